"""The training loop: check everything, then train with periodic logging, evaluation and saves.

Evaluation is passed in (`evaluate_fn`, normally `transformer_jax.eval.evaluate.evaluate`), so
this layer never imports the one above it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import time
from typing import Any, Callable, Optional

import jax
import numpy as np
from jax.experimental import multihost_utils

from transformer_jax import config as config_lib
from transformer_jax.core import compilation, lease, outage, progress, storage
from transformer_jax.core.errors import UserError
from transformer_jax.data import cache, pipeline, prepare, sources, tasks
from transformer_jax.data import tokenizer as tokenizer_lib
from transformer_jax.model import ModelConfig, count_params, describe
from transformer_jax.model.flops import peak_flops
from transformer_jax.train import actions, checkpoint, pretrained, sharding
from transformer_jax.train import state as state_lib
from transformer_jax.train import step as step_lib
from transformer_jax.train.logger import MetricLogger, check_trackers

DISPATCH_AHEAD = 2  # train steps the host may queue before waiting for the devices

# evaluate_fn(params, model_config, config, tokenizer, pairs, mesh) -> metrics
EvaluateFn = Callable[..., dict]


@dataclasses.dataclass
class Result:
  """What a finished (or stopped) run hands to the code that reports on it."""

  workdir: str
  state: Any
  model_config: ModelConfig
  tokenizer: tokenizer_lib.Tokenizer
  start_step: int  # the step this run resumed from (0 for a new run)
  final_metrics: dict  # the evaluation after the last step; {} if stopped early
  test_metrics: dict  # the same on data.test_split, when it is not data.eval_split; else {}
  stopped_by: Optional[str]  # the signal that stopped the run early, or None
  checkpoint_steps: list
  tokens_seen: int
  wall_time: float  # seconds since this run's first step, up to the final evaluation
  train_time: float  # seconds of train steps alone (Throughput's clock), compiling ones aside
  pruned: Optional[str] = None  # why on_eval stopped the run early (a sweep's pruner), or None
  trackers_complete: bool = True  # the trackers got everything (else they were away at the end)

  @property
  def step(self) -> int:
    return int(self.state.step)


def _announce(model_config, described, train_set, eval_pairs, tokenizer, mesh, restored, start,
              set_aside) -> None:
  print(described, flush=True)
  print(f"data: {len(train_set):,} train examples ({train_set.dropped} too long, dropped), "
        f"{len(eval_pairs):,} eval examples, tokenizer of {tokenizer.vocab_size} pieces "
        f"(of the model's {model_config.vocab_size} embedding rows), "
        f"{mesh.devices.size} device(s) ({jax.default_backend()}) in {jax.process_count()} "
        f"process(es), mesh {sharding.describe_mesh(mesh)}", flush=True)
  if restored:
    changed = f" with changed config: {', '.join(restored.changed)}" if restored.changed else ""
    moved = (f" (unreadable steps {set_aside} moved to {checkpoint.UNREADABLE}/)" if set_aside
             else "")
    print(f"resuming from step {start}{changed}{moved}", flush=True)


def _process_rows(mesh, multiple: int):
  """rows_for of `pipeline.batches`: the real rows of a global batch that this process's devices
  hold (`shard_batch` pads the batch to a multiple of `multiple` x the batch shards first);
  None with one process, which holds them all."""
  if jax.process_count() == 1:
    return None

  @functools.lru_cache(maxsize=None)  # a few distinct row counts: one per length bucket
  def rows_for(rows: int):
    padded = sharding.padded_rows(rows, multiple * sharding.batch_shards(mesh))
    indices = sharding.process_row_indices(padded, mesh)
    return indices[indices < rows]
  return rows_for


def prepare_data_once(config, workdir: str, vocab_size: int):
  """`prepare.prepare_data` for every process of the job, the data prepared by one of them.

  With several processes and the cache on, process 0 trains the tokenizer and tokenises the
  corpus into the cache (`data/cache.py`, keyed by content) while the others wait, then read
  it: data.cache_dir must be a path every host shares, or a bucket (the default when the
  workdir is in one: `cache.root`). Without that, or without the cache, each process prepares
  the data itself (with a warning in the first case).
  """
  processes = jax.process_count()
  cache_dir = cache.root(config.data, workdir, processes)
  if processes == 1 or cache_dir is None:
    return prepare.prepare_data(config, workdir, vocab_size)
  failure, prepared = None, None
  if jax.process_index() == 0:
    if not config.data.cache_dir and not os.environ.get(cache.ENV) and storage.is_url(cache_dir):
      print(f"the job's processes share the tokenised data through {cache_dir} (the default "
            "for a workdir in a bucket); set data.cache_dir to keep it elsewhere", flush=True)
    try:
      prepared = prepare.prepare_data(config, workdir, vocab_size, processes=processes)
    except Exception as e:  # told to the others below, so that they stop too, not wait on
      failure = e
    failed = multihost_utils.broadcast_one_to_all(np.int32(failure is not None))
  else:
    print(f"process {jax.process_index()}: waiting for process 0 to prepare the data into the "
          f"cache {cache_dir}", flush=True)
    with progress.waiting("waiting for process 0 to prepare the data"):
      failed = multihost_utils.broadcast_one_to_all(np.int32(0))
  if failure is not None:
    raise failure
  if failed:
    raise UserError("process 0 of this job could not prepare the data (see its error)")
  return (prepared if prepared is not None
          else prepare.prepare_data(config, workdir, vocab_size, cached=True,
                                    processes=processes))


def _saved_labels(workdir: str) -> Optional[str]:
  """data.labels of the workdir's config.json, or None where it has none (a new run)."""
  path = storage.join(workdir, config_lib.SAVED)
  try:
    return str(json.loads(storage.read_text(path))["data"]["labels"])
  except (OSError, ValueError, KeyError, TypeError):
    return None


