"""Initialisers, the feed-forward network, normalisation, the residual wiring, the two layers."""

from __future__ import annotations

import functools
from typing import Callable, Optional, Sequence

import flax.linen as nn
import jax
from jax.ad_checkpoint import checkpoint_name

from transformer_jax.model.attention import Dropout, MultiHeadAttention
from transformer_jax.model.axes import constrain, param_init
from transformer_jax.model.config import ModelConfig

Array = jax.Array

# The nonlinearity of each FFN activation; the gated ones multiply it by a second projection.
# gelu is the tanh approximation (flax's default), gelu_exact the error-function form.
ACTIVATIONS = {"relu": nn.relu, "gelu": nn.gelu,
               "gelu_exact": functools.partial(nn.gelu, approximate=False),
               "silu": nn.silu, "swiglu": nn.swish, "geglu": nn.gelu}


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
  """FFN(x) = act(x W1 + b1) W2 + b2, applied at every position; dropout on the output.

  Gated (swiglu, geglu; Shazeer 2020): FFN(x) = (act(x W_gate + b_gate) * (x W1 + b1)) W2 + b2,
  a third matrix of the same shape as W1.
  """

  config: ModelConfig

  @nn.compact
  def __call__(self, x: Array, deterministic: bool) -> Array:
    cfg = self.config

    def dense(features, names, name):
      return nn.Dense(features, use_bias=cfg.use_bias, dtype=cfg.compute_dtype,
                      kernel_init=param_init(kernel_init(cfg), *names),
                      bias_init=param_init(nn.initializers.zeros_init(), names[-1]), name=name)

    h = ACTIVATIONS[cfg.activation](dense(cfg.d_ff, ("embed", "mlp"),
                                          "wi_gate" if cfg.gated else "wi")(x))
    if cfg.gated:
      h = h * dense(cfg.d_ff, ("embed", "mlp"), "wi")(x)
    h = constrain(h, "batch", "length", "mlp")
    h = constrain(dense(cfg.d_model, ("mlp", "embed"), "wo")(h), "batch", "length", "embed")
    h = checkpoint_name(h, "mlp_out")  # for model.remat's policies (transformer.REMAT_POLICIES)
    return Dropout(rate=cfg.dropout_rate, generator=cfg.dropout_rng)(h, deterministic)


def attention(cfg: ModelConfig, name: str, decode: bool = False, rotary: bool = False,
              bidirectional: bool = True) -> MultiHeadAttention:
  """The attention of a layer; `rotary` (self-attention) applies the position options that act
  inside attention (rotary, relative_xl), `bidirectional` says whether keys follow queries."""
  relative = rotary and cfg.positional == "relative_xl"
  # Randomised positions reach random_positions_max: embed every distance below it.
  span = cfg.random_positions_max if cfg.draws_positions else 0
  return MultiHeadAttention(
      num_heads=cfg.num_heads, d_model=cfg.d_model, num_kv_heads=cfg.num_kv_heads,
      head_dim=cfg.head_dim,
      dropout_rate=cfg.attention_dropout_rate, output_dropout_rate=cfg.dropout_rate,
      dropout_generator=cfg.dropout_rng,
      fused_qkv=cfg.fused_qkv, use_bias=cfg.qkv_bias, out_bias=cfg.use_bias,
      rotary_base=cfg.position_base if rotary and cfg.positional == "rotary" else 0.0,
      relative_base=cfg.position_base if relative else 0.0,
      relative_bidirectional=bidirectional, relative_span=span,
      geometric=rotary and cfg.self_attention == "geometric",
      implementation=cfg.attention_impl, decode=decode, dtype=cfg.compute_dtype,
      kernel_init=kernel_init(cfg), name=name)


def norm_layer(config: ModelConfig, name: str) -> nn.Module:
  """LayerNorm (scale and bias; no bias with model.use_bias=False), or RMSNorm (scale only:
  x / rms(x) * scale, the statistics in float32; Zhang & Sennrich, 2019)."""
  scale_init = param_init(nn.initializers.ones_init(), "embed")
  if config.norm_type == "rmsnorm":
    return nn.RMSNorm(epsilon=config.layer_norm_eps, dtype=config.compute_dtype,
                      scale_init=scale_init, name=name)
  return nn.LayerNorm(epsilon=config.layer_norm_eps, dtype=config.compute_dtype,
                      use_bias=config.use_bias, scale_init=scale_init,
                      bias_init=param_init(nn.initializers.zeros_init(), "embed"), name=name)


GATE_BIAS = -3.0  # model.residual_gate's initial bias: sigmoid(-3) = 0.047, nearly a copy


