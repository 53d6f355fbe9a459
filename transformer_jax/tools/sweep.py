"""Hyperparameter sweeps declared next to their experiment.

An experiment file may define `get_sweep()` returning a list of override dicts (dotted config
keys -> values), usually built with `grid(...)` or `random_search(...)`:

  def get_sweep():
    return sweep.grid(**{"train.learning_rate": [1e-3, 2e-3], "model.num_encoder_layers": [2, 3]})

`transformer-jax --config=FILE --workdir=DIR --sweep` runs every trial as its own training run in
DIR/trial_NNN (sequentially, or N at a time with --sweep_parallel=N). A finished trial leaves
DIR/trial_NNN/trial_result.json and is never run again; an interrupted one resumes from its own
checkpoints. DIR/results.csv and DIR/results.md list every trial, sorted by the chosen metric.

Seeds: a trial with a "seeds" entry ({"model.positional": "rotary", "seeds": 5}), or every trial
with --sweep_seeds=N (which wins over the entries), is run once per seed: seeds S, S+1, ...,
S+N-1, S being the trial's config seed, each in DIR/trial_NNN_seedK. results.md then also
holds one row per trial with the median, min and max over its seeds of each reported metric.

--sweep_test_best: each run trains with data.test_split left out (so training never reads it)
and, once finished, its checkpoint with the best train.best_metric on data.eval_split (the one
train.keep_best keeps) is scored once on data.test_split (--mode=evaluate in the run's
directory): the test_* columns. They are reported, never used to sort or select.

--sweep_trials=5,3,0 runs only those trials of get_sweep() (numbered from 0 in its order), in
that order; the others are not started, and their runs already finished in DIR stay in the
results tables. The trial numbers, and so the directories, are those of the whole sweep.

DIR may be a bucket (`gs://`, `s3://`, see docs/storage.md): every read and write of the sweep
goes through core/storage.py, and each trial trains into DIR/trial_NNN there.
"""

from __future__ import annotations

import csv
import importlib.util
import io
import itertools
import json
import math
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, NamedTuple, Optional, Sequence

import numpy as np
from absl import flags
from ml_collections import config_flags

from transformer_jax import config as config_lib
from transformer_jax.core import metric_names, progress, storage
from transformer_jax.core.errors import UserError, unknown_key_message
from transformer_jax.eval import evaluate
from transformer_jax.train import checkpoint, logger

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
  try:
    trials = module.get_sweep()
  except Exception as e:  # the experiment's own code: report it in one line
    raise UserError(f"get_sweep() in {config_path} raised {type(e).__name__}: {e}") from None
  if not isinstance(trials, (list, tuple)) or not trials or not all(
      isinstance(t, dict) and all(isinstance(k, str) for k in t) for t in trials):
    raise UserError(f"get_sweep() in {config_path} must return a non-empty list of dicts of "
                    "dotted config keys (e.g. {'train.learning_rate': 1e-3})")
  for i, trial in enumerate(trials):
    if any(isinstance(value, dict) for value in trial.values()):
      raise UserError(f"trial_{i:03d} of get_sweep() in {config_path} nests a dict ({trial}); "
                      f"write its keys dotted: {_dotted(trial)}")
  return list(trials)


SEEDS = "seeds"  # the trial entry that asks for runs with several seeds (not a config key)


class Run(NamedTuple):
  """One training run of a sweep: a trial, with one seed of it where seeds were asked for."""

  trial: int  # index into get_sweep()'s list
  seed: Optional[int]  # None: the trial's config seed, in a directory named by the trial alone
  overrides: dict  # the trial's config overrides, with "seed" where seeded

  @property
  def name(self) -> str:
    return f"trial_{self.trial:03d}" + ("" if self.seed is None else f"_seed{self.seed}")


