"""Runs the GPU suite's plan: each wave compiled at once, then each case timed alone.

  python -m benchmarks.gpu OUTDIR [--dry_run] [--only NAME...] [--multi30k DIR] [--resume]
                                  [--budget_min M] [--estimates_only] ...

OUTDIR/results.json and OUTDIR/results.md are rewritten after every case: a run cut off when
the machine goes back keeps everything that finished. OUTDIR/logs/NAME.log holds each case's
command lines and output (NAME.compile.log its compile in a wave), OUTDIR/profiles/ the traces
of the default steps (each with its program's HLO: `python -m transformer_jax.tools.profile
OUTDIR/profiles/MODEL` reads one again) and CASE.md, the tables of each, OUTDIR/jax_cache the
compilation cache
(with XLA's per-fusion autotune cache) that the waves fill and the timed cases read.

A wave's cases compile at once: each process runs its benchmark with benchmark.steps=0
(compile, store in the cache, stop), taking GPU memory as it needs it. Their autotuning then
times GEMM candidates on a GPU that the others use too, so a choice may differ from the one a
process alone would make: the timed runs are alone, but run those choices. Within a window
every case of the default's shapes runs the same choices for the same GEMMs (the defaults'
wave autotuned them first, the levers read them from the autotune cache), so a lever is
compared with its default on equal terms; against a program compiled alone, the first window's
default steps (compiled alone: docs/benchmarks.md) are the control.

--dry_run runs every case's command on the CPU with tiny overrides (model dims, a few steps,
float32, a fake Multi30k), so that every command line, config key and output parse is exercised
in a few minutes; the numbers it produces mean nothing. A case the CPU cannot run (cuDNN's
attention) is compiled for an H100 instead, where JAX's CUDA compiler is installed.

After the cases, each measured train step is compiled once more for an H100 on the CPU
(`--mode=compile`, no GPU time) and the compiler's estimate, a roofline bound, is shown beside
the measured step (`--no_estimates` leaves them out; `--estimates_only` adds them afterwards to
an OUTDIR that a window filled, on any machine with JAX's CUDA compiler).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import fnmatch
import importlib.util
import json
import os
import pathlib
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Optional

from benchmarks.gpu import plan as plan_lib
from benchmarks.gpu import report
from benchmarks.gpu.plan import Case, Command

REPO = pathlib.Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------- the dry run

TINY_MODEL = {"model.d_model": 32, "model.num_heads": 2, "model.d_ff": 64,
              "model.num_encoder_layers": 1, "model.num_decoder_layers": 1,
              "model.vocab_size": 64, "model.dtype": "float32"}


def dry_overrides(command: Command) -> dict:
  """The command's overrides with a tiny model and a few steps: seconds on a CPU, same keys."""
  values = dict(command.overrides)
  values.update(TINY_MODEL)
  if command.mode == "compile":
    values.update({"compile.batch_size": 2, "compile.source_len": 8, "compile.target_len": 8,
                   "compile.decode_batch": 2, "model.dtype": "bfloat16"})
  elif command.mode == "benchmark":
    values.update({"benchmark.batch_size": 2, "benchmark.source_len": 8,
                   "benchmark.target_len": 8, "benchmark.warmup": 1, "benchmark.steps": 2})
    if values.get("benchmark.decode_steps"):
      values.update({"benchmark.decode_batch": 2, "benchmark.decode_steps": 1})
    if values.get("benchmark.torch_compile"):
      values["benchmark.torch_compile"] = "eager"  # dynamo's tracing without inductor's codegen
    if values.get("train.loss_chunk_tokens"):
      values["train.loss_chunk_tokens"] = 4  # 16 target tokens: four chunks, as on the GPU
  else:  # the Multi30k recipe: 10 steps, a checkpoint each, so that the last 10 can be averaged
    values.update({"data.tokens_per_batch": 128, "train.steps": 10, "train.warmup_steps": 5,
                   "train.checkpoint_every": 1, "train.eval_every": 0, "train.log_every": 5,
                   "eval.batch_size": 8, "eval.beam_size": 2, "eval.max_decode_len": 16})
  return values


