"""The GPU benchmark suite (issue 17): every number we want from one H100 window, in one go.

  python benchmarks/gpu_suite.py OUTDIR [--dry_run] [--only NAME...] [--multi30k DIR] [--resume]

Usually started by `benchmarks/gpu.sh OUTDIR`, which first installs the CUDA build of JAX.

Each case runs the project's own command line (`launch.py --mode=benchmark|train|evaluate`) as a
subprocess, so that what is measured is what a user runs, one case cannot leave the next one a
half-used GPU or a poisoned XLA cache, and a crash or a hang (killed at the case's timeout) costs
that case alone. OUTDIR/results.json and OUTDIR/results.md are rewritten after every case: a run
cut off when the machine goes back keeps everything that finished. OUTDIR/logs/NAME.log holds each
case's command lines and output.

GPU time comes in 15-minute leases, so the full cross product of model x attention x remat x
batch x XLA flag (2 x 2 x 2 x 4 x 4 = 128 compiles) cannot fit. The plan varies one factor at a
time around a default (bf16, plain attention, no remat, ~25k tokens per side: the paper's batch),
and the cases run in order of importance: the default step of both models, the ratio to PyTorch,
the Multi30k recipe, then the single-factor changes, decoding and XLA flags. Each case carries a
cost on an H100 (process start, compile, timed steps): measured for the three cases that ran on
2026-11-28 (2.5-3 minutes each, over two of them XLA's compile and autotuning), guessed from those
for the others; the plan prints their total. `--only` runs the ones a lease has not measured yet.

--dry_run runs every case's command on the CPU with tiny overrides (model dims, a few steps,
float32, a fake Multi30k), so that every command line, config key and output parse is exercised
in about a minute; the numbers it produces mean nothing.

After the cases, each measured train step is compiled once more for an H100 on the CPU
(`--mode=compile --config.compile.topology=h100`, no GPU time) and the compiler's estimate of its
step time and MFU is shown beside the measured one: the first GPU window checks the estimates
of docs/benchmarks.md too (`--no_estimates` leaves them out).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import fnmatch
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

REPO = pathlib.Path(__file__).resolve().parents[1]
PEAK_TFLOPS = 989.0  # H100 SXM dense bf16 (the figure benchmark.PEAK_FLOPS uses)
PUBLISHED_BLEU = 41.02  # Multi30k test_2016_flickr, lowercased tokenized BLEU (Wu et al., 2021)
SEQ_LEN = 64  # tokens per row on each side in the train-step cases
ROWS = {"8k": 128, "16k": 256, "25k": 400, "32k": 512, "64k": 1024}  # rows x 64 tokens/side
DEFAULT_TOKENS = "25k"

# XLA GPU flags tried one at a time on the big train step. Each name was checked against the flag
# parser of jaxlib 0.10.2 (an unknown flag aborts the process, so --dry_run checks them again).
XLA_FLAG_CASES = (
    ("lhs", "--xla_gpu_enable_latency_hiding_scheduler=true",
     "overlap independent kernels (mostly meant for collectives; one GPU may gain nothing)"),
    ("no_triton_gemm", "--xla_gpu_enable_triton_gemm=false",
     "every matrix product through cuBLAS instead of Triton-generated GEMM fusions"),
    ("no_command_buffer", "--xla_gpu_enable_command_buffer=",
     "no CUDA graphs: shows what graph capture saves in launch overhead"),
)


# ----------------------------------------------------------------------------- the plan


@dataclasses.dataclass
class Command:
  """One launch.py run: its mode, flags and extra environment."""
  mode: str  # benchmark | train | evaluate
  config: str  # experiments/X.py
  overrides: dict  # config key -> value, as --config.KEY=VALUE
  env: dict = dataclasses.field(default_factory=dict)
  timeout_min: float = 6.0
  workdir: Optional[str] = None  # relative to OUTDIR

  def argv(self, python: str, outdir: pathlib.Path) -> list:
    flags = [f"--config={self.config}", f"--mode={self.mode}"]
    if self.workdir:
      flags.append(f"--workdir={outdir / self.workdir}")
    flags += [f"--config.{key}={_flag_value(value).replace('{outdir}', str(outdir))}"
              for key, value in self.overrides.items()]
    return [python, "launch.py", *flags]


@dataclasses.dataclass
class Case:
  name: str
  table: str  # train | torch | decode | multi30k: where results.md shows it
  minutes: float  # guessed cost on an H100, start-up and compile included
  why: str
  commands: list
  describe: dict = dataclasses.field(default_factory=dict)  # shown in the tables
  lever: bool = False  # a change of the default step, measured against it (`combine`)
  combine: Optional[str] = None  # the model whose measured levers this case combines


def _flag_value(value) -> str:
  return str(value) if not isinstance(value, str) else value


def _bench(model: str, tokens: str = DEFAULT_TOKENS, **overrides) -> dict:
  """Overrides of a bf16 train-step benchmark of `model` at `tokens` per side, decoding off."""
  values = {"model.dtype": "bfloat16", "benchmark.batch_size": ROWS[tokens],
            "benchmark.source_len": SEQ_LEN, "benchmark.target_len": SEQ_LEN,
            "benchmark.warmup": 3, "benchmark.steps": 20, "benchmark.decode_steps": 0}
  values.update(overrides)
  return values


def _train_case(name, model, minutes, why, tokens=DEFAULT_TOKENS, xla_flag="", lever=False,
                **overrides):
  env = {"XLA_FLAGS": xla_flag} if xla_flag else {}
  return Case(name, "train", minutes, why,
              [Command("benchmark", f"experiments/{model}.py", _bench(model, tokens, **overrides),
                       env=env, timeout_min=6)],
              _describe(model, tokens, xla_flag, overrides), lever=lever)


def _describe(model, tokens, xla_flag, overrides) -> dict:
  return {"model": model, "tokens": tokens, "xla_flags": xla_flag or "-",
          "attention": overrides.get("model.attention_impl", "plain"),
          "remat": overrides.get("model.remat", "none"),
          "dropout bits": overrides.get("model.dropout_rng", "threefry")}


def _lever(name, model, why, tokens=DEFAULT_TOKENS, xla_flag="", **overrides):
  """A lever: one change of `model`'s default step, timed against it in the same window. Its
  shapes are the default's (or only the batch differs), so XLA's per-fusion autotuning results,
  kept beside the compilation cache (README: Compile once), serve most of its GEMMs: guessed
  at 1.8 minutes against the default's 2.5-2.7 (start-up and the program's own compile stay)."""
  return _train_case(name, model, 1.8, why, tokens, xla_flag, lever=True, **overrides)


def combined_case(model: str) -> Case:
  """The levers of `model` that beat its default in this window, together (built at run time
  by `combine`); skipped where none did."""
  return Case(f"{model}_best", "train", 2.0, f"{model}: every lever that beat the default, "
              "together (chosen from this window's measurements)", [], {}, combine=model)


def _tokens_per_s(row) -> Optional[float]:
  return (row.get("metrics") or {}).get("target_tokens_per_s") if row.get("status") == "ok" \
      else None


def combine(case: Case, cases: list, rows: dict) -> Optional[Case]:
  """`case` (a combined_case) with the command of its model's winning levers: those whose
  target tokens/s beat the default's, merged best first (a key a better lever set is kept;
  the XLA flags of all of them joined); None when no lever beat the default."""
  default = _tokens_per_s(rows.get(f"{case.combine}_bf16", {}))
  levers = [(c, _tokens_per_s(rows.get(c.name, {}))) for c in cases
            if c.lever and c.describe.get("model") == case.combine]
  winners = sorted([(speed, c) for c, speed in levers if default and speed and speed > default],
                   key=lambda pair: -pair[0])
  if not winners:
    return None
  overrides, flags, defaults = {}, [], _bench(case.combine)
  for _, lever in winners:
    command = lever.commands[0]
    for key, value in command.overrides.items():
      if key not in overrides or overrides[key] == defaults.get(key):
        overrides[key] = value
    if command.env.get("XLA_FLAGS"):
      flags.append(command.env["XLA_FLAGS"])
  env = {"XLA_FLAGS": " ".join(flags)} if flags else {}
  tokens = next((t for t, rows_ in ROWS.items()
                 if rows_ == overrides.get("benchmark.batch_size")), DEFAULT_TOKENS)
  return dataclasses.replace(
      case, commands=[Command("benchmark", f"experiments/{case.combine}.py", overrides, env=env,
                              timeout_min=6)],
      describe=_describe(case.combine, tokens, " ".join(flags), overrides),
      why=f"{case.why}: {', '.join(c.name for _, c in winners)}")


def _torch_case(name, model, minutes, why, tokens=DEFAULT_TOKENS):
  overrides = {"benchmark.torch": True, "benchmark.torch_autocast": True,
               "benchmark.torch_compile": "inductor"}
  # Both frameworks hold their memory in one process: JAX must not take 75% of the GPU up front.
  env = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
  return Case(name, "torch", minutes, why,
              [Command("benchmark", f"experiments/{model}.py", _bench(model, tokens, **overrides),
                       env=env, timeout_min=10)],
              {"model": model, "tokens": tokens})


def _decode_case(name, model, minutes, decode_batch):
  # The benchmark always times a train step first: a small one (8 rows) keeps its cost down.
  overrides = _bench(model, **{"benchmark.batch_size": 8, "benchmark.warmup": 1,
                               "benchmark.steps": 2, "benchmark.decode_batch": decode_batch,
                               "benchmark.decode_steps": 3})
  return Case(name, "decode", minutes,
              f"greedy and beam-4 output tokens/s, {decode_batch} sentences of {SEQ_LEN} tokens",
              [Command("benchmark", f"experiments/{model}.py", overrides, timeout_min=6)],
              {"model": model, "decode_batch": decode_batch})


def _multi30k_case(data_dir: str) -> Case:
  data = {"data.path": data_dir}
  return Case(
      "multi30k", "multi30k", 8.0,
      "the published recipe end to end: 8k updates, then the test set with the mean of the last "
      "10 checkpoints and beam 5 (train keeps 10 checkpoints in this recipe)",
      [Command("train", "experiments/multi30k_ende.py", dict(data), timeout_min=15,
               workdir="runs/multi30k"),
       Command("evaluate", "experiments/multi30k_ende.py",
               {**data, "data.eval_split": "test_2016_flickr", "eval.average_last": 10},
               timeout_min=5, workdir="runs/multi30k")])


# A window: 15 minutes of device time, of which the machine's start and the install take about
# 3 (the first window, 2026-11-28); the cases that fit in the rest run first.
WINDOW_MIN = 15.0
NO_WINNER = "no winner"  # the status of a combination none of whose levers beat the default
STARTUP_MIN = 3.0


def _profiled(model: str) -> dict:
  """The default case's overrides: two more steps traced into OUTDIR/profiles/MODEL, whose
  kernel categories land in its result (benchmark.profile): the profile costs no compile."""
  return {"benchmark.profile": f"{{outdir}}/profiles/{model}"}


def plan(multi30k_dir: Optional[str]) -> list:
  """Every case, most important first: the default step of both models with their profiles,
  then the levers of issue 53 against them (big's first: its goal is the higher), each model's
  winning levers together, and then the rest (PyTorch, the batch sweep, decoding, XLA flags)."""
  cases = [
      _train_case("base_bf16", "base", 2.7, "the default: Transformer base, bf16, 25k tokens/side, "
                  "profiled", **_profiled("base")),
      _train_case("big_bf16", "big", 2.5, "the default: Transformer big, bf16, 25k tokens/side, "
                  "profiled", **_profiled("big")),
      _lever("big_rbg", "big", "dropout bits from XLA's RngBitGenerator, not threefry",
             **{"model.dropout_rng": "rbg"}),
      _lever("big_attn_jax", "big", "jax.nn.dot_product_attention (cuDNN on GPUs; no "
             "attention dropout)", **{"model.attention_impl": "jax",
                                      "model.attention_dropout_rate": 0.0}),
      _lever("big_b64k", "big", "twice the default's tokens per step (the H200 holds them)",
             tokens="64k"),
      _lever("big_b64k_qkv_out", "big", "the same, recomputing the FFN's hidden layer and the "
             "attention weights (remat qkv_out)", tokens="64k", **{"model.remat": "qkv_out"}),
      _lever("base_rbg", "base", "dropout bits from XLA's RngBitGenerator, not threefry",
             **{"model.dropout_rng": "rbg"}),
      _lever("base_attn_jax", "base", "jax.nn.dot_product_attention (cuDNN on GPUs; no "
             "attention dropout)", **{"model.attention_impl": "jax",
                                      "model.attention_dropout_rate": 0.0}),
      _lever("base_b64k", "base", "twice the default's tokens per step", tokens="64k"),
      combined_case("big"),
      combined_case("base"),
      _torch_case("base_torch", "base", 3.0,
                  "torch.nn.Transformer, bf16 autocast + torch.compile, timed in the same process"),
      # At 16k: both frameworks' activations of the big model share the one GPU in this case.
      _torch_case("big_torch", "big", 3.5, "the same for big, at 16k tokens/side so both fit",
                  tokens="16k"),
  ]
  if multi30k_dir:
    cases.append(_multi30k_case(multi30k_dir))
  cases += [
      _lever("big_remat_dots", "big", "recompute all but the weight products' outputs",
             **{"model.remat": "dots"}),
      _train_case("base_b8k", "base", 2.5, "batch sweep", tokens="8k"),
      _train_case("base_b16k", "base", 2.5, "batch sweep", tokens="16k"),
      _train_case("base_b32k", "base", 2.7, "batch sweep", tokens="32k"),
      _train_case("big_b32k", "big", 2.7, "batch sweep", tokens="32k"),
      _decode_case("base_decode64", "base", 2.5, 64),
      _decode_case("base_decode256", "base", 2.7, 256),
      _decode_case("big_decode256", "big", 3.0, 256),
  ]
  cases += [_lever(f"big_xla_{short}", "big", why, xla_flag=flag)
            for short, flag, why in XLA_FLAG_CASES]
  return cases


# The compile phase (`precompile`): the window's train cases compiled at once, each process
# running its benchmark with benchmark.steps=0 (compile, store in the compilation cache, stop);
# then each case is timed alone and loads its program from the cache. Guesses until a window
# measures them (results.json keeps precompile_min and each case's wall time): one compile and
# autotuning as in the first window's cases (2.5-3 min, of which about 2 the compile), about 3
# of the host's 16 cores each (XLA's parallel LLVM code generation); a case that loads its
# program: the process's start, the load, warm-up, timed and traced steps.
COMPILE_MIN = 2.0
CORES_PER_COMPILE = 3
HOST_CORES = 16
TIMED_MIN = 0.6


def precompilable(case: Case) -> bool:
  return case.table == "train" and bool(case.commands) and case.commands[0].mode == "benchmark"


def compile_phase_min(count: int) -> float:
  """Guessed minutes to compile `count` train steps at once on the host's cores."""
  return max(COMPILE_MIN, count * COMPILE_MIN * CORES_PER_COMPILE / HOST_CORES) if count else 0.0


def in_one_window(cases: list, minutes: float = WINDOW_MIN - STARTUP_MIN) -> list:
  """The first cases whose guessed minutes fit in `minutes` (one window after the machine's
  start): the train cases among them compiled at once first, then timed at TIMED_MIN each."""
  fitting = []
  for case in cases:
    trial = fitting + [case]
    compiled = [c for c in trial if precompilable(c)]
    spent = (compile_phase_min(len(compiled)) + TIMED_MIN * len(compiled)
             + sum(c.minutes for c in trial if c not in compiled))
    if spent > minutes:
      break
    fitting = trial
  return fitting


def precompile_command(command: Command) -> Command:
  """The case's benchmark with nothing timed: it compiles the step into the compilation cache
  (benchmark.steps=0), taking GPU memory as it needs it, so that several run at once."""
  overrides = {k: v for k, v in command.overrides.items()
               if k not in ("benchmark.profile", "benchmark.torch", "benchmark.torch_autocast",
                            "benchmark.torch_compile")}
  overrides.update({"benchmark.steps": 0, "benchmark.warmup": 0, "benchmark.decode_steps": 0})
  return dataclasses.replace(command, overrides=overrides, timeout_min=8,
                             env=dict(command.env, XLA_PYTHON_CLIENT_PREALLOCATE="false"))


def precompile(cases: list, state: dict, args, outdir: pathlib.Path, env: dict,
               started: float) -> None:
  """The compile phase: the pending train cases of one window (of --budget_min where given)
  compiled at once, --precompile_jobs at a time; each row gets precompile_s and
  precompile_status, the state precompile_min. A case whose compile failed is still run (and
  compiles then, or fails in its own log)."""
  pending = [c for c, row in zip(cases, state["cases"]) if row["status"] == "pending"]
  left = (args.budget_min - (time.time() - started) / 60 if args.budget_min
          else WINDOW_MIN - STARTUP_MIN)
  chosen = [c for c in in_one_window(pending, left) if precompilable(c)]
  if not chosen or not args.precompile_jobs:
    return
  rows = {row["name"]: row for row in state["cases"]}
  print(f"[{(time.time() - started) / 60:5.1f} min] compiling {len(chosen)} cases at once "
        f"({args.precompile_jobs} at a time): {', '.join(c.name for c in chosen)}", flush=True)
  phase_started = time.time()

  def compile_one(case: Case) -> None:
    command = precompile_command(case.commands[0])
    if args.dry_run:
      command = dataclasses.replace(command, overrides={
          **dry_overrides(command), "benchmark.steps": 0, "benchmark.warmup": 0})
    status, _, seconds, output = run_command(
        command.argv(args.python, outdir), command_env(env, command), command.timeout_min * 60,
        outdir / "logs" / f"{case.name}.compile.log")
    parsed = last_json(output) if status == "ok" else None
    rows[case.name].update(precompile_s=seconds, precompile_status=status if parsed or
                           status != "ok" else "failed")

  with concurrent.futures.ThreadPoolExecutor(max_workers=args.precompile_jobs) as pool:
    list(pool.map(compile_one, chosen))
  state["precompile_min"] = (time.time() - phase_started) / 60
  print(f"          compiled in {state['precompile_min']:.1f} min: " + ", ".join(
      f"{c.name} {rows[c.name]['precompile_status']}" for c in chosen), flush=True)
  write_results(outdir, state, cases, started)


def _cost_min(case: Case, row: dict) -> float:
  """A case's guessed minutes now: TIMED_MIN once its program was compiled ahead."""
  return TIMED_MIN if row.get("precompile_status") == "ok" else case.minutes


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
  else:  # the Multi30k recipe: 10 steps, a checkpoint each, so that the last 10 can be averaged
    values.update({"data.tokens_per_batch": 128, "train.steps": 10, "train.warmup_steps": 5,
                   "train.checkpoint_every": 1, "train.eval_every": 0, "train.log_every": 5,
                   "eval.batch_size": 8, "eval.beam_size": 2, "eval.max_decode_len": 16})
  return values


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


# ----------------------------------------------------------------------------- running


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
        ("XLA_", "JAX_", "CUDA_VISIBLE")))
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
    row["mfu_989"] = m["tflops_per_s"] / PEAK_TFLOPS
  if isinstance(m.get("bleu_lowercase_tokenized"), (int, float)):
    row["bleu_minus_published"] = m["bleu_lowercase_tokenized"] - PUBLISHED_BLEU


