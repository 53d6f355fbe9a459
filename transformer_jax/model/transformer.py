"""Encoder, Decoder and the Transformer with `encode` / `decode` methods; sizes and `describe`."""

from __future__ import annotations

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
  DecoderLayer,
  EncoderLayer,
  embedding_init,
  kernel_init,
  norm_layer,
)
from transformer_jax.model.positions import AddPositions

Array = jax.Array

# Rematerialisation of each layer in the backward pass (model.remat): "full" keeps only the
# layer's inputs; "dots" also keeps the outputs of its weight matrix products.
REMAT_POLICIES = {"full": None, "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


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
                  tokens: Array, positions: Array, deterministic: bool) -> Array:
  """Token embedding scaled by sqrt(d_model), plus positions, then dropout."""
  x = embed(tokens) * jnp.sqrt(jnp.asarray(cfg.d_model, cfg.compute_dtype))
  x = constrain(positions_module(x, positions), "batch", "length", "embed")
  return attention.Dropout(rate=cfg.dropout_rate)(x, deterministic)


def _default_positions(tokens: Array) -> Array:
  return jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)


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


def _maybe_remat(layer_class, cfg: ModelConfig, deterministic_argnum: int):
  """The layer class, wrapped in `nn.remat` when training with model.remat set.

  The parameter tree is the same either way (the layers keep their names), so a checkpoint
  trained with one setting restores with any other.
  """
  if cfg.remat == "none" or cfg.decode:
    return layer_class
  return nn.remat(layer_class, static_argnums=(deterministic_argnum,),
                  policy=REMAT_POLICIES[cfg.remat])


class Encoder(nn.Module):
  config: ModelConfig
  embed: nn.Module

  @nn.compact
  def __call__(self, tokens: Array, positions: Optional[Array] = None,
               segments: Optional[Array] = None) -> Array:
    """tokens int `[batch, src_len]` (0 = padding) -> `[batch, src_len, d_model]`.

    positions / segments are given for packed rows (several examples per row).
    """
    cfg = self.config
    deterministic = cfg.deterministic
    positions = _default_positions(tokens) if positions is None else positions
    valid = tokens > 0
    mask = attention.padding_mask(valid, valid)
    if segments is not None:
      mask = attention.combine_masks(mask, attention.segment_mask(segments, segments))
    x = _embed_tokens(cfg, self.embed, AddPositions(cfg, name="positions"), tokens, positions,
                      deterministic)
    layer = _maybe_remat(EncoderLayer, cfg, deterministic_argnum=3)
    for i in range(cfg.num_encoder_layers):
      x = layer(cfg, name=f"layer_{i}")(x, mask, deterministic)
    if cfg.norm == "pre":
      x = norm_layer(cfg, "final_norm")(x)
    return x


class Decoder(nn.Module):
  config: ModelConfig
  embed: nn.Module

  @nn.compact
  def __call__(self, encoded: Array, source_tokens: Array, decoder_inputs: Array,
               positions: Optional[Array] = None, source_segments: Optional[Array] = None,
               target_segments: Optional[Array] = None) -> Array:
    """Returns logits `[batch, tgt_len, vocab]` in float32.

    Args:
      encoded: `[batch, src_len, d_model]` from the encoder.
      source_tokens: int `[batch, src_len]`, for the cross-attention padding mask.
      decoder_inputs: int `[batch, tgt_len]`, the targets shifted right (BOS first).
      positions: int `[batch, tgt_len]`; in decode mode, the position of the single step.
      source_segments, target_segments: example ids for packed rows.
    """
    cfg = self.config
    deterministic = cfg.deterministic
    positions = _default_positions(decoder_inputs) if positions is None else positions
    source_valid = source_tokens > 0
    if cfg.decode:
      # One step at a time: the cache masks positions not yet written; queries are never padding.
      query_valid = jnp.ones(decoder_inputs.shape, dtype=bool)
      self_mask = None
    else:
      query_valid = decoder_inputs > 0
      self_mask = attention.combine_masks(
          attention.padding_mask(query_valid, query_valid),
          attention.causal_mask(decoder_inputs.shape[1]))
    cross_mask = attention.padding_mask(query_valid, source_valid)
    if target_segments is not None:
      self_mask = attention.combine_masks(
          self_mask, attention.segment_mask(target_segments, target_segments))
      cross_mask = attention.combine_masks(
          cross_mask, attention.segment_mask(target_segments, source_segments))

    y = _embed_tokens(cfg, self.embed, AddPositions(cfg, name="positions"), decoder_inputs,
                      positions, deterministic)
    layer = _maybe_remat(DecoderLayer, cfg, deterministic_argnum=5)
    for i in range(cfg.num_decoder_layers):
      y = layer(cfg, decode=cfg.decode, name=f"layer_{i}")(
          y, encoded, self_mask, cross_mask, deterministic)
    if cfg.norm == "pre":
      y = norm_layer(cfg, "final_norm")(y)
    if cfg.tie_output:
      embedding = jnp.asarray(self.embed.embedding, cfg.compute_dtype)
      logits = output_projection(y.astype(cfg.compute_dtype), embedding)
    else:
      logits = nn.Dense(cfg.vocab_size, dtype=cfg.compute_dtype,
                        kernel_init=param_init(kernel_init(cfg), "embed", "vocab"),
                        bias_init=param_init(nn.initializers.zeros_init(), "vocab"),
                        name="logits")(y)
    return constrain(logits.astype(jnp.float32), "batch", "length", "vocab")