# What a compile for a GPU on a CPU machine may lack (tools/compile.py's and the model's
# one-line errors): JAX's CUDA compiler, or the cuDNN library that cuDNN's attention asks for
# its version while tracing.
GPU_LIBRARIES_MISSING = ("needs NVIDIA's cuDNN library", "gpu-compile")


def gpu_compiler() -> bool:
  """Whether JAX's CUDA compiler is installed here (it compiles for GPUs without one)."""
  return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None


def write_fake_multi30k(directory: pathlib.Path) -> pathlib.Path:
  """A few lines in the Multi30k layout (train, val, test_2016_flickr; .en and .de)."""
  en = "a man in a red shirt rides a bike down the street while two dogs run after him".split()
  de = "ein mann in einem roten hemd faehrt ein rad die strasse hinab und zwei hunde".split()
  directory.mkdir(parents=True, exist_ok=True)
  for split, count in (("train", 64), ("val", 8), ("test_2016_flickr", 8)):
    for lang, words in (("en", en), ("de", de)):
      lines = [" ".join(words[(i * 3 + j) % len(words)] for j in range(4 + i % 7))
               for i in range(count)]
      (directory / f"{split}.{lang}").write_text("\n".join(lines) + "\n")
  return directory


# ----------------------------------------------------------------------------- processes


class Interrupted(Exception):
  """SIGTERM or SIGINT reached the suite: stop the case in flight, keep what finished."""


def _raise_interrupted(signum, frame):  # pylint: disable=unused-argument
  raise Interrupted(signal.Signals(signum).name)


def last_json(text: str) -> Optional[dict]:
  """The last output line that is a JSON object (the benchmark's and evaluate's result line)."""
  for line in reversed(text.splitlines()):
    line = line.strip()
    if line.startswith("{"):
      try:
        value = json.loads(line)
      except ValueError:
        continue
      if isinstance(value, dict):
        return value
  return None


_RUNNING = set()  # the cases' processes in flight, stopped when the suite is interrupted
_RUNNING_LOCK = threading.Lock()


def _stop(process: subprocess.Popen) -> None:
  """SIGTERM to the case's process group (train then saves a checkpoint), SIGKILL 15 s later."""
  for signum, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
    try:
      os.killpg(process.pid, signum)
    except ProcessLookupError:
      return
    try:
      process.wait(timeout=wait)
      return
    except subprocess.TimeoutExpired:
      pass


def run_command(argv: list, env: dict, timeout_s: float, log: pathlib.Path) -> tuple:
  """Runs argv with its output appended to `log`; returns (status, return code, seconds, output)."""
  with open(log, "a") as f:
    shown = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items() if k.startswith(
        ("XLA_", "JAX_", "CUDA_VISIBLE", "TRANSFORMER_JAX_COMPILE")))
    f.write(f"$ {shown} {shlex.join(argv)}\n")
    f.flush()
    start = len(log.read_bytes())
    started = time.perf_counter()
    process = subprocess.Popen(argv, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL, start_new_session=True)
    with _RUNNING_LOCK:
      _RUNNING.add(process)
    try:
      code = process.wait(timeout=timeout_s)
      status = "ok" if code == 0 else "failed"
    except subprocess.TimeoutExpired:
      _stop(process)
      code, status = process.returncode, "timeout"
    except BaseException:
      _stop(process)
      raise
    finally:
      with _RUNNING_LOCK:
        _RUNNING.discard(process)
    seconds = time.perf_counter() - started
  output = log.read_bytes()[start:].decode(errors="replace")
  return status, code, seconds, output


def _error_line(output: str) -> str:
  """The line that says why a run failed: launch.py's `error: ...`, else the last non-empty one."""
  lines = [line.strip() for line in output.splitlines() if line.strip()]
  for line in reversed(lines):
    if line.startswith("error:") or "Error" in line.split(":")[0]:
      return line[:300]
  return lines[-1][:300] if lines else ""


def command_env(base_env: dict, command: Command) -> dict:
  """The suite's environment with the command's own on top (its XLA_FLAGS after the suite's)."""
  env = dict(base_env)
  for key, value in command.env.items():
    env[key] = f"{env[key]} {value}".strip() if key == "XLA_FLAGS" and env.get(key) else value
  return env


