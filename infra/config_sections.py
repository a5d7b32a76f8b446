"""The sections of a run's configuration, one pydantic v2 model each: run, data, model, sft, evaluate, storage,
tracking and ray (rl, the largest, lives in infra/rl_config.py). infra/config.py puts them together into `Config`,
checks what spans sections, and reads recipes and overrides.

Every section forbids unknown keys and validates assignments; each field has its constraint and its default here,
and nowhere else.
"""

from __future__ import annotations

from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from infra.config_base import Section
from infra.trainer_config import OptimConfig


class RunConfig(Section):
    name: str = Field("demo", min_length=1, pattern=r"^[A-Za-z0-9._-]+$", description="Run name; used in run folders.")
    seed: int = Field(0, ge=0, description="Global seed: data generation, model init, sampling.")
    output_dir: str = Field(
        "outputs", min_length=1,
        description="Local folder for run folders (`runs/<run_id>/`). Not Prefect's state: that is in the project's "
        "outputs/.prefect (or $PREFECT_HOME), fixed before any config is read (infra/prefect_env.py).",
    )
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

    @model_validator(mode="after")
    def _one_sft_mix(self) -> SyntheticTaskConfig:
        if self.tool_call_fraction > 0 and self.shortcut_fraction > 0:
            raise ValueError(f"shortcut_fraction={self.shortcut_fraction} has no effect with tool_call_fraction="
                             f"{self.tool_call_fraction} (the calculator task mixes its SFT rows its own way); set one "
                             "of them to 0")
        return self


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
    max_train_samples: int | None = Field(None, gt=0, description="Cap on training rows, drawn at random with "
                                          "run.seed (None: all).")
    max_validation_samples: int | None = Field(None, gt=0, description="Cap on held-out rows, drawn at random with "
                                               "run.seed (None: all).")
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
                f"sft.train_batch_size={self.train_batch_size} must be a multiple of "
                f"sft.micro_batch_size={self.micro_batch_size}: change either"
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

    @field_validator("root")
    @classmethod
    def _no_glob_characters(cls, root: str) -> str:
        if problem := glob_problem(root):
            raise ValueError(problem)
        return root

    @field_validator("endpoint_url")
    @classmethod
    def _http_url(cls, url: str | None) -> str | None:
        problem = url and endpoint_url_problem(url)
        if problem:
            raise ValueError(problem)
        return url


def glob_problem(path: str) -> str | None:
    """Why a store root cannot hold path (None: it can): the store finds versions and table files by glob
    patterns under its root (fsspec's and DuckDB's), where these characters are patterns, not names; gc would
    then find no committed version and take every one for an abandoned upload."""
    if found := sorted(set("*?[]") & set(path)):
        return (f"{' '.join(found)} in the path: the store matches file names under its root with glob "
                "patterns, in which these characters are patterns. Fix: choose a folder whose path has none of * ? [ ]")
    return None


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
