"""Evaluation: generate on a held-out split and score with the training reward functions.

Greedy decoding gives `acc` (exact-match accuracy: the share of responses that score 1) per data_source.
With `evaluate.n > 1`, samples at `evaluate.temperature` add mean@n, best@n and maj@n
(stages/validation.py). Runnable without Prefect; the pipeline calls it for each model it compares.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from infra.config import Config
from stages.data_prep import load_prompts
from stages.model.loading import load_model, load_tokenizer
from stages.rewards import default_compute_score
from stages.rollout.base import RolloutOutput, SamplingParams
from stages.rollout.hf import HFRolloutEngine
from stages.validation import group_metrics

logger = logging.getLogger(__name__)


@dataclass
class EvalResult:
    metrics: dict[str, float]  # "<data_source>/acc", "acc"
    samples: list[dict]  # one row per generated response


def evaluate_model(cfg: Config, model_dir: Path, data_file: Path) -> EvalResult:
    tokenizer = load_tokenizer(model_dir, cfg.model.trust_remote_code)
    prompts = load_prompts(data_file, tokenizer, cfg.data)
    num = min(len(prompts), cfg.evaluate.max_samples or len(prompts))
    model = load_model(model_dir, cfg.model, trainable=False)
    engine = HFRolloutEngine(model, tokenizer.pad_token_id, tokenizer.eos_token_id, cfg.evaluate.batch_size)
    max_tokens = cfg.evaluate.max_new_tokens or cfg.data.max_response_length
    greedy = SamplingParams(n=1, temperature=0.0, max_tokens=max_tokens, seed=cfg.run.seed)
    samples = [_score(prompts, out, tokenizer) for out in engine.generate(prompts.prompt_ids[:num], greedy)]
    metrics = _accuracy(samples)
    ev = cfg.evaluate
    if ev.n > 1:
        sampling = SamplingParams(n=ev.n, temperature=ev.temperature, top_p=ev.top_p, max_tokens=max_tokens,
                                  seed=cfg.run.seed)
        sampled = [_score(prompts, out, tokenizer) for out in engine.generate(prompts.prompt_ids[:num], sampling)]
        metrics.update(group_metrics(sampled, ev.n, prefix="eval"))
        samples += [{**s, "sampled": True} for s in sampled]
    return EvalResult(metrics, samples)


def _score(prompts, out: RolloutOutput, tokenizer) -> dict:
    i = out.prompt_index
    text = tokenizer.decode(out.response_ids, skip_special_tokens=True)
    result = default_compute_score(prompts.data_sources[i], text, prompts.ground_truths[i], prompts.extra_infos[i])
    score = float(result["score"] if isinstance(result, dict) else result)
    return {
        "prompt_index": i,
        "data_source": prompts.data_sources[i],
        "response": text,
        "ground_truth": prompts.ground_truths[i],
        "score": score,
        "finish_reason": out.finish_reason,
        "response_length": len(out.response_ids),
    }


def _accuracy(samples: list[dict]) -> dict[str, float]:
    by_source: dict[str, list[float]] = defaultdict(list)
    for s in samples:
        by_source[s["data_source"]].append(1.0 if s["score"] >= 1.0 else 0.0)
    metrics = {f"{src}/acc": sum(v) / len(v) for src, v in by_source.items()}
    hits = [h for v in by_source.values() for h in v]
    metrics["acc"] = sum(hits) / len(hits) if hits else 0.0
    return metrics
