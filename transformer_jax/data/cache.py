"""A cache shared between runs: the tokenised train split, and the tokenizer trained for it.

Tokenising WMT14 takes minutes; every start of every run, sweep trial and process of a
multi-host job used to do it again. An entry is written once and read by later starts instead.

  CACHE/KIND/HASH/           one entry: HASH = sha256 of its key (a JSON object)
      meta.json              the key, and the dtype, shape and CRC-32 of each array
      NAME.npy               the arrays, read back memory-mapped (not copied into memory)
  CACHE/KIND/HASH.lock       held (flock) while the entry is looked up or built

The key names everything the arrays depend on: the data (the files' sha256, or the TFDS
dataset's name, version and split), the tokenizer's sha256, and a format version.

Concurrent runs are safe. A builder holds the entry's lock, so another process of the same
machine waits and then reads what it wrote instead of tokenising too; an entry is written in a
temporary directory, each file fsync'ed, and renamed into place in one step, so a reader sees
all of it or none (also where locks do not work across machines: two builders then each write
a whole entry, and the first rename wins). A damaged entry (a file truncated or altered, found
by the sizes and checksums) is reported in one warning, set aside and built again; a cache that
cannot be written (read-only, disk full) costs a warning and the time to tokenise, nothing else.

Written here rather than taken from grain or TFDS: grain caches nothing across processes, and
TFDS's preparation writes a dataset, not a tokenisation of it keyed by the tokenizer.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
import zlib
from typing import Callable, Optional

import numpy as np

VERSION = 1  # bump when what an entry holds changes meaning
ENV = "TRANSFORMER_JAX_CACHE"  # overrides the default location (tests point it at a tmp dir)
META = "meta.json"


def root(data_config) -> Optional[str]:
  """The cache directory of `data_config`, or None when data.cache is off.

  data.cache_dir, else $TRANSFORMER_JAX_CACHE, else $XDG_CACHE_HOME/transformer_jax, else
  ~/.cache/transformer_jax.
  """
  if not data_config.cache:
    return None
  directory = (data_config.cache_dir or os.environ.get(ENV) or os.path.join(
      os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
      "transformer_jax"))
  return os.path.abspath(os.path.expanduser(directory))


def key_hash(key: dict) -> str:
  return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def warn(message: str) -> None:
  print(f"warning: {message}", file=sys.stderr, flush=True)


class Damaged(Exception):
  """An entry that exists but cannot be trusted; the message says why."""


def fetch(cache_dir: Optional[str], kind: str, key: dict,
          build: Callable[[], dict], describe: str = "", expected: bool = False) -> dict:
  """The arrays of the entry `key` ({name: array}, memory-mapped), built and stored if absent.

  build() -> {name: np.ndarray}; called when the entry is missing or damaged, or when there is
  no cache (cache_dir None). `describe` names what is built, for the one line printed then.
  expected: another process of the job has just written the entry here, so a missing one means
  that this process does not see its cache (said in a warning before building it again).
  """
  if cache_dir is None:
    return build()
  key = json.loads(json.dumps(key))  # as meta.json gives it back (lists, not tuples)
  directory = os.path.join(cache_dir, kind)
  entry = os.path.join(directory, key_hash(key))
  try:
    os.makedirs(directory, exist_ok=True)
  except OSError as e:
    warn(f"cannot create the cache directory {directory} ({_reason(e)}); working without it")
    return build()
  with _locked(entry + ".lock") as locked:
    try:
      arrays = read(entry, key)
    except Damaged as e:
      warn(f"the cache entry {entry} is damaged ({e}); building it again")
      _set_aside(entry)
      arrays = None
    if arrays is not None:
      return arrays
    if expected:
      warn(f"the cache entry {entry} that process 0 of this job wrote is not there: this "
           "host does not see its cache; set data.cache_dir to a path every host shares "
           "(building the entry here too)")
    # Holding the lock, no other writer of this entry is at work: whatever they left is debris.
    _remove_temporaries(entry, age=0.0 if locked else 3600.0)
    if describe:
      print(f"{describe}: writing it to the cache ({entry}) for later runs", flush=True)
    arrays = build()
    try:
      write(entry, key, arrays)
    except OSError as e:
      warn(f"cannot write the cache entry {entry} ({_reason(e)}); this run goes on without it")
    return arrays


def read(entry: str, key: dict) -> Optional[dict]:
  """The entry's arrays, memory-mapped and verified; None if it does not exist.

  Raises Damaged if its metadata, a file's size, dtype or shape, or a checksum is wrong.
  """
  if not os.path.isdir(entry):
    return None
  try:
    with open(os.path.join(entry, META), encoding="utf-8") as f:
      meta = json.load(f)
    if meta.get("version") != VERSION or meta.get("key") != key:
      raise Damaged("its metadata is for another key or format version")
    arrays = {}
    for name, info in meta["arrays"].items():
      path = os.path.join(entry, f"{name}.npy")
      if int(np.prod(info["shape"])) == 0:
        array = np.load(path)  # an empty file cannot be memory-mapped
      else:
        array = np.load(path, mmap_mode="r")
      if str(array.dtype) != info["dtype"] or list(array.shape) != info["shape"]:
        raise Damaged(f"{name}.npy holds {array.dtype}{list(array.shape)}, not "
                      f"{info['dtype']}{info['shape']}")
      if checksum(array) != info["crc32"]:
        raise Damaged(f"{name}.npy does not match its checksum")
      arrays[name] = array
    return arrays
  except Damaged:
    raise
  except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
    raise Damaged(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None


def checksum(array: np.ndarray) -> int:
  """CRC-32 of the array's bytes (~1.6 GB/s here: a check for damage, not for tampering)."""
  return zlib.crc32(np.ascontiguousarray(array).view(np.uint8).reshape(-1))


