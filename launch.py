"""Entry point: flags -> one library call per mode.

  python launch.py --config=experiments/scan_simple.py --workdir=runs/scan --mode=train
  python launch.py --config=experiments/base.py --mode=describe
  python launch.py --config=experiments/base.py --config.model.d_model=256 --mode=describe

Errors the user can fix are printed as one line `error: ...` with exit code 2.
"""

import logging
import sys

from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags

from transformer_jax.errors import UserError

MODES = ("describe", "train", "evaluate", "export")

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file (experiments/*.py).",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, logs and the tokenizer.")
_MODE = flags.DEFINE_string("mode", "train", f"One of: {', '.join(MODES)}.")
_SPLIT = flags.DEFINE_string("split", "train", "Data split for --mode=export.")
_CHECKPOINT_STEP = flags.DEFINE_integer("checkpoint_step", None,
                                        "Checkpoint to evaluate (default: the latest).")


def _fail(message: str) -> None:
  print(f"error: {message}", file=sys.stderr)
  sys.exit(2)


def _parse_flags(argv):
  """absl parsing, with every flag error turned into one line and exit code 2."""
  try:
    remaining = flags.FLAGS(argv)
  except flags.Error as e:
    _fail(str(e).splitlines()[0] + " (see --helpfull)")
  except (AttributeError, KeyError) as e:  # ml_collections: an override names no config key
    bad = [a for a in argv if a.startswith("--config.")]
    _fail(f"unknown config key {str(e).strip(chr(34) + chr(39))!r} in {' '.join(bad)}; "
          "see the experiment file for the keys that exist")
  except Exception as e:  # pylint: disable=broad-except  # a config file that fails to import
    _fail(f"cannot load --config: {type(e).__name__}: {str(e).splitlines()[-1].strip()}")
  try:
    if _CONFIG.value is not None:
      _CONFIG.value.get("seed")  # config files load lazily; surface a bad path or broken file now
  except Exception as e:  # pylint: disable=broad-except  # anything a broken config file raises
    _fail(f"cannot load --config: {str(e).splitlines()[-1].strip()}; check the path")
  return remaining


def run(argv) -> None:
  if len(argv) > 1:
    raise UserError(f"unexpected arguments {' '.join(argv[1:])}; flags look like --name=value")
  if _CONFIG.value is None:
    raise UserError("--config is required, e.g. --config=experiments/scan_simple.py")
  mode = _MODE.value
  if mode not in MODES:
    raise UserError(f"--mode must be one of {', '.join(MODES)}; got {mode!r}")
  config = _CONFIG.value

  # Imported here so that `--help` and flag errors answer without loading JAX.
  from transformer_jax import config as config_lib
  from transformer_jax import model as model_lib

  if mode == "describe":
    print(model_lib.describe(config_lib.validate(config)))
    return
  if mode == "export":
    from transformer_jax import data
    config_lib.validate(config)
    data.export_split(config, _SPLIT.value, sys.stdout)
    return
  if _WORKDIR.value is None:
    raise UserError(f"--workdir is required for --mode={mode}")
  if mode == "train":
    from transformer_jax import train
    train.train_and_evaluate(config, _WORKDIR.value)
  elif mode == "evaluate":
    from transformer_jax import evaluate
    evaluate.evaluate_from_workdir(config, _WORKDIR.value, step=_CHECKPOINT_STEP.value)


def main(argv) -> None:
  # INFO from JAX and orbax ("no TPU found", every checkpoint file) buries the training log.
  absl_logging.set_verbosity(absl_logging.WARNING)
  logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
  try:
    run(argv)
  except UserError as e:
    _fail(str(e))


if __name__ == "__main__":
  app.run(main, flags_parser=_parse_flags)