class Residual(nn.Module):
  """Wraps sublayers with the residual connection and normalisation, post-LN or pre-LN.

  post (the paper): LN(x + Sublayer(x)); pre: x + Sublayer(LN(x)). With several sublayers (a
  parallel block) they all read the same input and their outputs are summed.

  With model.residual_gate, the sum becomes a gated choice per position and channel between
  keeping x and taking the sublayer's output u (the copy gate of Csordas et al.'s Neural Data
  Router, 2022, here around every block): g = sigmoid(h W_g + b_g), x' = g * u + (1 - g) * x,
  with h the sublayer's input (LN(x) pre-LN, x post-LN) and then LN(x') post-LN. b_g starts at
  GATE_BIAS, so that each block starts as nearly the identity: a column keeps its state unless
  the gate learns to let the update through.
  """

  config: ModelConfig

  @nn.compact
  def __call__(self, x: Array, *sublayers: Callable[[Array], Array]) -> Array:
    cfg = self.config
    norm = norm_layer(cfg, "norm")
    h = norm(x) if cfg.norm == "pre" else x
    update = sum(sublayer(h) for sublayer in sublayers)
    if cfg.residual_gate:
      gate = nn.sigmoid(nn.Dense(
          cfg.d_model, dtype=cfg.compute_dtype,
          kernel_init=param_init(kernel_init(cfg), "embed", None),
          bias_init=param_init(nn.initializers.constant(GATE_BIAS), None), name="gate")(h))
      x = x + gate * (update - x)  # g * u + (1 - g) * x
    else:
      x = x + update
    if cfg.norm == "post":
      x = norm(x)
    return constrain(x, "batch", "length", "embed")


def residual_blocks(cfg: ModelConfig, x: Array,
                    blocks: Sequence[tuple[str, Callable[[Array], Array]]]) -> Array:
  """The blocks (name, sublayer) one after the other, each with its Residual; or, with
  model.parallel_block, all of them in one Residual named "parallel_block"."""
  if cfg.parallel_block:
    return Residual(cfg, name="parallel_block")(x, *(sublayer for _, sublayer in blocks))
  for name, sublayer in blocks:
    x = Residual(cfg, name=name)(x, sublayer)
  return x


class EncoderLayer(nn.Module):
  config: ModelConfig

  @nn.compact
  def __call__(self, x: Array, mask: Optional[Array], deterministic: bool,
               bias: Optional[Array] = None, positions: Optional[Array] = None,
               distances: Optional[Array] = None) -> Array:
    """x `[batch, src_len, d_model]`, mask bool `[batch, 1, src_len, src_len]`; bias (relative
    positions) `[batch, heads, src_len, src_len]`; positions (rotary) int `[batch, src_len]`;
    distances (relative_xl) int `[batch, src_len, src_len]`."""
    cfg = self.config
    self_attention = attention(cfg, "self_attention", rotary=True)
    ffn = FeedForward(cfg, name="ffn")
    return residual_blocks(cfg, x, [
        ("attention_block", lambda h: self_attention(h, None, mask, deterministic, bias=bias,
                                                     positions=positions, distances=distances)),
        ("ffn_block", lambda h: ffn(h, deterministic))])


class DecoderLayer(nn.Module):
  """Masked self-attention, cross-attention to the encoder output (none in a decoder-only
  model: `encoded` None), feed-forward."""

  config: ModelConfig
  decode: bool = False

  @nn.compact
  def __call__(self, y: Array, encoded: Optional[Array], self_mask: Optional[Array],
               cross_mask: Optional[Array], deterministic: bool, bias: Optional[Array] = None,
               positions: Optional[Array] = None, distances: Optional[Array] = None,
               cache_slot: int = 0) -> Array:
    """y `[batch, tgt_len, d_model]`, encoded `[batch, src_len, d_model]` or None.

    self_mask `[batch, 1, tgt_len, tgt_len]` (causal and padding), cross_mask
    `[batch, 1, tgt_len, src_len]`; bias (relative positions) `[batch, heads, tgt_len, tgt_len]`;
    positions (rotary) int `[batch, tgt_len]`; distances (relative_xl) int
    `[batch, tgt_len, tgt_len or cache_len]`; cache_slot: see MultiHeadAttention.
    """
    cfg = self.config
    self_attention = attention(cfg, "self_attention", self.decode, rotary=True,
                               bidirectional=False)
    blocks = [("self_attention_block", lambda h: self_attention(
        h, None, self_mask, deterministic, bias=bias, positions=positions, distances=distances,
        cache_slot=cache_slot))]
    if encoded is not None:
      cross_attention = attention(cfg, "cross_attention", self.decode)
      blocks.append(("cross_attention_block",
                     lambda h: cross_attention(h, encoded, cross_mask, deterministic)))
    ffn = FeedForward(cfg, name="ffn")
    blocks.append(("ffn_block", lambda h: ffn(h, deterministic)))
    return residual_blocks(cfg, y, blocks)
