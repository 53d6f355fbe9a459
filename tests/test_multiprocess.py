"""Two processes on localhost (CPU, gloo collectives, 2 devices each) train like one 4-device
process, with the parameters split over the devices of both: started with explicit flags, and
as the two workers of a Cloud TPU VM pod that JAX finds through the VM's metadata server."""

import http.server
import json
import os
import subprocess
import sys
import threading

import jax
import numpy as np
import pytest
from launcher import NAMESPACE, cpu_environment, job_outputs, namespaces_work, start_job

from tests import emulators
from transformer_jax.data import prepare
from transformer_jax.eval import load
from transformer_jax.experiments import tiny

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARGS = ["--config=experiments/tiny.py", "--mode=train", "--config.train.steps=3",
        "--config.train.log_every=1", "--config.train.checkpoint_every=3",
        "--config.eval.max_examples=8",
        # The key bias has a zero gradient in exact arithmetic; Adam would amplify its rounding
        # noise (which depends on the reduction order) to +-lr. Without it, all must agree.
        "--config.model.qkv_bias=False"]


_env = cpu_environment  # (test_trackers' job of two processes imports it by this name)


def _train_losses(workdir):
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    return [(r["step"], r["loss"], r["tokens"]) for r in map(json.loads, f)
            if r["split"] == "train"]


def _params(workdir):
  config = tiny.get_config()
  config.model.qkv_bias = False
  return jax.tree.leaves(jax.device_get(load.load_trained(config, str(workdir)).params))


def _outputs(processes) -> list:
  outputs = [p.communicate(timeout=300)[0].decode() for p in processes]
  for process, output in zip(processes, outputs):
    assert process.returncode == 0, output[-3000:]
  return outputs


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
  """The reference both jobs of two processes must match: one process with 4 data-parallel
  devices, the same global batch."""
  workdir = tmp_path_factory.mktemp("one") / "run"
  _outputs([subprocess.Popen([sys.executable, "launch.py", *ARGS, f"--workdir={workdir}"],
                             cwd=ROOT, env=cpu_environment(4), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT)])
  return workdir


def _assert_trains_like(one, two):
  """The same steps, tokens and losses, and the same final parameters."""
  losses_one, losses_two = _train_losses(one), _train_losses(two)
  assert [s for s, _, _ in losses_two] == [1, 2, 3]
  for (_, loss_a, tokens_a), (_, loss_b, tokens_b) in zip(losses_one, losses_two, strict=True):
    assert tokens_a == tokens_b
    assert loss_b == pytest.approx(loss_a, rel=1e-5)
  for a, b in zip(_params(one), _params(two), strict=True):
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


def test_data_that_process_0_refuses_stops_every_process_of_the_job(tmp_path):
  """Two processes started with explicit flags (--coordinator_address, --num_processes,
  --process_id) form one job: process 0 prepares the data; its one-line error ends the other
  too, each with exit 2, instead of leaving it waiting for data that never comes. (That a job of
  two processes trains like one process: the TPU VM pod below, which starts the same way once
  JAX has found its coordinator, process count and ids.)"""
  codes, outputs = job_outputs(start_job(
      [sys.executable, "launch.py", *ARGS, f"--workdir={tmp_path / 'w'}",
       "--config.model.vocab_size=12"],  # too few pieces for SCAN's words
      cpu_environment(2, TRANSFORMER_JAX_CACHE=str(tmp_path / "cache"))))
  assert codes == [2, 2], outputs
  assert "error: a word vocabulary of model.vocab_size=12 pieces" in outputs[0]
  assert "error: process 0 of this job could not prepare the data" in outputs[1]
  assert not (tmp_path / "w").exists()


def test_a_job_of_two_processes_on_the_cpu_prints_no_gloo_lines(tmp_path):
  """Gloo, the CPU's collectives between processes, prints "[Gloo] Rank N is connected to ..."
  on stdout each time it connects: a job of two processes shows none of them, and all of its own
  output (process 0's summary at the end)."""
  codes, outputs = job_outputs(start_job(
      [sys.executable, "launch.py", *ARGS, f"--workdir={tmp_path / 'w'}"],
      cpu_environment(2, TRANSFORMER_JAX_CACHE=str(tmp_path / "cache"))))
  assert codes == [0, 0], outputs
  assert "Run summary" in outputs[0] and "Run summary" not in outputs[1]
  for output in outputs:
    assert [line for line in output.splitlines() if "[Gloo]" in line] == [], output


