"""Sweeps whose study is in a real PostgreSQL server (tests/postgres.py starts one for this
file): several workers share it, a killed worker's trial comes back and resumes from its own
checkpoint, and what a worker cannot use is one line and exit code 2. The workers and other
launch.py runs are forked by three launchers (tests/launcher.py) that import the library once
for the whole file; each run is a real process of its own."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import optuna
import postgres
import pytest
from launcher import Launcher, environment
from test_trackers import mlflow_server  # noqa: F401 - the real MLflow server, a fixture

from transformer_jax.core.errors import UserError
from transformer_jax.eval import load
from transformer_jax.tools.sweep import space, store, worker

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Twelve trials of the same compiled programs: the shuffle buffer changes the batches' order,
# train.log_every nothing that is compiled (tiny's d_ff would be a new program; a learning rate
# would not: it is an input of the compiled step).
TWELVE = """from transformer_jax.experiments import tiny
from transformer_jax.tools import sweep

get_config = tiny.get_config


def get_sweep():
  return sweep.grid(**{"data.shuffle_buffer": [0, 4, 8, 16], "train.log_every": [1, 2, 3]})
"""
FAST = ["--config.train.steps=2", "--config.train.checkpoint_every=2",
        "--config.eval.max_examples=8"]


@pytest.fixture(scope="module")
def db():
  server = postgres.start()
  yield server
  postgres.stop(server)


# What a worker of a study in PostgreSQL imports beyond the launcher's own: Optuna's database
# storage (SQLAlchemy, its ORM and PostgreSQL dialect, Alembic's version check) and the driver,
# half a second each run otherwise.
DATABASE_MODULES = ["sqlalchemy", "sqlalchemy.orm", "sqlalchemy.dialects.postgresql", "psycopg",
                    "alembic.context", "alembic.op", "alembic.command"]


@pytest.fixture(scope="module")
def launchers(tmp_path_factory):
  """Three launchers: up to three launch.py runs at once (a launcher runs one at a time)."""
  started = [Launcher(environment(), str(tmp_path_factory.mktemp(f"launches{i}")),
                      preload=DATABASE_MODULES) for i in range(3)]
  yield started
  for launcher in started:
    launcher.close()


def _worker(launcher, experiment, workdir, url, *extra) -> Launcher:
  """Starts a worker of the study at `url` on `launcher`; _ended(launcher) waits for it."""
  launcher.start(f"--config={experiment}", f"--workdir={workdir}", "--sweep",
                 f"--sweep_storage={url}", *extra)
  return launcher


def _ended(launcher) -> tuple:
  """(exit code, stdout and stderr) of the run started on `launcher`, once it has ended."""
  code = launcher.wait()
  out, err = launcher.output()
  return code, out + err


def _until_evaluated(launcher, trial) -> None:
  """Waits until the run on `launcher` has logged an evaluation of the trial directory `trial`
  (its train step and its evaluation's programs compiled), or has ended."""
  metrics, deadline = trial / "metrics.jsonl", time.time() + 300
  while time.time() < deadline and launcher.running():
    if metrics.exists() and '"split": "eval"' in metrics.read_text():
      return
    time.sleep(0.05)


def _study(url, workdir):
  optuna.logging.set_verbosity(optuna.logging.ERROR)
  return optuna.load_study(study_name=str(workdir), storage=url)


def test_three_workers_share_a_twelve_trial_study_each_trial_once(tmp_path, db, launchers):
  experiment = tmp_path / "twelve.py"
  experiment.write_text(TWELVE)
  workdir = tmp_path / "sweep"
  # The second and third worker start once the first has evaluated trial_0000: its programs
  # are compiled then, and in the session's compilation cache, which they read instead of
  # compiling the same programs at the same time (the file's first sweep: the cache is cold).
  workers = [_worker(launchers[0], experiment, workdir, db.url, *FAST)]
  _until_evaluated(workers[0], workdir / "trial_0000")
  workers += [_worker(launcher, experiment, workdir, db.url, *FAST) for launcher in launchers[1:]]
  codes, outputs = zip(*map(_ended, workers))
  assert list(codes) == [0, 0, 0], outputs
  study = _study(db.url, workdir)
  trials = study.get_trials()
  # Workers that ask at once for the last waiting trial: the ones that find the queue empty
  # record a surplus trial each (FAIL, no overrides, in no table) and stop.
  surplus = [t for t in trials if t.user_attrs.get("sweep_surplus")]
  assert all(t.state.name == "FAIL" and "sweep_overrides" not in t.user_attrs for t in surplus)
  trials = [t for t in trials if not t.user_attrs.get("sweep_surplus")]
  assert len(trials) == 12
  assert all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)
  assert sorted(t.user_attrs["sweep_key"] for t in trials) == sorted(map(str, range(12)))
  started = [line.split()[0] for out in outputs for line in out.splitlines()
             if " started" in line]
  assert sorted(started) == [f"trial_{i:04d}" for i in range(12)]  # each once, by one worker
  assert all("sweep: study " in out for out in outputs), outputs  # all three joined
  for i in range(12):  # each trained once: its log lines (train.log_every) written once
    with open(workdir / f"trial_{i:04d}" / "metrics.jsonl", encoding="utf-8") as f:
      steps = [r["step"] for r in map(json.loads, f) if r["split"] == "train"]
    assert steps == [1, 2] if i % 3 == 0 else steps == [2], (i, steps)
  table = (workdir / "results.md").read_text()
  assert table.count("| finished |") == 12
  # --mode=sweep_results rebuilds the same table from the study alone.
  os.remove(workdir / "results.md")
  code, out, err = launchers[0].run("--mode=sweep_results", f"--workdir={workdir}",
                                    f"--sweep_storage={db.url}")
  assert code == 0, err
  assert (workdir / "results.md").read_text() == table and table in out
  assert "best trial: " + str(workdir / "trial_") in out


