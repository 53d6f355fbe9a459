"""Pictures of a run: training curves, the model's positions, attention maps, and a seq2seq
evaluation's outputs by reference length with where their first error falls.

Everything renders headless into PNG files: figures are made with matplotlib's object API
(`Figure`), never pyplot, so no GUI backend or global figure state is involved.
"""

from __future__ import annotations

import io
import os
import sys
import textwrap
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from matplotlib.figure import Figure

from transformer_jax import config as config_lib
from transformer_jax.core import storage
from transformer_jax.core.errors import UserError
from transformer_jax.core.tokens import BOS_ID, EOS_ID, UNK_ID
from transformer_jax.eval import decode, load, search
from transformer_jax.eval import evaluate as evaluate_lib
from transformer_jax.model import make_model, shift_right
from transformer_jax.model.positions import (
  relative_position_bucket,
  relative_sinusoids,
  sinusoidal_positions,
)
from transformer_jax.train import logger

ATTENTION_KINDS = ("encoder_self_attention", "decoder_self_attention", "cross_attention")


def _save(fig: Figure, path: str, dpi: int) -> str:
  """Writes the PNG whole or not at all (a full disk leaves the previous picture)."""
  png = io.BytesIO()
  fig.savefig(png, format="png", dpi=dpi)
  return storage.write(path, png.getvalue())


def _series(records, split, key):
  points = [(r["step"], r[key]) for r in records if r.get("split") == split and key in r]
  return tuple(zip(*sorted(points))) if points else ((), ())


# The task's own evaluation metric, in the first of these groups that the run logged: decoding
# (seq2seq), classification, else perplexity (a language model's only one).
TASK_PANELS = (
    ("exact match / BLEU", (("eval", "exact_match"), ("eval", "bleu"))),
    ("accuracy / macro-F1", (("eval", "accuracy"), ("eval", "macro_f1"))),
    ("perplexity", (("eval", "perplexity"),)),
)
PERCENT = ("exact_match", "accuracy", "macro_f1")  # fractions, drawn on BLEU's 0-100 scale


def task_panel(records: list[dict]) -> tuple[str, tuple]:
  """(title, ((split, key), ...)) of the task metric panel: the first of TASK_PANELS with data."""
  for title, lines in TASK_PANELS:
    if any(_series(records, split, key)[0] for split, key in lines):
      return title, lines
  return TASK_PANELS[0]


def plot_curves(records: list[dict], path: str) -> str:
  """Loss, accuracy, the task's metric and learning rate against the step."""
  panels = [
      ("loss", [("train", "loss"), ("eval", "loss")]),
      ("token accuracy", [("train", "accuracy"), ("eval", "token_accuracy")]),
      task_panel(records),
      ("learning rate", [("train", "learning_rate")]),
  ]
  fig = Figure(figsize=(4.2 * len(panels), 3.4))
  axes = fig.subplots(1, len(panels))
  for ax, (title, lines) in zip(axes, panels):
    for split, key in lines:
      steps, values = _series(records, split, key)
      if not steps:
        continue
      values = np.asarray(values, dtype=float)
      if split == "eval" and key in PERCENT:
        values = values * 100.0
      ax.plot(steps, values, marker="o" if split == "eval" else None, markersize=3,
              label=f"{split} {key}")
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    if ax.lines:
      ax.legend(fontsize=7)
  fig.tight_layout()
  return _save(fig, path, dpi=110)


def plot_by_length(result: dict, path: str, title: str = "") -> str:
  """A seq2seq evaluation's diagnostics (eval/diagnostics.py): exact match and decoded token
  accuracy by reference length, standard and oracle-length decoding, and the histogram of the
  first wrong token's position of each."""
  rows = result["by_length"]
  lengths = [row["length"] for row in rows]
  fig = Figure(figsize=(13.0, 3.6))
  axes = fig.subplots(1, 3)
  for ax, metric, name in ((axes[0], "exact_match", "exact match"),
                           (axes[1], "token_accuracy", "decoded token accuracy")):
    for prefix, label in (("", "standard (own EOS)"), ("oracle_", "oracle length")):
      if f"{prefix}{metric}" in rows[0]:
        ax.plot(lengths, [100.0 * row[f"{prefix}{metric}"] for row in rows], marker="o",
                markersize=3, label=label)
    ax.set(title=f"{name} by reference length", xlabel="reference length (tokens)",
           ylabel="%", ylim=(-2, 102))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  width = 0.4
  for k, (name, positions) in enumerate(result.get("first_error", {}).items()):
    x = np.array([int(p) for p in positions], dtype=float)
    axes[2].bar(x + (k - 0.5) * width, list(positions.values()), width=width,
                label=f"{name} decoding")
  axes[2].set(title="first wrong token of the wrong outputs", xlabel="position (0-based)",
              ylabel="outputs")
  axes[2].legend(fontsize=8)
  if title:
    fig.suptitle(title, fontsize=9)
  fig.tight_layout()
  return _save(fig, path, dpi=100)


