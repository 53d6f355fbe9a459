"""Training logs: one readable line per log step, WORKDIR/metrics.jsonl, and TensorBoard events."""

from __future__ import annotations

import os
import socket
import struct
import time

from transformer_jax.core import progress, storage
from transformer_jax.core.errors import UserError

METRICS_FILE = "metrics.jsonl"


def read_metrics(workdir: str, required: bool = False) -> list[dict]:
  """The records MetricLogger wrote to WORKDIR/metrics.jsonl, in step order.

  A step logged twice (re-run after a resume from an earlier checkpoint) counts once, by its
  last record per split; lines that do not parse (a write cut off by a kill or a full disk) are
  skipped with a warning. Without the file: [] or, if `required`, a UserError saying to train.
  """
  path = storage.join(workdir, METRICS_FILE)
  if not storage.log_exists(path):
    if required:
      raise UserError(f"{workdir} has no {METRICS_FILE}; train first with --mode=train")
    return []
  latest = {}
  for record in storage.read_jsonl(path):
    if isinstance(record.get("step"), int):
      key = (record.get("split"), record["step"])
      latest.pop(key, None)  # the last record of a step wins, in its place
      latest[key] = record
  return sorted(latest.values(), key=lambda r: r["step"])


class _Events:
  """TensorBoard scalars and text: tensorboardX's summaries and event protos, framed as TFRecords
  (with tensorboardX's CRC) and appended in the caller's thread by `storage.AppendFile`.

  Not tensorboardX's SummaryWriter: its writer thread dies on a full disk without a word, and the
  training loop then blocks forever on the thread's full queue; and its buffered file would
  report the same failure again at exit. Here a failed write raises at the step that made it
  (one UserError naming the file) and leaves the file ending with a whole record.
  """

  def __init__(self, directory: str):
    # Imported here: tensorboardX imports torch when it is installed (seconds), and only
    # training writes events.
    from tensorboardX import summary  # see above
    from tensorboardX.proto.event_pb2 import Event  # see above
    from tensorboardX.record_writer import masked_crc32c  # see above
    self._summary, self._event, self._crc = summary, Event, masked_crc32c
    storage.makedirs(directory)
    # The pid in the name: two runs started within the same second (a resume right after a
    # kill) must not share a file.
    name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}"
    self._file = storage.AppendFile(storage.join(directory, name))
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


def write_hparams(workdir: str, hparams: dict, metrics: dict, step: int) -> None:
  """Adds a sweep trial's overrides and final metrics (as final/NAME) to WORKDIR/tensorboard,
  for the HParams view of the sweep's directory."""
  values = {k: v if isinstance(v, (bool, int, float, str)) else str(v) for k, v in hparams.items()}
  numbers = {f"final/{k}": float(v) for k, v in metrics.items()
             if isinstance(v, (int, float)) and not isinstance(v, bool)
             and k not in ("step", "max_examples", "max_decode_len")}
  events = _Events(storage.join(workdir, "tensorboard"))
  try:
    events.hparams(values, numbers, step)
  finally:
    events.close()


