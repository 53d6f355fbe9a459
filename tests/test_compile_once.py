"""Compile once (core/compilation.py, train/state.py's hyperparameters): runs and sweep trials that
differ only in settings share one compiled train step, in a process and across processes through
the persistent compilation cache, with results bitwise those of the step with the settings
folded in as constants (today's optimizer: optax's adamw and schedules with Python floats).

Compiles are counted from JAX's own monitoring events (`compilation.Clock`) and the start-up
record the loop writes from them, never from timings.
"""

import functools
import json
import os
import shutil
import zlib

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from launcher import ROOT, Launcher, environment
from test_checkpoint import assert_same_state, restore_latest

from tests import emulators
from transformer_jax import config as config_lib
from transformer_jax.core import compilation
from transformer_jax.experiments import tiny
from transformer_jax.model import attention, make_model
from transformer_jax.tools import benchmark
from transformer_jax.train import sharding
from transformer_jax.train import state as state_lib
from transformer_jax.train import step as step_lib
from transformer_jax.train.logger import read_metrics

TINY = ["--config=experiments/tiny.py", "--config.train.steps=3", "--config.train.log_every=1",
        "--config.train.checkpoint_every=3", "--config.eval.max_examples=8",
        "--config.eval.batch_size=8"]


def stock_optimizer(t, d_model: int):
  """The optimizer as it was before its settings became inputs: optax's adamw and schedules
  with every setting a Python float (an independent reference for the new one)."""
  parts = [optax.clip_by_global_norm(t.grad_clip_norm)] if t.grad_clip_norm > 0 else []
  parts.append(optax.adamw(state_lib.make_schedule(t, d_model), b1=t.adam_b1, b2=t.adam_b2,
                           eps=t.adam_eps, weight_decay=t.weight_decay))
  return optax.chain(*parts)


SETTINGS = [
    dict(schedule="rsqrt", learning_rate=1.0, warmup_steps=4000, steps=100_000),
    dict(schedule="rsqrt", learning_rate=2.0, warmup_steps=3, steps=20, adam_b2=0.997),
    dict(schedule="cosine", learning_rate=3e-3, warmup_steps=4, steps=9, weight_decay=0.01,
         grad_clip_norm=0.5),
    dict(schedule="cosine", learning_rate=1e-3, warmup_steps=0, steps=50, adam_b1=0.8),
    dict(schedule="constant", learning_rate=7e-4, warmup_steps=0, adam_eps=1e-6),
    dict(schedule="constant", learning_rate=5e-3, warmup_steps=5, weight_decay=0.1),
]


def train_config(**settings):
  c = tiny.get_config()
  c.train.update(settings)
  return c


@pytest.mark.parametrize("settings", SETTINGS)
def test_the_schedule_from_inputs_is_optax_s_bitwise(settings):
  t = train_config(**settings).train
  counts = jnp.concatenate([jnp.arange(0, 64), jnp.array([99, 4000, 4001, 99_999, 200_000])])
  h = state_lib.hyperparameters(t, 512)
  ours = jax.jit(lambda c, h: jax.vmap(state_lib.schedule_of(t.schedule, h))(c))(counts, h)
  stock = jax.jit(jax.vmap(state_lib.make_schedule(t, 512)))(counts)
  np.testing.assert_array_equal(np.asarray(ours), np.asarray(stock))


def steps_equal_today_s(settings: dict, dropout: float) -> None:
  """Four steps of the new step (settings as inputs, smoothing and dropout too) against
  train_step with the stock optimizer and the smoothing and dropout rates as Python floats,
  jitted on the same mesh with the same shardings and donation: parameters, optimizer state
  and loss equal, bitwise."""
  c = train_config(**settings, label_smoothing=0.1)
  c.model.update(dropout_rate=dropout, attention_dropout_rate=dropout)
  model_config = config_lib.validate(c)
  mesh = sharding.make_mesh(c.mesh.to_dict())
  new = step_lib.make_train_step(model_config, c, mesh)
  optimizer = state_lib.make_optimizer(c.train, model_config.d_model)
  shardings = state_lib.state_shardings(model_config, optimizer, mesh)
  replicated = sharding.replicated(mesh)
  stock = sharding.jit(functools.partial(
      step_lib.train_step, model=make_model(model_config),
      optimizer=stock_optimizer(c.train, model_config.d_model),
      smoothing=c.train.label_smoothing, accum_steps=1), mesh, donate_argnums=(0,),
      in_shardings=(shardings, sharding.batch_sharding(mesh), replicated),
      out_shardings=(shardings, replicated))
  a = state_lib.init_state(model_config, optimizer, 0, mesh)
  b = state_lib.init_state(model_config, optimizer, 0, mesh)
  rng = jax.random.PRNGKey(1)
  for seed in range(4):
    batch = sharding.shard_batch(benchmark.synthetic_batch(model_config, 8, 12, 10, seed=seed),
                                 mesh)
    a, metrics_a = new(a, batch, rng)
    b, metrics_b = stock(b, batch, rng)
  assert_same_state(a, b)
  assert float(metrics_a["loss"]) == float(metrics_b["loss"])


