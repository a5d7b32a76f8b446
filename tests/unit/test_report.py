"""HTML run report (infra.report reads, infra.report_render renders) over real run tables written with
RunTables and read back through DuckDB: every plot is there as a decodable PNG, missing metrics give notes,
text is escaped, best/worst rollouts and the evaluation table hold hand-computed values, the report lands in
the store (local and S3), CLI exit codes."""

from __future__ import annotations

import base64
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from infra import report, report_render
from infra.store import ArtifactStore
from infra.trajectories import RunTables

PROJECT = Path(__file__).resolve().parents[2]
RUN = "rl-test"
EVIL = "<script>alert('x')</script> & 2"
# step -> scores of its 4 samples; the best sample of the run (score 1.0 at the last step) says EVIL
SCORES = {1: [0.0, 0.0, 1.0, 0.0], 2: [0.0, 1.0, 0.0, 0.5], 3: [1.0, 0.0, 1.0, 0.25], 4: [1.0, 1.0, 0.0, 1.0]}


def rollout_rows(step: int) -> list[dict]:
    rows = []
    for i, score in enumerate(SCORES[step]):
        response = EVIL if (step, i) == (4, 3) else f"answer {step}.{i}"
        rows.append({"group_id": f"{step}-0-{i // 2}", "sample_index": i % 2, "data_source": "synthetic",
                     "prompt": f"prompt {step}.{i}", "response": response, "ground_truth": "2",
                     "num_prompt_tokens": 5, "num_response_tokens": 3 + i, "score": score, "reward": score,
                     "advantage": score - 0.5, "old_logprob_mean": -0.4, "ref_logprob_mean": None,
                     "entropy_mean": 1.2, "kl_mean": None, "finish_reason": "stop", "policy_version": step - 1})
    return rows


def step_metrics(step: int, with_kl: bool) -> dict[str, float]:
    scores = SCORES[step]
    metrics = {"critic/score/mean": sum(scores) / 4, "critic/score/min": min(scores),
               "critic/score/max": max(scores), "critic/rewards/mean": sum(scores) / 4,
               "actor/entropy": 1.5 - 0.1 * step, "actor/grad_norm": 0.8 / step,
               "response_length/mean": 4.5, "response_length/min": 3, "response_length/max": 6,
               "timing_s/step": 3.0, "timing_s/gen": 1.5, "timing_s/reward": 0.2, "timing_s/update_actor": 1.0,
               "timing_s/old_log_prob": 0.3, "timing_s/sync": 0.1, "tool/calls": 2.0 * step, "tool/errors": 1.0,
               "num_turns/mean": 1.0 + 0.25 * step}
    if with_kl:
        metrics.update({"actor/ppo_kl": 0.001 * step, "actor/kl_loss": 0.002 * step})
    return metrics


def write_run(store: ArtifactStore, run_id: str = RUN, validation: bool = True, with_kl: bool = True) -> None:
    tables = RunTables(store, run_id)
    for step in SCORES:
        tables.write_rollouts(step, rollout_rows(step))
        metrics = step_metrics(step, with_kl)
        if validation and step % 2 == 0:
            tables.write_validation(step, [{"prompt_index": i, "data_source": "synthetic", "score": float(i < step),
                                            "response": "r"} for i in range(4)])
            metrics["val/acc/mean@1"] = step / 4
            metrics["val/synthetic/acc/mean@1"] = step / 4
            metrics["timing_s/testing"] = 0.5
        tables.write_metrics(step, metrics)


def write_evals(store: ArtifactStore, run_id: str = RUN) -> None:
    # per-sample rows; acc = share of greedy rows with score >= 1: base 1/4, sft 2/4, rl 3/4 (the sampled
    # row of rl, score 0, does not count)
    tables = RunTables(store, run_id)
    for label, hits in (("rl", 3), ("base", 1), ("sft", 2)):
        rows = [{"data_source": "synthetic", "prompt_index": i, "response": "r", "score": float(i < hits),
                 "sampled": False} for i in range(4)]
        if label == "rl":
            rows.append({"data_source": "synthetic", "prompt_index": 0, "response": "r", "score": 0.0,
                         "sampled": True})
        tables.write_evals(label, rows)


def images(page: str) -> dict[str, bytes]:
    """alt text -> PNG bytes of every embedded image."""
    found = re.findall(r'<img alt="([^"]*)" src="data:image/png;base64,([^"]+)">', page)
    return {alt: base64.b64decode(data) for alt, data in found}


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


@pytest.fixture
def local(tmp_path) -> ArtifactStore:
    return ArtifactStore(str(tmp_path / "store"), cache_dir=tmp_path / "cache")


