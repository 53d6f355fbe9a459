"""SentencePiece tokenizer: trained on the fly from the training text, or loaded from a .model file.

Ids: 0 = padding, 1 = BOS, 2 = EOS, 3 = unknown. Source and target share one vocabulary (joint
BPE by default, trained on a random sample of both sides of the training split).

A model imported from Hugging Face (`tools/hf`) keeps its own tokenizer instead: `HFTokenizer`
reads any `tokenizer.json` (GPT-2's byte-level BPE, BERT's WordPiece, ...) with the `tokenizers`
library, or Marian's SentencePiece models and vocabulary (source.spm, target.spm, vocab.json)
with SentencePiece, through the map between its ids and ours that the import wrote
(`HF_FILENAME`).
"""

from __future__ import annotations

import base64
import io
import json
import os
from typing import Iterable, Iterator, Sequence

import numpy as np
import sentencepiece as spm

from transformer_jax.core import files, storage
from transformer_jax.core.errors import UserError
from transformer_jax.core.tokens import (  # noqa: F401 (re-exported)
  BOS_ID,
  EOS_ID,
  MASK_ID,
  MASK_PIECE,
  PAD_ID,
  UNK_ID,
)
from transformer_jax.data import sources

FILENAME = "tokenizer.model"
HF_FILENAME = "tokenizer_hf.json"  # an imported model's: its tokenizer.json and the id map


class Tokenizer:
  """A thin wrapper over a SentencePiece processor with the project's special ids."""

  def __init__(self, model_proto: bytes, name: str = "the SentencePiece model",
               fix: str = "fix data.tokenizer.model_path"):
    """name, fix: how messages name the model (its file) and what to do about a bad one."""
    self.model_proto = model_proto
    if not model_proto:
      raise UserError(f"{name} is empty; {fix}")
    try:
      self._sp = spm.SentencePieceProcessor(model_proto=model_proto)
    except (RuntimeError, TypeError, ValueError):  # sentencepiece's "ParseFromArray" failure
      raise UserError(f"{name} is not a SentencePiece model (its {len(model_proto)} bytes do not "
                      f"parse); {fix}") from None
    if (self._sp.pad_id(), self._sp.bos_id(), self._sp.eos_id()) != (PAD_ID, BOS_ID, EOS_ID):
      raise UserError(f"{name} must use pad=0, bos=1, eos=2 (train it with --pad_id=0 "
                      "--bos_id=1 --eos_id=2 --unk_id=3)")

  @property
  def vocab_size(self) -> int:
    return self._sp.get_piece_size()

  prompt_bos = True  # a prompt of a decoder-only model starts with BOS
  filename = FILENAME  # its file in a workdir

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

  def has_mask(self) -> bool:
    """Whether MASK_ID is the <mask> piece (the tokenizers of encoder-only tasks)."""
    return self.vocab_size > MASK_ID and self._sp.id_to_piece(MASK_ID) == MASK_PIECE