RATES = """from transformer_jax.experiments import tiny
from transformer_jax.tools import sweep

get_config = tiny.get_config


def get_search_space():
  return {"train.learning_rate": sweep.log_uniform(1e-4, 1e-2)}
"""


def test_parallel_workers_never_draw_the_same_trial(tmp_path, db, launchers):
  # Each worker once sampled with sweep.sampler_seed itself: three workers drew the same rates.
  experiment = tmp_path / "rates.py"
  experiment.write_text(RATES)
  workdir = tmp_path / "sweep"
  code, stdout, stderr = launchers[0].run(
      f"--config={experiment}", f"--workdir={workdir}", "--sweep", f"--sweep_storage={db.url}",
      "--sweep_parallel=3", "--config.sweep.budget=24", *FAST)
  assert code == 0, stdout + stderr
  trials = [t for t in _study(db.url, workdir).get_trials()
            if not t.user_attrs.get("sweep_surplus")]
  rates = [t.params["train.learning_rate"] for t in trials]
  assert len(rates) == 24 and len(set(rates)) == 24, sorted(rates)
  # Three processes share the one stdout: a line of one may run into another's.
  seeds = re.findall(r"samples with seed (\d+)", stdout)
  assert len(seeds) == 3 and len(set(seeds)) == 3, stdout  # said, one each


ONE = """from transformer_jax.experiments import tiny

get_config = tiny.get_config


def get_sweep():
  return [{"data.shuffle_buffer": 16}]
"""
# Long enough to be stopped in the middle: evaluations every 10 steps, a checkpoint after each.
KILLED = ["--config.train.steps=40", "--config.train.checkpoint_every=10",
          "--config.train.eval_every=10", "--config.train.log_every=1",
          "--config.eval.max_examples=8", "--config.model.qkv_bias=False",
          "--sweep_heartbeat_s=1", "--config.sweep.retries=1"]


