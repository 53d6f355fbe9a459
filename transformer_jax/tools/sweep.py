"""Hyperparameter sweeps declared next to their experiment.

An experiment file may define `get_sweep()` returning a list of override dicts (dotted config
keys -> values), usually built with `grid(...)` or `random_search(...)`:

  def get_sweep():
    return sweep.grid(**{"train.learning_rate": [1e-3, 2e-3], "model.num_encoder_layers": [2, 3]})

`transformer-jax --config=FILE --workdir=DIR --sweep` runs every trial as its own training run in
DIR/trial_NNN (sequentially, or N at a time with --sweep_parallel=N). A finished trial leaves
DIR/trial_NNN/trial_result.json and is never run again; an interrupted one resumes from its own
checkpoints. DIR/results.csv and DIR/results.md list every trial, sorted by the chosen metric.
"""

from __future__ import annotations

import csv
import importlib.util
import itertools
import json
import math
import os
import shlex
import subprocess
import sys
import time
from typing import Any, Optional, Sequence

import numpy as np

from transformer_jax.core import metric_names
from transformer_jax.core.errors import UserError
from transformer_jax.core.files import atomic_write
from transformer_jax.train import logger

RESULT_FILE = "trial_result.json"
# A trial is the command line run by this very interpreter: it needs no checkout around the
# installed package, and picks up the same virtual environment.
COMMAND = (sys.executable, "-m", "transformer_jax")


def grid(**axes: Sequence[Any]) -> list[dict]:
  """Every combination of the given values: grid(**{"a.b": [1, 2], "c": [3]})."""
  keys = list(axes)
  return [dict(zip(keys, values)) for values in itertools.product(*(axes[k] for k in keys))]


def random_search(num_trials: int, seed: int = 0, **space) -> list[dict]:
  """`num_trials` random points. A value is a list (uniform choice), ("uniform", lo, hi) or
  ("log_uniform", lo, hi)."""
  rng = np.random.default_rng(seed)
  trials = []
  for _ in range(num_trials):
    trial = {}
    for key, spec in space.items():
      if isinstance(spec, tuple) and spec and spec[0] == "uniform":
        trial[key] = float(rng.uniform(spec[1], spec[2]))
      elif isinstance(spec, tuple) and spec and spec[0] == "log_uniform":
        trial[key] = float(math.exp(rng.uniform(math.log(spec[1]), math.log(spec[2]))))
      else:
        trial[key] = list(spec)[int(rng.integers(len(spec)))]
    trials.append(trial)
  return trials


