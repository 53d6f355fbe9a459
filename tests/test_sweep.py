"""Sweeps on Optuna with the default storage (the journal file in the workdir): the plan, the
search space and its errors, pruning, a trial's own failure, SIGTERM, seeds with a test pass,
and a worker of two processes. (A PostgreSQL study with several workers and a killed one:
test_sweep_postgres.py.) Every launch.py run is forked by a launcher (tests/launcher.py) that
imports the library once for the whole file, a second one for the other process of a worker's
job of two; each run is a real process of its own."""

import csv
import json
import os
import signal
import time
from types import SimpleNamespace

import launcher
import optuna
import pytest

from transformer_jax.core.errors import UserError
from transformer_jax.tools import sweep
from transformer_jax.tools.sweep import results, space, store, worker

FAST = ["--config.train.steps=2", "--config.train.log_every=1", "--config.train.checkpoint_every=2",
        "--config.eval.max_examples=8"]


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
  """The launcher of this file's runs (process 0 of a worker's job of two: launch_two)."""
  server = launcher.Launcher(launcher.environment(), str(tmp_path_factory.mktemp("launches")))
  yield server
  server.close()


def _run(launch, *args):
  """The stdout and stderr of `launch.py ARGS`, which must exit with 0."""
  code, out, err = launch.run(*args)
  assert code == 0, out + err
  return SimpleNamespace(stdout=out, stderr=err)


def _study(workdir):
  optuna.logging.set_verbosity(optuna.logging.ERROR)
  return results.open_study(str(workdir), None)


def _rows(workdir):
  with open(workdir / "results.csv", encoding="utf-8") as f:
    return {r["trial"]: r for r in csv.DictReader(f)}


def test_grid_is_the_cartesian_product():
  trials = sweep.grid(**{"a": [1, 2], "b.c": ["x", "y", "z"]})
  assert len(trials) == 6
  assert {(t["a"], t["b.c"]) for t in trials} == {(a, c) for a in (1, 2) for c in "xyz"}


def test_seeds_per_trial_by_entry_or_flag(tmp_path):
  trials = [{"a": 1, "seeds": 3}, {"a": 2}]
  assert space.seed_counts(trials) == [3, None]
  assert space.seed_counts(trials, seeds=2) == [2, 2]  # the flag wins over the entries
  experiment = tmp_path / "e.py"
  experiment.write_text("from transformer_jax.experiments.tiny import get_config  # noqa\n"
                        "def get_sweep():\n  return [{'seed': 7}, {'train.steps': 3, 'seeds': 2}]"
                        "\n")
  queued = space.queued_trials(space.load(str(experiment)), {}, only=[1, 0])
  assert [(q.index, q.seed, q.overrides) for q in queued] == [
      (1, 0, {"train.steps": 3, "seed": 0}), (1, 1, {"train.steps": 3, "seed": 1}),
      (0, None, {"seed": 7})]  # sweep.trials' order; seeds from the trial's config seed
  for bad, why in (([{"seeds": 0}], "positive"), ([{"seeds": "5"}], "positive"),
                   ([{"seeds": 2, "seed": 1}], "leave out one")):
    with pytest.raises(UserError, match=why):
      space.seed_counts(bad)
  with pytest.raises(UserError, match="sweep.seeds must be >= 0"):
    space.seed_counts(trials, seeds=-1)


SPACE = """from transformer_jax.experiments import tiny
from transformer_jax.tools import sweep

get_config = tiny.get_config


def get_sweep():
  return [{"model.positional": "rotary", "train.learning_rate": 1e-3}]


def get_search_space():
  return {SPACE}
"""
GOOD = ('{"train.learning_rate": sweep.log_uniform(1e-4, 1e-2), '
        '"model.positional": sweep.choice(["sinusoidal", "rotary"]), '
        '"model.position_base": sweep.log_uniform(1e3, 1e5, when={"model.positional": "rotary"}), '
        '"data.shuffle_buffer": sweep.integer(0, 16, step=8)}')


def _experiment(tmp_path, text, name="space.py"):
  path = tmp_path / name
  path.write_text(SPACE.replace("{SPACE}", text))
  return str(path)


