"""The Transformer: shapes, no future leakage, padding invariance, packing, sizes, config checks."""

import functools
import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax import config as config_lib
from transformer_jax.core.errors import UserError
from transformer_jax.model import (
  ModelConfig,
  Transformer,
  count_params,
  describe,
  init_params,
  make_model,
  param_shapes,
)
from transformer_jax.model.transformer import output_projection

REPO = pathlib.Path(__file__).resolve().parents[1]


def load_experiment(name):
  """experiments/<name>.py's get_config(), loaded by path (experiments/ is not a package)."""
  path = REPO / "experiments" / f"{name}.py"
  spec = importlib.util.spec_from_file_location(f"experiment_{name}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def random_tokens(seed, shape, vocab_size, low=1):
  """Token ids in [low, vocab_size); low=1 keeps padding (id 0) out."""
  return jnp.asarray(np.random.default_rng(seed).integers(low, vocab_size, size=shape), jnp.int32)


def model_params(cfg, random_params, seed=0):
  return random_params(lambda rng: {"params": init_params(cfg, rng)}, seed=seed)


@functools.lru_cache(maxsize=None)
def logits_fn(cfg: ModelConfig):
  """A jitted (params, source, [decoder_inputs,] **packing) -> logits, one per config.

  Compiled at XLA's lowest optimisation level: compiling is most of these tests' run time, -O0
  halves it, and none of the properties tested depends on it.
  """
  return jax.jit(
      lambda params, *args, **kwargs: make_model(cfg).apply({"params": params}, *args, **kwargs),
      compiler_options={"xla_backend_optimization_level": 0})


# ----------------------------------------------------------------------------- shapes


def test_encode_decode_call_shapes(tiny_config, random_params):
  cfg = tiny_config
  params = model_params(cfg, random_params)
  model = Transformer(cfg)
  source = random_tokens(0, (2, 7), cfg.vocab_size)
  targets = random_tokens(1, (2, 6), cfg.vocab_size)

  encoded = jax.eval_shape(lambda p, s: model.apply({"params": p}, s, method=Transformer.encode),
                           params, source)
  decoded = jax.eval_shape(
      lambda p, e, s, t: model.apply({"params": p}, e, s, t, method=Transformer.decode),
      params, encoded, source, targets)
  logits = logits_fn(cfg)(params, source, targets)

  assert encoded.shape == (2, 7, cfg.d_model)
  assert decoded.shape == logits.shape == (2, 6, cfg.vocab_size)
  assert decoded.dtype == logits.dtype == jnp.float32
  assert np.all(np.isfinite(np.asarray(logits)))


# ----------------------------------------------------------------------------- causality


@pytest.mark.parametrize("norm,attention_impl", [("post", "plain"), ("pre", "plain"),
                                                 ("post", "jax")])
def test_future_targets_never_change_past_logits(tiny_config, random_params, norm, attention_impl):
  cfg = tiny_config.replace(norm=norm, attention_impl=attention_impl)
  params = model_params(cfg, random_params)
  apply = logits_fn(cfg)
  batch, src_len, tgt_len = 2, 7, 6
  source = random_tokens(0, (batch, src_len), cfg.vocab_size)
  targets = random_tokens(1, (batch, tgt_len), cfg.vocab_size)
  base = np.asarray(apply(params, source, targets))

  for t in (0, 2, 4):
    # Every position after t gets a different token (shifted by 1..vocab-2, never 0).
    shift = random_tokens(10 + t, (batch, tgt_len - t - 1), cfg.vocab_size - 1)
    changed = targets.at[:, t + 1:].set((targets[:, t + 1:] - 1 + shift) % (cfg.vocab_size - 1) + 1)
    assert np.all(np.asarray(changed[:, t + 1:] != targets[:, t + 1:]))
    logits = np.asarray(apply(params, source, changed))
    np.testing.assert_allclose(logits[:, :t + 1], base[:, :t + 1], rtol=0, atol=1e-6,
                               err_msg=f"logits at positions <= {t} saw a later target")
    assert not np.allclose(logits[:, t + 1:], base[:, t + 1:], atol=1e-3)  # the change is visible


# ----------------------------------------------------------------------------- padding, packing


def test_extra_source_padding_does_not_change_logits(tiny_config, random_params):
  cfg = tiny_config
  params = model_params(cfg, random_params)
  apply = logits_fn(cfg)
  source = np.array(random_tokens(0, (2, 7), cfg.vocab_size))
  source[1, 4:] = 0  # the second example is already padded
  targets = random_tokens(1, (2, 6), cfg.vocab_size)

  logits = np.asarray(apply(params, jnp.asarray(source), targets))
  padded = np.pad(source, ((0, 0), (0, 5)))
  logits_padded = np.asarray(apply(params, jnp.asarray(padded), targets))
  np.testing.assert_allclose(logits_padded, logits, rtol=1e-5, atol=1e-5)

  # ...whereas a real source token does reach the logits.
  source[1, 3] = source[1, 3] % (cfg.vocab_size - 1) + 1
  assert not np.allclose(np.asarray(apply(params, jnp.asarray(source), targets))[1], logits[1],
                         atol=1e-3)


# ----------------------------------------------------------------------------- sizes


def paper_param_count(vocab, d_model, d_ff, layers):
  """Hand count: shared embedding (tied output) + encoder and decoder layers, with all biases."""
  attention = 4 * (d_model * d_model + d_model)
  ffn = d_model * d_ff + d_ff + d_ff * d_model + d_model
  layer_norm = 2 * d_model
  encoder_layer = attention + ffn + 2 * layer_norm
  decoder_layer = 2 * attention + ffn + 3 * layer_norm
  return vocab * d_model + layers * (encoder_layer + decoder_layer)


@pytest.mark.parametrize("name,d_model,d_ff,expected_millions", [("base", 512, 2048, 63.1),
                                                                 ("big", 1024, 4096, 214.0)])
def test_experiment_param_counts(name, d_model, d_ff, expected_millions):
  cfg = config_lib.model_config(load_experiment(name))
  assert (cfg.d_model, cfg.d_ff, cfg.vocab_size) == (d_model, d_ff, 37000)
  counts = count_params(param_shapes(cfg))
  assert abs(counts["total"] - expected_millions * 1e6) <= 0.01 * expected_millions * 1e6
  assert counts["total"] == paper_param_count(37000, d_model, d_ff, layers=6)
  assert counts["embedding"] == 37000 * d_model
  assert counts["non_embedding"] == counts["total"] - 37000 * d_model


def test_base_non_embedding_count():
  counts = count_params(param_shapes(config_lib.model_config(load_experiment("base"))))
  assert counts["non_embedding"] == counts["total"] - 37000 * 512
  assert abs(counts["non_embedding"] - 44.1e6) <= 0.01 * 44.1e6


def test_separate_embeddings_add_one_table(tiny_config):
  shared = param_shapes(tiny_config)
  separate = param_shapes(tiny_config.replace(share_embeddings=False))
  table = tiny_config.vocab_size * tiny_config.d_model
  assert count_params(separate)["total"] - count_params(shared)["total"] == table
  assert count_params(separate)["embedding"] - count_params(shared)["embedding"] == table
  assert "shared_embedding" in shared and "shared_embedding" not in separate
  for name in ("source_embedding", "target_embedding"):
    assert separate[name]["embedding"].shape == (tiny_config.vocab_size, tiny_config.d_model)


def test_untied_output_adds_a_dense_layer(tiny_config):
  tied = param_shapes(tiny_config)
  untied = param_shapes(tiny_config.replace(tie_output=False))
  vocab, d_model = tiny_config.vocab_size, tiny_config.d_model
  assert count_params(untied)["total"] - count_params(tied)["total"] == vocab * d_model + vocab
  assert "logits" not in tied["decoder"]
  assert untied["decoder"]["logits"]["kernel"].shape == (d_model, vocab)
  assert untied["decoder"]["logits"]["bias"].shape == (vocab,)


def test_learned_positions_add_two_tables_counted_as_embeddings(tiny_config):
  sinusoidal = count_params(param_shapes(tiny_config))
  learned_shapes = param_shapes(tiny_config.replace(positional="learned"))
  learned = count_params(learned_shapes)
  tables = 2 * tiny_config.max_len * tiny_config.d_model
  assert learned["total"] - sinusoidal["total"] == tables
  assert learned["embedding"] - sinusoidal["embedding"] == tables
  assert learned["non_embedding"] == sinusoidal["non_embedding"]
  for stack in ("encoder", "decoder"):
    assert learned_shapes[stack]["positions"]["table"].shape == (tiny_config.max_len,
                                                                tiny_config.d_model)


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize("changes,message", [
    (dict(d_model=30, num_heads=4), "divisible"),
    (dict(dropout_rate=1.0), "dropout_rate"),
    (dict(dropout_rate=-0.1), "dropout_rate"),
    (dict(attention_dropout_rate=1.5), "attention_dropout_rate"),
    (dict(norm="middle"), "model.norm"),
    (dict(activation="swish"), "model.activation"),
    (dict(positional="alibi"), "model.positional"),
    (dict(init="he"), "model.init"),
    (dict(attention_impl="flash"), "model.attention_impl"),
    (dict(dtype="float16"), "model.dtype"),
    (dict(num_heads=0), "num_heads"),
    (dict(d_model=9, num_heads=3, positional="sinusoidal"), "even"),
    (dict(attention_impl="jax", attention_dropout_rate=0.1), "attention_dropout_rate"),
    (dict(num_kv_heads=3), "num_kv_heads"),
    (dict(num_kv_heads=2, fused_qkv=True), "fused_qkv"),
    (dict(d_model=36, num_heads=4, positional="rotary"), "even head_dim"),
    (dict(relative_buckets=64, relative_max_distance=32), "relative_buckets"),
    (dict(arch="gpt"), "model.arch"),
    (dict(arch="decoder_only", num_decoder_layers=0), "num_decoder_layers"),
    (dict(num_labels=2), "num_labels"),
    (dict(type_vocab_size=-1), "type_vocab_size"),
    (dict(pooling="max"), "model.pooling"),
    (dict(arch="encoder_only", logits_bias=True), "logits_bias"),
])
def test_validate_rejects_impossible_configs(tiny_config, changes, message):
  with pytest.raises(UserError, match=message):
    tiny_config.replace(**changes).validate()


def test_validate_accepts_every_choice(tiny_config):
  for changes in (dict(norm="pre"), dict(activation="gelu"), dict(positional="learned"),
                  dict(positional="rotary"), dict(positional="relative_bias"),
                  dict(positional="none"),
                  dict(arch="decoder_only"), dict(arch="encoder_only", num_labels=2),
                  dict(init="normal"), dict(attention_impl="jax"), dict(dtype="bfloat16"),
                  dict(dropout_rate=0.0), dict(attention_dropout_rate=0.99),
                  dict(activation="gelu_exact"), dict(embed_scale=False),
                  dict(type_vocab_size=2, embed_norm=True),
                  dict(arch="encoder_only", num_labels=2, pooling="first"),
                  dict(activation="silu", logits_bias=True)):
    cfg = tiny_config.replace(**changes)
    assert cfg.validate() is cfg


def test_from_dict_rejects_unknown_keys():
  with pytest.raises(UserError, match="model.nope"):
    ModelConfig.from_dict({"vocab_size": 10, "nope": 1})


# ----------------------------------------------------------------------------- dtype


def test_bfloat16_compute_gives_float32_logits_close_to_float32(tiny_config, random_params):
  params = model_params(tiny_config, random_params)
  source = random_tokens(0, (2, 7), tiny_config.vocab_size)
  targets = random_tokens(1, (2, 6), tiny_config.vocab_size)
  logits32 = np.asarray(logits_fn(tiny_config)(params, source, targets))
  logits16 = logits_fn(tiny_config.replace(dtype="bfloat16"))(params, source, targets)

  assert logits16.dtype == jnp.float32
  assert all(p.dtype == jnp.float32 for p in jax.tree_util.tree_leaves(params))
  error = np.abs(np.asarray(logits16) - logits32)
  scale = np.abs(logits32).max()
  assert error.max() <= 0.1 * scale, (error.max(), scale)
  assert error.mean() <= 0.02 * scale, (error.mean(), scale)
  assert error.max() > 0.0  # the bfloat16 path really computed in lower precision


def test_output_projection_gradients_match_autodiff():
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(2, 3, 8)), jnp.float32)
  table = jnp.asarray(rng.normal(size=(13, 8)), jnp.float32)
  weights = jnp.asarray(rng.normal(size=(2, 3, 13)), jnp.float32)
  ours = jax.grad(lambda a, b: (output_projection(a, b) * weights).sum(), (0, 1))
  plain = jax.grad(lambda a, b: (jnp.einsum("btd,vd->btv", a, b) * weights).sum(), (0, 1))
  for got, want in zip(ours(x, table), plain(x, table)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(output_projection(x, table),
                             np.asarray(x, np.float64) @ np.asarray(table, np.float64).T,
                             rtol=1e-5, atol=1e-5)


def test_remat_gives_the_same_parameters_and_gradients(tiny_config):
  """Both remat policies against one plain model (its gradient compiled once for both). One
  layer in each stack: remat wraps each layer alone, and a second one only doubles the compile."""
  cfg = tiny_config.replace(deterministic=False, dropout_rate=0.2, num_encoder_layers=1,
                            num_decoder_layers=1)
  params = init_params(cfg, jax.random.PRNGKey(0))
  rng = np.random.default_rng(0)
  source = jnp.asarray(rng.integers(3, cfg.vocab_size, (2, 7)))
  target = jnp.asarray(rng.integers(3, cfg.vocab_size, (2, 5)))

  def grads(config):
    def loss(p):
      logits = Transformer(config).apply({"params": p}, source, target,
                                         rngs={"dropout": jax.random.PRNGKey(1)})
      return jnp.sum(jnp.sin(logits))  # every logit matters, with dropout masks in play
    return jax.jit(jax.grad(loss))(params)

  plain = grads(cfg)
  assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(plain)) > 0
  for remat in ("full", "dots"):
    rematted = cfg.replace(remat=remat)
    assert jax.tree.structure(param_shapes(rematted)) == jax.tree.structure(params), remat
    recomputed = grads(rematted)
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(recomputed)):
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=f"remat={remat}")


