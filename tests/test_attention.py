"""Attention against a float64 NumPy reference; mask builders against hand-written masks."""

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.core.errors import UserError
from transformer_jax.model import attention


def reference_attention(query, key, value, mask=None, bias=None):
  """softmax(Q K^T / sqrt(d_k) + bias + mask) V in float64, masked logits set to -inf.

  query `[batch, q_len, heads, head_dim]`, key/value `[batch, kv_len, heads, head_dim]`,
  mask and bias broadcastable to `[batch, heads, q_len, kv_len]` (mask: True = attend).
  Returns (output `[batch, q_len, heads, head_dim]`, weights `[batch, heads, q_len, kv_len]`).
  """
  q = np.asarray(query, np.float64).transpose(0, 2, 1, 3)  # [b, h, q, d]
  k = np.asarray(key, np.float64).transpose(0, 2, 3, 1)  # [b, h, d, k]
  v = np.asarray(value, np.float64).transpose(0, 2, 1, 3)  # [b, h, k, d]
  logits = (q @ k) / math.sqrt(q.shape[-1])
  if bias is not None:
    logits = logits + np.asarray(bias, np.float64)
  if mask is not None:
    logits = np.where(np.broadcast_to(np.asarray(mask), logits.shape), logits, -np.inf)
  with np.errstate(invalid="ignore"):  # a row with no key to attend to becomes NaN
    logits = logits - logits.max(axis=-1, keepdims=True)
    weights = np.exp(logits)
    weights = weights / weights.sum(axis=-1, keepdims=True)
  return (weights @ v).transpose(0, 2, 1, 3), weights


def random_qkv(rng, batch, q_len, kv_len, heads, head_dim):
  shapes = [(batch, q_len, heads, head_dim)] + [(batch, kv_len, heads, head_dim)] * 2
  return [jnp.asarray(rng.normal(size=s), jnp.float32) for s in shapes]


def random_mask(rng, shape):
  """A random boolean mask in which every row (last axis) has at least one True."""
  mask = rng.random(shape) < 0.6
  rows = mask.reshape(-1, shape[-1])
  rows[np.arange(rows.shape[0]), rng.integers(0, shape[-1], rows.shape[0])] = True
  return jnp.asarray(rows.reshape(shape))


def valid_lengths_mask(lengths, length):
  return jnp.asarray(np.arange(length)[None, :] < np.asarray(lengths)[:, None])


SHAPES = [  # batch, q_len, kv_len, heads, head_dim
    (1, 1, 1, 1, 4),
    (2, 5, 7, 3, 8),
    (3, 6, 6, 4, 16),
    (2, 9, 3, 2, 5),
]


# ----------------------------------------------------------------------------- plain vs NumPy


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("mask_kind", ["none", "shared_heads", "per_head"])
def test_plain_attention_matches_numpy_reference(shape, mask_kind):
  rng = np.random.default_rng(sum(shape))
  batch, q_len, kv_len, heads, _ = shape
  query, key, value = random_qkv(rng, *shape)
  mask = {"none": None,
          "shared_heads": random_mask(rng, (batch, 1, q_len, kv_len)),
          "per_head": random_mask(rng, (batch, heads, q_len, kv_len))}[mask_kind]
  expected, expected_weights = reference_attention(query, key, value, mask)

  out = attention.dot_product_attention(query, key, value, mask)
  weights = attention.dot_product_attention_weights(query, key, mask)

  assert out.shape == query.shape and out.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(weights), expected_weights, rtol=1e-5, atol=1e-6)


def test_plain_attention_scales_logits_by_sqrt_head_dim():
  # One query, two keys: the weight on key 0 is sigmoid((q.k0 - q.k1) / sqrt(d)).
  d = 16
  query = jnp.ones((1, 1, 1, d))
  key = jnp.stack([jnp.full((d,), 0.25), jnp.zeros((d,))])[None, :, None, :]
  weights = attention.dot_product_attention_weights(query, key)
  expected = 1.0 / (1.0 + math.exp(-(0.25 * d) / math.sqrt(d)))
  np.testing.assert_allclose(float(weights[0, 0, 0, 0]), expected, rtol=1e-6)


