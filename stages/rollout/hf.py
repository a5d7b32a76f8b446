"""Rollout with transformers' `generate` (the portable engine; vLLM is the fast one on CPU and GPU).

Prompts are left-padded into batches of `batch_size`; each prompt's `n` samples come from
`num_return_sequences`. A sample ends at the first stop token (kept in the response) or at max_tokens.
Decoding follows `SamplingParams` alone, as vLLM's and the cuda engine's: the model folder's
generation_config.json (a repetition penalty, a minimum length, suppressed tokens) does not apply.
Calls from several threads run one at a time: the model's generation_config is swapped for each call.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from contextlib import contextmanager

import torch
from transformers import GenerationConfig, PreTrainedModel

from stages.rollout.base import RolloutOutput, SamplingParams


class HFRolloutEngine:
    def __init__(self, model: PreTrainedModel, pad_token_id: int, eos_token_id: int, batch_size: int = 64):
        self.model = model.eval()
        self.pad_token_id = pad_token_id
        self.eos_token_id = eos_token_id
        self.batch_size = batch_size
        self._lock = threading.Lock()  # one generate at a time: each swaps the model's generation_config

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> list[RolloutOutput]:
        outputs: list[RolloutOutput] = []
        with self._lock, self._plain_generation_config():
            if params.seed is not None:
                torch.manual_seed(params.seed)
            for start in range(0, len(prompt_ids), self.batch_size):
                chunk = prompt_ids[start : start + self.batch_size]
                outputs.extend(self._generate_batch(chunk, params, start))
        return outputs

    def _generate_batch(self, prompts: list[list[int]], params: SamplingParams, offset: int) -> list[RolloutOutput]:
        device = next(self.model.parameters()).device
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for i, p in enumerate(prompts):
            input_ids[i, width - len(p) :] = torch.tensor(p)
            attention_mask[i, width - len(p) :] = 1
        stop_ids = list(params.stop_token_ids) or [self.eos_token_id]
        sampling = {} if params.greedy else {
            "temperature": params.temperature, "top_p": params.top_p,
            "top_k": params.top_k if params.top_k > 0 else None,
        }
        out = self.model.generate(
            input_ids=input_ids.to(device),
            attention_mask=attention_mask.to(device),
            do_sample=not params.greedy,
            num_return_sequences=params.n,
            max_new_tokens=params.max_tokens,
            eos_token_id=stop_ids,
            pad_token_id=self.pad_token_id,
            output_logits=True,
            return_dict_in_generate=True,
            **sampling,
        )
        new_tokens = out.sequences[:, width:].cpu()  # (B*n, L)
        logits = torch.stack(out.logits, dim=1).float().cpu()  # (B*n, L, V)
        logprobs = torch.log_softmax(logits / params.logprob_temperature, dim=-1)
        token_logprobs = logprobs.gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)  # (B*n, L)
        return [
            _trim(new_tokens[row], token_logprobs[row], set(stop_ids), offset + row // params.n)
            for row in range(new_tokens.shape[0])
        ]

    @contextmanager
    def _plain_generation_config(self):
        """transformers fills every setting a call leaves unset from the model's generation_config; during our
        calls that is the library's defaults (no penalties, processors or minimum length)."""
        saved, self.model.generation_config = self.model.generation_config, GenerationConfig()
        try:
            yield
        finally:
            self.model.generation_config = saved

    @torch.no_grad()
    def update_weights(self, state: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the model, from a dict or a stream of (name, tensor) pairs (consumed one
        at a time, so a stream gathered layer by layer never makes a second full copy)."""
        targets = self.model.state_dict(keep_vars=True)
        seen, unexpected = set(), []
        for name, tensor in state.items() if isinstance(state, Mapping) else state:
            if name in targets:
                targets[name].copy_(tensor)
                seen.add(name)
            else:
                unexpected.append(name)
        missing = [k for k in targets if k not in seen and "lm_head" not in k]
        if unexpected or missing:
            raise ValueError(f"weight sync mismatch: missing={missing[:5]} unexpected={unexpected[:5]}")

    def sleep(self) -> None:
        pass

    def wake(self) -> None:
        pass


def _trim(tokens: torch.Tensor, logprobs: torch.Tensor, stop_ids: set[int], prompt_index: int) -> RolloutOutput:
    ids = tokens.tolist()
    end = next((i for i, t in enumerate(ids) if t in stop_ids), None)
    if end is None:
        return RolloutOutput(prompt_index, ids, logprobs.tolist(), "length")
    return RolloutOutput(prompt_index, ids[: end + 1], logprobs[: end + 1].tolist(), "stop")
