"""Shared fixtures: a tiny model config, parameters that cost no compiled initialiser, the data
cache and the compilation cache of the tests' subprocesses in temporary directories, and
directories built once per test session (a trained workdir that several test files read)."""

import fcntl
import json
import os
import shutil
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from launcher import QUICK_COMPILE

from transformer_jax import cli
from transformer_jax.core import datastack, platforms
from transformer_jax.data import cache
from transformer_jax.model import ModelConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

platforms.cpu_only_unless_accelerated()  # before JAX starts: no TPU runtime warnings

# Before JAX starts too: XLA reads XLA_FLAGS once, when its first backend starts. The tests'
# quick-compiling flags (launcher.QUICK_COMPILE: why) for this process and every process the tests
# start; anything already in XLA_FLAGS is kept.
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {QUICK_COMPILE}".strip()


# The order in which pytest-xdist's workers take the files (`-n 3 --dist loadfile`: Makefile's
# TEST_JOBS): the most expensive first, so that the run does not end with one worker busy on a
# long file while the others wait. The seconds of each file (setup, call and teardown of its
# tests, summed) are measured, not written by hand: file_costs.json beside this file holds
# what the last run with `--record-file-costs` measured (`make file-costs`: the whole suite as
# `make test` runs it, on the 2-core machine). A file it does not list yet goes last, in
# pytest's order. A scheduling hint only: a missing or stale entry changes which worker runs
# what, never a result. Files are named by their path under tests/ (hf/test_x.py for
# tests/hf/test_x.py).
COSTS_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "file_costs.json")


def _read_costs() -> dict:
  try:
    with open(COSTS_FILE, encoding="utf-8") as f:
      return json.load(f)
  except (OSError, ValueError):  # none yet, or damaged: pytest's order, the same results
    return {}


FILE_COST = _read_costs()
TESTS = os.path.dirname(os.path.abspath(__file__))


def _file(item) -> str:
  return os.path.relpath(str(item.path), TESTS)


def pytest_addoption(parser):
  parser.addoption("--record-file-costs", action="store_true",
                   help=f"write the seconds each test file took in this run to {COSTS_FILE} "
                        "(the order and `slow` marks of the next runs); best from a whole run "
                        "of the suite as `make test` runs it")


_spent: dict = {}


def pytest_runtest_logreport(report):
  # In the controller of an xdist run, every worker's reports arrive here too.
  path = report.nodeid.split("::")[0]
  path = path[len("tests/"):] if path.startswith("tests/") else path
  _spent[path] = _spent.get(path, 0.0) + report.duration


def pytest_sessionfinish(session):
  config = session.config
  if not config.getoption("--record-file-costs") or hasattr(config, "workerinput"):
    return
  costs = {path: round(seconds) for path, seconds in
           sorted(_spent.items(), key=lambda entry: (-entry[1], entry[0]))}
  with open(COSTS_FILE, "w", encoding="utf-8") as f:
    json.dump(costs, f, indent=0)
    f.write("\n")


def pytest_configure(config):
  # xdist's default for --dist loadfile orders the files by their number of tests, which puts
  # the few-test expensive files (the GPU suite's dry run, the 8-device run) last.
  if hasattr(config.option, "loadscopereorder"):
    config.option.loadscopereorder = False


# Files at or above this cost are the `slow` ones (`make quick` runs the others: the everyday
# loop; `make test`, and so CI, runs everything).
SLOW_FILE_S = 45


def pytest_collection_modifyitems(config, items):
  items.sort(key=lambda item: -FILE_COST.get(_file(item), 0))  # stable: a file keeps its order
  for item in items:
    if FILE_COST.get(_file(item), 0) >= SLOW_FILE_S:
      item.add_marker(pytest.mark.slow)


# The test processes trace programs as launched runs do: their garbage collector is set as
# cli.py sets a run's (the suite's in-process tests spent about 6% of their CPU in it), and
# what collecting imported (the libraries, the test modules) is frozen out of its scans.
cli.collect_garbage_less_often(freeze=False)


def pytest_collection_finish(session):
  cli.collect_garbage_less_often()


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session):
  # The tests (their fixtures too) run from a frame with room on CPython's frame stack beyond
  # it, as launched runs do (core/datastack.py: test_decode.py 38.5 -> 31.5 CPU-s). The loop
  # itself is pytest's, or a pytest-xdist worker's: every other implementation of this hook.
  loop = session.config.pluginmanager.subset_hook_caller(
      "pytest_runtestloop", remove_plugins=[sys.modules[__name__]])
  return datastack.call(loop, session=session)


