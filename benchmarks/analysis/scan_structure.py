"""What SCAN's length split asks that its training part never shows: repetitions by part.

Each S of a command ("jump around left thrice") repeats a chunk of actions ("jump around left":
8 actions) once, twice or thrice. This prints, for each (chunk, times), how many commands of each
part of the length split hold such an S (data/scan.py `repetition_counts`), so that a table of
exact match can be read against what training covered. With --workdirs, trained runs of the
length split decode every command of --split (default test; greedy, the model's own EOS, the
newest checkpoint of each run, as transformer_jax.load gives it) and their exact match is
printed by the kind of command: which S repeat the 8-action chunk ("X around Y", X not turn),
the rest "short"; median [min, max] over the runs, and each run's figure; and each run's right
commands in the two parts of data/scan.py `repetition_groups` (the length test's 776 whose
repetition counts training shows, and 3,144 with a count it never shows).

  .venv/bin/python -m benchmarks.analysis.scan_structure
  .venv/bin/python -m benchmarks.analysis.scan_structure --dev_cutoff=16  # scan_length.py's dev
  .venv/bin/python -m benchmarks.analysis.scan_structure --workdirs runs/scan_full/trial_003_seed*
  .venv/bin/python -m benchmarks.analysis.scan_structure --dev_cutoff=16 --split=dev \
    --workdirs runs/scan_seeds/trial_014_seed*
"""

import argparse
import statistics
import sys

from transformer_jax.data import scan

LONG_CHUNK = 8  # "X around Y" with X a verb that acts: the only chunk longer than 4 actions


def kind(command: str) -> str:
  """The command's S repeating the 8-action chunk ("8x3 + 8x1"), longest first; "short" for
  the others ("8x3 + short"; "short" alone when none repeats it)."""
  every = scan.repetitions(command)
  parts = sorted((r for r in every if r[0] == LONG_CHUNK), reverse=True)
  names = [f"{chunk}x{times}" for chunk, times in parts]
  if len(parts) < len(every):
    names.append("short")
  return " + ".join(names)


def exact_match_by_kind(workdirs: list[str], split: str, dev_cutoff: int) -> None:
  from transformer_jax.core import platforms
  platforms.cpu_only_unless_accelerated()  # as launch.py: no TPU runtime's warnings on a CPU
  import transformer_jax  # jax only when models are decoded

  pairs = scan.load("length", split, dev_cutoff)
  kinds = [kind(command) for command, _ in pairs]
  # The two parts by what training showed (the train split for test, train_without_dev for dev).
  groups = scan.repetition_groups([command for command, _ in pairs], "length",
                                  "train" if split == "test" else "train_without_dev", dev_cutoff)
  right = {}
  for workdir in workdirs:
    hypotheses = transformer_jax.load(workdir).translate([command for command, _ in pairs])
    right[workdir] = [h == reference for h, (_, reference) in zip(hypotheses, pairs)]
    parts = "; ".join(
        f"{name}: {sum(r for r, g in zip(right[workdir], groups) if g == name):,} of "
        f"{groups.count(name):,}" for name in (scan.TRAINED, scan.UNSEEN) if name in groups)
    print(f"{workdir}: {sum(right[workdir]) / len(pairs):.2%} of {len(pairs):,} {split} commands "
          f"({parts})", flush=True)
  print(f"\nExact match on {split} by kind of command, median [min, max] over {len(workdirs)} "
        "runs\n")
  print("| kind | commands | exact match | per run |")
  print("| --- | ---: | ---: | --- |")
  for name in sorted(set(kinds), key=lambda k: (-kinds.count(k), k)):
    rows = [i for i, k in enumerate(kinds) if k == name]
    rates = [100 * sum(right[w][i] for i in rows) / len(rows) for w in workdirs]
    print(f"| {name} | {len(rows):,} | {statistics.median(rates):.2f}% [{min(rates):.2f}, "
          f"{max(rates):.2f}] | " + " / ".join(f"{r:.2f}" for r in rates) + " |")


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--dev_cutoff", type=int, default=scan.DEV_CUTOFF,
                      help="data.scan_dev_cutoff: the most actions of a train_without_dev output")
  parser.add_argument("--workdirs", nargs="*", default=[],
                      help="runs of the length split: their exact match by kind of command")
  parser.add_argument("--split", default="test", choices=["test", "dev"],
                      help="the part the runs decode (dev: cut at --dev_cutoff)")
  args = parser.parse_args()
  parts = ["train", "train_without_dev", "dev", "test"]
  pairs = {part: scan.load("length", part, args.dev_cutoff) for part in parts}
  counts = {part: scan.repetition_counts(pairs[part]) for part in parts}
  keys = sorted(set().union(*counts.values()))
  print(f"SCAN length split, dev cutoff {args.dev_cutoff}: commands holding an S that repeats a "
        "chunk of N actions T times (a command is counted once per kind)\n")
  print("| chunk x times | actions | " + " | ".join(
      f"{part} ({len(pairs[part]):,})" for part in parts) + " |")
  print("| --- | ---: | " + " | ".join("---:" for _ in parts) + " |")
  for chunk, times in keys:
    cells = [f"{counts[part].get((chunk, times), 0):,}" for part in parts]
    print(f"| {chunk} x {times} | {chunk * times} | " + " | ".join(cells) + " |")
  if args.workdirs:
    print()
    from transformer_jax.core.errors import UserError
    try:
      exact_match_by_kind(args.workdirs, args.split, args.dev_cutoff)
    except UserError as e:  # a workdir without a trained model, say: one line, as launch.py
      print(f"error: {e}", file=sys.stderr)
      return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
