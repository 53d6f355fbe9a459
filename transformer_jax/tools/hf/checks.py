"""The files of a Hugging Face model directory are untrusted input: each size, text and number
that `import_hf` reads from them is checked here before it is used, and every failure is one
UserError naming the file and what is wrong with it.

- sizes: a safetensors header's length, its tensors' shapes and byte ranges, and the config's
  counts (vocabulary, widths, layers, positions) are bounded before anything is allocated;
- text: config, index and tokenizer files are decoded as UTF-8 JSON objects, or refused;
- numbers: every config value that becomes a model option has the type and range the option
  takes; every floating-point tensor is finite (NaN or Inf weights decode nothing and would
  later look like a bad learning rate).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import numpy as np

from transformer_jax.core.errors import UserError

MAX_TEXT_BYTES = 1 << 30  # a config, index or tokenizer file (the largest tokenizer.json: ~30 MB)
MAX_HEADER_BYTES = 100 << 20  # a safetensors header (the safetensors library's own limit)
MAX_COUNT = 1 << 24  # any width, count or length of the config (the longest contexts: ~10M)
MAX_VOCAB = 1 << 22  # vocabulary rows (the largest vocabularies: ~256k), a list of each is made
MAX_RANK = 8  # dimensions of one tensor


def read_bytes(path: str, what: str, limit: int = MAX_TEXT_BYTES) -> bytes:
  """The bytes of `path`, refused when larger than `limit` (a text file has no business being
  gigabytes) or unreadable."""
  try:
    size = os.path.getsize(path)
    if size > limit:
      raise UserError(f"{path} has {size:,} bytes, more than the {limit:,} such a file can "
                      f"have; download {what} again")
    with open(path, "rb") as f:
      return f.read(limit + 1)
  except OSError as e:
    raise UserError(f"cannot read {path} ({e.strerror or e}); download {what} again") from None


def decode_text(data: bytes, path: str, what: str) -> str:
  try:
    return data.decode("utf-8")
  except UnicodeDecodeError as e:
    raise UserError(f"{path} is not UTF-8 text (byte {e.start:,} is {data[e.start]:#04x}); "
                    f"download {what} again") from None


def read_text(path: str, what: str) -> str:
  """A text file: bounded, and decoded as UTF-8 or refused in one line."""
  return decode_text(read_bytes(path, what), path, what)


def parse_json(text: str, path: str, what: str) -> dict:
  """A JSON object (a dict), or one line naming the file."""
  try:
    value = json.loads(text)
  except RecursionError:
    raise UserError(f"{path} nests too deeply to be JSON of {what}; download it again") from None
  except ValueError as e:
    raise UserError(f"{path} is not valid JSON ({e}); download {what} again") from None
  if not isinstance(value, dict):
    raise UserError(f"{path} is not a JSON object; download {what} again")
  return value


def read_json(path: str, what: str) -> dict:
  return parse_json(read_text(path, what), path, what)


# ----------------------------------------------------------------------------- config values


def option_default(options_class, name: str):
  """The default of option `name` of a dataclass (ModelConfig), or a value of its type for an
  option without a default (vocab_size: 0); None for a name it lacks."""
  for field in dataclasses.fields(options_class):
    if field.name == name:
      if field.default is not dataclasses.MISSING:
        return field.default
      return {"int": 0, "float": 0.0, "bool": False, "str": ""}.get(str(field.type))
  return None


def option_value(ours: str, theirs: str, value, default, path: str):
  """`value` of their config key `theirs`, for our model option `ours` whose default (in
  ModelConfig) is `default`: of the option's type (bool, int, float or str) and, for numbers,
  finite and within [0, MAX_COUNT] for counts; else one line naming the key."""
  def refuse(need: str):
    return UserError(f"{path} has {theirs}={shown(value)}, but model.{ours} needs {need}; fix "
                     "the value or download config.json again")
  if isinstance(default, bool):
    if not isinstance(value, bool):
      raise refuse("true or false")
  elif isinstance(default, int):
    if isinstance(value, float) and value.is_integer() and abs(value) <= MAX_COUNT:
      value = int(value)  # 768.0: a JSON writer's integer
    if isinstance(value, bool) or not isinstance(value, int):
      raise refuse("an integer")
    limit = MAX_VOCAB if ours == "vocab_size" else MAX_COUNT
    if not 0 <= value <= limit:
      raise refuse(f"an integer in [0, {limit:,}]")
  elif isinstance(default, float):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
      raise refuse("a finite number")
    value = float(value)
  elif isinstance(default, str) and not isinstance(value, str):
    raise refuse("a string")
  return value


def shown(value) -> str:
  text = json.dumps(value) if not isinstance(value, float) or math.isfinite(value) else str(value)
  return text if len(text) <= 40 else text[:37] + "..."


def hashable(value, key: str, path: str):
  """A config value looked up in a table of choices: a JSON scalar, or one line."""
  if isinstance(value, (dict, list)):
    raise UserError(f"{path} has {key}={shown(value)}, not a single value; fix the value or "
                    "download config.json again")
  return value


def count_list(value, key: str, path: str) -> int:
  """The length of a config value that has one entry per item (id2label: one per class)."""
  if not isinstance(value, (list, dict)) or len(value) > MAX_COUNT:
    raise UserError(f"{path} has {key}={shown(value)}, not a list or object of one entry per "
                    "item; fix the value or download config.json again")
  return len(value)


# ----------------------------------------------------------------------------- safetensors


def safetensors_header(path: str, dtypes: dict) -> tuple[int, dict]:
  """(the header's length, {name: (dtype, shape, start, end)}) of a .safetensors file, every
  number checked against the file's size before anything is read or mapped: an 8-byte
  little-endian header length, a UTF-8 JSON header, then the tensors' bytes."""
  def damaged(reason: str) -> UserError:
    return UserError(f"{path} does not read as safetensors ({reason}); download it again")

  try:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
      start = f.read(8)
      if len(start) < 8:
        raise damaged(f"{size} bytes, fewer than the 8 of the header's length")
      length = int.from_bytes(start, "little")
      if length > min(size - 8, MAX_HEADER_BYTES):
        raise damaged(f"its header claims {length:,} bytes, more than the "
                      f"{min(size - 8, MAX_HEADER_BYTES):,} there can be")
      raw = f.read(length)
  except OSError as e:
    raise damaged(e.strerror or str(e)) from None
  header = parse_json(decode_text(raw, path, "it"), path, "the weights")
  data_bytes = size - 8 - length
  tensors = {}
  for name, info in header.items():
    if name == "__metadata__":
      continue
    where = f"tensor {name[:80]!r}"
    if not isinstance(info, dict):
      raise damaged(f"{where} is described by {shown(info)}, not an object")
    dtype = info.get("dtype")
    if not isinstance(dtype, str) or dtype not in dtypes:
      raise damaged(f"{where} has dtype {shown(dtype)}; the dtypes read here are "
                    f"{', '.join(dtypes)}")
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if (not isinstance(shape, list) or len(shape) > MAX_RANK
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
      raise damaged(f"{where} has shape {shown(shape)}, not a list of at most {MAX_RANK} sizes")
    if (not isinstance(offsets, list) or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1] <= data_bytes):
      raise damaged(f"{where} has data_offsets {shown(offsets)}, outside the file's "
                    f"{data_bytes:,} bytes of data")
    expected = math.prod(shape) * np.dtype(dtypes[dtype]).itemsize
    if offsets[1] - offsets[0] != expected:
      raise damaged(f"{where} of shape {tuple(shape)} and dtype {dtype} needs {expected:,} bytes, "
                    f"but its data_offsets span {offsets[1] - offsets[0]:,}")
    tensors[name] = (dtypes[dtype], tuple(shape), offsets[0], offsets[1])
  return length, tensors


def weight_map(index: dict, path: str) -> dict:
  """{tensor: shard file} of a sharded model's index, each shard a plain file name."""
  mapping = index.get("weight_map")
  if not isinstance(mapping, dict) or not mapping:
    raise UserError(f"{path} has no weight_map of tensor names to shard files; download it "
                    "again")
  for name, shard in mapping.items():
    if (not isinstance(shard, str) or not shard or os.path.basename(shard) != shard
        or shard in (".", "..")):
      raise UserError(f"{path} places {name[:80]!r} in {shown(shard)}, not a file name of the "
                      "model's directory; download it again")
  return mapping


# ----------------------------------------------------------------------------- tensors


def finite(tensors: dict, where: str) -> None:
  """Refuses the first floating-point tensor holding NaN or Inf, by name."""
  for name, value in tensors.items():
    if np.issubdtype(value.dtype, np.floating) and not np.isfinite(value).all():
      bad = int(np.size(value) - np.count_nonzero(np.isfinite(value)))
      raise UserError(f"the weights in {where} hold {bad:,} NaN or infinite value(s) in "
                      f"{name}; these weights are damaged (or diverged in training): download "
                      "them again or import another checkpoint")
