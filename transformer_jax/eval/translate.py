"""Text lines in, translations out, in order."""

from __future__ import annotations

import itertools
import json
import re
import sys
from typing import Iterable, Iterator, Sequence

import numpy as np

from transformer_jax.core import progress
from transformer_jax.core.errors import UserError
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


# How --mode=translate / generate write each output as one line of stdout (--output_format):
#   text: as decoded, each line break inside it (what str.splitlines breaks at: \n, \r, \x0b,
#     \x0c, \x1c-\x1e, \x85, \u2028, \u2029) written as a space, and said once on stderr;
#   escaped: backslash escapes as in a Python string literal (\\, \n, \r, \t, \xHH, \uHHHH for
#     every control character and line separator), so `ast.literal_eval('"' + line + '"')`
#     (with '"' escaped too) gives the output back;
#   jsonl: one JSON object {"output": ...} per line.
OUTPUT_FORMATS = ("text", "escaped", "jsonl")
_NAMED_ESCAPES = {"\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(char: str) -> str:
  if char in _NAMED_ESCAPES:
    return _NAMED_ESCAPES[char]
  code = ord(char)
  return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def _escaped(text: str) -> str:
  return re.sub(r"[\\\x00-\x1f\x7f-\x9f\u2028\u2029]", lambda m: _escape(m.group()), text)


def output_line(text: str, output_format: str) -> tuple[str, bool]:
  """(one output as one line of `output_format`, without its newline; whether `text` held a
  line break that the text format wrote as a space)."""
  if output_format == "jsonl":
    line = json.dumps({"output": text}, ensure_ascii=False)  # escapes \x00-\x1f, not these:
    return re.sub("[\x85\u2028\u2029]", lambda m: f"\\u{ord(m.group()):04x}", line), False
  if output_format == "escaped":
    return _escaped(text), False
  if output_format != "text":
    raise UserError(f"--output_format must be one of {', '.join(OUTPUT_FORMATS)}; got "
                    f"{output_format!r}")
  parts = text.splitlines()
  return " ".join(parts), len(parts) > 1 or text != text.rstrip("\n\r\x0b\x0c\x1c\x1d\x1e"
                                                                "\x85\u2028\u2029")


def warn_folded(folded: int, count: int, what: str, err) -> None:
  if folded:
    print(f"warning: {folded} of {count} {what} held line breaks (\\n, \\x0b, \\x1d, ...), "
          "written as spaces to keep one output per line; --output_format=escaped or jsonl keeps "
          "them", file=err, flush=True)


def translate(params, model_config: ModelConfig, config, tokenizer: tokenizer_lib.Tokenizer,
              lines: Iterable[str], mesh=None, buffer_size: int = 0
              ) -> Iterator[tuple[str, bool]]:
  """Yields (translation, truncated) for each line, in order.

  Lines are read lazily, `buffer_size` at a time (0: eval.batch_size), and each buffer is
  decoded in batches of at most eval.batch_size rows, so that a buffer of 1 answers every line
  as soon as it is read. A blank line translates to an empty line without decoding; a source
  of more than data.max_source_len - 1 tokens (the last place is EOS's) is truncated; a
  translation is the decoded text as it is, line breaks included (`output_line` writes it as one
  line). `mesh`: the mesh `params` live on, if any.
  """
  batch_size, max_length = config.eval.batch_size, max_decode_length(config)
  buffer_size = buffer_size or batch_size
  rows = min(buffer_size, batch_size)  # one shape for every batch: one compilation
  lines = iter(lines)
  decoded = 0
  while chunk := [line.rstrip("\r\n") for line in itertools.islice(lines, buffer_size)]:
    results = [("", False)] * len(chunk)
    todo = [i for i, line in enumerate(chunk) if line.strip()]
    for start in range(0, len(todo), rows):
      batch = todo[start:start + rows]
      inputs, truncated = encode_sources(tokenizer, [chunk[i] for i in batch],
                                         config.data.max_source_len, rows)
      tokens = decode_batch(params, model_config, config.eval, inputs, max_length,
                            batch_rng(config, decoded), mesh=mesh)
      decoded += 1
      for row, i in enumerate(batch):
        results[i] = (detokenize(tokenizer, tokens[row]), bool(truncated[row]))
    yield from results


def buffer_size(config, lines) -> int:
  """Source lines read before translating: eval.buffer_size, or where it is 0, 1 for a
  terminal (each line is answered as it is typed) and eval.batch_size for a file or a pipe."""
  if config.eval.buffer_size:
    return config.eval.buffer_size
  try:
    interactive = lines.isatty()
  except (AttributeError, ValueError):  # not a stream, or a closed one
    interactive = False
  return 1 if interactive else config.eval.batch_size


class DecodedLines:
  """The lines of a byte stream (or a text stream) as text, never failing on bad bytes.

  Bytes that are not UTF-8 become U+FFFD and the numbers of their lines are kept in `bad`, for
  one warning at the end instead of a lost batch. A text stream decoded with surrogateescape (a
  POSIX locale) carries such bytes as lone surrogates; they are replaced the same way. A UTF-8
  byte order mark at the start is not text and is dropped.
  """

  def __init__(self, lines: Iterable):
    self.lines = lines
    self.bad = []

  def __iter__(self) -> Iterator[str]:
    for number, line in enumerate(self.lines, 1):
      raw = line if isinstance(line, bytes) else line.encode("utf-8", "surrogateescape")
      try:
        text = raw.decode("utf-8")
      except UnicodeDecodeError:
        text = raw.decode("utf-8", errors="replace")
        self.bad.append(number)
      yield text.removeprefix("\ufeff") if number == 1 else text


def _lines(numbers: list) -> str:
  return ", ".join(map(str, numbers[:10])) + (", ..." if len(numbers) > 10 else "")


def write_translations(params, model_config: ModelConfig, config,
                       tokenizer: tokenizer_lib.Tokenizer, lines: Iterable, out=sys.stdout,
                       err=sys.stderr, mesh=None, output_format: str = "text") -> int:
  """Writes one translation per line of `lines` (bytes or text) to `out`, in order, each as
  `output_line` writes it in `output_format`; returns the line count.

  How many sources were truncated, and which were not UTF-8, is said once each, on `err`, at
  the end.
  """
  size = buffer_size(config, lines)
  lines = DecodedLines(lines)
  output_line("", output_format)  # an unknown format is refused before any work
  count, truncated, folded = 0, [], 0
  # A count of lines with their rate on a terminal's stderr, for a file being translated (a
  # person typing sees each answer instead).
  with progress.bar(desc="translating", unit="line", stdout_is_output=True,
                    disable=size == 1 or not progress.enabled(stdout_is_output=True)) as shown:
    for count, (translation, cut) in enumerate(
        translate(params, model_config, config, tokenizer, lines, mesh, size), 1):
      line, was_folded = output_line(translation, output_format)
      out.write(line + "\n")
      out.flush()
      shown.update()
      folded += was_folded
      if cut:
        truncated.append(count)
  warn_folded(folded, count, "translations", err)
  if truncated:
    print(f"warning: {len(truncated)} of {count} source lines (line {_lines(truncated)}) had "
          f"more than data.max_source_len - 1 = {config.data.max_source_len - 1} tokens and were "
          "truncated", file=err, flush=True)
  if lines.bad:
    print(f"warning: {len(lines.bad)} of {count} source lines (line {_lines(lines.bad)}) were "
          "not UTF-8; their undecodable bytes were read as U+FFFD", file=err, flush=True)
  return count


def check_translates(config) -> None:
  """Translation needs a model trained on source -> target pairs (data.task=seq2seq); checked
  before any checkpoint is read, whose decoding would fail with a message about lengths."""
  if config.data.task != "seq2seq":
    instead = ("continue text with --mode=generate" if config.data.task == "lm" else
               "score it with --mode=evaluate")
    raise UserError(f"--mode=translate needs a model trained on source -> target pairs "
                    f"(data.task=seq2seq: model.arch=encoder_decoder, or decoder_only as in "
                    f"experiments/scan_decoder.py), not data.task={config.data.task} with "
                    f"model.arch={config.model.arch}; {instead}")


def translate_from_workdir(config, workdir: str, lines: Iterable[str], out=sys.stdout,
                           err=sys.stderr, step=None, output_format: str = "text") -> int:
  """`write_translations` with checkpoint `step` of `workdir` (default: the latest), averaged
  if eval.average_last > 0."""
  check_translates(config)
  output_line("", output_format)
  trained = load_trained(config, workdir, step)
  return write_translations(trained.params, trained.model_config, config, trained.tokenizer,
                            lines, out, err, trained.mesh, output_format)
