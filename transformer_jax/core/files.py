"""Local files that survive a crash, a full disk or a read-only file system (append-safe logs:
core/jsonlog.py).

- `atomic_write`: a reader sees the old file or the new one, never a half-written one.
- `check_readable`: a one-line UserError for a path that is not a readable regular file.
- `write_error`: the one-line UserError for a write that failed (the path, why, and for a full
  disk the free space left), so that every writer reports a full disk the same way.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import tempfile
from typing import Optional

from transformer_jax.core.errors import UserError

# Write failures that the user fixes outside the program: no room, no permission, read-only.
NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
WRITE_ERRNOS = (*NO_ROOM, errno.EROFS, errno.EACCES, errno.EPERM)
_UMASK = os.umask(0o022)  # read once (umask can only be read by setting it), then put back
os.umask(_UMASK)


def _size(n: float) -> str:
  for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
    if n < 1024 or unit == "TiB":
      return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
    n /= 1024
  return f"{n} bytes"


def free_space(path: str) -> Optional[int]:
  """Free bytes on the file system that holds `path` (or its nearest existing parent)."""
  path = os.path.abspath(path)
  while not os.path.exists(path) and os.path.dirname(path) != path:
    path = os.path.dirname(path)
  try:
    return shutil.disk_usage(path).free
  except OSError:
    return None


def write_error(path: str, e: OSError, what: str = "", where: Optional[str] = None) -> UserError:
  """The UserError for a failed write of `path`: one line with the cause and the fix.

  what: what the failed write means for the run, e.g. "the last checkpoint, step 20, is intact".
  where: a file on the same file system as `path`, if `path` is not a file's path (stdout).
  """
  after = f"; {what}" if what else ""
  if e.errno in NO_ROOM:
    free = free_space(where or path)
    room = f", {_size(free)} free" if free is not None else ""
    return UserError(f"cannot write {path}: no space left on its file system{room}{after}; free "
                     "some space (or move the directory to a larger disk) and run the same "
                     "command again")
  if e.errno == errno.EROFS:
    return UserError(f"cannot write {path}: the file system is read-only{after}; use a writable "
                     "directory")
  if e.errno in (errno.EACCES, errno.EPERM):
    return UserError(f"cannot write {path}: permission denied{after}; fix its permissions or "
                     "use another directory")
  return UserError(f"cannot write {path}: {e.strerror or e}{after}")


def check_readable(path: str, fix: str) -> None:
  """Raises a UserError unless `path` is a regular file this process can read.

  The message says what the path is instead (absent, a dangling link, a directory, a FIFO, a
  device such as /dev/null), then `fix`.
  """
  if not os.path.lexists(path):
    raise UserError(f"{path} does not exist; {fix}")
  if not os.path.exists(path):
    raise UserError(f"{path} is a broken symbolic link (to {os.readlink(path)}); {fix}")
  mode = os.stat(path).st_mode
  kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe (FIFO)"),
           (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
           (stat.S_ISSOCK, "a socket"))
  for test, kind in kinds:
    if test(mode):
      target = f" (it points to {os.path.realpath(path)})" if os.path.islink(path) else ""
      raise UserError(f"{path} is {kind}{target}, not a regular file; {fix}")
  if not os.access(path, os.R_OK):
    raise UserError(f"{path} cannot be read: permission denied; fix its permissions or {fix}")


def atomic_write(path: str, content: bytes | str, what: str = "") -> str:
  """Writes `content` to `path` through a temporary file, fsync and a rename; returns `path`.

  The rename is atomic on POSIX file systems, so a crash or a full disk mid-write leaves the
  previous file in place. A failed write raises `write_error`'s UserError (`what`: see there)
  and leaves no temporary file behind.
  """
  data = content.encode("utf-8") if isinstance(content, str) else content
  directory, name = os.path.split(os.path.abspath(path))
  temporary = None
  try:
    fd, temporary = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
    with os.fdopen(fd, "wb") as f:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())
    os.chmod(temporary, 0o666 & ~_UMASK)  # mkstemp makes it private; open() would not
    os.replace(temporary, path)
  except OSError as e:
    if temporary is not None and os.path.exists(temporary):
      os.remove(temporary)
    raise write_error(path, e, what) from None
  return path
