"""SFT on two Ray workers (FSDP2 data parallel over gloo, `ray.num_devices_per_node=2`): the one-process run's
steps up to float32 summation order, exact resumption from its sharded checkpoints, a model folder written once.

One Ray instance for the module (2 logical CPU slots); `run_sft` attaches to it.
"""

import pytest
import torch

from infra.checkpoints import StoreCheckpoints
from infra.config import load_config
from infra.config_sections import RayConfig
from infra.store import ArtifactStore
from infra.tracking import Tracker
from stages.model.loading import load_model
from stages.sft import SHARDED_DIR, run_sft
from tests.conftest import TINY_OVERRIDES

STEPS = ["sft.epochs=2", "sft.save_freq=3"]  # 16 steps of 32 sequences, micro-batches of 16


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    from stages.workers.group import init_ray

    init_ray(RayConfig(num_cpus=2, num_devices_per_node=2))
    yield
    ray.shutdown()


class StopAt(Tracker):
    """A tracker that kills the run (raises) when it is asked to log step `stop`."""

    def __init__(self, stop: int = -1):
        super().__init__([])
        self.stop, self.seen = stop, []

    def log(self, metrics, step):
        if step == self.stop:
            raise KeyboardInterrupt(f"killed at step {step}")
        self.seen.append({"step": step, **metrics})


def run(overrides, model_dir, data_dir, out, store, tracker):
    cfg = load_config(None, TINY_OVERRIDES + STEPS + overrides)
    return run_sft(cfg, model_dir, data_dir, out, StoreCheckpoints(store, "sft-ranks", max_to_keep=2), tracker)


def test_two_ranks_train_as_one_process_and_resume_exactly(ray_cluster, tiny_model_dir, tiny_data_dir, tmp_path):
    one = StopAt()
    run([], tiny_model_dir, tiny_data_dir, tmp_path / "one", ArtifactStore(str(tmp_path / "s0")), one)
    two = StopAt()
    run(["ray.num_devices_per_node=2"], tiny_model_dir, tiny_data_dir, tmp_path / "two",
        ArtifactStore(str(tmp_path / "s1")), two)

    # Step 1 is the same sum over the same tokens in another order (each rank's half, then summed across ranks):
    # equal to float32 rounding; a rank's share missing or an average instead of a sum would change it by 2x.
    assert two.seen[0]["train/loss"] == pytest.approx(one.seen[0]["train/loss"], rel=1e-6)
    assert two.seen[0]["train/grad_norm"] == pytest.approx(one.seen[0]["train/grad_norm"], rel=1e-5)
    for got, want in zip(two.seen, one.seen, strict=True):  # later steps: Adam amplifies the rounding a little
        assert got["train/lr"] == want["train/lr"]
        assert got["train/loss"] == pytest.approx(want["train/loss"], rel=1e-4), got["step"]
        assert ("val/loss" in got) == ("val/loss" in want)
        if "val/loss" in got:
            assert got["val/loss"] == pytest.approx(want["val/loss"], rel=1e-4), got["step"]
    a = load_model(tmp_path / "one", load_config(None, TINY_OVERRIDES).model).state_dict()
    b = load_model(tmp_path / "two", load_config(None, TINY_OVERRIDES).model).state_dict()
    lr = load_config(None, TINY_OVERRIDES).sft.optim.lr
    for name in a:  # each Adam step moves a weight by about lr at most: 16 steps of rounding stay far below that
        assert float((a[name] - b[name]).abs().max()) < 16 * lr * 0.1, name

    store = ArtifactStore(str(tmp_path / "s2"))
    with pytest.raises(KeyboardInterrupt):
        run(["ray.num_devices_per_node=2"], tiny_model_dir, tiny_data_dir, tmp_path / "b", store, StopAt(stop=8))
    latest = store.versions("checkpoint", "sft-ranks")[-1]
    assert latest.metadata["step"] == 6 and (store.get_dir(latest.ref) / SHARDED_DIR).is_dir()  # DCP, both ranks'
    resumed = StopAt()
    run(["ray.num_devices_per_node=2"], tiny_model_dir, tiny_data_dir, tmp_path / "b", store, resumed)
    assert resumed.seen[0]["step"] == 7
    by_step = {m["step"]: m for m in two.seen}
    assert all(m["train/loss"] == by_step[m["step"]]["train/loss"] for m in resumed.seen)
    c = load_model(tmp_path / "b", load_config(None, TINY_OVERRIDES).model).state_dict()
    assert all(torch.equal(b[name], c[name]) for name in b)


def test_two_ranks_train_lora_adapters_as_one_process(ray_cluster, tiny_model_dir, tiny_data_dir, tmp_path):
    # every rank starts from the same random adapters (lora_A), the one process's: the steps after the first (where
    # lora_B = 0 hides lora_A) are equal too
    lora = ["model.lora.rank=4", "model.lora.alpha=8", "sft.epochs=1"]
    one, two = StopAt(), StopAt()
    run(lora, tiny_model_dir, tiny_data_dir, tmp_path / "one", ArtifactStore(str(tmp_path / "s0")), one)
    run(lora + ["ray.num_devices_per_node=2"], tiny_model_dir, tiny_data_dir, tmp_path / "two",
        ArtifactStore(str(tmp_path / "s1")), two)
    assert len(one.seen) == len(two.seen) == 8
    for got, want in zip(two.seen, one.seen):
        assert got["train/loss"] == pytest.approx(want["train/loss"], rel=1e-5), got["step"]


def test_two_ranks_resume_their_dropout_streams_exactly(ray_cluster, tiny_model_dir, tiny_data_dir, tmp_path):
    # with dropout each rank draws from its own generator: saved beside the shards, restored at resume
    dropout = ["model.lora.rank=4", "model.lora.dropout=0.2", "sft.epochs=1", "ray.num_devices_per_node=2"]
    straight = StopAt()
    run(dropout, tiny_model_dir, tiny_data_dir, tmp_path / "a", ArtifactStore(str(tmp_path / "s0")), straight)
    store = ArtifactStore(str(tmp_path / "s1"))
    with pytest.raises(KeyboardInterrupt):
        run(dropout, tiny_model_dir, tiny_data_dir, tmp_path / "b", store, StopAt(stop=5))
    resumed = StopAt()
    run(dropout, tiny_model_dir, tiny_data_dir, tmp_path / "b", store, resumed)
    assert resumed.seen[0]["step"] == 4
    by_step = {m["step"]: m for m in straight.seen}
    assert all(m["train/loss"] == by_step[m["step"]]["train/loss"] for m in resumed.seen)
