"""Workdir paths that may be URLs: every workdir read and write goes through here.

A path is a local path or `gs://BUCKET/KEY` (Google Cloud Storage, through gcsfs) or
`s3://BUCKET/KEY` (Amazon S3 or an S3-compatible store, through s3fs). Local paths behave exactly
as `core/files.py` makes them behave; its guarantee of whole-or-nothing writes (`write`) is kept
on an object store by one upload, which the store publishes whole or not at all. The same
functions serve both kinds of path. Built on them: `core/jsonlog.py` (append-safe logs) and
`core/lease.py` (conditional writes, one writer per workdir).

Endpoints: gcsfs reads STORAGE_EMULATOR_HOST (and `check` passes it on to TensorStore, which
writes orbax's checkpoints, as TENSORSTORE_GCS_HTTP_URL) and botocore AWS_ENDPOINT_URL_S3 (or
AWS_ENDPOINT_URL), so an emulator or another S3-compatible store needs no flag. Every failure a
user fixes (a scheme typo, a missing bucket, no permission, no credentials, an endpoint that does
not answer) is one UserError naming it; in a training run a store that does not answer is
waited for (`core/outage.py`), for our requests and for those orbax makes through fsspec.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import socket
import threading
from concurrent import futures
from typing import Callable, Optional

from transformer_jax.core import files, outage
from transformer_jax.core.errors import UserError

SCHEMES = {"gs": "Google Cloud Storage", "s3": "Amazon S3 or an S3-compatible store"}
# How long the first request to a bucket may take (connecting, retries included) before the run
# stops with an error saying what it waited for.
TIMEOUT_ENV = "TRANSFORMER_JAX_STORAGE_TIMEOUT"
DEFAULT_TIMEOUT_S = 60.0
RETRIES = 3  # tries of a request (the first included) while the store fails or answers 5xx
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):(/+)(.*)$")


def is_url(path: str) -> bool:
  """True for `scheme://...` (and for `scheme:/...`, a URL with a slash missing)."""
  return bool(_URL.match(str(path)))


def check(path: str, what: str = "--workdir") -> str:
  """`path` ready for the other functions: a local path made absolute, or a URL checked.

  A URL of another scheme (`gcs://`, `s4://`) or with a slash missing (`gs:/b`) is refused in one
  line, so that it never becomes a local folder named `gs:`.
  """
  path = str(path)
  found = _URL.match(path)
  if not found:
    return os.path.abspath(os.path.expanduser(path))
  scheme, slashes, rest = found.groups()
  known = " or ".join(f"{s}://BUCKET/PATH ({name})" for s, name in SCHEMES.items())
  if scheme not in SCHEMES:
    guess = {"gcs": "gs", "gcp": "gs", "google": "gs", "s3a": "s3", "s3n": "s3"}.get(scheme.lower())
    hint = f" (did you mean {guess}://{rest}?)" if guess else ""
    raise UserError(f"{what} {path}: unknown storage scheme {scheme}://{hint}; use {known}, or a "
                    "local path")
  if slashes != "//" or not rest.split("/")[0]:
    raise UserError(f"{what} {path} is not a {scheme}:// URL with a bucket; write it as "
                    f"{scheme}://BUCKET/PATH")
  emulator = os.environ.get("STORAGE_EMULATOR_HOST")
  if scheme == "gs" and emulator and "TENSORSTORE_GCS_HTTP_URL" not in os.environ:
    # One endpoint setting for every library: TensorStore (orbax's checkpoints) reads its own.
    os.environ["TENSORSTORE_GCS_HTTP_URL"] = (emulator if "://" in emulator
                                              else f"http://{emulator}")
    if not os.environ.get("GOOGLE_APPLICATION_CREDENTIALS"):
      # No credentials at an emulator, as gcsfs is given (filesystem: "anon"): TensorStore's
      # own chain would print "Could not find the credentials file" on every run. Its fixed
      # token goes to the emulator alone; real GCS keeps the chain and its warnings.
      os.environ.setdefault("GOOGLE_AUTH_TOKEN_FOR_TESTING", "anonymous")
  return f"{scheme}://{rest.rstrip('/')}"


def split_url(url: str) -> tuple[str, str]:
  """('gs', 'bucket/key') of a URL; one of another scheme is refused as `check` refuses it."""
  scheme, rest = url.split("://", 1) if "://" in url else (None, url)
  if scheme not in SCHEMES:
    check(url, "the path")  # raises its UserError
  return scheme, rest


def bucket_of(url: str) -> str:
  scheme, rest = split_url(url)
  return f"{scheme}://{rest.split('/')[0]}"


def endpoint(scheme: str) -> str:
  """The service a scheme's requests go to, for messages."""
  if scheme == "gs":
    return os.environ.get("STORAGE_EMULATOR_HOST") or "storage.googleapis.com"
  return (os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
          or "Amazon S3")


