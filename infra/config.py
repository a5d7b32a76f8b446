"""Run configuration: pydantic v2 models, one section per stage, YAML recipes and dotted overrides.

A recipe is a YAML file whose top-level keys are the sections below. Command-line overrides are
``section.key=value`` (values parsed as YAML, so ``sft.optim.lr=1e-4`` and
``tracking.backends=[console,wandb]`` work). Unknown keys and bad values raise ``ConfigError`` naming the
key, the value and what is allowed. Defaults live here and nowhere else.

Secrets (S3 credentials, the wandb API key) are never fields: they come from the environment
(``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, ``WANDB_API_KEY``) and so are never written with a run.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from infra.redact import redact, url_credential_fields
from infra.rl_config import OptimConfig, RLConfig


class ConfigError(ValueError):
    """A recipe or override that does not validate; the message names every bad key."""


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RunConfig(Section):
    name: str = Field("demo", min_length=1, pattern=r"^[A-Za-z0-9._-]+$", description="Run name; used in run folders.")
    seed: int = Field(0, ge=0, description="Global seed: data generation, model init, sampling.")
    output_dir: str = Field("outputs", min_length=1, description="Local folder for run folders and Prefect state.")
    source_overrides: dict[str, list[str]] = Field(
        default_factory=dict, description="A record of the overrides given in verl's keys (`--verl KEY=VALUE`, "
        "infra/verl_overrides.py), each with the overrides of this config it became ([]: none). The run reads the "
        "fields themselves; the flow reads this only to turn verl's trainer.total_epochs into rl.total_steps once "
        "the training rows are counted (until then the entry reads `rl.total_steps=<after data prep: ...>`)."
    )


class SyntheticTaskConfig(Section):
    """Exact-answer arithmetic in GSM8K's answer format: 'a + b - c' with worked steps and '#### N'."""

    num_train: int = Field(4000, gt=0, description="Training problems.")
    num_validation: int = Field(200, gt=0, description="Held-out problems; never overlap with training.")
    num_terms: int = Field(3, ge=2, le=6, description="Operands per problem (difficulty).")
    max_operand: int = Field(50, ge=2, le=10**6, description="Operands are drawn from [1, max_operand].")
    operators: list[Literal["+", "-", "*"]] = Field(["+", "-"], min_length=1, description="Operators used.")
    shortcut_fraction: float = Field(
        0.0, ge=0.0, le=0.9,
        description="Share of SFT rows answering with only '#### N' (no work): extra SFT-only copies of training "
        "problems on top of their worked answers; RL prompts are unchanged.",
    )
    tool_call_fraction: float = Field(
        0.0, ge=0.0, le=1.0,
        description="> 0: the calculator task (data/synthetic.py): RL rows use the tool_agent loop with the "
        "calculator, and this share of the SFT rows show the call (the rest answer directly).",
    )


class ColumnMapping(Section):
    """Where a user's file keeps each field; names are column names of the file."""

    question: str = Field("question", description="Column with the prompt text (or a verl chat list).")
    answer: str = Field("answer", description="Column with the ground truth (or a full '... #### N' answer).")
    response: str | None = Field(None, description="Column with an SFT response; None: use `answer`.")
    data_source: str | None = Field(None, description="Column with data_source; None: `data.data_source`.")


