"""The device mesh and the data-parallel wrapper around a per-device step.

The step is written for one device's shard of the batch and reduces across the `data` mesh
axis itself (pmap semantics); `data_parallel` runs it as `jax.jit(jax.shard_map(...))` over all
devices. The step never needs to know how many devices there are.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

DATA_AXIS = "data"


def make_mesh(devices=None) -> jax.sharding.Mesh:
  """A 1-D mesh over all devices with a `data` axis (Auto axis type, as this code expects)."""
  devices = jax.devices() if devices is None else devices
  return jax.sharding.Mesh(np.asarray(devices), (DATA_AXIS,), axis_types=(AxisType.Auto,))


def data_parallel(step_fn, mesh, donate_state: bool = True):
  """jit(shard_map(step_fn)) for step_fn(state, batch, rng) -> (state, metrics).

  state and rng are replicated; the batch is split along its leading axis; metrics must already
  be reduced across the axis inside step_fn (so they come out replicated).
  """
  sharded = jax.shard_map(step_fn, mesh=mesh, in_specs=(P(), P(DATA_AXIS), P()),
                          out_specs=(P(), P()), check_vma=False)
  return jax.jit(sharded, donate_argnums=(0,) if donate_state else ())


def shard_batch(batch, mesh):
  """Places a host batch on the mesh, split along the leading (batch) axis."""
  sharding = NamedSharding(mesh, P(DATA_AXIS))
  return jax.tree.map(lambda x: jax.device_put(x, sharding), batch)


def replicate(tree, mesh):
  return jax.device_put(tree, NamedSharding(mesh, P()))
