"""Rollout with vLLM's offline `LLM`, run in-process (no engine subprocess), with in-place weight sync.

The engine lives in the caller's process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so a trainer there can
hand it new weights without a restart: `update_weights` serialises an HF-named state dict to safetensors
bytes and the worker extension in `vllm_ext.py` reloads it through vLLM's own `load_weights`. vLLM is
imported lazily, so this module imports on machines without it.

Stopping matches `HFRolloutEngine`: a sample ends at the first of `params.stop_token_ids` (default: the
model's EOS ids from generation_config.json and the tokenizer), which is kept as the last response id
with its logprob; vLLM's own EOS handling is switched off (`ignore_eos`) so that explicit stop ids
replace the EOS rather than add to it.

Logprobs come from `logprobs_mode="processed_logprobs"`: log_softmax of the logits after temperature
and after top-k/top-p masking, taken at the sampled token. With top_k=-1 and top_p=1 (the RL default)
that is exactly the convention of `base.py`, log softmax(logits / T); greedy requests skip temperature,
so they get log softmax(logits) (T=1), also as the convention says. Deviation: with top_k > 0 or
top_p < 1 the value is renormalised over the kept tokens, i.e. it exceeds the convention's by
-log(kept probability mass) >= 0 at that position; no vLLM mode returns the unfiltered value at T != 1.
On CUDA this mode makes vLLM use its PyTorch sampler instead of FlashInfer's.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import safetensors
import safetensors.torch
import torch

from stages.model.loading import stop_token_ids
from stages.rollout.base import RolloutOutput, SamplingParams

logger = logging.getLogger(__name__)

EXTENSION_CLS = "stages.rollout.vllm_ext.WeightSyncExtension"
LOGPROBS_MODE = "processed_logprobs"


CPU_BATCHED_TOKENS = 1 << 17


def _unlink_shm_names(tensor_parallel_size: int) -> None:
    """Remove the /dev/shm names of this rank's tensor-parallel group (vLLM names them after the group's ranks
    only, e.g. `-tp:0-[0-1]-cpushm_0`), between barriers over the workers' world. Called before the engine
    starts (a name left by killed workers makes the start fail with EEXIST) and after every rank has
    mapped the segments (their mappings live on; killed workers then leave nothing behind)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    first = rank - rank % tensor_parallel_size
    ranks = "-".join(str(r) for r in range(first, first + tensor_parallel_size))
    dist.barrier()
    for path in Path("/dev/shm").iterdir():
        if f"-[{ranks}]-cpushm_" in path.name:
            path.unlink(missing_ok=True)
    dist.barrier()


@contextmanager
def _without_proxy_modules():
    """Hide modules holding werkzeug LocalProxy objects (Flask's `current_app`, ...) while vLLM starts.

    vLLM's CPU platform scans every attribute of every loaded module with `hasattr`, and a LocalProxy outside
    an app context raises RuntimeError there (only AttributeError is swallowed). Flask gets loaded by, e.g.,
    moto's S3 server in the same process. `type(v)` does not touch the proxy, so the check itself is safe.
    """
    hidden = {name: module for name, module in list(sys.modules.items())
              if any(type(v).__name__ == "LocalProxy" for v in list(getattr(module, "__dict__", {}).values()))}
    for name in hidden:
        del sys.modules[name]
    try:
        yield
    finally:
        sys.modules.update(hidden)