def seed_counts(trials: list, seeds: int = 0) -> list[Optional[int]]:
  """How many seeds each trial runs: --sweep_seeds (`seeds`) if given, else its "seeds" entry,
  else None (one run with the config's seed, named as before seeds existed)."""
  if seeds < 0:
    raise UserError(f"--sweep_seeds must be >= 0 (0 = as get_sweep() says), got {seeds}")
  counts = []
  for i, trial in enumerate(trials):
    count = seeds or trial.get(SEEDS)
    if count is not None and (isinstance(count, bool) or not isinstance(count, int)
                              or count < 1):
      raise UserError(f"trial_{i:03d} of get_sweep() asks for {SEEDS}={count!r}; give a "
                      "positive number of seeds")
    if count is not None and "seed" in trial:
      raise UserError(f"trial_{i:03d} of get_sweep() sets seed={trial['seed']} and asks for "
                      f"{count} seeds; leave out one of the two")
    counts.append(count)
  return counts


def expand_runs(trials: list, configs: list, counts: list) -> list[Run]:
  """The runs of the trials (`trials` without their "seeds" entries; `configs` their configs)."""
  runs = []
  for i, (trial, config, count) in enumerate(zip(trials, configs, counts)):
    if count is None:
      runs.append(Run(i, None, dict(trial)))
    else:
      runs += [Run(i, config.seed + k, {**trial, "seed": config.seed + k}) for k in range(count)]
  return runs


def _dotted(trial: dict, prefix: str = "") -> dict:
  """{'train': {'steps': 2}} -> {'train.steps': 2}."""
  flat = {}
  for key, value in trial.items():
    if isinstance(value, dict):
      flat.update(_dotted(value, f"{prefix}{key}."))
    else:
      flat[f"{prefix}{key}"] = value
  return flat


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


def trial_config(config_path: str, overrides: dict, base_overrides: dict):
  """The config a trial's command line gives its run, parsed as that run parses it."""
  args = [a for a in trial_command(config_path, "", overrides, base_overrides)[len(COMMAND):]
          if a.startswith("--config")]
  flag_values = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "", flag_values=flag_values, lock_config=True,
                                  sys_argv=["sweep", *args])
  try:
    flag_values(["sweep", *args])
  except flags.Error as e:  # a value of the wrong type: "flag --config.a.b=x: why"
    raise UserError(" ".join(str(e).split())) from None
  except (AttributeError, KeyError) as e:  # ml_collections: a key that does not exist
    raise UserError(unknown_key_message(e, args)) from None
  return flag_values["config"].value


def check_trials(config_path: str, trials: list, base_overrides: dict) -> list:
  """Every trial's config, validated before any trial runs; the first bad one is a UserError."""
  configs = []
  for i, trial in enumerate(trials):
    try:
      # The seeds entry asks for runs (seed_counts); it is not a config key.
      config = trial_config(config_path, {k: v for k, v in trial.items() if k != SEEDS},
                            base_overrides)
      config_lib.validate(config)
    except UserError as e:
      raise UserError(f"trial_{i:03d} of get_sweep() in {config_path} ({trial}): {e}; fix "
                      "get_sweep() (no trial was run)") from None
    configs.append(config)
  return configs


def _log(workdir: str, **record) -> None:
  storage.append_jsonl(storage.join(workdir, "sweep_log.jsonl"), {"time": time.time(), **record})


def _trial_dir(workdir: str, run: Run) -> str:
  return storage.join(workdir, run.name)


def _read_json(path: str, what: str) -> dict:
  try:
    value = json.loads(storage.read_text(path))
  except (OSError, ValueError) as e:
    raise UserError(f"cannot read {path} ({what}): {e}; move it away to run the trial "
                    "again") from None
  if not isinstance(value, dict):
    raise UserError(f"{path} ({what}) is not a JSON object; move it away to run the trial again")
  return value


def _check_trial_dir(directory: str, overrides: dict) -> None:
  """A trial directory belongs to exactly one set of overrides: refuse a changed sweep."""
  path = storage.join(directory, "trial.json")
  if storage.exists(path):
    previous = _read_json(path, "the trial's overrides").get("overrides")
    if previous != json.loads(json.dumps(overrides)):
      raise UserError(f"{directory} was run with overrides {previous}, but the sweep now asks for "
                      f"{overrides}; use a new --workdir for a changed sweep")


