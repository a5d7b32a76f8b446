"""The trainer's logprobs on models whose logits are more than hidden @ lm_head.weight.T.

The chunked head (stages/model/policy.py) computes hidden @ W.T; Gemma 2 soft-caps its logits, Granite divides them,
Phi's head has a bias and LoRA on lm_head adds an adapter. Each of those must get the model's own logprobs (they
took the plain projection's, with no error: the SFT loss of a soft-capped tiny Gemma 2 was 22.7 against its 14.2).
"""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, Gemma2Config, GraniteConfig, PhiConfig, Qwen2Config

from stages.model.policy import TokenLogprobs, head_problem

SMALL = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2}


def model_of(config) -> torch.nn.Module:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(30)  # logits of a trained model's size, where the extras matter
    return model


def reference(model, input_ids, r: int) -> torch.Tensor:
    """log p(token) from the model's own logits, (B, R)."""
    logits = model(input_ids=input_ids).logits[:, -r - 1 : -1].float()
    return logits.log_softmax(-1).gather(-1, input_ids[:, -r:, None])[..., 0]


def logprobs(model, input_ids, r: int) -> torch.Tensor:
    mask = torch.ones_like(input_ids)
    positions = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    return TokenLogprobs(model)(input_ids, mask, positions, r)[0]


CASES = {
    "gemma2 soft-caps": Gemma2Config(**SMALL, head_dim=8, final_logit_softcapping=2.0),
    "granite scales": GraniteConfig(**SMALL, logits_scaling=8.0),
    "phi has a bias": PhiConfig(**SMALL),
}


@pytest.mark.parametrize("name", CASES)
def test_logprobs_are_the_models_own(name):
    model = model_of(CASES[name])
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    assert head_problem(model) is not None
    torch.testing.assert_close(logprobs(model, ids, 4), reference(model, ids, 4), rtol=1e-5, atol=1e-5)


def test_lora_on_lm_head_is_trained_through_its_adapter():
    model = model_of(Qwen2Config(**SMALL))
    assert head_problem(model) is None  # a plain Qwen2 head takes the chunked path
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"], init_lora_weights=False)
    peft = get_peft_model(model, config)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    assert "LoRA on lm_head" in head_problem(peft)
    ours = logprobs(peft, ids, 4)
    torch.testing.assert_close(ours, reference(peft, ids, 4), rtol=1e-5, atol=1e-5)
    ours.sum().backward()
    head = peft.get_base_model().lm_head
    assert head.lora_B["default"].weight.grad.abs().sum() > 0


def test_packed_rows_refuse_an_output_layer_they_cannot_compute():
    with pytest.raises(ValueError, match="use_remove_padding=false"):
        TokenLogprobs(model_of(CASES["gemma2 soft-caps"]), pack=True)


def test_the_weight_sync_merges_lora_on_an_untied_lm_head():
    """The sync gathers the weights in buckets, one per decoder layer and else one per key: lm_head's base weight
    and its two adapters came in three buckets, and merging the first raised KeyError at the first weight sync
    (training and the merge stage, which read the whole state dict, worked)."""
    from stages.model.fsdp import hf_weights, init_process_group, iter_hf_weights, shard

    init_process_group()  # a world of one rank
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"], init_lora_weights=False)
    peft = get_peft_model(model_of(Qwen2Config(**SMALL, tie_word_embeddings=False)), config)
    head = peft.get_base_model().lm_head
    merged = (head.base_layer.weight + 2.0 * head.lora_B["default"].weight @ head.lora_A["default"].weight).detach()
    want = hf_weights({k: v.detach().clone() for k, v in TokenLogprobs(peft).state_dict().items()}, 8 / 4)
    synced = dict(iter_hf_weights(shard(TokenLogprobs(peft)), 8 / 4))
    assert list(synced) == list(want) and "lm_head.weight" in synced
    for name, value in want.items():
        torch.testing.assert_close(synced[name], value, rtol=0, atol=0, msg=name)
    torch.testing.assert_close(synced["lm_head.weight"], merged, rtol=1e-6, atol=1e-6)  # W + alpha / r * B @ A
