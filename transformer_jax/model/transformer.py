"""The stacks (Encoder, Decoder) and the three models built from them: the encoder-decoder
Transformer (with `encode` / `decode`), DecoderOnly and EncoderOnly; sizes and `describe`."""

from __future__ import annotations

import functools
from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.core.tokens import BOS_ID
from transformer_jax.model import attention
from transformer_jax.model.axes import constrain, param_init
from transformer_jax.model.config import ModelConfig
from transformer_jax.model.layers import (
  ACTIVATIONS,
  DecoderLayer,
  EncoderLayer,
  embedding_init,
  kernel_init,
  norm_layer,
)
from transformer_jax.model.positions import AddPositions, RelativePositionBias, random_positions

Array = jax.Array

# Rematerialisation of each layer in the backward pass (model.remat): "full" keeps only the
# layer's inputs; "dots" also keeps the outputs of its weight matrix products; "dots_all" every
# matrix product's output, the attention's batched ones (logits, context) too; "qkv_out" the
# queries, keys, values, the attention's context and the outputs of the attention and the FFN
# (names given in attention.py and layers.py): the FFN's hidden layer (d_ff wide, the largest
# activation of a layer) and the attention weights are computed again; "block_out" the outputs
# of the attention and FFN blocks alone (MaxText's save_out_proj), each block's inside again.
REMAT_POLICIES = {
    "full": None,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "dots_all": jax.checkpoint_policies.dots_saveable,
    "qkv_out": jax.checkpoint_policies.save_only_these_names("qkv", "context", "attention_out",
                                                             "mlp_out"),
    "block_out": jax.checkpoint_policies.save_only_these_names("attention_out", "mlp_out"),
}


def shift_right(targets: Array, bos_id: int = BOS_ID, segments: Optional[Array] = None) -> Array:
  """Decoder inputs: BOS followed by the targets without their last position. `[batch, length]`.

  Positions where `targets` is padding (0) stay 0. With `segments` (int `[batch, length]`,
  packed rows), every example starts with its own BOS.
  """
  bos = jnp.full((targets.shape[0], 1), bos_id, targets.dtype)
  shifted = jnp.concatenate([bos, targets[:, :-1]], axis=1)
  if segments is not None:
    previous = jnp.concatenate([jnp.zeros_like(segments[:, :1]), segments[:, :-1]], axis=1)
    shifted = jnp.where(segments != previous, bos_id, shifted)
  return jnp.where(targets > 0, shifted, 0)

def _embed(cfg: ModelConfig, name: str) -> nn.Embed:
  return nn.Embed(cfg.vocab_size, cfg.d_model,
                  embedding_init=param_init(embedding_init(cfg), "vocab", "embed"),
                  dtype=cfg.compute_dtype, name=name)


def _embed_tokens(cfg: ModelConfig, embed: nn.Embed, positions_module: AddPositions,
                  tokens: Array, positions: Array, deterministic: bool,
                  token_types: Optional[Array] = None) -> Array:
  """Token embedding (zeros for BOS with model.zero_bos_embedding; scaled by sqrt(d_model) with
  model.embed_scale), plus positions, plus each token's type (model.type_vocab_size;
  `token_types` int `[batch, length]`, None: type 0, one segment), normalised
  (model.embed_norm), then dropout.

  Called in a stack's compact scope: the type table and the norm are that stack's
  "token_types" and "embed_norm"."""
  rows = tokens
  for token, row in cfg.row_copies:
    rows = jnp.where(tokens == token, row, rows)
  x = embed(rows)
  if cfg.zero_bos_embedding:
    x = jnp.where((tokens == BOS_ID)[..., None], jnp.zeros((), x.dtype), x)
  if cfg.embed_scale:
    x = x * jnp.sqrt(jnp.asarray(cfg.d_model, cfg.compute_dtype))
  x = positions_module(x, positions)
  if cfg.type_vocab_size:
    types = nn.Embed(cfg.type_vocab_size, cfg.d_model, dtype=cfg.compute_dtype,
                     embedding_init=param_init(nn.initializers.normal(stddev=0.02), "token_type",
                                               "embed"), name="token_types")
    x = x + types(jnp.zeros((), jnp.int32) if token_types is None else token_types)
  if cfg.embed_norm:
    x = norm_layer(cfg, "embed_norm")(x)
  x = constrain(x, "batch", "length", "embed")
  return attention.Dropout(rate=cfg.dropout_rate, generator=cfg.dropout_rng)(x, deterministic)


