"""The output of one process of a job of several (jax.distributed): without Gloo's connection
lines on stdout, and a lost peer said in one line on stderr instead of a C++ stack dump.

When another process of the job dies (killed, or its host lost), this one learns it in two
places at once: its next collective fails in the main thread (Gloo's "Connection reset by
peer" on the CPU), and the coordination service's error poller, a C++ thread, logs a fatal
error and aborts the process: some 60 lines of C++ and Python stack on stderr, exit by SIGABRT.
JAX 0.10 offers no way to handle the poller's error (`jax.distributed.initialize` takes no
callback, and the client's own callback argument aborts too: the status it passes cannot be
converted to Python). So:
- the main thread's error becomes one line (`is_peer_lost`, `stop_for_lost_peer`, called by
  the command line's top level), and the process ends at once with PEER_LOST_EXIT;
- stderr goes through a small filter process (`lost_peer_in_one_line`) that forwards every byte
  as it comes and, from the runtime's fatal report of a lost peer (or after our own line), drops
  the rest and says the one line itself. A filter thread would die with the aborted process
  before its last read; a process of its own outlives it and ends when the pipe closes.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import threading

# The exit code of a process that stops because another process of its job is gone: a fault,
# not the user's error (2). When the runtime's poller aborts first, the exit is SIGABRT's.
PEER_LOST_EXIT = 1
LOST = "another process of this job is gone"
_FIX = ("this process stops too. Start every process of the job again: training resumes from "
        "the last checkpoint")
# What JAX's errors say when the other end of a collective or the coordination service is gone.
_PEER_ERRORS = ("Gloo all-reduce failed", "Gloo AllGather failed", "Connection reset by peer",
                "coordination service", "Socket closed", "Broken pipe")
GLOO_LINE = b"[Gloo] "


def peer_lost_message(detail: str) -> str:
  """The one line (without "error: ") for a job that lost a process."""
  detail = " ".join(detail.split())[:200] or "no detail"
  return f"{LOST} (killed, or its host lost: {detail}); {_FIX}"


def is_peer_lost(error: BaseException) -> bool:
  """Whether `error`, raised in a job of several processes, says that another process is gone
  (a collective whose peer closed its connection, the coordination service unreachable)."""
  import jax
  if jax.process_count() == 1:
    return False
  while error is not None:  # JAX's error, or another library's that wraps it (orbax's syncs)
    if any(text in str(error) for text in _PEER_ERRORS):
      return True
    error = error.__cause__ or error.__context__
  return False


_drains: list = []  # what must reach the terminal before the process ends (the stdout filter)


def stop_for_lost_peer(detail: str) -> None:
  """Says `peer_lost_message(detail)` in one line on stderr and ends the process at once. Not
  through the interpreter's exit: JAX's exit handlers would wait on the lost peer's collectives,
  and the runtime's poller aborts the process when it notices the loss."""
  for drain in _drains:
    drain()
  try:
    sys.stderr.flush()
  except Exception:  # noqa: BLE001 - a closed stream has nothing to flush
    pass
  _write_all(2, f"error: {peer_lost_message(detail)}\n".encode())
  os._exit(PEER_LOST_EXIT)


def _write_all(fd: int, data: bytes) -> None:
  while data:
    data = data[os.write(fd, data):]


