"""Evaluation and translation with a trained model.

`evaluate`: metrics over a split: loss, perplexity and token accuracy by teacher forcing; BLEU,
chrF and exact match of the decoded, detokenized text. `translate`: text lines in, translations
out, in order. Both decode through `decode_batch` with the same batch shapes, so the same sources
get the same outputs. `load_trained` restores a checkpoint of a workdir, or the mean of its last
`eval.average_last` checkpoints. `decode_throughput` measures decoding speed.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import os
import statistics
import sys
import time
from typing import Any, Iterable, Iterator, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import sacrebleu

from transformer_jax import checkpoint, config as config_lib, data, decode, train
from transformer_jax.data import pipeline, sources as sources_lib, tokenizer as tokenizer_lib
from transformer_jax.errors import UserError
from transformer_jax.model import ModelConfig, Transformer

# ----------------------------------------------------------------------------- metrics


def text_metrics(hypotheses: Sequence[str], references: Sequence[str]) -> dict:
  """Corpus metrics of detokenized hypotheses against one reference each, all in [0, 100] but
  exact match in [0, 1].

  bleu: sacreBLEU on cased, detokenized text (its own 13a tokenization): the number to report;
    `bleu_signature` records how it was computed.
  bleu_lowercase_tokenized: the same on lowercased text, which is close to multi-bleu.perl -lc on
    Moses-tokenized text, for comparison with papers that report that.
  chrf: sacreBLEU chrF (character 6-grams, beta 2).
  exact_match: the fraction of hypotheses equal to their reference up to whitespace.
  """
  hypotheses, references = list(hypotheses), [list(references)]
  bleu = sacrebleu.BLEU()
  score = bleu.corpus_score(hypotheses, references)
  return {
      "bleu": score.score,
      "bleu_lowercase_tokenized":
          sacrebleu.BLEU(lowercase=True).corpus_score(hypotheses, references).score,
      "chrf": sacrebleu.CHRF().corpus_score(hypotheses, references).score,
      "exact_match": float(np.mean([h.split() == r.split()
                                    for h, r in zip(hypotheses, references[0])])),
      "bleu_signature": str(bleu.get_signature()),
  }


@functools.lru_cache(maxsize=None)
def _eval_step(model_config: ModelConfig):
  model = Transformer(model_config.replace(deterministic=True, decode=False))

  @jax.jit
  def step(params, batch):
    targets = batch["targets"]
    logits = model.apply({"params": params}, batch["inputs"], train.shift_right(targets))
    _, nll, correct = train.label_smoothed_cross_entropy(logits, targets, 0.0)
    weights = (targets > 0).astype(jnp.float32)
    correct = correct * weights
    return {"nll": (nll * weights).sum(), "correct": correct.sum(), "tokens": weights.sum()}

  return step


# ----------------------------------------------------------------------------- decoding


def decode_settings(eval_config) -> dict:
  """The settings that determine the decoded outputs, as recorded with the metrics."""
  e = eval_config
  settings = {"decode": e.decode}
  if e.decode == "beam":
    settings.update(beam_size=e.beam_size, length_penalty=e.length_penalty)
  elif e.decode == "sample":
    settings.update(temperature=e.temperature, top_k=e.top_k)
  return settings


def max_decode_length(config) -> int:
  """Output positions (EOS included) that decoding allows: eval.max_decode_len or the targets'."""
  return config.eval.max_decode_len or config.data.max_target_len


def decode_batch(params, model_config: ModelConfig, eval_config, inputs, max_length: int,
                 rng=None):
  """Output token ids `[batch, max_length]` of source ids `inputs` by the configured search.

  Rows of `inputs` that are all padding come back as zeros at no cost. `rng` (a PRNG key) is
  used by decode=sample only.
  """
  cfg = model_config.replace(deterministic=True)
  e = eval_config
  if e.decode == "beam":
    tokens, _ = decode.beam_search(params, cfg, inputs, max_length, beam_size=e.beam_size,
                                   alpha=e.length_penalty)
    return tokens
  if e.decode == "sample":
    rng = jax.random.key(0) if rng is None else rng
    return decode.sample(params, cfg, inputs, max_length, rng, temperature=e.temperature,
                         top_k=e.top_k)
  return decode.greedy_decode(params, cfg, inputs, max_length)


