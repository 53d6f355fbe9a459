"""Llama both ways (tools/hf), judged by `transformers` itself: LlamaForCausalLM built at random
initialisation (a tiny config with grouped-query attention, a rope_theta of its own, an untied
head; nothing downloaded), saved next to a Llama tokenizer that transformers converts from a
SentencePiece model this test trains, imported, and compared: logits on random token batches with
padding (float32, max |diff| <= 1e-4), greedy continuations of 32 tokens, the same after export ->
from_pretrained, and CTranslate2's greedy decoding of the export.
"""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.core.errors import UserError
from transformer_jax.core.tokens import BOS_ID, EOS_ID
from transformer_jax.data import tokenizer as tokenizer_lib
from transformer_jax.eval import decode
from transformer_jax.eval.generate import encode_prompts
from transformer_jax.model import ModelConfig, describe, param_shapes
from transformer_jax.tools import hf

from .common import (
  MULTI30K,
  TEXTS,
  TOLERANCE,
  assert_logits_match,
  bert_dir,
  ct2_greedy_equals_ours,
  llama_tokenizer,
  multi30k,
  our_logits,
  our_workdir,
  random_batch,
  randomize,
  their_logits,
  torch,
  trained_from,
  transformers,
)


def llama_dir(directory, tie=False, seed=0):
  directory.mkdir(parents=True, exist_ok=True)
  tokenizer = llama_tokenizer(TEXTS, directory, 300)
  config = transformers.LlamaConfig(
      vocab_size=len(tokenizer), hidden_size=32, intermediate_size=48, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
      rope_theta=500.0, rms_norm_eps=1e-5, tie_word_embeddings=tie, bos_token_id=1,
      eos_token_id=2)
  torch.manual_seed(seed)
  model = randomize(transformers.LlamaForCausalLM(config), seed=seed, scale=0.3)
  model.save_pretrained(directory)
  tokenizer.save_pretrained(directory)
  return str(directory)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
  """(their directory, our imported workdir, our export of it) of the untied test model."""
  root = tmp_path_factory.mktemp("llama")
  hf_dir = llama_dir(root / "hf")
  hf.import_hf(hf_dir, str(root / "w"))
  hf.export_hf(str(root / "w"), str(root / "exported"))
  return hf_dir, root / "w", root / "exported"


def our_greedy(trained, prompts, mask, steps=32):
  ours = decode.greedy_decode(
      trained.params, trained.model_config.replace(deterministic=True),
      jnp.asarray(np.where(mask, trained.tokenizer.our_ids[prompts], 0), jnp.int32), steps)
  return np.asarray(ours)


def test_llama_import_matches_transformers_logits_and_greedy(llama):
  hf_dir, workdir, _ = llama
  trained = trained_from(workdir)
  model = trained.model_config
  assert (model.arch, model.norm_type, model.positional, model.activation) == (
      "decoder_only", "rmsnorm", "rotary", "swiglu")
  assert (model.num_kv_heads, model.position_base, model.tie_output, model.use_bias,
          model.qkv_bias) == (2, 500.0, False, False, False)
  reference = transformers.LlamaForCausalLM.from_pretrained(hf_dir).eval()
  vocab = reference.config.vocab_size
  assert_logits_match(trained, reference, *random_batch(vocab))

  # generate's prompts are their tokenizer's ids (<s> first); an empty one is <s> alone.
  prompts, _ = encode_prompts(trained.tokenizer, [TEXTS[0], ""], 24, 2)
  theirs = transformers.AutoTokenizer.from_pretrained(hf_dir)(TEXTS[0])["input_ids"]
  assert theirs[0] == 1 and len(theirs) > 3
  assert prompts.tolist() == [trained.tokenizer.our_ids[theirs].tolist() + [0] * (24 - len(
      theirs)), [BOS_ID] + [0] * 23]

  # Greedy continuations of 32 tokens of prompts that start with <s>, as Llama reads them (ours
  # in one right-padded batch with the KV cache; theirs one by one). Our decoding never emits
  # BOS (decode.py): theirs is told the same (suppress_tokens, -inf without renormalising).
  prompts, prompt_mask = random_batch(vocab, seed=1, lengths=(6, 3, 1), low=3)
  prompts[:, 0] = reference.config.bos_token_id
  ours = our_greedy(trained, prompts, prompt_mask)
  compared = 0
  for row, length in enumerate(prompt_mask.sum(1)):
    generated = reference.generate(torch.tensor(prompts[row:row + 1, :length]),
                                   attention_mask=torch.ones(1, length, dtype=torch.long),
                                   max_new_tokens=32, do_sample=False,
                                   suppress_tokens=[reference.config.bos_token_id],
                                   pad_token_id=reference.config.eos_token_id)
    theirs = generated[0, length:].numpy()
    np.testing.assert_array_equal(trained.tokenizer.hf_ids[ours[row][:len(theirs)]], theirs)
    compared += len(theirs)
  assert compared >= 40  # continuations, not an EOS at once


