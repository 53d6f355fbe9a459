"""Experiment trackers (train/trackers/): runs logged to a real MLflow tracking server, started
here on 127.0.0.1 with a SQLite store, and to W&B in offline mode, read back by W&B's own reader
(`wandb leet inspect`). What each shows must equal metrics.jsonl: after a SIGKILL and a resume,
while the server is away and back, and from a job of two processes.
"""

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import types
import urllib.request

import emulators
import pytest
from launcher import Launcher, environment

from transformer_jax import config as config_lib
from transformer_jax.core.errors import UserError
from transformer_jax.tools.sweep import tracking
from transformer_jax.train import trackers
from transformer_jax.train.trackers import mlflow as mlflow_tracker

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--config=experiments/tiny.py", "--mode=train", "--config.eval.max_examples=8",
        "--config.eval.batch_size=8"]


class ServerUri(str):
  """The MLflow server's URI, and in `.directory` the folder of its store and artifacts."""

  directory: str


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
  """`mlflow server` with a SQLite store and its own artifact folder, on a free port of
  127.0.0.1, for this file's tests (it takes some seconds to start: once); its ServerUri."""
  directory = tmp_path_factory.mktemp("mlflow")
  port = emulators.free_port()
  server = subprocess.Popen(
      [os.path.join(os.path.dirname(sys.executable), "mlflow"), "server", "--backend-store-uri",
       f"sqlite:///{directory}/mlflow.db", "--artifacts-destination", str(directory / "artifacts"),
       "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
      cwd=directory, stdout=open(directory / "server.log", "w"), stderr=subprocess.STDOUT,
      # Without the job runner (its seven worker processes serve MLflow's GenAI jobs).
      env=dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false"),
      start_new_session=True)  # its workers in its process group, stopped together
  uri = ServerUri(f"http://127.0.0.1:{port}")
  uri.directory = str(directory)
  deadline = time.time() + 120
  while True:
    try:
      with urllib.request.urlopen(f"{uri}/health", timeout=2) as answer:
        if answer.status == 200:
          break
    except OSError:
      pass
    assert server.poll() is None and time.time() < deadline, (directory / "server.log").read_text()
    time.sleep(0.3)
  yield uri
  os.killpg(server.pid, signal.SIGTERM)
  server.wait(timeout=60)


@pytest.fixture(scope="module")
def launcher(tmp_path_factory):
  """The runs of this file, MLflow's client imported once (a run that logs to MLflow imports
  it: a second and a half each time). Not W&B: its import makes temporary folders that the first
  run to exit would remove for all the others."""
  preload = [*trackers.RUNS["mlflow"][1], f"{trackers.__name__}.mlflow"]
  server = Launcher(environment(), str(tmp_path_factory.mktemp("launches")), preload=preload)
  yield server
  server.close()


def _client(uri):
  from mlflow.tracking import MlflowClient
  return MlflowClient(uri)


def _runs(uri, experiment, run_id=None):
  """The MLflow runs of `experiment` (of the workdir whose tracker id is `run_id`)."""
  client = _client(uri)
  found = client.get_experiment_by_name(experiment)
  if found is None:
    return []
  where = f"tags.`{mlflow_tracker.RUN_ID_TAG}` = '{run_id}'" if run_id else ""
  return client.search_runs([found.experiment_id], filter_string=where)


def _records(workdir, split):
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    return [r for r in map(json.loads, f) if r["split"] == split]


def _history(uri, run, key):
  """[(step, value)] of `key` in the MLflow run, in the order of the steps."""
  return sorted((m.step, m.value) for m in _client(uri).get_metric_history(run.info.run_id, key))


# What a step computes, the same when a resumed run does it again (its time, rate and
# compilation are the run's own).
COMPUTED = ("loss", "nll", "accuracy", "grad_norm", "learning_rate", "tokens", "padding",
            "perplexity", "token_accuracy", "bleu", "chrf", "exact_match")


def _assert_shows_metrics_jsonl(uri, run, workdir, splits=("train", "eval"), keys=None):
  """Every number of every record of metrics.jsonl (or its `keys`), at its step, once."""
  for split in splits:
    records = _records(workdir, split)
    assert records, split
    shown = keys or {k for r in records for k, v in r.items() if isinstance(v, (int, float))
                     and k not in ("step", "interval_s", "interval_steps", "interval_tokens",
                                   "compile_tokens")}
    for key in shown:
      expected = [(r["step"], pytest.approx(float(r[key]), rel=1e-6)) for r in records if key in r]
      assert _history(uri, run, f"{split}/{key}") == expected, (split, key)


def _mlflow_flags(uri, experiment, *more):
  return [f"--config.mlflow.tracking_uri={uri}", f"--config.mlflow.experiment={experiment}",
          *more]


def _run_id(workdir) -> str:
  return json.loads((workdir / "tracker.json").read_text())["run_id"]


# --------------------------------------------------------------------------------- MLflow


@pytest.fixture(scope="module")
def mlflow_run(tmp_path_factory, launcher, mlflow_server):
  """A tiny run logged to MLflow beside TensorBoard as the child of a study, made once: the
  first test below checks it and goes on with it (a plot, the sweep's hooks); the test of system
  metrics reads it as a run that does not ask for them. Its config (the sweep hook's: this
  file's server, experiment "tiny"), parent (the study's run id), workdir, err (its stderr) and
  run (its MLflow run as the server showed it when the run ended)."""
  tiny = types.SimpleNamespace(config=config_lib.default_config())
  tiny.config.mlflow.tracking_uri, tiny.config.mlflow.experiment = mlflow_server, "tiny"
  tiny.parent = tracking.start_study(tiny.config, "study-a", storage="sqlite:///study.db",
                                     params={"space": "train.learning_rate in [1e-4, 1e-2]"})
  tiny.workdir = tmp_path_factory.mktemp("mlflow_run") / "run"
  code, out, tiny.err = launcher.run(
      *TINY, f"--workdir={tiny.workdir}", "--config.train.log_every=5",
      "--config.train.eval_every=10", "--config.train.trackers=tensorboard,mlflow",
      "--config.train.tracker_group=study-a", f"--config.mlflow.parent_run_id={tiny.parent}",
      *_mlflow_flags(mlflow_server, "tiny"))
  assert code == 0, out + tiny.err
  [tiny.run] = _runs(mlflow_server, "tiny", _run_id(tiny.workdir))
  return tiny


def test_a_run_in_mlflow_equals_metrics_jsonl_and_joins_its_sweep(tmp_path, launcher,
                                                                  mlflow_server, mlflow_run):
  """A tiny run with MLflow beside TensorBoard: the flattened config as params, each scalar of
  metrics.jsonl at its step, the sample translations as a table, the checkpoints kept, the
  summary; --mode=plot adds its plots to the same run. The sweep hook makes a parent run for a
  study; the run, started with its id, is its child, and record_trial marks it."""
  config, parent, workdir = mlflow_run.config, mlflow_run.parent, mlflow_run.workdir
  assert tracking.start_study(config, "study-a") == parent  # a resumed sweep: the same
  err, run = mlflow_run.err, mlflow_run.run
  assert "warning" not in err, err
  assert os.listdir(workdir / "tensorboard")  # TensorBoard as before
  assert run.info.status == "FINISHED"
  _assert_shows_metrics_jsonl(mlflow_server, run, workdir, ("train", "eval", "checkpoint"))
  saved = json.loads((workdir / "config.json").read_text())
  assert run.data.params["model.d_model"] == str(saved["model"]["d_model"]) == "32"
  assert len(run.data.params) == len(trackers.flat_config(config))
  assert run.data.tags["checkpoint_steps"] == "10,20"
  assert run.data.tags["mlflow.parentRunId"] == parent
  assert run.data.tags[mlflow_tracker.STUDY_TAG] == "study-a"
  final = _records(workdir, "eval")[-1]
  assert run.data.metrics["summary/eval/bleu"] == pytest.approx(final["bleu"])
  assert run.data.metrics["summary/step"] == 20
  client = _client(mlflow_server)
  tables = [f.path for f in client.list_artifacts(run.info.run_id, "eval/samples")]
  assert tables == ["eval/samples/step_000000010.json", "eval/samples/step_000000020.json"]
  table = json.loads(open(client.download_artifacts(run.info.run_id, tables[-1],
                                                    str(tmp_path))).read())
  [result] = [json.loads(p.read_text()) for p in (workdir / "eval").glob("20.*.json")]
  assert table["columns"] == ["source", "translation", "reference"]
  assert table["data"] == [[s["source"], s["hypothesis"], s["reference"]]
                           for s in result["samples"]]
  # The run's own files, as the workdir has them at the end.
  uploaded = {f.path for f in client.list_artifacts(run.info.run_id)}
  assert {"config.json", "summary.md", "metrics.jsonl"} <= uploaded
  summary_md = open(client.download_artifacts(run.info.run_id, "summary.md",
                                              str(tmp_path))).read()
  assert summary_md == (workdir / "summary.md").read_text()
  kept = json.loads(open(client.download_artifacts(run.info.run_id, "checkpoints.json",
                                                  str(tmp_path))).read())
  assert kept == {"directory": str(workdir / "checkpoints"),
                  "steps": {s: f"file://{workdir}/checkpoints/{s}" for s in ("10", "20")}}

  code, out, err = launcher.run("--mode=plot", f"--workdir={workdir}")
  assert code == 0, out + err
  plots = {os.path.basename(f.path) for f in client.list_artifacts(run.info.run_id, "plots")}
  assert plots == set(os.listdir(workdir / "plots")) and "curves.png" in plots

  # The hook of the sweep engine, with the trial's config (as its workdir holds it).
  tracking.record_trial(config_lib.from_workdir(str(workdir)), str(workdir), 0, "PRUNED",
                        params={"lr": 0.01}, value=2.5, step=10)
  other = tracking.record_mlflow_trial(config, parent, 1, "COMPLETE", params={"lr": 0.001},
                                       value=1.5, step=20)
  tracking.end_study(config, parent, best={"trial": 1, "value": 1.5,
                                           "params": {"lr": 0.001}})
  runs = {r.info.run_id: r for r in _runs(mlflow_server, "tiny")}
  pruned, complete, study = runs[run.info.run_id], runs[other], runs[parent]
  assert (pruned.info.status, pruned.data.tags["trial_state"],
          pruned.data.tags["pruned_at_step"]) == ("KILLED", "PRUNED", "10")
  assert pruned.data.params["lr"] == "0.01" and pruned.data.metrics["trial/value"] == 2.5
  assert (complete.info.status, complete.data.tags["mlflow.parentRunId"]) == ("FINISHED", parent)
  assert study.info.status == "FINISHED" and study.data.metrics["best/value"] == 1.5
  assert study.data.params["space"] == "train.learning_rate in [1e-4, 1e-2]"
  assert study.data.tags["study_storage"] == "sqlite:///study.db"


def test_mlflow_system_metrics_are_on_the_run_when_asked_for(tmp_path, launcher, mlflow_server,
                                                             mlflow_run):
  """mlflow.system_metrics=True: MLflow's own system/... metrics (CPU, memory) on the run,
  however short; without it (mlflow_run's, which leaves the default, False), none."""
  workdir = tmp_path / "run"
  code, out, err = launcher.run(
      *TINY, f"--workdir={workdir}", "--config.train.steps=20", "--config.train.trackers=mlflow",
      "--config.mlflow.system_metrics=True", "--config.mlflow.system_metrics_every_s=1",
      *_mlflow_flags(mlflow_server, "system"))
  assert code == 0, out + err
  assert "warning" not in err, err
  assert not config_lib.from_workdir(str(mlflow_run.workdir)).mlflow.system_metrics
  runs = {False: mlflow_run.run}
  [runs[True]] = _runs(mlflow_server, "system", _run_id(workdir))
  shown = {k for k in runs[True].data.metrics if k.startswith("system/")}
  assert {"system/cpu_utilization_percentage", "system/system_memory_usage_megabytes"} <= shown
  assert runs[True].data.metrics["system/system_memory_usage_megabytes"] > 0
  assert not [k for k in runs[False].data.metrics if k.startswith("system/")]
  assert runs[True].info.status == runs[False].info.status == "FINISHED"


def test_a_run_killed_and_resumed_shows_every_step_once(tmp_path, launcher, mlflow_server):
  """SIGKILL once MLflow shows steps past the newest checkpoint; the resumed run logs those
  steps again to metrics.jsonl but not to the trackers (MLflow, and W&B offline): one MLflow
  run, one W&B run id, every step once, each value metrics.jsonl's (W&B's offline file loses
  the last steps before the kill: the resumed run sends them from metrics.jsonl). W&B, read
  back by its own reader, has the flattened config, the project and tags, the summary."""
  workdir = tmp_path / "run"
  # Saves at 200 and 400 only (keep_best=0: none at the evaluation); the evaluation at 210
  # (after step 210's log) leaves the test time to see step 210 in MLflow and kill the run;
  # tracker_interval_s=0 sends each log step at once (the default's 2 s would end the run first).
  flags = [*TINY, f"--workdir={workdir}", "--config.train.steps=400",
           "--config.train.tracker_interval_s=0",
           "--config.eval.max_examples=32", "--config.train.log_every=10",
           "--config.train.checkpoint_every=200", "--config.train.eval_every=210",
           "--config.train.keep_best=0", "--config.train.trackers=mlflow,wandb",
           "--config.wandb.mode=offline", "--config.wandb.project=tiny", "--config.wandb.tags=a,b",
           *_mlflow_flags(mlflow_server, "killed")]
  launcher.start(*flags)
  runs, shown, saved = [], -1, []
  while launcher.running() and not (shown >= 210 and 200 in saved):  # orbax finishes saves later
    time.sleep(0.05)
    runs = runs or _runs(mlflow_server, "killed")
    if runs:
      shown = max((s for s, _ in _history(mlflow_server, runs[0], "train/loss")), default=-1)
      saved = [int(n) for n in os.listdir(workdir / "checkpoints") if n.isdigit()]
  launcher.send(signal.SIGKILL)
  assert launcher.wait() == -signal.SIGKILL, "the run ended before MLflow showed step 210"
  saved = [int(n) for n in os.listdir(workdir / "checkpoints") if n.isdigit()]
  assert max(saved) == 200 < shown, (saved, shown)  # steps shown past the checkpoint
  code, out, err = launcher.run(*flags)
  assert code == 0, out + err
  assert "resuming from step 200" in out

  [run] = _runs(mlflow_server, "killed")
  assert run.data.tags[mlflow_tracker.RUN_ID_TAG] == _run_id(workdir)
  _assert_shows_metrics_jsonl(mlflow_server, run, workdir, keys=COMPUTED)
  assert [s for s, _ in _history(mlflow_server, run, "train/loss")] == list(range(10, 401, 10))
  for key in run.data.metrics:  # the time and rates of a step logged twice: the first run's
    steps = [s for s, _ in _history(mlflow_server, run, key)]
    assert len(steps) == len(set(steps)), key

  records = _wandb_records(workdir)
  history, run_ids = _wandb_history(workdir, records)
  assert run_ids == {_run_id(workdir)}
  train = _records(workdir, "train")
  assert sorted(history) == [r["step"] for r in train]  # evaluations and saves share their rows
  for r in train:
    assert history[r["step"]]["train/loss"] == pytest.approx(r["loss"], rel=1e-6)
  for r in _records(workdir, "eval"):  # each evaluation's samples: a table at its step
    assert history[r["step"]]["eval/samples.nrows"] == len(r["samples"]) == 5
  # The checkpoints as references (not uploads), the last save's among them (in flight when
  # it was logged: sent again at the end).
  [*_, kept] = [r["artifact"] for r in records if r["type"] == "artifact"
                and r["artifact"]["name"] == f"checkpoints-{_run_id(workdir)}"]
  refs = {e["path"].split("/")[0]: e["ref"] for e in kept["manifest"]["contents"]}
  assert set(refs) == {"200", "400"} and "step-400" in kept["aliases"]
  assert refs["400"].startswith(f"file://{workdir}/checkpoints/400/")
  # The training's own session: after it, one more uploads the run's files (logger.RUN_FILES).
  summaries = [json.loads(_wandb_inspect(d, "--summary"))
               for d in sorted((workdir / "wandb").glob("offline-run-*"))
               if list(d.glob("*.wandb"))]
  summary = [s for s in summaries if "summary/step" in s["summary"]][-1]
  assert (summary["run_id"], summary["project"], summary["tags"]) == (_run_id(workdir), "tiny",
                                                                      ["a", "b"])
  assert summary["config"]["model.d_model"] == 32 and summary["config"]["train.steps"] == 400
  assert summary["summary"]["summary/step"] == 400
  assert summary["summary"]["checkpoint_steps"] == [200, 400]
  assert not (workdir / "tensorboard").exists()  # not asked for


def test_a_tracker_away_mid_run_costs_one_warning_and_catches_up(tmp_path, launcher,
                                                                mlflow_server):
  """The server goes away mid-run: training goes on, metrics.jsonl and TensorBoard complete,
  one warning; the server back, the retries send what was held. A server that stops answering
  for good: the run still finishes, saying what was not sent."""
  proxy = emulators.Outage(mlflow_server)  # a relay the test takes down, back up, stalls
  workdir = tmp_path / "run"
  # Saves at 100 and 200 only (the run's time goes to its steps); tracker_interval_s=0.2 sends
  # soon after the server goes (the default's 2 s would end the run first).
  flags = [*TINY, f"--workdir={workdir}", "--config.train.log_every=2",
           "--config.train.checkpoint_every=100", "--config.train.tracker_interval_s=0.2",
           "--config.train.trackers=tensorboard,mlflow", "--config.train.tracker_retry_s=0.5",
           *_mlflow_flags(f"http://127.0.0.1:{proxy.port}", "away")]
  # MLflow's own variable, honoured: no retry of a refused request (a warning at once).
  env = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"}
  launcher.start(*flags, "--config.train.steps=200", env=env)
  assert launcher.wait_for(lambda out: "step 20/200" in out)
  proxy.down()
  while launcher.running() and "warning: mlflow" not in launcher.output()[1]:
    time.sleep(0.02)
  proxy.up()
  code = launcher.wait()
  out, err = launcher.output()
  assert code == 0, out + err
  assert [s["step"] for s in _records(workdir, "train")] == list(range(2, 201, 2))
  assert [s["step"] for s in _events(workdir, "train/loss")] == list(range(2, 201, 2))
  assert err.count("warning: mlflow") == 1 and "mlflow: reached again" in err, err
  [run] = _runs(mlflow_server, "away")
  _assert_shows_metrics_jsonl(mlflow_server, run, workdir)

  proxy.stall()  # for good: requests hang (until MLflow's own timeout, set by its variable)
  code, out, err = launcher.run(*flags, "--config.train.steps=220",
                                env=dict(env, MLFLOW_HTTP_REQUEST_TIMEOUT="1"))
  assert code == 0, out + err
  assert [s["step"] for s in _records(workdir, "train")] == list(range(2, 221, 2))
  assert err.count("warning: mlflow") == 1, err
  assert "record(s) not sent" in err and "metrics.jsonl holds them all" in err, err


def _events(workdir, tag):
  """The TensorBoard scalars `tag` of the workdir, as TensorBoard's own reader finds them."""
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
  events = EventAccumulator(str(workdir / "tensorboard"), size_guidance={"scalars": 0})
  events.Reload()
  return [{"step": e.step, "value": e.value} for e in events.Scalars(tag)]


def test_log_steps_between_two_sends_go_in_one_request_each_with_its_own_time(mlflow_server):
  """train.tracker_interval_s: the records logged while a send waits out the interval go to
  MLflow together (a request costs the training process milliseconds), every step once, in
  order, each metric stamped with the time it was logged at, not the time it was sent."""
  from transformer_jax.train.trackers.base import Background

  class Counted(mlflow_tracker.MlflowTracker):
    sends = []

    def write(self, records):
      self.sends.append([r["step"] for r in records])
      super().write(records)

  config = config_lib.default_config()
  config.mlflow.update(tracking_uri=mlflow_server, experiment="interval")
  logger = Background(Counted(config, "interval"), "interval-run", {"a": 1}, interval_s=1.5)
  logged = {}
  for step in range(1, 21):
    before = time.time()
    logger.write([{"split": "train", "step": step, "time": time.time(), "loss": 1.0 / step}])
    logged[step] = (int(before * 1000), int(time.time() * 1000) + 1)
    deadline = time.time() + 60
    while step == 1 and not Counted.sends and time.time() < deadline:  # the run opened, 1 sent
      time.sleep(0.01)
    time.sleep(0.05)
  logger.close()
  sends = Counted.sends
  assert [s for send in sends for s in send] == list(range(1, 21)), sends
  assert sends[0] == [1] and len(sends) <= 3, sends  # 2-20 in ~1 s: together, or nearly
  [run] = _runs(mlflow_server, "interval", "interval-run")
  history = _client(mlflow_server).get_metric_history(run.info.run_id, "train/loss")
  assert sorted((m.step, m.value) for m in history) == [(s, 1.0 / s) for s in range(1, 21)]
  for m in history:
    assert logged[m.step][0] <= m.timestamp <= logged[m.step][1], (m.step, m.timestamp)
  assert run.info.status == "FINISHED"


def test_a_job_of_two_processes_logs_one_run(tmp_path, mlflow_server):
  """Process 0 alone logs, under the id it chose and sent to process 1."""
  from test_multiprocess import ARGS, _env
  port = emulators.free_port()
  workdir = tmp_path / "run"
  pair = [subprocess.Popen([sys.executable, "launch.py", *ARGS, f"--workdir={workdir}",
                            "--config.train.trackers=mlflow", *_mlflow_flags(mlflow_server, "two"),
                            f"--coordinator_address=localhost:{port}", "--num_processes=2",
                            f"--process_id={i}"], cwd=ROOT,
                           env=dict(_env(2), TRANSFORMER_JAX_CACHE=str(tmp_path / "cache")),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for i in (0, 1)]
  outputs = [p.communicate(timeout=300)[0].decode() for p in pair]
  assert [p.returncode for p in pair] == [0, 0], outputs
  [run] = _runs(mlflow_server, "two")
  assert run.data.tags[mlflow_tracker.RUN_ID_TAG] == _run_id(workdir)
  _assert_shows_metrics_jsonl(mlflow_server, run, workdir, ("train",))


# ------------------------------------------------------------------------------------ W&B


def _wandb_inspect(run_dir, *flags):
  done = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", *flags,
                         str(run_dir)], capture_output=True, text=True)
  assert done.returncode == 0, (run_dir, done.stderr)
  return done.stdout