class MetricLogger:
  """Writes metrics to stdout, metrics.jsonl (one JSON object per line) and TensorBoard."""

  def __init__(self, workdir: str, total_steps: int, start_step: int = 0, enabled: bool = True,
               peak_flops: float | None = None):
    """enabled=False (every process but the first of a multi-process run) writes nothing.

    start_step: the step this run starts from. Records of later steps in metrics.jsonl were
    written by a run that stopped before its next checkpoint; they are dropped, as this run
    logs those steps again. peak_flops: the devices' combined peak FLOP/s, for the MFU shown
    in each line.
    """
    self.total_steps = total_steps
    self.enabled = enabled
    self.peak_flops = peak_flops
    self._last_time = time.time()
    self._last_step = start_step
    if not enabled:
      return
    path = storage.join(workdir, METRICS_FILE)
    storage.set_aside_partial_line(path)
    storage.rewrite_jsonl(path, keep=lambda r: not isinstance(r.get("step"), int)
                          or r["step"] <= start_step)
    self._jsonl = storage.JsonLog(path)
    self._tb = _Events(storage.join(workdir, "tensorboard"))

  def _write(self, record: dict) -> None:
    self._jsonl.append(record)
    self._tb.scalars({f"{record['split']}/{key}": value for key, value in record.items()
                      if key not in ("step", "split", "interval_s", "interval_tokens")
                      and isinstance(value, (int, float))}, record["step"])

  def train(self, step: int, metrics: dict, learning_rate: float, tokens: float = 0.0,
            flops: float = 0.0, input_seconds: float = 0.0) -> None:
    """tokens, flops: non-padding tokens and model FLOPs of all steps since the previous call.

    input_seconds: host time spent making and transferring those steps' batches. The host
    dispatches steps ahead of the devices, so input stalls training only when this approaches
    the elapsed time; the log shows it as a share of that time.
    """
    now = time.time()
    elapsed = max(now - self._last_time, 1e-9)
    steps_per_s = (step - self._last_step) / elapsed
    tokens_per_s = (tokens or float(metrics["tokens"]) * (step - self._last_step)) / elapsed
    eta = (self.total_steps - step) / max(steps_per_s, 1e-9)
    self._last_time, self._last_step = now, step
    record = {"split": "train", "step": step, "time": now,
              **{k: float(v) for k, v in metrics.items()},
              "learning_rate": learning_rate, "tokens_per_s": tokens_per_s,
              "steps_per_s": steps_per_s, "interval_s": elapsed,
              "interval_tokens": tokens_per_s * elapsed}
    if input_seconds:
      record["input_share"] = input_seconds / elapsed
    if flops:
      record["tflops_per_s"] = flops / elapsed / 1e12
      if self.peak_flops:
        record["mfu"] = flops / elapsed / self.peak_flops
    if not self.enabled:
      return
    self._write(record)
    progress.write(f"step {step}/{self.total_steps} | loss {record['loss']:.4f} | acc "
          f"{record['accuracy']:.4f} | lr {learning_rate:.3g} | gnorm {record['grad_norm']:.3f} | "
          + (f"pad {record['padding']:.1%} | " if "padding" in record else "")
          + f"{tokens_per_s:,.0f} tok/s | {steps_per_s:.2f} steps/s | "
          + (f"{record['tflops_per_s'] * 1e3:,.1f} GFLOP/s | " if "tflops_per_s" in record else "")
          + (f"MFU {record['mfu']:.1%} | " if "mfu" in record else "")
          + (f"input {record['input_share']:.0%} | " if "input_share" in record else "")
          + f"ETA {progress.duration(eta)}")

  def eval(self, step: int, metrics: dict, split: str = "eval") -> None:
    """split: "eval" (data.eval_split, during and after training) or "test" (data.test_split,
    after the last step)."""
    if not self.enabled:
      return
    record = {"split": split, "step": step, "time": time.time(),
              **{k: v for k, v in metrics.items() if isinstance(v, (int, float))}}
    self._write(record)
    if metrics.get("samples"):
      rows = "\n".join(f"| {s['source']} | {s['hypothesis']} | {s['reference']} |"
                       for s in metrics["samples"])
      header = "| source | translation | reference |\n| --- | --- | --- |\n"
      self._tb.text(f"{split}/samples", header + rows, step)
    shown = " | ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                       for k, v in record.items() if k not in ("split", "step", "time"))
    progress.write(f"{split} at step {step} | {shown}")

  def text(self, tag: str, text: str) -> None:
    if self.enabled:
      self._tb.text(tag, f"```\n{text}\n```", 0)

  def close(self) -> None:
    if self.enabled:
      self._jsonl.close()
      self._tb.close()
