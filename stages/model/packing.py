"""Packed rows: verl's padded rows run as one row without padding, attention kept within each sequence.

`pack_rows` packs a batch's padded rows (B, L) into one row of their T real tokens (position ids restart at 0 for
each sequence) and says where the responses are; `TokenLogprobs(pack=True)` (stages/model/policy.py) runs the
model on it and puts its outputs back into the (B, R) layout. `host_inputs` packs on the host, where the batch is,
and `sequence_parallel_rows` gives a Ulysses rank its slice of the row (stages/model/sequence_parallel.py).

Attention stays within each sequence (`packed_attention`: the flash kernel's variable-length path on CUDA, a
custom op `rlpipe::flash_varlen` so a compiled layer stays one graph; a per-sequence loop elsewhere), reached
through a transformers attention implementation registered here (`use_packed_attention`). `packing_unsupported`
says which models it computes exactly.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from stages.model import rotary
from stages.model.sequence_parallel import split_packed, ulysses_attention

PACKED_ATTENTION = "packed_sdpa"  # transformers attention implementation: sdpa, or varlen when packed

def host_inputs(batch, pack: bool, group: dist.ProcessGroup | None = None) -> dict:
    """A batch's model inputs (`Batch.model_inputs`, on the host), with its rows packed there when the module packs
    (this rank's slice under a Ulysses `group`): packing on the device would make the host wait for lengths."""
    inputs = batch.model_inputs()
    if pack:
        packed = pack_rows(inputs["input_ids"], inputs["attention_mask"], inputs["num_response_tokens"])
        inputs["packed"] = sequence_parallel_rows(packed, group)
    return inputs


def sequence_parallel_rows(packed: dict, group: dist.ProcessGroup | None) -> dict:
    """`packed` (`pack_rows`) with this rank's slice of the row under "sequence_parallel" (`split_packed`) when
    there is a group; as given otherwise."""
    if group is None:
        return packed
    return {**packed, "sequence_parallel": split_packed(packed, dist.get_rank(group), dist.get_world_size(group))}


def pack_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor, num_response_tokens: int) -> dict:
    """verl's padded rows (B, L) -> one packed row of their T real tokens, and where the responses are.

    Each row's real tokens must be contiguous (left-padded prompt of >= 1 token, then a right-padded
    response), as `stages.batch.build_batch` makes them. Returns input_ids, position_ids (T,),
    cu_seqlens (B+1,) int32, max_seqlen (int), response_mask (B, R) bool, response_index (K,) the flat
    (B * R) positions of the K response tokens in row-major order, targets (K,) those tokens and predicting
    (K,) the packed index of the state that predicts each.
    """
    mask = attention_mask.bool()
    lengths = mask.sum(-1)  # (B,)
    response = mask[:, -num_response_tokens:]  # (B, R)
    prompt_lengths = lengths - response.sum(-1)
    if bool((prompt_lengths < 1).any()):
        raise ValueError("packing needs a prompt of at least one token in every row")
    cu = F.pad(lengths.cumsum(0), (1, 0))
    j = torch.arange(num_response_tokens, device=mask.device)
    target_index = (cu[:-1] + prompt_lengths)[:, None] + j[None, :]  # (B, R) packed index of response token j
    flat_ids = input_ids[mask]
    target_index = target_index[response]
    return {
        "input_ids": flat_ids, "position_ids": (mask.cumsum(-1) - 1)[mask], "cu_seqlens": cu.to(torch.int32),
        "max_seqlen": int(lengths.max()), "response_mask": response,
        "response_index": response.reshape(-1).nonzero().squeeze(-1), "targets": flat_ids[target_index],
        "predicting": target_index - 1,
    }