# ------------------------------------------------------------------------- one filesystem a scheme

_FILESYSTEMS: dict = {}
_FILESYSTEMS_LOCK = threading.Lock()


def _timeout() -> float:
  try:
    return float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))
  except ValueError:
    raise UserError(f"{TIMEOUT_ENV}={os.environ[TIMEOUT_ENV]} is not a number of seconds") from None


def filesystem(scheme: str):
  """The fsspec filesystem of `scheme` (one per process; listings never cached, as other
  processes write the same bucket)."""
  key = (scheme, os.getpid(), os.environ.get("STORAGE_EMULATOR_HOST"),
         os.environ.get("AWS_ENDPOINT_URL_S3"), os.environ.get("AWS_ENDPOINT_URL"),
         os.environ.get("GOOGLE_APPLICATION_CREDENTIALS"))
  with _FILESYSTEMS_LOCK:
    if key not in _FILESYSTEMS:
      timeout = min(_timeout(), 30.0)
      client = {"gs": "gcsfs", "s3": "s3fs"}[scheme]
      try:
        __import__(client)
      except ImportError:
        extra = {"gs": "gcs", "s3": "s3"}[scheme]
        raise UserError(f"a {scheme}:// workdir needs {client}, which is not installed; "
                        f"pip install -e '.[{extra}]' (or pip install {client})") from None
      _check_credentials_file(scheme)
      if scheme == "gs":
        # gcsfs logs a warning per bucket when it cannot ask for the bucket's kind, and a
        # traceback for each failed request; the failures reach the user as one UserError.
        import logging
        logging.getLogger("gcsfs").setLevel(logging.CRITICAL)
        # gcsfs's own chain (Application Default Credentials, then the VM's, then none); at
        # an emulator, a key file named by GOOGLE_APPLICATION_CREDENTIALS or no credentials
        # (the chain would first wait for a metadata server that is not there).
        token = None
        if os.environ.get("STORAGE_EMULATOR_HOST"):
          token = ("google_default" if os.environ.get("GOOGLE_APPLICATION_CREDENTIALS")
                   else "anon")
        fs = _gcs_class()(token=token, requests_timeout=timeout, skip_instance_cache=True,
                          use_listings_cache=False)
      else:
        import fsspec.config
        import s3fs  # imported here: only bucket workdirs need it
        settings = {"connect_timeout": timeout, "read_timeout": timeout,
                    "retries": {"total_max_attempts": RETRIES}}
        fs = s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False,
                               config_kwargs=settings)
        # orbax writes a checkpoint's folders and metadata through etils.epath, which takes
        # fsspec's s3:// filesystem: the same tries and time limits for it (botocore's own, 5
        # tries of a growing backoff, about 10 s at a store that refuses connections), where
        # fsspec's configuration sets none, and its requests ride outages out (`_riding`).
        fsspec.config.conf.setdefault("s3", {}).setdefault("config_kwargs", settings)
        for name in ("s3", "s3a"):
          fsspec.register_implementation(name, _riding(s3fs.S3FileSystem, "_call_s3", "s3"),
                                         clobber=True)
      _fresh_listings(scheme)
      _forget_libraries_filesystems(scheme)
      _FILESYSTEMS[key] = fs
    return _FILESYSTEMS[key]


