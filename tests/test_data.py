"""Data sources (local files, TFDS), the tokenizer, and batching: token budgets and packing."""

import contextlib
import json
import os
import sys
import tempfile
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax import config as config_lib
from transformer_jax import run
from transformer_jax.core.errors import UserError
from transformer_jax.data import pipeline, prepare, sources
from transformer_jax.data import tokenizer as tokenizer_lib
from transformer_jax.experiments import multi30k_ende, tiny
from transformer_jax.model import Transformer, init_params, shift_right
from transformer_jax.train import step as step_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MULTI30K = os.path.join(ROOT, "..", "shared", "data", "multi30k")


def tiny_config():
  return tiny.get_config()


def files_config(path, fmt="parallel"):
  c = tiny_config()
  c.data.update(source="files", path=str(path), format=fmt, source_lang="en", target_lang="de")
  return c


class DigitTokenizer:
  """Texts of space-separated ids -> those ids: batching tests without SentencePiece."""

  vocab_size = 50

  def encode(self, texts):
    return [[int(w) for w in t.split()] for t in texts]


def synthetic(n, seed=0, max_len=30):
  rng = np.random.default_rng(seed)
  pairs = []
  for _ in range(n):
    s, t = rng.integers(1, max_len, size=2)
    pairs.append((" ".join(map(str, rng.integers(3, 50, s))),
                  " ".join(map(str, rng.integers(3, 50, t)))))
  return pairs


# ----------------------------------------------------------------------------- local files


def test_parallel_files_and_tsv_give_the_same_pairs(tmp_path):
  (tmp_path / "train.en").write_bytes("A dog.\r\nTwo cats\n\nÜber alles\n".encode())
  (tmp_path / "train.de").write_text("Ein Hund.\nZwei Katzen\nleer\nÜber alles", encoding="utf-8")
  (tmp_path / "train.tsv").write_text("A dog.\tEin Hund.\nTwo cats\tZwei Katzen\n\tleer\n"
                                      "Über alles\tÜber alles\n", encoding="utf-8")
  expected = [("A dog.", "Ein Hund."), ("Two cats", "Zwei Katzen"), ("", "leer"),
              ("Über alles", "Über alles")]
  parallel = sources.load_split(files_config(tmp_path).data, "train")
  tsv = sources.load_split(files_config(tmp_path, "tsv").data, "train")
  assert list(parallel) == expected and list(tsv) == expected
  assert parallel[-1] == expected[-1] and parallel[1:3] == expected[1:3]
  reverse = files_config(tmp_path)
  reverse.data.update(source_lang="de", target_lang="en")
  assert sources.load_split(reverse.data, "train")[0] == ("Ein Hund.", "A dog.")


@pytest.mark.parametrize("files,fmt,split,message", [
    ({}, "parallel", "nosuch", ["nosuch.en", "does not exist", "train"]),
    ({"train.en": b"", "train.de": b"x\n"}, "parallel", "train", ["train.en", "is empty"]),
    ({"train.en": b"a\nb\nc\n", "train.de": b"a\nb\n"}, "parallel", "train",
     ["has 3 lines", "has 2", "aligned"]),
    ({"train.en": b"ok\nfine\n\xff\xfe bad\n", "train.de": b"a\nb\nc\n"}, "parallel", "train",
     ["train.en line 3", "not UTF-8"]),
    ({"train.tsv": b"a\tb\nno tab here\n"}, "tsv", "train", ["train.tsv line 2", "no tab"]),
    ({"train.tsv": b"a\tb\tc\n"}, "tsv", "train", ["line 1", "2 tabs"]),
])
def test_file_errors_name_the_file_and_the_fix(tmp_path, files, fmt, split, message):
  (tmp_path / "train.en").write_bytes(b"x\n")
  (tmp_path / "train.de").write_bytes(b"y\n")
  for name, content in files.items():
    (tmp_path / name).write_bytes(content)
  with pytest.raises(UserError) as e:
    sources.load_split(files_config(tmp_path, fmt).data, split)
  assert "\n" not in str(e.value)
  for part in message:
    assert part in str(e.value)


