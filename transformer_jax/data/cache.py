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

A cache in a bucket (data.cache_dir=gs://... or s3://..., for the hosts of a pod that share no
file system) holds the same entries as objects, written through `core/storage.py`:

  CACHE/KIND/HASH/meta.json      the key, the arrays' dtypes, shapes and CRC-32s, and WRITER
  CACHE/KIND/HASH/WRITER/NAME.npy  the arrays, uploaded before meta.json

An object store has no rename, so an entry is published by its meta.json, created last and only
if none is there (the store's precondition, as for the lease): an entry without it is not read,
and of two writers the first to create it wins while the other deletes its own arrays (so a
reader never mixes the arrays of two writers). A reader downloads the entry once into a local
mirror (LOCAL_CACHE/buckets/SCHEME/BUCKET/PATH/KIND/HASH, a local entry as above, written and
read as one) and memory-maps it from there, checksums verified; a damaged object is reported,
its entry deleted and built again. A bucket that cannot be read or written costs a warning.

Written here rather than taken from grain or TFDS: grain caches nothing across processes, and
TFDS's preparation writes a dataset, not a tokenisation of it keyed by the tokenizer.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import io
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
import zlib
from typing import Callable, Optional

import numpy as np

from transformer_jax.core import lease, storage
from transformer_jax.core.errors import UserError

VERSION = 1  # bump when what an entry holds changes meaning
ENV = "TRANSFORMER_JAX_CACHE"  # overrides the default location (tests point it at a tmp dir)
META = "meta.json"
# The default cache of a job of several processes whose workdir is in a bucket: BUCKET/IN_BUCKET.
IN_BUCKET = "transformer_jax_cache"


def local_root() -> str:
  """$TRANSFORMER_JAX_CACHE unless it is a URL, else $XDG_CACHE_HOME/transformer_jax, else
  ~/.cache/transformer_jax (absolute): where this host keeps its cache or its bucket mirror."""
  directory = os.environ.get(ENV)
  if not directory or storage.is_url(directory):
    directory = os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "transformer_jax")
  return os.path.abspath(os.path.expanduser(directory))


def root(data_config, workdir: str = "", processes: int = 1) -> Optional[str]:
  """The cache directory of `data_config` (a local path or a gs:// / s3:// URL), or None when
  data.cache is off.

  data.cache_dir, else $TRANSFORMER_JAX_CACHE, else, for a job of several processes whose
  `workdir` is in a bucket (hosts of a pod without a shared file system), BUCKET/IN_BUCKET in
  the workdir's bucket, else $XDG_CACHE_HOME/transformer_jax or ~/.cache/transformer_jax.
  """
  if not data_config.cache:
    return None
  directory = data_config.cache_dir or os.environ.get(ENV)
  if not directory and processes > 1 and workdir and storage.is_url(workdir):
    return storage.join(storage.bucket_of(workdir), IN_BUCKET)
  if directory and storage.is_url(directory):
    return storage.check(directory, "data.cache_dir")
  return local_root() if not directory else os.path.abspath(os.path.expanduser(directory))


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
  if storage.is_url(cache_dir):
    return _fetch_remote(cache_dir, kind, key, build, describe, expected)
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


# ----------------------------------------------------------------------------- a cache in a bucket


def _mirror(cache_dir: str, kind: str, key: dict) -> str:
  """The local entry that mirrors the bucket entry `key` (made into a fresh temporary directory
  when the local cache cannot be created: the entry is then downloaded at each start)."""
  scheme, rest = cache_dir.split("://", 1)
  directory = os.path.join(local_root(), "buckets", scheme, rest, kind)
  try:
    os.makedirs(directory, exist_ok=True)
  except OSError as e:
    warn(f"cannot create the local mirror {directory} of the cache {cache_dir} ({_reason(e)}); "
         "its entries are downloaded at each start")
    directory = tempfile.mkdtemp(prefix="transformer_jax_cache.")
  return os.path.join(directory, key_hash(key))


# Buckets of this process whose cache could not be read, or written: said once (a run fetches
# several entries: the tokenizer, each split), later entries go without it in silence.
_UNREADABLE: set = set()
_UNWRITABLE: set = set()