def test_unknown_implementation_is_rejected():
  q = jnp.zeros((1, 2, 1, 4))
  with pytest.raises(ValueError, match="unknown attention implementation"):
    attention.dot_product_attention(q, q, q, implementation="flash")


# ----------------------------------------------------------------------------- "jax" vs "plain"


@pytest.mark.parametrize("shape", [(2, 6, 6, 2, 8), (3, 5, 5, 4, 4)])
def test_jax_implementation_matches_plain_under_padding_and_causal_masks(shape):
  rng = np.random.default_rng(1)
  batch, length, _, _, _ = shape
  query, key, value = random_qkv(rng, *shape)
  lengths = rng.integers(1, length + 1, size=batch)
  lengths[0] = length - 2  # at least one row with padding
  valid = valid_lengths_mask(lengths, length)
  mask = attention.combine_masks(attention.padding_mask(valid, valid),
                                 attention.causal_mask(length))

  attend = jax.jit(attention.dot_product_attention, static_argnames="implementation")
  plain = attend(query, key, value, mask, implementation="plain")
  fused = attend(query, key, value, mask, implementation="jax")

  # Padding queries attend to nothing, so their output is unspecified; compare real positions.
  real = np.asarray(valid)
  np.testing.assert_allclose(np.asarray(fused)[real], np.asarray(plain)[real], rtol=1e-5, atol=1e-6)
  expected, _ = reference_attention(query, key, value, mask)
  np.testing.assert_allclose(np.asarray(fused)[real], expected[real], rtol=1e-5, atol=1e-5)


# cudnn runs on NVIDIA GPUs alone: tests/test_levers.py compiles it for an H100 on the CPU.
CPU_IMPLEMENTATIONS = [name for name in attention.IMPLEMENTATIONS if name != "cudnn"]


def test_bias_is_added_to_the_logits_in_every_implementation():
  rng = np.random.default_rng(3)
  query, key, value = random_qkv(rng, 2, 5, 5, 2, 8)
  bias = jnp.asarray(rng.normal(size=(2, 2, 5, 5)) * 2.0, jnp.float32)
  mask = attention.causal_mask(5)
  expected, expected_weights = reference_attention(query, key, value, mask, bias)
  weights = attention.dot_product_attention_weights(query, key, mask, bias)
  np.testing.assert_allclose(np.asarray(weights), expected_weights, rtol=1e-5, atol=1e-6)
  for implementation in CPU_IMPLEMENTATIONS:
    out = attention.dot_product_attention(query, key, value, mask, bias=bias,
                                          implementation=implementation)
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-5, atol=1e-5)


def test_jax_implementation_refuses_attention_dropout():
  q = jnp.zeros((1, 2, 1, 4))
  with pytest.raises(UserError, match="dropout"):
    attention.dot_product_attention(q, q, q, dropout_rate=0.1, dropout_rng=jax.random.PRNGKey(0),
                                    deterministic=False, implementation="jax")


# ----------------------------------------------------------------------------- padding


def test_padded_keys_get_exactly_zero_weight():
  rng = np.random.default_rng(2)
  batch, length, heads, head_dim = 3, 7, 2, 8
  query, key, _ = random_qkv(rng, batch, length, length, heads, head_dim)
  key = key * 4.0  # large logits: masked entries must still be exactly 0, not tiny
  valid = valid_lengths_mask([7, 4, 1], length)
  mask = attention.padding_mask(valid, valid)

  weights = np.asarray(attention.dot_product_attention_weights(query, key, mask))

  assert weights.shape == (batch, heads, length, length)
  assert np.all(np.isfinite(weights))  # fully masked (padding) query rows must not become NaN
  full_mask = np.broadcast_to(np.asarray(mask), weights.shape)
  real_rows = np.broadcast_to(np.asarray(valid)[:, None, :, None], weights.shape)
  assert np.all(weights[~full_mask & real_rows] == 0.0)
  np.testing.assert_allclose(weights.sum(-1), 1.0, rtol=1e-6)
  assert np.all(weights[full_mask] > 0.0)


