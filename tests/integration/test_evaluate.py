"""The evaluation stage for real: vLLM and transformers engines in Ray actors on one tiny fp32 model give the
same greedy responses and accuracy; n > 1 adds mean/best/maj@n per data_source; results reach the `evals` view
and the base-vs-RL comparison. One Ray instance and one evaluation per engine for the module."""

from __future__ import annotations

from importlib.util import find_spec

import pytest

from infra.config import load_config
from infra.sql import query
from infra.store import ArtifactStore
from infra.trajectories import EVAL_COLUMNS, RunTables
from stages.evaluate import ALL, comparison_markdown, comparison_rows, eval_rows, evaluate_model, summary
from tests.conftest import TINY_OVERRIDES
from tests.integration.test_merge import spread_model
from tests.tolerances import greedy_margin

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_cluster"),
              pytest.mark.skipif(find_spec("vllm") is None, reason="vLLM is not installed")]

N = 4
NUM_PROMPTS = 12
# A reward that a random model earns about half the time (accuracy strictly between 0 and 1, so equal accuracy
# of the two engines says something), through the custom-function path that training uses too.
REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info):
    return float((len(solution_str) + len(str(ground_truth))) % 2)
'''


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory):
    return spread_model(tiny_model_dir, tmp_path_factory.mktemp("eval-model"))


@pytest.fixture(scope="module")
def reward_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("reward") / "reward.py"
    path.write_text(REWARD)
    return path


def _config(reward_file, *extra):
    return load_config(None, TINY_OVERRIDES + [
        f"evaluate.max_samples={NUM_PROMPTS}", "evaluate.max_new_tokens=12", f"rl.reward.custom_path={reward_file}",
        "rl.reward.num_workers=1", *extra])


@pytest.fixture(scope="module")
def vllm_result(model_dir, tiny_data_dir, reward_file):
    cfg = _config(reward_file, "evaluate.engine=vllm", f"evaluate.n={N}", "evaluate.temperature=1.0")
    return evaluate_model(cfg, model_dir, tiny_data_dir / "validation.parquet")


@pytest.fixture(scope="module")
def hf_result(model_dir, tiny_data_dir, reward_file):
    return evaluate_model(_config(reward_file, "evaluate.engine=hf"), model_dir, tiny_data_dir / "validation.parquet")


@pytest.fixture(scope="module")
def cuda_result(model_dir, tiny_data_dir, reward_file):
    """Our engine (on the CPU here, fp32), as evaluate.engine=auto picks it on a GPU machine without vLLM."""
    return evaluate_model(_config(reward_file, "evaluate.engine=cuda"), model_dir, tiny_data_dir / "validation.parquet")


def _greedy(result):
    return [s for s in result.samples if not s["sampled"]]


def hf_greedy_margin(model_dir, data_dir, reward_file) -> float:
    """`greedy_margin` along transformers' greedy responses to the evaluated prompts."""
    from stages.data_prep import load_prompts
    from stages.model.loading import load_model, load_tokenizer
    from stages.rollout.base import SamplingParams
    from stages.rollout.hf import HFRolloutEngine

    cfg = _config(reward_file)
    tokenizer, model = load_tokenizer(model_dir), load_model(model_dir, cfg.model, trainable=False)
    prompts = load_prompts(data_dir / "validation.parquet", tokenizer, cfg.data).prompt_ids[:NUM_PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=cfg.evaluate.max_new_tokens)
    outputs = HFRolloutEngine(model, tokenizer.pad_token_id, tokenizer.eos_token_id).generate(prompts, params)
    return greedy_margin(model, prompts, [o.response_ids for o in outputs])


def test_vllm_and_hf_give_the_same_greedy_responses_and_accuracy(vllm_result, hf_result, model_dir, tiny_data_dir,
                                                                  reward_file):
    assert (vllm_result.engine, hf_result.engine) == ("vllm", "hf")
    # no near-tie on the way: float32 engines within 1e-4 of each other (see test_vllm_engine) pick the same tokens
    assert hf_greedy_margin(model_dir, tiny_data_dir, reward_file) > 1e-4
    vllm_greedy, hf_greedy = _greedy(vllm_result), _greedy(hf_result)
    assert [s["prompt_index"] for s in vllm_greedy] == list(range(NUM_PROMPTS))
    assert [s["response"] for s in vllm_greedy] == [s["response"] for s in hf_greedy]
    assert len({s["response"] for s in hf_greedy}) > 1, "degenerate model: one response for every prompt"
    assert vllm_result.scores[ALL]["acc"] == hf_result.scores[ALL]["acc"]
    assert 0.0 < hf_result.acc < 1.0  # the reward is earned sometimes: equal accuracy is not 0 == 0
    # acc is the share of greedy responses scoring >= 1
    assert hf_result.acc == sum(s["score"] >= 1 for s in hf_greedy) / NUM_PROMPTS


def test_cuda_engine_gives_hf_greedy_responses(cuda_result, hf_result):
    assert cuda_result.engine == "cuda"
    assert [s["response"] for s in _greedy(cuda_result)] == [s["response"] for s in _greedy(hf_result)]
    assert cuda_result.scores == hf_result.scores


def test_sampling_adds_mean_best_maj_per_data_source(vllm_result):
    sampled = [s for s in vllm_result.samples if s["sampled"]]
    assert len(sampled) == NUM_PROMPTS * N
    [source] = {s["data_source"] for s in sampled}
    assert set(vllm_result.scores) == {source, ALL}
    assert vllm_result.num_prompts == {source: NUM_PROMPTS, ALL: NUM_PROMPTS}
    metrics = vllm_result.scores[source]
    assert set(metrics) == {"acc", f"mean@{N}", f"best@{N}", f"worst@{N}", f"maj@{N}"}
    by_prompt = [[s["score"] for s in sampled if s["prompt_index"] == i] for i in range(NUM_PROMPTS)]
    assert metrics[f"mean@{N}"] == pytest.approx(sum(map(sum, by_prompt)) / (NUM_PROMPTS * N))
    assert metrics[f"best@{N}"] == pytest.approx(sum(map(max, by_prompt)) / NUM_PROMPTS)
    assert metrics[f"worst@{N}"] == pytest.approx(sum(map(min, by_prompt)) / NUM_PROMPTS)
    assert metrics[f"mean@{N}"] <= metrics[f"best@{N}"] and 0 <= metrics[f"maj@{N}"] <= metrics[f"best@{N}"]
    assert len({tuple(scores) for scores in by_prompt}) > 1  # samples differ: the sampled metrics say something


def test_results_reach_the_evals_view_and_the_comparison(vllm_result, hf_result, tmp_path):
    store = ArtifactStore(str(tmp_path / "store"))
    records = {"base": summary(hf_result, "base", "model/base@0123456789abcdef", "dataset/d@0123456789abcdef",
                               "eval/base@0123456789abcdef"),
               "rl": summary(vllm_result, "rl", "model/rl@0123456789abcdef", "dataset/d@0123456789abcdef",
                             "eval/rl@0123456789abcdef")}
    columns = "run_id, label, model, engine, data_source, metric, value, num_prompts"
    assert query(str(tmp_path / "store"), f"SELECT {columns} FROM evals") == []  # no evaluations yet: no rows
    tables = RunTables(store, "demo-run")
    for label, record in records.items():
        assert set(eval_rows(record)[0]) | {"time"} == set(EVAL_COLUMNS)  # the schema the empty view declares
        tables.write_evals(label, eval_rows(record))
    rows = query(str(tmp_path / "store"), f"SELECT {columns} FROM evals ORDER BY label, data_source, metric")
    assert len(rows) == 2 + 10  # base: acc for the source and all; rl: acc + mean/best/worst/maj@4, twice
    assert {(r["label"], r["engine"], r["model"]) for r in rows} == {
        ("base", "hf", "model/base@0123456789abcdef"), ("rl", "vllm", "model/rl@0123456789abcdef")}
    got = {(r["label"], r["data_source"], r["metric"]): r["value"] for r in rows}
    assert got[("rl", ALL, f"best@{N}")] == vllm_result.scores[ALL][f"best@{N}"]
    assert got[("base", ALL, "acc")] == hf_result.acc
    assert {r["num_prompts"] for r in rows} == {NUM_PROMPTS} and {r["run_id"] for r in rows} == {"demo-run"}

    table = comparison_rows(records)
    acc = next(r for r in table if r["data_source"] == ALL and r["metric"] == "acc")
    assert acc == {"data_source": ALL, "metric": "acc", "base": hf_result.acc, "rl": vllm_result.acc}
    assert next(r for r in table if r["metric"] == f"maj@{N}")["base"] is None  # base was evaluated greedy only
    markdown = comparison_markdown(records)
    assert f"| {ALL} | acc | {100 * hf_result.acc:.1f}% | {100 * vllm_result.acc:.1f}% |" in markdown
    assert "`model/rl@0123456789abcdef`" in markdown