class DataConfig(Section):
    source: Literal["synthetic", "gsm8k", "file"] = Field("synthetic", description="Which recipe in data/.")
    synthetic: SyntheticTaskConfig = Field(default_factory=SyntheticTaskConfig)
    gsm8k_path: str = Field(
        "openai/gsm8k", description="Hub dataset id, or a local folder/file with GSM8K-format JSONL/parquet."
    )
    path: str | None = Field(None, description="source=file: a local .parquet/.jsonl (or a folder of them).")
    columns: ColumnMapping = Field(default_factory=ColumnMapping)
    data_source: str = Field("custom", min_length=1, description="data_source for file rows without one.")
    validation_fraction: float = Field(0.1, gt=0, lt=1, description="source=file: share held out.")
    max_train_samples: int | None = Field(None, gt=0, description="Cap on training rows (None: all).")
    max_validation_samples: int | None = Field(None, gt=0, description="Cap on held-out rows (None: all).")
    max_prompt_length: int = Field(128, gt=0, description="Prompt tokens (chat template applied).")
    max_response_length: int = Field(64, gt=0, description="Response tokens for SFT targets and rollouts.")
    filter_overlong_prompts: bool = Field(True, description="Drop prompts over max_prompt_length (counted).")
    truncation: Literal["error", "left", "right"] = Field(
        "error", description="Prompts still over max_prompt_length: error, or keep the right/left part."
    )
    bad_rows: Literal["error", "skip"] = Field("error", description="Malformed rows: fail, or skip and count.")
    interaction: str | None = Field(
        None, min_length=1, description="A simulated user for every RL row (train and validation): its name in "
        "rl.multi_turn.interaction_config_path. Rows get agent_name tool_agent and extra_info.interaction_kwargs "
        "{name, query, ground_truth}, as verl's gsm8k interaction preprocessing; rows that already have "
        "interaction_kwargs keep theirs. None: none added."
    )


class TinyModelConfig(Section):
    """A small model built offline from this config plus a tokenizer trained on the task's text."""

    arch: Literal["qwen2", "qwen3", "qwen3_moe", "llama"] = Field(
        "qwen2", description="Architecture family (qwen3_moe: 4 experts, 2 per token, each of intermediate_size / 2).")
    hidden_size: int = Field(128, gt=0, multiple_of=8)
    num_layers: int = Field(2, gt=0)
    num_heads: int = Field(4, gt=0)
    num_kv_heads: int = Field(2, gt=0)
    intermediate_size: int = Field(512, gt=0)
    vocab_size: int = Field(384, ge=300, description="BPE vocabulary incl. 256 byte tokens and specials.")
    embedding_rows: int | None = Field(
        None, gt=0, description="Rows of the embedding and head (null: the tokenizer's size rounded up to 64); "
        "larger gives a hub model's shape, e.g. 151936 as in Qwen2.5, with rows no token uses.")
    max_position_embeddings: int = Field(512, gt=0)

    @model_validator(mode="after")
    def _heads_divide(self) -> TinyModelConfig:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size={self.hidden_size} must be divisible by num_heads={self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be divisible by num_kv_heads={self.num_kv_heads}")
        if self.embedding_rows is not None and self.embedding_rows < self.vocab_size:
            raise ValueError(f"embedding_rows={self.embedding_rows} must be at least vocab_size={self.vocab_size}")
        return self


class LoraConfig(Section):
    rank: int = Field(8, gt=0, description="LoRA rank r.")
    alpha: float = Field(16.0, gt=0, description="LoRA scaling alpha (scale = alpha / r).")
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear", description="Module names to adapt, or 'all-linear'."
    )


class ModelConfig(Section):
    path: str = Field("tiny", min_length=1, description="'tiny' (built-in spec), a local HF folder or a hub id.")
    tiny: TinyModelConfig = Field(default_factory=TinyModelConfig)
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="What the model computes in (training: its forwards and backwards under FSDP2 mixed "
        "precision, with float32 master weights and optimizer state; rollout and evaluation: the engines' weights).")
    lora: LoraConfig | None = Field(None, description="Set to enable peft LoRA; null for full fine-tuning.")
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward.")
    trust_remote_code: bool = Field(False, description="Passed to transformers for hub models.")


class SFTOptimConfig(OptimConfig):
    """The optimizer section with SFT's defaults (same fields as rl.actor.optim)."""

    lr: float = Field(1e-3, gt=0, description="Peak learning rate.")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW betas, each in [0, 1).")
    lr_scheduler: Literal["constant", "cosine", "linear"] = Field("cosine", description="After warmup.")


