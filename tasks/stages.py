"""Prefect tasks: thin wrappers that run a stage, version its outputs in the store and cache the result.

Each task is cached on the config sections its stage reads, its input artifacts' versions and the content of the
local files it reads (tasks/cache_keys.py). Tasks return artifact references as strings (`kind/name@version`);
results persist as JSON under PREFECT_RESULTS_LOCAL_STORAGE_PATH. Run with `--refresh-cache` to force a re-run:
every stage runs again, SFT and RL from step 0 (`RefreshedCheckpoints`). Prefect retries a stage once only for a
failure a second attempt can pass (`transient`).
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml

from infra import prefect_env

prefect_env.configure()

from prefect import get_run_logger, task  # noqa: E402
from prefect.settings import get_current_settings  # noqa: E402

from infra.artifacts import ArtifactRef  # noqa: E402
from infra.checkpoints import StoreCheckpoints  # noqa: E402
from infra.config import Config, apply_override  # noqa: E402
from infra.console import bars_closed_on_error  # noqa: E402
from infra.lease import LeaseLost, stage_lease  # noqa: E402
from infra.orphans import SCRATCH  # noqa: E402
from infra.store import ArtifactStore, CorruptArtifactError  # noqa: E402
from infra.tracking import Tracker  # noqa: E402
from stages.merge import checkpoint_metadata  # noqa: E402
from stages.model.safe_load import UnsafeCheckpointError  # noqa: E402
from stages.rewards.pool import RewardFailedError  # noqa: E402
from tasks.cache_keys import (  # noqa: E402
    base_model_sections,
    data_sections,
    eval_sections,
    merge_sections,
    rl_sections,
    run_logger,
    sft_sections,
    stage_hash,
    stage_key,
)


@dataclass(frozen=True)
class RunContext:
    """What every task of one flow run shares; never part of a cache key."""

    run_id: str
    run_dir: str

    @property
    def tmp_dir(self) -> Path:
        """The flow's temporary folders go here (infra/orphans.py removes it, after a kill too)."""
        return Path(self.run_dir) / SCRATCH


def record_automatic_settings(store: ArtifactStore, ctx: RunContext, decided: dict[str, object]) -> None:
    """Write the settings the workers decided (None = automatic in the recipe) into the run's config.yaml, in the
    run folder and in the store, so that the file states what ran (and reruns it as a recipe)."""
    if not decided:
        return
    path = Path(ctx.run_dir) / "config.yaml"
    tree = yaml.safe_load(path.read_text())
    for key, value in decided.items():
        apply_override(tree, key.split("."), value)
    text = yaml.safe_dump(tree, sort_keys=False)
    tmp = path.with_suffix(".yaml.tmp")
    tmp.write_text(text)
    tmp.replace(path)
    store.write_bytes(f"runs/{ctx.run_id}/config.yaml", text.encode())


def refresh_cache() -> bool:
    """Whether this run was started with --refresh-cache (PREFECT_TASKS_REFRESH_CACHE)."""
    return bool(get_current_settings().tasks.refresh_cache)


class RefreshedCheckpoints(StoreCheckpoints):
    """A stage's checkpoints under --refresh-cache: the stage trains again from step 0, so it resumes only from a
    checkpoint this flow run saved (a retry of the task), never from an earlier run's (which may come from older
    code: what a refresh is for). `latest` removes an earlier run's checkpoints at once and says so (a refresh that
    failed before its first save left them, and a plain resume then took the old final checkpoint for SFT's); RL
    then removes its trajectory tables too (`RLTrainer.resume`)."""

    def latest(self) -> Path | None:
        newest = self.latest_ref()
        if newest is None:
            return None
        manifest = self.store.manifest(newest)
        if manifest.metadata.get("flow_run") != self.metadata["flow_run"]:
            run_logger().warning(
                "--refresh-cache: %s trains again from step 0 instead of resuming from %s (step %s, saved by flow run "
                "%s); that run's checkpoints (and, for RL, its trajectory tables) are removed",
                self.name, newest, manifest.metadata.get("step"), manifest.metadata.get("flow_run"))
            self.clear()
            return None
        return super().latest()


def stage_checkpoints(store: ArtifactStore, name: str, max_to_keep: int, inputs: dict[str, str], cfg: Config,
                      ctx: RunContext) -> StoreCheckpoints:
    """A training stage's checkpoints; each records the flow run that saved it (for RefreshedCheckpoints)."""
    kind = RefreshedCheckpoints if refresh_cache() else StoreCheckpoints
    return kind(store, name, max_to_keep, inputs, {**checkpoint_metadata(cfg.model), "flow_run": ctx.run_id},
                ctx.tmp_dir)