def _params(workdir):
  config = space.trial_config(str(workdir.parent.parent / "one.py"), {},
                              {"model.qkv_bias": False, "data.shuffle_buffer": 16,
                               "train.steps": 40})
  return jax.tree.leaves(jax.device_get(load.load_trained(config, str(workdir)).params))


def test_a_killed_workers_trial_is_requeued_and_resumes_from_its_checkpoint(tmp_path, db,
                                                                             launchers):
  experiment = tmp_path / "one.py"
  experiment.write_text(ONE)
  killed_dir = tmp_path / "killed"
  first = _worker(launchers[1], experiment, killed_dir, db.url, *KILLED)
  checkpoints = killed_dir / "trial_0000" / "checkpoints"
  deadline = time.time() + 300
  while not (checkpoints / "10").exists() and time.time() < deadline and first.running():
    time.sleep(0.02)
  first.send(signal.SIGSTOP)  # frozen where it is, then killed: a lost VM
  first.send(signal.SIGKILL)
  code, out = _ended(first)
  assert code == -signal.SIGKILL, out
  saved = sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit())
  assert saved and saved[-1] < 40, saved  # killed mid-trial
  # The uninterrupted run to compare with, beside the resumed one: both read the programs that
  # the killed run compiled (this model's own: model.qkv_bias) from the session's cache.
  reference = _worker(launchers[0], experiment, tmp_path / "reference", db.url, *KILLED)
  code, out = _ended(_worker(launchers[1], experiment, killed_dir, db.url, *KILLED))
  reference_code, reference_out = _ended(reference)
  assert reference_code == 0, reference_out
  assert code == 0, out
  assert "trial_0000 started (again, after trial 0)" in out, out
  assert "already reported" not in out, out  # the lost attempt's evaluations: not again
  study = _study(db.url, killed_dir)
  lost, again = study.get_trials()
  assert lost.state == optuna.trial.TrialState.FAIL and "sweep_error" not in lost.user_attrs
  assert again.state == optuna.trial.TrialState.COMPLETE
  assert again.system_attrs["failed_trial"] == 0
  log = (killed_dir / "trial_0000" / "train.log").read_text()
  assert "resuming from step" in log
  with open(killed_dir / "trial_0000" / "metrics.jsonl", encoding="utf-8") as f:
    steps = [r["step"] for r in map(json.loads, f) if r["split"] == "train"]
  resumed = int(log.split("resuming from step ")[1].split()[0])
  assert resumed in saved and sorted(set(steps)) == list(range(1, 41)) and steps[-1] == 40
  assert all(steps.count(s) == 1 for s in range(1, resumed + 1))  # not trained again
  assert "| trial_0000 | finished |" in (killed_dir / "results.md").read_text()
  table = (killed_dir / "results.csv").read_text().splitlines()
  assert table[1].split(",")[table[0].split(",").index("retries")] == "1"
  for a, b in zip(_params(tmp_path / "reference" / "trial_0000"),
                  _params(killed_dir / "trial_0000"), strict=True):
    np.testing.assert_array_equal(a, b)


# ------------------------------------------------------------------ what a worker refuses


def _one_error(launcher, command, env=None):
  code, _, err = launcher.run(*command, env=env)
  lines = err.strip().splitlines()
  assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err[-3000:]
  return lines[0]


def test_a_database_that_cannot_be_used_is_one_line_and_nothing_is_written(tmp_path, db,
                                                                            launchers):
  workdir = tmp_path / "sweep"
  base = ["--config=experiments/tiny.py", f"--workdir={workdir}", "--sweep"]
  silent = postgres._free_port()
  line = _one_error(launchers[0],
                    base + [f"--sweep_storage=postgresql+psycopg://a:b@127.0.0.1:{silent}/x"],
                    {store.WAIT_ENV: "2"})
  assert f"no database answered at 127.0.0.1:{silent} within 2 s" in line and ":b@" not in line
  wrong = db.url.replace(postgres.PASSWORD, "wrong")
  line = _one_error(launchers[0], base + [f"--sweep_storage={wrong}"])
  assert "refused this worker" in line and "password" in line and "wrong" not in line
  assert not workdir.exists()


