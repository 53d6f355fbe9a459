"""Where a run is logged besides metrics.jsonl, chosen by train.trackers: TensorBoard, W&B and
MLflow, each a `base.Writer` as metrics.jsonl's is (train/logger.py hands each record to each).
W&B and MLflow keep a run of their own, driven off the training thread (base.Background); each
package is imported only when asked for, so the core install needs neither.

One run, whatever happens to it: the tracker run's id is WORKDIR/tracker.json's, written once by
the workdir's first training; a resumed run (after a stop, a kill, a raised train.steps)
continues it, sending first what its run lacks of metrics.jsonl, as does the same command on a
finished workdir (logger.sync_trackers). In a job of several processes process 0 alone logs,
under the id it read or chose and sent to the others.
"""

from __future__ import annotations

import importlib.util
import json
import uuid

from transformer_jax import config as config_lib
from transformer_jax.core import lease, storage
from transformer_jax.core.errors import UserError
from transformer_jax.train.trackers.base import Background, Tracker, Writer  # noqa: F401

ID_FILE = "tracker.json"
# The trackers that keep a run of their own (a run id, resumed, synced), each its module here
# and its pip extra: its class, and what its calls import, imported on the calling thread before
# any tracker thread starts (two threads importing MLflow and W&B at once lost an MLflow run to
# Python 3.11's "AST constructor recursion depth mismatch", an import race in a dependency).
RUNS = {"wandb": ("WandbTracker", ("wandb",)),
        "mlflow": ("MlflowTracker", ("mlflow.tracking", "mlflow.entities"))}


def check(config) -> list:
  """The trackers `config` asks for, each installed; else one UserError naming the pip extra."""
  chosen = config_lib.tracker_names(config)
  for name in (name for name in chosen if name in RUNS):
    try:
      missing = importlib.util.find_spec(name) is None
    except ValueError:  # in sys.modules as None: an import of it fails
      missing = True
    if missing:
      raise UserError(f"train.trackers asks for {name}, which is not installed: pip install "
                      f"'transformer_jax[{name}]' (or leave {name} out of train.trackers)")
  if "mlflow" in chosen:
    _check_tracking_uri(config)
  return chosen


# The schemes of MLflow's tracking stores (its docs: "Where Runs Are Recorded"): a server, a
# Databricks workspace, a folder, or a database through SQLAlchemy.
TRACKING_SCHEMES = ("http", "https", "file", "databricks", "databricks-uc", "uc", "sqlite",
                    "postgresql", "mysql", "mssql")


def _check_tracking_uri(config) -> None:
  """A tracking URI MLflow cannot use (a typo such as htp:/host) is one line now, not an
  'unreachable' tracker retried for the whole run."""
  from transformer_jax.core import secrets
  from transformer_jax.train.trackers.mlflow import settings
  uri = settings(config)[0]
  scheme = uri.split(":", 1)[0].split("+", 1)[0].lower() if ":" in uri else ""
  if scheme and len(scheme) > 1 and scheme not in TRACKING_SCHEMES:
    where = "mlflow.tracking_uri" if config.mlflow.tracking_uri else "MLFLOW_TRACKING_URI"
    raise UserError(f"{where} {secrets.redact(uri)!r} is no tracking URI MLflow knows (its "
                    f"scheme {scheme!r} is none of {', '.join(TRACKING_SCHEMES)}); fix it, or "
                    "leave it empty for MLflow's local store")


def with_runs(config) -> list:
  """The trackers of train.trackers that keep a run of their own (check()ed)."""
  return [name for name in check(config) if name in RUNS]


def read_run_id(workdir: str) -> str | None:
  """The tracker run id of WORKDIR/tracker.json; None before the workdir's first training."""
  path = storage.join(workdir, ID_FILE)
  try:
    return json.loads(storage.read_text(path))["run_id"]
  except FileNotFoundError:
    return None
  except (ValueError, KeyError, TypeError) as e:
    raise UserError(f"{path} is damaged ({e}); it holds the tracker run's id: restore it, or "
                    "delete it to log this workdir under a new tracker run") from None


def claim_run_id(workdir: str) -> str:
  """WORKDIR/tracker.json's id, chosen and written now if the workdir has none. Written once:
  of two processes creating it at once one wins, and both read the winner's."""
  found = read_run_id(workdir)
  if found:
    return found
  lease.create(storage.join(workdir, ID_FILE),
                 json.dumps({"run_id": uuid.uuid4().hex[:16]}) + "\n")
  return read_run_id(workdir)


def shared_run_id(workdir: str) -> str:
  """claim_run_id's id on process 0, sent to every process of the job (all must call this)."""
  import jax

  from transformer_jax.core import multihost
  return multihost.broadcast(claim_run_id(workdir) if jax.process_index() == 0 else "",
                             "a tracker's run id", size=64)


def flat_config(config) -> dict:
  """The full config as {dotted key: value}, lists and tuples as JSON."""
  from transformer_jax.core.trees import flatten
  return {k: json.dumps(list(v)) if isinstance(v, (list, tuple)) else v
          for k, v in flatten(config.to_dict()).items()}


def open_writers(config, workdir: str, run_id: str | None, backlog: list = (),
                 tensorboard: bool = True) -> list:
  """A writer for each tracker of train.trackers: TensorBoard's (unless `tensorboard` is
  False), and a started Background for each tracker that keeps a run (its run `run_id`; none
  without one). backlog: the records of the steps before this run (Background)."""
  names = check(config)
  writers = []
  if tensorboard and "tensorboard" in names:
    from transformer_jax.train.trackers.tensorboard import TensorBoard
    writers.append(TensorBoard(workdir))
  if not run_id:
    return writers
  names = [name for name in names if name in RUNS]
  for name in names:
    for module in RUNS[name][1]:
      importlib.import_module(module)
  return writers + [Background(
      getattr(importlib.import_module(f"{__name__}.{name}"), RUNS[name][0])(config, workdir),
      run_id, flat_config(config), retry_s=config.train.tracker_retry_s, backlog=backlog,
      interval_s=config.train.tracker_interval_s) for name in names]
