"""Bad input is answered in one line `error: ...` with exit code 2, no traceback, and leaves an
existing workdir exactly as it was.

Each row runs launch.py as a user does (forked from a process that has done the imports, see
launcher.py). The workdir of most rows already holds a run: a tokenizer and a checkpoint written
by checkpoint.Manager for the tiny config.
"""

import collections
import json
import os
import pickle
import shutil
import socket
import tempfile

import jax.numpy as jnp
import pytest
from hf.files import gpt2_files
from launcher import Launcher, environment

import transformer_jax
from transformer_jax import cli
from transformer_jax.core import lock
from transformer_jax.core.errors import UserError
from transformer_jax.data import scan
from transformer_jax.data import tokenizer as tokenizer_lib
from transformer_jax.experiments import tiny
from transformer_jax.train import checkpoint

NOBODY = 65534  # runs the unwritable-workdir row when the tests run as root


@pytest.fixture(scope="module")
def launcher(tmp_path_factory):
  server = Launcher(environment(), str(tmp_path_factory.mktemp("launches")))
  yield server
  server.close()


def _made(directory):
  directory.mkdir()
  return directory


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
  (workdir / "metrics.jsonl").write_text('{"split": "train", "step": 10, "loss": 1.0}\n')
  other_tokenizer = root / "other.model"
  other_tokenizer.write_bytes(tokenizer_lib.train(["jump left", "walk right twice"] * 50, 32,
                                                  "word").model_proto)

  def variant(name, change):
    """A copy of the trained workdir with one thing wrong."""
    copy = root / name
    shutil.copytree(workdir, copy)
    change(copy)
    return copy

  swapped = variant("swapped", lambda w: shutil.copy(other_tokenizer, w / tokenizer_lib.FILENAME))
  garbled = variant("garbled", lambda w: (w / tokenizer_lib.FILENAME).write_bytes(b"\x07" * 999))
  checkpoints_file = variant("checkpoints_file", lambda w: (
      shutil.rmtree(w / "checkpoints"), (w / "checkpoints").write_text("")))
  metrics_dir = variant("metrics_dir", lambda w: (
      os.remove(w / "metrics.jsonl"), (w / "metrics.jsonl").mkdir()))
  plots_file = variant("plots_file", lambda w: (w / "plots").write_text(""))
  locked = variant("locked", lambda w: None)
  configured = variant("configured", lambda w: (w / "config.json").write_text(
      config.to_json_best_effort()))  # as training writes it: --config may be left out
  edited = variant("edited", lambda w: (w / "config.json").write_text(
      config.to_json_best_effort().replace('"d_model": 32', '"d_model": 64')))  # by hand
  holder = lock.DirectoryLock(str(locked))  # another run, alive: this test process
  holder.acquire()

  configs = root / "configs"  # experiment files as a user's mistakes make them
  configs.mkdir()
  for name, text in CONFIG_FILES.items():
    (configs / name).write_text(text)
  tokenizers = root / "tokenizers"
  tokenizers.mkdir()
  (tokenizers / "empty.model").write_bytes(b"")
  (tokenizers / "garbage.model").write_bytes(bytes(range(256)) * 4)

  def data_dir(name, files, special=None):
    """A data directory; `special(path)` makes its train.de (a FIFO, a directory, a link)."""
    directory = root / name
    directory.mkdir()
    for filename, content in files.items():
      (directory / filename).write_bytes(content)
    if special:
      special(str(directory / "train.de"))
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
      "pid": os.getpid(),
      "host": socket.gethostname(),
      "root": root,
      "configs": configs,
      "tokenizers": tokenizers,
      "swapped": swapped,
      "garbled": garbled,
      "checkpoints_file": checkpoints_file,
      "metrics_dir": metrics_dir,
      "plots_file": plots_file,
      "locked": locked,
      "configured": configured,
      "edited": edited,
      "fifo": data_dir("fifo", {"train.en": good, **test}, special=os.mkfifo),
      "dir": data_dir("dir", {"train.en": good, **test}, special=os.mkdir),
      "null": data_dir("null", {"train.en": good, **test},
                       special=lambda path: os.symlink(os.devnull, path)),
      "trained": workdir,
      "fresh": root / "fresh_run",
      "empty_dir": _made(root / "empty_dir"),
      "a_file": a_file,
      "unwritable": unwritable,
      "other_tokenizer": other_tokenizer,
      "missing": data_dir("missing", {"train.en": good, **test}),
      "empty": data_dir("empty", {"train.en": good, "train.de": b"", **test}),
      "misaligned": data_dir("misaligned", {"train.en": good, "train.de": b"springen\nlaufen\n",
                                            **test}),
      "cr_only": data_dir("cr_only", {"train.en": good, "train.de": b"springen\rlaufen\rx\r",
                                      **test}),
      "latin1": data_dir("latin1", {"train.en": good, "train.de": "springen\nl\xe4ufen\nx\n"
                                    .encode("latin-1"), **test}),
      "labels_empty": data_dir("labels_empty", {"train.tsv": b"a\tb\tyes\nc\td\t\n"}),
      "labels_unknown": data_dir("labels_unknown", {
          "train.tsv": b"a\tb\tyes\nc\td\tno\ne\tf\tmaybe\n"}),
  }
  holder.release()
  shutil.rmtree(base)


TINY = ["--config=experiments/tiny.py", "--mode=train"]
TRAINED = TINY + ["--workdir={trained}"]
FRESH = TINY + ["--workdir={fresh}"]
FILES = ["--config.data.source=files"]
EVALUATE = ["--config=experiments/tiny.py", "--mode=evaluate"]
TRANSLATE = ["--config=experiments/tiny.py", "--mode=translate"]
GENERATE = ["--config=experiments/tiny.py", "--mode=generate"]
PLOT = ["--config=experiments/tiny.py", "--mode=plot"]
EXPORT = ["--config=experiments/tiny.py", "--mode=export"]
BENCHMARK = ["--config=experiments/tiny.py", "--mode=benchmark"]
SWEEP = ["--workdir={fresh}", "--sweep"]
# A tiny model whose split dimensions divide 2 (4 heads); a 4-chip slice.
COMPILE = ["--config=experiments/tiny.py", "--mode=compile", "--config.model.num_heads=4"]
SLICE = COMPILE + ["--config.compile.topology=v5e:2x2"]