@torch.library.custom_op("rlpipe::flash_varlen", mutates_args=())
def _flash_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention within packed sequences through ATen's flash kernel (CUDA, bf16/fp16, GQA): (out, lse).

    A custom op, so torch.compile keeps a decoder layer in one graph around it (no graph break)."""
    out, lse, _, _, _ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, 0.0, True, False, scale=scale)
    return out, lse


@_flash_varlen.register_fake
def _(q, k, v, cu_seqlens, max_seqlen, scale):
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("rlpipe::flash_varlen_backward", mutates_args=())
def _flash_varlen_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           out: torch.Tensor, lse: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                           scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    no_dropout = torch.zeros(2, dtype=torch.uint64, device=q.device), torch.empty(0, device=q.device)
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        grad_out.contiguous(), q, k, v, out, lse, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, 0.0, True,
        *no_dropout, scale=scale)
    return dq, dk, dv


@_flash_varlen_backward.register_fake
def _(grad_out, q, k, v, out, lse, cu_seqlens, max_seqlen, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _flash_varlen_setup(ctx, inputs, output):
    q, k, v, cu_seqlens, max_seqlen, scale = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], cu_seqlens)
    ctx.max_seqlen, ctx.scale = max_seqlen, scale


def _flash_varlen_grad(ctx, grad_out, _grad_lse):
    q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
    dq, dk, dv = _flash_varlen_backward(grad_out, q, k, v, out, lse, cu_seqlens, ctx.max_seqlen, ctx.scale)
    return dq, dk, dv, None, None, None


_flash_varlen.register_autograd(_flash_varlen_grad, setup_context=_flash_varlen_setup)


def packed_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
                     max_seqlen: int, scale: float) -> torch.Tensor:
    """Causal attention within each packed sequence: query (T, H, D), key/value (T, H_kv, D) -> (T, H, D).

    cu_seqlens (S+1,) int32 are the sequences' boundaries; head h attends with kv head h // (H / H_kv).
    """
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    if query.is_cuda and torch.is_autocast_enabled("cuda"):  # as autocast runs sdpa: in its dtype (SFT's path)
        query, key, value = (x.to(torch.get_autocast_dtype("cuda")) for x in (query, key, value))
    if query.is_cuda and query.dtype in (torch.bfloat16, torch.float16):
        return _flash_varlen(query, key, value, cu_seqlens, max_seqlen, scale)[0]
    groups = query.shape[1] // key.shape[1]
    bounds = cu_seqlens.tolist()
    outs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        q = query[start:end].transpose(0, 1)  # (H, l, D)
        k = key[start:end].transpose(0, 1).repeat_interleave(groups, 0)
        v = value[start:end].transpose(0, 1).repeat_interleave(groups, 0)
        outs.append(F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale).transpose(0, 1))
    return torch.cat(outs)


def _hf_packed_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers attention function: varlen when the forward got cu_seq_lens_q, else plain sdpa."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"packed attention expects one packed row, got a batch of {query.shape[0]}")
    # (T, heads, D), T/P with SP: no copy where the rotary op wrote (1, T, heads, D) memory, and views only in
    # backward (x[0] would make the compiled backward materialise a transposed gradient)
    q, k, v = (x.transpose(1, 2).flatten(0, 1).contiguous() for x in (query, key, value))
    group = kwargs.get("sequence_parallel")
    if group is None:
        out = packed_attention(q, k, v, cu, kwargs["max_length_q"], scaling)
    else:
        out = ulysses_attention(packed_attention, q, k, v, cu, kwargs["max_length_q"], scaling, group)
    return out[None], None  # (1, T, heads, D)


def _hf_packed_mask(*args, attention_mask=None, **kwargs):
    """No mask for packed rows (attention_mask None; the boundaries come as cu_seq_lens), sdpa's otherwise."""
    if attention_mask is None:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)



PACKED_MODEL_TYPES = ("qwen2", "qwen3", "qwen3_moe", "llama")  # attention through transformers' interface, no windows


def packing_unsupported(config) -> str | None:
    """Why packed rows would not compute this model exactly (None: they do): attention must go through
    transformers' attention interface (the packed implementation sees every layer), never slide and drop
    nothing (attention_dropout 0: Qwen2's and Llama's default)."""
    if config.model_type not in PACKED_MODEL_TYPES:
        return f"model_type={config.model_type!r} (packed: {', '.join(PACKED_MODEL_TYPES)})"
    if getattr(config, "use_sliding_window", False) or "sliding_attention" in (getattr(config, "layer_types", None)
                                                                               or ()):
        return "sliding-window attention"
    if getattr(config, "attention_dropout", 0.0):  # the packed kernels apply none
        return f"attention_dropout={config.attention_dropout}"
    return None


def use_packed_attention(lm: nn.Module) -> None:
    """Register `PACKED_ATTENTION` with transformers and switch `lm` (or the model inside peft) to it; its rotary
    embedding writes q and k in the layout that attention reads (stages/model/rotary.py)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(PACKED_ATTENTION, _hf_packed_attention)
    AttentionMaskInterface.register(PACKED_ATTENTION, _hf_packed_mask)
    hf = lm.get_base_model() if hasattr(lm, "get_base_model") else lm
    hf.set_attn_implementation(PACKED_ATTENTION)
    rotary.install(type(hf).__module__)
