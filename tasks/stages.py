"""Prefect tasks: thin wrappers that run a stage, version its outputs in the store and cache the result.

Each task's cache key is the hash of the config sections the stage reads plus the versions of its input
artifacts (and the store as resolved: `store_identity`), so changing an unrelated section (say `evaluate`) does not
re-run SFT, plus the content of every local file the stage reads through a path (data files, a reward function
file, a local model folder: `content_digest`), so replacing a file behind the same path is a cache miss.
Tasks return artifact references as strings (`kind/name@version`); results persist as JSON under
PREFECT_RESULTS_LOCAL_STORAGE_PATH. A cached result that names an artifact the store no longer holds (deleted as
corrupt, or by hand) is a cache miss (`live_key`). Code changes do not invalidate the cache (every manifest records
the code version); run with `--refresh-cache` to force a re-run: every stage runs again, SFT and RL from step 0
(`RefreshedCheckpoints`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

from infra import prefect_env

prefect_env.configure()

from prefect import get_run_logger, task  # noqa: E402
from prefect.context import TaskRunContext  # noqa: E402
from prefect.exceptions import MissingContextError  # noqa: E402
from prefect.results import ResultStore  # noqa: E402
from prefect.settings import get_current_settings  # noqa: E402

from infra.artifacts import ArtifactRef, file_sha256  # noqa: E402
from infra.checkpoints import StoreCheckpoints  # noqa: E402
from infra.config import Config, StorageConfig, apply_override, config_hash  # noqa: E402
from infra.console import bars_closed_on_error  # noqa: E402
from infra.lease import LeaseLost, stage_lease  # noqa: E402
from infra.orphans import SCRATCH  # noqa: E402
from infra.store import ArtifactStore, CorruptArtifactError  # noqa: E402
from infra.tracking import Tracker  # noqa: E402
from stages.merge import checkpoint_metadata  # noqa: E402
from stages.model.safe_load import UnsafeCheckpointError  # noqa: E402
from stages.rewards.pool import RewardFailedError  # noqa: E402


@dataclass(frozen=True)
class RunContext:
    """What every task of one flow run shares; never part of a cache key."""

    run_id: str
    run_dir: str

    @property
    def tmp_dir(self) -> Path:
        """The flow's temporary folders go here (infra/orphans.py removes it, after a kill too)."""
        return Path(self.run_dir) / SCRATCH


def stage_key(stage: str, sections: Callable[[Config], tuple], inputs: tuple[str, ...] = ()) -> Callable:
    """A Prefect cache_key_fn over the stage's config sections and its input artifact refs."""

    def key_fn(context: TaskRunContext | None, params: dict) -> str:
        cfg: Config = params["cfg"]
        key = f"{stage}-{stage_hash(cfg, sections, [params[name] for name in inputs])}"
        return live_key(key, cfg, context.result_store) if context else key  # None: called outside a task run

    return key_fn


def stage_hash(cfg: Config, sections: Callable[[Config], tuple], inputs: list[str]) -> str:
    return config_hash(*sections(cfg), *map(_input_identity, inputs), *store_identity(cfg.storage))


def store_identity(storage: StorageConfig) -> tuple[str, ...]:
    """`ArtifactStore.identity`: a relative root is relative to the working directory, while PREFECT_HOME and its
    cached results are not, so the key holds the root as the store resolves it."""
    return ArtifactStore.from_config(storage).identity


def live_key(key: str, cfg: Config, results: ResultStore) -> str:
    """`key`, unless the result cached under it in `results` (the task run's result store) names an artifact that the
    store no longer holds (deleted as corrupt, removed by hand): then a key derived from it and from that result,
    which Prefect has not cached (a miss: the task runs again and caches its result there) or under which it cached
    the re-run's result. Costs, only where a result is cached, one read of it and one manifest read per artifact ref
    in it."""
    base, store = key, None
    while results.exists(key):
        try:
            value = results.read(key).result
        except Exception:  # noqa: BLE001 - an unreadable record: Prefect's own read of it decides, as before
            return key
        store = store or open_store(cfg)
        missing = [str(ref) for ref in _artifact_refs(value) if not store.exists(ref)]
        if not missing:
            return key
        if key == base:  # once: a later link of the chain names the same artifact when its content is the same
            _logger().warning("the cached result of %s names %s, which the store at %s no longer holds: running the "
                              "task again", key, ", ".join(missing), cfg.storage.root)
        key = f"{base}-{hashlib.sha256(json.dumps([key, value], default=str).encode()).hexdigest()[:16]}"
    return key


