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

from transformer_jax import (benchmark, checkpoint, config as config_lib, data, evaluate, parallel,
                             summary)
from transformer_jax.data import pipeline, tokenizer as tokenizer_lib
from transformer_jax.errors import UserError
from transformer_jax.logger import MetricLogger, read_metrics
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


def shift_right(targets, bos_id: int = tokenizer_lib.BOS_ID, segments=None):
  """Decoder inputs: BOS followed by the targets without their last position. `[batch, length]`.

  With `segments` (int `[batch, length]`, packed rows), every example starts with its own BOS.
  """
  bos = jnp.full((targets.shape[0], 1), bos_id, targets.dtype)
  shifted = jnp.concatenate([bos, targets[:, :-1]], axis=1)
  if segments is not None:
    previous = jnp.concatenate([jnp.zeros_like(segments[:, :1]), segments[:, :-1]], axis=1)
    shifted = jnp.where(segments != previous, bos_id, shifted)
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


# ----------------------------------------------------------------------------- the loop

DISPATCH_AHEAD = 2  # train steps the host may queue before waiting for the devices


def prepare_tokenizer(config, workdir: str, train_pairs, vocab_size: int):
  """(tokenizer, new): the run's tokenizer, and whether WORKDIR/tokenizer.model is still to write.

  The workdir's tokenizer wins (a resumed run keeps its ids); else data.tokenizer.model_path;
  else one trained on a sample of the train split. Nothing is written here.
  """
  t = config.data.tokenizer
  path = os.path.join(workdir, tokenizer_lib.FILENAME)
  new = not os.path.exists(path)
  if not new:
    tokenizer = tokenizer_lib.load(path)
    if t.model_path and tokenizer_lib.load(t.model_path).model_proto != tokenizer.model_proto:
      raise UserError(f"data.tokenizer.model_path {t.model_path} is not {path}, the vocabulary "
                      "this workdir was trained with; drop the override or start a new --workdir")
  elif t.model_path:
    tokenizer = tokenizer_lib.load(t.model_path)
  else:
    texts = tokenizer_lib.training_texts(train_pairs, t.sample_size, config.seed)
    tokenizer = tokenizer_lib.train(texts, vocab_size, t.model_type, t.character_coverage,
                                    t.sample_size)
  if tokenizer.vocab_size > vocab_size:
    raise UserError(f"the tokenizer has {tokenizer.vocab_size} pieces but model.vocab_size is "
                    f"{vocab_size}; raise model.vocab_size")
  return tokenizer, new


def prepare_data(config, workdir: str, model_config: ModelConfig):
  """Loads the splits and the tokenizer, and encodes the train split. Writes nothing.

  Returns (tokenizer, new_tokenizer, train_set, eval_pairs).
  """
  train_pairs = data.load_split(config.data, config.data.train_split)
  if not len(train_pairs):
    raise UserError(f"the {config.data.train_split!r} split is empty; check the data config")
  tokenizer, new = prepare_tokenizer(config, workdir, train_pairs, model_config.vocab_size)
  d = config.data
  train_set = pipeline.encode(train_pairs, tokenizer, d.max_source_len, d.max_target_len)
  if not len(train_set):
    raise UserError("every training example is longer than data.max_source_len / "
                    "data.max_target_len; raise them")
  eval_pairs = data.load_split(config.data, config.data.eval_split)
  return tokenizer, new, train_set, eval_pairs


def _write(path: str, content: bytes) -> None:
  with open(path + ".tmp", "wb") as f:
    f.write(content)
  os.replace(path + ".tmp", path)


