"""What the benchmark scripts share: the checkout, launch.py in a subprocess, text files read by
line, outputs cut at their EOS.

The scripts run from the repository root as modules (`python -m benchmarks.NAME`), so that they
import this one as `benchmarks.common`.
"""

import itertools
import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]  # the checkout
MULTI30K = ROOT.parent / "shared" / "data" / "multi30k"  # train/val .en/.de, where it is shared


def launch(*flags, cwd=ROOT, env=None) -> str:
  """`launch.py FLAGS` of the checkout `cwd`, to its end: its stdout. Where it fails, this
  process exits with the end of its output."""
  done = subprocess.run([sys.executable, "launch.py", *flags], cwd=cwd, env=env,
                        capture_output=True, text=True)
  if done.returncode:
    raise SystemExit(f"launch.py {' '.join(flags)} failed:\n{done.stdout[-3000:]}"
                     f"{done.stderr[-3000:]}")
  return done.stdout


def last_json(stdout: str) -> dict:
  """The JSON record a mode prints on its last line (benchmark, compile, evaluate)."""
  return json.loads(stdout.strip().splitlines()[-1])


def lines(path, count=None) -> list[str]:
  """The first `count` (all, if None) non-empty lines of a text file, stripped."""
  with open(path, encoding="utf-8") as f:
    return list(itertools.islice((s for s in map(str.strip, f) if s), count))


def cut(ids, eos) -> list:
  """ids up to (without) the first EOS."""
  ids = list(ids)
  return ids[:ids.index(eos)] if eos in ids else ids

