"""Orbax checkpoints in WORKDIR/checkpoints: async saves, keep-last-N and keep-best-by-metric,
a verified resume that falls back past unreadable checkpoints, and preemption (SIGTERM/SIGINT).

Each checkpoint STEP holds two items, committed together (orbax writes STEP.orbax-checkpoint-tmp
and renames it when both are complete):
  state  the TrainState (parameters, optimizer state, step)
  meta   JSON: the step, the data-iterator position and RNG, the full config, the tokenizer's
         sha256, and a checksum of every state array, which catches truncated or altered files.

The train stream is random access by step and dropout draws fold the step into PRNGKey(seed), so
(step, seed) is the whole data-iterator and RNG state; `meta` records it explicitly and a resume
checks it.
"""

from __future__ import annotations

import contextlib
import gc
import glob
import hashlib
import json
import logging
import os
import re
import signal
import sys
import threading
import time
import warnings
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from transformer_jax.core import files, lease, lock, metric_names, outage, signals, storage, trees
from transformer_jax.core.errors import UserError
from transformer_jax.train import sharding

FORMAT = 1
COMMIT_FILE = "commit_success.txt"  # orbax's mark of a finished step in a bucket
UNREADABLE = "checkpoints_unreadable"  # where train moves checkpoints that do not read back
# Model keys that may change on resume: they change neither the parameter shapes nor what the
# parameters compute. Every other model key, and switching gradient clipping on or off (it adds
# optimizer state), makes a checkpoint incompatible.
RESUMABLE_MODEL_KEYS = ("dropout_rate", "attention_dropout_rate", "attention_impl", "dtype", "init",
                        "remat", "dropout_rng")

# ----------------------------------------------------------------------------- the workdir


# What training writes in the workdir, and whether each is a directory: a path of the wrong kind
# (a file named `checkpoints`, say) is refused before anything is written.
WORKDIR_ENTRIES = {"checkpoints": True, UNREADABLE: True, "tensorboard": True, "eval": True,
                   "tokenizer.model": False, "config.json": False, "metrics.jsonl": False,
                   "summary.md": False, lock.FILENAME: False, "tracker.json": False}


def check_workdir(workdir: str, entries: dict = WORKDIR_ENTRIES) -> str:
  """The absolute workdir if training can write there; creates nothing. Raises UserError.

  entries: {name: is a directory} of what will be written inside it.
  """
  if not workdir.strip():
    raise UserError("--workdir is empty (an unset shell variable?); give a directory")
  workdir = storage.check(workdir)  # a URL stays one (never a local folder named `gs:`)
  if storage.is_url(workdir):  # an object store has no file kinds or modes to check
    if workdir.startswith("s3://"):
      _teach_orbax_s3(workdir)  # refused here if this orbax cannot learn s3://
    storage.check_bucket(workdir)
    return workdir
  if os.path.exists(workdir):
    if not os.path.isdir(workdir):
      raise UserError(f"--workdir {workdir} is a file; give a directory")
    if not os.access(workdir, os.W_OK | os.X_OK):
      raise UserError(f"--workdir {workdir} is not writable; choose another or fix its "
                      "permissions")
    for name, is_dir in entries.items():
      path = os.path.join(workdir, name)
      if os.path.lexists(path) and os.path.isdir(path) != is_dir:
        kind = "a file" if is_dir else "a directory"
        raise UserError(f"{path} is {kind}, where this program keeps its "
                        f"{'directory' if is_dir else 'file'} {name}; move it away or use "
                        "another --workdir")
      if os.path.isdir(path) and not os.access(path, os.W_OK | os.X_OK):
        raise UserError(f"{path} is not writable; fix its permissions or use another --workdir")
    return workdir
  parent = os.path.dirname(workdir)
  while not os.path.exists(parent):
    parent = os.path.dirname(parent)
  if not os.path.isdir(parent):
    raise UserError(f"cannot create --workdir {workdir}: {parent} is a file; choose another")
  if not os.access(parent, os.W_OK | os.X_OK):
    raise UserError(f"cannot create --workdir {workdir}: {parent} is not writable; choose "
                    "another or fix its permissions")
  return workdir


def create_workdir(workdir: str) -> None:
  storage.makedirs(workdir)


def saved_steps(workdir: str) -> list:
  """The steps of the finished checkpoints in WORKDIR/checkpoints (no orbax needed). In a bucket
  a step is finished once orbax wrote its commit_success.txt."""
  directory = storage.join(workdir, "checkpoints")
  steps = [n for n in storage.listdir(directory) if n.isdigit()]
  if storage.is_url(directory):
    steps = [n for n in steps if storage.exists(storage.join(directory, n, COMMIT_FILE))]
  return sorted(int(n) for n in steps)


