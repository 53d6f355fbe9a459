"""Workdir paths that may be URLs: every workdir read and write goes through here.

A path is a local path or `gs://BUCKET/KEY` (Google Cloud Storage, through gcsfs) or
`s3://BUCKET/KEY` (Amazon S3 or an S3-compatible store, through s3fs). Local paths behave exactly
as `core/files.py` and `core/lock.py` make them behave; each guarantee those give is redone here
for object stores, one implementation per kind of storage behind one set of functions:

- whole-or-nothing writes (`write`): local, a temporary file and a rename; an object store, one
  upload, which the store publishes whole or not at all;
- append-safe JSON-lines logs (`JsonLog`, `read_jsonl`, `rewrite_jsonl`): local, appends to one
  file; an object store has no append, so each record is one numbered chunk object under
  `PATH.parts/` and readers concatenate the chunks in order;
- one writer per workdir (`lock`): local, flock; an object store, a lease object (`Lease`).

Endpoints: gcsfs reads STORAGE_EMULATOR_HOST (and `check` passes it on to TensorStore, which
writes orbax's checkpoints, as TENSORSTORE_GCS_HTTP_URL) and botocore AWS_ENDPOINT_URL_S3 (or
AWS_ENDPOINT_URL), so an emulator or another S3-compatible store needs no flag. Every failure a
user fixes (a scheme typo, a missing bucket, no permission, no credentials, an endpoint that does
not answer) is one UserError naming it.
"""

from __future__ import annotations

import atexit
import datetime
import errno
import hashlib
import json
import os
import re
import shutil
import socket
import sys
import threading
import time
import uuid
import weakref
from concurrent import futures
from typing import Callable, Optional

from transformer_jax.core import files, outage
from transformer_jax.core import lock as lock_lib
from transformer_jax.core.errors import UserError

SCHEMES = {"gs": "Google Cloud Storage", "s3": "Amazon S3 or an S3-compatible store"}
# How long the first request to a bucket may take (connecting, retries included) before the run
# stops with an error saying what it waited for.
TIMEOUT_ENV = "TRANSFORMER_JAX_STORAGE_TIMEOUT"
DEFAULT_TIMEOUT_S = 60.0
RETRIES = 3  # tries of a request (the first included) while the store fails or answers 5xx
PARTS_SUFFIX = ".parts"  # metrics.jsonl on an object store: metrics.jsonl.parts/000000001.jsonl
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


def _split(url: str) -> tuple[str, str]:
  """('gs', 'bucket/key') of a URL; one of another scheme is refused as `check` refuses it."""
  scheme, rest = url.split("://", 1) if "://" in url else (None, url)
  if scheme not in SCHEMES:
    check(url, "the path")  # raises its UserError
  return scheme, rest


def bucket_of(url: str) -> str:
  scheme, rest = _split(url)
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
      _FILESYSTEMS[key] = fs
    return _FILESYSTEMS[key]


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
  an outage in a training run as the workdir's own requests do (`_ride`: on the same bound and
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


def _failure(url: str, e: BaseException, doing: str) -> Optional[UserError]:
  """The UserError for a failed request about `url`, or None if it is not one a user fixes."""
  scheme, _ = _split(url)
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


def _ride(url: str, doing: str, fn: Callable, *args, **kwargs):
  """fn(*args, **kwargs), a request about `url`: in a training run (`outage.arm`) retried while
  the store does not answer, up to train.storage_outage_s (`core/outage.py`)."""
  if not outage.armed():
    return fn(*args, **kwargs)
  return outage.retry(lambda: fn(*args, **kwargs), endpoint(_split(url)[0]),
                      f"to {doing} {url}")


def user_failure(url: str, e: BaseException, doing: str) -> Optional[UserError]:
  """The UserError of `_failure` for a failure met elsewhere (orbax's writes), or None."""
  try:
    return _failure(url, e, doing)
  except UserError as error:  # a URL of no known scheme
    return error


def _call(url: str, doing: str, fn: Callable, *args, **kwargs):
  """fn(*args, **kwargs), a request about `url`; user-fixable failures become one UserError."""
  try:
    return _ride(url, doing, fn, *args, **kwargs)
  except UserError:
    raise
  except FileNotFoundError:
    raise
  except Exception as e:  # the libraries raise many types; _failure sorts them
    error = _failure(url, e, doing)
    if error is None:
      raise
    raise error from None