def test_a_study_of_another_sweep_is_refused(tmp_path, db):
  experiment = tmp_path / "twelve.py"
  experiment.write_text(TWELVE)
  options = worker.Options(storage=db.url)
  p = worker.plan(str(experiment), {}, options)
  st = store.open_storage(db.url, str(tmp_path), 60, 0)
  worker.join_study(p, str(tmp_path / "w"), st)
  other = worker.plan(str(experiment), {"train.steps": 3}, options)
  with pytest.raises(UserError, match="belongs to another sweep"):
    worker.join_study(other, str(tmp_path / "w"), st)
  assert len(_study(db.url, tmp_path / "w").get_trials()) == 12  # enqueued once


# ------------------------------------------------------------------ secrets


# A password (and token) that must be found nowhere: 40 letters and digits (W&B's key length).
SENTINEL = "Sentinel7Pw" + "q4x9" * 7 + "z"
TWO = """from transformer_jax.experiments import tiny

get_config = tiny.get_config


def get_sweep():
  return [{"data.shuffle_buffer": 8}, {"data.shuffle_buffer": 16}]
"""


def _descendants(pid: int) -> list:
  """The pids of a process's children, theirs, and so on (Linux /proc)."""
  found, queue = [], [pid]
  while queue:
    parent = queue.pop()
    try:
      with open(f"/proc/{parent}/task/{parent}/children", encoding="utf-8") as f:
        children = [int(c) for c in f.read().split()]
    except OSError:
      continue
    found += children
    queue += children
  return found


def _files_holding(root, secret: str) -> list:
  return [os.path.join(d, name) for d, _, names in os.walk(root) for name in names
          if not os.path.islink(os.path.join(d, name))
          and secret.encode() in open(os.path.join(d, name), "rb").read()]


