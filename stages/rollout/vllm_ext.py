"""The vLLM worker extension that loads new weights in place (mixed into vLLM's worker class).

vLLM imports this module inside its worker by dotted path (`worker_extension_cls`), so it imports only
torch and safetensors. Weights travel as one safetensors blob: `collective_rpc` would turn a dict of
tensors into nested lists.
"""

from __future__ import annotations

import safetensors.torch


class WeightSyncExtension:
    """Methods that `LLM.collective_rpc` can call on every worker; `self` is the vLLM worker."""

    def load_safetensors_weights(self, blob: bytes) -> int:
        """Load HF-named weights from safetensors bytes into the running model; return how many tensors.

        `reload_weights` goes through the model's own `load_weights` (fusing q/k/v and gate/up, repacking
        for the CPU kernels), which is why calling `model.load_weights` directly is not enough.
        """
        state = safetensors.torch.load(blob)
        self.model_runner.reload_weights(weights_iterator=iter(state.items()))
        return len(state)

    def load_weight_stream(self, weights) -> None:
        """Load HF-named (name, tensor) pairs from an iterator, consumed layer by layer (in-process engines)."""
        self.model_runner.reload_weights(weights_iterator=weights)

    def param_count(self) -> int:
        """Parameters this worker's model holds (a tensor-parallel rank holds its shards)."""
        return sum(p.numel() for p in self.model_runner.model.parameters())
