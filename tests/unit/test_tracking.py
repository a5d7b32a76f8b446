"""Tracking backends: console, jsonl in the run folder, wandb offline (a real wandb run, no network)."""

import json
import logging

import torch

from infra.config import TrackingConfig
from infra.tracking import Tracker


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
    with Tracker.from_config(cfg, "run", tmp_path, config={"sft": {"epochs": 1}}) as t:
        t.log({"train/loss": 1.0}, step=1)
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
