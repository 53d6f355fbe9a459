"""What an example is for each task (data.task), on top of the sources' (source, target) pairs.

  seq2seq   source -> target (translation, SCAN): both sides, EOS-terminated. The encoder-decoder
            reads the source and predicts the target; the decoder-only model reads
            "source EOS BOS target" and is trained on the target only (a prefix LM).
  lm        a text per example (a line of a file, a TFDS text record) as the target, no source:
            the decoder-only language model. Texts longer than data.max_target_len tokens are cut
            into pieces of that length, each trained as a text of its own.
  mlm       a text per example as the source, no target: the train step masks it (BERT's
            corruption, data.mask_rate) and predicts the masked tokens. Long texts are cut into
            pieces of data.max_source_len.
  classify  (text, label): the text as the source, the label's index + 1 as a one-token target
            (0 stays padding); the labels are data.labels, or the sorted labels of the train split.
            With data.text_pair, (text_a, text_b, label): the source is BERT's "[CLS] A [SEP] B"
            (EOS = [SEP] follows), which the train step reads with token type 1 after the first
            EOS (`train/step.py`); a pair longer than data.max_source_len is cut longest-first,
            as BERT's fast tokenizer cuts it (`_longest_first`): both texts stay.

Text sources (data.format=text, TFDS text datasets) give (text, "") pairs; the tasks without a
side leave it empty (length 0), so its batch array has no columns.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from transformer_jax.core.errors import UserError
from transformer_jax.data import pipeline, sources
from transformer_jax.data.tokenizer import EOS_ID, Tokenizer

TASKS = ("seq2seq", "lm", "mlm", "classify")
# The tasks each architecture trains on.
ARCH_TASKS = {"encoder_decoder": ("seq2seq",), "decoder_only": ("seq2seq", "lm"),
              "encoder_only": ("mlm", "classify")}
# Tasks whose examples are single texts (the target of a text source is empty).
TEXT_TASKS = ("lm", "mlm")
# The tokenizer of an encoder-only model has a <mask> piece (id core.tokens.MASK_ID).
MASK_TASKS = ("mlm", "classify")


def check(arch: str, data_config) -> None:
  """The task, architecture and data format fit together. Raises UserError."""
  d = data_config
  if d.task not in ARCH_TASKS[arch]:
    raise UserError(f"data.task={d.task} does not train a model.arch={arch} model; it trains on "
                    f"{' or '.join(ARCH_TASKS[arch])} (set data.task or model.arch)")
  if d.source == "files":
    formats = {"seq2seq": ("parallel", "tsv"), "lm": ("text",), "mlm": ("text",),
               "classify": ("tsv",)}[d.task]
    if d.format not in formats:
      raise UserError(f"data.task={d.task} reads data.format={' or '.join(formats)} files, not "
                      f"{d.format}")
  if d.get("text_pair", False) and (d.task != "classify" or (
      d.source, d.format) != ("files", "tsv") and d.source != "tfds"):
    raise UserError("data.text_pair reads sentence pairs for data.task=classify from "
                    "data.source=files data.format=tsv (text_a<TAB>text_b<TAB>label lines) or "
                    "data.source=tfds; set those or data.text_pair=False")
  if d.get("text_pair", False) and d.source == "tfds" and not d.get("text_pair_field", ""):
    raise UserError("data.text_pair with data.source=tfds reads text B from "
                    "data.text_pair_field; set it (glue/mrpc: --config.data.text_field=sentence1 "
                    "--config.data.text_pair_field=sentence2)")
  if d.task == "classify" and d.batching == "packed":
    raise UserError("data.task=classify classifies whole rows; use data.batching=tokens or fixed")


def batch_lengths(data_config) -> tuple[int, int]:
  """The widest (inputs, targets) columns a batch of the task has: a missing side has none, a
  class label one."""
  d = data_config
  return {"seq2seq": (d.max_source_len, d.max_target_len), "lm": (0, d.max_target_len),
          "mlm": (d.max_source_len, 0), "classify": (d.max_source_len, 1)}[d.task]


def tokenizer_texts(data_config, pairs):
  """The pairs whose sides train the tokenizer: both sides, without the labels of classify."""
  if data_config.task != "classify":
    return pairs
  return _SourceOnly(pairs)


class _SourceOnly(sources._PairSequence):
  def __init__(self, pairs):
    self.pairs = pairs

  def __len__(self):
    return len(self.pairs)

  def gather(self, indices):
    return [(source, "") for source, _ in sources.gather(self.pairs, indices)]


class _TargetOnly(_SourceOnly):
  """(text, anything) -> ("", text): a text as the target of the language model."""

  def gather(self, indices):
    return [("", source) for source, _ in sources.gather(self.pairs, indices)]


_TRAIN_LABELS = {}  # the labels of a train split, by where it is read from


def label_names(data_config) -> tuple:
  """The classes of data.task=classify, in the order of their ids: data.labels (comma-separated)
  or the sorted distinct labels of the train split (a workdir trained before `fix_labels`
  wrote its labels into its config reads them so, as it was trained)."""
  d = data_config
  if d.labels:
    return tuple(label.strip() for label in d.labels.split(","))
  key = (d.source, d.path, d.format, d.tfds_name, d.tfds_data_dir, d.label_field, d.train_split,
         bool(d.get("text_pair", False)))
  if key not in _TRAIN_LABELS:
    pairs = sources.load_split(d, d.train_split)
    labels = [label for _, label in sources.gather(pairs, range(len(pairs)))]
    check_labels(pairs, range(len(pairs)), labels)
    _TRAIN_LABELS[key] = tuple(sorted(set(labels)))
  return _TRAIN_LABELS[key]


def _natural_key(label: str) -> list:
  """LABEL_2 before LABEL_10: digit runs compare as numbers."""
  return [(int(part) if i % 2 else part) for i, part in enumerate(re.split(r"(\d+)", label))]


def fix_labels(data_config, saved_labels=None) -> None:
  """Sets data.labels of a classifier's new run once, before it trains, so that the id of each
  class never depends on how its names sort later: the train split's labels, digit runs read
  as numbers (LABEL_2 before LABEL_10). `saved_labels`: data.labels of the workdir's own
  config.json (a run that resumes keeps them, even empty: it trained with the sorted order)."""
  d = data_config
  if d.task != "classify" or d.labels:
    return
  if saved_labels is not None:
    d.labels = saved_labels
    return
  names = sorted(label_names(d), key=_natural_key)
  bad = next((n for n in names if "," in n or n != n.strip() or not n), None)
  if bad is not None:
    raise UserError(f"the train split has the label {bad!r}, which data.labels (comma-separated) "
                    "cannot hold; rename it in the data, or name the classes in data.labels")
  d.labels = ",".join(names)


def check_class_count(data_config, num_labels: int) -> None:
  """More classes than the model's head has outputs would train labels past its last logit (a
  non-finite loss): refused, naming both counts."""
  names = label_names(data_config)
  if len(names) > num_labels:
    source = "data.labels" if data_config.labels else f"the {data_config.train_split!r} split"
    shown = ", ".join(map(repr, names[:6])) + (", ..." if len(names) > 6 else "")
    raise UserError(f"{source} has {len(names)} classes ({shown}) but model.num_labels is "
                    f"{num_labels}; set --config.model.num_labels={len(names)}, or fix the "
                    "labels")


def check_labels(pairs, indices, labels, known=None) -> None:
  """Refuses the first example (by file and line, where it has them) whose label is empty or,
  given the `known` classes, not one of them: either would train a class the model lacks."""
  for index, label in zip(indices, labels):
    if not label.strip():
      raise UserError(f"{sources.where(pairs, index)} has an empty label; give every example "
                      "its class (text<TAB>label, or text_a<TAB>text_b<TAB>label with "
                      "data.text_pair) or remove the line")
    if known is not None and label not in known:
      raise UserError(f"{sources.where(pairs, index)} has the label {label[:60]!r}, which is not "
                      f"among the classes {list(known)[:10]}; fix the data, or list every class "
                      "in data.labels (comma-separated)")


def examples(data_config, pairs, tokenizer: Tokenizer) -> pipeline.Encoded:
  """The tokenised examples of a split's pairs for data.task (see the module docstring)."""
  d = data_config
  if d.task == "seq2seq":
    return pipeline.encode(pairs, tokenizer, d.max_source_len, d.max_target_len)
  if d.task == "lm":
    # No limit at first: long texts are cut below rather than dropped.
    encoded = pipeline.encode(_TargetOnly(pairs), tokenizer, 1, np.iinfo(np.int32).max)
    return _texts(encoded, "target", d.max_target_len)
  if d.task == "mlm":
    encoded = pipeline.encode(_SourceOnly(pairs), tokenizer, np.iinfo(np.int32).max, 1)
    return _texts(encoded, "source", d.max_source_len)
  labels = {name: i for i, name in enumerate(label_names(d))}
  if d.get("text_pair", False):
    tokenizer = PairTokenizer(tokenizer, d.max_source_len)
  encoded = pipeline.encode(_SourceOnly(pairs), tokenizer, d.max_source_len, 1)
  kept = sources.gather(pairs, encoded.index)
  check_labels(pairs, encoded.index, [label for _, label in kept], labels)
  ids = np.asarray([labels[label] + 1 for _, label in kept], np.int32)
  return dataclasses.replace(encoded, target=ids, target_starts=np.arange(len(ids)),
                             target_lengths=np.ones(len(ids), np.int64), max_target_len=1)