def command_env(base_env: dict, command: Command) -> dict:
  """The environment of a command: the suite's, with the command's own on top (its XLA_FLAGS
  after the suite's)."""
  env = dict(base_env)
  for key, value in command.env.items():
    env[key] = f"{env[key]} {value}".strip() if key == "XLA_FLAGS" and env.get(key) else value
  return env


def run_case(case: Case, outdir: pathlib.Path, python: str, base_env: dict, dry_run: bool,
             timeout_cap_s: Optional[float]) -> dict:
  log = outdir / "logs" / f"{case.name}.log"
  log.write_text("")
  row = {"name": case.name, "status": "ok", "wall_s": 0.0, "commands": [],
         "log": str(log.relative_to(outdir))}
  for command in case.commands:
    if dry_run:
      command = dataclasses.replace(command, overrides=dry_overrides(command), timeout_min=3)
    argv = command.argv(python, outdir)
    env = command_env(base_env, command)
    timeout_s = command.timeout_min * 60
    if timeout_cap_s is not None:
      timeout_s = max(30.0, min(timeout_s, timeout_cap_s - row["wall_s"]))
    status, code, seconds, output = run_command(argv, env, timeout_s, log)
    row["commands"].append(" ".join(argv[1:]))
    row["wall_s"] += seconds
    row[f"{command.mode}_wall_s"] = seconds
    if command.mode == "train":
      # The final validation (train also evaluates data.test_split, in a file of its own).
      if command.workdir and latest_eval(outdir / command.workdir):
        row["val_metrics"] = latest_eval(outdir / command.workdir)
    else:
      parsed = last_json(output)
      if parsed is not None:
        row["metrics"] = parsed
      elif status == "ok":
        status = "failed"
        output += "\nerror: no JSON line in the output"
    if status != "ok":
      row.update(status=status, returncode=code, error=_error_line(output))
      break
  derive(row)
  return row


