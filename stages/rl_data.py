"""Data plumbing of the RL loop: which prompts a step sees, turning rollouts into a Batch, and the
per-sample rows and per-step metrics that go to the trajectory tables and trackers.

The prompt order is a permutation seeded by (seed, epoch), and a step's prompts are a pure function of
the step number, so a resumed run draws exactly the batches an uninterrupted run would have.
"""

from __future__ import annotations

import hashlib
import json
import math
import time

import torch

from infra.learning_signal import group_signal_metrics
from stages.agent.trajectory import Trajectory
from stages.batch import Batch, build_batch
from stages.core import masked_mean, masked_sum, pair_order, preference_pairs
from stages.data_prep import PromptSet

COUNTS = ("/errors", "/timeouts", "/nan")  # reward metrics that add up over generation batches (others: means)


def average_metrics(parts: list[dict[str, float]]) -> dict[str, float]:
    """Metrics of several generation batches as one: counts (COUNTS, async/*) summed, the others averaged over the
    batches that have them."""
    total: dict[str, float] = {}
    seen: dict[str, int] = {}
    for part in parts:
        for key, value in part.items():
            total[key] = total.get(key, 0.0) + value
            seen[key] = seen.get(key, 0) + 1
    return {k: v if k.endswith(COUNTS) or k.startswith("async/") else v / seen[k] for k, v in total.items()}


class PromptSampler:
    def __init__(self, num_prompts: int, batch_size: int, seed: int):
        if batch_size > num_prompts:
            raise ValueError(f"rl.train_batch_size={batch_size} > {num_prompts} training prompts")
        self.num_prompts, self.batch_size, self.seed = num_prompts, batch_size, seed
        self.steps_per_epoch = num_prompts // batch_size

    def _order(self, epoch: int) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.num_prompts, generator=generator).tolist()

    def indices(self, step: int, extra: int = 0) -> list[int]:
        """Prompts of (1-based) `step`; `extra` > 0: another draw for dynamic sampling (DAPO), of prompts that the
        step has not had: a random order of the other prompts, `extra` batches into it (from its start again once
        the step has had every prompt). A pure function of (step, extra), so a resumed step draws the same."""
        epoch, offset = divmod(step - 1, self.steps_per_epoch)
        base = self._order(epoch)[offset * self.batch_size : (offset + 1) * self.batch_size]
        if not extra:
            return base
        key = hashlib.sha256(f"{self.seed}/{step}/top-ups".encode()).hexdigest()
        generator = torch.Generator().manual_seed(int(key[:15], 16))
        taken = set(base)
        others = [i for i in torch.randperm(self.num_prompts, generator=generator).tolist() if i not in taken]
        start = (extra - 1) * self.batch_size
        return [others[(start + k) % len(others)] for k in range(self.batch_size)] if others else base


def rollout_batch(prompts: PromptSet, indices: list[int], trajectories: list[Trajectory], group_prefix: str,
                  pad_token_id: int) -> Batch:
    """A Batch of every sample; `trajectories[i].prompt_index` indexes into `indices`."""
    rows = [indices[t.prompt_index] for t in trajectories]
    meta = {
        "group_id": [f"{group_prefix}-{t.prompt_index}" for t in trajectories],
        "sample_index": _sample_indices(trajectories),
        "prompt_row": rows,
        "data_source": [prompts.data_sources[r] for r in rows],
        "ground_truth": [prompts.ground_truths[r] for r in rows],
        "extra_info": [prompts.extra_infos[r] for r in rows],
        "response": [t.text for t in trajectories],
        "finish_reason": [t.finish_reason for t in trajectories],
        "num_turns": [t.num_turns for t in trajectories],
        "turns": [t.turns for t in trajectories],
        "rollout_metrics": [t.metrics for t in trajectories],
    }
    if any(t.versions is not None for t in trajectories):  # asynchronous modes: each token's policy version
        meta.update(version_meta(trajectories))
    return build_batch([prompts.prompt_ids[r] for r in rows], [t.response_ids for t in trajectories],
                       [t.logprobs for t in trajectories], pad_token_id, meta,
                       [t.response_mask for t in trajectories])


