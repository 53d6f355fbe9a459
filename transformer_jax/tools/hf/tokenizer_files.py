"""Their tokenizer's files in and out: `read` (a Hugging Face model directory's tokenizer ->
the record our `data.tokenizer.HFTokenizer` reads) and `write` (our tokenizer -> the files
`transformers` loads), by the architecture's kind of tokenizer (`Architecture.tokenizer`):
tokenizer.json (the tokenizers library), Marian's two SentencePiece models and vocab.json, or
T5's spiece.model with its sentinels.
"""

from __future__ import annotations

import base64
import json
import os

from transformer_jax.core import files
from transformer_jax.core.errors import UserError
from transformer_jax.core.tokens import BOS_ID, EOS_ID, PAD_ID
from transformer_jax.data import tokenizer as tokenizer_lib
from transformer_jax.tools.hf import checks
from transformer_jax.tools.hf.architectures import Vocab

CONFIG = "config.json"
TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
# Marian's tokenizer: a SentencePiece model for each side and the vocabulary of both.
SOURCE_SPM, TARGET_SPM, VOCAB_JSON = "source.spm", "target.spm", "vocab.json"
SPIECE = "spiece.model"  # T5's SentencePiece model


# ----------------------------------------------------------------------------- reading theirs


def _special_tokens(arch, hf_dir: str) -> dict:
  """{our special: their token}: the architecture's defaults, then tokenizer_config.json's."""
  tokens = dict(arch.special_tokens)
  path = os.path.join(hf_dir, TOKENIZER_CONFIG)
  if os.path.isfile(path):
    saved = checks.read_json(path, "the tokenizer")
    names = {"pad": ("pad_token",), "bos": ("cls_token", "bos_token"),
             "eos": ("sep_token", "eos_token"), "unk": ("unk_token",), "mask": ("mask_token",)}
    for ours, theirs in names.items():
      for name in theirs:
        value = saved.get(name)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str) and ours in tokens:
          tokens[ours] = value
          break
  return tokens


def _configured_ids(ids: dict, tokens: dict, hf_config: dict, hf_vocab_size: int, id_to_token):
  """The specials that the tokenizer lacks, from config.json's pad/bos/eos_token_id."""
  for name in ("pad", "bos", "eos"):
    configured = hf_config.get(f"{name}_token_id")
    if ids.get(name) is None and isinstance(configured, int) and 0 <= configured < hf_vocab_size:
      ids[name] = configured
      tokens[name] = id_to_token(configured)
  return {k: v for k, v in tokens.items() if ids.get(k) is not None and v}, ids


def _read_marian(arch, hf_dir: str, hf_vocab_size: int, hf_config: dict):
  """({"sentencepiece": ...}, {our special: their token}, {our special: their id}) of Marian's
  source.spm, target.spm and vocab.json. Our BOS is their decoder_start_token_id (their pad)."""
  missing = [name for name in (SOURCE_SPM, TARGET_SPM, VOCAB_JSON)
             if not os.path.isfile(os.path.join(hf_dir, name))]
  if missing:
    raise UserError(f"{hf_dir} holds no {missing[0]}; save the model's tokenizer there too "
                    "(MarianTokenizer.from_pretrained(...).save_pretrained(DIR), or download "
                    f"{SOURCE_SPM}, {TARGET_SPM} and {VOCAB_JSON})")
  saved = {}
  if os.path.isfile(os.path.join(hf_dir, TOKENIZER_CONFIG)):
    saved = checks.read_json(os.path.join(hf_dir, TOKENIZER_CONFIG), "the tokenizer")
  if saved.get("separate_vocabs"):
    raise UserError(f"{hf_dir} is a Marian model with separate source and target vocabularies "
                    "(separate_vocabs), which this project's one vocabulary cannot express; "
                    "import a model with one vocab.json")
  vocab_path = os.path.join(hf_dir, VOCAB_JSON)
  vocab = checks.read_json(vocab_path, "the tokenizer")
  if not all(isinstance(v, int) and 0 <= v < hf_vocab_size for v in vocab.values()):
    raise UserError(f"{vocab_path} maps a piece to an id outside the model's vocab_size "
                    f"{hf_vocab_size}; the tokenizer belongs to another model")
  models = {}
  for name in (SOURCE_SPM, TARGET_SPM):
    models[name] = checks.read_bytes(os.path.join(hf_dir, name), "the tokenizer")
    try:
      tokenizer_lib.spm_processor(models[name])
    except ValueError:
      raise UserError(f"{os.path.join(hf_dir, name)} is not a SentencePiece model; download the "
                      "tokenizer again") from None
  tokens = dict(arch.special_tokens)
  for name in tokens:
    value = saved.get(f"{name}_token")
    value = value.get("content") if isinstance(value, dict) else value
    if isinstance(value, str):
      tokens[name] = value
  if tokens["unk"] not in vocab:
    raise UserError(f"{vocab_path} lacks the unknown token {tokens['unk']!r}; download the "
                    "tokenizer again")
  ids = {name: vocab.get(token) for name, token in tokens.items()}
  start = hf_config.get("decoder_start_token_id", ids.get("pad"))
  if isinstance(start, int) and 0 <= start < hf_vocab_size:
    ids["bos"] = start
  pieces = {v: k for k, v in vocab.items()}
  tokens, ids = _configured_ids(ids, tokens, hf_config, hf_vocab_size, pieces.get)
  tokens.setdefault("bos", pieces.get(ids.get("bos")))
  record = {"source": base64.b64encode(models[SOURCE_SPM]).decode(),
            "target": base64.b64encode(models[TARGET_SPM]).decode(), "vocab": vocab,
            "unk": tokens["unk"], "specials": sorted({v for v in ids.values() if v is not None})}
  return {"sentencepiece": record}, tokens, ids


