"""Corpus metrics of decoded text against references (sacreBLEU, chrF, exact match) and of a
classifier's predictions (accuracy, macro-F1)."""

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


def classification_metrics(predicted: Sequence[str], gold: Sequence[str],
                           classes: Sequence[str]) -> dict:
  """accuracy, and macro_f1: the unweighted mean over `classes` of each class's F1 =
  2 TP / (2 TP + FP + FN) (0 for a class never predicted nor present), both in [0, 1].

  Written out rather than taken from scikit-learn, which this project does not otherwise need.
  """
  predicted, gold = np.asarray(predicted, object), np.asarray(gold, object)
  f1 = []
  for name in classes:
    true_positive = np.sum((predicted == name) & (gold == name))
    wrong = np.sum(predicted == name) + np.sum(gold == name) - 2 * true_positive  # FP + FN
    f1.append(2 * true_positive / (2 * true_positive + wrong) if true_positive + wrong else 0.0)
  return {"accuracy": float(np.mean(predicted == gold)), "macro_f1": float(np.mean(f1))}
