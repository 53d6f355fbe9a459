"""Metrics of a model over a split: loss, perplexity and token accuracy by teacher forcing;
BLEU, chrF and exact match of the decoded, detokenized text, with the diagnostics of
eval/diagnostics.py (by reference length, first error, oracle-length decoding); accuracy and
macro-F1 of a classifier."""

from __future__ import annotations

import functools
import json
import math
import os

import jax.numpy as jnp
import numpy as np

from transformer_jax.core import progress, storage
from transformer_jax.core.errors import UserError
from transformer_jax.data import pipeline, sources, tasks
from transformer_jax.data import tokenizer as tokenizer_lib
from transformer_jax.eval import diagnostics
from transformer_jax.eval.load import load_trained
from transformer_jax.eval.metrics import classification_metrics, text_metrics
from transformer_jax.eval.search import (
  batch_rng,
  decode_batch,
  decode_settings,
  detokenize,
  head_lengths,
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


SAMPLES = 5  # translations shown in TensorBoard and kept in each result file of eval/


def evaluate(params, model_config: ModelConfig, config, tokenizer: tokenizer_lib.Tokenizer,
             pairs, mesh=None) -> dict:
  """Metrics of `params` on the (source, reference) `pairs` of a split, and the decode settings.

  Every task: loss and perplexity (per target token, or per masked token, or per example) and
  accuracy by teacher forcing; seq2seq also decodes (BLEU, chrF, exact match) and reports the
  diagnostics of eval/diagnostics.py: exact match and decoded token accuracy by reference
  length (`by_length`), where the first wrong token falls (`first_error`, `errors`), and, with
  eval.oracle_length (off by default; scan_length.py turns it on), the same for a second,
  oracle-length greedy decode (EOS masked out, stopped at the reference's length:
  `oracle_exact_match`), which costs one more decode of the split; exact match by group where
  the data source has groups (`by_group` and `exact_match_GROUP`: SCAN's length splits, by
  whether training showed every repetition count of the command); with model.length_head, the
  share of examples whose length the head predicts exactly (rounded: `length_head_accuracy`),
  its mean absolute error in tokens (`length_head_error`) and its mean signed error
  (`length_head_bias`, < 0: too short), each also by group (`length_head_accuracy_GROUP`, ...);
  classify reports accuracy and macro-F1 over the classes. `params` live on `mesh` (default:
  the mesh of config.mesh), sharded as in training or not; batches are split over its data x
  fsdp devices.
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
  hypotheses, oracle, predicted = [], [], []
  oracle_length = d.task == "seq2seq" and e.oracle_length
  length_head = d.task == "seq2seq" and model_config.length_head
  head_signed = []  # the length head's rounded predictions minus the references' lengths
  # Counted in sentences, not batches: a split is a handful of batches, and beam search spends
  # most of the time, inside one compiled loop per batch.
  shown = progress.bar(total=len(examples), unit="sentence",
                       desc=f"evaluating ({decode_name(config)})"
                            + (" and oracle length" if oracle_length else ""))
  for index, (batch, n_real) in enumerate(pipeline.eval_batches(examples, e.batch_size)):
    out = sharding.to_host(step(params, sharding.shard_batch(batch, mesh),
                                batch_rng(config, index)))
    predicted += out.pop("predicted", [])[:n_real].tolist() if d.task == "classify" else []
    for k, v in out.items():
      sums[k] += float(v)
    if d.task == "seq2seq":
      guessed = (head_lengths(params, model_config, batch["inputs"], max_length, mesh)
                 if length_head else None)
      outputs = decode_batch(params, model_config, e, batch["inputs"], max_length,
                             batch_rng(config, index), mesh=mesh, predicted=guessed)
      hypotheses += [detokenize(tokenizer, row) for row in outputs[:n_real]]
      # the reference's tokens, EOS not counted (padding rows: 0)
      lengths = np.maximum(np.sum(batch["targets"] != 0, axis=-1) - 1, 0)
      if length_head:
        head_signed += (guessed[:n_real].astype(np.int64) - lengths[:n_real]).tolist()
      if oracle_length:
        outputs = decode_batch(params, model_config, e, batch["inputs"], max_length,
                               mesh=mesh, lengths=lengths)
        oracle += [detokenize(tokenizer, row) for row in outputs[:n_real]]
    shown.update(n_real)
  shown.close()
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
  outputs = {"standard": hypotheses}
  if oracle_length:
    outputs["oracle"] = oracle
    text["oracle_exact_match"] = text_metrics(oracle, references)["exact_match"]
  groups = sources.groups(d, kept)
  if length_head:
    signed = np.asarray(head_signed)
    text.update(head_metrics(signed))
    if groups:
      names = np.asarray(groups)
      for group in dict.fromkeys(groups):
        text.update(head_metrics(signed[names == group], group))
  return {
      **metrics,
      **text,
      **counts,
      "bleu_signature": signature,
      "decoding": {**decode_settings(e), "oracle_length": bool(oracle_length)},
      **diagnostics.diagnose(references, outputs),
      **(diagnostics.by_group(references, outputs, groups) if groups else {}),
      "samples": [{"source": source, "hypothesis": hypothesis, "reference": reference,
                   **({"oracle_length_hypothesis": oracle[i]} if oracle_length else {})}
                  for i, ((source, reference), hypothesis) in enumerate(
                      zip(kept[:SAMPLES], hypotheses))],
  }


def head_metrics(signed: np.ndarray, group: str = "") -> dict:
  """model.length_head's figures from its rounded predictions minus the references' lengths:
  the share exact, the mean absolute and the mean signed error in tokens (named _GROUP)."""
  suffix = f"_{group}" if group else ""
  return {f"length_head_accuracy{suffix}": float(np.mean(signed == 0)),
          f"length_head_error{suffix}": float(np.mean(np.abs(signed))),
          f"length_head_bias{suffix}": float(np.mean(signed))}


def decode_name(config) -> str:
  """The search of `config.eval` in a file name: greedy, beam4-lp0.6, sample-t0.8-top40, with
  -lenK when eval.max_decode_len sets the output length (beam4-lplength1.0 with transformers'
  length penalty; -eos with eval.force_eos, -suppressN with N eval.suppress_tokens;
  greedy-lengthhead[-slackK] with eval.length_head, whatever eval.decode says)."""
  e = config.eval
  if e.get("length_head", False):
    slack = e.get("length_head_slack", 0)
    name = "greedy-lengthhead" + (f"-slack{slack}" if slack else "")
  elif e.decode == "beam":
    form = "" if e.get("length_penalty_form", "gnmt") == "gnmt" else e.length_penalty_form
    name = f"beam{e.beam_size}-lp{form}{e.length_penalty:g}"
  elif e.decode == "sample":
    name = f"sample-t{e.temperature:g}" + (f"-top{e.top_k}" if e.top_k else "")
  else:
    name = "greedy"
  name += "-eos" if e.get("force_eos", False) else ""
  name += f"-suppress{len(e.suppress_tokens)}" if e.get("suppress_tokens", ()) else ""
  return name + (f"-len{e.max_decode_len}" if e.max_decode_len else "")


def result_name(step: int, split: str, config, averaged: int = 0) -> str:
  """`STEP.SPLIT.DECODE[.avgN][.limitK].json`: one file per checkpoint, split, search, averaging
  (N checkpoints) and example limit (eval.max_examples), so that no result replaces another's."""
  parts = [str(step), split.replace("/", "_").replace(os.sep, "_"), decode_name(config)]
  if averaged:
    parts.append(f"avg{averaged}")
  if config.eval.max_examples:
    parts.append(f"limit{config.eval.max_examples}")
  return ".".join(parts) + ".json"


def result_path(workdir: str, step: int, split: str, config, averaged: int = 0) -> str:
  return os.path.join(workdir, RESULTS, result_name(step, split, config, averaged))


RESULTS = "eval"  # WORKDIR/eval holds one JSON file per evaluation


def record(step: int, split: str, config, metrics: dict, checkpoints=()) -> dict:
  """The JSON object of one evaluation: what produced it, then its metrics."""
  return {"step": step, "split": split, "checkpoints": list(checkpoints) or [step],
          "max_examples": config.eval.max_examples,
          "max_decode_len": max_decode_length(config), **metrics}


def write_results(workdir: str, result: dict, config, what: str = "") -> str:
  """Writes `result` (see `record`) to its file in WORKDIR/eval; returns the path.

  `what`: see files.write_error.
  """
  averaged = len(result["checkpoints"]) if len(result["checkpoints"]) > 1 else 0
  path = result_path(workdir, result["step"], result["split"], config, averaged)
  storage.makedirs(storage.dirname(path), what)
  return storage.write(path, json.dumps(result, indent=2), what)


def read_results(workdir: str) -> list[dict]:
  """Every evaluation result of WORKDIR/eval (files that do not parse are skipped), by step."""
  directory = storage.join(workdir, RESULTS)
  results = []
  for name in storage.listdir(directory):
    if not name.endswith(".json") or not name.split(".")[0].isdigit():
      continue
    try:
      result = json.loads(storage.read_text(storage.join(directory, name)))
    except (OSError, ValueError):
      continue
    if isinstance(result, dict) and isinstance(result.get("step"), int):
      results.append({**result, "file": name})
  return sorted(results, key=lambda r: r["step"])


def evaluate_from_workdir(config, workdir: str, step=None, split=None) -> dict:
  """Evaluates a checkpoint of `workdir` on `split` (default data.eval_split); prints the result
  as one JSON line.

  The result then goes to its file in WORKDIR/eval (see `result_name`): printed first, so that a
  workdir that cannot be written (read-only, full) loses nothing but the file.
  """
  split = split or config.data.eval_split
  pairs = sources.load_split(config.data, split)  # a bad split is refused before the model loads
  trained = load_trained(config, workdir, step)
  metrics = evaluate(trained.params, trained.model_config, config, trained.tokenizer, pairs,
                     trained.mesh)
  result = record(trained.step, split, config, metrics, trained.averaged_steps)
  print(json.dumps(result), flush=True)
  write_results(storage.check(workdir), result, config,
                what="the metrics are the JSON line printed above")
  return metrics