def _default_positions(tokens: Array) -> Array:
  return jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)


def _segments(tokens: Array, segments: Optional[Array]) -> Array:
  """Example ids of packed rows, or 1 at every real token of an unpacked row (0 = padding)."""
  return (tokens > 0).astype(jnp.int32) if segments is None else segments


def _position_bias(cfg: ModelConfig, bidirectional: bool, query_positions: Array,
                   key_positions: Array) -> Optional[Array]:
  """The stack's relative position bias `[batch, heads, q_len, kv_len]`, or None when the model
  has none. Called in a module's compact scope: the table is that stack's "relative_bias"."""
  if cfg.positional != "relative_bias":
    return None
  return RelativePositionBias(cfg, bidirectional, name="relative_bias")(query_positions,
                                                                         key_positions)


def _relative_distances(cfg: ModelConfig, query_positions: Array,
                        key_positions: Array) -> Optional[Array]:
  """relative_xl or geometric self-attention: int `[batch, q_len, kv_len]`, query position -
  key position; else None."""
  if cfg.positional != "relative_xl" and cfg.self_attention != "geometric":
    return None
  return query_positions[:, :, None] - key_positions[:, None, :]


# model.random_positions_eval: the key of the evaluation's draw (any fixed key would do).
EVAL_POSITIONS_KEY = 29
# model.length_head_share=exp: a token's score is capped here before exp, so that a sum of
# shares stays finite in float32 (e^40 ~ 2e17: no output is that long).
MAX_LENGTH_SCORE = 40.0


def _drawn_positions(module: nn.Module, cfg: ModelConfig, positions: Array) -> Array:
  """The positions the model reads (cfg.draws_positions): in training mapped to a sorted random
  subset of [0, random_positions_max), drawn from the "dropout" RNG stream; in evaluation and
  decoding with model.random_positions_eval to a subset of max_len positions drawn from a fixed
  key, so that a decoding step sees the positions the whole sequence would; otherwise
  unchanged."""
  if not cfg.draws_positions:
    return positions
  if cfg.deterministic:
    return random_positions(jax.random.PRNGKey(EVAL_POSITIONS_KEY), positions,
                            cfg.random_positions_max, draw=cfg.max_len)
  return random_positions(module.make_rng("dropout"), positions, cfg.random_positions_max)


@jax.custom_vjp
def output_projection(x: Array, embedding: Array) -> Array:
  """Logits of the tied output layer: x `[batch, length, d]` times the `[vocab, d]` table^T.

  The gradient is the usual one; the custom rule only fixes how it is computed: the table's
  gradient as `(x^T dlogits)^T`, a `[d, vocab]` product transposed once at the end, where
  autodiff transposed the whole `[tokens, vocab]` logit gradient first (about 40 ms of a
  750 ms step on the CPU benchmark).
  """
  return jnp.einsum("btd,vd->btv", x, embedding)


def _output_projection_fwd(x, embedding):
  return output_projection(x, embedding), (x, embedding)


def _output_projection_bwd(residuals, d_logits):
  x, embedding = residuals
  d_x = jnp.einsum("btv,vd->btd", d_logits, embedding)
  d_embedding = jnp.einsum("btd,btv->dv", x, d_logits).T
  return d_x, d_embedding


output_projection.defvjp(_output_projection_fwd, _output_projection_bwd)


def exclude_rows(logits: Array, rows: tuple) -> Array:
  """logits `[..., vocab]` with the entries of `rows` (model.excluded_rows) at -inf: those rows
  get probability 0 from every softmax taken of them, and no gradient."""
  if not rows:
    return logits
  excluded = np.zeros(logits.shape[-1], bool)
  excluded[list(rows)] = True
  return jnp.where(excluded, -jnp.inf, logits)


