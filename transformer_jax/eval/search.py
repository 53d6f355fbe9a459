"""The configured search: `eval.decode` picks greedy, beam or sampling, with its settings.

evaluate, translate and the benchmark all decode through `decode_batch`, so the same sources
give the same outputs everywhere.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.core.tokens import UNK_ID
from transformer_jax.data import tokenizer as tokenizer_lib
from transformer_jax.eval import decode
from transformer_jax.model import ModelConfig
from transformer_jax.train import sharding


def decode_settings(eval_config) -> dict:
  """The settings that determine the decoded outputs, as recorded with the metrics."""
  e = eval_config
  settings = {"decode": e.decode}
  if e.decode == "beam":
    settings.update(beam_size=e.beam_size, length_penalty=e.length_penalty)
    if e.get("length_penalty_form", "gnmt") != "gnmt":
      settings["length_penalty_form"] = e.length_penalty_form
  elif e.decode == "sample":
    settings.update(temperature=e.temperature, top_k=e.top_k)
  if e.get("force_eos", False):
    settings["force_eos"] = True
  if e.get("length_head", False):
    settings = {"decode": "greedy", "length_head": True}
    if e.get("length_head_slack", 0):
      settings["length_head_slack"] = e.length_head_slack
  if e.get("suppress_tokens", ()):
    settings["suppress_tokens"] = list(e.suppress_tokens)
  return settings


def max_decode_length(config) -> int:
  """Output positions (EOS included) that decoding allows: eval.max_decode_len or the targets'."""
  return config.eval.max_decode_len or config.data.max_target_len


def decode_batch(params, model_config: ModelConfig, eval_config, inputs, max_length: int,
                 rng=None, mesh=None, prompts: bool = False, lengths=None,
                 predicted=None) -> np.ndarray:
  """Output token ids `[batch, max_length]` of source ids `inputs` by the configured search.

  Rows of `inputs` that are all padding come back as zeros at no cost. `rng` (a PRNG key) is
  used by decode=sample only. With a `mesh` (that `params` live on), the rows are split over
  its data x fsdp devices and every process gets all outputs. A decoder-only model continues
  the prompt "source EOS BOS", as it was trained; or, with `prompts`, the rows of `inputs`
  themselves (`generate.py`).

  `lengths` (int `[batch]`): oracle-length decoding (see `decode.greedy_decode`): greedy,
  whatever eval.decode says, with EOS masked out and row r stopped after lengths[r] tokens.
  Without `lengths`, eval.length_head decodes the same way with the lengths that the model's
  length head predicts (`head_lengths`); with eval.length_head_slack = k > 0 the model's own
  EOS ends row r anywhere from predicted[r] - k to predicted[r] + k tokens (greedy).
  `predicted`: those lengths where the caller has them already (`head_lengths` of `inputs`).
  """
  cfg = model_config.replace(deterministic=True)
  e = eval_config
  rows = len(inputs)
  window = None
  if lengths is None and e.get("length_head", False):
    lengths = (head_lengths(params, cfg, inputs, max_length, mesh) if predicted is None
               else np.asarray(predicted, np.int32))
    if slack := e.get("length_head_slack", 0):
      window = (np.maximum(lengths - slack, 0).astype(np.int32),
                np.minimum(lengths + slack, max_length - 1).astype(np.int32))
      lengths = None
  if cfg.arch == "decoder_only" and not prompts:
    inputs = np.asarray(decode.seq2seq_prompt(np.asarray(inputs)))
  context = contextlib.nullcontext()
  if mesh is not None:
    placed = {"inputs": np.asarray(inputs)}
    if lengths is not None:
      placed["lengths"] = np.asarray(lengths, np.int32)
    if window is not None:
      placed["shortest"], placed["longest"] = window
    placed = sharding.shard_batch(placed, mesh)
    inputs, lengths = placed["inputs"], placed.get("lengths", lengths)
    window = None if window is None else (placed["shortest"], placed["longest"])
    context = sharding.context(mesh)
  rules = {"suppressed": tuple(int(t) for t in e.get("suppress_tokens", ())),
           "force_eos": bool(e.get("force_eos", False))}
  with context:
    if lengths is not None or window is not None:
      tokens = decode.greedy_decode(params, cfg, inputs, max_length, window=window,
                                    lengths=None if lengths is None else jnp.asarray(lengths),
                                    suppressed=rules["suppressed"])
    elif e.decode == "beam":
      tokens, _ = decode.beam_search(params, cfg, inputs, max_length, beam_size=e.beam_size,
                                     alpha=e.length_penalty,
                                     penalty_form=e.get("length_penalty_form", "gnmt"), **rules)
    elif e.decode == "sample":
      rng = jax.random.key(0) if rng is None else rng
      tokens = decode.sample(params, cfg, inputs, max_length, rng, temperature=e.temperature,
                             top_k=e.top_k, **rules)
    else:
      tokens = decode.greedy_decode(params, cfg, inputs, max_length, **rules)
  return sharding.to_host(tokens)[:rows]


def head_lengths(params, model_config: ModelConfig, inputs, max_length: int,
                 mesh=None) -> np.ndarray:
  """model.length_head's predicted output lengths of source ids `inputs` (int `[rows]`, EOS
  not counted): rounded to the nearest integer and kept in [1, max_length - 1] (the output
  positions decoding allows, one left for EOS). Rows of padding get 0."""
  cfg = model_config.replace(deterministic=True)
  host = np.asarray(inputs)
  context = contextlib.nullcontext()
  if mesh is not None:
    inputs = sharding.shard_batch({"inputs": host}, mesh)["inputs"]
    context = sharding.context(mesh)
  with context:
    predicted = decode.predicted_lengths(params, cfg, jnp.asarray(inputs))
  predicted = np.asarray(sharding.to_host(predicted))[:len(host)]
  kept = np.clip(np.rint(predicted), 1, max(max_length - 1, 1)).astype(np.int32)
  return np.where(host.any(axis=-1), kept, 0)


def detokenize(tokenizer: tokenizer_lib.Tokenizer, ids) -> str:
  """The text of decoded ids; ids the tokenizer lacks (model.vocab_size may exceed its size, and
  an undertrained model can emit them) read as unknown."""
  ids = np.asarray(ids)
  return tokenizer.decode(np.where(ids < tokenizer.vocab_size, ids, UNK_ID))


def batch_rng(config, index: int):
  """The sampling key of the `index`-th decoded batch: evaluate and translate agree on it."""
  return jax.random.fold_in(jax.random.key(config.seed), index)
