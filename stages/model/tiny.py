"""Build a tiny Qwen2- or Llama-architecture model and a tokenizer offline, in seconds.

The tokenizer is a byte-level BPE trained with `tokenizers` on the task's own text, with single-digit
tokens (as Llama and Qwen do) so arithmetic is learnable, a ChatML chat template and the special tokens
`<|im_start|>`, `<|im_end|>` (end of turn, the EOS for generation), `<|endoftext|>` and `<|pad|>`.
The model is randomly initialised from a transformers config with a fixed seed. Both are saved as a
plain Hugging Face folder that transformers and vLLM load like any hub model.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

from infra.config_sections import TinyModelConfig

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE with individual digits, trained on `texts`; deterministic for the same texts."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(sorted(set(texts)), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        unk_token=None,
        chat_template=CHAT_TEMPLATE,
        model_max_length=1 << 20,
    )


def _model_config(cfg: TinyModelConfig, tokenizer: PreTrainedTokenizerFast):
    vocab = max((len(tokenizer) + 63) // 64 * 64, cfg.embedding_rows or 0)  # round up: friendlier kernel shapes
    common = dict(
        vocab_size=vocab,
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        intermediate_size=cfg.intermediate_size,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        rope_theta=10000.0,
    )
    if cfg.arch == "qwen2":
        return Qwen2Config(**common)
    if cfg.arch == "qwen3":
        return Qwen3Config(**common, head_dim=cfg.hidden_size // cfg.num_heads)
    if cfg.arch == "qwen3_moe":
        return Qwen3MoeConfig(**common, head_dim=cfg.hidden_size // cfg.num_heads, num_experts=4,
                              num_experts_per_tok=2, moe_intermediate_size=cfg.intermediate_size // 2)
    return LlamaConfig(**common, head_dim=cfg.hidden_size // cfg.num_heads)


def build_tiny_model(cfg: TinyModelConfig, texts: Iterable[str], seed: int, out_dir: str | Path) -> Path:
    """Train the tokenizer on `texts`, initialise the model with `seed`, save both to `out_dir`."""
    out = Path(out_dir)
    tokenizer = train_tokenizer(texts, cfg.vocab_size)
    config = _model_config(cfg, tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, do_sample=False
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
