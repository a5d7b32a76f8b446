"""verl's command-line keys (`--verl`, infra/verl_overrides.py, the table in infra/verl_keys.py).

Over the whole table: every mapped key with a sample value reaches its field with the expected value (the sample
differs from what the field held before, so a mapping that sets nothing fails); every key accepted only as-is is
accepted with that value and refused with another, naming the key and the reason; keys with no setting change
nothing; refused keys name the key and the reason; a misspelt key names the nearest key. verl's GSM8K GRPO
tutorial (tests/verl_gsm8k.py) with only paths swapped resolves to the same config as the same run written in our
keys. Everything here runs `load_config` only.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from flows.post_train import parse_args
from infra.config import ConfigError, load_config
from infra.verl_keys import ROWS, TABLE
from infra.verl_overrides import (
    IMPLIED,
    VerlKeyError,
    markdown_table,
    parse_value,
    pending,
    resolve_after_data_prep,
    translate,
)
from tests.verl_gsm8k import native, tutorial, write_gsm8k_parquet

A, R, M = "actor_rollout_ref.actor.", "actor_rollout_ref.rollout.", "actor_rollout_ref.model."
PROJECT = Path(__file__).resolve().parents[2]
BASE = load_config(None, IMPLIED)  # what a verl command line starts from without a recipe

# Rows that set one field to the value as given: key -> a sample value (differs from BASE's).
SAME = {
    "data.train_batch_size": "64", "data.max_prompt_length": "256", "data.max_response_length": "512",
    "data.filter_overlong_prompts": "False", M + "path": "/models/qwen", M + "trust_remote_code": "True",
    M + "enable_gradient_checkpointing": "True", M + "use_remove_padding": "True", A + "use_remove_padding": "False",
    A + "ppo_mini_batch_size": "8", A + "ppo_micro_batch_size_per_gpu": "4", A + "use_dynamic_bsz": "True",
    A + "ppo_max_token_len_per_gpu": "16384", A + "ppo_epochs": "2", A + "clip_ratio_c": "10.0",
    A + "loss_agg_mode": "seq-mean-token-sum-norm", A + "entropy_coeff": "0.01", A + "use_kl_loss": "True",
    A + "kl_loss_coef": "0.05", A + "grad_clip": "0.5", A + "optim.clip_grad": "2.0", A + "optim.lr": "1e-6",
    A + "optim.weight_decay": "0.01", A + "optim.betas": "[0.9,0.99]", A + "optim.lr_scheduler_type": "cosine",
    A + "optim.warmup_style": "cosine", A + "optim.min_lr_ratio": "0.1", A + "use_torch_compile": "False",
    A + "fsdp_config.reshard_after_forward": "True", R + "n": "5", R + "temperature": "0.7", R + "top_p": "0.9",
    R + "top_k": "20", R + "gpu_memory_utilization": "0.6", R + "tensor_model_parallel_size": "2",
    R + "enforce_eager": "False", R + "max_num_seqs": "64", R + "prompt_length": "1024", R + "response_length": "2048",
    R + "val_kwargs.n": "4", R + "val_kwargs.top_p": "0.95", R + "multi_turn.tool_config_path": "tools.yaml",
    R + "multi_turn.interaction_config_path": "users.yaml", R + "multi_turn.max_parallel_calls": "2",
    R + "multi_turn.max_tool_response_length": "512", R + "multi_turn.tool_response_truncate_side": "left",
    R + "multi_turn.format": "qwen", "critic.optim.lr": "2e-5", "critic.optim.weight_decay": "0.01",
    "critic.optim.betas": "[0.9,0.95]", "critic.optim.lr_scheduler_type": "cosine", "critic.grad_clip": "0.5",
    "critic.optim.clip_grad": "3.0", "critic.ppo_micro_batch_size_per_gpu": "8", "critic.ppo_epochs": "2",
    "critic.use_dynamic_bsz": "True", "critic.ppo_max_token_len_per_gpu": "32768", "critic.cliprange_value": "0.2",
    "custom_reward_function.path": "my_reward.py", "custom_reward_function.name": "score",
    "reward_model.micro_batch_size_per_gpu": "4", "reward_model.overlong_buffer.penalty_factor": "0.5",
    "algorithm.use_kl_in_reward": "True", "algorithm.kl_ctrl.type": "adaptive", "algorithm.kl_ctrl.kl_coef": "0.01",
    "algorithm.kl_ctrl.horizon": "500", "algorithm.kl_ctrl.target_kl": "0.05", "algorithm.filter_groups.enable": "True",
    "algorithm.filter_groups.metric": "seq_reward", "algorithm.filter_groups.max_num_gen_batches": "0",
    A + "fsdp_config.optimizer_offload": "True", A + "fsdp_config.offload_policy": "True",
    "critic.model.fsdp_config.optimizer_offload": "True", "critic.model.fsdp_config.offload_policy": "True",
    R + "free_cache_engine": "True", R + "quantization": "fp8", A + "ulysses_sequence_parallel_size": "2",
    "trainer.project_name": "verl_examples", "trainer.n_gpus_per_node": "2", "trainer.nnodes": "2",
    "ray_kwargs.ray_init.num_cpus": "8", "trainer.val_before_train": "False", "trainer.max_actor_ckpt_to_keep": "5",
}

RC = "algorithm.rollout_correction."
SAME |= {RC + "rollout_is": "token", RC + "rollout_is_threshold": "5.0", RC + "rollout_is_batch_normalize": "True",
         RC + "rollout_rs": "token_k1", RC + "rollout_rs_threshold": "0.5_2.0", RC + "bypass_mode": "True",
         RC + "loss_type": "reinforce"}

CONTEXT = {R + "tensor_model_parallel_size": ["trainer.n_gpus_per_node=2"],  # what a sample needs to validate
           A + "ulysses_sequence_parallel_size": ["trainer.n_gpus_per_node=2"],
           RC + "rollout_is_batch_normalize": [RC + "rollout_is=token"],
           RC + "rollout_rs": [RC + "rollout_rs_threshold=2.0"],
           RC + "rollout_rs_threshold": [RC + "rollout_rs=token_k1"],
           RC + "loss_type": [RC + "bypass_mode=True", A + "policy_loss.loss_mode=gpg"]}

OUR_CONTEXT = {R + "quantization": ["rl.rollout.engine=cuda"]}  # our settings a sample needs

ASYNC = ["rollout.n_gpus_per_node=1"]  # rollout devices of their own: what verl's asynchronous recipes need

# Rows that convert: key -> (the verl overrides, what they must set). Hand-worked values in the comments.
VIA = {
    "data.train_files": (["data.train_files={data}/train.parquet", "data.val_files={data}/test.parquet"],
                         {"data.source": "file", "data.path": "{data}"}),
    "data.val_files": (["data.train_files={data}/train.parquet", "data.val_files={data}/test.parquet"],
                       {"data.source": "file", "data.path": "{data}"}),
    "data.truncation": (["data.truncation=left"], {"data.truncation": "left"}),
    "data.train_max_samples": (["data.train_max_samples=100"], {"data.max_train_samples": 100}),
    "data.val_max_samples": (["data.val_max_samples=50"], {"data.max_validation_samples": 50}),
    "data.seed": (["data.seed=7"], {"run.seed": 7}),
    M + "lora_rank": ([M + "lora_rank=32"], {"model.lora.rank": 32}),
    M + "lora_alpha": ([M + "lora_rank=8", M + "lora_alpha=32"], {"model.lora.alpha": 32}),
    M + "target_modules": ([M + "lora_rank=8", M + "target_modules=[q_proj,v_proj]"],
                           {"model.lora.target_modules": ["q_proj", "v_proj"]}),
    # global 8 over 2 GPUs x 1 node = 4 per device
    A + "ppo_micro_batch_size": (["trainer.n_gpus_per_node=2", A + "ppo_micro_batch_size=8"],
                                 {"rl.actor.micro_batch_size": 4}),
    # verl: clip_ratio fills only the side given as null
    A + "clip_ratio": ([A + "clip_ratio=0.3", A + "clip_ratio_low=null"],
                       {"rl.actor.clip_ratio_low": 0.3, "rl.actor.clip_ratio_high": 0.2}),
    A + "clip_ratio_low": ([A + "clip_ratio_low=0.1"], {"rl.actor.clip_ratio_low": 0.1}),
    A + "clip_ratio_high": ([A + "clip_ratio_high=0.28"], {"rl.actor.clip_ratio_high": 0.28}),
    A + "kl_loss_type": ([A + "kl_loss_type=k2"], {"rl.actor.kl_loss_type": "k2"}),
    A + "policy_loss.loss_mode": ([A + "policy_loss.loss_mode=gspo"],
                                  {"rl.actor.policy_loss": "gspo", "rl.actor.loss_agg_mode": "seq-mean-token-mean"}),
    A + "policy_loss.clip_cov_ratio": ([A + "policy_loss.loss_mode=clip_cov", A + "policy_loss.clip_cov_ratio=0.001"],
                                      {"rl.actor.policy_loss.clip_cov_ratio": 0.001}),
    A + "policy_loss.clip_cov_lb": ([A + "policy_loss.loss_mode=clip_cov", A + "policy_loss.clip_cov_lb=2.0"],
                                   {"rl.actor.policy_loss.clip_cov_lb": 2.0}),
    A + "policy_loss.clip_cov_ub": ([A + "policy_loss.loss_mode=clip_cov", A + "policy_loss.clip_cov_ub=4.0"],
                                   {"rl.actor.policy_loss.clip_cov_ub": 4.0}),
    A + "policy_loss.kl_cov_ratio": ([A + "policy_loss.loss_mode=kl_cov", A + "policy_loss.kl_cov_ratio=0.001"],
                                    {"rl.actor.policy_loss.kl_cov_ratio": 0.001}),
    A + "policy_loss.ppo_kl_coef": ([A + "policy_loss.loss_mode=kl_cov", A + "policy_loss.ppo_kl_coef=0.5"],
                                   {"rl.actor.policy_loss.ppo_kl_coef": 0.5}),
    A + "optim.lr_warmup_steps": ([A + "optim.lr_warmup_steps=5"], {"rl.actor.optim.warmup_steps": 5}),
    # int(0.05 x 200) = 10
    A + "optim.lr_warmup_steps_ratio": (["trainer.total_training_steps=200", A + "optim.lr_warmup_steps_ratio=0.05"],
                                        {"rl.actor.optim.warmup_steps": 10}),
    R + "name": ([R + "name=hf"], {"rl.rollout.engine": "hf"}),
    R + "val_kwargs.temperature": ([R + "val_kwargs.temperature=0.6"], {"rl.rollout.val_temperature": 0.6}),
    # verl samples greedily without do_sample, whatever the temperature (here: the recipe's 0.6)
    R + "val_kwargs.do_sample": ([R + "val_kwargs.do_sample=False"], {"rl.rollout.val_temperature": 0.0},
                                 "rl: {rollout: {val_temperature: 0.6}}"),
    R + "multi_turn.max_assistant_turns": ([R + "multi_turn.max_assistant_turns=6"],
                                           {"rl.multi_turn.max_assistant_turns": 6}),
    R + "multi_turn.max_user_turns": ([R + "multi_turn.max_user_turns=2"], {"rl.multi_turn.max_user_turns": 2}),
    "critic.optim.lr_warmup_steps": (["critic.optim.lr_warmup_steps=3"], {"rl.critic.optim.warmup_steps": 3}),
    # int(0.1 x 100) = 10
    "critic.optim.lr_warmup_steps_ratio": (
        ["trainer.total_training_steps=100", "critic.optim.lr_warmup_steps_ratio=0.1"],
        {"rl.critic.optim.warmup_steps": 10}),
    # verl's actor first trains at step 3: steps 1 and 2 are critic-only
    "trainer.critic_warmup": (["trainer.critic_warmup=3"], {"rl.critic.warmup_steps_before_actor": 2}),
    "reward_model.enable": (["reward_model.enable=True", "reward_model.model.path=/models/rm"],
                            {"rl.reward.reward_model_path": "/models/rm"}),
    "reward_model.model.path": (["reward_model.enable=True", "reward_model.model.path=/models/rm"],
                                {"rl.reward.reward_model_path": "/models/rm"}),
    "reward_model.overlong_buffer.enable": (
        ["reward_model.overlong_buffer.enable=True", "reward_model.overlong_buffer.len=48"],
        {"rl.reward.overlong_buffer": 48}),
    "reward_model.overlong_buffer.len": (["reward_model.overlong_buffer.enable=True",
                                          "reward_model.overlong_buffer.len=64"], {"rl.reward.overlong_buffer": 64}),
    "algorithm.adv_estimator": (["algorithm.adv_estimator=rloo_vectorized"], {"rl.algorithm.adv_estimator": "rloo"}),
    "algorithm.gamma": (["algorithm.adv_estimator=gae", "algorithm.gamma=0.99"],
                        {"rl.algorithm.adv_estimator.gamma": 0.99}),
    "algorithm.lam": (["algorithm.adv_estimator=gae", "algorithm.lam=0.95"], {"rl.algorithm.adv_estimator.lam": 0.95}),
    "algorithm.norm_adv_by_std_in_grpo": (["algorithm.norm_adv_by_std_in_grpo=False"],
                                          {"rl.algorithm.adv_estimator.norm_adv_by_std_in_grpo": False}),
    "algorithm.kl_penalty": (["algorithm.kl_penalty=low_var_kl"], {"rl.algorithm.kl_penalty": "low_var_kl"}),
    # after data prep counts 100 rows: 3 epochs x (100 // 32) = 9 steps
    "trainer.total_epochs": (["trainer.total_epochs=3"], {"rl.total_steps": 9}),
    "trainer.total_training_steps": (["trainer.total_training_steps=50"], {"rl.total_steps": 50}),
    "trainer.experiment_name": (["trainer.experiment_name=qwen2_7b_function_rm"], {"run.name": "qwen2_7b_function_rm"}),
    "trainer.logger": (["trainer.logger=[console,wandb,file]"], {"tracking.backends": ["console", "wandb", "jsonl"]}),
    "trainer.save_freq": (["trainer.save_freq=-1"], {"rl.save_freq": 0}),  # verl -1: never; here the end only
    "trainer.test_freq": (["trainer.test_freq=7"], {"rl.test_freq": 7}),
    "trainer.resume_mode": (["trainer.resume_mode=disable"], {"rl.resume_mode": "disable"}),
    # verl's asynchronous recipes (a fully async one has async_training.* keys; ppo_mini_batch_size 16 here)
    "rollout.n_gpus_per_node": (["rollout.n_gpus_per_node=2"],
                                {"ray.rollout_devices_per_node": 2, "rl.async_training.mode": "one_step_off"}),
    "rollout.total_epochs": (["rollout.total_epochs=3"], {"rl.total_steps": 9}),  # 3 x (100 // 32)
    # a step: require_batches 2 x 16 prompts = 32; 320 // 32 = 10
    "rollout.total_rollout_steps": (ASYNC + ["async_training.require_batches=2", "rollout.total_rollout_steps=320"],
                                    {"rl.total_steps": 10, "rl.train_batch_size": 32}),
    "rollout.test_freq": (ASYNC + ["async_training.trigger_parameter_sync_step=2", "rollout.test_freq=3"],
                          {"rl.test_freq": 6}),  # every 3 syncs of 2 steps
    "async_training.staleness_threshold": (
        ASYNC + ["async_training.staleness_threshold=2.5"],
        {"rl.async_training.max_staleness": 3, "rl.async_training.mode": "fully_async",
         "ray.rollout_devices_per_node": 1, "rl.train_batch_size": 16}),
    "async_training.trigger_parameter_sync_step": (ASYNC + ["async_training.trigger_parameter_sync_step=2"],
                                                   {"rl.async_training.trigger_parameter_sync_step": 2}),
    "async_training.require_batches": (ASYNC + ["async_training.require_batches=4"], {"rl.train_batch_size": 64}),
    "async_training.partial_rollout": (ASYNC + ["async_training.partial_rollout=False"],
                                       {"rl.async_training.partial_rollout": False}),
    "async_training.use_rollout_log_probs": (ASYNC + ["async_training.use_rollout_log_probs=True"],
                                             {"rl.algorithm.rollout_correction.bypass_mode": True}),
    "async_training.compute_prox_log_prob": (
        ASYNC + ["async_training.use_rollout_log_probs=True", "async_training.compute_prox_log_prob=True"],
        {"rl.algorithm.rollout_correction.bypass_mode": False, "rl.async_training.mode": "fully_async"}),
}

# Rows accepted only when the value is what this project does, where that depends on other keys:
# key -> (accepted overrides, refused overrides, the reason the refusal gives).
CHECKED = {
    "data.gen_batch_size": (["data.gen_batch_size=32"], ["data.gen_batch_size=96"], "each generation round draws"),
    "rollout.nnodes": (["rollout.nnodes=1"], ["rollout.nnodes=2"], "rollout workers run on the trainer's nodes here"),
    "actor_rollout_ref.hybrid_engine": (["rollout.n_gpus_per_node=1", "actor_rollout_ref.hybrid_engine=False"],
                                        ["actor_rollout_ref.hybrid_engine=False"],
                                        "a rollout of its own needs its GPUs"),
    "critic.enable": (["algorithm.adv_estimator=gae", "critic.enable=True"], ["critic.enable=True"],
                      "the critic runs exactly when the estimator is gae here"),
    "critic.model.path": ([M + "path=/m", "critic.model.path=/m"], [M + "path=/m", "critic.model.path=/other"],
                          "the critic starts from the actor's model here"),
    "critic.ppo_mini_batch_size": (["critic.ppo_mini_batch_size=16"], ["critic.ppo_mini_batch_size=8"],
                                   "the critic trains on the actor's mini-batches here"),
    "trainer.max_critic_ckpt_to_keep": (["trainer.max_critic_ckpt_to_keep=2"], ["trainer.max_critic_ckpt_to_keep=3"],
                                        "actor and critic are saved in one checkpoint here"),
}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_gsm8k_parquet(tmp_path_factory.mktemp("verl-gsm8k"))


def run(verl: list[str], recipe: Path | None = None, rows: int = 100, ours: list[str] = ()):
    """The config a verl command line (after our overrides `ours`) resolves to (after data prep counted `rows`
    training rows)."""
    cfg = load_config(recipe, translate(recipe, list(ours), verl).overrides)
    return resolve_after_data_prep(cfg, rows)[0]


def value_at(cfg, key: str):
    node = cfg.model_dump(mode="json")
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return "<absent>"
        node = node[part]
    return node["name"] if isinstance(node, dict) and "name" in node and not key.endswith(".name") else node


def without_record(cfg) -> dict:
    dump = cfg.model_dump(mode="json")
    dump["run"].pop("source_overrides")
    return dump


def test_every_row_of_the_table_is_tested():
    kinds = {kind: {r.key for r in ROWS if r.kind == kind} for kind in ("same", "via", "only")}
    assert kinds["same"] == set(SAME)
    assert kinds["via"] == set(VIA)
    assert set(CHECKED) <= kinds["only"] and all(TABLE[k].allowed for k in kinds["only"] - set(CHECKED))
    assert len(TABLE) >= 60


@pytest.mark.parametrize("key", sorted(SAME))
def test_a_key_with_our_equivalent_sets_it(key):
    ours, value = TABLE[key].ours, parse_value(SAME[key])
    assert value_at(BASE, ours) != value  # the sample changes the field
    cfg = run([*CONTEXT.get(key, []), f"{key}={SAME[key]}"], ours=OUR_CONTEXT.get(key, []))
    assert value_at(cfg, ours) == value


@pytest.mark.parametrize("key", sorted(VIA))
def test_a_converted_key_sets_the_converted_value(key, data, tmp_path):
    verl, expected, *recipe_text = VIA[key]
    recipe = tmp_path / "recipe.yaml" if recipe_text else None
    if recipe:
        recipe.write_text(recipe_text[0])
    cfg, base = run([arg.format(data=data) for arg in verl], recipe), load_config(recipe, IMPLIED)
    expected = {ours: value.format(data=data) if isinstance(value, str) else value for ours, value in expected.items()}
    assert any(value_at(base, ours) != value for ours, value in expected.items())  # the case changes something
    assert {ours: value_at(cfg, ours) for ours in expected} == expected


def _other(value):
    """A value that is not `value`, in verl's syntax."""
    if isinstance(value, bool):
        return str(not value)
    if value is None or isinstance(value, str):
        return "something_else"
    if isinstance(value, dict):
        return "{a: 1}"
    return str(value + 1)