def test_padded_keys_get_zero_weight_even_when_real_logits_are_extreme():
  # Real logits of -12,000: a "large negative" mask constant such as -1e4 would outweigh them.
  query = jnp.full((1, 1, 1, 4), 100.0)
  key = jnp.concatenate([jnp.full((1, 2, 1, 4), -60.0), jnp.zeros((1, 1, 1, 4))], axis=1)
  mask = attention.padding_mask(jnp.array([[True]]), jnp.array([[True, True, False]]))
  weights = np.asarray(attention.dot_product_attention_weights(query, key, mask))[0, 0, 0]
  np.testing.assert_array_equal(weights, [0.5, 0.5, 0.0])


def test_values_at_padded_keys_do_not_reach_real_queries():
  rng = np.random.default_rng(3)
  batch, length, heads, head_dim = 2, 6, 2, 4
  query, key, value = random_qkv(rng, batch, length, length, heads, head_dim)
  valid = valid_lengths_mask([4, 2], length)
  mask = attention.padding_mask(valid, valid)
  pad = ~np.asarray(valid)[:, :, None, None]
  key2 = jnp.where(pad, 1e3, key)
  value2 = jnp.where(pad, -1e3, value)

  out = np.asarray(attention.dot_product_attention(query, key, value, mask))
  out2 = np.asarray(attention.dot_product_attention(query, key2, value2, mask))

  real = np.asarray(valid)
  np.testing.assert_array_equal(out2[real], out[real])
  assert not np.allclose(np.asarray(attention.dot_product_attention(query, key2, value2)), out)


# ----------------------------------------------------------------------------- mask builders


def test_causal_mask():
  expected = np.array([[1, 0, 0, 0],
                       [1, 1, 0, 0],
                       [1, 1, 1, 0],
                       [1, 1, 1, 1]], dtype=bool)
  mask = attention.causal_mask(4)
  assert mask.shape == (1, 1, 4, 4) and mask.dtype == jnp.bool_
  np.testing.assert_array_equal(np.asarray(mask)[0, 0], expected)


def test_padding_mask():
  query_valid = jnp.array([[True, True, False], [True, False, False]])
  key_valid = jnp.array([[True, False], [True, True]])
  expected = np.array([
      [[1, 0],
       [1, 0],
       [0, 0]],
      [[1, 1],
       [0, 0],
       [0, 0]],
  ], dtype=bool)[:, None]
  mask = attention.padding_mask(query_valid, key_valid)
  assert mask.shape == (2, 1, 3, 2) and mask.dtype == jnp.bool_
  np.testing.assert_array_equal(np.asarray(mask), expected)


def test_segment_mask():
  query_segments = jnp.array([[1, 1, 2, 0]])
  key_segments = jnp.array([[1, 2, 2, 0, 3]])
  expected = np.array([
      [1, 0, 0, 0, 0],
      [1, 0, 0, 0, 0],
      [0, 1, 1, 0, 0],
      [0, 0, 0, 1, 0],  # padding matches padding; the padding mask removes it
  ], dtype=bool)[None, None]
  mask = attention.segment_mask(query_segments, key_segments)
  assert mask.shape == (1, 1, 4, 5) and mask.dtype == jnp.bool_
  np.testing.assert_array_equal(np.asarray(mask), expected)


def test_combine_masks():
  assert attention.combine_masks() is None
  assert attention.combine_masks(None, None) is None
  causal = attention.causal_mask(3)
  np.testing.assert_array_equal(np.asarray(attention.combine_masks(None, causal)),
                                np.asarray(causal))

  valid = jnp.array([[True, True, False], [True, True, True]])
  combined = attention.combine_masks(attention.padding_mask(valid, valid), None, causal)
  expected = np.array([
      [[1, 0, 0],
       [1, 1, 0],
       [0, 0, 0]],
      [[1, 0, 0],
       [1, 1, 0],
       [1, 1, 1]],
  ], dtype=bool)[:, None]
  assert combined.shape == (2, 1, 3, 3)
  np.testing.assert_array_equal(np.asarray(combined), expected)


