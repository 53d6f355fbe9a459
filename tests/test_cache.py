"""The tokenised-data cache: written once, read back verified, rebuilt when damaged, safe with
several writers; and a run's second start reads neither the text nor trains a tokenizer."""

import contextlib
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from tests import emulators
from transformer_jax.core import storage
from transformer_jax.core.errors import UserError
from transformer_jax.data import cache, pipeline, prepare, sources
from transformer_jax.data import tokenizer as tokenizer_lib
from transformer_jax.experiments import tiny

KEY = {"data": {"source": "test", "n": 3}, "tokenizer": "abc"}
VOCAB = 48  # the word vocabulary of the text below: 40 words and 4 special ids


def arrays(seed=0):
  rng = np.random.default_rng(seed)
  return {"tokens": rng.integers(0, 60000, 1000).astype(np.uint16),
          "offsets": np.cumsum(rng.integers(1, 9, 101)).astype(np.int64),
          "empty": np.zeros(0, np.int32)}


class Builds:
  """build() for cache.fetch that counts its calls."""

  def __init__(self, seed=0, seconds=0.0):
    self.calls, self.seed, self.seconds = 0, seed, seconds

  def __call__(self):
    self.calls += 1
    time.sleep(self.seconds)  # long enough for other writers to start meanwhile
    return arrays(self.seed)


def assert_same(a, b):
  assert a.keys() == b.keys()
  for name in a:
    assert a[name].dtype == b[name].dtype
    np.testing.assert_array_equal(a[name], b[name])


def entry_of(root, key=KEY, kind="encoded"):
  return os.path.join(root, kind, cache.key_hash(key))


@contextlib.contextmanager
def _no_tokenising(monkeypatch, who: str):
  """Fails the test if, inside, anything trains a tokenizer, tokenises, or reads the text."""

  def forbidden(*args, **kwargs):
    raise AssertionError(f"{who} tokenised or read the text")

  with monkeypatch.context() as patch:
    for module, name in ((pipeline, "encode_corpus"), (tokenizer_lib, "train"),
                         (sources.LazyPairs, "pairs")):
      patch.setattr(module, name, property(forbidden) if name == "pairs" else forbidden)
    yield


def test_an_entry_is_built_once_then_read_back_memory_mapped(tmp_path):
  build = Builds()
  first = cache.fetch(str(tmp_path), "encoded", KEY, build)
  again = cache.fetch(str(tmp_path), "encoded", KEY, build)
  assert build.calls == 1
  assert_same(first, arrays())
  assert_same(again, arrays())
  assert isinstance(again["tokens"], np.memmap)  # read from the file, not copied into memory
  other = cache.fetch(str(tmp_path), "encoded", {**KEY, "tokenizer": "xyz"}, Builds(seed=1))
  assert_same(other, arrays(seed=1))  # another key, another entry
  assert sorted(os.listdir(tmp_path / "encoded")) == sorted(
      [cache.key_hash(KEY), cache.key_hash({**KEY, "tokenizer": "xyz"})]
      + [cache.key_hash(KEY) + ".lock", cache.key_hash({**KEY, "tokenizer": "xyz"}) + ".lock"])
  assert cache.fetch(None, "encoded", KEY, build) is not None and build.calls == 2  # no cache


def _flip_a_byte(entry):
  path = os.path.join(entry, "tokens.npy")
  data = bytearray(open(path, "rb").read())
  data[-7] ^= 0x10
  open(path, "wb").write(bytes(data))


def _truncate(entry):
  path = os.path.join(entry, "offsets.npy")
  os.truncate(path, os.path.getsize(path) - 8)


def _remove_a_file(entry):
  os.remove(os.path.join(entry, "tokens.npy"))


def _garbage_meta(entry):
  open(os.path.join(entry, cache.META), "w").write('{"version": 1, "ke')


def _other_key(entry):
  meta = json.load(open(os.path.join(entry, cache.META)))
  meta["key"]["tokenizer"] = "someone else's"
  json.dump(meta, open(os.path.join(entry, cache.META), "w"))


@pytest.mark.parametrize("damage", [_flip_a_byte, _truncate, _remove_a_file, _garbage_meta,
                                    _other_key])
