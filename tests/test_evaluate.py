"""Evaluation and translation: the text metrics' fixed points, checkpoint averaging, translate's
line handling, and --mode=translate reproducing --mode=evaluate on a briefly trained tiny model."""

import copy
import io
import json
import os
import pty

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from launcher import Launcher, environment

from transformer_jax import config as config_lib
from transformer_jax.core import progress
from transformer_jax.core.errors import UserError
from transformer_jax.data import scan
from transformer_jax.data import tokenizer as tokenizer_lib
from transformer_jax.eval import diagnostics, load, search
from transformer_jax.eval import evaluate as evaluate_lib
from transformer_jax.eval import translate as translate_lib
from transformer_jax.eval.metrics import classification_metrics, text_metrics
from transformer_jax.experiments import tiny
from transformer_jax.model import param_shapes
from transformer_jax.tools import benchmark
from transformer_jax.train import state as state_lib


def tiny_config():
  return tiny.get_config()


# ----------------------------------------------------------------------------- metrics

REFERENCES = ["The cat sat on the mat, and the dog sat on the rug.",
              "Two men are playing football in a park near the river.",
              "A woman in a red coat walks her dog along the beach."]


def test_bleu_of_references_against_themselves_is_100():
  metrics = text_metrics(REFERENCES, REFERENCES)
  for key in ("bleu", "bleu_lowercase_tokenized", "chrf"):
    assert metrics[key] == pytest.approx(100.0), key
  assert metrics["exact_match"] == 1.0
  assert "case:mixed" in metrics["bleu_signature"]


def test_classification_accuracy_and_macro_f1_by_hand():
  gold = ["a", "a", "a", "b", "b", "c"]
  predicted = ["a", "a", "b", "b", "c", "c"]
  # F1 = 2TP / (2TP + FP + FN): a: 4 / (4 + 0 + 1); b: 2 / (2 + 1 + 1); c: 2 / (2 + 1 + 0).
  metrics = classification_metrics(predicted, gold, ["a", "b", "c", "d"])
  assert metrics["accuracy"] == pytest.approx(4 / 6)
  assert metrics["macro_f1"] == pytest.approx((4 / 5 + 2 / 4 + 2 / 3 + 0.0) / 4)
  assert classification_metrics(gold, gold, ["a", "b", "c"]) == {"accuracy": 1.0, "macro_f1": 1.0}


def test_cased_bleu_sees_case_lowercased_bleu_does_not():
  metrics = text_metrics([r.lower() for r in REFERENCES], REFERENCES)
  assert metrics["bleu"] < 95.0  # only the first word of each sentence is capitalised
  assert metrics["bleu_lowercase_tokenized"] == pytest.approx(100.0)
  assert metrics["exact_match"] == 0.0
  # Exact match ignores whitespace, nothing else.
  metrics = text_metrics([" ".join(REFERENCES[0].split()) + "  ", "Two men are playing."],
                                  REFERENCES[:2])
  assert metrics["exact_match"] == 0.5
  assert 0.0 < metrics["bleu"] < 100.0


def test_eval_config_values_are_validated():
  c = tiny_config()
  c.eval.update(decode="sample", temperature=0.7, top_k=5, average_last=2)
  config_lib.validate(c)
  for key, value, message in (("temperature", 0.0, "temperature"), ("top_k", -1, "top_k"),
                              ("average_last", 4, "keep_checkpoints"),
                              ("decode", "nucleus", "greedy, beam, sample"),
                              ("length_penalty", -0.5, "length_penalty"),
                              ("max_decode_len", 65, "max_len")):
    bad = tiny_config()
    bad.eval[key] = value
    with pytest.raises(UserError, match=message):
      config_lib.validate(bad)


# ----------------------------------------------------------------------------- checkpoint averaging