def _metrics_of(directory: str, config) -> tuple[Optional[dict], list[dict]]:
  """A trial's final metrics on data.eval_split (its result file of step train.steps; None if
  it did not get there) and its metrics.jsonl records."""
  path = evaluate.result_path(directory, config.train.steps, config.data.eval_split, config)
  if not storage.exists(path):
    return None, []
  final = _read_json(path, "the trial's final metrics")
  return final, logger.read_metrics(directory)


def _numbers(record: dict) -> dict:
  return {k: v for k, v in record.items() if isinstance(v, (int, float))
          and not isinstance(v, bool) and k not in ("step", "time", "eval_s")}


def _test_best(directory: str, test: "TestPass", overrides: dict, config,
               records: list) -> dict:
  """The run's checkpoint with the best train.best_metric scored once on data.test_split
  (--mode=evaluate in a subprocess, its output appended to the run's train.log); its result
  file is read back if an earlier sweep wrote it. {"test": {...}} or {"test_status": why not}."""
  split, metric = config.data.test_split, config.train.best_metric
  if not split or split == config.data.eval_split:
    return {"test_status": "no data.test_split apart from data.eval_split"}
  best = metric_names.best_record(records, metric)
  if best is None:
    return {"test_status": f"no evaluation reported {metric}"}
  step = best["step"]
  if step not in checkpoint.saved_steps(directory):
    return {"test_status": f"the best {metric} was at step {step}, whose checkpoint is gone "
                           "(keep it with train.keep_best >= 1)"}
  path = evaluate.result_path(directory, step, split, config)
  if not storage.exists(path):
    command = [*COMMAND, f"--config={test.config_path}", f"--workdir={directory}",
               "--mode=evaluate", f"--checkpoint_step={step}", f"--split={split}",
               *trial_command(test.config_path, directory, {**overrides, **TEST_LEFT_OUT},
                              test.base_overrides)[len(COMMAND) + 3:]]
    log = _TrialLog(storage.join(directory, "train.log"))
    try:
      code = subprocess.run(command, stdout=log.file, stderr=subprocess.STDOUT).returncode
    finally:
      log.close()
    if code != 0 or not storage.exists(path):
      return {"test_status": f"the evaluation on {split} failed (exit {code}); see "
                             f"{directory}/train.log"}
  return {"test": {"split": split, "step": step, "selected_by": metric,
                   "metrics": _read_json(path, "the run's test result")}}


class TestPass(NamedTuple):
  """--sweep_test_best: what scoring a run's best checkpoint on the test split needs."""

  config_path: str
  base_overrides: dict


# What a run trains without under --sweep_test_best: the test split is read once, afterwards.
TEST_LEFT_OUT = {"data.test_split": ""}


def _finish_trial(directory: str, overrides: dict, wall_time_s: float, metric: str,
                  config, test: Optional[TestPass] = None) -> Optional[dict]:
  """The result of a trial that ended with exit code 0, written to its directory; None if it
  stopped early (a signal) and has no final metrics.

  best: the evaluation on data.eval_split with the best train.best_metric (the checkpoint
  keep_best keeps); with `test`, that checkpoint scored on data.test_split (see _test_best),
  before the result file is written: a sweep stopped meanwhile redoes only that.
  """
  final, records = _metrics_of(directory, config)
  if final is None:
    return None
  best = metric_names.best_record(records, metric)
  best_step = best["step"] if best else None
  selected = metric_names.best_record(records, config.train.best_metric)
  result = {"overrides": overrides, "metrics": final, "best_step": best_step,
            "wall_time_s": wall_time_s, "status": "done"}
  if selected is not None:
    result["best"] = {"metric": config.train.best_metric, "step": selected["step"],
                      "metrics": _numbers(selected)}
  if test is not None:
    result.update(_test_best(directory, test, overrides, config, records))
  logger.write_hparams(directory, overrides, final, final["step"])  # before the result: a
  # trial with its result file is finished and never revisited
  storage.write(storage.join(directory, RESULT_FILE), json.dumps(result, indent=2))
  return result


