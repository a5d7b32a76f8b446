"""The engines that run in this process without vLLM: `cuda` (ours) or `hf` (transformers generate).

Shared by the RL workers (`rl.rollout.engine`) and evaluation (`evaluate.engine`). A model the `cuda`
engine cannot compute gets the transformers path with one warning, never wrong numbers.
"""

from __future__ import annotations

import logging

import torch

from infra.config_sections import ModelConfig
from stages.model.loading import load_model, load_tokenizer
from stages.rollout.cuda_weights import unsupported

logger = logging.getLogger(__name__)


def local_engine(kind: str, model_dir: str, model_cfg: ModelConfig, *, max_model_len: int, max_num_seqs: int,
                 setting: str, prefix_cache_rows: int = 0, hf_batch_size: int = 64, quantization: str | None = None,
                 free_cache: bool | None = False, tensor_parallel_group=None):
    """`kind` 'cuda' or 'hf'; `setting` names the config field in the fallback warning; `quantization`,
    `free_cache` (release_memory_on_sleep) and `tensor_parallel_group`: the cuda engine's."""
    tokenizer = load_tokenizer(model_dir, model_cfg.trust_remote_code)
    model = load_model(model_dir, model_cfg, trainable=False)
    on_gpu = torch.cuda.is_available()
    problem = unsupported(model.config) if kind == "cuda" else None
    if problem and tensor_parallel_group is not None:
        raise ValueError(f"{setting}=cuda cannot run this model ({problem}), and its fallback (transformers) has no "
                         "tensor parallelism: use rl.rollout.engine=vllm or rl.rollout.tensor_model_parallel_size=1")
    if problem:
        logger.warning("%s=cuda cannot run this model (%s): generating with transformers (the hf engine) instead",
                       setting, problem)
    if kind == "cuda" and not problem:
        from stages.rollout.cuda_engine import CudaRolloutEngine

        # The engine copies the weights into its own fused layout (the HF model is not kept) and holds a
        # static KV cache of max_num_seqs rows x max_model_len positions; bf16 on GPU, the model's dtype
        # (fp32 in the CPU tests) elsewhere.
        return CudaRolloutEngine(model, tokenizer.eos_token_id, max_num_seqs=max_num_seqs,
                                 max_model_len=max_model_len, device="cuda" if on_gpu else "cpu",
                                 dtype=torch.bfloat16 if on_gpu else None, prefix_cache_rows=prefix_cache_rows,
                                 quantization=quantization, release_memory_on_sleep=free_cache,
                                 tensor_parallel_group=tensor_parallel_group)
    from stages.rollout.hf import HFRolloutEngine

    if on_gpu:
        model = model.cuda()
    return HFRolloutEngine(model, tokenizer.pad_token_id, tokenizer.eos_token_id, hf_batch_size)
