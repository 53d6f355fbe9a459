"""Hyperparameter sweeps declared next to their experiment.

An experiment file may define `get_sweep()` returning a list of override dicts (dotted config
keys -> values), usually built with `grid(...)` or `random_search(...)`:

  def get_sweep():
    return sweep.grid(**{"train.learning_rate": [1e-3, 2e-3], "model.num_encoder_layers": [2, 3]})

`transformer-jax --config=FILE --workdir=DIR --sweep` runs every trial as its own training run in
DIR/trial_NNN (sequentially, or N at a time with --sweep_parallel=N). A finished trial leaves
DIR/trial_NNN/trial_result.json and is never run again; an interrupted one resumes from its own
checkpoints. DIR/results.csv and DIR/results.md list every trial, sorted by the chosen metric.
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
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Optional, Sequence

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
      config = trial_config(config_path, trial, base_overrides)
      config_lib.validate(config)
    except UserError as e:
      raise UserError(f"trial_{i:03d} of get_sweep() in {config_path} ({trial}): {e}; fix "
                      "get_sweep() (no trial was run)") from None
    configs.append(config)
  return configs


def _log(workdir: str, **record) -> None:
  storage.append_jsonl(storage.join(workdir, "sweep_log.jsonl"), {"time": time.time(), **record})


def _trial_dir(workdir: str, index: int) -> str:
  return storage.join(workdir, f"trial_{index:03d}")


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


def _finish_trial(directory: str, overrides: dict, wall_time_s: float, metric: str,
                  config) -> Optional[dict]:
  """The result of a trial that ended with exit code 0, written to its directory; None if it
  stopped early (a signal) and has no final metrics."""
  final, records = _metrics_of(directory, config)
  if final is None:
    return None
  best = metric_names.best_record(records, metric)
  best_step = best["step"] if best else None
  result = {"overrides": overrides, "metrics": final, "best_step": best_step,
            "wall_time_s": wall_time_s, "status": "done"}
  logger.write_hparams(directory, overrides, final, final["step"])  # before the result: a
  # trial with its result file is finished and never revisited
  storage.write(storage.join(directory, RESULT_FILE), json.dumps(result, indent=2))
  return result


def write_results(workdir: str, results: list[tuple[int, dict]], metric: str,
                  split: str) -> tuple[str, str, str]:
  """results.csv and results.md, sorted by `metric` (best first); failed trials last.

  split: the data split the final metrics are of (data.eval_split), named in results.md.
  Returns the two paths and the Markdown table.
  """
  keys = sorted({k for _, r in results for k in r["overrides"]})
  columns = sorted({k for _, r in results for k, v in r.get("metrics", {}).items()
                    if isinstance(v, (int, float))
                    and k not in ("step", "max_examples", "max_decode_len")})

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
  table = io.StringIO(newline="")
  writer = csv.DictWriter(table, fieldnames=columns)
  writer.writeheader()
  writer.writerows(rows)
  csv_path = storage.write(storage.join(workdir, "results.csv"), table.getvalue())

  def cell(v):
    return f"{v:.4g}" if isinstance(v, float) else str(v)

  better = "lower" if metric_names.lower_is_better(metric) else "higher"
  lines = [f"# Sweep results: {metric} on split {split!r}, best first", "",
           f"Each trial's final evaluation of data.eval_split ({split}) at train.steps, sorted by "
           f"{metric} ({better} is better); best_step: the trial's evaluation with the best "
           f"{metric} during training.", "",
           "| " + " | ".join(columns) + " |", "| " + " | ".join("---" for _ in columns) + " |"]
  lines += ["| " + " | ".join(cell(row[c]) for c in columns) + " |" for row in rows]
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


def _launchable(workdir: str, pending: list, waiting: set) -> Optional[int]:
  """The first pending trial whose directory no other run holds. A held one (a trial left running
  by a sweep that was killed) is waited for, with one line saying so."""
  for i in pending:
    try:
      storage.lock(_trial_dir(workdir, i), "trial").check()
      return i
    except UserError as e:
      if i not in waiting:
        waiting.add(i)
        print(f"trial_{i:03d}: waiting for the run that holds it ({e})", flush=True)
  return None


def run_sweep(config_path: str, workdir: str, base_overrides: Optional[dict] = None,
              parallel: int = 1, dry_run: bool = False, metric: str = "loss",
              out=sys.stdout) -> list[tuple[int, dict]]:
  """Runs (or with dry_run, prints) every trial not yet finished; writes the results table.

  Every trial's config is validated first: a bad one is refused before any trial runs.
  """
  if parallel < 1:
    raise UserError(f"--sweep_parallel must be >= 1, got {parallel}")
  if metric not in metric_names.EVAL_METRICS:
    raise UserError(f"--sweep_metric must be one of {', '.join(metric_names.EVAL_METRICS)}; "
                    f"got {metric!r}")
  config_path = os.path.abspath(config_path)
  trials = load_sweep(config_path)
  base_overrides = dict(base_overrides or {})
  configs = check_trials(config_path, trials, base_overrides)
  workdir = checkpoint.check_workdir(workdir, entries={})
  commands = [trial_command(config_path, _trial_dir(workdir, i), t, base_overrides)
              for i, t in enumerate(trials)]
  if dry_run:
    for command in commands:
      out.write(shlex.join(command) + "\n")
    return []

  for i, trial in enumerate(trials):  # all checked before anything is written
    _check_trial_dir(_trial_dir(workdir, i), trial)
  checkpoint.create_workdir(workdir)
  sweep_lock = storage.lock(workdir, "the sweep's --workdir")  # flock, or a bucket's lease
  sweep_lock.acquire()
  with sweep_lock:
    return _run_trials(workdir, trials, configs, commands, parallel, metric)


class _Progress:
  """One bar over the sweep's train steps (every trial's), with the ETA of the whole sweep and
  the running trials' step and loss, read from their metrics.jsonl (trials run in subprocesses
  that write to their own logs). Drawn only for a person watching (core/progress.py)."""

  def __init__(self, workdir: str, configs: list, done: list):
    self._workdir, self._steps = workdir, [c.train.steps for c in configs]
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
      record = _last_train_record(storage.join(_trial_dir(self._workdir, i),
                                               logger.METRICS_FILE))
      step = min(int(record.get("step", 0)), self._steps[i])
      steps += step
      loss = f" loss {record['loss']:.3f}" if "loss" in record else ""
      shown.append(f"trial_{i:03d} {step}/{self._steps[i]}{loss}")
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


def _run_trials(workdir, trials, configs, commands, parallel, metric) -> list[tuple[int, dict]]:
  results, pending = {}, []
  for i, trial in enumerate(trials):
    directory = _trial_dir(workdir, i)
    if not storage.exists(storage.join(directory, "trial.json")):
      checkpoint.create_workdir(directory)
      storage.write(storage.join(directory, "trial.json"), json.dumps({"overrides": trial}))
    path = storage.join(directory, RESULT_FILE)
    result = None
    if storage.exists(path):
      try:
        result = _read_json(path, "the trial's result")
      except UserError as e:
        print(f"warning: {e}", file=sys.stderr, flush=True)
    if result is not None:
      results[i] = result
    else:
      pending.append(i)
  print(f"sweep: {len(trials)} trials, {len(results)} already finished, running {len(pending)} "
        f"({parallel} at a time) in {workdir}", flush=True)

  running, waiting = {}, set()  # running: index -> (process, start time, log file)
  watch = _Progress(workdir, configs, done=[i for i in range(len(trials)) if i not in pending])
  with _Signals(running) as signals, watch:
    while (pending and not signals.signal) or running:
      while pending and len(running) < parallel and not signals.signal:
        i = _launchable(workdir, pending, waiting)
        if i is None:
          break
        pending.remove(i)
        log = _TrialLog(storage.join(_trial_dir(workdir, i), "train.log"))
        _log(workdir, trial=i, event="start", overrides=trials[i])
        process = subprocess.Popen(commands[i], stdout=log.file, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        running[i] = (process, time.time(), log)
        progress.write(f"trial_{i:03d} started: {trials[i]}")
      time.sleep(0.2)
      watch.update(running)
      for i, (process, start, log) in list(running.items()):
        if process.poll() is None:
          continue
        log.close()
        del running[i]
        wall = time.time() - start
        directory = _trial_dir(workdir, i)
        result = None
        if process.returncode == 0:
          result = _finish_trial(directory, trials[i], wall, metric, configs[i])
        if result is not None:
          results[i] = result
          watch.finished(i)
          progress.write(f"trial_{i:03d} done in {wall:.0f}s: {metric} "
                         f"{result['metrics'].get(metric)}")
        elif process.returncode == 0 or signals.signal:
          results[i] = {"overrides": trials[i], "status": "interrupted", "wall_time_s": wall}
          progress.write(f"trial_{i:03d} stopped ({signals.signal or 'a signal'}); a rerun "
                         "resumes it")
        else:
          results[i] = {"overrides": trials[i], "status": f"failed (exit {process.returncode})",
                        "wall_time_s": wall}
          progress.write(f"trial_{i:03d} failed with exit code {process.returncode}; see "
                         f"{directory}/train.log")
        _log(workdir, trial=i, event="end", status=results[i]["status"])

  ordered = sorted(results.items())
  if ordered:
    split = ", ".join(sorted({c.data.eval_split for c in configs}))
    csv_path, md_path, table = write_results(workdir, ordered, metric, split)
    print(f"\n{table}\nresults: {md_path} and {csv_path}", flush=True)
  if signals.signal:
    print(f"{signals.signal}: the sweep stopped; its running trials saved checkpoints; run the "
          "same command to resume", flush=True)
  return ordered