def check_bucket(url: str, what: str = "--workdir") -> None:
  """Raises the UserError for a bucket that is missing, forbidden or unreachable, after at most
  TRANSFORMER_JAX_STORAGE_TIMEOUT seconds (the first request of a run, made before anything is
  written)."""
  scheme, rest = _split(url)
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
  scheme, _ = _split(url)
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


def exists(path: str) -> bool:
  if not is_url(path):
    return os.path.exists(path)
  scheme, key = _split(path)
  return bool(_call(path, "read", filesystem(scheme).exists, key))


def isfile(path: str) -> bool:
  if not is_url(path):
    return os.path.isfile(path)
  scheme, key = _split(path)
  return bool(_call(path, "read", filesystem(scheme).isfile, key))


def isdir(path: str) -> bool:
  """On an object store: some object's name starts with `path/`."""
  if not is_url(path):
    return os.path.isdir(path)
  scheme, key = _split(path)
  return bool(_call(path, "read", filesystem(scheme).isdir, key))


def listdir(path: str) -> list[str]:
  """The names directly under `path` (sorted); [] if there is nothing."""
  if not is_url(path):
    return sorted(os.listdir(path)) if os.path.isdir(path) else []
  scheme, key = _split(path)
  try:
    found = _call(path, "list", filesystem(scheme).ls, key, detail=False)
  except FileNotFoundError:
    return []
  return sorted({name.rstrip("/").rsplit("/", 1)[-1] for name in found
                 if name.rstrip("/") != key})


def read_bytes(path: str) -> bytes:
  """The content of `path`; FileNotFoundError if there is none."""
  if not is_url(path):
    with open(path, "rb") as f:
      return f.read()
  scheme, key = _split(path)
  return _call(path, "read", filesystem(scheme).cat_file, key)


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
  scheme, key = _split(path)
  try:
    _call(path, "write", filesystem(scheme).pipe_file, key, data)
  except FileNotFoundError:  # an upload finds no object missing: its bucket is
    raise _no_bucket(path, "write") from None
  return path


def _no_bucket(path: str, doing: str) -> UserError:
  return UserError(f"cannot {doing} {path}: the bucket {bucket_of(path)} does not exist; create "
                   "it first or fix the name")


def create(path: str, content: bytes | str) -> bool:
  """Writes `content` to `path` only if nothing is there; True if it did.

  The precondition is the store's own (GCS `ifGenerationMatch=0`, S3 `If-None-Match: *`), so of
  two processes creating one object at once exactly one succeeds.
  """
  data = content.encode("utf-8") if isinstance(content, str) else content
  if not is_url(path):
    try:
      fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
      return False
    with os.fdopen(fd, "wb") as f:
      f.write(data)
    return True
  scheme, key = _split(path)
  try:
    _call(path, "write", filesystem(scheme).pipe_file, key, data, mode="create")
  except FileExistsError:
    return False
  except FileNotFoundError:
    raise _no_bucket(path, "write") from None
  return True


def version(path: str) -> Optional[str]:
  """The store's version of the object `path` (GCS generation, S3 ETag), None if there is none."""
  scheme, key = _split(path)
  try:
    info = _call(path, "read", filesystem(scheme).info, key)
  except FileNotFoundError:
    return None
  found = info.get("generation") if scheme == "gs" else info.get("ETag")
  return None if found is None else str(found)


def remove_if(path: str, at_version: str) -> bool:
  """Deletes the object `path` only if it is still at `at_version` (see `version`); True if it
  did. The store's precondition decides (GCS `ifGenerationMatch`, S3 `If-Match`), so of several
  processes deleting one object they all read at that version, exactly one succeeds, and none
  deletes a newer object written meanwhile."""
  scheme, key = _split(path)
  fs = filesystem(scheme)
  bucket, _, name = key.partition("/")
  try:
    if scheme == "gs":
      _ride(path, "delete", fs.call, "DELETE", "b/{}/o/{}", bucket, name,
            ifGenerationMatch=at_version)
    else:
      _ride(path, "delete", fs.call_s3, "delete_object", Bucket=bucket, Key=name,
            IfMatch=at_version)
  except (FileNotFoundError, FileExistsError):  # gone already, or (gcsfs: 412) changed
    return False
  except OSError as e:
    if scheme == "s3" and e.errno == errno.EINVAL:  # s3fs: 412 Precondition Failed
      return False
    raise _failure(path, e, "delete") or e from None
  return True


