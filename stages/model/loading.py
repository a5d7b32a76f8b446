"""Load a Hugging Face causal LM and its tokenizer (+ peft LoRA), and save one as a plain HF folder.

`path` is a local folder (e.g. an artifact fetched from the store) or a hub id. Hub ids are resolved by
transformers as usual; nothing here special-cases the tiny models, which are ordinary local folders.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import jinja2
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from infra.config_sections import LoraConfig, ModelConfig

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_tokenizer(path: str | Path, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
        logger.warning("tokenizer at %s has no pad token; using eos %r", path, tokenizer.eos_token)
    if tokenizer.chat_template is None:
        raise ValueError(f"tokenizer at {path} has no chat_template; model.path must point to a chat model")
    return tokenizer


def compute_dtype(cfg: ModelConfig) -> torch.dtype | None:
    """What a trained model computes in, when not in its fp32 master weights: `model.dtype` (FSDP2 mixed
    precision casts the weights for each forward; optimizer state and updates stay fp32)."""
    return None if cfg.dtype == "float32" else DTYPES[cfg.dtype]


def load_model(path: str | Path, cfg: ModelConfig, *, trainable: bool = True) -> PreTrainedModel:
    """The causal LM at `path` in `cfg.dtype`, wrapped with LoRA when `cfg.lora` is set and trainable."""
    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=DTYPES[cfg.dtype], trust_remote_code=cfg.trust_remote_code
    )
    if trainable and cfg.lora is not None:
        model = apply_lora(model, cfg.lora)
    if trainable and cfg.gradient_checkpointing:
        enable_checkpointing(model)
    if not trainable:
        model.requires_grad_(False).eval()
    return model


def apply_lora(model: PreTrainedModel, cfg: LoraConfig) -> PreTrainedModel:
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    peft_cfg = PeftLoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=cfg.target_modules,
        task_type="CAUSAL_LM",
    )
    tied = model.config.get_text_config().tie_word_embeddings
    peft_model = get_peft_model(model, peft_cfg)
    problem = _lora_target_problem(peft_model, tied)
    if problem:
        raise ValueError(f"lora.target_modules={cfg.target_modules!r}: {problem}; target the linear layers only "
                         "(e.g. all-linear, or q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj)")
    return peft_model


def _lora_target_problem(peft_model, tied: bool) -> str | None:
    """Why the merge (stages/model/fsdp.py `hf_weights`: W + scale * B @ A per linear layer) could not fold these
    adapters into plain HF weights (None: it can)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    head = peft_model.get_base_model().get_output_embeddings()
    for name, module in peft_model.named_modules():
        if not isinstance(module, BaseTunerLayer):
            continue
        base = module.get_base_layer()
        if type(base) is not torch.nn.Linear:
            return f"{name} is a {type(base).__name__}, which the merge cannot fold an adapter into"
        if tied and base is getattr(head, "base_layer", head):
            return f"{name} is the output layer, tied to the input embeddings (an adapter would untie them)"
    return None


def enable_checkpointing(model) -> None:
    """Recompute each decoder layer's activations in backward (a LoRA-wrapped model too)."""
    hf = model.get_base_model() if hasattr(model, "get_base_model") else model
    hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    hf.config.use_cache = False
    if hf is not model:
        model.enable_input_require_grads()  # checkpointed blocks need an input that requires grad


def unwrap_merged(model: PreTrainedModel) -> PreTrainedModel:
    """A plain transformers model: LoRA weights merged into a copy of the base when peft is used."""
    if hasattr(model, "merge_and_unload"):
        import copy

        return copy.deepcopy(model).merge_and_unload()
    return model


