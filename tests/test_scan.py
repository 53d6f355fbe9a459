"""The SCAN generator against the grammar's published counts and semantics."""

import json
import re
import subprocess
import sys

import pytest

from transformer_jax import config as config_lib
from transformer_jax.core.errors import UserError
from transformer_jax.data import scan, sources

# The result-table scripts run as the docs run them: python -m benchmarks.analysis.NAME.
STRUCTURE = [sys.executable, "-m", "benchmarks.analysis.scan_structure"]
CUTOFF_TABLE = [sys.executable, "-m", "benchmarks.analysis.scan_cutoff_table"]


def test_grammar_yields_exactly_20910_distinct_commands():
  pairs = scan.all_pairs()
  assert len(pairs) == 20910
  assert len({command for command, _ in pairs}) == 20910


@pytest.mark.parametrize("command, actions", [
    ("jump", "I_JUMP"),
    ("turn left", "I_TURN_LEFT"),
    ("jump twice after walk left", "I_TURN_LEFT I_WALK I_JUMP I_JUMP"),  # the paper's example
    ("run opposite right", "I_TURN_RIGHT I_TURN_RIGHT I_RUN"),
    ("turn around left", " ".join(["I_TURN_LEFT"] * 4)),
    ("look around right thrice", " ".join(["I_TURN_RIGHT I_LOOK"] * 12)),
    ("walk and turn opposite left", "I_WALK I_TURN_LEFT I_TURN_LEFT"),
])
def test_interpretation(command, actions):
  assert dict(scan.all_pairs())[command] == actions


def test_repetitions_account_for_every_action_of_every_command():
  """Each S's chunk x times, summed, is the length of the grammar's own output, for all 20,910
  commands; and the examples read as the grammar says."""
  for command, actions in scan.all_pairs():
    assert sum(chunk * times for chunk, times in scan.repetitions(command)) == \
        len(actions.split()), command
  assert scan.repetitions("jump around left thrice") == [(8, 3)]
  assert scan.repetitions("turn around left thrice after run twice") == [(4, 3), (1, 2)]
  assert scan.repetitions("walk opposite right and look left") == [(3, 1), (2, 1)]
  with pytest.raises(ValueError, match="not a SCAN command"):
    scan.repetitions("jump twice twice")


def test_the_length_split_tests_a_repetition_train_never_shows():
  """What docs/benchmarks.md says of the length split: 8 actions three times (24, past 22) is
  in no train command and in most test commands; a command counts once per kind."""
  train = scan.repetition_counts(scan.load("length", "train"))
  test_pairs = scan.load("length", "test")
  test = scan.repetition_counts(test_pairs)
  assert (8, 3) not in train and (8, 2) in train
  assert test[(8, 3)] == sum((8, 3) in scan.repetitions(c) for c, _ in test_pairs) > 3920 // 2
  assert scan.repetition_counts([("jump around left thrice and walk around right thrice", "")]) \
      == {(8, 3): 1}


def test_the_length_test_falls_into_776_trained_and_3144_unseen_repetition_counts():
  """repetition_groups: what issue 29 measured in the published files; training on the 90% of
  a cutoff re-split from 24 on leaves no test command with an unseen count."""
  commands = [c for c, _ in scan.load("length", "test")]
  groups = scan.repetition_groups(commands, "length")
  assert (groups.count(scan.TRAINED), groups.count(scan.UNSEEN)) == (776, 3144)
  assert [c for c, g in zip(commands, groups) if g == scan.UNSEEN] == [
      c for c in commands if (8, 3) in scan.repetitions(c)]
  cut = [c for c, _ in scan.load("length_cutoff_24", "test")]
  assert set(scan.repetition_groups(cut, "length_cutoff_24", "train_without_dev")) == {
      scan.TRAINED}


