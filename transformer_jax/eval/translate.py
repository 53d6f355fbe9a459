"""Text lines in, translations out, in order."""

from __future__ import annotations

import itertools
import sys
from typing import Iterable, Iterator, Sequence

import numpy as np

from transformer_jax.core.tokens import EOS_ID
from transformer_jax.data import tokenizer as tokenizer_lib
from transformer_jax.eval.load import load_trained
from transformer_jax.eval.search import batch_rng, decode_batch, detokenize, max_decode_length
from transformer_jax.model import ModelConfig


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
    row = row[: max_source_len - 1] + [EOS_ID]
    inputs[i, : len(row)] = row
  return inputs, truncated


def translate(params, model_config: ModelConfig, config, tokenizer: tokenizer_lib.Tokenizer,
              lines: Iterable[str], mesh=None) -> Iterator[tuple[str, bool]]:
  """Yields (translation, truncated) for each line, in order, decoding eval.batch_size at a time.

  Lines are read lazily, one batch at a time. A blank line translates to an empty line without
  decoding; a source of more than data.max_source_len - 1 tokens (the last place is EOS's) is
  truncated; a translation never contains a newline. `mesh`: the mesh `params` live on, if any.
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
      tokens = decode_batch(params, model_config, config.eval, inputs, max_length,
                            batch_rng(config, decoded), mesh=mesh)
      decoded += 1
      for row, i in enumerate(todo):
        results[i] = (" ".join(detokenize(tokenizer, tokens[row]).splitlines()),
                      bool(truncated[row]))
    yield from results


def write_translations(params, model_config: ModelConfig, config,
                       tokenizer: tokenizer_lib.Tokenizer, lines: Iterable[str], out=sys.stdout,
                       err=sys.stderr, mesh=None) -> int:
  """Writes one translation per line of `lines` to `out`, in order; returns the line count.

  How many sources were truncated is said once, on `err`, at the end.
  """
  count, truncated, first = 0, 0, None
  for count, (translation, cut) in enumerate(
      translate(params, model_config, config, tokenizer, lines, mesh), 1):
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
                            lines, out, err, trained.mesh)