def detokenize(tokenizer: tokenizer_lib.Tokenizer, ids) -> str:
  """The text of decoded ids; ids the tokenizer lacks (model.vocab_size may exceed its size, and
  an undertrained model can emit them) read as unknown."""
  ids = np.asarray(ids)
  return tokenizer.decode(np.where(ids < tokenizer.vocab_size, ids, tokenizer_lib.UNK_ID))


def _batch_rng(config, index: int):
  """The sampling key of the `index`-th decoded batch: evaluate and translate agree on it."""
  return jax.random.fold_in(jax.random.key(config.seed), index)


# ----------------------------------------------------------------------------- evaluate


SAMPLES = 5  # translations shown in TensorBoard and kept in eval/STEP.json


def evaluate(params, model_config: ModelConfig, config, tokenizer: tokenizer_lib.Tokenizer,
             pairs) -> dict:
  """Metrics of `params` on (source, reference) `pairs`, and the decode settings used."""
  d, e = config.data, config.eval
  if e.max_examples:
    pairs = pairs[: e.max_examples]
  examples = pipeline.encode(pairs, tokenizer, d.max_source_len, d.max_target_len)
  if not len(examples):
    raise UserError("no evaluation example fits data.max_source_len / data.max_target_len")
  max_length = max_decode_length(config)
  step = _eval_step(model_config)
  sums = {"nll": 0.0, "correct": 0.0, "tokens": 0.0}
  hypotheses = []
  for index, (batch, n_real) in enumerate(pipeline.eval_batches(examples, e.batch_size)):
    for k, v in jax.device_get(step(params, batch)).items():
      sums[k] += float(v)
    outputs = np.asarray(decode_batch(params, model_config, e, batch["inputs"], max_length,
                                      _batch_rng(config, index)))
    hypotheses += [detokenize(tokenizer, row) for row in outputs[:n_real]]
  kept = sources_lib.gather(pairs, examples.index)
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


def write_results(workdir: str, step: int, metrics: dict) -> str:
  """Writes WORKDIR/eval/STEP.json; returns its path."""
  directory = os.path.join(workdir, "eval")
  os.makedirs(directory, exist_ok=True)
  path = os.path.join(directory, f"{step}.json")
  with open(path + ".tmp", "w") as f:
    json.dump({"step": step, **metrics}, f, indent=2)
  os.replace(path + ".tmp", path)
  return path


# ----------------------------------------------------------------------------- checkpoints


class Trained(NamedTuple):
  model_config: ModelConfig
  params: Any
  tokenizer: tokenizer_lib.Tokenizer
  step: int  # the checkpoint restored; with averaging, the latest one averaged
  averaged_steps: tuple  # the checkpoints whose parameters were averaged; () = no averaging


def steps_to_average(available: Sequence[int], step, n: int) -> list:
  """The last `n` of the `available` checkpoint steps up to and including `step` (None: the
  latest); a UserError if there are fewer or `step` is not available."""
  step = max(available, default=None) if step is None else step
  if step not in available:
    raise UserError(f"no checkpoint at step {step}; available: {sorted(available) or 'none'}")
  chosen = sorted(s for s in available if s <= step)[-n:]
  if len(chosen) < n:
    raise UserError(f"eval.average_last={n} needs {n} checkpoints up to step {step}, but there "
                    f"are only {chosen or 'none'}; lower eval.average_last")
  return chosen


def average_params(manager: checkpoint.Manager, state, steps: Sequence[int]):
  """The element-wise mean of the parameters checkpointed at `steps` (restored one at a time)."""
  total = None
  for step in steps:
    params = manager.restore(state, step).params
    total = params if total is None else jax.tree.map(jnp.add, total, params)
  return jax.tree.map(lambda x: (x / len(steps)).astype(x.dtype), total)