def _fetch_remote(cache_dir: str, kind: str, key: dict, build: Callable[[], dict],
                  describe: str, expected: bool) -> dict:
  """`fetch` for a cache in a bucket (see the module's docstring)."""
  if cache_dir in _UNREADABLE:
    return build()
  entry = storage.join(cache_dir, kind, key_hash(key))
  mirror = _mirror(cache_dir, kind, key)
  with _locked(mirror + ".lock") as locked:  # one download per host
    try:
      arrays = read(mirror, key)
    except Damaged:  # the mirror only: the bucket's entry is checked as it is downloaded again
      _set_aside(mirror)
      arrays = None
    if arrays is not None:
      return arrays
    _remove_temporaries(mirror, age=0.0 if locked else 3600.0)
    try:
      arrays = _download(entry, key, mirror)
    except Damaged as e:
      warn(f"the cache entry {entry} is damaged ({e}); building it again")
      _set_aside(mirror)
      try:
        _discard(entry)
      except (UserError, OSError):
        pass  # the damaged entry stays (this upload is then dropped); later starts say so too
      arrays = None
    except (UserError, OSError) as e:
      warn(f"cannot read the cache {cache_dir} ({_reason(e)}); this run goes on without it")
      _UNREADABLE.add(cache_dir)
      return build()
    if arrays is not None:
      return arrays
    if expected:
      warn(f"the cache entry {entry} that process 0 of this job wrote is not there: it could "
           "not write it (see its warning) or this host reads another bucket (building the "
           "entry here too)")
    if describe:
      print(f"{describe}: writing it to the cache ({entry}) for later runs", flush=True)
    arrays = build()
    try:
      if cache_dir not in _UNWRITABLE:
        _upload(entry, key, arrays)
    except (UserError, OSError) as e:
      warn(f"cannot write the cache {cache_dir} ({_reason(e)}); this run goes on without it")
      _UNWRITABLE.add(cache_dir)
    with contextlib.suppress(OSError):
      write(mirror, key, arrays)  # later starts on this host read it without a download
    return arrays


def _meta(entry: str) -> tuple[Optional[dict], Optional[str]]:
  """(the entry's meta.json, its version) in the bucket; (None, None) if it has none."""
  path = storage.join(entry, META)
  at_version = lease.version(path)
  try:
    raw = storage.read_bytes(path)
  except FileNotFoundError:
    return None, None
  try:
    meta = json.loads(raw.decode("utf-8"))
  except (UnicodeDecodeError, ValueError):
    meta = None
  if not isinstance(meta, dict) or not isinstance(meta.get("writer"), str):
    meta = {}
  return meta, at_version


def _download(entry: str, key: dict, mirror: str) -> Optional[dict]:
  """The bucket's entry, downloaded into `mirror` (a local entry) and read from there, verified;
  None if the bucket has none. Raises Damaged as `read` does."""
  meta, _ = _meta(entry)
  if meta is None:
    return None
  if meta.get("version") != VERSION or meta.get("key") != key or not isinstance(
      meta.get("arrays"), dict):
    raise Damaged("its metadata is for another key or format version")
  temporary = tempfile.mkdtemp(prefix=f".{os.path.basename(mirror)}.",
                               dir=os.path.dirname(mirror))
  try:
    for name in meta["arrays"]:
      try:
        data = storage.read_bytes(storage.join(entry, meta["writer"], f"{name}.npy"))
      except FileNotFoundError:
        raise Damaged(f"{name}.npy is missing") from None
      _write_synced(os.path.join(temporary, f"{name}.npy"), data)
    local = {name: value for name, value in meta.items() if name != "writer"}
    _write_synced(os.path.join(temporary, META), json.dumps(local).encode("utf-8"))
    _fsync_directory(temporary)
    os.chmod(temporary, 0o755)
    _set_aside(mirror)  # a damaged mirror left by someone else: replaced by this download
    try:
      os.rename(temporary, mirror)
    except OSError as e:
      if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
        raise
  finally:
    shutil.rmtree(temporary, ignore_errors=True)
  return read(mirror, key)


def _write_synced(path: str, data: bytes) -> None:
  with open(path, "wb") as f:
    f.write(data)
    f.flush()
    os.fsync(f.fileno())


def _upload(entry: str, key: dict, arrays: dict) -> None:
  """Uploads the arrays under ENTRY/WRITER/, then publishes them by creating ENTRY/meta.json if
  no other writer has (else deletes them: the entry published first is as good)."""
  writer = uuid.uuid4().hex
  meta = {"version": VERSION, "key": key, "writer": writer, "arrays": {}}
  for name, array in arrays.items():
    array = np.ascontiguousarray(array)
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    storage.write(storage.join(entry, writer, f"{name}.npy"), buffer.getvalue())
    meta["arrays"][name] = {"dtype": str(array.dtype), "shape": list(array.shape),
                            "crc32": checksum(array)}
  if not lease.create(storage.join(entry, META), json.dumps(meta)):
    storage.remove_tree(storage.join(entry, writer))


def _discard(entry: str) -> None:
  """Deletes a damaged bucket entry: its meta.json at the version read (not an entry another
  process has published meanwhile), then the arrays it named."""
  meta, at_version = _meta(entry)
  if at_version is not None:
    lease.remove_if(storage.join(entry, META), at_version)
  if meta and meta.get("writer"):
    storage.remove_tree(storage.join(entry, meta["writer"]))


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


def _reason(e: Exception) -> str:
  if isinstance(e, UserError):  # "cannot write gs://...: permission denied (...); grant ..."
    return str(e)
  return getattr(e, "strerror", None) or str(e)
