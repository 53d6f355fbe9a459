"""Tokenised, fixed-shape batches: a deterministic train stream and ordered eval batches.

Batch `k` of the train stream depends only on (data, config, seed, k): epochs are shuffled with a
seed derived from (seed, epoch) and the stream is indexed by step, so the step is the whole
iterator state and a resumed run gets exactly the batch that would have come next. Nor does it
depend on the number of processes or devices: the plan of a batch (which examples fill which
row, `TrainStream.plan`) comes from the examples' lengths alone and is the same on every
process, and each process reads the tokens of its own rows only (`fill`). `batches` makes them
ahead of the train step in a background thread.

Three ways to batch (data.batching):
  fixed   `batch_size` examples per batch, padded to the configured maximum lengths.
  tokens  length buckets; each batch holds examples of one bucket, trimmed to the bucket's length,
          and as many rows as fit data.tokens_per_batch (the paper's batching by approximate
          length).
  packed  several examples per row of the maximum lengths, with segment ids and positions so that
          attention never crosses examples; as many rows as fit data.tokens_per_batch.

A packed batch carries, besides "inputs" and "targets" (int32 `[rows, length]`, 0 = padding):
  "inputs_segmentation", "targets_segmentation": example number within the row (1, 2, ...; 0 =
      padding); example j of a row has the same number on both sides.
  "inputs_position", "targets_position": position of each token within its own example.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
from typing import Any, Callable, Optional

import grain
import numpy as np

from transformer_jax.core.errors import UserError
from transformer_jax.data import sources
from transformer_jax.data.tokenizer import EOS_ID, HFTokenizer, Tokenizer

PACKED_KEYS = ("inputs_segmentation", "targets_segmentation", "inputs_position", "targets_position")


@dataclasses.dataclass
class Encoded:
  """Tokenised, EOS-terminated examples stored ragged: example i's source is
  `source[source_starts[i]:source_starts[i] + source_lengths[i]]`. `index` maps each example back
  to its position in the split. Ragged storage keeps a corpus of millions of pairs at its token
  count; `source` and `target` may be memory-mapped files of the cache (`data/cache.py`), of
  which a batch reads only its own examples."""

  source: np.ndarray  # [tokens] every example's ids and EOS, uint16 or int32
  source_starts: np.ndarray  # [n] int64
  source_lengths: np.ndarray  # [n] EOS included
  target: np.ndarray
  target_starts: np.ndarray
  target_lengths: np.ndarray
  index: np.ndarray  # [n]
  dropped: int  # examples longer than the limits
  max_source_len: int
  max_target_len: int

  def __len__(self):
    return len(self.index)

  def rows(self, rows, source_len: int | None = None, target_len: int | None = None) -> dict:
    """One example per row, padded to the given lengths (default: the maximum lengths)."""
    rows = np.asarray(rows, np.int64)
    plan = Plan(rows, np.ones(len(rows), np.int64), source_len or self.max_source_len,
                target_len or self.max_target_len, packed=False)
    return fill(self, plan)


def encode_corpus(pairs, tokenizer: Tokenizer, chunk_size: int = 50_000) -> dict:
  """Tokenises every pair and appends EOS to both sides: the form the cache stores.

  Returns {"source", "target": [tokens] uint16 (int32 for vocabularies over 65,535),
  "source_offsets", "target_offsets": [n + 1] int64, example i at offsets[i]:offsets[i + 1]}.
  Reads and tokenises `chunk_size` pairs at a time, so a large corpus is never held as text.
  """
  dtype = np.uint16 if tokenizer.vocab_size <= np.iinfo(np.uint16).max else np.int32
  parts = {"source": [], "target": [], "source_lengths": [], "target_lengths": []}
  for start in range(0, len(pairs), chunk_size):
    chunk = sources.gather(pairs, range(start, min(start + chunk_size, len(pairs))))
    for side, texts in (("source", [s for s, _ in chunk]), ("target", [t for _, t in chunk])):
      # Marian's tokenizer reads the two sides with two SentencePiece models.
      ids = (tokenizer.encode(texts, target=True) if side == "target" and
             isinstance(tokenizer, HFTokenizer) else tokenizer.encode(texts))
      lengths = np.fromiter(map(len, ids), np.int64, len(ids)) + 1  # EOS
      tokens = np.empty(int(lengths.sum()), dtype)
      eos = np.cumsum(lengths) - 1
      real = np.ones(len(tokens), bool)
      real[eos] = False
      tokens[real] = np.fromiter(itertools.chain.from_iterable(ids), dtype, len(tokens) - len(ids))
      tokens[eos] = EOS_ID
      parts[side].append(tokens)
      parts[f"{side}_lengths"].append(lengths)
  corpus = {}
  for side in ("source", "target"):
    corpus[side] = np.concatenate(parts[side]) if parts[side] else np.zeros(0, dtype)
    lengths = np.concatenate(parts[f"{side}_lengths"]) if parts[side] else np.zeros(0, np.int64)
    corpus[f"{side}_offsets"] = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
  return corpus


def select(corpus: dict, max_source_len: int, max_target_len: int) -> Encoded:
  """The examples of an `encode_corpus` result that fit the limits (EOS included)."""
  # Plain arrays over the same memory: indexing an np.memmap goes through Python code each time.
  corpus = {name: np.asarray(array) for name, array in corpus.items()}
  source_lengths = np.diff(corpus["source_offsets"])
  target_lengths = np.diff(corpus["target_offsets"])
  index = np.flatnonzero((source_lengths <= max_source_len) & (target_lengths <= max_target_len))
  # All kept (the usual case with generous limits): views instead of copies of [n] arrays.
  kept = slice(None) if len(index) == len(source_lengths) else index
  return Encoded(source=corpus["source"], source_starts=corpus["source_offsets"][:-1][kept],
                 source_lengths=source_lengths[kept], target=corpus["target"],
                 target_starts=corpus["target_offsets"][:-1][kept],
                 target_lengths=target_lengths[kept], index=index,
                 dropped=len(source_lengths) - len(index), max_source_len=max_source_len,
                 max_target_len=max_target_len)


def encode(pairs, tokenizer: Tokenizer, max_source_len: int, max_target_len: int,
           chunk_size: int = 50_000) -> Encoded:
  """Tokenises pairs, appends EOS to both sides, drops pairs that do not fit the limits."""
  return select(encode_corpus(pairs, tokenizer, chunk_size), max_source_len, max_target_len)


@dataclasses.dataclass(frozen=True)
class Plan:
  """Which examples fill which row of one global batch: row r holds the examples
  `examples[row_starts[r]:row_starts[r] + row_sizes[r]]`, one after the other."""

  examples: np.ndarray  # [examples] example ids, row by row
  row_sizes: np.ndarray  # [rows] examples per row (1 unless packed)
  source_len: int
  target_len: int
  packed: bool

  @property
  def rows(self) -> int:
    return len(self.row_sizes)

  @property
  def row_starts(self) -> np.ndarray:
    return np.cumsum(self.row_sizes) - self.row_sizes

  def tokens(self, examples: Encoded) -> int:
    """Non-padding tokens of the batch, both sides, without reading any token."""
    return int(examples.source_lengths[self.examples].sum()
               + examples.target_lengths[self.examples].sum())


def fill(examples: Encoded, plan: Plan, rows=None) -> dict:
  """The global batch of `plan` (see the module docstring), with only `rows` filled (default:
  all); the other rows are empty (all 0). Reads the tokens of those rows' examples only.

  Vectorised over every token of the batch: a Python loop per example would cost more than
  the train step of a small model (the log's `input` share).
  """
  keys = ("inputs", "targets") + (PACKED_KEYS if plan.packed else ())
  batch = {k: np.zeros((plan.rows, plan.source_len if k.startswith("inputs") else plan.target_len),
                       np.int32) for k in keys}
  rows = np.arange(plan.rows) if rows is None else np.asarray(rows, np.int64)
  if plan.packed:
    sizes = plan.row_sizes[rows]
    first = np.repeat(np.cumsum(sizes) - sizes, sizes)  # each example's row's first example
    ids = plan.examples[np.repeat(plan.row_starts[rows], sizes) + np.arange(len(first)) - first]
    row_of = np.repeat(rows, sizes)
  else:
    ids, row_of = plan.examples[rows], rows
  for side, tokens, starts, lengths in (
      ("inputs", examples.source, examples.source_starts, examples.source_lengths),
      ("targets", examples.target, examples.target_starts, examples.target_lengths)):
    n = lengths[ids]
    begins = np.cumsum(n) - n  # of each example among all the tokens filled
    position = np.arange(begins[-1] + n[-1] if len(n) else 0) - np.repeat(begins, n)
    at = np.repeat(row_of * batch[side].shape[1] + (begins - begins[first] if plan.packed else 0),
                   n) + position  # flat index into the batch
    batch[side].flat[at] = tokens[np.repeat(starts[ids], n) + position]
    if plan.packed:
      batch[f"{side}_segmentation"].flat[at] = np.repeat(np.arange(len(ids)) - first + 1, n)
      batch[f"{side}_position"].flat[at] = position
  return batch


def lengths(examples: Encoded) -> np.ndarray:
  """The longer of each example's source and target length (EOS included). `[n]`."""
  return np.maximum(examples.source_lengths, examples.target_lengths)


def pack(source_lengths, target_lengths, order, source_len: int, target_len: int,
         open_rows: int = 16) -> list[list[int]]:
  """First-fit packing over a window of open rows: each example, taken in `order`, goes into the
  first of the last `open_rows` rows that still has room on both sides, or starts a new row.

  A window instead of one open row roughly halves the padding (e.g. 16% -> 7% on Multi30k with
  rows of 64) at a small constant cost. Returns the example ids of each row.
  """
  rows, open_ = [], collections.deque()  # open_: [source room, target room, row]
  for i, s, t in zip(order.tolist(), source_lengths[order].tolist(),
                     target_lengths[order].tolist()):
    for row in open_:
      if s <= row[0] and t <= row[1]:
        row[0] -= s
        row[1] -= t
        row[2].append(i)
        break
    else:
      row = [i]
      rows.append(row)
      open_.append([source_len - s, target_len - t, row])
      if len(open_) > open_rows:
        open_.popleft()
  return rows


def padding_fraction(batch: dict) -> float:
  """Share of padding positions in a batch, both sides together."""
  real = sum(int((batch[k] > 0).sum()) for k in ("inputs", "targets"))
  return 1.0 - real / sum(batch[k].size for k in ("inputs", "targets"))


class TrainStream:
  """Random access to train batches by step: `stream[step]` -> a dict of int32 arrays.

  batching="tokens": length buckets of width `bucket_width`; bucket b holds the examples whose
  longer side has a length in (width(b-1), width b]; a batch of bucket b is trimmed to that length
  and has as many rows as fit `tokens_per_batch` per side (padding included), rounded down to a
  multiple of `row_multiple` (the accumulation steps). Trimming is what makes short
  examples cheap. batching="packed": rows of the maximum lengths, packed greedily from a shuffled
  epoch, `tokens_per_batch // max length` rows (rounded the same way). See the module docstring.

  `plan(step)` says which examples fill which row of the global batch, from the examples'
  lengths alone; every process computes the same plan, and `batch(step, rows)` reads the tokens
  of the given rows only. Safe to use from several threads.
  """

  def __init__(self, examples: Encoded, data_config, seed: int, row_multiple: int = 1):
    self.examples = examples
    self.seed = seed
    d = data_config
    self.batching = d.batching
    self._lock = threading.Lock()
    if not len(examples):
      raise UserError("no training example fits data.max_source_len / data.max_target_len")
    if d.batching == "fixed":
      self._fixed = (grain.MapDataset.range(len(examples)).shuffle(seed=seed)
                     .repeat(None).batch(d.batch_size, drop_remainder=True))
      return
    self._fixed = None
    self._budget = d.tokens_per_batch
    if d.batching == "packed":
      self._lengths = (examples.max_source_len, examples.max_target_len)
      self._packed_rows = self._rows_that_fit(max(self._lengths), row_multiple)
    else:
      width = d.bucket_width
      self._width = width
      self._bucket = (lengths(examples) + width - 1) // width  # bucket b: lengths in (w(b-1), wb]
      self._rows = {int(b): self._rows_that_fit(int(b) * width, row_multiple)
                    for b in np.unique(self._bucket)}
    self._epoch_sizes = []  # batches in each epoch so far
    self._epoch_starts = [0]
    self._cache = collections.OrderedDict()  # epoch -> its batches; the latest two

  def _rows_that_fit(self, length: int, row_multiple: int) -> int:
    rows = self._budget // length // row_multiple * row_multiple
    if rows == 0:
      raise UserError(f"data.tokens_per_batch ({self._budget}) cannot hold one row of length "
                      f"{length} for each of {row_multiple} accumulation steps; raise it")
    return rows

  def _make_epoch(self, epoch: int) -> list:
    """The batches of one epoch: arrays of example ids (tokens) or lists of rows (packed)."""
    rng = np.random.default_rng([self.seed, epoch])
    order = rng.permutation(len(self.examples))
    if self.batching == "packed":
      rows = pack(self.examples.source_lengths, self.examples.target_lengths, order,
                  *self._lengths)
      n = self._packed_rows
      return [rows[i:i + n] for i in range(0, len(rows) - n + 1, n)]
    # The examples of each bucket in epoch order: a stable sort of the order by bucket.
    by_bucket = order[np.argsort(self._bucket[order], kind="stable")]
    buckets = self._bucket[by_bucket]
    batches = []
    for b, rows in self._rows.items():
      members = by_bucket[np.searchsorted(buckets, b):np.searchsorted(buckets, b, side="right")]
      batches += [members[i:i + rows] for i in range(0, len(members) - rows + 1, rows)]
    return [batches[i] for i in rng.permutation(len(batches))]

  def _epoch(self, epoch: int) -> list:
    with self._lock:
      if epoch not in self._cache:
        self._cache[epoch] = self._make_epoch(epoch)
        while len(self._cache) > 2:
          self._cache.popitem(last=False)
      return self._cache[epoch]

  def locate(self, step: int) -> tuple[int, int]:
    """(epoch, batch within the epoch) of a step."""
    while step >= self._epoch_starts[-1]:
      size = len(self._epoch(len(self._epoch_sizes)))
      if size == 0:
        raise UserError(f"one epoch of {len(self.examples)} training examples does not fill a "
                        f"single batch of data.tokens_per_batch={self._budget}; lower it")
      with self._lock:
        if len(self._epoch_starts) == len(self._epoch_sizes) + 1:  # not done by another thread
          self._epoch_sizes.append(size)
          self._epoch_starts.append(self._epoch_starts[-1] + size)
    epoch = int(np.searchsorted(self._epoch_starts, step, side="right")) - 1
    return epoch, step - self._epoch_starts[epoch]

  def plan(self, step: int) -> Plan:
    """Which examples fill which row of the batch of `step`."""
    if self._fixed is not None:
      ids = np.asarray(self._fixed[step], np.int64)
      return Plan(ids, np.ones(len(ids), np.int64), self.examples.max_source_len,
                  self.examples.max_target_len, packed=False)
    epoch, k = self.locate(step)
    members = self._epoch(epoch)[k]
    if self.batching == "packed":
      sizes = np.fromiter(map(len, members), np.int64, len(members))
      ids = np.fromiter(itertools.chain.from_iterable(members), np.int64, int(sizes.sum()))
      return Plan(ids, sizes, *self._lengths, packed=True)
    length = int(self._bucket[members[0]]) * self._width
    return Plan(np.asarray(members, np.int64), np.ones(len(members), np.int64),
                min(length, self.examples.max_source_len),
                min(length, self.examples.max_target_len), packed=False)

  def batch(self, step: int, rows=None) -> dict:
    """The batch of `step` with only `rows` filled (default: all); see `fill`."""
    return fill(self.examples, self.plan(step), rows)

  def __getitem__(self, step: int) -> dict:
    return self.batch(step)


@dataclasses.dataclass
class Batch:
  """One step's batch as `batches` delivers it."""

  step: int
  data: Any  # the arrays, as `place` made them
  tokens: int  # non-padding tokens of the whole global batch, both sides
  shape: tuple  # (rows, source length, target length) of the global batch


def batches(stream: TrainStream, start: int, stop: int,
            rows_for: Optional[Callable[[int], np.ndarray]] = None,
            place: Optional[Callable[[dict], Any]] = None, prefetch: int = 2):
  """An iterator of `Batch`es for the steps start, ..., stop - 1, made ahead in the background.

  Each step's batch is `stream.batch(step, rows_for(rows))` (rows_for: this process's rows of a
  global batch of `rows` rows; None: all), passed through `place` (e.g. onto the devices). A
  background thread (grain's) makes up to `prefetch` batches ahead (0: each one when asked, on
  the calling thread). An exception raised making a batch is raised by `next()` for that step.
  `close()` the iterator when done (`contextlib.closing`): it stops and joins the thread.
  Prefetching changes nothing but timing: batch k is still `stream`'s batch of step k.
  """

  def make(step: int) -> Batch:
    plan = stream.plan(step)
    rows = None if rows_for is None else rows_for(plan.rows)
    data = fill(stream.examples, plan, rows)
    return Batch(step=step, data=place(data) if place else data,
                 tokens=plan.tokens(stream.examples),
                 shape=(plan.rows, plan.source_len, plan.target_len))

  dataset = grain.MapDataset.range(start, stop).map(make).to_iter_dataset(
      grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))  # in order, on the caller
  if prefetch:
    dataset = grain.experimental.ThreadPrefetchIterDataset(dataset,
                                                           prefetch_buffer_size=prefetch)
  return iter(dataset)


def eval_batches(examples: Encoded, batch_size: int):
  """Ordered batches covering every example once; the last one is padded with empty rows.

  Yields (batch, n_real): rows past n_real are all padding and carry zero loss weight.
  """
  for start in range(0, len(examples), batch_size):
    rows = np.arange(start, min(start + batch_size, len(examples)))
    batch = examples.rows(rows)
    n_real = len(rows)
    if n_real < batch_size:
      batch = {k: np.pad(v, ((0, batch_size - n_real), (0, 0))) for k, v in batch.items()}
    yield batch, n_real
