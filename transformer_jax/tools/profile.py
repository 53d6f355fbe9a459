"""The compiled operations that take the time in a `jax.profiler` trace (train.profile_steps).

A trace directory (WORKDIR/tensorboard/plugins/profile/RUN/) holds HOST.xplane.pb, the profiler's
XSpace: planes (a host, each device) of lines (threads, streams) of events. The events of
compiled XLA code carry the stats `hlo_module` (the jitted program, e.g. jit_train_step) and
`hlo_op` (the fused operation); on a CPU they run on the runtime's threads, on a GPU or TPU on
the device planes. Their times are summed per operation over every line, so on a CPU, where one
step's operations run on several threads at once, the total may exceed the wall time. The train
step of each batch shape is a program of its own under the same name; their operations of the
same name are summed together.

  python -m transformer_jax.tools.profile WORKDIR [--top=N] [--module=SUBSTRING]

WORKDIR: a workdir trained with --config.train.profile_steps=N (or any directory or .xplane.pb
file of a jax.profiler trace); the newest trace under it is read. --module keeps the programs
whose name contains it (default train_step, the train step's program; "" = all).
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
from typing import NamedTuple, Optional

from transformer_jax.core import platforms
from transformer_jax.core.errors import UserError

TRACE_SUFFIX = ".xplane.pb"


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


def op_times(trace_file: str, module: Optional[str] = None) -> list[OpTime]:
  """Every compiled operation of the trace, with its time, the longest first. module: only
  those of programs whose name contains it (e.g. "train_step")."""
  import jax  # the profiler's reader; imported here, as only this tool needs it
  data = jax.profiler.ProfileData.from_file(trace_file)
  totals = {}
  for plane in data.planes:
    for line in plane.lines:
      for event in line.events:
        stats = _stats(event)
        op, program = stats.get("hlo_op"), stats.get("hlo_module")
        if not op or not program or (module and module not in str(program)):
          continue
        calls, ns = totals.get((program, op), (0, 0.0))
        totals[(str(program), str(op))] = (calls + 1, ns + event.duration_ns)
  rows = [OpTime(program, op, calls, ns / 1e9) for (program, op), (calls, ns) in totals.items()]
  return sorted(rows, key=lambda r: (-r.seconds, r.module, r.op))


def table(rows: list[OpTime], top: int = 15) -> str:
  """The `top` operations as a Markdown table, each with its share of all compiled time."""
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
  print(f"{trace}\n\n{table(rows, args.top)}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