def training_texts(pairs, sample_size: int, seed: int = 0) -> Iterator[str]:
  """Source and target sentences of a random sample of at most `sample_size` / 2 pairs.

  Lazy: nothing is read until the tokenizer is actually trained (not on resume). Sampling by
  index reads only the sample from a large corpus instead of the whole split.
  """
  n = len(pairs)
  count = min(n, max(1, sample_size // 2))
  indices = np.arange(n) if count == n else np.sort(
      np.random.default_rng(seed).choice(n, count, replace=False))
  for start in range(0, len(indices), 10_000):
    for source, target in sources.gather(pairs, indices[start:start + 10_000]):
      yield from (text for text in (source, target) if text)  # a text dataset has no target


def train(texts: Iterable[str], vocab_size: int, model_type: str = "bpe",
          character_coverage: float = 1.0, sample_size: int = 1_000_000,
          mask: bool = False) -> Tokenizer:
  """Trains a SentencePiece model in memory; `mask` adds the <mask> piece as MASK_ID."""
  proto = io.BytesIO()
  try:
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_writer=proto, vocab_size=vocab_size,
        model_type=model_type, character_coverage=character_coverage,
        input_sentence_size=sample_size, shuffle_input_sentence=True,
        pad_id=PAD_ID, bos_id=BOS_ID, eos_id=EOS_ID, unk_id=UNK_ID,
        user_defined_symbols=[MASK_PIECE] if mask else [],
        hard_vocab_limit=model_type != "word", minloglevel=2)
  except RuntimeError as e:  # e.g. "Vocabulary size is too high (10000). Please set it to <= 4046."
    message = (str(e).strip().splitlines() or [type(e).__name__])[-1].rsplit("] ", 1)[-1]
    fix = ("lower model.vocab_size or raise data.tokenizer.sample_size"
           if "too high" in message else "raise model.vocab_size")
    raise UserError(f"SentencePiece cannot train a {model_type} vocabulary of {vocab_size} pieces "
                    f"on this text ({message}); {fix}") from None
  return Tokenizer(proto.getvalue())


def load(path: str, fix: str = "fix data.tokenizer.model_path") -> Tokenizer:
  """The tokenizer in the SentencePiece .model file `path`; `fix` ends the message of a bad one."""
  if storage.is_url(path):  # a workdir in a bucket
    try:
      return Tokenizer(storage.read_bytes(path), f"tokenizer model {path}", fix)
    except FileNotFoundError:
      raise UserError(f"{path} does not exist; {fix}") from None
  files.check_readable(path, fix)
  with open(path, "rb") as f:
    return Tokenizer(f.read(), f"tokenizer model {path}", fix)


class _TokenizersModel:
  """Their ids of texts and texts of their ids, by a `tokenizer.json` (the tokenizers library)."""

  def __init__(self, text: str):
    from tokenizers import Tokenizer as HFTokenizerModel
    self._tokenizer = HFTokenizerModel.from_str(text)

  def encode(self, texts: list, target: bool) -> list:
    del target  # one tokenizer for both sides
    return [e.ids for e in self._tokenizer.encode_batch(texts, add_special_tokens=False)]

  def decode(self, ids: list) -> str:
    return self._tokenizer.decode(ids, skip_special_tokens=True)

  def id_to_token(self, i: int) -> str:
    return self._tokenizer.id_to_token(i)

  def token_to_id(self, token: str):
    return self._tokenizer.token_to_id(token)


def spm_processor(proto: bytes) -> spm.SentencePieceProcessor:
  """A SentencePiece processor of a serialised model; ValueError when it does not parse."""
  try:
    return spm.SentencePieceProcessor(model_proto=proto)
  except (RuntimeError, TypeError) as e:
    raise ValueError(f"not a SentencePiece model ({e})") from None


class _MarianModel:
  """Marian's tokenizer (transformers' MarianTokenizer): the source text's pieces by source.spm,
  the target's by target.spm, each piece's id in vocab.json (<unk>'s when it has none); a leading
  language code such as ">>de<<" is one token. Text back from the target model's pieces.
  T5's is the same with one model for both sides and no language codes."""

  def __init__(self, record: dict):
    self._source = spm_processor(base64.b64decode(record["source"]))
    self._target = spm_processor(base64.b64decode(record["target"]))
    self._vocab = {str(k): int(v) for k, v in record["vocab"].items()}
    self._pieces = {v: k for k, v in self._vocab.items()}
    self._unk = self._vocab[record["unk"]]
    self._specials = set(record["specials"])
    self._language_codes = record.get("language_codes", True)

  def _ids(self, text: str, processor) -> list:
    code = []
    if self._language_codes and text.startswith(">>") and text.find("<<") != -1:
      end = text.find("<<") + 2
      code, text = [text[:end]], text[end:]
    pieces = code + processor.encode(text, out_type=str)
    return [self._vocab.get(piece, self._unk) for piece in pieces]

  def encode(self, texts: list, target: bool) -> list:
    processor = self._target if target else self._source
    return [self._ids(text, processor) for text in texts]

  def decode(self, ids: list) -> str:
    pieces = [self._pieces[i] for i in ids if i in self._pieces and i not in self._specials]
    return self._target.decode_pieces(pieces).replace("\u2581", " ").strip()

  def id_to_token(self, i: int):
    return self._pieces.get(i)

  def token_to_id(self, token: str):
    return self._vocab.get(token)


class HFTokenizer:
  """A Hugging Face tokenizer read through an imported model's id map: the same interface as
  `Tokenizer`, the same ids (0 pad, 1 BOS, 2 EOS, ...) on our side.

  The file (`HF_FILENAME`, JSON): "tokenizer" (their tokenizer.json, as a string) or
  "sentencepiece" (Marian's: {"source", "target": the .spm files in base64, "vocab": their
  vocab.json, "unk": its unknown token, "specials": the ids of its special tokens,
  "language_codes": false for T5's, whose texts have none}), "hf_ids"
  (per our id, their id; -1: a token of ours only, e.g. GPT-2's padding), "our_ids" (per their
  id, ours), "add_bos" (whether the model reads a text after a BOS: BERT's [CLS]; GPT-2 none),
  "prompt_bos" (a decoder-only model's: whether a prompt starts with BOS, as Llama's does; absent:
  add_bos), "special_tokens" ({our special: their token}).
  """

  def __init__(self, data: bytes, name: str = "the imported tokenizer",
               fix: str = "import the model again with --mode=import_hf"):
    self.model_proto = data  # what the checkpoints' tokenizer sha256 is taken of
    try:
      record = json.loads(data)
      if "sentencepiece" in record:
        self._tokenizer = _MarianModel(record["sentencepiece"])
      else:
        self._tokenizer = _TokenizersModel(record["tokenizer"])
      self.hf_ids = np.asarray(record["hf_ids"], np.int64)
      self.our_ids = np.asarray(record["our_ids"], np.int64)
      self.add_bos = bool(record["add_bos"])
      self._prompt_bos = bool(record.get("prompt_bos", self.add_bos))
      self.special_tokens = dict(record.get("special_tokens", {}))
    except ImportError:
      raise UserError(f"{name} needs the tokenizers library; install the hf extra "
                      "(pip install 'transformer_jax[hf]')") from None
    except Exception as e:  # any damage: JSON, a missing key, a tokenizer that does not parse
      raise UserError(f"{name} does not read ({type(e).__name__}: {str(e)[:80]}); {fix}") from None

  @property
  def vocab_size(self) -> int:
    return len(self.hf_ids)

  filename = HF_FILENAME

  @property
  def prompt_bos(self) -> bool:
    """Whether a prompt starts with BOS: GPT-2's tokenizer adds none, so neither do we;
    Llama's adds <s> (our BOS, which the pipeline also puts before every training text)."""
    return self._prompt_bos

  def encode(self, texts: Sequence[str], target: bool = False) -> list[list[int]]:
    """Our ids of each text as the model reads it, but for the EOS that our pipeline appends:
    BERT's "[CLS] text" ([SEP] = our EOS follows), GPT-2's, Llama's and Marian's text alone (BOS
    before a decoder-only model's text is the pipeline's); "" gives [].
    target: the text is a target (Marian has a SentencePiece model for each side)."""
    texts = list(texts)
    encodings = self._tokenizer.encode(texts, target)
    start = [BOS_ID] if self.add_bos else []
    # An empty text stays empty: the pipeline's "no such side" (a text task's other side).
    return [start + self.our_ids[np.asarray(ids, np.int64)].tolist() if text else []
            for text, ids in zip(texts, encodings)]

  def decode(self, ids: Iterable[int]) -> str:
    """Text of one id sequence; stops at the first EOS, skips padding, BOS and our own tokens."""
    kept = []
    for i in np.asarray(ids).tolist():
      if i == EOS_ID:
        break
      if i not in (PAD_ID, BOS_ID) and 0 <= i < len(self.hf_ids) and self.hf_ids[i] >= 0:
        kept.append(int(self.hf_ids[i]))
    return self._tokenizer.decode(kept)

  def pieces(self, ids: Iterable[int]) -> list[str]:
    """Their token of each id; "<pad>" for a row of ours only (GPT-2's padding)."""
    return [self._tokenizer.id_to_token(int(self.hf_ids[int(i)])) if self.hf_ids[int(i)] >= 0
            else "<pad>" for i in ids]

  def has_mask(self) -> bool:
    """Whether MASK_ID is the model's mask token (BERT's [MASK])."""
    return (self.vocab_size > MASK_ID and "mask" in self.special_tokens
            and self.hf_ids[MASK_ID] == self._tokenizer.token_to_id(self.special_tokens["mask"]))


def load_workdir(workdir: str, fix: str):
  """The tokenizer of a workdir (a local path or a bucket URL): its SentencePiece model
  (FILENAME) or, for an imported model, its Hugging Face tokenizer (HF_FILENAME). None when it
  has neither."""
  local = not storage.is_url(workdir)
  present = (lambda path: os.path.lexists(path)) if local else storage.exists
  model_path, hf_path = storage.join(workdir, FILENAME), storage.join(workdir, HF_FILENAME)
  if not present(model_path) and present(hf_path):
    if local:
      files.check_readable(hf_path, fix)
    return HFTokenizer(storage.read_bytes(hf_path), f"tokenizer {hf_path}", fix)
  if present(model_path):
    return load(model_path, fix)
  return None