class Transformer(nn.Module):
  """The encoder-decoder Transformer. `__call__` = decode(encode(source), source, targets)."""

  config: ModelConfig

  def setup(self):
    cfg = self.config
    source_embed = _embed(cfg, "shared_embedding" if cfg.share_embeddings else "source_embedding")
    target_embed = source_embed if cfg.share_embeddings else _embed(cfg, "target_embedding")
    self.encoder = Encoder(cfg, source_embed, name="encoder")
    self.decoder = Decoder(cfg, target_embed, name="decoder")

  def encode(self, source_tokens: Array, source_positions: Optional[Array] = None,
             source_segments: Optional[Array] = None) -> Array:
    return self.encoder(source_tokens, source_positions, source_segments)

  def decode(self, encoded: Array, source_tokens: Array, decoder_inputs: Array,
             target_positions: Optional[Array] = None, source_segments: Optional[Array] = None,
             target_segments: Optional[Array] = None) -> Array:
    return self.decoder(encoded, source_tokens, decoder_inputs, target_positions,
                        source_segments, target_segments)

  def __call__(self, source_tokens: Array, decoder_inputs: Array,
               source_positions: Optional[Array] = None, target_positions: Optional[Array] = None,
               source_segments: Optional[Array] = None,
               target_segments: Optional[Array] = None) -> Array:
    """source_tokens `[batch, src_len]`, decoder_inputs `[batch, tgt_len]`
    -> logits `[batch, tgt_len, vocab]`."""
    encoded = self.encode(source_tokens, source_positions, source_segments)
    return self.decode(encoded, source_tokens, decoder_inputs, target_positions,
                       source_segments, target_segments)


# ----------------------------------------------------------------------------- sizes


def init_boxed_params(config: ModelConfig, rng: Array):
  """Initial float32 parameters, each wrapped with the logical names of its dimensions
  (`nn.LogicallyPartitioned`; see `axes.py`). `nn.get_partition_spec` reads the names,
  `nn.unbox` the arrays."""
  model = Transformer(config.replace(deterministic=True, decode=False))
  tokens = jnp.ones((1, 8), jnp.int32)  # the shapes depend on the config only, not on lengths
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


def describe(config: ModelConfig) -> str:
  """A short human-readable summary: the config and parameter counts."""
  counts = count_params(param_shapes(config))
  lines = [
      f"Transformer: {config.num_encoder_layers}+{config.num_decoder_layers} layers, "
      f"d_model {config.d_model}, d_ff {config.d_ff}, {config.num_heads} heads "
      f"(head_dim {config.head_dim}), vocab {config.vocab_size}, {config.norm}-LN, "
      f"{config.positional} positions, dtype {config.dtype}",
      f"parameters: {counts['total']:,} total, {counts['non_embedding']:,} without embeddings "
      f"({counts['embedding']:,} in embedding tables)",
  ]
  return "\n".join(lines)
