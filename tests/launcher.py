"""Runs `launch.py` many times without paying its imports each time (test helper).

A server process imports launch.py and the library once (no JAX backend is started there), then
forks one child per command; each child runs exactly what `python launch.py FLAGS...` runs:
absl parses the flags, `launch.main` runs, and the child exits through the normal interpreter
shutdown with launch.py's exit code. The children are real processes, so tests can SIGKILL or
SIGTERM them.
"""

import json
import os
import pathlib
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SERVER = r"""
import gc, importlib, json, os, subprocess, sys
gc.disable()  # with gc.freeze() before each fork: the children's collections leave the parent's
              # objects alone, so they neither copy its memory nor spend seconds exiting
preload, sys.argv = sys.argv[1:], ["transformer-jax"]  # (Launcher's preload)
from absl import app
from transformer_jax import cli, run  # the heavy imports, done once
from transformer_jax.tools import sweep
from transformer_jax.eval import evaluate, translate
for name in preload:  # more modules the runs import
  importlib.import_module(name)

def child(command):
  os.dup2(os.open(command.get("stdin") or os.devnull, os.O_RDONLY), 0)
  for fd, path in ((1, command["stdout"]), (2, command["stderr"])):
    os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644), fd)
  if command.get("cwd"):
    os.chdir(command["cwd"])
  if command.get("user") is not None and os.geteuid() == 0:
    os.setgroups([])
    os.setgid(command["user"])
    os.setuid(command["user"])
  os.environ.update(command.get("env") or {})
  sys.argv = ["transformer-jax", *command["flags"]]  # ml_collections reads sys.argv
  app.run(cli._main, flags_parser=cli._parse_flags)

for line in sys.stdin:
  command = json.loads(line)
  if "shell" in command:  # a command of the test's own (mount, umount) in the server's namespaces
    done = subprocess.run(command["shell"], shell=True, capture_output=True, text=True)
    print(json.dumps({"code": done.returncode, "output": done.stdout + done.stderr}), flush=True)
    continue
  sys.stdout.flush()
  gc.freeze()
  pid = os.fork()
  if pid == 0:
    gc.enable()
    child(command)  # ends in sys.exit: the interpreter shuts down normally, atexit and all
    sys.exit(0)
  print(json.dumps({"pid": pid}), flush=True)
  _, status = os.waitpid(pid, 0)
  print(json.dumps({"code": os.waitstatus_to_exitcode(status)}), flush=True)
"""


# `python -c SCRIPT_RUNNER SCRIPT ARGS...` runs a test's Python script as `python -c SCRIPT ARGS...`
# would (sys.argv[1:] are ARGS), from core/datastack.py's roomy frame, as launched runs are.
SCRIPT_RUNNER = ("import sys; from transformer_jax.core import datastack; "
                 "script = sys.argv.pop(1); code = compile(script, '<script>', 'exec'); "
                 "datastack.call(exec, code, {'__name__': '__main__'})")


def script_command(script: str, *args) -> list:
  """The command line that runs the Python source `script` with `args` (SCRIPT_RUNNER)."""
  return [sys.executable, "-c", SCRIPT_RUNNER, script, *map(str, args)]


def environment(cache_dir=None) -> dict:
  """The environment for runs on the CPU that share a persistent compilation cache: `cache_dir`,
  or by default the test session's (conftest.py's compilation_cache, shared by every test)."""
  cache_dir = cache_dir or os.environ["JAX_COMPILATION_CACHE_DIR"]
  return dict(os.environ, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=str(cache_dir),
              JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
              JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")


# XLA_FLAGS of every test process (conftest.py puts them in the session's environment, so the
# launch.py runs and scripts the tests start inherit them; a test that sets XLA_FLAGS itself
# adds them): XLA's CPU compiler with LLVM's optimisations off and its older loop emitters
# instead of the fusion emitters. The tests' programs are tiny and run a few steps, so compiling
# is most of their CPU time: the tiny train step compiles in about 1 s of CPU instead of 4.4 s
# (2.6 s with the first flag alone), and runs a step about 6 ms slower (not noticed below some
# 750 steps). Two more for a machine whose cores the test workers already share (3 workers on
# 2 cores): the compiled module in one piece instead of pieces compiled on threads in parallel
# (0.77 -> 0.63 CPU-s for the tiny step), and each program's matrix products on its own thread
# instead of Eigen's pool (whose threads wait for work by spinning). test_levers.py with
# test_length_head.py: 72.1 -> 65.8 CPU-s; test_sharding.py: 37.5 -> 34.0. What XLA computes is
# the same program; only its machine code and threads differ. Users' runs (make demo, the
# benchmarks) keep XLA's defaults.
_QUICK_FLAGS = ("--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false "
                "--xla_cpu_parallel_codegen_split_count=1 --xla_cpu_multi_thread_eigen=false")
_QUICK_ENV = "TRANSFORMER_JAX_TEST_XLA_FLAGS"


def _xla_takes(flags: str) -> bool:
  """Whether this XLA starts with `flags` (it aborts a process on a flag it does not know)."""
  return subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], capture_output=True,
                        env=dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags)).returncode == 0