def save_hf_folder(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, out_dir: str | Path) -> Path:
    """Save as a plain HF folder (safetensors, config, tokenizer with chat template, generation config)."""
    out = Path(out_dir)
    plain = unwrap_merged(model)
    plain.config.use_cache = True
    plain.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def stop_token_ids(model_dir: str | Path, tokenizer_eos_id: int | None) -> tuple[int, ...]:
    """The ids generation stops at, as vLLM's defaults (and so verl's rollouts): generation_config.json's
    `eos_token_id` (int or list: Llama 3.1's <|eot_id|>, <|eom_id|> and <|end_of_text|>, Qwen2.5-Instruct's
    <|im_end|> and <|endoftext|>) and the tokenizer's EOS."""
    ids = set() if tokenizer_eos_id is None else {tokenizer_eos_id}
    path = Path(model_dir) / "generation_config.json"
    if path.exists():
        eos = json.loads(path.read_text()).get("eos_token_id")
        ids |= {eos} if isinstance(eos, int) else set(eos or ())
    if not ids:
        raise ValueError(f"no EOS token id in {model_dir} (generation_config.json or tokenizer); "
                         "pass SamplingParams.stop_token_ids")
    return tuple(sorted(ids))


def chat_prompt_ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict],
                    tools: list[dict] | None = None) -> list[int]:
    """Token ids of `messages` through the chat template, ending with the assistant turn's header; `tools` (OpenAI
    function schemas) rendered where the template puts them (Qwen's: a system block), as verl's tool agent loop."""
    text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def tool_turn_ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict]) -> list[int]:
    """Token ids of tool messages plus the next assistant header, as the chat template renders them after an
    assistant turn that ended with the end-of-turn token (which the model's own ids already hold)."""
    return _turn_delta_ids(tokenizer, messages)


def user_turn_ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Token ids of one user message plus the next assistant header, rendered after an assistant turn as
    `tool_turn_ids` renders tool messages (a simulated user's reply in a multi-turn rollout). The probe renders it
    after a user turn, as verl does; templates that refuse two user turns in a row (Gemma's, Llama 2's) after a
    user and an assistant turn. Not that first: Qwen3's template gives the last assistant turn an empty think
    block only while no user turn follows it, so that probe is no prefix of itself plus the user turn."""
    message = [{"role": "user", "content": text}]
    try:
        return _turn_delta_ids(tokenizer, message)
    except jinja2.TemplateError:  # raise_exception in the template: roles must alternate
        return _turn_delta_ids(tokenizer, message,
                               [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}])


def _turn_delta_ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict],
                    base: list[dict] | None = None) -> list[int]:
    """What the chat template appends for `messages` (and the next assistant header) after a finished turn."""
    base = base or [{"role": "user", "content": "x"}]
    before = tokenizer.apply_chat_template(base, tokenize=False)
    after = tokenizer.apply_chat_template(base + messages, add_generation_prompt=True, tokenize=False)
    if not after.startswith(before):
        raise ValueError("the chat template renders earlier messages differently once tool or user messages "
                         "follow; multi-turn rollouts need a template that only appends")
    eos = tokenizer.eos_token or ""
    separator = before[before.rindex(eos) + len(eos):] if eos and eos in before else ""
    delta = separator + after[len(before):]
    ids_of = lambda text, **kw: tokenizer(text, add_special_tokens=False, **kw)["input_ids"]  # noqa: E731
    contents = [str(m.get("content") or "") for m in messages]
    specials = [t for t in tokenizer.all_special_tokens if t]
    if not any(t in c for c in contents for t in specials):
        return ids_of(delta)
    # A content holds a control token's text (a tool's output or a user's text with `<|im_end|>\n<|im_start|>
    # assistant`): tokenized with the template, it would become real control tokens and forge turns in the context
    # the model trains on. The contents are tokenized as plain text (`split_special_tokens`), the template's own
    # text around them as before; placeholders find them. A template that changes a content (trims it, say) cannot
    # be split this way: then it stays as the template renders it.
    marks = [f"\ue000{i}\ue001" for i in range(len(messages))]
    marked = tokenizer.apply_chat_template(base + [{**m, "content": k} for m, k in zip(messages, marks)],
                                           add_generation_prompt=True, tokenize=False)[len(before):]
    filled = marked
    for mark, content in zip(marks, contents):
        filled = filled.replace(mark, content)
    if any(marked.count(mark) != 1 for mark in marks) or separator + filled != delta:
        return ids_of(delta)
    ids: list[int] = []
    rest = separator + marked
    for mark, content in zip(marks, contents):
        head, _, rest = rest.partition(mark)
        ids += ids_of(head) + ids_of(content, split_special_tokens=True)
    return ids + ids_of(rest)
