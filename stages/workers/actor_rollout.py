"""The colocated worker: actor (trainer + optimizer), reference and rollout engine in one process.

HybridFlow's colocated placement: the three roles share one device and switch phases (generate, then
compute logprobs, then train, then push the new weights into the engine in-process). N such workers (one
per device) form one torch.distributed world: the actor and the reference are FSDP2-sharded over it (even
at N = 1), and every worker has its own rollout engine that generates its share of the prompts
(data-parallel rollout). The world is created first; vLLM then joins it in external-launcher mode with
tensor parallel size 1, so each engine still computes alone (see stages/model/fsdp.py). The reference is
the base model with LoRA disabled when LoRA is on, otherwise a frozen sharded copy; it is only built when
a KL term or online DPO needs it.

Weight sync streams the actor's parameters into the engine one decoder layer at a time (each gathered
from the shards, LoRA merged), so no device holds a second full copy next to the engine's.

With rollout workers of their own (`ray.rollout_devices_per_node`, stages/rl_async.py) the worker builds no engine:
it trains, and its rank 0 broadcasts the weights to them (`send_weights`, stages/workers/weight_transfer.py).
Peak device memory of each phase goes into the step's metrics (`memory_metrics`, stages/workers/memory.py).

With `rl.actor.ulysses_sequence_parallel_size` P > 1, groups of P consecutive ranks run the actor's and the
reference's micro-batches together (Ulysses sequence parallelism, stages/model/sequence_parallel.py): the ranks of
a group get the same rows, each packs them and runs 1/P of the packed row, and each returns the same results.

The worker is a plain class (testable without Ray); stages/workers/group.py runs it as a Ray actor.
"""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist

from infra.config import Config
from stages.batch import Batch, build_batch, to_device
from stages.model.fsdp import (
    all_reduce,
    full_state_dict,
    hf_weights,
    init_process_group,
    iter_hf_weights,
    reshard,
    shard,
)
from stages.model.loading import compute_dtype, enable_checkpointing, load_model
from stages.model.packing import host_inputs, packing_unsupported
from stages.model.policy import TokenLogprobs, compile_layers, head_problem
from stages.model.sequence_parallel import check_heads, consecutive_group, sequence_parallel_group
from stages.rollout.base import PackedOutputs, RolloutOutput, SamplingParams
from stages.rollout.cuda_weights import TP_FIELD
from stages.rollout.local import local_engine
from stages.rollout.prefix_cache import PrefixRouter
from stages.workers.actor_loss import actor_loss
from stages.workers.memory import MemoryPeaks, measured
from stages.workers.train_engine import (
    TrainEngine,
    automatic_fields,
    local_mini_rows,
    micro_batches,
    resolve_trainer,
    state_is_large,
)
from stages.workers.weight_transfer import WeightGroup, WeightMeta, weight_meta

logger = logging.getLogger(__name__)


class StaleEngineError(RuntimeError):
    """The rollout engine's logprobs disagree with the trainer's after a weight sync."""


def engine_max_len(cfg: Config) -> int:
    """The rollout engines' max_model_len: a prompt and its whole response."""
    return cfg.data.max_prompt_length + cfg.data.max_response_length