def _logits(cfg: ModelConfig, embed: nn.Embed, y: Array, bias: Optional[Array] = None) -> Array:
  """float32 logits `[batch, length, vocab]` of the outputs y: the embedding table transposed
  (tied) or a Dense layer named "logits", plus `bias` `[vocab]`; the rows of
  model.excluded_rows at -inf. Every vocabulary distribution of the model comes from here."""
  if cfg.tie_output:
    embedding = jnp.asarray(embed.embedding, cfg.compute_dtype)
    if cfg.zero_bos_embedding:
      embedding = embedding.at[BOS_ID].set(0)
    logits = output_projection(y.astype(cfg.compute_dtype), embedding)
  else:
    logits = nn.Dense(cfg.vocab_size, use_bias=cfg.use_bias, dtype=cfg.compute_dtype,
                      kernel_init=param_init(kernel_init(cfg), "embed", "vocab"),
                      bias_init=param_init(nn.initializers.zeros_init(), "vocab"),
                      name="logits")(y)
  logits = logits.astype(jnp.float32) + (0.0 if bias is None else bias)
  return constrain(exclude_rows(logits, cfg.excluded_rows), "batch", "length", "vocab")


# The parameters the output layer reads (`output_logits`), by name: the table of a tied layer
# (the target side's), the untied layer ("logits") and the logits' biases, at the top of the
# tree or in the decoder.
_TIED_TABLES = ("shared_embedding", "target_embedding", "token_embedding")
_OUTPUT_LAYERS = ("logits", "logits_bias", "mlm_bias")


def output_layer_params(config: ModelConfig, params) -> dict:
  """The part of `params` that the model's `output_logits` reads (and nothing more): what the
  chunked loss (train.loss_chunk_tokens) keeps a gradient of while it runs."""
  names = _OUTPUT_LAYERS + (_TIED_TABLES if config.tie_output else ())
  kept = {name: params[name] for name in names if name in params}
  if "decoder" in params:
    inner = {name: params["decoder"][name] for name in names if name in params["decoder"]}
    if inner:
      kept["decoder"] = inner
  return kept


def _maybe_remat(layer_class, cfg: ModelConfig, deterministic_argnum: int):
  """The layer class, wrapped in `nn.remat` when training with model.remat set.

  The parameter tree is the same either way (the layers keep their names), so a checkpoint
  trained with one setting restores with any other.
  """
  if cfg.remat == "none" or cfg.decode:
    return layer_class
  return nn.remat(layer_class, static_argnums=(deterministic_argnum,),
                  policy=REMAT_POLICIES[cfg.remat])


def _stack_layers(layer_class, cfg: ModelConfig, count: int, **kwargs) -> list:
  """The `count` layers of a stack, in order: layer_0, layer_1, ..., or with model.share_layers
  one module, "shared_layer", `count` times (one set of parameters applied repeatedly)."""
  if cfg.share_layers:
    return [layer_class(cfg, name="shared_layer", **kwargs)] * count
  return [layer_class(cfg, name=f"layer_{i}", **kwargs) for i in range(count)]


def _cached_key_positions(module: nn.Module, positions: Array) -> Optional[Array]:
  """Decode mode: the position of every cache slot once this call's `positions` (int
  `[batch, n]`) are written at the cache index, int `[batch, cache_len]`, -1 where nothing (or
  padding) was written; None on the cache-creating call, which writes nothing."""
  initialized = module.has_variable("cache", "key_positions")
  slots = module.variable("cache", "key_positions",
                          lambda: jnp.full(positions.shape, -1, jnp.int32))
  index = module.variable("cache", "index", lambda: jnp.array(0, jnp.int32))
  if not initialized:
    return None
  slots.value = jax.lax.dynamic_update_slice(slots.value, positions.astype(jnp.int32),
                                             (0, index.value))
  index.value = index.value + positions.shape[1]
  return slots.value


