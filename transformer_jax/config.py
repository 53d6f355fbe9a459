"""The full experiment config with its defaults, and its validation.

Experiment files in `experiments/` start from `default_config()` and change what their recipe
needs, so every key exists in every experiment and `--config.key=value` can reach all of them.
"""

from __future__ import annotations

import dataclasses

import ml_collections

from transformer_jax.errors import UserError
from transformer_jax.model import ModelConfig


def default_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0

  # Model: every ModelConfig field except the per-call switches (deterministic, decode).
  c.model = ml_collections.ConfigDict({
      f.name: f.default for f in dataclasses.fields(ModelConfig)
      if f.name not in ("deterministic", "decode", "vocab_size")})
  c.model.vocab_size = 37000
  c.model.dtype = "auto"  # bfloat16 on GPU/TPU, float32 on CPU

  c.data = ml_collections.ConfigDict()
  c.data.source = "scan"  # scan | tfds | files
  c.data.scan_split = "simple"  # simple | length
  c.data.train_split = "train"
  c.data.eval_split = "test"
  c.data.max_source_len = 64
  c.data.max_target_len = 64
  c.data.batching = "tokens"  # tokens: length-bucketed batches under a token budget | fixed
  c.data.tokens_per_batch = 4096  # global budget per side, padding included (batching=tokens)
  c.data.bucket_width = 8  # length buckets of this width (batching=tokens)
  c.data.batch_size = 64  # global, in examples (batching=fixed)
  c.data.shuffle_buffer = 0  # 0 = full random permutation each epoch
  c.data.tokenizer = ml_collections.ConfigDict()
  c.data.tokenizer.model_type = "bpe"  # bpe | unigram | word (SentencePiece)
  c.data.tokenizer.character_coverage = 1.0
  c.data.tokenizer.sample_size = 1_000_000  # sentences sampled to train it
  c.data.tokenizer.model_path = ""  # a pretrained SentencePiece .model instead of training one

  c.train = ml_collections.ConfigDict()
  c.train.steps = 1000
  c.train.schedule = "rsqrt"  # rsqrt (the paper's) | constant | cosine
  c.train.learning_rate = 1.0  # rsqrt: scale on d_model^-0.5 * min(...); else the peak rate
  c.train.warmup_steps = 4000
  c.train.adam_b1 = 0.9
  c.train.adam_b2 = 0.98
  c.train.adam_eps = 1e-9
  c.train.weight_decay = 0.0
  c.train.label_smoothing = 0.1
  c.train.grad_clip_norm = 0.0  # 0 = no clipping
  c.train.grad_accum_steps = 1
  c.train.log_every = 100
  c.train.eval_every = 0  # 0 = evaluate only at the end
  c.train.checkpoint_every = 1000
  c.train.keep_checkpoints = 3

  c.eval = ml_collections.ConfigDict()
  c.eval.batch_size = 256
  c.eval.max_decode_len = 0  # 0 = data.max_target_len
  c.eval.decode = "greedy"  # greedy | beam
  c.eval.beam_size = 4
  c.eval.length_penalty = 0.6
  c.eval.max_examples = 0  # 0 = the whole split
  return c


def model_config(config: ml_collections.ConfigDict, platform: str = "cpu") -> ModelConfig:
  """The validated ModelConfig of an experiment; dtype "auto" resolves by platform."""
  values = config.model.to_dict()
  if values.get("dtype") == "auto":
    values["dtype"] = "float32" if platform == "cpu" else "bfloat16"
  model = ModelConfig.from_dict(values)
  if model.max_len < max(config.data.max_source_len, config.data.max_target_len) + 1:
    raise UserError(f"model.max_len ({model.max_len}) must exceed data.max_source_len and "
                    f"data.max_target_len; raise model.max_len")
  return model


_CHOICES = {
    "data.source": ("scan", "tfds", "files"),
    "data.scan_split": ("simple", "length"),
    "data.batching": ("tokens", "fixed"),
    "train.schedule": ("rsqrt", "constant", "cosine"),
    "eval.decode": ("greedy", "beam"),
}


def _get(config, dotted):
  for part in dotted.split("."):
    config = config[part]
  return config


def validate(config: ml_collections.ConfigDict, platform: str = "cpu") -> ModelConfig:
  """Checks every value a user can set; returns the ModelConfig. Raises UserError."""
  model = model_config(config, platform)
  for key in ("train.steps", "data.batch_size", "data.tokens_per_batch", "data.bucket_width", "data.max_source_len", "data.max_target_len",
              "train.grad_accum_steps", "train.log_every", "train.checkpoint_every",
              "train.keep_checkpoints", "eval.batch_size", "eval.beam_size"):
    if _get(config, key) <= 0:
      raise UserError(f"{key} must be positive, got {_get(config, key)}")
  for key in ("train.warmup_steps", "train.eval_every", "eval.max_decode_len",
              "eval.max_examples", "train.grad_clip_norm", "train.weight_decay"):
    if _get(config, key) < 0:
      raise UserError(f"{key} must be >= 0, got {_get(config, key)}")
  if config.train.learning_rate <= 0:
    raise UserError(f"train.learning_rate must be positive, got {config.train.learning_rate}")
  if not 0.0 <= config.train.label_smoothing < 1.0:
    raise UserError(f"train.label_smoothing must be in [0, 1), got {config.train.label_smoothing}")
  if config.train.schedule == "rsqrt" and config.train.warmup_steps == 0:
    raise UserError("train.warmup_steps must be positive for the rsqrt schedule")
  for key, choices in _CHOICES.items():
    if _get(config, key) not in choices:
      raise UserError(f"{key} must be one of {', '.join(choices)}; got {_get(config, key)!r}")
  return model
