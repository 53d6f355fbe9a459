"""The tasks: text files and TFDS text datasets, language-model and masked-LM examples with one
side, classification labels, and which task trains which architecture."""

import io

import numpy as np
import pytest

from transformer_jax import config as config_lib
from transformer_jax.core.errors import UserError
from transformer_jax.core.tokens import EOS_ID
from transformer_jax.data import pipeline, scan, sources, tasks
from transformer_jax.eval import generate
from transformer_jax.experiments import tiny


class DigitTokenizer:
  """Texts of space-separated ids -> those ids: task tests without SentencePiece."""

  vocab_size = 50

  def encode(self, texts):
    return [[int(w) for w in t.split()] for t in texts]


def text_config(tmp_path, task, arch, **data):
  c = tiny.get_config()
  c.model.update(arch=arch, max_len=64)
  c.data.update(task=task, source="files", path=str(tmp_path),
                format="tsv" if task == "classify" else "text", **data)
  return c


def test_text_files_skip_blank_lines_and_long_texts_become_pieces(tmp_path):
  (tmp_path / "train.txt").write_text("5 6 7\n\n   \n8 9 10 11 12 13 14\r\n\t\n15\n")
  c = text_config(tmp_path, "lm", "decoder_only", max_target_len=4)
  pairs = sources.load_split(c.data, "train")
  assert list(pairs) == [("5 6 7", ""), ("8 9 10 11 12 13 14", ""), ("15", "")]
  examples = tasks.examples(c.data, pairs, DigitTokenizer())
  # Each text and its EOS, cut into pieces of at most 4 tokens; no source side.
  pieces = [examples.target[a:a + n].tolist() for a, n in zip(examples.target_starts,
                                                              examples.target_lengths)]
  assert pieces == [[5, 6, 7, EOS_ID], [8, 9, 10, 11], [12, 13, 14, EOS_ID], [15, EOS_ID]]
  assert examples.index.tolist() == [0, 1, 1, 2] and examples.dropped == 0
  assert examples.source_lengths.tolist() == [0, 0, 0, 0] and examples.max_source_len == 0

  c.data.update(task="mlm", max_source_len=3)
  c.model.arch = "encoder_only"
  examples = tasks.examples(c.data, pairs, DigitTokenizer())
  assert examples.source_lengths.tolist() == [3, 1, 3, 3, 2, 2] and examples.max_source_len == 3
  assert examples.target_lengths.tolist() == [0] * 6 and examples.max_target_len == 0


@pytest.mark.parametrize("task, batching", [("lm", "packed"), ("lm", "tokens"),
                                            ("mlm", "packed")])
def test_text_batches_have_no_columns_for_the_missing_side(tmp_path, task, batching):
  rng = np.random.default_rng(0)
  lines = [" ".join(map(str, rng.integers(3, 50, rng.integers(1, 20)))) for _ in range(200)]
  (tmp_path / "train.txt").write_text("\n".join(lines) + "\n")
  arch = "decoder_only" if task == "lm" else "encoder_only"
  c = text_config(tmp_path, task, arch, batching=batching, tokens_per_batch=256,
                  max_source_len=16, max_target_len=16)
  examples = tasks.examples(c.data, sources.load_split(c.data, "train"), DigitTokenizer())
  batch = pipeline.TrainStream(examples, c.data, seed=0)[3]
  text, empty = ("targets", "inputs") if task == "lm" else ("inputs", "targets")
  assert batch[empty].shape == (batch[text].shape[0], 0)
  assert (batch[text] > 0).sum() > 0 and batch[text].shape[1] <= 16
  if batching == "packed":
    assert batch[f"{text}_segmentation"].max() > 1  # several texts in a row


