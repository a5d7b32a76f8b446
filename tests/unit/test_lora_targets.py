"""LoRA targets the merge cannot fold into plain HF weights are a config error, not a silently dropped adapter.

The merge (stages/model/fsdp.py `hf_weights`) adds scale * B @ A to linear weights. An adapter on embed_tokens
(peft's lora_embedding_A/B) was left out of merged models and weight syncs with no message (logits off by 1.4), or
failed with a KeyError beside a linear target; one on an lm_head tied to the embeddings would untie them.
"""

from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM, Qwen2Config

from infra.config_sections import LoraConfig
from stages.model.loading import apply_lora

SMALL = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2}


def lora(targets, tied: bool = True):
    model = AutoModelForCausalLM.from_config(Qwen2Config(**SMALL, tie_word_embeddings=tied))
    return apply_lora(model, LoraConfig(rank=4, alpha=8, target_modules=targets))


@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`")
@pytest.mark.parametrize("targets, tied, message", [
    (["embed_tokens"], False, "embed_tokens is a Embedding"),
    (["embed_tokens", "q_proj"], False, "embed_tokens is a Embedding"),
    (["lm_head", "q_proj"], True, "tied to the input embeddings"),
])
def test_targets_the_merge_cannot_fold_name_the_field(targets, tied, message):
    with pytest.raises(ValueError, match=rf"lora.target_modules=.*{message}.*target the linear layers only"):
        lora(targets, tied)


def test_linear_targets_and_an_untied_head_are_accepted():
    assert lora("all-linear") is not None
    assert lora(["lm_head", "q_proj"], tied=False) is not None
