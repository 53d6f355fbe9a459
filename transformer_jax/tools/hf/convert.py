"""Hugging Face model directories in and out: `import_hf` (theirs -> a workdir) and `export_hf`
(a workdir -> theirs), one function per direction, driven by the tables of `architectures.py`
(their tokenizers: `tokenizer_files.py`).

An imported workdir is a normal one: config.json (the mapped model and a fine-tuning recipe),
the tokenizer (`data.tokenizer.HF_FILENAME`: their tokenizer.json and the id map) and an orbax
checkpoint at step 0 written by `train/checkpoint.py`, so every mode reads it as a trained run.
Everything is read and checked before anything is written.
"""

from __future__ import annotations

import json
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax import config as config_lib
from transformer_jax.core import files
from transformer_jax.core.errors import UserError
from transformer_jax.core.tokens import BOS_ID, PAD_ID
from transformer_jax.data import tokenizer as tokenizer_lib
from transformer_jax.model import ModelConfig, init_boxed_params, param_shapes
from transformer_jax.tools.hf import checks, tokenizer_files, weights
from transformer_jax.tools.hf.architectures import (
  ARCHITECTURES,
  COUNT,
  Field,
  Vocab,
  vocab_layout,
)
from transformer_jax.train import checkpoint
from transformer_jax.train import state as state_lib

CONFIG = tokenizer_files.CONFIG

# Our training recipe for an imported model: fine-tuning rates (AdamW, a short warmup, cosine
# decay), no label smoothing. Any of it can be changed with --config.train.KEY=VALUE.
FINE_TUNING = {"train.schedule": "cosine", "train.learning_rate": 5e-5,
               "train.warmup_steps": 100, "train.adam_b2": 0.999, "train.adam_eps": 1e-8,
               "train.weight_decay": 0.01, "train.label_smoothing": 0.0}