# ----------------------------------------------------------------------------- a TPU VM pod


class MetadataServer:
  """The Compute Engine metadata server of worker `worker` of a TPU VM pod of `workers` hosts,
  on 127.0.0.1: the instance attributes that JAX's pod detection reads
  (jax/_src/clusters/cloud_tpu_cluster.py: GceTpuCluster), answered, as the real server does,
  only to requests with the header Metadata-Flavor: Google. `asked`: the keys requested.
  workers=0: the metadata server of a GKE node, which has none of these attributes."""

  def __init__(self, worker: int, workers: int):
    attributes = {} if workers == 0 else {
        "agent-worker-number": str(worker),
        "worker-network-endpoints": ",".join(["unknown:unknown:127.0.0.1"] * workers),
        "tpu-env": f"ACCELERATOR_TYPE: 'v5litepod-{4 * workers}'\nWORKER_ID: '{worker}'\n",
    }
    self.asked = []
    prefix = "/computeMetadata/v1/instance/attributes/"
    outer = self

    class Handler(http.server.BaseHTTPRequestHandler):
      def do_GET(self):
        key = self.path[len(prefix):] if self.path.startswith(prefix) else None
        outer.asked.append(key)
        if self.headers.get("Metadata-Flavor") != "Google":
          status, body = 403, b"Missing Metadata-Flavor:Google header."
        elif key in attributes:
          status, body = 200, attributes[key].encode()
        else:
          status, body = 404, b"not found"
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

      def log_message(self, *args):
        pass

    self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=self._server.serve_forever, daemon=True).start()
    self.address = f"127.0.0.1:{self._server.server_port}"

  def close(self):
    self._server.shutdown()
    self._server.server_close()


def _on_a_tpu_vm(command, directory) -> list:
  """`command` run where JAX's start-up (jax/_src/cloud_tpu_init.py) takes the machine for a
  Cloud TPU VM. It looks for a TPU chip on the PCI bus (/sys/bus/pci/devices/*/vendor and
  device); without one it sets TPU_SKIP_MDS_QUERY, and its pod detection never asks the metadata
  server. In a mount namespace of its own the command sees one v5e chip there; where namespaces
  are refused, a prelude removes TPU_SKIP_MDS_QUERY after `import jax` instead. JAX_FORCE_TPU_INIT
  (in the environment) stands for the libtpu package, which is not installed."""
  if namespaces_work() and os.path.isdir("/sys/bus/pci/devices"):
    devices = directory / "pci"
    if not devices.exists():
      devices.mkdir()
      for real in os.listdir("/sys/bus/pci/devices"):  # the real ones too: gloo reads them
        (devices / real).symlink_to(os.path.realpath(f"/sys/bus/pci/devices/{real}"))
      chip = devices / "0000:ff:04.0"
      chip.mkdir()
      (chip / "vendor").write_text("0x1ae0\n")  # Google
      (chip / "device").write_text("0x0063\n")  # TPU v5e
      (chip / "class").write_text("0x120000\n")  # a processing accelerator (gloo reads it)
    return [*NAMESPACE, "sh", "-c", 'mount --bind "$0" /sys/bus/pci/devices && exec "$@"',
            str(directory / "pci"), *command]
  prelude = ("import os, runpy, sys, jax; os.environ.pop('TPU_SKIP_MDS_QUERY', None); "
             "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")
  return [command[0], "-c", prelude, *command[1:]]


def _tpu_vm_env(server: MetadataServer, port: int, cache_dir) -> dict:
  """The environment of a worker of a TPU VM pod: its metadata server, the coordinator's port
  (JAX's default, 8482, may be taken here), no variable of another cluster kind."""
  env = dict(cpu_environment(2), JAX_FORCE_TPU_INIT="1", GCE_METADATA_IP=server.address,
             JAX_COORDINATOR_PORT=str(port), TRANSFORMER_JAX_CACHE=str(cache_dir),
             NO_PROXY="127.0.0.1", no_proxy="127.0.0.1")
  for name in ("TPU_WORKER_HOSTNAMES", "TPU_PROCESS_ADDRESSES", "TPU_SKIP_MDS_QUERY",
               "SLURM_JOB_ID", "OMPI_MCA_orte_hnp_uri", "KUBERNETES_SERVICE_HOST"):
    env.pop(name, None)
  return env


