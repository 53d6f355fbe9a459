"""Autoregressive decoding with the KV cache: greedy, beam search, and sampling.

Data flow: `start` -> one `decode_step` per output position inside a `lax.while_loop` that stops
as soon as no row can change any more. `start` depends on the architecture:
  encoder-decoder: `encode` the source once, then `init_cache` (the decoder's first
    `decode=True` call, which projects the encoder output into cross-attention keys/values and
    allocates the self-attention cache); step 0 reads BOS at position 0.
  decoder-only: the source is a prompt, "the tokens before the first output" (a translation's
    prompt is "source EOS BOS", see `seq2seq_prompt`; a language model's "BOS text"). All but
    its last token are written into the cache in one call (the prefill; rows of different
    lengths end at the same cache slot, padding before them masked); step 0 reads the last one
    at its position.

Conventions: pad = 0, BOS = `bos_id`, EOS = `eos_id`. Outputs are int32 `[batch, max_length]`
without BOS, with EOS, and zeros after EOS (a row that reaches `max_length` first has no EOS).
PAD and BOS are never emitted: their log-probabilities are set to -inf *without renormalising*,
so every score below is the model's own log-probability of the tokens chosen and agrees with
`sequence_log_prob`, which runs the full (uncached) model. A source row of padding only (how
callers fill a batch to its fixed size) is not decoded: its output is all zeros at once, so it
never keeps the loop running.

The searches and `sequence_log_prob` are jitted pure functions: `config`, `max_length`, the beam
size, top-k and the special ids are static (they fix shapes or control flow), everything else
(parameters, sources, alpha, temperature, rng) is traced. `encode`, `init_cache` and
`decode_step` are pure and jittable building blocks.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from transformer_jax.core.errors import UserError
from transformer_jax.core.tokens import BOS_ID
from transformer_jax.model import DecoderOnly, ModelConfig, Transformer, make_model, shift_right

Array = jax.Array
Cache = Any  # the flax 'cache' collection: a nested dict of arrays

# A finite stand-in for log(0): sums and divisions of it stay finite (no inf - inf = NaN), and
# it is far below any real log-probability of a sequence.
NEG_INF = -1.0e9

# Step-invariant cache entries (cross-attention keys/values of the encoder output): identical
# for every beam of a source, so reordering beams leaves them as they are.
_STEP_INVARIANT = ("cross_key", "cross_value")


# ----------------------------------------------------------------------------- model calls


def _model(config: ModelConfig, decode: bool):
  return make_model(config.replace(decode=decode, deterministic=True))


def _check_length(config: ModelConfig, length: int, what: str = "decode length") -> None:
  if not 1 <= length <= config.max_len:
    raise UserError(f"{what} {length} must be in [1, model.max_len={config.max_len}]; "
                    "lower eval.max_decode_len (its default is data.max_target_len), or "
                    "shorten the input")


def encode(params, config: ModelConfig, source_tokens: Array) -> Array:
  """source_tokens int `[batch, src_len]` (0 = padding) -> encoded `[batch, src_len, d_model]`."""
  return _model(config, decode=False).apply({"params": params}, source_tokens,
                                            method=Transformer.encode)


@functools.partial(jax.jit, static_argnames=("config",))
def predicted_lengths(params, config: ModelConfig, source_tokens: Array) -> Array:
  """model.length_head: the length the head predicts for each source's output (EOS not
  counted), float32 `[batch]`; rows of padding get 0."""
  return _model(config, decode=False).apply({"params": params}, source_tokens,
                                            method=Transformer.source_length_prediction)


def init_cache(params, config: ModelConfig, encoded: Array, source_tokens: Array,
               max_length: int) -> Cache:
  """The encoder-decoder's cache for `max_length` steps, with cross-attention keys/values.

  Args:
    encoded: `[batch, src_len, d_model]` from `encode`.
    source_tokens: int `[batch, src_len]`.
    max_length: number of output positions the cache holds (static).

  Returns:
    the 'cache' collection: per decoder layer, self-attention `cached_key`/`cached_value`
    `[batch, max_length, kv_heads, head_dim]` (zeros) and `cache_index` 0, and cross-attention
    `cross_key`/`cross_value` `[batch, src_len, kv_heads, head_dim]`; the decoder's
    `key_positions` `[batch, max_length]` (-1: nothing written yet) and `index`.
  """
  _check_length(config, max_length)
  dummy = jnp.zeros((source_tokens.shape[0], max_length), jnp.int32)
  # This call only creates the cache; under jit its logits are dead code and get removed.
  _, variables = _model(config, decode=True).apply(
      {"params": params}, encoded, source_tokens, dummy, method=Transformer.decode,
      mutable=["cache"])
  return variables["cache"]


def prompt_lengths(prompt: Array) -> Array:
  """int32 `[batch]`: the real tokens of each right-padded prompt row `[batch, length]`."""
  return jnp.sum(prompt != 0, axis=-1, dtype=jnp.int32)


def seq2seq_prompt(source_tokens: Array, bos_id: int = BOS_ID) -> Array:
  """The decoder-only model's prompt for a source: "source EOS BOS", as in training.

  source_tokens int `[batch, src_len]` (EOS-terminated, right-padded) -> `[batch, src_len + 1]`;
  a row of padding only stays padding.
  """
  lengths = prompt_lengths(source_tokens)
  prompt = jnp.pad(source_tokens, ((0, 0), (0, 1)))
  bos = jnp.arange(prompt.shape[1])[None, :] == lengths[:, None]
  return jnp.where(bos & (lengths[:, None] > 0), bos_id, prompt)


def _prefill(params, config: ModelConfig, prompt: Array, max_length: int):
  """The decoder-only cache with each prompt row but its last token written.

  The rows are right-aligned, so that every row's next token goes to the same cache slot: row
  r's tokens sit in the last n_r - 1 of the `prompt_len - 1` prefill slots, at positions
  0 .. n_r - 2, and the slots before them hold padding at position -1, which the mask hides.

  Returns (cache for prompt_len - 1 + max_length slots, last prompt token int `[batch]` (BOS
  for an empty row), its position int `[batch]`).
  """
  batch, width = prompt.shape[0], prompt.shape[1] - 1
  _check_length(config, width + max_length, "prompt length + decode length")
  lengths = prompt_lengths(prompt)
  model = _model(config, decode=True)
  dummy = jnp.zeros((batch, width + max_length), jnp.int32)
  _, variables = model.apply({"params": params}, dummy, dummy, method=DecoderOnly.extend,
                             mutable=["cache"])
  cache = variables["cache"]
  if width:
    index = jnp.arange(width)[None, :] - (width - (lengths[:, None] - 1))  # into the prompt
    tokens = jnp.where(index >= 0, jnp.take_along_axis(prompt, jnp.maximum(index, 0), axis=1), 0)
    _, variables = model.apply({"params": params, "cache": cache}, tokens,
                               jnp.where(index >= 0, index, -1), method=DecoderOnly.extend,
                               mutable=["cache"])
    cache = variables["cache"]
  last = jnp.take_along_axis(prompt, jnp.maximum(lengths - 1, 0)[:, None], axis=1)[:, 0]
  return cache, jnp.where(lengths > 0, last, BOS_ID), jnp.maximum(lengths - 1, 0)


class Start(NamedTuple):
  """Where decoding starts: the cache, what each step reads besides it, and step 0's input."""

  cache: Cache
  context: tuple  # encoder-decoder: (encoded, source_tokens); decoder-only: ()
  first_tokens: Array  # int [batch]: the input of step 0
  first_positions: Array  # int [batch]: its position; step t reads position first + t


