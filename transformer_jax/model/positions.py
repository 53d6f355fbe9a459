"""Position information: the paper's sinusoidal table or a learned one (added to the embeddings),
rotary position embeddings (applied to queries and keys), T5's relative position bias (added
to the attention logits), Transformer-XL's relative position term (computed in attention from
the queries), and randomised positions for training (Ruoss et al., 2023)."""

from __future__ import annotations

from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.core.errors import UserError
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
    rows = max(cfg.max_len, cfg.random_positions_max)  # randomised positions reach further
    if cfg.positional == "learned":
      table = self.param("table", param_init(nn.initializers.normal(stddev=0.02), "position",
                                             "embed"), (rows, cfg.d_model))
    else:
      table = jnp.asarray(sinusoidal_positions(rows, cfg.d_model, cfg.position_base))
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


# ----------------------------------------------------------------------------- Transformer-XL


def relative_distances(span: int, bidirectional: bool) -> np.ndarray:
  """The distances i - j (query position - key position) that relative_xl embeds, in the order
  of its rows: 0 .. span - 1 (causal), or -(span - 1) .. span - 1 (bidirectional). int64."""
  return np.arange(-(span - 1) if bidirectional else 0, span)


def relative_sinusoids(distances: np.ndarray, d_model: int, base: float = 10000.0) -> np.ndarray:
  """Transformer-XL's R: sinusoids of each (signed) distance, [sin | cos] halves.

  R[r, i] = sin(distance_r / base^(2i/d)), R[r, d/2 + i] = cos(same), i < d/2. Returns float32
  `[len(distances), d_model]` (a NumPy constant).
  """
  inverse_wavelengths = base ** (-np.arange(0, d_model, 2, dtype=np.float64) / d_model)
  angles = np.asarray(distances, np.float64)[:, None] * inverse_wavelengths
  return np.concatenate([np.sin(angles), np.cos(angles)], axis=-1).astype(np.float32)


def relative_position_logits(query: Array, embeddings: Array, distances: Array,
                             lowest: int) -> Array:
  """The position term of Transformer-XL's logits, query . W_r R_{i-j}, for every pair (i, j).

  The term is computed against every embedded distance (one product per row of `embeddings`,
  not one per key) and then each pair's distance is looked up, so the positions can be any
  integers: packed rows, a decoding cache, randomised positions. Distances outside the rows
  take the nearest row (never happens for positions within the span).

  Args:
    query: `[batch, q_len, heads, head_dim]` (with Transformer-XL's bias v added).
    embeddings: W_r R, `[rows, heads, head_dim]`; row r embeds the distance lowest + r.
    distances: int `[batch, q_len, kv_len]`, query position - key position.
    lowest: the distance of row 0.

  Returns:
    float32 `[batch, heads, q_len, kv_len]` (not yet scaled by 1 / sqrt(head_dim)).
  """
  every = jnp.einsum("bqhd,rhd->bhqr", query, embeddings, preferred_element_type=jnp.float32)
  rows = jnp.clip(distances - lowest, 0, embeddings.shape[0] - 1)
  index = jnp.broadcast_to(rows[:, None], every.shape[:3] + (distances.shape[-1],))
  return jnp.take_along_axis(every, index, axis=-1)


# ----------------------------------------------------------------------------- random offsets


def random_positions(rng: Array, positions: Array, max_positions: int,
                     draw: Optional[int] = None) -> Array:
  """Randomised positions (Ruoss et al., 2023): position p of a row becomes the p-th smallest of
  a random subset of [0, max_positions) drawn for that row, so positions stay increasing and
  distinct within each example (packed examples of a row share the row's draw).

  Args:
    rng: PRNG key.
    positions: int `[batch, length]`, each in [0, draw) (negative: padding, kept as is).
    max_positions: the range drawn from; at least `draw`.
    draw: the size of each row's subset (default: length). A fixed size (model.max_len) makes
      the positions of a decoding step, called with one token, those of the full sequence.

  Returns:
    int32 `[batch, length]`.
  """
  batch, length = positions.shape[0], draw or positions.shape[1]
  if length > max_positions:
    raise UserError(f"a sequence of {length} positions cannot draw distinct positions from "
                    f"model.random_positions_max={max_positions}; raise it")
  # The indices of the `length` largest of uniform scores: a uniform random subset.
  scores = jax.random.uniform(rng, (batch, max_positions))
  drawn = jnp.sort(jax.lax.top_k(scores, length)[1], axis=-1).astype(jnp.int32)
  taken = jnp.take_along_axis(drawn, jnp.clip(positions, 0, length - 1), axis=-1)
  return jnp.where(positions >= 0, taken, positions).astype(jnp.int32)
