"""Every command in README.md and docs/ is checked, so that a documented command cannot rot.

Each `launch.py` command goes through the real flag parsing, config loading (experiment files,
installed names, a workdir's config.json) and validation, all in one subprocess; the cheap ones
(describe, export, tensorboard) also run. Training runs are exercised by the tests of their
modes. Any other command must be listed in OTHERS with where it is exercised, so that a new
command in the docs fails here until someone decides how it is checked.
"""

import json
import os
import pathlib
import re
import shlex
import signal
import subprocess
import sys

import pytest
from launcher import QUICK_COMPILE, Launcher, environment

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]

# Commands that are not launch.py, by their first words: where each is exercised instead.
OTHERS = {
    "make demo": "CI's own set-up; test_train trains and evaluates the same way",
    "make test": "CI runs it",
    "git clone": "the fresh-clone timing of docs/benchmarks.md (make demo)",
    "rm -rf runs/scan_simple": "the same (make demo from scratch)",
    ".venv/bin/pip install": "pip itself",
    "JAX_PLATFORMS=cpu .venv/bin/python -c": "test_benchmark (the same library calls)",
    "bash benchmarks/gpu.sh": "test_gpu_suite runs gpu.sh --dry_run",
    "deps=$(python3 -c": "the GPU machine's offline wheel download (registry access)",
    "print(c['options']": "the same (the second line of its python3 -c)",
    "python3 -m pip download": "the same",
    "setsid nohup bash benchmarks/gpu.sh": "the same GPU run, detached",
    "sleep": "waiting on the GPU machine",
    "setsid nohup bash -c 'bash benchmarks/gpu.sh": "the same GPU run, detached, with a mark at "
                                                   "its end",
    "for i in $(seq": "waiting on the GPU machine for that mark, then taking the results",
    ".venv/bin/python -m benchmarks.compile_table": "test_compile (its --mode=compile rows)",
    ".venv/bin/python -m benchmarks.top_fusions": "test_top_fusions (its kernel accounting)",
    # Timings of the input path (minutes on a 1.3 GB corpus); the code they time is tested.
    ".venv/bin/python -m benchmarks.synthetic_wmt": "writes the timing corpus, never committed",
    ".venv/bin/python -m benchmarks.second_start": "test_cache (a second start from the cache)",
    ".venv/bin/python -m benchmarks.input_share": "test_benchmark (benchmark.input's path)",
    # Timings of a workdir in a bucket (the GCS emulator); the code they time is tested.
    ".venv/bin/python -m benchmarks.bucket_checkpoint": "test_bucket_workdir (its checkpoints)",
    ".venv/bin/python -m benchmarks.bucket_logging": "test_bucket_workdir (its metrics)",
    # Minutes of waiting on a store that is down; test_bucket_outage rides out short outages.
    ".venv/bin/python -m benchmarks.storage_outage": "test_bucket_outage (the same runs, short)",
    "printf ": "writes the input of the next command (a launch.py command, checked)",
    ".venv/bin/python -m transformer_jax.tools.profile": "test_profile (the same command)",
    "cd \"$SLURM_SUBMIT_DIR\"": "a SLURM job script (its launch.py line is checked)",
    "sbatch": "SLURM",
    "gcloud": "Cloud TPU (its launch.py lines are checked)",
    "make install && .venv/bin/pip install -e": "the Cloud TPU set-up (inside gcloud ... ssh)",
    "hf download": "the hub's own tool, on a machine with network; test_hf imports what "
                   "transformers' save_pretrained writes",
    ".venv/bin/python -m benchmarks.hf_finetune": "test_hf (import, train further, export)",
    "JAX_PLATFORMS=cpu .venv/bin/python -m benchmarks.ct2_decode": "test_hf_llama (the Llama "
    "export that CTranslate2 converts and decodes as ours)",
    ".venv/bin/python -m benchmarks.marian_scan": "test_hf_marian (a sample of the same check)",
    ".venv/bin/python -m benchmarks.analysis.scan_structure": "test_scan runs it and checks its "
    "table",
    ".venv/bin/python -m pytest -q -s tests/hf/test_hf_scores.py": "the test itself (its printed "
    "figures)",
    ".venv/bin/wandb sync": "W&B's own upload (needs its service); test_trackers reads the "
                            "offline run files with W&B's own reader",
    ".venv/bin/mlflow ui": "MLflow's own UI; test_trackers reads the runs through its server",
    ".venv/bin/python -m benchmarks.trackers": "test_trackers (the same trackers, shorter runs)",
    ".venv/bin/optuna-dashboard": "Optuna's viewer of the study test_sweep_postgres fills",
    "export TRANSFORMER_JAX_SWEEP_STORAGE=": "test_sweep_postgres reads its study by this "
                                             "variable, the password from PGPASSWORD",
    "kubectl": "GKE (its launch.py lines are checked)",
    "sudo -u postgres psql": "tests/postgres.py makes the sweep tests' user and database so",
    "for vm in": "gcloud in a loop (its launch.py lines are checked)",
    "nice -n 19 .venv/bin/python -m benchmarks.sweep_search": "test_sweep (the same sweeps, "
    "smaller)",
    ".venv/bin/python -m benchmarks.analysis.scan_cutoff_table": "test_scan runs it on runs it "
    "writes",
    "git worktree add": "a second checkout of an earlier commit, for a side-by-side timing",
    ".venv/bin/python -m benchmarks.compile_once": "test_compile_once and test_sweep (the same "
    "start-ups, from JAX's own events)",
    'S="tests/': "the suite's own files (a shell variable for the two lines below)",
    "time .venv/bin/python -m pytest": "the suite itself, timed",
    "time TRANSFORMER_JAX_TEST_COMPILE_CACHE=off": "the suite itself, timed without the cache",
    ".venv/bin/python -m pytest -q -n 2 --dist loadfile tests": "the suite itself (make test's)",
    "make quick": "the suite itself, without the files marked slow",
}


