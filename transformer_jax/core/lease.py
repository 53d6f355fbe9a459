"""One writer per workdir, and the conditional writes it is built on.

- `create`, `version`, `remove_if`, `write_if`: writes an object store's precondition decides in
  the same request (GCS `ifGenerationMatch`, S3 `If-None-Match` / `If-Match`), so that of
  several processes writing one object at once exactly one succeeds (`create` also locally,
  with O_EXCL).
- `lock`: the one-writer lock of a directory: `core.lock.DirectoryLock` (flock) locally, a
  `Lease` (an object renewed by a background thread) in a bucket.
"""

from __future__ import annotations

import atexit
import datetime
import errno
import json
import os
import socket
import sys
import threading
import time
import uuid
import weakref
from typing import Optional

from transformer_jax.core import lock as lock_lib
from transformer_jax.core import outage, storage
from transformer_jax.core.errors import UserError


def create(path: str, content: bytes | str) -> bool:
  """Writes `content` to `path` only if nothing is there; True if it did.

  The precondition is the store's own (GCS `ifGenerationMatch=0`, S3 `If-None-Match: *`), so of
  two processes creating one object at once exactly one succeeds.
  """
  data = content.encode("utf-8") if isinstance(content, str) else content
  if not storage.is_url(path):
    try:
      fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
      return False
    with os.fdopen(fd, "wb") as f:
      f.write(data)
    return True
  try:
    storage.on_store(path, "write", "pipe_file", data, mode="create")
  except FileExistsError:
    return False
  except FileNotFoundError:
    raise storage.no_bucket_error(path, "write") from None
  return True


def version(path: str) -> Optional[str]:
  """The store's version of the object `path` (GCS generation, S3 ETag), None if there is none."""
  scheme, key = storage.split_url(path)
  try:
    info = storage.on_store(path, "read", "info")
  except FileNotFoundError:
    return None
  found = info.get("generation") if scheme == "gs" else info.get("ETag")
  return None if found is None else str(found)


def remove_if(path: str, at_version: str) -> bool:
  """Deletes the object `path` only if it is still at `at_version` (see `version`); True if it
  did. The store's precondition decides (GCS `ifGenerationMatch`, S3 `If-Match`), so of several
  processes deleting one object they all read at that version, exactly one succeeds, and none
  deletes a newer object written meanwhile."""
  scheme, key = storage.split_url(path)
  fs = storage.filesystem(scheme)
  bucket, _, name = key.partition("/")
  try:
    if scheme == "gs":
      storage.ride(path, "delete", fs.call, "DELETE", "b/{}/o/{}", bucket, name,
            ifGenerationMatch=at_version)
    else:
      storage.ride(path, "delete", fs.call_s3, "delete_object", Bucket=bucket, Key=name,
            IfMatch=at_version)
  except (FileNotFoundError, FileExistsError):  # gone already, or (gcsfs: 412) changed
    return False
  except OSError as e:
    if scheme == "s3" and e.errno == errno.EINVAL:  # s3fs: 412 Precondition Failed
      return False
    raise storage.request_failure(path, e, "delete") or e from None
  return True


def write_if(path: str, content: bytes | str, at_version: str) -> Optional[str]:
  """Replaces the object `path` with `content` only if it is still at `at_version` (see
  `version`); its new version, or None if it changed or is gone meanwhile (GCS
  `ifGenerationMatch`, S3 `If-Match`: the store decides, in the same request)."""
  data = content.encode("utf-8") if isinstance(content, str) else content
  scheme, key = storage.split_url(path)
  fs = storage.filesystem(scheme)
  bucket, _, name = key.partition("/")
  try:
    if scheme == "gs":
      answer = storage.ride(path, "write", fs.call, "POST",
                     fs._location + "/upload/storage/v1/b/{}/o", bucket, uploadType="media",
                     name=name, ifGenerationMatch=at_version, data=data, json_out=True)
      return str(answer["generation"])
    return storage.ride(path, "write", fs.call_s3, "put_object", Bucket=bucket, Key=name, Body=data,
                 IfMatch=at_version)["ETag"]
  except (FileNotFoundError, FileExistsError):  # gone, or (gcsfs: 412) changed
    return None
  except OSError as e:
    if scheme == "s3" and e.errno == errno.EINVAL:  # s3fs: 412 Precondition Failed
      return None
    raise storage.request_failure(path, e, "write") or e from None




# ------------------------------------------------------------------------- one writer: a lease

LEASE_SECONDS = 60.0  # a lease not renewed for this long is taken over
RENEW_EVERY_S = 20.0  # how often a live run renews its lease (one conditional write each)


def _now() -> float:
  return time.time()


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except (PermissionError, OSError):
    return True
  return True


