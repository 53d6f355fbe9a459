"""benchmarks/gpu_suite.py and gpu.sh: the dry run of every case fills results.json/results.md.

No GPU is needed: the dry run runs each case's command on the CPU with a tiny model, so these
tests check the command lines, the config keys and the parsing that the real run will rely on.
"""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest
from launcher import QUICK_COMPILE

REPO = pathlib.Path(__file__).resolve().parents[1]
# A script, not a module of the package: loaded from its file.
_SPEC = importlib.util.spec_from_file_location("gpu_suite", REPO / "benchmarks" / "gpu_suite.py")
gpu_suite = importlib.util.module_from_spec(_SPEC)
sys.modules["gpu_suite"] = gpu_suite  # its dataclasses look their module up there
_SPEC.loader.exec_module(gpu_suite)


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
  """Returns `make(path)`: `path` made as an OUTDIR of a dry run whose compilation cache (a dry
  run keeps it in OUTDIR/jax_cache) is this module's: the cases of the three dry runs here
  compile the same tiny steps (base_bf16's is in each), once."""
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


def test_the_plan_fits_a_window_and_starts_with_the_profiled_default_steps():
  cases = gpu_suite.plan("/data/multi30k")
  names = [c.name for c in cases]
  assert names[:2] == ["base_bf16", "big_bf16"]
  assert len(names) == len(set(names))
  for case in cases[:2]:
    profile = case.commands[0].overrides["benchmark.profile"]
    assert case.commands[0].argv("python", gpu_suite.pathlib.Path("/out"))[-1].endswith(
        f"benchmark.profile=/out/profiles/{case.describe['model']}") and "{outdir}" in profile
  # Issue 53's goal for one window: the profile of both models and at least 6 levers, by the
  # plan's guessed minutes (compiled at once first, then timed from the compilation cache).
  window = gpu_suite.in_one_window(cases)
  assert window[:2] == cases[:2] and sum(c.lever for c in window) >= 6
  assert sum(c.lever for c in gpu_suite.in_one_window(cases, 1e9)) == sum(c.lever for c in cases)
  assert len(gpu_suite.in_one_window([c for c in cases if not gpu_suite.precompilable(c)])) < 6
  levers = [c for c in cases if c.lever]
  assert {"model.dropout_rng", "model.attention_impl", "model.remat"} <= {
      key for c in levers for key in c.commands[0].overrides if key.startswith("model.")}
  assert {c.combine for c in cases if c.combine} == {"base", "big"}
  assert 40 <= sum(c.minutes for c in cases) <= 70
  for case in cases:
    assert 0 < case.minutes and (case.combine or
                                 case.minutes < sum(c.timeout_min for c in case.commands))
    for command in case.commands:
      if command.mode == "benchmark":
        assert command.overrides["model.dtype"] == "bfloat16"
  by_name = {c.name: c for c in cases}
  torch = by_name["base_torch"].commands[0]
  assert torch.overrides["benchmark.torch_compile"] == "inductor"
  assert torch.overrides["benchmark.torch_autocast"] is True
  assert torch.env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
  for name, tokens in (("base_b8k", 8192), ("base_b16k", 16384), ("base_bf16", 25600),
                       ("base_b32k", 32768), ("base_b64k", 65536)):
    o = by_name[name].commands[0].overrides
    assert o["benchmark.batch_size"] * o["benchmark.source_len"] == tokens
  train, evaluate = by_name["multi30k"].commands
  assert (train.mode, evaluate.mode) == ("train", "evaluate")
  assert evaluate.overrides["eval.average_last"] == 10
  assert evaluate.overrides["data.eval_split"] == "test_2016_flickr"
  precompiled = gpu_suite.precompile_command(by_name["big_bf16"].commands[0]).overrides
  assert precompiled["benchmark.steps"] == 0 and "benchmark.profile" not in precompiled
  flags = {c.commands[0].env.get("XLA_FLAGS") for c in cases if c.name.startswith("big_xla_")}
  assert flags == {flag for _, flag, _ in gpu_suite.XLA_FLAG_CASES}
  assert "multi30k" not in [c.name for c in gpu_suite.plan(None)]


