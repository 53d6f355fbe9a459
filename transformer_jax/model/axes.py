"""Logical axis names: how the model says what each dimension of a parameter or activation is.

Every parameter is created with the names of its dimensions (`param_init`), and the main
activations are constrained by theirs (`constrain`). The model never names a device or a mesh:
`transformer_jax.train.sharding.RULES` maps these names to mesh axes in one table, the way t5x and
MaxText partition. Outside that mapping (`sharding.context`), both are no-ops.

The names:
  batch     examples (activations only)
  length    positions of a sequence (activations only)
  embed     d_model
  heads     attention heads (of the queries)
  kv_heads  heads of the keys and values (fewer than `heads` with grouped-query attention)
  kv        head_dim (d_k = d_v)
  mlp       the feed-forward hidden dimension d_ff
  vocab     the vocabulary
  position  rows of a learned position table
  token_type  rows of a token-type table (BERT's segments)
  relpos_buckets  buckets of relative distance (T5's relative position bias)
  stack     the q/k/v index of a fused projection
"""

from __future__ import annotations

from typing import Callable, Optional

import flax.linen as nn
import jax


class Named(nn.LogicallyPartitioned):
  """A parameter boxed with its logical axis names, which unboxes to the bare array.

  flax's `LogicallyPartitioned` also adds a sharding constraint when unboxed under a mesh; here
  parameters are placed by the shardings of the jit that creates or updates them, and
  `nn.DenseGeneral` unboxes its initial kernel while it still has the flat 2-D shape that the
  names do not fit (which fails under a mesh).
  """

  def unbox(self, apply_constraint: bool = True):
    del apply_constraint
    return self.value


def param_init(init: Callable, *names: Optional[str]) -> Callable:
  """`init`, marked with the logical names of the dimensions of the parameter it creates."""

  def init_named(*args, **kwargs):
    return Named(init(*args, **kwargs), names)

  return init_named


def constrain(x: jax.Array, *names: Optional[str]) -> jax.Array:
  """x, constrained to the sharding its logical dimension names map to (a no-op unless a mesh
  and the rules are in context)."""
  return nn.with_logical_constraint(x, names)
