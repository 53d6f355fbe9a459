"""train.profile_steps: a jax.profiler trace of chosen train steps, and the table of its top
compiled operations (tools/profile.py)."""

import json
import subprocess
import sys
import types

import pytest

from transformer_jax import config as config_lib
from transformer_jax.core.errors import UserError
from transformer_jax.eval import evaluate as evaluate_lib
from transformer_jax.experiments import tiny
from transformer_jax.tools import profile
from transformer_jax.train import loop


def test_a_three_step_run_traces_its_steps_and_the_parser_finds_the_train_steps_ops(
    tmp_path, capsys):
  config = tiny.get_config()
  config.data.update(batching="fixed", batch_size=8)
  config.train.update(steps=3, log_every=1, profile_start=1, profile_steps=2)
  config.model.update(dropout_rate=0.1, attention_dropout_rate=0.1)  # dropout kernels too
  config.eval.update(max_examples=2, max_decode_len=4)
  workdir = tmp_path / "run"
  loop.train(config, str(workdir), evaluate_fn=evaluate_lib.evaluate)
  assert "profile of steps 2-3: " in capsys.readouterr().out
  traces = list((workdir / "tensorboard" / "plugins" / "profile").glob("*/*.xplane.pb"))
  assert len(traces) == 1  # where TensorBoard's profile plugin looks
  assert list(traces[0].parent.glob("*.trace.json.gz"))  # for Perfetto
  assert profile.find_trace(str(workdir)) == str(traces[0])
  rows = profile.op_times(str(traces[0]), module="train_step")
  assert rows and all("train_step" in r.module for r in rows)
  # Steps 2 and 3 ran the one compiled train step twice: each of its operations ran a multiple
  # of two times, and the parser's total is the sum of its rows.
  assert all(r.calls % 2 == 0 and r.seconds > 0 for r in rows), rows[:5]
  assert [r.seconds for r in rows] == sorted((r.seconds for r in rows), reverse=True)
  table = profile.table(rows, top=5)
  assert table.count("| `") == 5 and f"{len(rows)} operations" in table
  # Beside the trace, the traced program's HLO, by whose op names every kernel of the trace
  # falls in a category; the categories and the idle gaps make up the whole.
  hlo = (traces[0].parent / profile.PROGRAM_FILE).read_text()
  found = profile.kernels(hlo)
  kernels = [r for r in rows if not r.op.startswith(profile.CONTROL_FLOW)]
  assert all(r.op in found for r in kernels)
  kinds = {profile.category(found[r.op]) for r in kernels}
  assert kinds >= {"attention products", "matrix products", "optimizer update", "loss",
                   "dropout", "softmax", "layer norm"}, kinds
  idle = profile.idle_seconds(str(traces[0]), "train_step")
  assert idle > 0
  shares = profile.category_table(rows, hlo, idle)
  percents = [float(line.rsplit("|", 2)[-2].strip().rstrip("%"))
              for line in shares.splitlines()[2:] if line.startswith("| ")]
  assert abs(sum(percents) - 100) < 0.1 * len(percents) and "| idle" in shares
  assert "not in the program's HLO" not in shares
  # The profile as numbers: two steps traced; a step's device time is its kernels' time plus
  # the gaps, shared out by category (summing to 1) and, kernel by kernel, in the top table.
  found = profile.summary(rows, hlo, idle, top=5)
  kernel_s = sum(r.seconds for r in kernels)
  assert found["steps"] == profile.steps_traced(rows) == 2
  assert found["step_device_ms"] == pytest.approx((kernel_s + idle) * 1e3 / 2)
  assert sum(found["categories"].values()) == pytest.approx(1.0)
  assert found["idle_share"] == pytest.approx(found["categories"][profile.IDLE])
  assert [k["op"] for k in found["top"]] == [r.op for r in kernels[:5]]
  for k in found["top"]:
    assert k["category"] == profile.category(profile.kernels(hlo)[k["op"]])
    assert k["share"] <= found["categories"][k["category"]] + 1e-9
    assert k["ms_per_step"] == pytest.approx(k["share"] * found["step_device_ms"])
  # The script prints the same tables, and with --json the same numbers.
  command = [sys.executable, "-m", "transformer_jax.tools.profile"]
  out = subprocess.run(command + [str(workdir), "--top=3", "--json"], cwd=tmp_path,
                       capture_output=True, text=True, check=True).stdout
  assert out.count("| `") == 3 and "| dropout |" in out and "share of the step" in out
  printed = json.loads(out.strip().splitlines()[-1])
  assert printed["steps"] == 2 and printed["categories"].keys() == found["categories"].keys()
  assert [k["op"] for k in printed["top"]] == [r.op for r in kernels[:3]]
  missing = subprocess.run(command + [str(tmp_path / "x")], cwd=tmp_path,
                           capture_output=True, text=True)
  assert missing.returncode == 2 and missing.stderr.startswith("error: no profiler trace")


