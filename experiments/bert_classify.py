"""Sequence classification fine-tuned from the masked LM of bert_mlm.py (train.init_from): is a
SCAN command "long" (more than 22 actions, the length split's rule) or "short"? The classifier
has to count what twice, thrice, around and "and" multiply; 19% of the commands are long.
Accuracy and macro-F1 on the test commands:

  .venv/bin/python launch.py --config=experiments/bert_classify.py --workdir=runs/bert_classify

--config.train.init_from= (empty) trains the same model from scratch, for comparison. Any
text<TAB>label TSV works (--config.data.source=files --config.data.path=DIR, SPLIT.tsv), and
TFDS classification datasets by name, e.g. SST-2: --config.data.source=tfds
--config.data.tfds_name=glue/sst2 --config.data.text_field=sentence
--config.data.eval_split=validation (after pretraining on text of that kind).
"""

from transformer_jax.experiments import bert_mlm


def get_config():
  c = bert_mlm.get_config()
  c.model.num_labels = 2
  c.data.update(task="classify", max_source_len=16, bucket_width=16, tokens_per_batch=2048)
  c.train.update(init_from="runs/bert_mlm", steps=1000, learning_rate=5e-4, warmup_steps=100,
                 best_metric="macro_f1")
  return c
