"""The command line: flags -> one library call per mode.

Installed as the `transformer-jax` console script; also `python -m transformer_jax` and the
checkout's `launch.py`:

  transformer-jax --config=experiments/scan_simple.py --workdir=runs/scan --mode=train
  transformer-jax --config=scan_simple --workdir=runs/scan --mode=translate < in.txt
  transformer-jax --config=gpt_demo --workdir=runs/gpt --mode=generate < prompts.txt
  transformer-jax --config=base --config.model.d_model=256 --mode=describe
  transformer-jax --config=scan_simple --config.model.d_model=64 --mode=config
  transformer-jax --help

`--config` takes an experiment file, or the name of an experiment installed with the package
(`experiments/NAME.py` of the checkout). Errors the user can fix are printed as one line
`error: ...` with exit code 2.

Every mode is one row of MODES: its function, what it does, whether it takes --config and
--workdir, and the other flags it takes; a flag given to a mode that does not take it is refused
in one line naming the modes that do. The library is imported only once the flags are parsed,
so `--help` and flag errors answer without loading JAX.
"""

import difflib
import gc
import json
import logging
import os
import re
import sys
from typing import Callable, NamedTuple, Optional

import ml_collections
from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags

from transformer_jax import experiments
from transformer_jax.core import datastack, secrets, storage
from transformer_jax.core.errors import UserError, unknown_key_message

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Experiment config: a file (experiments/*.py) or an installed experiment's "
    "name (e.g. scan_simple).", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None,
                               "Directory for checkpoints, logs and the tokenizer.")
_SPLIT = flags.DEFINE_string("split", None, "Data split: for --mode=export (default train) and "
                             "--mode=evaluate (default data.eval_split).")
_TEXT = flags.DEFINE_string("text", None, "--mode=plot: an input sentence whose attention maps "
                            "(encoder, decoder, cross) are drawn.")
# --- sweeps (tools/sweep): what the sweep is (its metric, sampler, pruner, budget, seeds) is the
# experiment's config (sweep.*); these flags are this machine's part in it.
_SWEEP = flags.DEFINE_bool(
    "sweep", False, "Be a worker of the experiment's sweep (an Optuna study): take its trials "
    "(get_sweep()'s, then get_search_space()'s draws) until sweep.budget is spent, each trained "
    "in WORKDIR/trial_NNNN. The same command on more machines adds workers (with --sweep_storage).")
_SWEEP_DRY_RUN = flags.DEFINE_bool("sweep_dry_run", False, "Print the sweep's plan (enqueued "
                                   "trials, search space, sampler, pruner, storage, budget); "
                                   "create nothing.")
_SWEEP_PARALLEL = flags.DEFINE_integer("sweep_parallel", 1, "Worker processes to start on this "
                                       "machine (each takes trials of the study).")
_SWEEP_STORAGE = flags.DEFINE_string(
    "sweep_storage", None, "Database of the study, shared by workers on many machines: any "
    "SQLAlchemy URL, e.g. postgresql+psycopg://USER@HOST:5432/DB (its password from PGPASSWORD "
    "or ~/.pgpass, not the command line). Default: TRANSFORMER_JAX_SWEEP_STORAGE, else a journal "
    "file in --workdir (one machine).")
_SWEEP_HEARTBEAT_S = flags.DEFINE_integer(
    "sweep_heartbeat_s", 60, "With --sweep_storage: seconds between a worker's heartbeats; a "
    "trial silent for 3 of them is lost and goes back to the queue.")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "Multi-process runs: host:port of "
                                   "process 0 (auto-detected on Cloud TPU and SLURM).")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Multi-process runs: process count.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "Multi-process runs: this process's index.")
_KEEP_HOST_MEMORY = flags.DEFINE_enum(
    "keep_host_memory", "auto", ["auto", "true", "false"],
    "Let malloc keep freed memory for reuse (Linux/glibc; auto, true or false). XLA:CPU then "
    "stops page-faulting its "
    "large per-step temporaries again every step (about 20% of the CPU benchmark's step); the "
    "process keeps its peak resident memory. auto: only when a step's arrays exceed 32 MiB "
    "(for small steps the shared malloc lock costs more than it saves).")
_COMPILE_CACHE = flags.DEFINE_string(
    "compile_cache", None, "Folder (or gs://, s3:// URL) of the persistent compilation cache "
    "that runs share, so that a program compiled once loads in seconds; off = none. Default: "
    "$TRANSFORMER_JAX_COMPILE_CACHE, else ~/.cache/transformer_jax/xla; a sweep's "
    "WORKDIR/compile_cache, shared by its workers. The cache is trusted code (README: Compile "
    "once).")
_HF_DIR = flags.DEFINE_string("hf_dir", None, "--mode=import_hf / export_hf: the Hugging Face "
                              "model directory read or written (tools/hf).")
_CHECKPOINT_STEP = flags.DEFINE_integer(
    "checkpoint_step", None,
    "Checkpoint to evaluate, translate or generate with (default: the latest).")
_OUTPUT_FORMAT = flags.DEFINE_enum(
    "output_format", "text", ["text", "escaped", "jsonl"],
    "--mode=translate / generate: how each output is written as one line. text: line breaks "
    "inside an output (\\n, \\x0b, \\x1d, ...) as spaces, counted on stderr; escaped: "
    "Python string escapes (\\\\, \\n, \\xHH, \\uHHHH); jsonl: {\"output\": ...} per line.")
# The sweep's settings that were flags until they moved into the experiment's config (sweep.*):
# {old flag: its key}. Each is refused in one line naming --config.sweep.KEY=.
MOVED_TO_CONFIG = {"sweep_metric": "metric", "sweep_sampler": "sampler",
                   "sweep_pruner": "pruner", "sweep_budget": "budget",
                   "sweep_seed": "sampler_seed", "sweep_seeds": "seeds", "sweep_trials": "trials",
                   "sweep_test_best": "test_best", "sweep_retries": "retries",
                   "sweep_outage_s": "outage_s"}


class Mode(NamedTuple):
  """A row of MODES: what --mode=NAME runs and which flags it takes.

  run: run(config, workdir) (config None where the mode takes none). workdir: "" (takes none),
  "optional", "required", or "trained" (required, and read as a trained run's). Without --config,
  a mode that takes both loads the config.json of its --workdir. why_not: {flag: the end of the
  line refusing it}, where the reason is not obvious.
  """
  run: Callable
  help: str
  config: bool
  workdir: str
  flags: tuple = ()
  why_not: dict = {}


# Flag groups that several modes take.
_JOB = ("coordinator_address", "num_processes", "process_id")  # one job of several processes
_CONFIGURED = ("keep_host_memory",)  # it decides by the config's step size
_TRAINS = (*_JOB, "compile_cache", *_CONFIGURED)  # compiles for this machine, in a job
_READS = ("checkpoint_step", *_TRAINS)  # reads a trained run's checkpoint
SWEEPS = ("sweep", "sweep_dry_run")  # the flags that make --mode=train a sweep's worker


def _train(config, workdir):
  from transformer_jax import run as run_lib
  run_lib.train_and_evaluate(config, workdir)


def _evaluate(config, workdir):
  from transformer_jax.eval import evaluate
  evaluate.evaluate_from_workdir(config, workdir, step=_CHECKPOINT_STEP.value, split=_SPLIT.value)


def _translate(config, workdir):  # stdin lines -> stdout translations, in order
  from transformer_jax.eval import translate
  # Bytes, decoded by translate: a line that is not UTF-8 must not lose its whole batch.
  translate.translate_from_workdir(config, workdir, sys.stdin.buffer, sys.stdout,
                                   step=_CHECKPOINT_STEP.value, output_format=_OUTPUT_FORMAT.value)


def _generate(config, workdir):  # stdin prompts -> stdout continuations, in order
  from transformer_jax.eval import generate
  generate.generate_from_workdir(config, workdir, sys.stdin.buffer, sys.stdout,
                                 step=_CHECKPOINT_STEP.value, output_format=_OUTPUT_FORMAT.value)


def _plot(config, workdir):
  from transformer_jax.tools import plot
  for path in plot.plot_workdir(config, workdir, text=_TEXT.value, step=_CHECKPOINT_STEP.value):
    print(path)


def _describe(config, workdir):
  from transformer_jax import config as config_lib
  from transformer_jax import model as model_lib
  print(model_lib.describe(config_lib.validate(config)))


def _config(config, workdir):
  from transformer_jax import config as config_lib
  config_lib.validate(config)  # the config a run would take: a bad value says so here
  print("# the config this command gives a run (--config and its overrides): key = value  "
        "# what it does\n")
  print(config_lib.describe(config))


def _export(config, workdir):
  from transformer_jax import config as config_lib
  from transformer_jax import data
  config_lib.validate(config)
  data.export_split(config, _SPLIT.value or "train", sys.stdout)


def _benchmark(config, workdir):
  from transformer_jax.tools import benchmark
  benchmark.run_benchmark(config)


def _compile(config, workdir):
  from transformer_jax.core import compilation
  from transformer_jax.tools import compile as compile_lib
  # Its programs are for chips this process has none of: JAX's persistent cache (one that
  # JAX_COMPILATION_CACHE_DIR names) would store them, and the next --mode=compile would fail
  # to load them (a program compiled without a device cannot be loaded without one), printing
  # JAX's warning for each before compiling anew. This process keeps none.
  compilation.configure("off")
  compile_lib.run_compile(config)


def _import_hf(config, workdir):
  from transformer_jax.tools import hf
  print(hf.import_hf(_hf_dir(), workdir))


def _export_hf(config, workdir):
  from transformer_jax.tools import hf
  print(hf.export_hf(workdir, _hf_dir(), step=_CHECKPOINT_STEP.value))


def _sweep_results(config, workdir):
  from transformer_jax.tools.sweep import results, store
  print(results.sweep_results(workdir, store.given(_SWEEP_STORAGE.value)), end="")


def _sweep_plot(config, workdir):
  from transformer_jax.tools.sweep import results, store
  for path in results.plot(workdir, store.given(_SWEEP_STORAGE.value)):
    print(path)


def _sweep(config, workdir):
  """--sweep / --sweep_dry_run: this process is a worker of the experiment's study."""
  from transformer_jax import config as config_lib
  from transformer_jax import run as run_lib
  from transformer_jax.tools.sweep import worker
  config_lib.validate(config)
  worker.run_sweep(config_flags.get_config_filename(flags.FLAGS["config"]), workdir,
                   config_flags.get_override_values(flags.FLAGS["config"]),
                   run_lib.train_and_evaluate, sweep_options(config), argv=sys.argv[1:])


MODES = {
    "train": Mode(
        _train, "trains in --workdir, resuming from its newest checkpoint, then evaluates",
        config=True, workdir="required", flags=(*_TRAINS, *SWEEPS),
        why_not={"checkpoint_step": "; training always resumes from the newest checkpoint"}),
    "evaluate": Mode(
        _evaluate, "BLEU, chrF, loss, ... of a checkpoint on --split (one JSON line)",
        config=True, workdir="trained", flags=("split", *_READS)),
    "translate": Mode(
        _translate, "stdin sentences -> stdout translations, one per line, in order",
        config=True, workdir="trained", flags=("output_format", *_READS)),
    "generate": Mode(
        _generate, "stdin prompts -> stdout continuations (a decoder-only language model)",
        config=True, workdir="trained", flags=("output_format", *_READS)),
    "plot": Mode(  # on a sweep's workdir: SWEEP_PLOT
        _plot, "curves, positions and (with --text) attention maps into WORKDIR/plots/",
        config=True, workdir="trained", flags=("text", "sweep_storage", *_READS)),
    "describe": Mode(
        _describe, "the model and its parameter counts",
        config=True, workdir="optional", flags=_CONFIGURED),
    "config": Mode(
        _config, "every config key with its value and what it does (overrides applied)",
        config=True, workdir="optional", flags=_CONFIGURED),
    "export": Mode(
        _export, "a data split (--split) as source<TAB>target lines",
        config=True, workdir="optional", flags=("split", *_CONFIGURED)),
    "benchmark": Mode(
        _benchmark, "times the train step and decoding on a synthetic batch",
        config=True, workdir="", flags=("compile_cache", *_CONFIGURED)),
    "compile": Mode(
        _compile, "compiles for a TPU slice or GPUs on any machine: memory, FLOPs, step time",
        config=True, workdir="", flags=_CONFIGURED),
    "import_hf": Mode(
        _import_hf, "a Hugging Face model directory (--hf_dir) -> a workdir at step 0",
        config=False, workdir="required", flags=("hf_dir",),
        why_not={"config": "; the model's config comes from --hf_dir (its config.json): leave "
                 "--config out, then override keys (--config.KEY=VALUE) in the modes that read "
                 "the new --workdir"}),
    "export_hf": Mode(
        _export_hf, "a workdir -> a Hugging Face model directory (--hf_dir) for from_pretrained",
        config=False, workdir="required", flags=("hf_dir", "checkpoint_step"),
        why_not={"config": "; the export writes the workdir's own config.json and checkpoint: "
                 "leave --config out (to change the model, train it first)"}),
    "sweep_results": Mode(
        _sweep_results, "a sweep's results.md/.csv rebuilt from its study (--workdir), no training",
        config=False, workdir="required", flags=("sweep_storage",),
        why_not={"config": "; the tables are rebuilt from the study in --workdir (and "
                 "--sweep_storage where it is a database)"}),
}
# Two modes change with what they are given: --mode=train with --sweep or --sweep_dry_run is a
# worker of the experiment's sweep; --mode=plot on a sweep's workdir draws its study.
SWEEP = MODES["train"]._replace(
    run=_sweep, help="--sweep: a worker of the experiment's sweep (its study)",
    flags=MODES["train"].flags + ("sweep_parallel", "sweep_storage", "sweep_heartbeat_s"))
SWEEP_PLOT = Mode(_sweep_plot, "Optuna's plots of a sweep's study into WORKDIR/plots/",
                  config=False, workdir="required", flags=("sweep_storage",))
_MODE = flags.DEFINE_string("mode", "train", f"One of {', '.join(MODES)} (default train).")
_OUR_FLAGS = (_CONFIG, _WORKDIR, _MODE, _CHECKPOINT_STEP, _SPLIT, _TEXT, _SWEEP, _SWEEP_DRY_RUN,
              _SWEEP_PARALLEL, _SWEEP_STORAGE, _SWEEP_HEARTBEAT_S, _COORDINATOR, _NUM_PROCESSES,
              _PROCESS_ID, _KEEP_HOST_MEMORY, _COMPILE_CACHE, _HF_DIR, _OUTPUT_FORMAT)


def takes(mode: Mode, flag: str) -> bool:
  return mode.config if flag == "config" else bool(mode.workdir) if flag == "workdir" else (
      flag in mode.flags)


def refused_flag(flag: str, mode: str, given) -> Optional[str]:
  """The one line that refuses --flag for --mode=`mode` (its row of MODES does not take it), or
  None; `given`: the names of the flags given (--sweep makes --mode=train take the sweep's)."""
  row = SWEEP if mode == "train" and set(SWEEPS) & set(given) else MODES[mode]
  if takes(row, flag):
    return None
  if mode == "train" and takes(SWEEP, flag):
    return (f"--{flag} only applies with --sweep or --sweep_dry_run; add --sweep or leave "
            f"--{flag} out")
  if flag in SWEEPS:
    return f"--{flag} trains every trial; it does not combine with --mode={mode}"
  users = [name for name, other in MODES.items()
           if takes(other, flag) or name == "train" and takes(SWEEP, flag)]
  why = row.why_not.get(flag, "")
  if len(users) > 5:  # most modes take it: name the mode that does not
    return f"--mode={mode} does not use --{flag}" + (why or "; leave it out")
  return f"--{flag} is for --mode={' or '.join(users)}, not --mode={mode}" + why


def _help() -> str:
  """What --help prints: the modes, our flags and where the config keys are, one line each."""
  lines = ["usage: transformer-jax --config=EXPERIMENT [--config.KEY=VALUE ...] "
           "[--workdir=DIR] --mode=MODE",
           "       (python launch.py ... from a checkout)", "", "modes (--mode):"]
  lines += [f"  {name:<10} {mode.help}" for name, mode in MODES.items()]
  lines += ["", "flags:"]
  for holder in _OUR_FLAGS:
    text = " ".join(flags.FLAGS[holder.name].help.split())
    text = re.sub(r"^<[^>]*>: ", "", text)  # absl's enum prefix
    first = re.split(r"(?<=\.)\s(?=[A-Z])", text)[0].rstrip(".")  # the first sentence
    lines.append(f"  --{holder.name:<20} {first}")
  lines += ["", "keys of the config: --config.KEY=VALUE sets any key of the experiment; "
            "--mode=config lists them all",
            "  with their values and one line each (e.g. --config=scan_simple --mode=config); "
            "their defaults",
            "  and comments are in transformer_jax/config.py.",
            "sweeps: --sweep makes this command a worker of the experiment's Optuna study, as "
            "its config's sweep.*",
            "  keys say (metric, sampler, pruner, budget, seeds: --config.sweep.budget=N, ...); "
            "on one machine its study",
            "  is a file in --workdir (--sweep_parallel=N workers); on many, every machine runs "
            "the same command",
            "  with --sweep_storage=postgresql+psycopg://... (README: Sweeps; docs/cloud.md).",
            "installed experiments (--config=NAME): " + ", ".join(experiments.names()),
            "", "--helpfull adds the flags of the libraries (absl)."]
  return "\n".join(lines)


def _trial_numbers(trials: str) -> Optional[list]:
  """sweep.trials ("5,3,0") as trial numbers; None when empty (all of get_sweep())."""
  if not str(trials).strip():
    return None
  try:
    return [int(t) for t in str(trials).split(",")]
  except ValueError:
    raise UserError("sweep.trials takes trial numbers of get_sweep(), comma-separated (e.g. "
                    f"--config.sweep.trials=5,3,0); got {trials}") from None


def sweep_options(config):
  """The worker's Options: the sweep's settings from the config (sweep.*), this machine's from
  the flags."""
  from transformer_jax.tools.sweep import store, worker
  s = config.sweep
  return worker.Options(
      metric=s.metric, sampler=s.sampler, pruner=s.pruner, budget=s.budget, seed=s.sampler_seed,
      retries=s.retries, seeds=s.seeds, only=_trial_numbers(s.trials), test_best=s.test_best,
      outage_s=s.outage_s, storage=store.given(_SWEEP_STORAGE.value),
      heartbeat_s=_SWEEP_HEARTBEAT_S.value, parallel=_SWEEP_PARALLEL.value,
      dry_run=_SWEEP_DRY_RUN.value)


def _hf_dir() -> str:
  if not (_HF_DIR.value or "").strip():
    raise UserError(f"--hf_dir is required for --mode={_MODE.value}")
  return _HF_DIR.value


def _fail(message: str) -> None:
  print(f"error: {message}", file=sys.stderr)
  sys.exit(2)


_TYPE_ERRORS = (("invalid literal for int()", "an integer"),
                ("could not convert string to float", "a number"),
                ("Non-boolean argument", "true or false"))


def _flag_error(message: str) -> str:
  """absl's message for a bad flag; for a --config override of the wrong type, a plainer one."""
  match = re.match(r"flag --config\.([\w.]+)=(.*?): (.*)", message)
  if match:
    for marker, kind in _TYPE_ERRORS:
      if marker in match.group(3):
        return f"--config.{match.group(1)} takes {kind}; got {match.group(2)!r}"
  return message + " (see --helpfull)"


def _last_line(text: str) -> str:
  lines = [line.strip() for line in text.splitlines() if line.strip()]
  return lines[-1] if lines else "an error without a message"


def _resolve_config_flags(argv: list) -> list:
  """`--config=NAME` -> the installed experiment file NAME.py when no file NAME exists."""
  resolved = []
  for arg in argv:
    if arg.startswith("--config="):
      path, colon, rest = arg[len("--config="):].partition(":")
      arg = f"--config={experiments.resolve(path)}{colon}{rest}"
    resolved.append(arg)
  return resolved


def _flag_value(argv: list, name: str):
  """The value of --name=V or --name V in argv (the last one), or None."""
  value = None
  for i, arg in enumerate(argv):
    if arg.startswith(f"--{name}="):
      value = arg.split("=", 1)[1]
    elif arg == f"--{name}" and i + 1 < len(argv):
      value = argv[i + 1]
  return value


_WORKDIR_PROBLEM: dict = {}  # why --workdir gave no config (see _workdir_config), by workdir


def _workdir_config(workdir: str, mode: str) -> Optional[str]:
  """The --config that loads `workdir`'s config.json (`experiments/_workdir.py:WORKDIR`), or None
  with the reason kept in _WORKDIR_PROBLEM: a bucket that is missing or unreachable, missing
  credentials, or a workdir without config.json (a local one that does not exist is left to
  check_trained_workdir, which suggests a neighbour)."""
  try:
    path = storage.check(workdir)
    if storage.is_url(path):
      storage.check_bucket(path)  # a bounded wait, and the one line for a bucket's problem
    if storage.isfile(storage.join(path, "config.json")):
      return f"{os.path.join(experiments.DIRECTORY, '_workdir.py')}:{path}"
    if mode != "train":
      problem = ("holds no config.json" if storage.is_url(path) or os.path.isdir(path)
                 else "is a file, not a directory" if os.path.lexists(path)
                 else "does not exist")
      _WORKDIR_PROBLEM[workdir] = UserError(
          f"--workdir {workdir} {problem} to take the run's config from; give the workdir of a "
          "trained run, or --config=EXPERIMENT (the one it was trained with)")
  except UserError as e:
    _WORKDIR_PROBLEM[workdir] = e
  except OSError:
    pass  # a bad --workdir is reported by the mode itself, in one line
  return None


def _workdir_config_flags(argv: list) -> list:
  """Without --config, a mode that reads a workdir holding config.json gets
  `--config=experiments/_workdir.py:WORKDIR`: the workdir's config, which `--config.key=value`
  overrides as usual."""
  if any(arg == "--config" or arg.startswith("--config=") for arg in argv):
    return argv
  workdir = _flag_value(argv, "workdir")
  mode = _flag_value(argv, "mode") or "train"
  if mode not in MODES or not MODES[mode].config or not MODES[mode].workdir or not (
      workdir or "").strip():
    return argv
  if workdir not in _WORKDIR_LOADER:
    _WORKDIR_LOADER[workdir] = _workdir_config(workdir, mode)
  loader = _WORKDIR_LOADER[workdir]
  return argv if loader is None else argv[:1] + [f"--config={loader}"] + argv[1:]


_WORKDIR_LOADER: dict = {}  # _workdir_config's answer, by workdir (argv is read twice)


def _moved_flag(argv: list) -> Optional[str]:
  """The line refusing a sweep setting given as its old flag (MOVED_TO_CONFIG), else None."""
  for arg in argv[1:]:
    if not arg.startswith("-"):
      continue
    name = arg.lstrip("-").split("=", 1)[0]
    flag = name[2:] if name.startswith("no") and name[2:] == "sweep_test_best" else name
    if flag in MOVED_TO_CONFIG:
      key, mode = MOVED_TO_CONFIG[flag], _flag_value(argv, "mode")
      if mode in MODES and not MODES[mode].config:
        return (f"--{flag} is now a key of the experiment's config, sweep.{key}, which "
                f"--mode={mode} does not take (a sweep's tables sort by its study's own "
                "sweep.metric); leave it out")
      if flag == "sweep_test_best":  # a bool: --sweep_test_best, --nosweep_test_best, =false
        value = arg.split("=", 1)[1] if "=" in arg else str(name == flag)
      else:
        value = _flag_value(argv, flag) or "VALUE"
      return (f"--{flag} is now a key of the experiment's config, sweep.{key}: give "
              f"--config.sweep.{key}={value} (or set it in the experiment's get_config())")
  return None


def _parse_flags(argv):
  """absl parsing, with every flag error turned into one line and exit code 2."""
  if any(arg in ("--help", "-h", "-?", "--helpshort") for arg in argv[1:]):
    print(_help())  # absl's would print "Try --helpfull" and exit 1
    sys.exit(0)
  if "--helpfull" in argv[1:]:  # absl's lists its own flags first and exits 1
    print(_help() + "\n\nevery flag, the libraries' (absl) included:\n" + flags.FLAGS.get_help())
    sys.exit(0)
  if "--config=" in argv:
    _fail("--config is empty (an unset shell variable?); give an experiment file or name, e.g. "
          "--config=experiments/scan_simple.py")
  moved = _moved_flag(argv)
  if moved:
    _fail(moved)
  mode = _flag_value(argv, "mode")
  configless = mode in MODES and not MODES[mode].config
  if configless and any(a.split("=")[0].startswith("--config") for a in argv[1:]):
    _fail(refused_flag("config", mode, ()))  # absl would call --config.KEY an unknown flag
  argv = _workdir_config_flags(_resolve_config_flags(argv))
  # ml_collections reads overrides from sys.argv
  sys.argv[:] = _workdir_config_flags(_resolve_config_flags(sys.argv))
  # ml_collections logs a warning when get_config() returns None; run() reports that as an error.
  logging.getLogger("absl").setLevel(logging.ERROR)
  if any(arg.startswith("--config=") for arg in argv) or configless:
    from transformer_jax.core import platforms
    if mode == "compile":
      platforms.quiet_compiler_logs()  # before the config file imports JAX
    # Before anything (a config file, a workdir's checks) starts a JAX backend: JAX would look
    # for the accelerator plugins first, and an installed CUDA plugin without a GPU prints its
    # traceback.
    platforms.cpu_only_unless_accelerated()
  try:
    remaining = flags.FLAGS(argv)
  except flags.Error as e:
    text = str(e)
    if "Error whilst parsing config file" in text:  # the file or its get_config() raised
      where = "its get_config()" if ", in get_config\n" in text else "the file"
      _fail(f"cannot load --config: {where} raised {_last_line(text)}")
    _fail(_flag_error(text.splitlines()[0]))
  except AttributeError as e:
    if "has no attribute 'get_config'" in str(e):
      _fail("cannot load --config: the file defines no get_config(); an experiment file "
            "defines get_config() returning a ConfigDict (see experiments/tiny.py)")
    _fail(unknown_key_message(e, argv))
  except KeyError as e:  # ml_collections: an override names no config key
    _fail(unknown_key_message(e, argv))
  except Exception as e:  # a config file that fails to import
    _fail(f"cannot load --config: {type(e).__name__}: {_last_line(str(e))}")
  logging.getLogger("absl").setLevel(logging.NOTSET)
  try:
    if _CONFIG.value is not None:
      _CONFIG.value.get("seed")  # config files load lazily; surface a bad path or broken file now
  except Exception as e:  # anything a broken config file raises
    _fail(f"cannot load --config: {str(e).splitlines()[-1].strip()}; check the path, or name "
          f"an installed experiment ({', '.join(experiments.names())})")
  return remaining


def _check_flags(mode: str) -> None:
  """Flag values that no library call checks, and flags the mode does not take (MODES)."""
  for flag in (_WORKDIR, _TEXT, _SPLIT, _COORDINATOR):
    if flag.value is not None and not flag.value.strip():
      raise UserError(f"--{flag.name} is empty (an unset shell variable?); give a value or "
                      "leave the flag out")
  given = [h.name for h in _OUR_FLAGS if h.name != "mode" and flags.FLAGS[h.name].present]
  for name in given:
    problem = refused_flag(name, mode, given)
    if problem:
      raise UserError(problem)
  count, index = _NUM_PROCESSES.value, _PROCESS_ID.value
  if count is not None and count < 1:
    raise UserError(f"--num_processes must be positive, got {count}")
  if index is not None and not 0 <= index < (count or 1):
    raise UserError(f"--process_id must be in [0, --num_processes), got {index}")
  if _COORDINATOR.value and not re.fullmatch(r"\S+:\d+", _COORDINATOR.value):
    raise UserError(f"--coordinator_address must be host:port, got {_COORDINATOR.value!r}")


def _chosen(name: str) -> Mode:
  """The row that runs --mode=`name`: MODES', or SWEEP / SWEEP_PLOT (see there)."""
  if name == "train" and (_SWEEP.value or _SWEEP_DRY_RUN.value):
    return SWEEP
  if name == "plot" and (_WORKDIR.value or "").strip():
    from transformer_jax.tools.sweep import store
    if store.is_sweep_workdir(_WORKDIR.value):
      return SWEEP_PLOT
  return MODES[name]


def _given_config(workdir: Optional[str]):
  """--config (with its overrides), or the one line saying why there is none."""
  config = _CONFIG.value
  if config is None:
    if flags.FLAGS["config"].present:  # a file was given, and its get_config() returned None
      raise UserError("the experiment's get_config() returned None; return a ConfigDict "
                      "(see experiments/tiny.py)")
    problem = _WORKDIR_PROBLEM.get(workdir)
    if problem is not None:
      raise problem  # the workdir's own problem, not the missing --config
    raise UserError("--config is required, e.g. --config=experiments/scan_simple.py (a mode "
                    "that reads a --workdir holding config.json may leave it out)")
  if not isinstance(config, ml_collections.ConfigDict):
    raise UserError(f"the experiment's get_config() returned {type(config).__name__}, not an "
                    "ml_collections.ConfigDict (see experiments/tiny.py)")
  return config


def run(argv) -> None:
  if len(argv) > 1:
    raise UserError(f"unexpected arguments {' '.join(argv[1:])}; flags look like --name=value")
  name = _MODE.value
  if name not in MODES:
    raise UserError(f"--mode must be one of {', '.join(MODES)}; got {name!r}")
  _check_flags(name)
  mode, workdir = _chosen(name), _WORKDIR.value
  if mode.workdir in ("required", "trained") and workdir is None:
    raise UserError(f"--workdir is required for --mode={name}"
                    + (" (the sweep's)" if name == "sweep_results" else ""))
  if not mode.config:  # a Hugging Face directory in or out, a sweep's study
    if "hf_dir" in mode.flags:
      from transformer_jax.core import platforms
      platforms.cpu_only_unless_accelerated()
    mode.run(None, workdir)
    return
  if workdir is not None and (mode.workdir == "trained" or mode.workdir == "optional"
                              and _CONFIG.value is None):
    check_trained_workdir(workdir)  # before "--config is required": a typo says so
  config = _given_config(workdir)
  if mode.workdir in ("required", "trained") and mode is not SWEEP:
    from transformer_jax.train import checkpoint
    checkpoint.check_config_file(workdir)  # the checkpoint is the truth
    if mode.workdir == "trained":
      _check_workdir_config(config, workdir)

  from transformer_jax.core import hostmem, platforms
  platforms.cpu_only_unless_accelerated()  # before JAX starts a backend
  keep = _KEEP_HOST_MEMORY.value
  try:
    worth = keep == "true" or (keep == "auto" and hostmem.worth_keeping(config, name))
  except (AttributeError, KeyError, TypeError):  # keys missing: config_lib.validate says which
    worth = keep == "true"
  if worth:
    hostmem.keep_freed_memory()  # before the first JAX computation starts the CPU backend
  if "compile_cache" in mode.flags and not _SWEEP_DRY_RUN.value:
    _configure_compile_cache()
  if "num_processes" in mode.flags and not _SWEEP_DRY_RUN.value:  # a job's processes: one run
    from transformer_jax.train import sharding
    sharding.initialize_distributed(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
  mode.run(config, workdir)


def _check_workdir_config(config, workdir: str) -> None:
  """A --config that describes another model or data than the workdir was trained with is
  refused by name (the workdir's own config.json is what --config left out loads)."""
  from transformer_jax.core import trees
  from transformer_jax.train import checkpoint
  path = storage.join(workdir, "config.json")
  try:
    saved = json.loads(storage.read_text(path))
  except (OSError, ValueError):
    return  # no config.json (or a damaged one): loading the checkpoint decides
  incompatible, _ = checkpoint.compare_configs(saved, config)
  old, new = trees.flatten(saved), trees.flatten(checkpoint.config_json(config))
  # A workdir that never trained (an imported model: no metrics.jsonl) has no data of its own.
  trained = any(storage.exists(storage.join(workdir, name))  # a bucket's log is in parts
                for name in ("metrics.jsonl", "metrics.jsonl.parts"))
  incompatible += [f"{key} {old[key]} -> {new[key]}" for key in checkpoint.DATA_KEYS
                   if trained and key in old and key in new and old[key] != new[key]]
  if incompatible:
    shown = ", ".join(incompatible[:4]) + (f" and {len(incompatible) - 4} more"
                                           if len(incompatible) > 4 else "")
    raise UserError(f"the config given does not fit {workdir} (its config.json): {shown}; leave "
                    "--config out to use the workdir's own config (--config.key=value still "
                    "overrides), or pick another --workdir")


def check_trained_workdir(workdir: str) -> None:
  """A --workdir that a reading mode cannot use: missing (with the nearest existing sibling
  directory as a guess), a file, or with a file where its checkpoints directory belongs."""
  if not workdir.strip() or storage.is_url(workdir):
    return  # empty: _check_flags says so; a bucket: loading its config.json says what is missing
  path = os.path.expanduser(workdir)
  if not os.path.lexists(path):
    parent = os.path.dirname(os.path.normpath(workdir))
    try:
      siblings = sorted(name for name in os.listdir(os.path.expanduser(parent) or ".")
                        if os.path.isdir(os.path.join(os.path.expanduser(parent), name)))
    except OSError:
      siblings = []
    guess = difflib.get_close_matches(os.path.basename(os.path.normpath(workdir)), siblings, n=1)
    raise UserError(f"--workdir {workdir} does not exist; "
                    + (f"did you mean {os.path.join(parent, guess[0])}?" if guess else
                       "give the directory of a trained run (--mode=train writes one)"))
  if not os.path.isdir(path):
    raise UserError(f"--workdir {workdir} is a file, not a directory; give the directory of a "
                    "trained run (--mode=train writes one)")
  checkpoints = os.path.join(path, "checkpoints")
  if os.path.lexists(checkpoints) and not os.path.isdir(checkpoints):
    raise UserError(f"{checkpoints} is a file, where a trained workdir keeps its directory of "
                    "checkpoints; move the file away and put the checkpoints back, or give "
                    "another --workdir")


def _configure_compile_cache() -> None:
  """The persistent compilation cache of this process (core/compilation.py): --compile_cache,
  else a sweep's own in its workdir (every worker's, on every host), else the default."""
  from transformer_jax.core import compilation
  directory = _COMPILE_CACHE.value
  if directory is not None and not directory.strip():
    raise UserError("--compile_cache is empty (an unset shell variable?); give a folder, or off")
  if (directory is None and _SWEEP.value and _WORKDIR.value
      and not os.environ.get(compilation.ENV) and not os.environ.get("JAX_COMPILATION_CACHE_DIR")):
    directory = storage.join(storage.check(_WORKDIR.value), "compile_cache")
  compilation.configure(directory)


def _stdout_file():
  """The file behind stdout, where Linux names it in /proc; else None."""
  try:
    return os.readlink(f"/proc/self/fd/{sys.stdout.fileno()}")
  except (OSError, ValueError):
    return None


# Python's cyclic garbage collector in a process that traces programs: tracing makes hundreds of
# thousands of short-lived objects, and with the default thresholds (a young collection every
# 700 new objects, now and then a full one over every object of JAX and the other libraries)
# the collector took 0.5 of the 4 CPU-seconds of a tiny model's 3-step run, mostly before its
# first step; these thresholds took 0.1 (docs/benchmarks.md). The same cycles are freed, later.
GC_THRESHOLDS = (50_000, 20, 10)


def collect_garbage_less_often(freeze: bool = True) -> None:
  """GC_THRESHOLDS set, and (`freeze`) the objects made so far, the imported libraries' that
  live as long as the process, frozen out of the collector's scans."""
  if freeze:
    gc.freeze()
  gc.set_threshold(*GC_THRESHOLDS)


def _main(argv) -> None:
  collect_garbage_less_often()
  # INFO from JAX and orbax ("no TPU found", every checkpoint file) buries the training log.
  absl_logging.set_verbosity(absl_logging.WARNING)
  logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
  secrets.redact_argv()  # parsed: what trackers and lock files record of it has no password
  try:
    # From a frame with room on CPython's frame stack beyond it: tracing then never maps and
    # unmaps a chunk of that stack at each call (core/datastack.py).
    datastack.call(run, argv)
    sys.stdout.flush()  # inside the try: a closed pipe fails here, not at interpreter exit
  except UserError as e:
    _fail(" ".join(str(e).splitlines()))
  except KeyboardInterrupt as e:
    print(f"interrupted ({e})" if str(e) else "interrupted", file=sys.stderr)
    sys.exit(130)
  except BrokenPipeError:
    # The reader of stdout went away (`--mode=export | head`): stop quietly. Point stdout at
    # /dev/null so that Python's own flush at exit does not report the broken pipe again.
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    sys.exit(0)
  except OSError as e:
    from transformer_jax.core import files
    if e.errno not in files.WRITE_ERRNOS:
      raise
    # A write that no caller turned into a UserError: a full disk or a read-only file system
    # under a file, or under stdout (the library names every file it writes).
    if e.filename:
      error = files.write_error(str(e.filename), e)
    else:
      target = _stdout_file()
      error = files.write_error(f"standard output ({target or 'not a file'})", e, where=target)
    _fail(" ".join(str(error).splitlines()))
  except Exception as e:
    # In a job of several processes, another process killed (or its host lost) fails this one's
    # next collective: one line, not a traceback (core/job_output.py).
    if "jax" in sys.modules:
      from transformer_jax.core import job_output
      if job_output.is_peer_lost(e):
        job_output.stop_for_lost_peer(str(e).splitlines()[0])
    raise


def main() -> None:
  """The console script: parses the flags and runs the mode."""
  collect_garbage_less_often(freeze=False)  # from the start: parsing the flags imports JAX
  app.run(_main, flags_parser=_parse_flags)


if __name__ == "__main__":
  main()
