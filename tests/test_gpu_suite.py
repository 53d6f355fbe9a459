"""benchmarks/gpu (plan, runner, report) and gpu.sh: the dry run of every kind of case fills
results.json/results.md.

No GPU is needed: the dry run runs each case's command on the CPU with a tiny model, so these
tests check the command lines, the config keys and the parsing that the real run will rely on.
"""

import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import pytest
from launcher import QUICK_COMPILE

from benchmarks.gpu import plan as gpu_plan
from benchmarks.gpu import report, runner

REPO = pathlib.Path(__file__).resolve().parents[1]


def make_fake_multi30k(directory: pathlib.Path) -> pathlib.Path:
  """A few sentence pairs in the Multi30k file layout."""
  pairs = [("two dogs play in the snow", "zwei hunde spielen im schnee"),
           ("a girl reads a book", "ein maedchen liest ein buch"),
           ("the man rides a horse", "der mann reitet ein pferd"),
           ("a boy jumps into the water", "ein junge springt ins wasser")]
  directory.mkdir(parents=True)
  for split, count in (("train", 48), ("val", 6), ("test_2016_flickr", 6)):
    rows = [pairs[i % len(pairs)] for i in range(count)]
    (directory / f"{split}.en").write_text("".join(en + "\n" for en, _ in rows))
    (directory / f"{split}.de").write_text("".join(de + "\n" for _, de in rows))
  return directory


def run(argv, env=None, timeout=900):
  return subprocess.run(argv, cwd=REPO, env=dict(os.environ, **(env or {})),
                        capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def dry_run_outdir(tmp_path_factory):
  """Returns `make(path)`: `path` made as an OUTDIR of a dry run whose compilation cache (a run
  keeps it in OUTDIR/jax_cache) is this module's: the two dry runs here compile some of the
  same tiny steps, once."""
  cache = tmp_path_factory.mktemp("dry_run_jax_cache")

  def make(path: pathlib.Path) -> pathlib.Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "jax_cache").symlink_to(cache, target_is_directory=True)
    return path

  return make


# The dry runs' processes compile with LLVM's optimisations off: their tiny steps are only
# checked to run and report (about 30% less CPU: the base train case 10.3 -> 7.6 s). A case's own
# XLA flag is appended to it.
DRY_RUN_ENV = {"XLA_FLAGS": QUICK_COMPILE}