def test_a_database_password_and_tracker_secrets_reach_no_file_log_tracker_or_ps(
    tmp_path, db, mlflow_server, launchers):  # noqa: F811 - the fixture imported above
  """A sweep of two worker processes whose study's password is on the command line, with every
  tracker (TensorBoard, W&B offline, the real MLflow server, its URI and W&B's key holding the
  same secret in the environment): the secret is in no file the run, W&B, MLflow or anything
  under TMPDIR and HOME wrote, in no output line, MLflow param or tag, Optuna attribute, nor on
  a worker's command line. The study is then read without a password on the command line:
  the whole URL in TRANSFORMER_JAX_SWEEP_STORAGE, or the password in PGPASSWORD."""
  url = postgres.add_user(db, "secretive", SENTINEL)
  experiment = tmp_path / "two.py"
  experiment.write_text(TWO)
  run_dir = tmp_path / "run"  # everything the sweep writes locally: workdir, HOME, TMPDIR
  workdir, home, temp = run_dir / "sweep", run_dir / "home", run_dir / "tmp"
  home.mkdir(parents=True)
  temp.mkdir()
  env = dict(environment(), HOME=str(home), TMPDIR=str(temp), WANDB_API_KEY=SENTINEL,
             MLFLOW_TRACKING_URI=mlflow_server.replace("//", f"//tracker:{SENTINEL}@"),
             MLFLOW_EXPERIMENT_NAME="secrets", TRANSFORMER_JAX_CACHE=str(run_dir / "cache"))
  command = [sys.executable, "launch.py", f"--config={experiment}", f"--workdir={workdir}",
             "--sweep", "--sweep_parallel=2", f"--sweep_storage={url}", *FAST,
             "--config.eval.batch_size=8", "--config.train.trackers=tensorboard,wandb,mlflow",
             "--config.wandb.mode=offline"]
  sweep = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
  # The sweep's own command line, as the user typed it (password included): a process that it
  # forks (a worker, any program it runs) shows that one until it execs its own, and seen in
  # that instant it is no line of the forked program's (it once failed this test).
  typed = " ".join(command)
  command_lines, workers = {}, set()
  while sweep.poll() is None:  # what `ps` shows every user of the machine
    try:  # the workers are the sweep's own children (a worker's forks share its command line)
      with open(f"/proc/{sweep.pid}/task/{sweep.pid}/children", encoding="utf-8") as f:
        workers.update(int(c) for c in f.read().split())
    except OSError:
      pass
    for pid in _descendants(sweep.pid):
      try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
          line = f.read().replace(b"\0", b" ").decode()
      except OSError:
        continue
      if line.strip() != typed:
        command_lines[pid] = line or command_lines.get(pid, "")  # empty: it has ended
    time.sleep(0.05)
  out, err = sweep.communicate(timeout=600)
  assert sweep.returncode == 0, out + err
  assert len([pid for pid in workers if "--sweep_parallel=1" in command_lines.get(pid, "")]) == 2, \
      command_lines
  assert not [c for c in command_lines.values() if SENTINEL in c], command_lines
  assert SENTINEL not in out + err and "secretive:***@" in out, out + err
  # What was written: enough of it that the search means something.
  assert len({p.parent.parent.parent for p in workdir.glob("trial_*/wandb/*/run-*.wandb")}) == 2
  assert len({p.parent.parent for p in workdir.glob("trial_*/tensorboard/events.*")}) == 2
  assert _files_holding(run_dir, SENTINEL) == []
  assert _files_holding(mlflow_server.directory, SENTINEL) == []
  from mlflow.tracking import MlflowClient
  client = MlflowClient(mlflow_server)
  runs = client.search_runs([client.get_experiment_by_name("secrets").experiment_id])
  assert len(runs) == 3  # the study's parent run and the two trials' runs
  for run in runs:
    shown = json.dumps([run.data.params, run.data.tags, list(run.data.metrics)])
    assert SENTINEL not in shown and ("trial_state" in shown or "best/trial" in shown), shown
  study = _study(url, workdir)  # what optuna-dashboard shows
  rdb = optuna.storages.RDBStorage(url)
  attrs = [study.user_attrs, rdb.get_study_system_attrs(rdb.get_study_id_from_name(str(workdir)))]
  attrs += [[t.user_attrs, t.system_attrs, t.params] for t in study.get_trials()]
  assert SENTINEL not in json.dumps(attrs, default=str)
  assert [t.state.name for t in study.get_trials()] == ["COMPLETE", "COMPLETE"]

  # Without the password on the command line: the URL in the environment, or PGPASSWORD.
  for flags, more in (([], {store.STORAGE_ENV: url}),
                      ([f"--sweep_storage={url.replace(':' + SENTINEL, '')}"],
                       {"PGPASSWORD": SENTINEL})):
    code, out, err = launchers[0].run("--mode=sweep_results", f"--workdir={workdir}", *flags,
                                      env=more)
    assert code == 0 and out.count("| finished |") == 2, err
    assert SENTINEL not in out + err


# ------------------------------------------------------------------ the database goes away