# ----------------------------------------------------------------------------- module


D_MODEL, HEADS, HEAD_DIM = 32, 4, 8


@pytest.fixture
def init_mha(random_params):
  """Returns `make(inputs_q, inputs_kv=None, **module_fields)` -> (module, params)."""

  def make(inputs_q, inputs_kv=None, **kwargs):
    module = attention.MultiHeadAttention(num_heads=HEADS, d_model=D_MODEL, **kwargs)
    return module, random_params(lambda rng: module.init(rng, inputs_q, inputs_kv))

  return make


def shapes_of(params):
  return jax.tree_util.tree_map(lambda x: tuple(x.shape), params)


def count(params):
  return sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(params))


def random_inputs(seed, batch, length, d_model=D_MODEL):
  return jnp.asarray(np.random.default_rng(seed).normal(size=(batch, length, d_model)), jnp.float32)


OUT = {"kernel": (HEADS, HEAD_DIM, D_MODEL), "bias": (D_MODEL,)}


def test_separate_projections_params(init_mha):
  x = random_inputs(0, 2, 5)
  module, params = init_mha(x)
  projection = {"kernel": (D_MODEL, HEADS, HEAD_DIM), "bias": (HEADS, HEAD_DIM)}
  assert shapes_of(params) == {"query": projection, "key": projection, "value": projection,
                               "out": OUT}
  assert module.apply({"params": params}, x).shape == x.shape


def test_fused_self_attention_params(init_mha):
  x = random_inputs(0, 2, 5)
  module, params = init_mha(x, fused_qkv=True)
  assert shapes_of(params) == {
      "qkv": {"kernel": (D_MODEL, 3, HEADS, HEAD_DIM), "bias": (3, HEADS, HEAD_DIM)}, "out": OUT}
  assert module.apply({"params": params}, x).shape == x.shape


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_grouped_query_attention_shares_each_key_value_head_within_its_group(init_mha, kv_heads):
  x = random_inputs(0, 2, 5)
  valid = valid_lengths_mask([5, 3], 5)
  mask = attention.padding_mask(valid, valid)
  module, params = init_mha(x, num_kv_heads=kv_heads)
  kv = {"kernel": (D_MODEL, kv_heads, HEAD_DIM), "bias": (kv_heads, HEAD_DIM)}
  assert shapes_of(params)["key"] == shapes_of(params)["value"] == kv
  p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), params)
  x64 = np.asarray(x, np.float64)
  project = lambda name: np.einsum("bld,dhk->blhk", x64, p[name]["kernel"]) + p[name]["bias"]
  group = HEADS // kv_heads  # query head h reads key/value head h // group
  expected, _ = reference_attention(project("query"), np.repeat(project("key"), group, axis=2),
                                    np.repeat(project("value"), group, axis=2), mask)
  expected = np.einsum("blhk,hkd->bld", expected, p["out"]["kernel"]) + p["out"]["bias"]
  out = module.apply({"params": params}, x, None, mask)
  real = np.asarray(valid)
  np.testing.assert_allclose(np.asarray(out)[real], expected[real], rtol=1e-5, atol=1e-5)


def test_fused_cross_attention_params(init_mha):
  x, memory = random_inputs(0, 2, 5), random_inputs(1, 2, 7)
  module, params = init_mha(x, memory, fused_qkv=True)
  assert shapes_of(params) == {
      "query": {"kernel": (D_MODEL, HEADS, HEAD_DIM), "bias": (HEADS, HEAD_DIM)},
      "kv": {"kernel": (D_MODEL, 2, HEADS, HEAD_DIM), "bias": (2, HEADS, HEAD_DIM)}, "out": OUT}
  assert module.apply({"params": params}, x, memory).shape == x.shape


