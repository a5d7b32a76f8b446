"""Metrics tracking: one interface, several sinks (console, jsonl in the run folder, wandb, Prometheus).

`Tracker.log(metrics, step)` fans out to every configured backend. Values may be Python numbers or
0-d tensors; they are converted once here. wandb runs offline by default (`tracking.wandb_mode`); its
API key, when online, comes from the environment (`WANDB_API_KEY`) and is never written by us.

`prometheus` serves the latest logged values over HTTP while the tracker is open (the stage's run, in the
process that logs: for RL the Ray driver, i.e. the flow's process); see `PrometheusBackend` and
`prometheus_name` for the exported names.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import re
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Protocol

from tqdm.auto import tqdm

from infra.config_sections import TrackingConfig
from infra.console import LINES

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
    """Appends `{"step": s, **metrics}` lines to `metrics.jsonl` in the run folder.

    A step at or before the file's last one (a retried task resuming from its checkpoint in the same run folder)
    first drops the lines of that step and later ones, so each step is in the file once, as in the tables."""

    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        text = path.read_text() if path.exists() else ""
        lines = _parsed(text)
        self.last_step = max((s for s, _ in lines), default=None)
        if text != "".join(line + "\n" for _, line in lines):
            self._rewrite(lines)  # a line cut by a kill: the next one must start on its own line

    def _rewrite(self, lines: list[tuple[int, str]]) -> None:
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text("".join(line + "\n" for _, line in lines))
        tmp.replace(self.path)

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self.last_step is not None and step <= self.last_step:
            self._rewrite([(s, line) for s, line in _parsed(self.path.read_text()) if s < step])
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        self.last_step = step

    def finish(self) -> None:
        pass


def _parsed(text: str) -> list[tuple[int, str]]:
    """(step, line) of each whole line of a metrics.jsonl text; a line cut by a kill is left out."""
    lines = []
    for line in text.splitlines():
        try:
            lines.append((int(json.loads(line)["step"]), line))
        except (ValueError, KeyError, TypeError):
            continue
    return lines


class WandbBackend:
    def __init__(self, cfg: TrackingConfig, run_name: str, run_dir: Path, config: dict, group: str | None = None):
        """`group`: the stage run (`rl-<key>`), the same for each flow run that resumes it, so that wandb shows a
        resumed run's pieces together."""
        import wandb

        os.environ.setdefault("WANDB_MODE", cfg.wandb_mode)
        os.environ.setdefault("WANDB_SILENT", "true")
        self.run = wandb.init(project=cfg.project, name=run_name, group=group, dir=str(run_dir), config=config,
                              mode=cfg.wandb_mode, reinit="create_new")

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def finish(self) -> None:
        self.run.finish()


PROMETHEUS_PREFIX = "rlpipe_"


def prometheus_name(key: str) -> str:
    """A metric key as a Prometheus metric name (`[a-zA-Z_:][a-zA-Z0-9_:]*`, no colons: those are for
    recording rules): `@` becomes `_at_`, every other character outside `[A-Za-z0-9_]` (`/`, `-`, `.`, ...) `_`,
    runs of `_` one `_`, none at either end, and the prefix `rlpipe_`. So `actor/pg_loss` ->
    `rlpipe_actor_pg_loss`, `val/acc/mean@8` -> `rlpipe_val_acc_mean_at_8`, `timing_s/gen` -> `rlpipe_timing_s_gen`.
    """
    name = re.sub(r"[^A-Za-z0-9_]", "_", key.replace("@", "_at_"))
    return PROMETHEUS_PREFIX + re.sub(r"_+", "_", name).strip("_")


