"""--mode=compile: the train and decode steps compiled for a TPU slice or NVIDIA GPUs on this CPU
machine.

What cannot compile (an unknown topology, a mesh that does not divide the slice, a step that
does not fit) has its rows in test_errors.py."""

import importlib
import json
import os
import pathlib
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from launcher import Launcher

from transformer_jax import config as config_lib
from transformer_jax.core.errors import UserError
from transformer_jax.model import flops
from transformer_jax.model.flops import CHIPS, Chip
from transformer_jax.tools import compile as compile_lib

REPO = pathlib.Path(__file__).resolve().parents[1]
# A tiny model whose every split dimension divides 2: d_model 32, 4 heads, d_ff 64, vocab 32.
TINY = ["--config=experiments/tiny.py", "--mode=compile", "--config.model.num_heads=4"]


_LAUNCHER = {}


@pytest.fixture(autouse=True, scope="module")
def _launcher(tmp_path_factory):
  """The runs of `launch` are forked by one launcher (tests/launcher.py), which has imported the
  library once; each is `launch.py FLAGS` as a user runs it (no JAX_PLATFORMS)."""
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  _LAUNCHER["server"] = Launcher(env, str(tmp_path_factory.mktemp("compile_launches")))
  yield
  _LAUNCHER.pop("server").close()


def launch(*flags):
  """`launch.py FLAGS`: its returncode, stdout and stderr."""
  code, out, err = _LAUNCHER["server"].run(*flags)
  return types.SimpleNamespace(returncode=code, stdout=out, stderr=err)


def report_of(result):
  """The JSON report of a --mode=compile run that succeeded, and the text printed before it."""
  assert result.returncode == 0, result.stderr
  lines = result.stdout.strip().splitlines()
  return json.loads(lines[-1]), "\n".join(lines[:-1])


def test_estimate_takes_the_cost_model_or_else_a_roofline():
  v5e = dict(CHIPS)["TPU v5 lite"]
  assert compile_lib.estimate_seconds({"optimal_seconds": 0.25}, v5e)[0] == 0.25
  # A negative time (each op XLA cannot estimate adds -1): the roofline, here compute-bound.
  seconds, method = compile_lib.estimate_seconds(
      {"optimal_seconds": -3.0, "flops": 197e12, "bytes accessed": 0.819e12 / 2}, v5e)
  assert seconds == pytest.approx(1.0) and "compute-bound" in method
  seconds, method = compile_lib.estimate_seconds(
      {"flops": 197e12 / 4, "bytes accessed": 2 * 0.819e12}, v5e)
  assert seconds == pytest.approx(2.0) and "bandwidth-bound" in method


def test_every_chip_has_its_spec():
  for _, chip in CHIPS:
    assert isinstance(chip, Chip) and chip.peak_flops > 1e14 and chip.hbm_bytes > 1e10


def tpu_launch(*flags):
  """--mode=compile for a v5e 2x2 slice, batch 16 (skipped without libtpu)."""
  pytest.importorskip("libtpu")
  return launch(*TINY, "--config.compile.topology=v5e:2x2", "--config.compile.batch_size=16",
                *flags)


def test_compile_mode_reports_memory_flops_and_estimates_for_a_slice():
  result = tpu_launch("--config.mesh.data=1", "--config.mesh.fsdp=2", "--config.mesh.tensor=2")
  report, text = report_of(result)
  assert result.stderr == ""  # no TPU runtime warnings reach the user
  assert "not measurements" in text and "fits" in text
  assert report["chips"] == 4 and report["chip"] == "TPU v5e"
  assert report["mesh"] == {"data": 1, "fsdp": 2, "tensor": 2}
  train = report["train"]
  assert train["fits"] and 0 < train["total_bytes"] < train["hbm_bytes"]
  # 22,400 float32 parameters, split 4 ways where both fsdp and tensor divide (most of them).
  assert 22_400 * 4 / 4 <= train["params_bytes"] < 22_400 * 4 / 2
  assert train["optimizer_bytes"] >= 2 * train["params_bytes"]  # Adam's two moments
  # The compiled step does the model's matrix products, plus the small rest (norms, softmax).
  assert 0.9 < train["compiled_flops"] / train["model_flops"] < 1.6
  assert train["step_s"] > 0 and 0 < train["mfu"] < 1 and train["target_tokens_per_s"] > 0
  assert report["decode"]["fits"] and report["decode"]["tokens_per_s"] > 0