def start(params, config: ModelConfig, source_tokens: Array, max_length: int,
          beam_size: int = 1, bos_id: int = BOS_ID) -> Start:
  """The decoding state before the first output of each row (see the module docstring).

  Args:
    source_tokens: int `[batch, src_len]`: the encoder's source, or the decoder-only prompt.
    max_length: output positions (static).
    beam_size: rows are repeated beam_size times (after encoding, before a prefill).
  """
  batch = source_tokens.shape[0] * beam_size
  if config.arch == "decoder_only":
    cache, first, positions = _prefill(params, config, _tile_beams(source_tokens, beam_size),
                                       max_length)
    return Start(cache, (), first, positions)
  encoded = _tile_beams(encode(params, config, source_tokens), beam_size)
  source_tokens = _tile_beams(source_tokens, beam_size)
  cache = init_cache(params, config, encoded, source_tokens, max_length)
  return Start(cache, (encoded, source_tokens), jnp.full((batch,), bos_id, jnp.int32),
               jnp.zeros((batch,), jnp.int32))


def decode_step(params, config: ModelConfig, cache: Cache, context: tuple, tokens: Array,
                positions: Array) -> tuple[Array, Cache]:
  """One position of incremental decoding.

  Args:
    cache: from `start` or the previous step.
    context: `Start.context`.
    tokens: int `[batch]`, the input of this step.
    positions: int `[batch]`, its position.

  Returns:
    (logits float32 `[batch, vocab]` for the next token, updated cache).
  """
  positions = positions[:, None].astype(jnp.int32)
  if config.arch == "decoder_only":
    logits, variables = _model(config, decode=True).apply(
        {"params": params, "cache": cache}, tokens[:, None], positions,
        method=DecoderOnly.extend, mutable=["cache"])
  else:
    encoded, source_tokens = context
    logits, variables = _model(config, decode=True).apply(
        {"params": params, "cache": cache}, encoded, source_tokens, tokens[:, None], positions,
        method=Transformer.decode, mutable=["cache"])
  return logits[:, 0], variables["cache"]


