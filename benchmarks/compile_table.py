"""The `--mode=compile` tables of docs/benchmarks.md: models x TPU slices or GPUs x meshes x
batches.

  python -m benchmarks.compile_table OUT_DIR [--models base,big,xl] [--topologies v5e:2x4,...]
  python -m benchmarks.compile_table OUT_DIR --topologies h100,h100-8   # NVIDIA GPUs
  python -m benchmarks.compile_table OUT_DIR --models xl --topologies h100-8 --meshes fsdp

Each row is one `transformer-jax --mode=compile` run in its own process (a compile of `big` takes
minutes on two cores, `xl` longer). Rows are appended to OUT_DIR/rows.jsonl as they finish and a
rerun skips the rows already there, so the table can be built over several sittings;
OUT_DIR/table.md is rewritten after every row. Every figure is the compiler's estimate for a
program it has not run, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

MODELS = ("base", "big", "xl")
TOPOLOGIES = ("v5e:2x4", "v5p:2x2x1", "v6e:2x4")
LENGTH = 64  # source and target positions of every compiled row (a typical WMT length bucket)
# Tokens per chip and side for the per-chip batch sweep (base and big); xl only the first. A GPU
# (80 GB or more of HBM, against 16 to 95 GiB a TPU chip) gets 4 times as many.
TOKENS_PER_CHIP = (2048, 8192)
TOKENS_PER_GPU = (8192, 32768)


def chips(topology: str) -> int:
  """Devices of a TPU slice (v5e:2x4) or of GPUs (h100, h100-8, h100-2x8)."""
  if ":" not in topology:
    size = topology.rsplit("-", 1)[-1]
    return product(size) if re.fullmatch(r"(\d+x)?\d+", size) else 1
  return product(topology.split(":")[1])


def product(dims: str) -> int:
  count = 1
  for n in dims.split("x"):
    count *= int(n)
  return count


def meshes(count: int) -> dict:
  """Data parallel, fully sharded data parallel, and FSDP with 2-way tensor parallelism (one
  device: data parallel alone, which is all of them)."""
  if count == 1:
    return {"data": {"data": 1, "fsdp": 1, "tensor": 1}}
  return {"data": {"data": count, "fsdp": 1, "tensor": 1},
          "fsdp": {"data": 1, "fsdp": count, "tensor": 1},
          "fsdp+tensor": {"data": 1, "fsdp": count // 2, "tensor": 2}}


def plan(models, topologies) -> list:
  rows = []
  for model in models:
    for topology in topologies:
      batches = TOKENS_PER_CHIP if ":" in topology else TOKENS_PER_GPU
      for mesh_name, mesh in meshes(chips(topology)).items():
        for tokens in batches[:1] if model == "xl" else batches:
          rows.append({"model": model, "topology": topology, "mesh_name": mesh_name,
                       "mesh": mesh, "tokens_per_chip": tokens,
                       "rows": chips(topology) * tokens // LENGTH})
  return rows


def key(row) -> str:
  return f"{row['model']} {row['topology']} {row['mesh_name']} {row['tokens_per_chip']}"


def run(row) -> dict:
  flags = [f"--config={row['model']}", "--mode=compile",
           f"--config.compile.topology={row['topology']}",
           f"--config.compile.batch_size={row['rows']}", f"--config.compile.source_len={LENGTH}",
           f"--config.compile.target_len={LENGTH}"]
  flags += [f"--config.mesh.{axis}={size}" for axis, size in row["mesh"].items()]
  start = time.time()
  done = subprocess.run([sys.executable, "-m", "transformer_jax", *flags], capture_output=True,
                        text=True)
  result = dict(row, wall_s=time.time() - start, returncode=done.returncode)
  if done.returncode == 0:
    result["report"] = json.loads(done.stdout.strip().splitlines()[-1])
  else:
    result["error"] = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
  return result


def _gib(n):
  return f"{n / 2**30:.2f}"


def table(results: list) -> str:
  """The rows as Markdown. Every step time, MFU and rate is the compiler's estimate (a
  roofline bound on a GPU, XLA's cost model or a roofline on a TPU), and where a GPU window
  measured the same model, its measured-to-estimate factor stands beside it (compile.MEASURED,
  with its source under the table)."""
  lines = ["| model | slice | mesh | tokens/chip/side | HBM per chip, GiB (params + optimizer "
           "+ temp) | fits | TFLOP per chip, compiled / formula | step (estimate) | MFU "
           "(estimate) | target tokens/s per chip (estimate) | measured / estimate |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  factors = False
  for r in results:
    mesh = " x ".join(str(r["mesh"][a]) for a in ("data", "fsdp", "tensor"))
    head = (f"| {r['model']} | {r['topology']} | {r['mesh_name']} ({mesh}) | "
            f"{r['tokens_per_chip']:,} |")
    if "report" not in r:
      needs = re.search(r"it needs (.*? over its [\d.]+ GiB)", r["error"])  # a GPU's
      hbm = (needs.group(1) if needs else
             r["error"].split("(Ran out of memory on HBM, ")[-1].split(")")[0] if (
                 "does not fit" in r["error"]) else r["error"][:80])
      lines.append(f"{head} {hbm} | no | | | | | |")
      continue
    t = r["report"]["train"]
    method = "cost model" if t["estimate"].startswith("XLA") else "roofline bound"
    factor = t.get("measured_factor")
    factors = factors or factor is not None
    lines.append(
        f"{head} {_gib(t['total_bytes'])} ({_gib(t['params_bytes'])} + "
        f"{_gib(t['optimizer_bytes'])} + {_gib(t['temp_bytes'])}) | "
        f"{'yes' if t['fits'] else 'no'} | "
        f"{t['compiled_flops'] / 1e12:.3f} / {t['model_flops'] / 1e12:.3f} | "
        f"{t['step_s'] * 1e3:.1f} ms ({method}) | "
        f"{t['mfu']:.1%} | {t['target_tokens_per_s']:,.0f} | "
        f"{f'{factor:.2f}x' if factor else '-'} |")
  lines.append("\nEvery step time, MFU and rate above is the compiler's estimate for a program it "
               "has not run, not a measurement.")
  if factors:
    from transformer_jax.tools.compile import MEASURED  # the measured steps, with their source
    lines.append("measured / estimate: how much slower a measured step of the same model was "
                 "than its own estimate (one GPU, the default step): " + "; ".join(
                     f"{m.model} {m.factor:.2f}x ({m.measured_ms:g} ms against {m.estimate_ms:g} "
                     f"ms at {m.tokens:,} tokens/side; {m.source})" for m in MEASURED))
  return "\n".join(lines) + "\n"


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("out")
  parser.add_argument("--models", default=",".join(MODELS))
  parser.add_argument("--topologies", default=",".join(TOPOLOGIES))
  parser.add_argument("--meshes", default="", help="only these meshes, e.g. fsdp,data")
  parser.add_argument("--tokens", default="", help="only these tokens per device, e.g. 8192")
  args = parser.parse_args()
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, "rows.jsonl")
  results = []
  if os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      results = [json.loads(line) for line in f if line.strip()]
  done = {key(r) for r in results}
  for row in plan(args.models.split(","), args.topologies.split(",")):
    if key(row) in done or (args.meshes and row["mesh_name"] not in args.meshes.split(",")) or (
        args.tokens and str(row["tokens_per_chip"]) not in args.tokens.split(",")):
      continue
    print(f"{key(row)} ...", flush=True)
    result = run(row)
    print(f"  {result.get('error') or 'ok'} ({result['wall_s']:.0f} s)", flush=True)
    results.append(result)
    with open(path, "a", encoding="utf-8") as f:
      f.write(json.dumps(result) + "\n")
    with open(os.path.join(args.out, "table.md"), "w", encoding="utf-8") as f:
      f.write(table(results))


if __name__ == "__main__":
  main()
