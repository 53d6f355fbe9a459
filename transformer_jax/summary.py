"""The end-of-run summary: printed and written to WORKDIR/summary.md."""

from __future__ import annotations

import json
import os
from typing import Any, Optional, Sequence

from transformer_jax.config import default_config


def _flatten(tree: dict, prefix: str = "") -> dict:
  flat = {}
  for key, value in tree.items():
    name = f"{prefix}{key}"
    if isinstance(value, dict):
      flat.update(_flatten(value, name + "."))
    else:
      flat[name] = value
  return flat


def config_diff(config) -> list[tuple[str, Any, Any]]:
  """(key, default, value) for every config value that differs from `default_config()`."""
  defaults = _flatten(default_config().to_dict())
  values = _flatten(config.to_dict())
  return [(k, defaults.get(k, "(new)"), values[k]) for k in sorted(values)
          if defaults.get(k, object()) != values[k]]


def best_eval(records: list[dict], metric: str, higher_is_better: bool) -> Optional[dict]:
  evals = [r for r in records if r.get("split") == "eval" and metric in r]
  if not evals:
    return None
  return (max if higher_is_better else min)(evals, key=lambda r: r[metric])


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
  for metric, higher in (("exact_match", True), ("bleu", True), ("loss", False)):
    best = best_eval(records, metric, higher)
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
  path = os.path.join(workdir, "summary.md")
  with open(path + ".tmp", "w", encoding="utf-8") as f:
    f.write(text)
  os.replace(path + ".tmp", path)
  return path
