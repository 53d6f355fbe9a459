"""The GPU suite's results.md: a table per kind of case, the profiles of the default steps, the
compiler's estimates beside the measurements, and what did not run."""

from __future__ import annotations

import json
import os
import pathlib
import time

from benchmarks.gpu import plan as plan_lib
from benchmarks.gpu.plan import PEAK_TFLOPS, PUBLISHED_BLEU

NO_WINNER = "no winner"  # the status of a combination none of whose levers beat the default
UNAVAILABLE = "unavailable"  # a case this checkout (or, in a dry run, the CPU) cannot run
NOT_FAILURES = ("ok", "pending", NO_WINNER, UNAVAILABLE)
ESTIMATE_TOPOLOGY = "h100"


def num(value, digits=3, scale=1.0) -> str:
  if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
    return "-"
  value *= scale
  if abs(value) >= 1000:
    return f"{value:,.0f}"
  return f"{value:.{digits}g}"


def _m(row, key):
  return (row.get("metrics") or {}).get(key)


def _percent(value) -> str:
  return num(value, scale=100) + "%" if value is not None else "-"


def _bound_factor(row):
  """This window's measured step time over the compiler's bound for the same step."""
  if not row.get("estimate") or not _m(row, "step_ms"):
    return None
  return _m(row, "step_ms") / (row["estimate"]["step_s"] * 1e3)


TABLES = {
    "train": ("Train step (bf16, rows of 64 + 64 tokens)", (
        ("model", lambda c, r: c.describe.get("model", "-")),
        ("tokens/side", lambda c, r: c.describe.get("tokens", "-")),
        ("attention", lambda c, r: c.describe.get("attention", "-")),
        ("remat", lambda c, r: c.describe.get("remat", "-")),
        ("dropout bits", lambda c, r: c.describe.get("dropout bits", "threefry")),
        ("loss chunk", lambda c, r: str(c.describe.get("loss chunk", "-"))),
        ("XLA flags", lambda c, r: f"`{c.describe.get('xla_flags', '-')}`"),
        ("compile s", lambda c, r: num(_m(r, "compile_s"))),
        ("step ms", lambda c, r: num(_m(r, "step_ms"))),
        ("target tok/s", lambda c, r: num(_m(r, "target_tokens_per_s"))),
        ("TFLOP/s", lambda c, r: num(_m(r, "tflops_per_s"))),
        ("MFU (989)", lambda c, r: _percent(r.get("mfu_989"))),
        ("peak GiB", lambda c, r: num(_m(r, "peak_memory_gib"))),
        ("XLA temp GiB", lambda c, r: num(_m(r, "temp_memory_gib"))),
        (f"estimate: roofline bound ms ({ESTIMATE_TOPOLOGY})",
         lambda c, r: num((r.get("estimate") or {}).get("step_s"), scale=1e3)),
        ("bound's MFU", lambda c, r: _percent((r.get("estimate") or {}).get("mfu"))),
        ("measured / bound", lambda c, r: num(_bound_factor(r))),
    )),
    "torch": ("Against PyTorch: torch.nn.Transformer, bf16 autocast, torch.compile, same process", (
        ("model", lambda c, r: c.describe.get("model", "-")),
        ("tokens/side", lambda c, r: c.describe.get("tokens", "-")),
        ("JAX step ms", lambda c, r: num(_m(r, "step_ms"))),
        ("PyTorch step ms", lambda c, r: num(_m(r, "torch_step_ms"))),
        ("PyTorch / JAX", lambda c, r: num(_m(r, "speedup_vs_torch")) + "x"
         if _m(r, "speedup_vs_torch") else "-"),
        ("JAX params", lambda c, r: num(_m(r, "params"))),
        ("PyTorch params", lambda c, r: num(_m(r, "torch_params"))),
    )),
    "decode": ("Decoding (random weights: every row runs all 64 positions)", (
        ("model", lambda c, r: c.describe.get("model", "-")),
        ("batch", lambda c, r: str(c.describe.get("decode_batch", "-"))),
        ("greedy tok/s", lambda c, r: num(_m(r, "greedy_tokens_per_s"))),
        ("greedy ms/batch", lambda c, r: num(_m(r, "greedy_ms_per_batch"))),
        ("beam 4 tok/s", lambda c, r: num(_m(r, "beam4_tokens_per_s"))),
        ("beam 4 ms/batch", lambda c, r: num(_m(r, "beam4_ms_per_batch"))),
    )),
    "multi30k": (f"Multi30k En-De recipe (published: {PUBLISHED_BLEU} lowercased tokenized BLEU)", (
        ("test BLEU (lc, tok)", lambda c, r: num(_m(r, "bleu_lowercase_tokenized"), 4)),
        ("vs published", lambda c, r: num(r.get("bleu_minus_published"), 2)),
        ("sacreBLEU (cased)", lambda c, r: num(_m(r, "bleu"), 4)),
        ("averaged checkpoints", lambda c, r: str(len(_m(r, "checkpoints") or [])) or "-"),
        ("val BLEU (lc, tok; last checkpoint)",
         lambda c, r: num((r.get("val_metrics") or {}).get("bleu_lowercase_tokenized"), 4)),
        ("train min", lambda c, r: num((r.get("train_wall_s") or 0) / 60 or None)),
        ("evaluate s", lambda c, r: num(r.get("evaluate_wall_s"))),
    )),
}


