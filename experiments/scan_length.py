"""SCAN, length split: train on action sequences of at most 22 actions, test on longer ones.

Transformers famously fail this split (exact match near 0-20%); it is here to measure that.
"""

from transformer_jax.experiments import scan_simple


def get_config():
  c = scan_simple.get_config()
  c.data.scan_split = "length"
  return c