# ----------------------------------------------------------------------------- the estimates

ESTIMATE_TOPOLOGY = "h100"


def estimate_command(case: Case) -> Command:
  """The `--mode=compile` run of a train case's step for an H100: the same model, batch and
  options, compiled on the CPU (XLA_FLAGS as the case's: they steer the GPU compiler too)."""
  bench = case.commands[0]
  overrides = {k: v for k, v in bench.overrides.items() if not k.startswith("benchmark.")}
  overrides.update({"compile.topology": ESTIMATE_TOPOLOGY,
                    "compile.batch_size": bench.overrides["benchmark.batch_size"],
                    "compile.source_len": bench.overrides["benchmark.source_len"],
                    "compile.target_len": bench.overrides["benchmark.target_len"]})
  return Command("compile", bench.config, overrides, env=dict(bench.env), timeout_min=10)


def run_estimate(case: Case, row: dict, outdir: pathlib.Path, python: str, base_env: dict,
                 dry_run: bool) -> None:
  """Adds row["estimate"] (the compile report's train part) or row["estimate_error"]; the case's
  own status stays as measured."""
  command = estimate_command(case)
  if dry_run:
    command = dataclasses.replace(command, overrides=dry_overrides(command), timeout_min=3)
  env = dict(base_env, **command.env)
  status, _, _, output = run_command(command.argv(python, outdir), env, command.timeout_min * 60,
                                     outdir / "logs" / f"{case.name}.estimate.log")
  report = last_json(output) if status == "ok" else None
  if report and "train" in report:
    row["estimate"] = {k: report["train"][k] for k in ("step_s", "mfu", "estimate", "fits",
                                                      "total_bytes", "target_tokens_per_s")}
    row["estimate"]["kind"] = "roofline bound (the compiler's, not autotuned)"
    row.pop("estimate_error", None)
  else:
    row["estimate_error"] = _error_line(output) or status


