"""Agent loops: how one prompt row becomes `n` trajectories. Each row names its loop in `agent_name`.

An `AgentLoop` gets a batch of samples (the rows that named it) and a `LoopContext` (the engine's batched
`generate`, the tokenizer, the sampling parameters with `n`, the tools, the simulated users) and returns `n`
trajectories per sample, prompt-major. Loops are registered in `AGENT_LOOPS` under verl's names; `agent_loop(name)`
also takes `path/to/file.py:ClassName` or `package.module.ClassName` for a user's own loop (a subclass of AgentLoop).

`single_turn` is one batched engine call with `params.n` samples per prompt: exactly the call the RL loop,
validation and evaluation made before loops existed, so its results are unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from infra.imports import load_object
from stages.agent.trajectory import Trajectory
from stages.core.registry import Registry
from stages.rollout.base import PackedOutputs, RolloutOutput, SamplingParams

DEFAULT_LOOP = "single_turn"
GenerateFn = Callable[[list[list[int]], SamplingParams], Sequence[RolloutOutput]]  # a list, or PackedOutputs


@dataclass
class Sample:
    """One prompt row as a loop sees it."""

    prompt_index: int  # index into the rows given to Rollout.run
    prompt_ids: list[int]  # chat template applied, generation prompt added
    messages: list[dict]  # the row's chat list
    extra_info: dict = field(default_factory=dict)  # verl's extra_info (tools_kwargs, interaction_kwargs, ...)


@dataclass
class LoopContext:
    generate: GenerateFn  # batched: prompt ids + params -> outputs, prompt-major (n per prompt)
    tokenizer: Any
    params: SamplingParams
    tools: dict[str, Any] = field(default_factory=dict)  # name -> tool (stages/tools)
    options: Any = None  # the loop's config section (e.g. rl.multi_turn)
    interactions: dict[str, Any] = field(default_factory=dict)  # name -> simulated user (stages/agent/interactions.py)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def decode_for_parsing(self, ids: list[int]) -> str:
        """`ids` decoded with special tokens kept, for tool-call parsing: a tokenizer may make the call markers
        (`<tool_call>`) special tokens, which `decode` drops. The eos and pad tokens are left out first: they are
        no part of what the model wrote. Other `params.stop_token_ids` stay, since a loop may stop a turn at the
        call's closing marker (`</tool_call>`), which the parser needs."""
        ends = {self.tokenizer.eos_token_id, self.tokenizer.pad_token_id}
        return self.tokenizer.decode([i for i in ids if i not in ends], skip_special_tokens=False)

    def decode_all(self, sequences: list[list[int]]) -> list[str]:
        """`decode` of each sequence; a fast tokenizer decodes them in one call on all the host's cores (the
        driver's largest serial cost after generation: 0.1-0.17 s for 1,024 responses of ~300 tokens on one core).
        Tokenizers that clean up spaces after decoding (WordPiece-era ones) decode one by one, as `decode` does."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None or getattr(self.tokenizer, "clean_up_tokenization_spaces", True):
            return [self.decode(ids) for ids in sequences]
        return backend.decode_batch(sequences, skip_special_tokens=True)


class AgentLoop:
    """Base of every loop. Subclasses implement `run_batch`."""

    name = ""

    def run_batch(self, ctx: LoopContext, samples: list[Sample]) -> list[Trajectory]:
        """`ctx.params.n` trajectories per sample, prompt-major, `prompt_index` copied from each sample."""
        raise NotImplementedError(f"{type(self).__name__}.run_batch")


AGENT_LOOPS: Registry[type[AgentLoop]] = Registry("agent loop")


@AGENT_LOOPS.register("single_turn")
class SingleTurnLoop(AgentLoop):
    """One model turn per sample: the prompt, then the response up to a stop token or max_tokens."""

    name = "single_turn"

    def run_batch(self, ctx: LoopContext, samples: list[Sample]) -> list[Trajectory]:
        """The trajectories' ids and logprobs are array views of the packed outputs (workers send them packed):
        building the batch concatenates them instead of iterating ~300 Python numbers per sample."""
        outputs = PackedOutputs.pack(ctx.generate([s.prompt_ids for s in samples], ctx.params))
        texts = ctx.decode_all(outputs.token_lists())
        columns = (outputs.prompt_index.tolist(), outputs.split(outputs.token_ids), outputs.split(outputs.logprobs),
                   outputs.finish_reasons, outputs.extras, texts)
        return [Trajectory(prompt_index=samples[p].prompt_index, response_ids=ids, response_mask=[1] * len(ids),
                           logprobs=logprobs, finish_reason=finish, text=text, agent_name=self.name,
                           versions=extra.get("versions"))
                for p, ids, logprobs, finish, extra, text in zip(*columns, strict=True)]


def agent_loop(name: str) -> AgentLoop:
    """The loop registered as `name`, or a user's AgentLoop subclass by `file.py:Class` / `package.module.Class`."""
    if name in AGENT_LOOPS.keys():
        return AGENT_LOOPS.get(name)()
    if ":" not in name and "." not in name:
        AGENT_LOOPS.get(name)  # raises: unknown loop, listing the registered ones
    cls = load_object(name, "agent loop")
    if not (isinstance(cls, type) and issubclass(cls, AgentLoop)):
        raise ValueError(f"agent loop {name!r} is not a subclass of stages.agent.AgentLoop; define "
                         "class MyLoop(AgentLoop) with run_batch(ctx, samples)")
    return cls()