def latest_eval(workdir: pathlib.Path) -> Optional[dict]:
  """The result of the workdir's last evaluation on its data.eval_split (config.json): the file
  eval/STEP.SPLIT.DECODE[...].json of the highest step."""
  try:
    split = json.loads((workdir / "config.json").read_text())["data"]["eval_split"]
  except (OSError, ValueError, KeyError):
    return None
  results = []
  for path in sorted((workdir / "eval").glob("*.json")):
    step, _, rest = path.name.partition(".")
    if step.isdigit() and rest.startswith(f"{split}."):
      results.append((int(step), path))
  if not results:
    return None
  return json.loads(max(results, key=lambda r: r[0])[1].read_text())


def derive(row: dict) -> None:
  """Adds the numbers computed from a finished case's output."""
  m = row.get("metrics") or {}
  if isinstance(m.get("tflops_per_s"), (int, float)):
    row["mfu_989"] = m["tflops_per_s"] / plan_lib.PEAK_TFLOPS
  if isinstance(m.get("bleu_lowercase_tokenized"), (int, float)):
    row["bleu_minus_published"] = m["bleu_lowercase_tokenized"] - plan_lib.PUBLISHED_BLEU


# ----------------------------------------------------------------------------- one case


def run_case(case: Case, outdir: pathlib.Path, python: str, base_env: dict, dry_run: bool,
             timeout_cap_s: Optional[float]) -> dict:
  log = outdir / "logs" / f"{case.name}.log"
  log.write_text("")
  row = {"name": case.name, "status": "ok", "wall_s": 0.0, "commands": [],
         "log": str(log.relative_to(outdir))}
  commands = case.commands
  if dry_run and plan_lib.needs_gpu(case):  # the CPU cannot run it: compile it for an H100
    commands = [estimate_command(case)]
    row["dry_run_check"] = f"compiled for {report.ESTIMATE_TOPOLOGY} (the CPU cannot run it)"
  for command in commands:
    if dry_run:
      command = dataclasses.replace(command, overrides=dry_overrides(command), timeout_min=3)
    argv = command.argv(python, outdir)
    timeout_s = command.timeout_min * 60
    if timeout_cap_s is not None:
      timeout_s = max(30.0, min(timeout_s, timeout_cap_s - row["wall_s"]))
    status, code, seconds, output = run_command(argv, command_env(base_env, command), timeout_s,
                                                log)
    row["commands"].append(" ".join(argv[1:]))
    row["wall_s"] += seconds
    row[f"{command.mode}_wall_s"] = seconds
    if command.mode == "train":
      # The final validation (train also evaluates data.test_split, in a file of its own).
      if command.workdir and latest_eval(outdir / command.workdir):
        row["val_metrics"] = latest_eval(outdir / command.workdir)
    else:
      parsed = last_json(output)
      if parsed is not None and command.mode == "compile":
        row["estimate"] = _estimate(parsed)
      elif parsed is not None:
        row["metrics"] = parsed
      elif status == "ok":
        status = "failed"
        output += "\nerror: no JSON line in the output"
    if status != "ok":
      row.update(status=status, returncode=code, error=_error_line(output))
      if row.get("dry_run_check") and any(m in row["error"] for m in GPU_LIBRARIES_MISSING):
        # The command line, its keys and the config's checks passed; the compile stopped where
        # it needs what only a GPU machine has: a dry run's answer for it, not a failure.
        row.update(status=report.UNAVAILABLE, error="the CPU cannot run it, and its compile "
                   f"for {report.ESTIMATE_TOPOLOGY} stopped at: {row['error']}")
      break
  if row["status"] == "ok" and (row.get("metrics") or {}).get("profile_top"):
    (outdir / "profiles" / f"{case.name}.md").write_text(report.profile_tables(row) + "\n")
  derive(row)
  return row


# ----------------------------------------------------------------------------- the estimates


