"""`--mode=benchmark`: compile time, step time, tokens/s, FLOPs, MFU, memory, decode speed.

The FLOP formula and the devices' peak FLOP/s live with the model (`model/flops.py`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import statistics
import tempfile
import time

import jax
import numpy as np

from transformer_jax import config as config_lib
from transformer_jax.core import compilation
from transformer_jax.core.errors import UserError
from transformer_jax.data import cache, pipeline, prepare, tasks
from transformer_jax.data import sources as sources_lib
from transformer_jax.eval import load, search
from transformer_jax.model import ModelConfig, count_params, init_params
from transformer_jax.model.flops import peak_flops, train_flops_per_step
from transformer_jax.train import sharding
from transformer_jax.train import state as state_lib
from transformer_jax.train import step as step_lib


def synthetic_batch(cfg: ModelConfig, batch: int, source_len: int, target_len: int, seed=0):
  """Full rows of random real tokens (ids >= 4), EOS-free: every position counts. A classifier's
  targets are labels + 1."""
  rng = np.random.default_rng(seed)
  high = cfg.num_labels + 1 if cfg.num_labels else cfg.vocab_size
  return {"inputs": rng.integers(4, cfg.vocab_size, (batch, source_len), dtype=np.int32),
          "targets": rng.integers(min(4, high - 1), high, (batch, target_len), dtype=np.int32)}


def batch_lengths(config) -> tuple[int, int]:
  """The synthetic batch's (source, target) widths: benchmark.source_len and target_len, or none,
  or one label, as the task's batches have (data/tasks.py)."""
  b = config.benchmark
  return {"seq2seq": (b.source_len, b.target_len), "lm": (0, b.target_len),
          "mlm": (b.source_len, 0), "classify": (b.source_len, 1)}[config.data.task]


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
  """Times the jitted train step on a synthetic batch, on the mesh of config.mesh.

  references: {name: another framework's warmed-up train step (a callable)}, each timed in
  alternating blocks with this one; its median lands in `NAME_step_ms`.
  """
  b = config.benchmark
  started = time.perf_counter()
  mesh = sharding.make_mesh(config.mesh.to_dict())
  bench_config = config.copy_and_resolve_references()
  bench_config.data.batching = "fixed"
  bench_config.data.batch_size = b.batch_size
  optimizer = state_lib.make_optimizer(config.train, model_config.d_model)
  step = step_lib.make_train_step(model_config, bench_config, mesh)
  state = state_lib.init_state(model_config, optimizer, config.seed, mesh)
  source_len, target_len = batch_lengths(config)
  batch = sharding.shard_batch(synthetic_batch(model_config, b.batch_size, source_len,
                                               target_len), mesh,
                               multiple=config.train.grad_accum_steps)
  rng = jax.random.PRNGKey(0)
  jax.block_until_ready((state, batch))

  start = time.perf_counter()
  setup_s = start - started  # mesh, initial state (its initialiser compiled too) and batch
  clock = compilation.Clock()
  compiled = step.lower(state, batch, rng).compile()
  compile_s = time.perf_counter() - start  # tracing, lowering and compiling (or the cache's)
  spent = clock.read()
  # XLA's own accounting of the compiled step: every backend reports it, unlike memory_stats().
  analysis = compiled.memory_analysis()

  if not b.steps:  # compile only: the program is in the compilation cache now
    return {"device": f"{mesh.devices.size} x {jax.devices()[0].device_kind}",
            "compile_s": compile_s, "setup_s": setup_s, "trace_s": spent["trace_s"],
            "lower_s": spent["lower_s"], "backend_compile_s": spent["compile_s"],
            "compile_cache": spent["cache"]}
  holder = {"state": state}
  hparams = step.placed()

  def run():
    holder["state"], metrics = compiled(holder["state"], batch, rng, hparams)
    jax.block_until_ready(metrics)

  for _ in range(b.warmup):
    run()
  medians = interleaved_medians({"jax": run, **(references or {})}, b.steps)
  step_s = medians["jax"]
  flops = train_flops_per_step(model_config, b.batch_size, source_len, target_len)
  device = jax.devices()[0]
  peak = peak_flops(device)
  achieved = flops / step_s
  result = {
      "device": f"{mesh.devices.size} x {device.device_kind}",
      "mesh": sharding.describe_mesh(mesh),
      "params": count_params(state.params)["total"],
      "compile_s": compile_s,
      # compile_s split as JAX counts it, and whether the compilation cache answered
      "setup_s": setup_s, "trace_s": spent["trace_s"], "lower_s": spent["lower_s"],
      "backend_compile_s": spent["compile_s"], "compile_cache": spent["cache"],
      "step_ms": step_s * 1e3,
      "source_tokens_per_s": b.batch_size * source_len / step_s,
      "target_tokens_per_s": b.batch_size * target_len / step_s,
      "flops_per_step": flops,
      "tflops_per_s": achieved / 1e12,
      "mfu": achieved / (peak * mesh.devices.size) if peak else None,
  }
  for name in references or {}:
    result[f"{name}_step_ms"] = medians[name] * 1e3
  if b.profile:
    try:
      found = profile_steps(run, compiled.as_text(), b.profile)
    except Exception as e:  # noqa: BLE001 - the timing stands without its profile
      # (a GPU machine without CUPTI, the profiler's library, for one): said in the result
      result["profile_error"] = f"{type(e).__name__}: {e}"[:300]
    else:
      result["profile"] = found.pop("categories")  # each category's share of the step
      result["profile_top"] = found  # the top kernels: steps traced, ms and share of a step
  if analysis is not None:
    result["temp_memory_gib"] = analysis.temp_size_in_bytes / 2**30  # activations and scratch
  stats = device.memory_stats() if hasattr(device, "memory_stats") else None
  if stats and "peak_bytes_in_use" in stats:
    result["peak_memory_gib"] = stats["peak_bytes_in_use"] / 2**30
  return result


