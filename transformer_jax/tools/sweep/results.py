"""A sweep's tables and plots, rebuilt from its study at any time (--mode=sweep_results, and
--mode=plot on a sweep's workdir): one row per trial directory, with the state of its latest
attempt (finished, pruned at step N, failed: why, running, waiting) and how often a lost worker
made it start again."""

from __future__ import annotations

import csv
import io
import os
import statistics
import warnings
from typing import Optional

from transformer_jax.core import metric_names, storage
from transformer_jax.core.errors import UserError

# The metrics of a run's best evaluation and of its test pass that the tables show (those it
# reported), after the sweep's own metric.
SHOWN = ("exact_match", "oracle_exact_match", "token_accuracy", "bleu", "accuracy", "loss",
         "exact_match_repetitions_trained", "exact_match_repetition_unseen")


def _state(t) -> str:
  from optuna.trial import TrialState
  a = t.user_attrs
  if t.state == TrialState.COMPLETE:
    return "finished"
  if t.state == TrialState.PRUNED:
    return f"pruned at step {a.get('sweep_pruned_step', '?')}"
  if t.state == TrialState.RUNNING:
    return "running"
  if t.state == TrialState.WAITING:
    return "waiting"
  if a.get("sweep_error"):
    return f"failed: {a['sweep_error']}"
  return "lost (its worker stopped; retries spent)"


def _retries(what: str, trial):
  """Optuna's record of a retried trial (RetryHeartbeatStaleTrialCallback's, experimental
  since Optuna 2.8: its warning left out)."""
  import optuna
  from optuna.storages import RetryHeartbeatStaleTrialCallback
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
    return getattr(RetryHeartbeatStaleTrialCallback, what)(trial)


def root_of(trial) -> int:
  """The number of the trial a (retried) trial continues: its directory's number."""
  retried = _retries("retried_trial_number", trial)
  return trial.number if retried is None else retried


def retry_history(trial) -> list:
  """The numbers of the earlier attempts of a retried trial, first to last."""
  return _retries("retry_history", trial)


def latest_attempts(study) -> list:
  """[(trial directory number, its latest attempt, its attempts)] in directory order; trials
  drawn past the budget (sweep_surplus) left out."""
  by_root = {}
  for t in study.get_trials(deepcopy=False):
    if t.user_attrs.get("sweep_surplus"):
      continue
    root = root_of(t)
    by_root.setdefault(root, []).append(t)
  return [(root, max(ts, key=lambda t: t.number), ts) for root, ts in sorted(by_root.items())]


def _wall_s(attempts: list):
  """A trial's wall time: all its attempts' (a lost one's up to its last evaluation)."""
  walls = [t.user_attrs["sweep_wall_s"] for t in attempts if "sweep_wall_s" in t.user_attrs]
  return round(sum(walls), 1) if walls else ""


def _metrics(t, metric: str) -> dict:
  """What a trial reported: its final evaluation's metrics, or a pruned one's at its pruning
  step (at least `metric`, the value the study holds for that step)."""
  got = dict(t.user_attrs.get("sweep_metrics") or {})
  step = t.user_attrs.get("sweep_pruned_step")
  if t.state.name == "PRUNED" and metric not in got and step in t.intermediate_values:
    got[metric] = t.intermediate_values[step]
  return got


def _cell(v) -> str:
  return f"{v:.4g}" if isinstance(v, float) else str(v)


