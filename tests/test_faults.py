"""Faults lose nothing: a second trainer on the same workdir, a full disk at each kind of write,
a read-only workdir. (kill -9 inside checkpoint saves, SIGTERM in the final evaluation and a
damaged metrics.jsonl: test_checkpoint.py.)

The runs are launch.py processes forked by tests/launcher.py on the tiny config of
test_checkpoint.py. The full disks are small tmpfs mounts in a mount namespace of the launcher's
own (where the machine allows one: as root, or with unprivileged user namespaces); the writes
themselves are also tested with an injected ENOSPC in test_files.py.
"""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
from launcher import ROOT, Launcher, environment, namespaces_work
from test_checkpoint import (
  RUN,
  STEPS,
  assert_same_state,
  last_logged_step,
  logged_steps,
  reference_run,
  restore_latest,
)


@pytest.fixture(scope="module")
def cache_dir(request, tmp_path_factory):
  cache = getattr(request.config, "cache", None)
  return cache.mkdir("jax_compilation_cache") if cache else tmp_path_factory.mktemp("jax")


@pytest.fixture(scope="module")
def launcher(cache_dir, tmp_path_factory):
  """The runs' launcher: in a mount namespace of its own where the machine allows one (the full
  disks below need it), else a plain one."""
  server = Launcher(environment(cache_dir), str(tmp_path_factory.mktemp("launches")),
                    namespace=namespaces_work())
  yield server
  server.close()


@pytest.fixture(scope="module")
def reference(launcher, shared_directory):
  """An uninterrupted run of STEPS steps: test_checkpoint.py's, trained once per session."""
  return reference_run(launcher, shared_directory)


def one_error(err: str) -> str:
  """The one line of stderr, which must be an error line; no traceback anywhere."""
  lines = err.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
  return lines[0]


# ----------------------------------------------------------------------------- a second writer


def test_a_second_trainer_is_refused_and_the_first_loses_nothing(tmp_path, launcher):
  workdir = tmp_path / "run"
  long_run = ["--config.train.steps=5000", "--config.train.checkpoint_every=1000"]
  pid = launcher.start(*RUN, f"--workdir={workdir}", *long_run)
  launcher.wait_for(lambda out: last_logged_step(out) >= 2)
  # The same command again (a double-submitted job), from a process of its own. The first is
  # paused meanwhile (alive, holding its lock) so that its steps do not take the CPU the second
  # needs to start; it goes on afterwards.
  launcher.send(signal.SIGSTOP)
  paused_at = last_logged_step(launcher.output()[0])
  try:
    second = subprocess.run([sys.executable, "launch.py", *RUN, f"--workdir={workdir}",
                             *long_run], cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"),
                            capture_output=True, text=True, timeout=120)
  finally:
    launcher.send(signal.SIGCONT)
  assert launcher.wait_for(lambda out: last_logged_step(out) > paused_at)  # training again
  assert second.returncode == 2, second.stdout + second.stderr
  line = one_error(second.stderr)
  assert f"is in use by pid {pid} on host {socket.gethostname()}" in line, line
  assert second.stdout == ""
  launcher.send(signal.SIGTERM)
  assert launcher.wait() == 0, launcher.output()
  steps = logged_steps(workdir)
  assert steps == list(range(1, len(steps) + 1))  # one run's records, none twice
  assert (workdir / "lock").read_text() == ""  # released at a clean end


def test_a_second_ctrl_c_stops_at_once_in_one_line(tmp_path, launcher):
  """Ctrl-C twice, the second while the checkpoint of the first is being saved (RUN saves every
  step): one line, no tracebacks from the save threads it cuts off. (That the next run ignores a
  checkpoint cut off: test_checkpoint's kills inside saves.)"""
  launcher.start(*RUN, f"--workdir={tmp_path / 'run'}", "--config.train.steps=5000")
  launcher.wait_for(lambda out: last_logged_step(out) >= 2)
  launcher.send(signal.SIGINT)
  time.sleep(0.2)  # two signals before Python runs its handler count as one
  launcher.send(signal.SIGINT)
  assert launcher.wait() == 130, launcher.output()
  out, err = launcher.output()
  assert "Traceback" not in err and "Exception ignored" not in err, err
  interrupted = [line for line in err.splitlines() if not re.match(r"[IWE]\d{4} ", line)]
  assert len(interrupted) == 1 and interrupted[0].startswith("interrupted (a second Ctrl-C"), err
  # The start-up line names the tokenizer's size and the model's apart (RUN: both 23).
  assert "tokenizer of 23 pieces (of the model's 23 embedding rows)" in out, out


