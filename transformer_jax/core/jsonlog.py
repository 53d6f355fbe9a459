"""Append-only logs in a workdir, local or in a bucket: metrics.jsonl and TensorBoard's events.

- `JsonLog` / `read_jsonl`: one JSON object per line. Local: appends to one file; a write that was
  cut off (the process killed, the disk full) leaves at most a partial last line, which the next
  writer sets aside (`set_aside_partial_line`) instead of gluing the next record to it, and
  readers skip it. An object store has no append: each upload is one numbered chunk object under
  `PATH.parts/`, and readers concatenate the chunks in order.
- `AppendFile`: binary records, local to one file, in a bucket to numbered objects PATH.NNNNNN.
- `rewrite_jsonl`: drops records, each file or chunk rewritten whole.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from concurrent import futures
from typing import Callable

from transformer_jax.core import files, storage

PARTIAL_SUFFIX = ".partial"  # where a cut-off last line is set aside: metrics.jsonl.partial
PARTS_SUFFIX = ".parts"  # metrics.jsonl on an object store: metrics.jsonl.parts/000000001.jsonl


def _record(line: bytes):
  """The JSON object of one line, or None if it is not one."""
  try:
    record = json.loads(line.decode("utf-8"))
  except (UnicodeDecodeError, ValueError):
    return None
  return record if isinstance(record, dict) else None


def _parts(path: str) -> list[str]:
  """The chunk objects of an object-store log, in order."""
  directory = path + PARTS_SUFFIX
  return [storage.join(directory, name) for name in storage.listdir(directory)
          if name.endswith(".jsonl")]


def _objects(path: str) -> list[str]:
  """The files of a log: `path` itself if it is there, then (an object store) its chunks."""
  if not storage.is_url(path):
    return [path] if os.path.isfile(path) else []
  return ([path] if storage.isfile(path) else []) + _parts(path)


def _lines(path: str) -> list[bytes]:
  """The lines of a log's file or object, each with its line end."""
  if storage.is_url(path):
    return storage.read_bytes(path).splitlines(keepends=True)
  with open(path, "rb") as f:
    return f.readlines()


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
  """Moves a cut-off last line of the local log `path` (no newline at its end) to `path.partial`.

  Returns the bytes set aside (0 if the file ends cleanly or does not exist, and always on an
  object store, whose chunks are uploaded whole). One `warning:` line goes to `err` (stderr)
  when something was set aside.
  """
  if storage.is_url(path) or not os.path.isfile(path):
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
    raise files.write_error(path, e) from None
  print(f"warning: {path} ended in a cut-off record ({len(partial)} bytes of a write that did "
        f"not finish); set it aside in {os.path.basename(path)}{PARTIAL_SUFFIX}",
        file=err or sys.stderr, flush=True)
  return len(partial)


def read_jsonl(path: str, err=None) -> list[dict]:
  """The JSON objects of a log, skipping lines that do not parse (a cut-off last line, damaged
  bytes) with one `warning:` line on `err` (stderr) naming them. An object store: the object
  `path` if any, then its chunks in order."""
  records, bad, url = [], [], storage.is_url(path)
  for part in _objects(path) if url else [path]:
    for number, line in enumerate(_lines(part), 1):
      if not line.strip():
        continue
      record = _record(line)
      if record is not None:
        records.append(record)
      else:
        bad.append(f"{storage.basename(part)}:{number}" if url else number)
  if bad and url:
    print(f"warning: skipped {len(bad)} unreadable line(s) of {path} ({', '.join(bad[:10])}): "
          "damaged records", file=err or sys.stderr, flush=True)
  elif bad:
    shown = ", ".join(map(str, bad[:10])) + (", ..." if len(bad) > 10 else "")
    print(f"warning: skipped {len(bad)} unreadable line(s) of {path} (line {shown}): cut off "
          "or damaged records", file=err or sys.stderr, flush=True)
  return records


def log_exists(path: str) -> bool:
  """True if the log `path` has any record file (local: the file)."""
  return bool(_objects(path))


def rewrite_jsonl(path: str, keep: Callable[[dict], bool]) -> int:
  """Drops the records for which `keep` is False, each file or chunk rewritten whole (locally
  atomically); returns how many were dropped. Lines that do not parse are kept as they are (a
  reader skips them; they are not ours to drop)."""
  dropped = 0
  for part in _objects(path):
    lines = _lines(part)
    kept = [line for line in lines if (record := _record(line)) is None or keep(record)]
    if len(kept) < len(lines):
      dropped += len(lines) - len(kept)
      if kept or not storage.is_url(path):
        storage.write(part, b"".join(kept))
      else:
        storage.remove(part)
  return dropped


