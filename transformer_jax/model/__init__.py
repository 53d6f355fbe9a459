"""The model: its config, attention and masks, positions, layers, the Transformer, FLOP counts.

Imports flow one way inside: config <- attention <- positions, layers <- transformer; flops
needs only the config.
"""

from transformer_jax.model.config import CHOICES, ModelConfig
from transformer_jax.model.transformer import (
                                               Transformer,
                                               count_params,
                                               describe,
                                               init_boxed_params,
                                               init_params,
                                               param_shapes,
                                               shift_right,
)

__all__ = ["CHOICES", "ModelConfig", "Transformer", "count_params", "describe",
           "init_boxed_params", "init_params", "param_shapes", "shift_right"]
