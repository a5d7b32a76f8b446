"""`tool_agent`: the model talks, calls tools, reads their answers and talks again, up to the turn and token limits.

Token in, token out: each model turn is generated from the ids so far (prompt + earlier turns' ids as the engine
made them, never re-encoded text) and appended as the engine returned it (mask 1, the engine's logprobs); the
tools' answers are rendered with the chat template (`tool_turn_ids`: the template's tool messages and the next
assistant header, as a delta) and appended with mask 0 and logprob 0. The total response (model + tool
tokens) stays within `params.max_tokens` (data.max_response_length, verl's response_length).

A turn ends the trajectory when it has no tool call (`stop`), when the token budget runs out (`length`) or when
`max_assistant_turns` / `max_user_turns` is reached (`max_turns`). Malformed calls, unknown tools, bad
arguments, raising or hanging tools become error texts the model reads (stages/tools/calls.py); calls beyond
`max_parallel_calls` in one turn get an error text too. Tool answers are cut to `max_tool_response_length`
characters on `tool_response_truncate_side`.

Concurrency: all trajectories of a batch run as coroutines. Their generation requests go through
`BatchedEngine`, which sends whatever is pending as one batched engine call in a worker thread, so a sample
waiting for its tool overlaps the others' generation. Sampling seeds follow the engine calls, whose make-up
depends on tool timing: a multi-turn batch is reproducible only as far as its tools' timing is.

The reward scores the model's turns joined by newlines (`Trajectory.text`); the reward function also gets every
turn in `extra_info["turns"]`. The tools' step rewards and `calc_reward` add up in `Trajectory.tool_reward`.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace

from stages.agent.loops import AGENT_LOOPS, AgentLoop, GenerateFn, LoopContext, Sample
from stages.agent.trajectory import Trajectory
from stages.model.loading import tool_turn_ids
from stages.rollout.base import RolloutOutput, SamplingParams
from stages.tools.calls import call_tool
from stages.tools.parsers import parse_tool_calls, tool_messages

SEED_STRIDE = 7919  # between consecutive engine calls' seeds


class BatchedEngine:
    """One-sample generation requests from concurrent trajectories, served in batched engine calls."""

    def __init__(self, generate: GenerateFn, params: SamplingParams):
        self._generate, self._params = generate, params
        self._pending: list[tuple[list[int], int, asyncio.Future]] = []
        self._wake = asyncio.Event()
        self._closed = False
        self.num_calls = 0

    async def generate(self, prompt_ids: list[int], max_tokens: int) -> RolloutOutput:
        future = asyncio.get_running_loop().create_future()
        self._pending.append((prompt_ids, max_tokens, future))
        self._wake.set()
        return await future

    def close(self) -> None:
        self._closed = True
        self._wake.set()

    async def serve(self) -> None:
        """Until closed: wait for requests, then send every pending one in one engine call (in a thread)."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            await asyncio.sleep(0)  # requests made ready by the same event join this call
            batch, self._pending = self._pending, []
            if not batch:
                if self._closed:
                    return
                continue
            await self._serve(batch)

    async def _serve(self, batch: list[tuple[list[int], int, asyncio.Future]]) -> None:
        seed = None if self._params.seed is None else self._params.seed + SEED_STRIDE * self.num_calls
        params = replace(self._params, n=1, max_tokens=max(m for _, m, _ in batch), seed=seed)
        self.num_calls += 1
        try:
            outputs = await asyncio.to_thread(self._generate, [ids for ids, _, _ in batch], params)
        except Exception as exc:  # the engine's failure is every waiting trajectory's
            for _, _, future in batch:
                future.set_exception(exc)
            return
        for out in outputs:
            _, max_tokens, future = batch[out.prompt_index]
            future.set_result(_cut(out, max_tokens))


def _cut(out: RolloutOutput, max_tokens: int) -> RolloutOutput:
    """A sample generated with a larger budget than its own, cut to it: the same as stopping there."""
    if len(out.response_ids) <= max_tokens:
        return out
    return replace(out, response_ids=out.response_ids[:max_tokens], logprobs=out.logprobs[:max_tokens],
                   finish_reason="length")


def truncate_text(text: str, limit: int, side: str) -> str:
    """`text` cut to `limit` characters, keeping its start (side=right), end (left) or both ends (middle)."""
    if len(text) <= limit:
        return text
    marker = "...(truncated)..."
    keep = max(limit - len(marker), 0)
    if side == "left":
        return marker + text[len(text) - keep:]
    if side == "right":
        return text[:keep] + marker
    return text[: keep // 2] + marker + text[len(text) - (keep - keep // 2):]


@dataclass
class _State:
    """One trajectory being built."""

    response_ids: list[int]
    mask: list[int]
    logprobs: list[float]
    turns: list[dict]
    texts: list[str]
    metrics: dict[str, float]
    finish_reason: str = "stop"
    tool_reward: float = 0.0

    def add(self, ids: list[int], logprobs: list[float] | None) -> None:
        self.response_ids += ids
        self.mask += [1 if logprobs is not None else 0] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)

    def count(self, key: str, value: float = 1.0) -> None:
        self.metrics[key] = self.metrics.get(key, 0.0) + value