def test_steps_to_average_are_the_last_n_up_to_the_step():
  assert load.steps_to_average([100, 200, 300, 400], None, 2) == [300, 400]
  assert load.steps_to_average([100, 200, 300, 400], 300, 3) == [100, 200, 300]
  with pytest.raises(UserError, match="average_last=3"):
    load.steps_to_average([100, 200, 300], 200, 3)
  with pytest.raises(UserError, match="no checkpoint at step 250"):
    load.steps_to_average([100, 200, 300], 250, 1)


class FakeManager:
  """Restores TrainStates whose parameters are {"w": step * ones}."""

  def restore(self, state, step):
    return state_lib.TrainState(step=step, params={"w": jnp.full((2, 3), float(step))},
                            opt_state=None)


def test_average_params_is_the_elementwise_mean():
  averaged = load.average_params(FakeManager(), None, [200, 300, 400])
  np.testing.assert_array_equal(averaged["w"], np.full((2, 3), 300.0))
  assert averaged["w"].dtype == jnp.float32


# ----------------------------------------------------------------------------- translate


@pytest.fixture(scope="module")
def model():
  """(config, model_config, params, tokenizer): experiments/tiny.py with random parameters
  (N(0, 0.5^2), drawn with NumPy: no compiled initialiser) and a SCAN word vocabulary."""
  c = tiny_config()
  model_config = config_lib.validate(c)
  rng = np.random.default_rng(0)
  params = jax.tree.map(lambda x: jnp.asarray(rng.normal(0.0, 0.5, x.shape), jnp.float32),
                        param_shapes(model_config))
  tokenizer = tokenizer_lib.train([t for p in scan.load("simple", "train") for t in p],
                                  model_config.vocab_size, "word")
  return c, model_config, params, tokenizer


def test_evaluation_bar_counts_sentences_and_names_the_search(model, monkeypatch, capsys):
  c, model_config, params, tokenizer = model
  c = copy.deepcopy(c)
  c.eval.update(decode="beam", beam_size=2, batch_size=4, max_examples=10)
  monkeypatch.setenv(progress.ENV, "1")
  drawing = progress.bar
  monkeypatch.setattr(progress, "bar", lambda **kw: drawing(**kw, mininterval=0, miniters=1))
  pairs = scan.load("simple", "test")
  metrics = evaluate_lib.evaluate(params, model_config, c, tokenizer, pairs)
  drawn = capsys.readouterr().err
  assert metrics["examples"] == 10
  assert "evaluating (beam2-lp0.6)" in drawn and "sentence" in drawn
  assert [f"{n}/10" in drawn for n in (4, 8, 10)] == [True] * 3  # batch by batch


def test_diagnostics_by_hand():
  references = ["a b c", "a b c", "a b", "a b", "x"]
  standard = ["a b c", "a b", "a b c d", "a c", ""]
  oracle = ["a b c", "a b d", "a b", "b b", "x"]
  found = diagnostics.diagnose(references, {"standard": standard, "oracle": oracle})
  assert found["by_length"] == [
      {"length": 1, "examples": 1, "exact_match": 0.0, "token_accuracy": 0.0,
       "oracle_exact_match": 1.0, "oracle_token_accuracy": 1.0},
      {"length": 2, "examples": 2, "exact_match": 0.0, "token_accuracy": 3 / 4,
       "oracle_exact_match": 0.5, "oracle_token_accuracy": 3 / 4},
      {"length": 3, "examples": 2, "exact_match": 0.5, "token_accuracy": 5 / 6,
       "oracle_exact_match": 0.5, "oracle_token_accuracy": 5 / 6}]
  # standard: "a b" stops at 2, "a b c d" runs on at 2, "a c" errs at 1, "" stops at 0
  assert found["first_error"] == {"standard": {"0": 1, "1": 1, "2": 2},
                                  "oracle": {"0": 1, "2": 1}}
  assert found["errors"] == {"standard": {"stopped_early": 2, "ran_on": 1, "wrong_token": 1},
                             "oracle": {"stopped_early": 0, "ran_on": 0, "wrong_token": 2}}
  table = diagnostics.by_length_table(found)
  assert table.splitlines()[2] == "| 1 | 1 | 0.0% | 0.0% | 100.0% | 100.0% |"