def decode_speed(params, model_config: ModelConfig, eval_config, sources: np.ndarray,
                 max_length: int, batch_size: int = 32, repeats: int = 3) -> dict:
  """Decoding speed of eval_config's search over `sources`, measured after a warm-up call.

  Args:
    sources: int `[n, src_len]` source ids (EOS-terminated, padded), cut into full batches of
      `batch_size` rows (repeated if n < batch_size, the remainder dropped).
    repeats: timed passes over all batches; the median pass is reported.

  Returns:
    tokens_per_s: output tokens (EOS included; for beam search those of the returned best
    hypotheses, not of every beam) per second; sentences_per_s; seconds of the median pass and
    of every pass; the sentences and tokens of one pass.
  """
  if len(sources) < batch_size:
    sources = np.resize(sources, (batch_size, sources.shape[1]))
  batches = [sources[i:i + batch_size]
             for i in range(0, len(sources) - batch_size + 1, batch_size)]
  # Warm-up: compiles, and fills caches (the model and config replace() are cached by jit).
  np.asarray(search.decode_batch(params, model_config, eval_config, batches[0], max_length))
  passes, tokens = [], 0
  for _ in range(repeats):
    tokens = 0
    start = time.perf_counter()
    for batch in batches:
      outputs = np.asarray(search.decode_batch(params, model_config, eval_config, batch,
                                               max_length))
      tokens += int((outputs != 0).sum())
    passes.append(time.perf_counter() - start)
  seconds = statistics.median(passes)
  sentences = len(batches) * batch_size
  return {"tokens_per_s": tokens / seconds, "sentences_per_s": sentences / seconds,
          "seconds": seconds, "pass_seconds": passes, "sentences": sentences, "tokens": tokens}


def _searches(eval_config, beam_size: int) -> list:
  """[(name, eval config)] for greedy search and beam search of `beam_size`, the other settings
  (length penalty, max length) as configured."""
  searches = []
  for name, overrides in (("greedy", {"decode": "greedy"}),
                          (f"beam{beam_size}", {"decode": "beam", "beam_size": beam_size})):
    search_config = eval_config.copy_and_resolve_references()
    search_config.update(overrides)
    searches.append((name, search_config))
  return searches


def benchmark_decoding(config, workdir: str, batch_size: int = 32, beam_size: int = 4,
                       num_batches: int = 8, repeats: int = 3, step=None) -> dict:
  """Greedy and beam-search decoding speed of a trained workdir on its eval split's sources.

  Uses the first `num_batches * batch_size` eval examples, beam length penalty
  eval.length_penalty, and eval.max_decode_len (or data.max_target_len) output positions.
  """
  trained = load.load_trained(config, workdir, step)
  d = config.data
  if trained.model_config.arch == "encoder_only":
    raise UserError("an encoder-only model does not decode; there is no decoding to time")
  pairs = sources_lib.load_split(d, d.eval_split)
  examples = tasks.examples(d, pairs[: num_batches * batch_size], trained.tokenizer)
  if not len(examples):
    raise UserError("no evaluation example fits data.max_source_len / data.max_target_len")
  sources = examples.rows(np.arange(len(examples)))["inputs"]
  results = {"step": trained.step, "platform": jax.default_backend(),
             "device": jax.devices()[0].device_kind, "device_count": jax.device_count(),
             "cpu_count": os.cpu_count(),
             "batch_size": batch_size, "max_decode_len": search.max_decode_length(config)}
  for name, eval_config in _searches(config.eval, beam_size):
    results[name] = {**search.decode_settings(eval_config), **decode_speed(
        trained.params, trained.model_config, eval_config, sources,
        search.max_decode_length(config), batch_size, repeats)}
  return results


