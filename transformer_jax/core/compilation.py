"""Compile once: JAX's persistent compilation cache, and where a run's start-up time goes.

Every run, sweep trial and worker compiles the same train step. JAX keeps compiled programs in
a persistent cache keyed by the lowered program, the JAX version and the devices (and, with it,
XLA's per-fusion GPU autotuning results: `jax_persistent_cache_enable_xla_caches`), so a
second process that lowers the same program loads it instead of compiling it. `configure` turns
it on for every run: a per-user folder by default, a sweep's own under its workdir (shared by
every worker and host, a bucket too), `--compile_cache=DIR` elsewhere, `--compile_cache=off`
none. The cache holds machine code that the process runs: it is trusted code (README: Compile
once), so only those who may run code as the user may write to it.

`Clock` reads JAX's own monitoring events (tracing, lowering, compiling, cache hits and
misses): what a start-up spent where, and whether the cache answered, counted by JAX itself
rather than guessed from timings.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
import threading
import uuid
import warnings
from typing import Optional

import jax

from transformer_jax.core import storage

ENV = "TRANSFORMER_JAX_COMPILE_CACHE"  # the folder (or "off") when --compile_cache is not given
OFF = "off"
# Any size limit makes JAX lock the folder around each read and write (processes that compile the
# same program at once neither read a half-written entry nor write over each other); past it the
# least recently used entries go. Buckets get no limit: an object is written whole or not at all.
LOCAL_LIMIT_BYTES = 8 << 30
# Programs cheaper to compile than this are not stored (decoding and evaluation steps of a tiny
# model still are: a sweep trial compiles a dozen of them).
MIN_COMPILE_S = 0.05
# JAX's default for jax_persistent_cache_enable_xla_caches: XLA's per-fusion GPU autotune cache
# in the same folder.
_XLA_CACHES = "xla_gpu_per_fusion_autotune_cache_dir"

# JAX's monitoring events (jax._src.dispatch and compiler), stable names it documents for
# listeners.
_TRACE = "/jax/core/compile/jaxpr_trace_duration"
_LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_COMPILE = "/jax/core/compile/backend_compile_duration"
_HITS = "/jax/compilation_cache/cache_hits"
_MISSES = "/jax/compilation_cache/cache_misses"
_COUNTED = {_TRACE: "trace_s", _LOWER: "lower_s", _COMPILE: "compile_s"}
_FIX = "--compile_cache=DIR moves it, --compile_cache=off turns it off"


def default_dir() -> str:
  """$TRANSFORMER_JAX_COMPILE_CACHE, else xla/ in the data cache's root ($TRANSFORMER_JAX_CACHE
  or ~/.cache/transformer_jax)."""
  if os.environ.get(ENV):
    return os.environ[ENV]
  root = os.environ.get("TRANSFORMER_JAX_CACHE") or os.path.join("~", ".cache",
                                                                  "transformer_jax")
  return os.path.join(os.path.expanduser(root), "xla")


def _warn(message: str) -> None:
  print(f"warning: {message}", file=sys.stderr, flush=True)


def _is_folder(directory: str) -> bool:
  try:
    return storage.isdir(directory)
  except Exception:  # noqa: BLE001 - unreachable counts as no folder
    return False


def _writable(directory: str) -> Optional[str]:
  """None if a file can be written into `directory` (made if missing), else why not."""
  probe = storage.join(directory, f".probe-{uuid.uuid4().hex}")
  try:
    storage.makedirs(directory)
    storage.write(probe, b"")
    storage.remove(probe)
  except Exception as e:  # any failure means: no cache, and the run goes on
    return str(e).splitlines()[0][:200] if str(e) else type(e).__name__
  return None


_configured: dict = {"directory": None}


def configure(directory: Optional[str] = None) -> Optional[str]:
  """Points JAX's persistent compilation cache at `directory` and returns the folder in use
  (None: no cache). Call it before the first compile of the process.

  `directory`: a folder or a gs:// / s3:// URL; "off" = no cache; None =
  $TRANSFORMER_JAX_COMPILE_CACHE, else JAX's own JAX_COMPILATION_CACHE_DIR where the environment
  sets one, else `default_dir()`.
  A folder that cannot be written warns once (one line) and the run goes on without a cache.
  """
  if directory is None:
    directory = os.environ.get(ENV) or os.environ.get("JAX_COMPILATION_CACHE_DIR") or None
  if directory is None:
    directory = default_dir()
  if directory.strip().lower() == OFF:
    _set(None)
    return None
  if not storage.is_url(directory):
    directory = os.path.abspath(os.path.expanduser(directory))
  why = _writable(directory)
  if why is not None and not _is_folder(directory):
    # Said at the first compile, not now: a command that fails on the user's input first says
    # that alone, in one line.
    _pending.append(f"the compilation cache {directory} cannot be written ({why}); compiling "
                    f"without it ({_FIX})")
    _listen()
    _set(None)
    return None
  # A folder this user may read but not write (another user's, a read-only mount) still serves
  # what it holds; the first write that fails says so in one line (below).
  _set(directory)
  _one_warning_for_bad_entries()
  return directory


_JAX_CACHE_WARNINGS = {"Error reading persistent compilation cache entry": "read",
                       "Error writing persistent compilation cache entry": "write"}
_told: set = set()


def _one_warning_for_bad_entries() -> None:
  """JAX warns once per entry it cannot read (damaged, truncated, another build's) or write,
  with its path and a line of source each, and compiles the program anew: one line of ours
  instead, the first time in the process (reading and writing each)."""
  if getattr(warnings.showwarning, "_compilation_cache", False):
    return
  original = warnings.showwarning

  def show(message, category, filename, lineno, file=None, line=None):
    text = str(message)
    doing = next((v for k, v in _JAX_CACHE_WARNINGS.items() if text.startswith(k)), None)
    if doing is None:
      return original(message, category, filename, lineno, file, line)
    if doing == "read":
      _drop_entries(re.search(r"entry for '([^']+)'", text))
    if doing not in _told:
      _told.add(doing)
      why = text.split(": ", 2)[-1].splitlines()[0][:160]
      where = _configured["directory"]
      _warn(f"the compilation cache {where} has an entry that cannot be read ({why}); such "
            "programs are compiled anew and stored again" if doing == "read" else
            f"the compilation cache {where} cannot be written ({why}); programs compiled now "
            f"are not stored ({_FIX})")

  show._compilation_cache = True
  warnings.showwarning = show


def _drop_entries(found) -> None:
  """Removes the entries of a program whose entry could not be read: JAX never writes over an
  existing entry, so a damaged one would be read (and fail) at every start. JAX names an entry
  MODULE-KEY-cache and does not say which key failed: every entry of that module goes (the
  others compile once more)."""
  directory = _configured["directory"]
  if found is None or directory is None:
    return
  prefix = found.group(1) + "-"
  try:
    for name in storage.listdir(directory):
      if name.startswith(prefix) and name.endswith(("-cache", "-atime")):
        storage.remove(storage.join(directory, name))
  except Exception:  # noqa: BLE001 - a cache we cannot tidy is only slower; the run goes on
    pass


def _set(directory: Optional[str]) -> None:
  if directory == _configured["directory"] and directory is not None:
    return
  jax.config.update("jax_compilation_cache_dir", directory)
  if directory is not None:
    jax.config.update("jax_persistent_cache_min_compile_time_secs",
                      float(os.environ.get("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
                                           MIN_COMPILE_S)))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    # A bucket gets no limit whatever the environment says: JAX's lock around a limited cache
    # is a lock file, which for a URL would be made on the local disk (a folder named "gs:").
    # (JAX needs the filelock package for a limit: a dependency of ours, checked all the same.)
    jax.config.update("jax_compilation_cache_max_size",
                      -1 if storage.is_url(directory) or not importlib.util.find_spec("filelock")
                      else int(os.environ.get("JAX_COMPILATION_CACHE_MAX_SIZE",
                                              LOCAL_LIMIT_BYTES)))
    # XLA's own caches beside JAX's (the GPU autotuning results) are files its C++ writes: a
    # bucket URL would become a local folder named "gs:" or "s3:". A bucket keeps the compiled
    # programs alone (which hold their autotuned choices).
    jax.config.update("jax_persistent_cache_enable_xla_caches",
                      "none" if storage.is_url(directory) else _XLA_CACHES)
  from jax.experimental.compilation_cache import compilation_cache
  compilation_cache.reset_cache()  # the next compile opens the cache anew (or none)
  _configured["directory"] = directory


def directory() -> Optional[str]:
  """The cache folder `configure` set (None: none, or not configured by us)."""
  return _configured["directory"]


# ----------------------------------------------------------------------------- the clock

_lock = threading.Lock()
_totals = {"trace_s": 0.0, "lower_s": 0.0, "compile_s": 0.0, "cache_hits": 0, "cache_misses": 0}
_listening = []


_pending: list = []  # a warning for the first compile


def _on_event(event: str, **kwargs) -> None:
  key = {_HITS: "cache_hits", _MISSES: "cache_misses"}.get(event)
  if key:
    with _lock:
      _totals[key] += 1


def _on_duration(event: str, seconds: float, **kwargs) -> None:
  if event == _COMPILE and _pending:
    _warn(_pending.pop())
  key = _COUNTED.get(event)
  if key:
    with _lock:
      _totals[key] += seconds


def _listen() -> None:
  if not _listening:
    jax.monitoring.register_event_listener(_on_event)
    jax.monitoring.register_event_duration_secs_listener(_on_duration)
    _listening.append(True)


def totals() -> dict:
  """The process's tracing, lowering and compiling seconds and cache hits and misses so far
  (counted from when this module first listened: `Clock` starts listening)."""
  _listen()
  with _lock:
    return dict(_totals)


class Clock:
  """What JAX spent on tracing, lowering and compiling, and the cache's hits and misses, between
  `Clock()` and `read()` (the whole process's: other threads' compiles count too)."""

  def __init__(self):
    self._start = totals()

  def read(self) -> dict:
    now = totals()
    spent = {k: now[k] - self._start[k] for k in now}
    # hit: every program came from the cache; miss: none did; partly: some did; off: programs
    # were compiled with no cache; none: nothing was compiled (all in this process's memory).
    hits, misses = spent["cache_hits"], spent["cache_misses"]
    spent["cache"] = ("partly" if hits and misses else "hit" if hits else "miss" if misses
                      else "off" if spent["compile_s"] else "none")
    return spent