def make_engine(cfg: Config, model_dir: str):
    rollout = cfg.rl.rollout
    max_len = engine_max_len(cfg)
    if rollout.engine == "vllm":
        from stages.rollout.vllm_engine import VLLMRolloutEngine

        return VLLMRolloutEngine(model_dir, dtype=cfg.model.dtype, seed=cfg.run.seed, max_model_len=max_len,
                                 enforce_eager=rollout.enforce_eager,
                                 gpu_memory_utilization=rollout.gpu_memory_utilization,
                                 enable_sleep_mode=torch.cuda.is_available(), external_launcher=True,
                                 max_num_seqs=rollout.max_num_seqs,
                                 tensor_parallel_size=rollout.tensor_model_parallel_size)
    if rollout.engine not in ("hf", "cuda"):
        raise ValueError(f"rl.rollout.engine={rollout.engine!r} is not an engine: set it to vllm, hf or cuda")
    # cuda, tensor parallel: a group of consecutive ranks per engine (a collective: right after the world forms)
    group = consecutive_group(rollout.tensor_model_parallel_size, TP_FIELD) if rollout.engine == "cuda" else None
    return local_engine(rollout.engine, model_dir, cfg.model, max_model_len=max_len, max_num_seqs=rollout.max_num_seqs,
                        setting="rl.rollout.engine", prefix_cache_rows=prefix_cache_rows(cfg),
                        quantization=rollout.quantization, free_cache=rollout.free_cache_engine,
                        tensor_parallel_group=group)


def prefix_cache_rows(cfg: Config) -> int:
    """rl.rollout.prefix_cache_rows, resolved: by default on (max_num_seqs rows) for multi-turn rollouts on the cuda
    engine only (the others keep no park)."""
    rows, multi_turn = cfg.rl.rollout.prefix_cache_rows, cfg.rl.multi_turn
    if rows is not None or cfg.rl.rollout.engine != "cuda":
        return rows or 0
    uses_turns = multi_turn.tool_config_path or multi_turn.tool_functions or getattr(
        multi_turn, "interaction_config_path", None)
    return cfg.rl.rollout.max_num_seqs if uses_turns else 0


def prefix_router(cfg: Config, engines: int) -> PrefixRouter | None:
    """With several cuda engines and prefix reuse on, the router that sends a trajectory's turns to one engine."""
    rows = prefix_cache_rows(cfg)
    if rows == 0 or engines == 1:
        return None
    return PrefixRouter(engines, rows, cfg.data.max_prompt_length + cfg.data.max_response_length)


