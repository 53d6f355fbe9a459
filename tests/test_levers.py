"""The GPU step's levers (issue 53), checked on the CPU before any GPU window: each is an option
whose numerics equal the default's, or whose difference is stated and tested here.

model.dropout_rng=rbg|unsafe_rbg: dropout's bits from XLA's RngBitGenerator instead of threefry
(other masks from the same key, the same rate and scale, the same mask on any mesh; unsafe_rbg
draws rbg's very bits). model.remat=dots_all|qkv_out|block_out (beside none|full|dots): what
each policy keeps for the backward pass, read from JAX's own list of saved residuals, and the
same loss and gradients as none. train.loss_chunk_tokens: the loss, its metrics and gradients
of the default up to float rounding, and no [tokens, vocab] array in the compiled program.
model.attention_impl=cudnn: compiled for an H100 on this CPU (XLA's GPU compiler), the fused
kernel in the program, forward and backward.
"""

import contextlib
import io
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from launcher import ROOT

from transformer_jax import config as config_lib
from transformer_jax import model as model_lib
from transformer_jax.core import compilation
from transformer_jax.core.errors import UserError
from transformer_jax.experiments import tiny
from transformer_jax.model import attention, make_model
from transformer_jax.model.transformer import REMAT_POLICIES
from transformer_jax.tools import benchmark
from transformer_jax.train import sharding
from transformer_jax.train import state as state_lib
from transformer_jax.train import step as step_lib

SHAPE = (64, 512)  # 32,768 draws: a kept fraction within 5 sigma is +-0.0083 at rate 0.1


def kept_within_5_sigma(kept: np.ndarray, p_keep: float) -> None:
  n = kept.size
  sigma = np.sqrt(n * p_keep * (1 - p_keep))
  assert abs(kept.sum() - n * p_keep) < 5 * sigma, (kept.mean(), p_keep)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rbg_dropout_keeps_the_rate_and_scale_of_threefry_with_other_masks(dtype):
  """The same keep probability (binomial bound) and the very scale of the survivors as the
  default generator; deterministic in the key; masks other than threefry's; two keys' masks
  agree as often as independent draws do (p^2 + q^2), not more."""
  rate = 0.1
  x = jnp.ones(SHAPE, dtype)
  key, other = jax.random.PRNGKey(3), jax.random.PRNGKey(4)
  drop = jax.jit(attention.dropout, static_argnums=(1, 3))
  rbg, threefry = np.asarray(drop(x, rate, key, "rbg")), np.asarray(drop(x, rate, key, "threefry"))
  keep_count = round((1 - rate) * 2**(8 if dtype == jnp.bfloat16 else 16))
  p_keep = keep_count / 2**(8 if dtype == jnp.bfloat16 else 16)
  kept = rbg != 0
  kept_within_5_sigma(kept, p_keep)
  assert set(np.unique(rbg[kept]).tolist()) == set(np.unique(threefry[threefry != 0]).tolist())
  np.testing.assert_array_equal(rbg, np.asarray(drop(x, rate, key, "rbg")))
  assert (kept != (threefry != 0)).any()
  agree = kept == (np.asarray(drop(x, rate, other, "rbg")) != 0)
  kept_within_5_sigma(agree, p_keep**2 + (1 - p_keep)**2)


def test_rbg_dropout_as_an_input_rate_draws_the_float_rate_s_masks():
  """Compile once (train/step.py): thresholds as inputs give the float rate's values with rbg
  too."""
  x = jax.random.normal(jax.random.PRNGKey(0), (4, 6, 8))
  key = jax.random.PRNGKey(2)
  static = jax.jit(lambda x: attention.dropout(x, 0.3, key, "rbg"))(x)
  keep = attention.DropoutRate.thresholds(0.3)
  traced = jax.jit(lambda x, keep: attention.dropout(x, attention.DropoutRate(0.3, keep), key,
                                                     "rbg"))(x, keep)
  np.testing.assert_array_equal(np.asarray(static), np.asarray(traced))


