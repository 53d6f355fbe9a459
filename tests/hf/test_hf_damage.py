"""Damaged Hugging Face model directories at --mode=import_hf: a seeded loop of a few hundred
variants of a GPT-2 that imports (truncated files, flipped bytes, random bytes, header fields of
the wrong type or absurd sizes, NaN weights, config values of every wrong kind) in the
safetensors file, the sharded index and its shards, config.json, tokenizer.json and
tokenizer_config.json. Each one imports or is refused by one UserError of one line that names
the damaged file (or the model directory, for what the files say together); never another
exception. The import runs in-process (the CLI prints a UserError as one line: test_errors)."""

import json
import os
import random
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest
from launcher import ROOT

from transformer_jax.core.errors import UserError

from .files import gpt2_files

pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")
from transformer_jax.tools import hf  # noqa: E402

SEED = 40
# Random variants of each file, beside its fixed cases; fewer where most damage still imports
# (tokenizer_config.json's values of a wrong type are left out, as transformers leaves them),
# since each import that succeeds writes a checkpoint.
VARIANTS = {"config.json": 45, "tokenizer.json": 45, "tokenizer_config.json": 12,
            "model.safetensors.index.json": 30, "model.safetensors": 45,
            "model-00002-of-00002.safetensors": 30}
WRONG_VALUES = (None, -1, 0, 2**62, -(2**62), 1e308, 0.5, "x", "", [], [1, 2], {}, {"a": 1},
                True, float("nan"), float("inf"))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
  """A good GPT-2 directory with tokenizer_config.json, and the same split into two shards."""
  from safetensors.numpy import load_file, save_file
  root = tmp_path_factory.mktemp("hf_damage")
  good = gpt2_files(root / "good")
  (good / "tokenizer_config.json").write_text(json.dumps(
      {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "model_max_length": 16}))
  sharded = root / "sharded"
  shutil.copytree(good, sharded)
  tensors = load_file(str(sharded / "model.safetensors"))
  os.remove(sharded / "model.safetensors")
  names = sorted(tensors)
  shards = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
  for i, shard in enumerate(shards):
    save_file({k: tensors[k] for k in names[i::2]}, str(sharded / shard))
  (sharded / "model.safetensors.index.json").write_text(json.dumps(
      {"metadata": {}, "weight_map": {k: shards[j % 2] for j, k in enumerate(names)}}))
  return root, good, sharded


def _header(data: bytes) -> tuple[int, dict]:
  length = struct.unpack("<Q", data[:8])[0]
  return length, json.loads(data[8:8 + length])


def _with_header(data: bytes, header: dict) -> bytes:
  """The file with its header replaced (the tensors' bytes kept)."""
  length, _ = _header(data)
  raw = json.dumps(header).encode()
  return struct.pack("<Q", len(raw)) + raw + data[8 + length:]


