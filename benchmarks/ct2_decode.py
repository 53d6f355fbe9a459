"""Our greedy and beam decoding against CTranslate2's (float32 and int8, CPU) on one Llama model,
side by side in one run.

  python -m benchmarks.ct2_decode [DATA_DIR] [--prompts N] [--new_tokens T] [--batch B]

A LlamaForCausalLM is built by `transformers` (random weights drawn so that each layer keeps
its activations' scale and greedy choices are not near-ties; nothing is downloaded) with a
Llama tokenizer converted by `transformers` from a SentencePiece model trained here on
Multi30k; it is imported (--mode=import_hf's function), exported again (export_hf's), and the
export is converted with CTranslate2's own converter. The prompts are the first N English
Multi30k validation captions as Llama reads them (`<s>` first). Each decoder continues every
prompt by T tokens, B prompts per call (and once more one prompt per call): ours
(`decode.greedy_decode`, `decode.beam_search`, jitted, compiled before timing) and
CTranslate2's `Generator.generate_batch` with compute_type float32 and int8. Beam search: 4
beams ranked by raw log-probability (our alpha 0, their length_penalty 0). BOS is never emitted
by ours; theirs is told the same. Printed: the time per decoding of all N prompts (median of
--repeats), tokens/s, and how many continuations equal ours exactly.
DATA_DIR (default ../shared/data/multi30k) holds train.en/de and val.en.
"""

import argparse
import io
import os
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import sentencepiece as spm
import torch
import transformers

from benchmarks.common import MULTI30K, cut, lines
from transformer_jax import config as config_lib
from transformer_jax.eval import decode
from transformer_jax.eval.load import load_trained
from transformer_jax.tools import hf


