"""Data prep: the three sources, verl's schema, bad rows, caps, and load_prompts' length handling."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data.synthetic import Problem, expression, generate
from infra.config_sections import ColumnMapping, DataConfig, SyntheticTaskConfig
from stages.data_prep import corpus_texts, load_prompts, run_data_prep
from stages.rewards import default_compute_score

SAMPLES = Path(__file__).resolve().parents[2] / "data" / "samples"
OUTPUTS = ("train.parquet", "validation.parquet", "sft_train.parquet", "sft_validation.parquet", "stats.json")
CHAT = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))


def synthetic_cfg(**task) -> DataConfig:
    task = {"num_train": 60, "num_validation": 20, **task}
    return DataConfig(source="synthetic", synthetic=SyntheticTaskConfig(**task))


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def rows(path: Path) -> list[dict]:
    return pq.read_table(path).to_pylist()


# --------------------------------------------------------------------------------------------------
# Synthetic


def test_synthetic_format_by_hand():
    problem = Problem((23, 45, 7), ("+", "-"))
    assert problem.question == "What is 23 + 45 - 7?"
    assert problem.response == "23 + 45 = 68\n68 - 7 = 61\n#### 61"
    # left to right: 3+4=7, 7*5=35, 35-2=33, 33*6=198; parentheses make standard precedence agree
    assert expression((3, 4, 5, 2, 6), ("+", "*", "-", "*")) == "((3 + 4) * 5 - 2) * 6"
    assert Problem((3, 4, 5, 2, 6), ("+", "*", "-", "*")).answer == 198
    assert expression((2, 3, 4), ("*", "+")) == "2 * 3 + 4"  # no parentheses needed
    assert Problem((5, 9), ("-",)).response == "5 - 9 = -4\n#### -4"


def test_synthetic_deterministic_by_seed(tmp_path):
    cfg = synthetic_cfg()
    run_data_prep(cfg, 7, tmp_path / "a")
    run_data_prep(cfg, 7, tmp_path / "b")
    run_data_prep(cfg, 8, tmp_path / "c")
    for name in OUTPUTS[:4]:
        assert pq.read_table(tmp_path / "a" / name).equals(pq.read_table(tmp_path / "b" / name))
        assert not pq.read_table(tmp_path / "a" / name).equals(pq.read_table(tmp_path / "c" / name))


@pytest.mark.parametrize("operators", [["+", "-"], ["+", "-", "*"]])
def test_synthetic_counts_answers_no_overlap(tmp_path, operators):
    cfg = synthetic_cfg(num_terms=4, max_operand=20, operators=operators)
    stats = run_data_prep(cfg, 0, tmp_path)
    assert (stats["num_train"], stats["num_validation"], stats["num_skipped_rows"]) == (60, 20, 0)
    assert json.loads((tmp_path / "stats.json").read_text()) == stats
    train, validation = rows(tmp_path / "train.parquet"), rows(tmp_path / "validation.parquet")
    sft = rows(tmp_path / "sft_train.parquet") + rows(tmp_path / "sft_validation.parquet")
    assert (len(train), len(validation), len(sft)) == (60, 20, 80)
    train_questions = {r["extra_info"]["question"] for r in train}
    assert len(train_questions) == 60
    assert not train_questions & {r["extra_info"]["question"] for r in validation}
    for row, sft_row in zip(train + validation, sft, strict=True):
        question = row["prompt"][0]["content"]
        assert question.startswith("What is ") and question.endswith("?")
        truth = row["reward_model"]["ground_truth"]
        assert int(truth) == eval(question[len("What is ") : -1])  # standard precedence, our own strings
        response = sft_row["response"]
        assert response.endswith(f"\n#### {truth}") and sft_row["prompt"] == row["prompt"]
        lines = response.split("\n")[:-1]
        assert len(lines) == 3  # num_terms - 1 steps
        for line in lines:  # each step `a op b = c` is right
            lhs, rhs = line.split(" = ")
            assert eval(lhs) == int(rhs)
        assert default_compute_score(row["data_source"], response, truth) == 1.0
    assert all(r["data_source"] == "synthetic/arithmetic" and r["ability"] == "math" for r in train)


def test_synthetic_problem_space_exhausted():
    # max_operand=2, num_terms=2, one operator: 2 * 2 = 4 distinct problems
    tiny = {"max_operand": 2, "num_terms": 2, "operators": ["+"]}
    train, validation = generate(SyntheticTaskConfig(num_train=3, num_validation=1, **tiny), seed=0)
    questions = sorted(p.question for p in train + validation)
    assert questions == ["What is 1 + 1?", "What is 1 + 2?", "What is 2 + 1?", "What is 2 + 2?"]
    with pytest.raises(ValueError, match=r"5 exceeds the 4 distinct problems.*raise data.synthetic.max_operand"):
        generate(SyntheticTaskConfig(num_train=4, num_validation=1, **tiny), seed=0)


def test_caps_counted(tmp_path):
    cfg = synthetic_cfg().model_copy(update={"max_train_samples": 10, "max_validation_samples": 5})
    stats = run_data_prep(cfg, 0, tmp_path)
    assert (stats["num_train"], stats["num_validation"]) == (10, 5)
    assert (stats["num_train_dropped_by_cap"], stats["num_validation_dropped_by_cap"]) == (50, 15)
    assert len(rows(tmp_path / "sft_train.parquet")) == 10


def test_shortcut_rows_are_extra_sft_rows_only(tmp_path):
    cfg = synthetic_cfg(num_train=40, shortcut_fraction=0.6)
    stats = run_data_prep(cfg, 0, tmp_path)
    sft, train = rows(tmp_path / "sft_train.parquet"), rows(tmp_path / "train.parquet")
    shortcuts = [r for r in sft if r["response"].startswith("####")]
    assert len(train) == 40 and stats["num_sft_extra"] == len(shortcuts) == 60  # 60 / (40 + 60) = 0.6
    worked = {r["prompt"][0]["content"]: r["response"] for r in sft if not r["response"].startswith("####")}
    assert sorted(worked) == sorted(r["prompt"][0]["content"] for r in train)  # every problem keeps its work
    for r in shortcuts:  # a shortcut answers a training problem, with its right answer and no work
        assert r["response"] == "#### " + worked[r["prompt"][0]["content"]].rsplit("#### ", 1)[1]
    assert all("=" in r["extra_info"]["answer"] for r in train)  # RL rows keep the worked reference answer


# --------------------------------------------------------------------------------------------------
# GSM8K


def test_gsm8k_folder_schema_and_ground_truth(tmp_path):
    src = tmp_path / "gsm8k"
    src.mkdir()
    shutil.copy(SAMPLES / "gsm8k_sample.jsonl", src / "train.jsonl")
    shutil.copy(SAMPLES / "gsm8k_test_sample.jsonl", src / "test.jsonl")
    stats = run_data_prep(DataConfig(source="gsm8k", gsm8k_path=str(src)), 0, tmp_path / "out")
    assert (stats["num_train"], stats["num_validation"]) == (21, 8)
    table = pq.read_table(tmp_path / "out" / "train.parquet")
    extra_info = [("split", pa.string()), ("index", pa.int64()), ("question", pa.string()), ("answer", pa.string())]
    assert table.schema == pa.schema(
        [
            ("data_source", pa.string()),
            ("prompt", CHAT),
            ("ability", pa.string()),
            ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
            ("extra_info", pa.struct(extra_info)),
        ]
    )
    sft_schema = pq.read_schema(tmp_path / "out" / "sft_train.parquet")
    assert sft_schema == pa.schema([("prompt", CHAT), ("response", pa.string())])
    train = table.to_pylist()
    first = train[0]
    assert first["data_source"] == "openai/gsm8k"
    instruction = 'Let\'s think step by step and output the final answer after "####".'
    assert first["prompt"] == [{"role": "user", "content": f"{first['extra_info']['question']} {instruction}"}]
    assert first["reward_model"] == {"style": "rule", "ground_truth": "126"}
    assert first["extra_info"]["split"] == "train" and first["extra_info"]["index"] == 0
    assert first["extra_info"]["answer"].endswith("#### 126")
    assert train[4]["reward_model"]["ground_truth"] == "1400"  # "#### 1,400": comma stripped
    assert train[7]["reward_model"]["ground_truth"] == "1.25"
    validation = rows(tmp_path / "out" / "validation.parquet")
    assert validation[5]["reward_model"]["ground_truth"] == "1800"  # "#### 1,800"
    assert {r["extra_info"]["split"] for r in validation} == {"validation"}
    sft = rows(tmp_path / "out" / "sft_train.parquet")
    assert sft[0]["response"] == first["extra_info"]["answer"]
    # every reference answer scores 1.0 with the gsm8k scorer
    for s, r in zip(sft, train, strict=True):
        assert default_compute_score("openai/gsm8k", s["response"], r["reward_model"]["ground_truth"]) == 1.0
    corpus = corpus_texts(tmp_path / "out")
    assert {"user", "assistant", "system", sft[0]["response"], first["prompt"][0]["content"]} <= set(corpus)


def test_gsm8k_samples_folder_and_single_file_split(tmp_path):
    stats = run_data_prep(DataConfig(source="gsm8k", gsm8k_path=str(SAMPLES)), 0, tmp_path / "a")
    assert (stats["num_train"], stats["num_validation"]) == (21, 8)  # "test" in the file name
    cfg = DataConfig(source="gsm8k", gsm8k_path=str(SAMPLES / "gsm8k_sample.jsonl"), validation_fraction=0.2)
    stats = run_data_prep(cfg, 0, tmp_path / "b")
    assert (stats["num_train"], stats["num_validation"]) == (17, 4)  # round(0.2 * 21) = 4
    indices = [r["extra_info"]["index"] for r in rows(tmp_path / "b" / "train.parquet")]
    held_out = [r["extra_info"]["index"] for r in rows(tmp_path / "b" / "validation.parquet")]
    assert sorted(indices + held_out) == list(range(21)) and indices == sorted(indices)


def test_gsm8k_hub_id(tmp_path, monkeypatch):
    """The hub branch, with load_dataset answered by an in-memory DatasetDict of the samples (no network)."""
    import datasets

    def load_dataset(path, name):
        assert (path, name) == ("openai/gsm8k", "main")
        files = {"train": "gsm8k_sample.jsonl", "test": "gsm8k_test_sample.jsonl"}
        splits = {k: [json.loads(line) for line in (SAMPLES / f).read_text().splitlines()] for k, f in files.items()}
        return datasets.DatasetDict({k: datasets.Dataset.from_list(v) for k, v in splits.items()})

    monkeypatch.chdir(tmp_path)  # so that no local folder named openai/gsm8k can shadow the hub id
    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    stats = run_data_prep(DataConfig(source="gsm8k"), 0, tmp_path / "out")
    assert (stats["num_train"], stats["num_validation"]) == (21, 8)
    assert rows(tmp_path / "out" / "validation.parquet")[5]["reward_model"]["ground_truth"] == "1800"


def test_gsm8k_path_neither_local_nor_hub(tmp_path):
    with pytest.raises(ValueError, match="neither a local file/folder nor a hub id"):
        run_data_prep(DataConfig(source="gsm8k", gsm8k_path=str(tmp_path / "nope" / "x" / "y")), 0, tmp_path)


# --------------------------------------------------------------------------------------------------
# User files


def test_file_with_column_mapping(tmp_path):
    data = write_jsonl(tmp_path / "mine.jsonl", [
        {"q": "What is 2 + 2?", "a": "4", "src": "mytask", "r": "2 + 2 = 4\n#### 4"},
        {"q": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Sum 1000 and 234."}],
         "a": "1000 + 234 = 1234\n#### 1,234", "src": "mytask", "r": "#### 1234"},
        {"q": "Name the capital of France.", "a": "Paris", "src": "geo", "r": "Paris"},
        {"q": "What is 10 / 4?", "a": "so #### \\frac{5}{2}", "src": "math", "r": "#### \\frac{5}{2}"},
    ])  # fmt: skip
    columns = ColumnMapping(question="q", answer="a", response="r", data_source="src")
    cfg = DataConfig(source="file", path=str(data), columns=columns, validation_fraction=0.25)
    stats = run_data_prep(cfg, 0, tmp_path / "out")
    assert (stats["num_train"], stats["num_validation"]) == (3, 1)
    out = rows(tmp_path / "out" / "train.parquet") + rows(tmp_path / "out" / "validation.parquet")
    by_index = {r["extra_info"]["index"]: r for r in out}
    assert by_index[0]["prompt"] == [{"role": "user", "content": "What is 2 + 2?"}]
    assert by_index[1]["prompt"][0] == {"role": "system", "content": "Be brief."}
    assert by_index[1]["extra_info"]["question"] == "Sum 1000 and 234."
    truths = {i: r["reward_model"]["ground_truth"] for i, r in by_index.items()}
    assert truths == {0: "4", 1: "1234", 2: "Paris", 3: "\\frac{5}{2}"}  # "#### 1,234" -> "1234"
    assert {i: r["data_source"] for i, r in by_index.items()} == {0: "mytask", 1: "mytask", 2: "geo", 3: "math"}
    sft = rows(tmp_path / "out" / "sft_train.parquet") + rows(tmp_path / "out" / "sft_validation.parquet")
    assert {s["response"] for s in sft} == {"2 + 2 = 4\n#### 4", "#### 1234", "Paris", "#### \\frac{5}{2}"}


def test_file_verl_schema_passthrough(tmp_path):
    verl_rows = [
        {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"Q{i}?"}], "ability": "math",
         "reward_model": {"style": "rule", "ground_truth": str(i)},
         "extra_info": {"split": "train", "index": 100 + i, "answer": f"#### {i}", "question": f"Q{i}?",
                        "difficulty": i % 3}}
        for i in range(10)
    ]  # fmt: skip
    pq.write_table(pa.Table.from_pylist(verl_rows), tmp_path / "verl.parquet")
    cfg = DataConfig(source="file", path=str(tmp_path / "verl.parquet"), validation_fraction=0.2)
    stats = run_data_prep(cfg, 3, tmp_path / "out")
    assert (stats["num_train"], stats["num_validation"]) == (8, 2)
    out = rows(tmp_path / "out" / "train.parquet") + rows(tmp_path / "out" / "validation.parquet")
    for row in out:
        i = row["extra_info"]["index"] - 100
        assert row["prompt"] == [{"role": "user", "content": f"Q{i}?"}]
        assert row["reward_model"]["ground_truth"] == str(i)
        assert row["extra_info"]["difficulty"] == i % 3  # unknown extra_info keys pass through
    assert sorted(r["extra_info"]["index"] for r in out) == list(range(100, 110))
    assert {s["response"] for s in rows(tmp_path / "out" / "sft_train.parquet")} <= {f"#### {i}" for i in range(10)}


def test_caps_draw_rows_at_random_not_the_files_first(tmp_path):
    """A file sorted by source (500 gsm8k rows, then 500 math): the first 200 were all gsm8k, as verl's shuffled
    train_max_samples never is."""
    data = write_jsonl(tmp_path / "sorted.jsonl", [{"question": f"q{i}", "answer": f"#### {i}",
                                                    "src": "gsm8k" if i < 500 else "math"} for i in range(1000)])
    cfg = DataConfig(source="file", path=str(data), columns=ColumnMapping(data_source="src"), max_train_samples=200,
                     max_validation_samples=20)
    stats = run_data_prep(cfg, 0, tmp_path / "out")
    assert (stats["num_train"], stats["num_validation"]) == (200, 20)
    assert set(stats["data_sources"]) == {"gsm8k", "math"}
    again = run_data_prep(cfg, 0, tmp_path / "again")  # the same seed: the same rows
    assert rows(tmp_path / "again" / "train.parquet") == rows(tmp_path / "out" / "train.parquet") and again == stats


def test_empty_kwargs_in_verl_extra_info_are_written(tmp_path):
    """`create_kwargs: {}` (a tool without per-row arguments) is a struct without fields, which Parquet cannot
    write: data prep failed with pyarrow's ArrowNotImplementedError. Written as None, which the loop takes for {}."""
    verl_rows = [{"data_source": "mine", "prompt": [{"role": "user", "content": f"Q{i}?"}],
                  "reward_model": {"style": "rule", "ground_truth": str(i)}, "agent_name": "tool_agent",
                  "extra_info": {"tools_kwargs": {"clock": {"create_kwargs": {}}}, "other": {}}} for i in range(10)]
    data = write_jsonl(tmp_path / "verl.jsonl", verl_rows)
    run_data_prep(DataConfig(source="file", path=str(data), validation_fraction=0.2), 0, tmp_path / "out")
    [row, *_] = rows(tmp_path / "out" / "train.parquet")
    assert row["extra_info"]["tools_kwargs"] == {"clock": {"create_kwargs": None}}
    assert row["extra_info"]["other"] is None


