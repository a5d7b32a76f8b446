"""Which architectures each fast path computes, and the checkpoint layout weight syncs send to vLLM.

Tiny random models built from transformers configs (no hub). The fast paths (the cuda engine, packed rows) must
name what they cannot compute, so that the workers fall back instead of computing wrong numbers.
"""

from __future__ import annotations

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, MistralConfig, Qwen3Config, Qwen3MoeConfig

from stages.model.packing import packing_unsupported
from stages.rollout.cuda_weights import unsupported
from stages.rollout.vllm_engine import checkpoint_layout

SMALL = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=64, head_dim=8)


def test_qwen3_moe_experts_split_into_the_checkpoints_tensors(tmp_path):
    config = Qwen3MoeConfig(**SMALL, num_experts=3, num_experts_per_tok=2, moe_intermediate_size=16)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(tmp_path)
    on_disk = load_file(str(tmp_path / "model.safetensors"))
    sent = dict(checkpoint_layout(model.state_dict().items()))
    assert set(sent) == set(on_disk)
    assert all(torch.equal(sent[name], tensor) for name, tensor in on_disk.items())
    assert "model.layers.1.mlp.experts.2.up_proj.weight" in sent


def test_fast_paths_name_what_they_cannot_compute():
    qwen3 = Qwen3Config(**SMALL)
    moe = Qwen3MoeConfig(**SMALL, num_experts=3, num_experts_per_tok=2, moe_intermediate_size=16)
    windowed = MistralConfig(**SMALL, sliding_window=16)
    assert unsupported(qwen3) is None and packing_unsupported(qwen3) is None
    assert unsupported(moe) == "model_type='qwen3_moe' (supported: qwen2, qwen3, llama)"
    assert packing_unsupported(moe) is None  # experts act per token: packing changes nothing
    assert unsupported(windowed).startswith("model_type='mistral'")
    assert packing_unsupported(windowed).startswith("model_type='mistral'")
    assert unsupported(Qwen3Config(**SMALL, use_sliding_window=True)) == "sliding-window attention"
    # the packed kernels drop nothing, while the padded path applies the config's attention dropout in training
    assert packing_unsupported(Qwen3Config(**SMALL, attention_dropout=0.1)) == "attention_dropout=0.1"