def version_meta(trajectories: list[Trajectory]) -> dict[str, list]:
    """Per sample: its tokens' policy versions, and the oldest and newest of its model tokens' (None without any)."""
    model = [[v for v, m in zip(t.versions or [], t.response_mask) if m and v >= 0] for t in trajectories]
    return {"token_versions": [list(t.versions or []) for t in trajectories],
            "policy_version": [min(v) if v else None for v in model],
            "policy_version_max": [max(v) if v else None for v in model]}


def _sample_indices(outputs: list[Trajectory]) -> list[int]:
    seen: dict[int, int] = {}
    out = []
    for o in outputs:
        out.append(seen.get(o.prompt_index, 0))
        seen[o.prompt_index] = out[-1] + 1
    return out


def concat_batches(batches: list[Batch], pad_token_id: int) -> Batch:
    """Re-pad samples of several Batches into one (dynamic sampling's further generations, the async modes' groups
    of several chunks). A meta key that some batches lack (a reward component only one data source's scorer
    returns, where a batch had no sample of it) is NaN (`reward_*`) or None in their samples, so every key keeps
    one value per sample."""
    prompts, responses, logprobs, masks = [], [], [], []
    for b in batches:
        t, num_response = b.tensors, b.num_response_tokens
        for i in range(len(b)):
            prompt = t["input_ids"][i, :-num_response][t["attention_mask"][i, :-num_response] > 0]
            n = int(t["attention_mask"][i, -num_response:].sum())  # tool tokens too: they are in the response
            prompts.append(prompt.tolist())
            responses.append(t["input_ids"][i, -num_response:][:n].tolist())
            logprobs.append(t["rollout_logprobs"][i, :n].tolist())
            masks.append(b.response_mask[i, :n].long().tolist())
    keys = dict.fromkeys(k for b in batches for k in b.meta)
    meta = {k: [v for b in batches for v in b.meta.get(k, [math.nan if k.startswith("reward_") else None] * len(b))]
            for k in keys}
    batch = build_batch(prompts, responses, logprobs, pad_token_id, meta, masks)
    for key, value in batches[0].tensors.items():  # per-sample values (scores, rewards, baselines)
        if value.dim() == 1:
            batch.tensors[key] = torch.cat([b.tensors[key] for b in batches])
    return batch


def trajectory_rows(batch: Batch, prompt_texts: list[str], policy_version: int) -> list[dict]:
    """One row per sample for the `rollouts` table. `policy_version`: the version the step trains (its start).
    A sample's `policy_version` is its oldest model token's (the trained one when the meta has none: synchronous),
    `staleness` the versions between it and the trained one; asynchronous runs add `token_policy_versions`."""
    t, mask = batch.tensors, batch.response_mask
    now = time.time()

    def per_seq(name: str) -> list[float | None]:
        if name not in t:
            return [None] * len(batch)
        return masked_mean(t[name].float(), mask, dim=-1).tolist()

    columns = {k: per_seq(k) for k in ("advantages", "old_logprobs", "ref_logprobs", "rollout_logprobs",
                                       "entropy", "kl")}
    # per-sample values as lists at once (indexing the tensors row by row took 20-56 ms at 1,024 rows)
    prompt_tokens = t["attention_mask"][:, : -batch.num_response_tokens].sum(-1).tolist()
    response_tokens = mask.sum(-1).tolist()
    scores, rewards = t["scores"].double().tolist(), t["rewards"].double().tolist()  # floats, as float() gave
    rows = []
    for i in range(len(batch)):
        row = {
            "group_id": batch.meta["group_id"][i], "sample_index": batch.meta["sample_index"][i],
            "data_source": batch.meta["data_source"][i], "prompt": prompt_texts[i],
            "response": batch.meta["response"][i], "ground_truth": str(batch.meta["ground_truth"][i]),
            "num_prompt_tokens": prompt_tokens[i], "num_response_tokens": response_tokens[i], "score": scores[i],
            "reward": rewards[i], "advantage": columns["advantages"][i],
            "old_logprob_mean": columns["old_logprobs"][i], "ref_logprob_mean": columns["ref_logprobs"][i],
            "rollout_logprob_mean": columns["rollout_logprobs"][i], "entropy_mean": columns["entropy"][i],
            "kl_mean": columns["kl"][i], "finish_reason": batch.meta["finish_reason"][i],
            "num_turns": batch.meta["num_turns"][i],
            **tool_counts(batch.meta["rollout_metrics"][i]),
            **_versions(batch.meta, i, policy_version), "time": now,
        }
        row.update({k: batch.meta[k][i] for k in batch.meta if k.startswith("reward_")})
        rows.append(row)
    return rows


