"""Hugging Face interop (tools/hf), judged by `transformers` itself.

Each architecture is built with transformers at random initialisation (small configs, nothing
downloaded), saved with save_pretrained next to a tokenizer this test trains with the
`tokenizers` library, imported, and compared: logits on random token batches with padding
(float32, max |diff| <= 1e-4), greedy continuations of 32 tokens (GPT-2), and the same after
export -> from_pretrained.
"""

import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax import config as config_lib
from transformer_jax.core.errors import UserError
from transformer_jax.core.tokens import EOS_ID
from transformer_jax.data import tokenizer as tokenizer_lib
from transformer_jax.eval import decode
from transformer_jax.eval.load import load_trained
from transformer_jax.model import make_model
from transformer_jax.tools import hf
from transformer_jax.tools.hf.architectures import vocab_layout

from .common import (
  MULTI30K,
  ROOT,
  TEXTS,
  TOLERANCE,
  assert_logits_match,
  bert_dir,
  byte_level_bpe,
  ct2_greedy_equals_ours,
  multi30k,
  our_logits,
  our_workdir,
  random_batch,
  randomize,
  save,
  their_logits,
  torch,
  trained_from,
  transformers,
  wordpiece,
)


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
  tokenizer = byte_level_bpe(TEXTS)
  eos = tokenizer.token_to_id("<|endoftext|>")
  config = transformers.GPT2Config(vocab_size=tokenizer.get_vocab_size(), n_positions=64,
                                   n_embd=32, n_layer=2, n_head=4, bos_token_id=eos,
                                   eos_token_id=eos)
  torch.manual_seed(0)
  model = randomize(transformers.GPT2LMHeadModel(config))
  return save(model, tokenizer, tmp_path_factory.mktemp("gpt2"), bos_token="<|endoftext|>",
              eos_token="<|endoftext|>")


@pytest.fixture(scope="module")
def bert_mlm_dir(tmp_path_factory):
  return bert_dir(tmp_path_factory, transformers.BertForMaskedLM, "bert_mlm")


@pytest.fixture(scope="module")
def bert_classifier_dir(tmp_path_factory):
  return bert_dir(tmp_path_factory, transformers.BertForSequenceClassification, "bert_cls")


@pytest.fixture(scope="module")
def gpt2_workdir(gpt2_dir, tmp_path_factory):
  """The test GPT-2 imported once (the tests that only read it share it)."""
  workdir = tmp_path_factory.mktemp("gpt2_workdir") / "w"
  hf.import_hf(gpt2_dir, str(workdir))
  return workdir


@pytest.fixture(scope="module")
def gpt2_export(gpt2_workdir, tmp_path_factory):
  out = tmp_path_factory.mktemp("gpt2_export") / "hf"
  hf.export_hf(str(gpt2_workdir), str(out))
  return out


def imported(hf_dir, workdir):
  hf.import_hf(hf_dir, str(workdir))
  config = config_lib.from_workdir(str(workdir))
  return load_trained(config, str(workdir))


# ----------------------------------------------------------------------------- the vocabulary


def test_vocab_layout_moves_specials_to_our_ids_and_back():
  # GPT-2: no padding, bos = eos = the last id. Ours: 0 a new row, 1 a copy of eos, 2 eos.
  vocab = vocab_layout(6, {"bos": 5, "eos": 5}, ("pad", "bos", "eos"))
  assert vocab.hf_ids.tolist() == [-1, 5, 5, 0, 1, 2, 3, 4]
  assert vocab.our_ids.tolist() == [3, 4, 5, 6, 7, 2]
  table = np.arange(6.0)[:, None] + 1
  assert vocab.to_ours(table)[:, 0].tolist() == [0, 6, 6, 1, 2, 3, 4, 5]
  np.testing.assert_array_equal(vocab.to_hf(vocab.to_ours(table)), table)
  # GPT-2 fine-tuned with <|endoftext|> as padding too: it stays our EOS, padding is a copy.
  vocab = vocab_layout(6, {"pad": 5, "bos": 5, "eos": 5}, ("pad", "bos", "eos"))
  assert vocab.hf_ids.tolist()[:3] == [5, 5, 5] and vocab.our_ids[5] == 2
  # BERT: every special exists; a pure permutation.
  vocab = vocab_layout(8, {"pad": 0, "unk": 1, "bos": 2, "eos": 3, "mask": 4},
                       ("pad", "bos", "eos", "unk", "mask"))
  assert vocab.hf_ids.tolist() == [0, 2, 3, 1, 4, 5, 6, 7]
  assert sorted(vocab.hf_ids.tolist()) == list(range(8))
  np.testing.assert_array_equal(vocab.hf_ids[vocab.our_ids], np.arange(8))