class Encoder(nn.Module):
  """The bidirectional stack: embeddings, layers of self-attention and FFN, final norm."""

  config: ModelConfig
  embed: nn.Module

  @nn.compact
  def __call__(self, tokens: Array, positions: Optional[Array] = None,
               segments: Optional[Array] = None, token_types: Optional[Array] = None) -> Array:
    """tokens int `[batch, src_len]` (0 = padding) -> `[batch, src_len, d_model]`.

    positions / segments are given for packed rows (several examples per row); token_types
    (int, the same shape; model.type_vocab_size) for rows of two segments (BERT's A and B).
    """
    cfg = self.config
    deterministic = cfg.deterministic
    positions = _default_positions(tokens) if positions is None else positions
    positions = _drawn_positions(self, cfg, positions)
    valid = tokens > 0
    mask = attention.padding_mask(valid, valid)
    if segments is not None:
      mask = attention.combine_masks(mask, attention.segment_mask(segments, segments))
    x = _embed_tokens(cfg, self.embed, AddPositions(cfg, name="positions"), tokens, positions,
                      deterministic, token_types)
    bias = _position_bias(cfg, True, positions, positions)
    distances = _relative_distances(cfg, positions, positions)
    layer_class = _maybe_remat(EncoderLayer, cfg, deterministic_argnum=3)
    for layer in _stack_layers(layer_class, cfg, cfg.num_encoder_layers):
      x = layer(x, mask, deterministic, bias, positions, distances)
    if cfg.norm == "pre":
      x = norm_layer(cfg, "final_norm")(x)
    return x


class Decoder(nn.Module):
  """The causal stack: embeddings, layers of masked self-attention (and cross-attention to an
  encoder output), final norm, output projection. Used by the encoder-decoder and, without
  cross-attention, by the decoder-only model."""

  config: ModelConfig
  embed: nn.Module

  @nn.compact
  def __call__(self, tokens: Optional[Array], positions: Optional[Array],
               segments: Optional[Array], encoded: Optional[Array] = None,
               cross_mask: Optional[Array] = None, output_from: int = 0,
               output_layer: bool = True, hidden: Optional[Array] = None) -> Array:
    """Returns logits `[batch, length - output_from, vocab]` in float32.

    Args:
      tokens: int `[batch, length]` (0 = padding).
      positions: int `[batch, length]`, each token's position within its example; a query
        attends to the keys of its example at positions up to its own. In decode mode, the
        positions of this call's tokens (-1: padding of a prompt).
      segments: int `[batch, length]`, example ids (0 = padding).
      encoded: `[batch, src_len, d_model]` from the encoder, or None (decoder-only).
      cross_mask: bool `[batch, 1, length, src_len]`.
      output_from: the logits of positions output_from, ... only (decoder-only: the target).
      output_layer: False returns what the output layer reads instead of logits: the final
        hidden states `[batch, length - output_from, d_model]` (train.loss_chunk_tokens).
      hidden: such hidden states: the output layer alone runs, on them (the other arguments
        are not read).
    """
    cfg = self.config
    if hidden is not None:
      return _decoder_logits(self, hidden)
    deterministic = cfg.deterministic
    positions = _drawn_positions(self, cfg, positions)
    key_positions = _cached_key_positions(self, positions) if cfg.decode else None
    if key_positions is not None:
      # A decoding step (or prompt): the cache says which slots hold keys of real positions;
      # the attention's cache index keeps each query from the slots after its own.
      self_mask = (key_positions >= 0)[:, None, None, :]
    else:
      key_positions = positions
      self_mask = attention.combine_masks(
          attention.segment_mask(segments, segments), (segments > 0)[:, None, None, :],
          positions[:, None, None, :] <= positions[:, None, :, None])
    y = _embed_tokens(cfg, self.embed, AddPositions(cfg, name="positions"), tokens, positions,
                      deterministic)
    bias = _position_bias(cfg, False, positions, key_positions)
    distances = _relative_distances(cfg, positions, key_positions)
    layer_class = _maybe_remat(DecoderLayer, cfg, deterministic_argnum=5)
    layers = _stack_layers(layer_class, cfg, cfg.num_decoder_layers, decode=cfg.decode)
    for i, layer in enumerate(layers):
      # A shared layer keeps one decoding cache per application (no remat when decoding).
      slot = (i,) if cfg.share_layers and cfg.decode else ()
      y = layer(y, encoded, self_mask, cross_mask, deterministic, bias, positions, distances,
                *slot)
    y = y[:, output_from:]
    if cfg.norm == "pre":
      y = norm_layer(cfg, "final_norm")(y)
    return _decoder_logits(self, y) if output_layer else y


