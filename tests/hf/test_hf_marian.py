"""Marian (MarianMTModel) in and out of tools/hf, judged by `transformers` itself.

A tiny MarianMTModel is built with transformers at random initialisation (nothing downloaded),
saved with save_pretrained next to a MarianTokenizer whose SentencePiece models this test trains
(one for the source side, another for the target side, one vocab.json), imported, and compared:
logits on padded batches (float32, max |diff| <= 1e-4), 32 greedy tokens, and the same after
export -> from_pretrained; the tokenizer against MarianTokenizer on Multi30k.
"""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax import config as config_lib
from transformer_jax.core.errors import UserError
from transformer_jax.core.tokens import BOS_ID, EOS_ID
from transformer_jax.data import tokenizer as tokenizer_lib
from transformer_jax.eval import decode
from transformer_jax.model import make_model
from transformer_jax.model.positions import sinusoidal_positions
from transformer_jax.tools import hf
from transformer_jax.tools.hf.convert import sinusoid_halves_order

from .common import (
  MULTI30K,
  ROOT,
  TEXTS,
  TOLERANCE,
  marian_config,
  marian_tokenizer,
  multi30k,
  randomize,
  seq2seq_greedy_pairs,
  torch,
  trained_from,
  transformers,
)


@pytest.fixture(scope="module")
def marian_dir(tmp_path_factory):
  directory = tmp_path_factory.mktemp("marian")
  english, german = TEXTS[0::2], TEXTS[1::2]
  tokenizer = marian_tokenizer(directory, english + german[:1], german, 60)
  config = marian_config(len(tokenizer.encoder))
  torch.manual_seed(0)
  model = randomize(transformers.MarianMTModel(config), scale=0.3)
  with torch.no_grad():  # a buffer, not a parameter: randomize leaves it at zero
    bias = torch.randn(model.final_logits_bias.shape, generator=torch.Generator().manual_seed(1))
    bias[0, config.pad_token_id] = -30.0  # Marian never generates <pad> (bad_words_ids)
    bias[0, config.eos_token_id] = -3.0  # continuations of 32 tokens, not an EOS at once
    model.final_logits_bias.copy_(bias)
    model.model.shared.weight[config.pad_token_id] = 0.0  # as Marian's <pad> row is
  model.save_pretrained(directory)
  tokenizer.save_pretrained(directory)
  return str(directory)


@pytest.fixture(scope="module")
def marian_workdir(marian_dir, tmp_path_factory):
  workdir = tmp_path_factory.mktemp("marian_workdir") / "w"
  hf.import_hf(marian_dir, str(workdir))
  return workdir


def padded_batch(vocab_size, seed, lengths, high):
  rng = np.random.default_rng(seed)
  ids = rng.integers(0, high, (len(lengths), max(lengths)))
  mask = np.arange(max(lengths))[None] < np.asarray(lengths)[:, None]
  return ids, mask


def their_logits(model, source, source_mask, target, target_mask):
  pad = model.config.pad_token_id
  with torch.no_grad():
    out = model(input_ids=torch.tensor(np.where(source_mask, source, pad)),
                attention_mask=torch.tensor(source_mask.astype(np.int64)),
                decoder_input_ids=torch.tensor(np.where(target_mask, target, pad)),
                decoder_attention_mask=torch.tensor(target_mask.astype(np.int64)))
  return out.logits.numpy()


def our_logits(trained, source, source_mask, target, target_mask):
  """Our logits of the same batch in their vocabulary's order."""
  our_ids = trained.tokenizer.our_ids
  model = make_model(trained.model_config.replace(deterministic=True))
  logits = model.apply({"params": trained.params},
                       jnp.asarray(np.where(source_mask, our_ids[source], 0), jnp.int32),
                       jnp.asarray(np.where(target_mask, our_ids[target], 0), jnp.int32))
  return np.asarray(logits)[..., our_ids]


def batches(config):
  """Sources (without <pad>) and decoder inputs that start with the decoder start token."""
  source, source_mask = padded_batch(config.vocab_size, 0, (11, 6, 2), config.vocab_size - 1)
  target, target_mask = padded_batch(config.vocab_size, 1, (9, 4, 7), config.vocab_size - 1)
  target[:, 0] = config.decoder_start_token_id
  return source, source_mask, target, target_mask


def greedy_pairs(trained, reference, source, source_mask, length=32):
  """(ours, theirs) greedy continuations of each source in their ids, up to their first EOS."""
  ours = np.asarray(decode.greedy_decode(
      trained.params, trained.model_config.replace(deterministic=True),
      jnp.asarray(np.where(source_mask, trained.tokenizer.our_ids[source], 0), jnp.int32),
      length))
  return seq2seq_greedy_pairs(ours, trained.tokenizer.hf_ids, reference, source, source_mask,
                              length, forced_eos_token_id=None)


# ----------------------------------------------------------------------------- the model


