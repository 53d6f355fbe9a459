"""Learning-rate schedules, the optimizer, and the train state it updates (and where it lives)."""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
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


# ----------------------------------------------------------------------------- hyperparameters
#
# Settings that change no shape and no program structure reach the compiled step as arguments
# (`hyperparameters`), so that runs and sweep trials that differ only in them share one compiled
# program: in a process without tracing again, across processes through the compilation cache
# (core/compilation.py). Values that today's formulas combine in Python (float64, then rounded to
# float32 once as a constant of the program) are combined here on the host the same way, so that
# the step computes with the very float32 numbers it did when they were constants: a run's
# results are bitwise those of a step with them folded in (tests/test_compile_once.py).
#
# What stays structure (a change compiles anew): train.schedule; whether gradients are clipped
# (train.grad_clip_norm > 0) and whether weights decay (train.weight_decay > 0), which add a
# transformation, and with it optimizer state, or a pass over the parameters; the label smoothing
# being 0 or not (the loss skips its uniform term) and the dropout rates being 0 or not.


def hyperparameters(train_config, d_model: int) -> dict:
  """The optimizer's and schedule's settings as the compiled step takes them: float32 / int32
  NumPy scalars (`train_step`'s `hparams`), computed on the host."""
  t = train_config
  f32, i32 = np.float32, np.int32
  warmup = max(t.warmup_steps, 1)
  # constant: the linear warm-up's length (0 = none); cosine: at least 1, then the decay's
  warmup_length = t.warmup_steps if t.schedule == "constant" else warmup
  decay_length = max(t.steps, t.warmup_steps + 1) - warmup
  return {
      "learning_rate": f32(t.learning_rate),
      # rsqrt: scale * d_model^-0.5, and warmup^-1.5 (rsqrt_schedule's two products of Python
      # floats); a warmup of 0 is refused for rsqrt by config validation.
      "rsqrt_peak": f32(t.learning_rate * d_model**-0.5),
      "rsqrt_warmup": f32(float(t.warmup_steps) ** -1.5 if t.warmup_steps else 0.0),
      "warmup_steps": i32(warmup_length),
      "decay_steps": f32(float(decay_length)),
      # XLA turns a division by a constant into a product with its float32 reciprocal: the
      # schedules divide by these lengths, so the inputs are those reciprocals.
      "warmup_reciprocal": _reciprocal(warmup_length),
      "decay_reciprocal": _reciprocal(decay_length),
      "adam_b1": f32(t.adam_b1), "adam_b2": f32(t.adam_b2),
      # 1 - beta as optax computes it from a Python float (float64), rounded once
      "adam_1m_b1": f32(1 - t.adam_b1), "adam_1m_b2": f32(1 - t.adam_b2),
      "adam_eps": f32(t.adam_eps),
      "weight_decay": f32(t.weight_decay),
      "grad_clip_norm": f32(t.grad_clip_norm),
  }


def _reciprocal(length: int) -> np.float32:
  """1 / length as XLA folds it (float32 division of float32 values); 0 for no length."""
  return np.float32(1) / np.float32(length) if length else np.float32(0)


def _linear_warmup(count, h):
  """optax.linear_schedule(0, learning_rate, warmup_steps)(count) with the length an input."""
  count = jnp.clip(count - 0, 0, h["warmup_steps"])
  frac = 1 - count.astype(jnp.float32) * h["warmup_reciprocal"]
  return (-h["learning_rate"]) * (frac**1) + h["learning_rate"]


def _cosine_decay(count, h):
  """optax.cosine_decay_schedule(learning_rate, decay_steps)(count), the values inputs."""
  count = jnp.minimum(count, h["decay_steps"])
  cosine_decay = 0.5 * (1 + jnp.cos(jnp.pi * count * h["decay_reciprocal"]))
  decayed = (1 - 0.0) * cosine_decay**1.0 + 0.0
  return h["learning_rate"] * decayed


def schedule_of(kind: str, h: dict) -> optax.Schedule:
  """The learning rate as a function of the update count (0-based), from `hyperparameters`'
  values (inputs of the step): make_schedule's rates, bitwise."""
  if kind == "rsqrt":
    def rsqrt(count):
      step = jnp.maximum(jnp.asarray(count + 1, jnp.float32), 1.0)
      return h["rsqrt_peak"] * jnp.minimum(step**-0.5, step * h["rsqrt_warmup"])
    return rsqrt
  if kind == "cosine":  # optax.warmup_cosine_decay_schedule: join at the warm-up's end
    return lambda count: jnp.where(count < h["warmup_steps"], _linear_warmup(count, h),
                                   _cosine_decay(count - h["warmup_steps"], h))
  # constant, after a linear warm-up where there is one (no warm-up: the rate itself)
  return lambda count: jnp.where(h["warmup_steps"] > 0, _linear_warmup(count, h),
                                 h["learning_rate"])