def _decoder_logits(decoder: Decoder, y: Array) -> Array:
  """The decoder's output layer: float32 logits `[batch, length, vocab]` of its final hidden
  states y `[batch, length, d_model]`. Called in the decoder's compact scope (its "logits"
  layer, "logits_bias")."""
  cfg = decoder.config
  bias = (decoder.param("logits_bias", param_init(nn.initializers.zeros_init(), "vocab"),
                        (cfg.vocab_size,)) if cfg.logits_bias else None)
  return _logits(cfg, decoder.embed, y, bias)


class Transformer(nn.Module):
  """The encoder-decoder Transformer. `__call__` = decode(encode(source), source, targets)."""

  config: ModelConfig

  def setup(self):
    cfg = self.config
    source_embed = _embed(cfg, "shared_embedding" if cfg.share_embeddings else "source_embedding")
    target_embed = source_embed if cfg.share_embeddings else _embed(cfg, "target_embedding")
    self.encoder = Encoder(cfg, source_embed, name="encoder")
    self.decoder = Decoder(cfg, target_embed, name="decoder")
    if cfg.length_head:
      self.length_head = nn.Dense(1, dtype=jnp.float32,
                                  kernel_init=param_init(kernel_init(cfg), "embed", None),
                                  bias_init=param_init(nn.initializers.zeros_init(), None),
                                  name="length_head")

  def predict_length(self, encoded: Array, source_tokens: Array) -> Array:
    """model.length_head: the predicted length of each target (EOS not counted), float32
    `[batch]`: the sum over the real source tokens of share(w . h_i + b), h_i the encoder's
    output at token i and share softplus or exp (model.length_head_share). Each token adds its
    own non-negative share, so a source made of parts seen in training predicts the sum of
    their shares, however long it is; with exp, what the context adds to a token's score
    multiplies its share. With model.length_head_stop_gradient no gradient flows from the
    prediction into the encoder."""
    encoded = encoded.astype(jnp.float32)
    if self.config.length_head_stop_gradient:
      encoded = jax.lax.stop_gradient(encoded)
    scores = self.length_head(encoded)[..., 0]
    if self.config.length_head_share == "exp":
      # capped where float32 would overflow in the sum (e^40 tokens is no length anyway)
      shares = jnp.exp(jnp.minimum(scores, MAX_LENGTH_SCORE))
    else:
      shares = jax.nn.softplus(scores)
    return jnp.sum(jnp.where(source_tokens > 0, shares, 0.0), axis=-1)

  def source_length_prediction(self, source_tokens: Array) -> Array:
    """`predict_length(encode(source_tokens), source_tokens)`: float32 `[batch]`."""
    return self.predict_length(self.encode(source_tokens), source_tokens)

  def encode(self, source_tokens: Array, source_positions: Optional[Array] = None,
             source_segments: Optional[Array] = None) -> Array:
    return self.encoder(source_tokens, source_positions, source_segments)

  def decode(self, encoded: Array, source_tokens: Array, decoder_inputs: Array,
             target_positions: Optional[Array] = None, source_segments: Optional[Array] = None,
             target_segments: Optional[Array] = None, output_layer: bool = True) -> Array:
    """Logits `[batch, tgt_len, vocab]` (float32) of the targets (with `output_layer=False`,
    the hidden states `output_logits` turns into them).

    Args:
      encoded: `[batch, src_len, d_model]` from the encoder.
      source_tokens: int `[batch, src_len]`, for the cross-attention padding mask.
      decoder_inputs: int `[batch, tgt_len]`, the targets shifted right (BOS first).
      target_positions: int `[batch, tgt_len]`; in decode mode, the position of the step.
      source_segments, target_segments: example ids for packed rows.
    """
    positions = (_default_positions(decoder_inputs) if target_positions is None
                 else target_positions)
    # In decode mode the queries are the steps being decoded, never padding.
    query_valid = (jnp.ones(decoder_inputs.shape, bool) if self.config.decode
                   else decoder_inputs > 0)
    cross_mask = attention.padding_mask(query_valid, source_tokens > 0)
    if target_segments is not None:
      cross_mask = attention.combine_masks(
          cross_mask, attention.segment_mask(target_segments, source_segments))
    return self.decoder(decoder_inputs, positions, _segments(decoder_inputs, target_segments),
                        encoded, cross_mask, output_layer=output_layer)

  def output_logits(self, hidden: Array) -> Array:
    """The output layer alone: float32 logits `[batch, length, vocab]` of the decoder's final
    hidden states `[batch, length, d_model]` (what `output_layer=False` returns)."""
    return self.decoder(None, None, None, hidden=hidden)

  def __call__(self, source_tokens: Array, decoder_inputs: Array,
               source_positions: Optional[Array] = None, target_positions: Optional[Array] = None,
               source_segments: Optional[Array] = None,
               target_segments: Optional[Array] = None, output_layer: bool = True) -> Array:
    """source_tokens `[batch, src_len]`, decoder_inputs `[batch, tgt_len]`
    -> logits `[batch, tgt_len, vocab]`, or with `output_layer=False` the hidden states
    `[batch, tgt_len, d_model]` that `output_logits` turns into them. With model.length_head,
    the predicted target lengths (`predict_length`) are sown as the "intermediates"
    collection's "length"; packed rows (source_segments) have none, since each row holds
    several targets."""
    encoded = self.encode(source_tokens, source_positions, source_segments)
    if self.config.length_head and source_segments is None:
      self.sow("intermediates", "length", self.predict_length(encoded, source_tokens))
    return self.decode(encoded, source_tokens, decoder_inputs, target_positions,
                       source_segments, target_segments, output_layer)


