"""Sweeps on a tiny task (experiments/tiny.py on SCAN): what a learning sampler and a pruner buy.

  --what=samplers  TPE against random search at the same budget: the best final loss of each
                   sweep, the median over --repeats sweep seeds
  --what=pruners   ASHA against no pruning, the same random trials (same sampler seed): train
                   steps trained in all, the best final loss, and whether the best trial of the
                   unpruned sweep also finished under ASHA
  --what=parallel  TPE against random as a user runs them: `launch.py --sweep` with
                   --sweep_parallel=--workers worker processes on the journal file, --budget
                   trials; per sweep seed, the wall time from the sweep's start until a finished
                   trial reached the worse of the two samplers' best values (a value both
                   reach), and how many drawn trials were distinct
  --what=overhead  the storage's cost per trial (ask, 10 reports and pruner questions, tell,
                   with heartbeats), on the journal file and on PostgreSQL (--storage=URL)

Each sweep is one worker in this process (tools/sweep/worker.work), its trials trained by
run.train_and_evaluate; prints one JSON line per sweep and a summary.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

from transformer_jax.core import platforms

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
platforms.cpu_only_unless_accelerated()

EXPERIMENT = """from transformer_jax.experiments import tiny
from transformer_jax.tools import sweep

get_config = tiny.get_config


def get_search_space():
  return {"train.learning_rate": sweep.log_uniform(1e-4, 3e-1),
          "train.warmup_steps": sweep.integer(0, 40, step=10)}
"""
BASE = {"train.steps": 60, "train.eval_every": 10, "train.log_every": 10,
        "train.checkpoint_every": 60, "train.keep_best": 0, "eval.max_examples": 32,
        "train.on_nonfinite": "skip"}


def sweep(directory, sampler, pruner, seed, budget, extra=None):
  import optuna

  from transformer_jax import run
  from transformer_jax.tools.sweep import store, worker
  optuna.logging.set_verbosity(optuna.logging.ERROR)
  path = os.path.join(directory, "space.py")
  with open(path, "w", encoding="utf-8") as f:
    f.write(EXPERIMENT)
  workdir = os.path.join(directory, f"{sampler}-{pruner}-{seed}")
  options = worker.Options(sampler=sampler, pruner=pruner, seed=seed, budget=budget)
  p = worker.plan(path, {**BASE, **(extra or {})}, options)
  os.makedirs(workdir)
  st = store.open_storage(None, workdir, 60, 0)
  study = worker.join_study(p, workdir, st)
  start = time.time()
  worker.work(p, workdir, study, st, run.train_and_evaluate)
  trials = study.get_trials()
  steps = sum(t.user_attrs.get("sweep_pruned_step", BASE["train.steps"]) for t in trials
              if t.state.name in ("COMPLETE", "PRUNED", "FAIL"))
  finished = [t for t in trials if t.state.name == "COMPLETE"]
  best = min(finished, key=lambda t: t.value) if finished else None
  return {"sampler": sampler, "pruner": pruner, "seed": seed, "trials": len(trials),
          "finished": len(finished), "pruned": sum(t.state.name == "PRUNED" for t in trials),
          "steps": steps, "best_loss": best.value if best else None,
          "best_params": best.params if best else None,
          "finished_params": [t.params for t in finished], "wall_s": round(time.time() - start)}


def overhead(url, trials=50, reports=10):
  """Seconds per trial of the study's own work: ask, reports with pruner questions, tell."""
  import optuna

  from transformer_jax.tools.sweep import store
  optuna.logging.set_verbosity(optuna.logging.ERROR)
  results = {}
  with tempfile.TemporaryDirectory() as directory:
    for name, target in (("journal file", None), ("postgresql", url)):
      if name == "postgresql" and not url:
        continue
      st = store.open_storage(target, directory, 60, 0)
      study = optuna.create_study(study_name=f"overhead-{time.time()}", storage=st.storage,
                                  pruner=optuna.pruners.SuccessiveHalvingPruner())

      def objective(trial):
        x = trial.suggest_float("x", 1e-4, 1e-1, log=True)
        for step in range(reports):
          trial.report(x * (step + 1), step)
          trial.should_prune()
        return x

      start = time.time()
      study.optimize(objective, n_trials=trials)
      results[name] = round((time.time() - start) / trials * 1000, 1)
  return results