# ----------------------------------------------------------------------------- architectures


def arch_config(arch, **changes):
  """A tiny model of the architecture: 2 layers, d_model 32, 4 heads, vocab 50."""
  values = dict(vocab_size=50, arch=arch, d_model=32, num_heads=4, num_encoder_layers=2,
                num_decoder_layers=2, d_ff=64, max_len=32, deterministic=True)
  values.update(changes)
  return ModelConfig(**values).validate()


@pytest.mark.parametrize("changes", [
    dict(positional="learned", norm="pre", residual_gate=True),
    dict(positional="rotary", num_kv_heads=2, norm_type="rmsnorm", activation="swiglu"),
    dict(positional="relative_bias", parallel_block=True, norm="pre", tie_output=False)])
def test_decoder_only_is_causal_reads_its_source_and_ignores_padding(random_params, changes):
  cfg = arch_config("decoder_only", **changes)
  params = model_params(cfg, random_params)
  apply = logits_fn(cfg)
  source = np.array(random_tokens(0, (2, 5), cfg.vocab_size))
  source[1, 3:] = 0
  targets = random_tokens(1, (2, 6), cfg.vocab_size)
  base = np.asarray(apply(params, jnp.asarray(source), targets))
  assert base.shape == (2, 6, cfg.vocab_size)  # the target's logits only

  t = 2  # every target token after t changed: the logits up to t stay
  changed = targets.at[:, t + 1:].set(targets[:, t + 1:] % (cfg.vocab_size - 1) + 1)
  logits = np.asarray(apply(params, jnp.asarray(source), changed))
  np.testing.assert_allclose(logits[:, :t + 1], base[:, :t + 1], rtol=0, atol=1e-5)
  assert not np.allclose(logits[:, t + 1:], base[:, t + 1:], atol=1e-3)
  # More padding after the source changes nothing: positions count real tokens only.
  padded = np.pad(source, ((0, 0), (0, 3)))
  np.testing.assert_allclose(np.asarray(apply(params, jnp.asarray(padded), targets)), base,
                             rtol=1e-5, atol=1e-5)
  # A source token reaches every target logit.
  source[1, 0] = source[1, 0] % (cfg.vocab_size - 1) + 1
  other = np.asarray(apply(params, jnp.asarray(source), targets))
  assert not np.allclose(other[1, 0], base[1, 0], atol=1e-3)
  np.testing.assert_allclose(other[0], base[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch, changes", [
    ("encoder_decoder", {}),
    ("decoder_only", dict(positional="relative_bias", num_kv_heads=1)),
    ("decoder_only", dict(positional="rotary", norm="pre")),
    ("encoder_only", dict(positional="relative_bias")),
    ("encoder_only", dict(positional="rotary", num_kv_heads=2))])