def test_llama_export_loads_in_transformers_and_round_trips(llama):
  hf_dir, workdir, out = llama
  exported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  original = transformers.LlamaForCausalLM.from_pretrained(hf_dir).eval()
  assert type(exported).__name__ == "LlamaForCausalLM"
  config = json.loads((out / "config.json").read_text())
  assert (config["model_type"], config["num_key_value_heads"], config["tie_word_embeddings"],
          config["bos_token_id"], config["eos_token_id"]) == ("llama", 2, False, 1, 2)
  ids, mask = random_batch(original.config.vocab_size, seed=2)
  expected = their_logits(original, ids, mask)
  assert np.abs(their_logits(exported, ids, mask) - expected)[mask].max() <= TOLERANCE
  theirs = dict(original.state_dict())
  assert set(exported.state_dict()) == set(theirs)
  for name, tensor in exported.state_dict().items():
    np.testing.assert_array_equal(tensor.numpy(), theirs[name].numpy(), err_msg=name)
  tokenizer = transformers.AutoTokenizer.from_pretrained(out)
  assert tokenizer(TEXTS[2])["input_ids"] == transformers.AutoTokenizer.from_pretrained(
      hf_dir)(TEXTS[2])["input_ids"]
  assert tokenizer(TEXTS[2])["input_ids"][0] == 1  # <s> first


def test_a_tied_llama_imports_and_exports(tmp_path):
  """tie_word_embeddings=true: no lm_head of its own, our tied output projection."""
  hf_dir = llama_dir(tmp_path / "hf", tie=True, seed=1)
  hf.import_hf(hf_dir, str(tmp_path / "w"))
  trained = trained_from(tmp_path / "w")
  assert trained.model_config.tie_output and "logits" not in trained.params["decoder"]
  original = transformers.LlamaForCausalLM.from_pretrained(hf_dir).eval()
  ids, mask = random_batch(original.config.vocab_size, seed=4)
  expected = their_logits(original, ids, mask)
  assert np.abs(our_logits(trained, ids, mask) - expected)[mask].max() <= TOLERANCE
  hf.export_hf(str(tmp_path / "w"), str(tmp_path / "out"))
  exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
  assert exported.config.tie_word_embeddings
  assert np.abs(their_logits(exported, ids, mask) - expected)[mask].max() <= TOLERANCE


