"""The study in the experiment trackers (train.trackers with wandb or mlflow), as an Optuna
callback: `study.optimize(..., callbacks=[StudyTracking(...)])`.

Each trial's run is in the study's group (train.tracker_group = the study's name) and, for
MLflow, a child of the study's parent run (start_study: made once by the study's creator, its id
a user attribute of the study that every worker reads). When a trial ends, its state, parameters
and last or pruning step go to its run (record_trial); when the budget is spent, the best trial
goes to the parent run (StudyTracking.end). A tracker that fails costs a warning, never a trial.
"""

from __future__ import annotations

import json
import os
import sys

from transformer_jax.core.errors import UserError
from transformer_jax.tools.sweep import results as results_lib
from transformer_jax.tools.sweep import space as space_lib
from transformer_jax.tools.sweep import store

PARENT_ATTR = "mlflow_parent_run_id"  # the study's user attribute: its MLflow parent run
ENDED_ATTR = "mlflow_parent_ended"  # how many trials the study had when its parent run ended


class _TrackerWarning:
  """The first tracker failure of this worker is a warning; the rest go unsaid."""

  said = False

  @classmethod
  def warn(cls, what: str, e: Exception) -> None:
    if not cls.said:
      cls.said = True
      text = store.redact(" ".join(str(e).split()))[:200]
      print(f"warning: {what} failed ({type(e).__name__}: {text}); "
            "the sweep goes on without it (further tracker failures are not repeated)",
            file=sys.stderr, flush=True)


def _tracked(config) -> list:
  from transformer_jax import config as config_lib
  try:
    return [n for n in config_lib.tracker_names(config) if n != "tensorboard"]
  except UserError:
    return []  # the trial's own error, said where it is checked


def _trial_name(trial) -> str:
  return f"trial_{results_lib.root_of(trial):04d}"


def _params(trial) -> dict:
  return {**trial.params, **(trial.user_attrs.get("sweep_overrides") or {})}


