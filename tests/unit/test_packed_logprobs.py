"""Packed sequences (no padding) give the padded path's logprobs, entropies and gradients."""

from __future__ import annotations

import pytest
import torch

from stages.batch import build_batch
from stages.model.packing import pack_rows
from stages.model.policy import TokenLogprobs
from tests.tolerances import assert_close_reordered
from tests.triton_device import needs_triton, triton_device
from tests.unit.test_cuda_engine import PAD, tiny_model


def _batch():
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 300, (n,), generator=g).tolist() for n in (3, 9, 5, 1)]
    responses = [torch.randint(4, 300, (n,), generator=g).tolist() for n in (6, 1, 11, 4)]
    return build_batch(prompts, responses, [[0.0] * len(r) for r in responses], pad_token_id=PAD)


def test_pack_rows_drops_padding_and_finds_the_responses():
    batch = _batch()
    t = batch.tensors
    packed = pack_rows(t["input_ids"], t["attention_mask"], batch.num_response_tokens)
    assert packed["cu_seqlens"].tolist() == [0, 9, 19, 35, 40]  # lengths 3+6, 9+1, 5+11, 1+4
    assert packed["max_seqlen"] == 16
    assert packed["position_ids"][:10].tolist() == [*range(9), 0]
    assert torch.equal(packed["targets"], t["input_ids"][:, -batch.num_response_tokens:][batch.response_mask])
    assert packed["predicting"][:6].tolist() == [2, 3, 4, 5, 6, 7]  # row 0: prompt at 0..2, response at 3..8


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama3"])
def test_packed_forward_equals_padded_forward_and_gradients(arch):
    batch = _batch()
    inputs, mask = batch.model_inputs(), batch.response_mask
    results = []
    for pack in (False, True):
        model = tiny_model(arch)
        module = TokenLogprobs(model, chunk_tokens=7, pack=pack)
        lp, ent = module(**inputs, temperature=0.9, with_entropy=True)
        ((lp * mask).sum() + (ent * mask).sum()).backward()
        results.append((lp * mask, ent * mask, {name: p.grad for name, p in model.named_parameters()}))
    (lp0, ent0, g0), (lp1, ent1, g1) = results
    # other attention kernels and shapes: this model's (weights of std 0.2) float32 logprobs and entropies are
    # within ~6e-6 of their float64 values, so the two paths differ by up to about twice that
    torch.testing.assert_close(lp1, lp0, rtol=0, atol=1e-4)
    torch.testing.assert_close(ent1, ent0, rtol=0, atol=1e-4)
    assert_close_reordered(g1, g0)
    assert (lp1 != 0).sum() == mask.sum()  # padding positions stay exactly zero


def test_entropy_without_gradient_keeps_values_and_logprob_gradients():
    batch = _batch()
    inputs, mask = batch.model_inputs(), batch.response_mask
    results = []
    for entropy_grad in (True, False):
        model = tiny_model()
        module = TokenLogprobs(model, chunk_tokens=7, pack=True)
        lp, ent = module(**inputs, with_entropy=True, entropy_grad=entropy_grad)
        (lp * mask).sum().backward()
        results.append((ent * mask, torch.cat([p.grad.flatten() for p in model.parameters()]), ent.requires_grad))
    (ent0, g0, req0), (ent1, g1, req1) = results
    # the same forward and the same logprob graph (the entropy's part of it adds zeros): the same bits
    assert torch.equal(ent0, ent1) and torch.equal(g0, g1) and req0 and not req1


def test_head_gradients_match_full_log_softmax():
    """The chunked head (logsumexp saved, logits recomputed in backward) against plain autograd."""
    from stages.model.policy import chunked_logprobs

    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 9, 16, generator=g, requires_grad=True)
    weight = torch.randn(50, 16, generator=g, requires_grad=True)
    targets = torch.randint(0, 50, (2, 9), generator=g)
    upstream = torch.randn(2, 9, generator=g)
    results = []
    for chunked in (False, True):
        if chunked:
            lp, ent = chunked_logprobs(hidden, weight, targets, 0.7, with_entropy=True, chunk_tokens=4,
                                       entropy_grad=False)
        else:
            logp = torch.log_softmax(hidden @ weight.T / 0.7, -1)
            lp, ent = logp.gather(-1, targets[..., None])[..., 0], -(logp.exp() * logp).sum(-1)
        grads = torch.autograd.grad((lp * upstream).sum(), (hidden, weight))
        outputs = (lp.detach(), ent.detach(), *grads)
        results.append(dict(zip(("logprobs", "entropy", "hidden grad", "weight grad"), outputs)))
    assert_close_reordered(results[1], results[0])  # logits recomputed per chunk: the same sums, reordered