def claim_workdir(workdir: str, seen_steps: list) -> lock.DirectoryLock:
  """Makes this run the one writer of the (existing) `workdir`; returns the lock to release.

  Process 0 takes the lock for every process of a job, and tells them whether it got it. Refused
  (UserError, on every process) when another run holds the lock, or when the checkpoints are no
  longer `seen_steps`, those this run read before: another run saved one in the meantime.
  """
  held = lease.lock(workdir)  # flock locally, a lease in a bucket
  refusal = None
  if jax.process_index() == 0:
    try:
      held.acquire()
      if saved_steps(workdir) != seen_steps:
        held.release()
        refusal = (f"another run saved checkpoints in --workdir {workdir} while this one was "
                   f"starting (steps {seen_steps} -> {saved_steps(workdir)}); run the same "
                   "command again to continue from the newest")
    except UserError as e:
      refusal = str(e)
  if jax.process_count() > 1:
    if multihost_utils.broadcast_one_to_all(np.int32(refusal is not None)) and refusal is None:
      refusal = f"process 0 of this job could not take --workdir {workdir} (see its error)"
  if refusal:
    raise UserError(refusal)
  return held


def sha256(data: bytes) -> str:
  return hashlib.sha256(data).hexdigest()


# ----------------------------------------------------------------------------- what is checked


@jax.jit
def checksums(tree) -> list:
  """One uint32 per array: the wrapping sum of its bits, so any changed bit changes it."""
  def bits(x):
    if x.dtype == jnp.bool_:
      return x.astype(jnp.uint32)
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
    return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)
  return [jnp.sum(bits(x), dtype=jnp.uint32) for x in jax.tree.leaves(tree)]


def config_json(config) -> dict:
  return json.loads(config.to_json_best_effort())


def compare_configs(saved: dict, config) -> tuple[list, list]:
  """(incompatible, changed): `key old -> new` for keys of both configs whose values differ."""
  old, new = trees.flatten(saved), trees.flatten(config_json(config))
  incompatible, changed = [], []
  for key in sorted(old.keys() & new.keys()):
    a, b = old[key], new[key]
    if key == "train.grad_clip_norm" and (a > 0) != (b > 0):
      incompatible.append(f"{key} {a} -> {b} (clipping on/off changes the optimizer state)")
    elif a != b:
      fixed = key.startswith("model.") and key.split(".", 1)[1] not in RESUMABLE_MODEL_KEYS
      (incompatible if fixed else changed).append(f"{key} {a} -> {b}")
  return incompatible, changed


# Keys besides the model's that make a config another experiment than a workdir's.
DATA_KEYS = ("data.source", "data.scan_split", "data.tfds_name", "data.path", "data.source_lang",
             "data.target_lang")


def check_config_file(workdir: str, data_keys: tuple = DATA_KEYS) -> None:
  """The one rule for a workdir's config: its checkpoints are the truth (each records the full
  config it was trained with); WORKDIR/config.json is their copy for reading and for leaving
  --config out. A config.json that no longer fits the newest readable checkpoint (edited by
  hand) is refused by name, in every mode that reads the workdir, before anything is written.

  data_keys: keys besides the model's that make the data another than the checkpoint's.
  """
  path = storage.join(workdir, "config.json")
  if not saved_steps(workdir) or not storage.isfile(path):
    return
  try:
    edited = json.loads(storage.read_text(path))
  except (OSError, ValueError):
    return  # a damaged config.json: --config left out says so when it loads it
  manager = Manager(workdir, None)
  try:
    for step in reversed(manager.all_steps()):
      try:
        recorded = manager._read_meta(step)["config"]
        break
      except _Unreadable:
        continue
    else:
      return  # no readable checkpoint: restoring one says so
  finally:
    manager.close()
  old, new = trees.flatten(recorded), trees.flatten(edited)
  differ = [f"{key} {old[key]} -> {new[key]}" for key in sorted(old.keys() & new.keys())
            if old[key] != new[key] and ((key.startswith("model.") and key.split(".", 1)[1]
                                          not in RESUMABLE_MODEL_KEYS) or key in data_keys)]
  if differ:
    shown = ", ".join(differ[:4]) + (f" and {len(differ) - 4} more" if len(differ) > 4 else "")
    raise UserError(f"{path} no longer matches checkpoint step {step}, which records the config "
                    f"it was trained with ({shown}); the checkpoint is the truth: undo the edit "
                    "of config.json (change values with --config.key=value instead) or start a "
                    "new --workdir")


# ----------------------------------------------------------------------------- the manager


class Restored(NamedTuple):
  step: int
  state: Any
  meta: dict
  changed: list  # "key old -> new" for config values that differ from the checkpoint's


class _Unreadable(Exception):
  pass


class _Unanswered(Exception):
  """A checkpoint write cut by a store that does not answer (Manager rides it out)."""


