"""What maps to what, as data: for each Hugging Face architecture, its config fields and our model
options, and its tensors and our parameters, each with the transform between the two.

`convert.py` reads these tables in both directions; nothing here knows about files. A tensor's
shape is checked against the one its transform expects from our parameter's shape (itself from
the mapped config), so weights that disagree with their config.json are refused by name.

Tensor names are the full names of the HF class's `state_dict`; `{i}` stands for a layer's
index, in theirs and ours. Our parameter paths are '/'-joined (see `model.param_shapes`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, NamedTuple, Optional

import numpy as np

# ----------------------------------------------------------------------------- the vocabulary


class Vocab(NamedTuple):
  """How our token ids relate to theirs. Our ids 0, 1, 2 (and 3, 4 in an encoder-only model) are
  the project's pad, BOS, EOS (unknown, <mask>) (`core/tokens.py`): the model's own special
  tokens move there, and a special it lacks gets a row of its own (GPT-2 has no padding).

  hf_ids: int `[our vocab]`, the HF row each of our rows comes from (-1: a new row of zeros; a
    row may repeat another's: GPT-2's BOS starts as a copy of its <|endoftext|>).
  our_ids: int `[their vocab]`, our row that each HF row becomes (and returns from).
  """

  hf_ids: np.ndarray
  our_ids: np.ndarray

  def to_ours(self, hf_table: np.ndarray) -> np.ndarray:
    """Rows (or entries) in our order: `[their vocab, ...]` -> `[our vocab, ...]`."""
    rows = hf_table[np.maximum(self.hf_ids, 0)]
    rows[self.hf_ids < 0] = 0
    return rows

  def to_hf(self, table: np.ndarray) -> np.ndarray:
    return table[self.our_ids]

  def copies(self) -> tuple:
    """(our row, the row of ours that owns the same row of theirs) of every copy: as
    model.row_copies, the copy reads its owner's row."""
    return tuple((int(r), int(self.our_ids[h])) for r, h in enumerate(self.hf_ids)
                 if h >= 0 and self.our_ids[h] != r)

  def extra_rows(self) -> tuple:
    """Our rows that are no row of theirs (a new row, or a copy of a row another of ours
    owns): model.excluded_rows, so that they never take probability from their rows."""
    return tuple(int(r) for r, h in enumerate(self.hf_ids) if h < 0 or self.our_ids[h] != r)


def vocab_layout(hf_vocab_size: int, specials: dict, slots: tuple) -> Vocab:
  """Our vocabulary: the `slots` (our special ids, in order 0, 1, ...: names of `specials`),
  then every other HF row in its order.

  specials: {name: HF id or None}. When two names share an HF id (GPT-2's bos and eos), the one
  listed first in OWNERS owns the row; the other gets a copy of it.
  """
  hf_ids, owner = [-1] * len(slots), {}
  for name in sorted(slots, key=OWNERS.index):
    hf_id = specials.get(name)
    if hf_id is not None:
      hf_ids[slots.index(name)] = hf_id
      owner.setdefault(hf_id, slots.index(name))
  rest = [h for h in range(hf_vocab_size) if h not in owner]
  hf_ids = np.asarray(hf_ids + rest, np.int64)
  our_ids = np.empty(hf_vocab_size, np.int64)
  our_ids[rest] = np.arange(len(slots), len(hf_ids))
  for hf_id, ours in owner.items():
    our_ids[hf_id] = ours
  return Vocab(hf_ids, our_ids)


# Who keeps a row that two specials share: GPT-2's <|endoftext|> is its EOS, also when it
# doubles as BOS or as the padding of a fine-tuning recipe (our padding row is then a copy).
OWNERS = ("eos", "unk", "mask", "bos", "pad")
DECODER_SLOTS = ("pad", "bos", "eos")  # our ids 0, 1, 2
ENCODER_SLOTS = ("pad", "bos", "eos", "unk", "mask")  # 0..4; BERT's bos/eos are [CLS]/[SEP]


# ----------------------------------------------------------------------------- tensor transforms


class Transform(NamedTuple):
  """A tensor of theirs <-> one or more parameters of ours.

  hf_shape(shapes, vocab): the shape their tensor must have, given ours.
  to_ours(tensor, shapes, vocab): our parameters, a list in the rule's order.
  to_hf(arrays, vocab): their tensor.
  """

  hf_shape: Callable
  to_ours: Callable
  to_hf: Callable


def _size(shape) -> int:
  return math.prod(shape)