def _graph_stats() -> tuple[int, int]:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (flash attention, compiled layers)")
def test_compiled_packed_training_on_cuda_matches_padded_without_recompiles():
    """The training path on a GPU (compiled layers and head, the flash custom op) against the padded eager one,
    in bf16; then more batches of other lengths neither recompile nor break the layers' graphs."""
    from stages.model.policy import compile_layers

    batch = _batch()
    mask = batch.response_mask.cuda()
    results = []
    for compiled in (False, True):
        model = tiny_model().to("cuda", torch.bfloat16)
        if compiled:
            compile_layers(model)
        module = TokenLogprobs(model, chunk_tokens=8, pack=compiled, compile_head=compiled)
        inputs = {k: v.cuda() if torch.is_tensor(v) else v for k, v in batch.model_inputs().items()}
        lp, _ = module(**inputs, temperature=0.9)
        (lp.float() * mask).sum().backward()
        results.append((lp.float() * mask, torch.cat([p.grad.float().flatten() for p in model.parameters()])))
    (lp0, g0), (lp1, g1) = results
    torch.testing.assert_close(lp1, lp0, atol=0.05, rtol=0.02)
    assert float((g1 - g0).norm() / g0.norm()) < 0.03
    graphs, breaks = _graph_stats()
    g = torch.Generator().manual_seed(5)
    for lengths in ((4, 13, 2, 9, 30), (17, 5, 40)):
        prompts = [torch.randint(4, 300, (n,), generator=g).tolist() for n in lengths]
        responses = [torch.randint(4, 300, (n + 4,), generator=g).tolist() for n in lengths]  # no 1-token chunk
        other = build_batch(prompts, responses, [[0.0] * len(r) for r in responses], pad_token_id=PAD)
        inputs = {k: v.cuda() if torch.is_tensor(v) else v for k, v in other.model_inputs().items()}
        lp, _ = module(**inputs)
        lp.sum().backward()
    assert _graph_stats() == (graphs, breaks)


@needs_triton
@pytest.mark.parametrize("with_entropy", [True, False])
def test_triton_head_kernels_match_float64(with_entropy):
    from stages.model.head_kernels import head_backward_, head_forward

    dev = triton_device()
    g = torch.Generator(device=dev).manual_seed(0)
    n, v, temperature = 37, 10_007, 0.7  # a vocabulary that the kernels' blocks do not divide
    logits = (torch.randn(n, v, device=dev, generator=g) * 3).to(torch.bfloat16)
    targets = torch.randint(0, v, (n,), device=dev, generator=g)
    logits[0, targets[0]] = 16.0  # a peaked row: 1 - p(target) ~ 1e-2, which bf16 rounding of -p would lose
    z = logits.double() / temperature
    logp = torch.log_softmax(z, -1)
    lp, lse, ent = head_forward(logits, targets, temperature, with_entropy)
    torch.testing.assert_close(lp.double(), logp.gather(-1, targets[:, None])[:, 0], atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(lse.double(), torch.logsumexp(z, -1), atol=1e-4, rtol=1e-5)
    expected_ent = -(logp.exp() * logp).sum(-1) if with_entropy else torch.zeros(n, dtype=torch.float64, device=dev)
    torch.testing.assert_close(ent.double(), expected_ent, atol=1e-4, rtol=1e-4)
    grad = torch.randn(n, device=dev, generator=g)
    onehot = torch.nn.functional.one_hot(targets, v).double()
    expected = grad.double()[:, None] * (onehot - logp.exp()) / temperature
    out = head_backward_(logits.clone(), targets, lse, grad, temperature)
    torch.testing.assert_close(out.double(), expected, atol=1e-6, rtol=1e-2)  # bf16 output
