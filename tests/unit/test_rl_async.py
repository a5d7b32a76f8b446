"""Asynchronous RL without Ray or an engine: the producer, partial rollouts and the policy-version bookkeeping.

- `generate_in_segments` / `versioned` (stages/rollout/partial.py) against a scripted engine call whose policy
  version changes between calls: what each continuation call asks for, and each token's version.
- `AsyncRollout` (stages/rl_async.py) with a fake `produce` and engine: a push landing between two segments of a
  chunk in flight, the staleness bound (wait and drop), the bounded queue, `paused`, failures, timeouts, `close`.
  Threads are ordered with threading.Event; `spy_waits` tells a test when the producer has decided not to start a
  chunk (it then waits to be notified), so "nothing started" is checked without sleeping. `AsyncSchedule`'s chunk
  bookkeeping (`produce`, `next_batch`) with a stub trainer; the rest of it needs Ray workers and is left to
  tests/integration/test_async_rl.py.
- The version columns of the rollouts table (`version_meta`, `trajectory_rows`), `average_metrics`, the tool loop's
  version bookkeeping (`_State.add`, `_cut`) and `AsyncTrainingConfig`.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import replace
from types import SimpleNamespace

import pydantic
import pytest
import torch

from infra.rl_config import AsyncTrainingConfig
from stages.agent.tool_loop import _cut, _State
from stages.agent.trajectory import Trajectory
from stages.batch import build_batch
from stages.rl_async import AsyncRollout, AsyncSchedule, Group, RolloutFailed
from stages.rl_data import average_metrics, trajectory_rows, version_meta
from stages.rl_rollout import RolloutDriver
from stages.rollout.base import RolloutOutput, SamplingParams
from stages.rollout.partial import generate_in_segments, versioned

WAIT_S = 5.0  # the most any Event wait or poll may take before the test fails (none takes that long when it passes)


# ---- fakes and helpers ------------------------------------------------------------------------------------------


def logprobs_of(tokens: list[int]) -> list[float]:
    return [-t / 100 for t in tokens]


class ScriptedCall:
    """A VersionedCall: call k answers script[k], one (tokens, finish_reason) per prompt x n (prompt-major), with
    policy version versions[k]; token t has logprob -t/100. Records each call's prompts and params."""

    def __init__(self, script: list[list[tuple[list[int], str]]], versions: list[int]):
        self.script, self.versions = script, versions
        self.calls: list[tuple[list[list[int]], SamplingParams]] = []

    def __call__(self, prompt_ids: list[list[int]], params: SamplingParams) -> tuple[list[RolloutOutput], int]:
        k = len(self.calls)
        self.calls.append(([list(p) for p in prompt_ids], params))
        answers = self.script[k]
        assert len(answers) == len(prompt_ids) * params.n
        for tokens, finish in answers:  # the script obeys the budget: "length" exactly when it is used up
            assert len(tokens) <= params.max_tokens and (finish == "length") == (len(tokens) == params.max_tokens)
        outputs = [RolloutOutput(i // params.n, tokens, logprobs_of(tokens), finish)
                   for i, (tokens, finish) in enumerate(answers)]
        return outputs, self.versions[k]


class PositionEngine:
    """A fake engine: every sample goes on counting positions (prompt [0] -> 1, 2, 3, ...; a continuation from
    [0, 1, 2] -> 3, 4), so a sample continued across calls equals an uninterrupted one; finish "length". Logs
    ("call", prompts, max_tokens, seed) and "return" per call; with `block_first`, the first call sets `entered`
    and waits for `release`."""

    def __init__(self, block_first: bool = False):
        self.block_first = block_first
        self.log: list = []
        self.entered, self.release = threading.Event(), threading.Event()
        self.in_call = False

    def __call__(self, prompt_ids: list[list[int]], params: SamplingParams) -> list[RolloutOutput]:
        self.log.append(("call", [list(p) for p in prompt_ids], params.max_tokens, params.seed))
        self.in_call = True
        if self.block_first and len(self.log) == 1:
            self.entered.set()
            assert self.release.wait(WAIT_S)
        tokens = [list(range(len(p), len(p) + params.max_tokens)) for p in prompt_ids]
        outputs = [RolloutOutput(i, t, logprobs_of(t), "length") for i, t in enumerate(tokens) for _ in range(params.n)]
        self.in_call = False
        self.log.append("return")
        return outputs


def no_engine(prompt_ids, params):
    raise AssertionError("this test's producer never calls the engine")


class Producer:
    """A fake `produce(first, count)`: records (first, count), sets event("started", first), waits for its gate when
    `first` is in `gated`, raises `error` if given, sleeps `delay_s`, then sets event("finished", first) and returns
    one Group per index that `keep` keeps (version `versions[index]`, default 0; one sample, group id g<index>)."""

    def __init__(self, versions: dict[int, int] | None = None, gated: tuple[int, ...] = (),
                 error: BaseException | None = None, keep=lambda index: True, delay_s: float = 0.0):
        self.versions, self.error, self.keep, self.delay_s = versions or {}, error, keep, delay_s
        self.gates = {first: threading.Event() for first in gated}
        self.calls: list[tuple[int, int]] = []
        self._events: dict[tuple[str, int], threading.Event] = {}
        self._lock = threading.Lock()

    def event(self, name: str, first: int) -> threading.Event:
        with self._lock:  # both threads ask for events: one Event per key
            return self._events.setdefault((name, first), threading.Event())

    def __call__(self, first: int, count: int) -> list[Group]:
        self.calls.append((first, count))
        self.event("started", first).set()
        if first in self.gates:
            assert self.gates[first].wait(WAIT_S)
        if self.error is not None:
            raise self.error
        time.sleep(self.delay_s)
        groups = [Group(i, scored_batch([[5]], [[1]], {"group_id": [f"g{i}"]}), self.versions.get(i, 0))
                  for i in range(first, first + count) if self.keep(i)]
        self.event("finished", first).set()
        return groups


def settings(**overrides) -> AsyncTrainingConfig:
    return AsyncTrainingConfig(**{"mode": "fully_async", "rollout_timeout_s": WAIT_S, **overrides})


def spy_waits(rollout: AsyncRollout) -> threading.Event:
    """An Event set whenever the producer finds that it may not start its next chunk (it then waits until notified).
    Install before start()."""
    waiting, may_start = threading.Event(), rollout._may_start

    def spied() -> bool:
        allowed = may_start()
        if not allowed:
            waiting.set()
        return allowed

    rollout._may_start = spied
    return waiting


def wait_until(predicate) -> None:
    """Poll state that another thread sets without notifying anyone (AsyncRollout's _pushing, _pausing)."""
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, "the other thread never got there"
        time.sleep(0.001)


def indices(groups: list[Group]) -> list[int]:
    return [g.index for g in groups]


@pytest.fixture
def closing():
    """track(rollout, *events): after the test, set the events (gates a producer may wait on) and close the rollout,
    so that no producer thread outlives its test."""
    made: list[tuple[AsyncRollout, tuple[threading.Event, ...]]] = []

    def track(rollout: AsyncRollout, *events: threading.Event) -> AsyncRollout:
        made.append((rollout, events))
        return rollout

    yield track
    for rollout, events in made:
        for event in events:
            event.set()
        rollout.close()


# ---- partial rollouts: generate_in_segments, versioned ----------------------------------------------------------


@pytest.mark.parametrize(("seed", "continuation_seeds"), [(10, [7929, 15848]), (None, [None, None])])
def test_generate_in_segments_continues_samples_at_the_budget_with_each_calls_version(seed, continuation_seeds):
    # 2 prompts x n=2, 5 tokens, segments of 2: versions 0, 1, 2 for the three calls
    call = ScriptedCall([
        [([11, 12], "length"), ([13], "stop"), ([21, 22], "length"), ([23, 24], "length")],
        [([31, 32], "length"), ([41], "stop"), ([51, 52], "length")],  # the live samples 0, 2, 3; n=1 each
        [([33], "length"), ([53], "length")],  # samples 0 and 3, 4 tokens done: 1 left
    ], versions=[0, 1, 2])
    params = SamplingParams(n=2, temperature=0.7, max_tokens=5, stop_token_ids=(99,), seed=seed)

    outputs = generate_in_segments(call, [[1], [2]], params, segment_tokens=2)

    assert [(o.prompt_index, o.response_ids, o.finish_reason, o.extra["versions"]) for o in outputs] == [
        (0, [11, 12, 31, 32, 33], "length", [0, 0, 1, 1, 2]),  # three segments, the last cut to the budget
        (0, [13], "stop", [0]),  # stopped in the first segment: never continued
        (1, [21, 22, 41], "stop", [0, 0, 1]),
        (1, [23, 24, 51, 52, 53], "length", [0, 0, 1, 1, 2]),
    ]
    assert [o.logprobs for o in outputs] == [logprobs_of(o.response_ids) for o in outputs]
    assert call.calls == [
        ([[1], [2]], replace(params, max_tokens=2)),
        ([[1, 11, 12], [2, 21, 22], [2, 23, 24]], replace(params, n=1, max_tokens=2, seed=continuation_seeds[0])),
        ([[1, 11, 12, 31, 32], [2, 23, 24, 51, 52]], replace(params, n=1, max_tokens=1, seed=continuation_seeds[1])),
    ]


@pytest.mark.parametrize(("max_tokens", "answer"), [
    (3, ([1, 2, 3], "length")),  # the whole budget fits one segment of 4: used up, not continued
    (8, ([1], "stop")),  # every sample stopped in the first segment
])
def test_generate_in_segments_makes_one_call_when_nothing_is_left_to_continue(max_tokens, answer):
    call = ScriptedCall([[answer]], versions=[7])
    params = SamplingParams(max_tokens=max_tokens, seed=1)

    outputs = generate_in_segments(call, [[5]], params, segment_tokens=4)

    assert call.calls == [([[5]], replace(params, max_tokens=min(4, max_tokens)))]
    assert [(o.response_ids, o.finish_reason, o.extra["versions"]) for o in outputs] == [
        (answer[0], answer[1], [7] * len(answer[0]))]


class ModelLenCall:
    """A VersionedCall that bounds prompt + response by `max_model_len` as the cuda engine and vLLM do: a sample that
    reaches it ends with finish "length" before max_tokens, and a prompt that leaves no room is a ValueError. Tokens
    count positions (as PositionEngine's); version = the call's number."""

    def __init__(self, max_model_len: int):
        self.max_model_len = max_model_len
        self.calls: list[tuple[list[int], int]] = []  # (prompt lengths, max_tokens)

    def __call__(self, prompt_ids: list[list[int]], params: SamplingParams) -> tuple[list[RolloutOutput], int]:
        self.calls.append(([len(p) for p in prompt_ids], params.max_tokens))
        if max(len(p) for p in prompt_ids) >= self.max_model_len:
            raise ValueError("a prompt leaves no room to generate within the engine's max_model_len")
        outputs = []
        for i, p in enumerate(prompt_ids):
            tokens = list(range(len(p), min(len(p) + params.max_tokens, self.max_model_len)))
            outputs += [RolloutOutput(i, tokens, logprobs_of(tokens), "length")] * params.n
        return outputs, len(self.calls) - 1


def test_generate_in_segments_does_not_continue_a_sample_the_engine_ended_at_max_model_len():
    # The tool loop's calls give every sample the largest remaining budget (6 here) and cut each reply to its own
    # afterwards, so a sample with a long context reaches max_model_len (10) first: prompt A (8 tokens) ends after
    # 2 tokens with finish "length". It is done; B (2 tokens) goes on in segments of 3 up to the budget: 3 + 3.
    call = ModelLenCall(max_model_len=10)
    params = SamplingParams(max_tokens=6, seed=1)

    outputs = generate_in_segments(call, [list(range(8)), [0, 1]], params, segment_tokens=3)

    assert call.calls == [([8, 2], 3), ([5], 3)]  # A's 10 tokens are never sent back as a prompt
    assert [(o.response_ids, o.extra["versions"]) for o in outputs] == [
        ([8, 9], [0, 0]), ([2, 3, 4, 5, 6, 7], [0, 0, 0, 1, 1, 1])]


def test_generate_in_segments_does_not_continue_a_sample_that_fills_max_model_len_at_the_segments_end():
    # prompt A (7 tokens) fills max_model_len (10) after exactly one segment of 3: as long as B's first segment, so
    # only the engine's max_model_len tells that it is done (the old code sent its 10 tokens back and failed there)
    call = ModelLenCall(max_model_len=10)

    outputs = generate_in_segments(call, [list(range(7)), [0, 1]], SamplingParams(max_tokens=6, seed=1),
                                   segment_tokens=3, max_model_len=10)

    assert call.calls == [([7, 2], 3), ([5], 3)]
    assert [len(o.response_ids) for o in outputs] == [3, 6]


def test_versioned_tags_every_token_and_keeps_the_outputs_extra():
    out = RolloutOutput(1, [4, 5, 6], [-0.1, -0.2, -0.3], "stop", {"engine": "cuda"})

    tagged = versioned([out], 3)

    assert tagged == [RolloutOutput(1, [4, 5, 6], [-0.1, -0.2, -0.3], "stop", {"engine": "cuda", "versions": [3] * 3})]
    assert out.extra == {"engine": "cuda"}  # the input is not mutated


# ---- AsyncRollout.generate: the engine's version on every token ------------------------------------------------


def test_generate_without_partial_rollouts_is_one_call_tagged_with_the_engines_version():
    engine = PositionEngine()
    rollout = AsyncRollout(settings(partial_rollout=False), 2, engine, Producer(), next_group=0, version=3)

    outputs = rollout.generate([[0]], SamplingParams(n=2, max_tokens=5, seed=4))

    assert engine.log == [("call", [[0]], 5, 4), "return"]
    assert [(o.response_ids, o.extra["versions"]) for o in outputs] == [([1, 2, 3, 4, 5], [3] * 5)] * 2


def test_generate_with_partial_rollouts_goes_in_segments_of_partial_rollout_tokens():
    engine = PositionEngine()
    rollout = AsyncRollout(settings(partial_rollout_tokens=2), 2, engine, Producer(), next_group=0, version=3)

    outputs = rollout.generate([[0]], SamplingParams(max_tokens=5, seed=4))

    # segments of 2, 2 and 1 tokens; seeds 4, 4 + 7919, 4 + 2 * 7919
    assert engine.log == [("call", [[0]], 2, 4), "return", ("call", [[0, 1, 2]], 2, 7923), "return",
                          ("call", [[0, 1, 2, 3, 4]], 1, 15842), "return"]
    assert [(o.response_ids, o.extra["versions"]) for o in outputs] == [([1, 2, 3, 4, 5], [3] * 5)]


# ---- AsyncRollout: the producer thread, pushes, the staleness bound, the queue ---------------------------------


def test_a_push_lands_between_two_segments_of_the_chunk_in_flight(closing):
    engine = PositionEngine(block_first=True)

    def produce(first: int, count: int) -> list[Group]:  # one group of one sample; its outputs are the batch
        return [Group(first, rollout.generate([[0]], SamplingParams(max_tokens=4, seed=5)), 0)]

    # batch size 1, max_staleness 0 (wait): chunk 0 needs version 0, chunk 1 version 1, chunk 2 version 2
    rollout = closing(AsyncRollout(settings(max_staleness=0, partial_rollout_tokens=2), 1, engine, produce,
                                   next_group=0, version=0), engine.release)
    sent: list[bool] = []  # per send: was an engine call running?
    pushed: dict[str, float] = {}

    def send() -> dict[str, float]:
        engine.log.append("send")
        sent.append(engine.in_call)
        return {"timing_s/send": 0.25}

    rollout.start()
    assert engine.entered.wait(WAIT_S)  # segment 1 of chunk 0 is in the engine
    pusher = threading.Thread(target=lambda: pushed.update(rollout.push(1, send)))
    pusher.start()
    wait_until(lambda: rollout._pushing)  # the push waits for the engine call...
    assert "send" not in engine.log
    engine.release.set()  # ...which returns now
    pusher.join(WAIT_S)

    assert not pusher.is_alive() and sent == [False]
    assert rollout.version == 1 and pushed["timing_s/send"] == 0.25 and pushed["async/push_wait_s"] > 0
    groups, _ = rollout.take(1, trained_version=0)  # chunk 0 is done: segment 2 ran after the push
    assert engine.log[:5] == [("call", [[0]], 2, 5), "return", "send", ("call", [[0, 1, 2]], 2, 5 + 7919), "return"]
    [out] = groups[0].batch
    assert (out.response_ids, out.extra["versions"]) == ([1, 2, 3, 4], [0, 0, 1, 1])


def test_a_push_or_a_pause_behind_a_stalled_rollout_worker_fails_after_the_timeout(closing):
    """The engine call (or the chunk) in flight never returns: push and paused waited for it forever; now they fail
    as take does, after rollout_timeout_s, and leave the producer free to go on."""
    engine = PositionEngine(block_first=True)

    def produce(first: int, count: int) -> list[Group]:
        return [Group(first, rollout.generate([[0]], SamplingParams(max_tokens=4, seed=5)), 0)]

    rollout = closing(AsyncRollout(settings(rollout_timeout_s=0.05), 1, engine, produce, next_group=0, version=0),
                      engine.release)
    rollout.start()
    assert engine.entered.wait(WAIT_S)

    def pause() -> None:
        with rollout.paused():
            pass

    errors = [in_thread(lambda: rollout.push(1, lambda: {})), in_thread(pause)]  # a hang fails, not hangs the suite

    assert [type(e) for e in errors] == [RolloutFailed, RolloutFailed], errors
    assert str(errors[0]).startswith("a weight push waited 0.05 s (rl.async_training.rollout_timeout_s) for the "
                                     "rollout workers' engine call in flight")
    assert str(errors[1]).startswith("no scored group came from the rollout workers in 0.05 s")
    assert rollout.version == 0 and not rollout._pushing and not rollout._pausing


def in_thread(call) -> BaseException | None:
    """What `call()` raised, run in a thread that must end within WAIT_S."""
    raised: list[BaseException | None] = [None]

    def run() -> None:
        try:
            call()
        except BaseException as exc:  # noqa: BLE001 - returned to the test
            raised[0] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(WAIT_S)
    assert not thread.is_alive(), "still waiting"
    return raised[0]


def test_wait_starts_no_chunk_before_the_engines_hold_the_version_its_last_group_needs(closing):
    producer = Producer(versions={2: 1, 3: 1})  # what the engines hold when their chunk starts
    # max_staleness 0, batch 2, chunks of 2: the chunk of groups 2-3 is trained by step 2, on version 1
    rollout = closing(AsyncRollout(settings(max_staleness=0, generation_groups=2, queue_groups=8), 2, no_engine,
                                   producer, next_group=0, version=0))
    assert rollout.required_version() == 0  # the next kept group (the first) trains in step 1, on version 0
    waiting = spy_waits(rollout)
    rollout.start()

    assert waiting.wait(WAIT_S) and producer.calls == [(0, 2)]
    waiting.clear()
    groups, metrics = rollout.take(2, trained_version=0)
    assert indices(groups) == [0, 1] and metrics["async/dropped_groups"] == 0.0
    assert waiting.wait(WAIT_S) and producer.calls == [(0, 2)]  # the queue has room, but version 0 < 1: still waits
    assert rollout.required_version() == 1

    waiting.clear()
    rollout.push(1, lambda: {})
    assert waiting.wait(WAIT_S) and producer.calls == [(0, 2), (2, 2)]  # chunk 4-5 needs version 2
    assert indices(rollout.take(2, trained_version=1)[0]) == [2, 3]


def test_drop_starts_chunks_freely_and_take_drops_groups_over_the_bound(closing):
    # max_staleness 0, drop: chunk 2-3 starts at version 0 although its required version is 1
    producer = Producer(versions={0: 0, 1: 0, 2: 1, 3: 1, 4: 1, 5: 1})
    rollout = closing(AsyncRollout(settings(staleness_policy="drop", max_staleness=0, generation_groups=2,
                                            queue_groups=4), 2, no_engine, producer, next_group=0, version=0))
    waiting = spy_waits(rollout)
    rollout.start()
    assert waiting.wait(WAIT_S) and producer.calls == [(0, 2), (2, 2)]  # the queue (4) is full

    groups, metrics = rollout.take(2, trained_version=1)

    # groups 0, 1: 1 - 0 = 1 > 0, dropped; groups 2, 3: 1 - 1 = 0, kept
    assert indices(groups) == [2, 3] and rollout.next_group == 4
    assert (metrics["async/dropped_groups"], metrics["async/queue_groups"]) == (2.0, 4.0)
    groups, metrics = rollout.take(1, trained_version=1)
    assert indices(groups) == [4] and rollout.next_group == 5 and metrics["async/dropped_groups"] == 0.0


def test_take_fails_naming_the_timeout_when_no_group_comes_in_time(closing):
    producer = Producer(gated=(0,))  # the chunk never finishes: a stalled rollout worker
    rollout = closing(AsyncRollout(settings(rollout_timeout_s=0.05), 2, no_engine, producer, 0, 0),
                      *producer.gates.values())
    rollout.start()

    with pytest.raises(RolloutFailed, match=r"no scored group came from the rollout workers in 0\.05 s "
                                            r"\(rl\.async_training\.rollout_timeout_s\)"):
        rollout.take(1, trained_version=0)


def test_a_timeout_while_dynamic_sampling_drops_every_group_says_so(closing):
    """max_num_gen_batches=0 (no limit) and a reward without spread: the wait timed out blaming a stalled worker."""
    nothing = closing(AsyncRollout(settings(generation_groups=2, rollout_timeout_s=0.3), 2, no_engine,
                                   Producer(keep=lambda i: False, delay_s=0.01), 0, 0))
    nothing.start()
    with pytest.raises(RolloutFailed, match=r"no group was kept in 0\.3 s .*: the rollout workers generated \d+ groups "
                                            r"meanwhile, and dynamic sampling dropped them all"):
        nothing.take(1, trained_version=0)


def test_dynamic_sampling_gives_up_after_max_num_gen_batches_steps_worth_of_groups(closing):
    # a reward that never varies keeps no group: the producer stops as the synchronous loop does, and says why
    nothing = closing(AsyncRollout(settings(generation_groups=2), 2, no_engine, Producer(keep=lambda i: False), 0, 0,
                                   max_gen_batches=3))
    nothing.start()
    with pytest.raises(RolloutFailed, match=r"dynamic sampling kept 0/2 groups of the next step after 6 generated "
                                            r"groups \(3 steps' worth\); raise rl.algorithm.max_num_gen_batches"):
        nothing.take(1, trained_version=0)
    # half the groups kept: every step fills within 2 steps' worth, so the count starts again and nothing fails
    half = closing(AsyncRollout(settings(generation_groups=2, max_staleness=3), 2, no_engine,
                                Producer(keep=lambda i: i % 2 == 0), 0, 0, max_gen_batches=2))
    half.start()
    for step in range(3):
        groups, _ = half.take(2, trained_version=step)
        assert indices(groups) == [4 * step, 4 * step + 2]


def test_an_error_in_produce_surfaces_from_take_and_paused_with_the_original_as_cause(closing):
    error = ValueError("the reward pool broke")
    rollout = closing(AsyncRollout(settings(), 2, no_engine, Producer(error=error), 0, 0))
    rollout.start()

    with pytest.raises(RolloutFailed, match="ValueError: the reward pool broke") as failed:
        rollout.take(2, trained_version=0)
    assert failed.value.__cause__ is error
    with pytest.raises(RolloutFailed) as failed:
        with rollout.paused():
            pass
    assert failed.value.__cause__ is error


def test_the_producer_starts_no_chunk_while_the_queue_has_no_room_for_it(closing):
    producer = Producer()
    rollout = closing(AsyncRollout(settings(staleness_policy="drop", generation_groups=2, queue_groups=2), 2,
                                   no_engine, producer, 0, 0))
    waiting = spy_waits(rollout)
    rollout.start()
    assert waiting.wait(WAIT_S) and producer.calls == [(0, 2)]  # 2 groups wait: 2 + 2 > 2

    waiting.clear()
    assert indices(rollout.take(1, trained_version=0)[0]) == [0]
    assert waiting.wait(WAIT_S) and producer.calls == [(0, 2)]  # 1 + 2 > 2: still no room

    assert indices(rollout.take(1, trained_version=0)[0]) == [1]
    assert producer.event("started", 2).wait(WAIT_S) and producer.calls == [(0, 2), (2, 2)]


def test_paused_waits_for_the_chunk_in_flight_and_starts_none_inside(closing):
    producer = Producer(gated=(0,))
    # a queue of 4: room for chunk 2 after chunk 0, none after that
    rollout = closing(AsyncRollout(settings(staleness_policy="drop", generation_groups=2, queue_groups=4), 2,
                                   no_engine, producer, 0, 0), *producer.gates.values())
    waiting = spy_waits(rollout)
    rollout.start()
    assert producer.event("started", 0).wait(WAIT_S)
    releaser = threading.Thread(target=lambda: (wait_until(lambda: rollout._pausing), producer.gates[0].set()))
    releaser.start()

    with rollout.paused():  # returns only once chunk 0 is done
        assert producer.event("finished", 0).is_set()
        assert waiting.wait(WAIT_S) and producer.calls == [(0, 2)]  # room for chunk 2, but paused

    releaser.join(WAIT_S)
    assert producer.event("started", 2).wait(WAIT_S) and producer.calls == [(0, 2), (2, 2)]


def test_close_stops_a_waiting_producer_and_refuses_engine_calls_after():
    rollout = AsyncRollout(settings(generation_groups=2, queue_groups=2), 2, PositionEngine(), Producer(), 0, 0)
    waiting = spy_waits(rollout)
    rollout.start()
    assert waiting.wait(WAIT_S)  # the queue is full

    rollout.close()

    assert not rollout._thread.is_alive()
    with pytest.raises(RolloutFailed, match="closed"):
        rollout.generate([[0]], SamplingParams(max_tokens=2))


def test_close_stops_a_producer_inside_a_chunk_at_its_next_engine_call():
    gate, calls = threading.Event(), []

    def produce(first: int, count: int) -> list[Group]:
        assert gate.wait(WAIT_S)
        calls.append(first)
        return [Group(first, rollout.generate([[0]], SamplingParams(max_tokens=2)), 0)]

    engine = PositionEngine()
    rollout = AsyncRollout(settings(), 2, engine, produce, 0, 0)
    rollout.start()
    releaser = threading.Thread(target=lambda: (wait_until(lambda: rollout._closed), gate.set()))
    releaser.start()

    rollout.close()

    releaser.join(WAIT_S)
    assert not rollout._thread.is_alive() and calls == [0] and engine.log == []
    with pytest.raises(RolloutFailed) as failed:
        rollout.take(1, trained_version=0)
    assert isinstance(failed.value.__cause__, RolloutFailed) and "closed" in str(failed.value.__cause__)


# ---- AsyncRollout: a chunk across steps, dynamic sampling, the timeout per group ------------------------------------


def test_wait_feeds_a_step_whose_groups_span_two_chunks(closing):
    producer = Producer()
    rollout = closing(AsyncRollout(settings(max_staleness=0, generation_groups=3, rollout_timeout_s=0.05), 4,
                                   no_engine, producer, 0, 0))
    rollout.start()

    groups, _ = rollout.take(4, trained_version=0)

    assert indices(groups) == [0, 1, 2, 3]


def test_wait_feeds_a_step_after_dynamic_sampling_dropped_a_group(closing):
    producer = Producer(keep=lambda index: index != 1)
    rollout = closing(AsyncRollout(settings(mode="sync", rollout_timeout_s=0.05), 2, no_engine, producer, 0, 0))
    rollout.start()

    groups, _ = rollout.take(2, trained_version=0)

    assert indices(groups) == [0, 2]


def test_take_times_out_only_when_the_next_group_is_late(closing):
    # one group per chunk, 100 ms each, and a queue of one: chunk k+1 starts only when take has popped group k, so
    # groups 1 and 2 come >= 100 and >= 200 ms after take started, whenever the main thread gets to run it
    producer = Producer(delay_s=0.1)
    rollout = closing(AsyncRollout(settings(generation_groups=1, queue_groups=1, rollout_timeout_s=0.15), 3,
                                   no_engine, producer, 0, 0))
    rollout.start()

    groups, _ = rollout.take(3, trained_version=0)

    assert indices(groups) == [0, 1, 2]


# ---- the rollouts table's version columns, metrics ---------------------------------------------------------------


def scored_batch(responses: list[list[int]], masks: list[list[int]], meta: dict | None = None):
    n = len(responses)
    base = {"group_id": ["1-0"] * n, "sample_index": list(range(n)), "data_source": ["math"] * n,
            "response": ["r"] * n, "ground_truth": ["4"] * n, "finish_reason": ["stop"] * n, "num_turns": [1] * n,
            "rollout_metrics": [{}] * n}
    batch = build_batch([[1, 2]] * n, responses, [[-0.5] * len(r) for r in responses], 0, {**base, **(meta or {})},
                        masks)
    batch.tensors["scores"] = batch.tensors["rewards"] = torch.ones(n)
    return batch


def version_columns(row: dict) -> dict:
    return {k: row[k] for k in ("policy_version", "policy_version_max", "staleness", "token_policy_versions")
            if k in row}


def test_trajectory_rows_of_a_synchronous_batch_are_the_trained_version():
    batch = scored_batch([[5, 6], [7]], [[1, 1], [1]])

    rows = trajectory_rows(batch, ["p", "p"], policy_version=3)

    assert [version_columns(r) for r in rows] == [
        {"policy_version": 3, "policy_version_max": 3, "staleness": 0}] * 2


def test_version_meta_and_trajectory_rows_use_the_model_tokens_versions():
    trajectories = [
        # model tokens at versions 1, 2, 3; tool tokens (mask 0) at -1, and one at 9 that the mask hides
        Trajectory(0, [5, 6, 7, 8, 9], [1, 1, 0, 0, 1], [-0.1, -0.2, 0.0, 0.0, -0.3], "stop", "a",
                   versions=[1, 2, -1, 9, 3]),
        Trajectory(0, [5], [1], [-0.1], "length", "b", versions=[4]),
        Trajectory(1, [5, 6], [1, 0], [-0.1, 0.0], "stop", "c", versions=[-1, -1]),  # no model token has a version
        Trajectory(1, [5], [1], [-0.1], "stop", "d"),  # no versions at all
    ]

    meta = version_meta(trajectories)

    assert meta == {"token_versions": [[1, 2, -1, 9, 3], [4], [-1, -1], []],
                    "policy_version": [1, 4, None, None], "policy_version_max": [3, 4, None, None]}
    batch = scored_batch([t.response_ids for t in trajectories], [t.response_mask for t in trajectories], meta)
    rows = trajectory_rows(batch, ["p"] * 4, policy_version=4)
    assert [version_columns(r) for r in rows] == [
        {"policy_version": 1, "policy_version_max": 3, "staleness": 3, "token_policy_versions": [1, 2, -1, 9, 3]},
        {"policy_version": 4, "policy_version_max": 4, "staleness": 0, "token_policy_versions": [4]},
        {"policy_version": None, "policy_version_max": None, "staleness": None, "token_policy_versions": [-1, -1]},
        {"policy_version": None, "policy_version_max": None, "staleness": None, "token_policy_versions": []},
    ]


class ChunkGen:
    """The trainer's RolloutDriver as AsyncSchedule.produce calls it: each generate answers the next chunk of
    `chunks` (per group, its samples' scores) with reward metric `reward/x` = the chunk's number; DAPO's filter on
    the score. Records the seeds."""

    varied_groups, batch_seed = RolloutDriver.varied_groups, RolloutDriver.batch_seed

    def __init__(self, chunks: list[list[list[float]]], batch_size: int):
        self.chunks, self.seeds = iter(enumerate(chunks)), []
        self.rl = SimpleNamespace(train_batch_size=batch_size, algorithm=SimpleNamespace(filter_groups_metric="score"))
        self.sampler = SimpleNamespace(indices=lambda step: list(range(batch_size)))

    def generate(self, indices, group_prefix, seed, timer):
        self.seeds.append(seed)
        number, groups = next(self.chunks)
        assert len(groups) == len(indices)
        scores = [s for group in groups for s in group]
        n = len(scores)
        meta = {"group_id": [f"{group_prefix}-{k}" for k, group in enumerate(groups) for _ in group],
                "policy_version": [0] * n, "token_versions": [[0]] * n}
        batch = scored_batch([[5]] * n, [[1]] * n, meta)
        batch.tensors["scores"] = batch.tensors["rewards"] = torch.tensor(scores)
        return batch, {"reward/x": float(number)}


def chunk_schedule(chunks: list[list[list[float]]], batch_size: int, filter_groups: bool = True) -> AsyncSchedule:
    """AsyncSchedule's produce / next_batch on a stub trainer (no workers: __init__ would start them)."""
    schedule = AsyncSchedule.__new__(AsyncSchedule)
    schedule.trainer = SimpleNamespace(gen=ChunkGen(chunks, batch_size), tokenizer=SimpleNamespace(pad_token_id=0),
                                       rl=SimpleNamespace(train_batch_size=batch_size,
                                                          algorithm=SimpleNamespace(filter_groups=filter_groups)))
    schedule._untrained, schedule._chunk_metrics = [], []
    schedule.rollout = SimpleNamespace(version=0)
    return schedule


def take_all(schedule: AsyncSchedule, groups: list[Group]) -> None:
    schedule.rollout.take = lambda num_groups, version: (groups, {})


def test_a_steps_signal_metrics_count_the_groups_dynamic_sampling_dropped_and_empty_chunks_metrics():
    """Chunks of 4, 2 and 2 groups for a step of 3: 2, then all 2, then 1 group have equal scores. The step reports
    what the synchronous loop would over all 8 generated groups (the old code: over the 3 kept, 0 with equal
    scores), and all three chunks' metrics (the old code lost the middle one's)."""
    varied, equal = [0.0, 1.0], [1.0, 1.0]
    schedule = chunk_schedule([[varied, equal, varied, [0.0, 0.0]], [equal, equal], [equal, varied]], batch_size=3)

    kept = [schedule.produce(0, 4), schedule.produce(4, 2), schedule.produce(6, 2)]

    assert [indices(groups) for groups in kept] == [[0, 2], [], [7]]
    take_all(schedule, [g for groups in kept for g in groups])
    batch, metrics = schedule.next_batch(1)
    assert len(batch) == 6
    assert metrics["train/frac_groups_zero_std"] == 5 / 8 and metrics["train/frac_groups_all_wrong"] == 1 / 8
    assert metrics["train/pass@2"] == 7 / 8
    assert metrics["async/chunks"] == 3.0 and metrics["async/filtered_groups"] == 5.0
    assert metrics["reward/x"] == 1.0  # the mean of chunks 0, 1, 2


def test_a_group_dropped_for_staleness_hands_its_reports_to_the_next_group_taken(closing):
    producer = Producer(versions={0: 0, 1: 1})
    rollout = closing(AsyncRollout(settings(staleness_policy="drop", max_staleness=0, generation_groups=2), 1,
                                   no_engine, producer, next_group=0, version=0))
    rollout.start()
    producer.event("finished", 0).wait(WAIT_S)

    groups, metrics = rollout.take(1, trained_version=1)

    assert indices(groups) == [1] and metrics["async/dropped_groups"] == 1.0
    assert [b.meta["group_id"] for b in groups[0].untrained] == [["g0"]]


def test_chunk_seeds_stay_apart_when_a_step_has_over_1000_groups():
    """Chunk seeds were step * 1000 + offset: group 1000 of step 1 had step 2's first seed."""
    schedule = chunk_schedule([[[1.0]] * 1000, [[1.0]], [[1.0]]], batch_size=1500, filter_groups=False)

    for first, count in ((0, 1000), (1000, 1), (1500, 1)):
        schedule.produce(first, count)

    step_1, step_1_offset_1000, step_2 = schedule.trainer.gen.seeds
    assert len({step_1, step_1_offset_1000, step_2}) == 3 and step_1 == 1500  # a batch of <= 1000: step * 1000


def test_average_metrics_sums_counts_and_async_keys_and_averages_the_rest():
    parts = [
        {"reward/errors": 1.0, "reward/timeouts": 0.0, "reward/nan": 2.0, "async/generate_s": 1.5,
         "reward/acc/mean": 0.5, "timing_s/async": 1.0, "reward/nan_frac": 0.5},
        {"reward/errors": 2.0, "reward/timeouts": 1.0, "reward/nan": 0.0, "async/generate_s": 2.5,
         "reward/acc/mean": 1.0, "timing_s/async": 3.0, "reward/nan_frac": 0.0},
    ]

    assert average_metrics(parts) == {
        "reward/errors": 3.0, "reward/timeouts": 1.0, "reward/nan": 2.0, "async/generate_s": 4.0,  # sums
        "reward/acc/mean": 0.75, "timing_s/async": 2.0, "reward/nan_frac": 0.25,  # means: (0.5 + 1) / 2, ...
    }
    assert average_metrics([]) == {}


# ---- the tool loop's versions ------------------------------------------------------------------------------------


def new_state() -> _State:
    return _State(response_ids=[], mask=[], logprobs=[], turns=[], texts=[], metrics={}, messages=[])


def test_state_add_fills_tool_tokens_and_unversioned_turns_with_minus_one():
    state = new_state()
    state.add([1, 2], [-0.1, -0.2])  # a model turn without versions (synchronous): none kept
    state.add([3], None)  # a tool turn
    assert state.versions is None

    state.add([4, 5], [-0.4, -0.5], [2, 3])  # the first versioned turn: -1 for everything before it
    state.add([6, 7], None)
    state.add([8], [-0.8], [3])

    assert state.response_ids == [1, 2, 3, 4, 5, 6, 7, 8]
    assert state.mask == [1, 1, 0, 1, 1, 0, 0, 1]
    assert state.versions == [-1, -1, -1, 2, 3, -1, -1, 3]


def test_state_add_keeps_versions_from_the_first_turn():
    state = new_state()
    state.add([1, 2], [-0.1, -0.2], [0, 1])
    state.add([3], None)
    assert state.versions == [0, 1, -1]


def test_cut_truncates_versions_with_the_ids():
    out = RolloutOutput(0, [1, 2, 3, 4], [-0.1, -0.2, -0.3, -0.4], "stop", {"versions": [0, 0, 1, 1], "k": "v"})

    assert _cut(out, 3) == RolloutOutput(0, [1, 2, 3], [-0.1, -0.2, -0.3], "length", {"versions": [0, 0, 1], "k": "v"})
    assert _cut(out, 4) is out
    assert out.extra["versions"] == [0, 0, 1, 1]  # the input is not mutated
    plain = RolloutOutput(0, [1, 2], [-0.1, -0.2], "stop")
    assert _cut(plain, 1) == RolloutOutput(0, [1], [-0.1], "length")


# ---- AsyncTrainingConfig ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("mode", "staleness"), [("sync", 0), ("one_step_off", 1), ("fully_async", 3)])
def test_staleness_bound_per_mode(mode, staleness):
    assert AsyncTrainingConfig(mode=mode, max_staleness=3).staleness == staleness


def test_pushes_every_k_steps_need_a_staleness_bound_of_k_minus_one():
    message = ("rl.async_training.trigger_parameter_sync_step=3 pushes weights every 3 steps, so samples lag up to 2 "
               "versions: raise max_staleness (=1) to at least that, or push more often")
    with pytest.raises(pydantic.ValidationError, match=re.escape(message)):
        AsyncTrainingConfig(mode="fully_async", trigger_parameter_sync_step=3, max_staleness=1)
    assert AsyncTrainingConfig(mode="fully_async", trigger_parameter_sync_step=3, max_staleness=2).staleness == 2
    # the other modes push after every step: the field is not theirs to check
    assert AsyncTrainingConfig(mode="one_step_off", trigger_parameter_sync_step=3).staleness == 1


def test_fields_the_mode_does_not_read_are_named():
    from infra.config import load_config

    colocated = load_config(None, ["rl.async_training.max_staleness=3", "rl.async_training.rollout_timeout_s=5"])
    assert colocated.rl.async_training.ignored_fields(separate=False) == [
        "rl.async_training.max_staleness=3", "rl.async_training.rollout_timeout_s=5.0"]
    assert colocated.rl.async_training.ignored_fields(separate=True) == ["rl.async_training.max_staleness=3"]
    fully = load_config(None, ["rl.async_training.mode=fully_async", "ray.rollout_devices_per_node=1",
                               "rl.async_training.max_staleness=3", "rl.async_training.partial_rollout=false"])
    assert fully.rl.async_training.ignored_fields(separate=True) == []


def test_a_weight_push_whose_workers_stall_fails_after_the_timeout(monkeypatch):
    """The push's own work (trainer ranks' send, rollout workers' receive, the check's generate, the memory report)
    waited on the workers without a bound: a rollout worker stuck in receive_weights hung the trainer, and with it
    the producer (`_pushing` stayed set). Each wait is bounded by rollout_timeout_s now."""
    import ray

    from stages.workers.group import WorkerGroup

    waited = []

    def never_ready(pending, num_returns, timeout):
        waited.append(timeout)
        return [], pending

    monkeypatch.setattr(ray, "wait", never_ready)
    with pytest.raises(TimeoutError, match=r"^2 of 2 worker calls not done after 0\.05 s$"):
        WorkerGroup.get_all(["a", "b"], 0.05)
    assert 0 <= waited[0] <= 0.05

    handle = SimpleNamespace(send_weights=SimpleNamespace(remote=lambda: "sent"),
                             receive_weights=SimpleNamespace(remote=lambda meta: "received"))

    def stalled(refs, timeout_s=None):
        assert timeout_s == 0.05  # rollout_timeout_s
        raise TimeoutError("1 of 2 worker calls not done after 0.05 s")

    schedule = AsyncSchedule.__new__(AsyncSchedule)
    schedule.trainer = SimpleNamespace(actor=SimpleNamespace(handles=[handle], get_all=stalled),
                                       engines=SimpleNamespace(handles=[handle]))
    schedule.rollout, schedule.meta = SimpleNamespace(timeout_s=0.05), None
    with pytest.raises(RolloutFailed, match=r"^a weight push of version 3 stalled: 1 of 2 worker calls not done "
                                            r"after 0\.05 s \(rl\.async_training\.rollout_timeout_s\)"):
        schedule._send(3)