def test_one_window_holds_the_profiles_of_both_models_and_at_least_six_levers():
  cases = gpu_plan.plan("/data/multi30k")
  names = [c.name for c in cases]
  assert names[:2] == ["base_bf16", "big_bf16"]
  assert len(names) == len(set(names))
  for case in cases[:2]:
    profile = case.commands[0].overrides["benchmark.profile"]
    assert case.commands[0].argv("python", pathlib.Path("/out"))[-1].endswith(
        f"benchmark.profile=/out/profiles/{case.describe['model']}") and "{outdir}" in profile
  # Issue 53's goal for one window: the profile of both models and at least 6 levers, by the
  # plan's guessed minutes (each wave compiled at once, then timed from the compilation cache),
  # with the machine's start: the phases add up to the window.
  window = gpu_plan.in_one_window(cases)
  phases = gpu_plan.phases(window)
  assert window[:2] == cases[:2] and sum(c.lever for c in window) >= 6
  assert sum(bool(c.combine) for c in window) == 2
  assert gpu_plan.STARTUP_MIN + sum(m for _, _, m in phases) <= gpu_plan.WINDOW_MIN
  assert [name for name, _, _ in phases] == [
      f"{step} the {wave}" + (" at once" if step == "compile" else ", each alone")
      for wave in ("defaults", "levers", "combinations") for step in ("compile", "time")]
  assert sum(c.lever for c in gpu_plan.in_one_window(cases, 1e9)) == sum(c.lever for c in cases)
  # Without the waves (each case compiling when it runs) a window holds four or five.
  alone = [dataclasses.replace(c, wave=gpu_plan.ALONE) for c in cases]
  assert len(gpu_plan.in_one_window(alone)) < 6
  # The levers of issue 53 in the window, each a config key of this checkout.
  options = {(key, str(value)) for c in window if c.lever
             for key, value in c.commands[0].overrides.items() if not key.startswith("bench")}
  assert {("model.dropout_rng", "rbg"), ("model.attention_impl", "cudnn"),
          ("train.loss_chunk_tokens", str(gpu_plan.LOSS_CHUNK_TOKENS))} <= options
  assert {c.describe["tokens"] for c in window if c.lever} >= {"25k", "64k", "128k"}
  assert any("command_buffer" in c.commands[0].env.get("XLA_FLAGS", "") for c in window)
  assert all(gpu_plan.missing_option(c) is None for c in cases)
  assert [c.name for c in cases if gpu_plan.needs_gpu(c)] == ["big_cudnn", "base_cudnn"]
  assert 50 <= sum(c.minutes for c in cases) <= 90
  for case in cases:
    assert 0 < case.minutes and (case.combine or
                                 case.minutes < sum(c.timeout_min for c in case.commands))
    assert (case.wave != gpu_plan.ALONE) == (case.compile_min > 0)
    for command in case.commands:
      if command.mode == "benchmark":
        assert command.overrides["model.dtype"] == "bfloat16"
  by_name = {c.name: c for c in cases}
  torch = by_name["base_torch"].commands[0]
  assert torch.overrides["benchmark.torch_compile"] == "inductor"
  assert torch.overrides["benchmark.torch_autocast"] is True
  assert torch.env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
  for name, tokens in (("base_b8k", 8192), ("base_b16k", 16384), ("base_bf16", 25600),
                       ("base_b32k", 32768), ("base_b64k", 65536), ("big_b128k", 131072)):
    o = by_name[name].commands[0].overrides
    assert o["benchmark.batch_size"] * o["benchmark.source_len"] == tokens
  train, evaluate = by_name["multi30k"].commands
  assert (train.mode, evaluate.mode) == ("train", "evaluate")
  assert evaluate.overrides["eval.average_last"] == 10
  assert evaluate.overrides["data.eval_split"] == "test_2016_flickr"
  precompiled = runner.precompile_command(by_name["big_bf16"].commands[0]).overrides
  assert precompiled["benchmark.steps"] == 0 and "benchmark.profile" not in precompiled
  flags = {c.commands[0].env.get("XLA_FLAGS") for c in cases if c.name.startswith("big_xla_")}
  assert flags == {flag for _, flag, _ in gpu_plan.XLA_FLAG_CASES}
  assert "multi30k" not in [c.name for c in gpu_plan.plan(None)]
  # The plan as printed: each phase with its minutes, and what one window holds.
  text = report.plan_text(cases, set())
  assert f"one window holds the first {len(window)} cases: 2 profiled default steps" in text
  assert "compile the levers at once: big_rbg, big_cudnn" in text


def test_an_option_this_checkout_lacks_leaves_its_case_out_with_the_reason():
  case = gpu_plan.plan(None)[2]
  command = case.commands[0]
  unknown = dataclasses.replace(case, commands=[dataclasses.replace(
      command, overrides={**command.overrides, "model.no_such_lever": 1})])
  assert gpu_plan.missing_option(unknown) == "no config key model.no_such_lever in this checkout"
  other = dataclasses.replace(case, commands=[dataclasses.replace(
      command, overrides={**command.overrides, "model.dropout_rng": "philox"})])
  assert gpu_plan.missing_option(other).startswith(
      "model.dropout_rng=philox is not a choice of this checkout (threefry, rbg")


def test_the_combination_takes_the_levers_that_beat_the_default_best_first():
  cases = gpu_plan.plan(None)
  best = next(c for c in cases if c.combine == "big")

  def rows(**speeds):
    return {name: {"status": "ok", "metrics": {"target_tokens_per_s": speed}}
            for name, speed in speeds.items()}

  assert gpu_plan.combine(best, cases, rows(big_bf16=100, big_rbg=90, base_rbg=500)) is None
  built = gpu_plan.combine(best, cases, rows(big_bf16=100, big_rbg=110, big_b128k=130,
                                             big_loss_chunk=105, big_cudnn=99,
                                             big_xla_graphs_all=101))
  overrides = built.commands[0].overrides
  assert overrides["model.dropout_rng"] == "rbg"
  assert overrides["train.loss_chunk_tokens"] == gpu_plan.LOSS_CHUNK_TOKENS
  assert overrides["benchmark.batch_size"] == gpu_plan.ROWS["128k"]
  assert "benchmark.profile" not in overrides
  assert overrides.get("model.attention_impl", "plain") == "plain"  # 99 < 100: not taken
  assert built.commands[0].env["XLA_FLAGS"] == gpu_plan.XLA_FLAG_CASES[0][1]
  assert built.why.endswith("big_b128k, big_rbg, big_loss_chunk, big_xla_graphs_all")
  assert built.describe["tokens"] == "128k" and not built.lever
  assert built.compile_min == gpu_plan.NEW_SHAPE_COMPILE_MIN  # 128k: shapes of its own


