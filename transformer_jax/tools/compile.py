"""`--mode=compile`: the real train step (and a greedy decode step) compiled for a TPU slice or
NVIDIA GPUs on a machine without them, and what the compiler says of it: memory per chip against
the chip's HBM, FLOPs against the model's formula, and a step time estimated by XLA's cost model
(or, where that gives no usable number, a roofline). The way MaxText's `train_compile.py` checks a
config before a slice is paid for.

Everything printed is the compiler's estimate for a program it has not run: no measurement.
The roofline takes the larger of (compiled FLOPs / the chip's peak) and (bytes accessed / its
HBM bandwidth) and ignores communication between chips (ICI, NVLink, the network).

GPUs: XLA's GPU compiler, given a description of the part (model/gpus/PART.txtpb) instead of a
device, compiles for `--config.compile.topology=PART`, `PART-GPUS` (one host) or
`PART-HOSTSxGPUS`. Without a device nothing is autotuned (GEMMs get default tiles), and the
executable has no cost analysis: XLA's HLO cost analysis runs on its optimised module instead
(`optimized_cost`).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax import config as config_lib
from transformer_jax.core import platforms
from transformer_jax.core.errors import UserError
from transformer_jax.data import tasks
from transformer_jax.eval import decode
from transformer_jax.model import ModelConfig, flops
from transformer_jax.model.flops import GiB, chip, train_flops_per_step
from transformer_jax.train import sharding
from transformer_jax.train import state as state_lib
from transformer_jax.train import step as step_lib

# Cloud TPU accelerator-type names for the topologies `get_topology_desc` knows (v5p and v4
# names count TensorCores, two per chip).
ALIASES = {"v5litepod-4": "v5e:2x2", "v5litepod-8": "v5e:2x4", "v5e-4": "v5e:2x2",
           "v5e-8": "v5e:2x4", "v6e-4": "v6e:2x2", "v6e-8": "v6e:2x4", "v5p-8": "v5p:2x2x1",
           "v4-8": "v4:2x2x1"}
EXAMPLES = ("v5e:2x4, v5p:2x2x1, v6e:2x4, v4:2x2x1 (or v5litepod-8, v5p-8, v6e-8, v4-8), or "
            "GPUs: h100, h100-8, h100-2x8")
SAY = "compiler's estimates for a program it has not run, not measurements"
# XLA's description of each NVIDIA part it compiles for: model/gpus/PART.txtpb.
GPU_TARGETS = pathlib.Path(flops.__file__).parent / "gpus"
GPU_SAY = ("not autotuned (default GEMM tiles; temporaries depend on the GEMM backend chosen); "
           "NVLink and network transfers not counted")


class Measured(NamedTuple):
  """A train step a GPU window timed, beside the estimate `--mode=compile` gives for it."""
  model: str  # the experiment
  shape: tuple  # (d_model, d_ff, num_heads, encoder layers, decoder layers, vocab_size)
  device: str
  tokens: int  # per side
  measured_ms: float
  estimate_ms: float
  source: str

  @property
  def factor(self) -> float:
    return self.measured_ms / self.estimate_ms


# Every measured step with its estimate for the same part: docs/benchmarks.md, "The first GPU
# numbers" (H100) and "The second GPU window" (H200; its results.json is committed): the
# suite's base_bf16 and big_bf16 cases, bf16, plain attention, no remat; the estimates of the
# same steps compiled for h100 and h200 on the CPU. A later window adds its rows here.
BASE_SHAPE, BIG_SHAPE = (512, 2048, 8, 6, 6, 37000), (1024, 4096, 16, 6, 6, 37000)
MEASURED = (
    Measured("base", BASE_SHAPE, "H100", 25_600, 49.1, 24.3, "one H100, JAX 0.11.2, 2026-11-28"),
    Measured("big", BIG_SHAPE, "H100", 25_600, 99.5, 46.9, "one H100, JAX 0.11.2, 2026-11-28"),
    Measured("base", BASE_SHAPE, "H200", 25_600, 42.4, 17.0, "one H200, JAX 0.11.2, 2026-11-29"),
    Measured("big", BIG_SHAPE, "H200", 25_600, 90.7, 33.8, "one H200, JAX 0.11.2, 2026-11-29"),
)


def _shape(model_config: ModelConfig) -> tuple:
  c = model_config
  return (c.d_model, c.d_ff, c.num_heads, c.num_encoder_layers, c.num_decoder_layers,
          c.vocab_size)


def measured_for(model_config: ModelConfig, chip: str = "") -> Measured | None:
  """The measured step of a model of this shape, if a GPU window timed one: on `chip` (an
  H100, an H200) where one was, else on the first part that was."""
  same = [m for m in MEASURED if m.shape == _shape(model_config)]
  return next((m for m in same if m.device == chip), same[0] if same else None)


def honest_line(train: dict, model_config: ModelConfig, unit: str, chip: str = "") -> str:
  """What the step-time estimate is, and how far a measured step of the same model was from
  its own estimate, where one was measured (on `chip` where one was)."""
  kind = ("a roofline bound: the step cannot be faster on this part, a real one is slower"
          if train["estimate"].startswith("roofline") else "XLA's cost model")
  m = measured_for(model_config, chip) if unit == "GPU" else None
  if m is None:
    return (f"  the step time above is {kind}; no step of this model was measured on such a "
            "part yet, so nothing says how far from it a real step is")
  return (f"  the step time above is {kind}; measured: {m.model} on {m.source} took "
          f"{m.measured_ms:g} ms at {m.tokens:,} tokens/side where its estimate said "
          f"{m.estimate_ms:g} ms ({m.factor:.2f}x): read this estimate as about "
          f"{train['step_s'] * 1e3 * m.factor:.0f} ms, MFU {train['mfu'] / m.factor:.0%}")


def gpu_parts() -> list:
  return sorted(path.stem for path in GPU_TARGETS.glob("*.txtpb"))


def gpu_topology(name: str) -> tuple | None:
  """(part, hosts, GPUs per host) of a GPU topology name (h100, h100-8, h100-2x8), or None if
  `name` names no GPU part (a TPU slice)."""
  for part in sorted(gpu_parts(), key=len, reverse=True):  # a100-80g before a prefix of it
    if name != part and not name.startswith(part + "-"):
      continue
    match = re.fullmatch(r"(?:(\d+)x)?(\d+)", name[len(part) + 1:]) if name != part else None
    hosts, gpus = (int(match.group(1) or 1), int(match.group(2))) if match else (1, 1)
    if (name != part and not match) or hosts < 1 or gpus < 1:
      raise UserError(f"unknown GPU topology {name!r}: write PART, PART-GPUS or "
                      f"PART-HOSTSxGPUS (GPUs per host), e.g. {part}-8 or {part}-2x8; parts: "
                      f"{', '.join(gpu_parts())}")
    return part, hosts, gpus
  return None


def gpu_devices(part: str, hosts: int, gpus: int) -> list:
  """Compile-only devices of `hosts` x `gpus` NVIDIA GPUs of `part`, on any machine."""
  try:
    import jax_plugins.xla_cuda12  # noqa: F401  (the CUDA compiler; also to say what to install)
  except ImportError:
    raise UserError("--mode=compile needs the CUDA plugin of JAX to compile for GPUs: "
                    "pip install -e '.[gpu-compile]'") from None
  platforms.cpu_only_to_compile_for_gpus()  # before a backend starts
  from jax.experimental import topologies
  target = (GPU_TARGETS / f"{part}.txtpb").read_text(encoding="utf-8")
  try:
    return list(topologies.get_topology_desc(platform="cuda", topology=f"1x{hosts}x{gpus}",
                                             target_config=target).devices)
  except (NotImplementedError, RuntimeError) as e:  # a backend other than the CPU's started
    first = " ".join(str(e).split())[:200] or type(e).__name__
    raise UserError(f"JAX could not describe {hosts} x {gpus} {part} GPUs: {first}; run with "
                    "JAX_PLATFORMS=cpu") from None


def gpu_fit_error(what: str, spec, mesh, train: dict) -> UserError:
  """The GPU compiler leaves memory to the runtime: a program larger than the part's HBM
  compiles, and is refused here, as libtpu refuses it for a TPU."""
  return UserError(
      f"{what} does not fit {spec.name} HBM on mesh {sharding.describe_mesh(mesh)}: it needs "
      f"{_gib(train['total_bytes'])} per GPU (parameters {_gib(train['params_bytes'])} + "
      f"optimizer {_gib(train['optimizer_bytes'])} + temporaries {_gib(train['temp_bytes'])}), "
      f"{_gib(train['total_bytes'] - spec.hbm_bytes)} over its {_gib(spec.hbm_bytes)}; split the "
      "parameters and optimizer state with --config.mesh.fsdp (and --config.mesh.tensor), use "
      "--config.model.remat=full, or compile a smaller batch")


def topology_devices(name: str) -> list:
  """The devices of a TPU slice by topology name, from libtpu, on any machine."""
  if not name:
    raise UserError(f"--mode=compile needs --config.compile.topology, e.g. {EXAMPLES}")
  if not re.match(r"(v\d|tpu)", name):  # every TPU's name starts so; b200, l4 would be GPUs
    raise UserError(f"unknown topology {name!r}: no GPU part described here ("
                    f"{', '.join(gpu_parts())}: model/gpus/PART.txtpb) and no TPU slice; use "
                    f"e.g. {EXAMPLES}")
  try:
    import libtpu  # noqa: F401  (only to say what to install)
  except ImportError:
    raise UserError("--mode=compile needs libtpu to compile for TPUs: pip install -e '.[tpu]'"
                    ) from None
  platforms.quiet_tpu_compiler()  # before libtpu loads
  from jax.experimental import topologies
  try:
    return list(topologies.get_topology_desc(platform="tpu",
                                             topology_name=ALIASES.get(name, name)).devices)
  except Exception as e:  # JaxRuntimeError (INVALID_ARGUMENT: a bad name) or libtpu failing
    first = " ".join(str(e).split())[:200] or type(e).__name__
    if "INVALID_ARGUMENT" in first:
      raise UserError(f"unknown TPU topology {name!r} ({first.split(': ', 1)[-1]}); use e.g. "
                      f"{EXAMPLES}") from None
    raise UserError(f"libtpu could not describe the TPU topology {name!r}: {first}") from None


@dataclasses.dataclass
class Shapes:
  rows: int
  source_len: int
  target_len: int

  def __str__(self):
    return f"{self.rows} rows x (source {self.source_len} + target {self.target_len})"


def train_shapes(config, mesh) -> Shapes:
  """The batch the train step is compiled for: compile.* where set, else the largest batch the
  data config makes (the longest length bucket, or packed rows), padded for the mesh."""
  c, d = config.compile, config.data
  widest = tasks.batch_lengths(d)  # a side the task does not have stays empty
  source_len = (c.source_len or widest[0]) if widest[0] else 0
  target_len = (c.target_len or widest[1]) if widest[1] else 0
  if c.batch_size:
    rows = c.batch_size
  elif d.batching == "fixed":
    rows = d.batch_size
  else:
    rows = d.tokens_per_batch // max(source_len, target_len)
  accum = config.train.grad_accum_steps
  rows = rows // accum * accum
  if rows <= 0:
    raise UserError(f"the compiled batch has no row: data.tokens_per_batch "
                    f"({d.tokens_per_batch}) is shorter than one example; raise it or set "
                    "--config.compile.batch_size")
  return Shapes(sharding.padded_rows(rows, accum * sharding.batch_shards(mesh)), source_len,
                target_len)


def _abstract(shape, dtype, sharding_):
  return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding_)


def _fails_to_fit(error: Exception) -> str | None:
  """The compiler's out-of-memory message, or None if `error` is another failure. libtpu says
  e.g. "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO
  temporaries (203.94G) exceeds available HBM (15.75G)."
  """
  text = " ".join(str(error).split())
  if "RESOURCE_EXHAUSTED" not in text:
    return None
  text = text.split("RESOURCE_EXHAUSTED:", 1)[-1].strip().rstrip(".")
  return text[:300]


# Without autotuning, XLA:GPU's Triton GEMM emitter finds no tiling for some small matrix
# products ("Couldn't find output tile sizes"); such a program is compiled again with every GEMM
# through cuBLAS, and its estimates say so.
_CUBLAS_ONLY = {"xla_gpu_enable_triton_gemm": False}
CUBLAS_NOTE = "GEMMs through cuBLAS: XLA's untuned Triton GEMMs found no tiling"


def compile_lowered(lowered, what: str, chip_name: str, mesh, held: str = ""):
  """(the compiled program, a note on how it was compiled or "")."""
  try:
    try:
      return lowered.compile(), ""
    except Exception as e:
      if "find output tile sizes" not in str(e):
        raise
      return lowered.compile(compiler_options=_CUBLAS_ONLY), CUBLAS_NOTE
  except Exception as e:  # XlaRuntimeError: the program does not fit the chip, or worse
    if "PTX compilation provider" in str(e) or "libdevice not found" in str(e):
      raise UserError("XLA's GPU compiler finds no ptxas or libdevice (CUDA's nvcc): pip "
                      "install -e '.[gpu-compile]'") from None
    reason = _fails_to_fit(e)
    if reason is None:
      raise
    raise UserError(f"{what} does not fit {chip_name} HBM on mesh "
                    f"{sharding.describe_mesh(mesh)}{held} ({reason}); split the parameters "
                    "and optimizer state with --config.mesh.fsdp (and --config.mesh.tensor), "
                    "use --config.model.remat=full, or compile a smaller batch") from None


def _cost(compiled) -> dict:
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):  # older JAX: one dict per program
    cost = cost[0] if cost else {}
  return dict(cost or {}) or optimized_cost(compiled)


def optimized_cost(compiled) -> dict:
  """XLA's HLO cost analysis ("flops", "bytes accessed") of a compiled program's optimised
  module, for a compiler whose executable has none without a device (XLA:GPU).

  The analysis is XLA's generic one, run through the CPU client by a private jaxlib function
  (`hlo_module_cost_analysis`). It knows nothing of cuBLAS/cuDNN calls (each counts -1 FLOP and
  -1 byte): their FLOPs and the bytes of their operands and result come from the HLO text
  (`matrix_products`). Where a later jaxlib lacks the function, the FLOPs of every matrix
  product in the HLO text, without bytes. Either way a loop body counts once, as in XLA's own
  figures for TPUs."""
  text = compiled.as_text()
  products = matrix_products(text)
  try:
    from jax._src.lib import _jax
    module = compiled.runtime_executable().hlo_modules()[0]
    generic = _jax.hlo_module_cost_analysis(jax.devices("cpu")[0].client, module)
    calls = [p for p in products if p.call]
    return {"flops": generic["flops"] + sum(p.flops + 1 for p in calls),
            "bytes accessed": generic["bytes accessed"] + sum(p.bytes + 1 for p in calls)}
  except Exception:  # private: moved, renamed or changed
    return {"flops": sum(p.flops for p in products), "fallback": "FLOPs of the HLO's dots"}


class MatrixProduct(NamedTuple):
  flops: float
  bytes: float  # operands and result in HBM (cuBLAS/cuDNN calls only; a dot sits in a fusion)
  call: bool  # a cuBLAS/cuDNN custom call rather than a `dot` instruction


_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([\w\-]+)\((.*)$")
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([\d,]*)\]")
_GEMM_CALLS = ("__cublas$gemm", "__cublas$lt$matmul", "__cudnn$matmul")
ITEM_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
              "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}


def _array(shape: str) -> tuple[list, int]:
  """(dimensions, bytes per element) of an HLO shape, or of a tuple's first element."""
  match = _ARRAY.search(shape)
  if not match:
    return [], 0
  return ([int(n) for n in match.group(2).split(",") if n],
          ITEM_BYTES.get(match.group(1), 1))  # f8 types and the like: one byte


