"""Long outages of a bucket's store at chosen moments of a run (issue 55): the rows of
docs/storage.md.

  python -m benchmarks.storage_outage STORE:MOMENT:DOWN_S[:BOUND_S] ... [--jobs=N]

Each row trains the tests' small run (tests/test_checkpoint.py's RUN: 8 steps, every step
checkpointed) into gs://bucket/... or s3://bucket/... on the tests' emulators (tests/emulators.py,
each row its own), behind a relay that refuses and cuts connections (emulators.Outage) for
DOWN_S seconds from MOMENT, with train.storage_outage_s=BOUND_S (default 300). MOMENT:

  step-N       once step N is logged (between steps: every request cut)
  arrays-N     inside checkpoint N's array write (TensorStore's uploads)
  metadata-N   inside checkpoint N's _CHECKPOINT_METADATA upload (orbax, through fsspec)
  commit-N     inside checkpoint N's commit (its item's commit_success.txt); commit-8 is the
               last checkpoint's, written at the run's end
  metrics      inside an upload of a metrics.jsonl chunk (the first)
  events       inside an upload of a TensorBoard event file (the first)
  eval         inside the upload of the final evaluation's results (eval/...)
  summary      inside the upload of summary.md, the run's last file

Printed per row, as a Markdown table row: the exit code; inside the bound, whether the final
parameters and optimizer state equal an uninterrupted local run's bit for bit; past it (exit 2),
whether the last complete checkpoint reads back whole and whether the same command, run again
once the store answers, ends with exit 0 and bitwise equal; the run's own outage and error lines
(shortened); its wall time. Rows run --jobs at a time; they mostly wait, so several fit on two
cores.

The issue's long outages (at least 10 moments per store, up to 200 s, the bound 300 s, and past
it), as docs/storage.md ran them:
  python -m benchmarks.storage_outage gs:step-2:200 gs:arrays-1:70 ... --jobs=4
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import os
import re
import sys
import tempfile
import time

# tests/ is not a package: test_checkpoint.py imports launcher.py by its own name.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tests"))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from launcher import Launcher, environment  # noqa: E402
from test_checkpoint import RUN, last_logged_step  # noqa: E402

from tests import emulators  # noqa: E402

UPLOAD = {"gs": "/upload/", "s3": "PUT /"}  # a request that writes an object
MOMENTS = {  # MOMENT (N: a step) -> the object whose upload takes the store down
    "arrays": "checkpoints/{}/state/ocdbt.process_0/d/",
    "metadata": "checkpoints/{}/_CHECKPOINT_METADATA",
    "commit": "checkpoints/{}/meta/commit_success.txt",
    "metrics": "metrics.jsonl.parts/", "events": "tensorboard/events.out.tfevents",
    "eval": "/eval/", "summary": "summary.md"}


def _leaves(workdir: str) -> list:
  from test_bucket_workdir import restore_latest
  restored = restore_latest(workdir)
  return [restored.step] + [np.asarray(x) for x in jax.tree.leaves(restored.state)]


def reference() -> list:
  """The final state of the same run, uninterrupted, in a local workdir."""
  workdir = os.path.join(tempfile.mkdtemp(), "reference")
  server = Launcher(environment(tempfile.mkdtemp()), tempfile.mkdtemp())
  code, out, err = server.run(*RUN, f"--workdir={workdir}")
  server.close()
  assert code == 0, err[-2000:]
  return _leaves(workdir)


def _same(workdir: str, expected: list) -> bool:
  leaves = _leaves(workdir)
  return len(leaves) == len(expected) and all(np.array_equal(a, b)
                                              for a, b in zip(leaves, expected))


def _said(err: str) -> str:
  """The run's own outage and error lines, shortened for a table cell."""
  lines = [line.strip() for line in err.splitlines()
           if line.startswith(("error:", "warning:")) and "answer" in line
           or "answers again" in line]
  short = [re.sub(r"https?://127\.0\.0\.1:\d+", "the store", line) for line in lines]
  return " / ".join(s[:70] + ("..." if len(s) > 70 else "") for s in short).replace("|", "/")