def test_a_damaged_entry_is_reported_and_built_again(tmp_path, capsys, damage):
  cache.fetch(str(tmp_path), "encoded", KEY, Builds())
  damage(entry_of(tmp_path))
  build = Builds()
  fetched = cache.fetch(str(tmp_path), "encoded", KEY, build)
  assert build.calls == 1
  assert_same(fetched, arrays())
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and err.startswith("warning: the cache entry") and "damaged" in err
  build = Builds()
  assert_same(cache.fetch(str(tmp_path), "encoded", KEY, build), arrays())
  assert build.calls == 0  # the rebuilt entry is whole
  assert not [n for n in os.listdir(tmp_path / "encoded") if n.startswith(".")]  # no debris


def test_a_write_cut_off_midway_is_never_read(tmp_path, monkeypatch):
  """A writer killed mid-write leaves a temporary directory, never a half entry."""
  def dies(*args, **kwargs):
    raise KeyboardInterrupt  # as if killed while saving the second array

  calls = []
  save = np.save
  monkeypatch.setattr(np, "save", lambda *a, **k: (calls.append(1), save(*a, **k))
                      if not calls else dies())
  with pytest.raises(KeyboardInterrupt):
    cache.fetch(str(tmp_path), "encoded", KEY, Builds())
  monkeypatch.setattr(np, "save", save)
  assert not os.path.exists(entry_of(tmp_path))
  # What a SIGKILL leaves (no `finally` runs): a temporary directory beside the entry.
  debris = tmp_path / "encoded" / f".{cache.key_hash(KEY)}.killed"
  debris.mkdir()
  (debris / "tokens.npy").write_bytes(b"\x93NUMPY half")
  build = Builds()
  assert_same(cache.fetch(str(tmp_path), "encoded", KEY, build), arrays())
  assert build.calls == 1
  assert not debris.exists()  # cleared by the next writer, holding the lock


def test_an_unwritable_cache_costs_a_warning_only(tmp_path, capsys, monkeypatch):
  def full_disk(*args, **kwargs):
    raise OSError(28, "No space left on device")

  monkeypatch.setattr(cache.os, "fsync", full_disk)
  build = Builds()
  assert_same(cache.fetch(str(tmp_path), "encoded", KEY, build), arrays())
  err = capsys.readouterr().err
  assert "cannot write the cache entry" in err and "No space left on device" in err
  assert not os.path.exists(entry_of(tmp_path))
  blocked = tmp_path / "file"
  blocked.write_text("not a directory")
  assert_same(cache.fetch(str(blocked), "encoded", KEY, build), arrays())
  assert "cannot create the cache directory" in capsys.readouterr().err


def test_an_entry_another_host_wrote_but_this_one_cannot_see_is_named_and_built(tmp_path, capsys):
  """expected=True: process 0 of the job has written the entry; a missing one means that this
  host's data.cache_dir is not the one process 0 wrote to, which the warning says."""
  build = Builds()
  assert_same(cache.fetch(str(tmp_path), "encoded", KEY, build, expected=True), arrays())
  assert build.calls == 1
  assert "process 0 of this job wrote is not there" in capsys.readouterr().err
  cache.fetch(str(tmp_path), "encoded", KEY, build, expected=True)  # there now: read, no warning
  assert build.calls == 1 and capsys.readouterr().err == ""


CHILD = """
import contextlib, json, sys, time
import numpy as np
from transformer_jax.data import cache
root, locks, key = sys.argv[1], sys.argv[2] == "1", json.loads(sys.argv[3])
if not locks:  # a file system without working locks: every writer builds and renames
  cache._locked = lambda path: contextlib.nullcontext(False)
calls = []
def build():
  calls.append(1)
  time.sleep(0.5)  # long enough for the other writers to start meanwhile
  content = json.loads(sys.argv[4]).items()
  return {name: np.asarray(value, dtype) for name, (value, dtype) in content}
fetched = cache.fetch(root, "encoded", key, build)
print(json.dumps([len(calls), {k: v.tolist() for k, v in fetched.items()}]))
"""


@pytest.mark.parametrize("locks", [True, False])
def test_concurrent_writers_all_get_the_same_whole_entry(tmp_path, locks):
  expected = {k: v.tolist() for k, v in arrays().items()}
  content = json.dumps({k: (v.tolist(), str(v.dtype)) for k, v in arrays().items()})
  children = [subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path), str(int(locks)),
                                json.dumps(KEY), content], stdout=subprocess.PIPE, text=True)
              for _ in range(4)]
  results = []
  for child in children:
    out = child.communicate(timeout=120)[0]
    assert child.returncode == 0
    results.append(json.loads(out.strip().splitlines()[-1]))
  assert all(result == expected for _, result in results)
  builds = sum(calls for calls, _ in results)
  assert builds == 1 if locks else builds > 1  # with locks, the others wait and read
  assert_same(cache.read(entry_of(tmp_path), KEY), arrays())
  assert not [n for n in os.listdir(tmp_path / "encoded") if n.startswith(".")]