class ActorRolloutWorker:
    def __init__(self, cfg: Config, model_dir: str, rank: int = 0, world_size: int = 1,
                 master_addr: str = "127.0.0.1", master_port: int | None = None):
        self.cfg = cfg
        self.rl = cfg.rl
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        init_process_group(rank, world_size, master_addr, master_port)  # first: vLLM joins this world
        # with rollout workers of their own (ray.rollout_devices_per_node), the trainer generates nothing
        self.engine = None if cfg.ray.rollout_devices_per_node else make_engine(cfg, model_dir)
        sp = self.sequence_parallel_size(cfg)
        self.sp_group = sequence_parallel_group(sp)  # after vLLM's groups: every rank creates groups in one order
        self.rank, self.weights = rank, None  # weights: the broadcast group to the rollout workers
        self.memory = MemoryPeaks(self.device)
        self._held_awake = False
        torch.manual_seed(cfg.run.seed)  # the same initial weights (LoRA adapters too) on every rank
        # fp32 master weights; forwards compute in model.dtype (FSDP2 mixed precision)
        model_cfg = cfg.model.model_copy(update={"gradient_checkpointing": bool(self.rl.actor.gradient_checkpointing),
                                                 "dtype": "float32"})
        model = load_model(model_dir, model_cfg)
        check_heads(model.config, sp)
        self._resolve(cfg, model)
        self.actor = self._sharded(model)
        self.ref = None
        if self.rl.uses_reference and cfg.model.lora is None:  # frozen: stored in model.dtype
            self.ref = self._sharded(load_model(model_dir, cfg.model, trainable=False))
        pair_rows = 2 if self.rl.algorithm.adv_estimator.pairwise else 1  # online DPO: a pair in one micro-batch
        self.trainer = TrainEngine("actor", self.actor, self.rl.actor, self.rl.total_steps,
                                   local_mini_rows(cfg, sp), pair_rows, sp)
        lora = cfg.model.lora
        self.lora_scale = lora.alpha / lora.rank if lora else None
        torch.manual_seed(cfg.run.seed + rank)  # per-rank randomness from here on (dropout)

    @classmethod
    def sequence_parallel_size(cls, cfg: Config) -> int:
        """Consecutive ranks that get the same rows (WorkerGroup's dispatch): a Ulysses group."""
        return cfg.rl.actor.ulysses_sequence_parallel_size

    def _resolve(self, cfg: Config, model) -> None:
        """Decide the actor's automatic (None) settings once, for this device and model; `automatic` lists them
        (with the rollout's prefix_cache_rows) for the driver to log and record."""
        given, cuda = cfg.rl.actor, self.device.type == "cuda"
        problem, sp = packing_unsupported(model.config) or head_problem(model), given.ulysses_sequence_parallel_size
        if problem and given.use_remove_padding:
            raise ValueError(f"rl.actor.use_remove_padding=true: packed rows cannot compute this model ({problem}); "
                             "set it to false or leave it null")
        if problem and sp > 1:
            raise ValueError(f"rl.actor.ulysses_sequence_parallel_size={sp} splits packed rows, which cannot compute "
                             f"this model ({problem}): set it to 1")
        if problem and cuda and given.use_remove_padding is None:
            logger.warning("rl.actor.use_remove_padding: off, packed rows cannot compute this model (%s): the actor "
                           "and reference run on padded rows", problem)
        checkpointing = given.gradient_checkpointing
        if checkpointing is None:
            world = dist.get_world_size() if dist.is_initialized() else 1
            checkpointing = cuda and state_is_large(sum(p.numel() for p in model.parameters()), world,
                                                    torch.cuda.get_device_properties(self.device).total_memory)
            if checkpointing:
                enable_checkpointing(model)
        actor = resolve_trainer(given, model).model_copy(update={
            "gradient_checkpointing": checkpointing,
            "use_remove_padding": ((cuda or sp > 1) and not problem) if given.use_remove_padding is None
            else given.use_remove_padding,
            "use_torch_compile": cuda if given.use_torch_compile is None else given.use_torch_compile,
            "logprob_chunk_tokens": given.logprob_chunk_tokens or (8192 if cuda else 1024)})
        rollout = cfg.rl.rollout.model_copy(update={"prefix_cache_rows": prefix_cache_rows(cfg)})
        self.rl = cfg.rl.model_copy(update={"actor": actor, "rollout": rollout})
        self.cfg = cfg.model_copy(update={"rl": self.rl})
        self.automatic = {**automatic_fields(given, actor, "rl.actor"),
                          **automatic_fields(cfg.rl.rollout, rollout, "rl.rollout")}

    def automatic_settings(self) -> dict[str, object]:
        return self.automatic

    def memory_metrics(self) -> dict[str, float]:
        """Peak device memory of each phase since the last call, the largest over ranks (a collective)."""
        return self.memory.metrics()

    def _sharded(self, model) -> TokenLogprobs:
        """The model as a sharded TokenLogprobs with the actor's resolved device settings."""
        actor = self.rl.actor
        if actor.use_torch_compile:
            compile_layers(model)
        module = TokenLogprobs(model.to(self.device), chunk_tokens=actor.logprob_chunk_tokens,
                               pack=actor.use_remove_padding, compile_head=actor.use_torch_compile,
                               sequence_parallel=self.sp_group)
        return shard(module, compute_dtype(self.cfg.model), actor.reshard_after_forward, actor.offload)

    # ---- rollout -------------------------------------------------------------------------------

    def hold_engine_awake(self, awake: bool) -> None:
        """Keep the engine awake across the generate calls of one rollout (a multi-turn loop calls once per turn:
        one wake instead of one per turn, and vllm's prefix cache lives on between turns), or let it sleep."""
        self._held_awake = awake
        self.engine.wake() if awake else self.engine.sleep()

    @measured("gen")
    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> PackedOutputs:
        """This rank's prompts (`prompt_index` counts from 0 within them); the driver offsets the indices. Packed:
        the driver unpickles arrays, not one object per token."""
        if self._held_awake:
            return PackedOutputs.pack(self.engine.generate(prompt_ids, params))
        self.engine.wake()
        try:
            return PackedOutputs.pack(self.engine.generate(prompt_ids, params))
        finally:
            self.engine.sleep()

    def engine_param_count(self) -> int:
        """Parameters this rank's vllm engine holds (its shard under tensor parallel rollout)."""
        return self.engine.param_count()

    # ---- inference passes ------------------------------------------------------------------------

    @torch.no_grad()
    @measured(lambda batch, role="actor", with_entropy=False: "old_log_prob" if role == "actor" else "ref")
    def compute_logprobs(self, batch: Batch, role: str = "actor", with_entropy: bool = False):
        """(logprobs, entropy) of the batch's responses under the actor or the reference, (B, R) each."""
        model, context = self._role(role)
        model.eval()
        num_rows, width = len(batch), batch.num_response_tokens
        logprobs, entropy = torch.zeros(num_rows, width), torch.zeros(num_rows, width)
        sp = self.trainer.sequence_parallel_size
        with context:
            for rows in micro_batches(batch, self.rl.actor, sequence_parallel_size=sp):
                lp, ent = model(**self._inputs(batch.select(rows)), temperature=self.rl.rollout.temperature,
                                with_entropy=with_entropy)
                logprobs[rows], entropy[rows] = lp.float().cpu(), ent.float().cpu()
            # inside the context: leaving peft's disable_adapter re-enables requires_grad on the parameters
            # registered then, which must be the sharded ones that the optimizer holds
            reshard(model)
        return logprobs, entropy

    def _role(self, role: str):
        if role == "actor":
            return self.actor, nullcontext()
        if self.ref is not None:
            return self.ref, nullcontext()
        if self.lora_scale is not None:
            return self.actor, self.actor.lm.disable_adapter()
        raise ValueError("no reference model: set rl.actor.use_kl_loss or rl.algorithm.use_kl_in_reward")

    def _inputs(self, values: Batch | dict, split: bool = True) -> dict:
        """Tensors moved to this worker's device; a Batch gives its model inputs, packed on the host when the
        models pack, and split over this rank's Ulysses group unless `split` is False (every rank then runs its own
        rows alone; see `to_device`: the host never waits for the device here)."""
        if isinstance(values, Batch):
            values = host_inputs(values, self.actor.pack, self.sp_group if split else None)
        return to_device(values, self.device)

    # ---- training ----------------------------------------------------------------------------------

    @measured("update_actor")
    def update_actor(self, batch: Batch) -> dict[str, float]:
        return self.trainer.update(batch, lambda micro, denominators: actor_loss(
            self.actor, micro, denominators, self.cfg, self._inputs))

    # ---- weight sync ---------------------------------------------------------------------------------

    @measured("sync")
    def sync_weights(self, check_prompts: list[list[int]]) -> dict[str, float]:
        """Stream the actor's weights into the engine layer by layer, then check the engine on a few greedy
        tokens (every rank checks its own engine; the largest difference is reported and checked). The check
        wakes the engine again after the push's sleep, so it also covers weights that a sleep moves (vLLM's
        level 1 offloads them; verl #7904 lost them at wake-up)."""
        start = time.perf_counter()
        self.engine.wake()
        try:
            self.engine.update_weights(iter_hf_weights(self.actor, self.lora_scale, compute_dtype(self.cfg.model)))
        finally:
            self.engine.sleep()
        metrics = {"timing_s/sync_push": time.perf_counter() - start}
        if self.rl.rollout.logprob_check_tokens and check_prompts:
            start = time.perf_counter()
            metrics["rollout/logprob_diff_max"] = self._check_engine(check_prompts)
            metrics["timing_s/sync_check"] = time.perf_counter() - start
        return metrics

    def _check_engine(self, prompts: list[list[int]]) -> float:
        tokens = min(self.rl.rollout.logprob_check_tokens, self.cfg.data.max_response_length)  # fits the engine
        return self.engine_diff(prompts, self.generate(prompts, SamplingParams(n=1, temperature=0.0,
                                                                               max_tokens=tokens)))

    def engine_diff(self, prompts: list[list[int]], outs: list[RolloutOutput]) -> float:
        """The largest |engine - trainer| logprob over greedy `outs` of `prompts` (all ranks, a collective);
        StaleEngineError above rl.rollout.logprob_check_tol."""
        batch = build_batch([prompts[o.prompt_index] for o in outs], [o.response_ids for o in outs],
                            [o.logprobs for o in outs], pad_token_id=0)
        self.actor.eval()
        with torch.no_grad():  # not split: the ranks of a Ulysses group check rows of their own engines
            lp, _ = self.actor(**self._inputs(batch, split=False), temperature=1.0)
        reshard(self.actor)
        mask = batch.response_mask
        local = ((lp.cpu() - batch.tensors["rollout_logprobs"]).abs() * mask).max()
        diff = float(all_reduce(local, dist.ReduceOp.MAX))  # every rank raises, or none
        if diff > self.rl.rollout.logprob_check_tol:
            raise StaleEngineError(
                f"rollout engine disagrees with the trainer after a weight sync: max |logprob diff| = {diff:.3g} "
                f"> rl.rollout.logprob_check_tol={self.rl.rollout.logprob_check_tol}"
            )
        return diff

    # ---- weights to rollout workers on other devices (stages/workers/weight_transfer.py) ---------------

    def open_weight_group(self, addr: str, port: int, size: int) -> None:
        """Rank 0 joins the broadcast group to the rollout workers as its rank 0 (the others take no part)."""
        if self.rank == 0:
            self.weights = WeightGroup(addr, port, 0, size, self.device, self.rl.async_training.rollout_timeout_s)

    def close_weight_group(self) -> None:
        """Rank 0 leaves the broadcast group (with every rollout worker: `WeightGroup.close` is collective)."""
        if self.weights is not None:
            self.weights.close()
            self.weights = None

    def _pushed_weights(self):
        """The weights a push sends: HF names, LoRA merged, floating tensors in the forward's dtype (model.dtype:
        the engines compute in it, so sending fp32 master weights would only double the bytes)."""
        yield from iter_hf_weights(self.actor, self.lora_scale, compute_dtype(self.cfg.model))

    def weight_meta(self) -> WeightMeta:
        """Names, shapes and dtypes of a push, in its order (every rank iterates: the gathers are collective)."""
        return weight_meta(self._pushed_weights())

    @measured("push")
    def send_weights(self) -> dict[str, float]:
        """Push the actor's weights to the rollout workers (every rank gathers; rank 0 broadcasts)."""
        start = time.perf_counter()
        weights = self._pushed_weights()
        if self.weights is None:  # ranks > 0 take part in the gathers only
            for _ in weights:
                pass
            return {}
        sent = self.weights.send(weights)
        return {"timing_s/push": time.perf_counter() - start, "async/push_mib": sent / 2**20}

    # ---- checkpoints -------------------------------------------------------------------------------

    def save_checkpoint(self, path: str) -> None:
        """Sharded (every rank writes its shards) into `path`/actor; `path` must be visible to every rank."""
        self.trainer.save(Path(path) / "actor")

    def load_checkpoint(self, path: str) -> None:
        self.trainer.load(Path(path) / "actor")

    def hf_state(self) -> dict[str, torch.Tensor]:
        """Plain HF weights (LoRA merged) on rank 0 (empty elsewhere); tests compare them with checkpoints."""
        state = full_state_dict(self.actor)
        return hf_weights(state, self.lora_scale) if state else {}