@pytest.mark.parametrize("start, steps, message", [
    (1, -1, "train.profile_steps must be >= 0"),
    (18, 3, "train.profile_start + train.profile_steps (18 + 3) exceeds train.steps (20)"),
])
def test_a_profile_window_outside_training_is_refused(start, steps, message):
  config = tiny.get_config()
  config.train.update(profile_start=start, profile_steps=steps)
  with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")
                     .replace("+", r"\+")):
    config_lib.validate(config)


@pytest.mark.parametrize("line, expected", [
    ('%custom-call.3 = (bf16[8,64]{1,0}, s8[0]{0}) custom-call(%a, %b), custom_call_target='
     '"__cublas$gemm", metadata={op_name="jit(train_step)/jvp(Transformer)/decoder/layer_0/ffn/'
     'wi/dot_general"}', "matrix products"),
    ('%custom-call.9 = bf16[8,64,4,16]{3,2,1,0} custom-call(%q, %k, %v), custom_call_target='
     '"__cudnn$fmhaSoftmax", metadata={op_name="jit(train_step)/jvp(Transformer)/encoder/'
     'layer_0/attention_block/self_attention/dot_product_attention"}', "attention products"),
    ('%loop_select_fusion.2 = f32[64]{0} fusion(%p), kind=kLoop, calls=%fused_computation.2, '
     'metadata={op_name="jit(train_step)/optimizer/mul"}', "optimizer update"),
    ('%copy.7 = f32[64,8]{0,1} copy(%p), metadata={op_name="jit(train_step)/transpose"}',
     "copies and layout"),
])
def test_gpu_kernels_fall_in_their_categories(line, expected):
  """The GPU's kernels as XLA's GPU compiler names them (cuBLAS and cuDNN calls)."""
  text = f"ENTRY %main {{\n  {line}\n}}\n"
  name = line.split(" = ")[0].lstrip("%")
  assert profile.category(profile.kernels(text)[name]) == expected


def test_the_benchmark_profiles_two_more_steps_by_category(tmp_path):
  """benchmark.profile: the timed step's program traced for two more steps; the result holds
  each category's share, which with the idle gaps add up to the whole."""
  from transformer_jax.tools import benchmark
  config = tiny.get_config()
  config.model.update(dropout_rate=0.1)
  config.benchmark.update(batch_size=8, steps=2, warmup=1, decode_steps=0,
                          profile=str(tmp_path / "trace"))
  result = benchmark.run_benchmark(config)
  shares, top = result["profile"], result["profile_top"]
  assert abs(sum(shares.values()) - 1.0) < 1e-9
  assert top["steps"] == 2 and top["idle_share"] == pytest.approx(shares[profile.IDLE])
  assert len(top["top"]) == 12 and all(k["category"] in shares for k in top["top"])
  assert shares["matrix products"] > 0 and shares["dropout"] > 0
  assert list(shares)[-1] == profile.IDLE
  trace = profile.find_trace(str(tmp_path / "trace"))
  assert list((tmp_path / "trace").glob(f"**/{profile.PROGRAM_FILE}"))
  assert profile.op_times(trace, "train_step")


def _event(op, start, end, module="jit_train_step", name=None):
  return types.SimpleNamespace(stats=[("hlo_op", op), ("hlo_module", module)], start_ns=start,
                               end_ns=end, duration_ns=end - start, name=name or op)


def _plane(name, **lines):
  return types.SimpleNamespace(name=name, lines=[types.SimpleNamespace(name=n.replace("_", " "),
                                                                       events=e)
                                                 for n, e in lines.items()])


def test_each_kernel_counts_once_on_a_gpu_a_tpu_and_a_cpu():
  """A GPU's trace names each operation three times: the host's launch annotation, the kernel on
  its stream, and the profiler's derived "XLA Ops" line; only the streams' kernels count (and
  only their gaps are idle). A TPU's plane has the derived line alone; a CPU's host runs them."""
  kernels = [_event("fusion.1", 0, 10), _event("dot.2", 15, 20), _event("fusion.1", 30, 40)]
  derived = [_event("fusion.1", 0, 10), _event("dot.2", 15, 20), _event("fusion.1", 30, 40)]
  host = _plane("/host:CPU", python=[_event("fusion.1", 0, 2), _event("dot.2", 3, 4)])
  gpu = types.SimpleNamespace(planes=[host, _plane(
      "/device:GPU:0", Stream_7=kernels, XLA_Ops=derived,
      XLA_Modules=[types.SimpleNamespace(stats=[("hlo_module", "jit_train_step")], start_ns=0,
                                         end_ns=40, duration_ns=40)])])
  rows = profile.op_times("", "train_step", data=gpu)
  assert [(r.op, r.calls, r.seconds * 1e9) for r in rows] == [("fusion.1", 2, 20), ("dot.2", 1, 5)]
  assert profile.idle_seconds("", "train_step", data=gpu) * 1e9 == pytest.approx(15)
  tpu = types.SimpleNamespace(planes=[host, _plane("/device:TPU:0", XLA_Ops=derived)])
  assert profile.op_times("", "train_step", data=tpu) == rows
  cpu = types.SimpleNamespace(planes=[_plane("/host:CPU", a=kernels[:2], b=kernels[2:])])
  assert profile.op_times("", None, data=cpu) == rows
  other = types.SimpleNamespace(planes=[_plane("/host:CPU", a=[_event("x.1", 0, 5, "jit_eval")])])
  assert profile.op_times("", "train_step", data=other) == []