def write_if(path: str, content: bytes | str, at_version: str) -> Optional[str]:
  """Replaces the object `path` with `content` only if it is still at `at_version` (see
  `version`); its new version, or None if it changed or is gone meanwhile (GCS
  `ifGenerationMatch`, S3 `If-Match`: the store decides, in the same request)."""
  data = content.encode("utf-8") if isinstance(content, str) else content
  scheme, key = _split(path)
  fs = filesystem(scheme)
  bucket, _, name = key.partition("/")
  try:
    if scheme == "gs":
      answer = _ride(path, "write", fs.call, "POST",
                     fs._location + "/upload/storage/v1/b/{}/o", bucket, uploadType="media",
                     name=name, ifGenerationMatch=at_version, data=data, json_out=True)
      return str(answer["generation"])
    return _ride(path, "write", fs.call_s3, "put_object", Bucket=bucket, Key=name, Body=data,
                 IfMatch=at_version)["ETag"]
  except (FileNotFoundError, FileExistsError):  # gone, or (gcsfs: 412) changed
    return None
  except OSError as e:
    if scheme == "s3" and e.errno == errno.EINVAL:  # s3fs: 412 Precondition Failed
      return None
    raise _failure(path, e, "write") or e from None


def remove(path: str) -> None:
  """Deletes the file or object `path` if it exists."""
  if not is_url(path):
    try:
      os.remove(path)
    except FileNotFoundError:
      pass
    return
  scheme, key = _split(path)
  try:
    _call(path, "delete", filesystem(scheme).rm_file, key)
  except FileNotFoundError:
    pass


def remove_tree(path: str) -> None:
  """Deletes the directory `path` and everything under it (an object store: every object whose
  name starts with `path/`), if there is any."""
  if not is_url(path):
    shutil.rmtree(path, ignore_errors=True)
    return
  scheme, key = _split(path)
  try:
    _call(path, "delete", filesystem(scheme).rm, key, recursive=True)
  except FileNotFoundError:
    pass


def open_read(path: str):
  """`path` opened for reading in binary, read as it is used (a stream for large files); the
  caller closes it. FileNotFoundError if there is none."""
  if not is_url(path):
    return open(path, "rb")
  scheme, key = _split(path)
  return _call(path, "read", filesystem(scheme).open, key, "rb")


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
  scheme, key = _split(source)
  _call(source, "move", filesystem(scheme).mv, key, _split(destination)[1], recursive=True)


def makedirs(path: str) -> None:
  """Local: creates the directory (a failure is `files.write_error`'s UserError). An object store
  has no directories: nothing to do."""
  if is_url(path):
    return
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    raise files.write_error(path, e) from None


# ------------------------------------------------------------------------- JSON-lines logs

def _parts(path: str) -> list[str]:
  """The chunk objects of an object-store log, in order."""
  directory = path + PARTS_SUFFIX
  return [join(directory, name) for name in listdir(directory) if name.endswith(".jsonl")]


def _parse_lines(data: bytes, where: str, bad: list) -> list[dict]:
  records = []
  for number, line in enumerate(data.splitlines(), 1):
    if not line.strip():
      continue
    try:
      record = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
      record = None
    if isinstance(record, dict):
      records.append(record)
    else:
      bad.append(f"{where}:{number}")
  return records


def read_jsonl(path: str, err=None) -> list[dict]:
  """The records of a JSON-lines log (see `JsonLog`): local, `files.read_jsonl`; an object store,
  the object `path` if any, then its chunks in order."""
  if not is_url(path):
    return files.read_jsonl(path, err)
  records, bad = [], []
  for part in ([path] if isfile(path) else []) + _parts(path):
    records += _parse_lines(read_bytes(part), basename(part), bad)
  if bad:
    print(f"warning: skipped {len(bad)} unreadable line(s) of {path} ({', '.join(bad[:10])}): "
          "damaged records", file=err or sys.stderr, flush=True)
  return records


