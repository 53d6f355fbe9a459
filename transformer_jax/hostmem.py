"""Host memory: make glibc's malloc keep freed memory for reuse. Call before JAX starts.

XLA:CPU allocates the temporaries of every call afresh: for the CPU benchmark's train step that is
one block of about 540 MB. glibc serves a block that large with mmap and unmaps it on free, so each
step page-faults (and the kernel zeroes) its whole working set again. That ran at about 5.5 GB/s
on the 2-core benchmark machine, about 100 ms of a 780 ms step. With one arena, no mmap and no
trimming, freed blocks go back to malloc's heap and the next step reuses them (measured: 771 ->
626 ms a step). The cost: the process keeps its peak resident memory until it exits.
"""

from __future__ import annotations

import ctypes
import sys

# mallopt() parameters from glibc's malloc.h.
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8


def keep_freed_memory() -> bool:
  """Applies the settings; returns False where they do not apply (not Linux with glibc).

  Must run before JAX creates its CPU threads: a thread keeps the malloc arena it first used.
  """
  if not sys.platform.startswith("linux"):
    return False
  try:
    libc = ctypes.CDLL("libc.so.6")
  except OSError:
    return False
  if not hasattr(libc, "gnu_get_libc_version"):  # another C library (musl) under the same name
    return False
  # One arena: with several, a thread's arena is capped at 64 MB and larger blocks go to mmap.
  return bool(libc.mallopt(_M_ARENA_MAX, 1)
              and libc.mallopt(_M_MMAP_MAX, 0)  # never mmap: every block comes from the heap
              and libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))  # and never shrink the heap
