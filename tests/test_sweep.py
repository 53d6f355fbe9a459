"""Sweeps: grid and random search, dry run, and resuming an interrupted sweep."""

import csv
import json
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest

from transformer_jax.core import lock
from transformer_jax.core.errors import UserError
from transformer_jax.tools import sweep

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAST = ["--config.train.steps=2", "--config.train.log_every=1", "--config.train.checkpoint_every=2",
        "--config.eval.max_examples=8"]


def test_grid_is_the_cartesian_product():
  trials = sweep.grid(**{"a": [1, 2], "b.c": ["x", "y", "z"]})
  assert len(trials) == 6
  assert {(t["a"], t["b.c"]) for t in trials} == {(a, c) for a in (1, 2) for c in "xyz"}


def test_random_search_draws_from_the_space():
  trials = sweep.random_search(50, seed=1, **{"lr": ("log_uniform", 1e-4, 1e-2),
                                              "p": ("uniform", 0.0, 0.5), "n": [2, 4]})
  assert len(trials) == 50
  assert all(1e-4 <= t["lr"] <= 1e-2 and 0.0 <= t["p"] <= 0.5 and t["n"] in (2, 4)
             for t in trials)
  assert len({t["n"] for t in trials}) == 2
  assert sweep.random_search(5, seed=1, lr=("uniform", 0, 1)) == \
      sweep.random_search(5, seed=1, lr=("uniform", 0, 1))


def test_dry_run_prints_one_command_per_trial(tmp_path):
  out = subprocess.run([sys.executable, "launch.py", "--config=experiments/tiny.py",
                        f"--workdir={tmp_path}", "--sweep_dry_run", "--config.train.steps=3"],
                       cwd=ROOT, check=True, capture_output=True, text=True).stdout.splitlines()
  assert len(out) == 4
  assert all("--mode=train" in line and "--config.train.steps=3" in line for line in out)
  assert [f"trial_{i:03d}" in out[i] for i in range(4)] == [True] * 4
  assert not list(tmp_path.iterdir())  # nothing ran


def _starts(workdir):
  with open(workdir / "sweep_log.jsonl", encoding="utf-8") as f:
    return [r["trial"] for r in map(json.loads, f) if r["event"] == "start"]


# A 2 x 2 grid whose four trials run the same compiled programs (tiny.py's own grid changes the
# learning rate, a constant of the train step, and d_ff: four programs to compile); the shuffle
# buffer changes the order of the batches, so the trials' losses differ.
SHARED_PROGRAM_GRID = """from transformer_jax.experiments import tiny
from transformer_jax.tools import sweep

get_config = tiny.get_config


def get_sweep():
  return sweep.grid(**{"data.shuffle_buffer": [0, 16], "train.log_every": [1, 2]})
"""