def log_exists(path: str) -> bool:
  """True if the JSON-lines log `path` has any record file (local: the file)."""
  if not is_url(path):
    return os.path.isfile(path)
  return isfile(path) or bool(_parts(path))


def rewrite_jsonl(path: str, keep: Callable[[dict], bool]) -> int:
  """Drops the records for which `keep` is False, each file or chunk rewritten whole; returns
  how many were dropped."""
  if not is_url(path):
    return files.rewrite_jsonl(path, keep)
  dropped = 0
  for part in ([path] if isfile(path) else []) + _parts(path):
    lines = read_bytes(part).splitlines(keepends=True)
    kept = []
    for line in lines:
      try:
        record = json.loads(line.decode("utf-8"))
      except (UnicodeDecodeError, ValueError):
        record = None
      if not (isinstance(record, dict) and not keep(record)):
        kept.append(line)
    if len(kept) < len(lines):
      dropped += len(lines) - len(kept)
      if kept:
        write(part, b"".join(kept))
      else:
        remove(part)
  return dropped


def set_aside_partial_line(path: str, err=None) -> int:
  """Local: `files.set_aside_partial_line`. An object store has no cut-off records (every chunk
  is uploaded whole): 0."""
  return 0 if is_url(path) else files.set_aside_partial_line(path, err)


class _Uploads:
  """Runs uploads in order on one background thread, so that the caller (the training loop)
  never waits for a request. A failed upload is raised by the next `submit` or by `close`; the
  uploads queued after it are dropped unrun (a log with a chunk missing is not continued, and a
  run on its way out after an outage does not wait out each one's tries)."""

  def __init__(self):
    self._pool = futures.ThreadPoolExecutor(1, thread_name_prefix="storage-upload")
    self._pending: list = []
    self._failed = False

  def _run(self, upload: Callable[[], object]) -> None:
    if self._failed:
      return
    try:
      upload()
    except BaseException:
      self._failed = True
      raise

  def _raise_failures(self, wait: bool) -> None:
    keep = []
    for future in self._pending:
      if wait or future.done():
        future.result()  # raises the upload's UserError
      else:
        keep.append(future)
    self._pending = keep

  def submit(self, upload: Callable[[], object]) -> None:
    self._raise_failures(wait=False)
    self._pending.append(self._pool.submit(self._run, upload))

  def close(self) -> None:
    try:
      self._raise_failures(wait=True)
    finally:
      self._pool.shutdown(wait=True)


class _Chunks:
  """Appends on an object store: objects `name(n)`, n = start, start + 1, ..., uploaded in order
  on `_Uploads`' background thread (`close` waits for them).

  Each upload takes everything appended since the previous one began: one record an object
  while the uploads keep up (a run logging every few seconds), several when records come
  faster than requests (a logged step of a few ms), so that the requests, and the background
  thread's hold on the GIL, never grow with the rate of the caller's appends.
  """

  def __init__(self, name, start: int = 0):
    self._name, self._next, self._uploads = name, start, _Uploads()
    self._waiting: list = []  # appended, not yet taken by an upload
    self._queued = False  # an upload that will take them is queued
    self._lock = threading.Lock()

  def append(self, data: bytes) -> None:
    with self._lock:
      self._waiting.append(data)
      if self._queued:
        return
      self._queued = True
    try:
      self._uploads.submit(self._upload)
    except BaseException:  # an earlier upload failed: raised here, nothing new queued
      with self._lock:
        self._queued = False
      raise

  def _upload(self) -> None:
    with self._lock:
      data, self._waiting, self._queued = b"".join(self._waiting), [], False
      number, self._next = self._next, self._next + 1
    write(self._name(number), data)

  def close(self) -> None:
    self._uploads.close()