def _check_finite(unchecked, policy: str, manager: checkpoint.Manager) -> None:
  """Reports the steps of `unchecked` [(step, metrics)] whose loss or gradients were NaN/inf.

  The step itself did not apply those updates. policy "skip": one line per skipped step.
  "stop": a UserError naming the first such step, raised once the saves in flight are written,
  so the checkpoints on disk are the good ones from before it.
  """
  flags = jax.device_get([(m["finite"], m["loss"], m["grad_norm"]) for _, m in unchecked])
  for (step, _), (finite, loss, grad_norm) in zip(unchecked, flags):
    if finite:
      continue
    values = f"loss {float(loss)}, gradient norm {float(grad_norm)}"
    if policy == "skip":
      print(f"step {step}: skipped the update ({values}); train.on_nonfinite=skip", flush=True)
      continue
    manager.wait()
    raise UserError(f"non-finite loss or gradients at step {step} ({values}); stopped without "
                    f"saving it (checkpoints: {manager.all_steps() or 'none'}); lower "
                    "train.learning_rate, set train.grad_clip_norm, or set "
                    "train.on_nonfinite=skip")


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """Trains `config` in `workdir` (resuming from its newest readable checkpoint), then evaluates.

  Everything the user's input can fail (config, data, tokenizer, batching, a checkpoint's
  compatibility) is checked before the workdir is touched. SIGTERM/SIGINT end the run after the
  current step with a checkpoint. Returns the final evaluation metrics ({} if stopped early).
  """
  model_config = config_lib.validate(config, jax.default_backend())
  t = config.train
  workdir = checkpoint.check_workdir(workdir)
  tokenizer, new_tokenizer, train_set, eval_pairs = prepare_data(config, workdir, model_config)
  mesh = parallel.make_mesh(config.mesh.to_dict())
  optimizer = make_optimizer(config.train, model_config.d_model)
  p_train_step = make_train_step(model_config, config, mesh, optimizer)
  stream = pipeline.TrainStream(train_set, config.data, config.seed,
                                row_multiple=mesh.devices.size * t.grad_accum_steps)
  new_state = lambda: create_state(model_config, optimizer, config.seed)
  tokenizer_sha = checkpoint.sha256(tokenizer.model_proto)
  reader = checkpoint.Manager(workdir, config, tokenizer_sha)
  restored = reader.latest_good(jax.eval_shape(new_state))
  reader.close()

  # Every check passed: from here on the workdir changes. With several processes, the first
  # writes the files; checkpoints are written by all of them together (orbax).
  is_main = jax.process_index() == 0
  checkpoint.create_workdir(workdir)
  if is_main and new_tokenizer:
    _write(os.path.join(workdir, tokenizer_lib.FILENAME), tokenizer.model_proto)
  if is_main:
    _write(os.path.join(workdir, "config.json"), config.to_json_best_effort(indent=2).encode())
  set_aside = reader.set_aside_unreadable()
  manager = checkpoint.Manager(workdir, config, tokenizer_sha, writable=True)
  if restored:
    state, start = restored.state, restored.step
  else:
    # One compiled initialiser, not hundreds of op-by-op dispatches; made replicated on the mesh.
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    state, start = jax.jit(new_state, out_shardings=replicated)(), 0
  rng = jax.random.PRNGKey(config.seed)

  counts = count_params(state.params)
  say = print if is_main else (lambda *args, **kwargs: None)
  say(describe(model_config), flush=True)
  say(f"data: {len(train_set):,} train examples ({train_set.dropped} too long, dropped), "
      f"{len(eval_pairs):,} eval examples, vocabulary {tokenizer.vocab_size}, "
      f"{mesh.devices.size} device(s) ({jax.default_backend()}) in {jax.process_count()} "
      f"process(es)", flush=True)
  if restored and is_main:
    changed = f" with changed config: {', '.join(restored.changed)}" if restored.changed else ""
    moved = (f" (unreadable steps {set_aside} moved to {checkpoint.UNREADABLE}/)" if set_aside
             else "")
    print(f"resuming from step {start}{changed}{moved}", flush=True)
  peak = benchmark.peak_flops(jax.devices()[0])
  logger = MetricLogger(workdir, total_steps=config.train.steps, start_step=start,
                        enabled=is_main, peak_flops=peak * mesh.devices.size if peak else None)
  logger.text("config", config.to_json_best_effort(indent=2))
  logger.text("model", f"{describe(model_config)}\n{counts}")
  schedule = make_schedule(t, model_config.d_model)

  unchecked = []  # (step, metrics) on the device, read together at the next log/eval/save step
  started, tokens_seen = time.time(), 0
  tokens_since_log = flops_since_log = 0.0  # host arithmetic on the host batch: no device sync
  input_seconds = 0.0  # host time making and transferring batches since the last log line
  with checkpoint.Preemption() as preemption:
    for step in range(start, t.steps):
      input_start = time.perf_counter()
      host_batch = stream[step]
      batch = parallel.shard_batch(host_batch, mesh)
      input_seconds += time.perf_counter() - input_start
      state, metrics = p_train_step(state, batch, rng)
      tokens = int((host_batch["inputs"] > 0).sum() + (host_batch["targets"] > 0).sum())
      tokens_seen += tokens
      tokens_since_log += tokens
      flops_since_log += benchmark.train_flops_per_step(model_config, *host_batch["inputs"].shape,
                                                        host_batch["targets"].shape[1])
      done = step + 1
      unchecked.append((done, metrics))
      if len(unchecked) > DISPATCH_AHEAD:
        # Let the host run at most DISPATCH_AHEAD steps ahead of the devices (enough to hide
        # dispatch and input time): a preemption signal is then honoured within a step or two,
        # not after every step queued since the last sync has run.
        unchecked[-1 - DISPATCH_AHEAD][1]["finite"].block_until_ready()
      stop = preemption.reached(done)
      last = done == t.steps
      log = done % t.log_every == 0 or last
      run_eval = bool(t.eval_every and done % t.eval_every == 0) and not (stop or last)
      save = stop or last or done % t.checkpoint_every == 0 or (run_eval and t.keep_best > 0)
      if log or run_eval or save:
        _check_finite(unchecked, t.on_nonfinite, manager)
        unchecked = []
      if log:
        metrics = {k: v for k, v in jax.device_get(metrics).items() if k != "finite"}
        logger.train(done, metrics, float(schedule(done - 1)), tokens_since_log, flops_since_log,
                     input_seconds)
        tokens_since_log = flops_since_log = input_seconds = 0.0
      if run_eval:
        eval_metrics = evaluate.evaluate(parallel.to_local(state.params), model_config, config,
                                         tokenizer, eval_pairs)
        logger.eval(done, eval_metrics)
      if save:
        manager.save(done, state, eval_metrics if run_eval else None)  # metrics rank keep_best
      if stop:
        manager.wait()
        manager.close()
        logger.close()
        say(f"{preemption.signal}: stopped after step {done} and saved its checkpoint; run the "
            "same command to resume", flush=True)
        return {}
  manager.wait()

  wall_time = time.time() - started
  eval_metrics = evaluate.evaluate(parallel.to_local(state.params), model_config, config,
                                   tokenizer, eval_pairs)
  logger.eval(int(state.step), eval_metrics)
  logger.close()
  checkpoint_steps = manager.all_steps()
  manager.close()
  if not is_main:
    return eval_metrics
  results_path = evaluate.write_results(workdir, int(state.step), eval_metrics)
  report = summary.render(config, eval_metrics, read_metrics(workdir), wall_time,
                          tokens_seen, int(state.step) - start, int(state.step),
                          checkpoint_steps)
  summary.write(workdir, report)
  print("\n" + report, flush=True)
  print(f"workdir {workdir} holds:\n"
        f"  checkpoints/       steps {checkpoint_steps} (orbax; a rerun resumes from the latest)\n"
        f"  tokenizer.model    the SentencePiece vocabulary ({tokenizer.vocab_size} pieces)\n"
        f"  config.json        the full experiment config\n"
        f"  metrics.jsonl      training and evaluation metrics, one JSON object per line\n"
        f"  tensorboard/       event files: tensorboard --logdir {os.path.join(workdir, 'tensorboard')}\n"
        f"  eval/              final metrics: {os.path.relpath(results_path, workdir)}\n"
        f"  summary.md         this summary", flush=True)
  return eval_metrics
