"""The end-of-run summary: printed and written to WORKDIR/summary.md."""

from __future__ import annotations

import json
from typing import Any, Sequence

from transformer_jax.config import default_config
from transformer_jax.core import metric_names, storage
from transformer_jax.core.trees import flatten
from transformer_jax.eval import diagnostics


def config_diff(config) -> list[tuple[str, Any, Any]]:
  """(key, default, value) for every config value that differs from `default_config()`."""
  defaults = flatten(default_config().to_dict())
  values = flatten(config.to_dict())
  return [(k, defaults.get(k, "(new)"), values[k]) for k in sorted(values)
          if defaults.get(k, object()) != values[k]]


def _format(value) -> str:
  if isinstance(value, float):
    return f"{value:.4g}"
  return json.dumps(value) if not isinstance(value, str) else value


def training_cost(records: list[dict]) -> dict:
  """The time and tokens of every run of a workdir, from its metrics.jsonl records (a resumed
  run's records replace those of the steps it ran again).

  train_s, steps, tokens: the training clock (evaluation, saves and steps that compile left
  out), the steps and the tokens it timed; compile_s, compile_steps: the steps that compiled
  (each run's first of each batch shape); all_tokens: every step's tokens; eval_s,
  evaluations: evaluation, the final ones included; save_s, saves: checkpoint saves.
  """
  def total(splits, key):
    return sum(float(r.get(key, 0.0)) for r in records if r.get("split") in splits)

  return {"train_s": total(("train",), "interval_s"), "steps": total(("train",), "interval_steps"),
          "tokens": total(("train",), "interval_tokens"),
          "all_tokens": total(("train",), "interval_tokens") + total(("train",), "compile_tokens"),
          "compile_s": total(("train",), "compile_s"),
          "compile_steps": total(("train",), "compile_steps"),
          "eval_s": total(("eval", "test"), "eval_s"),
          "evaluations": sum(r.get("split") in ("eval", "test") and "eval_s" in r for r in records),
          "save_s": total(("checkpoint",), "save_s"),
          "saves": sum(r.get("split") == "checkpoint" for r in records)}


def ranked_metrics(config, records: list[dict]) -> list[str]:
  """The metrics whose best evaluation the summary lists: train.best_metric first (the one
  that ranks checkpoints), then every other metric the evaluations reported."""
  reported = [m for m in metric_names.EVAL_METRICS
              if any(r.get("split") == "eval" and m in r for r in records)]
  return list(dict.fromkeys([config.train.best_metric, *reported]))


def render(config, finals: dict, records: list[dict], final_step: int,
           checkpoint_steps: Sequence[int] = ()) -> str:
  """The summary as Markdown. finals: {split: metrics} of the final evaluation."""
  lines = ["# Run summary", "", "## Config (differences from the defaults)", ""]
  diff = config_diff(config)
  lines += ["| key | default | value |", "| --- | --- | --- |"]
  lines += [f"| `{k}` | {_format(d)} | {_format(v)} |" for k, d, v in diff]
  splits = list(finals)
  names = [k for k in dict.fromkeys(k for m in finals.values() for k in m)
           if any(isinstance(m.get(k), (int, float)) and not isinstance(m.get(k), bool)
                  for m in finals.values())]
  lines += ["", f"## Final metrics (step {final_step})", "",
            "| metric | " + " | ".join(splits) + " |",
            "| --- |" + " --- |" * len(splits)]
  lines += [f"| {k} | " + " | ".join(_format(finals[s].get(k, "")) for s in splits) + " |"
            for k in names]
  for split, metrics in finals.items():
    table = diagnostics.by_length_table(metrics)
    if table:
      lines += ["", f"## {split}: decoded outputs by reference length (tokens of the output)", "",
                table, "", diagnostics.errors_line(metrics)]
    table = diagnostics.by_group_table(metrics)
    if table:
      lines += ["", f"## {split}: exact match by group of examples", "", table]
  eval_split = config.data.eval_split
  lines += ["", f"## Best evaluation on {eval_split} and checkpoints", ""]
  for metric in ranked_metrics(config, records):
    best = metric_names.best_record(records, metric)
    if best is not None:
      kept = " (checkpoint kept)" if best["step"] in checkpoint_steps else ""
      ranks = " (train.best_metric)" if metric == config.train.best_metric else ""
      lines.append(f"- best {metric}{ranks}: {_format(best[metric])} at step {best['step']}"
                   f"{kept}")
  if checkpoint_steps:
    lines.append(f"- checkpoints in the workdir: steps {', '.join(map(str, checkpoint_steps))}")
  cost = training_cost(records)
  throughput = cost["tokens"] / cost["train_s"] if cost["train_s"] > 0 else 0.0
  rate = cost["steps"] / cost["train_s"] if cost["train_s"] > 0 else 0.0
  lines += ["", "## Cost (every run of this workdir)", "",
            f"- training: {cost['train_s'] / 60:.1f} min for {cost['steps']:.0f} steps, "
            f"{rate:.2f} steps/s (the steps that compiled, evaluation and saves apart)",
            f"- steps that compiled (the first of each batch shape in each run): "
            f"{cost['compile_s']:.1f} s for {cost['compile_steps']:.0f} steps",
            f"- evaluation: {cost['eval_s'] / 60:.1f} min for {cost['evaluations']} "
            "evaluations, the final ones included",
            f"- checkpoint saves: {cost['save_s']:.1f} s for {cost['saves']} saves",
            f"- tokens seen (source + target, no padding): {cost['all_tokens']:,.0f}",
            f"- throughput: {throughput:,.0f} tokens/s"]
  startup = [r for r in records if r.get("split") == "startup"]
  if startup:
    r = startup[-1]
    lines.append(f"- start-up of the latest run: {r['startup_s']:.1f} s to its first step's end: "
                 f"set-up {r['setup_s']:.1f} s, tracing {r['trace_s']:.1f} s, lowering "
                 f"{r['lower_s']:.1f} s, compiling {r['compile_s']:.1f} s (compilation cache: "
                 f"{r['cache']})")
  return "\n".join(lines + [""])


def write(workdir: str, text: str) -> str:
  return storage.write(storage.join(workdir, "summary.md"), text)
