"""A --workdir in a bucket (gs://, s3://) on the emulators of tests/emulators.py: launch.py runs
as a user runs it, with only the endpoint variables set; nothing appears on the local disk."""

import json
import os
import signal

import jax
import ml_collections
import pytest
from launcher import ROOT, Launcher, environment
from test_checkpoint import RUN, STEPS, assert_same_state, last_logged_step, reference_run

import transformer_jax
from tests import emulators
from transformer_jax import config as config_lib
from transformer_jax.core import lease, storage
from transformer_jax.train import checkpoint
from transformer_jax.train import state as state_lib
from transformer_jax.train.logger import read_metrics

TINY = ["--config=experiments/tiny.py", "--config.train.steps=2", "--config.train.log_every=1",
        "--config.eval.max_examples=8"]


@pytest.fixture(scope="module")
def buckets():
  with emulators.buckets():
    yield dict(os.environ)


@pytest.fixture(scope="module")
def launcher(request, buckets, tmp_path_factory):
  # test_checkpoint's compilation cache: the same tiny runs compile once.
  cache = getattr(request.config, "cache", None)
  cache_dir = cache.mkdir("jax_compilation_cache") if cache else tmp_path_factory.mktemp("jax")
  server = Launcher({**environment(cache_dir), **buckets},
                    str(tmp_path_factory.mktemp("launches")))
  yield server
  server.close()


def local_entries() -> set:
  """What a URL turned into a local path would create: `gs:` or `s3:` folders."""
  return {name for name in os.listdir(ROOT) if name.endswith(":")}


@pytest.fixture(scope="module")
def gs_run(launcher):
  """A tiny run trained into gs://bucket/run (once for the module)."""
  workdir = "gs://bucket/run"
  code, out, err = launcher.run(*TINY, f"--workdir={workdir}", "--mode=train")
  assert code == 0, err
  assert "credentials file" not in err, err  # TensorStore's, at an emulator (issue 55)
  return workdir


def test_train_then_evaluate_and_plot_in_a_gs_workdir(launcher, gs_run):
  workdir = gs_run
  assert {"config.json", "tokenizer.model", "checkpoints", "eval", "summary.md", "tensorboard",
          "metrics.jsonl.parts"} <= set(storage.listdir(workdir))
  assert "lock" not in storage.listdir(workdir)  # the lease ends with the run
  assert storage.listdir(storage.join(workdir, "checkpoints")) == ["2"]
  assert json.loads(storage.read_text(storage.join(workdir, "config.json")))["train"]["steps"] == 2
  train = [r for r in read_metrics(workdir) if r["split"] == "train"]
  assert [r["step"] for r in train] == [1, 2]
  assert all(name.startswith("events.out.tfevents.")
             for name in storage.listdir(storage.join(workdir, "tensorboard")))

  # --config left out: the workdir's own config.json, read from the bucket.
  code, out, err = launcher.run(f"--workdir={workdir}", "--mode=evaluate", "--split=test")
  assert code == 0, err
  result = json.loads(out.strip().splitlines()[-1])
  assert result["step"] == 2 and result["split"] == "test"
  code, out, err = launcher.run(f"--workdir={workdir}", "--mode=translate")  # stdin: empty
  assert code == 0 and out == "", err
  code, out, err = launcher.run(f"--workdir={workdir}", "--mode=plot")
  assert code == 0, err
  assert storage.read_bytes(storage.join(workdir, "plots", "curves.png"))[:4] == b"\x89PNG"
  assert local_entries() == set()


def test_a_second_trainer_is_refused_while_a_lease_is_live(launcher):
  workdir = "gs://bucket/leased"
  holder = lease.Lease(workdir)  # another run, alive: this test process
  holder.acquire()
  try:
    code, out, err = launcher.run(*TINY, f"--workdir={workdir}", "--mode=train")
  finally:
    holder.release()
  assert code == 2, err
  assert err.strip().count("\n") == 0 and f"pid {os.getpid()}" in err and "in use by" in err
  assert storage.listdir(workdir) == []  # nothing written