def benchmark_decode(config, model_config: ModelConfig, params) -> dict:
  """Output tokens/s of greedy and beam-4 search on one synthetic batch of benchmark.decode_batch
  rows (random weights, so every row decodes all benchmark.target_len positions)."""
  b = config.benchmark
  source_ids = synthetic_batch(model_config, b.decode_batch, b.source_len, 1)["inputs"]
  results = {}
  for name, eval_config in _searches(config.eval, beam_size=4):
    speed = decode_speed(params, model_config, eval_config, source_ids, b.target_len,
                         batch_size=b.decode_batch, repeats=max(1, b.decode_steps))
    results[f"{name}_tokens_per_s"] = speed["tokens_per_s"]
    results[f"{name}_ms_per_batch"] = speed["seconds"] * 1e3
  return results


def benchmark_input(config, model_config: ModelConfig) -> dict:
  """The input path alone on config.data (`--config.benchmark.input=True`): no train step.

  - tokenizer_s: the run's tokenizer, from data.tokenizer.model_path, the cache or trained now;
  - a first start, from raw text: the data files hashed (the cache key), the train split
    tokenised and written to an empty cache in a temporary directory, the batch plan, the first
    batch placed on the mesh: raw_first_batch_s; raw_target_tokens_per_s: target tokens
    tokenised (and written) per second;
  - a second start, from that warm cache: the same steps, reading the entry back (verified):
    warm_first_batch_s, of which warm_hash_s hashing the files and warm_cache_read_s reading;
    then benchmark.input_steps more batches as the training loop takes them from
    `pipeline.batches` (prefetching thread, placement on the mesh): warm_*_tokens_per_s.
    With benchmark.input_raw=False only this one, from data.cache_dir (built there if absent).
  """
  d, b = config.data, config.benchmark
  mesh = sharding.make_mesh(config.mesh.to_dict())
  multiple = config.train.grad_accum_steps
  start = time.perf_counter()
  source_key = sources_lib.split_key(d, d.train_split)
  pairs = sources_lib.LazyPairs(d, d.train_split)
  with tempfile.TemporaryDirectory() as workdir:  # a tokenizer is never taken from a workdir
    tokenizer, _ = prepare.prepare_tokenizer(config, workdir, pairs, model_config.vocab_size,
                                             cache.root(d), source_key)
  result = {"tokenizer_s": time.perf_counter() - start, "batching": d.batching}
  key = {"data": source_key, "tokenizer": hashlib.sha256(tokenizer.model_proto).hexdigest()}

  def start_up(cache_dir: str, steps: int) -> dict:
    start = time.perf_counter()
    sources_lib.split_key(d, d.train_split)
    hash_s = time.perf_counter() - start
    corpus = cache.fetch(cache_dir, "encoded", key,
                         lambda: pipeline.encode_corpus(pairs, tokenizer))
    fetch_s = time.perf_counter() - start - hash_s
    examples = pipeline.select(corpus, d.max_source_len, d.max_target_len)
    stream = pipeline.TrainStream(examples, d, config.seed, row_multiple=multiple)
    place = lambda host: sharding.shard_batch(host, mesh, multiple=multiple)  # noqa: E731
    with contextlib.closing(pipeline.batches(stream, 0, steps + 1, place=place,
                                             prefetch=d.prefetch)) as batches:
      jax.block_until_ready(next(batches).data)
      first_s = time.perf_counter() - start
      start = time.perf_counter()
      after = list(batches)
      jax.block_until_ready([batch.data for batch in after])
    seconds = time.perf_counter() - start
    target = sum(int(examples.target_lengths[stream.plan(x.step).examples].sum()) for x in after)
    tokens, slots = (sum(x.tokens for x in after),
                     sum(x.shape[0] * (x.shape[1] + x.shape[2]) for x in after))
    return {"first_s": first_s, "hash_s": hash_s, "fetch_s": fetch_s, "examples": len(examples),
            "corpus_target_tokens": int(corpus["target"].size), "steps": len(after),
            "target_tokens_per_s": target / seconds if after else 0.0,
            "source_tokens_per_s": (tokens - target) / seconds if after else 0.0,
            "batches_per_s": len(after) / seconds if after else 0.0,
            "padding": 1.0 - tokens / slots if after else 0.0}

  if b.input_raw:
    with tempfile.TemporaryDirectory() as cache_dir:
      raw = start_up(cache_dir, 0)
      warm = start_up(cache_dir, b.input_steps)
    result.update({"raw_first_batch_s": raw["first_s"],
                   "raw_target_tokens_per_s": raw["corpus_target_tokens"] / raw["fetch_s"]})
  else:
    start_up(cache.root(d), 0)  # builds the entry if it is not there yet
    warm = start_up(cache.root(d), b.input_steps)
  result.update({
      "train_examples": warm["examples"], "corpus_target_tokens": warm["corpus_target_tokens"],
      "warm_first_batch_s": warm["first_s"], "warm_hash_s": warm["hash_s"],
      "warm_cache_read_s": warm["fetch_s"],
      **({"first_batch_speedup": raw["first_s"] / warm["first_s"]} if b.input_raw else {}),
      "warm_steps": warm["steps"],
      **{f"warm_{k}": warm[k] for k in ("target_tokens_per_s", "source_tokens_per_s",
                                        "batches_per_s")},
      "padding": warm["padding"],
  })
  return result