# TensorStore's own retries of a bucket's requests (it writes the arrays), backing off from 1 s
# to at most 16 s between tries: as many tries as cover the run's outage budget
# (train.storage_outage_s), so that a write cut by an outage inside the bound waits inside
# TensorStore instead of failing after its default tries (a 200 s outage inside a checkpoint
# write ended a run whose bound was 300 s: "All 5 retry attempts failed"). Never fewer than
# _MIN_TRIES (about 3 s, a blip's worth, as gcsfs and s3fs are given: storage.RETRIES), and not
# many more than the bound, so that past it the run stops about when its other writes do.
_FIRST_DELAY_S, _MAX_DELAY_S, _MIN_TRIES = 1, 16, 2


def tensorstore_retries(outage_s: float) -> dict:
  """TensorStore's retry settings (its gcs_request_retries / s3_request_retries context) whose
  backoff adds up to at least `outage_s` seconds. TensorStore waits once after each of its
  max_retries failed tries (1 s, 2 s, 4 s, ... at most 16 s, each plus up to 1 s of jitter)."""
  tries, waited, delay = 0, 0.0, _FIRST_DELAY_S
  while tries < _MIN_TRIES or waited < outage_s:
    waited += delay
    delay = min(2 * delay, _MAX_DELAY_S)
    tries += 1
  return {"max_retries": tries, "initial_delay": f"{_FIRST_DELAY_S}s",
          "max_delay": f"{_MAX_DELAY_S}s"}


def _bound_tensorstore_retries(outage_s: float) -> None:
  """Puts tensorstore_retries(outage_s) into the TensorStore context orbax builds for every
  array it writes (a private table of orbax 0.11 to 0.12; another orbax keeps TensorStore's
  defaults: 32 tries of up to 32 s each, which cover 300 s as well)."""
  try:
    from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils
    for context in (ts_utils._BASE_TS_CONTEXT, ts_utils._DEFAULT_OCDBT_TS_CONTEXT):
      for resource in ("gcs_request_retries", "s3_request_retries"):
        context[resource] = tensorstore_retries(outage_s)
  except (ImportError, AttributeError):
    pass


def _release_cut_save() -> None:
  """Ends the threads of a save cut short that still wait for a signal of it (the creation of
  its directory, which failed): orbax would keep them, and the process at its end, for its
  coordination timeout (5 minutes), then log a TimeoutError each. They are marked cancelled
  and woken, so that each returns without running its part of the save. Private parts of orbax
  (0.11 to 0.12): where they differ, the threads time out as before. Then the save's abandoned
  coroutines, which complain when collected, are collected: now, not at some later step."""
  # Their coroutines, never started, would each say so when the interpreter ends.
  warnings.filterwarnings("ignore", message="coroutine .* was never awaited",
                          category=RuntimeWarning)
  try:
    from orbax.checkpoint._src.futures import future as ocp_future
    for thread in threading.enumerate():
      if isinstance(thread, ocp_future._SignalingThread) and thread.is_alive():
        thread._cancelled = True
        ocp_future.set_signals(thread._receive_signals, operation_id=thread._operation_id)
  except Exception:  # noqa: BLE001  another orbax: its own timeout ends them
    pass
  gc.collect()


def _user_error_in(e: BaseException) -> Optional[UserError]:
  """The UserError `e` was raised from (or during), if any: one of ours, raised inside orbax's
  save (a request past train.storage_outage_s), which orbax may have wrapped."""
  seen = set()
  while e is not None and id(e) not in seen:
    if isinstance(e, UserError):
      return e
    seen.add(id(e))
    e = e.__cause__ or e.__context__
  return None


def _write_errno(e: BaseException):
  """The errno of a failed write, found in an OSError or in the text of the error that orbax and
  tensorstore raise for it (`... No space left on device [os_error_code='28']`); else None."""
  if isinstance(e, OSError) and e.errno in files.WRITE_ERRNOS:
    return e.errno
  for match in re.finditer(r"os_error_code='?(\d+)|\[Errno (\d+)\]", str(e)):
    code = int(match.group(1) or match.group(2))
    if code in files.WRITE_ERRNOS:
      return code
  return None


class _WriteFailureFilter(logging.Filter):
  """Drops the error logs (with tracebacks) of orbax's background save threads and of asyncio's
  abandoned tasks for a write that failed (disk full, read-only): `Manager` raises that failure
  as one UserError in the main thread, and nothing else needs saying."""

  bucket_saves = False  # a writable Manager of a bucket exists: it reports every failed save

  def filter(self, record: logging.LogRecord) -> bool:
    exception = record.exc_info[1] if record.exc_info else None
    if self.bucket_saves and record.levelno >= logging.ERROR and (
        "orbax" in record.pathname or _abandoned_write(record, exception)):
      return False  # a save the store refused or cut: Manager raises it in one line
    if outage.armed() and (outage.unreachable(Exception(record.getMessage()))
                           or exception is not None and outage.unreachable(exception)
                           or record.getMessage().startswith("Waiting for previous save")):
      return False  # a save cut, or held up, by a store that does not answer: ridden out
    return _write_errno(Exception(f"{record.getMessage()} {exception}")) is None


_FILTER = _WriteFailureFilter()


