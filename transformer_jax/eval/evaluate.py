"""Metrics of a model over a split: loss, perplexity and token accuracy by teacher forcing;
BLEU, chrF and exact match of the decoded, detokenized text."""

from __future__ import annotations

import functools
import json
import math
import os

import jax.numpy as jnp

from transformer_jax.core import files
from transformer_jax.core.errors import UserError
from transformer_jax.data import pipeline, sources
from transformer_jax.data import tokenizer as tokenizer_lib
from transformer_jax.eval.load import load_trained
from transformer_jax.eval.metrics import text_metrics
from transformer_jax.eval.search import (
  batch_rng,
  decode_batch,
  decode_settings,
  detokenize,
  max_decode_length,
)
from transformer_jax.model import ModelConfig, Transformer, shift_right
from transformer_jax.train import sharding
from transformer_jax.train.losses import label_smoothed_cross_entropy


@functools.lru_cache(maxsize=None)
def _eval_step(model_config: ModelConfig, mesh):
  """Sums of the loss, correct tokens and tokens of a batch, by teacher forcing, on `mesh`."""
  model = Transformer(model_config.replace(deterministic=True, decode=False))

  def step(params, batch):
    targets = batch["targets"]
    logits = model.apply({"params": params}, batch["inputs"], shift_right(targets))
    _, nll, correct = label_smoothed_cross_entropy(logits, targets, 0.0)
    weights = (targets > 0).astype(jnp.float32)
    correct = correct * weights
    return {"nll": (nll * weights).sum(), "correct": correct.sum(), "tokens": weights.sum()}

  return sharding.jit(step, mesh, out_shardings=sharding.replicated(mesh))


SAMPLES = 5  # translations shown in TensorBoard and kept in eval/STEP.json


def evaluate(params, model_config: ModelConfig, config, tokenizer: tokenizer_lib.Tokenizer,
             pairs, mesh=None) -> dict:
  """Metrics of `params` on (source, reference) `pairs`, and the decode settings used.

  `params` live on `mesh` (default: the mesh of config.mesh), sharded as in training or not;
  batches are split over its data x fsdp devices. With several processes every process calls
  this with the same pairs and gets the same metrics.
  """
  mesh = sharding.make_mesh(config.mesh.to_dict()) if mesh is None else mesh
  d, e = config.data, config.eval
  if e.max_examples:
    pairs = pairs[: e.max_examples]
  examples = pipeline.encode(pairs, tokenizer, d.max_source_len, d.max_target_len)
  if not len(examples):
    raise UserError("no evaluation example fits data.max_source_len / data.max_target_len")
  max_length = max_decode_length(config)
  step = _eval_step(model_config, mesh)
  sums = {"nll": 0.0, "correct": 0.0, "tokens": 0.0}
  hypotheses = []
  for index, (batch, n_real) in enumerate(pipeline.eval_batches(examples, e.batch_size)):
    for k, v in sharding.to_host(step(params, sharding.shard_batch(batch, mesh))).items():
      sums[k] += float(v)
    outputs = decode_batch(params, model_config, e, batch["inputs"], max_length,
                           batch_rng(config, index), mesh=mesh)
    hypotheses += [detokenize(tokenizer, row) for row in outputs[:n_real]]
  kept = sources.gather(pairs, examples.index)
  references = [target for _, target in kept]
  nll = sums["nll"] / sums["tokens"]
  text = text_metrics(hypotheses, references)
  signature = text.pop("bleu_signature")
  return {
      "loss": nll,
      "perplexity": math.exp(min(nll, 50.0)),
      "token_accuracy": sums["correct"] / sums["tokens"],
      **text,
      "examples": len(examples),
      "skipped_too_long": examples.dropped,
      "bleu_signature": signature,
      "decoding": decode_settings(e),
      "samples": [{"source": source, "hypothesis": hypothesis, "reference": reference}
                  for (source, reference), hypothesis in zip(kept[:SAMPLES], hypotheses)],
  }


def write_results(workdir: str, step: int, metrics: dict, what: str = "") -> str:
  """Writes WORKDIR/eval/STEP.json; returns its path. `what`: see files.write_error."""
  directory = os.path.join(workdir, "eval")
  try:
    os.makedirs(directory, exist_ok=True)
  except OSError as e:
    raise files.write_error(directory, e, what) from None
  return files.atomic_write(os.path.join(directory, f"{step}.json"),
                            json.dumps({"step": step, **metrics}, indent=2), what)


def evaluate_from_workdir(config, workdir: str, step=None) -> dict:
  """Evaluates a checkpoint of `workdir` on data.eval_split; prints the metrics as one JSON line.

  The metrics then go to WORKDIR/eval/STEP.json: printed first, so that a workdir that cannot
  be written (read-only, full) loses nothing but the file.
  """
  trained = load_trained(config, workdir, step)
  metrics = evaluate(trained.params, trained.model_config, config, trained.tokenizer,
                     sources.load_split(config.data, config.data.eval_split), trained.mesh)
  if trained.averaged_steps:
    metrics["averaged_steps"] = list(trained.averaged_steps)
  print(json.dumps({"step": trained.step, **metrics}), flush=True)
  write_results(os.path.abspath(workdir), trained.step, metrics,
                what="the metrics are the JSON line printed above")
  return metrics
