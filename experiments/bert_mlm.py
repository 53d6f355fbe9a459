"""A small BERT: an encoder-only model pretrained as a masked language model on SCAN's texts
("command actions", e.g. "jump twice I_JUMP I_JUMP"; generated from the grammar, no download).
To fill in masked actions the model has to interpret the command. Then fine-tune a classifier
from it with bert_classify.py:

  .venv/bin/python launch.py --config=experiments/bert_mlm.py --workdir=runs/bert_mlm
  .venv/bin/python launch.py --config=experiments/bert_classify.py --workdir=runs/bert_classify

BERT's shape at 1/6 of the width: 4 post-LN layers, d_model 128, GELU, learned positions, the
MLM head tied to the embeddings; 15% of the tokens masked (80% <mask>, 10% random, 10% kept),
drawn anew every step. On text files instead: --config.data.source=files --config.data.path=DIR
(SPLIT.txt, one text a line) and a BPE vocabulary (--config.data.tokenizer.model_type=bpe
--config.model.vocab_size=8000).
"""

from transformer_jax.config import default_config


def get_config():
  c = default_config()
  c.model.update(arch="encoder_only", d_model=128, num_heads=4, num_encoder_layers=4, d_ff=512,
                 activation="gelu", norm="post", positional="learned", dropout_rate=0.1,
                 vocab_size=32, max_len=64, init="normal")
  c.data.update(task="mlm", mask_rate=0.15, source="scan", scan_split="simple",
                train_split="train", eval_split="test", max_source_len=64, batching="tokens",
                tokens_per_batch=4096, bucket_width=16)
  c.data.tokenizer.model_type = "word"
  c.train.update(steps=2000, schedule="cosine", learning_rate=1e-3, warmup_steps=200,
                 grad_clip_norm=1.0, label_smoothing=0.0, log_every=100, eval_every=500,
                 checkpoint_every=500)
  c.eval.update(batch_size=512)
  return c