def _artifact_refs(value: object) -> list[ArtifactRef]:
    """The artifact refs in a task's result: the result itself (a ref string), or the string values of a record
    (evaluate's summary); other strings (a hub id, a local path) are no refs."""
    refs = []
    for item in value.values() if isinstance(value, dict) else [value]:
        if isinstance(item, str):
            try:
                refs.append(ArtifactRef.parse(item))
            except ValueError:
                continue
    return refs


def _logger() -> logging.Logger | logging.LoggerAdapter:
    """The task run's logger (its messages reach the run's logs), or this module's outside a run."""
    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger(__name__)


def _input_identity(value: str) -> str:
    """An artifact ref as is (its version is a content hash); a local path as path + content digest, so that
    replacing the files behind the same path is a new input; anything else (a hub id) as is."""
    try:
        ArtifactRef.parse(value)
        return value
    except ValueError:
        return f"{value}#{content_digest(value)}" if value and Path(value).exists() else value


def content_digest(path: str | None) -> str | None:
    """sha256 over a local file's bytes, or over a folder's (relative path, file sha256) pairs; None for None or
    a path that does not exist here (a hub id, or a dataset name)."""
    if not path or not Path(path).exists():
        return None
    root = Path(path).resolve()
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    digest = hashlib.sha256()
    for file in files:
        stat = file.stat()
        digest.update(f"{file.relative_to(root) if file != root else ''}\0".encode())
        digest.update(_file_digest(str(file), stat.st_size, stat.st_mtime_ns).encode())
    return digest.hexdigest()[:16]


@functools.lru_cache(maxsize=4096)
def _file_digest(path: str, size: int, mtime_ns: int) -> str:
    """A file's sha256, computed once per (path, size, mtime) in this process: cache keys of several stages hash
    the same model folder."""
    return file_sha256(Path(path))


def _data_sections(cfg: Config) -> tuple:
    return cfg.data, str(cfg.run.seed), content_digest(cfg.data.path), content_digest(cfg.data.gsm8k_path)


def _base_model_sections(cfg: Config) -> tuple:
    return cfg.model.path, cfg.model.tiny, str(cfg.run.seed), content_digest(cfg.model.path)


def _sft_sections(cfg: Config) -> tuple:
    return cfg.sft, cfg.model, cfg.data, str(cfg.run.seed)


def _tool_digests(cfg: Config) -> tuple:
    """The content of the tool files of rl.multi_turn: its YAMLs (tools, interactions) and its function tools' files."""
    mt = cfg.rl.multi_turn
    return (content_digest(mt.tool_config_path), content_digest(mt.interaction_config_path),
            *(content_digest(spec.rpartition(":")[0]) for spec in mt.tool_functions if ":" in spec))


def _rl_sections(cfg: Config) -> tuple:
    reward = cfg.rl.reward
    return (cfg.rl, cfg.model, cfg.data, str(cfg.run.seed), content_digest(reward.custom_path),
            content_digest(reward.reward_model_path), *_tool_digests(cfg))


def _merge_sections(cfg: Config) -> tuple:
    return cfg.model.lora, cfg.model.trust_remote_code