def _safetensors_variants(data: bytes, rng: random.Random, count: int) -> list:
  """(what, bytes) of damaged safetensors files."""
  length, header = _header(data)
  names = sorted(k for k in header if k != "__metadata__")
  out = [("empty", b""), ("7 bytes", data[:7]),
         ("header of 2^62 bytes", struct.pack("<Q", 2**62) + data[8:]),
         ("header past the end", struct.pack("<Q", len(data)) + data[8:]),
         ("header not UTF-8", struct.pack("<Q", 4) + b"\xff\xfe\xfd\xfc" + data[8 + length:]),
         ("header not an object", _with_header(data, [1, 2])),
         ("tensors cut off", data[:8 + length + (len(data) - 8 - length) // 2])]
  for _ in range(count):
    kind = rng.choice(["truncate", "flip", "dtype", "shape", "offsets", "nan", "entry"])
    name = rng.choice(names)
    changed = json.loads(json.dumps(header))
    if kind == "truncate":
      out.append((kind, data[:rng.randrange(len(data))]))
      continue
    if kind == "flip":  # bytes of the length and the header, where a flip changes meaning
      damaged = bytearray(data)
      for _ in range(rng.randint(1, 4)):
        damaged[rng.randrange(8 + length)] ^= 1 << rng.randrange(8)
      out.append((kind, bytes(damaged)))
      continue
    if kind == "nan":  # a weight of the tensor made NaN or infinite
      start, end = header[name]["data_offsets"]
      value = rng.choice([np.nan, np.inf, -np.inf])
      at = 8 + length + start + 4 * rng.randrange((end - start) // 4)
      out.append((f"{kind} in {name}", data[:at] + np.float32(value).tobytes() + data[at + 4:]))
      continue
    if kind == "dtype":
      changed[name]["dtype"] = rng.choice(["F8", "float32", "", None, 7, "F64", "I8", "BOOL"])
    elif kind == "shape":
      changed[name]["shape"] = rng.choice([[2**40, 2**40], [-1], [1.5], "8", None, [2**62],
                                           [1] * 40, [0], [3, 5], [[1]]])
    elif kind == "offsets":
      start, end = header[name]["data_offsets"]
      changed[name]["data_offsets"] = rng.choice([[end, start], [0, 2**62], [-8, end], [start],
                                                  None, [start, end + 4], [0.5, end],
                                                  [start + 4, end + 4]])
    else:
      changed[name] = rng.choice(WRONG_VALUES)
    out.append((f"{kind} of {name}", _with_header(data, changed)))
  return out


def _json_variants(text: str, rng: random.Random, count: int) -> list:
  """(what, bytes) of damaged JSON files: cut, flipped, random, and values of every wrong kind
  at every depth of the object."""
  data = text.encode()
  out = [("empty", b""), ("random bytes", bytes(rng.randrange(256) for _ in range(300))),
         ("not UTF-8", data[:20] + b"\xc3\x28" + data[20:]), ("a list", b"[1, 2]"),
         ("nested deeply", b"[" * 100000 + b"]" * 100000)]
  value = json.loads(text)
  paths = []

  def walk(node, path):
    for key, child in (node.items() if isinstance(node, dict) else
                       enumerate(node) if isinstance(node, list) else ()):
      if len(paths) < 5000:
        paths.append(path + (key,))
        walk(child, path + (key,))
  walk(value, ())
  for _ in range(count):
    kind = rng.choice(["truncate", "flip", "value", "value", "value", "drop"])
    if kind == "truncate":
      out.append((kind, data[:rng.randrange(len(data))]))
      continue
    if kind == "flip":
      damaged = bytearray(data)
      for _ in range(rng.randint(1, 3)):
        damaged[rng.randrange(len(damaged))] ^= 1 << rng.randrange(8)
      out.append((kind, bytes(damaged)))
      continue
    changed = json.loads(text)
    # Mostly the top-level keys (what the import reads), sometimes deeper.
    path = rng.choice([p for p in paths if len(p) == 1] if rng.random() < 0.7 else paths)
    node = changed
    for key in path[:-1]:
      node = node[key]
    if kind == "drop":
      del node[path[-1]]
    else:
      node[path[-1]] = rng.choice(WRONG_VALUES)
    out.append((f"{kind} at {'.'.join(map(str, path))[:60]}", json.dumps(changed).encode()))
  return out


def _variants(models):
  """(directory to copy, file, what, bytes) for every damaged file, in a seeded order."""
  _, good, sharded = models
  rng = random.Random(SEED)
  cases = []
  for name in ("config.json", "tokenizer.json", "tokenizer_config.json",
               "model.safetensors.index.json"):
    source = sharded if name == "model.safetensors.index.json" else good
    cases += [(source, name, what, data) for what, data in
              _json_variants((source / name).read_text(), rng, VARIANTS[name])]
  for name in ("model.safetensors", "model-00002-of-00002.safetensors"):
    source = good if name == "model.safetensors" else sharded
    cases += [(source, name, what, data) for what, data in
              _safetensors_variants((source / name).read_bytes(), rng, VARIANTS[name])]
  return cases


def test_every_damaged_file_imports_or_is_one_line_naming_it(models, tmp_path):
  root, _, _ = models
  cases = _variants(models)
  assert len(cases) >= 240
  outcomes, failures = {"imported": 0, "refused": 0}, []
  for number, (source, name, what, data) in enumerate(cases):
    directory = tmp_path / f"hf_{number}"
    shutil.copytree(source, directory)
    (directory / name).write_bytes(data)
    workdir = tmp_path / f"run_{number}"
    try:
      hf.import_hf(str(directory), str(workdir))
      outcomes["imported"] += 1
      continue
    except UserError as e:
      message = str(e)
    except Exception as e:  # noqa: BLE001  the failure this test is for
      message = None
      failures.append(f"{name} ({what}): {type(e).__name__}: {str(e)[:300]}")
    finally:
      shutil.rmtree(directory)
    outcomes["refused"] += 1
    # One line that names the file, or (for what the files say together) the directory.
    if message is not None and ("\n" in message or len(message) > 700
                                or str(directory) not in message):
      failures.append(f"{name} ({what}): {message}")
    assert not os.path.exists(workdir / "checkpoints"), (name, what)  # nothing half-written
    shutil.rmtree(workdir, ignore_errors=True)
  assert not failures, "\n".join(failures)
  # The loop damages far more than it leaves importable.
  assert outcomes["refused"] > 3 * outcomes["imported"], outcomes


def test_the_named_examples_say_what_is_wrong(models, tmp_path):
  """The issue's three: a header of 2^62 bytes, a tokenizer.json of random bytes, NaN weights."""
  _, good, _ = models
  data = (good / "model.safetensors").read_bytes()
  length, header = _header(data)
  start, _ = header["transformer.h.0.mlp.c_fc.weight"]["data_offsets"]
  at = 8 + length + start
  cases = [("model.safetensors", struct.pack("<Q", 2**62) + data[8:],
            ["does not read as safetensors", "header claims 4,611,686,018,427,387,904 bytes"]),
           ("tokenizer.json", bytes(random.Random(1).randrange(128, 256) for _ in range(500)),
            ["tokenizer.json is not UTF-8 text", "download the tokenizer again"]),
           ("model.safetensors", data[:at] + np.float32(np.nan).tobytes() + data[at + 4:],
            ["1 NaN or infinite value(s) in transformer.h.0.mlp.c_fc.weight"])]
  for number, (name, content, expected) in enumerate(cases):
    directory = tmp_path / f"hf_{number}"
    shutil.copytree(good, directory)
    (directory / name).write_bytes(content)
    with pytest.raises(UserError) as raised:
      hf.import_hf(str(directory), str(tmp_path / f"run_{number}"))
    for text in expected:
      assert text in str(raised.value), (text, str(raised.value))


def test_the_command_line_prints_one_line(models, tmp_path):
  """Two damaged directories through launch.py, in one process each: one line, exit 2."""
  _, good, _ = models
  bad = tmp_path / "bad"
  shutil.copytree(good, bad)
  (bad / "model.safetensors").write_bytes(struct.pack("<Q", 2**62) + b"{}")
  nan = tmp_path / "nan"
  shutil.copytree(good, nan)
  (nan / "config.json").write_text((good / "config.json").read_text().replace(
      '"n_embd": 8', '"n_embd": NaN'))
  for directory, expected in ((bad, "does not read as safetensors"),
                              (nan, "n_embd=nan, but model.d_model needs an integer")):
    result = subprocess.run(
        [sys.executable, "launch.py", "--mode=import_hf", f"--hf_dir={directory}",
         f"--workdir={tmp_path / 'run'}"], cwd=ROOT, capture_output=True, text=True,
        env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: "), result.stderr
    assert expected in result.stderr, result.stderr
    assert not (tmp_path / "run").exists()