def test_compile_mode_compiles_a_decoder_only_model_with_its_prompt_cache():
  report, _ = report_of(tpu_launch("--config.model.arch=decoder_only",
                                   "--config.model.num_kv_heads=2",
                                   "--config.model.positional=relative_bias"))
  train = report["train"]
  assert train["batch"] == "16 rows x (source 12 + target 50)"  # one sequence of both
  assert 0.9 < train["compiled_flops"] / train["model_flops"] < 1.6
  assert report["decode"]["fits"] and report["decode"]["tokens_per_s"] > 0


# --- NVIDIA GPUs: XLA's GPU compiler, from the CUDA plugin of JAX (the gpu-compile extra)

def needs_cuda_compiler():
  """Skips a test where the CUDA plugin of JAX is not installed (pip install -e '.[gpu-compile]',
  part of the test extra)."""
  pytest.importorskip("jax_plugins.xla_cuda12",
                      reason="compiling for GPUs needs the gpu-compile extra (jax-cuda12-plugin)")


def test_gpu_topology_names():
  assert compile_lib.gpu_topology("h100") == ("h100", 1, 1)
  assert compile_lib.gpu_topology("h100-8") == ("h100", 1, 8)
  assert compile_lib.gpu_topology("h100-2x8") == ("h100", 2, 8)
  assert compile_lib.gpu_topology("a100-80g") == ("a100-80g", 1, 1)
  assert compile_lib.gpu_topology("a100-80g-4") == ("a100-80g", 1, 4)
  assert compile_lib.gpu_topology("h200-8") == ("h200", 1, 8)
  assert compile_lib.gpu_topology("v5e:2x4") is None and compile_lib.gpu_topology("h800") is None
  for bad in ("h100-", "h100-8x", "h100-0", "h100-2x0", "h100-eight"):
    with pytest.raises(UserError, match="unknown GPU topology"):
      compile_lib.gpu_topology(bad)


def _field(text: str, name: str) -> str:
  return re.search(rf"^\s*{name}: (\"[^\"]*\"|\S+)", text, re.M).group(1)


@pytest.mark.parametrize("part", compile_lib.gpu_parts())
def test_a_gpu_description_parses_and_agrees_with_the_chip_table(part):
  text = (compile_lib.GPU_TARGETS / f"{part}.txtpb").read_text()
  kind = _field(text, "device_description_str").strip('"')
  spec = flops.chip(types.SimpleNamespace(device_kind=kind))
  assert spec is not None, kind
  assert float(_field(text, "device_memory_size")) == spec.hbm_bytes
  assert float(_field(text, "memory_bandwidth")) == spec.hbm_bytes_per_s
  # Every SM's FP32 lanes at the clock: the datasheet's FP32 peak (19.5 TFLOP/s and up).
  fp32 = (2 * int(_field(text, "core_count")) * int(_field(text, "fpus_per_core"))
          * float(_field(text, "clock_rate_ghz")) * 1e9)
  assert 19e12 < fp32 < spec.peak_flops / 10
  needs_cuda_compiler()
  devices = compile_lib.gpu_devices(part, 1, 2)  # the installed jaxlib's schema parses it
  assert len(devices) == 2 and devices[0].device_kind == kind
  assert compile_lib.gpu_devices(part, 2, 8)[15].device_kind == kind


def test_the_cost_of_a_gpu_program_counts_its_matrix_products(monkeypatch):
  """On a matrix product of known size: the cost analysis (and its fallback, the HLO's matrix
  products) against 2 m n k FLOPs, and at least the operands and the result in bytes."""
  needs_cuda_compiler()
  devices = compile_lib.gpu_devices("h100", 1, 1)
  mesh = jax.sharding.Mesh(np.array(devices), ("d",))
  place = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  m, k, n = 512, 1024, 768
  x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16, sharding=place)
  w = jax.ShapeDtypeStruct((k, n), jnp.bfloat16, sharding=place)
  compiled = jax.jit(lambda x, w: jax.nn.relu(x @ w)).lower(x, w).compile()
  cost = compile_lib.optimized_cost(compiled)
  assert "fallback" not in cost
  assert 2 * m * n * k <= cost["flops"] < 1.01 * 2 * m * n * k
  assert cost["bytes accessed"] >= 2 * (m * k + k * n + m * n)
  products = compile_lib.matrix_products(compiled.as_text())
  assert sum(p.flops for p in products) == 2 * m * n * k
  # The same GEMM through cuBLAS (a custom call, which XLA's generic analysis cannot see into).
  compiled = jax.jit(lambda x, w: jax.nn.relu(x @ w)).lower(x, w).compile(
      compiler_options={"xla_gpu_enable_triton_gemm": False})
  assert "custom_call_target=\"__cublas" in compiled.as_text()
  cost = compile_lib.optimized_cost(compiled)
  assert 2 * m * n * k <= cost["flops"] < 1.01 * 2 * m * n * k
  assert cost["bytes accessed"] >= 2 * (m * k + k * n + m * n)
  # A later jaxlib without the private analysis: the matrix products' FLOPs, no bytes.
  from jax._src.lib import _jax
  monkeypatch.delattr(_jax, "hlo_module_cost_analysis")
  assert compile_lib.optimized_cost(compiled) == {
      "flops": 2 * m * n * k, "fallback": "FLOPs of the HLO's dots"}