def test_structure_table_prints_the_counts_of_each_part():
  """benchmarks/analysis/scan_structure.py, as docs/benchmarks.md runs it: one row per
  (chunk, times), one column per part, the counts of `repetition_counts`."""
  out = subprocess.run([*STRUCTURE, "--dev_cutoff=16"],
                       check=True, capture_output=True, text=True).stdout
  rows = {line.split(" | ")[0].strip("| "): line for line in out.splitlines()
          if line.startswith("| ") and " x " in line.split(" | ")[0]}
  counts = [scan.repetition_counts(scan.load("length", part, 16))
            for part in ["train", "train_without_dev", "dev", "test"]]
  for (chunk, times) in [(8, 3), (8, 2), (1, 1)]:
    cells = [c.strip() for c in rows[f"{chunk} x {times}"].strip("|").split("|")]
    expected = [part.get((chunk, times), 0) for part in counts]
    assert cells[1] == str(chunk * times)
    assert [int(c.replace(",", "")) for c in cells[2:]] == expected


def test_kinds_of_command_name_the_repeated_8_action_chunks():
  """benchmarks/analysis/scan_structure.py's rows of exact match by kind: each command gets one
  kind."""
  from benchmarks.analysis import scan_structure as structure
  assert structure.kind("jump around left thrice") == "8x3"
  assert structure.kind("jump twice after look around right thrice") == "8x3 + short"
  assert structure.kind("walk around left and run around right twice") == "8x2 + 8x1"
  assert structure.kind("turn around left thrice and jump") == "short"
  kinds = [structure.kind(command) for command, _ in scan.load("length", "test")]
  assert sum("8x3" in k for k in kinds) == scan.repetition_counts(
      scan.load("length", "test"))[(8, 3)]


def test_length_split_follows_the_22_action_rule():
  pairs = scan.all_pairs()
  expected_train = sum(len(a.split()) <= 22 for _, a in pairs)
  train, test = scan.load("length", "train"), scan.load("length", "test")
  assert len(train) == expected_train and len(test) == len(pairs) - expected_train
  assert (len(train), len(test)) == (16990, 3920)  # the sizes Lake & Baroni report
  assert max(len(a.split()) for _, a in train) == 22
  assert min(len(a.split()) for _, a in test) == 24


def test_length_split_dev_is_the_longest_train_outputs_held_out():
  train = scan.load("length", "train")
  dev, rest = scan.load("length", "dev"), scan.load("length", "train_without_dev")
  assert (len(dev), len(rest)) == (576, 16414)
  assert sorted(dev + rest) == sorted(train) and not set(dev) & set(rest)
  assert {len(a.split()) for _, a in dev} == {22} and max(len(a.split()) for _, a in rest) == 21


@pytest.mark.parametrize("cutoff", [16, 12])
def test_length_split_dev_cutoff_partitions_the_train_split_only(cutoff):
  """dev and train_without_dev are drawn from the train split only, disjoint, and together all
  of it; the cut falls at data.scan_dev_cutoff, through the config as through scan.load."""
  c = config_lib.default_config()
  c.data.update(scan_split="length", scan_dev_cutoff=cutoff)
  train, test = set(scan.load("length", "train")), set(scan.load("length", "test"))
  dev, rest = sources.load_split(c.data, "dev"), sources.load_split(c.data, "train_without_dev")
  assert set(dev) <= train and set(rest) <= train and not (set(dev) | set(rest)) & test
  assert not set(dev) & set(rest) and len(dev) + len(rest) == len(train)
  assert max(len(a.split()) for _, a in rest) == cutoff
  assert min(len(a.split()) for _, a in dev) == cutoff + 1
  assert max(len(a.split()) for _, a in dev) == 22
  if cutoff == 16:
    assert (len(dev), len(rest)) == (2848, 14142)  # as the scan_length recipe says
  assert sources.split_key(c.data, "dev") != sources.split_key(
      config_lib.default_config().data, "dev")  # a cached dev of another cutoff is not reused
  assert "scan_dev_cutoff" not in sources.split_key(c.data, "train")  # train's cache stays


# Test commands of each cutoff re-split (outputs of more than C actions), counted in the
# published tasks.txt of Lake & Baroni's repository (2026-11-27); 22 is the length split.
PUBLISHED_TEST_COUNTS = {22: 3920, 24: 3584, 25: 3136, 26: 2624, 27: 2176, 28: 1728, 30: 1152,
                         32: 704, 33: 448, 36: 384, 40: 128}