def test_exact_match_by_group_by_hand():
  references = ["a b", "c", "d e", "f"]
  found = diagnostics.by_group(references, {"standard": ["a b", "x", "d  e", "f g"],
                                            "oracle": ["a b", "c", "d x", "f"]},
                               ["seen", "unseen", "seen", "unseen"])
  assert found["by_group"] == [
      {"group": "seen", "examples": 2, "exact_match": 1.0, "oracle_exact_match": 0.5},
      {"group": "unseen", "examples": 2, "exact_match": 0.0, "oracle_exact_match": 1.0}]
  assert (found["exact_match_seen"], found["oracle_exact_match_unseen"]) == (1.0, 1.0)
  assert diagnostics.by_group_table(found).splitlines()[2] == "| seen | 2 | 100.00% | 50.00% |"


def test_evaluate_on_scan_length_test_reports_its_two_parts(model):
  """The length split's test in its two groups (repetitions trained or a count unseen), each
  group's exact match from its own examples: the two, weighted, give the whole."""
  c, model_config, params, tokenizer = model
  c = copy.deepcopy(c)
  c.data.scan_split = "length"
  c.eval.update(batch_size=16, oracle_length=True)
  pairs = scan.load("length", "test")[::98]  # 40 commands of both groups
  metrics = evaluate_lib.evaluate(params, model_config, c, tokenizer, pairs)
  groups = scan.repetition_groups([s for s, _ in pairs], "length")
  rows = {row["group"]: row for row in metrics["by_group"]}
  assert {g: rows[g]["examples"] for g in rows} == {g: groups.count(g) for g in set(groups)}
  assert set(rows) == {scan.TRAINED, scan.UNSEEN}
  for key in ("exact_match", "oracle_exact_match"):
    assert metrics[key] == pytest.approx(
        sum(r[key] * r["examples"] for r in rows.values()) / len(pairs))
    assert metrics[f"{key}_{scan.UNSEEN}"] == rows[scan.UNSEEN][key]
  c.data.scan_split = "simple"
  assert "by_group" not in evaluate_lib.evaluate(params, model_config, c, tokenizer, pairs[:4])


def test_evaluate_reports_oracle_length_and_by_length_diagnostics(model):
  """A random model (a word vocabulary: one token per word): the oracle-length outputs never
  stop early nor run on, and the by-length rows add up to the split's exact match."""
  c, model_config, params, tokenizer = model
  c = copy.deepcopy(c)
  c.eval.update(batch_size=16, max_examples=40, oracle_length=True)
  pairs = scan.load("simple", "test")
  metrics = evaluate_lib.evaluate(params, model_config, c, tokenizer, pairs)
  rows = metrics["by_length"]
  assert sum(r["examples"] for r in rows) == metrics["examples"] == 40
  for key in ("exact_match", "oracle_exact_match"):
    assert metrics[key] == pytest.approx(sum(r[key] * r["examples"] for r in rows) / 40)
  assert metrics["errors"]["oracle"]["stopped_early"] == metrics["errors"]["oracle"]["ran_on"] == 0
  for sample in metrics["samples"]:
    assert len(sample["oracle_length_hypothesis"].split()) == len(sample["reference"].split())
  for name in ("standard", "oracle"):
    assert sum(metrics["first_error"][name].values()) == sum(metrics["errors"][name].values())
  assert metrics["decoding"]["oracle_length"] is True
  c.eval.oracle_length = False
  plain = evaluate_lib.evaluate(params, model_config, c, tokenizer, pairs)
  assert "oracle_exact_match" not in plain and list(plain["errors"]) == ["standard"]
  assert plain["exact_match"] == metrics["exact_match"]


LONG_LINE = " and ".join(["walk left twice"] * 4)  # 15 words, more than max_source_len - 1 = 11
LINES = ["jump twice\n", "\n", "look around right and walk\r\n", "   \n", "fly to the moon\n",
         LONG_LINE + "\n", "run left after jump"]


