"""hostmem.keep_freed_memory: a large block freed and allocated again costs no new page faults."""

import subprocess
import sys
import textwrap

import pytest

from transformer_jax.core import hostmem
from transformer_jax.experiments import bench_cpu
from transformer_jax.experiments import tiny as tiny_experiment

PROGRAM = textwrap.dedent("""
    import ctypes, resource, sys
    from transformer_jax.core import hostmem
    applied = hostmem.keep_freed_memory() if sys.argv[1] == "keep" else None
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    def faults_of_a_fresh_block():  # what XLA:CPU does with its temporaries, through malloc
      before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
      size = 64 * 2**20
      block = libc.malloc(size)
      ctypes.memset(block, 1, size)
      libc.free(block)
      return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    faults_of_a_fresh_block()  # the first time, every page is new in either case
    print(applied, faults_of_a_fresh_block())
""")


def _second_block_faults(mode):
  out = subprocess.run([sys.executable, "-c", PROGRAM, mode], capture_output=True, text=True,
                       check=True).stdout.split()
  return out[0], int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc settings")
def test_freed_memory_is_reused_without_page_faults():
  applied, kept = _second_block_faults("keep")
  if applied != "True":
    pytest.skip("not glibc")
  _, default = _second_block_faults("default")
  pages = 64 * 2**20 // 4096
  assert default > pages // 2  # glibc's default: the block was unmapped and faults in again
  assert kept < pages // 20


def test_auto_keeps_memory_only_for_steps_with_large_arrays():
  tiny, bench = tiny_experiment.get_config(), bench_cpu.get_config()
  assert not hostmem.worth_keeping(tiny, "train")  # its steps' blocks stay on malloc's heap
  assert hostmem.worth_keeping(bench, "benchmark")  # 0.51 GiB of temporaries measured
  # The estimate grows with the tokens of a step and with the vocabulary.
  small = hostmem.step_activation_bytes(bench, "benchmark")
  bench.benchmark.batch_size *= 2
  assert hostmem.step_activation_bytes(bench, "benchmark") == 2 * small
  tiny.model.vocab_size = 1_000_000
  assert hostmem.worth_keeping(tiny, "train")
