"""A 1.5B-parameter Transformer: d_model 2048, 16 heads, d_ff 8192, 12+12 layers, 32k vocabulary.

Beyond what one TPU v5e chip holds when every device keeps all the parameters and their Adam
state: 12 bytes per parameter in float32, 16.4 GiB against the chip's 16 GiB, before
activations. It trains when the parameters and optimizer state are split over the devices
(`config.mesh.fsdp`):

  launch.py --config=experiments/xl.py --mode=compile --config.compile.topology=v5e:2x4 \
    --config.mesh.data=1 --config.mesh.fsdp=8

fits a v5e-8 slice, and with --config.mesh.data=8 (data parallel only) it does not
(docs/benchmarks.md has the compiler's numbers).
"""

from transformer_jax.experiments import big


def get_config():
  c = big.get_config()
  c.model.update(d_model=2048, num_heads=16, d_ff=8192, num_encoder_layers=12,
                 num_decoder_layers=12, vocab_size=32000, dropout_rate=0.1)
  return c
