"""What SCAN's length split asks that its training part never shows: repetitions by part.

Each S of a command ("jump around left thrice") repeats a chunk of actions ("jump around left":
8 actions) once, twice or thrice. This prints, for each (chunk, times), how many commands of each
part of the length split hold such an S (data/scan.py `repetition_counts`), so that a table of
exact match can be read against what training covered:

  .venv/bin/python benchmarks/scan_structure.py
  .venv/bin/python benchmarks/scan_structure.py --dev_cutoff=16   # the dev of scan_length.py
"""

import argparse

from transformer_jax.data import scan


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--dev_cutoff", type=int, default=scan.DEV_CUTOFF,
                      help="data.scan_dev_cutoff: the most actions of a train_without_dev output")
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


if __name__ == "__main__":
  main()