@pytest.mark.parametrize("workdir, says, mode", [
    ("gcs://bucket/run", "unknown storage scheme gcs://", "--mode=train"),
    ("gs:/bucket/run", "not a gs:// URL", "--mode=train"),
    ("gs://no-such-bucket/run", "the bucket gs://no-such-bucket does not exist", "--mode=train"),
    ("s3://no-such-bucket/run", "the bucket s3://no-such-bucket does not exist", "--mode=train"),
    ("gs://private/run", "no valid credentials for Google Cloud Storage", "--mode=train"),
    ("gcs://bucket/run", "unknown storage scheme gcs://", "--mode=evaluate")])
def test_a_bad_bucket_workdir_is_one_line_exit_2(launcher, workdir, says, mode):
  code, out, err = launcher.run(*TINY, f"--workdir={workdir}", mode)
  lines = err.strip().splitlines()
  assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
  assert says in lines[0]
  assert local_entries() == set()
  if workdir.startswith("s3://bucket"):
    assert storage.listdir(workdir) == []  # refused before anything was written


def restore_latest(workdir: str):
  """The newest readable checkpoint of a workdir (local or in a bucket), via its config.json."""
  config = ml_collections.ConfigDict(json.loads(storage.read_text(
      storage.join(workdir, "config.json"))))
  model_config = config_lib.validate(config)
  optimizer = state_lib.make_optimizer(config.train, model_config.d_model)
  target = jax.eval_shape(lambda: state_lib.create_state(model_config, optimizer, config.seed))
  manager = checkpoint.Manager(workdir, config)
  try:
    return manager.latest_good(target)
  finally:
    manager.close()


def unfinished_steps(workdir: str) -> list:
  """The checkpoint steps of a bucket workdir that orbax began and has not committed (no
  commit_success.txt yet): a save under way, or cut short."""
  directory = storage.join(workdir, "checkpoints")
  return [n for n in storage.listdir(directory) if n.isdigit()
          and not storage.exists(storage.join(directory, n, checkpoint.COMMIT_FILE))]


