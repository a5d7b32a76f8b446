"""The `cuda` rollout engine: generation with a static KV cache and decode steps captured as CUDA graphs.

Algorithm (one `generate` call; sequences = prompts x n, prompt-major):

1. Slots. The engine holds `max_num_seqs` slots: a KV-cache row, a position, a token count, a done flag
   and an output row each. Running sequences occupy slots [0, B); the rest are free.
2. Admission. While prompts wait and at least a batch of them fits (n slots each), the waiting prompts
   are prefilled together, packed without padding; each prompt is computed once and its K/V copied into
   its n slots; each slot samples its own first token from the prompt's last logits.
3. Decode rounds. `sync_every` decode steps run back to back without reading anything back: one token
   per slot for slots [0, bucket(B)), where buckets are a fixed list of batch sizes (rows past B are
   padding: harmless writes into free slots). Each step (forward, sampling, bookkeeping) is one CUDA
   graph per (bucket, sampling mode), captured on first use, replayed afterwards.
4. Harvest. After a round the done flags are read; finished sequences are copied out (trimmed at their
   first stop token or at their token limit) and their slots freed; the last running slots move into the holes
   (K/V rows included), so B shrinks and smaller, cheaper buckets run: finished sequences stop costing
   compute, up to `sync_every - 1` steps of overrun (their extra tokens are dropped).

5. Prefix reuse (`prefix_cache_rows` > 0, for multi-turn trajectories). When a sequence finishes, the K/V of
   its prompt and reply (all but the last token, whose K/V were not computed) are copied from its slot into a
   row of the park, a second cache of that many rows, and indexed by their tokens (prefix_cache.py). A later
   prompt that starts with a parked sequence (the same trajectory's next turn: earlier prompt + reply + tool
   tokens) has that row copied into its slots and computes only the tokens after it. A weight update empties
   the park (its K/V belong to the old weights); when it is full the oldest entry goes; a taken entry is gone.

Deviations from vLLM: no paged KV cache (each slot holds `max_model_len` positions), prefix reuse only from
whole finished sequences (not shared between prompts with a common start), no chunked prefill; admission is by
whole prompts (all n samples together).

Kernels: on CUDA with Triton, the decode step's rotation, K/V write and attention are one kernel, a program per
(sequence, KV head), from 128 such pairs on; below that the rotation and K/V write are one kernel and attention is
split-KV flash-decoding. Sampling is one pass over the logits plus a small draw (triton_kernels.py); the other
pointwise work between matmuls is torch.compile'd (cuda_model.py). Graph capture and replay: cuda_graphs.py;
the slots' state: cuda_slots.py.
Sampling and logprobs: stages/rollout/sampling.py (the convention of base.py). With the same seed,
prompts, weights and engine settings, outputs are identical (graphs are captured with the RNG state and
the slot counters saved and restored); the fused sampler's draws are keyed by a seed drawn from torch's
generator, so CPU and CUDA draw different samples for one seed.
Weights: `update_weights` copies an HF state dict into the engine's own fused weights in place, so the
captured graphs stay valid. On a machine without CUDA the same code runs eagerly (tests use that).
"""

from __future__ import annotations

import logging
import time
from collections import deque

import torch
import torch.distributed as dist

from stages.model.policy import hf_parts
from stages.rollout.base import RolloutOutput, SamplingParams
from stages.rollout.cuda_graphs import DecodeGraphs
from stages.rollout.cuda_model import Decoder
from stages.rollout.cuda_slots import MAX_STOP_TOKENS, Slots, batch_buckets, trim
from stages.rollout.prefix_cache import PrefixIndex
from stages.rollout.sampling import Sampler, SamplingMode

logger = logging.getLogger(__name__)

