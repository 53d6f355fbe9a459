"""Progress: the lines before a slow run's first log line, and bars only for a person watching."""

import io
import sys

import numpy as np

from transformer_jax.core import progress
from transformer_jax.train import actions


def test_early_lines_until_the_first_log_line():
  early = actions.EarlyProgress(start=0, total=1000, log_every=100, every=30.0)
  t0 = early.started
  loss = {"loss": np.float32(7.25)}
  first = early.line(1, loss, now=t0 + 40.0)
  assert first.startswith("step 1/1000 done in 40.0s (compilation included) | loss 7.2500")
  assert "the log follows at step 100" in first
  assert early.line(2, loss, now=t0 + 50.0) == ""  # 10 s later: not yet
  line = early.line(31, loss, now=t0 + 100.0)  # 30 steps in 60 s after the first
  assert line == "step 31/1000 | loss 7.2500 | 0.50 steps/s | ETA 32m18s", line
  assert early.line(40, loss, now=t0 + 110.0) == ""
  assert early.line(100, loss, now=t0 + 500.0) == ""  # the periodic log speaks from here
  # A resumed run: its first log line is at the next multiple of log_every.
  resumed = actions.EarlyProgress(start=250, total=1000, log_every=100)
  assert "the log follows at step 300" in resumed.line(251, loss)
  assert resumed.line(300, loss) == ""
  assert actions.EarlyProgress(0, 5, 100).line(1, loss).endswith("at step 5")


def test_bars_only_on_a_terminal_unless_forced(monkeypatch):
  monkeypatch.delenv(progress.ENV, raising=False)
  assert not progress.enabled()  # pytest captures both streams: no terminal
  stream = io.StringIO()
  monkeypatch.setattr(sys, "stderr", stream)
  assert list(progress.bar(range(3), total=3, desc="quiet")) == [0, 1, 2]
  assert stream.getvalue() == ""
  monkeypatch.setenv(progress.ENV, "1")
  assert list(progress.bar(range(3), total=3, desc="shown", mininterval=0)) == [0, 1, 2]
  assert "shown" in stream.getvalue() and "3/3" in stream.getvalue()
  monkeypatch.setenv(progress.ENV, "0")
  assert not progress.enabled(stdout_is_output=True)
  assert progress.duration(3725) == "1h02m05s" and progress.duration(42) == "0m42s"


def test_evaluations_left_at_a_log_line_count_the_one_after_it_and_the_final_one():
  # 40 steps, evaluated at 10, 20, 30 and after the last step; a log line comes before the
  # evaluation of its own step.
  expected = {1: 4, 9: 4, 10: 4, 11: 3, 20: 3, 30: 2, 35: 1, 40: 1}
  got = {step: actions.evaluations_left(step, 40, 10) for step in expected}
  assert got == expected
  assert actions.evaluations_left(5, 40, 0) == 1  # eval_every=0: the final one alone
  assert actions.evaluations_left(10, 20, 10) == 2  # at 10, and the final one (not at 20)
