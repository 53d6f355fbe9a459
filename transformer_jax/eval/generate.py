"""Prompts in, continuations out: a decoder-only language model (data.task=lm) continues each
line of text, with the KV cache and the configured search (eval.decode: greedy, sample, beam)."""

from __future__ import annotations

import itertools
import sys
from typing import Iterable, Iterator

import numpy as np

from transformer_jax.core.errors import UserError
from transformer_jax.core.tokens import BOS_ID
from transformer_jax.data import tokenizer as tokenizer_lib
from transformer_jax.eval.load import load_trained
from transformer_jax.eval.search import batch_rng, decode_batch, detokenize, max_decode_length
from transformer_jax.eval.translate import DecodedLines, output_line, warn_folded
from transformer_jax.model import ModelConfig


def check_generates(model_config: ModelConfig, config) -> None:
  if model_config.arch != "decoder_only" or config.data.task != "lm":
    raise UserError(f"--mode=generate continues text with a decoder-only language model "
                    f"(model.arch=decoder_only, data.task=lm), not model.arch="
                    f"{model_config.arch}, data.task={config.data.task}"
                    + ("; translate with --mode=translate" if config.data.task == "seq2seq"
                       else ""))


def encode_prompts(tokenizer: tokenizer_lib.Tokenizer, texts, longest: int,
                   rows: int) -> tuple[np.ndarray, np.ndarray]:
  """Prompts as the model reads them: "BOS text" ("text" for an imported GPT-2), its last
  `longest` tokens kept, right-padded.

  Returns (int32 `[rows, longest]`, rows past len(texts) all padding; bool `[len(texts)]`: which
  prompts lost their beginning).
  """
  ids = tokenizer.encode(list(texts))
  prompts = np.zeros((rows, longest), np.int32)
  truncated = np.zeros(len(ids), bool)
  for i, row in enumerate(ids):
    # An imported GPT-2 reads a prompt without BOS, as its tokenizer gives it; an empty prompt
    # still starts with one (GPT-2's <|endoftext|>).
    row = [BOS_ID] + row if tokenizer.prompt_bos or not row else row
    truncated[i] = len(row) > longest
    row = row[-longest:]
    prompts[i, :len(row)] = row
  return prompts, truncated


def generate(params, model_config: ModelConfig, config, tokenizer: tokenizer_lib.Tokenizer,
             lines: Iterable[str], mesh=None) -> Iterator[tuple[str, bool]]:
  """Yields (continuation, truncated) for each line, in order, eval.batch_size lines at a time.

  A blank line is an empty prompt: the model writes a text from its beginning. A prompt keeps
  its last model.max_len - eval.max_decode_len tokens (BOS included), so that prompt and
  continuation fit the positions the model has; a continuation is the decoded text as it is,
  line breaks included (`translate.output_line` writes it as one line).
  """
  check_generates(model_config, config)
  batch_size, max_length = config.eval.batch_size, max_decode_length(config)
  longest = model_config.max_len - max_length + 1  # the prompt's last token reads position 0..
  if longest < 1:
    raise UserError(f"eval.max_decode_len ({max_length}) leaves no room for a prompt in "
                    f"model.max_len ({model_config.max_len}); lower it")
  lines = iter(lines)
  for index in itertools.count():
    chunk = [line.rstrip("\r\n") for line in itertools.islice(lines, batch_size)]
    if not chunk:
      return
    prompts, truncated = encode_prompts(tokenizer, chunk, longest, batch_size)
    tokens = decode_batch(params, model_config, config.eval, prompts, max_length,
                          batch_rng(config, index), mesh=mesh, prompts=True)
    for row in range(len(chunk)):
      yield detokenize(tokenizer, tokens[row]), bool(truncated[row])


def generate_from_workdir(config, workdir: str, lines: Iterable, out=sys.stdout,
                          err=sys.stderr, step=None, output_format: str = "text") -> int:
  """Writes one continuation per line of `lines` (bytes or text) to `out`, each as
  `translate.output_line` writes it in `output_format`, with checkpoint
  `step` of `workdir` (default: the latest); returns the line count. Truncated prompts and lines
  that are not UTF-8 are counted on `err`, as translate does."""
  # Checked on the config before any checkpoint is read: restoring another architecture's
  # checkpoint into this one would fail first, with a message about the tree, not the mode.
  check_generates(config.model, config)
  output_line("", output_format)  # an unknown format is refused before any work
  trained = load_trained(config, workdir, step)
  lines = DecodedLines(lines)
  count, truncated, folded = 0, 0, 0
  for text, cut in generate(trained.params, trained.model_config, config, trained.tokenizer,
                            lines, trained.mesh):
    line, was_folded = output_line(text, output_format)
    out.write(line + "\n")
    out.flush()
    count, truncated, folded = count + 1, truncated + cut, folded + was_folded
  warn_folded(folded, count, "continuations", err)
  if truncated:
    print(f"warning: {truncated} of {count} prompts were longer than model.max_len - "
          "eval.max_decode_len tokens and kept only their end", file=err, flush=True)
  if lines.bad:
    print(f"warning: {len(lines.bad)} of {count} prompts were not UTF-8; their undecodable "
          "bytes were read as U+FFFD", file=err, flush=True)
  return count