def test_interrupted_sweep_resumes_without_redoing_finished_trials(tmp_path):
  experiment = tmp_path / "grid.py"
  experiment.write_text(SHARED_PROGRAM_GRID)
  workdir = tmp_path / "sweep"
  command = [sys.executable, "launch.py", f"--config={experiment}", f"--workdir={workdir}",
             "--sweep", "--sweep_metric=loss"] + FAST
  process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
  deadline = time.time() + 240
  finished = lambda: [i for i in range(4)
                      if (workdir / f"trial_{i:03d}" / sweep.RESULT_FILE).exists()]
  while len(finished()) < 2 and time.time() < deadline and process.poll() is None:
    time.sleep(0.2)
  process.send_signal(signal.SIGTERM)  # to the sweep alone: it passes it on to its trial
  out = process.communicate(timeout=120)[0]
  assert process.returncode == 0, out
  done_before = finished()
  assert len(done_before) >= 2, "the sweep did not finish two trials in time"
  if len(done_before) == 4:
    pytest.skip("the machine was too fast to interrupt the sweep")
  assert "SIGTERM: the sweep stopped" in out and "Traceback" not in out, out
  for i in range(4):  # no trial left running: each trial directory is free
    lock.DirectoryLock(str(workdir / f"trial_{i:03d}")).check()

  out = subprocess.run(command, cwd=ROOT, check=True, capture_output=True, text=True).stdout
  starts = _starts(workdir)
  for i in done_before:
    assert starts.count(i) == 1, f"finished trial {i} ran again"
  assert sorted(set(starts)) == [0, 1, 2, 3]
  with open(workdir / "results.csv", encoding="utf-8") as f:
    rows = list(csv.DictReader(f))
  assert sorted(r["trial"] for r in rows) == [f"trial_{i:03d}" for i in range(4)]
  assert all(r["status"] == "done" for r in rows)
  losses = [float(r["loss"]) for r in rows]
  assert losses == sorted(losses)  # best (lowest) first
  assert {(int(r["data.shuffle_buffer"]), int(r["train.log_every"])) for r in rows} == \
      {(buffer, every) for buffer in (0, 16) for every in (1, 2)}
  table = (workdir / "results.md").read_text()
  assert table.count("| trial_") == 4
  # The table names what it ranks: the metric and the split of the trials' final evaluation
  # (tiny's data.eval_split), and the sweep prints it at the end.
  assert table.startswith("# Sweep results: loss on split 'test', best first\n"), table[:200]
  assert table in out and out.rstrip().endswith("results.csv"), out[-2000:]
  # Each trial's overrides and final metrics, for TensorBoard's HParams view.
  from tensorboardX.proto.event_pb2 import Event
  for i, row in enumerate(sorted(rows, key=lambda r: r["trial"])):
    plugins, scalars = set(), {}
    for path in (workdir / f"trial_{i:03d}" / "tensorboard").glob("events.out.tfevents.*"):
      data, offset = path.read_bytes(), 0
      while offset < len(data):
        length = int.from_bytes(data[offset:offset + 8], "little")
        event = Event.FromString(data[offset + 12:offset + 12 + length])
        offset += 16 + length
        for value in event.summary.value:
          plugins.add(value.metadata.plugin_data.plugin_name)
          if value.tag.startswith("final/"):
            scalars[value.tag] = value.simple_value
          if value.metadata.plugin_data.plugin_name == "hparams" and b"train.log_every" in \
              value.metadata.plugin_data.content:
            assert b"data.shuffle_buffer" in value.metadata.plugin_data.content
    assert "hparams" in plugins, i
    assert scalars["final/loss"] == pytest.approx(float(row["loss"]), rel=1e-5)


def test_changed_sweep_in_the_same_workdir_is_refused(tmp_path):
  (tmp_path / "trial_000").mkdir()
  (tmp_path / "trial_000" / "trial.json").write_text(json.dumps({"overrides": {"x": 1}}))
  result = subprocess.run([sys.executable, "launch.py", "--config=experiments/tiny.py",
                           f"--workdir={tmp_path}", "--sweep"] + FAST, cwd=ROOT,
                          capture_output=True, text=True)
  assert result.returncode == 2
  assert "use a new --workdir" in result.stderr and "Traceback" not in result.stderr


def test_sweep_bar_counts_every_trials_steps_from_their_metrics(tmp_path, monkeypatch, capsys):
  monkeypatch.setenv("TRANSFORMER_JAX_PROGRESS", "1")
  configs = [sweep.trial_config("experiments/tiny.py", {"train.steps": n}, {}) for n in (10, 20)]
  trial = tmp_path / "trial_001"
  trial.mkdir()
  with open(trial / "metrics.jsonl", "w", encoding="utf-8") as f:
    f.write(json.dumps({"split": "train", "step": 5, "loss": 2.5}) + "\n")
    f.write(json.dumps({"split": "val", "step": 5, "loss": 9.0}) + "\n")
    f.write('{"split": "train", "step": 7, "lo')  # a line being written
  with sweep._Progress(str(tmp_path), configs, done=[0]) as watch:
    watch.update({1: None})
    assert (watch._bar.n, watch._bar.total) == (10 + 5, 30)
    drawn = capsys.readouterr().err
  assert "trial_001 5/20 loss 2.500" in drawn and "sweep" in drawn
  assert sweep._last_train_record(str(tmp_path / "absent.jsonl")) == {}


# ----------------------------------------------------------------------------- seeds


def test_seeds_per_trial_by_entry_or_flag():
  trials = [{"a": 1, "seeds": 3}, {"a": 2}]
  assert sweep.seed_counts(trials) == [3, None]
  assert sweep.seed_counts(trials, seeds=2) == [2, 2]  # the flag wins over the entries
  configs = [sweep.trial_config("experiments/tiny.py", {"seed": s}, {}) for s in (7, 0)]
  runs = sweep.expand_runs([{"a": 1}, {"a": 2}], configs, [3, None])
  assert [r.name for r in runs] == ["trial_000_seed7", "trial_000_seed8", "trial_000_seed9",
                                    "trial_001"]
  assert [r.overrides for r in runs] == [{"a": 1, "seed": 7}, {"a": 1, "seed": 8},
                                         {"a": 1, "seed": 9}, {"a": 2}]
  for bad, why in (([{"seeds": 0}], "positive"), ([{"seeds": "5"}], "positive"),
                   ([{"seeds": 2, "seed": 1}], "leave out one")):
    with pytest.raises(UserError, match=why):
      sweep.seed_counts(bad)
  with pytest.raises(UserError, match="sweep_seeds"):
    sweep.seed_counts(trials, seeds=-1)


