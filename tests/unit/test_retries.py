"""Which stage failures Prefect retries (tasks.stages.transient): a second attempt that must fail the same way doubled
the time to fail and printed the error twice; a failure that may pass on a second attempt is retried."""

from __future__ import annotations

from types import SimpleNamespace

from ray.exceptions import ActorDiedError

from stages.rewards.pool import RewardFailedError
from stages.rl_async import RolloutFailed
from tasks.stages import transient


def retried(error: BaseException) -> bool:
    return transient(None, None, SimpleNamespace(result=lambda raise_on_failure=False: error))


def wrapped(error: BaseException) -> RolloutFailed:
    """What the async modes raise for their producer's error."""
    try:
        raise RolloutFailed(f"the rollout workers failed while generating ({error})") from error
    except RolloutFailed as exc:
        return exc


def died_in_init(last_line: str) -> ActorDiedError:
    """Ray's error for a worker whose __init__ raised (Ray keeps the traceback's text only)."""
    error = ActorDiedError()
    error._actor_init_failed = True
    error.error_msg = ("The actor died because of an error raised in its creation task, ray::Worker.__init__() "
                       f"(pid=1)\n  File \"stages/workers/actor_rollout.py\", line 130, in __init__\n{last_line}")
    return error


def test_a_repeatable_error_wrapped_by_the_async_modes_is_not_retried():
    assert not retried(RewardFailedError("90% of samples failed to score"))
    assert not retried(wrapped(RewardFailedError("90% of samples failed to score")))  # was retried
    assert not retried(wrapped(ValueError("a prompt over data.max_prompt_length")))
    assert retried(wrapped(RuntimeError("the engine's connection dropped")))  # a dead or stalled worker
    assert retried(RolloutFailed("no scored group came from the rollout workers in 600 s"))


def test_a_worker_whose_init_raised_a_repeatable_error_is_not_retried():
    assert not retried(died_in_init("ValueError: model.lora.target_modules=['q_projx']: no such module"))
    assert not retried(died_in_init("infra.checkpoints.UnsafeCheckpointError: pickled code in trainer.pt"))
    assert retried(died_in_init("RuntimeError: CUDA error: an illegal memory access was encountered"))
    assert retried(ActorDiedError())  # a worker killed mid-run (its node went away, out of memory)