def test_file_mapped_column_absent(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [{"question": "x", "solution": "1"}] * 3)
    with pytest.raises(ValueError, match=r"data.columns.answer='answer' is not a column.*\['question', 'solution'\]"):
        run_data_prep(DataConfig(source="file", path=str(data)), 0, tmp_path / "out")


def test_verl_rows_without_reward_model_name_the_missing_column(tmp_path):
    """A file with verl's 'prompt' but no 'reward_model' column: data prep and the command line (before the flow)
    say so and how to fix it, not that the default mapped column 'question' is missing."""
    from flows.post_train import preflight
    from infra.config import ConfigError, load_config

    prompt = [{"role": "user", "content": "What is 1 + 1?"}]
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": prompt, "answer": "2", "data_source": "mine"}] * 3)
    message = (rf"{data}: a 'prompt' column \(verl's\) but no 'reward_model' column \(columns: \['answer', "
               r"'data_source', 'prompt'\]\); verl's RL rows give their ground truth as reward_model = "
               r"\{'ground_truth': ...\}.*Add that column, or map your columns .*data.columns.question=prompt")
    with pytest.raises(ValueError, match=message):
        run_data_prep(DataConfig(source="file", path=str(data)), 0, tmp_path / "out")
    with pytest.raises(ConfigError, match=message):
        preflight(load_config(None, [f"storage.root={tmp_path / 'store'}", "data.source=file", f"data.path={data}"]))
    mapped = DataConfig(source="file", path=str(data), columns=ColumnMapping(question="prompt"))
    assert run_data_prep(mapped, 0, tmp_path / "out")["num_train"] == 2  # the fix it names works


