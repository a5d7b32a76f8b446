"""The hf engine decodes by its SamplingParams alone, as vLLM and the cuda engine do.

transformers fills what a `generate` call leaves unset from the model's generation_config.json, which hub models and
our SFT exports carry: a repetition penalty there made "greedy" evaluation on the hf engine differ from argmax
decoding in 4 of 4 prompts.
"""

from __future__ import annotations

import torch

from stages.rollout.base import SamplingParams
from stages.rollout.hf import HFRolloutEngine
from tests.unit.test_cuda_engine import EOS, PAD, prompts, tiny_model


def argmax_decode(model, prompt: list[int], max_tokens: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_tokens):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
            if ids[-1] == EOS:
                break
    return ids[len(prompt):]


def test_greedy_ignores_the_models_generation_config():
    model = tiny_model()
    model.generation_config.repetition_penalty = 2.0
    model.generation_config.no_repeat_ngram_size = 2
    model.generation_config.min_new_tokens = 6
    engine = HFRolloutEngine(model, PAD, EOS)
    batch = prompts(4)
    outputs = engine.generate(batch, SamplingParams(n=1, temperature=0.0, max_tokens=6, stop_token_ids=(EOS,)))
    assert [o.response_ids for o in outputs] == [argmax_decode(model, p, 6) for p in batch]
    assert model.generation_config.repetition_penalty == 2.0  # the model's own file is left as it was



def test_calls_from_threads_leave_the_models_generation_config():
    """Each call swaps the model's generation_config for the library defaults. Two calls interleaved without the
    engine's lock restored each other's swap: the model kept the defaults, and its own settings were lost."""
    from concurrent.futures import ThreadPoolExecutor

    model = tiny_model()
    model.generation_config.repetition_penalty = 2.0
    engine = HFRolloutEngine(model, PAD, EOS)
    greedy = SamplingParams(n=1, temperature=0.0, max_tokens=4, stop_token_ids=(EOS,))
    batch = prompts(2)
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: engine.generate(batch, greedy), range(32)))
    assert model.generation_config.repetition_penalty == 2.0
    expected = [argmax_decode(model, p, 4) for p in batch]
    assert all([o.response_ids for o in outputs] == expected for outputs in results)


def test_logprobs_are_the_tempered_full_vocabulary_logprobs_of_each_sampled_token():
    """Taken step by step by a logits processor (before generate's temperature and top-p warpers): each equals
    log_softmax(logits / T) of a plain forward over the prompt and the tokens before it. The engine kept every step's
    (rows, vocab) logits before (hundreds of GiB at RL sizes for a 150k vocabulary)."""
    torch.manual_seed(0)
    model = tiny_model()
    engine = HFRolloutEngine(model, PAD, EOS)
    batch = prompts(3)
    params = SamplingParams(n=2, temperature=0.7, top_p=0.9, max_tokens=8, stop_token_ids=(EOS,), seed=5)
    calls, generate = [], model.generate
    model.generate = lambda **kwargs: calls.append(kwargs) or generate(**kwargs)
    outputs = engine.generate(batch, params)
    assert not calls[0].get("output_logits") and not calls[0].get("output_scores")  # no per-step logits kept
    assert len(outputs) == 6 and any(len(o.response_ids) > 1 for o in outputs)
    with torch.no_grad():
        for out in outputs:
            ids = torch.tensor([batch[out.prompt_index] + out.response_ids])
            logits = model(input_ids=ids).logits[0, len(batch[out.prompt_index]) - 1 : -1].float()  # (L, V)
            expected = torch.log_softmax(logits / 0.7, dim=-1).gather(-1, torch.tensor(out.response_ids)[:, None])
            assert torch.allclose(torch.tensor(out.logprobs), expected[:, 0], atol=1e-4)


def test_a_weight_sync_without_an_untied_head_is_refused():
    """Only a tied head may be left out (it is the embedding); an untied one would keep the stale head."""
    import pytest

    tied = tiny_model()
    names = [k for k in tied.state_dict() if not k.startswith("lm_head.")]
    HFRolloutEngine(tied, PAD, EOS).update_weights({k: tied.state_dict()[k] for k in names})  # fine
    untied = tiny_model()
    untied.config.tie_word_embeddings = False
    with pytest.raises(ValueError, match=r"missing=\['lm_head.weight'\]"):
        HFRolloutEngine(untied, PAD, EOS).update_weights({k: untied.state_dict()[k] for k in names})