def _mode(flags) -> str:
  """The mode a row runs (for COUNTS): --sweep, else --mode, else train."""
  if any(f.startswith("--sweep") for f in flags):
    return "sweep"
  return next((f.split("=")[1] for f in flags if f.startswith("--mode=")), "train")


TINY_CONFIG = "from transformer_jax.experiments.tiny import get_config  # noqa: F401\n"
CONFIG_FILES = {
    "raises.py": "raise RuntimeError('boom at import')\n",
    "raises_value_error.py": "raise ValueError('bad at import')\n",
    "no_get_config.py": "X = 1\n",
    "returns_dict.py": "def get_config():\n  return {'seed': 1}\n",
    "returns_none.py": "def get_config():\n  pass\n",
    "get_config_raises.py": "def get_config():\n  raise ValueError('bad recipe')\n",
    "lacks_keys.py": ("import ml_collections\n\ndef get_config():\n"
                      "  return ml_collections.ConfigDict({'seed': 1})\n"),
    "sweep_bad_key.py": TINY_CONFIG + ("def get_sweep():\n  return [{'train.steps': 2}, "
                                       "{'train.learnin_rate': 1e-3}]\n"),
    "sweep_bad_type.py": TINY_CONFIG + "def get_sweep():\n  return [{'train.steps': 'many'}]\n",
    "sweep_bad_value.py": TINY_CONFIG + ("def get_sweep():\n  return [{'train.steps': 2}, "
                                         "{'model.num_heads': 3}]\n"),
    "sweep_raises.py": TINY_CONFIG + "def get_sweep():\n  raise KeyError('x')\n",
    "sweep_int_key.py": TINY_CONFIG + "def get_sweep():\n  return [{1: 2}]\n",
    "sweep_nested.py": TINY_CONFIG + "def get_sweep():\n  return [{'train': {'steps': 2}}]\n",
}

