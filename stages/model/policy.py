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
reached through a transformers attention implementation; all three in stages/model/packing.py), and the
outputs are put back into the (B, R) layout, zeros at padding. Same inputs and outputs as the padded path; no
pad token is computed.

Sequence parallelism (`sequence_parallel`, packed rows only): the ranks of a Ulysses group each run a slice of
the packed row and exchange heads around attention (stages/model/sequence_parallel.py); every rank of the group
returns the micro-batch's whole (B, R) outputs.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from stages.model.packing import pack_rows, sequence_parallel_rows, use_packed_attention
from stages.model.sequence_parallel import gather_outputs

logger = logging.getLogger(__name__)


def hf_parts(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """(body, lm_head) of a transformers causal LM, looking through a peft wrapper."""
    hf = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(hf, hf.base_model_prefix), hf.get_output_embeddings()


def _head_forward(logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool):
    """(logprobs, logsumexp, entropy or zeros) of raw logits (N, V), in float32."""
    z = logits.float() / temperature
    lse = torch.logsumexp(z, dim=-1)
    logprobs = z.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    entropy = lse - (torch.softmax(z, dim=-1) * z).sum(-1) if with_entropy else torch.zeros_like(lse)
    return logprobs, lse, entropy


def _chunk_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
                    with_entropy: bool, entropy_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole chunk under autograd (an entropy bonus, or activations kept): (logprobs, entropy)."""
    logprobs, _, entropy = _head_forward(F.linear(hidden, weight), targets, temperature, with_entropy)
    return logprobs, entropy if entropy_grad else entropy.detach()


def _head_logits_grad(logits: torch.Tensor, lse: torch.Tensor, grad: torch.Tensor, temperature: float):
    """-grad * softmax(logits / T) / T in logits' dtype: d(sum grad * logprobs)/d logits but for the targets'
    +grad / T (added by the caller). One elementwise pass (with a one-hot compare in it, the compiled kernel
    took twice as long on an H200)."""
    probs = torch.exp(logits.float() / temperature - lse.unsqueeze(-1))
    return (probs * (-grad / temperature).unsqueeze(-1)).to(logits.dtype)


_COMPILED: dict[object, object] = {}


def _compiled(fn, enabled: bool = True):
    """fn compiled once (dynamic shapes: chunks and packed lengths vary), or fn itself when not enabled."""
    if not enabled:
        return fn
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn, dynamic=True)
    return _COMPILED[fn]


class _HeadChunk(torch.autograd.Function):
    """Logprobs of `targets` under hidden @ weight.T: saves the chunk's logsumexp, not its logits.

    Backward recomputes the logits (one matmul, as activation checkpointing would) but not their reductions:
    with the saved logsumexp, the logits' gradient is one elementwise pass. The entropy, when asked for, is a
    metric here (no gradient flows through it; entropy bonuses take the checkpointed path). With
    `compile_head` the passes over the logits are Triton kernels on CUDA (stages/model/head_kernels.py) and
    torch.compile'd elsewhere."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, with_entropy: bool, compile_head: bool):
        logits = F.linear(hidden, weight)
        if compile_head and logits.is_cuda:
            from stages.model.head_kernels import head_forward

            logprobs, lse, entropy = head_forward(logits, targets, temperature, with_entropy)
        else:
            logprobs, lse, entropy = _compiled(_head_forward, compile_head)(logits, targets, temperature,
                                                                            with_entropy)
        ctx.save_for_backward(hidden, weight, targets, lse, logprobs)
        ctx.temperature, ctx.compile_head = temperature, compile_head
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, _grad_entropy):
        hidden, weight, targets, lse, logprobs = ctx.saved_tensors
        logits = F.linear(hidden, weight)
        if ctx.compile_head and logits.is_cuda:
            from stages.model.head_kernels import head_backward_

            grad_logits = head_backward_(logits, targets, lse, grad_logprobs, ctx.temperature)
        else:
            grad_logits = _compiled(_head_logits_grad, ctx.compile_head)(logits, lse, grad_logprobs, ctx.temperature)
            # the targets' entries: grad * (1 - p) / T, from float32 (grad * (-p) rounded first would lose it)
            rows = torch.arange(len(targets), device=targets.device)
            grad_logits[rows, targets] = (grad_logprobs * -torch.expm1(logprobs) / ctx.temperature).to(logits.dtype)
        grad_hidden = grad_logits @ weight if ctx.needs_input_grad[0] else None
        grad_weight = grad_logits.t() @ hidden if ctx.needs_input_grad[1] else None
        return grad_hidden, grad_weight, None, None, None, None