def test_last_json_finds_the_result_line_under_later_noise():
  output = 'step 1\n{"a": 1}\n{"step_ms": 2.5}\nW1123 warning {not json\n\n'
  assert runner.last_json(output) == {"step_ms": 2.5}
  assert runner.last_json("no json here\n") is None


def test_a_hung_case_is_killed_at_its_timeout(tmp_path):
  log = tmp_path / "hang.log"
  status, _, seconds, output = runner.run_command(
      [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(120)"],
      dict(os.environ), timeout_s=2, log=log)
  assert status == "timeout" and seconds < 30
  assert "started" in output and "time.sleep(120)" in log.read_text()


def test_every_xla_flag_of_the_suite_parses():
  """XLA parses XLA_FLAGS (GPU flags included) when a backend starts, on the CPU too, and aborts
  the process on a flag (or a value) it does not know: every case's flag at once starts, an
  unknown one not."""
  flags = " ".join(flag for _, flag, _ in gpu_plan.XLA_FLAG_CASES)
  start = [sys.executable, "-c", "import jax; print(jax.devices()[0].platform)"]
  good = run(start, env={"JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags}, timeout=120)
  assert good.returncode == 0 and good.stdout.strip() == "cpu", good.stderr[-2000:]
  bad = run(start, env={"JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"{flags} --xla_gpu_no_such_flag=1"},
            timeout=120)
  assert bad.returncode != 0 and "xla_gpu_no_such_flag" in bad.stderr, bad.stderr[-2000:]


# One case of each table, each wave, and every case with options of its own (cuDNN attention,
# the chunked loss, remat, an XLA flag): every parser, column and flag path is exercised; the
# other cases differ from these only in sizes, the other XLA cases only in their flag, which
# test_every_xla_flag_of_the_suite_parses checks in one process.
XLA_SAMPLE = f"big_xla_{gpu_plan.XLA_FLAG_CASES[0][0]}"
SAMPLE = ("base_bf16", "base_rbg", "base_best", "base_torch", "multi30k", "base_decode64",
          "big_cudnn", "big_loss_chunk", "big_remat_dots", XLA_SAMPLE)


def test_gpu_sh_dry_run_fills_a_row_per_case_with_the_parsed_numbers(tmp_path, dry_run_outdir):
  """gpu.sh --dry_run (no venv, no install) runs the suite with the data of $MULTI30K."""
  data = make_fake_multi30k(tmp_path / "multi30k")
  out, venv = dry_run_outdir(tmp_path / "out"), tmp_path / "venv"
  result = run(["bash", "benchmarks/gpu.sh", str(out), "--dry_run", "--only", *SAMPLE],
               env={"PYTHON": sys.executable, "VENV": str(venv), "MULTI30K": str(data),
                    **DRY_RUN_ENV})
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  assert not venv.exists()
  assert f"total: {len(SAMPLE)} cases" in result.stdout  # the plan is printed before it runs

  state = json.loads((out / "results.json").read_text())
  assert state["multi30k_dir"] == str(data)
  expected = [c for c in gpu_plan.plan(str(data)) if c.name in SAMPLE]
  assert {c.table for c in expected} == {c.table for c in gpu_plan.plan(str(data))}
  assert [row["name"] for row in state["cases"]] == [c.name for c in expected]
  assert state["dry_run"] is True and state["environment"]["backend"] == "cpu"
  assert state["environment"]["jax"] and state["environment"]["device"].startswith("1 x ")
  assert state["started"].endswith("+00:00")  # the date, in UTC
  markdown = (out / "results.md").read_text()
  rows = {row["name"]: row for row in state["cases"]}
  # Each wave of the window was compiled at once first and each timed case loaded its program
  # from the compilation cache; each phase's minutes are kept beside the plan's guess.
  phases = {p["phase"]: p for p in state["phases"]}
  assert phases["compile the defaults at once"]["measured_min"] > 0
  assert phases["compile the levers at once"]["cases"] == 3  # big_cudnn is compiled for an H100
  assert rows["base_bf16"]["precompile_status"] == "ok" and "phases (guessed" in markdown
  for row in state["cases"]:
    if row.get("precompile_status") == "ok" and row["status"] == "ok":
      assert row["metrics"]["compile_cache"] == "hit", row
  # The default step's profile: its categories' shares and its top kernels in its row, in
  # results.md and in profiles/base_bf16.md, its trace (and program) in profiles/base.
  shares = rows["base_bf16"]["metrics"]["profile"]
  assert abs(sum(shares.values()) - 1) < 1e-6 and "Where the step's time goes" in markdown
  top = rows["base_bf16"]["metrics"]["profile_top"]
  assert top["steps"] == 2 and top["top"] and all(k["category"] in shares for k in top["top"])
  tables = (out / "profiles" / "base_bf16.md").read_text()
  assert tables.startswith("### base_bf16: ") and tables.strip() in markdown
  assert f"| `{top['top'][0]['op']}` | {top['top'][0]['category']} |" in tables
  assert list((out / "profiles" / "base").glob("**/*.xplane.pb"))
  combined = rows.pop("base_best")
  assert combined["status"] in ("ok", report.NO_WINNER)
  if combined["status"] == "ok":  # base_rbg was faster than base_bf16 in this dry run
    assert "--config.model.dropout_rng=rbg" in combined["commands"][0]
  assert "--config.model.dropout_rng=rbg" in rows["base_rbg"]["commands"][0]
  # cuDNN's attention, which the CPU cannot run: compiled for an H100 where JAX's CUDA
  # compiler is installed, as far as it gets without the cuDNN library (its command line, keys
  # and the config's checks pass), else left out with the reason; never a failure.
  cudnn = rows.pop("big_cudnn")
  if not runner.gpu_compiler():
    assert cudnn["status"] == report.UNAVAILABLE and "CUDA compiler" in cudnn["error"]
  elif cudnn["status"] == "ok":  # the cuDNN library is installed here
    assert cudnn["estimate"]["step_s"] > 0, cudnn
  else:
    assert cudnn["status"] == report.UNAVAILABLE, cudnn
    assert "stopped at: error: model.attention_impl='cudnn' needs NVIDIA's cuDNN" in cudnn[
        "error"]
  if runner.gpu_compiler():
    assert "--config.model.attention_impl=cudnn" in cudnn["commands"][0]
    assert "--config.compile.topology=h100" in cudnn["commands"][0]
  assert "--config.train.loss_chunk_tokens=4" in rows["big_loss_chunk"]["commands"][0]
  for case in expected:
    if case.combine or case.name not in rows:
      continue
    row = rows[case.name]
    assert row["status"] == "ok", row
    assert (out / row["log"]).stat().st_size > 0
    m = row["metrics"]
    if case.table == "multi30k":
      assert 0 <= m["bleu_lowercase_tokenized"] <= 100
      assert row["bleu_minus_published"] == pytest.approx(m["bleu_lowercase_tokenized"] - 41.02)
      assert len(m["checkpoints"]) == 10  # --config.eval.average_last=10 took effect
      assert m["split"] == "test_2016_flickr"
      assert row["val_metrics"]["step"] == 10  # the train run's own final validation
      assert row["val_metrics"]["split"] == "val"
      assert row["train_wall_s"] > 0 and row["evaluate_wall_s"] > 0
      assert "--config.data.eval_split=test_2016_flickr" in row["commands"][1]
      # The given data's files were checked; the tiny model trains on the suite's fake text,
      # which its vocabulary of 64 fits (the real Multi30k's characters alone do not).
      assert f"--config.data.path={out}/fake_multi30k" in row["commands"][0]
      line = next(row for row in markdown.splitlines() if row.startswith("| multi30k |"))
      assert f"{m['bleu_lowercase_tokenized']:.4g}" in line
      continue
    for key in ("compile_s", "step_ms", "target_tokens_per_s", "tflops_per_s"):
      assert m[key] > 0, (case.name, key)
    assert row["mfu_989"] == pytest.approx(m["tflops_per_s"] / 989)
    if case.table == "torch":
      assert m["torch_step_ms"] > 0
      assert m["speedup_vs_torch"] == pytest.approx(m["torch_step_ms"] / m["step_ms"])
      assert "--config.benchmark.torch_autocast=True" in row["commands"][0]
      assert "--config.benchmark.torch_compile=eager" in row["commands"][0]
    if case.table == "decode":
      assert m["greedy_tokens_per_s"] > 0 and m["beam4_tokens_per_s"] > 0
    first_train = case is next(c for c in expected if c.table == "train")
    if first_train and runner.gpu_compiler():
      # The same step compiled for an H100 on the CPU, beside the measured one (a dry run
      # estimates the first train case only: each estimate is a GPU compile).
      assert "--config.compile.topology=h100" in (out / f"logs/{case.name}.estimate.log"
                                                   ).read_text()
      assert row["estimate"]["step_s"] > 0 and 0 < row["estimate"]["mfu"] < 1, row
      assert row["estimate"]["kind"].startswith("roofline bound")
    elif case.table == "train":
      assert "estimate" not in row and not (out / f"logs/{case.name}.estimate.log").exists()
    line = next(row for row in markdown.splitlines() if row.startswith(f"| {case.name} |"))
    assert line.endswith("| ok |")
    shown = m["step_ms"] if case.table != "decode" else m["greedy_tokens_per_s"]
    assert report.num(shown) in line
  assert "estimate: roofline bound ms" in markdown and "measured / bound" in markdown
  assert "earlier windows' measured / bound of the default steps: base 2.02x" in markdown
  assert "--config.model.remat=dots" in rows["big_remat_dots"]["commands"][0]
  flag = next(flag for name, flag, _ in gpu_plan.XLA_FLAG_CASES if XLA_SAMPLE.endswith(name))
  # The case's flag reached its process, after the flags of the suite's own environment.
  assert f"XLA_FLAGS={QUICK_COMPILE} {flag} " in (out / rows[XLA_SAMPLE]["log"]).read_text(
      ).replace("'", "")

  # --estimates_only, afterwards: the next measured train case gets its estimate (a dry run
  # estimates one per call), the rows stay as they ran, the combination with its own options.
  assert runner.main([str(out), "--dry_run", "--estimates_only"]) == 0
  before = {**rows, "big_cudnn": cudnn, "base_best": combined}
  after = {row["name"]: row for row in json.loads((out / "results.json").read_text())["cases"]}
  new = {n for n, r in after.items() if "estimate" in r} - {
      n for n, r in before.items() if "estimate" in r}
  assert len(new) == 1 and after[new.pop()]["estimate"]["kind"].startswith("roofline bound")
  assert {n: r["status"] for n, r in after.items()} == {n: r["status"] for n, r in before.items()}
  if combined["status"] == "ok":
    line = next(line for line in (out / "results.md").read_text().splitlines()
                if line.startswith("| base_best |"))
    assert line.startswith("| base_best | base | 25k | plain | none | rbg |"), line


def test_a_failing_case_is_recorded_a_missing_option_noted_and_the_suite_goes_on(
    tmp_path, monkeypatch, dry_run_outdir, capsys):
  bad = gpu_plan.Case("bad", "train", 0.1, "a value the config refuses", [gpu_plan.Command(
      "benchmark", "experiments/base.py", {"train.learning_rate": -1.0})], {})
  missing = gpu_plan.Case("missing", "train", 0.1, "a lever not merged yet", [gpu_plan.Command(
      "benchmark", "experiments/base.py", {"model.no_such_lever": 1})], {})
  # A case of the dry run above: its tiny step is in this module's compilation cache (the
  # test reads it instead of compiling it again).
  good = next(c for c in gpu_plan.plan(None) if c.name == "base_rbg")
  monkeypatch.setattr(gpu_plan, "plan", lambda multi30k: [bad, missing, good])
  dry_run_outdir(tmp_path)
  for key, value in DRY_RUN_ENV.items():  # for the cases' processes (this one's JAX has started)
    monkeypatch.setenv(key, value)
  code = runner.main([str(tmp_path), "--dry_run", "--jobs", "1", "--no_estimates",
                      "--precompile_jobs", "0"])
  assert code == 1
  assert "note: missing is left out: no config key model.no_such_lever" in capsys.readouterr().out
  state = json.loads((tmp_path / "results.json").read_text())
  assert [row["status"] for row in state["cases"]] == ["failed", report.UNAVAILABLE, "ok"]
  assert "train.learning_rate must be positive" in state["cases"][0]["error"]
  assert state["cases"][2]["metrics"]["step_ms"] > 0 and "estimate" not in state["cases"][2]
  text = (tmp_path / "results.md").read_text()
  assert "- bad: failed" in text and "- missing: unavailable (no config key" in text


def test_the_report_keeps_a_timing_whose_profile_failed_and_says_why():
  cases = gpu_plan.plan(None)[:2]
  state = {"dry_run": False, "started": "2026-11-29T00:00:00+00:00", "elapsed_min": 1.0,
           "plan_min": 5.4, "cases": [
               {"name": "base_bf16", "status": "ok", "metrics": {
                   "step_ms": 49.1, "profile_error": "RuntimeError: no CUPTI"}},
               {"name": "big_bf16", "status": "pending"}]}
  text = report.render_markdown(state, cases)
  assert "| base_bf16 | base | 25k | plain | none | threefry | - | `-` | - | 49.1 |" in text
  assert "- base_bf16: no profile (RuntimeError: no CUPTI); its timing stands" in text
  assert "| big_bf16 |" in text and text.count("| pending |") == 1
