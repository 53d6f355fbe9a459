"""A new run that starts from another run's parameters (train.init_from): fine-tuning, as BERT
fine-tunes a classifier from its masked-LM pretraining.

The other workdir's latest checkpoint is read with its own config (config.json), so nothing of
its model has to match this one; every parameter of this model whose path and shape the other
model has is copied from it, the rest (a new head) keep their initial values, and the optimizer
state starts afresh. The run uses the other workdir's tokenizer (`data/prepare.py`).
"""

from __future__ import annotations

import json

import jax
import ml_collections

from transformer_jax import config as config_lib
from transformer_jax.core import storage, trees
from transformer_jax.core.errors import UserError
from transformer_jax.train import checkpoint
from transformer_jax.train import state as state_lib


def source_config(workdir: str) -> ml_collections.ConfigDict:
  """The config a workdir was trained with (its config.json)."""
  workdir = storage.check(workdir, "train.init_from")
  path = storage.join(workdir, "config.json")
  if not storage.isfile(path):
    raise UserError(f"train.init_from={workdir} holds no trained run ({path} does not exist); "
                    "point it at the workdir of a finished --mode=train")
  checkpoint.check_config_file(workdir)  # its checkpoints are the truth
  return ml_collections.ConfigDict(json.loads(storage.read_text(path)))


def load(workdir: str, state: state_lib.TrainState, mesh) -> tuple[state_lib.TrainState, list]:
  """`state` with the parameters that `workdir`'s latest checkpoint has under the same path and
  shape; returns (state, the paths copied). Raises UserError if none fits."""
  saved = source_config(workdir)
  model_config = config_lib.validate(saved, jax.default_backend())
  optimizer = state_lib.make_optimizer(saved.train, model_config.d_model)
  manager = checkpoint.Manager(workdir, saved)
  try:
    old = trees.flatten(manager.restore(state_lib.abstract_state(model_config, optimizer,
                                                                 mesh)).params)
  finally:
    manager.close()
  new = trees.flatten(state.params)
  copied = {k for k, v in new.items() if k in old and old[k].shape == v.shape}
  if not copied:
    raise UserError(f"no parameter of train.init_from={workdir} has a name and shape of this "
                    "model; initialise from a run of the same model size")

  def take(path, x):
    key = ".".join(p.key for p in path)
    return jax.device_put(old[key], x.sharding) if key in copied else x

  params = jax.tree_util.tree_map_with_path(take, state.params)
  return state.replace(params=params), sorted(copied)