def gpu_launch(*flags):
  needs_cuda_compiler()
  return launch(*TINY, "--config.compile.batch_size=16", *flags)


def test_compile_mode_reports_for_one_h100():
  result = gpu_launch("--config.compile.topology=h100")
  report, text = report_of(result)
  assert result.stderr == ""  # no CUDA driver warnings on a machine without a GPU
  # Nothing it compiled went into the persistent cache the run was given (the session's): a
  # program for a GPU this machine lacks could not be loaded by the next run, which would warn.
  # (Its decoding program, `one_position`, is compiled by --mode=compile alone.)
  assert not list(pathlib.Path(os.environ["JAX_COMPILATION_CACHE_DIR"]).glob("*one_position*"))
  assert "not autotuned" in text and "NVLink and network transfers not counted" in text
  assert "memory per GPU" in text and "fits" in text and "989 TFLOP/s" in text
  assert report["platform"] == "gpu" and report["chips"] == 1 and report["chip"] == "H100"
  train = report["train"]
  assert train["fits"] and train["params_bytes"] == 22_400 * 4
  assert 0.9 < train["compiled_flops"] / train["model_flops"] < 1.6
  assert train["bytes_accessed"] > train["params_bytes"]
  assert 0 < train["mfu"] < 1 and report["decode"]["tokens_per_s"] > 0
  # What the estimate is, and that no window measured this (tiny) model.
  assert "a roofline bound" in text and "no step of this model was measured" in text
  assert "measured_factor" not in train


def test_the_measured_models_say_how_far_their_estimate_was():
  """base and big were timed on an H100 and on an H200 (docs/benchmarks.md): their estimates
  come with the measured-to-estimate factor of the window on the same part (the H100's for a
  part no window measured), for GPU targets only."""
  for name, chip, factor in (("base", "H100", 49.1 / 24.3), ("big", "H100", 99.5 / 46.9),
                             ("base", "H200", 42.4 / 17.0), ("big", "H200", 90.7 / 33.8),
                             ("big", "A100", 99.5 / 46.9)):
    config = importlib.import_module(f"transformer_jax.experiments.{name}").get_config()
    model_config = config_lib.validate(config)
    assert compile_lib.measured_for(model_config, chip).factor == pytest.approx(factor)
    train = {"estimate": "roofline, HBM bandwidth-bound", "step_s": 0.025, "mfu": 0.4}
    line = compile_lib.honest_line(train, model_config, "GPU", chip)
    assert f"({factor:.2f}x)" in line and f"about {25 * factor:.0f} ms" in line
    assert f"MFU {0.4 / factor:.0%}" in line and ("H100" if chip == "A100" else chip) in line
    assert "no step of this model" in compile_lib.honest_line(train, model_config, "chip")


def test_compile_mode_splits_a_step_over_eight_h100s():
  report, _ = report_of(gpu_launch("--config.compile.topology=h100-8", "--config.mesh.data=2",
                                   "--config.mesh.fsdp=2", "--config.mesh.tensor=2"))
  assert report["chips"] == 8 and report["mesh"] == {"data": 2, "fsdp": 2, "tensor": 2}
  train = report["train"]
  assert 22_400 * 4 / 4 <= train["params_bytes"] < 22_400 * 4 / 2
  assert 0.9 < train["compiled_flops"] / train["model_flops"] < 1.6


