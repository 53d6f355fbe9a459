"""The GPU step's levers (issue 53), checked on the CPU before any GPU window: each is an option
whose numerics equal the default's, or whose difference is stated and tested here.

model.dropout_rng=rbg: dropout's bits from XLA's RngBitGenerator instead of threefry (other
masks from the same key, the same rate and scale, the same mask on any mesh).
model.remat=dots_all|qkv_out (beside none|full|dots): what each policy keeps for the backward
pass, read from JAX's own list of saved residuals, and the same loss and gradients as none.
"""

import contextlib
import io
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from launcher import ROOT

from transformer_jax import config as config_lib
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


def test_both_generators_draw_the_same_mask_on_any_mesh():
  """On 8 (simulated) devices, a batch sharded over all of them is dropped with the mask it has
  on one device, for threefry (partitionable: each device draws its shard) and rbg (each device
  computes the whole array and keeps its shard)."""
  env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu",
         "PYTHONPATH": ROOT, "PATH": "/usr/bin:/bin"}
  out = subprocess.run([sys.executable, "-c", MESH_SCRIPT], cwd=ROOT, env=env, check=True,
                       capture_output=True, text=True).stdout
  assert out.strip().splitlines()[-1] == '{"threefry": true, "rbg": true}', out


def test_an_unknown_generator_is_one_line():
  c = tiny.get_config()
  c.model.dropout_rng = "philox"
  with pytest.raises(UserError, match=r"model.dropout_rng must be one of threefry, rbg"):
    config_lib.validate(c)


def _step_once(c):
  model_config = config_lib.validate(c)
  mesh = sharding.make_mesh(c.mesh.to_dict())
  step = step_lib.make_train_step(model_config, c, mesh)
  state = state_lib.init_state(model_config, state_lib.make_optimizer(
      c.train, model_config.d_model), c.seed, mesh)
  batch = sharding.shard_batch(benchmark.synthetic_batch(model_config, 8, 12, 10), mesh)
  clock = compilation.Clock()
  _, metrics = jax.block_until_ready(step(state, batch, jax.random.PRNGKey(c.seed)))
  return float(metrics["loss"]), clock.read()


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


D_FF = 96  # a width no other array of the tiny remat model has


def remat_model(remat: str):
  c = tiny.get_config()
  c.model.update(d_model=32, d_ff=D_FF, num_heads=4, remat=remat, dropout_rate=0.1,
                 attention_dropout_rate=0.1)
  model = make_model(config_lib.validate(c))
  batch = benchmark.synthetic_batch(model.config, 4, 8, 8)
  params = model.init({"params": jax.random.PRNGKey(0), "dropout": jax.random.PRNGKey(0)},
                      batch["inputs"], batch["targets"])["params"]

  def loss(p):
    return step_lib._loss_and_metrics(p, model, batch, jax.random.PRNGKey(1), 0.1, 100.0)[0]

  return loss, params


def saved_activations(remat: str) -> list:
  """JAX's list of what the backward pass keeps (jax.ad_checkpoint.print_saved_residuals),
  parameters and constants left out: one line per array, e.g. "f32[4,8,96] output of ..."."""
  loss, params = remat_model(remat)
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    jax.ad_checkpoint.print_saved_residuals(loss, params)
  return [line for line in out.getvalue().splitlines()
          if "from the argument" not in line and "from a " not in line]


def test_every_remat_policy_keeps_what_it_says():
  """none keeps the FFN's hidden layer and the attention weights; full neither; dots the hidden
  layer (a weight product's output) but not the weights; dots_all the attention's batched
  products as well; qkv_out the named queries, keys, values and block outputs, neither the
  hidden layer nor the weights."""
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


@pytest.mark.parametrize("remat", sorted(REMAT_POLICIES))
def test_every_remat_policy_gives_the_loss_and_gradients_of_none(remat):
  """Recomputing draws the same dropout masks: the same loss and gradients, up to the order
  XLA sums in."""
  reference_loss, reference_params = remat_model("none")
  loss, params = remat_model(remat)
  (a, grads_a), (b, grads_b) = (jax.jit(jax.value_and_grad(reference_loss))(reference_params),
                                jax.jit(jax.value_and_grad(loss))(params))
  np.testing.assert_allclose(float(a), float(b), rtol=1e-6)
  for x, y in zip(jax.tree.leaves(grads_a), jax.tree.leaves(grads_b), strict=True):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)
