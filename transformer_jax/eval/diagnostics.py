"""Why a seq2seq model fails where it does: its outputs by reference length, where the first
wrong token falls, and the same for decoding with the reference's length (the oracle length).

Everything here compares whitespace-separated tokens of the detokenized text (SCAN's actions,
a translation's words), so the numbers do not depend on the subword vocabulary:

  exact_match: the output equals the reference.
  token_accuracy: output tokens equal to the reference's at the same position, over the
    reference's tokens (a missing token is wrong; tokens past the reference's end are not
    counted, but such an output is not an exact match). Not the teacher-forced token accuracy
    of `evaluate`'s top level: this one is of the decoded output.
  first error: the position (0-based) of the first token where output and reference differ; an
    output that stops early errs at its own length, one that runs on at the reference's.
  errors: wrong outputs that stopped early (a strict prefix of the reference), ran on (the
    reference is a strict prefix of them), or have a wrong token before either end.

With oracle-length decoding (EOS masked out, stopped at the reference's length; see
`decode.greedy_decode`) no output stops early or runs on, so `oracle_exact_match` minus
`exact_match` is the share the model loses by deciding when to stop.

By group (`by_group`): exact match over named groups of the examples that the data source
gives (data/sources.py `groups`; for SCAN's length splits, whether training showed every
repetition count of the command), as rows and as flat metrics `exact_match_GROUP`.
"""

from __future__ import annotations

from collections import Counter
from typing import Optional, Sequence

DECODINGS = ("standard", "oracle")


def first_error(hypothesis: Sequence[str], reference: Sequence[str]) -> Optional[int]:
  """The first position where the token lists differ (None if they are equal)."""
  for i, (h, r) in enumerate(zip(hypothesis, reference)):
    if h != r:
      return i
  return None if len(hypothesis) == len(reference) else min(len(hypothesis), len(reference))


def error_kind(hypothesis: Sequence[str], reference: Sequence[str]) -> Optional[str]:
  """None (exact), "stopped_early", "ran_on" or "wrong_token" (see the module docstring)."""
  position = first_error(hypothesis, reference)
  if position is None:
    return None
  if position == len(hypothesis):
    return "stopped_early"
  if position == len(reference):
    return "ran_on"
  return "wrong_token"


def _correct_tokens(hypothesis: Sequence[str], reference: Sequence[str]) -> int:
  return sum(h == r for h, r in zip(hypothesis, reference))


def diagnose(references: Sequence[str], outputs: dict) -> dict:
  """The diagnostics of decoded texts against their references.

  Args:
    references: the reference texts.
    outputs: {decoding name (see DECODINGS): the hypotheses, one per reference}.

  Returns:
    by_length: one row per reference length (in tokens), shortest first: length, examples, and
      for each decoding D ("" for standard, "oracle_" for oracle) D + exact_match and
      D + token_accuracy, both in [0, 1];
    first_error: {decoding: {position (a string, for JSON): wrong outputs whose first error is
      there}}, positions in increasing order;
    errors: {decoding: {"stopped_early", "ran_on", "wrong_token": counts}}.
  """
  references = [r.split() for r in references]
  lengths = sorted({len(r) for r in references})
  rows = {n: {"length": n, "examples": 0} for n in lengths}
  for r in references:
    rows[len(r)]["examples"] += 1
  first, errors = {}, {}
  for name, hypotheses in outputs.items():
    prefix = "" if name == "standard" else f"{name}_"
    exact, correct, positions, kinds = Counter(), Counter(), Counter(), Counter()
    for h, r in zip((h.split() for h in hypotheses), references):
      kind = error_kind(h, r)
      exact[len(r)] += kind is None
      correct[len(r)] += _correct_tokens(h, r)
      if kind is not None:
        positions[first_error(h, r)] += 1
        kinds[kind] += 1
    for n, row in rows.items():
      row[f"{prefix}exact_match"] = exact[n] / row["examples"]
      row[f"{prefix}token_accuracy"] = correct[n] / (n * row["examples"]) if n else 1.0
    first[name] = {str(p): positions[p] for p in sorted(positions)}
    errors[name] = {k: kinds[k] for k in ("stopped_early", "ran_on", "wrong_token")}
  return {"by_length": [rows[n] for n in lengths], "first_error": first, "errors": errors}


def by_group(references: Sequence[str], outputs: dict, groups: Sequence[str]) -> dict:
  """Exact match by group of the examples, for each decoding of `outputs` (see `diagnose`).

  Returns by_group: one row per group in order of first appearance: group, examples, and for
  each decoding D ("" for standard, "oracle_" for oracle) D + exact_match; and the same as flat
  metrics: D + "exact_match_" + group.
  """
  names = list(dict.fromkeys(groups))
  rows = {g: {"group": g, "examples": sum(x == g for x in groups)} for g in names}
  flat = {}
  for name, hypotheses in outputs.items():
    prefix = "" if name == "standard" else f"{name}_"
    right = Counter(g for g, h, r in zip(groups, hypotheses, references) if h.split() == r.split())
    for g, row in rows.items():
      row[f"{prefix}exact_match"] = flat[f"{prefix}exact_match_{g}"] = right[g] / row["examples"]
  return {"by_group": [rows[g] for g in names], **flat}


def by_group_table(result: dict) -> str:
  """The by-group rows of an evaluation (see `by_group`) as a Markdown table, percentages."""
  rows = result.get("by_group") or []
  if not rows:
    return ""
  oracle = "oracle_exact_match" in rows[0]
  lines = ["| group | examples | exact match |" + (" oracle-length exact match |" if oracle
                                                   else ""),
           "| --- | --- | --- |" + (" --- |" if oracle else "")]
  for row in rows:
    lines.append(f"| {row['group']} | {row['examples']} | {100 * row['exact_match']:.2f}% |"
                 + (f" {100 * row['oracle_exact_match']:.2f}% |" if oracle else ""))
  return "\n".join(lines)


def by_length_table(result: dict) -> str:
  """The by-length rows of an evaluation (see `diagnose`) as a Markdown table, percentages."""
  rows = result.get("by_length") or []
  if not rows:
    return ""
  oracle = "oracle_exact_match" in rows[0]
  columns = ["exact_match", "token_accuracy"] + (
      ["oracle_exact_match", "oracle_token_accuracy"] if oracle else [])
  names = {"exact_match": "exact match", "token_accuracy": "token accuracy",
           "oracle_exact_match": "oracle-length exact match",
           "oracle_token_accuracy": "oracle-length token accuracy"}
  lines = ["| reference length | examples | " + " | ".join(names[c] for c in columns) + " |",
           "| --- | --- |" + " --- |" * len(columns)]
  for row in rows:
    lines.append(f"| {row['length']} | {row['examples']} | "
                 + " | ".join(f"{100 * row[c]:.1f}%" for c in columns) + " |")
  return "\n".join(lines)


def errors_line(result: dict) -> str:
  """One line per decoding: how the wrong outputs went wrong, and the commonest first-error
  positions."""
  lines = []
  for name, kinds in (result.get("errors") or {}).items():
    positions = result.get("first_error", {}).get(name, {})
    common = sorted(positions.items(), key=lambda item: -item[1])[:5]
    shown = ", ".join(f"{p} ({c})" for p, c in common) or "none"
    lines.append(f"- {name} decoding: {kinds['stopped_early']} stopped early, {kinds['ran_on']} "
                 f"ran on, {kinds['wrong_token']} had a wrong token first; commonest first-error "
                 f"positions (0-based, count): {shown}")
  return "\n".join(lines)
