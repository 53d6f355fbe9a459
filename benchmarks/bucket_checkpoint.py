"""Save and restore time of a model's train-state checkpoint: local disk against gs:// and s3://.

  python -m benchmarks.bucket_checkpoint [CONFIG [STORES]]   (default: base local,gs,s3)

The buckets are the emulators of the tests (tests/emulators.py: gcp-storage-emulator, moto's S3
server) on 127.0.0.1, so the numbers measure this program's path through TensorStore's gcs and
s3 drivers and HTTP, not a real bucket's bandwidth. The state is CONFIG's TrainState (parameters
and Adam moments) filled with normal noise (zeros would compress to nothing). Save:
`checkpoint.Manager.save` and its wait (orbax's async save, made whole). Restore:
`Manager.restore` of the newest step, its checksum check included. Prints one JSON line per
store.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import tempfile
import time

import jax
import numpy as np

from tests import emulators
from transformer_jax import config as config_lib
from transformer_jax.train import checkpoint, sharding
from transformer_jax.train import state as state_lib


def measure(config, workdir: str, state, target) -> dict:
  manager = checkpoint.Manager(workdir, config, "0" * 64, writable=True)
  start = time.perf_counter()
  manager.save(1, state)
  manager.wait()
  saved = time.perf_counter() - start
  manager.close()
  reader = checkpoint.Manager(workdir, config, "0" * 64)
  start = time.perf_counter()
  restored = reader.restore(target)
  jax.block_until_ready(restored)
  restored_s = time.perf_counter() - start
  reader.close()
  return {"workdir": workdir.split("://")[0] + "://" if "://" in workdir else "local disk",
          "save_s": round(saved, 2), "restore_s": round(restored_s, 2)}


def main(name: str = "base", stores: str = "local,gs,s3") -> None:
  config = importlib.import_module(f"transformer_jax.experiments.{name}").get_config()
  model_config = config_lib.validate(config, jax.default_backend())
  mesh = sharding.make_mesh(config.mesh.to_dict())
  optimizer = state_lib.make_optimizer(config.train, model_config.d_model)
  target = state_lib.abstract_state(model_config, optimizer, mesh)
  rng = np.random.default_rng(0)
  state = jax.tree.map(lambda s: jax.device_put(
      rng.standard_normal(s.shape).astype(s.dtype) if s.shape else np.zeros((), s.dtype),
      s.sharding), target)
  size = sum(x.nbytes for x in jax.tree.leaves(state))
  print(json.dumps({"config": name, "state_bytes": size}), flush=True)
  stores = stores.split(",")
  if "local" in stores:
    with tempfile.TemporaryDirectory() as local:
      print(json.dumps(measure(config, local, state, target)), flush=True)
  for scheme, emulator, variable in (("gs", emulators.gcs, "gcs_url"),
                                     ("s3", emulators.s3, "s3_url")):
    if scheme in stores:
      with emulator() as url:
        os.environ.update(emulators.environment(**{variable: url}))
        emulators.make_bucket(f"{scheme}://bench")
        print(json.dumps(measure(config, f"{scheme}://bench/run", state, target)), flush=True)


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("name", metavar="config", nargs="?", default="base",
                      help="an experiment's name (default: base)")
  parser.add_argument("stores", nargs="?", default="local,gs,s3", help="of local, gs, s3")
  main(**vars(parser.parse_args()))
