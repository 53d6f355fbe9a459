"""The train step: (state, batch, rng) -> (state, metrics), and its jit over a device mesh."""

from __future__ import annotations

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from transformer_jax.core.errors import UserError
from transformer_jax.core.tokens import EOS_ID, MASK_ID
from transformer_jax.model import ModelConfig, make_model, output_layer_params, shift_right
from transformer_jax.model.attention import DropoutRate
from transformer_jax.model.axes import constrain
from transformer_jax.train import sharding
from transformer_jax.train import state as state_lib
from transformer_jax.train.losses import (
  chunked_loss_sums,
  label_smoothed_cross_entropy,
  smoothing_coefficients,
)
from transformer_jax.train.state import TrainState

# Folded into the step's key for the masked-LM corruption: apart from the dropout keys, which
# fold in the microbatch index.
_MASKING_STREAM = 2**31 - 1


def mask_tokens(inputs, rng, rate: float, vocab_size: int):
  """BERT's corruption for the masked-LM task (data.task=mlm), on the device.

  Each real token is chosen with probability `rate`; a chosen token becomes <mask> (80%), a
  random token (10%) or stays (10%), and only chosen tokens are predicted. Random tokens are
  drawn above MASK_ID, never a special piece. The draws are a function of (rng, shape) only, so
  they are the same on every mesh.

  Args:
    inputs: int `[batch, length]` (0 = padding).

  Returns:
    (corrupted inputs, targets: the original token where chosen, else 0), int `[batch, length]`.
  """
  choose, kind, replacement = jax.random.split(rng, 3)
  chosen = (inputs > 0) & (jax.random.uniform(choose, inputs.shape) < rate)
  u = jax.random.uniform(kind, inputs.shape)
  random_tokens = jax.random.randint(replacement, inputs.shape, MASK_ID + 1, vocab_size,
                                     inputs.dtype)
  corrupted = jnp.where(chosen & (u < 0.8), MASK_ID,
                        jnp.where(chosen & (u < 0.9), random_tokens, inputs))
  return corrupted, jnp.where(chosen, inputs, 0)


def prepare_batch(batch, rng, task: str, mask_rate: float, vocab_size: int):
  """The batch as the loss reads it: for data.task=mlm, the inputs corrupted by `mask_tokens`
  and the targets they predict; any other task's batch as it comes."""
  if task != "mlm":
    return batch
  inputs, targets = mask_tokens(batch["inputs"], jax.random.fold_in(rng, _MASKING_STREAM),
                                mask_rate, vocab_size)
  return {**batch, "inputs": inputs, "targets": targets}


def pair_token_types(inputs):
  """BERT's token types of rows "[CLS] A [SEP] B [SEP]" (data.text_pair; [SEP] is our EOS): 1
  after the first EOS, 0 before it and at it, and 0 at padding. A single text's one EOS ends
  the row, so its tokens are all of type 0."""
  eos = (inputs == EOS_ID).astype(jnp.int32)
  return ((jnp.cumsum(eos, axis=1) - eos > 0) & (inputs > 0)).astype(jnp.int32)


def target_lengths(targets):
  """The length of each row's target, EOS not counted (what model.length_head predicts), float32
  `[batch]`; 0 for a row of padding."""
  return jnp.maximum(jnp.sum(targets > 0, axis=-1) - 1, 0).astype(jnp.float32)


def forward(model, params, batch, rngs=None, lengths: bool = False, output_layer: bool = True):
  """The model's logits for a batch, the labels they predict and the weight of each label.

  encoder-decoder and decoder-only: logits `[batch, tgt_len, vocab]` of the targets (teacher
  forcing); encoder-only: logits at every input position (masked LM) or `[batch, 1, labels]`
  (classification, whose targets hold label + 1). Weights are 1 at real labels, 0 at padding.
  With `lengths` (model.length_head), a fourth value: the predicted target lengths `[batch]`.
  With `output_layer=False` (not for a classifier), the hidden states `[batch, length,
  d_model]` that the model's `output_logits` turns into those logits, in their place.
  """
  targets = batch["targets"]
  if model.config.arch == "encoder_only":
    segments = batch.get("inputs_segmentation")
    logits = model.apply({"params": params}, batch["inputs"], batch.get("inputs_position"),
                         segments, rngs=rngs,
                         token_types=(pair_token_types(batch["inputs"]) if segments is None
                                      and model.config.type_vocab_size else None),
                         output_layer=output_layer)
  else:
    segments = batch.get("targets_segmentation")  # packed rows (data.batching=packed) only
    logits = model.apply({"params": params}, batch["inputs"],
                         shift_right(targets, segments=segments),
                         source_positions=batch.get("inputs_position"),
                         target_positions=batch.get("targets_position"),
                         source_segments=batch.get("inputs_segmentation"),
                         target_segments=segments, output_layer=output_layer, rngs=rngs,
                         mutable=["intermediates"] if lengths else False)
  labels = jnp.maximum(targets - 1, 0) if model.config.num_labels else targets
  if lengths:  # the model sowed them (Transformer.__call__)
    logits, sown = logits
    return logits, labels, (targets > 0).astype(jnp.float32), sown["intermediates"]["length"][0]
  return logits, labels, (targets > 0).astype(jnp.float32)


