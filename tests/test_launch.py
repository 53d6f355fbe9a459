"""launch.py as a user runs it: describe prints the size; user errors are one line, exit code 2."""

import importlib
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from transformer_jax import config as config_lib
from transformer_jax import experiments
from transformer_jax.core import trees
from transformer_jax.tools import sweep

REPO = pathlib.Path(__file__).resolve().parents[1]


def launch(*flags):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "launch.py", *flags], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=120)


def test_describe_prints_the_base_parameter_count():
  result = launch("--config=experiments/base.py", "--mode=describe")
  assert result.returncode == 0, result.stderr
  assert "63,082,496" in result.stdout
  assert "model.vocab_size 37000" in result.stdout  # the embedding rows, named as the key
  assert "Traceback" not in result.stderr


def test_help_lists_the_modes_our_flags_and_the_config_keys_without_importing_jax():
  from transformer_jax import cli
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  result = subprocess.run([sys.executable, "-X", "importtime", "launch.py", "--help"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stderr
  imported = {line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines()
              if line.startswith("import time:")}
  assert imported and not imported & {"jax", "flax", "orbax"}, sorted(imported)
  lines = result.stdout.splitlines()
  for mode in cli.MODES:  # one line each
    assert sum(line.split()[:1] == [mode] for line in lines) == 1, (mode, result.stdout)
  for holder in cli._OUR_FLAGS:
    assert sum(line.split()[:1] == [f"--{holder.name}"] for line in lines) == 1, holder.name
  assert "--mode=config" in result.stdout and "transformer_jax/config.py" in result.stdout
  # The sweep's settings are the config's (sweep.*); only the machine's are flags.
  assert "--config.sweep.budget=N" in result.stdout and "--sweep_budget" not in result.stdout
  assert "Try --helpfull" not in result.stdout
  full = subprocess.run([sys.executable, "launch.py", "--helpfull"], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=120)
  assert full.returncode == 0, full.stderr  # absl's own exits 1
  assert full.stdout.startswith(result.stdout.rstrip("\n"))  # our map first
  assert "--[no]logtostderr" in full.stdout and "--workdir" in full.stdout


def test_mode_config_prints_every_key_with_its_value_and_description():
  result = launch("--config=experiments/scan_simple.py", "--config.model.d_model=64",
                  "--mode=config")
  assert result.returncode == 0, result.stderr
  config = config_lib.default_config()
  keys = [line.split(" = ")[0] for line in result.stdout.splitlines()
          if " = " in line and not line.startswith("#")]
  assert sorted(keys) == sorted(trees.flatten(config.to_dict()))
  line = next(line for line in result.stdout.splitlines() if line.startswith("model.d_model "))
  assert re.fullmatch(r"model\.d_model = 64 +# width of the residual stream .*", line), line
  assert "(no description)" not in result.stdout


def test_every_config_key_has_a_description():
  """The comments of default_config() and ModelConfig describe every key (--mode=config)."""
  descriptions = config_lib.key_descriptions()
  keys = trees.flatten(config_lib.default_config().to_dict())
  assert [key for key in keys if not descriptions.get(key)] == []
  assert descriptions["model.d_ff"].startswith("hidden units")  # the field's own comment
  assert descriptions["data.task"].startswith("What an example is")  # the block above the key
  assert "#" not in descriptions["data.format"]  # block and end-of-line comments, one line


def test_a_cpu_machine_runs_on_the_cpu_without_tpu_runtime_warnings():
  """libtpu comes with the test extra (to compile for TPU slices); without JAX_PLATFORMS, a
  machine with no accelerator must not start its runtime (which prints warnings on stderr)."""
  pytest.importorskip("libtpu")
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  result = subprocess.run([sys.executable, "launch.py", "--config=experiments/tiny.py",
                           "--mode=benchmark", "--config.benchmark.steps=1",
                           "--config.benchmark.warmup=0", "--config.benchmark.decode_steps=0"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stderr
  assert result.stderr == ""
  assert '"device": "1 x cpu"' in result.stdout


def test_an_installed_experiment_is_found_by_name():
  by_name = launch("--config=base", "--config.model.d_model=256", "--mode=describe")
  by_path = launch("--config=experiments/base.py", "--config.model.d_model=256",
                   "--mode=describe")
  assert by_name.returncode == 0, by_name.stderr
  assert by_name.stdout == by_path.stdout and "d_model 256" in by_name.stdout


@pytest.mark.parametrize("flags,names", [
    (["--config=experiments/base.py", "--config.model.num_heads=7", "--mode=describe"],
     ["num_heads", "7"]),
    (["--config=experiments/base.py", "--config.model.nope=1", "--mode=describe"], ["nope"]),
    (["--config=experiments/no_such_experiment.py", "--mode=describe"], ["no_such_experiment.py"]),
    (["--config=no_such_name", "--mode=describe"], ["no_such_name", "scan_simple, tiny"]),
    (["--config=experiments/base.py", "--mode=fly"], ["--mode", "fly"]),
])
def test_user_errors_are_one_line_with_exit_code_2(flags, names):
  result = launch(*flags)
  assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1, result.stderr
  assert lines[0].startswith("error:"), result.stderr
  assert "Traceback" not in result.stderr + result.stdout
  for name in names:
    assert name in lines[0]  # the message names what to fix


@pytest.mark.parametrize("name", experiments.names())
def test_every_shipped_recipe_and_its_sweep_validate(name):
  path = os.path.join(experiments.DIRECTORY, f"{name}.py")
  module = importlib.import_module(f"transformer_jax.experiments.{name}")
  config_lib.validate(module.get_config())
  if hasattr(module, "get_sweep"):
    trials = module.get_sweep()
    assert trials and len({json.dumps(t, sort_keys=True) for t in trials}) == len(trials), name
    assert len(sweep.check_trials(path, trials, {})) == len(trials)
