"""Imported models score as `transformers` scores them: every log-probability (--mode=evaluate's
loss, the API's per-token log-probabilities, a fine-tuning step's loss and gradient), a
classifier's class names, the README's API call for each architecture, and the generation
settings of the original (beam search with forced EOS and bad words, compared on Multi30k).

Each model is built by transformers at random initialisation with every tensor drawn anew
(`randomize`), in configurations the other HF tests leave out: a vocabulary larger than the
tokenizer, logits all strongly negative (where a row of ours that the original lacks, at logit
0, would take the probability), T5 with d_kv 8, 12 default-named and 3 named classes, sentence
pairs.
"""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import transformer_jax
from transformer_jax import config as config_lib
from transformer_jax.core.errors import UserError
from transformer_jax.data import sources as sources_lib
from transformer_jax.data import tasks
from transformer_jax.data import tokenizer as tokenizer_lib
from transformer_jax.eval import evaluate as evaluate_lib
from transformer_jax.eval import search
from transformer_jax.tools import hf

from .common import (
  EXTRA_IDS,
  MULTI30K,
  ROOT,
  TEXTS,
  TOLERANCE,
  byte_level_bpe,
  llama_tokenizer,
  marian_config,
  marian_tokenizer,
  multi30k,
  randomize,
  save,
  t5_config,
  t5_tokenizer_files,
  torch,
  trained_from,
  transformers,
  wordpiece,
)

ENGLISH = ["a small dog runs in the park", "two men are playing football on the grass",
           "a woman in a red coat waits for the bus while it rains", "a man sleeps",
           "children play"]
GERMAN = ["ein kleiner Hund rennt im Park", "zwei Männer spielen Fußball auf dem Rasen",
          "eine Frau in einem roten Mantel wartet auf den Bus", "ein Mann schläft",
          "Kinder spielen"]


def strongly_negative(model, head, final_norm, shift=-32.0, seed=5):
  """Every logit of a tied or untied head near `shift`: a common direction u added to every
  row of the head and a final norm whose output is mostly -u * |shift| / |u|^2."""
  generator = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    u = torch.randn(head.weight.shape[1], generator=generator)
    head.weight.add_(u)
    final_norm.weight.mul_(0.05)
    final_norm.bias.copy_(u * shift / u.dot(u) + 0.05 * torch.randn(u.shape, generator=generator))
  return model


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
  """Their model directories, built once: {name: directory}."""
  root = tmp_path_factory.mktemp("hf_scores")
  out = {}
  # GPT-2: 13 rows beyond the tokenizer's ids, every logit near -32.
  tokenizer = byte_level_bpe(TEXTS)
  eos = tokenizer.token_to_id("<|endoftext|>")
  config = transformers.GPT2Config(vocab_size=tokenizer.get_vocab_size() + 13, n_positions=64,
                                   n_embd=32, n_layer=2, n_head=4, bos_token_id=eos,
                                   eos_token_id=eos)
  model = randomize(transformers.GPT2LMHeadModel(config), seed=1)
  strongly_negative(model, model.lm_head, model.transformer.ln_f)
  out["gpt2"] = save(model, tokenizer, root / "gpt2", bos_token="<|endoftext|>",
                     eos_token="<|endoftext|>")
  # Llama: untied head, 5 rows beyond the tokenizer's, our padding a row of our own.
  (root / "llama").mkdir()
  tokenizer = llama_tokenizer(TEXTS, root / "llama", 300)
  config = transformers.LlamaConfig(
      vocab_size=len(tokenizer) + 5, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
      rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
  randomize(transformers.LlamaForCausalLM(config), seed=2, scale=0.5).save_pretrained(
      root / "llama")
  tokenizer.save_pretrained(root / "llama")
  out["llama"] = str(root / "llama")
  # BERT: masked LM (3 rows beyond the tokenizer), a 12-class classifier with transformers'
  # default names, a 3-class one with names that do not sort in the order of their ids.
  tokenizer = wordpiece(TEXTS)
  specials = dict(pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]",
                  mask_token="[MASK]")
  common = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                intermediate_size=64, max_position_embeddings=48)
  for name, head, changes in (
      ("bert_mlm", transformers.BertForMaskedLM,
       dict(vocab_size=tokenizer.get_vocab_size() + 3)),
      ("bert_12", transformers.BertForSequenceClassification, dict(num_labels=12)),
      ("bert_3", transformers.BertForSequenceClassification,
       dict(id2label={0: "neutral", 1: "contradiction", 2: "entailment"},
            label2id={"neutral": 0, "contradiction": 1, "entailment": 2}))):
    config = transformers.BertConfig(**{"vocab_size": tokenizer.get_vocab_size(), **common,
                                        **changes})
    # The classifiers at a larger scale: their [CLS] outputs, and so their classes, then vary
    # from one text to another.
    model = randomize(head(config), seed=3, scale=0.5 if name == "bert_mlm" else 1.0)
    out[name] = save(model, tokenizer, root / name, **specials)
  # T5 v1.1 with d_kv 8 (4 heads of a 32-wide model: 32 query features), 2 rows past the
  # sentinels; the untied head drawn apart from the embedding.
  pieces = t5_tokenizer_files(root / "t5", TEXTS, 60)
  model = randomize(transformers.T5ForConditionalGeneration(
      t5_config(pieces + EXTRA_IDS + 2, d_kv=8, num_heads=4)), seed=4)
  with torch.no_grad():
    model.lm_head.weight = torch.nn.Parameter(torch.randn(
        model.lm_head.weight.shape, generator=torch.Generator().manual_seed(6)))
  model.save_pretrained(root / "t5")
  out["t5"] = str(root / "t5")
  out["marian"] = marian_dir(root / "marian")
  return out