def _texts(encoded: pipeline.Encoded, side: str, length: int) -> pipeline.Encoded:
  """Single texts on `side`, the other side empty (no tokens, no batch columns); a text of more
  than `length` tokens cut into pieces of at most `length` (the last keeps the EOS). The pieces
  are (start, length) views into the same token buffer, nothing is copied; `index` maps each
  piece to its text."""
  other = "target" if side == "source" else "source"
  starts = np.asarray(encoded.__dict__[f"{side}_starts"])
  lengths = np.asarray(encoded.__dict__[f"{side}_lengths"])
  counts = np.maximum(-(-lengths // length), 1)  # pieces per text
  total = int(counts.sum())
  offset = (np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)) * length
  empty = np.zeros(total, np.int64)
  return dataclasses.replace(
      encoded, index=np.repeat(encoded.index, counts), dropped=0,
      **{f"{side}_starts": np.repeat(starts, counts) + offset,
         f"{side}_lengths": np.minimum(np.repeat(lengths, counts) - offset, length),
         f"max_{side}_len": length, other: encoded.__dict__[other][:0],
         f"{other}_starts": empty, f"{other}_lengths": empty, f"max_{other}_len": 0})


class PairTokenizer:
  """Reads a source "text_a<TAB>text_b" (data.text_pair) as BERT's tokenizer reads a pair:
  "[CLS] A [SEP] B" (our BOS, A, EOS, B; the pipeline appends the last EOS), or "A EOS B" for a
  tokenizer without BOS. A pair longer than `max_len` tokens (both EOS included) is cut
  longest-first, as BERT's fast tokenizer (the tokenizers library) cuts it: `_longest_first`."""

  def __init__(self, tokenizer: Tokenizer, max_len: int):
    self.tokenizer, self.max_len = tokenizer, max_len
    self.vocab_size = tokenizer.vocab_size

  def encode(self, texts, target: bool = False) -> list[list[int]]:
    texts = list(texts)
    if not any(texts):  # the classify task's empty target side
      return [[] for _ in texts]
    split = [text.split(sources.PAIR_SEPARATOR, 1) for text in texts]
    if any(len(parts) != 2 for parts in split):
      raise ValueError("PairTokenizer reads text_a<TAB>text_b sources")
    firsts = self.tokenizer.encode([a for a, _ in split])
    seconds = self.tokenizer.encode([b for _, b in split])
    start = 1 if getattr(self.tokenizer, "add_bos", False) else 0
    rows = []
    for first, second in zip(firsts, seconds):
      a, b = first[start:], second[start:]  # without [CLS]
      extra = start + 2  # [CLS], the [SEP] between, the last [SEP]
      n_a, n_b = _longest_first(len(a), len(b), self.max_len - extra)
      rows.append(first[:start] + a[:n_a] + [EOS_ID] + b[:n_b])
    return rows


def _longest_first(n_a: int, n_b: int, budget: int) -> tuple[int, int]:
  """How many tokens of A and B stay when at most `budget` may (truncation="longest_first" of
  the tokenizers library): the shorter text whole if the longer can have the rest and still be
  at least as long; else both cut to half the budget, the odd token to the longer text (to B when
  they were equally long). Tokens go from the ends of the texts."""
  if n_a + n_b <= budget:
    return n_a, n_b
  swap = n_a > n_b
  short, long = (n_b, n_a) if swap else (n_a, n_b)
  long = max(short, budget - short)
  if short + long > budget:
    short = max(budget, 0) // 2
    long = max(budget, 0) - short
  return (long, short) if swap else (short, long)