def _convolution_taps(rest: str, rhs: list) -> float:
  """Multiply-adds per output element of an HLO `convolution` (XLA:TPU writes every matrix
  product as one): the kernel's input features times its window's taps that land on the input,
  not on the holes of an lhs dilation (a batched product is a window of size B and dilation B
  over the batch: one tap)."""
  labels = re.search(r"dim_labels=[^_]+_([^-]+)->", rest)
  if not labels or "i" not in labels.group(1) or len(labels.group(1)) != len(rhs):
    return 0.0
  kernel = labels.group(1)
  taps = float(rhs[kernel.index("i")])
  window = re.search(r"window=\{([^}]*)\}", rest)
  fields = dict(re.findall(r"(\w+)=([\dx_-]+)", window.group(1))) if window else {}
  sizes = [int(n) for n in fields["size"].split("x")] if "size" in fields else []
  dilations = [int(n) for n in fields.get("lhs_dilate", "").split("x") if n]
  for j, size in enumerate(sizes):
    dilation = dilations[j] if j < len(dilations) else 1
    taps *= -(-size // dilation)
  return taps


def matrix_products(hlo: str) -> list:
  """Every matrix product of an optimised HLO module: `dot` instructions (in fusions too),
  `convolution`s (XLA:TPU's form of them) and cuBLAS/cuDNN GEMM calls, each with 2 x output
  elements x contracted size FLOPs."""
  arrays, found = {}, []
  for line in hlo.splitlines():
    instruction = _INSTRUCTION.match(line)
    if not instruction:
      continue
    name, shape, op, rest = instruction.groups()
    arrays[name] = _array(shape)
    target = re.search(r'custom_call_target="([^"]+)"', rest)
    call = op == "custom-call" and target is not None and target.group(1) in _GEMM_CALLS
    if op == "convolution":
      operands = re.findall(r"%([\w.\-]+)", rest.split(")", 1)[0])
      rhs = arrays.get(operands[1], ([], 0))[0] if len(operands) > 1 else []
      dims = arrays[name][0]
      outputs = float(np.prod(dims)) if dims else 1.0
      found.append(MatrixProduct(2.0 * outputs * _convolution_taps(rest, rhs), 0.0, False))
      continue
    if op == "dot":
      contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", rest)
    elif call:
      contracting = re.search(r'"lhs_contracting_dimensions":\[([\d",]*)\]', rest)
    else:
      continue
    operands = re.findall(r"%([\w.\-]+)", rest.split(")", 1)[0])
    lhs = arrays.get(operands[0], ([], 0))[0] if operands else []
    size = 1
    for axis in re.findall(r"\d+", contracting.group(1)) if contracting else []:
      size *= lhs[int(axis)] if int(axis) < len(lhs) else 1
    dims, item = arrays[name]
    outputs = float(np.prod(dims)) if dims else 1.0
    moved = outputs * item + sum(float(np.prod(arrays[o][0])) * arrays[o][1]
                                 for o in operands if o in arrays)
    found.append(MatrixProduct(2.0 * outputs * size, moved if call else 0.0, call))
  return found


def estimate_seconds(cost: dict, spec) -> tuple[float, str]:
  """(seconds, which estimate): XLA's cost model where it gives a positive time, else the
  roofline max(flops / peak, bytes accessed / HBM bandwidth)."""
  optimal = float(cost.get("optimal_seconds", -1.0))
  if optimal > 0:
    return optimal, "XLA cost model (optimal_seconds)"
  flops, accessed = float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0))
  compute, memory = flops / spec.peak_flops, accessed / spec.hbm_bytes_per_s
  bound = "compute" if compute >= memory else "HBM bandwidth"
  if "fallback" in cost:  # no bytes: the compute time alone
    return compute, f"roofline of FLOPs alone ({cost['fallback']}; no cost analysis)"
  why = (f" (XLA's cost model gave {optimal:.3g} s: not usable)" if "optimal_seconds" in cost
         else "")
  return max(compute, memory), f"roofline, {bound}-bound{why}"