def _wandb_records(workdir) -> list:
  """The records of every offline run of the workdir, in order, as W&B's own reader of its run
  files gives them. A run directory without a run file (W&B's service killed before it wrote
  one: it writes the file in blocks) has nothing to read, as the tracker's resume finds
  (trackers.wandb.last_offline_step): the resumed run sends all."""
  return [json.loads(line) for run_dir in sorted((workdir / "wandb").glob("offline-run-*"))
          if list(run_dir.glob("*.wandb")) for line in _wandb_inspect(run_dir).splitlines()]


def _wandb_history(workdir, records=None):
  """({step: history row} of every offline run of the workdir, {their run ids}); a step twice
  fails. A row's table shows as its fields NAME._type, NAME.nrows, ..."""
  history, run_ids = {}, set()
  for record in records if records is not None else _wandb_records(workdir):
    if record["type"] == "run":
      run_ids.add(record["run"]["run_id"])
    if record["type"] == "history":
      step = record["history"]["step"]["num"]
      assert step not in history, f"step {step} shown twice"
      history[step] = record["history"]["item"]
  return history, run_ids


def test_wandb_rows_sent_together_keep_the_time_they_were_logged_at(tmp_path):
  """W&B offline, the interval holding steps 2-5 back: each history row (W&B's own reader)
  has its step's values and the time the step was logged at (W&B's _timestamp)."""
  from transformer_jax.train.trackers.base import Background
  from transformer_jax.train.trackers.wandb import WandbTracker
  config = config_lib.default_config()
  config.wandb.update(mode="offline", project="interval")
  logger = Background(WandbTracker(config, str(tmp_path)), "interval-run",
                      {"a": 1}, interval_s=30)
  logged = {}
  for step in range(1, 6):
    before = time.time()
    logger.write([{"split": "train", "step": step, "time": time.time(), "loss": 1.0 / step}])
    logged[step] = (before, time.time())
    time.sleep(0.1)
  logger.close()  # sends what the 30 s interval held back at once
  history, run_ids = _wandb_history(tmp_path)
  assert run_ids == {"interval-run"} and sorted(history) == [1, 2, 3, 4, 5]
  for step, row in history.items():
    assert row["train/loss"] == pytest.approx(1.0 / step)
    assert logged[step][0] <= row["_timestamp"] <= logged[step][1], (step, row["_timestamp"])


