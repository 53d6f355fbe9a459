"""core/datastack.py: calls from its frame never map a chunk of CPython's frame stack anew.

Counted in page faults (each chunk mapped afresh faults its first page in), not timed.
"""

import resource
import sys
import threading

import pytest

from transformer_jax.core import datastack


def leaf(a=0, b=0, c=0, d=0, e=0, f=0, g=0, h=0):
  return a


def hot_call_at(depth: int, calls: int) -> None:
  """`calls` calls of leaf() from `depth` frames below this one."""
  if depth:
    return hot_call_at(depth - 1, calls)
  for _ in range(calls):
    leaf()


def faults_of_hot_calls(max_depth=600, calls=500) -> int:
  """Minor page faults of a hot call at every depth up to max_depth: some depth puts leaf()'s
  frame across a chunk's edge (600 frames of hot_call_at span several chunks of 16 KiB)."""
  before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
  for depth in range(max_depth):
    hot_call_at(depth, calls)
  return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before


def in_a_new_thread(fn):
  """fn() on a thread of its own: a frame stack of its own, with no roomy frame below (the
  tests themselves run from one: conftest.py)."""
  result = []
  thread = threading.Thread(target=lambda: result.append(fn()))
  thread.start()
  thread.join()
  return result[0]


@pytest.mark.skipif(not hasattr(resource, "RUSAGE_THREAD"),
                    reason="counts one thread's page faults (Linux)")
def test_a_hot_call_at_any_depth_maps_no_chunk_from_the_roomy_frame():
  outside = in_a_new_thread(faults_of_hot_calls)
  inside = in_a_new_thread(lambda: datastack.call(faults_of_hot_calls))
  # Inside: the pages of the chunk that the deepest frames touch for the first time (about 18),
  # not one per call.
  assert inside < 100, (inside, outside)
  if (3, 11) <= sys.version_info[:2] <= (3, 13) and sys.implementation.name == "cpython":
    # Where measured (3.11, 3.12, 3.13: 5811 faults outside): each call at a chunk's edge
    # maps the next chunk and faults it in, so the probe sees the cost it removes.
    assert outside > 2000, outside


def test_call_passes_arguments_results_and_exceptions_through():
  assert datastack.call(divmod, 17, 5) == (3, 2)
  assert datastack.call(dict, a=1, b=2) == {"a": 1, "b": 2}
  with pytest.raises(ZeroDivisionError):
    datastack.call(divmod, 1, 0)
  # Nested calls and recursion deeper than the room (a chunk of its own beyond it) still work.
  assert datastack.call(datastack.call, sum, range(4)) == 6
  limit = sys.getrecursionlimit()
  sys.setrecursionlimit(limit + 6000)
  try:
    assert datastack.call(hot_call_at, 5000, 1) is None
  finally:
    sys.setrecursionlimit(limit)