class StudyTracking:
  """Optuna's callback that reports each ended trial to its tracker runs.

  plan: the worker's Plan (its base_config, options, experiment, budget); state: the worker's
  dict of its trial, {"ran": {"trial", "directory", "config", "step"}, "handed_back": number}.
  """

  def __init__(self, plan, state: dict | None = None):
    self.plan, self.state, self.parent = plan, {} if state is None else state, ""

  def start(self, study, storage_url: str) -> str:
    """The study's MLflow parent run ("" without MLflow among train.trackers, or if MLflow could
    not be reached): the id kept in the study, else made (or found again) by start_study."""
    self.parent = ""
    if "mlflow" not in _tracked(self.plan.base_config):
      return ""
    known = study.user_attrs.get(PARENT_ATTR)
    if known:
      self.parent = known
      return known
    p, o = self.plan, self.plan.options
    params = {"experiment": os.path.basename(p.experiment.path), "metric": o.metric,
              "sampler": o.sampler, "pruner": o.pruner, "budget": p.budget, "seed": o.seed}
    if p.experiment.space:
      params["space"] = "; ".join(s.strip() for s in space_lib.describe(p.experiment.space))
    try:
      parent = start_study(p.base_config, study.study_name, storage=store.redact(storage_url),
                           params=params, display=store.display_name(study.study_name))
    except Exception as e:  # noqa: BLE001 - a tracker never stops the sweep
      _TrackerWarning.warn("MLflow's parent run of the study", e)
      return ""
    study.set_user_attr(PARENT_ATTR, parent)
    self.parent = parent
    return parent

  def trial_config(self, config, study_name: str):
    """The trial's config in the study's group (unless the command set train.tracker_group) and,
    for MLflow, under its parent run; unchanged without a tracker beside TensorBoard."""
    chosen = _tracked(config)
    if chosen:
      if not config.train.tracker_group:
        config.train.tracker_group = store.display_name(study_name)
      if "mlflow" in chosen and self.parent:
        config.mlflow.parent_run_id = self.parent
    return config

  def __call__(self, study, trial) -> None:
    """The ended trial's state on its tracker runs (record_trial)."""
    state = self.state
    ran = state.pop("ran", None)
    if state.get("handed_back") == trial.number or trial.user_attrs.get("sweep_surplus"):
      return  # back to the queue, or never a trial of the budget
    if trial.state.name not in ("COMPLETE", "PRUNED", "FAIL"):
      return
    if ran is not None and ran["trial"] == trial.number:
      config, directory = ran["config"], ran["directory"]
    else:  # failed before its config was built: a run of its own under the parent
      config = self.trial_config(self.plan.base_config.copy_and_resolve_references(),
                                 study.study_name)
      directory = ""  # no training run
    if not _tracked(config):
      return
    step = trial.user_attrs.get("sweep_pruned_step")
    if step is None and trial.state.name == "COMPLETE" and ran is not None:
      step = ran.get("step")  # its final step: the last evaluation may come before it
    if step is None and trial.intermediate_values:
      step = max(trial.intermediate_values)
    if step is None and ran is not None:
      step = ran.get("step")  # its final step (a run without evaluations reports none before)
    value = trial.value if trial.state.name == "COMPLETE" else (
        trial.intermediate_values.get(step) if step is not None else None)
    try:
      record_trial(config, directory, trial.number, trial.state.name, params=_params(trial),
                   value=value, step=step)
    except Exception as e:  # noqa: BLE001 - a tracker never fails the trial or the sweep
      _TrackerWarning.warn(f"recording {_trial_name(trial)} in its tracker", e)

  def end(self, study) -> None:
    """The parent run ended with the best trial, once per state of the study (a second worker
    that finds it ended with as many trials does nothing; a later sweep adding trials ends it
    again)."""
    if not self.parent:
      return
    count = len(study.get_trials(deepcopy=False))
    if study.user_attrs.get(ENDED_ATTR) == count:
      return
    best = {}
    try:
      trial = study.best_trial
      best = {"trial": trial.number, "directory": _trial_name(trial), "value": trial.value,
              "params": _params(trial)}
    except ValueError:  # no trial finished
      pass
    try:
      end_study(self.plan.base_config, self.parent, best=best)
    except Exception as e:  # noqa: BLE001 - a tracker never fails the sweep
      _TrackerWarning.warn("ending MLflow's parent run of the study", e)
      return
    study.set_user_attr(ENDED_ATTR, count)


# ------------------------------------------------------------------- the trackers' side


def record_trial(config, workdir: str, trial: int, state: str, params: dict | None = None,
                 value: float | None = None, step: int | None = None) -> None:
  """A trial's outcome (Optuna's state: COMPLETE, PRUNED, FAIL; its parameters; objective value;
  last reported step, the pruning step of a pruned trial) on the tracker run of its training
  workdir, in each tracker of `config` (the trial's config: its train.tracker_group, and for
  MLflow its mlflow.parent_run_id from start_study). Nothing where the workdir has no tracker run
  yet or no tracker is chosen; workdir "": the trial has no training run (it failed before one),
  so MLflow gets a child run of its own."""
  from transformer_jax.train import trackers
  run_id = trackers.read_run_id(workdir) if workdir else None
  chosen = trackers.with_runs(config)
  if "mlflow" in chosen and config.mlflow.parent_run_id:
    record_mlflow_trial(config, config.mlflow.parent_run_id, trial, state, params, value, step,
                        run_id=run_id or "")
  if "wandb" in chosen and run_id:
    record_wandb_trial(config, workdir, run_id, trial, state, params, value, step)


def start_study(config, study: str, storage: str = "", params: dict | None = None,
                display: str = "") -> str:
  """The parent run of the sweep `study` in `config`'s MLflow experiment, created if it does not
  exist (a resumed sweep finds its own); its id. storage: where the study lives (Optuna's
  storage URL), kept as a tag; params: the sweep's settings (its space, sampler, pruner);
  display: the study's name as the run and its study tag show it ("" = `study`)."""
  from transformer_jax.train.trackers import mlflow
  client, experiment_id = mlflow.open_store(config)
  run = mlflow.find_run(client, experiment_id, mlflow.STUDY_TAG + ".parent", study)
  if run is None:
    run = client.create_run(experiment_id, run_name=display or study, tags={
        mlflow.STUDY_TAG + ".parent": study, mlflow.STUDY_TAG: display or study,
        "study_storage": storage})
  else:
    client.update_run(run.info.run_id, status="RUNNING")
  mlflow.log_to(client, run, params)
  return run.info.run_id


