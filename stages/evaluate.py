"""Evaluation: generate on a held-out split and score with the training reward functions.

Engines (`evaluate.engine`): `vllm`, `cuda` (ours, stages/rollout/cuda_engine.py), `hf` (transformers) or
`auto` (the default: vLLM where it is installed, else cuda where this process sees a GPU, else hf).
Generation runs in Ray actors (`EvalWorker`, one device each, on the cluster that stages/workers/group.py
`init_ray` starts or attaches to, so `ray.address` is honoured): the in-process vLLM engine creates a
torch.distributed group and binds the process's threads, which the Prefect task's process must not inherit
(a second model evaluated in the same process would find the group taken). With
N workers (`ray.num_devices_per_node * ray.num_nodes`) each generates a contiguous share of the prompts.

Metrics, per data_source and over all of them (`all`): greedy `acc`, the mean of each response's `acc` where the
reward returns one, else of its score (as verl's validation: for 0/1 scorers, the share right; a reward of -1/+1
or with bonuses gives a mean score, not a share);
with `evaluate.n > 1`, n samples per prompt at `evaluate.temperature` add mean@n, best@n (pass@n),
worst@n and maj@n (stages/validation.py). Scores come from the RL stage's reward functions (`rl.reward`: the
data_source scorers or the custom function) in the same process pool with per-sample timeouts.

The `evals` table (infra/trajectories.py, partition `run_id` = the flow run, `label` = the model's label:
base, sft, rl), one row per (data_source, metric) in long format, like `metrics`:

    model VARCHAR        the evaluated model (artifact ref, local folder or hub id)
    eval VARCHAR         the eval artifact holding metrics.json and samples.jsonl (one row per response)
    dataset VARCHAR      the dataset artifact; split VARCHAR: 'validation'
    engine VARCHAR       vllm, cuda or hf
    data_source VARCHAR  a data_source of the split, or 'all'
    metric VARCHAR       acc, mean@n, best@n, worst@n, maj@n
    value DOUBLE         in [0, 1]
    num_prompts BIGINT   prompts evaluated for that data_source
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path

import torch

from infra.config import Config
from stages.agent import Rollout
from stages.agent.rollout import load_rollout_interactions, load_rollout_tools, tool_schemas
from stages.data_prep import load_prompts
from stages.model.loading import load_tokenizer, stop_token_ids
from stages.rewards.pool import RewardPool
from stages.rollout.base import PackedOutputs, SamplingParams
from stages.rollout.local import local_engine
from stages.validation import group_metrics, sample_value

logger = logging.getLogger(__name__)

ALL = "all"  # the data_source name of the aggregate over every data_source


def resolve_engine(name: str) -> str:
    """'auto' -> 'vllm' where vLLM is installed, else 'cuda' with a GPU, else 'hf'; 'vllm' without vLLM is an
    error."""
    has_vllm = find_spec("vllm") is not None
    fallback = "cuda" if torch.cuda.is_available() else "hf"
    if name == "auto":
        return "vllm" if has_vllm else fallback
    if name == "vllm" and not has_vllm:
        raise ValueError(f"evaluate.engine=vllm but vLLM is not installed in this environment; "
                         f"set evaluate.engine={fallback} (or auto, which picks {fallback} here)")
    return name


def max_new_tokens(cfg: Config) -> int:
    return cfg.evaluate.max_new_tokens or cfg.data.max_response_length


# ---- the Ray actor ------------------------------------------------------------------------------


class EvalWorker:
    """One engine on one device; generates its contiguous share of the prompts (prompt indices kept global)."""

    def __init__(self, cfg: Config, model_dir: str, rank: int = 0, world_size: int = 1):
        self.rank, self.world_size = rank, world_size
        self.engine = make_engine(cfg, model_dir)

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> PackedOutputs:
        per_rank = -(-len(prompt_ids) // self.world_size)  # ceil
        start = self.rank * per_rank
        outputs = self.engine.generate(prompt_ids[start : start + per_rank], params)
        for out in outputs:
            out.prompt_index += start
        return PackedOutputs.pack(outputs)  # arrays: the driver unpickles no object per token


def make_engine(cfg: Config, model_dir: str):
    ev = cfg.evaluate
    if ev.engine == "vllm":
        from stages.rollout.vllm_engine import VLLMRolloutEngine

        return VLLMRolloutEngine(model_dir, dtype=cfg.model.dtype, seed=cfg.run.seed,
                                 max_model_len=cfg.data.max_prompt_length + max_new_tokens(cfg),
                                 gpu_memory_utilization=ev.gpu_memory_utilization)
    return local_engine(ev.engine, model_dir, cfg.model, max_model_len=cfg.data.max_prompt_length + max_new_tokens(cfg),
                        max_num_seqs=ev.batch_size, setting="evaluate.engine", hf_batch_size=ev.batch_size)


@contextmanager
def eval_workers(cfg: Config, model_dir: str):
    """N independent `EvalWorker` actors, one device each, on this stage's own Ray or `ray.address`'s cluster.

    Not a stages/workers WorkerGroup: evaluation workers share no torch.distributed world and no device with
    another role, so they need no placement group or rendezvous, only a device each. Yields a function
    `generate(prompt_ids, params) -> outputs` over all of them (prompt-major, like one engine).
    """
    import ray

    from stages.workers.group import init_ray

    started_ray = init_ray(cfg.ray)
    handles = []
    try:
        num_gpus = 1 if ray.cluster_resources().get("GPU", 0) > 0 else 0
        world_size = cfg.ray.num_devices_per_node * cfg.ray.num_nodes
        remote = ray.remote(num_cpus=1, num_gpus=num_gpus)(EvalWorker)
        handles = [remote.remote(cfg, model_dir, rank, world_size) for rank in range(world_size)]

        def generate(prompt_ids: list[list[int]], params: SamplingParams) -> PackedOutputs:
            shards = ray.get([h.generate.remote(prompt_ids, params) for h in handles])
            return PackedOutputs.concat(shards, [range(len(prompt_ids))] * len(shards))

        yield generate
    finally:
        for handle in handles:
            ray.kill(handle)
        if started_ray:
            ray.shutdown()


# ---- evaluation ---------------------------------------------------------------------------------


@dataclass
class EvalResult:
    engine: str
    scores: dict[str, dict[str, float]]  # data_source (and "all") -> metric (acc, mean@n, ...) -> value
    num_prompts: dict[str, int]  # data_source (and "all") -> prompts evaluated
    samples: list[dict]  # one row per generated response (greedy, then the n samples when n > 1)

    @property
    def acc(self) -> float:
        return self.scores[ALL]["acc"]

    @property
    def metrics(self) -> dict[str, float]:
        """Flat view: 'acc', 'mean@n', ... over all data sources, '<data_source>/<metric>' per source."""
        return {(name if src == ALL else f"{src}/{name}"): value
                for src, metrics in self.scores.items() for name, value in metrics.items()}


def evaluate_model(cfg: Config, model_dir: Path, data_file: Path) -> EvalResult:
    """Greedy (and, with n > 1, sampled) generation on `data_file`'s prompts, scored per data_source."""
    ev = cfg.evaluate
    engine = resolve_engine(ev.engine)
    cfg = cfg.model_copy(update={"evaluate": ev.model_copy(update={"engine": engine})})
    tokenizer = load_tokenizer(model_dir, cfg.model.trust_remote_code)
    multi_turn = cfg.rl.multi_turn
    tools = load_rollout_tools(multi_turn)
    prompts = load_prompts(data_file, tokenizer, cfg.data, tool_schemas(tools))
    num = min(len(prompts), ev.max_samples or len(prompts))
    if num == 0:
        raise ValueError(f"{data_file}: no prompts to evaluate (all filtered by data.max_prompt_length?)")
    stop = stop_token_ids(model_dir, tokenizer.eos_token_id)
    runs = [SamplingParams(n=1, temperature=0.0, max_tokens=max_new_tokens(cfg), stop_token_ids=stop,
                           seed=cfg.run.seed)]
    if ev.n > 1:
        runs.append(SamplingParams(n=ev.n, temperature=ev.temperature, top_p=ev.top_p,
                                   max_tokens=max_new_tokens(cfg), stop_token_ids=stop, seed=cfg.run.seed))
    logger.info("evaluate %s on %d prompts with %s (n=%d)", model_dir, num, engine, ev.n)
    rows = list(range(num))
    with eval_workers(cfg, str(model_dir)) as generate, RewardPool(cfg.rl.reward) as pool:
        rollout = Rollout(generate, tokenizer, pool, tools, multi_turn, load_rollout_interactions(multi_turn))
        greedy, *sampled = [_samples(rollout, prompts, rows, params, sampled=params.n > 1) for params in runs]
    sampled = sampled[0] if sampled else []
    scores, counts = score_table(greedy, sampled, ev.n)
    return EvalResult(engine, scores, counts, greedy + sampled)