@pytest.mark.parametrize("settings", SETTINGS[1:])
def test_the_train_step_with_inputs_equals_today_s_bitwise(settings):
  """Without dropout (whose thresholds as inputs agree to an ulp, below)."""
  steps_equal_today_s(settings, dropout=0.0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("rate", [1e-6, 0.1, 0.3, 0.999])
def test_dropout_thresholds_as_inputs_draw_the_same_masks(rate, dtype):
  """The dropout of a rate whose thresholds are inputs: the same values and gradient as the
  float rate's (keep-all and keep-none rates included), for 16-bit and 8-bit draws."""
  x = jax.random.normal(jax.random.PRNGKey(0), (3, 2, 5, 6)).astype(dtype)
  y = jax.random.normal(jax.random.PRNGKey(1), x.shape).astype(dtype)
  rng = jax.random.PRNGKey(2)

  def loss(x, rate):
    return jnp.sum((attention.dropout(x, rate, rng) * y).astype(jnp.float32))

  static = jax.jit(jax.value_and_grad(lambda x: loss(x, rate)))(x)
  traced = jax.jit(jax.value_and_grad(
      lambda x, keep: loss(x, attention.DropoutRate(rate, keep))))(
          x, attention.DropoutRate.thresholds(rate))
  for a, b in zip(static, traced):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def one_step_gradients(dropout: float, as_inputs: bool):
  """The loss and gradients of one tiny step with residual and attention dropout: the rates as
  floats (constants), or their thresholds as inputs as the train step takes them."""
  c = train_config(label_smoothing=0.1)
  c.model.update(dropout_rate=dropout, attention_dropout_rate=dropout)
  model_config = config_lib.validate(c)
  mesh = sharding.make_mesh(c.mesh.to_dict())
  state = state_lib.init_state(model_config, state_lib.make_optimizer(
      c.train, model_config.d_model), 0, mesh)
  batch = benchmark.synthetic_batch(model_config, 8, 12, 10)
  tokens = float((batch["targets"] > 0).sum())

  def gradients(params, keep):
    config = model_config
    if keep is not None:
      config = step_lib.program_config(model_config).replace(**{
          name: attention.DropoutRate(dropout, keep[name]) for name in keep})
    return jax.value_and_grad(lambda p: step_lib._loss_and_metrics(
        p, make_model(config), batch, jax.random.PRNGKey(1), 0.1, tokens)[0])(params)

  keep = ({name: attention.DropoutRate.thresholds(dropout) for name in step_lib.DROPOUT_RATES}
          if as_inputs else None)
  return jax.device_get(jax.jit(gradients)(state.params, keep))


def test_with_dropout_as_inputs_the_loss_is_bitwise_and_gradients_agree_to_an_ulp():
  """Where XLA does not allow bitwise: a dropout scale that is a constant of the program is
  folded into neighbouring products, an input scale cannot be, so the gradients of the two
  programs differ in the last float32 bits (the masks and the loss do not)."""
  (loss_a, grads_a), (loss_b, grads_b) = (one_step_gradients(0.1, False),
                                          one_step_gradients(0.1, True))
  assert float(loss_a) == float(loss_b)
  for a, b in zip(jax.tree.leaves(grads_a), jax.tree.leaves(grads_b), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_settings_share_one_program_and_a_shape_compiles_anew():
  """Two steps whose configs differ in every setting that is an input (dropout rates included)
  share the jitted function: the second runs without tracing or compiling (JAX's events say
  so); d_model (a shape) makes a new program."""
  first = train_config(learning_rate=1e-3, label_smoothing=0.1, grad_clip_norm=1.0)
  second = train_config(learning_rate=3e-3, label_smoothing=0.2, grad_clip_norm=0.3,
                        warmup_steps=7, adam_b1=0.8, adam_b2=0.99, adam_eps=1e-7)
  second.seed = 5
  first.model.update(dropout_rate=0.1, attention_dropout_rate=0.1)
  second.model.update(dropout_rate=0.3, attention_dropout_rate=0.05)
  wider = train_config(learning_rate=1e-3, label_smoothing=0.1, grad_clip_norm=1.0)
  wider.model.update(d_model=48, dropout_rate=0.1, attention_dropout_rate=0.1)
  mesh = sharding.make_mesh(first.mesh.to_dict())
  spent = []
  for c in (first, second, wider):
    model_config = config_lib.validate(c)
    step = step_lib.make_train_step(model_config, c, mesh)
    state = state_lib.init_state(model_config, state_lib.make_optimizer(
        c.train, model_config.d_model), c.seed, mesh)
    batch = sharding.shard_batch(benchmark.synthetic_batch(model_config, 8, 12, 10), mesh)
    clock = compilation.Clock()
    jax.block_until_ready(step(state, batch, jax.random.PRNGKey(c.seed)))
    spent.append(clock.read())
  assert spent[0]["trace_s"] > 0 and spent[0]["compile_s"] > 0
  assert spent[1]["trace_s"] == spent[1]["compile_s"] == 0.0, spent[1]
  assert spent[1]["cache"] == "none"
  assert spent[2]["trace_s"] > 0 and spent[2]["compile_s"] > 0  # a new shape compiles


def startup(workdir) -> dict:
  records = [r for r in read_metrics(str(workdir)) if r.get("split") == "startup"]
  assert records, f"no start-up record in {workdir}"
  return records[-1]


@pytest.fixture(scope="module")
def launcher(tmp_path_factory):
  """The runs of this file; gcsfs and s3fs imported once (each run with a cache in a bucket
  would import them: a second)."""
  server = Launcher(environment(tmp_path_factory.mktemp("unused_cache")),
                    str(tmp_path_factory.mktemp("launches")), preload=["gcsfs", "s3fs"])
  yield server
  server.close()


@pytest.fixture(scope="module")
def first_run(launcher, tmp_path_factory):
  """The workdir of a tiny run (train.learning_rate 1e-3) that filled an empty cache, the
  cache its sibling "xla": the first process of the tests below, run once (a test that changes
  the cache puts it back as it was)."""
  workdir = tmp_path_factory.mktemp("first_run") / "first"
  code, _, err = launcher.run(*TINY, f"--workdir={workdir}", "--config.train.learning_rate=1e-3",
                              f"--compile_cache={workdir.parent / 'xla'}")
  assert code == 0, err
  return workdir


def test_a_second_process_with_another_rate_loads_the_step_from_the_cache(launcher, tmp_path,
                                                                          first_run):
  """A new process that differs only in train.learning_rate finds the train step in the cache
  (JAX's cache-hit event), and trains to parameters bitwise those of a run without the cache."""
  cache = first_run.parent / "xla"
  runs = {"first": startup(first_run)}
  for name, rate, where in (("second", "3e-3", cache), ("uncached", "3e-3", "off")):
    code, out, err = launcher.run(*TINY, f"--workdir={tmp_path / name}",
                                  f"--config.train.learning_rate={rate}",
                                  f"--compile_cache={where}")
    assert code == 0, err
    runs[name] = startup(tmp_path / name)
  assert runs["first"]["cache"] == "miss" and runs["first"]["cache_misses"] >= 1
  assert runs["second"]["cache"] == "hit" and runs["second"]["cache_misses"] == 0
  assert runs["uncached"]["cache"] == "off"
  assert "cache: hit" in (tmp_path / "second" / "summary.md").read_text()
  assert_same_state(restore_latest(tmp_path / "second").state,
                    restore_latest(tmp_path / "uncached").state)


def one_warning(launcher, workdir, cache, says: str) -> bool:
  """A tiny run with --compile_cache=`cache` ends with exit 0 and exactly one warning line on
  stderr, which says `says`."""
  code, _, err = launcher.run(*TINY, f"--workdir={workdir}", f"--compile_cache={cache}")
  warnings = [line for line in err.splitlines() if "warning" in line.lower()]
  assert code == 0 and len(warnings) == 1 and says in warnings[0], err
  return True


def _entries(cache) -> list:
  return sorted(p for p in cache.iterdir() if p.name.endswith("-cache"))


def test_damaged_entries_compile_anew_with_one_warning(launcher, tmp_path, first_run):
  """Every entry damaged, half of them cut short, half replaced by data that decompresses but is
  no program (another build's): the run compiles them anew with one warning line, and a third
  run reads them from the cache again."""
  # The first process's cache, where it is (its folder is part of each entry's key), put back
  # as it was afterwards.
  cache = first_run.parent / "xla"
  shutil.copytree(cache, tmp_path / "as_it_was")
  try:
    assert _entries(cache)
    for i, path in enumerate(_entries(cache)):
      data = path.read_bytes()
      path.write_bytes(data[: len(data) // 2] if i % 2 else zlib.compress(os.urandom(4096))
                       + data[-4:])
    assert one_warning(launcher, tmp_path / "second", cache, "has an entry that cannot be read")
    assert startup(tmp_path / "second")["cache"] == "miss"
    # Stored again: a third run reads them.
    code, _, err = launcher.run(*TINY, f"--workdir={tmp_path / 'third'}",
                                f"--compile_cache={cache}")
    assert code == 0 and "warning" not in err.lower(), err
    assert startup(tmp_path / "third")["cache"] == "hit"
  finally:
    shutil.rmtree(cache)
    shutil.copytree(tmp_path / "as_it_was", cache)


def test_an_unwritable_cache_folder_warns_once_and_the_run_goes_on(launcher, tmp_path):
  blocker = tmp_path / "a_file"
  blocker.write_text("not a folder")
  assert one_warning(launcher, tmp_path / "run", blocker / "xla", "cannot be written")
  assert startup(tmp_path / "run")["cache"] == "off"


def test_a_cache_in_a_bucket_serves_the_next_process(launcher, tmp_path_factory):
  """gs:// and s3:// (the emulators): the second process finds the first's program there, and
  nothing appears on the local disk."""
  from transformer_jax.core import storage
  with emulators.buckets() as (gcs_url, s3_url):
    for bucket in ("gs", "s3"):
      tmp = tmp_path_factory.mktemp(f"{bucket}_runs")
      for name, rate in (("first", "1e-3"), ("second", "2e-3")):
        code, _, err = launcher.run(*TINY, f"--workdir={tmp / name}",
                                    f"--config.train.learning_rate={rate}",
                                    f"--compile_cache={bucket}://bucket/xla",
                                    env=emulators.environment(gcs_url, s3_url))
        assert code == 0, err
      assert startup(tmp / "first")["cache"] == "miss", bucket
      assert startup(tmp / "second")["cache"] == "hit", bucket
      assert any(n.endswith("-cache") for n in storage.listdir(f"{bucket}://bucket/xla"))
    # No folder named after a URL where the runs started (JAX's lock file, XLA's caches).
    assert not [n for n in os.listdir(ROOT) if n.endswith(":")]


def test_the_compile_cache_flag_is_refused_where_nothing_compiles():
  from transformer_jax import cli
  assert "compile_cache" in (cli.refused_flag("compile_cache", "describe", []) or "")
  assert cli.refused_flag("compile_cache", "train", []) is None


def test_workers_on_one_gpu_share_its_memory():
  from transformer_jax.tools.sweep import worker
  assert worker.shared_accelerator_memory(1, {}) == {}
  share = worker.shared_accelerator_memory(3, {})
  assert float(share["XLA_PYTHON_CLIENT_MEM_FRACTION"]) * 3 <= 0.75 + 1e-3
  assert worker.shared_accelerator_memory(3, {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}) == {}


def test_the_benchmark_splits_its_start_up():
  c = tiny.get_config()
  c.benchmark = ml_collections.ConfigDict(config_lib.default_config().benchmark.to_dict())
  c.benchmark.update(batch_size=4, source_len=8, target_len=8, steps=1, warmup=0)
  result = benchmark.benchmark_train(c, config_lib.validate(c))
  for key in ("setup_s", "trace_s", "lower_s", "backend_compile_s"):
    assert result[key] >= 0.0
  assert result["compile_cache"] in ("hit", "miss", "partly", "off", "none")
  json.dumps(result)


TWO_RATES = """from transformer_jax.experiments import tiny

get_config = tiny.get_config


def get_sweep():
  return [{"train.learning_rate": 1e-3}, {"train.learning_rate": 3e-3}]
"""


def test_a_sweep_keeps_its_cache_in_its_workdir(launcher, tmp_path):
  """Without a cache named anywhere, a sweep's workers share WORKDIR/compile_cache; its second
  trial (another rate) compiles nothing."""
  experiment = tmp_path / "two_rates.py"
  experiment.write_text(TWO_RATES)
  workdir = tmp_path / "sweep"
  code, out, err = launcher.run(f"--config={experiment}", f"--workdir={workdir}", "--sweep",
                                "--config.train.steps=2", "--config.eval.max_examples=8",
                                "--config.eval.batch_size=8",
                                env={"JAX_COMPILATION_CACHE_DIR": "",
                                     "TRANSFORMER_JAX_COMPILE_CACHE": ""})
  assert code == 0, out + err
  assert _entries(workdir / "compile_cache")
  assert startup(workdir / "trial_0000")["cache"] == "miss"
  assert startup(workdir / "trial_0001")["cache"] == "none"