@pytest.mark.parametrize("workers, gke_hosts", [(1, None), (2, None), (0, "h0,h1,h2")])
def test_the_pod_detection_counts_the_workers_of_a_tpu_vm(tmp_path, workers, gke_hosts):
  """A single-host slice (a v5litepod-8 is one VM) is one process: distributed start-up skipped.
  On GKE the pod's hosts come from TPU_WORKER_HOSTNAMES, which JAX reads before the metadata."""
  server = MetadataServer(0, workers)
  script = tmp_path / "count.py"
  script.write_text("from transformer_jax.train import sharding\n"
                    "print('processes:', sharding.detected_process_count())\n")
  env = _tpu_vm_env(server, emulators.free_port(), tmp_path / "cache")
  if gke_hosts:
    env.update(TPU_WORKER_HOSTNAMES=gke_hosts, TPU_WORKER_ID="0")
  try:
    done = subprocess.run(_on_a_tpu_vm([sys.executable, str(script)], tmp_path), cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
  finally:
    server.close()
  assert done.returncode == 0, done.stderr[-3000:]
  if gke_hosts:  # JAX tried the TPU VM's attributes first, then read the GKE variables
    assert "processes: 3" in done.stdout
    assert "agent-worker-number" in server.asked
  else:
    assert f"processes: {workers}" in done.stdout
    assert "worker-network-endpoints" in server.asked


def test_a_tpu_vm_pod_found_through_its_metadata_server_trains_as_one_job(tmp_path, one_process,
                                                                           monkeypatch, capsys):
  """Two processes with no flag about the job, each with its own metadata server: JAX's own
  detection makes them the two workers of one job (process count 2, one fsdp mesh over both),
  which trains like one process. Like the hosts of a pod without a shared file system, each has
  its own local cache, and they share the data through a cache in a bucket (the GCS emulator):
  process 0 alone prepares it; a later start on the same data, on another host, reads it."""
  pod = tmp_path / "pod"
  servers = [MetadataServer(worker, 2) for worker in (0, 1)]
  with emulators.gcs_buckets("bucket") as gcs_url:
    try:
      port = emulators.free_port()
      command = [sys.executable, "launch.py", *ARGS, f"--workdir={pod}", "--config.mesh.data=1",
                 "--config.mesh.fsdp=4", "--config.data.cache_dir=gs://bucket/cache"]
      pair = [subprocess.Popen(_on_a_tpu_vm(command, tmp_path), cwd=ROOT,
                               env={**_tpu_vm_env(server, port, tmp_path / f"host{i}"),
                                    **emulators.environment(gcs_url)},
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
              for i, server in enumerate(servers)]
      outputs = _outputs(pair)
    finally:
      for server in servers:
        server.close()
    # A later start on the same data (what the next job runs first, on a fresh host) reads the
    # bucket's cache too.
    monkeypatch.setenv("TRANSFORMER_JAX_CACHE", str(tmp_path / "host2"))
    config = tiny.get_config()
    config.data.cache_dir = "gs://bucket/cache"
    capsys.readouterr()
    prepare.prepare_data(config, str(tmp_path / "next"), config.model.vocab_size)
    later = capsys.readouterr().out
  for server in servers:  # JAX asked each worker's own server who it is and who the others are
    assert {"agent-worker-number", "worker-network-endpoints"} <= set(server.asked)
  assert "4 device(s) (cpu) in 2 process(es), mesh data 1 x fsdp 4 x tensor 1" in outputs[0]
  assert "Run summary" in outputs[0] and "Run summary" not in outputs[1]  # process 0 reports
  _assert_trains_like(one_process, pod)
  # The data, prepared once: by process 0, while process 1 waits and then reads the cache.
  assert "tokenising the 'train' split: writing it to the cache (gs://bucket/cache/" in outputs[0]
  assert "training the tokenizer" in outputs[0]
  assert "process 1: waiting for process 0 to prepare the data" in outputs[1]
  assert "tokenising" not in outputs[1] and "training the tokenizer" not in outputs[1]
  assert "warning: the cache" not in outputs[1]
  assert "tokenising" not in later and "training the tokenizer" not in later
