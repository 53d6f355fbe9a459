"""Scaled dot-product attention as pure functions, mask builders, and the multi-head module.

Shapes follow the paper's symbols: `batch`, query length `q_len`, key/value length `kv_len`,
`heads`, and `head_dim` (= d_k = d_v = d_model / heads, or T5's d_kv: model.head_size). Masks
are boolean and broadcast to `[batch, heads, q_len, kv_len]`; True means "may attend".
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from transformer_jax.core.errors import UserError
from transformer_jax.model.axes import constrain, param_init
from transformer_jax.model.config import CHOICES, check_attention_dropout
from transformer_jax.model.positions import (
  apply_rotary,
  relative_distances,
  relative_position_logits,
  relative_sinusoids,
)

Array = jax.Array

IMPLEMENTATIONS = CHOICES["attention_impl"]


# ----------------------------------------------------------------------------- masks


def padding_mask(query_valid: Array, key_valid: Array) -> Array:
  """Mask that lets valid queries attend to valid (non-padding) keys.

  Args:
    query_valid: bool `[batch, q_len]`, True at real tokens.
    key_valid: bool `[batch, kv_len]`, True at real tokens.

  Returns:
    bool `[batch, 1, q_len, kv_len]`.
  """
  return query_valid[:, None, :, None] & key_valid[:, None, None, :]


def causal_mask(length: int) -> Array:
  """Mask that lets position i attend only to positions j <= i. bool `[1, 1, length, length]`."""
  return jnp.tril(jnp.ones((length, length), dtype=bool))[None, None]


def segment_mask(query_segments: Array, key_segments: Array) -> Array:
  """Mask for packed rows: attend only within the same example (segment id).

  Args:
    query_segments: int `[batch, q_len]`, example id of each position (0 = padding).
    key_segments: int `[batch, kv_len]`.

  Returns:
    bool `[batch, 1, q_len, kv_len]`.
  """
  return query_segments[:, None, :, None] == key_segments[:, None, None, :]


def combine_masks(*masks: Optional[Array]) -> Optional[Array]:
  """Logical AND of the given masks (None entries are ignored); None if all are None."""
  masks = [m for m in masks if m is not None]
  if not masks:
    return None
  return functools.reduce(jnp.logical_and, masks)


# ----------------------------------------------------------------------------- dropout


@dataclasses.dataclass(frozen=True, eq=False)
class DropoutRate:
  """A dropout rate whose keep thresholds are inputs of the compiled train step
  (train/step.py), so that runs with other rates share its program. `rate` (> 0) only says
  that there is dropout; `keep` holds what `dropout` computes from a float rate, for 16-bit and
  8-bit draws: {"16": (keep count, float32 scale), "8": (keep count, bfloat16 scale)}."""

  rate: float
  keep: dict

  @staticmethod
  def thresholds(rate: float) -> dict:
    """`keep` for `rate`, computed on the host exactly as `dropout` does for a float rate."""
    keep = {}
    for bits, dtype in ((16, jnp.float32), (8, jnp.bfloat16)):
      count = round((1.0 - rate) * 2**bits)
      # keep none: a zero scale (what is kept is nothing; an infinite one would make NaN
      # gradients of the zeros)
      scale = np.asarray(jnp.asarray(2**bits / count if count else 0.0, dtype))
      keep[str(bits)] = (np.uint32(count), scale)
    return keep


def dropping(rate) -> bool:
  """Whether `rate` (a float or a DropoutRate) drops anything."""
  return (rate.rate if isinstance(rate, DropoutRate) else rate) > 0.0


# The generators of dropout's random bits (model.dropout_rng). threefry: JAX's default key, the
# bits a function of (key, shape) alone, computed shard by shard. rbg: XLA's RngBitGenerator
# (Philox on GPUs) seeded from four threefry words of the same key: fewer integer operations per
# bit, but its bits are the backend's own (a GPU and a CPU draw different masks for one key)
# and on a mesh every device computes the whole array and keeps its shard (the same mask
# whatever the mesh, at the cost of the whole array per device; XLA's flag that lets each
# device draw its own shard instead is for TPUs). unsafe_rbg: JAX's other RngBitGenerator key,
# which differs from rbg only in how keys split and fold in (by RngBitGenerator, not threefry).
# Dropout does neither with the key it makes (the stream's keys are derived as threefry keys
# by Flax, then each draw's key is seeded once), so unsafe_rbg draws rbg's very bits: it is
# here so that a benchmark of JAX's generators by name finds it, and measures the same.
GENERATORS = CHOICES["dropout_rng"]


def random_bits(rng: Array, shape: tuple, dtype, generator: str = "threefry") -> Array:
  """`jax.random.bits(rng, shape, dtype)` from `generator` (GENERATORS); `rng` is a threefry
  key (Flax's RNG streams) either way."""
  if generator in ("rbg", "unsafe_rbg"):
    seed = jax.random.bits(rng, (4,), jnp.uint32)
    rng = jax.random.wrap_key_data(seed, impl=generator)
  elif generator != "threefry":
    raise ValueError(f"unknown dropout generator {generator!r}")
  return jax.random.bits(rng, shape, dtype)


def dropout(x: Array, rate, rng: Array, generator: str = "threefry") -> Array:
  """Inverted dropout: zeroes each element with probability `rate`, scales the rest by 1/keep.

  One 16-bit draw per element: each 32-bit word of `jax.random.bits` gives two (its halves go to
  the first and second half of the last axis when that axis is even), so the keep probability is
  `1 - rate` rounded to a multiple of 2^-16 and the survivors are scaled by the inverse of that
  rounded value. Half the words of `jax.random.bernoulli`, which draws 32 bits per element.

  The bits come from JAX's partitionable threefry: the mask is a function of (rng, x.shape) only,
  so it is the same whichever mesh the step runs on, each device computes only the bits of its
  own shard, and a batch grown by empty rows at the end keeps the masks of its real rows.
  (XLA's `rng_bit_generator` was faster on one CPU but computes the whole array on every device
  of a mesh.)

  bfloat16 x (accelerators): one 8-bit draw per element, `1 - rate` rounded to a multiple of
  2^-8 (0.1 drops 26/256 = 10.16%; survivors scaled by 256/230, so the mean is kept exactly).
  XLA keeps the random bits in HBM between the kernel that draws them and the ones that read
  them (forward and backward), so 8 bits where 16 were halve that traffic: 4% of the bytes of
  the base model's step on H100s by the compiler's count. float32 keeps the 16-bit draws.

  `rate`: a float, or a `DropoutRate` whose thresholds are inputs of the compiled step (the
  same masks and scales as its float rate gives). `generator`: where the bits come from
  (GENERATORS; model.dropout_rng): with "rbg" the same thresholds and scales, other masks.
  """
  with jax.named_scope("dropout"):  # tools/profile.py's kernel categories read these names
    return _dropout(x, rate, functools.partial(random_bits, generator=generator), rng)


def _dropout(x: Array, rate, bits_of: Callable, rng: Array) -> Array:
  bits = 8 if x.dtype == jnp.bfloat16 else 16
  if isinstance(rate, DropoutRate):
    keep_count, scale = rate.keep[str(bits)]
    scale = scale.astype(x.dtype)
    if bits == 8:  # compared in 32 bits: a keep count of 256 (keep all) does not fit 8
      draws = bits_of(rng, x.shape, jnp.uint8).astype(jnp.uint32)
      return jnp.where(draws < keep_count, x * scale, jnp.zeros((), x.dtype))
  else:
    keep_count = round((1.0 - rate) * 2**bits)  # P(keep) = keep_count / 2^bits
    if keep_count >= 2**bits:
      return x
    if keep_count == 0:
      return jnp.zeros_like(x)
    scale = jnp.asarray(2**bits / keep_count, x.dtype)
  if bits == 8:
    draws = bits_of(rng, x.shape, jnp.uint8)  # 4 per 32-bit word of threefry
    return jnp.where(draws < jnp.uint8(keep_count), x * scale, jnp.zeros((), x.dtype))
  if x.ndim and x.shape[-1] % 2 == 0:
    words = bits_of(rng, x.shape[:-1] + (x.shape[-1] // 2,), jnp.uint32)
    draws = jnp.concatenate([words & 0xFFFF, words >> 16], axis=-1)
  else:
    draws = bits_of(rng, x.shape, jnp.uint32) >> 16
  threshold = keep_count if isinstance(rate, DropoutRate) else jnp.uint32(keep_count)
  return jnp.where(draws < threshold, x * scale, jnp.zeros((), x.dtype))


class Dropout(nn.Module):
  """`nn.Dropout` with the faster mask of `dropout`; draws from the "dropout" RNG stream."""

  rate: float
  generator: str = "threefry"  # of the random bits: GENERATORS

  @nn.compact
  def __call__(self, x: Array, deterministic: bool) -> Array:
    if deterministic or not dropping(self.rate):
      return x
    return dropout(x, self.rate, self.make_rng("dropout"), self.generator)


# ----------------------------------------------------------------------------- attention


def dot_product_attention_weights(query: Array, key: Array, mask: Optional[Array] = None,
                                  bias: Optional[Array] = None) -> Array:
  """softmax(Q K^T / sqrt(d_k) + bias + mask), computed in float32.

  Args:
    query: `[batch, q_len, heads, head_dim]`.
    key: `[batch, kv_len, heads, head_dim]`.
    mask: bool, broadcastable to `[batch, heads, q_len, kv_len]`.
    bias: float, broadcastable to `[batch, heads, q_len, kv_len]`, added to the scaled logits
      (e.g. T5's relative position bias).

  Returns:
    float32 `[batch, heads, q_len, kv_len]`; masked positions get exactly zero weight.
  """
  with jax.named_scope("softmax"):  # tools/profile.py's kernel categories read these names
    return jax.nn.softmax(_attention_logits(query, key, mask, bias), axis=-1)


def _attention_logits(query: Array, key: Array, mask: Optional[Array],
                      bias: Optional[Array]) -> Array:
  """The float32 logits Q K^T / sqrt(d_k) + bias, masked: `[batch, heads, q_len, kv_len]`."""
  depth = query.shape[-1]
  logits = jnp.einsum("bqhd,bkhd->bhqk", query, key, preferred_element_type=jnp.float32)
  logits = logits / jnp.sqrt(jnp.float32(depth))
  if bias is not None:
    logits = logits + bias.astype(jnp.float32)
  if mask is not None:
    # The most negative finite value: exp() underflows to exactly 0 after the max is subtracted,
    # and a row with every key masked (a padding query) stays finite instead of becoming NaN.
    logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
  return logits


def geometric_attention_weights(query: Array, key: Array, distances: Array,
                                mask: Optional[Array] = None,
                                bias: Optional[Array] = None) -> Array:
  """Geometric attention (Csordas, Irie & Schmidhuber, 2022, the Neural Data Router): each query
  i looks at its keys from the nearest outwards and stops at the first that matches. With
  p_ij = sigmoid(Q K^T / sqrt(d_k) + bias) the chance that key j matches, key j gets

      A_ij = p_ij * prod_{k nearer to i than j} (1 - p_ik),

  so the weights of a row sum to at most 1 (not renormalized). A key is nearer when its
  distance |i - k| is smaller, or equal and it lies before the query (the earlier of two keys
  at the same distance comes first). The query's own position and masked keys get p = 0: they
  take no weight and stop nothing. Computed in float32, as a sum of logarithms.

  Args:
    query, key, mask, bias: as `dot_product_attention_weights`.
    distances: int `[batch, q_len, kv_len]`, query position - key position.

  Returns:
    float32 `[batch, heads, q_len, kv_len]`.
  """
  distances = distances.astype(jnp.int32)
  own = (distances == 0)[:, None]
  logits = _attention_logits(query, key, combine_masks(mask, ~own), bias)
  log_match = jax.nn.log_sigmoid(logits)
  log_pass = jax.nn.log_sigmoid(-logits)
  # Each query's search order: by distance, and at equal distance the key before the query
  # (distance > 0) first. The sum over the keys searched before each key is an exclusive
  # cumulative sum in that order: O(q_len kv_len log kv_len), not a [q_len, kv_len, kv_len] mask.
  order = jnp.argsort(2 * jnp.abs(distances) + (distances < 0), axis=-1, stable=True)
  in_order = jnp.take_along_axis(log_pass, order[:, None], axis=-1)
  before = jnp.cumsum(in_order, axis=-1)
  before = jnp.concatenate([jnp.zeros_like(before[..., :1]), before[..., :-1]], axis=-1)
  passed = jnp.take_along_axis(before, jnp.argsort(order, axis=-1)[:, None], axis=-1)
  return jnp.exp(log_match + passed)


def attention_weights(query: Array, key: Array, mask: Optional[Array] = None,
                      bias: Optional[Array] = None,
                      geometric_distances: Optional[Array] = None) -> Array:
  """`geometric_attention_weights` where `geometric_distances` are given, else
  `dot_product_attention_weights`: float32 `[batch, heads, q_len, kv_len]`."""
  if geometric_distances is None:
    return dot_product_attention_weights(query, key, mask, bias)
  return geometric_attention_weights(query, key, geometric_distances, mask, bias)


@jax.custom_vjp
def softmax_to_bfloat16(logits: Array) -> Array:
  """softmax(logits) over the last axis, computed in float32 and returned in bfloat16, with a
  backward pass that reads only that bfloat16 output: d logits = p * (g - sum(g * p)).

  Attention under `model.dtype=bfloat16` rounds its weights to bfloat16 for the product with
  the values anyway, so the forward pass is unchanged. What changes is what the backward pass
  keeps: left to autodiff, XLA keeps the float32 exponentials `[batch, heads, q, k]` in HBM and
  reads them in five kernels (the values' product, its gradients, the logits' gradient); here
  the bfloat16 probabilities are kept instead, half the bytes. The gradient of the logits then
  uses p rounded to bfloat16 (relative error 2^-9) where it used float32 p.
  """
  with jax.named_scope("softmax"):
    return jax.nn.softmax(logits, axis=-1).astype(jnp.bfloat16)


def _softmax_to_bfloat16_fwd(logits):
  probabilities = softmax_to_bfloat16(logits)
  return probabilities, probabilities


def _softmax_to_bfloat16_bwd(probabilities, grad):
  p, g = probabilities.astype(jnp.float32), grad.astype(jnp.float32)
  return (p * (g - jnp.sum(g * p, axis=-1, keepdims=True)),)


softmax_to_bfloat16.defvjp(_softmax_to_bfloat16_fwd, _softmax_to_bfloat16_bwd)


def dot_product_attention(
    query: Array,
    key: Array,
    value: Array,
    mask: Optional[Array] = None,
    *,
    bias: Optional[Array] = None,
    dropout_rate: float = 0.0,
    dropout_rng: Optional[Array] = None,
    dropout_generator: str = "threefry",
    deterministic: bool = True,
    implementation: str = "plain",
    geometric_distances: Optional[Array] = None,
) -> Array:
  """softmax(Q K^T / sqrt(d_k) + bias + mask) V.

  Args:
    query: `[batch, q_len, heads, head_dim]`.
    key: `[batch, kv_len, heads, head_dim]`.
    value: `[batch, kv_len, heads, head_dim]`.
    mask: bool, broadcastable to `[batch, heads, q_len, kv_len]`, True = attend.
    bias: float, broadcastable to `[batch, heads, q_len, kv_len]`, added to the logits.
    dropout_rate: dropout on the attention weights ("plain" and "plain_bf16"; "plain_bf16"
      with bfloat16 values drops the bfloat16 weights, with 8-bit draws).
    dropout_rng: PRNG key for that dropout.
    dropout_generator: the generator of its random bits (GENERATORS).
    deterministic: disables dropout.
    implementation: "plain" (einsum + softmax, any backend), "plain_bf16" (the same, but with
      bfloat16 values the weights come from `softmax_to_bfloat16`: the backward pass keeps them
      in bfloat16; float32 values are computed as "plain"), "jax"
      (`jax.nn.dot_product_attention`, XLA's implementation) or "cudnn" (the same function's
      cuDNN flash attention: NVIDIA GPUs, 16-bit inputs, head_dim a multiple of 8; the mask
      enters as a bias of large negative values, as JAX turns masks into one). Neither of the
      last two drops attention weights (`check_attention_dropout`).
    geometric_distances: int `[batch, q_len, kv_len]` (query position - key position): the
      weights are `geometric_attention_weights` instead of the softmax (any implementation:
      computed as "plain").

  Returns:
    `[batch, q_len, heads, head_dim]` in the dtype of `query`.
  """
  if implementation in ("jax", "cudnn") and geometric_distances is None:
    check_attention_dropout(implementation, 0.0 if deterministic or not dropping(dropout_rate)
                            else 1.0)
    if bias is not None:
      bias = jnp.broadcast_to(bias, bias.shape[:2] + (query.shape[1], key.shape[1]))
      bias = bias.astype(query.dtype)
    try:
      return jax.nn.dot_product_attention(
          query, key, value, bias=bias, mask=mask,
          implementation="cudnn" if implementation == "cudnn" else "xla")
    except RuntimeError as e:  # JAX asks the installed cuDNN for its version first
      if "cuDNN" not in str(e):
        raise
      raise UserError(f"model.attention_impl='cudnn' needs NVIDIA's cuDNN library ({e}); "
                      "install jax[cuda12], which brings it, or use another "
                      "model.attention_impl") from None
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"unknown attention implementation {implementation!r}")
  if (implementation == "plain_bf16" and value.dtype == jnp.bfloat16
      and geometric_distances is None):
    weights = softmax_to_bfloat16(_attention_logits(query, key, mask, bias))
  else:
    weights = attention_weights(query, key, mask, bias, geometric_distances)
  if dropping(dropout_rate) and not deterministic:
    weights = dropout(weights, dropout_rate, dropout_rng, dropout_generator)
  return jnp.einsum("bhqk,bkhd->bqhd", weights.astype(value.dtype), value)


# ----------------------------------------------------------------------------- module


def _stacked_init(init: Callable, n: int) -> Callable:
  """Initialises a fused kernel like `n` separate projections.

  DenseGeneral hands its initialiser the flat shape (d_model, n * heads * head_dim); Xavier on
  that shape would use fan_out = n * d_model and start fused q/k/v smaller than separate ones.
  """

  def init_fn(rng, shape, dtype=jnp.float32):
    fan_in, fan_out = shape
    return jnp.concatenate([init(k, (fan_in, fan_out // n), dtype)
                            for k in jax.random.split(rng, n)], axis=1)

  return init_fn


class MultiHeadAttention(nn.Module):
  """Multi-head attention: self-attention (`inputs_kv=None`) or cross-attention.

  With `num_kv_heads` < `num_heads` (grouped-query attention, Ainslie et al. 2023), each key/value
  head serves num_heads / num_kv_heads query heads; 1 is multi-query attention. With
  `rotary_base` > 0, self-attention queries and keys are rotated by their positions (RoPE).
  With `relative_base` > 0, self-attention is Transformer-XL's relative attention (Dai et al.,
  2019): logits (q + u).k + (q + v).(W_r R_{i-j}), scaled by 1 / sqrt(head_dim), with R the
  sinusoids of the distance i - j (see `positions.relative_sinusoids`), W_r a learned projection
  ("position"), u and v learned per head ("content_bias", "position_bias"), one set per layer.

  With `decode=True` it keeps a `cache` collection for incremental decoding: self-attention
  appends each call's keys/values (one step, or a whole prompt) at the cache index, and a query
  sees the positions written up to its own; cross-attention projects the encoder output once and
  reuses it. The first call with `decode=True` (full-length inputs) only creates the cache.
  The cache holds the key/value heads only: grouped-query attention shrinks it.
  """

  num_heads: int
  d_model: int
  num_kv_heads: int = 0  # 0 = num_heads
  head_dim: int = 0  # width of each head's queries, keys and values; 0 = d_model // num_heads
  dropout_rate: float = 0.0  # on attention weights
  output_dropout_rate: float = 0.0  # on the output projection
  dropout_generator: str = "threefry"  # of both dropouts' random bits: GENERATORS
  fused_qkv: bool = False
  use_bias: bool = True  # on the query, key and value projections
  out_bias: bool = True  # on the output projection
  rotary_base: float = 0.0  # > 0: rotary position embedding of queries and keys (self-attention)
  relative_base: float = 0.0  # > 0: Transformer-XL relative attention, sinusoids of this base
  relative_bidirectional: bool = True  # relative_xl: embed negative distances too (an encoder)
  relative_span: int = 0  # relative_xl: embed distances below at least this (0: the lengths)
  geometric: bool = False  # self-attention: geometric_attention_weights instead of the softmax
  implementation: str = "plain"
  decode: bool = False
  dtype: jnp.dtype = jnp.float32
  kernel_init: Callable = nn.initializers.xavier_uniform()

  @nn.compact
  def __call__(self, inputs_q: Array, inputs_kv: Optional[Array] = None,
               mask: Optional[Array] = None, deterministic: bool = True, *,
               bias: Optional[Array] = None, positions: Optional[Array] = None,
               distances: Optional[Array] = None, cache_slot: int = 0) -> Array:
    """inputs_q `[batch, q_len, d_model]`, inputs_kv `[batch, kv_len, d_model]` or None (self-
    attention) -> `[batch, q_len, d_model]`.

    mask: bool, broadcastable to `[batch, heads, q_len, kv_len]`; bias: float, the same shape,
    added to the logits; positions: int `[batch, q_len]`, the positions rotary embeddings use;
    distances: int `[batch, q_len, kv_len]`, query position - key position (relative_xl and
    geometric; in decode mode kv_len is the cache's); cache_slot: which of the decoding caches
    this call extends (a layer applied several times, model.share_layers, keeps one per
    application).
    """
    head_dim = self.head_dim or self.d_model // self.num_heads
    kv_heads = self.num_kv_heads or self.num_heads
    bias_init = nn.initializers.zeros_init()

    def dense(n=None, name=None, heads=self.num_heads, head_name="heads"):
      """Projection d_model -> [n,] heads, head_dim (n fused projections stacked)."""
      features = (heads, head_dim) if n is None else (n, heads, head_dim)
      names = (head_name, "kv") if n is None else ("stack", head_name, "kv")
      init = self.kernel_init if n is None else _stacked_init(self.kernel_init, n)
      return nn.DenseGeneral(features=features, axis=-1, use_bias=self.use_bias,
                             dtype=self.dtype, kernel_init=param_init(init, "embed", *names),
                             bias_init=param_init(bias_init, *names), name=name)

    def heads(x, name="heads"):
      return constrain(x, "batch", "length", name, "kv")

    self_attention = inputs_kv is None

    def project_kv(x):
      if self.fused_qkv:
        kv = dense(2, name="kv", heads=kv_heads, head_name="kv_heads")(x)
        return heads(kv[:, :, 0], "kv_heads"), heads(kv[:, :, 1], "kv_heads")
      return (heads(dense(name="key", heads=kv_heads, head_name="kv_heads")(x), "kv_heads"),
              heads(dense(name="value", heads=kv_heads, head_name="kv_heads")(x), "kv_heads"))

    if self_attention and self.fused_qkv:
      qkv = dense(3, name="qkv")(inputs_q)
      query, key, value = heads(qkv[:, :, 0]), heads(qkv[:, :, 1]), heads(qkv[:, :, 2])
    else:
      query = heads(dense(name="query")(inputs_q))
      if self_attention:
        key, value = project_kv(inputs_q)
      elif self.decode:
        # Encoder keys/values are computed on the cache-creating call and reused at every step.
        if self.has_variable("cache", "cross_key"):
          key = self.get_variable("cache", "cross_key")
          value = self.get_variable("cache", "cross_value")
        else:
          key, value = project_kv(inputs_kv)
          self.put_variable("cache", "cross_key", key)
          self.put_variable("cache", "cross_value", value)
      else:
        key, value = project_kv(inputs_kv)

    # Names for model.remat's policies (transformer.REMAT_POLICIES); no effect elsewhere.
    query, key, value = (checkpoint_name(t, "qkv") for t in (query, key, value))
    if self.rotary_base and self_attention:
      query = apply_rotary(query, positions, self.rotary_base)
      key = apply_rotary(key, positions, self.rotary_base)
    if self.decode and self_attention:
      key, value, mask = self._extend_cache(key, value, mask, cache_slot)
    if self.relative_base and self_attention:
      bias, query = self._relative_xl(query, key.shape[1], distances, bias, head_dim)
    if kv_heads != self.num_heads:  # each key/value head serves a group of query heads
      key = heads(jnp.repeat(key, self.num_heads // kv_heads, axis=2))
      value = heads(jnp.repeat(value, self.num_heads // kv_heads, axis=2))

    dropout_rng = None
    if dropping(self.dropout_rate) and not deterministic:
      dropout_rng = self.make_rng("dropout")
    geometric = distances if self.geometric and self_attention else None
    if self.is_mutable_collection("intermediates"):
      # Only when a caller asks for attention maps; the training path never computes them twice.
      self.sow("intermediates", "attention_weights",
               attention_weights(query, key, mask, bias, geometric))
    out = dot_product_attention(query, key, value, mask, bias=bias,
                                dropout_rate=self.dropout_rate, dropout_rng=dropout_rng,
                                dropout_generator=self.dropout_generator,
                                deterministic=deterministic, implementation=self.implementation,
                                geometric_distances=geometric)
    out = checkpoint_name(out, "context")
    out = nn.DenseGeneral(features=self.d_model, axis=(-2, -1), use_bias=self.out_bias,
                          dtype=self.dtype,
                          kernel_init=param_init(self.kernel_init, "heads", "kv", "embed"),
                          bias_init=param_init(bias_init, "embed"), name="out")(heads(out))
    out = checkpoint_name(constrain(out, "batch", "length", "embed"), "attention_out")
    return Dropout(rate=self.output_dropout_rate, generator=self.dropout_generator)(
        out, deterministic)

  def _relative_xl(self, query, kv_len, distances, bias, head_dim):
    """Transformer-XL: the position term (q + v).(W_r R_{i-j}) / sqrt(head_dim) added to `bias`,
    and the query q + u of the content term. Returns (bias, query)."""
    span = max(query.shape[1], kv_len, self.relative_span)
    rows = relative_distances(span, self.relative_bidirectional)
    table = jnp.asarray(relative_sinusoids(rows, self.d_model, self.relative_base), self.dtype)
    embeddings = nn.DenseGeneral(
        features=(self.num_heads, head_dim), use_bias=False, dtype=self.dtype,
        kernel_init=param_init(self.kernel_init, "embed", "heads", "kv"), name="position")(table)
    zeros = param_init(nn.initializers.zeros_init(), "heads", "kv")
    u = self.param("content_bias", zeros, (self.num_heads, head_dim))
    v = self.param("position_bias", zeros, (self.num_heads, head_dim))
    logits = relative_position_logits(query + v.astype(query.dtype), embeddings, distances,
                                      int(rows[0]))
    logits = logits / jnp.sqrt(jnp.float32(head_dim))
    return (logits if bias is None else bias + logits), query + u.astype(query.dtype)

  def _extend_cache(self, key, value, mask, slot=0):
    """Writes this call's keys/values at the cache index; a query sees the cache positions
    written before it and its own (never those not yet written). Slot s > 0 keeps its cache in
    variables named with the suffix _s."""
    suffix = f"_{slot}" if slot else ""
    initialized = self.has_variable("cache", "cached_key" + suffix)
    cached_key = self.variable("cache", "cached_key" + suffix, jnp.zeros, key.shape, key.dtype)
    cached_value = self.variable("cache", "cached_value" + suffix, jnp.zeros, value.shape,
                                 value.dtype)
    cache_index = self.variable("cache", "cache_index" + suffix,
                                lambda: jnp.array(0, dtype=jnp.int32))
    if not initialized:
      return key, value, mask  # cache-creating call: a plain full-length pass
    steps = key.shape[1]
    max_length = cached_key.value.shape[1]
    index = cache_index.value
    key = jax.lax.dynamic_update_slice(cached_key.value, key, (0, index, 0, 0))
    value = jax.lax.dynamic_update_slice(cached_value.value, value, (0, index, 0, 0))
    cached_key.value, cached_value.value = key, value
    cache_index.value = index + steps
    written = jnp.arange(max_length)[None, :] <= index + jnp.arange(steps)[:, None]
    return key, value, combine_masks(mask, written[None, None])
