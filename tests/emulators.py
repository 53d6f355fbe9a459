"""Object-store emulators on 127.0.0.1 for the tests (test helper): real HTTP servers in their
own processes, reached through the same environment variables a user sets for a real endpoint.

- gs://: gcp-storage-emulator (the GCS JSON API). It ignores preconditions, so it is started
  with these additions: an upload or a delete with `ifGenerationMatch=N` of an object at another
  generation (0: none) is answered 412, as GCS answers it (the lease's atomic creation, takeover
  and renewal depend on them); each check and its action hold one lock, as GCS applies them
  atomically. Downloads also carry the object's generation in `x-goog-generation`, as GCS sends
  it: TensorStore's gcs driver (orbax's OCDBT checkpoints) refuses a read without it. Everything
  else is the emulator's own.
- s3://: moto's S3 server application. It honours `If-None-Match: *` and `If-Match` itself,
  but checks and writes in two steps on a threaded server, so two racing creates could both
  succeed (seen: 2 of 8 threads won test_storage's race). It is started with every write (any
  request but a GET or HEAD) holding one lock, as S3 applies a conditional write atomically.
"""

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

GCS_SERVER = r"""
import sys
import threading
from http import HTTPStatus
from gcp_storage_emulator.handlers import objects
from gcp_storage_emulator.exceptions import NotFound

insert = objects.insert
atomic = threading.Lock()

def precondition_failed(response):
  response.status = HTTPStatus.PRECONDITION_FAILED
  response.json({"error": {"code": 412, "message": "At least one of the pre-conditions "
                           "you specified did not hold.", "errors": []}})

def insert_with_precondition(request, response, storage, *args, **kwargs):
  with atomic:
    return insert_if(request, response, storage, *args, **kwargs)

def insert_if(request, response, storage, *args, **kwargs):
  wanted = request.query.get("ifGenerationMatch", [None])[0]
  if wanted is not None:
    name = request.query.get("name", [None])[0]
    if name is None and isinstance(request.data, dict):
      name = (request.data.get("meta") or request.data).get("name")
    try:
      current = str(storage.get_file_obj(request.params["bucket_name"], name)["generation"])
    except NotFound:
      current = "0"  # GCS's generation of an object that does not exist
    if current != wanted:
      precondition_failed(response)
      return
  return insert(request, response, storage, *args, **kwargs)

delete = objects.delete

def delete_with_precondition(request, response, storage, *args, **kwargs):
  wanted = request.query.get("ifGenerationMatch", [None])[0]
  with atomic:
    if wanted is not None:
      try:
        obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
      except NotFound:
        response.status = HTTPStatus.NOT_FOUND
        return
      if str(obj["generation"]) != wanted:
        precondition_failed(response)
        return
    return delete(request, response, storage, *args, **kwargs)

download = objects.download

def download_with_generation(request, response, storage, *args, **kwargs):
  try:
    obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
    response["x-goog-generation"] = obj["generation"]
  except NotFound:
    pass
  return download(request, response, storage, *args, **kwargs)

objects.insert = insert_with_precondition  # before the server module builds its routes
objects.download = download_with_generation
objects.delete = delete_with_precondition
import json
import re
from gcp_storage_emulator import server as emulator

# GCS's IAM for buckets named private*: an anonymous caller is answered 401 and any other one
# 403 (the emulator has no accounts, so none is granted access). POST /token is the OAuth token
# endpoint a service-account key file may name (token_uri): it grants every key a token.
PRIVATE = re.compile(r"/b/(private[-.\w]*)(/|$)")
handle = emulator.Router.handle

def reply(handler, code, body):
  data = json.dumps(body).encode("utf-8")
  handler.send_response(code)
  handler.send_header("Content-Type", "application/json")
  handler.send_header("Content-Length", str(len(data)))
  handler.end_headers()
  handler.wfile.write(data)

def handle_with_iam(self, method):
  handler = self._request_handler
  path = handler.path.split("?")[0]
  if path == "/token" and method == "POST":
    return reply(handler, 200, {"access_token": "a-token", "token_type": "Bearer",
                                "expires_in": 3600})
  private = PRIVATE.search(path)
  if private:
    bucket = private.group(1)
    if not handler.headers.get("Authorization"):
      message = ("Anonymous caller does not have storage.objects.list access to the Google "
                 "Cloud Storage bucket. Permission 'storage.objects.list' denied on resource "
                 "(or it may not exist).")
      return reply(handler, 401, {"error": {"code": 401, "message": message, "errors": [
          {"message": message, "domain": "global", "reason": "required"}]}})
    message = (f"tests@emulator.iam.gserviceaccount.com does not have storage.objects.list "
               f"access to the Google Cloud Storage bucket {bucket}. Permission "
               "'storage.objects.list' denied on resource (or it may not exist).")
    return reply(handler, 403, {"error": {"code": 403, "message": message, "errors": [
        {"message": message, "domain": "global", "reason": "forbidden"}]}})
  return handle(self, method)

emulator.Router.handle = handle_with_iam
from gcp_storage_emulator.server import create_server
server = create_server("127.0.0.1", int(sys.argv[1]), in_memory=True)
server.run()
"""


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _wait(url: str, process: subprocess.Popen, seconds: float = 30.0) -> None:
  deadline = time.time() + seconds
  while time.time() < deadline:
    if process.poll() is not None:
      raise RuntimeError(f"the emulator for {url} exited with code {process.returncode}")
    try:
      urllib.request.urlopen(url, timeout=1).close()
      return
    except urllib.error.HTTPError:
      return  # it answers
    except OSError:
      time.sleep(0.05)
  raise RuntimeError(f"the emulator for {url} did not answer within {seconds} s")