# --------------------------------------------------------------------------------------------------
# Bad rows


BAD_ROWS = [
    {"question": "What is 1 + 1?", "answer": "2"},
    {"question": "What is 2 + 2?", "answer": "4"},
    {"question": "What is 3 + 3?"},  # row 2: no answer
    {"question": "What is 4 + 4?", "answer": 8.5},  # row 3: a fraction where text is expected
    {"question": "", "answer": "0"},  # row 4: empty prompt
    "{not json",  # row 5
    {"question": "What is 5 + 5?", "answer": "10"},
    {"question": "What is 6 + 6?", "answer": "12"},
]


def test_bad_row_error_names_row_and_field(tmp_path):
    data = write_jsonl(tmp_path / "data.jsonl", BAD_ROWS)
    out = tmp_path / "out"
    expected = (
        "row 2 (line 3) of data.jsonl: field 'answer' (mapped by data.columns.answer) is missing; "
        "fix the row or set data.bad_rows=skip"
    )
    with pytest.raises(ValueError) as info:
        run_data_prep(DataConfig(source="file", path=str(data)), 0, out)
    assert str(info.value) == expected
    assert not out.exists()  # nothing written before every row is valid


def test_bad_row_wrong_types(tmp_path):
    data = write_jsonl(tmp_path / "data.jsonl", [BAD_ROWS[0], BAD_ROWS[3]])
    with pytest.raises(ValueError, match=r"row 1 \(line 2\) of data.jsonl: field 'answer' .* is float 8.5, expected "
                                         r"text"):
        run_data_prep(DataConfig(source="file", path=str(data)), 0, tmp_path / "out")
    verl = [{"prompt": "not a list", "reward_model": {"ground_truth": "1"}, "data_source": "x"}]
    pq.write_table(pa.Table.from_pylist(verl), tmp_path / "v.parquet")
    with pytest.raises(ValueError, match=r"row 0 of v.parquet: field 'prompt' is str 'not a list', expected a chat"):
        run_data_prep(DataConfig(source="file", path=str(tmp_path / "v.parquet")), 0, tmp_path / "out")


