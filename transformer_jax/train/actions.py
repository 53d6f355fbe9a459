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
from typing import Callable, Optional

import jax

from transformer_jax.core import progress, storage
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
  """This process's clock of training, and the steps, tokens, model FLOPs and host input time
  since the last log line: the rates and the ETA of each log line.

  In the manner of big_vision's `Chrono`, the clock runs only while the devices train: it stands
  still during evaluation and checkpoint saves (`paused("eval")`, `paused("save")`), and during
  every step that compiles (`paused("compile")`): the first step of each batch shape, which jit
  compiles the train step for (the first step of a process is one), is timed alone, waited for,
  and counted in no rate. The seconds of each pause are kept apart, by kind. So the rates and
  the ETA are those of compiled train steps, and after a resume they come from this process's
  own steps. The counts come from the batch plan on the host, so no device value is waited for
  beyond what the loop waits for anyway: it reads back a step's results (and so waits for the
  devices to catch up) before every log line, evaluation and save, where the clock is read or
  paused, and before a step that compiles.
  """

  def __init__(self, model_config: ModelConfig, clock=time.perf_counter):
    self.model_config = model_config
    self.clock = clock
    self.tokens_seen = 0  # source + target, no padding, over this process's steps
    self.train_seconds = 0.0  # the clock's time over this process's timed steps
    self.timed_steps = 0
    self.paused_seconds = {}  # kind -> seconds the clock stood still, over this process
    self.last_pause = {}  # kind -> seconds of the latest pause of that kind
    self._shapes = set()
    self._started = self._interval_started = clock()  # before this process's first step
    self._reset()

  def _reset(self) -> None:
    self.steps = self.compile_steps = 0
    self.tokens = self.flops = self.input_seconds = self.compile_tokens = 0.0
    self._interval_pauses = {}  # kind -> seconds in this interval

  def compiles(self, shape: tuple) -> bool:
    """Whether a step of this batch shape is the first: jit compiles the train step for it."""
    new = shape not in self._shapes
    self._shapes.add(shape)
    return new

  @contextlib.contextmanager
  def input(self):
    """Times the host's work of making and transferring a batch."""
    start = self.clock()
    yield
    self.input_seconds += self.clock() - start

  @contextlib.contextmanager
  def paused(self, kind: str):
    """Stops the clock for work that is not a timed train step: an evaluation ("eval"), a
    checkpoint save ("save"), a step that compiles ("compile"), a profiler's start or stop."""
    start = self.clock()
    try:
      yield
    finally:
      seconds = self.clock() - start
      self._interval_pauses[kind] = self._interval_pauses.get(kind, 0.0) + seconds
      self.paused_seconds[kind] = self.paused_seconds.get(kind, 0.0) + seconds
      self.last_pause[kind] = seconds

  def count(self, tokens: int, shape: tuple, compiled: bool = False) -> None:
    """After each step: tokens: non-padding tokens of a global batch, both sides; shape: its
    (rows, source length, target length); compiled: the step compiled (timed apart)."""
    self.tokens_seen += tokens
    if compiled:
      self.compile_steps += 1
      self.compile_tokens += tokens
      return
    self.steps += 1
    self.tokens += tokens
    self.flops += train_flops_per_step(self.model_config, *shape)

  def _interval_seconds(self, now: float) -> float:
    return max(now - self._interval_started - sum(self._interval_pauses.values()), 0.0)

  def steps_per_s(self) -> float:
    """This process's timed train steps per second so far (0.0 before one)."""
    seconds = self.train_seconds + self._interval_seconds(self.clock())
    steps = self.timed_steps + self.steps
    return steps / seconds if steps and seconds > 0 else 0.0

  def take(self) -> dict:
    """The interval's counts since the previous call (the keyword arguments of
    `MetricLogger.train`); starts a new interval."""
    now = self.clock()
    seconds = self._interval_seconds(now)
    interval = {"steps": self.steps, "seconds": seconds, "tokens": self.tokens,
                "flops": self.flops, "input_seconds": self.input_seconds,
                "compile_steps": self.compile_steps, "compile_tokens": self.compile_tokens,
                "compile_seconds": self._interval_pauses.get("compile", 0.0)}
    self.train_seconds += seconds
    self.timed_steps += self.steps
    self._interval_started = now
    self._reset()
    return interval

  def eta(self, step: int, total: int) -> float | None:
    """Seconds of training left after `step` at this process's rate; None before it has one."""
    rate = self.steps_per_s()
    return (total - step) / rate if rate > 0 else None

  @property
  def wall_time(self) -> float:
    """Seconds since this process's first step began, pauses included."""
    return self.clock() - self._started


