"""The compiled operations that take the time in a `jax.profiler` trace (train.profile_steps).

A trace directory (WORKDIR/tensorboard/plugins/profile/RUN/) holds HOST.xplane.pb, the profiler's
XSpace: planes (a host, each device) of lines (threads, streams) of events. The events of
compiled XLA code carry the stats `hlo_module` (the jitted program, e.g. jit_train_step) and
`hlo_op` (the fused operation); on a CPU they run on the runtime's threads, on a GPU or TPU on
the device planes. Their times are summed per operation over every line, so on a CPU, where one
step's operations run on several threads at once, the total may exceed the wall time. The train
step of each batch shape is a program of its own under the same name; their operations of the
same name are summed together.

  python -m transformer_jax.tools.profile WORKDIR [--top=N] [--module=SUBSTRING] [--json]

WORKDIR: a workdir trained with --config.train.profile_steps=N (or any directory or .xplane.pb
file of a jax.profiler trace); the newest trace under it is read. --module keeps the programs
whose name contains it (default train_step, the train step's program; "" = all). With the
traced program's HLO beside the trace (train.profile_steps and benchmark.profile write it), it
prints the top kernels by device time, each with its category and its share of the step (the
kernels' time plus the idle gaps between them), and the step's time by category; --json adds
those numbers as one JSON line (the GPU suite reads it).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
from typing import NamedTuple, Optional

from transformer_jax.core import platforms
from transformer_jax.core.errors import UserError
from transformer_jax.train.actions import Profiler

TRACE_SUFFIX = ".xplane.pb"
PROGRAM_FILE = Profiler.PROGRAM_FILE  # the traced program's HLO, beside the trace


class OpTime(NamedTuple):
  module: str  # the jitted program (HLO module)
  op: str  # the HLO operation (usually a fusion)
  calls: int  # events: executions of the operation, over every step traced
  seconds: float  # summed over its events


def find_trace(path: str) -> str:
  """The newest HOST.xplane.pb at or under `path` (a workdir, its tensorboard/ or a trace
  directory, or the file itself)."""
  if os.path.isfile(path):
    return path
  found = glob.glob(os.path.join(glob.escape(path), "**", "*" + TRACE_SUFFIX), recursive=True)
  if not found:
    raise UserError(f"no profiler trace (*{TRACE_SUFFIX}) under {path}; train with "
                    "--config.train.profile_steps=N to take one")
  return max(found, key=os.path.getmtime)


def _stats(event) -> dict:
  return {name: value for name, value in event.stats}


# Lines the profiler derives from the others (TSL's xplane schema): on a TPU's plane "XLA Ops"
# holds the kernels; on a GPU's plane the streams do, and these repeat them grouped.
DERIVED_LINES = ("Steps", "XLA Modules", "XLA Ops", "Async XLA Ops", "XLA TraceMe",
                 "TensorFlow Name Scope", "TensorFlow Ops", "Framework Name Scope",
                 "Framework Ops", "Source code", "Launch Stats")


def _load(trace_file: str):
  import jax  # the profiler's reader; imported here, as only this tool needs it
  return jax.profiler.ProfileData.from_file(trace_file)


def _is_kernel(event, module: Optional[str]) -> bool:
  stats = _stats(event)
  program = str(stats.get("hlo_module") or "")
  return bool(stats.get("hlo_op")) and bool(program) and (not module or module in program)


def kernel_lines(data, module: Optional[str] = None) -> list:
  """[(plane, its lines that hold the program's kernels)], each kernel counted once: on a GPU
  the device planes' streams, on a TPU their "XLA Ops" line (the host's annotations of the same
  operations left out); on a CPU, where the host runs the kernels, every line of the host."""
  def has_kernels(line):
    return any(_is_kernel(e, module) for e in line.events)

  devices = [p for p in data.planes if p.name.startswith("/device:")
             and any(has_kernels(line) for line in p.lines)]
  if not devices:
    return [(p, list(p.lines)) for p in data.planes]
  chosen = []
  for plane in devices:
    streams = [line for line in plane.lines
               if line.name not in DERIVED_LINES and has_kernels(line)]
    chosen.append((plane, streams or [line for line in plane.lines if line.name == "XLA Ops"]))
  return chosen


# A GPU program that XLA runs as CUDA graphs (command buffers, on by default since JAX 0.5)
# marks every kernel inside a graph with the graph's thunk as its `hlo_op` ("command_buffer_1": on
# the H200 with JAX 0.11.2 a whole train step is one graph); the kernel's own name then tells
# which fusion it runs (XLA names a fusion's kernel after the instruction, "." and "-" as "_":
# fusion.12 -> fusion_12), or which library it comes from (cuBLAS's nvjet/xmma/cutlass GEMMs,
# cuDNN's fused attention).
COMMAND_BUFFER = "command_buffer"


def kernel_op(hlo_op: str, kernel: str) -> str:
  """The operation a kernel event stands for: its `hlo_op`, or, inside a CUDA graph, the
  kernel's own name."""
  return kernel if hlo_op.startswith(COMMAND_BUFFER) and kernel else hlo_op


def op_times(trace_file: str, module: Optional[str] = None, data=None) -> list[OpTime]:
  """Every compiled operation of the trace, with its time, the longest first. module: only
  those of programs whose name contains it (e.g. "train_step"). data: the trace as read
  (jax.profiler.ProfileData), instead of the file."""
  data = data if data is not None else _load(trace_file)
  totals = {}
  for _, lines in kernel_lines(data, module):
    for line in lines:
      for event in line.events:
        if not _is_kernel(event, module):
          continue
        stats = _stats(event)
        key = (str(stats["hlo_module"]), kernel_op(str(stats["hlo_op"]), event.name))
        calls, ns = totals.get(key, (0, 0.0))
        totals[key] = (calls + 1, ns + event.duration_ns)
  rows = [OpTime(program, op, calls, ns / 1e9) for (program, op), (calls, ns) in totals.items()]
  return sorted(rows, key=lambda r: (-r.seconds, r.module, r.op))


# ----------------------------------------------------------------------------- categories

# What a kernel does, from the op names of the instructions it runs (the fusion's body, or the
# one instruction): the Flax module path and the named scopes of the model and the train step
# ("dropout", "softmax", "loss", "optimizer"; model/attention.py, train/step.py). The first
# category whose mark one of them carries is the kernel's: a fusion that draws dropout bits and
# scales a softmax counts as dropout. Matrix products come first: a kernel with a dot (or a
# cuBLAS/cuDNN call) is a product, the attention's own (its einsums, fused attention) apart.
# A mark is a component of the op name's path ("jvp(loss)" and "transpose(jvp(loss))" have the
# component "loss"); "norm" matches every component that ends in it (final_norm, ...).
CATEGORIES = (
    ("attention products", ("bqhd,bkhd->bhqk", "bhqk,bkhd->bqhd", "dot_product_attention")),
    ("matrix products", ()),  # any other dot, convolution or GEMM call
    ("optimizer update", ("optimizer",)),
    ("loss", ("loss",)),
    ("dropout", ("dropout",)),
    ("softmax", ("softmax",)),
    ("layer norm", ("norm",)),
    ("copies and layout", ()),  # copy, transpose, bitcast kernels
    ("other", ()),
)
IDLE = "idle (no kernel running)"
CONTROL_FLOW = ("while", "conditional", "call")
_PRODUCTS = ("dot(", "convolution(", "gemm", "cublas", "cudnn", "fmha")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = .*?\b([a-z][\w\-]*)\(")
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")


def kernels(hlo_text: str) -> dict:
  """{instruction name: the text of the instructions it runs} for every instruction of an
  optimised HLO module: a fusion's body (its called computations, nested ones included) or the
  instruction's own line."""
  bodies, lines, current = {}, {}, None
  for line in hlo_text.splitlines():
    if current is None:
      if found := _COMPUTATION.match(line):
        current = found.group(1)
        bodies[current] = []
      continue
    if line.strip() == "}":
      current = None
      continue
    bodies[current].append(line)
    if found := _INSTRUCTION.match(line):
      lines[found.group(1)] = line

  def text(line: str, depth: int = 0) -> str:
    called = [c for c in _CALLS.findall(line) if c in bodies] if depth < 4 else []
    return "\n".join([line] + [text(inner, depth + 1) for c in called for inner in bodies[c]])

  return {name: text(line) for name, line in lines.items()}


def _components(op_name: str) -> set:
  return {c for c in re.split(r"[/()]", op_name) if c}


def _marked(components: set, mark: str) -> bool:
  return any(c.endswith(mark) for c in components) if mark == "norm" else mark in components


def category(text: str) -> str:
  """The category (CATEGORIES) of a kernel that runs the instructions of `text`."""
  names = _OP_NAME.findall(text)
  if any(mark in text for mark in _PRODUCTS):
    products = [n for n in names if "dot_general" in n or "->" in n] or names
    if "fmha" in text or any(_marked(_components(n), mark) for n in products
                             for mark in CATEGORIES[0][1]):
      return CATEGORIES[0][0]
    return CATEGORIES[1][0]
  components = [_components(n) for n in names]
  for name, marks in CATEGORIES[2:7]:
    if any(_marked(c, mark) for c in components for mark in marks):
      return name
  first = _INSTRUCTION.match(text.splitlines()[0]) if text else None
  if first and first.group(2) in ("copy", "transpose", "bitcast", "copy-start", "copy-done"):
    return "copies and layout"
  return "other"


def idle_seconds(trace_file: str, module: Optional[str] = None, data=None) -> float:
  """Time inside the traced span of the program's kernels when none of them ran: on each
  device (a plane; on a CPU, the host) the span from its first kernel's start to its last one's
  end, less the union of its kernels' intervals over all its lines (streams, threads)."""
  data = data if data is not None else _load(trace_file)
  idle = 0.0
  for _, lines in kernel_lines(data, module):
    spans = sorted((e.start_ns, e.end_ns) for line in lines for e in line.events
                   if _is_kernel(e, module))
    if not spans:
      continue
    busy, (start, end) = 0.0, spans[0]
    for a, b in spans[1:]:
      if a > end:
        busy, start = busy + end - start, a
      end = max(end, b)
    busy += end - start
    idle += max(b for _, b in spans) - spans[0][0] - busy
  return idle / 1e9


# Kernels of libraries, by their names, when the HLO does not name them (inside a CUDA graph):
# cuDNN's fused attention first (its kernels' names carry "fmha", "sdpa" or "flash"), then
# cuBLAS/cuBLASLt's GEMMs (names starting nvjet on Hopper, xmma/cutlass/gemm elsewhere).
# Which instruction called a cuBLAS GEMM is not in the trace, so the attention's own einsums
# done by cuBLAS count as matrix products there.
_LIBRARY_KERNELS = (
    ("attention products", re.compile(r"cudnn.*(fmha|flash|attn|sdpa)|fmha|sdpa|flash_?attn",
                                      re.I)),
    ("matrix products", re.compile(r"^(nvjet|sm\d+_xmma|cutlass|ampere_|hopper_|.*gemm|"
                                   r"cublas)", re.I)),
)


def library_category(kernel: str) -> Optional[str]:
  """The category of a library's kernel (cuBLAS, cuDNN) by its name, or None."""
  return next((name for name, pattern in _LIBRARY_KERNELS if pattern.search(kernel)), None)


def categorized(rows: list[OpTime], hlo_text: str) -> tuple:
  """([(row, its category)] of the kernels, control-flow operations left out: their bodies'
  kernels are rows of their own; the number of kernels not found in the HLO, counted as
  other). A kernel of a CUDA graph is found by its name (an instruction's, "." and "-" as "_")
  or, a library's, by library_category."""
  found = kernels(hlo_text)
  by_kernel_name = {re.sub(r"[.\-]", "_", name): text for name, text in found.items()}
  result, unknown = [], 0
  for row in rows:
    if row.op.startswith(CONTROL_FLOW):
      continue
    text = found.get(row.op) or by_kernel_name.get(row.op)
    if text is not None:
      result.append((row, category(text)))
      continue
    library = library_category(row.op)
    unknown += library is None
    result.append((row, library or "other"))
  return result, unknown


def _by_category(rows: list[OpTime], hlo_text: str, idle_s: float) -> tuple:
  """({category: seconds} with IDLE, {category: kernels}, kernels not found in the HLO)."""
  seconds, calls = {}, {}
  found, unknown = categorized(rows, hlo_text)
  for row, name in found:
    seconds[name] = seconds.get(name, 0.0) + row.seconds
    calls[name] = calls.get(name, 0) + 1
  seconds[IDLE] = idle_s
  return seconds, calls, unknown


def steps_traced(rows: list[OpTime]) -> int:
  """How many steps the trace holds: the fewest executions of any kernel (a step runs each of
  its kernels at least once; the optimizer's, for one, exactly once)."""
  counts = [r.calls for r in rows if not r.op.startswith(CONTROL_FLOW)]
  return max(1, min(counts)) if counts else 1


def category_seconds(rows: list[OpTime], hlo_text: str, idle_s: float,
                     shares: bool = False) -> dict:
  """{category: seconds} (CATEGORIES' order, IDLE last), or each one's share of their sum."""
  seconds = _by_category(rows, hlo_text, idle_s)[0]
  total = sum(seconds.values()) or 1.0
  return {name: seconds[name] / total if shares else seconds[name]
          for name in [c for c, _ in CATEGORIES] + [IDLE] if name in seconds}


def category_table(rows: list[OpTime], hlo_text: str, idle_s: float) -> str:
  """Device time by category (CATEGORIES, with the idle gaps), as a share of the kernels' time
  plus the gaps. On a CPU, where kernels run on several threads at once, the shares are of the
  summed thread time."""
  seconds, calls, unknown = _by_category(rows, hlo_text, idle_s)
  total = sum(seconds.values()) or 1.0
  steps = steps_traced(rows)
  lines = ["| category | kernels | ms per step | share of the step |",
           "| --- | ---: | ---: | ---: |"]
  for name in [c for c, _ in CATEGORIES] + [IDLE]:
    if name in seconds:
      lines.append(f"| {name} | {calls.get(name, '')} | {seconds[name] * 1e3 / steps:.2f} | "
                   f"{seconds[name] / total:.1%} |")
  if unknown:
    lines.append(f"\n{unknown} of {len(rows)} operations not in the program's HLO: counted as "
                 "other")
  return "\n".join(lines)


def summary(rows: list[OpTime], hlo_text: str, idle_s: float, top: int = 15) -> dict:
  """The profile as numbers: steps traced, the device time of a step (kernels plus idle gaps),
  each category's share of it, and the `top` kernels by device time with their category and
  share (the same denominator: kernels' time plus the gaps)."""
  found, _ = categorized(rows, hlo_text)
  steps = steps_traced(rows)
  total = sum(r.seconds for r, _ in found) + idle_s or 1.0
  return {"steps": steps, "step_device_ms": total * 1e3 / steps,
          "idle_share": idle_s / total,
          "categories": category_seconds(rows, hlo_text, idle_s, shares=True),
          "top": [{"op": r.op, "category": name, "calls_per_step": r.calls / steps,
                   "ms_per_step": r.seconds * 1e3 / steps, "share": r.seconds / total}
                  for r, name in found[:top]]}


def top_table(profile: dict) -> str:
  """`summary`'s top kernels as a Markdown table: each with its category and share of the
  step."""
  lines = ["| kernel | category | calls per step | ms per step | share of the step |",
           "| --- | --- | ---: | ---: | ---: |"]
  lines += [f"| `{k['op']}` | {k['category']} | {k['calls_per_step']:g} | "
            f"{k['ms_per_step']:.3f} | {k['share']:.1%} |" for k in profile["top"]]
  lines.append(f"\n{profile['steps']} steps traced; a step is {profile['step_device_ms']:.2f} "
               f"ms of device time, {profile['idle_share']:.1%} of it idle (no kernel running)")
  return "\n".join(lines)


def table(rows: list[OpTime], top: int = 15) -> str:
  """The `top` operations as a Markdown table, each with its share of all compiled time (for a
  trace without its program's HLO: no categories, no idle gaps)."""
  total = sum(r.seconds for r in rows) or 1.0
  lines = ["| operation | program | calls | total ms | ms per call | share |",
           "| --- | --- | ---: | ---: | ---: | ---: |"]
  lines += [f"| `{r.op}` | {r.module} | {r.calls} | {r.seconds * 1e3:.2f} | "
            f"{r.seconds * 1e3 / r.calls:.3f} | {r.seconds / total:.1%} |" for r in rows[:top]]
  lines.append(f"\n{len(rows)} operations, {total * 1e3:.1f} ms of compiled code in all")
  return "\n".join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m transformer_jax.tools.profile",
                                   description=__doc__.splitlines()[0])
  parser.add_argument("workdir")
  parser.add_argument("--top", type=int, default=15)
  parser.add_argument("--module", default="train_step")
  parser.add_argument("--json", action="store_true",
                      help="also print the profile's numbers as one JSON line, last")
  args = parser.parse_args(argv)
  platforms.cpu_only_unless_accelerated()  # reading a trace needs no accelerator runtime
  try:
    trace = find_trace(args.workdir)
    rows = op_times(trace, args.module or None)
    if not rows:
      raise UserError(f"no compiled operations of a program named *{args.module}* in {trace}; "
                      "try --module=''")
  except UserError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  program = os.path.join(os.path.dirname(trace), PROGRAM_FILE)
  if not os.path.exists(program):  # a trace of another program: no categories
    print(f"{trace}\n\n{table(rows, args.top)}")
    if args.json:
      print(json.dumps({"trace": trace, "top": [r._asdict() for r in rows[:args.top]]}))
    return 0
  with open(program) as f:
    hlo_text = f.read()
  idle_s = idle_seconds(trace, args.module or None)
  found = summary(rows, hlo_text, idle_s, args.top)
  print(f"{trace}\n\nThe top kernels (categories from the op names of {PROGRAM_FILE}):\n\n"
        f"{top_table(found)}\n\nBy category:\n\n{category_table(rows, hlo_text, idle_s)}")
  if args.json:
    print(json.dumps({"trace": trace, **found}))
  return 0


if __name__ == "__main__":
  sys.exit(main())