def _memory(compiled) -> dict:
  m = compiled.memory_analysis()
  args, out = m.argument_size_in_bytes, m.output_size_in_bytes
  alias, temp = m.alias_size_in_bytes, m.temp_size_in_bytes
  return {"argument_bytes": args, "output_bytes": out, "alias_bytes": alias, "temp_bytes": temp,
          "total_bytes": args + out - alias + temp}


def _state_bytes_per_chip(abstract_state) -> tuple[int, int]:
  """(parameter bytes, optimizer-state bytes) that one chip holds."""
  def held(tree):
    return sum(int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize
               for x in jax.tree.leaves(tree))
  return held(abstract_state.params), held(abstract_state.opt_state)


def abstract_train_state(config, model_config: ModelConfig, mesh):
  """The train state's shapes, dtypes and shardings on `mesh`, without any array."""
  optimizer = state_lib.make_optimizer(config.train, model_config.d_model)
  return state_lib.abstract_state(model_config, optimizer, mesh)


def lower_train_step(config, model_config: ModelConfig, mesh, state=None) -> tuple:
  """(the train step lowered on an abstract state (`state`, or the config's) and batch for
  `mesh`, the batch's Shapes, the abstract state)."""
  step = step_lib.make_train_step(model_config, config, mesh)
  state = state if state is not None else abstract_train_state(config, model_config, mesh)
  shapes = train_shapes(config, mesh)
  rows = sharding.batch_sharding(mesh)
  keys = ("inputs", "targets")
  if config.data.batching == "packed":
    keys += ("inputs_segmentation", "targets_segmentation", "inputs_position", "targets_position")
  batch = {k: _abstract((shapes.rows, shapes.source_len if k.startswith("inputs") else
                         shapes.target_len), jnp.int32, rows) for k in keys}
  rng = _abstract((2,), jnp.uint32, sharding.replicated(mesh))
  return step.lower(state, batch, rng), shapes, state


