"""Progress bars with an ETA for the long steps (tqdm), drawn on stderr only for a person watching.

A bar is drawn when stderr is a terminal and stdout is one too: output sent to a file or a pipe
(`> train.log`, a SLURM job, a sweep's trial log) keeps only the periodic log lines. Modes whose
stdout is their product (translate) draw on a terminal stderr whatever stdout is. The environment
variable TRANSFORMER_JAX_PROGRESS=1 or 0 forces bars on or off.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading

ENV = "TRANSFORMER_JAX_PROGRESS"


def enabled(stdout_is_output: bool = False) -> bool:
  """Whether bars are drawn. stdout_is_output: stdout carries the mode's results, not a log."""
  forced = os.environ.get(ENV, "")
  if forced in ("0", "1"):
    return forced == "1"
  try:
    return sys.stderr.isatty() and (stdout_is_output or sys.stdout.isatty())
  except (AttributeError, ValueError):  # a closed or replaced stream
    return False


def bar(iterable=None, total=None, desc: str = "", unit: str = "it", initial: int = 0,
        stdout_is_output: bool = False, **kwargs):
  """A tqdm bar on stderr (disabled, and then free, when `enabled()` is false) over `iterable`,
  or updated by hand; close it, or use it as a context manager. total None: a count with its
  rate and no ETA."""
  from tqdm import tqdm  # imported here: most commands draw no bar
  options = {"dynamic_ncols": True, "mininterval": 0.5, "smoothing": 0.1, **kwargs}
  options.setdefault("disable", not enabled(stdout_is_output))
  return tqdm(iterable, total=total, desc=desc, unit=unit, initial=initial, file=sys.stderr,
              leave=False, **options)


@contextlib.contextmanager
def waiting(desc: str):
  """A bar for a step that reports no progress of its own (compiling, training a tokenizer):
  the elapsed time, refreshed twice a second."""
  if not enabled():
    yield
    return
  with bar(desc=desc, bar_format="{desc}: {elapsed}") as shown:
    done = threading.Event()

    def tick():
      while not done.wait(0.5):
        shown.refresh()

    thread = threading.Thread(target=tick, daemon=True)
    thread.start()
    try:
      yield
    finally:
      done.set()
      thread.join()


def write(line: str) -> None:
  """Prints a log line on stdout, above any bar being drawn."""
  if enabled():
    from tqdm import tqdm  # see bar()
    tqdm.write(line, file=sys.stdout)
    sys.stdout.flush()
  else:
    print(line, flush=True)


def duration(seconds: float) -> str:
  """3m20s, 1h02m00s."""
  seconds = int(max(seconds, 0))
  h, rem = divmod(seconds, 3600)
  m, s = divmod(rem, 60)
  return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"