# The metrics of a run's best evaluation and of its test pass that the tables show (those it
# reported), after the sweep's own metric.
SHOWN = ("exact_match", "oracle_exact_match", "token_accuracy", "bleu", "accuracy", "loss",
         "exact_match_repetitions_trained", "exact_match_repetition_unseen")


def _shown(metric: str, results: list) -> list[str]:
  reported = {k for _, r in results for part in ("best", "test")
              for k in (r.get(part) or {}).get("metrics", {})}
  return [m for m in dict.fromkeys((metric, *SHOWN)) if m in reported]


def _run_values(result: dict, shown: list) -> dict:
  """best_M and test_M of a run's result (see _finish_trial), for each M of `shown`."""
  values = {}
  for part in ("best", "test"):
    metrics = (result.get(part) or {}).get("metrics", {})
    values.update({f"{part}_{m}": metrics[m] for m in shown if m in metrics})
  return values


def _cell(v) -> str:
  return f"{v:.4g}" if isinstance(v, float) else str(v)


def seed_rows(runs: list, results: dict, metric: str, shown: list) -> list[dict]:
  """One row per trial: its overrides (seed left out), the seeds done, and for the final
  `metric` and each best_M / test_M (see _run_values) the median, min and max over its
  finished runs. Sorted by the median best `metric` (dev, the selection), else final; best
  first."""
  keys = sorted({k for run in runs for k in run.overrides if k != "seed"})
  by_trial = {}
  for run in runs:
    by_trial.setdefault(run.trial, []).append(run)
  rows = []
  for trial, members in by_trial.items():
    done = [results[run.name] for run in members
            if results.get(run.name, {}).get("status") == "done"]
    row = {"trial": f"trial_{trial:03d}", "seeds": f"{len(done)}/{len(members)}"}
    row.update({k: members[0].overrides.get(k, "") for k in keys})
    values = {}
    for r in done:
      for name, value in {f"final_{metric}": r.get("metrics", {}).get(metric),
                          **_run_values(r, shown)}.items():
        if isinstance(value, (int, float)):
          values.setdefault(name, []).append(float(value))
    columns = [f"best_{m}" for m in shown] + [f"final_{metric}"] + [f"test_{m}" for m in shown]
    for name in columns:
      found = values.get(name, [])
      row.update({f"{name}_median": statistics.median(found) if found else "",
                  f"{name}_min": min(found) if found else "",
                  f"{name}_max": max(found) if found else ""})
    rows.append(row)

  def order(row):
    for name in (f"best_{metric}_median", f"final_{metric}_median"):
      if row.get(name, "") != "":
        return (False, metric_names.sort_key(metric, row[name]), row["trial"])
    return (True, 0.0, row["trial"])

  return sorted(rows, key=order)


def _seed_table(rows: list, metric: str) -> list[str]:
  """The Markdown lines of `seed_rows`: each metric as "median [min, max]"."""
  fixed = [k for k in rows[0] if not k.endswith(("_median", "_min", "_max"))]
  metrics = [k[:-len("_median")] for k in rows[0] if k.endswith("_median")
             and any(row[k] != "" for row in rows)]
  lines = ["| " + " | ".join(fixed + metrics) + " |",
           "| " + " | ".join("---" for _ in fixed + metrics) + " |"]
  for row in rows:
    cells = [_cell(row[k]) for k in fixed] + [
        "" if row[f"{m}_median"] == "" else
        f"{_cell(row[f'{m}_median'])} [{_cell(row[f'{m}_min'])}, {_cell(row[f'{m}_max'])}]"
        for m in metrics]
    lines.append("| " + " | ".join(cells) + " |")
  return lines


def _write_csv(path: str, rows: list) -> str:
  table = io.StringIO(newline="")
  writer = csv.DictWriter(table, fieldnames=list(rows[0]))
  writer.writeheader()
  writer.writerows(rows)
  return storage.write(path, table.getvalue())