def grammar_length_counts() -> dict:
  """Commands by output length, from the grammar's rules alone (not from data.scan): a
  generating polynomial {actions: count}. V: U (4 verbs, 1 action); U D or turn D (8 of 2
  actions, 2 of 1); opposite (8 of 3, 2 of 2); around (8 of 8, 2 of 4). S: V once, twice or
  thrice; C: S, or S and/after S (two orders of two S each)."""
  def times(p, q):
    out = {}
    for a, m in p.items():
      for b, n in q.items():
        out[a + b] = out.get(a + b, 0) + m * n
    return out
  v = {1: 4 + 2, 2: 8 + 2, 3: 8, 4: 2, 8: 8}
  s = {}
  for k in (1, 2, 3):
    for n, count in v.items():
      s[k * n] = s.get(k * n, 0) + count
  c = dict(s)
  for n, count in times(s, s).items():
    c[n] = c.get(n, 0) + 2 * count
  return c


@pytest.mark.parametrize("cutoff", sorted(PUBLISHED_TEST_COUNTS))
def test_cutoff_resplit_counts_match_the_grammar_and_the_published_file(cutoff):
  """length_cutoff_C: train = outputs of at most C actions, test = the longer, disjoint and
  together all 20,910; the counts as the grammar's own polynomial and the published file have
  them; dev a fixed 10% of train, train_without_dev the rest."""
  split = f"length_cutoff_{cutoff}"
  train, test = scan.load(split, "train"), scan.load(split, "test")
  by_length = grammar_length_counts()
  assert len(test) == PUBLISHED_TEST_COUNTS[cutoff] == sum(
      n for length, n in by_length.items() if length > cutoff)
  assert len(train) + len(test) == sum(by_length.values()) == 20910
  assert not set(train) & set(test)
  assert max(len(a.split()) for _, a in train) <= cutoff < min(len(a.split()) for _, a in test)
  dev, rest = scan.load(split, "dev"), scan.load(split, "train_without_dev")
  assert len(dev) == int(0.1 * len(train)) and len(rest) == len(train) - len(dev)
  assert sorted(dev + rest) == train and not set(dev) & set(rest)


def test_cutoff_resplits_are_deterministic_and_22_is_the_length_split():
  assert scan.load("length_cutoff_26", "dev") == scan.load("length_cutoff_26", "dev")
  assert len(scan.load("length_cutoff_26", "test")) == 2624  # as issue 41 and Csordas et al.
  for part in ("train", "test"):
    assert scan.load("length_cutoff_22", part) == scan.load("length", part)
  c = config_lib.default_config()
  c.data.scan_split = "length_cutoff_26"
  config_lib.validate(c)
  assert sources.load_split(c.data, "dev") == scan.load("length_cutoff_26", "dev")
  assert sources.split_key(c.data, "dev") != sources.split_key(
      config_lib.default_config().data, "dev")  # each cutoff caches its own parts
  classes = dict(scan.lengths_classified("length_cutoff_26", "test"))
  assert set(classes.values()) == {"long"}  # "long" means past the split's own cutoff


@pytest.mark.parametrize("split, message", [
    ("length_cutoff_48", "in [1, 47]"), ("length_cutoff_0", "in [1, 47]"),
    ("length_cutoff_x", "whole number"), ("length_cutoff_-3", "whole number"),
    ("lenght", "unknown SCAN split"), ("length_cutoff_", "whole number")])
def test_a_bad_scan_split_is_a_user_error(split, message):
  c = config_lib.default_config()
  c.data.scan_split = split
  with pytest.raises(UserError, match=f"data.scan_split: .*{re.escape(message)}"):
    config_lib.validate(c)
  with pytest.raises(UserError, match=re.escape(message)):
    sources.load_split(c.data, "train")