# ----------------------------------------------------------------------------- a full disk


@pytest.fixture(scope="module")
def disk(launcher):
  """The launcher, where it can mount small file systems."""
  if not launcher.namespace:
    pytest.skip("this machine allows no mount namespace for a tmpfs; test_files.py injects the "
                "full disk instead")
  return launcher


def tmpfs(disk, path, size: int) -> None:
  """Mounts a tmpfs of `size` bytes at `path` (inside the launcher's namespace)."""
  os.makedirs(path, exist_ok=True)
  disk.shell(f"mount -t tmpfs -o size={size} tmpfs {path}")


def move_to_a_larger_disk(disk, path) -> None:
  """What a user does after a full disk: the directory's files, moved where there is room."""
  keep = f"{path}.moved"
  shutil.copytree(disk.outside(path), keep, symlinks=True)
  disk.shell(f"umount {path}")
  shutil.rmtree(path)
  os.rename(keep, path)


def full_disk_error(line: str, path) -> None:
  assert re.search(rf"cannot write {re.escape(str(path))}\S*: no space left on its file system, "
                   r"[\d.]+ (bytes|KiB) free", line), line


def test_a_full_disk_at_a_checkpoint_keeps_the_last_one_and_resumes_exactly(
    tmp_path, disk, reference):
  workdir = tmp_path / "run"
  size = sum(os.path.getsize(os.path.join(r, n))
             for r, _, names in os.walk(reference / "checkpoints" / str(STEPS)) for n in names)
  tmpfs(disk, workdir / "checkpoints", int(size * 1.5))  # room for the first checkpoint only
  run = [*RUN, f"--workdir={workdir}", "--config.train.checkpoint_every=4"]
  code, out, err = disk.run(*run)
  assert code == 2, out + err
  line = one_error(err)
  full_disk_error(line, workdir / "checkpoints")
  assert "the checkpoints written before (steps [4]) are intact" in line

  move_to_a_larger_disk(disk, workdir / "checkpoints")
  code, out, err = disk.run(*run)
  assert code == 0, out + err
  assert "resuming from step 4" in out
  assert_same_state(restore_latest(workdir).state, restore_latest(reference).state)
  assert logged_steps(workdir) == list(range(1, STEPS + 1))


