"""Training throughput with the metrics going to a gs:// bucket against a local workdir.

  python -m benchmarks.bucket_logging [STEPS] [--rounds=N] [launch.py flags ...]
  (default: 300 steps, 1 round)

Trains the tiny config with a record logged every step (`train.log_every=1`: the most requests a
run makes), into a local workdir and into the GCS emulator of the tests (tests/emulators.py) on
127.0.0.1, with no checkpoint before the end; N rounds of one local run then one gs:// run, so
that a machine whose load drifts weighs on both alike. Prints, for each run, the median steps/s
of the logged intervals after the first 20 (compilation and warm-up left out), then the median
over the rounds of each and of the per-round ratio gs:// / local: the uploads run on a
background thread, so the ratio should be 1 within the machine's noise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

from benchmarks.common import launch
from tests import emulators
from transformer_jax.train.logger import read_metrics


def run(workdir: str, steps: int, extra: list, env: dict) -> float:
  flags = ["--config=experiments/tiny.py", "--mode=train", f"--workdir={workdir}",
           f"--config.train.steps={steps}", "--config.train.log_every=1",
           f"--config.train.checkpoint_every={steps}", f"--config.train.eval_every={steps}",
           "--config.eval.max_examples=8", *extra]
  launch(*flags, env=env)
  records = read_metrics(workdir)
  rates = [r["steps_per_s"] for r in records if r.get("split") == "train" and r["step"] > 20]
  return statistics.median(rates)


def main(steps: int = 300, rounds: int = 1, extra: list = ()) -> None:
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  rates = {"local disk": [], "gs://": []}
  with emulators.gcs() as url, tempfile.TemporaryDirectory() as local:
    os.environ.update(emulators.environment(url))
    env.update(emulators.environment(url))
    emulators.make_bucket("gs://bench")
    for n in range(rounds):
      for name, workdir in (("local disk", os.path.join(local, f"run{n}")),
                            ("gs://", f"gs://bench/run{n}")):
        rates[name].append(run(workdir, steps, list(extra), env))
        print(json.dumps({"round": n, "workdir": name,
                          "median_steps_per_s": round(rates[name][-1], 2)}), flush=True)
  ratios = [g / loc for loc, g in zip(rates["local disk"], rates["gs://"])]
  print(json.dumps({"rounds": len(ratios),
                    **{f"{name} median_steps_per_s": round(statistics.median(r), 2)
                       for name, r in rates.items()},
                    "median ratio gs:// / local": round(statistics.median(ratios), 3),
                    "ratios": [round(r, 3) for r in ratios]}), flush=True)


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
  parser.add_argument("steps", nargs="?", type=int, default=300)
  parser.add_argument("--rounds", type=int, default=1)
  args, extra = parser.parse_known_args()  # the rest: launch.py flags
  main(args.steps, args.rounds, extra)
