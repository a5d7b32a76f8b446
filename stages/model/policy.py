"""Modules the RL workers train: token logprobs of a causal LM, and a value model.

Both wrap a Hugging Face causal LM (optionally peft-wrapped) so that the whole computation happens
inside one root `forward` (what FSDP2 needs to unshard/reshard and reduce gradients correctly).

Layout of a batch (verl's): each row is a left-padded prompt of P tokens followed by a right-padded
response of R tokens, L = P + R. Response token j sits at position P + j and is predicted by the hidden
state at position P + j - 1, so the R predicting positions are `hidden[:, -R - 1 : -1]`.

Memory: the vocabulary projection is done in chunks of `chunk_tokens` positions, each under activation
checkpointing when gradients are needed, so full-vocabulary float32 logits never exist for the whole
batch at once (only for one chunk, and again in backward for one chunk). With `compile_head`, each chunk
is one compiled function: the float32 upcast is fused into its reductions, so only bf16 logits are stored.

Packing (`pack=True`): the padded rows are packed into one row without padding before the model runs
(`pack_rows`: position ids restart at 0 for each sequence), attention stays within each sequence
(`packed_attention`: the flash kernel's variable-length path on CUDA, a per-sequence loop elsewhere,
reached through a transformers attention implementation registered here), and the outputs are put back
into the (B, R) layout, zeros at padding. Same inputs and outputs as the padded path; no pad token is
computed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

PACKED_ATTENTION = "packed_sdpa"  # transformers attention implementation: sdpa, or varlen when packed


def hf_parts(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """(body, lm_head) of a transformers causal LM, looking through a peft wrapper."""
    hf = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(hf, hf.base_model_prefix), hf.get_output_embeddings()


def _chunk_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
                    with_entropy: bool, entropy_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    logits = F.linear(hidden, weight).float() / temperature  # (N, V)
    lse = torch.logsumexp(logits, dim=-1)  # (N,)
    logprobs = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    if not with_entropy:
        return logprobs, torch.zeros_like(logprobs)
    x, norm = (logits, lse) if entropy_grad else (logits.detach(), lse.detach())
    entropy = norm - (torch.softmax(x, dim=-1) * x).sum(-1)
    return logprobs, entropy


_COMPILED: dict[str, object] = {}


def _compiled_chunk_logprobs():
    if "chunk" not in _COMPILED:
        _COMPILED["chunk"] = torch.compile(_chunk_logprobs, dynamic=True)
    return _COMPILED["chunk"]


def chunked_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
                     with_entropy: bool, chunk_tokens: int = 1024, compile_head: bool = False,
                     checkpoint_head: bool = True, entropy_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprobs (and entropy) of `targets` (B, R) from final hidden states (B, R, H), chunk by chunk.

    entropy_grad=False: the entropy is a metric only (no entropy bonus), so backward skips its softmax.
    checkpoint_head=False keeps each chunk's activations for backward instead of recomputing its vocabulary
    projection (one matmul of three saved, for chunk x vocabulary bf16 logits kept per chunk).
    """
    b, r, h = hidden.shape
    flat_h, flat_t = hidden.reshape(b * r, h), targets.reshape(b * r)
    fn = _compiled_chunk_logprobs() if compile_head else _chunk_logprobs
    outs_lp, outs_ent = [], []
    for start in range(0, b * r, chunk_tokens):
        args = (flat_h[start : start + chunk_tokens], weight, flat_t[start : start + chunk_tokens], temperature,
                with_entropy, entropy_grad)
        if torch.is_grad_enabled() and checkpoint_head:
            lp, ent = checkpoint(fn, *args, use_reentrant=False)
        else:
            lp, ent = fn(*args)
        outs_lp.append(lp)
        outs_ent.append(ent)
    # clone: FSDP2 warns on (and can mishandle) view outputs of a sharded module's forward
    return torch.cat(outs_lp).view(b, r).clone(), torch.cat(outs_ent).view(b, r).clone()