@contextlib.contextmanager
def running(command: list, url: str):
  process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  try:
    _wait(url, process)
    yield url
  finally:
    process.kill()
    process.wait()


S3_SERVER = r"""
import os
import sys
import threading
from werkzeug.serving import run_simple
from moto.moto_server.werkzeug_app import (DomainDispatcherApplication, MotoRequestHandler,
                                           create_backend_app)

port = int(sys.argv[1])
os.environ.setdefault("MOTO_PORT", str(port))  # as moto.server sets it
app = DomainDispatcherApplication(create_backend_app)
writes = threading.Lock()

def one_write_at_a_time(environ, start_response):
  if environ["REQUEST_METHOD"] in ("GET", "HEAD"):
    return app(environ, start_response)
  with writes:
    return list(app(environ, start_response))  # the whole answer, before the next write

run_simple("127.0.0.1", port, one_write_at_a_time, threaded=True,
           request_handler=MotoRequestHandler)
"""


def gcs():
  """Starts the GCS emulator; yields its endpoint for STORAGE_EMULATOR_HOST."""
  port = free_port()
  return running([sys.executable, "-c", GCS_SERVER, str(port)], f"http://127.0.0.1:{port}")


def s3():
  """Starts moto's S3 server; yields its endpoint for AWS_ENDPOINT_URL_S3."""
  port = free_port()
  return running([sys.executable, "-c", S3_SERVER, str(port)], f"http://127.0.0.1:{port}")


def environment(gcs_url: str = None, s3_url: str = None) -> dict:
  """The variables that point gcsfs (and the Google libraries) and botocore at the emulators,
  with dummy S3 credentials (moto accepts any) and no instance-metadata lookups."""
  env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
         "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
         "TRANSFORMER_JAX_STORAGE_TIMEOUT": "20"}
  if gcs_url:
    env["STORAGE_EMULATOR_HOST"] = gcs_url
  if s3_url:
    env["AWS_ENDPOINT_URL_S3"] = s3_url
  return env


