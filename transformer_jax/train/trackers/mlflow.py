"""MLflow: one MLflow run per workdir, found again by its tag `transformer_jax.run_id` (a sweep's
parent run and its trials' states: tools/sweep/tracking.py, with this module's helpers).

The tracking URI is mlflow.tracking_uri, else MLflow's own MLFLOW_TRACKING_URI, else MLflow's
default (a local store). A server, a file store (file:/path) and a SQLite database
(sqlite:///path.db) work alike; the last two need no network (README: "Experiment trackers").
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import urllib.parse

from transformer_jax.core import secrets
from transformer_jax.train.trackers import base

RUN_ID_TAG = "transformer_jax.run_id"
STUDY_TAG = "transformer_jax.study"
DEFAULT_EXPERIMENT = "transformer_jax"
# MLflow's own defaults retry a failed request 7 times over some 4 minutes, each waiting up to
# 120 s: a server that is down would hold the end of a run that long. Ours retries later
# instead (base.Background); a user's own setting of these variables wins.
_HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                  "MLFLOW_HTTP_REQUEST_TIMEOUT": "20"}
BATCH = 100  # params and tags per log_batch call (MLflow's limit); metrics go 1,000 at a time
_PARAM_CHARS = 6000  # MLflow's longest param value


def _not_own_retry(record) -> bool:
  """urllib3's warning at each retry of a request, from a tracker's thread: the tracker says
  once that it cannot reach its server (base.Background), not once per request."""
  return not threading.current_thread().name.startswith("tracker-")


def _credentials_apart(tracking_uri: str) -> str:
  """An http(s) tracking URI without its USER:PASSWORD@, which go to MLflow's own variables
  (MLFLOW_TRACKING_USERNAME, MLFLOW_TRACKING_PASSWORD) instead: MLflow prints a run's address,
  the tracking URI, to stdout (into logs) when the run ends."""
  parts = urllib.parse.urlsplit(tracking_uri)
  if parts.scheme not in ("http", "https") or parts.password is None:
    return tracking_uri
  os.environ["MLFLOW_TRACKING_USERNAME"] = urllib.parse.unquote(parts.username or "")
  os.environ["MLFLOW_TRACKING_PASSWORD"] = urllib.parse.unquote(parts.password)
  return urllib.parse.urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]))


def connect(tracking_uri: str):
  for name, value in _HTTP_DEFAULTS.items():
    os.environ.setdefault(name, value)
  tracking_uri = _credentials_apart(tracking_uri)
  retries = logging.getLogger("urllib3.connectionpool")
  if _not_own_retry not in retries.filters:
    retries.addFilter(_not_own_retry)
  from mlflow.tracking import MlflowClient
  return MlflowClient(tracking_uri=tracking_uri or None)


def _artifacts_beside(tracking_uri: str) -> str | None:
  """A SQLite store's artifact folder: `mlartifacts` beside the database (MLflow's default
  would be ./mlruns of whatever directory the run started in)."""
  if not tracking_uri.startswith("sqlite:///"):
    return None
  database = os.path.abspath(tracking_uri[len("sqlite:///"):])
  return os.path.join(os.path.dirname(database), "mlartifacts")


def _experiment_id(client, name: str, tracking_uri: str = "") -> str:
  """The id of the experiment `name`, created if it does not exist (by this call or another
  process's at the same time)."""
  found = client.get_experiment_by_name(name)
  if found is not None:
    return found.experiment_id
  try:
    return client.create_experiment(name, artifact_location=_artifacts_beside(tracking_uri))
  except Exception:  # another process created it first
    found = client.get_experiment_by_name(name)
    if found is None:
      raise
    return found.experiment_id


def find_run(client, experiment_id: str, tag: str, value: str):
  runs = client.search_runs([experiment_id], filter_string=f"tags.`{tag}` = '{value}'",
                            max_results=1, order_by=["attributes.start_time ASC"])
  return runs[0] if runs else None


def open_store(config) -> tuple:
  """(an MlflowClient of `config`'s tracking URI, the id of its experiment)."""
  tracking_uri, experiment = settings(config)
  client = connect(tracking_uri)
  return client, _experiment_id(client, experiment, tracking_uri)


def log_to(client, run, params: dict = None, tags: dict = None, metrics: list = ()) -> None:
  """The params `run` lacks (MLflow's are immutable), tags and metrics, in MLflow's batches."""
  from mlflow.entities import Param, RunTag
  params = [Param(k, str(v)[:_PARAM_CHARS]) for k, v in (params or {}).items()
            if k not in run.data.params]
  tags = [RunTag(k, str(v)) for k, v in (tags or {}).items()]
  for i in range(0, max(len(params), len(tags), len(metrics) and 1), BATCH):
    client.log_batch(run.info.run_id, metrics=[] if i else list(metrics),
                     params=params[i:i + BATCH], tags=tags[i:i + BATCH])


def settings(config) -> tuple[str, str]:
  """(tracking URI, experiment name) of `config`: its mlflow.* keys, else MLflow's own
  environment variables (MLFLOW_TRACKING_URI, MLFLOW_EXPERIMENT_NAME)."""
  m = config.mlflow
  return (m.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI", ""),
          m.experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME", "") or DEFAULT_EXPERIMENT)


def context_tags() -> dict:
  """The provenance of the run as MLflow's own context tags (what `mlflow.start_run` would add;
  `MlflowClient.create_run` adds none) and two of ours."""
  p = base.provenance()
  tags = {"mlflow.user": p["user"], "mlflow.source.name": p["program"],
          "mlflow.source.type": "LOCAL", "host": p["host"], "command": p["command"]}
  if p.get("git_commit"):
    tags.update({"mlflow.source.git.commit": p["git_commit"], "git_dirty": str(p["git_dirty"])})
  return tags


def as_metric(key, value, step, wall=None):
  """wall: when the value was logged (time.time()); None: now."""
  from mlflow.entities import Metric
  return Metric(key, float(value), int((time.time() if wall is None else wall) * 1000), int(step))


class MlflowTracker(base.Tracker):
  name = "mlflow"

  def __init__(self, config, workdir: str):
    self.config = config
    self.where = secrets.redact(settings(config)[0]) or "MLflow's default store"
    self.run_name = base.run_name(config, workdir, config.mlflow.run_name)
    self.tags = {tag: "" for tag in base.split_tags(config.train.tags)}
    if config.train.notes:
      self.tags["mlflow.note.content"] = config.train.notes  # the run's description
    if config.mlflow.parent_run_id:
      self.tags["mlflow.parentRunId"] = config.mlflow.parent_run_id
    if config.train.tracker_group:
      self.tags[STUDY_TAG] = config.train.tracker_group
    self.client = self.run_id = self.monitor = None

  def open(self, run_id: str, config: dict) -> dict:
    client, experiment_id = open_store(self.config)
    run = find_run(client, experiment_id, RUN_ID_TAG, run_id)
    tags = {RUN_ID_TAG: run_id, **self.tags, **context_tags()}
    resumed = run is not None
    if run is None:
      run = client.create_run(experiment_id, run_name=self.run_name, tags=tags)
      shown = {}
    else:  # resumed: the steps it shows, which this run does not send again
      client.update_run(run.info.run_id, status="RUNNING")
      shown = self._last_steps(client, run)
    self.client, self.run_id = client, run.info.run_id
    # Params are immutable in MLflow: a resumed run with a changed config (which training
    # allows for some keys) keeps the first values and names the changed keys in a tag.
    known = run.data.params
    changed = sorted(k for k, v in config.items() if k in known
                     and known[k] != str(v)[:_PARAM_CHARS])
    if changed:
      tags["config_changed_on_resume"] = ", ".join(changed)[:5000]
    log_to(client, run, config, tags)
    if self.config.mlflow.system_metrics and self.monitor is None:
      self._start_monitor(resumed)
    return shown

  def _start_monitor(self, resumed: bool) -> None:
    """MLflow's SystemMetricsMonitor on this run (system/... metrics, steps after a resumed
    run's); a monitor that cannot start (no psutil) costs one warning, never the run."""
    try:
      from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor
      self.monitor = SystemMetricsMonitor(
          self.run_id, sampling_interval=self.config.mlflow.system_metrics_every_s,
          resume_logging=resumed,
          tracking_uri=_credentials_apart(settings(self.config)[0]) or None)
    except Exception as e:  # noqa: BLE001 - system metrics are never worth a run
      print(f"warning: MLflow's system metrics could not start ({type(e).__name__}: "
            f"{' '.join(str(e).split())[:200]}); the run goes on without them",
            file=sys.stderr, flush=True)
      return
    self.monitor.start()

  @staticmethod
  def _last_steps(client, run) -> dict:
    """{split: last step} of the records the run shows: the history of SPLIT/time, which
    every record of metrics.jsonl has."""
    splits = {key.split("/")[0] for key in run.data.metrics if key.endswith("/time")}
    return {split: max((m.step for m in client.get_metric_history(run.info.run_id,
                                                                   f"{split}/time")), default=-1)
            for split in splits}

  def write(self, records: list) -> None:
    metrics = [as_metric(k, v, r["step"], r.get("time")) for r in records
               for k, v in base.scalars(r).items()]
    for i in range(0, len(metrics), base.MAX_VALUES):
      self.client.log_batch(self.run_id, metrics=metrics[i:i + base.MAX_VALUES])
    for r in records:
      if rows := base.sample_rows(r):
        columns = dict(zip(base.SAMPLE_COLUMNS, map(list, zip(*rows))))
        self.client.log_table(self.run_id, columns,
                              f"{r['split']}/samples/step_{r['step']:09d}.json")

  def summary(self, values: dict) -> None:
    step = int(values.get("step", 0))
    self.client.log_batch(self.run_id, metrics=[as_metric(f"summary/{k}", v, step)
                                                for k, v in base.numbers(values).items()])

  def images(self, paths: dict, step: int) -> None:
    for path in paths.values():
      self.client.log_artifact(self.run_id, path, "plots")

  def files(self, paths: dict) -> None:
    for name, path in paths.items():
      self.client.log_artifact(self.run_id, path, os.path.dirname(name) or None)

  def checkpoints(self, steps: list, directory: str) -> None:
    """Tags, and checkpoints.json: {"directory", "steps": {step: its URI}} (MLflow keeps no
    references to files it does not store)."""
    from mlflow.entities import RunTag
    self.client.log_batch(self.run_id, tags=[
        RunTag("checkpoint_steps", ",".join(map(str, steps))), RunTag("checkpoints", directory)])
    self.client.log_dict(self.run_id, {"directory": directory,
                                       "steps": base.checkpoint_uris(steps, directory)},
                         "checkpoints.json")

  def close(self, state: str) -> None:
    if self.monitor is not None:  # its last samples too, however short the run
      self.monitor.finish()
      self.monitor.publish_metrics(self.monitor.aggregate_metrics())
      self.monitor.mlflow_logger.flush()
      self.monitor = None
    if self.client is not None:
      self.client.set_terminated(self.run_id, {"finished": "FINISHED", "stopped": "KILLED"}.get(
          state, "FAILED"))