def run_estimates(cases: list, state: dict, args, outdir: pathlib.Path, env: dict,
                  started: float) -> None:
  """The H100 compile estimate of every measured train case that has none yet (of the first one
  in a dry run)."""
  todo = [(case, row) for case, row in zip(cases, state["cases"])
          if case.table == "train" and row["status"] == "ok" and "estimate" not in row]
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
      print(f"          {row['name']} estimate for {ESTIMATE_TOPOLOGY}: {shown}", flush=True)
      write_results(outdir, state, cases, started)


# ----------------------------------------------------------------------------- reporting


def _num(value, digits=3, scale=1.0) -> str:
  if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
    return "-"
  value *= scale
  if abs(value) >= 1000:
    return f"{value:,.0f}"
  return f"{value:.{digits}g}"


def _m(row, key):
  return (row.get("metrics") or {}).get(key)


TABLES = {
    "train": ("Train step (bf16, rows of 64 + 64 tokens)", (
        ("model", lambda c, r: c.describe["model"]),
        ("tokens/side", lambda c, r: c.describe["tokens"]),
        ("attention", lambda c, r: c.describe["attention"]),
        ("remat", lambda c, r: c.describe["remat"]),
        ("dropout bits", lambda c, r: c.describe.get("dropout bits", "threefry")),
        ("XLA flags", lambda c, r: f"`{c.describe['xla_flags']}`"),
        ("compile s", lambda c, r: _num(_m(r, "compile_s"))),
        ("step ms", lambda c, r: _num(_m(r, "step_ms"))),
        ("target tok/s", lambda c, r: _num(_m(r, "target_tokens_per_s"))),
        ("TFLOP/s", lambda c, r: _num(_m(r, "tflops_per_s"))),
        ("MFU (989)", lambda c, r: _num(r.get("mfu_989"), scale=100) + "%"
         if r.get("mfu_989") is not None else "-"),
        ("peak GiB", lambda c, r: _num(_m(r, "peak_memory_gib"))),
        ("XLA temp GiB", lambda c, r: _num(_m(r, "temp_memory_gib"))),
        ("roofline bound ms (h100)", lambda c, r: _num((r.get("estimate") or {}).get(
            "step_s"), scale=1e3)),
        ("bound's MFU", lambda c, r: _num(r["estimate"]["mfu"], scale=100) + "%"
         if r.get("estimate") else "-"),
        ("measured / bound", lambda c, r: _num(_m(r, "step_ms") / (r["estimate"]["step_s"] * 1e3))
         if r.get("estimate") and _m(r, "step_ms") else "-"),
    )),
    "torch": ("Against PyTorch: torch.nn.Transformer, bf16 autocast, torch.compile, same process", (
        ("model", lambda c, r: c.describe["model"]),
        ("tokens/side", lambda c, r: c.describe["tokens"]),
        ("JAX step ms", lambda c, r: _num(_m(r, "step_ms"))),
        ("PyTorch step ms", lambda c, r: _num(_m(r, "torch_step_ms"))),
        ("PyTorch / JAX", lambda c, r: _num(_m(r, "speedup_vs_torch")) + "x"
         if _m(r, "speedup_vs_torch") else "-"),
        ("JAX params", lambda c, r: _num(_m(r, "params"))),
        ("PyTorch params", lambda c, r: _num(_m(r, "torch_params"))),
    )),
    "decode": ("Decoding (random weights: every row runs all 64 positions)", (
        ("model", lambda c, r: c.describe["model"]),
        ("batch", lambda c, r: str(c.describe["decode_batch"])),
        ("greedy tok/s", lambda c, r: _num(_m(r, "greedy_tokens_per_s"))),
        ("greedy ms/batch", lambda c, r: _num(_m(r, "greedy_ms_per_batch"))),
        ("beam 4 tok/s", lambda c, r: _num(_m(r, "beam4_tokens_per_s"))),
        ("beam 4 ms/batch", lambda c, r: _num(_m(r, "beam4_ms_per_batch"))),
    )),
    "multi30k": (f"Multi30k En-De recipe (published: {PUBLISHED_BLEU} lowercased tokenized BLEU)", (
        ("test BLEU (lc, tok)", lambda c, r: _num(_m(r, "bleu_lowercase_tokenized"), 4)),
        ("vs published", lambda c, r: _num(r.get("bleu_minus_published"), 2)),
        ("sacreBLEU (cased)", lambda c, r: _num(_m(r, "bleu"), 4)),
        ("averaged checkpoints", lambda c, r: str(len(_m(r, "checkpoints") or [])) or "-"),
        ("val BLEU (lc, tok; last checkpoint)",
         lambda c, r: _num((r.get("val_metrics") or {}).get("bleu_lowercase_tokenized"), 4)),
        ("train min", lambda c, r: _num((r.get("train_wall_s") or 0) / 60 or None)),
        ("evaluate s", lambda c, r: _num(r.get("evaluate_wall_s"))),
    )),
}