def _hydra(value) -> str:
    return "null" if value is None else "{}" if value == {} else str(value)


@pytest.mark.parametrize("key", sorted(r.key for r in ROWS if r.kind == "only"))
def test_a_key_accepted_as_is_changes_nothing_and_refuses_other_values(key):
    row = TABLE[key]
    accepted, refused, reason = CHECKED.get(key) or ([f"{key}={_hydra(row.allowed[0])}"],
                                                     [f"{key}={_other(row.allowed[0])}"], row.note.split(": ", 1)[1])
    assert without_record(run(accepted)) == without_record(run(accepted[:-1]))
    with pytest.raises(VerlKeyError) as err:
        translate(None, [], refused)
    [line] = [line for line in str(err.value).splitlines() if key in line]
    assert line.strip().startswith(f"{refused[-1]}: ") and reason in line


@pytest.mark.parametrize("key", sorted(r.key for r in ROWS if r.kind == "no_setting"))
def test_a_key_with_no_setting_changes_nothing_and_says_why(key):
    translation = translate(None, [], [f"{key}=1"])
    assert without_record(load_config(None, translation.overrides)) == without_record(BASE)
    assert any(line.startswith(f"{key}=1 -> nothing to set  # {TABLE[key].note}") for line in translation.lines)


@pytest.mark.parametrize("key", sorted(r.key for r in ROWS if r.kind == "refused"))
def test_a_refused_key_names_itself_and_the_reason(key):
    with pytest.raises(VerlKeyError, match=re.escape(f"{key}=x: refused: {TABLE[key].note}")):
        translate(None, [], [f"{key}=x"])