def test_every_plot_is_an_embedded_png(local):
    write_run(local)
    page = report.build_report(local, RUN, title="demo <run>", extra={"model": "model/rl@0123"}).html
    pngs = images(page)
    for panel in report_render.PANELS:
        alts = [alt for alt in pngs if alt.startswith(panel.title + ":")]
        assert len(alts) == 1, (panel.title, list(pngs))
        # 6.4 x 3.4 in at 120 dpi; the timing panel (many phases, legend beside it) is twice as wide
        assert png_size(pngs[alts[0]]) == ((1536 if panel.wide else 768), 408)
    assert "This run logged none of" not in page
    assert "<title>demo &lt;run&gt;</title>" in page and "model/rl@0123" in page
    assert 'src="http' not in page and "<script" not in page  # self-contained, no scripts
    # legends name the series: the timing panel lists each phase, the KL panel both KL metrics
    timing = next(alt for alt in pngs if alt.startswith("Timing per phase"))
    assert all(f"timing_s/{p}" in timing for p in ("step", "gen", "reward", "update_actor", "testing"))
    assert "actor/ppo_kl, actor/kl_loss" in next(alt for alt in pngs if alt.startswith("KL:"))


def test_best_and_worst_rollouts_and_escaping(local):
    write_run(local)
    data = report.read_run(local, RUN, num_rollouts=3)
    # best: score 1.0, one sample per group first, latest step first: step 4's groups (4.0 and 4.1 share
    # group 4-0-0, so 4.1 waits), then step 3's first group
    assert [(r["step"], r["score"], r["prompt"]) for r in data.best] == [
        (4, 1.0, "prompt 4.0"), (4, 1.0, "prompt 4.3"), (3, 1.0, "prompt 3.0")]
    # worst: score 0.0, latest step first: step 4 has one (2), step 3 one (1), then step 2's first (0 of 0, 2)
    assert [(r["step"], r["score"], r["prompt"]) for r in data.worst] == [
        (4, 0.0, "prompt 4.2"), (3, 0.0, "prompt 3.1"), (2, 0.0, "prompt 2.0")]
    assert data.num_rollouts == 16 and data.rollout_steps == [1, 2, 3, 4]
    page = report_render.render(data, "t", None)
    assert "alert" in page and "<script>alert" not in page
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt; &amp; 2" in page
    assert "Best 3 (highest score)" in page and "Worst 3 (lowest score)" in page
    assert "Scores of the 16 rollouts range from 0 to 1." in page


def test_equal_scores_worst_does_not_repeat_best(local):
    tables = RunTables(local, "flat")
    rows = [{**row, "score": 0.0, "advantage": 0.0, "response": f"bell\x07 {i}"}
            for i, row in enumerate(rollout_rows(1))]
    tables.write_rollouts(1, rows)
    tables.write_metrics(1, {"critic/score/min": 0.0, "critic/score/max": 0.0})
    data = report.read_run(local, "flat", num_rollouts=3)
    # 4 samples, all score 0: best = the first sample of each group, then the second; worst = what is left
    assert [r["prompt"] for r in data.best] == ["prompt 1.0", "prompt 1.2", "prompt 1.1"]
    assert [r["prompt"] for r in data.worst] == ["prompt 1.3"]
    page = report_render.render(data, "t", None)
    assert "Worst 1 (lowest score)" in page and "range from 0 to 0: all equal" in page
    assert "bell\\x07 0" in page and "\x07" not in page  # a control character is shown, not embedded

def test_run_without_validation_or_kl_gets_notes(local):
    write_run(local, validation=False, with_kl=False)
    page = report.build_report(local, RUN).html
    titles = {alt.split(":")[0] for alt in images(page)}
    assert titles == {p.title for p in report_render.PANELS} - {"Validation accuracy", "KL"}
    notes = re.findall(r'<div class="panel note"><h3>([^<]+)</h3>', page)
    assert notes == ["Validation accuracy", "KL"]
    assert "rl.test_freq" in page and "rl.actor.use_kl_loss" in page  # the note says what logs them
    assert f"No evaluation rows for run {RUN}" in page