def render_markdown(state: dict, cases: list) -> str:
  rows = {row["name"]: row for row in state["cases"]}
  env = state.get("environment") or {}
  lines = ["# GPU suite results", ""]
  if state["dry_run"]:
    lines += ["**Dry run on the CPU with tiny overrides: the numbers mean nothing.**", ""]
  lines += [f"- started {state['started']}, {state['elapsed_min']:.1f} min so far; "
            f"plan {state['plan_min']:.1f} min for {len(cases)} cases",
            f"- device: {env.get('device', '?')}; jax {env.get('jax', '?')} "
            f"({env.get('backend', '?')}); torch {env.get('torch', '?')}; "
            f"python {env.get('python', '?')}",
            f"- MFU is against {PEAK_TFLOPS:g} TFLOP/s (H100 dense bf16); FLOPs as in "
            "transformer_jax/benchmark.py",
            f"- estimate: the same step compiled for `{ESTIMATE_TOPOLOGY}` on the CPU "
            "(`--mode=compile`): the compiler's roofline for a program it has not run, not "
            "autotuned; MFU by the model's FLOP formula", ""]
  for table, (title, columns) in TABLES.items():
    members = [c for c in cases if c.table == table]
    if not members:
      continue
    lines += [f"## {title}", "",
              "| case | " + " | ".join(h for h, _ in columns) + " | status |",
              "| --- " * (len(columns) + 2) + "|"]
    for case in members:
      row = rows[case.name]
      done = row["status"] == "ok" or row.get("metrics")
      cells = [fn(case, row) if done else "" for _, fn in columns]
      lines.append(f"| {case.name} | " + " | ".join(cells) + f" | {row['status']} |")
    lines.append("")
  profiled = [row for row in state["cases"] if (row.get("metrics") or {}).get("profile")]
  if profiled:
    kinds = list(profiled[0]["metrics"]["profile"])
    lines += ["## Where the step's time goes (benchmark.profile: two traced steps)", "",
              "| case | " + " | ".join(kinds) + " |", "| --- " * (len(kinds) + 1) + "|"]
    lines += [f"| {row['name']} | " + " | ".join(
        f"{row['metrics']['profile'].get(k, 0):.1%}" for k in kinds) + " |" for row in profiled]
    lines.append("")
  problems = [row for row in state["cases"]
              if row["status"] not in ("ok", "pending", NO_WINNER)]
  if problems:
    lines += ["## Not ok", ""]
    lines += [f"- {row['name']}: {row['status']}"
              + (f" ({row['error']})" if row.get("error") else "")
              + (f", log {row['log']}" if row.get("log") else "") for row in problems]
    lines.append("")
  return "\n".join(lines)