# on_eval(step, eval_metrics) -> why to stop now (a sweep's pruner), or None to go on
OnEval = Callable[[int, dict], Optional[str]]


def train(config, workdir: str, evaluate_fn: EvaluateFn, on_eval: Optional[OnEval] = None
          ) -> Result:
  """Trains `config` in `workdir` (resuming from its newest readable checkpoint), then evaluates.

  Everything the user's input can fail (config, data, tokenizer, batching, a checkpoint's
  compatibility) is checked before the workdir is touched. SIGTERM/SIGINT end the run after the
  current step with a checkpoint. on_eval (a sweep trial's reporter) sees every periodic
  evaluation; when it answers with a reason, the run saves that step's checkpoint and stops
  (Result.pruned), without the final evaluation.
  """
  started = time.perf_counter()  # start-up: from here to the first step's end
  model_config = config_lib.validate(config, jax.default_backend())
  t = config.train
  workdir = checkpoint.check_workdir(workdir)
  if jax.process_count() == 1:  # a second run in this workdir is refused before any work
    lease.lock(workdir).check()
  if t.init_from:
    pretrained.source_config(t.init_from)  # there is a run to start from
  tasks.fix_labels(config.data, _saved_labels(workdir))
  tokenizer, new_tokenizer, train_set, eval_pairs = prepare_data_once(
      config, workdir, model_config.vocab_size)
  d = config.data
  # The test split is evaluated once, after the last step; a missing one is refused now.
  test_pairs = (sources.load_split(d, d.test_split)
                if d.test_split and d.test_split != d.eval_split else None)
  mesh = sharding.make_mesh(config.mesh.to_dict())
  optimizer = state_lib.make_optimizer(t, model_config.d_model)
  train_step = step_lib.make_train_step(model_config, config, mesh)
  # The batches do not depend on the mesh: rows are a multiple of the accumulation steps only,
  # and shard_batch fills a batch with empty rows to split it over the devices.
  stream = pipeline.TrainStream(train_set, config.data, config.seed,
                                row_multiple=t.grad_accum_steps)
  tokenizer_sha = checkpoint.sha256(tokenizer.model_proto)
  seen_steps = checkpoint.saved_steps(workdir)
  reader = checkpoint.Manager(workdir, config, tokenizer_sha)
  # Restored onto this run's mesh, whatever mesh or device count wrote the checkpoint.
  restored = reader.latest_good(state_lib.abstract_state(model_config, optimizer, mesh))
  reader.close()
  if restored and restored.step > t.steps:
    raise UserError(f"the newest checkpoint of {workdir} is at step {restored.step}, past "
                    f"train.steps={t.steps}; raise train.steps to continue, or evaluate it with "
                    "--mode=evaluate")
  stream.plan(restored.step if restored else 0)  # a batching that fits no batch fails here
  check_trackers(config)  # each tracker of train.trackers installed

  # Every check passed: from here on the workdir changes. With several processes, the first
  # writes the files; checkpoints are written by all of them together (orbax).
  is_main = jax.process_index() == 0
  config_json = config.to_json_best_effort(indent=2)
  checkpoint.create_workdir(workdir)
  lock = checkpoint.claim_workdir(workdir, seen_steps)  # held until training and its eval end
  if storage.is_url(workdir):  # the bucket answered: from now on its outages are ridden out
    outage.arm(t.storage_outage_s)  # (up to the run's last write: run.py disarms)
  if is_main and new_tokenizer:
    storage.write(storage.join(workdir, tokenizer.filename), tokenizer.model_proto)
  if is_main:
    storage.write(storage.join(workdir, "config.json"), config_json)
  set_aside = reader.set_aside_unreadable()
  manager = checkpoint.Manager(workdir, config, tokenizer_sha, writable=True)
  copied = []
  if restored:
    state, start = restored.state, restored.step
  else:
    state, start = state_lib.init_state(model_config, optimizer, config.seed, mesh), 0
    if t.init_from:
      state, copied = pretrained.load(t.init_from, state, mesh)
  rng = jax.random.PRNGKey(config.seed)
  described = describe(model_config, state.params)  # printed and logged: counted once
  if is_main:
    _announce(model_config, described, train_set, eval_pairs, tokenizer, mesh, restored, start,
              set_aside)
    if copied:
      print(f"initialised {len(copied)} of {len(jax.tree.leaves(state.params))} parameters "
            f"from {t.init_from}", flush=True)

  peak = peak_flops(jax.devices()[0])
  logger = MetricLogger(workdir, total_steps=t.steps, start_step=start, enabled=is_main,
                        peak_flops=peak * mesh.devices.size if peak else None, config=config)
  logger.text("config", config_json)
  logger.text("model", f"{described}\n{count_params(state.params)}")
  schedule = state_lib.make_schedule(t, model_config.d_model)
  periodic = actions.Periodic(t)
  throughput = actions.Throughput(model_config)
  pending = actions.PendingSteps(DISPATCH_AHEAD)
  nonfinite = actions.NonFinitePolicy(t.on_nonfinite, manager)
  profiler = actions.Profiler(
      t, storage.join(workdir, "tensorboard"), start, enabled=is_main,
      program=lambda: train_step.lower(state, batch.data, rng).compile().as_text())

  def evaluate(params, pairs=eval_pairs) -> tuple[dict, float]:
    """The metrics, and the seconds they took (the training clock stands still meanwhile)."""
    with throughput.paused("eval"):
      metrics = evaluate_fn(params, model_config, config, tokenizer, pairs, mesh)
    return metrics, throughput.last_pause["eval"]

  def save(step: int, eval_metrics) -> None:
    with throughput.paused("save"):
      manager.save(step, state, eval_metrics)  # the metrics rank checkpoints for keep_best
    logger.checkpoint(step, throughput.last_pause["save"], kept=manager.all_steps,
                      directory=manager.directory)

  # Batches are made ahead in a background thread, each process filling only its own rows.
  batches = pipeline.batches(
      stream, start, t.steps, rows_for=_process_rows(mesh, t.grad_accum_steps),
      place=lambda host: sharding.shard_batch(host, mesh, multiple=t.grad_accum_steps),
      prefetch=config.data.prefetch)
  early = actions.EarlyProgress(start, t.steps, t.log_every)
  bar = progress.bar(total=t.steps, initial=start, desc="training", unit="step")
  # The logger last: an error on the way closes its tracker runs as failed.
  with (lock, contextlib.closing(batches), checkpoint.Preemption() as preemption, bar,
        contextlib.closing(profiler), logger):
    metrics = None  # the previous step's
    pruned = None
    for step in range(start, t.steps):
      with throughput.paused("profile"):
        profiler.before(step)
      with throughput.input():
        batch = next(batches)
      # A step of a new batch shape compiles: timed apart, once the steps before it are done.
      compiles = throughput.compiles(batch.shape)
      if compiles and metrics is not None:
        jax.block_until_ready(metrics)
      waiting = (progress.waiting("compiling the train step") if step == start
                 else contextlib.nullcontext())
      if step == start:  # the start-up ends with this step
        setup_s, clock = time.perf_counter() - started, compilation.Clock()
      with waiting, throughput.paused("compile") if compiles else contextlib.nullcontext():
        state, metrics = train_step(state, batch.data, rng)
        if compiles:
          jax.block_until_ready(metrics)  # the wait is the compilation's
      if step == start:
        logger.startup(start, setup_s, time.perf_counter() - started, clock.read())
      throughput.count(batch.tokens, batch.shape, compiled=compiles)
      done = step + 1
      bar.update()
      if line := profiler.after(done, metrics, lambda: throughput.paused("profile")):
        progress.write(line)  # only the first process traces
      if is_main and (line := early.line(done, metrics, rate=throughput.steps_per_s())):
        progress.write(line)
      pending.push(done, metrics)
      due = periodic.due(done, stop=preemption.reached(done))
      if due.sync:
        nonfinite.check(pending.drain())
      if due.log:
        logged = {k: v for k, v in jax.device_get(metrics).items() if k != "finite"}
        logger.train(done, logged, float(schedule(done - 1)), **throughput.take(),
                     eta_s=throughput.eta(done, t.steps), eval_eta_s=_eval_eta(throughput, done, t))
      eval_metrics = None
      if due.eval:
        eval_metrics, seconds = evaluate(state.params)
        logger.eval(done, eval_metrics, seconds=seconds)
        if on_eval is not None:
          pruned = on_eval(done, eval_metrics)
      if due.save or pruned:
        save(done, eval_metrics)
      if due.stop or pruned:
        break
    batches.close()  # its thread ends before the final evaluation
    profiler.close()
    manager.wait()
    wall_time = throughput.wall_time  # of training; the final evaluation is not counted
    final_metrics, test_metrics = {}, {}
    if not preemption.signal and not pruned:
      # The last step's checkpoint is written: a signal now abandons the evaluation (a rerun of
      # the same command evaluates that checkpoint) instead of waiting for it.
      eval_seconds = test_seconds = 0.0
      with preemption.abandoning():
        final_metrics, eval_seconds = evaluate(state.params)
        if test_pairs is not None:
          test_metrics, test_seconds = evaluate(state.params, test_pairs)
      if not preemption.signal:
        logger.eval(int(state.step), final_metrics, seconds=eval_seconds)
        if test_metrics:
          logger.eval(int(state.step), test_metrics, split="test", seconds=test_seconds)
      else:
        final_metrics, test_metrics = {}, {}
    logger.summary({"step": int(state.step), "tokens_seen": throughput.tokens_seen,
                    "train_time_s": throughput.train_seconds, "wall_time_s": wall_time,
                    **{f"{split}/{k}": v for split, metrics in (
                        ("eval", final_metrics), ("test", test_metrics))
                       for k, v in metrics.items() if isinstance(v, (int, float))}})
    logger.close("stopped" if preemption.signal else "finished")
  checkpoint_steps = manager.all_steps()
  manager.close()
  return Result(workdir=workdir, state=state, model_config=model_config, tokenizer=tokenizer,
                start_step=start, final_metrics=final_metrics, test_metrics=test_metrics,
                stopped_by=preemption.signal, pruned=pruned,
                checkpoint_steps=checkpoint_steps, tokens_seen=throughput.tokens_seen,
                wall_time=wall_time, train_time=throughput.train_seconds,
                trackers_complete=logger.trackers_complete)


def _eval_eta(throughput: actions.Throughput, step: int, t) -> float | None:
  """Seconds of the evaluations still to come, at the latest one's pace; None before one ran."""
  last = throughput.last_pause.get("eval")
  if last is None:
    return None
  return last * actions.evaluations_left(step, t.steps, t.eval_every)
