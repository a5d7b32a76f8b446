"""RewardPool: rule scores in worker processes, dict components, and containment of scorers that raise, hang,
return NaN or kill their worker; plus DAPO's overlong penalty on hand-computed lengths."""

from __future__ import annotations

import logging
import math
import multiprocessing
import time
from pathlib import Path

import pytest
import torch

from infra.rl_config import RewardConfig
from stages.rewards.overlong import overlong_penalty
from stages.rewards.pool import RewardFailedError, RewardPool, RewardRequest

TIMEOUT_S = 0.5

BAD_SCORERS = '''
import os, time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if extra_info and "pid_dir" in extra_info:  # tell the test which process ran this sample
        with open(os.path.join(extra_info["pid_dir"], data_source), "w") as f:
            f.write(str(os.getpid()))
    if data_source == "raise":
        raise ZeroDivisionError("boom")
    if data_source == "sleep":
        time.sleep(1e9)
    if data_source == "spin":
        while True:
            pass
    if data_source == "nan":
        return float("nan")
    if data_source == "inf":
        return {"score": float("inf")}
    if data_source == "text":
        return "1.0"
    if data_source == "nodict":
        return {"acc": 1.0}
    if data_source == "exit":
        os._exit(3)
    return float(solution_str == ground_truth)
'''

WITH_COMPONENTS = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    acc = float(solution_str.strip() == ground_truth)
    out = {"score": acc - 0.5 * extra_info["penalty"], "acc": acc, "pred": solution_str.strip(), "note": "text"}
    if "fmt" in extra_info:
        out["format"] = extra_info["fmt"]
    return out