TWO_TRIALS = """from transformer_jax.experiments import tiny

get_config = tiny.get_config


def get_sweep():
  return [{"data.shuffle_buffer": 8}, {"data.shuffle_buffer": 16}]
"""


def test_a_sweep_with_mlflow_makes_its_trials_children_of_the_study(tmp_path, launcher,
                                                                    mlflow_server):
  """A two-trial sweep with train.trackers=mlflow: one parent run tagged with the study (its id
  kept in the study for every worker), each trial's training run its child with its parameters,
  state and last step, FINISHED; the parent ends with the best trial."""
  import optuna

  from transformer_jax.tools.sweep import results, worker
  experiment = tmp_path / "two.py"
  experiment.write_text(TWO_TRIALS)
  workdir = tmp_path / "sweep"
  code, out, err = launcher.run(
      f"--config={experiment}", f"--workdir={workdir}", "--sweep", "--config.sweep.pruner=none",
      "--config.train.steps=3", "--config.train.eval_every=2",  # reported at 2; the last step, 3
      "--config.train.log_every=1", "--config.train.checkpoint_every=2",
      "--config.eval.max_examples=8", "--config.eval.batch_size=8",
      "--config.train.trackers=mlflow", *_mlflow_flags(mlflow_server, "sweep"))
  assert code == 0, out + err
  optuna.logging.set_verbosity(optuna.logging.ERROR)
  study = results.open_study(str(workdir), None)
  trials = study.get_trials()
  assert [t.state.name for t in trials] == ["COMPLETE", "COMPLETE"]
  parent_id = study.user_attrs[tracking.PARENT_ATTR]
  runs = {r.info.run_id: r for r in _runs(mlflow_server, "sweep")}
  parent = runs.pop(parent_id)
  # Named by the study's folder, not the machine's absolute path (one MLflow server for many).
  shown = f"sweep-{hashlib.sha1(study.study_name.encode()).hexdigest()[:6]}"
  assert parent.data.tags[mlflow_tracker.STUDY_TAG] == shown == parent.info.run_name
  assert str(tmp_path) not in parent.info.run_name
  assert parent.info.status == "FINISHED" and parent.data.params["budget"] == "2"
  best = min(trials, key=lambda t: t.value)
  assert json.loads(parent.data.tags["best/trial"]) == best.number
  assert parent.data.metrics["best/value"] == pytest.approx(best.value)
  assert len(runs) == 2  # the two trials' training runs, and no run besides
  for t in trials:
    directory = workdir / worker.trial_name(t.number)
    [run] = [r for r in runs.values()
             if r.data.tags[mlflow_tracker.RUN_ID_TAG] == _run_id(directory)]
    assert run.data.tags["mlflow.parentRunId"] == parent_id
    assert run.data.tags[mlflow_tracker.STUDY_TAG] == shown
    assert (run.data.tags["trial"], run.data.tags["trial_state"]) == (str(t.number), "COMPLETE")
    assert run.data.tags["last_step"] == "3"  # its final step (train.steps), not step 2's
    assert run.data.params["data.shuffle_buffer"] == str(
        t.user_attrs["sweep_overrides"]["data.shuffle_buffer"])
    assert run.data.metrics["trial/value"] == pytest.approx(t.value)
    assert run.info.status == "FINISHED"


