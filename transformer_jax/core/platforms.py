"""Which JAX platforms a run starts: the CPU alone on a machine without an accelerator.

With `libtpu` installed (it comes with the test extra, for `--mode=compile`), JAX tries to start
a TPU runtime on every machine, and on one without a TPU that runtime prints five lines of
warnings before JAX falls back to the CPU. So on a machine with neither a TPU nor a GPU the
command line asks JAX for the CPU only, before JAX starts; an explicit `JAX_PLATFORMS` always
wins. Compiling for a TPU slice (`tools/compile.py`) loads libtpu on its own and quietly
(`quiet_tpu_compiler`); compiling for GPUs that are not here starts the CPU backend alone, on
any machine (`cpu_only_to_compile_for_gpus`).
"""

from __future__ import annotations

import glob
import os
import sys

_GPU_DEVICE_FILES = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg", "/dev/kfd")
# TPU VMs expose their chips as /dev/accel* (v4, v5e) or VFIO groups (v5p, v6e).
_TPU_DEVICE_FILES = ("/dev/accel*", "/dev/vfio/[0-9]*")


def has_tpu() -> bool:
  """Whether a TPU may be attached. JAX's own PCI check (it knows every TPU's device id) or the
  device files of a TPU VM; any doubt counts as a TPU, so a TPU machine is never held to the
  CPU."""
  if any(glob.glob(pattern) for pattern in _TPU_DEVICE_FILES):
    return True
  try:
    from jax._src import hardware_utils  # private, but updated with every new TPU
    return hardware_utils.num_available_tpu_chips_and_device_id()[0] > 0
  except Exception:  # the helper moved or changed: assume a TPU rather than force the CPU
    return True


def has_gpu() -> bool:
  return any(os.path.exists(path) for path in _GPU_DEVICE_FILES)


def cpu_only_unless_accelerated() -> None:
  """Asks JAX for the CPU only (JAX_PLATFORMS=cpu, also for child processes) when JAX_PLATFORMS
  is unset and this machine has no TPU and no GPU. Call it before JAX starts a backend."""
  if "JAX_PLATFORMS" in os.environ or has_tpu() or has_gpu():
    return
  os.environ["JAX_PLATFORMS"] = "cpu"
  if "jax" in sys.modules:  # imported already: it read the variable then
    sys.modules["jax"].config.update("jax_platforms", "cpu")


def quiet_tpu_compiler() -> None:
  """Lets libtpu load as a compiler on a machine without a TPU without its start-up warnings:
  the runtime wants to know the slice it runs on, and a single host of any type satisfies it.
  Does nothing on a TPU machine or where the variables are set."""
  if not has_tpu():
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-8")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    # Without a TPU there is no chip to guard: let several processes load libtpu at once (the
    # runtime's lock file would otherwise refuse the second compile on this machine).
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def cpu_only_to_compile_for_gpus() -> None:
  """Asks JAX for the CPU backend alone (JAX_PLATFORMS=cpu, overriding any value), before a
  backend starts: the CUDA plugin then registers its compiler, which `get_topology_desc`
  needs, without a driver. Asked for the CUDA backend, the plugin looks for a GPU, fails at
  cuInit on a machine without one and never registers; on a GPU machine it would take the GPUs
  (and their memory) that a compile does not use."""
  os.environ["JAX_PLATFORMS"] = "cpu"
  if "jax" in sys.modules:  # imported already (no backend started yet): it read the variable
    sys.modules["jax"].config.update("jax_platforms", "cpu")


def quiet_compiler_logs() -> None:
  """Keeps XLA's C++ log lines off stderr (TF_CPP_MIN_LOG_LEVEL=3, over any lower level: libtpu
  sets 1 in the environment it leaves to child processes) for a process that only compiles:
  XLA:GPU logs its doubts about a program larger than the part (the scheduler's memory limit,
  rematerialisation), and `--mode=compile` reports what does not fit in one line itself. Call it
  before JAX is imported: XLA reads the level when it loads."""
  os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
