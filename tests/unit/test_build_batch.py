"""build_batch: samples padded into verl's layout (prompts left-padded, responses right-padded)."""

import random

import pytest
import torch

from stages.batch import build_batch


def padded_by_hand(prompts, responses, logprobs, pad, masks):
    p, r = max(map(len, prompts)), max(map(len, responses))
    ids, attention = torch.full((len(prompts), p + r), pad), torch.zeros((len(prompts), p + r), dtype=torch.long)
    lp, response_mask = torch.zeros((len(prompts), r)), torch.zeros((len(prompts), r), dtype=torch.bool)
    for i, (prompt, response) in enumerate(zip(prompts, responses)):
        for j, token in enumerate(prompt):
            ids[i, p - len(prompt) + j], attention[i, p - len(prompt) + j] = token, 1
        for j, token in enumerate(response):
            ids[i, p + j], attention[i, p + j], lp[i, j], response_mask[i, j] = token, 1, logprobs[i][j], masks[i][j]
    return ids, attention, lp, response_mask


def test_layout_equals_padding_each_sample_by_hand():
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 99) for _ in range(rng.randint(1, 9))] for _ in range(13)]
    responses = [[rng.randrange(1, 99) for _ in range(rng.randint(1, 7))] for _ in range(13)]
    logprobs = [[-rng.random() for _ in r] for r in responses]
    masks = [[rng.random() < 0.8 for _ in r] for r in responses]  # multi-turn: tool tokens are not the model's
    batch = build_batch(prompts, responses, logprobs, pad_token_id=0, response_masks=masks)
    ids, attention, lp, response_mask = padded_by_hand(prompts, responses, logprobs, 0, masks)
    t = batch.tensors
    assert torch.equal(t["input_ids"], ids) and torch.equal(t["attention_mask"], attention)
    assert torch.equal(t["rollout_logprobs"], lp) and torch.equal(t["response_mask"], response_mask)
    assert torch.equal(t["position_ids"], (attention.cumsum(-1) - 1).clamp(min=0))


def test_mismatched_logprobs_and_empty_responses_are_refused():
    with pytest.raises(ValueError, match="one rollout logprob per token"):
        build_batch([[1], [2]], [[3, 4], [5]], [[0.0], [0.0, 0.0]], pad_token_id=0)  # same total, wrong rows
    with pytest.raises(ValueError, match="one response mask value per token"):
        build_batch([[1], [2]], [[3, 4], [5]], [[0.0, 0.0], [0.0]], pad_token_id=0, response_masks=[[1], [1, 0]])
    with pytest.raises(ValueError, match="at least one token"):
        build_batch([[1]], [[]], [[]], pad_token_id=0)