def _quick_compile() -> str:
  """_QUICK_FLAGS where this XLA knows them (a later XLA may drop one), else those it knows of
  them, one by one (LLVM's level, the first, every XLA has). Probed once in a short process;
  the result goes into the environment for the test workers and runs."""
  if _QUICK_ENV not in os.environ:
    first, *rest = _QUICK_FLAGS.split()
    known = rest if _xla_takes(_QUICK_FLAGS) else [f for f in rest if _xla_takes(f)]
    os.environ[_QUICK_ENV] = " ".join([first, *known])
  return os.environ[_QUICK_ENV]


QUICK_COMPILE = _quick_compile()


def cpu_environment(devices: int, **extra) -> dict:
  """This environment on the CPU, with `devices` host devices (XLA's
  --xla_force_host_platform_device_count) and the tests' quick-compiling flags; `extra` added."""
  return dict(os.environ, JAX_PLATFORMS="cpu",
              XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} {QUICK_COMPILE}",
              **extra)


def start_job(command: list, env: dict, processes: int = 2, port=None) -> list:
  """Starts `command` (a launch.py command line) as the `processes` processes of one JAX job, as
  the explicit flags make one: a coordinator on 127.0.0.1 at a free port (or `port`),
  --num_processes and --process_id. The Popen of each, process 0 first, with stdout and stderr
  together in text; `job_outputs` waits for them. The one way the tests start a job of several
  processes."""
  from tests import emulators  # (its free_port: the one way the tests find a port)
  port = port or emulators.free_port()
  return [subprocess.Popen([*command, f"--coordinator_address=127.0.0.1:{port}",
                            f"--num_processes={processes}", f"--process_id={i}"], cwd=ROOT,
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
          for i in range(processes)]


def job_outputs(job: list, timeout: float = 300) -> tuple:
  """Waits for the processes of `start_job`: (their exit codes, their outputs), process 0 first.
  A process still running after `timeout` seconds is killed, with the others, and fails the test
  with what each printed."""
  try:
    outputs = [p.communicate(timeout=timeout)[0] for p in job]
  except subprocess.TimeoutExpired:
    for p in job:
      p.kill()
    raise AssertionError(f"a job's process ran past {timeout} s:\n" +
                         "\n".join(p.communicate()[0][-3000:] for p in job)) from None
  return [p.returncode for p in job], outputs


# A user and mount namespace of the server's own, where it may mount file systems (a small
# tmpfs: a full disk) that only it and its children see. As root, or as any user where the kernel
# allows unprivileged user namespaces.
NAMESPACE = ["unshare", "--user", "--map-root-user", "--mount"]


def namespaces_work() -> bool:
  """Whether this machine lets a test mount a tmpfs in a namespace of its own."""
  try:
    return subprocess.run([*NAMESPACE, "mount", "-t", "tmpfs", "-o", "size=4k", "tmpfs", "/tmp"],
                          capture_output=True, timeout=30).returncode == 0
  except (OSError, subprocess.SubprocessError):
    return False


class Launcher:
  """`start(flags)` a launch.py run, watch its output, signal it, `wait()` for its exit code.

  namespace=True: the server and its runs live in a mount namespace of their own (NAMESPACE),
  where `shell()` mounts file systems; the test sees their files at `outside(path)`.
  preload: modules the server imports too (a tracker's client: every run would import it anew);
  none that starts a thread (the server forks) or makes files at import that a run's exit removes
  (W&B's temporary folders: the first run to end would take them from the others).
  """

  def __init__(self, env: dict, directory, namespace: bool = False, preload=(),
               server_stderr=None):
    self.directory = directory
    prefix = NAMESPACE if namespace else []
    # server_stderr: a file for what the server itself prints on stderr (its imports: what a
    # fresh `python launch.py` would print before its own output), instead of the test's stderr.
    self.server_stderr = server_stderr
    err = None if server_stderr is None else open(server_stderr, "w")
    self._server = subprocess.Popen([*prefix, sys.executable, "-c", SERVER, *preload], cwd=ROOT,
                                    env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=err, text=True)
    if err is not None:
      err.close()  # the server has its own copy
    self.namespace = namespace
    self._count = 0
    self.pid = None
    self.stdout = self.stderr = None

  def start(self, *flags, user=None, stdout=None, env=None, cwd=None, stdin=None) -> int:
    """Starts `launch.py FLAGS`; `user`: a uid to run it as (when the tests run as root);
    `stdout`: a file for its stdout (as the run sees it), instead of one of the launcher's;
    `env`: variables added to the launcher's environment for this run; `cwd`: the directory it
    runs in (by default the checkout's root); `stdin`: a file it reads as its stdin (by default
    it reads /dev/null)."""
    self._count += 1
    self.stdout = stdout or os.path.join(self.directory, f"launch{self._count}.out")
    self.stderr = os.path.join(self.directory, f"launch{self._count}.err")
    for path in (self.stdout, self.stderr)[0 if stdout is None else 1:]:
      open(path, "w").close()
    command = {"flags": list(flags), "stdout": self.stdout, "stderr": self.stderr, "user": user,
               "env": env, "cwd": None if cwd is None else str(cwd),
               "stdin": None if stdin is None else str(stdin)}
    self._server.stdin.write(json.dumps(command) + "\n")
    self._server.stdin.flush()
    self.pid = json.loads(self._server.stdout.readline())["pid"]
    return self.pid

  def shell(self, command: str) -> str:
    """Runs a shell command in the server's namespaces; its output. Fails the test if it fails."""
    self._server.stdin.write(json.dumps({"shell": command}) + "\n")
    self._server.stdin.flush()
    reply = json.loads(self._server.stdout.readline())
    assert reply["code"] == 0, (command, reply["output"])
    return reply["output"]

  def outside(self, path) -> pathlib.Path:
    """Where the test sees `path` as the runs see it (inside their mount namespace)."""
    path = os.path.abspath(str(path))
    return pathlib.Path(f"/proc/{self._server.pid}/root{path}" if self.namespace else path)

  def output(self) -> tuple:
    with open(self.outside(self.stdout)) as out, open(self.stderr) as err:
      return out.read(), err.read()

  def send(self, signum) -> None:
    try:
      os.kill(self.pid, signum)
    except ProcessLookupError:  # it has already ended
      pass

  def wait(self) -> int:
    return json.loads(self._server.stdout.readline())["code"]

  def running(self) -> bool:
    """Whether the run last started is still running (its server reaps it when it ends)."""
    try:
      os.kill(self.pid, 0)
    except ProcessLookupError:
      return False
    return True

  def wait_for(self, predicate, timeout: float = 300) -> bool:
    """Polls the output until predicate(stdout) holds (True) or the run ends (False)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
      if predicate(self.output()[0]):
        return True
      if not self.running():
        return predicate(self.output()[0])
      time.sleep(0.02)
    raise TimeoutError(f"launch.py did not get there in {timeout} s:\n{self.output()}")

  def run(self, *flags, user=None, stdout=None, env=None, cwd=None, stdin=None) -> tuple:
    """(exit code, stdout, stderr) of `launch.py FLAGS`."""
    self.start(*flags, user=user, stdout=stdout, env=env, cwd=cwd, stdin=stdin)
    code = self.wait()
    return (code, *self.output())

  def close(self) -> None:
    self._server.stdin.close()
    self._server.wait(timeout=60)

