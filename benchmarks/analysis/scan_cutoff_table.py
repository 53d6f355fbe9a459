"""The table of SCAN's length re-splits (experiments/scan_cutoff.py): cutoff x option, exact match
on test of each run's last checkpoint (the model's own EOS, length included) and with the oracle
length, median [min, max] over seeds, each seed's figure, the wrong outputs by kind (stopped
early, ran on, a wrong token first) summed over seeds, and Csordas et al.'s figure beside.

Reads every run under the given directories (a sweep's trial_NNN_seedK, or single runs): its
config.json and its result file of the test split at train.steps (eval/STEP.test.greedy.json,
written at the end of training). Runs without that file (unfinished) are counted as missing.
A run with model.length_head has a row for each way its last checkpoint was decoded: at the
head's predicted length (eval/STEP.test.greedy-lengthhead.json), with its own EOS within k
tokens of it (greedy-lengthhead-slackK, eval.length_head_slack) and with its own EOS alone (the
greedy file, where `--mode=evaluate --config.eval.length_head=False` wrote one), with the share
of test outputs whose length the head gets exactly in a last column.
A run whose sizes or training settings (layers, heads, batches, steps, learning rate, label
smoothing, optimizer, embeddings) differ from those most runs of its architecture have, the
recipe's, has a row of its own that names them.

  .venv/bin/python -m benchmarks.analysis.scan_cutoff_table runs/scan_cutoff
"""

import argparse
import collections
import glob
import json
import os
import re
import statistics
import sys

from transformer_jax.data import scan

# Csordas, Irie & Schmidhuber 2021, relative-position Transformer on Newman et al.'s re-splits
# (their steps and sizes; second-hand figures, see docs/benchmarks.md).
CSORDAS = {24: 0.12, 25: 0.31, 26: 0.61, 27: 1.00}


def option(config: dict) -> str:
  """The model of a run's config.json in a few words."""
  m = config["model"]
  if m["arch"] == "encoder_decoder" and m["positional"] == "sinusoidal":
    name = "encoder-decoder, sinusoidal (the paper's)"
  else:
    name = f"{m['arch'].replace('_', '-')}, {m['positional'].replace('_', ' ')}"
    if m["positional"] == "relative_bias":
      name += f" {m['relative_buckets']}/{m['relative_max_distance']}"
  if m.get("random_positions_max"):
    name += f", random positions < {m['random_positions_max']}"
  if m.get("share_layers"):
    name += ", shared layers"
  if m.get("residual_gate"):
    name += ", gated residuals"
  if m.get("self_attention", "softmax") != "softmax":
    name += f", {m['self_attention']} self-attention"
  if m.get("length_head"):
    name += (", length head" + (" (exp shares)" if m.get("length_head_share") == "exp" else "")
             + (" (stop-gradient)" if m.get("length_head_stop_gradient") else ""))
  return name + (f", dropout {m['dropout_rate']:g}" if m["dropout_rate"] else "")


def runs(directories: list[str]) -> list[dict]:
  """{cutoff, option, seed, exact_match, oracle_exact_match (None if not scored)} per run."""
  found = []
  for directory in directories:
    for path in sorted(glob.glob(os.path.join(directory, "**", "config.json"), recursive=True)):
      workdir = os.path.dirname(path)
      with open(path) as f:
        config = json.load(f)
      split = config["data"]["scan_split"]
      if not split.startswith(scan.CUTOFF_PREFIX):
        continue
      # How the run itself decoded (at the end of training), then the other decodings where an
      # evaluation afterwards wrote them: a length-head run gives a row of each.
      steps = config["train"]["steps"]
      own = ("greedy-lengthhead" if config["model"].get("length_head")
             and config["eval"].get("length_head") else "greedy")
      if own == "greedy-lengthhead" and config["eval"].get("length_head_slack"):
        own += f"-slack{config['eval']['length_head_slack']}"
      decodings = [own]
      if config["model"].get("length_head"):
        for written in sorted(glob.glob(os.path.join(workdir, "eval",
                                                     f"{steps}.test.greedy*.json"))):
          decoding = os.path.basename(written).split(".")[2]
          if re.fullmatch(r"greedy(-lengthhead(-slack\d+)?)?", decoding) and decoding != own:
            decodings.append(decoding)
      for decoding in decodings:
        result = os.path.join(workdir, "eval", f"{steps}.test.{decoding}.json")
        metrics = {}
        if os.path.exists(result):
          with open(result) as f:
            metrics = json.load(f)
        name = option(config)
        if config["model"].get("length_head"):
          slack = decoding.rpartition("-slack")[2] if "-slack" in decoding else ""
          name += (", decoded to its own EOS" if decoding == "greedy" else
                   f", decoded to its own EOS within {slack} of its length" if slack else
                   ", decoded at its length")
        found.append({"cutoff": scan.max_train_actions(split), "option": name,
                      "arch": config["model"]["arch"], "settings": settings(config),
                      "seed": config["seed"],
                      "exact_match": metrics.get("exact_match"),
                      "oracle_exact_match": metrics.get("oracle_exact_match"),
                      "length_head_accuracy": metrics.get("length_head_accuracy"),
                      "errors": metrics.get("errors", {}).get("standard", {})})
  # A setting that differs from the value most runs of the same architecture have (the recipe's,
  # where most runs follow it) is named in the option: a row of its own. Where no value has more
  # runs than every other, each run names its own.
  for arch in {r["arch"] for r in found}:
    members = [r for r in found if r["arch"] == arch]
    for key in members[0]["settings"]:
      counts = collections.Counter(r["settings"][key] for r in members).most_common()
      usual = counts[0][0] if len(counts) == 1 or counts[0][1] > counts[1][1] else None
      for r in members:
        if r["settings"][key] != usual and r["settings"][key]:  # "": a setting it lacks
          r["option"] += ", " + r["settings"][key]
  return found


