"""Bad input is answered in one line `error: ...` with exit code 2, no traceback, and leaves an
existing workdir exactly as it was.

Each row runs launch.py as a user does (forked from a process that has done the imports, see
launcher.py). The workdir of most rows already holds a run: a tokenizer and a checkpoint written
by checkpoint.Manager for the tiny config.
"""

import os
import shutil
import subprocess
import sys
import tempfile

import jax.numpy as jnp
import pytest
from launcher import ROOT, Launcher, environment

from transformer_jax.data import scan
from transformer_jax.data import tokenizer as tokenizer_lib
from transformer_jax.experiments import tiny
from transformer_jax.train import checkpoint

NOBODY = 65534  # runs the unwritable-workdir row when the tests run as root


@pytest.fixture(scope="module")
def launcher(tmp_path_factory):
  server = Launcher(environment(tmp_path_factory.mktemp("jax_cache")),
                    str(tmp_path_factory.mktemp("launches")))
  yield server
  server.close()


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
  """Every path a row refers to: a trained workdir, data directories, files."""
  root = tmp_path_factory.mktemp("inputs")
  config = tiny.get_config()

  workdir = root / "trained"
  workdir.mkdir()
  pairs = scan.load("simple", "train")
  tokenizer = tokenizer_lib.train([t for p in pairs for t in p], config.model.vocab_size, "word")
  (workdir / tokenizer_lib.FILENAME).write_bytes(tokenizer.model_proto)
  manager = checkpoint.Manager(str(workdir), config, checkpoint.sha256(tokenizer.model_proto),
                               writable=True)
  manager.save(10, {"step": jnp.int32(10), "params": {"w": jnp.ones((2, 2))}})
  manager.wait()
  manager.close()
  other_tokenizer = root / "other.model"
  other_tokenizer.write_bytes(tokenizer_lib.train(["jump left", "walk right twice"] * 50, 32,
                                                  "word").model_proto)

  def data_dir(name, files):
    directory = root / name
    directory.mkdir()
    for filename, content in files.items():
      (directory / filename).write_bytes(content)
    return directory

  good = b"jump left\nwalk twice\nrun\n"
  test = {"test.en": b"jump\n", "test.de": b"springen\n"}
  a_file = root / "a_file"
  a_file.write_text("not a directory\n")
  # An existing directory that cannot be written (mkdtemp: outside pytest's private directory,
  # so that the unprivileged user of that row can reach it).
  base = tempfile.mkdtemp(prefix="unwritable")
  os.chmod(base, 0o755)
  unwritable = os.path.join(base, "run")
  os.mkdir(unwritable, 0o555)
  os.chmod(unwritable, 0o555)
  yield {
      "trained": workdir,
      "fresh": root / "fresh_run",
      "a_file": a_file,
      "unwritable": unwritable,
      "other_tokenizer": other_tokenizer,
      "missing": data_dir("missing", {"train.en": good, **test}),
      "empty": data_dir("empty", {"train.en": good, "train.de": b"", **test}),
      "misaligned": data_dir("misaligned", {"train.en": good, "train.de": b"springen\nlaufen\n",
                                            **test}),
      "latin1": data_dir("latin1", {"train.en": good, "train.de": "springen\nl\xe4ufen\nx\n"
                                    .encode("latin-1"), **test}),
  }
  shutil.rmtree(base)


TINY = ["--config=experiments/tiny.py", "--mode=train"]
TRAINED = TINY + ["--workdir={trained}"]
FILES = ["--config.data.source=files"]

