"""`--mode=benchmark`: compile time, step time, tokens/s, FLOPs, MFU, memory, decode speed.

Model FLOPs of one training step (no padding: the benchmark batch is full), counting a
multiply-add as 2 FLOPs and the backward pass as twice the forward:

  forward = 2 * (  L_enc * (4 d^2 + 2 d d_ff) * B S            encoder projections and FFN
                 + L_dec * (4 d^2 + 2 d d_ff + 2 d^2) * B T     decoder self-attn, FFN, cross q/out
                 + L_dec * 2 d^2 * B S                          cross-attention keys and values
                 + d V * B T )                                  output projection
          + 4 d * B * (L_enc S^2 + L_dec T^2 + L_dec T S)       QK^T and AV of every attention
  train   = 3 * forward

This is the usual "6 x parameters per token" with each weight matrix charged for the tokens it
actually sees, plus the attention term (the causal mask's zeros are counted, as in most MFU
reports). MFU = achieved FLOP/s / the device's peak dense bf16 FLOP/s.
"""

from __future__ import annotations

import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax import config as config_lib, parallel, train
from transformer_jax.model import ModelConfig, count_params, init_params

# Peak dense bf16 FLOP/s by device kind (substring match, first hit wins).
PEAK_FLOPS = (
    ("H200", 989e12), ("H100", 989e12), ("A100", 312e12),
    ("TPU v5p", 459e12), ("TPU v5 lite", 197e12), ("TPU v5e", 197e12), ("TPU v4", 275e12),
)


def peak_flops(device) -> float | None:
  kind = getattr(device, "device_kind", "")
  for name, flops in PEAK_FLOPS:
    if name.lower() in kind.lower():
      return flops
  return None


def train_flops_per_step(cfg: ModelConfig, batch: int, source_len: int, target_len: int) -> float:
  """Model FLOPs of one training step on a full `[batch, source_len]`/`[batch, target_len]` batch."""
  d, f, v = cfg.d_model, cfg.d_ff, cfg.vocab_size
  le, ld = cfg.num_encoder_layers, cfg.num_decoder_layers
  s_tokens, t_tokens = batch * source_len, batch * target_len
  matmuls = (le * (4 * d * d + 2 * d * f) * s_tokens
             + ld * (6 * d * d + 2 * d * f) * t_tokens
             + ld * 2 * d * d * s_tokens
             + d * v * t_tokens)
  attention = 2 * d * batch * (le * source_len**2 + ld * target_len**2 + ld * target_len * source_len)
  return 3.0 * (2.0 * matmuls + 2.0 * attention)


def synthetic_batch(cfg: ModelConfig, batch: int, source_len: int, target_len: int, seed=0):
  """Full rows of random real tokens (ids >= 4), EOS-free: every position counts."""
  rng = np.random.default_rng(seed)
  return {"inputs": rng.integers(4, cfg.vocab_size, (batch, source_len), dtype=np.int32),
          "targets": rng.integers(4, cfg.vocab_size, (batch, target_len), dtype=np.int32)}


def interleaved_medians(runs: dict, steps: int, block: int = 5) -> dict:
  """Median seconds of `steps` calls of each callable in `runs`, alternating blocks of `block`.

  Side-by-side timings taken one after the other drift apart when the machine's speed does (a
  neighbour on a shared host, thermal limits); alternating short blocks exposes every framework
  to the same stretches.
  """
  times = {name: [] for name in runs}
  while any(len(t) < steps for t in times.values()):
    for name, fn in runs.items():
      for _ in range(min(block, steps - len(times[name]))):
        start = time.perf_counter()
        fn()
        times[name].append(time.perf_counter() - start)
  return {name: statistics.median(t) for name, t in times.items()}


