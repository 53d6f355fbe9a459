"""The tensors of a Hugging Face model directory, read and written as NumPy arrays.

Read, in this order of preference: `model.safetensors`; sharded safetensors through their
`model.safetensors.index.json` (each shard the index names must exist); `pytorch_model.bin`
only through `torch.load(..., weights_only=True)`, which refuses a pickle that would run code.
Written: one `model.safetensors`.
"""

from __future__ import annotations

import os
import warnings

import ml_dtypes
import numpy as np

from transformer_jax.core.errors import UserError
from transformer_jax.tools.hf import checks

SAFETENSORS = "model.safetensors"
INDEX = "model.safetensors.index.json"
PYTORCH = "pytorch_model.bin"


# safetensors' dtype names -> NumPy's (bfloat16 from ml_dtypes, which JAX brings): read here,
# since safetensors' own NumPy reader does not know bfloat16, the dtype most checkpoints use.
DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
          "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
          "BOOL": np.bool_}


def _safetensors(path: str) -> dict:
  """The tensors of a .safetensors file: an 8-byte little-endian header size, a JSON header
  {name: {dtype, shape, data_offsets}}, then the bytes (memory-mapped, read on use). Every
  size in it is checked against the file before anything is mapped (`checks.py`)."""
  length, header = checks.safetensors_header(path, DTYPES)
  try:
    data = np.memmap(path, np.uint8, mode="r", offset=8 + length) if os.path.getsize(
        path) > 8 + length else np.zeros(0, np.uint8)  # a file of empty tensors maps nothing
  except (OSError, ValueError) as e:
    raise UserError(f"{path} does not read as safetensors ({e}); download it again") from None
  return {name: data[start:end].view(dtype).reshape(shape)
          for name, (dtype, shape, start, end) in header.items()}


def _sharded(hf_dir: str) -> dict:
  index_path = os.path.join(hf_dir, INDEX)
  weight_map = checks.weight_map(checks.read_json(index_path, "the index"), index_path)
  shards = sorted(set(weight_map.values()))
  missing = [s for s in shards if not os.path.isfile(os.path.join(hf_dir, s))]
  if missing:
    raise UserError(f"{index_path} names {len(missing)} missing shard(s), e.g. {missing[0]}; "
                    "download every file of the model")
  tensors = {}
  for shard in shards:
    tensors.update(_safetensors(os.path.join(hf_dir, shard)))
  absent = sorted(set(weight_map) - set(tensors))
  if absent:
    raise UserError(f"{index_path} places {absent[0]} in a shard that does not hold it; "
                    "download the model again")
  return tensors


def _pytorch(path: str) -> dict:
  try:
    import torch
  except ImportError:
    raise UserError(f"{path} is a PyTorch pickle, which needs torch to read; install torch "
                    "(pip install 'transformer_jax[torch]') or convert the model to "
                    "safetensors") from None
  try:
    with warnings.catch_warnings():  # torch warns about pickle protocols before it refuses
      warnings.simplefilter("ignore")
      state = torch.load(path, map_location="cpu", weights_only=True)
  except Exception:  # pickle.UnpicklingError for anything that is not plain tensors
    raise UserError(f"{path} is not a weights-only PyTorch file (torch.load with "
                    "weights_only=True refuses it); use the model's safetensors instead (a "
                    "pickle may run code)") from None
  if not isinstance(state, dict):
    raise UserError(f"{path} holds a {type(state).__name__}, not a state dict of tensors; use "
                    "the model's safetensors instead")
  return {k: v.detach().float().numpy() if v.dtype.is_floating_point else v.numpy()
          for k, v in state.items() if hasattr(v, "numpy")}


def weight_files(hf_dir: str) -> list:
  """The weight files of `hf_dir` that `read` would use, by preference (may be empty)."""
  return [name for name in (SAFETENSORS, INDEX, PYTORCH)
          if os.path.isfile(os.path.join(hf_dir, name))]


def check_present(hf_dir: str) -> None:
  """Raises UserError when `hf_dir` holds no weight file at all."""
  if not weight_files(hf_dir):
    raise UserError(f"{hf_dir} holds no weights ({SAFETENSORS}, {INDEX} or {PYTORCH}); "
                    "download the model's weight files into it")


def read(hf_dir: str) -> dict:
  """{name: float32 or integer NumPy array} of every tensor of the model in `hf_dir`."""
  check_present(hf_dir)
  found = weight_files(hf_dir)
  path = os.path.join(hf_dir, found[0])
  tensors = {SAFETENSORS: _safetensors, INDEX: lambda _: _sharded(hf_dir),
             PYTORCH: _pytorch}[found[0]](path)
  floating = (np.float64, np.float16, ml_dtypes.bfloat16)
  tensors = {k: v.astype(np.float32) if v.dtype in floating else v for k, v in tensors.items()}
  checks.finite(tensors, hf_dir)
  return tensors


def write(hf_dir: str, tensors: dict) -> None:
  """Writes `tensors` ({name: array}) as `hf_dir`/model.safetensors (PyTorch's format tag)."""
  from safetensors.numpy import save_file
  save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()},
            os.path.join(hf_dir, SAFETENSORS), metadata={"format": "pt"})
