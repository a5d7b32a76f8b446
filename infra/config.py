"""Run configuration: the whole run's `Config`, its checks across sections, YAML recipes and dotted overrides.

`Config` holds one section per stage (the section models: infra/config_sections.py; rl: infra/rl_config.py).
A recipe is a YAML file whose top-level keys are those sections. Command-line overrides are
``section.key=value`` (values parsed as YAML, so ``sft.optim.lr=1e-4`` and
``tracking.backends=[console,wandb]`` work). Unknown keys and bad values raise ``ConfigError`` naming the
key, the value and what is allowed. Defaults live in the section models and nowhere else.

Secrets (S3 credentials, the wandb API key) are never fields: they come from the environment
(``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, ``WANDB_API_KEY``) and so are never written with a run.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, Field, ValidationError, model_validator

from infra.config_base import Section
from infra.config_sections import (
    DataConfig,
    EvaluateConfig,
    ModelConfig,
    RayConfig,
    RunConfig,
    SFTConfig,
    StorageConfig,
    TrackingConfig,
)
from infra.redact import URL_CREDENTIALS, redact, url_credential_fields
from infra.rl_config import RLConfig

CREDENTIALS_PROBLEM = ("holds a URL with credentials (user:password@ or token@); remove that part and give "
                       "credentials through the environment (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY for S3), "
                       "which is never saved")


class ConfigError(ValueError):
    """A recipe or override that does not validate; the message names every bad key."""


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
            raise ValueError(f"{', '.join(fields)} {CREDENTIALS_PROBLEM}")
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
    def _overlong_buffer_fits(self) -> Config:
        """Checked here, not at the first scoring after SFT and the engines' start (verl asserts it at start too)."""
        buffer, longest = self.rl.reward.overlong_buffer, self.data.max_response_length
        if self.rl.enabled and buffer > longest:
            raise ValueError(f"rl.reward.overlong_buffer={buffer} is longer than the response, "
                             f"data.max_response_length={longest}: lower it (DAPO's paper: a quarter of the length)")
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
    if isinstance(value, str) and URL_CREDENTIALS.search(value):  # the field's own message may quote the secret
        return f"{key} = {redact(repr(value))}: {CREDENTIALS_PROBLEM}"
    message = err["msg"].removeprefix("Value error, ")
    if not loc or message.startswith(f"{key}."):  # a check across sections or fields naming its keys in full
        return message
    if isinstance(value, dict):  # a check across a section's fields: the section, then what its message says
        return f"{key}: {message}"
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
