"""Transformer base (Vaswani et al., 2017, Table 3): 6+6 layers, d_model 512, 8 heads, 63M
parameters.

The model and optimiser recipe of the paper; a dataset recipe (e.g. WMT14 En-De) starts from it.
"""

from transformer_jax.config import default_config


def get_config():
  c = default_config()
  c.model.update(d_model=512, num_heads=8, d_ff=2048, num_encoder_layers=6, num_decoder_layers=6,
                 dropout_rate=0.1, vocab_size=37000, share_embeddings=True, tie_output=True,
                 max_len=256)
  c.train.update(steps=100_000, schedule="rsqrt", learning_rate=1.0, warmup_steps=4000,
                 label_smoothing=0.1, checkpoint_every=5000)
  return c
