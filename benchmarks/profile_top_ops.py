"""The top compiled operations by time in a run's profiler trace (train.profile_steps).

  python benchmarks/profile_top_ops.py WORKDIR [--top=N] [--module=SUBSTRING]

WORKDIR: a workdir trained with --config.train.profile_steps=N (or any directory or
.xplane.pb file of a jax.profiler trace); the newest trace under it is read. --module keeps the
programs whose name contains it (default: train_step, the train step's program; "" = all).
"""

import argparse
import sys

from transformer_jax.core import platforms
from transformer_jax.core.errors import UserError
from transformer_jax.tools import profile


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("workdir")
  parser.add_argument("--top", type=int, default=15)
  parser.add_argument("--module", default="train_step")
  args = parser.parse_args(argv)
  platforms.cpu_only_unless_accelerated()  # reading a trace needs no accelerator runtime
  try:
    trace = profile.find_trace(args.workdir)
    rows = profile.op_times(trace, args.module or None)
  except UserError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if not rows:
    print(f"error: no compiled operations of a program named *{args.module}* in {trace}; "
          "try --module=''", file=sys.stderr)
    return 2
  print(f"{trace}\n")
  print(profile.table(rows, args.top))
  return 0


if __name__ == "__main__":
  sys.exit(main())