@AGENT_LOOPS.register("tool_agent")
class ToolAgentLoop(AgentLoop):
    name = "tool_agent"

    def run_batch(self, ctx: LoopContext, samples: list[Sample]) -> list[Trajectory]:
        return asyncio.run(self._run_all(ctx, samples))

    async def _run_all(self, ctx: LoopContext, samples: list[Sample]) -> list[Trajectory]:
        engine = BatchedEngine(ctx.generate, ctx.params)
        server = asyncio.create_task(engine.serve())
        try:
            return list(await asyncio.gather(*(self._run_one(ctx, engine, s) for s in samples
                                               for _ in range(ctx.params.n))))
        finally:
            engine.close()
            await server

    async def _run_one(self, ctx: LoopContext, engine: BatchedEngine, sample: Sample) -> Trajectory:
        opts, budget = ctx.options, ctx.params.max_tokens
        state = _State([], [], [], [], [], {"tool/calls": 0.0})
        kwargs = (sample.extra_info or {}).get("tools_kwargs") or {}
        instances = {name: await tool.create(**(kwargs.get(name) or {}).get("create_kwargs", {}))
                     for name, tool in ctx.tools.items()}
        try:
            await self._turns(ctx, engine, sample, state, instances, budget)
        finally:
            for name, tool in ctx.tools.items():
                state.tool_reward += await tool.calc_reward(instances[name])
                await tool.release(instances[name])
        return Trajectory(sample.prompt_index, state.response_ids, state.mask, state.logprobs, state.finish_reason,
                          "\n".join(state.texts), self.name, state.turns,
                          opts.tool_reward_weight * state.tool_reward, state.metrics)

    async def _turns(self, ctx: LoopContext, engine: BatchedEngine, sample: Sample, state: _State,
                     instances: dict[str, str], budget: int) -> None:
        opts = ctx.options
        num_assistant = num_user = 0
        while True:
            out = await engine.generate(sample.prompt_ids + state.response_ids, budget - len(state.response_ids))
            state.add(out.response_ids, out.logprobs)
            num_assistant += 1
            text = ctx.decode(out.response_ids)
            content, calls, errors = parse_tool_calls(text, opts.format)
            state.texts.append(text)
            state.turns.append({"role": "assistant", "text": text, "tokens": len(out.response_ids)})
            if out.finish_reason == "length" or len(state.response_ids) >= budget:
                state.finish_reason = "length"
                return
            if not calls and not errors:
                state.finish_reason = "stop"
                return
            if num_assistant >= opts.max_assistant_turns or num_user >= opts.max_user_turns:
                state.finish_reason = "max_turns"
                return
            answers = await self._call_tools(ctx, state, calls, errors, instances)
            ids = tool_turn_ids(ctx.tokenizer, tool_messages(answers))
            room = budget - len(state.response_ids)
            state.add(ids[:room], None)
            num_user += 1
            if len(ids) >= room:  # no room left for the model to answer
                state.finish_reason = "length"
                return

    async def _call_tools(self, ctx: LoopContext, state: _State, calls: list, errors: list[str],
                          instances: dict[str, str]) -> list[str]:
        """Run this turn's calls concurrently; -> the answer texts: the calls' in order, then one per malformed
        call and one per call beyond max_parallel_calls."""
        opts = ctx.options
        start = time.perf_counter()
        results = await asyncio.gather(*(call_tool(ctx.tools, instances, c, opts.tool_timeout_s)
                                         for c in calls[: opts.max_parallel_calls]))
        answers = []
        for result in results:
            name = result.call.name if result.known_tool else "unknown"
            text = truncate_text(result.response.text, opts.max_tool_response_length,
                                 opts.tool_response_truncate_side)
            answers.append(text)
            state.tool_reward += result.response.reward
            for key, flag in (("calls", 1.0), ("errors", float(result.error)), ("timeouts", float(result.timeout))):
                state.count(f"tool/{key}", flag)
                state.count(f"tool/{name}/{key}", flag)
            state.turns.append({"role": "tool", "tool_name": result.call.name, "arguments": result.call.arguments,
                                "text": text, "error": result.error, "timeout": result.timeout,
                                "latency_s": result.response.metrics.get("latency_s", time.perf_counter() - start)})
        refused = [f"error: {e}" for e in errors] + [
            f"error: at most {opts.max_parallel_calls} tool calls per turn; {c.name!r} was not run"
            for c in calls[opts.max_parallel_calls:]]
        state.count("tool/parse_errors", len(errors))
        for text in refused:
            state.turns.append({"role": "tool", "tool_name": None, "arguments": None, "text": text, "error": True,
                                "timeout": False, "latency_s": 0.0})
        return answers + refused