# (id, flags, what the one line must say); {name} stands for paths[name].
ROWS = [
    ("unknown config key", TRAINED + ["--config.model.nope=1"], ["nope"]),
    ("misspelt config key", TRAINED + ["--config.model.nrom=pre"],
     ["unknown config key model.nrom in --config.model.nrom=pre (did you mean model.norm?)"]),
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
    ("unknown tracker", TRAINED + ["--config.train.trackers=tensorboard,neptune"],
     ["train.trackers names neptune, which is no tracker"]),
    ("unknown W&B mode", TRAINED + ["--config.train.trackers=wandb", "--config.wandb.mode=on"],
     ["wandb.mode must be one of online, offline, disabled"]),
    # The config goes to config.json and the trackers: a password in it is refused, masked.
    ("a password in a tracker's URI", TRAINED + ["--config.train.trackers=mlflow",
                                                 "--config.mlflow.tracking_uri=http://me:pw1@h:5000"],
     ["mlflow.tracking_uri holds a password or token (http://me:***@h:5000)",
      "MLFLOW_TRACKING_PASSWORD"]),
    ("max_len below the data lengths", TRAINED + ["--config.model.max_len=8"],
     ["model.max_len (8)"]),
    ("batch size vs accumulation", TRAINED + ["--config.data.batching=fixed",
                                              "--config.data.batch_size=8",
                                              "--config.train.grad_accum_steps=3"],
     ["data.batch_size (8)", "train.grad_accum_steps (3)"]),
    ("token budget below one example", TRAINED + ["--config.data.tokens_per_batch=16"],
     ["data.tokens_per_batch (16)"]),
    ("SCAN cutoff past the longest output", TRAINED + ["--config.data.scan_split=length_cutoff_48"],
     ["data.scan_split", "in [1, 47]", "length_cutoff_26"]),
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
    # --- train: flags and experiment files
    ("empty --workdir", TINY + ["--workdir="], ["--workdir is empty"]),
    ("empty --config", ["--config=", "--workdir={trained}"], ["--config is empty"]),
    ("config raises at import", ["--config={configs}/raises.py", "--workdir={trained}"],
     ["RuntimeError: boom at import"]),
    ("config raises ValueError at import", ["--config={configs}/raises_value_error.py",
                                            "--workdir={trained}"],
     ["cannot load --config: the file raised ValueError: bad at import"]),
    ("config without get_config", ["--config={configs}/no_get_config.py", "--workdir={trained}"],
     ["defines no get_config()"]),
    ("get_config returns a dict", ["--config={configs}/returns_dict.py", "--workdir={trained}"],
     ["get_config() returned dict"]),
    ("get_config returns None", ["--config={configs}/returns_none.py", "--workdir={trained}"],
     ["get_config() returned None"]),
    ("get_config raises", ["--config={configs}/get_config_raises.py", "--workdir={trained}"],
     ["get_config() raised ValueError: bad recipe"]),
    ("config without the default keys", ["--config={configs}/lacks_keys.py",
                                         "--workdir={trained}"],
     ["lacks the keys benchmark.batch_size"]),
    ("process id out of range", TRAINED + ["--coordinator_address=localhost:1234",
                                           "--num_processes=2", "--process_id=2"],
     ["--process_id must be in [0, --num_processes)"]),
    ("coordinator without a port", TRAINED + ["--coordinator_address=localhost",
                                              "--num_processes=2", "--process_id=0"],
     ["--coordinator_address must be host:port"]),
    ("--checkpoint_step with train", TRAINED + ["--checkpoint_step=10"],
     ["--checkpoint_step is for --mode=evaluate or translate or generate or plot or export_hf, "
      "not --mode=train",
      "resumes from the newest checkpoint"]),
    ("--split with train", TRAINED + ["--split=test"],
     ["--split is for --mode=evaluate or export, not --mode=train"]),
    # --- train: numbers that are not finite or out of range
    ("negative seed", TRAINED + ["--config.seed=-1"], ["seed must be in [0, 2**32)"]),
    ("seed of 2**32 (= seed 0 for PRNGKey)", TRAINED + ["--config.seed=4294967296"],
     ["seed must be in [0, 2**32)"]),
    ("learning rate nan", TRAINED + ["--config.train.learning_rate=nan"],
     ["train.learning_rate must be a finite number, got nan"]),
    ("learning rate inf", TRAINED + ["--config.train.learning_rate=inf"],
     ["train.learning_rate must be a finite number, got inf"]),
    ("adam_b1 above 1", TRAINED + ["--config.train.adam_b1=1.5"],
     ["train.adam_b1 must be in [0, 1), got 1.5"]),
    ("negative adam_b2", TRAINED + ["--config.train.adam_b2=-0.1"], ["train.adam_b2 must be in"]),
    ("adam_eps of 0", TRAINED + ["--config.train.adam_eps=0"],
     ["train.adam_eps must be positive"]),
    ("weight decay nan", TRAINED + ["--config.train.weight_decay=nan"],
     ["train.weight_decay must be a finite number"]),
    ("clipping norm inf", TRAINED + ["--config.train.grad_clip_norm=inf"],
     ["train.grad_clip_norm must be a finite number"]),
    ("layer norm eps of 0", TRAINED + ["--config.model.layer_norm_eps=0"],
     ["model.layer_norm_eps must be positive"]),
    ("position base inf", TRAINED + ["--config.model.position_base=inf"],
     ["model.position_base must be a finite number"]),
    ("steps beyond int32", TRAINED + ["--config.train.steps=2147483648"],
     ["train.steps must be below 2**31"]),
    ("top_k above the vocabulary", TRAINED + ["--config.eval.top_k=100"],
     ["eval.top_k (100) exceeds model.vocab_size (32)"]),
    ("temperature inf", TRAINED + ["--config.eval.temperature=inf"],
     ["eval.temperature must be a finite number"]),
    # --- train: tokenizer and data
    ("unknown tokenizer type", FRESH + ["--config.data.tokenizer.model_type=typo"],
     ["data.tokenizer.model_type must be one of bpe, unigram, word; got 'typo'"]),
    ("tokenizer file of garbage", FRESH + ["--config.data.tokenizer.model_path="
                                           "{tokenizers}/garbage.model"],
     ["garbage.model is not a SentencePiece model"]),
    ("empty tokenizer file", FRESH + ["--config.data.tokenizer.model_path="
                                      "{tokenizers}/empty.model"], ["empty.model is empty"]),
    ("tokenizer path a directory", FRESH + ["--config.data.tokenizer.model_path={tokenizers}"],
     ["tokenizers is a directory, not a regular file"]),
    ("word vocabulary below the words", FRESH + ["--config.model.vocab_size=10"],
     ["vocabulary of model.vocab_size=10 pieces leaves", "training words unknown",
      "raise model.vocab_size to 23"]),
    ("vocabulary below the special tokens", FRESH + ["--config.model.vocab_size=1"],
     ["model.vocab_size (1) must exceed the 4 special tokens", "raise model.vocab_size"]),
    ("data file with CR-only line endings", TRAINED + FILES + ["--config.data.path={cr_only}"],
     ["train.de ends its lines with CR alone (3 CR, 0 LF", "convert them to LF"]),
    ("data file a FIFO", TRAINED + FILES + ["--config.data.path={fifo}"],
     ["train.de is a named pipe (FIFO), not a regular file"]),
    ("data file a directory", TRAINED + FILES + ["--config.data.path={dir}"],
     ["train.de is a directory, not a regular file"]),
    ("data file a link to /dev/null", TRAINED + FILES + ["--config.data.path={null}"],
     ["train.de is a character device (it points to /dev/null)"]),
    # --- train: the workdir
    ("config.json edited off its checkpoint", ["--mode=train", "--workdir={edited}"],
     ["config.json no longer matches checkpoint step 10", "model.d_model 32 -> 64",
      "the checkpoint is the truth"]),
    ("checkpoints is a file", TINY + ["--workdir={checkpoints_file}"],
     ["checkpoints is a file, where this program keeps its directory"]),
    ("metrics.jsonl is a directory", TINY + ["--workdir={metrics_dir}"],
     ["metrics.jsonl is a directory, where this program keeps its file"]),
    ("workdir in use by another run", TINY + ["--workdir={locked}"],
     ["is in use by pid {pid} on host {host}", "use another directory"]),
    # --- evaluate
    ("evaluate: another tokenizer", EVALUATE + ["--workdir={swapped}"],
     ["was trained with another vocabulary", "swapped/tokenizer.model"]),
    ("evaluate: damaged tokenizer", EVALUATE + ["--workdir={garbled}"],
     ["tokenizer.model is not a SentencePiece model", "restore it"]),
    ("evaluate: another model", EVALUATE + ["--workdir={trained}", "--config.model.d_model=64"],
     ["does not fit this config: model.d_model 32 -> 64"]),
    ("evaluate: no such step", EVALUATE + ["--workdir={trained}", "--checkpoint_step=7"],
     ["no checkpoint at step 7", "available: [10]"]),
    ("evaluate: nothing trained", EVALUATE + ["--workdir={missing}"], ["holds no trained model"]),
    ("evaluate: a typo in --workdir", ["--mode=evaluate", "--workdir={root}/traind"],
     ["--workdir {root}/traind does not exist; did you mean {root}/trained?"]),
    ("evaluate: no such workdir, nothing near", EVALUATE + ["--workdir={fresh}"],
     ["--workdir {fresh} does not exist; give the directory of a trained run"]),
    ("evaluate: workdir is a file", EVALUATE + ["--workdir={a_file}"],
     ["a_file is a file, not a directory"]),
    ("evaluate: checkpoints is a file", EVALUATE + ["--workdir={checkpoints_file}"],
     ["checkpoints is a file, where a trained workdir keeps its directory of checkpoints"]),
    ("evaluate: config.json edited off its checkpoint", ["--mode=evaluate", "--workdir={edited}"],
     ["edited/config.json no longer matches checkpoint step 10", "model.d_model 32 -> 64",
      "the checkpoint is the truth", "undo the edit"]),
    ("evaluate: averaging more than there are", EVALUATE + ["--workdir={trained}",
                                                            "--config.eval.average_last=2"],
     ["eval.average_last=2 needs 2 checkpoints"]),
    ("evaluate: --text", EVALUATE + ["--workdir={trained}", "--text=jump"],
     ["--text is for --mode=plot, not --mode=evaluate"]),
    ("evaluate: learning rate nan", EVALUATE + ["--workdir={trained}",
                                                "--config.train.learning_rate=nan"],
     ["train.learning_rate must be a finite number"]),
    ("evaluate: no --config, no config.json", ["--mode=evaluate", "--workdir={trained}"],
     ["trained holds no config.json to take the run's config from", "--config=EXPERIMENT"]),
    ("evaluate: the workdir's config.json, a step it lacks",  # reached the checkpoints
     ["--mode=evaluate", "--workdir={configured}", "--checkpoint_step=7"],
     ["no checkpoint at step 7", "available: [10]"]),
    ("evaluate: the workdir's config.json, overridden off its model",
     ["--mode=evaluate", "--workdir={configured}", "--config.model.d_model=64"],
     ["the config given does not fit", "model.d_model 32 -> 64", "leave --config out"]),
    ("evaluate: another experiment than the workdir's", ["--config=experiments/scan_simple.py",
                                                         "--mode=evaluate",
                                                         "--workdir={configured}"],
     ["the config given does not fit", "configured (its config.json)", "model.d_model 32 ->"]),
    # --- translate
    ("translate: another tokenizer", TRANSLATE + ["--workdir={swapped}"],
     ["was trained with another vocabulary"]),
    ("translate: no such step", TRANSLATE + ["--workdir={trained}", "--checkpoint_step=3"],
     ["no checkpoint at step 3"]),
    ("translate: empty --workdir", TRANSLATE + ["--workdir="], ["--workdir is empty"]),
    ("translate: a typo in --workdir", ["--mode=translate", "--workdir={root}/trainde"],
     ["does not exist; did you mean {root}/trained?"]),
    ("translate: workdir is a file", TRANSLATE + ["--workdir={a_file}"],
     ["a_file is a file, not a directory"]),
    ("translate: checkpoints is a file", TRANSLATE + ["--workdir={checkpoints_file}"],
     ["checkpoints is a file, where a trained workdir keeps"]),
    ("translate: config.json edited off its checkpoint", ["--mode=translate",
                                                          "--workdir={edited}"],
     ["config.json no longer matches checkpoint step 10", "the checkpoint is the truth"]),
    ("translate: a language model", TRANSLATE + ["--workdir={trained}", "--config.data.task=lm",
                                                 "--config.model.arch=decoder_only"],
     ["--mode=translate needs a model trained on source -> target pairs", "data.task=lm",
      "continue text with --mode=generate"]),
    ("translate: top_k above the vocabulary", TRANSLATE + ["--workdir={trained}",
                                                         "--config.eval.decode=sample",
                                                         "--config.eval.top_k=33"],
     ["eval.top_k (33) exceeds"]),
    # --- generate
    ("generate: not a language model", GENERATE + ["--workdir={trained}"],
     ["continues text with a decoder-only language model", "--mode=translate"]),
    ("generate: empty --workdir", GENERATE + ["--workdir="], ["--workdir is empty"]),
    ("generate: a typo in --workdir", GENERATE + ["--workdir={root}/traned"],
     ["did you mean {root}/trained?"]),
    ("generate: config.json edited off its checkpoint", ["--mode=generate", "--workdir={edited}"],
     ["config.json no longer matches checkpoint step 10"]),
    # --- plot
    ("plot: nothing trained", PLOT + ["--workdir={missing}"], ["has no metrics.jsonl"]),
    ("plot: a typo in --workdir", ["--mode=plot", "--workdir={root}/trainedd"],
     ["did you mean {root}/trained?"]),
    ("plot: config.json edited off its checkpoint", ["--mode=plot", "--workdir={edited}"],
     ["config.json no longer matches checkpoint step 10"]),
    ("plot: plots is a file", PLOT + ["--workdir={plots_file}"],
     ["plots is not a directory, where plots are written"]),
    ("plot: empty --text", PLOT + ["--workdir={trained}", "--text="], ["--text is empty"]),
    ("plot: another tokenizer", PLOT + ["--workdir={swapped}", "--text=jump twice"],
     ["was trained with another vocabulary"]),
    ("plot: no such step (the pictures of another stay)", PLOT + ["--workdir={trained}",
                                                                  "--checkpoint_step=7"],
     ["no checkpoint at step 7"]),
    ("plot: another experiment than the workdir's", ["--config=experiments/scan_simple.py",
                                                     "--mode=plot", "--workdir={configured}"],
     ["the config given does not fit", "model.d_model 32 ->"]),
    # --- export
    ("export: unknown split", EXPORT + ["--split=dev"],
     ["SCAN's simple split has the parts train, test, not 'dev'"]),
    ("export: empty --split", EXPORT + ["--split="], ["--split is empty"]),
    ("export: data file a FIFO", EXPORT + FILES + ["--config.data.path={fifo}"],
     ["train.de is a named pipe"]),
    ("export: adam_eps nan", EXPORT + ["--config.train.adam_eps=nan"],
     ["train.adam_eps must be a finite number"]),
    # --- sweep
    ("sweep: unknown key in a trial", ["--config={configs}/sweep_bad_key.py", *SWEEP],
     ["trial_001 of get_sweep()", "unknown config key train.learnin_rate",
      "(did you mean train.learning_rate?)", "no trial was run"]),
    ("sweep: value of the wrong type", ["--config={configs}/sweep_bad_type.py", *SWEEP],
     ["trial_000 of get_sweep()", "--config.train.steps=many"]),
    ("sweep: impossible value", ["--config={configs}/sweep_bad_value.py", *SWEEP],
     ["trial_001 of get_sweep()", "model.num_heads (3)"]),
    ("sweep: get_sweep raises", ["--config={configs}/sweep_raises.py", *SWEEP],
     ["get_sweep() in", "raised KeyError"]),
    ("sweep: a key that is not a string", ["--config={configs}/sweep_int_key.py", *SWEEP],
     ["must return a non-empty list of dicts of dotted config keys"]),
    ("sweep: a nested dict for a trial", ["--config={configs}/sweep_nested.py", *SWEEP],
     ["trial_000 of get_sweep()", "nests a dict", "write its keys dotted: {{'train.steps': 2}}"]),
    ("sweep: no get_sweep", ["--config=experiments/scan_simple.py", *SWEEP],
     ["defines no get_sweep()"]),
    ("sweep: unknown metric", ["--config=experiments/tiny.py", *SWEEP,
                               "--config.sweep.metric=blue"],
     ["sweep.metric must be one of", "'blue'"]),
    ("sweep: a metric the task never reports", ["--config=experiments/tiny.py", *SWEEP,
                                                "--config.sweep.metric=accuracy"],
     ["sweep.metric=accuracy: the evaluation of data.task=seq2seq does not report it",
      "it reports loss, perplexity"]),
    ("sweep: a negative budget", ["--config=experiments/tiny.py", *SWEEP,
                                  "--config.sweep.budget=-1"],
     ["sweep.budget must be >= 0, got -1"]),
    ("sweep: a MySQL URL without its driver", ["--config=experiments/tiny.py", *SWEEP,
                                               "--sweep_storage=mysql://u@localhost/db"],
     ["needs a database driver that is not installed", "install that driver",
      "the sweep extra has PostgreSQL's alone"]),
    ("sweep: a pruner without evaluations", ["--config=experiments/tiny.py", *SWEEP,
                                             "--config.sweep.pruner=asha"],
     ["sweep.pruner=asha prunes at evaluations", "--config.train.eval_every=N"]),
    ("sweep: with --mode=evaluate", ["--config=experiments/tiny.py", *SWEEP, "--mode=evaluate"],
     ["--sweep trains every trial; it does not combine with --mode=evaluate"]),
    ("sweep: none at a time", ["--config=experiments/tiny.py", *SWEEP, "--sweep_parallel=0"],
     ["--sweep_parallel must be >= 1"]),
    ("sweep_results: a workdir no sweep ran in", ["--mode=sweep_results", "--workdir={fresh}"],
     ["{fresh} holds no sweep", "give the --workdir a --sweep ran in"]),
    ("sweep_results: no --workdir", ["--mode=sweep_results"],
     ["--workdir is required for --mode=sweep_results"]),
    ("sweep_results: with --config", ["--mode=sweep_results", "--workdir={fresh}",
                                      "--config=experiments/tiny.py"],
     ["--mode=sweep_results does not use --config", "rebuilt from the study"]),
    ("sweep: its storage with --mode=evaluate", ["--config=experiments/tiny.py", "--mode=evaluate",
                                                 "--workdir={fresh}", "--sweep_storage=sqlite:///x.db"],
     ["--sweep_storage is for --mode=train or plot or sweep_results, not --mode=evaluate"]),
    ("sweep: a trial number past get_sweep()", ["--config=experiments/tiny.py", *SWEEP,
                                                 "--config.sweep.trials=1,4"],
     ["sweep.trials must name trials 0..3 of get_sweep()", "got 1,4"]),
    ("sweep: a trial that is not a number", ["--config=experiments/tiny.py", *SWEEP,
                                             "--config.sweep.trials=first"],
     ["sweep.trials takes trial numbers", "got first"]),
    ("sweep: a trial named twice", ["--config=experiments/tiny.py", *SWEEP,
                                    "--config.sweep.trials=2,2"], ["names a trial twice: 2,2"]),
    ("sweep: workdir is a file", ["--config=experiments/tiny.py", "--workdir={a_file}",
                                  "--sweep"], ["a_file is a file"]),
    ("sweep: workdir in use", ["--config=experiments/tiny.py", "--workdir={locked}", "--sweep"],
     ["is in use by pid {pid}"]),
    ("sweep: base override nan", ["--config=experiments/tiny.py", *SWEEP,
                                  "--config.train.learning_rate=nan"],
     ["train.learning_rate must be a finite number"]),
    # --- benchmark
    ("benchmark: batch of 0", BENCHMARK + ["--config.benchmark.batch_size=0"],
     ["benchmark.batch_size must be positive"]),
    ("benchmark: timed steps below 0", BENCHMARK + ["--config.benchmark.steps=-1"],
     ["benchmark.steps must be >= 0 (0: compile the step, time nothing)"]),
    ("benchmark: source beyond max_len", BENCHMARK + ["--config.benchmark.source_len=1000"],
     ["benchmark.source_len (1000) must be below model.max_len (64)"]),
    ("benchmark: decode batch of 0", BENCHMARK + ["--config.benchmark.decode_batch=0"],
     ["benchmark.decode_batch must be positive"]),
    ("benchmark: negative warm-up", BENCHMARK + ["--config.benchmark.warmup=-1"],
     ["benchmark.warmup must be >= 0"]),
    ("benchmark: learning rate inf", BENCHMARK + ["--config.train.learning_rate=inf"],
     ["train.learning_rate must be a finite number"]),
    # --- compile (for a TPU slice, on this CPU machine)
    ("compile: no topology", COMPILE, ["needs --config.compile.topology", "v5e:2x4"]),
    ("compile: topology of the wrong shape", COMPILE + ["--config.compile.topology=v5e:9x9"],
     ["unknown TPU topology 'v5e:9x9'", "not divisible"]),
    ("compile: not a topology name", COMPILE + ["--config.compile.topology=banana"],
     ["unknown topology 'banana'"]),
    # issue 55: a GPU part without a description here is not called a TPU topology
    ("compile: a GPU part not described", COMPILE + ["--config.compile.topology=b200"],
     ["unknown topology 'b200': no GPU part described here (a100-80g, h100, h200",
      "and no TPU slice"]),
    ("compile: a chip without figures", COMPILE + ["--config.compile.topology=tpu7x:2x2"],
     ["no HBM and peak figures", "TPU7x"]),
    ("compile: mesh does not cover the slice", SLICE + ["--config.mesh.data=3"],
     ["3 places for 4 devices"]),
    ("compile: mesh does not divide the slice", SLICE + ["--config.mesh.fsdp=3"],
     ["do not split into groups of 3"]),
    ("compile: unknown mesh axis", SLICE + ["--config.mesh.model=2"], ["model"]),
    ("compile: does not fit", SLICE + ["--config.compile.batch_size=4000000"],
     ["does not fit TPU v5e HBM", "exceeds available HBM", "--config.mesh.fsdp"]),
    ("compile: negative batch", SLICE + ["--config.compile.batch_size=-1"],
     ["compile.batch_size must be >= 0"]),
    ("compile: decode batch of 0", SLICE + ["--config.compile.decode_batch=0"],
     ["compile.decode_batch must be positive"]),
    # --- config
    ("config: learning rate nan", ["--config=experiments/tiny.py", "--mode=config",
                                   "--config.train.learning_rate=nan"],
     ["train.learning_rate must be a finite number"]),
    ("config: a misspelt key", ["--config=experiments/tiny.py", "--mode=config",
                                "--config.model.d_modle=64"],
     ["unknown config key model.d_modle", "(did you mean model.d_model?)"]),
    # --- describe
    ("describe: position base nan", ["--config=experiments/tiny.py", "--mode=describe",
                                     "--config.model.position_base=nan"],
     ["model.position_base must be a finite number"]),
]
# --- issue 40: flags a mode does not use (cli.MODES), refusals that name the cause (a
# classifier's labels by file and line), a describing mode that reads --workdir's config.
CLASSIFY = ["--config=experiments/tiny.py", "--workdir={fresh}", *FILES,
            "--config.data.format=tsv", "--config.data.task=classify",
            "--config.model.arch=encoder_only", "--config.model.num_labels=2",
            "--config.data.text_pair=True", "--config.data.test_split="]