def test_validation_table_is_used_when_no_val_metrics(local):
    tables = RunTables(local, RUN)
    tables.write_metrics(1, {"critic/score/mean": 0.5, "actor/entropy": float("nan")})
    tables.write_validation(1, [{"score": 1.0}, {"score": 0.0}, {"score": 0.0}, {"score": 0.0}])
    tables.write_validation(3, [{"score": 1.0}, {"score": 1.0}, {"score": 0.0}, {"score": 1.0}])
    data = report.read_run(local, RUN)
    assert data.val_scores == [(1, 0.25), (3, 0.75)]  # 1/4 and 3/4
    page = report_render.render(data, "t", None)
    assert any(alt.startswith("Validation accuracy: val/score/mean") for alt in images(page))
    # entropy was logged, but only as NaN: a note, not empty axes
    assert "<h3>Entropy</h3>" in page


def test_eval_table_accuracy_per_model(local):
    write_run(local)
    write_evals(local)
    data = report.read_run(local, RUN)
    header, rows = report_render.eval_table(data.evals)
    assert header == ["model", "data_source", "acc", "samples"]
    assert rows == [["base", "synthetic", 0.25, 4], ["sft", "synthetic", 0.5, 4], ["rl", "synthetic", 0.75, 4]]
    page = report_render.render(data, "t", None)
    assert "<td>rl</td><td>synthetic</td><td>0.75</td><td>4</td>" in page


def test_eval_table_long_rows_side_by_side(local):
    # the layout of stages/evaluate.py: one row per (data_source, metric) of each model label
    tables = RunTables(local, "flow-run-1")
    for label, acc in (("sft", 0.5), ("rl", 0.75), ("base", 0.25)):
        tables.write_evals(label, [
            {"model": f"model/{label}@0123456789abcdef", "engine": "hf", "data_source": src, "metric": metric,
             "value": value, "num_prompts": 4}
            for src in ("all", "synthetic") for metric, value in (("acc", acc), ("mean@4", acc / 2))])
    RunTables(local, "older-run").write_evals("rl", [{"score": 1.0, "sampled": False}])  # another layout
    data = report.read_run(local, "flow-run-1")
    assert all(r["score"] is None for r in data.evals)  # the view's union: the other run's column is NULL here
    header, rows = report_render.eval_table(data.evals)
    assert header == ["data_source", "metric", "base", "sft", "rl"]
    assert sorted(rows) == [["all", "acc", 0.25, 0.5, 0.75], ["all", "mean@4", 0.125, 0.25, 0.375],
                            ["synthetic", "acc", 0.25, 0.5, 0.75], ["synthetic", "mean@4", 0.125, 0.25, 0.375]]
    page = report_render.render(data, "t", None)
    assert "<td>all</td><td>acc</td><td>0.25</td><td>0.5</td><td>0.75</td>" in page
    # rows of neither layout: a note naming their columns, the rest of the report still renders
    bad = report_render.RunData(RUN, {}, [], [], [], [{"label": "rl", "accuracy": 0.5}], 0)
    assert "evals rows with columns [&#x27;accuracy&#x27;, &#x27;label&#x27;]" in report_render.render(bad, "t", None)


def test_evals_of_another_run_id(local):
    write_run(local)
    write_evals(local, "flow-run-1")
    assert report.read_run(local, RUN).evals == []
    assert len(report.read_run(local, RUN, evals_run_id="flow-run-1").evals) == 13


@pytest.mark.parametrize("store", ["local", pytest.param("s3", marks=pytest.mark.s3)], indirect=True)
def test_write_report_saves_into_the_store(store):
    write_run(store)
    url, warnings = report.write_report(store, RUN, extra={"steps": 4})
    assert url == store.url(f"runs/{RUN}/report.html")
    saved = store.read_bytes(f"runs/{RUN}/report.html").decode()
    assert saved.startswith("<!DOCTYPE html>") and len(images(saved)) == len(report_render.PANELS)
    assert store.glob(f"runs/{RUN}/*") == [f"runs/{RUN}/report.html"]  # no temp file left


def test_unknown_run_lists_known_ids(local):
    write_run(local, "run-a")
    write_run(local, "run-b")
    with pytest.raises(report.UnknownRunError, match="run_id='nope'.*known run ids: run-a, run-b"):
        report.build_report(local, "nope")
    with pytest.raises(ValueError, match="run_id='../x'"):
        report.build_report(local, "../x")


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "infra.report", *args], cwd=PROJECT, capture_output=True,
                          text=True, timeout=120)


