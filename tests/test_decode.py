"""Decoding: the KV cache against the full decoder, greedy against a NumPy loop over the full
model, beam search and sampling against greedy, and every score against `sequence_log_prob`."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.core.errors import UserError
from transformer_jax.eval import decode
from transformer_jax.model import ModelConfig, make_model, param_shapes

VOCAB, PAD, BOS, EOS = 20, 0, 1, 2
ALPHA = 0.6


def make_config(**changes) -> ModelConfig:
  """2+2 layers, d_model 32, 2 heads, vocab 20; untied output layer (so it has an EOS bias)."""
  values = dict(vocab_size=VOCAB, d_model=32, num_heads=2, num_encoder_layers=2,
                num_decoder_layers=2, d_ff=64, max_len=16, tie_output=False, norm="pre",
                deterministic=True)
  values.update(changes)
  return ModelConfig(**values).validate()


def random_params(config: ModelConfig, seed: int, eos_bias: float = 0.0):
  """Random parameters: entries N(0, 0.35^2), LayerNorm scales 1 + N(0, 0.3^2), EOS bias + eos_bias.

  Unlike a fresh initialisation, which is nearly a constant function (one token everywhere), the
  output depends on source and prefix, so greedy, beam and sampling can disagree. The EOS bias
  sets how soon hypotheses end. NumPy draws: jitting JAX's initialisers costs seconds of compile.
  """
  rng = np.random.default_rng(seed)

  def draw(path, leaf):
    noise = rng.normal(size=leaf.shape).astype(np.float32)
    if path[-1].key == "scale":
      return jnp.asarray(1.0 + 0.3 * noise)
    if config.tie_output or path[-1].key != "bias" or path[-2].key != "logits":
      return jnp.asarray(0.35 * noise)
    return jnp.asarray(0.35 * noise).at[EOS].add(eos_bias)

  return jax.tree_util.tree_map_with_path(draw, param_shapes(config))


def random_sources(seed: int, batch: int, length: int) -> jnp.ndarray:
  """int32 `[batch, length]`: tokens in [3, VOCAB) then padding (0); every row has >= 2 tokens."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(3, VOCAB, size=(batch, length))
  lengths = rng.integers(2, length + 1, size=(batch, 1))
  return jnp.asarray(np.where(np.arange(length) < lengths, tokens, PAD), jnp.int32)


@functools.partial(jax.jit, static_argnums=1)
def full_logits(params, config, source, decoder_inputs):
  """The uncached model: logits `[batch, tgt_len, vocab]`."""
  model = make_model(config.replace(decode=False, deterministic=True))
  return model.apply({"params": params}, source, decoder_inputs)


def penalised_scores(params, config, source, tokens, alpha=ALPHA):
  """log p(tokens | source) / GNMT length penalty, scored by the full model. float `[batch]`."""
  lengths = np.sum(np.asarray(tokens) != 0, axis=-1)
  log_probs = np.asarray(decode.sequence_log_prob(params, config, source, tokens), np.float64)
  return log_probs / ((5.0 + lengths) / 6.0) ** alpha


def assert_well_formed(tokens):
  """No BOS or PAD before the first EOS; only zeros after it."""
  for row in np.asarray(tokens):
    eos = np.flatnonzero(row == EOS)
    end = eos[0] + 1 if eos.size else len(row)
    assert np.all(row[end:] == PAD), row
    assert np.all((row[:end] != PAD) & (row[:end] != BOS)), row


