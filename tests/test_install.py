"""`pip install .` (not editable) gives a package that trains, sweeps and benchmarks from any
directory: nothing in it reaches into the checkout.

The project is installed without its dependencies into a folder of its own; the dependencies come
from the test environment. The commands run from a directory outside the checkout, so neither the
working directory nor the editable install of the test environment can supply the package.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
  target = tmp_path_factory.mktemp("site")
  subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                  "--no-warn-script-location", "--target", str(target), str(ROOT)],
                 check=True, capture_output=True, text=True, timeout=600)
  outside = tmp_path_factory.mktemp("elsewhere")
  env = dict(os.environ, PYTHONPATH=str(target), JAX_PLATFORMS="cpu")
  return target, outside, env


def _run(installed, *args, timeout=300):
  target, outside, env = installed
  return subprocess.run([str(target / "bin" / "transformer-jax"), *args], cwd=outside, env=env,
                        capture_output=True, text=True, timeout=timeout)


def test_the_installed_copy_is_the_one_that_runs(installed):
  target, outside, env = installed
  out = subprocess.run([sys.executable, "-c", "import transformer_jax.experiments as e, "
                        "transformer_jax as t; print(t.__file__); print(e.DIRECTORY)"],
                       cwd=outside, env=env, capture_output=True, text=True, check=True)
  package, experiments = out.stdout.split()
  assert package.startswith(str(target)) and experiments.startswith(str(target))
  assert (target / "transformer_jax" / "experiments" / "tiny.py").is_file()
  assert not (target / "experiments").exists()  # installed inside the package, not top level
  assert (target / "transformer_jax" / "model" / "gpus" / "h100.txtpb").is_file()  # GPU targets


def test_train_from_outside_the_checkout(installed):
  target, outside, _ = installed
  tiny = target / "transformer_jax" / "experiments" / "tiny.py"
  result = _run(installed, f"--config={tiny}", "--workdir=run", "--mode=train",
                "--config.train.steps=4", "--config.train.log_every=2",
                "--config.train.checkpoint_every=4", "--config.eval.max_examples=8")
  assert result.returncode == 0, result.stderr[-3000:]
  assert (outside / "run" / "checkpoints" / "4").is_dir()
  final = json.loads((outside / "run" / "eval" / "4.test.greedy.limit8.json").read_text())
  assert final["examples"] == 8


def test_sweep_dry_run_and_benchmark_by_experiment_name(installed):
  target, outside, _ = installed
  result = _run(installed, "--config=tiny", "--workdir=sweep", "--sweep_dry_run")
  assert result.returncode == 0, result.stderr
  lines = result.stdout.splitlines()
  assert len(lines) == 4  # tiny.py's get_sweep(): a 2 x 2 grid
  tiny = str(target / "transformer_jax" / "experiments" / "tiny.py")
  for line in lines:
    assert f"{sys.executable} -m transformer_jax --config={tiny}" in line
  result = _run(installed, "--config=tiny", "--mode=benchmark", "--config.benchmark.steps=2",
                "--config.benchmark.warmup=1", "--config.benchmark.decode_steps=0")
  assert result.returncode == 0, result.stderr
  assert json.loads(result.stdout.splitlines()[-1])["step_ms"] > 0