MESH_SCRIPT = textwrap.dedent("""
    import json, sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from transformer_jax.model import attention
    assert jax.device_count() == 8
    mesh = Mesh(np.array(jax.devices()), ("data",))
    x = jax.random.normal(jax.random.PRNGKey(0), (16, 4, 32))
    key = jax.random.PRNGKey(7)
    same = {}
    for generator in attention.GENERATORS:
      drop = jax.jit(lambda x, key: attention.dropout(x, 0.25, key, generator))
      alone = np.asarray(drop(jax.device_put(x, jax.devices()[0]), key))
      sharded = drop(jax.device_put(x, NamedSharding(mesh, P("data"))), key)
      assert len(sharded.sharding.device_set) == 8
      same[generator] = bool(np.array_equal(alone, np.asarray(sharded)))
    print(json.dumps(same))
""")


def test_every_generator_draws_the_same_mask_on_any_mesh():
  """On 8 (simulated) devices, a batch sharded over all of them is dropped with the mask it has
  on one device, for threefry (partitionable: each device draws its shard) and rbg and
  unsafe_rbg (each device computes the whole array and keeps its shard)."""
  env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu",
         "PYTHONPATH": ROOT, "PATH": "/usr/bin:/bin"}
  out = subprocess.run([sys.executable, "-c", MESH_SCRIPT], cwd=ROOT, env=env, check=True,
                       capture_output=True, text=True).stdout
  assert out.strip().splitlines()[-1] == (
      '{"threefry": true, "rbg": true, "unsafe_rbg": true}'), out


def test_unsafe_rbg_draws_the_bits_of_rbg():
  """JAX's two RngBitGenerator keys differ only in how they split and fold in, which dropout
  never does with the key it makes: the very same masks."""
  x = jnp.ones((16, 64), jnp.bfloat16)
  for key in (jax.random.PRNGKey(0), jax.random.PRNGKey(11)):
    np.testing.assert_array_equal(np.asarray(attention.dropout(x, 0.1, key, "unsafe_rbg")),
                                  np.asarray(attention.dropout(x, 0.1, key, "rbg")))


def test_an_unknown_generator_is_one_line():
  c = tiny.get_config()
  c.model.dropout_rng = "philox"
  with pytest.raises(UserError, match=r"model.dropout_rng must be one of threefry, rbg, "
                                     r"unsafe_rbg; got 'philox'$"):
    config_lib.validate(c)


def _step_metrics(c, init=None):
  """One train step of config `c` on a synthetic batch: (its metrics as floats, the seconds
  spent tracing and compiling). The initial state is that of config `init` (default `c`) with
  c's seed: one whose model differs from c's in its dropout alone has the very same state."""
  model_config = config_lib.validate(c)
  mesh = sharding.make_mesh(c.mesh.to_dict())
  step = step_lib.make_train_step(model_config, c, mesh)
  init = c if init is None else init
  init_config = config_lib.validate(init)
  state = state_lib.init_state(init_config, state_lib.make_optimizer(
      init.train, init_config.d_model), c.seed, mesh)
  batch = sharding.shard_batch(benchmark.synthetic_batch(model_config, 8, 12, 10), mesh)
  clock = compilation.Clock()
  _, metrics = jax.block_until_ready(step(state, batch, jax.random.PRNGKey(c.seed)))
  return {k: float(v) for k, v in metrics.items()}, clock.read()


def _step_once(c):
  # Dropout's generator and rates do not enter the initial state: every config's state comes
  # from one model without dropout (one compiled initialiser, the seed its input).
  metrics, spent = _step_metrics(c, init=tiny.get_config())
  return metrics["loss"], spent


