"""Position encodings: the paper's sinusoidal table, or a learned one."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.model.axes import param_init
from transformer_jax.model.config import ModelConfig

Array = jax.Array


def sinusoidal_positions(length: int, d_model: int, base: float = 10000.0) -> np.ndarray:
  """The paper's table: PE[pos, 2i] = sin(pos / base^(2i/d)), PE[pos, 2i+1] = cos(same).

  Returns float32 `[length, d_model]` (a NumPy constant, folded into the compiled program).
  """
  positions = np.arange(length, dtype=np.float64)[:, None]
  even = np.arange(0, d_model, 2, dtype=np.float64)
  angles = positions / np.power(base, even / d_model)
  table = np.zeros((length, d_model), dtype=np.float64)
  table[:, 0::2] = np.sin(angles)
  table[:, 1::2] = np.cos(angles[:, : d_model // 2])
  return table.astype(np.float32)


class AddPositions(nn.Module):
  """Adds sinusoidal or learned position encodings at the given integer positions."""

  config: ModelConfig

  @nn.compact
  def __call__(self, x: Array, positions: Array) -> Array:
    """x `[batch, length, d_model]`, positions int `[batch, length]`."""
    cfg = self.config
    if cfg.positional == "learned":
      table = self.param("table", param_init(nn.initializers.normal(stddev=0.02), "position",
                                             "embed"), (cfg.max_len, cfg.d_model))
    else:
      table = jnp.asarray(sinusoidal_positions(cfg.max_len, cfg.d_model, cfg.position_base))
    return x + jnp.take(table, positions, axis=0).astype(x.dtype)