def state_fit_error(spec, mesh, params_bytes: int, optimizer_bytes: int,
                    unit: str) -> UserError | None:
  """The refusal of a model whose parameters and optimizer state alone (the train step's
  arguments, which it holds throughout) exceed the chip's HBM, or None: said before anything
  is compiled, since no batch, remat or GEMM backend makes such a step fit."""
  held = params_bytes + optimizer_bytes
  if held <= spec.hbm_bytes:
    return None
  return UserError(
      f"the train step does not fit {spec.name} HBM on mesh {sharding.describe_mesh(mesh)}: "
      f"its parameters ({_gib(params_bytes)}) and optimizer state ({_gib(optimizer_bytes)}) "
      f"alone take {_gib(held)} per {unit}, {_gib(held - spec.hbm_bytes)} over its "
      f"{_gib(spec.hbm_bytes)}, before any activation; split them with --config.mesh.fsdp "
      "(and --config.mesh.tensor), or compile a smaller model")


def compile_train_step(config, model_config: ModelConfig, mesh, spec,
                       unit: str = "chip") -> dict:
  state = abstract_train_state(config, model_config, mesh)
  params_bytes, optimizer_bytes = _state_bytes_per_chip(state)
  refusal = state_fit_error(spec, mesh, params_bytes, optimizer_bytes, unit)
  if refusal is not None:
    raise refusal
  lowered, shapes, _ = lower_train_step(config, model_config, mesh, state)
  held = (f", where each chip holds parameters of {_gib(params_bytes)} and optimizer state of "
          f"{_gib(optimizer_bytes)}")
  start = time.perf_counter()
  compiled, note = compile_lowered(lowered, "the train step", spec.name, mesh, held)
  seconds_to_compile = time.perf_counter() - start
  cost, memory = _cost(compiled), _memory(compiled)
  chips = mesh.devices.size
  # A loop body counts once in XLA's figures: gradient accumulation runs it accum times.
  accum = config.train.grad_accum_steps
  cost["flops"] = float(cost.get("flops", 0.0)) * accum
  cost["bytes accessed"] = float(cost.get("bytes accessed", 0.0)) * accum
  seconds, method = estimate_seconds(cost, spec)
  method += f"; {note}" if note else ""
  model_flops = train_flops_per_step(model_config, shapes.rows, shapes.source_len,
                                     shapes.target_len)
  return {
      "batch": str(shapes), "compile_s": seconds_to_compile,
      "params_bytes": params_bytes, "optimizer_bytes": optimizer_bytes, **memory,
      "hbm_bytes": spec.hbm_bytes, "fits": memory["total_bytes"] <= spec.hbm_bytes,
      "compiled_flops": cost["flops"], "model_flops": model_flops / chips,
      "bytes_accessed": cost["bytes accessed"], "step_s": seconds, "estimate": method,
      "mfu": model_flops / chips / (seconds * spec.peak_flops),
      "target_tokens_per_s": shapes.rows * shapes.target_len / seconds / chips,
      "source_tokens_per_s": shapes.rows * shapes.source_len / seconds / chips,
  }


