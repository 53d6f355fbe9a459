"""Long outages of a bucket's store mid-run (issue 55): the rows of docs/storage.md.

  python benchmarks/storage_outage.py STORE:STEP:DOWN_S[:BOUND_S] ... [--jobs=N]

Each row trains the tests' small run (tests/test_checkpoint.py's RUN: every step checkpointed,
so an outage that starts once step STEP is logged cuts a checkpoint write) into gs://bucket/...
or s3://bucket/... on the tests' emulators (tests/emulators.py), behind a relay that refuses and
cuts connections for DOWN_S seconds (emulators.Outage), with train.storage_outage_s=BOUND_S
(default 300). Printed per row, as a Markdown table row: the exit code, the run's own outage
lines, and whether its final parameters equal an uninterrupted local run's bit for bit (inside
the bound), or whether its last checkpoint reads back whole (past it). Rows run --jobs at a
time (each with emulators of its own); they mostly wait, so several fit on two cores.

Example (the issue's long outages: at least 10 moments per store, outages up to 200 s):
  python benchmarks/storage_outage.py gs:1:30 gs:3:200 s3:1:70 s3:4:200 gs:2:60:20 --jobs=3
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import os
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests"))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from launcher import Launcher, environment  # noqa: E402
from test_checkpoint import RUN, last_logged_step  # noqa: E402

from tests import emulators  # noqa: E402


def _leaves(workdir: str) -> list:
  from test_bucket_workdir import restore_latest
  restored = restore_latest(workdir)
  return [restored.step] + [np.asarray(x) for x in jax.tree.leaves(restored.state)]


def reference() -> list:
  """The final state of the same run, uninterrupted, in a local workdir."""
  workdir = os.path.join(tempfile.mkdtemp(), "reference")
  server = Launcher(environment(tempfile.mkdtemp()), tempfile.mkdtemp())
  server.start(*RUN, f"--workdir={workdir}")
  assert server.wait() == 0, server.output()[1][-2000:]
  server.close()
  return _leaves(workdir)


def row(spec: str, expected: list) -> str:
  store, step, down = spec.split(":")[:3]
  bound = float(spec.split(":")[3]) if spec.count(":") == 3 else 300.0
  step, down = int(step), float(down)
  with emulators.gcs() as gcs_url, emulators.s3() as s3_url:
    target = gcs_url if store == "gs" else s3_url
    relay = emulators.Outage(target)
    env = {**environment(tempfile.mkdtemp()),
           **(emulators.environment(relay.url) if store == "gs" else
              emulators.environment(None, relay.url)),
           **({"TENSORSTORE_GCS_HTTP_URL": relay.url} if store == "gs" else {})}
    saved = dict(os.environ)
    os.environ.update(emulators.environment(gcs_url, s3_url))
    emulators.make_bucket(f"{store}://bucket")
    workdir = f"{store}://bucket/outage-{step}-{int(down)}"
    server = Launcher(env, tempfile.mkdtemp())
    server.start(*RUN, f"--workdir={workdir}", f"--config.train.storage_outage_s={bound}")
    assert server.wait_for(lambda out: last_logged_step(out) >= step)
    relay.down()
    started = time.time()
    while time.time() - started < down:
      try:
        os.kill(server.pid, 0)
      except ProcessLookupError:
        break
      time.sleep(0.2)
    relay.up()
    code = server.wait()
    err = server.output()[1]
    server.close()
    said = " / ".join(line.strip()[:90] for line in err.splitlines()
                      if "answer" in line or line.startswith("error:"))
    try:
      leaves = _leaves(workdir)
      whole = "reads back whole"
      same = (len(leaves) == len(expected)
              and all(np.array_equal(a, b) for a, b in zip(leaves, expected)))
    except Exception as e:  # noqa: BLE001 - a row reports what it found
      same, whole = False, f"does not read back ({type(e).__name__})"
    relay.close()
    os.environ.clear()
    os.environ.update(saved)
  verdict = ("bitwise equal" if same else "differs") if code == 0 else f"last checkpoint {whole}"
  return (f"| {store}:// | after step {step} | {down:.0f} s | {bound:.0f} s | {code} | {verdict} "
          f"| {said} |")


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("rows", nargs="+", help="STORE:STEP:DOWN_S[:BOUND_S], STORE gs or s3")
  parser.add_argument("--jobs", type=int, default=2)
  args = parser.parse_args(argv)
  expected = reference()
  print("| store | outage starts | down | train.storage_outage_s | exit | final state | "
        "the run's lines |\n| --- | --- | ---: | ---: | ---: | --- | --- |", flush=True)
  # Processes, not threads: each row points os.environ at its own emulators.
  context = multiprocessing.get_context("spawn")
  with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=context) as pool:
    for line in pool.map(row, args.rows, [expected] * len(args.rows)):
      print(line, flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
