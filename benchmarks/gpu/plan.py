"""The GPU suite's cases, most important first, and the cost model of one window.

Each case runs the project's own command line (`launch.py --mode=benchmark|train|evaluate`) as
a subprocess, so that what is measured is what a user runs, one case cannot leave the next one
a half-used GPU, and a crash or a hang (killed at the case's timeout) costs that case alone.

GPU time comes in windows of 15 minutes (the machine's start and the install included), and a
case of the first window (2026-11-28, one H100) cost 2.5-3 minutes, over two of them XLA's
compile and GPU autotuning: four cases a window. The full cross product of model x attention x
remat x batch x XLA flag cannot fit, so the plan varies one factor at a time around a default
(bf16, plain attention, no remat, 25,600 tokens a side: the paper's batch), and a window runs in
waves (issue 53):

1. the default step of both models, compiled at once, then timed alone and profiled (two more
   steps traced: `benchmark.profile`), so that the profile is the first thing a window answers;
2. the levers (one change of a default each), compiled at once into the shared compilation
   cache, then each timed alone from it: a lever of the default's shapes finds most of its GEMMs
   autotuned already (XLA's per-fusion autotune cache, kept beside JAX's: core/compilation.py);
3. each model's winning levers together, chosen from wave 2's measurements.

Everything after those (PyTorch side by side, Multi30k, batch sweep, decoding) runs one case
at a time, compile included, while the budget lasts.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

PEAK_TFLOPS = 989.0  # H100/H200 SXM dense bf16 (the figure tools/benchmark.py's PEAK_FLOPS uses)
PUBLISHED_BLEU = 41.02  # Multi30k test_2016_flickr, lowercased tokenized BLEU (Wu et al., 2021)
SEQ_LEN = 64  # tokens per row on each side in the train-step cases
ROWS = {"8k": 128, "16k": 256, "25k": 400, "32k": 512, "64k": 1024, "128k": 2048}
DEFAULT_TOKENS = "25k"
# train.loss_chunk_tokens of the chunked-loss lever: a quarter of the default batch (400 rows x
# 16 positions: four chunks of 0.95 GB of float32 logits instead of one of 3.8 GB).
LOSS_CHUNK_TOKENS = 6400

# XLA GPU flags tried one at a time on the big train step (wave 2 holds the first; the others
# run after the window). Each name was checked against the flag parser of jaxlib 0.10.2 (an
# unknown flag aborts the process; tests/test_gpu_suite.py parses all of them in one process).
XLA_FLAG_CASES = (
    ("graphs_all", "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN "
     "--xla_gpu_graph_min_graph_size=1",
     "CUDA graphs around every kind of kernel, cuBLAS and cuDNN calls included, however short "
     "the run of kernels (launch gaps are the profile's idle time)"),
    ("lhs", "--xla_gpu_enable_latency_hiding_scheduler=true",
     "overlap independent kernels (mostly meant for collectives; one GPU may gain nothing)"),
    ("no_triton_gemm", "--xla_gpu_enable_triton_gemm=false",
     "every matrix product through cuBLAS instead of Triton-generated GEMM fusions"),
    ("no_command_buffer", "--xla_gpu_enable_command_buffer=",
     "no CUDA graphs: shows what graph capture saves in launch overhead"),
    # The H200's profile (2026-11-29): the FFN's bias add, ReLU and ReLU gradient run as three
    # passes over the [tokens, d_ff] activation after cuBLAS's GEMM, 4.8 ms of big's 88.7.
    ("cublaslt", "--xla_gpu_enable_cublaslt=true",
     "GEMMs through cuBLASLt, whose epilogues take a bias add and a ReLU into the GEMM"),
)

# The flags that the H200's profile points at (docs/benchmarks.md, "The second GPU window"):
# the FFN's bias and ReLU into cuBLASLt's GEMM epilogue, and every GEMM through cuBLAS (Triton's
# GEMM fusions took 15.7 ms of big's 88.7). Levers of wave 2, with the others.
PROFILED_FLAGS = ("cublaslt", "no_triton_gemm")

# Waves (module docstring): a case's wave says when it is compiled and timed in a window.
DEFAULTS, LEVERS, COMBINED, ALONE = 1, 2, 3, 0


@dataclasses.dataclass
class Command:
  """One launch.py run: its mode, flags and extra environment."""
  mode: str  # benchmark | train | evaluate | compile
  config: str  # experiments/X.py
  overrides: dict  # config key -> value, as --config.KEY=VALUE ({outdir} replaced by OUTDIR)
  env: dict = dataclasses.field(default_factory=dict)
  timeout_min: float = 6.0
  workdir: Optional[str] = None  # relative to OUTDIR

  def argv(self, python: str, outdir) -> list:
    flags = [f"--config={self.config}", f"--mode={self.mode}"]
    if self.workdir:
      flags.append(f"--workdir={outdir}/{self.workdir}")
    flags += [f"--config.{key}={str(value).replace('{outdir}', str(outdir))}"
              for key, value in self.overrides.items()]
    return [python, "launch.py", *flags]


@dataclasses.dataclass
class Case:
  name: str
  table: str  # train | torch | decode | multi30k: where results.md shows it
  minutes: float  # guessed cost on one GPU when run alone, start-up and compile included
  why: str
  commands: list
  describe: dict = dataclasses.field(default_factory=dict)  # shown in the tables
  wave: int = ALONE  # DEFAULTS, LEVERS, COMBINED: compiled with its wave, then timed alone
  # Guessed minutes of its compile in a wave: a new shape's compile and autotuning, or less
  # where the default of its model (wave 1) autotuned its GEMMs already.
  compile_min: float = 0.0
  combine: Optional[str] = None  # the model whose measured levers this case combines

  @property
  def lever(self) -> bool:
    return self.wave == LEVERS


# ----------------------------------------------------------------------------- the cases


def bench_overrides(model: str, tokens: str = DEFAULT_TOKENS, **overrides) -> dict:
  """Overrides of a bf16 train-step benchmark of `model` at `tokens` per side, decoding off."""
  values = {"model.dtype": "bfloat16", "benchmark.batch_size": ROWS[tokens],
            "benchmark.source_len": SEQ_LEN, "benchmark.target_len": SEQ_LEN,
            "benchmark.warmup": 3, "benchmark.steps": 20, "benchmark.decode_steps": 0}
  values.update(overrides)
  return values


def describe(model, tokens, xla_flags, overrides) -> dict:
  return {"model": model, "tokens": tokens, "xla_flags": xla_flags or "-",
          "attention": overrides.get("model.attention_impl", "plain"),
          "remat": overrides.get("model.remat", "none"),
          "dropout bits": overrides.get("model.dropout_rng", "threefry"),
          "loss chunk": overrides.get("train.loss_chunk_tokens", 0) or "-"}


def train_case(name, model, minutes, why, tokens=DEFAULT_TOKENS, xla_flags="", wave=ALONE,
               compile_min=0.0, **overrides) -> Case:
  env = {"XLA_FLAGS": xla_flags} if xla_flags else {}
  return Case(name, "train", minutes, why,
              [Command("benchmark", f"experiments/{model}.py",
                       bench_overrides(model, tokens, **overrides), env=env, timeout_min=6)],
              describe(model, tokens, xla_flags, overrides), wave=wave, compile_min=compile_min)


def default_case(model: str) -> Case:
  """The default step of `model`, with two more steps traced into OUTDIR/profiles/MODEL: the
  profile costs no compile of its own."""
  return train_case(f"{model}_bf16", model, 2.7, f"the default: Transformer {model}, bf16, "
                    "25k tokens/side, profiled", wave=DEFAULTS, compile_min=DEFAULTS_COMPILE_MIN,
                    **{"benchmark.profile": f"{{outdir}}/profiles/{model}"})


def lever(name, model, why, tokens=DEFAULT_TOKENS, xla_flags="", **overrides) -> Case:
  """One change of `model`'s default step, timed against it in the same window. Of the
  default's shapes, it finds most of its GEMMs autotuned by wave 1; another batch autotunes
  its own."""
  same_shapes = tokens == DEFAULT_TOKENS
  return train_case(name, model, 2.0 if same_shapes else 2.7, why, tokens, xla_flags,
                    wave=LEVERS, compile_min=CACHED_GEMMS_COMPILE_MIN if same_shapes
                    else NEW_SHAPE_COMPILE_MIN, **overrides)


def combined_case(model: str) -> Case:
  """The levers of `model` that beat its default in this window, together (built at run time
  by `combine`); skipped where none did."""
  return Case(f"{model}_best", "train", 2.5, f"{model}: every lever that beat the default, "
              "together (chosen from this window's measurements)", [], {}, wave=COMBINED,
              compile_min=CACHED_GEMMS_COMPILE_MIN, combine=model)


def tokens_per_s(row: dict) -> Optional[float]:
  return (row.get("metrics") or {}).get("target_tokens_per_s") if row.get("status") == "ok" \
      else None


def combine(case: Case, cases: list, rows: dict) -> Optional[Case]:
  """`case` (a combined_case) with the command of its model's winning levers: those whose
  target tokens/s beat the default's, merged best first (a key a better lever set is kept;
  the XLA flags of all of them joined); None when no lever beat the default."""
  model = case.combine
  default = tokens_per_s(rows.get(f"{model}_bf16", {}))
  levers = [(c, tokens_per_s(rows.get(c.name, {}))) for c in cases
            if c.lever and c.describe.get("model") == model]
  winners = sorted([(speed, c) for c, speed in levers if default and speed and speed > default],
                   key=lambda pair: -pair[0])
  if not winners:
    return None
  overrides, flags, defaults = {}, [], bench_overrides(model)
  for _, won in winners:
    command = won.commands[0]
    for key, value in command.overrides.items():
      if key not in overrides or overrides[key] == defaults.get(key):
        overrides[key] = value
    if command.env.get("XLA_FLAGS"):
      flags.append(command.env["XLA_FLAGS"])
  overrides.pop("benchmark.profile", None)
  env = {"XLA_FLAGS": " ".join(flags)} if flags else {}
  tokens = next((t for t, rows_ in ROWS.items()
                 if rows_ == overrides.get("benchmark.batch_size")), DEFAULT_TOKENS)
  return dataclasses.replace(
      case, commands=[Command("benchmark", f"experiments/{model}.py", overrides, env=env,
                              timeout_min=6)],
      describe=describe(model, tokens, " ".join(flags), overrides),
      compile_min=max(c.compile_min for _, c in winners),
      why=f"{case.why}: {', '.join(c.name for _, c in winners)}")


def torch_case(name, model, minutes, why, tokens=DEFAULT_TOKENS) -> Case:
  overrides = {"benchmark.torch": True, "benchmark.torch_autocast": True,
               "benchmark.torch_compile": "inductor"}
  # Both frameworks hold their memory in one process: JAX must not take 75% of the GPU up front.
  env = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
  return Case(name, "torch", minutes, why,
              [Command("benchmark", f"experiments/{model}.py",
                       bench_overrides(model, tokens, **overrides), env=env, timeout_min=10)],
              {"model": model, "tokens": tokens})


def decode_case(name, model, minutes, decode_batch) -> Case:
  # The benchmark always times a train step first: a small one (8 rows) keeps its cost down.
  overrides = bench_overrides(model, **{
      "benchmark.batch_size": 8, "benchmark.warmup": 1, "benchmark.steps": 2,
      "benchmark.decode_batch": decode_batch, "benchmark.decode_steps": 3})
  return Case(name, "decode", minutes,
              f"greedy and beam-4 output tokens/s, {decode_batch} sentences of {SEQ_LEN} tokens",
              [Command("benchmark", f"experiments/{model}.py", overrides, timeout_min=6)],
              {"model": model, "decode_batch": decode_batch})


def multi30k_case(data_dir: str) -> Case:
  data = {"data.path": data_dir}
  return Case(
      "multi30k", "multi30k", 8.0,
      "the published recipe end to end: 8k updates, then the test set with the mean of the last "
      "10 checkpoints and beam 5 (train keeps 10 checkpoints in this recipe)",
      [Command("train", "experiments/multi30k_ende.py", dict(data), timeout_min=15,
               workdir="runs/multi30k"),
       Command("evaluate", "experiments/multi30k_ende.py",
               {**data, "data.eval_split": "test_2016_flickr", "eval.average_last": 10},
               timeout_min=5, workdir="runs/multi30k")])


# cuDNN's fused attention takes no attention-weight dropout, and the paper's models have none
# (model.attention_dropout_rate=0 in experiments/base.py and big.py): the same model.
CUDNN = {"model.attention_impl": "cudnn"}


def plan(multi30k_dir: Optional[str]) -> list:
  """Every case, most important first: the profiled default step of both models, the levers of
  issue 53 against them (big's first: its goal is the higher), each model's winning levers
  together, then the rest (PyTorch, Multi30k, the batch sweep, decoding, more XLA flags)."""
  graphs = XLA_FLAG_CASES[0]
  cases = [
      default_case("base"),
      default_case("big"),
      lever("big_rbg", "big", "dropout bits from XLA's RngBitGenerator (Philox), not threefry",
            **{"model.dropout_rng": "rbg"}),
      lever("big_cudnn", "big", "cuDNN's fused attention: no [batch, heads, q, k] weights in "
            "HBM", **CUDNN),
      lever("big_loss_chunk", "big", f"the output layer and the loss in chunks of "
            f"{LOSS_CHUNK_TOKENS} tokens: no float32 [tokens, vocab] logits in HBM",
            **{"train.loss_chunk_tokens": LOSS_CHUNK_TOKENS}),
      lever("big_b64k", "big", "2.56x the default's tokens per step", tokens="64k"),
      lever("big_b128k", "big", "5.12x the default's tokens: the largest batch of 64-token rows "
            "that an H200 holds without remat (compiled for h200: 81.1 of 141 GB)",
            tokens="128k"),
      lever(f"big_xla_{graphs[0]}", "big", graphs[2], xla_flags=graphs[1]),
      lever("base_rbg", "base", "dropout bits from XLA's RngBitGenerator, not threefry",
            **{"model.dropout_rng": "rbg"}),
      lever("base_cudnn", "base", "cuDNN's fused attention", **CUDNN),
      *[lever(f"big_xla_{short}", "big", why, xla_flags=flag)
        for short, flag, why in XLA_FLAG_CASES if short in PROFILED_FLAGS],
      combined_case("big"),
      combined_case("base"),
      # after the window's waves: one at a time, compile included
      lever("base_loss_chunk", "base", f"the loss in chunks of {LOSS_CHUNK_TOKENS} tokens",
            **{"train.loss_chunk_tokens": LOSS_CHUNK_TOKENS}),
      lever("base_b64k", "base", "2.56x the default's tokens per step", tokens="64k"),
      lever("big_b64k_block_out", "big", "64k tokens, only the attention and FFN outputs kept "
            "(remat block_out)", tokens="64k", **{"model.remat": "block_out"}),
      torch_case("base_torch", "base", 3.0,
                 "torch.nn.Transformer, bf16 autocast + torch.compile, timed in the same process"),
      # At 16k: both frameworks' activations of the big model share the one GPU in this case.
      torch_case("big_torch", "big", 3.5, "the same for big, at 16k tokens/side so both fit",
                 tokens="16k"),
  ]
  if multi30k_dir:
    cases.append(multi30k_case(multi30k_dir))
  cases += [
      lever("big_remat_dots", "big", "recompute all but the weight products' outputs",
            **{"model.remat": "dots"}),
      lever("big_b32k", "big", "a batch sweep point", tokens="32k"),
      train_case("base_b8k", "base", 2.5, "batch sweep", tokens="8k"),
      train_case("base_b16k", "base", 2.5, "batch sweep", tokens="16k"),
      train_case("base_b32k", "base", 2.7, "batch sweep", tokens="32k"),
      decode_case("base_decode64", "base", 2.5, 64),
      decode_case("base_decode256", "base", 2.7, 256),
      decode_case("big_decode256", "big", 3.0, 256),
  ]
  cases += [lever(f"big_xla_{short}", "big", why, xla_flags=flag)
            for short, flag, why in XLA_FLAG_CASES[1:] if short not in PROFILED_FLAGS]
  return cases


# ----------------------------------------------------------------------------- the cost model

# Minutes, measured by the second window (one H200, JAX 0.11.2, 2026-11-29:
# benchmarks/results/2026-11-29-h200/results.json, its "phases" and each case's precompile_s
# and wall_s) where it measured them, by the first (one H100, 2026-11-28) or guessed otherwise;
# results.json keeps each phase's guessed and measured minutes side by side.
# - The machine's start until the suite runs: 37 s of start and transfers, then 25 s of gpu.sh's
#   set-up (the venv layered over the machine's python, the wheels of .whl/). A device command
#   runs for 10 minutes at most, so a window is two calls (the suite started in its own session,
#   then collected: docs/benchmarks.md); the second call and giving the machine back take the
#   rest of these minutes.
STARTUP_MIN = 2.0
WINDOW_MIN = 15.0
# - The defaults' compile, base and big at once: 195 and 192 s (the first window's H100: 133
#   and 126 s, each alone). The same programs compile for an H100 on the 2-vCPU dev CPU in 21
#   and 33 s with no autotuning: most of it is XLA's GPU autotuning, and the two processes
#   autotune on the one GPU at the same time.
DEFAULTS_COMPILE_MIN = 3.3
# - A lever's compile at a batch of its own (new GEMM shapes to autotune): 143 s (64k) and 128
#   s (128k), eight compiles at once.
NEW_SHAPE_COMPILE_MIN = 2.4
# - A lever's compile where its model's default (wave 1) autotuned the same GEMM fusions into
#   the per-fusion autotune cache: 63-87 s (rbg, cuDNN, loss chunk; 119 s for CUDA graphs
#   around every kernel), eight at once; the combination, 61 s alone.
CACHED_GEMMS_COMPILE_MIN = 1.2
# - Compiles at once share the host's 16 cores; XLA's parallel code generation keeps about 3 of
#   them busy per process (a guess: the eight levers took 2.4 minutes at once, their longest).
CORES_PER_COMPILE = 3
HOST_CORES = 16
# - A case that loads its program from the cache: 16-24 s each (the process, set-up, the load,
#   3 warm-up and 20 timed steps).
TIMED_MIN = 0.35
# - A profiled default: two more steps traced and the trace read on the host, about 5 s.
PROFILE_MIN = 0.1


def wave_compile_min(cases: list) -> float:
  """Guessed minutes to compile `cases` at once on the host's cores."""
  if not cases:
    return 0.0
  return max(max(c.compile_min for c in cases),
             sum(c.compile_min for c in cases) * CORES_PER_COMPILE / HOST_CORES)


def timed_min(case: Case) -> float:
  profiled = bool(case.commands) and "benchmark.profile" in case.commands[0].overrides
  return TIMED_MIN + (PROFILE_MIN if profiled else 0.0)


def phases(cases: list) -> list:
  """[(phase, its cases, guessed minutes)] for running `cases` in a window, start-up not
  included: each wave compiled at once and then timed, then the cases of no wave one at a
  time, compile included."""
  result = []
  for wave, name in ((DEFAULTS, "defaults"), (LEVERS, "levers"), (COMBINED, "combinations")):
    members = [c for c in cases if c.wave == wave]
    if members:
      result += [(f"compile the {name} at once", members, wave_compile_min(members)),
                 (f"time the {name}, each alone", members, sum(map(timed_min, members)))]
  alone = [c for c in cases if c.wave == ALONE]
  if alone:
    result.append(("the rest, one at a time", alone, sum(c.minutes for c in alone)))
  return result


def in_one_window(cases: list, minutes: float = WINDOW_MIN - STARTUP_MIN) -> list:
  """The first cases (in plan order) whose phases fit in `minutes`."""
  fitting = []
  for case in cases:
    if sum(m for _, _, m in phases(fitting + [case])) > minutes:
      break
    fitting.append(case)
  return fitting


# ----------------------------------------------------------------------------- this checkout


def missing_option(case: Case) -> Optional[str]:
  """Why this checkout cannot run `case` (a config key or choice it does not have yet, e.g. a
  lever another branch adds), or None. A combination is checked when it is built."""
  import importlib
  try:
    from transformer_jax.model.config import CHOICES
  except ImportError as e:  # the suite still runs the cases; each fails in its own log
    return f"the project does not import ({e})"
  for command in case.commands:
    name = command.config.rsplit("/", 1)[-1].removesuffix(".py")
    config = importlib.import_module(f"transformer_jax.experiments.{name}").get_config()
    for key, value in command.overrides.items():
      node = config
      for part in key.split("."):
        if part not in node:
          return f"no config key {key} in this checkout"
        node = node[part]
      field = key.split(".")[-1]
      if key.startswith("model.") and field in CHOICES and value not in CHOICES[field]:
        return f"{key}={value} is not a choice of this checkout ({', '.join(CHOICES[field])})"
  return None


def needs_gpu(case: Case) -> bool:
  """A case the CPU cannot run (cuDNN's attention): a dry run compiles it for an H100 instead."""
  return any(c.overrides.get("model.attention_impl") == "cudnn" for c in case.commands)
