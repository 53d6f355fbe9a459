"""Dataset sources behind one interface: a split name -> a random-access sequence of
(source_text, target_text) pairs (any object with __len__ and __getitem__, as grain expects)."""

from __future__ import annotations

from typing import Sequence

from transformer_jax.data import scan
from transformer_jax.errors import UserError

Pairs = Sequence[tuple[str, str]]


def load_split(data_config, split: str) -> Pairs:
  """The pairs of one split of the configured source."""
  if data_config.source == "scan":
    if split not in ("train", "test"):
      raise UserError(f"SCAN has the splits train and test, not {split!r}")
    return scan.load(data_config.scan_split, split)
  raise UserError(f"data.source={data_config.source!r} is not available yet; use data.source=scan")
