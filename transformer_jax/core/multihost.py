"""What process 0 of a job of several processes (jax.distributed) decides, sent to the others."""

from __future__ import annotations

import json

from transformer_jax.core.errors import UserError

SIZE = 1 << 16  # bytes of JSON at most


def broadcast(value, what: str = "a value", size: int = SIZE):
  """Process 0's `value` (JSON-able) on every process of the job; every process must call this,
  with the same size (the others' `value` is ignored). A job of one process gets `value` back."""
  import jax
  if jax.process_count() == 1:
    return value
  import numpy as np
  from jax.experimental import multihost_utils
  buffer = np.zeros(size, np.uint8)
  if jax.process_index() == 0:
    data = json.dumps(value).encode()
    if len(data) > size:
      raise UserError(f"{what} takes {len(data)} bytes, more than the {size} that a job's "
                      "processes are sent")
    buffer[:len(data)] = np.frombuffer(data, np.uint8)
  got = np.asarray(multihost_utils.broadcast_one_to_all(buffer)).astype(np.uint8)
  return json.loads(bytes(got).rstrip(b"\0").decode())
