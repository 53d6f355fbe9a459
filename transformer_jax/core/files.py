"""Files that survive a crash, a full disk or a read-only file system.

- `atomic_write`: a reader sees the old file or the new one, never a half-written one.
- `JsonLog` / `read_jsonl`: append-only logs of one JSON object per line (metrics.jsonl). A write
  that was cut off (the process killed, the disk full) leaves at most a partial last line; the
  next writer sets it aside instead of gluing the next record to it, and readers skip it.
- `write_error`: the one-line UserError for a write that failed (the path, why, and for a full
  disk the free space left), so that every writer reports a full disk the same way.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import sys
import tempfile
from typing import Callable, Optional

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


# ----------------------------------------------------------------------------- JSON-lines logs

PARTIAL_SUFFIX = ".partial"  # where a cut-off last line is set aside: metrics.jsonl.partial


def _cut_off_tail(path: str) -> int:
  """The byte offset after the last newline of `path` (its size if it ends in one)."""
  with open(path, "rb") as f:
    size = f.seek(0, os.SEEK_END)
    end = size
    while end > 0:
      start = max(0, end - 65536)
      f.seek(start)
      chunk = f.read(end - start)
      newline = chunk.rfind(b"\n")
      if newline >= 0:
        return start + newline + 1
      end = start
  return 0


def set_aside_partial_line(path: str, err=None) -> int:
  """Moves a cut-off last line of `path` (no newline at its end) to `path.partial`.

  Returns the bytes set aside (0 if the file ends cleanly or does not exist). One `warning:` line
  goes to `err` (stderr) when something was set aside.
  """
  if not os.path.isfile(path):
    return 0
  keep = _cut_off_tail(path)
  size = os.path.getsize(path)
  if keep == size:
    return 0
  with open(path, "rb") as f:
    f.seek(keep)
    partial = f.read()
  try:
    with open(path + PARTIAL_SUFFIX, "ab") as f:
      f.write(partial + b"\n")
    os.truncate(path, keep)
  except OSError as e:
    raise write_error(path, e) from None
  print(f"warning: {path} ended in a cut-off record ({len(partial)} bytes of a write that did "
        f"not finish); set it aside in {os.path.basename(path)}{PARTIAL_SUFFIX}",
        file=err or sys.stderr, flush=True)
  return len(partial)


def read_jsonl(path: str, err=None) -> list[dict]:
  """The JSON objects of a JSON-lines file, skipping lines that do not parse (a cut-off last
  line, damaged bytes) with one `warning:` line on `err` (stderr) naming them."""
  records, bad = [], []
  with open(path, "rb") as f:
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        record = json.loads(line.decode("utf-8"))
      except (UnicodeDecodeError, ValueError):
        bad.append(number)
        continue
      if isinstance(record, dict):
        records.append(record)
      else:
        bad.append(number)
  if bad:
    shown = ", ".join(map(str, bad[:10])) + (", ..." if len(bad) > 10 else "")
    print(f"warning: skipped {len(bad)} unreadable line(s) of {path} (line {shown}): cut off "
          "or damaged records", file=err or sys.stderr, flush=True)
  return records


def rewrite_jsonl(path: str, keep: Callable[[dict], bool]) -> int:
  """Atomically drops the records of `path` for which `keep` is False; returns how many.

  Lines that do not parse are kept as they are (a reader skips them; they are not ours to drop).
  """
  if not os.path.isfile(path):
    return 0
  kept, dropped = [], 0
  with open(path, "rb") as f:
    for line in f:
      try:
        record = json.loads(line.decode("utf-8"))
      except (UnicodeDecodeError, ValueError):
        record = None
      if isinstance(record, dict) and not keep(record):
        dropped += 1
      else:
        kept.append(line)
  if dropped:
    atomic_write(path, b"".join(kept))
  return dropped


class AppendFile:
  """Appends records (bytes) to `path`, each in one write. A write that fails (disk full) takes
  back whatever part of its record reached the file, so the file always ends with a whole
  record, and raises `write_error`'s UserError."""

  def __init__(self, path: str):
    self.path = path
    try:
      self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    except OSError as e:
      raise write_error(path, e) from None

  def append(self, data: bytes) -> None:
    size = os.fstat(self._fd).st_size
    try:
      written = 0
      while written < len(data):
        written += os.write(self._fd, data[written:])
    except OSError as e:
      try:
        os.ftruncate(self._fd, size)
      except OSError:
        pass  # a JsonLog's next writer sets the partial line aside
      raise write_error(self.path, e) from None

  def close(self) -> None:
    if self._fd is not None:
      os.close(self._fd)
      self._fd = None


class JsonLog:
  """Appends one JSON object per line to `path` (an AppendFile).

  On opening, a cut-off last line left by an earlier writer (killed in the middle of a write) is
  set aside, so that the next record does not continue it.
  """

  def __init__(self, path: str, err=None):
    set_aside_partial_line(path, err)
    self._file = AppendFile(path)
    self.path = path

  def append(self, record: dict) -> None:
    self._file.append((json.dumps(record) + "\n").encode("utf-8"))

  def close(self) -> None:
    self._file.close()


def append_jsonl(path: str, record: dict) -> None:
  """One record appended to `path` (see JsonLog), for logs written now and then."""
  log = JsonLog(path)
  try:
    log.append(record)
  finally:
    log.close()