def marian_dir(directory, scale=1.0, eos_bias=3.0):
  """Marian with the generation settings of Helsinki-NLP's models: beams, forced EOS at the
  length limit, <pad> as a bad word; an EOS likely enough that beams end on their own too."""
  english = multi30k("train", "en", 2000) if os.path.isdir(MULTI30K) else TEXTS[0::2]
  german = multi30k("train", "de", 2000) if os.path.isdir(MULTI30K) else TEXTS[1::2]
  tokenizer = marian_tokenizer(directory, english, german, 120)
  config = marian_config(len(tokenizer.encoder))
  model = randomize(transformers.MarianMTModel(config), seed=7, scale=scale)
  with torch.no_grad():  # a buffer: noise on it too, <pad> never generated, EOS not too rare
    bias = torch.randn(model.final_logits_bias.shape, generator=torch.Generator().manual_seed(8))
    bias[0, config.pad_token_id] = -30.0
    bias[0, config.eos_token_id] = eos_bias
    model.final_logits_bias.copy_(bias)
    model.model.shared.weight[config.pad_token_id] = 0.0
  model.generation_config = transformers.GenerationConfig(
      num_beams=4, max_length=12, length_penalty=1.0, forced_eos_token_id=0,
      bad_words_ids=[[config.pad_token_id]], decoder_start_token_id=config.pad_token_id,
      pad_token_id=config.pad_token_id, eos_token_id=0, bos_token_id=0)
  model.save_pretrained(directory)
  tokenizer.save_pretrained(directory)
  return str(directory)


@pytest.fixture(scope="module")
def workdirs(dirs, tmp_path_factory):
  root = tmp_path_factory.mktemp("hf_scores_workdirs")
  for name, directory in dirs.items():
    hf.import_hf(directory, str(root / name))
  return {name: root / name for name in dirs}


def reference(dirs, name):
  classes = {"gpt2": transformers.GPT2LMHeadModel, "llama": transformers.LlamaForCausalLM,
             "bert_mlm": transformers.BertForMaskedLM,
             "t5": transformers.T5ForConditionalGeneration, "marian": transformers.MarianMTModel}
  cls = classes.get(name, transformers.BertForSequenceClassification)
  return cls.from_pretrained(dirs[name]).eval()


def their_token_log_probs(name, model, tokenizer, sources, targets):
  """Per text: transformers' log p of each target token (EOS included), teacher forced, the
  inputs as the model's own tokenizer writes them (a language model: its BOS, then the text)."""
  out = []
  for source, target in zip(sources, targets):
    if name in ("gpt2", "llama"):
      ids = tokenizer(target, add_special_tokens=False).input_ids
      start = model.config.bos_token_id
      inputs = torch.tensor([[start] + ids])
      labels = ids + [model.config.eos_token_id]
      with torch.no_grad():
        logits = model(input_ids=inputs).logits[0]
    else:
      source_ids = tokenizer(source).input_ids  # </s> appended
      labels = tokenizer(text_target=target).input_ids
      with torch.no_grad():
        logits = model(input_ids=torch.tensor([source_ids]),
                       labels=torch.tensor([labels])).logits[0]
    log_probs = torch.log_softmax(logits.double(), -1).numpy()
    out.append(log_probs[np.arange(len(labels)), labels])
  return out