ROWS += [
    ("--sweep_heartbeat_s without --sweep", TRAINED + ["--sweep_heartbeat_s=5"],
     ["--sweep_heartbeat_s only applies with --sweep or --sweep_dry_run", "add --sweep"]),
    ("--sweep_heartbeat_s with evaluate", EVALUATE + ["--workdir={trained}",
                                                      "--sweep_heartbeat_s=5"],
     ["--sweep_heartbeat_s is for --mode=train, not --mode=evaluate"]),
    # The sweep's settings moved into the experiment's config: each old flag names its key.
    ("--sweep_trials, now sweep.trials", TRAINED + ["--sweep", "--sweep_trials=1"],
     ["--sweep_trials is now a key of the experiment's config, sweep.trials: give "
      "--config.sweep.trials=1"]),
    ("--sweep_seeds with evaluate, now sweep.seeds", EVALUATE + ["--workdir={trained}",
                                                                 "--sweep_seeds", "3"],
     ["--sweep_seeds is now a key", "--config.sweep.seeds=3"]),
    ("--sweep_metric, now sweep.metric", TRAINED + ["--sweep_metric=bleu"],
     ["give --config.sweep.metric=bleu (or set it in the experiment's get_config())"]),
    ("--nosweep_test_best, now sweep.test_best", TRAINED + ["--nosweep_test_best"],
     ["--sweep_test_best is now a key", "--config.sweep.test_best=False"]),
    ("--sweep_metric with sweep_results", ["--mode=sweep_results", "--workdir={fresh}",
                                            "--sweep_metric=bleu"],
     ["sweep.metric, which --mode=sweep_results does not take", "its study's own sweep.metric"]),
    ("--sweep_parallel with plot", PLOT + ["--workdir={trained}", "--sweep_parallel=2"],
     ["--sweep_parallel is for --mode=train, not --mode=plot"]),
    ("--workdir with benchmark", BENCHMARK + ["--workdir={trained}"],
     ["--mode=benchmark does not use --workdir", "leave it out"]),
    ("--num_processes with describe", ["--config=experiments/tiny.py", "--mode=describe",
                                       "--num_processes=2"],
     ["--num_processes is for --mode=train or evaluate", "not --mode=describe"]),
    ("--checkpoint_step with export", EXPORT + ["--checkpoint_step=10"],
     ["--checkpoint_step is for --mode=", "export_hf, not --mode=export"]),
    ("--keep_host_memory with export_hf", ["--mode=export_hf", "--workdir={trained}",
                                            "--hf_dir={fresh}", "--keep_host_memory=true"],
     ["--mode=export_hf does not use --keep_host_memory"]),
    ("describe: a --workdir without config.json", ["--mode=describe", "--workdir={root}"],
     ["{root} holds no config.json to take the run's config from"]),
    ("config: a --workdir that is a file", ["--mode=config", "--workdir={a_file}"],
     ["a_file is a file, not a directory; give the directory of a trained run"]),
    ("classify: an empty label", CLASSIFY + ["--config.data.path={labels_empty}"],
     ["labels_empty/train.tsv line 2 has an empty label", "give every example its class"]),
    ("classify: an unknown label", CLASSIFY + ["--config.data.path={labels_unknown}",
                                               "--config.data.labels=yes,no"],
     ["labels_unknown/train.tsv line 3 has the label 'maybe'", "data.labels"]),
    ("classify: more classes than the head", CLASSIFY + ["--config.data.path={labels_unknown}"],
     ["has 3 classes ('maybe', 'no', 'yes') but model.num_labels is 2",
      "--config.model.num_labels=3"]),
]
COUNTS = collections.Counter(_mode(row[1]) for row in ROWS)