def _forget_libraries_filesystems(scheme: str) -> None:
  """The filesystems that etils.epath (orbax's) made for `scheme` before, with the endpoints and
  credentials the environment named then, are dropped: epath keeps one per protocol for the
  process, and fsspec one per class and arguments, so a process whose environment now names
  another store (a notebook, a test of another emulator) would go on reading the old one."""
  import fsspec
  for protocol in ({"gs": ("gs", "gcs"), "s3": ("s3", "s3a")}[scheme]):
    try:
      fsspec.get_filesystem_class(protocol).clear_instance_cache()
    except (ImportError, ValueError, AttributeError):  # not installed: nothing was made
      pass
  try:
    from etils.epath import backend
    backend._FileSystemSpecBackend._get_filesystem.cache_clear()  # its lru_cache, all protocols
  except (ImportError, AttributeError):  # another etils: its own caching, if any, stays
    pass


def _fresh_listings(scheme: str) -> None:
  """The filesystems fsspec makes for `scheme` (orbax's, through etils.epath) list the store
  afresh, as the workdir's own do: fsspec keeps listings by default, so orbax would go on
  seeing checkpoint steps deleted by another filesystem (`Manager` removing what an outage
  cut), or long gone where the process read a workdir before (unless fsspec's configuration
  says otherwise)."""
  import fsspec.config
  for protocol in ({"gs": ("gs", "gcs"), "s3": ("s3", "s3a")}[scheme]):
    fsspec.config.conf.setdefault(protocol, {}).setdefault("use_listings_cache", False)


def _gcs_class():
  """gcsfs's filesystem with its requests tried RETRIES times (`_retrying`), for the workdir's
  own requests; orbax writes a checkpoint's folders and metadata through etils.epath, which
  takes fsspec's class for gs:// (gcsfs's extended one), so that class is registered again with
  the same count of tries, its requests riding outages out (`_riding`). Longer outages are
  core/outage.py's to ride out."""
  # The workdir's: the JSON-API filesystem itself, not gcsfs's default subclass for zonal and
  # hierarchical buckets: that one first asks each bucket's layout over gRPC, which an emulator
  # does not answer (it then hangs in retries). Imported here: only bucket workdirs need it.
  import fsspec
  from gcsfs.core import GCSFileSystem
  for name in ("gs", "gcs"):
    registered = fsspec.get_filesystem_class(name)
    if not getattr(registered, "rides_outages", False):
      fsspec.register_implementation(name, _riding(_retrying(registered), "_request", "gs"),
                                     clobber=True)
  return _retrying(GCSFileSystem)


def _riding(base: type, method: str, scheme: str) -> type:
  """`base`, an fsspec filesystem class, whose requests (its coroutine method `method`) ride out
  an outage in a training run as the workdir's own requests do (`ride`: on the same bound and
  clock, said in the same lines), for the filesystems fsspec makes: orbax's, through
  etils.epath, which write a checkpoint's folders, metadata and commit files. A save in flight
  then waits for the store as TensorStore waits with its arrays (train/checkpoint.py), instead
  of failing after the library's few tries and leaving TensorStore's writes to land behind it.
  Outside a training run (`outage.armed`) one try, as before."""
  request = getattr(base, method)

  async def ride(self, *args, **kwargs):
    return await outage.retry_async(lambda: request(self, *args, **kwargs), endpoint(scheme),
                                    "to write or read a checkpoint's files")

  return type(base.__name__, (base,), {method: ride, "rides_outages": True,
                                       "__module__": base.__module__})