def estimate_command(case: Case) -> Command:
  """The `--mode=compile` run of a train case's step for an H100: the same model, batch and
  options, compiled on the CPU (XLA_FLAGS as the case's: they steer the GPU compiler too)."""
  bench = case.commands[0]
  overrides = {k: v for k, v in bench.overrides.items() if not k.startswith("benchmark.")}
  overrides.update({"compile.topology": report.ESTIMATE_TOPOLOGY,
                    "compile.batch_size": bench.overrides["benchmark.batch_size"],
                    "compile.source_len": bench.overrides["benchmark.source_len"],
                    "compile.target_len": bench.overrides["benchmark.target_len"]})
  return Command("compile", bench.config, overrides, env=dict(bench.env), timeout_min=10)


def _estimate(report_json: dict) -> Optional[dict]:
  train = report_json.get("train")
  if not train:
    return None
  found = {k: train[k] for k in ("step_s", "mfu", "estimate", "fits", "total_bytes",
                                 "target_tokens_per_s") if k in train}
  found["kind"] = "roofline bound (the compiler's, for a program not autotuned and not run)"
  return found


def run_estimate(case: Case, row: dict, outdir: pathlib.Path, python: str, base_env: dict,
                 dry_run: bool) -> None:
  """Adds row["estimate"] (the compile report's train part) or row["estimate_error"]; the case's
  own status stays as measured."""
  command = estimate_command(case)
  if dry_run:
    command = dataclasses.replace(command, overrides=dry_overrides(command), timeout_min=3)
  status, _, _, output = run_command(command.argv(python, outdir),
                                     dict(base_env, **command.env), command.timeout_min * 60,
                                     outdir / "logs" / f"{case.name}.estimate.log")
  found = _estimate(last_json(output) or {}) if status == "ok" else None
  if found:
    row["estimate"] = found
    row.pop("estimate_error", None)
  else:
    row["estimate_error"] = _error_line(output) or status


def run_estimates(cases: list, state: dict, args, outdir: pathlib.Path, env: dict,
                  started: float) -> None:
  """The H100 compile estimate of every measured train case that has none yet (of the first one
  in a dry run)."""
  todo = [(case, row) for case, row in zip(cases, state["cases"])
          if case.table == "train" and row["status"] == "ok" and "estimate" not in row
          and case.commands]
  if args.dry_run:  # the dry run checks the path with one estimate: each is a GPU compile
    todo = todo[:1]
  jobs = 1 if not args.dry_run else args.jobs or min(4, os.cpu_count() or 1)
  with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
    futures = {pool.submit(run_estimate, case, row, outdir, args.python, env, args.dry_run): row
               for case, row in todo}
    for future in concurrent.futures.as_completed(futures):
      row = futures[future]
      try:
        future.result()
      except Exception as e:  # pylint: disable=broad-except  # the measurements stay
        row["estimate_error"] = f"{type(e).__name__}: {e}"
      shown = row.get("estimate_error") or (
          f"{row['estimate']['step_s'] * 1e3:.1f} ms, MFU {row['estimate']['mfu']:.1%}")
      print(f"          {row['name']} estimate (roofline bound) for "
            f"{report.ESTIMATE_TOPOLOGY}: {shown}", flush=True)
      report.write_results(outdir, state, cases, started)


# ----------------------------------------------------------------------------- waves


def precompile_command(command: Command) -> Command:
  """The case's benchmark with nothing timed: it compiles the step into the compilation cache
  (benchmark.steps=0), taking GPU memory as it needs it, so that several run at once."""
  overrides = {k: v for k, v in command.overrides.items()
               if k not in ("benchmark.profile", "benchmark.torch", "benchmark.torch_autocast",
                            "benchmark.torch_compile")}
  overrides.update({"benchmark.steps": 0, "benchmark.warmup": 0, "benchmark.decode_steps": 0})
  return dataclasses.replace(command, overrides=overrides, timeout_min=8,
                             env=dict(command.env, XLA_PYTHON_CLIENT_PREALLOCATE="false"))