@pytest.mark.parametrize("name", ["gpt2", "llama", "t5", "marian"])
def test_evaluate_loss_and_token_log_probs_are_transformers(name, dirs, workdirs, tmp_path):
  """--mode=evaluate's loss (its library call) and `token_log_probs` of the Python API against
  transformers' own teacher-forced log-probabilities, within 1e-4."""
  model = reference(dirs, name)
  tokenizer = transformers.AutoTokenizer.from_pretrained(dirs[name])
  lm = name in ("gpt2", "llama")
  sources = [""] * len(ENGLISH) if lm else ENGLISH
  targets = ENGLISH if lm else GERMAN
  expected = their_token_log_probs(name, model, tokenizer, sources, targets)

  longest = {"data.max_source_len": 63, "data.max_target_len": 63}  # nothing truncated
  api = transformer_jax.load(str(workdirs[name]), overrides=longest)
  assert api.model_config.excluded_rows  # the rows their vocabulary lacks
  ours = api.token_log_probs(sources, targets)
  assert [len(row) for row in ours] == [len(row) for row in expected]
  # Without ../shared's Multi30k, Marian's tokenizer is trained on the fallback's few sentences:
  # the German targets then split into up to 40 pieces whose noised float32 activations drift
  # from transformers' float64 by up to 3.4e-4 (seen at 2026-11-27); the check the issue asks
  # for (1e-4) is the one made with Multi30k's tokenizer, as CI has it.
  tolerance = TOLERANCE if name != "marian" or os.path.isdir(MULTI30K) else 5e-4
  assert max(np.abs(a - b).max() for a, b in zip(ours, expected)) <= tolerance
  np.testing.assert_allclose(api.score(sources, targets), [row.sum() for row in expected],
                             atol=tolerance * 20)

  data = tmp_path / "data"
  data.mkdir()
  if lm:
    (data / "val.txt").write_text("\n".join(targets) + "\n", encoding="utf-8")
    overrides = {"data.format": "text"}
  else:
    (data / "val.en").write_text("\n".join(sources) + "\n", encoding="utf-8")
    (data / "val.de").write_text("\n".join(targets) + "\n", encoding="utf-8")
    overrides = {"data.format": "parallel", "data.source_lang": "en", "data.target_lang": "de",
                 "eval.decode": "greedy", "eval.max_decode_len": 2}
  config = api.config
  config.data.update(source="files", path=str(data))
  for key, value in overrides.items():
    section, option = key.split(".")
    config[section][option] = value
  # What --mode=evaluate runs once it has loaded the checkpoint.
  metrics = evaluate_lib.evaluate(api.params, api.model_config, config, api.tokenizer,
                                  sources_lib.load_split(config.data, "val"))
  nll = -np.concatenate(expected)
  assert abs(metrics["loss"] - nll.mean()) <= TOLERANCE
  assert metrics["perplexity"] == pytest.approx(np.exp(nll.mean()), rel=1e-4)
  # What the rows their vocabulary lacks did to the loss before they were excluded.
  every_row = dataclasses.replace(api, model_config=api.model_config.replace(
      excluded_rows=(), row_copies=()))
  before = -np.concatenate(every_row.token_log_probs(sources, targets)).mean()
  print(f"{name}: loss {metrics['loss']:.5f}, transformers {nll.mean():.5f}, with every row "
        f"in the softmax {before:.5f}")


