"""Cache keys of the stage tasks (tasks/stages.py): what makes Prefect run a stage again, or reuse its result.

Each task's cache key is the hash of the config sections the stage reads (`*_sections`) plus the versions of its input
artifacts (and the store as resolved: `store_identity`), so changing an unrelated section (say `evaluate`) does not
re-run SFT, plus the content of every local file the stage reads through a path (data files, a reward function
file, a local model folder: `content_digest`), so replacing a file behind the same path is a cache miss. A cached
result that names an artifact the store no longer holds (deleted as corrupt, or by hand) is a cache miss
(`live_key`). Code changes do not invalidate the cache (every manifest records the code version), so that a refactor
never re-runs a day of RL; a fix that changes what a stage writes for the same config and inputs bumps the stage's
entry in `OUTPUT_VERSIONS` instead, and results cached before it are not reused.

`--refresh-cache` (Prefect's refresh) writes the time it started beside the cached results (`REFRESH_MARKER`), and
a result cached before it is a miss from then on, whether the refresh finished that stage or not: resuming a refresh
that failed (with the command the console prints, which has no --refresh-cache) must not hand back the results it
was refreshing, nor those of the stages after the one that failed.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel

from infra import prefect_env

prefect_env.configure()

from prefect import get_run_logger  # noqa: E402
from prefect.context import TaskRunContext  # noqa: E402
from prefect.exceptions import MissingContextError  # noqa: E402
from prefect.results import ResultStore  # noqa: E402
from prefect.settings import get_current_settings  # noqa: E402

from infra.artifacts import ArtifactRef, file_sha256  # noqa: E402
from infra.config import Config, config_hash  # noqa: E402
from infra.config_sections import StorageConfig  # noqa: E402
from infra.store import ArtifactStore  # noqa: E402

# What each stage's output is, as far as the cache is concerned; a stage not named here is at 1. Bump one when a fix
# changes the stage's output for the same config and inputs. merge 2: merged models are cast to the run's dtype
# (before: float32 whatever model.dtype said). data-prep 2: data.max_train_samples / max_validation_samples draw rows
# at random (before: the first rows), and SFT files of tool_agent rows name it (agent_name); other datasets are the
# same bytes, so the stages after them stay cached.
OUTPUT_VERSIONS = {"merge": 2, "data-prep": 2}


def stage_key(stage: str, sections: Callable[[Config], tuple], inputs: tuple[str, ...] = ()) -> Callable:
    """A Prefect cache_key_fn over the stage's config sections, its input artifact refs and its OUTPUT_VERSIONS."""
    prefix = stage if OUTPUT_VERSIONS.get(stage, 1) == 1 else f"{stage}-v{OUTPUT_VERSIONS[stage]}"

    def key_fn(context: TaskRunContext | None, params: dict) -> str:
        cfg: Config = params["cfg"]
        key = f"{prefix}-{stage_hash(cfg, sections, [params[name] for name in inputs])}"
        if context is None:  # called outside a task run
            return key
        if get_current_settings().tasks.refresh_cache:
            note_refresh(context.result_store, str(context.task_run.flow_run_id))
        return live_key(key, cfg, context.result_store)

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
    base, store, refreshed = key, None, refreshed_at(results)
    while results.exists(key):
        if refreshed is not None and _written_before(results, key, refreshed):
            if key == base:
                run_logger().info("the result cached under %s is older than the last --refresh-cache run: running the "
                                  "task again", key)
            key = f"{base}-refresh-{hashlib.sha256(f'{key} {refreshed}'.encode()).hexdigest()[:16]}"
            continue
        try:
            value = results.read(key).result
        except Exception:  # noqa: BLE001 - an unreadable record: Prefect's own read of it decides, as before
            return key
        store = store or ArtifactStore.from_config(cfg.storage)
        missing = [str(ref) for ref in _artifact_refs(value) if not store.exists(ref)]
        if not missing:
            return key
        if key == base:  # once: a later link of the chain names the same artifact when its content is the same
            run_logger().warning("the cached result of %s names %s, which the store at %s no longer holds: running the "
                              "task again", key, ", ".join(missing), cfg.storage.root)
        key = f"{base}-{hashlib.sha256(json.dumps([key, value], default=str).encode()).hexdigest()[:16]}"
    return key


REFRESH_MARKER = ".refresh-started"  # in the result storage's folder: {"flow_run": id, "time": epoch seconds}


def _result_folder(results: ResultStore) -> Path | None:
    """The local folder of the cached results (PREFECT_RESULTS_LOCAL_STORAGE_PATH); None for other storage."""
    base = getattr(results.result_storage, "basepath", None)
    return Path(base).expanduser() if base else None