class SFTConfig(Section):
    enabled: bool = Field(True, description="Run the SFT warm-start; false: RL starts from the base model.")
    epochs: int = Field(3, gt=0)
    train_batch_size: int = Field(32, gt=0, description="Global batch (sequences per optimizer step).")
    micro_batch_size: int = Field(16, gt=0, description="Per-device sequences per forward/backward.")
    optim: SFTOptimConfig = Field(default_factory=SFTOptimConfig)
    val_freq: int = Field(0, ge=0, description="Validation loss every N steps (0: once per epoch).")
    save_freq: int = Field(0, ge=0, description="Checkpoint every N steps (0: only at the end of each epoch).")
    max_ckpt_to_keep: int = Field(2, gt=0)
    offload: bool = Field(False, description="FSDP2 CPU offload (verl's SFT fsdp_config.cpu_offload): the fp32 "
                          "weights, gradients and AdamW state stay in host memory and each layer comes to the GPU "
                          "for its forward and backward, the optimizer steps on the CPU; for full fine-tuning of "
                          "models whose training state does not fit the GPU (7B: ~122 GB). Slower per step.")

    @model_validator(mode="after")
    def _micro_divides_batch(self) -> SFTConfig:
        if self.train_batch_size % self.micro_batch_size:
            raise ValueError(
                f"train_batch_size={self.train_batch_size} must be a multiple of "
                f"micro_batch_size={self.micro_batch_size}"
            )
        return self


class EvaluateConfig(Section):
    engine: Literal["auto", "vllm", "cuda", "hf"] = Field(
        "auto", description="Generation engine, run in a Ray actor: vllm, cuda (ours), hf (transformers), or auto "
        "(vllm where it is installed, else cuda where the flow sees a GPU, else hf)."
    )
    n: int = Field(1, gt=0, description="Samples per prompt; n > 1 adds mean@n, best@n, maj@n.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature when n > 1 (greedy at n=1).")
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens: int | None = Field(None, gt=0, description="None: data.max_response_length.")
    batch_size: int = Field(64, gt=0, description="Prompts per generation call.")
    max_samples: int | None = Field(None, gt=0, description="Cap on evaluated prompts (None: all).")
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1, description="vLLM on GPU: share of memory it may use.")


class StorageConfig(Section):
    root: str = Field("outputs/store", min_length=1, description="Local folder or s3://bucket/prefix.")
    endpoint_url: str | None = Field(
        None, description="S3 endpoint (e.g. a local S3 server); None: AWS_ENDPOINT_URL or AWS's default."
    )
    timeout_s: float = Field(
        5.0, gt=0, le=600, description="S3: seconds one attempt of a request may take (connect, send, answer; "
        "plus its upload at min_upload_mib_s) and may wait for the next byte of a download; then it is retried."
    )
    max_attempts: int = Field(
        3, ge=1, le=10, description="S3: attempts per request (1 + retries with backoff of at most 1, 2, 4... s); "
        "a storage that never answers fails after about max_attempts * timeout_s."
    )
    min_upload_mib_s: float = Field(
        2.0, gt=0, description="S3: slowest upload per connection (MiB/s) before an attempt counts as stalled; "
        "uploads run up to 10 parts of 8 MiB at once, so lower it on a link slower than 10x this."
    )

    @model_validator(mode="after")
    def _known_protocol(self) -> StorageConfig:
        if "://" in self.root and not self.root.startswith(("s3://", "file://", "memory://")):
            raise ValueError(f"root={self.root!r}: use a local path, file://, memory:// or s3://bucket/prefix")
        return self

    @field_validator("endpoint_url")
    @classmethod
    def _http_url(cls, url: str | None) -> str | None:
        problem = url and endpoint_url_problem(url)
        if problem:
            raise ValueError(problem)
        return url


ENDPOINT_EXAMPLE = "http://127.0.0.1:9000 (a local S3 server) or https://s3.us-east-1.amazonaws.com"