def _read_t5(arch, hf_dir: str, hf_vocab_size: int, hf_config: dict):
  """T5's tokenizer: spiece.model (its pieces' ids are T5's) and the sentinels <extra_id_0>, ...
  after them, the last id being <extra_id_0> (tokenizer_config.json's extra_ids, 100 by default),
  read through our SentencePiece wrapper; without spiece.model, tokenizer.json (what
  transformers 5 saves). Our BOS is their decoder_start_token_id (their <pad>)."""
  path = os.path.join(hf_dir, SPIECE)
  if not os.path.isfile(path):
    if not os.path.isfile(os.path.join(hf_dir, TOKENIZER)):
      raise UserError(f"{hf_dir} holds no {SPIECE} (nor {TOKENIZER}); save the model's tokenizer "
                      "there too (AutoTokenizer.from_pretrained(...).save_pretrained(DIR), or "
                      f"download {SPIECE})")
    record, tokens, ids = _read_tokenizer_json(arch, hf_dir, hf_vocab_size, hf_config)
  else:
    proto = checks.read_bytes(path, "the tokenizer")
    try:
      processor = tokenizer_lib.spm_processor(proto)
    except ValueError:
      raise UserError(f"{path} is not a SentencePiece model; download the tokenizer again") \
          from None
    saved = {}
    if os.path.isfile(os.path.join(hf_dir, TOKENIZER_CONFIG)):
      saved = checks.read_json(os.path.join(hf_dir, TOKENIZER_CONFIG), "the tokenizer")
    size = processor.get_piece_size()
    extra = saved.get("extra_ids", 100)
    if not isinstance(extra, int) or extra < 0 or size + extra > hf_vocab_size:
      raise UserError(f"{path} has {size} pieces, which with extra_ids={extra!r} sentinels "
                      f"exceed the model's vocab_size {hf_vocab_size}; the tokenizer belongs to "
                      "another model")
    vocab = {processor.id_to_piece(i): i for i in range(size)}
    vocab.update({f"<extra_id_{i}>": size + extra - 1 - i for i in range(extra)})
    tokens = _special_tokens(arch, hf_dir)
    missing = [token for token in tokens.values() if token not in vocab]
    if missing:
      raise UserError(f"{path} lacks the special token {missing[0]!r}; download the tokenizer "
                      "again")
    ids = {name: vocab[token] for name, token in tokens.items()}
    record = {"sentencepiece": {
        "source": base64.b64encode(proto).decode(), "target": base64.b64encode(proto).decode(),
        "vocab": vocab, "unk": tokens["unk"], "language_codes": False,
        "specials": sorted(set(ids.values()) | set(range(size, size + extra)))}}
  start = hf_config.get("decoder_start_token_id", ids.get("pad"))
  if not isinstance(start, int) or not 0 <= start < hf_vocab_size:
    raise UserError(f"{os.path.join(hf_dir, CONFIG)} has decoder_start_token_id={start!r}, not "
                    "a token of the model; set it to the pad token's id (0), as T5's")
  ids["bos"] = start
  tokens["bos"] = tokens.get("pad") if start == ids.get("pad") else f"<id {start}>"
  return record, tokens, ids


