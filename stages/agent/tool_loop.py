"""`tool_agent`: the model talks, calls tools, reads their answers and talks again, up to the turn and token limits.

Token in, token out: each model turn is generated from the ids so far (prompt + earlier turns' ids as the engine
made them, never re-encoded text) and appended as the engine returned it (mask 1, the engine's logprobs); the
tools' answers are rendered with the chat template (`tool_turn_ids`: the template's tool messages and the next
assistant header, as a delta) and appended with mask 0 and logprob 0. The total response (model + tool
tokens) stays within `params.max_tokens` (data.max_response_length, verl's response_length).

A turn ends the trajectory when it has no tool call (`stop`, also when its eos lands exactly on the budget), when the
token budget runs out (`length`: also a turn that used it up with a tool call, or with a simulated user to answer)
or when `max_assistant_turns` / `max_user_turns` is reached (`max_turns`; tool and user turns both count against
`max_user_turns`, as in verl). Malformed calls, unknown tools, bad arguments, raising or hanging tools become error
texts the model reads (stages/tools/calls.py); calls beyond `max_parallel_calls` in one turn get an error text too.
The model reads one answer per call, in the order it wrote the calls (as verl's and OpenAI's tool messages are),
whether the answer is the tool's, a parse error or a refusal. Tool answers are cut to `max_tool_response_length`
characters on `tool_response_truncate_side` (verl's meaning: left keeps the start, right the end, middle both ends).

Calls are parsed from the turn decoded with special tokens kept (a tokenizer may make `<tool_call>` a special
token; verl's tool parsers decode the same way) but without the eos and pad tokens
(`LoopContext.decode_for_parsing`). The text the loop stores (the reward's `Trajectory.text`, the turn records,
the interaction's messages) is the decode without special tokens, as single_turn's and verl's reward text is.

A trajectory creates an instance of every tool before its first turn; when a `create` raises, the instances
already created are released before the error propagates.

Concurrency: all trajectories of a batch run as coroutines. Their generation requests go through
`BatchedEngine`, which sends whatever is pending as one batched engine call in a worker thread, so a sample
waiting for its tool overlaps the others' generation; before a call it lingers a little for trajectories that
are about to come back from their tools (at most half the last call's time), since a batch engine serves two
small calls in about twice the time of one large one. Sampling seeds follow the engine calls, whose make-up
depends on tool timing: a multi-turn batch is reproducible only as far as its tools' timing is.

Simulated users (stages/agent/interactions.py): a row with `extra_info.interaction_kwargs` (and interactions
configured) does not stop at a model turn without a tool call: its interaction gets the conversation so far (the
prompt messages and every assistant, tool and user message as chat dicts) and answers; unless it ends the
conversation, its reply is appended as a user message (`user_turn_ids`, mask 0, logprob 0) and the model goes on.
The interaction also judges the turn that hits the turn limit (its reply is recorded, not appended), so every
complete answer gets a turn score; a reply that ends the conversation is recorded and not appended either (no model
turn follows it; verl appends it with mask 0). A failing interaction ends its trajectory (`interaction_error`) where
it is next asked: one whose `start_interaction` failed, after the first model turn, which trains as any other.

The reward scores the model's turns joined by newlines (`Trajectory.text`); the reward function also gets every
turn in `extra_info["turns"]` (user turns with their `score`). The tools' step rewards and `calc_reward` add up in
`Trajectory.tool_reward`, the interaction's turn scores in `Trajectory.interaction_reward`, each times its weight.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, replace

from stages.agent.interactions import InteractionSession, pick_interaction
from stages.agent.loops import AGENT_LOOPS, AgentLoop, GenerateFn, LoopContext, Sample
from stages.agent.trajectory import Trajectory
from stages.model.loading import tool_turn_ids, user_turn_ids
from stages.rollout.base import RolloutOutput, SamplingParams
from stages.tools.base import ToolCall
from stages.tools.calls import ToolCallResult, call_tool
from stages.tools.parsers import in_call_order, parse_tool_calls, tool_messages

logger = logging.getLogger(__name__)

SEED_STRIDE = 7919  # between consecutive engine calls' seeds


class BatchedEngine:
    """One-sample generation requests from `live` concurrent trajectories, served in batched engine calls.

    Our engines generate a batch at a time, so a call started with a few requests and another soon after with
    the rest cost about two calls. Once a request waits, the next call therefore lingers until every live
    trajectory has asked (the rest are back from their tools) or for at most `linger` times the last call's
    duration, whichever comes first: a slow tool delays the others by at most that much.
    """

    def __init__(self, generate: GenerateFn, params: SamplingParams, live: int, linger: float = 0.5):
        self._generate, self._params = generate, params
        self._pending: list[tuple[list[int], int, asyncio.Future]] = []
        self._wake = asyncio.Event()
        self._closed = False
        self._live, self._linger, self._last_call_s = live, linger, 0.0
        self.num_calls = 0

    async def generate(self, prompt_ids: list[int], max_tokens: int) -> RolloutOutput:
        future = asyncio.get_running_loop().create_future()
        self._pending.append((prompt_ids, max_tokens, future))
        self._wake.set()
        return await future

    def finished(self) -> None:
        """One trajectory is done: it will not ask again."""
        self._live -= 1
        self._wake.set()

    def close(self) -> None:
        self._closed = True
        self._wake.set()

    async def serve(self) -> None:
        """Until closed: wait for requests, then send every pending one in one engine call (in a thread)."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            await asyncio.sleep(0)  # requests made ready by the same event join this call
            if not self._pending:
                if self._closed:
                    return
                continue
            await self._wait_for_others()
            batch, self._pending = self._pending, []
            await self._serve(batch)

    async def _wait_for_others(self) -> None:
        deadline = time.perf_counter() + self._linger * self._last_call_s
        while len(self._pending) < self._live and (left := deadline - time.perf_counter()) > 0:
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), left)
            except TimeoutError:
                return
            await asyncio.sleep(0)

    async def _serve(self, batch: list[tuple[list[int], int, asyncio.Future]]) -> None:
        seed = None if self._params.seed is None else self._params.seed + SEED_STRIDE * self.num_calls
        params = replace(self._params, n=1, max_tokens=max(m for _, m, _ in batch), seed=seed)
        self.num_calls += 1
        start = time.perf_counter()
        try:
            outputs = await asyncio.to_thread(self._generate, [ids for ids, _, _ in batch], params)
        except Exception as exc:  # the engine's failure is every waiting trajectory's
            for _, _, future in batch:
                future.set_exception(exc)
            return
        finally:
            self._last_call_s = time.perf_counter() - start
        for out in outputs:
            _, max_tokens, future = batch[out.prompt_index]
            future.set_result(_cut(out, max_tokens))


