"""Training logs: one readable line per log step, and each record to every writer: metrics.jsonl
(`Jsonl`) and the trackers of train.trackers (train/trackers/: TensorBoard, W&B, MLflow)."""

from __future__ import annotations

import os
import time

from transformer_jax import config as config_lib
from transformer_jax.core import jsonlog, progress, storage
from transformer_jax.core.errors import UserError
from transformer_jax.train import trackers
from transformer_jax.train.trackers.base import numbers  # noqa: F401 - a record's numbers
from transformer_jax.train.trackers.tensorboard import write_hparams  # noqa: F401 - for sweeps

METRICS_FILE = "metrics.jsonl"


def read_metrics(workdir: str, required: bool = False) -> list[dict]:
  """The records MetricLogger wrote to WORKDIR/metrics.jsonl, in step order.

  A step logged twice (re-run after a resume from an earlier checkpoint) counts once, by its
  last record per split; lines that do not parse (a write cut off by a kill or a full disk) are
  skipped with a warning. Without the file: [] or, if `required`, a UserError saying to train.
  """
  path = storage.join(workdir, METRICS_FILE)
  if not jsonlog.log_exists(path):
    if required:
      raise UserError(f"{workdir} has no {METRICS_FILE}; train first with --mode=train")
    return []
  latest = {}
  for record in jsonlog.read_jsonl(path):
    if isinstance(record.get("step"), int):
      key = (record.get("split"), record["step"])
      latest.pop(key, None)  # the last record of a step wins, in its place
      latest[key] = record
  return sorted(latest.values(), key=lambda r: r["step"])


def check_trackers(config) -> None:
  """The trackers of train.trackers exist and are installed (one UserError otherwise): checked
  with the rest of a run's config, before the workdir changes."""
  trackers.check(config)


class Jsonl(trackers.Writer):
  """The writer of WORKDIR/metrics.jsonl: each record whole, one JSON object per line."""

  def __init__(self, workdir: str, start_step: int):
    """Records of steps after `start_step` were written by a run that stopped before its next
    checkpoint: they are dropped, as this run logs those steps again."""
    path = storage.join(workdir, METRICS_FILE)
    jsonlog.set_aside_partial_line(path)
    jsonlog.rewrite_jsonl(path, keep=lambda r: not isinstance(r.get("step"), int)
                          or r["step"] <= start_step)
    self._log = jsonlog.JsonLog(path)

  def write(self, records: list) -> None:
    for record in records:
      self._log.append(record)

  def close(self, state: str = "finished") -> None:
    self._log.close()


class MetricLogger:
  """Writes metrics to stdout and to its writers: metrics.jsonl (`Jsonl`) and the trackers of
  train.trackers (`config`; without one, TensorBoard alone), each record to each writer."""

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
    self._kept = None  # (the function giving the checkpoint steps kept, their directory)
    self.trackers_complete = True  # after close: every tracker sent everything
    if config is None:
      config = config_lib.default_config()  # TensorBoard alone
    tracked = trackers.with_runs(config)
    self._run_id = trackers.shared_run_id(workdir) if tracked else None
    self._writers = []
    if not enabled:
      return
    self._writers.append(Jsonl(workdir, start_step))
    # The trackers get metrics.jsonl's earlier records too: those their run lacks are sent.
    backlog = read_metrics(workdir) if self._run_id else []
    self._writers += trackers.open_writers(config, workdir, self._run_id, backlog)

  def _write(self, record: dict) -> None:
    for writer in self._writers:
      writer.write([record])

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
    after the last step). seconds: the evaluation's time (as eval_s). The sample translations
    go into the record too: a tracker that lacks them gets them from metrics.jsonl."""
    if not self.enabled:
      return
    record = {"split": split, "step": step, "time": time.time(), **numbers(metrics)}
    if seconds is not None:
      record["eval_s"] = seconds
    if metrics.get("samples"):
      record["samples"] = [{k: s[k] for k in ("source", "hypothesis", "reference")}
                           for s in metrics["samples"]]
    self._write(record)
    shown = " | ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                       for k, v in record.items() if k not in ("split", "step", "time", "samples"))
    progress.write(f"{split} at step {step} | {shown}")

  def checkpoint(self, step: int, seconds: float, kept=None, directory: str = "") -> None:
    """A checkpoint save: the seconds the loop waited for it (save_s; orbax writes the files in
    the background, so this is mostly the copy of the state off the devices). kept: a function
    returning the steps the workdir keeps now, in `directory`, for the trackers (references,
    not weights; asked only where a tracker keeps a run, and again at the close, when every
    save is written)."""
    if self.enabled:
      self._write({"split": "checkpoint", "step": step, "time": time.time(), "save_s": seconds})
      if kept is not None and self._run_id:
        self._kept = (kept, directory)
        self._checkpoints()

  def _checkpoints(self) -> None:
    kept, directory = self._kept
    steps = list(kept())
    for writer in self._writers:
      writer.checkpoints(steps, directory)

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
    self._write(record)  # the trackers' run takes it as its summary (base.Background)
    progress.write(f"start-up {startup_s:.1f} s: set-up {setup_s:.1f} s, first step "
                   f"{startup_s - setup_s:.1f} s (tracing {record['trace_s']:.1f} s, lowering "
                   f"{record['lower_s']:.1f} s, compiling {record['compile_s']:.1f} s; "
                   f"compilation cache: {_CACHE_WORDS[spent['cache']]})")

  def text(self, tag: str, text: str) -> None:
    if self.enabled:
      for writer in self._writers:
        writer.text(tag, text, 0)

  def summary(self, values: dict) -> None:
    """The run's figures at its end, for the trackers (metrics.jsonl and summary.md have them)."""
    if self.enabled:
      for writer in self._writers:
        writer.summary(values)

  def close(self, state: str = "finished") -> None:
    """state (for the trackers): finished | stopped (by a signal; resumable) | failed."""
    if self.enabled and not self._closed:
      self._closed = True
      if self._kept is not None and state != "failed":
        self._checkpoints()  # the newest save, in flight at its record, is written now
      for writer in self._writers:
        writer.close(state)
      self.trackers_complete = all(writer.complete for writer in self._writers)

  def __enter__(self):
    return self

  def __exit__(self, kind, error, traceback):
    self.close("finished" if kind is None else "failed")