def test_the_combination_takes_the_levers_that_beat_the_default_best_first():
  cases = gpu_suite.plan(None)
  best = next(c for c in cases if c.combine == "big")

  def rows(**speeds):
    return {name: {"status": "ok", "metrics": {"target_tokens_per_s": speed}}
            for name, speed in speeds.items()}

  assert gpu_suite.combine(best, cases, rows(big_bf16=100, big_rbg=90, base_rbg=500)) is None
  built = gpu_suite.combine(best, cases, rows(big_bf16=100, big_rbg=110, big_b64k_qkv_out=130,
                                              big_attn_jax=99, big_xla_lhs=101))
  overrides = built.commands[0].overrides
  assert overrides["model.dropout_rng"] == "rbg" and overrides["model.remat"] == "qkv_out"
  assert overrides["benchmark.batch_size"] == gpu_suite.ROWS["64k"]
  assert overrides.get("model.attention_impl", "plain") == "plain"  # 99 < 100: not taken
  assert built.commands[0].env["XLA_FLAGS"] == gpu_suite.XLA_FLAG_CASES[0][1]
  assert built.why.endswith("big_b64k_qkv_out, big_rbg, big_xla_lhs")
  assert built.describe["tokens"] == "64k" and not built.lever


def test_last_json_finds_the_result_line_under_later_noise():
  output = 'step 1\n{"a": 1}\n{"step_ms": 2.5}\nW1123 warning {not json\n\n'
  assert gpu_suite.last_json(output) == {"step_ms": 2.5}
  assert gpu_suite.last_json("no json here\n") is None