def linear(n_in: int = 1) -> Transform:
  """torch.nn.Linear's weight `[out, in]` <-> a kernel whose first n_in axes are the input."""
  return Transform(
      lambda s, v: (_size(s[0][n_in:]), _size(s[0][:n_in])),
      lambda w, s, v: [w.T.reshape(s[0])],
      lambda a, v: a[0].reshape(_size(a[0].shape[:n_in]), -1).T)


def conv1d(n_in: int = 1) -> Transform:
  """GPT-2's Conv1D weight `[in, out]` (a Linear stored transposed) <-> a kernel."""
  return Transform(
      lambda s, v: (_size(s[0][:n_in]), _size(s[0][n_in:])),
      lambda w, s, v: [w.reshape(s[0])],
      lambda a, v: a[0].reshape(_size(a[0].shape[:n_in]), -1))


def fused_conv1d() -> Transform:
  """GPT-2's c_attn `[d, 3 d]` (queries, keys, values side by side) <-> three kernels
  `[d, heads, head_dim]`."""
  return Transform(
      lambda s, v: (s[0][0], sum(_size(x[1:]) for x in s)),
      lambda w, s, v: [part.reshape(x) for part, x in
                       zip(np.split(w, np.cumsum([_size(x[1:]) for x in s])[:-1], axis=1), s)],
      lambda a, v: np.concatenate([x.reshape(x.shape[0], -1) for x in a], axis=1))


def fused_vector() -> Transform:
  """GPT-2's c_attn bias `[3 d]` <-> three biases `[heads, head_dim]`."""
  return Transform(
      lambda s, v: (sum(_size(x) for x in s),),
      lambda w, s, v: [part.reshape(x) for part, x in
                       zip(np.split(w, np.cumsum([_size(x) for x in s])[:-1]), s)],
      lambda a, v: np.concatenate([x.reshape(-1) for x in a]))


VECTOR = Transform(lambda s, v: (_size(s[0]),), lambda w, s, v: [w.reshape(s[0])],
                   lambda a, v: a[0].reshape(-1))
TABLE = Transform(lambda s, v: tuple(s[0]), lambda w, s, v: [w], lambda a, v: a[0])
VOCAB = Transform(lambda s, v: (len(v.our_ids),) + tuple(s[0][1:]),
                  lambda w, s, v: [v.to_ours(w)], lambda a, v: v.to_hf(a[0]))
# An untied output layer: torch.nn.Linear `[their vocab, d]` <-> our kernel `[d, our vocab]`.
VOCAB_OUT = Transform(lambda s, v: (len(v.our_ids), s[0][0]),
                      lambda w, s, v: [v.to_ours(w).T], lambda a, v: v.to_hf(a[0].T))


BIAS_ROW = Transform(lambda s, v: (1, len(v.our_ids)), lambda w, s, v: [v.to_ours(w[0])],
                    lambda a, v: v.to_hf(a[0])[None])  # Marian's final_logits_bias `[1, vocab]`


class Rule(NamedTuple):
  hf: str  # their tensor's name
  ours: tuple  # our parameter path(s)
  transform: Transform
  when: Optional[str] = None  # a boolean model option: the rule holds when it is True ("not X":
  # when it is False), e.g. Llama's lm_head.weight only with an untied output layer
  # True: a tensor that may be absent (read as zeros), for a parameter of ours that may be
  # absent too (written as zeros): Marian's final_logits_bias, our model.logits_bias.
  optional: bool = False


def norm(hf: str, ours: str) -> tuple:
  """A LayerNorm: their weight and bias, our scale and bias."""
  return (Rule(f"{hf}.weight", (f"{ours}/scale",), VECTOR),
          Rule(f"{hf}.bias", (f"{ours}/bias",), VECTOR))


def dense(hf: str, ours: str, transform: Transform) -> tuple:
  """A dense layer: their weight and bias, our kernel and bias."""
  return (Rule(f"{hf}.weight", (f"{ours}/kernel",), transform),
          Rule(f"{hf}.bias", (f"{ours}/bias",), VECTOR))


# ----------------------------------------------------------------------------- config fields


class Field(NamedTuple):
  """Our option `ours` <-> their config field `hf`.

  values: {their value: ours} for a choice (a value outside it cannot be mapped); None: the
    same number; COUNT: ours is the number of their entries (id2label -> num_labels).
  default: their value when the field is absent (a callable of their config).
  """

  ours: str
  hf: str
  values: Optional[dict] = None
  default: object = None


COUNT = "count"