def test_killed_in_a_bucket_then_resumed_equals_an_uninterrupted_local_run(launcher,
                                                                        shared_directory):
  """kill -9 in the middle of a gs:// run, inside a checkpoint save (its lease and a step
  without its commit file left behind), then the same command: the final state and the logged
  steps are those of a local run that was never interrupted (test_checkpoint.py's reference
  run of the same command, trained once per session)."""
  local = reference_run(launcher, shared_directory)
  workdir = "gs://bucket/killed"
  launcher.start(*RUN, f"--workdir={workdir}")
  # Every step is checkpointed (RUN): from the middle on, the first moment a save is under way.
  launcher.wait_for(lambda out: last_logged_step(out) >= STEPS // 2 and unfinished_steps(workdir))
  launcher.send(signal.SIGKILL)
  assert launcher.wait() == -signal.SIGKILL
  assert "lock" in storage.listdir(workdir)  # the killed run's lease
  cut_short = unfinished_steps(workdir)
  assert cut_short, "the kill did not land inside a checkpoint save"
  assert int(cut_short[0]) not in checkpoint.saved_steps(workdir)
  code, out, err = launcher.run(*RUN, f"--workdir={workdir}")
  assert code == 0, err
  resumed, reference = restore_latest(workdir), restore_latest(str(local))
  assert resumed.step == reference.step == STEPS
  assert_same_state(resumed.state, reference.state)
  steps = [r["step"] for r in read_metrics(workdir) if r["split"] == "train"]
  assert steps == list(range(1, STEPS + 1))
  assert local_entries() == set()


def test_an_s3_workdir_holds_the_checkpoints_a_gs_one_does(launcher, gs_run):
  """orbax's checkpoints through TensorStore's s3 driver (moto's server): the same run into
  s3:// saves and loads back the state its gs:// twin holds, bit for bit, and evaluates as it
  does."""
  workdir = "s3://bucket/run"
  code, out, err = launcher.run(*TINY, f"--workdir={workdir}", "--mode=train")
  assert code == 0, err
  assert storage.listdir(storage.join(workdir, "checkpoints")) == ["2"]
  # Committed as orbax commits a gs:// step: in place, commit_success.txt written last.
  assert checkpoint.COMMIT_FILE in storage.listdir(storage.join(workdir, "checkpoints", "2"))
  assert checkpoint.saved_steps(workdir) == checkpoint.saved_steps(gs_run) == [2]
  # Training's final evaluation, written to s3://; the checkpoint is read back below (restore,
  # load), as --mode=evaluate reads it (run on gs:// by test_train_then_evaluate_and_plot...).
  results = [set(storage.listdir(storage.join(w, "eval"))) for w in (workdir, gs_run)]
  assert results[0] & results[1]  # the final evaluation of training, at least
  for name in results[0] & results[1]:
    on_s3, on_gs = (json.loads(storage.read_text(storage.join(w, "eval", name)))
                    for w in (workdir, gs_run))
    timeless = [{k: v for k, v in r.items() if "second" not in k and "time" not in k}
                for r in (on_s3, on_gs)]
    assert timeless[0] == timeless[1] and "loss" in timeless[0], name
  assert_same_state(restore_latest(workdir).state, restore_latest(gs_run).state)
  model = transformer_jax.load(workdir)  # in this process, from the bucket
  assert model.step == 2
  assert_same_state(model.params, restore_latest(gs_run).state.params)
  assert local_entries() == set()


TWO_TRIALS = """from experiments.tiny import get_config  # noqa: F401


def get_sweep():
  return [{"train.learning_rate": 1e-3}, {"train.learning_rate": 3e-3}]
"""


def test_a_sweep_into_a_gs_workdir_ranks_its_trials_and_resumes(launcher, tmp_path):
  """--sweep with a bucket workdir: it names a database for its study (here SQLite, one worker);
  each trial trains into WORKDIR/trial_NNNN there, results.md and results.csv rank them; run
  again, no finished trial is redone."""
  experiment = tmp_path / "two_trials.py"
  experiment.write_text(TWO_TRIALS)
  workdir = "gs://bucket/sweep"
  command = [f"--config={experiment}", f"--workdir={workdir}", "--sweep",
             f"--sweep_storage=sqlite:///{tmp_path}/study.db", *TINY[1:]]
  code, out, err = launcher.run(*[c for c in command if not c.startswith("--sweep_storage")])
  assert code == 2 and "give --sweep_storage=" in err, out + err
  code, out, err = launcher.run(*command)
  assert code == 0, out + err
  assert {"results.md", "results.csv", "sweep.json", "trial_0000", "trial_0001"} <= set(
      storage.listdir(workdir))
  for trial in ("trial_0000", "trial_0001"):
    names = storage.listdir(storage.join(workdir, trial))
    assert {"trial.json", "train.log", "config.json"} <= set(names), names
    assert storage.listdir(storage.join(workdir, trial, "checkpoints")) == ["2"]
    lease.lock(storage.join(workdir, trial)).check()  # no run holds it any more
  table = storage.read_text(storage.join(workdir, "results.md"))
  assert table.count("| trial_") == 2 and table.count("| finished |") == 2 and table in out
  rows = storage.read_text(storage.join(workdir, "results.csv")).splitlines()
  assert len(rows) == 3 and rows[0].startswith("trial,state")

  code, out, err = launcher.run(*command)
  assert code == 0, out + err
  assert " started" not in out
  assert storage.read_text(storage.join(workdir, "results.csv")).splitlines() == rows
  assert local_entries() == set()


@pytest.mark.parametrize("mode", ["--mode=train", "--mode=evaluate"])
def test_gcs_without_permission_is_one_line_exit_2(launcher, buckets, tmp_path, mode):
  """Real credentials (a service-account key whose token endpoint is the emulator's) that the
  bucket refuses: GCS answers 403, the run says so in one line before writing anything."""
  key = emulators.service_account_key(tmp_path / "key.json", buckets["STORAGE_EMULATOR_HOST"])
  code, out, err = launcher.run(*TINY, "--workdir=gs://private/run", mode,
                                env={"GOOGLE_APPLICATION_CREDENTIALS": key})
  lines = err.strip().splitlines()
  assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
  assert "permission denied" in lines[0] and "grant this account read and write access" in err
  assert "gs://private" in lines[0] and "Forbidden" in lines[0]
  assert local_entries() == set()