def _mask_special(log_probs: Array, bos_id: int, suppressed: tuple = ()) -> Array:
  """Forbids PAD (0), BOS and the `suppressed` ids (eval.suppress_tokens): log_probs
  `[..., vocab]` with those entries set to NEG_INF."""
  ids = jnp.arange(log_probs.shape[-1])
  forbidden = (ids == 0) | (ids == bos_id)
  for token in suppressed:
    forbidden = forbidden | (ids == token)
  return jnp.where(forbidden, NEG_INF, log_probs)


def _force_eos(log_probs: Array, step: Array, max_length: int, eos_id: int) -> Array:
  """eval.force_eos: at the last output position only EOS, counted as log 1 (as transformers'
  forced_eos_token_id: an output cut at the length limit still ends with EOS)."""
  eos = jnp.arange(log_probs.shape[-1]) == eos_id
  return jnp.where(step == max_length - 1, jnp.where(eos, 0.0, NEG_INF), log_probs)


def _empty_rows(source_tokens: Array) -> Array:
  """bool `[batch]`: rows of padding only, which the searches treat as finished from the start."""
  return ~jnp.any(source_tokens != 0, axis=-1)


def _step_log_probs(params, config, cache, context, tokens, positions, bos_id, suppressed=()):
  """decode_step followed by log_softmax and the PAD/BOS mask: `[batch, vocab]`, cache."""
  logits, cache = decode_step(params, config, cache, context, tokens, positions)
  return _mask_special(jax.nn.log_softmax(logits, axis=-1), bos_id, suppressed), cache


@functools.partial(jax.jit, static_argnames=("config", "bos_id"))
def token_log_probs(params, config: ModelConfig, source_tokens: Array, output_tokens: Array,
                    bos_id: int = 1) -> Array:
  """log p of each output token under the full, uncached model (teacher forcing).

  Args:
    source_tokens: int `[batch, src_len]` (decoder-only: the source, not its prompt: the model
      reads "source BOS output" as in training; src_len may be 0).
    output_tokens: int `[batch, length]` as the decoders return them (no BOS; zeros after EOS).

  Returns:
    float32 `[batch, length]`: log p of each non-zero output token, 0 elsewhere.
  """
  # Inputs after EOS become padding; they only feed positions that are not counted below.
  decoder_inputs = shift_right(output_tokens, bos_id)
  logits = _model(config, decode=False).apply({"params": params}, source_tokens, decoder_inputs)
  log_probs = jax.nn.log_softmax(logits, axis=-1)
  token_log_probs = jnp.take_along_axis(log_probs, output_tokens[..., None], axis=-1)[..., 0]
  return jnp.where(output_tokens != 0, token_log_probs, 0.0)


@functools.partial(jax.jit, static_argnames=("config", "bos_id"))
def sequence_log_prob(params, config: ModelConfig, source_tokens: Array, output_tokens: Array,
                      bos_id: int = 1) -> Array:
  """log p(output | source): float32 `[batch]`, the sums of `token_log_probs`."""
  return jnp.sum(token_log_probs(params, config, source_tokens, output_tokens, bos_id), axis=-1)


def length_penalty(length: Array, alpha: float, form: str = "gnmt") -> Array:
  """The length penalty lp(Y) of eval.length_penalty_form: GNMT's ((5 + |Y|) / 6)^alpha, or
  "length": |Y|^alpha (transformers'); a hypothesis scores log p(Y) / lp(Y)."""
  length = jnp.asarray(length, jnp.float32)
  return (length if form == "length" else (5.0 + length) / 6.0) ** alpha


