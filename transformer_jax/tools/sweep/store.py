"""Where a sweep's study lives: Optuna's journal file in the workdir (one machine), or a database
any SQLAlchemy URL names (many machines; PostgreSQL is the tested one).

Why a journal file and not SQLite for one machine (read in Optuna 5.0's source): N worker
processes pull waiting trials at once. RDBStorage claims a waiting trial with SELECT ... FOR
UPDATE, and SQLite has no row locks (the clause is dropped): two workers can both read a trial
as waiting and both run it. The journal file appends every operation under a file lock and
replays the log in order, so exactly one claim of a trial wins. The journal has no heartbeat,
though (only RDBStorage implements it): on one machine a dead worker is seen directly instead
(its pid is gone, see worker.reclaim_dead_local_trials). Many machines need a database server:
heartbeats mark a lost worker's trial failed after the grace period, and the retry callback
puts it back in the queue.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import threading
import time
from typing import NamedTuple, Optional

from transformer_jax.core import secrets, storage
from transformer_jax.core.errors import UserError

JOURNAL = "study.journal"  # the default storage, in the sweep's workdir
RECORD = "sweep.json"  # the workdir's note of its study: name and storage (password left out)
# How long a worker waits for a database that does not answer (env: tests shorten it).
WAIT_ENV = "TRANSFORMER_JAX_SWEEP_DB_WAIT_S"
WAIT_S = 60.0
# How long a worker rides out a database that stops answering mid-sweep (Options.outage_s's
# default: as long as a training run waits for its bucket, train.storage_outage_s).
OUTAGE_S = 300.0
STUDY_ATTR = "transformer_jax"  # the study's user attribute naming the sweep it belongs to


# The study's database URL where --sweep_storage is not given: a password kept off the command
# line (which `ps` shows every user, and trackers record). Or a URL without a password, with
# PostgreSQL's own PGPASSWORD or ~/.pgpass giving it.
STORAGE_ENV = "TRANSFORMER_JAX_SWEEP_STORAGE"


def given(flag: Optional[str]) -> Optional[str]:
  """The study's database URL: --sweep_storage, else STORAGE_ENV; None: the journal file."""
  return flag or os.environ.get(STORAGE_ENV) or None


def redact(url: str) -> str:
  """A storage URL without its password."""
  return secrets.redact(url)


def _host(url: str) -> str:
  match = re.search(r"@([^/?]+)", url) or re.search(r"//([^/?@]+)", url)
  return match.group(1) if match else url


class Storage(NamedTuple):
  storage: object  # an optuna storage
  url: str  # as shown: the URL without its password, or the journal file's path
  heartbeats: bool  # RDB storage: lost workers are noticed by their heartbeats
  local_file: Optional[str]  # the journal file (None: a database)


def open_storage(url: Optional[str], workdir: str, heartbeat_s: int, retries: int,
                 create: bool = True) -> Storage:
  """The study's storage: `url` (--sweep_storage), else the journal file in `workdir`.

  A database that does not answer is waited for (WAIT_S) and then one UserError naming what was
  waited for; a refused login is one at once. create=False: the journal file must exist."""
  import optuna
  from optuna.storages import RetryHeartbeatStaleTrialCallback
  if url is None:
    if storage.is_url(workdir):
      raise UserError(f"a sweep in a bucket ({workdir}) keeps its study in a database its workers "
                      "share: give --sweep_storage=postgresql+psycopg://USER@HOST/DB or that URL "
                      f"in {STORAGE_ENV}, its password in ~/.pgpass or PGPASSWORD (see "
                      "docs/cloud.md)")
    path = os.path.join(workdir, JOURNAL)
    if not create and not os.path.isfile(path):
      raise UserError(f"{workdir} holds no sweep (no {JOURNAL}); give the --workdir of a sweep, "
                      "or --sweep_storage where its study is kept")
    from optuna.storages.journal import JournalFileBackend, JournalFileOpenLock
    backend = JournalFileBackend(path, lock_obj=JournalFileOpenLock(path))
    return Storage(optuna.storages.JournalStorage(backend), path, False, path)
  if not re.match(r"^[a-z0-9+]+://", url):
    raise UserError(f"--sweep_storage must be a database URL, e.g. postgresql+psycopg://USER@"
                    f"HOST:5432/DB or sqlite:///sweep.db; got {redact(url)!r}")
  engine = {"pool_pre_ping": True}
  if url.startswith("postgresql"):
    engine["connect_args"] = {"connect_timeout": 5}
  wait = float(os.environ.get(WAIT_ENV, WAIT_S))
  deadline, error = time.time() + wait, None
  import sqlalchemy.exc
  while True:
    try:
      rdb = optuna.storages.RDBStorage(
          url, engine_kwargs=engine, heartbeat_interval=heartbeat_s, grace_period=3 * heartbeat_s,
          heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback(
              max_retry=retries, inherit_intermediate_values=True))
      return Storage(rdb, redact(url), True, None)
    except ImportError as e:  # a driver that is not installed
      fix = ("install the sweep extra: pip install 'transformer_jax[sweep]'"
             if url.startswith("postgresql") else "install that driver (the sweep extra has "
             "PostgreSQL's alone: psycopg, for postgresql+psycopg://)")
      raise UserError(f"--sweep_storage={redact(url)} needs a database driver that is not "
                      f"installed ({e}); {fix}") from None
    except sqlalchemy.exc.ArgumentError as e:
      raise UserError(f"--sweep_storage={redact(url)} is no database URL SQLAlchemy reads ({e})"
                      ) from None
    except (sqlalchemy.exc.OperationalError, sqlalchemy.exc.InterfaceError) as e:
      text = " ".join(str(e.orig if getattr(e, "orig", None) else e).split())
      text = text.split("(Background on this error")[0].strip()
      if re.search(r"password|authentication|role .* does not exist|database .* does not exist",
                   text):
        raise UserError(f"the database at {redact(url)} refused this worker: {text}; check the "
                        "user, password and database name in --sweep_storage") from None
      error = text
    except (sqlalchemy.exc.ProgrammingError, sqlalchemy.exc.IntegrityError) as e:
      text = " ".join(str(e.orig if getattr(e, "orig", None) else e).split())
      if not re.search(r"already exists|duplicate key", text):
        raise
      error = text  # another worker created Optuna's tables at the same moment: open again
    if time.time() >= deadline:
      raise UserError(f"no database answered at {_host(url)} within {wait:.0f} s (waited for "
                      f"{redact(url)}; last: {error}); start it or check --sweep_storage and the "
                      "network between this worker and the database")
    time.sleep(1.0)