def _samples(rollout: Rollout, prompts, rows: list[int], params: SamplingParams, sampled: bool) -> list[dict]:
    """Generate and score; one dict per response (the eval artifact's samples.jsonl)."""
    trajectories = rollout.run(prompts, rows, params)
    scored = rollout.score(prompts, rows, trajectories)
    failed = {k: v for k, v in scored.result.metrics.items()
              if k in ("reward/errors", "reward/timeouts", "reward/nan") and v}
    if failed:
        logger.warning("evaluation: %s of %d responses scored 0 by the reward pool", failed, len(trajectories))
    # scores: the reward function's alone (no tool rewards); acc: the reward's own where it returned one
    # (math_dapo: score -1/+1, acc 0/1), None elsewhere (not NaN: the samples go to JSON)
    accs = [None if math.isnan(a) else a for a in scored.result.components.get("acc", [math.nan] * len(trajectories))]
    return [{"prompt_index": t.prompt_index, "sampled": sampled, "data_source": prompts.data_sources[t.prompt_index],
             "prompt": prompts.prompts[t.prompt_index][-1]["content"], "response": t.text,
             "ground_truth": str(prompts.ground_truths[t.prompt_index]), "score": score, "acc": acc, "pred": pred,
             "reward_error": error, "finish_reason": t.finish_reason, "response_length": sum(t.response_mask)}
            for t, score, acc, pred, error in zip(trajectories, scored.result.scores, accs, scored.result.preds,
                                                  scored.result.errors, strict=True)]


