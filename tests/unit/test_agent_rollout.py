"""The rollout component (stages/agent): single_turn gives exactly what the direct engine call and reward requests
gave before the component existed; rows pick their loop by agent_name; a user's loop loads by path; a batch of
mixed loops comes back prompt-major in row order."""

from __future__ import annotations

import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from stages.agent import AGENT_LOOPS, LoopContext, Rollout, Trajectory, agent_loop
from stages.data_prep import load_prompts
from stages.model.loading import load_model, load_tokenizer
from stages.rewards.pool import RewardPool, RewardRequest
from stages.rollout.base import SamplingParams
from stages.rollout.hf import HFRolloutEngine

USER_LOOP = '''
from stages.agent import AgentLoop, Trajectory


class EchoLoop(AgentLoop):
    """Answers each prompt with its own last two prompt tokens, a model turn then a masked 'tool' token."""

    def run_batch(self, ctx, samples):
        return [Trajectory(s.prompt_index, s.prompt_ids[-2:], [1, 0], [-0.5, 0.0], "stop", "echo", "echo")
                for s in samples for _ in range(ctx.params.n)]
'''


@pytest.fixture(scope="module")
def setup(tiny_config, tiny_data_dir, tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    engine = HFRolloutEngine(load_model(tiny_model_dir, tiny_config.model, trainable=False),
                             tokenizer.pad_token_id, tokenizer.eos_token_id)
    prompts = load_prompts(tiny_data_dir / "validation.parquet", tokenizer, tiny_config.data)
    with RewardPool(tiny_config.rl.reward) as pool:
        yield engine, tokenizer, prompts, pool


PARAMS = SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=5)


def test_single_turn_is_the_direct_engine_call_and_reward(setup):
    engine, tokenizer, prompts, pool = setup
    rows = [4, 0, 7, 2]
    trajectories = Rollout(engine.generate, tokenizer, pool).run(prompts, rows, PARAMS)
    outputs = engine.generate([prompts.prompt_ids[r] for r in rows], PARAMS)  # the call the stages made before
    # single-turn ids and logprobs are array views of the packed outputs: compared as lists
    assert [(t.prompt_index, list(t.response_ids), list(t.logprobs), t.finish_reason) for t in trajectories] == [
        (o.prompt_index, o.response_ids, o.logprobs, o.finish_reason) for o in outputs]
    texts = [tokenizer.decode(o.response_ids, skip_special_tokens=True) for o in outputs]
    assert [t.text for t in trajectories] == texts
    assert all(t.response_mask == [1] * len(t.response_ids) and t.agent_name == "single_turn" for t in trajectories)

    scored = Rollout(engine.generate, tokenizer, pool).score(prompts, rows, trajectories)
    direct = pool.score([RewardRequest(prompts.data_sources[rows[o.prompt_index]], text,
                                       prompts.ground_truths[rows[o.prompt_index]],
                                       prompts.extra_infos[rows[o.prompt_index]]) for o, text in zip(outputs, texts)])
    assert scored.scores == direct.scores and scored.result.errors == direct.errors


def test_decoding_all_responses_at_once_is_decoding_each(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    rng = random.Random(0)
    special = [tokenizer.eos_token_id, tokenizer.pad_token_id]
    sequences = [[rng.choice(special) if rng.random() < 0.1 else rng.randrange(len(tokenizer))
                  for _ in range(rng.randrange(1, 40))] for _ in range(50)]
    each = [tokenizer.decode(ids, skip_special_tokens=True) for ids in sequences]
    assert LoopContext(None, tokenizer, PARAMS).decode_all(sequences) == each


def test_a_tokenizer_that_cleans_up_spaces_decodes_as_decode_does():
    words = Tokenizer(models.WordLevel({"[UNK]": 0, "[EOS]": 1, "a": 2, ".": 3, "do": 4, "n't": 5}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    cleaning = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]", eos_token="[EOS]",
                                       clean_up_tokenization_spaces=True)
    sequences = [[2, 3, 4, 5, 1], [4, 5, 2, 3]]
    assert cleaning.backend_tokenizer.decode(sequences[0], skip_special_tokens=True) == "a . do n't"  # raw
    assert LoopContext(None, cleaning, PARAMS).decode_all(sequences) == ["a. don't", "don't a."]


def test_rows_choose_their_loop_and_come_back_in_row_order(setup, tiny_config, tiny_data_dir, tmp_path):
    engine, tokenizer, _, pool = setup
    loop_file = tmp_path / "my_loop.py"
    loop_file.write_text(USER_LOOP)
    rows = pq.read_table(tiny_data_dir / "validation.parquet").to_pylist()[:4]
    names = ["single_turn", f"{loop_file}:EchoLoop", None, f"{loop_file}:EchoLoop"]
    for row, name in zip(rows, names):
        row["agent_name"] = name
    data = tmp_path / "mixed.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data)
    prompts = load_prompts(data, tokenizer, tiny_config.data)
    assert prompts.agent_names == ["single_turn", f"{loop_file}:EchoLoop", "single_turn", f"{loop_file}:EchoLoop"]

    trajectories = Rollout(engine.generate, tokenizer, pool).run(prompts, [0, 1, 2, 3], PARAMS)
    assert [t.prompt_index for t in trajectories] == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    echo = [t for t in trajectories if t.prompt_index in (1, 3)]
    assert all(t.agent_name == "echo" and t.response_mask == [1, 0] for t in echo)
    single = [t for t in trajectories if t.prompt_index in (0, 2)]
    alone = Rollout(engine.generate, tokenizer, pool).run(prompts, [0, 2], PARAMS)
    assert [(list(t.response_ids), list(t.logprobs)) for t in single] == [
        (list(t.response_ids), list(t.logprobs)) for t in alone]


def test_unknown_or_wrong_loops_are_named(tmp_path):
    with pytest.raises(ValueError, match="unknown agent loop 'tool_agnet'; valid keys: .*single_turn"):
        agent_loop("tool_agnet")
    not_a_loop = tmp_path / "x.py"
    not_a_loop.write_text("class Thing:\n    pass\n")
    with pytest.raises(ValueError, match="not a subclass of stages.agent.AgentLoop"):
        agent_loop(f"{not_a_loop}:Thing")
    with pytest.raises(ValueError, match="has no 'Missing'"):
        agent_loop(f"{not_a_loop}:Missing")
    assert "single_turn" in AGENT_LOOPS.keys()


def test_a_trajectory_checks_its_lengths():
    with pytest.raises(ValueError, match="3 ids, 2 mask values and 3 logprobs differ"):
        Trajectory(0, [1, 2, 3], [1, 1], [0.0] * 3, "stop", "x")