def test_kernels_inside_a_cuda_graph_count_by_their_own_names():
  """XLA runs a GPU program as CUDA graphs (command buffers): the H200's trace of 2026-11-29
  (JAX 0.11.2) marks every kernel of the train step with the graph's thunk, hlo_op
  "command_buffer_1". Each kernel then counts by its own name: a fusion's is the instruction's
  with "." as "_", found in the HLO by it; cuBLAS's (nvjet_*) and cuDNN's fall in their
  categories by name."""
  hlo = "\n".join([
      "ENTRY %main {",
      '  %loop_compare_select_fusion.3 = f32[8]{0} fusion(%p), kind=kLoop, calls=%c, '
      'metadata={op_name="jit(train_step)/jvp(Transformer)/decoder/dropout/ge"}',
      '  %input_reduce_fusion.26 = f32[8]{0} fusion(%p), kind=kInput, calls=%d, '
      'metadata={op_name="jit(train_step)/jvp(loss)/reduce_max"}',
      '  %gemm_fusion_dot.419 = bf16[8,64]{1,0} fusion(%a, %b), kind=kCustom, calls=%e, '
      'metadata={op_name="jit(train_step)/jvp(Transformer)/encoder/ffn/wi/dot_general"}',
      "}", ""])
  graph = "command_buffer_1"
  cublas = "nvjet_sm90_tst_128x160_64x5_2x1_v_bz_NNT"
  cudnn = "cudnn_generated_fort_native_sdpa_sm90_knob_7_64x128x128_4x1x1_kernel0_0"
  step = [("loop_compare_select_fusion_3", 0, 10), (cublas, 12, 40),
          ("gemm_fusion_dot_419", 40, 60), (cudnn, 60, 70), ("input_reduce_fusion_26", 75, 80)]
  events = [_event(graph, start + offset, end + offset, name=name)
            for offset in (0, 100) for name, start, end in step]
  gpu = types.SimpleNamespace(planes=[_plane("/device:GPU:0", Stream_14=events)])
  rows = profile.op_times("", "train_step", data=gpu)
  assert {r.op: (r.calls, r.seconds * 1e9) for r in rows} == {
      name: (2, 2 * (end - start)) for name, start, end in step}
  assert profile.steps_traced(rows) == 2
  found, unknown = profile.categorized(rows, hlo)
  assert unknown == 0
  assert {row.op: name for row, name in found} == {
      "loop_compare_select_fusion_3": "dropout",
      cublas: "matrix products",
      "gemm_fusion_dot_419": "matrix products",
      cudnn: "attention products",
      "input_reduce_fusion_26": "loss"}
  # Gaps: 2 + 5 inside each step, 20 between the two steps' kernels.
  assert profile.idle_seconds("", "train_step", data=gpu) * 1e9 == pytest.approx(2 * 7 + 20)
  # Outside a graph the hlo_op names the kernel's operation, whatever the kernel is called.
  assert profile.kernel_op("fusion.1", "loop_add_fusion_1") == "fusion.1"
  assert profile.kernel_op(graph, "gemm_fusion_dot_419") == "gemm_fusion_dot_419"
  assert profile.library_category("loop_add_fusion") is None


def test_a_profile_that_fails_leaves_the_benchmarks_timing(tmp_path, monkeypatch):
  """A machine whose profiler cannot trace (no CUPTI on a GPU, say) still gets its step timed:
  the result says why there is no profile."""
  import jax

  from transformer_jax.tools import benchmark

  def no_profiler(directory):
    raise RuntimeError("the profiler's library is not installed")

  monkeypatch.setattr(jax.profiler, "start_trace", no_profiler)
  config = tiny.get_config()
  config.benchmark.update(batch_size=8, steps=2, warmup=1, decode_steps=0,
                          profile=str(tmp_path / "trace"))
  result = benchmark.run_benchmark(config)
  assert result["step_ms"] > 0 and "profile" not in result
  assert result["profile_error"] == "RuntimeError: the profiler's library is not installed"