# ----------------------------------------------------------------------------- GPT-2


def test_gpt2_import_matches_transformers_logits_and_greedy(gpt2_dir, gpt2_workdir):
  trained = trained_from(gpt2_workdir)
  reference = transformers.GPT2LMHeadModel.from_pretrained(gpt2_dir).eval()
  vocab = reference.config.vocab_size
  assert_logits_match(trained, reference, *random_batch(vocab))

  # Greedy continuations of 32 tokens from prompts of different lengths (ours in one batch).
  prompts, prompt_mask = random_batch(vocab, seed=1, lengths=(6, 3, 1), low=1)
  ours = np.asarray(decode.greedy_decode(
      trained.params, trained.model_config.replace(deterministic=True),
      jnp.asarray(np.where(prompt_mask, trained.tokenizer.our_ids[prompts], 0), jnp.int32), 32))
  eos = reference.config.eos_token_id
  for row, length in enumerate(prompt_mask.sum(1)):
    generated = reference.generate(torch.tensor(prompts[row:row + 1, :length]),
                                   attention_mask=torch.ones(1, length, dtype=torch.long),
                                   max_new_tokens=32, do_sample=False, pad_token_id=eos)
    theirs = generated[0, length:].numpy()
    mine = trained.tokenizer.hf_ids[ours[row][:len(theirs)]]
    np.testing.assert_array_equal(mine, theirs)


def test_gpt2_export_loads_in_transformers_and_round_trips(gpt2_dir, gpt2_workdir, gpt2_export):
  trained = trained_from(gpt2_workdir)
  out = gpt2_export
  exported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  original = transformers.GPT2LMHeadModel.from_pretrained(gpt2_dir).eval()
  assert type(exported).__name__ == "GPT2LMHeadModel"
  ids, mask = random_batch(original.config.vocab_size, seed=2)
  expected = their_logits(original, ids, mask)
  assert np.abs(their_logits(exported, ids, mask) - expected)[mask].max() <= TOLERANCE
  assert np.abs(our_logits(trained, ids, mask) - their_logits(exported, ids, mask))[mask].max() \
      <= TOLERANCE
  theirs = dict(original.state_dict())
  for name, tensor in exported.state_dict().items():
    np.testing.assert_array_equal(tensor.numpy(), theirs[name].numpy(), err_msg=name)
  tokenizer = transformers.AutoTokenizer.from_pretrained(out)
  assert tokenizer(TEXTS[0])["input_ids"] == transformers.AutoTokenizer.from_pretrained(
      gpt2_dir)(TEXTS[0])["input_ids"]


# ----------------------------------------------------------------------------- BERT


@pytest.mark.parametrize("which", ["mlm", "classifier"])
def test_bert_import_and_export_match_transformers(which, bert_mlm_dir, bert_classifier_dir,
                                                   tmp_path):
  hf_dir = {"mlm": bert_mlm_dir, "classifier": bert_classifier_dir}[which]
  trained = imported(hf_dir, tmp_path / "w")
  auto = (transformers.AutoModelForMaskedLM if which == "mlm"
          else transformers.AutoModelForSequenceClassification)
  original = auto.from_pretrained(hf_dir).eval()
  assert trained.model_config.num_labels == (3 if which == "classifier" else 0)
  ids, mask = random_batch(original.config.vocab_size)
  ids[:, 0] = 2  # rows start with [CLS], as BERT reads them (the classifier pools it)
  expected = their_logits(original, ids, mask)
  valid = mask if which == "mlm" else np.ones(len(ids), bool)
  assert np.abs(our_logits(trained, ids, mask) - expected)[valid].max() <= TOLERANCE
  assert np.abs(expected).max() > 0.5

  out = tmp_path / "exported"
  hf.export_hf(str(tmp_path / "w"), str(out))
  exported = auto.from_pretrained(out).eval()
  assert type(exported) is type(original)
  assert np.abs(their_logits(exported, ids, mask) - expected)[valid].max() <= TOLERANCE
  theirs = dict(original.state_dict())
  for name, tensor in exported.state_dict().items():
    np.testing.assert_array_equal(tensor.numpy(), theirs[name].numpy(), err_msg=name)
  config = json.loads((out / "config.json").read_text())
  assert config["model_type"] == "bert" and config["hidden_act"] == "gelu"


