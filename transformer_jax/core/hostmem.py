"""Host memory: make glibc's malloc keep freed memory for reuse. Call before JAX starts.

XLA:CPU allocates the temporaries of every call afresh: for the CPU benchmark's train step that is
one block of about 540 MB. glibc serves a block that large with mmap and unmaps it on free, so each
step page-faults (and the kernel zeroes) its whole working set again. That ran at about 5.5 GB/s
on the 2-core benchmark machine, about 100 ms of a 780 ms step. With one arena, no mmap and no
trimming, freed blocks go back to malloc's heap and the next step reuses them (measured: 771 ->
626 ms a step). The costs: the process keeps its peak resident memory until it exits, and all
threads share one arena's lock, which made the tiny test model's 7.5 ms step 10-11 ms. So
`--keep_host_memory=auto` (the command line) applies it only when a step's arrays may exceed glibc's
largest heap-served block (`worth_keeping`).
"""

from __future__ import annotations

import ctypes
import sys

# glibc serves blocks above its mmap threshold with mmap; the threshold adapts up to this size.
MMAP_THRESHOLD_MAX = 32 * 2**20

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


def step_activation_bytes(config, mode: str) -> int:
  """A rough upper size of one step's float32 activations for `config` in the command line's `mode`.

  Tokens per step (per side) times the logits and every layer's FFN and attention outputs; the
  real temporaries are of this order (0.51 GiB measured against 0.18 GiB estimated for the CPU
  benchmark model), and the estimate only has to tell tens of MiB from hundreds.
  """
  m, d, b = config.model, config.data, config.benchmark
  if mode == "benchmark":
    tokens = b.batch_size * max(b.source_len, b.target_len)
  else:
    tokens = config.eval.batch_size * d.max_target_len
    if mode == "train":
      train_tokens = (d.batch_size * max(d.max_source_len, d.max_target_len)
                      if d.batching == "fixed" else d.tokens_per_batch)
      tokens = max(tokens, train_tokens)
  layers = m.num_encoder_layers + m.num_decoder_layers
  return 4 * tokens * (m.vocab_size + layers * (m.d_ff + 6 * m.d_model))


def worth_keeping(config, mode: str) -> bool:
  """True when a step's arrays are likely to be mmapped (and page-faulted) afresh every step."""
  return step_activation_bytes(config, mode) > MMAP_THRESHOLD_MAX