@dataclasses.dataclass(frozen=True)
class Head:
  """One HF class of an architecture: its tensors beyond the base model's, our options that
  go with it, and the data task our workdir trains it on."""

  hf_class: str
  task: str
  rules: tuple
  fixed: dict
  fields: tuple = ()


@dataclasses.dataclass(frozen=True)
class Architecture:
  model_type: str
  prefix: str  # the base model's name prefix in the HF class's state_dict
  fields: tuple  # Field rules
  fixed: dict  # our options that this architecture always has (export refuses others)
  required: dict  # their config fields we cannot map unless they have this value (or default)
  layer_rules: tuple  # per layer, `{i}` in the names
  rules: tuple  # the rest of the base model
  heads: tuple  # Head, by HF class
  special_tokens: dict  # {our special: their default token} (tokenizer_config.json overrides)
  slots: tuple  # our special ids, in order
  add_bos: bool  # whether its tokenizer starts a text with BOS (BERT's [CLS]); GPT-2's does not
  ignored: tuple  # regular expressions of their tensors that hold no parameter (buffers, ties)
  # Checks of their config beyond `required`: callables of it returning what we cannot map (a
  # sentence naming the field), or None.
  checks: tuple = ()
  # Their config fields that export derives from our model (not read on import), e.g. Llama's
  # head_dim: {their field: callable of our ModelConfig}.
  derived: tuple = ()
  # Our options that an import sets but export does not require (Llama's dropout 0; Marian's
  # logits bias: a model without one exports a bias of zeros).
  imported: dict = dataclasses.field(default_factory=dict)
  # A decoder-only model's prompt starts with BOS (Llama's <s>; GPT-2's none). Its texts are
  # encoded without it (add_bos False): our pipeline and decoding put BOS first themselves.
  prompt_bos: bool = False
  # Pairs of their config fields that must be equal, the first mapped by `fields` (Marian's
  # encoder and decoder heads: model.num_heads is one number for both stacks).
  same: tuple = ()
  # Their sinusoidal table has the sines in the first half of the features and the cosines in
  # the second (Marian); ours interleaves them. The two models are the same function once the
  # features of the residual stream are permuted, which import and export do (convert.py).
  sinusoid_halves: bool = False
  tokenizer: str = "tokenizers"  # tokenizer.json; "sentencepiece": source.spm, target.spm,
  # vocab.json (Marian's); "t5": spiece.model (else tokenizer.json) with T5's sentinel tokens
  # Their tensors that a checkpoint may lack, read as a copy of another: (missing, source).
  # transformers 5 saves a freshly built T5 with its lm_head tied to shared.weight and writes
  # that table once; the head is then the embedding, untied from here on.
  aliases: tuple = ()
  # Export: the names of our special tokens in a tokenizer.json model's tokenizer_config.json
  # (BERT's [CLS] and [SEP] are its cls_token and sep_token; T5 has no BOS token: ours is its
  # decoder start, its <pad>), and whether its unk_token is the EOS token (GPT-2's is).
  token_names: dict = dataclasses.field(default_factory=lambda: dict(TOKEN_NAMES))
  eos_as_unk: bool = False
  # Export of an imported tokenizer: the id written as their BOS. "eos": their EOS (GPT-2's
  # <|endoftext|> is both); "always": the row our BOS came from (Marian's and T5's decoder
  # start); "if_any": that row when the tokenizer has one (Llama's <s>); None: no BOS id.
  export_bos: Optional[str] = None
  # The decoder starts from our BOS, and no BOS comes before a source: export writes our BOS as
  # decoder_start_token_id, not bos_token_id (Marian, T5).
  bos_is_decoder_start: bool = False
  forced_eos: bool = False  # export writes forced_eos_token_id: the EOS (Marian's config does)
  # A model trained here exports with its padding in the last row, where Marian keeps <pad>
  # (CTranslate2's converter drops that row): ours 0 -> theirs V-1, ours i -> i - 1.
  pad_last: bool = False


# tokenizer_config.json's names of our special tokens (Architecture.token_names).
TOKEN_NAMES = {"pad": "pad_token", "unk": "unk_token", "mask": "mask_token", "bos": "bos_token",
               "eos": "eos_token"}


# HF activation names <-> ours. GPT-2's "gelu_new" and "gelu_pytorch_tanh" are the tanh
# approximation; BERT's "gelu" the error function.
ACTIVATIONS = {"gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "gelu": "gelu_exact",
               "relu": "relu"}

