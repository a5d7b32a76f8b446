"""verl's `ppo_trainer.yaml` keys and what each becomes here: the one table behind `--verl` and README "From verl".

Each `VerlKey` turns a verl key's value into overrides of our config (`apply(value, given) -> {our key: value}`,
conversions in infra/verl_convert.py, verl_async.py and verl_files.py) or is refused (`apply is None`) with the
reason. Four kinds of rows:

- `same` / `via`: our equivalent, with the value converted where units or conventions differ (the note says how);
- `only`: accepted with the value that is what this project does anyway (`fsdp_config.param_offload=False`), any
  other value refused with the reason;
- `no_setting`: a speed or memory knob of verl's implementation whose counterpart is automatic here, or a setting
  that changes nothing here; the note says what happens instead, and the console prints it;
- `refused`: a feature we lack, with the reason and what to use instead where there is something.

Facts are verl's (volcengine/verl: `verl/trainer/config/_generated_ppo_trainer.yaml`, `ray_trainer.py`, the
workers); rows marked "DAPO recipe" are keys of verl's DAPO recipe config, and the `rollout.*` and
`async_training.*` rows those of its asynchronous recipes (`recipe/one_step_off_policy`, `recipe/fully_async_policy`).
Keys a user does not give keep this project's values (the recipe's, else the defaults of infra/config_sections.py,
infra/trainer_config.py and infra/rl_config.py), not verl's defaults.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from infra import verl_async, verl_files
from infra import verl_convert as c
from infra.verl_convert import Convert, Given


@dataclass(frozen=True)
class VerlKey:
    key: str
    kind: Literal["same", "via", "only", "no_setting", "refused"]
    ours: str  # our key(s) it sets, as the table shows them ('' when none)
    note: str = ""
    apply: Convert | None = field(default=None, compare=False)  # None: refused
    allowed: tuple = ()  # `only`: the values accepted


def same(key: str, ours: str, note: str = "") -> VerlKey:
    return VerlKey(key, "same", ours, note, lambda value, _given: {ours: value})


def via(key: str, ours: str, apply: Convert, note: str) -> VerlKey:
    return VerlKey(key, "via", ours, note, apply)


def refused(key: str, reason: str) -> VerlKey:
    return VerlKey(key, "refused", "", reason)


def no_setting(key: str, note: str) -> VerlKey:
    return VerlKey(key, "no_setting", "", note, lambda _value, _given: {})


def only_if(key: str, apply: Convert, note: str) -> VerlKey:
    """Accepted when `apply` finds the value is what this project does; it raises the reason otherwise."""
    return VerlKey(key, "only", "", note, apply)


def only(key: str, allowed: tuple, reason: str) -> VerlKey:
    """Accepted with one of `allowed` (what this project does anyway), refused with `reason` otherwise."""
    shown = " or ".join("null" if a is None else str(a) for a in allowed)

    def apply(value: Any, _given: Given) -> dict:
        if any(isinstance(value, bool) == isinstance(a, bool) and value == a for a in allowed):
            return {}
        raise ValueError(f"only {shown} runs here: {reason}")

    return VerlKey(key, "only", "", f"only {shown}: {reason}", apply, allowed)


A, R, M = "actor_rollout_ref.actor.", "actor_rollout_ref.rollout.", "actor_rollout_ref.model."
RC = "algorithm.rollout_correction."
NO_PARAM_OFFLOAD = ("parameters are not moved between phases here; fsdp_config.offload_policy (rl.*.offload) keeps "
                    "them in host memory throughout")
PER_DEVICE_PASSES = "no-grad log-prob passes use rl.actor.micro_batch_size (or the token budget); speed/memory only"

ROWS = [
    # ---- data
    via("data.train_files", "data.source=file, data.path", verl_files.files_folder,
        "the folder holding the train and val files and nothing else (validation files are found by name: "
        "test/val/validation/valid/dev/eval, as verl's test.parquet); a lone train file: data.path = that file, "
        "data.validation_fraction held out"),
    via("data.val_files", "data.source=file, data.path", verl_files.val_files, "with data.train_files (one folder)"),
    VerlKey("data.train_batch_size", "same", "rl.train_batch_size", "prompts per step, as verl's (not read by "
            "verl's fully async recipe, nor here with its async_training.* keys)", c.train_batch_size),
    same("data.max_prompt_length", "data.max_prompt_length"),
    same("data.max_response_length", "data.max_response_length"),
    same("data.filter_overlong_prompts", "data.filter_overlong_prompts"),
    via("data.truncation", "data.truncation", c.truncation, "error, left, right; verl's middle is refused"),
    via("data.train_max_samples", "data.max_train_samples", c.max_samples("data.max_train_samples"), "-1: all"),
    via("data.val_max_samples", "data.max_validation_samples", c.max_samples("data.max_validation_samples"),
        "-1: all"),
    via("data.seed", "run.seed", c.seed, "null: no change; run.seed also seeds sampling and initialisation here"),
    only("data.prompt_key", ("prompt",), "verl-schema files keep the chat list in `prompt`; other layouts: "
         "data.columns.question"),
    only("data.reward_fn_key", ("data_source",), "rewards are routed by data_source"),
    only("data.shuffle", (True,), "prompts are drawn in a seeded permutation per epoch"),
    only("data.tokenizer", (None,), "the model's own tokenizer is used"),
    only("data.custom_cls.path", (None,), "a dataset class of your own is not supported: rows come from files "
         "(data.path) or the recipes in data/"),
    only_if("data.gen_batch_size", c.gen_batch_size, "DAPO recipe: only equal to data.train_batch_size; fully async "
            "recipe (1: streaming): groups stream to the trainer as they are scored, from engine calls of "
            "rl.async_training.generation_groups prompts"),
    no_setting("data.val_batch_size", "validation prompts go to the engines in one pass per worker"),
    no_setting("data.dataloader_num_workers", "no data loader processes: prompts are read once, in memory"),
    # ---- model
    same(M + "path", "model.path", "a local folder or hub id"),
    same(M + "trust_remote_code", "model.trust_remote_code"),
    same(M + "enable_gradient_checkpointing", "rl.actor.gradient_checkpointing"),
    same(M + "use_remove_padding", "rl.actor.use_remove_padding", "packed sequences (varlen flash attention on CUDA)"),
    same(A + "use_remove_padding", "rl.actor.use_remove_padding", "as actor_rollout_ref.model.use_remove_padding"),
    via(M + "lora_rank", "model.lora.rank", c.lora_rank, "0: model.lora=null (full fine-tuning)"),
    via(M + "lora_alpha", "model.lora.alpha", c.lora_field("model.lora.alpha"),
        "when LoRA is on (lora_rank > 0, here or in the recipe); no effect otherwise, as in verl"),
    via(M + "target_modules", "model.lora.target_modules", c.lora_field("model.lora.target_modules"),
        "all-linear or a list; when LoRA is on"),
    only(M + "lora_adapter_path", (None,), "LoRA starts from new adapters here"),
    only(M + "use_liger", (False,), "no Liger kernels; the log-prob head is fused by rl.actor.use_torch_compile"),
    only(M + "use_fused_kernels", (False,), "no verl fused kernels; the log-prob head is fused by "
         "rl.actor.use_torch_compile (on with CUDA)"),
    only(M + "enable_activation_offload", (False,), "no activation offload here"),
    only(M + "custom_chat_template", (None,), "the tokenizer's own chat template is used"),
    only(M + "external_lib", (None,), "no external model libraries are imported"),
    only_if("actor_rollout_ref.hybrid_engine", verl_async.hybrid_engine, "True; False with rollout.n_gpus_per_node "
            "(verl's asynchronous recipes: rollout workers of their own)"),
    # ---- actor
    only(A + "strategy", ("fsdp", "fsdp2"), "training is FSDP2 here; Megatron is not supported"),
    same(A + "ppo_mini_batch_size", "rl.actor.ppo_mini_batch_size", "prompts per optimizer step (x rollout.n "
         "samples), as verl's"),
    same(A + "ppo_micro_batch_size_per_gpu", "rl.actor.micro_batch_size", "samples per forward/backward per device"),
    via(A + "ppo_micro_batch_size", "rl.actor.micro_batch_size", c.global_micro_batch,
        "verl's deprecated global form: divided by n_gpus_per_node x nnodes"),
    same(A + "use_dynamic_bsz", "rl.actor.use_dynamic_bsz"),
    same(A + "ppo_max_token_len_per_gpu", "rl.actor.max_token_len_per_device"),
    same(A + "ppo_epochs", "rl.actor.ppo_epochs"),
    only(A + "shuffle", (False,), "mini-batches are consecutive rows of the step's batch"),
    via(A + "clip_ratio", "rl.actor.clip_ratio_low, clip_ratio_high", c.clip_ratio,
        "as in verl, only where clip_ratio_low/high are given as null (both default to 0.2, so clip_ratio alone "
        "changes nothing in verl either); set clip_ratio_low/high"),
    via(A + "clip_ratio_low", "rl.actor.clip_ratio_low", c.clip_side("clip_ratio_low"), "null: clip_ratio"),
    via(A + "clip_ratio_high", "rl.actor.clip_ratio_high", c.clip_side("clip_ratio_high"), "null: clip_ratio"),
    same(A + "clip_ratio_c", "rl.actor.clip_ratio_c"),
    same(A + "loss_agg_mode", "rl.actor.loss_agg_mode"),
    same(A + "entropy_coeff", "rl.actor.entropy_coeff"),
    same(A + "use_kl_loss", "rl.actor.use_kl_loss"),
    same(A + "kl_loss_coef", "rl.actor.kl_loss_coef"),
    via(A + "kl_loss_type", "rl.actor.kl_loss_type", c.kl_name("rl.actor.kl_loss_type"),
        "kl/k1, mse/k2, low_var_kl/k3, abs, '+' forms; verl's full is refused"),
    via(A + "policy_loss.loss_mode", "rl.actor.policy_loss", c.loss_mode,
        "vanilla, gspo, gpg, cispo, clip_cov, kl_cov; verl's sapo, geo_mean are refused; bypass_mode: set "
        "algorithm.rollout_correction.bypass_mode; gspo without loss_agg_mode also sets "
        "rl.actor.loss_agg_mode=seq-mean-token-mean (verl's gspo aggregates so)"),
    via(A + "policy_loss.clip_cov_ratio", "rl.actor.policy_loss.clip_cov_ratio", c.loss_param("clip_cov_ratio"),
        "with clip_cov (verl reads it only there)"),
    via(A + "policy_loss.clip_cov_lb", "rl.actor.policy_loss.clip_cov_lb", c.loss_param("clip_cov_lb"),
        "with clip_cov"),
    via(A + "policy_loss.clip_cov_ub", "rl.actor.policy_loss.clip_cov_ub", c.loss_param("clip_cov_ub"),
        "with clip_cov"),
    via(A + "policy_loss.kl_cov_ratio", "rl.actor.policy_loss.kl_cov_ratio", c.loss_param("kl_cov_ratio"),
        "with kl_cov"),
    via(A + "policy_loss.ppo_kl_coef", "rl.actor.policy_loss.ppo_kl_coef", c.loss_param("ppo_kl_coef"),
        "with kl_cov"),
    only(A + "loss_scale_factor", (None,), "losses are normalised by loss_agg_mode only"),
    same(A + "grad_clip", "rl.actor.optim.grad_clip"),
    same(A + "optim.clip_grad", "rl.actor.optim.grad_clip"),
    same(A + "optim.lr", "rl.actor.optim.lr"),
    same(A + "optim.weight_decay", "rl.actor.optim.weight_decay"),
    same(A + "optim.betas", "rl.actor.optim.betas"),
    via(A + "optim.lr_warmup_steps", "rl.actor.optim.warmup_steps", c.warmup_steps("actor"),
        "-1/null: lr_warmup_steps_ratio decides. verl's first warmup step has lr 0, ours lr/warmup_steps"),
    via(A + "optim.lr_warmup_steps_ratio", "rl.actor.optim.warmup_steps", c.warmup_ratio("actor"),
        "int(ratio x total training steps), as verl; ignored when lr_warmup_steps >= 0"),
    same(A + "optim.lr_scheduler_type", "rl.actor.optim.lr_scheduler", "constant or cosine"),
    same(A + "optim.warmup_style", "rl.actor.optim.lr_scheduler", "verl's older name of lr_scheduler_type"),
    same(A + "optim.min_lr_ratio", "rl.actor.optim.min_lr_ratio"),
    only(A + "optim.num_cycles", (0.5,), "the cosine decays over half a period, once"),
    only(A + "optim.optimizer", ("AdamW",), "the optimizer is AdamW"),
    same(A + "use_torch_compile", "rl.actor.use_torch_compile"),
    same(A + "fsdp_config.reshard_after_forward", "rl.actor.reshard_after_forward"),
    only(A + "fsdp_config.param_offload", (False,), NO_PARAM_OFFLOAD),
    same(A + "fsdp_config.optimizer_offload", "rl.actor.optimizer_offload", "AdamW's moments in host memory between "
         "steps"),
    same(A + "fsdp_config.offload_policy", "rl.actor.offload", "FSDP2's CPU offload: parameters, gradients and "
         "optimizer state in host memory"),
    only(A + "fsdp_config.fsdp_size", (-1,), "every worker shards the model (no hybrid sharding groups)"),
    same(A + "ulysses_sequence_parallel_size", "rl.actor.ulysses_sequence_parallel_size",
         "actor and reference; packed rows only"),
    no_setting(A + "entropy_from_logits_with_chunking", "the log-prob head always works in chunks here "
               "(rl.actor.logprob_chunk_tokens)"),
    no_setting(A + "entropy_checkpointing", "with an entropy bonus the head's chunks are recomputed in backward here"),
    # ---- reference
    no_setting("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", PER_DEVICE_PASSES),
    no_setting("actor_rollout_ref.ref.fsdp_config.param_offload", "not done: the reference stays on the device, "
               "sharded, in model.dtype (with LoRA it is the actor without adapters: no copy); memory only"),
    # ---- rollout
    via(R + "name", "rl.rollout.engine", c.engine, "vllm or hf; sglang and trtllm are refused"),
    same(R + "n", "rl.rollout.n", "samples per prompt"),
    same(R + "temperature", "rl.rollout.temperature"),
    same(R + "top_p", "rl.rollout.top_p"),
    same(R + "top_k", "rl.rollout.top_k", "-1: off"),
    only(R + "do_sample", (True,), "training rollouts are sampled"),
    same(R + "gpu_memory_utilization", "rl.rollout.gpu_memory_utilization"),
    same(R + "tensor_model_parallel_size", "rl.rollout.tensor_model_parallel_size", "vllm and cuda"),
    same(R + "enforce_eager", "rl.rollout.enforce_eager"),
    same(R + "max_num_seqs", "rl.rollout.max_num_seqs"),
    same(R + "free_cache_engine", "rl.rollout.free_cache_engine", "cuda engine; vllm's sleep mode frees its cache on "
         "GPUs anyway"),
    same(R + "quantization", "rl.rollout.quantization", "fp8 with the cuda engine: one scale per output channel (verl: "
         "128x128 blocks)"),
    same(R + "prompt_length", "data.max_prompt_length", "one prompt length for data and rollouts"),
    same(R + "response_length", "data.max_response_length", "one response length for data and rollouts"),
    no_setting(R + "log_prob_micro_batch_size_per_gpu", PER_DEVICE_PASSES),
    no_setting(R + "mode", "verl's ways of driving its engines (sync, async); here the engine runs in-process on "
               "each worker"),
    same(R + "val_kwargs.n", "rl.rollout.val_n"),
    via(R + "val_kwargs.temperature", "rl.rollout.val_temperature", c.val_temperature,
        "ignored with val_kwargs.do_sample=False, as in verl"),
    same(R + "val_kwargs.top_p", "rl.rollout.val_top_p"),
    only(R + "val_kwargs.top_k", (-1,), "validation sampling has no top-k here"),
    via(R + "val_kwargs.do_sample", "rl.rollout.val_temperature", c.val_do_sample, "False: 0 (greedy)"),
    no_setting(R + "multi_turn.enable", "each row names its agent loop (agent_name column); tool_agent runs tools"),
    same(R + "multi_turn.tool_config_path", "rl.multi_turn.tool_config_path"),
    same(R + "multi_turn.interaction_config_path", "rl.multi_turn.interaction_config_path"),
    via(R + "multi_turn.max_assistant_turns", "rl.multi_turn.max_assistant_turns",
        c.turn_limit("rl.multi_turn.max_assistant_turns"), "null (no limit) is refused"),
    via(R + "multi_turn.max_user_turns", "rl.multi_turn.max_user_turns", c.turn_limit("rl.multi_turn.max_user_turns"),
        "null (no limit) is refused"),
    same(R + "multi_turn.max_parallel_calls", "rl.multi_turn.max_parallel_calls"),
    same(R + "multi_turn.max_tool_response_length", "rl.multi_turn.max_tool_response_length"),
    same(R + "multi_turn.tool_response_truncate_side", "rl.multi_turn.tool_response_truncate_side"),
    same(R + "multi_turn.format", "rl.multi_turn.format"),
    only(R + "agent.agent_loop_config_path", (None,), "a row names its own loop: agent_name = path/file.py:Class"),
    # ---- critic
    only_if("critic.enable", c.critic_enable, "the critic runs exactly with adv_estimator=gae"),
    only_if("critic.model.path", c.equal_to("actor_rollout_ref.model.path", c.model_path,
                                            "the critic starts from the actor's model here"),
            "only the actor's model: the critic starts from it here"),
    same("critic.optim.lr", "rl.critic.optim.lr"),
    same("critic.optim.weight_decay", "rl.critic.optim.weight_decay"),
    same("critic.optim.betas", "rl.critic.optim.betas"),
    via("critic.optim.lr_warmup_steps", "rl.critic.optim.warmup_steps", c.warmup_steps("critic"),
        "as the actor's"),
    via("critic.optim.lr_warmup_steps_ratio", "rl.critic.optim.warmup_steps", c.warmup_ratio("critic"),
        "as the actor's"),
    same("critic.optim.lr_scheduler_type", "rl.critic.optim.lr_scheduler"),
    same("critic.grad_clip", "rl.critic.optim.grad_clip"),
    same("critic.optim.clip_grad", "rl.critic.optim.grad_clip"),
    same("critic.ppo_micro_batch_size_per_gpu", "rl.critic.micro_batch_size"),
    only_if("critic.ppo_mini_batch_size", c.equal_to("the actor's ppo_mini_batch_size", c.mini_batch,
                                                     "the critic trains on the actor's mini-batches here"),
            "only the actor's (verl's default): the critic trains on the actor's mini-batches here"),
    same("critic.ppo_epochs", "rl.critic.ppo_epochs"),
    same("critic.use_dynamic_bsz", "rl.critic.use_dynamic_bsz"),
    same("critic.ppo_max_token_len_per_gpu", "rl.critic.max_token_len_per_device"),
    same("critic.cliprange_value", "rl.critic.cliprange_value"),
    no_setting("critic.forward_micro_batch_size_per_gpu", "value passes use rl.critic.micro_batch_size"),
    no_setting("critic.model.use_remove_padding", "the critic's rows are padded here; speed only"),
    only("critic.model.enable_gradient_checkpointing", (False,), "the critic does not recompute activations here"),
    only("critic.model.lora_rank", (0,), "the critic trains all its parameters here"),
    only("critic.model.fsdp_config.param_offload", (False,), NO_PARAM_OFFLOAD),
    same("critic.model.fsdp_config.offload_policy", "rl.critic.offload"),
    same("critic.model.fsdp_config.optimizer_offload", "rl.critic.optimizer_offload"),
    via("trainer.critic_warmup", "rl.critic.warmup_steps_before_actor", c.critic_warmup,
        "k - 1: verl's actor first trains at step k (steps count from 1), ours after this many critic-only steps"),
    # ---- reward
    same("custom_reward_function.path", "rl.reward.custom_path"),
    same("custom_reward_function.name", "rl.reward.custom_function"),
    only("custom_reward_function.reward_kwargs", ({},), "the reward function gets no extra keyword arguments"),
    via("reward_model.enable", "rl.reward.reward_model_path", c.reward_model,
        "True: reward_model.model.path. Unlike verl, whose RM score replaces the rule score, here the score is "
        "rule + rl.reward.reward_model_weight x RM"),
    via("reward_model.model.path", "rl.reward.reward_model_path", c.reward_model_path,
        "with reward_model.enable=True, as in verl"),
    same("reward_model.micro_batch_size_per_gpu", "rl.reward.reward_model_batch_size"),
    only("reward_model.reward_manager", ("naive", "dapo"), "other reward managers are not implemented; dapo's "
         "overlong penalty is reward_model.overlong_buffer.*"),
    via("reward_model.overlong_buffer.enable", "rl.reward.overlong_buffer", c.overlong_enable,
        "DAPO recipe; True: .len, False: 0 (off)"),
    via("reward_model.overlong_buffer.len", "rl.reward.overlong_buffer", c.overlong_len, "DAPO recipe; with .enable"),
    same("reward_model.overlong_buffer.penalty_factor", "rl.reward.overlong_penalty_factor", "DAPO recipe"),
    only("reward_model.sandbox_fusion.url", (None,), "code runs in the local sandboxed python tool, not a remote "
         "judge"),
    no_setting("reward_model.launch_reward_fn_async", "scoring runs in a process pool (rl.reward.num_workers) here"),
    # ---- algorithm
    via("algorithm.adv_estimator", "rl.algorithm.adv_estimator", c.adv_estimator,
        "same names; grpo_vectorized/rloo_vectorized: grpo/rloo; verl's optimal-token baselines are refused"),
    via("algorithm.gamma", "rl.algorithm.adv_estimator.gamma", c.estimator_param("gamma"),
        "with estimators that have it (gae, reinforce_plus_plus), as verl reads it"),
    via("algorithm.lam", "rl.algorithm.adv_estimator.lam", c.estimator_param("lam"), "with gae"),
    via("algorithm.norm_adv_by_std_in_grpo", "rl.algorithm.adv_estimator.norm_adv_by_std_in_grpo",
        c.estimator_param("norm_adv_by_std_in_grpo"), "with grpo, grpo_passk"),
    same("algorithm.use_kl_in_reward", "rl.algorithm.use_kl_in_reward"),
    via("algorithm.kl_penalty", "rl.algorithm.kl_penalty", c.kl_name("rl.algorithm.kl_penalty"),
        "as kl_loss_type"),
    same("algorithm.kl_ctrl.type", "rl.algorithm.kl_ctrl_type"),
    same("algorithm.kl_ctrl.kl_coef", "rl.algorithm.kl_coef"),
    same("algorithm.kl_ctrl.horizon", "rl.algorithm.kl_horizon"),
    same("algorithm.kl_ctrl.target_kl", "rl.algorithm.target_kl"),
    only("algorithm.use_pf_ppo", (False,), "no preference-feedback reweighting (PF-PPO)"),
    *(same(RC + key, "rl." + RC + key, note) for key, note in (
        ("rollout_is", "token or sequence (TIS); null: no weights"),
        ("rollout_is_threshold", ""),
        ("rollout_is_batch_normalize", ""),
        ("rollout_rs", "comma-separated criteria, e.g. token_k1 (IcePop), seq_mean_k1, seq_max_k3"),
        ("rollout_rs_threshold", "k1 bounds 'lower_upper' apply to the ratio as verl's documentation says (verl's "
         "code inverts asymmetric ones; symmetric ones agree)"),
        ("bypass_mode", "no old-logprob pass; the policy loss stays rl.actor.policy_loss (verl switches to its "
         "bypass_mode loss: vanilla or reinforce)"),
        ("loss_type", "with bypass_mode; reinforce needs rl.actor.policy_loss=gpg (verl's REINFORCE loss)"),
    )),
    same("algorithm.filter_groups.enable", "rl.algorithm.filter_groups", "DAPO recipe"),
    same("algorithm.filter_groups.metric", "rl.algorithm.filter_groups_metric", "DAPO recipe"),
    same("algorithm.filter_groups.max_num_gen_batches", "rl.algorithm.max_num_gen_batches", "DAPO recipe; 0: no limit"),
    # ---- verl's asynchronous recipes (one_step_off_policy, fully_async_policy): rollout GPUs of their own
    via("rollout.n_gpus_per_node", "ray.rollout_devices_per_node, rl.async_training.mode", verl_async.rollout_gpus,
        "rollout devices per node beside trainer.n_gpus_per_node; mode fully_async with async_training.* keys, else "
        "one_step_off"),
    only_if("rollout.nnodes", c.equal_to("trainer.nnodes", lambda g: g.get("trainer.nnodes", g.base.ray.num_nodes),
                                         "rollout workers run on the trainer's nodes here (ray.num_nodes)"),
            "only equal to trainer.nnodes"),
    via("rollout.total_rollout_steps", "rl.total_steps", verl_async.total_rollout_steps,
        "fully async: prompts over the run // a step's prompts (require_batches x ppo_mini_batch_size); as in verl "
        "no more than rollout.total_epochs and trainer.total_epochs allow (the fewest steps); null: no bound"),
    via("rollout.total_epochs", "rl.total_steps", verl_async.rollout_total_epochs,
        "as trainer.total_epochs (after data prep), a bound beside total_rollout_steps; total_training_steps wins"),
    via("rollout.test_freq", "rl.test_freq", verl_async.rollout_test_freq,
        "validation every N weight syncs: N x trigger_parameter_sync_step steps"),
    via("async_training.staleness_threshold", "rl.async_training.max_staleness", verl_async.staleness,
        "verl bounds the stale samples per sync window, so a sample lags at most ceil(threshold) syncs; here the "
        "bound is in trainer steps: T - 1 + ceil(threshold) x T with a push every T steps (0 stays synchronous)"),
    via("async_training.trigger_parameter_sync_step", "rl.async_training.trigger_parameter_sync_step",
        verl_async.async_setting("rl.async_training.trigger_parameter_sync_step"),
        "steps between weight pushes; a step here is one of verl's local updates"),
    via("async_training.require_batches", "rl.train_batch_size", verl_async.async_setting(""),
        "a step takes require_batches x ppo_mini_batch_size prompts (verl's local update)"),
    via("async_training.partial_rollout", "rl.async_training.partial_rollout",
        verl_async.async_setting("rl.async_training.partial_rollout"),
        "generation in flight pauses at a push and goes on"),
    via("async_training.use_rollout_log_probs", "rl.algorithm.rollout_correction.bypass_mode",
        verl_async.rollout_bypass,
        "the rollout's logprobs as the old policy (bypass), unless compute_prox_log_prob; True when not given, as in "
        "verl's recipe"),
    via("async_training.compute_prox_log_prob", "rl.algorithm.rollout_correction.bypass_mode",
        verl_async.rollout_bypass,
        "True: the trainer recomputes the old policy's logprobs (no bypass; rollout_correction weights them); "
        "False: bypass unless use_rollout_log_probs=False"),
    *(no_setting("async_training.checkpoint_engine." + key, "weights reach the rollout workers as one NCCL broadcast "
                 "per tensor, loaded as they arrive (stages/workers/weight_transfer.py); nothing to tune")
      for key in ("enable", "device_buffer_size_M", "overlap_broadcast_and_consume", "bypass_cpu")),
    # ---- trainer
    via("trainer.total_epochs", "rl.total_steps", verl_async.trainer_total_epochs,
        "epochs x (training rows // data.train_batch_size), set after data prep counts the rows that RL trains on "
        "(prompts over data.max_prompt_length left out, as verl's filtered dataloader; verl drops a last partial "
        "batch too); ignored when total_training_steps is given, as in verl; fully async: a bound beside "
        "rollout.total_rollout_steps"),
    via("trainer.total_training_steps", "rl.total_steps", c.total_training_steps, "null: total_epochs decides"),
    same("trainer.project_name", "tracking.project"),
    via("trainer.experiment_name", "run.name", c.run_name, "letters, digits, . _ - only"),
    via("trainer.logger", "tracking.backends", c.loggers, "console, wandb, file (our jsonl); others are refused"),
    same("trainer.n_gpus_per_node", "ray.num_devices_per_node", "workers per node (CPU slots on a CPU machine)"),
    same("trainer.nnodes", "ray.num_nodes"),
    same("ray_kwargs.ray_init.num_cpus", "ray.num_cpus"),
    via("trainer.save_freq", "rl.save_freq", c.freq("rl.save_freq"),
        "-1: 0; the last step is always saved here (RL's output is its final checkpoint)"),
    via("trainer.test_freq", "rl.test_freq", c.freq("rl.test_freq"),
        "-1: 0; here validation also runs at the last step (verl: not with -1)"),
    via("trainer.resume_mode", "rl.resume_mode", c.resume_mode, "auto, disable; resume_path is refused"),
    only("trainer.resume_from_path", (None,), "a run resumes from the newest checkpoint of its configuration"),
    same("trainer.val_before_train", "rl.val_before_train"),
    only("trainer.val_only", (False,), "to evaluate a model alone: rl.enabled=false (the flow evaluates base and SFT)"),
    same("trainer.max_actor_ckpt_to_keep", "rl.max_ckpt_to_keep", "null (keep all) is refused: give a number"),
    only_if("trainer.max_critic_ckpt_to_keep", c.equal_to("trainer.max_actor_ckpt_to_keep", c.ckpt_to_keep,
                                                          "actor and critic are saved in one checkpoint here"),
            "only the actor's: actor and critic are saved in one checkpoint here"),
    refused("trainer.default_local_dir", "checkpoints are artifacts in the store (storage.root): "
            "python -m infra.store versions checkpoint/rl-<key>"),
    only("trainer.default_hdfs_dir", (None,), "no HDFS copy; the store may be S3 (storage.root=s3://...)"),
    no_setting("trainer.balance_batch", "rows are balanced across workers within each mini-batch here, so the "
               "mini-batches hold the samples in generation order (as verl's balance_batch=False)"),
    only("trainer.device", ("cuda",), "CUDA is used when present, else the CPU"),
    no_setting("trainer.log_val_generations", "every validation sample is stored (SQL: the validation table)"),
    only("trainer.rollout_data_dir", (None,), "no JSONL dump: rollouts are in the store's rollouts table "
         "(python -m infra.sql)"),
    only("trainer.validation_data_dir", (None,), "no JSONL dump: validation samples are in the store's validation "
         "table (python -m infra.sql)"),
]

TABLE: dict[str, VerlKey] = {row.key: row for row in ROWS}
assert len(TABLE) == len(ROWS), "a verl key is listed twice"