# The filter process of stderr: the standard library only, no site packages (it starts in a few
# milliseconds). It ignores SIGINT and SIGTERM (a Ctrl-C reaches the whole process group; the
# filter ends when the pipe closes, after the process it serves) and forwards what it reads at
# once; a piece of a line waits at most 0.1 s for its end. The runtime's warnings that the
# service is gone wait a few seconds for the fatal line that usually follows. From that line, or
# from our own, it forwards nothing more, and says the one line itself (unless ours came first).
_FILTER = r"""
import os, re, select, signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
OURS, FIX = sys.argv[1].encode(), sys.argv[2].encode()
FATAL = b"the JAX distributed service detected fatal errors"
# The runtime's warnings as it finds the service gone, before its fatal line (held: said only
# if no fatal line follows within HOLD_S), and their gRPC continuation lines.
CHATTER = re.compile(rb"^[WE]\d{4} .*(coordination_service\w*|preemption_sync_manager)\.cc"
                     rb"|^Additional GRPC error information|^:UNKNOWN:Error received from peer")
HOLD_S = 3.0

def write(data):
  while data:
    try:
      data = data[os.write(1, data):]
    except OSError:
      return

def detail(line):
  text = line.split(b"absl::Status: ", 1)[-1]
  return b" ".join(text.split(b". ", 1)[0].split())[:200]

held, chatter, since, dropping = b"", [], 0.0, False
while True:
  waiting = [t for t in (held and 0.1, chatter and since + HOLD_S - time.time()) if t]
  if waiting and not select.select([0], [], [], max(0.0, min(waiting)))[0]:
    if chatter and time.time() >= since + HOLD_S:
      write(b"".join(chatter))  # no fatal line came: it was news, not the end
      chatter = []
    if held and not chatter:
      write(held)
      held = b""
    continue
  chunk = os.read(0, 65536)
  if not chunk:
    break
  if dropping:
    continue
  lines = (held + chunk).split(b"\n")
  held = lines.pop()
  for line in lines:
    if FATAL in line:
      write(b"error: " + OURS + b" (killed, or its host lost: " + detail(line) + b"); " + FIX
            + b"\n")
      dropping = True
      break
    if line.startswith(b"error: " + OURS):
      write(line + b"\n")
      dropping = True
      break
    if CHATTER.search(line) or (chatter and line.startswith(b":")):
      since = since if chatter else time.time()
      chatter.append(line + b"\n")
    elif chatter:
      chatter.append(line + b"\n")  # kept in order behind the held lines
    else:
      write(line + b"\n")
if not dropping:
  write(b"".join(chatter) + held)
"""


def lost_peer_in_one_line() -> None:
  """Sends this process's stderr (file descriptor 2) through the filter process above; call it
  before the distributed runtime starts, so that its C++ logging goes through it too."""
  sys.stderr.flush()
  real = os.dup(2)
  try:
    filter_ = subprocess.Popen([sys.executable, "-I", "-S", "-c", _FILTER, LOST, _FIX],
                               stdin=subprocess.PIPE, stdout=real, stderr=real,
                               close_fds=True)
  except OSError:  # no filter: JAX's own report stays
    os.close(real)
    return
  os.dup2(filter_.stdin.fileno(), 2)
  filter_.stdin.close()  # fd 2 is now the pipe's only writer here
  os.close(real)


def drop_gloo_lines() -> None:
  """Gloo, the CPU's collectives between processes, prints "[Gloo] Rank N is connected to M peer
  ranks..." on stdout (C++'s std::cout, no setting quiets it) each time it connects. Here this
  process's stdout (file descriptor 1) goes through a pipe to a thread that forwards every other
  line to the real one as it comes; at exit (or `stop_for_lost_peer`) the pipe is drained."""
  sys.stdout.flush()
  real = os.dup(1)
  read, write = os.pipe()
  os.dup2(write, 1)
  os.close(write)

  def forward() -> None:
    held, at_start = b"", True  # held: the start of a line that may be Gloo's
    while True:
      chunk = os.read(read, 65536)
      if not chunk:
        break
      out = []
      for line in (held + chunk).splitlines(keepends=True):
        held = b""
        ends = line.endswith(b"\n")
        if at_start and (line.startswith(GLOO_LINE) or (
            not ends and GLOO_LINE.startswith(line))):
          if not ends:
            held = line  # decided when its end comes
          continue  # Gloo's line, dropped (also when cut short)
        out.append(line)
        at_start = ends
      _write_all(real, b"".join(out))
    if not held.startswith(GLOO_LINE):
      _write_all(real, held)
    os.close(read)

  thread = threading.Thread(target=forward, name="stdout-without-gloo", daemon=True)
  thread.start()

  def drain() -> None:
    try:
      sys.stdout.flush()
    except Exception:  # noqa: BLE001 - a closed stdout has nothing to flush
      pass
    os.dup2(real, 1)  # the pipe's last writer in this process closed: the thread ends
    thread.join(timeout=5)

  # Run at the interpreter's exit, or by `stop_for_lost_peer`, whose os._exit skips atexit:
  # never both.
  _drains.append(drain)
  atexit.register(drain)