def reference_greedy(params, config, source, max_length, lengths=None):
  """Greedy decoding by re-running the full, uncached model on the whole prefix at every step.

  PAD and BOS are never chosen. Positions after the prefix are padding, which the causal mask
  keeps from affecting the prefix, so one compiled shape serves every step. With `lengths`
  (oracle length): EOS is never chosen either, and row r stops after lengths[r] tokens.
  """
  batch = source.shape[0]
  out = np.zeros((batch, max_length), np.int64)
  done = np.zeros(batch, bool) if lengths is None else np.asarray(lengths) <= 0
  for t in range(max_length):
    inputs = np.zeros((batch, max_length), np.int32)
    inputs[:, 0] = BOS
    inputs[:, 1:t + 1] = out[:, :t]
    logits = np.array(full_logits(params, config, source, jnp.asarray(inputs)))[:, t]
    logits[:, [PAD, BOS]] = -np.inf
    if lengths is not None:
      logits[:, EOS] = -np.inf
    chosen = np.argmax(logits, axis=-1)
    out[~done, t] = chosen[~done]
    done |= chosen == EOS
    if lengths is not None:
      done |= t + 1 >= np.asarray(lengths)
    if done.all():
      break
  return out


# ----------------------------------------------------------------------------- the cache


@functools.partial(jax.jit, static_argnums=0)
def cached_and_full(config, params, source, decoder_inputs):
  """Logits of the full decoder and of one cached step per position, both `[batch, len, vocab]`.

  Also returns the encoder output and the cache as `init_cache` creates it. The cache holds
  config.max_len positions, more than the prefix: positions not yet written must be masked.
  """
  full = full_logits(params, config, source, decoder_inputs)
  encoded = decode.encode(params, config, source)
  cache = decode.init_cache(params, config, encoded, source, config.max_len)

  def step(cache, t):
    positions = jnp.full((source.shape[0],), t)
    logits, cache = decode.decode_step(params, config, cache, (encoded, source),
                                       decoder_inputs[:, t], positions)
    return cache, logits

  _, cached = jax.lax.scan(step, cache, jnp.arange(decoder_inputs.shape[1]))
  return full, cached.transpose(1, 0, 2), encoded, cache


# Every pair of (norm, qkv projection, positions) values appears once; tied and untied outputs too.
def teacher_forced_batch(batch: int = 3, steps: int = 6):
  """Random sources `[batch, 7]` and decoder inputs `[batch, steps]` (BOS, then random tokens)."""
  source = random_sources(seed=1, batch=batch, length=7)
  targets = np.random.default_rng(2).integers(3, VOCAB, size=(batch, steps))
  return source, jnp.asarray(np.concatenate([np.full((batch, 1), BOS), targets[:, :-1]], 1),
                             jnp.int32)


@pytest.mark.parametrize("norm, fused_qkv, positional, tie_output", [
    ("pre", False, "sinusoidal", False), ("pre", True, "learned", True),
    ("post", False, "learned", True), ("post", True, "sinusoidal", False)])
def test_cached_steps_match_full_decoder(norm, fused_qkv, positional, tie_output):
  config = make_config(norm=norm, fused_qkv=fused_qkv, positional=positional,
                       tie_output=tie_output)
  params = random_params(config, 0)
  source, decoder_inputs = teacher_forced_batch()
  full, cached, encoded, cache = cached_and_full(config, params, source, decoder_inputs)
  np.testing.assert_allclose(cached, full, atol=1e-5, rtol=1e-5)

  # The cache as created: empty self-attention keys/values at index 0, and cross-attention keys
  # that are the encoder output projected once.
  layer = cache["decoder"]["layer_1"]
  assert layer["self_attention"]["cached_key"].shape == (
      len(source), config.max_len, config.num_heads, config.head_dim)
  assert int(layer["self_attention"]["cache_index"]) == 0
  if not fused_qkv:
    key = params["decoder"]["layer_1"]["cross_attention"]["key"]
    expected = jnp.einsum("bsd,dhk->bshk", encoded, key["kernel"]) + key["bias"]
    np.testing.assert_allclose(layer["cross_attention"]["cross_key"], expected, atol=1e-5)