def study_name(workdir: str) -> str:
  """A sweep's study is named by its workdir (the same --workdir on every worker)."""
  return storage.check(workdir).rstrip("/")


def display_name(study: str) -> str:
  """The study as the trackers show it (the W&B group, MLflow's parent run and study tag): the
  last folder of its workdir and 6 hex digits of the whole name, so that two sweeps in folders
  of one name stay apart, without a machine's absolute path in a shared project."""
  if "/" not in study:
    return study
  digest = hashlib.sha1(study.encode()).hexdigest()[:6]
  return f"{study.rstrip('/').rsplit('/', 1)[-1]}-{digest}"


def fingerprint(base_config, experiment, metric: str) -> dict:
  """What makes two sweeps the same one: the base config, the declared trials and space, the
  metric. Stored on the study; a worker of another sweep is refused. The config's sweep section
  is left out but for its metric: a sweep goes on with a larger budget or more seeds."""
  from transformer_jax.train import checkpoint
  space = {k: [repr(p.distribution), p.when] for k, p in (experiment.space or {}).items()}
  config = {k: v for k, v in checkpoint.config_json(base_config).items() if k != "sweep"}
  body = json.dumps({"config": config, "trials": experiment.trials,
                     "space": space, "metric": metric}, sort_keys=True, default=repr)
  return {"experiment": os.path.basename(experiment.path), "metric": metric,
          "split": base_config.data.eval_split,
          "sha256": hashlib.sha256(body.encode()).hexdigest()[:16]}


def write_record(workdir: str, name: str, shown_url: str) -> None:
  storage.write(storage.join(workdir, RECORD),
                json.dumps({"study": name, "storage": shown_url}, indent=2))


def read_record(workdir: str) -> Optional[dict]:
  try:
    return json.loads(storage.read_text(storage.join(workdir, RECORD)))
  except (OSError, ValueError):
    return None


def is_sweep_workdir(workdir: str) -> bool:
  try:
    return storage.exists(storage.join(workdir, RECORD))
  except (OSError, UserError):
    return False


# ------------------------------------------------------------------ a database that goes away


class DatabaseLost(BaseException):
  """The study's database did not answer within the outage bound. A BaseException, so that it
  passes the handlers of Optuna's optimize() (which would try to record the trial's failure in
  the database that is gone) and of the trial's objective; the worker turns it into one line."""


def _unreachable(error: BaseException) -> bool:
  """Whether `error` (or one it was raised from) says the database did not answer (a refused or
  cut connection), as opposed to an answer (a constraint, a finished trial)."""
  import sqlalchemy.exc
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    if isinstance(error, (sqlalchemy.exc.OperationalError, sqlalchemy.exc.InterfaceError,
                          sqlalchemy.exc.DisconnectionError)):
      return True
    if isinstance(error, sqlalchemy.exc.DBAPIError) and error.connection_invalidated:
      return True
    error = error.__cause__ or error.__context__
  return False