GPT2 = Architecture(
    model_type="gpt2",
    prefix="transformer.",
    fields=(Field("d_model", "n_embd"), Field("num_heads", "n_head"),
            Field("num_decoder_layers", "n_layer"), Field("max_len", "n_positions"),
            Field("d_ff", "n_inner", default=lambda c: 4 * c["n_embd"]),
            Field("layer_norm_eps", "layer_norm_epsilon", default=1e-5),
            Field("activation", "activation_function", ACTIVATIONS, "gelu_new"),
            Field("dropout_rate", "resid_pdrop", default=0.1),
            Field("attention_dropout_rate", "attn_pdrop", default=0.1)),
    fixed=dict(arch="decoder_only", num_encoder_layers=0, norm="pre", norm_type="layernorm",
               positional="learned", embed_scale=False, tie_output=True, qkv_bias=True,
               num_kv_heads=0, parallel_block=False, type_vocab_size=0, embed_norm=False,
               use_bias=True, logits_bias=False),
    required=dict(tie_word_embeddings=True, scale_attn_weights=True,
                  scale_attn_by_inverse_layer_idx=False, add_cross_attention=False),
    layer_rules=(
        *norm("transformer.h.{i}.ln_1", "decoder/layer_{i}/self_attention_block/norm"),
        Rule("transformer.h.{i}.attn.c_attn.weight",
             tuple(f"decoder/layer_{{i}}/self_attention/{x}/kernel"
                   for x in ("query", "key", "value")), fused_conv1d()),
        Rule("transformer.h.{i}.attn.c_attn.bias",
             tuple(f"decoder/layer_{{i}}/self_attention/{x}/bias"
                   for x in ("query", "key", "value")), fused_vector()),
        *dense("transformer.h.{i}.attn.c_proj", "decoder/layer_{i}/self_attention/out",
               conv1d(2)),
        *norm("transformer.h.{i}.ln_2", "decoder/layer_{i}/ffn_block/norm"),
        *dense("transformer.h.{i}.mlp.c_fc", "decoder/layer_{i}/ffn/wi", conv1d()),
        *dense("transformer.h.{i}.mlp.c_proj", "decoder/layer_{i}/ffn/wo", conv1d()),
    ),
    rules=(Rule("transformer.wte.weight", ("token_embedding/embedding",), VOCAB),
           Rule("transformer.wpe.weight", ("decoder/positions/table",), TABLE),
           *norm("transformer.ln_f", "decoder/final_norm")),
    heads=(Head("GPT2LMHeadModel", "lm", (), dict(num_labels=0)),),
    special_tokens={"bos": "<|endoftext|>", "eos": "<|endoftext|>"},
    slots=DECODER_SLOTS,
    add_bos=False,
    ignored=(r"\.attn\.(masked_)?bias$", r"^lm_head\.weight$"),
    derived=(("embd_pdrop", lambda m: m.dropout_rate),),
    eos_as_unk=True,
    export_bos="eos",
)


def _bert_layer(i: str = "{i}") -> tuple:
  base, ours = f"bert.encoder.layer.{i}", f"encoder/layer_{i}"
  return (*dense(f"{base}.attention.self.query", f"{ours}/self_attention/query", linear()),
          *dense(f"{base}.attention.self.key", f"{ours}/self_attention/key", linear()),
          *dense(f"{base}.attention.self.value", f"{ours}/self_attention/value", linear()),
          *dense(f"{base}.attention.output.dense", f"{ours}/self_attention/out", linear(2)),
          *norm(f"{base}.attention.output.LayerNorm", f"{ours}/attention_block/norm"),
          *dense(f"{base}.intermediate.dense", f"{ours}/ffn/wi", linear()),
          *dense(f"{base}.output.dense", f"{ours}/ffn/wo", linear()),
          *norm(f"{base}.output.LayerNorm", f"{ours}/ffn_block/norm"))


