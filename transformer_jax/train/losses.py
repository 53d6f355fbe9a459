"""The training loss: label-smoothed cross-entropy with a hand-derived gradient."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def label_smoothed_cross_entropy(logits, targets, smoothing: float):
  """Per-position loss against q = (1 - smoothing) * one_hot(target) + smoothing / vocab.

  Args:
    logits: float `[batch, length, vocab]`.
    targets: int `[batch, length]`.
    smoothing: epsilon in [0, 1).

  Returns:
    (loss, nll, correct): float32 `[batch, length]` each for the loss and the unsmoothed
    -log p(target); bool `[batch, length]` for "the target has the largest logit" (ties count as
    correct, unlike argmax, which takes the first of them).
  """
  return _cross_entropy(logits, targets, float(smoothing))


# The gradient with respect to the logits is softmax(logits) - q, computed in one elementwise pass
# over the `[tokens, vocab]` array. Left to autodiff, log_softmax + take_along_axis gave a scatter
# and a transposed recomputation of the softmax, and the loss head took a third of the CPU step.
@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _cross_entropy(logits, targets, smoothing):
  return _cross_entropy_fwd(logits, targets, smoothing)[0]


def _cross_entropy_fwd(logits, targets, smoothing):
  x = logits.astype(jnp.float32)
  x_max = jnp.max(x, axis=-1)
  log_normalizer = x_max + jnp.log(jnp.sum(jnp.exp(x - x_max[..., None]), axis=-1))
  # A gather, not a one-hot product: the backward pass below never differentiates it.
  target_logit = jnp.take_along_axis(x, targets[..., None], axis=-1)[..., 0]
  nll = log_normalizer - target_logit
  uniform = log_normalizer - jnp.mean(x, axis=-1)  # -mean(log p)
  loss = (1.0 - smoothing) * nll + smoothing * uniform
  return (loss, nll, target_logit >= x_max), (logits, targets, log_normalizer)


def _cross_entropy_bwd(smoothing, residuals, cotangents):
  logits, targets, log_normalizer = residuals
  d_loss, d_nll, _ = cotangents
  x = logits.astype(jnp.float32)
  probs = jnp.exp(x - log_normalizer[..., None])
  # d loss / dx = p - q and d nll / dx = p - one_hot.
  on_target = ((1.0 - smoothing) * d_loss + d_nll)[..., None]
  d_logits = ((d_loss + d_nll)[..., None] * probs
              - jnp.where(_one_hot(targets, x.shape[-1]), on_target, 0.0)
              - (smoothing / x.shape[-1]) * d_loss[..., None])
  return d_logits.astype(logits.dtype), None


def _one_hot(targets, vocab: int):
  return targets[..., None] == jnp.arange(vocab, dtype=targets.dtype)


_cross_entropy.defvjp(_cross_entropy_fwd, _cross_entropy_bwd)
