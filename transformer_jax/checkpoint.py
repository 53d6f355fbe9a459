"""Orbax checkpoints in WORKDIR/checkpoints: periodic async saves, keep-last-N, automatic resume."""

from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp

from transformer_jax.errors import UserError


def prepare_workdir(workdir: str) -> str:
  """The absolute workdir, created if needed; a UserError if it cannot be used."""
  workdir = os.path.abspath(os.path.expanduser(workdir))
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise UserError(f"--workdir {workdir} is a file; give a directory")
  try:
    os.makedirs(workdir, exist_ok=True)
  except OSError as e:
    raise UserError(f"cannot create --workdir {workdir}: {e.strerror}; choose another") from None
  if not os.access(workdir, os.W_OK | os.X_OK):
    raise UserError(f"--workdir {workdir} is not writable; choose another or fix its permissions")
  return workdir


class Manager:
  """Saves and restores the train state; wraps ocp.CheckpointManager."""

  def __init__(self, workdir: str, config):
    self.directory = os.path.join(os.path.abspath(workdir), "checkpoints")
    options = ocp.CheckpointManagerOptions(max_to_keep=config.train.keep_checkpoints, create=True,
                                           enable_async_checkpointing=True)
    self._manager = ocp.CheckpointManager(self.directory, options=options)

  def latest_step(self):
    return self._manager.latest_step()

  def all_steps(self):
    return list(self._manager.all_steps())

  def restore(self, state, step=None):
    """The checkpointed state at `step` (default: latest), shaped like `state`."""
    step = self.latest_step() if step is None else step
    if step is None or step not in self.all_steps():
      raise UserError(f"no checkpoint at step {step} in {self.directory}; "
                      f"available: {self.all_steps() or 'none'}")
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
    return self._manager.restore(step, args=ocp.args.StandardRestore(abstract))

  def restore_or(self, state):
    """The latest checkpoint if there is one, else `state` unchanged."""
    return state if self.latest_step() is None else self.restore(state)

  def save(self, step: int, state) -> None:
    self._manager.save(step, args=ocp.args.StandardSave(state))

  def wait(self) -> None:
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.close()