def _read_tokenizer_json(arch, hf_dir: str, hf_vocab_size: int, hf_config: dict):
  """({"tokenizer": their tokenizer.json text}, {our special: their token}, {our special: their
  id}): the ids of the special tokens in the tokenizer, else config.json's pad/bos/eos_token_id."""
  path = os.path.join(hf_dir, TOKENIZER)
  if not os.path.isfile(path):
    raise UserError(f"{hf_dir} holds no {TOKENIZER}; save the model's tokenizer there too "
                    "(AutoTokenizer.from_pretrained(...).save_pretrained(DIR), or download it)")
  try:
    from tokenizers import Tokenizer
  except ImportError:
    raise UserError("importing a Hugging Face model needs its libraries; install the hf extra "
                    "(pip install 'transformer_jax[hf]')") from None
  text = checks.read_text(path, "the tokenizer")
  try:
    tokenizer = Tokenizer.from_str(text)
  except Exception as e:  # the tokenizers library's own exception type
    raise UserError(f"{path} does not load with the tokenizers library ({e}); download the "
                    "tokenizer again") from None
  if tokenizer.get_vocab_size() > hf_vocab_size:
    raise UserError(f"{path} has {tokenizer.get_vocab_size()} tokens, more than the model's "
                    f"vocab_size {hf_vocab_size}; the tokenizer belongs to another model")
  tokens = _special_tokens(arch, hf_dir)
  ids = {name: tokenizer.token_to_id(token) for name, token in tokens.items()}
  tokens, ids = _configured_ids(ids, tokens, hf_config, hf_vocab_size, tokenizer.id_to_token)
  return {"tokenizer": text}, tokens, ids


# The reader of each kind of tokenizer (Architecture.tokenizer).
READERS = {"tokenizers": _read_tokenizer_json, "sentencepiece": _read_marian, "t5": _read_t5}


def read(arch, hf_dir: str, hf_vocab_size: int, hf_config: dict):
  """(the record of their tokenizer, {our special: their token}, {our special: their id}) of
  the tokenizer in `hf_dir`, read as its architecture keeps it; refuses one that does not fit."""
  return READERS[arch.tokenizer](arch, hf_dir, hf_vocab_size, hf_config)



# ----------------------------------------------------------------------------- writing theirs


def _write_marian(hf_dir: str, tokenizer, vocab: Vocab, special_ids: dict,
                            max_len: int) -> list:
  """source.spm, target.spm, vocab.json and tokenizer_config.json, as MarianTokenizer saves
  them: the imported model's own, or our SentencePiece model for both sides."""
  if isinstance(tokenizer, tokenizer_lib.HFTokenizer):
    record = json.loads(tokenizer.model_proto)["sentencepiece"]
    source, target = base64.b64decode(record["source"]), base64.b64decode(record["target"])
    pieces = record["vocab"]
    tokens = {name: tokenizer.special_tokens.get(name) for name in ("pad", "eos", "unk")}
  else:
    source = target = tokenizer.model_proto
    pieces = {piece: int(vocab.hf_ids[i]) for i, piece in
              enumerate(tokenizer.pieces(range(tokenizer.vocab_size)))}
    # Rows of the model beyond the tokenizer's pieces get names of their own, so that every id
    # has a token (CTranslate2 reads the vocabulary as the list of tokens by id).
    pieces.update({f"<unused{i}>": int(vocab.hf_ids[i])
                   for i in range(tokenizer.vocab_size, len(vocab.hf_ids))})
    tokens = {name: tokenizer.pieces([i])[0] for name, i in
              (("pad", PAD_ID), ("eos", EOS_ID), ("unk", 3))}
  files.atomic_write(os.path.join(hf_dir, SOURCE_SPM), source)
  files.atomic_write(os.path.join(hf_dir, TARGET_SPM), target)
  files.atomic_write(os.path.join(hf_dir, VOCAB_JSON), json.dumps(pieces, ensure_ascii=False))
  tokenizer_config = {f"{k}_token": v for k, v in tokens.items() if v}
  tokenizer_config.update(tokenizer_class="MarianTokenizer", model_max_length=max_len,
                          separate_vocabs=False)
  files.atomic_write(os.path.join(hf_dir, TOKENIZER_CONFIG),
                     json.dumps(tokenizer_config, indent=2))
  return [SOURCE_SPM, TARGET_SPM, VOCAB_JSON, TOKENIZER_CONFIG]


