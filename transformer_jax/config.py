"""The full experiment config with its defaults, and its validation.

Experiment files in `experiments/` start from `default_config()` and change what their recipe
needs, so every key exists in every experiment and `--config.key=value` can reach all of them.
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import json
import math
import os
import re
import tokenize

import ml_collections

from transformer_jax.core import metric_names, secrets, storage, trees
from transformer_jax.core.errors import UserError
from transformer_jax.core.tokens import UNK_ID
from transformer_jax.data import scan
from transformer_jax.data import tasks as data_tasks
from transformer_jax.model import config as model_config_lib
from transformer_jax.model.config import ModelConfig


def default_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0  # of the initialisation, dropout and data order

  # The model (model/config.py): every ModelConfig field but the per-call switches (deterministic,
  # decode).
  c.model = ml_collections.ConfigDict({
      f.name: f.default for f in dataclasses.fields(ModelConfig)
      if f.name not in ("deterministic", "decode", "vocab_size")})
  c.model.vocab_size = 37000
  c.model.dtype = "auto"  # bfloat16 on GPU/TPU, float32 on CPU

  # The device mesh (train/sharding.py): the product of its sizes is the device count, and one
  # size may be -1 for "the devices left".
  c.mesh = ml_collections.ConfigDict()
  c.mesh.data = -1  # data parallel: each device group takes its rows of the batch
  c.mesh.fsdp = 1  # fully sharded data parallel: rows, and parameters and optimizer state split
  c.mesh.tensor = 1  # tensor parallel: heads, d_ff and the vocabulary split

  c.data = ml_collections.ConfigDict()  # what is read, tokenised and batched (data/)
  # What an example is (data/tasks.py): seq2seq (source -> target) | lm (texts; decoder_only)
  # | mlm (masked texts; encoder_only) | classify (text<TAB>label; encoder_only)
  c.data.task = "seq2seq"
  c.data.source = "scan"  # scan | tfds | files
  # source=scan: the split of SCAN, simple | length | length_cutoff_C (train on the outputs of
  # at most C actions, test on the longer: Newman et al.'s and Csordas et al.'s re-splits of
  # the length split, C in [1, 47]; data/scan.py)
  c.data.scan_split = "simple"
  # scan_split=length: the parts dev / train_without_dev cut the train split (outputs of at
  # most 22 actions) here: train_without_dev = at most this many actions, dev = more (1..21).
  c.data.scan_dev_cutoff = 21
  c.data.tfds_name = ""  # source=tfds: a TFDS translation dataset, e.g. wmt14_translate/de-en
  c.data.tfds_data_dir = ""  # source=tfds: "" = $TFDS_DATA_DIR or ~/tensorflow_datasets
  c.data.tfds_download = True  # source=tfds: download and prepare the dataset if it is not there
  c.data.path = ""  # source=files: the directory (or gs://, s3:// folder) holding the split files
  c.data.text_suffix = "txt"  # source=files, format=text: the split's file is SPLIT.text_suffix
  # source=files: parallel (SPLIT.SRC + SPLIT.TGT) | tsv (SPLIT.tsv) | text (SPLIT.txt: a text
  # a line; data.text_suffix names another suffix, e.g. en for train.en)
  c.data.format = "parallel"
  c.data.source_lang = "en"  # the direction, for tfds and parallel files
  c.data.target_lang = "de"  # the language translated into
  c.data.text_field = "text"  # source=tfds, task lm / mlm / classify: the record's text field
  c.data.label_field = "label"  # source=tfds, task classify: the record's label field
  c.data.labels = ""  # task classify: the classes by id, comma-separated; "" = fixed at train start
  # task classify: rows of two texts (GLUE's sentence pairs): SPLIT.tsv lines of
  # text_a<TAB>text_b<TAB>label (or TFDS records, data.text_pair_field), read as BERT's
  # "[CLS] A [SEP] B [SEP]" with B's tokens of token type 1; pairs longer than
  # data.max_source_len are cut longest-first (as BERT's tokenizer)
  c.data.text_pair = False
  # source=tfds, data.text_pair: the record's field of text B, data.text_field's A (GLUE's
  # glue/mrpc: sentence1 and sentence2; glue/mnli: premise and hypothesis)
  c.data.text_pair_field = ""
  c.data.mask_rate = 0.15  # task mlm: share of tokens the step masks (BERT: 80% <mask>, 10% random)
  c.data.train_split = "train"  # the split trained on
  c.data.eval_split = "test"  # evaluated during and after training
  # The held-out test set (e.g. newstest2014): evaluated once, after the last step; "" = none.
  c.data.test_split = "test"
  c.data.max_source_len = 64  # longer examples are dropped (EOS included)
  c.data.max_target_len = 64  # longer examples are dropped (EOS included); lm: texts are cut
  c.data.batching = "tokens"  # tokens (length buckets under a token budget) | packed | fixed
  c.data.tokens_per_batch = 4096  # global budget per side, padding included (tokens, packed)
  c.data.bucket_width = 8  # length buckets of this width (batching=tokens)
  c.data.batch_size = 64  # global, in examples (batching=fixed)
  c.data.shuffle_buffer = 0  # examples shuffled together; 0 = full random permutation each epoch
  c.data.prefetch = 2  # batches made ahead in a background thread; 0 = on the main thread
  c.data.cache = True  # keep the tokenised train split (and its tokenizer) for later runs
  c.data.cache_dir = ""  # "" = $TRANSFORMER_JAX_CACHE or ~/.cache/transformer_jax; or gs://, s3://
  c.data.tokenizer = ml_collections.ConfigDict()  # the SentencePiece vocabulary
  c.data.tokenizer.model_type = "bpe"  # bpe | unigram | word (SentencePiece)
  c.data.tokenizer.character_coverage = 1.0  # share of characters kept; the rarest are unknown
  c.data.tokenizer.sample_size = 1_000_000  # sentences sampled to train it
  c.data.tokenizer.model_path = ""  # a pretrained SentencePiece .model instead of training one

  c.train = ml_collections.ConfigDict()  # the optimizer, schedule and loop (train/)
  c.train.steps = 1000  # optimizer steps of the whole run (a resumed run counts on)
  c.train.schedule = "rsqrt"  # rsqrt (the paper's) | constant | cosine
  c.train.learning_rate = 1.0  # rsqrt: scale on d_model^-0.5 * min(...); else the peak rate
  c.train.warmup_steps = 4000  # steps of the learning rate's rise to its peak
  c.train.adam_b1 = 0.9  # Adam's first-moment decay (the paper: 0.9)
  c.train.adam_b2 = 0.98  # Adam's second-moment decay (the paper: 0.98)
  c.train.adam_eps = 1e-9  # Adam's epsilon (the paper: 1e-9)
  c.train.weight_decay = 0.0  # decoupled weight decay (AdamW); 0 = Adam
  c.train.label_smoothing = 0.1  # share of the target's probability spread over the vocabulary
  c.train.grad_clip_norm = 0.0  # 0 = no clipping
  # model.length_head: the weight of the squared error of each example's predicted length
  # (tokens^2), summed over the examples and divided by the batch's target tokens, as the loss is.
  c.train.length_loss_weight = 0.1
  c.train.grad_accum_steps = 1  # micro-batches summed into one update (the batch split in N)
  # > 0: the output projection, log-softmax and loss (and their gradients) run over the targets
  # in chunks of this many tokens, so that no float32 [tokens, vocab] logits live in memory at
  # once (train/losses.py: chunked_loss); the same loss and gradients up to float rounding.
  # 0 = one pass over all tokens (the default).
  c.train.loss_chunk_tokens = 0
  c.train.log_every = 100  # steps between log lines (stdout, metrics.jsonl, TensorBoard)
  c.train.eval_every = 0  # 0 = evaluate only at the end
  c.train.checkpoint_every = 1000  # steps between checkpoints (and one at the last step)
  c.train.keep_checkpoints = 3  # the latest N checkpoints are kept
  c.train.keep_best = 1  # also keep the N best by train.best_metric (at eval_every steps); 0 = off
  c.train.best_metric = "loss"  # loss | perplexity (lower is better) | token_accuracy | bleu | ...
  c.train.on_nonfinite = "stop"  # NaN/inf loss or gradients: stop, keeping good checkpoints | skip
  # A workdir in a bucket: seconds its writes (checkpoints, metrics, the lease) wait out a store
  # that does not answer, retrying, while training goes on; past them the run stops in one line.
  # (The storage libraries' own retries come first: about half a minute.)
  c.train.storage_outage_s = 300.0
  # A workdir whose latest parameters start a new run (fine-tuning, e.g. a classifier from a
  # masked-LM run): those of the same name and shape are copied, and its tokenizer is used.
  c.train.init_from = ""
  # A jax.profiler trace of train steps profile_start + 1 .. profile_start + profile_steps into
  # WORKDIR/tensorboard (TensorBoard's Profile tab; Perfetto); 0 steps = off. The default start
  # leaves out step 1, whose compilation would fill the trace.
  c.train.profile_steps = 0
  c.train.profile_start = 1  # the trace starts after this step (1: leaves out step 1's compilation)
  # Where the run is logged besides metrics.jsonl, comma-separated: tensorboard | wandb | mlflow
  # (train/trackers/; wandb and mlflow need the pip extras of those names).
  c.train.trackers = "tensorboard"
  # A group of runs (a sweep's study): the W&B group (where wandb.group is empty) and the tag
  # transformer_jax.study of the MLflow run.
  c.train.tracker_group = ""
  # The run in every tracker: its name ("" = the workdir's name), tags (comma-separated) and
  # notes (W&B's name, tags and notes; MLflow's run name, a tag per tag, the run's description).
  # wandb.name, wandb.tags and mlflow.run_name win where set.
  c.train.run_name = ""  # the run's name in the trackers; "" = the workdir's name
  c.train.tags = ""  # the run's tags in the trackers, comma-separated
  c.train.notes = ""  # the run's notes (W&B) or description (MLflow)
  c.train.tracker_retry_s = 60.0  # seconds between tries of a tracker that could not be reached
  # Seconds between two sends of scalars to a tracker; what is logged in between goes in one
  # request (a request costs the training process milliseconds: trackers/base.py). 0 = each
  # log step at once.
  c.train.tracker_interval_s = 2.0

  # Weights & Biases (train.trackers=wandb): each "" leaves the setting to W&B (its WANDB_*
  # environment variables, its login).
  c.wandb = ml_collections.ConfigDict()
  c.wandb.project = ""  # "" = $WANDB_PROJECT, else W&B's default
  c.wandb.entity = ""  # the team or user; "" = $WANDB_ENTITY, else the login's
  c.wandb.group = ""  # "" = train.tracker_group, else $WANDB_RUN_GROUP
  c.wandb.tags = ""  # comma-separated; "" = $WANDB_TAGS
  c.wandb.mode = ""  # online | offline (synced later: wandb sync) | disabled; "" = $WANDB_MODE
  c.wandb.name = ""  # the run's display name; "" = the workdir's name

  # MLflow (train.trackers=mlflow).
  c.mlflow = ml_collections.ConfigDict()
  # A server (http://host:5000), a file store (file:/path) or SQLite (sqlite:///path.db);
  # "" = $MLFLOW_TRACKING_URI, else MLflow's default local store.
  c.mlflow.tracking_uri = ""
  c.mlflow.experiment = ""  # "" = $MLFLOW_EXPERIMENT_NAME, else transformer_jax
  c.mlflow.run_name = ""  # "" = the workdir's name
  c.mlflow.parent_run_id = ""  # a sweep's parent run (sweep.tracking.start_study); "" = none
  # CPU, memory, disk, network (and GPU where MLflow can read it) as system/... metrics of the
  # run, by MLflow's SystemMetricsMonitor (psutil)
  c.mlflow.system_metrics = False
  c.mlflow.system_metrics_every_s = 10.0  # seconds between two samples of the system metrics

  # The experiment's sweep (--sweep; tools/sweep): what the study optimises, how it draws and
  # stops trials. What it varies is the experiment's get_sweep() and get_search_space(); the
  # machine's own settings (its workers, the study's database) are flags. Read by --sweep only.
  c.sweep = ml_collections.ConfigDict()
  # The eval metric the study optimises, the pruner watches and the results table sorts by
  # (loss and perplexity: lower is better; one that the evaluation of data.task reports).
  c.sweep.metric = "loss"
  c.sweep.sampler = "tpe"  # draws get_search_space()'s trials: tpe | gp | cmaes | random | grid
  # Early stopping at every evaluation (train.eval_every > 0): median | asha | hyperband | none
  c.sweep.pruner = "none"
  # Trials of the study in all, get_sweep()'s included; 0 = get_sweep()'s alone (a grid: all of it)
  c.sweep.budget = 0
  # The sampler's seed: the study's first worker samples with it, the workers that join derive
  # their own from it (the i-th of --sweep_parallel: its i-th; others: with entropy).
  c.sweep.sampler_seed = 0
  # Runs of every get_sweep() trial, with seeds S, S+1, ... (S: the trial's seed), each a trial of
  # its own, the tables adding median, min and max; 0 = the trial's "seeds" entry, else one run.
  c.sweep.seeds = 0
  # get_sweep()'s trials to enqueue, by number from 0, comma-separated, in this order (e.g.
  # 5,3,0); "" = all. Trials already in the study stay.
  c.sweep.trials = ""
  # Train each trial without data.test_split, then score its checkpoint with the best
  # train.best_metric on data.test_split once (test_* columns, never used to sort).
  c.sweep.test_best = False
  c.sweep.retries = 3  # times a trial whose worker was lost (or preempted) is taken up again
  # Seconds a worker rides out a database (--sweep_storage) that stops answering mid-sweep before
  # it stops, naming its trial's checkpoint (as long as train.storage_outage_s).
  c.sweep.outage_s = 300.0

  c.eval = ml_collections.ConfigDict()  # evaluation and decoding (eval/)
  c.eval.batch_size = 256  # sentences decoded together
  c.eval.max_decode_len = 0  # output tokens decoded at most; 0 = data.max_target_len
  # --mode=translate: source lines read before translating them; 0 = 1 when stdin is a terminal
  # (each line is answered as it is typed), else eval.batch_size (files and pipes).
  c.eval.buffer_size = 0
  c.eval.decode = "greedy"  # greedy | beam | sample
  c.eval.beam_size = 4  # decode=beam: hypotheses kept at each step
  c.eval.length_penalty = 0.6  # decode=beam: GNMT alpha; 0 = rank by log-probability
  # decode=beam: gnmt: log p / ((5 + |Y|) / 6)^alpha; length: log p / |Y|^alpha (transformers')
  c.eval.length_penalty_form = "gnmt"
  # An output that reaches the decode length ends with EOS there, EOS counted as log 1
  # (transformers' forced_eos_token_id, which an imported Marian has).
  c.eval.force_eos = False
  c.eval.suppress_tokens = ()  # token ids (the workdir's) never generated; () = none
  c.eval.temperature = 1.0  # decode=sample: the logits are divided by it
  c.eval.top_k = 0  # decode=sample: sample among the k most probable tokens; 0 = all
  c.eval.max_examples = 0  # examples evaluated, the first of the split; 0 = the whole split
  c.eval.average_last = 0  # evaluate/translate with the mean of the last N checkpoints; 0 = off
  # seq2seq: decode every evaluation a second time, greedy with the reference's length (EOS
  # masked out, stopped there): oracle_exact_match and its diagnostics; costs one more decode.
  c.eval.oracle_length = False
  # model.length_head: every decode (eval.decode's search aside) is greedy with the length the
  # head predicts (rounded; EOS masked out, stopped there), as oracle-length decoding is with
  # the reference's. False: the model's own EOS decides.
  c.eval.length_head = False
  # eval.length_head: > 0 lets the model's own EOS end an output anywhere within this many
  # tokens of the predicted length (before it EOS is masked out, after it forced); 0 = exactly.
  c.eval.length_head_slack = 0

  c.compile = ml_collections.ConfigDict()  # --mode=compile (tools/compile.py)
  c.compile.topology = ""  # a TPU slice (v5e:2x4, v5p:2x2x1, v5litepod-8) or GPUs (h100, h100-8)
  c.compile.batch_size = 0  # rows of the compiled train batch; 0 = the data config's largest
  c.compile.source_len = 0  # tokens per compiled source row; 0 = data.max_source_len
  c.compile.target_len = 0  # tokens per compiled target row; 0 = data.max_target_len
  c.compile.decode_batch = 64  # rows of the compiled greedy decode step

  c.benchmark = ml_collections.ConfigDict()  # --mode=benchmark
  c.benchmark.batch_size = 64  # global rows of the synthetic batch
  c.benchmark.source_len = 32  # tokens per source row of the synthetic batch
  c.benchmark.target_len = 32  # tokens per target row
  c.benchmark.warmup = 3  # untimed steps after the compilation
  # timed train steps; the median is reported. 0: compile the step (into the compilation cache)
  # and stop: the GPU suite compiles a window's cases at once that way.
  c.benchmark.steps = 20
  c.benchmark.decode_batch = 32  # rows of the timed decoding
  c.benchmark.decode_steps = 3  # timed decode batches (greedy and beam 4); 0 skips decoding
  c.benchmark.torch = False  # also time torch.nn.Transformer (needs the [torch] extra)
  c.benchmark.torch_autocast = False  # torch side: bf16 autocast (float32 parameters)
  c.benchmark.torch_compile = ""  # torch side: a torch.compile backend (e.g. inductor); "" = eager
  # A directory: trace 2 more train steps after the timed ones into it and add each kernel
  # category's share of them (tools/profile.py) to the result; "" = no trace.
  c.benchmark.profile = ""
  c.benchmark.input = False  # time the input path alone (data.*), not the train step
  c.benchmark.input_steps = 200  # batches timed after the first one (benchmark.input)
  c.benchmark.input_raw = True  # benchmark.input: also time a first start from raw text
  return c


def _commented(source: str, assignment: str) -> dict:
  """{name: description} of the lines of `source` that match the regex `assignment` (group 1:
  the name): the comment block just above the line, then the comment at its end, as one line."""
  comments = {token.start[0]: token.string.lstrip("#").strip()
              for token in tokenize.generate_tokens(io.StringIO(source).readline)
              if token.type == tokenize.COMMENT}  # a "#" inside a string is no comment
  lines = source.splitlines()
  found = {}
  for number, line in enumerate(lines, 1):
    match = re.match(assignment, line)
    if not match:
      continue
    above = number - 1
    while above >= 1 and lines[above - 1].strip().startswith("#"):
      above -= 1
    found[match.group(1)] = " ".join(comments[n] for n in range(above + 1, number + 1)
                                     if n in comments)
  return found


def key_descriptions() -> dict:
  """{dotted key: one line}: the comments of `default_config()` (this file) on each key, and for
  the model's keys those of their ModelConfig fields (model/config.py) where this file has none.
  tests/test_config.py requires one for every key."""
  model = _commented(inspect.getsource(ModelConfig), r"  (\w+): [^=]+")
  described = {f"model.{name}": text for name, text in model.items()}
  own = _commented(inspect.getsource(default_config), r"\s*c\.([\w.]+) = ")
  described.update({key: text for key, text in own.items() if text})
  return described


def describe(config: ml_collections.ConfigDict) -> str:
  """Every key of `config` with its value and its one-line description, section by section."""
  descriptions = key_descriptions()
  values = trees.flatten(config.to_dict())
  shown = {key: json.dumps(list(v) if isinstance(v, tuple) else v) for key, v in values.items()}
  width = max(len(f"{key} = {value}") for key, value in shown.items())
  lines, section = [], None
  for key, value in sorted(shown.items(), key=lambda item: ("." in item[0], item[0])):
    if key.split(".")[0] != section and "." in key:
      section = key.split(".")[0]
      lines.append(f"\n# {section}: {descriptions.get(section, '')}".rstrip(": "))
    text = f"{key} = {value}"
    lines.append(f"{text:<{width}}  # {descriptions.get(key, '(no description)')}")
  return "\n".join(lines).lstrip("\n")


SAVED = "config.json"  # WORKDIR/config.json: the full config of the run that trained it


def from_workdir(workdir: str) -> ml_collections.ConfigDict:
  """The config a workdir was trained with (WORKDIR/config.json), over `default_config()`: the
  source of truth for every mode that reads a workdir when --config is left out.

  Keys that this version no longer has are ignored; keys it added keep their defaults.
  """
  path = storage.join(storage.check(workdir), SAVED) if storage.is_url(workdir) else os.path.join(
      workdir, SAVED)
  try:
    saved = json.loads(storage.read_text(path))
  except FileNotFoundError:
    raise UserError(f"{workdir} holds no {SAVED} (not a trained workdir?); give --config, e.g. "
                    "--config=experiments/scan_simple.py") from None
  except (OSError, ValueError) as e:
    raise UserError(f"cannot read {path}: {e}; give --config instead") from None
  c = default_config()
  for key, value in trees.flatten(saved).items():
    *parents, name = key.split(".")
    node = c
    for part in parents:
      node = node.get(part) if isinstance(node, ml_collections.ConfigDict) else None
    if not isinstance(node, ml_collections.ConfigDict):
      continue
    if name not in node and parents != ["mesh"]:
      continue
    current = node.get(name)
    node[name] = tuple(value) if isinstance(current, tuple) and isinstance(value, list) else value
  return c


def model_config(config: ml_collections.ConfigDict, platform: str = "cpu") -> ModelConfig:
  """The validated ModelConfig of an experiment; dtype "auto" resolves by platform."""
  values = config.model.to_dict()
  if values.get("dtype") == "auto":
    values["dtype"] = "float32" if platform == "cpu" else "bfloat16"
  model = ModelConfig.from_dict(values)
  d = config.data
  if model.arch == "encoder_decoder" and model.max_len < max(d.max_source_len,
                                                             d.max_target_len) + 1:
    raise UserError(f"model.max_len ({model.max_len}) must exceed data.max_source_len and "
                    f"data.max_target_len; raise model.max_len")
  # The decoder-only model reads a source and its target as one sequence.
  longest = {"seq2seq": d.max_source_len + d.max_target_len, "lm": d.max_target_len,
             "mlm": d.max_source_len, "classify": d.max_source_len}.get(d.task, 0)
  if model.arch != "encoder_decoder" and model.max_len < longest:
    what = {"seq2seq": "data.max_source_len + data.max_target_len", "lm": "data.max_target_len"
            }.get(d.task, "data.max_source_len")
    raise UserError(f"model.max_len ({model.max_len}) must be at least {what} ({longest}) for "
                    f"model.arch={model.arch}; raise model.max_len")
  return model


# Every string option and its allowed values: the model's own (checked by ModelConfig too) and
# the rest of the experiment's.
CHOICES = {
    **{f"model.{key}": values for key, values in model_config_lib.CHOICES.items()},
    "model.dtype": ("auto", *model_config_lib.CHOICES["dtype"]),  # auto: by platform
    "data.task": data_tasks.TASKS,
    "data.source": ("scan", "tfds", "files"),
    "data.batching": ("tokens", "packed", "fixed"),
    "data.format": ("parallel", "tsv", "text"),
    "train.schedule": ("rsqrt", "constant", "cosine"),
    "train.best_metric": metric_names.EVAL_METRICS,
    "train.on_nonfinite": ("stop", "skip"),
    "eval.decode": ("greedy", "beam", "sample"),
    "eval.length_penalty_form": ("gnmt", "length"),
    "data.tokenizer.model_type": ("bpe", "unigram", "word"),
}


TRACKERS = ("tensorboard", "wandb", "mlflow")  # train.trackers' names (train/trackers/)


def tracker_names(config) -> list:
  """train.trackers as a list, each once; a UserError for a name that is no tracker."""
  chosen = [n.strip() for n in str(config.train.trackers).split(",") if n.strip()]
  unknown = [n for n in chosen if n not in TRACKERS]
  if unknown:
    raise UserError(f"train.trackers names {', '.join(unknown)}, which is no tracker; give a "
                    f"comma-separated list of {', '.join(TRACKERS)} (or '' for none)")
  return list(dict.fromkeys(chosen))


def _get(config, dotted):
  for part in dotted.split("."):
    config = config[part]
  return config


def check_structure(config) -> None:
  """A config is a ConfigDict with every key of `default_config()` (the mesh's axes aside)."""
  if not isinstance(config, ml_collections.ConfigDict):
    raise UserError(f"the experiment's get_config() returned {type(config).__name__}, not an "
                    "ml_collections.ConfigDict; return transformer_jax.config.default_config() "
                    "with your changes (see experiments/tiny.py)")
  missing = sorted(set(trees.flatten(default_config().to_dict()))
                   - set(trees.flatten(config.to_dict())))
  missing = [key for key in missing if not key.startswith("mesh.")]
  if missing:
    shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
    raise UserError(f"the experiment's config lacks the keys {shown}; start it from "
                    "transformer_jax.config.default_config() (see experiments/tiny.py)")


def _check_numbers(config) -> None:
  """Every number finite; the ranges that a type does not say."""
  for key, value in trees.flatten(config.to_dict()).items():
    if isinstance(value, float) and not math.isfinite(value):
      raise UserError(f"{key} must be a finite number, got {value}")
  t = config.train
  if not 0 <= config.seed < 2**32:  # PRNGKey(seed) keeps 32 bits: 2**32 would repeat seed 0
    raise UserError(f"seed must be in [0, 2**32), got {config.seed}")
  if t.steps >= 2**31:  # the step counter is an int32
    raise UserError(f"train.steps must be below 2**31, got {t.steps}")
  for key in ("adam_b1", "adam_b2"):
    if not 0.0 <= t[key] < 1.0:
      raise UserError(f"train.{key} must be in [0, 1), got {t[key]} (the paper: 0.9 and 0.98)")
  if t.adam_eps <= 0:
    raise UserError(f"train.adam_eps must be positive, got {t.adam_eps} (the paper: 1e-9)")
  if config.model.layer_norm_eps <= 0:
    raise UserError(f"model.layer_norm_eps must be positive, got {config.model.layer_norm_eps}")
  if config.model.vocab_size <= UNK_ID + 1:
    raise UserError(f"model.vocab_size ({config.model.vocab_size}) must exceed the {UNK_ID + 1} "
                    "special tokens (padding, BOS, EOS, unknown) to leave pieces for the text; "
                    "raise model.vocab_size")
  if not 1 <= config.data.scan_dev_cutoff < 22:
    raise UserError(f"data.scan_dev_cutoff must be in [1, 21] (SCAN's length split trains on "
                    f"outputs of at most 22 actions), got {config.data.scan_dev_cutoff}")
  if config.eval.top_k > config.model.vocab_size:
    raise UserError(f"eval.top_k ({config.eval.top_k}) exceeds model.vocab_size "
                    f"({config.model.vocab_size}); lower it (0 = sample from all tokens)")


def _check_secrets(config) -> None:
  """No password or token in a key: the config goes to config.json, the trackers' params and
  the logs. Services take theirs from the environment or their own files instead."""
  for key, value in trees.flatten(config.to_dict()).items():
    if isinstance(value, str) and secrets.has_secret(value):
      raise UserError(f"{key} holds a password or token ({secrets.redact(value)}), and the config "
                      "is written to config.json and sent to the trackers; leave it out and give "
                      "it in the environment (MLflow: MLFLOW_TRACKING_USERNAME and "
                      "MLFLOW_TRACKING_PASSWORD, or the whole URI in MLFLOW_TRACKING_URI)")


def validate(config: ml_collections.ConfigDict, platform: str = "cpu") -> ModelConfig:
  """Checks every value a user can set; returns the ModelConfig. Raises UserError."""
  check_structure(config)
  _check_numbers(config)
  _check_secrets(config)
  model = model_config(config, platform)
  for key in ("train.steps", "data.batch_size", "data.tokens_per_batch", "data.bucket_width",
              "data.max_source_len", "data.max_target_len", "train.grad_accum_steps",
              "train.log_every", "train.checkpoint_every",
              "train.keep_checkpoints", "eval.batch_size", "eval.beam_size",
              "compile.decode_batch"):
    if _get(config, key) <= 0:
      raise UserError(f"{key} must be positive, got {_get(config, key)}")
  for key in ("train.warmup_steps", "train.eval_every", "eval.max_decode_len", "data.prefetch",
              "eval.max_examples", "eval.buffer_size", "train.grad_clip_norm", "train.weight_decay",
              "eval.length_penalty", "eval.top_k", "eval.average_last", "train.keep_best",
              "train.profile_steps", "train.profile_start", "train.storage_outage_s",
              "compile.batch_size", "compile.source_len", "compile.target_len",
              "train.length_loss_weight", "eval.length_head_slack", "train.loss_chunk_tokens"):
    if _get(config, key) < 0:
      raise UserError(f"{key} must be >= 0, got {_get(config, key)}")
  if config.train.learning_rate <= 0:
    raise UserError(f"train.learning_rate must be positive, got {config.train.learning_rate}")
  if config.train.loss_chunk_tokens and model.num_labels:
    raise UserError("train.loss_chunk_tokens chunks the vocabulary's logits, and a classifier "
                    "(model.num_labels) has a few classes' instead; set it to 0")
  if not 0.0 <= config.train.label_smoothing < 1.0:
    raise UserError(f"train.label_smoothing must be in [0, 1), got {config.train.label_smoothing}")
  if config.eval.temperature <= 0:
    raise UserError(f"eval.temperature must be positive, got {config.eval.temperature}")
  if config.eval.average_last > config.train.keep_checkpoints:
    raise UserError(f"eval.average_last ({config.eval.average_last}) exceeds "
                    f"train.keep_checkpoints ({config.train.keep_checkpoints}), the checkpoints a "
                    "run keeps; lower it or raise train.keep_checkpoints")
  if config.eval.max_decode_len > model.max_len:
    raise UserError(f"eval.max_decode_len ({config.eval.max_decode_len}) must be at most "
                    f"model.max_len ({model.max_len}); lower it or raise model.max_len")
  t = config.train
  if t.profile_steps and t.profile_start + t.profile_steps > t.steps:
    raise UserError(f"train.profile_start + train.profile_steps ({t.profile_start} + "
                    f"{t.profile_steps}) exceeds train.steps ({t.steps}): the trace would end "
                    "after training; lower them")
  if config.train.schedule == "rsqrt" and config.train.warmup_steps == 0:
    raise UserError("train.warmup_steps must be positive for the rsqrt schedule")
  for key, choices in CHOICES.items():
    if _get(config, key) not in choices:
      raise UserError(f"{key} must be one of {', '.join(choices)}; got {_get(config, key)!r}")
  _validate_data(config.data)
  tracker_names(config)
  if config.train.tracker_retry_s <= 0:
    raise UserError(f"train.tracker_retry_s must be positive, got {config.train.tracker_retry_s}")
  if config.train.tracker_interval_s < 0:
    raise UserError(f"train.tracker_interval_s must be 0 or more seconds, got "
                    f"{config.train.tracker_interval_s}")
  if config.wandb.mode not in ("", "online", "offline", "disabled"):
    raise UserError(f"wandb.mode must be one of online, offline, disabled (or '' for $WANDB_MODE);"
                    f" got {config.wandb.mode!r}")
  data_tasks.check(model.arch, config.data)
  if config.data.task == "classify" and not model.num_labels:
    raise UserError("data.task=classify needs model.num_labels, the number of classes")
  named = [name for name in config.data.labels.split(",")] if config.data.labels else []
  if config.data.task == "classify" and named and len(named) != model.num_labels:
    raise UserError(f"data.labels names {len(named)} classes but model.num_labels is "
                    f"{model.num_labels}; give one name per class, in the order of their ids")
  suppressed = config.eval.suppress_tokens
  if not all(isinstance(t, int) and 0 <= t < model.vocab_size for t in suppressed):
    raise UserError(f"eval.suppress_tokens must be token ids in [0, model.vocab_size="
                    f"{model.vocab_size}), got {tuple(suppressed)!r}")
  if config.eval.length_head and not model.length_head:
    raise UserError("eval.length_head decodes with the lengths model.length_head predicts, and "
                    "this model has no such head; set eval.length_head=False")
  if model.length_head and config.data.batching == "packed":
    raise UserError("model.length_head predicts one target's length per row, and "
                    "data.batching=packed puts several in a row; use data.batching=tokens")
  if config.data.task == "mlm" and not 0.0 < config.data.mask_rate < 1.0:
    raise UserError(f"data.mask_rate must be in (0, 1), got {config.data.mask_rate}")
  return model


def _validate_data(d) -> None:
  """The data values that can be checked without reading data."""
  if d.source == "tfds" and not d.tfds_name:
    raise UserError("data.source=tfds needs data.tfds_name, e.g. "
                    "--config.data.tfds_name=wmt14_translate/de-en")
  if d.source == "files" and not d.path:
    raise UserError("data.source=files needs data.path, the directory holding the split files, "
                    "e.g. --config.data.path=../shared/data/multi30k")
  if (d.source == "tfds" and d.task == "seq2seq") or (d.source == "files"
                                                       and d.format == "parallel"):
    if not d.source_lang or not d.target_lang or d.source_lang == d.target_lang:
      raise UserError(f"data.source_lang ({d.source_lang!r}) and data.target_lang "
                      f"({d.target_lang!r}) must be two different languages, e.g. en and de")
  if d.source == "scan":
    try:
      scan.max_train_actions(d.scan_split)
    except ValueError as e:
      raise UserError(f"data.scan_split: {e}") from None
  for key in ("train_split", "eval_split"):
    if not d[key]:
      raise UserError(f"data.{key} is empty; name a split of the data source")
  if not 0.0 < d.tokenizer.character_coverage <= 1.0:
    raise UserError("data.tokenizer.character_coverage must be in (0, 1], got "
                    f"{d.tokenizer.character_coverage}")
  if d.tokenizer.sample_size <= 0:
    raise UserError(f"data.tokenizer.sample_size must be positive, got {d.tokenizer.sample_size}")


def validate_benchmark(config, model: ModelConfig) -> None:
  """The `benchmark.*` values, checked by --mode=benchmark only (other modes do not use them)."""
  b = config.benchmark
  for key in ("batch_size", "source_len", "target_len", "decode_batch"):
    if b[key] <= 0:
      raise UserError(f"benchmark.{key} must be positive, got {b[key]}")
  if b.steps < 0:
    raise UserError(f"benchmark.steps must be >= 0 (0: compile the step, time nothing), got "
                    f"{b.steps}")
  for key in ("warmup", "decode_steps"):
    if b[key] < 0:
      raise UserError(f"benchmark.{key} must be >= 0, got {b[key]}")
  for key in ("source_len", "target_len"):
    if b[key] >= model.max_len:
      raise UserError(f"benchmark.{key} ({b[key]}) must be below model.max_len ({model.max_len}); "
                      "lower it or raise model.max_len")