def evaluations_left(step: int, total: int, eval_every: int) -> int:
  """Evaluations of data.eval_split still to come at the log line of `step` (which comes before
  that step's evaluation): the periodic ones before the last step, and the final one."""
  periodic = (total - 1) // eval_every - (step - 1) // eval_every if eval_every else 0
  return max(periodic, 0) + 1


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

  def line(self, step: int, metrics, now=None, rate: float = 0.0) -> str:
    """The line to print after `step` (steps done so far), or "" if none is due. rate: the
    steps/s of the training clock (`Throughput.steps_per_s`), if it has one; else the steps
    since the first one over the wall time."""
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
    rate = rate or (step - self.start - 1) / max(now - self.first_done, 1e-9)
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


class Profiler:
  """A `jax.profiler` trace of the train steps train.profile_start + 1 .. profile_start +
  profile_steps (steps counted as the log counts them) into WORKDIR/tensorboard/plugins/profile/,
  where TensorBoard's profile plugin finds it (Perfetto opens the .trace.json.gz beside it).

  The default profile_start=1 leaves out the first step, whose compilation would fill the trace;
  a run resumed inside the window traces the rest of it, its first step included. Only the first
  process traces (its host and devices). Tracing slows the traced steps a little: their log line
  shows it; the trace's start and stop are not counted (`Throughput.paused("profile")`).
  """

  # Beside the trace: the traced program's optimised HLO, whose op names (Flax module paths
  # and the named scopes of the step) let tools/profile.py sort its kernels into categories.
  PROGRAM_FILE = "train_step.hlo.txt"

  def __init__(self, train_config, directory: str, start: int, enabled: bool = True,
               program: Optional[Callable[[], str]] = None):
    """program: returns the optimised HLO text of the traced train step (from the compilation
    cache when there is one; else compiled once more after the trace)."""
    t = train_config
    self.program = program
    first, last = max(t.profile_start, start), t.profile_start + t.profile_steps
    self.window = (first, last) if enabled and t.profile_steps and first < last else None
    self.directory = directory
    self.active = False

  def before(self, step: int) -> None:
    """Before the step that follows `step` steps done."""
    if self.window and step == self.window[0]:
      jax.profiler.start_trace(self.directory)
      self.active = True

  def after(self, step: int, metrics, paused=contextlib.nullcontext) -> str:
    """After `step` steps done: ends the trace at the window's last step, once the devices are
    done with it (a wait that is that step's time), within `paused()`; the line that says where
    the trace is, or ""."""
    if not (self.active and step == self.window[1]):
      return ""
    jax.block_until_ready(metrics)
    with paused():
      self.close()
      self._write_program()
    first, last = self.window
    return (f"profile of steps {first + 1}-{last}: {self.directory}/plugins/profile/ "
            f"(tensorboard --logdir {self.directory}, Profile tab)")

  def _write_program(self) -> None:
    if self.program is None:
      return
    runs = storage.join(self.directory, "plugins", "profile")
    newest = max(storage.listdir(runs), default=None)  # runs are named by their start time
    if newest is not None:
      storage.write(storage.join(runs, newest, self.PROGRAM_FILE), self.program())

  def close(self) -> None:
    """Ends a trace still running (a run stopped inside the window); no-op otherwise."""
    if self.active:
      self.active = False
      jax.profiler.stop_trace()