def by_length_results(workdir: str) -> list[dict]:
  """The newest evaluation (highest step) of each split of WORKDIR/eval that has by-length
  diagnostics, by split name."""
  newest = {}
  for result in evaluate_lib.read_results(workdir):
    if result.get("by_length"):
      newest[result["split"]] = result  # read_results sorts by step
  return [newest[split] for split in sorted(newest)]


def plot_positional_encoding(table: np.ndarray, path: str, title: str) -> str:
  """A heat map of a `[length, d_model]` positional-encoding table."""
  fig = Figure(figsize=(8, 4))
  ax = fig.subplots()
  image = ax.imshow(table, aspect="auto", cmap="RdBu", vmin=-1, vmax=1, interpolation="nearest")
  ax.set_xlabel("dimension")
  ax.set_ylabel("position")
  ax.set_title(title)
  fig.colorbar(image, ax=ax)
  fig.tight_layout()
  return _save(fig, path, dpi=110)


# Tried in order for each glyph (matplotlib >= 3.6 falls back per glyph): DejaVu has Latin,
# Greek and Cyrillic; the CJK families draw Chinese, Japanese and Korean where installed.
FONT_FAMILIES = ("DejaVu Sans", "Noto Sans CJK JP", "Noto Sans CJK SC", "Source Han Sans",
                 "WenQuanYi Zen Hei", "Droid Sans Fallback", "Noto Sans")


def font_families() -> list:
  """The FONT_FAMILIES installed here, in order."""
  from matplotlib import font_manager  # with matplotlib's own import, not at ours
  installed = {font.name for font in font_manager.fontManager.ttflist}
  return [family for family in FONT_FAMILIES if family in installed] or ["sans-serif"]


def missing_glyphs(texts, families) -> str:
  """The characters of `texts` that no font of `families` draws (they would show as boxes)."""
  from matplotlib import font_manager
  from matplotlib.ft2font import FT2Font
  covered = set()
  for family in families:
    path = font_manager.findfont(font_manager.FontProperties(family=family),
                                 fallback_to_default=False)
    covered |= set(FT2Font(path).get_charmap())
  wanted = {c for text in texts for c in text if not c.isspace()}
  return "".join(sorted(c for c in wanted if ord(c) not in covered))


def plot_attention(weights: np.ndarray, query_tokens: list[str], key_tokens: list[str],
                   path: str, title: str) -> str:
  """Writes `attention_figure` to `path`; a warning names the characters no font draws."""
  import matplotlib  # see font_families
  families = font_families()
  missing = missing_glyphs([*query_tokens, *key_tokens, title], families)
  if missing:
    print(f"warning: no installed font draws {missing[:20]!r}, shown as boxes in {path}; "
          "install a font that has them (e.g. Noto Sans CJK: fonts-noto-cjk) and plot again",
          file=sys.stderr, flush=True)
  with matplotlib.rc_context({"font.family": families}):
    return _save(attention_figure(weights, query_tokens, key_tokens, title), path, dpi=100)


