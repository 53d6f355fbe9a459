"""Dataset sources behind one interface: a split name -> a random-access sequence of
(source_text, target_text) pairs (any object with __len__ and __getitem__, as grain expects).

  data.source=scan   SCAN, generated from its grammar (splits train, test); texts or classes
                     of its commands for the other tasks (see data/scan.py).
  data.source=files  local text in data.path: aligned `SPLIT.SRC` / `SPLIT.TGT` files
                     (data.format=parallel, e.g. train.en + train.de), `SPLIT.tsv` files of
                     `source<TAB>target` lines (data.format=tsv; `text<TAB>label` to classify),
                     or `SPLIT.txt` files of one text a line (data.format=text: (text, "")
                     pairs; blank lines are skipped; data.text_suffix for other names).
  data.source=tfds   a TFDS dataset by name (data.tfds_name, e.g. wmt14_translate/de-en, lm1b,
                     imdb_reviews), read TF-free through tfds.data_source (array_record).

The direction is data.source_lang -> data.target_lang for parallel files and TFDS translation
datasets; a TFDS text dataset gives (data.text_field, "") pairs, or (text, label) with
data.label_field to classify (see `data/tasks.py`).
"""

from __future__ import annotations

import collections.abc
import os
from typing import Sequence

import numpy as np

from transformer_jax.core import files
from transformer_jax.core.errors import UserError
from transformer_jax.data import scan, tfds_prepare

Pairs = Sequence[tuple[str, str]]


def load_split(data_config, split: str) -> Pairs:
  """The pairs of one split of the configured source."""
  if data_config.source == "scan":
    parts = scan.PARTS.get(data_config.scan_split, ("train", "test"))
    if split not in parts:
      raise UserError(f"SCAN's {data_config.scan_split} split has the parts "
                      f"{', '.join(parts)}, not {split!r}")
    read = {"seq2seq": scan.load, "classify": scan.lengths_classified}.get(data_config.task,
                                                                           scan.texts)
    return read(data_config.scan_split, split)
  if data_config.source == "files":
    return load_files(data_config, split)
  if data_config.source == "tfds":
    return load_tfds(data_config, split)
  raise UserError(f"data.source must be one of scan, files, tfds; got {data_config.source!r}")


def gather(pairs: Pairs, indices) -> list[tuple[str, str]]:
  """pairs[i] for each i, in one batched read where the source supports it."""
  if hasattr(pairs, "gather"):
    return pairs.gather(indices)
  return [pairs[int(i)] for i in indices]


class _PairSequence(collections.abc.Sequence):
  """Random access by int, slice (-> list) or `gather(indices)` (-> list)."""

  def __getitem__(self, index):
    if isinstance(index, slice):
      return self.gather(range(len(self))[index])
    index = int(index)
    if index < 0:
      index += len(self)
    if not 0 <= index < len(self):
      raise IndexError(index)
    return self.gather([index])[0]

  def gather(self, indices) -> list[tuple[str, str]]:
    raise NotImplementedError


# ----------------------------------------------------------------------------- local files


def resolve_path(path: str) -> str:
  """A data path as an absolute path; a relative one is relative to the current directory.

  The library never looks beside its own files: installed with `pip install .` it has no
  checkout around it.
  """
  if not path:
    raise UserError("data.path is empty; set it to the directory holding the split files, "
                    "e.g. --config.data.path=../shared/data/multi30k")
  path = os.path.abspath(os.path.expanduser(path))
  if not os.path.isdir(path):
    raise UserError(f"data.path {path} is not a directory; fix data.path (a relative path is "
                    "read from the current directory)")
  return path


class _Lines:
  """The lines of a UTF-8 text file, held as bytes plus line offsets, decoded on access.

  Holding bytes keeps a multi-GB corpus at its file size instead of one Python string per line.
  """

  def __init__(self, path: str):
    self.path = path
    try:
      with open(path, "rb") as f:
        self.data = f.read()
    except OSError as e:
      raise UserError(f"cannot read {path}: {e.strerror}; fix data.path or the file") from None
    if not self.data.strip():
      raise UserError(f"{path} is empty; put one sentence per line in it or fix data.path")
    _check_utf8(self.data, path)
    ends = np.flatnonzero(np.frombuffer(self.data, np.uint8) == ord("\n"))
    if not self.data.endswith(b"\n"):
      ends = np.append(ends, len(self.data))
    starts = np.concatenate([[0], ends[:-1] + 1])
    if self.data.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte order mark is not text
      starts[0] = min(3, ends[0])
    crlf = np.zeros(len(ends), bool)
    nonempty = ends > starts
    crlf[nonempty] = np.frombuffer(self.data, np.uint8)[ends[nonempty] - 1] == ord("\r")
    self.starts, self.ends = starts, ends - crlf

  def __len__(self):
    return len(self.starts)

  def line(self, i: int) -> str:
    return str(memoryview(self.data)[self.starts[i]:self.ends[i]], "utf-8")


