"""Positional encodings, the feed-forward network and the residual/LayerNorm wiring."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.model import ModelConfig, attention, layers, param_shapes
from transformer_jax.model import positions as positions_lib


def small_config(**changes) -> ModelConfig:
  values = dict(vocab_size=20, d_model=4, num_heads=1, num_encoder_layers=1, num_decoder_layers=1,
                d_ff=8, max_len=6, position_base=100.0, deterministic=True)
  values.update(changes)
  return ModelConfig(**values).validate()


def random_inputs(seed, shape):
  return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


# PE[pos, 2i] = sin(pos / 100^(2i/4)), PE[pos, 2i+1] = cos(pos / 100^(2i/4));
# the two frequencies are 100^0 = 1 and 100^(2/4) = 10.
PE_4x4_BASE_100 = [
    [math.sin(0), math.cos(0), math.sin(0 / 10), math.cos(0 / 10)],
    [math.sin(1), math.cos(1), math.sin(1 / 10), math.cos(1 / 10)],
    [math.sin(2), math.cos(2), math.sin(2 / 10), math.cos(2 / 10)],
    [math.sin(3), math.cos(3), math.sin(3 / 10), math.cos(3 / 10)],
]


def test_sinusoidal_positions_closed_form():
  table = positions_lib.sinusoidal_positions(4, 4, base=100)
  assert table.shape == (4, 4) and table.dtype == np.float32
  np.testing.assert_allclose(table, np.array(PE_4x4_BASE_100), rtol=1e-6, atol=1e-7)


def test_sinusoidal_positions_default_base_is_the_papers():
  # d_model 6: frequencies 1, 10000^(-2/6), 10000^(-4/6); PE[5, 4] = sin(5 / 10000^(4/6)).
  table = positions_lib.sinusoidal_positions(8, 6)
  np.testing.assert_allclose(table[5, 4], math.sin(5 / 10000 ** (4 / 6)), rtol=1e-6)
  np.testing.assert_allclose(table[7, 3], math.cos(7 / 10000 ** (2 / 6)), rtol=1e-6)


def test_sinusoidal_add_positions_takes_rows_at_the_given_positions():
  cfg = small_config()
  module = positions_lib.AddPositions(cfg)
  x = jnp.ones((2, 3, 4))
  positions = jnp.array([[3, 0, 2], [1, 1, 0]])
  variables = module.init(jax.random.PRNGKey(0), x, positions)
  assert not variables.get("params")  # sinusoidal positions are a constant, not a parameter
  out = module.apply(variables, x, positions)
  expected = 1.0 + np.array(PE_4x4_BASE_100)[np.asarray(positions)]
  np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-6, atol=1e-6)


def test_learned_positions_are_a_table_param(random_params):
  cfg = small_config(positional="learned", d_model=8, max_len=5)
  module = positions_lib.AddPositions(cfg)
  x = jnp.zeros((2, 3, 8))
  positions = jnp.array([[4, 0, 2], [1, 1, 3]])
  params = random_params(lambda rng: module.init(rng, x, positions))
  assert jax.tree_util.tree_map(lambda p: p.shape, params) == {"table": (5, 8)}
  out = module.apply({"params": params}, x, positions)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(params["table"])[np.asarray(positions)])


def test_feed_forward_matches_numpy_reference(random_params):
  cfg = small_config(d_model=8, num_heads=2, d_ff=16)
  x = random_inputs(1, (2, 3, 8))
  module = layers.FeedForward(cfg)
  params = random_params(lambda rng: module.init(rng, x, True))
  assert jax.tree_util.tree_map(lambda p: p.shape, params) == {
      "wi": {"kernel": (8, 16), "bias": (16,)}, "wo": {"kernel": (16, 8), "bias": (8,)}}
  p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), params)
  hidden = np.maximum(np.asarray(x, np.float64) @ p["wi"]["kernel"] + p["wi"]["bias"], 0.0)
  expected = hidden @ p["wo"]["kernel"] + p["wo"]["bias"]
  np.testing.assert_allclose(np.asarray(module.apply({"params": params}, x, True)), expected,
                             rtol=1e-5, atol=1e-5)


def layer_norm(x, eps=1e-6):
  """LayerNorm with the initial scale 1 and bias 0, in float64."""
  x = np.asarray(x, np.float64)
  mean = x.mean(-1, keepdims=True)
  return (x - mean) / np.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + eps)


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_residual_wiring(norm):
  cfg = small_config(d_model=8, num_heads=2, norm=norm)
  x = random_inputs(0, (2, 3, 8)) * 3.0 + 1.0
  sublayer = lambda h: 2.0 * h + 0.5
  module = layers.Residual(cfg)
  params = module.init(jax.random.PRNGKey(0), x, sublayer)["params"]
  out = np.asarray(module.apply({"params": params}, x, sublayer))
  x64 = np.asarray(x, np.float64)
  if norm == "post":  # LayerNorm(x + Sublayer(x))
    expected = layer_norm(x64 + (2.0 * x64 + 0.5))
  else:  # x + Sublayer(LayerNorm(x))
    expected = x64 + (2.0 * layer_norm(x64) + 0.5)
  np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_residual_gate_mixes_input_and_update_by_a_sigmoid_of_the_sublayer_input(random_params,
                                                                                  norm):
  """model.residual_gate: x' = g u + (1 - g) x, g = sigmoid(h W + b), h the sublayer's input,
  in float64; the gate's bias starts at GATE_BIAS (nearly a copy of x at initialisation)."""
  cfg = small_config(d_model=8, num_heads=2, norm=norm, residual_gate=True)
  x = random_inputs(0, (2, 3, 8)) * 3.0 + 1.0
  sublayer = lambda h: 2.0 * h + 0.5
  module = layers.Residual(cfg)
  initial = module.init(jax.random.PRNGKey(0), x, sublayer)["params"]
  np.testing.assert_array_equal(np.asarray(initial["gate"]["bias"].unbox()), layers.GATE_BIAS)
  params = random_params(lambda rng: module.init(rng, x, sublayer))
  out = np.asarray(module.apply({"params": params}, x, sublayer))
  p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), params)
  x64 = np.asarray(x, np.float64)
  scale, bias = p["norm"]["scale"], p["norm"]["bias"]
  h = layer_norm(x64) * scale + bias if norm == "pre" else x64
  g = 1.0 / (1.0 + np.exp(-(h @ p["gate"]["kernel"] + p["gate"]["bias"])))
  mixed = g * (2.0 * h + 0.5) + (1.0 - g) * x64
  expected = layer_norm(mixed) * scale + bias if norm == "post" else mixed
  np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
  assert 0.05 < g.mean() < 0.95  # the check is not of a gate stuck open or shut