def write_results(workdir: str, runs: list, results: dict, metric: str,
                  split: str) -> tuple[str, str, str]:
  """results.csv and results.md, sorted by `metric` (best first); failed trials last. With
  seeded trials, also results_seeds.csv and a second table in results.md (see seed_rows).

  runs: the sweep's runs (`Run`); results: {run name: its result} of those that have one.
  split: the data split the final metrics are of (data.eval_split), named in results.md.
  Returns the path of results.csv and results.md, and the Markdown text.
  """
  listed = [(run, results[run.name]) for run in runs if run.name in results]
  seeded = any(run.seed is not None for run in runs)
  keys = sorted({k for run, _ in listed for k in run.overrides if k != "seed"})
  columns = sorted({k for _, r in listed for k, v in r.get("metrics", {}).items()
                    if isinstance(v, (int, float)) and not isinstance(v, bool)
                    and k not in ("step", "max_examples", "max_decode_len")})
  shown = _shown(metric, [(run.name, r) for run, r in listed])
  extra = [f"{part}_{m}" for part in ("best", "test") for m in shown]

  def order(item):
    run, r = item
    value = r.get("metrics", {}).get(metric)
    return (value is None, metric_names.sort_key(metric, value) if value is not None else 0.0,
            run.name)

  rows = []
  for run, r in sorted(listed, key=order):
    row = {"trial": run.name, "status": r["status"]}
    if seeded:
      row["seed"] = "" if run.seed is None else run.seed
    row.update({k: run.overrides.get(k, "") for k in keys})
    row.update({m: r.get("metrics", {}).get(m, "") for m in columns})
    values = _run_values(r, shown)
    row.update({k: values.get(k, "") for k in extra})
    row.update({"best_step": r.get("best_step", ""),
                "wall_time_s": round(r.get("wall_time_s", 0), 1)})
    if r.get("test_status"):
      row["status"] += f" ({r['test_status']})"
    rows.append(row)
  columns = list(rows[0])
  csv_path = _write_csv(storage.join(workdir, "results.csv"), rows)

  better = "lower" if metric_names.lower_is_better(metric) else "higher"
  lines = [f"# Sweep results: {metric} on split {split!r}, best first", "",
           f"Each trial's final evaluation of data.eval_split ({split}) at train.steps, sorted by "
           f"{metric} ({better} is better); best_step: the trial's evaluation with the best "
           f"{metric} during training.", "",
           "| " + " | ".join(columns) + " |", "| " + " | ".join("---" for _ in columns) + " |"]
  lines += ["| " + " | ".join(_cell(row[c]) for c in columns) + " |" for row in rows]
  if extra:
    lines[3:3] = [
        "best_M: the run's evaluation of data.eval_split with the best train.best_metric (the "
        "checkpoint keep_best keeps); test_M: that checkpoint on data.test_split, scored once "
        "(--sweep_test_best), never used to sort."]
  if seeded:
    by_trial = seed_rows(runs, results, metric, shown)
    _write_csv(storage.join(workdir, "results_seeds.csv"), by_trial)
    lines += ["", "## Over seeds: median [min, max] of each trial's finished runs", "",
              f"Sorted by the median best_{metric} (the selection on {split}), else the median "
              f"final_{metric} (data.eval_split at train.steps); seeds: runs finished / asked "
              "for (results_seeds.csv has the numbers).", ""]
    lines += _seed_table(by_trial, metric)
  text = "\n".join(lines) + "\n"
  md_path = storage.write(storage.join(workdir, "results.md"), text)
  return csv_path, md_path, text


class _Signals:
  """While a sweep runs, SIGTERM and SIGINT go on to its running trials (each in a session of its
  own, so that a terminal's Ctrl-C reaches them once, through here) and no trial starts after
  them. A trial stops as training does: its current step checkpointed, exit code 0."""

  def __init__(self, running: dict):
    self.running = running
    self.signal = None
    self._previous = {}

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      for sig in (signal.SIGTERM, signal.SIGINT):
        self._previous[sig] = signal.signal(sig, self._forward)
    return self

  def __exit__(self, *exc):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)

  def _forward(self, signum, frame):
    self.signal = signal.Signals(signum).name
    for process, _, _ in self.running.values():
      if process.poll() is None:
        process.send_signal(signum)  # a second Ctrl-C stops a trial at once, as it does train


