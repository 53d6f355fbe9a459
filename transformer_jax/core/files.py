"""Atomic file writes: a reader sees the old file or the new one, never a half-written one."""

from __future__ import annotations

import os


def atomic_write(path: str, content: bytes | str) -> str:
  """Writes `content` to `path` through a temporary file and a rename; returns `path`.

  The rename is atomic on POSIX file systems, so a crash or a full disk mid-write leaves the
  previous file in place (and at most a stray `path.tmp`).
  """
  data = content.encode("utf-8") if isinstance(content, str) else content
  temporary = path + ".tmp"
  with open(temporary, "wb") as f:
    f.write(data)
  os.replace(temporary, path)
  return path
