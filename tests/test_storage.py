"""core/storage.py against real object-store emulators on 127.0.0.1 (tests/emulators.py): one
set of functions, the same guarantees on a local disk, gs:// and s3://."""

import collections
import contextlib
import http.server
import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from tests import emulators
from transformer_jax.core import jsonlog, lease, storage
from transformer_jax.core.errors import UserError


@pytest.fixture(scope="module")
def stores():
  """Both emulators, the environment pointing at them, and one bucket on each."""
  with emulators.buckets() as (gcs_url, s3_url):
    yield {"gs": gcs_url, "s3": s3_url}


_COUNT = iter(range(10**6))


@pytest.fixture(params=["local", "gs", "s3"])
def root(request, tmp_path):
  """A fresh directory: local, or a fresh prefix in each emulator's bucket."""
  if request.param == "local":
    return str(tmp_path)
  request.getfixturevalue("stores")
  return f"{request.param}://bucket/t{next(_COUNT)}-{os.getpid()}"


def one_line(error) -> str:
  text = str(error.value)
  assert "\n" not in text
  return text


@pytest.mark.parametrize("typo, says", [
    ("gcs://bucket/run", "did you mean gs://bucket/run"), ("s4://bucket/run", "s4://"),
    ("gs:/bucket/run", "not a gs:// URL"), ("gs:///run", "not a gs:// URL"),
    ("s3a://bucket/run", "did you mean s3://bucket/run")])
def test_a_scheme_typo_is_refused_in_one_line_and_never_becomes_a_local_folder(typo, says,
                                                                               tmp_path,
                                                                               monkeypatch):
  monkeypatch.chdir(tmp_path)
  with pytest.raises(UserError) as error:
    storage.check(typo)
  assert says in one_line(error)
  assert os.listdir(tmp_path) == []


