"""SCAN with a decoder-only model: each example is one sequence "command EOS BOS actions EOS",
the loss falls on the actions only (a prefix LM), and decoding continues the prompt "command
EOS BOS" from the KV cache. The recipe of scan_simple.py (the `make demo` model's data, batches
and schedule) with 4 pre-LN layers instead of 2+2, about the same size:

  .venv/bin/python launch.py --config=experiments/scan_decoder.py --workdir=runs/scan_decoder

The length split with this model is one trial of scan_length.py's sweep.
"""

from transformer_jax.experiments import scan_simple


def get_config():
  c = scan_simple.get_config()
  c.model.update(arch="decoder_only", num_decoder_layers=4, norm="pre", max_len=128)
  return c