def attention_figure(weights: np.ndarray, query_tokens: list[str], key_tokens: list[str],
                     title: str) -> Figure:
  """One grid of heat maps (rows = layers, columns = heads) sharing one colour bar.

  Args:
    weights: `[layers, heads, q_len, kv_len]` attention weights of one example.
  """
  layers, heads = weights.shape[:2]
  # One square per token pair; room for the longest token labels on the left and below, and
  # for the colour bar on the right. The constrained layout keeps every label inside.
  label = 0.075 * max(map(len, [*query_tokens, *key_tokens, "x"]))
  width = 0.22 * len(key_tokens) + 0.9 + label
  height = 0.22 * len(query_tokens) + 0.9 + label
  fig = Figure(figsize=(width * heads + 1.0, height * layers + 0.6), layout="constrained")
  axes = fig.subplots(layers, heads, squeeze=False)
  image = None
  for layer in range(layers):
    for head in range(heads):
      ax = axes[layer, head]
      image = ax.imshow(weights[layer, head], cmap="viridis", vmin=0.0, vmax=1.0,
                        interpolation="nearest")
      ax.set_xticks(range(len(key_tokens)))
      ax.set_xticklabels(key_tokens, rotation=90, fontsize=7)
      ax.set_yticks(range(len(query_tokens)))
      ax.set_yticklabels(query_tokens, fontsize=7)
      ax.set_title(f"layer {layer} head {head}", fontsize=8)
  fig.colorbar(image, ax=axes, shrink=min(1.0, 3.0 / layers + 0.2), label="attention weight")
  title = title if len(title) <= 160 else title[:157] + "..."
  fig.suptitle(textwrap.fill(title, max(30, int(width * heads * 9))), fontsize=9)
  return fig


def _stacked(inter, stack: str, count: int, module: str) -> np.ndarray:
  """`[layers, heads, q_len, kv_len]`: the sown weights of `module` in each layer of a stack
  (with model.share_layers, in each application of the stack's one layer)."""
  if "shared_layer" in inter[stack]:
    sown = inter[stack]["shared_layer"][module]["attention_weights"]  # one per application
    return np.stack([weights[0] for weights in sown[:count]])
  return np.stack([inter[stack][f"layer_{i}"][module]["attention_weights"][0][0]
                   for i in range(count)])


def _pieces(tokenizer, ids) -> list[str]:
  """The pieces of `ids`; ids past the tokenizer's vocabulary (model.vocab_size may be larger)
  read as unknown."""
  ids = np.asarray(ids)
  return tokenizer.pieces(np.where(ids < tokenizer.vocab_size, ids, UNK_ID))


def _greedy_output(params, cfg, prompt, max_length: int) -> np.ndarray:
  """The greedy output up to and with its EOS, int `[length]`."""
  output = np.asarray(decode.greedy_decode(params, cfg, prompt, max_length))[0]
  length = int(np.argmax(output == EOS_ID)) + 1 if (output == EOS_ID).any() else len(output)
  return output[:length]


def text_room(model_config, max_length: int, task: str) -> int:
  """How many tokens of an input attention_maps draws: a decoder-only model's sequence holds the
  text (lm: after BOS; else "text EOS BOS") and max_length decoded tokens within model.max_len;
  otherwise the text and EOS."""
  if model_config.arch != "decoder_only":
    return model_config.max_len - 1
  return model_config.max_len - max_length - (0 if task == "lm" else 2)


def _apply(model, params, *inputs):
  """model.apply with the attention weights kept, as one compiled program (op by op, each of
  its hundred-odd operations compiles a program of its own)."""
  return jax.jit(lambda p, *x: model.apply({"params": p}, *x, mutable=["intermediates"]))(
      params, *inputs)