class JsonLog:
  """Appends one JSON object per line to the log `path`.

  Local: `files.JsonLog` (appends to the file). An object store: the records go to chunk
  objects PATH.parts/NNNNNNNNN.jsonl (one record each, or several appended while the previous
  upload ran: `_Chunks`), numbered after the chunks already there, so a writer killed at any
  moment leaves only whole records and a later writer never overwrites an earlier one. The
  uploads run on a background thread in order (`close` waits for them); a process killed within
  a request's time of an `append` may lose that record.
  """

  def __init__(self, path: str, err=None):
    self.path = path
    if not is_url(path):
      self._local, self._chunks = files.JsonLog(path, err), None
      return
    names = [basename(p) for p in _parts(path)]
    after = max((int(n.split(".")[0]) for n in names if n.split(".")[0].isdigit()), default=0)
    self._local = None
    self._chunks = _Chunks(lambda n: join(path + PARTS_SUFFIX, f"{n:09d}.jsonl"), after + 1)

  def append(self, record: dict) -> None:
    if self._local is not None:
      self._local.append(record)
    else:
      self._chunks.append((json.dumps(record) + "\n").encode("utf-8"))

  def close(self) -> None:
    (self._chunks if self._local is None else self._local).close()


class AppendFile:
  """Appends binary records to `path`. Local: `files.AppendFile` (one file). An object store:
  objects PATH.NNNNNN of one or more appends each (TensorBoard reads every event file of a
  directory in name order, so event files stay readable as a sequence), uploaded as `JsonLog`'s
  chunks are."""

  def __init__(self, path: str):
    self.path = path
    self._file = (_Chunks(lambda n: f"{path}.{n:06d}") if is_url(path)
                  else files.AppendFile(path))

  def append(self, data: bytes) -> None:
    self._file.append(data)

  def close(self) -> None:
    self._file.close()


def append_jsonl(path: str, record: dict) -> None:
  """One record appended to the log `path` (see JsonLog), for logs written now and then."""
  log = JsonLog(path)
  try:
    log.append(record)
  finally:
    log.close()


# ------------------------------------------------------------------------- one writer: a lease

LEASE_SECONDS = 60.0  # a lease not renewed for this long is taken over
RENEW_EVERY_S = 20.0  # how often a live run renews its lease (one conditional write each)


def _now() -> float:
  return time.time()


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except (PermissionError, OSError):
    return True
  return True