def test_the_rbg_train_step_compiles_once_for_any_seed_and_rate():
  """With rbg, as with threefry, the seed and the dropout rates stay inputs: a second run with
  others neither traces nor compiles; its loss differs from threefry's (other masks) and,
  without dropout, it is threefry's exactly (no bits drawn)."""
  def config(generator, rate, seed):
    c = tiny.get_config()
    c.model.update(dropout_rate=rate, attention_dropout_rate=rate, dropout_rng=generator)
    c.seed = seed
    return c

  first, _ = _step_once(config("rbg", 0.1, 0))
  second, spent = _step_once(config("rbg", 0.3, 5))
  assert spent["trace_s"] == spent["compile_s"] == 0.0, spent
  assert np.isfinite(first) and first != second
  assert _step_once(config("threefry", 0.1, 0))[0] != first
  assert _step_once(config("threefry", 0.0, 0))[0] == _step_once(config("rbg", 0.0, 0))[0]
  _step_once(config("unsafe_rbg", 0.2, 1))
  same, spent = _step_once(config("unsafe_rbg", 0.3, 5))  # rbg's bits: rbg's loss
  assert spent["trace_s"] == spent["compile_s"] == 0.0 and same == second, spent


D_FF = 96  # a width no other array of the tiny remat model has


def remat_model(remat: str, init: bool = True):
  """The loss of a tiny model with `remat` and its parameters (without `init`: their shapes and
  dtypes alone, jax.eval_shape's, for what only traces)."""
  c = tiny.get_config()
  c.model.update(d_model=32, d_ff=D_FF, num_heads=4, remat=remat, dropout_rate=0.1,
                 attention_dropout_rate=0.1)
  model = make_model(config_lib.validate(c))
  batch = benchmark.synthetic_batch(model.config, 4, 8, 8)

  def make_params():
    return model.init({"params": jax.random.PRNGKey(0), "dropout": jax.random.PRNGKey(0)},
                      batch["inputs"], batch["targets"])["params"]

  params = jax.jit(make_params)() if init else jax.eval_shape(make_params)

  def loss(p):
    return step_lib._loss_and_metrics(p, model, batch, jax.random.PRNGKey(1), 0.1, 100.0)[0]

  return loss, params


def saved_activations(remat: str) -> list:
  """JAX's list of what the backward pass keeps (jax.ad_checkpoint.print_saved_residuals),
  parameters and constants left out: one line per array, e.g. "f32[4,8,96] output of ..."."""
  loss, params = remat_model(remat, init=False)  # it traces: shapes are all it reads
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    jax.ad_checkpoint.print_saved_residuals(loss, params)
  return [line for line in out.getvalue().splitlines()
          if "from the argument" not in line and "from a " not in line]


def test_every_remat_policy_keeps_what_it_says():
  """none keeps the FFN's hidden layer and the attention weights; full neither; dots the hidden
  layer (a weight product's output) but not the weights; dots_all the attention's batched
  products as well; qkv_out the named queries, keys, values and block outputs, neither the
  hidden layer nor the weights; block_out the attention and FFN outputs alone."""
  hidden = f",{D_FF}]"
  weights = "[4,4,8,8]"  # [batch, heads, queries, keys]

  def count(lines, text):
    return sum(text in line for line in lines)

  kept = {remat: saved_activations(remat) for remat in ("none", *REMAT_POLICIES)}
  assert count(kept["none"], hidden) and count(kept["none"], weights)
  assert not count(kept["full"], hidden) and not count(kept["full"], weights)
  assert count(kept["dots"], hidden) and not count(kept["dots"], weights)
  assert count(kept["dots_all"], weights)
  assert not count(kept["qkv_out"], hidden) and not count(kept["qkv_out"], weights)
  assert count(kept["qkv_out"], "named 'qkv'") == 3 * 3  # 3 attentions of 3 arrays each
  assert len(kept["full"]) < len(kept["qkv_out"]) < len(kept["none"])
  block = kept["block_out"]
  assert not count(block, hidden) and not count(block, weights) and not count(block, "'qkv'")
  # 3 attentions (encoder, decoder self and cross) and 2 FFNs, one layer each; the rest is the
  # stacks' inputs, which every policy keeps
  assert count(block, "named 'attention_out'") == 3 and count(block, "named 'mlp_out'") == 2
  assert len(block) == len(kept["full"]) + 5, block