BERT = Architecture(
    model_type="bert",
    prefix="bert.",
    fields=(Field("d_model", "hidden_size"), Field("num_heads", "num_attention_heads"),
            Field("num_encoder_layers", "num_hidden_layers"),
            Field("max_len", "max_position_embeddings"), Field("d_ff", "intermediate_size"),
            Field("layer_norm_eps", "layer_norm_eps", default=1e-12),
            Field("type_vocab_size", "type_vocab_size", default=2),
            Field("activation", "hidden_act", ACTIVATIONS, "gelu"),
            Field("dropout_rate", "hidden_dropout_prob", default=0.1),
            Field("attention_dropout_rate", "attention_probs_dropout_prob", default=0.1)),
    fixed=dict(arch="encoder_only", num_decoder_layers=0, norm="post", norm_type="layernorm",
               positional="learned", embed_scale=False, tie_output=True, qkv_bias=True,
               num_kv_heads=0, parallel_block=False, embed_norm=True, use_bias=True),
    required=dict(tie_word_embeddings=True, position_embedding_type="absolute",
                  is_decoder=False, add_cross_attention=False),
    layer_rules=_bert_layer(),
    rules=(Rule("bert.embeddings.word_embeddings.weight", ("token_embedding/embedding",), VOCAB),
           Rule("bert.embeddings.position_embeddings.weight", ("encoder/positions/table",),
                TABLE),
           Rule("bert.embeddings.token_type_embeddings.weight",
                ("encoder/token_types/embedding",), TABLE),
           *norm("bert.embeddings.LayerNorm", "encoder/embed_norm")),
    heads=(
        Head("BertForMaskedLM", "mlm",
             (*dense("cls.predictions.transform.dense", "mlm_dense", linear()),
              *norm("cls.predictions.transform.LayerNorm", "mlm_norm"),
              Rule("cls.predictions.bias", ("mlm_bias",), VOCAB)),
             dict(num_labels=0)),
        Head("BertForSequenceClassification", "classify",
             (*dense("bert.pooler.dense", "pooler", linear()),
              *dense("classifier", "classifier", linear())),
             dict(pooling="first"), (Field("num_labels", "id2label", COUNT, {"0": 0, "1": 1}),)),
    ),
    special_tokens={"pad": "[PAD]", "bos": "[CLS]", "eos": "[SEP]", "unk": "[UNK]",
                    "mask": "[MASK]"},
    slots=ENCODER_SLOTS,
    add_bos=True,
    ignored=(r"position_ids$", r"^cls\.predictions\.decoder\.(weight|bias)$",
             r"^cls\.seq_relationship\.", r"^bert\.pooler\."),
    token_names={**TOKEN_NAMES, "bos": "cls_token", "eos": "sep_token"},
)



def _rope(hf_config: dict) -> dict:
  """Their rotary settings: transformers 5's rope_parameters, or the top-level fields of older
  configs (rope_theta, rope_scaling)."""
  return hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {}


def _llama_checks(hf_config: dict):
  rope_type = _rope(hf_config).get("rope_type", _rope(hf_config).get("type", "default"))
  if rope_type != "default":
    return (f"rotary scaling {rope_type!r} (rope_parameters / rope_scaling; Llama 3.1 and "
            "later) has no model option here; only plain rotary positions (rope_type default) "
            "import")
  return None


def _llama_layer(i: str = "{i}") -> tuple:
  base, ours = f"model.layers.{i}", f"decoder/layer_{i}"
  return (
      Rule(f"{base}.input_layernorm.weight", (f"{ours}/self_attention_block/norm/scale",),
           VECTOR),
      *(Rule(f"{base}.self_attn.{x}_proj.weight", (f"{ours}/self_attention/{name}/kernel",),
             linear()) for x, name in (("q", "query"), ("k", "key"), ("v", "value"))),
      Rule(f"{base}.self_attn.o_proj.weight", (f"{ours}/self_attention/out/kernel",), linear(2)),
      Rule(f"{base}.post_attention_layernorm.weight", (f"{ours}/ffn_block/norm/scale",), VECTOR),
      # SwiGLU: down(silu(gate(x)) * up(x)); ours wo(swish(wi_gate(x)) * wi(x)).
      Rule(f"{base}.mlp.gate_proj.weight", (f"{ours}/ffn/wi_gate/kernel",), linear()),
      Rule(f"{base}.mlp.up_proj.weight", (f"{ours}/ffn/wi/kernel",), linear()),
      Rule(f"{base}.mlp.down_proj.weight", (f"{ours}/ffn/wo/kernel",), linear()))