class Lease:
  """One writer per object-store directory: the object DIR/lock, created with the store's
  precondition (see `create`), renewed by a background thread, deleted at a clean end.

  A lease that has not been renewed for `seconds` (its run was killed, or its machine lost) is
  taken over by the next run; so is one left by a dead process of this same host, at once. The
  interface is `core.lock.DirectoryLock`'s: `check`, `acquire`, `release`, `held`.

  Costs: one conditional write every `renew_every` seconds while a run lives (180 an hour at
  the defaults), plus a few requests at start and end. A run killed without a clean end
  blocks a run on another machine for at most `seconds` after its last renewal.
  """

  def __init__(self, directory: str, what: str = "--workdir", seconds: float = LEASE_SECONDS,
               renew_every: float = RENEW_EVERY_S):
    self.directory = directory
    self.path = storage.join(directory, lock_lib.FILENAME)
    self.what = what
    self.seconds = seconds
    self.renew_every = renew_every
    self.lost = False  # set once this run has said that another run took the lease over
    self._token = None
    self._version = None  # the store's version of this run's lease object, while it holds it
    self._stop = threading.Event()
    self._thread = None

  def _read(self) -> Optional[dict]:
    try:
      return self._parse(storage.read_bytes(self.path))
    except FileNotFoundError:
      return None

  def _read_versioned(self) -> tuple[Optional[dict], Optional[str]]:
    """(the holder's record, the object's version): the version is asked first, so that the
    record read is of that version or a newer one (a delete conditioned on it then fails)."""
    at_version = version(self.path)
    try:
      raw = storage.read_bytes(self.path)
    except FileNotFoundError:
      return None, None
    return self._parse(raw), at_version

  @staticmethod
  def _parse(raw: bytes) -> dict:
    try:
      holder = json.loads(raw.decode("utf-8"))
      return holder if isinstance(holder, dict) else {}
    except (UnicodeDecodeError, ValueError):
      return {}  # damaged: treated as expired

  def _expired(self, holder: dict) -> bool:
    renewed = holder.get("renewed")
    if not isinstance(renewed, (int, float)):
      return True
    if holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int):
      if holder["pid"] != os.getpid() and not _pid_alive(holder["pid"]):
        return True  # its process is gone: no need to wait for the lease to run out
    return _now() > renewed + float(holder.get("seconds", self.seconds))

  def _refusal(self, holder: dict) -> UserError:
    left = float(holder.get("renewed", 0)) + float(holder.get("seconds", self.seconds)) - _now()
    text = lock_lib._holder_text(json.dumps(holder).encode("utf-8"))
    return UserError(f"{self.what} {self.directory} is in use by {text}; only one run may write "
                     "it: wait for that run to end (or stop it), or use another directory (if it "
                     f"was killed, its lease runs out in {max(left, 0):.0f} s)")

  def check(self) -> None:
    """Raises the refusal if another run holds a live lease now; writes nothing."""
    holder = self._read()
    if holder is not None and holder.get("token") != self._token and not self._expired(holder):
      raise self._refusal(holder)

  def _record(self, since: str) -> bytes:
    return json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "since": since,
                       "command": " ".join(sys.argv)[:300], "token": self._token,
                       "renewed": _now(), "seconds": self.seconds}).encode("utf-8")

  def acquire(self) -> None:
    """Takes the lease or raises a UserError naming its holder."""
    token = uuid.uuid4().hex
    since = datetime.datetime.now().isoformat(timespec="seconds")
    for _ in range(3):
      holder, at_version = self._read_versioned()
      if holder is not None:
        if not self._expired(holder):
          raise self._refusal(holder)
        text = lock_lib._holder_text(json.dumps(holder).encode("utf-8"))
        print(f"warning: the previous run in {self.directory} ({text}) did not end cleanly; "
              "taking over its lease", file=sys.stderr, flush=True)
        # Only the stale version: of two runs taking over at once one deletes it, the other's
        # delete fails (it never deletes the lease the first then creates), and a renewal
        # meanwhile keeps its lease.
        if at_version is not None:
          remove_if(self.path, at_version)
      self._token = token
      if create(self.path, self._record(since)):
        self._version = version(self.path)  # each renewal replaces exactly this version
        break
      self._token = None  # another run created it between our read and our write
    else:
      raise self._refusal(self._read() or {})
    self._since = since
    self._stop.clear()
    self._thread = threading.Thread(target=self._renew, name="storage-lease", daemon=True)
    self._thread.start()
    atexit.register(_release, weakref.ref(self))

  def _renew(self) -> None:
    while not self._stop.wait(self.renew_every):
      try:
        # One conditional write: it replaces this run's own last version or nothing, so a run
        # that stalled past its lease never overwrites the lease another run took meanwhile.
        renewed = write_if(self.path, self._record(self._since), self._version)
        if renewed is None:
          try:
            holder = self._read()
          except Exception:  # unreadable just now (an outage): the takeover is said all the same
            holder = None
          print(f"warning: the lease on {self.directory} was taken over by another run "
                f"({lock_lib._holder_text(json.dumps(holder or {}).encode())}); this run no "
                "longer holds it", file=sys.stderr, flush=True)
          self.lost = True  # after the warning: whoever sees it set finds the takeover said
          return
        self._version = renewed
      except Exception as e:  # a failed renewal is retried at the next one
        if outage.ongoing() or outage.unreachable(e):
          continue  # an outage, said once by core/outage.py (and the run's writes end it)
        print(f"warning: could not renew the lease on {self.directory}: "
              f"{' '.join(str(e).split())}", file=sys.stderr, flush=True)

  def release(self) -> None:
    """Stops renewing and deletes the lease if it is still this run's."""
    if self._token is None:
      return
    self._stop.set()
    if self._thread is not None and self._thread is not threading.current_thread():
      self._thread.join(timeout=5)
    try:
      if self._version is not None:
        remove_if(self.path, self._version)  # this run's own version, never a taker's lease
    except Exception:
      pass  # the lease then runs out by itself
    self._token = self._version = None

  @property
  def held(self) -> bool:
    return self._token is not None

  def __enter__(self) -> "Lease":
    return self

  def __exit__(self, *exc) -> None:
    self.release()


def _release(reference: weakref.ref) -> None:
  held = reference()
  if held is not None:
    held.release()


def lock(directory: str, what: str = "--workdir"):
  """The one-writer lock of `directory`: a `core.lock.DirectoryLock` (flock) for a local
  directory, a `Lease` for an object-store one."""
  if storage.is_url(directory):
    return Lease(directory, what)
  return lock_lib.DirectoryLock(directory, what)
