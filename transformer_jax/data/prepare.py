"""What a training run reads before it writes anything: the splits and the run's tokenizer.

The tokenised train split and the tokenizer trained for it come from the cache (`cache.py`)
when an earlier run made them: a second start, a sweep trial or another process of the job
reads them instead of training a tokenizer and tokenising the corpus again.
"""

from __future__ import annotations

import collections
import hashlib
import os

import numpy as np

from transformer_jax.core import progress, storage
from transformer_jax.core.errors import UserError
from transformer_jax.data import cache, pipeline, sources, tasks
from transformer_jax.data import tokenizer as tokenizer_lib

# What to do about a damaged WORKDIR/tokenizer.model.
WORKDIR_TOKENIZER_FIX = "restore it (the workdir's checkpoints use it) or start a new --workdir"
UNKNOWN_SHARE = 0.01  # a word vocabulary that leaves more training words unknown is refused


def _counting(texts, words: collections.Counter):
  """`texts`, unchanged, counting their words into `words` as they are read."""
  for text in texts:
    words.update(text.split())
    yield text


def _check_word_coverage(words: collections.Counter, vocab_size: int) -> None:
  """A word vocabulary keeps the vocab_size - 4 most frequent words (4 ids are special) and reads
  every other word as unknown: refuse one under which the training text is largely unknown."""
  total = sum(words.values())
  unknown = sum(count for _, count in words.most_common()[max(vocab_size - 4, 0):])
  if total and unknown / total > UNKNOWN_SHARE:
    raise UserError(f"a word vocabulary of model.vocab_size={vocab_size} pieces leaves "
                    f"{unknown / total:.0%} of the training words unknown (the text has "
                    f"{len(words)} distinct words); raise model.vocab_size to {len(words) + 4} "
                    "or use data.tokenizer.model_type=bpe")


def prepare_tokenizer(config, workdir: str, train_pairs, vocab_size: int, cache_dir=None,
                      source_key=None, cached: bool = False):
  """(tokenizer, new): the run's tokenizer, and whether WORKDIR/tokenizer.model is still to write.

  The workdir's tokenizer wins (a resumed run keeps its ids); else data.tokenizer.model_path;
  else that of the run in train.init_from; else the one trained for this split, task and these
  settings, from the cache (`cache_dir`, with the split's `source_key`) or trained now on a
  sample of `train_pairs`. Nothing is written in the workdir here. cached: another process has
  just written the cache entries (`cache.fetch`'s `expected`).
  """
  t = config.data.tokenizer
  path = storage.join(workdir, tokenizer_lib.FILENAME)
  existing = tokenizer_lib.load_workdir(workdir, WORKDIR_TOKENIZER_FIX)
  new = existing is None
  init_from = config.train.init_from
  init_from = (init_from if storage.is_url(init_from) else os.path.expanduser(init_from))
  # The tokenizer of the run in train.init_from: its SentencePiece model or, for an imported
  # model, its Hugging Face tokenizer.
  source = (tokenizer_lib.load(t.model_path) if t.model_path
            else tokenizer_lib.load_workdir(init_from, "fix train.init_from") if init_from
            else None)
  if init_from and not t.model_path and source is None:
    source = tokenizer_lib.load(storage.join(init_from, tokenizer_lib.FILENAME),
                                "fix train.init_from")  # raises: it has none
  model_path = t.model_path or init_from
  if not new:
    tokenizer = existing
    if source is not None and source.model_proto != tokenizer.model_proto:
      raise UserError(f"the tokenizer of {model_path} is not {path}, the vocabulary this "
                      "workdir was trained with; drop data.tokenizer.model_path / "
                      "train.init_from or start a new --workdir")
  elif source is not None:
    tokenizer = source
  else:
    mask = config.data.task in tasks.MASK_TASKS

    def train():
      texts = tokenizer_lib.training_texts(tasks.tokenizer_texts(config.data, train_pairs),
                                           t.sample_size, config.seed)
      words = collections.Counter()
      if t.model_type == "word":
        texts = _counting(texts, words)
      with progress.waiting(f"training the {t.model_type} tokenizer ({vocab_size:,} pieces)"):
        trained = tokenizer_lib.train(texts, vocab_size, t.model_type, t.character_coverage,
                                      t.sample_size, mask=mask)
      if t.model_type == "word":  # <mask> takes two pieces of a word vocabulary
        _check_word_coverage(words, vocab_size - 2 * mask)
      return {"model": np.frombuffer(trained.model_proto, np.uint8)}

    # The task picks the texts (classify leaves out the labels) and the <mask> piece.
    key = {"data": source_key, "task": config.data.task, "vocab_size": vocab_size,
           "model_type": t.model_type, "character_coverage": t.character_coverage,
           "sample_size": t.sample_size, "seed": config.seed}
    stored = (cache.fetch(cache_dir, "tokenizers", key, train, describe="training the tokenizer",
                          expected=cached)
              if source_key is not None else train())
    tokenizer = tokenizer_lib.Tokenizer(np.asarray(stored["model"]).tobytes())
  if config.data.task in tasks.MASK_TASKS and not tokenizer.has_mask():
    raise UserError(f"data.task={config.data.task} needs a tokenizer whose piece "
                    f"{tokenizer_lib.MASK_ID} is {tokenizer_lib.MASK_PIECE}, as this project "
                    "trains for encoder-only tasks; use the tokenizer.model of such a run "
                    "(data.tokenizer.model_path) or let the run train one")
  if tokenizer.vocab_size > vocab_size:
    raise UserError(f"the tokenizer has {tokenizer.vocab_size} pieces but model.vocab_size is "
                    f"{vocab_size}; raise model.vocab_size")
  return tokenizer, new


def prepare_data(config, workdir: str, vocab_size: int, cached: bool = False,
                 processes: int = 1):
  """Loads the splits and the tokenizer, and the tokenised train split. Writes nothing in the
  workdir (the cache may gain entries). cached: another process of the job has just prepared
  the same data into the cache, which this one reads (see `train.loop.prepare_data_once`).
  processes: how many the job has (picks the default cache, `cache.root`).

  Returns (tokenizer, new_tokenizer, train_set, eval_pairs).
  """
  d = config.data
  cache_dir = cache.root(d, workdir, processes)
  source_key = sources.split_key(d, d.train_split)
  train_pairs = sources.LazyPairs(d, d.train_split)  # read only if the cache lacks something
  tokenizer, new = prepare_tokenizer(config, workdir, train_pairs, vocab_size, cache_dir,
                                     source_key, cached)
  if d.task == "seq2seq":
    key = {"data": source_key, "tokenizer": hashlib.sha256(tokenizer.model_proto).hexdigest()}
    corpus = cache.fetch(cache_dir, "encoded", key,
                         lambda: pipeline.encode_corpus(train_pairs, tokenizer),
                         describe=f"tokenising the {d.train_split!r} split", expected=cached)
    train_set = pipeline.select(corpus, d.max_source_len, d.max_target_len)
  else:
    # Only seq2seq's examples are the cached corpus filtered by the limits: the other tasks cut
    # texts into pieces or map labels to ids (tasks.examples), so they are encoded each start.
    if d.task == "classify":
      tasks.check_class_count(d, config.model.num_labels)
    with progress.waiting(f"encoding {len(train_pairs):,} training examples"):
      train_set = tasks.examples(d, train_pairs, tokenizer)
  if not len(train_set):
    raise UserError("every training example is longer than data.max_source_len / "
                    "data.max_target_len; raise them")
  eval_pairs = sources.load_split(config.data, config.data.eval_split)
  return tokenizer, new, train_set, eval_pairs
