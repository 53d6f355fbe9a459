"""Model FLOPs of a training step, and the accelerators' peak FLOP/s, HBM size and bandwidth.

Model FLOPs of one training step (no padding: the benchmark batch is full), counting a
multiply-add as 2 FLOPs and the backward pass as twice the forward:

  forward = 2 * (  L_enc * (4 d^2 + 2 d d_ff) * B S            encoder projections and FFN
                 + L_dec * (4 d^2 + 2 d d_ff + 2 d^2) * B T     decoder self-attn, FFN, cross q/out
                 + L_dec * 2 d^2 * B S                          cross-attention keys and values
                 + d V * B T )                                  output projection
          + 4 d * B * (L_enc S^2 + L_dec T^2 + L_dec T S)       QK^T and AV of every attention
  train   = 3 * forward

This is the usual "6 x parameters per token" with each weight matrix charged for the tokens it
actually sees, plus the attention term (the causal mask's zeros are counted, as in most MFU
reports). MFU = achieved FLOP/s / the device's peak dense bf16 FLOP/s.
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
# extends. Figures from the vendors' spec sheets (HBM per chip; A100 40 GB).
CHIPS = (
    ("H200", Chip("H200", 989e12, 141e9, 4.8e12)),
    ("H100", Chip("H100", 989e12, 80e9, 3.35e12)),
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
  """Model FLOPs of one train step on a full `[batch, source_len]` + `[batch, target_len]` batch."""
  d, f, v = cfg.d_model, cfg.d_ff, cfg.vocab_size
  le, ld = cfg.num_encoder_layers, cfg.num_decoder_layers
  s_tokens, t_tokens = batch * source_len, batch * target_len
  matmuls = (le * (4 * d * d + 2 * d * f) * s_tokens
             + ld * (6 * d * d + 2 * d * f) * t_tokens
             + ld * 2 * d * d * s_tokens
             + d * v * t_tokens)
  attention = 2 * d * batch * (le * source_len**2 + ld * target_len**2
                               + ld * target_len * source_len)
  return 3.0 * (2.0 * matmuls + 2.0 * attention)