def _loss_and_metrics(params, model, batch, rng, smoothing, normalizer, length_weight=0.0,
                      chunk_tokens: int = 0):
  """Sum of the smoothed loss over a microbatch's tokens, divided by the batch's token count.

  smoothing: the label smoothing, as `label_smoothed_cross_entropy` takes it. With
  model.length_head, plus `length_weight` (train.length_loss_weight) times the squared error of
  each example's predicted target length, summed over the examples and divided by the same
  token count. chunk_tokens (train.loss_chunk_tokens) > 0: the output layer and the loss run in
  chunks of that many tokens (`chunked_loss_sums`), the same sums up to float rounding."""
  outputs = forward(model, params, batch, {"dropout": rng}, lengths=model.config.length_head,
                    output_layer=not chunk_tokens)
  if model.config.length_head:
    outputs, predicted = outputs[:3], outputs[3]
    real = batch["targets"][:, 0] > 0
    squared = jnp.where(real, (predicted - target_lengths(batch["targets"])) ** 2, 0.0)
  logits, labels, weights = outputs  # with chunk_tokens: the hidden states the logits come from
  if (isinstance(smoothing, dict) and not chunk_tokens
      and logits.shape[-1] != loss_width(model.config)):
    raise AssertionError(f"logits of {logits.shape[-1]} rows, smoothing for "
                         f"{loss_width(model.config)}")
  # bfloat16 compute runs on accelerators, where the step is HBM-bound and the loss's passes
  # over the [tokens, vocab] logits are its largest kernels; float32 keeps the CPU's faster form.
  options = {"bfloat16_logits": model.config.compute_dtype == jnp.bfloat16,
             "excluded_rows": excluded_loss_rows(model.config)}
  with jax.named_scope("loss"):  # tools/profile.py's kernel categories read these names
    if chunk_tokens:
      total, nll, correct = chunked_loss_sums(
          lambda p, h: model.apply({"params": p}, h, method="output_logits"),
          output_layer_params(model.config, params), logits, labels, weights, smoothing,
          chunk_tokens, **options)
      sums = {"loss": total, "nll": nll, "correct": correct}
    else:
      loss, nll, correct = label_smoothed_cross_entropy(logits, labels, smoothing, **options)
      sums = {"loss": (loss * weights).sum(), "nll": (nll * weights).sum(),
              "correct": (correct * weights).sum()}
  if model.config.length_head:
    sums["length_squared_error"] = squared.sum()
    sums["loss"] = sums["loss"] + length_weight * sums["length_squared_error"]
  return sums["loss"] / normalizer, sums


def loss_width(model_config: ModelConfig) -> int:
  """The rows of the logits the loss reads: the classes of a classifier, else the vocabulary."""
  return model_config.num_labels or model_config.vocab_size


def excluded_loss_rows(model_config: ModelConfig) -> tuple:
  return () if model_config.num_labels else tuple(model_config.excluded_rows)


