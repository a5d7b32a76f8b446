"""The run report's page: matplotlib plots of the RL metrics, the evaluation table, best and worst rollouts.

``render(RunData, title, extra)`` -> one HTML page; infra/report.py reads the ``RunData`` from the store and
saves the page. Plots are matplotlib figures (Agg canvas, no pyplot state) embedded as base64 PNG, so the
one HTML file works when opened from S3 or a mail attachment: no scripts, no external files. A panel whose
metrics the run did not log shows a note saying what was looked for and which setting logs it, instead of
empty axes. Every text that comes from the data (prompts, responses, labels, metric names, ``extra``) is
escaped.
"""

from __future__ import annotations

import base64
import html
import io
import math
import unicodedata
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timezone

from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter

from infra.artifacts import code_version

MAX_TEXT = 1500  # characters of a prompt/response shown per rollout
FACT_CHARS = 200  # characters of one fact (a ground truth, a group id) in a rollout card's line
EVAL_ORDER = ("base", "sft", "rl")  # labels first in this order, then the others sorted


@dataclass(frozen=True)
class Panel:
    """One plot: metric names (exact, or a prefix ending in '/'), what the y axis is, and where it comes from."""

    title: str
    ylabel: str
    names: tuple[str, ...]
    hint: str  # which setting/stage logs these metrics, shown when the run has none of them
    log_y: bool = False
    band: tuple[str, str] | None = None  # (min, max) metric names shaded around the first series
    ylim: tuple[float, float] | None = None  # fixed y range (accuracy: 0..1, so small changes look small)
    wide: bool = False  # a full-width figure with the legend beside the axes (many series)


PANELS = (
    Panel("Reward", "score / reward", ("critic/score/mean", "critic/rewards/mean"),
          "logged every RL step by the driver (stages/rl_data.py data_metrics)",
          band=("critic/score/min", "critic/score/max")),
    Panel("Validation accuracy", "accuracy", ("val/acc/",),
          "logged every rl.test_freq steps (and at step 0 with rl.val_before_train)", ylim=(-0.02, 1.02)),
    Panel("KL", "KL", ("actor/ppo_kl", "actor/kl_loss", "actor/reward_kl_penalty"),
          "actor/ppo_kl comes with the actor update; actor/kl_loss with rl.actor.use_kl_loss; "
          "actor/reward_kl_penalty with rl.algorithm.use_kl_in_reward"),
    Panel("Entropy", "nats / token", ("actor/entropy",), "of the policy before its update (old-logprob pass)"),
    Panel("Response length", "tokens", ("response_length/mean",), "logged every RL step by the driver",
          band=("response_length/min", "response_length/max")),
    Panel("Gradient norm", "L2 norm before clipping", ("actor/grad_norm", "critic/grad_norm"),
          "actor/grad_norm with the actor update, critic/grad_norm with a critic (PPO/GAE)"),
    Panel("Tool use", "per step (count; turns per sample)", ("tool/calls", "tool/errors", "tool/parse_errors",
                                                             "tool/timeouts", "num_turns/mean"),
          "logged every RL step by multi-turn agent loops (rl.multi_turn, agent_name tool_agent)"),
    Panel("Timing per phase", "seconds (log scale)", ("timing_s/",), "logged every RL step by StepTimer",
          log_y=True, wide=True),
)


@dataclass
class RunData:
    """What the report shows, read from the store."""

    run_id: str
    metrics: dict[str, list[tuple[int, float]]]  # name -> [(step, value)] sorted by step
    val_scores: list[tuple[int, float]]  # (step, mean score) from the validation table
    best: list[dict]
    worst: list[dict]
    evals: list[dict]
    num_rollouts: int
    rollout_steps: list[int] = field(default_factory=list)
    evals_run_id: str = ""  # the run whose evals rows these are (the flow run, when evaluation wrote them)
    warnings: list[str] = field(default_factory=list)  # shown in a box at the top (infra.learning_signal)


# ---------------------------------------------------------------------------------------------- plots


def _series(panel: Panel, metrics: dict[str, list[tuple[int, float]]]) -> dict[str, list[tuple[int, float]]]:
    """Metric name -> finite points, for the panel's names (prefixes expanded, in a stable order)."""
    found = {}
    for pattern in panel.names:
        names = sorted(n for n in metrics if n.startswith(pattern)) if pattern.endswith("/") else [pattern]
        for name in names:
            points = [(s, v) for s, v in metrics.get(name, []) if math.isfinite(v)]
            if points and (not panel.log_y or any(v > 0 for _, v in points)):
                found[name] = [(s, v) for s, v in points if v > 0] if panel.log_y else points
    return found