def _retrying(base: type) -> type:
  """`base`, a gcsfs class, with its requests tried RETRIES times. gcsfs binds its own count
  (six tries, with 1 + 2 + 4 + 8 + 16 s of sleep between them) to the request method when the
  class is defined, so a `retries` set on an instance changes nothing; here the undecorated
  method is decorated again. (A gcsfs without that layout, or a class with a request method of
  its own, this function's classes included: `base`, unchanged.)"""
  try:
    from gcsfs.core import GCSFileSystem
    from gcsfs.retry import retry_request
    request = GCSFileSystem._request.__wrapped__
  except (ImportError, AttributeError):
    return base
  if base._request is not GCSFileSystem._request:
    return base
  return type(base.__name__, (base,), {"_request": retry_request(retries=RETRIES)(request),
                                       "__module__": base.__module__})


# google-auth fails on a key file that is not there (after gcsfs's chain has waited on its other
# sources); botocore treats a missing shared-credentials file as none, a common way to use none.
_CREDENTIALS_FILES = {"gs": ("GOOGLE_APPLICATION_CREDENTIALS",), "s3": ()}


def _check_credentials_file(scheme: str) -> None:
  """A credentials file that a variable names but that is not there is one line at once (the
  libraries would otherwise go on to their other sources and wait for each)."""
  for variable in _CREDENTIALS_FILES[scheme]:
    path = os.environ.get(variable)
    if path and not os.path.isfile(os.path.expanduser(path)):
      raise UserError(f"{variable} names {path}, which is not a file; point it at the "
                      f"credentials file of {SCHEMES[scheme]} (or unset it)")


def request_failure(url: str, e: BaseException, doing: str) -> Optional[UserError]:
  """The UserError for a failed request about `url`, or None if it is not one a user fixes."""
  scheme, _ = split_url(url)
  bucket = bucket_of(url)
  name = type(e).__name__
  text = str(e).splitlines()[0] if str(e) else name
  credentials = {"gs": "run `gcloud auth application-default login` (or set "
                       "GOOGLE_APPLICATION_CREDENTIALS to a service-account key)",
                 "s3": "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)"}[scheme]
  if name in ("NoCredentialsError", "PartialCredentialsError", "DefaultCredentialsError",
              "RefreshError") or "credentials" in text.lower() and "invalid" not in text.lower():
    return UserError(f"cannot {doing} {url}: no credentials for {SCHEMES[scheme]} ({text}); "
                     f"{credentials}")
  code = getattr(e, "code", None)
  if code == 401 or text.startswith("Anonymous caller"):  # no credentials reached the store
    return UserError(f"cannot {doing} {url}: no valid credentials for {SCHEMES[scheme]} "
                     f"({text}); {credentials}")
  if isinstance(e, PermissionError) or code == 403 or text.startswith("Forbidden"):
    return UserError(f"cannot {doing} {url}: permission denied ({text}); grant this account "
                     f"read and write access to {bucket} (or use another bucket), or check "
                     f"the credentials ({credentials})")
  if "bucket" in text.lower() and ("not exist" in text.lower() or "not found" in text.lower()):
    return UserError(f"cannot {doing} {url}: the bucket {bucket} does not exist; create it "
                     "first or fix the name")
  if "Timeout" in name:  # the library's own time limit (gcsfs's FSTimeoutError, botocore's)
    return UserError(f"cannot {doing} {url}: no answer from {endpoint(scheme)} within "
                     f"{_timeout():.0f} s ({name}, after {RETRIES} attempts); check the network "
                     f"and the endpoint, or raise {TIMEOUT_ENV}")
  if name in ("EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError",
              "ClientConnectorError", "ServerDisconnectedError", "ConnectionError",
              "TimeoutError", "ConnectionRefusedError", "ClientOSError") or name.startswith(
                "ClientConnector") or isinstance(
                e, (ConnectionError, TimeoutError)):
    return UserError(f"cannot {doing} {url}: {endpoint(scheme)} does not answer ({name}: {text}, "
                     f"after {RETRIES} attempts); check the network and the endpoint "
                     "(STORAGE_EMULATOR_HOST for gs://, AWS_ENDPOINT_URL_S3 for s3://)")
  return None