def test_dry_run_with_seeds_names_each_run_by_trial_and_seed(tmp_path):
  out = subprocess.run([sys.executable, "launch.py", "--config=experiments/tiny.py",
                        f"--workdir={tmp_path}", "--sweep_dry_run", "--sweep_seeds=2",
                        "--sweep_test_best"],
                       cwd=ROOT, check=True, capture_output=True, text=True).stdout.splitlines()
  assert len(out) == 8
  for i, line in enumerate(out):
    assert f"trial_{i // 2:03d}_seed{i % 2} " in line and f"--config.seed={i % 2}" in line
    assert line.endswith("--config.data.test_split=")  # trained without the test split
  assert not list(tmp_path.iterdir())


def test_dry_run_with_chosen_trials_keeps_their_numbers_and_order(tmp_path):
  out = subprocess.run([sys.executable, "launch.py", "--config=experiments/tiny.py",
                        f"--workdir={tmp_path}", "--sweep_dry_run", "--sweep_seeds=2",
                        "--sweep_trials=3,1"],
                       cwd=ROOT, check=True, capture_output=True, text=True).stdout.splitlines()
  names = [line.split("--workdir=")[1].split()[0].rsplit("/", 1)[1] for line in out]
  assert names == ["trial_003_seed0", "trial_003_seed1", "trial_001_seed0", "trial_001_seed1"]
  everything = subprocess.run([sys.executable, "launch.py", "--config=experiments/tiny.py",
                               f"--workdir={tmp_path}", "--sweep_dry_run", "--sweep_seeds=2"],
                              cwd=ROOT, check=True, capture_output=True,
                              text=True).stdout.splitlines()
  assert out == everything[6:8] + everything[2:4]  # the same commands as in the whole sweep


# Two trials of the same compiled programs (see SHARED_PROGRAM_GRID).
TWO_TRIALS = """from transformer_jax.experiments import tiny

get_config = tiny.get_config


def get_sweep():
  return [{"data.shuffle_buffer": 0}, {"data.shuffle_buffer": 16}]
"""


def test_chosen_trials_run_alone_and_the_table_keeps_the_others(tmp_path):
  """--sweep_trials=1 runs trial 1 only (trial 0 gets no directory); a later --sweep_trials=0
  runs trial 0 and leaves trial 1 finished, and the table lists both. (Two tiny runs.)"""
  experiment = tmp_path / "two.py"
  experiment.write_text(TWO_TRIALS)
  workdir = tmp_path / "sweep"
  command = [sys.executable, "launch.py", f"--config={experiment}", f"--workdir={workdir}",
             "--sweep", "--sweep_metric=loss"] + FAST
  out = subprocess.run(command + ["--sweep_trials=1"], cwd=ROOT, check=True,
                       capture_output=True, text=True).stdout
  assert "--sweep_trials chose 1 runs" in out
  assert sorted(p.name for p in workdir.iterdir() if p.name.startswith("trial_")) == \
      ["trial_001"]
  out = subprocess.run(command + ["--sweep_trials=0"], cwd=ROOT, check=True,
                       capture_output=True, text=True).stdout
  assert "0 of the chosen already finished (and 1 of the others), running 1" in out
  assert _starts(workdir) == [1, 0]
  with open(workdir / "results.csv", encoding="utf-8") as f:
    rows = list(csv.DictReader(f))
  assert sorted(r["trial"] for r in rows) == ["trial_000", "trial_001"]
  assert all(r["status"] == "done" for r in rows)


def _result(loss, best_em, test_em, status="done"):
  return {"status": status, "metrics": {"loss": loss, "exact_match": best_em / 2},
          "best": {"metric": "exact_match", "step": 2, "metrics": {"exact_match": best_em}},
          "test": {"split": "test", "step": 2, "metrics": {"exact_match": test_em}},
          "best_step": 2, "wall_time_s": 1.0}


