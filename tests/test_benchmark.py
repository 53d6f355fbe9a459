"""--mode=benchmark: the FLOPs formula counted by hand, the interleaving, a tiny end-to-end run."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from transformer_jax.model import ModelConfig, flops
from transformer_jax.tools import benchmark

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_train_flops_match_a_count_of_every_product():
  d, f, v, b, s, t = 8, 16, 11, 3, 5, 7
  cfg = ModelConfig(vocab_size=v, d_model=d, num_heads=2, num_encoder_layers=2,
                    num_decoder_layers=3, d_ff=f)
  products = []  # (rows, inner, columns) of every forward matrix product
  for _ in range(2):  # encoder layer: q, k, v, out; QK^T and AV per example; FFN in and out
    products += [(b * s, d, d)] * 4 + [(s, d, s), (s, s, d)] * b + [(b * s, d, f), (b * s, f, d)]
  for _ in range(3):  # decoder layer: self-attention, cross-attention (k, v over the source), FFN
    products += [(b * t, d, d)] * 4 + [(t, d, t), (t, t, d)] * b
    products += [(b * t, d, d)] * 2 + [(b * s, d, d)] * 2 + [(t, d, s), (t, s, d)] * b
    products += [(b * t, d, f), (b * t, f, d)]
  products.append((b * t, d, v))  # output projection
  forward = sum(2 * m * k * n for m, k, n in products)
  assert flops.train_flops_per_step(cfg, b, s, t) == 3 * forward


@pytest.mark.parametrize("kind,peak", [
    ("NVIDIA H100 80GB HBM3", 989e12), ("TPU v5 lite", 197e12), ("TPU v5", 459e12),
    ("TPU v6 lite", 918e12), ("TPU v4", 275e12), ("cpu", None)])
def test_peak_flops_by_the_device_kind_jax_reports(kind, peak):
  class Device:
    device_kind = kind

  assert flops.peak_flops(Device()) == peak


def test_interleaved_medians_alternate_blocks_and_count_every_call():
  calls = []
  runs = {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}
  medians = benchmark.interleaved_medians(runs, steps=7, block=3)
  assert "".join(calls) == "aaabbbaaabbbab"
  assert set(medians) == {"a", "b"} and all(m >= 0 for m in medians.values())


def test_benchmark_mode_prints_its_numbers_as_json():
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  result = subprocess.run(
      [sys.executable, "launch.py", "--config=experiments/tiny.py", "--mode=benchmark",
       "--config.benchmark.batch_size=4", "--config.benchmark.source_len=6",
       "--config.benchmark.target_len=5", "--config.benchmark.steps=3",
       "--config.benchmark.warmup=1", "--config.benchmark.decode_batch=2",
       "--config.benchmark.decode_steps=1"],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr
  numbers = json.loads(result.stdout.strip().splitlines()[-1])
  cfg = ModelConfig(vocab_size=32, d_model=32, num_heads=2, num_encoder_layers=1,
                    num_decoder_layers=1, d_ff=64)
  assert numbers["flops_per_step"] == flops.train_flops_per_step(cfg, 4, 6, 5)
  for key in ("compile_s", "step_ms", "greedy_tokens_per_s", "beam4_tokens_per_s",
              "temp_memory_gib"):
    assert numbers[key] > 0, key
  assert numbers["target_tokens_per_s"] == pytest.approx(4 * 5 / (numbers["step_ms"] / 1e3))
  assert numbers["mfu"] is None  # no peak is known for a CPU


@pytest.mark.parametrize("batching", ["tokens", "packed"])
def test_input_benchmark_times_the_input_path_alone(batching, capsys):
  """--config.benchmark.input=True: a first start from raw text and a second from its cache."""
  from transformer_jax.experiments import tiny
  c = tiny.get_config()
  c.data.batching = batching
  c.benchmark.update(input=True, input_steps=7)
  numbers = benchmark.run_benchmark(c)
  assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == numbers
  assert numbers["warm_steps"] == 7 and numbers["batching"] == batching
  assert numbers["train_examples"] == 16728  # SCAN simple's train split, all within the limits
  for key in ("raw_first_batch_s", "warm_first_batch_s", "raw_target_tokens_per_s",
              "warm_target_tokens_per_s", "warm_source_tokens_per_s", "warm_batches_per_s"):
    assert numbers[key] > 0, key
  assert numbers["first_batch_speedup"] == pytest.approx(
      numbers["raw_first_batch_s"] / numbers["warm_first_batch_s"])
  # The target share of the tokens delivered is SCAN's: actions are longer than commands.
  assert numbers["warm_target_tokens_per_s"] > numbers["warm_source_tokens_per_s"]
  assert 0 < numbers["padding"] < 1
  c.benchmark.input_raw = False  # the warm start alone, from the cache of the runs
  warm = benchmark.run_benchmark(c)
  assert "raw_first_batch_s" not in warm and warm["warm_steps"] == 7
  assert warm["corpus_target_tokens"] == numbers["corpus_target_tokens"]