def test_packed_rows_equal_their_examples_run_separately(random_params, arch, changes):
  cfg = arch_config(arch, **changes)
  params = model_params(cfg, random_params)
  apply = logits_fn(cfg)
  vocab = cfg.vocab_size
  src_a, tgt_a = random_tokens(0, (3,), vocab), random_tokens(1, (2,), vocab)
  src_b, tgt_b = random_tokens(2, (2,), vocab), random_tokens(3, (3,), vocab)

  def row(*parts, length=6):
    return jnp.pad(jnp.concatenate(parts), (0, length - sum(len(p) for p in parts)))[None]

  packing = dict(source_positions=jnp.array([[0, 1, 2, 0, 1, 0]]),
                 source_segments=jnp.array([[1, 1, 1, 2, 2, 0]]))
  if arch == "encoder_only":
    separate = np.asarray(apply(params, jnp.concatenate([row(src_a), row(src_b)])))
    packed = np.asarray(apply(params, row(src_a, src_b), packing["source_positions"],
                              packing["source_segments"]))
    np.testing.assert_allclose(packed[0, :3], separate[0, :3], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(packed[0, 3:5], separate[1, :2], rtol=1e-5, atol=1e-5)
    return
  separate = np.asarray(apply(params, jnp.concatenate([row(src_a), row(src_b)]),
                              jnp.concatenate([row(tgt_a), row(tgt_b)])))
  packed = np.asarray(apply(params, row(src_a, src_b), row(tgt_a, tgt_b),
                            target_positions=jnp.array([[0, 1, 0, 1, 2, 0]]),
                            target_segments=jnp.array([[1, 1, 2, 2, 2, 0]]), **packing))
  np.testing.assert_allclose(packed[0, :2], separate[0, :2], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(packed[0, 2:5], separate[1, :3], rtol=1e-5, atol=1e-5)


def test_encoder_only_heads_ignore_padding(random_params):
  mlm = arch_config("encoder_only", positional="learned")
  classifier = mlm.replace(num_labels=3)
  tokens = np.array(random_tokens(0, (2, 6), 50))
  tokens[1, 4:] = 0
  padded = jnp.asarray(np.pad(tokens, ((0, 0), (0, 3))))
  for cfg, shape in ((mlm, (2, 6, 50)), (classifier, (2, 1, 3))):
    params = model_params(cfg, random_params)
    logits = np.asarray(logits_fn(cfg)(params, jnp.asarray(tokens)))
    assert logits.shape == shape
    padded_logits = np.asarray(logits_fn(cfg)(params, padded))[:, :shape[1]]
    real = (tokens > 0) if cfg is mlm else np.ones((2, 1), bool)
    np.testing.assert_allclose(padded_logits[real], logits[real], rtol=1e-5, atol=1e-5)


def test_published_sizes_of_gpt2_small_and_bert_base():
  """GPT-2 small: 124,439,808 (tied, 1024 learned positions); BERT-base: 109,482,240 with its
  pooler, "110M" (here: a mean-pooling classification head, or BERT's MLM head)."""
  d, ff, layers = 768, 3072, 12
  layer = 4 * (d * d + d) + (d * ff + ff + ff * d + d) + 2 * 2 * d  # attention, FFN, 2 norms
  gpt2 = arch_config("decoder_only", vocab_size=50257, d_model=d, num_heads=12, d_ff=ff,
                     num_decoder_layers=layers, max_len=1024, positional="learned", norm="pre",
                     activation="gelu")
  counts = count_params(param_shapes(gpt2))
  assert counts["total"] == 50257 * d + 1024 * d + layers * layer + 2 * d == 124_439_808
  bert = arch_config("encoder_only", vocab_size=30522, d_model=d, num_heads=12, d_ff=ff,
                     num_encoder_layers=layers, max_len=512, positional="learned",
                     activation="gelu")
  base = 30522 * d + 512 * d + layers * layer
  mlm = count_params(param_shapes(bert))["total"]
  assert mlm == base + (d * d + d) + 2 * d + 30522  # dense, norm, output bias
  classifier = count_params(param_shapes(bert.replace(num_labels=2)))["total"]
  assert classifier == base + (d * d + d) + (d * 2 + 2)  # pooler, classes
  for total in (mlm, classifier):
    assert abs(total - 109_482_240) <= 0.01 * 109_482_240


def test_default_parameter_tree_is_the_encoder_decoders_of_before():
  """New options default to today's model: a checkpoint of the default config keeps its tree."""
  shapes = param_shapes(ModelConfig(vocab_size=8, d_model=4, num_heads=2, num_encoder_layers=1,
                                    num_decoder_layers=1, d_ff=8, max_len=8))
  paths = sorted("/".join(p.key for p in path)
                 for path, _ in jax.tree_util.tree_leaves_with_path(shapes))
  attention = [f"{name}/{leaf}" for name in ("key", "out", "query", "value")
               for leaf in ("bias", "kernel")]
  ffn = ["ffn/wi/bias", "ffn/wi/kernel", "ffn/wo/bias", "ffn/wo/kernel"]
  norm = lambda block: [f"{block}/norm/bias", f"{block}/norm/scale"]
  encoder = ([f"self_attention/{a}" for a in attention] + norm("attention_block") + ffn
             + norm("ffn_block"))
  decoder = ([f"{kind}_attention/{a}" for kind in ("self", "cross") for a in attention]
             + norm("self_attention_block") + norm("cross_attention_block") + ffn
             + norm("ffn_block"))
  expected = (["shared_embedding/embedding"] + [f"encoder/layer_0/{p}" for p in encoder]
              + [f"decoder/layer_0/{p}" for p in decoder])
  assert paths == sorted(expected)


def test_bert_embedding_options_add_their_tables_and_change_the_embeddings(random_params):
  """type_vocab_size adds a [types, d] table (counted as embedding), embed_norm a LayerNorm per
  stack; without embed_scale the embeddings are not multiplied by sqrt(d_model). Each changes
  the logits; with all three off the model is the one of before."""
  base = arch_config("encoder_only", positional="learned")
  bert = base.replace(type_vocab_size=2, embed_norm=True, embed_scale=False)
  shapes = param_shapes(bert)
  assert shapes["encoder"]["token_types"]["embedding"].shape == (2, bert.d_model)
  assert set(shapes["encoder"]["embed_norm"]) == {"scale", "bias"}
  counts, before = count_params(shapes), count_params(param_shapes(base))
  assert counts["embedding"] - before["embedding"] == 2 * bert.d_model
  assert counts["total"] - before["total"] == 4 * bert.d_model
  tokens = random_tokens(0, (2, 6), base.vocab_size)
  params = model_params(bert, random_params)
  reference = np.asarray(logits_fn(bert)(params, tokens))
  for changes in (dict(embed_scale=True), dict(activation="gelu_exact")):
    assert not np.allclose(np.asarray(logits_fn(bert.replace(**changes))(params, tokens)),
                           reference, atol=1e-4)


def test_first_token_pooling_reads_the_first_output_only(random_params):
  cfg = arch_config("encoder_only", positional="learned", num_labels=3, pooling="first")
  params = model_params(cfg, random_params)
  tokens = np.asarray(random_tokens(0, (1, 6), cfg.vocab_size))
  changed = tokens.copy()
  changed[0, 0] = changed[0, 0] % (cfg.vocab_size - 1) + 1
  mean = np.asarray(logits_fn(cfg.replace(pooling="mean"))(params, jnp.asarray(tokens)))
  first = np.asarray(logits_fn(cfg)(params, jnp.asarray(tokens)))
  assert not np.allclose(mean, first, atol=1e-5)
  # The output at the first token depends on every token (bidirectional), so it changes too.
  assert not np.allclose(np.asarray(logits_fn(cfg)(params, jnp.asarray(changed))), first)


def test_logits_bias_is_one_vector_added_to_every_logit(tiny_config, random_params):
  """model.logits_bias: decoder/logits_bias `[vocab]`, added to the logits at every position
  (Marian's final_logits_bias); the rest of the tree and the logits before it are unchanged."""
  cfg = tiny_config.replace(logits_bias=True, activation="silu")
  params = model_params(cfg, random_params)
  assert params["decoder"]["logits_bias"].shape == (cfg.vocab_size,)
  without = {k: v for k, v in params.items()}
  without["decoder"] = {k: v for k, v in params["decoder"].items() if k != "logits_bias"}
  source, targets = random_tokens(0, (2, 5), cfg.vocab_size), random_tokens(1, (2, 4), 50)
  biased = np.asarray(logits_fn(cfg)(params, source, targets))
  plain = np.asarray(logits_fn(cfg.replace(logits_bias=False))(without, source, targets))
  np.testing.assert_allclose(biased - plain, np.broadcast_to(
      params["decoder"]["logits_bias"], biased.shape), atol=1e-5)
  assert "logits bias" in describe(cfg) and "silu" in describe(cfg)
  # A run describes its model from the parameters it has (no trace of the initialiser): the
  # same words and counts as from the traced shapes.
  assert describe(cfg, params) == describe(cfg)
  assert "parameters" in describe(cfg)
  wrong = dict(params, decoder=without["decoder"])
  assert describe(cfg, wrong) != describe(cfg)  # the counts are of the parameters given


def test_zero_bos_embedding_is_the_model_with_a_zero_bos_row(tiny_config, random_params):
  """model.zero_bos_embedding reads BOS as a zero vector in and out (the tied projection gives it
  a zero logit): the same function as the plain model with the table's BOS row set to zero."""
  cfg = tiny_config.replace(zero_bos_embedding=True)
  params = model_params(cfg, random_params)
  source = random_tokens(0, (2, 5), cfg.vocab_size)
  targets = random_tokens(1, (2, 4), cfg.vocab_size).at[:, 0].set(1)  # BOS first
  table = params["shared_embedding"]["embedding"]
  zeroed = dict(params, shared_embedding={"embedding": table.at[1].set(0.0)})
  plain = cfg.replace(zero_bos_embedding=False)
  expected = np.asarray(logits_fn(plain)(zeroed, source, targets))
  np.testing.assert_allclose(np.asarray(logits_fn(cfg)(params, source, targets)), expected,
                             atol=1e-5)
  assert not np.allclose(np.asarray(logits_fn(plain)(params, source, targets)), expected,
                         atol=1e-3)
