"""Checkpoints load without unpickling arbitrary objects: a trainer state, an SFT train state, DCP's .metadata or a
non-tensor value inside a DCP shard that holds an object whose __reduce__ would run code is refused with
UnsafeCheckpointError, and the code does not run (its marker file is never created). Each test then shows that
the same file, loaded the unsafe way, does run the code, so the refusal is what protects."""

from __future__ import annotations

import pickle
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo

from infra.config import load_config
from stages.model.fsdp import read_checkpoint_model_state
from stages.model.safe_load import (
    SafeFileSystemReader,
    SafeLoadPlanner,
    UnsafeCheckpointError,
    load_state,
    refusals_raised,
)
from stages.sft import CHECKPOINT_FILE, _Loop


class Payload:
    """Unpickling it creates `marker` (it could as well run any shell command)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


@pytest.fixture(autouse=True)
def _quiet_dcp():
    with warnings.catch_warnings():  # DCP warns that it runs without a process group
        warnings.simplefilter("ignore", UserWarning)
        yield


def test_trainer_state_with_code_is_refused(tmp_path):
    marker, path = tmp_path / "pwned", tmp_path / "trainer.pt"
    torch.save({"step": 4, "kl_ctrl": {"value": 0.1}, "python_rng": Payload(marker)}, path)
    with pytest.raises(UnsafeCheckpointError, match=r"trainer\.pt: refused to load: it holds .*io\.open"):
        load_state(path)
    assert not marker.exists()
    torch.load(path, weights_only=False)  # what the RL stage did before
    assert marker.exists()


def test_plain_trainer_state_roundtrips(tmp_path):
    import random

    state = {"step": 4, "kl_ctrl": {"value": 0.1}, "python_rng": random.getstate(),
             "torch_rng": torch.get_rng_state(), "no_signal": {"streak": [{"step": 3.0, "x": 0.5}]}}
    torch.save(state, tmp_path / "trainer.pt")
    loaded = load_state(tmp_path / "trainer.pt")
    assert loaded["python_rng"] == state["python_rng"] and torch.equal(loaded["torch_rng"], state["torch_rng"])
    random.setstate(loaded["python_rng"])  # Python's random state is a tuple of ints: plain data


class FolderCheckpoints:
    tmp_dir = None

    def __init__(self, folder):
        self.folder = folder

    def latest(self):
        return self.folder


def test_sft_train_state_with_code_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    model = torch.nn.Linear(2, 2)
    torch.save({"step": 3, "model": model.state_dict(), "scheduler": Payload(marker)}, tmp_path / CHECKPOINT_FILE)
    with pytest.raises(UnsafeCheckpointError, match=CHECKPOINT_FILE):
        _Loop(load_config(None, []), None, None, FolderCheckpoints(tmp_path)).resume()  # before any rank loads it
    assert not marker.exists()


def dcp_folder(root, state) -> tuple:
    """An RL-checkpoint-like folder root/actor written by DCP in this process."""
    dcp.save(state, checkpoint_id=str(root / "actor"))
    return root, root / "actor"


def test_real_dcp_metadata_loads(tmp_path):
    weight = torch.arange(6.0).reshape(2, 3)
    ckpt, _ = dcp_folder(tmp_path, {"model": {"w": weight, "b": torch.ones(2, dtype=torch.bfloat16)}})
    state = read_checkpoint_model_state(ckpt)
    assert torch.equal(state["w"], weight) and state["b"].dtype == torch.bfloat16


def test_dcp_metadata_with_code_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    ckpt, actor = dcp_folder(tmp_path, {"model": {"w": torch.ones(2)}})
    (actor / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata: refused to load: it holds the global io\.open"):
        read_checkpoint_model_state(ckpt)
    assert not marker.exists()
    with pytest.raises(CheckpointException):  # DCP's own reader runs the code, then fails on what it built
        dcp.load({"model": {"w": torch.zeros(2)}}, checkpoint_id=str(actor))
    assert marker.exists()


def test_dcp_metadata_pointing_outside_the_folder_is_refused(tmp_path):
    ckpt, actor = dcp_folder(tmp_path, {"model": {"w": torch.ones(2)}})
    metadata = pickle.loads((actor / ".metadata").read_bytes())
    for index, info in metadata.storage_data.items():
        metadata.storage_data[index] = _StorageInfo("../../secret", info.offset, info.length)
    (actor / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(UnsafeCheckpointError, match="outside the checkpoint folder"):
        read_checkpoint_model_state(ckpt)


def test_dcp_value_with_code_is_refused(tmp_path):
    """Non-tensor values (optimizer hyper-parameters, scheduler state) are torch.save blobs inside the shards."""
    marker = tmp_path / "pwned"
    _, actor = dcp_folder(tmp_path, {"model": {"w": torch.ones(2)}, "scheduler": {"last_epoch": Payload(marker)}})
    target = {"model": {"w": torch.zeros(2)}, "scheduler": {"last_epoch": 0}}
    refused = pytest.raises(UnsafeCheckpointError, match=r"the value of 'scheduler\.last_epoch'.*io\.open")
    with refused, refusals_raised():
        dcp.load(target, storage_reader=SafeFileSystemReader(str(actor)), planner=SafeLoadPlanner(folder=actor))
    assert not marker.exists()
    dcp.load(target, checkpoint_id=str(actor))  # DCP's own planner: torch.load(weights_only=False)
    assert marker.exists()


def test_dcp_plain_values_load(tmp_path):
    _, actor = dcp_folder(tmp_path, {"model": {"w": torch.ones(2)}, "scheduler": {"last_epoch": 7, "lrs": [0.5]}})
    target = {"model": {"w": torch.zeros(2)}, "scheduler": {"last_epoch": 0, "lrs": [0.0]}}
    dcp.load(target, storage_reader=SafeFileSystemReader(str(actor)), planner=SafeLoadPlanner(folder=actor))
    assert torch.equal(target["model"]["w"], torch.ones(2)) and target["scheduler"] == {"last_epoch": 7, "lrs": [0.5]}
