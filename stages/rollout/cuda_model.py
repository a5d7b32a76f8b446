"""A plain-torch decoder for generation: fused weights, a static KV cache, prefill and one decode step.

The rollout engine (cuda_engine.py) drives this module; it holds no scheduling state. It implements the
Qwen2 / Qwen3 / Llama 2-3 decoder (RMSNorm, Qwen3's per-head q/k norms, rotary embeddings from the model's own
rotary module, so Llama 3's rope scaling too, grouped-query attention, SwiGLU MLP) on weights copied from a
transformers model, with the same operation order as transformers so that greedy outputs match:

- weights: per layer one fused qkv projection and one fused gate/up projection; `load` copies HF-named
  tensors into them in place, so captured CUDA graphs stay valid across weight syncs; with `fp8` the four
  projections of every layer are quantised after each load (float8 e4m3, one scale per output channel,
  in place) and their bf16 copies emptied until the next load; activations are quantised per token as they
  come (fp8.py `linear`); embeddings, norms and the head stay in the engine's dtype;
- tensor parallelism (a process group of ranks that run the same prompts in lockstep): each rank keeps its
  share of the heads and of the MLP's width (DecoderWeights), and the o and down projections' partial outputs
  are summed across the group (one all-reduce each per layer), so every rank holds the same residual stream,
  logits and, with the same seed, tokens;
- KV cache: (layers, 2, slots, max_len, kv_heads, head_dim), a sequence's tokens at positions 0.. of
  its slot; the engine moves slots around (compaction), this module only reads and writes them;
- prefill: prompts packed without padding (position ids per prompt), causal attention within each
  prompt (stages/model/packing.py `packed_attention`), K/V written into each of the prompt's `n` slots;
  a continued prompt (its first tokens' K/V already copied into its slots from the park) computes only its
  remaining tokens, which attend to the slot's cache;
- park: (layers, 2, rows, max_len, kv_heads, head_dim), K/V of finished sequences kept between engine calls
  (the engine's prefix reuse for multi-turn trajectories); `park_kv` / `unpark_kv` copy slots to rows and back;
- decode: one token per slot for slots [0, B); attention reads each slot's first pos+1 cache entries:
  `triton` (CUDA: triton_kernels.py `decode_step_attention`, which also rotates q and k and writes the new
  K/V: one program per (slot, kv head) at large batch, split-KV flash-decoding at small; the default there),
  `flash` (CUDA: the flash kernel's varlen path with per-slot lengths; one program per sequence and kv
  head, no splits, so it is latency-bound at decode) or `sdpa` (any device: masked attention over the first
  `kv_len` entries, a bucket of the engine's).

Pointwise work between matmuls (norms, rotary, SwiGLU, residual adds) is in small functions that the
engine may `torch.compile`, with the matmuls called between them (see `attn_inputs`); the token dimension
becomes dynamic after the second size seen, so a couple of compilations serve every batch size.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F

from stages.model.packing import packed_attention
from stages.rollout.cuda_weights import DecoderShape, DecoderWeights
from stages.rollout.fp8 import linear

# ---- pointwise pieces (compiled on CUDA; same operation order as transformers) -------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def attn_inputs(h, delta, norm_w, qkv_w, qkv_b, eps: float):
    """The residual stream h + delta (delta: the previous layer's MLP output, None for the first layer) and its
    qkv projection (N, (heads + 2 kv_heads) D).

    A residual add stays out of the function that makes its matmul: inductor would otherwise fold it into the
    matmul (addmm), whose extra copy of h cost two device copies a layer in the decode step."""
    if delta is not None:
        h = h + delta
    return h, linear(rms_norm(h, norm_w, eps), qkv_w, qkv_b)


def rotate(qkv, q_norm_w, k_norm_w, cos, sin, eps: float, num_heads: int, num_kv_heads: int):
    """qkv (N, (heads + 2 kv_heads) D) -> rotated q (N, heads, D), rotated k and v (N, kv_heads, D); q and k normed
    per head first when the model has q/k norms (Qwen3)."""
    d = cos.shape[-1]
    q, k, v = qkv.split([num_heads * d, num_kv_heads * d, num_kv_heads * d], dim=-1)
    q, k = q.view(-1, num_heads, d), k.view(-1, num_kv_heads, d)
    if q_norm_w is not None:
        q, k = rms_norm(q, q_norm_w, eps), rms_norm(k, k_norm_w, eps)
    cos, sin = cos[:, None, :], sin[:, None, :]  # (N, 1, D)
    return _rotate(q, cos, sin), _rotate(k, cos, sin), v.reshape(-1, num_kv_heads, d)


def mlp(h, attn_out, norm_w, gate_up_w, down_w, eps: float):
    """(residual stream h + attn_out, the SwiGLU MLP's output on it): both (N, H)."""
    h = h + attn_out
    gate, up = linear(rms_norm(h, norm_w, eps), gate_up_w).chunk(2, dim=-1)
    return h, linear(F.silu(gate) * up, down_w)


def final_norm(h, delta, norm_w, eps: float):
    return rms_norm(h + delta, norm_w, eps)


class Decoder:
    """Forward passes of the decoder over the engine's slots. Not an nn.Module: it trains nothing."""

    def __init__(self, config, rotary: torch.nn.Module, device: torch.device, dtype: torch.dtype, max_slots: int,
                 max_len: int, attention: str, compile: bool, fp8: bool = False,
                 tp_group: dist.ProcessGroup | None = None):
        full = DecoderShape.from_config(config)
        self.tp_group = tp_group  # tensor parallel: this rank computes its share of heads and MLP width
        rank, size = (dist.get_rank(tp_group), dist.get_world_size(tp_group)) if tp_group is not None else (0, 1)
        self.shape = full.sharded(size)
        if attention not in ("triton", "flash", "sdpa"):
            raise ValueError(f"attention={attention!r}: use 'triton' or 'flash' (CUDA) or 'sdpa'")
        if attention == "flash" and (device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16)):
            raise ValueError("attention='flash' needs a CUDA device and bfloat16/float16 weights; use 'sdpa'")
        if attention == "triton":
            from stages.rollout.triton_kernels import decode_step_attention

            self._triton_attention = decode_step_attention
        self.device, self.dtype, self.attention = device, dtype, attention
        self.max_slots, self.max_len = max_slots, max_len
        self.weights = DecoderWeights(self.shape, device, dtype, fp8, full, rank)
        self.scale = self.shape.head_dim ** -0.5
        with torch.no_grad():
            positions = torch.arange(max_len, device=device)[None]
            rotary = copy.deepcopy(rotary).to(device)  # the caller's model stays where it is
            cos, sin = rotary(torch.empty(0, device=device, dtype=dtype), positions)
        self.cos, self.sin = cos[0].contiguous(), sin[0].contiguous()  # (max_len, D) in dtype
        self.kv: torch.Tensor | None = None
        self.park: torch.Tensor | None = None
        # automatic dynamic shapes: a second token count recompiles once with that dimension symbolic
        wrap = (lambda f: torch.compile(f, fullgraph=True)) if compile else (lambda f: f)
        self._attn_inputs = wrap(attn_inputs)
        self._rotate = wrap(rotate)
        self._o_proj = wrap(linear) if fp8 else linear  # fp8: the activations' quantisation, compiled
        self._mlp = wrap(mlp)
        self._final_norm = wrap(final_norm)
        self._cu_q = torch.arange(max_slots + 1, device=device, dtype=torch.int32)  # one query per slot
        self._cu_k = self._cu_q * max_len  # each slot's cache region in the flattened cache
        self._cu_grouped = self._cu_q * (self.shape.num_heads // self.shape.num_kv_heads)

    def allocate_cache(self) -> None:
        s = self.shape
        self.kv = torch.zeros(s.num_layers, 2, self.max_slots, self.max_len, s.num_kv_heads, s.head_dim,
                              device=self.device, dtype=self.dtype)

    def free_cache(self) -> None:
        self.kv = self.park = None

    def allocate_park(self, rows: int) -> None:
        s = self.shape
        self.park = torch.zeros(s.num_layers, 2, rows, self.max_len, s.num_kv_heads, s.head_dim,
                                device=self.device, dtype=self.dtype)

    def park_kv(self, slots: torch.Tensor, rows: torch.Tensor, length: int) -> None:
        """Copy the first `length` positions of each slot into its park row (slots[i] -> rows[i])."""
        self.park[:, :, rows, :length] = self.kv[:, :, slots, :length]

    def unpark_kv(self, rows: torch.Tensor, slots: torch.Tensor, length: int) -> None:
        self.kv[:, :, slots, :length] = self.park[:, :, rows, :length]

    def kv_bytes(self, rows: int | None = None) -> int:
        """Bytes of the K/V cache (`rows`: of that many rows, the park's for instance; default the slots')."""
        s, rows = self.shape, self.max_slots if rows is None else rows
        return s.num_layers * 2 * rows * self.max_len * s.kv_size * self.weights.embed.element_size()

    def _logits(self, h: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        return F.linear(self._final_norm(h, delta, self.weights.final_norm, self.shape.eps), self.weights.lm_head)

    def _layer(self, i: int, h, delta, attend) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i on the residual stream h + delta -> (its residual stream, its MLP output): the add is done by
        the next layer's first kernel. attend(i, qkv) -> attention output (N, heads, D)."""
        w, s = self.weights, self.shape
        qkv_w, o_w, gate_up, down = w.projections(i)
        h, qkv = self._attn_inputs(h, delta, w.in_norm[i], qkv_w, w.qkv_b[i], s.eps)
        attn = self._reduce(self._o_proj(attend(i, qkv).reshape(-1, s.q_size), o_w, w.o_b[i]))
        h, delta = self._mlp(h, attn, w.post_norm[i], gate_up, down, s.eps)
        return h, self._reduce(delta)

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Tensor parallel: the sum of the ranks' partial o / down projections (each holds a share of the heads
        and of the MLP's width), in place; every rank then holds the same residual stream."""
        if self.tp_group is not None:
            dist.all_reduce(x, group=self.tp_group)
        return x

    def _layers(self, ids: torch.Tensor, attend) -> tuple[torch.Tensor, torch.Tensor]:
        h, delta = F.embedding(ids, self.weights.embed), None
        for i in range(self.shape.num_layers):
            h, delta = self._layer(i, h, delta, attend)
        return h, delta

    def _rotated(self, i: int, qkv, cos, sin):
        w, s = self.weights, self.shape
        return self._rotate(qkv, w.q_norm[i], w.k_norm[i], cos, sin, s.eps, s.num_heads, s.num_kv_heads)

    @torch.no_grad()
    def prefill(self, ids, positions, cu_seqlens, max_seqlen: int, dst_slot, dst_pos, src_token, last_token,
                context: tuple | None = None):
        """Packed prompts -> logits at each prompt's last token (P, V); K/V copied to every target slot.

        ids, positions: (N,) packed prompt tokens; cu_seqlens: (P+1,) int32; dst_slot, dst_pos, src_token:
        (N*n,) where each packed token's K/V go; last_token: (P,) index of each prompt's last token.
        context: None when every prompt is packed whole; else (read_slot (P,), kv_len (P,) int32, max_kv_len):
        the packed tokens are the ends of prompts whose K/V start in slot read_slot[p] (their earlier positions
        already there), and attend to its first kv_len[p] positions, causally (the queries are the last ones).
        """

        cos, sin = self.cos[positions], self.sin[positions]

        def attend(i, qkv):
            q, k, v = self._rotated(i, qkv, cos, sin)
            self.kv[i, 0].index_put_((dst_slot, dst_pos), k[src_token])
            self.kv[i, 1].index_put_((dst_slot, dst_pos), v[src_token])
            if context is None:
                return packed_attention(q, k, v, cu_seqlens, max_seqlen, self.scale)
            return self._cached_attention(i, q, cu_seqlens, max_seqlen, *context)

        h, delta = self._layers(ids, attend)
        return self._logits(h[last_token], delta[last_token])

    def _cached_attention(self, i, q, cu_q, max_q: int, read_slot, kv_len, max_kv: int) -> torch.Tensor:
        """Queries (the last tokens of each prompt) over their slot's cache: flash varlen on CUDA, sdpa else."""
        s = self.shape
        if self.attention != "sdpa":
            cu_k = torch.cat([read_slot, read_slot[-1:] + 1]).to(torch.int32) * self.max_len
            keys = self.kv[i, 0].view(-1, s.num_kv_heads, s.head_dim)  # every slot's region, end to end
            values = self.kv[i, 1].view(-1, s.num_kv_heads, s.head_dim)
            return torch.ops.aten._flash_attention_forward(
                q, keys, values, cu_q, cu_k, max_q, max_kv, 0.0, True, False, scale=self.scale, seqused_k=kv_len,
            )[0]
        groups = s.num_heads // s.num_kv_heads
        outs = []
        for start, end, slot, total in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), read_slot.tolist(),
                                           kv_len.tolist()):
            keys = self.kv[i, 0, slot, :total].transpose(0, 1).repeat_interleave(groups, 0)  # (H, total, D)
            values = self.kv[i, 1, slot, :total].transpose(0, 1).repeat_interleave(groups, 0)
            query_pos = torch.arange(total - (end - start), total, device=q.device)
            mask = torch.arange(total, device=q.device)[None, :] <= query_pos[:, None]
            out = F.scaled_dot_product_attention(q[start:end].transpose(0, 1), keys, values, attn_mask=mask,
                                                 scale=self.scale)
            outs.append(out.transpose(0, 1))
        return torch.cat(outs)

    @torch.no_grad()
    def decode(self, ids: torch.Tensor, positions: torch.Tensor, kv_len: int) -> torch.Tensor:
        """One token for each of the slots [0, B): ids, positions (B,) -> logits (B, V).

        The token's K/V are written at its position; attention covers positions 0..position of the slot.
        `kv_len` (sdpa only) bounds the cache entries read: every position must be below it.
        """
        b = ids.shape[0]
        rows = self._cu_q[:b].long()
        if self.attention == "triton":
            used = (positions + 1).to(torch.int32)
            attend = lambda i, qkv: self._triton_decode(i, qkv, positions, used)  # noqa: E731
        else:
            cos, sin = self.cos[positions], self.sin[positions]
            if self.attention == "flash":
                used = (positions + 1).to(torch.int32)
                decode = lambda i, q, k, v: self._flash_decode(i, q, k, v, rows, positions, used)  # noqa: E731
            else:
                valid = torch.arange(kv_len, device=ids.device)[None, :] <= positions[:, None]  # (B, T)
                decode = lambda i, q, k, v: self._sdpa_decode(i, q, k, v, rows, positions, valid)  # noqa: E731
            attend = lambda i, qkv: decode(i, *self._rotated(i, qkv, cos, sin))  # noqa: E731
        return self._logits(*self._layers(ids, attend))

    def _write(self, i, k, v, rows, positions) -> None:
        self.kv[i, 0].index_put_((rows, positions), k)
        self.kv[i, 1].index_put_((rows, positions), v)

    def _triton_decode(self, i, qkv, positions, used):
        """Rotation (and Qwen3's q/k norms), the K/V write and attention (triton_kernels.decode_step_attention)."""
        w, s = self.weights, self.shape
        return self._triton_attention(qkv, self.cos, self.sin, positions, used, s.num_heads, self.kv[i, 0],
                                      self.kv[i, 1], self.scale, w.q_norm[i], w.k_norm[i], s.eps)

    def _flash_decode(self, i, q, k, v, rows, positions, used):
        """The `groups` query heads of a kv head are run as a 7-token query "sequence" of that kv head (no
        causal mask: all of them sit at the last position), so each CTA reads a kv head's cache once."""
        self._write(i, k, v, rows, positions)
        b, s = q.shape[0], self.shape
        groups = s.num_heads // s.num_kv_heads
        queries = q.view(b, s.num_kv_heads, groups, s.head_dim).transpose(1, 2).reshape(b * groups, s.num_kv_heads,
                                                                                       s.head_dim)
        keys = self.kv[i, 0, :b].view(b * self.max_len, s.num_kv_heads, s.head_dim)
        values = self.kv[i, 1, :b].view(b * self.max_len, s.num_kv_heads, s.head_dim)
        out = torch.ops.aten._flash_attention_forward(
            queries, keys, values, self._cu_grouped[: b + 1], self._cu_k[: b + 1], groups, self.max_len, 0.0,
            False, False, scale=self.scale, seqused_k=used,
        )[0]  # (B * groups, kv_heads, D)
        return out.view(b, groups, s.num_kv_heads, s.head_dim).transpose(1, 2).reshape(b, s.num_heads, s.head_dim)

    def _sdpa_decode(self, i, q, k, v, rows, positions, valid):
        self._write(i, k, v, rows, positions)
        b, t, s = q.shape[0], valid.shape[1], self.shape
        groups = s.num_heads // s.num_kv_heads
        keys = self.kv[i, 0, :b, :t].transpose(1, 2)  # (B, kv_heads, T, D)
        values = self.kv[i, 1, :b, :t].transpose(1, 2)
        queries = q.view(b, s.num_kv_heads, groups, s.head_dim)  # head h uses kv head h // groups
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=valid[:, None, None, :],
                                             scale=self.scale)
        return out.reshape(b, s.num_heads, s.head_dim)