def test_cli_exit_codes(local, tmp_path):
    write_run(local)
    out = tmp_path / "out" / "report.html"
    done = cli("--root", local.root, "--run", RUN, "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert len(images(out.read_text())) == len(report_render.PANELS)
    done = cli("--root", local.root, "--run", RUN)  # into the store
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == local.url(f"runs/{RUN}/report.html")
    done = cli("--root", local.root, "--run", "missing")
    assert done.returncode == 2 and done.stdout == ""
    assert "run_id='missing'" in done.stderr and f"known run ids: {RUN}" in done.stderr
    assert cli("--root", local.root).returncode == 2  # argparse: --run is required


def test_no_signal_warning_is_a_visible_box(local):
    write_run(local)
    tables = RunTables(local, RUN)
    for step in (5, 6):  # two steps where every group had equal rewards; the loop warned at step 6
        tables.write_metrics(step, {"train/frac_groups_zero_std": 1.0, "train/frac_groups_all_wrong": 1.0,
                                    "train/frac_groups_all_correct": 0.0,
                                    **({"train/no_signal_warning": 2.0} if step == 6 else {})})
    page = report.build_report(local, RUN)
    assert len(page.warnings) == 1 and "steps 5-6" in page.warnings[0]
    assert '<div class="warning" role="alert">' in page.html and "steps 5-6" in page.html
    write_run(local, "rl-quiet")
    quiet = report.build_report(local, "rl-quiet")
    assert quiet.warnings == [] and 'role="alert"' not in quiet.html


def test_multi_turn_rollouts_show_their_turns(local):
    write_run(local)
    best = rollout_rows(4)[0]
    RunTables(local, RUN).write_turns(4, [
        {"group_id": best["group_id"], "sample_index": best["sample_index"], "turn": 0, "role": "assistant",
         "text": '<tool_call>{"name": "calculator"}</tool_call>', "num_tokens": 9},
        {"group_id": best["group_id"], "sample_index": best["sample_index"], "turn": 1, "role": "tool",
         "text": "84", "tool_name": "calculator", "error": False},
        {"group_id": best["group_id"], "sample_index": best["sample_index"], "turn": 2, "role": "assistant",
         "text": "#### 84", "num_tokens": 4}])
    data = report.read_run(local, RUN, num_rollouts=3)
    assert [t["role"] for t in data.best[0]["turns"]] == ["assistant", "tool", "assistant"]
    assert all(not r["turns"] for r in data.best[1:] + data.worst)
    page = report_render.render(data, "t", None)
    assert "turn 1: tool calculator" in page and "turn 2: assistant" in page and "#### 84" in page
    assert any(alt.startswith("Tool use:") and "tool/calls" in alt for alt in images(page))


def test_cli_out_takes_any_file_name_and_names_itself_in_errors(local, tmp_path, capsys):
    """--out is written atomically next to itself (no store: a folder such as 'out [1]' is no storage.root); a
    folder or an unwritable path is an error naming --out."""
    write_run(local)
    out = tmp_path / "out [1]" / "r é.html"
    assert report.main(["--root", local.root, "--run", RUN, "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert len(images(out.read_text())) == len(report_render.PANELS)
    assert [p.name for p in out.parent.iterdir()] == [out.name]  # no temporary file left
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    for bad, why in ((out.parent, "is a folder; give the report's file name, e.g. --out "),
                     (a_file / "r.html", "cannot write the report there")):
        assert report.main(["--root", local.root, "--run", RUN, "--out", str(bad)]) == 1
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.startswith(f"error: --out {str(bad)!r}") and why in captured.err
        assert "storage.root" not in captured.err
    assert a_file.read_text() == "x" and [p.name for p in out.parent.iterdir()] == [out.name]


def test_the_accuracy_panel_keeps_its_range_only_for_accuracies():
    """A reward without acc puts its score in val/acc/*: -1/+1 scores were drawn off the fixed 0..1 axes."""
    from matplotlib.figure import Figure

    panel = next(p for p in report_render.PANELS if p.ylim)
    for values, low in (([0.2, 0.5, 0.9], panel.ylim[0]), ([-0.8, -0.2, 0.4], -0.8)):
        ax = Figure().add_subplot()
        ax.plot([1, 2, 3], values, label="val/acc/mean@1")
        report_render._style(ax, panel, values)
        assert ax.get_ylim()[0] <= low and ax.get_ylim()[1] >= max(values)
    fixed = Figure().add_subplot()
    fixed.plot([1, 2], [0.2, 0.5], label="val/acc/mean@1")
    report_render._style(fixed, panel, [0.2, 0.5])
    assert fixed.get_ylim() == panel.ylim


def test_a_rollout_cards_facts_hold_no_control_characters_and_are_cut():
    html = report_render.rollout_cards("t", [{"step": 1, "ground_truth": "a\x00\x1b[31m" + "9" * 500,
                                              "prompt": "p", "response": "r"}])
    assert "\x00" not in html and "\x1b" not in html and "\\x00" in html and "more characters" in html
