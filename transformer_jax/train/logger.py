"""Training logs: one readable line per log step, WORKDIR/metrics.jsonl, TensorBoard events, and
the experiment trackers of train.trackers (train/trackers/: W&B, MLflow), all fed from here."""

from __future__ import annotations

import os
import socket
import struct
import sys
import time

from transformer_jax.core import progress, storage
from transformer_jax.core.errors import UserError
from transformer_jax.train import trackers

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


def check_trackers(config) -> None:
  """The trackers of train.trackers exist and are installed (one UserError otherwise): checked
  with the rest of a run's config, before the workdir changes."""
  trackers.check(config)


# The keys of a record that are bookkeeping, not metrics (summed by tools/summary.py instead).
_NOT_SCALARS = ("step", "split", "interval_s", "interval_steps", "interval_tokens",
                "compile_tokens")


def _scalars(record: dict) -> dict:
  """{"SPLIT/KEY": number} of a metrics.jsonl record, as TensorBoard and the trackers show it."""
  return {f"{record['split']}/{key}": value for key, value in record.items()
          if key not in _NOT_SCALARS and isinstance(value, (int, float))
          and not isinstance(value, bool)}


class MetricLogger:
  """Writes metrics to stdout, metrics.jsonl (one JSON object per line), TensorBoard and the
  trackers of train.trackers (`config`; without one, TensorBoard alone)."""

  def __init__(self, workdir: str, total_steps: int, start_step: int = 0, enabled: bool = True,
               peak_flops: float | None = None, config=None):
    """enabled=False (every process but the first of a multi-process run) writes nothing.

    start_step: the step this run starts from. Records of later steps in metrics.jsonl were
    written by a run that stopped before its next checkpoint; they are dropped, as this run
    logs those steps again (and the trackers, which show them already, skip them). peak_flops:
    the devices' combined peak FLOP/s, for the MFU shown in each line. Every process of a job
    must make its logger: the tracker run's id goes from the first to the others.
    """
    self.total_steps = total_steps
    self.enabled = enabled
    self.peak_flops = peak_flops
    self._closed = False
    self.trackers_complete = True  # after close: every tracker sent everything
    chosen = trackers.check(config) if config is not None else ["tensorboard"]
    run_id = (trackers.shared_run_id(workdir) if set(chosen) - {"tensorboard"} else None)
    if not enabled:
      return
    path = storage.join(workdir, METRICS_FILE)
    storage.set_aside_partial_line(path)
    storage.rewrite_jsonl(path, keep=lambda r: not isinstance(r.get("step"), int)
                          or r["step"] <= start_step)
    self._jsonl = storage.JsonLog(path)
    self._tb = (_Events(storage.join(workdir, "tensorboard")) if "tensorboard" in chosen
                else None)
    # The trackers get metrics.jsonl's earlier records too: those their run lacks are sent.
    self._trackers = (trackers.open_trackers(config, workdir, run_id, _backlog(workdir))
                      if run_id else [])

  def _write(self, record: dict) -> None:
    self._jsonl.append(record)
    values = _scalars(record)
    if self._tb:
      self._tb.scalars(values, record["step"])
    for tracker in self._trackers:
      tracker.scalars(record["split"], values, record["step"])

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
      rows = [[s["source"], s["hypothesis"], s["reference"]] for s in metrics["samples"]]
      if self._tb:
        header = "| source | translation | reference |\n| --- | --- | --- |\n"
        self._tb.text(f"{split}/samples", header + "\n".join(f"| {' | '.join(row)} |"
                                                             for row in rows), step)
      for tracker in self._trackers:
        tracker.table(f"{split}/samples", ["source", "translation", "reference"], rows, step)
    shown = " | ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                       for k, v in record.items() if k not in ("split", "step", "time"))
    progress.write(f"{split} at step {step} | {shown}")

  def checkpoint(self, step: int, seconds: float, kept=None, directory: str = "") -> None:
    """A checkpoint save: the seconds the loop waited for it (save_s; orbax writes the files in
    the background, so this is mostly the copy of the state off the devices). kept: a function
    returning the steps the workdir keeps now, in `directory`, for the trackers (references,
    not weights; asked only where a tracker takes them)."""
    if self.enabled:
      self._write({"split": "checkpoint", "step": step, "time": time.time(), "save_s": seconds})
      steps = list(kept()) if kept is not None and self._trackers else None
      for tracker in self._trackers if steps is not None else ():
        tracker.checkpoints(steps, directory)

  def startup(self, step: int, setup_s: float, startup_s: float, spent: dict) -> None:
    """Where this run's start-up went, up to the end of its first step: set-up (config, data,
    tokenizer, checkpoint, initial state: `setup_s`), then the first step's tracing, lowering and
    compiling as JAX counted them (`compilation.Clock.read()`: `spent`), and whether the
    compilation cache answered. A record of its own in metrics.jsonl (split "startup")."""
    record = {"split": "startup", "step": step, "time": time.time(), "startup_s": startup_s,
              "setup_s": setup_s, **{k: float(spent[k]) for k in ("trace_s", "lower_s",
                                                                   "compile_s")},
              "cache_hits": int(spent["cache_hits"]), "cache_misses": int(spent["cache_misses"]),
              "cache": spent["cache"]}
    if not self.enabled:
      return
    # metrics.jsonl and TensorBoard; the trackers take it as the run's summary, not as a series
    # (a resumed run has one start-up per run, at steps the series already shows).
    self._jsonl.append(record)
    values = _scalars(record)
    if self._tb:
      self._tb.scalars(values, step)
    for tracker in self._trackers:  # at the run's first step: one point per run in MLflow
      tracker.summary({"step": step, **values})
    progress.write(f"start-up {startup_s:.1f} s: set-up {setup_s:.1f} s, first step "
                   f"{startup_s - setup_s:.1f} s (tracing {record['trace_s']:.1f} s, lowering "
                   f"{record['lower_s']:.1f} s, compiling {record['compile_s']:.1f} s; "
                   f"compilation cache: {_CACHE_WORDS[spent['cache']]})")

  def text(self, tag: str, text: str) -> None:
    if self.enabled and self._tb:
      self._tb.text(tag, f"```\n{text}\n```", 0)

  def summary(self, values: dict) -> None:
    """The run's figures at its end, for the trackers (metrics.jsonl and summary.md have them)."""
    if self.enabled:
      for tracker in self._trackers:
        tracker.summary(values)

  def close(self, state: str = "finished") -> None:
    """state (for the trackers): finished | stopped (by a signal; resumable) | failed."""
    if self.enabled and not self._closed:
      self._closed = True
      self._jsonl.close()
      if self._tb:
        self._tb.close()
      for tracker in self._trackers:
        tracker.close(state)
      self.trackers_complete = all(tracker.complete for tracker in self._trackers)

  def __enter__(self):
    return self

  def __exit__(self, kind, error, traceback):
    self.close("finished" if kind is None else "failed")


