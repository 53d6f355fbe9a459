"""Room on CPython's frame stack for a process that traces programs: `call(fn, ...)`.

Since Python 3.11, CPython keeps the frames of running Python functions on a stack of its own
per thread, made of chunks of 16 KiB or more. A call whose frame does not fit in the current
chunk gets a fresh chunk from mmap, and when the frame at the base of a chunk returns, the chunk
goes back to the system with munmap at once. Tracing a model with JAX and Flax makes hundreds of
thousands of calls at depths of a few hundred frames; wherever a hot call sits at a chunk's edge,
every call maps a chunk, faults its pages in and unmaps it. The suite's test_decode.py made
456,000 mmaps and munmaps of 16 KiB each, and 13% of its CPU time was the kernel's; from this
frame, 4,900 and 3% (docs/benchmarks.md: "Room on CPython's frame stack"). 3.11, 3.12 and 3.13
all do this; 3.10 (frames on the heap) does not.

`call` runs `fn` from a frame whose code has `ROOM` unused local slots. A chunk is sized for the
first frame that needs it, rounded up to a power of two, so this frame takes a chunk of 512 KiB
and leaves about half of it free for the frames that `fn` calls: they never reach a chunk's
edge unless they go some thousand frames deeper. The chunk is mapped once, when `call` starts,
and unmapped when it returns. Nothing else changes: `fn` gets the same arguments and its
exceptions pass through.
"""

from __future__ import annotations

import sys
import types

# 32,768 slots of 8 bytes: 256 KiB of frame; with CPython's margin, a chunk of 512 KiB.
ROOM = 1 << 15

_roomy = None


def _call(fn, args, kwargs):
  return fn(*args, **kwargs)


def _make_roomy():
  code = _call.__code__
  names = code.co_varnames + tuple(map("_room{}".format, range(ROOM)))
  return types.FunctionType(code.replace(co_varnames=names, co_nlocals=len(names)),
                            _call.__globals__, "call_with_room")


def call(fn, *args, **kwargs):
  """fn(*args, **kwargs), from a frame at the base of a chunk of CPython's frame stack with
  room for the frames fn calls (the module's docstring: why)."""
  global _roomy
  if sys.version_info < (3, 11) or sys.implementation.name != "cpython":
    return fn(*args, **kwargs)
  if _roomy is None:
    _roomy = _make_roomy()
  return _roomy(fn, args, kwargs)
