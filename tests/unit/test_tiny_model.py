"""Tiny models: built offline from a spec, deterministic by seed, ordinary HF folders with a chat template."""

import filecmp

import pytest
import torch

from infra.config import load_config
from infra.config_sections import TinyModelConfig
from stages.model.loading import chat_prompt_ids, load_model, load_tokenizer
from stages.model.tiny import build_tiny_model

TEXTS = ["What is 3 + 4 - 2?", "3 + 4 = 7\n7 - 2 = 5\n#### 5", "user", "assistant"]


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_tiny_model_builds_loads_and_generates(arch, tmp_path):
    spec = TinyModelConfig(arch=arch, hidden_size=64, intermediate_size=128)
    a = build_tiny_model(spec, TEXTS, seed=3, out_dir=tmp_path / "a")
    b = build_tiny_model(spec, TEXTS, seed=3, out_dir=tmp_path / "b")
    assert filecmp.cmp(a / "model.safetensors", b / "model.safetensors", shallow=False)  # same seed, same bytes
    assert filecmp.cmp(a / "tokenizer.json", b / "tokenizer.json", shallow=False)
    tokenizer = load_tokenizer(a)
    ids = chat_prompt_ids(tokenizer, [{"role": "user", "content": "What is 12 + 3?"}])
    text = tokenizer.decode(ids)
    assert text.endswith("<|im_start|>assistant\n") and "12 + 3" in text
    assert [tokenizer.decode([i]) for i in tokenizer("123", add_special_tokens=False)["input_ids"]] == ["1", "2", "3"]
    model = load_model(a, load_config(None).model, trainable=False)
    assert model.config.model_type == arch
    out = model.generate(torch.tensor([ids]), max_new_tokens=3, do_sample=False)
    assert out.shape == (1, len(ids) + 3)


def test_different_seed_gives_different_weights(tmp_path):
    spec = TinyModelConfig(hidden_size=64, intermediate_size=128)
    a = build_tiny_model(spec, TEXTS, seed=0, out_dir=tmp_path / "a")
    b = build_tiny_model(spec, TEXTS, seed=1, out_dir=tmp_path / "b")
    assert not filecmp.cmp(a / "model.safetensors", b / "model.safetensors", shallow=False)


def test_embedding_rows_give_a_hub_vocabulary_shape(tmp_path):
    spec = TinyModelConfig(hidden_size=64, intermediate_size=128, embedding_rows=1000)
    model = load_model(build_tiny_model(spec, TEXTS, seed=0, out_dir=tmp_path / "a"), load_config(None).model)
    assert model.get_input_embeddings().weight.shape[0] == 1000
    with pytest.raises(ValueError, match="embedding_rows=300 must be at least vocab_size=384"):
        TinyModelConfig(embedding_rows=300)


def test_stop_ids_are_the_generation_configs_eos_ids_and_the_tokenizers(tmp_path):
    """Rollouts, validation and evaluation stop where vLLM (and verl) stop by default: a model whose end of turn is
    not tokenizer.eos_token (Llama 3.1's <|eot_id|> and <|eom_id|>, Gemma's <end_of_turn>) ran on to the length
    limit when only the tokenizer's EOS stopped it."""
    import json

    from stages.model.loading import stop_token_ids

    assert stop_token_ids(tmp_path, 2) == (2,)  # no generation_config.json
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [202, 2, 7]}))
    assert stop_token_ids(tmp_path, 2) == (2, 7, 202)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 9}))
    assert stop_token_ids(tmp_path, None) == (9,)
    (tmp_path / "generation_config.json").write_text("{}")
    with pytest.raises(ValueError, match="no EOS token id"):
        stop_token_ids(tmp_path, None)
