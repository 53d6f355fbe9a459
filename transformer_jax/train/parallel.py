"""The device mesh and the data-parallel wrapper around a per-device step.

The step is written for one device's shard of the batch and reduces across the `data` mesh
axis itself (pmap semantics); `data_parallel` runs it as `jax.jit(jax.shard_map(...))` over all
devices. The step never needs to know how many devices there are.
"""

from __future__ import annotations

import os

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from transformer_jax.core.errors import UserError

DATA_AXIS = "data"


def initialize_distributed(coordinator_address=None, num_processes=None, process_id=None) -> None:
  """Starts JAX's multi-process runtime when this is one process of several.

  Explicit flags win; otherwise JAX detects Cloud TPU pods and SLURM jobs (several tasks) itself.
  A single process on one machine needs none of this and skips it.
  """
  explicit = coordinator_address is not None or num_processes is not None
  slurm = int(os.environ.get("SLURM_NTASKS", "1")) > 1
  tpu_pod = "TPU_WORKER_HOSTNAMES" in os.environ and "," in os.environ["TPU_WORKER_HOSTNAMES"]
  if not (explicit or slurm or tpu_pod):
    return
  if explicit and (coordinator_address is None or num_processes is None or process_id is None):

    raise UserError("multi-process runs need all of --coordinator_address, --num_processes and "
                    "--process_id (or none of them on Cloud TPU / SLURM)")
  jax.distributed.initialize(coordinator_address=coordinator_address,
                             num_processes=num_processes, process_id=process_id)


MESH_AXES = (DATA_AXIS,)  # the axes implemented so far; "fsdp" and "tensor" will join here


def make_mesh(axes=None, devices=None) -> jax.sharding.Mesh:
  """The device mesh from `config.mesh`: {axis name: size}, one size may be -1 (the rest).

  The mesh always spans every device (of every process). Only the `data` axis exists today;
  its axis type is Auto, as this code expects (jax.make_mesh now defaults to Explicit).
  """

  devices = jax.devices() if devices is None else devices
  axes = dict(axes or {DATA_AXIS: -1})
  unknown = [name for name in axes if name not in MESH_AXES]
  if unknown:
    raise UserError(f"mesh axes {unknown} are not implemented yet; the mesh has the axes "
                    f"{list(MESH_AXES)} (set e.g. --config.mesh.data=-1)")
  fixed = int(np.prod([size for size in axes.values() if size != -1]))
  if list(axes.values()).count(-1) > 1 or any(size == 0 or size < -1 for size in axes.values()):
    raise UserError(f"config.mesh {axes}: sizes must be positive, with at most one -1")
  sizes = {name: (len(devices) // fixed if size == -1 else size) for name, size in axes.items()}
  if int(np.prod(list(sizes.values()))) != len(devices):
    raise UserError(f"config.mesh {axes} does not cover the {len(devices)} devices; use -1 for "
                    "one axis to take the rest")
  shape = tuple(sizes[name] for name in MESH_AXES)
  return jax.sharding.Mesh(np.asarray(devices).reshape(shape), MESH_AXES,
                           axis_types=(AxisType.Auto,) * len(MESH_AXES))


def data_parallel(step_fn, mesh, donate_state: bool = True):
  """jit(shard_map(step_fn)) for step_fn(state, batch, rng) -> (state, metrics).

  state and rng are replicated; the batch is split along its leading axis; metrics must already
  be reduced across the axis inside step_fn (so they come out replicated).
  """
  sharded = jax.shard_map(step_fn, mesh=mesh, in_specs=(P(), P(DATA_AXIS), P()),
                          out_specs=(P(), P()), check_vma=False)
  return jax.jit(sharded, donate_argnums=(0,) if donate_state else ())


def process_rows(global_rows: int) -> slice:
  """The rows of a global batch that this process puts on its devices (all of them with one
  process). Every process derives the same global batch plan; each materialises only its part."""
  count, index = jax.process_count(), jax.process_index()
  if global_rows % count:

    raise UserError(f"a global batch of {global_rows} rows does not split over {count} processes")
  per_process = global_rows // count
  return slice(index * per_process, (index + 1) * per_process)


def shard_batch(batch, mesh):
  """Places a global host batch on the mesh, split along the leading (batch) axis.

  With several processes each one contributes only its own rows (`process_rows`); the devices
  of the mesh are ordered by process, so process i's rows land on process i's devices.
  """
  sharding = NamedSharding(mesh, P(DATA_AXIS))
  if jax.process_count() == 1:
    return jax.tree.map(lambda x: jax.device_put(x, sharding), batch)
  rows = process_rows(len(jax.tree.leaves(batch)[0]))
  return jax.tree.map(
      lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x[rows]),
                                                       x.shape), batch)


def replicate(tree, mesh):
  """Copies a host (or single-device) pytree onto every device of the mesh, across processes."""
  sharding = NamedSharding(mesh, P())
  if jax.process_count() == 1:
    return jax.device_put(tree, sharding)
  return jax.tree.map(
      lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x), np.shape(x)),
      tree)


def to_local(tree):
  """A replicated global pytree as arrays on this process's first device (for host-side work
  such as evaluation, which every process can then run on its own)."""
  if jax.process_count() == 1:
    return tree
  return jax.tree.map(lambda x: x.addressable_data(0) if isinstance(x, jax.Array) else x, tree)
