"""The whole tiny flow with `storage.root=s3://bucket/prefix` against a real local S3 server (moto, on
127.0.0.1): every artifact and table lands in the bucket and nothing in a local store; the SQL command
reads the trajectories back from S3, and the store command shows each artifact's lineage there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from infra.artifacts import ArtifactRef
from infra.store import ArtifactStore
from tests.conftest import TINY_OVERRIDES

pytestmark = [pytest.mark.s3, pytest.mark.slow]
PROJECT = Path(__file__).resolve().parents[2]
STEPS, BATCH, N = 2, 8, 2
TINY_RL = ["rl.enabled=true", f"rl.total_steps={STEPS}", f"rl.train_batch_size={BATCH}", f"rl.rollout.n={N}",
           "rl.actor.ppo_mini_batch_size=4", "rl.rollout.engine=hf", "rl.test_freq=2", "rl.save_freq=1",
           "rl.val_before_train=false", "rl.max_validation_samples=8", "rl.reward.num_workers=1",
           "evaluate.engine=hf", "evaluate.max_samples=8", "sft.save_freq=4", "ray.num_cpus=2",
           "data.max_response_length=16", "tracking.backends=[jsonl]"]


@pytest.fixture(scope="module")
def flow_on_s3(s3_server, tmp_path_factory):
    """One flow run into a fresh bucket; returns (store root, flow result, local output folder)."""
    from flows.post_train import post_train

    root = f"s3://{s3_server.create_bucket()}/runs/demo"
    out = tmp_path_factory.mktemp("flow-s3")
    result = post_train(None, [*TINY_OVERRIDES, *TINY_RL, f"storage.root={root}",
                               f"storage.endpoint_url={s3_server.endpoint_url}", f"run.output_dir={out}"])
    return root, result, out


def keys(s3_server, root: str) -> list[str]:
    """Every object key under root, relative to it, listed with boto3 (not through our store code)."""
    bucket, _, prefix = root.removeprefix("s3://").partition("/")
    pages = s3_server.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/")
    return sorted(obj["Key"][len(prefix) + 1:] for page in pages for obj in page.get("Contents", []))


def cli(module: str, root: str, endpoint: str, *args: str) -> subprocess.CompletedProcess:
    """A command as a user runs it: the endpoint from AWS_ENDPOINT_URL, credentials from the environment."""
    env = {**os.environ, "PYTHONPATH": str(PROJECT), "AWS_ENDPOINT_URL": endpoint}
    done = subprocess.run([sys.executable, "-m", module, "--root", root, *args], cwd=PROJECT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done


def test_every_artifact_and_table_is_in_the_bucket(flow_on_s3, s3_server):
    root, result, out = flow_on_s3
    assert set(result["stages"].values()) == {"Completed"}
    found = keys(s3_server, root)
    manifests = [k for k in found if k.startswith("artifacts/") and k.endswith("/_manifest.json")]
    committed = {tuple(k.split("/")[1:3]) for k in manifests}  # (kind, name) of every committed version
    kinds = {kind for kind, _ in committed}
    assert {"dataset", "model", "checkpoint", "eval"} <= kinds, committed
    assert {("dataset", "synthetic"), ("model", "sft"), ("model", "rl"), ("eval", "base"), ("eval", "sft"),
            ("eval", "rl")} <= committed, committed
    assert any(name.startswith("sft-") for kind, name in committed if kind == "checkpoint")
    assert any(name.startswith("rl-") for kind, name in committed if kind == "checkpoint")
    model_files = {k.rsplit("/", 1)[-1] for k in found if k.startswith("artifacts/model/rl/")}
    assert {"config.json", "model.safetensors", "tokenizer.json", "_manifest.json"} <= model_files, model_files
    for table in ("rollouts", "metrics", "validation"):  # one parquet file per step
        assert any(k.startswith(f"{table}/run_id=") and k.endswith(".parquet") for k in found), table
    assert f"runs/{result['run_id']}/config.yaml" in found
    assert not any(out.rglob("_manifest.json")) and not any(out.rglob("*.parquet"))  # nothing in a local store
    assert not (PROJECT / "outputs" / "store" / "runs" / result["run_id"]).exists()

    store = ArtifactStore(root, endpoint_url=s3_server.endpoint_url)
    rl_model = ArtifactRef.parse(result["results"]["rl"]["model"])
    assert store.exists(rl_model) and store.manifest(rl_model).inputs  # made from something, recorded


def test_sql_cli_reads_the_trajectories_from_s3(flow_on_s3, s3_server):
    root, result, _ = flow_on_s3
    sql = "SELECT step, count(*) AS n, count(DISTINCT group_id) AS groups, min(length(response)) >= 0 AS ok " \
          "FROM rollouts GROUP BY 1 ORDER BY 1"
    rows = json.loads(cli("infra.sql", root, s3_server.endpoint_url, "--format", "json", sql).stdout)
    assert rows == [{"step": s, "n": BATCH * N, "groups": BATCH, "ok": True} for s in range(1, STEPS + 1)]
    metrics = json.loads(cli("infra.sql", root, s3_server.endpoint_url, "--format", "json",
                             "SELECT DISTINCT step FROM metrics WHERE name = 'actor/pg_loss' ORDER BY 1").stdout)
    assert metrics == [{"step": s} for s in range(1, STEPS + 1)]
    evals = json.loads(cli("infra.sql", root, s3_server.endpoint_url, "--format", "json",
                           f"SELECT DISTINCT label FROM evals WHERE run_id = '{result['run_id']}' ORDER BY 1").stdout)
    assert evals == [{"label": label} for label in ("base", "rl", "sft")]


def test_lineage_on_s3_names_what_each_version_was_made_from(flow_on_s3, s3_server):
    root, result, _ = flow_on_s3
    store = ArtifactStore(root, endpoint_url=s3_server.endpoint_url)
    rl_model, sft_model = result["results"]["rl"]["model"], result["results"]["sft"]["model"]
    sft = store.manifest(ArtifactRef.parse(sft_model))
    dataset = sft.inputs["dataset"]

    versions = cli("infra.store", root, s3_server.endpoint_url, "versions", "model/sft").stdout
    assert sft_model in versions and f"dataset={dataset}" in versions and f"base_model={sft.inputs['base_model']}" \
        in versions

    shown = cli("infra.store", root, s3_server.endpoint_url, "show", rl_model).stdout
    manifest, _, lineage = shown.partition("lineage:\n")
    assert json.loads(manifest)["inputs"] == store.manifest(ArtifactRef.parse(rl_model)).inputs
    lines = [line.strip() for line in lineage.splitlines()]
    assert lines[0] == rl_model
    # the RL model goes back, through its inputs, to the SFT model and the dataset, all in the bucket
    assert any(line.endswith(f"<- {sft_model}") for line in lines), lineage
    assert any(line.endswith(f"<- {dataset}") for line in lines), lineage
    assert "(not in store)" not in lineage
