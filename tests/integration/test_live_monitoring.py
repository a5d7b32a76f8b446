"""Live monitoring for real: an RL run (the tiny model, vLLM on CPU, 3 GRPO steps, validation at steps 0, 2
and 3) with `tracking.backends=[prometheus,jsonl]` on a fixed port. A thread scrapes /metrics over HTTP while
`run_rl` works (the last step may be logged just before run_rl returns, so that one is scraped after it, before
the tracker closes); each step must hold exactly what the jsonl backend wrote up to that step (the step's values,
and the latest earlier value of a key the step did not log), and the port is closed with the tracker.
"""

from __future__ import annotations

import json
import math
import threading
import urllib.request
from pathlib import Path
from urllib.error import URLError

import pytest

from infra.config import load_config
from infra.tracking import Tracker, prometheus_name
from tests.conftest import TINY_OVERRIDES, free_port
from tests.integration.test_rl import RL
from tests.unit.test_tracking import RUN_KEYS

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]

RUN = "rl-live"


def scrape(url: str) -> dict[str, float]:
    """This run's samples on the endpoint: {metric name: value}."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if s.labels == {"run_id": RUN}}


class Scraper(threading.Thread):
    """Scrapes every 0.1 s until stopped; keeps the first scrape that showed each step."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.halt = url, threading.Event()
        self.seen: dict[int, dict[str, float]] = {}
        self.failures: list[str] = []

    def run(self) -> None:
        while not self.halt.wait(0.1):
            try:
                samples = scrape(self.url)
            except URLError as exc:  # the server is up for the whole run: any failure fails the test
                self.failures.append(repr(exc))
                continue
            if "rlpipe_step" in samples:
                self.seen.setdefault(int(samples["rlpipe_step"]), samples)


def same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def test_prometheus_endpoint_serves_every_step_during_an_rl_run(tiny_data_dir, tiny_model_dir, tmp_path):
    from infra.checkpoints import StoreCheckpoints
    from infra.store import ArtifactStore
    from infra.trajectories import RunTables
    from stages.merge import checkpoint_metadata
    from stages.rl import run_rl

    port = free_port()
    cfg = load_config(None, TINY_OVERRIDES + RL + ["tracking.backends=[prometheus,jsonl]",
                                                   f"tracking.prometheus_port={port}"])
    store = ArtifactStore(str(tmp_path / "store"))
    checkpoints = StoreCheckpoints(store, RUN, cfg.rl.max_ckpt_to_keep, {"init_model": str(tiny_model_dir)},
                                   checkpoint_metadata(cfg.model))
    url = f"http://127.0.0.1:{port}/metrics"
    with Tracker.from_config(cfg.tracking, RUN, tmp_path) as tracker:
        scraper = Scraper(url)
        scraper.start()
        try:
            result = run_rl(cfg, str(tiny_model_dir), tiny_data_dir, checkpoints, RunTables(store, RUN), tracker)
        finally:
            scraper.halt.set()
            scraper.join()
        during = sorted(scraper.seen)
        scraper.seen.setdefault(3, scrape(url))  # the last step: run_rl may return before the next poll
    with pytest.raises(URLError):  # closed with the tracker: connection refused
        urllib.request.urlopen(url, timeout=10)

    assert result.num_steps == 3 and not scraper.failures, scraper.failures
    assert during[:3] == [0, 1, 2], during  # seen while run_rl ran (validation, steps 1 and 2)
    assert scraper.seen[3]["rlpipe_step"] == 3  # still served after run_rl, until the tracker closes
    logged: dict[str, float] = {}
    lines = [json.loads(x) for x in Path(tmp_path / f"{RUN}.metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 1, 2, 3]
    for line in lines:
        step = line.pop("step")
        logged.update(line)
        expected = {prometheus_name(k): v for k, v in logged.items()} | {"rlpipe_step": float(step)}
        seen = dict(scraper.seen[step])
        assert seen.pop("rlpipe_step_timestamp_seconds") > 0
        assert seen.keys() == expected.keys(), (step, seen.keys() ^ expected.keys())
        bad = {name: (seen[name], value) for name, value in expected.items() if not same(seen[name], value)}
        assert not bad, (step, bad)
    assert {"rlpipe_actor_pg_loss", "rlpipe_critic_score_mean", "rlpipe_val_acc_mean_at_1"} <= seen.keys()
    # the dashboard's unit test takes its metric keys from RUN_KEYS["grpo"]: a run with this config still logs them
    missing = set(RUN_KEYS["grpo"]) - logged.keys()
    assert not missing, f"no longer logged (update tests/unit/data/rl_metric_keys.json and the dashboard): {missing}"