def test_classification_targets_are_label_ids_plus_one(tmp_path):
  (tmp_path / "train.tsv").write_text("5 6\tpos\n7\tneg\n8 9 10\tpos\n")
  (tmp_path / "test.tsv").write_text("11\tneg\n12\tmaybe\n")
  c = text_config(tmp_path, "classify", "encoder_only")
  c.model.num_labels = 2
  assert tasks.label_names(c.data) == ("neg", "pos")  # sorted, from the train split
  examples = tasks.examples(c.data, sources.load_split(c.data, "train"), DigitTokenizer())
  assert examples.target.tolist() == [2, 1, 2] and examples.max_target_len == 1
  assert examples.source_lengths.tolist() == [3, 2, 4]  # EOS included
  c.data.labels = "pos,neg"  # an explicit order
  assert tasks.examples(c.data, sources.load_split(c.data, "train"),
                        DigitTokenizer()).target.tolist() == [1, 2, 1]
  with pytest.raises(UserError, match="maybe.*not among the classes"):
    tasks.examples(c.data, sources.load_split(c.data, "test"), DigitTokenizer())


@pytest.mark.parametrize("arch, task, changes, message", [
    ("encoder_decoder", "lm", {}, "does not train a model.arch=encoder_decoder"),
    ("decoder_only", "mlm", {}, "trains on seq2seq or lm"),
    ("encoder_only", "seq2seq", {}, "trains on mlm or classify"),
    ("decoder_only", "lm", {"data.format": "tsv"}, "reads data.format=text"),
    ("encoder_only", "classify", {"model.num_labels": 0}, "needs model.num_labels"),
    ("encoder_only", "classify", {"data.batching": "packed"}, "batching=tokens or fixed"),
    ("encoder_only", "mlm", {"data.mask_rate": 0.0}, "data.mask_rate"),
    ("decoder_only", "seq2seq", {"data.source": "scan", "model.max_len": 40},
     "max_source_len \\+ data.max_target_len"),
])
def test_tasks_that_do_not_fit_the_architecture_or_data_are_user_errors(tmp_path, arch, task,
                                                                       changes, message):
  c = text_config(tmp_path, task, arch)
  c.model.num_labels = 2 if task == "classify" else 0
  c.update_from_flattened_dict(changes)
  with pytest.raises(UserError, match=message):
    config_lib.validate(c)


def test_tfds_text_datasets_give_texts_and_labels(tmp_path):
  import tensorflow_datasets as tfds
  c = tiny.get_config()
  c.data.update(source="tfds", tfds_name="lm1b", task="lm", tfds_data_dir=str(tmp_path))
  with tfds.testing.mock_data(num_examples=6):
    texts = sources.load_split(c.data, "train")
    assert len(texts) == 6 and all(t and isinstance(t, str) and e == "" for t, e in texts)
    c.data.update(tfds_name="imdb_reviews", task="classify")
    reviews = sources.load_split(c.data, "test")
    assert {label for _, label in reviews} <= {"0", "1"}
    c.data.label_field = "stars"
    with pytest.raises(UserError, match="has the fields.*not data.label_field='stars'"):
      sources.load_split(c.data, "test")


@pytest.mark.parametrize("arch, task", [("decoder_only", "seq2seq"), ("decoder_only", "lm"),
                                        ("encoder_only", "mlm"), ("encoder_only", "classify")])