def earlier_factors() -> list:
  """Lines naming the measured-to-estimate factors that earlier windows found (kept in one
  place: transformer_jax/tools/compile.py's MEASURED, with their source)."""
  try:
    from transformer_jax.tools.compile import MEASURED
  except ImportError:
    return []
  return [f"{m.model} {m.factor:.2f}x ({m.measured_ms:g} ms measured against a bound of "
          f"{m.estimate_ms:g} ms; {m.source})" for m in MEASURED]


def _header(state: dict, cases: list) -> list:
  env = state.get("environment") or {}
  lines = [f"- started {state['started']}, {state['elapsed_min']:.1f} min so far; "
           f"plan {state['plan_min']:.1f} min for {len(cases)} cases",
           f"- device: {env.get('device', '?')}; jax {env.get('jax', '?')} "
           f"({env.get('backend', '?')}); torch {env.get('torch', '?')}; "
           f"python {env.get('python', '?')}",
           f"- MFU is against {PEAK_TFLOPS:g} TFLOP/s (H100/H200 SXM dense bf16); FLOPs by the "
           "model's formula (transformer_jax/model/flops.py)",
           f"- estimate: the same step compiled for `{ESTIMATE_TOPOLOGY}` on a CPU "
           "(`--mode=compile`): a roofline bound (FLOPs at peak or bytes at full HBM "
           "bandwidth, whichever is slower) for a program not autotuned and not run, not a "
           "measurement; `measured / bound` is this window's factor"]
  factors = earlier_factors()
  if factors:
    lines.append("- earlier windows' measured / bound of the default steps: " + "; ".join(factors))
  phases = state.get("phases") or []
  if phases:
    lines.append("- phases (guessed / measured minutes): " + "; ".join(
        f"{p['phase']} ({p['cases']} cases) {p['guess_min']:.1f} / "
        + (f"{p['measured_min']:.1f}" if p.get("measured_min") is not None else "-")
        for p in phases))
  return lines + [""]


def profile_tables(row: dict) -> str:
  """A profiled case's tables: the step's time by category, then its top kernels (the
  benchmark's `profile` and `profile_top`, tools/profile.py's summary of two traced steps)."""
  shares, top = row["metrics"]["profile"], row["metrics"]["profile_top"]
  lines = [f"### {row['name']}: {top['step_device_ms']:.1f} ms of device time a step "
           f"({top['steps']} steps traced), {top['idle_share']:.1%} of it idle", "",
           "| category | share of the step | ms per step |", "| --- | ---: | ---: |"]
  lines += [f"| {name} | {share:.1%} | {share * top['step_device_ms']:.2f} |"
            for name, share in shares.items()]
  lines += ["", "| kernel | category | ms per step | share of the step |",
            "| --- | --- | ---: | ---: |"]
  lines += [f"| `{k['op']}` | {k['category']} | {k['ms_per_step']:.3f} | {k['share']:.1%} |"
            for k in top["top"]]
  return "\n".join(lines)