def test_a_sweep_trial_in_its_wandb_group_with_its_state(tmp_path):
  """tracking.record_trial, the sweep's hook: the trial's W&B run (resumed by the id of its
  workdir) gets its state, pruning step, value and parameters, in the study's group."""
  config = config_lib.default_config()
  config.train.update(trackers="tensorboard,wandb", tracker_group="study-b")
  config.wandb.update(mode="offline", project="sweep")
  run_id = trackers.claim_run_id(str(tmp_path))
  tracking.record_trial(config, str(tmp_path), 3, "PRUNED", params={"train.learning_rate": 0.01},
                        value=2.5, step=10)
  [run_dir] = (tmp_path / "wandb").glob(f"offline-run-*-{run_id}")
  summary = json.loads(_wandb_inspect(run_dir, "--summary"))
  assert summary["run_id"] == run_id
  assert {k: summary["summary"][k] for k in ("trial/number", "trial/state",
                                             "trial/pruned_at_step", "trial/value")} == {
      "trial/number": 3, "trial/state": "PRUNED", "trial/pruned_at_step": 10, "trial/value": 2.5}
  assert summary["config"]["trial/train.learning_rate"] == 0.01
  [run] = [json.loads(line)["run"] for line in _wandb_inspect(run_dir).splitlines()
           if json.loads(line)["type"] == "run"]
  assert run["run_group"] == "study-b"


