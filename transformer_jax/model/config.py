"""ModelConfig: everything that fixes the model's shape and arithmetic.

It imports no model code, so every module of the model (and every layer above) can import it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax.numpy as jnp

from transformer_jax.core.errors import UserError

# The allowed values of every string option; `transformer_jax.config` extends this table with the
# experiment's other options, so all choices are listed in one place.
CHOICES = {
    # encoder_decoder: the paper's; decoder_only: one causal stack (GPT); encoder_only: one
    # bidirectional stack (BERT).
    "arch": ("encoder_decoder", "decoder_only", "encoder_only"),
    # swiglu / geglu: the gated FFN (Shazeer, 2020): (act(x W_gate) * x W1) W2.
    # gelu: the tanh approximation (GPT-2's "gelu_new"); gelu_exact: x * Phi(x) with the error
  # function (BERT's "gelu"); silu: x * sigmoid(x), not gated (Marian's "swish").
  "activation": ("relu", "gelu", "gelu_exact", "silu", "swiglu", "geglu"),
    "norm": ("post", "pre"),
    "norm_type": ("layernorm", "rmsnorm"),
    # rotary: RoPE (Su et al., 2021) on queries and keys; relative_bias: T5's learned per-head
    # bias of bucketed relative distances; both leave the embeddings without positions. none:
    # no position information at all (NoPE; a causal stack still tells positions apart).
    # relative_xl: Transformer-XL's relative attention (Dai et al., 2019) in self-attention:
    # logits (q + u).k + (q + v).(W_r R_{i-j}), R sinusoids of the distance i - j.
    "positional": ("sinusoidal", "learned", "rotary", "relative_bias", "relative_xl", "none"),
    "init": ("xavier", "normal"),
    # see attention.dot_product_attention; cudnn: cuDNN's fused attention (NVIDIA GPUs only)
    "attention_impl": ("plain", "plain_bf16", "jax", "cudnn"),
    # softmax: the paper's; geometric: Csordas et al.'s geometric attention (the Neural Data
    # Router, 2022), each query takes the nearest key that matches (attention.
    # geometric_attention_weights). Self-attention only: cross-attention stays softmax.
    "self_attention": ("softmax", "geometric"),
    "dtype": ("float32", "bfloat16"),
  # The classification head's summary of a row: the mean over its real tokens, or the output at
  # its first token (BERT's [CLS]).
  "pooling": ("mean", "first"),
    # transformer.REMAT_POLICIES
    "remat": ("none", "full", "dots", "dots_all", "qkv_out", "block_out"),
    # the generator of dropout's random bits (attention.GENERATORS says what each one means)
    "dropout_rng": ("threefry", "rbg", "unsafe_rbg"),
    # length_head: each source token's share of the output length, from z = w . h_i + b.
    # softplus: softplus(z), shares that add up as the parts of the source do. exp: exp(z), so
    # that what the context adds to z multiplies the share (a count such as "three times"
    # multiplies a phrase's length instead of adding a fixed number of tokens).
    "length_head_share": ("softplus", "exp"),
}


def check_attention_dropout(implementation: str, rate: float) -> None:
  """Refuses attention-weight dropout with the fused implementations. jax.nn.
  dot_product_attention ("jax", "cudnn") takes no dropout at all; cuDNN's own dropout (JAX's
  private cuDNN module) takes its rate and seed as Python numbers written into the compiled
  call: another rate or seed would compile another program (the step's are inputs), and its
  masks are cuDNN's, not a function of the step's key (docs/benchmarks.md, "GPU levers")."""
  if implementation in ("jax", "cudnn") and rate > 0.0:
    raise UserError(f"model.attention_impl={implementation!r} has no attention-weight dropout; "
                    "set model.attention_dropout_rate=0 or model.attention_impl='plain'")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Everything that fixes the model's shape and arithmetic. Immutable; vary with `.replace()`."""

  vocab_size: int  # embedding rows: at least the tokenizer's pieces (special tokens included)
  arch: str = "encoder_decoder"  # encoder_decoder (the paper) | decoder_only (GPT) | encoder_only
  d_model: int = 512  # width of the residual stream (embeddings and every layer's output)
  num_heads: int = 8  # attention heads; head_dim = d_model / num_heads, or head_size
  # > 0: the width of each head's queries, keys and values (T5's d_kv), independent of d_model
  # (num_heads * head_size need not be d_model); 0: d_model / num_heads.
  head_size: int = 0
  num_kv_heads: int = 0  # key/value heads (grouped-query attention); 0 = num_heads
  num_encoder_layers: int = 6  # layers of the encoder stack (encoder_decoder, encoder_only)
  num_decoder_layers: int = 6  # layers of the decoder stack (encoder_decoder, decoder_only)
  d_ff: int = 2048  # hidden units of the position-wise feed-forward network
  dropout_rate: float = 0.1  # residual dropout: embeddings and every sublayer output
  attention_dropout_rate: float = 0.0  # on attention weights
  activation: str = "relu"  # of the feed-forward network: relu | gelu | silu | swiglu | geglu
  norm: str = "post"  # "post" = the paper's LayerNorm(x + Sublayer(x)); "pre" = x + Sublayer(LN(x))
  norm_type: str = "layernorm"  # layernorm | rmsnorm
  # True: the sublayers of a layer read the same input and their outputs are summed
  # (GPT-J, PaLM): x + Attention(LN(x)) + FFN(LN(x)) pre-LN, LN(x + Attention(x) + FFN(x)) post-LN.
  parallel_block: bool = False
  # True: each stack has one layer's parameters, applied num_*_layers times (the universal
  # Transformer of Dehghani et al., 2019, without adaptive computation time).
  share_layers: bool = False
  # True: every residual block chooses per position and channel between its input and the
  # sublayer's output, g * u + (1 - g) * x, a learned sigmoid gate g of the sublayer's input
  # (the copy gate of Csordas et al.'s Neural Data Router, 2022; layers.Residual). False: x + u.
  residual_gate: bool = False
  # encoder_decoder: True adds a head that predicts the target's length (EOS not counted) from
  # the encoder's output: a sum over the source tokens of softplus(w . h_i + b), each token's
  # share of the output (the fertility of non-autoregressive translation, Gu et al., 2018).
  # Trained with train.length_loss_weight; eval.length_head decodes outputs of that length.
  length_head: bool = False
  # With length_head: True reads the encoder's output through a stop-gradient, so the length
  # loss trains the head alone and the encoder and decoder learn as they would without it.
  length_head_stop_gradient: bool = False
  length_head_share: str = "softplus"  # with length_head: how z_i becomes a share (see CHOICES)
  self_attention: str = "softmax"  # (see CHOICES)
  positional: str = "sinusoidal"  # (see CHOICES)
  position_base: float = 10000.0  # sinusoidal, rotary and relative_xl: the base of the wavelengths
  relative_buckets: int = 32  # relative_bias: buckets of the relative distance (per direction
  relative_max_distance: int = 128  # in an encoder); beyond max_distance all share the last one
  max_len: int = 256  # longest sequence the positions (and decoding) allow
  # > 0: in training, each row's positions are a sorted random subset of [0, this) (Ruoss et al.,
  # 2023), so that the positions of longer test sequences were all seen; at least max_len.
  # Evaluation and decoding use 0, 1, ... unless random_positions_eval. 0 = off.
  random_positions_max: int = 0
  # With random_positions_max: evaluation and decoding draw positions too, as Ruoss et al. do at
  # test time: each row a sorted random subset of max_len positions from a fixed key (the same
  # draw for every call and decoding step of a batch row; deterministic, not seeded by the run).
  random_positions_eval: bool = False
  embed_scale: bool = True  # token embeddings times sqrt(d_model), as the paper (not GPT-2, BERT)
  # > 0: a learned table of that many token types (BERT's segment A/B) whose row 0 is added to
  # every token's embedding: the model reads one segment, as BERT does a single sentence.
  type_vocab_size: int = 0
  embed_norm: bool = False  # a norm of the summed embeddings before the first layer (BERT)
  share_embeddings: bool = True  # one table for source and target tokens
  tie_output: bool = True  # the output projection is the (target) embedding table transposed
  logits_bias: bool = False  # a learned bias on the decoder's logits (Marian's final_logits_bias)
  # BOS embeds as a zero vector (its row of a tied table also gives it zero logits): the decoder
  # starts from zeros, as Marian's does and CTranslate2 assumes of every Marian model.
  zero_bos_embedding: bool = False
  # Ids of vocabulary rows that never receive probability: their logits are -inf wherever the
  # model outputs logits (training, evaluation, scoring, decoding). An imported model's rows that
  # its original vocabulary lacks (a new padding row, a special token's copy); () = all real.
  excluded_rows: tuple = ()
  # (token, row) pairs: the token embeds as another row (its own row unread), so that two ids of
  # ours that are one token of an imported model's (GPT-2's BOS and <|endoftext|>) share one
  # row, and its gradient, as in the original; () = every token its own row.
  row_copies: tuple = ()
  fused_qkv: bool = False  # one matmul for queries, keys and values (another parameter layout)
  qkv_bias: bool = True  # biases on the query, key and value projections
  # False: no bias in any other dense layer (attention output, FFN, an untied output layer, the
  # encoder-only heads) nor in LayerNorm (Llama, T5); the q/k/v biases follow model.qkv_bias.
  use_bias: bool = True
  init: str = "xavier"  # parameter init: xavier (uniform, the paper's) | normal (GPT-2's 0.02)
  # plain (ours, with dropout) | plain_bf16 (plain; under dtype=bfloat16 the backward pass keeps
  # bfloat16 attention weights, not float32 ones) | jax (jax.nn.dot_product_attention, XLA's) |
  # cudnn (its cuDNN flash attention: NVIDIA GPUs, bfloat16, no attention-weight dropout)
  attention_impl: str = "plain"
  layer_norm_eps: float = 1e-6  # epsilon of LayerNorm / RMSNorm
  dtype: str = "float32"  # compute dtype; parameters stay float32
  remat: str = "none"  # recompute layer activations in the backward pass (CHOICES)
  # dropout's random bits: threefry (the default: the same masks on any mesh and backend) | rbg |
  # unsafe_rbg (attention.GENERATORS)
  dropout_rng: str = "threefry"
  num_labels: int = 0  # encoder_only: > 0 adds a sequence-classification head of that many classes
  pooling: str = "mean"  # the classification head's summary of a row (see CHOICES)
  deterministic: bool = False  # True disables dropout (evaluation, decoding)
  decode: bool = False  # True: incremental decoding with a KV cache

  @property
  def compute_dtype(self):
    return jnp.dtype(self.dtype)

  @property
  def head_dim(self) -> int:
    """The width of each head's queries, keys and values: model.head_size, or d_model /
    num_heads."""
    return self.head_size or self.d_model // self.num_heads

  @property
  def kv_heads(self) -> int:
    """Heads of the keys and values: num_kv_heads, or num_heads (multi-head attention)."""
    return self.num_kv_heads or self.num_heads

  @property
  def gated(self) -> bool:
    return self.activation in ("swiglu", "geglu")

  @property
  def draws_positions(self) -> bool:
    """Whether this model's positions are a random draw from [0, random_positions_max): in
    training, and with random_positions_eval in evaluation and decoding too."""
    return bool(self.random_positions_max) and (not self.deterministic
                                                or self.random_positions_eval)

  def replace(self, **changes) -> "ModelConfig":
    return dataclasses.replace(self, **changes)

  def validate(self) -> "ModelConfig":
    """Raises UserError naming the first impossible value."""
    positive = ("vocab_size", "d_model", "num_heads", "d_ff", "max_len")
    for name in positive:
      if getattr(self, name) <= 0:
        raise UserError(f"model.{name} must be positive, got {getattr(self, name)}")
    for name in ("num_encoder_layers", "num_decoder_layers"):
      if getattr(self, name) < 0:
        raise UserError(f"model.{name} must be >= 0, got {getattr(self, name)}")
    if self.head_size < 0:
      raise UserError(f"model.head_size must be >= 0 (0 = model.d_model / model.num_heads), got "
                      f"{self.head_size}")
    if not self.head_size and self.d_model % self.num_heads:
      raise UserError(f"model.d_model ({self.d_model}) must be divisible by model.num_heads "
                      f"({self.num_heads}); change one of them, or set model.head_size")
    if self.positional in ("sinusoidal", "relative_xl") and self.d_model % 2:
      raise UserError(f"model.d_model ({self.d_model}) must be even for {self.positional} "
                      "positions")
    for name in ("dropout_rate", "attention_dropout_rate"):
      value = getattr(self, name)
      if not 0.0 <= value < 1.0:
        raise UserError(f"model.{name} must be in [0, 1), got {value}")
    for name, choices in CHOICES.items():
      if getattr(self, name) not in choices:
        raise UserError(f"model.{name} must be one of {', '.join(choices)}; "
                        f"got {getattr(self, name)!r}")
    check_attention_dropout(self.attention_impl, self.attention_dropout_rate)
    if self.attention_impl == "cudnn" and self.dtype != "bfloat16":
      raise UserError("model.attention_impl='cudnn' runs cuDNN's fused attention, on NVIDIA GPUs "
                      f"in bfloat16, and model.dtype is {self.dtype} (auto is float32 on a "
                      "CPU); set model.dtype=bfloat16 on a GPU, or another attention_impl")
    for name in ("qkv_bias", "use_bias"):
      if not isinstance(getattr(self, name), bool):
        raise UserError(f"model.{name} must be True or False, got {getattr(self, name)!r}")
    if self.position_base <= 1.0:
      raise UserError(f"model.position_base must be > 1, got {self.position_base}")
    self._validate_options()
    return self

  def _validate_options(self) -> None:
    """The architecture, attention and position options and the pairs of them that clash."""
    if self.num_kv_heads < 0 or (self.num_kv_heads and self.num_heads % self.num_kv_heads):
      raise UserError(f"model.num_kv_heads ({self.num_kv_heads}) must divide model.num_heads "
                      f"({self.num_heads}) (0 = as many as num_heads)")
    if self.fused_qkv and self.kv_heads != self.num_heads:
      raise UserError("model.fused_qkv stacks queries, keys and values of as many heads; with "
                      "model.num_kv_heads set, use model.fused_qkv=False")
    if self.positional == "rotary" and self.head_dim % 2:
      raise UserError(f"rotary positions need an even head_dim, got {self.head_dim} "
                      "(model.head_size, or model.d_model / model.num_heads)")
    if self.relative_buckets < 2 or self.relative_max_distance < self.relative_buckets:
      raise UserError(f"model.relative_buckets ({self.relative_buckets}) must be >= 2 and at "
                      f"most model.relative_max_distance ({self.relative_max_distance})")
    if self.type_vocab_size < 0:
      raise UserError(f"model.type_vocab_size must be >= 0 (0 = no token types), got "
                      f"{self.type_vocab_size}")
    if self.num_labels < 0 or (self.num_labels and self.arch != "encoder_only"):
      raise UserError(f"model.num_labels ({self.num_labels}) is for model.arch=encoder_only "
                      "(a classification head); leave it 0 otherwise")
    if self.random_positions_max and self.positional == "none":
      raise UserError("model.random_positions_max draws positions, which model.positional=none "
                      "never reads; set model.random_positions_max=0 or choose positions")
    if self.random_positions_eval and not self.random_positions_max:
      raise UserError("model.random_positions_eval draws evaluation positions from [0, "
                      "model.random_positions_max), which is 0 (off); set it (e.g. 4 x max_len)")
    if self.random_positions_max and self.random_positions_max < self.max_len:
      raise UserError(f"model.random_positions_max ({self.random_positions_max}) must be at least "
                      f"model.max_len ({self.max_len}), or 0 (off)")
    if self.length_head and self.arch != "encoder_decoder":
      raise UserError(f"model.length_head reads the encoder's output, which model.arch="
                      f"{self.arch} lacks; set model.length_head=False or use encoder_decoder")
    if self.length_head_stop_gradient and not self.length_head:
      raise UserError("model.length_head_stop_gradient is about model.length_head's input, and "
                      "the head is off; set model.length_head=True or leave this False")
    if self.length_head_share != "softplus" and not self.length_head:
      raise UserError("model.length_head_share is how model.length_head turns each token's "
                      "score into its share, and the head is off; set model.length_head=True "
                      "or leave it softplus")
    if self.logits_bias and self.arch == "encoder_only":
      raise UserError("model.logits_bias is a bias of the decoder's logits; an encoder_only model "
                      "has its head's own bias (set model.logits_bias=False)")
    rows = self.excluded_rows
    if not isinstance(rows, tuple) or not all(
        isinstance(r, int) and 0 <= r < self.vocab_size for r in rows) or len(set(rows)) != len(
        rows) or len(rows) >= self.vocab_size:
      raise UserError(f"model.excluded_rows must be distinct row ids in [0, model.vocab_size="
                      f"{self.vocab_size}) leaving at least one row, got {rows!r}")
    pairs = self.row_copies
    if not isinstance(pairs, tuple) or not all(
        isinstance(p, tuple) and len(p) == 2 and all(
            isinstance(i, int) and 0 <= i < self.vocab_size for i in p) for p in pairs):
      raise UserError(f"model.row_copies must be (token, row) pairs of ids in [0, "
                      f"model.vocab_size={self.vocab_size}), got {pairs!r}")
    stack = {"decoder_only": "num_decoder_layers", "encoder_only": "num_encoder_layers"}
    if self.arch in stack and getattr(self, stack[self.arch]) == 0:
      raise UserError(f"model.arch={self.arch} needs model.{stack[self.arch]} > 0")

  @classmethod
  def from_dict(cls, values: Mapping[str, Any]) -> "ModelConfig":
    """Builds and validates a ModelConfig from a mapping (e.g. `config.model`)."""
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - fields)
    if unknown:
      raise UserError(f"unknown model config key(s): {', '.join('model.' + k for k in unknown)}")
    values = dict(values)
    if isinstance(values.get("excluded_rows"), list):  # as JSON writes a tuple
      values["excluded_rows"] = tuple(values["excluded_rows"])
    if isinstance(values.get("row_copies"), (list, tuple)):
      values["row_copies"] = tuple(tuple(pair) if isinstance(pair, list) else pair
                                   for pair in values["row_copies"])
    return cls(**values).validate()