def test_a_hung_case_is_killed_at_its_timeout(tmp_path):
  log = tmp_path / "hang.log"
  status, _, seconds, output = gpu_suite.run_command(
      [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(120)"],
      dict(os.environ), timeout_s=2, log=log)
  assert status == "timeout" and seconds < 30
  assert "started" in output and "time.sleep(120)" in log.read_text()


# One case of each table and every case with flags of its own (attention, remat, one XLA flag):
# every parser, column and flag path is exercised; the other cases differ from these only in
# sizes (all 18 took 2+ minutes of the suite), the other XLA cases only in their flag, which
# test_every_xla_flag_of_the_suite_parses checks in one process.
XLA_SAMPLE = f"big_xla_{gpu_suite.XLA_FLAG_CASES[0][0]}"
SAMPLE = ("base_bf16", "base_rbg", "base_best", "base_torch", "multi30k", "base_decode64",
          "big_attn_jax", "big_remat_dots", XLA_SAMPLE)


def test_every_xla_flag_of_the_suite_parses():
  """XLA parses XLA_FLAGS (GPU flags included) when a backend starts, on the CPU too, and aborts
  the process on a flag it does not know: every case's flag at once starts, an unknown one not."""
  flags = " ".join(flag for _, flag, _ in gpu_suite.XLA_FLAG_CASES)
  start = [sys.executable, "-c", "import jax; print(jax.devices()[0].platform)"]
  good = run(start, env={"JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags}, timeout=120)
  assert good.returncode == 0 and good.stdout.strip() == "cpu", good.stderr[-2000:]
  bad = run(start, env={"JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"{flags} --xla_gpu_no_such_flag=1"},
            timeout=120)
  assert bad.returncode != 0 and "xla_gpu_no_such_flag" in bad.stderr, bad.stderr[-2000:]


def test_dry_run_fills_a_row_per_case_with_the_parsed_numbers(tmp_path, dry_run_outdir):
  data = make_fake_multi30k(tmp_path / "multi30k")
  out = dry_run_outdir(tmp_path / "out")
  result = run([sys.executable, "benchmarks/gpu_suite.py", str(out), "--dry_run",
                "--multi30k", str(data), "--only", *SAMPLE], env=DRY_RUN_ENV)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  assert f"total: {len(SAMPLE)} cases" in result.stdout  # the plan is printed before it runs

  state = json.loads((out / "results.json").read_text())
  expected = [c for c in gpu_suite.plan(str(data)) if c.name in SAMPLE]
  assert {c.table for c in expected} == {c.table for c in gpu_suite.plan(str(data))}
  assert [row["name"] for row in state["cases"]] == [c.name for c in expected]
  assert state["dry_run"] is True and state["environment"]["backend"] == "cpu"
  markdown = (out / "results.md").read_text()
  rows = {row["name"]: row for row in state["cases"]}
  # The window's train cases were compiled at once first, and each timed one loaded its program
  # from the compilation cache; the default step's profile is in its row and in results.md.
  assert state["precompile_min"] > 0 and rows["base_bf16"]["precompile_status"] == "ok"
  for row in state["cases"]:
    if row.get("precompile_status") == "ok" and row["status"] == "ok":
      assert row["metrics"]["compile_cache"] == "hit", row
  shares = rows["base_bf16"]["metrics"]["profile"]
  assert abs(sum(shares.values()) - 1) < 1e-6 and "Where the step's time goes" in markdown
  combined = rows.pop("base_best")
  assert combined["status"] in ("ok", gpu_suite.NO_WINNER)
  if combined["status"] == "ok":  # base_rbg was faster than base_bf16 in this dry run
    assert "--config.model.dropout_rng=rbg" in combined["commands"][0]
  assert "--config.model.dropout_rng=rbg" in rows["base_rbg"]["commands"][0]
  for case, row in zip(expected, state["cases"]):
    if case.combine:
      continue
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
    if first_train and importlib.util.find_spec("jax_plugins.xla_cuda12"):
      # The same step compiled for an H100 on the CPU, beside the measured one (a dry run
      # estimates the first train case only: each estimate is a GPU compile).
      assert "--config.compile.topology=h100" in (out / f"logs/{case.name}.estimate.log"
                                                   ).read_text()
      assert row["estimate"]["step_s"] > 0 and 0 < row["estimate"]["mfu"] < 1, row
    elif case.table == "train":
      assert "estimate" not in row and not (out / f"logs/{case.name}.estimate.log").exists()
    line = next(row for row in markdown.splitlines() if row.startswith(f"| {case.name} |"))
    assert line.endswith("| ok |")
    shown = m["step_ms"] if case.table != "decode" else m["greedy_tokens_per_s"]
    assert gpu_suite._num(shown) in line  # pylint: disable=protected-access
  assert "--config.model.attention_impl=jax" in rows["big_attn_jax"].get("commands")[0]
  assert "--config.model.remat=dots" in rows["big_remat_dots"]["commands"][0]
  flag = next(flag for name, flag, _ in gpu_suite.XLA_FLAG_CASES if XLA_SAMPLE.endswith(name))
  # The case's flag reached its process, after the flags of the suite's own environment.
  assert f"XLA_FLAGS={QUICK_COMPILE} {flag} " in (out / rows[XLA_SAMPLE]["log"]).read_text(
      ).replace("'", "")


def test_a_failing_case_is_recorded_and_the_suite_goes_on(tmp_path, monkeypatch, dry_run_outdir):
  bad = gpu_suite.Case("bad", "train", 0.1, "an unknown key", [gpu_suite.Command(
      "benchmark", "experiments/base.py", {"model.no_such_key": 1})], {})
  good = gpu_suite.plan(None)[0]
  monkeypatch.setattr(gpu_suite, "plan", lambda multi30k: [bad, good])
  dry_run_outdir(tmp_path)
  for key, value in DRY_RUN_ENV.items():  # for the cases' processes (this one's JAX has started)
    monkeypatch.setenv(key, value)
  code = gpu_suite.main([str(tmp_path), "--dry_run", "--jobs", "1", "--no_estimates"])
  assert code == 1
  state = json.loads((tmp_path / "results.json").read_text())
  assert [row["status"] for row in state["cases"]] == ["failed", "ok"]
  assert "no_such_key" in state["cases"][0]["error"]
  assert state["cases"][1]["metrics"]["step_ms"] > 0 and "estimate" not in state["cases"][1]
  assert "- bad: failed" in (tmp_path / "results.md").read_text()


def test_gpu_sh_dry_run_skips_the_install_and_passes_the_data_on(tmp_path, dry_run_outdir):
  data = make_fake_multi30k(tmp_path / "multi30k")
  out, venv = dry_run_outdir(tmp_path / "out"), tmp_path / "venv"
  result = run(["bash", "benchmarks/gpu.sh", str(out), "--dry_run", "--only", "base_bf16",
                "--no_estimates"],
               env={"PYTHON": sys.executable, "VENV": str(venv), "MULTI30K": str(data),
                    **DRY_RUN_ENV})
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  assert not venv.exists()
  state = json.loads((out / "results.json").read_text())
  assert state["multi30k_dir"] == str(data)
  [row] = state["cases"]
  assert row["name"] == "base_bf16" and row["status"] == "ok" and row["metrics"]["step_ms"] > 0
  assert "| base_bf16 |" in (out / "results.md").read_text()