def attention_maps(params, model_config, tokenizer, text: str, max_length: int, task: str =
                   "seq2seq"):
  """Attention weights of every layer and head for one input and what the model makes of it.

  encoder-decoder: the source sentence and its greedy translation (the decoder attends over
  BOS + the translation); decoder-only: the sequence "source EOS BOS translation" (task
  seq2seq) or "BOS text continuation" (lm), all of it in one self-attention; encoder-only: the
  text.

  Returns (maps, key_pieces, query_pieces, output): maps[kind] is `[layers, heads, q_len,
  kv_len]` for each of `ATTENTION_KINDS` the architecture has; the pieces label the source (or
  the whole sequence) and the decoder's inputs; output is the decoded text ("" if none).
  """
  cfg = model_config.replace(deterministic=True, decode=False)
  model = make_model(cfg)
  ids = tokenizer.encode([text])[0]
  room = max(text_room(cfg, max_length, task), 0)
  ids = ids[max(len(ids) - room, 0):] if cfg.arch == "decoder_only" and task == "lm" else ids[:room]
  if cfg.arch == "encoder_only":
    source = jnp.asarray([ids + [EOS_ID]], jnp.int32)
    _, state = _apply(model, params, source)
    pieces = _pieces(tokenizer, source[0])
    maps = {"encoder_self_attention": _stacked(jax.device_get(state["intermediates"]),
                                               "encoder", cfg.num_encoder_layers,
                                               "self_attention")}
    return maps, pieces, pieces, ""
  if cfg.arch == "decoder_only" and task == "lm":
    kept = ids
    # As --mode=generate reads it: an imported GPT-2 without BOS (eval/generate.py).
    prompt = [BOS_ID] + kept if tokenizer.prompt_bos or not kept else kept
    output = _greedy_output(params, cfg, jnp.asarray([prompt], jnp.int32), max_length)
    source = jnp.zeros((1, 0), jnp.int32)
    decoder_inputs = jnp.asarray([prompt + output.tolist()], jnp.int32)
  else:
    source = jnp.asarray([ids + [EOS_ID]], jnp.int32)
    prompt = decode.seq2seq_prompt(source) if cfg.arch == "decoder_only" else source
    output = _greedy_output(params, cfg, prompt, max_length)
    decoder_inputs = shift_right(jnp.asarray(output[None], jnp.int32))  # no padding up to EOS
  _, state = _apply(model, params, source, decoder_inputs)
  inter = jax.device_get(state["intermediates"])
  source_pieces = _pieces(tokenizer, source[0])
  target_pieces = _pieces(tokenizer, decoder_inputs[0])
  maps = {"decoder_self_attention": _stacked(inter, "decoder", cfg.num_decoder_layers,
                                             "self_attention")}
  if cfg.arch == "decoder_only":
    sequence = source_pieces + target_pieces
    return maps, sequence, sequence, search.detokenize(tokenizer, output)
  maps["encoder_self_attention"] = _stacked(inter, "encoder", cfg.num_encoder_layers,
                                            "self_attention")
  maps["cross_attention"] = _stacked(inter, "decoder", cfg.num_decoder_layers, "cross_attention")
  return maps, source_pieces, target_pieces, search.detokenize(tokenizer, output)


def position_picture(model_config, params) -> Optional[tuple[np.ndarray, str]]:
  """(table, title) of the model's positions: the sinusoidal or learned table `[positions,
  d_model]`, the rotary angles' cosines `[positions, head_dim / 2]`, the relative bias of each
  head by distance `[heads, distances]`, or relative_xl's query-independent position term
  v.(W_r R_{i-j}) of each head of the first layer by distance `[heads, distances]`; None without
  positions."""
  cfg = model_config
  length = min(cfg.max_len, 100)
  stack = "decoder" if cfg.arch == "decoder_only" else "encoder"
  if cfg.positional == "learned":
    return (np.asarray(params[stack]["positions"]["table"])[:length],
            f"learned positions ({stack}), {length} x {cfg.d_model}")
  if cfg.positional == "sinusoidal":
    return (sinusoidal_positions(length, cfg.d_model, cfg.position_base),
            f"sinusoidal positional encoding, {length} positions x d_model {cfg.d_model}, "
            f"base {cfg.position_base:g}")
  if cfg.positional == "rotary":
    half = cfg.head_dim // 2
    angles = np.arange(length)[:, None] * cfg.position_base ** (-np.arange(half) / half)
    return (np.cos(angles), f"rotary positions: cos(position x wavelength^-1), {length} "
                            f"positions x {half} pairs of each head's {cfg.head_dim} features")
  if cfg.positional == "relative_bias":
    distances = np.arange(-length + 1, length) if stack == "encoder" else np.arange(length)
    buckets = relative_position_bucket(jnp.asarray(-distances), stack == "encoder",
                                       cfg.relative_buckets, cfg.relative_max_distance)
    bias = np.asarray(params[stack]["relative_bias"]["table"])[np.asarray(buckets)].T
    scale = max(float(np.abs(bias).max()), 1e-6)
    return (bias / scale, f"relative position bias ({stack}) by head and distance query - key "
                          f"({distances[0]} .. {distances[-1]}), divided by {scale:.3g}")
  if cfg.positional == "relative_xl":
    distances = np.arange(-length + 1, length) if stack == "encoder" else np.arange(length)
    layer = params[stack]["shared_layer" if cfg.share_layers else "layer_0"]["self_attention"]
    sinusoids = relative_sinusoids(distances, cfg.d_model, cfg.position_base)
    embedded = np.einsum("rd,dhk->rhk", sinusoids, np.asarray(layer["position"]["kernel"]))
    term = np.einsum("hk,rhk->hr", np.asarray(layer["position_bias"]), embedded)
    term = term / np.sqrt(cfg.head_dim)
    scale = max(float(np.abs(term).max()), 1e-6)
    return (term / scale, f"relative_xl position term v.(W_r R) ({stack}, first layer) by head "
                          f"and distance query - key ({distances[0]} .. {distances[-1]}), "
                          f"divided by {scale:.3g}")
  return None


