"""Transformer big (Vaswani et al., 2017, Table 3): 6+6 layers, d_model 1024, 16 heads, 214M
parameters."""

from transformer_jax.experiments import base


def get_config():
  """base with the paper's big sizes: wider, more heads, more dropout, three times the steps."""
  c = base.get_config()
  c.model.update(d_model=1024, num_heads=16, d_ff=4096, dropout_rate=0.3)
  c.train.steps = 300_000
  return c
