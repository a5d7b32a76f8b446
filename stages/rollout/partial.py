"""Partial rollouts: generation cut into segments so that a weight push can land between them.

The fully asynchronous mode (stages/rl_async.py) pushes new weights while rollouts are in flight. Each engine call
generates at most `segment_tokens` tokens per sample; a sample that reached that budget continues in the next call
from its prompt plus everything generated so far, with whatever weights the engine holds by then. Every token
records the policy version of the call that produced it (`RolloutOutput.extra["versions"]`), and its logprob is
that version's: the rollout logprobs stay exact for rollout correction.

Samples of one call that reach the segment budget all have the same length, so each continuation call has one
`max_tokens`; a sample the engine ended at its max_model_len (shorter, or exactly at the segment's end) is finished.
Continuations are one sample per prompt (n=1), seeded by the segment (`seed + segment * 7919`), so a run with
partial rollouts samples differently from one without (the same in distribution). Engines with a prefix cache
(vLLM; the cuda engine's park when on) reuse the continued prefix's K/V.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from stages.rollout.base import RolloutOutput, SamplingParams

# one engine call -> (outputs, the policy version that produced them)
VersionedCall = Callable[[list[list[int]], SamplingParams], tuple[list[RolloutOutput], int]]
SEGMENT_SEED_STRIDE = 7919


@dataclass
class _Partial:
    prompt_index: int
    response_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    extra: dict

    def extend(self, out: RolloutOutput, version: int) -> None:
        self.response_ids += out.response_ids
        self.logprobs += out.logprobs
        self.versions += [version] * len(out.response_ids)
        self.finish_reason = out.finish_reason

    def output(self) -> RolloutOutput:
        return RolloutOutput(self.prompt_index, self.response_ids, self.logprobs, self.finish_reason,
                             {**self.extra, "versions": self.versions})


def versioned(outputs: list[RolloutOutput], version: int) -> list[RolloutOutput]:
    """Outputs of one engine call, every token tagged with the call's policy version."""
    return [replace(o, extra={**o.extra, "versions": [version] * len(o.response_ids)}) for o in outputs]


def generate_in_segments(call: VersionedCall, prompt_ids: list[list[int]], params: SamplingParams,
                         segment_tokens: int, max_model_len: int | None = None) -> list[RolloutOutput]:
    """`params.n` samples per prompt (prompt-major, as one engine call returns them), generated at most
    `segment_tokens` tokens per call; each output's extra["versions"] holds its tokens' policy versions.
    max_model_len: the engine's; a sample whose prompt and tokens fill it is finished."""
    first = replace(params, max_tokens=min(segment_tokens, params.max_tokens))
    outs, version = call(prompt_ids, first)
    samples = [_Partial(o.prompt_index, list(o.response_ids), list(o.logprobs), [version] * len(o.response_ids),
                        o.finish_reason, dict(o.extra)) for o in outs]
    segment, done = 1, first.max_tokens  # tokens every sample still live has generated
    while True:
        # live: cut by the segment budget alone; a "length" sample shorter than `done`, or one that fills
        # max_model_len at `done`, reached the engine's max_model_len (a tool loop's call has its largest sample's
        # budget), and sending it back would fail there
        live = [s for s in samples if s.finish_reason == "length" and len(s.response_ids) == done
                and (max_model_len is None or len(prompt_ids[s.prompt_index]) + done < max_model_len)]
        if not live or done >= params.max_tokens:
            return [s.output() for s in samples]
        seed = None if params.seed is None else params.seed + segment * SEGMENT_SEED_STRIDE
        more = replace(params, n=1, seed=seed, max_tokens=min(segment_tokens, params.max_tokens - done))
        outs, version = call([prompt_ids[s.prompt_index] + s.response_ids for s in live], more)
        for out in outs:
            live[out.prompt_index].extend(out, version)
        segment, done = segment + 1, done + more.max_tokens
