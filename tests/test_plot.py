"""Every plot kind renders a real picture; attention maps obey their masks; the run summary."""

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from transformer_jax.eval import load
from transformer_jax.experiments import tiny
from transformer_jax.model.positions import sinusoidal_positions
from transformer_jax.tools import plot, summary

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT = "jump twice after walk left"


@pytest.fixture(scope="module")
def trained_workdir(tmp_path_factory, tiny_run):
  """A copy of the session's trained tiny workdir (conftest.py), which plots go into."""
  workdir = tmp_path_factory.mktemp("plot") / "run"
  shutil.copytree(tiny_run, workdir)
  return workdir


def tiny_config():
  return tiny.get_config()


def assert_real_picture(path):
  with open(path, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n", path
  image = np.asarray(Image.open(path).convert("RGB"))
  assert image.shape[0] > 100 and image.shape[1] > 100
  assert image.std() > 10.0, f"{path} is (nearly) blank"
  # Its colours, each packed into one integer (counting unique rows of pixels sorts whole rows:
  # seconds for a large picture).
  red, green, blue = image.astype(np.uint32).transpose(2, 0, 1)
  colours = red << 16 | green << 8 | blue
  assert len(np.unique(colours)) > 50, f"{path} has too few colours"


def test_plot_mode_renders_every_kind(trained_workdir):
  # What --mode=plot --text=TEXT runs, in this process: the attention maps' greedy decoding
  # compiles once for this test and the next. (test_docs runs the README's `--mode=plot --text`
  # command through launch.py, test_errors its user errors.)
  paths = plot.plot_workdir(tiny_config(), str(trained_workdir), text=TEXT)
  names = sorted(os.path.basename(p) for p in paths)
  assert names == sorted(["curves.png", "positional_encoding.png", "encoder_self_attention.png",
                          "decoder_self_attention.png", "cross_attention.png",
                          "by_length.test.greedy.limit64.png"])
  for path in paths:
    assert os.path.dirname(path) == str(trained_workdir / "plots")
    assert_real_picture(path)


def test_attention_maps_respect_the_masks(trained_workdir):
  config = tiny_config()
  model_config, params, tokenizer = load.load_trained(config, str(trained_workdir))[:3]
  max_length = config.eval.max_decode_len or config.data.max_target_len  # as --mode=plot's
  maps, source_pieces, target_pieces, _ = plot.attention_maps(params, model_config, tokenizer,
                                                               TEXT, max_length)
  layers, heads = model_config.num_decoder_layers, model_config.num_heads
  decoder = maps["decoder_self_attention"]
  assert decoder.shape == (layers, heads, len(target_pieces), len(target_pieces))
  upper = np.triu(np.ones(decoder.shape[-2:], bool), k=1)
  assert (decoder[..., upper] == 0.0).all()  # exactly zero above the diagonal
  assert decoder[..., ~upper].min() > 0.0
  for kind in plot.ATTENTION_KINDS:
    np.testing.assert_allclose(maps[kind].sum(-1), 1.0, rtol=1e-5)
  assert maps["cross_attention"].shape[-1] == len(source_pieces) == len(TEXT.split()) + 1
  assert source_pieces[-1] == "</s>"


def test_positional_encoding_picture(tmp_path):
  path = plot.plot_positional_encoding(sinusoidal_positions(50, 64), str(tmp_path / "pe.png"),
                                       "pe")
  assert_real_picture(path)


def test_curves_from_metrics(tmp_path):
  records = [{"split": "train", "step": s, "loss": 3.0 / s, "accuracy": 1 - 1 / s,
              "learning_rate": 1e-3} for s in range(1, 40)]
  records += [{"split": "eval", "step": s, "loss": 2.0 / s, "token_accuracy": 0.5,
               "exact_match": 0.1 * s, "bleu": 5.0 * s} for s in (10, 20, 30)]
  assert_real_picture(plot.plot_curves(records, str(tmp_path / "curves.png")))
  assert plot.task_panel(records)[0] == "exact match / BLEU"
  lm = records[:39] + [{"split": "eval", "step": 10, "loss": 2.0, "perplexity": 7.4}]
  assert plot.task_panel(lm)[0] == "perplexity"
  classify = lm + [{"split": "eval", "step": 10, "accuracy": 0.9, "macro_f1": 0.8}]
  assert plot.task_panel(classify)[0] == "accuracy / macro-F1"


def test_plot_without_a_run_is_a_user_error(tmp_path):
  result = subprocess.run([sys.executable, "launch.py", "--config=experiments/tiny.py",
                           f"--workdir={tmp_path}", "--mode=plot"], cwd=ROOT,
                          capture_output=True, text=True)
  assert result.returncode == 2
  assert result.stderr.strip().startswith("error:") and "metrics.jsonl" in result.stderr
  assert "Traceback" not in result.stderr


def test_summary_lists_config_differences_and_metrics():
  config = tiny_config()
  config.train.steps = 77
  diff = dict((k, (d, v)) for k, d, v in summary.config_diff(config))
  assert diff["train.steps"] == (1000, 77)
  assert diff["model.d_model"] == (512, 32)
  assert "train.adam_b1" not in diff  # unchanged keys are not listed
  config.train.best_metric = "chrf"
  records = [{"split": "train", "step": 10, "interval_s": 40.0, "interval_steps": 8,
              "interval_tokens": 9000.0, "compile_s": 12.0, "compile_steps": 2,
              "compile_tokens": 1000.0},
             {"split": "eval", "step": 10, "exact_match": 0.5, "loss": 1.0, "chrf": 30.0,
              "macro_f1": 0.5, "eval_s": 30.0},
             {"split": "checkpoint", "step": 10, "save_s": 1.5},
             {"split": "train", "step": 20, "interval_s": 80.0, "interval_steps": 10,
              "interval_tokens": 15000.0},
             {"split": "eval", "step": 20, "exact_match": 0.25, "loss": 0.8, "chrf": 40.0,
              "macro_f1": 0.75, "eval_s": 60.0},
             {"split": "checkpoint", "step": 20, "save_s": 0.5},
             {"split": "test", "step": 20, "exact_match": 0.75, "loss": 0.5, "eval_s": 30.0}]
  text = summary.render(config, {"test": {"exact_match": 0.25, "loss": 0.8},
                                 "other": {"exact_match": 0.75, "loss": 0.5}}, records,
                        final_step=77, checkpoint_steps=[20])
  assert "| `train.steps` | 1000 | 77 |" in text
  assert "| metric | test | other |" in text and "| loss | 0.8 | 0.5 |" in text
  best = [line for line in text.splitlines() if line.startswith("- best ")]
  # train.best_metric first, then every metric the evaluations reported, each its best way.
  assert best == ["- best chrf (train.best_metric): 40 at step 20 (checkpoint kept)",
                  "- best loss: 0.8 at step 20 (checkpoint kept)",
                  "- best exact_match: 0.5 at step 10",  # never chosen on the test split
                  "- best macro_f1: 0.75 at step 20 (checkpoint kept)"], best
  assert "## Best evaluation on test and checkpoints" in text  # data.eval_split
  assert "- training: 2.0 min for 18 steps, 0.15 steps/s" in text
  assert "- steps that compiled (the first of each batch shape in each run): 12.0 s for 2 " \
      "steps" in text
  assert "- evaluation: 2.0 min for 3 evaluations" in text
  assert "- checkpoint saves: 2.0 s for 2 saves" in text
  assert "tokens seen (source + target, no padding): 25,000" in text
  assert "200 tokens/s" in text


@pytest.mark.parametrize("arch, positional, share_layers", [
    ("decoder_only", "relative_bias", False), ("encoder_only", "rotary", False),
    ("decoder_only", "relative_xl", True)])  # one shared layer applied twice: two maps
def test_one_stack_models_have_their_attention_maps_and_positions(tmp_path, random_params, arch,
                                                                  positional, share_layers):
  from transformer_jax.data import scan
  from transformer_jax.data import tokenizer as tokenizer_lib
  from transformer_jax.model import ModelConfig, init_params
  tokenizer = tokenizer_lib.train([t for p in scan.load("simple", "train") for t in p], 32,
                                  "word")
  cfg = ModelConfig(vocab_size=32, arch=arch, d_model=16, num_heads=2, num_encoder_layers=2,
                    num_decoder_layers=2, d_ff=32, max_len=32, positional=positional,
                    share_layers=share_layers)
  params = random_params(lambda rng: {"params": init_params(cfg, rng)})
  maps, keys, queries, output = plot.attention_maps(params, cfg, tokenizer, TEXT, 8)
  assert all(len(m) == 2 for m in maps.values())  # a map per layer (application)
  words = len(TEXT.split()) + 1  # and EOS
  if arch == "decoder_only":  # one sequence: "source EOS BOS output", causal
    (kind,) = maps
    assert kind == "decoder_self_attention" and keys == queries and keys[:words + 1] == (
        tokenizer.pieces(tokenizer.encode([TEXT])[0]) + ["</s>", "<s>"])
    upper = np.triu(np.ones(maps[kind].shape[-2:], bool), k=1)
    assert (maps[kind][..., upper] == 0.0).all() and maps[kind][..., ~upper].min() > 0.0
  else:
    assert list(maps) == ["encoder_self_attention"] and output == ""
    assert maps["encoder_self_attention"].shape == (2, 2, words, words)
    assert maps["encoder_self_attention"].min() > 0.0  # nothing masked
  np.testing.assert_allclose(next(iter(maps.values())).sum(-1), 1.0, rtol=1e-5)
  table, title = plot.position_picture(cfg, params)
  assert table.shape == ((32, 4) if positional == "rotary" else (2, 32)), title
  assert_real_picture(plot.plot_positional_encoding(table, str(tmp_path / "p.png"), title))


def test_attention_figure_has_a_colour_bar_and_keeps_its_labels_inside():
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  layers, heads = 2, 3
  keys = ["▁a", "▁Donaudampfschifffahrtsgesellschaft", "</s>"]
  queries = ["<s>", "▁quite_a_long_piece", "."]
  weights = np.random.default_rng(0).dirichlet(np.ones(3), size=(layers, heads, 3))
  fig = plot.attention_figure(weights, queries, keys, "a title")
  canvas = FigureCanvasAgg(fig)
  canvas.draw()
  renderer = canvas.get_renderer()
  assert len(fig.axes) == layers * heads + 1  # the maps and one shared colour bar
  assert fig.axes[-1].get_ylim() == (0.0, 1.0)
  box = fig.bbox
  for ax in fig.axes[:-1]:
    for label in ax.get_xticklabels() + ax.get_yticklabels():
      extent = label.get_window_extent(renderer)
      assert box.x0 - 1 <= extent.x0 and extent.x1 <= box.x1 + 1, label.get_text()
      assert box.y0 - 1 <= extent.y0 and extent.y1 <= box.y1 + 1, label.get_text()
  # Glyphs no installed font has are named (DejaVu, matplotlib's own font, has no CJK).
  assert plot.missing_glyphs(["Haus", "Straße"], ["DejaVu Sans"]) == ""
  assert set(plot.missing_glyphs(["猫が 好き"], ["DejaVu Sans"])) == set("猫が好き")
