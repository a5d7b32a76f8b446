"""Rollout with transformers' `generate` (the portable engine; vLLM is the fast one on CPU and GPU).

Prompts are left-padded into batches of `batch_size`; each prompt's `n` samples come from
`num_return_sequences`. A sample ends at the first stop token (kept in the response) or at max_tokens.
Decoding follows `SamplingParams` alone, as vLLM's and the cuda engine's: the model folder's
generation_config.json (a repetition penalty, a minimum length, suppressed tokens) does not apply.
Calls from several threads run one at a time: the model's generation_config is swapped for each call.

Logprobs: log_softmax(raw logits / logprob_temperature) at the sampled token, taken one step at a time by a
logits processor (`_TokenLogprobs`), which transformers runs before its temperature and top-k/top-p warpers; only
one step's (rows, vocab) is held, not every step's logits (`output_logits` kept rows x tokens x vocab floats on the
device: hundreds of GiB for a real vocabulary at RL batch sizes).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from contextlib import contextmanager

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList, PreTrainedModel

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
        recorder = _TokenLogprobs(params.logprob_temperature)
        sequences = self.model.generate(
            input_ids=input_ids.to(device),
            attention_mask=attention_mask.to(device),
            do_sample=not params.greedy,
            num_return_sequences=params.n,
            max_new_tokens=params.max_tokens,
            eos_token_id=stop_ids,
            pad_token_id=self.pad_token_id,
            logits_processor=LogitsProcessorList([recorder]),
            **sampling,
        )
        new_tokens = sequences[:, width:].cpu()  # (B*n, L)
        token_logprobs = recorder.finish(sequences).cpu()  # (B*n, L)
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
        tied = getattr(self.model.config, "tie_word_embeddings", False)  # a tied head is the embedding: not sent
        missing = [k for k in targets if k not in seen and not (tied and k.startswith("lm_head."))]
        if unexpected or missing:
            raise ValueError(f"weight sync mismatch: missing={missing[:5]} unexpected={unexpected[:5]}")

    def sleep(self) -> None:
        pass

    def wake(self) -> None:
        pass


class _TokenLogprobs(LogitsProcessor):
    """Each sampled token's log_softmax(raw logits / temperature), one step behind: at a step, the last input id is
    the token sampled at the step before, whose distribution was kept."""

    def __init__(self, temperature: float):
        self.temperature = temperature
        self.previous: torch.Tensor | None = None  # (rows, V) log-probabilities of the step before
        self.values: list[torch.Tensor] = []  # (rows,) per step

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self._take(input_ids[:, -1:])
        self.previous = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        return scores

    def _take(self, tokens: torch.Tensor) -> None:
        if self.previous is not None:
            self.values.append(self.previous.gather(-1, tokens).squeeze(-1))

    def finish(self, sequences: torch.Tensor) -> torch.Tensor:
        """(rows, steps) with the last step's token (no step came after it to take it)."""
        self._take(sequences[:, -1:])
        self.previous = None
        return torch.stack(self.values, dim=1)


def _trim(tokens: torch.Tensor, logprobs: torch.Tensor, stop_ids: set[int], prompt_index: int) -> RolloutOutput:
    ids = tokens.tolist()
    end = next((i for i, t in enumerate(ids) if t in stop_ids), None)
    if end is None:
        return RolloutOutput(prompt_index, ids, logprobs.tolist(), "length")
    return RolloutOutput(prompt_index, ids[: end + 1], logprobs[: end + 1].tolist(), "stop")
