"""The config a workdir was trained with: what `--workdir=W` without `--config` loads.

The command line passes `--config=<this file>:W` for a mode that reads a workdir when
`--config` is left out, so that `--config.key=value` overrides apply to it as to any experiment.
"""

from transformer_jax import config as config_lib


def get_config(workdir):
  return config_lib.from_workdir(workdir)
