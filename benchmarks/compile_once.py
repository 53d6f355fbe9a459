"""Compile once: the start-up of sweep trials and of a second process, against today's code.

  python -m benchmarks.compile_once sweep OUT [--checkout DIR]   # 40 trials, 3 workers
  python -m benchmarks.compile_once second OUT [--checkout DIR]  # base benchmark, two processes

`--checkout DIR` runs the same commands with another checkout of the project (e.g. the commit
before compile-once, `git worktree add DIR COMMIT`), in the same environment, for the ratio.

sweep: `experiments/tiny.py` swept with `--sweep --config.sweep.budget=40 --sweep_parallel=3`,
10 steps a trial (the learning rate and d_ff drawn: tiny's search space), in OUT/sweep (a
journal study, one machine). A trial's start-up is measured the same way for both checkouts,
from the files a trial writes: from trial.json (written as the trial starts) to its first train
record, less that record's timed steps (interval_s): set-up and the first step's compile. The
first trial of each shape in each worker process is counted apart ("first"); the others are
"after".

second: `launch.py --config=experiments/base.py --mode=benchmark` twice, each a new process, with
the compilation cache in OUT/xla (emptied first): each process's set-up and compile (the
benchmark's setup_s and compile_s: tracing, lowering and compiling or loading), and the
second's share of the first's.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import statistics
import time

from benchmarks.common import ROOT, last_json, launch
from transformer_jax.train.logger import read_metrics


def _environment(checkout: pathlib.Path, **extra) -> dict:
  env = dict(os.environ, **extra)
  if checkout != ROOT:  # that checkout's package first
    env["PYTHONPATH"] = str(checkout)
  return env


def trial_startups(sweep: pathlib.Path) -> list[dict]:
  """Each trial's start-up (seconds), its shape (model.d_ff) and start time, from its files."""
  rows = []
  for trial in sorted(sweep.glob("trial_*")):
    started = (trial / "trial.json").stat().st_mtime
    overrides = json.loads((trial / "trial.json").read_text()).get("overrides", {})
    records = read_metrics(str(trial))
    first = next(r for r in records if r.get("split") == "train")
    steps_s = first.get("interval_s", 0.0)
    rows.append({"trial": trial.name, "shape": overrides.get("model.d_ff"), "start": started,
                 "startup_s": first["time"] - steps_s - started,
                 "recorded_s": next((r["startup_s"] for r in records
                                     if r.get("split") == "startup"), None)})
  return rows


def sweep(out: pathlib.Path, checkout: pathlib.Path) -> dict:
  workdir = out / "sweep"
  shutil.rmtree(workdir, ignore_errors=True)
  # A checkout from before the sweep's settings moved into the config takes --sweep_budget.
  keyed = "c.sweep = " in (checkout / "transformer_jax" / "config.py").read_text()
  budget = "--config.sweep.budget=40" if keyed else "--sweep_budget=40"
  start = time.perf_counter()
  launch("--config=experiments/tiny.py", f"--workdir={workdir}", "--sweep", budget,
         "--sweep_parallel=3", "--config.train.steps=10", cwd=checkout,
         env=_environment(checkout))
  wall = time.perf_counter() - start
  rows = trial_startups(workdir)
  # A worker's first trial of a shape: which worker ran a trial is not recorded by today's code,
  # so the first three trials of each shape (3 workers) count as firsts.
  seen: dict = {}
  for row in sorted(rows, key=lambda r: r["start"]):
    seen[row["shape"]] = seen.get(row["shape"], 0) + 1
    row["first"] = seen[row["shape"]] <= 3
  after = [r["startup_s"] for r in rows if not r["first"]]
  first = [r["startup_s"] for r in rows if r["first"]]
  return {"trials": len(rows), "wall_s": wall,
          "median_startup_after_first_s": statistics.median(after) if after else None,
          "median_startup_first_s": statistics.median(first) if first else None,
          "median_recorded_startup_after_first_s": statistics.median(
              [r["recorded_s"] for r in rows if not r["first"] and r["recorded_s"] is not None]
              or [float("nan")])}


def second(out: pathlib.Path, checkout: pathlib.Path) -> dict:
  cache = out / "xla"
  shutil.rmtree(cache, ignore_errors=True)
  results = []
  for _ in range(2):
    result = last_json(launch(
        "--config=experiments/base.py", "--mode=benchmark", "--config.benchmark.steps=2",
        "--config.benchmark.warmup=1", "--config.benchmark.decode_steps=0", cwd=checkout,
        env=_environment(checkout, TRANSFORMER_JAX_COMPILE_CACHE=str(cache))))
    result["startup_s"] = result.get("setup_s", 0.0) + result["compile_s"]
    results.append({k: result.get(k) for k in ("startup_s", "setup_s", "compile_s", "trace_s",
                                               "lower_s", "backend_compile_s", "compile_cache",
                                               "step_ms")})
  return {"first": results[0], "second": results[1],
          "second_share_of_first": results[1]["startup_s"] / results[0]["startup_s"]}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("what", choices=("sweep", "second"))
  parser.add_argument("out", type=pathlib.Path)
  parser.add_argument("--checkout", type=pathlib.Path, default=ROOT)
  args = parser.parse_args()
  args.out.mkdir(parents=True, exist_ok=True)
  result = (sweep if args.what == "sweep" else second)(args.out.resolve(),
                                                       args.checkout.resolve())
  print(json.dumps({"what": args.what, "checkout": "this" if args.checkout.resolve() == ROOT
                    else "other", **result}, indent=2))


if __name__ == "__main__":
  main()
