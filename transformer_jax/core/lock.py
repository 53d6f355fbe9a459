"""One writer per directory: an advisory lock on DIR/lock, held for the writer's lifetime.

`flock` rather than a pid file: the kernel drops the lock when its holder dies, however it dies
(kill -9, a crash, a lost node on NFS once its lease ends), so a stale lock is taken over by the
next writer without any guessing about whether a recorded pid is still alive, and two writers
starting at once cannot both win. The file records its holder (host, pid, start time, command) for
the message that refuses a second writer. Readers (evaluate, translate, plot) take no lock: they
may read a workdir while its training run writes it.

A file system without locks (some network and FUSE mounts) gets one warning and no lock.
"""

from __future__ import annotations

import atexit
import datetime
import errno
import fcntl
import json
import os
import socket
import sys
import weakref

from transformer_jax.core.errors import UserError
from transformer_jax.core.files import write_error

FILENAME = "lock"
_UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


def _holder_text(raw: bytes) -> str:
  try:
    holder = json.loads(raw.decode("utf-8"))
    return (f"pid {holder['pid']} on host {holder['host']} since {holder['since']} "
            f"({holder['command']})")
  except (ValueError, KeyError, TypeError, UnicodeDecodeError):
    return "another process (it has not recorded itself yet)"


class DirectoryLock:
  """`acquire()` makes this process the directory's one writer until `release()` (or the end of
  a `with lock:` block, or of the process).

  `what`: how the directory is named in messages (e.g. "--workdir").
  """

  def __init__(self, directory: str, what: str = "--workdir"):
    self.directory = os.path.abspath(directory)
    self.path = os.path.join(self.directory, FILENAME)
    self.what = what
    self._fd = None

  def _refusal(self, fd: int) -> UserError:
    os.lseek(fd, 0, os.SEEK_SET)
    holder = _holder_text(os.read(fd, 4096))
    return UserError(f"{self.what} {self.directory} is in use by {holder}; only one run may write "
                     "it: wait for that run to end (or stop it), or use another directory")

  def check(self) -> None:
    """Raises the refusal if another process holds the lock now; creates and changes nothing."""
    try:
      fd = os.open(self.path, os.O_RDONLY)
    except OSError:  # no lock file: nobody has written here with a lock
      return
    try:
      fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as e:
      if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
        raise self._refusal(fd) from None
    finally:
      os.close(fd)  # drops the shared lock, if it was taken

  def acquire(self) -> None:
    """Takes the lock (the directory must exist) or raises a UserError naming its holder."""
    try:
      fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
      raise write_error(self.path, e) from None
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
        refusal = self._refusal(fd)
        os.close(fd)
        raise refusal from None
      if e.errno not in _UNSUPPORTED:
        os.close(fd)
        raise
      print(f"warning: the file system of {self.directory} has no file locks; make sure that "
            "only one run writes it", file=sys.stderr, flush=True)
    previous = os.read(fd, 4096)
    if previous.strip():  # the last holder ended without releasing: killed, or its machine lost
      print(f"warning: the previous run in {self.directory} ({_holder_text(previous)}) did not "
            "end cleanly; taking over its lock", file=sys.stderr, flush=True)
    holder = {"host": socket.gethostname(), "pid": os.getpid(),
              "since": datetime.datetime.now().isoformat(timespec="seconds"),
              "command": " ".join(sys.argv)[:300]}
    try:
      os.ftruncate(fd, 0)
      os.pwrite(fd, json.dumps(holder).encode("utf-8"), 0)
    except OSError as e:
      os.close(fd)
      raise write_error(self.path, e) from None
    self._fd = fd
    # An exit through an exception (a UserError, Ctrl-C) is a clean end too; only a killed
    # process leaves its record behind. A weak reference: the lock may be dropped earlier.
    atexit.register(_release, weakref.ref(self))

  def release(self) -> None:
    """Empties the record (a clean end) and drops the lock."""
    if self._fd is None:
      return
    try:
      os.ftruncate(self._fd, 0)
    except OSError:
      pass  # the next holder then reports an unclean end; the lock is dropped all the same
    os.close(self._fd)
    self._fd = None

  @property
  def held(self) -> bool:
    return self._fd is not None

  def __enter__(self) -> "DirectoryLock":  # `with lock:` releases it at the end of the block
    return self

  def __exit__(self, *exc) -> None:
    self.release()

  def __del__(self):  # a run that raised before its `with` block: drop the lock with the object
    self.release()



def _release(reference: weakref.ref) -> None:
  held = reference()
  if held is not None:
    held.release()