# ----------------------------------------------------------------------------- greedy, sampling


def _left_to_right(params, config: ModelConfig, source_tokens: Array, max_length: int,
                   choose: Callable[[Array, Array], Array], bos_id: int, eos_id: int,
                   lengths: Array | None = None, suppressed: tuple = (),
                   force_eos: bool = False, window: tuple | None = None) -> Array:
  """One token per row per step, chosen by `choose(log_probs [batch, vocab], step) -> [batch]`.

  Stops once every row has emitted EOS (or after `max_length` steps); returns `[batch, max_length]`.
  With `lengths` (int `[batch]`, the oracle length): EOS is forbidden and row r stops after
  exactly lengths[r] tokens (capped at max_length), so that only the tokens are the model's.
  With `window` = (shortest, longest) (int `[batch]` each): row r may emit EOS only after at
  least shortest[r] tokens and must emit it after longest[r]; the model chooses where in between.
  `suppressed`, `force_eos`: eval.suppress_tokens and eval.force_eos.
  """
  batch = source_tokens.shape[0]
  begin = start(params, config, source_tokens, max_length, bos_id=bos_id)
  if lengths is not None:
    lengths = jnp.minimum(jnp.asarray(lengths, jnp.int32), max_length)
  if window is not None:
    shortest, longest = (jnp.asarray(w, jnp.int32) for w in window)

  def not_done(state):
    step, _, _, _, finished = state
    return (step < max_length) & ~jnp.all(finished)

  def advance(state):
    step, last, tokens, cache, finished = state
    log_probs, cache = _step_log_probs(params, config, cache, begin.context, last,
                                       begin.first_positions + step, bos_id, suppressed)
    if force_eos:
      log_probs = _force_eos(log_probs, step, max_length, eos_id)
    if lengths is not None:
      log_probs = log_probs.at[:, eos_id].set(NEG_INF)
    if window is not None:
      eos = jnp.arange(log_probs.shape[-1]) == eos_id
      log_probs = jnp.where((step < shortest)[:, None] & eos, NEG_INF, log_probs)
      log_probs = jnp.where((step >= longest)[:, None] & ~eos, NEG_INF, log_probs)
    chosen = jnp.where(finished, 0, choose(log_probs, step)).astype(jnp.int32)
    tokens = tokens.at[:, step].set(chosen)
    finished = finished | (chosen == eos_id)
    if lengths is not None:
      finished = finished | (step + 1 >= lengths)
    return step + 1, chosen, tokens, cache, finished

  empty = _empty_rows(source_tokens)
  if lengths is not None:
    empty = empty | (lengths <= 0)
  state = (jnp.array(0, jnp.int32), begin.first_tokens,
           jnp.zeros((batch, max_length), jnp.int32), begin.cache, empty)
  return jax.lax.while_loop(not_done, advance, state)[2]


@functools.partial(jax.jit, static_argnames=("config", "max_length", "bos_id", "eos_id",
                                             "suppressed", "force_eos"))
def greedy_decode(params, config: ModelConfig, source_tokens: Array, max_length: int,
                  bos_id: int = 1, eos_id: int = 2, lengths: Array | None = None,
                  suppressed: tuple = (), force_eos: bool = False,
                  window: tuple | None = None) -> Array:
  """Picks the most probable token at every step.

  Args:
    source_tokens: int `[batch, src_len]` (0 = padding).
    max_length: output positions, EOS included (static; at most `config.max_len`).
    lengths: oracle-length decoding: int `[batch]`, the length each output must have (the
      reference's, EOS not counted). EOS is masked out of the choice and row r stops after
      lengths[r] tokens; its output has exactly min(lengths[r], max_length) tokens and no EOS.
      The gap between this and plain greedy decoding is the error of the model's decision to
      stop. None (default): plain greedy decoding.
    window: (shortest, longest), int `[batch]` each: EOS is forbidden before shortest[r] tokens
      and the only choice after longest[r] (eval.length_head_slack around a predicted length).

  Returns:
    int32 `[batch, max_length]`: no BOS, EOS included, zeros after EOS.
  """
  return _left_to_right(params, config, source_tokens, max_length,
                        lambda log_probs, step: jnp.argmax(log_probs, axis=-1), bos_id, eos_id,
                        lengths, suppressed, force_eos, window)


