"""The one interface of every place a run is logged to, and the thread that keeps a tracker's
service off the training loop's path.

A `Writer` (as CLU's metric writers) takes the logger's records: metrics.jsonl (logger.py),
TensorBoard, W&B and MLflow (a module each here) are writers of the same kind. A `Tracker` is a
writer whose every call goes to a service and may fail; `Background` drives one on a thread of
its own, in order, from a bounded queue that the training thread only appends to: a tracker that
is slow, stalled or unreachable costs training nothing. Its first failure prints one warning;
the call is retried every `retry_s` while later calls wait behind it (up to `capacity`, then the
oldest are dropped: metrics.jsonl and TensorBoard keep them all). Records go at most once every
`interval_s`, those logged in between in one call: a request costs the training process some
milliseconds of Python (MLflow's client: about 2 ms of CPU, which the training thread waits for
under the GIL), which a request every few log steps would make several percent of a small
model's training; one every two seconds costs nothing measurable (docs/benchmarks.md,
"Experiment trackers on and off").
"""

from __future__ import annotations

import collections
import functools
import getpass
import os
import shlex
import socket
import subprocess
import sys
import threading
import time
from typing import Optional

from transformer_jax.core import secrets, storage

# The fields of a metrics.jsonl record that are bookkeeping, not series of the run (the
# summary sums them instead: tools/summary.py).
BOOKKEEPING = ("step", "split", "interval_s", "interval_steps", "interval_tokens",
               "compile_tokens")
SAMPLE_COLUMNS = ("source", "translation", "reference")


def numbers(record: dict, leave_out=()) -> dict:
  """The numeric fields of a record (booleans are not numbers here), but those of `leave_out`:
  the one filter of the records of metrics.jsonl, the final metrics and the summary."""
  return {k: v for k, v in record.items() if isinstance(v, (int, float))
          and not isinstance(v, bool) and k not in leave_out}


def scalars(record: dict) -> dict:
  """{"SPLIT/KEY": number} of a metrics.jsonl record: its series, as every writer shows them."""
  return {f"{record['split']}/{k}": v for k, v in numbers(record, BOOKKEEPING).items()}


def sample_rows(record: dict) -> list:
  """An evaluation record's sample translations as rows of SAMPLE_COLUMNS."""
  return [[s["source"], s["hypothesis"], s["reference"]] for s in record.get("samples") or ()]


def checkpoint_uris(steps: list, directory: str) -> dict:
  """{step: the URI of its checkpoint}: in a bucket as it is, on a local disk as file://."""
  if not storage.is_url(directory):
    directory = "file://" + os.path.abspath(directory)
  return {str(step): f"{directory.rstrip('/')}/{step}" for step in steps}


def run_name(config, workdir: str, own: str = "") -> str:
  """The run's name in a tracker: its own key, else train.run_name, else the workdir's name."""
  return own or config.train.run_name or os.path.basename(workdir.rstrip("/")) or workdir


def split_tags(text: str) -> list:
  """train.tags / wandb.tags: comma-separated, blanks dropped."""
  return [t.strip() for t in text.split(",") if t.strip()]


class Writer:
  """One place a run is logged to. A method is a no-op where the writer shows no such thing."""

  name = "writer"

  def write(self, records: list) -> None:
    """metrics.jsonl's records, in order: {"split", "step", "time", numbers..., and for an
    evaluation "samples": [{"source", "hypothesis", "reference"}]}."""

  def text(self, tag: str, text: str, step: int) -> None:
    """A text of the run's: its config, its model."""

  def summary(self, values: dict) -> None:
    """The run's figures at its end (final metrics, tokens, time) or at its start-up."""

  def checkpoints(self, steps: list, directory: str) -> None:
    """The checkpoint steps the workdir keeps now, in `directory` (references, not weights)."""

  def images(self, paths: dict, step: int) -> None:
    """{name: local PNG file}: --mode=plot's plots."""

  def files(self, paths: dict) -> None:
    """{name in the run ("summary.md", "plots/curves.png"): local file}: the run's files."""

  def close(self, state: str = "finished") -> None:
    """state: finished | stopped (a signal; the same command resumes it) | failed."""

  @property
  def complete(self) -> bool:
    """After close: everything was written."""
    return True


class Tracker(Writer):
  """A writer to a service that keeps a run of its own (W&B, MLflow), called on `Background`'s
  thread. Any exception means "not done, try again": a retried `write` sends the same numbers
  at the same steps and times, which MLflow's stores keep once. `open` finds the workdir's run
  by `run_id` (WORKDIR/tracker.json) or creates it, and returns {split: last step} ("*": every
  split) of the steps it shows already, which a resumed run does not send again (a run killed
  after its last checkpoint logs those steps a second time)."""

  where = ""  # the service, for messages: a URI, a project

  def open(self, run_id: str, config: dict) -> dict:
    raise NotImplementedError


