"""A synthetic parallel corpus the size and shape of WMT14 En-De, for timing the input path.

  python -m benchmarks.synthetic_wmt OUTDIR [--pairs 4500000] [--seed 0]

Writes OUTDIR/train.en + train.de (4.5M pairs by default), valid.* and test.* (3,000 pairs each):
`data.source=files`, `data.format=parallel`, `data.path=OUTDIR`. About 1.3 GB; generated in
about a minute on 2 cores, never committed.

What matters for the input path is the amount of text and its statistics, not its meaning:
- sentence lengths as in WMT14 En-De: log-normal, median 21 words, mean ~24, a long tail up to
  150 words; the German side's length follows the English one with some noise;
- words drawn from a Zipf distribution (exponent 1.1) over 80k pseudo-words per language, made
  of 1-5 syllables, so that BPE finds sub-word structure as it does in real text, plus commas and
  a final full stop; the first letter of each sentence is upper case;
- each German word is a fixed function of the English word at a nearby position, so the pairs
  are learnable (a model can lower its loss on them), though the benchmark does not need that.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

CHUNK = 100_000  # sentences generated at once: ~120 MB of index arrays
VOCAB = 80_000
ZIPF = 1.1
NOISE = 3.0  # word length noise in the frequency order: ~5.8 bytes per word with its space


def pseudo_words(rng, n: int, syllables: list[str], max_syllables: int) -> list[str]:
  """`n` distinct words of 1..max_syllables syllables, shorter ones more likely, shortest first
  (frequent words are short, as in natural language)."""
  weights = 1.0 / np.arange(1, max_syllables + 1)
  words, seen = [], set()
  while len(words) < n:
    counts = rng.choice(np.arange(1, max_syllables + 1), 2 * n, p=weights / weights.sum())
    parts = rng.integers(0, len(syllables), (2 * n, max_syllables))
    for count, row in zip(counts.tolist(), parts.tolist()):
      word = "".join(syllables[i] for i in row[:count])
      if word not in seen and len(words) < n:
        seen.add(word)
        words.append(word)
  noise = rng.normal(0.0, NOISE, len(words))
  return [w for _, w in sorted(zip(np.array([len(w) for w in words]) + noise, words))]


def word_table(words: list[str]):
  """(bytes of every word followed by a space, offset of each word, length of each word + 1)."""
  encoded = [w.encode() + b" " for w in words]
  lengths = np.array([len(e) for e in encoded], np.int64)
  offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
  return np.frombuffer(b"".join(encoded), np.uint8), offsets, lengths


def render(table, ids: np.ndarray, sentence_lengths: np.ndarray) -> bytes:
  """Sentences of word ids (flattened) as text lines, built with NumPy gathers (no Python loop
  over words: the corpus has ~100M words per side)."""
  data, offsets, lengths = table
  chars = lengths[ids]
  out_starts = np.cumsum(chars) - chars
  total = int(chars.sum())
  gather = np.repeat(offsets[ids] - out_starts, chars) + np.arange(total)
  text = data[gather]
  sentence_ends = np.cumsum(sentence_lengths)  # in words
  last_char = out_starts[sentence_ends - 1] + chars[sentence_ends - 1] - 1
  text[last_char] = ord("\n")
  first = np.concatenate([[0], last_char[:-1] + 1])
  lower = (text[first] >= ord("a")) & (text[first] <= ord("z"))
  text[first[lower]] -= 32  # capitalise the first letter
  return text.tobytes()


def generate(out_dir: str, split: str, pairs: int, seed: int, tables, mapping) -> None:
  rng = np.random.default_rng([seed, sum(map(ord, split))])
  en_table, de_table = tables
  cdf = np.cumsum(1.0 / np.arange(1, VOCAB + 1) ** ZIPF)
  cdf /= cdf[-1]
  comma, stop = VOCAB, VOCAB + 1  # the two punctuation "words" after the pseudo-words
  with open(os.path.join(out_dir, f"{split}.en"), "wb") as en, \
       open(os.path.join(out_dir, f"{split}.de"), "wb") as de:
    for start in range(0, pairs, CHUNK):
      n = min(CHUNK, pairs - start)
      words = np.clip(np.round(rng.lognormal(np.log(21.0), 0.55, n)), 1, 150).astype(np.int64)
      ids = np.searchsorted(cdf, rng.random(int(words.sum())))
      ids[rng.random(len(ids)) < 0.05] = comma
      en_ids, en_lengths = _with_stop(ids, words, stop)
      # German: each word from the English word at a jittered position, via a fixed mapping;
      # a tenth of the words dropped or doubled, so the lengths differ a little.
      keep = rng.choice([0, 1, 2], len(ids), p=[0.05, 0.9, 0.05])
      de_words = np.maximum(np.add.reduceat(keep, np.cumsum(words) - words), 1)
      de_src = _positions(de_words, words, rng)
      de_ids, de_lengths = _with_stop(mapping[ids[de_src]], de_words, stop)
      en.write(render(en_table, en_ids, en_lengths))
      de.write(render(de_table, de_ids, de_lengths))


def _positions(de_words, en_words, rng):
  """Indices of English words, `de_words[s]` of them for sentence s, in roughly English order."""
  en_starts = np.cumsum(en_words) - en_words
  position = np.repeat(np.arange(len(de_words)), de_words)
  within = np.arange(len(position)) - np.repeat(np.cumsum(de_words) - de_words, de_words)
  scaled = within * np.repeat(en_words, de_words) // np.repeat(de_words, de_words)
  jitter = rng.choice([-1, 0, 1], len(position), p=[0.1, 0.8, 0.1])
  scaled = np.clip(scaled + jitter, 0, np.repeat(en_words, de_words) - 1)
  return en_starts[position] + scaled


def _with_stop(ids, words, stop):
  """Appends the full-stop word to every sentence: (ids, words per sentence)."""
  ends = np.cumsum(words)
  out = np.insert(ids, ends, stop)
  return out, words + 1


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("out_dir")
  parser.add_argument("--pairs", type=int, default=4_500_000)
  parser.add_argument("--eval_pairs", type=int, default=3_000)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()
  os.makedirs(args.out_dir, exist_ok=True)
  start = time.time()
  rng = np.random.default_rng(args.seed)
  consonants, vowels = list("bcdfghjklmnprstvwz"), list("aeiouy")
  syllables = [c + v for c in consonants for v in vowels] + [
      c + v + c2 for c in consonants[:10] for v in vowels for c2 in "nrst"]
  en_words = pseudo_words(rng, VOCAB, syllables, 4)
  de_words = pseudo_words(rng, VOCAB, syllables + ["sch", "ei", "ung", "keit"], 4)
  tables = (word_table(en_words + [",", "."]), word_table(de_words + [",", "."]))
  # German rank of each English word: near its own rank, so frequent words stay frequent.
  mapping = np.argsort(np.arange(VOCAB) * rng.lognormal(0.0, 0.5, VOCAB))
  mapping = np.concatenate([mapping, [VOCAB, VOCAB + 1]])
  for split, pairs in (("train", args.pairs), ("valid", args.eval_pairs),
                       ("test", args.eval_pairs)):
    generate(args.out_dir, split, pairs, args.seed, tables, mapping)
  size = sum(os.path.getsize(os.path.join(args.out_dir, f)) for f in os.listdir(args.out_dir))
  print(f"{args.out_dir}: {args.pairs:,} train pairs, {size / 1e9:.2f} GB, "
        f"{time.time() - start:.0f} s")


if __name__ == "__main__":
  main()