'''


def _write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "my_reward.py"
    path.write_text(text)
    return str(path)


@pytest.fixture(scope="module")
def default_pool():
    with RewardPool(RewardConfig(num_workers=2, timeout_s=5.0)) as pool:
        yield pool


# --------------------------------------------------------------------------------------------------
# default scorer


def test_default_scorer_scores_in_order(default_pool):
    requests = [
        RewardRequest("synthetic/arithmetic", "2 + 3 = 5\n#### 5", "5", None),  # right
        RewardRequest("synthetic/arithmetic", "2 + 3 = 6\n#### 6", "5", None),  # wrong
        RewardRequest("openai/gsm8k", "so #### 1,234", "1234", {"split": "test"}),  # right, commas stripped
        RewardRequest("openai/gsm8k", "the answer is 72", "72", None),  # strict needs '#### '
    ]
    result = default_pool.score(requests)
    assert result.scores == [1.0, 0.0, 1.0, 0.0]
    assert result.errors == [None] * 4
    assert result.components == {}
    assert result.metrics == {"reward/errors": 0.0, "reward/timeouts": 0.0, "reward/nan": 0.0}


def test_many_samples_keep_their_order_across_chunks_and_workers(default_pool):
    # 300 samples -> chunks of ceil(300 / 8) = 38 over 2 workers; sample i is right iff i % 3 == 0
    requests = [RewardRequest("synthetic/arithmetic", f"{i} + 0 = {i}\n#### {i}", str(i if i % 3 == 0 else i + 1), None)
                for i in range(300)]
    assert default_pool.score(requests).scores == [float(i % 3 == 0) for i in range(300)]
    assert default_pool.score([]).scores == []


def test_unknown_data_source_is_an_error_not_a_crash(default_pool, caplog):
    requests = [RewardRequest("nobody/knows", "#### 1", "1", None), RewardRequest("openai/gsm8k", "#### 1", "1", None)]
    with caplog.at_level(logging.WARNING, logger="stages.rewards.pool"):
        result = default_pool.score(requests)
    assert result.scores == [0.0, 1.0]
    assert result.errors[0].startswith("error: ValueError: no reward function for data_source 'nobody/knows'")
    assert result.metrics["reward/errors"] == 1.0
    assert "'nobody/knows'" in caplog.text and "#### 1" in caplog.text  # data_source and the solution snippet


# --------------------------------------------------------------------------------------------------
# the MATH datasets' scorer (rl.reward.math_scorer) reaches the workers; math_dapo's dict


MATH_REQUESTS = [
    RewardRequest("lighteval/MATH", "so \\boxed{\\frac{2}{4}}", "\\frac{1}{2}", None),  # verl 0, math-verify 1
    RewardRequest("HuggingFaceH4/MATH-500", "\\boxed{\\frac12}", "\\frac{1}{2}", None),  # both 1
    RewardRequest("math", "Answer: 1,000", "1000", None),  # math_dapo under both: +1, acc 1
    RewardRequest("aime2024", "Answer: 7", "8", None),  # math_dapo under both: -1, acc 0
]


def test_default_pool_scores_math_as_verl(default_pool):
    result = default_pool.score(MATH_REQUESTS)
    assert result.scores == [0.0, 1.0, 1.0, -1.0]
    assert result.errors == [None] * 4
    assert list(result.components) == ["acc"]  # math_dapo's bool acc; its string pred is left out
    assert math.isnan(result.components["acc"][0]) and result.components["acc"][2:] == [1.0, 0.0]
    assert result.metrics["reward/acc/mean"] == pytest.approx(0.5)  # (1 + 0) / 2 math_dapo samples
    assert result.preds == [None, None, "1000", "7"]  # math_dapo's answer, kept for maj@n's vote


def test_math_verify_option_reaches_the_workers():
    with RewardPool(RewardConfig(num_workers=1, timeout_s=5.0, math_scorer="math_verify")) as pool:
        assert pool.score(MATH_REQUESTS).scores == [1.0, 1.0, 1.0, -1.0]


def test_math_scorer_with_a_custom_reward_is_warned_about(tmp_path, caplog):
    cfg = RewardConfig(custom_path=_write(tmp_path, WITH_COMPONENTS), num_workers=1, math_scorer="math_verify")
    with caplog.at_level(logging.WARNING, logger="stages.rewards.pool"), RewardPool(cfg):
        pass
    assert "rl.reward.math_scorer=math_verify does not apply" in caplog.text


# --------------------------------------------------------------------------------------------------
# custom scorer with components


def test_custom_dict_components_and_means(tmp_path, caplog):
    cfg = RewardConfig(custom_path=_write(tmp_path, WITH_COMPONENTS), num_workers=2, timeout_s=5.0)
    requests = [
        RewardRequest("mine", "4", "4", {"penalty": 0.0, "fmt": 1.0}),  # score 1, acc 1, format 1
        RewardRequest("mine", "5", "4", {"penalty": 1.0, "fmt": 0.0}),  # score 0 - 0.5 = -0.5, acc 0, format 0
        RewardRequest("mine", " 4", "4", {"penalty": 1.0}),  # score 1 - 0.5 = 0.5, acc 1, no format
    ]
    with RewardPool(cfg) as pool, caplog.at_level(logging.WARNING, logger="stages.rewards.pool"):
        result = pool.score(requests)
    assert result.scores == [1.0, -0.5, 0.5]
    assert result.errors == [None, None, None]
    assert result.components["acc"] == [1.0, 0.0, 1.0]
    assert result.components["format"][:2] == [1.0, 0.0] and math.isnan(result.components["format"][2])
    assert "pred" not in result.components and result.preds == ["4", "5", "4"]  # the answer, for maj@n's vote
    assert "note" not in result.components  # another string: not a component, warned about once
    assert "'note' is not a number" in caplog.text and "'pred'" not in caplog.text
    assert result.metrics["reward/acc/mean"] == pytest.approx(2 / 3)  # (1 + 0 + 1) / 3
    assert result.metrics["reward/format/mean"] == pytest.approx(0.5)  # (1 + 0) / 2: the sample without it is out


# --------------------------------------------------------------------------------------------------
# containment: raise, hang, NaN, non-number, a dying worker


def _children() -> set[int]:
    return {p.pid for p in multiprocessing.active_children()}


def _live(pid: int) -> bool:
    """Whether `pid` is a running (not zombie) process, read from /proc."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("num_workers", [1, 2])
def test_bad_scorers_are_contained_and_pool_keeps_working(tmp_path, num_workers, caplog):
    cfg = RewardConfig(custom_path=_write(tmp_path, BAD_SCORERS), num_workers=num_workers, timeout_s=TIMEOUT_S)
    bad = ["raise", "sleep", "nan", "text", "spin", "inf", "nodict", "exit"]
    expected_error = {"raise": "error: ZeroDivisionError: boom", "sleep": f"timeout after {TIMEOUT_S:g}s",
                      "spin": f"timeout after {TIMEOUT_S:g}s", "nan": "nan", "inf": "nan",
                      "text": "error: TypeError", "nodict": "error: KeyError",
                      "exit": "error: worker process died (exit code 3)"}
    # good samples around each bad one, so every chunk has work before and after a failure
    requests, expected = [], []
    for i, kind in enumerate(bad):
        requests += [RewardRequest("good", "a", "a", None), RewardRequest(kind, "a", "a", {"pid_dir": str(tmp_path)}),
                     RewardRequest("good", "a", "b", None)]
        expected += [1.0, 0.0, 0.0]
    before = _children()
    with RewardPool(cfg) as pool:
        with caplog.at_level(logging.WARNING, logger="stages.rewards.pool"):
            result = pool.score(requests)
        assert result.scores == expected
        for i, kind in enumerate(bad):
            assert result.errors[3 * i] is None and result.errors[3 * i + 2] is None
            assert result.errors[3 * i + 1].startswith(expected_error[kind]), kind
        assert result.metrics == {"reward/errors": 4.0, "reward/timeouts": 2.0, "reward/nan": 2.0}
        assert caplog.text.count("the reward failed on 8 of 24 samples") == 1  # one warning per batch
        # the workers that hung or died are gone (killed and reaped, no zombies) and were replaced
        replaced = {int((tmp_path / kind).read_text()) for kind in ("sleep", "spin", "exit")}
        assert len(replaced) == 3 and not replaced & _children()
        assert len(pool_pids := _children() - before) == num_workers, pool_pids
        deadline = time.monotonic() + 2.0
        while any(_live(pid) for pid in replaced) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not any(_live(pid) for pid in replaced)
        # the pool still works
        again = pool.score([RewardRequest("good", "x", "x", None), RewardRequest("good", "x", "y", None)])
        assert again.scores == [1.0, 0.0] and again.errors == [None, None]


# --------------------------------------------------------------------------------------------------
# construction and shutdown


def test_bad_custom_path_or_function_is_a_value_error_at_construction(tmp_path):
    before = _children()
    with pytest.raises(ValueError, match="not found"):
        RewardPool(RewardConfig(custom_path=str(tmp_path / "missing.py")))
    path = _write(tmp_path, WITH_COMPONENTS)
    with pytest.raises(ValueError, match="has no function 'reward'.*compute_score"):
        RewardPool(RewardConfig(custom_path=path, custom_function="reward"))
    assert _children() == before  # nothing was started


def test_close_leaves_no_children_and_is_idempotent(tmp_path):
    before = _children()
    pool = RewardPool(RewardConfig(custom_path=_write(tmp_path, BAD_SCORERS), num_workers=3, timeout_s=TIMEOUT_S))
    pids = _children() - before
    assert len(pids) == 3
    pool.close()
    pool.close()
    assert _children() == before
    assert not any(_live(pid) for pid in pids)
    with pytest.raises(RuntimeError, match="after close"):
        pool.score([RewardRequest("good", "a", "a", None)])


# --------------------------------------------------------------------------------------------------
# overlong penalty (DAPO): L = 20, B = 4 -> expected = 16; penalty = min(-(len - 16) / 4 * factor, 0)


def test_overlong_penalty_hand_computed():
    lengths = [0, 16, 17, 18, 20]
    # 0, 16: within 16 -> 0; 17: -(1/4) * 2 = -0.5; 18: -(2/4) * 2 = -1.0; 20: -(4/4) * 2 = -2.0
    assert overlong_penalty(lengths, 20, 4, 2.0) == [0.0, 0.0, -0.5, -1.0, -2.0]
    assert overlong_penalty(torch.tensor(lengths), 20, 4, 2.0) == [0.0, 0.0, -0.5, -1.0, -2.0]
    assert overlong_penalty(lengths, 20, 0, 2.0) == [0.0] * 5  # buffer 0: off
    assert overlong_penalty([10, 11], 10, 10, 1.0) == [-1.0, -1.1]  # expected 0: -(10/10), -(11/10)


def test_overlong_penalty_rejects_bad_settings():
    with pytest.raises(ValueError, match="overlong_buffer=30"):
        overlong_penalty([1], 20, 30, 1.0)
    with pytest.raises(ValueError, match="overlong_penalty_factor=-1"):
        overlong_penalty([1], 20, 4, -1.0)
    with pytest.raises(ValueError, match="max_response_length=0"):
        overlong_penalty([1], 0, 0, 1.0)


ALWAYS_FAILS = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    raise KeyError('x')\n"


def test_a_reward_that_fails_on_almost_every_sample_stops_the_run(tmp_path):
    cfg = RewardConfig(custom_path=_write(tmp_path, ALWAYS_FAILS), num_workers=1, max_failed_frac=0.9)
    with RewardPool(cfg) as pool, pytest.raises(RewardFailedError, match=r"failed on 10 of 10 samples.*KeyError.*"
                                                                        r"rl.reward.on_failure=warn"):
        pool.score([RewardRequest("mine", "a", "a", None)] * 10)


def test_a_small_call_is_judged_with_the_samples_before_it(tmp_path, caplog):
    """An async producer's chunk of one bad prompt's 8 samples, inside a step of 64: one warning, not the error
    (scored in one call, the same 8 of 64 only warn); a broken reward still stops the run once a step's worth of
    samples has been scored."""
    cfg = RewardConfig(custom_path=_write(tmp_path, BAD_SCORERS), num_workers=1, max_failed_frac=0.9)
    good, bad = RewardRequest("ok", "1", "1", None), RewardRequest("raise", "1", "1", None)
    with RewardPool(cfg, min_judged=64) as pool, caplog.at_level(logging.WARNING, logger="stages.rewards.pool"):
        assert pool.score([bad] * 8).scores == [0.0] * 8  # 8 of 8 failed, but 8 < 64 judged: a warning
        assert "failed on 8 of 8 samples" in caplog.text
        for _ in range(7):
            pool.score([good] * 8)
        pool.score([bad] * 8)  # 8 of the last 64 failed (the first 8 have left the window)
        for _ in range(6):
            pool.score([bad] * 8)  # up to 56 of the last 64 failed (0.875 < 0.9): warnings
        with pytest.raises(RewardFailedError, match=r"failed on 8 of 8 samples .*\(64 of the last 64 samples\)"):
            pool.score([bad] * 8)  # 64 of the last 64
    with RewardPool(cfg) as pool, pytest.raises(RewardFailedError):
        pool.score([bad] * 8)  # judged on its own (evaluation's single call)


def test_a_reward_that_times_out_everywhere_names_the_timeout(tmp_path):
    cfg = RewardConfig(custom_path=_write(tmp_path, BAD_SCORERS), num_workers=1, timeout_s=TIMEOUT_S)
    with RewardPool(cfg) as pool, pytest.raises(RewardFailedError, match=r"raise rl.reward.timeout_s \(now 0.5 s\)"):
        pool.score([RewardRequest("sleep", "1", "1", None)])


def test_on_failure_warn_scores_zero_and_says_so(tmp_path, caplog):
    cfg = RewardConfig(custom_path=_write(tmp_path, ALWAYS_FAILS), num_workers=1, on_failure="warn")
    with RewardPool(cfg) as pool, caplog.at_level(logging.WARNING, logger="stages.rewards.pool"):
        result = pool.score([RewardRequest("mine", "a", "a", None)] * 10)
    assert result.scores == [0.0] * 10 and "max_failed_frac=0.9 reached" in caplog.text


RAISES_DEEP = '''def helper(text):
    return 1 / (len(text) - len(text))


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return helper(solution_str)
'''


def test_a_raising_reward_shows_the_user_its_own_traceback(tmp_path):
    """Not only 'ZeroDivisionError: division by zero': the file and line of the user's function, as the cause that
    Python prints above the driver's traceback."""
    import traceback

    path = _write(tmp_path, RAISES_DEEP)
    with RewardPool(RewardConfig(custom_path=path, num_workers=1)) as pool, pytest.raises(RewardFailedError) as info:
        pool.score([RewardRequest("mine", "a", "a", None)] * 4)
    printed = "".join(traceback.format_exception(info.value))
    assert f'File "{path}", line 6, in compute_score\n    return helper(solution_str)' in printed
    assert f'File "{path}", line 2, in helper\n    return 1 / (len(text) - len(text))' in printed
    assert "ZeroDivisionError: division by zero\n" in printed and "pool.py" not in str(info.value.__cause__)
    assert printed.index("in helper") < printed.index("RewardFailedError: the reward failed on 4 of 4 samples")
    assert str(info.value).endswith("(its traceback is above)")  # one line: the console's stage line quotes it


def test_a_warning_shows_the_traceback_the_first_time_it_is_met(tmp_path, caplog):
    path = _write(tmp_path, RAISES_DEEP)
    cfg = RewardConfig(custom_path=path, num_workers=1, on_failure="warn")
    with RewardPool(cfg) as pool, caplog.at_level(logging.WARNING, logger="stages.rewards.pool"):
        pool.score([RewardRequest("mine", "a", "a", None)] * 2)
        pool.score([RewardRequest("mine", "a", "a", None)] * 2)
    first, second = [r.getMessage() for r in caplog.records if "the reward failed" in r.getMessage()]
    assert f'File "{path}", line 2, in helper' in first and first.endswith("ZeroDivisionError: division by zero")
    assert "File " not in second and second.endswith("(its traceback: in the first warning about it)")


def test_remax_baseline_is_rewarded_as_the_samples_are():
    """ReMax's baseline is the greedy response's reward as `score` gives the samples (verl scores the baseline with
    the same reward function): the overlong penalty was missing from it, so a sample equal to the greedy response
    near the length limit got advantage -0.75 instead of 0 (score 1, 46 of 48 tokens, buffer 8, factor 1)."""
    from contextlib import nullcontext
    from types import SimpleNamespace

    from infra.config import load_config
    from stages.agent.trajectory import Trajectory
    from stages.rl_rollout import RolloutDriver

    cfg = load_config(None, ["rl.algorithm.adv_estimator=remax", "data.max_response_length=48",
                             "rl.reward.overlong_buffer=8", "rl.reward.overlong_penalty_factor=1.0"])
    greedy = [Trajectory(prompt_index=i, response_ids=[7] * length, response_mask=[1] * length,
                         logprobs=[0.0] * length, finish_reason="stop", text="x") for i, length in enumerate((46, 10))]
    rollout = SimpleNamespace(run=lambda train, indices, params: greedy,
                              score=lambda train, indices, trajectories: SimpleNamespace(scores=[1.0, 1.0]))
    driver = SimpleNamespace(rl=cfg.rl, cfg=cfg, stop_ids=(2,), rollout=rollout,
                             reward_model=None, engines_awake=nullcontext, train=None)
    batch = SimpleNamespace(meta={"prompt_row": [5, 5, 9]})
    baselines = RolloutDriver._greedy_baselines(driver, batch, [5, 9])
    # 46 tokens: 6 into the 8-token buffer before 48 -> penalty -(46 - 40) / 8 = -0.75; 10 tokens: none
    assert baselines.tolist() == [0.25, 0.25, 1.0]