class DecoderOnly(nn.Module):
  """A decoder-only (GPT-style) language model over one sequence: the source, if any, then the
  target, each example in one causal stream ("source EOS BOS target EOS"; a language model's
  examples have no source). Called like the encoder-decoder, it returns the target's logits
  only, so the loss falls on the target (a prefix LM for sequence-to-sequence tasks)."""

  config: ModelConfig

  def setup(self):
    self.decoder = Decoder(self.config, _embed(self.config, "token_embedding"), name="decoder")

  def __call__(self, source_tokens: Array, decoder_inputs: Array,
               source_positions: Optional[Array] = None, target_positions: Optional[Array] = None,
               source_segments: Optional[Array] = None,
               target_segments: Optional[Array] = None, output_layer: bool = True) -> Array:
    """Logits `[batch, tgt_len, vocab]` of the targets (with `output_layer=False`, the hidden
    states `output_logits` turns into them).

    Args:
      source_tokens: int `[batch, src_len]` (0 = padding; src_len may be 0).
      decoder_inputs: int `[batch, tgt_len]`, the targets shifted right (BOS first).
      source_positions, target_positions, source_segments, target_segments: packed rows, where
        source example k and target example k are one sequence.
    """
    source_segments = _segments(source_tokens, source_segments)
    target_segments = _segments(decoder_inputs, target_segments)
    source_positions = (_default_positions(source_tokens) if source_positions is None
                        else source_positions)
    target_positions = (_default_positions(decoder_inputs) if target_positions is None
                        else target_positions)
    # Each target continues its own example's source: its positions start at that length.
    source_length = jnp.sum((source_segments[:, None, :] == target_segments[:, :, None])
                            & (source_tokens > 0)[:, None, :], axis=-1, dtype=jnp.int32)
    return self.decoder(
        jnp.concatenate([source_tokens, decoder_inputs], axis=1),
        jnp.concatenate([source_positions, target_positions + source_length], axis=1),
        jnp.concatenate([source_segments, target_segments], axis=1),
        output_from=source_tokens.shape[1], output_layer=output_layer)

  def output_logits(self, hidden: Array) -> Array:
    """The output layer alone (as `Transformer.output_logits`)."""
    return self.decoder(None, None, None, hidden=hidden)

  def extend(self, tokens: Array, positions: Array) -> Array:
    """Decode mode: writes `tokens` (int `[batch, n]`, a prompt or one step) at `positions`
    (int `[batch, n]`, -1 for padding) into the cache; returns their logits `[batch, n, vocab]`.
    """
    return self.decoder(tokens, positions, (positions >= 0).astype(jnp.int32))


