"""The post-training flow end to end through Prefect (a temporary local Prefect server), on a tiny config:
a first run executes every stage, a second identical run is all cache hits, and bad inputs fail cleanly."""

import json

import pytest

from infra.config import ConfigError
from infra.store import ArtifactStore, StoreError
from tests.conftest import TINY_OVERRIDES

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def post_train():
    from flows.post_train import post_train

    return post_train


def _overrides(tmp_path, *extra):
    return TINY_OVERRIDES + [f"storage.root={tmp_path / 'store'}", f"run.output_dir={tmp_path / 'out'}",
                             "tracking.backends=[jsonl]", *extra]


def test_flow_runs_then_hits_the_cache(post_train, tmp_path):
    first = post_train(None, _overrides(tmp_path))
    assert set(first["stages"].values()) == {"Completed"}
    acc = first["results"]["sft"]["acc"]
    assert 0.0 <= acc <= 1.0

    second = post_train(None, _overrides(tmp_path))
    assert second["stages"] == {k: "Cached" for k in first["stages"]}
    assert second["results"]["sft"]["acc"] == acc

    # An unrelated section's change re-runs only what reads it.
    third = post_train(None, _overrides(tmp_path, "evaluate.max_samples=8"))
    assert third["stages"]["sft"] == "Cached" and third["stages"]["data-prep"] == "Cached"
    assert third["stages"]["evaluate-sft"] == "Completed"

    store = ArtifactStore(str(tmp_path / "store"))
    [sft] = store.versions("model", "sft")
    assert sft.inputs["dataset"].startswith("dataset/synthetic@") and sft.config_hash
    run_dir = tmp_path / "out" / "runs" / first["run_id"]
    assert (run_dir / "config.yaml").read_text().count("storage:") == 1
    metrics = [json.loads(line) for line in (run_dir / f"{first['run_id']}-sft.metrics.jsonl").open()]
    assert {"train/loss", "train/lr", "train/grad_norm"} <= set(metrics[0])
    assert "val/loss" in metrics[-1]
    assert store.glob(f"runs/{first['run_id']}/config.yaml")


def test_bad_config_fails_before_any_stage(post_train, tmp_path):
    with pytest.raises(ConfigError, match="sft.optim.lr"):
        post_train(None, _overrides(tmp_path, "sft.optim.lr=-1"))
    assert not (tmp_path / "store").exists()


def test_dataset_missing_ground_truth_fails_and_leaves_no_artifact(post_train, tmp_path):
    rows = [{"question": "What is 1 + 1?", "answer": "#### 2"}, {"question": "What is 2 + 2?"}]
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=r"row 1 .*'answer'"):
        post_train(None, _overrides(tmp_path, "data.source=file", f"data.path={path}"))
    store = ArtifactStore(str(tmp_path / "store"))
    assert store.artifacts() == []
    assert not list((tmp_path / "store").glob(".staging/*"))


def test_unreachable_s3_endpoint_is_one_clear_error(post_train, tmp_path, s3_server):
    overrides = _overrides(tmp_path) + ["storage.root=s3://bucket/prefix", "storage.endpoint_url=http://127.0.0.1:9"]
    with pytest.raises(StoreError, match=r"storage.endpoint_url"):
        post_train(None, overrides)