def _eval_sections(cfg: Config) -> tuple:
    """What evaluation results depend on: the engine as resolved here (auto -> vllm or hf), the prompt
    and response lengths, dtype, the reward function (its file's content too) and the sampling seed."""
    from stages.evaluate import resolve_engine

    ev, reward = cfg.evaluate, cfg.rl.reward
    return (ev.model_copy(update={"engine": resolve_engine(ev.engine)}), cfg.data.max_prompt_length,
            cfg.data.max_response_length, cfg.data.filter_overlong_prompts, cfg.data.truncation, cfg.model.dtype,
            reward.custom_path, reward.custom_function, reward.math_scorer, str(reward.timeout_s), str(cfg.run.seed),
            content_digest(reward.custom_path), cfg.rl.multi_turn, *_tool_digests(cfg))


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
    code: what a refresh is for). `save` replaces the earlier run's checkpoints as usual; `latest` says so."""

    def latest(self) -> Path | None:
        newest = self.latest_ref()
        if newest is None:
            return None
        manifest = self.store.manifest(newest)
        if manifest.metadata.get("flow_run") != self.metadata["flow_run"]:
            _logger().warning(
                "--refresh-cache: %s trains again from step 0 instead of resuming from %s (step %s, saved by flow run "
                "%s); that run's checkpoints (and, for RL, its trajectory tables) are replaced by this run's",
                self.name, newest, manifest.metadata.get("step"), manifest.metadata.get("flow_run"))
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
# raises, a corrupt artifact, a lease another run holds now. Retrying them doubled the time to fail and printed
# the error twice; what remains retried is what can pass on a second attempt (a stalled store, a dead worker).
REPEATABLE = (ValueError, TypeError, LookupError, AttributeError, ImportError, NotImplementedError, FileNotFoundError,
              PermissionError, RewardFailedError, CorruptArtifactError, UnsafeCheckpointError, LeaseLost)


def transient(_task, _task_run, state) -> bool:
    """Prefect's retry_condition_fn: retry unless the failure is one a retry would repeat (`REPEATABLE`)."""
    error = state.result(raise_on_failure=False)
    return not isinstance(error, REPEATABLE) and not isinstance(getattr(error, "cause", None), REPEATABLE)


def local_model_path(store: ArtifactStore, model: str) -> str:
    """A model input is an artifact ref (fetched from the store) or a local folder / hub id (as is)."""
    try:
        ref = ArtifactRef.parse(model)
    except ValueError:
        return model
    return str(store.get_dir(ref))


@task(name="data-prep", cache_key_fn=stage_key("data-prep", _data_sections), persist_result=True,
      result_serializer="json", retries=1, retry_condition_fn=transient)
def data_prep_task(cfg: Config, ctx: RunContext) -> str:
    from stages.data_prep import run_data_prep

    log = get_run_logger()
    store = open_store(cfg)
    with tempfile.TemporaryDirectory(dir=ctx.tmp_dir) as tmp:
        stats = run_data_prep(cfg.data, cfg.run.seed, Path(tmp))
        ref = store.put_dir("dataset", cfg.data.source, Path(tmp),
                            inputs={"source": _data_origin(cfg)}, config_hash=stage_hash(cfg, _data_sections, []),
                            metadata={"stats": stats})
    log.info("data prep: %s (%d train, %d validation rows)", ref, stats["num_train"], stats["num_validation"])
    return str(ref)


def _data_origin(cfg: Config) -> str:
    return {"synthetic": "synthetic-generator", "gsm8k": cfg.data.gsm8k_path, "file": str(cfg.data.path)}[
        cfg.data.source
    ]


@task(name="base-model", cache_key_fn=stage_key("base-model", _base_model_sections, ("dataset",)),
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
                            config_hash=stage_hash(cfg, _base_model_sections, [dataset]))
    get_run_logger().info("base model: %s", ref)
    return str(ref)


@task(name="sft", cache_key_fn=stage_key("sft", _sft_sections, ("dataset", "base_model")), persist_result=True,
      result_serializer="json", retries=1, retry_condition_fn=transient)
