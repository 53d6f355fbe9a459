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
  tiny = str(target / "transformer_jax" / "experiments" / "tiny.py")
  assert lines[0].startswith(f"sweep of {tiny} in ")
  assert len([line for line in lines if line.startswith("  get_sweep[")]) == 4  # a 2 x 2 grid
  assert not (outside / "sweep").exists()
  result = _run(installed, "--config=tiny", "--mode=benchmark", "--config.benchmark.steps=2",
                "--config.benchmark.warmup=1", "--config.benchmark.decode_steps=0")
  assert result.returncode == 0, result.stderr
  assert json.loads(result.stdout.splitlines()[-1])["step_ms"] > 0


def test_one_tested_jax_for_every_platform():
  """setup.cfg's cpu, cuda12 and tpu extras (and the test extras' libtpu) pin one JAX release,
  inside the range the package asks for; every install command in the docs and gpu.sh's default
  use it, and it is the JAX these tests run on (`make test` installs [cpu,test])."""
  import configparser
  import re

  import jax

  setup = configparser.ConfigParser()
  setup.read(ROOT / "setup.cfg")
  extras = setup["options.extras_require"]
  pins = {}
  for extra in ("cpu", "cuda12", "tpu", "test", "gpu-compile"):
    for line in extras[extra].splitlines():
      found = re.fullmatch(r"(jaxlib|jax(?:\[[\w-]+\])?)\s*(==.*|[<>~!].*)?", line.strip())
      if found:
        pins[f"{extra}: {found[1]}"] = found[2]
  assert set(pins) >= {"cpu: jax", "cpu: jaxlib", "cuda12: jax[cuda12]", "tpu: jax[tpu]",
                       "test: jax[tpu]", "test: jax[cuda12-local]",
                       "gpu-compile: jax[cuda12-local]"}, pins
  assert len(set(pins.values())) == 1 and next(iter(pins.values())).startswith("=="), pins
  version = next(iter(pins.values()))[2:]
  [floor] = re.findall(r"^\s*jax>=([\d.]+)\s*$", setup["options"]["install_requires"], re.M)
  as_tuple = lambda v: tuple(int(x) for x in v.split("."))
  assert as_tuple(floor) <= as_tuple(version), (floor, version)
  assert jax.__version__ == version, f"tests run on jax {jax.__version__}, setup.cfg pins {version}"

  texts = {p: (ROOT / p).read_text() for p in ("README.md", "docs/cloud.md", "docs/benchmarks.md")}
  for path, text in texts.items():
    for spec in re.findall(r"(?<![\w-])jax\[\w+\][^\s'\"`]*", text):
      assert spec.endswith(f"=={version}"), (path, spec)  # no unpinned or other accelerator JAX
  assert f"JAX_VERSION=${{JAX_VERSION:-{version}}}" in (ROOT / "benchmarks" / "gpu.sh").read_text()
