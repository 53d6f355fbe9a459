"""Corpus metrics of decoded text against references: sacreBLEU, chrF, exact match."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import sacrebleu


def text_metrics(hypotheses: Sequence[str], references: Sequence[str]) -> dict:
  """Corpus metrics of detokenized hypotheses against one reference each, all in [0, 100] but
  exact match in [0, 1].

  bleu: sacreBLEU on cased, detokenized text (its own 13a tokenization): the number to report;
    `bleu_signature` records how it was computed.
  bleu_lowercase_tokenized: the same on lowercased text, which is close to multi-bleu.perl -lc on
    Moses-tokenized text, for comparison with papers that report that.
  chrf: sacreBLEU chrF (character 6-grams, beta 2).
  exact_match: the fraction of hypotheses equal to their reference up to whitespace.
  """
  hypotheses, references = list(hypotheses), [list(references)]
  bleu = sacrebleu.BLEU()
  score = bleu.corpus_score(hypotheses, references)
  return {
      "bleu": score.score,
      "bleu_lowercase_tokenized":
          sacrebleu.BLEU(lowercase=True).corpus_score(hypotheses, references).score,
      "chrf": sacrebleu.CHRF().corpus_score(hypotheses, references).score,
      "exact_match": float(np.mean([h.split() == r.split()
                                    for h, r in zip(hypotheses, references[0])])),
      "bleu_signature": str(bleu.get_signature()),
  }
