"""Hugging Face model directories written for the tests (test helper): a GPT-2 of one layer
that imports, built with the safetensors and tokenizers libraries themselves."""

import json


def gpt2_files(directory, vocab_size=300, d=8, positions=16, **config):
  """A GPT-2 of one layer that imports: config.json, model.safetensors, tokenizer.json."""
  import numpy as np
  from safetensors.numpy import save_file
  from tokenizers import Tokenizer, models, pre_tokenizers, trainers
  directory.mkdir()
  (directory / "config.json").write_text(json.dumps(dict(
      model_type="gpt2", architectures=["GPT2LMHeadModel"], vocab_size=vocab_size, n_embd=d,
      n_head=2, n_layer=1, n_positions=positions, **config)))
  shapes = {"transformer.wte.weight": (vocab_size, d), "transformer.wpe.weight": (positions, d)}
  for name, shape in (("ln_1", (d,)), ("ln_2", (d,)), ("attn.c_attn", (d, 3 * d)),
                      ("attn.c_proj", (d, d)), ("mlp.c_fc", (d, 4 * d)),
                      ("mlp.c_proj", (4 * d, d))):
    shapes[f"transformer.h.0.{name}.weight"] = shape
    shapes[f"transformer.h.0.{name}.bias"] = shape[-1:]
  shapes.update({"transformer.ln_f.weight": (d,), "transformer.ln_f.bias": (d,)})
  save_file({k: np.ones(v, np.float32) for k, v in shapes.items()},
            str(directory / "model.safetensors"))
  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel()
  tokenizer.train_from_iterator(["jump left", "walk right twice"], trainers.BpeTrainer(
      vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  tokenizer.save(str(directory / "tokenizer.json"))
  return directory