# Llama (and the decoders that share its layout: Mistral without sliding windows, Llama 2, small
# Llama-architecture models). Rotary positions: HF's rotate_half pairs feature i with i + d/2,
# which is our model.positional=rotary layout, so q and k need no permutation.
LLAMA = Architecture(
    model_type="llama",
    prefix="model.",
    fields=(Field("d_model", "hidden_size"), Field("num_heads", "num_attention_heads"),
            # Their head_dim (absent in older configs: hidden_size / num_attention_heads) is our
            # model.head_size, 0 where it is that quotient (convert.py); export writes head_dim.
            Field("head_size", "head_dim", default=0),
            Field("num_kv_heads", "num_key_value_heads",
                  default=lambda c: c.get("num_attention_heads")),
            Field("num_decoder_layers", "num_hidden_layers"),
            Field("max_len", "max_position_embeddings", default=2048),
            Field("d_ff", "intermediate_size"),
            Field("layer_norm_eps", "rms_norm_eps", default=1e-6),
            Field("position_base", "rope_theta",
                  default=lambda c: _rope(c).get("rope_theta", 10000.0)),
            Field("activation", "hidden_act", {"silu": "swiglu"}, "silu"),
            Field("tie_output", "tie_word_embeddings", {False: False, True: True}, False),
            Field("attention_dropout_rate", "attention_dropout", default=0.0)),
    fixed=dict(arch="decoder_only", num_encoder_layers=0, norm="pre", norm_type="rmsnorm",
               positional="rotary", embed_scale=False, qkv_bias=False, use_bias=False,
               fused_qkv=False, parallel_block=False, type_vocab_size=0, embed_norm=False,
               logits_bias=False),
    required=dict(attention_bias=False, mlp_bias=False, add_cross_attention=False),
    layer_rules=_llama_layer(),
    rules=(Rule("model.embed_tokens.weight", ("token_embedding/embedding",), VOCAB),
           Rule("model.norm.weight", ("decoder/final_norm/scale",), VECTOR),
           Rule("lm_head.weight", ("decoder/logits/kernel",), VOCAB_OUT, when="not tie_output")),
    heads=(Head("LlamaForCausalLM", "lm", (), dict(num_labels=0)),),
    special_tokens={"bos": "<s>", "eos": "</s>"},
    slots=DECODER_SLOTS,
    add_bos=False,
    prompt_bos=True,
    ignored=(r"rotary_emb\.inv_freq$", r"^lm_head\.weight$"),
    checks=(_llama_checks,),
    derived=(("head_dim", lambda m: m.head_dim), ("num_key_value_heads", lambda m: m.kv_heads),
             ("rope_parameters", lambda m: {"rope_type": "default",
                                            "rope_theta": m.position_base}),
             ("rope_theta", lambda m: m.position_base), ("pretraining_tp", lambda m: 1)),
    imported=dict(dropout_rate=0.0),  # Llama has no residual dropout
    export_bos="if_any",
)

def _marian_attention(hf: str, ours: str) -> tuple:
  return tuple(rule for theirs, mine, transform in (
      ("q_proj", "query", linear()), ("k_proj", "key", linear()), ("v_proj", "value", linear()),
      ("out_proj", "out", linear(2))) for rule in dense(f"{hf}.{theirs}", f"{ours}/{mine}",
                                                         transform))


def _marian_ffn(hf: str, ours: str) -> tuple:
  return (*dense(f"{hf}.fc1", f"{ours}/ffn/wi", linear()),
          *dense(f"{hf}.fc2", f"{ours}/ffn/wo", linear()),
          *norm(f"{hf}.final_layer_norm", f"{ours}/ffn_block/norm"))


# Marian's activation names: "swish" is SiLU (written back as "swish", listed first); "gelu" the
# error-function form.
MARIAN_ACTIVATIONS = {"swish": "silu", "silu": "silu", "relu": "relu", "gelu": "gelu_exact",
                      "gelu_new": "gelu"}