class _LocalFile:
  """Appends records (bytes) to the local file `path`, each in one write. A write that fails
  (disk full) takes back whatever part of its record reached the file, so the file always ends
  with a whole record, and raises `files.write_error`'s UserError."""

  def __init__(self, path: str):
    self.path = path
    try:
      self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    except OSError as e:
      raise files.write_error(path, e) from None

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
      raise files.write_error(self.path, e) from None

  def close(self) -> None:
    if self._fd is not None:
      os.close(self._fd)
      self._fd = None


class _Uploads:
  """Runs uploads in order on one background thread, so that the caller (the training loop)
  never waits for a request. A failed upload is raised by the next `submit` or by `close`; the
  uploads queued after it are dropped unrun (a log with a chunk missing is not continued, and a
  run on its way out after an outage does not wait out each one's tries)."""

  def __init__(self):
    self._pool = futures.ThreadPoolExecutor(1, thread_name_prefix="storage-upload")
    self._pending: list = []
    self._failed = False

  def _run(self, upload: Callable[[], object]) -> None:
    if self._failed:
      return
    try:
      upload()
    except BaseException:
      self._failed = True
      raise

  def _raise_failures(self, wait: bool) -> None:
    keep = []
    for future in self._pending:
      if wait or future.done():
        future.result()  # raises the upload's UserError
      else:
        keep.append(future)
    self._pending = keep

  def submit(self, upload: Callable[[], object]) -> None:
    self._raise_failures(wait=False)
    self._pending.append(self._pool.submit(self._run, upload))

  def close(self) -> None:
    try:
      self._raise_failures(wait=True)
    finally:
      self._pool.shutdown(wait=True)


class _Chunks:
  """Appends on an object store: objects `name(n)`, n = start, start + 1, ..., uploaded in order
  on `_Uploads`' background thread (`close` waits for them).

  Each upload takes everything appended since the previous one began: one record an object
  while the uploads keep up (a run logging every few seconds), several when records come
  faster than requests (a logged step of a few ms), so that the requests, and the background
  thread's hold on the GIL, never grow with the rate of the caller's appends.
  """

  def __init__(self, name, start: int = 0):
    self._name, self._next, self._uploads = name, start, _Uploads()
    self._waiting: list = []  # appended, not yet taken by an upload
    self._queued = False  # an upload that will take them is queued
    self._lock = threading.Lock()

  def append(self, data: bytes) -> None:
    with self._lock:
      self._waiting.append(data)
      if self._queued:
        return
      self._queued = True
    try:
      self._uploads.submit(self._upload)
    except BaseException:  # an earlier upload failed: raised here, nothing new queued
      with self._lock:
        self._queued = False
      raise

  def _upload(self) -> None:
    with self._lock:
      data, self._waiting, self._queued = b"".join(self._waiting), [], False
      number, self._next = self._next, self._next + 1
    storage.write(self._name(number), data)

  def close(self) -> None:
    self._uploads.close()


class AppendFile:
  """Appends binary records to `path`. Local: one file (`_LocalFile`). An object store: objects
  PATH.NNNNNN of one or more appends each (TensorBoard reads every event file of a directory in
  name order, so event files stay readable as a sequence), uploaded as `JsonLog`'s chunks are."""

  def __init__(self, path: str):
    self.path = path
    self._file = (_Chunks(lambda n: f"{path}.{n:06d}") if storage.is_url(path)
                  else _LocalFile(path))

  def append(self, data: bytes) -> None:
    self._file.append(data)

  def close(self) -> None:
    self._file.close()


class JsonLog:
  """Appends one JSON object per line to the log `path`.

  Local: appends to the file, after setting aside a cut-off last line left by an earlier writer
  (killed in the middle of a write), so that the next record does not continue it. An object
  store: the records go to chunk objects PATH.parts/NNNNNNNNN.jsonl (one record each, or several
  appended while the previous upload ran: `_Chunks`), numbered after the chunks already there,
  so a writer killed at any moment leaves only whole records and a later writer never
  overwrites an earlier one. The uploads run on a background thread in order (`close` waits for
  them); a process killed within a request's time of an `append` may lose that record.
  """

  def __init__(self, path: str, err=None):
    self.path = path
    if not storage.is_url(path):
      set_aside_partial_line(path, err)
      self._file = _LocalFile(path)
      return
    names = [storage.basename(p) for p in _parts(path)]
    after = max((int(n.split(".")[0]) for n in names if n.split(".")[0].isdigit()), default=0)
    self._file = _Chunks(lambda n: storage.join(path + PARTS_SUFFIX, f"{n:09d}.jsonl"), after + 1)

  def append(self, record: dict) -> None:
    self._file.append((json.dumps(record) + "\n").encode("utf-8"))

  def close(self) -> None:
    self._file.close()