def _flat(tree) -> dict:
  """{"a/b/c": leaf} of a nested dict of arrays (our parameter paths)."""
  return {"/".join(p.key for p in path): leaf
          for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def _embed_axes(model: ModelConfig) -> dict:
  """{our parameter path: the indices of its axes named "embed"} (the residual stream's
  features), from the logical names the model gives its parameters (`model/axes.py`)."""
  import flax.linen as nn
  boxed = jax.eval_shape(lambda rng: init_boxed_params(model, rng), jax.random.PRNGKey(0))
  specs = nn.get_partition_spec(boxed)
  leaves = jax.tree_util.tree_leaves_with_path(
      specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
  return {"/".join(p.key for p in path): [i for i, name in enumerate(spec) if name == "embed"]
          for path, spec in leaves}


def sinusoid_halves_order(d_model: int) -> np.ndarray:
  """The features of our residual stream in the order of a model whose sinusoidal table has
  the sines in its first half and the cosines in its second (Marian's): their feature k is our
  feature order[k], since our table interleaves them (sin at 2i, cos at 2i + 1).

  Every layer treats the features alike (a LayerNorm's mean and variance, matrices whose rows
  or columns move with them), so permuting every "embed" axis of every parameter turns one
  model into the other exactly.
  """
  return np.concatenate([np.arange(0, d_model, 2), np.arange(1, d_model, 2)])


def _permute_features(flat: dict, model: ModelConfig, order: np.ndarray) -> dict:
  """Every parameter with its "embed" axes taken in `order`."""
  axes = _embed_axes(model)
  out = {}
  for path, value in flat.items():
    for axis in axes[path]:
      value = np.take(value, order, axis=axis)
    out[path] = value
  return out


def _nested(flat: dict) -> dict:
  tree = {}
  for path, leaf in flat.items():
    *parents, name = path.split("/")
    node = tree
    for part in parents:
      node = node.setdefault(part, {})
    node[name] = leaf
  return tree


# ----------------------------------------------------------------------------- reading theirs


def _read_json(path: str, what: str) -> dict:
  return checks.read_json(path, what)  # bounded, UTF-8, a JSON object: or one line


def _architecture(hf_config: dict, path: str):
  """(Architecture, Head) of their config: by model_type, then by its `architectures` class."""
  model_type = checks.hashable(hf_config.get("model_type"), "model_type", path)
  if model_type not in ARCHITECTURES:
    raise UserError(f"{path} has model_type {model_type!r}, which cannot be imported (supported: "
                    f"{', '.join(ARCHITECTURES)}); import a model of one of those types")
  arch = ARCHITECTURES[model_type]
  classes = hf_config.get("architectures") or [arch.heads[0].hf_class]
  if not isinstance(classes, list) or not all(isinstance(c, str) for c in classes):
    raise UserError(f"{path} has architectures={checks.shown(classes)}, not a list of class "
                    "names; fix the value or download config.json again")
  for head in arch.heads:
    if head.hf_class in classes:
      return arch, head
  raise UserError(f"{path} is a {', '.join(classes)}; the {model_type} classes that import are "
                  f"{', '.join(h.hf_class for h in arch.heads)} (set \"architectures\" to one of "
                  "them if the weights have its head)")


def _field_value(field, hf_config: dict, path: str):
  """Our value of a Field, from their config."""
  if field.hf in hf_config and hf_config[field.hf] is not None:
    value = hf_config[field.hf]
  elif callable(field.default):
    try:  # derived from their other values, which may be of any type
      value = field.default(hf_config)
    except (TypeError, ValueError, KeyError, AttributeError, ArithmeticError):
      value = None
  else:
    value = field.default
  if value is None:
    raise UserError(f"{path} lacks {field.hf}, which sets model.{field.ours}; download the "
                    "model's config.json again")
  if field.values == COUNT:
    return checks.count_list(value, field.hf, path)
  if field.values is not None:
    if checks.hashable(value, field.hf, path) not in field.values:
      raise UserError(f"{path} has {field.hf}={value!r}, which model.{field.ours} cannot express "
                      f"(it maps {', '.join(map(repr, field.values))}); this model cannot be "
                      "imported")
    return field.values[value]
  default = checks.option_default(ModelConfig, field.ours)  # the option's type
  return checks.option_value(field.ours, field.hf, value, default, path)


def _model_options(arch, head, hf_config: dict, path: str) -> dict:
  """Our model options (without vocab_size) from their config; refuses what we cannot map."""
  for key, value in arch.required.items():
    if hf_config.get(key, value) != value:
      raise UserError(f"{path} has {key}={hf_config[key]!r}; this project's {arch.model_type} "
                      f"import needs {key}={value!r}, so this model cannot be imported")
  for check in arch.checks:
    problem = check(hf_config)
    if problem:
      raise UserError(f"{path} has {problem}, so this model cannot be imported")
  for first, second in arch.same:
    if second in hf_config and hf_config[second] is not None and (
        hf_config[second] != hf_config.get(first)):
      raise UserError(f"{path} has {first}={hf_config.get(first)!r} but {second}="
                      f"{hf_config[second]!r}; this project's {arch.model_type} has one value for "
                      "both, so this model cannot be imported")
  options = {f.ours: _field_value(f, hf_config, path) for f in arch.fields + head.fields}
  if options.get("head_size") and options["head_size"] * options["num_heads"] == options[
      "d_model"]:
    options["head_size"] = 0  # their head width is d_model / num_heads, our default
  return {**arch.imported, **options, **arch.fixed, **head.fixed}


def _shape_error(name: str, shape, expected, path: str) -> UserError:
  return UserError(f"the weights' {name} has shape {tuple(shape)}, but {path} gives "
                   f"{tuple(expected)}; the weights and config.json must come from the same model")


def _expand(rules: tuple, model: ModelConfig) -> list:
  """The rules with `{i}` replaced by each layer's index, as many as the stack that their
  parameters belong to has layers (rules without it once)."""
  out = []
  for rule in rules:
    if "{i}" in rule.hf:
      layers = (model.num_encoder_layers if rule.ours[0].startswith("encoder/")
                else model.num_decoder_layers)
      out += [rule._replace(hf=rule.hf.format(i=i), ours=tuple(p.format(i=i) for p in rule.ours))
              for i in range(layers)]
    else:
      out.append(rule)
  return out


def _holds(rule, model: ModelConfig) -> bool:
  """Whether the rule's tensor exists for this model (Rule.when)."""
  if rule.when is None:
    return True
  negated = rule.when.startswith("not ")
  return bool(getattr(model, rule.when.removeprefix("not "))) != negated


def _rules(arch, head, model: ModelConfig) -> list:
  rules = _expand(arch.layer_rules + arch.rules + head.rules, model)
  return [rule for rule in rules if _holds(rule, model)]


def _params_from(tensors: dict, arch, head, model: ModelConfig, vocab: Vocab, path: str) -> dict:
  """Our parameter tree from their tensors, each checked against the shape our config gives."""
  if arch.prefix and not any(k.startswith(arch.prefix) for k in tensors):
    # Saved from the base class (GPT2Model, BertModel): names without the prefix.
    heads = ("cls.", "lm_head.", "classifier.", "final_logits_bias")
    tensors = {(k if k.startswith(heads) else arch.prefix + k): v for k, v in tensors.items()}
  for missing, source in arch.aliases:
    if missing not in tensors and source in tensors:
      tensors = {**tensors, missing: tensors[source]}
  shapes = {k: tuple(v.shape) for k, v in _flat(param_shapes(model)).items()}
  flat, used = {}, set()
  for rule in _rules(arch, head, model):
    ours = [shapes[p] for p in rule.ours]
    expected = rule.transform.hf_shape(ours, vocab)
    if rule.hf not in tensors and rule.optional:
      tensors[rule.hf] = np.zeros(expected, np.float32)  # as transformers reads it: zeros
    if rule.hf not in tensors:
      raise UserError(f"the weights in {os.path.dirname(path)} lack {rule.hf}, which a "
                      f"{head.hf_class} has; download the complete model")
    tensor = tensors[rule.hf]
    if tuple(tensor.shape) != tuple(expected):
      raise _shape_error(rule.hf, tensor.shape, expected, path)
    for p, value in zip(rule.ours, rule.transform.to_ours(tensor, ours, vocab)):
      flat[p] = np.asarray(value, np.float32)
    used.add(rule.hf)
  assert set(flat) == set(shapes), sorted(set(shapes) ^ set(flat))  # the table covers the model
  unused = [k for k in sorted(set(tensors) - used)
            if not any(re.search(pattern, k) for pattern in arch.ignored)]
  if unused:
    print(f"note: {len(unused)} tensor(s) of the checkpoint have no counterpart here and are "
          f"left out: {', '.join(unused[:3])}{' ...' if len(unused) > 3 else ''}",
          file=sys.stderr)
  if arch.sinusoid_halves:
    flat = _permute_features(flat, model, np.argsort(sinusoid_halves_order(model.d_model)))
  return _nested(flat)


def _class_names(hf_config: dict, count: int) -> list:
  """A classifier's class names by id: their id2label (transformers' LABEL_0, LABEL_1, ... where
  it has none), each a name that data.labels (comma-separated) holds as it is."""
  id2label = hf_config.get("id2label") or {str(i): f"LABEL_{i}" for i in range(count)}
  if sorted(map(str, id2label)) != sorted(str(i) for i in range(count)):
    raise UserError(f"config.json's id2label has the ids {sorted(id2label)[:5]}, not 0 to "
                    f"{count - 1}; give every class an id of 0..{count - 1} there")
  names = [str(id2label[str(i)] if str(i) in id2label else id2label[i]) for i in range(count)]
  bad = next((n for n in names if not n.strip() or "," in n or n != n.strip()), None)
  if bad is not None or len(set(names)) != count:
    problem = (f"the class name {bad!r}, which data.labels (comma-separated) cannot hold"
               if bad is not None else "a class name twice")
    raise UserError(f"config.json's id2label has {problem}; give each class its own name "
                    "without commas or outer spaces there")
  return names


def _experiment_config(model: ModelConfig, task: str, hf_config: dict):
  """The full experiment config of the imported model: defaults, the model, its task (with a
  classifier's class names), limits that fit its positions, and the fine-tuning recipe."""
  config = config_lib.default_config()
  for key, value in dict(model.__dict__).items():
    if key in config.model:
      config.model[key] = value
  config.model.vocab_size = model.vocab_size
  config.model.dtype = "auto"
  config.data.task = task
  # The data to fine-tune on is the user's to name (--config.data.source=files, data.path=...);
  # until then the config keeps the built-in SCAN data, which needs no files, so it validates.
  config.data.source = "scan"
  config.data.format = {"lm": "text", "mlm": "text", "classify": "tsv"}.get(task, "parallel")
  if task == "classify":  # their class names, in the order of their ids, whatever they are
    config.data.labels = ",".join(_class_names(hf_config, model.num_labels))
  longest = model.max_len // 2 if task == "seq2seq" else model.max_len
  config.data.max_source_len = min(config.data.max_source_len, longest)
  config.data.max_target_len = min(config.data.max_target_len, longest)
  for key, value in FINE_TUNING.items():
    section, name = key.split(".")
    config[section][name] = value
  return config


GENERATION_CONFIG = "generation_config.json"
# transformers' values of the generation options that change outputs when they are absent.
_GENERATION_DEFAULTS = {
    "max_length": 20, "min_length": 0, "do_sample": False, "early_stopping": False,
    "num_beams": 1, "temperature": 1.0, "top_k": 50, "top_p": 1.0, "min_p": None,
    "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "repetition_penalty": 1.0,
    "encoder_repetition_penalty": 1.0, "length_penalty": 1.0, "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0, "renormalize_logits": False, "num_beam_groups": 1,
    "diversity_penalty": 0.0, "remove_invalid_values": False}
# Keys that are no generation setting of ours to map (ids the import reads elsewhere, outputs).
_GENERATION_IGNORED = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id",
                       "transformers_version", "_from_model_config", "use_cache",
                       "num_return_sequences", "output_attentions", "output_hidden_states",
                       "output_scores", "output_logits", "return_dict_in_generate")


def _setting(settings: dict, key: str):
  """Their value of a generation option: the one given, else transformers' default."""
  return settings.get(key, _GENERATION_DEFAULTS.get(key))


def _lengths(e, settings: dict, model: ModelConfig, vocab: Vocab, special_ids: dict) -> list:
  # Their max_length counts the decoder's start token, or a decoder-only model's prompt too.
  longest = model.max_len - (model.arch == "decoder_only")  # a prompt of one token at least
  if "max_new_tokens" in settings:
    e.max_decode_len = min(int(settings["max_new_tokens"]), longest)
  elif "max_length" in settings and model.arch == "encoder_decoder":
    e.max_decode_len = min(int(settings["max_length"]) - 1, longest)
  elif "max_length" in settings:
    return [f"max_length={settings['max_length']} (prompt and output together; "
            "eval.max_decode_len counts the output only)"]
  return []


def _search(e, settings: dict, model: ModelConfig, vocab: Vocab, special_ids: dict) -> list:
  value = lambda key: _setting(settings, key)  # noqa: E731
  if value("do_sample"):
    e.decode, e.temperature, e.top_k = "sample", float(value("temperature")), int(value("top_k"))
  elif value("num_beams") > 1:
    e.decode, e.beam_size = "beam", int(value("num_beams"))
    e.length_penalty, e.length_penalty_form = float(value("length_penalty")), "length"
    if value("early_stopping") is not True and e.length_penalty > 0:
      return [f"early_stopping={value('early_stopping')!r} (transformers may stop a beam "
              "search that a longer hypothesis would still win; ours does not)"]
  else:
    e.decode = "greedy"
  return []


def _suppressed(e, settings: dict, model: ModelConfig, vocab: Vocab, special_ids: dict) -> list:
  suppressed, unmapped = list(settings.get("suppress_tokens") or []), []
  for words in settings.get("bad_words_ids") or []:
    if len(words) == 1:
      suppressed += words
    else:
      unmapped.append(f"bad_words_ids {words} (a sequence of tokens; only single tokens here)")
  ours = sorted({int(vocab.our_ids[t]) for t in suppressed if 0 <= t < len(vocab.our_ids)}
                - {PAD_ID, BOS_ID})  # never generated anyway
  e.suppress_tokens = tuple(ours)
  return unmapped


def _forced_eos(e, settings: dict, model: ModelConfig, vocab: Vocab, special_ids: dict) -> list:
  forced = settings.get("forced_eos_token_id")
  if forced is None:
    return []
  if forced in (special_ids.get("eos"), [special_ids.get("eos")]):
    e.force_eos = True
    return []
  return [f"forced_eos_token_id={forced} (not the EOS token)"]


# Their generation options that map to config.eval, and the function that maps each group: it
# sets config.eval and returns what it could not express. Any other option left at a value
# other than transformers' default is named in the import's note.
_GENERATION_MAPS = (
    (("max_length", "max_new_tokens"), _lengths),
    (("do_sample", "num_beams", "temperature", "top_k", "length_penalty", "early_stopping"),
     _search),
    (("suppress_tokens", "bad_words_ids"), _suppressed),
    (("forced_eos_token_id",), _forced_eos),
)


def _generation_settings(config, hf_dir: str, hf_config: dict, model: ModelConfig,
                         vocab: Vocab, special_ids: dict) -> str:
  """config.eval from the model's generation settings: generation_config.json, else those that
  older models keep in config.json. Returns one line naming the settings that have no
  counterpart here ("" when none)."""
  if model.arch == "encoder_only":
    return ""  # nothing generates
  path = os.path.join(hf_dir, GENERATION_CONFIG)
  if os.path.isfile(path):
    settings = _read_json(path, "the model")
  else:
    settings = {k: v for k, v in hf_config.items() if k in _GENERATION_DEFAULTS or k in (
        "max_new_tokens", "bad_words_ids", "suppress_tokens", "forced_eos_token_id",
        "forced_bos_token_id", "begin_suppress_tokens")}
  unmapped = []
  # transformers stops generating at any of a list of EOS ids; ours at the tokenizer's EOS.
  eos = settings.get("eos_token_id")
  if isinstance(eos, list) and len(set(eos)) > 1:
    ours = special_ids.get("eos")
    unmapped.append(f"eos_token_id={eos} (transformers stops at any of them; generation here "
                    f"stops at the EOS token{f' {ours}' if ours is not None else ''} alone)")
  settings = {k: v for k, v in settings.items() if v is not None and k not in _GENERATION_IGNORED}
  for _, mapper in _GENERATION_MAPS:
    unmapped += mapper(config.eval, settings, model, vocab, special_ids)
  handled = {key for keys, _ in _GENERATION_MAPS for key in keys}
  for key in sorted(settings):
    if key not in handled and settings[key] != _GENERATION_DEFAULTS.get(key, object()):
      unmapped.append(f"{key}={settings[key]!r}")
  if not unmapped:
    return ""
  return (f"note: {GENERATION_CONFIG if os.path.isfile(path) else CONFIG}'s generation settings "
          f"{'; '.join(unmapped)} have no counterpart here and are left out")


def _check_new_workdir(workdir: str) -> str:
  entries = dict(checkpoint.WORKDIR_ENTRIES, **{tokenizer_lib.HF_FILENAME: False})
  workdir = checkpoint.check_workdir(workdir, entries)
  held = [name for name in ("config.json", "checkpoints", tokenizer_lib.FILENAME,
                            tokenizer_lib.HF_FILENAME)
          if os.path.lexists(os.path.join(workdir, name))]
  if held:
    raise UserError(f"--workdir {workdir} already holds a run ({held[0]}); import into a new "
                    "--workdir")
  return workdir


def import_hf(hf_dir: str, workdir: str) -> str:
  """Writes the Hugging Face model in `hf_dir` as a workdir at `workdir`; returns a summary."""
  if not hf_dir or not os.path.isdir(hf_dir):
    raise UserError(f"--hf_dir {hf_dir!r} is not a directory; give the directory of a Hugging "
                    "Face model (config.json, model.safetensors, tokenizer.json)")
  workdir = _check_new_workdir(workdir)
  config_path = os.path.join(hf_dir, CONFIG)
  if not os.path.isfile(config_path):
    raise UserError(f"{hf_dir} holds no {CONFIG}; download the model's config.json with its "
                    "weights")
  hf_config = _read_json(config_path, "the model")
  generation_path = os.path.join(hf_dir, GENERATION_CONFIG)
  if hf_config.get("decoder_start_token_id") is None and os.path.isfile(generation_path):
    # transformers 5 keeps it there only; it decides which token the decoder starts from.
    start = _read_json(generation_path, "the model").get("decoder_start_token_id")
    if start is not None:
      hf_config = {**hf_config, "decoder_start_token_id": start}
  arch, head = _architecture(hf_config, config_path)
  options = _model_options(arch, head, hf_config, config_path)
  weights.check_present(hf_dir)
  hf_vocab_size = _field_value(Field("vocab_size", "vocab_size"), hf_config, config_path)
  tokenizer_record, special_tokens, special_ids = tokenizer_files.read(arch, hf_dir,
                                                                      hf_vocab_size, hf_config)
  vocab = vocab_layout(hf_vocab_size, special_ids, arch.slots)
  try:
    model = ModelConfig(vocab_size=len(vocab.hf_ids), excluded_rows=vocab.extra_rows(),
                        row_copies=vocab.copies(), **options).validate()
  except UserError as e:
    raise UserError(f"{config_path} maps to a model this project refuses: {e}") from None
  params = _params_from(weights.read(hf_dir), arch, head, model, vocab, config_path)
  config = _experiment_config(model, head.task, hf_config)
  generation_note = _generation_settings(config, hf_dir, hf_config, model, vocab, special_ids)
  config_lib.validate(config)
  tokenizer_file = json.dumps({
      **tokenizer_record, "hf_ids": vocab.hf_ids.tolist(),
      "our_ids": vocab.our_ids.tolist(), "add_bos": arch.add_bos,
      "prompt_bos": arch.prompt_bos,
      "special_tokens": special_tokens, "model_type": arch.model_type}).encode()
  tokenizer_lib.HFTokenizer(tokenizer_file)  # reads back

  optimizer = state_lib.make_optimizer(config.train, model.d_model)
  params = jax.tree.map(jnp.asarray, params)
  state = state_lib.TrainState(step=jnp.array(0, jnp.int32), params=params,
                               opt_state=optimizer.init(params))
  checkpoint.create_workdir(workdir)
  files.atomic_write(os.path.join(workdir, tokenizer_lib.HF_FILENAME), tokenizer_file)
  files.atomic_write(os.path.join(workdir, "config.json"), config.to_json_best_effort(indent=2))
  manager = checkpoint.Manager(workdir, config, checkpoint.sha256(tokenizer_file), writable=True)
  try:
    manager.save(0, state)
    manager.wait()
  finally:
    manager.close()
  if generation_note:
    print(generation_note, file=sys.stderr)
  return (f"imported {hf_config.get('model_type')} ({head.hf_class}) from {hf_dir} into "
          f"{workdir}: {model.arch}, {len(jax.tree.leaves(params))} parameter arrays, "
          f"vocabulary {model.vocab_size} (theirs {hf_vocab_size}), data.task={head.task}")


# ----------------------------------------------------------------------------- writing theirs


# Keys of ModelConfig that an architecture does not read: the stack it does not have.
_UNREAD = {"decoder_only": ("num_encoder_layers",), "encoder_only": ("num_decoder_layers",)}


def _target(model: ModelConfig):
  """(Architecture, Head) that expresses our model; refuses, naming the option, when none does."""
  # Options no exported class has: one layer's weights shared by the stack, a learned position
  # table widened for randomised training positions, positions drawn at evaluation, and gated
  # residual blocks, a length head, and geometric self-attention.
  unexported = {"share_layers": model.share_layers,
                "random_positions_max": model.random_positions_max
                                        and model.positional == "learned",
                "random_positions_eval": model.random_positions_eval,
                "residual_gate": model.residual_gate,
                "length_head": model.length_head,
                "self_attention": model.self_attention != "softmax"}
  key = next((key for key, present in unexported.items() if present), None)
  if key:
    raise UserError(f"no Hugging Face class that this project exports has model.{key} "
                    f"(got {getattr(model, key)!r}); train without it to export")
  reasons = []
  for arch in ARCHITECTURES.values():
    if arch.fixed["arch"] != model.arch:
      continue
    for head in arch.heads:
      fixed = {**arch.fixed, **head.fixed}
      if "num_labels" not in fixed and not model.num_labels:
        continue  # a classifier's class: not for a model without classes
      # A key the architecture never reads (a decoder-only model's num_encoder_layers) is no
      # reason to refuse: the export writes what the model has.
      wrong = [(k, v) for k, v in fixed.items()
               if getattr(model, k) != v and k not in _UNREAD.get(model.arch, ())]
      if not wrong:
        for field in arch.fields:
          if field.values not in (None, COUNT):
            inverse = {ours: theirs for theirs, ours in reversed(field.values.items())}
            if getattr(model, field.ours) not in inverse:
              wrong.append((field.ours, "/".join(sorted(set(field.values.values())))))
      if not wrong:
        return arch, head
      reasons.append(f"{head.hf_class} needs " + ", ".join(
          f"model.{key}={value} (not {getattr(model, key)!r})" for key, value in wrong[:3]))
  raise UserError(f"no Hugging Face class that this project exports expresses this model.arch="
                  f"{model.arch} ({'; '.join(reasons) or 'none for this architecture'}); "
                  "train with the options of one of them to export")


def _label_names(config, count: int) -> list:
  """The class names of a classifier: data.labels, or the train split's (when it can still be
  read), else LABEL_0, LABEL_1, ... as transformers names them."""
  from transformer_jax.data import tasks
  try:
    names = list(tasks.label_names(config.data))
  except (UserError, OSError):
    names = []
  return names if len(names) == count else [f"LABEL_{i}" for i in range(count)]


def _hf_config(arch, head, model: ModelConfig, vocab: Vocab, special_ids: dict,
               labels: list) -> dict:
  hf = {"model_type": arch.model_type, "architectures": [head.hf_class],
        "vocab_size": len(vocab.our_ids), **arch.required}
  for field in arch.fields + head.fields:
    value = getattr(model, field.ours)
    if field.values == COUNT:
      value = {str(i): labels[i] for i in range(value)}
      hf["label2id"] = {v: int(k) for k, v in value.items()}
    elif field.values is not None:
      value = {ours: theirs for theirs, ours in reversed(field.values.items())}[value]
    hf[field.hf] = value
  for first, second in arch.same:
    hf[second] = hf[first]
  for name, value in arch.derived:
    hf[name] = value(model)
  for name in ("pad", "bos", "eos"):
    if special_ids.get(name) is not None:
      hf[f"{name}_token_id"] = int(special_ids[name])
  if arch.bos_is_decoder_start:
    hf["decoder_start_token_id"] = hf.pop("bos_token_id")
  if arch.forced_eos:
    hf["forced_eos_token_id"] = hf["eos_token_id"]
  return hf


def _own_vocab(arch, vocab_size: int) -> Vocab:
  """The ids of a model trained here (our SentencePiece vocabulary) in their model: the same,
  pad 0, BOS 1, EOS 2; or with our padding in the last row (Architecture.pad_last)."""
  ids = np.arange(vocab_size)
  if not arch.pad_last:
    return Vocab(ids, ids)
  return Vocab(np.roll(ids, 1), np.roll(ids, -1))  # ours 0 -> theirs V-1, ours i -> i - 1


def export_hf(workdir: str, hf_dir: str, step=None) -> str:
  """Writes the model of `workdir` (its latest checkpoint, or `step`) as a Hugging Face model
  directory `hf_dir` that `transformers` loads with its Auto classes; returns a summary."""
  from transformer_jax.eval.load import load_trained
  given, workdir = workdir, os.path.abspath(os.path.expanduser(workdir))
  if not os.path.isfile(os.path.join(workdir, config_lib.SAVED)):
    what = ("does not exist" if not os.path.lexists(workdir) else "is a file" if not
            os.path.isdir(workdir) else f"holds no trained run (no {config_lib.SAVED})")
    raise UserError(f"--workdir {given} {what}: there is no model to export; give the workdir of "
                    "a run that --mode=train or --mode=import_hf wrote")
  config = config_lib.from_workdir(workdir)
  model = config_lib.validate(config)
  arch, head = _target(model)
  if hf_dir and os.path.isfile(os.path.join(hf_dir, CONFIG)):
    raise UserError(f"--hf_dir {hf_dir} already holds a model ({CONFIG}); export into a new or "
                    "empty directory")
  trained = load_trained(config, workdir, step)
  tokenizer = trained.tokenizer
  if isinstance(tokenizer, tokenizer_lib.HFTokenizer):
    vocab = Vocab(tokenizer.hf_ids, tokenizer.our_ids)
  else:  # our own SentencePiece vocabulary: pad 0, BOS 1, EOS 2 (or pad last)
    vocab = _own_vocab(arch, model.vocab_size)
  flat = {k: np.array(v, np.float32) for k, v in _flat(jax.device_get(trained.params)).items()}
  if model.zero_bos_embedding:  # the rows as the model reads them
    for path in flat:
      if path.endswith("embedding/embedding"):
        flat[path][BOS_ID] = 0.0
  if arch.sinusoid_halves:
    flat = _permute_features(flat, model, sinusoid_halves_order(model.d_model))
  tensors = {}
  for rule in _rules(arch, head, model):
    if rule.optional and not all(p in flat for p in rule.ours):
      tensors[rule.hf] = np.zeros(rule.transform.hf_shape(None, vocab), np.float32)
      continue
    tensors[rule.hf] = rule.transform.to_hf([flat[p] for p in rule.ours], vocab)
  special_ids = tokenizer_files.special_ids(arch, tokenizer, vocab)
  labels = _label_names(config, model.num_labels) if model.num_labels else []
  hf_config = _hf_config(arch, head, model, vocab, special_ids, labels)
  try:
    os.makedirs(hf_dir, exist_ok=True)
  except OSError as e:
    raise files.write_error(hf_dir, e) from None
  files.atomic_write(os.path.join(hf_dir, CONFIG), json.dumps(hf_config, indent=2))
  weights.write(hf_dir, tensors)
  wrote = [CONFIG, weights.SAFETENSORS]
  wrote += tokenizer_files.write(hf_dir, arch, tokenizer, vocab, special_ids, model.max_len)
  return (f"exported {workdir} (step {trained.step}) as {head.hf_class} to {hf_dir}: "
          f"{', '.join(wrote)}")