def chunked_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
                     with_entropy: bool, chunk_tokens: int = 1024, compile_head: bool = False,
                     checkpoint_head: bool = True, entropy_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprobs (and entropy) of `targets` (B, R) from final hidden states (B, R, H), chunk by chunk.

    With gradients, each chunk's vocabulary projection is recomputed in backward (`_HeadChunk`; with an
    entropy bonus, `entropy_grad`, the whole chunk under activation checkpointing). checkpoint_head=False
    keeps each chunk's activations for backward instead (chunk x vocabulary logits kept per chunk).
    entropy_grad=False: the entropy is a metric only, without gradient.
    """
    b, r, h = hidden.shape
    flat_h, flat_t = hidden.reshape(b * r, h), targets.reshape(b * r)
    outs_lp, outs_ent = [], []
    for start in range(0, b * r, chunk_tokens):
        chunk_h, chunk_t = flat_h[start : start + chunk_tokens], flat_t[start : start + chunk_tokens]
        if not torch.is_grad_enabled() or (checkpoint_head and not (with_entropy and entropy_grad)):
            lp, ent = _HeadChunk.apply(chunk_h, weight, chunk_t, temperature, with_entropy, compile_head)
        else:  # an entropy bonus, or activations kept
            args = (chunk_h, weight, chunk_t, temperature, with_entropy, entropy_grad)
            fn = _compiled(_chunk_logprobs, compile_head)
            lp, ent = checkpoint(fn, *args, use_reentrant=False) if checkpoint_head else fn(*args)
        outs_lp.append(lp)
        outs_ent.append(ent)
    # clone: FSDP2 warns on (and can mishandle) view outputs of a sharded module's forward
    return torch.cat(outs_lp).view(b, r).clone(), torch.cat(outs_ent).view(b, r).clone()


class TokenLogprobs(nn.Module):
    """forward(input_ids, attention_mask, position_ids, num_response_tokens) -> (logprobs, entropy), (B, R).

    pack: run the model on the rows packed without padding (see the module docstring); compile_head:
    compile the chunked vocabulary projection; checkpoint_head=False: keep its activations for backward
    (see `chunked_logprobs`); sequence_parallel: the Ulysses group this rank computes packed rows with (None:
    each rank alone).
    """

    def __init__(self, lm: nn.Module, chunk_tokens: int = 1024, pack: bool = False, compile_head: bool = False,
                 checkpoint_head: bool = True, sequence_parallel: dist.ProcessGroup | None = None):
        super().__init__()
        if sequence_parallel is not None and not pack:
            raise ValueError("sequence parallelism runs on packed rows: TokenLogprobs(pack=True)")
        self.lm = lm
        self.chunk_tokens = chunk_tokens
        self.pack = pack
        self.sequence_parallel = sequence_parallel
        self.head = {"compile_head": compile_head, "checkpoint_head": checkpoint_head}
        self.head_problem = head_problem(lm)
        if self.head_problem:
            if pack or sequence_parallel is not None:
                raise ValueError(f"packed rows compute logits as hidden @ lm_head.weight.T, which is not this model's "
                                 f"output layer ({self.head_problem}); set rl.actor.use_remove_padding=false")
            logger.info("trainer: logprobs from the model's own logits, not the chunked head: %s (memory: the "
                        "micro-batch's full-vocabulary logits)", self.head_problem)
        if pack:
            use_packed_attention(lm)

    def forward(self, input_ids, attention_mask, position_ids, num_response_tokens: int, temperature: float = 1.0,
                with_entropy: bool = False, entropy_grad: bool = True, packed: dict | None = None):
        """`packed`: `pack_rows` of these rows, computed where the batch is (on the host: reading lengths
        from device tensors would make the host wait for the device), with `sequence_parallel_rows`' entry for
        this rank's slice; a packed dict without that entry runs the whole row on this rank. None: computed here
        (split over the group when there is one)."""
        body, lm_head = hf_parts(self.lm)
        r = num_response_tokens
        head = {**self.head, "entropy_grad": entropy_grad}
        if self.pack:
            if packed is None:
                packed = sequence_parallel_rows(pack_rows(input_ids, attention_mask, r), self.sequence_parallel)
            return self._packed(body, lm_head, packed, temperature, with_entropy, head)
        if self.head_problem:
            return self._model_logprobs(input_ids, attention_mask, position_ids, r, temperature, with_entropy)
        hidden = body(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                      use_cache=False).last_hidden_state  # (B, L, H)
        predicting = hidden[:, -r - 1 : -1]  # (B, R, H)
        targets = input_ids[:, -r:]  # (B, R)
        return chunked_logprobs(predicting, lm_head.weight, targets, temperature, with_entropy, self.chunk_tokens,
                                **head)

    def _model_logprobs(self, input_ids, attention_mask, position_ids, r: int, temperature: float,
                        with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's own forward, its output layer's extras included (soft-capping, scaling, a bias, LoRA)."""
        logits = self.lm(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=False, logits_to_keep=r + 1).logits[:, :-1]  # (B, R, V)
        b, _, v = logits.shape
        logprobs, _, entropy = _head_forward(logits.reshape(b * r, v), input_ids[:, -r:].reshape(b * r),
                                             temperature, with_entropy)
        return logprobs.view(b, r).clone(), entropy.view(b, r).clone()  # not views, as in chunked_logprobs

    def _packed(self, body, lm_head, packed: dict, temperature: float, with_entropy: bool, head: dict):
        split = packed.get("sequence_parallel")  # this rank's slice of the row, or None: the whole row
        part, group = (packed, None) if split is None else (split, self.sequence_parallel)
        assert split is None or group is not None, "a row split for sequence parallelism needs the group"
        cu, longest = part["cu_seqlens"], part["max_seqlen"]
        # transformers passes a prepared (4D) mask through as is, so it neither builds one nor looks for packed
        # sequences in the position ids (a host sync per forward); the packed attention ignores it
        no_mask = torch.empty((1, 1, 0, 0), dtype=torch.bool, device=cu.device)
        extra = {} if group is None else {"sequence_parallel": group}  # reaches packing._hf_packed_attention
        hidden = body(input_ids=part["input_ids"][None], position_ids=part["position_ids"][None],
                      attention_mask=no_mask, use_cache=False, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                      max_length_q=longest, max_length_k=longest, **extra).last_hidden_state[0]  # (T or T/P, H)
        lp, ent = chunked_logprobs(hidden[part["predicting"]][None], lm_head.weight, part["targets"][None],
                                   temperature, with_entropy, self.chunk_tokens, **head)
        lp, ent = lp[0], ent[0]  # (K,), or (W,) of this rank's slice
        if group is not None:
            lp, ent = gather_outputs(lp, ent, split["gather_index"], group)  # (K,)
        shape, where = packed["response_mask"].shape, packed["response_index"]  # scatter: no host sync
        # clones, not views: FSDP's pre-backward hook on a returned view is lost to an in-place op on it
        out_lp = lp.new_zeros(shape.numel()).scatter(0, where, lp).view(shape).clone()
        out_ent = ent.new_zeros(shape.numel()).scatter(0, where, ent).view(shape).clone()
        return out_lp, out_ent