def compile_decode_step(config, model_config: ModelConfig, mesh, spec) -> dict | None:
  """One position of greedy decoding with a full KV cache: memory and tokens/s per chip (None
  for an encoder-only model, which does not decode). A decoder-only model's cache also holds
  the prompt, "source EOS BOS"."""
  if model_config.arch == "encoder_only":
    return None
  cfg = model_config.replace(deterministic=True)
  optimizer = state_lib.make_optimizer(config.train, model_config.d_model)
  params = state_lib.abstract_state(model_config, optimizer, mesh).params
  rows = sharding.padded_rows(config.compile.decode_batch, sharding.batch_shards(mesh))
  source_len, length = tasks.batch_lengths(config.data)[0], config.data.max_target_len
  if cfg.arch == "decoder_only":
    source_len += 1  # the prompt's BOS
  batch, replicated = sharding.batch_sharding(mesh), sharding.replicated(mesh)
  source = _abstract((rows, source_len), jnp.int32, batch)
  begin = jax.eval_shape(lambda p, s: decode.start(p, cfg, s, length), params, source)
  place = lambda x: _abstract(x.shape, x.dtype, batch if x.ndim else replicated)
  cache, context = jax.tree.map(place, begin.cache), jax.tree.map(place, begin.context)
  tokens = _abstract((rows,), jnp.int32, batch)

  def one_position(params, cache, context, tokens, positions):
    logits, cache = decode.decode_step(params, cfg, cache, context, tokens, positions)
    return jnp.argmax(logits, axis=-1), cache

  step = sharding.jit(one_position, mesh, donate_argnums=(1,))
  compiled, note = compile_lowered(step.lower(params, cache, context, tokens, tokens),
                                   "the decode step", spec.name, mesh)
  cost, memory = _cost(compiled), _memory(compiled)
  seconds, method = estimate_seconds(cost, spec)
  method += f"; {note}" if note else ""
  return {"batch": f"{rows} rows, cache of {length} positions", **memory,
          "fits": memory["total_bytes"] <= spec.hbm_bytes, "step_s": seconds,
          "estimate": method, "tokens_per_s": rows / seconds / mesh.devices.size}