def _label(name: str, panel: Panel) -> str:
    """Legend text: the metric name without the prefix the panel shares ('timing_s/gen' -> 'gen')."""
    prefixes = [p for p in panel.names if p.endswith("/") and name.startswith(p)]
    return name[len(prefixes[0]):] if prefixes else name


def figure_png(panel: Panel, series: dict[str, list[tuple[int, float]]],
               metrics: dict[str, list[tuple[int, float]]]) -> bytes:
    """PNG bytes of one panel (series must not be empty)."""
    fig = Figure(figsize=(12.8 if panel.wide else 6.4, 3.4), dpi=120, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for i, (name, points) in enumerate(series.items()):
        steps, values = zip(*points)
        total = name == "timing_s/step"  # the whole step: the reference the phases are read against
        marker = "o" if len(points) <= 60 else None  # markers show single points; long runs are lines
        ax.plot(steps, values, marker=marker, markersize=3.5 if len(points) > 1 else 6, label=_label(name, panel),
                color="black" if total else (f"C{i}" if len(series) <= 10 else colormaps["tab20"](i % 20)),
                linewidth=2.2 if total else 1.4,
                linestyle="-" if panel.wide else ("-", "--", ":")[i % 3])  # equal series stay visible
    if panel.band and panel.band[0] in metrics and panel.band[1] in metrics:
        low, high = dict(metrics[panel.band[0]]), dict(metrics[panel.band[1]])
        steps = sorted(set(low) & set(high))
        ax.fill_between(steps, [low[s] for s in steps], [high[s] for s in steps], color="C0", alpha=0.15,
                        linewidth=0, label=f"{_label(panel.band[0], panel).rsplit('/', 1)[0]} min-max")
    _style(ax, panel, [v for points in series.values() for _, v in points])
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _style(ax, panel: Panel, values: list[float]) -> None:
    if panel.log_y:  # plain numbers (0.5, 1, 2), at 1-2-5 steps when the data spans at most 2 decades
        ax.set_yscale("log")
        decades = math.log10(max(values) / min(values))
        ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0) if decades <= 2 else (1.0,)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
    else:
        ax.ticklabel_format(axis="y", useOffset=False)  # no '+5.633' offset text over the title
    if panel.ylim and all(panel.ylim[0] <= v <= panel.ylim[1] for v in values):  # a -1/+1 score: its own range
        ax.set_ylim(*panel.ylim)
    ax.set_title(panel.title, fontsize=12)
    ax.set_xlabel("step", fontsize=10)
    ax.set_ylabel(panel.ylabel, fontsize=10)
    ax.tick_params(labelsize=9)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    if panel.wide:  # many series (timing phases): legend beside the axes so it never covers the lines
        ax.legend(fontsize=9, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    else:
        ax.legend(fontsize=8.5, loc="best", framealpha=0.85)


def panel_html(panel: Panel, data: RunData) -> str:
    series = _series(panel, data.metrics)
    if panel.title == "Validation accuracy" and not series and data.val_scores:
        series = {"val/score/mean (validation table)": data.val_scores}
    title = html.escape(panel.title)
    if not series:
        looked = ", ".join(panel.names)
        return (f'<div class="panel note"><h3>{title}</h3><p>This run logged none of: <code>'
                f'{html.escape(looked)}</code>.</p><p>{html.escape(panel.hint)}.</p></div>')
    png = base64.b64encode(figure_png(panel, series, data.metrics)).decode()
    alt = f"{panel.title}: " + ", ".join(series)
    wide = ' style="grid-column:1/-1"' if panel.wide else ""
    return f'<div class="panel"{wide}><img alt="{html.escape(alt)}" src="data:image/png;base64,{png}"></div>'


# ---------------------------------------------------------------------------------------------- tables


def _fmt(value) -> str:
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.4g}"
    return "" if value is None else str(value)


def _table(header: list[str] | None, rows: list[list]) -> str:
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header or [])
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(v))}</td>" for v in row) + "</tr>" for row in rows)
    return f"<table>{f'<thead><tr>{head}</tr></thead>' if head else ''}<tbody>{body}</tbody></table>"