def test_export_refuses_a_model_no_architecture_expresses(gpt2_workdir, tmp_path):
  """Our paper-default post-LN decoder-only model has no GPT-2 counterpart: refused by name."""
  shutil.copytree(gpt2_workdir, tmp_path / "w")
  config = json.loads((tmp_path / "w" / "config.json").read_text())
  config["model"]["norm"] = "post"
  (tmp_path / "w" / "config.json").write_text(json.dumps(config))
  with pytest.raises(UserError, match="model.norm=pre"):
    hf.export_hf(str(tmp_path / "w"), str(tmp_path / "out"))
  assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- tokenizers

@pytest.mark.skipif(not os.path.isdir(MULTI30K), reason="../shared/data/multi30k not present")
@pytest.mark.parametrize("kind", ["gpt2", "bert"])
def test_imported_tokenizer_reads_text_as_transformers_does(kind, tmp_path):
  """1,000 English and 1,000 German Multi30k sentences: our ids, mapped back to theirs, are
  AutoTokenizer's (GPT-2: the text alone; BERT: [CLS] text [SEP], our encode + the EOS that our
  pipeline appends), and decoding gives their text back."""
  train = multi30k("train", "en", 3000) + multi30k("train", "de", 3000)
  sentences = multi30k("val", "en", 1000) + multi30k("val", "de", 1000)
  assert len(sentences) == 2000
  if kind == "gpt2":
    tokenizer = byte_level_bpe(train, 2000)
    eos = tokenizer.token_to_id("<|endoftext|>")
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=tokenizer.get_vocab_size(), n_positions=16, n_embd=8, n_layer=1, n_head=2,
        bos_token_id=eos, eos_token_id=eos))
    hf_dir = save(model, tokenizer, tmp_path / "hf", bos_token="<|endoftext|>",
                  eos_token="<|endoftext|>")
  else:
    tokenizer = wordpiece(train, 2000)
    model = transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=tokenizer.get_vocab_size(), hidden_size=8, num_hidden_layers=1,
        num_attention_heads=2, intermediate_size=16, max_position_embeddings=16))
    hf_dir = save(model, tokenizer, tmp_path / "hf", pad_token="[PAD]", unk_token="[UNK]",
                  cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")
  hf.import_hf(hf_dir, str(tmp_path / "w"))
  ours = tokenizer_lib.load_workdir(str(tmp_path / "w"), "")
  theirs = transformers.AutoTokenizer.from_pretrained(hf_dir)
  expected = theirs(sentences)["input_ids"]
  encoded = [row + [EOS_ID] if kind == "bert" else row for row in ours.encode(sentences)]
  assert [ours.hf_ids[row].tolist() for row in encoded] == expected
  assert sum(map(len, expected)) > 10 * len(sentences)  # words split into several tokens
  decoded = [ours.decode(row + [EOS_ID]) for row in ours.encode(sentences[:50])]
  assert decoded == theirs.batch_decode(expected[:50], skip_special_tokens=True)
  assert ours.has_mask() == (kind == "bert")


# ----------------------------------------------------------------------------- the modes


def launch(*flags):
  return subprocess.run([sys.executable, os.path.join(ROOT, "launch.py"), *flags],
                        capture_output=True, text=True, timeout=300, cwd=ROOT,
                        input="a small dog\nzwei Männer spielen\n\n")


def test_generate_on_an_imported_gpt2_continues_text_as_transformers_does(gpt2_dir, tmp_path):
  """launch.py --mode=import_hf, then --mode=generate (greedy, 32 tokens) on the workdir: each
  line's continuation is the text of transformers' greedy generate from its tokenizer's ids (no
  BOS before a prompt; an empty prompt starts at <|endoftext|>)."""
  workdir = str(tmp_path / "w")
  done = launch("--mode=import_hf", f"--hf_dir={gpt2_dir}", f"--workdir={workdir}")
  assert done.returncode == 0, done.stderr
  assert "imported gpt2 (GPT2LMHeadModel)" in done.stdout
  done = launch("--mode=generate", f"--workdir={workdir}", "--config.eval.max_decode_len=32")
  assert done.returncode == 0, done.stderr
  model = transformers.GPT2LMHeadModel.from_pretrained(gpt2_dir).eval()
  tokenizer = transformers.AutoTokenizer.from_pretrained(gpt2_dir)
  expected = []
  for prompt in ("a small dog", "zwei Männer spielen", ""):
    ids = tokenizer(prompt)["input_ids"] or [tokenizer.eos_token_id]
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=int),
                         max_new_tokens=32, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    text = tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)
    expected.append(" ".join(text.splitlines()))
  assert done.stdout.splitlines() == expected