def write_results(outdir: pathlib.Path, state: dict, cases: list, started: float) -> None:
  """results.json and results.md, each replaced atomically: a kill mid-write loses nothing."""
  state["elapsed_min"] = (time.time() - started) / 60
  for name, text in (("results.json", json.dumps(state, indent=2)),
                     ("results.md", render_markdown(state, cases))):
    tmp = outdir / f"{name}.tmp"
    tmp.write_text(text + "\n")
    os.replace(tmp, outdir / name)


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


def _start_case(pool, index, case, state, args, outdir, env, started, cases):
  """Submits one case to the pool, or marks it skipped when it no longer fits the budget."""
  row = state["cases"][index]
  elapsed_min = (time.time() - started) / 60
  cap_s = None
  if args.budget_min:
    if elapsed_min + _cost_min(case, row) > args.budget_min:
      row.update(status="skipped", error="over --budget_min")
      return None
    cap_s = (args.budget_min - elapsed_min) * 60
  if case.combine:
    built = combine(case, cases, {r["name"]: r for r in state["cases"]})
    if built is None:
      row.update(status=NO_WINNER, error=f"no lever of {case.combine} beat its default")
      return None
    case = cases[index] = built
    row["why"] = case.why
  print(f"[{elapsed_min:5.1f} min] {case.name}: {case.why}", flush=True)
  row["status"] = "running"
  return pool.submit(run_case, case, outdir, args.python, env, args.dry_run, cap_s)