def _checked_text(text: str, config, model_config, tokenizer) -> tuple[str, int]:
  """(--text as text, the decode length): bytes that are not UTF-8 read as U+FFFD and a text
  longer than the model reads cut, each with the warning that translate and generate give; a
  decode length that leaves the text no room is refused by its key (eval.max_decode_len)."""
  raw = text.encode("utf-8", "surrogateescape")  # argv's undecodable bytes: lone surrogates
  try:
    text = raw.decode("utf-8")
  except UnicodeDecodeError:
    text = raw.decode("utf-8", errors="replace")
    print("warning: --text is not UTF-8; its undecodable bytes were read as U+FFFD",
          file=sys.stderr, flush=True)
  max_length = search.max_decode_length(config)
  tokens = len(tokenizer.encode([text])[0])
  room = text_room(model_config, max_length, config.data.task)
  if room < 1:
    raise UserError(f"eval.max_decode_len ({max_length}) leaves no room for --text in "
                    f"model.max_len ({model_config.max_len}); lower it, e.g. "
                    f"--config.eval.max_decode_len={max(model_config.max_len // 4, 1)}")
  kept = "last" if model_config.arch == "decoder_only" and config.data.task == "lm" else "first"
  if tokens > room:
    print(f"warning: --text has {tokens} tokens, more than the {room} that model.max_len "
          f"({model_config.max_len}) leaves it; the {kept} {room} were drawn", file=sys.stderr,
          flush=True)
  return text, max_length


def plot_workdir(config, workdir: str, text: Optional[str] = None,
                 step: Optional[int] = None) -> list[str]:
  """Writes every plot for a run into WORKDIR/plots, and sends them to the run's trackers;
  returns the paths."""
  workdir = storage.check(workdir)
  out = storage.join(workdir, "plots")
  # Curves need a training run; attention maps (--text) need only a checkpoint, which an
  # imported model (--mode=import_hf) has before it ever trains.
  records = logger.read_metrics(workdir, required=text is None)
  model_config = config_lib.validate(config)
  if not storage.is_url(out) and os.path.lexists(out) and not os.path.isdir(out):
    raise UserError(f"{out} is not a directory, where plots are written; move it away")
  params = tokenizer = None  # loaded (and checked) before anything is written
  # A --checkpoint_step is checked even where no picture needs the parameters: a step that
  # does not exist must not redraw the pictures of another.
  if (text is not None or model_config.positional in ("learned", "relative_bias", "relative_xl")
      or step is not None):
    model_config, params, tokenizer = load.load_trained(config, workdir, step)[:3]
  if text is not None:  # refused before any picture is written
    text, max_length = _checked_text(text, config, model_config, tokenizer)
  storage.makedirs(out)
  paths = [plot_curves(records, storage.join(out, "curves.png"))] if records else []

  for result in by_length_results(workdir):
    name = result["file"][:-len(".json")].split(".", 1)[1]  # SPLIT.DECODE[...], step left out
    paths.append(plot_by_length(result, storage.join(out, f"by_length.{name}.png"),
                                f"{result['split']} at step {result['step']} ({result['file']})"))

  picture = position_picture(model_config, params)
  if picture is not None:
    table, title = picture
    paths.append(plot_positional_encoding(table, storage.join(out, "positional_encoding.png"),
                                          title))

  if text is not None:
    maps, source_pieces, target_pieces, output = attention_maps(
        params, model_config, tokenizer, text, max_length, config.data.task)
    axes = {"encoder_self_attention": (source_pieces, source_pieces),
            "decoder_self_attention": (target_pieces, target_pieces),
            "cross_attention": (target_pieces, source_pieces)}
    for kind in ATTENTION_KINDS:
      if kind not in maps:
        continue
      queries, keys = axes[kind]
      paths.append(plot_attention(maps[kind], queries, keys, storage.join(out, f"{kind}.png"),
                                  f"{kind.replace('_', ' ')}: {text!r} -> {output!r}"))
  # The run's W&B / MLflow run shows them too (train.trackers), at its last step.
  logger.publish_images(config, workdir, paths, max((r["step"] for r in records), default=0))
  return paths
