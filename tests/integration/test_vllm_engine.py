"""VLLMRolloutEngine against transformers on a tiny fp32 Qwen2 model: greedy tokens and logprobs, weight
sync, sampling logprobs at temperature 0.7, stop tokens and max_tokens. One engine for the whole module."""

from __future__ import annotations

import copy
from importlib.util import find_spec

import pytest
import torch

from infra.config_sections import TinyModelConfig
from stages.model.tiny import build_tiny_model
from stages.rollout.base import SamplingParams
from stages.rollout.hf import HFRolloutEngine
from tests.tolerances import greedy_margin

pytestmark = [pytest.mark.slow, pytest.mark.skipif(find_spec("vllm") is None, reason="vLLM is not installed")]

# Twice each engine's float32 error: this model's (weights of std 0.15) logprobs are within ~2e-5 of their
# float64 values in transformers, and vLLM's differ from transformers' by ~1e-5.
LOGPROB_ATOL = 1e-4
PROMPTS = ["12+7=", "3+4=", "25+19=", "0+6=", "8+13=", "3+9=", "17+", "6+22="]  # greedy: 0+6= and 3+9= end at EOS


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Qwen2 (head_dim 32: vLLM's CPU attention has no head_dim 16) with weights spread wider than
    the 0.02 init, so greedy decoding does not repeat one token and argmax margins are not near-ties."""
    from transformers import AutoModelForCausalLM

    texts = [f"{a}+{b}={a + b}" for a in range(30) for b in range(30)]
    out = build_tiny_model(TinyModelConfig(hidden_size=128, intermediate_size=256), texts, 0,
                           tmp_path_factory.mktemp("vllm-tiny"))
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        for param in model.parameters():
            if param.ndim == 2:
                param.normal_(0.0, 0.15)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine(model_dir):
    from stages.rollout.vllm_engine import VLLMRolloutEngine

    engine = VLLMRolloutEngine(model_dir, dtype="float32", seed=0, max_model_len=512)
    assert torch.distributed.is_initialized()  # vLLM's in-process gloo world of size 1
    yield engine
    engine.shutdown()
    assert not torch.distributed.is_initialized()  # later tests can start their own process group


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    return [tokenizer(p).input_ids for p in PROMPTS]


def _hf_engine(model, tokenizer) -> HFRolloutEngine:
    return HFRolloutEngine(model, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)


@torch.no_grad()
def _teacher_forced_logprobs(model, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    """log softmax(logits / T) of each response token given the prompt and the response before it. (R,)"""
    ids = torch.tensor([prompt + response])
    logits = model(ids).logits[0, len(prompt) - 1 : -1].float()  # (R, V): position t predicts token t+1
    return torch.log_softmax(logits / temperature, dim=-1).gather(-1, torch.tensor(response)[:, None])[:, 0]


def _assert_same_greedy(engine, hf_model, tokenizer, prompt_ids, max_tokens=16):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    ours = engine.generate(prompt_ids, params)
    ref = _hf_engine(hf_model, tokenizer).generate(prompt_ids, params)
    # no near-tie on the way: engines within LOGPROB_ATOL of each other then pick the same tokens
    assert greedy_margin(hf_model, prompt_ids, [r.response_ids for r in ref]) > LOGPROB_ATOL
    assert [o.response_ids for o in ours] == [r.response_ids for r in ref]
    assert [o.finish_reason for o in ours] == [r.finish_reason for r in ref]
    for o, r in zip(ours, ref):
        torch.testing.assert_close(torch.tensor(o.logprobs), torch.tensor(r.logprobs), rtol=0, atol=LOGPROB_ATOL)
    return ours


def test_default_stop_is_the_eos(engine, tokenizer):
    assert engine.stop_token_ids == (tokenizer.eos_token_id,)


def test_greedy_matches_transformers(engine, hf_model, tokenizer, prompt_ids):
    ours = _assert_same_greedy(engine, hf_model, tokenizer, prompt_ids)
    assert len({tuple(o.response_ids) for o in ours}) > 1, "degenerate model: every prompt gives the same output"
    assert all(len(set(o.response_ids)) > 1 for o in ours), "degenerate model: a response repeats one token"
    assert any(o.finish_reason == "stop" for o in ours), "no prompt reaches the EOS: stopping goes untested"


def test_update_weights_then_sync_back(engine, hf_model, tokenizer, prompt_ids):
    before = engine.generate(prompt_ids, SamplingParams(temperature=0.0, max_tokens=16))
    perturbed = copy.deepcopy(hf_model)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(2)
        for param in perturbed.parameters():
            param.add_(0.1 * torch.randn_like(param))
    try:
        engine.update_weights(perturbed.state_dict())  # tied: lm_head shares the embedding's storage
        after = _assert_same_greedy(engine, perturbed, tokenizer, prompt_ids)
        assert [o.response_ids for o in after] != [o.response_ids for o in before]
    finally:
        engine.update_weights(hf_model.state_dict())
    back = _assert_same_greedy(engine, hf_model, tokenizer, prompt_ids)
    assert [o.response_ids for o in back] == [o.response_ids for o in before]


def test_update_weights_rejects_a_partial_state(engine, hf_model):
    state = {k: v for k, v in hf_model.state_dict().items() if "layers.1." not in k}
    with pytest.raises(ValueError, match="missing=.*layers.1"):
        engine.update_weights(state)
    with pytest.raises(ValueError, match="unexpected=.*extra"):
        engine.update_weights({**hf_model.state_dict(), "extra.weight": torch.zeros(1)})


def test_sampling_logprobs_match_teacher_forcing(engine, hf_model, prompt_ids):
    n, temperature = 4, 0.7
    outputs = engine.generate(prompt_ids, SamplingParams(n=n, temperature=temperature, max_tokens=12))
    assert len(outputs) == len(prompt_ids) * n
    assert [o.prompt_index for o in outputs] == [i for i in range(len(prompt_ids)) for _ in range(n)]
    assert len({tuple(o.response_ids) for o in outputs[:n]}) > 1, "n samples of one prompt are all equal"
    for o in outputs:
        assert len(o.logprobs) == len(o.response_ids) > 0
        assert o.finish_reason == ("length" if len(o.response_ids) == 12 and o.response_ids[-1] not in
                                   engine.stop_token_ids else "stop")
        expected = _teacher_forced_logprobs(hf_model, prompt_ids[o.prompt_index], o.response_ids, temperature)
        torch.testing.assert_close(torch.tensor(o.logprobs), expected, rtol=0, atol=LOGPROB_ATOL)
        # Not the temperature-1 values: the test can tell the two conventions apart.
        raw = _teacher_forced_logprobs(hf_model, prompt_ids[o.prompt_index], o.response_ids, 1.0)
        assert (torch.tensor(o.logprobs) - raw).abs().max() > 10 * LOGPROB_ATOL


def test_sampling_seeds_differ_per_call_and_repeat_on_rerun(engine, prompt_ids):
    params = SamplingParams(n=2, temperature=1.0, max_tokens=12)
    calls = engine._num_generate_calls
    first = [o.response_ids for o in engine.generate(prompt_ids, params)]
    second = [o.response_ids for o in engine.generate(prompt_ids, params)]
    assert first != second
    engine._num_generate_calls = calls  # what a fresh engine with the same seed would be at this call
    assert [o.response_ids for o in engine.generate(prompt_ids, params)] == first


def test_explicit_seed_repeats_and_leaves_the_engine_sequence_alone(engine, prompt_ids):
    params = SamplingParams(n=2, temperature=1.0, max_tokens=12, seed=123)
    calls = engine._num_generate_calls
    first = [o.response_ids for o in engine.generate(prompt_ids, params)]
    assert [o.response_ids for o in engine.generate(prompt_ids, params)] == first
    other = SamplingParams(n=2, temperature=1.0, max_tokens=12, seed=124)
    assert [o.response_ids for o in engine.generate(prompt_ids, other)] != first
    assert engine._num_generate_calls == calls


def test_max_tokens_gives_length(engine, prompt_ids):
    outputs = engine.generate(prompt_ids, SamplingParams(temperature=0.0, max_tokens=3))
    for o in outputs:  # "stop" only where the EOS came within 3 tokens
        stopped = o.response_ids[-1] in engine.stop_token_ids
        assert o.finish_reason == ("stop" if stopped else "length") and (stopped or len(o.response_ids) == 3)
    assert any(o.finish_reason == "length" for o in outputs)


def test_stop_token_ends_the_sample_and_is_kept(engine, prompt_ids):
    greedy = engine.generate(prompt_ids, SamplingParams(temperature=0.0, max_tokens=16))
    # A non-EOS token that first appears mid-response in a greedy output: stopping on it cuts the output there.
    index, position = next((i, j) for i, o in enumerate(greedy) for j in range(1, len(o.response_ids))
                           if o.response_ids[j] not in o.response_ids[:j] + list(engine.stop_token_ids))
    stop = greedy[index].response_ids[position]
    outputs = engine.generate(prompt_ids, SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=(stop,)))
    cut = outputs[index]
    assert cut.finish_reason == "stop" and cut.response_ids == greedy[index].response_ids[: position + 1]
    assert cut.logprobs == pytest.approx(greedy[index].logprobs[: position + 1], abs=LOGPROB_ATOL)
    assert any(g.finish_reason == "stop" for g in greedy), "no EOS in the greedy outputs: nothing to replace"
    for o in outputs:  # the explicit stop id replaces the EOS: only it ends a sample
        assert stop not in o.response_ids[:-1]
        assert o.finish_reason == ("stop" if o.response_ids[-1] == stop else "length")
        assert o.finish_reason == "stop" or len(o.response_ids) == 16


@torch.no_grad()
def test_top_k_logprobs_are_renormalised_over_the_kept_tokens(engine, hf_model, prompt_ids):
    """The documented deviation from base.py's convention: with top-k, vLLM's processed logprobs are taken
    after masking, i.e. log softmax over the k kept tokens = convention - log(kept probability mass)."""
    k, temperature = 5, 0.7
    outputs = engine.generate(prompt_ids, SamplingParams(temperature=temperature, top_k=k, max_tokens=8))
    for o in outputs:
        ids = torch.tensor([prompt_ids[o.prompt_index] + o.response_ids])
        scaled = hf_model(ids).logits[0, len(prompt_ids[o.prompt_index]) - 1 : -1] / temperature  # (R, V)
        kept = scaled.topk(k, dim=-1).values  # (R, k)
        chosen = scaled.gather(-1, torch.tensor(o.response_ids)[:, None])[:, 0]  # (R,)
        assert (chosen[:, None] >= kept[:, -1:]).all(), "a sampled token outside the top k"
        torch.testing.assert_close(torch.tensor(o.logprobs), chosen - kept.logsumexp(-1), rtol=0, atol=LOGPROB_ATOL)
        assert (torch.tensor(o.logprobs) >= chosen - scaled.logsumexp(-1) - LOGPROB_ATOL).all()