def profile_steps(run, hlo_text: str, directory: str, steps: int = 2) -> dict:
  """A jax.profiler trace of `steps` more steps (`run()` each) into `directory`, with the
  program's HLO beside it; returns tools/profile.py's summary: the share of each kernel category
  (and of the idle gaps) in the traced time, and the top kernels with theirs."""
  from transformer_jax.tools import profile  # reads the trace; only a profiled run needs it
  jax.profiler.start_trace(directory)
  try:
    for _ in range(steps):
      run()
  finally:
    jax.profiler.stop_trace()
  trace = profile.find_trace(directory)
  with open(os.path.join(os.path.dirname(trace), profile.PROGRAM_FILE), "w") as f:
    f.write(hlo_text)
  rows = profile.op_times(trace, "train_step")
  return profile.summary(rows, hlo_text, profile.idle_seconds(trace, "train_step"), top=12)


def run_benchmark(config) -> dict:
  """Everything `--mode=benchmark` prints; the last stdout line is the JSON object."""
  model_config = config_lib.validate(config, jax.default_backend())
  config_lib.validate_benchmark(config, model_config)
  b = config.benchmark
  if b.input:
    if config.data.task != "seq2seq":  # only seq2seq's examples are cached (data/prepare.py)
      raise UserError(f"benchmark.input times the cached input path of data.task=seq2seq, not "
                      f"{config.data.task}; set data.task=seq2seq")
    print(f"benchmark: the input path of {config.data.source} {config.data.train_split!r}, "
          f"batching={config.data.batching}, prefetch {config.data.prefetch}", flush=True)
    return _report(benchmark_input(config, model_config))
  print(f"benchmark: batch {b.batch_size} x (source, target) {batch_lengths(config)}, "
        f"{b.steps} timed steps after {b.warmup} warm-up, {jax.device_count()} device(s) "
        f"({jax.devices()[0].device_kind})", flush=True)
  references = {}
  if b.torch and model_config.arch != "encoder_decoder":
    raise UserError("benchmark.torch times torch.nn.Transformer, an encoder-decoder; set "
                    "model.arch=encoder_decoder or benchmark.torch=False")
  if b.torch and b.steps:
    from transformer_jax.tools import torch_reference  # imports torch: optional
    references["torch"], torch_params = torch_reference.make_step(
        model_config, config, synthetic_batch(model_config, b.batch_size, b.source_len,
                                              b.target_len))
  result = benchmark_train(config, model_config, references)  # sets torch_step_ms
  if b.torch and b.steps:
    result["torch_params"] = torch_params
    result["speedup_vs_torch"] = result["torch_step_ms"] / result["step_ms"]
  if b.decode_steps and b.steps and model_config.arch != "encoder_only":  # encoders do not decode
    params = init_params(model_config, jax.random.PRNGKey(config.seed))
    result.update(benchmark_decode(config, model_config, params))
  return _report(result)


def _report(result: dict) -> dict:
  for key, value in result.items():
    shown = f"{value:,.4g}" if isinstance(value, float) else value
    print(f"  {key:24s} {shown}", flush=True)
  print(json.dumps(result), flush=True)
  return result