class CudaRolloutEngine:
    """RolloutEngine (base.py) over a transformers Qwen2/Llama model; fast on CUDA, correct anywhere.

    model: the HF causal LM whose weights are copied (it is not kept). max_model_len bounds prompt +
    response tokens: a sequence that reaches it ends there (finish reason `length`, as in vLLM), so one call may
    mix long prompts with a max_tokens that only the short ones have room for (a multi-turn batch's turns);
    max_num_seqs is the number of concurrent sequences (KV cache rows); prefix_cache_rows is
    the number of finished sequences whose K/V are kept for a continuation (0: off). quantization 'fp8':
    the layers' projections in float8 with per-channel scales, requantised at every `update_weights`
    (fp8.py; Hopper or Ada on CUDA, emulated in float32 on CPU for tests).
    release_memory_on_sleep: `sleep` frees the KV cache and the CUDA graphs (captured again as generation
    meets each batch size after `wake`); None: when the cache and the prefix park take >= `FREE_CACHE_SHARE` of
    the GPU.
    tensor_parallel_group: the ranks that form one engine (cuda_model.py): each calls `generate` with the same
    prompts and parameters and all return the same outputs; without a seed they share the first rank's.
    """

    def __init__(self, model: torch.nn.Module, eos_token_id: int, *, max_num_seqs: int = 256,
                 max_model_len: int = 1024, device: str | torch.device | None = None,
                 dtype: torch.dtype | None = None, attention: str = "auto", use_cuda_graphs: bool | None = None,
                 compile: bool | None = None, sync_every: int = 4, max_prefill_tokens: int = 16384,
                 release_memory_on_sleep: bool | None = False, fused_sampling: bool | None = None,
                 prefix_cache_rows: int = 0, quantization: str | None = None,
                 tensor_parallel_group: dist.ProcessGroup | None = None):
        for name, value in (("max_num_seqs", max_num_seqs), ("max_model_len", max_model_len),
                            ("sync_every", sync_every), ("max_prefill_tokens", max_prefill_tokens)):
            if value < 1:
                raise ValueError(f"{name}={value} must be >= 1")
        if prefix_cache_rows < 0:
            raise ValueError(f"prefix_cache_rows={prefix_cache_rows} must be >= 0 (0: no prefix reuse)")
        param = next(model.parameters())
        self.device = torch.device(device) if device is not None else param.device
        _check_quantization(quantization, self.device)
        self.dtype = dtype or param.dtype
        on_cuda = self.device.type == "cuda"
        half = self.dtype in (torch.bfloat16, torch.float16)
        triton_ok = on_cuda and _has_triton()
        if attention == "auto":
            attention = ("triton" if triton_ok else "flash") if on_cuda and half else "sdpa"
        if fused_sampling is None:
            fused_sampling = triton_ok
        if fused_sampling and not triton_ok:
            raise ValueError("fused_sampling=True needs a CUDA device and triton")
        self.use_cuda_graphs = on_cuda if use_cuda_graphs is None else use_cuda_graphs
        if self.use_cuda_graphs and not on_cuda:
            raise ValueError("use_cuda_graphs=True needs a CUDA device")
        self.eos_token_id = eos_token_id
        self.max_num_seqs, self.max_model_len, self.sync_every = max_num_seqs, max_model_len, sync_every
        self.max_prefill_tokens = max_prefill_tokens
        body, _ = hf_parts(model)
        kv_len = max_model_len + sync_every  # finished sequences may overrun by sync_every - 1 steps
        self.decoder = Decoder(model.config, body.rotary_emb, self.device, self.dtype, max_num_seqs, kv_len,
                               attention, on_cuda if compile is None else compile, fp8=quantization == "fp8",
                               tp_group=tensor_parallel_group)
        self.decoder.weights.load(model.state_dict())
        held = self.decoder.kv_bytes() + self.decoder.kv_bytes(prefix_cache_rows)  # the cache and the prefix park
        self.release_memory_on_sleep = (_large_cache(held, self.device)
                                        if release_memory_on_sleep is None else release_memory_on_sleep)
        self.sampler = Sampler(self.device, on_cuda if compile is None else compile, fused_sampling)
        self.slots = Slots(max_num_seqs, kv_len, self.device)
        self.buckets = batch_buckets(max_num_seqs)
        s = self.slots
        self.graphs = DecodeGraphs(self._decode_step, (s.token, s.pos, s.gen, s.done, self.sampler.seed), self.device)
        self.stats: dict[str, float] = {}
        self.prefix_cache_rows = prefix_cache_rows
        self.prefix = PrefixIndex(prefix_cache_rows, max_model_len) if prefix_cache_rows else None
        self.wake()

    # ---- interface ---------------------------------------------------------------------------------

    def param_count(self) -> int:
        """Parameters this engine holds (this rank's share under tensor parallelism)."""
        return self.decoder.weights.count()

    def _group_seed(self) -> int:
        group = self.decoder.tp_group
        seed = torch.randint(0, 2**31 - 1, (1,), device=self.device)
        dist.broadcast(seed, src=dist.get_global_rank(group, 0), group=group)
        return int(seed.item())

    def update_weights(self, state) -> None:
        """A full HF state dict, or an iterable of (name, tensor) pairs (e.g. streamed layer by layer)."""
        if self.prefix is not None:
            self.prefix.clear()  # parked K/V were computed with the old weights
        self.decoder.weights.load(state)

    def sleep(self) -> None:
        if self.release_memory_on_sleep:
            self.graphs.clear()
            self.decoder.free_cache()
            if self.prefix is not None:
                self.prefix.clear()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def wake(self) -> None:
        if self.decoder.kv is None:
            self.decoder.allocate_cache()
        if self.prefix is not None and self.decoder.park is None:
            self.decoder.allocate_park(self.prefix_cache_rows)

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> list[RolloutOutput]:
        if not prompt_ids:  # as vLLM: a data-parallel share can be empty (fewer live prompts than engines)
            return []
        self._check(prompt_ids, params)
        mode = SamplingMode(greedy=True) if params.greedy else SamplingMode(False, params.top_k, params.top_p)
        self._set_params(params)
        if params.seed is not None:
            torch.manual_seed(params.seed)
        elif self.decoder.tp_group is not None:  # the group's ranks must draw alike: the first rank's seed
            torch.manual_seed(self._group_seed())
        self.sampler.seed.fill_(int(torch.randint(0, 2**31 - 1, (1,)).item()))  # the fused sampler's noise key
        self.stats = {"decode_steps": 0, "row_steps": 0, "padded_row_steps": 0, "prefill_tokens": 0,
                      "reused_tokens": 0, "prefill_s": 0.0, "capture_s": 0.0, "harvest_s": 0.0}
        self._prompt_ids = prompt_ids
        waiting = deque(range(len(prompt_ids)))
        self._active, self._host_pos = [], []  # per slot in [0, B): sequence id, next position
        self.slots.reset_from(0)
        results: dict[int, RolloutOutput] = {}
        while True:
            self._admit(waiting, prompt_ids, params.n, mode)
            if not self._active:
                break
            self._decode_round(mode)
            self._harvest(results, params)
        return [results[i] for i in range(len(prompt_ids) * params.n)]

    # ---- scheduling ------------------------------------------------------------------------------------

    def _check(self, prompt_ids: list[list[int]], params: SamplingParams) -> None:
        if any(len(p) == 0 for p in prompt_ids):
            raise ValueError("every prompt needs at least one token")
        longest = max(len(p) for p in prompt_ids)
        if longest >= self.max_model_len:
            raise ValueError(f"a prompt of {longest} tokens leaves no room to generate within the engine's "
                             f"max_model_len={self.max_model_len}; raise max_model_len or shorten the prompts")
        if params.n > self.max_num_seqs:
            raise ValueError(f"n={params.n} exceeds the engine's max_num_seqs={self.max_num_seqs}")
        if params.max_tokens < 1 or len(params.stop_token_ids) > MAX_STOP_TOKENS:
            raise ValueError(f"max_tokens={params.max_tokens} must be >= 1 and at most {MAX_STOP_TOKENS} stop "
                             f"tokens may be given (got {len(params.stop_token_ids)})")

    def _set_params(self, params: SamplingParams) -> None:
        stops = list(params.stop_token_ids) or [self.eos_token_id]
        self.slots.stop_ids.fill_(-1)
        self.slots.stop_ids[: len(stops)] = torch.tensor(stops)
        self._max_tokens = params.max_tokens
        self.sampler.set_temperature(params.logprob_temperature)
        self._stops = set(stops)

    def _admit(self, waiting: deque, prompt_ids: list[list[int]], n: int, mode: SamplingMode) -> None:
        """Prefill waiting prompts into free slots, once a batch of them (a quarter of the slots) fits."""
        capacity = (self.max_num_seqs - len(self._active)) // n
        batch = min(len(waiting), max(1, self.max_num_seqs // (4 * n)))
        if capacity == 0 or not waiting or (self._active and capacity < batch):
            return
        take = [waiting.popleft() for _ in range(min(capacity, len(waiting)))]
        parked = {}  # prompt index -> (park row, tokens reused)
        if self.prefix is not None:
            parked = {i: hit for i in take if (hit := self.prefix.take(prompt_ids[i])) is not None}
        chunk, tokens = [], 0
        for index in take:
            cost = len(prompt_ids[index]) - parked.get(index, (0, 0))[1]
            if chunk and tokens + cost > self.max_prefill_tokens:
                self._prefill(chunk, prompt_ids, n, mode, parked)
                chunk, tokens = [], 0
            chunk.append(index)
            tokens += cost
        self._prefill(chunk, prompt_ids, n, mode, parked)

    def _prefill(self, indices: list[int], prompt_ids: list[list[int]], n: int, mode: SamplingMode,
                 parked: dict[int, tuple[int, int]]) -> None:
        """Compute the prompts (from their parked length on, for those with a parked prefix) into n slots each."""
        start_time = time.perf_counter()
        dev, start = self.device, len(self._active)
        reused = torch.tensor([parked.get(i, (0, 0))[1] for i in indices])
        full = torch.tensor([len(prompt_ids[i]) for i in indices])
        lengths = full - reused  # tokens computed per prompt
        cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0))
        sample_lengths = lengths.repeat_interleave(n)  # (m*n,)
        slots = start + torch.arange(len(indices) * n)
        total = int(sample_lengths.sum())
        offsets = torch.arange(total) - (sample_lengths.cumsum(0) - sample_lengths).repeat_interleave(sample_lengths)
        src = cu[:-1].repeat_interleave(n).repeat_interleave(sample_lengths) + offsets
        ids = torch.tensor([t for i, r in zip(indices, reused.tolist()) for t in prompt_ids[i][r:]])
        positions = torch.cat([torch.arange(r, f) for r, f in zip(reused.tolist(), full.tolist())])
        dst_pos = offsets + reused.repeat_interleave(n).repeat_interleave(sample_lengths)
        context = self._unpark(indices, parked, slots, n, full) if int(reused.max()) > 0 else None
        logits = self.decoder.prefill(
            ids.to(dev), positions.to(dev), cu.to(dev, torch.int32), int(lengths.max()),
            slots.repeat_interleave(sample_lengths).to(dev), dst_pos.to(dev), src.to(dev), (cu[1:] - 1).to(dev),
            context,
        )
        tokens, logprobs = self.sampler.sample(logits.repeat_interleave(n, dim=0), mode)
        rows, s = slots.to(dev), self.slots
        s.pos[rows] = full.repeat_interleave(n).to(dev)
        s.gen[rows] = 0
        s.limit[rows] = (self.max_model_len - full).clamp(max=self._max_tokens).repeat_interleave(n).to(dev)
        s.done[rows] = False
        self._record(rows, tokens, logprobs, advance=False)
        self._active += [i * n + k for i in indices for k in range(n)]
        self._host_pos += full.repeat_interleave(n).tolist()
        self.stats["prefill_tokens"] += int(lengths.sum())
        self.stats["reused_tokens"] += int(reused.sum())
        self.stats["prefill_s"] += time.perf_counter() - start_time

    def _unpark(self, indices: list[int], parked: dict[int, tuple[int, int]], slots: torch.Tensor, n: int,
                full: torch.Tensor) -> tuple:
        """Copy the parked prefixes into their prompts' slots; -> the prefill's attention context."""
        hits = [(k, parked[i]) for k, i in enumerate(indices) if i in parked]
        dst = torch.tensor([int(slots[k * n + j]) for k, _ in hits for j in range(n)], device=self.device)
        src = torch.tensor([row for _, (row, _) in hits for _ in range(n)], device=self.device)
        self.decoder.unpark_kv(src, dst, max(length for _, (_, length) in hits))
        read_slot = slots[::n].to(self.device)
        return read_slot, full.to(self.device, torch.int32), int(full.max())

    def _record(self, rows: torch.Tensor, tokens: torch.Tensor, logprobs: torch.Tensor, advance: bool) -> None:
        """Append each row's new token (and its logprob); mark rows that hit a stop token or their limit."""
        s = self.slots
        gen = s.gen[rows]
        s.out_tokens.index_put_((rows, gen), tokens)
        s.out_logprobs.index_put_((rows, gen), logprobs.float())
        gen = gen + 1
        s.gen[rows] = gen
        stop = (tokens[:, None] == s.stop_ids[None, :]).any(-1) | (gen >= s.limit[rows])
        s.done[rows] = s.done[rows] | stop
        if advance:
            s.pos[rows] = s.pos[rows] + 1
        s.token[rows] = tokens

    def _decode_round(self, mode: SamplingMode) -> None:
        b = len(self._active)
        bucket = next(x for x in self.buckets if x >= b)
        kv_len = self.decoder.max_len
        if self.decoder.attention == "sdpa":  # read only the cache prefix this round can touch
            kv_len = min(kv_len, -(-(max(self._host_pos) + self.sync_every) // 128) * 128)
        for _ in range(self.sync_every):
            if self.use_cuda_graphs:
                graph, capture_s = self.graphs.get(bucket, kv_len, mode)
                self.stats["capture_s"] += capture_s
                graph.replay()
            else:
                self._decode_step(bucket, kv_len, mode)
        self._host_pos = [p + self.sync_every for p in self._host_pos]
        self.stats["decode_steps"] += self.sync_every
        self.stats["row_steps"] += b * self.sync_every
        self.stats["padded_row_steps"] += bucket * self.sync_every

    def _decode_step(self, bucket: int, kv_len: int, mode: SamplingMode) -> None:
        s = self.slots
        logits = self.decoder.decode(s.token[:bucket], s.pos[:bucket], kv_len)
        tokens, logprobs = self.sampler.sample(logits, mode)
        self._record(s.rows[:bucket], tokens, logprobs, advance=True)

    def _harvest(self, results: dict[int, RolloutOutput], params: SamplingParams) -> None:
        b, s = len(self._active), self.slots
        done = s.done[:b].nonzero()[:, 0].tolist()  # the round's only read-back (waits for the round)
        start = time.perf_counter()
        if not done:
            return
        rows = torch.tensor(done, device=self.device)
        tokens = s.out_tokens[rows, : params.max_tokens].tolist()
        logprobs = s.out_logprobs[rows, : params.max_tokens].tolist()
        for slot, toks, lps, limit in zip(done, tokens, logprobs, s.limit[rows].tolist()):
            seq = self._active[slot]
            results[seq] = trim(toks[:limit], lps[:limit], self._stops, seq // params.n)
        if self.prefix is not None:
            self._park(done, results, params.n)
        self._compact(done)
        self.stats["harvest_s"] += time.perf_counter() - start  # host time while the device waits

    def _park(self, done: list[int], results: dict[int, RolloutOutput], n: int) -> None:
        """Keep the finished slots' K/V (prompt + reply but its last token) in the park, indexed by their tokens."""
        row_slot, longest = {}, 0  # a row given twice (evicted within this harvest) keeps its last sequence
        for slot in done:
            seq = self._active[slot]
            tokens = self._prompt_ids[seq // n] + results[seq].response_ids[:-1]
            row_slot[self.prefix.add(tokens)] = slot
            longest = max(longest, len(tokens))
        rows, slots = (torch.tensor(x, device=self.device) for x in zip(*row_slot.items()))
        self.decoder.park_kv(slots, rows, longest)

    def _compact(self, done: list[int]) -> None:
        """Move the last running slots into the finished ones' places: running slots stay [0, B')."""
        finished = set(done)
        keep = [i for i in range(len(self._active)) if i not in finished]
        b = len(keep)
        holes = [i for i in done if i < b]
        movers = [i for i in keep if i >= b]
        if movers:
            dst, src = torch.tensor(holes, device=self.device), torch.tensor(movers, device=self.device)
            for t in self.slots.rows_state():
                t[dst] = t[src]
            upto = max(self._host_pos[i] for i in movers)
            kv = self.decoder.kv
            kv[:, :, dst, :upto] = kv[:, :, src, :upto]
            for h, m in zip(holes, movers):
                self._active[h], self._host_pos[h] = self._active[m], self._host_pos[m]
        del self._active[b:], self._host_pos[b:]
        self.slots.reset_from(b)


FREE_CACHE_SHARE = 0.2  # release_memory_on_sleep=None frees caches at least this share of the GPU's memory


def _large_cache(kv_bytes: int, device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    large = kv_bytes >= FREE_CACHE_SHARE * torch.cuda.get_device_properties(device).total_memory
    logger.info("cuda engine: KV cache and prefix park %.1f GiB: %s them while the trainer works", kv_bytes / 2**30,
                "freeing" if large else "keeping")
    return large


def _check_quantization(quantization: str | None, device: torch.device) -> None:
    if quantization not in (None, "fp8"):
        raise ValueError(f"quantization={quantization!r}: use None or 'fp8'")
    if quantization and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise ValueError(f"quantization='fp8' needs float8 matmuls (compute capability 8.9+: Ada, Hopper); this GPU "
                         f"is {torch.cuda.get_device_name(device)}: leave rl.rollout.quantization unset")


def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