def _check_utf8(data: bytes, path: str, chunk: int = 1 << 24) -> None:
  """Raises UserError naming the first line that is not UTF-8."""
  view = memoryview(data)
  start = 0
  while start < len(data):
    # "\n" never occurs inside a multi-byte UTF-8 sequence, so chunks can end after one.
    end = len(data) if start + chunk >= len(data) else data.rfind(b"\n", start, start + chunk) + 1
    end = end if end > start else min(start + chunk, len(data))
    try:
      str(view[start:end], "utf-8")
    except UnicodeDecodeError as e:
      line = data.count(b"\n", 0, start + e.start) + 1
      raise UserError(f"{path} line {line} is not UTF-8 text ({e.reason} at byte "
                      f"{start + e.start}); convert the file to UTF-8, e.g. with iconv") from None
    start = end


class ParallelFiles(_PairSequence):
  """Line i of the source file with line i of the target file."""

  def __init__(self, source_path: str, target_path: str):
    self.source, self.target = _Lines(source_path), _Lines(target_path)
    if len(self.source) != len(self.target):
      raise UserError(f"{source_path} has {len(self.source)} lines but {target_path} has "
                      f"{len(self.target)}; the two files of a split must be aligned line by line")

  def __len__(self):
    return len(self.source)

  def gather(self, indices):
    return [(self.source.line(i), self.target.line(i)) for i in indices]


class TsvFile(_PairSequence):
  """`source<TAB>target` lines."""

  def __init__(self, path: str):
    self.lines = _Lines(path)
    data = np.frombuffer(self.lines.data, np.uint8)
    tabs = np.flatnonzero(data == ord("\t"))
    line_of_tab = np.searchsorted(self.lines.starts, tabs, side="right") - 1
    counts = np.bincount(line_of_tab, minlength=len(self.lines))
    bad = np.flatnonzero(counts != 1)
    if len(bad):
      i = int(bad[0])
      problem = "has no tab" if counts[i] == 0 else f"has {counts[i]} tabs"
      raise UserError(f"{path} line {i + 1} {problem}; each line of a data.format=tsv file must "
                      "be source<TAB>target (or use data.format=parallel for aligned files)")

  def __len__(self):
    return len(self.lines)

  def gather(self, indices):
    return [tuple(self.lines.line(i).split("\t")) for i in indices]


class TextFile(_PairSequence):
  """(line, "") for each line of a text file that is not blank."""

  def __init__(self, path: str):
    self.lines = _Lines(path)
    data = np.frombuffer(self.lines.data, np.uint8)
    visible = np.concatenate([[0], np.cumsum(~np.isin(data, list(b" \t\r\f\v")))])
    self.kept = np.flatnonzero(visible[self.lines.ends] > visible[self.lines.starts])

  def __len__(self):
    return len(self.kept)

  def gather(self, indices):
    return [(self.lines.line(self.kept[i]), "") for i in indices]


def _split_files(directory: str, suffixes: list[str]) -> list[str]:
  """The split names for which `directory` has a file with every suffix (`train.en` -> `train`)."""
  names = set(os.listdir(directory))
  return sorted({n[:-len(suffixes[0])] for n in names if n.endswith(suffixes[0])
                 and all(n[:-len(suffixes[0])] + x in names for x in suffixes)})


def load_files(data_config, split: str) -> Pairs:
  d = data_config
  directory = resolve_path(d.path)
  if d.format in ("tsv", "text"):
    suffixes = [".tsv" if d.format == "tsv" else f".{d.text_suffix}"]
  elif d.format == "parallel":
    suffixes = [f".{d.source_lang}", f".{d.target_lang}"]
  else:
    raise UserError(f"data.format must be one of parallel, tsv, text; got {d.format!r}")
  names = [split + x for x in suffixes]
  paths = [os.path.join(directory, n) for n in names]
  for path in paths:
    found = ", ".join(_split_files(directory, suffixes)) or "none"
    files.check_readable(path, f"data.format={d.format} reads {' and '.join(names)} text files "
                         f"for split {split!r} (splits found in {directory}: {found}); fix "
                         "data.path or the split name (data.train_split / data.eval_split / "
                         "data.test_split)")
  if d.format == "text":
    return TextFile(paths[0])
  return TsvFile(paths[0]) if d.format == "tsv" else ParallelFiles(*paths)


# ----------------------------------------------------------------------------- TFDS

class TfdsPairs(_PairSequence):
  """(source, target) strings from a TFDS random-access source of records: the fields
  `source_field` and `target_field` (translation: the languages), or "" without a target."""

  def __init__(self, records, source_field: str, target_field: str | None):
    self.records, self.source_field, self.target_field = records, source_field, target_field

  def __len__(self):
    return len(self.records)

  def gather(self, indices):
    indices = [int(i) for i in indices]
    try:  # one batched read (parallel in array_record)
      records = self.records.__getitems__(indices)
    except (AttributeError, TypeError):  # no batched read (tfds.testing.mock_data's is broken)
      records = [self.records[i] for i in indices]
    return [(_text(r[self.source_field]),
             _text(r[self.target_field]) if self.target_field else "") for r in records]