# --- Hugging Face model directories (tools/hf): --mode=import_hf / export_hf. Each {hf_*}
# directory is a tiny GPT-2 (written with safetensors and tokenizers, no torch) with one thing
# wrong; the import's --workdir={fresh} must stay absent.
IMPORT_HF = ["--mode=import_hf", "--workdir={fresh}"]
HF_ROWS = [
    ("import_hf: no --hf_dir", ["--mode=import_hf", "--workdir={fresh}"],
     ["--hf_dir is required for --mode=import_hf"]),
    ("import_hf: not a directory", IMPORT_HF + ["--hf_dir={a_file}"], ["is not a directory"]),
    ("import_hf: no config.json", IMPORT_HF + ["--hf_dir={hf_no_config}"],
     ["hf_no_config holds no config.json"]),
    ("import_hf: no weights", IMPORT_HF + ["--hf_dir={hf_no_weights}"],
     ["hf_no_weights holds no weights", "model.safetensors"]),
    ("import_hf: unsupported model_type", IMPORT_HF + ["--hf_dir={hf_model_type}"],
     ["model_type 'mamba'", "supported: gpt2, bert"]),
    ("import_hf: unknown activation", IMPORT_HF + ["--hf_dir={hf_activation}"],
     ["activation_function='swoosh'", "model.activation cannot express"]),
    ("import_hf: a config field with no counterpart", IMPORT_HF + ["--hf_dir={hf_untied}"],
     ["tie_word_embeddings=False", "cannot be imported"]),
    ("import_hf: a Marian field we cannot map", IMPORT_HF + ["--hf_dir={hf_marian_widths}"],
     ["encoder_ffn_dim=32 but decoder_ffn_dim=16", "cannot be imported"]),
    ("import_hf: shapes disagree with the config", IMPORT_HF + ["--hf_dir={hf_shapes}"],
     ["transformer.h.0.mlp.c_fc.weight has shape (8, 24)", "gives (8, 32)"]),
    ("import_hf: a shard missing", IMPORT_HF + ["--hf_dir={hf_sharded}"],
     ["names 1 missing shard(s)", "model-00002-of-00002.safetensors"]),
    ("import_hf: a pickle that is not weights-only", IMPORT_HF + ["--hf_dir={hf_pickle}"],
     ["pytorch_model.bin is not a weights-only PyTorch file"]),
    ("import_hf: no tokenizer", IMPORT_HF + ["--hf_dir={hf_no_tokenizer}"],
     ["holds no tokenizer.json"]),
    ("import_hf: into a trained workdir", ["--mode=import_hf", "--workdir={trained}",
                                           "--hf_dir={hf_good}"],
     ["already holds a run"]),
    ("export_hf: a model no HF class expresses", ["--mode=export_hf", "--workdir={configured}",
                                                  "--hf_dir={fresh}"],
     ["no Hugging Face class", "model.arch=encoder_decoder"]),
    # issue 55: no trained run there is said, not "give --config" (which export_hf refuses)
    ("export_hf: an empty workdir", ["--mode=export_hf", "--workdir={empty_dir}",
                                     "--hf_dir={fresh}"],
     ["--workdir {empty_dir} holds no trained run (no config.json): there is no model to "
      "export"]),
    ("export_hf: no such workdir", ["--mode=export_hf", "--workdir={fresh}/none",
                                    "--hf_dir={fresh}"],
     ["--workdir {fresh}/none does not exist: there is no model to export"]),
    ("plot: --text refused on an imported GPT-2", ["--mode=plot", "--workdir={imported}",
                                                  "--text=hi", "--config.eval.max_decode_len=16"],
     ["eval.max_decode_len (16) leaves no room for --text"]),  # and no picture written first
    ("--hf_dir with train", TRAINED + ["--hf_dir={hf_good}"],
     ["--hf_dir is for --mode=import_hf or export_hf"]),
    # issue 40: the flags the Hugging Face modes do not use, and untrusted files
    ("import_hf: --config.KEY", IMPORT_HF + ["--hf_dir={hf_good}", "--config.model.d_ff=8"],
     ["--mode=import_hf does not use --config", "comes from --hf_dir"]),
    ("import_hf: --config", IMPORT_HF + ["--hf_dir={hf_good}", "--config=tiny"],
     ["--mode=import_hf does not use --config"]),
    ("export_hf: --config.KEY", ["--mode=export_hf", "--workdir={trained}", "--hf_dir={fresh}",
                                 "--config.model.d_ff=8"],
     ["--mode=export_hf does not use --config", "the workdir's own config.json"]),
    ("import_hf: --split", IMPORT_HF + ["--hf_dir={hf_good}", "--split=train"],
     ["--split is for --mode=evaluate or export, not --mode=import_hf"]),
    ("import_hf: a header of 2^62 bytes", IMPORT_HF + ["--hf_dir={hf_huge_header}"],
     ["model.safetensors does not read as safetensors", "header claims"]),
    ("import_hf: tokenizer.json of random bytes", IMPORT_HF + ["--hf_dir={hf_random_tokenizer}"],
     ["tokenizer.json is not UTF-8 text", "download the tokenizer again"]),
    ("import_hf: NaN weights", IMPORT_HF + ["--hf_dir={hf_nan}"],
     ["NaN or infinite value(s) in transformer.wte.weight"]),
    ("import_hf: a count of the wrong type", IMPORT_HF + ["--hf_dir={hf_layers_text}"],
     ["n_layer=\"one\", but model.num_decoder_layers needs an integer"]),
]
COUNTS.update(_mode(row[1]) for row in HF_ROWS)


