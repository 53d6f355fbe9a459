"""The end-of-run summary: printed and written to WORKDIR/summary.md."""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

from transformer_jax.config import default_config
from transformer_jax.core import metric_names
from transformer_jax.core.files import atomic_write
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


def render(config, final_metrics: dict, records: list[dict], wall_time_s: float,
           tokens_seen: int, steps_run: int, final_step: int,
           checkpoint_steps: Sequence[int] = ()) -> str:
  """The summary as Markdown."""
  lines = ["# Run summary", "", "## Config (differences from the defaults)", ""]
  diff = config_diff(config)
  lines += ["| key | default | value |", "| --- | --- | --- |"]
  lines += [f"| `{k}` | {_format(d)} | {_format(v)} |" for k, d, v in diff]
  lines += ["", f"## Final metrics (step {final_step})", "", "| metric | value |", "| --- | --- |"]
  lines += [f"| {k} | {_format(v)} |" for k, v in final_metrics.items()
            if isinstance(v, (int, float))]
  lines += ["", "## Best evaluation and checkpoints", ""]
  for metric in ("exact_match", "bleu", "loss"):
    best = metric_names.best_record(records, metric)
    if best is not None:
      kept = " (checkpoint kept)" if best["step"] in checkpoint_steps else ""
      lines.append(f"- best {metric}: {_format(best[metric])} at step {best['step']}{kept}")
  if checkpoint_steps:
    lines.append(f"- checkpoints in the workdir: steps {', '.join(map(str, checkpoint_steps))}")
  throughput = tokens_seen / wall_time_s if wall_time_s > 0 else 0.0
  lines += ["", "## Cost", "",
            f"- wall time of this run: {wall_time_s / 60:.1f} min for {steps_run} steps",
            f"- tokens seen in this run (source + target, no padding): {tokens_seen:,}",
            f"- throughput: {throughput:,.0f} tokens/s", ""]
  return "\n".join(lines)


def write(workdir: str, text: str) -> str:
  return atomic_write(os.path.join(workdir, "summary.md"), text)