def _gib(n: float) -> str:
  return f"{n / GiB:.2f} GiB"


def report(name: str, mesh, train: dict, decode_: dict, spec, unit: str = "chip") -> str:
  spare = spec.hbm_bytes - train["total_bytes"]
  fit = (f"fits, {_gib(spare)} to spare" if spare >= 0 else
         f"DOES NOT FIT, {_gib(-spare)} over")
  roofline = (f"dense bf16 peak {spec.peak_flops / 1e12:,.0f} TFLOP/s and HBM "
              f"{spec.hbm_bytes_per_s / 1e12:.2f} TB/s per {unit}")
  lines = [
      f"compiled for {name}: {mesh.devices.size} x {spec.name}, mesh "
      f"{sharding.describe_mesh(mesh)}; the {SAY}"
      + (f"; {GPU_SAY}" if unit == "GPU" else ""),
      f"train step, batch {train['batch']}, compiled in {train['compile_s']:.1f} s on this machine",
      f"  memory per {unit}: parameters {_gib(train['params_bytes'])} + optimizer "
      f"{_gib(train['optimizer_bytes'])} + temporaries {_gib(train['temp_bytes'])} = "
      f"{_gib(train['total_bytes'])} of {_gib(spec.hbm_bytes)} HBM: {fit}",
      f"  FLOPs per {unit}: compiled {train['compiled_flops'] / 1e12:.3f} T, model formula "
      f"{train['model_flops'] / 1e12:.3f} T",
      f"  step time {train['step_s'] * 1e3:.1f} ms ({train['estimate']}; {roofline}): MFU "
      f"{train['mfu']:.1%}, {train['target_tokens_per_s']:,.0f} target tokens/s per {unit}",
  ]
  if decode_ is None:
    lines.append("no decode step: an encoder-only model does not decode")
  else:
    lines.append(f"greedy decode step, {decode_['batch']}: {_gib(decode_['total_bytes'])} per "
                 f"{unit}, {decode_['step_s'] * 1e3:.2f} ms ({decode_['estimate']}): "
                 f"{decode_['tokens_per_s']:,.0f} tokens/s per {unit}")
  return "\n".join(lines)