def test_the_excluded_rows_are_what_their_vocabulary_lacks(workdirs):
  """GPT-2: our padding (a new row) and BOS (a copy of <|endoftext|>, read as its row);
  T5 and Marian: our padding, a copy of <pad>, which is our BOS (their decoder start)."""
  models = {name: config_lib.model_config(config_lib.from_workdir(str(workdirs[name])))
            for name in ("gpt2", "llama", "t5", "marian", "bert_mlm")}
  rows = {name: (model.excluded_rows, model.row_copies) for name, model in models.items()}
  assert rows == {"gpt2": ((0, 1), ((1, 2),)), "llama": ((0,), ()), "t5": ((0,), ((0, 1),)),
                  "marian": ((0,), ((0, 1),)), "bert_mlm": ((), ())}


def test_a_workdir_from_before_the_excluded_rows_loads_with_every_row(workdirs, tmp_path):
  """A config.json without the new keys (a workdir imported or trained before them) loads,
  its model with every row real, as it was."""
  import shutil
  workdir = tmp_path / "old"
  shutil.copytree(workdirs["llama"], workdir)
  meta = workdir / "checkpoints" / "0" / "meta" / "metadata"  # the checkpoint's own config
  for path, config in ((workdir / "config.json", None), (meta, "config")):
    saved = json.loads(path.read_text())
    for key in ("excluded_rows", "row_copies"):
      del (saved[config] if config else saved)["model"][key]
    path.write_text(json.dumps(saved))
  old = trained_from(workdir)
  assert (old.model_config.excluded_rows, old.model_config.row_copies) == ((), ())


README_SNIPPET = "## Python API"


def readme_architecture_example():
  with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
    section = f.read().split(README_SNIPPET)[1].split("\n## ")[0]
  blocks = section.split("```python\n")[1:]
  example = next(block.split("```")[0] for block in blocks if "model.module.apply" in block)
  assert "runs/marian" in example
  return example


@pytest.mark.parametrize("name", ["marian", "gpt2", "bert_mlm"])
def test_the_readme_api_applies_each_architecture_as_transformers_does(name, dirs, workdirs):
  """The README's `model.module.apply` example, run as written on an encoder-decoder, a
  decoder-only and an encoder-only workdir: its log-probabilities, in their vocabulary's order,
  are transformers' for the same ids (all rows: the excluded ones give no probability)."""
  namespace = {}
  exec(readme_architecture_example().replace('"runs/marian"', repr(str(workdirs[name]))),
       namespace)
  model, ids = namespace["model"], np.asarray(namespace["ids"])
  ours = np.asarray(namespace["log_probs"])[..., model.tokenizer.our_ids]
  theirs_ids = torch.tensor(model.tokenizer.hf_ids[ids])
  reference_model = reference(dirs, name)
  with torch.no_grad():
    if name == "marian":
      start = torch.full((1, 1), reference_model.config.decoder_start_token_id)
      logits = reference_model(input_ids=theirs_ids,
                               decoder_input_ids=torch.cat([start, theirs_ids[:, :-1]], 1)).logits
    elif name == "gpt2":
      start = torch.full((1, 1), reference_model.config.bos_token_id)
      logits = reference_model(input_ids=torch.cat([start, theirs_ids[:, :-1]], 1)).logits
    else:
      logits = reference_model(input_ids=theirs_ids).logits
  expected = torch.log_softmax(logits.double(), -1).numpy()
  # Our float32 against transformers' in float64: the error of a log-probability grows with its
  # size (down to -47 here; 1.4e-4 off at -47 on one CPU, 37 float32 ulps): TOLERANCE, relative
  # beyond 1.
  assert (np.abs(ours - expected) / np.maximum(1.0, np.abs(expected))).max() <= TOLERANCE


