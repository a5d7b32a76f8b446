"""RewardModelScorer on a tiny random Qwen2 classifier saved and loaded back: a reference forward, determinism,
batch-size and padding invariance, and refusal of a checkpoint without a reward head."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2ForSequenceClassification

from stages.model.tiny import train_tokenizer
from stages.rewards.reward_model import RewardModelScorer

TEXTS = [f"What is {a} + {b}? The answer is {a + b}." for a in range(20) for b in range(20)]
PROMPTS = [
    [{"role": "user", "content": "What is 2 + 3?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 12 + 7?"}],
    [{"role": "user", "content": "What is 1 + 1?"}],
]
RESPONSES = ["5", "The answer is 19. " * 6, "The answer is 2."]  # very different lengths: padding in a batch
# Scores of ~0.03 from a float32 model of width 32 (weights of std 0.02): computed with other padding and batch
# shapes, they differ by float32 rounding, ~1e-8; a wrong token or position changes them by ~1e-3 or more.
SCORE_ATOL = 1e-5


def _config(tokenizer) -> Qwen2Config:
    return Qwen2Config(vocab_size=(len(tokenizer) + 63) // 64 * 64, hidden_size=32, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                       max_position_embeddings=512, num_labels=1, pad_token_id=None)  # the scorer sets it


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    tokenizer = train_tokenizer(TEXTS, 300)
    torch.manual_seed(0)
    model = Qwen2ForSequenceClassification(_config(tokenizer))
    out = tmp_path_factory.mktemp("tiny-rm")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


def test_score_matches_an_unbatched_reference_forward(rm_dir):
    scorer = RewardModelScorer(rm_dir, batch_size=3)
    scores = scorer.score(PROMPTS, RESPONSES)
    tok, model = scorer.tokenizer, scorer.model
    for prompt, response, score in zip(PROMPTS, RESPONSES, scores):
        # ChatML written out by hand; the score is the head applied to the last token's hidden state
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in prompt)
        text += f"<|im_start|>assistant\n{response}<|im_end|>\n"
        ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            hidden = model.model(input_ids=ids).last_hidden_state[0, -1]  # (H,)
            expected = model.score(hidden)[0].item()
        assert score == pytest.approx(expected, abs=SCORE_ATOL)
    assert max(scores) - min(scores) > 1e-3  # the responses really get different scores


def test_deterministic_and_batch_size_and_padding_invariant(rm_dir):
    one = RewardModelScorer(rm_dir, batch_size=1).score(PROMPTS, RESPONSES)  # no padding at all
    three = RewardModelScorer(rm_dir, batch_size=3).score(PROMPTS, RESPONSES)  # short ones right-padded
    again = RewardModelScorer(rm_dir, batch_size=3).score(PROMPTS, RESPONSES)
    assert three == again
    assert three == pytest.approx(one, abs=SCORE_ATOL)
    # the same sample next to a much longer one (more padding) keeps its score
    padded = RewardModelScorer(rm_dir, batch_size=2).score([PROMPTS[0], PROMPTS[1]], [RESPONSES[0], "x " * 200])
    assert padded[0] == pytest.approx(one[0], abs=SCORE_ATOL)


def test_pad_token_is_set_on_the_model_config(rm_dir):
    scorer = RewardModelScorer(rm_dir)
    assert scorer.model.config.pad_token_id == scorer.tokenizer.pad_token_id is not None
    assert scorer.tokenizer.padding_side == "right"


def test_refuses_a_language_model_and_mismatched_inputs(rm_dir, tmp_path):
    scorer = RewardModelScorer(rm_dir)
    with pytest.raises(ValueError, match="2 prompts but 1 responses"):
        scorer.score(PROMPTS[:2], RESPONSES[:1])
    with pytest.raises(ValueError, match="batch_size=0"):
        RewardModelScorer(rm_dir, batch_size=0)
    tokenizer = scorer.tokenizer
    Qwen2ForCausalLM(_config(tokenizer)).save_pretrained(tmp_path)  # a policy, no reward head
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="no trained classification head"):
        RewardModelScorer(str(tmp_path))


def test_a_transcript_longer_than_the_models_positions_is_scored_on_its_start(tmp_path, caplog):
    """A learned position table (GPT-2's 64 rows here) has no row past its end: the long transcript raised
    IndexError and ended the RL run. It is cut to the first 64 tokens, as verl's right truncation, and counted."""
    import logging

    from transformers import GPT2Config, GPT2ForSequenceClassification

    tokenizer = train_tokenizer(TEXTS, 300)
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=(len(tokenizer) + 63) // 64 * 64, n_embd=32, n_layer=1, n_head=4, n_positions=64,
                        num_labels=1)
    GPT2ForSequenceClassification(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    scorer = RewardModelScorer(str(tmp_path), batch_size=2)
    long = "The answer is 19. " * 40
    with caplog.at_level(logging.WARNING, logger="stages.rewards.reward_model"):
        short_score, long_score = scorer.score(PROMPTS[:2], ["5", long])
    assert "1 of 2 transcripts are longer than its 64 positions" in caplog.text
    ids = torch.tensor([scorer._encode(PROMPTS[1], long)[:64]])
    with torch.no_grad():
        expected = scorer.model(input_ids=ids).logits[0, 0].item()
    assert long_score == pytest.approx(expected, abs=SCORE_ATOL)
    assert short_score == pytest.approx(scorer.score(PROMPTS[:1], ["5"])[0], abs=SCORE_ATOL)