@functools.partial(jax.jit, static_argnums=0)
def cached_and_full_decoder_only(config, params, source, decoder_inputs):
  """As `cached_and_full` for a decoder-only model: the prompt "source EOS BOS" written into
  the cache in one call (rows of different lengths), then one cached step per target position."""
  full = full_logits(params, config, source, decoder_inputs)
  begin = decode.start(params, config, decode.seq2seq_prompt(source), decoder_inputs.shape[1])

  def step(cache, t):
    tokens = jnp.where(t == 0, begin.first_tokens, decoder_inputs[:, t])
    logits, cache = decode.decode_step(params, config, cache, begin.context, tokens,
                                       begin.first_positions + t)
    return cache, logits

  _, cached = jax.lax.scan(step, begin.cache, jnp.arange(decoder_inputs.shape[1]))
  return full, cached.transpose(1, 0, 2), begin


# Each position option, grouped-query attention and the block options, in both architectures.
@pytest.mark.parametrize("arch, changes", [
    ("encoder_decoder", dict(positional="rotary", num_kv_heads=1)),
    ("encoder_decoder", dict(positional="relative_bias", parallel_block=True)),
    ("encoder_decoder", dict(activation="silu", logits_bias=True, residual_gate=True)),
    ("decoder_only", dict(positional="learned", norm="post", tie_output=True,
                          residual_gate=True)),
    ("decoder_only", dict(positional="none")),
    ("decoder_only", dict(positional="rotary", num_kv_heads=1, norm_type="rmsnorm",
                          activation="swiglu", qkv_bias=False, use_bias=False,  # Llama's
                          tie_output=False)),
    ("decoder_only", dict(positional="relative_bias", num_heads=4, num_kv_heads=2,
                          parallel_block=True)),
    # Transformer-XL relative attention, randomised training positions, shared layers (one
    # cache per application of the shared layer); a length head, which the decoder never reads.
    ("encoder_decoder", dict(positional="relative_xl", share_layers=True, length_head=True)),
    ("decoder_only", dict(positional="relative_xl", num_heads=4, num_kv_heads=2,
                          random_positions_max=64)),
    ("decoder_only", dict(positional="rotary", share_layers=True, random_positions_max=64)),
    # Positions drawn at evaluation too: each decoding step reads its position's draw.
    ("decoder_only", dict(positional="rotary", random_positions_max=64,
                          random_positions_eval=True)),
    ("encoder_decoder", dict(positional="relative_xl", random_positions_max=64,
                             random_positions_eval=True)),
    # Geometric self-attention: a step's search over the cache runs from its newest key back.
    ("encoder_decoder", dict(positional="relative_xl", self_attention="geometric",
                             share_layers=True)),
    ("decoder_only", dict(positional="rotary", self_attention="geometric", num_kv_heads=1))])
def test_cached_steps_match_the_full_model_for_every_option(arch, changes):
  config = make_config(arch=arch, **changes)
  params = random_params(config, 0)
  source, decoder_inputs = teacher_forced_batch()
  layer = "shared_layer" if config.share_layers else "layer_0"
  if arch == "encoder_decoder":
    full, cached, _, cache = cached_and_full(config, params, source, decoder_inputs)
    kv_cache = cache["decoder"][layer]["self_attention"]["cached_key"]
  else:
    full, cached, begin = cached_and_full_decoder_only(config, params, source, decoder_inputs)
    lengths = np.sum(np.asarray(source) != 0, axis=1)
    # The prompt "source EOS BOS" minus its last token is in the cache: lengths + 1 - 1 slots.
    np.testing.assert_array_equal(begin.first_positions, lengths)
    np.testing.assert_array_equal(begin.first_tokens, np.full(len(source), BOS))
    cache = begin.cache
    kv_cache = cache["decoder"][layer]["self_attention"]["cached_key"]
  np.testing.assert_allclose(cached, full, atol=2e-5, rtol=2e-5)
  assert kv_cache.shape[2:] == (config.kv_heads, config.head_dim)  # the key/value heads only
  if config.share_layers:  # the second application of the shared layer has its own cache
    assert cache["decoder"][layer]["self_attention"]["cached_key_1"].shape == kv_cache.shape