# ---------------------------------------------------------------------------- the choice


def test_a_tracker_not_installed_is_one_line_naming_the_extra(monkeypatch):
  config = config_lib.default_config()
  config.train.trackers = "tensorboard,wandb"
  monkeypatch.setitem(sys.modules, "wandb", None)  # what `import wandb` finds uninstalled
  with pytest.raises(UserError, match=r"asks for wandb, which is not installed: pip install "
                                      r"'transformer_jax\[wandb\]'"):
    trackers.check(config)
  config.train.trackers = "tensorboard,neptune"
  with pytest.raises(UserError, match="neptune, which is no tracker"):
    config_lib.validate(config)
  config.train.trackers = "tensorboard"
  for key, value in (("tracker_retry_s", 0.0), ("tracker_interval_s", -1.0)):
    bad = config_lib.default_config()
    bad.train[key] = value
    with pytest.raises(UserError, match=f"train.{key} must be"):
      config_lib.validate(bad)


def test_the_core_imports_no_tracker_package():
  code = ("import sys, transformer_jax.run, transformer_jax.cli; "
          "print(sorted(m for m in ('wandb', 'mlflow') if m in sys.modules))")
  done = subprocess.run([sys.executable, "-c", code],
                        capture_output=True, text=True, check=True, cwd=ROOT)
  assert done.stdout.strip() == "[]"