def test_whole_number_answers_a_bom_and_null_data_sources_are_read(tmp_path):
    """An int answer column (parquet or JSONL from a spreadsheet) was a bad row each; a UTF-8 byte order mark made
    line 1 bad JSON; a null data_source failed instead of taking data.data_source, as the README says."""
    lines = [json.dumps({"question": f"What is {i} + 1?", "answer": i + 1, "src": None if i % 2 else "mine"})
             for i in range(10)]
    data = tmp_path / "data.jsonl"
    data.write_bytes(b"\xef\xbb\xbf" + "\n".join(lines).encode() + b"\n")
    cfg = DataConfig(source="file", path=str(data), columns=ColumnMapping(data_source="src"), data_source="fallback",
                     validation_fraction=0.2)
    stats = run_data_prep(cfg, 0, tmp_path / "out")
    assert stats["num_train"] + stats["num_validation"] == 10 and stats["num_skipped_rows"] == 0
    out = rows(tmp_path / "out" / "train.parquet") + rows(tmp_path / "out" / "validation.parquet")
    assert {r["extra_info"]["index"]: r["reward_model"]["ground_truth"] for r in out} == {
        i: str(i + 1) for i in range(10)}
    assert {r["extra_info"]["index"]: r["data_source"] for r in out} == {
        i: "fallback" if i % 2 else "mine" for i in range(10)}