def launched(directory, sampler, seed, budget, workers):
  """One sweep as a user runs it (subprocess workers); its finished trials' values and times."""
  import subprocess

  import optuna
  optuna.logging.set_verbosity(optuna.logging.ERROR)
  path = os.path.join(directory, "space.py")
  with open(path, "w", encoding="utf-8") as f:
    f.write(EXPERIMENT)
  workdir = os.path.join(directory, f"parallel-{sampler}-{seed}")
  flags = [f"--config.{k}={v}" for k, v in {**BASE, "train.eval_every": 0}.items()]
  start = time.time()
  subprocess.run([sys.executable, "launch.py", f"--config={path}", f"--workdir={workdir}",
                  "--sweep", f"--config.sweep.sampler={sampler}",
                  f"--config.sweep.sampler_seed={seed}", f"--config.sweep.budget={budget}",
                  f"--sweep_parallel={workers}", *flags],
                 cwd=ROOT, check=True, capture_output=True)
  wall = time.time() - start
  from transformer_jax.tools.sweep import results
  study = results.open_study(workdir, None)
  done = sorted((t for t in study.get_trials() if t.state.name == "COMPLETE"
                 and t.value is not None), key=lambda t: t.datetime_complete)
  drawn = [tuple(sorted(t.params.items())) for t in study.get_trials() if t.params]
  return {"sampler": sampler, "seed": seed, "wall_s": round(wall, 1), "finished": len(done),
          "distinct": f"{len(set(drawn))}/{len(drawn)}",
          "curve": [(t.datetime_complete.timestamp() - start, t.value) for t in done]}


def time_to(curve, target):
  """Seconds from the sweep's start until a finished trial's value was <= target."""
  return next((round(seconds, 1) for seconds, value in curve if value <= target), None)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--what", choices=("samplers", "pruners", "parallel", "overhead"),
                      required=True)
  parser.add_argument("--workers", type=int, default=3, help="for --what=parallel")
  parser.add_argument("--budget", type=int, default=10)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--seed", type=int, default=None, help="run this sweep seed alone")
  parser.add_argument("--storage", default=None, help="a PostgreSQL URL for --what=overhead")
  args = parser.parse_args()
  if args.what == "overhead":
    print(json.dumps({"ms_per_trial": overhead(args.storage)}))
    return
  runs = []
  with tempfile.TemporaryDirectory() as directory:
    if args.what == "parallel":
      seeds = range(args.repeats) if args.seed is None else [args.seed]
      for seed in seeds:
        pair = {s: launched(directory, s, seed, args.budget, args.workers)
                for s in ("tpe", "random")}
        target = max(min(v for _, v in r["curve"]) for r in pair.values())
        for r in pair.values():
          print(json.dumps({k: v for k, v in r.items() if k != "curve"}
                           | {"best_loss": min(v for _, v in r["curve"])}), flush=True)
        print(f"seed {seed}: to loss {target:.4f}: tpe {time_to(pair['tpe']['curve'], target)} s,"
              f" random {time_to(pair['random']['curve'], target)} s (whole sweeps: tpe "
              f"{pair['tpe']['wall_s']} s, random {pair['random']['wall_s']} s)", flush=True)
    elif args.what == "samplers":
      seeds = range(args.repeats) if args.seed is None else [args.seed]
      for seed in seeds:
        for sampler in ("tpe", "random"):
          # No pruner: the final evaluation alone.
          runs.append(sweep(directory, sampler, "none", seed, args.budget,
                            {"train.eval_every": 0}))
          print(json.dumps(runs[-1]), flush=True)
      for sampler in ("tpe", "random"):
        best = [r["best_loss"] for r in runs if r["sampler"] == sampler]
        print(f"{sampler}: best final loss, median of {len(best)} sweeps "
              f"{statistics.median(best):.4f} (each: {', '.join(f'{b:.4f}' for b in best)})")
    else:
      for seed in range(args.repeats):
        plain = sweep(directory, "random", "none", seed, args.budget)
        asha = sweep(directory, "random", "asha", seed, args.budget)
        print(json.dumps(plain), flush=True)
        print(json.dumps(asha), flush=True)
        kept = plain["best_params"] in asha["finished_params"]
        print(f"seed {seed}: steps {plain['steps']} -> {asha['steps']} "
              f"({1 - asha['steps'] / plain['steps']:.0%} fewer); best loss "
              f"{plain['best_loss']:.4f} -> {asha['best_loss']:.4f}; the unpruned best trial "
              f"{'finished' if kept else 'was pruned'} under ASHA", flush=True)


if __name__ == "__main__":
  main()
