"""Downloading and preparing a TFDS dataset (as array_record) on a machine without TensorFlow.

TFDS's builders download with `requests`, parse the raw files themselves and write array_record
without TensorFlow; one step still needs it: TFDS's archive extractor opens and writes files
through `tf.io.gfile` and names them with `tf.compat.as_text`. Where TensorFlow is not installed,
`download_and_prepare` serves those three calls from the standard library while it runs, so that
the paper's `wmt14_translate/de-en` (and `wmt17_translate/de-en`) prepare with the project's
declared dependencies alone. Anything else a builder needs is reported in one line naming what to
install.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import types

from transformer_jax.core import progress
from transformer_jax.core.errors import UserError

TF_EXTRA = "pip install -e '.[tf]'"


def _as_text(value) -> str:
  return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def _open(path, mode: str = "r"):
  return open(os.fspath(path), mode)


# The part of TensorFlow that TFDS's extractor calls, from the standard library.
_TENSORFLOW_STAND_IN = types.SimpleNamespace(
    compat=types.SimpleNamespace(as_text=_as_text),
    io=types.SimpleNamespace(gfile=types.SimpleNamespace(GFile=_open)))


@contextlib.contextmanager
def extraction_without_tensorflow():
  """While open, TFDS extracts archives without TensorFlow (if TensorFlow is not installed)."""
  if importlib.util.find_spec("tensorflow") is not None:
    yield
    return
  from tensorflow_datasets.core.download import extractor  # optional, slow to import
  saved = extractor.tf
  extractor.tf = _TENSORFLOW_STAND_IN
  try:
    yield
  finally:
    extractor.tf = saved


def needs(e: ImportError) -> str:
  """What to install for a module that a TFDS builder could not import."""
  name = (getattr(e, "name", "") or "").split(".")[0]
  if name in ("tensorflow", "tf"):
    return f"TensorFlow, which this project does not install by default: {TF_EXTRA}"
  if name == "apache_beam":
    return "Apache Beam: pip install apache-beam"
  return f"the module {name or e}: pip install {name or '<it>'}"


def _causes(e: BaseException):
  """`e` and the exceptions it was raised from (TFDS wraps a failed import in its own errors)."""
  seen = set()
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    yield e
    e = e.__cause__ or e.__context__


def download_and_prepare(builder, name: str) -> None:
  """Downloads and prepares `builder`'s dataset in its data_dir; a UserError names what failed."""
  import tensorflow_datasets as tfds  # optional, slow to import
  if not progress.enabled():
    tfds.disable_progress_bar()
  print(f"preparing the TFDS dataset {name} in {builder.data_dir} (once; later runs read it)",
        file=sys.stderr, flush=True)
  try:
    with extraction_without_tensorflow():
      builder.download_and_prepare()
  except Exception as e:  # TFDS raises many types; the cause decides the message
    for cause in _causes(e):
      if isinstance(cause, ImportError):
        raise UserError(f"preparing the TFDS dataset {name!r} needs {needs(cause)} (or prepare "
                        "it elsewhere and point data.tfds_data_dir at it)") from None
    for cause in _causes(e):
      if isinstance(cause, OSError):
        text = str(cause).splitlines()[0] if str(cause) else ""
        raise UserError(f"downloading or unpacking the TFDS dataset {name!r} failed "
                        f"({type(cause).__name__}: {text}); check the network and the free "
                        "space, or point data.tfds_data_dir at a prepared copy") from None
    raise