def _abandoned_write(record: logging.LogRecord, exception) -> bool:
  """asyncio's "Future (or Task) exception was never retrieved" for a write of a save that
  failed: a tensorstore write, or an aiohttp request the store cut ("Cannot write to closing
  transport"). Logged whenever the future is collected, also after the run has disarmed its
  outage handling, so that without this a refused or cut save printed one line or several, by
  chance."""
  if record.name != "asyncio" or "never retrieved" not in record.getMessage():
    return False
  return ("tensorstore_spec" in f"{record.getMessage()} {exception}"
          or exception is not None and outage.unreachable(exception))


def _drop_write_failure_noise(previous):
  """An unraisable-exception hook that drops what a failed checkpoint write leaves behind: its
  errors, and tensorstore writes still in flight that finish into the closed event loop of the
  save they belonged to. Everything else goes to `previous`."""
  def hook(unraisable):
    value = unraisable.exc_value
    if (_write_errno(Exception(str(value))) is None
        and not (outage.armed() and value is not None and outage.unreachable(value))
        and not (isinstance(value, RuntimeError) and str(value) == "Event loop is closed")):
      previous(unraisable)
  hook.drops_write_failure_noise = True
  return hook


@contextlib.contextmanager
def _quiet():
  """Silences what orbax, tensorstore and asyncio print while a damaged checkpoint fails to read
  (tracebacks of abandoned coroutines, error logs): the failure is reported once, by us."""
  loggers = [logging.getLogger(name) for name in ("absl", "asyncio")]
  levels = [lg.level for lg in loggers]
  hook = sys.unraisablehook
  for lg in loggers:
    lg.setLevel(logging.CRITICAL)
  sys.unraisablehook = lambda _: None
  try:
    yield
  except BaseException:
    # A failed read's abandoned coroutines complain when collected: here, not at some later
    # step. (Only then: a collection of a large process's heap costs a second or more.)
    gc.collect()
    raise
  finally:
    for lg, level in zip(loggers, levels):
      lg.setLevel(level)
    sys.unraisablehook = hook


def _excerpt(text: str, limit: int = 200) -> str:
  """`text` on one line, without TensorStore's annotations (`[source locations='...']`,
  `[tensorstore_spec='{...}']`, which repeat the paths), and at most `limit` characters, cut
  between words with `...` (a line cut mid-path reads as a wrong path)."""
  text = " ".join(re.sub(r"\s*\[[a-z_ ]+='(?:[^'\\]|\\.)*'\]", "", str(text)).split())
  if len(text) <= limit:
    return text
  return text[:limit].rsplit(" ", 1)[0].rstrip(",;:") + " ..."


def _reason(e: Exception) -> str:
  text = " ".join(str(e).split())
  return f"{type(e).__name__}: {text[:160]}{'...' if len(text) > 160 else ''}"


def _restore_target(target):
  """ShapeDtypeStructs to restore into: the target's sharding (orbax reshards a checkpoint
  written on any mesh into it), or replicated over all devices."""
  replicated = NamedSharding(sharding.make_mesh(), P())
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=getattr(x, "sharding", None) or replicated), target)


def _s3_kvstore(url: str) -> dict:
  """TensorStore's spec of the s3:// prefix `url`, with the endpoint, region and credentials
  that botocore (s3fs) reads from the environment, so that both reach the same store."""
  bucket, _, key = url[len("s3://"):].partition("/")
  spec = {"driver": "s3", "bucket": bucket, "path": key}
  endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
  if endpoint:
    spec["endpoint"] = endpoint
  region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
  if region:
    spec["aws_region"] = region
  if os.environ.get("AWS_ACCESS_KEY_ID"):  # else the default chain (profile, instance role)
    spec["aws_credentials"] = {"type": "environment"}
  return spec


_S3_TAUGHT = []


def _teach_orbax_s3(workdir: str) -> None:
  """Lets orbax hand s3:// checkpoint paths to TensorStore's s3 driver.

  orbax 0.12 builds TensorStore specs from path strings: `_normalize_path` runs os.path.normpath
  (which turns `s3://b` into `s3:/b`; it restores `gs://` alone) and only gs:// paths get a
  bucket driver, everything else the local file driver. Its directory work (listing, commit
  files, deleting old steps) goes through etils.epath, which already reads s3:// with s3fs. So
  three functions learn s3://, each falling through to orbax's own for every other path. An
  orbax without them cannot be taught: the one-line refusal of before.
  """
  if _S3_TAUGHT:
    return
  try:
    from orbax.checkpoint._src.path import gcs_utils
    from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils
    normalize, use_bucket_driver = ts_utils._normalize_path, ts_utils._use_gcs_driver
    bucket_kvstore = gcs_utils.get_kvstore_for_gcs
    ocp.options.AtomicityOptions  # noqa: B018 (checked here, used by Manager)
  except (ImportError, AttributeError):
    raise UserError(f"--workdir {workdir}: this orbax version ({ocp.__version__}) cannot write "
                    "checkpoints to s3://; use a gs:// bucket or a local or shared directory"
                    ) from None

  def _normalize_path(path: str) -> str:
    path = str(path)
    if path.startswith("s3://"):
      return "s3://" + os.path.normpath(path[len("s3://"):])
    return normalize(path)

  def _use_gcs_driver(directory: str) -> bool:
    return str(directory).startswith("s3://") or use_bucket_driver(directory)

  def get_kvstore_for_gcs(path: str) -> dict:
    return _s3_kvstore(str(path)) if str(path).startswith("s3://") else bucket_kvstore(path)

  ts_utils._normalize_path = _normalize_path
  ts_utils._use_gcs_driver = _use_gcs_driver
  gcs_utils.get_kvstore_for_gcs = get_kvstore_for_gcs
  _S3_TAUGHT.append(True)


