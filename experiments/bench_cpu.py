"""The CPU speed reference: d_model 256, 4 heads, 3+3 layers, vocab 8000, batch 64 x 32.

  .venv/bin/python launch.py --config=experiments/bench_cpu.py --mode=benchmark \
    --config.benchmark.torch=True
"""

from transformer_jax.config import default_config


def get_config():
  c = default_config()
  c.model.update(d_model=256, num_heads=4, d_ff=1024, num_encoder_layers=3, num_decoder_layers=3,
                 dropout_rate=0.1, vocab_size=8000, max_len=128)
  c.train.update(label_smoothing=0.1)
  c.benchmark.update(batch_size=64, source_len=32, target_len=32, steps=20, warmup=3)
  return c