def test_an_imported_gpt2_trains_further_with_its_own_tokenizer(gpt2_workdir, tmp_path):
  """--mode=train on an imported workdir continues from its step-0 checkpoint with the imported
  tokenizer (no SentencePiece model is trained) and the loss falls."""
  workdir, data = tmp_path / "w", tmp_path / "data"
  data.mkdir()
  (data / "train.txt").write_text("\n".join(TEXTS) + "\n")
  (data / "test.txt").write_text("\n".join(TEXTS[:5]) + "\n")
  shutil.copytree(gpt2_workdir, workdir)
  done = launch("--mode=train", f"--workdir={workdir}", "--config.data.source=files",
                f"--config.data.path={data}", "--config.train.steps=30",
                "--config.train.log_every=10", "--config.train.learning_rate=3e-3",
                "--config.train.warmup_steps=5", "--config.data.max_target_len=32",
                "--config.data.tokens_per_batch=512", "--config.data.test_split=")
  assert done.returncode == 0, done.stderr
  records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  losses = [r["loss"] for r in records if r["split"] == "train"]
  assert len(losses) == 3 and losses[-1] < losses[0] - 0.3, losses
  assert not (workdir / tokenizer_lib.FILENAME).exists()
  assert "imported model's tokenizer" in done.stdout