def _launchable(workdir: str, runs: list, pending: list, waiting: set) -> Optional[int]:
  """The first pending run whose directory no other run holds. A held one (a run left running
  by a sweep that was killed) is waited for, with one line saying so."""
  for j in pending:
    try:
      storage.lock(_trial_dir(workdir, runs[j]), "trial").check()
      return j
    except UserError as e:
      if j not in waiting:
        waiting.add(j)
        print(f"{runs[j].name}: waiting for the run that holds it ({e})", flush=True)
  return None


def run_sweep(config_path: str, workdir: str, base_overrides: Optional[dict] = None,
              parallel: int = 1, dry_run: bool = False, metric: str = "loss",
              out=sys.stdout, seeds: int = 0,
              test_best: bool = False,
              only: Optional[Sequence[int]] = None) -> list[tuple[str, dict]]:
  """Runs (or with dry_run, prints) every run not yet finished; writes the results tables.

  Every trial's config is validated first: a bad one is refused before any trial runs.
  seeds: --sweep_seeds (0: each trial's "seeds" entry, else one run); test_best:
  --sweep_test_best (see the module docstring); only: --sweep_trials, the trial numbers to run,
  in that order (None: all). Returns [(run name, result)].
  """
  if parallel < 1:
    raise UserError(f"--sweep_parallel must be >= 1, got {parallel}")
  if metric not in metric_names.EVAL_METRICS:
    raise UserError(f"--sweep_metric must be one of {', '.join(metric_names.EVAL_METRICS)}; "
                    f"got {metric!r}")
  config_path = os.path.abspath(config_path)
  trials = load_sweep(config_path)
  counts = seed_counts(trials, seeds)
  trials = [{k: v for k, v in t.items() if k != SEEDS} for t in trials]
  base_overrides = dict(base_overrides or {})
  configs = check_trials(config_path, trials, base_overrides)
  runs = expand_runs(trials, configs, counts)
  chosen = chosen_runs(runs, len(trials), only)
  test = TestPass(config_path, base_overrides) if test_best else None
  workdir = checkpoint.check_workdir(workdir, entries={})
  left_out = TEST_LEFT_OUT if test_best else {}
  commands = [trial_command(config_path, _trial_dir(workdir, run), {**run.overrides, **left_out},
                            base_overrides) for run in runs]
  if dry_run:
    for j in chosen:
      out.write(shlex.join(commands[j]) + "\n")
    return []

  for j in chosen:  # all checked before anything is written
    _check_trial_dir(_trial_dir(workdir, runs[j]), runs[j].overrides)
  checkpoint.create_workdir(workdir)
  sweep_lock = storage.lock(workdir, "the sweep's --workdir")  # flock, or a bucket's lease
  sweep_lock.acquire()
  with sweep_lock:
    return _run_trials(workdir, runs, [configs[run.trial] for run in runs], commands, parallel,
                       metric, test, chosen)


def chosen_runs(runs: list, num_trials: int, only: Optional[Sequence[int]]) -> list[int]:
  """The indices into `runs` of --sweep_trials' trials, in the flag's order (all: None)."""
  if only is None:
    return list(range(len(runs)))
  only = list(only)
  wrong = [t for t in only if not 0 <= t < num_trials]
  if wrong or not only:
    raise UserError(f"--sweep_trials must name trials 0..{num_trials - 1} of get_sweep(); got "
                    f"{','.join(map(str, only)) or 'none'}")
  if len(set(only)) != len(only):
    raise UserError(f"--sweep_trials names a trial twice: {','.join(map(str, only))}")
  return sorted((j for j, run in enumerate(runs) if run.trial in only),
                key=lambda j: (only.index(runs[j].trial), j))