def test_missing_directory_and_bad_config_are_user_errors(tmp_path):
  with pytest.raises(UserError, match="data.path .* is not a directory"):
    sources.load_split(files_config(tmp_path / "nope").data, "train")
  c = files_config("")
  with pytest.raises(UserError, match="needs data.path"):
    config_lib.validate(c)
  c = files_config(tmp_path)
  c.data.target_lang = "en"
  with pytest.raises(UserError, match="two different languages"):
    config_lib.validate(c)
  c.data.update(target_lang="de", batching="packd")
  with pytest.raises(UserError, match="data.batching must be one of tokens, packed, fixed"):
    config_lib.validate(c)


@pytest.mark.skipif(not os.path.isdir(MULTI30K), reason="../shared/data/multi30k not present")
def test_multi30k_recipe_reads_the_shared_data():
  c = multi30k_ende.get_config()
  config_lib.validate(c)
  sizes = {s: len(sources.load_split(c.data, s))
           for s in (c.data.train_split, c.data.eval_split, c.data.test_split)}
  assert sizes == {"train": 29000, "val": 1014, "test_2016_flickr": 1000}
  source, target = sources.load_split(c.data, "train")[0]
  assert source.startswith("Two young") and target.startswith("Zwei junge")


# ----------------------------------------------------------------------------- tokenizer


def test_tokenizer_is_trained_from_a_sample_and_the_workdir_copy_wins(tmp_path):
  c = tiny_config()
  c.data.tokenizer.model_type = "bpe"
  pairs = [(f"the cat {i} sat on the mat", f"die Katze {i} sass auf der Matte") for i in range(500)]
  sample = list(tokenizer_lib.training_texts(pairs, 100, seed=0))
  assert len(sample) == 100 and set(sample) <= {t for p in pairs for t in p}
  trained, new = prepare.prepare_tokenizer(c, str(tmp_path), pairs, 40)
  assert new and trained.vocab_size == 40
  (tmp_path / tokenizer_lib.FILENAME).write_bytes(trained.model_proto)  # as the loop does, once
  other = [("other words entirely", "ganz andere")] * 50
  again, new = prepare.prepare_tokenizer(c, str(tmp_path), other, 40)
  assert not new and again.model_proto == trained.model_proto  # a resumed run keeps its ids
  with pytest.raises(UserError, match="lower model.vocab_size"):
    tokenizer_lib.train(["a b"] * 10, 5000, "bpe")
  # Too few pieces for the text's characters: the fix goes the other way.
  with pytest.raises(UserError, match=r"smaller than required_chars.*; raise model.vocab_size$"):
    tokenizer_lib.train(["a b c d e f g h"] * 10, 6, "bpe")


# ----------------------------------------------------------------------------- batching


def stream_for(batching, pairs, row_multiple=1, tokens=256, max_len=32):
  c = tiny_config()
  c.data.update(batching=batching, tokens_per_batch=tokens, bucket_width=4,
                max_source_len=max_len, max_target_len=max_len)
  examples = pipeline.encode(pairs, DigitTokenizer(), max_len, max_len)
  return examples, pipeline.TrainStream(examples, c.data, seed=0, row_multiple=row_multiple)


def test_encode_keeps_what_fits_and_rows_round_trip():
  pairs = [("5 6 7", "8 9"), (" ".join(["4"] * 40), "5"), ("10", "11 12 13 14")]
  examples = pipeline.encode(pairs, DigitTokenizer(), 8, 8, chunk_size=2)
  assert len(examples) == 2 and examples.dropped == 1
  np.testing.assert_array_equal(examples.index, [0, 2])
  rows = examples.rows([1, 0])
  np.testing.assert_array_equal(rows["inputs"], [[10, 2, 0, 0, 0, 0, 0, 0],
                                                 [5, 6, 7, 2, 0, 0, 0, 0]])
  np.testing.assert_array_equal(rows["targets"][0], [11, 12, 13, 14, 2, 0, 0, 0])


