"""Shared fixtures: a tiny model config, parameters that cost no compiled initialiser, and the
data cache in a temporary directory."""

import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.core import platforms
from transformer_jax.data import cache
from transformer_jax.model import ModelConfig

platforms.cpu_only_unless_accelerated()  # before JAX starts: no TPU runtime warnings


@pytest.fixture(autouse=True, scope="session")
def data_cache(tmp_path_factory):
  """The tokenised-data cache of every run in the tests (launch.py subprocesses included, through
  the environment): one temporary directory per test worker, never the user's home."""
  directory = tmp_path_factory.mktemp("data_cache")
  os.environ[cache.ENV] = str(directory)
  return directory


@pytest.fixture
def tiny_config() -> ModelConfig:
  """2+2 layers, d_model 32, 4 heads (head_dim 8), vocab 50; dropout off."""
  return ModelConfig(vocab_size=50, d_model=32, num_heads=4, num_encoder_layers=2,
                     num_decoder_layers=2, d_ff=64, max_len=32, deterministic=True).validate()


@pytest.fixture
def random_params():
  """Returns `make(init_fn, seed=0)`: NumPy-drawn parameters shaped like `init_fn(rng)["params"]`
  (unboxed: plain arrays without their logical axis names).

  The shapes come from `jax.eval_shape`, so no initialiser is compiled (that dominates the run time
  of tiny-module tests); the values, normal(0, 0.3) and LayerNorm scales near 1, are good enough for
  tests of properties that hold for any parameters.
  """

  def make(init_fn, seed=0):
    shapes = nn.unbox(jax.eval_shape(init_fn, jax.random.PRNGKey(0))["params"])
    rng = np.random.default_rng(seed)

    def draw(path, shape):
      values = rng.normal(0.0, 0.3, shape.shape)
      if getattr(path[-1], "key", "") == "scale":
        values = 1.0 + values
      return jnp.asarray(values, jnp.float32)

    return jax.tree_util.tree_map_with_path(draw, shapes)

  return make
