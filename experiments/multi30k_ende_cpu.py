"""Multi30k English->German (task 1) on a laptop: 2 CPU cores, 30 minutes of training.

The published small recipe (multi30k_ende.py) is built for a GPU: its 2,000-step warm-up alone
takes over an hour on two cores. This one spends the 30 minutes differently: a wider, shallower
pre-LayerNorm model that converges at a high learning rate, small packed batches (many updates),
and a cosine schedule that reaches zero at the last step, which on the reference machine
(2 vCPUs) is at about 30 minutes. Batch size and learning rate were chosen by the sweep below
on `val`; `test_2016_flickr` was only read for the final report (docs/benchmarks.md: 37.9 cased
sacreBLEU on test_2016_flickr after 29.6 minutes, beam 5).

  .venv/bin/python launch.py --config=experiments/multi30k_ende_cpu.py --workdir=runs/multi30k_cpu

On a faster machine the same steps take less time; give it more with --config.train.steps.

Reads the raw text from ../shared/data/multi30k (train.{en,de}, val.{en,de},
test_2016_flickr.{en,de}) or from --config.data.path=DIR. The final evaluation decodes `val`
and `test_2016_flickr` with beam 5 (cased, detokenized sacreBLEU).
"""

from transformer_jax.config import default_config

STEPS = 4900  # ~29 minutes at ~2.8 steps/s on the reference machine, start-up included


def get_config():
  c = default_config()
  c.model.update(d_model=256, num_heads=4, d_ff=1024, num_encoder_layers=3,
                 num_decoder_layers=3, dropout_rate=0.2, norm="pre", vocab_size=8000,
                 share_embeddings=True, tie_output=True, max_len=128)
  c.data.update(source="files", path="../shared/data/multi30k", format="parallel",
                source_lang="en", target_lang="de", train_split="train", eval_split="val",
                test_split="test_2016_flickr", max_source_len=64, max_target_len=64,
                batching="packed", tokens_per_batch=1024)
  c.data.tokenizer.update(model_type="bpe", character_coverage=1.0)
  # No evaluation while training: it would come out of the 30 minutes. Seven checkpoints, about
  # four minutes apart, for the curve of docs/benchmarks.md.
  c.train.update(steps=STEPS, schedule="cosine", learning_rate=2e-3, warmup_steps=400,
                 label_smoothing=0.1, log_every=100, eval_every=0, checkpoint_every=700,
                 keep_checkpoints=7, keep_best=0)
  c.eval.update(decode="beam", beam_size=5, length_penalty=0.6, batch_size=256)
  c.sweep.metric = "bleu"  # get_sweep()'s trials are ranked by greedy BLEU on val
  return c


def get_sweep():
  """Short trials (about 6 minutes of training each on the reference machine, the same minutes
  whatever the batch size), scored by greedy BLEU on `val`; the test split is switched off in
  every trial. Results in docs/benchmarks.md: 1,024 tokens per batch at 2e-3 won."""
  def trial(tokens, lr, steps=None, **more):
    steps = steps or (480 if tokens == 2048 else 250)  # the same minutes at either batch size
    return {"data.tokens_per_batch": tokens, "train.learning_rate": lr, "train.steps": steps,
            "train.warmup_steps": steps // 10, "train.checkpoint_every": steps,
            "data.test_split": "", "eval.decode": "greedy", **more}
  return [trial(2048, 1e-3), trial(2048, 2e-3), trial(2048, 3e-3), trial(4096, 2e-3),
          # Added after the first four: the rate still rose at 3e-3; and one layer more each,
          # for as many minutes (a step costs 4/3 as much).
          trial(2048, 5e-3),
          trial(2048, 3e-3, 360, **{"model.num_encoder_layers": 4,
                                    "model.num_decoder_layers": 4}),
          # 4,096 tokens lost to 2,048 by far: half as many again (~1.9x the steps per minute).
          trial(1024, 2e-3, 900),
          # 1,024 won by far again: half as many once more.
          trial(512, 1.5e-3, 1700)]
