"""The device mesh, the one table that maps the model's logical axes to it, and placement.

The mesh has three axes (`config.mesh`):
  data    data parallelism: each group of devices along it holds a full copy of what the
          others shard (parameters, optimizer state) and its own rows of the batch
  fsdp    fully sharded data parallelism (ZeRO-3): the batch is split along it as along
          `data`, and every parameter and its optimizer state are split along their d_model
          (`embed`) dimension, gathered layer by layer when used
  tensor  tensor parallelism (Megatron): attention heads, the feed-forward hidden units and
          the vocabulary are split along it, and the activations with them

The model names the dimensions of its parameters and main activations (`model/axes.py`);
`RULES` maps those names to mesh axes, as t5x's and MaxText's rule tables do. The train step
is written for the whole global batch (`train/step.py`) and runs as one `jax.jit` whose inputs
and outputs carry these shardings; XLA's SPMD partitioner inserts the collectives. The step's
update is the same on every mesh (`tests/test_sharding.py`).
"""

from __future__ import annotations

import contextlib
import math
import os
from typing import Optional

import flax.linen as nn
import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from transformer_jax.core import job_output
from transformer_jax.core.errors import UserError

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")  # the batch is split over both

# Logical axis -> mesh axes: the one place that decides what is split where. For each array,
# the rules are tried in order and a mesh axis is used at most once, so an activation
# [batch, length, embed] gets batch -> (data, fsdp) and leaves embed whole, while a parameter
# [embed, mlp] (it has no batch) gets embed -> fsdp and mlp -> tensor. Names not listed
# (length, kv, position, relpos_buckets, stack) are never split.
RULES = (
    ("batch", BATCH_AXES),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),  # grouped-query attention: split like the heads when they divide
    ("mlp", "tensor"),
    ("vocab", "tensor"),
)


def initialize_distributed(coordinator_address=None, num_processes=None, process_id=None) -> None:
  """Starts JAX's multi-process runtime when this is one process of several.

  Explicit flags win. Otherwise JAX's own cluster detection decides (`detected_process_count`):
  Cloud TPU VM pods through the VM's metadata server, GKE TPU pods, SLURM, Open MPI, Kubernetes.
  A single process (one host, or a cluster of one) needs none of this and skips it.
  """
  explicit = coordinator_address is not None or num_processes is not None
  if explicit and (coordinator_address is None or num_processes is None or process_id is None):
    raise UserError("multi-process runs need all of --coordinator_address, --num_processes and "
                    "--process_id (or none of them on Cloud TPU / SLURM)")
  if explicit:
    kwargs = dict(coordinator_address=coordinator_address, num_processes=num_processes,
                  process_id=process_id)
  elif detected_process_count() > 1:
    kwargs = {}  # JAX detects the same cluster again and takes its parameters
  else:
    return
  # Another process of the job lost: one line on stderr, not the runtime's C++ stack dump.
  job_output.lost_peer_in_one_line()
  jax.distributed.initialize(**kwargs)
  if jax.devices()[0].platform == "cpu":
    job_output.drop_gloo_lines()


def detected_process_count() -> int:
  """How many processes the cluster JAX detects around this one has (1: none detected).

  Asks the cluster environments `jax.distributed.initialize()` itself tries, in its order, so
  that the two never disagree. Detecting starts nothing: `jax.distributed.initialize` on a
  single process would start a coordinator service (on a fixed port on TPU VMs) for nothing.
  """
  try:  # JAX keeps its detection private; its ClusterEnv interface has been stable since 0.4
    from jax._src import clusters
    environments = [env for env in clusters.ClusterEnv._cluster_types
                    if not env.opt_in_only_method]
  except (ImportError, AttributeError):  # a JAX without it: the variables its detection reads
    hosts = os.environ.get("TPU_PROCESS_ADDRESSES") or os.environ.get("TPU_WORKER_HOSTNAMES", "")
    return max(int(os.environ.get("SLURM_NTASKS", "1")), len(hosts.split(",")))
  present = next((env for env in environments if env.is_env_present()), None)
  return 1 if present is None else present.get_process_count()