class EncoderOnly(nn.Module):
  """An encoder-only (BERT-style) model: the bidirectional stack with a masked-language-model
  head (a dense layer, the activation and a norm, then the output projection with a bias, as
  BERT's), or, with model.num_labels > 0, a sequence-classification head (the mean of the
  outputs over the real tokens, or with model.pooling=first the first token's output, a tanh
  dense layer, then the classes)."""

  config: ModelConfig

  @nn.compact
  def __call__(self, tokens: Optional[Array], positions: Optional[Array] = None,
               segments: Optional[Array] = None, token_types: Optional[Array] = None,
               output_layer: bool = True, hidden: Optional[Array] = None) -> Array:
    """tokens int `[batch, length]` -> float32 logits: `[batch, length, vocab]` (masked LM) or
    `[batch, 1, num_labels]` (classification). token_types: int `[batch, length]` (BERT's
    segment A 0 / B 1; None: all 0). The masked LM's `output_layer=False` returns the
    `[batch, length, d_model]` the output projection reads, and `hidden` (such an array) runs
    the projection alone (`output_logits`)."""
    cfg = self.config
    embed = _embed(cfg, "token_embedding")
    if hidden is not None:
      return self._mlm_logits(embed, hidden)
    x = Encoder(cfg, embed, name="encoder")(tokens, positions, segments, token_types)

    def dense(features, names, name):
      return nn.Dense(features, use_bias=cfg.use_bias, dtype=cfg.compute_dtype,
                      kernel_init=param_init(kernel_init(cfg), *names),
                      bias_init=param_init(nn.initializers.zeros_init(), names[-1]), name=name)

    if cfg.num_labels:
      if cfg.pooling == "first":
        pooled = x[:, 0]
      else:
        valid = (tokens > 0)[:, :, None].astype(x.dtype)
        pooled = jnp.sum(x * valid, axis=1) / jnp.maximum(jnp.sum(valid, axis=1), 1.0)
      pooled = jnp.tanh(dense(cfg.d_model, ("embed", "mlp"), "pooler")(pooled))
      logits = dense(cfg.num_labels, ("mlp", None), "classifier")(pooled)
      return logits[:, None, :].astype(jnp.float32)
    h = ACTIVATIONS[cfg.activation](dense(cfg.d_model, ("embed", "mlp"), "mlm_dense")(x))
    h = norm_layer(cfg, "mlm_norm")(h)
    return self._mlm_logits(embed, h) if output_layer else h

  def _mlm_logits(self, embed: nn.Embed, h: Array) -> Array:
    """The masked LM's output projection (with BERT's bias); called from `__call__`."""
    cfg = self.config
    bias = (self.param("mlm_bias", param_init(nn.initializers.zeros_init(), "vocab"),
                       (cfg.vocab_size,)) if cfg.tie_output and cfg.use_bias else None)
    return _logits(cfg, embed, h, bias)

  def output_logits(self, hidden: Array) -> Array:
    """The masked LM's output projection alone (as `Transformer.output_logits`)."""
    return self(None, hidden=hidden)


MODELS = {"encoder_decoder": Transformer, "decoder_only": DecoderOnly,
          "encoder_only": EncoderOnly}


def make_model(config: ModelConfig) -> nn.Module:
  """The module of config.arch."""
  return MODELS[config.arch](config)


# ----------------------------------------------------------------------------- sizes


def init_boxed_params(config: ModelConfig, rng: Array):
  """Initial float32 parameters, each wrapped with the logical names of its dimensions
  (`nn.LogicallyPartitioned`; see `axes.py`). `nn.get_partition_spec` reads the names,
  `nn.unbox` the arrays."""
  model = make_model(config.replace(deterministic=True, decode=False))
  tokens = jnp.ones((1, 8), jnp.int32)  # the shapes depend on the config only, not on lengths
  if config.arch == "encoder_only":
    return model.init(rng, tokens)["params"]
  return model.init(rng, tokens, tokens)["params"]