# Placeholders the docs ask the reader to fill in, with a value each.
PLACEHOLDERS = {"trial_00N": "trial_001", "BEST_DEV_STEP": "100", " TRIAL_OVERRIDES": ""}


def commands():
  """(file, command) for every line of the ```sh blocks, continuations joined, comments out."""
  found = []
  for name in DOCS:
    language, pending = None, ""
    for line in (ROOT / name).read_text().splitlines():
      if line.startswith("```"):
        language = line[3:].strip() if language is None else None
        continue
      if language != "sh":
        continue
      line = pending + line.split("  #")[0].rstrip()
      if line.endswith("\\"):
        pending = line[:-1] + " "
        continue
      pending = ""
      for placeholder, value in PLACEHOLDERS.items():
        line = line.replace(placeholder, value)
      if line.strip() and not line.strip().startswith("#"):
        found.append((name, line.strip()))
  return found


# In one process (a forked child per command): each command's flags through the command line's
# own parser and the config's validation, without running the mode.
CHECK = r"""
import json, os, shlex, sys
from absl import flags
from transformer_jax import cli
from transformer_jax import config as config_lib
results = []
for line in json.loads(sys.argv[1]):
  read, write = os.pipe()
  if os.fork() == 0:  # absl's flags parse once per process: a forked child per command
    os.close(read)
    argv = ["launch.py"] + shlex.split(line)[1:]
    sys.argv[:] = argv
    os.dup2(write, 1)
    try:
      cli._parse_flags(argv)
      mode = cli._MODE.value
      assert mode in cli.MODES, mode
      cli._check_flags(mode)
      if not cli.MODES[mode].config:  # a sweep's study (test_sweep), a Hugging Face directory
        assert cli._WORKDIR.value, "--workdir is required"  # in or out (test_hf)
        assert cli._HF_DIR.value or "hf_dir" not in cli.MODES[mode].flags, "--hf_dir is required"
        result = [line, "ok", mode, [None, None]]
      else:
        if cli._CONFIG.value is None:
          raise SystemExit("no config")
        config_lib.validate(cli._CONFIG.value)
        config = cli._CONFIG.value
        result = [line, "ok", mode, [config.model.d_model, config.data.source]]
    except BaseException as e:
      result = [line, f"{type(e).__name__}: {e}", None, None]
    os.write(write, json.dumps(result).encode())
    os._exit(0)
  os.close(write)
  with os.fdopen(read, "rb") as f:
    results.append(json.loads(f.read() or b'["", "no answer", null, null]'))
  os.wait()
print(json.dumps(results))
"""


def launch_command(line: str):
  """The `launch.py ...` part of a documented line (inside sbatch --wrap '...', gcloud
  --command='...', a pipe or a redirection); None if the line runs no launch.py."""
  line = line.replace("transformer-jax ", "python launch.py ", 1)  # the console script
  words = line.split("launch.py", 1)
  if len(words) == 2 and ("python" in words[0] or "srun" in words[0]):
    return line[line.index("launch.py"):].split(" | ")[0].split(" > ")[0].rstrip("'")
  return None