class _Progress:
  """One bar over the sweep's train steps (every trial's), with the ETA of the whole sweep and
  the running trials' step and loss, read from their metrics.jsonl (trials run in subprocesses
  that write to their own logs). Drawn only for a person watching (core/progress.py)."""

  def __init__(self, workdir: str, configs: list, done: list, names: Optional[list] = None,
               chosen: Optional[list] = None):
    # Runs --sweep_trials left out count for nothing.
    self._workdir = workdir
    self._steps = [c.train.steps if chosen is None or i in chosen else 0
                   for i, c in enumerate(configs)]
    self._names = names or [f"trial_{i:03d}" for i in range(len(configs))]
    self._finished = sum(self._steps[i] for i in done)
    self._bar = progress.bar(total=sum(self._steps), initial=self._finished, desc="sweep",
                             unit="step")
    self._last_read = 0.0

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self._bar.close()

  def finished(self, i: int) -> None:
    self._finished += self._steps[i]

  def update(self, running: dict) -> None:
    # In a bucket each read is a request or two a trial: every 10 s rather than every second.
    every = 10.0 if storage.is_url(self._workdir) else 1.0
    if self._bar.disable or time.time() - self._last_read < every:
      return
    self._last_read = time.time()
    shown, steps = [], self._finished
    for i in sorted(running):
      record = _last_train_record(storage.join(self._workdir, self._names[i],
                                               logger.METRICS_FILE))
      step = min(int(record.get("step", 0)), self._steps[i])
      steps += step
      loss = f" loss {record['loss']:.3f}" if "loss" in record else ""
      shown.append(f"{self._names[i]} {step}/{self._steps[i]}{loss}")
    self._bar.n = max(self._bar.n, steps)
    self._bar.set_postfix_str("; ".join(shown), refresh=True)


def _tail(path: str) -> bytes:
  """The end of a trial's metrics.jsonl: its last 16 KiB locally; in a bucket, its last few
  chunk objects (storage.JsonLog)."""
  if storage.is_url(path):
    parts = storage.listdir(path + storage.PARTS_SUFFIX)[-4:]
    return b"".join(storage.read_bytes(storage.join(path + storage.PARTS_SUFFIX, name))
                    for name in parts)
  with open(path, "rb") as f:
    f.seek(0, os.SEEK_END)
    f.seek(max(f.tell() - 16384, 0))
    return f.read()


def _last_train_record(path: str) -> dict:
  """The newest training record of a trial's metrics.jsonl ({} before its first log line)."""
  try:
    lines = _tail(path).decode("utf-8", "replace").splitlines()
  except OSError:
    return {}
  for line in reversed(lines):
    try:
      record = json.loads(line)
    except ValueError:  # the partial first line of the tail, or a line being written
      continue
    if isinstance(record, dict) and record.get("split") == "train":
      return record
  return {}


class _TrialLog:
  """A trial's train.log (its stdout and stderr). Local: the file, appended to by the trial's
  process. In a bucket, which has no append: a local temporary file that the process writes,
  added to the log object when the trial ends (a sweep killed meanwhile loses that much of the
  log; the trial's metrics and checkpoints are in the bucket already)."""

  def __init__(self, path: str):
    self.path = path
    self.file = (tempfile.TemporaryFile(prefix="trial-", suffix=".log") if storage.is_url(path)
                 else open(path, "ab"))

  def close(self) -> None:
    try:
      if storage.is_url(self.path):
        self.file.seek(0)
        try:
          before = storage.read_bytes(self.path)
        except FileNotFoundError:
          before = b""
        storage.write(self.path, before + self.file.read())
    except UserError as e:  # the trial's own outcome matters more than its log
      print(f"warning: could not write {self.path}: {e}", file=sys.stderr, flush=True)
    finally:
      self.file.close()