def endpoint_url_problem(url: str) -> str | None:
    """Why url cannot be an S3 endpoint, or None. botocore and DuckDB's httpfs both need the scheme: without one
    botocore fails only at the first request, deep inside, and guessing https would be wrong for a local server."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError unless the port is a number in 0-65535
    except ValueError as exc:
        return f"not a URL ({exc}); expected http(s)://host[:port], e.g. {ENDPOINT_EXAMPLE}"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        hint = f"; with the scheme: http://{url} or https://{url}" if "://" not in url else ""
        return f"expected an http:// or https:// URL with a host, e.g. {ENDPOINT_EXAMPLE}{hint}"
    return None


class TrackingConfig(Section):
    backends: list[Literal["console", "jsonl", "wandb", "prometheus"]] = Field(
        ["console", "jsonl"], description="Sinks. prometheus: an HTTP endpoint (/metrics) with the latest step's "
        "metrics while a stage runs (infra/tracking.py PrometheusBackend)."
    )
    project: str = Field("rlpipe", min_length=1, description="wandb project.")
    wandb_mode: Literal["offline", "online", "disabled"] = Field("offline", description="WANDB_MODE.")
    log_freq: int = Field(10, gt=0, description="Console/metrics logging every N steps.")
    console: Literal["quiet", "verbose"] = Field(
        "quiet", description="quiet: the console shows stage lines, progress bars, our warnings and every error; "
        "Prefect, Ray, vLLM and INFO logs go to log files in the run folder. verbose: all of it on the console too."
    )
    prometheus_host: str = Field(
        "127.0.0.1", min_length=1, description="Address the Prometheus endpoint listens on; 0.0.0.0 or :: for "
        "every interface (it has no authentication: only on a trusted network)."
    )
    prometheus_port: int = Field(
        9464, ge=0, le=65535, description="Port of the Prometheus endpoint; 0: a free port, printed with the URL."
    )


class RayConfig(Section):
    """Where the workers run: N = num_devices_per_node * num_nodes, one per device, for the RL trainer's colocated
    roles, the SFT ranks (FSDP2 data parallel; N = 1: SFT in the stage's own process) and evaluation.

    Multi-node: start Ray on every node (`ray start --head` on one, `ray start --address=HEAD:6379` on the
    others) and set `address` (e.g. 'auto' on a node of the cluster); checkpoints are then staged in a
    folder every node must see (a shared file system).
    """

    address: str | None = Field(None, description="Attach to this cluster ('auto', 'host:port'); None: local.")
    num_cpus: int | None = Field(None, gt=0, description="CPUs of a local cluster (None: all).")
    num_devices_per_node: int = Field(
        1, gt=0, description="Workers per node: GPUs, or CPU slots on CPU machines (each takes 1 Ray CPU)."
    )
    num_nodes: int = Field(1, gt=0, description="Nodes the workers span (PACK placement; 1: STRICT_PACK).")
    rollout_devices_per_node: int = Field(
        0, ge=0, description="Devices per node that only generate (rollout workers, beside the "
        "num_devices_per_node trainer devices); 0: colocated, the trainer's workers generate.")

    @property
    def num_trainers(self) -> int:
        return self.num_devices_per_node * self.num_nodes

    @property
    def num_rollout_workers(self) -> int:
        return self.rollout_devices_per_node * self.num_nodes


class Config(Section):
    """A whole run: one section per stage plus storage, tracking and Ray."""

    run: RunConfig = Field(default_factory=RunConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    sft: SFTConfig = Field(default_factory=SFTConfig)
    rl: RLConfig = Field(default_factory=RLConfig)
    evaluate: EvaluateConfig = Field(default_factory=EvaluateConfig)
    storage: StorageConfig = Field(default_factory=StorageConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    ray: RayConfig = Field(default_factory=RayConfig)

    @model_validator(mode="after")
    def _no_credentials(self) -> Config:
        """A config is saved with every run (config.yaml, the store, Prefect's parameters): no secrets in it."""
        fields = url_credential_fields(self.model_dump(mode="json"))
        if fields:
            raise ValueError(f"{', '.join(fields)} holds a URL with a password; remove the user:password@ part and "
                             "give credentials through the environment (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY "
                             "for S3), which is never saved")
        return self

    @model_validator(mode="after")
    def _no_float16_training(self) -> Config:
        """float16 runs only where nothing trains (evaluation, generation): the loss is divided by the batch's token
        count and there is no loss scaling, so small float16 gradients would flush to zero."""
        if self.model.dtype == "float16" and (self.sft.enabled or self.rl.enabled):
            raise ValueError("model.dtype=float16: training in float16 needs loss scaling, which the trainers do not "
                             "do (small gradients underflow to 0); use bfloat16 (NVIDIA GPUs since Ampere, TPUs) or "
                             "float32")
        return self

    @model_validator(mode="after")
    def _finite_floats(self) -> Config:
        """Every float of every section, those defined in other modules (rl_config, algorithms) included, is finite:
        inf passes bounds such as `gt=0` and a field without bounds takes nan, and neither is a usable setting (an
        inf learning rate or timeout fails, or hangs, far from the config). Checked here, once for the whole tree,
        so that no section's base class can forget it. No field uses inf for "no limit": those use None."""
        bad = list(_non_finite(self, ""))
        if bad:
            raise ValueError(f"{', '.join(bad)}: inf and nan are not allowed; give a finite number (or null where "
                             "the field's description says null means no limit)")
        return self

    @model_validator(mode="after")
    def _interaction_is_configured(self) -> Config:
        if self.data.interaction and not self.rl.multi_turn.interaction_config_path:
            raise ValueError(f"data.interaction={self.data.interaction!r} names a simulated user, but "
                             "rl.multi_turn.interaction_config_path is not set: give the interaction YAML (e.g. "
                             "recipes/interactions/gsm8k.yaml), or drop data.interaction")
        return self

    @model_validator(mode="after")
    def _workers_share_mini_batches(self) -> Config:
        """Every worker trains on an equal share of every mini-batch (so the loss is the same at any N)."""
        ray, actor = self.ray, self.rl.actor
        workers, rows = ray.num_devices_per_node * ray.num_nodes, actor.ppo_mini_batch_size * self.rl.rollout.n
        if self.rl.enabled and rows % workers:
            raise ValueError(
                f"rl.actor.ppo_mini_batch_size * rl.rollout.n = {actor.ppo_mini_batch_size} * {self.rl.rollout.n} "
                f"= {rows} samples per mini-batch must be divisible by the number of workers, "
                f"ray.num_devices_per_node * ray.num_nodes = {ray.num_devices_per_node} * {ray.num_nodes} = {workers}"
            )
        if self.rl.enabled and self.rl.algorithm.adv_estimator.pairwise and actor.ppo_mini_batch_size % workers:
            raise ValueError(
                f"rl.algorithm.adv_estimator={self.rl.algorithm.adv_estimator.name} trains on one pair per prompt, and "
                f"no pair may be split across workers: rl.actor.ppo_mini_batch_size={actor.ppo_mini_batch_size} "
                f"(pairs per mini-batch) must be divisible by the number of workers, {workers}")
        sp = self.rl.actor.ulysses_sequence_parallel_size
        if self.rl.enabled and workers % sp:
            raise ValueError(f"rl.actor.ulysses_sequence_parallel_size={sp} must divide the number of trainer workers, "
                             f"ray.num_devices_per_node * ray.num_nodes = {workers}: change either")
        tp, engine = self.rl.rollout.tensor_model_parallel_size, self.rl.rollout.engine
        if self.rl.enabled and tp > 1 and engine == "hf":
            raise ValueError(f"rl.rollout.tensor_model_parallel_size={tp} needs rl.rollout.engine=vllm or cuda (the hf "
                             "engine runs on one device); set it to 1")
        if self.rl.enabled and self.rl.rollout.quantization and engine != "cuda":
            raise ValueError(f"rl.rollout.quantization={self.rl.rollout.quantization} needs rl.rollout.engine=cuda "
                             f"(the {engine} engine is not quantised here); unset it or use the cuda engine")
        engines = ray.num_rollout_workers or workers
        if self.rl.enabled and engines % tp:
            raise ValueError(f"rl.rollout.tensor_model_parallel_size={tp} must divide the number of generating "
                             f"workers, {engines} (ray.rollout_devices_per_node * ray.num_nodes, or the trainers')")
        return self

    @model_validator(mode="after")
    def _sft_ranks_share_batches(self) -> Config:
        """SFT runs on every trainer device (ray.num_devices_per_node * ray.num_nodes), each taking an equal share."""
        ranks, batch = self.ray.num_trainers, self.sft.train_batch_size
        if self.sft.enabled and batch % ranks:
            raise ValueError(f"sft.train_batch_size={batch} must be divisible by the number of SFT ranks, "
                             f"ray.num_devices_per_node * ray.num_nodes = {ranks}: each rank takes an equal share")
        return self

    @model_validator(mode="after")
    def _async_has_rollout_devices(self) -> Config:
        mode = self.rl.async_training.mode
        if self.rl.enabled and mode != "sync" and not self.ray.rollout_devices_per_node:
            raise ValueError(f"rl.async_training.mode={mode} generates on devices of its own while the trainer "
                             "trains: set ray.rollout_devices_per_node (e.g. 1), or use mode=sync")
        return self


def _non_finite(value: Any, key: str) -> Iterator[str]:
    """'key = value' for each float under value (a section, dict, list or tuple) that is inf or nan."""
    if isinstance(value, BaseModel):
        for name in type(value).model_fields:
            yield from _non_finite(getattr(value, name), f"{key}.{name}" if key else name)
    elif isinstance(value, dict):
        for name, item in value.items():
            yield from _non_finite(item, f"{key}.{name}")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _non_finite(item, f"{key}[{i}]")
    elif isinstance(value, float) and not math.isfinite(value):
        yield f"{key} = {value}"


# --------------------------------------------------------------------------------------------------
# Loading


def parse_override(text: str) -> tuple[list[str], Any]:
    """'a.b.c=value' -> (['a', 'b', 'c'], value parsed as YAML)."""
    key, sep, raw = text.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r}: expected KEY=VALUE with a dotted key, e.g. sft.optim.lr=1e-4")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {text!r}: the value is not valid YAML ({_yaml_problem(exc)}); quote a string "
                          f"that starts with [ {{ or holds ': ', e.g. {key}='\"{raw}\"'") from None
    return key.split("."), value


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """YAML's own reason and place, without its multi-line excerpt of the text."""
    mark = getattr(exc, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    return f"{getattr(exc, 'problem', None) or type(exc).__name__}{where}"


def apply_override(tree: dict, path: list[str], value: Any) -> None:
    """Set `path` to `value` in the raw tree. Variants (infra/algorithms.py) are named by a string or a section
    with `name`: a parameter set under a name turns it into {name: ...}; a name set where a variant section
    stands keeps the section when the name is the same and replaces it when not (another variant's parameters
    would not fit)."""
    node = tree
    for i, part in enumerate(path[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if isinstance(child, str) and _is_variant(path[: i + 1]):
            child = node[part] = {"name": child}
        if not isinstance(child, dict):
            raise ConfigError(f"override {'.'.join(path)}: {'.'.join(path[: i + 1])} is a value, not a section")
        node = child
    current = node.get(path[-1])
    if isinstance(value, str) and isinstance(current, dict) and _is_variant(path):
        if current.get("name", value) == value:  # the same variant, or parameters waiting for their name
            current["name"] = value
            return
    node[path[-1]] = value


VARIANT_PATHS = {("rl", "algorithm", "adv_estimator"), ("rl", "actor", "policy_loss")}


def _is_variant(path: list[str]) -> bool:
    return tuple(path) in VARIANT_PATHS


def _allowed_fields(loc: tuple) -> list[str]:
    """Field names of the section at `loc` (used to list what an unknown key could have been)."""
    model: type[BaseModel] | None = Config
    for part in loc:
        field = model.model_fields.get(str(part)) if model else None
        if field is None:
            return []
        model = next((a for a in _annotation_models(field.annotation)), None)
    return sorted(model.model_fields) if model else []


def _variant_model(path: tuple, name: str) -> type[BaseModel]:
    """The variant class called `name` of the union at `path` (e.g. rl.algorithm.adv_estimator, 'gae')."""
    model: Any = Config
    for part in path[:-1]:
        model = next(_annotation_models(model.model_fields[part].annotation))
    members = _annotation_models(model.model_fields[path[-1]].annotation)
    return next(m for m in members if m.model_fields["name"].default == name)


def _annotation_models(annotation: Any):
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation
    for arg in getattr(annotation, "__args__", ()) or ():
        yield from _annotation_models(arg)


def _format_error(err: dict) -> str:
    loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith(("function-after", "tagged"))))
    variant = loc[3] if loc[:3] in VARIANT_PATHS and len(loc) > 4 else None
    if variant is not None:  # the tag pydantic puts after a variant's path: not a key of the tree
        loc = loc[:3] + loc[4:]
    key = ".".join(str(p) for p in loc) or "<root>"
    value = err.get("input")
    if err["type"] == "extra_forbidden":
        if variant is not None:
            allowed = ", ".join(sorted(_variant_model(loc[:3], variant).model_fields))
            return f"unknown key {key!r} (value {redact(repr(value))}); {loc[2]} {variant!r} takes: {allowed}"
        allowed = _allowed_fields(loc[:-1])
        return f"unknown key {key!r} (value {redact(repr(value))}); allowed here: {', '.join(allowed)}"
    message = err["msg"].removeprefix("Value error, ")
    if not loc:  # a check across sections: its message names the keys
        return message
    shown = redact(repr(value)) if not isinstance(value, dict) else "{...}"
    return f"{key} = {shown}: {message}"


def validate(tree: dict) -> Config:
    try:
        return Config.model_validate(tree)
    except ValidationError as exc:
        lines = [_format_error(e) for e in exc.errors()]
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(lines)) from None


