"""The model: its config, positions, attention and masks, layers, the three architectures (the
encoder-decoder Transformer, DecoderOnly, EncoderOnly), FLOP counts.

Imports flow one way inside: config <- positions <- attention <- layers <- transformer; flops
needs only the config.
"""

from transformer_jax.model.config import CHOICES, ModelConfig
from transformer_jax.model.transformer import (
                                               DecoderOnly,
                                               EncoderOnly,
                                               Transformer,
                                               count_params,
                                               describe,
                                               init_boxed_params,
                                               init_params,
                                               make_model,
                                               output_layer_params,
                                               param_shapes,
                                               shift_right,
)

__all__ = ["CHOICES", "DecoderOnly", "EncoderOnly", "ModelConfig", "Transformer", "count_params",
           "describe", "init_boxed_params", "init_params", "make_model", "output_layer_params",
           "param_shapes", "shift_right"]