def _create_kwargs(tools_kwargs: dict, name: str) -> dict:
    """`tools_kwargs[name]["create_kwargs"]` without its None values. A parquet struct column has the keys of every
    row, so a tool or key that only other rows have reads back as None: the tool's own defaults apply then."""
    kwargs = (tools_kwargs.get(name) or {}).get("create_kwargs") or {}
    return {k: v for k, v in kwargs.items() if v is not None}


async def _create_instances(tools: dict, tools_kwargs: dict) -> dict[str, str]:
    """Each tool's instance id for one trajectory. When a `create` raises, the instances created before it are
    released (each, even if another's release raises) and the create's error propagates: nobody else knows their
    ids."""
    instances: dict[str, str] = {}
    try:
        for name, tool in tools.items():
            instances[name] = await tool.create(**_create_kwargs(tools_kwargs, name))
    except BaseException:
        await _all_of([(tools[name].release, iid) for name, iid in instances.items()], raise_first=False)
        raise
    return instances


async def _finish(tools: dict, instances: dict[str, str],
                  session: InteractionSession | None) -> list[tuple[str, float]]:
    """Each tool's (name, calc_reward) for the trajectory; then every instance is released and the session
    finalised, each even if a reward, a release or the finalising raised. The first error propagates; later ones
    are logged."""
    cleanup = [(tool.release, instances[name]) for name, tool in tools.items()]
    cleanup += [(session.finalize,)] if session else []
    try:
        rewards = [(name, await tool.calc_reward(instances[name])) for name, tool in tools.items()]
    except BaseException:
        await _all_of(cleanup, raise_first=False)
        raise
    await _all_of(cleanup, raise_first=True)
    return rewards