# ----------------------------------------------------------------------------- the mesh


def mesh_shape(axes, device_count: int) -> dict:
  """{axis: size} for all of MESH_AXES from `config.mesh` ({axis: size}; at most one -1, which
  takes the devices left; an axis not given has size 1; no axes at all: data parallel)."""
  axes = dict(axes or {"data": -1})
  unknown = [name for name in axes if name not in MESH_AXES]
  if unknown:
    raise UserError(f"unknown mesh axes {unknown}; the mesh has the axes {list(MESH_AXES)} "
                    "(e.g. --config.mesh.fsdp=4)")
  sizes = list(axes.values())
  if sizes.count(-1) > 1 or any(size == 0 or size < -1 for size in sizes):
    raise UserError(f"config.mesh {axes}: sizes must be positive, with at most one -1")
  fixed = math.prod(size for size in axes.values() if size != -1)
  if -1 in axes.values():
    if device_count % fixed:
      raise UserError(f"config.mesh {axes}: the {device_count} devices do not split into "
                      f"groups of {fixed}; choose sizes whose product divides {device_count}")
    axes = {name: device_count // fixed if size == -1 else size for name, size in axes.items()}
  shape = {name: axes.get(name, 1) for name in MESH_AXES}
  if math.prod(shape.values()) != device_count:
    raise UserError(f"config.mesh {shape} has {math.prod(shape.values())} places for "
                    f"{device_count} devices; make the sizes multiply to {device_count} "
                    "(or set one axis to -1)")
  return shape


def make_mesh(axes=None, devices=None) -> jax.sharding.Mesh:
  """The device mesh of `config.mesh` over `devices` (default: every device of every process).

  Axis types are Auto, as this code expects (jax.make_mesh now defaults to Explicit);
  `jax.make_mesh` orders the devices by their physical links on TPU slices.
  """
  devices = jax.devices() if devices is None else list(devices)
  shape = mesh_shape(axes, len(devices))
  return jax.make_mesh(tuple(shape.values()), MESH_AXES,
                       axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices)


def describe_mesh(mesh: jax.sharding.Mesh) -> str:
  return " x ".join(f"{name} {size}" for name, size in mesh.shape.items())


@contextlib.contextmanager
def context(mesh: jax.sharding.Mesh):
  """The mesh and RULES in force while a model function is traced, so that the model's
  activation constraints (`axes.constrain`) take effect; outside it they do nothing."""
  with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
    yield


class MeshFunction:
  """A jitted function traced with its mesh and RULES in context (see `jit`)."""

  def __init__(self, jitted, mesh):
    self.jitted, self.mesh = jitted, mesh

  def __call__(self, *args, **kwargs):
    with context(self.mesh):
      return self.jitted(*args, **kwargs)

  def lower(self, *args, **kwargs):
    with context(self.mesh):
      return self.jitted.lower(*args, **kwargs)


def jit(fn, mesh, **jit_kwargs) -> MeshFunction:
  """`jax.jit(fn, **jit_kwargs)`, traced and run on `mesh` with the model's logical axis rules."""
  return MeshFunction(jax.jit(fn, **jit_kwargs), mesh)


# ----------------------------------------------------------------------------- shardings


def _divisible_spec(spec: P, shape, mesh) -> P:
  """`spec` without the mesh axes that do not divide their dimension (that dimension is then
  kept whole: a 50-token vocabulary on 4 tensor shards is replicated, not padded)."""
  kept = []
  for dim, axes in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
    names = (axes,) if isinstance(axes, str) else tuple(axes or ())
    size = math.prod(mesh.shape[name] for name in names)
    kept.append(axes if size > 1 and dim % size == 0 else None)
  return P(*kept)


def logical_shardings(boxed_tree, mesh) -> object:
  """NamedShardings for a pytree whose leaves are `nn.LogicallyPartitioned` boxes (or plain
  leaves, replicated), e.g. `jax.eval_shape` of an initialiser; the tree of the unboxed values."""
  specs = nn.logical_to_mesh(nn.get_partition_spec(boxed_tree), RULES)
  shapes = nn.unbox(boxed_tree)
  return jax.tree.map(lambda spec, x: NamedSharding(mesh, _divisible_spec(spec, x.shape, mesh)),
                      specs, shapes, is_leaf=lambda x: isinstance(x, P))


def replicated(mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def batch_sharding(mesh) -> NamedSharding:
  """Rows over data x fsdp; every other dimension whole."""
  return NamedSharding(mesh, P(BATCH_AXES))


def batch_shards(mesh) -> int:
  return math.prod(mesh.shape[name] for name in BATCH_AXES)


def shard_bytes(array: jax.Array) -> int:
  """Bytes of one device's shard of `array`."""
  return int(np.prod(array.sharding.shard_shape(array.shape))) * array.dtype.itemsize


# ----------------------------------------------------------------------------- batches


def padded_rows(rows: int, multiple: int) -> int:
  return -(-rows // multiple) * multiple


def pad_rows(batch: dict, rows: int) -> dict:
  """The batch with empty rows (all 0: padding, segment 0) appended up to `rows`.

  Empty rows carry no token, so they change no loss, gradient or metric; a batch of any row
  count can thus be split over any number of devices, and the real rows stay the same rows on
  every mesh.
  """
  return {k: np.pad(v, ((0, rows - len(v)),) + ((0, 0),) * (v.ndim - 1)) if len(v) < rows
          else v for k, v in batch.items()}


def process_row_indices(global_rows: int, mesh) -> np.ndarray:
  """The rows of a `global_rows`-row batch that this process's devices hold, in order.

  With one process: all of them. Every process derives the same global batch plan and needs
  to materialise only these rows (`shard_batch` reads no others).
  """
  index_map = batch_sharding(mesh).addressable_devices_indices_map((global_rows,))
  rows = set()
  for (row_slice,) in index_map.values():
    rows.update(range(*row_slice.indices(global_rows)))
  return np.asarray(sorted(rows), np.int64)


def shard_batch(batch: dict, mesh, multiple: int = 1) -> dict:
  """Places a host batch on the mesh, rows split over data x fsdp.

  `batch` holds every row of the global batch (or at least this process's rows,
  `process_row_indices`; only those are read). The rows are first padded with empty rows to a
  multiple of `multiple` times the batch shards (`pad_rows`).
  """
  rows = padded_rows(len(next(iter(batch.values()))), multiple * batch_shards(mesh))
  batch = pad_rows(batch, rows)
  sharding = batch_sharding(mesh)
  return {k: jax.make_array_from_callback(v.shape, sharding, lambda index, v=v: v[index])
          for k, v in batch.items()}


def to_host(tree):
  """Global arrays as NumPy arrays with every element, on every process (for host-side work
  such as detokenising; every process gets the same values)."""
  def fetch(x):
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
      return np.asarray(x)
    if x.sharding.is_fully_replicated:
      return np.asarray(x.addressable_data(0))
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return jax.tree.map(fetch, tree)


def place(tree, shardings):
  """Puts a host (or differently placed) pytree onto the mesh with `shardings`; with several
  processes every process passes the same full values."""
  if jax.process_count() == 1:
    return jax.device_put(tree, shardings)
  return jax.tree.map(
      lambda x, s: jax.make_array_from_callback(np.shape(x), s, lambda i: np.asarray(x)[i]),
      tree, shardings)


def mesh_of(tree) -> Optional[jax.sharding.Mesh]:
  """The mesh the arrays of `tree` live on (None for host arrays)."""
  for leaf in jax.tree.leaves(tree):
    sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, NamedSharding):
      return sharding.mesh
  return None
