"""The end-of-run summary: printed and written to WORKDIR/summary.md."""

from __future__ import annotations

import json
from typing import Any, Sequence

from transformer_jax.config import default_config
from transformer_jax.core import metric_names, storage
from transformer_jax.core.trees import flatten


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


def training_cost(records: list[dict]) -> tuple[float, float]:
  """(seconds, tokens) of training over every run of a workdir, from the train records of
  metrics.jsonl: each covers the steps since the previous one (a resumed run's records replace
  those of the steps it ran again)."""
  train = [r for r in records if r.get("split") == "train"]
  seconds = sum(float(r.get("interval_s", 0.0)) for r in train)
  tokens = sum(float(r.get("interval_tokens", 0.0)) for r in train)
  return seconds, tokens


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
  lines += ["", "## Best evaluation and checkpoints", ""]
  for metric in ("exact_match", "bleu", "loss"):
    best = metric_names.best_record(records, metric)
    if best is not None:
      kept = " (checkpoint kept)" if best["step"] in checkpoint_steps else ""
      lines.append(f"- best {metric}: {_format(best[metric])} at step {best['step']}{kept}")
  if checkpoint_steps:
    lines.append(f"- checkpoints in the workdir: steps {', '.join(map(str, checkpoint_steps))}")
  seconds, tokens = training_cost(records)
  throughput = tokens / seconds if seconds > 0 else 0.0
  lines += ["", "## Cost (every run of this workdir, the evaluations after the last step aside)",
            "", f"- wall time of training: {seconds / 60:.1f} min for {final_step} steps",
            f"- tokens seen (source + target, no padding): {tokens:,.0f}",
            f"- throughput: {throughput:,.0f} tokens/s", ""]
  return "\n".join(lines)


def write(workdir: str, text: str) -> str:
  return storage.write(storage.join(workdir, "summary.md"), text)
