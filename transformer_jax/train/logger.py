"""Training logs: one readable line per log step, WORKDIR/metrics.jsonl, and TensorBoard events."""

from __future__ import annotations

import os
import socket
import struct
import sys
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


# What tensorboardX's package imports if it can and _Events never uses: torch (for its
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


class _Events:
  """TensorBoard scalars and text: tensorboardX's summaries and event protos, framed as TFRecords
  (with tensorboardX's CRC) and appended in the caller's thread by `storage.AppendFile`.

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
                      if key not in ("step", "split", "interval_s", "interval_steps",
                                     "interval_tokens", "compile_tokens")
                      and isinstance(value, (int, float))}, record["step"])

  def train(self, step: int, metrics: dict, learning_rate: float, steps: int = 0,
            seconds: float = 0.0, tokens: float = 0.0, flops: float = 0.0,
            input_seconds: float = 0.0, compile_steps: int = 0, compile_seconds: float = 0.0,
            compile_tokens: float = 0.0, eta_s: float | None = None,
            eval_eta_s: float | None = None) -> None:
    """The interval since the previous call, as `Throughput.take` measures it: `steps` train
    steps timed over `seconds` of the training clock (evaluation, saves and steps that compile
    left out), with `tokens` non-padding tokens and `flops` model FLOPs; `compile_steps` steps
    that compiled (the first of each batch shape), over `compile_seconds`, with
    `compile_tokens`. eta_s: training time left at this process's rate; eval_eta_s: the
    evaluations' left, at the latest one's pace.

    input_seconds: host time spent making and transferring the timed steps' batches. The host
    dispatches steps ahead of the devices, so input stalls training only when this approaches
    the elapsed time; the log shows it as a share of that time.
    """
    record = {"split": "train", "step": step, "time": time.time(),
              **{k: float(v) for k, v in metrics.items()},
              "learning_rate": learning_rate, "interval_s": seconds, "interval_steps": steps,
              "interval_tokens": tokens}
    shown = []
    if steps and seconds > 0:
      record.update(tokens_per_s=tokens / seconds, steps_per_s=steps / seconds)
      shown += [f"{tokens / seconds:,.0f} tok/s", f"{steps / seconds:.2f} steps/s"]
      if flops:
        record["tflops_per_s"] = flops / seconds / 1e12
        shown.append(f"{flops / seconds / 1e9:,.1f} GFLOP/s")
        if self.peak_flops:
          record["mfu"] = flops / seconds / self.peak_flops
          shown.append(f"MFU {record['mfu']:.1%}")
      if input_seconds:
        record["input_share"] = input_seconds / seconds
        shown.append(f"input {record['input_share']:.0%}")
    if compile_steps:
      record.update(compile_s=compile_seconds, compile_steps=compile_steps,
                    compile_tokens=compile_tokens)
      shown.append(f"{compile_steps} step(s) compiling {compile_seconds:.1f}s")
    if eta_s is not None:
      record["eta_s"] = eta_s
      shown.append(f"ETA {progress.duration(eta_s)}" + (
          f" (+{progress.duration(eval_eta_s)} evaluating)" if eval_eta_s else ""))
      if eval_eta_s:
        record["eval_eta_s"] = eval_eta_s
    if not self.enabled:
      return
    self._write(record)
    progress.write(" | ".join([
        f"step {step}/{self.total_steps}", f"loss {record['loss']:.4f}",
        f"acc {record['accuracy']:.4f}", f"lr {learning_rate:.3g}",
        f"gnorm {record['grad_norm']:.3f}",
        *([f"pad {record['padding']:.1%}"] if "padding" in record else []), *shown]))

  def eval(self, step: int, metrics: dict, split: str = "eval",
           seconds: float | None = None) -> None:
    """split: "eval" (data.eval_split, during and after training) or "test" (data.test_split,
    after the last step). seconds: the evaluation's time (as eval_s)."""
    if not self.enabled:
      return
    record = {"split": split, "step": step, "time": time.time(),
              **{k: v for k, v in metrics.items() if isinstance(v, (int, float))}}
    if seconds is not None:
      record["eval_s"] = seconds
    self._write(record)
    if metrics.get("samples"):
      rows = "\n".join(f"| {s['source']} | {s['hypothesis']} | {s['reference']} |"
                       for s in metrics["samples"])
      header = "| source | translation | reference |\n| --- | --- | --- |\n"
      self._tb.text(f"{split}/samples", header + rows, step)
    shown = " | ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                       for k, v in record.items() if k not in ("split", "step", "time"))
    progress.write(f"{split} at step {step} | {shown}")

  def checkpoint(self, step: int, seconds: float) -> None:
    """A checkpoint save: the seconds the loop waited for it (save_s; orbax writes the files in
    the background, so this is mostly the copy of the state off the devices)."""
    if self.enabled:
      self._write({"split": "checkpoint", "step": step, "time": time.time(), "save_s": seconds})

  def text(self, tag: str, text: str) -> None:
    if self.enabled:
      self._tb.text(tag, f"```\n{text}\n```", 0)

  def close(self) -> None:
    if self.enabled:
      self._jsonl.close()
      self._tb.close()