def rows(study, metric: str) -> list[dict]:
  """One row per trial directory, best first (finished, by `metric`), then the others."""
  attempts = latest_attempts(study)
  keys = sorted({k for _, t, _ in attempts for k in (t.user_attrs.get("sweep_overrides") or {})
                 if k != "seed"})
  seeded = any(t.user_attrs.get("sweep_seed") is not None for _, t, _ in attempts)
  reported = {t.number: _metrics(t, metric) for _, t, _ in attempts}
  columns = sorted({k for got in reported.values() for k in got
                    if k not in ("max_examples", "max_decode_len")})
  shown = {part: [m for m in dict.fromkeys((metric, *SHOWN))
                  if any(m in (t.user_attrs.get(f"sweep_{part}") or {}).get("metrics", {})
                         for _, t, _ in attempts)] for part in ("best", "test")}
  table = []
  for root, t, tries in attempts:
    a = t.user_attrs
    overrides = a.get("sweep_overrides") or {}
    row = {"trial": f"trial_{root:04d}", "state": _state(t)}
    if a.get("sweep_test_status"):
      row["state"] += f" ({a['sweep_test_status']})"
    if seeded:
      row["seed"] = "" if a.get("sweep_seed") is None else a["sweep_seed"]
    row.update({k: overrides.get(k, "") for k in keys})
    row.update({m: reported[t.number].get(m, "") for m in columns})
    for part in ("best", "test"):
      got = (a.get(f"sweep_{part}") or {}).get("metrics", {})
      row.update({f"{part}_{m}": got.get(m, "") for m in shown[part]})
    row.update({"best_step": a.get("sweep_best_step", ""), "retries": len(tries) - 1,
                "wall_time_s": _wall_s(tries),
                # set-up and first step (compile or cache), to a hundredth of a second (a
                # worker's later trials start in a few); "cache": what answered it
                "startup_s": round((a.get("sweep_startup") or {}).get("startup_s", 0.0), 2)
                if a.get("sweep_startup") else "",
                "cache": (a.get("sweep_startup") or {}).get("cache", ""),
                "get_sweep": "" if a.get("sweep_index") is None else a["sweep_index"]})
    table.append(row)

  def order(row):
    value = row.get(metric, "")
    done = row["state"].startswith("finished") and value != ""
    return (not done, metric_names.sort_key(metric, value) if done else 0.0, row["trial"])

  return sorted(table, key=order)


def seed_rows(table: list[dict], metric: str) -> list[dict]:
  """One row per get_sweep() trial run with several seeds: median [min, max] over its finished
  runs of the final metric and each best_/test_ column."""
  groups = {}
  for row in table:
    if row.get("seed", "") != "" and row["get_sweep"] != "":
      groups.setdefault(row["get_sweep"], []).append(row)
  names = [metric] + [k for k in table[0] if k.startswith(("best_", "test_")) and k != "best_step"]
  out = []
  for index, members in sorted(groups.items()):
    done = [r for r in members if r["state"].startswith("finished")]
    row = {"get_sweep": index, "seeds": f"{len(done)}/{len(members)}"}
    for name in names:
      found = [float(r[name]) for r in done if r.get(name, "") != ""]
      row.update({f"{name}_median": statistics.median(found) if found else "",
                  f"{name}_min": min(found) if found else "",
                  f"{name}_max": max(found) if found else ""})
    out.append(row)

  def order(row):
    for name in (f"best_{metric}_median", f"{metric}_median"):
      if row.get(name, "") != "":
        return (False, metric_names.sort_key(metric, row[name]), row["get_sweep"])
    return (True, 0.0, row["get_sweep"])

  return sorted(out, key=order)


def _write_csv(path: str, table: list) -> str:
  text = io.StringIO(newline="")
  writer = csv.DictWriter(text, fieldnames=list(table[0]))
  writer.writeheader()
  writer.writerows(table)
  return storage.write(path, text.getvalue())


def _markdown(table: list) -> list[str]:
  columns = list(table[0])
  return (["| " + " | ".join(columns) + " |", "| " + " | ".join("---" for _ in columns) + " |"]
          + ["| " + " | ".join(_cell(row[c]) for c in columns) + " |" for row in table])


