"""The training loss: label-smoothed cross-entropy with a hand-derived gradient."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np


def smoothing_coefficients(smoothing: float, width: int, excluded_rows: tuple = ()) -> dict:
  """The float32 numbers the loss and its gradient use for `smoothing` over `width` rows (the
  excluded ones aside): 1 - smoothing, smoothing, smoothing / rows kept, each computed in float64
  and rounded once. The train step takes them as inputs (train/state.py: hyperparameters)."""
  return {"confidence": np.float32(1.0 - smoothing), "smoothing": np.float32(smoothing),
          "uniform": np.float32(smoothing / (width - len(excluded_rows)))}


def label_smoothed_cross_entropy(logits, targets, smoothing,
                                 bfloat16_logits: bool = False, excluded_rows: tuple = ()):
  """Per-position loss against q = (1 - smoothing) * one_hot(target) + smoothing / vocab.

  excluded_rows: model.excluded_rows, whose logits the model makes -inf: they take no
  probability, and the smoothing's uniform share spreads over the other rows only.

  Args:
    logits: float `[batch, length, vocab]`.
    targets: int `[batch, length]`.
    smoothing: epsilon in [0, 1), or `smoothing_coefficients`' dict of it (whose values may be
      inputs of a compiled step: the smoothing is then on, whatever their value).
    bfloat16_logits: the logits were computed in bfloat16 (`model.dtype=bfloat16`; the model
      returns them as float32). The loss then reads them as bfloat16, which is exact, so the
      program keeps no float32 copy of the `[tokens, vocab]` array, and in ONE pass
      (`_one_pass_statistics`) instead of four (max, sum of exponentials, mean, target). The
      same loss up to float32 rounding (the normalizer is summed in another order), the same
      bfloat16 gradient; fewer HBM bytes on accelerators, but a slower serial reduction on
      CPUs, whose float32 steps keep the other form. The train step sets it under
      `model.dtype=bfloat16`.

  Returns:
    (loss, nll, correct): float32 `[batch, length]` each for the loss and the unsmoothed
    -log p(target); bool `[batch, length]` for "the target has the largest logit" (ties count as
    correct, unlike argmax, which takes the first of them).
  """
  if bfloat16_logits:
    # Exact for bfloat16 values: XLA folds the model's upcast and this cast away, and the
    # gradient comes back in bfloat16, as the model's own cast would have made it.
    logits = logits.astype(jnp.bfloat16)
  if not isinstance(smoothing, dict):
    smoothing = (smoothing_coefficients(float(smoothing), logits.shape[-1], excluded_rows)
                 if smoothing else None)
  return _cross_entropy(logits, targets, smoothing, bool(bfloat16_logits), tuple(excluded_rows))


# The gradient with respect to the logits is softmax(logits) - q, computed in one elementwise pass
# over the `[tokens, vocab]` array. Left to autodiff, log_softmax + take_along_axis gave a scatter
# and a transposed recomputation of the softmax, and the loss head took a third of the CPU step.
# `smoothing`: smoothing_coefficients' dict, or None for none.
@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _cross_entropy(logits, targets, smoothing, one_pass, excluded):
  return _cross_entropy_fwd(logits, targets, smoothing, one_pass, excluded)[0]


def _kept(vocab: int, excluded: tuple) -> np.ndarray:
  """bool `[vocab]`: the rows that take part in the smoothing (a constant of the program)."""
  kept = np.ones(vocab, bool)
  kept[list(excluded)] = False
  return kept


def _cross_entropy_fwd(logits, targets, smoothing, one_pass, excluded):
  x = logits.astype(jnp.float32)
  # The uniform share of q over the rows kept: their mean logit (-inf rows read as 0 in it).
  summed = jnp.where(_kept(x.shape[-1], excluded), x, 0.0) if excluded else x
  kept = x.shape[-1] - len(excluded)
  if one_pass:
    x_max, log_normalizer, total, target_logit = _one_pass_statistics(x, targets, summed)
    mean = total / kept
  else:
    x_max = jnp.max(x, axis=-1)
    log_normalizer = x_max + jnp.log(jnp.sum(jnp.exp(x - x_max[..., None]), axis=-1))
    # A gather, not a one-hot product: the backward pass below never differentiates it.
    target_logit = jnp.take_along_axis(x, targets[..., None], axis=-1)[..., 0]
  nll = log_normalizer - target_logit
  if not smoothing:
    return (nll, nll, target_logit >= x_max), (logits, targets, log_normalizer, smoothing)
  uniform = log_normalizer - (mean if one_pass else jnp.sum(summed, axis=-1) / kept)
  # uniform: -mean(log p) over kept rows
  loss = smoothing["confidence"] * nll + smoothing["smoothing"] * uniform
  return (loss, nll, target_logit >= x_max), (logits, targets, log_normalizer, smoothing)


def _one_pass_statistics(x, targets, summed):
  """(max, log-sum-exp, sum of `summed` (x, or x with excluded rows at 0), target's logit) over
  the last axis of x in ONE variadic reduction.

  The sum of exponentials is kept relative to the running maximum and rescaled when the maximum
  grows (the "online softmax" of Milakov & Gimelshein, 2018), so the logits are read once where
  the two-pass form reads them for the maximum and again for the exponentials (and XLA adds a
  pass each for the mean and the gather of the target). The target's logit is a masked sum: one
  non-zero term, so exact.
  """
  hit = targets[..., None] == jnp.arange(x.shape[-1], dtype=targets.dtype)

  def combine(a, b):
    (max_a, sum_a, total_a, target_a), (max_b, sum_b, total_b, target_b) = a, b
    high, low = jnp.maximum(max_a, max_b), jnp.minimum(max_a, max_b)
    scaled = jnp.where(max_a >= max_b, sum_b, sum_a)  # the sum kept against the lower maximum
    # exp(low - high) <= 1; equal maxima (two empty -inf partials included) scale by 1.
    factor = jnp.exp(jnp.where(high == low, 0.0, low - high))
    kept = jnp.where(max_a >= max_b, sum_a, sum_b)
    return high, kept + scaled * factor, total_a + total_b, target_a + target_b

  zero = jnp.zeros((), x.dtype)
  x_max, exp_sum, total, target_logit = jax.lax.reduce(
      (x, jnp.ones_like(x), summed, jnp.where(hit, x, zero)),
      (jnp.array(-jnp.inf, x.dtype), zero, zero, zero), combine, (x.ndim - 1,))
  return x_max, x_max + jnp.log(exp_sum), total, target_logit


def _cross_entropy_bwd(one_pass, excluded, residuals, cotangents):
  logits, targets, log_normalizer, smoothing = residuals
  d_loss, d_nll, _ = cotangents
  x = logits.astype(jnp.float32)
  probs = jnp.exp(x - log_normalizer[..., None])
  # d loss / dx = p - q and d nll / dx = p - one_hot.
  on_target = ((smoothing["confidence"] if smoothing else 1.0) * d_loss + d_nll)[..., None]
  d_logits = ((d_loss + d_nll)[..., None] * probs
              - jnp.where(_one_hot(targets, x.shape[-1]), on_target, 0.0))
  if smoothing:
    uniform = smoothing["uniform"] * d_loss[..., None]
    d_logits = d_logits - (jnp.where(_kept(x.shape[-1], excluded), uniform, 0.0) if excluded
                           else uniform)
  # The smoothing's numbers are settings, not parameters: no gradient flows to them.
  return d_logits.astype(logits.dtype), None, (jax.tree.map(jnp.zeros_like, smoothing)
                                               if smoothing else None)


def _one_hot(targets, vocab: int):
  return targets[..., None] == jnp.arange(vocab, dtype=targets.dtype)


_cross_entropy.defvjp(_cross_entropy_fwd, _cross_entropy_bwd)



def chunked_loss_sums(logits_of, params, hidden, targets, weights, smoothing, chunk_tokens: int,
                      bfloat16_logits: bool = False, excluded_rows: tuple = ()):
  """The sums over the tokens of `label_smoothed_cross_entropy(logits_of(params, hidden),
  targets, ...)` times `weights` (loss, nll, correct), computed in chunks of about
  `chunk_tokens` tokens, so that no float32 `[tokens, vocab]` array is ever whole
  (train.loss_chunk_tokens).

  A chunk is every row's next `ceil(chunk_tokens / batch)` positions (the last one padded
  with weight 0). One scan over the chunks computes each chunk's logits, its sums and, at
  once, their gradients with respect to the chunk's hidden states and the output layer's
  parameters (the gradient of the loss against the logits is known in the forward pass:
  p - q, the custom rule of `label_smoothed_cross_entropy`); the backward pass only scales
  them by the loss's cotangent (a fused linear cross-entropy). The output layer's products run
  three times, as in the default (logits, their gradient times the layer, the layer's
  gradient), but per chunk: the logits and their gradient live one chunk at a time, and the
  forward pass keeps the hidden states' gradient `[batch, length, d]` and the layer's
  `[vocab, d]`. The layer's gradient is summed over the chunks (on a mesh, reduced across
  devices per chunk).

  Args:
    logits_of: (params, hidden `[batch, span, d]`) -> float32 logits `[batch, span, vocab]`:
      the model's output layer.
    params: the parameters it reads (only these: each gets a gradient accumulator).
    hidden: `[batch, length, d]`: what the output layer reads.
    targets: int `[batch, length]`.
    weights: float `[batch, length]` (0 at padding).
    smoothing, bfloat16_logits, excluded_rows: as `label_smoothed_cross_entropy`.
    chunk_tokens: > 0.

  Returns:
    float32 scalars (loss sum, nll sum, correct sum), equal to the sums of the default's
    per-token values up to float rounding (summed in another order). Only the loss sum has a
    gradient: the nll and correct sums are metrics (the train step's aux), and the weights,
    targets and smoothing are data.
  """
  if not isinstance(smoothing, dict):
    width = jax.eval_shape(logits_of, params, hidden[:, :1]).shape[-1]
    smoothing = (smoothing_coefficients(float(smoothing), width, tuple(excluded_rows))
                 if smoothing else None)
  return _chunked_sums(logits_of, int(chunk_tokens), bool(bfloat16_logits),
                       tuple(excluded_rows), params, hidden, targets, weights, smoothing)


def _chunks(rows: int, length: int, chunk_tokens: int):
  """(split, join) of `chunked_loss_sums`: `[rows, length, ...]` <-> `[chunks, rows, span,
  ...]`, padded with zeros at the end of the length axis."""
  span = min(length, max(1, -(-chunk_tokens // rows)))  # positions per chunk
  chunks = -(-length // span)
  pad = chunks * span - length

  def split(x):
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    return x.reshape((rows, chunks, span) + x.shape[2:]).swapaxes(0, 1)

  def join(x):
    return x.swapaxes(0, 1).reshape((rows, chunks * span) + x.shape[3:])[:, :length]

  return split, join


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _chunked_sums(logits_of, chunk_tokens, one_pass, excluded, params, hidden, targets, weights,
                  smoothing):
  return _chunked_sums_fwd(logits_of, chunk_tokens, one_pass, excluded, params, hidden, targets,
                           weights, smoothing)[0]


def _chunked_sums_fwd(logits_of, chunk_tokens, one_pass, excluded, params, hidden, targets,
                      weights, smoothing):
  split, join = _chunks(*targets.shape, chunk_tokens)

  def sums(p, h, t, w):
    loss, nll, correct = label_smoothed_cross_entropy(logits_of(p, h), t, smoothing, one_pass,
                                                      excluded)
    return jnp.sum(loss * w), (jnp.sum(nll * w), jnp.sum(correct * w))

  grads = jax.value_and_grad(sums, argnums=(0, 1), has_aux=True)

  def one_chunk(carry, chunk):
    d_params, totals = carry
    (loss, (nll, correct)), (dp, dh) = grads(params, *chunk)
    return (jax.tree.map(jnp.add, d_params, dp),
            tuple(a + b for a, b in zip(totals, (loss, nll, correct)))), dh

  zero = jnp.zeros((), jnp.float32)
  (d_params, totals), d_hidden = jax.lax.scan(
      one_chunk, (jax.tree.map(jnp.zeros_like, params), (zero, zero, zero)),
      (split(hidden), split(targets), split(weights.astype(jnp.float32))))
  return totals, (d_params, join(d_hidden))


def _chunked_sums_bwd(logits_of, chunk_tokens, one_pass, excluded, residuals, cotangents):
  d_params, d_hidden = residuals
  d_loss = cotangents[0]  # the nll and correct sums are metrics: no gradient (see above)
  # None: no gradient to the targets, weights and smoothing (data, not parameters)
  return (jax.tree.map(lambda g: (d_loss * g).astype(g.dtype), d_params),
          (d_loss * d_hidden).astype(d_hidden.dtype), None, None, None)


_chunked_sums.defvjp(_chunked_sums_fwd, _chunked_sums_bwd)