# (id, flags, what the one line must say); {name} stands for paths[name].
ROWS = [
    ("unknown config key", TRAINED + ["--config.model.nope=1"], ["nope"]),
    ("int given text", TRAINED + ["--config.train.steps=ten"],
     ["--config.train.steps takes an integer", "'ten'"]),
    ("float given text", TRAINED + ["--config.train.learning_rate=fast"],
     ["--config.train.learning_rate takes a number"]),
    ("bool given text", TRAINED + ["--config.model.share_embeddings=maybe"],
     ["--config.model.share_embeddings takes true or false"]),
    ("negative steps", TRAINED + ["--config.train.steps=-5"], ["train.steps must be positive"]),
    ("d_model not divisible by heads", TRAINED + ["--config.model.num_heads=3"],
     ["model.d_model (32)", "model.num_heads (3)"]),
    ("dropout of 1", TRAINED + ["--config.model.dropout_rate=1.0"],
     ["model.dropout_rate must be in [0, 1)"]),
    ("negative attention dropout", TRAINED + ["--config.model.attention_dropout_rate=-0.1"],
     ["model.attention_dropout_rate must be in [0, 1)"]),
    ("label smoothing above 1", TRAINED + ["--config.train.label_smoothing=1.5"],
     ["train.label_smoothing"]),
    ("unknown schedule", TRAINED + ["--config.train.schedule=linear"],
     ["train.schedule must be one of", "linear"]),
    ("unknown non-finite policy", TRAINED + ["--config.train.on_nonfinite=ignore"],
     ["train.on_nonfinite must be one of", "ignore"]),
    ("negative keep_best", TRAINED + ["--config.train.keep_best=-1"], ["train.keep_best"]),
    ("max_len below the data lengths", TRAINED + ["--config.model.max_len=8"],
     ["model.max_len (8)"]),
    ("batch size vs accumulation", TRAINED + ["--config.data.batching=fixed",
                                              "--config.data.batch_size=8",
                                              "--config.train.grad_accum_steps=3"],
     ["data.batch_size (8)", "train.grad_accum_steps (3)"]),
    ("token budget below one example", TRAINED + ["--config.data.tokens_per_batch=16"],
     ["data.tokens_per_batch (16)"]),
    ("no --config", ["--mode=train", "--workdir={trained}"], ["--config is required"]),
    ("config file missing", ["--config=experiments/no_such.py", "--workdir={trained}"],
     ["no_such.py"]),
    ("unknown mode", TRAINED + ["--mode=fly"], ["--mode", "fly"]),
    ("positional argument", TRAINED + ["extra"], ["unexpected arguments extra"]),
    ("no --workdir", TINY, ["--workdir is required"]),
    ("workdir is a file", TINY + ["--workdir={a_file}"], ["a_file is a file"]),
    ("workdir inside a file", TINY + ["--workdir={a_file}/run"], ["a_file is a file"]),
    ("unwritable workdir", TINY + ["--workdir={unwritable}"], ["is not writable"]),
    ("missing data file", TINY + FILES + ["--config.data.path={missing}", "--workdir={fresh}"],
     ["train.de does not exist"]),
    ("empty data file", TRAINED + FILES + ["--config.data.path={empty}"],
     ["train.de is empty"]),
    ("misaligned parallel files", TRAINED + FILES + ["--config.data.path={misaligned}"],
     ["has 3 lines", "has 2"]),
    ("non-UTF-8 line", TRAINED + FILES + ["--config.data.path={latin1}"],
     ["train.de line 2 is not UTF-8"]),
    ("data.path not a directory", TRAINED + FILES + ["--config.data.path={a_file}"],
     ["data.path", "not a directory"]),
    ("resume with another model shape", TRAINED + ["--config.model.d_model=64",
                                                   "--config.model.d_ff=128"],
     ["checkpoint step 10 in", "does not fit this config", "model.d_ff 64 -> 128",
      "model.d_model 32 -> 64"]),
    ("resume with another vocabulary size", TRAINED + ["--config.model.vocab_size=40"],
     ["checkpoint step 10 in", "does not fit this config", "model.vocab_size 32 -> 40"]),
    ("resume with another tokenizer", TRAINED + ["--config.data.tokenizer.model_path="
                                                 "{other_tokenizer}"],
     ["data.tokenizer.model_path", "other.model", "tokenizer.model"]),
    ("resume switching clipping on", TRAINED + ["--config.train.grad_clip_norm=1.0"],
     ["train.grad_clip_norm 0.0 -> 1.0"]),
]


def snapshot(path):
  """A path's files and directories with their sizes and modification times (None: absent)."""
  if not os.path.exists(path):
    return None
  entries = {".": os.stat(path).st_mtime_ns}
  for root, dirs, files in os.walk(path):
    for name in dirs + files:
      full = os.path.join(root, name)
      entries[os.path.relpath(full, path)] = (os.stat(full).st_size, os.stat(full).st_mtime_ns)
  return entries


@pytest.mark.parametrize("flags,expected", [row[1:] for row in ROWS], ids=[row[0] for row in ROWS])
def test_bad_input_is_one_line_exit_2_and_changes_nothing(launcher, paths, flags, expected):
  flags = [flag.format(**paths) for flag in flags]
  watched = ("trained", "fresh", "a_file", "unwritable")
  before = {name: snapshot(paths[name]) for name in watched}
  user = NOBODY if any(str(paths["unwritable"]) in flag for flag in flags) else None

  code, out, err = launcher.run(*flags, user=user)
  lines = err.strip().splitlines()
  assert code == 2, (code, out, err)
  assert len(lines) == 1 and lines[0].startswith("error: "), err
  assert "Traceback" not in out + err
  for text in expected:
    assert text in lines[0], (text, lines[0])
  assert {name: snapshot(paths[name]) for name in watched} == before


def test_a_closed_pipe_ends_export_quietly():
  proc = subprocess.Popen([sys.executable, "launch.py", "--config=experiments/scan_length.py",
                           "--mode=export", "--split=train"], cwd=ROOT,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE)
  first = proc.stdout.readline()
  proc.stdout.close()  # like `| head -1`
  err = proc.stderr.read().decode()
  assert proc.wait(timeout=120) == 0, err
  assert first.count(b"\t") == 1 and err == ""