def ride(url: str, doing: str, fn: Callable, *args, **kwargs):
  """fn(*args, **kwargs), a request about `url`: in a training run (`outage.arm`) retried while
  the store does not answer, up to train.storage_outage_s (`core/outage.py`)."""
  if not outage.armed():
    return fn(*args, **kwargs)
  return outage.retry(lambda: fn(*args, **kwargs), endpoint(split_url(url)[0]),
                      f"to {doing} {url}")


def user_failure(url: str, e: BaseException, doing: str) -> Optional[UserError]:
  """The UserError of `request_failure` for a failure met elsewhere (orbax's writes), or None."""
  try:
    return request_failure(url, e, doing)
  except UserError as error:  # a URL of no known scheme
    return error


def _call(url: str, doing: str, fn: Callable, *args, **kwargs):
  """fn(*args, **kwargs), a request about `url`; user-fixable failures become one UserError."""
  try:
    return ride(url, doing, fn, *args, **kwargs)
  except UserError:
    raise
  except FileNotFoundError:
    raise
  except Exception as e:  # the libraries raise many types; request_failure sorts them
    error = request_failure(url, e, doing)
    if error is None:
      raise
    raise error from None


def check_bucket(url: str, what: str = "--workdir") -> None:
  """Raises the UserError for a bucket that is missing, forbidden or unreachable, after at most
  TRANSFORMER_JAX_STORAGE_TIMEOUT seconds (the first request of a run, made before anything is
  written)."""
  scheme, rest = split_url(url)
  bucket = rest.split("/")[0]
  fs = filesystem(scheme)
  seconds = _timeout()

  def probe():
    # A listing of the bucket's top level: it needs the permission to list objects only (an
    # account allowed its objects but not the bucket's metadata passes), and it is empty, not
    # missing, for a bucket that exists.
    try:
      _call(url, "list", fs.ls, bucket, detail=False)
    except FileNotFoundError:
      raise UserError(f"{what} {url}: the bucket {scheme}://{bucket} does not exist; create it "
                      "first or fix the name") from None

  worker = futures.ThreadPoolExecutor(1, thread_name_prefix="storage-probe")
  try:
    worker.submit(probe).result(timeout=seconds)
  except futures.TimeoutError:
    raise UserError(f"{what} {url}: no answer from {endpoint(scheme)} within {seconds:.0f} s "
                    f"(waited for a listing of {scheme}://{bucket}); check the network and the "
                    f"endpoint, or raise {TIMEOUT_ENV}") from None
  finally:
    worker.shutdown(wait=False)


# ------------------------------------------------------------------------- paths, reads and writes

def probe(url: str, seconds: float = 5.0) -> None:
  """Whether the store of `url` answers at all, quickly (a connection to its endpoint, without
  the libraries' retries of a request): raises ConnectionError (or TimeoutError) if not."""
  scheme, _ = split_url(url)
  address = endpoint(scheme)
  if address in ("storage.googleapis.com", "Amazon S3"):
    address = "https://" + ("storage.googleapis.com" if scheme == "gs" else "s3.amazonaws.com")
  found = re.match(r"^(?:(https?)://)?([^/:]+)(?::(\d+))?", address)
  port = int(found.group(3) or (80 if found.group(1) == "http" else 443))
  socket.create_connection((found.group(2), port), timeout=seconds).close()


def join(base: str, *parts: str) -> str:
  if is_url(base):
    return "/".join([base.rstrip("/"), *(p.strip("/") for p in parts)])
  return os.path.join(base, *parts)


def basename(path: str) -> str:
  return path.rstrip("/").rsplit("/", 1)[-1] if is_url(path) else os.path.basename(path)


def dirname(path: str) -> str:
  return path.rstrip("/").rsplit("/", 1)[0] if is_url(path) else os.path.dirname(path)


def on_store(path: str, doing: str, method: str, *args, **kwargs):
  """The filesystem's `method` called on the object key of the URL `path`, through `_call`."""
  scheme, key = split_url(path)
  return _call(path, doing, getattr(filesystem(scheme), method), key, *args, **kwargs)