MARIAN = Architecture(
    model_type="marian",
    prefix="model.",
    fields=(Field("d_model", "d_model"), Field("num_heads", "encoder_attention_heads"),
            Field("num_encoder_layers", "encoder_layers"),
            Field("num_decoder_layers", "decoder_layers"), Field("d_ff", "encoder_ffn_dim"),
            Field("max_len", "max_position_embeddings", default=1024),
            Field("activation", "activation_function", MARIAN_ACTIVATIONS, "gelu"),
            Field("embed_scale", "scale_embedding", default=False),
            Field("dropout_rate", "dropout", default=0.1),
            Field("attention_dropout_rate", "attention_dropout", default=0.0)),
    # post-LN, no final norm, no embedding norm; torch's LayerNorm epsilon (Marian has no field).
    fixed=dict(arch="encoder_decoder", norm="post", norm_type="layernorm",
               positional="sinusoidal", position_base=10000.0, share_embeddings=True,
               tie_output=True, qkv_bias=True, fused_qkv=False, num_kv_heads=0,
               parallel_block=False, type_vocab_size=0, embed_norm=False, layer_norm_eps=1e-5,
               use_bias=True),
    required=dict(share_encoder_decoder_embeddings=True, tie_word_embeddings=True),
    layer_rules=(
        *_marian_attention("model.encoder.layers.{i}.self_attn",
                           "encoder/layer_{i}/self_attention"),
        *norm("model.encoder.layers.{i}.self_attn_layer_norm",
              "encoder/layer_{i}/attention_block/norm"),
        *_marian_ffn("model.encoder.layers.{i}", "encoder/layer_{i}"),
        *_marian_attention("model.decoder.layers.{i}.self_attn",
                           "decoder/layer_{i}/self_attention"),
        *norm("model.decoder.layers.{i}.self_attn_layer_norm",
              "decoder/layer_{i}/self_attention_block/norm"),
        *_marian_attention("model.decoder.layers.{i}.encoder_attn",
                           "decoder/layer_{i}/cross_attention"),
        *norm("model.decoder.layers.{i}.encoder_attn_layer_norm",
              "decoder/layer_{i}/cross_attention_block/norm"),
        *_marian_ffn("model.decoder.layers.{i}", "decoder/layer_{i}"),
    ),
    rules=(Rule("model.shared.weight", ("shared_embedding/embedding",), VOCAB),),
    heads=(Head("MarianMTModel", "seq2seq",
                (Rule("final_logits_bias", ("decoder/logits_bias",), BIAS_ROW, optional=True),),
                dict(num_labels=0)),),
    special_tokens={"pad": "<pad>", "eos": "</s>", "unk": "<unk>"},
    slots=DECODER_SLOTS,
    add_bos=False,
    ignored=(r"embed_positions\.weight$", r"embed_tokens\.weight$", r"^lm_head\.weight$"),
    same=(("encoder_attention_heads", "decoder_attention_heads"),
          ("encoder_ffn_dim", "decoder_ffn_dim"), ("vocab_size", "decoder_vocab_size")),
    imported=dict(logits_bias=True),
    sinusoid_halves=True,
    tokenizer="sentencepiece",
    export_bos="always",
    bos_is_decoder_start=True,
    forced_eos=True,
    pad_last=True,
)


def scaled_query() -> Transform:
  """T5's query projection, whose attention logits are not divided by sqrt(head_dim): ours
  divides them, so the query kernel carries the factor sqrt(head_dim) (exact in float32 when
  head_dim is a power of 4, as T5's 64 is: the factor is then a power of 2)."""
  plain = linear()
  return Transform(plain.hf_shape,
                   lambda w, s, v: [plain.to_ours(w, s, v)[0] * np.float32(math.sqrt(s[0][-1]))],
                   lambda a, v: plain.to_hf([a[0] / np.float32(math.sqrt(a[0].shape[-1]))], v))


def _t5_checks(hf_config: dict):
  # transformers 5 saves tie_word_embeddings True for every T5 and says with
  # scale_decoder_outputs whether the head's input is scaled by d_model**-0.5 (the original T5,
  # whose head is tied); older versions say it with tie_word_embeddings alone.
  scaled = hf_config.get("scale_decoder_outputs")
  if scaled is None:
    scaled = hf_config.get("tie_word_embeddings", True) is not False
  if scaled:
    return ("its decoder output scaled by d_model**-0.5 before a head tied to the embedding "
            "(tie_word_embeddings true / scale_decoder_outputs true: the original T5); only "
            "T5 v1.1's untied head (tie_word_embeddings false) maps to model.tie_output=False")
  return None


def _t5_attention(hf: str, ours: str) -> tuple:
  return tuple(Rule(f"{hf}.{theirs}.weight", (f"{ours}/{mine}/kernel",), transform)
               for theirs, mine, transform in (("q", "query", scaled_query()),
                                                ("k", "key", linear()), ("v", "value", linear()),
                                                ("o", "out", linear(2))))


def _t5_ffn(hf: str, ours: str) -> tuple:
  """Gated GELU: wo(gelu_tanh(wi_0 x) * wi_1 x); ours wo(gelu(wi_gate x) * wi x) (geglu)."""
  return (Rule(f"{hf}.DenseReluDense.wi_0.weight", (f"{ours}/ffn/wi_gate/kernel",), linear()),
          Rule(f"{hf}.DenseReluDense.wi_1.weight", (f"{ours}/ffn/wi/kernel",), linear()),
          Rule(f"{hf}.DenseReluDense.wo.weight", (f"{ours}/ffn/wo/kernel",), linear()),
          Rule(f"{hf}.layer_norm.weight", (f"{ours}/ffn_block/norm/scale",), VECTOR))


