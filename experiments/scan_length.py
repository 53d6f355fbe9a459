"""SCAN, length split: train on action sequences of at most 22 actions, test on longer ones.

Transformers famously fail this split (exact match near 0-20%). Model selection never sees the
test split: the run trains on `train_without_dev` (outputs of at most 21 actions), evaluates on
`dev` (the 576 train commands with 22-action outputs: the longest of the train split) every
500 steps, and keeps the checkpoint with the best dev exact match. Then, once per run:

  .venv/bin/python launch.py --config=experiments/scan_length.py --workdir=runs/scan_length \
    --mode=evaluate --config.data.eval_split=test --checkpoint_step=BEST_DEV_STEP

`get_sweep()` holds the position and architecture options compared in docs/benchmarks.md: the
paper's model (sinusoidal positions), T5's relative position bias (with the default buckets, and
with 16 or 8 buckets up to distance 16 or 8, so that every distance of a longer test output falls
in a bucket trained on), and a decoder-only model with relative bias, no positions (NoPE) or RoPE.
"""

from transformer_jax.experiments import scan_simple

# A 4-layer decoder-only model, about the size of the 2+2-layer encoder-decoder.
DECODER_ONLY = {"model.arch": "decoder_only", "model.num_decoder_layers": 4, "model.norm": "pre"}
SHORT_BUCKETS = {"model.relative_buckets": 16, "model.relative_max_distance": 16}
SHORTER_BUCKETS = {"model.relative_buckets": 8, "model.relative_max_distance": 8}


def get_config():
  c = scan_simple.get_config()
  c.model.max_len = 128  # the decoder-only model reads source and target as one sequence
  c.data.update(scan_split="length", train_split="train_without_dev", eval_split="dev",
                test_split="test")
  # 3,000 steps: on the 2-core CPU a trial takes 5-10 minutes; dev exact match mostly peaks by then.
  c.train.update(steps=3000, eval_every=500, keep_best=1, best_metric="exact_match")
  return c


def get_sweep():
  return [
      {},
      {"model.positional": "relative_bias"},
      {"model.positional": "relative_bias", **SHORT_BUCKETS},
      {**DECODER_ONLY, "model.positional": "relative_bias", **SHORT_BUCKETS},
      {**DECODER_ONLY, "model.positional": "none"},
      {**DECODER_ONLY, "model.positional": "rotary"},
      # Added after the first six: shorter buckets helped both architectures there.
      {"model.positional": "relative_bias", **SHORTER_BUCKETS},
      {**DECODER_ONLY, "model.positional": "relative_bias", **SHORTER_BUCKETS},
      # Issue 29's position schemes: Transformer-XL relative attention (Csordás et al. 2021 found
      # relative positions the main fix), randomised training positions (Ruoss et al. 2023) and
      # shared ("universal") layers.
      {"model.positional": "relative_xl"},
      {**DECODER_ONLY, "model.positional": "relative_xl"},
      {"model.positional": "relative_xl", "model.share_layers": True},
      {"model.positional": "relative_xl", "model.random_positions_max": 256},
      {**DECODER_ONLY, "model.positional": "rotary", "model.random_positions_max": 256},
  ]
