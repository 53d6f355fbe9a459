"""Training throughput of the tiny model with each experiment tracker on and off.

  python benchmarks/trackers.py [STEPS [ROUNDS [LOG_EVERY]]]   (default: 2000 8 100)

Each round trains experiments/tiny.py for STEPS steps (launch.py, a fresh workdir) once with
TensorBoard alone (today's default, "off"), once with MLflow beside it (a real `mlflow server`
with a SQLite store, started here on 127.0.0.1), once with W&B (offline mode: no network) and
once with both; the rounds interleave the four (each in every position in turn) so that the
machine's load falls on all alike, and each round's ratio is to that round's run without.
Throughput is the training clock's (metrics.jsonl: steps over seconds of train steps, the
compiling ones, evaluation and saves left out), at train.log_every=LOG_EVERY (the default: 100).
Prints one JSON line per run, then for each setup the median rate and the median of its ratios.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETUPS = {"off": "tensorboard", "mlflow": "tensorboard,mlflow", "wandb": "tensorboard,wandb",
          "both": "tensorboard,mlflow,wandb"}


def _server(directory: str) -> tuple:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  server = subprocess.Popen(
      [os.path.join(os.path.dirname(sys.executable), "mlflow"), "server", "--backend-store-uri",
       f"sqlite:///{directory}/mlflow.db", "--artifacts-destination", f"{directory}/artifacts",
       "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
  uri = f"http://127.0.0.1:{port}"
  for _ in range(600):
    try:
      with urllib.request.urlopen(f"{uri}/health", timeout=2):
        return server, uri
    except OSError:
      time.sleep(0.2)
  raise RuntimeError("mlflow server did not start")


def train(directory: str, name: str, steps: int, log_every: int, uri: str, env: dict) -> float:
  workdir = os.path.join(directory, name)
  subprocess.run([sys.executable, "launch.py", "--config=experiments/tiny.py", "--mode=train",
                  f"--workdir={workdir}", f"--config.train.steps={steps}",
                  f"--config.train.log_every={log_every}",
                  f"--config.train.checkpoint_every={steps}", "--config.eval.max_examples=8",
                  f"--config.train.trackers={SETUPS[name.split('.')[0]]}",
                  f"--config.mlflow.tracking_uri={uri}", "--config.mlflow.experiment=benchmark",
                  "--config.wandb.mode=offline", "--config.wandb.project=benchmark"],
                 cwd=REPO, env=env, check=True, capture_output=True)
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    train = [r for r in map(json.loads, f) if r["split"] == "train"]
  return sum(r["interval_steps"] for r in train) / sum(r["interval_s"] for r in train)


def main(steps: int = 2000, rounds: int = 8, log_every: int = 100) -> None:
  with tempfile.TemporaryDirectory() as directory:
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               JAX_COMPILATION_CACHE_DIR=os.path.join(directory, "jax_cache"),
               TRANSFORMER_JAX_CACHE=os.path.join(directory, "data_cache"))
    server, uri = _server(directory)
    try:
      rates = {name: [] for name in SETUPS}
      train(directory, "off.warmup", 20, log_every, uri, env)  # the data and compilation caches
      names = list(SETUPS)
      for round_ in range(rounds):
        for name in names[round_ % 4:] + names[:round_ % 4]:  # each setup in each position
          rate = train(directory, f"{name}.{round_}", steps, log_every, uri, env)
          rates[name].append(rate)
          print(json.dumps({"trackers": SETUPS[name], "round": round_, "steps_per_s": rate}),
                flush=True)
    finally:
      os.killpg(server.pid, signal.SIGTERM)
      server.wait()
  for name, values in rates.items():
    # Each round's ratio to the same round's run without trackers (the load of the machine at
    # that time), then their median.
    ratios = [value / off for value, off in zip(values, rates["off"])]
    print(json.dumps({"trackers": SETUPS[name],
                      "median_steps_per_s": round(statistics.median(values), 1),
                      "median_ratio_to_off": round(statistics.median(ratios), 4),
                      "ratios": [round(r, 3) for r in ratios]}), flush=True)


if __name__ == "__main__":
  main(*map(int, sys.argv[1:]))