def test_check_makes_local_paths_absolute_and_normalises_urls(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  assert storage.check("runs/a") == os.path.join(str(tmp_path), "runs", "a")
  assert storage.check("~") == os.path.expanduser("~")
  assert storage.check("gs://b/run/") == "gs://b/run"
  assert storage.check("s3://b") == "s3://b"
  assert not storage.is_url(str(tmp_path)) and storage.is_url("gs://b/x")


def test_reads_and_whole_writes(root):
  path = storage.join(root, "sub", "config.json")
  assert not storage.exists(path) and not storage.isdir(storage.join(root, "sub"))
  storage.makedirs(storage.join(root, "sub"))
  storage.write(path, '{"a": 1}')
  assert storage.read_text(path) == '{"a": 1}' and storage.isfile(path)
  storage.write(path, b"\x00" * 100_000)  # replaced whole
  assert storage.read_bytes(path) == b"\x00" * 100_000
  storage.write(storage.join(root, "sub", "b.txt"), "b")
  assert storage.listdir(storage.join(root, "sub")) == ["b.txt", "config.json"]
  assert storage.isdir(storage.join(root, "sub")) and storage.listdir(root) == ["sub"]
  storage.remove(path)
  storage.remove(path)  # already gone: nothing to do
  assert not storage.exists(path) and storage.listdir(storage.join(root, "nothing")) == []
  with pytest.raises(FileNotFoundError):
    storage.read_bytes(path)


def test_create_is_exclusive_among_racing_writers(root):
  """The store's precondition decides: of 8 threads creating one object at once, one wins and
  its content is what stays."""
  storage.makedirs(root)
  path = storage.join(root, "lease")
  won, start = [], threading.Barrier(8)

  def racer(n):
    start.wait()
    if lease.create(path, f"writer {n}"):
      won.append(n)

  threads = [threading.Thread(target=racer, args=(n,)) for n in range(8)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert len(won) == 1
  assert storage.read_text(path) == f"writer {won[0]}"
  assert not lease.create(path, "late")


def test_a_log_keeps_every_record_of_successive_writers_in_order(root):
  storage.makedirs(root)
  path = storage.join(root, "metrics.jsonl")
  assert jsonlog.read_jsonl(path) == [] if storage.is_url(root) else True
  for writer in range(2):  # a run, then its resume
    log = jsonlog.JsonLog(path)
    for step in range(3):
      log.append({"writer": writer, "step": step})
    log.close()
  records = jsonlog.read_jsonl(path)
  assert [(r["writer"], r["step"]) for r in records] == [(w, s) for w in range(2) for s in range(3)]
  assert jsonlog.log_exists(path)
  assert jsonlog.rewrite_jsonl(path, keep=lambda r: r["step"] != 1) == 2
  assert [(r["writer"], r["step"]) for r in jsonlog.read_jsonl(path)] == [
      (0, 0), (0, 2), (1, 0), (1, 2)]
  log = jsonlog.JsonLog(path)  # a writer after the rewrite: its records come last
  log.append({"writer": 2, "step": 0})
  log.close()
  assert jsonlog.read_jsonl(path)[-1] == {"writer": 2, "step": 0}


def test_a_local_log_is_one_file(tmp_path):
  """Locally the log is one file of JSON lines, no chunks."""
  path = str(tmp_path / "metrics.jsonl")
  log = jsonlog.JsonLog(path)
  log.append({"step": 1})
  log.close()
  assert jsonlog.read_jsonl(path) == [{"step": 1}]
  assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1}\n'
  assert os.listdir(tmp_path) == ["metrics.jsonl"]


def test_a_killed_writer_leaves_only_whole_chunks(stores):
  """Each record is its own object: whatever a writer did before it died reads back whole."""
  path = "s3://bucket/killed/metrics.jsonl"
  log = jsonlog.JsonLog(path)
  log.append({"step": 1})
  deadline = time.time() + 10  # no close(): the writer dies once its upload is done
  while not storage.listdir(path + jsonlog.PARTS_SUFFIX):
    assert time.time() < deadline
    time.sleep(0.05)
  later = jsonlog.JsonLog(path)
  later.append({"step": 2})
  later.close()
  assert jsonlog.read_jsonl(path) == [{"step": 1}, {"step": 2}]
  assert storage.listdir(path + jsonlog.PARTS_SUFFIX) == ["000000001.jsonl", "000000002.jsonl"]


# ------------------------------------------------------------------------------------ the lease

@pytest.fixture(params=["gs", "s3"])
def bucket_dir(request, stores):
  return f"{request.param}://bucket/lease{next(_COUNT)}"


def test_a_second_writer_is_refused_in_one_line_naming_the_holder(bucket_dir):
  first = lease.lock(bucket_dir)
  assert isinstance(first, lease.Lease)
  first.acquire()
  try:
    for attempt in (lease.Lease(bucket_dir).acquire, lease.Lease(bucket_dir).check):
      with pytest.raises(UserError) as error:
        attempt()
      text = one_line(error)
      assert f"pid {os.getpid()} on host {socket.gethostname()}" in text
      assert "is in use by" in text and bucket_dir in text
    holder = json.loads(storage.read_text(storage.join(bucket_dir, "lock")))
    assert holder["command"] and holder["seconds"] == lease.LEASE_SECONDS
  finally:
    first.release()
  assert not storage.exists(storage.join(bucket_dir, "lock"))  # a clean end frees it
  second = lease.Lease(bucket_dir)
  second.check()
  second.acquire()
  second.release()


def _foreign_lease(directory: str, renewed: float, seconds: float = 3.0) -> None:
  storage.write(storage.join(directory, "lock"), json.dumps({
      "host": "another-host", "pid": 1, "since": "2026-11-24T00:00:00", "command": "train",
      "token": "theirs", "renewed": renewed, "seconds": seconds}))


def test_a_lease_that_is_not_renewed_is_taken_over_after_it_runs_out(bucket_dir, capfd):
  _foreign_lease(bucket_dir, renewed=time.time(), seconds=1.5)
  with pytest.raises(UserError) as error:
    lease.Lease(bucket_dir).acquire()
  assert "pid 1 on host another-host" in one_line(error) and "runs out in" in one_line(error)
  time.sleep(1.6)
  taker = lease.Lease(bucket_dir)
  taker.acquire()
  try:
    assert "did not end cleanly; taking over its lease" in capfd.readouterr().err
    assert json.loads(storage.read_text(taker.path))["pid"] == os.getpid()
  finally:
    taker.release()


def test_a_conditional_delete_removes_only_the_version_it_read(bucket_dir):
  path = storage.join(bucket_dir, "object")
  storage.write(path, "one")
  first = lease.version(path)
  storage.write(path, "two")
  assert lease.version(path) not in (None, first)
  assert not lease.remove_if(path, first)  # rewritten since: kept
  assert storage.read_text(path) == "two"
  assert lease.remove_if(path, lease.version(path))
  assert not storage.exists(path) and lease.version(path) is None
  assert not lease.remove_if(path, first)  # gone already


def test_a_conditional_write_replaces_only_the_version_it_names(bucket_dir):
  path = storage.join(bucket_dir, "object")
  assert lease.write_if(path, "none yet", "1") is None  # nothing there: nothing written
  assert not storage.exists(path)
  storage.write(path, "one")
  first = lease.version(path)
  second = lease.write_if(path, "two", first)
  assert second not in (None, first) and second == lease.version(path)
  assert storage.read_text(path) == "two"
  assert lease.write_if(path, "three", first) is None  # a stale version: kept as it is
  assert storage.read_text(path) == "two"


def test_of_runs_taking_over_a_stale_lease_at_once_exactly_one_wins(bucket_dir, monkeypatch):
  """Six takers read the same expired lease and all decide to take it over; the worst order
  follows: one deletes it and creates its own lease, and only then do the others delete. Each
  deletes only the version it read (the store's precondition), so exactly one gets the lease
  and the others are refused naming it."""
  _foreign_lease(bucket_dir, renewed=time.time() - 100, seconds=1.0)
  takers = 6
  all_judged, first = threading.Barrier(takers, timeout=30), threading.Lock()
  remove_if = lease.remove_if

  def in_the_worst_order(path, at_version):
    all_judged.wait()  # every taker has read the stale lease
    if not first.acquire(blocking=False):
      deadline = time.time() + 20
      while lease.version(path) in (None, at_version):  # until the first holds a new lease
        assert time.time() < deadline
        time.sleep(0.02)
    return remove_if(path, at_version)

  monkeypatch.setattr(lease, "remove_if", in_the_worst_order)
  won, refused = [], []

  def taker():
    held = lease.Lease(bucket_dir)
    try:
      held.acquire()
      won.append(held)
    except UserError as e:
      refused.append(str(e))

  threads = [threading.Thread(target=taker) for _ in range(takers)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  try:
    assert len(won) == 1 and len(refused) == takers - 1, refused
    assert json.loads(storage.read_text(won[0].path))["token"] == won[0]._token
    assert all("is in use by" in text for text in refused)
  finally:
    monkeypatch.setattr(lease, "remove_if", remove_if)  # release's own delete, unordered
    for held in won:
      held.release()


def test_a_dead_process_of_this_host_is_taken_over_at_once(bucket_dir):
  dead = 2**22 + 12345  # above the default pid_max: no such process
  storage.write(storage.join(bucket_dir, "lock"), json.dumps({
      "host": socket.gethostname(), "pid": dead, "since": "x", "command": "train",
      "token": "old", "renewed": time.time(), "seconds": 600}))
  held = lease.Lease(bucket_dir)
  held.acquire()
  held.release()


def test_a_live_run_renews_its_lease_and_notices_a_takeover(bucket_dir, capfd):
  held = lease.Lease(bucket_dir, seconds=5, renew_every=0.2)
  held.acquire()
  try:
    first = json.loads(storage.read_text(held.path))["renewed"]
    deadline = time.time() + 10
    while json.loads(storage.read_text(held.path))["renewed"] == first:
      assert time.time() < deadline, "the lease was not renewed"
      time.sleep(0.1)
    _foreign_lease(bucket_dir, renewed=time.time(), seconds=5)  # taken from under it
    while not held.lost:
      assert time.time() < deadline, "the takeover went unnoticed"
      time.sleep(0.1)
    assert json.loads(storage.read_text(held.path))["token"] == "theirs"  # not overwritten
    assert "was taken over by another run" in capfd.readouterr().err
  finally:
    held.release()
  assert json.loads(storage.read_text(held.path))["token"] == "theirs"  # not deleted either


# ------------------------------------------------------------------------------------ bad inputs

@pytest.mark.parametrize("scheme", ["gs", "s3"])
def test_a_missing_bucket_is_one_error(scheme, stores):
  with pytest.raises(UserError) as error:
    storage.check_bucket(f"{scheme}://no-such-bucket/run")
  assert f"the bucket {scheme}://no-such-bucket does not exist" in one_line(error)


# Each store's variable for its endpoint.
ENDPOINTS = pytest.mark.parametrize("scheme, variable", [("gs", "STORAGE_EMULATOR_HOST"),
                                                         ("s3", "AWS_ENDPOINT_URL_S3")])


def _bucket_check_error(scheme, variable, endpoint, monkeypatch, within_s):
  """check_bucket's one-line error at a store reached at `endpoint`, with a 2 s timeout; it must
  come within `within_s` seconds."""
  monkeypatch.setenv(variable, endpoint)
  monkeypatch.setenv(storage.TIMEOUT_ENV, "2")
  start = time.time()
  with pytest.raises(UserError) as error:
    storage.check_bucket(f"{scheme}://bucket/run")
  assert time.time() - start < within_s
  return one_line(error)


@ENDPOINTS
def test_an_endpoint_that_does_not_answer_is_one_error_within_the_timeout(scheme, variable,
                                                                          stores, monkeypatch):
  silent = f"http://127.0.0.1:{emulators.free_port()}"  # nothing listens there
  text = _bucket_check_error(scheme, variable, silent, monkeypatch, within_s=15)
  assert silent in text and ("does not answer" in text or "no answer" in text)


@contextlib.contextmanager
def _unavailable():
  """A store answering 503 to every request: (its URL, the list of requests it was sent)."""
  sent = []

  class Unavailable(http.server.BaseHTTPRequestHandler):
    def answer(self):
      sent.append(f"{self.command} {self.path}")
      self.send_response(503)
      self.send_header("Content-Length", "0")
      self.end_headers()

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = answer

    def log_message(self, *args):
      pass

  server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Unavailable)
  threading.Thread(target=server.serve_forever, daemon=True).start()
  try:
    yield f"http://127.0.0.1:{server.server_address[1]}", sent
  finally:
    server.shutdown()
    server.server_close()


@ENDPOINTS
def test_a_request_is_tried_retries_times_on_either_store(scheme, variable, stores, monkeypatch):
  """One read at a store that answers 503 is sent storage.RETRIES times, on gcsfs (which binds
  its own six tries, with 31 s of sleep, when its class is defined) as on s3fs (botocore's own
  count leaves out the first try). Longer outages are core/outage.py's."""
  with _unavailable() as (url, sent):
    monkeypatch.setenv(variable, url)
    with pytest.raises(Exception) as error:
      storage.filesystem(scheme).cat_file("bucket/object")
  assert "503" in str(error.value) or "Service Unavailable" in str(error.value), error.value
  reads = [request for request in sent if "object" in request]  # (not a lease's listing)
  assert len(reads) == storage.RETRIES and len(set(reads)) == 1, sent


def test_orbaxs_requests_through_etils_are_tried_as_many_times(stores):
  """orbax writes a checkpoint's folders and metadata through etils.epath, which takes fsspec's
  own class for gs:// (gcsfs's extended one): once the workdir's filesystem is made, that class
  too sends a request storage.RETRIES times (six, and 31 s, before), so that an outage reaches
  train.storage_outage_s's count at once. In a fresh process, as a run's."""
  script = ("from transformer_jax.core import storage\n"
            "storage.filesystem('gs')\n"
            "from etils import epath\n"
            "epath.Path('gs://bucket/object').read_bytes()\n")
  with _unavailable() as (url, sent):
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env={**os.environ, "STORAGE_EMULATOR_HOST": url}, timeout=120)
  assert done.returncode != 0 and "503" in done.stderr, done.stderr[-2000:]
  tries = collections.Counter(sent)
  assert max(tries.values()) == storage.RETRIES, sent