def record_mlflow_trial(config, parent_run_id: str, trial: int, state: str,
                        params: dict | None = None, value: float | None = None,
                        step: int | None = None, run_id: str = "") -> str:
  """A trial of the study under `parent_run_id`: its state (Optuna's: RUNNING, COMPLETE, PRUNED,
  FAIL), its parameters, its objective value and its last reported step (the pruning step of
  a pruned trial). run_id: the trial's training run (WORKDIR/tracker.json's id); without one,
  or before its training run exists, a child run of its own is made for the trial.
  Returns the MLflow id of the run that holds the trial."""
  from transformer_jax.train.trackers import mlflow
  client, experiment_id = mlflow.open_store(config)
  key = f"{parent_run_id}/{trial}"
  run = ((mlflow.find_run(client, experiment_id, mlflow.RUN_ID_TAG, run_id) if run_id else None)
         or mlflow.find_run(client, experiment_id, "trial_key", key))
  if run is None:
    run = client.create_run(experiment_id, run_name=f"trial {trial}", tags={
        "mlflow.parentRunId": parent_run_id, "trial_key": key,
        **({mlflow.RUN_ID_TAG: run_id} if run_id else {})})
  tags = {"mlflow.parentRunId": parent_run_id, "trial": trial, "trial_key": key,
          "trial_state": state}
  if step is not None:
    tags["pruned_at_step" if state == "PRUNED" else "last_step"] = step
  mlflow.log_to(client, run, params, tags,
                [] if value is None else [mlflow.as_metric("trial/value", value, step or 0)])
  status = {"COMPLETE": "FINISHED", "PRUNED": "KILLED", "FAIL": "FAILED"}.get(state)
  if status:
    client.set_terminated(run.info.run_id, status)
  return run.info.run_id


def end_study(config, parent_run_id: str, best: dict | None = None,
              state: str = "FINISHED") -> None:
  """Ends the parent run: the best trial's number, value and parameters (as best/...)."""
  from mlflow.entities import RunTag

  from transformer_jax.train.trackers import mlflow
  client = mlflow.connect(mlflow.settings(config)[0])
  best = best or {}
  tags = [RunTag(f"best/{k}", json.dumps(v) if not isinstance(v, str) else v)
          for k, v in best.items()]
  metrics = ([mlflow.as_metric("best/value", best["value"], 0)]
             if isinstance(best.get("value"), (int, float)) else [])
  client.log_batch(parent_run_id, metrics=metrics, tags=tags[:mlflow.BATCH])
  client.set_terminated(parent_run_id, state)


def record_wandb_trial(config, workdir: str, run_id: str, trial: int, state: str,
                       params: dict | None = None, value: float | None = None,
                       step: int | None = None) -> None:
  """A sweep trial's outcome on its W&B run (resumed for it; in the group train.tracker_group):
  its state (Optuna's: COMPLETE, PRUNED, FAIL), parameters, objective value and last reported
  step (the pruning step of a pruned trial), in the run's summary and config."""
  import wandb

  from transformer_jax.train.trackers.wandb import WandbTracker
  tracker = WandbTracker(config, workdir)
  settings = {k: v for k, v in tracker.settings.items() if k != "name"}
  run = wandb.init(id=run_id, resume="allow", reinit="create_new",
                   settings=wandb.Settings(silent=True, console="off"), **settings)
  try:
    run.config.update({f"trial/{k}": v for k, v in (params or {}).items()},
                      allow_val_change=True)
    run.summary.update({"trial/number": trial, "trial/state": state,
                        **({"trial/value": value} if value is not None else {}),
                        **({"trial/pruned_at_step" if state == "PRUNED" else "trial/last_step":
                            step} if step is not None else {})})
  finally:
    run.finish(exit_code=1 if state == "FAIL" else 0)