async def _all_of(calls: list[tuple], raise_first: bool) -> None:
    """Await every (fn, *args) in order, whatever each raises; the first exception is raised at the end when
    `raise_first`, the rest are logged with their tracebacks."""
    first = None
    for fn, *args in calls:
        try:
            await fn(*args)
        except Exception as exc:
            if raise_first and first is None:
                first = exc
            else:
                logger.warning("tool loop: %s failed while ending a trajectory", fn.__qualname__, exc_info=exc)
    if first is not None:
        raise first


def _cut(out: RolloutOutput, max_tokens: int) -> RolloutOutput:
    """A sample generated with a larger budget than its own, cut to it: the same as stopping there."""
    if len(out.response_ids) <= max_tokens:
        return out
    extra = {**out.extra, "versions": out.extra["versions"][:max_tokens]} if "versions" in out.extra else out.extra
    return replace(out, response_ids=out.response_ids[:max_tokens], logprobs=out.logprobs[:max_tokens],
                   finish_reason="length", extra=extra)


def truncate_text(text: str, limit: int, side: str) -> str:
    """`text` cut to `limit` characters, keeping its start (side=left), its end (right) or both ends (middle): verl's
    meaning of tool_response_truncate_side (the side kept, except middle, the part cut)."""
    if len(text) <= limit:
        return text
    marker = "...(truncated)..."
    keep = max(limit - len(marker), 0)
    if side == "left":
        return text[:keep] + marker
    if side == "right":
        return marker + text[len(text) - keep:]
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
    messages: list[dict]  # the conversation as chat dicts (what an interaction reads)
    finish_reason: str = "stop"
    tool_reward: float = 0.0
    interaction_reward: float = 0.0
    versions: list[int] | None = None  # each token's policy version when the engine reports them

    def add(self, ids: list[int], logprobs: list[float] | None, versions: list[int] | None = None) -> None:
        self.response_ids += ids
        self.mask += [1 if logprobs is not None else 0] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        if versions is not None or self.versions is not None:
            self.versions = (self.versions or [-1] * (len(self.response_ids) - len(ids))) + (
                versions if versions is not None else [-1] * len(ids))

    def count(self, key: str, value: float = 1.0) -> None:
        self.metrics[key] = self.metrics.get(key, 0.0) + value

    def finite_reward(self, value: float, source: str) -> float:
        """`value`, or 0 for NaN/inf (counted in tool/nan_rewards, warned): as the reward pool scores a NaN, so that
        one tool cannot turn its whole group's advantages into NaN."""
        if math.isfinite(value):
            return value
        self.count("tool/nan_rewards")
        logger.warning("%s gave a reward of %s; scored 0 (counted in tool/nan_rewards)", source, value)
        return 0.0


