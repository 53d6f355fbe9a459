"""Training throughput of the tiny model with each experiment tracker on and off, in one run.

  python -m benchmarks.trackers [BLOCKS [LOG_EVERY [INTERVAL_S]]]   (default: 40 100, the config's)

One process trains experiments/tiny.py (its train step and batches, as train/loop.py runs them)
through four MetricLoggers at once, each with its own workdir: TensorBoard alone (today's
default, "off"), with MLflow (a real `mlflow server` with a SQLite store, started here on
127.0.0.1), with W&B (offline mode: no network), and with both. Training alternates between
them in blocks of 2 x LOG_EVERY steps, each logger logging every LOG_EVERY steps of its blocks
(train.log_every's default: 100), the four in a new order each round, so that the machine's
load (it is shared) falls on all four alike. A block is timed from its first step's dispatch to
its last step's result. Prints one JSON line per setup: its steps/s over its BLOCKS blocks, the
ratio to "off"'s, and the training thread's own time in each log call (MetricLogger.train: the
log line, metrics.jsonl, TensorBoard, and handing the record to the trackers' queues).
INTERVAL_S: train.tracker_interval_s, the least time between two sends of scalars to a tracker
(0: each log step at once; left out: the config's default, 2).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

from transformer_jax import config as config_lib  # noqa: E402
from transformer_jax.data import pipeline, prepare  # noqa: E402
from transformer_jax.experiments import tiny  # noqa: E402
from transformer_jax.train import actions, sharding  # noqa: E402
from transformer_jax.train import state as state_lib  # noqa: E402
from transformer_jax.train import step as step_lib  # noqa: E402
from transformer_jax.train.logger import MetricLogger  # noqa: E402

SETUPS = {"off": "tensorboard", "mlflow": "tensorboard,mlflow", "wandb": "tensorboard,wandb",
          "both": "tensorboard,mlflow,wandb"}


def mlflow_server(directory: str) -> tuple:
  """`mlflow server` (SQLite store) on a free port of 127.0.0.1: (process, URI)."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  server = subprocess.Popen(
      [os.path.join(os.path.dirname(sys.executable), "mlflow"), "server", "--backend-store-uri",
       f"sqlite:///{directory}/mlflow.db", "--artifacts-destination", f"{directory}/artifacts",
       "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
      env=dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false"),
      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
  uri = f"http://127.0.0.1:{port}"
  for _ in range(600):
    try:
      with urllib.request.urlopen(f"{uri}/health", timeout=2):
        return server, uri
    except OSError:
      time.sleep(0.2)
  raise RuntimeError("mlflow server did not start")


def main(blocks: int = 40, log_every: int = 100, interval_s: float | None = None) -> None:
  directory = tempfile.mkdtemp(prefix="trackers_benchmark_")
  server, uri = mlflow_server(directory)
  try:
    config = tiny.get_config()
    config.train.log_every = log_every
    if interval_s is not None:
      config.train.tracker_interval_s = interval_s
    config.mlflow.update(tracking_uri=uri, experiment="benchmark")
    config.wandb.update(mode="offline", project="benchmark")
    model_config = config_lib.validate(config)
    _, _, train_set, _ = prepare.prepare_data(config, directory, model_config.vocab_size)
    mesh = sharding.make_mesh(config.mesh.to_dict())
    optimizer = state_lib.make_optimizer(config.train, model_config.d_model)
    train_step = step_lib.make_train_step(model_config, config, mesh)
    state = state_lib.init_state(model_config, optimizer, config.seed, mesh)
    rng = jax.random.PRNGKey(config.seed)
    block = 2 * log_every
    total = ((blocks + 1) * len(SETUPS) + 1) * block
    stream = pipeline.TrainStream(train_set, config.data, config.seed)
    batches = pipeline.batches(stream, 0, total,
                               place=lambda host: sharding.shard_batch(host, mesh))
    loggers = {}
    for name, trackers in SETUPS.items():
      config.train.trackers = trackers
      os.makedirs(os.path.join(directory, name))
      loggers[name] = MetricLogger(os.path.join(directory, name), total_steps=total,
                                   config=config)
    throughput = actions.Throughput(model_config)

    def run(steps: int, logger=None) -> float:
      nonlocal state
      start, metrics = time.perf_counter(), None
      for i in range(1, steps + 1):
        batch = next(batches)
        state, metrics = train_step(state, batch.data, rng)
        throughput.count(batch.tokens, batch.shape, compiled=False)
        if logger is not None and i % log_every == 0:  # as the loop logs
          logged = {k: v for k, v in jax.device_get(metrics).items() if k != "finite"}
          called = time.perf_counter()
          logger.train(int(state.step), logged, 1e-3, **throughput.take())
          in_logger[logger] = in_logger.get(logger, 0.0) + time.perf_counter() - called
      jax.block_until_ready(metrics)
      return time.perf_counter() - start

    in_logger = {}  # seconds the training thread spent in each logger's train()
    run(block)  # compiles
    for logger in loggers.values():  # untimed: the trackers open their runs meanwhile
      run(block, logger)
    in_logger.clear()
    seconds = dict.fromkeys(SETUPS, 0.0)
    names = list(SETUPS)
    for round_ in range(blocks):
      for name in names[round_ % 4:] + names[:round_ % 4]:
        seconds[name] += run(block, loggers[name])
    batches.close()
    for logger in loggers.values():
      logger.close()
  finally:
    os.killpg(server.pid, signal.SIGTERM)
    server.wait()
    shutil.rmtree(directory, ignore_errors=True)
  for name in SETUPS:
    print(json.dumps({"trackers": SETUPS[name], "steps": blocks * block,
                      "steps_per_s": round(blocks * block / seconds[name], 1),
                      "ratio_to_off": round(seconds["off"] / seconds[name], 4),
                      "ms_per_log_call": round(1000 * in_logger[loggers[name]] / (2 * blocks), 3)}),
          flush=True)


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("blocks", nargs="?", type=int, default=40)
  parser.add_argument("log_every", nargs="?", type=int, default=100)
  parser.add_argument("interval_s", nargs="?", type=float, help="(default: the config's)")
  main(**vars(parser.parse_args()))
