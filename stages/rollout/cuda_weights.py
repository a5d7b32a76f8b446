"""The cuda decoder's shape and weights: which HF models it can run (`unsupported`), the shape of a model and of
one tensor-parallel rank's share (`DecoderShape`), and the fused weights that weight syncs copy into in place
(`DecoderWeights`: per layer one qkv and one gate/up tensor; fp8 copies of the four projections when asked).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from stages.rollout.fp8 import FP8, quantise_rows

PROJECTIONS = ("qkv_w", "o_w", "gate_up", "down")  # the matmul weights `fp8` quantises

TP_FIELD = "rl.rollout.tensor_model_parallel_size"
SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama")  # llama: Llama 2 and 3 (rope scaling comes from HF's rotary)


def unsupported(config) -> str | None:
    """Why the decoder below cannot compute this HF config's model exactly, or None when it can."""
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        return f"model_type={config.model_type!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
    if getattr(config, "hidden_act", "silu") != "silu" or getattr(config, "mlp_bias", False):
        return "an MLP other than silu without bias"
    if getattr(config, "use_sliding_window", False):
        return "sliding-window attention"
    return None


@dataclass(frozen=True)
class DecoderShape:
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    eps: float
    qkv_bias: bool
    o_bias: bool
    tied: bool
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before the rotation

    @classmethod
    def from_config(cls, config) -> DecoderShape:
        problem = unsupported(config)
        if problem:
            raise ValueError(f"the cuda rollout engine cannot run this model: {problem}; use rl.rollout.engine=hf "
                             "or vllm")
        heads = config.num_attention_heads
        attention_bias = bool(getattr(config, "attention_bias", False))
        qkv_bias = config.model_type == "qwen2" or attention_bias
        return cls(
            num_layers=config.num_hidden_layers, hidden=config.hidden_size, num_heads=heads,
            num_kv_heads=config.num_key_value_heads or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            intermediate=config.intermediate_size, vocab=config.vocab_size, eps=config.rms_norm_eps,
            qkv_bias=qkv_bias, o_bias=config.model_type in ("llama", "qwen3") and attention_bias,
            tied=bool(config.tie_word_embeddings), qk_norm=config.model_type == "qwen3",
        )

    def sharded(self, size: int) -> DecoderShape:
        """One rank's share under tensor parallelism over `size` ranks: its heads, kv heads (one, shared by
        several ranks, when there are fewer kv heads than ranks) and share of the MLP's width."""
        if size == 1:
            return self
        problems = [f"{name}={value}" for name, value, ok in (
            ("num_attention_heads", self.num_heads, self.num_heads % size == 0),
            ("num_key_value_heads", self.num_kv_heads, self.num_kv_heads % size == 0 or size % self.num_kv_heads == 0),
            ("intermediate_size", self.intermediate, self.intermediate % size == 0)) if not ok]
        if problems:
            raise ValueError(f"{TP_FIELD}={size} must divide the model's {', '.join(problems)} (or, for kv heads, be "
                             "a multiple of them): choose another size")
        return replace(self, num_heads=self.num_heads // size, num_kv_heads=max(1, self.num_kv_heads // size),
                       intermediate=self.intermediate // size)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


class DecoderWeights:
    """The decoder's weights in one dtype on one device; `load` fills them from HF-named tensors in place.

    Tensor parallel rank `rank` of `size` (Megatron's split): `shape` is its share (DecoderShape.sharded of `full`);
    it keeps its heads' rows of q, k, v (and biases) and columns of o, its rows of gate and up and columns of
    down; embeddings, norms and the head whole; o's bias on rank 0 only (the ranks' o outputs are summed)."""

    def __init__(self, shape: DecoderShape, device: torch.device, dtype: torch.dtype, fp8: bool = False,
                 full: DecoderShape | None = None, rank: int = 0):
        s, kw = shape, {"device": device, "dtype": dtype}
        self.full, self.rank = full or shape, rank
        qkv = s.q_size + 2 * s.kv_size
        self.embed = torch.empty(s.vocab, s.hidden, **kw)
        self.lm_head = self.embed if s.tied else torch.empty(s.vocab, s.hidden, **kw)
        self.final_norm = torch.empty(s.hidden, **kw)
        # one tensor per layer and role (not slices of a stacked tensor): compiled code sees equal layouts
        layers = range(s.num_layers)
        self.in_norm = [torch.empty(s.hidden, **kw) for _ in layers]
        self.qkv_w = [torch.empty(qkv, s.hidden, **kw) for _ in layers]
        self.qkv_b = [torch.empty(qkv, **kw) for _ in layers] if s.qkv_bias else [None] * s.num_layers
        self.o_w = [torch.empty(s.hidden, s.q_size, **kw) for _ in layers]
        self.o_b = [torch.empty(s.hidden, **kw) for _ in layers] if s.o_bias and rank == 0 else [None] * s.num_layers
        self.post_norm = [torch.empty(s.hidden, **kw) for _ in layers]
        none = [None] * s.num_layers
        self.q_norm = [torch.empty(s.head_dim, **kw) for _ in layers] if s.qk_norm else none
        self.k_norm = [torch.empty(s.head_dim, **kw) for _ in layers] if s.qk_norm else none
        self.gate_up = [torch.empty(2 * s.intermediate, s.hidden, **kw) for _ in layers]
        self.down = [torch.empty(s.hidden, s.intermediate, **kw) for _ in layers]
        self.shape = shape
        # fp8: per projection and layer (weight (O, K) float8, scales (O,) float32), refilled in place by `load`
        self.fp8 = {name: [(torch.empty(w.shape, device=device, dtype=FP8),
                            torch.empty(w.shape[0], device=device, dtype=torch.float32)) for w in getattr(self, name)]
                    for name in PROJECTIONS} if fp8 else None

    def projections(self, i: int) -> tuple:
        """Layer i's qkv, o, gate/up and down weights as fp8.py `linear` takes them."""
        if self.fp8 is not None:
            return tuple(self.fp8[name][i] for name in PROJECTIONS)
        return self.qkv_w[i], self.o_w[i], self.gate_up[i], self.down[i]

    def targets(self) -> dict[str, tuple | None]:
        """HF parameter name -> (the view of our weights it is copied into, the dimension of which this rank keeps
        a slice (None: all of it), the slice's start, that dimension's full size); None: another rank's."""
        s, f = self.shape, self.full
        d, q, k = s.head_dim, s.q_size, s.q_size + s.kv_size
        q0, i0 = self.rank * q, self.rank * s.intermediate
        kv0 = self.rank * f.num_kv_heads // (f.num_heads // s.num_heads) * d  # a shared kv head: its first rank's
        whole = lambda t: (t, None, 0, None)  # noqa: E731
        out = {"model.embed_tokens.weight": whole(self.embed), "model.norm.weight": whole(self.final_norm),
               "lm_head.weight": whole(self.lm_head)}
        for i in range(s.num_layers):
            p = f"model.layers.{i}."
            out |= {
                p + "input_layernorm.weight": whole(self.in_norm[i]),
                p + "post_attention_layernorm.weight": whole(self.post_norm[i]),
                p + "self_attn.q_proj.weight": (self.qkv_w[i][:q], 0, q0, f.q_size),
                p + "self_attn.k_proj.weight": (self.qkv_w[i][q:k], 0, kv0, f.kv_size),
                p + "self_attn.v_proj.weight": (self.qkv_w[i][k:], 0, kv0, f.kv_size),
                p + "self_attn.o_proj.weight": (self.o_w[i], 1, q0, f.q_size),
                p + "mlp.gate_proj.weight": (self.gate_up[i][: s.intermediate], 0, i0, f.intermediate),
                p + "mlp.up_proj.weight": (self.gate_up[i][s.intermediate :], 0, i0, f.intermediate),
                p + "mlp.down_proj.weight": (self.down[i], 1, i0, f.intermediate),
            }
            if s.qk_norm:
                out |= {p + "self_attn.q_norm.weight": whole(self.q_norm[i]),
                        p + "self_attn.k_norm.weight": whole(self.k_norm[i])}
            if s.qkv_bias:
                b = self.qkv_b[i]
                out |= {p + "self_attn.q_proj.bias": (b[:q], 0, q0, f.q_size),
                        p + "self_attn.k_proj.bias": (b[q:k], 0, kv0, f.kv_size),
                        p + "self_attn.v_proj.bias": (b[k:], 0, kv0, f.kv_size)}
            if s.o_bias:
                out[p + "self_attn.o_proj.bias"] = whole(self.o_b[i]) if self.rank == 0 else None
        return out

    @torch.no_grad()
    def load(self, state) -> None:
        """Copy HF-named tensors in (any device/dtype): a dict, or (name, tensor) pairs streamed one layer at a
        time (stages/model/fsdp.py `iter_hf_weights`); under tensor parallelism each rank takes its slice of the
        full tensors. Every weight must come; unknown names are an error."""
        if self.fp8 is not None:
            self._staging(allocated=True)
        targets = self.targets()
        seen: set[str] = set()
        for name, value in state.items() if isinstance(state, dict) else state:
            if name not in targets:
                raise ValueError(f"weight sync: unexpected parameter {name!r}; pass plain HF names (LoRA merged, "
                                 "no wrapper prefixes)")
            seen.add(name)
            if targets[name] is None:
                continue
            dst, dim, start, full = targets[name]
            expected = tuple(full if j == dim else n for j, n in enumerate(dst.shape))
            if tuple(value.shape) != expected:
                raise ValueError(f"weight sync: {name} has shape {tuple(value.shape)}, expected {expected}")
            dst.copy_(value if dim is None else value.narrow(dim, start, dst.shape[dim]), non_blocking=True)
        optional = {"lm_head.weight"} if self.shape.tied else set()
        missing = sorted(set(targets) - seen - optional)
        if missing:
            raise ValueError(f"weight sync: {len(missing)} parameters missing, e.g. {missing[:3]}; pass the full "
                             "state dict (the engine's weights are now partly updated)")
        if self.fp8 is not None:
            for name in PROJECTIONS:
                for weight, (quantised, scales) in zip(getattr(self, name), self.fp8[name]):
                    quantise_rows(weight, quantised, scales)
            self._staging(allocated=False)

    def count(self) -> int:
        """Parameters held here (this rank's share under tensor parallelism)."""
        return sum(t[0].numel() for name, t in self.targets().items()
                   if t is not None and not (self.shape.tied and name == "lm_head.weight"))

    def _staging(self, allocated: bool) -> None:
        """fp8: the projections' engine-dtype copies hold memory only while a load fills them."""
        for name in PROJECTIONS:
            for weight in getattr(self, name):
                weight.untyped_storage().resize_(weight.numel() * weight.element_size() if allocated else 0)
