"""Stopping at the next safe point on SIGTERM or SIGINT, for training (train/checkpoint.py's
`Preemption`, which saves the step in flight) and for a sweep worker between trials
(tools/sweep/worker.py, which starts no new trial)."""

from __future__ import annotations

import signal
import threading

STOPPING = (signal.SIGTERM, signal.SIGINT)


class Signals:
  """`with Signals() as s:` SIGTERM and SIGINT set `s.signal` (the signal's name) instead of
  ending the process; the previous handlers come back at the end of the block. Nothing is
  installed outside the main thread (Python allows handlers there alone) or with install=False."""

  def __init__(self, install: bool = True):
    self.signal = None
    self._install = install
    self._previous = {}

  def __enter__(self):
    if self._install and threading.current_thread() is threading.main_thread():
      for sig in STOPPING:
        self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def __exit__(self, *exc):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
    self._previous = {}

  def _handle(self, signum, frame):
    self.signal = signal.Signals(signum).name
