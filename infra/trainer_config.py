"""Configuration of a trained model's update loop: the optimizer (rl.actor.optim, rl.critic.optim, and sft.optim's
base), the fields actor and critic share (rl.actor, rl.critic), and the actor's policy loss and memory settings.

verl's names: `rl.actor.ppo_mini_batch_size` (prompts per optimizer step, global), `rl.actor.micro_batch_size`
(sequences per forward/backward on one device), `rl.actor.policy_loss`, `rl.actor.loss_agg_mode`,
`rl.actor.use_kl_loss`. infra/rl_config.py puts these sections into `RLConfig`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from infra.algorithms import PolicyLoss, Vanilla, as_variant
from infra.config_base import Section


class OptimConfig(Section):
    """The one optimizer section (AdamW + LR schedule): rl.actor.optim, rl.critic.optim and sft.optim. The class
    defaults are the RL ones (verl's betas); SFT's section starts from its own (sft.optim in
    infra/config_sections.py)."""

    lr: float = Field(1e-5, gt=0, description="Peak learning rate.")
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas, each in [0, 1).")
    warmup_steps: int = Field(0, ge=0, description="Linear warmup from 0 to lr over this many schedule steps (RL: "
                              "training steps, one per RL step; SFT: optimizer steps).")
    lr_scheduler: Literal["constant", "cosine", "linear"] = Field("constant", description="After warmup.")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="Floor of the decay, as a share of lr.")
    grad_clip: float = Field(1.0, gt=0, description="Max global gradient norm.")

    @model_validator(mode="after")
    def _betas_in_range(self) -> OptimConfig:
        if not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas={list(self.betas)}: each must be in [0, 1)")
        return self


class TrainerConfig(Section):
    """Fields of a trained model's update loop, shared by actor and critic."""

    optim: OptimConfig = Field(default_factory=OptimConfig)
    micro_batch_size: int = Field(16, gt=0, description="Sequences per forward/backward on one device.")
    use_dynamic_bsz: bool = Field(False, description="Pack micro-batches by token budget instead.")
    max_token_len_per_device: int = Field(4096, gt=0, description="Token budget per micro-batch (dynamic).")
    ppo_epochs: int = Field(1, gt=0, description="Passes over each step's batch.")
    offload: bool = Field(
        False, description="FSDP2 CPU offload (verl's fsdp_config.offload_policy): sharded parameters, gradients and "
        "optimizer state live in host memory and each layer is gathered to the GPU for its forward and backward; "
        "the optimizer steps on the CPU. For models whose training state does not fit the GPU (e.g. 7B on one); "
        "nothing moves on CPU-only machines.")
    optimizer_offload: bool = Field(
        False, description="AdamW's moments (2x the trained parameters in fp32) wait in host memory between "
        "optimizer steps and come to the device for each step (verl's fsdp_config.optimizer_offload): generation "
        "and forward/backward run without them; the step itself still holds them (e.g. a 7B model on one H200).")
    reshard_after_forward: bool | None = Field(
        None, description="FSDP2: free each layer's gathered weights after forward and gather them again in backward "
        "(ZeRO-3, least memory), or keep them until backward. None: keep them on one device, or on several when the "
        "model's bf16 weights + fp32 gradients take <= 1/4 of a GPU's memory; free them otherwise.")
    grad_sync_every_micro_batch: bool | None = Field(
        None, description="FSDP2: reduce-scatter gradients after every micro-batch (least memory), or once per "
        "mini-batch (fewer collectives; unsharded gradients kept in between). None: as reshard_after_forward.")

    @model_validator(mode="before")
    @classmethod
    def _optimizer_fields_moved(cls, data):
        moved = sorted(set(OptimConfig.model_fields) & set(data)) if isinstance(data, dict) else []
        if moved:
            raise ValueError(f"{', '.join(moved)} moved into the optimizer section: write optim.{moved[0]} "
                             f"(e.g. rl.actor.optim.{moved[0]}, as verl's actor.optim.{moved[0]})")
        return data


class ActorConfig(TrainerConfig):
    ppo_mini_batch_size: int = Field(
        16, gt=0, description="Prompts per optimizer step (global; x n samples, or x one pair with online_dpo).")
    policy_loss: PolicyLoss = Field(
        default_factory=Vanilla, description="vanilla | gspo | gpg | cispo | clip_cov | kl_cov, a name or {name: ..., "
        "its parameters} (infra/algorithms.py).")
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = (
        Field("token-mean", description="How token losses become the batch loss (policy_loss=gspo: "
              "seq-mean-token-mean unless given).")
    )
    clip_ratio_low: float = Field(0.2, ge=0, description="PPO clip: ratio >= 1 - clip_ratio_low.")
    clip_ratio_high: float = Field(0.2, ge=0, description="PPO clip: ratio <= 1 + clip_ratio_high (DAPO: 0.28).")
    clip_ratio_c: float = Field(3.0, gt=1, description="Dual-clip bound for negative advantages.")
    entropy_coeff: float = Field(0.0, ge=0, description="Entropy bonus weight.")
    use_kl_loss: bool = Field(False, description="KL to the reference as a loss term (GRPO style).")
    kl_loss_coef: float = Field(0.001, ge=0)
    kl_loss_type: str = Field("low_var_kl", description="k1 | k2 | k3 | abs | mse | low_var_kl, '+' forms too.")
    gradient_checkpointing: bool | None = Field(
        None, description="Recompute each layer's activations in backward. None: on with CUDA when a rank's share of "
        "fp32 weights, gradients and AdamW moments (16 bytes per parameter) exceeds 40% of its GPU (e.g. 7B on one "
        "H200), off otherwise (faster).")
    use_remove_padding: bool | None = Field(
        None, description="Pack sequences without padding in actor/reference forwards (verl's use_remove_padding); "
        "None: on with CUDA (varlen flash attention), off on CPU (where it loops over sequences).")
    use_torch_compile: bool | None = Field(
        None, description="torch.compile each decoder layer and the logprob head (actor and reference; dynamic "
        "shapes, a minute or two of compilation in the first step). None: on with CUDA, off on CPU.")
    logprob_chunk_tokens: int | None = Field(
        None, gt=0, description="Tokens per chunk of the vocabulary projection (logits never exist for the whole "
        "micro-batch: chunk x vocab values at a time). None: 8192 with CUDA, 1024 on CPU.")
    ulysses_sequence_parallel_size: int = Field(
        1, gt=0, description="Ulysses sequence parallelism of the actor and reference passes (verl's key): groups of "
        "this many consecutive trainer ranks run each micro-batch together, each rank holding 1/P of its packed "
        "tokens (and 1/P of the heads in attention), so the data-parallel ranks are ranks / P (micro_batch_size and "
        "max_token_len_per_device x P are per group). Needs packed rows (use_remove_padding true or null) and must "
        "divide the number of trainer ranks and the model's attention heads. The critic runs without. 1: off.")

    @field_validator("policy_loss", mode="before")
    @classmethod
    def _policy_loss_name(cls, value):
        return as_variant(value, "vanilla")

    @model_validator(mode="before")
    @classmethod
    def _gspo_averages_sequences(cls, data):
        """GSPO's loss is a mean over sequences of their tokens' mean (the paper's; verl forces it): its default
        when rl.actor.loss_agg_mode is not given. A mode that is given is kept."""
        if isinstance(data, dict) and "loss_agg_mode" not in data:
            loss = as_variant(data.get("policy_loss"), "vanilla")
            if isinstance(loss, dict) and loss.get("name") == "gspo":
                return {**data, "loss_agg_mode": "seq-mean-token-mean"}
        return data

    @model_validator(mode="after")
    def _sequence_parallel_packs(self) -> ActorConfig:
        if self.ulysses_sequence_parallel_size > 1 and self.use_remove_padding is False:
            raise ValueError(f"rl.actor.ulysses_sequence_parallel_size={self.ulysses_sequence_parallel_size} splits "
                             "packed rows: set rl.actor.use_remove_padding to true or null (or the size to 1)")
        return self


class CriticConfig(TrainerConfig):
    cliprange_value: float = Field(0.5, gt=0, description="Value clipping range.")
    warmup_steps_before_actor: int = Field(0, ge=0, description="Critic-only steps before the actor trains.")