def score_table(greedy: list[dict], sampled: list[dict], n: int) -> tuple[dict[str, dict[str, float]], dict[str, int]]:
    """Per data_source and over all: acc of the greedy samples, mean/best/maj@n of the sampled ones."""
    by_source: dict[str, list[dict]] = defaultdict(list)
    for s in greedy:
        by_source[s["data_source"]].append(s)
    groups = {**{src: by_source[src] for src in sorted(by_source)}, ALL: greedy}
    scores, counts = {}, {}
    for src, rows in groups.items():
        scores[src] = {"acc": sum(sample_value(s) for s in rows) / len(rows)}  # as validation's mean@1
        counts[src] = len(rows)
        if sampled:
            mine = [s for s in sampled if src == ALL or s["data_source"] == src]
            metrics = group_metrics(mine, n, prefix="eval")
            names = (f"mean@{n}", f"best@{n}", f"worst@{n}", f"maj@{n}")
            scores[src].update({name: metrics[f"eval/acc/{name}"] for name in names})
    return scores, counts


# ---- results: table rows and the base / SFT / RL comparison -------------------------------------


def summary(result: EvalResult, label: str, model: str, dataset: str, eval_ref: str) -> dict:
    """A JSON-able record of one model's evaluation (what the pipeline's evaluate task returns)."""
    return {"label": label, "model": model, "dataset": dataset, "eval": eval_ref, "engine": result.engine,
            "acc": result.acc, "scores": result.scores, "num_prompts": result.num_prompts}


def eval_rows(record: dict) -> list[dict]:
    """The `evals` table rows of one `summary` record (schema in the module docstring)."""
    return [{"model": record["model"], "eval": record["eval"], "dataset": record["dataset"], "split": "validation",
             "engine": record["engine"], "data_source": src, "metric": metric, "value": float(value),
             "num_prompts": int(record["num_prompts"][src])}
            for src, metrics in record["scores"].items() for metric, value in metrics.items()]


def comparison_rows(records: dict[str, dict]) -> list[dict]:
    """One row per (data_source, metric), one column per model label (None where a model lacks it)."""
    keys = list(dict.fromkeys((src, metric) for r in records.values()
                              for src, metrics in r["scores"].items() for metric in metrics))
    return [{"data_source": src, "metric": metric,
             **{label: r["scores"].get(src, {}).get(metric) for label, r in records.items()}} for src, metric in keys]


def comparison_markdown(records: dict[str, dict]) -> str:
    """A markdown report: the comparison table (percent) and what each column was made from."""
    labels = list(records)
    lines = ["# Held-out evaluation: " + " vs ".join(labels), "",
             "| data_source | metric | " + " | ".join(labels) + " |", "|---|---|" + "---:|" * len(labels)]
    for row in comparison_rows(records):
        cells = ["-" if row[label] is None else f"{100 * row[label]:.1f}%" for label in labels]
        lines.append(f"| {row['data_source']} | {row['metric']} | " + " | ".join(cells) + " |")
    lines += ["", "| model | artifact | engine | prompts | eval |", "|---|---|---|---:|---|"]
    lines += [f"| {label} | `{r['model']}` | {r['engine']} | {r['num_prompts'][ALL]} | `{r['eval']}` |"
              for label, r in records.items()]
    return "\n".join(lines) + "\n"
