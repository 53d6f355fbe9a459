"""A sweep worker: joins the study (creating it and enqueueing get_sweep()'s trials if it is the
first), then takes trials until the budget is spent, training each in WORKDIR/trial_NNNN.

The same command on any number of machines makes them workers of one study. A trial is a
training run in this process (train_fn, run.train_and_evaluate), whose every evaluation reports
sweep.metric to Optuna and asks the pruner whether to stop. What befalls a trial:
- it finishes: its final metric is the trial's value (state COMPLETE);
- the pruner stops it: its checkpoint is saved, state PRUNED at that step;
- it fails by its own fault (a bad override, a NaN loss, an error in training): state FAIL with
  its error, not retried;
- its worker is lost (SIGKILL, a lost VM): heartbeats (a database) or its gone pid (the journal
  file, one machine) mark it failed, and a copy is enqueued (up to sweep.retries times) that
  trains in the same trial directory, resuming from its latest checkpoint;
- another process of its job (jax.distributed) is gone: the trial is handed back, and the process
  stops in one line (core/job_output.py);
- its worker gets SIGTERM/SIGINT: training saves its step, the trial is handed back (failed, with
  a copy enqueued as for a lost worker) and the worker exits with code 0;
- its database goes away: every call of the worker waits for it (store.ride_out), up to
  Options.outage_s, while training goes on until its next evaluation's report; past the bound
  training saves its step and the worker stops in one line naming that checkpoint, the trial
  left running in the study until its heartbeat lapses and a worker takes it up again.
Each trial runs through study.optimize(n_trials=1): in Optuna 5.0 that is where heartbeats live
(its _run_trial fails stale trials, then records the trial's heartbeat from a thread while the
objective runs; ask/tell has none), and only RDBStorage implements them (BaseHeartbeat).
A job of several processes (jax.distributed) is one worker: process 0 takes the trial and sends
its overrides to the others (multihost_utils), all train it, process 0 alone reports.

Each trial's identity is in the environment of its training run, TRIAL_ENV (JSON: study, trial
number, directory, overrides), and in WORKDIR/trial_NNNN/trial.json.

Trackers (train.trackers with wandb or mlflow): tracking.StudyTracking, optimize()'s callback,
puts each trial's run in the study's group (and MLflow's under the study's parent run) and
reports each ended trial to it.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Callable, NamedTuple, Optional

from transformer_jax.core import job_output, lease, metric_names, multihost, storage
from transformer_jax.core import signals as signals_lib
from transformer_jax.core.errors import UserError
from transformer_jax.tools.sweep import results as results_lib
from transformer_jax.tools.sweep import space as space_lib
from transformer_jax.tools.sweep import store
from transformer_jax.tools.sweep.tracking import StudyTracking
from transformer_jax.train import checkpoint, logger

TRIAL_ENV = "TRANSFORMER_JAX_SWEEP_TRIAL"
# The index of a worker that --sweep_parallel started (its sampler's stream: sweep.sampler_seed's
# i-th).
WORKER_ENV = "TRANSFORMER_JAX_SWEEP_WORKER"
PARENT_ENV = "TRANSFORMER_JAX_SWEEP_PARENT"  # its pid: such a worker dies with it
# What a run trains without under sweep.test_best: the test split is read once, afterwards.
TEST_LEFT_OUT = {"data.test_split": ""}
TrainFn = Callable  # train_fn(config, workdir, on_eval=...) -> final metrics ({} if stopped)


class Options(NamedTuple):
  metric: str = "loss"
  sampler: str = "tpe"
  pruner: str = "none"
  budget: int = 0  # trials in the study in all, enqueued ones included; 0: as declared
  storage: Optional[str] = None  # --sweep_storage; None: the journal file in the workdir
  seed: int = 0  # the sampler's
  heartbeat_s: int = 60
  retries: int = 3
  parallel: int = 1  # worker processes this command starts on this machine
  seeds: int = 0
  only: Optional[list] = None  # sweep.trials
  test_best: bool = False
  dry_run: bool = False
  # How long a worker rides out its database not answering mid-sweep (reports, polls,
  # heartbeats, a trial's end); past it the worker stops in one line (store.Outage).
  outage_s: float = store.OUTAGE_S


class _TrialError(Exception):
  """A trial failed by its own fault (its error is the trial's sweep_error attribute)."""


class _HandedBack(Exception):
  """SIGTERM/SIGINT stopped the trial: it goes back to the queue."""


class _Surplus(Exception):
  """A trial the sampler drew after the budget was spent (workers racing for the last one)."""


def trial_name(root: int) -> str:
  return f"trial_{root:04d}"


root_of = results_lib.root_of


def _check_options(o: Options) -> None:
  space_lib.direction(o.metric)
  if o.sampler not in space_lib.SAMPLERS:
    raise UserError(f"sweep.sampler must be one of {', '.join(space_lib.SAMPLERS)}; got "
                    f"{o.sampler!r}")
  if o.pruner not in space_lib.PRUNERS:
    raise UserError(f"sweep.pruner must be one of {', '.join(space_lib.PRUNERS)}; got "
                    f"{o.pruner!r}")
  for name, value, least in (("--sweep_parallel", o.parallel, 1), ("sweep.budget", o.budget, 0),
                             ("--sweep_heartbeat_s", o.heartbeat_s, 1),
                             ("sweep.retries", o.retries, 0), ("sweep.outage_s", o.outage_s, 0)):
    if value < least:
      raise UserError(f"{name} must be >= {least}, got {value}")


class Plan(NamedTuple):
  """Everything a sweep is, checked before anything is written."""

  experiment: space_lib.Experiment
  base_overrides: dict  # the command's --config.KEY=VALUE
  left_out: dict  # TEST_LEFT_OUT under sweep.test_best
  base_config: object
  queued: list  # space_lib.Queued
  budget: int
  options: Options


def plan(config_path: str, base_overrides: dict, options: Options) -> Plan:
  _check_options(options)
  if (options.storage or "").startswith("sqlite") and options.parallel > 1:
    raise UserError("a SQLite study cannot be shared by several workers (SQLite has no row "
                    "locks: two could take the same trial); leave --sweep_storage out for the "
                    "journal file in a local --workdir, or use PostgreSQL")
  experiment = space_lib.load(os.path.abspath(config_path))
  left_out = TEST_LEFT_OUT if options.test_best else {}
  queued = space_lib.queued_trials(experiment, {**base_overrides, **left_out}, options.seeds,
                                   options.only)
  space_lib.check_space(experiment, {**base_overrides, **left_out})
  base_config = space_lib.trial_config(experiment.path, left_out, base_overrides)
  _check_reported(options, base_config)
  budget = options.budget
  if not budget:
    if experiment.space and options.sampler == "grid":
      budget = len(queued) + _grid_size(space_lib.grid_of(experiment.space))
    elif experiment.space and not queued:
      raise UserError(f"get_search_space() in {experiment.path} needs a trial budget: give "
                      "--config.sweep.budget=N (the trials of the study in all, get_sweep()'s "
                      "included)")
    else:
      budget = len(queued)  # get_sweep()'s trials alone; sweep.budget adds drawn ones
  if budget < len(queued):
    raise UserError(f"sweep.budget={budget} is fewer than the {len(queued)} trials get_sweep() "
                    "enqueues; raise it, or choose trials with sweep.trials")
  space_lib.make_sampler(options.sampler, experiment.space, options.seed, budget)  # it can
  space_lib.make_pruner(options.pruner, base_config)
  return Plan(experiment, base_overrides, left_out, base_config, queued, budget, options)


def _check_reported(o: Options, config) -> None:
  """The metric is one the trials' evaluations report, and a pruner has evaluations to see."""
  task = config.data.task
  reported = metric_names.task_metrics(task, bool(config.eval.get("oracle_length", False)))
  if o.metric not in reported:
    raise UserError(f"sweep.metric={o.metric}: the evaluation of data.task={task} does not "
                    f"report it; it reports {', '.join(reported)}")
  if o.pruner != "none" and not config.train.eval_every:
    raise UserError(f"sweep.pruner={o.pruner} prunes at evaluations, and train.eval_every is "
                    "0 (none before the end): set --config.train.eval_every=N, or "
                    "--config.sweep.pruner=none")


def _grid_size(grid: dict) -> int:
  size = 1
  for values in grid.values():
    size *= len(values)
  return size


def describe_plan(p: Plan, workdir: str) -> str:
  o = p.options
  url = store.redact(o.storage) if o.storage else os.path.join(workdir, store.JOURNAL)
  lines = [f"sweep of {p.experiment.path} in {workdir}",
           f"study: {store.study_name(workdir)} in {url}",
           f"metric: {o.metric} on data.eval_split ({p.base_config.data.eval_split}), "
           f"{space_lib.direction(o.metric)}d",
           f"budget: {p.budget} trials ({len(p.queued)} enqueued from get_sweep()"
           + (f", up to {p.budget - len(p.queued)} drawn by the {o.sampler} sampler"
              if p.experiment.space else "") + ")",
           f"pruner: {o.pruner}",
           f"faults: heartbeat every {o.heartbeat_s} s, lost after {3 * o.heartbeat_s} s, "
           f"retried up to {o.retries} times" if o.storage else
           f"faults: a dead worker's trial (pid gone) retried up to {o.retries} times",
           f"workers here: {o.parallel}"]
  if p.experiment.space:
    lines += ["search space:", *space_lib.describe(p.experiment.space)]
  if p.queued:
    lines.append("enqueued trials (get_sweep()):")
    lines += [f"  get_sweep[{q.index}]" + (f" seed {q.seed}" if q.seed is not None else "")
              + f": {q.overrides}" for q in p.queued]
  return "\n".join(lines)


# ------------------------------------------------------------------ the study


def join_study(p: Plan, workdir: str, st: store.Storage):
  """The study of this sweep, created (with get_sweep()'s trials enqueued) by the first worker;
  a study of another sweep under this name is refused."""
  import optuna
  o = p.options
  name = store.study_name(workdir)
  sampler = space_lib.make_sampler(o.sampler, p.experiment.space, o.seed, p.budget)
  pruner = space_lib.make_pruner(o.pruner, p.base_config)
  ours = store.fingerprint(p.base_config, p.experiment, o.metric)
  # Asked first: create_study on a journal file appends its line even when the study exists.
  if name not in optuna.get_all_study_names(storage=st.storage):
    try:
      study = optuna.create_study(study_name=name, storage=st.storage, sampler=sampler,
                                  pruner=pruner, direction=space_lib.direction(o.metric))
      study.set_user_attr(store.STUDY_ATTR, ours)
      _enqueue(study, p)
      StudyTracking(p).start(study, st.url)  # before "ready": every other worker finds its id
      study.set_user_attr("ready", True)  # the others wait for this: no trial enqueued twice
      return study
    except optuna.exceptions.DuplicatedStudyError:
      pass  # another worker created it meanwhile
  seed = worker_seed(o.seed)
  sampler = space_lib.make_sampler(o.sampler, p.experiment.space, seed, p.budget)
  study = optuna.load_study(study_name=name, storage=st.storage, sampler=sampler, pruner=pruner)
  progress_line(f"sweep: this worker ({socket.gethostname()}, pid {os.getpid()}) samples with "
                f"seed {seed}")
  deadline = time.time() + 120
  while not study.user_attrs.get("ready") and time.time() < deadline:
    time.sleep(0.5)  # its creator is enqueueing get_sweep()'s trials
  theirs = study.user_attrs.get(store.STUDY_ATTR)
  if theirs != ours:
    raise UserError(f"the study {name} in {st.url} belongs to another sweep ({theirs}; this "
                    f"one: {ours}): a changed experiment, config or metric; give another "
                    "--workdir (or --sweep_storage) for a changed sweep")
  _enqueue(study, p)  # trials that sweep.trials or sweep.seeds add to an earlier sweep
  return study


def worker_seed(seed: int) -> int:
  """The sampler's seed of a worker that joins a study made by another: workers with one seed
  would draw the same trials. The study's creator samples with sweep.sampler_seed itself (a lone
  worker is reproducible); the i-th worker of --sweep_parallel with the i-th seed of its stream;
  a worker started on its own (another machine) with entropy of its own, said in one line."""
  import numpy as np
  index = os.environ.get(WORKER_ENV)
  key = [int(index) + 1] if index is not None else [int.from_bytes(os.urandom(8), "little")]
  return int(np.random.SeedSequence([seed, *key]).generate_state(1)[0])


def _enqueue(study, p: Plan) -> None:
  known = {t.user_attrs.get("sweep_key") for t in study.get_trials(deepcopy=False)}
  for q in p.queued:
    if q.key not in known:
      params = {k: v for k, v in q.overrides.items() if k in (p.experiment.space or {})}
      study.enqueue_trial(params, user_attrs={"sweep_key": q.key, "sweep_index": q.index,
                                              "sweep_seed": q.seed, "sweep_overrides": q.overrides})


def _census(study) -> dict:
  """Counts of the study's trials by state, and `roots`: the trials of the budget so far."""
  from optuna.trial import TrialState
  counts = {"roots": 0, "waiting": 0, "running": 0}
  for t in study.get_trials(deepcopy=False):
    if t.user_attrs.get("sweep_surplus"):
      continue
    if root_of(t) == t.number:
      counts["roots"] += 1
    if t.state == TrialState.WAITING:
      counts["waiting"] += 1
    elif t.state == TrialState.RUNNING:
      counts["running"] += 1
  return counts


def _retry(options: Options):
  from optuna.storages import RetryHeartbeatStaleTrialCallback
  return RetryHeartbeatStaleTrialCallback(max_retry=options.retries,
                                          inherit_intermediate_values=True)


def reclaim_dead_local_trials(study, options: Options) -> None:
  """The journal file's stand-in for heartbeats: a running trial of a worker on this machine
  whose process is gone is failed and, within sweep.retries, enqueued again."""
  from optuna.trial import TrialState
  host = socket.gethostname()
  for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
    worker = t.user_attrs.get("sweep_worker") or {}
    if worker.get("host") != host or _alive(worker.get("pid")):
      continue
    try:
      study.tell(t.number, state=TrialState.FAIL)
    except (ValueError, RuntimeError):  # another worker reclaimed it first
      continue
    progress_line(f"{trial_name(root_of(t))}: its worker (pid {worker.get('pid')}) is gone; "
                  "the trial goes back to the queue")
    _retry(options)(study, study.get_trials(deepcopy=False)[t.number])


def _alive(pid) -> bool:
  if not isinstance(pid, int):
    return True  # not ours to judge
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def progress_line(text: str) -> None:
  print(text, file=sys.__stdout__, flush=True)


# ------------------------------------------------------------------ one trial


class _Log:
  """A trial's train.log: what its training run prints (Python's stdout). Local: the file; in a
  bucket (no append), a temporary file added to the log object at the end."""

  def __init__(self, path: str):
    self.path = path
    self.file = (tempfile.TemporaryFile("w+", prefix="trial-", suffix=".log")
                 if storage.is_url(path) else open(path, "a", encoding="utf-8"))

  def close(self) -> None:
    try:
      if storage.is_url(self.path):
        self.file.seek(0)
        try:
          before = storage.read_text(self.path)
        except FileNotFoundError:
          before = ""
        storage.write(self.path, before + self.file.read())
    except UserError as e:  # the trial's outcome matters more than its log
      print(f"warning: could not write {self.path}: {e}", file=sys.stderr, flush=True)
    finally:
      self.file.close()


class _Reporter:
  """on_eval for a trial's training: reports sweep.metric at each evaluation, asks the pruner
  (process 0), and stops every process of the job alike."""

  def __init__(self, trial, metric: str, reported=()):
    self.trial, self.metric = trial, metric
    self.reported = set(reported)  # steps a lost attempt reported (inherited): not again
    self.pruned = None  # (step, why)
    self.pruned_metrics = {}  # the evaluation that pruned it
    self.start = time.time()
    self.lost = False  # the study's database did not come back: training stopped, saved

  def __call__(self, step: int, metrics: dict) -> Optional[str]:
    why = None
    if self.trial is not None and metrics.get(self.metric) is not None:
      value = float(metrics[self.metric])
      try:
        if step not in self.reported:  # a resumed run evaluates them again
          self.trial.report(value, step)
        # So far: a lost worker's attempt counts up to its last evaluation (results.py sums).
        self.trial.set_user_attr("sweep_wall_s", round(time.time() - self.start, 1))
        if self.trial.should_prune():
          self.pruned_metrics = _numbers(metrics)
          pruner = type(self.trial.study.pruner).__name__
          why = f"pruned at step {step}: {self.metric} {value:.4g} ({pruner})"
      except store.DatabaseLost:
        self.lost, why = True, LOST
    why = multihost.broadcast(why)
    if why and not self.lost:
      self.pruned = (step, why)
    return why


LOST = "the study's database is unreachable"  # why a trial's training stopped


def _identity(study_name: str, number: int, root: int, overrides: dict) -> dict:
  return {"study": study_name, "trial": number, "directory": trial_name(root),
          "overrides": overrides}


def _train(train_fn, config, directory: str, reporter, identity: dict):
  """One trial's training run, its identity in the environment, its output in train.log."""
  os.environ[TRIAL_ENV] = json.dumps(identity)
  checkpoint.create_workdir(directory)
  storage.write(storage.join(directory, "trial.json"), json.dumps(identity, indent=2))
  log = _Log(storage.join(directory, "train.log"))
  try:
    with contextlib.redirect_stdout(log.file):
      return train_fn(config, directory, on_eval=reporter)
  finally:
    log.close()
    os.environ.pop(TRIAL_ENV, None)


def _numbers(record: dict) -> dict:
  return {k: v for k, v in record.items() if isinstance(v, (int, float))
          and not isinstance(v, bool) and k not in ("step", "time", "eval_s")}


def _finish(trial, directory: str, overrides: dict, final: dict, config, p: Plan,
            wall: float) -> float:
  """A finished trial's attributes (final metrics, best step, best evaluation, test pass) and its
  value."""
  metric = p.options.metric
  if final.get(metric) is None:
    raise UserError(f"its final evaluation reported no {metric} (it reported "
                    f"{', '.join(sorted(_numbers(final)))}); pick another sweep.metric")
  records = logger.read_metrics(directory)
  best = metric_names.best_record(records, metric)
  selected = metric_names.best_record(records, config.train.best_metric)
  trial.set_user_attr("sweep_metrics", _numbers(final))
  trial.set_user_attr("sweep_best_step", best["step"] if best else None)
  trial.set_user_attr("sweep_wall_s", round(wall, 1))
  startup = [r for r in records if r.get("split") == "startup"]
  if startup:  # the latest attempt's: set-up and first step, and what the cache said
    trial.set_user_attr("sweep_startup", {k: startup[-1][k] for k in (
        "startup_s", "setup_s", "trace_s", "lower_s", "compile_s", "cache")})
  if selected is not None:
    trial.set_user_attr("sweep_best", {"metric": config.train.best_metric,
                                       "step": selected["step"], "metrics": _numbers(selected)})
  if p.options.test_best:
    for key, value in _test_best(directory, overrides, config, records, p).items():
      trial.set_user_attr(f"sweep_{key}", value)
  logger.write_hparams(directory, overrides, final, final.get("step", config.train.steps))
  return float(final[metric])


def _test_best(directory: str, overrides: dict, config, records: list, p: Plan) -> dict:
  """The run's checkpoint with the best train.best_metric scored once on data.test_split (the
  split it trained without); {"test": {...}} or {"test_status": why not}."""
  from transformer_jax.eval import evaluate
  full = space_lib.trial_config(p.experiment.path, overrides, p.base_overrides)
  split, metric = full.data.test_split, config.train.best_metric
  if not split or split == config.data.eval_split:
    return {"test_status": "no data.test_split apart from data.eval_split"}
  best = metric_names.best_record(records, metric)
  if best is None:
    return {"test_status": f"no evaluation reported {metric}"}
  step = best["step"]
  if step not in checkpoint.saved_steps(directory):
    return {"test_status": f"the best {metric} was at step {step}, whose checkpoint is gone "
                           "(keep it with train.keep_best >= 1)"}
  path = evaluate.result_path(directory, step, split, full)
  if not storage.exists(path):
    with contextlib.redirect_stdout(io.StringIO()):
      evaluate.evaluate_from_workdir(full, directory, step=step, split=split)
  metrics = json.loads(storage.read_text(path))
  return {"test": {"split": split, "step": step, "selected_by": metric, "metrics": metrics}}


def _objective(p: Plan, workdir: str, train_fn, study_name: str, state: dict,
               tracking: StudyTracking):
  import optuna
  space = p.experiment.space or {}

  def objective(trial) -> float:
    frozen = trial.study.get_trials(deepcopy=False)[trial.number]  # its system attributes
    root = root_of(frozen)
    overrides = trial.user_attrs.get("sweep_overrides")
    if overrides is None:  # a trial for the sampler to draw
      earlier = sum(1 for t in trial.study.get_trials(deepcopy=False)
                    if t.number < trial.number and root_of(t) == t.number
                    and not t.user_attrs.get("sweep_surplus"))
      if not space or earlier >= p.budget:
        trial.set_user_attr("sweep_surplus", True)
        raise _Surplus()
      overrides = space_lib.suggest(trial, space)
      trial.set_user_attr("sweep_overrides", overrides)
    else:  # get_sweep()'s (or a retried one): its keys of the space recorded as parameters
      space_lib.suggest(trial, {k: v for k, v in space.items() if k in overrides})
    trial.set_user_attr("sweep_worker", {"host": socket.gethostname(), "pid": os.getpid()})
    name = trial_name(root)
    directory = storage.join(workdir, name)
    history = results_lib.retry_history(frozen)
    retry = f" (again, after trial {history[-1]})" if history else ""
    try:
      config = space_lib.trial_config(p.experiment.path, {**overrides, **p.left_out},
                                      p.base_overrides)
      from transformer_jax import config as config_lib
      config_lib.validate(config)
    except UserError as e:
      return _fail(trial, name, str(e))
    state["ran"] = {"trial": trial.number, "directory": directory,
                    "config": tracking.trial_config(config, study_name)}
    if history:
      try:
        _wait_for_the_lost_run(directory, name)
      except UserError as e:
        return _fail(trial, name, str(e))
    progress_line(f"{name} started{retry}: {overrides}")
    identity = _identity(study_name, trial.number, root, overrides)
    multihost.broadcast(identity, "a trial's overrides")
    reporter = _Reporter(trial, p.options.metric, frozen.intermediate_values)
    start = time.time()
    try:
      final = _train(train_fn, config, directory, reporter, identity)
    except UserError as e:
      return _fail(trial, name, str(e))
    except Exception as e:  # noqa: BLE001 - the trial's own fault, recorded in the study
      if job_output.is_peer_lost(e):  # not the trial's fault: it goes back to the queue
        state["handed_back"], state["peer_lost"] = trial.number, str(e).splitlines()[0]
        progress_line(f"{name} goes back to the queue: {job_output.LOST}")
        raise _HandedBack() from None
      return _fail(trial, name, f"{type(e).__name__}: {' '.join(str(e).split())[:300]}")
    wall = time.time() - start
    if reporter.lost:
      raise store.DatabaseLost(directory)  # its checkpoint is saved; the worker says so
    if final:
      state["ran"]["step"] = final.get("step", config.train.steps)
    if reporter.pruned:
      step, why = reporter.pruned
      trial.set_user_attr("sweep_pruned_step", step)
      trial.set_user_attr("sweep_metrics", reporter.pruned_metrics)
      trial.set_user_attr("sweep_wall_s", round(wall, 1))
      progress_line(f"{name} {why}; its checkpoint is saved")
      raise optuna.TrialPruned(why)
    if not final:
      trial.set_user_attr("sweep_wall_s", round(wall, 1))
      state["handed_back"] = trial.number
      progress_line(f"{name} stopped by a signal after saving its checkpoint; it goes back to "
                    "the queue")
      raise _HandedBack()
    try:
      value = _finish(trial, directory, overrides, final, config, p, wall)
    except UserError as e:
      return _fail(trial, name, str(e))
    progress_line(f"{name} finished in {wall:.0f} s: {p.options.metric} {value:.4g}")
    return value

  return objective


def _wait_for_the_lost_run(directory: str, name: str) -> None:
  """A trial taken up again trains where its lost run trained. Locally that run's lock went with
  its process; in a bucket its lease runs out (lease.LEASE_SECONDS) unless renewed: wait for
  that rather than fail the trial for a lease nobody holds any more."""
  import jax
  if jax.process_count() > 1:
    return  # a job of several processes holds no lock of its own (train.loop)
  deadline, said = time.time() + lease.LEASE_SECONDS + 30, False
  while True:
    try:
      lease.lock(directory).check()
      return
    except UserError as e:
      if time.time() > deadline:
        raise
      if not said:
        progress_line(f"{name}: waiting for the lost run's hold on it to end ({e})")
        said = True
      time.sleep(5)


def _fail(trial, name: str, error: str):
  error = store.redact(error)
  trial.set_user_attr("sweep_error", error)
  progress_line(f"{name} failed (not retried): {error}")
  raise _TrialError(error)


# ------------------------------------------------------------------ the worker


def work(p: Plan, workdir: str, study, st: store.Storage, train_fn,
         tracking: Optional[StudyTracking] = None) -> Optional[str]:
  """Takes trials until none is left to take; returns the signal that stopped it, if any.
  tracking: the study in the trackers (StudyTracking, started); None: made here."""
  if tracking is None:
    tracking = StudyTracking(p)
    tracking.start(study, st.url)
  state = tracking.state
  try:
    return _work(p, workdir, study, st, train_fn, tracking)
  except BaseException:
    outage = getattr(st.storage, "outage", None)
    if outage is None or not outage.lost:
      raise
    # Whatever Optuna raised on its way out (it records the trial's end in the database that
    # is gone): the trial is still RUNNING there, and comes back by its heartbeat.
    raise _lost(outage, state.get("ran")) from None
  finally:
    multihost.broadcast(None)  # the other processes of the job stop


def _lost(outage, ran: Optional[dict]) -> UserError:
  """The one line of a worker whose database did not come back within sweep.outage_s."""
  where = ""
  if ran is not None:
    directory = ran["directory"]
    steps = checkpoint.saved_steps(directory)
    where = (f"; {os.path.basename(directory)} stopped with its checkpoint "
             f"{storage.join(directory, 'checkpoints', str(max(steps)))}" if steps else
             f"; {os.path.basename(directory)} stopped before its first checkpoint") + \
        (", from which it resumes when a worker takes it up again (its heartbeat lapses)")
  return UserError(f"the study's database at {outage.url} did not answer for "
                   f"{outage.seconds:.0f} s (sweep.outage_s){where}; run the same command "
                   "once the database answers")


def _work(p: Plan, workdir: str, study, st: store.Storage, train_fn,
          tracking: StudyTracking) -> Optional[str]:
  import optuna
  state = tracking.state
  objective = _objective(p, workdir, train_fn, study.study_name, state, tracking)
  callbacks = [tracking]
  waiting_said = False
  with signals_lib.Signals() as signals:
    while not signals.signal:
      if st.heartbeats:
        optuna.storages.fail_stale_trials(study)
      else:
        reclaim_dead_local_trials(study, p.options)
      census = _census(study)
      if census["waiting"] or (p.experiment.space and census["roots"] < p.budget):
        waiting_said = False
        study.optimize(objective, n_trials=1, catch=(_TrialError, _HandedBack, _Surplus),
                       callbacks=callbacks, gc_after_trial=False)
        if "handed_back" in state:
          number = state.pop("handed_back")
          _retry(p.options)(study, study.get_trials(deepcopy=False)[number])
          if "peer_lost" in state:  # the job cannot go on: this process ends in one line
            job_output.stop_for_lost_peer(state.pop("peer_lost"))
          return signals.signal or "a signal"
      elif census["running"]:
        if not waiting_said:
          progress_line(f"no trial to take; waiting while {census['running']} run on other "
                        "workers (a lost one comes back to the queue)")
          waiting_said = True
        time.sleep(min(2.0, p.options.heartbeat_s))
      else:
        return None
    return signals.signal


def follow(workdir: str, p: Plan, train_fn) -> None:
  """Processes 1.. of a job of several: train what process 0 sends, until it sends None."""
  while True:
    identity = multihost.broadcast(None)
    if identity is None:
      return
    config = space_lib.trial_config(p.experiment.path, {**identity["overrides"], **p.left_out},
                                    p.base_overrides)
    directory = storage.join(workdir, identity["directory"])
    with contextlib.redirect_stdout(io.StringIO()):
      os.environ[TRIAL_ENV] = json.dumps(identity)
      try:
        train_fn(config, directory, on_eval=_Reporter(None, p.options.metric))
      finally:
        os.environ.pop(TRIAL_ENV, None)
    progress_line(f"{identity['directory']}: trained with process 0")


# JAX preallocates this share of a GPU's memory by default (its GPU memory allocation docs).
JAX_PREALLOCATED_SHARE = 0.75


def shared_accelerator_memory(count: int, environ) -> dict:
  """The environment that lets `count` worker processes share one machine's GPUs: each
  preallocates 1/count of JAX's default share (XLA_PYTHON_CLIENT_MEM_FRACTION), instead of the
  first taking three quarters of the memory and the others failing to allocate. Nothing where
  the user set JAX's memory variables, or for one worker. TPUs are not shared between processes
  this way (one process owns a TPU chip); the CPU ignores it."""
  if count <= 1 or any(k in environ for k in ("XLA_PYTHON_CLIENT_MEM_FRACTION",
                                              "XLA_PYTHON_CLIENT_PREALLOCATE",
                                              "XLA_PYTHON_CLIENT_ALLOCATOR")):
    return {}
  return {"XLA_PYTHON_CLIENT_MEM_FRACTION": f"{JAX_PREALLOCATED_SHARE / count:.3f}"}


def _without_flag(argv: list, name: str) -> list:
  """argv without --name=V and --name V."""
  kept, skip = [], False
  for arg in argv:
    if skip:
      skip = False
    elif arg == f"--{name}":
      skip = True
    elif not arg.startswith(f"--{name}="):
      kept.append(arg)
  return kept


def _spawn_workers(argv: list, count: int, url: Optional[str] = None) -> int:
  """--sweep_parallel=N: N worker processes of the same command on this machine, killed with
  this one (PR_SET_PDEATHSIG), signals passed on; the exit code of the first that failed.
  url: the study's database, handed over in the environment (store.STORAGE_ENV): a password on
  a command line is in `ps` for every user of the machine."""
  argv = _without_flag(_without_flag(argv, "sweep_parallel"), "sweep_storage")
  command = [sys.executable, "-m", "transformer_jax", *argv, "--sweep_parallel=1"]
  env = dict(os.environ, **({store.STORAGE_ENV: url} if url else {}))

  env.update(shared_accelerator_memory(count, os.environ), **{PARENT_ENV: str(os.getpid())})
  # No preexec_fn: it makes Popen fork with Python's fork hooks (JAX's warns of os.fork() in a
  # multithreaded process); each child ties itself to this process (die_with_parent).
  children = [subprocess.Popen(command, env={**env, WORKER_ENV: str(i)}) for i in range(count)]

  def forward(signum, frame):
    for child in children:
      if child.poll() is None:
        child.send_signal(signum)

  previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
  try:
    codes = [child.wait() for child in children]
  finally:
    for sig, handler in previous.items():
      signal.signal(sig, handler)
  return next((code for code in codes if code), 0)


def die_with_parent() -> None:
  """A worker that --sweep_parallel started is killed with the command that started it
  (PR_SET_PDEATHSIG, Linux), or ends now if that command has already gone."""
  parent = os.environ.pop(PARENT_ENV, None)
  if parent is None or not sys.platform.startswith("linux"):
    return
  ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
  if os.getppid() != int(parent):
    os._exit(1)


def run_sweep(config_path: str, workdir: str, base_overrides: dict, train_fn: TrainFn,
              options: Options, argv: Optional[list] = None, out=sys.stdout) -> None:
  """--sweep (and --sweep_dry_run): checks the whole plan, then works as a worker of the study
  (or starts --sweep_parallel workers here), then writes the results tables."""
  import jax
  die_with_parent()
  p = plan(config_path, dict(base_overrides or {}), options)
  workdir = checkpoint.check_workdir(workdir, entries={})
  if options.dry_run:
    out.write(describe_plan(p, workdir) + "\n")
    return
  if not storage.is_url(workdir) and os.path.isdir(workdir):
    lease.lock(workdir).check()  # a training run's workdir in use is no sweep's
  main = jax.process_index() == 0
  if not main:
    follow(workdir, p, train_fn)
    return
  import optuna
  optuna.logging.set_verbosity(optuna.logging.ERROR)  # our own lines say what happens
  if options.storage is None:
    checkpoint.create_workdir(workdir)
  st = store.open_storage(options.storage, workdir, options.heartbeat_s, options.retries)
  if st.heartbeats:  # a database server, which can go away for a while mid-sweep
    st = st._replace(storage=store.ride_out(st.storage, st.url, options.outage_s,
                                                 grace_s=3 * options.heartbeat_s))
  try:
    _sweep(p, workdir, st, train_fn, options, argv, out)
  except store.DatabaseLost:  # between trials: no trial of this worker's is left behind
    raise _lost(st.storage.outage, None) from None


def _sweep(p: Plan, workdir: str, st: store.Storage, train_fn, options: Options, argv, out):
  study = join_study(p, workdir, st)
  tracking = StudyTracking(p)
  tracking.start(study, st.url)
  checkpoint.create_workdir(workdir)
  store.write_record(workdir, study.study_name, st.url)
  c = _census(study)
  progress_line(f"sweep: study {study.study_name} in {st.url}: {c['roots']} of {p.budget} trials "
                f"so far, {c['waiting']} waiting, {c['running']} running")
  if options.parallel > 1:
    code = _spawn_workers(argv or [], options.parallel, options.storage)
    stopped = None if code == 0 else f"exit code {code}"
  else:
    stopped = work(p, workdir, study, st, train_fn, tracking)
  if not stopped:
    tracking.end(study)
  table, best = results_lib.write(study, workdir, options.metric,
                                  p.base_config.data.eval_split)
  out.write(f"\n{table}\nresults: {storage.join(workdir, 'results.md')} and "
            f"{storage.join(workdir, 'results.csv')}\n")
  if best:
    out.write(f"best trial: {best}\n")
  if stopped:
    out.write(f"{stopped}: this worker stopped; its trial went back to the queue; run the same "
              "command to go on\n")
  out.flush()
