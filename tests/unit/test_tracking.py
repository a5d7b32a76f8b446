"""Tracking backends: console, jsonl in the run folder, wandb offline (a real wandb run, no network), the
Prometheus endpoint (real HTTP on 127.0.0.1), and the Grafana dashboard's queries against what it serves."""

import json
import logging
import math
import re
import socket
import time
import urllib.request
from pathlib import Path
from urllib.error import URLError

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from infra.config_sections import TrackingConfig
from infra.tracking import Tracker, prometheus_name


def test_jsonl_and_console(tmp_path, caplog):
    cfg = TrackingConfig(backends=["console", "jsonl"], log_freq=2)
    with caplog.at_level(logging.INFO, logger="infra.tracking"), Tracker.from_config(cfg, "run", tmp_path) as t:
        t.log({"train/loss": torch.tensor(1.5), "train/lr": 1e-3}, step=1)  # console skips odd steps
        t.log({"train/loss": 0.5}, step=2)
    lines = [json.loads(x) for x in (tmp_path / "run.metrics.jsonl").read_text().splitlines()]
    assert lines == [{"step": 1, "train/loss": 1.5, "train/lr": 1e-3}, {"step": 2, "train/loss": 0.5}]
    assert "step 2  train/loss=0.5" in caplog.text and "step 1 " not in caplog.text


def test_wandb_offline_writes_a_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    cfg = TrackingConfig(backends=["wandb"], wandb_mode="offline", project="rlpipe-test")
    with Tracker.from_config(cfg, "run", tmp_path, config={"sft": {"epochs": 1}}, group="rl-0123") as t:
        t.log({"train/loss": 1.0}, step=1)
        [backend] = t.backends
        assert backend.run.group == "rl-0123"  # the flow runs that resume one stage run, together in wandb
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))


# --------------------------------------------------------------------------------------------------
# Prometheus: the endpoint, the names, the port; the Grafana dashboard against what the exporter serves.

DASHBOARD = Path(__file__).parents[2] / "docs" / "grafana" / "rl-dashboard.json"
RUN_KEYS = json.loads((Path(__file__).parent / "data" / "rl_metric_keys.json").read_text())["runs"]


def prometheus_cfg(port: int = 0) -> TrackingConfig:
    return TrackingConfig(backends=["prometheus"], prometheus_port=port)


def scrape(url: str) -> dict[tuple[str, str], float]:
    """{(metric name, run_id label): value} of every sample the endpoint serves."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {(s.name, s.labels["run_id"]): s.value for family in text_string_to_metric_families(text)
            for s in family.samples}


@pytest.mark.parametrize("key, name", [
    ("actor/pg_loss", "rlpipe_actor_pg_loss"),
    ("critic/score/mean", "rlpipe_critic_score_mean"),
    ("timing_s/update_actor", "rlpipe_timing_s_update_actor"),
    ("val/acc/mean@8", "rlpipe_val_acc_mean_at_8"),  # '@' is spelt out: mean@8 and mean_8 stay apart
    ("val/openai/gsm8k/acc/best@1", "rlpipe_val_openai_gsm8k_acc_best_at_1"),
    ("val-core/x.y:z", "rlpipe_val_core_x_y_z"),  # '-', '.', ':' (colons are for recording rules)
    ("reward/ kind //mean/", "rlpipe_reward_kind_mean"),  # runs of '_' collapse, none at the ends
    ("2nd/loss", "rlpipe_2nd_loss"),  # the prefix makes a leading digit legal
])
def test_prometheus_names(key, name):
    assert prometheus_name(key) == name
    assert re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", name)


def test_endpoint_serves_the_latest_values_and_closing_frees_the_port(tmp_path):
    with Tracker.from_config(prometheus_cfg(), "run-a", tmp_path) as t, \
            Tracker.from_config(prometheus_cfg(), "run-b", tmp_path) as other:  # own registries: no clash
        url = t.backends[0].url
        assert scrape(url) == {}  # nothing logged yet
        t.log({"actor/pg_loss": torch.tensor(-0.25), "val/acc/mean@1": 0.5, "actor/kl": math.nan}, step=1)
        t.log({"actor/pg_loss": 0.125, "timing_s/gen": math.inf}, step=2)  # val/acc not logged at step 2
        other.log({"actor/pg_loss": 7.0}, step=9)
        samples = scrape(url)
        port = t.backends[0].port
    stamp = samples.pop(("rlpipe_step_timestamp_seconds", "run-a"))
    assert abs(stamp - time.time()) < 60
    kl = samples.pop(("rlpipe_actor_kl", "run-a"))
    assert math.isnan(kl)  # NaN and Inf are served as they are, not replaced by an old finite value
    assert samples == {("rlpipe_actor_pg_loss", "run-a"): 0.125, ("rlpipe_val_acc_mean_at_1", "run-a"): 0.5,
                       ("rlpipe_timing_s_gen", "run-a"): math.inf, ("rlpipe_step", "run-a"): 2.0}
    with pytest.raises(URLError):  # closed: connection refused
        urllib.request.urlopen(url, timeout=10)
    with Tracker.from_config(prometheus_cfg(port), "run-c", tmp_path) as t:  # free again at once (the next stage)
        t.log({"x": 1.0}, step=1)
        assert scrape(f"http://127.0.0.1:{port}/metrics")[("rlpipe_x", "run-c")] == 1.0


def test_a_busy_port_is_an_error_naming_the_field_and_the_fix(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        jsonl = TrackingConfig(backends=["jsonl", "prometheus"], prometheus_port=port)
        with pytest.raises(ValueError, match=rf"tracking\.prometheus_port={port}: 127\.0\.0\.1:{port} is already in "
                           r"use.*tracking\.prometheus_port=0"):
            Tracker.from_config(jsonl, "run", tmp_path)


def test_two_keys_with_one_name_export_the_first_and_warn_once(tmp_path, caplog):
    with Tracker.from_config(prometheus_cfg(), "run", tmp_path) as t:
        for step in (1, 2):
            t.log({"a/b": 1.0, "a.b": 2.0, "step": 3.0}, step=step)  # 'step' would be rlpipe_step
        samples = scrape(t.backends[0].url)
    assert samples[("rlpipe_a_b", "run")] == 1.0 and samples[("rlpipe_step", "run")] == 2.0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and "'a.b' maps to rlpipe_a_b, which 'a/b' already has" in warnings[0], warnings


def exported_names(tmp_path) -> set[str]:
    """What the exporter serves after logging each recorded real run's metric keys."""
    names = set()
    for run, keys in RUN_KEYS.items():
        with Tracker.from_config(prometheus_cfg(), run, tmp_path) as t:
            t.log({key: 1.0 for key in keys}, step=1)
            names |= {name for name, _ in scrape(t.backends[0].url)}
    return names