def test_search_space_draws_conditional_keys_and_dry_run_creates_nothing(tmp_path, launch):
  experiment = space.load(_experiment(tmp_path, GOOD))
  space.check_space(experiment, {})
  study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
  drawn = [space.suggest(study.ask(), experiment.space) for _ in range(40)]
  for overrides in drawn:
    assert 1e-4 <= overrides["train.learning_rate"] <= 1e-2
    assert overrides["data.shuffle_buffer"] in (0, 8, 16)
    assert ("model.position_base" in overrides) == (overrides["model.positional"] == "rotary")
  assert {o["model.positional"] for o in drawn} == {"sinusoidal", "rotary"}
  assert space.grid_of({k: v for k, v in experiment.space.items() if k != "train.learning_rate"
                        and k != "model.position_base"}) == {
      "model.positional": ["sinusoidal", "rotary"], "data.shuffle_buffer": [0, 8, 16]}

  workdir = tmp_path / "sweep"
  out = _run(launch, f"--config={experiment.path}", f"--workdir={workdir}", "--sweep_dry_run",
             "--config.sweep.budget=10", "--config.sweep.pruner=asha",
             "--config.sweep.sampler=random", "--config.train.eval_every=5").stdout
  for part in ("budget: 10 trials (1 enqueued from get_sweep(), up to 9 drawn by the random "
               "sampler)", "pruner: asha", "study.journal",
               "model.position_base: float in [1000.0, 100000.0] (log scale), when "
               "model.positional in ['rotary']",
               "get_sweep[0]: {'model.positional': 'rotary', 'train.learning_rate': 0.001}"):
    assert part in out, out
  assert not workdir.exists()


@pytest.mark.parametrize("text, flags, message", [
    ("{}", [], "must return a non-empty dict"),
    ('{"train.learning_rate": [1e-4, 1e-2]}', [], "is not a distribution"),
    ('{"train.learnin_rate": sweep.uniform(0.1, 0.2)}', [], "train.learnin_rate"),
    ('{"model.position_base": sweep.uniform(1, 2, when={"model.positional": "rotary"})}', [],
     "declare it first, with sweep.choice"),
    ('{"model.positional": sweep.choice(["rotary"]), "model.position_base": '
     'sweep.uniform(1, 2, when={"model.positional": "alibi"})}', [], "none of its choices"),
    ('{"model.num_heads": sweep.integer(2, 3)}', [], "model.num_heads=3"),
    ('{"train.learning_rate": sweep.uniform(1e-3, 1e-2)}', ["grid"], "a continuous range"),
    (GOOD, ["tpe", "no get_sweep"], "needs a trial budget"),
])
def test_a_bad_search_space_is_one_error_before_anything_runs(tmp_path, text, flags, message):
  options = worker.Options(sampler=flags[0] if flags else "tpe")
  path = _experiment(tmp_path, text)
  if "no get_sweep" in flags:  # a search space alone: its budget must be given
    with open(path, "a", encoding="utf-8") as f:
      f.write("\n\ndel get_sweep\n")
  with pytest.raises(UserError, match=message.replace("[", r"\[").replace("(", r"\(")):
    worker.plan(path, {}, options)


@pytest.mark.parametrize("options, message", [
    (worker.Options(sampler="bayes", budget=2), "sweep.sampler must be one of"),
    (worker.Options(pruner="early", budget=2), "sweep.pruner must be one of"),
    (worker.Options(budget=0, seeds=0, only=[3]), "sweep.trials must name trials 0..0"),
])
def test_unknown_sampler_pruner_or_trial_is_one_error(tmp_path, options, message):
  with pytest.raises(UserError, match=message):
    worker.plan(_experiment(tmp_path, GOOD), {}, options)


def test_a_sweep_in_a_bucket_names_its_database():
  with pytest.raises(UserError, match="keeps its study in a database its workers share: give "
                                      "--sweep_storage="):
    worker.store.open_storage(None, "gs://runs/sweep", heartbeat_s=60, retries=3)


# Four trials: two of the same programs (the shuffle buffer changes only the batches' order), one
# with a learning rate too small to learn (the median pruner stops it at its first evaluation),
# one whose test split does not exist (its own fault: failed, not retried).
PRUNED = """from transformer_jax.experiments import tiny

get_config = tiny.get_config


def get_sweep():
  return [{"data.shuffle_buffer": 0}, {"data.shuffle_buffer": 16},
          {"train.learning_rate": 1e-7}, {"data.test_split": "no_such_split"}]
"""