# ---------------------------------------------------------------------------- provenance


def _git(*args) -> str:
  return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                        check=True).stdout.strip()


def test_an_mlflow_run_carries_its_provenance_name_tags_and_notes(tmp_path):
  """MLflow's own context tags, which MlflowClient.create_run leaves out (git commit, user,
  program), the host and the command line with its secret masked, and train.run_name, tags
  and notes; a real MLflow store (SQLite) read back with MLflow's client."""
  from mlflow.tracking import MlflowClient

  from transformer_jax.train.trackers import base
  config = config_lib.default_config()
  uri = f"sqlite:///{tmp_path}/mlflow.db"
  config.mlflow.tracking_uri = uri
  config.train.update(run_name="baseline-lr3", tags="paper, wmt", notes="the paper's recipe")
  argv = sys.argv
  sys.argv = ["launch.py", "--sweep_storage=postgresql://u:sentinel-pw@db/x"]
  base._provenance.cache_clear()
  try:
    tracker = mlflow_tracker.MlflowTracker(config, "workdir-name")
    tracker.open("provenance-run", trackers.flat_config(config))
  finally:
    sys.argv = argv
    base._provenance.cache_clear()
  run = MlflowClient(uri).get_run(tracker.run_id)
  tags = run.data.tags
  assert run.info.run_name == "baseline-lr3"
  assert tags["mlflow.source.git.commit"] == _git("rev-parse", "HEAD")
  assert tags["git_dirty"] == str(bool(_git("status", "--porcelain", "--untracked-files=no")))
  assert tags["mlflow.user"] and tags["host"] and tags["mlflow.source.name"] == "launch.py"
  assert "sentinel-pw" not in tags["command"] and "--sweep_storage=" in tags["command"]
  assert "paper" in tags and "wmt" in tags
  assert tags["mlflow.note.content"] == "the paper's recipe"
  (tmp_path / "plots").mkdir()
  (tmp_path / "plots" / "curves.png").write_bytes(b"png")
  tracker.files({"plots/curves.png": str(tmp_path / "plots" / "curves.png")})
  tracker.close("finished")
  # A SQLite store keeps its artifacts beside the database, not in the current directory.
  assert (tmp_path / "mlartifacts" / run.info.run_id / "artifacts"
          / "plots" / "curves.png").read_bytes() == b"png"


