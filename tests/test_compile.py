"""--mode=compile: the train and decode steps compiled for a TPU slice on this CPU machine.

What cannot compile (an unknown topology, a mesh that does not divide the slice, a step that
does not fit) has its rows in test_errors.py."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from transformer_jax.model.flops import CHIPS, Chip
from transformer_jax.tools import compile as compile_lib

REPO = pathlib.Path(__file__).resolve().parents[1]
# A tiny model whose every split dimension divides 2: d_model 32, 4 heads, d_ff 64, vocab 32.
TINY = ["--config=experiments/tiny.py", "--mode=compile", "--config.model.num_heads=4"]


def launch(*flags):
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}  # as a user runs it
  return subprocess.run([sys.executable, "launch.py", *flags], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=300)


def test_estimate_takes_the_cost_model_or_else_a_roofline():
  v5e = dict(CHIPS)["TPU v5 lite"]
  assert compile_lib.estimate_seconds({"optimal_seconds": 0.25}, v5e)[0] == 0.25
  # A negative time (each op XLA cannot estimate adds -1): the roofline, here compute-bound.
  seconds, method = compile_lib.estimate_seconds(
      {"optimal_seconds": -3.0, "flops": 197e12, "bytes accessed": 0.819e12 / 2}, v5e)
  assert seconds == pytest.approx(1.0) and "compute-bound" in method
  seconds, method = compile_lib.estimate_seconds(
      {"flops": 197e12 / 4, "bytes accessed": 2 * 0.819e12}, v5e)
  assert seconds == pytest.approx(2.0) and "bandwidth-bound" in method


def test_every_chip_has_its_spec():
  for _, chip in CHIPS:
    assert isinstance(chip, Chip) and chip.peak_flops > 1e14 and chip.hbm_bytes > 1e10


def test_compile_mode_reports_memory_flops_and_estimates_for_a_slice():
  pytest.importorskip("libtpu")
  result = launch(*TINY, "--config.compile.topology=v5e:2x2", "--config.mesh.data=1",
                  "--config.mesh.fsdp=2", "--config.mesh.tensor=2",
                  "--config.compile.batch_size=16")
  assert result.returncode == 0, result.stderr
  assert result.stderr == ""  # no TPU runtime warnings reach the user
  lines = result.stdout.strip().splitlines()
  report = json.loads(lines[-1])
  text = "\n".join(lines[:-1])
  assert "not measurements" in text and "fits" in text
  assert report["chips"] == 4 and report["chip"] == "TPU v5e"
  assert report["mesh"] == {"data": 1, "fsdp": 2, "tensor": 2}
  train = report["train"]
  assert train["fits"] and 0 < train["total_bytes"] < train["hbm_bytes"]
  # 22,400 float32 parameters, split 4 ways where both fsdp and tensor divide (most of them).
  assert 22_400 * 4 / 4 <= train["params_bytes"] < 22_400 * 4 / 2
  assert train["optimizer_bytes"] >= 2 * train["params_bytes"]  # Adam's two moments
  # The compiled step does the model's matrix products, plus the small rest (norms, softmax).
  assert 0.9 < train["compiled_flops"] / train["model_flops"] < 1.6
  assert train["step_s"] > 0 and 0 < train["mfu"] < 1 and train["target_tokens_per_s"] > 0
  assert report["decode"]["fits"] and report["decode"]["tokens_per_s"] > 0


def test_compile_mode_compiles_a_decoder_only_model_with_its_prompt_cache():
  pytest.importorskip("libtpu")
  result = launch(*TINY, "--config.compile.topology=v5e:2x2", "--config.compile.batch_size=16",
                  "--config.model.arch=decoder_only", "--config.model.num_kv_heads=2",
                  "--config.model.positional=relative_bias")
  assert result.returncode == 0, result.stderr
  report = json.loads(result.stdout.strip().splitlines()[-1])
  train = report["train"]
  assert train["batch"] == "16 rows x (source 12 + target 50)"  # one sequence of both
  assert 0.9 < train["compiled_flops"] / train["model_flops"] < 1.6
  assert report["decode"]["fits"] and report["decode"]["tokens_per_s"] > 0