def eval_table(rows: list[dict]) -> tuple[list[str], list[list]]:
    """The evaluation rows of a run as (header, rows), models (labels base, sft, rl, others) side by side.

    Long rows (``metric`` or ``name``, ``value``; stages/evaluate.py writes these) give one row per
    (data_source, metric) and one column per model. Per-sample rows with a ``score`` give one row per model
    (and data_source): acc = share of greedy rows (``sampled`` not true) scoring >= 1, and their count.
    """
    present = {c for r in rows for c, v in r.items() if v is not None}  # other runs' columns are NULL here
    key = next((c for c in ("metric", "name") if c in present), None)
    by_source = "data_source" in present
    if not rows:
        return [], []
    if key and "value" in present:
        labels = sorted({r["label"] for r in rows}, key=_label_rank)
        cells: dict[tuple, dict[str, float]] = defaultdict(dict)
        for r in rows:
            cells[(r.get("data_source"), r[key])][r["label"]] = r["value"]
        return ([*(["data_source"] if by_source else []), "metric", *labels],
                [[*([src] if by_source else []), name, *(cells[(src, name)].get(lab) for lab in labels)]
                 for src, name in cells])
    if "score" not in present:
        raise ValueError(f"evals rows with columns {sorted(present)}: expected (metric, value) rows or "
                         "per-sample rows with a score column")
    groups: dict[tuple, list[float]] = defaultdict(list)
    for r in rows:
        if not r.get("sampled") and r["score"] is not None:
            groups[(r["label"], r.get("data_source"))].append(r["score"])
    return (["model", *(["data_source"] if by_source else []), "acc", "samples"],
            [[lab, *([src] if by_source else []), sum(s >= 1 for s in scores) / len(scores), len(scores)]
             for (lab, src), scores in sorted(groups.items(), key=lambda kv: (_label_rank(kv[0][0]), str(kv[0])))])


def _label_rank(label: str) -> tuple:
    return (EVAL_ORDER.index(label) if label in EVAL_ORDER else len(EVAL_ORDER)), label


def timing_table(metrics: dict[str, list[tuple[int, float]]]) -> str:
    """Mean seconds per phase and its share of a step (phases nest: reward runs inside gen)."""
    phases = {n: [v for _, v in pts if math.isfinite(v)] for n, pts in metrics.items() if n.startswith("timing_s/")}
    means = {n.removeprefix("timing_s/"): sum(v) / len(v) for n, v in phases.items() if v}
    if not means:
        return ""
    step = means.get("step")
    rows = [[name, mean, f"{100 * mean / step:.1f}%" if step else ""]
            for name, mean in sorted(means.items(), key=lambda kv: -kv[1])]
    return (_table(["phase", "mean s", "share of step"], rows) + "<p class='sub'>Phases nest (reward runs inside "
            "gen) and testing runs outside the step, so the shares need not add up to 100%.</p>")


def rollout_cards(title: str, rows: list[dict]) -> str:
    cards = []
    for r in rows:
        facts = " · ".join(f"{k} <b>{html.escape(_clip(_fmt(r[k]), FACT_CHARS))}</b>" for k in
                           ("step", "score", "reward", "advantage", "num_response_tokens", "finish_reason",
                            "ground_truth", "group_id") if k in r)
        shown = ("prompt", "response") if not r.get("turns") else ("prompt",)
        texts = "".join(f"<div class='label'>{k}</div><pre>{html.escape(_clip(r.get(k)))}</pre>"
                        for k in shown if k in r)
        texts += "".join(f"<div class='label'>turn {t['turn']}: {html.escape(_turn_label(t))}</div>"
                         f"<pre>{html.escape(_clip(t['text']))}</pre>" for t in r.get("turns") or [])
        cards.append(f'<div class="card"><div class="facts">{facts}</div>{texts}</div>')
    return f"<h3>{html.escape(title)}</h3>" + ("".join(cards) or "<p class='note'>No rollouts.</p>")


def _turn_label(turn: dict) -> str:
    if turn["role"] != "tool":
        return turn["role"]
    return f"tool {turn.get('tool_name') or '(not run)'}" + (" (error)" if turn.get("error") else "")


def _clip(text, limit: int = 0) -> str:
    """Text for a <pre>: control characters as visible escapes (HTML cannot hold them), long text cut at `limit`
    characters (MAX_TEXT when 0)."""
    limit = limit or MAX_TEXT
    text = "".join(c if c in "\n\t" or unicodedata.category(c) != "Cc" else f"\\x{ord(c):02x}"
                   for c in ("" if text is None else str(text)))
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more characters)"


# ---------------------------------------------------------------------------------------------- page