def target(config) -> tuple:
  """(the model config, the mesh of compile-only devices, their Chip, "GPU" or "chip") of
  config.compile.topology and config.mesh."""
  name = config.compile.topology
  gpus = gpu_topology(name) if name else None
  devices = gpu_devices(*gpus) if gpus else topology_devices(name)
  model_config = config_lib.validate(config, platform="gpu" if gpus else "tpu")  # bfloat16
  spec = chip(devices[0])
  if spec is None:
    raise UserError(f"no HBM and peak figures for device kind {devices[0].device_kind!r}; "
                    f"use one of {EXAMPLES}")
  return (model_config, sharding.make_mesh(config.mesh.to_dict(), devices), spec,
          "GPU" if gpus else "chip")


def run_compile(config) -> dict:
  """Everything `--mode=compile` prints; the last stdout line is one JSON object."""
  name = config.compile.topology
  model_config, mesh, spec, unit = target(config)
  gpus, devices = unit == "GPU", list(mesh.devices.flat)
  print(f"compiling for {name} ({len(devices)} x {spec.name}), mesh "
        f"{sharding.describe_mesh(mesh)}...", flush=True)
  train = compile_train_step(config, model_config, mesh, spec, unit)
  if gpus and not train["fits"]:
    raise gpu_fit_error("the train step", spec, mesh, train)
  decode_ = compile_decode_step(config, model_config, mesh, spec)
  print(report(name, mesh, train, decode_, spec, unit), flush=True)
  print(honest_line(train, model_config, unit, spec.name), flush=True)
  measured = measured_for(model_config, spec.name) if gpus else None
  if measured is not None:
    train["measured_factor"] = measured.factor
  result = {"topology": name, "chips": len(devices), "chip": spec.name,
            "platform": "gpu" if gpus else "tpu", "mesh": dict(mesh.shape),
            "note": SAY + (f"; {GPU_SAY}" if gpus else ""), "train": train, "decode": decode_}
  print(json.dumps(result), flush=True)
  return result
