"""Evaluation over a whole split: loss, perplexity, token accuracy, exact match, BLEU."""

from __future__ import annotations

import functools
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import sacrebleu

from transformer_jax import checkpoint, config as config_lib, data, decode, train
from transformer_jax.data import pipeline, tokenizer as tokenizer_lib
from transformer_jax.errors import UserError
from transformer_jax.model import ModelConfig, Transformer


@functools.lru_cache(maxsize=None)
def _eval_step(model_config: ModelConfig):
  model = Transformer(model_config.replace(deterministic=True, decode=False))

  @jax.jit
  def step(params, batch):
    targets = batch["targets"]
    logits = model.apply({"params": params}, batch["inputs"], train.shift_right(targets))
    _, nll = train.label_smoothed_cross_entropy(logits, targets, 0.0)
    weights = (targets > 0).astype(jnp.float32)
    correct = (jnp.argmax(logits, -1) == targets) * weights
    return {"nll": (nll * weights).sum(), "correct": correct.sum(), "tokens": weights.sum()}

  return step


def decode_batch(params, model_config: ModelConfig, eval_config, inputs, max_length: int):
  """Output token ids `[batch, max_length]` by the configured search."""
  cfg = model_config.replace(deterministic=True)
  if eval_config.decode == "beam":
    tokens, _ = decode.beam_search(params, cfg, inputs, max_length,
                                   beam_size=eval_config.beam_size,
                                   alpha=eval_config.length_penalty)
    return tokens
  return decode.greedy_decode(params, cfg, inputs, max_length)


def evaluate(params, model_config: ModelConfig, config, tokenizer: tokenizer_lib.Tokenizer,
             pairs) -> dict:
  """Metrics of `params` on (source, reference) `pairs`."""
  d, e = config.data, config.eval
  if e.max_examples:
    pairs = pairs[: e.max_examples]
  examples = pipeline.encode(pairs, tokenizer, d.max_source_len, d.max_target_len)
  if not len(examples):
    raise UserError("no evaluation example fits data.max_source_len / data.max_target_len")
  max_length = e.max_decode_len or d.max_target_len
  step = _eval_step(model_config)
  sums = {"nll": 0.0, "correct": 0.0, "tokens": 0.0}
  hypotheses = []
  for batch, n_real in pipeline.eval_batches(examples, e.batch_size):
    for k, v in jax.device_get(step(params, batch)).items():
      sums[k] += float(v)
    outputs = np.asarray(decode_batch(params, model_config, e, batch["inputs"], max_length))
    hypotheses += [tokenizer.decode(row) for row in outputs[:n_real]]
  references = [pairs[i][1] for i in examples.index]
  nll = sums["nll"] / sums["tokens"]
  return {
      "loss": nll,
      "perplexity": math.exp(min(nll, 50.0)),
      "token_accuracy": sums["correct"] / sums["tokens"],
      "exact_match": float(np.mean([h.split() == r.split() for h, r in
                                    zip(hypotheses, references)])),
      "bleu": sacrebleu.corpus_bleu(hypotheses, [references]).score,
      "examples": len(examples),
      "skipped_too_long": examples.dropped,
  }


def write_results(workdir: str, step: int, metrics: dict) -> str:
  """Writes WORKDIR/eval/STEP.json; returns its path."""
  directory = os.path.join(workdir, "eval")
  os.makedirs(directory, exist_ok=True)
  path = os.path.join(directory, f"{step}.json")
  with open(path + ".tmp", "w") as f:
    json.dump({"step": step, **metrics}, f, indent=2)
  os.replace(path + ".tmp", path)
  return path


def load_trained(config, workdir: str, step=None):
  """(model_config, params, tokenizer, step) from a trained workdir."""
  model_config = config_lib.validate(config, jax.default_backend())
  workdir = os.path.abspath(workdir)
  tokenizer_path = os.path.join(workdir, tokenizer_lib.FILENAME)
  if not os.path.isfile(tokenizer_path):
    raise UserError(f"{workdir} holds no trained model (no {tokenizer_lib.FILENAME}); "
                    "train first with --mode=train")
  manager = checkpoint.Manager(workdir, config)
  if manager.latest_step() is None:
    raise UserError(f"{workdir} holds no checkpoint; train first with --mode=train")
  optimizer = train.make_optimizer(config.train, model_config.d_model)
  abstract = jax.eval_shape(lambda: train.create_state(model_config, optimizer, config.seed))
  state = manager.restore(abstract, step)
  manager.close()
  return model_config, state.params, tokenizer_lib.load(tokenizer_path), int(state.step)


def evaluate_from_workdir(config, workdir: str, step=None) -> dict:
  """Evaluates a checkpoint of `workdir` on data.eval_split; prints the metrics as one JSON line."""
  model_config, params, tokenizer, step = load_trained(config, workdir, step)
  metrics = evaluate(params, model_config, config, tokenizer,
                     data.load_split(config.data, config.data.eval_split))
  write_results(os.path.abspath(workdir), step, metrics)
  print(json.dumps({"step": step, **metrics}), flush=True)
  return metrics