def build(data, root, args):
  """Their model directory: the tokenizer and a LlamaForCausalLM of the given size."""
  texts = lines(os.path.join(data, "train.en"), 20000) + lines(os.path.join(data, "train.de"),
                                                               20000)
  model = io.BytesIO()
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(texts), model_writer=model, vocab_size=args.vocab, model_type="bpe",
      byte_fallback=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)
  os.makedirs(os.path.join(root, "spm"))
  with open(os.path.join(root, "spm", "tokenizer.model"), "wb") as f:
    f.write(model.getvalue())
  tokenizer = transformers.LlamaTokenizer.from_pretrained(os.path.join(root, "spm"),
                                                          add_bos_token=True)
  config = transformers.LlamaConfig(
      vocab_size=len(tokenizer), hidden_size=args.d_model, intermediate_size=args.d_ff,
      num_hidden_layers=args.layers, num_attention_heads=args.heads,
      num_key_value_heads=args.kv_heads, max_position_embeddings=256, rope_theta=10000.0,
      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
  torch.manual_seed(0)
  llama = transformers.LlamaForCausalLM(config).eval()
  with torch.no_grad():
    for name, parameter in llama.named_parameters():
      if name.endswith("embed_tokens.weight"):
        parameter.normal_(0.0, 1.0)
      elif parameter.ndim == 2:  # [out, in]: unit gain
        parameter.normal_(0.0, parameter.shape[1] ** -0.5)
  directory = os.path.join(root, "hf")
  llama.save_pretrained(directory)
  tokenizer.save_pretrained(directory)
  return directory, tokenizer


def timed(fn, repeats):
  """(median seconds, the last result) of `repeats` calls after one untimed warm-up call."""
  result = fn()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    result = fn()
    times.append(time.perf_counter() - start)
  return statistics.median(times), result


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("data", nargs="?", default=str(MULTI30K))
  parser.add_argument("--prompts", type=int, default=64)
  parser.add_argument("--new_tokens", type=int, default=32)
  parser.add_argument("--batch", type=int, default=16)
  parser.add_argument("--single", type=int, default=8, help="prompts decoded one per call")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--vocab", type=int, default=8000)
  parser.add_argument("--d_model", type=int, default=512)
  parser.add_argument("--d_ff", type=int, default=1408)
  parser.add_argument("--layers", type=int, default=6)
  parser.add_argument("--heads", type=int, default=8)
  parser.add_argument("--kv_heads", type=int, default=4)
  parser.add_argument("--threads", type=int, default=os.cpu_count(),
                      help="CTranslate2's intra_threads (JAX uses every core)")
  args = parser.parse_args()
  import ctranslate2
  from ctranslate2.converters import TransformersConverter

  root = tempfile.mkdtemp(prefix="ct2_decode_")
  hf_dir, tokenizer = build(args.data, root, args)
  hf.import_hf(hf_dir, os.path.join(root, "w"))
  hf.export_hf(os.path.join(root, "w"), os.path.join(root, "exported"))
  TransformersConverter(os.path.join(root, "exported")).convert(os.path.join(root, "ct2"))
  config = config_lib.from_workdir(os.path.join(root, "w"))
  trained = load_trained(config, os.path.join(root, "w"))
  model = trained.model_config.replace(deterministic=True)
  ours_of = trained.tokenizer.our_ids
  hf_of = trained.tokenizer.hf_ids

  prompts = [tokenizer(text)["input_ids"] for text in lines(os.path.join(args.data, "val.en"),
                                                             args.prompts)]
  longest = max(map(len, prompts))
  padded = np.zeros((len(prompts), longest), np.int32)
  for i, row in enumerate(prompts):
    padded[i, :len(row)] = ours_of[row]
  steps, eos = args.new_tokens, tokenizer.eos_token_id
  print(f"LlamaForCausalLM d_model {args.d_model}, {args.layers} layers, {args.heads} heads "
        f"({args.kv_heads} key/value), d_ff {args.d_ff}, vocabulary {len(tokenizer)}; "
        f"{len(prompts)} prompts of {min(map(len, prompts))}-{longest} tokens, {steps} new "
        f"tokens; batch {args.batch} (and 1 for the first {args.single}); "
        f"jax {jax.__version__} on {jax.devices()[0].platform}, ctranslate2 "
        f"{ctranslate2.__version__} with {args.threads} threads; load average "
        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")

  def ours(search, batch, count):
    def run():
      out = []
      for start in range(0, count, batch):
        rows = jnp.asarray(padded[start:start + batch])
        if search == "greedy":
          result = decode.greedy_decode(trained.params, model, rows, steps)
        else:
          result = decode.beam_search(trained.params, model, rows, steps, beam_size=4,
                                      alpha=0.0)[0]
        out += [cut(hf_of[r], eos) for r in np.asarray(result)]
      return out
    return run

  generators = {kind: ctranslate2.Generator(os.path.join(root, "ct2"), device="cpu",
                                            compute_type=kind, intra_threads=args.threads)
                for kind in ("float32", "int8")}

  def theirs(kind, search, batch, count):
    pieces = [tokenizer.convert_ids_to_tokens(row) for row in prompts[:count]]

    def run():
      out = []
      for start in range(0, count, batch):
        results = generators[kind].generate_batch(
            pieces[start:start + batch], max_length=steps, beam_size=1 if search == "greedy"
            else 4, length_penalty=0.0, sampling_topk=1, include_prompt_in_result=False,
            suppress_sequences=[[tokenizer.bos_token]])
        out += [cut(r.sequences_ids[0], eos) for r in results]
      return out
    return run

  for search in ("greedy", "beam4"):
    for batch, count in ((args.batch, len(prompts)), (1, args.single)):
      reference = None
      for name, fn in (("ours (JAX, float32)", ours(search, batch, count)),
                       ("CTranslate2 float32", theirs("float32", search, batch, count)),
                       ("CTranslate2 int8", theirs("int8", search, batch, count))):
        seconds, out = timed(fn, args.repeats)
        reference = out if reference is None else reference
        same = sum(a == b for a, b in zip(out, reference))
        tokens = sum(len(r) for r in out)
        print(f"| {search} | {batch} | {name} | {seconds * 1000:.0f} ms | "
              f"{tokens / seconds:,.0f} | {same} of {count} |", flush=True)


if __name__ == "__main__":
  main()
