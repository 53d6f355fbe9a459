"""The training loop's side jobs, each a small object the loop calls once per step.

In the manner of CLU's `periodic_actions` and big_vision's `Chrono`. Written here rather than
taken from CLU: CLU's `PeriodicAction` fires on `step % every == 0` alone, while ours must also
fire on the last step, on a preemption, and save whenever an evaluation ranks checkpoints;
and the throughput and NaN bookkeeping below work on host-side values that CLU does not see.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

import jax

from transformer_jax.core import progress
from transformer_jax.core.errors import UserError
from transformer_jax.model import ModelConfig
from transformer_jax.model.flops import train_flops_per_step


@dataclasses.dataclass(frozen=True)
class Due:
  """What the loop does after a step: check the NaN flags, log, evaluate, save, stop."""

  log: bool
  eval: bool
  save: bool
  stop: bool

  @property
  def sync(self) -> bool:
    """Whether the step's results are read back to the host at all."""
    return self.log or self.eval or self.save


class Periodic:
  """Decides from `config.train` which periodic jobs are due after a step."""

  def __init__(self, train_config):
    self.t = train_config

  def due(self, step: int, stop: bool) -> Due:
    """`step`: steps done so far; `stop`: a preemption asks to stop after this step."""
    t = self.t
    last = step == t.steps
    run_eval = bool(t.eval_every and step % t.eval_every == 0) and not (stop or last)
    # A save after an evaluation lets keep_best rank the checkpoint by its metrics.
    save = stop or last or step % t.checkpoint_every == 0 or (run_eval and t.keep_best > 0)
    return Due(log=step % t.log_every == 0 or last, eval=run_eval, save=save, stop=stop)


class Throughput:
  """Tokens, model FLOPs and host input time since the last log line, and tokens in all.

  Counted from the batch plan on the host, so no device value is waited for.
  """

  def __init__(self, model_config: ModelConfig):
    self.model_config = model_config
    self.tokens_seen = 0  # source + target, no padding, over the whole run
    self.started = time.time()
    self._reset()

  def _reset(self) -> None:
    self.tokens = self.flops = self.input_seconds = 0.0

  @contextlib.contextmanager
  def input(self):
    """Times the host's work of making and transferring a batch."""
    start = time.perf_counter()
    yield
    self.input_seconds += time.perf_counter() - start

  def count(self, tokens: int, shape: tuple) -> None:
    """tokens: non-padding tokens of a global batch, both sides; shape: its (rows, source
    length, target length)."""
    self.tokens_seen += tokens
    self.tokens += tokens
    self.flops += train_flops_per_step(self.model_config, *shape)

  def take(self) -> dict:
    """The interval's counts (the keyword arguments of `MetricLogger.train`); starts a new one."""
    interval = {"tokens": self.tokens, "flops": self.flops, "input_seconds": self.input_seconds}
    self._reset()
    return interval

  @property
  def wall_time(self) -> float:
    return time.time() - self.started


class EarlyProgress:
  """Plain lines (not metrics records) before the first log line of a run: one after the
  first step, which includes compilation, then one every `every` seconds until the periodic
  log takes over, so that a slow recipe (log_every=100 at 0.5 steps/s) is not silent for
  minutes. Each reads the step's loss back: a sync that the steps after the first log skip.
  """

  def __init__(self, start: int, total: int, log_every: int, every: float = 30.0):
    self.total, self.every = total, every
    self.first_log = min((start // log_every + 1) * log_every, total)
    self.start = start
    self.started = time.time()  # made just before the run's first step is dispatched
    self.first_done = self.last = None

  def line(self, step: int, metrics, now=None) -> str:
    """The line to print after `step` (steps done so far), or "" if none is due."""
    if step >= self.first_log:
      return ""  # the periodic log speaks from here on
    now = time.time() if now is None else now
    if self.first_done is None:
      self.first_done = self.last = now
      loss = float(jax.device_get(metrics["loss"]))
      return (f"step {step}/{self.total} done in {now - self.started:.1f}s (compilation "
              f"included) | loss {loss:.4f} | the log follows at step {self.first_log}")
    if now - self.last < self.every:
      return ""
    self.last = now
    rate = (step - self.start - 1) / max(now - self.first_done, 1e-9)
    loss = float(jax.device_get(metrics["loss"]))
    return (f"step {step}/{self.total} | loss {loss:.4f} | {rate:.2f} steps/s | ETA "
            f"{progress.duration((self.total - step) / max(rate, 1e-9))}")


class PendingSteps:
  """Steps dispatched to the devices whose results the host has not read yet.

  The host may run at most `ahead` steps in front of the devices: enough to hide dispatch and
  input time, and few enough that a preemption signal is honoured within a step or two rather
  than after every step queued since the last read.
  """

  def __init__(self, ahead: int = 2):
    self.ahead = ahead
    self._steps = []  # (step, metrics on the device)

  def push(self, step: int, metrics: dict) -> None:
    self._steps.append((step, metrics))
    if len(self._steps) > self.ahead:
      self._steps[-1 - self.ahead][1]["finite"].block_until_ready()

  def drain(self) -> list:
    steps, self._steps = self._steps, []
    return steps


class NonFinitePolicy:
  """Reports the steps whose loss or gradients were NaN/inf (train.on_nonfinite).

  The step itself did not apply those updates. "skip": one line per skipped step. "stop": a
  UserError naming the first such step, raised once the saves in flight are written, so the
  checkpoints on disk are the good ones from before it.
  """

  def __init__(self, policy: str, manager):
    self.policy = policy
    self.manager = manager

  def check(self, steps: list) -> None:
    """steps: [(step, metrics)] from `PendingSteps.drain`."""
    values = jax.device_get([(m["finite"], m["loss"], m["grad_norm"]) for _, m in steps])
    for (step, _), (finite, loss, grad_norm) in zip(steps, values):
      if finite:
        continue
      described = f"loss {float(loss)}, gradient norm {float(grad_norm)}"
      if self.policy == "skip":
        print(f"step {step}: skipped the update ({described}); train.on_nonfinite=skip",
              flush=True)
        continue
      self.manager.wait()
      raise UserError(f"non-finite loss or gradients at step {step} ({described}); stopped "
                      f"without saving it (checkpoints: {self.manager.all_steps() or 'none'}); "
                      "lower train.learning_rate, set train.grad_clip_norm, or set "
                      "train.on_nonfinite=skip")