class Outage:
  """One worker's view of its database: every call waits out an outage of up to `seconds`,
  said in one line when it begins and one when it ends; past the bound every call (then and
  later) raises DatabaseLost. Shared by the worker's thread and the heartbeat thread."""

  FIRST_DELAY_S, MAX_DELAY_S = 0.25, 4.0

  def __init__(self, url: str, seconds: float):
    self.url, self.seconds = url, float(seconds)
    self.since: Optional[float] = None  # the current outage's first failure
    self.ended = float("-inf")  # when the last one ended
    self.lost = False  # past the bound: this worker stops
    self._lock = threading.Lock()

  def _began(self, error: BaseException) -> float:
    with self._lock:
      if self.since is None:
        self.since = time.time()
        while error.__cause__ is not None:  # Optuna's StorageInternalError says no more
          error = error.__cause__
        text = " ".join(str(getattr(error, "orig", None) or error).split())
        text = redact(text.split("(Background on this error")[0].strip())[:160]
        print(f"warning: the study's database at {_host(self.url)} is unreachable ({text}); "
              f"waiting up to {self.seconds:.0f} s", file=sys.stderr, flush=True)
      return self.since

  def _answered(self) -> None:
    with self._lock:
      if self.since is not None:
        print(f"the study's database is back after {time.time() - self.since:.0f} s; the "
              "sweep goes on", file=sys.stderr, flush=True)
        self.since, self.ended = None, time.time()

  def call(self, fn, *args, **kwargs):
    delay = self.FIRST_DELAY_S
    while True:
      if self.lost:
        raise DatabaseLost(self.url)
      try:
        result = fn(*args, **kwargs)
      except Exception as e:  # noqa: BLE001 - SQLAlchemy's and Optuna's types; sorted below
        if not _unreachable(e):
          raise
        if time.time() - self._began(e) > self.seconds:
          self.lost = True
          raise DatabaseLost(self.url) from None
        time.sleep(delay)
        delay = min(2 * delay, self.MAX_DELAY_S)
        continue
      self._answered()
      return result

  def heartbeat(self, fn, trial_id: int) -> None:
    """Optuna's heartbeat thread calls this every --sweep_heartbeat_s: a missed beat is said
    (an outage's first line, or one warning) and the thread goes on, never dies of it."""
    if self.lost:
      return
    try:
      fn(trial_id)
    except Exception as e:  # noqa: BLE001 - a heartbeat thread that raised would end silently
      if _unreachable(e):
        self._began(e)
      else:
        print(f"warning: a heartbeat of the sweep's trial failed ({type(e).__name__}: "
              f"{redact(' '.join(str(e).split()))[:160]}); the next one is tried",
              file=sys.stderr, flush=True)
      return
    self._answered()


def ride_out(rdb, url: str, seconds: float, grace_s: float):
  """`rdb` (an RDBStorage) as a storage whose every call waits out an outage (Outage); Optuna
  takes it as it is (optuna.storages.get_storage passes a BaseStorage through), with its
  heartbeats, as its own _CachedStorage would be. For `grace_s` (the heartbeats' grace period)
  after an outage no trial is judged stale: no worker's heartbeats reached the database, and
  the trials of the workers that rode it out are alive. Why by hand: Optuna retries nothing (a call
  that fails mid-trial ends optimize() with a traceback), and its storages have no hook."""
  import optuna
  from optuna.storages import BaseStorage
  from optuna.storages._cached_storage import _CachedStorage
  from optuna.storages._heartbeat import BaseHeartbeat
  inner, outage = _CachedStorage(rdb), Outage(url, seconds)

  def waiting(name):
    def method(self, *args, **kwargs):
      return outage.call(getattr(inner, name), *args, **kwargs)
    method.__name__ = name
    return method

  names = {n for base in (BaseStorage, BaseHeartbeat) for n in dir(base)
           if not n.startswith("__") and callable(getattr(base, n))}
  names.add("_get_stale_trial_ids")
  namespace = {n: waiting(n) for n in names}

  def set_trial_state_values(self, trial_id, state, values=None):
    tries = []

    def attempt():
      tries.append(1)
      try:
        return inner.set_trial_state_values(trial_id, state, values)
      except optuna.exceptions.UpdateFinishedTrialError:
        # A try that was cut after the database committed it: the trial ended as asked.
        if len(tries) > 1 and inner.get_trial(trial_id).state == state:
          return True
        raise
    return outage.call(attempt)

  namespace["set_trial_state_values"] = set_trial_state_values

  def in_grace() -> bool:
    return outage.since is not None or time.time() - outage.ended < grace_s

  def _get_stale_trial_ids(self, study_id):
    if in_grace():
      return []
    stale = outage.call(inner._get_stale_trial_ids, study_id)
    # A check that began before the database went away waited the outage out and was answered
    # the moment it came back, when every running trial's last heartbeat is as old as the
    # outage: the grace holds for it too (else it failed the trials of workers that rode the
    # outage out, which then ended in a traceback: "Cannot tell a FAIL trial").
    return [] if in_grace() else stale

  namespace["_get_stale_trial_ids"] = _get_stale_trial_ids
  namespace["record_heartbeat"] = lambda self, trial_id: outage.heartbeat(
      inner.record_heartbeat, trial_id)
  namespace["__getattr__"] = lambda self, name: getattr(inner, name)
  namespace["outage"] = outage
  return type("PatientStorage", (BaseStorage, BaseHeartbeat), namespace)()