def test_decoder_only_searches_agree_with_the_full_model():
  config = make_config(arch="decoder_only", positional="rotary", num_kv_heads=1)
  params = random_params(config, 13, 1.0)
  source = random_sources(seed=8, batch=6, length=6)
  prompt = decode.seq2seq_prompt(source)
  max_length = 8
  greedy = np.asarray(decode.greedy_decode(params, config, prompt, max_length))
  np.testing.assert_array_equal(greedy, reference_greedy(params, config, source, max_length))
  assert_well_formed(greedy)
  tokens, scores = decode.beam_search(params, config, prompt, max_length, beam_size=3,
                                      alpha=ALPHA)
  np.testing.assert_allclose(scores, penalised_scores(params, config, source, tokens), atol=1e-4)
  assert np.all(np.asarray(scores) >= penalised_scores(params, config, source, greedy) - 1e-5)
  sampled = decode.sample(params, config, prompt, max_length, jax.random.key(0), top_k=1)
  np.testing.assert_array_equal(sampled, greedy)


def test_a_language_model_continues_its_prompt():
  """A decoder-only LM's prompt is "BOS text" (rows of different lengths, one empty); greedy
  continuation equals the full model's argmax, step by step, on prompt + output so far."""
  config = make_config(arch="decoder_only", positional="relative_bias")
  params = random_params(config, 5, 1.0)
  prompts = np.zeros((3, 4), np.int32)
  prompts[0, :4], prompts[1, :2], prompts[2, :1] = [BOS, 5, 6, 7], [BOS, 9], [BOS]
  max_length = 6
  tokens = np.asarray(decode.greedy_decode(params, config, jnp.asarray(prompts), max_length))
  assert_well_formed(tokens)
  no_source = jnp.zeros((3, 0), jnp.int32)
  for row, length in enumerate([4, 2, 1]):
    sequence = list(prompts[row, :length])
    for t in range(max_length):
      inputs = np.zeros((1, 4 + max_length), np.int32)
      inputs[0, :len(sequence)] = sequence
      logits = np.array(full_logits(params, config, no_source[:1], jnp.asarray(inputs)))
      logits = logits[0, len(sequence) - 1]
      logits[[PAD, BOS]] = -np.inf
      assert tokens[row, t] == np.argmax(logits), (row, t)
      if tokens[row, t] == EOS:
        break
      sequence.append(tokens[row, t])


def test_decode_length_beyond_max_len_is_a_user_error():
  config = make_config()
  params = random_params(config, 0)
  with pytest.raises(UserError, match="max_len"):
    decode.greedy_decode(params, config, random_sources(0, 1, 4), config.max_len + 1)


# ----------------------------------------------------------------------------- greedy


@pytest.fixture(scope="module")
def searched():
  """One model, 8 sources, greedy and beam-4 outputs, shared by the search tests.

  The seeds and EOS bias give rows that end early and rows that run to max_length, and beam
  outputs that differ from greedy's in some rows.
  """
  config = make_config()
  params = random_params(config, 13, 1.0)
  source = random_sources(seed=8, batch=8, length=6)
  max_length = 10
  greedy = decode.greedy_decode(params, config, source, max_length)
  beam_tokens, beam_scores = decode.beam_search(params, config, source, max_length, beam_size=4,
                                                alpha=ALPHA)
  return config, params, source, max_length, greedy, beam_tokens, beam_scores


def test_greedy_matches_naive_loop_over_full_model(searched):
  config, params, source, max_length, greedy, _, _ = searched
  greedy = np.asarray(greedy)
  np.testing.assert_array_equal(greedy, reference_greedy(params, config, source, max_length))
  finished = (greedy == EOS).any(axis=1)
  assert 0 < finished.sum() < len(finished), "want rows that end early and rows that do not"
  assert_well_formed(greedy)


# ----------------------------------------------------------------------------- beam search