def test_a_pruned_trial_and_a_failed_one_are_in_the_table_rebuilt_from_the_study(tmp_path,
                                                                                   launch):
  experiment = tmp_path / "pruned.py"
  experiment.write_text(PRUNED)
  workdir = tmp_path / "sweep"
  command = [f"--config={experiment}", f"--workdir={workdir}", "--sweep",
             "--config.sweep.pruner=median", "--config.train.steps=10",
             "--config.train.eval_every=5", "--config.train.learning_rate=3e-3",
             "--config.eval.max_examples=8"]
  out = _run(launch, *command).stdout
  assert "trial_0002 pruned at step 5: loss" in out, out
  rows = _rows(workdir)
  assert rows["trial_0002"]["state"] == "pruned at step 5"
  assert rows["trial_0003"]["state"].startswith("failed: ") and "no_such_split" in \
      rows["trial_0003"]["state"]
  assert [rows[f"trial_000{i}"]["state"] for i in (0, 1)] == ["finished", "finished"]
  # Each finished trial's start-up, and what compiled it: the first trial of the worker traced
  # and compiled the step (or loaded it from the session's cache), the second reused it.
  assert all(float(rows[f"trial_000{i}"]["startup_s"]) > 0 for i in (0, 1))
  assert rows["trial_0000"]["cache"] in ("hit", "miss", "partly", "off")
  assert rows["trial_0001"]["cache"] == "none"
  assert list(rows)[:2] == sorted(["trial_0000", "trial_0001"],
                                  key=lambda t: float(rows[t]["loss"]))
  pruned = workdir / "trial_0002"
  assert "5" in os.listdir(pruned / "checkpoints")  # the pruned trial saved its step
  with open(pruned / "metrics.jsonl", encoding="utf-8") as f:
    assert max(r["step"] for r in map(json.loads, f)) == 5
  study = _study(workdir)
  assert [t.state.name for t in study.get_trials()] == ["COMPLETE", "COMPLETE", "PRUNED", "FAIL"]
  with open(pruned / "metrics.jsonl", encoding="utf-8") as f:
    (evaluation,) = [r for r in map(json.loads, f) if r["split"] == "eval"]
  assert study.get_trials()[2].intermediate_values == {5: pytest.approx(evaluation["loss"])}
  # Its row shows the evaluation that pruned it (once: every metric left empty).
  for metric in ("loss", "token_accuracy"):
    assert float(rows["trial_0002"][metric]) == pytest.approx(evaluation[metric], rel=1e-3)
  # The trial's identity, for its training run and for trackers.
  assert json.loads((workdir / "trial_0001" / "trial.json").read_text()) == {
      "study": str(workdir), "trial": 1, "directory": "trial_0001",
      "overrides": {"data.shuffle_buffer": 16}}
  # Rebuilt from the study alone; the plots drawn from it; HParams written by each finished one.
  table = (workdir / "results.md").read_text()
  os.remove(workdir / "results.md")
  rebuilt = _run(launch, "--mode=sweep_results", f"--workdir={workdir}").stdout
  assert (workdir / "results.md").read_text() == table and "best trial: " in rebuilt
  drawn = results.plot(str(workdir), None)
  assert {os.path.basename(p) for p in drawn} >= {"sweep_history.png",
                                                 "sweep_intermediate_values.png"}
  assert all(open(p, "rb").read(8) == b"\x89PNG\r\n\x1a\n" for p in drawn)
  assert list((workdir / "trial_0000" / "tensorboard").glob("events.out.tfevents.*"))
  # The same command again: nothing left to run, the study unchanged.
  again = _run(launch, *command).stdout
  assert " started" not in again and len(_study(workdir).get_trials()) == 4


ONE = """from transformer_jax.experiments import tiny

get_config = tiny.get_config


def get_sweep():
  return [{"data.shuffle_buffer": 16}]
"""


