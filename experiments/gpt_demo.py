"""A small GPT on the English side of Multi30k (29,000 image captions): a decoder-only language
model that learns in minutes on a CPU. Perplexity on the validation captions, and samples:

  .venv/bin/python launch.py --config=experiments/gpt_demo.py --workdir=runs/gpt_demo
  echo "A man in a blue shirt" | .venv/bin/python launch.py --config=experiments/gpt_demo.py \\
    --workdir=runs/gpt_demo --mode=generate

4 pre-RMSNorm layers, d_model 128, SwiGLU, rotary positions, tied embeddings, a 4,000-piece BPE
vocabulary; packed rows of 64 tokens, 2,048 tokens per step: about 17 GFLOP a step, so that the
1,200 steps take about 12 minutes on two shared cores (8,192 tokens a step took ~3 s a step).
Generation samples at temperature 0.8 among the 40 most probable pieces (eval.decode=greedy for
the most probable continuation).
Reads ../shared/data/multi30k/{train,val,test_2016_flickr}.en (see multi30k_ende.py) or
--config.data.path=DIR; any directory of SPLIT.txt files of one text a line works with
--config.data.text_suffix=txt (and --config.data.test_split=NAME). After training, the
perplexity of val and of test_2016_flickr is evaluated.
"""

from transformer_jax.config import default_config


def get_config():
  c = default_config()
  c.model.update(arch="decoder_only", d_model=128, num_heads=4, num_decoder_layers=4, d_ff=384,
                 activation="swiglu", norm="pre", norm_type="rmsnorm", positional="rotary",
                 dropout_rate=0.1, vocab_size=4000, max_len=64, init="normal")
  c.data.update(task="lm", source="files", path="../shared/data/multi30k", format="text",
                text_suffix="en", train_split="train", eval_split="val",
                test_split="test_2016_flickr", max_target_len=64,
                batching="packed", tokens_per_batch=2048)
  c.data.tokenizer.update(model_type="bpe")
  c.train.update(steps=1200, schedule="cosine", learning_rate=3e-3, warmup_steps=100,
                 grad_clip_norm=1.0, label_smoothing=0.0, log_every=100, eval_every=200,
                 checkpoint_every=200, best_metric="perplexity")
  c.eval.update(decode="sample", temperature=0.8, top_k=40, max_decode_len=32, batch_size=256)
  return c
