"""verl's GSM8K GRPO tutorial command line through the whole flow, as a user runs it: `python -m flows.post_train
--verl <examples/grpo_trainer/run_qwen2-7b.sh's overrides>` (tests/verl_gsm8k.py).

Swapped, as the paths are: the parquet files (verl's GSM8K layout, 21 train / 8 test rows of data/samples) and
the model (the session's tiny model folder). Appended after the tutorial's line, the way verl's scripts take `$@`
(the last value wins, as in Hydra), because this machine cannot run the originals: `trainer.n_gpus_per_node=1` and
`tensor_model_parallel_size=1` (8 GPUs and a 2-way tensor-parallel engine; here: 2 CPU cores, one worker),
`data.train_batch_size=8` with `ppo_mini_batch_size=4` (1024 prompts a step; the data has 21 rows),
`data.max_response_length=16` and `data.max_prompt_length=256` (the tiny model has 512 positions; the prompts are
139-229 tokens, so none is filtered), `trainer.total_epochs=1` (2 steps: 21 // 8). Our own overrides, before
`--verl`, only place the store and run folders in tmp, cap Ray's CPUs and the scorer processes, and keep the
evaluation of the base and RL models small (hf engine, 4 prompts). Every other verl value is the tutorial's:
vLLM rollouts, n=5, KL loss k3, remove-padding, gradient checkpointing, wandb (offline), save_freq 20, test_freq 5.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from infra.config import load_config
from tests.verl_gsm8k import native, tutorial, write_gsm8k_parquet

pytestmark = pytest.mark.slow

PROJECT = Path(__file__).resolve().parents[2]
A, R = "actor_rollout_ref.actor.", "actor_rollout_ref.rollout."
SMALL = ["trainer.n_gpus_per_node=1", R + "tensor_model_parallel_size=1", "data.train_batch_size=8",
         A + "ppo_mini_batch_size=4", "data.max_response_length=16", "data.max_prompt_length=256",
         "trainer.total_epochs=1"]
SMALL_NATIVE = ["ray.num_devices_per_node=1", "rl.rollout.tensor_model_parallel_size=1", "rl.train_batch_size=8",
                "rl.actor.ppo_mini_batch_size=4", "data.max_response_length=16", "data.max_prompt_length=256",
                "rl.total_steps=2"]


def test_the_tutorial_command_line_runs_through_the_flow(tmp_path, tiny_model_dir):
    data = write_gsm8k_parquet(tmp_path / "gsm8k")
    ours = [f"storage.root={tmp_path / 'store'}", f"run.output_dir={tmp_path / 'out'}", "ray.num_cpus=2",
            "rl.reward.num_workers=1", "evaluate.engine=hf", "evaluate.max_samples=4"]
    env = {**os.environ, "PYTHONPATH": str(PROJECT), "PREFECT_HOME": str(tmp_path / "prefect"),
           "PREFECT_RESULTS_LOCAL_STORAGE_PATH": str(tmp_path / "prefect" / "results")}
    done = subprocess.run([sys.executable, "-m", "flows.post_train", *ours, "--verl", *tutorial(data, tiny_model_dir),
                           *SMALL], cwd=PROJECT, env=env, capture_output=True, text=True, timeout=900)
    console = done.stdout + done.stderr
    assert done.returncode == 0, console[-6000:]

    # The mapping, one line per key, then the step count once data prep has counted the rows.
    for line in (f"{R}n=5 -> rl.rollout.n=5", "data.train_batch_size=8 -> rl.train_batch_size=8  (given 2 times",
                 f"{A}ppo_micro_batch_size_per_gpu=40 -> rl.actor.micro_batch_size=40",
                 f"{R}log_prob_micro_batch_size_per_gpu=40 -> nothing to set  # no-grad log-prob passes",
                 f"data.train_files={data}/train.parquet -> data.source=file data.path={data}",
                 "trainer.total_epochs=1 -> rl.total_steps=<after data prep: 1 x (training rows // 8)>",
                 "verl: trainer.total_epochs=1 -> rl.total_steps=2  # 21 training rows"):
        assert line in console, console[-6000:]
    assert re.search(r"^\S+ data-prep +ran .*  21 train / 8 validation rows$", console, re.M), console[-6000:]
    assert re.search(r"^\S+ rl +ran .*  2 steps, ", console, re.M), console[-6000:]
    assert re.search(r"^\S+ evaluate-rl +ran ", console, re.M) and not re.search(r"^\S+ sft ", console, re.M)

    # config.yaml (run folder and store): the native run's config, and the record of what each verl key became. The
    # RL stage writes the automatic settings (None in a config) it decided into config.yaml
    # (tasks/stages.py record_automatic_settings), as it does for a native run: those differ from None only.
    [run_dir] = (tmp_path / "out" / "runs").iterdir()
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    stored = tmp_path / "store" / "runs" / run_dir.name / "config.yaml"
    assert stored.read_text() == (run_dir / "config.yaml").read_text()
    record = saved["run"].pop("source_overrides")
    expected = load_config(None, native(data, tiny_model_dir) + SMALL_NATIVE + ours).model_dump(mode="json")
    expected["run"].pop("source_overrides")
    differ = differences(saved, expected)
    assert [(key, ours) for key, ours, native_value in differ if native_value is not None] == []
    assert {key for key, _, _ in differ} <= {"rl.actor.use_torch_compile", "rl.actor.logprob_chunk_tokens",
                                             "rl.actor.reshard_after_forward", "rl.actor.grad_sync_every_micro_batch",
                                             "rl.rollout.prefix_cache_rows"}
    assert record["trainer.total_epochs=1"] == ["rl.total_steps=2"]
    assert record[f"{R}n=5"] == ["rl.rollout.n=5"] and record[f"{A}fsdp_config.param_offload=False"] == []


def differences(a, b, path: str = "") -> list[tuple[str, object, object]]:
    """(dotted key, a's value, b's value) wherever two config trees differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for key in sorted(set(a) | set(b)) for d in differences(a.get(key), b.get(key), f"{path}.{key}")]
    return [] if a == b else [(path[1:], a, b)]