def _text(value) -> str:
  return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def _import_tfds():
  try:
    import tensorflow_datasets as tfds  # optional, slow to import
  except ImportError as e:
    raise UserError(f"data.source=tfds needs tensorflow-datasets ({e}); install it with "
                    "pip install -e .") from None
  # TFDS imports its dataset modules lazily; this registers the translation builders (wmt*,
  # ted_*, opus, ...) and the text ones (lm1b, imdb_reviews, glue, ...), which `tfds.builder`
  # does not find by name without TensorFlow otherwise.
  import tensorflow_datasets.text  # noqa: F401 (registers the builders)
  import tensorflow_datasets.translate  # noqa: F401
  return tfds


def tfds_fields(data_config) -> tuple:
  """The record fields that make a pair: (source, target), target None for text tasks."""
  d = data_config
  if d.task == "seq2seq":
    return d.source_lang, d.target_lang
  return d.text_field, d.label_field if d.task == "classify" else None


def tfds_builder(data_config):
  """The TFDS builder of data.tfds_name, checked against data.source_lang / data.target_lang."""
  d = data_config
  tfds = _import_tfds()
  if not d.tfds_name:
    raise UserError("data.tfds_name is empty; name a TFDS dataset, e.g. "
                    "--config.data.tfds_name=wmt14_translate/de-en")
  kwargs = {"file_format": "array_record"}  # the random-access, TF-free format
  if d.tfds_data_dir:
    kwargs["data_dir"] = os.path.expanduser(d.tfds_data_dir)
  try:
    builder = tfds.builder(d.tfds_name, **kwargs)
  except tfds.core.DatasetNotFoundError:
    raise UserError(f"unknown TFDS dataset {d.tfds_name!r} (data.tfds_name); use a name from "
                    "https://www.tensorflow.org/datasets/catalog/overview#translate, e.g. "
                    "wmt14_translate/de-en") from None
  except ImportError as e:
    raise UserError(f"the TFDS dataset {d.tfds_name!r} needs {tfds_prepare.needs(e)}") from None
  except ValueError as e:  # an unknown config (language pair) or version
    configs = [c.name for c in getattr(_safe_builder_cls(tfds, d.tfds_name), "BUILDER_CONFIGS",
                                       None) or []]
    known = f" (its configs: {', '.join(configs[:20])})" if configs else ""
    raise UserError(f"cannot build TFDS dataset {d.tfds_name!r}{known}: "
                    f"{str(e).splitlines()[0]}; fix data.tfds_name") from None
  fields = _languages(builder)
  keys = (("data.source_lang", "data.target_lang") if d.task == "seq2seq"
          else ("data.text_field", "data.label_field"))
  for key, field in zip(keys, tfds_fields(d)):
    if fields is not None and field is not None and field not in fields:
      kind = "languages" if d.task == "seq2seq" else "fields"
      raise UserError(f"the TFDS dataset {d.tfds_name!r} has the {kind} "
                      f"{', '.join(fields)}, not {key}={field!r}; fix {key}")
  return builder


def _safe_builder_cls(tfds, name):
  try:
    return tfds.builder_cls(name.split("/")[0].split(":")[0])
  except Exception:  # only used to improve a message
    return None


def _languages(builder):
  features = builder.info.features
  if hasattr(features, "languages"):  # tfds.features.Translation
    return list(features.languages)
  if hasattr(features, "keys"):
    return list(features.keys())
  return None


def load_tfds(data_config, split: str) -> Pairs:
  d = data_config
  builder = tfds_builder(d)
  if not builder.is_prepared():
    if not d.tfds_download:
      raise UserError(f"the TFDS dataset {d.tfds_name!r} is not prepared in {builder.data_dir}; "
                      "set data.tfds_download=True or point data.tfds_data_dir at a prepared copy")
    tfds_prepare.download_and_prepare(builder, d.tfds_name)
  try:
    records = builder.as_data_source(split=split)
  except NotImplementedError:
    raise UserError(f"the TFDS dataset {d.tfds_name!r} in {builder.data_dir} is not stored as "
                    "array_record, so it has no TF-free random access; prepare it again into an "
                    "empty data.tfds_data_dir") from None
  except (ValueError, KeyError) as e:
    splits = ", ".join(builder.info.splits.keys())
    raise UserError(f"the TFDS dataset {d.tfds_name!r} has no split {split!r} "
                    f"({str(e).splitlines()[0]}); its splits: {splits or 'unknown'}; fix "
                    "data.train_split / data.eval_split / data.test_split") from None
  return TfdsPairs(records, *tfds_fields(d))
