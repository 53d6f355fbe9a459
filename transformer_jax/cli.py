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

The library is imported only once the flags are parsed, so `--help` and flag errors answer
without loading JAX.
"""

import difflib
import json
import logging
import os
import re
import sys
from typing import Optional

import ml_collections
from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags

from transformer_jax import experiments
from transformer_jax.core import secrets, storage
from transformer_jax.core.errors import UserError, unknown_key_message

# Each mode and what it does, in one line (README's mode table says more).
MODE_HELP = {
    "train": "trains in --workdir, resuming from its newest checkpoint, then evaluates",
    "evaluate": "BLEU, chrF, loss, ... of a checkpoint on --split (one JSON line)",
    "translate": "stdin sentences -> stdout translations, one per line, in order",
    "generate": "stdin prompts -> stdout continuations (a decoder-only language model)",
    "plot": "curves, positions and (with --text) attention maps into WORKDIR/plots/",
    "describe": "the model and its parameter counts",
    "config": "every config key with its value and what it does (overrides applied)",
    "export": "a data split (--split) as source<TAB>target lines",
    "benchmark": "times the train step and decoding on a synthetic batch",
    "compile": "compiles for a TPU slice or GPUs on any machine: memory, FLOPs, step time",
    "import_hf": "a Hugging Face model directory (--hf_dir) -> a workdir at step 0",
    "export_hf": "a workdir -> a Hugging Face model directory (--hf_dir) for from_pretrained",
    "sweep_results": "a sweep's results.md/.csv rebuilt from its study (--workdir), no training",
}
MODES = tuple(MODE_HELP)
HF_MODES = ("import_hf", "export_hf")  # Hugging Face model directories in and out: no --config
# Modes that read a workdir: without --config they load the config it was trained with.
WORKDIR_MODES = ("train", "evaluate", "translate", "generate", "plot")
# Modes that only read a trained workdir.
READING_MODES = ("evaluate", "translate", "generate", "plot")
# Modes that read a config alone: with --workdir and without --config, the workdir's.
DESCRIBING_MODES = ("describe", "config", "export")
# The modes --config is for: not the Hugging Face ones, nor sweep_results (it reads the study).
CONFIG_MODES = tuple(m for m in MODES if m not in HF_MODES + ("sweep_results",))
SWEEPS = ("sweep", "sweep_dry_run")  # the flags that start a sweep (--mode=train)
# The modes that compile programs for this machine: the compilation cache serves them.
CACHED_MODES = ("train", "evaluate", "translate", "generate", "plot", "benchmark")
# The modes that read a sweep's study (plot: where --workdir is a sweep's): its storage and
# metric flags need no --sweep there.
SWEEP_READING_MODES = ("sweep_results", "plot")

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Experiment config: a file (experiments/*.py) or an installed experiment's "
    "name (e.g. scan_simple).", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None,
                               "Directory for checkpoints, logs and the tokenizer.")
_MODE = flags.DEFINE_string("mode", "train", f"One of {', '.join(MODES)} (default train).")
_SPLIT = flags.DEFINE_string("split", None, "Data split: for --mode=export (default train) and "
                             "--mode=evaluate (default data.eval_split).")
_TEXT = flags.DEFINE_string("text", None, "--mode=plot: an input sentence whose attention maps "
                            "(encoder, decoder, cross) are drawn.")
# --- sweeps (tools/sweep): --sweep and --sweep_dry_run (mode train); --sweep_storage also for
# --mode=sweep_results and --mode=plot on a sweep's workdir.
_SWEEP = flags.DEFINE_bool(
    "sweep", False, "Be a worker of the experiment's sweep (an Optuna study): take its trials "
    "(get_sweep()'s, then get_search_space()'s draws) until --sweep_budget is spent, each trained "
    "in WORKDIR/trial_NNNN. The same command on more machines adds workers (with --sweep_storage).")
_SWEEP_PARALLEL = flags.DEFINE_integer("sweep_parallel", 1, "Worker processes to start on this "
                                       "machine (each takes trials of the study).")
_SWEEP_SEEDS = flags.DEFINE_integer(
    "sweep_seeds", 0, "Runs of every get_sweep() trial, with seeds S, S+1, ... (S: the trial's "
    "config seed), each a trial of its own; results.md adds the median, min and max over seeds. "
    "0 = as get_sweep() says: a trial's 'seeds' entry, else one run.")
_SWEEP_TRIALS = flags.DEFINE_list(
    "sweep_trials", None, "Enqueue only these trials of get_sweep() (numbers from 0, "
    "comma-separated), in this order; trials already in the study stay.")
_SWEEP_TEST_BEST = flags.DEFINE_bool(
    "sweep_test_best", False, "Train each trial without data.test_split, then score its "
    "checkpoint with the best train.best_metric on data.test_split once (test_* columns; "
    "never used to sort).")
_SWEEP_DRY_RUN = flags.DEFINE_bool("sweep_dry_run", False, "Print the sweep's plan (enqueued "
                                   "trials, search space, sampler, pruner, storage, budget); "
                                   "create nothing.")
_SWEEP_METRIC = flags.DEFINE_string("sweep_metric", "loss", "Eval metric the study optimises, "
                                    "the pruner watches and the results table sorts by (loss "
                                    "and perplexity: lower is better).")
_SWEEP_SAMPLER = flags.DEFINE_string("sweep_sampler", "tpe", "Optuna sampler drawing "
                                     "get_search_space()'s trials: tpe, gp, cmaes, random or grid.")
_SWEEP_PRUNER = flags.DEFINE_string("sweep_pruner", "none", "Early stopping at every evaluation "
                                    "(train.eval_every): median, asha, hyperband or none.")
_SWEEP_BUDGET = flags.DEFINE_integer("sweep_budget", 0, "Trials of the study in all, "
                                     "get_sweep()'s included (0: get_sweep()'s only; a grid: all "
                                     "of it).")
_SWEEP_STORAGE = flags.DEFINE_string(
    "sweep_storage", None, "Database of the study, shared by workers on many machines: any "
    "SQLAlchemy URL, e.g. postgresql+psycopg://USER@HOST:5432/DB (its password from PGPASSWORD "
    "or ~/.pgpass, not the command line). Default: TRANSFORMER_JAX_SWEEP_STORAGE, else a journal "
    "file in --workdir (one machine).")
_SWEEP_SEED = flags.DEFINE_integer(
    "sweep_seed", 0, "Seed of the sampler of the study's first worker; the workers that join it "
    "derive their own from it (--sweep_parallel's i-th worker: its i-th; others: with entropy).")
_SWEEP_HEARTBEAT_S = flags.DEFINE_integer(
    "sweep_heartbeat_s", 60, "With --sweep_storage: seconds between a worker's heartbeats; a "
    "trial silent for 3 of them is lost and goes back to the queue.")
_SWEEP_OUTAGE_S = flags.DEFINE_float(
    "sweep_outage_s", 300.0, "With --sweep_storage: seconds a worker rides out a database that "
    "stops answering mid-sweep before it stops, naming its trial's checkpoint.")
_SWEEP_RETRIES = flags.DEFINE_integer("sweep_retries", 3, "Times a trial whose worker was lost "
                                      "(or preempted) is taken up again.")
_SWEEP_FLAGS = (_SWEEP, _SWEEP_PARALLEL, _SWEEP_SEEDS, _SWEEP_TRIALS, _SWEEP_TEST_BEST,
                _SWEEP_DRY_RUN, _SWEEP_METRIC, _SWEEP_SAMPLER, _SWEEP_PRUNER, _SWEEP_BUDGET,
                _SWEEP_STORAGE, _SWEEP_SEED, _SWEEP_HEARTBEAT_S, _SWEEP_OUTAGE_S, _SWEEP_RETRIES)
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
_OUR_FLAGS = (_CONFIG, _WORKDIR, _MODE, _CHECKPOINT_STEP, _SPLIT, _TEXT, *_SWEEP_FLAGS,
              _COORDINATOR, _NUM_PROCESSES, _PROCESS_ID, _KEEP_HOST_MEMORY, _COMPILE_CACHE,
              _HF_DIR, _OUTPUT_FORMAT)


def _help() -> str:
  """What --help prints: the modes, our flags and where the config keys are, one line each."""
  lines = ["usage: transformer-jax --config=EXPERIMENT [--config.KEY=VALUE ...] "
           "[--workdir=DIR] --mode=MODE",
           "       (python launch.py ... from a checkout)", "", "modes (--mode):"]
  lines += [f"  {mode:<10} {text}" for mode, text in MODE_HELP.items()]
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
            "sweeps: --sweep makes this command a worker of the experiment's Optuna study; on "
            "one machine",
            "  its study is a file in --workdir (--sweep_parallel=N workers); on many, every "
            "machine runs the",
            "  same command with --sweep_storage=postgresql+psycopg://... (README: Sweeps; "
            "docs/cloud.md).",
            "installed experiments (--config=NAME): " + ", ".join(experiments.names()),
            "", "--helpfull adds the flags of the libraries (absl)."]
  return "\n".join(lines)


def _sweep_trials():
  """--sweep_trials as trial numbers (None when not given)."""
  if _SWEEP_TRIALS.value is None:
    return None
  try:
    return [int(t) for t in _SWEEP_TRIALS.value]
  except ValueError:
    raise UserError("--sweep_trials takes trial numbers of get_sweep(), comma-separated (e.g. "
                    f"--sweep_trials=5,3,0); got {','.join(_SWEEP_TRIALS.value)}") from None


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
      problem = ("does not exist" if not storage.is_url(path) and not os.path.lexists(path)
                 else "is a file, not a directory" if not storage.is_url(path)
                 and not os.path.isdir(path) else "holds no config.json")
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
  if mode not in WORKDIR_MODES + DESCRIBING_MODES or not workdir or not workdir.strip():
    return argv
  if workdir not in _WORKDIR_LOADER:
    _WORKDIR_LOADER[workdir] = _workdir_config(workdir, mode)
  loader = _WORKDIR_LOADER[workdir]
  return argv if loader is None else argv[:1] + [f"--config={loader}"] + argv[1:]


_WORKDIR_LOADER: dict = {}  # _workdir_config's answer, by workdir (argv is read twice)


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
  mode = _flag_value(argv, "mode")
  if mode in HF_MODES and any(a.split("=")[0].startswith("--config") for a in argv[1:]):
    _fail(refused_flag("config", mode, ()))  # absl would call --config.KEY an unknown flag
  argv = _workdir_config_flags(_resolve_config_flags(argv))
  # ml_collections reads overrides from sys.argv
  sys.argv[:] = _workdir_config_flags(_resolve_config_flags(sys.argv))
  # ml_collections logs a warning when get_config() returns None; run() reports that as an error.
  logging.getLogger("absl").setLevel(logging.ERROR)
  if any(arg.startswith("--config=") for arg in argv) or mode in HF_MODES:
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


# Which modes use each of our flags, and the flags it needs beside it (any one of them): a flag
# given to another mode, or without what it needs, is refused in one line. A new flag is one
# entry here.
FLAG_USES = {
    "config": (CONFIG_MODES, ()),
    "workdir": (WORKDIR_MODES + DESCRIBING_MODES + HF_MODES + ("sweep_results",), ()),
    "checkpoint_step": (READING_MODES + ("export_hf",), ()),
    "split": (("export", "evaluate"), ()),
    "text": (("plot",), ()),
    "hf_dir": (HF_MODES, ()),
    "output_format": (("translate", "generate"), ()),
    "sweep": (("train",), ()),
    "sweep_dry_run": (("train",), ()),
    "sweep_parallel": (("train",), SWEEPS),
    "sweep_seeds": (("train",), SWEEPS),
    "sweep_trials": (("train",), SWEEPS),
    "sweep_test_best": (("train",), SWEEPS),
    "sweep_metric": (("train", "sweep_results"), SWEEPS),
    "sweep_sampler": (("train",), SWEEPS),
    "sweep_pruner": (("train",), SWEEPS),
    "sweep_budget": (("train",), SWEEPS),
    "sweep_storage": (("train",) + SWEEP_READING_MODES, SWEEPS),
    "sweep_seed": (("train",), SWEEPS),
    "sweep_heartbeat_s": (("train",), SWEEPS),
    "sweep_outage_s": (("train",), SWEEPS),
    "sweep_retries": (("train",), SWEEPS),
    "coordinator_address": (WORKDIR_MODES, ()),
    "num_processes": (WORKDIR_MODES, ()),
    "process_id": (WORKDIR_MODES, ()),
    "keep_host_memory": (CONFIG_MODES, ()),
    "compile_cache": (CACHED_MODES, ()),
}
# What a refusal adds where the reason is not obvious: (flag, mode) -> the rest of the line.
_WHY_NOT = {
    ("checkpoint_step", "train"): "; training always resumes from the newest checkpoint",
    ("config", "import_hf"): "; the model's config comes from --hf_dir (its config.json): leave "
                             "--config out, then override keys (--config.KEY=VALUE) in the modes "
                             "that read the new --workdir",
    ("config", "sweep_results"): "; the tables are rebuilt from the study in --workdir (and "
                                 "--sweep_storage where it is a database)",
    ("config", "export_hf"): "; the export writes the workdir's own config.json and checkpoint: "
                             "leave --config out (to change the model, train it first)",
}


def refused_flag(name: str, mode: str, given) -> Optional[str]:
  """The one line that refuses --name (a key of FLAG_USES) for `mode` when the mode does not use
  it or none of the flags it needs is among `given` (flag names); None when it is used."""
  modes, needs = FLAG_USES[name]
  if mode not in modes:
    if name in SWEEPS:
      return f"--{name} trains every trial; it does not combine with --mode={mode}"
    why = _WHY_NOT.get((name, mode), "")
    if len(modes) > 5:  # most modes take it: name the mode that does not
      return f"--mode={mode} does not use --{name}" + (why or "; leave it out")
    return f"--{name} is for --mode={' or '.join(modes)}, not --mode={mode}" + why
  if needs and mode not in SWEEP_READING_MODES and not any(n in given for n in needs):
    options = " or ".join(f"--{n}" for n in needs)
    return f"--{name} only applies with {options}; add --{needs[0]} or leave --{name} out"
  return None


def _check_flags(mode: str) -> None:
  """Flag values that no library call checks, and flags the mode does not use (FLAG_USES)."""
  for flag in (_WORKDIR, _TEXT, _SPLIT, _COORDINATOR):
    if flag.value is not None and not flag.value.strip():
      raise UserError(f"--{flag.name} is empty (an unset shell variable?); give a value or "
                      "leave the flag out")
  given = [name for name in FLAG_USES if flags.FLAGS[name].present]
  for name in given:
    problem = refused_flag(name, mode, given)
    if problem:
      raise UserError(problem)
  if _SWEEP.value or _SWEEP_DRY_RUN.value:
    from transformer_jax.core import metric_names
    if _SWEEP_METRIC.value not in metric_names.EVAL_METRICS:
      raise UserError(f"--sweep_metric must be one of {', '.join(metric_names.EVAL_METRICS)}; "
                      f"got {_SWEEP_METRIC.value!r}")
  count, index = _NUM_PROCESSES.value, _PROCESS_ID.value
  if count is not None and count < 1:
    raise UserError(f"--num_processes must be positive, got {count}")
  if index is not None and not 0 <= index < (count or 1):
    raise UserError(f"--process_id must be in [0, --num_processes), got {index}")
  if _COORDINATOR.value and not re.fullmatch(r"\S+:\d+", _COORDINATOR.value):
    raise UserError(f"--coordinator_address must be host:port, got {_COORDINATOR.value!r}")


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


def run(argv) -> None:
  if len(argv) > 1:
    raise UserError(f"unexpected arguments {' '.join(argv[1:])}; flags look like --name=value")
  mode = _MODE.value
  if mode not in MODES:
    raise UserError(f"--mode must be one of {', '.join(MODES)}; got {mode!r}")
  _check_flags(mode)
  if mode in HF_MODES:
    _run_hf(mode)
    return
  if mode == "sweep_results" or (mode == "plot" and _is_sweep_workdir(_WORKDIR.value)):
    _run_sweep_reading(mode)
    return
  if _WORKDIR.value is not None and (mode in READING_MODES or mode in DESCRIBING_MODES
                                     and _CONFIG.value is None):
    check_trained_workdir(_WORKDIR.value)  # before "--config is required": a typo says so
  if _CONFIG.value is None:
    if flags.FLAGS["config"].present:  # a file was given, and its get_config() returned None
      raise UserError("the experiment's get_config() returned None; return a ConfigDict "
                      "(see experiments/tiny.py)")
    problem = _WORKDIR_PROBLEM.get(_WORKDIR.value)
    if problem is not None:
      raise problem  # the workdir's own problem, not the missing --config
    raise UserError("--config is required, e.g. --config=experiments/scan_simple.py (a mode "
                    "that reads a --workdir holding config.json may leave it out)")
  config = _CONFIG.value
  if not isinstance(config, ml_collections.ConfigDict):
    raise UserError(f"the experiment's get_config() returned {type(config).__name__}, not an "
                    "ml_collections.ConfigDict (see experiments/tiny.py)")
  if mode in WORKDIR_MODES and _WORKDIR.value and not (_SWEEP.value or _SWEEP_DRY_RUN.value):
    from transformer_jax.train import checkpoint
    checkpoint.check_config_file(_WORKDIR.value)  # the checkpoint is the truth
    if mode in READING_MODES:
      _check_workdir_config(config, _WORKDIR.value)

  from transformer_jax.core import hostmem, platforms
  platforms.cpu_only_unless_accelerated()  # before JAX starts a backend
  keep = _KEEP_HOST_MEMORY.value
  try:
    worth = keep == "true" or (keep == "auto" and hostmem.worth_keeping(config, mode))
  except (AttributeError, KeyError, TypeError):  # keys missing: config_lib.validate says which
    worth = keep == "true"
  if worth:
    hostmem.keep_freed_memory()  # before the first JAX computation starts the CPU backend
  if mode in CACHED_MODES and not _SWEEP_DRY_RUN.value:
    _configure_compile_cache()
  from transformer_jax import config as config_lib
  from transformer_jax import model as model_lib

  if mode == "describe":
    print(model_lib.describe(config_lib.validate(config)))
    return
  if mode == "config":
    config_lib.validate(config)  # the config a run would take: a bad value says so here
    print("# the config this command gives a run (--config and its overrides): key = value  "
          "# what it does\n")
    print(config_lib.describe(config))
    return
  if mode == "benchmark":
    from transformer_jax.tools import benchmark
    benchmark.run_benchmark(config)
    return
  if mode == "compile":
    from transformer_jax.tools import compile as compile_lib
    compile_lib.run_compile(config)
    return
  if mode == "export":
    from transformer_jax import data
    config_lib.validate(config)
    data.export_split(config, _SPLIT.value or "train", sys.stdout)
    return
  if _WORKDIR.value is None:
    raise UserError(f"--workdir is required for --mode={mode}")
  from transformer_jax.train import sharding
  if _SWEEP.value or _SWEEP_DRY_RUN.value:
    config_lib.validate(config)
    from transformer_jax import run as run_lib
    from transformer_jax.tools.sweep import store, worker
    options = worker.Options(
        metric=_SWEEP_METRIC.value, sampler=_SWEEP_SAMPLER.value, pruner=_SWEEP_PRUNER.value,
        budget=_SWEEP_BUDGET.value, storage=store.given(_SWEEP_STORAGE.value),
        seed=_SWEEP_SEED.value,
        heartbeat_s=_SWEEP_HEARTBEAT_S.value, outage_s=_SWEEP_OUTAGE_S.value,
        retries=_SWEEP_RETRIES.value,
        parallel=_SWEEP_PARALLEL.value, seeds=_SWEEP_SEEDS.value, only=_sweep_trials(),
        test_best=_SWEEP_TEST_BEST.value, dry_run=_SWEEP_DRY_RUN.value)
    if not _SWEEP_DRY_RUN.value:  # a job of several processes is one worker
      sharding.initialize_distributed(_COORDINATOR.value, _NUM_PROCESSES.value,
                                      _PROCESS_ID.value)
    worker.run_sweep(config_flags.get_config_filename(flags.FLAGS["config"]), _WORKDIR.value,
                     config_flags.get_override_values(flags.FLAGS["config"]),
                     run_lib.train_and_evaluate, options, argv=sys.argv[1:])
    return
  sharding.initialize_distributed(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
  if mode == "train":
    from transformer_jax import run as run_lib
    run_lib.train_and_evaluate(config, _WORKDIR.value)
  elif mode == "plot":
    from transformer_jax.tools import plot
    for path in plot.plot_workdir(config, _WORKDIR.value, text=_TEXT.value,
                                  step=_CHECKPOINT_STEP.value):
      print(path)
  elif mode == "evaluate":
    from transformer_jax.eval import evaluate
    evaluate.evaluate_from_workdir(config, _WORKDIR.value, step=_CHECKPOINT_STEP.value,
                                   split=_SPLIT.value)
  elif mode == "translate":  # stdin lines -> stdout translations, in order
    from transformer_jax.eval import translate
    # Bytes, decoded by translate: a line that is not UTF-8 must not lose its whole batch.
    translate.translate_from_workdir(config, _WORKDIR.value, sys.stdin.buffer, sys.stdout,
                                    step=_CHECKPOINT_STEP.value,
                                    output_format=_OUTPUT_FORMAT.value)
  elif mode == "generate":  # stdin prompts -> stdout continuations, in order
    from transformer_jax.eval import generate
    generate.generate_from_workdir(config, _WORKDIR.value, sys.stdin.buffer, sys.stdout,
                                   step=_CHECKPOINT_STEP.value,
                                   output_format=_OUTPUT_FORMAT.value)


def _is_sweep_workdir(workdir) -> bool:
  if not (workdir or "").strip():
    return False
  from transformer_jax.tools.sweep import store
  return store.is_sweep_workdir(workdir)


def _run_sweep_reading(mode: str) -> None:
  """--mode=sweep_results, and --mode=plot on a sweep's workdir: read its study, train nothing."""
  if not (_WORKDIR.value or "").strip():
    raise UserError(f"--workdir is required for --mode={mode} (the sweep's)")
  from transformer_jax.tools.sweep import results, store
  url = store.given(_SWEEP_STORAGE.value)
  if mode == "plot":
    for path in results.plot(_WORKDIR.value, url):
      print(path)
    return
  metric = _SWEEP_METRIC.value if flags.FLAGS["sweep_metric"].present else None
  print(results.sweep_results(_WORKDIR.value, url, metric), end="")


