"""Metrics of a model over a split: loss, perplexity and token accuracy by teacher forcing;
BLEU, chrF and exact match of the decoded, detokenized text; accuracy and macro-F1 of a
classifier."""

from __future__ import annotations

import functools
import json
import math
import os

import jax.numpy as jnp

from transformer_jax.core import files
from transformer_jax.core.errors import UserError
from transformer_jax.data import pipeline, sources, tasks
from transformer_jax.data import tokenizer as tokenizer_lib
from transformer_jax.eval.load import load_trained
from transformer_jax.eval.metrics import classification_metrics, text_metrics
from transformer_jax.eval.search import (
  batch_rng,
  decode_batch,
  decode_settings,
  detokenize,
  max_decode_length,
)
from transformer_jax.model import ModelConfig, make_model
from transformer_jax.train import sharding
from transformer_jax.train import step as step_lib
from transformer_jax.train.losses import label_smoothed_cross_entropy


@functools.lru_cache(maxsize=None)
def _eval_step(model_config: ModelConfig, task: str, mask_rate: float, mesh):
  """Sums of the loss, correct labels and labels of a batch, by teacher forcing, on `mesh`; the
  predicted class of each row for classification. The masked-LM's corruption is drawn from
  `rng`, so an evaluation masks the same tokens every time."""
  model = make_model(model_config.replace(deterministic=True, decode=False))

  def step(params, batch, rng):
    batch = step_lib.prepare_batch(batch, rng, task, mask_rate, model_config.vocab_size)
    logits, labels, weights = step_lib.forward(model, params, batch)
    _, nll, correct = label_smoothed_cross_entropy(logits, labels, 0.0)
    sums = {"nll": (nll * weights).sum(), "correct": (correct * weights).sum(),
            "tokens": weights.sum()}
    if task == "classify":
      sums["predicted"] = jnp.argmax(logits[:, 0], axis=-1)
    return sums

  return sharding.jit(step, mesh, out_shardings=sharding.replicated(mesh))


SAMPLES = 5  # translations shown in TensorBoard and kept in eval/STEP.json


def evaluate(params, model_config: ModelConfig, config, tokenizer: tokenizer_lib.Tokenizer,
             pairs, mesh=None) -> dict:
  """Metrics of `params` on the (source, reference) `pairs` of a split, and the decode settings.

  Every task: loss and perplexity (per target token, or per masked token, or per example) and
  accuracy by teacher forcing; seq2seq also decodes (BLEU, chrF, exact match); classify reports
  accuracy and macro-F1 over the classes. `params` live on `mesh` (default: the mesh of
  config.mesh), sharded as in training or not; batches are split over its data x fsdp devices.
  With several processes every process calls this with the same pairs and gets the same metrics.
  """
  mesh = sharding.make_mesh(config.mesh.to_dict()) if mesh is None else mesh
  d, e = config.data, config.eval
  if e.max_examples:
    pairs = pairs[: e.max_examples]
  examples = tasks.examples(d, pairs, tokenizer)
  if not len(examples):
    raise UserError("no evaluation example fits data.max_source_len / data.max_target_len")
  max_length = max_decode_length(config)
  step = _eval_step(model_config, d.task, d.mask_rate, mesh)
  sums = {"nll": 0.0, "correct": 0.0, "tokens": 0.0}
  hypotheses, predicted = [], []
  for index, (batch, n_real) in enumerate(pipeline.eval_batches(examples, e.batch_size)):
    out = sharding.to_host(step(params, sharding.shard_batch(batch, mesh),
                                batch_rng(config, index)))
    predicted += out.pop("predicted", [])[:n_real].tolist() if d.task == "classify" else []
    for k, v in out.items():
      sums[k] += float(v)
    if d.task == "seq2seq":
      outputs = decode_batch(params, model_config, e, batch["inputs"], max_length,
                             batch_rng(config, index), mesh=mesh)
      hypotheses += [detokenize(tokenizer, row) for row in outputs[:n_real]]
  nll = sums["nll"] / sums["tokens"]
  metrics = {"loss": nll, "perplexity": math.exp(min(nll, 50.0)),
             "token_accuracy": sums["correct"] / sums["tokens"]}
  counts = {"examples": len(examples), "skipped_too_long": examples.dropped}
  if d.task == "classify":
    names = tasks.label_names(d)
    gold = [name for _, name in sources.gather(pairs, examples.index)]
    guesses = [names[i] for i in predicted]
    return {"loss": nll, **classification_metrics(guesses, gold, names), **counts,
            "samples": [{"source": source, "hypothesis": guess, "reference": label}
                        for (source, label), guess in zip(
                            sources.gather(pairs, examples.index[:SAMPLES]), guesses)]}
  if d.task != "seq2seq":
    return {**metrics, **counts}
  kept = sources.gather(pairs, examples.index)
  references = [target for _, target in kept]
  text = text_metrics(hypotheses, references)
  signature = text.pop("bleu_signature")
  return {
      **metrics,
      **text,
      **counts,
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
