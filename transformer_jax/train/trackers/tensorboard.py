"""TensorBoard (train.trackers=tensorboard): WORKDIR/tensorboard's event files, written on the
caller's thread, so that a full disk is said at the step that met it."""

from __future__ import annotations

import os
import socket
import struct
import sys
import time

from transformer_jax.core import jsonlog, storage
from transformer_jax.train.trackers.base import BOOKKEEPING, Writer, numbers, sample_rows, scalars

# What tensorboardX's package imports if it can and Events never uses: torch (for its
# SummaryWriter's tensor conversions; about 2 s to import where torch is installed, as in a test
# environment) and two cloud clients (for its own writers to buckets; ours go through
# core/storage.py). Each is optional there: tensorboardX catches the ImportError.
_TENSORBOARDX_EXTRAS = ("torch", "boto3", "google.cloud.storage")


def _tensorboardx():
  """(tensorboardX.summary, its Event proto, its masked CRC-32C), imported without the extras
  above when they are not imported yet (0.3 s instead of 2.3 s with torch installed). Imported
  here, not at the top: only training writes events."""
  hidden = [name for name in _TENSORBOARDX_EXTRAS if name not in sys.modules]
  for name in hidden:
    sys.modules[name] = None  # `import name` raises ImportError while this holds
  try:
    from tensorboardX import summary
    from tensorboardX.proto.event_pb2 import Event
    from tensorboardX.record_writer import masked_crc32c
  finally:
    for name in hidden:
      if sys.modules.get(name, 0) is None:
        del sys.modules[name]
  return summary, Event, masked_crc32c


class Events:
  """TensorBoard scalars and text: tensorboardX's summaries and event protos, framed as TFRecords
  (with tensorboardX's CRC) and appended in the caller's thread by `jsonlog.AppendFile`.

  Not tensorboardX's SummaryWriter: its writer thread dies on a full disk without a word, and the
  training loop then blocks forever on the thread's full queue; and its buffered file would
  report the same failure again at exit. Here a failed write raises at the step that made it
  (one UserError naming the file) and leaves the file ending with a whole record.
  """

  def __init__(self, directory: str):
    self._summary, self._event, self._crc = _tensorboardx()
    storage.makedirs(directory)
    # The pid in the name: two runs started within the same second (a resume right after a
    # kill) must not share a file.
    name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}"
    self._file = jsonlog.AppendFile(storage.join(directory, name))
    self._append([self._event(wall_time=time.time(), file_version="brain.Event:2")])

  def _record(self, data: bytes) -> bytes:
    """One TFRecord: length, its CRC, the data, its CRC (little-endian, as TensorBoard reads)."""
    header = struct.pack("<Q", len(data))
    return (header + struct.pack("<I", self._crc(header)) + data
            + struct.pack("<I", self._crc(data)))

  def _append(self, events: list) -> None:
    self._file.append(b"".join(self._record(e.SerializeToString()) for e in events))

  def write(self, summaries: list, step: int) -> None:
    self._append([self._event(summary=s, step=step, wall_time=time.time()) for s in summaries])

  def scalars(self, values: dict, step: int) -> None:
    self.write([self._summary.scalar(tag, value) for tag, value in values.items()], step)

  def text(self, tag: str, text: str, step: int) -> None:
    self.write([self._summary.text(tag, text)], step)

  def hparams(self, hparams: dict, metrics: dict, step: int) -> None:
    """TensorBoard's HParams view: the run's hyperparameters and its metrics (also written as
    scalars, where the view reads their values)."""
    self.write(list(self._summary.hparams(hparams, metrics)), step)
    self.scalars(metrics, step)

  def close(self) -> None:
    self._file.close()


class TensorBoard(Writer):
  """The writer of WORKDIR/tensorboard: each record's series as scalars, its samples as a
  Markdown table."""

  name = "tensorboard"

  def __init__(self, workdir: str):
    self._events = Events(storage.join(workdir, "tensorboard"))

  def write(self, records: list) -> None:
    for record in records:
      self._events.scalars(scalars(record), record["step"])
      if rows := sample_rows(record):
        header = "| source | translation | reference |\n| --- | --- | --- |\n"
        self._events.text(f"{record['split']}/samples",
                          header + "\n".join(f"| {' | '.join(row)} |" for row in rows),
                          record["step"])

  def text(self, tag: str, text: str, step: int) -> None:
    self._events.text(tag, f"```\n{text}\n```", step)

  def close(self, state: str = "finished") -> None:
    self._events.close()


def write_hparams(workdir: str, hparams: dict, metrics: dict, step: int) -> None:
  """Adds a sweep trial's overrides and final metrics (as final/NAME) to WORKDIR/tensorboard,
  for the HParams view of the sweep's directory."""
  values = {k: v if isinstance(v, (bool, int, float, str)) else str(v) for k, v in hparams.items()}
  finals = {f"final/{k}": float(v) for k, v in numbers(
      metrics, (*BOOKKEEPING, "max_examples", "max_decode_len")).items()}
  events = Events(storage.join(workdir, "tensorboard"))
  try:
    events.hparams(values, finals, step)
  finally:
    events.close()