def test_post_and_pre_layer_norm_differ_with_the_same_params(random_params):
  post, pre = small_config(d_model=16, num_heads=2, d_ff=32), small_config(
      d_model=16, num_heads=2, d_ff=32, norm="pre")
  x = random_inputs(1, (2, 5, 16))
  valid = jnp.array([[True] * 5, [True] * 3 + [False] * 2])
  mask = attention.padding_mask(valid, valid)
  params = random_params(lambda rng: layers.EncoderLayer(post).init(rng, x, mask, True))
  # Same parameter tree either way: only the order of LayerNorm and the residual add changes.
  assert jax.tree_util.tree_structure(params) == jax.tree_util.tree_structure(
      random_params(lambda rng: layers.EncoderLayer(pre).init(rng, x, mask, True)))
  out_post = layers.EncoderLayer(post).apply({"params": params}, x, mask, True)
  out_pre = layers.EncoderLayer(pre).apply({"params": params}, x, mask, True)
  assert out_post.shape == out_pre.shape == x.shape
  assert not np.allclose(np.asarray(out_post), np.asarray(out_pre), atol=1e-3)
  # Post-LN ends in a LayerNorm, so every position has the norm's bias as its mean (LayerNorm's
  # scale and bias act per feature); pre-LN ends in a residual add and keeps the input's scale.
  ffn_norm = params["ffn_block"]["norm"]
  normalised = (np.asarray(out_post) - np.asarray(ffn_norm["bias"])) / np.asarray(ffn_norm["scale"])
  np.testing.assert_allclose(normalised.mean(-1), 0.0, atol=1e-4)
  np.testing.assert_allclose(normalised.std(-1), 1.0, atol=1e-3)
  assert not np.allclose(np.asarray(out_pre).std(-1), 1.0, atol=1e-1)


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_only_pre_layer_norm_has_final_norms(tiny_config, norm):
  params = param_shapes(tiny_config.replace(norm=norm))
  for stack in ("encoder", "decoder"):
    assert ("final_norm" in params[stack]) == (norm == "pre")
    if norm == "pre":
      assert params[stack]["final_norm"]["scale"].shape == (tiny_config.d_model,)