@functools.partial(jax.jit, static_argnames=("config", "max_length", "top_k", "bos_id",
                                             "eos_id", "suppressed", "force_eos"))
def sample(params, config: ModelConfig, source_tokens: Array, max_length: int, rng: Array,
           temperature: float = 1.0, top_k: int = 0, bos_id: int = 1, eos_id: int = 2,
           suppressed: tuple = (), force_eos: bool = False) -> Array:
  """Ancestral sampling from softmax(logits / temperature), optionally among the top-k tokens.

  Args:
    source_tokens: int `[batch, src_len]`.
    max_length: output positions (static).
    rng: PRNG key; step t uses `fold_in(rng, t)`.
    temperature: > 0; below 1 sharpens, above 1 flattens the distribution.
    top_k: sample only among the k most probable tokens (static; 0 = the whole vocabulary).
      top_k=1 is greedy decoding.

  Returns:
    int32 `[batch, max_length]`: no BOS, EOS included, zeros after EOS.
  """

  def choose(log_probs, step):
    logits = log_probs / temperature
    if 0 < top_k < logits.shape[-1]:
      kth_best = jax.lax.top_k(logits, top_k)[0][:, -1:]
      logits = jnp.where(logits < kth_best, -jnp.inf, logits)
    return jax.random.categorical(jax.random.fold_in(rng, step), logits, axis=-1)

  return _left_to_right(params, config, source_tokens, max_length, choose, bos_id, eos_id,
                        suppressed=suppressed, force_eos=force_eos)


# ----------------------------------------------------------------------------- beam search


class _Beams(NamedTuple):
  """Beam-search state; `batch` rows, `beam` = beam_size, `length` = max_length."""

  step: Array  # int32 scalar: the output position filled next
  alive_tokens: Array  # int32 [batch, beam, length], best first
  alive_log_probs: Array  # float32 [batch, beam]: log p of each alive prefix
  finished_tokens: Array  # int32 [batch, beam, length], best first
  finished_scores: Array  # float32 [batch, beam]: log p / length_penalty; NEG_INF = empty slot
  cache: Cache  # batch * beam rows, row b * beam + k is beam k of source b


def _gather(x: Array, indices: Array) -> Array:
  """x `[batch, n, ...]`, indices int `[batch, m]` -> `[batch, m, ...]` (per-row take)."""
  return jax.vmap(lambda row, index: row[index])(x, indices)


def _reorder_cache(cache: Cache, parents: Array) -> Cache:
  """Cache rows follow their beams: parents int `[batch, beam]` indexes the previous beams."""
  batch, beam = parents.shape

  def reorder(path, x):
    if x.ndim == 0 or getattr(path[-1], "key", None) in _STEP_INVARIANT:
      return x  # cache_index is shared by all rows
    x = x.reshape((batch, beam) + x.shape[1:])
    return _gather(x, parents).reshape((batch * beam,) + x.shape[2:])

  return jax.tree_util.tree_map_with_path(reorder, cache)


def _tile_beams(x: Array, beam_size: int) -> Array:
  """`[batch, ...]` -> `[batch * beam_size, ...]`, each row repeated beam_size times in place."""
  return jnp.repeat(x, beam_size, axis=0)


@functools.partial(jax.jit, static_argnames=("config", "max_length", "beam_size", "bos_id",
                                             "eos_id", "penalty_form", "suppressed",
                                             "force_eos"))