def tool_counts(counts: dict[str, float]) -> dict[str, int]:
    """A sample's tool calls and failed ones as its `turns` rows show them (the rows with a tool name, and those of
    them marked error): a call refused past max_parallel_calls is both; a malformed call, with no name, neither."""
    refused = int(counts.get("tool/refused", 0))
    return {"num_tool_calls": int(counts.get("tool/calls", 0)) + refused,
            "num_tool_errors": int(counts.get("tool/errors", 0)) + refused}


def _versions(meta: dict, i: int, trained: int) -> dict:
    if "policy_version" not in meta:
        return {"policy_version": trained, "policy_version_max": trained, "staleness": 0}
    oldest = meta["policy_version"][i]
    return {"policy_version": oldest, "policy_version_max": meta["policy_version_max"][i],
            "staleness": None if oldest is None else trained - oldest,
            "token_policy_versions": meta["token_versions"][i]}


def turn_rows(batch: Batch) -> list[dict]:
    """One row per turn of each multi-turn sample, for the `turns` table (infra.trajectories.TURN_COLUMNS)."""
    rows = []
    for i, turns in enumerate(batch.meta["turns"]):
        for k, turn in enumerate(turns):
            arguments = turn.get("arguments")
            rows.append({"group_id": batch.meta["group_id"][i], "sample_index": batch.meta["sample_index"][i],
                         "turn": k, "role": turn["role"], "text": turn["text"], "num_tokens": turn.get("tokens"),
                         "tool_name": turn.get("tool_name"),
                         "arguments": None if arguments is None else json.dumps(arguments, sort_keys=True),
                         "error": turn.get("error"), "timeout": turn.get("timeout"),
                         "latency_s": turn.get("latency_s"), "score": turn.get("score")})
    return rows


def rollout_metrics(batches: list[Batch]) -> dict[str, float]:
    """Turns and tool calls of every generated sample: sums of the per-sample counts (tool/calls, tool/errors,
    tool/<name>/timeouts, ...) and num_turns/mean|max; nothing for single-turn samples without tools."""
    counts: dict[str, float] = {}
    turns = [n for b in batches for n in b.meta["num_turns"]]
    for b in batches:
        for sample in b.meta["rollout_metrics"]:
            for key, value in sample.items():
                counts[key] = counts.get(key, 0.0) + value
    if max(turns, default=1) > 1 or counts:
        counts.update({"num_turns/mean": sum(turns) / len(turns), "num_turns/max": float(max(turns))})
    return counts