def translations(model, lines, batch_size):
  c, model_config, params, tokenizer = model
  c.eval.batch_size = batch_size
  return list(translate_lib.translate(params, model_config, c, tokenizer, lines))


def test_translate_keeps_order_and_blank_lines_and_truncates(model):
  results = translations(model, LINES, 4)  # two batches, the second padded
  outputs = [text for text, _ in results]
  assert [cut for _, cut in results] == [False] * 5 + [True, False]
  assert outputs[1] == outputs[3] == ""
  assert all(outputs[i] for i in (0, 2, 5, 6)) and all("\n" not in o for o in outputs)
  # Another batch size and order give the same translation of each line.
  assert [text for text, _ in translations(model, LINES[::-1], 3)] == outputs[::-1]
  # The long line is translated as its first max_source_len - 1 tokens.
  c = model[0]
  truncated = " ".join(LONG_LINE.split()[:c.data.max_source_len - 1])
  assert translations(model, [truncated], 4) == [(outputs[5], False)]

  out, err = io.StringIO(), io.StringIO()
  assert translate_lib.write_translations(model[2], model[1], c, model[3], LINES, out, err) == 7
  assert out.getvalue().split("\n") == outputs + [""]
  assert len(err.getvalue().splitlines()) == 1 and "1 of 7" in err.getvalue()


def test_translate_answers_each_line_before_reading_the_next_with_a_buffer_of_one(model):
  c, model_config, params, tokenizer = model
  c.eval.batch_size = 4
  read = []

  def typed():  # a person at a terminal: the next line exists only once the last is answered
    for line in LINES:
      read.append(line)
      yield line

  answers = translate_lib.translate(params, model_config, c, tokenizer, typed(), buffer_size=1)
  streamed = []
  for count, answer in enumerate(answers, 1):
    assert len(read) == count  # answered before the next line was read
    streamed.append(answer)
  assert streamed == translations(model, LINES, 4)  # the same as in batches
  # eval.buffer_size = 0 chooses by the input: 1 for a terminal, eval.batch_size otherwise.
  leader, follower = pty.openpty()
  with os.fdopen(follower, "rb") as terminal:
    assert translate_lib.buffer_size(c, terminal) == 1
  os.close(leader)
  assert translate_lib.buffer_size(c, io.BytesIO(b"jump\n")) == 4
  c.eval.buffer_size = 2
  assert translate_lib.buffer_size(c, io.BytesIO(b"jump\n")) == 2
  c.eval.buffer_size = 0


def test_translate_reads_bytes_that_are_not_utf8_with_replacement_characters(model):
  c, model_config, params, tokenizer = model
  c.eval.batch_size = 4
  raw = [b"\xef\xbb\xbfjump twice\n", b"walk l\xe4ft\n", b"run\r\n", b"look \xff\xfe\n"]
  out, err = io.StringIO(), io.StringIO()
  assert translate_lib.write_translations(params, model_config, c, tokenizer, raw, out, err) == 4
  decoded = ["jump twice", "walk l\ufffdft", "run", "look \ufffd\ufffd"]
  expected = [text for text, _ in translations(model, decoded, 4)]
  assert out.getvalue().split("\n") == expected + [""]  # nothing lost, the batch included
  assert err.getvalue().splitlines() == [
      "warning: 2 of 4 source lines (line 2, 4) were not UTF-8; their undecodable bytes were "
      "read as U+FFFD"]
  # A text stream decoded with surrogateescape (a POSIX locale) gives the same lines.
  escaped = [line.decode("utf-8", "surrogateescape") for line in raw]
  assert list(translate_lib.DecodedLines(escaped)) == [t + e for t, e in zip(
      decoded, ["\n", "\n", "\r\n", "\n"])]