def train_step(state: TrainState, batch, rng, hparams=None, *, model, optimizer, smoothing,
               accum_steps: int, task: str = "seq2seq", mask_rate: float = 0.15,
               length_weight=0.0, loss_chunk_tokens: int = 0):
  """One update from the global batch: (state, batch, rng) -> (state, metrics).

  hparams: `state_lib.hyperparameters` and the loss's smoothing (`make_train_step`), inputs of
  the compiled step; `optimizer(hparams)` then builds the optimizer, and the smoothing and
  length-loss weight come from them. None: `optimizer` is the optimizer, and `smoothing` and
  `length_weight` the values.

  Written for the whole batch; `make_train_step` runs it on a mesh. The loss is the mean over
  all non-padding target tokens of the batch, so rows of padding added to fill a mesh change
  nothing. With `accum_steps` > 1 the rows are dealt out to microbatches in turn (row r to
  microbatch r % accum_steps), so every device holds part of every microbatch.
  loss_chunk_tokens (train.loss_chunk_tokens): > 0 computes the output layer and the loss in
  chunks of that many tokens (`_loss_and_metrics`).
  """
  if hparams is not None:
    smoothing = hparams["smoothing"] if smoothing else 0.0
    length_weight = hparams["length_loss_weight"]
    optimizer = optimizer(hparams["optimizer"])
    if hparams["dropout"]:  # the rates' thresholds are inputs too
      model = make_model(model.config.replace(**{
          name: DropoutRate(getattr(model.config, name), keep)
          for name, keep in hparams["dropout"].items()}))
  rng = jax.random.fold_in(rng, state.step)
  raw = batch  # the padding share is that of the batch as it came
  batch = prepare_batch(batch, rng, task, mask_rate, model.config.vocab_size)
  tokens = (batch["targets"] > 0).sum().astype(jnp.float32)
  grad_fn = jax.grad(_loss_and_metrics, has_aux=True)

  def deal(x):  # [rows, ...] -> [accum_steps, rows / accum_steps, ...]
    x = x.reshape((x.shape[0] // accum_steps, accum_steps) + x.shape[1:]).swapaxes(0, 1)
    return constrain(x, None, "batch", *(None,) * (x.ndim - 2))

  def accumulate(carry, inputs):
    grads, sums = carry
    microbatch, i = inputs
    g, s = grad_fn(state.params, model, microbatch, jax.random.fold_in(rng, i), smoothing,
                   tokens, length_weight, loss_chunk_tokens)
    return (jax.tree.map(jnp.add, grads, g), jax.tree.map(jnp.add, sums, s)), None

  zeros = (jax.tree.map(jnp.zeros_like, state.params),
           {"loss": 0.0, "nll": 0.0, "correct": 0.0}
           | ({"length_squared_error": 0.0} if model.config.length_head else {}))
  (grads, sums), _ = jax.lax.scan(accumulate, zeros,
                                  (jax.tree.map(deal, batch), jnp.arange(accum_steps)))

  with jax.named_scope("optimizer"):
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
  # A NaN/inf loss or gradient leaves parameters and optimizer state as they were (the step still
  # advances to the next batch); `finite` tells the loop, which stops or skips on the host.
  grad_norm = optax.tree.norm(grads)
  finite = jnp.isfinite(sums["loss"]) & jnp.isfinite(grad_norm)
  params, opt_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old),
                                   (params, opt_state), (state.params, state.opt_state))
  # Share of padding in the rows that hold examples, both sides: what bucketing and packing try
  # to keep low (the empty rows that fill a mesh are not counted).
  used = (raw["inputs"] > 0).any(axis=1) | (raw["targets"] > 0).any(axis=1)
  real = sum((raw[k] > 0).sum() for k in ("inputs", "targets")).astype(jnp.float32)
  slots = used.sum() * (raw["inputs"].shape[1] + raw["targets"].shape[1])
  metrics = {"loss": sums["loss"] / tokens, "nll": sums["nll"] / tokens,
             "accuracy": sums["correct"] / tokens, "grad_norm": grad_norm,
             "tokens": tokens, "padding": 1.0 - real / jnp.maximum(slots, 1), "finite": finite}
  if model.config.length_head:  # the mean squared error of the predicted lengths, in tokens^2
    examples = (raw["targets"][:, 0] > 0).sum().astype(jnp.float32)
    metrics["length_mse"] = sums["length_squared_error"] / jnp.maximum(examples, 1.0)
  return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics


class TrainStep:
  """The compiled train step with this run's hyperparameters: `step(state, batch, rng)` and
  `step.lower(state, batch, rng)` call the shared jitted function with them as its fourth
  argument (placed on the devices at the first call; lowered as abstract values, which is also
  how an abstract mesh of `--mode=compile` takes them)."""

  def __init__(self, jitted, hparams: dict, mesh):
    self.jitted, self.hparams, self.mesh = jitted, hparams, mesh
    self._placed = None

  def placed(self):
    """The hyperparameters on the mesh: the fourth argument of `lower(...).compile()`'s
    program."""
    if self._placed is None:
      self._placed = jax.device_put(self.hparams, sharding.replicated(self.mesh))
    return self._placed

  def __call__(self, state, batch, rng):
    return self.jitted(state, batch, rng, self.placed())

  def lower(self, state, batch, rng):
    replicated = sharding.replicated(self.mesh)
    hparams = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype,
                                                          sharding=replicated), self.hparams)
    return self.jitted.lower(state, batch, rng, hparams)