def settings(config: dict) -> dict:
  """The training and size settings of a run's config.json, each in a few words."""
  m, t, d = config["model"], config["train"], config["data"]
  layers = (f"{m['num_decoder_layers']} layers" if m["arch"] == "decoder_only" else
            f"{m['num_encoder_layers']}+{m['num_decoder_layers']} layers")
  batch = (f"batches of {d['tokens_per_batch']:,} tokens" if d["batching"] == "tokens" else
           f"batches of {d['batch_size']} rows")
  return {"layers": layers, "heads": f"{m['num_heads']} heads", "batch": batch,
          "steps": f"{t['steps']:,} steps",
          "learning rate": f"{t['schedule']} learning rate {t['learning_rate']:g}",
          "label smoothing": f"label smoothing {t['label_smoothing']:g}",
          "optimizer": f"Adam beta2 {t['adam_b2']:g}, gradients clipped at {t['grad_clip_norm']:g}",
          "embeddings": ("embeddings " + ("scaled" if m["embed_scale"] else "unscaled")
                         + (", tied" if m["tie_output"] else ", untied")),
          "length loss": (f"length loss weight {t.get('length_loss_weight', 0.1):g}"
                          if m.get("length_head") else "")}


def spread(values: list) -> str:
  return (f"{100 * statistics.median(values):.2f}% [{100 * min(values):.2f}, "
          f"{100 * max(values):.2f}]") if values else "-"


def errors(scored: list[dict]) -> str:
  """The wrong outputs of the runs by kind (eval/diagnostics: where the first wrong token is)."""
  kinds = ("stopped_early", "ran_on", "wrong_token")
  if not scored or any(not r["errors"] for r in scored):
    return "-"
  return " / ".join(f"{sum(r['errors'].get(k, 0) for r in scored):,}" for k in kinds)


def table(found: list[dict]) -> str:
  heads = any(r.get("length_head_accuracy") is not None for r in found)
  lines = ["| cutoff | option | seeds scored | exact match, median [min, max] | per seed | "
           "oracle-length exact match, median [min, max] | wrong outputs, all seeds: stopped "
           "early / ran on / wrong token | Csordas et al. |"
           + (" length head: exact lengths, median [min, max] |" if heads else ""),
           "| ---: | --- | ---: | --- | --- | --- | --- | ---: |" + (" --- |" if heads else "")]
  rows = sorted({(r["cutoff"], r["option"]) for r in found})
  for cutoff, name in rows:
    members = sorted((r for r in found if (r["cutoff"], r["option"]) == (cutoff, name)),
                     key=lambda r: r["seed"])
    scored = [r for r in members if r["exact_match"] is not None]
    per_seed = " / ".join(f"{r['seed']}: {100 * r['exact_match']:.2f}" for r in scored)
    paper = f"{100 * CSORDAS[cutoff]:.0f}%" if cutoff in CSORDAS else "-"
    head_accuracy = [r["length_head_accuracy"] for r in scored
                     if r.get("length_head_accuracy") is not None]
    lines.append(f"| {cutoff} | {name} | {len(scored)}/{len(members)} | "
                 f"{spread([r['exact_match'] for r in scored])} | {per_seed} | "
                 f"{spread([r['oracle_exact_match'] for r in scored])} | {errors(scored)} | "
                 f"{paper} |" + (f" {spread(head_accuracy)} |" if heads else ""))
  return "\n".join(lines)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("directories", nargs="+", help="sweep directories or run workdirs")
  args = parser.parse_args()
  found = runs(args.directories)
  if not found:
    print(f"error: no run of a length_cutoff_C split under {', '.join(args.directories)}",
          file=sys.stderr)
    return 2
  print(table(found))
  return 0


if __name__ == "__main__":
  sys.exit(main())