def test_a_dev_cutoff_out_of_range_is_a_user_error():
  c = config_lib.default_config()
  c.data.scan_dev_cutoff = 22
  with pytest.raises(UserError, match="scan_dev_cutoff"):
    config_lib.validate(c)


def test_texts_and_classes_of_the_commands():
  pairs = scan.load("simple", "test")
  texts, classes = scan.texts("simple", "test"), scan.lengths_classified("simple", "test")
  assert len(texts) == len(classes) == len(pairs)
  assert texts[0] == (f"{pairs[0][0]} {pairs[0][1]}", "")
  long = {c for c, label in classes if label == "long"}
  assert long == {c for c, a in pairs if len(a.split()) > 22} and 0 < len(long) < len(pairs)


def test_simple_split_is_a_fixed_80_20_partition():
  train, test = scan.load("simple", "train"), scan.load("simple", "test")
  assert (len(train), len(test)) == (16728, 4182)
  assert not set(train) & set(test)
  assert set(train) | set(test) == set(scan.all_pairs())
  assert scan.load("simple", "train") == train  # deterministic


def test_export_mode_writes_tab_separated_pairs():
  out = subprocess.run([sys.executable, "launch.py", "--config=experiments/scan_length.py",
                        "--mode=export", "--split=test"], capture_output=True, text=True,
                       check=True).stdout.splitlines()
  assert len(out) == 3920
  assert all(len(line.split("\t")) == 2 for line in out)
  assert [tuple(line.split("\t")) for line in out] == scan.load("length", "test")