def service_account_key(path, gcs_url: str) -> str:
  """Writes a service-account key file whose token endpoint is the GCS emulator's (a fresh RSA
  key: google-auth signs its token request with it); returns the path, for
  GOOGLE_APPLICATION_CREDENTIALS."""
  from cryptography.hazmat.primitives import serialization
  from cryptography.hazmat.primitives.asymmetric import rsa
  key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
  pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                          serialization.NoEncryption()).decode("ascii")
  with open(path, "w", encoding="utf-8") as f:
    json.dump({"type": "service_account", "project_id": "tests", "private_key_id": "1",
               "private_key": pem, "client_email": "tests@emulator.iam.gserviceaccount.com",
               "client_id": "1", "token_uri": f"{gcs_url}/token"}, f)
  return str(path)


def make_bucket(url: str) -> None:
  """Creates the bucket of `url` (gs://b or s3://b) on its emulator."""
  from transformer_jax.core import storage
  scheme, rest = url.split("://", 1)
  storage.filesystem(scheme).mkdir(rest.split("/")[0])


@contextlib.contextmanager
def buckets():
  """Both emulators, os.environ pointing at them (restored after), and gs://bucket,
  s3://bucket and gs://private (no caller may read or write it) made; yields the GCS and S3
  endpoints."""
  with gcs() as gcs_url, s3() as s3_url:
    saved = dict(os.environ)
    os.environ.update(environment(gcs_url, s3_url))
    try:
      for bucket in ("gs://bucket", "s3://bucket", "gs://private"):
        make_bucket(bucket)
      yield gcs_url, s3_url
    finally:
      os.environ.clear()
      os.environ.update(saved)


@contextlib.contextmanager
def gcs_buckets(*names: str):
  """The GCS emulator alone, os.environ pointing at it (restored after), and the buckets
  gs://NAME made; yields its endpoint (for the environment of other processes)."""
  with gcs() as gcs_url:
    saved = dict(os.environ)
    os.environ.update(environment(gcs_url))
    try:
      for name in names:
        make_bucket(f"gs://{name}")
      yield gcs_url
    finally:
      os.environ.clear()
      os.environ.update(saved)