def provenance() -> dict:
  """Where the run came from, for every tracker: the git commit of the code that runs (and
  whether its tree had changes), the command line (secrets masked: cli.py redacts sys.argv once
  its flags are read; masked again here), the program, the host and the user."""
  return dict(_provenance())


@functools.lru_cache(maxsize=None)
def _provenance() -> dict:
  source = os.path.dirname(os.path.abspath(__file__))  # git finds the checkout above it
  found = {"command": secrets.redact(shlex.join(sys.argv)), "host": socket.gethostname(),
           "program": os.path.basename(sys.argv[0]) if sys.argv else "", "user": _user()}

  def git(*args) -> str:
    return subprocess.run(["git", "-C", source, *args], capture_output=True, text=True,
                          timeout=10, check=True).stdout.strip()

  try:  # an installed copy, or no git at all: no commit
    found["git_commit"] = git("rev-parse", "HEAD")
    found["git_dirty"] = bool(git("status", "--porcelain", "--untracked-files=no"))
  except (OSError, subprocess.SubprocessError):
    pass
  return found


def _user() -> str:
  try:
    return getpass.getuser()
  except Exception:  # noqa: BLE001 - no user name in a container is no reason to stop
    return ""


# Seconds to wait at the end of a run for a tracker to take what is queued; after that the
# rest is given up (it is in metrics.jsonl) rather than keep a finished run waiting.
CLOSE_TIMEOUT_S = 60.0
MAX_VALUES = 1000  # numbers sent in one call of Tracker.write (MLflow's limit per request)
# Errors of this process, not of the tracker's service: a bug, a broken install, an import gone
# wrong (Python 3.11's "AST constructor recursion depth mismatch" is a SystemError). Retried
# like the others, but never said to be the service's.
LOCAL_ERRORS = (ImportError, SyntaxError, SystemError, NameError, AttributeError, TypeError,
                AssertionError, RecursionError, MemoryError, NotImplementedError)


def _queued(method: str):
  """A method of Background: Writer's `method`, queued for the tracker's thread."""
  return lambda self, *args: self._put(method, *args)


