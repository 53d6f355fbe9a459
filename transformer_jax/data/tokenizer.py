"""SentencePiece tokenizer: trained on the fly from the training text, or loaded from a .model file.

Ids: 0 = padding, 1 = BOS, 2 = EOS, 3 = unknown. Source and target share one vocabulary.
"""

from __future__ import annotations

import io
import os
from typing import Iterable, Sequence

import numpy as np
import sentencepiece as spm

from transformer_jax.errors import UserError

PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
FILENAME = "tokenizer.model"


class Tokenizer:
  """A thin wrapper over a SentencePiece processor with the project's special ids."""

  def __init__(self, model_proto: bytes):
    self.model_proto = model_proto
    self._sp = spm.SentencePieceProcessor(model_proto=model_proto)
    if (self._sp.pad_id(), self._sp.bos_id(), self._sp.eos_id()) != (PAD_ID, BOS_ID, EOS_ID):
      raise UserError("the SentencePiece model must use pad=0, bos=1, eos=2 (train it with "
                      "--pad_id=0 --bos_id=1 --eos_id=2 --unk_id=3)")

  @property
  def vocab_size(self) -> int:
    return self._sp.get_piece_size()

  def encode(self, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of each text, without BOS/EOS."""
    return self._sp.encode(list(texts))

  def decode(self, ids: Iterable[int]) -> str:
    """Text of one id sequence; stops at the first EOS, skips padding."""
    kept = []
    for i in np.asarray(ids).tolist():
      if i == EOS_ID:
        break
      if i not in (PAD_ID, BOS_ID):
        kept.append(i)
    return self._sp.decode(kept)

  def pieces(self, ids: Iterable[int]) -> list[str]:
    return [self._sp.id_to_piece(int(i)) for i in ids]


def train(texts: Iterable[str], vocab_size: int, model_type: str = "bpe",
          character_coverage: float = 1.0, sample_size: int = 1_000_000) -> Tokenizer:
  """Trains a SentencePiece model in memory."""
  proto = io.BytesIO()
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(texts), model_writer=proto, vocab_size=vocab_size,
      model_type=model_type, character_coverage=character_coverage,
      input_sentence_size=sample_size, shuffle_input_sentence=True,
      pad_id=PAD_ID, bos_id=BOS_ID, eos_id=EOS_ID, unk_id=UNK_ID,
      hard_vocab_limit=model_type != "word", minloglevel=2)
  return Tokenizer(proto.getvalue())


def load(path: str) -> Tokenizer:
  if not os.path.isfile(path):
    raise UserError(f"tokenizer model {path} does not exist; fix data.tokenizer.model_path")
  with open(path, "rb") as f:
    return Tokenizer(f.read())


def load_or_train(tokenizer_config, workdir: str, texts: Iterable[str], vocab_size: int) -> Tokenizer:
  """The workdir's tokenizer if it has one (resume), else a given .model, else a newly trained one.

  A new tokenizer is written into the workdir once, so a resumed run reuses the same ids.
  """
  path = os.path.join(workdir, FILENAME)
  if os.path.exists(path):
    return load(path)
  if tokenizer_config.model_path:
    tokenizer = load(tokenizer_config.model_path)
  else:
    tokenizer = train(texts, vocab_size, tokenizer_config.model_type,
                      tokenizer_config.character_coverage, tokenizer_config.sample_size)
  if tokenizer.vocab_size > vocab_size:
    raise UserError(f"the tokenizer has {tokenizer.vocab_size} pieces but model.vocab_size is "
                    f"{vocab_size}; raise model.vocab_size")
  tmp = path + ".tmp"
  with open(tmp, "wb") as f:
    f.write(tokenizer.model_proto)
  os.replace(tmp, path)
  return tokenizer