# T5 v1.1 (T5ForConditionalGeneration with feed_forward_proj gated-gelu and an untied head):
# pre-RMSNorm without biases, final norms in both stacks, one relative position bias per stack
# (their first layer's table, which every layer of the stack adds; ours is the stack's own),
# bidirectional in the encoder and causal in the decoder, none in cross-attention. Its decoder
# starts from <pad>, which becomes our BOS (as Marian's does); its tokenizer appends </s>.
T5 = Architecture(
    model_type="t5",
    prefix="",
    fields=(Field("d_model", "d_model"), Field("num_heads", "num_heads"),
            Field("head_size", "d_kv"), Field("num_encoder_layers", "num_layers"),
            Field("num_decoder_layers", "num_decoder_layers",
                  default=lambda c: c.get("num_layers")),
            Field("d_ff", "d_ff"), Field("layer_norm_eps", "layer_norm_epsilon", default=1e-6),
            Field("relative_buckets", "relative_attention_num_buckets", default=32),
            Field("relative_max_distance", "relative_attention_max_distance", default=128),
            Field("activation", "feed_forward_proj", {"gated-gelu": "geglu"}, "relu"),
            # T5's one dropout rate is on the attention weights and the residual stream alike.
            Field("attention_dropout_rate", "dropout_rate", default=0.1),
            Field("dropout_rate", "dropout_rate", default=0.1)),
    fixed=dict(arch="encoder_decoder", norm="pre", norm_type="rmsnorm",
               positional="relative_bias", share_embeddings=True, tie_output=False,
               embed_scale=False, qkv_bias=False, use_bias=False, fused_qkv=False,
               num_kv_heads=0, parallel_block=False, type_vocab_size=0, embed_norm=False,
               logits_bias=False),
    required=dict(is_encoder_decoder=True),
    layer_rules=(
        *_t5_attention("encoder.block.{i}.layer.0.SelfAttention",
                       "encoder/layer_{i}/self_attention"),
        Rule("encoder.block.{i}.layer.0.layer_norm.weight",
             ("encoder/layer_{i}/attention_block/norm/scale",), VECTOR),
        *_t5_ffn("encoder.block.{i}.layer.1", "encoder/layer_{i}"),
        *_t5_attention("decoder.block.{i}.layer.0.SelfAttention",
                       "decoder/layer_{i}/self_attention"),
        Rule("decoder.block.{i}.layer.0.layer_norm.weight",
             ("decoder/layer_{i}/self_attention_block/norm/scale",), VECTOR),
        *_t5_attention("decoder.block.{i}.layer.1.EncDecAttention",
                       "decoder/layer_{i}/cross_attention"),
        Rule("decoder.block.{i}.layer.1.layer_norm.weight",
             ("decoder/layer_{i}/cross_attention_block/norm/scale",), VECTOR),
        *_t5_ffn("decoder.block.{i}.layer.2", "decoder/layer_{i}"),
    ),
    rules=(Rule("shared.weight", ("shared_embedding/embedding",), VOCAB),
           Rule("encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
                ("encoder/relative_bias/table",), TABLE),
           Rule("decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
                ("decoder/relative_bias/table",), TABLE),
           Rule("encoder.final_layer_norm.weight", ("encoder/final_norm/scale",), VECTOR),
           Rule("decoder.final_layer_norm.weight", ("decoder/final_norm/scale",), VECTOR),
           Rule("lm_head.weight", ("decoder/logits/kernel",), VOCAB_OUT)),
    heads=(Head("T5ForConditionalGeneration", "seq2seq", (), dict(num_labels=0)),),
    special_tokens={"pad": "<pad>", "eos": "</s>", "unk": "<unk>"},
    slots=DECODER_SLOTS,
    add_bos=False,
    ignored=(r"^(encoder|decoder)\.embed_tokens\.weight$",
             r"EncDecAttention\.relative_attention_bias\.weight$"),
    checks=(_t5_checks,),
    derived=(("d_kv", lambda m: m.head_dim), ("tie_word_embeddings", lambda m: False),
             ("scale_decoder_outputs", lambda m: False)),
    imported=dict(max_len=512),  # relative positions have no table; T5's tokenizer's length
    tokenizer="t5",
    aliases=(("lm_head.weight", "shared.weight"),),
    token_names={k: v for k, v in TOKEN_NAMES.items() if k != "bos"},
    export_bos="always",
    bos_is_decoder_start=True,
)

# Export picks the first architecture (in this order) whose fixed options all equal the model's:
# GPT-2 (learned positions, LayerNorm with biases) and Llama (rotary, RMSNorm, no biases) share
# none, so a decoder-only model goes out as the one its options match, or is refused.
ARCHITECTURES = {a.model_type: a for a in (GPT2, BERT, LLAMA, MARIAN, T5)}