def test_sigterm_saves_hands_the_trial_back_and_exits_0(tmp_path, launch):
  experiment = tmp_path / "one.py"
  experiment.write_text(ONE)
  workdir = tmp_path / "sweep"
  launch.start(f"--config={experiment}", f"--workdir={workdir}", "--sweep",
               "--config.train.steps=400", "--config.train.checkpoint_every=200",
               "--config.eval.max_examples=8")
  metrics = workdir / "trial_0000" / "metrics.jsonl"
  launch.wait_for(lambda _: metrics.exists() and '"split": "train"' in metrics.read_text(), 240)
  launch.send(signal.SIGTERM)
  code = launch.wait()
  out = "".join(launch.output())
  assert code == 0, out
  assert "trial_0000 stopped by a signal after saving its checkpoint" in out, out
  saved = [int(p) for p in os.listdir(workdir / "trial_0000" / "checkpoints") if p.isdigit()]
  assert saved and max(saved) < 400
  study = _study(workdir)
  handed, queued = study.get_trials()
  assert handed.state.name == "FAIL" and queued.state.name == "WAITING"
  assert queued.system_attrs["failed_trial"] == 0
  assert _rows(workdir)["trial_0000"]["state"] == "waiting"
  assert float(_rows(workdir)["trial_0000"]["wall_time_s"]) > 0  # the attempt's time counts


def test_a_retried_trials_wall_time_counts_every_attempt():
  import optuna
  optuna.logging.set_verbosity(optuna.logging.ERROR)
  study = optuna.create_study()
  first = study.ask()
  first.set_user_attr("sweep_wall_s", 3.0)  # a lost attempt, up to its last evaluation
  study.tell(first, state=optuna.trial.TrialState.FAIL)
  worker._retry(worker.Options(retries=1))(study, study.get_trials()[0])
  second = study.ask()
  second.set_user_attr("sweep_wall_s", 4.5)
  study.tell(second, 1.0)
  (row,) = results.rows(study, "loss")
  assert (row["trial"], row["retries"], row["wall_time_s"]) == ("trial_0000", 1, 7.5)


SEEDED = """from transformer_jax.experiments import tiny

get_config = tiny.get_config


def get_sweep():
  return [{"train.learning_rate": 1e-3, "seeds": 2}]
"""
LENGTH = ["--config.data.scan_split=length", "--config.data.train_split=train_without_dev",
          "--config.data.eval_split=dev", "--config.data.test_split=test",
          "--config.train.keep_best=1", "--config.train.eval_every=1"]


def test_seeded_sweep_scores_test_once_per_run_and_grows_with_more_seeds(tmp_path, launch):
  """Seeds of a tiny trial, each trained without the test split and its best dev checkpoint
  scored on test once. First one seed (--config.sweep.seeds=1), then the trial's own two with
  two workers: the study takes the new seed's trial only, once (the sweep section of the config
  is no part of the sweep's identity)."""
  experiment = tmp_path / "seeded.py"
  experiment.write_text(SEEDED)
  workdir = tmp_path / "sweep"
  command = [f"--config={experiment}", f"--workdir={workdir}", "--sweep",
             "--config.sweep.metric=exact_match", "--config.sweep.test_best=True"] + FAST + LENGTH
  _run(launch, *command, "--config.sweep.seeds=1")
  # Two local workers on the journal file: the one new trial is taken by one of them, once.
  parallel = _run(launch, *command, "--sweep_parallel=2")
  out = parallel.stdout
  assert out.count(" started") == 1 and "trial_0001 started" in out, out
  assert "os.fork()" not in parallel.stderr, parallel.stderr  # JAX's warning of a forked JAX
  tests = []
  trials = _study(workdir).get_trials()
  # Both workers may ask at once; the one that finds the queue empty records a surplus trial
  # (FAIL, left out of every table) and stops.
  surplus = [t for t in trials if t.user_attrs.get("sweep_surplus")]
  assert all(t.state.name == "FAIL" and "sweep_overrides" not in t.user_attrs for t in surplus)
  trials = [t for t in trials if not t.user_attrs.get("sweep_surplus")]
  assert [t.number for t in trials] == [0, 1]
  for trial in trials:
    run = workdir / f"trial_{trial.number:04d}"
    assert trial.user_attrs["sweep_overrides"]["seed"] == trial.number
    test = trial.user_attrs["sweep_test"]
    assert test["split"] == "test" and test["step"] == trial.user_attrs["sweep_best"]["step"]
    assert [p.name for p in (run / "eval").glob("*.test.*")] == [
        f"{test['step']}.test.greedy.limit8.json"]  # test read once, at the best dev step
    records = [json.loads(line) for line in open(run / "metrics.jsonl", encoding="utf-8")]
    assert not [r for r in records if r.get("split") == "test"]  # training never read test
    tests.append(test["metrics"]["exact_match"])
  with open(workdir / "results_seeds.csv", encoding="utf-8") as f:
    (row,) = list(csv.DictReader(f))
  assert row["seeds"] == "2/2"
  assert float(row["test_exact_match_median"]) == pytest.approx(sum(tests) / 2)
  assert "## Over seeds" in (workdir / "results.md").read_text()


