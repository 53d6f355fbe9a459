"""transformer_jax: the encoder-decoder Transformer of "Attention Is All You Need" in JAX/Flax."""

import importlib

__version__ = "0.1.0"


def load(workdir: str, step=None, overrides=None):
  """A trained workdir as a Python object: `.translate(sentences)`, `.score(sources, targets)`,
  `.params`, `.config` (see transformer_jax/api.py)."""
  # Imported by name when called: `import transformer_jax` stays cheap (no JAX) and below every
  # layer (tests/test_layout.py).
  return importlib.import_module("transformer_jax.api").load_model(workdir, step, overrides)