@pytest.fixture(scope="module")
def without_remat():
  """remat=none's parameters, and its loss and gradients at them: computed once for every
  policy's test."""
  loss, params = remat_model("none")
  return params, jax.jit(jax.value_and_grad(loss))(params)


@pytest.mark.parametrize("remat", sorted(REMAT_POLICIES))
def test_every_remat_policy_gives_the_loss_and_gradients_of_none(remat, without_remat):
  """Recomputing draws the same dropout masks: the same loss and gradients, up to the order
  XLA sums in."""
  reference_params, (a, grads_a) = without_remat
  loss, params = remat_model(remat, init=False)
  def shapes(tree):
    return jax.tree.map(lambda x: (x.shape, x.dtype), tree)

  assert shapes(params) == shapes(reference_params)  # the same parameters, remat or not
  b, grads_b = jax.jit(jax.value_and_grad(loss))(reference_params)
  np.testing.assert_allclose(float(a), float(b), rtol=1e-6)
  for x, y in zip(jax.tree.leaves(grads_a), jax.tree.leaves(grads_b), strict=True):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- the chunked loss

CHUNKED = {  # tiny models whose output layers differ (a config of each, and its task)
    "tied, length head": ({"length_head": True}, "seq2seq"),
    "untied, logits bias, excluded rows": ({"arch": "decoder_only", "tie_output": False,
                                            "logits_bias": True, "excluded_rows": (2, 3)}, "lm"),
    "masked LM": ({"arch": "encoder_only"}, "mlm"),
}


def chunked_model(options: dict, task: str):
  """A tiny model, its parameters and a batch with padding (rows cut short, a row of nothing)
  whose targets avoid the excluded rows."""
  c = tiny.get_config()
  c.model.update(**options)
  c.data.task = task
  model = make_model(config_lib.validate(c))
  rng = np.random.default_rng(0)
  inputs = rng.integers(4, model.config.vocab_size, (4, 9), dtype=np.int32)
  targets = rng.integers(4, model.config.vocab_size, (4, 9 if task == "mlm" else 7),
                         dtype=np.int32)
  targets[1, 4:], targets[3] = 0, 0
  if task == "mlm":
    targets[rng.random(targets.shape) < 0.5] = 0
  batch = {"inputs": inputs, "targets": targets}
  params = model.init({"params": jax.random.PRNGKey(0), "dropout": jax.random.PRNGKey(0)},
                      *(inputs,) if task == "mlm" else (inputs, targets))["params"]
  return model, params, batch


@pytest.mark.parametrize("name", CHUNKED)
def test_the_chunked_loss_gives_the_default_loss_metrics_and_gradients(name):
  """With label smoothing, padding and dropout (the same masks: the output layer draws none),
  chunks of 5 tokens over 4 rows (2 positions each, the last chunk half padding) and one chunk
  larger than the batch: the default's loss, nll, correct count, length error and gradients."""
  model, params, batch = chunked_model(*CHUNKED[name])

  def run(chunk):
    return jax.jit(jax.value_and_grad(lambda p: step_lib._loss_and_metrics(
        p, model, batch, jax.random.PRNGKey(1), 0.1, 20.0, 0.5, chunk), has_aux=True))(params)

  (loss, sums), grads = run(0)
  assert np.isfinite(float(loss)) and float(sums["correct"]) < float(sums["nll"])
  for chunk in (5, 1000):
    (chunked_loss, chunked_sums), chunked_grads = run(chunk)
    np.testing.assert_allclose(float(chunked_loss), float(loss), rtol=1e-6)
    assert chunked_sums.keys() == sums.keys()
    for key in sums:
      np.testing.assert_allclose(float(chunked_sums[key]), float(sums[key]), rtol=1e-6, atol=1e-6)
    for path, a, b in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(grads),
                          jax.tree.leaves(chunked_grads), strict=True):
      np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6,
                                 err_msg=jax.tree_util.keystr(path[0]))


