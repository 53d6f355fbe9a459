"""The same model, batch and optimizer in PyTorch (eager `torch.nn.Transformer`), for a side-by-side
step time (`--mode=benchmark --config.benchmark.torch=True` times it in alternating blocks with the
JAX step). Needs the optional extra: `.venv/bin/pip install -e '.[torch]'` (torch 2.13.0, CPU).
On a machine with CUDA it runs on the GPU; `benchmark.torch_autocast` (bf16 autocast) and
`benchmark.torch_compile` (a torch.compile backend, e.g. inductor) make it the fair opponent of a
bf16 JAX step there. Both are off by default, which keeps the CPU comparison eager and float32.

Matched to transformer_jax: post-LN layers with ReLU FFN, dropout, a shared embedding scaled by
sqrt(d_model) plus sinusoidal positions, an output projection tied to the embedding,
label-smoothed cross-entropy, Adam(0.9, 0.98, 1e-9). torch.nn.Transformer adds a final LayerNorm
to each stack (2 * 2 * d_model parameters more); the parameter counts are printed side by side.
"""

from __future__ import annotations

import math
import os

import numpy as np

from transformer_jax.core.errors import UserError
from transformer_jax.model.positions import sinusoidal_positions


def make_step(model_config, config, batch):
  """Builds the model and returns (step, parameter count); `step()` runs one warmed-up train step.

  batch: {"inputs", "targets"} int arrays, the synthetic batch the JAX step is timed on.
  """
  # libgomp's threads spin for a while after each parallel region by default. Timed in
  # alternating blocks with JAX, that spinning took the cores from the first JAX steps of every
  # block (about +60 ms a step); passive waiting left PyTorch's own step time unchanged.
  # Read once when torch loads its OpenMP runtime, so it must be set before the import.
  os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
  try:
    import torch  # after OMP_WAIT_POLICY is set
  except ImportError as e:
    raise UserError(f"benchmark.torch=True needs PyTorch ({e}); install it with "
                    "pip install -e '.[torch]'") from None
  from torch import nn

  torch.manual_seed(0)
  torch.set_num_threads(os.cpu_count() or 1)
  cfg, b = model_config, config.benchmark
  device = "cuda" if torch.cuda.is_available() else "cpu"

  class Model(nn.Module):
    def __init__(self):
      super().__init__()
      self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model, padding_idx=0)
      nn.init.normal_(self.embed.weight, std=cfg.d_model**-0.5)
      self.register_buffer("positions", torch.from_numpy(
          sinusoidal_positions(cfg.max_len, cfg.d_model, cfg.position_base)))
      self.transformer = nn.Transformer(
          d_model=cfg.d_model, nhead=cfg.num_heads, num_encoder_layers=cfg.num_encoder_layers,
          num_decoder_layers=cfg.num_decoder_layers, dim_feedforward=cfg.d_ff,
          dropout=cfg.dropout_rate, activation=cfg.activation, batch_first=True,
          norm_first=cfg.norm == "pre", layer_norm_eps=cfg.layer_norm_eps)
      self.drop = nn.Dropout(cfg.dropout_rate)

    def embed_tokens(self, tokens):
      x = self.embed(tokens) * math.sqrt(cfg.d_model) + self.positions[: tokens.shape[1]]
      return self.drop(x)

    def forward(self, source, decoder_inputs):
      length = decoder_inputs.shape[1]
      causal = torch.triu(torch.ones(length, length, dtype=torch.bool, device=source.device),
                          diagonal=1)  # True = masked
      y = self.transformer(self.embed_tokens(source), self.embed_tokens(decoder_inputs),
                           tgt_mask=causal, tgt_is_causal=True,
                           src_key_padding_mask=source == 0, memory_key_padding_mask=source == 0,
                           tgt_key_padding_mask=decoder_inputs == 0)
      return y @ self.embed.weight.T

  model = Model().to(device)
  model.train()
  optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9)
  forward = model
  if b.torch_compile:
    if b.torch_compile not in torch._dynamo.list_backends(exclude_tags=()):
      raise UserError(f"benchmark.torch_compile={b.torch_compile!r} is not a torch.compile "
                      f"backend; use e.g. {', '.join(torch._dynamo.list_backends())} (or '' for "
                      "no compilation)")
    forward = torch.compile(model, backend=b.torch_compile)
  source = torch.from_numpy(batch["inputs"]).long().to(device)
  targets = torch.from_numpy(batch["targets"]).long().to(device)
  decoder_inputs = torch.cat([torch.ones_like(targets[:, :1]), targets[:, :-1]], dim=1)
  loss_fn = nn.CrossEntropyLoss(ignore_index=0, label_smoothing=config.train.label_smoothing)

  def step():
    optimizer.zero_grad(set_to_none=True)
    # Parameters stay float32, as in the JAX model; autocast runs the products in bf16.
    with torch.autocast(device, dtype=torch.bfloat16, enabled=b.torch_autocast):
      logits = forward(source, decoder_inputs)
      loss = loss_fn(logits.reshape(-1, cfg.vocab_size), targets.reshape(-1))
    loss.backward()
    optimizer.step()
    if device == "cuda":  # kernels run asynchronously: the caller's clock must see them finish
      torch.cuda.synchronize()
    return loss

  for _ in range(b.warmup):
    step()
  params = sum(int(np.prod(p.shape)) for p in model.parameters())
  return step, params