@AGENT_LOOPS.register("tool_agent")
class ToolAgentLoop(AgentLoop):
    name = "tool_agent"

    def __init__(self):
        self._warned: set[tuple[str, str]] = set()  # (interaction, method) whose failure was logged with traceback
        self._warned_unconfigured = False

    def run_batch(self, ctx: LoopContext, samples: list[Sample]) -> list[Trajectory]:
        return asyncio.run(self._run_all(ctx, samples))

    async def _run_all(self, ctx: LoopContext, samples: list[Sample]) -> list[Trajectory]:
        picks = [pick_interaction(ctx.interactions, s.extra_info) for s in samples]  # bad rows fail before generating
        self._warn_unconfigured(ctx, samples)
        engine = BatchedEngine(ctx.generate, ctx.params, live=len(samples) * ctx.params.n)
        server = asyncio.create_task(engine.serve())
        try:
            return list(await asyncio.gather(*(self._run_tracked(ctx, engine, s, pick)
                                               for s, pick in zip(samples, picks) for _ in range(ctx.params.n))))
        finally:
            engine.close()
            await server

    async def _run_tracked(self, ctx: LoopContext, engine: BatchedEngine, sample: Sample,
                           pick: tuple | None) -> Trajectory:
        try:
            return await self._run_one(ctx, engine, sample, pick)
        finally:
            engine.finished()

    def _warn_unconfigured(self, ctx: LoopContext, samples: list[Sample]) -> None:
        if ctx.interactions or self._warned_unconfigured:
            return
        num = sum(1 for s in samples if (s.extra_info or {}).get("interaction_kwargs"))
        if num:
            logger.warning("%d rows have extra_info.interaction_kwargs but rl.multi_turn.interaction_config_path is "
                           "not set: they run without a simulated user (warned once)", num)
            self._warned_unconfigured = True

    async def _run_one(self, ctx: LoopContext, engine: BatchedEngine, sample: Sample,
                       pick: tuple | None) -> Trajectory:
        opts, budget = ctx.options, ctx.params.max_tokens
        state = _State([], [], [], [], [], {"tool/calls": 0.0}, list(sample.messages))
        session = InteractionSession(*pick, opts.interaction_timeout_s, state.metrics, self._warned) if pick else None
        kwargs = (sample.extra_info or {}).get("tools_kwargs") or {}
        instances = await _create_instances(ctx.tools, kwargs)
        try:
            if session:
                await session.start()
            await self._turns(ctx, engine, sample, state, instances, budget, session)
        finally:
            rewards = await _finish(ctx.tools, instances, session)
            state.tool_reward += sum(state.finite_reward(r, f"calc_reward of tool {n!r}") for n, r in rewards)
        return Trajectory(sample.prompt_index, state.response_ids, state.mask, state.logprobs, state.finish_reason,
                          "\n".join(state.texts), self.name, state.turns,
                          opts.tool_reward_weight * state.tool_reward, state.metrics,
                          opts.interaction_reward_weight * state.interaction_reward, state.versions)

    async def _turns(self, ctx: LoopContext, engine: BatchedEngine, sample: Sample, state: _State,
                     instances: dict[str, str], budget: int, session: InteractionSession | None) -> None:
        opts = ctx.options
        num_assistant = num_user = 0
        while True:
            out = await engine.generate(sample.prompt_ids + state.response_ids, budget - len(state.response_ids))
            state.add(out.response_ids, out.logprobs, out.extra.get("versions"))
            num_assistant += 1
            text = ctx.decode(out.response_ids)
            _, calls, errors = parse_tool_calls(ctx.decode_for_parsing(out.response_ids), opts.format)
            if errors:  # counted here: a turn at a limit ends the trajectory before its calls would run
                state.count("tool/parse_errors", len(errors))
            state.texts.append(text)
            state.turns.append({"role": "assistant", "text": text, "tokens": len(out.response_ids)})
            state.messages.append({"role": "assistant", "content": text})
            if out.finish_reason == "length" or len(state.response_ids) >= budget:
                # a last answer that fits the budget exactly stopped on its own; a call or a user has no room left
                done = out.finish_reason == "stop" and not calls and not errors and session is None
                state.finish_reason = "stop" if done else "length"
                return
            at_limit = num_assistant >= opts.max_assistant_turns or num_user >= opts.max_user_turns
            if not calls and not errors:
                if session is None:
                    state.finish_reason = "stop"
                    return
                ids = await self._user_turn(ctx, state, session, at_limit, budget)
            elif at_limit:
                state.finish_reason = "max_turns"
                return
            else:
                messages = tool_messages(await self._call_tools(ctx, state, calls, errors, instances))
                state.messages += messages
                ids = tool_turn_ids(ctx.tokenizer, messages)
            if ids is None:  # the interaction ended the trajectory (finish_reason set)
                return
            room = budget - len(state.response_ids)
            state.add(ids[:room], None)
            num_user += 1
            if len(ids) >= room:  # no room left for the model to answer
                state.finish_reason = "length"
                return

    async def _user_turn(self, ctx: LoopContext, state: _State, session: InteractionSession, at_limit: bool,
                         budget: int) -> list[int] | None:
        """Ask the interaction for the user's reply to the model's last turn; -> the reply's ids to append, or None
        when the trajectory ends here: the interaction ended it (`stop`) or failed (`interaction_error`), or the
        turn limit is reached (`max_turns`; the reply is recorded with its score, but not appended)."""
        reply = await session.respond(state.messages)
        if reply is None:
            state.finish_reason = "interaction_error"
            return None
        state.interaction_reward += reply.score
        turn = {"role": "user", "text": reply.text, "tokens": 0, "score": reply.score, "data": reply.data}
        state.turns.append(turn)
        if reply.terminate or at_limit:
            state.finish_reason = "stop" if reply.terminate else "max_turns"
            return None
        state.messages.append({"role": "user", "content": reply.text})
        ids = user_turn_ids(ctx.tokenizer, reply.text)
        turn["tokens"] = min(len(ids), budget - len(state.response_ids))
        return ids

    async def _call_tools(self, ctx: LoopContext, state: _State, calls: list[ToolCall], errors: list[str],
                          instances: dict[str, str]) -> list[str]:
        """Run this turn's first `max_parallel_calls` calls concurrently; -> one answer text per call, in the order
        the model wrote them: the tool's answer, the parse error of a malformed call, or a refusal for a call
        beyond max_parallel_calls."""
        opts = ctx.options
        start = time.perf_counter()
        results = iter(await asyncio.gather(*(call_tool(ctx.tools, instances, c, opts.tool_timeout_s)
                                              for c in calls[: opts.max_parallel_calls])))
        answers, num_run = [], 0
        for item in in_call_order(calls, errors):
            if isinstance(item, str):  # a malformed call's parse error
                answers.append(self._record_refusal(state, f"error: {item}"))
            elif num_run < opts.max_parallel_calls:
                num_run += 1
                answers.append(self._record_answer(ctx, state, next(results), start))
            else:
                state.count("tool/refused")
                answers.append(self._record_refusal(
                    state, f"error: at most {opts.max_parallel_calls} tool calls per turn; {item.name!r} was not run",
                    item))
        return answers

    def _record_answer(self, ctx: LoopContext, state: _State, result: ToolCallResult, start: float) -> str:
        """Count one executed call and record its turn; -> its answer text, cut to max_tool_response_length."""
        opts = ctx.options
        text = truncate_text(result.response.text, opts.max_tool_response_length, opts.tool_response_truncate_side)
        state.tool_reward += state.finite_reward(result.response.reward, f"tool {result.call.name!r}")
        for key, flag in (("calls", 1.0), ("errors", float(result.error)), ("timeouts", float(result.timeout))):
            state.count(f"tool/{key}", flag)
            if result.known_tool:  # a model can invent any number of names: not one metric key each
                state.count(f"tool/{result.call.name}/{key}", flag)
        if not result.known_tool:
            state.count("tool/unknown_tool")
        state.turns.append({"role": "tool", "tool_name": result.call.name, "arguments": result.call.arguments,
                            "text": text, "error": result.error, "timeout": result.timeout,
                            "latency_s": result.response.metrics.get("latency_s", time.perf_counter() - start)})
        return text

    @staticmethod
    def _record_refusal(state: _State, text: str, call: ToolCall | None = None) -> str:
        """Record the turn of a call that did not run (malformed: no `call`; or past max_parallel_calls); -> `text`."""
        state.turns.append({"role": "tool", "tool_name": call and call.name, "arguments": call and call.arguments,
                            "text": text, "error": True, "timeout": False, "latency_s": 0.0})
        return text