def open_store(cfg: Config) -> ArtifactStore:
    return ArtifactStore.from_config(cfg.storage)


# Failures that a second attempt meets again: a bad value, a missing file, a user's reward function that
# raises, a corrupt artifact, a lease another run holds now, a ray.address with no cluster (`RayUnreachable`, a
# ValueError: ConnectionError itself is an OSError, as a stalled store's errors are). Retrying them doubled the time
# to fail and printed the error twice; what remains retried is what can pass on a second attempt (a stalled store, a
# dead worker).
REPEATABLE = (ValueError, TypeError, LookupError, AttributeError, ImportError, NotImplementedError, FileNotFoundError,
              PermissionError, RewardFailedError, CorruptArtifactError, UnsafeCheckpointError, LeaseLost)


def transient(_task, _task_run, state) -> bool:
    """Prefect's retry_condition_fn: retry unless the failure is one a retry would repeat (`REPEATABLE`): the error
    itself, the error a Ray task raised (`.cause`), the one it was raised from (`__cause__`: the async modes'
    RolloutFailed wraps the producer's), or the one a Ray worker's __init__ raised (a model that cannot load)."""
    error, seen = state.result(raise_on_failure=False), 0
    while isinstance(error, BaseException) and seen < 8:
        if isinstance(error, REPEATABLE) or _init_raised_repeatable(error):
            return False
        error, seen = getattr(error, "cause", None) or error.__cause__, seen + 1
    return True


def _init_raised_repeatable(error: BaseException) -> bool:
    """Whether `error` is Ray's ActorDiedError for a worker whose __init__ raised one of REPEATABLE (Ray keeps only
    its traceback's text, which ends with `TypeName: message`)."""
    if not getattr(error, "actor_init_failed", False):
        return False
    lines = [line.strip() for line in str(getattr(error, "error_msg", "")).splitlines() if line.strip()]
    names = {cls.__name__ for cls in REPEATABLE} | {sub.__name__ for cls in REPEATABLE for sub in cls.__subclasses__()}
    return any(line.split(":", 1)[0].rsplit(".", 1)[-1] in names for line in lines[-3:])


def local_model_path(store: ArtifactStore, model: str) -> str:
    """A model input is an artifact ref (fetched from the store) or a local folder / hub id (as is)."""
    try:
        ref = ArtifactRef.parse(model)
    except ValueError:
        return model
    return str(store.get_dir(ref))


@task(name="data-prep", cache_key_fn=stage_key("data-prep", data_sections), persist_result=True,
      result_serializer="json", retries=1, retry_condition_fn=transient)
def data_prep_task(cfg: Config, ctx: RunContext) -> str:
    from stages.data_prep import run_data_prep

    log = get_run_logger()
    store = open_store(cfg)
    with tempfile.TemporaryDirectory(dir=ctx.tmp_dir) as tmp:
        stats = run_data_prep(cfg.data, cfg.run.seed, Path(tmp))
        ref = store.put_dir("dataset", cfg.data.source, Path(tmp),
                            inputs={"source": _data_origin(cfg)}, config_hash=stage_hash(cfg, data_sections, []),
                            metadata={"stats": stats})
    log.info("data prep: %s (%d train, %d validation rows)", ref, stats["num_train"], stats["num_validation"])
    return str(ref)


def _data_origin(cfg: Config) -> str:
    return {"synthetic": "synthetic-generator", "gsm8k": cfg.data.gsm8k_path, "file": str(cfg.data.path)}[
        cfg.data.source
    ]


@task(name="base-model", cache_key_fn=stage_key("base-model", base_model_sections, ("dataset",)),
      persist_result=True, result_serializer="json")
def base_model_task(cfg: Config, dataset: str, ctx: RunContext) -> str:
    """'tiny': build the model + tokenizer from the dataset's text; otherwise the path/hub id as given."""
    if cfg.model.path != "tiny":
        return cfg.model.path
    from stages.data_prep import corpus_texts
    from stages.model.tiny import build_tiny_model

    store = open_store(cfg)
    data_dir = store.get_dir(ArtifactRef.parse(dataset))
    with tempfile.TemporaryDirectory(dir=ctx.tmp_dir) as tmp:
        build_tiny_model(cfg.model.tiny, corpus_texts(data_dir), cfg.run.seed, tmp)
        ref = store.put_dir("model", f"base-tiny-{cfg.model.tiny.arch}", Path(tmp), inputs={"dataset": dataset},
                            config_hash=stage_hash(cfg, base_model_sections, [dataset]))
    get_run_logger().info("base model: %s", ref)
    return str(ref)


@task(name="sft", cache_key_fn=stage_key("sft", sft_sections, ("dataset", "base_model")), persist_result=True,
      result_serializer="json", retries=1, retry_condition_fn=transient)
