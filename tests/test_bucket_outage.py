"""A gs:// workdir whose store goes away mid-run (emulators.Outage: connections refused and cut,
the emulator behind it keeping every object) for longer than a lease renewal, then comes back:
the run rides it out (one warning line when it begins, one when it ends, no traceback) and its
final parameters equal an uninterrupted run's bitwise. Past train.storage_outage_s the run
stops with one error line, exit 2, its last complete checkpoint intact."""

import os
import time

import pytest
from launcher import Launcher, environment
from test_bucket_workdir import restore_latest
from test_checkpoint import RUN, STEPS, assert_same_state, last_logged_step, reference_run

from tests import emulators
from transformer_jax.core import storage
from transformer_jax.train import checkpoint
from transformer_jax.train.logger import read_metrics

pytest.importorskip("gcsfs")
# Longer than a lease renewal, and than a request's own tries (storage.RETRIES, with about 1 + 2 s
# of gcsfs's sleep between them: an outage shorter than that never reaches the run). The
# tester's was 70 s; past the lease renewal nothing new happens but more waiting.
DOWN_S = 25
assert DOWN_S > storage.RENEW_EVERY_S


@pytest.fixture(scope="module")
def store(request, tmp_path_factory):
  """(the relay in front of a GCS emulator holding gs://bucket, a launcher whose runs reach the
  store through the relay only)."""
  with emulators.gcs_buckets("bucket") as url:
    relay = emulators.Outage(url)
    cache = getattr(request.config, "cache", None)
    cache_dir = cache.mkdir("jax_compilation_cache") if cache else tmp_path_factory.mktemp("jax")
    env = {**environment(cache_dir), **emulators.environment(relay.url),
           "TENSORSTORE_GCS_HTTP_URL": relay.url}
    server = Launcher(env, str(tmp_path_factory.mktemp("launches")))
    try:
      yield relay, server
    finally:
      server.close()
      relay.close()


def _down_while(relay, launcher, start_at: int, seconds: float) -> None:
  """Takes the store down once the run has logged step `start_at`, for `seconds` (or, None,
  until the run ends), then brings it back."""
  assert launcher.wait_for(lambda out: last_logged_step(out) >= start_at)
  relay.down()
  deadline = time.time() + (seconds or 600)
  try:
    while time.time() < deadline:
      try:
        os.kill(launcher.pid, 0)
      except ProcessLookupError:  # it ended (the launcher has reaped it)
        return
      time.sleep(0.1)
  finally:
    relay.up()


def test_an_outage_longer_than_a_lease_renewal_is_ridden_out_bitwise(store, shared_directory):
  relay, launcher = store
  local = reference_run(launcher, shared_directory)
  workdir = "gs://bucket/outage"
  launcher.start(*RUN, f"--workdir={workdir}")
  _down_while(relay, launcher, 2, DOWN_S)
  code = launcher.wait()
  out, err = launcher.output()
  assert code == 0, err
  assert "Traceback" not in err and "error:" not in err, err
  said = [line for line in err.splitlines() if "does not answer" in line]
  assert len(said) == 1 and "train.storage_outage_s=300" in said[0], err
  assert "answers again after" in err
  resumed, reference = restore_latest(workdir), restore_latest(str(local))
  assert resumed.step == reference.step == STEPS
  assert_same_state(resumed.state, reference.state)
  # Every step's metrics were written, late, once the store answered.
  steps = [r["step"] for r in read_metrics(workdir) if r["split"] == "train"]
  assert steps == list(range(1, STEPS + 1))
  assert "lock" not in storage.listdir(workdir)  # the lease ended with the run


def test_past_the_bound_it_stops_in_one_line_keeping_its_last_checkpoint(store):
  relay, launcher = store
  workdir = "gs://bucket/gave_up"
  launcher.start(*RUN, f"--workdir={workdir}", "--config.train.storage_outage_s=3")
  _down_while(relay, launcher, 3, None)  # down until the run gives up
  code = launcher.wait()
  out, err = launcher.output()
  errors = [line for line in err.splitlines() if line.startswith("error: ")]
  assert code == 2, err
  assert "Traceback" not in err, err
  assert len(errors) == 1 and relay.url in errors[0] and "(train.storage_outage_s=3)" in errors[0]
  assert "last complete checkpoint" in errors[0] and "train.storage_outage_s" in errors[0]
  # The last complete checkpoint reads back whole (its checksums verified), so that a rerun
  # resumes from it, as test_bucket_workdir's run resumes after a kill -9.
  steps = checkpoint.saved_steps(workdir)
  assert steps and steps[-1] < STEPS, steps
  assert restore_latest(workdir).step == steps[-1]


@pytest.mark.parametrize("workdir, env, says", [
    ("gs://bucket/never_trained", {}, "gs://bucket/never_trained holds no config.json to take "
                                      "the run's config from"),
    ("gs://no-such-bucket/run", {}, "the bucket gs://no-such-bucket does not exist"),
    ("gs://bucket/run", {"GOOGLE_APPLICATION_CREDENTIALS": "/nonexistent/key.json"},
     "GOOGLE_APPLICATION_CREDENTIALS names /nonexistent/key.json, which is not a file")])
def test_a_bucket_workdir_to_read_without_config_names_what_is_missing(store, workdir, env, says):
  """Not "--config is required": the workdir, its bucket or the credentials are what is wrong
  (the last at once, not after the credential chain's waits)."""
  _, launcher = store
  started = time.time()
  code, out, err = launcher.run(f"--workdir={workdir}", "--mode=evaluate", env=env)
  assert code == 2 and err.count("\n") == 1 and err.startswith("error: "), err
  assert says in err, err
  assert time.time() - started < 30


def test_a_checkpoint_write_the_store_refuses_is_one_line(store):
  """The store answers 403 to the checkpoints' uploads (every other request passes): one line
  naming the answer, exit 2, none of orbax's tracebacks."""
  relay, launcher = store
  workdir = "gs://bucket/refused"
  relay.refuse("/upload/", "checkpoints")  # uploads only: the listings pass
  try:
    code, out, err = launcher.run(*RUN, f"--workdir={workdir}")
  finally:
    relay.refuse()
  assert code == 2, err
  assert "Traceback" not in err, err
  # (TensorStore, at an emulator without credentials, logs one line of its own when it looks
  # for them: "Could not find the credentials file"; a real run has credentials.)
  lines = [line for line in err.strip().splitlines()
           if "google_auth_provider.cc" not in line]
  assert len(lines) == 1 and lines[0].startswith("error: "), err
  assert "permission denied" in lines[0] and "Forbidden" in lines[0], err
  assert "no checkpoint was written" in lines[0], err


@pytest.mark.parametrize("outage_s", [0, 3, 31, 60, 300, 1000])
def test_tensorstore_retries_a_write_as_long_as_the_outage_budget(outage_s):
  """TensorStore's backoff (from 1 s, doubling, at most 16 s) over its tries adds up to the
  run's train.storage_outage_s (a 200 s outage inside a checkpoint write ended a run bound at
  300 s after TensorStore's 5 tries), never fewer than its 5, and not a try more than needed."""
  settings = checkpoint.tensorstore_retries(outage_s)
  assert (settings["initial_delay"], settings["max_delay"]) == ("1s", "16s")
  tries = settings["max_retries"]

  def waited(n):
    return sum(min(2 ** i, 16) for i in range(n))

  assert tries >= 5 and waited(tries) >= outage_s
  assert tries == 5 or waited(tries - 1) < outage_s
