"""Evaluation metric names and which way is better: one table for checkpoints, sweeps, summaries."""

from __future__ import annotations

from typing import Optional

LOWER_IS_BETTER = ("loss", "perplexity")
# Every metric that `eval.evaluate` reports as a number (the choices of train.best_metric).
EVAL_METRICS = ("loss", "perplexity", "token_accuracy", "exact_match", "oracle_exact_match",
                "bleu", "bleu_lowercase_tokenized", "chrf", "accuracy", "macro_f1")

# The metrics that eval.evaluate reports for each data.task (seq2seq decodes; classify predicts).
TEXT_METRICS = ("bleu", "bleu_lowercase_tokenized", "chrf", "exact_match")
_BY_TASK = {"seq2seq": ("loss", "perplexity", "token_accuracy", *TEXT_METRICS),
            "classify": ("loss", "accuracy", "macro_f1")}


def task_metrics(task: str, oracle_length: bool = False) -> tuple:
  """The EVAL_METRICS that an evaluation of `task` reports (oracle_exact_match: seq2seq with
  eval.oracle_length)."""
  metrics = _BY_TASK.get(task, ("loss", "perplexity", "token_accuracy"))
  return metrics + (("oracle_exact_match",) if task == "seq2seq" and oracle_length else ())


def lower_is_better(metric: str) -> bool:
  return metric in LOWER_IS_BETTER


def sort_key(metric: str, value: float) -> float:
  """A key under which smaller is better, for min() and sorted()."""
  return value if lower_is_better(metric) else -value


def best_record(records: list[dict], metric: str) -> Optional[dict]:
  """The eval record of `records` (metrics.jsonl rows) with the best `metric`; None if none."""
  evals = [r for r in records if r.get("split") == "eval" and metric in r]
  return min(evals, key=lambda r: sort_key(metric, r[metric])) if evals else None