def test_the_chunked_loss_under_bfloat16_is_as_near_float32_as_the_default():
  """bfloat16 rounds the chunked gradients at other points (the chunk's gradients before the
  loss's scale, not after): they differ from the default's by about bfloat16's precision, and
  lie no farther from the float32 gradients than the default's do."""
  model, params, batch = chunked_model({"dtype": "bfloat16"}, "seq2seq")
  exact = make_model(model.config.replace(dtype="float32"))

  def grads(model, chunk):
    return jax.jit(jax.grad(lambda p: step_lib._loss_and_metrics(
        p, model, batch, jax.random.PRNGKey(1), 0.1, 20.0, 0.0, chunk)[0]))(params)

  def flat(tree):
    return np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(tree)])

  def distance(a, b):  # relative to b, over all parameters
    return np.linalg.norm(flat(a) - flat(b)) / np.linalg.norm(flat(b))

  reference, default, chunked = grads(exact, 0), grads(model, 0), grads(model, 5)
  assert distance(chunked, default) < 2**-6  # 0.6% here; each is 4% from float32
  assert distance(chunked, reference) < 1.25 * distance(default, reference), (
      distance(chunked, reference), distance(default, reference))


@pytest.mark.parametrize("name", CHUNKED)
def test_the_output_layer_params_are_those_its_logits_read(name):
  """What the chunked loss keeps gradients of: exactly the leaves that the model's output
  layer gives a gradient (the tied table; the untied layer and the logits' biases)."""
  model, params, _ = chunked_model(*CHUNKED[name])
  hidden = jax.random.normal(jax.random.PRNGKey(0), (2, 3, model.config.d_model))

  def squares(p):  # the excluded rows' -inf aside
    logits = model.apply({"params": p}, hidden, method="output_logits")
    return jnp.sum(jnp.where(jnp.isfinite(logits), logits, 0.0) ** 2)

  grads = jax.grad(squares)(params)
  read = {jax.tree_util.keystr(path) for path, g in jax.tree_util.tree_leaves_with_path(grads)
          if np.any(np.asarray(g) != 0)}
  kept = {jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(
      model_lib.output_layer_params(model.config, params))}
  assert kept == read, (kept, read)


def largest_vocab_array(hlo: str, vocab: int) -> int:
  """The most elements of any array in a compiled program whose last axis is `vocab` wide."""
  sizes = [int(np.prod([int(d) for d in dims.split(",")]))
           for dims in re.findall(r"\[([\d,]+)\]", hlo) if dims.split(",")[-1] == str(vocab)]
  return max(sizes, default=0)


def test_the_chunked_step_holds_no_tokens_by_vocabulary_array():
  """Compiled on this CPU (d_model 32, a vocabulary of 3,001 rows, 16 x 64 target tokens): the
  default's program holds arrays of all tokens x the vocabulary (the logits, their gradient)
  and the chunked one none larger than a chunk's, with less memory for temporaries by at
  least one float32 logits array."""
  c = tiny.get_config()
  c.model.update(vocab_size=3001, max_len=80)
  model = make_model(config_lib.validate(c))
  batch = benchmark.synthetic_batch(model.config, 16, 64, 64)
  params = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), batch["inputs"],
                                             batch["targets"])["params"])

  def compiled(chunk):
    return jax.jit(jax.grad(lambda p: step_lib._loss_and_metrics(
        p, model, batch, jax.random.PRNGKey(1), 0.1, 1.0, 0.0, chunk)[0])).lower(params).compile()

  tokens, chunk = 16 * 64, 128
  default, chunked = compiled(0), compiled(chunk)
  assert largest_vocab_array(default.as_text(), 3001) >= tokens * 3001
  assert largest_vocab_array(chunked.as_text(), 3001) <= chunk * 3001
  saved = default.memory_analysis().temp_size_in_bytes - (
      chunked.memory_analysis().temp_size_in_bytes)
  assert saved >= tokens * 3001 * 4, saved


