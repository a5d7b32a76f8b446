"""Modules the RL workers train: token logprobs of a causal LM, and a value model.

Both wrap a Hugging Face causal LM (optionally peft-wrapped) so that the whole computation happens
inside one root `forward` (what FSDP2 needs to unshard/reshard and reduce gradients correctly).

Layout of a batch (verl's): each row is a left-padded prompt of P tokens followed by a right-padded
response of R tokens, L = P + R. Response token j sits at position P + j and is predicted by the hidden
state at position P + j - 1, so the R predicting positions are `hidden[:, -R - 1 : -1]`.

Memory: the vocabulary projection is done in chunks of `chunk_tokens` positions, each under activation
checkpointing when gradients are needed, so full-vocabulary float32 logits never exist for the whole
batch at once (only for one chunk, and again in backward for one chunk).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


def hf_parts(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """(body, lm_head) of a transformers causal LM, looking through a peft wrapper."""
    hf = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(hf, hf.base_model_prefix), hf.get_output_embeddings()


def _chunk_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
                    with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    logits = F.linear(hidden, weight).float() / temperature  # (N, V)
    lse = torch.logsumexp(logits, dim=-1)  # (N,)
    logprobs = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    if not with_entropy:
        return logprobs, torch.zeros_like(logprobs)
    entropy = lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    return logprobs, entropy


def chunked_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
                     with_entropy: bool, chunk_tokens: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprobs (and entropy) of `targets` (B, R) from final hidden states (B, R, H), chunk by chunk."""
    b, r, h = hidden.shape
    flat_h, flat_t = hidden.reshape(b * r, h), targets.reshape(b * r)
    outs_lp, outs_ent = [], []
    for start in range(0, b * r, chunk_tokens):
        args = (flat_h[start : start + chunk_tokens], weight, flat_t[start : start + chunk_tokens], temperature,
                with_entropy)
        if torch.is_grad_enabled():
            lp, ent = checkpoint(_chunk_logprobs, *args, use_reentrant=False)
        else:
            lp, ent = _chunk_logprobs(*args)
        outs_lp.append(lp)
        outs_ent.append(ent)
    # clone: FSDP2 warns on (and can mishandle) view outputs of a sharded module's forward
    return torch.cat(outs_lp).view(b, r).clone(), torch.cat(outs_ent).view(b, r).clone()


class TokenLogprobs(nn.Module):
    """forward(input_ids, attention_mask, position_ids, num_response_tokens) -> (logprobs, entropy), (B, R)."""

    def __init__(self, lm: nn.Module, chunk_tokens: int = 1024):
        super().__init__()
        self.lm = lm
        self.chunk_tokens = chunk_tokens

    def forward(self, input_ids, attention_mask, position_ids, num_response_tokens: int, temperature: float = 1.0,
                with_entropy: bool = False):
        body, lm_head = hf_parts(self.lm)
        hidden = body(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                      use_cache=False).last_hidden_state  # (B, L, H)
        r = num_response_tokens
        predicting = hidden[:, -r - 1 : -1]  # (B, R, H)
        targets = input_ids[:, -r:]  # (B, R)
        return chunked_logprobs(predicting, lm_head.weight, targets, temperature, with_entropy, self.chunk_tokens)


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