def test_cutoff_table_gives_median_min_max_over_seeds_of_each_cutoff_and_option(tmp_path):
  """benchmarks/analysis/scan_cutoff_table.py over run directories as training leaves them
  (config.json, eval/STEPS.test.greedy.json): one row per (cutoff, option), unscored runs
  counted apart."""
  def run(name, split, arch, positional, seed, exact=None, oracle=None, more="sweep", **model):
    c = config_lib.default_config()
    c.data.scan_split, c.model.arch, c.model.positional, c.seed = split, arch, positional, seed
    c.model.dropout_rate = 0.0
    c.model.update(model)
    workdir = tmp_path / more / name
    (workdir / "eval").mkdir(parents=True)
    (workdir / "config.json").write_text(c.to_json_best_effort())
    if exact is not None:
      (workdir / "eval" / f"{c.train.steps}.test.greedy.json").write_text(json.dumps({
          "exact_match": exact, "oracle_exact_match": oracle, "errors": {"standard": {
              "stopped_early": seed + 1, "ran_on": 2, "wrong_token": 10 * seed}}}))
  for seed, exact in enumerate([0.5, 0.9, 0.7]):
    run(f"a{seed}", "length_cutoff_26", "decoder_only", "relative_bias", seed, exact, exact + 0.05)
  run("b0", "length_cutoff_24", "encoder_decoder", "sinusoidal", 0, 0.125, 0.25)
  run("b1", "length_cutoff_24", "encoder_decoder", "sinusoidal", 1)  # not finished
  run("c0", "length", "encoder_decoder", "sinusoidal", 0, 0.5, 0.5)  # not a re-split
  out = subprocess.run([*CUTOFF_TABLE, str(tmp_path / "sweep")],
                       check=True, capture_output=True, text=True).stdout.splitlines()
  rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in out[2:]]
  assert rows == [
      ["24", "encoder-decoder, sinusoidal (the paper's)", "1/2", "12.50% [12.50, 12.50]",
       "0: 12.50", "25.00% [25.00, 25.00]", "1 / 2 / 0", "12%"],
      ["26", "decoder-only, relative bias 32/128", "3/3", "70.00% [50.00, 90.00]",
       "0: 50.00 / 1: 90.00 / 2: 70.00", "75.00% [55.00, 95.00]", "6 / 6 / 30", "61%"]]
  # Beside them, a run with shared layers, one of other steps, and one of other sizes and
  # optimizer settings: rows of their own; a setting is named where it differs from the one most
  # runs of the architecture have (the recipe's), and on every run where none has the most.
  run("d0", "length_cutoff_26", "decoder_only", "relative_bias", 0, 0.25, 0.5, more="more",
      share_layers=True)
  c = config_lib.default_config()
  c.data.scan_split, c.train.steps = "length_cutoff_26", 2000
  (tmp_path / "more" / "e0").mkdir()
  (tmp_path / "more" / "e0" / "config.json").write_text(c.to_json_best_effort())
  c = config_lib.default_config()
  c.data.scan_split, c.model.arch, c.model.positional = "length_cutoff_27", "decoder_only", "none"
  c.model.num_heads, c.train.schedule, c.train.learning_rate = 2, "constant", 1e-3
  c.data.batching, c.data.batch_size, c.model.embed_scale = "fixed", 256, False
  (tmp_path / "more" / "f0").mkdir()
  (tmp_path / "more" / "f0" / "config.json").write_text(c.to_json_best_effort())
  out = subprocess.run([*CUTOFF_TABLE, str(tmp_path / "sweep"),
                        str(tmp_path / "more")], check=True, capture_output=True,
                       text=True).stdout.splitlines()
  assert [[cell.strip() for cell in line.strip("|").split("|")][:3] for line in out[2:]] == [
      ["24", "encoder-decoder, sinusoidal (the paper's)", "1/2"],
      ["26", "decoder-only, relative bias 32/128", "3/3"],
      ["26", "decoder-only, relative bias 32/128, shared layers", "1/1"],
      ["26", "encoder-decoder, sinusoidal (the paper's), dropout 0.1, 2,000 steps", "0/1"],
      ["27", "decoder-only, none, dropout 0.1, 2 heads, batches of 256 rows, constant learning "
       "rate 0.001, embeddings unscaled, tied", "0/1"]]
  c.data.scan_split = "length_cutoff_26"  # as many runs of 1,000 as of 2,000 steps: both named
  (tmp_path / "more" / "g0").mkdir()
  (tmp_path / "more" / "g0" / "config.json").write_text(c.to_json_best_effort())
  e = config_lib.default_config()
  e.data.scan_split, e.train.steps = "length_cutoff_24", 2000
  (tmp_path / "more" / "g1").mkdir()
  (tmp_path / "more" / "g1" / "config.json").write_text(e.to_json_best_effort())
  out = subprocess.run([*CUTOFF_TABLE, str(tmp_path / "sweep"),
                        str(tmp_path / "more")], check=True, capture_output=True,
                       text=True).stdout.splitlines()
  assert [[cell.strip() for cell in line.strip("|").split("|")][1] for line in out[2:]][:2] == [
      "encoder-decoder, sinusoidal (the paper's), 1,000 steps",
      "encoder-decoder, sinusoidal (the paper's), dropout 0.1, 2,000 steps"]
  empty = subprocess.run([*CUTOFF_TABLE, str(tmp_path / "no")],
                         capture_output=True, text=True)
  assert empty.returncode == 2 and empty.stderr.startswith("error: no run")


