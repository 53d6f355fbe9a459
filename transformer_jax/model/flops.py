"""Model FLOPs of a training step, and the accelerators' peak FLOP/s, HBM size and bandwidth.

Model FLOPs of one training step (no padding: the benchmark batch is full), counting a
multiply-add as 2 FLOPs and the backward pass as twice the forward. With d_q = heads x head_dim
(d unless model.head_size sets the heads' width apart, as T5's d_kv), d_kv = key/value heads x
head_dim (d_q with multi-head attention, less with grouped-query attention) and F = 2 d d_ff
(3 d d_ff for a gated FFN), the matrices one token passes through are

  A = 2 d d_q + 2 d d_kv      self-attention: queries and output d x d_q, keys and values d x d_kv
  layer = A + F

and the encoder-decoder's forward pass is

  forward = 2 * (  L_enc * layer * B S                          encoder
                 + L_dec * (layer + 2 d d_q) * B T              decoder; cross-attention q, out
                 + L_dec * 2 d d_kv * B S                       cross-attention keys and values
                 + d V * B T )                                  output projection
          + 4 d_q * B * (L_enc S^2 + L_dec T^2 + L_dec T S)     QK^T and AV of every attention

The decoder-only model runs its L_dec layers over source and target together (B (S + T)
tokens, attention over (S + T)^2) and projects the target only (d V * B T); the encoder-only
model runs L_enc layers over B S tokens and its masked-LM head (d^2 + d V per token; a
classifier's head is per row and left out). train = 3 * forward.

With model.positional=relative_xl each self-attention also projects the sinusoids of its R
embedded distances (W_r: 2 d d_q R per layer, once per batch) and scores every query against
them (2 d_q R per query token); R = 2 span - 1 in the encoder (distances of both signs), span in
a causal decoder, where span is the sequence length (source S, target T, or S + T), or
model.random_positions_max when that is larger.

This is the usual "6 x parameters per token" with each weight matrix charged for the tokens it
actually sees, plus the attention term (the causal mask's zeros are counted, as in most MFU
reports). Positions, token types, norms, biases and the parallel block change no matrix
product; model.residual_gate adds a d x d gate to each residual block (d^2 per token each).
MFU = achieved FLOP/s / the device's peak dense bf16 FLOP/s.
"""

from __future__ import annotations

from typing import NamedTuple

from transformer_jax.model.config import ModelConfig


class Chip(NamedTuple):
  """An accelerator's published peak dense bf16 FLOP/s, HBM size and HBM bandwidth."""

  name: str
  peak_flops: float
  hbm_bytes: float
  hbm_bytes_per_s: float


GiB = 2**30

# By device kind (substring match, first hit wins). TPUs report device_kind "TPU v4", "TPU v5
# lite" (v5e), "TPU v5" (v5p), "TPU v6 lite" (v6e); each "lite" entry comes before the name it
# extends, as the A100 80GB comes before the 40 GB one. Figures from the vendors' spec sheets
# (HBM per chip, in the units the sheet writes: "80GB" is 80e9 bytes, "16 GiB" 16 * GiB; the SXM
# parts of NVIDIA's). The GPUs that `--mode=compile` targets also have XLA's description of the
# part in gpus/PART.txtpb, whose HBM figures must equal these (tests/test_compile.py checks).
CHIPS = (
    ("H200", Chip("H200", 989e12, 141e9, 4.8e12)),
    ("H100", Chip("H100", 989e12, 80e9, 3.35e12)),
    ("A100-SXM4-80GB", Chip("A100 80GB", 312e12, 80e9, 2.039e12)),
    ("A100", Chip("A100", 312e12, 40e9, 1.555e12)),
    ("TPU v6 lite", Chip("TPU v6e", 918e12, 32 * GiB, 1.64e12)),
    ("TPU v5 lite", Chip("TPU v5e", 197e12, 16 * GiB, 0.819e12)),
    ("TPU v5", Chip("TPU v5p", 459e12, 95 * GiB, 2.765e12)),
    ("TPU v4", Chip("TPU v4", 275e12, 32 * GiB, 1.228e12)),
)


def chip(device) -> Chip | None:
  """The spec sheet of `device`'s kind, or None (CPUs, unknown accelerators)."""
  kind = getattr(device, "device_kind", "")
  for name, spec in CHIPS:
    if name.lower() in kind.lower():
      return spec
  return None


def peak_flops(device) -> float | None:
  spec = chip(device)
  return spec.peak_flops if spec else None


def train_flops_per_step(cfg: ModelConfig, batch: int, source_len: int, target_len: int) -> float:
  """Model FLOPs of one train step on a full `[batch, source_len]` + `[batch, target_len]` batch
  (the module docstring has the formula)."""
  d, v = cfg.d_model, cfg.vocab_size
  le, ld = cfg.num_encoder_layers, cfg.num_decoder_layers
  d_q, d_kv = cfg.num_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
  layer = 2 * d * d_q + 2 * d * d_kv + (3 if cfg.gated else 2) * d * cfg.d_ff
  # model.residual_gate: a d x d gate in each residual block (a layer's 2 or 3, or 1 parallel)
  gates = d * d * (1 if cfg.parallel_block else 2) if cfg.residual_gate else 0
  layer += gates
  s_tokens, t_tokens = batch * source_len, batch * target_len
  if cfg.arch == "decoder_only":
    length = source_len + target_len
    matmuls = ld * layer * batch * length + d * v * t_tokens
    scores = ld * length**2
  elif cfg.arch == "encoder_only":
    head = 0 if cfg.num_labels else d * d + d * v
    matmuls = le * layer * s_tokens + head * s_tokens
    scores = le * source_len**2
  else:
    cross_gate = d * d if cfg.residual_gate and not cfg.parallel_block else 0
    matmuls = (le * layer * s_tokens + ld * (layer + 2 * d * d_q + cross_gate) * t_tokens
               + ld * 2 * d * d_kv * s_tokens + d * v * t_tokens)
    scores = le * source_len**2 + ld * target_len**2 + ld * target_len * source_len
  return 3.0 * (2.0 * matmuls + 4.0 * d_q * batch * scores
                + _relative_xl_flops(cfg, batch, source_len, target_len))


def _relative_xl_flops(cfg: ModelConfig, batch: int, source_len: int, target_len: int) -> float:
  """Forward FLOPs of relative_xl's position term: W_r times the embedded distances and the
  queries times the result, in every self-attention (0 for other position options)."""
  if cfg.positional != "relative_xl":
    return 0.0
  d, d_q = cfg.d_model, cfg.num_heads * cfg.head_dim

  def attention(layers, length, bidirectional):
    span = max(length, cfg.random_positions_max)
    rows = 2 * span - 1 if bidirectional else span
    return layers * (2.0 * d * d_q * rows + 2.0 * d_q * batch * length * rows)

  if cfg.arch == "decoder_only":
    return attention(cfg.num_decoder_layers, source_len + target_len, False)
  if cfg.arch == "encoder_only":
    return attention(cfg.num_encoder_layers, source_len, True)
  return (attention(cfg.num_encoder_layers, source_len, True)
          + attention(cfg.num_decoder_layers, target_len, False))