def sft_task(cfg: Config, dataset: str, base_model: str, ctx: RunContext) -> str:
    """SFT from `base_model`; resumes from this configuration's checkpoints. With --refresh-cache it trains again
    from step 0 (`RefreshedCheckpoints`: an earlier run's checkpoints are replaced as this one saves its own)."""
    from stages.sft import run_sft

    store = open_store(cfg)
    key = stage_hash(cfg, sft_sections, [dataset, base_model])
    inputs = {"dataset": dataset, "base_model": base_model}
    checkpoints = stage_checkpoints(store, f"sft-{key}", cfg.sft.max_ckpt_to_keep, inputs, cfg, ctx)
    data_dir = store.get_dir(ArtifactRef.parse(dataset))
    with stage_lease(store, f"sft-{key}", ctx.run_id):
        made = [m.ref for m in store.versions("model", "sft") if m.config_hash == key]
        if made and not refresh_cache():  # a concurrent flow with the same config
            return str(made[-1])  # trained it while this one waited for the lease
        with tempfile.TemporaryDirectory(dir=ctx.tmp_dir) as tmp, _tracker(cfg, ctx, "sft", f"sft-{key}") as tracker, \
                bars_closed_on_error():
            result = run_sft(cfg, local_model_path(store, base_model), data_dir, Path(tmp), checkpoints, tracker)
            ref = store.put_dir("model", "sft", Path(tmp), inputs=inputs, config_hash=key,
                                metadata={"steps": result.num_steps, "metrics": result.final_metrics})
    get_run_logger().info("sft model: %s after %d steps", ref, result.num_steps)
    return str(ref)


# The cache key's prefix says what the task returns (a checkpoint since the merge stage exists), so a result
# cached by an older version of this task (a model ref) is never handed to merge.
@task(name="rl", cache_key_fn=stage_key("rl-checkpoint", rl_sections, ("dataset", "init_model")),
      persist_result=True, result_serializer="json", retries=1, retry_condition_fn=transient)
def rl_task(cfg: Config, dataset: str, init_model: str, ctx: RunContext) -> str:
    """RL from `init_model` (the SFT model, or the base model when SFT is off); resumes from checkpoints.

    Returns the final checkpoint's ref (the RL loop always checkpoints its last step; RL writes no model
    folder); `merge` turns it into a model. A final checkpoint of this configuration is returned as it is (a
    concurrent flow trained it, or Prefect lost the cached result), except with --refresh-cache: then RL trains
    again from step 0, like SFT (`RefreshedCheckpoints`: the earlier run's checkpoints and trajectory tables
    are removed as this run starts, which a warning says).
    """
    from infra.trajectories import RunTables
    from stages.rl import run_rl

    store = open_store(cfg)
    key = stage_hash(cfg, rl_sections, [dataset, init_model])
    inputs = {"dataset": dataset, "init_model": init_model}
    run_id = f"rl-{key}"  # stable across retries and resumes: trajectories of one RL run stay in one place
    checkpoints = stage_checkpoints(store, run_id, cfg.rl.max_ckpt_to_keep, inputs, cfg, ctx)
    data_dir = store.get_dir(ArtifactRef.parse(dataset))
    with stage_lease(store, run_id, ctx.run_id):
        final = checkpoints.at_step(cfg.rl.total_steps)
        if final and not refresh_cache():  # a concurrent flow with the same config trained it while this one
            return str(final)  # waited for the lease
        with _tracker(cfg, ctx, "rl", run_id) as tracker, bars_closed_on_error():
            result = run_rl(cfg, local_model_path(store, init_model), data_dir, checkpoints,
                            RunTables(store, run_id), tracker)
    record_automatic_settings(store, ctx, result.automatic)
    get_run_logger().info("rl: %d steps, final checkpoint %s (trajectories: run_id=%s)", result.num_steps,
                          result.checkpoint, run_id)
    return str(result.checkpoint)


@task(name="merge", cache_key_fn=stage_key("merge", merge_sections, ("checkpoint", "base_model")),
      persist_result=True, result_serializer="json", retries=1, retry_condition_fn=transient)
def merge_task(cfg: Config, checkpoint: str, base_model: str, ctx: RunContext, name: str = "rl") -> str:
    """A checkpoint (+ the model it was trained from) -> a plain HF folder, the versioned artifact model/<name>."""
    from stages.merge import merge_checkpoint, merge_source, store_merged

    store = open_store(cfg)
    ref = ArtifactRef.parse(checkpoint)
    if ref.kind != "checkpoint":
        raise ValueError(f"merge: {checkpoint} is not a checkpoint; re-run the flow with --refresh-cache")
    source = merge_source(store, ref, base_model=base_model)
    with tempfile.TemporaryDirectory(dir=ctx.tmp_dir) as tmp:
        result = merge_checkpoint(source, Path(tmp) / "model")
        model = store_merged(store, source, result, name,
                             config_hash=stage_hash(cfg, merge_sections, [checkpoint, base_model]))
    get_run_logger().info("merge: %s (step %d%s) -> %s", ref, source.step,
                          f", LoRA r={result.lora_rank} merged" if result.lora_rank else "", model)
    return str(model)