def test_results_over_seeds_are_median_min_and_max(tmp_path):
  runs = sweep.expand_runs([{"x": 1}, {"x": 2}], [SimpleNamespace(seed=0)] * 2, [3, 3])
  values = {"trial_000": [(0.5, 0.2, 0.1), (0.4, 0.6, 0.3), (0.3, 0.4, 0.0)],
            "trial_001": [(0.9, 0.9, 0.05), (0.8, 0.7, 0.5)]}  # its third seed failed
  results = {}
  for run in runs:
    name = f"trial_{run.trial:03d}"
    if run.seed < len(values[name]):
      results[run.name] = _result(*values[name][run.seed])
    else:
      results[run.name] = {"status": "failed (exit 1)", "wall_time_s": 1.0}
  _, md_path, text = sweep.write_results(str(tmp_path), runs, results, "exact_match", "dev")
  with open(tmp_path / "results_seeds.csv", encoding="utf-8") as f:
    rows = list(csv.DictReader(f))
  assert [r["trial"] for r in rows] == ["trial_001", "trial_000"]  # by median best dev EM
  assert [r["seeds"] for r in rows] == ["2/3", "3/3"]
  for row in rows:
    got = np.array(values[row["trial"]])
    for column, k in (("best_exact_match", 1), ("test_exact_match", 2)):
      assert float(row[f"{column}_median"]) == pytest.approx(np.median(got[:, k]))
      assert float(row[f"{column}_min"]) == pytest.approx(got[:, k].min())
      assert float(row[f"{column}_max"]) == pytest.approx(got[:, k].max())
    assert float(row["final_exact_match_median"]) == pytest.approx(np.median(got[:, 1] / 2))
  assert "| trial_000 | 3/3 | 1 | 0.4 [0.2, 0.6] |" in text
  with open(tmp_path / "results.csv", encoding="utf-8") as f:
    per_run = list(csv.DictReader(f))
  assert len(per_run) == 6 and {r["seed"] for r in per_run} == {"0", "1", "2"}
  assert open(md_path, encoding="utf-8").read() == text


SEEDED = """from transformer_jax.experiments import tiny

get_config = tiny.get_config


def get_sweep():
  return [{"train.learning_rate": 1e-3, "seeds": 2}]
"""
LENGTH = ["--config.data.scan_split=length", "--config.data.train_split=train_without_dev",
          "--config.data.eval_split=dev", "--config.data.test_split=test",
          "--config.train.keep_best=1", "--config.train.eval_every=1"]


def test_seeded_sweep_scores_test_once_per_run_and_resumes_with_more_seeds(tmp_path):
  """Seeds of a tiny trial, each trained without the test split and its best dev checkpoint
  scored on test once. First one seed (--sweep_seeds=1), then the trial's own two: the second
  sweep resumes, running only the new seed. (Two runs in all: about a minute of CPU.)"""
  experiment = tmp_path / "seeded.py"
  experiment.write_text(SEEDED)
  workdir = tmp_path / "sweep"
  command = [sys.executable, "launch.py", f"--config={experiment}", f"--workdir={workdir}",
             "--sweep", "--sweep_metric=exact_match", "--sweep_test_best"] + FAST + LENGTH
  subprocess.run(command + ["--sweep_seeds=1"], cwd=ROOT, check=True, capture_output=True,
                 text=True)
  out = subprocess.run(command, cwd=ROOT, check=True, capture_output=True, text=True).stdout
  assert "1 trials in 2 runs (seeds), 1 already finished, running 1" in out
  with open(workdir / "sweep_log.jsonl", encoding="utf-8") as f:
    starts = [r["run"] for r in map(json.loads, f) if r["event"] == "start"]
  assert sorted(starts) == ["trial_000_seed0", "trial_000_seed1"]
  tests = []
  for seed in range(2):
    run = workdir / f"trial_000_seed{seed}"
    result = json.loads((run / sweep.RESULT_FILE).read_text())
    assert result["overrides"]["seed"] == seed and result["test"]["split"] == "test"
    step = result["best"]["step"]
    assert result["test"]["step"] == step
    assert [p.name for p in (run / "eval").glob("*.test.*")] == [
        f"{step}.test.greedy.limit8.json"]  # test read once, at the best dev step
    records = [json.loads(line) for line in open(run / "metrics.jsonl", encoding="utf-8")]
    assert not [r for r in records if r.get("split") == "test"]  # training never read test
    tests.append(result["test"]["metrics"]["exact_match"])
  with open(workdir / "results_seeds.csv", encoding="utf-8") as f:
    (row,) = list(csv.DictReader(f))
  assert row["seeds"] == "2/2"
  assert float(row["test_exact_match_median"]) == pytest.approx(float(np.median(tests)))
  assert "## Over seeds" in (workdir / "results.md").read_text()