@pytest.fixture(scope="module")
def newcomer(tmp_path_factory):
  """launch.py as a newcomer runs it: without JAX_PLATFORMS, with the session's compilation
  cache (make demo's training and the README's are the same program, compiled with LLVM's
  optimisations off: nothing here is timed or compared with a reference). Each command runs as
  `python launch.py ...` does, in a process forked from one that has imported the library once
  (launcher.py), MLflow's client too (two of the README's runs log to MLflow); what that import
  prints on stderr is in `newcomer.server_stderr`."""
  directory = tmp_path_factory.mktemp("newcomer")
  env = {k: v for k, v in dict(environment(), XLA_FLAGS=QUICK_COMPILE).items()
         if k != "JAX_PLATFORMS"}
  from transformer_jax.train import trackers
  launcher = Launcher(env, str(directory), server_stderr=directory / "server.err",
                      preload=[*trackers.RUNS["mlflow"][1], f"{trackers.__name__}.mlflow"])
  yield launcher
  launcher.close()


def test_every_documented_command(tmp_path, newcomer):
  launches, others = [], []
  for name, line in commands():
    launch = launch_command(line)
    if launch:
      launches.append(launch)
    else:
      others.append((name, line.replace("transformer-jax ", "python launch.py ", 1)))
  unclassified = [(n, c) for n, c in others
                  if not any(c.startswith(prefix) for prefix in OTHERS)
                  and not c.startswith(".venv/bin/tensorboard")]
  assert not unclassified, f"documented commands no test checks: {unclassified}"
  assert len(launches) >= 15, launches

  # The workdirs the docs name, as training leaves them: a config.json (scan_simple's).
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  cwd = tmp_path / "checkout"
  cwd.mkdir()
  for entry in ("launch.py", "experiments"):
    (cwd / entry).symlink_to(ROOT / entry)
  from transformer_jax.experiments import scan_simple
  for workdir in {m for line in launches for m in re.findall(r"--workdir=(runs/[\w/]+)", line)}:
    (cwd / workdir).mkdir(parents=True, exist_ok=True)
    (cwd / workdir / "config.json").write_text(scan_simple.get_config().to_json_best_effort())
  checked = json.loads(subprocess.run(
      [sys.executable, "-c", CHECK, json.dumps(launches)], cwd=cwd, env=env,
      capture_output=True, text=True, check=True).stdout)
  failed = [(line, status) for line, status, _, _ in checked if status != "ok"]
  assert not failed, failed
  modes = {line: mode for line, _, mode, _ in checked}
  assert {"train", "evaluate", "describe", "export", "plot"} <= set(modes.values())
  seen = {line: tuple(d) for line, _, _, d in checked}
  assert seen[next(x for x in launches if "norm=pre" in x)][0] == 256  # overrides applied

  # One of each cheap kind runs (describe; export | head of SCAN: other data sets are
  # downloads), and the README's tensorboard command; the parsing above covers the rest.
  # They run as a newcomer runs them: without JAX_PLATFORMS, in the venv `make test` builds
  # (the CUDA plugin installed, no GPU): nothing on stderr (no plugin's traceback).
  run = [next(x for x in launches if modes[x] == "describe"),
         next(x for x in launches if modes[x] == "export" and seen[x][1] == "scan")]
  for line in run:
    words = line.split()
    assert words[0] == "launch.py", line
    code, out, err = newcomer.run(*words[1:])
    assert code == 0, (line, err[-2000:])
    assert out.strip(), line
    assert err == "", (line, err[-2000:])
  assert pathlib.Path(newcomer.server_stderr).read_text() == ""  # nor while importing
  tensorboard = next(c for _, c in others if c.startswith(".venv/bin/tensorboard"))
  logdir = tmp_path / "tb"
  from transformer_jax.train import logger
  logger.write_hparams(str(logdir), {"model.d_ff": 32}, {"loss": 1.5}, 1)
  binary = pathlib.Path(sys.executable).parent / "tensorboard"
  args = tensorboard.split()[1:]
  args[args.index("--logdir") + 1] = str(logdir / "tensorboard")
  result = subprocess.run([str(binary), "--inspect", *args], capture_output=True, text=True,
                          timeout=120)
  assert result.returncode == 0 and "final/loss" in result.stdout, result.stdout + result.stderr


