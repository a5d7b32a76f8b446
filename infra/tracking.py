"""Metrics tracking: one interface, several sinks (console, jsonl in the run folder, wandb).

`Tracker.log(metrics, step)` fans out to every configured backend. Values may be Python numbers or
0-d tensors; they are converted once here. wandb runs offline by default (`tracking.wandb_mode`); its
API key, when online, comes from the environment (`WANDB_API_KEY`) and is never written by us.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from pathlib import Path
from typing import Any, Protocol

from tqdm.auto import tqdm

from infra.config import TrackingConfig

logger = logging.getLogger(__name__)


def to_float(value: Any) -> float:
    if hasattr(value, "item"):
        value = value.item()
    return float(value)


class Backend(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...
    def finish(self) -> None: ...


class ConsoleBackend:
    """One log line per call, every `log_freq` steps (always for prefixes 'val/' and 'eval/'); INFO, so with
    `tracking.console=quiet` the line goes to the run's run.log only (infra/console.py)."""

    def __init__(self, log_freq: int):
        self.log_freq = log_freq

    def log(self, metrics: dict[str, float], step: int) -> None:
        is_val = any(k.startswith(("val/", "eval/", "val-core/")) for k in metrics)
        if step % self.log_freq and not is_val:
            return
        text = "  ".join(f"{k}={_fmt(v)}" for k, v in sorted(metrics.items()))
        logger.info("step %d  %s", step, text)

    def finish(self) -> None:
        pass


def _fmt(v: float) -> str:
    return f"{v:.4g}" if math.isfinite(v) else str(v)


class JsonlBackend:
    """Appends `{"step": s, **metrics}` lines to `metrics.jsonl` in the run folder."""

    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)

    def log(self, metrics: dict[str, float], step: int) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")

    def finish(self) -> None:
        pass


class WandbBackend:
    def __init__(self, cfg: TrackingConfig, run_name: str, run_dir: Path, config: dict):
        import wandb

        os.environ.setdefault("WANDB_MODE", cfg.wandb_mode)
        os.environ.setdefault("WANDB_SILENT", "true")
        self.run = wandb.init(
            project=cfg.project, name=run_name, dir=str(run_dir), config=config, mode=cfg.wandb_mode, reinit="create_new"
        )

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def finish(self) -> None:
        self.run.finish()


class Tracker:
    """Fan-out metrics logger. Use as a context manager so backends are closed."""

    def __init__(self, backends: list[Backend]):
        self.backends = backends

    @classmethod
    def from_config(cls, cfg: TrackingConfig, run_name: str, run_dir: Path, config: dict | None = None) -> Tracker:
        backends: list[Backend] = []
        for name in cfg.backends:
            if name == "console":
                backends.append(ConsoleBackend(cfg.log_freq))
            elif name == "jsonl":
                backends.append(JsonlBackend(run_dir / f"{run_name}.metrics.jsonl"))
            elif name == "wandb":
                backends.append(WandbBackend(cfg, run_name, run_dir, config or {}))
        return cls(backends)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        clean = {k: to_float(v) for k, v in metrics.items()}
        for backend in self.backends:
            backend.log(clean, step)

    def finish(self) -> None:
        for backend in self.backends:
            backend.finish()

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc) -> None:
        self.finish()


def progress_bar(total: int, initial: int, desc: str) -> tqdm:
    """A tqdm bar; redrawn at most every 10 s when stderr is not a terminal (logs, CI)."""
    interactive = sys.stderr.isatty()
    return tqdm(total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True,
                mininterval=0.5 if interactive else 10.0)
