"""A real PostgreSQL server for the tests: Debian's package (`.ci/run` installs it), initdb and
pg_ctl in a temporary directory on 127.0.0.1 and a free port, run as the `postgres` user where
the tests run as root (PostgreSQL refuses root). One database and one user with a password."""

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from types import SimpleNamespace

from tests import emulators

USER, PASSWORD, DATABASE = "sweeper", "s3cret-pw", "sweeps"


def _binaries() -> str:
  found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
  if not found:
    raise RuntimeError("PostgreSQL is not installed (no /usr/lib/postgresql/*/bin/initdb): "
                       "apt-get install -y postgresql (as .ci/run does)")
  return os.path.dirname(found[-1])


_free_port = emulators.free_port  # (the tests' one way to find a port)


def start() -> SimpleNamespace:
  """A running server; stop(server) ends it and removes its files."""
  bin_dir = _binaries()
  root = tempfile.mkdtemp(prefix="pg-")
  as_user = []
  if os.geteuid() == 0:
    owner = pwd.getpwnam("postgres")
    os.chown(root, owner.pw_uid, owner.pw_gid)
    as_user = ["runuser", "-u", "postgres", "--"]
  password_file = os.path.join(root, "pw")
  with open(password_file, "w", encoding="utf-8") as f:
    f.write("admin-pw\n")
  if as_user:
    os.chown(password_file, owner.pw_uid, owner.pw_gid)
  data = os.path.join(root, "data")
  port = _free_port()

  def run(*command):
    subprocess.run([*as_user, *command], check=True, capture_output=True, cwd=root)

  run(f"{bin_dir}/initdb", "-D", data, "-U", "postgres", "-A", "scram-sha-256",
      f"--pwfile={password_file}", "--no-sync")
  run(f"{bin_dir}/pg_ctl", "-D", data, "-l", os.path.join(root, "log"), "-w", "-o",
      f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off "
      "-c synchronous_commit=off -c full_page_writes=off", "start")
  import psycopg
  with psycopg.connect(host="127.0.0.1", port=port, user="postgres", password="admin-pw",
                       dbname="postgres", autocommit=True) as connection:
    connection.execute(f"CREATE USER {USER} WITH PASSWORD '{PASSWORD}'")
    connection.execute(f"CREATE DATABASE {DATABASE} OWNER {USER}")
  server = SimpleNamespace(root=root, data=data, port=port, bin_dir=bin_dir, as_user=as_user,
                           url=f"postgresql+psycopg://{USER}:{PASSWORD}@127.0.0.1:{port}/"
                               f"{DATABASE}")
  return server


def add_user(server, user: str, password: str) -> str:
  """Another user with `password` and a database of its own (named as the user); its URL."""
  import psycopg
  with psycopg.connect(host="127.0.0.1", port=server.port, user="postgres", password="admin-pw",
                       dbname="postgres", autocommit=True) as connection:
    connection.execute(f"CREATE USER {user} WITH PASSWORD '{password}'")
    connection.execute(f"CREATE DATABASE {user} OWNER {user}")
  return f"postgresql+psycopg://{user}:{password}@127.0.0.1:{server.port}/{user}"


def pg_ctl(server, *action) -> None:
  """pg_ctl's `action` on the running server (e.g. "stop", "-m", "fast"; "start"), as its
  owner; the same port and settings as start()."""
  subprocess.run([*server.as_user, f"{server.bin_dir}/pg_ctl", "-D", server.data, "-l",
                  os.path.join(server.root, "log"), "-w", "-o",
                  f"-p {server.port} -k {server.root} -c listen_addresses=127.0.0.1 -c fsync=off "
                  "-c synchronous_commit=off -c full_page_writes=off", *action],
                 check=True, capture_output=True, cwd=server.root)


def stop(server) -> None:
  subprocess.run([*server.as_user, f"{server.bin_dir}/pg_ctl", "-D", server.data, "-m",
                  "immediate", "stop"], capture_output=True, cwd=server.root)
  shutil.rmtree(server.root, ignore_errors=True)