def test_an_exported_llama_converts_with_ctranslate2_and_decodes_as_ours(llama, tmp_path):
  """CTranslate2's own converter reads the Llama export; its float32 greedy continuations are
  ours."""
  ctranslate2 = pytest.importorskip("ctranslate2")
  from ctranslate2.converters import TransformersConverter
  _, workdir, out = llama
  trained = trained_from(workdir)
  TransformersConverter(str(out)).convert(str(tmp_path / "ct2"))
  generator = ctranslate2.Generator(str(tmp_path / "ct2"), device="cpu", compute_type="float32")
  tokenizer = transformers.AutoTokenizer.from_pretrained(out)
  # Prompts shaped as the import test's: its compiled greedy decoding serves again.
  prompts, mask = random_batch(len(tokenizer), seed=3, lengths=(6, 3, 1), low=3)
  prompts[:, 0] = tokenizer.bos_token_id
  ours = our_greedy(trained, prompts, mask)
  compared = ct2_greedy_equals_ours(generator, tokenizer, prompts, mask, ours,
                                    trained.tokenizer.hf_ids,
                                    suppress_sequences=[[tokenizer.bos_token]])
  assert compared >= 32


def test_a_model_trained_here_with_llama_options_exports_as_llama(tmp_path):
  """A workdir of our own (a SentencePiece vocabulary; num_kv_heads 0, i.e. as many as the
  heads; a tied output) exports as LlamaForCausalLM with our ids, and transformers' logits are
  ours."""
  from transformer_jax import config as config_lib
  from transformer_jax.model import make_model
  tokenizer = tokenizer_lib.train(TEXTS, 40, "word")
  config = config_lib.default_config()
  config.model.update(dict(
      vocab_size=tokenizer.vocab_size, arch="decoder_only", d_model=32, num_heads=4, d_ff=48,
      num_encoder_layers=0, num_decoder_layers=2, norm="pre", norm_type="rmsnorm",
      positional="rotary", position_base=1000.0, activation="swiglu", embed_scale=False,
      qkv_bias=False, use_bias=False, layer_norm_eps=1e-5, max_len=64, init="normal"))
  config.data.task = "lm"
  model_config, state = our_workdir(config, tokenizer, tmp_path / "w")
  hf.export_hf(str(tmp_path / "w"), str(tmp_path / "out"))
  exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
  assert type(exported).__name__ == "LlamaForCausalLM"
  assert exported.config.num_key_value_heads == 4 and exported.config.tie_word_embeddings
  assert (exported.config.pad_token_id, exported.config.bos_token_id,
          exported.config.eos_token_id) == (0, BOS_ID, EOS_ID)
  ids, mask = random_batch(tokenizer.vocab_size, low=1)
  model = make_model(model_config.replace(deterministic=True))
  ours = np.asarray(model.apply({"params": state.params}, jnp.zeros((3, 0), jnp.int32),
                                jnp.asarray(ids, jnp.int32)))
  assert np.abs(ours - their_logits(exported, ids, mask))[mask].max() <= TOLERANCE


# ----------------------------------------------------------------------------- the options


def test_use_bias_false_removes_every_bias_and_describe_says_so():
  config = ModelConfig(vocab_size=50, arch="decoder_only", d_model=16, num_heads=4, d_ff=32,
                       num_encoder_layers=0, num_decoder_layers=1, tie_output=False, norm="pre",
                       qkv_bias=False, use_bias=False).validate()
  paths = ["/".join(p.key for p in path) for path, _ in
           jax.tree_util.tree_leaves_with_path(param_shapes(config))]
  assert paths and not [p for p in paths if p.endswith("bias")], paths
  with_bias = ["/".join(p.key for p in path) for path, _ in
               jax.tree_util.tree_leaves_with_path(param_shapes(config.replace(use_bias=True)))]
  # use_bias alone: the output projection, the FFN, both norms' and the untied head's biases.
  assert sorted(p for p in with_bias if p.endswith("bias")) == sorted([
      "decoder/final_norm/bias", "decoder/layer_0/ffn/wi/bias", "decoder/layer_0/ffn/wo/bias",
      "decoder/layer_0/ffn_block/norm/bias", "decoder/layer_0/self_attention/out/bias",
      "decoder/layer_0/self_attention_block/norm/bias", "decoder/logits/bias"])
  assert "no biases, untied output layer" in describe(config)
  with pytest.raises(UserError, match="model.use_bias must be True or False"):
    config.replace(use_bias="no").validate()