def write(study, workdir: str, metric: str, split: str) -> tuple[str, Optional[str]]:
  """results.csv and results.md (and results_seeds.csv with seeded trials) from the study;
  returns the Markdown text and the best finished trial's directory (or None)."""
  table = rows(study, metric)
  if not table:
    return "(no trials yet)", None
  _write_csv(storage.join(workdir, "results.csv"), table)
  better = "lower" if metric_names.lower_is_better(metric) else "higher"
  lines = [f"# Sweep results: {metric} on split {split!r}, best first", "",
           f"Study {study.study_name}. Each trial directory's latest attempt: finished trials by "
           f"their final {metric} on data.eval_split ({split}) at train.steps ({better} is "
           "better), then the others (a pruned one's metrics at its pruning step); best_step: its "
           f"evaluation with the best {metric}; retries: how often a lost worker's trial was "
           "taken up again; wall_time_s: all its attempts'.", ""]
  lines += _markdown(table)
  by_seed = seed_rows(table, metric)
  if by_seed:
    _write_csv(storage.join(workdir, "results_seeds.csv"), by_seed)
    lines += ["", "## Over seeds: median [min, max] of each get_sweep() trial's finished runs",
              ""]
    metrics = [k[:-len("_median")] for k in by_seed[0] if k.endswith("_median")
               and any(r[k] != "" for r in by_seed)]
    lines += ["| get_sweep | seeds | " + " | ".join(metrics) + " |",
              "| " + " | ".join("---" for _ in range(len(metrics) + 2)) + " |"]
    for r in by_seed:
      cells = ["" if r[f"{m}_median"] == "" else
               f"{_cell(r[f'{m}_median'])} [{_cell(r[f'{m}_min'])}, {_cell(r[f'{m}_max'])}]"
               for m in metrics]
      lines.append(f"| {r['get_sweep']} | {r['seeds']} | " + " | ".join(cells) + " |")
  text = "\n".join(lines) + "\n"
  storage.write(storage.join(workdir, "results.md"), text)
  best = table[0]
  found = (storage.join(workdir, best["trial"]) + f" ({metric} {_cell(best[metric])})"
           if best["state"] == "finished" else None)
  return text, found


def open_study(workdir: str, url: Optional[str]):
  """The study of a sweep's workdir (read through its sweep.json), in `url` if given."""
  import optuna

  from transformer_jax.tools.sweep import store
  record = store.read_record(workdir)
  if record is None:
    raise UserError(f"{workdir} holds no sweep (no {store.RECORD}); give the --workdir a --sweep "
                    "ran in")
  if url is None and record["storage"] != os.path.join(workdir, store.JOURNAL) and \
      "://" in record["storage"]:
    url = record["storage"]
    if ":***@" in url:
      raise UserError(f"the study of {workdir} is in {url}: give --sweep_storage with its "
                      "password (or leave the password out and set PGPASSWORD)")
  optuna.logging.set_verbosity(optuna.logging.ERROR)
  st = store.open_storage(url, storage.check(workdir), heartbeat_s=60, retries=0, create=False)
  try:
    return optuna.load_study(study_name=record["study"], storage=st.storage)
  except KeyError:
    raise UserError(f"no study {record['study']} in {st.url}; give the --sweep_storage the "
                    "sweep used") from None


def sweep_results(workdir: str, url: Optional[str], metric: Optional[str] = None) -> str:
  """--mode=sweep_results: the tables rebuilt from the study, nothing trained."""
  study = open_study(workdir, url)
  ours = study.user_attrs.get("transformer_jax", {})
  metric = metric or ours.get("metric", "loss")
  text, best = write(study, workdir, metric, ours.get("split", "data.eval_split"))
  return text + (f"\nbest trial: {best}\n" if best else "")


def plot(workdir: str, url: Optional[str]) -> list[str]:
  """--mode=plot on a sweep's workdir: Optuna's optimisation history, parameter importances and
  intermediate values (learning curves of pruned and finished trials) in WORKDIR/plots/."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import optuna.visualization.matplotlib as vis
  study = open_study(workdir, url)
  directory = storage.join(workdir, "plots")
  storage.makedirs(directory)
  written = []
  for name, draw in (("sweep_history", vis.plot_optimization_history),
                     ("sweep_importances", vis.plot_param_importances),
                     ("sweep_intermediate_values", vis.plot_intermediate_values)):
    try:
      axes = draw(study)
    except (ValueError, RuntimeError, ZeroDivisionError) as e:  # too few trials or parameters
      print(f"{name}: not drawn ({' '.join(str(e).split())})")
      continue
    figure = axes.figure if hasattr(axes, "figure") else axes.flat[0].figure
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", bbox_inches="tight")
    plt.close(figure)
    written.append(storage.write(storage.join(directory, f"{name}.png"), buffer.getvalue()))
  return written
