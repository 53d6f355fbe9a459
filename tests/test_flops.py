"""The model FLOP formula against XLA's count of the lowered train step, for every architecture
and the options that change a matrix product (grouped-query attention, gated FFN, relative_xl)."""

import jax
import jax.numpy as jnp
import pytest

from transformer_jax import config as config_lib
from transformer_jax.experiments import tiny
from transformer_jax.model.flops import train_flops_per_step
from transformer_jax.train import sharding
from transformer_jax.train import state as state_lib
from transformer_jax.train import step as step_lib


@pytest.mark.parametrize("arch, task, changes, lengths", [
    ("encoder_decoder", "seq2seq", dict(num_kv_heads=2, activation="geglu"), (24, 16)),
    ("decoder_only", "seq2seq", dict(num_kv_heads=1, activation="swiglu"), (24, 16)),
    ("decoder_only", "lm", dict(positional="rotary"), (0, 32)),
    ("encoder_only", "mlm", dict(positional="relative_bias"), (32, 0)),
    # Transformer-XL's position term (W_r and the position scores) is counted; a shared layer
    # costs what separate layers do.
    ("encoder_decoder", "seq2seq", dict(positional="relative_xl", share_layers=True), (24, 16)),
    ("decoder_only", "seq2seq", dict(positional="relative_xl", random_positions_max=96),
     (24, 16)),
    ("encoder_decoder", "seq2seq", dict(residual_gate=True), (24, 16)),  # a gate per block
])
def test_formula_matches_the_compiled_step(arch, task, changes, lengths):
  # Sizes at which the matrix products dominate, as they do in any real model: what XLA counts
  # beyond them (softmax, norms, Adam) is then a few percent.
  c = tiny.get_config()
  c.model.update(arch=arch, d_model=128, num_heads=4, d_ff=512, num_encoder_layers=2,
                 num_decoder_layers=2, vocab_size=256, max_len=64, **changes)
  c.data.update(task=task, batching="fixed", batch_size=8)
  if task != "seq2seq":
    c.data.update(source="files", path="unused", format="tsv" if task == "classify" else "text")
  model_config = config_lib.validate(c)
  mesh = sharding.make_mesh({"data": 1}, jax.devices()[:1])
  optimizer = state_lib.make_optimizer(c.train, model_config.d_model)
  step = step_lib.make_train_step(model_config, c, mesh)
  source_len, target_len = lengths
  batch = {"inputs": jax.ShapeDtypeStruct((8, source_len), jnp.int32),
           "targets": jax.ShapeDtypeStruct((8, target_len), jnp.int32)}
  lowered = step.lower(state_lib.abstract_state(model_config, optimizer, mesh), batch,
                       jax.ShapeDtypeStruct((2,), jnp.uint32))
  counted = lowered.cost_analysis()["flops"]
  formula = train_flops_per_step(model_config, 8, source_len, target_len)
  assert 1.0 <= counted / formula < 1.06, (counted, formula)
  # Each term matters: without the attention scores or the FFN the formula falls short.
  assert counted / train_flops_per_step(model_config.replace(d_ff=0), 8, *lengths) > 1.3
  if model_config.residual_gate:  # nor without the gates
    assert counted / train_flops_per_step(model_config.replace(residual_gate=False), 8,
                                          *lengths) > 1.06
  if model_config.positional == "relative_xl":  # nor without relative_xl's position term
    without = train_flops_per_step(model_config.replace(positional="rotary"), 8, *lengths)
    assert counted / without > 1.04
