"""Fine-tuning imported Hugging Face models on Multi30k: a GPT-2 continued on the English side,
a BERT classifier trained to tell English from German captions.

  python -m benchmarks.hf_finetune [DATA_DIR] [STEPS]

Both models are built by `transformers` at random initialisation (small configs; nothing is
downloaded) with tokenizers trained here by the `tokenizers` library (byte-level BPE, WordPiece),
saved with save_pretrained, imported with --mode=import_hf and trained with --mode=train for
STEPS (default 300) steps; then the trained workdir is exported with --mode=export_hf and the
export's validation loss (GPT-2) or accuracy (BERT), computed by transformers, is printed next
to ours.
DATA_DIR (default ../shared/data/multi30k) holds train.en/de and val.en/de.
"""

import argparse
import glob
import json
import os
import tempfile

import numpy as np
import torch
import transformers
from tokenizers import (
  Tokenizer,
  decoders,
  models,
  normalizers,
  pre_tokenizers,
  processors,
  trainers,
)

from benchmarks.common import MULTI30K, launch, lines
from transformer_jax.train.logger import read_metrics


def losses(workdir):
  """(step, train loss) and (step, eval loss) of a workdir's metrics."""
  records = read_metrics(workdir)
  return [(r["step"], round(r["loss"], 3)) for r in records if r["split"] == "train"], \
      [(r["step"], round(r["loss"], 3)) for r in records if r["split"] == "eval"]


def gpt2(data, root, steps):
  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  tokenizer.train_from_iterator(lines(os.path.join(data, "train.en")), trainers.BpeTrainer(
      vocab_size=4000, special_tokens=["<|endoftext|>"],
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  eos = tokenizer.token_to_id("<|endoftext|>")
  torch.manual_seed(0)
  model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
      vocab_size=tokenizer.get_vocab_size(), n_positions=64, n_embd=128, n_layer=2, n_head=4,
      bos_token_id=eos, eos_token_id=eos))
  hf_dir, workdir = os.path.join(root, "gpt2"), os.path.join(root, "gpt2_run")
  model.save_pretrained(hf_dir)
  transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<|endoftext|>",
                                       eos_token="<|endoftext|>").save_pretrained(hf_dir)
  launch("--mode=import_hf", f"--hf_dir={hf_dir}", f"--workdir={workdir}")
  launch("--mode=train", f"--workdir={workdir}", "--config.data.source=files",
         f"--config.data.path={data}", "--config.data.text_suffix=en",
         "--config.data.eval_split=val", "--config.data.test_split=",
         f"--config.train.steps={steps}", f"--config.train.log_every={steps // 6}",
         "--config.train.learning_rate=1e-3", "--config.train.warmup_steps=30",
         "--config.data.max_target_len=48", "--config.data.tokens_per_batch=2048")
  return workdir