class Manager:
  """Saves and restores the train state in WORKDIR/checkpoints; wraps ocp.CheckpointManager.

  Read-only unless `writable` (evaluation reads while a training run may be writing).
  `tokenizer_sha`: the sha256 of the tokenizer this run uses; a checkpoint written with another
  vocabulary is refused.
  """

  def __init__(self, workdir: str, config, tokenizer_sha: Optional[str] = None,
               writable: bool = False):
    self.workdir = storage.check(workdir)  # orbax needs an absolute path; a URL stays one
    atomicity = {}
    if self.workdir.startswith("s3://"):
      _teach_orbax_s3(self.workdir)
      # As orbax does by itself for gs://: each step written in place and committed by a
      # commit_success.txt written last (S3 has no rename: orbax's default would copy the whole
      # temporary directory, and a copy cut short would look finished).
      atomicity = {"atomicity_options": ocp.options.AtomicityOptions(
          mode=ocp.options.AtomicityMode.COMMIT_FILE)}
    self.directory = storage.join(self.workdir, "checkpoints")
    self.config = config
    self.tokenizer_sha = tokenizer_sha
    self.unreadable = []  # steps found unreadable by latest_good()
    self._last = self._unsaved = None  # the newest save asked for; one not written (an outage)
    self._started = None  # the step of the newest save orbax began
    self._cut: set = set()  # steps whose save an outage cut: their leftovers go
    self._any_cut = False  # whether a save of this run was cut (close() waits out its writes)
    if writable:
      if storage.is_url(self.workdir):
        _bound_tensorstore_retries(config.train.storage_outage_s)
        _FILTER.bucket_saves = True
      for name in ("absl", "asyncio"):
        logging.getLogger(name).addFilter(_FILTER)
      if not getattr(sys.unraisablehook, "drops_write_failure_noise", False):
        sys.unraisablehook = _drop_write_failure_noise(sys.unraisablehook)
      t = config.train
      policies = [ocp.checkpoint_managers.LatestN(n=t.keep_checkpoints)]
      if t.keep_best:
        lower_is_better = metric_names.lower_is_better(t.best_metric)
        worst = float("inf") if lower_is_better else float("-inf")
        policies.append(ocp.checkpoint_managers.BestN(
            get_metric_fn=lambda metrics: metrics.get(t.best_metric, worst),
            reverse=lower_is_better, n=t.keep_best, keep_checkpoints_without_metrics=False))
      options = ocp.CheckpointManagerOptions(
          create=True, cleanup_tmp_directories=True, enable_async_checkpointing=True,
          preservation_policy=ocp.checkpoint_managers.AnyPreservationPolicy(policies),
          **atomicity)
    else:
      options = ocp.CheckpointManagerOptions(read_only=True, create=False, save_interval_steps=0,
                                             **atomicity)
    with _quiet():  # orbax warns that a read-only directory is read-only
      self._manager = ocp.CheckpointManager(self.directory, options=options)

  def latest_step(self):
    return self._manager.latest_step()

  def all_steps(self):
    return sorted(self._manager.all_steps())

  def unfinished_steps(self) -> list:
    """Steps whose write never completed (the process died while saving); orbax ignores them."""
    if storage.is_url(self.directory):
      # In a bucket orbax writes each step in place and commits it with commit_success.txt,
      # written last: a step without one was cut short.
      names = [n for n in storage.listdir(self.directory) if ".orbax-checkpoint-tmp" in n or (
          n.isdigit() and not storage.exists(storage.join(self.directory, n, COMMIT_FILE)))]
    else:
      names = glob.glob(os.path.join(self.directory, "*.orbax-checkpoint-tmp*"))
    return sorted({int(os.path.basename(n).split(".")[0]) for n in names
                   if os.path.basename(n).split(".")[0].isdigit()})

  # --- saving

  def save(self, step: int, state, metrics: Optional[dict] = None) -> None:
    """Starts an async save of `state` as checkpoint `step`; eval `metrics` rank keep-best."""
    seed = self.config.seed
    meta = {
        "format": FORMAT,
        "step": step,
        "data": {"position": step, "seed": seed},  # the next batch is TrainStream[position]
        "rng": {"seed": seed, "key": jax.random.key_data(jax.random.key(seed)).tolist()},
        "tokenizer": {"file": "tokenizer.model", "sha256": self.tokenizer_sha},
        "checksums": [int(c) for c in jax.device_get(checksums(state))],
        "config": config_json(self.config),
    }
    if metrics is not None:
      metrics = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
    self._last = (step, ocp.args.Composite(state=ocp.args.StandardSave(state),
                                           meta=ocp.args.JsonSave(meta)), metrics)
    self._put(*self._last)

  def _put(self, step: int, args, metrics) -> None:
    """orbax's async save of `step`. Through an outage of a bucket's store (`core/outage.py`,
    armed by training) a save that cannot start is skipped, and training goes on: the next
    save, or `wait` at the end, writes a newer state once the store answers."""
    while True:
      if outage.ongoing() and not self._answers(f"to save checkpoint step {step}"):
        self._unsaved = (step, args, metrics)
        return
      try:
        with self._writing():
          self._forget_cut()  # its requests wait for the store (up to the bound) themselves
          self._manager.save(step, args=args, metrics=metrics, force=True)
        self._started, self._unsaved = step, None
        return
      except _Unanswered:
        # The save before this one (orbax raises its failure here), or this one's start, was
        # cut by the outage: see whether it is over.
        self._cut |= {s for s in (self._started, step) if s is not None}
        continue

  def wait(self) -> None:
    """Waits for the save under way; through an outage, until the store answers (up to
    train.storage_outage_s), then writes the newest state asked for, whole."""
    while True:
      try:
        with self._writing():
          self._manager.wait_until_finished()
      except _Unanswered:
        self._unsaved = self._last  # the save in flight was the newest one asked for
        self._cut.add(self._started)
      if self._unsaved is None:
        if storage.is_url(self.directory) and outage.seen():
          # A save the outage cut may have failed where orbax only logs it: what any save
          # left unfinished goes now that none is under way.
          self._cut |= set(self.unfinished_steps())
          self._forget_cut()
        return
      step, args, metrics = self._unsaved
      outage.wait_until_answering(lambda: storage.probe(self.directory), self._endpoint(),
                                  f"to save checkpoint step {step}")
      self._cut.add(step)  # written again from the start
      self._put(step, args, metrics)

  def _forget_cut(self) -> None:
    """What the saves an outage cut left in the store (a step without its commit file: never
    read, but a resume would warn of it) goes, once the store answers again, and orbax forgets
    those steps, so that a step is written again from the start."""
    cut, self._cut = sorted(s for s in self._cut if s is not None), set()
    if not cut:
      return
    self._any_cut = True
    if jax.process_index() == 0:  # one process deletes; the others wait for it below
      self._remove_unfinished(cut)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices("cut checkpoint saves forgotten")
    self._manager.reload()

  def _remove_unfinished(self, steps) -> None:
    """Deletes the steps of `steps` that have no commit file in the bucket (never read)."""
    for step in steps:
      path = storage.join(self.directory, str(step))
      if not storage.exists(storage.join(path, COMMIT_FILE)):
        storage.remove_tree(path)

  def _refused(self, error: Exception) -> UserError:
    """One line for a checkpoint write that the bucket's store refused (no permission, a
    bucket deleted, a quota): its answer, and what is intact."""
    _release_cut_save()
    cause = error
    while cause.__cause__ is not None or cause.__context__ is not None:
      cause = cause.__cause__ or cause.__context__
    known = storage.user_failure(self.directory, cause, "write a checkpoint in")
    reason = _excerpt(str(cause)) or type(cause).__name__
    steps = saved_steps(self.workdir)
    kept = (f"the checkpoints written before (steps {steps}) are intact" if steps
            else "no checkpoint was written")
    if known is not None:
      return UserError(f"{known}; {kept}")
    return UserError(f"cannot write a checkpoint in {self.directory}: the store answered "
                     f"{type(cause).__name__}: {reason}; {kept}")

  def _endpoint(self) -> str:
    return storage.endpoint(self.directory.split("://", 1)[0])

  def _answers(self, waited_for: str) -> bool:
    """One request to the store: True if it answers (the outage is over), False while it does
    not (up to the bound, past which the outage's UserError is raised)."""
    try:
      storage.probe(self.directory)
    except Exception as e:  # noqa: BLE001  sorted by outage.unreachable
      if not outage.unreachable(e):
        raise
      outage.failed(self._endpoint(), e, waited_for)
      return False
    outage.answered()
    return True

  @contextlib.contextmanager
  def _writing(self):
    """A failed write of a checkpoint (here, or in the async save of an earlier one: orbax
    raises it at the next call) becomes one UserError naming the directory and the free space;
    one cut by a store that does not answer, in a training run that rides out outages, raises
    _Unanswered (after `outage.failed`, which raises its UserError past the bound)."""
    try:
      yield
    except UserError:
      raise  # ours already (a request that waited past train.storage_outage_s)
    except Exception as e:  # orbax wraps the OSError in whatever its layer raises
      ours = _user_error_in(e)  # orbax's requests ride outages out (storage._riding)
      if ours is not None:
        _release_cut_save()
        raise ours from None
      if storage.is_url(self.directory) and outage.armed() and outage.unreachable(e):
        _release_cut_save()
        outage.failed(self._endpoint(), e, "to save a checkpoint")
        raise _Unanswered() from None
      code = _write_errno(e)
      if code is None and storage.is_url(self.directory):
        raise self._refused(e) from None
      if code is None:
        raise
      # A full disk cuts the save as a store does: its coroutines, never awaited, would say so
      # on stderr when collected or at exit, after the one error line.
      _release_cut_save()
      steps = saved_steps(self.workdir)
      kept = (f"the checkpoints written before (steps {steps}) are intact" if steps
              else "no checkpoint was written")
      raise files.write_error(self.directory, OSError(code, os.strerror(code)), kept) from None

  def close(self) -> None:
    self._manager.close()
    if storage.is_url(self.directory) and outage.seen() and jax.process_index() == 0:
      # Once every save and orbax's deletions of old steps are over: what an outage left
      # unfinished (a deletion it cut takes the commit file first; a cut save's late writes)
      # goes, so that a resume does not warn of a checkpoint the run stopped writing. A write
      # of a cut save that TensorStore still retries lands at its next try, at most
      # _MAX_DELAY_S (+ 1 s of jitter) after the store answered again: that is waited out
      # first, or it would make the step again behind this tidy-up.
      if self._any_cut:
        time.sleep(max(0.0, outage.last_answered() + _MAX_DELAY_S + 1 - time.time()))
      try:
        self._remove_unfinished(self.unfinished_steps())
      except Exception:  # noqa: BLE001 - a tidy-up: a store down again leaves them to the next run
        pass

  # --- restoring

  def restore(self, target, step: Optional[int] = None):
    """The state at `step` (default: the newest readable checkpoint), shaped like `target`."""
    if step is None:
      restored = self.latest_good(target)
      if restored is None:
        raise UserError(f"no checkpoint in {self.directory}; train first with --mode=train")
      return restored.state
    if step not in self.all_steps():
      raise UserError(f"no checkpoint at step {step} in {self.directory}; "
                      f"available: {self.all_steps() or 'none'}")
    try:
      return self._read(step, target).state
    except _Unreadable as e:
      raise UserError(f"checkpoint step {step} in {self.directory} is unreadable ({e}); choose "
                      f"another step of {self.all_steps()}") from None

  def latest_good(self, target) -> Optional[Restored]:
    """The newest checkpoint that reads back intact, or None if there is no checkpoint.

    Each unreadable newer checkpoint is reported in one line on stderr and recorded in
    `self.unreadable`. A checkpoint of an incompatible config raises UserError.
    """
    for step in self.unfinished_steps():
      print(f"warning: ignoring the unfinished checkpoint of step {step} in {self.directory} "
            "(the run stopped while writing it)", file=sys.stderr, flush=True)
    steps = self.all_steps()
    reasons = []
    for step in reversed(steps):
      try:
        return self._read(step, target)
      except _Unreadable as e:
        self.unreadable.append(step)
        reasons.append(f"step {step}: {e}")
        print(f"warning: checkpoint step {step} in {self.directory} is unreadable ({e}); "
              "using the previous one", file=sys.stderr, flush=True)
    if steps:
      raise UserError(f"no readable checkpoint in {self.directory} ({'; '.join(reasons)}); move "
                      "the directory away to start over")
    return None

  def set_aside_unreadable(self) -> list:
    """Moves the checkpoints latest_good() could not read to WORKDIR/checkpoints_unreadable, so
    that training can save those steps again (kept, not deleted, for a post-mortem). Returns
    their steps."""
    moved, self.unreadable = self.unreadable, []
    if jax.process_index() == 0:  # one process moves them; the others wait for it below
      for step in moved:
        destination = storage.join(self.workdir, UNREADABLE, str(step))
        n = 1
        while storage.exists(destination):
          destination = storage.join(self.workdir, UNREADABLE, f"{step}-{n}")
          n += 1
        storage.move(storage.join(self.directory, str(step)), destination)
    if moved and jax.process_count() > 1:
      multihost_utils.sync_global_devices("checkpoints set aside")
    return moved

  def metadata_reads(self, step: int) -> bool:
    """Whether checkpoint `step` is complete and its metadata reads and fits its step: a cheap
    check (no array is read) that catches truncated files and unfinished writes."""
    if self.unfinished_steps():
      return False
    try:
      self._read_meta(step)
    except _Unreadable:
      return False
    return True

  def _read_meta(self, step: int) -> dict:
    if not storage.isdir(storage.join(self.directory, str(step), "meta")):
      raise _Unreadable("it has no meta item: written by an older version or incomplete")
    with _quiet():
      try:
        meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        meta = meta["meta"]
      except Exception as e:  # any damage to the files
        raise _Unreadable(f"its metadata does not read: {_reason(e)}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
      raise _Unreadable("it has no metadata of this version")
    try:
      expected_key = jax.random.key_data(jax.random.key(meta["rng"]["seed"])).tolist()
      consistent = (meta["step"] == step and meta["data"]["position"] == step
                    and meta["rng"]["key"] == expected_key)
      meta["config"], meta["tokenizer"]["sha256"]  # noqa: B018 (present, or KeyError)
    except (KeyError, TypeError) as e:
      raise _Unreadable(f"its metadata lacks {e}") from None
    if not consistent:
      raise _Unreadable("its metadata does not match its step")
    return meta

  def _read(self, step: int, target) -> Restored:
    meta = self._read_meta(step)
    saved_config, saved_sha = meta["config"], meta["tokenizer"]["sha256"]
    incompatible, changed = compare_configs(saved_config, self.config)
    if incompatible:
      raise UserError(f"checkpoint step {step} in {self.directory} does not fit this config: "
                      f"{', '.join(incompatible)}; keep the checkpoint's values (its "
                      "config.json) or start a new --workdir")
    if self.tokenizer_sha and saved_sha and self.tokenizer_sha != saved_sha:
      raise UserError(f"checkpoint step {step} in {self.directory} was trained with another "
                      f"vocabulary (tokenizer sha256 {saved_sha[:12]}, now "
                      f"{self.tokenizer_sha[:12]}); restore the "
                      f"{os.path.join(self.workdir, 'tokenizer.model')} it was trained with, or "
                      "start a new --workdir")

    with _quiet():
      try:
        state = self._manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(_restore_target(target))))["state"]
      except Exception as e:  # any damage to the files
        raise _Unreadable(f"its arrays do not read: {_reason(e)}") from None
    if [int(c) for c in jax.device_get(checksums(state))] != meta["checksums"]:
      raise _Unreadable("its arrays do not match the checksums written with them")
    return Restored(step, state, meta, changed)


