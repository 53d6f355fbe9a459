"""Two processes on localhost (CPU, gloo collectives, 2 devices each) train like one 4-device
process, with the parameters split over the devices of both."""

import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

from transformer_jax.eval import load
from transformer_jax.experiments import tiny

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARGS = ["--config=experiments/tiny.py", "--mode=train", "--config.train.steps=3",
        "--config.train.log_every=1", "--config.train.checkpoint_every=3",
        "--config.eval.max_examples=8",
        # The key bias has a zero gradient in exact arithmetic; Adam would amplify its rounding
        # noise (which depends on the reduction order) to +-lr. Without it, all must agree.
        "--config.model.qkv_bias=False"]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _env(devices: int) -> dict:
  return dict(os.environ, JAX_PLATFORMS="cpu",
              XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")


def _train_losses(workdir):
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    return [(r["step"], r["loss"], r["tokens"]) for r in map(json.loads, f)
            if r["split"] == "train"]


def _params(workdir):
  config = tiny.get_config()
  config.model.qkv_bias = False
  return jax.tree.leaves(jax.device_get(load.load_trained(config, str(workdir)).params))


def test_two_processes_match_one_process_with_the_same_global_batch(tmp_path):
  """One process with 4 data-parallel devices against two processes of 2 devices whose mesh
  splits parameters and optimizer state over all 4 (fsdp across both processes)."""
  one, two = tmp_path / "one", tmp_path / "two"
  single = subprocess.Popen([sys.executable, "launch.py", *ARGS, f"--workdir={one}"], cwd=ROOT,
                            env=_env(4), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
  port = _free_port()
  pair = [subprocess.Popen([sys.executable, "launch.py", *ARGS, f"--workdir={two}",
                            "--config.mesh.data=1", "--config.mesh.fsdp=4",
                            f"--coordinator_address=localhost:{port}", "--num_processes=2",
                            f"--process_id={i}"], cwd=ROOT, env=_env(2),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for i in (0, 1)]
  outputs = [p.communicate(timeout=300)[0].decode() for p in [single] + pair]
  for process, output in zip([single] + pair, outputs):
    assert process.returncode == 0, output[-3000:]
  assert "4 device(s) (cpu) in 2 process(es), mesh data 1 x fsdp 4 x tensor 1" in outputs[1]
  assert "Run summary" not in outputs[2]  # only process 0 reports

  losses_one, losses_two = _train_losses(one), _train_losses(two)
  assert [s for s, _, _ in losses_two] == [1, 2, 3]
  for (_, loss_a, tokens_a), (_, loss_b, tokens_b) in zip(losses_one, losses_two):
    assert tokens_a == tokens_b
    assert loss_b == pytest.approx(loss_a, rel=1e-5)
  for a, b in zip(_params(one), _params(two)):
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