def test_decode_throughput_counts_output_tokens(model):
  c, model_config, params, tokenizer = model
  inputs, _ = translate_lib.encode_sources(tokenizer, ["jump twice", "walk left thrice"],
                                      c.data.max_source_len, 2)
  result = benchmark.decode_speed(params, model_config, c.eval, inputs,
                                      c.data.max_target_len, batch_size=4, repeats=2)
  assert result["sentences"] == 4 and len(result["pass_seconds"]) == 2
  batch = np.resize(inputs, (4, inputs.shape[1]))  # the rows decode_throughput decodes
  expected = np.asarray(search.decode_batch(params, model_config, c.eval, batch,
                                              c.data.max_target_len))
  assert result["tokens"] == (expected != 0).sum() > 0
  assert result["tokens_per_s"] == pytest.approx(result["tokens"] / result["seconds"])


# ----------------------------------------------------------------------------- end to end

# experiments/tiny.py, trained long enough that some but not all outputs are exactly right
# (measured: 6 of the 64 at step 300, 1 at step 200; the steps are most of this test's time).
TRAIN_FLAGS = ("--config.data.batching=fixed", "--config.data.batch_size=64",
               "--config.train.steps=300", "--config.train.learning_rate=5e-3",
               "--config.train.label_smoothing=0", "--config.train.log_every=150",
               "--config.train.checkpoint_every=150")


def test_translate_reproduces_evaluate_and_averaging_reads_the_last_checkpoints(tmp_path):
  workdir = tmp_path / "run"
  # Each run is `python launch.py ...` as a user starts it, forked from one process that has
  # imported the library once (launcher.py): the imports are paid once, not four times.
  launcher = Launcher(environment(), str(tmp_path))

  def run(*flags, stdin=None):
    code, out, err = launcher.run("--config=experiments/tiny.py", f"--workdir={workdir}",
                                  *TRAIN_FLAGS, *flags, stdin=stdin)
    assert code == 0, err[-3000:]
    return out

  try:
    run("--mode=train")
    evaluated = run("--mode=evaluate")
    exported = run("--mode=export", "--split=test")
    pairs = [line.split("\t") for line in exported.splitlines()][:tiny_config().eval.max_examples]
    sources, references = zip(*pairs)
    (tmp_path / "sources.txt").write_text("\n".join(sources) + "\n")
    translated = run("--mode=translate", stdin=tmp_path / "sources.txt")
  finally:
    launcher.close()
  metrics = json.loads(evaluated.strip().splitlines()[-1])

  hypotheses = translated.split("\n")[:-1]
  assert len(hypotheses) == len(sources) == metrics["examples"]
  assert metrics["skipped_too_long"] == 0
  assert 0.0 < metrics["exact_match"] < 1.0, "want a model that is sometimes right"
  ours = text_metrics(hypotheses, references)
  assert ours["exact_match"] == metrics["exact_match"]
  assert ours["bleu"] == pytest.approx(metrics["bleu"])
  assert ours["chrf"] == pytest.approx(metrics["chrf"])
  saved = json.loads((workdir / "eval" / "300.test.greedy.limit64.json").read_text())
  assert saved["exact_match"] == metrics["exact_match"]
  assert saved["decoding"] == {"decode": "greedy", "oracle_length": False}

  # Averaging the last 2 checkpoints (150 and 300) gives the mean of their parameters.
  c = tiny_config()
  c.data.update(batching="fixed", batch_size=64)
  c.train.update(steps=300, learning_rate=5e-3, label_smoothing=0.0, log_every=150,
                 checkpoint_every=150)
  first, last = load.load_trained(c, workdir, step=150), load.load_trained(c, workdir)
  assert (first.step, last.step, last.averaged_steps) == (150, 300, ())
  c.eval.average_last = 2
  averaged = load.load_trained(c, workdir)
  assert (averaged.step, averaged.averaged_steps) == (300, (150, 300))
  jax.tree.map(lambda m, a, b: np.testing.assert_allclose(m, (a + b) / 2, rtol=1e-6, atol=1e-7),
               averaged.params, first.params, last.params)
