"""A trained model from a workdir: one checkpoint, or the mean of the last N (averaging)."""

from __future__ import annotations

import os
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp

from transformer_jax import config as config_lib
from transformer_jax.core import storage
from transformer_jax.core.errors import UserError
from transformer_jax.data import prepare
from transformer_jax.data import tokenizer as tokenizer_lib
from transformer_jax.model import ModelConfig
from transformer_jax.train import checkpoint, sharding
from transformer_jax.train import state as state_lib


class Trained(NamedTuple):
  model_config: ModelConfig
  params: Any  # sharded on `mesh` as in training
  tokenizer: tokenizer_lib.Tokenizer
  step: int  # the checkpoint restored; with averaging, the latest one averaged
  averaged_steps: tuple  # the checkpoints whose parameters were averaged; () = no averaging
  mesh: Any  # the device mesh of config.mesh that the parameters live on


def steps_to_average(available: Sequence[int], step, n: int) -> list:
  """The last `n` of the `available` checkpoint steps up to and including `step` (None: the
  latest); a UserError if there are fewer or `step` is not available."""
  step = max(available, default=None) if step is None else step
  if step not in available:
    raise UserError(f"no checkpoint at step {step}; available: {sorted(available) or 'none'}")
  chosen = sorted(s for s in available if s <= step)[-n:]
  if len(chosen) < n:
    raise UserError(f"eval.average_last={n} needs {n} checkpoints up to step {step}, but there "
                    f"are only {chosen or 'none'}; lower eval.average_last")
  return chosen


def average_params(manager: checkpoint.Manager, state, steps: Sequence[int]):
  """The element-wise mean of the parameters checkpointed at `steps` (restored one at a time
  into the shardings of the target `state`)."""
  total = None
  for step in steps:
    params = manager.restore(state, step).params
    total = params if total is None else jax.tree.map(jnp.add, total, params)
  return jax.tree.map(lambda x: (x / len(steps)).astype(x.dtype), total)


def load_trained(config, workdir: str, step=None) -> Trained:
  """The model of a trained workdir at checkpoint `step` (default: the latest).

  With eval.average_last = N > 0 the parameters are the mean of the last N checkpoints up to
  `step` (checkpoint averaging, as in the paper's base and big results).
  """
  model_config = config_lib.validate(config, jax.default_backend())
  mesh = sharding.make_mesh(config.mesh.to_dict())
  workdir = storage.check(workdir) if storage.is_url(workdir) else os.path.abspath(workdir)
  tokenizer = tokenizer_lib.load_workdir(workdir, prepare.WORKDIR_TOKENIZER_FIX)
  if tokenizer is None:
    raise UserError(f"{workdir} holds no trained model (no {tokenizer_lib.FILENAME}); "
                    "train first with --mode=train")
  # The tokenizer and the config are checked against the checkpoint's record, as train does:
  # another vocabulary would give wrong translations without a word.
  manager = checkpoint.Manager(workdir, config, checkpoint.sha256(tokenizer.model_proto))
  try:
    if not manager.all_steps():
      raise UserError(f"{workdir} holds no checkpoint; train first with --mode=train")
    optimizer = state_lib.make_optimizer(config.train, model_config.d_model)
    abstract = state_lib.abstract_state(model_config, optimizer, mesh)
    averaged = ()
    if config.eval.average_last:
      averaged = tuple(steps_to_average(manager.all_steps(), step, config.eval.average_last))
      params, step = average_params(manager, abstract, averaged), averaged[-1]
    else:
      state = manager.restore(abstract, step)  # step None: the newest readable checkpoint
      params, step = state.params, int(state.step)
  finally:
    manager.close()
  return Trained(model_config, params, tokenizer, step, averaged, mesh)