@pytest.mark.parametrize("cross", [False, True])
def test_fused_and_separate_projections_compute_the_same_function(init_mha, cross):
  x = random_inputs(0, 2, 5)
  memory = random_inputs(1, 2, 7) if cross else None
  valid_kv = valid_lengths_mask([7, 3] if cross else [5, 3], 7 if cross else 5)
  mask = attention.padding_mask(jnp.ones((2, 5), bool), valid_kv)
  separate, params = init_mha(x, memory)
  fused = attention.MultiHeadAttention(num_heads=HEADS, d_model=D_MODEL, fused_qkv=True)
  stack = lambda names, leaf: jnp.stack([params[n][leaf] for n in names], axis=-3)
  if cross:
    fused_params = {"query": params["query"], "out": params["out"],
                    "kv": {leaf: stack(["key", "value"], leaf) for leaf in ("kernel", "bias")}}
  else:
    fused_params = {"out": params["out"],
                    "qkv": {leaf: stack(["query", "key", "value"], leaf)
                            for leaf in ("kernel", "bias")}}
  assert shapes_of(fused_params) == shapes_of(
      nn.unbox(jax.eval_shape(fused.init, jax.random.PRNGKey(0), x, memory)["params"]))

  np.testing.assert_allclose(
      np.asarray(fused.apply({"params": fused_params}, x, memory, mask)),
      np.asarray(separate.apply({"params": params}, x, memory, mask)), rtol=1e-5, atol=1e-6)


def test_fused_projections_are_initialised_like_separate_ones():
  x = random_inputs(0, 2, 5, d_model=64)
  separate = attention.MultiHeadAttention(num_heads=4, d_model=64)
  fused = attention.MultiHeadAttention(num_heads=4, d_model=64, fused_qkv=True)
  separate_params = nn.unbox(jax.jit(separate.init)(jax.random.PRNGKey(0), x)["params"])
  fused_params = nn.unbox(jax.jit(fused.init)(jax.random.PRNGKey(0), x)["params"])
  separate_std = float(np.std(separate_params["query"]["kernel"]))
  fused_std = float(np.std(fused_params["qkv"]["kernel"]))
  expected = math.sqrt(2.0 / (64 + 64))  # Xavier-uniform of one d_model x d_model projection
  np.testing.assert_allclose(separate_std, expected, rtol=0.1)
  np.testing.assert_allclose(fused_std, expected, rtol=0.1)


@pytest.mark.parametrize("fused_qkv", [False, True])
def test_qkv_bias_off_removes_exactly_the_qkv_biases(init_mha, fused_qkv):
  x = random_inputs(0, 2, 5)
  module, with_bias = init_mha(x, fused_qkv=fused_qkv)
  module_no_bias, without_bias = init_mha(x, fused_qkv=fused_qkv, use_bias=False)
  assert count(with_bias) - count(without_bias) == 3 * D_MODEL
  assert without_bias["out"]["bias"].shape == (D_MODEL,)  # the output projection keeps its bias
  assert module_no_bias.apply({"params": without_bias}, x).shape == x.shape


def test_cross_attention_output_shape_and_dependence_on_memory(init_mha):
  x, memory = random_inputs(0, 3, 4), random_inputs(1, 3, 9)
  module, params = init_mha(x, memory)
  out = module.apply({"params": params}, x, memory)
  assert out.shape == (3, 4, D_MODEL)
  other = module.apply({"params": params}, x, random_inputs(2, 3, 9))
  assert not np.allclose(np.asarray(out), np.asarray(other))


def test_module_attention_weights_ignore_padded_keys(init_mha):
  x = random_inputs(0, 2, 6)
  valid = valid_lengths_mask([6, 3], 6)
  mask = attention.padding_mask(valid, valid)
  module, params = init_mha(x)
  _, state = module.apply({"params": params}, x, None, mask, mutable=["intermediates"])
  (weights,) = state["intermediates"]["attention_weights"]
  assert weights.shape == (2, HEADS, 6, 6)
  assert np.all(np.asarray(weights)[1, :, :3, 3:] == 0.0)
  np.testing.assert_allclose(np.asarray(weights).sum(-1), 1.0, rtol=1e-6)


