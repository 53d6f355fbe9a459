"""The train step: (state, batch, rng) -> (state, metrics), and its data-parallel wrapper."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from transformer_jax.core.errors import UserError
from transformer_jax.model import ModelConfig, Transformer, shift_right
from transformer_jax.train import parallel
from transformer_jax.train.losses import label_smoothed_cross_entropy
from transformer_jax.train.state import TrainState


def _loss_and_metrics(params, model, batch, rng, smoothing, normalizer):
  """Sum of the smoothed loss over this shard's tokens, divided by the global token count."""
  targets = batch["targets"]
  segments = batch.get("targets_segmentation")  # packed rows (data.batching=packed) only
  logits = model.apply({"params": params}, batch["inputs"],
                       shift_right(targets, segments=segments),
                       source_positions=batch.get("inputs_position"),
                       target_positions=batch.get("targets_position"),
                       source_segments=batch.get("inputs_segmentation"),
                       target_segments=segments, rngs={"dropout": rng})
  loss, nll, correct = label_smoothed_cross_entropy(logits, targets, smoothing)
  weights = (targets > 0).astype(jnp.float32)
  correct = correct * weights
  sums = {"loss": (loss * weights).sum(), "nll": (nll * weights).sum(), "correct": correct.sum()}
  return sums["loss"] / normalizer, sums


def train_step(state: TrainState, batch, rng, *, model: Transformer, optimizer, smoothing: float,
               accum_steps: int, axis_name: str = parallel.DATA_AXIS):
  """One update from this device's shard of the global batch; reduces over `axis_name`.

  The loss is the mean over all non-padding target tokens of the global batch (not a mean of
  per-device means), so any device count gives the same update as one device.
  """
  rng = jax.random.fold_in(jax.random.fold_in(rng, state.step), jax.lax.axis_index(axis_name))
  tokens = jax.lax.psum((batch["targets"] > 0).sum().astype(jnp.float32), axis_name)
  grad_fn = jax.grad(_loss_and_metrics, has_aux=True)

  # Gradient accumulation: the shard is split into microbatches whose gradients are summed.
  micro = jax.tree.map(lambda x: x.reshape((accum_steps, -1) + x.shape[1:]), batch)

  def accumulate(carry, inputs):
    grads, sums = carry
    microbatch, i = inputs
    g, s = grad_fn(state.params, model, microbatch, jax.random.fold_in(rng, i), smoothing,
                   tokens)
    return (jax.tree.map(jnp.add, grads, g), jax.tree.map(jnp.add, sums, s)), None

  zeros = (jax.tree.map(jnp.zeros_like, state.params),
           {"loss": 0.0, "nll": 0.0, "correct": 0.0})
  (grads, sums), _ = jax.lax.scan(accumulate, zeros, (micro, jnp.arange(accum_steps)))
  grads, sums = jax.lax.psum((grads, sums), axis_name)

  updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  # A NaN/inf loss or gradient leaves parameters and optimizer state as they were (the step still
  # advances to the next batch); `finite` tells the loop, which stops or skips on the host.
  grad_norm = optax.tree.norm(grads)
  finite = jnp.isfinite(sums["loss"]) & jnp.isfinite(grad_norm)
  params, opt_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old),
                                   (params, opt_state), (state.params, state.opt_state))
  # Share of padding in the batch, both sides: what bucketing and packing try to keep low.
  real, slots = jax.lax.psum(
      (sum((batch[k] > 0).sum() for k in ("inputs", "targets")).astype(jnp.float32),
       jnp.float32(batch["inputs"].size + batch["targets"].size)), axis_name)
  metrics = {"loss": sums["loss"] / tokens, "nll": sums["nll"] / tokens,
             "accuracy": sums["correct"] / tokens, "grad_norm": grad_norm,
             "tokens": tokens, "padding": 1.0 - real / slots, "finite": finite}
  return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics


def make_train_step(model_config: ModelConfig, config, mesh, optimizer):
  n_devices = mesh.devices.size
  if (config.data.batching == "fixed"
      and config.data.batch_size % (n_devices * config.train.grad_accum_steps)):
    raise UserError(f"data.batch_size ({config.data.batch_size}) must be divisible by the device "
                    f"count ({n_devices}) times train.grad_accum_steps "
                    f"({config.train.grad_accum_steps})")
  step = functools.partial(train_step, model=Transformer(model_config), optimizer=optimizer,
                           smoothing=config.train.label_smoothing,
                           accum_steps=config.train.grad_accum_steps)
  return parallel.data_parallel(step, mesh)