def _run_hf(mode: str) -> None:
  """--mode=import_hf / export_hf: a workdir from a Hugging Face model directory, or back."""
  for flag in (_HF_DIR, _WORKDIR):
    if not (flag.value or "").strip():
      raise UserError(f"--{flag.name} is required for --mode={mode}")
  from transformer_jax.core import platforms
  platforms.cpu_only_unless_accelerated()
  from transformer_jax.tools import hf
  if mode == "import_hf":
    print(hf.import_hf(_HF_DIR.value, _WORKDIR.value))
  else:
    print(hf.export_hf(_WORKDIR.value, _HF_DIR.value, step=_CHECKPOINT_STEP.value))


def _stdout_file():
  """The file behind stdout, where Linux names it in /proc; else None."""
  try:
    return os.readlink(f"/proc/self/fd/{sys.stdout.fileno()}")
  except (OSError, ValueError):
    return None


def _main(argv) -> None:
  # INFO from JAX and orbax ("no TPU found", every checkpoint file) buries the training log.
  absl_logging.set_verbosity(absl_logging.WARNING)
  logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
  secrets.redact_argv()  # parsed: what trackers and lock files record of it has no password
  try:
    run(argv)
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


def main() -> None:
  """The console script: parses the flags and runs the mode."""
  app.run(_main, flags_parser=_parse_flags)


if __name__ == "__main__":
  main()
