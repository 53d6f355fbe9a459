"""Initialisers, the feed-forward network, the residual + LayerNorm wrapper, the two blocks."""

from __future__ import annotations

from typing import Optional

import flax.linen as nn
import jax

from transformer_jax.model.attention import Dropout, MultiHeadAttention
from transformer_jax.model.axes import constrain, param_init
from transformer_jax.model.config import ModelConfig

Array = jax.Array


def kernel_init(config: ModelConfig):
  """Weight initialiser: the paper's Xavier-uniform, or BERT/GPT-style normal(0.02)."""
  if config.init == "xavier":
    return nn.initializers.xavier_uniform()
  return nn.initializers.normal(stddev=0.02)


def embedding_init(config: ModelConfig):
  # normal(d_model^-0.5) times the sqrt(d_model) input scale gives unit-variance embeddings.
  if config.init == "xavier":
    return nn.initializers.normal(stddev=config.d_model**-0.5)
  return nn.initializers.normal(stddev=0.02)


class FeedForward(nn.Module):
  """FFN(x) = act(x W1 + b1) W2 + b2, applied at every position; dropout on the output."""

  config: ModelConfig

  @nn.compact
  def __call__(self, x: Array, deterministic: bool) -> Array:
    cfg = self.config
    activation = {"relu": nn.relu, "gelu": nn.gelu}[cfg.activation]
    h = nn.Dense(cfg.d_ff, dtype=cfg.compute_dtype,
                 kernel_init=param_init(kernel_init(cfg), "embed", "mlp"),
                 bias_init=param_init(nn.initializers.zeros_init(), "mlp"), name="wi")(x)
    h = constrain(activation(h), "batch", "length", "mlp")
    h = nn.Dense(cfg.d_model, dtype=cfg.compute_dtype,
                 kernel_init=param_init(kernel_init(cfg), "mlp", "embed"),
                 bias_init=param_init(nn.initializers.zeros_init(), "embed"), name="wo")(h)
    h = constrain(h, "batch", "length", "embed")
    return Dropout(rate=cfg.dropout_rate)(h, deterministic)


def _attention(cfg: ModelConfig, name: str, decode: bool = False) -> MultiHeadAttention:
  return MultiHeadAttention(
      num_heads=cfg.num_heads, d_model=cfg.d_model, dropout_rate=cfg.attention_dropout_rate,
      output_dropout_rate=cfg.dropout_rate, fused_qkv=cfg.fused_qkv, use_bias=cfg.qkv_bias,
      implementation=cfg.attention_impl, decode=decode, dtype=cfg.compute_dtype,
      kernel_init=kernel_init(cfg), name=name)


def layer_norm(config: ModelConfig, name: str) -> nn.LayerNorm:
  return nn.LayerNorm(epsilon=config.layer_norm_eps, dtype=config.compute_dtype,
                      scale_init=param_init(nn.initializers.ones_init(), "embed"),
                      bias_init=param_init(nn.initializers.zeros_init(), "embed"), name=name)


class Residual(nn.Module):
  """Wraps a sublayer with the residual connection and LayerNorm, post-LN or pre-LN.

  post (the paper): LayerNorm(x + Sublayer(x)); pre: x + Sublayer(LayerNorm(x)).
  """

  config: ModelConfig

  @nn.compact
  def __call__(self, x: Array, sublayer) -> Array:
    norm = layer_norm(self.config, "norm")
    if self.config.norm == "pre":
      x = x + sublayer(norm(x))
    else:
      x = norm(x + sublayer(x))
    return constrain(x, "batch", "length", "embed")


class EncoderLayer(nn.Module):
  config: ModelConfig

  @nn.compact
  def __call__(self, x: Array, mask: Optional[Array], deterministic: bool) -> Array:
    """x `[batch, src_len, d_model]`, mask bool `[batch, 1, src_len, src_len]`."""
    cfg = self.config
    attention = _attention(cfg, "self_attention")
    x = Residual(cfg, name="attention_block")(x, lambda h: attention(h, None, mask, deterministic))
    ffn = FeedForward(cfg, name="ffn")
    return Residual(cfg, name="ffn_block")(x, lambda h: ffn(h, deterministic))


class DecoderLayer(nn.Module):
  config: ModelConfig
  decode: bool = False

  @nn.compact
  def __call__(self, y: Array, encoded: Array, self_mask: Optional[Array],
               cross_mask: Optional[Array], deterministic: bool) -> Array:
    """y `[batch, tgt_len, d_model]`, encoded `[batch, src_len, d_model]`.

    self_mask `[batch, 1, tgt_len, tgt_len]` (causal and padding), cross_mask
    `[batch, 1, tgt_len, src_len]`.
    """
    cfg = self.config
    self_attention = _attention(cfg, "self_attention", self.decode)
    cross_attention = _attention(cfg, "cross_attention", self.decode)
    y = Residual(cfg, name="self_attention_block")(
        y, lambda h: self_attention(h, None, self_mask, deterministic))
    y = Residual(cfg, name="cross_attention_block")(
        y, lambda h: cross_attention(h, encoded, cross_mask, deterministic))
    ffn = FeedForward(cfg, name="ffn")
    return Residual(cfg, name="ffn_block")(y, lambda h: ffn(h, deterministic))