def _run_trials(workdir, runs, configs, commands, parallel, metric,
                test=None, chosen=None) -> list[tuple[str, dict]]:
  """Runs the `runs` not finished yet, of those in `chosen` (indices, in the order to run them;
  None: all); configs[j] and commands[j] are run j's. The results tables also list the other
  runs' results already in the workdir."""
  chosen = list(range(len(runs))) if chosen is None else chosen
  results, pending = {}, []
  for j, run in enumerate(runs):
    directory = _trial_dir(workdir, run)
    if j in chosen and not storage.exists(storage.join(directory, "trial.json")):
      checkpoint.create_workdir(directory)
      storage.write(storage.join(directory, "trial.json"), json.dumps({"overrides": run.overrides}))
    path = storage.join(directory, RESULT_FILE)
    result = None
    if storage.exists(path):
      try:
        result = _read_json(path, "the trial's result")
      except UserError as e:
        print(f"warning: {e}", file=sys.stderr, flush=True)
    if result is not None:
      results[run.name] = result
    elif j in chosen:
      pending.append(j)
  pending.sort(key=chosen.index)
  seeded = any(run.seed is not None for run in runs)
  what = (f"{len({run.trial for run in runs})} trials in {len(runs)} runs (seeds)" if seeded
          else f"{len(runs)} trials")
  finished = f"{len(results)} already finished"
  if len(chosen) < len(runs):
    # Counted apart: "chose 9 runs, 9 already finished, running 9" read as if the 9 were the same.
    ours = len(chosen) - len(pending)  # a chosen run is either finished or pending
    what += f", of which --sweep_trials chose {len(chosen)} runs"
    finished = (f"{ours} of the chosen already finished (and {len(results) - ours} of the "
                f"others)")
  print(f"sweep: {what}, {finished}, running {len(pending)} ({parallel} at a time) in {workdir}",
        flush=True)

  running, waiting = {}, set()  # running: index -> (process, start time, log file)
  watch = _Progress(workdir, configs, done=[j for j in chosen if j not in pending],
                    names=[run.name for run in runs], chosen=chosen)
  with _Signals(running) as signals, watch:
    while (pending and not signals.signal) or running:
      while pending and len(running) < parallel and not signals.signal:
        j = _launchable(workdir, runs, pending, waiting)
        if j is None:
          break
        pending.remove(j)
        run = runs[j]
        log = _TrialLog(storage.join(_trial_dir(workdir, run), "train.log"))
        _log(workdir, trial=run.trial, run=run.name, event="start", overrides=run.overrides)
        process = subprocess.Popen(commands[j], stdout=log.file, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        running[j] = (process, time.time(), log)
        progress.write(f"{run.name} started: {run.overrides}")
      time.sleep(0.2)
      watch.update(running)
      for j, (process, start, log) in list(running.items()):
        if process.poll() is None:
          continue
        log.close()
        del running[j]
        wall = time.time() - start
        run = runs[j]
        directory = _trial_dir(workdir, run)
        result = None
        if process.returncode == 0:
          result = _finish_trial(directory, run.overrides, wall, metric, configs[j], test)
        if result is not None:
          results[run.name] = result
          watch.finished(j)
          tested = (f"; test {result['test']['metrics'].get(metric)}" if "test" in result
                    else "")
          progress.write(f"{run.name} done in {wall:.0f}s: {metric} "
                         f"{result['metrics'].get(metric)}{tested}")
        elif process.returncode == 0 or signals.signal:
          results[run.name] = {"overrides": run.overrides, "status": "interrupted",
                               "wall_time_s": wall}
          progress.write(f"{run.name} stopped ({signals.signal or 'a signal'}); a rerun "
                         "resumes it")
        else:
          results[run.name] = {"overrides": run.overrides,
                               "status": f"failed (exit {process.returncode})",
                               "wall_time_s": wall}
          progress.write(f"{run.name} failed with exit code {process.returncode}; see "
                         f"{directory}/train.log")
        _log(workdir, trial=run.trial, run=run.name, event="end",
             status=results[run.name]["status"])

  ordered = [(run.name, results[run.name]) for run in runs if run.name in results]
  if ordered:
    split = ", ".join(sorted({c.data.eval_split for c in configs}))
    csv_path, md_path, table = write_results(workdir, runs, results, metric, split)
    print(f"\n{table}\nresults: {md_path} and {csv_path}", flush=True)
  if signals.signal:
    print(f"{signals.signal}: the sweep stopped; its running trials saved checkpoints; run the "
          "same command to resume", flush=True)
  return ordered