# ----------------------------------------------------------------------------- a run's data


def files_config(path, cache_dir):
  c = tiny.get_config()
  c.data.update(source="files", path=str(path), format="parallel", source_lang="en",
                target_lang="de", eval_split="train", cache_dir=str(cache_dir),
                max_source_len=12, max_target_len=12)
  c.data.tokenizer.update(model_type="word", sample_size=1000)
  return c


def test_a_second_start_reads_neither_text_nor_trains_a_tokenizer(tmp_path, monkeypatch):
  data = tmp_path / "data"
  data.mkdir()
  rng = np.random.default_rng(0)
  words = [f"w{i}" for i in range(20)]
  lines = [" ".join(rng.choice(words, rng.integers(1, 15))) for _ in range(200)]
  (data / "train.en").write_text("\n".join(lines) + "\n")
  (data / "train.de").write_text("\n".join(line.upper() for line in lines) + "\n")
  c = files_config(data, tmp_path / "cache")
  tokenizer, new, train_set, _ = prepare.prepare_data(c, str(tmp_path / "run1"), VOCAB)
  assert new and 0 < len(train_set) < 200  # some lines are longer than 11 words

  with _no_tokenising(monkeypatch, "the second start"):
    again, _, cached, _ = prepare.prepare_data(c, str(tmp_path / "run2"), VOCAB)
    c.data.update(max_source_len=20, max_target_len=20)  # other limits: the same entry
    _, _, longer, _ = prepare.prepare_data(c, str(tmp_path / "run3"), VOCAB)
  assert again.model_proto == tokenizer.model_proto
  expected = pipeline.encode(sources.load_split(c.data, "train"), tokenizer, 12, 12)
  for examples in (train_set, cached):
    np.testing.assert_array_equal(examples.index, expected.index)
    assert_same(examples.rows(np.arange(len(examples))),
                expected.rows(np.arange(len(expected))))
  assert len(longer) == 200

  # Changed text is another key: tokenised again (and the tokenizer trained again).
  (data / "train.de").write_text("\n".join(lines[::-1]) + "\n")
  c.data.update(max_source_len=12, max_target_len=12)
  _, _, changed, _ = prepare.prepare_data(c, str(tmp_path / "run4"), VOCAB)
  assert not np.array_equal(changed.target_lengths, cached.target_lengths)
  assert len(os.listdir(tmp_path / "cache" / "encoded")) == 4  # two entries and their locks


def test_the_cache_can_be_turned_off(tmp_path):
  c = tiny.get_config()
  c.data.update(cache=False, cache_dir=str(tmp_path / "cache"))
  prepare.prepare_data(c, str(tmp_path / "run"), VOCAB)
  assert not (tmp_path / "cache").exists()
  assert cache.root(c.data) is None
  c.data.update(cache=True, cache_dir="")
  assert cache.root(c.data) == os.environ[cache.ENV]  # the tests' own (conftest.py)


def test_tokenizers_are_cached_per_task_and_only_seq2seq_caches_its_examples(tmp_path):
  """One tsv read as seq2seq and as classify: each task gets its own tokenizer (classify's has
  <mask> and never saw the labels), and classify's examples are label ids, not the cached
  seq2seq targets."""
  data = tmp_path / "data"
  data.mkdir()
  rng = np.random.default_rng(0)
  words = [f"w{i}" for i in range(20)]
  lines = [f"{' '.join(rng.choice(words, rng.integers(1, 10)))}\t{rng.choice(['pos', 'neg'])}"
           for _ in range(100)]
  (data / "train.tsv").write_text("\n".join(lines) + "\n")
  c = files_config(data, tmp_path / "cache")
  c.data.format = "tsv"
  seq2seq, _, pairs_set, _ = prepare.prepare_data(c, str(tmp_path / "run1"), VOCAB)
  c.data.task = "classify"
  c.model.num_labels = 2  # a classifier's config names its class count (config.validate)
  classify, _, labels_set, _ = prepare.prepare_data(c, str(tmp_path / "run2"), VOCAB)
  assert not seq2seq.has_mask() and classify.has_mask()
  unknown = [tokenizer_lib.UNK_ID]
  assert unknown not in seq2seq.encode(["pos", "neg"])
  assert classify.encode(["pos", "neg"]) == [unknown, unknown]  # never trained on the labels
  assert len(os.listdir(tmp_path / "cache" / "tokenizers")) == 4  # two entries and their locks
  assert len(os.listdir(tmp_path / "cache" / "encoded")) == 2  # seq2seq's alone
  expected = [2 if line.endswith("pos") else 1 for line in lines]  # sorted labels: neg, pos
  np.testing.assert_array_equal(labels_set.target, expected)
  assert labels_set.target_lengths.tolist() == [1] * 100 and pairs_set.max_target_len == 12


