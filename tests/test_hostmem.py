"""hostmem.keep_freed_memory: a large block freed and allocated again costs no new page faults."""

import subprocess
import sys
import textwrap

import pytest

PROGRAM = textwrap.dedent("""
    import ctypes, resource, sys
    from transformer_jax import hostmem
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
