"""Sweeps: grid and random search, dry run, and resuming an interrupted sweep."""

import csv
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from transformer_jax.core import lock
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


def test_interrupted_sweep_resumes_without_redoing_finished_trials(tmp_path):
  workdir = tmp_path / "sweep"
  command = [sys.executable, "launch.py", "--config=experiments/tiny.py", f"--workdir={workdir}",
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
  assert {(float(r["train.learning_rate"]), int(r["model.d_ff"])) for r in rows} == \
      {(lr, d) for lr in (1e-3, 3e-3) for d in (32, 64)}
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
          if value.metadata.plugin_data.plugin_name == "hparams" and b"d_ff" in \
              value.metadata.plugin_data.content:
            assert b"train.learning_rate" in value.metadata.plugin_data.content
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
