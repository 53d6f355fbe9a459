"""Files that survive faults (core/files.py, core/jsonlog.py, core/lock.py), with the faults
injected in-process: a full disk in the middle of a write, a cut-off or damaged log line, a second
writer, a writer killed with its lock held."""

import errno
import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from transformer_jax.core import files, jsonlog, lock
from transformer_jax.core.errors import UserError
from transformer_jax.train import logger


def full_disk_after(monkeypatch, allowed: int):
  """os.write writes at most `allowed` more bytes in all, then fails with ENOSPC."""
  real_write = os.write
  left = {"bytes": allowed}

  def write(fd, data):
    if left["bytes"] <= 0:
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    n = real_write(fd, bytes(data[:left["bytes"]]))
    left["bytes"] -= n
    return n

  monkeypatch.setattr(os, "write", write)


def test_a_full_disk_in_the_middle_of_a_record_takes_the_part_back(tmp_path, monkeypatch):
  path = str(tmp_path / "metrics.jsonl")
  log = jsonlog.JsonLog(path)
  log.append({"step": 1, "loss": 2.5})
  before = open(path, "rb").read()
  full_disk_after(monkeypatch, 7)  # 7 bytes of the next line reach the file, then ENOSPC
  with pytest.raises(UserError, match=r"cannot write .*metrics.jsonl: no space left on its file "
                                      r"system, [\d.]+ \w+ free"):
    log.append({"step": 2, "loss": 2.25})
  monkeypatch.undo()
  assert open(path, "rb").read() == before  # the partial line was taken back
  log.append({"step": 2, "loss": 2.25})  # the disk has room again: nothing glued
  log.close()
  assert [r["step"] for r in jsonlog.read_jsonl(path)] == [1, 2]


def test_a_cut_off_last_line_is_set_aside_by_the_next_writer_and_skipped_by_readers(
    tmp_path, capsys):
  path = tmp_path / "metrics.jsonl"
  lines = [json.dumps({"split": "train", "step": s, "loss": 1.0 / s}) for s in (1, 2, 3)]
  damaged = lines[1][:10] + "\x00\xff" + lines[1][12:]  # bytes changed in the middle of a line
  path.write_bytes("\n".join([lines[0], damaged, lines[2]]).encode("utf-8", "surrogateescape")
                   + b"\n" + b'{"split": "train", "st')  # and a write cut off at the end

  records = logger.read_metrics(str(tmp_path))
  assert [r["step"] for r in records] == [1, 3]
  warning = capsys.readouterr().err.strip().splitlines()
  assert len(warning) == 1 and "skipped 2 unreadable line(s)" in warning[0]
  assert "(line 2, 4)" in warning[0]

  log = jsonlog.JsonLog(str(path))  # the next writer
  log.append({"split": "train", "step": 4, "loss": 0.25})
  log.close()
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "set it aside in metrics.jsonl.partial" in err[0]
  assert (tmp_path / "metrics.jsonl.partial").read_bytes() == b'{"split": "train", "st\n'
  assert path.read_bytes().endswith(lines[2].encode() + b"\n" + json.dumps(
      {"split": "train", "step": 4, "loss": 0.25}).encode() + b"\n")


def test_readers_keep_the_last_record_of_a_step_that_was_run_again(tmp_path):
  records = [{"split": "train", "step": 1, "loss": 3.0}, {"split": "train", "step": 2, "loss": 9.0},
             {"split": "eval", "step": 2, "loss": 9.5}, {"split": "train", "step": 3, "loss": 8.0},
             # a resume from the checkpoint of step 1 logs steps 2 and 3 again
             {"split": "train", "step": 2, "loss": 2.0}, {"split": "train", "step": 3, "loss": 1.0}]
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
  got = logger.read_metrics(str(tmp_path))
  assert [(r["split"], r["step"], r["loss"]) for r in got] == [
      ("train", 1, 3.0), ("eval", 2, 9.5), ("train", 2, 2.0), ("train", 3, 1.0)]