def test_a_fine_tuning_step_of_gpt2_is_transformers_step(dirs, workdirs):
  """Our train step on an imported GPT-2 (dropout off on both sides): the loss and the gradient
  norm of transformers' step on the same texts, and the same gradient of the embedding table
  (read from Adam's first moment); the rows their vocabulary lacks get none, so fine-tuning
  cannot learn to use them."""
  import optax

  from transformer_jax.data import pipeline
  from transformer_jax.model import make_model
  from transformer_jax.train import state as state_lib
  from transformer_jax.train import step as step_lib
  workdir = workdirs["gpt2"]
  config = config_lib.from_workdir(str(workdir))
  trained = trained_from(workdir)
  model_config = trained.model_config.replace(dropout_rate=0.0, attention_dropout_rate=0.0)
  examples = tasks.examples(config.data, [(text, "") for text in ENGLISH], trained.tokenizer)
  batch, _ = next(pipeline.eval_batches(examples, len(ENGLISH)))
  optimizer = state_lib.make_optimizer(config.train, model_config.d_model)
  state = state_lib.TrainState(step=jnp.array(0), params=trained.params,
                               opt_state=optimizer.init(trained.params))
  model = make_model(model_config)
  # Jitted, as a run's step is: one compiled program, not one dispatch per operation.
  state, metrics = jax.jit(lambda state, batch, rng: step_lib.train_step(
      state, batch, rng, model=model, optimizer=optimizer, smoothing=0.0, accum_steps=1,
      task="lm"))(state, batch, jax.random.PRNGKey(0))
  adam = [s for s in jax.tree.leaves(state.opt_state,
                                     is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
          if isinstance(s, optax.ScaleByAdamState)][0]
  table = np.asarray(adam.mu["token_embedding"]["embedding"]) / (1 - config.train.adam_b1)

  model = reference(dirs, "gpt2")
  tokenizer = transformers.AutoTokenizer.from_pretrained(dirs["gpt2"])
  eos = model.config.eos_token_id
  rows = [tokenizer(text, add_special_tokens=False).input_ids for text in ENGLISH]
  width = max(map(len, rows)) + 2  # "<|endoftext|> text <|endoftext|>", right-padded
  inputs = torch.tensor([[eos] + row + [eos] * (width - len(row) - 1) for row in rows])
  labels = torch.tensor([[eos] + row + [eos] + [-100] * (width - len(row) - 2) for row in rows])
  mask = (labels != -100).long()  # transformers shifts the labels itself
  loss = model(input_ids=inputs, attention_mask=mask, labels=labels).loss
  loss.backward()
  their_norm = float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters())))
  print(f"gpt2 fine-tuning step: loss {float(metrics['loss']):.6f} (transformers "
        f"{float(loss):.6f}), gradient norm {float(metrics['grad_norm']):.6f} ({their_norm:.6f})")
  assert abs(float(metrics["loss"]) - float(loss)) <= TOLERANCE
  assert abs(float(metrics["grad_norm"]) - their_norm) <= TOLERANCE * their_norm
  assert not table[list(model_config.excluded_rows)].any()
  np.testing.assert_allclose(table[trained.tokenizer.our_ids],
                             model.transformer.wte.weight.grad.numpy(), atol=1e-5)


@pytest.mark.parametrize("name", ["bert_12", "bert_3"])
def test_imported_classifiers_predict_transformers_classes_by_their_names(name, dirs, workdirs,
                                                                         tmp_path):
  """A split whose labels are transformers' own predictions (by name): --mode=evaluate's
  accuracy is 1.0, every row; 12 classes named LABEL_0..LABEL_11 keep the order of their ids
  (not LABEL_10 before LABEL_2), 3 named ones too; the 3-class data are sentence pairs."""
  model = reference(dirs, name)
  tokenizer = transformers.AutoTokenizer.from_pretrained(dirs[name])
  pair = name == "bert_3"
  rng = np.random.default_rng(0)
  words = sorted(w for w in tokenizer.get_vocab() if w.isalpha())
  texts = [" ".join(rng.choice(words, rng.integers(3, 12))) for _ in range(40)]
  rows = list(zip(texts[:20], texts[20:])) if pair else [(text,) for text in texts]
  with torch.no_grad():
    encoded = tokenizer(*zip(*rows), padding=True, return_tensors="pt",
                        return_token_type_ids=True)  # B of a pair: type 1
    predicted = model(**encoded).logits.argmax(-1).tolist()
  names = [model.config.id2label[i] for i in predicted]
  assert len(set(names)) >= (2 if pair else 3)  # classes to get right, not one
  data = tmp_path / "data"
  data.mkdir()
  (data / "val.tsv").write_text("".join("\t".join(row + (label,)) + "\n"
                                        for row, label in zip(rows, names)), encoding="utf-8")
  config = config_lib.from_workdir(str(workdirs[name]))
  assert config.data.labels.split(",") == [model.config.id2label[i]
                                           for i in range(model.config.num_labels)]
  config.data.update(source="files", path=str(data), format="tsv", text_pair=pair)
  metrics = evaluate_lib.evaluate_from_workdir(config, str(workdirs[name]), split="val")
  assert metrics["accuracy"] == 1.0 and metrics["examples"] == len(rows)

  # A split with a class their id2label lacks: one clear error, no remapping.
  (data / "val.tsv").write_text("".join("\t".join(row + (label,)) + "\n" for row, label in zip(
      rows, names[:-1] + ["LABEL_12" if not pair else "unknown"])), encoding="utf-8")
  with pytest.raises(UserError, match="not among the classes"):
    evaluate_lib.evaluate_from_workdir(config, str(workdirs[name]), split="val")
  config.data.labels = "a,b"
  with pytest.raises(UserError, match="data.labels names 2 classes"):
    config_lib.validate(config)


