"""The real TFDS builders of the paper's data, prepared offline: only the download is replaced.

The test writes small archives in the layout each builder expects (the statmt.org tarballs:
parallel text files and SGML test sets) and answers the download manager's fetch of each URL
with the local archive. Everything after the fetch is TFDS's and ours: the extraction (without
TensorFlow), the builder's own parsing, the array_record writing, the TF-free random access,
and a few train steps of the WMT14 base recipe with a tiny model.
"""

import io
import json
import sys
import tarfile

import pytest

from transformer_jax import run
from transformer_jax.data import sources
from transformer_jax.experiments import wmt14_ende_base

tfds = pytest.importorskip("tensorflow_datasets")

NEWS = "http://data.statmt.org/wmt19/translation-task/dev.tgz"
# The two training archives both datasets read.
SHARED = {
    "http://www.statmt.org/wmt13/training-parallel-europarl-v7.tgz": {
        "training/europarl-v7.de-en.de": ("de", "text", "europarl"),
        "training/europarl-v7.de-en.en": ("en", "text", "europarl")},
    "http://www.statmt.org/wmt13/training-parallel-commoncrawl.tgz": {
        "commoncrawl.de-en.de": ("de", "text", "commoncrawl"),
        "commoncrawl.de-en.en": ("en", "text", "commoncrawl")},
}
# {dataset: {url: {path in the archive: (language, format, subset)}}}: the files that
# wmt14_translate/de-en and wmt17_translate/de-en read from each download.
LAYOUT = {
    "wmt14_translate/de-en": {
        **SHARED,
        "http://www.statmt.org/wmt14/training-parallel-nc-v9.tgz": {
            "training/news-commentary-v9.de-en.de": ("de", "text", "commentary"),
            "training/news-commentary-v9.de-en.en": ("en", "text", "commentary")},
        NEWS: {
            "dev/newstest2013.de": ("de", "text", "newstest2013"),
            "dev/newstest2013.en": ("en", "text", "newstest2013"),
            "dev/newstest2014-deen-src.de.sgm": ("de", "sgm", "newstest2014"),
            "dev/newstest2014-deen-ref.en.sgm": ("en", "sgm", "newstest2014")},
    },
    "wmt17_translate/de-en": {
        **SHARED,
        "http://data.statmt.org/wmt17/translation-task/training-parallel-nc-v12.tgz": {
            "training/news-commentary-v12.de-en.de": ("de", "text", "commentary"),
            "training/news-commentary-v12.de-en.en": ("en", "text", "commentary")},
        "http://data.statmt.org/wmt18/translation-task/rapid2016.tgz": {
            "rapid2016.de-en.de": ("de", "text", "rapid"),
            "rapid2016.de-en.en": ("en", "text", "rapid")},
        NEWS: {
            "dev/newstest2016-deen-src.de.sgm": ("de", "sgm", "newstest2016"),
            "dev/newstest2016-deen-ref.en.sgm": ("en", "sgm", "newstest2016"),
            "dev/newstest2017-deen-src.de.sgm": ("de", "sgm", "newstest2017"),
            "dev/newstest2017-deen-ref.en.sgm": ("en", "sgm", "newstest2017")},
    },
}
SPLITS = {"wmt14_translate/de-en": {"train": ("europarl", "commoncrawl", "commentary"),
                                     "validation": ("newstest2013",), "test": ("newstest2014",)},
          "wmt17_translate/de-en": {"train": ("europarl", "commoncrawl", "commentary", "rapid"),
                                     "validation": ("newstest2016",), "test": ("newstest2017",)}}
WORDS = {"en": ["the", "small", "house", "is", "green", "and", "old", "street"],
         "de": ["das", "kleine", "Haus", "ist", "grün", "und", "alt", "Straße"]}


def sentences(subset: str, language: str, count: int = 16) -> list:
  """Distinct, aligned sentences of a subset: line i in English and German."""
  words = WORDS[language]
  return [f"{subset} {i}: " + " ".join(words[(i + k) % len(words)] for k in range(3 + i % 4))
          for i in range(count)]


def file_text(language: str, form: str, subset: str) -> str:
  lines = sentences(subset, language)
  if form == "text":
    return "\n".join(lines) + "\n"
  segments = "".join(f'<seg id="{i + 1}">{line}</seg>\n' for i, line in enumerate(lines))
  return (f'<srcset setid="{subset}" srclang="any">\n<doc docid="d1" genre="news">\n'
          f"<p>\n{segments}</p>\n</doc>\n</srcset>\n")