def sft_task(cfg: Config, dataset: str, base_model: str, ctx: RunContext) -> str:
    """SFT from `base_model`; resumes from this configuration's checkpoints. With --refresh-cache it trains again
    from step 0 (`RefreshedCheckpoints`: an earlier run's checkpoints are replaced as this one saves its own)."""
    from stages.sft import run_sft

    store = open_store(cfg)
    key = stage_hash(cfg, _sft_sections, [dataset, base_model])
    inputs = {"dataset": dataset, "base_model": base_model}
    checkpoints = stage_checkpoints(store, f"sft-{key}", cfg.sft.max_ckpt_to_keep, inputs, cfg, ctx)
    data_dir = store.get_dir(ArtifactRef.parse(dataset))
    with stage_lease(store, f"sft-{key}", ctx.run_id):
        made = [m.ref for m in store.versions("model", "sft") if m.config_hash == key]
        if made and not refresh_cache():  # a concurrent flow with the same config
            return str(made[-1])  # trained it while this one waited for the lease
        with tempfile.TemporaryDirectory(dir=ctx.tmp_dir) as tmp, _tracker(cfg, ctx, "sft") as tracker, \
                bars_closed_on_error():
            result = run_sft(cfg, local_model_path(store, base_model), data_dir, Path(tmp), checkpoints, tracker)
            ref = store.put_dir("model", "sft", Path(tmp), inputs=inputs, config_hash=key,
                                metadata={"steps": result.num_steps, "metrics": result.final_metrics})
    get_run_logger().info("sft model: %s after %d steps", ref, result.num_steps)
    return str(ref)


# The cache key's prefix says what the task returns (a checkpoint since the merge stage exists), so a result
# cached by an older version of this task (a model ref) is never handed to merge.
@task(name="rl", cache_key_fn=stage_key("rl-checkpoint", _rl_sections, ("dataset", "init_model")),
      persist_result=True, result_serializer="json", retries=1, retry_condition_fn=transient)
def rl_task(cfg: Config, dataset: str, init_model: str, ctx: RunContext) -> str:
    """RL from `init_model` (the SFT model, or the base model when SFT is off); resumes from checkpoints.

    Returns the final checkpoint's ref (the RL loop always checkpoints its last step; RL writes no model
    folder); `merge` turns it into a model. A final checkpoint of this configuration is returned as it is (a
    concurrent flow trained it, or Prefect lost the cached result), except with --refresh-cache: then RL trains
    again from step 0, like SFT (`RefreshedCheckpoints`: the earlier run's checkpoints and trajectory tables
    are replaced as this run writes its own, which a warning says).
    """
    from infra.trajectories import RunTables
    from stages.rl import run_rl

    store = open_store(cfg)
    key = stage_hash(cfg, _rl_sections, [dataset, init_model])
    inputs = {"dataset": dataset, "init_model": init_model}
    run_id = f"rl-{key}"  # stable across retries and resumes: trajectories of one RL run stay in one place
    checkpoints = stage_checkpoints(store, run_id, cfg.rl.max_ckpt_to_keep, inputs, cfg, ctx)
    data_dir = store.get_dir(ArtifactRef.parse(dataset))
    with stage_lease(store, run_id, ctx.run_id):
        final = checkpoints.at_step(cfg.rl.total_steps)
        if final and not refresh_cache():  # a concurrent flow with the same config trained it while this one
            return str(final)  # waited for the lease
        with _tracker(cfg, ctx, "rl") as tracker, bars_closed_on_error():
            result = run_rl(cfg, local_model_path(store, init_model), data_dir, checkpoints,
                            RunTables(store, run_id), tracker)
    record_automatic_settings(store, ctx, result.automatic)
    get_run_logger().info("rl: %d steps, final checkpoint %s (trajectories: run_id=%s)", result.num_steps,
                          result.checkpoint, run_id)
    return str(result.checkpoint)


@task(name="merge", cache_key_fn=stage_key("merge", _merge_sections, ("checkpoint", "base_model")),
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
                             config_hash=stage_hash(cfg, _merge_sections, [checkpoint, base_model]))
    get_run_logger().info("merge: %s (step %d%s) -> %s", ref, source.step,
                          f", LoRA r={result.lora_rank} merged" if result.lora_rank else "", model)
    return str(model)


@task(name="evaluate", cache_key_fn=stage_key("evaluate", _eval_sections, ("dataset", "model")),
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
                            config_hash=stage_hash(cfg, _eval_sections, [dataset, model]),
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

def _tracker(cfg: Config, ctx: RunContext, stage: str) -> Tracker:
    return Tracker.from_config(cfg.tracking, f"{ctx.run_id}-{stage}", Path(ctx.run_dir), cfg.model_dump(mode="json"))