def load_trained(config, workdir: str, step=None) -> Trained:
  """The model of a trained workdir at checkpoint `step` (default: the latest).

  With eval.average_last = N > 0 the parameters are the mean of the last N checkpoints up to
  `step` (checkpoint averaging, as in the paper's base and big results).
  """
  model_config = config_lib.validate(config, jax.default_backend())
  workdir = os.path.abspath(workdir)
  tokenizer_path = os.path.join(workdir, tokenizer_lib.FILENAME)
  if not os.path.isfile(tokenizer_path):
    raise UserError(f"{workdir} holds no trained model (no {tokenizer_lib.FILENAME}); "
                    "train first with --mode=train")
  manager = checkpoint.Manager(workdir, config)
  try:
    if not manager.all_steps():
      raise UserError(f"{workdir} holds no checkpoint; train first with --mode=train")
    optimizer = train.make_optimizer(config.train, model_config.d_model)
    abstract = jax.eval_shape(lambda: train.create_state(model_config, optimizer, config.seed))
    averaged = ()
    if config.eval.average_last:
      averaged = tuple(steps_to_average(manager.all_steps(), step, config.eval.average_last))
      params, step = average_params(manager, abstract, averaged), averaged[-1]
    else:
      state = manager.restore(abstract, step)  # step None: the newest readable checkpoint
      params, step = state.params, int(state.step)
  finally:
    manager.close()
  return Trained(model_config, params, tokenizer_lib.load(tokenizer_path), step, averaged)


def evaluate_from_workdir(config, workdir: str, step=None) -> dict:
  """Evaluates a checkpoint of `workdir` on data.eval_split; prints the metrics as one JSON line.

  The metrics also go to WORKDIR/eval/STEP.json.
  """
  trained = load_trained(config, workdir, step)
  metrics = evaluate(trained.params, trained.model_config, config, trained.tokenizer,
                     data.load_split(config.data, config.data.eval_split))
  if trained.averaged_steps:
    metrics["averaged_steps"] = list(trained.averaged_steps)
  write_results(os.path.abspath(workdir), trained.step, metrics)
  print(json.dumps({"step": trained.step, **metrics}), flush=True)
  return metrics


# ----------------------------------------------------------------------------- translate


def encode_sources(tokenizer: tokenizer_lib.Tokenizer, texts: Sequence[str], max_source_len: int,
                   rows: int) -> tuple[np.ndarray, np.ndarray]:
  """Source ids as the model reads them: EOS-terminated, truncated to fit, padded.

  Returns (int32 `[rows, max_source_len]`, with rows past len(texts) all padding;
  bool `[len(texts)]`: which texts were truncated).
  """
  ids = tokenizer.encode(list(texts))
  inputs = np.zeros((rows, max_source_len), np.int32)
  truncated = np.zeros(len(ids), bool)
  for i, row in enumerate(ids):
    truncated[i] = len(row) > max_source_len - 1
    row = row[: max_source_len - 1] + [tokenizer_lib.EOS_ID]
    inputs[i, : len(row)] = row
  return inputs, truncated


def translate(params, model_config: ModelConfig, config, tokenizer: tokenizer_lib.Tokenizer,
              lines: Iterable[str]) -> Iterator[tuple[str, bool]]:
  """Yields (translation, truncated) for each line, in order, decoding eval.batch_size at a time.

  Lines are read lazily, one batch at a time. A blank line translates to an empty line without
  decoding; a source of more than data.max_source_len - 1 tokens (the last place is EOS's) is
  truncated; a translation never contains a newline.
  """
  batch_size, max_length = config.eval.batch_size, max_decode_length(config)
  lines = iter(lines)
  decoded = 0
  while chunk := [line.rstrip("\r\n") for line in itertools.islice(lines, batch_size)]:
    results = [("", False)] * len(chunk)
    todo = [i for i, line in enumerate(chunk) if line.strip()]
    if todo:
      inputs, truncated = encode_sources(tokenizer, [chunk[i] for i in todo],
                                         config.data.max_source_len, batch_size)
      tokens = np.asarray(decode_batch(params, model_config, config.eval, inputs, max_length,
                                       _batch_rng(config, decoded)))
      decoded += 1
      for row, i in enumerate(todo):
        results[i] = (" ".join(detokenize(tokenizer, tokens[row]).splitlines()),
                      bool(truncated[row]))
    yield from results