def bert(data, root, steps):
  english, german = lines(os.path.join(data, "train.en")), lines(os.path.join(data, "train.de"))
  tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
  tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
  tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
  tokenizer.decoder = decoders.WordPiece()
  tokenizer.train_from_iterator(english + german, trainers.WordPieceTrainer(
      vocab_size=4000, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]))
  tokenizer.post_processor = processors.TemplateProcessing(
      single="[CLS] $A [SEP]", special_tokens=[("[CLS]", tokenizer.token_to_id("[CLS]")),
                                               ("[SEP]", tokenizer.token_to_id("[SEP]"))])
  torch.manual_seed(0)
  model = transformers.BertForSequenceClassification(transformers.BertConfig(
      vocab_size=tokenizer.get_vocab_size(), hidden_size=128, num_hidden_layers=2,
      num_attention_heads=4, intermediate_size=256, max_position_embeddings=64,
      id2label={0: "de", 1: "en"}, label2id={"de": 0, "en": 1}))
  hf_dir, workdir = os.path.join(root, "bert"), os.path.join(root, "bert_run")
  model.save_pretrained(hf_dir)
  transformers.PreTrainedTokenizerFast(
      tokenizer_object=tokenizer, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
      sep_token="[SEP]", mask_token="[MASK]").save_pretrained(hf_dir)
  # Half the captions in English, the other half (other images) in German.
  tsv = os.path.join(root, "language_id")
  os.makedirs(tsv)
  rng = np.random.default_rng(0)
  for split in ("train", "val"):
    en, de = lines(os.path.join(data, f"{split}.en")), lines(os.path.join(data, f"{split}.de"))
    half = len(en) // 2
    rows = [f"{t}\ten" for t in en[:half]] + [f"{t}\tde" for t in de[half:]]
    with open(os.path.join(tsv, f"{split}.tsv"), "w", encoding="utf-8") as f:
      f.write("\n".join(rows[i] for i in rng.permutation(len(rows))) + "\n")
  launch("--mode=import_hf", f"--hf_dir={hf_dir}", f"--workdir={workdir}")
  launch("--mode=train", f"--workdir={workdir}", "--config.data.source=files",
         f"--config.data.path={tsv}", "--config.data.eval_split=val",
         "--config.data.test_split=", f"--config.train.steps={steps}",
         f"--config.train.log_every={steps // 6}", "--config.train.learning_rate=3e-4",
         "--config.train.warmup_steps=30", "--config.data.batching=fixed",
         "--config.data.batch_size=32", "--config.data.max_source_len=48")
  return workdir


def transformers_gpt2_loss(hf_dir, texts):
  """Mean NLL per token of "<|endoftext|> text <|endoftext|>" (every token after the first), as
  our eval loss reads a text: by transformers, on the exported model."""
  model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
  tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
  eos = tokenizer.eos_token_id
  total, count = 0.0, 0
  with torch.no_grad():
    for text in texts:
      ids = torch.tensor([[eos] + tokenizer(text)["input_ids"] + [eos]])
      n = ids.shape[1] - 1
      total += float(model(input_ids=ids, labels=ids).loss) * n
      count += n
  return round(total / count, 3)


def transformers_accuracy(hf_dir, tsv):
  model = transformers.AutoModelForSequenceClassification.from_pretrained(hf_dir).eval()
  tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
  rows = [line.split("\t") for line in lines(tsv)]
  right = 0
  with torch.no_grad():
    for start in range(0, len(rows), 64):
      chunk = rows[start:start + 64]
      batch = tokenizer([t for t, _ in chunk], padding=True, truncation=True, max_length=48,
                        return_tensors="pt")
      predicted = model(**batch).logits.argmax(-1).tolist()
      right += sum(model.config.id2label[p] == label for p, (_, label) in zip(predicted, chunk))
  return round(right / len(rows), 4)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("data", nargs="?", default=str(MULTI30K),
                      help="Multi30k's train and val .en/.de")
  parser.add_argument("steps", nargs="?", type=int, default=300, help="training steps of each")
  args = parser.parse_args()
  data, steps = args.data, args.steps
  with tempfile.TemporaryDirectory() as root:
    for name, run in (("gpt2 on Multi30k English", gpt2), ("bert en/de classifier", bert)):
      workdir = run(os.path.abspath(data), root, steps)
      train, evaluation = losses(workdir)
      exported = os.path.join(root, f"{os.path.basename(workdir)}_hf")
      launch("--mode=export_hf", f"--workdir={workdir}", f"--hf_dir={exported}")
      kind = transformers.AutoConfig.from_pretrained(exported).architectures[0]
      if run is gpt2:
        check = ("the export's val loss by transformers "
                 f"{transformers_gpt2_loss(exported, lines(os.path.join(data, 'val.en')))}")
      else:
        accuracy = transformers_accuracy(exported, os.path.join(root, "language_id", "val.tsv"))
        with open(max(glob.glob(os.path.join(workdir, "eval", "*.json")))) as f:
          ours = json.load(f)["accuracy"]
        check = f"the export's val accuracy by transformers {accuracy} (ours {ours})"
      print(f"{name}: train loss by step {train}; eval loss {evaluation}; exported as {kind}; "
            f"{check}", flush=True)


if __name__ == "__main__":
  main()