NAME_MATCHER = re.compile(r'__name__\s*(=~|!~|=|!=)\s*"([^"]*)"')


def test_dashboard_queries_only_metrics_the_exporter_serves(tmp_path):
    """Every panel's every query reads metrics that real RL runs' keys become on the endpoint (a literal name,
    or a `__name__=~` regex matching at least one), filtered by the $run_id variable, on the $datasource."""
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["schemaVersion"] >= 36 and dashboard["uid"] and dashboard["title"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["run_id"]["definition"] == "label_values(rlpipe_step, run_id)"
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    exported = exported_names(tmp_path)
    for panel in panels:
        assert panel["targets"] and panel["datasource"]["uid"] == "${datasource}", panel["title"]
        for target in panel["targets"]:
            expr, where = target["expr"], f"{panel['title']}: {target['expr']}"
            assert target["datasource"]["uid"] == "${datasource}" and 'run_id=~"$run_id"' in expr, where
            for op, regex in NAME_MATCHER.findall(expr):
                assert op != "=~" or any(re.fullmatch(regex, name) for name in exported), where
            names = re.findall(r"\brlpipe_\w+", NAME_MATCHER.sub("", expr))
            assert names or "__name__=~" in expr, where
            assert set(names) <= exported, (where, set(names) - exported)
    wanted = {"rlpipe_critic_score_mean", "rlpipe_actor_pg_loss", "rlpipe_actor_ppo_kl", "rlpipe_actor_entropy",
              "rlpipe_response_length_mean", "rlpipe_actor_grad_norm", "rlpipe_perf_throughput", "rlpipe_tool_calls"}
    exprs = " ".join(t["expr"] for p in panels for t in p["targets"])
    assert wanted <= set(re.findall(r"\brlpipe_\w+", exprs))
    assert "rlpipe_val_acc_" in exprs and "rlpipe_timing_s_" in exprs


def test_a_resumed_run_rewrites_its_steps_in_the_jsonl_file_once(tmp_path):
    from infra.tracking import JsonlBackend

    path = tmp_path / "rl.metrics.jsonl"
    first = JsonlBackend(path)
    for step in (0, 1, 2, 3):
        first.log({"loss": float(step)}, step)
    path.write_text(path.read_text() + '{"step": 4, "lo')  # a kill mid-line
    retry = JsonlBackend(path)  # a retried task in the same run folder resumes from its checkpoint of step 2
    for step in (3, 4):
        retry.log({"loss": 10.0 + step}, step)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(d["step"], d["loss"]) for d in lines] == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 13.0), (4, 14.0)]
    path.write_text(path.read_text() + '{"step": 5, "lo')
    JsonlBackend(path).log({"loss": 16.0}, 6)  # resumed past the cut line: it goes, the new line stands alone
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 1, 2, 3, 4, 6]