def benchmark_train(config, model_config: ModelConfig, references=None) -> dict:
  """Times the jitted data-parallel train step on a synthetic batch.

  references: {name: another framework's warmed-up train step (a callable)}, each timed in
  alternating blocks with this one; its median lands in `NAME_step_ms`.
  """
  b = config.benchmark
  mesh = parallel.make_mesh(config.mesh.to_dict())
  bench_config = config.copy_and_resolve_references()
  bench_config.data.batching = "fixed"
  bench_config.data.batch_size = b.batch_size
  optimizer = train.make_optimizer(config.train, model_config.d_model)
  step = train.make_train_step(model_config, bench_config, mesh, optimizer)
  state = parallel.replicate(train.create_state(model_config, optimizer, config.seed), mesh)
  batch = parallel.shard_batch(synthetic_batch(model_config, b.batch_size, b.source_len,
                                               b.target_len), mesh)
  rng = jax.random.PRNGKey(0)

  start = time.perf_counter()
  compiled = step.lower(state, batch, rng).compile()
  compile_s = time.perf_counter() - start
  # XLA's own accounting of the compiled step: every backend reports it, unlike memory_stats().
  analysis = compiled.memory_analysis()

  holder = {"state": state}

  def run():
    holder["state"], metrics = compiled(holder["state"], batch, rng)
    jax.block_until_ready(metrics)

  for _ in range(b.warmup):
    run()
  medians = interleaved_medians({"jax": run, **(references or {})}, b.steps)
  step_s = medians["jax"]
  flops = train_flops_per_step(model_config, b.batch_size, b.source_len, b.target_len)
  device = jax.devices()[0]
  peak = peak_flops(device)
  achieved = flops / step_s
  result = {
      "device": f"{mesh.devices.size} x {device.device_kind}",
      "params": count_params(state.params)["total"],
      "compile_s": compile_s,
      "step_ms": step_s * 1e3,
      "source_tokens_per_s": b.batch_size * b.source_len / step_s,
      "target_tokens_per_s": b.batch_size * b.target_len / step_s,
      "flops_per_step": flops,
      "tflops_per_s": achieved / 1e12,
      "mfu": achieved / (peak * mesh.devices.size) if peak else None,
  }
  for name in references or {}:
    result[f"{name}_step_ms"] = medians[name] * 1e3
  if analysis is not None:
    result["temp_memory_gib"] = analysis.temp_size_in_bytes / 2**30  # activations and scratch
  stats = device.memory_stats() if hasattr(device, "memory_stats") else None
  if stats and "peak_bytes_in_use" in stats:
    result["peak_memory_gib"] = stats["peak_bytes_in_use"] / 2**30
  return result


def benchmark_decode(config, model_config: ModelConfig, params) -> dict:
  """Output tokens/s of greedy and beam-4 search at the benchmark's decode batch."""
  from transformer_jax import decode  # pylint: disable=import-outside-toplevel
  b = config.benchmark
  cfg = model_config.replace(deterministic=True)
  source = jnp.asarray(synthetic_batch(model_config, b.decode_batch, b.source_len, 1)["inputs"])
  max_length = b.target_len
  results = {}
  searches = {"greedy": lambda: decode.greedy_decode(params, cfg, source, max_length),
              "beam4": lambda: decode.beam_search(params, cfg, source, max_length, beam_size=4)[0]}
  for name, search in searches.items():
    jax.block_until_ready(search())  # compile
    outputs = []

    def run():
      outputs.append(jax.block_until_ready(search()))

    seconds = interleaved_medians({name: run}, max(1, b.decode_steps))[name]
    tokens = int((np.asarray(outputs[-1]) > 0).sum())
    results[f"{name}_tokens_per_s"] = tokens / seconds
    results[f"{name}_ms_per_batch"] = seconds * 1e3
  return results


def run_benchmark(config) -> dict:
  """Everything `--mode=benchmark` prints; the last stdout line is the JSON object."""
  model_config = config_lib.validate(config, jax.default_backend())
  b = config.benchmark
  print(f"benchmark: batch {b.batch_size} x (source {b.source_len} + target {b.target_len}), "
        f"{b.steps} timed steps after {b.warmup} warm-up, {jax.device_count()} device(s) "
        f"({jax.devices()[0].device_kind})", flush=True)
  references = {}
  if b.torch:
    from benchmarks import torch_reference  # pylint: disable=import-outside-toplevel
    references["torch"], torch_params = torch_reference.make_step(model_config, config)
  result = benchmark_train(config, model_config, references)  # sets torch_step_ms
  if b.torch:
    result["torch_params"] = torch_params
    result["speedup_vs_torch"] = result["torch_step_ms"] / result["step_ms"]
  if b.decode_steps:
    params = init_params(model_config, jax.random.PRNGKey(config.seed))
    result.update(benchmark_decode(config, model_config, params))
  for key, value in result.items():
    shown = f"{value:,.4g}" if isinstance(value, float) else value
    print(f"  {key:24s} {shown}", flush=True)
  print(json.dumps(result), flush=True)
  return result
