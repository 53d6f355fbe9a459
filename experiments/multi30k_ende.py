"""Multi30k English->German (task 1) with the published small-Transformer recipe (Wu et al., 2021):
4+4 layers, d_model 128, FFN 256, 4 heads, dropout 0.3, shared embeddings, 10k joint BPE,
peak learning rate 0.005 after 2k warmup steps (inverse square root decay), ~8k tokens per update,
8k updates, beam 5.

Reads the raw text from ../shared/data/multi30k (train.{en,de}, val.{en,de},
test_2016_flickr.{en,de}; see its SOURCE.md) or from --config.data.path=DIR. Validation runs on
`val`; evaluate on the test set with --config.data.eval_split=test_2016_flickr.

  .venv/bin/python launch.py --config=experiments/multi30k_ende.py --workdir=runs/multi30k

Published: 41.0 BLEU on test_2016_flickr, lowercased and tokenized, last-10 checkpoint average;
the cased, detokenized sacreBLEU reported here runs several points lower.
"""

from transformer_jax.config import default_config
from transformer_jax.tools import sweep

D_MODEL, WARMUP, PEAK_LR = 128, 2000, 0.005


def get_config():
  c = default_config()
  c.model.update(d_model=D_MODEL, num_heads=4, d_ff=256, num_encoder_layers=4,
                 num_decoder_layers=4, dropout_rate=0.3, vocab_size=10000, share_embeddings=True,
                 tie_output=True, max_len=128)
  c.data.update(source="files", path="../shared/data/multi30k", format="parallel",
                source_lang="en", target_lang="de", train_split="train", eval_split="val",
                test_split="test_2016_flickr", max_source_len=64, max_target_len=64,
                # Packed rows: one compiled shape and ~7% padding; 8192 tokens per side per update.
                batching="packed", tokens_per_batch=8192)
  c.data.tokenizer.update(model_type="bpe", character_coverage=1.0, sample_size=1_000_000)
  # The paper's rsqrt schedule peaks at scale * d_model^-0.5 * warmup^-0.5: this scale puts the
  # peak at PEAK_LR, which is fairseq's inverse_sqrt schedule of the recipe.
  c.train.update(steps=8000, schedule="rsqrt", learning_rate=PEAK_LR * (D_MODEL * WARMUP)**0.5,
                 warmup_steps=WARMUP, label_smoothing=0.1, log_every=100, eval_every=1000,
                 checkpoint_every=1000, keep_checkpoints=10)
  c.eval.update(decode="beam", beam_size=5, length_penalty=0.6, batch_size=256)
  # The sweep of docs/cloud.md's recipes (--sweep): 200 trials drawn from get_search_space(),
  # the unpromising stopped at their evaluations by ASHA.
  c.sweep.update(budget=200, pruner="asha")
  return c


def get_search_space():
  """What `--sweep` draws (docs/cloud.md's sweep recipes; sweep.budget trials): the recipe's peak
  learning rate within a factor of 3 either way, dropout and label smoothing around its own."""
  lr = get_config().train.learning_rate
  return {"train.learning_rate": sweep.log_uniform(lr / 3, lr * 3),
          "model.dropout_rate": sweep.uniform(0.1, 0.4),
          "train.label_smoothing": sweep.uniform(0.0, 0.2)}