def test_a_wandb_run_carries_its_provenance_name_tags_and_notes(tmp_path):
  from transformer_jax.train.trackers.wandb import WandbTracker
  config = config_lib.default_config()
  config.wandb.update(mode="offline", project="provenance")
  config.train.update(run_name="baseline-lr3", tags="paper,wmt", notes="the paper's recipe")
  tracker = WandbTracker(config, str(tmp_path))
  tracker.open("provenance-run", {"a": 1})
  (tmp_path / "summary.md").write_text("# the run\n")
  tracker.files({"summary.md": str(tmp_path / "summary.md")})  # the run's files (logger.RUN_FILES)
  # Checkpoints in a bucket: references (or, where W&B's client cannot reach the bucket, the
  # URIs in the artifact's metadata), never a read of the weights nor a failing tracker.
  tracker.checkpoints([10, 20], "gs://bucket/run/checkpoints")
  tracker.close("finished")
  [run_dir] = (tmp_path / "wandb").glob("offline-run-*-provenance-run")
  summary = json.loads(_wandb_inspect(run_dir, "--summary"))
  assert summary["config"]["provenance/git_commit"] == _git("rev-parse", "HEAD")
  assert summary["config"]["provenance/host"] and summary["config"]["provenance/user"] is not None
  records = [json.loads(line) for line in _wandb_inspect(run_dir).splitlines()]
  [run] = [r["run"] for r in records if r["type"] == "run"]
  assert run["display_name"] == "baseline-lr3" and run["tags"] == ["paper", "wmt"]
  [kept] = [r["artifact"] for r in records if r["type"] == "artifact"]
  assert kept["name"] == "checkpoints-provenance-run" and "step-20" in kept["aliases"]
  assert json.loads(kept["metadata"])["steps"] == {"10": "gs://bucket/run/checkpoints/10",
                                                   "20": "gs://bucket/run/checkpoints/20"}
  assert run["notes"] == "the paper's recipe"
  assert (run_dir / "files" / "summary.md").read_text() == "# the run\n"


def test_a_tracking_uri_mlflow_cannot_use_is_one_line(monkeypatch):
  """A typo in MLFLOW_TRACKING_URI was an 'unreachable' MLflow retried for the whole run."""
  config = config_lib.default_config()
  config.train.trackers = "tensorboard,mlflow"
  monkeypatch.setenv("MLFLOW_TRACKING_URI", "htp:/nonsense")
  with pytest.raises(UserError, match=r"MLFLOW_TRACKING_URI 'htp:/nonsense' is no tracking URI "
                                      r"MLflow knows \(its scheme 'htp'"):
    trackers.check(config)
  for good in ("http://127.0.0.1:5000", "sqlite:///m.db", "file:/tmp/mlruns", "mlruns",
               "postgresql+psycopg://u@h/db", "databricks"):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", good)
    assert "mlflow" in trackers.check(config)