_CACHE_WORDS = {"hit": "hit", "miss": "miss, now stored", "partly": "partly hit",
                "off": "off", "none": "not needed, compiled in this process already"}


def publish_images(config, workdir: str, paths: list, step: int) -> None:
  """--mode=plot's PNG files, to the workdir's tracker run (after training: the run resumed for
  the images alone); nothing without a tracker run or a tracker that shows images."""
  _publish(config, workdir, paths, lambda tracker, files: tracker.images(files, step))


# The run's own files, uploaded to its tracker run at the end of training (beside the plots of
# --mode=plot): what a tracker's page then shows of the run as the workdir has it.
RUN_FILES = ("config.json", "summary.md", "metrics.jsonl")


def publish_run_files(config, workdir: str) -> None:
  """RUN_FILES of a trained workdir to its tracker run (resumed for them, after summary.md is
  written); nothing without a tracker run."""
  paths = [storage.join(workdir, name) for name in RUN_FILES
           if storage.exists(storage.join(workdir, name))]
  _publish(config, workdir, paths, lambda tracker, files: tracker.files(files))


def sync_trackers(config, workdir: str) -> bool:
  """Sends a trained workdir's tracker runs what they lack (metrics.jsonl's records they do not
  show, the run's files) and closes them as finished: a run whose tracker was away at its end,
  or a workdir trained before the tracker was chosen. Whether there was a tracker to sync."""
  chosen = [n for n in trackers.check(config) if n != "tensorboard"]
  if not chosen:
    return False
  # Process 0 alone gets here: its own claim, not shared_run_id's broadcast to the job (which
  # every process must join, and would wait for the others for good).
  run_id = trackers.claim_run_id(workdir)
  for tracker in trackers.open_trackers(config, workdir, run_id, _backlog(workdir)):
    tracker.close("finished")
  publish_run_files(config, workdir)
  return True


def _backlog(workdir: str) -> list:
  """metrics.jsonl's records as the trackers take them (Background's backlog)."""
  return [(r["split"], _scalars(r), r["step"]) for r in read_metrics(workdir)
          if isinstance(r.get("split"), str) and r["split"] != "startup"]


def _publish(config, workdir: str, paths: list, send) -> None:
  chosen = [n for n in trackers.check(config) if n != "tensorboard"]
  run_id = trackers.read_run_id(workdir) if chosen else None
  if not run_id or not paths:
    return
  import tempfile
  with tempfile.TemporaryDirectory() as local:
    files = {}
    for path in paths:  # the trackers upload local files; a bucket workdir's are copied
      name = storage.basename(path).rsplit(".", 1)[0]
      files[name] = path if not storage.is_url(path) else _copy_local(path, local)
    for tracker in trackers.open_trackers(config, workdir, run_id):
      send(tracker, files)
      tracker.close("finished")


def _copy_local(path: str, directory: str) -> str:
  local = os.path.join(directory, storage.basename(path))
  with open(local, "wb") as f:
    f.write(storage.read_bytes(path))
  return local
