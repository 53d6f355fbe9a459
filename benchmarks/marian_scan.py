"""The SCAN demo model exported as Marian: our greedy against transformers' and CTranslate2's on
every SCAN test command, then the decoding speed of the three side by side.

  python -m benchmarks.marian_scan WORKDIR [COUNT]

WORKDIR is a trained encoder-decoder workdir whose options Marian expresses: the `make demo`
recipe with Marian's LayerNorm epsilon and zero start embedding (CTranslate2 starts every Marian
decoder from zeros), trained by

  launch.py --config=experiments/scan_simple.py --workdir=WORKDIR --mode=train \\
      --config.model.layer_norm_eps=1e-5 --config.model.zero_bos_embedding=True

The script exports it (`export_hf`), converts the export with CTranslate2's own converter (float32
and int8), decodes the first COUNT test commands (default: all 4,182) with ours (KV cache, batches
of 512), transformers' MarianMTModel.generate and CTranslate2's Translator, and prints one JSON
object: for each decoder, how many outputs equal ours token for token, the exact match against
the references and the seconds taken (greedy, and beam 4 for ours and CTranslate2).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import cut
from transformer_jax import config as config_lib
from transformer_jax.data import scan
from transformer_jax.eval import decode
from transformer_jax.eval.load import load_trained
from transformer_jax.eval.translate import encode_sources
from transformer_jax.tools import hf

BATCH = 512


def _search(params, cfg, inputs, length: int, beam: int):
  if beam:
    return decode.beam_search(params, cfg, inputs, length, beam_size=beam, alpha=0.6)[0]
  return decode.greedy_decode(params, cfg, inputs, length)


def ours(trained, config, commands, beam: int = 0):
  """(our output ids of each command without EOS, seconds of decoding after a warm-up)."""
  cfg = trained.model_config.replace(deterministic=True)
  length = config.data.max_target_len
  outputs, seconds = [], 0.0
  for start in range(0, len(commands), BATCH):
    inputs, _ = encode_sources(trained.tokenizer, commands[start:start + BATCH],
                               config.data.max_source_len, BATCH)

    inputs = jnp.asarray(inputs)
    if start == 0:
      jax.block_until_ready(_search(trained.params, cfg, inputs, length, beam))  # compiling
    begin = time.perf_counter()
    tokens = np.asarray(jax.block_until_ready(_search(trained.params, cfg, inputs, length, beam)))
    seconds += time.perf_counter() - begin
    n = min(BATCH, len(commands) - start)
    outputs += [cut(row, 2) for row in tokens[:n].tolist()]
  return outputs, seconds


def transformers_greedy(hf_dir, commands, length):
  """(their greedy output ids of each command without EOS, seconds), by MarianMTModel.generate."""
  import torch
  import transformers
  model = transformers.MarianMTModel.from_pretrained(hf_dir).eval()
  tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
  outputs, begin = [], time.perf_counter()
  for start in range(0, len(commands), BATCH):
    batch = tokenizer(commands[start:start + BATCH], padding=True, return_tensors="pt")
    with torch.no_grad():
      out = model.generate(**batch, max_new_tokens=length, do_sample=False, num_beams=1,
                           forced_eos_token_id=None)  # ours forces no EOS at the limit
    outputs += [cut(row[1:], model.config.eos_token_id) for row in out.tolist()]
  return outputs, time.perf_counter() - begin


def ctranslate2_outputs(ct2_dir, hf_dir, commands, length, beam: int = 1,
                        compute_type: str = "default"):
  """(CTranslate2's output ids of each command, seconds) of the converted model."""
  import ctranslate2
  import transformers
  tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
  translator = ctranslate2.Translator(ct2_dir, device="cpu", compute_type=compute_type,
                                      intra_threads=os.cpu_count() or 1)
  sources = [tokenizer.convert_ids_to_tokens(ids) for ids in tokenizer(commands)["input_ids"]]
  translator.translate_batch(sources[:8], beam_size=beam, max_decoding_length=length)  # warm-up
  begin = time.perf_counter()
  results = translator.translate_batch(sources, beam_size=beam, max_batch_size=BATCH,
                                       max_decoding_length=length, length_penalty=0.6)
  seconds = time.perf_counter() - begin
  return [tokenizer.convert_tokens_to_ids(r.hypotheses[0]) for r in results], seconds


def their_ids(hf_dir, trained, outputs):
  """Our output ids as the export's ids (through its vocab.json)."""
  with open(os.path.join(hf_dir, "vocab.json"), encoding="utf-8") as f:
    vocab = json.load(f)
  return [[vocab[piece] for piece in trained.tokenizer.pieces(row)] for row in outputs]


def compare(workdir: str, out_dir: str, count=None, timing: bool = True) -> dict:
  """Exports `workdir` into `out_dir`, converts it with CTranslate2 and decodes the first `count`
  SCAN test commands with the three; returns the counts and times (see the module docstring)."""
  from ctranslate2.converters import TransformersConverter
  workdir = os.path.abspath(workdir)
  config = config_lib.from_workdir(workdir)
  trained = load_trained(config, workdir)
  pairs = scan.load(config.data.scan_split, "test")[:count]
  commands, references = [c for c, _ in pairs], [a for _, a in pairs]
  hf_dir, ct2_dir = os.path.join(out_dir, "hf"), os.path.join(out_dir, "ct2")
  hf.export_hf(workdir, hf_dir)
  TransformersConverter(hf_dir).convert(ct2_dir)
  length = config.data.max_target_len

  mine, seconds = ours(trained, config, commands)
  expected = their_ids(hf_dir, trained, mine)

  import transformers
  tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)

  def exact(ids_rows):
    """The fraction of outputs (their ids) whose text is the reference."""
    texts = tokenizer.batch_decode(ids_rows, skip_special_tokens=True)
    return sum(" ".join(t.split()) == r for t, r in zip(texts, references)) / len(references)

  def row(outputs, seconds):
    return {"equal_to_ours": sum(a == b for a, b in zip(outputs, expected)),
            "seconds": round(seconds, 3), "exact_match": exact(outputs)}

  result = {"commands": len(commands), "workdir": workdir}
  result["ours_greedy"] = {"seconds": round(seconds, 3), "exact_match": exact(expected),
                           "tokens": sum(map(len, mine))}
  outputs, seconds = transformers_greedy(hf_dir, commands, length)
  result["transformers_greedy"] = row(outputs, seconds)
  outputs, seconds = ctranslate2_outputs(ct2_dir, hf_dir, commands, length)
  result["ctranslate2_greedy"] = row(outputs, seconds)
  if timing:
    beam, seconds = ours(trained, config, commands, beam=4)
    result["ours_beam4"] = {"seconds": round(seconds, 3),
                            "exact_match": exact(their_ids(hf_dir, trained, beam))}
    for compute_type in ("float32", "int8"):
      for size in (1, 4):
        outputs, seconds = ctranslate2_outputs(ct2_dir, hf_dir, commands, length, size,
                                               compute_type)
        name = f"ctranslate2_{'greedy' if size == 1 else 'beam4'}_{compute_type}"
        result[name] = row(outputs, seconds)
  return result


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("workdir", help="a trained workdir of the recipe above")
  parser.add_argument("count", nargs="?", type=int, help="the first COUNT test commands (all)")
  args = parser.parse_args()
  with tempfile.TemporaryDirectory() as out_dir:
    print(json.dumps(compare(args.workdir, out_dir, args.count), indent=2))


if __name__ == "__main__":
  main()