@ENDPOINTS
def test_an_endpoint_that_accepts_but_never_answers_is_one_error_after_the_timeout(
    scheme, variable, stores, monkeypatch):
  """A server that takes the connection and then says nothing (a firewall or a hung proxy): the
  first request is given up after TRANSFORMER_JAX_STORAGE_TIMEOUT seconds, named."""
  with socket.socket() as silent:
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)  # connections are accepted by the kernel; nothing ever reads them
    endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
    text = _bucket_check_error(scheme, variable, endpoint, monkeypatch, within_s=10)
  # Our own deadline or the library's (set from the same variable), whichever comes first.
  assert f"no answer from {endpoint} within 2 s" in text and "list" in text, text
  assert storage.TIMEOUT_ENV in text


def test_s3_without_credentials_is_one_error(stores, monkeypatch, tmp_path):
  for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
  monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
  monkeypatch.setattr(storage, "_FILESYSTEMS", {})  # a filesystem made with credentials keeps them
  with pytest.raises(UserError) as error:
    storage.write("s3://bucket/nocred/config.json", "{}")
  assert "no credentials" in one_line(error) and "AWS_ACCESS_KEY_ID" in one_line(error)


def test_gcs_without_credentials_is_one_error(stores):
  """An anonymous caller (gcsfs without credentials) is answered 401 by a bucket that needs
  them (the emulator answers as GCS does for gs://private, tests/emulators.py)."""
  with pytest.raises(UserError) as error:
    storage.check_bucket("gs://private/run")
  text = one_line(error)
  assert "no valid credentials for Google Cloud Storage" in text and "Anonymous caller" in text
  assert "gcloud auth application-default login" in text