class TokenLogprobs(nn.Module):
    """forward(input_ids, attention_mask, position_ids, num_response_tokens) -> (logprobs, entropy), (B, R).

    pack: run the model on the rows packed without padding (see the module docstring); compile_head:
    compile the chunked vocabulary projection; checkpoint_head=False: keep its activations for backward
    (see `chunked_logprobs`).
    """

    def __init__(self, lm: nn.Module, chunk_tokens: int = 1024, pack: bool = False, compile_head: bool = False,
                 checkpoint_head: bool = True):
        super().__init__()
        self.lm = lm
        self.chunk_tokens = chunk_tokens
        self.pack = pack
        self.head = {"compile_head": compile_head, "checkpoint_head": checkpoint_head}
        if pack:
            use_packed_attention(lm)

    def forward(self, input_ids, attention_mask, position_ids, num_response_tokens: int, temperature: float = 1.0,
                with_entropy: bool = False, entropy_grad: bool = True, packed: dict | None = None):
        """`packed`: `pack_rows` of these rows, computed where the batch is (on the host: reading lengths
        from device tensors would make the host wait for the device)."""
        body, lm_head = hf_parts(self.lm)
        r = num_response_tokens
        head = {**self.head, "entropy_grad": entropy_grad}
        if self.pack:
            packed = pack_rows(input_ids, attention_mask, r) if packed is None else packed
            return self._packed(body, lm_head, packed, temperature, with_entropy, head)
        hidden = body(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                      use_cache=False).last_hidden_state  # (B, L, H)
        predicting = hidden[:, -r - 1 : -1]  # (B, R, H)
        targets = input_ids[:, -r:]  # (B, R)
        return chunked_logprobs(predicting, lm_head.weight, targets, temperature, with_entropy, self.chunk_tokens,
                                **head)

    def _packed(self, body, lm_head, packed: dict, temperature: float, with_entropy: bool, head: dict):
        cu, longest = packed["cu_seqlens"], packed["max_seqlen"]
        hidden = body(input_ids=packed["input_ids"][None], position_ids=packed["position_ids"][None],
                      use_cache=False, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest,
                      max_length_k=longest).last_hidden_state[0]  # (T, H)
        lp, ent = chunked_logprobs(hidden[packed["predicting"]][None], lm_head.weight, packed["targets"][None],
                                   temperature, with_entropy, self.chunk_tokens, **head)
        mask = packed["response_mask"]
        out_lp = lp.new_zeros(mask.shape).masked_scatter(mask, lp[0])
        out_ent = ent.new_zeros(mask.shape).masked_scatter(mask, ent[0])
        return out_lp, out_ent


# ---- packing ---------------------------------------------------------------------------------------------


def pack_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor, num_response_tokens: int) -> dict:
    """verl's padded rows (B, L) -> one packed row of their T real tokens, and where the responses are.

    Each row's real tokens must be contiguous (left-padded prompt of >= 1 token, then a right-padded
    response), as `stages.batch.build_batch` makes them. Returns input_ids, position_ids (T,),
    cu_seqlens (B+1,) int32, max_seqlen (int), response_mask (B, R) bool, targets (K,) the response
    tokens in row-major order and predicting (K,) the packed index of the state that predicts each.
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
        "max_seqlen": int(lengths.max()), "response_mask": response, "targets": flat_ids[target_index],
        "predicting": target_index - 1,
    }


class _FlashVarlen(torch.autograd.Function):
    """Causal attention within packed sequences through ATen's flash kernel (CUDA, bf16/fp16, GQA)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, max_seqlen: int, scale: float):
        out, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, 0.0, True, False, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens, rng_state, unused)
        ctx.max_seqlen, ctx.scale = max_seqlen, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, cu, rng_state, unused = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad_out.contiguous(), q, k, v, out, lse, cu, cu, ctx.max_seqlen, ctx.max_seqlen, 0.0, True,
            rng_state, unused, scale=ctx.scale)
        return dq, dk, dv, None, None, None


def packed_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
                     max_seqlen: int, scale: float) -> torch.Tensor:
    """Causal attention within each packed sequence: query (T, H, D), key/value (T, H_kv, D) -> (T, H, D).

    cu_seqlens (S+1,) int32 are the sequences' boundaries; head h attends with kv head h // (H / H_kv).
    """
    if query.is_cuda and query.dtype in (torch.bfloat16, torch.float16):
        return _FlashVarlen.apply(query, key, value, cu_seqlens, max_seqlen, scale)
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
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # (T, heads, D)
    out = packed_attention(q.contiguous(), k.contiguous(), v.contiguous(), cu, kwargs["max_length_q"], scaling)
    return out[None], None  # (1, T, heads, D)


def _hf_packed_mask(*args, attention_mask=None, **kwargs):
    """No mask for packed rows (attention_mask None; the boundaries come as cu_seq_lens), sdpa's otherwise."""
    if attention_mask is None:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def use_packed_attention(lm: nn.Module) -> None:
    """Register `PACKED_ATTENTION` with transformers and switch `lm` (or the model inside peft) to it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(PACKED_ATTENTION, _hf_packed_attention)
    AttentionMaskInterface.register(PACKED_ATTENTION, _hf_packed_mask)
    hf = lm.get_base_model() if hasattr(lm, "get_base_model") else lm
    hf.set_attn_implementation(PACKED_ATTENTION)


def compile_layers(lm: nn.Module) -> None:
    """torch.compile each decoder layer in place (names unchanged; dynamic shapes for packed lengths)."""
    body, _ = hf_parts(lm)
    for layer in body.layers:
        layer.compile(dynamic=True)


class ValueModel(nn.Module):
    """A causal LM body with a scalar value head: forward(...) -> values (B, R) at response positions.

    values[:, j] estimates the return from response token j onward, read at the state that predicts it
    (position P + j - 1), as verl's critic does.
    """

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm
        body, _ = hf_parts(lm)
        hidden_size = body.config.hidden_size
        self.value_head = nn.Linear(hidden_size, 1, dtype=next(lm.parameters()).dtype)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids, attention_mask, position_ids, num_response_tokens: int) -> torch.Tensor:
        body, _ = hf_parts(self.lm)
        hidden = body(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                      use_cache=False).last_hidden_state
        r = num_response_tokens
        return self.value_head(hidden[:, -r - 1 : -1]).squeeze(-1).float()  # (B, R)