def _finish_case(future, row: dict) -> None:
  try:
    row.update(future.result())
  except Exception as e:  # pylint: disable=broad-except  # a bug here must not stop the suite
    row.update(status="error", error=f"{type(e).__name__}: {e}")
  summary = row.get("error") or ", ".join(
      f"{k}={_num(v)}" for k, v in (row.get("metrics") or {}).items()
      if k in ("step_ms", "speedup_vs_torch", "greedy_tokens_per_s", "beam4_tokens_per_s",
               "bleu_lowercase_tokenized"))
  print(f"          {row['name']} {row['status']} in {row.get('wall_s', 0):.0f} s: {summary}",
        flush=True)


def _plan_text(cases: list, skipped: set) -> str:
  lines = [f"{'case':18s} {'min':>5s} {'limit':>6s}  what"]
  for case in cases:
    limit = sum(c.timeout_min for c in case.commands)
    mark = "  (done, skipped)" if case.name in skipped else ""
    lines.append(f"{case.name:18s} {case.minutes:5.2f} {limit:6.0f}  {case.why}{mark}")
  todo = sum(c.minutes for c in cases if c.name not in skipped)
  lines.append(f"total: {len(cases)} cases, about {todo:.1f} min on an H100 "
               f"(each case's limit is the kill time)")
  window = in_one_window([c for c in cases if c.name not in skipped])
  profiles = sum("benchmark.profile" in (c.commands[0].overrides if c.commands else {})
                 for c in window)
  compiled = sum(map(precompilable, window))
  lines.append(f"one {WINDOW_MIN:g}-minute window ({STARTUP_MIN:g} of them the machine's start) "
               f"holds the first {len(window)}: {profiles} profiled default steps, "
               f"{sum(c.lever for c in window)} levers, {sum(bool(c.combine) for c in window)} "
               f"combinations; {compiled} compiled at once first (about "
               f"{compile_phase_min(compiled):.1f} min), then timed at {TIMED_MIN:g} min each "
               "(guessed minutes; pass --budget_min to stop in time)")
  return "\n".join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("outdir", type=pathlib.Path)
  parser.add_argument("--dry_run", action="store_true",
                      help="every case on the CPU with tiny overrides (a check of the suite)")
  parser.add_argument("--only", nargs="+", metavar="NAME",
                      help="run only these cases (names or shell patterns, e.g. 'base_*')")
  parser.add_argument("--multi30k", metavar="DIR",
                      help="folder with train/val/test_2016_flickr .en/.de; without it the "
                      "Multi30k case is left out (a dry run makes a fake one)")
  parser.add_argument("--resume", action="store_true",
                      help="keep the cases OUTDIR/results.json has as ok, run the rest")
  parser.add_argument("--precompile_jobs", type=int, default=6,
                      help="train cases of the window compiled at once before any is timed "
                      "(0: none; each then compiles when it runs)")
  parser.add_argument("--budget_min", type=float, default=0.0,
                      help="skip a case whose estimate no longer fits in this many minutes "
                      "since the start, and cap its timeout to what is left (0 = no budget)")
  parser.add_argument("--no_estimates", action="store_true",
                      help="leave out the H100 compile estimates after the cases")
  parser.add_argument("--python", default=sys.executable, help="interpreter for launch.py")
  parser.add_argument("--jobs", type=int, default=0,
                      help="cases at a time in a dry run (default: up to 4, one per core); a "
                      "real run always runs one: the cases share one GPU and are timed")
  args = parser.parse_args(argv)

  outdir = args.outdir.resolve()
  (outdir / "logs").mkdir(parents=True, exist_ok=True)
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
  cases = plan(multi30k)
  if args.only:
    unknown = [p for p in args.only if not any(fnmatch.fnmatch(c.name, p) for c in cases)]
    if unknown:
      print(f"error: no case matches {', '.join(unknown)}; the cases: "
            f"{', '.join(c.name for c in cases)}", file=sys.stderr)
      return 2
    cases = [c for c in cases if any(fnmatch.fnmatch(c.name, p) for p in args.only)]

  env = dict(os.environ, PYTHONUNBUFFERED="1")
  if args.dry_run:
    # CPU only, also on a GPU machine; one compilation cache shared by the cases, whose tiny
    # steps are often identical (the cache would distort compile times on a real run).
    env.update(JAX_PLATFORMS="cpu", CUDA_VISIBLE_DEVICES="",
               JAX_COMPILATION_CACHE_DIR=str(outdir / "jax_cache"),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")

  previous = {}
  if not args.resume:  # a train run finds no checkpoints of an earlier suite to resume from
    shutil.rmtree(outdir / "runs", ignore_errors=True)
  if args.resume and (outdir / "results.json").is_file():
    previous = {row["name"]: row for row in json.loads(
        (outdir / "results.json").read_text()).get("cases", []) if row.get("status") == "ok"}
  print(_plan_text(cases, set(previous)), flush=True)

  started = time.time()
  state = {"suite": "benchmarks/gpu_suite.py", "dry_run": args.dry_run,
           "started": datetime.datetime.now().isoformat(timespec="seconds"),
           "plan_min": sum(c.minutes for c in cases), "peak_tflops": PEAK_TFLOPS,
           "published_bleu": PUBLISHED_BLEU, "multi30k_dir": multi30k, "environment": {},
           "cases": [previous.get(c.name) or {"name": c.name, "status": "pending"}
                     for c in cases]}
  for row, case in zip(state["cases"], cases):
    row.update(estimate_min=case.minutes, why=case.why, table=case.table)
  write_results(outdir, state, cases, started)
  state["environment"] = probe_environment(args.python, env, with_torch=not args.dry_run)
  print(f"environment: {json.dumps(state['environment'])}", flush=True)
  write_results(outdir, state, cases, started)

  previous_handler = signal.signal(signal.SIGTERM, _raise_interrupted)
  try:
    precompile(cases, state, args, outdir, env, started)
    return _run_all(cases, state, args, outdir, env, started, previous)
  finally:
    signal.signal(signal.SIGTERM, previous_handler)


def _run_all(cases, state, args, outdir, env, started, previous) -> int:
  """Runs the cases not done yet, one at a time (dry run: --jobs at a time); the exit code."""
  jobs = 1 if not args.dry_run else args.jobs or min(4, os.cpu_count() or 1)
  todo = [i for i, case in enumerate(cases) if case.name not in previous]
  with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
    try:
      running = {}
      while todo or running:
        while todo and len(running) < jobs:
          index = todo.pop(0)
          future = _start_case(pool, index, cases[index], state, args, outdir, env, started,
                               cases)
          if future is not None:
            running[future] = index
          write_results(outdir, state, cases, started)
        if not running:
          continue
        done, _ = concurrent.futures.wait(running, return_when=concurrent.futures.FIRST_COMPLETED)
        for future in done:
          index = running.pop(future)
          _finish_case(future, state["cases"][index])
          write_results(outdir, state, cases, started)
    except (Interrupted, KeyboardInterrupt) as e:
      with _RUNNING_LOCK:
        in_flight = list(_RUNNING)
      for process in in_flight:
        _stop(process)
      for index in running.values():
        state["cases"][index].update(status="interrupted", error=str(e) or "interrupted")
      write_results(outdir, state, cases, started)
      print(f"interrupted; the finished cases are in {outdir}", flush=True)
      pool.shutdown(wait=False, cancel_futures=True)
      return 130
  if not args.no_estimates:
    run_estimates(cases, state, args, outdir, env, started)
  print((outdir / "results.md").read_text(), flush=True)
  return 0 if all(row["status"] in ("ok", NO_WINNER) for row in state["cases"]) else 1


if __name__ == "__main__":
  sys.exit(main())
