"""model.self_attention=geometric (issue 41): Csordas et al.'s geometric attention against a float64
loop over its definition, its properties (the nearest matching key takes the weight, rows sum to
at most 1, the query itself and padding take nothing), and the model with it: causal, padding-
invariant, different from the softmax, trainable. Cached decoding equals the full model:
tests/test_decode.py's test_cached_steps_match_the_full_model_for_every_option."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from transformer_jax.core.errors import UserError
from transformer_jax.model import ModelConfig, describe, make_model
from transformer_jax.model.attention import geometric_attention_weights
from transformer_jax.tools.hf import convert


def float64_weights(query, key, positions_q, positions_k, mask, bias):
  """A_ij = p_ij prod_{k in S_ij} (1 - p_ik), S_ij the keys searched before j (nearer, or as
  near and earlier), p = sigmoid(q.k / sqrt(d) + bias), 0 at the query's own position and at
  masked keys: loops in float64."""
  q, k = np.asarray(query, np.float64), np.asarray(key, np.float64)
  batch, q_len, heads, depth = q.shape
  k_len = k.shape[1]
  out = np.zeros((batch, heads, q_len, k_len))
  for b in range(batch):
    for h in range(heads):
      for i in range(q_len):
        p = np.zeros(k_len)
        for j in range(k_len):
          d = positions_q[b, i] - positions_k[b, j]
          if d != 0 and mask[b, 0, i, j]:
            p[j] = 1.0 / (1.0 + np.exp(-(q[b, i, h] @ k[b, j, h] / np.sqrt(depth)
                                         + bias[0, h, i, j])))
        for j in range(k_len):
          dj = positions_q[b, i] - positions_k[b, j]
          stay = 1.0
          for m in range(k_len):
            dm = positions_q[b, i] - positions_k[b, m]
            if abs(dm) < abs(dj) or (abs(dm) == abs(dj) and m < j):
              stay *= 1.0 - p[m]
          out[b, h, i, j] = p[j] * stay
  return out


def test_the_weights_are_the_definition_computed_in_float64():
  rng = np.random.default_rng(0)
  batch, length, heads, depth = 2, 7, 3, 4
  query = rng.normal(0, 1.5, (batch, length, heads, depth)).astype(np.float32)
  key = rng.normal(0, 1.5, (batch, length, heads, depth)).astype(np.float32)
  bias = rng.normal(0, 1.0, (1, heads, length, length)).astype(np.float32)
  valid = np.ones((batch, length), bool)
  valid[1, 5:] = False  # the second row's last two keys are padding
  mask = np.broadcast_to(valid[:, None, None, :], (batch, 1, length, length))
  positions = np.broadcast_to(np.arange(length), (batch, length))
  distances = positions[:, :, None] - positions[:, None, :]
  got = np.asarray(geometric_attention_weights(jnp.asarray(query), jnp.asarray(key),
                                               jnp.asarray(distances), jnp.asarray(mask),
                                               jnp.asarray(bias)))
  expected = float64_weights(query, key, positions, positions, mask, bias)
  np.testing.assert_allclose(got, expected, rtol=2e-5, atol=1e-7)
  assert np.all(got.sum(-1) <= 1 + 1e-6)
  assert np.all(np.diagonal(got, axis1=-2, axis2=-1) == 0)  # never the query itself
  assert np.all(got[1, :, :, 5:] == 0)  # nor padding
  # A causal search (keys up to the query only) is the same definition with fewer keys.
  causal = np.tril(np.ones((length, length), bool))[None, None]
  got = np.asarray(geometric_attention_weights(jnp.asarray(query), jnp.asarray(key),
                                               jnp.asarray(distances), jnp.asarray(causal)))
  expected = float64_weights(query, key, positions, positions,
                             np.broadcast_to(causal, (batch, 1, length, length)),
                             np.zeros((1, heads, length, length)))
  np.testing.assert_allclose(got, expected, rtol=2e-5, atol=1e-7)


def test_the_nearest_matching_key_takes_the_weight():
  """Query 3 of 7: logits +30 at keys 1 and 5 (both at distance 2), -30 elsewhere. The earlier
  of the two, key 1, is searched first and takes the weight; key 5 gets almost nothing. With
  key 2 matching too, key 2 (distance 1) takes it."""
  length = 7
  bias = np.full((1, 1, length, length), -30.0, np.float32)
  bias[0, 0, 3, [1, 5]] = 30.0
  zeros = jnp.zeros((1, length, 1, 2))
  distances = jnp.asarray(np.arange(length)[:, None] - np.arange(length)[None, :])[None]
  weights = np.asarray(geometric_attention_weights(zeros, zeros, distances,
                                                   bias=jnp.asarray(bias)))[0, 0, 3]
  assert weights[1] == pytest.approx(1.0, abs=1e-6) and weights[5] < 1e-6
  bias[0, 0, 3, 2] = 30.0
  weights = np.asarray(geometric_attention_weights(zeros, zeros, distances,
                                                   bias=jnp.asarray(bias)))[0, 0, 3]
  assert weights[2] == pytest.approx(1.0, abs=1e-6) and weights[1] < 1e-6


def config(**changes) -> ModelConfig:
  values = dict(vocab_size=20, d_model=16, num_heads=2, num_encoder_layers=2,
                num_decoder_layers=2, d_ff=32, max_len=32, deterministic=True,
                dropout_rate=0.0, self_attention="geometric", positional="relative_xl")
  values.update(changes)
  return ModelConfig(**values).validate()


@pytest.mark.parametrize("arch", ["encoder_decoder", "decoder_only", "encoder_only"])
def test_the_model_is_causal_padding_invariant_and_not_the_softmax(arch):
  cfg = config(arch=arch)
  model = make_model(cfg)
  # Jitted: one compiled program per model and shape instead of one dispatch per operation.
  apply = jax.jit(model.apply)
  softmax_apply = jax.jit(make_model(cfg.replace(self_attention="softmax")).apply)
  rng = np.random.default_rng(1)
  source = jnp.asarray(rng.integers(3, 20, (2, 6)), jnp.int32)
  target = jnp.asarray(rng.integers(3, 20, (2, 8)), jnp.int32)
  if arch == "encoder_only":
    params = jax.jit(model.init)(jax.random.key(0), source)["params"]
    out = apply({"params": params}, source)
    padded = apply({"params": params}, jnp.pad(source, ((0, 0), (0, 3))))
    np.testing.assert_allclose(padded[:, :6], out, atol=1e-5)
    softmax = softmax_apply({"params": params}, source)
    assert not np.allclose(out, softmax, atol=1e-3)
    return
  params = jax.jit(model.init)(jax.random.key(0), source, target)["params"]
  out = apply({"params": params}, source, target)
  changed = target.at[:, 5:].set(3)  # later tokens changed: earlier logits unchanged
  np.testing.assert_allclose(apply({"params": params}, source, changed)[:, :5], out[:, :5],
                             atol=1e-5)
  padded = apply({"params": params}, jnp.pad(source, ((0, 0), (0, 3))),
                 jnp.pad(target, ((0, 0), (0, 2))))
  np.testing.assert_allclose(padded[:, :8], out, atol=1e-5)
  softmax = softmax_apply({"params": params}, source, target)
  assert not np.allclose(out, softmax, atol=1e-3)
  assert "geometric self-attention" in describe(cfg)


def test_a_model_with_it_learns_to_reverse_short_sequences():
  """An encoder-decoder with geometric self-attention, trained with Adam for 300 steps, copies
  4-token sources reversed: each output token's nearest source neighbour decides it."""
  cfg = config(num_encoder_layers=1, num_decoder_layers=1, d_model=32, d_ff=64)
  model = make_model(cfg)
  rng = np.random.default_rng(2)

  def batch():
    source = rng.integers(3, 20, (64, 4))
    target = np.concatenate([np.ones((64, 1), np.int64), source[:, ::-1]], axis=1)
    return jnp.asarray(source, jnp.int32), jnp.asarray(target, jnp.int32)

  source, target = batch()
  params = jax.jit(model.init)(jax.random.key(0), source, target[:, :-1])["params"]
  optimizer = optax.adam(3e-3)
  state = optimizer.init(params)

  @jax.jit
  def step(params, state, source, target):
    def loss(p):
      logits = model.apply({"params": p}, source, target[:, :-1])
      return optax.softmax_cross_entropy_with_integer_labels(logits, target[:, 1:]).mean()
    value, grads = jax.value_and_grad(loss)(params)
    updates, state = optimizer.update(grads, state)
    return optax.apply_updates(params, updates), state, value

  for _ in range(300):
    params, state, value = step(params, state, *batch())
  source, target = batch()
  predicted = np.argmax(jax.jit(model.apply)({"params": params}, source, target[:, :-1]), -1)
  assert np.mean(predicted == np.asarray(target[:, 1:])) > 0.9


def test_an_unknown_self_attention_is_refused_in_one_line():
  with pytest.raises(UserError, match="self_attention"):
    config(self_attention="sigmoid")


def test_export_to_hugging_face_refuses_it():
  with pytest.raises(UserError, match="model.self_attention.*'geometric'"):
    convert._target(config())