# ----------------------------------------------------------------------------- RMSNorm, gated FFN


def test_rms_norm_is_x_over_its_root_mean_square_times_the_scale(random_params):
  cfg = small_config(d_model=8, num_heads=2, norm_type="rmsnorm")
  x = random_inputs(2, (2, 3, 8)) * 3.0 + 1.0
  module = layers.norm_layer(cfg, "norm")
  params = random_params(lambda rng: module.init(rng, x))
  assert jax.tree_util.tree_map(lambda p: p.shape, params) == {"scale": (8,)}  # no bias
  x64 = np.asarray(x, np.float64)
  expected = x64 / np.sqrt((x64**2).mean(-1, keepdims=True) + 1e-6) * np.asarray(params["scale"])
  np.testing.assert_allclose(np.asarray(module.apply({"params": params}, x)), expected,
                             rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("activation, nonlinearity", [
    ("swiglu", lambda z: z / (1.0 + np.exp(-z))),  # swish = SiLU
    ("geglu", lambda z: 0.5 * z * (1.0 + np.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z**3))))])
def test_gated_feed_forward_matches_numpy_reference(random_params, activation, nonlinearity):
  cfg = small_config(d_model=8, num_heads=2, d_ff=16, activation=activation)
  x = random_inputs(1, (2, 3, 8))
  module = layers.FeedForward(cfg)
  params = random_params(lambda rng: module.init(rng, x, True))
  dense = {"kernel": (8, 16), "bias": (16,)}
  assert jax.tree_util.tree_map(lambda p: p.shape, params) == {
      "wi_gate": dense, "wi": dense, "wo": {"kernel": (16, 8), "bias": (8,)}}
  p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), params)
  x64 = np.asarray(x, np.float64)
  gate = nonlinearity(x64 @ p["wi_gate"]["kernel"] + p["wi_gate"]["bias"])
  expected = (gate * (x64 @ p["wi"]["kernel"] + p["wi"]["bias"])) @ p["wo"]["kernel"] + p["wo"][
      "bias"]
  np.testing.assert_allclose(np.asarray(module.apply({"params": params}, x, True)), expected,
                             rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_parallel_block_sums_attention_and_ffn_of_the_same_input(random_params, norm):
  cfg = small_config(d_model=8, num_heads=2, d_ff=16, norm=norm, parallel_block=True)
  x = random_inputs(3, (2, 4, 8))
  valid = jnp.array([[True] * 4, [True] * 2 + [False] * 2])
  mask = attention.padding_mask(valid, valid)
  params = random_params(lambda rng: layers.EncoderLayer(cfg).init(rng, x, mask, True))
  assert set(params) == {"self_attention", "ffn", "parallel_block"}  # one norm for both
  out = np.asarray(layers.EncoderLayer(cfg).apply({"params": params}, x, mask, True))
  norm_module = layers.norm_layer(cfg, "norm")
  normed = norm_module.apply({"params": params["parallel_block"]["norm"]}, x)
  attend = lambda h: layers.attention(cfg, "a").apply({"params": params["self_attention"]}, h,
                                                      None, mask)
  ffn = lambda h: layers.FeedForward(cfg).apply({"params": params["ffn"]}, h, True)
  if norm == "pre":  # x + Attention(LN(x)) + FFN(LN(x))
    expected = x + attend(normed) + ffn(normed)
  else:  # LN(x + Attention(x) + FFN(x))
    expected = norm_module.apply({"params": params["parallel_block"]["norm"]},
                                 x + attend(x) + ffn(x))
  np.testing.assert_allclose(out, np.asarray(expected), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- rotary, T5 bias


def test_rotary_rotates_feature_pairs_by_position_times_wavelength():
  x = random_inputs(4, (1, 3, 2, 8))
  positions = jnp.array([[0, 5, 2]])
  out = np.asarray(positions_lib.apply_rotary(x, positions, base=100.0))
  x64 = np.asarray(x, np.float64)
  for t, position in enumerate([0, 5, 2]):
    for i in range(4):  # pairs (i, i + 4), angle position / 100^(i/4)
      angle = position / 100.0 ** (i / 4)
      a, b = x64[0, t, :, i], x64[0, t, :, i + 4]
      np.testing.assert_allclose(out[0, t, :, i], a * math.cos(angle) - b * math.sin(angle),
                                 atol=1e-5)
      np.testing.assert_allclose(out[0, t, :, i + 4], b * math.cos(angle) + a * math.sin(angle),
                                 atol=1e-5)


def test_rotary_scores_depend_on_the_distance_only():
  q, k = random_inputs(5, (1, 1, 1, 16)), random_inputs(6, (1, 1, 1, 16))

  def score(m, n):
    rotated_q = positions_lib.apply_rotary(q, jnp.array([[m]]))
    rotated_k = positions_lib.apply_rotary(k, jnp.array([[n]]))
    return float(jnp.sum(rotated_q * rotated_k))

  assert score(7, 3) == pytest.approx(score(4, 0), abs=1e-4)
  assert score(30, 11) == pytest.approx(score(19, 0), abs=1e-4)
  assert score(7, 3) != pytest.approx(score(7, 4), abs=1e-3)


def test_relative_buckets_are_exact_near_and_logarithmic_far():
  bucket = lambda distance, bidirectional: int(positions_lib.relative_position_bucket(
      jnp.asarray(-distance), bidirectional, 32, 128))  # distance = query - key position
  # Bidirectional: 16 buckets per direction, 8 of them exact; keys after the query get 16-31.
  assert [bucket(d, True) for d in range(8)] == list(range(8))
  assert [bucket(-d, True) for d in range(1, 8)] == list(range(17, 24))
  # Beyond: 8 + floor(log(d / 8) / log(128 / 8) * 8); at and past max_distance, the last.
  assert [bucket(d, True) for d in (8, 16, 32, 127, 128, 10_000)] == [8, 10, 12, 15, 15, 15]
  assert bucket(-10_000, True) == 31
  # Causal: all 32 buckets for keys before the query (16 exact: 16 + floor(log(32 / 16) /
  # log(128 / 16) * 16) = 21), later keys share bucket 0.
  assert [bucket(d, False) for d in (0, 15, 16, 32, 127, 128)] == [0, 15, 16, 21, 31, 31]
  assert bucket(-5, False) == 0


def test_relative_bias_reads_the_table_at_the_bucket_of_each_pair(random_params):
  cfg = small_config(d_model=8, num_heads=2, positional="relative_bias", relative_buckets=8,
                     relative_max_distance=16)
  module = positions_lib.RelativePositionBias(cfg, bidirectional=True)
  query_positions, key_positions = jnp.array([[0, 3, 9]]), jnp.array([[0, 1, 2, 3]])
  params = random_params(lambda rng: module.init(rng, query_positions, key_positions))
  assert params["table"].shape == (8, 2)  # buckets x heads
  bias = np.asarray(module.apply({"params": params}, query_positions, key_positions))
  assert bias.shape == (1, 2, 3, 4)
  for q, query in enumerate([0, 3, 9]):
    for k, key in enumerate([0, 1, 2, 3]):
      b = int(positions_lib.relative_position_bucket(jnp.asarray(key - query), True, 8, 16))
      np.testing.assert_allclose(bias[0, :, q, k], np.asarray(params["table"])[b])
