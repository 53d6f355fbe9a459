"""Training throughput with the metrics going to a gs:// bucket against a local workdir.

  python benchmarks/bucket_logging.py [STEPS] [--rounds=N] [launch.py flags ...]
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

import json
import os
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tests import emulators  # noqa: E402
from transformer_jax.core import jsonlog, storage  # noqa: E402


def run(workdir: str, steps: int, extra: list, env: dict) -> float:
  flags = ["--config=experiments/tiny.py", "--mode=train", f"--workdir={workdir}",
           f"--config.train.steps={steps}", "--config.train.log_every=1",
           f"--config.train.checkpoint_every={steps}", f"--config.train.eval_every={steps}",
           "--config.eval.max_examples=8", *extra]
  subprocess.run([sys.executable, os.path.join(REPO, "launch.py"), *flags], env=env, check=True,
                 stdout=subprocess.DEVNULL)
  records = jsonlog.read_jsonl(storage.join(workdir, "metrics.jsonl"))
  rates = [r["steps_per_s"] for r in records if r.get("split") == "train" and r["step"] > 20]
  return statistics.median(rates)


def main(steps: int = 300, *extra) -> None:
  rounds = [int(flag.split("=", 1)[1]) for flag in extra if flag.startswith("--rounds=")]
  extra = [flag for flag in extra if not flag.startswith("--rounds=")]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  rates = {"local disk": [], "gs://": []}
  with emulators.gcs() as url, tempfile.TemporaryDirectory() as local:
    os.environ.update(emulators.environment(url))
    env.update(emulators.environment(url))
    emulators.make_bucket("gs://bench")
    for n in range(rounds[-1] if rounds else 1):
      for name, workdir in (("local disk", os.path.join(local, f"run{n}")),
                            ("gs://", f"gs://bench/run{n}")):
        rates[name].append(run(workdir, int(steps), extra, env))
        print(json.dumps({"round": n, "workdir": name,
                          "median_steps_per_s": round(rates[name][-1], 2)}), flush=True)
  ratios = [g / loc for loc, g in zip(rates["local disk"], rates["gs://"])]
  print(json.dumps({"rounds": len(ratios),
                    **{f"{name} median_steps_per_s": round(statistics.median(r), 2)
                       for name, r in rates.items()},
                    "median ratio gs:// / local": round(statistics.median(ratios), 3),
                    "ratios": [round(r, 3) for r in ratios]}), flush=True)


if __name__ == "__main__":
  main(*sys.argv[1:])
