"""The recipes: one file per experiment, each with `get_config()` (and optionally `get_sweep()`).

Installed with the package as `transformer_jax.experiments`, so a recipe can import another
(`from transformer_jax.experiments import base`) and `--config=NAME` finds `NAME.py` here from
any directory.
"""

import os

DIRECTORY = os.path.dirname(os.path.abspath(__file__))


def names() -> list:
  """The installed experiments, by name."""
  return sorted(f[:-3] for f in os.listdir(DIRECTORY)
                if f.endswith(".py") and not f.startswith("_"))


def resolve(path: str) -> str:
  """`path` if it names a file; else the installed experiment it names (`tiny`, `tiny.py` or
  `experiments/tiny.py`); else `path` unchanged, for the flag parser to report."""
  if not path or os.path.exists(path):
    return path
  name = os.path.basename(path)
  name = name[:-3] if name.endswith(".py") else name
  candidate = os.path.join(DIRECTORY, f"{name}.py")
  return candidate if name in names() else path