@pytest.mark.parametrize("form", ["pytorch_bin", "sharded", "bfloat16"])
def test_pytorch_and_sharded_weights_import_as_safetensors_do(form, gpt2_dir, gpt2_workdir,
                                                             tmp_path):
  """pytorch_model.bin (read with weights_only=True), sharded safetensors with their index and
  bfloat16 safetensors give the parameters that model.safetensors gives (rounded to bfloat16)."""
  other = tmp_path / form
  shutil.copytree(gpt2_dir, other)
  os.remove(other / "model.safetensors")
  model = transformers.GPT2LMHeadModel.from_pretrained(gpt2_dir)
  if form == "pytorch_bin":
    torch.save(model.state_dict(), other / "pytorch_model.bin")
  elif form == "bfloat16":
    model.to(torch.bfloat16).save_pretrained(other)
  else:
    model.save_pretrained(other, max_shard_size="20KB")
    assert len(list(other.glob("model-*.safetensors"))) > 1
  reference = trained_from(gpt2_workdir).params
  params = imported(str(other), tmp_path / "b").params
  for a, b in zip(jax.tree.leaves(reference), jax.tree.leaves(params)):
    a = np.asarray(a)
    if form == "bfloat16":
      a = a.astype(jnp.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(a, np.asarray(b))


def test_a_model_trained_here_exports_as_gpt2_with_its_own_ids(tmp_path):
  """A workdir of our own (a SentencePiece vocabulary) whose options GPT-2 expresses exports with
  the ids unchanged (pad 0, BOS 1, EOS 2) and no tokenizer; transformers' logits are ours."""
  tokenizer = tokenizer_lib.train(TEXTS, 40, "word")
  config = config_lib.default_config()
  config.model.update(dict(
      vocab_size=tokenizer.vocab_size, arch="decoder_only", d_model=32, num_heads=4, d_ff=64,
      num_encoder_layers=0, num_decoder_layers=2, norm="pre", positional="learned",
      embed_scale=False, activation="gelu", layer_norm_eps=1e-5, max_len=64, init="normal"))
  config.data.task = "lm"
  model_config, state = our_workdir(config, tokenizer, tmp_path / "w")
  hf.export_hf(str(tmp_path / "w"), str(tmp_path / "out"))
  assert not (tmp_path / "out" / "tokenizer.json").exists()
  exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
  assert exported.config.eos_token_id == EOS_ID and exported.config.pad_token_id == 0
  ids, mask = random_batch(tokenizer.vocab_size, low=1)
  model = make_model(model_config.replace(deterministic=True))
  ours = np.asarray(model.apply({"params": state.params}, jnp.zeros((3, 0), jnp.int32),
                                jnp.asarray(ids, jnp.int32)))
  assert np.abs(ours - their_logits(exported, ids, mask))[mask].max() <= TOLERANCE


def test_an_exported_gpt2_converts_with_ctranslate2_and_decodes_as_ours(gpt2_workdir, gpt2_export,
                                                                       tmp_path):
  """CTranslate2's own converter reads the export; its greedy continuations of 32 tokens are
  ours (from the imported workdir, in one padded batch)."""
  ctranslate2 = pytest.importorskip("ctranslate2")
  from ctranslate2.converters import TransformersConverter
  trained = trained_from(gpt2_workdir)
  TransformersConverter(str(gpt2_export)).convert(str(tmp_path / "ct2"))
  generator = ctranslate2.Generator(str(tmp_path / "ct2"), device="cpu")
  vocab = transformers.AutoConfig.from_pretrained(gpt2_export).vocab_size
  # Prompts shaped as the import test's: its compiled greedy decoding serves again.
  prompts, mask = random_batch(vocab, seed=3, lengths=(6, 3, 1), low=1)
  ours = np.asarray(decode.greedy_decode(
      trained.params, trained.model_config.replace(deterministic=True),
      jnp.asarray(np.where(mask, trained.tokenizer.our_ids[prompts], 0), jnp.int32), 32))
  tokenizer = transformers.AutoTokenizer.from_pretrained(gpt2_export)
  compared = ct2_greedy_equals_ours(generator, tokenizer, prompts, mask, ours,
                                    trained.tokenizer.hf_ids)
  assert compared >= 32  # continuations, not an EOS at once


# ----------------------------------------------------------------------------- sentence pairs


def pair_config(workdir, data_dir, max_len, labels):
  """The imported workdir's config, reading data_dir's train.tsv as sentence pairs."""
  c = config_lib.from_workdir(str(workdir))
  c.data.update(source="files", path=str(data_dir), format="tsv", task="classify",
                text_pair=True, max_source_len=max_len, labels=labels)
  return c


@pytest.mark.skipif(not os.path.isdir(MULTI30K), reason="../shared/data/multi30k not present")
def test_sentence_pairs_read_as_bert_tokenizer_fast_reads_them(tmp_path):
  """300 Multi30k (English, German) pairs as data.text_pair rows, through the task and the
  batch: ids and token types equal BertTokenizerFast's input_ids and token_type_ids, whole
  and cut to 24 tokens longest-first."""
  from transformer_jax.data import sources, tasks
  from transformer_jax.train.step import pair_token_types
  english, german = multi30k("val", "en", 300), multi30k("val", "de", 300)
  trained = wordpiece(multi30k("train", "en", 3000) + multi30k("train", "de", 3000), 2000)
  theirs = transformers.BertTokenizerFast(vocab=trained.get_vocab())  # BERT's own pipeline
  model = transformers.BertForSequenceClassification(transformers.BertConfig(
      vocab_size=len(theirs), hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
      intermediate_size=16, max_position_embeddings=256, num_labels=2))
  model.save_pretrained(tmp_path / "hf")
  theirs.save_pretrained(tmp_path / "hf")
  hf.import_hf(str(tmp_path / "hf"), str(tmp_path / "w"))
  ours = tokenizer_lib.load_workdir(str(tmp_path / "w"), "")
  (tmp_path / "data").mkdir()
  (tmp_path / "data" / "train.tsv").write_text("".join(
      f"{a}\t{b}\t{i % 2}\n" for i, (a, b) in enumerate(zip(english, german))))
  for max_len in (256, 24):
    d = pair_config(tmp_path / "w", tmp_path / "data", max_len, "0,1").data
    examples = tasks.examples(d, sources.load_split(d, "train"), ours)
    assert len(examples) == 300
    inputs = examples.rows(range(300))["inputs"]
    types = np.asarray(pair_token_types(inputs))
    expected = theirs(english, german, truncation="longest_first", max_length=max_len)
    for row, (ids, type_ids) in enumerate(zip(expected["input_ids"],
                                              expected["token_type_ids"])):
      n = len(ids)
      assert ours.hf_ids[inputs[row, :n]].tolist() == ids and not inputs[row, n:].any()
      assert types[row, :n].tolist() == type_ids
    lengths = [len(ids) for ids in expected["input_ids"]]
    assert max(lengths) == max_len if max_len == 24 else max(lengths) > 24  # cut, and not


def test_an_imported_bert_classifier_fine_tunes_on_sentence_pairs_as_transformers_does(
    tmp_path_factory):
  """data.text_pair rows through the task, the batch and our train step's forward: the logits
  equal BertForSequenceClassification's given their tokenizer's pairs (token_type_ids), and
  after one SGD step on the pairs' cross-entropy, taken by each framework, they still do."""
  import optax

  from transformer_jax.data import sources, tasks
  from transformer_jax.train import step
  hf_dir = bert_dir(tmp_path_factory, transformers.BertForSequenceClassification, "bert_pairs")
  reference = transformers.BertForSequenceClassification.from_pretrained(hf_dir)
  with torch.no_grad():  # type rows far apart, so that a type read wrongly shows
    reference.bert.embeddings.token_type_embeddings.weight.mul_(5.0)
  reference.save_pretrained(hf_dir)
  root = tmp_path_factory.mktemp("bert_pairs_w")
  hf.import_hf(hf_dir, str(root / "w"))
  trained = trained_from(root / "w")
  first, second, labels = TEXTS[:6], TEXTS[7:13], [0, 2, 1, 1, 0, 2]
  (root / "train.tsv").write_text("".join(
      f"{a}\t{b}\t{label}\n" for a, b, label in zip(first, second, labels)))
  d = pair_config(root / "w", root, 16, "0,1,2").data
  examples = tasks.examples(d, sources.load_split(d, "train"), trained.tokenizer)
  batch = {k: jnp.asarray(v) for k, v in examples.rows(range(6)).items()}
  model = make_model(trained.model_config.replace(deterministic=True))

  def loss(params):
    logits, targets, _ = step.forward(model, params, batch)
    return optax.softmax_cross_entropy_with_integer_labels(logits[:, 0], targets[:, 0]).mean()

  encoded = transformers.AutoTokenizer.from_pretrained(hf_dir)(
      first, second, truncation="longest_first", max_length=16, padding=True,
      return_tensors="pt", return_token_type_ids=True)
  assert encoded["token_type_ids"].sum() > 6  # pairs, of type 1 after the first [SEP]
  truth = torch.tensor(labels)
  lr = 0.5
  params = trained.params
  for _ in range(2):
    with torch.no_grad():
      expected = reference(**encoded).logits.numpy()
    ours = np.asarray(step.forward(model, params, batch)[0][:, 0])
    assert np.abs(ours - expected).max() <= TOLERANCE
    reference.zero_grad()
    torch.nn.functional.cross_entropy(reference(**encoded).logits, truth).backward()
    with torch.no_grad():
      for parameter in reference.parameters():
        if parameter.grad is not None:
          parameter.sub_(lr * parameter.grad)
    params = jax.tree.map(lambda p, g: p - lr * g, params, jax.grad(loss)(params))
  with torch.no_grad():  # the step moved the logits by far more than the tolerance
    assert np.abs(reference(**encoded).logits.numpy() - expected).max() > 100 * TOLERANCE