# ----------------------------------------------------------------------------- a cache in a bucket


@pytest.fixture(scope="module")
def gcs():
  """The GCS emulator (tests/emulators.py) with gs://bucket and gs://private (no caller may
  read or write it)."""
  with emulators.gcs_buckets("bucket", "private") as url:
    yield url


def _on_a_fresh_host(monkeypatch, tmp_path, name):
  """This process as a host that has never read the bucket: an empty local cache (its mirror)."""
  monkeypatch.setenv(cache.ENV, str(tmp_path / name))


def _damage_an_object(entry):
  meta = json.loads(storage.read_text(storage.join(entry, cache.META)))
  path = storage.join(entry, meta["writer"], "tokens.npy")
  data = bytearray(storage.read_bytes(path))
  data[-7] ^= 0xFF  # one byte of the tokens: the shape and dtype still read
  storage.write(path, bytes(data))


def test_a_cache_in_a_bucket_is_built_once_read_by_other_hosts_and_rebuilt_when_damaged(
    gcs, tmp_path, monkeypatch, capsys):
  root = f"gs://bucket/cache-{os.getpid()}"
  entry = storage.join(root, "encoded", cache.key_hash(KEY))
  _on_a_fresh_host(monkeypatch, tmp_path, "host0")
  build = Builds()
  assert_same(cache.fetch(root, "encoded", KEY, build, describe="tokenising"), arrays())
  assert "tokenising: writing it to the cache (gs://bucket/" in capsys.readouterr().out
  names = storage.listdir(entry)  # the arrays under their writer's name, and meta.json
  assert len(names) == 2 and cache.META in names
  assert build.calls == 1

  # Another host: downloads the entry once into its mirror, memory-mapped from there.
  _on_a_fresh_host(monkeypatch, tmp_path, "host1")
  again = cache.fetch(root, "encoded", KEY, build, describe="tokenising")
  assert build.calls == 1 and isinstance(again["tokens"], np.memmap)
  assert_same(again, arrays())
  assert capsys.readouterr().out == ""
  # Its next start reads the mirror: the bucket is not asked for the arrays again.
  storage.remove_tree(entry)
  assert_same(cache.fetch(root, "encoded", KEY, build), arrays())
  assert build.calls == 1

  # A damaged object (the entry rebuilt above by host 0's writer): one warning, built again.
  _on_a_fresh_host(monkeypatch, tmp_path, "host2")
  cache.fetch(root, "encoded", KEY, build)
  assert build.calls == 2
  _damage_an_object(entry)
  _on_a_fresh_host(monkeypatch, tmp_path, "host3")
  capsys.readouterr()
  assert_same(cache.fetch(root, "encoded", KEY, build), arrays())
  err = capsys.readouterr().err
  assert build.calls == 3 and "is damaged (tokens.npy does not match its checksum)" in err
  _on_a_fresh_host(monkeypatch, tmp_path, "host4")  # what the rebuild uploaded is whole
  assert_same(cache.fetch(root, "encoded", KEY, build), arrays())
  assert build.calls == 3 and len(storage.listdir(entry)) == 2  # the damaged writer's gone


def test_a_bucket_cache_that_cannot_be_used_costs_one_warning(gcs, tmp_path, monkeypatch, capsys):
  _on_a_fresh_host(monkeypatch, tmp_path, "host")
  for root, says in (("gs://private/cache", "cannot read the cache gs://private/cache"),
                     ("gs://no-such-bucket/cache", "the bucket gs://no-such-bucket does not")):
    build = Builds()
    assert_same(cache.fetch(root, "encoded", KEY, build), arrays())
    lines = capsys.readouterr().err.strip().splitlines()
    assert build.calls == 1 and len(lines) == 1 and says in lines[0], lines
    assert lines[0].startswith("warning: ") and "this run goes on without it" in lines[0]


