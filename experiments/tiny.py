"""A tiny model on SCAN for tests and smoke runs: seconds per run on a CPU."""

from transformer_jax.config import default_config
from transformer_jax.experiments import scan_simple
from transformer_jax.tools import sweep


def get_config():
  c = default_config()
  c.model.update(d_model=32, num_heads=2, d_ff=64, num_encoder_layers=1, num_decoder_layers=1,
                 dropout_rate=0.0, vocab_size=32, max_len=64)
  # One length bucket (64 >= max_target_len): every batch has the same shape, so a run traces
  # and compiles its train step once, not once per bucket (a warm run: about a third less CPU,
  # which the tests' many tiny runs add up).
  scan_simple.scan_data(c.data, tokens_per_batch=256, bucket_width=64)
  c.train.update(steps=20, schedule="constant", learning_rate=1e-3, warmup_steps=0,
                 log_every=10, checkpoint_every=10)
  c.eval.update(batch_size=64, max_examples=64)
  return c


def get_sweep():
  """Four trials, for tests of `--sweep`."""
  return sweep.grid(**{"train.learning_rate": [1e-3, 3e-3], "model.d_ff": [32, 64]})


def get_search_space():
  """What `--sweep --config.sweep.budget=N` draws beyond get_sweep()'s trials (README: Sweeps)."""
  return {"train.learning_rate": sweep.log_uniform(3e-4, 1e-2),
          "model.d_ff": sweep.choice([32, 64])}