# causal LMs whose logits are lm_head(hidden) and nothing more (transformers 5.19's modeling files): the chunked head
# computes their logprobs; others soft-cap (Gemma 2-4), scale (Granite, Cohere) or slice their logits
PLAIN_HEAD_MODEL_TYPES = ("qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "llama", "mistral", "ministral", "mixtral",
                          "phi3", "olmo2", "gemma", "deepseek_v3", "glm4", "smollm3")


def head_problem(lm: nn.Module) -> str | None:
    """Why hidden @ lm_head.weight.T would not be this model's logits (None: it is)."""
    hf = lm.get_base_model() if hasattr(lm, "get_base_model") else lm
    head, model_type = hf.get_output_embeddings(), hf.config.model_type
    if model_type not in PLAIN_HEAD_MODEL_TYPES:
        return f"model_type={model_type!r} may change its logits after lm_head"
    if type(head) is not nn.Linear:
        return f"the output layer is a {type(head).__name__} (LoRA on lm_head?)"
    if head.bias is not None:
        return "the output layer has a bias"
    return None


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
        values = self.value_head(hidden[:, -r - 1 : -1]).squeeze(-1)  # (B, R)
        # A new tensor, never a view (squeeze's, or float()'s in fp32): FSDP2 hangs the re-gather of the root's
        # weights for backward on this output, and an in-place op on a view of it (`values.mul_(mask)`) drops
        # that hook, so that backward reads freed weights when they are resharded after forward.
        return values.to(torch.float32, copy=True)