@pytest.mark.parametrize("flags,expected", [
    (["--config.compile.topology=h100-8x"], "unknown GPU topology 'h100-8x'"),
    (["--config.compile.topology=h100-8", "--config.mesh.fsdp=3"],
     "do not split into groups of 3"),
    (["--config.compile.topology=h100", "--config.model.d_ff=100000000"],
     "does not fit H100 HBM"),
], ids=["bad name", "bad mesh", "does not fit"])
def test_compile_mode_refuses_in_one_line(flags, expected):
  result = gpu_launch(*flags)
  assert result.returncode == 2, result.stderr
  assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
  assert expected in result.stderr


def test_a_step_over_the_gpu_memory_is_refused_with_what_takes_it():
  """Parameters and optimizer state over the part's HBM are refused before anything compiles
  (the `does not fit` run above); a step that fits only without its temporaries compiles (the
  GPU compiler leaves memory to the runtime) and is refused after, with each part's share."""
  h100 = dict(CHIPS)["H100"]
  mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:1]).reshape(1, 1, 1),
                           ("data", "fsdp", "tensor"))
  gib = 1 << 30
  assert compile_lib.state_fit_error(h100, mesh, 20 * gib, 40 * gib, "GPU") is None
  before = str(compile_lib.state_fit_error(h100, mesh, 30 * gib, 60 * gib, "GPU"))
  assert before.startswith("the train step does not fit H100 HBM on mesh data 1 x fsdp 1 x "
                           "tensor 1: its parameters (30.00 GiB) and optimizer state (60.00 GiB)"
                           " alone take 90.00 GiB per GPU, 15.49 GiB over its 74.51 GiB"), before
  assert "--config.mesh.fsdp" in before and "\n" not in before
  train = {"total_bytes": 90 * gib, "params_bytes": 20 * gib, "optimizer_bytes": 40 * gib,
           "temp_bytes": 30 * gib}
  after = str(compile_lib.gpu_fit_error("the train step", h100, mesh, train))
  assert after.startswith("the train step does not fit H100 HBM on mesh data 1 x fsdp 1 x "
                          "tensor 1: it needs 90.00 GiB per GPU (parameters 20.00 GiB + "
                          "optimizer 40.00 GiB + temporaries 30.00 GiB), 15.49 GiB over"), after
  assert "--config.model.remat=full" in after and "\n" not in after


def test_the_estimate_table_says_what_its_figures_are_and_the_measured_factor():
  """benchmarks/compile_table.py's rows: every figure named an estimate (a roofline bound on a
  GPU, XLA's cost model on a TPU), and beside a model a GPU window measured, its
  measured-to-estimate factor with the window it comes from (compile_lib.MEASURED)."""
  from benchmarks import compile_table
  train = {"total_bytes": 3 << 30, "params_bytes": 1 << 30, "optimizer_bytes": 1 << 30,
           "temp_bytes": 1 << 30, "fits": True, "compiled_flops": 2e12, "model_flops": 1.9e12,
           "step_s": 0.05, "mfu": 0.4, "target_tokens_per_s": 6e5,
           "estimate": "roofline, HBM bandwidth-bound"}
  big = compile_lib.MEASURED[1]
  rows = [{"model": "big", "topology": "h100", "mesh_name": "data", "tokens_per_chip": 32768,
           "mesh": {"data": 1, "fsdp": 1, "tensor": 1},
           "report": {"train": dict(train, measured_factor=big.factor)}},
          {"model": "xl", "topology": "h100", "mesh_name": "data", "tokens_per_chip": 8192,
           "mesh": {"data": 1, "fsdp": 1, "tensor": 1}, "report": {"train": train}},
          {"model": "base", "topology": "v5e:2x4", "mesh_name": "data", "tokens_per_chip": 2048,
           "mesh": {"data": 8, "fsdp": 1, "tensor": 1},
           "report": {"train": dict(train, estimate="XLA cost model")}}]
  text = compile_table.table(rows)
  head, _, big_line, xl_line, tpu_line = text.splitlines()[:5]
  assert "step (estimate)" in head and "MFU (estimate)" in head
  assert head.endswith("| measured / estimate |")
  assert "50.0 ms (roofline bound)" in big_line and big_line.endswith(f"| {big.factor:.2f}x |")
  assert big.factor == pytest.approx(99.5 / 46.9)
  assert xl_line.endswith("| - |") and "(cost model)" in tpu_line and tpu_line.endswith("| - |")
  assert "the compiler's estimate for a program it has not run, not a measurement" in text
  assert f"big {big.factor:.2f}x (99.5 ms against 46.9 ms at 25,600 tokens/side; {big.source})" \
      in text
  assert "measured / estimate:" not in compile_table.table(rows[1:])