CSS = """
body{font-family:"DejaVu Sans",Helvetica,Arial,sans-serif;margin:24px auto;max-width:1320px;color:#222;
 padding:0 16px;line-height:1.4}
h1{font-size:24px;margin-bottom:4px}h2{font-size:19px;margin-top:28px;border-bottom:1px solid #ddd}
h3{font-size:15px;margin:10px 0 6px}.sub{color:#666;font-size:13px}
.grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(560px,1fr));gap:14px}
.panel img{width:100%;height:auto;display:block}.panel{border:1px solid #e3e3e3;border-radius:6px;padding:4px}
.note{background:#fafafa;color:#555;font-size:13px;padding:8px 12px}
table{border-collapse:collapse;font-size:13px;margin:6px 0}th,td{border:1px solid #ddd;padding:4px 10px;
 text-align:left}th{background:#f3f3f3}td{font-variant-numeric:tabular-nums}
.columns{display:grid;grid-template-columns:1fr 1fr;gap:18px}
.card{border:1px solid #e3e3e3;border-radius:6px;padding:8px 10px;margin-bottom:10px;font-size:13px}
.label{color:#777;font-size:12px;margin-top:4px}
.warning{background:#fff4e5;border:2px solid #e67e22;border-radius:6px;padding:8px 14px;margin:14px 0;font-size:14px}
pre{white-space:pre-wrap;word-break:break-word;background:#f7f7f7;padding:6px 8px;margin:2px 0;
 font-size:12.5px;max-height:220px;overflow:auto}
"""


def _last(points: list[tuple[int, float]] | None) -> str:
    return _fmt(points[-1][1]) + f" (step {points[-1][0]})" if points else "-"


def summary_rows(data: RunData) -> list[list]:
    m = data.metrics
    steps = sorted({s for pts in m.values() for s, _ in pts} | set(data.rollout_steps))
    val = next((m[n] for n in sorted(m) if n.startswith("val/acc/mean@")), None) or data.val_scores
    total_s = sum(v for _, v in m.get("timing_s/step", [])) + sum(v for _, v in m.get("timing_s/testing", []))
    return [["run id", data.run_id], ["steps", f"{steps[0]}-{steps[-1]} ({len(steps)} logged)" if steps else "-"],
            ["rollouts", data.num_rollouts],
            ["score (first step)", _fmt(m["critic/score/mean"][0][1]) if m.get("critic/score/mean") else "-"],
            ["score (last step)", _last(m.get("critic/score/mean"))], ["validation accuracy (last)", _last(val)],
            ["time in steps + validation", f"{total_s:.1f} s"]]


def _score_range(data: RunData) -> str:
    lows, highs = (data.metrics.get(f"critic/score/{s}", []) for s in ("min", "max"))
    if not lows or not highs:
        return ""
    low, high = min(v for _, v in lows), max(v for _, v in highs)
    same = ": all equal, so best and worst differ only by step and advantage" if low == high else ""
    return f"<p class='sub'>Scores of the {data.num_rollouts} rollouts range from {low:.4g} to {high:.4g}{same}.</p>"


def warning_box(warnings: list[str]) -> str:
    if not warnings:
        return ""
    items = "".join(f"<li>{html.escape(w)}</li>" for w in warnings)
    return f'<div class="warning" role="alert"><b>Warning</b><ul>{items}</ul></div>'


def render(data: RunData, title: str, extra: dict | None) -> str:
    """The HTML page of data (all text escaped)."""
    now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    try:
        header, body = eval_table(data.evals)
        evals = _table(header, body) if body else (
            f"<p class='note'>No evaluation rows for run {html.escape(data.evals_run_id or data.run_id)} (the "
            "<code>evals</code> table is filled by the evaluation stage of the flow).</p>")
    except ValueError as exc:  # rows of an unknown layout: say so, keep the rest of the report
        evals = f"<p class='note'>{html.escape(str(exc))}</p>"
    info = _table(None, summary_rows(data)) + (_table(["key", "value"], [[k, v] for k, v in extra.items()])
                                                      if extra else "")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title><style>{CSS}</style></head>
<body><h1>{html.escape(title)}</h1>
<div class="sub">run {html.escape(data.run_id)} · generated {now} · code {html.escape(code_version())}</div>
{warning_box(data.warnings)}
<h2>Summary</h2><div class="columns"><div>{info}</div><div><h3>Where the time goes</h3>
{timing_table(data.metrics) or "<p class='note'>No timing_s/* metrics.</p>"}</div></div>
<h2>Training curves</h2><div class="grid">{"".join(panel_html(p, data) for p in PANELS)}</div>
<h2>Evaluation</h2>{evals}
<h2>Rollouts</h2>{_score_range(data)}<div class="columns">
<div>{rollout_cards(f"Best {len(data.best)} (highest score)", data.best)}</div>
<div>{rollout_cards(f"Worst {len(data.worst)} (lowest score)", data.worst)}</div></div>
</body></html>
"""