@pytest.fixture(scope="module")
def launch_two(launch, tmp_path_factory):
  """Two launchers: the two processes of a worker's job, process 0 on this file's launcher."""
  other = launcher.Launcher(launcher.environment(), str(tmp_path_factory.mktemp("launches1")))
  yield [launch, other]
  other.close()


def _pair(launchers, experiment, workdir, *flags) -> list:
  """Starts the two processes of one worker's job on `launchers`, as launcher.start_job does (a
  coordinator on 127.0.0.1 at a free port, one CPU device each)."""
  from tests import emulators
  port = emulators.free_port()
  env = {"XLA_FLAGS": launcher.cpu_environment(1)["XLA_FLAGS"]}
  for i, server in enumerate(launchers):
    server.start(f"--config={experiment}", f"--workdir={workdir}", "--sweep", *flags,
                 f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2",
                 f"--process_id={i}", env=env)
  return launchers


def _ended(pair, timeout: float) -> tuple:
  """(exit codes, outputs: stdout and stderr) of the processes of `pair`, process 0 first. One
  still running after `timeout` seconds is killed, with the other, and fails the test."""
  deadline = time.time() + timeout
  while any(server.running() for server in pair) and time.time() < deadline:
    time.sleep(0.1)
  late = [server.pid for server in pair if server.running()]
  if late:
    for server in pair:
      server.send(signal.SIGKILL)
  codes = [server.wait() for server in pair]
  outputs = ["".join(server.output()) for server in pair]
  assert not late, (f"a job's process ran past {timeout} s", outputs)
  return codes, outputs


def test_a_worker_of_two_processes_trains_each_trial_with_both(tmp_path, launch_two):
  experiment = tmp_path / "two.py"
  experiment.write_text(ONE.replace('[{"data.shuffle_buffer": 16}]',
                                    '[{"data.shuffle_buffer": 0}, {"data.shuffle_buffer": 16}]'))
  workdir = tmp_path / "sweep"
  codes, outputs = _ended(_pair(launch_two, experiment, workdir, "--config.sweep.pruner=median",
                                "--config.train.eval_every=1", *FAST), 400)
  assert codes == [0, 0], outputs
  # Process 1 trained both (its collectives are what process 0's steps wait for) and reported
  # nothing to the study.
  assert outputs[0].count(" finished in ") == 2 and " started" not in outputs[1], outputs
  assert [f"{t}: trained with process 0" in outputs[1] for t in ("trial_0000", "trial_0001")] \
      == [True, True], outputs[1]
  rows = _rows(workdir)
  assert [rows[t]["state"] for t in ("trial_0000", "trial_0001")] == ["finished", "finished"]
  for trial in ("trial_0000", "trial_0001"):
    with open(workdir / trial / "metrics.jsonl", encoding="utf-8") as f:
      records = [r for r in map(json.loads, f) if r["split"] == "train"]
    assert [r["step"] for r in records] == [1, 2]


def _kill_while_training(pair, workdir, victim):
  """SIGKILLs process `victim` of `pair` once trial_0000 has logged two more steps; the other's
  exit code and output."""
  metrics = workdir / "trial_0000" / "metrics.jsonl"

  def steps():
    return metrics.read_text().count('"split": "train"') if metrics.exists() else 0

  before, deadline = steps(), time.time() + 240
  while steps() < before + 2:
    if time.time() > deadline or not all(server.running() for server in pair):
      codes, outputs = _ended(pair, 0)
      raise AssertionError([output[-2000:] for output in outputs])
    time.sleep(0.2)
  pair[victim].send(signal.SIGKILL)
  pair[victim].wait()
  codes, outputs = _ended([pair[1 - victim]], 120)
  return codes[0], outputs[0]