def test_marian_sinusoids_are_ours_with_the_features_permuted():
  """Their table (sines in the first half of the features, cosines in the second, positions
  from 0) is our interleaved one with its features taken in sinusoid_halves_order."""
  from transformers.models.marian.modeling_marian import MarianSinusoidalPositionalEmbedding
  theirs = MarianSinusoidalPositionalEmbedding(50, 16).create_weight().numpy()
  ours = sinusoidal_positions(50, 16)
  np.testing.assert_allclose(ours[:, sinusoid_halves_order(16)], theirs, atol=1e-6)
  assert not np.allclose(ours, theirs, atol=1e-2)  # the layouts do differ


def test_marian_import_matches_transformers_logits_and_greedy(marian_dir, marian_workdir):
  trained = trained_from(marian_workdir)
  cfg = trained.model_config
  assert (cfg.arch, cfg.norm, cfg.activation, cfg.embed_scale, cfg.logits_bias) == (
      "encoder_decoder", "post", "silu", True, True)
  assert (cfg.num_encoder_layers, cfg.num_decoder_layers) == (2, 3)
  reference = transformers.MarianMTModel.from_pretrained(marian_dir).eval()
  source, source_mask, target, target_mask = batches(reference.config)
  expected = their_logits(reference, source, source_mask, target, target_mask)
  ours = our_logits(trained, source, source_mask, target, target_mask)
  assert np.abs(ours - expected)[target_mask].max() <= TOLERANCE
  assert np.abs(expected).max() > 1.0  # the comparison has something to compare

  source, source_mask = padded_batch(cfg.vocab_size, 2, (9, 5, 1),
                                     reference.config.vocab_size - 1)
  compared = 0
  for mine, theirs in greedy_pairs(trained, reference, source, source_mask):
    np.testing.assert_array_equal(mine, theirs)
    compared += len(theirs)
  assert compared >= 64  # continuations, not an EOS at once


def test_marian_export_loads_in_transformers_and_round_trips(marian_dir, marian_workdir,
                                                              tmp_path):
  trained = trained_from(marian_workdir)
  hf.export_hf(str(marian_workdir), str(tmp_path / "out"))
  exported = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "out").eval()
  original = transformers.MarianMTModel.from_pretrained(marian_dir).eval()
  assert type(exported).__name__ == "MarianMTModel"
  theirs = dict(original.state_dict())
  for name, tensor in exported.state_dict().items():
    np.testing.assert_array_equal(tensor.numpy(), theirs[name].numpy(), err_msg=name)
  batch = batches(original.config)
  expected = their_logits(original, *batch)
  assert np.abs(their_logits(exported, *batch) - expected)[batch[3]].max() <= TOLERANCE
  assert np.abs(our_logits(trained, *batch) - expected)[batch[3]].max() <= TOLERANCE
  assert exported.config.decoder_start_token_id == original.config.decoder_start_token_id
  tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
  reference = transformers.AutoTokenizer.from_pretrained(marian_dir)
  assert type(tokenizer).__name__ == "MarianTokenizer"
  assert tokenizer(TEXTS[:4])["input_ids"] == reference(TEXTS[:4])["input_ids"]


def test_marian_fields_we_cannot_map_are_refused(marian_dir, tmp_path):
  """Different encoder and decoder widths, an unknown activation: one line naming the field,
  nothing written."""
  import shutil
  for change, field in ((dict(decoder_ffn_dim=32), "decoder_ffn_dim"),
                        (dict(activation_function="tanh"), "activation_function")):
    other = tmp_path / field
    shutil.copytree(marian_dir, other)
    config = json.loads((other / "config.json").read_text())
    config.update(change)
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match=field):
      hf.import_hf(str(other), str(tmp_path / f"w_{field}"))
    assert not (tmp_path / f"w_{field}").exists()


def test_an_exported_marian_converts_with_ctranslate2_and_decodes_as_ours(marian_workdir,
                                                                         tmp_path):
  """CTranslate2's own converter reads the export of the imported Marian (their vocabulary,
  <pad> last, two SentencePiece models); its greedy outputs of 32 tokens are ours."""
  ctranslate2 = pytest.importorskip("ctranslate2")
  from ctranslate2.converters import TransformersConverter
  trained = trained_from(marian_workdir)
  hf.export_hf(str(marian_workdir), str(tmp_path / "hf"))
  TransformersConverter(str(tmp_path / "hf")).convert(str(tmp_path / "ct2"))
  translator = ctranslate2.Translator(str(tmp_path / "ct2"), device="cpu")
  tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
  vocab = tokenizer.vocab_size
  # Sources shaped as the import test's: its compiled greedy decoding serves again.
  source, source_mask = padded_batch(vocab, 3, (9, 4, 2), vocab - 1)
  source[np.arange(3), source_mask.sum(1) - 1] = tokenizer.eos_token_id  # as a source ends
  ours = np.asarray(decode.greedy_decode(
      trained.params, trained.model_config.replace(deterministic=True),
      jnp.asarray(np.where(source_mask, trained.tokenizer.our_ids[source], 0), jnp.int32), 32))
  compared = 0
  for row, n in enumerate(source_mask.sum(1)):
    tokens = tokenizer.convert_ids_to_tokens(source[row, :n].tolist())
    result = translator.translate_batch([tokens], beam_size=1, max_decoding_length=32)[0]
    theirs = tokenizer.convert_tokens_to_ids(result.hypotheses[0])
    mine = trained.tokenizer.hf_ids[ours[row]].tolist()
    eos = tokenizer.eos_token_id
    mine = mine[:mine.index(eos)] if eos in mine else mine  # CTranslate2 drops EOS
    assert mine == theirs
    compared += len(mine)
  assert compared >= 32