class Background(Writer):
  """Drives `tracker` on a thread; each method returns at once."""

  def __init__(self, tracker: Tracker, run_id: str, config: dict, retry_s: float = 60.0,
               capacity: int = 10_000, backlog: list = (), interval_s: float = 0.0):
    """backlog: the records of the steps before this run's start (metrics.jsonl's): those the
    tracker run does not show yet (lost to a kill before they were sent, or logged before the
    tracker was chosen) are sent first. interval_s: the least time between two calls of
    tracker.write (0: each record as soon as the thread is free)."""
    self.tracker = tracker
    self.name = tracker.name
    self._backlog = [record for record in backlog if record.get("split") != "startup"]
    self._retry_s = retry_s
    self._interval_s = interval_s
    self._sent_at = -float("inf")  # time.monotonic() of the last write
    self._calls = collections.deque()
    self._capacity = capacity
    self._dropped = 0
    self._busy = 0  # calls at the head of the queue that the thread is making now
    self.unsent = 0  # calls given up at the end
    self._error: Optional[BaseException] = None  # the last failure, while failing
    self._cond = threading.Condition()
    self._closing = False
    self._shown: Optional[dict] = None  # {split: last step} the run showed before this one
    self._calls.append(("open", (run_id, config)))
    self._thread = threading.Thread(target=self._work, name=f"tracker-{tracker.name}",
                                    daemon=True)
    self._thread.start()

  def _put(self, method: str, *args) -> None:
    with self._cond:
      if self._closing:
        return
      if len(self._calls) >= self._capacity:  # the oldest waiting, never one in flight or the open
        del self._calls[max(self._busy, self._calls[0][0] == "open")]
        self._dropped += 1
      self._calls.append((method, args))
      self._cond.notify()

  def write(self, records: list) -> None:
    for record in records:  # a start-up is one per run: the run's summary, not a series
      if record["split"] == "startup":
        self._put("summary", {"step": record["step"], **scalars(record)})
      else:
        self._put("write", record)

  summary, images, checkpoints, files = map(_queued, ("summary", "images", "checkpoints", "files"))

  def _shown_before(self, record: dict) -> bool:
    """A record of a step the run already shows (logged before a kill)."""
    return bool(self._shown) and record["step"] <= self._shown.get(record["split"],
                                                                   self._shown.get("*", -1))

  def _hold(self) -> float:
    """Seconds until records may be sent again (train.tracker_interval_s after the last)."""
    return self._sent_at + self._interval_s - time.monotonic()

  def _next(self) -> tuple:
    """(method, args, calls taken): the first call queued, and with a record those queued
    right after it, up to MAX_VALUES fields (one request: MLflow's limit)."""
    method, args = self._calls[0]
    if method != "write":
      return method, args, 1
    records, values = [], 0
    for method_, args_ in self._calls:
      if method_ != "write" or (records and values + len(args_[0]) > MAX_VALUES):
        break
      records.append(args_[0])
      values += len(args_[0])
    return "write", (records,), len(records)

  def _work(self) -> None:
    final_try = False
    while True:
      with self._cond:
        # Records wait out the interval (what is logged meanwhile joins them); not at the end.
        while not self._closing:
          if not self._calls:
            self._cond.wait()
          elif self._calls[0][0] == "write" and (hold := self._hold()) > 0:
            self._cond.wait(hold)
          else:
            break
        if not self._calls:
          break
        method, args, count = self._next()
        self._busy = count
      try:
        self._call(method, args)
      except Exception as e:  # any failure: wait and try again
        if self._error is None:
          self._warn(e)
        self._error = e
        with self._cond:
          self._busy = 0
          if self._closing:
            if final_try:
              break
            final_try = True  # at the end: one more try now, not after retry_s
            continue
          self._cond.wait(self._retry_s)
        continue
      with self._cond:
        for _ in range(count):
          self._calls.popleft()
        self._busy = 0
      if self._error is not None:
        print(f"{self.name}: {'working' if _local(self._error) else 'reached'} again; sending "
              "what was held back", file=sys.stderr, flush=True)
        self._error = None
    with self._cond:
      self.unsent = len(self._calls) + self._dropped

  def _call(self, method: str, args: tuple) -> None:
    if method == "write":
      records = [r for r in args[0] if not self._shown_before(r)]
      if records:
        self._sent_at = time.monotonic()
        self.tracker.write(records)
      return
    result = getattr(self.tracker, method)(*args)
    if method == "open":
      self._shown = result or {}
      missing = [r for r in self._backlog if not self._shown_before(r)]
      self._backlog = []
      with self._cond:  # right after the open, before this run's records
        for record in reversed(missing):
          self._calls.insert(1, ("write", (record,)))

  def _warn(self, error: BaseException) -> None:
    where = (f"failed in this process ({_one_line(error)}), not at {self.tracker.where}"
             if _local(error) else f"({self.tracker.where}) failed: {_one_line(error)}")
    print(f"warning: {self.name} {where}; training goes on (metrics.jsonl and TensorBoard are "
          f"complete) and {self.name} is tried again every {self._retry_s:g} s",
          file=sys.stderr, flush=True)

  @property
  def complete(self) -> bool:
    return not self._thread.is_alive() and not self.unsent

  def close(self, state: str = "finished", timeout: float = CLOSE_TIMEOUT_S) -> None:
    """Sends what is queued (waiting at most `timeout` seconds), then ends the tracker's run."""
    self._put("close", state)
    with self._cond:
      self._closing = True
      self._cond.notify()
    self._thread.join(timeout)
    if self._thread.is_alive() or self.unsent:
      with self._cond:
        calls, dropped, error = [m for m, _ in self._calls], self._dropped, self._error
      why = (f"it failed in this process: {_one_line(error)}" if _local(error)
             else f"{self.tracker.where} failed: {_one_line(error)}" if error is not None
             else f"{self.tracker.where} did not answer within {timeout:g} s")
      others = sorted(set(calls) - {"write"})
      lost = ([f"{calls.count('write')} record(s) not sent"] if "write" in calls else []) + (
          [f"its {', '.join(others)} not made"] if others else []) + (
          [f"{dropped} dropped (more than {self._capacity} waited)"] if dropped else [])
      print(f"{self.name}: {', '.join(lost)} ({why}); metrics.jsonl holds them all (the same "
            "command on the finished workdir sends them)", file=sys.stderr, flush=True)


def _local(error: Optional[BaseException]) -> bool:
  return isinstance(error, LOCAL_ERRORS)


def _one_line(error: BaseException) -> str:
  text = secrets.redact(" ".join(str(error).split())) or type(error).__name__
  if isinstance(error, LOCAL_ERRORS):
    text = f"{type(error).__name__}: {text}"
  return text if len(text) <= 200 else text[:197] + "..."
