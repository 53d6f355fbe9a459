"""How soon a training run reaches its first step: a first start against a second one.

  python -m benchmarks.second_start DATA_DIR OUT_DIR [launch.py flags ...]

Runs `launch.py --mode=train` twice on `data.source=files` in DATA_DIR (e.g. the corpus of
`benchmarks/synthetic_wmt.py`), each time in a new workdir under OUT_DIR, with the cache in
OUT_DIR/cache (empty before the first start). The first start trains the tokenizer and tokenises
the train split into the cache; the second, like a sweep trial or a restart elsewhere, finds
both there. Prints the seconds from starting the process to its first `step` log line (the
first train step done: compile and one step included), the ratio, and the `data:` lines the
runs printed. Extra flags go to both runs (the defaults below give a small model, so that the
compile time, which the cache does not change, stays small beside the input path).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

from benchmarks.common import ROOT

FLAGS = [
    "--config=experiments/wmt14_ende_base.py", "--mode=train",
    "--config.data.source=files", "--config.data.format=parallel",
    "--config.data.eval_split=valid", "--config.data.test_split=test",
    "--config.model.d_model=128", "--config.model.num_heads=4", "--config.model.d_ff=256",
    "--config.model.num_encoder_layers=1", "--config.model.num_decoder_layers=1",
    "--config.data.tokens_per_batch=1024", "--config.train.steps=2",
    "--config.train.log_every=1", "--config.train.checkpoint_every=1000",
    "--config.eval.max_examples=8", "--config.eval.batch_size=8",
    "--config.eval.max_decode_len=8", "--config.eval.decode=greedy",
]


def first_step(workdir: pathlib.Path, flags: list[str]) -> tuple[float, list[str]]:
  """(seconds to the first `step` line, the lines printed before it)."""
  start = time.perf_counter()
  process = subprocess.Popen(
      [sys.executable, "launch.py", *flags, f"--workdir={workdir}"], cwd=ROOT,
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  lines, seconds = [], None
  for line in process.stdout:
    if seconds is None:
      lines.append(f"[{time.perf_counter() - start:6.1f} s] {line.rstrip()}")
      if line.startswith("step "):
        seconds = time.perf_counter() - start
  if process.wait() != 0 or seconds is None:
    sys.exit("launch.py failed:\n" + "\n".join(lines[-30:]))
  return seconds, lines


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
  parser.add_argument("data_dir", type=pathlib.Path, help="train/valid/test files")
  parser.add_argument("out_dir", type=pathlib.Path)
  args, extra = parser.parse_known_args()  # the rest: launch.py flags for both runs
  data_dir, out_dir = args.data_dir.resolve(), args.out_dir.resolve()
  cache = out_dir / "cache"
  shutil.rmtree(cache, ignore_errors=True)
  flags = FLAGS + [f"--config.data.path={data_dir}", f"--config.data.cache_dir={cache}", *extra]
  results = {}
  for name in ("first", "second"):
    workdir = out_dir / f"run_{name}"
    shutil.rmtree(workdir, ignore_errors=True)
    seconds, lines = first_step(workdir, flags)
    results[f"{name}_start_s"] = seconds
    print(f"{name} start: first step after {seconds:.1f} s", flush=True)
    for line in lines:
      if line.split("] ", 1)[1].startswith(("data:", "training the tokenizer", "tokenising",
                                            "step ")):
        print(f"  {line}", flush=True)
  results["speedup"] = results["first_start_s"] / results["second_start_s"]
  results["load"] = os.getloadavg()
  print(json.dumps(results), flush=True)


if __name__ == "__main__":
  main()
