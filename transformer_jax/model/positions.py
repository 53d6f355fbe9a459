"""Position information: the paper's sinusoidal table or a learned one (added to the embeddings),
rotary position embeddings (applied to queries and keys), and T5's relative position bias (added
to the attention logits)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.model.axes import param_init
from transformer_jax.model.config import ModelConfig

Array = jax.Array

# Positions added to the embeddings; rotary and relative_bias act inside attention, none nowhere.
ADDITIVE = ("sinusoidal", "learned")


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
  """Adds sinusoidal or learned position encodings at the given integer positions; with rotary,
  relative-bias or no positions the embeddings pass unchanged."""

  config: ModelConfig

  @nn.compact
  def __call__(self, x: Array, positions: Array) -> Array:
    """x `[batch, length, d_model]`, positions int `[batch, length]` (negative: padding, read
    as 0)."""
    cfg = self.config
    if cfg.positional not in ADDITIVE:
      return x
    if cfg.positional == "learned":
      table = self.param("table", param_init(nn.initializers.normal(stddev=0.02), "position",
                                             "embed"), (cfg.max_len, cfg.d_model))
    else:
      table = jnp.asarray(sinusoidal_positions(cfg.max_len, cfg.d_model, cfg.position_base))
    return x + jnp.take(table, jnp.maximum(positions, 0), axis=0).astype(x.dtype)


# ----------------------------------------------------------------------------- rotary


def apply_rotary(x: Array, positions: Array, base: float = 10000.0) -> Array:
  """Rotary position embedding (RoFormer, Su et al. 2021): rotates the pair of features
  (x[i], x[i + head_dim/2]) by the angle position * base^(-2i/head_dim).

  The product of a query rotated to position m and a key rotated to position n depends on m - n
  only. Pairing i with i + head_dim/2 (not 2i with 2i + 1) is the GPT-NeoX / LLaMA layout; the
  two are the same function up to a fixed permutation of the projection's columns.

  Args:
    x: `[batch, length, heads, head_dim]`, head_dim even.
    positions: int `[batch, length]`.

  Returns:
    `[batch, length, heads, head_dim]` in the dtype of x (the rotation is computed in float32).
  """
  half = x.shape[-1] // 2
  inverse_wavelengths = jnp.asarray(base ** (-np.arange(half, dtype=np.float64) / half),
                                    jnp.float32)
  angles = positions.astype(jnp.float32)[:, :, None, None] * inverse_wavelengths  # [b, l, 1, h/2]
  sin, cos = jnp.sin(angles), jnp.cos(angles)
  first, second = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
  rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
  return rotated.astype(x.dtype)


# ----------------------------------------------------------------------------- relative bias


def relative_position_bucket(relative_position: Array, bidirectional: bool, num_buckets: int,
                             max_distance: int) -> Array:
  """T5's bucket of each relative position (key position - query position).

  Half the buckets (all of them for one direction) hold the distances 0, 1, ... exactly; the
  rest cover the distances up to `max_distance` on a log scale, and every farther distance shares
  the last bucket. Bidirectional: keys before and keys after the query get separate halves.

  Args:
    relative_position: int array of key position - query position.

  Returns:
    int32 buckets in [0, num_buckets), the shape of relative_position.
  """
  distance = -relative_position  # > 0: the key is before the query
  bucket = jnp.zeros_like(relative_position)
  if bidirectional:
    num_buckets //= 2
    bucket = jnp.where(distance < 0, num_buckets, 0)
    distance = jnp.abs(distance)
  else:
    distance = jnp.maximum(distance, 0)
  exact = num_buckets // 2
  # log(distance / exact) / log(max_distance / exact) in [0, 1) for exact <= distance < max.
  scaled = (jnp.log(jnp.maximum(distance, 1).astype(jnp.float32) / exact)
            / np.log(max_distance / exact) * (num_buckets - exact))
  far = jnp.minimum(exact + scaled.astype(jnp.int32), num_buckets - 1)
  return (bucket + jnp.where(distance < exact, distance, far)).astype(jnp.int32)


class RelativePositionBias(nn.Module):
  """T5's relative position bias: one learned scalar per (bucket of relative distance, head),
  added to the attention logits. One table per stack, shared by its layers, as in T5."""

  config: ModelConfig
  bidirectional: bool

  @nn.compact
  def __call__(self, query_positions: Array, key_positions: Array) -> Array:
    """query_positions int `[batch, q_len]`, key_positions int `[batch, kv_len]`
    -> float32 bias `[batch, heads, q_len, kv_len]`."""
    cfg = self.config
    table = self.param("table", param_init(nn.initializers.variance_scaling(
        1.0, "fan_avg", "uniform"), "relpos_buckets", "heads"),
        (cfg.relative_buckets, cfg.num_heads))
    buckets = relative_position_bucket(key_positions[:, None, :] - query_positions[:, :, None],
                                       self.bidirectional, cfg.relative_buckets,
                                       cfg.relative_max_distance)
    return jnp.take(table, buckets, axis=0).transpose(0, 3, 1, 2)  # [b, q, k, h] -> [b, h, q, k]
