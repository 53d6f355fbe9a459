"""Training throughput with the metrics going to a gs:// bucket against a local workdir.

  python benchmarks/bucket_logging.py [STEPS] [launch.py flags ...]   (default: 300 steps)

Trains the tiny config twice with a record logged every step (`train.log_every=1`: the most
requests a run makes), once into a local workdir and once into the GCS emulator of the tests
(tests/emulators.py) on 127.0.0.1, with no checkpoint before the end. Prints, for each, the
median steps/s of the logged intervals after the first 20 (compilation and warm-up left out):
the uploads run on a background thread, so the two should agree within the machine's noise.
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
from transformer_jax.core import storage  # noqa: E402


def run(workdir: str, steps: int, extra: list, env: dict) -> float:
  flags = ["--config=experiments/tiny.py", "--mode=train", f"--workdir={workdir}",
           f"--config.train.steps={steps}", "--config.train.log_every=1",
           f"--config.train.checkpoint_every={steps}", f"--config.train.eval_every={steps}",
           "--config.eval.max_examples=8", *extra]
  subprocess.run([sys.executable, os.path.join(REPO, "launch.py"), *flags], env=env, check=True,
                 stdout=subprocess.DEVNULL)
  records = storage.read_jsonl(storage.join(workdir, "metrics.jsonl"))
  rates = [r["steps_per_s"] for r in records if r.get("split") == "train" and r["step"] > 20]
  return statistics.median(rates)


def main(steps: int = 300, *extra) -> None:
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  with tempfile.TemporaryDirectory() as local:
    rate = run(os.path.join(local, "run"), int(steps), list(extra), env)
    print(json.dumps({"workdir": "local disk", "median_steps_per_s": round(rate, 2)}), flush=True)
  with emulators.gcs() as url:
    os.environ.update(emulators.environment(url))
    env.update(emulators.environment(url))
    emulators.make_bucket("gs://bench")
    rate = run("gs://bench/run", int(steps), list(extra), env)
    print(json.dumps({"workdir": "gs://", "median_steps_per_s": round(rate, 2)}), flush=True)


if __name__ == "__main__":
  main(*sys.argv[1:])