def test_a_new_classifier_fixes_its_label_order_once(tmp_path):
  """Our own classifier: a new run's labels are the train split's in the order of their digit
  runs, written into its config before training; a run that resumes keeps its workdir's."""
  from transformer_jax.train import loop
  (tmp_path / "train.tsv").write_text("".join(f"text {i}\tLABEL_{i % 12}\n" for i in range(30)))
  config = config_lib.default_config()
  config.data.update(source="files", path=str(tmp_path), format="tsv", task="classify")
  tasks.fix_labels(config.data, loop._saved_labels(str(tmp_path / "new")))
  assert config.data.labels == ",".join(f"LABEL_{i}" for i in range(12))
  (tmp_path / "old").mkdir()
  (tmp_path / "old" / "config.json").write_text(json.dumps({"data": {"labels": ""}}))
  config.data.labels = ""
  tasks.fix_labels(config.data, loop._saved_labels(str(tmp_path / "old")))
  assert config.data.labels == ""  # trained before: read as it was trained (sorted text)
  assert tasks.label_names(config.data)[:3] == ("LABEL_0", "LABEL_1", "LABEL_10")


def test_imported_generation_settings(workdirs, capsys, tmp_path, dirs):
  """Marian's generation_config.json: beams and transformers' length penalty, the length limit
  (their max_length counts the decoder start), forced EOS, <pad> as a bad word (our BOS: never
  generated anyway); a setting with no counterpart is named in one line."""
  config = config_lib.from_workdir(str(workdirs["marian"]))
  e = config.eval
  assert (e.decode, e.beam_size, e.length_penalty, e.length_penalty_form, e.max_decode_len,
          e.force_eos, tuple(e.suppress_tokens)) == ("beam", 4, 1.0, "length", 11, True, ())
  # Its evaluations go to files of their own, not to those of our default beam search.
  assert evaluate_lib.decode_name(config) == "beam4-lplength1-eos-len11"
  model = transformers.MarianMTModel.from_pretrained(dirs["marian"])
  model.generation_config.no_repeat_ngram_size = 3
  model.generation_config.eos_token_id = [0, 5]  # a list: transformers stops at either
  model.save_pretrained(tmp_path / "hf")
  for name in ("source.spm", "target.spm", "vocab.json", "tokenizer_config.json"):
    (tmp_path / "hf" / name).write_bytes((dirs_path(dirs, "marian") / name).read_bytes())
  capsys.readouterr()
  hf.import_hf(str(tmp_path / "hf"), str(tmp_path / "w"))
  err = capsys.readouterr().err
  assert "no_repeat_ngram_size=3" in err and "have no counterpart here" in err
  assert "eos_token_id=[0, 5] (transformers stops at any of them; generation here stops at the " \
         "EOS token 0 alone)" in err
  # A decoder start that only generation_config.json names (config.json without one, as
  # transformers 5 may save it) is the one our BOS reads.
  t5 = tmp_path / "t5"
  t5.mkdir()
  for path in dirs_path(dirs, "t5").iterdir():
    (t5 / path.name).write_bytes(path.read_bytes())
  config = json.loads((t5 / "config.json").read_text())
  del config["decoder_start_token_id"]
  (t5 / "config.json").write_text(json.dumps(config))
  (t5 / "generation_config.json").write_text(json.dumps({"decoder_start_token_id": 3}))
  hf.import_hf(str(t5), str(tmp_path / "w_t5"))
  assert tokenizer_lib.load_workdir(str(tmp_path / "w_t5"), "").hf_ids[1] == 3


def dirs_path(dirs, name):
  import pathlib
  return pathlib.Path(dirs[name])