@pytest.mark.parametrize("batching", ["tokens", "packed"])
def test_batches_respect_the_token_budget(batching):
  pairs = synthetic(600)
  examples, stream = stream_for(batching, pairs, row_multiple=2, tokens=256)
  seen = []
  for step in range(30):
    batch = stream[step]
    rows = batch["inputs"].shape[0]
    assert rows % 2 == 0 and rows == batch["targets"].shape[0]
    assert batch["inputs"].size <= 256 and batch["targets"].size <= 256
    if batching == "tokens":  # one bucket: every row is longer than the previous bucket's length
      longest = np.maximum((batch["inputs"] > 0).sum(1), (batch["targets"] > 0).sum(1))
      assert batch["inputs"].shape[1] - 4 < longest.max() <= batch["inputs"].shape[1]
    seen.append(batch)
  for step in (0, 17, 29):  # random access: a fresh stream (a resumed run) gives the same batch
    again = stream_for(batching, pairs, row_multiple=2, tokens=256)[1][step]
    for key, value in seen[step].items():
      np.testing.assert_array_equal(again[key], value)


class RecordingArray(np.ndarray):
  """A token array that records every index it is read at."""

  def __getitem__(self, index):
    self.reads.append(np.asarray(index).ravel())
    return np.asarray(super().__getitem__(index))


def recording(examples):
  for side in ("source", "target"):
    array = np.asarray(getattr(examples, side)).view(RecordingArray)
    array.reads = []
    setattr(examples, side, array)
  return examples