def init_params(config: ModelConfig, rng: Array):
  """Initial float32 parameters: a nested dict of arrays."""
  return nn.unbox(init_boxed_params(config, rng))


def param_shapes(config: ModelConfig):
  """Parameter shapes without allocating them (jax.eval_shape)."""
  return jax.eval_shape(lambda r: init_params(config, r), jax.random.PRNGKey(0))


def count_params(params) -> dict:
  """Total parameters and those outside embedding tables (token and learned-position tables)."""
  total, embedding = 0, 0
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    size = int(np.prod(leaf.shape))
    total += size
    names = [getattr(p, "key", "") for p in path]
    if any(n.endswith("embedding") for n in names) or names[-1] == "table":
      embedding += size
  return {"total": total, "embedding": embedding, "non_embedding": total - embedding}


@functools.lru_cache(maxsize=8)
def _counts(config: ModelConfig) -> tuple:
  """count_params of the model's parameters, as (key, value) pairs, traced once per process
  (for `describe` without parameters: --mode=describe, a model not yet initialised)."""
  return tuple(count_params(param_shapes(config)).items())


def describe(config: ModelConfig, params=None) -> str:
  """A short human-readable summary: the config and parameter counts. `params`: the model's
  parameters (or their shapes), where the caller has them: counted without a trace of the
  model's initialiser."""
  counts = count_params(params) if params is not None else dict(_counts(config))
  c = config
  stacks = {"encoder_decoder": f"encoder-decoder, {c.num_encoder_layers}+{c.num_decoder_layers} "
                               "layers",
            "decoder_only": f"decoder-only, {c.num_decoder_layers} layers",
            "encoder_only": f"encoder-only, {c.num_encoder_layers} layers"}[c.arch]
  if c.share_layers:
    stacks += " (one shared layer per stack)"
  drawn = (f" (drawn from [0, {c.random_positions_max}) in training"
           + (" and evaluation)" if c.random_positions_eval else ")")
           if c.random_positions_max else "")
  head = f" ({c.num_labels} classes)" if c.num_labels else ""
  kv = f", {c.kv_heads} key/value heads" if c.kv_heads != c.num_heads else ""
  block = f"{c.norm}-{c.norm_type}, {c.activation}" + (", parallel blocks" if c.parallel_block
                                                       else "")
  block += ", gated residuals" if c.residual_gate else ""
  block += ", geometric self-attention" if c.self_attention == "geometric" else ""
  block += (", length head" + (" (exp shares)" if c.length_head_share == "exp" else "")
            + (" (stop-gradient)" if c.length_head_stop_gradient else "")
            if c.length_head else "")
  biases = {(True, True): "", (False, False): ", no biases", (True, False): ", q/k/v biases only",
            (False, True): ", no q/k/v biases"}[(c.qkv_bias, c.use_bias)]
  block += biases + ("" if c.tie_output else ", untied output layer")
  embeddings = [name for name, on in (("unscaled embeddings", not c.embed_scale),
                                      (f"{c.type_vocab_size} token types", c.type_vocab_size),
                                      ("embedding norm", c.embed_norm),
                                      ("logits bias", c.logits_bias),
                                      ("zero BOS embedding", c.zero_bos_embedding),
                                      (f"{len(c.excluded_rows)} rows without probability",
                                       c.excluded_rows),
                                      (f"{c.pooling}-pooled", c.num_labels and
                                       c.pooling != "mean")) if on]
  block += "".join(", " + name for name in embeddings)
  lines = [
      f"Transformer{head}: {stacks}, d_model {c.d_model}, d_ff {c.d_ff}, {c.num_heads} heads "
      f"(head_dim {c.head_dim}{kv}), model.vocab_size {c.vocab_size}, {block}, "
      f"{c.positional} positions{drawn}, dtype {c.dtype}",
      f"parameters: {counts['total']:,} total, {counts['non_embedding']:,} without embeddings "
      f"({counts['embedding']:,} in embedding and position tables)",
  ]
  return "\n".join(lines)
