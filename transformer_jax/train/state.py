"""Learning-rate schedules, the optimizer, and the train state it updates (and where it lives)."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import struct

from transformer_jax.model import ModelConfig, init_boxed_params
from transformer_jax.train import sharding


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


def _create_boxed_state(model_config: ModelConfig, optimizer, seed: int) -> TrainState:
  """The initial state with every parameter and its optimizer state (Adam's moments are trees
  of the parameters' shape) boxed with the parameter's logical axis names."""
  params = init_boxed_params(model_config, jax.random.PRNGKey(seed))
  return TrainState(step=jnp.array(0, jnp.int32), params=params, opt_state=optimizer.init(params))


def create_state(model_config: ModelConfig, optimizer, seed: int) -> TrainState:
  """The initial train state (plain arrays); the same values on every mesh."""
  return nn.unbox(_create_boxed_state(model_config, optimizer, seed))


def state_shardings(model_config: ModelConfig, optimizer, mesh) -> TrainState:
  """Where each array of the train state lives on `mesh` (a TrainState of NamedShardings):
  parameters and their optimizer state by their logical axes (`sharding.RULES`), scalars
  replicated."""
  boxed = jax.eval_shape(lambda: _create_boxed_state(model_config, optimizer, 0))
  return sharding.logical_shardings(boxed, mesh)


def abstract_state(model_config: ModelConfig, optimizer, mesh) -> TrainState:
  """ShapeDtypeStructs of the train state with their shardings on `mesh`: the target that a
  checkpoint is restored into (from whatever mesh it was saved on)."""
  shapes = jax.eval_shape(lambda: create_state(model_config, optimizer, 0))
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes,
                      state_shardings(model_config, optimizer, mesh))


def init_state(model_config: ModelConfig, optimizer, seed: int, mesh) -> TrainState:
  """The initial state, created in place on `mesh`: each device computes only its shards (one
  compiled initialiser, not hundreds of op-by-op dispatches)."""
  shardings = state_shardings(model_config, optimizer, mesh)
  return jax.jit(lambda: create_state(model_config, optimizer, seed), out_shardings=shardings)()