def write_translations(params, model_config: ModelConfig, config,
                       tokenizer: tokenizer_lib.Tokenizer, lines: Iterable[str], out=sys.stdout,
                       err=sys.stderr) -> int:
  """Writes one translation per line of `lines` to `out`, in order; returns the line count.

  How many sources were truncated is said once, on `err`, at the end.
  """
  count, truncated, first = 0, 0, None
  for count, (translation, cut) in enumerate(
      translate(params, model_config, config, tokenizer, lines), 1):
    out.write(translation + "\n")
    out.flush()
    if cut:
      truncated += 1
      first = first or count
  if truncated:
    print(f"warning: {truncated} of {count} source lines (the first is line {first}) had more "
          f"than data.max_source_len - 1 = {config.data.max_source_len - 1} tokens and were "
          "truncated", file=err, flush=True)
  return count


def translate_from_workdir(config, workdir: str, lines: Iterable[str], out=sys.stdout,
                           err=sys.stderr, step=None) -> int:
  """`write_translations` with checkpoint `step` of `workdir` (default: the latest), averaged
  if eval.average_last > 0."""
  trained = load_trained(config, workdir, step)
  return write_translations(trained.params, trained.model_config, config, trained.tokenizer,
                            lines, out, err)


# ----------------------------------------------------------------------------- throughput


def decode_throughput(params, model_config: ModelConfig, eval_config, sources: np.ndarray,
                      max_length: int, batch_size: int = 32, repeats: int = 3) -> dict:
  """Decoding speed of eval_config's search over `sources`, measured after a warm-up call.

  Args:
    sources: int `[n, src_len]` source ids (EOS-terminated, padded), cut into full batches of
      `batch_size` rows (repeated if n < batch_size, the remainder dropped).
    repeats: timed passes over all batches; the median pass is reported.

  Returns:
    tokens_per_s: output tokens (EOS included; for beam search those of the returned best
    hypotheses, not of every beam) per second; sentences_per_s; seconds of the median pass and
    of every pass; the sentences and tokens of one pass.
  """
  if len(sources) < batch_size:
    sources = np.resize(sources, (batch_size, sources.shape[1]))
  batches = [sources[i:i + batch_size]
             for i in range(0, len(sources) - batch_size + 1, batch_size)]
  # Warm-up: compiles, and fills caches (the model and config replace() are cached by jit).
  np.asarray(decode_batch(params, model_config, eval_config, batches[0], max_length))
  passes, tokens = [], 0
  for _ in range(repeats):
    tokens = 0
    start = time.perf_counter()
    for batch in batches:
      outputs = np.asarray(decode_batch(params, model_config, eval_config, batch, max_length))
      tokens += int((outputs != 0).sum())
    passes.append(time.perf_counter() - start)
  seconds = statistics.median(passes)
  sentences = len(batches) * batch_size
  return {"tokens_per_s": tokens / seconds, "sentences_per_s": sentences / seconds,
          "seconds": seconds, "pass_seconds": passes, "sentences": sentences, "tokens": tokens}


def benchmark_decoding(config, workdir: str, batch_size: int = 32, beam_size: int = 4,
                       num_batches: int = 8, repeats: int = 3, step=None) -> dict:
  """Greedy and beam-search decoding speed of a trained workdir on its eval split's sources.

  Uses the first `num_batches * batch_size` eval examples, beam length penalty
  eval.length_penalty, and eval.max_decode_len (or data.max_target_len) output positions.
  """
  trained = load_trained(config, workdir, step)
  d = config.data
  pairs = data.load_split(d, d.eval_split)
  examples = pipeline.encode(pairs[: num_batches * batch_size], trained.tokenizer,
                             d.max_source_len, d.max_target_len)
  if not len(examples):
    raise UserError("no evaluation example fits data.max_source_len / data.max_target_len")
  sources = examples.rows(np.arange(len(examples)))["inputs"]
  results = {"step": trained.step, "platform": jax.default_backend(),
             "device": jax.devices()[0].device_kind, "device_count": jax.device_count(),
             "cpu_count": os.cpu_count(),
             "batch_size": batch_size, "max_decode_len": max_decode_length(config)}
  for name, overrides in (("greedy", {"decode": "greedy"}),
                          (f"beam{beam_size}", {"decode": "beam", "beam_size": beam_size})):
    eval_config = config.eval.copy_and_resolve_references()
    eval_config.update(overrides)
    results[name] = {**decode_settings(eval_config), **decode_throughput(
        trained.params, trained.model_config, eval_config, sources,
        max_decode_length(config), batch_size, repeats)}
  return results
