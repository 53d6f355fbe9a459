"""What every tracker does, and the thread that keeps it off the training loop's path.

A tracker (W&B, MLflow) is a `Tracker`: a few methods, each a call to its service. `Background`
runs them on a thread of its own, in order, from a bounded queue that the training thread only
appends to: a tracker that is slow, stalled or unreachable costs training nothing. The first
failure prints one warning; the call is retried every `retry_s` while later calls wait behind
it (up to `capacity`, then the oldest are dropped: metrics.jsonl and TensorBoard keep them all).
Scalars go at most once every `interval_s`, those logged in between in one call: a request to
a tracker costs the training process some milliseconds of Python (MLflow's client: about 2 ms
of CPU, which the training thread waits for under the GIL), and a request every few log steps
would cost a small model's training several percent; one every two seconds costs it nothing
measurable (docs/benchmarks.md, "Experiment trackers on and off").
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

from transformer_jax.core import secrets


def split_tags(text: str) -> list:
  """train.tags / wandb.tags: comma-separated, blanks dropped."""
  return [t.strip() for t in text.split(",") if t.strip()]


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


class Tracker:
  """One tracker's run. Each method is called on `Background`'s thread; any exception means
  "not reached, try again later" (the same call is made again).

  The run is the workdir's: `open` finds it by `run_id` (WORKDIR/tracker.json) or creates it,
  and returns {split: last step} ("*": every split) of the steps it already shows, which a
  resumed run does not send again (a run killed after its last checkpoint logs those steps a
  second time).
  """

  name = "tracker"
  where = ""  # the service, for messages: a URI, a project

  def open(self, run_id: str, config: dict) -> dict:
    raise NotImplementedError

  def scalars(self, records: list) -> None:
    """records: [(split, {"SPLIT/KEY": number}, step, wall)], the numbers of metrics.jsonl
    records in their order (those queued since the previous call go together); wall: the
    time.time() the record was logged at (None for a record of an earlier run's)."""

  def table(self, name: str, columns: list, rows: list, step: int) -> None:
    """Sample translations: rows of `columns` strings."""

  def summary(self, values: dict) -> None:
    """The run's figures at its end (final metrics, tokens, time)."""

  def images(self, paths: dict, step: int) -> None:
    """{name: local PNG file}: --mode=plot's plots."""

  def checkpoints(self, steps: list, directory: str) -> None:
    """The checkpoint steps the workdir keeps now, in `directory` (references, not weights)."""

  def files(self, paths: dict) -> None:
    """{name: local file}: the run's own files (config.json, summary.md, metrics.jsonl)."""

  def close(self, state: str) -> None:
    """state: finished | stopped (a signal; the same command resumes it) | failed."""


# Seconds to wait at the end of a run for a tracker to take what is queued; after that the
# rest is given up (it is in metrics.jsonl) rather than keep a finished run waiting.
CLOSE_TIMEOUT_S = 60.0
MAX_VALUES = 1000  # numbers sent in one call of Tracker.scalars


class Background:
  """Drives `tracker` on a thread; each public method returns at once."""

  def __init__(self, tracker: Tracker, run_id: str, config: dict, retry_s: float = 60.0,
               capacity: int = 10_000, backlog: list = (), interval_s: float = 0.0):
    """backlog: the scalar records (split, values, step) of the steps before this run's start
    (metrics.jsonl's): those the tracker run does not show yet (lost to a kill before they
    were sent, or logged before the tracker was chosen) are sent first. interval_s: the least
    time between two calls of tracker.scalars (0: each record as soon as the thread is free)."""
    self.tracker = tracker
    self._backlog = [(split, values, step, None) for split, values, step in backlog]
    self._retry_s = retry_s
    self._interval_s = interval_s
    self._sent_at = -float("inf")  # time.monotonic() of the last scalars call
    self._calls = collections.deque()
    self._capacity = capacity
    self._dropped = 0
    self._busy = 0  # calls at the head of the queue that the thread is making now
    self.unsent = 0  # calls given up at the end
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

  def scalars(self, split: str, values: dict, step: int) -> None:
    self._put("scalars", split, values, step, time.time())

  def table(self, name: str, columns: list, rows: list, step: int) -> None:
    self._put("table", name, columns, rows, step)

  def summary(self, values: dict) -> None:
    self._put("summary", values)

  def images(self, paths: dict, step: int) -> None:
    self._put("images", paths, step)

  def checkpoints(self, steps: list, directory: str) -> None:
    self._put("checkpoints", steps, directory)

  def files(self, paths: dict) -> None:
    self._put("files", paths)

  def _shown_before(self, split: str, step: int) -> bool:
    """A record of a step the run already shows (logged before a kill)."""
    return bool(self._shown) and step <= self._shown.get(split, self._shown.get("*", -1))

  def _hold(self) -> float:
    """Seconds until scalars may be sent again (train.tracker_interval_s after the last)."""
    return self._sent_at + self._interval_s - time.monotonic()

  def _next(self) -> tuple:
    """(method, args, calls taken): the first call queued, and with a scalar record the ones
    queued right after it, up to MAX_VALUES numbers (one request: MLflow's limit per batch)."""
    method, args = self._calls[0]
    if method != "scalars":
      return method, args, 1
    records, values = [], 0
    for method_, args_ in self._calls:
      if method_ != "scalars" or (records and values + len(args_[1]) > MAX_VALUES):
        break
      records.append(args_)
      values += len(args_[1])
    return "scalars", records, len(records)

  def _work(self) -> None:
    warned, failing, final_try = False, False, False
    while True:
      with self._cond:
        # Scalars wait out the interval (what is logged meanwhile joins them); not at the end.
        while not self._closing:
          if not self._calls:
            self._cond.wait()
          elif self._calls[0][0] == "scalars" and (hold := self._hold()) > 0:
            self._cond.wait(hold)
          else:
            break
        if not self._calls:
          break
        method, args, count = self._next()
        self._busy = count
      try:
        if method == "scalars":
          records = [r for r in args if not self._shown_before(r[0], r[2])]
          if records:
            self._sent_at = time.monotonic()
            self.tracker.scalars(records)
        elif method != "table" or not self._shown_before(args[0].split("/")[0], args[-1]):
          result = getattr(self.tracker, method)(*args)
          if method == "open":
            self._shown = result or {}
            missing = [r for r in self._backlog if not self._shown_before(r[0], r[2])]
            self._backlog = []
            with self._cond:  # right after the open, before this run's records
              for record in reversed(missing):
                self._calls.insert(1, ("scalars", record))
      except Exception as e:  # any failure of the service: wait and try again
        if not warned:
          warned = True
          print(f"warning: {self.tracker.name} ({self.tracker.where}) failed: "
                f"{_one_line(e)}; training goes on (metrics.jsonl and TensorBoard are complete) "
                f"and {self.tracker.name} is tried again every {self._retry_s:g} s",
                file=sys.stderr, flush=True)
        failing = True
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
      if failing:
        failing = False
        print(f"{self.tracker.name}: reached again; sending what was held back",
              file=sys.stderr, flush=True)
    with self._cond:
      self.unsent = len(self._calls) + self._dropped

  @property
  def complete(self) -> bool:
    """After close: everything was sent."""
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
        left, dropped = len(self._calls), self._dropped
      lost = ([f"{left} record(s) not sent ({self.tracker.where} did not answer)"] if left else []
              ) + ([f"{dropped} dropped while it did not (more than {self._capacity} waited)"]
                   if dropped else [])
      print(f"{self.tracker.name}: {'; '.join(lost)}; metrics.jsonl holds them all",
            file=sys.stderr, flush=True)


def _one_line(error: BaseException) -> str:
  text = secrets.redact(" ".join(str(error).split())) or type(error).__name__
  return text if len(text) <= 200 else text[:197] + "..."
