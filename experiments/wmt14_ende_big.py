"""WMT14 English->German, Transformer big (Vaswani et al., 2017): 28.4 BLEU on newstest2014.

The data recipe of wmt14_ende_base.py (TFDS wmt14_translate/de-en, 37k shared BPE, ~25k + 25k tokens
per batch, newstest2013 validation, newstest2014 test) with the big model: d_model 1024, 16 heads,
FFN 4096, dropout 0.3, 300k steps.
"""

from transformer_jax.experiments import big, wmt14_ende_base
from transformer_jax.tools import sweep


def get_config():
  c = big.get_config()
  data = wmt14_ende_base.get_config()
  c.data = data.data
  c.eval = data.eval
  c.train.update(eval_every=data.train.eval_every, log_every=data.train.log_every)
  # docs/cloud.md's multi-host sweep (--sweep): 24 trials, stopped early by the median rule.
  c.sweep.update(budget=24, pruner="median")
  return c


def get_search_space():
  """What `--sweep` draws (docs/cloud.md's multi-host sweep; sweep.budget trials): the learning rate
  within a factor of 3 either way of the recipe's, and dropout around its 0.3."""
  lr = get_config().train.learning_rate
  return {"train.learning_rate": sweep.log_uniform(lr / 3, lr * 3),
          "model.dropout_rate": sweep.uniform(0.1, 0.4)}