class PrometheusBackend:
    """Serves `http://host:port/metrics` (Prometheus text format) from a thread until `finish`.

    Every numeric step metric is a gauge named by `prometheus_name` (HELP: the original key) with the label
    `run_id` (the tracker's run name, e.g. `<flow run id>-rl`), holding the latest value logged for it: a key
    that a step does not log (validation between test_freq steps) keeps its last value. `rlpipe_step` is the
    latest step and `rlpipe_step_timestamp_seconds` the Unix time it was logged. NaN and +-Inf are exported as
    they are (the text format has them; Grafana draws NaN as a gap), so a diverged loss shows instead of the
    last finite value. Each `log` swaps in one new snapshot, so a scrape sees a whole step, never half of one.
    Two keys with one name: the first keeps it, the other is not exported (a warning names both).

    The registry is this backend's own (not prometheus_client's global one): several trackers, one per
    stage or test, each serve their own metrics.
    """

    def __init__(self, cfg: TrackingConfig, run_name: str):
        from prometheus_client import CollectorRegistry, start_http_server

        self.run_name = run_name
        self.keys = {"rlpipe_step": "(the step)", "rlpipe_step_timestamp_seconds": "(the step's time)"}  # name -> key
        self.dropped: set[str] = set()  # keys whose name another key owns
        self.snapshot: dict[str, tuple[str, float]] = {}  # name -> (key, value); replaced whole by each log
        self.registry = CollectorRegistry()
        self.registry.register(self)
        host, port = cfg.prometheus_host, cfg.prometheus_port
        try:
            self.server, self.thread = start_http_server(port, host, self.registry)
        except OSError as exc:
            raise ValueError(_listen_error(host, port, exc)) from exc
        self.port = self.server.server_port
        shown = f"[{host}]" if ":" in host else host
        self.url = f"http://{shown}:{self.port}/metrics"
        LINES.info("metrics of %s for Prometheus: %s", run_name, self.url)

    def log(self, metrics: dict[str, float], step: int) -> None:
        snapshot = dict(self.snapshot)
        for key, value in metrics.items():
            name = prometheus_name(key)
            owner = self.keys.setdefault(name, key)
            if owner == key:
                snapshot[name] = (key, value)
            elif key not in self.dropped:
                self.dropped.add(key)
                logger.warning("prometheus: metric %r maps to %s, which %r already has; %r is not exported (it is "
                               "in the other backends)", key, name, owner, key)
        snapshot["rlpipe_step"] = ("the latest logged step", float(step))
        snapshot["rlpipe_step_timestamp_seconds"] = ("Unix time the latest step was logged", time.time())
        self.snapshot = snapshot

    def collect(self):
        """prometheus_client's collector protocol: called by the server thread at each scrape."""
        from prometheus_client.core import GaugeMetricFamily

        for name, (key, value) in self.snapshot.items():
            gauge = GaugeMetricFamily(name, key, labels=["run_id"])
            gauge.add_metric([self.run_name], value)
            yield gauge

    def finish(self) -> None:
        """Stop serving and close the socket, so the port is free when this returns."""
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


def _listen_error(host: str, port: int, exc: OSError) -> str:
    if exc.errno == errno.EADDRINUSE:
        return (f"tracking.prometheus_port={port}: {host}:{port} is already in use ({exc.strerror}); stop what "
                "listens there (another run's tracker?), choose a free port, or set tracking.prometheus_port=0 "
                "to take a free one (its URL is printed)")
    return (f"tracking.prometheus_host={host!r}, tracking.prometheus_port={port}: cannot listen there ({exc}); "
            "use an address of this machine (127.0.0.1, 0.0.0.0 for every interface) and a port >= 1024 or 0")


class Tracker:
    """Fan-out metrics logger. Use as a context manager so backends are closed."""

    def __init__(self, backends: list[Backend]):
        self.backends = backends

    @classmethod
    def from_config(cls, cfg: TrackingConfig, run_name: str, run_dir: Path, config: dict | None = None,
                    group: str | None = None) -> Tracker:
        """The backends `cfg.backends` names; if one fails to start, those already started are closed. `group`: the
        stage run this flow run's piece belongs to (wandb's group)."""
        backends: list[Backend] = []
        with ExitStack() as started:
            for name in cfg.backends:
                backends.append(_make_backend(name, cfg, run_name, run_dir, config or {}, group))
                started.callback(backends[-1].finish)
            started.pop_all()
        return cls(backends)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        clean = {k: to_float(v) for k, v in metrics.items()}
        for backend in self.backends:
            backend.log(clean, step)

    def finish(self) -> None:
        """Close every backend in order, even when one raises (the error propagates after the rest closed)."""
        with ExitStack() as stack:
            for backend in reversed(self.backends):
                stack.callback(backend.finish)

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc) -> None:
        self.finish()


def _make_backend(name: str, cfg: TrackingConfig, run_name: str, run_dir: Path, config: dict,
                  group: str | None = None) -> Backend:
    if name == "console":
        return ConsoleBackend(cfg.log_freq)
    if name == "jsonl":
        return JsonlBackend(run_dir / f"{run_name}.metrics.jsonl")
    if name == "wandb":
        return WandbBackend(cfg, run_name, run_dir, config, group)
    if name == "prometheus":
        return PrometheusBackend(cfg, run_name)
    raise ValueError(f"tracking.backends: unknown backend {name!r}; use console, jsonl, wandb or prometheus")


def progress_bar(total: int, initial: int, desc: str) -> tqdm:
    """A tqdm bar; redrawn at most every 10 s when stderr is not a terminal (logs, CI)."""
    interactive = sys.stderr.isatty()
    return tqdm(total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True,
                mininterval=0.5 if interactive else 10.0)
