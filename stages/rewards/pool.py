"""Score many samples with a verl-style reward function in worker processes, with a per-sample timeout.

`RewardPool` owns `num_workers` processes started with the "forkserver" context (the parent may hold
torch, vLLM or Ray state and threads, so forking it is unsafe; the fork server is a fresh interpreter,
and forking a worker from it is cheap). Each worker loads the reward function itself: the default
`stages.rewards.default_compute_score` with `cfg.math_scorer` bound, or the user's function by file path and
name (a function loaded from a file cannot be pickled by reference); the path, name and math_scorer travel as
the worker's start arguments (stages/rewards/pool_worker.py). The parent loads a user's function once too, so a
wrong path or name is a ValueError at construction.

Protocol, per worker, over one duplex Pipe:

- worker -> parent: `("ready",)` once the function is loaded (or `("fatal", msg)` and exit);
- parent -> worker: a chunk, a list of `(index, data_source, solution_str, ground_truth, extra_info)`,
  or None to exit; only idle, ready workers get a chunk, so the worker is always reading when sent to;
- worker -> parent: one `(index, score, components, error, dropped_keys, traceback, pred)` tuple per sample, as
  each finishes, so the parent sees progress sample by sample (`traceback`: the user's function's, when it raised;
  `pred`: the answer a dict result names, as text).

Timeout: the parent waits at most `timeout_s` for a busy worker's next result (counted from the chunk's
dispatch, the previous result, or the worker's "ready", whichever is latest). On expiry the sample in
progress scores 0 ("timeout after Xs"), the worker is killed (SIGKILL, then joined) and replaced, and the
rest of its chunk goes back to the queue for whichever worker is idle first. A worker that dies (a
segfault, `os._exit`) is handled the same way, its sample counted as an error.

A scorer that raises, returns a non-number, or a dict without "score" scores 0 and counts as an error;
a NaN/inf score scores 0 and counts as "nan". Each batch with such samples is logged (one warning naming the first);
the run stops only when `max_failed_frac` of a batch failed (`on_failure=error`). A scorer that raised brings its
traceback from the worker, from its own frame on (file and line of the user's code): the warning shows it the first
time that error is met at that line, and RewardFailedError carries it as its cause (`ScorerTraceback`), which Python
prints above the driver's traceback.
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from pathlib import Path

from infra.rl_config import RewardConfig
from stages.rewards.custom import load_reward_fn
from stages.rewards.pool_worker import worker_main

logger = logging.getLogger(__name__)

MAX_CHUNK = 64  # samples per message: few messages for big batches, still balanced across workers
STARTUP_TIMEOUT_S = 120.0  # a worker must import and load the reward function within this
SNIPPET_CHARS = 80  # of solution_str, in warnings


class RewardFailedError(RuntimeError):
    """(Almost) every sample of a batch failed to score (rl.reward.max_failed_frac, on_failure=error)."""


class ScorerTraceback(Exception):
    """The traceback of the user's reward function in a worker process, as text: the cause of RewardFailedError, so
    that Python prints it above the driver's own traceback (as multiprocessing.pool's RemoteTraceback)."""

    def __str__(self) -> str:
        return "the reward function raised in a reward worker process:\n" + self.args[0].rstrip("\n")


@dataclass
class RewardRequest:
    data_source: str
    solution_str: str
    ground_truth: str
    extra_info: dict | None = None


@dataclass
class RewardResult:
    scores: list[float]  # one per request; 0.0 for errors, timeouts and NaN
    components: dict[str, list[float]]  # extra numeric keys of dict results; NaN where a sample lacked one
    errors: list[str | None]  # None, "error: <ExcType: msg>", "timeout after Xs" or "nan"
    metrics: dict[str, float] = field(default_factory=dict)  # reward/errors|timeouts|nan, reward/<c>/mean
    preds: list[str | None] = field(default_factory=list)  # a dict result's "pred" (the answer it read), as text


# --------------------------------------------------------------------------------------------------
# Parent side (the workers' side: stages/rewards/pool_worker.py)


class _Worker:
    """One worker process, its end of the pipe, and the chunk indices it has not reported yet."""

    def __init__(self, ctx, custom_path: str | None, custom_function: str, math_scorer: str) -> None:
        self.conn, child_conn = ctx.Pipe(duplex=True)
        self.process = ctx.Process(target=worker_main, args=(child_conn, custom_path, custom_function, math_scorer),
                                   name="reward-worker", daemon=True)
        self.process.start()
        child_conn.close()  # so that the worker's death reads as EOF here
        self.ready = False
        self.pending: deque[int] = deque()
        self.last_event = time.monotonic()  # start, ready, dispatch or last result

    def stop(self, kill: bool) -> None:
        """Ask the worker to exit (or SIGKILL it), join it, and release its pipe and process handle."""
        if not kill:
            try:
                self.conn.send(None)
            except OSError:  # already dead: the join below reaps it
                pass
            self.process.join(timeout=1.0)
        if self.process.is_alive():
            self.process.kill()
        self.process.join()
        self.conn.close()
        self.process.close()


def _stop_all(workers: list[_Worker]) -> None:
    for worker in workers:
        worker.stop(kill=False)
    workers.clear()


class RewardPool:
    """Score `RewardRequest`s in `cfg.num_workers` processes with a per-sample timeout of `cfg.timeout_s`."""

    def __init__(self, cfg: RewardConfig, min_judged: int = 1) -> None:
        """`min_judged`: the fewest samples `max_failed_frac` is judged on. A smaller call (an asynchronous
        producer's chunk, a DAPO top-up) is judged with the samples before it, so that one bad prompt's group does
        not reach the fraction alone (RL passes one step's samples)."""
        self.cfg = cfg
        self._recent_failed: deque[bool] = deque(maxlen=max(1, min_judged))  # of the last min_judged samples
        self._custom_path = None
        if cfg.custom_path is not None:
            load_reward_fn(cfg.custom_path, cfg.custom_function)  # ValueError here, not in a worker
            self._custom_path = str(Path(cfg.custom_path).expanduser().resolve())
            if cfg.math_scorer != RewardConfig.model_fields["math_scorer"].default:
                logger.warning("rl.reward.math_scorer=%s does not apply: rl.reward.custom_path replaces the default "
                               "reward function (call stages.rewards.default_compute_score(..., math_scorer=%r) from "
                               "yours to use it)", cfg.math_scorer, cfg.math_scorer)
        self._ctx = multiprocessing.get_context("forkserver")
        _preload_rewards(self._ctx)
        self._warned_keys: set[str] = set()
        self._warned_tracebacks: set[tuple[str, str]] = set()  # (last frame, error line) of those warned with
        # the batch in flight, shared by the event-loop methods below
        self._requests: list[RewardRequest] = []
        self._outcomes: list[tuple | None] = []
        self._queue: deque[list[int]] = deque()  # chunks of request indices not yet dispatched
        self._missing = 0
        self._workers: list[_Worker] = []
        self._finalizer = weakref.finalize(self, _stop_all, self._workers)  # no zombies if never closed
        try:
            for _ in range(cfg.num_workers):
                self._workers.append(self._new_worker())
            while not all(w.ready for w in self._workers):
                self._wait_and_pump()
        except BaseException:  # not swallowed: stop the workers already started, then re-raise
            self.close()
            raise

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """Stop and join every worker (killing any that do not exit within a second); idempotent."""
        self._finalizer()

    def score(self, requests: list[RewardRequest]) -> RewardResult:
        """Score `requests` in order; bad samples score 0 and are counted in the metrics. When at least
        `max_failed_frac` of them failed, RewardFailedError (on_failure=error) or one loud warning (warn)."""
        if not self._finalizer.alive:
            raise RuntimeError("RewardPool.score() after close(); create a new RewardPool")
        self._discard_stale()
        outcomes: list[tuple | None] = [None] * len(requests)
        self._requests, self._outcomes, self._missing = requests, outcomes, len(requests)
        size = max(1, min(MAX_CHUNK, math.ceil(len(requests) / (4 * len(self._workers)))))
        self._queue = deque(list(range(i, min(i + size, len(requests)))) for i in range(0, len(requests), size))
        try:
            while self._missing:
                self._dispatch()
                self._wait_and_pump()
        finally:
            self._requests, self._outcomes, self._queue, self._missing = [], [], deque(), 0
        result = self._assemble(requests, outcomes)
        self._check_failures(requests, result.errors, [o[4] for o in outcomes])
        return result

    # -- the event loop ---------------------------------------------------------------------------

    def _new_worker(self) -> _Worker:
        return _Worker(self._ctx, self._custom_path, self.cfg.custom_function, self.cfg.math_scorer)

    def _discard_stale(self) -> None:
        """Replace workers still busy with a batch that was interrupted (an exception or Ctrl-C in score()):
        their results would otherwise land in the next batch."""
        for i, worker in enumerate(self._workers):
            if worker.pending:
                logger.warning("replacing a reward worker still busy with an interrupted batch")
                self._restart(i)

    def _dispatch(self) -> None:
        """Give the next queued chunk to each ready, idle worker."""
        for i, worker in enumerate(self._workers):
            if not self._queue:
                return
            if worker.ready and not worker.pending:
                chunk = self._queue.popleft()
                r = self._requests
                items = [(j, r[j].data_source, r[j].solution_str, r[j].ground_truth, r[j].extra_info) for j in chunk]
                worker.pending.extend(chunk)
                worker.last_event = time.monotonic()
                try:
                    worker.conn.send(items)
                except OSError:  # died while idle (killed from outside): the chunk goes back untouched
                    self._queue.appendleft(chunk)
                    self._restart(i)

    def _wait_and_pump(self) -> None:
        """Wait for the next message or deadline, handle every message that arrived, then enforce timeouts."""
        now = time.monotonic()
        deadlines = [self._deadline(w) for w in self._workers]
        # something is always in flight while samples are missing, so there is always a deadline
        assert any(deadlines), "reward pool: samples missing but no worker busy or starting"
        timeout = max(0.0, min(d for d in deadlines if d is not None) - now)
        handles = [h for w in self._workers for h in (w.conn, w.process.sentinel)]
        readable = set(wait(handles, timeout))
        for i, worker in enumerate(list(self._workers)):
            if worker.conn in readable or worker.process.sentinel in readable:
                self._pump(i, dead=worker.process.sentinel in readable)
        now = time.monotonic()
        for i, worker in enumerate(self._workers):
            deadline = self._deadline(worker)
            if deadline is not None and now >= deadline:
                if not worker.ready:
                    raise RuntimeError(f"a reward worker did not start within {STARTUP_TIMEOUT_S:.0f} s")
                self._replace(i, f"timeout after {self.cfg.timeout_s:g}s")

    def _deadline(self, worker: _Worker) -> float | None:
        if not worker.ready:
            return worker.last_event + STARTUP_TIMEOUT_S
        return worker.last_event + self.cfg.timeout_s if worker.pending else None

    def _pump(self, i: int, dead: bool) -> None:
        """Handle every message waiting from worker i; replace it if it has died."""
        worker = self._workers[i]
        try:
            while worker.conn.poll():
                self._handle(worker, worker.conn.recv())
        except (EOFError, OSError):
            dead = True
        if dead:
            worker.process.join(timeout=1.0)  # reap it, for the exit code
            if not worker.ready:
                raise RuntimeError(
                    f"a reward worker exited while starting (exit code {worker.process.exitcode}); see its "
                    "traceback above. A script that creates a RewardPool must do so under "
                    "`if __name__ == '__main__':` (workers re-import the main module)"
                )
            self._replace(i, f"error: worker process died (exit code {worker.process.exitcode})")

    def _handle(self, worker: _Worker, message: tuple) -> None:
        worker.last_event = time.monotonic()
        if message[0] == "ready":
            worker.ready = True
        elif message[0] == "fatal":
            raise RuntimeError(f"a reward worker could not load the reward function: {message[1]}")
        else:
            index = worker.pending.popleft()
            assert message[0] == index, f"worker reported sample {message[0]}, expected {index}"
            self._outcomes[index] = message[1:]
            self._missing -= 1

    def _replace(self, i: int, error: str) -> None:
        """Kill worker i; its sample in progress gets `error`, the rest of its chunk is requeued."""
        worker = self._workers[i]
        if worker.pending:
            index = worker.pending.popleft()
            self._outcomes[index] = (0.0, {}, error, (), None, None)
            self._missing -= 1
            if worker.pending:
                self._queue.appendleft(list(worker.pending))
        self._restart(i)

    def _restart(self, i: int) -> None:
        """Kill and reap worker i and start a fresh one in its place (the fork server makes this quick)."""
        self._workers[i].stop(kill=True)
        self._workers[i] = self._new_worker()

    # -- results ----------------------------------------------------------------------------------

    def _assemble(self, requests: list[RewardRequest], outcomes: list[tuple]) -> RewardResult:
        """Scores, components, errors and metrics from the per-sample outcomes; warns about each bad sample."""
        scores = [o[0] for o in outcomes]
        errors = [o[2] for o in outcomes]
        names = list(dict.fromkeys(k for o in outcomes for k in o[1]))
        components = {k: [o[1].get(k, math.nan) for o in outcomes] for k in names}
        self._warn_dropped(k for o in outcomes for k in o[3])
        metrics = {
            "reward/errors": float(sum(e is not None and e.startswith("error") for e in errors)),
            "reward/timeouts": float(sum(e is not None and e.startswith("timeout") for e in errors)),
            "reward/nan": float(sum(e == "nan" for e in errors)),
        }
        for name, values in components.items():
            present = [v for v in values if not math.isnan(v)]
            metrics[f"reward/{name}/mean"] = sum(present) / len(present) if present else math.nan
        return RewardResult(scores=scores, components=components, errors=errors, metrics=metrics,
                            preds=[o[5] for o in outcomes])

    def _check_failures(self, requests: list[RewardRequest], errors: list[str | None],
                        tracebacks: list[str | None]) -> None:
        """One warning per batch with failed samples (not one per sample), naming the first (the first that raised,
        with its traceback); the configured action when (almost) all of them failed."""
        failed = [(r, e, t) for r, e, t in zip(requests, errors, tracebacks) if e is not None]
        self._recent_failed.extend(e is not None for e in errors)
        if not failed:
            return
        request, error, trace = next((f for f in failed if f[2]), failed[0])
        snippet = request.solution_str[:SNIPPET_CHARS] + ("..." if len(request.solution_str) > SNIPPET_CHARS else "")
        text = (f"the reward failed on {len(failed)} of {len(requests)} samples (scored 0); the first, a "
                f"{request.data_source!r} sample: {error}; solution: {snippet!r}")
        judged = self._judged(len(failed), len(requests))
        if judged and judged != (len(failed), len(requests)):  # judged with the samples before this call
            text += f" ({judged[0]} of the last {judged[1]} samples)"
        if not judged or judged[0] < self.cfg.max_failed_frac * judged[1]:
            logger.warning(text + self._traceback_once(trace))
        elif self.cfg.on_failure == "error":
            timeouts = sum(e.startswith("timeout") for _, e, _ in failed)
            slow = (f", or raise rl.reward.timeout_s (now {self.cfg.timeout_s:g} s) if it is only slow"
                    if timeouts * 2 >= len(failed) else "")
            raise RewardFailedError(f"{text}. Fix the reward function (rl.reward.custom_path / custom_function){slow}, "
                                    "or set rl.reward.on_failure=warn to go on scoring failures as 0"
                                    + (" (its traceback is above)" if trace else "")
                                    ) from (ScorerTraceback(trace) if trace else None)
        else:
            logger.warning("%s. rl.reward.max_failed_frac=%g reached; going on (rl.reward.on_failure=warn)%s", text,
                           self.cfg.max_failed_frac, self._traceback_once(trace))

    def _judged(self, failed: int, total: int) -> tuple[int, int] | None:
        """(failed, samples) that max_failed_frac is judged on: this call's, or the last `min_judged` samples' when
        this call has fewer; None before that many have been scored."""
        window = self._recent_failed
        if total >= window.maxlen:
            return failed, total
        return (sum(window), len(window)) if len(window) == window.maxlen else None

    def _traceback_once(self, trace: str | None) -> str:
        """The scorer's traceback for a warning, the first time its error is met at its line; after that a pointer."""
        if not trace:
            return ""
        lines = trace.rstrip("\n").splitlines()
        where = next((line for line in reversed(lines) if line.lstrip().startswith("File ")), "")
        if (where, lines[-1]) in self._warned_tracebacks:
            return " (its traceback: in the first warning about it)"
        self._warned_tracebacks.add((where, lines[-1]))
        return "\n" + trace.rstrip("\n")

    def _warn_dropped(self, keys) -> None:
        for key in set(keys) - self._warned_keys:
            self._warned_keys.add(key)
            logger.warning("reward dict key %r is not a number; it is not logged as a component", key)


def _preload_rewards(ctx) -> None:
    """Have the fork server import the rule scorers (math-verify imports sympy, ~1 s) once, so that
    starting or replacing a worker is a fork. Only effective before the fork server first starts."""
    ctx.set_forkserver_preload(["__main__", "stages.rewards.pool_worker", "stages.rewards"])