class Suite:
  """One run of the plan: its cases, their rows (state["cases"]), the options and the clock."""

  def __init__(self, cases: list, state: dict, args, outdir: pathlib.Path, env: dict):
    self.cases, self.state, self.args, self.outdir, self.env = cases, state, args, outdir, env
    self.started = time.time()
    self.rows = state["cases"]

  def minutes(self) -> float:
    return (time.time() - self.started) / 60

  def left_min(self) -> float:
    """Minutes left of --budget_min, or of one window after the machine's start without it."""
    return (self.args.budget_min or plan_lib.WINDOW_MIN - plan_lib.STARTUP_MIN) - self.minutes()

  def save(self) -> None:
    report.write_results(self.outdir, self.state, self.cases, self.started)

  def say(self, text: str) -> None:
    print(f"[{self.minutes():5.1f} min] {text}", flush=True)

  def mark_unavailable(self) -> None:
    """Cases this checkout cannot run (a lever's config key not there yet), or that neither
    the CPU nor an H100 compile can check in a dry run: skipped with a note, never a crash."""
    for case, row in zip(self.cases, self.rows):
      if row["status"] != "pending":
        continue
      why = plan_lib.missing_option(case)
      if why is None and self.args.dry_run and plan_lib.needs_gpu(case) and not gpu_compiler():
        why = "needs a GPU, and JAX's CUDA compiler is not installed to compile it for one"
      if why:
        row.update(status=report.UNAVAILABLE, error=why)
        print(f"note: {case.name} is left out: {why}", flush=True)

  def build_combinations(self, indices: list) -> list:
    """The combined cases of `indices` with their commands (chosen from the measured levers);
    those with no winning lever marked NO_WINNER and dropped."""
    built = []
    by_name = {r["name"]: r for r in self.rows}
    for index in indices:
      row = self.rows[index]
      case = plan_lib.combine(self.cases[index], self.cases, by_name)
      if case is None:
        row.update(status=report.NO_WINNER,
                   error=f"no lever of {self.cases[index].combine} beat its default")
        continue
      self.cases[index] = case
      command = case.commands[0]
      row.update(why=case.why, built={"overrides": command.overrides, "env": command.env,
                                      "describe": case.describe})
      why = plan_lib.missing_option(case)
      if why:
        row.update(status=report.UNAVAILABLE, error=why)
        continue
      built.append(index)
    return built

  def rebuild_finished_combinations(self) -> None:
    """The combinations an earlier run finished (--resume, --estimates_only), as they ran (their
    rows keep what they were built of)."""
    for index, case in enumerate(self.cases):
      built = self.rows[index].get("built")
      if case.combine and self.rows[index]["status"] == "ok" and built:
        self.cases[index] = dataclasses.replace(
            case, why=self.rows[index].get("why", case.why), describe=built["describe"],
            commands=[Command("benchmark", f"experiments/{case.combine}.py",
                              built["overrides"], env=built["env"], timeout_min=6)])

  def precompile(self, indices: list, phase: str) -> None:
    """The compile phase of a wave: its cases compiled at once, --precompile_jobs at a time;
    each row gets precompile_s and precompile_status. A case whose compile failed is still run
    (and compiles then, or fails in its own log)."""
    chosen = [i for i in indices if not (self.args.dry_run and
                                         plan_lib.needs_gpu(self.cases[i]))]
    if not chosen or not self.args.precompile_jobs:
      return
    names = [self.cases[i].name for i in chosen]
    self.say(f"{phase}: {len(chosen)} at once ({self.args.precompile_jobs} at a time): "
             f"{', '.join(names)}")
    started = time.time()

    def compile_one(index: int) -> None:
      case, row = self.cases[index], self.rows[index]
      command = precompile_command(case.commands[0])
      if self.args.dry_run:
        command = dataclasses.replace(command, overrides={
            **dry_overrides(command), "benchmark.steps": 0, "benchmark.warmup": 0})
      status, _, seconds, output = run_command(
          command.argv(self.args.python, self.outdir), command_env(self.env, command),
          command.timeout_min * 60, self.outdir / "logs" / f"{case.name}.compile.log")
      parsed = last_json(output) if status == "ok" else None
      row.update(precompile_s=seconds,
                 precompile_status=status if parsed or status != "ok" else "failed")

    with concurrent.futures.ThreadPoolExecutor(max_workers=self.args.precompile_jobs) as pool:
      list(pool.map(compile_one, chosen))
    self.record_phase(phase, len(chosen), plan_lib.wave_compile_min(
        [self.cases[i] for i in chosen]), (time.time() - started) / 60)
    self.say("compiled: " + ", ".join(f"{self.cases[i].name} {self.rows[i]['precompile_status']}"
                                      for i in chosen))

  def record_phase(self, phase: str, count: int, guess: float, measured: float) -> None:
    self.state.setdefault("phases", []).append(
        {"phase": phase, "cases": count, "guess_min": guess, "measured_min": measured})
    self.save()

  def cost_min(self, index: int) -> float:
    """A case's guessed minutes now: timed alone once its wave compiled it, else all of it."""
    case, row = self.cases[index], self.rows[index]
    return (plan_lib.timed_min(case) if row.get("precompile_status") == "ok"
            else case.minutes)

  def start(self, pool, index: int):
    """Submits one case, or marks it skipped when it no longer fits the budget."""
    case, row = self.cases[index], self.rows[index]
    cap_s = None
    if self.args.budget_min:
      if self.minutes() + self.cost_min(index) > self.args.budget_min:
        row.update(status="skipped", error="over --budget_min")
        return None
      cap_s = (self.args.budget_min - self.minutes()) * 60
    self.say(f"{case.name}: {case.why}")
    row["status"] = "running"
    return pool.submit(run_case, case, self.outdir, self.args.python, self.env,
                       self.args.dry_run, cap_s)

  def finish(self, future, index: int) -> None:
    row = self.rows[index]
    try:
      row.update(future.result())
    except Exception as e:  # pylint: disable=broad-except  # a bug here must not stop the suite
      row.update(status="error", error=f"{type(e).__name__}: {e}")
    summary = row.get("error") or row.get("dry_run_check") or ", ".join(
        f"{k}={report.num(v)}" for k, v in (row.get("metrics") or {}).items()
        if k in ("step_ms", "speedup_vs_torch", "greedy_tokens_per_s", "beam4_tokens_per_s",
                 "bleu_lowercase_tokenized"))
    print(f"          {row['name']} {row['status']} in {row.get('wall_s', 0):.0f} s: {summary}",
          flush=True)

  def run(self, indices: list, phase: Optional[str] = None) -> None:
    """Runs these cases (timed one at a time; a dry run --jobs at a time)."""
    jobs = 1 if not self.args.dry_run else self.args.jobs or min(4, os.cpu_count() or 1)
    todo = [i for i in indices if self.rows[i]["status"] == "pending"]
    guess = sum(self.cost_min(i) for i in todo)
    started = time.time()
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
      running = {}
      try:
        while todo or running:
          while todo and len(running) < jobs:
            index = todo.pop(0)
            future = self.start(pool, index)
            if future is not None:
              running[future] = index
            self.save()
          if not running:
            continue
          done, _ = concurrent.futures.wait(running,
                                            return_when=concurrent.futures.FIRST_COMPLETED)
          for future in done:
            self.finish(future, running.pop(future))
            self.save()
      except (Interrupted, KeyboardInterrupt) as e:
        with _RUNNING_LOCK:
          in_flight = list(_RUNNING)
        for process in in_flight:
          _stop(process)
        for index in running.values():
          self.rows[index].update(status="interrupted", error=str(e) or "interrupted")
        self.save()
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    if phase:
      self.record_phase(phase, len(indices), guess, (time.time() - started) / 60)

  def window(self) -> set:
    """The pending cases that one window (or --budget_min) holds by the plan's minutes: the
    waves take theirs from these; the others run after them, one at a time."""
    pending = [c for c, row in zip(self.cases, self.rows) if row["status"] == "pending"]
    return {c.name for c in plan_lib.in_one_window(pending, self.left_min())}

  def wave(self, wave: int, name: str, window: set) -> None:
    """One wave: its cases in the window compiled at once, then each timed alone."""
    indices = [i for i, c in enumerate(self.cases)
               if c.wave == wave and c.name in window and self.rows[i]["status"] == "pending"]
    if wave == plan_lib.COMBINED:
      indices = self.build_combinations(indices)
    if not indices:
      return
    self.precompile(indices, f"compile the {name} at once")
    self.run(indices, f"time the {name}, each alone")


