"""Evaluation metric names and which way is better: one table for checkpoints, sweeps, summaries."""

from __future__ import annotations

from typing import Optional

LOWER_IS_BETTER = ("loss", "perplexity")
# Every metric that `eval.evaluate` reports as a number (the choices of train.best_metric).
EVAL_METRICS = ("loss", "perplexity", "token_accuracy", "exact_match", "oracle_exact_match",
                "bleu", "bleu_lowercase_tokenized", "chrf", "accuracy", "macro_f1")


def lower_is_better(metric: str) -> bool:
  return metric in LOWER_IS_BETTER


def sort_key(metric: str, value: float) -> float:
  """A key under which smaller is better, for min() and sorted()."""
  return value if lower_is_better(metric) else -value


def best_record(records: list[dict], metric: str) -> Optional[dict]:
  """The eval record of `records` (metrics.jsonl rows) with the best `metric`; None if none."""
  evals = [r for r in records if r.get("split") == "eval" and metric in r]
  return min(evals, key=lambda r: sort_key(metric, r[metric])) if evals else None