def test_bad_rows_skip_counts(tmp_path, caplog):
    data = write_jsonl(tmp_path / "data.jsonl", BAD_ROWS)
    cfg = DataConfig(source="file", path=str(data), bad_rows="skip", validation_fraction=0.25)
    stats = run_data_prep(cfg, 0, tmp_path / "out")
    assert stats["num_skipped_rows"] == 4  # rows 2, 3, 4, 5
    assert stats["num_train"] + stats["num_validation"] == 4
    assert "skipped 4 bad rows" in caplog.text
    assert all((tmp_path / "out" / name).exists() for name in OUTPUTS)


def test_a_line_that_is_not_utf8_is_a_bad_row_that_names_its_line(tmp_path, caplog):
    data = tmp_path / "data.jsonl"
    good = [json.dumps({"question": f"What is {i} + 1?", "answer": str(i + 1)}).encode() for i in range(4)]
    data.write_bytes(b"\n".join([good[0], b'{"question": "caf\xe9 private text", "answer": "1"}', *good[1:]]) + b"\n")
    with pytest.raises(ValueError, match=r"row 1 \(line 2\) of data.jsonl: not UTF-8 text \(byte 18 of the line is "
                                         r"b'\\xe9'\); save the file as UTF-8") as info:
        run_data_prep(DataConfig(source="file", path=str(data)), 0, tmp_path / "out")
    assert "private" not in str(info.value)  # the row's content is never quoted
    stats = run_data_prep(DataConfig(source="file", path=str(data), bad_rows="skip"), 0, tmp_path / "out")
    assert stats["num_skipped_rows"] == 1 and "private" not in caplog.text


def test_an_unreadable_parquet_file_is_named(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "empty.parquet").write_bytes(b"")
    with pytest.raises(ValueError, match=r"empty.parquet: not a readable parquet file \(Parquet file size is 0"):
        run_data_prep(DataConfig(source="file", path=str(tmp_path / "d")), 0, tmp_path / "out")


def test_gsm8k_bad_row(tmp_path):
    good, bad = {"question": "R?", "answer": "2 + 3 = 5\n#### 5"}, {"question": "Q?", "answer": "4 apples"}
    data = write_jsonl(tmp_path / "g.jsonl", [good, bad, good, good])
    with pytest.raises(ValueError, match=r"row 1 \(line 2\) of g.jsonl: field 'answer' has no '#### <number>'"):
        run_data_prep(DataConfig(source="gsm8k", gsm8k_path=str(data)), 0, tmp_path / "out")
    cfg = DataConfig(source="gsm8k", gsm8k_path=str(data), bad_rows="skip")
    stats = run_data_prep(cfg, 0, tmp_path / "out")
    assert (stats["num_skipped_rows"], stats["num_train"], stats["num_validation"]) == (1, 2, 1)


# --------------------------------------------------------------------------------------------------
# Simulated users (data.interaction)


def gsm8k_interaction_reply(kwargs: dict, answer: str) -> tuple:
    """Gsm8kInteraction's (terminate, text, score, data) for `answer` to a row with interaction_kwargs `kwargs`, as
    the tool_agent loop calls it (the whole kwargs to start_interaction and generate_response)."""
    import asyncio

    from stages.agent.interactions import Gsm8kInteraction

    async def reply():
        user = Gsm8kInteraction({"name": kwargs["name"]})
        instance = await user.start_interaction("id", **kwargs)
        return await user.generate_response(instance, [{"role": "assistant", "content": answer}], **kwargs)

    return asyncio.run(reply())


