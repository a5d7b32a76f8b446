"""Configuration of the RL stage (the largest section, so it lives apart from infra/config_sections.py).

verl users will recognise the names: `rl.train_batch_size` (prompts per step), `rl.rollout.n`,
`rl.actor.ppo_mini_batch_size` (prompts per optimizer step, global), `rl.actor.micro_batch_size`
(sequences per forward/backward on one device), `rl.algorithm.adv_estimator`, `rl.actor.policy_loss`,
`rl.actor.loss_agg_mode`, `rl.algorithm.use_kl_in_reward`, `rl.actor.use_kl_loss`. Algorithms are chosen
by config alone (README.md's "Algorithms, chosen by config" gives the settings of each); `recipes/` has GRPO,
DAPO, PPO and online DPO recipes.
The sections of the trained models (rl.actor, rl.critic and their optim) live in infra/trainer_config.py.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from infra.algorithms import GRPO, AdvEstimator, as_variant
from infra.config_base import Section
from infra.rollout_correction import RolloutCorrectionConfig, check_policy_loss
from infra.trainer_config import ActorConfig, CriticConfig


class RolloutConfig(Section):
    engine: Literal["vllm", "hf", "cuda"] = Field(
        "vllm", description="vllm (fast, colocated), hf (transformers generate) or cuda (our static-KV-cache engine "
        "with CUDA graphs, stages/rollout/cuda_engine.py; Qwen2/Llama; also runs on CPU, slowly)."
    )
    n: int = Field(8, gt=0, description="Samples per prompt.")
    max_num_seqs: int = Field(256, gt=0, description="vllm and cuda engines: sequences generated at once.")
    tensor_model_parallel_size: int = Field(
        1, gt=0, description="vllm and cuda: GPUs per rollout engine (tensor parallel); the workers form groups of "
        "this many consecutive ranks, each group one engine generating one share of the prompts. Must divide the "
        "number of workers (and, for cuda, the model's attention heads and intermediate size); hf: 1.")
    free_cache_engine: bool | None = Field(
        None, description="cuda: free the engine's KV cache and CUDA graphs while the trainer works and allocate "
        "and capture them again for the next generation (verl's free_cache_engine; the vllm engine's sleep mode "
        "always does on GPUs). None: free them when the cache takes >= 20% of the GPU's memory.")
    quantization: Literal["fp8"] | None = Field(
        None, description="cuda: 'fp8' generates with the layers' projections in float8 e4m3 (one scale per output "
        "channel, quantised at every weight sync; activations per token; Hopper/Ada GPUs), embeddings, norms, "
        "attention and head in model.dtype (verl's rollout.quantization; verl quantises 128x128 blocks). The "
        "trainer stays bf16: the sync check's gap grows (raise logprob_check_tol) and rl.algorithm."
        "rollout_correction absorbs the mismatch. None: model.dtype.")
    temperature: float = Field(1.0, gt=0, description="Training sampling temperature.")
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1, description="-1: off.")
    val_n: int = Field(1, gt=0, description="Validation samples per prompt (>1 adds mean/best/maj@n).")
    val_temperature: float = Field(0.0, ge=0, description="Validation temperature; 0 = greedy.")
    val_top_p: float = Field(1.0, gt=0, le=1)
    enforce_eager: bool = Field(True, description="vllm: skip graph capture/compilation (faster start on CPU).")
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1, description="vllm: share of device memory.")
    prefix_cache_rows: int | None = Field(
        None, ge=0, description="cuda: finished sequences whose K/V the engine keeps so that a multi-turn "
        "trajectory's next turn computes only its new tokens (a second KV cache of this many rows); None: "
        "max_num_seqs when rl.multi_turn has tools or interactions, else 0; 0: off.")
    logprob_check_tokens: int = Field(32, ge=0, description="Tokens checked after each weight sync (0: off).")
    logprob_check_freq: int = Field(
        1, ge=1, description="Check the engine after the weight sync of every k-th step, and always after a run's "
        "(or a resumed run's) first sync and the last step's; 1: every sync. The check costs ~5% of a GPU step "
        "(0.16 s of 2.6 s for a 0.5B model on an H100: bench/results/2026-11-27-gpu-sync-check.md); "
        "training/rollout_probs_diff_max is reported at every step regardless.")
    logprob_check_tol: float = Field(1e-2, gt=0, description="Max |engine - trainer| logprob before erroring.")

    def check_due(self, step: int, last_step: int, first: bool) -> bool:
        """Whether the engine is checked after the weight sync that follows `step` (logprob_check_freq): a process's
        first sync, every k-th step's and the last step's."""
        return first or step % self.logprob_check_freq == 0 or step == last_step


class AlgorithmConfig(Section):
    adv_estimator: AdvEstimator = Field(
        default_factory=GRPO, description="gae | grpo | dr_grpo | rloo | reinforce_plus_plus | "
        "reinforce_plus_plus_baseline | remax | opo | gpg | grpo_passk | online_dpo, a name or {name: ..., its "
        "parameters} (gamma, lam, norm_adv_by_std_in_grpo, epsilon, beta where the estimator has them; "
        "infra/algorithms.py).")
    @field_validator("adv_estimator", mode="before")
    @classmethod
    def _estimator_name(cls, value):
        return as_variant(value, "grpo")

    @model_validator(mode="before")
    @classmethod
    def _estimator_fields_moved(cls, data):
        moved = sorted({"gamma", "lam", "norm_adv_by_std_in_grpo"} & set(data)) if isinstance(data, dict) else []
        if moved:
            raise ValueError(f"{', '.join(moved)} moved into the estimator's section: write "
                             f"rl.algorithm.adv_estimator.{moved[0]} (only estimators that use it accept it)")
        return data

    use_kl_in_reward: bool = Field(False, description="Subtract beta * KL(old || ref) from token rewards.")
    kl_penalty: str = Field("kl", description="KL estimator for the in-reward penalty.")
    kl_ctrl_type: Literal["fixed", "adaptive"] = Field("fixed")
    kl_coef: float = Field(0.001, ge=0, description="beta (initial beta when adaptive).")
    target_kl: float = Field(0.1, gt=0, description="Adaptive controller target.")
    kl_horizon: int = Field(10000, gt=0, description="Adaptive controller horizon.")
    filter_groups: bool = Field(False, description="DAPO dynamic sampling: drop groups with zero spread.")
    filter_groups_metric: Literal["score", "acc", "seq_reward"] = Field("acc")
    max_num_gen_batches: int = Field(10, ge=0, description="Generation batches per step at most (0: no limit).")
    rollout_correction: RolloutCorrectionConfig = Field(
        default_factory=RolloutCorrectionConfig, description="verl's algorithm.rollout_correction: importance "
        "weights and rejection for the engine/trainer logprob gap, bypass mode (infra/rollout_correction.py).")


class RewardConfig(Section):
    custom_path: str | None = Field(None, description="Python file with a verl-style reward function.")
    custom_function: str = Field("compute_score", description="Function name in custom_path.")
    math_scorer: Literal["verl", "math_verify"] = Field(
        "verl", description="Scorer of the MATH data_sources (lighteval/MATH, DigitalLearningGmbH/MATH-lighteval, "
        "HuggingFaceH4/MATH-500) under the default reward function. verl: as verl, the last \\boxed{} compared by "
        "MATH's string normalisation (stages/rewards/math_reward.py); math_verify: math-verify's symbolic and "
        "numeric equivalence, more lenient ('0.5' = '\\frac{2}{4}'). Other data_sources are unaffected.")
    num_workers: int = Field(2, gt=0, description="Scorer processes.")
    timeout_s: float = Field(10.0, gt=0, description="Per-sample scorer timeout; a timeout scores 0.")
    max_failed_frac: float = Field(
        0.9, gt=0, le=1, description="When at least this share of a batch's samples fail to score (error, timeout "
        "or NaN), on_failure applies; fewer failures score 0 with one warning per batch.")
    on_failure: Literal["error", "warn"] = Field(
        "error", description="error: stop the run (a broken reward would train on zeros); warn: score them 0 loudly.")
    overlong_buffer: int = Field(0, ge=0, description="DAPO: penalise the last N tokens before max (0: off).")
    overlong_penalty_factor: float = Field(1.0, ge=0, description="DAPO: penalty at max length.")
    reward_model_path: str | None = Field(
        None, description="A one-label AutoModelForSequenceClassification reward model (folder or hub id), run in "
        "its own Ray worker; None: off. Its score is added to the rule score: score = rule + weight * rm.")
    reward_model_weight: float = Field(1.0, allow_inf_nan=False,
                                       description="Weight of the reward model's score in the sample score.")
    reward_model_batch_size: int = Field(16, gt=0, description="Samples per reward model forward pass.")


class MultiTurnConfig(Section):
    """Agent loops with tools and simulated users (stages/agent/tool_loop.py); verl's rollout.multi_turn. Rows
    choose a loop by their `agent_name` column (verl-format data files carry it; the calculator task sets it)."""

    tool_config_path: str | None = Field(
        None, description="YAML file of tools in verl's format (class_name, config, tool_schema per tool).")
    tool_functions: list[str] = Field(
        default_factory=list, description="Plain Python functions as tools: 'path/file.py:function' entries.")
    format: str = Field("hermes", description="Tool-call format of the chat template (stages/tools/parsers.py).")
    max_assistant_turns: int = Field(4, gt=0, description="Model turns per trajectory at most.")
    max_user_turns: int = Field(4, gt=0, description="Tool (and user) turns per trajectory at most.")
    max_parallel_calls: int = Field(1, gt=0, description="Tool calls run per model turn; more get an error text.")
    max_tool_response_length: int = Field(256, gt=0, description="Characters of one tool answer the model sees.")
    tool_response_truncate_side: Literal["left", "middle", "right"] = Field(
        "middle", description="Which part of a long tool answer the model reads, as verl: left its start, right its "
        "end, middle both ends (the middle cut).")
    tool_timeout_s: float = Field(10.0, gt=0, description="Wall-clock limit of one tool call.")
    tool_reward_weight: float = Field(
        1.0, allow_inf_nan=False, description="Weight of the tools' step rewards added to the outcome score.")
    interaction_config_path: str | None = Field(
        None, description="YAML file of simulated users in verl's format (`interaction:` list of name, class_name, "
        "config; stages/agent/interactions.py). Rows on tool_agent with extra_info.interaction_kwargs.name get the "
        "named one's reply after each model turn without a tool call. None: no simulated users.")
    interaction_reward_weight: float = Field(
        1.0, allow_inf_nan=False, description="Weight of a simulated user's turn scores (summed over the trajectory) "
        "added to the outcome score; 0: they are only recorded (turns table, the reward function's extra_info).")
    interaction_timeout_s: float = Field(
        30.0, gt=0, description="Wall-clock limit of one call to a simulated user; past it the trajectory ends "
        "(finish_reason interaction_error).")


class AsyncTrainingConfig(Section):
    """How generation and training overlap (verl's one_step_off_policy and fully_async_policy recipes).

    sync: generate, then train on it (staleness 0); colocated by default, or on separate rollout devices.
    one_step_off: separate rollout workers generate step k+1's batch while the trainer trains on step k
      (staleness exactly one policy version); weights are pushed after every update.
    fully_async: rollout workers stream scored groups into a bounded queue; the trainer takes
      train_batch_size groups per step; at most `max_staleness` versions between a sample's oldest token and the
      policy it trains; weights pushed every `trigger_parameter_sync_step` steps, interrupting generation in
      flight when `partial_rollout` is on. Modes other than sync need ray.rollout_devices_per_node > 0.
    """

    mode: Literal["sync", "one_step_off", "fully_async"] = Field("sync", description="Schedule of generation.")
    max_staleness: int = Field(1, ge=0, description="fully_async: policy versions a sample may lag behind the "
                               "policy it trains (0: the synchronous schedule on separate devices).")
    staleness_policy: Literal["wait", "drop"] = Field(
        "wait", description="fully_async: wait (generate no group that would be too stale) or drop (generate "
        "freely, drop groups over max_staleness when the trainer takes them).")
    trigger_parameter_sync_step: int = Field(1, gt=0, description="fully_async: push weights every N steps.")
    partial_rollout: bool = Field(True, description="fully_async: a weight push interrupts generation in flight, "
                                  "which continues with the new weights (every token records its policy version).")
    partial_rollout_tokens: int = Field(32, gt=0, description="fully_async with partial_rollout: tokens generated "
                                        "per engine call; a push waits at most one such call.")
    generation_groups: int | None = Field(None, gt=0, description="fully_async: prompts (groups) per engine call "
                                          "(None: rl.train_batch_size).")
    queue_groups: int | None = Field(None, gt=0, description="fully_async: scored groups waiting at most (None: "
                                     "twice rl.train_batch_size).")
    rollout_timeout_s: float = Field(600.0, gt=0, description="Longest the trainer waits for the next group, "
                                     "or a weight push or validation for the chunk in flight, before failing (a "
                                     "stalled rollout worker).")

    @model_validator(mode="after")
    def _pushes_keep_up(self) -> AsyncTrainingConfig:
        if self.mode == "fully_async" and self.trigger_parameter_sync_step - 1 > self.max_staleness:
            raise ValueError(f"rl.async_training.trigger_parameter_sync_step={self.trigger_parameter_sync_step} pushes "
                             f"weights every {self.trigger_parameter_sync_step} steps, so samples lag up to "
                             f"{self.trigger_parameter_sync_step - 1} versions: raise max_staleness "
                             f"(={self.max_staleness}) to at least that, or push more often")
        return self

    def ignored_fields(self, separate: bool) -> list[str]:
        """Fields set away from their defaults that this mode does not read (`separate`: rollout devices exist)."""
        used = {"mode", "rollout_timeout_s"} if separate else {"mode"}
        if self.mode == "fully_async":
            used = set(type(self).model_fields)
        return [f"rl.async_training.{name}={getattr(self, name)!r}" for name in sorted(self.model_fields_set - used)
                if getattr(self, name) != type(self).model_fields[name].default]

    @property
    def staleness(self) -> int:
        """Policy versions a sample may lag behind the policy it trains in this mode."""
        return {"sync": 0, "one_step_off": 1, "fully_async": self.max_staleness}[self.mode]


class RLConfig(Section):
    enabled: bool = Field(False, description="Run the RL stage after SFT.")
    total_steps: int = Field(20, gt=0, description="Training steps (one batch of prompts each).")
    train_batch_size: int = Field(32, gt=0, description="Prompts per step.")
    test_freq: int = Field(10, ge=0, description="Validate every N steps (0: only at the end).")
    save_freq: int = Field(10, ge=0, description="Checkpoint every N steps (0: only at the end).")
    max_ckpt_to_keep: int = Field(2, gt=0)
    resume_mode: Literal["auto", "disable"] = Field("auto", description="auto: continue from the latest checkpoint.")
    val_before_train: bool = Field(
        True, description="Validate before the first step; with rollout.val_n = 1 also rollout.n samples per prompt at "
        "the training temperature (val/acc/mean@n and best@n = pass@n: what RL starts from).")
    no_signal_frac: float = Field(
        0.9, gt=0, le=1, description="A step has almost no learning signal when at least this share of its groups "
        "got the same reward for every sample.")
    no_signal_steps: int = Field(
        3, ge=0, description="Warn (console, log, report, Prefect) after this many such steps in a row (0: never).")
    max_validation_samples: int | None = Field(None, gt=0, description="Cap on validation prompts.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    actor: ActorConfig = Field(default_factory=ActorConfig)
    critic: CriticConfig = Field(default_factory=CriticConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    multi_turn: MultiTurnConfig = Field(default_factory=MultiTurnConfig)
    async_training: AsyncTrainingConfig = Field(default_factory=AsyncTrainingConfig)

    @model_validator(mode="after")
    def _batch_sizes_divide(self) -> RLConfig:
        if self.train_batch_size % self.actor.ppo_mini_batch_size:
            raise ValueError(
                f"rl.train_batch_size={self.train_batch_size} must be a multiple of "
                f"rl.actor.ppo_mini_batch_size={self.actor.ppo_mini_batch_size} (prompts per optimizer step): raise "
                "the first or lower the second"
            )
        return self

    @model_validator(mode="after")
    def _names_exist(self) -> RLConfig:
        from stages.core import KL_ESTIMATORS

        for field, value in (("actor.kl_loss_type", self.actor.kl_loss_type),
                             ("algorithm.kl_penalty", self.algorithm.kl_penalty)):
            if value not in KL_ESTIMATORS:
                raise ValueError(f"{field}={value!r} is unknown; valid: {', '.join(sorted(KL_ESTIMATORS.keys()))}")
        return self

    @model_validator(mode="after")
    def _groups_fit(self) -> RLConfig:
        estimator = self.algorithm.adv_estimator
        if self.rollout.n < estimator.min_group_size:
            raise ValueError(f"rl.algorithm.adv_estimator={estimator.name} compares the samples of each prompt: "
                             f"rl.rollout.n={self.rollout.n} must be at least {estimator.min_group_size} (e.g. 4 or 8)")
        return self

    @model_validator(mode="after")
    def _pairs_fit(self) -> RLConfig:
        """Online DPO (a pairwise estimator) trains on (chosen, rejected) pairs with its own loss."""
        if not self.algorithm.adv_estimator.pairwise:
            return self
        name = self.algorithm.adv_estimator.name
        if self.rollout.n < 2:
            raise ValueError(f"rl.algorithm.adv_estimator={name} pairs the best and the worst of each prompt's "
                             f"samples: rl.rollout.n={self.rollout.n} must be at least 2 (e.g. 4 or 8)")
        if not self.actor.use_dynamic_bsz and self.actor.micro_batch_size % 2:
            raise ValueError(f"rl.algorithm.adv_estimator={name} keeps each (chosen, rejected) pair in one "
                             f"micro-batch: rl.actor.micro_batch_size={self.actor.micro_batch_size} must be even")
        if self.actor.policy_loss.name != "vanilla":
            raise ValueError(f"rl.algorithm.adv_estimator={name} trains with the DPO loss, so rl.actor.policy_loss="
                             f"{self.actor.policy_loss.name} would be ignored: remove it (the DPO loss's parameter is "
                             f"rl.algorithm.adv_estimator.beta)")
        if self.algorithm.use_kl_in_reward:
            raise ValueError(f"rl.algorithm.adv_estimator={name} ranks samples by their reward and stays near the "
                             "reference through beta; rl.algorithm.use_kl_in_reward=true would change the ranking: "
                             "set it to false")
        corr = self.algorithm.rollout_correction
        if corr.bypass_mode or corr.corrects:
            raise ValueError(f"rl.algorithm.adv_estimator={name}'s loss compares whole sequences with the reference "
                             "and takes no importance weights; rl.algorithm.rollout_correction (weights, rejection, "
                             "bypass) would be ignored or cut pairs: leave it off")
        return self

    @model_validator(mode="after")
    def _rollout_correction_fits_the_loss(self) -> RLConfig:
        check_policy_loss(self.algorithm.rollout_correction, self.actor.policy_loss.name)
        return self

    @property
    def uses_critic(self) -> bool:
        return self.algorithm.adv_estimator.needs_critic

    @property
    def uses_reference(self) -> bool:
        return self.actor.use_kl_loss or self.algorithm.use_kl_in_reward or self.algorithm.adv_estimator.needs_reference

    @property
    def train_rows_per_prompt(self) -> int:
        """Rows the actor trains on per prompt: its rollout.n samples, or one (chosen, rejected) pair (pairwise)."""
        return 2 if self.algorithm.adv_estimator.pairwise else self.rollout.n
