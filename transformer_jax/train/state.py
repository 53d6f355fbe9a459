"""Learning-rate schedules, the optimizer, and the train state it updates."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct

from transformer_jax.model import ModelConfig, init_params


def rsqrt_schedule(step, d_model: int, warmup_steps: int, scale: float = 1.0):
  """The paper's rate: scale * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5), step from 1."""
  step = jnp.maximum(jnp.asarray(step, jnp.float32), 1.0)
  return scale * d_model**-0.5 * jnp.minimum(step**-0.5, step * warmup_steps**-1.5)


def make_schedule(train_config, d_model: int) -> optax.Schedule:
  """The learning rate as a function of the optimizer's update count (0-based)."""
  t = train_config
  if t.schedule == "rsqrt":
    return lambda count: rsqrt_schedule(count + 1, d_model, t.warmup_steps, t.learning_rate)
  if t.schedule == "cosine":
    return optax.warmup_cosine_decay_schedule(0.0, t.learning_rate, max(t.warmup_steps, 1),
                                              max(t.steps, t.warmup_steps + 1))
  if t.warmup_steps:
    return optax.linear_schedule(0.0, t.learning_rate, t.warmup_steps)  # then constant
  return optax.constant_schedule(t.learning_rate)


@struct.dataclass
class TrainState:
  step: jax.Array
  params: Any
  opt_state: Any


def make_optimizer(train_config, d_model: int) -> optax.GradientTransformation:
  t = train_config
  parts = []
  if t.grad_clip_norm > 0:
    parts.append(optax.clip_by_global_norm(t.grad_clip_norm))
  parts.append(optax.adamw(make_schedule(t, d_model), b1=t.adam_b1, b2=t.adam_b2, eps=t.adam_eps,
                           weight_decay=t.weight_decay))
  return optax.chain(*parts)


def create_state(model_config: ModelConfig, optimizer, seed: int) -> TrainState:
  params = init_params(model_config, jax.random.PRNGKey(seed))
  return TrainState(step=jnp.array(0, jnp.int32), params=params, opt_state=optimizer.init(params))
