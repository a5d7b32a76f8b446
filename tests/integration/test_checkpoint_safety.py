"""RL resume from damaged and forged checkpoints, for real (a Ray worker, FSDP2, DCP, hf rollouts; one Ray instance
for the module, one 2-step run that the tests copy):

1. The step-2 checkpoint's actor shard zeroed in place (256 KiB, same size): the rerun warns naming the corrupt
   version, resumes from step 1 and redoes step 2 exactly: the same rollouts as the uninterrupted run.
2. A forged step-2 checkpoint (its manifest rewritten to match, as anyone who can write to the store can do) whose
   trainer state or DCP metadata would run code on load is refused with UnsafeCheckpointError; the code never runs.
"""

import hashlib
import json
import logging
import pickle
import shutil

import pytest
import torch

from infra.artifacts import MANIFEST
from infra.checkpoints import StoreCheckpoints
from infra.config import load_config
from infra.sql import query
from infra.store import ArtifactStore
from infra.tracking import Tracker
from infra.trajectories import RunTables
from stages.model.safe_load import UnsafeCheckpointError
from tests.conftest import TINY_OVERRIDES

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]

RL = ["rl.enabled=true", "rl.total_steps=2", "rl.train_batch_size=8", "rl.rollout.n=4",
      "rl.actor.ppo_mini_batch_size=4",
      "rl.rollout.engine=hf", "rl.save_freq=1", "rl.max_ckpt_to_keep=2", "rl.test_freq=0", "rl.val_before_train=false",
      "rl.actor.optim.lr=1e-3", "rl.reward.num_workers=1", "data.max_response_length=24"]
NAME = "rl-safety"


def run(root, tiny_data_dir, tiny_model_dir):
    from stages.rl import run_rl

    cfg = load_config(None, TINY_OVERRIDES + RL)
    store = ArtifactStore(str(root))
    return run_rl(cfg, str(tiny_model_dir), tiny_data_dir, StoreCheckpoints(store, NAME, cfg.rl.max_ckpt_to_keep),
                  RunTables(store, NAME), Tracker([]))


def rollouts(root, step: int) -> list[tuple]:
    return [tuple(r.values()) for r in query(str(root), "SELECT prompt, response, score FROM rollouts "
                                                        f"WHERE step = {step} ORDER BY ALL")]


@pytest.fixture(scope="module")
def first_run(tiny_data_dir, tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("first") / "store"
    run(root, tiny_data_dir, tiny_model_dir)
    return root, rollouts(root, 2)


def copy_of(first_run, tmp_path):
    root = tmp_path / "store"
    shutil.copytree(first_run[0], root)
    store = ArtifactStore(str(root))
    checkpoints = StoreCheckpoints(store, NAME, 2)
    return root, store, checkpoints.at_step(1), checkpoints.at_step(2)


def test_corrupt_checkpoint_falls_back_and_resumes_exactly(first_run, tiny_data_dir, tiny_model_dir, tmp_path,
                                                          caplog):
    root, store, step1, step2 = copy_of(first_run, tmp_path)
    shard = root / "artifacts" / "checkpoint" / NAME / step2.version / "actor" / "__0_0.distcp"
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.seek(size // 2)
        f.write(bytes(256 * 1024))
    assert shard.stat().st_size == size
    caplog.set_level(logging.INFO)
    result = run(root, tiny_data_dir, tiny_model_dir)
    assert f"checkpoint {step2} (step 2) is corrupt, skipping it: {step2} at" in caplog.text
    assert "actor/__0_0.distcp: sha256" in caplog.text
    assert f"resuming from checkpoint {step1} at step 1, the newest intact one, instead of the corrupt {step2}" \
           in caplog.text
    assert "rl: resumed at step 1" in caplog.text
    assert rollouts(root, 2) == first_run[1]  # step 2 redone from the exact state of step 1
    assert store.verify(result.checkpoint).metadata["step"] == 2
    assert [m.metadata["step"] for m in store.versions("checkpoint", NAME)] == [1, 2]  # the corrupt one is gone


class Payload:
    """Unpickling it creates `marker` (it could as well run any shell command)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def forge(store: ArtifactStore, ref, rel: str, data: bytes) -> None:
    """Replace a file of a stored version and rewrite its manifest to match: the store's checks pass."""
    folder = store.get_dir(ref)
    (folder / rel).write_bytes(data)
    manifest = json.loads((folder / MANIFEST).read_bytes())
    manifest["files"][rel] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (folder / MANIFEST).write_text(json.dumps(manifest))
    store.verify(ref)


def trainer_state_with_code(marker) -> bytes:
    path = marker.parent / "forged.pt"
    torch.save({"step": 2, "kl_ctrl": {"value": 0.0}, "python_rng": Payload(marker)}, path)
    return path.read_bytes()


@pytest.mark.parametrize("rel, forged", [("trainer.pt", trainer_state_with_code),
                                         ("actor/.metadata", lambda marker: pickle.dumps(Payload(marker)))],
                         ids=["trainer_state", "dcp_metadata"])
def test_forged_checkpoint_that_would_run_code_is_refused(first_run, tiny_data_dir, tiny_model_dir, tmp_path,
                                                          rel, forged):
    root, store, _, step2 = copy_of(first_run, tmp_path)
    marker = tmp_path / "pwned"
    forge(store, step2, rel, forged(marker))
    with pytest.raises(UnsafeCheckpointError, match=f"{rel.split('/')[-1]}: refused to load: it holds .*io.open"):
        run(root, tiny_data_dir, tiny_model_dir)
    assert not marker.exists()
