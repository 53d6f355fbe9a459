"""Refusals that name the right cause, and input text, in-process (the command line's one-line
rows are in test_errors.py): every flag is taken by some mode of cli.MODES; export_hf exports a
decoder-only model whatever its unread encoder depth and names the options no class has; plot
--text warns about bytes that are not UTF-8 and about a cut as translate does, and names
eval.max_decode_len; a credentials file that is not there is one line at once; which failures
of a store count as an outage."""

import aiohttp
import pytest

from transformer_jax import cli
from transformer_jax.core import outage, storage
from transformer_jax.core.errors import UserError
from transformer_jax.experiments import tiny
from transformer_jax.model import ModelConfig
from transformer_jax.tools import plot


def test_every_flag_says_which_modes_use_it():
  # Every flag of ours is taken by some mode of the table (--sweep's own by --mode=train with it).
  names = {holder.name for holder in cli._OUR_FLAGS} - {"mode"}
  for name in names:
    assert any(cli.takes(mode, name) for mode in (*cli.MODES.values(), cli.SWEEP)), name
  for name, mode in cli.MODES.items():
    assert set(mode.flags) <= names and mode.workdir in ("", "optional", "required", "trained")
    assert set(mode.why_not) <= names, name
  # A flag the mode does not use, one without the flag it needs, one that is used.
  assert cli.refused_flag("text", "evaluate", ["text"]) == (
      "--text is for --mode=plot, not --mode=evaluate")
  assert "only applies with --sweep" in cli.refused_flag("sweep_parallel", "train",
                                                         ["sweep_parallel"])
  assert cli.refused_flag("sweep_parallel", "train", ["sweep", "sweep_parallel"]) is None
  assert cli.refused_flag("checkpoint_step", "export_hf", []) is None
  assert "compile    compiles for a TPU slice or GPUs on any machine" in cli._help()


GPT2_LIKE = dict(vocab_size=30, d_model=16, d_ff=24, num_heads=2, num_decoder_layers=1,
                 arch="decoder_only", norm="pre", positional="learned", embed_scale=False,
                 tie_output=True, qkv_bias=True)


def test_export_takes_a_decoder_only_model_whatever_its_unread_encoder_depth():
  pytest.importorskip("safetensors")
  from transformer_jax.tools.hf import convert
  model = ModelConfig(**GPT2_LIKE).validate()
  assert model.num_encoder_layers == 6  # the default, which a decoder-only model never reads
  assert convert._target(model)[1].hf_class == "GPT2LMHeadModel"
  with pytest.raises(UserError) as refused:
    convert._target(model.replace(positional="rotary"))
  message = str(refused.value)
  assert "GPT2LMHeadModel needs model.positional=learned (not 'rotary')" in message
  assert "LlamaForCausalLM needs model.norm_type=rmsnorm (not 'layernorm')" in message
  assert "num_encoder_layers" not in message


class Words:
  """A tokenizer of space-separated words, one id each."""
  prompt_bos = True

  def encode(self, texts):
    return [[5 + len(w) for w in t.split()] for t in texts]


def test_plot_text_not_utf8_and_too_long_warn_as_translate_does(capsys):
  config = tiny.get_config()
  model = ModelConfig(vocab_size=30, d_model=16, d_ff=24, num_heads=2, max_len=8).validate()
  undecodable = b"jump \xff left".decode("utf-8", "surrogateescape")  # as argv carries it
  text, length = plot._checked_text(undecodable, config, model, Words())
  assert text == "jump \ufffd left" and length == config.data.max_target_len
  text, _ = plot._checked_text("a " * 20, config, model, Words())
  err = capsys.readouterr().err.splitlines()
  assert err[0] == "warning: --text is not UTF-8; its undecodable bytes were read as U+FFFD"
  assert err[1] == ("warning: --text has 20 tokens, more than the 7 that model.max_len (8) "
                    "leaves it; the first 7 were drawn")


def test_plot_text_of_a_language_model_names_eval_max_decode_len():
  config = tiny.get_config()
  config.data.task = "lm"
  model = ModelConfig(**{**GPT2_LIKE, "max_len": 16}).validate()
  config.eval.max_decode_len = 16
  with pytest.raises(UserError, match=r"eval.max_decode_len \(16\) leaves no room for --text in "
                                      r"model.max_len \(16\); lower it, e.g. "
                                      r"--config.eval.max_decode_len=4"):
    plot._checked_text("jump", config, model, Words())
  config.eval.max_decode_len = 10
  assert plot.text_room(model, 10, "lm") == 6


def test_a_credentials_file_that_is_not_there_is_one_line_at_once(monkeypatch, tmp_path):
  monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "key.json"))
  monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://127.0.0.1:9")  # never asked
  with pytest.raises(UserError, match=r"GOOGLE_APPLICATION_CREDENTIALS names .*key.json, which "
                                      r"is not a file"):
    storage.filesystem("gs")


def test_what_counts_as_an_outage():
  refused = ConnectionRefusedError(111, "Connect call failed ('127.0.0.1', 9)")
  wrapped = RuntimeError("orbax: the save failed")
  wrapped.__cause__ = refused
  assert outage.unreachable(refused) and outage.unreachable(wrapped)
  assert outage.unreachable(aiohttp.ServerDisconnectedError())
  forbidden = OSError("Forbidden: tests@x does not have storage.objects.create access")
  forbidden.code = 403
  assert not outage.unreachable(forbidden)
  assert not outage.unreachable(FileNotFoundError("gs://bucket/x"))
  unavailable = OSError("the store is busy")
  unavailable.code = 503
  assert outage.unreachable(unavailable)


def test_an_armed_retry_waits_out_failures_then_gives_up_in_one_line(monkeypatch, capsys):
  monkeypatch.setattr(outage, "FIRST_DELAY_S", 0.01)
  monkeypatch.setattr(outage, "MAX_DELAY_S", 0.01)
  monkeypatch.setattr(outage, "_ended", float("-inf"))
  outage.arm(0.3)
  try:
    answers = iter([ConnectionRefusedError(111, "refused")] * 3 + [None])

    def request():
      failure = next(answers)
      if failure:
        raise failure
      return "done"
    assert outage.retry(request, "http://store", "to write gs://b/x") == "done"
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and err[0].startswith("warning: http://store does not answer")
    assert err[1].startswith("http://store answers again after")
    monkeypatch.setattr(outage, "_ended", float("-inf"))

    def never():
      raise ConnectionRefusedError(111, "refused")
    with pytest.raises(UserError, match=r"http://store did not answer for 0 s "
                                        r"\(train.storage_outage_s=0\) while this run waited to "
                                        r"write gs://b/y; what was written before is intact"):
      outage.retry(never, "http://store", "to write gs://b/y")
    outage.arm(0.3)  # a new run: the process that gave up fails every request at once
    with pytest.raises(ValueError):  # not an outage: raised at once
      outage.retry(lambda: int("x"), "http://store", "to write")
  finally:
    outage.arm(0)