def load_config(recipe: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Read a YAML recipe (or the defaults), apply dotted overrides, validate."""
    tree: dict = {}
    if recipe is not None:
        path = Path(recipe)
        if not path.is_file():
            raise ConfigError(f"recipe {str(path)!r} not found; recipes live in recipes/ (e.g. recipes/demo.yaml)")
        tree = _read_recipe(path)
        if not isinstance(tree, dict):
            raise ConfigError(f"recipe {str(path)!r}: the top level must be a mapping of sections")
    for text in overrides:
        apply_override(tree, *parse_override(text))
    return validate(tree)


def _read_recipe(path: Path) -> Any:
    try:
        return yaml.safe_load(path.read_bytes().decode("utf-8")) or {}
    except UnicodeDecodeError as exc:
        bad = exc.object[exc.start:exc.start + 1]
        raise ConfigError(f"recipe {str(path)!r} is not UTF-8 text (byte {exc.start} is {bad!r}); save it as UTF-8"
                          ) from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"recipe {str(path)!r} is not valid YAML: {_yaml_problem(exc)}") from None


def to_yaml(config: BaseModel) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)


def config_hash(*parts: BaseModel | dict | str | None) -> str:
    """Stable short hash of config sections and input versions: the basis of cache keys."""
    canon = [p.model_dump(mode="json") if isinstance(p, BaseModel) else p for p in parts]
    blob = json.dumps(canon, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
