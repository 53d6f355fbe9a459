"""The input share of a loop whose step leaves the host idle, as on an accelerator.

  python -m benchmarks.input_share [STEP_MS] [CONFIG]

On this CPU the train step itself keeps the cores busy, so the log's `input` share mixes batch
making with the step's own threads. Here the step is a sleep of STEP_MS (default 3, about the
tiny model's step) while `pipeline.batches` delivers the batches of CONFIG (default
experiments/tiny.py) placed on the device, with data.prefetch 0 and 2, twice each; printed is
the share of the wall time spent in `next()` over 2,500 steps after 500 of warm-up.
"""

import contextlib
import importlib.util
import sys
import tempfile
import time

import jax

from transformer_jax.data import pipeline, prepare


def main():
  step_s = float(sys.argv[1] if len(sys.argv) > 1 else 3) / 1e3
  spec = importlib.util.spec_from_file_location(
      "config", sys.argv[2] if len(sys.argv) > 2 else "experiments/tiny.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config()
  with tempfile.TemporaryDirectory() as workdir:
    _, _, train_set, _ = prepare.prepare_data(c, workdir, c.model.vocab_size)
  stream = pipeline.TrainStream(train_set, c.data, c.seed)
  for prefetch in (0, 2, 0, 2):
    with contextlib.closing(pipeline.batches(stream, 0, 3000, place=jax.device_put,
                                             prefetch=prefetch)) as batches:
      for step in range(3000):
        if step == 500:
          start, waited = time.perf_counter(), 0.0
        before = time.perf_counter()
        next(batches)
        if step >= 500:
          waited += time.perf_counter() - before
        time.sleep(step_s)  # the host idle while the device runs the step
      share = waited / (time.perf_counter() - start)
    print(f"data.prefetch={prefetch}, a {step_s * 1e3:g} ms step: input share {share:.1%}",
          flush=True)


if __name__ == "__main__":
  main()