def test_data_and_its_cache_in_a_bucket(gcs, tmp_path, monkeypatch, capsys):
  """data.path=gs://... is read through core/storage.py and keyed by its content (the same key
  as the same files in a local directory); data.cache_dir=gs://...: a second host reads the
  first one's tokenizer and tokenised split, neither reading the text nor tokenising."""
  local = tmp_path / "data"
  local.mkdir()
  lines = [" ".join(f"w{(i * j) % 20}" for j in range(1 + i % 9)) for i in range(100)]
  (local / "train.en").write_text("\n".join(lines) + "\n")
  (local / "train.de").write_text("\n".join(line.upper() for line in lines) + "\n")
  data = f"gs://bucket/data-{os.getpid()}"
  for name in ("train.en", "train.de"):
    storage.write(storage.join(data, name), (local / name).read_bytes())
  c = files_config(data, f"gs://bucket/cache-{os.getpid()}-run")
  assert sources.split_key(c.data, "train") == sources.split_key(
      files_config(local, "").data, "train")
  assert sources.load_split(c.data, "train")[:3] == sources.load_split(
      files_config(local, "").data, "train")[:3]

  _on_a_fresh_host(monkeypatch, tmp_path, "host0")
  tokenizer, _, train_set, _ = prepare.prepare_data(c, str(tmp_path / "run1"), VOCAB)
  out = capsys.readouterr().out
  assert "training the tokenizer: writing it to the cache (gs://bucket/" in out
  assert "tokenising the 'train' split: writing it to the cache (gs://bucket/" in out

  _on_a_fresh_host(monkeypatch, tmp_path, "host1")

  with _no_tokenising(monkeypatch, "the second host"):
    again, _, cached, _ = prepare.prepare_data(c, str(tmp_path / "run2"), VOCAB)
  assert "writing it to the cache" not in capsys.readouterr().out
  assert again.model_proto == tokenizer.model_proto
  np.testing.assert_array_equal(cached.index, train_set.index)
  assert_same(cached.rows(np.arange(len(cached))), train_set.rows(np.arange(len(train_set))))


def test_a_bad_bucket_data_path_is_one_error(gcs, tmp_path):
  for path, says in (("gs://bucket/no-such-folder", "holds no files"),
                     ("gcs://bucket/data", "unknown storage scheme gcs://"),
                     ("gs://no-such-bucket/data", "the bucket gs://no-such-bucket does not exist"),
                     ("gs://private/data", "no valid credentials")):
    with pytest.raises(UserError) as error:
      sources.load_split(files_config(path, "").data, "train")
    assert says in str(error.value) and "\n" not in str(error.value), str(error.value)


def test_the_default_cache_of_a_job_of_several_processes_with_a_bucket_workdir(monkeypatch):
  """Its hosts share no file system: the workdir's bucket, not each host's own disk."""
  d = tiny.get_config().data
  monkeypatch.delenv(cache.ENV)
  assert cache.root(d, "gs://b/runs/one", 2) == f"gs://b/{cache.IN_BUCKET}"
  assert cache.root(d, "s3://b/run", 4) == f"s3://b/{cache.IN_BUCKET}"
  local = cache.local_root()
  assert not storage.is_url(local) and cache.root(d, "gs://b/run", 1) == local  # one host
  assert cache.root(d, "/runs/one", 2) == local
  monkeypatch.setenv(cache.ENV, "gs://other/cache")  # the user's choice wins
  assert cache.root(d, "gs://b/run", 2) == "gs://other/cache"
  assert cache.local_root() == local  # the mirror of a bucket cache stays on this host
  d.cache_dir = "s3://mine/c/"
  assert cache.root(d, "gs://b/run", 2) == "s3://mine/c"
  d.cache_dir = "gcs://mine/c"
  with pytest.raises(UserError, match="unknown storage scheme gcs://"):
    cache.root(d)


def test_a_missing_bucket_is_one_warning_for_every_entry_of_the_run(gcs, tmp_path, monkeypatch,
                                                                     capsys):
  """A run fetches several entries (the tokenizer, each split): a cache in a bucket that does
  not exist is said once, as the docs say, and every entry is built without it."""
  _on_a_fresh_host(monkeypatch, tmp_path, "host")
  root = f"gs://no-such-bucket-{os.getpid()}/cache"
  build = Builds()
  for kind in ("tokenizer", "encoded", "encoded_eval"):
    assert_same(cache.fetch(root, kind, KEY, build), arrays())
  assert build.calls == 3
  warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning")]
  assert len(warnings) == 1 and root in warnings[0], warnings