def test_interaction_rows_synthetic(tmp_path, tokenizer):
    """verl's gsm8k interaction preprocessing on the synthetic task: every RL row of both splits on tool_agent, with
    interaction_kwargs {name, query, ground_truth}; the SFT splits are those of the run without it."""
    run_data_prep(synthetic_cfg(), 0, tmp_path / "plain")
    stats = run_data_prep(synthetic_cfg().model_copy(update={"interaction": "gsm8k"}), 0, tmp_path / "out")
    assert stats["interaction"] == "gsm8k"
    for split in ("train", "validation"):
        out, plain = rows(tmp_path / "out" / f"{split}.parquet"), rows(tmp_path / "plain" / f"{split}.parquet")
        assert len(out) == len(plain) and {r["agent_name"] for r in out} == {"tool_agent"}
        for row, before in zip(out, plain, strict=True):
            kwargs = row["extra_info"].pop("interaction_kwargs")
            assert kwargs == {"name": "gsm8k", "query": row["prompt"][-1]["content"],
                              "ground_truth": row["reward_model"]["ground_truth"]}
            assert {k: v for k, v in row.items() if k != "agent_name"} == before  # nothing else changed
    for name in ("sft_train.parquet", "sft_validation.parquet"):
        assert pq.read_table(tmp_path / "out" / name).equals(pq.read_table(tmp_path / "plain" / name))
    # the rows as the RL stage reads them, and the interaction they name: the reference answer ends the
    # conversation with score 1, another answer gets the try-again reply and 0
    prompts = load_prompts(tmp_path / "out" / "train.parquet", tokenizer, DataConfig(max_prompt_length=512))
    assert set(prompts.agent_names) == {"tool_agent"}
    kwargs = prompts.extra_infos[0]["interaction_kwargs"]
    sft = rows(tmp_path / "out" / "sft_train.parquet")
    assert gsm8k_interaction_reply(kwargs, sft[0]["response"])[::2] == (True, 1.0)
    assert gsm8k_interaction_reply(kwargs, f"#### {int(kwargs['ground_truth']) + 1}")[::2] == (False, 0.0)


def test_interaction_rows_keep_the_calculator_tools_kwargs(tmp_path):
    cfg = synthetic_cfg(num_terms=2, operators=["*"], max_operand=99, tool_call_fraction=0.5)
    run_data_prep(cfg.model_copy(update={"interaction": "gsm8k"}), 0, tmp_path)
    for row in rows(tmp_path / "train.parquet") + rows(tmp_path / "validation.parquet"):
        truth = row["reward_model"]["ground_truth"]
        assert row["agent_name"] == "tool_agent" and row["data_source"] == "synthetic/calculator"
        assert row["extra_info"]["tools_kwargs"] == {"calculator": {"create_kwargs": {"ground_truth": truth}}}
        assert row["extra_info"]["interaction_kwargs"]["ground_truth"] == truth
    assert any(r["turns"] for r in rows(tmp_path / "sft_train.parquet"))  # SFT still shows the calls


def test_interaction_rows_gsm8k(tmp_path):
    """GSM8K-format input, as verl's gsm8k_multiturn_w_interaction.py: the query is the prompt (question plus
    instruction), the ground truth the number after '####' (commas stripped)."""
    cfg = DataConfig(source="gsm8k", gsm8k_path=str(SAMPLES), interaction="gsm8k")
    run_data_prep(cfg, 0, tmp_path)
    train = rows(tmp_path / "train.parquet")
    assert {r["agent_name"] for r in train} == {"tool_agent"}
    first, comma = train[0], train[4]
    assert first["extra_info"]["interaction_kwargs"] == {
        "name": "gsm8k", "query": first["prompt"][0]["content"], "ground_truth": "126"}
    assert first["prompt"][0]["content"].startswith(first["extra_info"]["question"] + " Let's think")
    assert comma["extra_info"]["interaction_kwargs"]["ground_truth"] == "1400"  # "#### 1,400"
    assert gsm8k_interaction_reply(first["extra_info"]["interaction_kwargs"],
                                   first["extra_info"]["answer"])[::2] == (True, 1.0)
    validation = rows(tmp_path / "validation.parquet")
    assert all(r["extra_info"]["interaction_kwargs"]["name"] == "gsm8k" for r in validation)