def exists(path: str) -> bool:
  return os.path.exists(path) if not is_url(path) else bool(on_store(path, "read", "exists"))


def isfile(path: str) -> bool:
  return os.path.isfile(path) if not is_url(path) else bool(on_store(path, "read", "isfile"))


def isdir(path: str) -> bool:
  """On an object store: some object's name starts with `path/`."""
  return os.path.isdir(path) if not is_url(path) else bool(on_store(path, "read", "isdir"))


def listdir(path: str) -> list[str]:
  """The names directly under `path` (sorted); [] if there is nothing."""
  if not is_url(path):
    return sorted(os.listdir(path)) if os.path.isdir(path) else []
  try:
    found = on_store(path, "list", "ls", detail=False)
  except FileNotFoundError:
    return []
  key = split_url(path)[1]
  return sorted({name.rstrip("/").rsplit("/", 1)[-1] for name in found
                 if name.rstrip("/") != key})


def read_bytes(path: str) -> bytes:
  """The content of `path`; FileNotFoundError if there is none."""
  if not is_url(path):
    with open(path, "rb") as f:
      return f.read()
  return on_store(path, "read", "cat_file")


def read_text(path: str) -> str:
  return read_bytes(path).decode("utf-8")


def write(path: str, content: bytes | str, what: str = "") -> str:
  """Writes `content` to `path` whole or not at all; returns `path`.

  Local: `files.atomic_write` (a temporary file and a rename). An object store: one upload,
  which the store publishes only once it is complete (a multipart upload of a large file too).
  """
  if not is_url(path):
    return files.atomic_write(path, content, what)
  data = content.encode("utf-8") if isinstance(content, str) else content
  try:
    on_store(path, "write", "pipe_file", data)
  except FileNotFoundError:  # an upload finds no object missing: its bucket is
    raise no_bucket_error(path, "write") from None
  return path


def no_bucket_error(path: str, doing: str) -> UserError:
  return UserError(f"cannot {doing} {path}: the bucket {bucket_of(path)} does not exist; create "
                   "it first or fix the name")


def remove(path: str) -> None:
  """Deletes the file or object `path` if it exists."""
  try:
    if is_url(path):
      on_store(path, "delete", "rm_file")
    else:
      os.remove(path)
  except FileNotFoundError:
    pass


def remove_tree(path: str) -> None:
  """Deletes the directory `path` and everything under it (an object store: every object whose
  name starts with `path/`), if there is any."""
  if not is_url(path):
    shutil.rmtree(path, ignore_errors=True)
    return
  try:
    on_store(path, "delete", "rm", recursive=True)
  except FileNotFoundError:
    pass


def open_read(path: str):
  """`path` opened for reading in binary, read as it is used (a stream for large files); the
  caller closes it. FileNotFoundError if there is none."""
  return open(path, "rb") if not is_url(path) else on_store(path, "read", "open", "rb")


def sha256(path: str, block: int = 1 << 24) -> str:
  """The sha256 of the content of `path`, read in blocks of `block` bytes (never all of a large
  object in memory at once)."""
  digest = hashlib.sha256()
  with open_read(path) as f:
    while chunk := _call(path, "read", f.read, block):
      digest.update(chunk)
  return digest.hexdigest()


def move(source: str, destination: str) -> None:
  """Moves a file or directory. Local: one rename. An object store has no rename: each object
  is copied, then deleted (not atomic; used only to set aside what is kept for a post-mortem)."""
  if not is_url(source):
    os.makedirs(os.path.dirname(destination), exist_ok=True)
    os.replace(source, destination)
    return
  on_store(source, "move", "mv", split_url(destination)[1], recursive=True)


def makedirs(path: str, what: str = "") -> None:
  """Local: creates the directory (a failure is `files.write_error`'s UserError; `what`: see
  there). An object store has no directories: nothing to do."""
  if is_url(path):
    return
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    raise files.write_error(path, e, what) from None
