"""Training logs: one readable line per log step, WORKDIR/metrics.jsonl, and TensorBoard events."""

from __future__ import annotations

import json
import os
import time

from transformer_jax.core.errors import UserError


def _duration(seconds: float) -> str:
  seconds = int(max(seconds, 0))
  h, rem = divmod(seconds, 3600)
  m, s = divmod(rem, 60)
  return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


METRICS_FILE = "metrics.jsonl"


def read_metrics(workdir: str, required: bool = False) -> list[dict]:
  """Every record MetricLogger wrote to WORKDIR/metrics.jsonl.

  Without the file: [] or, if `required`, a UserError saying to train first.
  """
  path = os.path.join(workdir, METRICS_FILE)
  if not os.path.exists(path):
    if required:
      raise UserError(f"{workdir} has no {METRICS_FILE}; train first with --mode=train")
    return []
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


class MetricLogger:
  """Writes metrics to stdout, metrics.jsonl (one JSON object per line) and TensorBoard."""

  def __init__(self, workdir: str, total_steps: int, start_step: int = 0, enabled: bool = True,
               peak_flops: float | None = None):
    """enabled=False (every process but the first of a multi-process run) writes nothing.

    peak_flops: the devices' combined peak FLOP/s, for the MFU shown in each line.
    """
    self.total_steps = total_steps
    self.enabled = enabled
    self.peak_flops = peak_flops
    self._last_time = time.time()
    self._last_step = start_step
    if not enabled:
      return
    self._jsonl = open(os.path.join(workdir, METRICS_FILE), "a", encoding="utf-8")
    # Imported here: tensorboardX imports torch when it is installed (seconds), and only
    # training writes events.
    from tensorboardX import SummaryWriter  # see above
    self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))

  def _write(self, record: dict) -> None:
    self._jsonl.write(json.dumps(record) + "\n")
    self._jsonl.flush()
    for key, value in record.items():
      if key not in ("step", "split") and isinstance(value, (int, float)):
        self._tb.add_scalar(f"{record['split']}/{key}", value, record["step"])
    self._tb.flush()

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
              "steps_per_s": steps_per_s}
    if input_seconds:
      record["input_share"] = input_seconds / elapsed
    if flops:
      record["tflops_per_s"] = flops / elapsed / 1e12
      if self.peak_flops:
        record["mfu"] = flops / elapsed / self.peak_flops
    if not self.enabled:
      return
    self._write(record)
    print(f"step {step}/{self.total_steps} | loss {record['loss']:.4f} | acc "
          f"{record['accuracy']:.4f} | lr {learning_rate:.3g} | gnorm {record['grad_norm']:.3f} | "
          + (f"pad {record['padding']:.1%} | " if "padding" in record else "")
          + f"{tokens_per_s:,.0f} tok/s | {steps_per_s:.2f} steps/s | "
          + (f"{record['tflops_per_s'] * 1e3:,.1f} GFLOP/s | " if "tflops_per_s" in record else "")
          + (f"MFU {record['mfu']:.1%} | " if "mfu" in record else "")
          + (f"input {record['input_share']:.0%} | " if "input_share" in record else "")
          + f"ETA {_duration(eta)}",
          flush=True)

  def eval(self, step: int, metrics: dict) -> None:
    if not self.enabled:
      return
    record = {"split": "eval", "step": step, "time": time.time(),
              **{k: v for k, v in metrics.items() if isinstance(v, (int, float))}}
    self._write(record)
    if metrics.get("samples"):
      rows = "\n".join(f"| {s['source']} | {s['hypothesis']} | {s['reference']} |"
                       for s in metrics["samples"])
      header = "| source | translation | reference |\n| --- | --- | --- |\n"
      self._tb.add_text("eval/samples", header + rows, step)
    shown = " | ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                       for k, v in record.items() if k not in ("split", "step", "time"))
    print(f"eval at step {step} | {shown}", flush=True)

  def text(self, tag: str, text: str) -> None:
    if self.enabled:
      self._tb.add_text(tag, f"```\n{text}\n```", 0)

  def close(self) -> None:
    if self.enabled:
      self._jsonl.close()
      self._tb.close()
