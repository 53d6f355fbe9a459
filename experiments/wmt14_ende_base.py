"""WMT14 English->German, Transformer base (Vaswani et al., 2017): 27.3 BLEU on newstest2014.

TFDS `wmt14_translate/de-en` (4.5M pairs), downloaded and prepared TF-free as array_record on the
first run (into data.tfds_data_dir, default ~/tensorflow_datasets); shared 37k BPE vocabulary;
batches of ~25k source + 25k target tokens by approximate length; 100k steps; validation on
newstest2013 (the TFDS `validation` split), test on newstest2014 (`test`): evaluate it with
--config.data.eval_split=test. Beam 4, length penalty 0.6, as in the paper.

The paper's batch was 8 GPUs x ~3.1k tokens per side; on fewer devices keep the 25k tokens with
train.grad_accum_steps (the budget is global: rows are split across devices and microbatches).
"""

from transformer_jax.experiments import base


def get_config():
  c = base.get_config()
  c.data.update(source="tfds", tfds_name="wmt14_translate/de-en", source_lang="en",
                target_lang="de", train_split="train", eval_split="validation",
                test_split="test", max_source_len=255, max_target_len=255, batching="tokens",
                tokens_per_batch=25_000, bucket_width=8)
  c.data.tokenizer.update(model_type="bpe", character_coverage=1.0, sample_size=2_000_000)
  c.train.update(eval_every=10_000, log_every=100)
  c.eval.update(decode="beam", beam_size=4, length_penalty=0.6, batch_size=128, max_examples=0)
  return c
