"""The Python API: a trained workdir as an object.

  import transformer_jax
  model = transformer_jax.load("runs/scan_simple")
  model.translate(["jump twice"])            # -> ["I_JUMP I_JUMP"]
  model.score(["jump twice"], ["I_JUMP I_JUMP"])  # -> [log p(target | source)]

Loading reads the workdir's config.json, tokenizer and newest checkpoint (or `step`; with
`eval.average_last` the mean of the last checkpoints), exactly as --mode=evaluate does.
Inference is deterministic: `model.module` is the Flax module of the workdir's architecture
(model.arch: Transformer, DecoderOnly or EncoderOnly) with dropout off, so `apply` needs no
dropout RNG: `(inputs, decoder_inputs)` for the first two (a decoder-only model's inputs may have
width 0), `(inputs)` for the encoder-only one (README.md, "Python API").
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import numpy as np

from transformer_jax import config as config_lib
from transformer_jax.core.errors import UserError
from transformer_jax.core.tokens import EOS_ID
from transformer_jax.data.tokenizer import HFTokenizer
from transformer_jax.eval import decode, load, translate
from transformer_jax.model import ModelConfig, make_model
from transformer_jax.train import checkpoint


@dataclasses.dataclass
class Model:
  """A trained model: its config (an ml_collections.ConfigDict), parameters and tokenizer."""
  config: Any
  model_config: ModelConfig  # deterministic=True: dropout off
  params: Any
  tokenizer: Any
  step: int  # the checkpoint loaded (with averaging, the newest one averaged)
  mesh: Any = None  # the device mesh the parameters live on (config.mesh)

  @property
  def module(self):
    """The Flax module of model.arch (Transformer, DecoderOnly or EncoderOnly), for `apply`
    with `{"params": self.params}`."""
    return make_model(self.model_config)

  def translate(self, sentences: Sequence[str]) -> list:
    """Translations of `sentences`, in order, decoded with config.eval (greedy by default)."""
    if isinstance(sentences, str):
      raise UserError("translate takes a list of sentences; wrap one sentence in a list")
    return [text for text, _ in translate.translate(
        self.params, self.model_config, self.config, self.tokenizer, list(sentences),
        self.mesh)]

  def token_log_probs(self, sources: Sequence[str], targets: Sequence[str]) -> list:
    """log p of each target token given the source and the tokens before it (natural log, EOS
    included), by teacher forcing: one float32 array per pair, as long as the target's ids and
    its EOS. A decoder-only model reads an empty source as no source at all (a language model
    scores the text alone, after BOS).

    Sources longer than data.max_source_len - 1 tokens are truncated as translate does;
    targets are scored in full.
    """
    if self.model_config.arch == "encoder_only":
      raise UserError("an encoder-only model has no targets to score; apply model.module to "
                      "the inputs for its logits (README.md, Python API)")
    if isinstance(sources, str) or isinstance(targets, str):
      raise UserError("score takes lists of sentences; wrap one sentence in a list")
    if len(sources) != len(targets):
      raise UserError(f"score needs as many targets as sources; got {len(targets)} targets "
                      f"for {len(sources)} sources")
    if not sources:
      return []
    inputs, _ = translate.encode_sources(self.tokenizer, list(sources),
                                         self.config.data.max_source_len, len(sources))
    if self.model_config.arch == "decoder_only":
      inputs[[i for i, text in enumerate(sources) if not text]] = 0
      inputs = inputs[:, :max(1, int((inputs != 0).sum(axis=1).max()))]
      inputs = inputs if inputs.any() else inputs[:, :0]
    encoded = (self.tokenizer.encode(list(targets), target=True)
               if isinstance(self.tokenizer, HFTokenizer) else self.tokenizer.encode(list(targets)))
    rows = [ids + [EOS_ID] for ids in encoded]
    outputs = np.zeros((len(rows), max(map(len, rows))), np.int32)
    for i, row in enumerate(rows):
      outputs[i, :len(row)] = row
    if outputs.shape[1] > self.model_config.max_len:
      raise UserError(f"a target has {outputs.shape[1]} tokens, more than model.max_len "
                      f"({self.model_config.max_len})")
    per_token = np.asarray(decode.token_log_probs(self.params, self.model_config, inputs,
                                                  outputs))
    return [per_token[i, :len(row)] for i, row in enumerate(rows)]

  def score(self, sources: Sequence[str], targets: Sequence[str]) -> list:
    """log p(target | source) of each pair (natural log, EOS included), by teacher forcing:
    the sums of `token_log_probs`."""
    return [float(np.sum(row, dtype=np.float64))
            for row in self.token_log_probs(sources, targets)]


def load_model(workdir: str, step: Optional[int] = None, overrides: Optional[dict] = None
               ) -> Model:
  """The model of `workdir` (its config.json), at checkpoint `step` (default: the newest).

  overrides: {dotted config key: value}, as --config.KEY=VALUE on the command line, e.g.
  `{"eval.decode": "beam"}`.
  """
  checkpoint.check_config_file(workdir)  # the checkpoint is the truth, as on the command line
  config = config_lib.from_workdir(workdir)
  for key, value in (overrides or {}).items():
    *parents, name = key.split(".")
    node = config
    try:
      for part in parents:
        node = node[part]
      node[name]  # an unknown key is refused, as on the command line
      node[name] = value
    except (KeyError, TypeError) as e:
      raise UserError(f"cannot override config key {key!r}: {e}") from None
  trained = load.load_trained(config, workdir, step)
  return Model(config=config,
               model_config=trained.model_config.replace(deterministic=True, decode=False),
               params=trained.params, tokenizer=trained.tokenizer, step=trained.step,
               mesh=trained.mesh)