def _profiles(state: dict) -> list:
  """The profiled cases: each category's share of the step side by side, then each one's own
  tables."""
  profiled = [row for row in state["cases"] if (row.get("metrics") or {}).get("profile")]
  failed = [f"- {row['name']}: no profile ({row['metrics']['profile_error']}); its timing stands"
            for row in state["cases"] if (row.get("metrics") or {}).get("profile_error")]
  if not profiled:
    return ["## Where the step's time goes", "", *failed, ""] if failed else []
  kinds = list(profiled[0]["metrics"]["profile"])
  lines = ["## Where the step's time goes (benchmark.profile: two traced steps)", "",
           "Each category's share of the step's device time (its kernels' time plus the idle "
           "gaps between them; tools/profile.py).", "",
           "| case | " + " | ".join(kinds) + " |", "| --- " * (len(kinds) + 1) + "|"]
  lines += [f"| {row['name']} | " + " | ".join(
      f"{row['metrics']['profile'].get(k, 0):.1%}" for k in kinds) + " |" for row in profiled]
  lines.append("")
  for row in profiled:
    if row["metrics"].get("profile_top"):
      lines += [profile_tables(row), ""]
  return lines + (failed + [""] if failed else [])


def render_markdown(state: dict, cases: list) -> str:
  rows = {row["name"]: row for row in state["cases"]}
  lines = ["# GPU suite results", ""]
  if state["dry_run"]:
    lines += ["**Dry run on the CPU with tiny overrides: the numbers mean nothing.**", ""]
  lines += _header(state, cases)
  for table, (title, columns) in TABLES.items():
    members = [c for c in cases if c.table == table]
    if not members:
      continue
    lines += [f"## {title}", "",
              "| case | " + " | ".join(h for h, _ in columns) + " | status |",
              "| --- " * (len(columns) + 2) + "|"]
    for case in members:
      row = rows[case.name]
      done = row["status"] == "ok" or row.get("metrics")
      cells = [fn(case, row) if done else "" for _, fn in columns]
      lines.append(f"| {case.name} | " + " | ".join(cells) + f" | {row['status']} |")
    lines.append("")
  lines += _profiles(state)
  problems = [row for row in state["cases"] if row["status"] not in ("ok", "pending")]
  if problems:
    lines += ["## Not run or not ok", ""]
    lines += [f"- {row['name']}: {row['status']}"
              + (f" ({row['error']})" if row.get("error") else "")
              + (f", log {row['log']}" if row.get("log") else "") for row in problems]
    lines.append("")
  return "\n".join(lines)


def write_results(outdir: pathlib.Path, state: dict, cases: list, started: float) -> None:
  """results.json and results.md, each replaced atomically: a kill mid-write loses nothing."""
  state["elapsed_min"] = (time.time() - started) / 60
  for name, text in (("results.json", json.dumps(state, indent=2)),
                     ("results.md", render_markdown(state, cases))):
    tmp = outdir / f"{name}.tmp"
    tmp.write_text(text + "\n")
    os.replace(tmp, outdir / name)


def plan_text(cases: list, skipped: set) -> str:
  """The plan as printed before a run: each case, then the cost model of one window."""
  lines = [f"{'case':26s} {'min':>5s} {'limit':>6s}  what"]
  for case in cases:
    limit = sum(c.timeout_min for c in case.commands)
    mark = "  (done, skipped)" if case.name in skipped else ""
    lines.append(f"{case.name:26s} {case.minutes:5.2f} {limit:6.0f}  {case.why}{mark}")
  todo = [c for c in cases if c.name not in skipped]
  lines.append(f"total: {len(cases)} cases, about {sum(c.minutes for c in todo):.1f} min on "
               "one GPU one at a time (each case's limit is its kill time)")
  window = plan_lib.in_one_window(todo)
  lines.append(f"one {plan_lib.WINDOW_MIN:g}-minute window: {plan_lib.STARTUP_MIN:g} min for the "
               "machine's start and the install, then (guessed minutes):")
  spent = plan_lib.STARTUP_MIN
  for phase, members, minutes in plan_lib.phases(window):
    spent += minutes
    lines.append(f"  {minutes:4.1f} min  {phase}: {', '.join(c.name for c in members)}"
                 f"  (at {spent:.1f})")
  profiles = sum(c.wave == plan_lib.DEFAULTS for c in window)
  lines.append(f"one window holds the first {len(window)} cases: {profiles} profiled default "
               f"steps, {sum(c.lever for c in window)} levers, "
               f"{sum(bool(c.combine) for c in window)} combinations (pass --budget_min to stop "
               "in time)")
  return "\n".join(lines)