@pytest.mark.parametrize("overrides, message", [
    ({"train.loss_chunk_tokens": -1}, r"^train.loss_chunk_tokens must be >= 0, got -1$"),
    ({"train.loss_chunk_tokens": 64, "model.arch": "encoder_only", "model.num_labels": 3,
      "data.task": "classify"}, r"^train.loss_chunk_tokens chunks the vocabulary's logits"),
])
def test_a_bad_loss_chunk_is_one_line(overrides, message):
  c = tiny.get_config()
  c.update_from_flattened_dict(overrides)
  with pytest.raises(UserError, match=message):
    config_lib.validate(c)


def test_the_train_step_with_a_chunked_loss_gives_the_default_metrics():
  """Through make_train_step (the compiled step of a run): the same loss, accuracy and gradient
  norm."""
  c = tiny.get_config()
  default, _ = _step_metrics(c)
  c.train.loss_chunk_tokens = 24
  chunked, _ = _step_metrics(c)
  for key in ("loss", "nll", "accuracy", "grad_norm", "tokens"):
    np.testing.assert_allclose(chunked[key], default[key], rtol=1e-5, err_msg=key)


# ----------------------------------------------------------------------------- cuDNN attention


def fused_attention_calls(attention_impl: str, monkeypatch) -> set:
  """The custom calls of a tiny bfloat16 train step compiled for one H100 on this CPU (XLA's GPU
  compiler, from the CUDA plugin of JAX) with model.attention_impl=`attention_impl`.

  JAX asks the installed cuDNN for its version before it emits the fused call; the compiler
  itself needs no cuDNN, and the gpu-compile extra installs none. Without the library, the
  test answers the question with a version (9.10) instead of skipping."""
  pytest.importorskip("jax_plugins.xla_cuda12",
                      reason="compiling for GPUs needs the gpu-compile extra (jax-cuda12-plugin)")
  from jax._src.cudnn import fused_attention_stablehlo

  from transformer_jax.tools import compile as compile_lib
  try:
    fused_attention_stablehlo.check_cudnn_version()
  except RuntimeError:
    monkeypatch.setattr(fused_attention_stablehlo, "check_cudnn_version", lambda: 91000)
  mesh = jax.sharding.Mesh(np.array(compile_lib.gpu_devices("h100", 1, 1)).reshape(1, 1, 1),
                           ("data", "fsdp", "tensor"))
  c = tiny.get_config()
  c.model.update(attention_impl=attention_impl, dtype="bfloat16", d_model=64, num_heads=4)
  c.compile.batch_size = 16
  lowered, _, _ = compile_lib.lower_train_step(c, config_lib.validate(c, platform="gpu"), mesh)
  compiled, _ = compile_lib.compile_lowered(lowered, "the train step", "H100", mesh)
  return set(re.findall(r'custom_call_target="([^"]+)"', compiled.as_text()))


def test_cudnn_attention_compiles_for_an_h100_with_the_fused_kernels(monkeypatch):
  """Forward and backward: cuDNN's fused attention, the mask as a bias."""
  calls = fused_attention_calls("cudnn", monkeypatch)
  assert {"__cudnn$fmhaScaleBiasSoftmax", "__cudnn$fmhaScaleBiasSoftmaxBackward"} <= calls, calls


@pytest.mark.parametrize("changes, message", [
    ({"attention_dropout_rate": 0.1}, r"^model.attention_impl='cudnn' has no attention-weight "
                                      r"dropout; set model.attention_dropout_rate=0"),
    ({"dtype": "float32"}, r"^model.attention_impl='cudnn' runs cuDNN's fused attention, on "
                           r"NVIDIA GPUs in bfloat16, and model.dtype is float32"),
])
def test_cudnn_attention_refuses_what_it_cannot_do_in_one_line(changes, message):
  c = tiny.get_config()
  c.model.update({"attention_impl": "cudnn", "dtype": "bfloat16", **changes})
  with pytest.raises(UserError, match=message):
    config_lib.validate(c, platform="gpu")