def test_gcs_without_permission_is_one_error(stores, monkeypatch, tmp_path):
  """Real credentials (a service-account key file: google-auth signs a token request to the
  key's token endpoint, the emulator's) that the bucket refuses: 403."""
  monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS",
                     emulators.service_account_key(tmp_path / "key.json", stores["gs"]))
  storage.check_bucket("gs://bucket/run")  # the same credentials, a bucket that lets them in
  for attempt in (lambda: storage.check_bucket("gs://private/run"),
                  lambda: storage.write("gs://private/run/config.json", "{}")):
    with pytest.raises(UserError) as error:
      attempt()
    text = one_line(error)
    assert "permission denied" in text and "gs://private" in text, text
    assert "does not have storage.objects.list access" in text or "Forbidden" in text


def test_a_log_upload_that_fails_is_raised_by_the_writer_not_lost(stores):
  """Uploads run off the caller's thread; a failure comes back as the usual one-line error."""
  log = jsonlog.JsonLog("gs://no-such-bucket/run/metrics.jsonl")
  log.append({"step": 1})
  with pytest.raises(UserError) as error:
    log.close()
  assert "no-such-bucket" in one_line(error)


def test_records_appended_faster_than_uploads_share_objects_in_order(stores):
  """A log appended every few ms (a tiny model logging each step) does not make one request a
  record: each upload takes every record appended while the previous one ran."""
  path = "gs://bucket/fast/metrics.jsonl"
  log = jsonlog.JsonLog(path)
  for step in range(200):
    log.append({"step": step})
  log.close()
  assert [r["step"] for r in jsonlog.read_jsonl(path)] == list(range(200))
  parts = storage.listdir(path + jsonlog.PARTS_SUFFIX)
  assert 1 < len(parts) < 50, parts  # the first upload took one record, later ones many
  assert parts == [f"{n:09d}.jsonl" for n in range(1, len(parts) + 1)]