def _write_t5(hf_dir: str, tokenizer, max_len: int) -> list:
  """spiece.model and tokenizer_config.json (T5Tokenizer with its sentinels) of an imported T5
  whose tokenizer came from its spiece.model."""
  record = json.loads(tokenizer.model_proto)["sentencepiece"]
  files.atomic_write(os.path.join(hf_dir, SPIECE), base64.b64decode(record["source"]))
  tokenizer_config = {f"{name}_token": tokenizer.special_tokens[name]
                      for name in ("pad", "eos", "unk") if name in tokenizer.special_tokens}
  tokenizer_config.update(
      tokenizer_class="T5Tokenizer", model_max_length=max_len,
      extra_ids=sum(piece.startswith("<extra_id_") for piece in record["vocab"]))
  files.atomic_write(os.path.join(hf_dir, TOKENIZER_CONFIG),
                     json.dumps(tokenizer_config, indent=2))
  return [SPIECE, TOKENIZER_CONFIG]



def _write_tokenizer_json(hf_dir: str, arch, tokenizer, max_len: int) -> list:
  """tokenizer.json and tokenizer_config.json of an imported tokenizer.json, its special tokens
  under the names the architecture gives them (Architecture.token_names)."""
  record = json.loads(tokenizer.model_proto)
  files.atomic_write(os.path.join(hf_dir, TOKENIZER), record["tokenizer"])
  names = arch.token_names
  tokenizer_config = {names[k]: v for k, v in tokenizer.special_tokens.items() if k in names}
  tokenizer_config["model_max_length"] = max_len
  if arch.eos_as_unk:
    tokenizer_config["unk_token"] = tokenizer.special_tokens.get("eos")
  files.atomic_write(os.path.join(hf_dir, TOKENIZER_CONFIG),
                     json.dumps(tokenizer_config, indent=2))
  return [TOKENIZER, TOKENIZER_CONFIG]


def write(hf_dir: str, arch, tokenizer, vocab: Vocab, special_ids: dict, max_len: int) -> list:
  """Writes the tokenizer of an exported model as `transformers` loads it for the architecture;
  returns the names of the files written (none: a tokenizer of ours with no files of theirs)."""
  imported = isinstance(tokenizer, tokenizer_lib.HFTokenizer)
  if arch.tokenizer == "sentencepiece":
    return _write_marian(hf_dir, tokenizer, vocab, special_ids, max_len)
  if arch.tokenizer == "t5" and imported and "sentencepiece" in json.loads(tokenizer.model_proto):
    return _write_t5(hf_dir, tokenizer, max_len)
  if imported:
    return _write_tokenizer_json(hf_dir, arch, tokenizer, max_len)
  return []


def special_ids(arch, tokenizer, vocab: Vocab) -> dict:
  """{our special: their id} that the exported config.json names: an imported tokenizer's own
  (its BOS as the architecture has it: Architecture.export_bos), else our SentencePiece
  vocabulary's pad, BOS and EOS."""
  if not isinstance(tokenizer, tokenizer_lib.HFTokenizer):
    return {name: int(vocab.hf_ids[i])
            for name, i in (("pad", PAD_ID), ("bos", BOS_ID), ("eos", EOS_ID))}
  ids = {name: int(tokenizer.hf_ids[slot]) for slot, name in
         ((PAD_ID, "pad"), (EOS_ID, "eos")) if tokenizer.hf_ids[slot] >= 0}
  if arch.export_bos == "eos":
    ids["bos"] = ids["eos"]
  elif arch.export_bos == "always" or (arch.export_bos == "if_any"
                                       and tokenizer.hf_ids[BOS_ID] >= 0):
    ids["bos"] = int(tokenizer.hf_ids[BOS_ID])
  return ids