@task(name="evaluate", cache_key_fn=stage_key("evaluate", eval_sections, ("dataset", "model")),
      persist_result=True, result_serializer="json")
def evaluate_task(cfg: Config, dataset: str, model: str, label: str, ctx: RunContext) -> dict:
    """Evaluate one model on the dataset's validation split; -> its summary record (stages.evaluate.summary)."""
    from stages.evaluate import evaluate_model, summary

    store = open_store(cfg)
    data_dir = store.get_dir(ArtifactRef.parse(dataset))
    result = evaluate_model(cfg, Path(local_model_path(store, model)), data_dir / "validation.parquet")
    with tempfile.TemporaryDirectory(dir=ctx.tmp_dir) as tmp:
        (Path(tmp) / "metrics.json").write_text(json.dumps(result.scores, indent=2))
        (Path(tmp) / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in result.samples))
        ref = store.put_dir("eval", label, Path(tmp), inputs={"dataset": dataset, "model": model},
                            config_hash=stage_hash(cfg, eval_sections, [dataset, model]),
                            metadata={"engine": result.engine, "acc": result.acc})
    get_run_logger().info("evaluate %s (%s, %s): acc=%.3f -> %s", label, model, result.engine, result.acc, ref)
    return summary(result, label, model, dataset, str(ref))


@task(name="publish-evals")
def publish_evals_task(cfg: Config, records: dict[str, dict], ctx: RunContext) -> list[dict]:
    """This run's comparison of its models: rows of the `evals` table (run_id = this flow run, label = the
    model's label) and Prefect table + markdown artifacts. Not cached: every run publishes its own."""
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    from infra.trajectories import RunTables
    from stages.evaluate import comparison_markdown, comparison_rows, eval_rows

    tables = RunTables(open_store(cfg), ctx.run_id)
    for label, record in records.items():
        tables.write_evals(label, eval_rows(record))
    rows = comparison_rows(records)
    what = " vs ".join(records)
    create_table_artifact(rows, key="post-train-evals", description=f"Held-out evaluation of {what} (run {ctx.run_id})")
    create_markdown_artifact(comparison_markdown(records), key="post-train-evals-report",
                             description=f"Held-out evaluation of {what} (run {ctx.run_id})")
    return rows


@task(name="report", retries=1, retry_condition_fn=transient)
def report_task(cfg: Config, rl_checkpoint: str, ctx: RunContext) -> str:
    """The HTML report of the RL run, saved in the store and linked from a Prefect markdown artifact.
    Not cached: it reads tables that grow (this flow run's evals), and rewriting it is cheap."""
    from prefect.artifacts import create_markdown_artifact

    from infra.report import write_report

    store = open_store(cfg)
    rl_run_id = ArtifactRef.parse(rl_checkpoint).name  # checkpoint/rl-<key>: the RL run's run_id
    url, warnings = write_report(store, rl_run_id, title=f"{cfg.run.name}: RL run {rl_run_id}",
                                 evals_run_id=ctx.run_id, extra={"flow run": ctx.run_id, "store": cfg.storage.root,
                                                                 "RL checkpoint": rl_checkpoint})
    link = url if "://" in url else Path(url).as_uri()
    alerts = "".join(f"> **Warning:** {text}\n\n" for text in warnings)
    create_markdown_artifact(
        key="run-report", description=f"HTML run report of {rl_run_id}",
        markdown=f"# Run report\n\n{alerts}[runs/{ctx.run_id}/report.html]({link}) of RL run `{rl_run_id}`: reward, "
                 "validation accuracy, KL, "
                 "entropy, response length, gradient norm and timing per step; base/SFT/RL evaluation; best and worst "
                 f"rollouts.\n\nFlow run `{ctx.run_id}`, store `{cfg.storage.root}`.\n")
    get_run_logger().info("run report: %s", url)
    return url

def _tracker(cfg: Config, ctx: RunContext, stage: str, stage_run: str) -> Tracker:
    """This flow run's tracking of `stage`; `stage_run` (sft-<key>, rl-<key>) groups the flow runs that resume it."""
    return Tracker.from_config(cfg.tracking, f"{ctx.run_id}-{stage}", Path(ctx.run_dir), cfg.model_dump(mode="json"),
                               group=stage_run)