def make_archives(root, name: str) -> dict:
  """{url: local .tgz} for every download of the dataset `name`."""
  archives = {}
  for url, members in LAYOUT[name].items():
    path = root / url.rsplit("/", 1)[1]
    with tarfile.open(path, "w:gz") as tar:
      for member, (language, form, subset) in members.items():
        data = file_text(language, form, subset).encode()
        info = tarfile.TarInfo(member)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    archives[url] = path
  return archives


@pytest.fixture
def offline_downloads(monkeypatch):
  """Answers the download manager's fetch of a URL with the test's archive for it; nothing else
  of TFDS is replaced (extraction, parsing and writing run as they would after a download)."""
  import promise
  from etils import epath
  from tensorflow_datasets.core.download import download_manager
  archives = {}
  fetched = []

  def fetch(self, resource):
    url = getattr(resource, "url", resource)
    if url not in archives:
      raise AssertionError(f"the builder asked for {url}, which the test has no archive for")
    fetched.append(url)
    return promise.Promise.resolve(epath.Path(archives[url]))

  monkeypatch.setattr(download_manager.DownloadManager, "_download_or_get_cache", fetch)
  return archives, fetched


def expected_pairs(name: str, split: str) -> list:
  return sorted((en, de) for subset in SPLITS[name][split]
                for en, de in zip(sentences(subset, "en"), sentences(subset, "de")))


def data_config(name: str, data_dir):
  c = wmt14_ende_base.get_config()
  c.data.update(tfds_name=name, tfds_data_dir=str(data_dir))
  return c


@pytest.mark.parametrize("name", ["wmt17_translate/de-en"])
def test_the_real_builder_prepares_every_split(tmp_path, offline_downloads, name):
  archives, fetched = offline_downloads
  archives.update(make_archives(tmp_path, name))
  c = data_config(name, tmp_path / "tfds")
  for split in ("train", "validation", "test"):
    assert sorted(sources.load_split(c.data, split)) == expected_pairs(name, split), split
  assert sorted(set(fetched)) == sorted(archives)  # every archive was used, and no other
  assert list((tmp_path / "tfds" / name / "1.0.0").glob("*.array_record-*"))
  assert "tensorflow" not in sys.modules


def test_the_wmt14_base_recipe_trains_on_data_the_real_builder_prepared(tmp_path,
                                                                        offline_downloads):
  """wmt14_translate/de-en prepared from fake archives by TFDS's own builder, then the recipe
  with a tiny model: BPE trained on the fly, a few steps, the final evaluation on newstest2013
  (validation) and newstest2014 (test) with the recipe's beam search."""
  name = "wmt14_translate/de-en"
  archives, fetched = offline_downloads
  archives.update(make_archives(tmp_path, name))
  c = data_config(name, tmp_path / "tfds")
  c.model.update(d_model=32, num_heads=2, d_ff=64, num_encoder_layers=1, num_decoder_layers=1,
                 vocab_size=96, max_len=64)
  c.data.update(max_source_len=32, max_target_len=32, tokens_per_batch=128)
  c.data.tokenizer.update(sample_size=1000)
  c.train.update(steps=3, log_every=3, checkpoint_every=3, eval_every=0)
  c.eval.update(batch_size=8, max_decode_len=8)
  workdir = tmp_path / "run"
  metrics = run.train_and_evaluate(c, str(workdir))
  assert sorted(set(fetched)) == sorted(archives)
  records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records if r["split"] == "train"][-1] == 3
  # Every sentence was read; a few are longer than the tiny model's 32 pieces and are skipped.
  assert metrics["examples"] + metrics["skipped_too_long"] == len(expected_pairs(name,
                                                                                 "validation"))
  results = {p.name: json.loads(p.read_text()) for p in (workdir / "eval").glob("*.json")}
  assert sorted(results) == ["3.test.beam4-lp0.6-len8.json", "3.validation.beam4-lp0.6-len8.json"]
  for split in ("validation", "test"):
    result = results[f"3.{split}.beam4-lp0.6-len8.json"]
    assert result["split"] == split and result["examples"] + result["skipped_too_long"] == 16
    assert result["bleu_signature"].startswith("nrefs:1")
    assert result["decoding"] == {"decode": "beam", "beam_size": 4, "length_penalty": 0.6,
                                  "oracle_length": False}
  assert "tensorflow" not in sys.modules