def process_rows(rows, processes, process, shards=4):
  """The rows of a global batch that `process` holds on a data-parallel mesh of `shards` devices
  spread evenly over `processes` processes (what sharding.process_row_indices gives): the batch
  is padded to a multiple of the shards, each process holds one contiguous block of it."""
  padded = -(-rows // shards) * shards
  block = padded // processes
  return np.arange(process * block, min((process + 1) * block, rows))


@pytest.mark.parametrize("batching", ["tokens", "packed", "fixed"])
def test_each_process_reads_only_its_rows_of_one_global_batch(batching):
  """The global batches do not depend on the number of processes: for 1, 2 and 4 processes,
  the rows each one fills put together are the one-process batch, and each process reads the
  tokens of the examples of its own rows and no others."""
  pairs = synthetic(500, seed=3)
  examples, stream = stream_for(batching, pairs, row_multiple=2, tokens=256)
  if batching == "fixed":
    stream = pipeline.TrainStream(examples, tiny_config().data, seed=0)
  for step in range(20):
    whole = stream[step]
    plan = stream.plan(step)
    assert plan.tokens(examples) == sum(int((whole[k] > 0).sum()) for k in ("inputs", "targets"))
    for processes in (1, 2, 4):
      together = {k: np.zeros_like(v) for k, v in whole.items()}
      for process in range(processes):
        rows = process_rows(plan.rows, processes, process)
        reader = recording(pipeline.Encoded(**vars(examples)))
        part = pipeline.fill(reader, plan, rows)
        others = np.setdiff1d(np.arange(plan.rows), rows)
        for key, value in part.items():
          assert not value[others].any()
          together[key][rows] = value[rows]
        mine = plan.examples[np.isin(np.repeat(np.arange(plan.rows), plan.row_sizes), rows)]
        for side in ("source", "target"):
          read = np.concatenate(getattr(reader, side).reads)
          starts = getattr(examples, f"{side}_starts")
          lengths = getattr(examples, f"{side}_lengths")
          allowed = np.concatenate([np.arange(starts[i], starts[i] + lengths[i]) for i in mine]
                                   or [np.zeros(0, np.int64)])
          assert set(read.tolist()) == set(allowed.tolist())
      for key, value in whole.items():
        np.testing.assert_array_equal(together[key], value, err_msg=f"{processes} {key}")


def test_batches_prefetch_the_stream_in_order_and_stop_cleanly():
  examples, stream = stream_for("tokens", synthetic(300), tokens=128)
  grain_threads = lambda: [t for t in threading.enumerate() if "grain" in t.name]  # noqa: E731
  placed = []
  for prefetch in (0, 3):
    with contextlib.closing(pipeline.batches(
        stream, 5, 25, rows_for=lambda rows: np.arange(0, rows, 2),
        place=lambda batch: placed.append(1) or batch, prefetch=prefetch)) as batches:
      got = list(batches)
    assert [b.step for b in got] == list(range(5, 25))
    for batch in got:
      expected = stream.batch(batch.step, np.arange(0, len(stream[batch.step]["inputs"]), 2))
      assert batch.shape == (len(expected["inputs"]), *(v.shape[1] for v in expected.values()))
      assert batch.tokens == stream.plan(batch.step).tokens(examples)
      for key, value in expected.items():
        np.testing.assert_array_equal(batch.data[key], value)
    assert not grain_threads()
  assert len(placed) == 40

  # Closed early (a preemption): the thread stops although its buffer is full.
  batches = pipeline.batches(stream, 0, 1000, prefetch=4)
  next(batches)
  time.sleep(0.2)
  assert grain_threads()
  batches.close()
  assert not grain_threads()


def test_an_error_making_a_batch_is_raised_by_next_and_stops_the_thread():
  _, stream = stream_for("tokens", synthetic(300), tokens=128)
  failure = UserError("the data went away")

  def place(batch):
    if place.calls == 2:
      raise failure
    place.calls += 1
    return batch

  place.calls = 0
  batches = pipeline.batches(stream, 0, 100, place=place, prefetch=2)
  next(batches), next(batches)
  with pytest.raises(UserError) as raised:
    next(batches)
  assert raised.value is failure  # the producer's own exception, in the main thread
  assert not [t for t in threading.enumerate() if "grain" in t.name]
  batches.close()


def test_packed_rows_are_well_formed_and_cover_each_example_once_per_epoch():
  pairs = synthetic(300, seed=1)
  examples, stream = stream_for("packed", pairs, tokens=512)
  epoch_batches = stream._epoch(0)
  members = [i for batch in epoch_batches for row in batch for i in row]
  assert len(members) == len(set(members)) > 0.8 * len(examples)
  padding = []
  for step in range(len(epoch_batches)):
    batch = stream[step]
    padding.append(pipeline.padding_fraction(batch))
    for side in ("inputs", "targets"):
      tokens, segments = batch[side], batch[f"{side}_segmentation"]
      positions = batch[f"{side}_position"]
      np.testing.assert_array_equal(segments > 0, tokens > 0)
      for r in range(tokens.shape[0]):
        ids = segments[r][segments[r] > 0]
        assert np.all(np.diff(ids) >= 0) and ids[0] == 1 and np.all(np.diff(np.unique(ids)) == 1)
        for s in np.unique(ids):  # each example is contiguous, positions restart at 0, EOS last
          at = np.flatnonzero(segments[r] == s)
          np.testing.assert_array_equal(positions[r, at], np.arange(len(at)))
          assert tokens[r, at[-1]] == tokenizer_lib.EOS_ID
    np.testing.assert_array_equal(batch["inputs_segmentation"].max(1),
                                  batch["targets_segmentation"].max(1))
  one_per_row = 1 - (examples.source_lengths.sum() + examples.target_lengths.sum()) / (
      2 * 32 * len(examples))
  assert np.mean(padding) < 0.6 * one_per_row  # ~0.22 against ~0.5


def test_shift_right_starts_every_packed_example_with_bos():
  targets = jnp.array([[5, 6, 2, 7, 2, 0]])
  segments = jnp.array([[1, 1, 1, 2, 2, 0]])
  np.testing.assert_array_equal(shift_right(targets, segments=segments),
                                [[1, 5, 6, 1, 7, 0]])


@pytest.mark.parametrize("attention_impl", ["plain", "jax"])
def test_packed_batches_never_attend_across_examples(tiny_config, random_params, attention_impl):
  """Each example's logits in a packed batch equal its logits alone, and its loss is unchanged:
  nothing in one segment can see another, in encoder, decoder or cross attention."""
  cfg = tiny_config.replace(attention_impl=attention_impl)
  params = random_params(lambda rng: {"params": init_params(cfg, rng)})
  model = Transformer(cfg)
  pairs = synthetic(40, seed=2, max_len=9)
  examples, stream = stream_for("packed", pairs, tokens=4 * 24, max_len=24)
  batch = stream[0]
  assert (batch["inputs_segmentation"].max(1) >= 2).all()  # several examples per row

  @jax.jit
  def apply(batch):
    return model.apply(
        {"params": params}, batch["inputs"],
        shift_right(batch["targets"], segments=batch.get("targets_segmentation")),
        source_positions=batch.get("inputs_position"),
        target_positions=batch.get("targets_position"),
        source_segments=batch.get("inputs_segmentation"),
        target_segments=batch.get("targets_segmentation"))

  def logits(batch):
    return np.asarray(apply(batch))

  packed = logits(batch)
  members = stream._epoch(0)[0]
  alone = [i for row in members for i in row]
  separate = logits(examples.rows(alone, 24, 24))
  k = 0
  for r, row in enumerate(members):
    for segment in range(1, len(row) + 1):
      at = np.flatnonzero(batch["targets_segmentation"][r] == segment)
      np.testing.assert_allclose(packed[r, at], separate[k, :len(at)], rtol=1e-5, atol=1e-5)
      k += 1

  # Changing every other example of row 0 leaves the first example's logits unchanged.
  changed = {key: value.copy() for key, value in batch.items()}
  for side in ("inputs", "targets"):
    others = changed[f"{side}_segmentation"][0] >= 2
    changed[side][0, others] = changed[side][0, others] % 40 + 3
  at = batch["targets_segmentation"][0] == 1
  np.testing.assert_allclose(logits(changed)[0, at], packed[0, at], rtol=1e-6, atol=1e-6)
  assert not np.allclose(logits(changed)[0, ~at & (batch["targets"][0] > 0)],
                         packed[0, ~at & (batch["targets"][0] > 0)], atol=1e-3)

  # The training loss sums over the packed batch equal those over the same examples unpacked.
  sums = jax.jit(lambda batch: step_lib._loss_and_metrics(
      params, model, batch, jax.random.PRNGKey(0), 0.1, 1.0)[1])
  packed_sums, separate_sums = sums(batch), sums(examples.rows(alone, 24, 24))
  for key in ("loss", "nll", "correct"):
    assert float(packed_sums[key]) == pytest.approx(float(separate_sums[key]), rel=1e-5)


# ----------------------------------------------------------------------------- TFDS


def tfds_config(tmp_path=None):
  c = tiny_config()
  c.data.update(source="tfds", tfds_name="wmt14_translate/de-en", source_lang="en",
                target_lang="de", train_split="train", eval_split="validation",
                test_split="test", max_source_len=48, max_target_len=48)
  if tmp_path is not None:
    c.data.tfds_data_dir = str(tmp_path)
  return c


@pytest.mark.parametrize("changes,message", [
    ({"tfds_name": "no_such_translate/de-en"}, "unknown TFDS dataset 'no_such_translate/de-en'"),
    ({"tfds_name": "wmt14_translate/xx-en"}, "fix data.tfds_name"),
    ({"source_lang": "fr"}, "languages de, en, not data.source_lang='fr'"),
    ({"tfds_download": False}, "is not prepared"),
])
def test_tfds_user_errors(tmp_path, changes, message):
  c = tfds_config(tmp_path)
  c.data.update(**changes)
  with pytest.raises(UserError) as e:
    sources.load_split(c.data, "train")
  assert message in str(e.value) and "\n" not in str(e.value)


def test_a_builder_of_data_not_prepared_leaves_no_empty_folder_behind(tmp_path, monkeypatch):
  # TFDS makes a temporary folder for the dataset's metadata from its GCS bucket and, finding
  # none (no network here), leaves it empty; sources.tfds_builder removes it. With files in it
  # (a machine with network), it stays: TFDS reads them later.
  scratch = tmp_path / "tmp"
  scratch.mkdir()
  monkeypatch.setattr(tempfile, "tempdir", str(scratch))
  c = tfds_config(tmp_path / "tfds")
  builder = sources.tfds_builder(c.data)
  assert not builder.is_prepared()
  left = [p for p in scratch.rglob("*")]
  assert all(any(q.is_file() for q in p.rglob("*")) for p in left if p.is_dir()), left
  assert tempfile.tempdir == str(scratch)


def test_tfds_preparation_that_needs_tensorflow_names_the_extra(tmp_path, monkeypatch):
  import tensorflow_datasets as tfds

  def needs_tf(*args, **kwargs):
    raise ModuleNotFoundError("No module named 'tensorflow'", name="tensorflow")

  monkeypatch.setattr(tfds.core.DatasetBuilder, "download_and_prepare", needs_tf)
  with pytest.raises(UserError, match=r"needs TensorFlow.*pip install -e '\.\[tf\]'"):
    sources.load_split(tfds_config(tmp_path).data, "train")


def test_tfds_wmt14_end_to_end_on_mock_data(tmp_path):
  """wmt14_translate/de-en through tfds.data_source on mock data, TF-free and offline: BPE
  trained on the fly, packed batches, a few train steps, evaluation on the validation split."""
  import tensorflow_datasets as tfds
  c = tfds_config()
  c.model.update(vocab_size=48)
  c.data.update(batching="packed", tokens_per_batch=4 * 48)
  c.data.tokenizer.update(model_type="bpe", sample_size=1000)
  c.train.update(steps=4, log_every=2, checkpoint_every=4)
  c.eval.update(max_examples=8, batch_size=8, max_decode_len=8)
  workdir = tmp_path / "run"
  with tfds.testing.mock_data(num_examples=64, policy=tfds.testing.MockPolicy.USE_CODE):
    pairs = sources.load_split(c.data, "validation")
    assert len(pairs) == 64 and all(isinstance(t, str) for t in pairs[0])
    metrics = run.train_and_evaluate(c, str(workdir))
  assert (workdir / tokenizer_lib.FILENAME).exists()
  assert tokenizer_lib.load(str(workdir / tokenizer_lib.FILENAME)).vocab_size == 48
  records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  steps = [r for r in records if r["split"] == "train"]
  assert [r["step"] for r in steps] == [2, 4]
  assert all(0.0 <= r["padding"] < 0.5 and np.isfinite(r["loss"]) for r in steps)
  assert metrics["examples"] > 0 and "bleu" in metrics


def test_tfds_prepares_and_reads_array_record_without_tensorflow(tmp_path):
  """A real (not mocked) TFDS preparation and random-access read, offline: a builder whose
  examples come from code, prepared as array_record into data.tfds_data_dir."""
  import tensorflow_datasets as tfds

  class TinyTranslateForTests(tfds.core.GeneratorBasedBuilder):
    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
      return tfds.core.DatasetInfo(builder=self,
                                   features=tfds.features.Translation(languages=("de", "en")))

    def _split_generators(self, dl_manager):
      return {"train": self._generate_examples(5), "newstest2013": self._generate_examples(3)}

    def _generate_examples(self, n=1):
      for i in range(n):
        yield i, {"de": f"Grüße {i}", "en": f"greetings {i}"}

  c = tfds_config(tmp_path)
  c.data.update(tfds_name="tiny_translate_for_tests", eval_split="newstest2013")
  pairs = sources.load_split(c.data, "newstest2013")
  assert sorted(pairs) == [(f"greetings {i}", f"Grüße {i}") for i in range(3)]
  assert len(sources.load_split(c.data, "train")) == 5
  with pytest.raises(UserError, match="has no split 'newstest2014'.*newstest2013"):
    sources.load_split(c.data, "newstest2014")
  assert not any(m == "tensorflow" or m.startswith("tensorflow.") for m in sys.modules)
