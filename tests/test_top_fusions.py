"""benchmarks/top_fusions.py: the kernels of an optimised program, charged their bytes and
FLOPs, on a GPU program of known sizes (XLA's GPU compiler, on the CPU)."""

import importlib.util
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.tools import compile as compile_lib

REPO = pathlib.Path(__file__).resolve().parents[1]
_SPEC = importlib.util.spec_from_file_location("top_fusions",
                                               REPO / "benchmarks" / "top_fusions.py")
top_fusions = importlib.util.module_from_spec(_SPEC)
sys.modules["top_fusions"] = top_fusions
_SPEC.loader.exec_module(top_fusions)


def test_a_matmul_and_an_elementwise_kernel_are_charged_their_bytes_and_flops():
  pytest.importorskip("jax_plugins.xla_cuda12",
                      reason="compiling for GPUs needs the gpu-compile extra (jax-cuda12-plugin)")
  devices = compile_lib.gpu_devices("h100", 1, 1)
  place = jax.sharding.NamedSharding(jax.sharding.Mesh(np.array(devices), ("d",)),
                                     jax.sharding.PartitionSpec())
  m, k, n = 1024, 2048, 4096
  x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16, sharding=place)
  w = jax.ShapeDtypeStruct((k, n), jnp.bfloat16, sharding=place)
  # The product, then a float32 softmax over its rows: a reduction XLA cannot fuse into the GEMM.
  compiled = jax.jit(lambda x, w: jax.nn.softmax((x @ w).astype(jnp.float32))).lower(
      x, w).compile()
  found = top_fusions.kernels(compiled.as_text(), compile_lib.ITEM_BYTES,
                              compile_lib.matrix_products)
  assert sum(f[1] for f in found) == 2 * m * n * k  # the product's FLOPs, in one kernel
  gemm = max(found, key=lambda f: f[1])
  assert gemm[1] == 2 * m * n * k and "dot_general" in gemm[4]
  assert gemm[0] >= 2 * (m * k + k * n + m * n)  # reads both operands, writes the product
  # The float32 output alone is m n 4 bytes; the largest kernel moves at least that.
  assert found[0][0] >= 4 * m * n and found[0][0] >= max(f[0] for f in found)


def test_the_convolutions_of_a_tpu_program_are_charged_their_flops():
  # XLA:TPU writes matrix products as `convolution`s, a batched one as a window over the
  # lhs-dilated batch whose other taps fall on holes: both must count 2 m n k per product.
  pytest.importorskip("libtpu")
  devices = compile_lib.topology_devices("v5e:2x2")[:1]
  place = jax.sharding.NamedSharding(jax.sharding.Mesh(np.array(devices), ("d",)),
                                     jax.sharding.PartitionSpec())
  b, m, k, n = 4, 256, 512, 384
  x = jax.ShapeDtypeStruct((b, m, k), jnp.bfloat16, sharding=place)
  w = jax.ShapeDtypeStruct((b, k, n), jnp.bfloat16, sharding=place)
  w2 = jax.ShapeDtypeStruct((k, n), jnp.bfloat16, sharding=place)
  compiled = jax.jit(lambda x, w, w2: (jax.nn.relu(jnp.einsum("bmk,bkn->bmn", x, w)),
                                       x @ w2)).lower(x, w, w2).compile()
  text = compiled.as_text()
  assert "convolution(" in text and " dot(" not in text
  found = top_fusions.kernels(text, compile_lib.ITEM_BYTES, compile_lib.matrix_products)
  assert sorted(f[1] for f in found if f[1]) == [2 * b * m * k * n] * 2
  # XLA's own count agrees (it adds the relu's b m n).
  assert sum(f[1] for f in found) == pytest.approx(compiled.cost_analysis()["flops"], rel=0.01)
