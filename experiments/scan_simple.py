"""SCAN, simple split (random 80/20): the embedded default. `make demo` trains this on a CPU.

A small post-LN Transformer with a word-level SentencePiece vocabulary (SCAN has 19 words).
Batches are length-bucketed under a 1024-token budget (~45 commands each); a cosine schedule
decaying to zero takes greedy exact match on the test split to >= 99% in 5000 steps.
"""

from transformer_jax.config import default_config


def scan_data(data, tokens_per_batch: int, bucket_width: int):
  """SCAN's simple split in words (commands up to 12, actions up to 50), batched by tokens."""
  data.update(source="scan", scan_split="simple", max_source_len=12, max_target_len=50,
              batching="tokens", tokens_per_batch=tokens_per_batch, bucket_width=bucket_width)
  data.tokenizer.model_type = "word"


def get_config():
  c = default_config()
  c.model.update(d_model=128, num_heads=4, d_ff=256, num_encoder_layers=2, num_decoder_layers=2,
                 dropout_rate=0.0, vocab_size=32, max_len=64)
  scan_data(c.data, tokens_per_batch=1024, bucket_width=16)
  c.train.update(steps=5000, schedule="cosine", learning_rate=2e-3, warmup_steps=300,
                 grad_clip_norm=1.0, label_smoothing=0.0, log_every=250, eval_every=1000,
                 checkpoint_every=1000)
  c.eval.update(batch_size=512)
  return c
