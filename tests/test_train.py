"""Schedules, the loss, the train step (including data parallelism) and the loop."""

import json
import math
import os
import shutil
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from launcher import QUICK_COMPILE, Launcher, environment, script_command

from transformer_jax import config as config_lib
from transformer_jax.data import pipeline, scan
from transformer_jax.data import tokenizer as tokenizer_lib
from transformer_jax.eval import decode
from transformer_jax.experiments import tiny
from transformer_jax.model import shift_right
from transformer_jax.train import losses, sharding
from transformer_jax.train import state as state_lib
from transformer_jax.train import step as step_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_config():
  return tiny.get_config()


@pytest.mark.parametrize("step", [1, 10, 100, 4000, 4001, 16000, 100000])
def test_rsqrt_schedule_matches_the_paper(step):
  d_model, warmup = 512, 4000
  expected = d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)
  assert float(state_lib.rsqrt_schedule(step, d_model, warmup)) == pytest.approx(expected, rel=1e-6)


def test_schedules_by_name():
  c = tiny_config()
  c.train.update(schedule="rsqrt", warmup_steps=4000, learning_rate=2.0)
  lr = state_lib.make_schedule(c.train, 512)
  # optimizer count 0 is the paper's step 1; the peak is at step = warmup.
  assert float(lr(0)) == pytest.approx(2.0 * 512**-0.5 * 4000**-1.5, rel=1e-6)
  assert float(lr(3999)) == pytest.approx(2.0 * 512**-0.5 * 4000**-0.5, rel=1e-6)
  assert float(lr(3999)) > float(lr(3998)) and float(lr(3999)) > float(lr(4000))
  c.train.update(schedule="cosine", warmup_steps=10, learning_rate=1e-3, steps=110)
  lr = state_lib.make_schedule(c.train, 512)
  assert float(lr(0)) == 0.0
  assert float(lr(10)) == pytest.approx(1e-3)
  assert float(lr(60)) == pytest.approx(0.5e-3, rel=1e-5)  # halfway down the cosine
  assert float(lr(110)) == pytest.approx(0.0, abs=1e-9)
  c.train.update(schedule="constant", warmup_steps=0, learning_rate=3e-4)
  assert float(state_lib.make_schedule(c.train, 512)(12345)) == pytest.approx(3e-4)


def _bfloat16_values(x):
  """x rounded to bfloat16, in float64: what a bfloat16 model's (upcast) logits hold."""
  return np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64)


def _logits_and_targets(seed, shape, vocab, bf16):
  """Normal logits [*shape, vocab] in float64 (rounded to bfloat16 values where bf16), integer
  targets [*shape], and the generator that drew them, for further draws."""
  rng = np.random.default_rng(seed)
  logits = rng.normal(size=(*shape, vocab))
  logits = _bfloat16_values(logits) if bf16 else logits
  return rng, logits, rng.integers(0, vocab, size=shape)


# bf16: the loss as the train step calls it under model.dtype=bfloat16 (bfloat16 values read in
# one pass); the float64 references see the same rounded logits.
@pytest.mark.parametrize("bf16", [False, True])
def test_label_smoothing_equals_its_closed_form(bf16):
  vocab, eps = 7, 0.1
  _, logits, targets = _logits_and_targets(0, (2, 5), vocab, bf16)
  loss, nll, _ = losses.label_smoothed_cross_entropy(jnp.asarray(logits, jnp.float32),
                                                    jnp.asarray(targets), eps, bf16)
  log_p = logits - np.log(np.exp(logits).sum(-1, keepdims=True))  # float64
  q = np.full((2, 5, vocab), eps / vocab)
  q[np.arange(2)[:, None], np.arange(5)[None], targets] += 1.0 - eps
  np.testing.assert_allclose(loss, -(q * log_p).sum(-1), rtol=1e-5)
  np.testing.assert_allclose(nll, -np.take_along_axis(log_p, targets[..., None], -1)[..., 0],
                             rtol=1e-5)


