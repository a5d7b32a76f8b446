"""One key figure per stage for the flow's stage lines, read from the stage's result and the store, so a cache
hit shows the figure of the run that made the result.

Keyed by task name; each function takes the config and the task's result (an artifact ref, or evaluate's record).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

from infra.artifacts import ArtifactRef
from infra.config import Config
from infra.sql import query
from tasks.stages import local_model_path, open_store


def data_rows(cfg: Config, dataset: str) -> str:
    stats = open_store(cfg).manifest(ArtifactRef.parse(dataset)).metadata["stats"]
    return f"{stats['num_train']} train / {stats['num_validation']} validation rows"


def model_parameters(cfg: Config, model: str) -> str:
    """Counted from the safetensors headers (no weights read); a hub id that is not local is shown as is."""
    from safetensors import safe_open

    files = sorted(Path(local_model_path(open_store(cfg), model)).glob("*.safetensors"))
    if not files:
        return model
    count = 0
    for path in files:
        with safe_open(path, "pt") as f:
            count += sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    return f"{count / 1e6:.2f}M parameters"


def sft_losses(cfg: Config, model: str) -> str:
    metrics = open_store(cfg).manifest(ArtifactRef.parse(model)).metadata["metrics"]
    return "final loss " + ", ".join(f"{split} {metrics[f'{split}/loss']:.3f}" for split in ("train", "val")
                                     if f"{split}/loss" in metrics)


def rl_progress(cfg: Config, checkpoint: str) -> str:
    """Steps (the checkpoint's), held-out accuracy at the start and the end, the starting model's pass@n, and the
    last mean score, from the store's metrics."""
    store = open_store(cfg)
    ref = ArtifactRef.parse(checkpoint)
    val, pass_n = f"val/acc/mean@{cfg.rl.rollout.val_n}", f"val/acc/best@{cfg.rl.rollout.n}"
    rows = query(store, "SELECT name, arg_min(value, step) AS first, arg_max(value, step) AS last FROM metrics "
                        f"WHERE run_id = '{ref.name}' AND name IN ('critic/score/mean', '{val}', '{pass_n}') "
                        "GROUP BY name")
    found = {row["name"]: row for row in rows}
    text = f"{store.manifest(ref).metadata['step']} steps"
    if val in found:
        text += f", validation acc {100 * found[val]['first']:.1f}% -> {100 * found[val]['last']:.1f}%"
    if pass_n in found:
        text += f" (pass@{cfg.rl.rollout.n} at start {100 * found[pass_n]['first']:.1f}%)"
    if "critic/score/mean" in found:
        text += f", last mean score {found['critic/score/mean']['last']:.3f}"
    return text


def held_out_accuracy(cfg: Config, record: dict) -> str:
    return f"held-out acc {100 * record['acc']:.1f}%"


FIGURES: dict[str, Callable[[Config, object], str]] = {
    "data-prep": data_rows, "base-model": model_parameters, "sft": sft_losses, "rl": rl_progress,
    "merge": lambda cfg, model: model, "evaluate": held_out_accuracy,
}