def write(entry: str, key: dict, arrays: dict) -> None:
  """Writes the entry in a temporary directory and renames it into place (see the docstring)."""
  directory = os.path.dirname(entry)
  temporary = tempfile.mkdtemp(prefix=f".{os.path.basename(entry)}.", dir=directory)
  try:
    meta = {"version": VERSION, "key": key, "arrays": {}}
    for name, array in arrays.items():
      array = np.ascontiguousarray(array)
      with open(os.path.join(temporary, f"{name}.npy"), "wb") as f:
        np.save(f, array, allow_pickle=False)
        f.flush()
        os.fsync(f.fileno())
      meta["arrays"][name] = {"dtype": str(array.dtype), "shape": list(array.shape),
                              "crc32": checksum(array)}
    with open(os.path.join(temporary, META), "w", encoding="utf-8") as f:
      json.dump(meta, f)
      f.flush()
      os.fsync(f.fileno())
    _fsync_directory(temporary)
    os.chmod(temporary, 0o755)  # mkdtemp's 0o700 would hide a shared cache from other users
    try:
      os.rename(temporary, entry)
    except OSError as e:
      if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
        raise
      return  # another process published the same entry first; theirs is as good
    _fsync_directory(directory)
  finally:
    shutil.rmtree(temporary, ignore_errors=True)


def _remove_temporaries(entry: str, age: float) -> None:
  """Deletes what writers of `entry` killed mid-write left: its temporary directories untouched
  for `age` seconds (without a lock, a live writer may be at work: it writes within seconds)."""
  directory, name = os.path.split(entry)
  for other in os.listdir(directory):
    path = os.path.join(directory, other)
    with contextlib.suppress(OSError):
      if other.startswith(f".{name}.") and time.time() - os.path.getmtime(path) > age:
        shutil.rmtree(path, ignore_errors=True)


def _fsync_directory(path: str) -> None:
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def _set_aside(entry: str) -> None:
  """Moves a damaged entry out of the way (a unique name: several processes may do this at
  once) and deletes it; a process that still maps its files keeps reading them meanwhile."""
  try:
    aside = tempfile.mkdtemp(prefix=f".{os.path.basename(entry)}.damaged.",
                             dir=os.path.dirname(entry))
    os.rename(entry, os.path.join(aside, "entry"))
    shutil.rmtree(aside, ignore_errors=True)
  except OSError:  # gone already (another process set it aside), or read-only
    shutil.rmtree(entry, ignore_errors=True)


@contextlib.contextmanager
def _locked(path: str):
  """Holds an exclusive flock on `path` (yields whether it could); says so when it waits.

  Without a lock (a file system that refuses them, a read-only cache) it goes on unlocked:
  the atomic rename alone keeps entries whole, at worst two processes build the same one.
  """
  try:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
  except OSError:
    yield False
    return
  try:
    locked = True
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      print(f"waiting for another process to finish the cache entry {path[:-len('.lock')]}",
            flush=True)
      fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError:
      locked = False  # no locks here
    yield locked
  finally:
    os.close(fd)  # releases the lock


def _reason(e: OSError) -> str:
  return e.strerror or str(e)
