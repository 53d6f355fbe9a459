"""Tokenised, fixed-shape batches: a deterministic train stream and ordered eval batches.

Batch `k` of the train stream depends only on (seed, k): the stream is a grain MapDataset
(shuffle per epoch -> repeat -> batch), indexed by step, so a resumed run gets exactly the batch
that would have come next.
"""

from __future__ import annotations

import dataclasses

import grain
import numpy as np

from transformer_jax.data.tokenizer import EOS_ID, Tokenizer
from transformer_jax.errors import UserError


@dataclasses.dataclass
class Encoded:
  """Examples as padded int32 arrays; `index` maps each row back to its position in the split."""

  inputs: np.ndarray  # [n, max_source_len]
  targets: np.ndarray  # [n, max_target_len], EOS-terminated
  index: np.ndarray  # [n]
  dropped: int  # examples longer than the limits

  def __len__(self):
    return len(self.index)

  def rows(self, rows) -> dict:
    return {"inputs": self.inputs[rows], "targets": self.targets[rows]}


def _pad(sequences, length):
  out = np.zeros((len(sequences), length), np.int32)
  for i, s in enumerate(sequences):
    out[i, : len(s)] = s
  return out


def encode(pairs, tokenizer: Tokenizer, max_source_len: int, max_target_len: int) -> Encoded:
  """Tokenises pairs, appends EOS to both sides, drops pairs that do not fit the limits."""
  sources = tokenizer.encode([s for s, _ in pairs])
  targets = tokenizer.encode([t for _, t in pairs])
  keep = [i for i, (s, t) in enumerate(zip(sources, targets))
          if len(s) + 1 <= max_source_len and len(t) + 1 <= max_target_len]
  return Encoded(
      inputs=_pad([sources[i] + [EOS_ID] for i in keep], max_source_len),
      targets=_pad([targets[i] + [EOS_ID] for i in keep], max_target_len),
      index=np.asarray(keep, np.int64), dropped=len(pairs) - len(keep))


def lengths(examples: Encoded) -> np.ndarray:
  """The longer of each example's source and target length (EOS included). `[n]`."""
  return np.maximum((examples.inputs > 0).sum(1), (examples.targets > 0).sum(1))


class TrainStream:
  """Random access to train batches by step: `stream[step]` -> {"inputs", "targets"}.

  batching="fixed": `batch_size` examples per batch, padded to the configured maximum lengths.
  batching="tokens": length buckets of width `bucket_width`; each batch holds examples of one
  bucket, trimmed to the bucket's length, and as many rows as fit `tokens_per_batch` (counted on
  the longer side, padding included), rounded down to a multiple of `row_multiple` (devices times
  accumulation steps). Trimming the padding is what makes short examples cheap.
  """

  def __init__(self, examples: Encoded, data_config, seed: int, row_multiple: int = 1):
    self.examples = examples
    self.seed = seed
    d = data_config
    if d.batching == "fixed":
      self._fixed = (grain.MapDataset.range(len(examples)).shuffle(seed=seed)
                     .repeat(None).batch(d.batch_size, drop_remainder=True))
      return
    self._fixed = None
    width = d.bucket_width
    self._bucket = (lengths(examples) + width - 1) // width  # bucket b holds lengths in (w(b-1), wb]
    self._rows = {}
    for b in np.unique(self._bucket):
      rows = d.tokens_per_batch // (int(b) * width) // row_multiple * row_multiple
      if rows == 0:
        raise UserError(f"data.tokens_per_batch ({d.tokens_per_batch}) cannot hold one example "
                        f"of length {int(b) * width} per device; raise it")
      self._rows[int(b)] = rows
    self._width = width
    self._epochs = []  # batches (row index arrays) of each epoch, made on demand
    self._epoch_starts = [0]

  def _epoch(self, epoch: int) -> list:
    """The batches of one epoch: shuffled within buckets, then the batch order shuffled."""
    rng = np.random.default_rng([self.seed, epoch])
    order = rng.permutation(len(self.examples))
    batches = []
    for b, rows in self._rows.items():
      members = order[self._bucket[order] == b]
      batches += [members[i:i + rows] for i in range(0, len(members) - rows + 1, rows)]
    return [batches[i] for i in rng.permutation(len(batches))]

  def __getitem__(self, step: int) -> dict:
    if self._fixed is not None:
      return self.examples.rows(self._fixed[step])
    while step >= self._epoch_starts[-1]:
      self._epochs.append(self._epoch(len(self._epochs)))
      self._epoch_starts.append(self._epoch_starts[-1] + len(self._epochs[-1]))
    epoch = int(np.searchsorted(self._epoch_starts, step, side="right")) - 1
    rows = self._epochs[epoch][step - self._epoch_starts[epoch]]
    batch = self.examples.rows(rows)
    length = int(self._bucket[rows[0]]) * self._width
    return {k: v[:, :length] for k, v in batch.items()}


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
