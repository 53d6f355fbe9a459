"""What moves the bytes: the top kernels of a compiled train step by HBM bytes (and their FLOPs).

  python -m benchmarks.top_fusions --config=base --topology=v5e:2x4 [--batch_size=256] \
      [--mesh=data=8] [--top=15]

The train step is compiled for the target as `--mode=compile` compiles it (same batch rules, a
TPU slice or GPUs, on the CPU), and every top-level instruction of its optimised HLO (a fusion,
a cuBLAS call, a copy, a collective; the bodies of loops counted once) is charged the bytes of
its operands and results, as XLA's cost analysis charges a fusion, and the FLOPs of the matrix
products inside it (dots, GEMM calls, and the convolutions XLA:TPU writes them as). The top rows
are printed as a markdown table with the JAX operation XLA names (op_name) and the share of the
step's bytes. Everything is the compiler's plan, not a measurement; on GPUs not autotuned.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys

from transformer_jax.core import platforms

# Instructions that move no data of their own.
FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "call",
        "conditional", "after-all", "partition-id", "replica-id"}


def _bytes(shape: str, item_bytes: dict) -> float:
  """Bytes of every array in an HLO shape (a tuple's elements summed)."""
  total = 0.0
  for dtype, dims in re.findall(r"([a-z][a-z0-9]*)\[([\d,]*)\]", shape):
    count = 1
    for n in dims.split(","):
      count *= int(n) if n else 1
    total += count * item_bytes.get(dtype, 1)
  return total


def kernels(hlo: str, item_bytes: dict, matrix_products) -> list:
  """[(bytes, flops, name, op, op_name)] of every top-level instruction, largest bytes first."""
  instruction = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([\w\-]+)\((.*)$")
  # Computations a fusion or a reduction calls are inside a kernel, not kernels themselves.
  inner = set(re.findall(r"\b(?:calls|to_apply)=%?([\w.\-]+)", hlo))
  shapes, current, found, bodies, lines = {}, None, [], {}, {}
  for line in hlo.splitlines():
    header = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s+\(.*\{\s*$", line)
    if header and " = " not in line.split("(")[0]:
      current = header.group(1)
      bodies[current] = []
      continue
    match = instruction.match(line)
    if not match or current is None:
      continue
    name, shape, op, rest = match.groups()
    shapes[name] = _bytes(shape, item_bytes)
    bodies[current].append(line)
    lines[name] = line
    if current in inner or op in FREE:
      continue
    operands = re.findall(r"%([\w.\-]+)", rest.split(")", 1)[0])
    moved = shapes[name] + sum(shapes.get(o, 0.0) for o in operands)
    called = re.search(r"\bcalls=%?([\w.\-]+)", rest)
    # A fusion's body; an unfused instruction (XLA:TPU leaves some convolutions so) with the
    # definitions of its operands, which give the contracted sizes.
    inside = "\n".join(bodies.get(called.group(1), []) if called
                       else [lines[o] for o in operands if o in lines] + [line])
    flops = sum(p.flops for p in matrix_products(inside))
    op_name = re.search(r'op_name="([^"]*)"', rest)
    found.append((moved, flops, name, op, op_name.group(1) if op_name else ""))
  return sorted(found, reverse=True)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--config", required=True, help="an installed experiment, e.g. base")
  parser.add_argument("--topology", required=True, help="v5e:2x4, h100-8, ...")
  parser.add_argument("--mesh", default="", help="e.g. data=1,fsdp=8 (default: data parallel)")
  parser.add_argument("--batch_size", type=int, default=0)
  parser.add_argument("--length", type=int, default=64, help="source and target positions")
  parser.add_argument("--top", type=int, default=15)
  args = parser.parse_args(argv)
  platforms.quiet_compiler_logs()  # before JAX is imported
  platforms.cpu_only_unless_accelerated()
  from transformer_jax.core.errors import UserError
  from transformer_jax.tools import compile as compile_lib

  config = importlib.import_module(f"transformer_jax.experiments.{args.config}").get_config()
  config.compile.update(topology=args.topology, batch_size=args.batch_size,
                        source_len=args.length, target_len=args.length)
  for pair in filter(None, args.mesh.split(",")):
    axis, size = pair.split("=")
    config.mesh[axis] = int(size)
  try:
    model_config, mesh, spec, unit = compile_lib.target(config)
    lowered, shapes, _ = compile_lib.lower_train_step(config, model_config, mesh)
    compiled, note = compile_lib.compile_lowered(lowered, "the train step", spec.name, mesh)
  except UserError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  found = kernels(compiled.as_text(), compile_lib.ITEM_BYTES, compile_lib.matrix_products)
  total_bytes, total_flops = sum(k[0] for k in found), sum(k[1] for k in found)
  print(f"{args.config} on {args.topology} ({len(mesh.devices.flat)} x {spec.name}, mesh "
        f"{compile_lib.sharding.describe_mesh(mesh)}), batch {shapes}, per {unit}: "
        f"{len(found)} kernels, {total_bytes / 2**30:.2f} GiB and {total_flops / 1e12:.3f} "
        f"TFLOP (loop bodies once){'; ' + note if note else ''}")
  print("\n| bytes, MiB | share | GFLOP | FLOP/byte | kernel | JAX operation |")
  print("| --- | --- | --- | --- | --- | --- |")
  for moved, flops, name, op, op_name in found[:args.top]:
    # jit(train_step)/while/body/closed_call/...: the step and its accumulation loop, everywhere
    where = re.sub(r"^jit\([^)]*\)/(while/body/)?(closed_call/)?", "", op_name)
    print(f"| {moved / 2**20:,.1f} | {moved / total_bytes:.1%} | {flops / 1e9:,.1f} | "
          f"{flops / moved if moved else 0:,.0f} | {op} `{name}` | `{where[:90]}` |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
