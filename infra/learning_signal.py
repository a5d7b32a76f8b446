"""Is RL learning anything? The share of groups that carry no signal, and the warning when it stays high.

Group-relative estimators (GRPO, RLOO, Dr.GRPO, ...) give every sample of a group whose rewards are all
equal an advantage of 0: such a group teaches nothing. When nearly every group of several steps in a row is
like that (every sample wrong: the task is too hard for the starting model; every sample right: it is
already solved), the run spends its time without changing the policy. The RL loop logs each step's shares
(`train/frac_groups_zero_std`, `..._all_correct`, `..._all_wrong`) and, through `NoSignalMonitor`, warns
and records the metric `train/no_signal_warning` (the streak's length in steps) at the step where such a streak
reaches `rl.no_signal_steps`.
The run report and the Prefect artifact read those metrics back and show the same text
(`no_signal_text`), so the console, the run's log, the report and Prefect say the same thing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from infra.rl_config import RLConfig

WARNING_METRIC = "train/no_signal_warning"
ZERO_STD, ALL_CORRECT, ALL_WRONG = ("train/frac_groups_zero_std", "train/frac_groups_all_correct",
                                    "train/frac_groups_all_wrong")


def group_signal_metrics(group_ids: list[str], rewards: list[float], scores: list[float]) -> dict[str, float]:
    """Per-step shares over groups (samples of one prompt): pass@k (some sample scores >= 1, k the group size, as
    evaluation's acc counts a correct answer) and mean@k (mean share of correct samples); and, over the groups of
    two or more samples (one sample has no spread to lose), rewards all equal, all correct or all wrong (every
    score >= 1, or every score <= 0: subsets of the first)."""
    groups: dict[str, list[tuple[float, float]]] = {}
    for g, reward, score in zip(group_ids, rewards, scores, strict=True):
        groups.setdefault(g, []).append((reward, score))
    if not groups:
        return {}
    num = len(groups)
    sizes = sorted({len(g) for g in groups.values()})
    k = sizes[0] if len(sizes) == 1 else "k"  # equal-size groups name their k (pass@8); mixed sizes say k
    metrics = {f"train/pass@{k}": sum(any(s >= 1 for _, s in g) for g in groups.values()) / num,
               f"train/mean@{k}": sum(sum(s >= 1 for _, s in g) / len(g) for g in groups.values()) / num}
    several = [g for g in groups.values() if len(g) > 1]
    if several:
        zero_std = [g for g in several if max(r for r, _ in g) - min(r for r, _ in g) <= 1e-6]
        metrics |= {ZERO_STD: len(zero_std) / len(several),
                    ALL_CORRECT: sum(all(s >= 1 for _, s in g) for g in zero_std) / len(several),
                    ALL_WRONG: sum(all(s <= 0 for _, s in g) for g in zero_std) / len(several)}
    return metrics


@dataclass
class NoSignalMonitor:
    """Counts consecutive steps whose share of zero-spread groups is >= `min_frac`; `update` returns the warning
    text at the step where the streak reaches `num_steps` (once per streak), else None."""

    min_frac: float
    num_steps: int
    streak: list[dict[str, float]]

    @classmethod
    def create(cls, min_frac: float, num_steps: int) -> NoSignalMonitor:
        return cls(min_frac, num_steps, [])

    @classmethod
    def for_config(cls, rl: RLConfig) -> tuple[NoSignalMonitor, str | None]:
        """The RL stage's monitor, off for estimators that do not compare a group's samples (their advantages need
        not be 0 when a group's rewards are equal: the warning would be false), and a note for the log when a
        group-relative estimator gets groups of one sample."""
        estimator = rl.algorithm.adv_estimator
        monitor = cls.create(rl.no_signal_frac, rl.no_signal_steps if estimator.group_relative else 0)
        if estimator.group_relative and rl.rollout.n == 1:
            return monitor, (f"rl.rollout.n=1 with rl.algorithm.adv_estimator={estimator.name}: each group is one "
                             "sample, which keeps its raw reward as its advantage (no baseline, as in verl); set "
                             "rl.rollout.n to 4 or more for the group baseline")
        return monitor, None

    def update(self, step: int, metrics: dict[str, float]) -> str | None:
        if self.num_steps == 0 or metrics.get(ZERO_STD, 0.0) < self.min_frac:
            self.streak = []
            return None
        self.streak.append({"step": step, **{k: metrics.get(k, 0.0) for k in (ZERO_STD, ALL_CORRECT, ALL_WRONG)}})
        return no_signal_text(self.streak) if len(self.streak) == self.num_steps else None

    def state_dict(self) -> dict:
        return {"streak": self.streak}

    def load_state_dict(self, state: dict) -> None:
        self.streak = list(state.get("streak", []))


def no_signal_text(streak: list[dict[str, float]]) -> str:
    """What the run saw over a streak of steps (dicts with step and the three shares) and what to do about it."""
    mean = {k: sum(s[k] for s in streak) / len(streak) for k in (ZERO_STD, ALL_CORRECT, ALL_WRONG)}
    first, last = int(streak[0]["step"]), int(streak[-1]["step"])
    seen = (f"RL has almost no learning signal: at steps {first}-{last}, {100 * mean[ZERO_STD]:.0f}% of the groups "
            f"had the same reward for every sample (all wrong: {100 * mean[ALL_WRONG]:.0f}%, all correct: "
            f"{100 * mean[ALL_CORRECT]:.0f}%), so their advantages are 0 and the policy barely changes.")
    if mean[ALL_CORRECT] > mean[ALL_WRONG]:
        return seen + (" The model already solves these prompts: use harder data (or stop here); a lower "
                       "rl.rollout.temperature makes it worse, a higher one adds variety.")
    return seen + (" The model rarely solves these prompts. What usually helps: a warmer start (more SFT epochs or "
                   "data, sft.*), easier prompts, more samples per prompt (rl.rollout.n), a higher "
                   "rl.rollout.temperature, or DAPO's dynamic sampling (rl.algorithm.filter_groups=true). "
                   "Validation at step 0 (val/acc/best@N: pass@N of the starting model) shows how often it can "
                   "solve them at all.")


def warnings_from_metrics(metrics: dict[str, list[tuple[int, float]]]) -> list[str]:
    """The warning texts of a run, rebuilt from its logged metrics (name -> [(step, value)]): one per step where
    `train/no_signal_warning` was logged, over the steps (its value) that led to it."""
    by_step = {k: dict(metrics.get(k, [])) for k in (ZERO_STD, ALL_CORRECT, ALL_WRONG)}
    texts = []
    for step, length in metrics.get(WARNING_METRIC, []):
        steps = sorted(s for s in by_step[ZERO_STD] if s <= step)[-max(1, int(length)):]
        texts.append(no_signal_text([{"step": s, **{k: by_step[k].get(s, 0.0) for k in by_step}} for s in steps]))
    return texts