def test_oracle_length_greedy_never_stops_early_and_has_the_reference_length(searched):
  """EOS masked out and decoding stopped at the given length: the full model's argmax without
  EOS at every step; exactly `lengths` tokens; where plain greedy put its EOS right after
  lengths[r] tokens, the same tokens as plain greedy."""
  config, params, source, max_length, greedy, _, _ = searched
  greedy = np.asarray(greedy)
  ended = np.array([np.flatnonzero(row == EOS)[0] if EOS in row else -1 for row in greedy])
  assert (ended >= 0).any() and (ended < 0).any()  # rows that stop and rows that run on
  lengths = np.where(ended >= 0, ended, np.arange(len(greedy)) % (max_length + 1))
  lengths[0] = max_length + 3  # capped at max_length
  oracle = np.asarray(decode.greedy_decode(params, config, source, max_length,
                                           lengths=jnp.asarray(lengths)))
  np.testing.assert_array_equal(
      oracle, reference_greedy(params, config, source, max_length, np.minimum(lengths, max_length)))
  assert not np.any(oracle == EOS)
  np.testing.assert_array_equal((oracle != PAD).sum(-1), np.minimum(lengths, max_length))
  same = (ended >= 0) & (np.arange(len(greedy)) > 0)
  assert same.any()
  np.testing.assert_array_equal(oracle[same], np.where(greedy[same] == EOS, PAD, greedy[same]))


def test_oracle_length_decoding_of_a_decoder_only_model():
  config = make_config(arch="decoder_only", positional="rotary")
  params = random_params(config, 13, 3.0)  # a strong EOS bias: plain greedy stops at once
  source = random_sources(seed=8, batch=4, length=5)
  lengths = jnp.asarray([1, 3, 6, 0])
  oracle = np.asarray(decode.greedy_decode(params, config, decode.seq2seq_prompt(source), 6,
                                           lengths=lengths))
  np.testing.assert_array_equal(oracle, reference_greedy(params, config, source, 6, lengths))
  np.testing.assert_array_equal((oracle != PAD).sum(-1), lengths)
  assert not np.any(oracle == EOS)


def test_beam_scores_are_the_full_models_penalised_log_probs(searched):
  config, params, source, _, _, tokens, scores = searched
  np.testing.assert_allclose(scores, penalised_scores(params, config, source, tokens), atol=1e-4)
  assert_well_formed(tokens)
  assert (np.asarray(tokens) == EOS).any(), "want finished hypotheses"


def test_beam_search_scores_at_least_greedy(searched):
  # Not a theorem (a beam can prune greedy's path), but on these models beam 4 should never lose.
  config, params, source, _, greedy, tokens, _ = searched
  beam = penalised_scores(params, config, source, tokens)
  assert np.all(beam >= penalised_scores(params, config, source, greedy) - 1e-5)
  assert np.any(np.asarray(tokens) != np.asarray(greedy)), "want beam search to find other outputs"


def test_beam_of_one_is_greedy(searched):
  config, params, source, max_length, greedy, _, _ = searched
  # With alpha = 0 greedy's EOS ends the search: nothing alive can then beat it.
  tokens, _ = decode.beam_search(params, config, source, max_length, beam_size=1, alpha=0.0)
  np.testing.assert_array_equal(tokens, greedy)
  # With alpha > 0 a longer hypothesis may still win, but never a worse one: greedy's output is
  # among the finished ones.
  tokens, scores = decode.beam_search(params, config, source, max_length, beam_size=1,
                                      alpha=ALPHA)
  assert np.all(scores >= penalised_scores(params, config, source, greedy) - 1e-5)


# ----------------------------------------------------------------------------- early stop


# The decoding length of the tests that count steps: one no other test compiles, so that the
# searches they run are traced with the counting step (and those that others run are not).
COUNTED_LENGTH = 13
_STEPS: list = []  # one entry per counted step executed
_DECODE_STEP = decode.decode_step


def _counted_step(*args):
  jax.debug.callback(lambda: _STEPS.append(1))
  return _DECODE_STEP(*args)


def count_steps(monkeypatch):
  """Counts `decode_step` executions inside compiled loops (via a host callback): the returned
  list, emptied. One counting step and one list for every test, so that a search compiled by
  one (at COUNTED_LENGTH, with the same shapes) counts for the next too."""
  _STEPS.clear()
  monkeypatch.setattr(decode, "decode_step", _counted_step)
  return _STEPS