@pytest.mark.skipif(not os.path.isdir(MULTI30K), reason="../shared/data/multi30k not present")
def test_marian_beam_search_is_transformers_on_multi30k(dirs, workdirs):
  """Every Multi30k val sentence: our beam search with the imported settings (4 beams,
  log p / length, forced EOS at 11 tokens, <pad> barred) gives transformers' output token for
  token when transformers searches until no beam can win (early_stopping="never"). With its
  default heuristic stop (early_stopping=False) the outputs that differ are ones where ours
  found a hypothesis that scores higher by transformers' own measure."""
  sentences = multi30k("val", "en", 1014)
  model = reference(dirs, "marian")
  tokenizer = transformers.AutoTokenizer.from_pretrained(dirs["marian"])
  api = transformer_jax.load(str(workdirs["marian"]))
  encoded = tokenizer(sentences, truncation=True, max_length=40).input_ids
  width = max(map(len, encoded))
  ours_in = np.zeros((len(encoded), width), np.int32)
  for i, row in enumerate(encoded):
    ours_in[i, :len(row)] = api.tokenizer.our_ids[row]
  ours = search.decode_batch(api.params, api.model_config, api.config.eval, ours_in,
                             search.max_decode_length(api.config))
  ours = [list(api.tokenizer.hf_ids[row[row != 0]]) for row in ours]

  def theirs(count, **options):
    out = []
    for start in range(0, count, 256):
      batch = tokenizer.pad({"input_ids": encoded[start:start + 256]}, return_tensors="pt")
      with torch.no_grad():
        generated = model.generate(**batch, **options)[:count - start]
      pad = model.config.pad_token_id
      out += [[t for t in row[1:].tolist() if t != pad] for row in generated]
    return out

  exact = theirs(len(encoded), early_stopping="never")
  assert ours == exact
  assert sum(len(row) < 11 for row in ours) >= 50  # beams that end with EOS on their own
  assert sum(len(row) == 11 for row in ours) >= 50  # and ones that the limit ends (forced EOS)
  assert all(row[-1] == model.config.eos_token_id for row in ours)
  default = theirs(256)  # the first 256 sentences
  differ = [i for i in range(len(default)) if ours[i] != default[i]]

  def score(i, output):  # transformers' beam score: log p / length, the forced EOS as log 1
    with torch.no_grad():
      logits = model(input_ids=torch.tensor([encoded[i]]), decoder_input_ids=torch.tensor(
          [[model.config.decoder_start_token_id] + output[:-1]])).logits[0]
    log_probs = torch.log_softmax(logits.double(), -1)[np.arange(len(output)), output].numpy()
    if len(output) == 11:
      log_probs[-1] = 0.0
    return log_probs.sum() / len(output)

  assert all(score(i, ours[i]) >= score(i, default[i]) - 1e-6 for i in differ)
  print(f"early_stopping=False differs on {len(differ)} of {len(default)} sentences")


def test_output_lines_keep_one_output_per_line_and_say_what_they_change():
  """--output_format: escaped and jsonl give every output back exactly, on one line; text
  writes line breaks as spaces and says so."""
  import ast
  import io

  from transformer_jax.eval.translate import output_line, warn_folded
  outputs = ["a\nb", "x\x0by\x1dz \\ q\u2028r\t\x85", "plain", "end\n", 'say "hi"']
  for text in outputs:
    escaped, folded = output_line(text, "escaped")
    assert not folded and len(escaped.splitlines()) == 1
    assert ast.literal_eval('"' + escaped.replace('"', '\\"') + '"') == text
    line, _ = output_line(text, "jsonl")
    assert len(line.splitlines()) == 1 and json.loads(line) == {"output": text}
  texts = [output_line(text, "text") for text in outputs]
  assert [line for line, _ in texts] == ["a b", "x y z \\ q r\t", "plain", "end", 'say "hi"']
  assert [folded for _, folded in texts] == [True, True, False, True, False]
  err = io.StringIO()
  warn_folded(3, 5, "translations", err)
  assert "3 of 5 translations held line breaks" in err.getvalue()
  assert "--output_format=escaped or jsonl" in err.getvalue()
  with pytest.raises(UserError, match="--output_format"):
    output_line("x", "csv")