def test_every_sweep_recipe_of_the_cloud_doc_runs_as_written(tmp_path):
  # Its recipes once named experiments that declare no sweep (exit 2 as written). Each runs
  # through the real launch.py with --sweep_dry_run; a bucket workdir becomes a local one (the
  # buckets themselves: test_bucket_workdir), the database is not reached by a dry run.
  text = (ROOT / "docs" / "cloud.md").read_text()
  sweeps = [c for name, line in commands() if name == "docs/cloud.md"
            for c in [launch_command(line)] if c and " --sweep " in f"{c} "]
  for listed in re.findall(r"command: (\[[^\]]*launch\.py[^\]]*\])", text):  # GKE's YAML
    words = json.loads(" ".join(listed.split()))
    sweeps.append(shlex.join(words[words.index("launch.py"):]))
  assert len(sweeps) >= 4, sweeps  # SLURM, TPU VMs, a multi-host slice, GKE
  # Each as `python launch.py ...` runs, forked from one process that imported the library once
  # (launcher.py); what that import prints on stderr is checked too.
  launcher = Launcher(environment(), str(tmp_path), server_stderr=tmp_path / "server.err")
  try:
    for i, line in enumerate(sweeps):
      args = [re.sub(r"^--workdir=\S+", f"--workdir={tmp_path / str(i)}", a)
              for a in shlex.split(line)[1:]]
      code, out, err = launcher.run(*args, "--sweep_dry_run")
      assert code == 0 and err == "", (line, err[-2000:])
      assert "search space:" in out and "pruner: " in out, out
      assert not (tmp_path / str(i)).exists()  # a dry run writes nothing
  finally:
    launcher.close()
  assert (tmp_path / "server.err").read_text() == ""


# Appended to the README's SCAN walkthrough so that it runs in seconds: a one-layer model, two
# steps, a few evaluation examples. Modes that read the workdir get the same model keys, which
# agree with its config.json.
TINY = ["--config.model.d_model=32", "--config.model.d_ff=64", "--config.model.num_heads=2",
        "--config.model.num_encoder_layers=1", "--config.model.num_decoder_layers=1",
        "--config.train.steps=2", "--config.train.log_every=1", "--config.train.checkpoint_every=2",
        "--config.eval.max_examples=8"]


def test_the_readme_walkthrough_runs_end_to_end_with_tiny_overrides(tmp_path, newcomer):
  """The README's SCAN commands run in its order (make demo's own command first), each on the
  workdirs the earlier ones left, from a directory that holds only launch.py and experiments/.
  (The installed `transformer-jax` command trains by path and works by name in test_install.)"""
  demo = subprocess.run(["make", "-s", "-n", "demo", "PY=.venv/bin/python"], cwd=ROOT,
                        capture_output=True, text=True, check=True).stdout.splitlines()[-1]
  readme = [line for name, line in commands() if name == "README.md"]
  walk = [demo] + [line for line in readme if "launch.py" in line and "runs/scan" in line]
  assert len(walk) >= 4 and {"--mode=plot", "--mode=evaluate"} <= {
      w for line in walk for w in line.split()}, walk
  checkout = tmp_path / "checkout"
  checkout.mkdir()
  for entry in ("launch.py", "experiments"):
    (checkout / entry).symlink_to(ROOT / entry)
  # Without JAX_PLATFORMS, as a newcomer runs them (see test_every_documented_command).
  launcher = newcomer
  for line in walk:
    words = shlex.split(line.split(" | ")[0])
    assert words[0].endswith("python") and words[1] == "launch.py", line
    launcher.start(*words[2:], *TINY, cwd=checkout)
    try:
      launcher.wait_for(lambda _: False, timeout=300)  # until it ends
    except TimeoutError:
      launcher.send(signal.SIGKILL)
      raise
    code, (out, err) = launcher.wait(), launcher.output()
    assert code == 0, (line, out[-1500:], err[-1500:])
    assert "Traceback" not in err and "cuDNN" not in err, (line, err[-3000:])
  scan = checkout / "runs" / "scan"
  assert list((scan / "eval").glob("2.test.greedy.limit8.json")), list((scan / "eval").iterdir())
  plots = {p.name for p in (checkout / "runs" / "scan_simple" / "plots").iterdir()}
  assert {"curves.png", "cross_attention.png"} <= plots, plots