_CACHE_WORDS = {"hit": "hit", "miss": "miss, now stored", "partly": "partly hit",
                "off": "off", "none": "not needed, compiled in this process already"}


def publish_images(config, workdir: str, paths: list, step: int) -> None:
  """--mode=plot's PNG files, to the workdir's tracker run (after training: the run resumed for
  the images alone); nothing without a tracker run."""
  _send(config, workdir, lambda writer, files: writer.images(files, step),
        {storage.basename(p).rsplit(".", 1)[0]: p for p in paths})


# The run's own files, uploaded to its tracker run at the end of training and by a sync: what a
# tracker's page then shows of the run as the workdir has it (and --mode=plot's plots).
RUN_FILES = ("config.json", "summary.md", "metrics.jsonl")


def _run_files(workdir: str) -> dict:
  found = {name: storage.join(workdir, name) for name in RUN_FILES}
  found = {name: path for name, path in found.items() if storage.exists(path)}
  plots = storage.join(workdir, "plots")
  if storage.exists(plots):
    found.update({f"plots/{name}": storage.join(plots, name)
                  for name in sorted(storage.listdir(plots)) if name.endswith(".png")})
  return found


def publish_run_files(config, workdir: str) -> None:
  """The run's files (RUN_FILES and plots/) of a trained workdir to its tracker run (resumed
  for them, after summary.md is written); nothing without a tracker run."""
  _send(config, workdir, lambda writer, files: writer.files(files), _run_files(workdir))


def sync_trackers(config, workdir: str) -> bool | None:
  """Sends a workdir's tracker runs what they lack (metrics.jsonl's records they do not show,
  the run's files) and closes them as finished: a run whose tracker was away at its end, or a
  workdir trained before the tracker was chosen. On process 0 alone. Whether they got it all
  (else each said what it did not get); None without a tracker that keeps a run."""
  if not trackers.with_runs(config):
    return None
  return _send(config, workdir, lambda writer, files: writer.files(files), _run_files(workdir),
               run_id=trackers.claim_run_id(workdir), backlog=read_metrics(workdir))


def _send(config, workdir: str, send, paths: dict, run_id: str | None = None,
          backlog: list = ()) -> bool:
  """send(writer, {name: local file}) for each tracker run of the workdir, then its close;
  whether every writer sent everything."""
  run_id = run_id or (trackers.read_run_id(workdir) if trackers.with_runs(config) else None)
  if not run_id or not (paths or backlog):
    return True
  import tempfile
  with tempfile.TemporaryDirectory() as local:
    # The trackers upload local files; a bucket workdir's are copied, under the same names.
    files = {name: path if not storage.is_url(path) else _copy_local(path, local, name)
             for name, path in paths.items()}
    writers = trackers.open_writers(config, workdir, run_id, backlog, tensorboard=False)
    for writer in writers:
      if files:
        send(writer, files)
      writer.close("finished")
  return all(writer.complete for writer in writers)


def _copy_local(path: str, directory: str, name: str) -> str:
  local = os.path.join(directory, os.path.dirname(name), storage.basename(path))
  os.makedirs(os.path.dirname(local), exist_ok=True)
  with open(local, "wb") as f:
    f.write(storage.read_bytes(path))
  return local
