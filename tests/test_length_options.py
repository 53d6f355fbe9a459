"""The options for length generalisation (issue 29): Transformer-XL relative attention
(model.positional=relative_xl) against a float64 NumPy formula, randomised training positions
(model.random_positions_max) and weight-shared layers (model.share_layers). Cached decoding of
each option is checked with the others in test_decode.py, the FLOP formula in test_flops.py."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.core.errors import UserError
from transformer_jax.model import ModelConfig, count_params, describe, make_model, param_shapes
from transformer_jax.model import attention as attention_lib
from transformer_jax.model import positions as positions_lib
from transformer_jax.model import transformer as transformer_lib
from transformer_jax.model.transformer import init_boxed_params
from transformer_jax.train.sharding import RULES

D_MODEL, HEADS, HEAD_DIM, BASE = 8, 2, 4, 100.0


def config(arch="encoder_decoder", **changes) -> ModelConfig:
  """2+2 layers, d_model 16, 2 heads, vocab 30, pre-LN, dropout off."""
  values = dict(vocab_size=30, arch=arch, d_model=16, num_heads=2, num_encoder_layers=2,
                num_decoder_layers=2, d_ff=32, max_len=24, norm="pre", deterministic=True,
                dropout_rate=0.0)
  values.update(changes)
  return ModelConfig(**values).validate()


def numpy_params(shapes, seed=0):
  """normal(0, 0.5) parameters (norm scales 1 + normal(0, 0.1)) shaped like `shapes`."""
  rng = np.random.default_rng(seed)

  def draw(path, leaf):
    noise = rng.normal(size=leaf.shape)
    value = 1.0 + 0.1 * noise if path[-1].key == "scale" else 0.5 * noise
    return jnp.asarray(value, jnp.float32)

  return jax.tree_util.tree_map_with_path(draw, shapes)


def tokens(seed, shape, vocab=30):
  return jnp.asarray(np.random.default_rng(seed).integers(3, vocab, size=shape), jnp.int32)


@functools.lru_cache(maxsize=None)
def apply_fn(cfg: ModelConfig):
  """A jitted (params, source, decoder_inputs, rng, **kwargs) -> logits, one per config."""
  model = make_model(cfg)
  return jax.jit(lambda params, source, inputs, rng, **kwargs: model.apply(
      {"params": params}, source, inputs, rngs={"dropout": rng}, **kwargs),
      compiler_options={"xla_backend_optimization_level": 0})  # compiling dominates


# ----------------------------------------------------------------------------- relative_xl


def reference_relative_xl(x, positions, p, causal):
  """Transformer-XL's attention weights and output in float64, written from the paper:
  A_ij = [(q_i + u).k_j + (q_i + v).(W_r R_{i-j})] / sqrt(head_dim), R_t[k] = sin(t w_k) and
  R_t[d/2 + k] = cos(t w_k) with w_k = BASE^(-2k/d); softmax over j (j <= i when causal)."""
  f = {name: np.asarray(value, np.float64) for name, value in p.items()}
  q = np.einsum("ld,dhk->lhk", x, f["query_kernel"]) + f["query_bias"]
  k = np.einsum("ld,dhk->lhk", x, f["key_kernel"]) + f["key_bias"]
  v_ = np.einsum("ld,dhk->lhk", x, f["value_kernel"]) + f["value_bias"]
  n = len(positions)
  logits = np.zeros((HEADS, n, n))
  w = BASE ** (-np.arange(0, D_MODEL, 2) / D_MODEL)
  for i in range(n):
    for j in range(n):
      t = positions[i] - positions[j]
      r = np.concatenate([np.sin(t * w), np.cos(t * w)])
      wr = np.einsum("d,dhk->hk", r, f["position_kernel"])
      for h in range(HEADS):
        logits[h, i, j] = ((q[i, h] + f["content_bias"][h]) @ k[j, h]
                           + (q[i, h] + f["position_bias"][h]) @ wr[h]) / np.sqrt(HEAD_DIM)
  if causal:
    logits = np.where(np.tril(np.ones((n, n), bool)), logits, -np.inf)
  weights = np.exp(logits - logits.max(-1, keepdims=True))
  weights /= weights.sum(-1, keepdims=True)
  heads = np.einsum("hij,jhk->ihk", weights, v_)
  return weights, np.einsum("ihk,hkd->id", heads, f["out_kernel"]) + f["out_bias"]


@pytest.mark.parametrize("causal, positions, span", [
    (False, [0, 1, 2, 3, 4], 0),
    (True, [0, 1, 2, 3, 4], 0),
    # Positions beyond the length (randomised ones) need the span of distances they reach.
    (False, [3, 4, 9, 12, 20], 21),
])
def test_relative_xl_attention_equals_the_float64_formula(causal, positions, span):
  x = jnp.asarray(np.random.default_rng(0).normal(size=(1, 5, D_MODEL)), jnp.float32)
  module = attention_lib.MultiHeadAttention(num_heads=HEADS, d_model=D_MODEL,
                                            relative_base=BASE, relative_bidirectional=not causal,
                                            relative_span=span)
  pos = jnp.asarray([positions], jnp.int32)
  distances = pos[:, :, None] - pos[:, None, :]
  shapes = jax.eval_shape(lambda r: module.init(r, x, distances=distances),
                          jax.random.PRNGKey(0))["params"]
  params = numpy_params(nn.unbox(shapes), seed=1)
  assert params["position"]["kernel"].shape == (D_MODEL, HEADS, HEAD_DIM)  # W_r
  assert params["content_bias"].shape == params["position_bias"].shape == (HEADS, HEAD_DIM)
  mask = attention_lib.causal_mask(5) if causal else None
  out, sown = module.apply({"params": params}, x, None, mask, distances=distances,
                           mutable=["intermediates"])
  flat = {"_".join(k.key for k in path): leaf
          for path, leaf in jax.tree_util.tree_leaves_with_path(params)}
  weights, expected = reference_relative_xl(np.asarray(x[0], np.float64), positions, flat,
                                            causal)
  got = sown["intermediates"]["attention_weights"][0][0]
  np.testing.assert_allclose(got, weights, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(out[0], expected, rtol=1e-4, atol=1e-4)


def test_relative_position_logits_look_up_each_pairs_distance():
  rng = np.random.default_rng(0)
  query = jnp.asarray(rng.normal(size=(1, 3, 2, 4)), jnp.float32)
  embeddings = jnp.asarray(rng.normal(size=(5, 2, 4)), jnp.float32)  # distances -2 .. 2
  pos = jnp.asarray([[0, 1, 2]])
  got = positions_lib.relative_position_logits(query, embeddings,
                                               pos[:, :, None] - pos[:, None, :], -2)
  assert got.shape == (1, 2, 3, 3)
  for i in range(3):
    for j in range(3):
      want = np.einsum("hd,hd->h", query[0, i], embeddings[i - j + 2])
      np.testing.assert_allclose(got[0, :, i, j], want, rtol=1e-5, atol=1e-5)


def test_relative_xl_has_no_absolute_positions_a_shift_changes_nothing():
  cfg = config(positional="relative_xl")
  params = numpy_params(param_shapes(cfg))
  source, inputs = tokens(0, (2, 6)), tokens(1, (2, 5))
  apply = apply_fn(cfg)
  base = apply(params, source, inputs, jax.random.PRNGKey(0))
  assert base.shape == (2, 5, cfg.vocab_size)
  shift = lambda n: jnp.broadcast_to(jnp.arange(n) + 7, (2, n))  # noqa: E731
  shifted = apply(params, source, inputs, jax.random.PRNGKey(0), source_positions=shift(6),
                  target_positions=shift(5))
  np.testing.assert_allclose(shifted, base, rtol=1e-5, atol=1e-5)
  assert "positions" not in params["encoder"]  # no table at the input
  # ... while the model does tell positions apart: reversing the source changes the output.
  assert not np.allclose(apply(params, source[:, ::-1], inputs, jax.random.PRNGKey(0)), base,
                         atol=1e-3)


@pytest.mark.parametrize("arch", ["encoder_decoder", "decoder_only"])
def test_relative_xl_decoder_is_causal(arch):
  cfg = config(arch, positional="relative_xl")
  params = numpy_params(param_shapes(cfg))
  source, inputs = tokens(0, (2, 6)), tokens(1, (2, 7))
  apply = apply_fn(cfg)
  base = np.asarray(apply(params, source, inputs, jax.random.PRNGKey(0)))
  t = 3
  changed = inputs.at[:, t + 1:].set(inputs[:, t + 1:] % 29 + 1)
  logits = np.asarray(apply(params, source, changed, jax.random.PRNGKey(0)))
  np.testing.assert_allclose(logits[:, :t + 1], base[:, :t + 1], rtol=0, atol=1e-5)
  assert not np.allclose(logits[:, t + 1:], base[:, t + 1:], atol=1e-3)


def test_relative_xl_parameters_are_named_for_the_sharding_rules():
  cfg = config(positional="relative_xl", d_model=32, num_heads=4)
  boxed = jax.eval_shape(lambda r: init_boxed_params(cfg, r), jax.random.PRNGKey(0))
  specs = nn.logical_to_mesh(nn.get_partition_spec(boxed), RULES)
  for stack, block in (("encoder", "self_attention"), ("decoder", "self_attention")):
    attention = specs[stack]["layer_0"][block]
    assert attention["position"]["kernel"] == jax.sharding.PartitionSpec("fsdp", "tensor", None)
    assert attention["content_bias"] == jax.sharding.PartitionSpec("tensor", None)
    assert attention["position_bias"] == jax.sharding.PartitionSpec("tensor", None)
  # Cross-attention reads content only.
  assert "position" not in specs["decoder"]["layer_0"]["cross_attention"]
  assert "relative_xl positions" in describe(cfg)


# ----------------------------------------------------------------------------- random positions


def test_random_positions_are_sorted_distinct_and_in_range():
  positions = jnp.asarray([[0, 1, 2, 3, 4, 5], [0, 1, 2, 0, 1, -1]], jnp.int32)  # packed, pad
  drawn = np.asarray(positions_lib.random_positions(jax.random.PRNGKey(3), positions, 40))
  assert drawn.dtype == np.int32 and ((drawn[:, :5] >= 0) & (drawn[:, :5] < 40)).all()
  assert (np.diff(drawn[0]) > 0).all()  # sorted and distinct
  np.testing.assert_array_equal(drawn[1, 3:5], drawn[1, :2])  # each example starts the draw
  assert (np.diff(drawn[1, :3]) > 0).all() and drawn[1, 5] == -1  # padding stays
  again = positions_lib.random_positions(jax.random.PRNGKey(3), positions, 40)
  np.testing.assert_array_equal(again, drawn)  # a function of the key
  other = positions_lib.random_positions(jax.random.PRNGKey(4), positions, 40)
  assert not np.array_equal(other, drawn)
  # Over many draws every position of the range is used, the largest too.
  many = positions_lib.random_positions(jax.random.PRNGKey(0), jnp.zeros((200, 6), jnp.int32)
                                        + jnp.arange(6), 40)
  assert set(np.unique(many)) == set(range(40))
  with pytest.raises(UserError, match="random_positions_max=4"):
    positions_lib.random_positions(jax.random.PRNGKey(0), positions, 4)


@pytest.mark.parametrize("arch, positional", [("encoder_decoder", "sinusoidal"),
                                              ("decoder_only", "rotary"),
                                              ("encoder_decoder", "relative_xl")])
def test_random_positions_train_only(arch, positional):
  off = config(arch, positional=positional)
  on = off.replace(random_positions_max=64)
  params = numpy_params(param_shapes(off))
  source, inputs = tokens(0, (2, 6)), tokens(1, (2, 5))
  key = jax.random.PRNGKey(0)
  evaluated = apply_fn(off)(params, source, inputs, key)
  # Evaluation (deterministic) reads positions 0, 1, ...: the same function as without.
  np.testing.assert_allclose(apply_fn(on)(params, source, inputs, key), evaluated, atol=1e-6)
  # Training draws positions from the dropout stream (dropout itself is off here).
  train = apply_fn(on.replace(deterministic=False))
  first = train(params, source, inputs, key)
  np.testing.assert_array_equal(train(params, source, inputs, key), first)
  assert not np.allclose(first, evaluated, atol=1e-3)
  assert not np.allclose(train(params, source, inputs, jax.random.PRNGKey(1)), first, atol=1e-3)


@pytest.mark.parametrize("arch, positional", [("decoder_only", "rotary"),
                                              ("encoder_decoder", "relative_xl")])
def test_random_positions_at_evaluation_are_a_fixed_draw_of_max_len(arch, positional):
  """model.random_positions_eval: evaluation reads the positions of one fixed draw of max_len
  from [0, random_positions_max) per row, the same in every call (deterministic), not 0, 1, ...
  The model with those positions given explicitly is the same function."""
  off = config(arch, positional=positional)
  on = off.replace(random_positions_max=64, random_positions_eval=True)
  params = numpy_params(param_shapes(off))
  source, inputs = tokens(0, (2, 6)), tokens(1, (2, 5))
  key = jax.random.PRNGKey(0)
  evaluated = apply_fn(on)(params, source, inputs, key)
  np.testing.assert_array_equal(apply_fn(on)(params, source, inputs, jax.random.PRNGKey(1)),
                                evaluated)  # not drawn from the run's random stream
  assert not np.allclose(apply_fn(off)(params, source, inputs, key), evaluated, atol=1e-3)
  # The draw: max_len (24) sorted distinct positions of [0, 64) per row; position p reads the
  # p-th. Given as explicit positions to the model without the option, the same logits.
  drawn = np.asarray(positions_lib.random_positions(
      jax.random.PRNGKey(transformer_lib.EVAL_POSITIONS_KEY), jnp.zeros((2, 24), jnp.int32)
      + jnp.arange(24), 64))
  assert (np.diff(drawn, axis=1) > 0).all() and drawn.max() < 64 and drawn[:, -1].min() > 23
  if arch == "decoder_only":
    # Rotary, with these positions given explicitly to the model without the option: the same
    # logits. The model reads "source target" as one sequence: its target positions are given
    # from 0 and follow the source's 6. (relative_xl without the option embeds no distance past
    # max_len at evaluation; its draws are checked against cached decoding in test_decode.py.)
    explicit = apply_fn(off)(params, source, inputs, key,
                             source_positions=jnp.asarray(drawn[:, :6]),
                             target_positions=jnp.asarray(drawn[:, 6:11] - 6))
    np.testing.assert_allclose(explicit, evaluated, atol=1e-5)
  with pytest.raises(UserError, match="random_positions_eval"):
    off.replace(random_positions_eval=True).validate()
  assert "in training and evaluation" in describe(on)


def test_random_positions_widen_a_learned_table_and_are_validated():
  cfg = config(positional="learned", random_positions_max=64)
  assert param_shapes(cfg)["encoder"]["positions"]["table"].shape == (64, 16)
  assert "drawn from [0, 64) in training" in describe(cfg)
  with pytest.raises(UserError, match="at least model.max_len"):
    config(random_positions_max=10)
  with pytest.raises(UserError, match="positional=none"):
    config(random_positions_max=64, positional="none")


# ----------------------------------------------------------------------------- shared layers


@pytest.mark.parametrize("arch", ["encoder_decoder", "decoder_only"])
def test_shared_layers_have_one_layers_parameters(arch):
  shared = config(arch, share_layers=True, num_encoder_layers=3, num_decoder_layers=3)
  one = config(arch, num_encoder_layers=1, num_decoder_layers=1)
  shapes = param_shapes(shared)
  assert count_params(shapes) == count_params(param_shapes(one))
  assert "shared_layer" in shapes["decoder"] and "layer_0" not in shapes["decoder"]
  assert "3 layers (one shared layer per stack)" in describe(shared)


@pytest.mark.parametrize("arch, changes", [
    ("encoder_decoder", dict(positional="relative_xl")),
    ("decoder_only", dict(positional="rotary", norm="post"))])
def test_shared_layers_equal_one_layer_applied_n_times(arch, changes):
  shared = config(arch, share_layers=True, num_encoder_layers=3, num_decoder_layers=3, **changes)
  separate = shared.replace(share_layers=False)
  params = numpy_params(param_shapes(shared))
  copied = jax.tree.map(lambda x: x, params)
  for stack in ("encoder", "decoder"):
    if stack in copied:
      layer = copied[stack].pop("shared_layer")
      copied[stack].update({f"layer_{i}": layer for i in range(3)})
  source, inputs = tokens(0, (2, 6)), tokens(1, (2, 5))
  key = jax.random.PRNGKey(0)
  np.testing.assert_allclose(apply_fn(shared)(params, source, inputs, key),
                             apply_fn(separate)(copied, source, inputs, key), atol=1e-5)


def test_shared_layers_with_remat_give_the_same_gradients():
  cfg = config("decoder_only", share_layers=True, deterministic=False, dropout_rate=0.2)
  params = numpy_params(param_shapes(cfg))
  source, inputs = tokens(0, (2, 6)), tokens(1, (2, 5))

  def grads(c):
    loss = lambda p: jnp.sum(jnp.sin(make_model(c).apply(  # noqa: E731
        {"params": p}, source, inputs, rngs={"dropout": jax.random.PRNGKey(1)})))
    return jax.jit(jax.grad(loss), compiler_options={"xla_backend_optimization_level": 0})(params)

  for a, b in zip(jax.tree.leaves(grads(cfg)), jax.tree.leaves(grads(cfg.replace(remat="full")))):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("changes, key", [
    (dict(share_layers=True), "share_layers"),
    (dict(positional="learned", random_positions_max=64), "random_positions_max"),
    (dict(positional="rotary", random_positions_max=64, random_positions_eval=True),
     "random_positions_eval"),
    (dict(residual_gate=True), "residual_gate")])
def test_export_to_hugging_face_refuses_shared_layers_and_a_widened_table(changes, key):
  from transformer_jax.tools.hf import convert
  model = config("decoder_only", norm="pre", activation="gelu", embed_scale=False, **changes)
  with pytest.raises(UserError, match=f"model.{key}"):
    convert._target(model)