def step_hyperparameters(model_config: ModelConfig, config) -> dict:
  """The inputs of the compiled step that are settings: the optimizer's (`state_lib.
  hyperparameters`), the label smoothing's coefficients, the length-loss weight and the keep
  thresholds of each dropout rate above 0 (`DropoutRate.thresholds`)."""
  t = config.train
  return {"optimizer": state_lib.hyperparameters(t, model_config.d_model),
          "smoothing": smoothing_coefficients(t.label_smoothing, loss_width(model_config),
                                              excluded_loss_rows(model_config)),
          "length_loss_weight": np.float32(t.get("length_loss_weight", 0.0)),
          "dropout": {name: DropoutRate.thresholds(getattr(model_config, name))
                      for name in DROPOUT_RATES if getattr(model_config, name) > 0}}


DROPOUT_RATES = ("dropout_rate", "attention_dropout_rate")
_DROPPING = 0.5  # a rate > 0 as the program's structure sees it (the step's input is the rate)


def program_config(model_config: ModelConfig) -> ModelConfig:
  """The model config as the compiled step's structure sees it: each dropout rate > 0 the same
  (the thresholds are inputs, `step_hyperparameters`)."""
  return model_config.replace(**{name: _DROPPING for name in DROPOUT_RATES
                                 if getattr(model_config, name) > 0})


# The jitted steps of the latest program structures (a sweep's shapes), latest last: each holds
# its compiled programs in memory, so a worker that meets many shapes keeps the recent ones.
_JITTED: collections.OrderedDict = collections.OrderedDict()
KEPT_PROGRAMS = 8


def _jitted_step(model_config: ModelConfig, kind: state_lib.OptimizerKind, smoothing: bool,
                 accum: int, task: str, mask_rate: float, mesh, optimizer,
                 loss_chunk_tokens: int = 0):
  """The jitted step for one program structure, kept for the process's later runs (a sweep
  worker's next trial): the same function object, so JAX neither traces nor compiles it again
  when only hyperparameters change. `optimizer`: one of `kind`, for its state's shardings."""
  key = (model_config, kind, smoothing, accum, task, mask_rate, mesh, loss_chunk_tokens)
  if key not in _JITTED:
    step = functools.partial(train_step, model=make_model(model_config),
                             optimizer=functools.partial(state_lib.optimizer, kind),
                             smoothing=smoothing, accum_steps=accum, task=task,
                             mask_rate=mask_rate, loss_chunk_tokens=loss_chunk_tokens)
    state_shardings = state_lib.state_shardings(model_config, optimizer, mesh)
    replicated = sharding.replicated(mesh)
    _JITTED[key] = sharding.jit(
        step, mesh, donate_argnums=(0,),
        in_shardings=(state_shardings, sharding.batch_sharding(mesh), replicated, replicated),
        out_shardings=(state_shardings, replicated))
    while len(_JITTED) > KEPT_PROGRAMS:
      _JITTED.popitem(last=False)
  _JITTED.move_to_end(key)
  return _JITTED[key]


def make_train_step(model_config: ModelConfig, config, mesh) -> TrainStep:
  """The train step as one jit over `mesh`: state sharded by its logical axes (donated), batch
  rows over data x fsdp, metrics replicated. Call it with batches from `sharding.shard_batch`
  (rows padded to a multiple of train.grad_accum_steps x the batch shards).

  Settings that change no shape or program structure (`step_hyperparameters`) are inputs of
  the compiled program: runs of this process that differ only in them reuse it, and other
  processes find it in the compilation cache."""
  accum = config.train.grad_accum_steps
  if config.data.batching == "fixed" and config.data.batch_size % accum:
    raise UserError(f"data.batch_size ({config.data.batch_size}) must be divisible by "
                    f"train.grad_accum_steps ({accum})")
  t = config.train
  jitted = _jitted_step(program_config(model_config), state_lib.OptimizerKind.of(t),
                        t.label_smoothing > 0,
                        accum, config.data.task, float(config.data.mask_rate), mesh,
                        state_lib.make_optimizer(t, model_config.d_model),
                        int(t.get("loss_chunk_tokens", 0)))
  return TrainStep(jitted, step_hyperparameters(model_config, config), mesh)