def row(spec: str, expected: list) -> str:
  store, moment, down, *bound = spec.split(":")
  down, bound = float(down), float(bound[0]) if bound else 300.0
  kind, _, step = moment.partition("-")
  started = time.time()
  with emulators.gcs() as gcs_url, emulators.s3() as s3_url:
    relay = emulators.Outage(gcs_url if store == "gs" else s3_url)
    env = {**environment(tempfile.mkdtemp()),
           **(emulators.environment(relay.url) if store == "gs" else
              emulators.environment(None, relay.url))}
    if store == "gs":
      env.update(TENSORSTORE_GCS_HTTP_URL=relay.url, GOOGLE_AUTH_TOKEN_FOR_TESTING="anonymous")
    os.environ.update(emulators.environment(gcs_url, s3_url))
    emulators.make_bucket(f"{store}://bucket")
    workdir = f"{store}://bucket/outage"
    command = (*RUN, f"--workdir={workdir}", f"--config.train.storage_outage_s={bound:g}")
    server = Launcher(env, tempfile.mkdtemp())
    if kind != "step":
      relay.trip(((UPLOAD[store], MOMENTS[kind].format(step)), down))
    server.start(*command)
    if kind == "step":
      assert server.wait_for(lambda out: last_logged_step(out) >= int(step))
      relay.down()
      deadline = time.time() + down
      while time.time() < deadline:
        try:
          os.kill(server.pid, 0)
        except ProcessLookupError:
          break
        time.sleep(0.2)
      relay.up()
    code = server.wait()
    err = server.output()[1]
    tripped = kind == "step" or bool(relay.tripped)
    relay.trip()
    relay.up()  # a run that gave up ended with the store still down
    if code == 0:
      verdict = "bitwise equal" if _same(workdir, expected) else "**differs**"
    else:
      try:
        kept = f"last checkpoint (step {_leaves(workdir)[0]}) reads back whole"
      except Exception as e:  # noqa: BLE001 - a row reports what it found
        kept = f"**no readable checkpoint** ({type(e).__name__}: {str(e)[:80]})"
      again, _, again_err = server.run(*command)
      resumed = (("bitwise equal" if _same(workdir, expected) else "**differs**")
                 if again == 0 else f"**exit {again}** ({_said(again_err)})")
      verdict = f"{kept}; the same command again: exit {again}, {resumed}"
    server.close()
    relay.close()
  if not tripped:
    verdict += " (**the moment never came**: no outage)"
  return (f"| {store}:// | {moment} | {down:.0f} s | {bound:.0f} s | {code} | {verdict} | "
          f"{_said(err)} | {time.time() - started:.0f} s |")


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("rows", nargs="+", help="STORE:MOMENT:DOWN_S[:BOUND_S], STORE gs or s3")
  parser.add_argument("--jobs", type=int, default=2)
  args = parser.parse_args(argv)
  for spec in args.rows:  # refused before anything runs
    store, moment = spec.split(":")[:2]
    kind, _, step = moment.partition("-")
    if store not in UPLOAD or kind not in {"step", *MOMENTS} or (kind in (
        "step", "arrays", "metadata", "commit") and not step.isdigit()):
      parser.error(f"{spec}: not STORE:MOMENT:DOWN_S[:BOUND_S] (see --help)")
  expected = reference()
  print("| store | moment | down | train.storage_outage_s | exit | final state | the run's lines "
        "| wall |\n| --- | --- | ---: | ---: | ---: | --- | --- | ---: |", flush=True)
  # Processes, not threads: each row points os.environ at its own emulators. A process a row:
  # TensorStore reads its GCS endpoint once per process.
  context = multiprocessing.get_context("spawn")
  with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=context,
                                              max_tasks_per_child=1) as pool:
    for line in pool.map(row, args.rows, [expected] * len(args.rows)):
      print(line, flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
