"""`--mode=train`: the training loop with evaluation, then the results, the summary and a map of
the workdir. The one place where training, evaluation and the tools meet."""

from __future__ import annotations

import json
import os
import sys
from typing import Optional

import jax

from transformer_jax import config as config_lib
from transformer_jax.core import outage, storage
from transformer_jax.data import tokenizer as tokenizer_lib
from transformer_jax.eval import evaluate as evaluate_lib
from transformer_jax.tools import summary
from transformer_jax.train import checkpoint, logger, loop
from transformer_jax.train.logger import read_metrics


def _workdir_map(result: loop.Result, results: list) -> str:
  workdir = result.workdir
  shown = ", ".join(os.path.relpath(path, workdir) for path in results)
  size = result.tokenizer.vocab_size
  vocabulary = (f"the SentencePiece vocabulary ({size} pieces)"
                if result.tokenizer.filename == tokenizer_lib.FILENAME
                else f"the imported model's tokenizer and id map ({size} tokens)")
  return (f"workdir {workdir} holds:\n"
          f"  checkpoints/       steps {result.checkpoint_steps} (orbax; a rerun resumes from "
          "the latest)\n"
          f"  {result.tokenizer.filename:<18} {vocabulary}\n"
          f"  config.json        the full experiment config\n"
          f"  metrics.jsonl      training and evaluation metrics, one JSON object per line\n"
          f"  tensorboard/       event files: tensorboard --logdir "
          f"{os.path.join(workdir, 'tensorboard')}\n"
          f"  eval/              final results: {shown}\n"
          f"  summary.md         this summary\n"
          f"  lock               held by the run writing the workdir (its host and pid)"
          + ("\n  tracker.json       the id of its W&B / MLflow run (train.trackers)"
             if storage.exists(storage.join(workdir, "tracker.json")) else ""))


def final_splits(config) -> list:
  """The splits evaluated after the last step: data.eval_split, then data.test_split."""
  d = config.data
  return [d.eval_split] + ([d.test_split] if d.test_split and d.test_split != d.eval_split
                           else [])


def finished(config, workdir: str) -> Optional[dict]:
  """The final results of a workdir trained to train.steps whose final evaluation was written
  ({split: result}), or None if training or its final evaluation is still to run.

  A config that differs from the workdir's in what the checkpoint holds is not finished here:
  training then refuses it by name.
  """
  workdir = storage.check(workdir)
  steps = checkpoint.saved_steps(workdir)
  path = storage.join(workdir, "config.json")
  if not steps or steps[-1] != config.train.steps or not storage.isfile(path):
    return None
  try:
    saved = json.loads(storage.read_text(path))
    if checkpoint.compare_configs(saved, config)[0]:
      return None
    # A damaged or unfinished newest checkpoint is not a finished run: training falls back to
    # the previous one (with a warning each) and redoes the last steps.
    manager = checkpoint.Manager(workdir, config)
    try:
      if not manager.metadata_reads(steps[-1]):
        return None
    finally:
      manager.close()
    results = {}
    for split in final_splits(config):
      results[split] = json.loads(storage.read_text(
          evaluate_lib.result_path(workdir, steps[-1], split, config)))
  except (OSError, ValueError):
    return None
  return results


def train_and_evaluate(config, workdir: str, on_eval: Optional[loop.OnEval] = None) -> dict:
  """Trains `config` in `workdir` (resuming if it holds checkpoints) and evaluates the result on
  data.eval_split and data.test_split.

  Returns the final evaluation metrics of data.eval_split ({} if a signal or on_eval stopped
  the run early; see loop.train). A workdir already trained to train.steps and evaluated is left
  as it is.
  """
  config_lib.validate(config, jax.default_backend())
  t = config.train
  if t.warmup_steps > t.steps and jax.process_index() == 0:
    print(f"warning: train.warmup_steps ({t.warmup_steps}) exceeds train.steps ({t.steps}): the "
          f"learning rate never reaches its peak ({t.schedule} schedule); lower "
          "train.warmup_steps or raise train.steps", file=sys.stderr, flush=True)
  done = finished(config, workdir)
  if done is not None:
    step = config.train.steps
    names = ", ".join(evaluate_lib.result_name(step, split, config) for split in done)
    print(f"already trained to step {step} (train.steps) and evaluated: eval/{{{names}}} and "
          f"summary.md in {storage.check(workdir)} are unchanged; raise train.steps to train "
          "further, or --mode=evaluate to evaluate otherwise", flush=True)
    if jax.process_index() == 0 and logger.sync_trackers(config, workdir):
      print("the trackers' run got what it lacked of metrics.jsonl and the run's files",
            flush=True)
    return done[config.data.eval_split]
  try:  # a bucket's outage is ridden out up to the last write (core/outage.py), then no more
    return _train_and_report(config, workdir, on_eval)
  finally:
    outage.arm(0)


def _train_and_report(config, workdir: str, on_eval: Optional[loop.OnEval] = None) -> dict:
  """Training, then its results, summary and map of the workdir (train_and_evaluate's body)."""
  result = loop.train(config, workdir, evaluate_fn=evaluate_lib.evaluate, on_eval=on_eval)
  is_main = jax.process_index() == 0
  if result.pruned:
    if is_main:
      print(f"{result.pruned}; the checkpoint of step {result.step} is saved", flush=True)
    return {}
  if result.stopped_by:
    if is_main and result.step >= config.train.steps:
      print(f"{result.stopped_by}: stopped during the final evaluation; the checkpoint of step "
            f"{result.step} is saved; run the same command to evaluate it", flush=True)
    elif is_main:
      print(f"{result.stopped_by}: stopped after step {result.step} and saved its checkpoint; "
            "run the same command to resume", flush=True)
    return {}
  if not is_main:
    return result.final_metrics
  finals = dict(zip(final_splits(config), (result.final_metrics, result.test_metrics)))
  paths = [evaluate_lib.write_results(result.workdir, evaluate_lib.record(
      result.step, split, config, metrics), config) for split, metrics in finals.items()]
  report = summary.render(config, finals, read_metrics(result.workdir), result.step,
                          result.checkpoint_steps)
  summary.write(result.workdir, report)
  if result.trackers_complete:  # else the same command on the finished workdir sends them
    logger.publish_run_files(config, result.workdir)
  print("\n" + report, flush=True)
  print(_workdir_map(result, paths), flush=True)
  return result.final_metrics