@pytest.fixture(autouse=True, scope="session")
def data_cache(tmp_path_factory):
  """The tokenised-data cache of every run in the tests (launch.py subprocesses included, through
  the environment): one temporary directory per test worker, never the user's home."""
  directory = tmp_path_factory.mktemp("data_cache")
  os.environ[cache.ENV] = str(directory)
  return directory


def _session_root(tmp_path_factory):
  """The folder that every test worker of this session shares: pytest-xdist's workers each have
  a temporary directory of their own under a common parent."""
  root = tmp_path_factory.getbasetemp()
  return root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root


# Large enough never to evict anything in a test session; any limit at all (instead of JAX's
# default, none) makes JAX's file cache take a file lock around each read and write, so that
# processes that compile the same program at the same time neither read a half-written entry
# nor write over each other (without it, an entry is written in place, unlocked).
CACHE_LIMIT_BYTES = 16 << 30


@pytest.fixture(autouse=True, scope="session")
def compilation_cache(tmp_path_factory):
  """A persistent compilation cache for every subprocess of the tests (launch.py runs, sweep
  trials, scripts), through the environment: one for the whole session, shared by the test
  workers. A program that several runs compile (the tiny model's train step, its evaluation's
  decoding), in whichever test file and on whichever worker, compiles once; the others read
  it. This process's JAX has read its configuration already and keeps none. Tests that want a
  cache of their own pass one (launcher.environment)."""
  directory = _session_root(tmp_path_factory) / "jax_cache"
  directory.mkdir(exist_ok=True)
  if os.environ.get("TRANSFORMER_JAX_TEST_COMPILE_CACHE") == "off":
    # The suite without a persistent cache (docs/benchmarks.md: Compile once): runs that give
    # no --compile_cache of their own compile everything.
    os.environ["TRANSFORMER_JAX_COMPILE_CACHE"] = "off"
  os.environ.update(JAX_COMPILATION_CACHE_DIR=str(directory),
                    JAX_COMPILATION_CACHE_MAX_SIZE=str(CACHE_LIMIT_BYTES),
                    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                    JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  return directory


@pytest.fixture(scope="session")
def shared_directory(tmp_path_factory):
  """Returns `make(name, build)`: the path `build(path)` made, built once per test session,
  whichever test file asks first, on whichever worker (pytest-xdist's workers share the parent of
  their temporary directories; a file lock makes the others wait for the first). For read-only
  inputs that several test files need, such as a trained workdir: a test that changes one
  works on a copy."""
  root = _session_root(tmp_path_factory)
  (root / "shared").mkdir(exist_ok=True)

  def make(name: str, build):
    path = root / "shared" / name
    with open(root / "shared" / f"{name}.lock", "w") as lock:
      fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
      if not (root / "shared" / f"{name}.done").exists():
        shutil.rmtree(path, ignore_errors=True)  # what a failed build left
        build(path)
        (root / "shared" / f"{name}.done").touch()
    return path

  return make


@pytest.fixture
def tiny_config() -> ModelConfig:
  """2+2 layers, d_model 32, 4 heads (head_dim 8), vocab 50; dropout off."""
  return ModelConfig(vocab_size=50, d_model=32, num_heads=4, num_encoder_layers=2,
                     num_decoder_layers=2, d_ff=64, max_len=32, deterministic=True).validate()


@pytest.fixture
def random_params():
  """Returns `make(init_fn, seed=0)`: NumPy-drawn parameters shaped like `init_fn(rng)["params"]`
  (unboxed: plain arrays without their logical axis names).

  The shapes come from `jax.eval_shape`, so no initialiser is compiled (that dominates the run time
  of tiny-module tests); the values, normal(0, 0.3) and LayerNorm scales near 1, are good enough for
  tests of properties that hold for any parameters.
  """

  def make(init_fn, seed=0):
    shapes = nn.unbox(jax.eval_shape(init_fn, jax.random.PRNGKey(0))["params"])
    rng = np.random.default_rng(seed)

    def draw(path, shape):
      values = rng.normal(0.0, 0.3, shape.shape)
      if getattr(path[-1], "key", "") == "scale":
        values = 1.0 + values
      return jnp.asarray(values, jnp.float32)

    return jax.tree_util.tree_map_with_path(draw, shapes)

  return make


@pytest.fixture(scope="session")
def tiny_run(shared_directory):
  """A workdir of experiments/tiny.py as `launch.py --mode=train` leaves it (20 steps, evaluated
  at steps 10 and 20), trained once per session: test_train's end-to-end test and test_plot work
  on copies of it."""

  def train(workdir):
    subprocess.run([sys.executable, "launch.py", "--config=experiments/tiny.py",
                    f"--workdir={workdir}", "--mode=train", "--config.train.eval_every=10"],
                   check=True, cwd=ROOT, capture_output=True)

  return shared_directory("tiny_run", train)