def test_every_architecture_trains_and_evaluates_its_tasks(tmp_path, arch, task):
  from transformer_jax import run
  commands = [command for command, _ in scan.load("simple", "train")[::40]]
  (tmp_path / "train.txt").write_text("\n".join(commands) + "\n")
  (tmp_path / "train.tsv").write_text("".join(f"{c}\t{'twice' in c}\n" for c in commands))
  # The final evaluation reads data.eval_split and data.test_split: these files have train only.
  c = text_config(tmp_path, task, arch, eval_split="train", test_split="train")
  if task == "seq2seq":
    c.data.update(source="scan", eval_split="test", test_split="test")
  c.model.update(num_labels=2 if task == "classify" else 0, max_len=64)
  c.train.update(steps=4, log_every=2, checkpoint_every=4)
  c.eval.update(max_examples=16, batch_size=16)
  metrics = run.train_and_evaluate(c, str(tmp_path / "run"))
  expected = {"seq2seq": ("exact_match", "bleu", "perplexity"), "lm": ("perplexity",),
              "mlm": ("perplexity", "token_accuracy"), "classify": ("accuracy", "macro_f1")}
  for key in expected[task] + ("loss",):
    assert np.isfinite(metrics[key]), key
  assert metrics["examples"] == 16 or task == "lm"
  if task == "lm":  # --mode=generate: a continuation per prompt line, a blank line included
    out, err = io.StringIO(), io.StringIO()
    c.eval.update(max_decode_len=8, max_examples=0)
    assert generate.generate_from_workdir(c, str(tmp_path / "run"), ["walk", "", "jump twice"],
                                          out, err) == 3
    assert len(out.getvalue().splitlines()) == 3 and not err.getvalue()
  elif task != "seq2seq":
    with pytest.raises(UserError, match="decoder-only language model"):
      generate.generate_from_workdir(c, str(tmp_path / "run"), ["walk"])


# ----------------------------------------------------------------------------- sentence pairs


def test_sentence_pairs_are_a_eos_b_cut_longest_first_with_b_of_type_1(tmp_path):
  """data.text_pair: text_a<TAB>text_b<TAB>label lines -> rows "A EOS B EOS" (a tokenizer
  without BOS); a pair over data.max_source_len is cut longest-first (the odd token of an even
  cut to B: A loses it on a tie), both texts stay; the train step's token types are 1 after the
  first EOS."""
  from transformer_jax.train.step import pair_token_types
  (tmp_path / "train.tsv").write_text("5 6 7\t8 9\tyes\n"  # 3 + 2 + 2 EOS = 7: fits in 7
                                      "5 6 7 10 11 12\t8\tno\n"  # 6 + 1 + 2 = 9: A loses 2
                                      "5 6 7\t8 9 10\tyes\n"  # 3 + 3 + 2 = 8: A loses 1 (tie)
                                      "5\t8 9 10 11 12 13 14 15\tno\n")  # B loses 3
  c = text_config(tmp_path, "classify", "encoder_only", text_pair=True, max_source_len=7)
  tasks.check("encoder_only", c.data)
  pairs = sources.load_split(c.data, "train")
  assert sources.gather(pairs, [0]) == [("5 6 7\t8 9", "yes")]
  examples = tasks.examples(c.data, pairs, DigitTokenizer())
  assert len(examples) == 4 and examples.dropped == 0
  inputs = examples.rows(range(4))["inputs"]
  e = EOS_ID
  assert inputs.tolist() == [[5, 6, 7, e, 8, 9, e], [5, 6, 7, 10, e, 8, e],
                             [5, 6, e, 8, 9, 10, e], [5, e, 8, 9, 10, 11, e]]
  assert examples.target.tolist() == [2, 1, 2, 1]  # labels no, yes + 1
  types = np.asarray(pair_token_types(np.pad(inputs, ((0, 0), (0, 2)))))
  assert types.tolist()[0] == [0, 0, 0, 0, 1, 1, 1, 0, 0]
  assert types.tolist()[3] == [0, 0, 1, 1, 1, 1, 1, 0, 0]
  # A single text (its one EOS last) is all of type 0.
  assert not np.asarray(pair_token_types(np.asarray([[5, 6, e, 0]]))).any()


@pytest.mark.parametrize("text, data, match", [
    ("5 6\tyes\n", {}, "line 1 has 1 tab; with data.text_pair=True each line must be "
                       "text_a<TAB>text_b<TAB>label"),
    ("5\t6\tyes\n", {"task": "mlm", "format": "text"}, "data.text_pair reads sentence pairs"),
])
def test_sentence_pair_files_and_settings_that_do_not_fit_are_user_errors(tmp_path, text, data,
                                                                          match):
  (tmp_path / "train.tsv").write_text(text)
  c = text_config(tmp_path, "classify", "encoder_only", text_pair=True)
  c.data.update(data)
  with pytest.raises(UserError, match=match):
    tasks.check("encoder_only", c.data)
    sources.load_split(c.data, "train")