class Lease:
  """One writer per object-store directory: the object DIR/lock, created with the store's
  precondition (see `create`), renewed by a background thread, deleted at a clean end.

  A lease that has not been renewed for `seconds` (its run was killed, or its machine lost) is
  taken over by the next run; so is one left by a dead process of this same host, at once. The
  interface is `core.lock.DirectoryLock`'s: `check`, `acquire`, `release`, `held`.

  Costs: one conditional write every `renew_every` seconds while a run lives (180 an hour at
  the defaults), plus a few requests at start and end. A run killed without a clean end
  blocks a run on another machine for at most `seconds` after its last renewal.
  """

  def __init__(self, directory: str, what: str = "--workdir", seconds: float = LEASE_SECONDS,
               renew_every: float = RENEW_EVERY_S):
    self.directory = directory
    self.path = join(directory, lock_lib.FILENAME)
    self.what = what
    self.seconds = seconds
    self.renew_every = renew_every
    self.lost = False  # set when another run took the lease over from under this one
    self._token = None
    self._version = None  # the store's version of this run's lease object, while it holds it
    self._stop = threading.Event()
    self._thread = None

  def _read(self) -> Optional[dict]:
    try:
      return self._parse(read_bytes(self.path))
    except FileNotFoundError:
      return None

  def _read_versioned(self) -> tuple[Optional[dict], Optional[str]]:
    """(the holder's record, the object's version): the version is asked first, so that the
    record read is of that version or a newer one (a delete conditioned on it then fails)."""
    at_version = version(self.path)
    try:
      raw = read_bytes(self.path)
    except FileNotFoundError:
      return None, None
    return self._parse(raw), at_version

  @staticmethod
  def _parse(raw: bytes) -> dict:
    try:
      holder = json.loads(raw.decode("utf-8"))
      return holder if isinstance(holder, dict) else {}
    except (UnicodeDecodeError, ValueError):
      return {}  # damaged: treated as expired

  def _expired(self, holder: dict) -> bool:
    renewed = holder.get("renewed")
    if not isinstance(renewed, (int, float)):
      return True
    if holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int):
      if holder["pid"] != os.getpid() and not _pid_alive(holder["pid"]):
        return True  # its process is gone: no need to wait for the lease to run out
    return _now() > renewed + float(holder.get("seconds", self.seconds))

  def _refusal(self, holder: dict) -> UserError:
    left = float(holder.get("renewed", 0)) + float(holder.get("seconds", self.seconds)) - _now()
    text = lock_lib._holder_text(json.dumps(holder).encode("utf-8"))
    return UserError(f"{self.what} {self.directory} is in use by {text}; only one run may write "
                     "it: wait for that run to end (or stop it), or use another directory (if it "
                     f"was killed, its lease runs out in {max(left, 0):.0f} s)")

  def check(self) -> None:
    """Raises the refusal if another run holds a live lease now; writes nothing."""
    holder = self._read()
    if holder is not None and holder.get("token") != self._token and not self._expired(holder):
      raise self._refusal(holder)

  def _record(self, since: str) -> bytes:
    return json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "since": since,
                       "command": " ".join(sys.argv)[:300], "token": self._token,
                       "renewed": _now(), "seconds": self.seconds}).encode("utf-8")

  def acquire(self) -> None:
    """Takes the lease or raises a UserError naming its holder."""
    token = uuid.uuid4().hex
    since = datetime.datetime.now().isoformat(timespec="seconds")
    for _ in range(3):
      holder, at_version = self._read_versioned()
      if holder is not None:
        if not self._expired(holder):
          raise self._refusal(holder)
        text = lock_lib._holder_text(json.dumps(holder).encode("utf-8"))
        print(f"warning: the previous run in {self.directory} ({text}) did not end cleanly; "
              "taking over its lease", file=sys.stderr, flush=True)
        # Only the stale version: of two runs taking over at once one deletes it, the other's
        # delete fails (it never deletes the lease the first then creates), and a renewal
        # meanwhile keeps its lease.
        if at_version is not None:
          remove_if(self.path, at_version)
      self._token = token
      if create(self.path, self._record(since)):
        self._version = version(self.path)  # each renewal replaces exactly this version
        break
      self._token = None  # another run created it between our read and our write
    else:
      raise self._refusal(self._read() or {})
    self._since = since
    self._stop.clear()
    self._thread = threading.Thread(target=self._renew, name="storage-lease", daemon=True)
    self._thread.start()
    atexit.register(_release, weakref.ref(self))

  def _renew(self) -> None:
    while not self._stop.wait(self.renew_every):
      try:
        # One conditional write: it replaces this run's own last version or nothing, so a run
        # that stalled past its lease never overwrites the lease another run took meanwhile.
        renewed = write_if(self.path, self._record(self._since), self._version)
        if renewed is None:
          self.lost = True
          holder = self._read()
          print(f"warning: the lease on {self.directory} was taken over by another run "
                f"({lock_lib._holder_text(json.dumps(holder or {}).encode())}); this run no "
                "longer holds it", file=sys.stderr, flush=True)
          return
        self._version = renewed
      except Exception as e:  # a failed renewal is retried at the next one
        if outage.ongoing() or outage.unreachable(e):
          continue  # an outage, said once by core/outage.py (and the run's writes end it)
        print(f"warning: could not renew the lease on {self.directory}: "
              f"{' '.join(str(e).split())}", file=sys.stderr, flush=True)

  def release(self) -> None:
    """Stops renewing and deletes the lease if it is still this run's."""
    if self._token is None:
      return
    self._stop.set()
    if self._thread is not None and self._thread is not threading.current_thread():
      self._thread.join(timeout=5)
    try:
      if self._version is not None:
        remove_if(self.path, self._version)  # this run's own version, never a taker's lease
    except Exception:
      pass  # the lease then runs out by itself
    self._token = self._version = None

  @property
  def held(self) -> bool:
    return self._token is not None

  def __enter__(self) -> "Lease":
    return self

  def __exit__(self, *exc) -> None:
    self.release()


def _release(reference: weakref.ref) -> None:
  held = reference()
  if held is not None:
    held.release()


def lock(directory: str, what: str = "--workdir"):
  """The one-writer lock of `directory`: a `core.lock.DirectoryLock` (flock) for a local
  directory, a `Lease` for an object-store one."""
  if is_url(directory):
    return Lease(directory, what)
  return lock_lib.DirectoryLock(directory, what)