IMPORTED_AT_THREAD_START = """
import sys, threading
from transformer_jax import config as config_lib
from transformer_jax.train import trackers
seen = []
start = threading.Thread.start
def observed(self):
  if self.name.startswith("tracker-"):
    seen.append(all(m in sys.modules for m in ("wandb", "mlflow.tracking", "mlflow.entities")))
  return start(self)
threading.Thread.start = observed
config = config_lib.default_config()
config.train.trackers = "tensorboard,wandb,mlflow"
config.wandb.update(mode="offline", project="imports")
config.mlflow.tracking_uri = sys.argv[2]
for writer in trackers.open_writers(config, sys.argv[1], "imports-run"):
  writer.close("finished")
print(seen)
"""


def test_the_trackers_are_imported_before_their_threads_start(tmp_path, mlflow_server):
  """Two tracker threads importing MLflow and W&B at once lost an MLflow run (Python 3.11's
  'AST constructor recursion depth mismatch'): each thread starts with both imported."""
  done = subprocess.run([sys.executable, "-c", IMPORTED_AT_THREAD_START, str(tmp_path),
                         mlflow_server],
                        cwd=ROOT, capture_output=True, text=True, env=environment(), timeout=300)
  assert done.returncode == 0, done.stderr[-2000:]
  assert done.stdout.strip().splitlines()[-1] == "[True, True]", done.stdout


def test_rerunning_a_finished_workdir_sends_its_tracker_what_it_lacks(tmp_path, tiny_run, launcher,
                                                                       mlflow_server):
  """A workdir whose tracker runs lack points (their service away at the end, a kill, or
  chosen only now): the same command on the finished workdir sends every record of
  metrics.jsonl they lack, the sample translations of each evaluation among them (W&B lost
  one across a kill: only its numbers were in metrics.jsonl), and the run's files, and ends
  the runs FINISHED (MLflow's server, and W&B offline read back by its own reader)."""
  import shutil
  workdir = tmp_path / "run"
  shutil.copytree(tiny_run, workdir)
  code, out, err = launcher.run("--config=experiments/tiny.py", f"--workdir={workdir}",
                                "--mode=train", "--config.train.eval_every=10",
                                "--config.train.trackers=tensorboard,mlflow,wandb",
                                "--config.wandb.mode=offline", "--config.wandb.project=synced",
                                *_mlflow_flags(mlflow_server, "synced"))
  assert code == 0, err[-2000:]
  assert "already trained" in out and "got what it lacked" in out
  [run] = _runs(mlflow_server, "synced", _run_id(workdir))
  assert run.info.status == "FINISHED"
  for split, key in (("train", "loss"), ("eval", "bleu")):
    records = _records(workdir, split)
    assert [step for step, _ in _history(mlflow_server, run, f"{split}/{key}")] == [
        r["step"] for r in records] and records
  client = _client(mlflow_server)
  files = {f.path for f in client.list_artifacts(run.info.run_id)}
  assert {"config.json", "summary.md", "metrics.jsonl"} <= files
  evals = _records(workdir, "eval")
  assert [r["step"] for r in evals] == [10, 20] and all(len(r["samples"]) == 5 for r in evals)
  for r in evals:
    table = json.loads(open(client.download_artifacts(
        run.info.run_id, f"eval/samples/step_{r['step']:09d}.json", str(tmp_path))).read())
    assert table["data"] == [[s["source"], s["hypothesis"], s["reference"]]
                             for s in r["samples"]]
  history, run_ids = _wandb_history(workdir)
  assert run_ids == {_run_id(workdir)}
  assert sorted(history) == sorted({r["step"] for r in _records(workdir, "train") + evals})
  for r in evals:
    assert history[r["step"]]["eval/samples.nrows"] == 5
    assert history[r["step"]]["eval/bleu"] == pytest.approx(r["bleu"])
  [run_dir] = (workdir / "wandb").glob("offline-run-*")
  assert (run_dir / "files" / "summary.md").read_text() == (workdir / "summary.md").read_text()


def test_a_tracker_failing_in_this_process_is_not_said_to_be_its_server(capsys):
  """An MLflow run was lost to an error of this process (Python 3.11's 'AST constructor
  recursion depth mismatch', a SystemError, from two threads importing at once) and the closing
  line said the server did not answer: both lines name the error as this process's."""
  from transformer_jax.train.trackers.base import Background

  class Broken(mlflow_tracker.MlflowTracker):
    def open(self, run_id, config):
      raise SystemError("AST constructor recursion depth mismatch (before=48, after=47)")

  config = config_lib.default_config()
  config.mlflow.tracking_uri = "http://127.0.0.1:9"  # never asked
  writer = Background(Broken(config, "local"), "local-run", {}, retry_s=60)
  writer.write([{"split": "train", "step": 1, "time": time.time(), "loss": 1.0}])
  writer.close()
  err = capsys.readouterr().err
  assert err.count("SystemError: AST constructor recursion depth mismatch") == 2, err
  warning, closing = err.strip().splitlines()
  assert "warning: mlflow failed in this process" in warning, err
  assert closing.startswith("mlflow: 1 record(s) not sent, its close, open not made (it failed "
                            "in this process: SystemError"), err
  assert "did not answer" not in err and "127.0.0.1" not in closing, err
  assert not writer.complete