def test_loops_stop_when_every_row_has_ended(monkeypatch):
  config = make_config()
  params = random_params(config, 13, 4.0)
  source = random_sources(seed=8, batch=8, length=6)
  max_length = COUNTED_LENGTH
  calls = count_steps(monkeypatch)
  tokens = np.asarray(decode.greedy_decode(params, config, source, max_length))
  jax.effects_barrier()
  ends = [np.flatnonzero(row == EOS) for row in tokens]
  assert all(e.size for e in ends), "want every row to end"
  assert len(calls) == max(e[0] for e in ends) + 1 < max_length
  assert_well_formed(tokens)

  # A model that always says EOS: one step each, and the beam is done at once, because no
  # alive hypothesis can beat a finished one with log-probability ~0.
  params = random_params(config, 13, 100.0)
  for search in (decode.greedy_decode, lambda *a: decode.beam_search(*a, beam_size=3)[0]):
    calls.clear()
    tokens = np.asarray(search(params, config, source, max_length))
    jax.effects_barrier()
    assert len(calls) == 1
    np.testing.assert_array_equal(tokens, np.eye(1, max_length, dtype=int).repeat(8, 0) * EOS)


# ----------------------------------------------------------------------------- sampling


def test_sampling_with_top_k_1_is_greedy(searched):
  config, params, source, max_length, greedy, _, _ = searched
  tokens = decode.sample(params, config, source, max_length, jax.random.key(0), top_k=1)
  np.testing.assert_array_equal(tokens, greedy)


def test_sampling_follows_the_model_distribution(searched):
  config, params, source, _, _, _, _ = searched
  n = 4000
  sources = jnp.tile(source[:1], (n, 1))
  first = jnp.zeros((8, 10), jnp.int32).at[:, 0].set(BOS)  # the shape reference_greedy compiles
  expected = np.array(jax.nn.softmax(full_logits(params, config, source[:8], first)[0, 0]))
  expected[[PAD, BOS]] = 0.0
  expected /= expected.sum()

  def first_token_frequencies(**kwargs):
    tokens = decode.sample(params, config, sources, 1, jax.random.key(1), **kwargs)
    return np.bincount(np.asarray(tokens[:, 0]), minlength=VOCAB) / n

  # Binomial standard error is <= 0.008 at n = 4000: 0.035 is over 4 sigma.
  np.testing.assert_allclose(first_token_frequencies(), expected, atol=0.035)
  top3 = np.argsort(expected)[-3:]
  frequencies = first_token_frequencies(top_k=3)
  assert set(np.flatnonzero(frequencies)) <= set(top3)
  np.testing.assert_allclose(frequencies[top3], expected[top3] / expected[top3].sum(), atol=0.035)
  # A low temperature concentrates the samples on the most probable token.
  assert first_token_frequencies(temperature=0.05)[np.argmax(expected)] > 0.99


def test_padding_only_rows_are_not_decoded(monkeypatch):
  config = make_config()
  params = random_params(config, 13, 4.0)
  source = random_sources(seed=8, batch=4, length=6)
  padded = jnp.concatenate([source, jnp.zeros_like(source)])  # as callers fill a last batch
  max_length = COUNTED_LENGTH  # the padded searches: test_loops_stop_when_every_row_has_ended's
  calls = count_steps(monkeypatch)
  for search in (decode.greedy_decode, lambda *a: decode.beam_search(*a, beam_size=3)[0]):
    calls.clear()
    alone = np.asarray(search(params, config, source, max_length))
    jax.effects_barrier()
    steps = len(calls)
    calls.clear()
    tokens = np.asarray(search(params, config, padded, max_length))
    jax.effects_barrier()
    assert len(calls) == steps < max_length  # the empty rows add no steps
    np.testing.assert_array_equal(tokens[:4], alone)
    assert not tokens[4:].any()