@pytest.mark.parametrize(("given", "nearest"), [
    (R + "temprature=0.7", R + "temperature"),
    (A + "optim.lr_warmup_ratio=0.1", A + "optim.lr_warmup_steps_ratio"),
    ("actor.optim.lr=1e-6", A + "optim.lr"),  # the end of a key: the key it ends
    ("trainer.total_epoch=3", "trainer.total_epochs"),
])
def test_a_misspelt_key_names_the_nearest(given, nearest):
    with pytest.raises(VerlKeyError, match=re.escape(f"{given}: not a verl key this project maps or refuses") +
                       r".*" + re.escape(f"did you mean {nearest}?")):
        translate(None, [], [given])


def test_one_of_our_keys_after_verl_says_where_it_goes():
    with pytest.raises(VerlKeyError, match=re.escape("rl.total_steps=2: one of this project's keys, not verl's: "
                                                     "give it before --verl")):
        translate(None, [], ["data.train_batch_size=64", "rl.total_steps=2"])


def test_a_verl_key_before_verl_says_to_give_it_after(capsys, tmp_path, monkeypatch):
    """The reverse of the test above, on the command line: not 'unknown key actor_rollout_ref; allowed here: data,
    evaluate, ...', but that it is verl's, and the command line with it after --verl (exit code 2, nothing run)."""
    import shlex
    import sys

    from flows.post_train import main

    monkeypatch.delenv("MAKELEVEL", raising=False)  # `make test`: the command shown is python's, not `make demo`'s
    out = f"run.output_dir={tmp_path / 'out'}"
    assert main(["recipes/demo.yaml", A + "optim.lr=1e-6", out, "--verbose"]) == 2
    err = capsys.readouterr().err
    fixed = shlex.join([sys.orig_argv[0], "-m", "flows.post_train", "recipes/demo.yaml", out, "--verbose", "--verl",
                        A + "optim.lr=1e-6"])
    assert err == (f"error: {A}optim.lr=1e-6: verl's key, not this project's; give verl's overrides after --verl, "
                   f"which maps them onto this project's keys (README 'From verl'):\n  {fixed}\n")
    monkeypatch.setenv("MAKELEVEL", "1")  # under `make demo ARGS=...`: the fixed command is make's
    assert main(["recipes/demo.yaml", A + "optim.lr=1e-6", "--verbose"]) == 2
    assert capsys.readouterr().err.endswith(f"\n  make demo ARGS='--verbose --verl {A}optim.lr=1e-6'\n")
    # Hydra's +key, a key under a section only verl has, one of verl's keys in a section we share; next to --verl
    assert main(["+trainer.total_epochs=2", "critic.nope=1", "data.train_files=x.parquet", "data.max_prompt_length=64",
                 "--verl", R + "n=4"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: +trainer.total_epochs=2, critic.nope=1, data.train_files=x.parquet: verl's keys")
    assert err.endswith(" -m flows.post_train data.max_prompt_length=64 --verl actor_rollout_ref.rollout.n=4 "
                        "+trainer.total_epochs=2 critic.nope=1 data.train_files=x.parquet\n")
    assert not (tmp_path / "out").exists()


def test_every_problem_is_reported_at_once():
    with pytest.raises(VerlKeyError) as err:
        translate(None, [], [R + "name=sglang", "trainer.default_local_dir=/ckpt", "data.nope=1",
                             A + "fsdp_config.param_offload=True", "no_equals_sign"])
    lines = str(err.value).splitlines()[1:]
    assert [line.split("=")[0].split(":")[0].strip() for line in lines] == [
        "no_equals_sign", R + "name", "trainer.default_local_dir", "data.nope", A + "fsdp_config.param_offload"]


@pytest.mark.parametrize(("raw", "value"), [
    ("True", True), ("false", False), ("null", None), ("1e-6", 1e-6), ("-1", -1), ("1_000", 1000), (".5", 0.5),
    ("'error'", "error"), ('"1"', "1"), ('["console","wandb"]', ["console", "wandb"]), ("[console, wandb]",
    ["console", "wandb"]), ("[1e-6, 2]", [1e-6, 2]), ("{a: 1}", {"a": 1}), ("Qwen/Qwen2-7B", "Qwen/Qwen2-7B"), ("", ""),
])
def test_values_are_read_in_hydras_syntax(raw, value):
    parsed = parse_value(raw)
    assert parsed == value and type(parsed) is type(value)


def test_hydra_prefixes_repeats_and_interpolations():
    # '+key' adds a key in Hydra; here every table key exists, so it is the same override. The last value wins.
    translation = translate(None, [], ["+data.train_batch_size=64", "data.train_batch_size=128"])
    assert load_config(None, translation.overrides).rl.train_batch_size == 128
    assert "(given 2 times: the last applies, as in Hydra)" in translation.lines[-1]
    with pytest.raises(VerlKeyError, match=r"interpolations"):
        translate(None, [], ["critic.optim.lr=${actor_rollout_ref.actor.optim.lr}"])


def test_one_field_set_twice_is_an_error():
    with pytest.raises(VerlKeyError, match=rf"{A}use_remove_padding=False sets rl.actor.use_remove_padding=false, but "
                                           rf"{M}use_remove_padding=True sets it to true"):
        translate(None, [], [M + "use_remove_padding=True", A + "use_remove_padding=False"])
    with pytest.raises(VerlKeyError, match=r"n=5 sets rl.rollout.n, and so does the override rl.rollout.n=4"):
        translate(None, ["rl.rollout.n=4"], [R + "n=5"])
    assert run([M + "use_remove_padding=True", A + "use_remove_padding=True"]).rl.actor.use_remove_padding


def test_lora_fields_follow_the_rank_as_in_verl(tmp_path):
    assert run([M + "lora_alpha=32"]).model.lora is None  # lora_rank 0 (verl's default): no LoRA, alpha unread
    recipe = tmp_path / "lora.yaml"
    recipe.write_text("model:\n  lora: {rank: 4}\n")
    on = load_config(recipe, translate(recipe, [], [M + "lora_alpha=32"]).overrides).model.lora
    assert (on.rank, on.alpha) == (4, 32)  # LoRA on in the recipe: verl's alpha applies
    assert load_config(recipe, translate(recipe, [], [M + "lora_rank=0"]).overrides).model.lora is None


def test_gspo_aggregates_as_verls_unless_the_mode_is_given():
    # verl's gspo uses seq-mean-token-mean for its policy term whatever loss_agg_mode says
    assert run([A + "policy_loss.loss_mode=gspo"]).rl.actor.loss_agg_mode == "seq-mean-token-mean"
    given = run([A + "policy_loss.loss_mode=gspo", A + "loss_agg_mode=token-mean"])
    assert given.rl.actor.loss_agg_mode == "token-mean"


def test_the_tutorial_resolves_to_the_native_config(data, tmp_path):
    """verl's examples/grpo_trainer/run_qwen2-7b.sh with its paths swapped. Nothing else changes: load_config checks
    no device, so n_gpus_per_node=8 and tensor_model_parallel_size=2 stay; the model folder is not read here."""
    model = tmp_path / "model"
    translation = translate(None, [], tutorial(data, model))
    cfg = load_config(None, translation.overrides)
    assert pending(cfg) == ["trainer.total_epochs=15"] and cfg.run.source_overrides["trainer.total_epochs=15"] == [
        "rl.total_steps=<after data prep: 15 x (training rows // 1024)>"]
    cfg, lines = resolve_after_data_prep(cfg, 7473)  # GSM8K's train split: 15 x (7473 // 1024) = 105 steps
    assert lines == ["trainer.total_epochs=15 -> rl.total_steps=105  # 7473 training rows"]
    assert without_record(cfg) == without_record(load_config(None, native(data, model)))
    assert set(cfg.run.source_overrides) == set(tutorial(data, model))
    assert cfg.run.source_overrides[R + "n=5"] == ["rl.rollout.n=5"] and pending(cfg) == []
    assert len(translation.lines) == len(tutorial(data, model)) + 1  # one per key, and the implied RL-only line


def test_epochs_need_a_full_batch_and_yield_to_total_training_steps(data):
    cfg = load_config(None, translate(None, [], ["trainer.total_epochs=2", "data.train_batch_size=64"]).overrides)
    with pytest.raises(ConfigError, match=r"21 training rows make no full batch of data.train_batch_size=64"):
        resolve_after_data_prep(cfg, 21)
    cfg = run(["trainer.total_epochs=2", "trainer.total_training_steps=7"])
    assert cfg.rl.total_steps == 7 and cfg.run.source_overrides["trainer.total_epochs=2"] == []
    # a warmup ratio of a step count that waits for the rows waits too: 2 x (100 // 32) = 6 steps, int(0.5 x 6) = 3
    cfg = run(["trainer.total_epochs=2", A + "optim.lr_warmup_steps_ratio=0.5"], rows=100)
    assert (cfg.rl.total_steps, cfg.rl.actor.optim.warmup_steps) == (6, 3)
    assert cfg.run.source_overrides[A + "optim.lr_warmup_steps_ratio=0.5"] == ["rl.actor.optim.warmup_steps=3"]


def test_data_files_must_be_one_folder_split_by_names(tmp_path, data):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "train.parquet").write_bytes((data / "train.parquet").read_bytes())
    (tmp_path / "a" / "heldout.parquet").write_bytes((data / "test.parquet").read_bytes())
    with pytest.raises(VerlKeyError, match=r"validation files are found by name .* would be \[\], not "
                                           r"\['heldout.parquet'\]; rename the files"):
        translate(None, [], [f"data.train_files={tmp_path}/a/train.parquet",
                             f"data.val_files={tmp_path}/a/heldout.parquet"])
    (tmp_path / "a" / "heldout.parquet").rename(tmp_path / "a" / "test.parquet")
    (tmp_path / "a" / "more.jsonl").write_text("")
    with pytest.raises(VerlKeyError, match=r"also holds .*more.jsonl; put the train and val files in a folder"):
        translate(None, [], [f"data.train_files={tmp_path}/a/train.parquet",
                             f"data.val_files={tmp_path}/a/test.parquet"])
    assert run([f"data.train_files={data}/train.parquet"]).data.path == f"{data}/train.parquet"


def test_data_files_in_two_folders_say_so(tmp_path, data):
    """Not 'also holds ...' about their common folder: that they are in two folders, and the fix."""
    for folder, name in (("a", "train"), ("b", "test")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / f"{name}.parquet").write_bytes((data / f"{name}.parquet").read_bytes())
    (tmp_path / "other.jsonl").write_text("")  # what the common folder also holds
    with pytest.raises(VerlKeyError) as info:
        translate(None, [], [f"data.train_files={tmp_path}/a/train.parquet",
                             f"data.val_files={tmp_path}/b/test.parquet"])
    assert str(info.value).splitlines()[1:] == [
        f"  data.train_files={tmp_path}/a/train.parquet: the train and val files are in 2 folders ({tmp_path}/a, "
        f"{tmp_path}/b); here data prep reads one folder (data.path), so put the train and val files together in a "
        "folder of their own and give their paths there"]


def test_a_missing_data_file_is_named_under_its_own_key(tmp_path, data, monkeypatch):
    """Not '... is not a .parquet or .jsonl file', and a missing val file under data.val_files, not train_files."""
    with pytest.raises(VerlKeyError) as info:
        translate(None, [], [f"data.train_files={data}/train.parquet", f"data.val_files={data}/tset.parquet"])
    assert str(info.value).splitlines()[1:] == [
        f"  data.val_files={data}/tset.parquet: {data}/tset.parquet does not exist; give the path of a .parquet or "
        ".jsonl file"]
    monkeypatch.chdir(tmp_path)
    with pytest.raises(VerlKeyError, match=r"data.train_files=gsm8k/train.parquet: gsm8k/train.parquet does not exist "
                                           rf"\(relative to {tmp_path}\); give the path"):
        translate(None, [], ["data.train_files=gsm8k/train.parquet"])
    with pytest.raises(VerlKeyError, match=rf"{data} is a folder; give the .parquet or .jsonl files in it"):
        translate(None, [], [f"data.train_files={data}"])


def test_verl_rows_without_reward_model_say_what_is_missing(tmp_path, data):
    """Not 'data.columns.question='question' is not a column': the reward_model column verl's rows need, and the fix."""
    import pyarrow.parquet as pq

    for name in ("train", "test"):
        table = pq.read_table(data / f"{name}.parquet")
        pq.write_table(table.drop_columns(["reward_model"]), tmp_path / f"{name}.parquet")
    verl = [f"data.train_files={tmp_path}/train.parquet", f"data.val_files={tmp_path}/test.parquet"]
    with pytest.raises(VerlKeyError, match=r"a 'prompt' column \(verl's\) but no 'reward_model' column .*"
                                           r"reward_model = \{'ground_truth': ...\}.* Add that column, or map your "
                                           r"columns .*data.columns.question=prompt data.columns.answer="):
        translate(None, [], verl)
    ours = ["data.columns.question=prompt", "data.columns.answer=data_source"]  # mapped: read as the user's columns
    assert run(verl, ours=ours).data.path == str(tmp_path)


def test_verls_fully_async_recipe_resolves_to_our_fully_async_mode():
    """The asynchronous keys of verl's recipe/fully_async_policy/dapo_7b_math_fsdp2_4_4.sh (its other keys are
    the table's ordinary rows): 4 rollout and 4 trainer GPUs, local updates of one 64-prompt mini-batch, a push every
    32 of them, stale samples up to one sync back, 81,920 prompts over the run."""
    cfg = run(["data.train_batch_size=0", "data.gen_batch_size=1", R + "n=16", A + "ppo_mini_batch_size=64",
               "actor_rollout_ref.hybrid_engine=False", "trainer.nnodes=1", "trainer.n_gpus_per_node=4",
               "rollout.nnodes=1", "rollout.n_gpus_per_node=4", f"rollout.total_rollout_steps={512 * 16 * 10}",
               "rollout.total_epochs=10", "async_training.staleness_threshold=1",
               "async_training.trigger_parameter_sync_step=32", "async_training.partial_rollout=True"], rows=10_000)
    assert (cfg.ray.num_devices_per_node, cfg.ray.rollout_devices_per_node) == (4, 4)
    a = cfg.rl.async_training
    assert (a.mode, a.trigger_parameter_sync_step, a.max_staleness, a.partial_rollout) == ("fully_async", 32, 63, True)
    # a step = one local update of 64 prompts; 81,920 prompts = 1,280 steps, fewer than 10 epochs of 10,000 rows
    # (10 x (10,000 // 64) = 1,560), so total_rollout_steps binds
    assert (cfg.rl.train_batch_size, cfg.rl.actor.ppo_mini_batch_size, cfg.rl.total_steps) == (64, 64, 1280)


FULLY_ASYNC = ASYNC + [A + "ppo_mini_batch_size=64", "async_training.require_batches=1"]  # steps of 64 prompts


@pytest.mark.parametrize(("verl", "steps"), [
    (["rollout.total_rollout_steps=81920", "rollout.total_epochs=10"], 150),  # min(81,920 // 64 = 1,280, 10 x 15)
    (["rollout.total_rollout_steps=81920", "trainer.total_epochs=2"], 30),  # min(1,280, 2 x (1,000 // 64) = 30)
    (["rollout.total_rollout_steps=81920", "rollout.total_epochs=10", "trainer.total_epochs=3"], 45),  # min(., 150, 45)
    (["rollout.total_rollout_steps=640", "rollout.total_epochs=10"], 10),  # min(640 // 64, 150)
    (["rollout.total_rollout_steps=null", "rollout.total_epochs=2"], 30),  # null: no bound from prompts
])
def test_fully_async_generates_no_more_than_the_epochs_allow(verl, steps):
    """verl's rollouter: min(rollout.total_rollout_steps, rows x trainer.total_epochs) prompts, in at most
    rollout.total_epochs passes over the rows (fully_async_rollouter.py); 1,000 training rows here."""
    cfg = run(FULLY_ASYNC + verl, rows=1000)
    assert (cfg.rl.train_batch_size, cfg.rl.total_steps) == (64, steps)
    assert pending(cfg) == []


def test_fully_async_step_bound_waits_for_the_rows_and_null_prompts_set_nothing():
    translation = translate(None, [], FULLY_ASYNC + ["rollout.total_rollout_steps=81920", "rollout.total_epochs=10"])
    assert translation.record["rollout.total_epochs=10"] == [
        "rl.total_steps=<after data prep: min(1280, 10 x (training rows // 64))>"]
    cfg = load_config(None, translate(None, [], FULLY_ASYNC + ["rollout.total_rollout_steps=null"]).overrides)
    assert cfg.rl.total_steps == BASE.rl.total_steps
    assert cfg.run.source_overrides["rollout.total_rollout_steps=null"] == []


@pytest.mark.parametrize(("verl", "bypass"), [
    (["async_training.compute_prox_log_prob=False"], True),  # verl's use_rollout_log_probs defaults to True
    (["async_training.compute_prox_log_prob=True"], False),
    (["async_training.use_rollout_log_probs=False"], False),
    (["async_training.use_rollout_log_probs=True", "async_training.compute_prox_log_prob=False"], True),
])
def test_rollout_logprobs_are_the_old_policy_as_in_verls_recipe(verl, bypass):
    """fully_async_ppo_trainer.yaml: use_rollout_log_probs True, compute_prox_log_prob False; the trainer takes
    rollout_log_probs as old_log_probs exactly when the first is on and the second off (fully_async ray_trainer.py)."""
    assert run(ASYNC + verl).rl.algorithm.rollout_correction.bypass_mode is bypass


def test_native_and_verl_problems_are_reported_at_once():
    """A bad native override does not hide the verl keys' problems: each is a line of one VerlKeyError."""
    recipe = PROJECT / "recipes/demo.yaml"
    with pytest.raises(VerlKeyError) as err:
        translate(recipe, ["rl.rollout.nn=3", "rl.rollout.n=4", "no_equals"], [R + "temprature=0.7", R + "n=5"])
    lines = [line.strip() for line in str(err.value).splitlines()[1:]]
    assert lines[0].startswith("unknown key 'rl.rollout.nn' (value 3)")
    assert lines[1].startswith("override 'no_equals': expected KEY=VALUE")
    assert lines[2].startswith(f"{R}temprature=0.7: not a verl key") and f"did you mean {R}temperature?" in lines[2]
    assert lines[3] == f"{R}n=5 sets rl.rollout.n, and so does the override rl.rollout.n=4: give it once"
    assert len(lines) == 4


@pytest.mark.parametrize("argv", [["--help"], ["-h"], ["recipes/demo.yaml", "rl.total_steps=3", "--help"]])
def test_help_prints_the_usage(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(argv)
    assert exit_.value.code == 0
    assert "Run it:  python -m flows.post_train recipes/demo.yaml [key=value ...]" in capsys.readouterr().out


def test_the_command_line_splits_at_verl():
    argv = ["recipes/demo.yaml", "rl.total_steps=3", "--verl", "data.train_batch_size=8", "--verbose",
            "trainer.nnodes=1"]
    assert parse_args(argv) == ("recipes/demo.yaml", ["rl.total_steps=3", "tracking.console=verbose"],
                                ["data.train_batch_size=8", "trainer.nnodes=1"])
    assert parse_args(["--verl", "trainer.nnodes=1"]) == (None, [], ["trainer.nnodes=1"])


def test_the_readme_table_is_the_table():
    readme = (PROJECT / "README.md").read_text()
    start, end = "<!-- verl-table: python -m infra.verl_overrides -->\n", "\n<!-- verl-table end -->"
    assert readme[readme.index(start) + len(start):readme.index(end)] == markdown_table()


def test_our_own_estimators_are_not_verl_values():
    with pytest.raises(VerlKeyError, match="rl.algorithm.adv_estimator=online_dpo before --verl"):
        translate(None, [], ["algorithm.adv_estimator=online_dpo"])


def test_epochs_count_the_prompts_rl_trains_on(tmp_path, tiny_model_dir):
    """trainer.total_epochs counted data prep's rows, while RL drops prompts over data.max_prompt_length first (as
    verl's dataloader length does): with most prompts dropped, one epoch ran about four times over the kept ones."""
    from types import SimpleNamespace

    from flows.post_train import counted_rows
    from infra.store import ArtifactStore
    from stages.data_prep import load_prompts, run_data_prep
    from stages.model.loading import load_tokenizer
    from tasks.stages import RunContext

    store_root, run_dir = tmp_path / "store", tmp_path / "run"
    run_dir.mkdir()
    cfg = load_config(None, translate(None, [f"storage.root={store_root}", "data.max_prompt_length=21",
                                             "data.synthetic.num_train=64"],
                                    ["trainer.total_epochs=1", "data.train_batch_size=4",
                                     "actor_rollout_ref.actor.ppo_mini_batch_size=4"]).overrides)
    run_data_prep(cfg.data, 0, tmp_path / "data")
    store = ArtifactStore(str(store_root))
    dataset = str(store.put_dir("dataset", "synthetic", tmp_path / "data"))
    kept = len(load_prompts(tmp_path / "data" / "train.parquet", load_tokenizer(tiny_model_dir), cfg.data).prompt_ids)
    assert 4 <= kept < 64  # synthetic prompts are 20-22 tokens: some over 21, some not

    lines = []
    resolved = counted_rows(cfg, dataset, str(tiny_model_dir), RunContext(run_id="r", run_dir=str(run_dir)),
                            SimpleNamespace(line=lines.append))
    assert resolved.rl.total_steps == kept // 4
    assert lines == [f"verl: trainer.total_epochs=1 -> rl.total_steps={kept // 4}  # {kept} training rows"]


@pytest.mark.parametrize("argv, option", [(["--hlep"], "--hlep"), (["recipes/demo.yaml", "--refresh"], "--refresh"),
                                          (["-v", "sft.epochs=1"], "-v")])
def test_an_unknown_option_is_named(argv, option):
    """A misspelt option was taken for the recipe ("recipe '--hlep' not found") or for an override."""
    with pytest.raises(ConfigError, match=rf"^{option}: not an option of this command; its options are --verl"):
        parse_args(argv)