class Outage:
  """A TCP relay in front of an endpoint (a thread of the test process), taken down and brought
  back by the test: down, it refuses new connections and cuts the open ones, as a store that
  went away does; the emulator behind it keeps every object; stalled, it takes connections and
  never answers them, as a server that hangs does; tripped (`trip`), it goes down by itself when
  a chosen request passes (inside a checkpoint write, say), for a chosen time. Point the client
  at `url`."""

  def __init__(self, target: str):
    self.target = target.split("://", 1)[-1].split(":")
    self.port = free_port()
    self.url = f"http://127.0.0.1:{self.port}"
    self._open, self._listener, self._thread = [], None, None
    self._lock = threading.Lock()
    self.refusing = ()  # texts: connections whose first request line holds them all get 403
    self.stalled = False
    self._trips: list = []  # [(text, seconds)]: the next request holding `text` takes it down
    self.tripped: list = []  # [text, when it went down, when it came back or None], in order
    self._closed = False
    self.up()

  def trip(self, *trips: tuple) -> None:
    """From now on, the relay goes down by itself when a request naming the first trip's text
    passes (in its first packet: the request line, the headers, the start of its body, where a
    multipart upload names its object; as sent or percent-encoded), that request cut, and comes
    back up after the trip's seconds (None: when `up` is called); then the next trip waits for
    its own text. `trips`: (text, seconds) pairs, a text a string or a tuple of strings that
    must all be there (("PUT /", "summary.md"): an upload of it). `tripped` records each
    outage as [text, its start, its end (None while down)]."""
    with self._lock:
      self._trips = list(trips)

  _REQUEST = re.compile(rb"^[A-Z]+ \S+ HTTP/1\.[01]\r\n")

  def _trips_on(self, data: bytes):
    """The seconds of the trip that the request beginning `data` sets off (then taken off the
    list), or False."""
    if not self._REQUEST.match(data):
      return False
    data = data.lower()
    with self._lock:
      if not self._trips or self._listener is None:
        return False
      text, seconds = self._trips[0]
      if not all(t.lower().encode() in data
                 or urllib.parse.quote(t, safe="").lower().encode() in data
                 for t in ((text,) if isinstance(text, str) else text)):
        return False
      self._trips.pop(0)
      self.tripped.append([text, time.time(), None])
      return seconds

  def wait_tripped(self, n: int, seconds: float = 120.0) -> None:
    """Waits until `n` trips have taken the relay down and brought it back up."""
    deadline = time.time() + seconds
    while not (len(self.tripped) >= n and all(end for _, _, end in self.tripped[:n])):
      if time.time() > deadline:
        raise TimeoutError(f"{len(self.tripped)} of {n} trips happened: {self.tripped}")
      time.sleep(0.05)

  def stall(self) -> None:
    """From now on, connections are taken and held unanswered; the open ones are cut."""
    self.stalled = True
    self.down()
    self.up()

  def refuse(self, *texts) -> None:
    """From now on, a connection whose first request line holds each of `texts` is answered 403
    Forbidden, as GCS answers a write its caller may not make (none: forward all again). Open
    connections are cut, so that every client opens new ones."""
    self.refusing = texts
    self.down()
    self.up()

  def up(self) -> None:
    if self._listener is not None or self._closed:
      return  # up already, or closed
    for outage in self.tripped:
      outage[2] = outage[2] or time.time()
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", self.port))
    listener.listen(64)
    self._listener = listener
    self._thread = threading.Thread(target=self._accept, args=(listener,), daemon=True)
    self._thread.start()

  def down(self) -> None:
    listener, self._listener = self._listener, None
    if listener is not None:
      with contextlib.suppress(OSError):
        listener.shutdown(socket.SHUT_RDWR)
      listener.close()
      self._thread.join(timeout=5)
    with self._lock:
      for connection in self._open:
        with contextlib.suppress(OSError):
          connection.shutdown(socket.SHUT_RDWR)
        connection.close()
      self._open = []

  def _accept(self, listener) -> None:
    while True:
      try:
        client, _ = listener.accept()
      except OSError:
        return  # closed by down()
      threading.Thread(target=self._serve, args=(client,), daemon=True).start()

  _FORBIDDEN = json.dumps({"error": {"code": 403, "message": "Forbidden: the relay of the "
                                     "tests refuses this request", "errors": []}}).encode()

  def _serve(self, client) -> None:
    if self.stalled:
      with self._lock:
        self._open.append(client)  # held open, unanswered
      return
    if self.refusing:
      try:
        first = client.recv(8192, socket.MSG_PEEK).split(b"\r\n", 1)[0]
      except OSError:
        client.close()
        return
      if all(text.encode() in first for text in self.refusing):
        with contextlib.suppress(OSError):
          client.sendall(b"HTTP/1.1 403 Forbidden\r\nContent-Type: application/json\r\n"
                         b"Connection: close\r\nContent-Length: %d\r\n\r\n"
                         % len(self._FORBIDDEN) + self._FORBIDDEN)
        client.close()
        return
    try:
      server = socket.create_connection((self.target[0], int(self.target[1])))
    except OSError:
      client.close()
      return
    with self._lock:
      self._open += [client, server]
    for a, b, requests in ((client, server, True), (server, client, False)):
      threading.Thread(target=self._pump, args=(a, b, requests), daemon=True).start()

  def _pump(self, source, sink, requests: bool) -> None:
    try:
      while data := source.recv(65536):
        if requests and self._trips:
          seconds = self._trips_on(data)
          if seconds is not False:  # this request is cut, with every other one
            self.down()
            if seconds is not None:
              timer = threading.Timer(seconds, self.up)
              timer.daemon = True
              timer.start()
            return
        sink.sendall(data)
    except OSError:
      pass
    finally:
      with contextlib.suppress(OSError):
        sink.shutdown(socket.SHUT_WR)

  def close(self) -> None:
    self._closed, self._trips = True, []  # a trip's timer no longer brings it up
    self.down()