def checkpoint_layout(pairs: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Runtime (transformers 5) names and tensors -> the checkpoint's, which vLLM's loaders read: mixture-of-experts
    layers hold their experts fused (`mlp.experts.gate_up_proj` (E, 2I, H), `mlp.experts.down_proj` (E, H, I)),
    checkpoints one tensor per expert and projection (`mlp.experts.{e}.gate_proj.weight`, ...)."""
    for name, tensor in pairs:
        if name.endswith(".experts.gate_up_proj"):
            prefix, half = name.removesuffix("gate_up_proj"), tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                yield f"{prefix}{e}.gate_proj.weight", tensor[e, :half]
                yield f"{prefix}{e}.up_proj.weight", tensor[e, half:]
        elif name.endswith(".experts.down_proj"):
            prefix = name.removesuffix("down_proj")
            for e in range(tensor.shape[0]):
                yield f"{prefix}{e}.down_proj.weight", tensor[e]
        else:
            yield name, tensor


class VLLMRolloutEngine:
    """An in-process vLLM engine behind the `RolloutEngine` interface."""

    def __init__(self, model_dir: str | Path, *, dtype: str = "float32", seed: int = 0, max_model_len: int = 1024,
                 enforce_eager: bool = True, gpu_memory_utilization: float = 0.5, enable_sleep_mode: bool = False,
                 external_launcher: bool = False, max_num_seqs: int = 256, tensor_parallel_size: int = 1):
        """`external_launcher`: join the torch.distributed world this process already belongs to (RANK and
        LOCAL_RANK set, as torchrun does) instead of creating one. vLLM then groups consecutive ranks by
        `tensor_parallel_size` (its "external data parallel" layout): each group is one engine whose ranks
        must call `generate` together with the same prompts, and the groups generate independently
        (data-parallel rollout next to FSDP training in that world)."""
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process: weight sync and a shared gloo group
        if not torch.cuda.is_available():
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM refuses to size it from NUMA
        import vllm

        self._vllm = vllm
        self.model_dir = Path(model_dir)
        self.seed = seed
        self.enable_sleep_mode = enable_sleep_mode
        self._num_generate_calls = 0
        # CPU: a seeded request whose prefill is split across scheduler steps fails ("CPU Generator does
        # not use offset"), so give the scheduler a budget large enough that prefills are never chunked.
        budget = {} if torch.cuda.is_available() else {"max_num_batched_tokens": CPU_BATCHED_TOKENS}
        if external_launcher:
            budget["distributed_executor_backend"] = "external_launcher"
        cpu_shm = external_launcher and tensor_parallel_size > 1 and not torch.cuda.is_available()
        if cpu_shm:  # vLLM's CPU tensor parallel talks through /dev/shm segments named after the group's ranks
            _unlink_shm_names(tensor_parallel_size)
        with _without_proxy_modules():
            self.llm = vllm.LLM(
                model=str(self.model_dir), dtype=dtype, seed=seed, max_model_len=max_model_len,
                enforce_eager=enforce_eager, gpu_memory_utilization=gpu_memory_utilization, max_num_seqs=max_num_seqs,
                tensor_parallel_size=tensor_parallel_size,
                enable_sleep_mode=enable_sleep_mode, logprobs_mode=LOGPROBS_MODE, worker_extension_cls=EXTENSION_CLS,
                **budget,
            )
        if cpu_shm:
            _unlink_shm_names(tensor_parallel_size)
        self.stop_token_ids = stop_token_ids(self.model_dir, self.llm.get_tokenizer().eos_token_id)
        hf_config = self.llm.llm_engine.model_config.hf_config
        self._tied = bool(getattr(hf_config, "tie_word_embeddings", False))
        self._checkpoint_names = checkpoint_names(self.model_dir)
        logger.info("vLLM engine ready: %s dtype=%s stop_token_ids=%s tied=%s", self.model_dir, dtype,
                    self.stop_token_ids, self._tied)

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> list[RolloutOutput]:
        """Sample `params.n` responses per prompt; outputs are prompt-major (prompt i's samples consecutive)."""
        if not prompt_ids:
            return []
        stop_ids = set(params.stop_token_ids or self.stop_token_ids)
        seeds = self._request_seeds(len(prompt_ids), params.seed)
        requests = self.llm.generate(
            [{"prompt_token_ids": list(ids)} for ids in prompt_ids],
            [self._vllm_params(params, sorted(stop_ids), seed) for seed in seeds],
            use_tqdm=False,
        )
        outputs = []
        for prompt_index, request in enumerate(requests):
            for sample in sorted(request.outputs, key=lambda s: s.index):
                outputs.append(_to_rollout_output(sample, prompt_index, stop_ids))
        return outputs

    def update_weights(self, state: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load full (unsharded) HF-named weights into the engine and drop the now stale prefix cache.

        Every tensor of the model's checkpoint must be present (a partial reload would leave layers
        half-processed); for tied embeddings `lm_head.weight` is added as a copy of the embedding,
        without which vLLM's reloaded output head is wrong. `state` may also be an iterable of (name,
        tensor) pairs (e.g. gathered layer by layer from sharded parameters): it is consumed lazily by
        vLLM's layer-wise reload, so the full model never exists twice; such a stream must include
        `lm_head.weight` for tied models, and a name it lacks is an error after loading.
        """
        if not isinstance(state, Mapping):
            self._update_weights_stream(checkpoint_layout(state))
            return
        state = dict(checkpoint_layout(state.items()))
        allowed = self._checkpoint_names | ({"lm_head.weight"} if self._tied else set())
        missing, unexpected = sorted(self._checkpoint_names - state.keys()), sorted(state.keys() - allowed)
        if missing or unexpected:
            raise ValueError(f"update_weights: state does not match the checkpoint in {self.model_dir}: "
                             f"missing={missing[:5]} unexpected={unexpected[:5]}; pass the full HF-named "
                             "state dict (merge LoRA adapters first)")
        blob = to_safetensors_bytes(state, tie_lm_head=self._tied)
        self.llm.collective_rpc("load_safetensors_weights", args=(blob,))
        self.llm.reset_prefix_cache()

    def _update_weights_stream(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> None:
        """In-process only (a generator cannot cross to an engine subprocess)."""
        expected = self._checkpoint_names | ({"lm_head.weight"} if self._tied else set())
        seen: set[str] = set()

        def checked():
            for name, tensor in pairs:
                if name not in expected:
                    raise ValueError(f"update_weights: {name!r} is not a tensor of the checkpoint in {self.model_dir}")
                seen.add(name)
                yield name, tensor

        self.llm.collective_rpc("load_weight_stream", args=(checked(),))
        self.llm.reset_prefix_cache()
        if missing := sorted(expected - seen):
            raise ValueError(f"update_weights: the weight stream lacked {missing[:5]}; the engine is now "
                             "inconsistent: pass every HF-named tensor (merge LoRA adapters first)")

    def param_count(self) -> int:
        """Parameters held by this process's part of the engine (all of them at tensor parallel size 1)."""
        return self.llm.collective_rpc("param_count")[0]

    def sleep(self) -> None:
        """Offload weights and free the KV cache (CUDA with `enable_sleep_mode`); otherwise nothing."""
        if self.enable_sleep_mode:
            self.llm.sleep(level=1)

    def wake(self) -> None:
        if self.enable_sleep_mode:
            self.llm.wake_up()
            self.llm.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stop the engine and tear down the torch.distributed world vLLM created in this process."""
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        self.llm.llm_engine.engine_core.shutdown()
        cleanup_dist_env_and_memory()

    def _request_seeds(self, num_prompts: int, seed: int | None) -> list[int]:
        """One seed per prompt, from `seed` when given, else from (engine seed, number of such calls so far):
        calls differ, and a fresh engine with the same seed repeats them.

        vLLM gives sample j of a prompt the seed `seed + j`, so seeds are drawn far apart (< 2**31).
        """
        if seed is None:
            seed = [self.seed, self._num_generate_calls]
            self._num_generate_calls += 1
        return np.random.default_rng(seed).integers(0, 2**31 - 2**16, size=num_prompts).tolist()

    def _vllm_params(self, params: SamplingParams, stop_ids: list[int], seed: int):
        return self._vllm.SamplingParams(
            n=params.n,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else 0,  # vLLM: 0 disables
            max_tokens=params.max_tokens,
            stop_token_ids=stop_ids,
            ignore_eos=True,  # stop_ids already hold the EOS unless the caller replaced it
            logprobs=0,  # the sampled token's logprob only
            seed=seed,
            detokenize=False,
        )


def _to_rollout_output(sample, prompt_index: int, stop_ids: set[int]) -> RolloutOutput:
    ids = list(sample.token_ids)
    logprobs = [position[token].logprob for position, token in zip(sample.logprobs, ids, strict=True)]
    if sample.finish_reason not in ("stop", "length"):
        raise RuntimeError(f"vLLM finished a sample with {sample.finish_reason!r} (expected stop or length)")
    assert sample.finish_reason == "length" or ids[-1] in stop_ids, "vLLM must keep the stop token"
    return RolloutOutput(prompt_index, ids, logprobs, sample.finish_reason)


def checkpoint_names(model_dir: str | Path) -> set[str]:
    """The tensor names in the model folder's safetensors files (HF names, without tied duplicates)."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors in {model_dir}: VLLMRolloutEngine needs a safetensors checkpoint")
    names: set[str] = set()
    for file in files:
        with safetensors.safe_open(str(file), framework="pt") as f:
            names.update(f.keys())
    return names


def to_safetensors_bytes(state: dict[str, torch.Tensor], tie_lm_head: bool) -> bytes:
    """Serialise CPU copies of `state`; tensors sharing storage (tied weights) are cloned, as safetensors
    refuses shared memory, and `lm_head.weight` is added from the embedding when `tie_lm_head`."""
    tensors, seen = {}, set()
    for name, tensor in state.items():
        tensor = tensor.detach().to("cpu").contiguous()
        storage = tensor.untyped_storage().data_ptr()
        tensors[name] = tensor.clone() if storage in seen else tensor
        seen.add(storage)
    if tie_lm_head and "lm_head.weight" not in tensors:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    return safetensors.torch.save(tensors)