def test_export_picks_llama_or_gpt2_by_the_options_and_refuses_others(llama, tmp_path):
  """One rule: the architecture whose fixed options all match. A Llama with LayerNorm matches
  neither: refused in one line naming what each needs."""
  _, workdir, _ = llama
  shutil.copytree(workdir, tmp_path / "w")
  config = json.loads((tmp_path / "w" / "config.json").read_text())
  config["model"]["norm_type"] = "layernorm"
  (tmp_path / "w" / "config.json").write_text(json.dumps(config))
  with pytest.raises(UserError) as error:
    hf.export_hf(str(tmp_path / "w"), str(tmp_path / "out"))
  message = str(error.value)
  assert "\n" not in message
  assert "GPT2LMHeadModel needs model.positional=learned" in message
  assert "LlamaForCausalLM needs model.norm_type=rmsnorm" in message
  assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("change, match", [
    (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}),
     "rotary scaling 'llama3'"),
    (dict(mlp_bias=True), "mlp_bias=True"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
])
def test_llama_configs_we_cannot_map_are_refused(llama, change, match, tmp_path):
  hf_dir, _, _ = llama
  other = tmp_path / "hf"
  shutil.copytree(hf_dir, other)
  config = json.loads((other / "config.json").read_text())
  config.update(change)
  (other / "config.json").write_text(json.dumps(config))
  with pytest.raises(UserError, match=match):
    hf.import_hf(str(other), str(tmp_path / "w"))
  assert not (tmp_path / "w").exists()


# ----------------------------------------------------------------------------- the tokenizer


@pytest.mark.skipif(not os.path.isdir(MULTI30K),
                    reason="../shared/data/multi30k not present")
def test_imported_llama_tokenizer_reads_text_as_transformers_does(tmp_path):
  """1,000 English and 1,000 German Multi30k sentences: our ids after BOS (as our pipeline and
  prompts read a text, and Llama's tokenizer gives it), mapped back to theirs, are
  LlamaTokenizer's; decoding gives their text back."""
  train = multi30k("train", "en", 3000) + multi30k("train", "de", 3000)
  sentences = multi30k("val", "en", 1000) + multi30k("val", "de", 1000)
  tokenizer = llama_tokenizer(train, tmp_path, 2000)
  model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
      vocab_size=len(tokenizer), hidden_size=8, intermediate_size=16, num_hidden_layers=1,
      num_attention_heads=2, max_position_embeddings=16))
  model.save_pretrained(tmp_path / "hf")
  tokenizer.save_pretrained(tmp_path / "hf")
  hf.import_hf(str(tmp_path / "hf"), str(tmp_path / "w"))
  ours = tokenizer_lib.load_workdir(str(tmp_path / "w"), "")
  assert ours.prompt_bos
  expected = tokenizer(sentences)["input_ids"]
  assert all(row[0] == 1 for row in expected)
  # Our texts come without BOS, which the pipeline and decoding put before them.
  assert [ours.hf_ids[[BOS_ID] + row].tolist() for row in ours.encode(sentences)] == expected
  assert sum(map(len, expected)) > 10 * len(sentences)
  decoded = [ours.decode(row + [EOS_ID]) for row in ours.encode(sentences[:50])]
  assert decoded == tokenizer.batch_decode(expected[:50], skip_special_tokens=True)
  assert ours.hf_ids[BOS_ID] == 1 and ours.hf_ids[EOS_ID] == 2


# ----------------------------------------------------------------------------- BERT's segment B