def test_a_process_of_a_worker_killed_ends_the_other_in_one_line_and_the_trial_goes_back(
    tmp_path, launch_two):
  """Killing either process of a two-process worker ends the other in one line (before:
  process 1 aborted with some 60 lines of C++ and Python stack; process 0 failed the trial for
  good, 'not retried'). The trial is handed back and resumes."""
  experiment = tmp_path / "one.py"
  experiment.write_text(ONE)
  workdir = tmp_path / "sweep"
  # Killed between checkpoints: the other process learns it in its step's collective at once
  # (in a checkpoint's barrier it would take JAX's heartbeat timeout, 100 s).
  flags = ("--config.train.steps=100000", "--config.train.log_every=1",
           "--config.train.checkpoint_every=1000")
  noise = ("Traceback", "Check failure", "Fatal Python error", "coordination_service",
           "Gloo", "preemption")
  for victim in (0, 1):
    code, output = _kill_while_training(_pair(launch_two, experiment, workdir, *flags), workdir,
                                        victim)
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    # Exit 1, or SIGABRT where the runtime's error poller (a C++ thread) aborts the process
    # before its main thread stops it: one line either way (core/job_output.py).
    assert code in (1, -signal.SIGABRT) and len(errors) == 1, (victim, code, output)
    assert errors[0].startswith("error: another process of this job is gone (") and \
        errors[0].endswith("training resumes from the last checkpoint"), errors
    assert not [text for text in noise if text in output.replace(errors[0], "")], output
  # Process 0, left alone, handed its trial back: failed, with a copy waiting in the queue (the
  # first kill left it running, and the second worker took it up as a lost worker's).
  assert "trial_0000 goes back to the queue: another process of this job is gone" in output
  study = _study(workdir)
  retried = [t for t in study.get_trials() if t.state == optuna.trial.TrialState.WAITING]
  assert len(retried) == 1 and all(
      t.state == optuna.trial.TrialState.FAIL for t in study.get_trials() if t not in retried)
  assert not any("sweep_error" in t.user_attrs for t in study.get_trials())  # not its fault


def test_a_study_of_another_sweep_is_refused_without_a_line_in_the_journal(tmp_path):
  # create_study was tried first: the refused run appended a create_study line to the journal.
  experiment = tmp_path / "tiny_sweep.py"
  experiment.write_text("from transformer_jax.experiments.tiny import get_config, get_sweep\n")
  workdir = tmp_path / "w"
  workdir.mkdir()
  st = store.open_storage(None, str(workdir), 60, 0)
  worker.join_study(worker.plan(str(experiment), {}, worker.Options()), str(workdir), st)
  journal = (workdir / store.JOURNAL).read_bytes()
  other = worker.plan(str(experiment), {"train.steps": 3}, worker.Options())
  with pytest.raises(UserError, match="belongs to another sweep"):
    worker.join_study(other, str(workdir), st)
  assert (workdir / store.JOURNAL).read_bytes() == journal
  # The config's sweep section (budget, seeds, ...) is how the same sweep goes on: it joins.
  more = worker.plan(str(experiment), {"sweep.budget": 9, "sweep.seeds": 2}, worker.Options())
  assert worker.join_study(more, str(workdir), st).study_name == store.study_name(str(workdir))


def test_a_resumed_trial_does_not_report_again_what_its_lost_attempt_reported():
  import warnings

  import optuna
  optuna.logging.set_verbosity(optuna.logging.ERROR)
  trial = optuna.create_study().ask()
  trial.report(1.5, 10)  # the lost attempt's evaluation, inherited by its retry
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    worker._Reporter(trial, "loss", reported={10: 1.5})(10, {"loss": 1.5})
    assert not [w for w in caught if "already reported" in str(w.message)]
    worker._Reporter(trial, "loss")(10, {"loss": 1.5})  # what it did before: Optuna warned
    assert [w for w in caught if "already reported" in str(w.message)]