def note_refresh(results: ResultStore, flow_run: str) -> None:
    """Record that a --refresh-cache flow run started now (once per flow run: its first task's key writes it)."""
    folder = _result_folder(results)
    if folder is None:
        return
    marker = folder / REFRESH_MARKER
    try:
        if json.loads(marker.read_text()).get("flow_run") == flow_run:
            return
    except (OSError, ValueError):
        pass  # none yet, or unreadable: written below
    folder.mkdir(parents=True, exist_ok=True)
    tmp = marker.with_name(f"{REFRESH_MARKER}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"flow_run": flow_run, "time": time.time()}))
    tmp.replace(marker)


def refreshed_at(results: ResultStore) -> float | None:
    """When the last --refresh-cache flow run started (epoch seconds), or None."""
    folder = _result_folder(results)
    try:
        return float(json.loads((folder / REFRESH_MARKER).read_text())["time"]) if folder else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _written_before(results: ResultStore, key: str, when: float) -> bool:
    folder = _result_folder(results)
    try:
        return folder is not None and (folder / key).stat().st_mtime < when
    except OSError:
        return False


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


def run_logger() -> logging.Logger | logging.LoggerAdapter:
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


def data_sections(cfg: Config) -> tuple:
    return cfg.data, str(cfg.run.seed), content_digest(cfg.data.path), content_digest(cfg.data.gsm8k_path)


def base_model_sections(cfg: Config) -> tuple:
    return cfg.model.path, cfg.model.tiny, str(cfg.run.seed), content_digest(cfg.model.path)


# Settings that change when or how a training stage runs, not what it trains: hashed at their defaults, so that
# changing one (raising a timeout, a tolerance or a limit that a failure asked for, saving more often, offloading or
# smaller micro-batches after running out of memory: the losses take global denominators, so the split does not
# change the update) resumes the same run's checkpoints instead of starting a new run from step 0. Configs with the
# defaults keep the keys they had. Among them the automatic (None) settings, which the workers decide per machine
# and the run's config.yaml records as decided: rerunning that file, or a recipe that sets one to what the machine
# decides, finds the run it came from.
SFT_OPERATIONAL = ("save_freq", "max_ckpt_to_keep", "offload", "micro_batch_size")
_DEVICE = ("offload", "optimizer_offload", "reshard_after_forward", "grad_sync_every_micro_batch", "micro_batch_size",
           "use_dynamic_bsz", "max_token_len_per_device")
RL_OPERATIONAL = ("save_freq", "max_ckpt_to_keep", "no_signal_frac", "no_signal_steps", "reward.num_workers",
                  "async_training.rollout_timeout_s",
                  *(f"{role}.{name}" for role in ("actor", "critic") for name in _DEVICE),
                  "actor.gradient_checkpointing", "actor.use_remove_padding", "actor.use_torch_compile",
                  "actor.logprob_chunk_tokens", "rollout.prefix_cache_rows", "rollout.free_cache_engine",
                  "rollout.gpu_memory_utilization", "rollout.logprob_check_freq", "rollout.logprob_check_tol",
                  "rollout.logprob_check_tokens", "algorithm.max_num_gen_batches")


def at_defaults(section: BaseModel, fields: tuple[str, ...]) -> BaseModel:
    """A copy of `section` with the dotted `fields` set to their defaults."""
    updates: dict[str, object] = {}
    nested: dict[str, list[str]] = {}
    for path in fields:
        head, _, rest = path.partition(".")
        if rest:
            nested.setdefault(head, []).append(rest)
        else:
            updates[head] = type(section).model_fields[head].get_default(call_default_factory=True)
    for head, rests in nested.items():
        updates[head] = at_defaults(getattr(section, head), tuple(rests))
    return section.model_copy(update=updates)


def sft_sections(cfg: Config) -> tuple:
    """With tools, a multi-turn row's prompt renders their schemas: their files are part of it (without tools, the
    key is what it was before tools reached SFT prompts)."""
    mt = cfg.rl.multi_turn
    with_tools = mt.tool_config_path or mt.tool_functions
    tools = (mt.tool_config_path, *mt.tool_functions, *_tool_file_digests(cfg)) if with_tools else ()
    return at_defaults(cfg.sft, SFT_OPERATIONAL), cfg.model, cfg.data, str(cfg.run.seed), *tools


def _tool_digests(cfg: Config) -> tuple:
    """The content of the tool files of rl.multi_turn: its YAMLs (tools, interactions) and its function tools' files."""
    tool_yaml, *functions = _tool_file_digests(cfg)
    return tool_yaml, content_digest(cfg.rl.multi_turn.interaction_config_path), *functions  # the order of old keys


def _tool_file_digests(cfg: Config) -> tuple:
    """The content of the files that define the tools (their schemas reach the prompts): the YAML, the functions'."""
    mt = cfg.rl.multi_turn
    return (content_digest(mt.tool_config_path),
            *(content_digest(spec.rpartition(":")[0]) for spec in mt.tool_functions if ":" in spec))


def rl_sections(cfg: Config) -> tuple:
    reward = cfg.rl.reward
    return (at_defaults(cfg.rl, RL_OPERATIONAL), cfg.model, cfg.data, str(cfg.run.seed),
            content_digest(reward.custom_path), content_digest(reward.reward_model_path), *_tool_digests(cfg))


def merge_sections(cfg: Config) -> tuple:
    return cfg.model.lora, cfg.model.trust_remote_code


def eval_sections(cfg: Config) -> tuple:
    """What evaluation results depend on: the engine as resolved here (auto -> vllm or hf), the prompt
    and response lengths, dtype, the reward function (its file's content too), the sampling seed and the number of
    eval workers (each samples its own share of the prompts with the run's seed, so the shares decide the samples)."""
    from stages.evaluate import resolve_engine

    ev, reward = cfg.evaluate, cfg.rl.reward
    return (ev.model_copy(update={"engine": resolve_engine(ev.engine)}), cfg.data.max_prompt_length,
            cfg.data.max_response_length, cfg.data.filter_overlong_prompts, cfg.data.truncation, cfg.model.dtype,
            reward.custom_path, reward.custom_function, reward.math_scorer, str(reward.timeout_s), str(cfg.run.seed),
            str(cfg.ray.num_devices_per_node * cfg.ray.num_nodes), content_digest(reward.custom_path),
            cfg.rl.multi_turn, *_tool_digests(cfg))