def test_a_bert_style_classifier_trains_and_evaluates_on_sentence_pairs(tmp_path):
  """model.type_vocab_size=2 and data.text_pair: training and evaluation read B as type 1 (the
  type table's row 1 is trained: its gradient reaches it)."""
  from transformer_jax import run
  commands = [command for command, _ in scan.load("simple", "train")[::40]]
  (tmp_path / "train.tsv").write_text("".join(
      f"{a}\t{b}\t{('twice' in a) == ('twice' in b)}\n" for a, b in zip(commands,
                                                                         commands[1:])))
  c = text_config(tmp_path, "classify", "encoder_only", eval_split="train", test_split="",
                  text_pair=True)
  c.model.update(num_labels=2, max_len=64, type_vocab_size=2)
  c.train.update(steps=4, log_every=2, checkpoint_every=4)
  c.eval.update(max_examples=16, batch_size=16)
  metrics = run.train_and_evaluate(c, str(tmp_path / "run"))
  assert np.isfinite(metrics["accuracy"]) and metrics["examples"] == 16
  # The step's logits depend on B's type: the type table's row 1 gets a gradient.
  import jax
  import jax.numpy as jnp

  from transformer_jax.eval.load import load_trained
  from transformer_jax.model import make_model
  from transformer_jax.train import step
  trained = load_trained(config_lib.from_workdir(str(tmp_path / "run")), str(tmp_path / "run"))
  examples = tasks.examples(c.data, sources.load_split(c.data, "train"), trained.tokenizer)
  batch = {k: jnp.asarray(v) for k, v in examples.rows(range(8)).items()}
  model = make_model(trained.model_config.replace(deterministic=True))
  grads = jax.grad(lambda p: step.forward(model, p, batch)[0].sum())(trained.params)
  table = [g for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]
           if "token_types" in jax.tree_util.keystr(path)]
  assert len(table) == 1 and table[0].shape[0] == 2
  assert np.abs(np.asarray(table[0][1])).max() > 0


def test_tfds_sentence_pairs_read_text_a_and_text_b_fields(tmp_path):
  """glue/mrpc (mock records): data.text_field sentence1 and data.text_pair_field sentence2 make
  the pair; a field the dataset lacks and a missing data.text_pair_field are user errors."""
  import tensorflow_datasets as tfds
  c = tiny.get_config()
  c.model.arch = "encoder_only"
  c.data.update(source="tfds", tfds_name="glue/mrpc", task="classify", text_pair=True,
                text_field="sentence1", tfds_data_dir=str(tmp_path))
  with pytest.raises(UserError, match="data.text_pair_field; set it"):
    tasks.check("encoder_only", c.data)
  c.data.text_pair_field = "sentence2"
  tasks.check("encoder_only", c.data)
  with tfds.testing.mock_data(num_examples=4):
    pairs = sources.load_split(c.data, "train")
    records = tfds.data_source("glue/mrpc", split="train", data_dir=str(tmp_path))
    text = sources._text
    expected = [(f"{text(r['sentence1'])}\t{text(r['sentence2'])}", text(r["label"]))
                for r in (records[i] for i in range(4))]
    assert all(a and b and "\t" not in a + b for a, b in (p[0].split("\t") for p in expected))
    assert sources.gather(pairs, range(4)) == expected
    assert sources.split_key(c.data, "train")["pair_field"] == "sentence2"
    c.data.text_pair_field = "hypothesis"
    with pytest.raises(UserError, match="not data.text_pair_field='hypothesis'"):
      sources.load_split(c.data, "train")
