"""verl's GSM8K GRPO tutorial for the tests: its command line, the equivalent native overrides, and local parquet
files in the layout verl's GSM8K preprocessing writes.

The command line is verl's `examples/grpo_trainer/run_qwen2-7b.sh` (volcengine/verl), key for key and value for
value, with the paths swapped: `$HOME/data/gsm8k/{train,test}.parquet` -> `{data}/{train,test}.parquet`,
`Qwen/Qwen2-7B-Instruct` -> `{model}`. `NATIVE` is the same run written by hand in this project's keys (not
generated from the table in infra/verl_keys.py), with `rl.total_steps` for 7473 training rows (GSM8K's train split:
15 epochs x (7473 // 1024) = 105 steps).
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

PROJECT = Path(__file__).resolve().parents[1]
SAMPLES = PROJECT / "data" / "samples"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'  # verl's gsm8k.py

TUTORIAL = """
    algorithm.adv_estimator=grpo
    data.train_files={data}/train.parquet
    data.val_files={data}/test.parquet
    data.train_batch_size=1024
    data.max_prompt_length=512
    data.max_response_length=1024
    data.filter_overlong_prompts=True
    data.truncation=error
    actor_rollout_ref.model.path={model}
    actor_rollout_ref.actor.optim.lr=1e-6
    actor_rollout_ref.model.use_remove_padding=True
    actor_rollout_ref.actor.ppo_mini_batch_size=256
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=40
    actor_rollout_ref.actor.use_kl_loss=True
    actor_rollout_ref.actor.kl_loss_coef=0.001
    actor_rollout_ref.actor.kl_loss_type=low_var_kl
    actor_rollout_ref.actor.entropy_coeff=0
    actor_rollout_ref.model.enable_gradient_checkpointing=True
    actor_rollout_ref.actor.fsdp_config.param_offload=False
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=40
    actor_rollout_ref.rollout.tensor_model_parallel_size=2
    actor_rollout_ref.rollout.name=vllm
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6
    actor_rollout_ref.rollout.n=5
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=40
    actor_rollout_ref.ref.fsdp_config.param_offload=True
    algorithm.use_kl_in_reward=False
    trainer.critic_warmup=0
    trainer.logger=["console","wandb"]
    trainer.project_name=verl_grpo_example_gsm8k
    trainer.experiment_name=qwen2_7b_function_rm
    trainer.n_gpus_per_node=8
    trainer.nnodes=1
    trainer.save_freq=20
    trainer.test_freq=5
    trainer.total_epochs=15
"""

NATIVE = """
    rl.enabled=true sft.enabled=false
    rl.algorithm.adv_estimator=grpo
    data.source=file data.path={data}
    rl.train_batch_size=1024
    data.max_prompt_length=512 data.max_response_length=1024 data.filter_overlong_prompts=true data.truncation=error
    model.path={model}
    rl.actor.optim.lr=1.0e-6
    rl.actor.use_remove_padding=true
    rl.actor.ppo_mini_batch_size=256
    rl.actor.micro_batch_size=40
    rl.actor.use_kl_loss=true rl.actor.kl_loss_coef=0.001 rl.actor.kl_loss_type=low_var_kl rl.actor.entropy_coeff=0
    rl.actor.gradient_checkpointing=true
    rl.rollout.tensor_model_parallel_size=2 rl.rollout.engine=vllm rl.rollout.gpu_memory_utilization=0.6 rl.rollout.n=5
    rl.algorithm.use_kl_in_reward=false
    rl.critic.warmup_steps_before_actor=0
    tracking.backends=[console,wandb] tracking.project=verl_grpo_example_gsm8k run.name=qwen2_7b_function_rm
    ray.num_devices_per_node=8 ray.num_nodes=1
    rl.save_freq=20 rl.test_freq=5
    rl.total_steps=105
"""


def tutorial(data: Path, model: Path | str) -> list[str]:
    return TUTORIAL.format(data=data, model=model).split()


def native(data: Path, model: Path | str) -> list[str]:
    return NATIVE.format(data=data, model=model).split()


def write_gsm8k_parquet(folder: Path) -> Path:
    """data/samples' GSM8K rows as verl's examples/data_preprocess/gsm8k.py writes them: train.parquet, test.parquet."""
    folder.mkdir(parents=True, exist_ok=True)
    for split, name in (("train", "gsm8k_sample.jsonl"), ("test", "gsm8k_test_sample.jsonl")):
        rows = [json.loads(line) for line in (SAMPLES / name).read_text().splitlines() if line.strip()]
        pq.write_table(pa.Table.from_pylist([_verl_row(r, split, i) for i, r in enumerate(rows)]),
                       folder / f"{split}.parquet")
    return folder


def _verl_row(row: dict, split: str, index: int) -> dict:
    solution = row["answer"].rsplit("#### ", 1)[1].replace(",", "").strip()
    return {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": f"{row['question']} {INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": solution},
        "extra_info": {"split": split, "index": index, "answer": row["answer"], "question": row["question"]},
    }