@pytest.mark.parametrize("head", ["BertForMaskedLM", "BertForSequenceClassification"])
def test_bert_rows_of_two_segments_read_as_transformers_does(head, tmp_path_factory):
  """Token types other than 0: "[CLS] A [SEP] B [SEP]" with B's tokens of type 1 (and padding),
  our EncoderOnly given the same token_types, equals transformers given token_type_ids."""

  from transformer_jax.model import make_model
  hf_dir = bert_dir(tmp_path_factory, getattr(transformers, head), f"bert_types_{head}")
  reference = getattr(transformers, head).from_pretrained(hf_dir).eval()
  with torch.no_grad():  # type rows far apart, so that a type read wrongly shows
    reference.bert.embeddings.token_type_embeddings.weight.mul_(5.0)
  reference.save_pretrained(hf_dir)
  workdir = tmp_path_factory.mktemp("bert_types_w") / "w"
  hf.import_hf(hf_dir, str(workdir))
  trained = trained_from(workdir)
  ids, mask = random_batch(reference.config.vocab_size, seed=5, lengths=(12, 9, 6), low=5)
  ids[:, 0] = 2  # [CLS]
  types = np.zeros_like(ids)
  for row, (middle, length) in enumerate(((5, 12), (4, 9), (3, 6))):
    ids[row, middle] = ids[row, length - 1] = 3  # [SEP] after each segment
    types[row, middle + 1:length] = 1
  with torch.no_grad():
    expected = reference(input_ids=torch.tensor(ids), token_type_ids=torch.tensor(types),
                         attention_mask=torch.tensor(mask.astype(np.int64))).logits.numpy()
  one_segment = their_logits(reference, ids, mask)
  tokenizer = trained.tokenizer
  tokens = jnp.asarray(np.where(mask, tokenizer.our_ids[ids], 0), jnp.int32)
  model = make_model(trained.model_config.replace(deterministic=True))
  ours = np.asarray(model.apply({"params": trained.params}, tokens,
                                token_types=jnp.asarray(types, jnp.int32)))
  if head == "BertForMaskedLM":
    ours, valid = ours[..., tokenizer.our_ids], mask
  else:
    ours, valid = ours[:, 0], np.ones(len(ids), bool)
  assert np.abs(ours - expected)[valid].max() <= TOLERANCE
  # Type 1 changes their output by far more than the tolerance: ours without it would fail.
  assert np.abs(one_segment - expected)[valid].max() > 20 * TOLERANCE


# ----------------------------------------------------------------------------- Llama's head_dim


def test_a_llama_whose_head_dim_is_not_hidden_over_heads_imports_and_exports(llama, tmp_path):
  """head_dim 16 of 4 heads in a 32-wide model (queries 64 wide; Gemma-like): model.head_size
  16; logits equal theirs; the export writes head_dim 16 back and loads in transformers."""
  hf_dir, workdir, _ = llama
  assert trained_from(workdir).model_config.head_size == 0  # their head_dim 8 is 32 / 4
  tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
  config = transformers.LlamaConfig(
      vocab_size=len(tokenizer), hidden_size=32, intermediate_size=48, num_hidden_layers=1,
      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
      rope_theta=500.0, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
  torch.manual_seed(3)
  reference = randomize(transformers.LlamaForCausalLM(config), seed=3, scale=0.3).eval()
  assert reference.model.layers[0].self_attn.q_proj.weight.shape == (64, 32)
  reference.save_pretrained(tmp_path / "hf")
  tokenizer.save_pretrained(tmp_path / "hf")
  hf.import_hf(str(tmp_path / "hf"), str(tmp_path / "w"))
  trained = trained_from(tmp_path / "w")
  assert (trained.model_config.head_size, trained.model_config.head_dim) == (16, 16)
  ids, mask = random_batch(config.vocab_size, seed=6)
  expected = their_logits(reference, ids, mask)
  assert np.abs(our_logits(trained, ids, mask) - expected)[mask].max() <= TOLERANCE
  assert np.abs(expected).max() > 1.0
  hf.export_hf(str(tmp_path / "w"), str(tmp_path / "out"))
  assert json.loads((tmp_path / "out" / "config.json").read_text())["head_dim"] == 16
  exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
  assert np.abs(their_logits(exported, ids, mask) - expected)[mask].max() <= TOLERANCE