def data_metrics(batch: Batch, max_response_length: int) -> dict[str, float]:
    """verl's data metrics: scores, rewards, advantages, returns, values, lengths, and the old policy's
    entropy (token mean, from the old-logprob pass; verl's actor/entropy)."""
    t, mask = batch.tensors, batch.response_mask
    lengths = batch.response_lengths().float()  # model + tool/user tokens, as verl counts them
    prompt_lengths = t["attention_mask"][:, : -batch.num_response_tokens].sum(-1).float()
    metrics = {}
    for name, values in (("critic/score", t["scores"]), ("critic/rewards", t["token_level_rewards"].sum(-1))):
        metrics.update(_stats(name, values.float()))
    for name, key in (("critic/advantages", "advantages"), ("critic/returns", "returns"), ("critic/values", "values")):
        if key in t:
            valid = t[key][mask]
            metrics.update(_stats(name, valid.float()))
    metrics.update(_stats("response_length", lengths))
    metrics["response_length/clip_ratio"] = float((lengths >= max_response_length).float().mean())
    if not torch.equal(lengths, mask.sum(-1).float()):  # multi-turn: the model's own share
        metrics.update(_stats("response_length/model_tokens", mask.sum(-1).float()))
    metrics.update(_stats("prompt_length", prompt_lengths))
    if "entropy" in t:
        metrics["actor/entropy"] = float(masked_mean(t["entropy"], mask))
    return metrics


def preference_batch(batch: Batch, num_ranks: int) -> tuple[Batch, dict[str, float]]:
    """Online DPO's pair batch: each group's best and worst sample by reward (stages/core/dpo.py; the rows the
    `online_dpo` labels mark +1 and -1) in the pair layout [chosen_0, rejected_0, chosen_1, ...], groups without a
    preference dropped. The pairs beyond a multiple of `num_ranks` are left out, so every worker trains on as many
    whole pairs. Metrics: pairs kept and left out, and the share of the step's groups that formed a pair."""
    mask = batch.response_mask
    pairs = preference_pairs(masked_sum(batch.tensors["token_level_rewards"], mask, dim=-1), batch.meta["group_id"])
    num_pairs = int(pairs.preferred.sum())
    kept = num_pairs - num_pairs % num_ranks
    metrics = {"dpo/num_pairs": float(kept), "dpo/num_pairs_dropped": float(num_pairs - kept),
               "dpo/frac_groups_paired": num_pairs / max(len(pairs.preferred), 1)}
    return batch.select(pair_order(pairs)[: 2 * kept]), metrics


def varied_rows(group_ids: list, metric: list[float], scores: list[float]) -> list[int]:
    """DAPO dynamic sampling: the rows of the groups whose filter metric is not the same for every sample.

    As verl: a single-sample group is kept (with rollout.n=1 the filter keeps everything). A NaN metric (a sample
    whose reward gave no `acc`: it raised, timed out, or its data source returns a plain float) says nothing of
    the group's spread: it is left out, and a group with no metric left is judged by its scores instead. (A NaN
    would otherwise make every group look varied: two NaNs are two different members of a set.)"""
    members: dict = {}
    for row, g in enumerate(group_ids):
        members.setdefault(g, []).append(row)
    kept = set()
    for g, rows in members.items():
        values = {round(float(metric[r]), 6) for r in rows if not math.isnan(metric[r])}
        if not values:
            values = {round(float(scores[r]), 6) for r in rows}
        if len(rows) == 1 or len(values) > 1:
            kept.add(g)
    return [row for row, g in enumerate(group_ids) if g in kept]


def signal_metrics(batches: list[Batch]) -> dict[str, float]:
    """How many groups carry a learning signal (infra.learning_signal), over every group a step generated:
    before dynamic sampling (DAPO's filter_groups) keeps only the varied ones."""
    return group_signal_metrics([g for b in batches for g in b.meta["group_id"]],
                                torch.cat([b.tensors["rewards"] for b in batches]).tolist(),
                                torch.cat([b.tensors["scores"] for b in batches]).tolist())


def _stats(name: str, values: torch.Tensor) -> dict[str, float]:
    if values.numel() == 0:
        return {}
    return {f"{name}/mean": float(values.mean()), f"{name}/max": float(values.max()),
            f"{name}/min": float(values.min())}