def test_cutoff_table_gives_a_length_head_run_a_row_for_each_decoding(tmp_path):
  """A run with model.length_head decoded at the head's length during training
  (STEPS.test.greedy-lengthhead.json), and one of two seeds evaluated again with its own EOS
  (STEPS.test.greedy.json), the other within 2 tokens of the head's length
  (STEPS.test.greedy-lengthhead-slack2.json): a row for each decoding, the head's exact lengths
  in a last column."""
  for seed, (at_length, own, share) in enumerate([(0.75, 0.5, 0.875), (0.25, None, 0.5)]):
    c = config_lib.default_config()
    c.data.scan_split, c.seed = "length_cutoff_27", seed
    c.model.update(positional="relative_xl", length_head=True)
    c.eval.length_head = True
    workdir = tmp_path / f"h{seed}"
    (workdir / "eval").mkdir(parents=True)
    (workdir / "config.json").write_text(c.to_json_best_effort())
    for decoding, exact in (("greedy-lengthhead", at_length), ("greedy", own),
                            ("greedy-lengthhead-slack2", 0.625 if seed else None),
                            ("beam4-lp0.6", 0.0)):  # not a decoding of the table's
      if exact is not None:
        (workdir / "eval" / f"{c.train.steps}.test.{decoding}.json").write_text(json.dumps({
            "exact_match": exact, "oracle_exact_match": 0.9, "length_head_accuracy": share}))
  # A third run whose head read the encoder through a stop-gradient: a row of its own.
  c.model.length_head_stop_gradient, c.seed = True, 0
  (tmp_path / "h2" / "eval").mkdir(parents=True)
  (tmp_path / "h2" / "config.json").write_text(c.to_json_best_effort())
  (tmp_path / "h2" / "eval" / f"{c.train.steps}.test.greedy-lengthhead.json").write_text(
      json.dumps({"exact_match": 1.0, "oracle_exact_match": 1.0, "length_head_accuracy": 1.0}))
  out = subprocess.run([*CUTOFF_TABLE, str(tmp_path)],
                       check=True, capture_output=True, text=True).stdout.splitlines()
  assert out[0].endswith("| length head: exact lengths, median [min, max] |")
  rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in out[2:]]
  assert [(r[1], r[2], r[3], r[-1]) for r in rows] == [
      ("encoder-decoder, relative xl, length head (stop-gradient), dropout 0.1, decoded at its "
       "length", "1/1", "100.00% [100.00, 100.00]", "100.00% [100.00, 100.00]"),
      ("encoder-decoder, relative xl, length head, dropout 0.1, decoded at its length", "2/2",
       "50.00% [25.00, 75.00]", "68.75% [50.00, 87.50]"),
      ("encoder-decoder, relative xl, length head, dropout 0.1, decoded to its own EOS", "1/1",
       "50.00% [50.00, 50.00]", "87.50% [87.50, 87.50]"),
      ("encoder-decoder, relative xl, length head, dropout 0.1, decoded to its own EOS within 2 "
       "of its length", "1/1", "62.50% [62.50, 62.50]", "50.00% [50.00, 50.00]")]


def test_cutoff_recipe_options_are_valid_configs_and_its_docstring_runs_csordas_settings():
  """Every option of experiments/scan_cutoff.py's get_sweep() is a config the sweep accepts
  (parsed as its command line, then validated); the trial numbers the docs give; the
  docstring's one-run command of Csordas et al.'s settings gives the config CSORDAS does."""
  from transformer_jax.experiments import scan_cutoff
  from transformer_jax.tools.sweep import space
  path = scan_cutoff.__file__
  sweep = scan_cutoff.get_sweep()
  for option in sweep:
    config_lib.validate(space.trial_config(
        path, {k: v for k, v in option.items() if k != "seeds"}, {}))
  # The trial numbers the docs give: 3k, 3k+1, 3k+2, 21+k, 28+k, 35+k and 42+k at cutoff
  # CUTOFFS[k].
  assert len(sweep) == 7 * len(scan_cutoff.CUTOFFS) == 49
  for k, cutoff in enumerate(scan_cutoff.CUTOFFS):
    for trial, option in ((3 * k, scan_cutoff.CHOSEN), (3 * k + 1, {}),
                          (3 * k + 2, scan_cutoff.RELATIVE_XL), (21 + k, scan_cutoff.CSORDAS),
                          (28 + k, scan_cutoff.LENGTH_HEAD), (35 + k, scan_cutoff.GEOMETRIC),
                          (42 + k, scan_cutoff.GEOMETRIC_HEAD)):
      assert sweep[trial] == {"data.scan_split": f"length_cutoff_{cutoff}", **option,
                              "seeds": scan_cutoff.SEEDS}
  command = scan_cutoff.__doc__[scan_cutoff.__doc__.index("--workdir=runs/cutoff27_cs"):]
  flags = dict(flag.split("=") for flag in re.findall(r"--config\.(\S+)", command))
  assert space.trial_config(path, flags, {}).to_dict() == space.trial_config(
      path, {**scan_cutoff.CSORDAS, "data.scan_split": "length_cutoff_27"}, {}).to_dict()