@pytest.mark.parametrize("bf16", [False, True])
def test_label_smoothing_gradient_and_correct_match_float64(bf16):
  vocab, eps = 11, 0.2
  rng, logits, targets = _logits_and_targets(1, (3, 4), vocab, bf16)
  logits[0, 0, 5] = logits[0, 0].max() + 1.0  # a sure argmax (1.0 apart: exact in bfloat16)
  targets[0, 0] = 5
  w_loss, w_nll = rng.normal(size=(3, 4)), rng.normal(size=(3, 4))

  def objective(x):
    loss, nll, _ = losses.label_smoothed_cross_entropy(x, jnp.asarray(targets), eps, bf16)
    return (loss * w_loss).sum() + (nll * w_nll).sum()

  grad = jax.grad(objective)(jnp.asarray(logits, jnp.float32))
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  one_hot = np.eye(vocab)[targets]
  q = (1.0 - eps) * one_hot + eps / vocab
  expected = w_loss[..., None] * (p - q) + w_nll[..., None] * (p - one_hot)
  # bf16: the gradient is rounded to bfloat16 once (relative error at most 2^-9).
  np.testing.assert_allclose(grad, expected, rtol=2**-8 if bf16 else 1e-4, atol=1e-6)
  _, _, correct = losses.label_smoothed_cross_entropy(jnp.asarray(logits, jnp.float32),
                                                     jnp.asarray(targets), eps, bf16)
  np.testing.assert_array_equal(correct, logits.argmax(-1) == targets)
  assert correct[0, 0]


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("eps", [0.0, 0.2])
def test_rows_at_minus_infinity_leave_the_vocabulary_loss_and_gradient(bf16, eps):
  """model.excluded_rows reach the loss as -inf logits (and by name, for the smoothing): loss,
  nll and gradient are those of the vocabulary without them (the smoothing spread over the
  others), the gradient 0 on them."""
  rng = np.random.default_rng(3)
  vocab, excluded = 9, [0, 1, 6]
  kept = [i for i in range(vocab) if i not in excluded]
  logits = rng.normal(size=(2, 3, vocab)) - 30.0  # strongly negative: a 0 logit would dominate
  logits = _bfloat16_values(logits) if bf16 else logits
  logits[..., excluded] = -np.inf
  targets = rng.choice(kept, size=(2, 3))

  def objective(x):
    loss, nll, _ = losses.label_smoothed_cross_entropy(x, jnp.asarray(targets), eps, bf16,
                                                      excluded_rows=tuple(excluded))
    return loss.sum() + nll.sum(), (loss, nll)

  (_, (loss, nll)), grad = jax.value_and_grad(objective, has_aux=True)(
      jnp.asarray(logits, jnp.float32))
  small = logits[..., kept]  # the same model over the real rows only, in float64
  log_p = small - np.log(np.exp(small - small.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
      - small.max(-1, keepdims=True)
  index = np.searchsorted(kept, targets)
  expected_nll = -np.take_along_axis(log_p, index[..., None], -1)[..., 0]
  np.testing.assert_allclose(nll, expected_nll, rtol=1e-5)
  np.testing.assert_allclose(loss, (1 - eps) * expected_nll - eps * log_p.mean(-1), rtol=1e-5)
  one_hot = np.eye(len(kept))[index]
  expected = 2 * np.exp(log_p) - (2 - eps) * one_hot - eps / len(kept)
  np.testing.assert_allclose(np.asarray(grad)[..., kept], expected,
                             rtol=2**-8 if bf16 else 1e-4, atol=1e-6)
  assert not np.asarray(grad)[..., excluded].any()


def test_one_pass_loss_matches_float64_on_wide_bfloat16_logits():
  # The one-pass reduction rescales its running sum of exponentials whenever the maximum grows:
  # logits spread over +-40 (exp alone would overflow float32 past 88) across a vocabulary wide
  # enough for XLA to split the reduction, and a row whose maximum is the last entry (rescaled
  # at the end) and one where it is the first. The logits hold bfloat16 values in float32, as a
  # model under model.dtype=bfloat16 returns them; the float64 reference reads the same values.
  rng = np.random.default_rng(2)
  vocab, eps = 5003, 0.1
  logits = jnp.asarray(rng.uniform(-40, 40, size=(2, 3, vocab)), jnp.bfloat16)
  logits = logits.at[0, 0, -1].set(60.0).at[0, 1, 0].set(60.0)
  targets = jnp.asarray(rng.integers(0, vocab, size=(2, 3)))
  x = np.asarray(logits, np.float64)
  log_p = x - x.max(-1, keepdims=True)
  log_p -= np.log(np.exp(log_p).sum(-1, keepdims=True))
  nll = -np.take_along_axis(log_p, np.asarray(targets)[..., None], -1)[..., 0]
  expected = (1 - eps) * nll - eps * log_p.mean(-1)

  def objective(v, one_pass):
    loss, nll, _ = losses.label_smoothed_cross_entropy(v, targets, eps, bfloat16_logits=one_pass)
    return loss.sum() + nll.sum(), (loss, nll)

  grads = {}
  for one_pass in (False, True):
    (_, (loss, got_nll)), grad = jax.jit(jax.value_and_grad(objective, has_aux=True),
                                         static_argnums=1)(logits.astype(jnp.float32),
                                                           one_pass)
    grads[one_pass] = np.asarray(grad, np.float32)
    # float32 sums of 5,003 terms against float64: a few ulps of the ~40-80 results.
    np.testing.assert_allclose(loss, expected, rtol=2e-6)
    np.testing.assert_allclose(got_nll, nll, rtol=2e-6)
    if one_pass:
      p = np.exp(log_p)
      q = (1 - eps) * (np.arange(vocab) == np.asarray(targets)[..., None]) + eps / vocab
      want = (p - q) + (p - (np.arange(vocab) == np.asarray(targets)[..., None]))
      # The gradient comes back in bfloat16 (8 bits of mantissa): within its rounding.
      np.testing.assert_allclose(np.asarray(grad, np.float64), want, atol=2 ** -8 * 2)
      # The same backward pass, its result rounded to bfloat16 (at most 2^-9 of |g| <= 2).
      np.testing.assert_allclose(grads[True], grads[False], atol=2 ** -8)


def test_shift_right_starts_with_bos_and_keeps_padding():
  targets = jnp.array([[5, 6, 2, 0], [7, 2, 0, 0]])
  np.testing.assert_array_equal(shift_right(targets), [[1, 5, 6, 0], [1, 7, 0, 0]])


def test_masked_lm_corruption_is_berts():
  rng = np.random.default_rng(0)
  inputs = rng.integers(5, 100, size=(64, 512))
  inputs[:, 400:] = 0  # padding is never chosen
  corrupted, targets = step_lib.mask_tokens(jnp.asarray(inputs), jax.random.key(3), 0.15, 100)
  corrupted, targets = np.asarray(corrupted), np.asarray(targets)
  chosen = targets > 0
  np.testing.assert_array_equal(targets[chosen], inputs[chosen])
  assert not chosen[:, 400:].any() and (corrupted[:, 400:] == 0).all()
  np.testing.assert_array_equal(corrupted[~chosen], inputs[~chosen])
  n = chosen.sum()  # ~3900: the shares below are within 4 standard errors
  assert abs(n / (64 * 400) - 0.15) < 0.01
  masked = corrupted[chosen] == tokenizer_lib.MASK_ID
  kept = corrupted[chosen] == inputs[chosen]
  random = ~masked & ~kept
  # Random tokens come from the 95 ids 5..99, so one in 95 equals the original.
  assert abs(masked.mean() - 0.8) < 0.03 and abs(kept.mean() - (0.1 + 0.1 / 95)) < 0.02
  assert abs(random.mean() - 0.1 * 94 / 95) < 0.02
  assert corrupted[chosen][random].min() > tokenizer_lib.MASK_ID
  again, _ = step_lib.mask_tokens(jnp.asarray(inputs), jax.random.key(3), 0.15, 100)
  np.testing.assert_array_equal(again, corrupted)  # a function of the key


def _setup(config, pairs, devices=None):
  model_config = config_lib.validate(config)
  texts = [t for p in pairs for t in p]
  tok = tokenizer_lib.train(texts, model_config.vocab_size, "word")
  data = pipeline.encode(pairs, tok, config.data.max_source_len, config.data.max_target_len)
  mesh = sharding.make_mesh(devices=devices)
  optimizer = state_lib.make_optimizer(config.train, model_config.d_model)
  step = step_lib.make_train_step(model_config, config, mesh)
  state = state_lib.init_state(model_config, optimizer, config.seed, mesh)
  return model_config, tok, data, mesh, step, state


def test_tiny_model_overfits_a_handful_of_pairs():
  c = tiny_config()
  c.model.update(d_model=64, num_heads=4, d_ff=128, num_encoder_layers=2, num_decoder_layers=2)
  c.train.update(schedule="constant", learning_rate=3e-3, label_smoothing=0.0)
  pairs = scan.load("simple", "train")[::2000][:8]
  model_config, tok, data, mesh, step, state = _setup(c, pairs)
  batch = sharding.shard_batch(data.rows(np.arange(len(data))), mesh)
  rng = jax.random.PRNGKey(0)
  for i in range(300):
    state, metrics = step(state, batch, rng)
    if float(metrics["accuracy"]) == 1.0 and i % 10 == 0:
      outputs = decode.greedy_decode(state.params, model_config.replace(deterministic=True),
                                     batch["inputs"], c.data.max_target_len)
      if all(tok.decode(o) == t for o, (_, t) in zip(np.asarray(outputs), pairs)):
        return
  pytest.fail(f"no exact overfit after 300 steps; last accuracy {float(metrics['accuracy'])}")


def test_tokens_batches_respect_the_budget_and_trim_padding():
  c = tiny_config()
  c.data.update(batching="tokens", tokens_per_batch=512, bucket_width=8)
  pairs = scan.load("simple", "train")
  tok = tokenizer_lib.train([t for p in pairs for t in p], 32, "word")
  data = pipeline.encode(pairs, tok, c.data.max_source_len, c.data.max_target_len)
  stream = pipeline.TrainStream(data, c.data, seed=0, row_multiple=4)
  seen = []
  for k in range(200):
    batch = stream[k]
    rows, length = batch["targets"].shape
    assert rows % 4 == 0 and rows * length <= 512
    assert batch["inputs"].shape[0] == rows
    longest = max((batch["inputs"] > 0).sum(1).max(), (batch["targets"] > 0).sum(1).max())
    assert length - 8 < longest <= length or length == c.data.max_target_len
    seen.append(batch["targets"])
  again = pipeline.TrainStream(data, c.data, seed=0, row_multiple=4)
  for k in (0, 57, 199):  # random access by step: a resumed stream gives the same batches
    np.testing.assert_array_equal(again[k]["targets"], seen[k])


def test_fixed_batches_have_the_configured_shape():
  c = tiny_config()
  c.data.update(batching="fixed", batch_size=8)
  pairs = scan.load("simple", "train")[:100]
  tok = tokenizer_lib.train([t for p in pairs for t in p], 32, "word")
  data = pipeline.encode(pairs, tok, c.data.max_source_len, c.data.max_target_len)
  batch = pipeline.TrainStream(data, c.data, seed=0)[30]  # past one epoch: repeats
  assert batch["inputs"].shape == (8, c.data.max_source_len)
  assert batch["targets"].shape == (8, c.data.max_target_len)


DATA_PARALLEL_SCRIPT = textwrap.dedent("""
    import json, sys
    import jax, numpy as np
    from transformer_jax.experiments import tiny
    from transformer_jax import config as config_lib
    from transformer_jax.train import sharding, state as state_lib, step as step_lib
    from transformer_jax.data import pipeline, scan, tokenizer as tokenizer_lib
    assert jax.device_count() == 4, jax.devices()
    c = tiny.get_config()
    c.data.update(batching="fixed", batch_size=16)
    c.train.update(grad_clip_norm=1.0, label_smoothing=0.1)
    # The key projection's bias has a zero gradient in exact arithmetic (softmax ignores a constant
    # added to every logit of a row); Adam's first step would blow its rounding noise up to +-lr.
    c.model.qkv_bias = False
    pairs = scan.load("simple", "train")[:64]
    tok = tokenizer_lib.train([t for p in pairs for t in p], 32, "word")
    data = pipeline.encode(pairs, tok, c.data.max_source_len, c.data.max_target_len)
    batch = pipeline.TrainStream(data, c.data, seed=0)[0]
    results = {{}}
    for name, devices, accum in (("one", jax.devices()[:1], 1), ("four", jax.devices(), 1),
                                 ("four_accum2", jax.devices(), 2)):
      c.train.grad_accum_steps = accum
      model_config = config_lib.validate(c)
      mesh = sharding.make_mesh(devices=devices)
      optimizer = state_lib.make_optimizer(c.train, model_config.d_model)
      step = step_lib.make_train_step(model_config, c, mesh)
      state = state_lib.init_state(model_config, optimizer, 0, mesh)
      results["init"] = [np.asarray(x, np.float64).ravel().tolist()
                         for x in jax.tree.leaves(jax.device_get(state.params))]
      state, metrics = step(state, sharding.shard_batch(batch, mesh, accum),
                            jax.random.PRNGKey(0))
      leaves = jax.tree.leaves(jax.device_get(state.params))
      results[name] = {{"loss": float(metrics["loss"]), "tokens": float(metrics["tokens"]),
                       "params": [np.asarray(x, np.float64).ravel().tolist() for x in leaves]}}
    print(json.dumps(results))
""")


def test_data_parallel_step_equals_single_device_step():
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=f"--xla_force_host_platform_device_count=4 {QUICK_COMPILE}")
  out = subprocess.run(script_command(DATA_PARALLEL_SCRIPT.format(root=ROOT)), env=env,
                       capture_output=True, text=True, check=True, cwd=ROOT)
  results = json.loads(out.stdout.strip().splitlines()[-1])
  one = results["one"]
  for name in ("four", "four_accum2"):
    other = results[name]
    assert other["tokens"] == one["tokens"]
    assert other["loss"] == pytest.approx(one["loss"], rel=1e-5)
    for a, b in zip(one["params"], other["params"]):
      np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
  # The update is not trivially zero: parameters moved.
  moved = [np.abs(np.asarray(a) - np.asarray(b)).max()
           for a, b in zip(one["params"], results["init"])]
  assert max(moved) > 1e-4


# Run after the README's example (which defines `model`): score() is log p(target | source) as
# the cached, step-by-step decoder computes it; the module applies without a dropout RNG.
API_CHECK = """
import jax, jax.numpy as jnp, numpy as np
import transformer_jax
from transformer_jax.core.tokens import EOS_ID
from transformer_jax.eval import decode
from transformer_jax.eval.translate import encode_sources

sources = ["jump twice", "walk left after run"]
targets = model.translate(sources)
scores = model.score(sources, targets)
inputs, _ = encode_sources(model.tokenizer, sources, model.config.data.max_source_len, 2)
mc = model.model_config
# Jitted: one compile each instead of one per operation run eagerly (seconds of the test).
step_fn = jax.jit(decode.decode_step, static_argnums=1)
start_fn = jax.jit(decode.start, static_argnums=(1, 3))
for i, ids in enumerate(model.tokenizer.encode(targets)):
  ids = ids + [EOS_ID]
  source = jnp.asarray(inputs[i:i + 1])
  start = start_fn(model.params, mc, source, len(ids))
  cache, tokens = start.cache, start.first_tokens  # BOS
  total = 0.0
  for step, y in enumerate(ids):
    logits, cache = step_fn(model.params, mc, cache, start.context, tokens,
                            start.first_positions + step)
    logits = np.asarray(logits[0], np.float64)
    total += logits[y] - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
    tokens = jnp.asarray([y], jnp.int32)
  assert abs(total - scores[i]) < 1e-3 * max(1.0, abs(total)), (total, scores[i])
assert model.score(sources, ["I_JUMP I_JUMP"] * 2)[0] < 0
noisy = transformer_jax.load(model_dir, overrides={"model.dropout_rate": 0.5})
x, y = jnp.asarray(inputs), jnp.ones((2, 3), jnp.int32)
apply = jax.jit(noisy.module.apply)
first = apply({"params": noisy.params}, x, y)
np.testing.assert_array_equal(first, apply({"params": noisy.params}, x, y))
"""


def test_train_then_evaluate_end_to_end(tmp_path, tiny_run):
  workdir = tmp_path / "run"  # launch.py --mode=train of experiments/tiny.py (conftest.py)
  shutil.copytree(tiny_run, workdir)
  for name in ("tokenizer.model", "config.json", "metrics.jsonl", "checkpoints", "tensorboard"):
    assert (workdir / name).exists(), name
  records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  train_records = [r for r in records if r["split"] == "train"]
  assert [r["step"] for r in train_records] == [10, 20]
  for key in ("loss", "accuracy", "learning_rate", "grad_norm", "tokens_per_s", "steps_per_s"):
    assert all(math.isfinite(r[key]) for r in train_records), key
  assert os.listdir(workdir / "tensorboard")
  final = workdir / "eval" / "20.test.greedy.limit64.json"  # train's own final evaluation
  kept = {name: (workdir / name).read_bytes() for name in ("summary.md", final)}
  assert json.loads(kept[final])["split"] == "test"
  # Training a finished workdir again changes nothing.
  # The workdir's config.json is its config: --config may be left out.
  # (Both runs are `python launch.py ...`, forked from one process that imported the library.)
  launcher = Launcher(environment(), str(tmp_path))
  try:
    code, again, err = launcher.run(f"--workdir={workdir}", "--mode=train")
    assert code == 0, err[-3000:]
    assert "already trained to step 20" in again
    # Another split and example limit go to a file of their own, beside the final evaluation.
    code, out, err = launcher.run(f"--workdir={workdir}", "--mode=evaluate", "--split=train",
                                  "--config.eval.max_examples=16")
    assert code == 0, err[-3000:]
  finally:
    launcher.close()
  metrics = json.loads(out.strip().splitlines()[-1])
  assert (metrics["step"], metrics["split"], metrics["examples"]) == (20, "train", 16)
  assert metrics["checkpoints"] == [20] and metrics["bleu_signature"].startswith("nrefs:1")
  for key in ("loss", "token_accuracy", "exact_match", "bleu", "perplexity"):
    assert key in metrics
  saved = json.loads((workdir / "eval" / "20.train.greedy.limit16.json").read_text())
  assert saved["exact_match"] == metrics["exact_match"]
  assert saved["loss"] == pytest.approx(metrics["loss"])
  assert {name: (workdir / name).read_bytes() for name in kept} == kept

  # The README's Python API example on this workdir, then its scores against the cached decoder.
  with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
    readme = f.read()
  example = readme.split("## Python API")[1].split("```python\n")[1].split("```")[0]
  assert "transformer_jax.load(" in example
  script = (f"model_dir = {str(workdir)!r}\n"
            + example.replace('"runs/scan_simple"', "model_dir") + API_CHECK)
  result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "32 20" in result.stdout  # model.config.model.d_model, model.step


def test_a_compiling_step_is_timed_apart_from_the_rate_and_the_eta():
  """actions.Throughput on a clock the test moves: a first step that compiles for 30 s is
  counted and timed apart; the rate and the ETA come from the four steps after it alone."""
  from transformer_jax.model import ModelConfig
  from transformer_jax.train import actions

  now = [100.0]
  throughput = actions.Throughput(ModelConfig(vocab_size=32), clock=lambda: now[0])
  with throughput.paused("compile"):
    now[0] += 30.0
  throughput.count(64, (8, 4, 4), compiled=True)
  for _ in range(4):
    now[0] += 0.5
    throughput.count(64, (8, 4, 4))
  interval = throughput.take()
  assert interval["steps"] == 4 and interval["compile_steps"] == 1
  assert interval["seconds"] == pytest.approx(2.0)
  assert interval["compile_seconds"] == pytest.approx(30.0)
  assert throughput.steps_per_s() == pytest.approx(2.0)
  assert throughput.eta(25, 30) == pytest.approx(2.5)  # 5 steps at 0.5 s, not at 32 s / 5


def test_rates_and_eta_leave_out_a_slow_evaluation_and_a_resume_uses_its_own_steps(tmp_path):
  """An evaluation made slow by a real sleep (through loop.train's evaluate_fn hook) stops the
  training clock: the interval after it runs at the pace of one without it, and the ETA follows
  that pace. A resumed run's first log line times its own steps, its compilation aside."""
  import time

  from transformer_jax.eval import evaluate as evaluate_lib
  from transformer_jax.tools import summary
  from transformer_jax.train import logger, loop

  sleep = 3.0
  calls = []

  def slow_evaluate(*args):
    if not calls:  # the evaluation at step 10
      time.sleep(sleep)
    calls.append(1)
    return evaluate_lib.evaluate(*args)

  config = tiny_config()
  # One batch shape: the first step alone compiles the train step.
  config.data.update(batching="fixed", batch_size=8)
  config.train.update(steps=20, log_every=5, eval_every=10, checkpoint_every=100)
  config.eval.update(max_examples=4, max_decode_len=8)
  workdir = str(tmp_path / "run")
  loop.train(config, workdir, evaluate_fn=slow_evaluate)
  config.train.steps = 30
  loop.train(config, workdir, evaluate_fn=slow_evaluate)  # resumed from step 20

  records = logger.read_metrics(workdir)
  train = {r["step"]: r for r in records if r["split"] == "train"}
  evals = {r["step"]: r for r in records if r["split"] == "eval"}
  saves = {r["step"]: r for r in records if r["split"] == "checkpoint"}
  assert sorted(train) == [5, 10, 15, 20, 25, 30] and sorted(evals) == [10, 20, 30]
  assert evals[10]["eval_s"] >= sleep and all(r["eval_s"] > 0 for r in evals.values())
  assert {10, 20, 30} <= set(saves) and all(r["save_s"] >= 0 for r in saves.values())
  # Each run's first step compiled, apart from the rates.
  assert train[5]["compile_steps"] == 1 and train[25]["compile_steps"] == 1
  assert train[5]["interval_steps"] == 4 and train[15]["interval_steps"] == 5
  # Steps 11-15 follow the 3 s evaluation: on the training clock they take a fraction of it (a
  # few ms each; more on a loaded machine, and the save at step 10 writes in the background).
  assert train[15]["interval_s"] < sleep / 2, train[15]
  assert train[15]["steps_per_s"] > 2 * 5 / sleep, train[15]
  # The ETA of the 5 steps left is at the pace of the 14 timed so far: absorbed, the evaluation
  # would put it above 5 * sleep / 14.
  assert train[15]["eta_s"] < 5 * sleep / 14 / 2, train[15]
  assert train[15]["eval_eta_s"] >= sleep  # the evaluations left, at the last one's pace
  # The resumed run: its rate and ETA come from its own steps 22-25, its first step (which
  # compiled) aside. (Not by comparing the two times: a tiny model compiles in under a second,
  # and on a loaded machine four of its steps took as long. The clock's arithmetic is
  # test_a_compiling_step_is_timed_apart_from_the_rate_and_the_eta's.)
  assert train[25]["interval_steps"] == 4 and train[25]["compile_s"] > 0, train[25]
  assert train[25]["eta_s"] == pytest.approx(5 * train[25]["interval_s"] / 4, rel=0.05)
  # The summary's cost: training, compiling steps, evaluation and saves apart.
  cost = summary.training_cost(records)
  assert cost["steps"] == 4 + 5 + 5 + 5 + 4 + 5 and cost["compile_steps"] == 2
  assert cost["evaluations"] == 3 and cost["eval_s"] >= sleep and cost["saves"] >= 3
  assert cost["train_s"] < sleep and cost["compile_s"] > 0  # 28 tiny steps
  text = summary.render(config, {"test": {"loss": 1.0}}, records, 30)
  assert "for 28 steps" in text and "for 3 evaluations" in text and "for 2 steps" in text


def test_tensorboard_events_are_written_without_importing_torch_and_read_by_tensorboard(
    tmp_path):
  """The logger's events (scalars, text) come back through TensorBoard's own event reader, and
  writing them imported neither torch nor tensorboardX's cloud clients (seconds of start-up for
  every run where torch is installed), which stay importable afterwards."""
  script = textwrap.dedent(f"""
      import sys
      from transformer_jax.train.trackers import tensorboard
      events = tensorboard.Events({str(tmp_path)!r})
      events.scalars({{"train/loss": 1.5}}, step=3)
      events.text("samples", "jump twice", step=4)
      events.close()
      print(sorted(n for n in ("torch", "boto3", "google.cloud.storage") if n in sys.modules))
      import torch, boto3  # what was hidden while tensorboardX loaded is there for others
      print("importable")
      """)
  done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  assert done.stdout.split("\n")[:2] == ["[]", "importable"], done.stdout
  from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
  (path,) = tmp_path.glob("events.out.tfevents.*")
  values = {(e.step, v.tag): v for e in EventFileLoader(str(path)).Load() for v in e.summary.value}
  assert list(values[(3, "train/loss")].tensor.float_val) == [1.5]  # its reader's scalar form
  text = values[(4, "samples/text_summary")]  # tensorboardX names a text summary so
  assert text.metadata.plugin_data.plugin_name == "text"
  assert text.tensor.string_val == [b"jump twice"]