def test_a_full_disk_at_the_logs_and_the_tokenizer_loses_nothing(tmp_path, disk, reference):
  more = [f"--config.train.steps={STEPS + 30}", "--config.train.checkpoint_every=1000"]

  # metrics.jsonl: its last page fills up at some step of the resumed run.
  workdir = tmp_path / "metrics"
  shutil.copytree(reference, workdir)
  page = tmp_path / "page"
  # One page more than the file takes: room for a few records, not for 30 steps of them.
  tmpfs(disk, page, ((workdir / "metrics.jsonl").stat().st_size // 4096 + 2) * 4096)
  shutil.copy(workdir / "metrics.jsonl", disk.outside(page / "metrics.jsonl"))
  disk.shell(f"mount --bind {page}/metrics.jsonl {workdir}/metrics.jsonl")
  code, out, err = disk.run(*RUN, f"--workdir={workdir}", *more)
  assert code == 2, out + err
  full_disk_error(one_error(err), workdir / "metrics.jsonl")
  stopped_at = last_logged_step(out) + 1
  assert logged_steps(disk.outside(workdir)) == list(range(1, stopped_at))  # whole records
  shutil.copy(disk.outside(page / "metrics.jsonl"), tmp_path / "moved.jsonl")
  disk.shell(f"umount {workdir}/metrics.jsonl")
  shutil.copy(tmp_path / "moved.jsonl", workdir / "metrics.jsonl")
  code, out, err = disk.run(*RUN, f"--workdir={workdir}", *more)
  assert code == 0 and "Traceback" not in err, out + err
  assert logged_steps(workdir) == list(range(1, STEPS + 31))  # re-run steps counted once
  code, out, err = disk.run(*RUN, f"--workdir={workdir}", "--mode=plot")
  assert code == 0 and err == "", err
  assert all(valid_events(workdir / "tensorboard" / n) for n in os.listdir(
      workdir / "tensorboard"))

  # TensorBoard: two pages for the events of the resumed run.
  workdir = tmp_path / "events"
  shutil.copytree(reference, workdir)
  tmpfs(disk, workdir / "tensorboard", 8192)
  code, out, err = disk.run(*RUN, f"--workdir={workdir}", *more)
  assert code == 2, out + err
  full_disk_error(one_error(err), workdir / "tensorboard" / "events.out.tfevents.")
  [events] = os.listdir(disk.outside(workdir / "tensorboard"))
  assert valid_events(disk.outside(workdir / "tensorboard" / events))  # whole records only
  disk.shell(f"umount {workdir}/tensorboard")

  # The tokenizer of a new run: the disk has one page, which the workdir's lock takes.
  workdir = tmp_path / "fresh"
  tmpfs(disk, workdir, 8192)
  code, out, err = disk.run(*RUN, f"--workdir={workdir}")
  assert code == 2, out + err
  full_disk_error(one_error(err), workdir / "tokenizer.model")
  assert os.listdir(disk.outside(workdir)) == ["lock"]  # no half-written file


def valid_events(path) -> int:
  """The records of a TensorBoard event file, each checked against its CRCs (TFRecord framing);
  0 if any is damaged."""
  from tensorboardX.proto.event_pb2 import Event
  from tensorboardX.record_writer import masked_crc32c
  data, offset, count = open(path, "rb").read(), 0, 0
  while offset < len(data):
    length = int.from_bytes(data[offset:offset + 8], "little")
    header_crc = int.from_bytes(data[offset + 8:offset + 12], "little")
    body = data[offset + 12:offset + 12 + length]
    body_crc = int.from_bytes(data[offset + 12 + length:offset + 16 + length], "little")
    if header_crc != masked_crc32c(data[offset:offset + 8]) or body_crc != masked_crc32c(body):
      return 0
    Event.FromString(body)
    offset, count = offset + 16 + length, count + 1
  return count


def test_evaluate_prints_its_metrics_before_a_write_fails_and_export_says_so(tmp_path, disk,
                                                                            reference):
  workdir = tmp_path / "run"
  shutil.copytree(reference, workdir)
  evaluate = [*RUN, f"--workdir={workdir}", "--mode=evaluate"]
  tmpfs(disk, workdir / "eval", 4096)
  disk.shell(f"head -c 4096 /dev/zero > {workdir}/eval/filler || true")  # now full
  code, out, err = disk.run(*evaluate)
  assert code == 2, out + err
  full_disk_error(one_error(err), workdir / "eval" / f"{STEPS}.test.greedy.limit8.json")
  assert "the metrics are the JSON line printed above" in err
  assert json.loads(out.strip().splitlines()[-1])["step"] == STEPS
  # export's stdout on the full disk
  code, out, err = disk.run(*RUN, "--mode=export", stdout=f"{workdir}/eval/export.tsv")
  assert code == 2, out + err
  full_disk_error(one_error(err), f"standard output ({workdir}/eval/export.tsv)")
  disk.shell(f"umount {workdir}/eval")

  disk.shell(f"mount --bind {workdir} {workdir} && mount -o remount,bind,ro {workdir}")
  before = sorted(os.listdir(workdir))
  code, out, err = disk.run(*evaluate)
  assert code == 2 and json.loads(out.strip().splitlines()[-1])["step"] == STEPS, out + err
  assert "the file system is read-only" in one_error(err)
  code, out, err = disk.run(*RUN, f"--workdir={workdir}", "--mode=plot")
  assert code == 2 and "read-only" in one_error(err), out + err
  code, out, err = disk.run(*RUN, f"--workdir={workdir}", f"--config.train.steps={STEPS + 1}")
  assert code == 2 and "is not writable" in one_error(err), out + err
  disk.shell(f"umount {workdir}")
  assert sorted(os.listdir(workdir)) == before
