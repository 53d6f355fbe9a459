"""What every tracker does, and the thread that keeps it off the training loop's path.

A tracker (W&B, MLflow) is a `Tracker`: a few methods, each a call to its service. `Background`
runs them on a thread of its own, in order, from a bounded queue that the training thread only
appends to: a tracker that is slow, stalled or unreachable costs training nothing. The first
failure prints one warning; the call is retried every `retry_s` while later calls wait behind
it (up to `capacity`, then the oldest are dropped: metrics.jsonl and TensorBoard keep them all).
"""

from __future__ import annotations

import collections
import sys
import threading
from typing import Optional


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

  def scalars(self, split: str, values: dict, step: int) -> None:
    """values: {"SPLIT/KEY": number}, the numbers of one metrics.jsonl record."""

  def table(self, name: str, columns: list, rows: list, step: int) -> None:
    """Sample translations: rows of `columns` strings."""

  def summary(self, values: dict) -> None:
    """The run's figures at its end (final metrics, tokens, time)."""

  def images(self, paths: dict, step: int) -> None:
    """{name: local PNG file}: --mode=plot's plots."""

  def checkpoints(self, steps: list, directory: str) -> None:
    """The checkpoint steps the workdir keeps now, in `directory` (references, not weights)."""

  def close(self, state: str) -> None:
    """state: finished | stopped (a signal; the same command resumes it) | failed."""


# Seconds to wait at the end of a run for a tracker to take what is queued; after that the
# rest is given up (it is in metrics.jsonl) rather than keep a finished run waiting.
CLOSE_TIMEOUT_S = 60.0


class Background:
  """Drives `tracker` on a thread; each public method returns at once."""

  def __init__(self, tracker: Tracker, run_id: str, config: dict, retry_s: float = 60.0,
               capacity: int = 10_000):
    self.tracker = tracker
    self._retry_s = retry_s
    self._calls = collections.deque()
    self._capacity = capacity
    self._dropped = 0
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
      if len(self._calls) >= self._capacity:
        del self._calls[1 if self._calls[0][0] == "open" else 0]  # the oldest, not the open
        self._dropped += 1
      self._calls.append((method, args))
      self._cond.notify()

  def scalars(self, split: str, values: dict, step: int) -> None:
    self._put("scalars", split, values, step)

  def table(self, name: str, columns: list, rows: list, step: int) -> None:
    self._put("table", name, columns, rows, step)

  def summary(self, values: dict) -> None:
    self._put("summary", values)

  def images(self, paths: dict, step: int) -> None:
    self._put("images", paths, step)

  def checkpoints(self, steps: list, directory: str) -> None:
    self._put("checkpoints", steps, directory)

  def _shown_before(self, method: str, args) -> bool:
    """A scalar record or table of a step the run already shows (logged before a kill)."""
    if method not in ("scalars", "table") or not self._shown:
      return False
    split = args[0] if method == "scalars" else args[0].split("/")[0]
    return args[-1] <= self._shown.get(split, self._shown.get("*", -1))

  def _work(self) -> None:
    warned, failing, final_try = False, False, False
    while True:
      with self._cond:
        while not self._calls and not self._closing:
          self._cond.wait()
        if not self._calls:
          break
        method, args = self._calls[0]
      try:
        if not self._shown_before(method, args):
          result = getattr(self.tracker, method)(*args)
          if method == "open":
            self._shown = result or {}
      except Exception as e:  # any failure of the service: wait and try again
        if not warned:
          warned = True
          print(f"warning: {self.tracker.name} ({self.tracker.where}) failed: "
                f"{_one_line(e)}; training goes on (metrics.jsonl and TensorBoard are complete) "
                f"and {self.tracker.name} is tried again every {self._retry_s:g} s",
                file=sys.stderr, flush=True)
        failing = True
        with self._cond:
          if self._closing:
            if final_try:
              break
            final_try = True  # at the end: one more try now, not after retry_s
            continue
          self._cond.wait(self._retry_s)
        continue
      with self._cond:
        self._calls.popleft()
      if failing:
        failing = False
        print(f"{self.tracker.name}: reached again; sending what was held back",
              file=sys.stderr, flush=True)
    with self._cond:
      self.unsent = len(self._calls) + self._dropped

  def close(self, state: str = "finished", timeout: float = CLOSE_TIMEOUT_S) -> None:
    """Sends what is queued (waiting at most `timeout` seconds), then ends the tracker's run."""
    self._put("close", state)
    with self._cond:
      self._closing = True
      self._cond.notify()
    self._thread.join(timeout)
    unsent = getattr(self, "unsent", None)
    if self._thread.is_alive() or unsent:
      with self._cond:
        left = len(self._calls) + self._dropped
      print(f"{self.tracker.name}: {left} record(s) not sent ({self.tracker.where} did not "
            "answer); metrics.jsonl holds them all", file=sys.stderr, flush=True)


def _one_line(error: BaseException) -> str:
  text = " ".join(str(error).split()) or type(error).__name__
  return text if len(text) <= 200 else text[:197] + "..."