# ----------------------------------------------------------------------------- the tokenizer


@pytest.mark.skipif(not os.path.isdir(MULTI30K), reason="../shared/data/multi30k not present")
def test_imported_marian_tokenizer_reads_text_as_transformers_does(tmp_path):
  """1,000 English (source side) and 1,000 German (target side) Multi30k sentences: our ids,
  mapped back to theirs, are MarianTokenizer's (source.spm for sources, target.spm for targets,
  EOS appended, as our pipeline appends it), and decoding gives their text back."""
  english, german = multi30k("val", "en", 1000), multi30k("val", "de", 1000)
  directory = tmp_path / "hf"
  theirs = marian_tokenizer(directory, multi30k("train", "en", 3000),
                            multi30k("train", "de", 3000), 1000)
  transformers.MarianMTModel(marian_config(len(theirs.encoder), d_model=8, encoder_layers=1,
                                           decoder_layers=1, encoder_attention_heads=2,
                                           decoder_attention_heads=2, encoder_ffn_dim=16,
                                           decoder_ffn_dim=16)).save_pretrained(directory)
  theirs.save_pretrained(directory)
  hf.import_hf(str(directory), str(tmp_path / "w"))
  ours = tokenizer_lib.load_workdir(str(tmp_path / "w"), "")
  theirs = transformers.AutoTokenizer.from_pretrained(directory)
  for texts, target in ((english, False), (german, True)):
    expected = (theirs(text_target=texts) if target else theirs(texts))["input_ids"]
    encoded = [row + [EOS_ID] for row in ours.encode(texts, target=target)]
    assert [ours.hf_ids[row].tolist() for row in encoded] == expected
    assert sum(map(len, expected)) > 4 * len(texts)  # words split into several pieces
    decoded = [ours.decode(row) for row in encoded[:100]]
    assert decoded == theirs.batch_decode(expected[:100], skip_special_tokens=True)
  # Our BOS is their decoder start token, <pad>; our padding a row of our own.
  assert ours.hf_ids[BOS_ID] == theirs.pad_token_id
  assert not ours.prompt_bos


# ----------------------------------------------------------------------------- SCAN, CTranslate2


def test_a_scan_model_exported_as_marian_decodes_alike_in_transformers_and_ctranslate2(
    tiny_run, tmp_path):
  """The session's tiny SCAN run, with Marian's LayerNorm epsilon and zero start embedding,
  exported: transformers' greedy generate and CTranslate2 (its own converter) give our greedy
  output on a sample of 32 SCAN test commands, token for token (benchmarks/marian_scan.py runs
  every command of the trained demo model)."""
  pytest.importorskip("ctranslate2")
  import importlib.util
  import shutil
  spec = importlib.util.spec_from_file_location(
      "marian_scan", os.path.join(ROOT, "benchmarks",
                                  "marian_scan.py"))
  marian_scan = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(marian_scan)
  from transformer_jax.train import checkpoint
  from transformer_jax.train import state as state_lib
  # As trained (our LayerNorm epsilon 1e-6), Marian cannot express it: refused by name.
  with pytest.raises(UserError, match=r"MarianMTModel needs model.layer_norm_eps=1e-05"):
    hf.export_hf(str(tiny_run), str(tmp_path / "refused"))
  assert not (tmp_path / "refused").exists()
  trained = trained_from(tiny_run)  # its parameters, in a run of the options Marian has
  config = config_lib.from_workdir(str(tiny_run))
  config.model.update(layer_norm_eps=1e-5, zero_bos_embedding=True)
  workdir = tmp_path / "w"
  workdir.mkdir()
  shutil.copy(tiny_run / tokenizer_lib.FILENAME, workdir)
  (workdir / "config.json").write_text(config.to_json_best_effort())
  optimizer = state_lib.make_optimizer(config.train, config.model.d_model)
  state = state_lib.TrainState(step=jnp.array(20, jnp.int32), params=trained.params,
                               opt_state=optimizer.init(trained.params))
  manager = checkpoint.Manager(str(workdir), config,
                               checkpoint.sha256(trained.tokenizer.model_proto), writable=True)
  manager.save(20, state)
  manager.wait()
  manager.close()
  result = marian_scan.compare(str(workdir), str(tmp_path / "out"), count=32, timing=False)
  assert result["commands"] == 32 and result["ours_greedy"]["tokens"] >= 32
  assert result["transformers_greedy"]["equal_to_ours"] == 32
  assert result["ctranslate2_greedy"]["equal_to_ours"] == 32