_gpt2_files = gpt2_files  # tests/hf/files.py


@pytest.fixture(scope="module")
def hf_paths(paths):
  """The {hf_*} directories, under paths["root"] (whose snapshot shows nothing changed)."""
  pytest.importorskip("safetensors")
  pytest.importorskip("tokenizers")
  import numpy as np
  from safetensors.numpy import load_file, save_file
  root = paths["root"] / "hf"
  root.mkdir()

  def variant(name, change=None, **config):
    directory = _gpt2_files(root / name, **config)
    if change:
      change(directory)
    return directory

  def imported(directory):
    from transformer_jax.tools import hf
    hf.import_hf(str(directory), str(root / "imported"))
    return root / "imported"

  def shapes(directory):
    tensors = load_file(str(directory / "model.safetensors"))
    tensors["transformer.h.0.mlp.c_fc.weight"] = np.ones((8, 24), np.float32)
    save_file(tensors, str(directory / "model.safetensors"))

  def sharded(directory):
    tensors = load_file(str(directory / "model.safetensors"))
    os.remove(directory / "model.safetensors")
    names = sorted(tensors)
    first = "model-00001-of-00002.safetensors"
    save_file({k: tensors[k] for k in names[:5]}, str(directory / first))
    weight_map = {k: first if i < 5 else "model-00002-of-00002.safetensors"
                  for i, k in enumerate(names)}
    (directory / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": weight_map}))

  def pickle_file(directory):
    os.remove(directory / "model.safetensors")
    (directory / "pytorch_model.bin").write_bytes(pickle.dumps(print))

  def huge_header(directory):
    data = (directory / "model.safetensors").read_bytes()
    (directory / "model.safetensors").write_bytes((2**62).to_bytes(8, "little") + data[8:])

  def nan_weights(directory):
    tensors = load_file(str(directory / "model.safetensors"))
    tensors["transformer.wte.weight"][3, 1] = np.nan
    save_file(tensors, str(directory / "model.safetensors"))

  return {
      "hf_good": variant("hf_good"),
      "hf_no_config": variant("hf_no_config", lambda d: os.remove(d / "config.json")),
      "hf_no_weights": variant("hf_no_weights", lambda d: os.remove(d / "model.safetensors")),
      "hf_no_tokenizer": variant("hf_no_tokenizer", lambda d: os.remove(d / "tokenizer.json")),
      "hf_model_type": variant("hf_model_type", lambda d: (d / "config.json").write_text(
          (d / "config.json").read_text().replace('"gpt2"', '"mamba"'))),
      "hf_activation": variant("hf_activation", activation_function="swoosh"),
      "hf_untied": variant("hf_untied", tie_word_embeddings=False),
      "hf_shapes": variant("hf_shapes", shapes),
      "hf_sharded": variant("hf_sharded", sharded),
      "hf_pickle": variant("hf_pickle", pickle_file),
      "hf_huge_header": variant("hf_huge_header", huge_header),
      "hf_random_tokenizer": variant("hf_random_tokenizer", lambda d: (
          d / "tokenizer.json").write_bytes(bytes(range(128, 256)) * 8)),
      "hf_nan": variant("hf_nan", nan_weights),
      "imported": imported(variant("hf_to_import")),
      "hf_layers_text": variant("hf_layers_text", lambda d: (d / "config.json").write_text(
          (d / "config.json").read_text().replace('"n_layer": 1', '"n_layer": "one"'))),
      # A Marian whose decoder is narrower than its encoder (model.d_ff is one number for both).
      "hf_marian_widths": variant("hf_marian_widths", lambda d: (d / "config.json").write_text(
          json.dumps(dict(model_type="marian", architectures=["MarianMTModel"], vocab_size=300,
                          d_model=8, encoder_layers=1, decoder_layers=1,
                          encoder_attention_heads=2, decoder_attention_heads=2,
                          encoder_ffn_dim=32, decoder_ffn_dim=16)))),
  }


@pytest.mark.parametrize("flags,expected", [row[1:] for row in HF_ROWS],
                         ids=[row[0] for row in HF_ROWS])
def test_bad_hf_input_is_one_line_exit_2_and_changes_nothing(launcher, paths, hf_paths, flags,
                                                             expected):
  test_bad_input_is_one_line_exit_2_and_changes_nothing(launcher, {**paths, **hf_paths}, flags,
                                                        expected)


def snapshot(path):
  """A path's files and directories with their sizes and modification times (None: absent).

  Links are not followed: /dev/null, behind one of them, changes whenever anything writes to it.
  """
  if not os.path.lexists(path):
    return None
  entries = {".": os.lstat(path).st_mtime_ns}
  for root, dirs, files in os.walk(path):
    for name in dirs + files:
      stat = os.lstat(os.path.join(root, name))
      entries[os.path.relpath(os.path.join(root, name), path)] = (stat.st_size, stat.st_mtime_ns)
  return entries


@pytest.mark.parametrize("flags,expected", [row[1:] for row in ROWS], ids=[row[0] for row in ROWS])
def test_bad_input_is_one_line_exit_2_and_changes_nothing(launcher, paths, flags, expected):
  flags = [flag.format(**paths) for flag in flags]
  expected = [text.format(**paths) for text in expected]
  watched = ("root", "fresh", "unwritable")
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


def test_warmup_beyond_the_steps_is_one_warning_and_the_run_goes_on(launcher):
  """The warning, then the run's next check (a token budget too small, to end it cheaply)."""
  code, out, err = launcher.run(*TRAINED, "--config.train.warmup_steps=30",
                                "--config.data.tokens_per_batch=16")
  lines = err.strip().splitlines()
  assert code == 2 and len(lines) == 2, err
  assert lines[0].startswith("warning: train.warmup_steps (30) exceeds train.steps (20)"), err
  assert "data.tokens_per_batch (16)" in lines[1], err


def test_the_python_api_also_holds_the_checkpoint_to_be_the_truth(paths):
  with pytest.raises(UserError, match="config.json no longer matches checkpoint step 10"):
    transformer_jax.load(str(paths["edited"]))


def test_the_table_covers_every_mode():
  assert set(COUNTS) >= set(cli.MODES) | {"sweep"}, COUNTS
  assert len(ROWS) >= 60


def test_a_closed_pipe_ends_export_quietly(launcher, tmp_path):
  pipe = tmp_path / "pipe"  # a named pipe: the run's stdout, read here as `| head -1` reads it
  os.mkfifo(pipe)
  launcher.start("--config=experiments/scan_length.py", "--mode=export", "--split=train",
                 stdout=str(pipe))
  with open(pipe, "rb") as reader:
    first = reader.readline()  # then closed, like `| head -1`
  code = launcher.wait()
  with open(launcher.stderr) as f:
    err = f.read()
  assert code == 0, err
  assert first.count(b"\t") == 1 and err == ""
