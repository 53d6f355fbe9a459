"""Data: sources (SCAN, ...), the SentencePiece tokenizer, and batching."""

from __future__ import annotations

import sys

from transformer_jax.data.sources import load_split


def export_split(config, split: str, out=sys.stdout) -> None:
  """Writes a split as `source<TAB>target` lines."""
  for source, target in load_split(config.data, split):
    out.write(f"{source}\t{target}\n")