def beam_search(params, config: ModelConfig, source_tokens: Array, max_length: int,
                beam_size: int = 4, alpha: float = 0.6, bos_id: int = 1,
                eos_id: int = 2, penalty_form: str = "gnmt", suppressed: tuple = (),
                force_eos: bool = False) -> tuple[Array, Array]:
  """Beam search with the GNMT length penalty; returns the best hypothesis of each row.

  Each step extends every alive beam by every token and ranks the `2 * beam_size` best
  extensions by log-probability. Extensions that end the hypothesis (EOS, or reaching
  `max_length`) and rank within the first `beam_size` join the finished set, scored
  log p / ((5 + length) / 6)^alpha; the `beam_size` best of the others stay alive (at most
  `beam_size` of the candidates can end in EOS, one per beam, so there are always enough).
  With beam_size=1 and alpha=0 this is exactly greedy decoding; with alpha > 0 one beam may go
  on past greedy's EOS to a longer hypothesis that scores higher.

  A row is done once its best finished score is at least `best alive log p / lp(max_length)`:
  log p only falls as a hypothesis grows and alpha >= 0 caps lp at lp(max_length), so no alive
  beam can then overtake it. The loop stops when every row is done.

  Args:
    source_tokens: int `[batch, src_len]` (0 = padding); encoded once, then tiled over beams.
    max_length: output positions, EOS included (static).
    beam_size: beams per row (static).
    alpha: length-penalty exponent, >= 0 (0 = rank by raw log-probability).
    penalty_form: eval.length_penalty_form ("gnmt" or "length", see `length_penalty`).
    suppressed, force_eos: eval.suppress_tokens and eval.force_eos.

  Returns:
    (tokens int32 `[batch, max_length]`: no BOS, EOS included, zeros after EOS;
     scores float32 `[batch]`: log p(tokens | source) / length_penalty(len(tokens), alpha);
     a padding-only source row gets zeros and score 0).
  """
  batch = source_tokens.shape[0]
  empty = _empty_rows(source_tokens)
  begin = start(params, config, source_tokens, max_length, beam_size, bos_id)
  first_tokens = begin.first_tokens.reshape(batch, beam_size)
  vocab = config.vocab_size
  best_possible_penalty = length_penalty(max_length, alpha, penalty_form)

  def not_done(beams: _Beams):
    bound = beams.alive_log_probs[:, 0] / best_possible_penalty
    rows_done = beams.finished_scores[:, 0] >= bound
    return (beams.step < max_length) & ~jnp.all(rows_done)

  def advance(beams: _Beams) -> _Beams:
    step = beams.step
    last = jnp.where(step == 0, first_tokens,
                     beams.alive_tokens[:, :, jnp.maximum(step - 1, 0)])
    log_probs, cache = _step_log_probs(params, config, beams.cache, begin.context,
                                       last.reshape(-1), begin.first_positions + step, bos_id,
                                       suppressed)
    if force_eos:
      log_probs = _force_eos(log_probs, step, max_length, eos_id)
    scores = beams.alive_log_probs[:, :, None] + log_probs.reshape(batch, beam_size, vocab)
    top_log_probs, top_index = jax.lax.top_k(scores.reshape(batch, -1), 2 * beam_size)
    parents, tokens = top_index // vocab, top_index % vocab
    candidates = _gather(beams.alive_tokens, parents).at[:, :, step].set(tokens)
    ended = (tokens == eos_id) | (step == max_length - 1)

    # Finished: ended candidates that made the top beam_size, merged with the earlier ones.
    in_beam = jnp.arange(2 * beam_size) < beam_size
    new_scores = jnp.where(ended & in_beam,
                           top_log_probs / length_penalty(step + 1, alpha, penalty_form), NEG_INF)
    finished_scores, keep = jax.lax.top_k(
        jnp.concatenate([beams.finished_scores, new_scores], axis=1), beam_size)
    finished_tokens = _gather(
        jnp.concatenate([beams.finished_tokens, candidates], axis=1), keep)

    # Alive: the best candidates that did not end; the cache rows follow their parents.
    alive_log_probs, keep = jax.lax.top_k(jnp.where(ended, NEG_INF, top_log_probs), beam_size)
    return _Beams(step=step + 1, alive_tokens=_gather(candidates, keep),
                  alive_log_probs=alive_log_probs, finished_tokens=finished_tokens,
                  finished_scores=finished_scores,
                  cache=_reorder_cache(cache, _gather(parents, keep)))

  # All beams start as the empty prefix; only the first may expand, or the first step would
  # fill the beam with beam_size copies of each extension. A padding-only row starts finished
  # with the empty output scored 0, which nothing can beat, so it is done at once.
  first = jnp.arange(beam_size) == 0
  beams = _Beams(
      step=jnp.array(0, jnp.int32),
      alive_tokens=jnp.zeros((batch, beam_size, max_length), jnp.int32),
      alive_log_probs=jnp.where(first & ~empty[:, None], 0.0, NEG_INF).astype(jnp.float32),
      finished_tokens=jnp.zeros((batch, beam_size, max_length), jnp.int32),
      finished_scores=jnp.where(first & empty[:, None], 0.0, NEG_INF).astype(jnp.float32),
      cache=begin.cache)
  beams = jax.lax.while_loop(not_done, advance, beams)
  return beams.finished_tokens[:, 0], beams.finished_scores[:, 0]
