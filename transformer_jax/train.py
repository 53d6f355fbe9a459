"""Losses, learning-rate schedules, the train step, and the training loop."""

from __future__ import annotations

import functools
import json
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import struct

from transformer_jax import checkpoint, config as config_lib, data, evaluate, parallel
from transformer_jax.data import pipeline, tokenizer as tokenizer_lib
from transformer_jax.errors import UserError
from transformer_jax.logger import MetricLogger
from transformer_jax.model import ModelConfig, Transformer, count_params, describe, init_params

# ----------------------------------------------------------------------------- pure math


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


def label_smoothed_cross_entropy(logits, targets, smoothing: float):
  """Per-position loss against q = (1 - smoothing) * one_hot(target) + smoothing / vocab.

  Args:
    logits: float `[batch, length, vocab]`.
    targets: int `[batch, length]`.
    smoothing: epsilon in [0, 1).

  Returns:
    (loss, nll), each float32 `[batch, length]`; nll is the unsmoothed -log p(target).
  """
  log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  nll = -jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
  uniform = -jnp.mean(log_probs, axis=-1)
  return (1.0 - smoothing) * nll + smoothing * uniform, nll


def shift_right(targets, bos_id: int = tokenizer_lib.BOS_ID):
  """Decoder inputs: BOS followed by the targets without their last position. `[batch, length]`."""
  bos = jnp.full((targets.shape[0], 1), bos_id, targets.dtype)
  shifted = jnp.concatenate([bos, targets[:, :-1]], axis=1)
  return jnp.where(targets > 0, shifted, 0)


# ----------------------------------------------------------------------------- state and step


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


def _loss_and_metrics(params, model, batch, rng, smoothing, normalizer):
  """Sum of the smoothed loss over this shard's tokens, divided by the global token count."""
  targets = batch["targets"]
  logits = model.apply({"params": params}, batch["inputs"], shift_right(targets),
                       rngs={"dropout": rng})
  loss, nll = label_smoothed_cross_entropy(logits, targets, smoothing)
  weights = (targets > 0).astype(jnp.float32)
  correct = (jnp.argmax(logits, -1) == targets) * weights
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
  metrics = {"loss": sums["loss"] / tokens, "nll": sums["nll"] / tokens,
             "accuracy": sums["correct"] / tokens, "grad_norm": optax.global_norm(grads),
             "tokens": tokens}
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


# ----------------------------------------------------------------------------- the loop


def prepare_data(config, workdir: str, model_config: ModelConfig):
  """Loads the splits, the tokenizer (trained once into the workdir) and encodes both splits."""
  train_pairs = data.load_split(config.data, config.data.train_split)
  if not len(train_pairs):
    raise UserError(f"the {config.data.train_split!r} split is empty; check the data config")
  texts = (text for pair in train_pairs for text in pair)
  tokenizer = tokenizer_lib.load_or_train(config.data.tokenizer, workdir, texts,
                                          model_config.vocab_size)
  d = config.data
  train_set = pipeline.encode(train_pairs, tokenizer, d.max_source_len, d.max_target_len)
  if not len(train_set):
    raise UserError("every training example is longer than data.max_source_len / "
                    "data.max_target_len; raise them")
  eval_pairs = data.load_split(config.data, config.data.eval_split)
  return tokenizer, train_set, eval_pairs


def _save_config(config, workdir):
  path = os.path.join(workdir, "config.json")
  with open(path + ".tmp", "w") as f:
    f.write(config.to_json_best_effort(indent=2))
  os.replace(path + ".tmp", path)


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """Trains `config` in `workdir` (resuming from its latest checkpoint), then evaluates.

  Returns the final evaluation metrics.
  """
  model_config = config_lib.validate(config, jax.default_backend())
  t = config.train
  workdir = checkpoint.prepare_workdir(workdir)
  tokenizer, train_set, eval_pairs = prepare_data(config, workdir, model_config)
  _save_config(config, workdir)

  mesh = parallel.make_mesh()
  optimizer = make_optimizer(config.train, model_config.d_model)
  p_train_step = make_train_step(model_config, config, mesh, optimizer)
  manager = checkpoint.Manager(workdir, config)
  state = create_state(model_config, optimizer, config.seed)
  state = manager.restore_or(state)
  start = int(state.step)
  state = parallel.replicate(state, mesh)
  stream = pipeline.TrainStream(train_set, config.data, config.seed,
                                row_multiple=mesh.devices.size * t.grad_accum_steps)
  rng = jax.random.PRNGKey(config.seed)

  counts = count_params(state.params)
  print(describe(model_config), flush=True)
  print(f"data: {len(train_set):,} train examples ({train_set.dropped} too long, dropped), "
        f"{len(eval_pairs):,} eval examples, vocabulary {tokenizer.vocab_size}, "
        f"{mesh.devices.size} device(s) ({jax.default_backend()})", flush=True)
  if start:
    print(f"resuming from step {start}", flush=True)
  logger = MetricLogger(workdir, total_steps=config.train.steps, start_step=start)
  logger.text("config", config.to_json_best_effort(indent=2))
  logger.text("model", f"{describe(model_config)}\n{counts}")

  eval_metrics = {}
  for step in range(start, t.steps):
    batch = parallel.shard_batch(stream[step], mesh)
    state, metrics = p_train_step(state, batch, rng)
    done = step + 1
    if done % t.log_every == 0 or done == t.steps:
      metrics = jax.device_get(metrics)
      if not np.isfinite(metrics["loss"]):
        raise UserError(f"the loss became {metrics['loss']} at step {done}; lower "
                        "train.learning_rate or enable train.grad_clip_norm")
      lr = float(make_schedule(t, model_config.d_model)(done - 1))
      logger.train(done, metrics, lr)
    if t.eval_every and done % t.eval_every == 0 and done != t.steps:
      eval_metrics = evaluate.evaluate(state.params, model_config, config, tokenizer, eval_pairs)
      logger.eval(done, eval_metrics)
    if done % t.checkpoint_every == 0 or done == t.steps:
      manager.save(done, state)
  manager.wait()

  eval_metrics = evaluate.evaluate(state.params, model_config, config, tokenizer, eval_pairs)
  logger.eval(int(state.step), eval_metrics)
  results_path = evaluate.write_results(workdir, int(state.step), eval_metrics)
  logger.close()
  print(f"\nworkdir {workdir} holds:\n"
        f"  checkpoints/       steps {manager.all_steps()} (orbax; a rerun resumes from the latest)\n"
        f"  tokenizer.model    the SentencePiece vocabulary ({tokenizer.vocab_size} pieces)\n"
        f"  config.json        the full experiment config\n"
        f"  metrics.jsonl      training and evaluation metrics, one JSON object per line\n"
        f"  tensorboard/       event files: tensorboard --logdir {os.path.join(workdir, 'tensorboard')}\n"
        f"  eval/              final metrics: {os.path.relpath(results_path, workdir)}", flush=True)
  return eval_metrics
