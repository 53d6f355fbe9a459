"""`--mode=train`: the training loop with evaluation, then the results, the summary and a map of
the workdir. The one place where training, evaluation and the tools meet."""

from __future__ import annotations

import os

import jax

from transformer_jax.eval.evaluate import evaluate, write_results
from transformer_jax.tools import summary
from transformer_jax.train import loop
from transformer_jax.train.logger import read_metrics


def _workdir_map(result: loop.Result, results_path: str) -> str:
  workdir = result.workdir
  return (f"workdir {workdir} holds:\n"
          f"  checkpoints/       steps {result.checkpoint_steps} (orbax; a rerun resumes from "
          "the latest)\n"
          f"  tokenizer.model    the SentencePiece vocabulary ({result.tokenizer.vocab_size} "
          "pieces)\n"
          f"  config.json        the full experiment config\n"
          f"  metrics.jsonl      training and evaluation metrics, one JSON object per line\n"
          f"  tensorboard/       event files: tensorboard --logdir "
          f"{os.path.join(workdir, 'tensorboard')}\n"
          f"  eval/              final metrics: {os.path.relpath(results_path, workdir)}\n"
          f"  summary.md         this summary\n"
          f"  lock               held by the run writing the workdir (its host and pid)")


def train_and_evaluate(config, workdir: str) -> dict:
  """Trains `config` in `workdir` (resuming if it holds checkpoints) and evaluates the result.

  Returns the final evaluation metrics ({} if a signal stopped the run early).
  """
  result = loop.train(config, workdir, evaluate_fn=evaluate)
  is_main = jax.process_index() == 0
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
  results_path = write_results(result.workdir, result.step, result.final_metrics)
  report = summary.render(config, result.final_metrics, read_metrics(result.workdir),
                          result.wall_time, result.tokens_seen, result.step - result.start_step,
                          result.step, result.checkpoint_steps)
  summary.write(result.workdir, report)
  print("\n" + report, flush=True)
  print(_workdir_map(result, results_path), flush=True)
  return result.final_metrics