def test_a_resumed_logger_drops_the_records_after_its_checkpoint(tmp_path):
  path = tmp_path / "metrics.jsonl"
  path.write_text("".join(json.dumps({"split": "train", "step": s}) + "\n" for s in range(1, 6)))
  metric_logger = logger.MetricLogger(str(tmp_path), total_steps=10, start_step=3)
  metric_logger.close()
  assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3]


def test_a_failed_atomic_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path, monkeypatch):
  path = tmp_path / "config.json"
  path.write_text("old")
  def fsync(fd):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

  monkeypatch.setattr(os, "fsync", fsync)
  with pytest.raises(UserError, match="config.json: no space left"):
    files.atomic_write(str(path), "new")
  assert path.read_text() == "old" and os.listdir(tmp_path) == ["config.json"]


@pytest.mark.parametrize("code,text", [(errno.EROFS, "the file system is read-only"),
                                       (errno.EACCES, "permission denied"),
                                       (errno.EDQUOT, "no space left")])
def test_write_errors_name_the_path_and_the_cause(code, text):
  message = str(files.write_error("/some/run/eval/8.json", OSError(code, os.strerror(code)),
                                  "the metrics are printed above"))
  assert message.startswith("cannot write /some/run/eval/8.json: " + text)
  assert "the metrics are printed above" in message and "\n" not in message


def test_a_second_writer_is_refused_with_the_holder_named(tmp_path):
  first = lock.DirectoryLock(str(tmp_path))
  first.acquire()
  holder = f"pid {os.getpid()} on host {socket.gethostname()}"
  with pytest.raises(UserError, match=f"is in use by {holder}"):
    lock.DirectoryLock(str(tmp_path)).acquire()
  with pytest.raises(UserError, match=f"is in use by {holder}"):
    lock.DirectoryLock(str(tmp_path)).check()  # the early check, which writes nothing
  with first:  # released at the end of the block
    pass
  second = lock.DirectoryLock(str(tmp_path))
  second.acquire()  # a clean end: no warning
  second.release()
  assert (tmp_path / lock.FILENAME).read_text() == ""


def test_the_lock_of_a_killed_writer_is_taken_over(tmp_path, capfd):
  code = ("import time; from transformer_jax.core import lock; "
          f"held = lock.DirectoryLock({str(tmp_path)!r}); held.acquire(); "
          "print('held', flush=True); time.sleep(60)")
  holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
  try:
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(UserError, match=f"in use by pid {holder.pid} "):
      lock.DirectoryLock(str(tmp_path)).acquire()
  finally:
    holder.send_signal(signal.SIGKILL)
    holder.wait()
  capfd.readouterr()
  taken = lock.DirectoryLock(str(tmp_path))
  taken.acquire()
  err = capfd.readouterr().err
  assert f"(pid {holder.pid} on host" in err and "did not end cleanly" in err
  assert json.loads((tmp_path / lock.FILENAME).read_text())["pid"] == os.getpid()
  taken.release()


def test_a_file_that_is_not_a_regular_file_is_named_for_what_it_is(tmp_path):
  os.mkfifo(tmp_path / "fifo")
  (tmp_path / "dir").mkdir()
  os.symlink("/dev/null", tmp_path / "null")
  os.symlink(tmp_path / "nowhere", tmp_path / "dangling")
  expected = {"fifo": "is a named pipe", "dir": "is a directory", "null": "is a character device",
              "dangling": "is a broken symbolic link", "absent": "does not exist"}
  for name, text in expected.items():
    with pytest.raises(UserError, match=f"{name} {text}.*; fix it"):
      files.check_readable(str(tmp_path / name), "fix it")


def test_free_space_is_read_from_the_nearest_existing_parent(tmp_path):
  free = files.free_space(str(tmp_path / "not" / "yet" / "there"))
  assert free is not None and abs(free - files.free_space(str(tmp_path))) < 1 << 30