def test_interaction_rows_verl_file_keeps_its_own(tmp_path):
    """A verl-format file: rows with interaction_kwargs of their own keep them; a row's own loop is kept, and rows
    on single_turn (or none) move to tool_agent, the loop that runs interactions."""
    own = {"name": "tutor", "ground_truth": "0", "level": "hard"}
    agents = ["my_loop.py:MyLoop", "single_turn", None, "tool_agent"]
    verl_rows = [
        {"data_source": "openai/gsm8k", "prompt": [{"role": "system", "content": "Be brief."},
                                                   {"role": "user", "content": f"Q{i}?"}],
         "reward_model": {"style": "rule", "ground_truth": str(i)}, "agent_name": agents[i % 4],
         "extra_info": {"index": i, "interaction_kwargs": own if i == 0 else None}}
        for i in range(8)
    ]  # fmt: skip
    pq.write_table(pa.Table.from_pylist(verl_rows), tmp_path / "verl.parquet")
    cfg = DataConfig(source="file", path=str(tmp_path / "verl.parquet"), validation_fraction=0.25,
                     interaction="gsm8k")
    run_data_prep(cfg, 0, tmp_path / "out")
    out = {r["extra_info"]["index"]: r for r in rows(tmp_path / "out" / "train.parquet") +
           rows(tmp_path / "out" / "validation.parquet")}
    assert sorted(out) == list(range(8))
    def given(kwargs: dict) -> dict:  # a parquet struct has every row's keys: the others' read back as None
        return {k: v for k, v in kwargs.items() if v is not None}

    assert given(out[0]["extra_info"]["interaction_kwargs"]) == own
    for i in range(1, 8):
        assert given(out[i]["extra_info"]["interaction_kwargs"]) == {"name": "gsm8k", "query": f"Q{i}?",
                                                                     "ground_truth": str(i)}
    assert {i: r["agent_name"] for i, r in out.items()} == {
        i: "my_loop.py:MyLoop" if i % 4 == 0 else "tool_agent" for i in range(8)}


def test_interaction_is_a_name():
    from infra.config import ConfigError, load_config

    users = "rl.multi_turn.interaction_config_path=recipes/interactions/gsm8k.yaml"
    assert load_config(None, ["data.interaction=gsm8k", users]).data.interaction == "gsm8k"
    assert load_config(None).data.interaction is None
    with pytest.raises(ConfigError, match="data.interaction"):
        load_config(None, ["data.interaction=''", users])
    with pytest.raises(ConfigError, match="rl.multi_turn.interaction_config_path is not set"):
        load_config(None, ["data.interaction=gsm8k"])


# --------------------------------------------------------------------------------------------------
# load_prompts


@pytest.fixture(scope="module")
def tokenizer():
    from stages.model.tiny import train_tokenizer  # imports transformers: keep it out of the other tests

    return train_tokenizer(["What is 1 + 2 + 3?", "user", "assistant", "a b c d e f g"], vocab_size=300)


@pytest.fixture
def prompts_parquet(tmp_path):
    """Prompts of 1, 4 and 8 words ('w w w ...'): their template lengths differ by the number of words."""
    verl_rows = [
        {"data_source": "synthetic/arithmetic", "prompt": [{"role": "user", "content": " ".join(["w"] * n)}],
         "reward_model": {"style": "rule", "ground_truth": str(n)}, "extra_info": {"index": n}}
        for n in (1, 4, 8)
    ]  # fmt: skip
    path = tmp_path / "p.parquet"
    pq.write_table(pa.Table.from_pylist(verl_rows), path)
    return path


def template_ids(tokenizer, content: str) -> list[int]:
    messages = [{"role": "user", "content": content}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_load_prompts_filter(tokenizer, prompts_parquet):
    full = [template_ids(tokenizer, " ".join(["w"] * n)) for n in (1, 4, 8)]
    assert len(full[0]) < len(full[1]) < len(full[2])
    cfg = DataConfig(max_prompt_length=len(full[1]), filter_overlong_prompts=True)
    prompts = load_prompts(prompts_parquet, tokenizer, cfg)
    assert (len(prompts), prompts.num_filtered, prompts.num_truncated) == (2, 1, 0)
    assert prompts.prompt_ids == full[:2]
    assert prompts.ground_truths == ["1", "4"] and prompts.data_sources == ["synthetic/arithmetic"] * 2
    assert prompts.extra_infos == [{"index": 1}, {"index": 4}]
    assert prompts.prompts[1] == [{"role": "user", "content": "w w w w"}]
    decoded = tokenizer.decode(prompts.prompt_ids[0])
    assert decoded == "<|im_start|>user\nw<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("side", ["left", "right"])
def test_load_prompts_truncation(tokenizer, prompts_parquet, side):
    full = template_ids(tokenizer, " ".join(["w"] * 8))
    limit = len(template_ids(tokenizer, "w"))
    cfg = DataConfig(max_prompt_length=limit, filter_overlong_prompts=False, truncation=side)
    prompts = load_prompts(prompts_parquet, tokenizer, cfg)
    assert (len(prompts), prompts.num_filtered, prompts.num_truncated) == (3, 0, 2)
    assert [len(ids) for ids in prompts.prompt_ids] == [limit] * 3
    kept = full[-limit:] if side == "left" else full[:limit]
    assert prompts.prompt_ids[2] == kept
    text = tokenizer.decode(prompts.prompt_ids[2])
    if side == "left":  # the end survives: the generation prompt
        assert text.endswith("<|im_end|>\n<|im_start|>assistant\n") and not text.startswith("<|im_start|>user")
    else:
        assert text.startswith("<|im_start|>user\nw w") and "assistant" not in text


def test_load_prompts_error_mode(tokenizer, prompts_parquet):
    full = template_ids(tokenizer, " ".join(["w"] * 4))
    cfg = DataConfig(max_prompt_length=len(full) - 1, filter_overlong_prompts=False, truncation="error")
    with pytest.raises(ValueError) as info:
        load_prompts(prompts_parquet, tokenizer, cfg)
    assert str(info.value) == (
        f"row 1 of p.parquet: the prompt is {len(full)} tokens, over data.max_prompt_length={len(full) - 1}; raise "
        "data.max_prompt_length, set data.truncation=left|right, or data.filter_overlong_prompts=true"
    )


def test_train_and_test_folders_split_by_their_names(tmp_path):
    """data/train/part-00000.jsonl and data/test/part-00000.jsonl were pooled and re-split by validation_fraction:
    most test rows trained on. The folder all files share does not count (its name may hold any word)."""
    from data.reading import split_files

    root = tmp_path / "test-runs" / "data"
    files = [root / "test" / "part-00000.jsonl", root / "train" / "part-00000.jsonl", root / "train" / "part-1.jsonl"]
    assert split_files(files) == {"train": files[1:], "validation": files[:1]}
    flat = [root / "test.jsonl", root / "train.jsonl"]
    assert split_files(flat) == {"train": flat[1:], "validation": flat[:1]}
    assert split_files([root / "a.jsonl", root / "b.jsonl"]) == {"all": [root / "a.jsonl", root / "b.jsonl"]}


def test_sft_targets_that_are_the_bare_ground_truth_are_warned_about(tmp_path, caplog):
    """verl's MATH/DAPO rows carry no extra_info.answer: SFT trained on `1/2`, which the reward scores 0."""
    bare = [{"data_source": "lighteval/MATH", "prompt": [{"role": "user", "content": f"Q{i}?"}],
             "reward_model": {"style": "rule", "ground_truth": f"\\frac{{1}}{{{i + 2}}}"}} for i in range(10)]
    pq.write_table(pa.Table.from_pylist(bare), tmp_path / "math.parquet")
    with caplog.at_level(logging.WARNING, logger="stages.data_prep"):
        run_data_prep(DataConfig(source="file", path=str(tmp_path / "math.parquet")), 0, tmp_path / "out")
    assert "SFT targets are the bare ground truth" in caplog.text and "data.columns.response" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="stages.data_prep"):
        run_data_prep(DataConfig(source="synthetic"), 0, tmp_path / "out2")  # worked solutions
    assert "bare ground truth" not in caplog.text