def _scale_by_adam(h: dict) -> optax.GradientTransformation:
  """optax.scale_by_adam with its decays as inputs. Written out because optax computes 1 - beta
  from beta: from a float32 input that rounds differently than from the Python float it gets as a
  constant, and every run's results would move in their last bits. The same state
  (optax.ScaleByAdamState) and formulas; `hyperparameters` brings 1 - beta rounded as before."""
  stock = optax.scale_by_adam()

  def update(updates, state, params=None):
    del params
    mu = jax.tree.map(lambda g, t: h["adam_1m_b1"] * (g**1) + h["adam_b1"] * t, updates,
                      state.mu)
    nu = jax.tree.map(lambda g, t: h["adam_1m_b2"] * (g**2) + h["adam_b2"] * t, updates,
                      state.nu)
    count = optax.safe_increment(state.count)
    mu_hat = optax.tree.bias_correction(mu, h["adam_b1"], count)
    nu_hat = optax.tree.bias_correction(nu, h["adam_b2"], count)
    updates = jax.tree.map(lambda m, v: m / (jnp.sqrt(v + 0.0) + h["adam_eps"]), mu_hat, nu_hat)
    return updates, optax.ScaleByAdamState(count=count, mu=mu, nu=nu)

  return optax.GradientTransformation(stock.init, update)


@dataclasses.dataclass(frozen=True)
class OptimizerKind:
  """What of train.* shapes the optimizer's program and state (the rest are its inputs)."""

  schedule: str
  clip: bool  # train.grad_clip_norm > 0
  decay: bool  # train.weight_decay > 0

  @classmethod
  def of(cls, train_config) -> "OptimizerKind":
    t = train_config
    return cls(t.schedule, t.grad_clip_norm > 0, t.weight_decay > 0)


def optimizer(kind: OptimizerKind, h: dict) -> optax.GradientTransformation:
  """AdamW as optax's chain (clip, then Adam, decayed weights and the scheduled rate) with the
  settings `h` of `hyperparameters`: NumPy values (constants of the program) or the train step's
  inputs. The state's structure depends on `kind` alone."""
  parts = [optax.clip_by_global_norm(h["grad_clip_norm"])] if kind.clip else []
  parts.append(optax.chain(
      _scale_by_adam(h),
      # weight_decay=0: optax's add_decayed_weights keeps its (empty) state and adds nothing
      optax.add_decayed_weights(h["weight_decay"] if kind.decay else 0.0),
      optax.scale_by_learning_rate(schedule_of(kind.schedule, h))))
  return optax.chain(*parts)


def make_optimizer(train_config, d_model: int) -> optax.GradientTransformation:
  """The run's optimizer with its settings as constants: what initialises and shapes the state
  (the train step builds the same one from its inputs)."""
  return optimizer(OptimizerKind.of(train_config), hyperparameters(train_config, d_model))


def _create_boxed_state(model_config: ModelConfig, optimizer, seed) -> TrainState:
  """The initial state with every parameter and its optimizer state (Adam's moments are trees
  of the parameters' shape) boxed with the parameter's logical axis names. `seed`: an int, or
  a PRNG key."""
  key = jax.random.PRNGKey(seed) if isinstance(seed, int) else seed
  params = init_boxed_params(model_config, key)
  return TrainState(step=jnp.array(0, jnp.int32), params=params, opt_state=optimizer.init(params))


def create_state(model_config: ModelConfig, optimizer, seed: int) -> TrainState:
  """The initial train state (plain arrays); the same values on every mesh."""
  return nn.unbox(_create_boxed_state(model_config, optimizer, seed))


def state_shardings(model_config: ModelConfig, optimizer, mesh) -> TrainState:
  """Where each array of the train state lives on `mesh` (a TrainState of NamedShardings):
  parameters and their optimizer state by their logical axes (`sharding.RULES`), scalars
  replicated."""
  return _kept(model_config, optimizer, mesh)[1]


def abstract_state(model_config: ModelConfig, optimizer, mesh) -> TrainState:
  """ShapeDtypeStructs of the train state with their shardings on `mesh`: the target that a
  checkpoint is restored into (from whatever mesh it was saved on)."""
  return _kept(model_config, optimizer, mesh)[0]


def init_state(model_config: ModelConfig, optimizer, seed: int, mesh) -> TrainState:
  """The initial state, created in place on `mesh`: each device computes only its shards (one
  compiled initialiser, not hundreds of op-by-op dispatches). The seed is the initialiser's
  input: runs that differ in it share the compiled program."""
  return _kept(model_config, optimizer, mesh)[2](jax.random.PRNGKey(seed))


_KEPT: dict = {}  # the latest few, as train/step.py keeps its steps


def _kept(model_config: ModelConfig, optimizer, mesh) -> tuple:
  """(abstract_state, state_shardings, the jitted initialiser) of one model and optimizer kind
  on one mesh, kept for the process's later asks: a run asks three times, a sweep worker's
  every trial again (each trace of the model's initialiser costs a tenth of a second even for
  the tiny model), and the same initialiser object is traced and compiled once. The settings
  of `optimizer` (one of `optimizer()`'s) do not enter the state's shapes, axes or initial
  values (zeros and counts): keyed by the model, the mesh and the structure of the optimizer's
  state, read off a one-parameter tree."""
  structure = jax.tree.structure(jax.eval_shape(
      optimizer.init, {"x": jax.ShapeDtypeStruct((1,), jnp.float32)}))
  key = (model_config, str(structure), mesh)
  if key not in _KEPT:
    boxed = jax.eval_shape(lambda: _create_boxed_state(model_config, optimizer, 0))
    shardings = sharding.logical_shardings(boxed, mesh)
    abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            nn.unbox(boxed), shardings)
    initialiser = jax.jit(lambda rng: create_state(model_config, optimizer, rng),
                          out_shardings=shardings)
    _KEPT[key] = (abstract, shardings, initialiser)
    while len(_KEPT) > 8:
      del _KEPT[next(iter(_KEPT))]  # the oldest (dicts keep insertion order)
  return _KEPT[key]