def load_sweep(config_path: str) -> list[dict]:
  """The trials an experiment file declares with get_sweep()."""
  spec = importlib.util.spec_from_file_location("sweep_experiment", config_path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  if not hasattr(module, "get_sweep"):
    raise UserError(f"{config_path} defines no get_sweep(); add one returning a list of "
                    "override dicts (see transformer_jax/tools/sweep.py)")
  trials = list(module.get_sweep())
  if not trials or not all(isinstance(t, dict) for t in trials):
    raise UserError(f"get_sweep() in {config_path} must return a non-empty list of dicts")
  return trials


def _flag_value(value) -> str:
  if isinstance(value, bool):
    return str(value)
  if isinstance(value, (list, tuple)):
    return f"({','.join(map(str, value))},)"
  return str(value)


def trial_command(config_path: str, trial_workdir: str, overrides: dict,
                  base_overrides: dict) -> list[str]:
  """The command line that runs one trial (base overrides first, the trial's last)."""
  command = [*COMMAND, f"--config={config_path}", f"--workdir={trial_workdir}",
             "--mode=train"]
  for key, value in {**base_overrides, **overrides}.items():
    command.append(f"--config.{key}={_flag_value(value)}")
  return command


def _log(workdir: str, **record) -> None:
  with open(os.path.join(workdir, "sweep_log.jsonl"), "a", encoding="utf-8") as f:
    f.write(json.dumps({"time": time.time(), **record}) + "\n")


def _trial_dir(workdir: str, index: int) -> str:
  return os.path.join(workdir, f"trial_{index:03d}")


def _check_trial_dir(directory: str, overrides: dict) -> None:
  """A trial directory belongs to exactly one set of overrides: refuse a changed sweep."""
  path = os.path.join(directory, "trial.json")
  if os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      previous = json.load(f)["overrides"]
    if previous != json.loads(json.dumps(overrides)):
      raise UserError(f"{directory} was run with overrides {previous}, but the sweep now asks for "
                      f"{overrides}; use a new --workdir for a changed sweep")
  else:
    os.makedirs(directory, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
      json.dump({"overrides": overrides}, f)


def _metrics_of(directory: str) -> tuple[dict, list[dict]]:
  """The final eval metrics (newest eval/STEP.json) and all metrics.jsonl records of a trial."""
  eval_dir = os.path.join(directory, "eval")
  steps = sorted(int(n[:-5]) for n in os.listdir(eval_dir) if n[:-5].isdigit())
  with open(os.path.join(eval_dir, f"{steps[-1]}.json"), encoding="utf-8") as f:
    final = json.load(f)
  return final, logger.read_metrics(directory)


def _finish_trial(directory: str, overrides: dict, wall_time_s: float, metric: str) -> dict:
  final, records = _metrics_of(directory)
  best = metric_names.best_record(records, metric)
  best_step = best["step"] if best else None
  result = {"overrides": overrides, "metrics": final, "best_step": best_step,
            "wall_time_s": wall_time_s, "status": "done"}
  atomic_write(os.path.join(directory, RESULT_FILE), json.dumps(result, indent=2))
  return result


def write_results(workdir: str, results: list[tuple[int, dict]], metric: str) -> tuple[str, str]:
  """results.csv and results.md, sorted by `metric` (best first); failed trials last."""
  keys = sorted({k for _, r in results for k in r["overrides"]})
  columns = sorted({k for _, r in results for k, v in r.get("metrics", {}).items()
                    if isinstance(v, (int, float)) and k != "step"})

  def order(item):
    value = item[1].get("metrics", {}).get(metric)
    return (value is None, metric_names.sort_key(metric, value) if value is not None else 0.0,
            item[0])

  rows = []
  for index, r in sorted(results, key=order):
    row = {"trial": f"trial_{index:03d}", "status": r["status"]}
    row.update({k: r["overrides"].get(k, "") for k in keys})
    row.update({m: r.get("metrics", {}).get(m, "") for m in columns})
    row.update({"best_step": r.get("best_step", ""),
                "wall_time_s": round(r.get("wall_time_s", 0), 1)})
    rows.append(row)
  columns = list(rows[0])
  csv_path = os.path.join(workdir, "results.csv")
  with open(csv_path, "w", newline="", encoding="utf-8") as f:
    writer = csv.DictWriter(f, fieldnames=columns)
    writer.writeheader()
    writer.writerows(rows)

  def cell(v):
    return f"{v:.4g}" if isinstance(v, float) else str(v)

  md_path = os.path.join(workdir, "results.md")
  with open(md_path, "w", encoding="utf-8") as f:
    f.write(f"# Sweep results (sorted by {metric}, best first)\n\n")
    f.write("| " + " | ".join(columns) + " |\n")
    f.write("| " + " | ".join("---" for _ in columns) + " |\n")
    for row in rows:
      f.write("| " + " | ".join(cell(row[c]) for c in columns) + " |\n")
  return csv_path, md_path


def run_sweep(config_path: str, workdir: str, base_overrides: Optional[dict] = None,
              parallel: int = 1, dry_run: bool = False, metric: str = "loss",
              out=sys.stdout) -> list[tuple[int, dict]]:
  """Runs (or with dry_run, prints) every trial not yet finished; writes the results table."""
  if parallel < 1:
    raise UserError(f"--sweep_parallel must be >= 1, got {parallel}")
  config_path = os.path.abspath(config_path)
  trials = load_sweep(config_path)
  base_overrides = dict(base_overrides or {})
  workdir = os.path.abspath(workdir)
  commands = [trial_command(config_path, _trial_dir(workdir, i), t, base_overrides)
              for i, t in enumerate(trials)]
  if dry_run:
    for command in commands:
      out.write(shlex.join(command) + "\n")
    return []

  os.makedirs(workdir, exist_ok=True)
  for i, trial in enumerate(trials):
    _check_trial_dir(_trial_dir(workdir, i), trial)
  results, pending = {}, []
  for i in range(len(trials)):
    path = os.path.join(_trial_dir(workdir, i), RESULT_FILE)
    if os.path.exists(path):
      with open(path, encoding="utf-8") as f:
        results[i] = json.load(f)
    else:
      pending.append(i)
  print(f"sweep: {len(trials)} trials, {len(results)} already finished, running {len(pending)} "
        f"({parallel} at a time) in {workdir}", flush=True)

  running = {}  # index -> (process, start time, log file)
  while pending or running:
    while pending and len(running) < parallel:
      i = pending.pop(0)
      log = open(os.path.join(_trial_dir(workdir, i), "train.log"), "a", encoding="utf-8")
      _log(workdir, trial=i, event="start", overrides=trials[i])
      process = subprocess.Popen(commands[i], stdout=log, stderr=subprocess.STDOUT)
      running[i] = (process, time.time(), log)
      print(f"trial_{i:03d} started: {trials[i]}", flush=True)
    time.sleep(0.2)
    for i, (process, start, log) in list(running.items()):
      if process.poll() is None:
        continue
      log.close()
      del running[i]
      wall = time.time() - start
      if process.returncode == 0:
        results[i] = _finish_trial(_trial_dir(workdir, i), trials[i], wall, metric)
        value = results[i]["metrics"].get(metric)
        print(f"trial_{i:03d} done in {wall:.0f}s: {metric} {value}", flush=True)
      else:
        results[i] = {"overrides": trials[i], "status": f"failed (exit {process.returncode})",
                      "wall_time_s": wall}
        print(f"trial_{i:03d} failed with exit code {process.returncode}; see "
              f"{_trial_dir(workdir, i)}/train.log", flush=True)
      _log(workdir, trial=i, event="end", status=results[i]["status"])

  ordered = sorted(results.items())
  csv_path, md_path = write_results(workdir, ordered, metric)
  print(f"results: {md_path} and {csv_path}", flush=True)
  return ordered