# ----------------------------------------------------------------------------- preemption


class _Abandoned(BaseException):
  """Raised by the signal handler inside `Preemption.abandoning()`. A BaseException, as
  KeyboardInterrupt is: library code that catches Exception (JAX's compilation cache does) must
  not swallow it."""


class Preemption(signals.Signals):
  """`with Preemption() as p:` ... `if p.reached(step):` save and stop.

  One process: SIGTERM or SIGINT (Ctrl-C) sets a flag that the loop reads after each step, so the
  step in flight finishes and is checkpointed; a second Ctrl-C interrupts at once. Several
  processes: JAX's preemption sync point, which tells every host to stop at the same step (the
  coordination service handles SIGTERM there, so no handler is installed).
  """

  def __init__(self):
    super().__init__(install=jax.process_count() == 1)  # self.signal: the signal's name
    self._sync = True
    self._abandon = False

  def _handle(self, signum, frame):
    if self.signal is not None and signum == signal.SIGINT:
      # Stop at once. The save threads in flight then fail and log tracebacks (orbax); the
      # one line that cli.py prints says what happened instead.
      logging.disable(logging.CRITICAL)
      warnings.simplefilter("ignore")  # and their coroutines, never awaited, warn at exit
      raise KeyboardInterrupt(
          f"a second Ctrl-C: stopped at once, after {self.signal}; a checkpoint being written is "
          "left unfinished and the next run ignores it; run the same command to resume")
    super()._handle(signum, frame)
    if self._abandon:
      raise _Abandoned

  @contextlib.contextmanager
  def abandoning(self):
    """Inside the block a signal stops the work at once: the block is left where it was, with
    `self.signal` set. For work that a rerun redoes anyway (the final evaluation)."""
    self._abandon = True
    previous_hook = sys.unraisablehook

    def hook(unraisable):
      # A signal that lands while Python runs a callback that cannot raise (JAX's gc
      # callback) is printed as "Exception ignored" and lost; the flag is set all the same, and
      # the block then runs to its end instead of stopping early: nothing to report.
      if not isinstance(unraisable.exc_value, _Abandoned):
        previous_hook(unraisable)

    sys.unraisablehook = hook
    try:
      yield
    except _Abandoned:
      pass
    finally:
      self._abandon = False
      sys.unraisablehook = previous_hook

  def reached(self, step: int) -> bool:
    """Whether to checkpoint `step` and stop; called after every step."""
    if jax.process_count() == 1:
      return self.signal is not None
    if not self._sync:
      return False
    try:
      if multihost_utils.reached_preemption_sync_point(step):
        self.signal = "preemption notice"
        return True
    except RuntimeError as e:  # jax.distributed started without its preemption service
      self._sync = False
      print(f"warning: no preemption checkpoints in this multi-process run ({e})",
            file=sys.stderr, flush=True)
    return False