def probe_environment(python: str, env: dict, with_torch: bool) -> dict:
  """Versions and the device, read by the same interpreter the cases use."""
  code = ("import json, platform, jax\n"
          "d = jax.devices()[0]\n"
          "r = {'python': platform.python_version(), 'jax': jax.__version__,\n"
          "     'backend': jax.default_backend(),\n"
          "     'device': f'{len(jax.devices())} x {d.device_kind}'}\n"
          "try:\n"
          "  import importlib.metadata as md; r['torch'] = md.version('torch')\n"
          f"  if {with_torch}:\n"
          "    import torch; r['torch_cuda'] = torch.cuda.is_available()\n"
          "except Exception as e: r['torch'] = f'missing ({type(e).__name__})'\n"
          "print(json.dumps(r))\n")
  try:
    result = subprocess.run([python, "-c", code], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=180)
    return last_json(result.stdout) or {"probe_error": _error_line(result.stderr)}
  except (OSError, subprocess.TimeoutExpired) as e:
    return {"probe_error": f"{type(e).__name__}: {e}"}


# ----------------------------------------------------------------------------- main


def parse_args(argv):
  parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu",
                                   description=__doc__.split("\n\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("outdir", type=pathlib.Path)
  parser.add_argument("--dry_run", action="store_true",
                      help="every case on the CPU with tiny overrides (a check of the suite)")
  parser.add_argument("--only", nargs="+", metavar="NAME",
                      help="run only these cases (names or shell patterns, e.g. 'base_*')")
  parser.add_argument("--multi30k", metavar="DIR",
                      help="folder with train/val/test_2016_flickr .en/.de; without it the "
                      "Multi30k case is left out (a dry run checks its files and trains on a "
                      "fake one)")
  parser.add_argument("--resume", action="store_true",
                      help="keep the cases OUTDIR/results.json has as ok, run the rest")
  parser.add_argument("--precompile_jobs", type=int, default=8,
                      help="cases of a wave compiled at once before any is timed (0: none; "
                      "each then compiles when it runs)")
  parser.add_argument("--budget_min", type=float, default=0.0,
                      help="skip a case whose estimate no longer fits in this many minutes "
                      "since the start, and cap its timeout to what is left (0 = no budget; "
                      "the waves still plan for one window)")
  parser.add_argument("--no_estimates", action="store_true",
                      help="leave out the H100 compile estimates after the cases")
  parser.add_argument("--estimates_only", action="store_true",
                      help="add the estimates to OUTDIR/results.json of an earlier run, no case "
                      "run (any machine with JAX's CUDA compiler)")
  parser.add_argument("--python", default=sys.executable, help="interpreter for launch.py")
  parser.add_argument("--jobs", type=int, default=0,
                      help="cases at a time in a dry run (default: up to 4, one per core); a "
                      "real run always runs one: the cases share one GPU and are timed")
  return parser.parse_args(argv)


def select(args, multi30k: Optional[str]) -> Optional[list]:
  cases = plan_lib.plan(multi30k)
  if not args.only:
    return cases
  unknown = [p for p in args.only if not any(fnmatch.fnmatch(c.name, p) for c in cases)]
  if unknown:
    print(f"error: no case matches {', '.join(unknown)}; the cases: "
          f"{', '.join(c.name for c in cases)}", file=sys.stderr)
    return None
  return [c for c in cases if any(fnmatch.fnmatch(c.name, p) for p in args.only)]


def main(argv=None) -> int:
  args = parse_args(argv)
  outdir = args.outdir.resolve()
  (outdir / "logs").mkdir(parents=True, exist_ok=True)
  (outdir / "profiles").mkdir(exist_ok=True)
  multi30k = args.multi30k
  if args.dry_run and not multi30k:
    multi30k = str(write_fake_multi30k(outdir / "fake_multi30k"))
  if multi30k:
    multi30k = str(pathlib.Path(multi30k).resolve())
    missing = [f"{s}.{lang}" for s in ("train", "val", "test_2016_flickr") for lang in ("en", "de")
               if not (pathlib.Path(multi30k) / f"{s}.{lang}").is_file()]
    if missing:
      print(f"error: --multi30k {multi30k} lacks {', '.join(missing)}", file=sys.stderr)
      return 2
  data = multi30k
  if args.dry_run and multi30k:  # the dry run's tiny vocabulary fits the fake text, not Multi30k
    data = str(write_fake_multi30k(outdir / "fake_multi30k"))
  cases = select(args, data)
  if cases is None:
    return 2

  # One compilation cache for the suite, in OUTDIR: the waves write it (XLA's per-fusion
  # autotune cache beside it), the timed cases read it, --resume on the same machine too. Named
  # by its real path: JAX's key for a program holds that autotune folder's path, so a suite
  # that reaches the same cache by another path (a link, as the tests' dry runs share one)
  # would miss every program in it.
  env = dict(os.environ, PYTHONUNBUFFERED="1",
             TRANSFORMER_JAX_COMPILE_CACHE=str((outdir / "jax_cache").resolve()))
  if args.dry_run:
    # CPU only, also on a GPU machine; the tiny steps compile in well under the cache's
    # threshold, so every program is stored.
    env.update(JAX_PLATFORMS="cpu", CUDA_VISIBLE_DEVICES="",
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")

  if args.estimates_only and not (outdir / "results.json").is_file():
    print(f"error: --estimates_only needs {outdir}/results.json of an earlier run",
          file=sys.stderr)
    return 2
  previous = {}
  if args.resume or args.estimates_only:
    if (outdir / "results.json").is_file():
      previous = {row["name"]: row for row in json.loads(
          (outdir / "results.json").read_text()).get("cases", []) if row.get("status") == "ok"}
  else:  # a train run finds no checkpoints of an earlier suite to resume from
    shutil.rmtree(outdir / "runs", ignore_errors=True)
  if not args.estimates_only:
    print(report.plan_text(cases, set(previous)), flush=True)

  state = {"suite": "python -m benchmarks.gpu", "dry_run": args.dry_run,
           "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "plan_min": sum(c.minutes for c in cases), "peak_tflops": plan_lib.PEAK_TFLOPS,
           "published_bleu": plan_lib.PUBLISHED_BLEU, "multi30k_dir": multi30k,
           "environment": {},
           "cases": [previous.get(c.name) or {"name": c.name, "status": "pending"}
                     for c in cases]}
  for row, case in zip(state["cases"], cases):
    row.update(estimate_min=case.minutes, why=case.why, table=case.table, wave=case.wave)
  suite = Suite(cases, state, args, outdir, env)
  if args.estimates_only:  # the earlier run's state as it was, its train cases estimated
    earlier = json.loads((outdir / "results.json").read_text())
    by_name = {row["name"]: row for row in earlier["cases"]}
    suite.cases = [c for c in cases if c.name in by_name]
    state = suite.state = dict(earlier, cases=[by_name[c.name] for c in suite.cases])
    suite.rows = state["cases"]
    suite.rebuild_finished_combinations()
    run_estimates(suite.cases, state, args, outdir, env, suite.started)
    print((outdir / "results.md").read_text(), flush=True)
    return 0
  suite.rebuild_finished_combinations()  # --resume keeps them: their commands, as they ran
  suite.save()
  state["environment"] = probe_environment(args.python, env, with_torch=not args.dry_run)
  print(f"environment: {json.dumps(state['environment'])}", flush=True)
  suite.mark_unavailable()
  suite.save()

  previous_handler = signal.signal(signal.SIGTERM, _raise_interrupted)
  try:
    window = suite.window()
    for wave, name in ((plan_lib.DEFAULTS, "defaults"), (plan_lib.LEVERS, "levers"),
                       (plan_lib.COMBINED, "combinations")):
      suite.wave(wave, name, window)
    rest = [i for i, row in enumerate(suite.rows) if row["status"] == "pending"]
    if rest and any(suite.cases[i].combine for i in rest):
      suite.build_combinations([i for i in rest if suite.cases[i].combine])
    suite.run([i for i in rest if suite.rows[i]["status"] == "pending"])
  except (Interrupted, KeyboardInterrupt):
    print(f"interrupted; the finished cases are in {outdir}", flush=True)
    return 130
  finally:
    signal.signal(signal.SIGTERM, previous_handler)
  if not args.no_estimates:
    run_estimates(cases, state, args, outdir, env, suite.started)
  print((outdir / "results.md").read_text(), flush=True)
  return 0 if all(row["status"] in report.NOT_FAILURES for row in state["cases"]) else 1