def test_workers_ride_out_the_database_stopped_mid_trial(tmp_path, db, launchers):
  # Once: every worker ended with exit code 1 and hundreds of lines of traceback (Optuna's
  # UnboundLocalError 'updated_state' last) when the database went away for a few seconds.
  experiment = tmp_path / "two.py"
  experiment.write_text(TWO)
  workdir = tmp_path / "sweep"
  slow = ["--config.train.steps=30", "--config.train.checkpoint_every=10",
          "--config.train.eval_every=5", "--config.eval.max_examples=8",
          "--sweep_heartbeat_s=2"]  # lost after 6 s without heartbeats: shorter than the stop
  # Two train a trial each; the third waits, judging the running trials' heartbeats.
  workers = [_worker(launcher, experiment, workdir, db.url, *slow) for launcher in launchers]
  checkpoints = workdir / "trial_0000" / "checkpoints"
  deadline = time.time() + 300
  while not (checkpoints / "10").exists() and time.time() < deadline:
    time.sleep(0.05)
  postgres.pg_ctl(db, "stop", "-m", "fast")  # connections cut, nothing answers
  time.sleep(10)  # training reaches its next evaluations, heartbeats and polls fail
  postgres.pg_ctl(db, "start")
  codes, outputs = zip(*map(_ended, workers))
  assert list(codes) == [0, 0, 0], outputs
  said = "\n".join(outputs)
  assert "Traceback" not in said, said
  assert said.count("is unreachable") >= 1 and said.count("is back after") >= 1, said
  for out in outputs:  # one line each way, per worker that saw it
    assert out.count("is unreachable") == out.count("is back after") <= 1, out
  study = _study(db.url, workdir)
  # Not failed as stale when it came back: no worker's heartbeats reached it meanwhile. (A
  # worker that asks once the queue is empty records a surplus trial, in no table.)
  trials = [t for t in study.get_trials() if not t.user_attrs.get("sweep_surplus")]
  assert [t.state.name for t in trials] == ["COMPLETE", "COMPLETE"], said
  with open(workdir / "trial_0000" / "metrics.jsonl", encoding="utf-8") as f:
    steps = [r["step"] for r in map(json.loads, f) if r["split"] == "eval"]
  assert steps == sorted(set(steps)) and steps[-1] == 30, steps  # trained once, to the end


def test_past_the_outage_bound_a_worker_stops_in_one_line_naming_the_checkpoint(
    tmp_path, db, capfd):
  st = store.open_storage(db.url, str(tmp_path), 60, 0)
  patient = store.ride_out(st.storage, st.url, 2, grace_s=180)
  optuna.create_study(study_name="outage", storage=patient)
  directory = tmp_path / "trial_0003"
  (directory / "checkpoints" / "20").mkdir(parents=True)
  postgres.pg_ctl(db, "stop", "-m", "fast")
  try:
    start = time.time()
    with pytest.raises(store.DatabaseLost):
      patient.get_all_studies()
    assert 2 <= time.time() - start < 10
    with pytest.raises(store.DatabaseLost):  # from then on at once
      patient.get_study_id_from_name("outage")
    patient.record_heartbeat(1)  # the heartbeat thread's call never raises
  finally:
    postgres.pg_ctl(db, "start")
  err = capfd.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "is unreachable" in err[0] and "waiting up to 2 s" in err[0], err
  assert postgres.PASSWORD not in err[0]
  line = str(worker._lost(patient.outage, {"directory": str(directory)}))
  assert str(directory / "checkpoints" / "20") in line and "did not answer for 2 s" in line
  assert postgres.PASSWORD not in line


def test_a_check_for_stale_trials_that_waited_out_an_outage_finds_none(tmp_path, db, capfd):
  """Asked while the database is away, the check is answered once it is back, when the running
  trial's last heartbeat is older than the grace period: no heartbeat could reach the database
  meanwhile, so it finds no stale trial. (Once a waiting worker failed the two running trials of
  the test above this way, and their workers ended in a traceback.) Past the grace, a trial
  whose heartbeats stopped is stale as before."""
  st = store.open_storage(db.url, str(tmp_path), 1, 0)  # a heartbeat a second, stale after 3 s
  patient = store.ride_out(st.storage, st.url, 60, grace_s=3)
  study = optuna.create_study(study_name="stale", storage=patient)
  trial = study.ask()
  patient.record_heartbeat(trial._trial_id)
  postgres.pg_ctl(db, "stop", "-m", "fast")
  restart = threading.Timer(4.0, postgres.pg_ctl, (db, "start"))
  restart.start()
  try:
    assert patient._get_stale_trial_ids(study._study_id) == []
  finally:
    restart.join()
  time.sleep(3.2)  # the grace after the outage, and no heartbeat since
  assert patient._get_stale_trial_ids(study._study_id) == [trial._trial_id]
  err = capfd.readouterr().err
  assert err.count("is unreachable") == 1 and err.count("is back after") == 1, err