def test_a_shortcut_fraction_the_calculator_task_would_ignore_is_refused():
    with pytest.raises(ValueError, match=r"shortcut_fraction=0.5 has no effect with tool_call_fraction=0.3"):
        SyntheticTaskConfig(tool_call_fraction=0.3, shortcut_fraction=0.5)


def test_a_bare_numeric_ground_truth_loses_its_commas_as_one_after_hashes_does():
    """'1,000' in an answer column stayed '1,000', which no scorer matches (they strip commas from the model's
    answer): every such row scored 0."""
    from data.files import ground_truth_of

    assert ground_truth_of("1,000", "row 1 answer") == ground_truth_of("Total: 1,000 #### 1,000", "row 1") == "1000"
    assert ground_truth_of(" Paris ", "row 2 answer") == "Paris" and ground_truth_of("1,2-diene", "r") == "1,2-diene"
    assert default_compute_score("openai/gsm8k", "#### 1000", ground_truth_of("1,000", "row 1 answer")) == 1.0


def test_a_gsm8k_hub_snapshot_reads_its_main_config_only(tmp_path):
    """A local copy of the hub dataset holds main/ and socratic/ (the same questions, other answers): both were read,
    so every question came twice, in both splits."""
    for config in ("main", "socratic"):
        (tmp_path / "gsm8k" / config).mkdir(parents=True)
        shutil.copy(SAMPLES / "gsm8k_sample.jsonl", tmp_path / "gsm8k" / config / "train.jsonl")
        shutil.copy(SAMPLES / "gsm8k_test_sample.jsonl", tmp_path / "gsm8k" / config / "test.jsonl")
    stats = run_data_prep(DataConfig(source="gsm8k", gsm8k_path=str(tmp_path / "gsm8k")), 0, tmp_path / "out")
    assert (stats["num_train"], stats["num_validation"]) == (21, 8)  # as the one folder's files


def test_validation_prompts_that_are_also_training_prompts_are_counted(tmp_path, caplog):
    """A file with each question 4 times, split at random: nearly every held-out prompt was also trained on, and
    nothing said so."""
    questions = [{"question": f"What is {i} + {i}?", "answer": f"#### {2 * i}"} for i in range(10)]
    data = write_jsonl(tmp_path / "dup.jsonl", questions * 4)
    stats = run_data_prep(DataConfig(source="file", path=str(data), validation_fraction=0.25), 0, tmp_path / "out")
    held_out = {r["prompt"][0]["content"] for r in rows(tmp_path / "out" / "validation.parquet")}
    trained = {r["prompt"][0]["content"] for r in rows(tmp_path / "out" / "train.parquet")}
    shared = sum(r["prompt"][0]["content"] in trained for r in rows(tmp_path / "out" / "validation.parquet"))
    assert held_out & trained and shared > 0
    assert f"{shared} of {stats['num_validation']} validation prompts are also training prompts" in caplog.text
    caplog.clear()
    run_data_prep(DataConfig(source="synthetic"), 0, tmp_path / "synthetic")  # disjoint by construction
    assert "also training prompts" not in caplog.text