def test_attention_dropout_only_when_not_deterministic(init_mha):
  x = random_inputs(0, 2, 6)
  module, params = init_mha(x, dropout_rate=0.5)
  no_dropout = attention.MultiHeadAttention(num_heads=HEADS, d_model=D_MODEL)
  apply_jit = jax.jit(module.apply, static_argnames="deterministic")
  apply = lambda deterministic, seed: np.asarray(apply_jit(
      {"params": params}, x, deterministic=deterministic,
      rngs={"dropout": jax.random.PRNGKey(seed)}))

  reference = np.asarray(no_dropout.apply({"params": params}, x))
  np.testing.assert_allclose(apply(True, 1), reference, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(apply(True, 2), apply(True, 1))

  a, b = apply(False, 1), apply(False, 2)
  assert not np.allclose(a, b)
  assert not np.allclose(a, reference)
  np.testing.assert_array_equal(apply(False, 1), a)  # same rng, same mask


@pytest.mark.parametrize("rate,shape", [(0.1, (64, 32, 256)), (0.3, (50, 999)), (0.5, (7,))])
def test_dropout_drops_at_the_rate_and_keeps_the_mean(rate, shape):
  x = jnp.full(shape, 2.0)
  out = np.asarray(attention.dropout(x, rate, jax.random.PRNGKey(0)))
  n = out.size
  dropped = (out == 0.0).mean()
  # Binomial: 5 standard deviations either side (the 7-element case checks only the values).
  assert abs(dropped - rate) <= 5 * math.sqrt(rate * (1 - rate) / n) + (1.0 if n < 100 else 0)
  kept = out[out != 0.0]
  np.testing.assert_allclose(kept, 2.0 / (1.0 - rate), rtol=1e-4)  # keep rounded to 2^-16
  if n > 1000:
    assert abs(out.mean() - 2.0) < 5 * 2.0 * math.sqrt(rate / (1 - rate) / n)


def test_dropout_masks_depend_on_the_key_only():
  x = jnp.ones((16, 64))
  a = np.asarray(attention.dropout(x, 0.5, jax.random.PRNGKey(1)))
  np.testing.assert_array_equal(a, attention.dropout(x, 0.5, jax.random.PRNGKey(1)))
  b = np.asarray(attention.dropout(x, 0.5, jax.random.PRNGKey(2)))
  assert (a != b).mean() > 0.3  # independent masks differ in about half the places
  # The two 16-bit halves of one word are not the same draw: halves of the last axis differ.
  assert (a[:, :32] != a[:, 32:]).mean() > 0.3
  assert np.all(attention.dropout(x, 1e-9, jax.random.PRNGKey(1)) == x)  # rounds to keep all


def test_dropout_gradient_is_the_same_mask():
  x = jnp.arange(1.0, 101.0)
  key = jax.random.PRNGKey(3)
  out = attention.dropout(x, 0.25, key)
  grad = jax.grad(lambda v: attention.dropout(v, 0.25, key).sum())(x)
  np.testing.assert_allclose(grad, np.asarray(out) / np.asarray(x), rtol=1e-6)


@pytest.mark.parametrize("rate", [0.1, 0.3])
def test_bfloat16_dropout_draws_8_bits_at_the_rounded_rate(rate):
  # bfloat16 (accelerators) draws 8 bits per element: the keep probability is 1 - rate rounded
  # to a multiple of 1/256 and the survivors are scaled by its inverse. 2M elements: 5 standard
  # deviations of the drop share are 0.1-0.2 points, finer than the 1/256 grid's rounding.
  keep = round((1 - rate) * 256)
  x = jnp.full((64, 128, 256), 2.0, jnp.bfloat16)
  key = jax.random.PRNGKey(7)
  out = np.asarray(attention.dropout(x, rate, key), np.float32)
  n = out.size
  p_drop = 1 - keep / 256
  assert abs((out == 0).mean() - p_drop) <= 5 * math.sqrt(p_drop * (1 - p_drop) / n)
  scale = float(jnp.asarray(256 / keep, jnp.bfloat16))  # the scale, rounded to bfloat16
  np.testing.assert_array_equal(np.unique(out[out != 0]), [2.0 * scale])
  np.testing.assert_array_equal(attention.dropout(x, rate, key), out)  # a function of the key
  # The gradient applies the same mask and scale.
  grad = jax.grad(lambda v: attention.dropout(v, rate, key).astype(jnp.float32).sum())(x)
  np.testing.assert_array_equal(np.asarray(grad, np.float32), out / 2.0)
  # Independent 8-bit draws: neighbours are dropped together at the square of the rate, not
  # in bytes of one word all together or all apart.
  both = ((out[..., :-1] == 0) & (out[..., 1:] == 0)).mean()
  assert abs(both - p_drop**2) < 0.01


def test_bfloat16_softmax_keeps_bfloat16_weights_with_the_softmax_gradient():
  # model.dtype=bfloat16 attention keeps its weights in bfloat16 for the backward pass: the
  # forward output is the float32 softmax rounded, the gradient that of softmax (float64 here)
  # up to bfloat16 rounding of p; masked keys get exactly zero weight and gradient.
  rng = np.random.default_rng(5)
  logits = rng.normal(size=(2, 3, 4, 6)) * 3
  logits[1, :, :, 4:] = np.finfo(np.float32).min  # masked keys, as _attention_logits masks them
  grad = rng.normal(size=logits.shape)
  x = jnp.asarray(logits, jnp.float32)
  out = attention.softmax_to_bfloat16(x)
  assert out.dtype == jnp.bfloat16
  np.testing.assert_array_equal(out, jax.nn.softmax(x, axis=-1).astype(jnp.bfloat16))
  shifted = np.exp(logits - logits.max(-1, keepdims=True))
  p = shifted / shifted.sum(-1, keepdims=True)
  expected = p * (grad - (grad * p).sum(-1, keepdims=True))  # float64 softmax VJP
  _, vjp = jax.vjp(attention.softmax_to_bfloat16, x)
  (got,) = vjp(jnp.asarray(grad, jnp.bfloat16))
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(got, expected, atol=2e-2 * np.abs(expected).max())
  assert np.all(np.asarray(got)[1, :, :, 4:] == 0)
  # attention_impl=plain_bf16 uses it under bfloat16: its query gradient against float64.
  q, k, v = random_qkv(rng, 2, 5, 7, 3, 8)
  mask = random_mask(rng, (2, 1, 5, 7))
  cotangent = rng.normal(size=(2, 5, 3, 8))

  def loss(query, dtype):
    cast = [a.astype(dtype) for a in (query, k, v)]
    out = attention.dot_product_attention(*cast, mask, implementation="plain_bf16")
    out = out.astype(jnp.float32)
    return jnp.sum(out * cotangent)

  step = 1e-6
  numeric = np.zeros(q.shape)
  q64 = np.asarray(q, np.float64)
  for index in np.ndindex(*q.shape[:1], 1, *q.shape[2:]):  # the first query of each row
    bumped = q64.copy()
    bumped[index] += step
    ahead = (reference_attention(bumped, k, v, mask)[0] * cotangent).sum()
    bumped[index] -= 2 * step
    behind = (reference_attention(bumped, k, v, mask)[0] * cotangent).sum()
    numeric[index] = (ahead - behind) / (2 * step)
  got = np.asarray(jax.grad(loss)(q, jnp.bfloat16), np.float32)[:, :1]
  np.testing.assert_allclose(got, numeric[:, :1], atol=0.05 * np.abs(numeric[:, :1]).max())
  full = np.asarray(jax.grad(loss)(q, jnp.float32))[:, :1]
  np.testing.assert_allclose(full, numeric[:, :1], rtol=1e-3, atol=1e-4)
  # "plain" (the default) keeps the float32 softmax under bfloat16; "plain_bf16" only there.
  def program(implementation, dtype):
    cast = [a.astype(dtype) for a in (q, k, v)]
    return str(jax.make_jaxpr(functools.partial(
        attention.dot_product_attention, implementation=implementation))(*cast, mask))

  assert "custom_vjp" in program("plain_bf16", jnp.bfloat16)
  assert "custom_vjp" not in program("plain", jnp.bfloat16)
  assert "custom_vjp" not in program("plain_bf16", jnp.float32)
