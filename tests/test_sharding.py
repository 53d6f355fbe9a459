"""The mesh, the logical-axis rules, and the same update on every mesh (8 simulated devices)."""

import json
import math
import os
import subprocess
import textwrap

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P
from launcher import QUICK_COMPILE, script_command

from transformer_jax.core.errors import UserError
from transformer_jax.model import ModelConfig
from transformer_jax.train import sharding
from transformer_jax.train import state as state_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_mesh_shape_fills_the_axis_given_as_minus_one():
  assert sharding.mesh_shape({"data": -1, "fsdp": 1, "tensor": 1}, 8) == {
      "data": 8, "fsdp": 1, "tensor": 1}
  assert sharding.mesh_shape({"data": -1, "fsdp": 4, "tensor": 1}, 8) == {
      "data": 2, "fsdp": 4, "tensor": 1}
  assert sharding.mesh_shape({"data": 1, "fsdp": -1, "tensor": 2}, 8) == {
      "data": 1, "fsdp": 4, "tensor": 2}
  assert sharding.mesh_shape({"fsdp": 2, "tensor": 4}, 8) == {"data": 1, "fsdp": 2, "tensor": 4}
  assert sharding.mesh_shape(None, 3) == {"data": 3, "fsdp": 1, "tensor": 1}


@pytest.mark.parametrize("axes, count, message", [
    ({"data": -1, "fsdp": -1}, 8, "at most one -1"),
    ({"data": 0}, 8, "must be positive"),
    ({"data": -1, "fsdp": 3}, 8, "do not split into groups of 3"),
    ({"data": 2, "fsdp": 2, "tensor": 1}, 8, "has 4 places for 8 devices"),
    ({"model": 2}, 8, "unknown mesh axes"),
])
def test_mesh_shape_refuses_what_does_not_fit(axes, count, message):
  with pytest.raises(UserError, match=message):
    sharding.mesh_shape(axes, count)


def test_make_mesh_spans_every_device_with_auto_axes():
  mesh = sharding.make_mesh({"data": -1, "fsdp": 1, "tensor": 1})
  assert mesh.axis_names == sharding.MESH_AXES
  assert mesh.devices.size == jax.device_count()
  assert set(mesh.axis_types) == {jax.sharding.AxisType.Auto}


def _specs(mesh_shape, model_config):
  """Mesh PartitionSpecs of the train state's parameters on an abstract mesh of that shape."""
  mesh = jax.sharding.AbstractMesh(tuple(mesh_shape), sharding.MESH_AXES)
  optimizer = optax.adam(1e-3)
  shardings = state_lib.state_shardings(model_config, optimizer, mesh)
  return (jax.tree.map(lambda s: s.spec, shardings.params),
          jax.tree.map(lambda s: s.spec, shardings.opt_state[0].mu))


def test_rules_split_weights_over_fsdp_and_tensor_and_keep_the_rest_whole():
  cfg = ModelConfig(vocab_size=64, d_model=32, num_heads=4, num_encoder_layers=1,
                    num_decoder_layers=1, d_ff=64, max_len=16, positional="learned")
  params, mu = _specs((2, 4, 2), cfg)
  attention = params["decoder"]["layer_0"]["cross_attention"]
  assert attention["query"]["kernel"] == P("fsdp", "tensor", None)  # [embed, heads, kv]
  assert attention["query"]["bias"] == P("tensor", None)  # [heads, kv]
  assert attention["out"]["kernel"] == P("tensor", None, "fsdp")  # [heads, kv, embed]
  assert attention["out"]["bias"] == P("fsdp")
  ffn = params["encoder"]["layer_0"]["ffn"]
  assert ffn["wi"]["kernel"] == P("fsdp", "tensor") and ffn["wi"]["bias"] == P("tensor")
  assert ffn["wo"]["kernel"] == P("tensor", "fsdp")
  assert params["shared_embedding"]["embedding"] == P("tensor", "fsdp")  # [vocab, embed]
  assert params["encoder"]["positions"]["table"] == P(None, "fsdp")
  assert params["encoder"]["layer_0"]["ffn_block"]["norm"]["scale"] == P("fsdp")
  assert mu == params  # Adam's moments are split like their parameters


def test_a_dimension_the_mesh_does_not_divide_stays_whole():
  cfg = ModelConfig(vocab_size=50, d_model=32, num_heads=2, num_encoder_layers=1,
                    num_decoder_layers=1, d_ff=64, max_len=16)
  params, _ = _specs((1, 2, 4), cfg)
  assert params["shared_embedding"]["embedding"] == P(None, "fsdp")  # 50 tokens on 4 shards
  attention = params["encoder"]["layer_0"]["self_attention"]
  assert attention["query"]["kernel"] == P("fsdp", None, None)  # 2 heads on 4 shards
  assert params["encoder"]["layer_0"]["ffn"]["wi"]["kernel"] == P("fsdp", "tensor")


def test_padded_rows_keep_the_real_rows_and_are_empty():
  batch = {"inputs": np.arange(1, 13).reshape(3, 4), "targets": np.ones((3, 2), np.int32)}
  padded = sharding.pad_rows(batch, 8)
  assert padded["inputs"].shape == (8, 4) and padded["targets"].shape == (8, 2)
  np.testing.assert_array_equal(padded["inputs"][:3], batch["inputs"])
  assert not padded["inputs"][3:].any() and not padded["targets"][3:].any()
  assert sharding.padded_rows(12, 8) == 16 and sharding.padded_rows(16, 8) == 16


# The same few updates on 1 device and on four meshes of 8 (simulated) devices, a checkpoint
# saved on one mesh and resumed on others, and the bytes each device holds. One subprocess: the
# device count is fixed when JAX starts.
MESHES_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import jax, numpy as np
    from transformer_jax import config as config_lib
    from transformer_jax.data import pipeline, scan, tokenizer as tokenizer_lib
    from transformer_jax.experiments import tiny
    from transformer_jax.train import checkpoint, sharding, state as state_lib, step as step_lib

    assert jax.device_count() == 8, jax.devices()
    c = tiny.get_config()
    # Every split dimension divides its mesh axis: d_model 32, 4 heads, d_ff 64, vocab 32.
    # Dropout on: its masks must not depend on the mesh either. A batch of 12 rows does not
    # split over 8 devices: it is filled with empty rows.
    c.model.update(num_heads=4, dropout_rate=0.1, attention_dropout_rate=0.1, qkv_bias=False)
    c.data.update(batching="fixed", batch_size=12)
    c.train.update(grad_clip_norm=1.0, label_smoothing=0.1, learning_rate=3e-3)
    model_config = config_lib.validate(c)
    pairs = scan.load("simple", "train")[:48]
    tok = tokenizer_lib.train([t for p in pairs for t in p], 32, "word")
    data = pipeline.encode(pairs, tok, c.data.max_source_len, c.data.max_target_len)
    stream = pipeline.TrainStream(data, c.data, seed=0)
    optimizer = state_lib.make_optimizer(c.train, model_config.d_model)
    rng = jax.random.PRNGKey(0)
    meshes = {"1": ({"data": 1}, jax.devices()[:1]), "8,1,1": ({"data": 8}, None),
              "2,4,1": ({"data": 2, "fsdp": 4}, None), "2,2,2": ({"data": 2, "fsdp": 2,
              "tensor": 2}, None), "1,2,4": ({"data": 1, "fsdp": 2, "tensor": 4}, None)}
    steps = {}

    def mesh_and_step(name):
      if name not in steps:
        axes, devices = meshes[name]
        mesh = sharding.make_mesh(axes, devices)
        steps[name] = mesh, step_lib.make_train_step(model_config, c, mesh)
      return steps[name]

    def run(name, state, start, stop, losses):
      mesh, step = mesh_and_step(name)
      for k in range(start, stop):
        state, metrics = step(state, sharding.shard_batch(stream[k], mesh), rng)
        losses.append(float(metrics["loss"]))
      return state

    def flat(tree):
      return [np.asarray(x, np.float64).ravel().tolist()
              for x in jax.tree.leaves(sharding.to_host(tree))]

    results, trained = {"meshes": {}}, {}
    for name in meshes:
      mesh, _ = mesh_and_step(name)
      state = state_lib.init_state(model_config, optimizer, 0, mesh)
      if name == "1":
        results["init"] = flat(state.params)
      losses = []
      state = trained[name] = run(name, state, 0, 3, losses)
      # Bytes each device holds of each parameter and of its Adam moments, against the whole.
      shards = [[sharding.shard_bytes(x), x.nbytes, str(x.sharding.spec)] for x in
                jax.tree.leaves(state.params) + jax.tree.leaves(state.opt_state[-1][0].mu)]
      results["meshes"][name] = {"losses": losses, "params": flat(state.params),
                                 "shards": shards, "shape": dict(mesh.shape)}

    # Resume: 2 steps on (2,4,1), a checkpoint, 2 more steps on each of 3 meshes, against 4
    # steps without a stop.
    workdir = sys.argv[1]
    mesh, _ = mesh_and_step("2,4,1")
    losses = []
    state = run("2,4,1", state_lib.init_state(model_config, optimizer, 0, mesh), 0, 2, losses)
    manager = checkpoint.Manager(workdir, c, writable=True)
    manager.save(2, state)
    manager.wait()
    manager.close()
    results["uninterrupted"] = {"losses": losses[:], "params": None}
    state = run("2,4,1", state, 2, 4, results["uninterrupted"]["losses"])
    results["uninterrupted"]["params"] = flat(state.params)
    results["resumed"] = {}
    for name in ("8,1,1", "1", "2,4,1"):
      mesh, _ = mesh_and_step(name)
      reader = checkpoint.Manager(workdir, c)
      restored = reader.latest_good(state_lib.abstract_state(model_config, optimizer, mesh))
      reader.close()
      spec = str(jax.tree.leaves(restored.state.params)[0].sharding)
      losses = []
      state = run(name, restored.state, 2, 4, losses)
      results["resumed"][name] = {"losses": losses, "params": flat(state.params),
                                  "step": restored.step, "sharding": spec}

    # Evaluation (its greedy decoding included) from the sharded state of (1,2,4) after its 3
    # updates above, against the same parameters on one device; averaging two checkpoints of
    # (2,4,1) restored onto (1,2,4).
    from transformer_jax.eval import evaluate, load
    c.eval.update(batch_size=8, max_examples=12)  # a second batch of 4 rows and 4 empty ones
    mesh, _ = mesh_and_step("1,2,4")
    state = trained["1,2,4"]
    one_mesh, _ = mesh_and_step("1")
    single = jax.device_put(sharding.to_host(state.params), jax.devices()[0])
    results["evaluate"] = []
    for params, m in ((state.params, mesh), (single, one_mesh)):
      metrics = evaluate.evaluate(params, model_config, c, tok, pairs[:12], m)
      results["evaluate"].append({
          "metrics": {k: v for k, v in metrics.items() if isinstance(v, float)},
          "hypotheses": [sample["hypothesis"] for sample in metrics["samples"]]})
    manager = checkpoint.Manager(workdir, c, writable=True)
    manager.save(3, trained["2,4,1"])
    manager.wait()
    manager.close()
    reader = checkpoint.Manager(workdir, c)
    averaged = load.average_params(reader, state_lib.abstract_state(model_config, optimizer, mesh),
                                   [2, 3])
    reader.close()
    saved = [sharding.to_host(checkpoint.Manager(workdir, c).restore(
        state_lib.abstract_state(model_config, optimizer, one_mesh), step).params)
        for step in (2, 3)]
    results["average"] = {
        "sharding": str(jax.tree.leaves(averaged)[0].sharding.spec),
        "error": max(float(np.abs(a - (b + c_) / 2).max()) for a, b, c_ in zip(
            jax.tree.leaves(sharding.to_host(averaged)), jax.tree.leaves(saved[0]),
            jax.tree.leaves(saved[1])))}

    # The other architectures with the new options (grouped-query attention with 2 key/value
    # heads, which 4 tensor shards do not divide; relative bias tables split by head; the
    # masked-LM corruption drawn on the mesh): 3 updates on (1,2,4) as on one device.
    from transformer_jax.data import tasks
    results["architectures"] = {}
    for name, task, changes in (
        ("decoder_only", "seq2seq", dict(num_kv_heads=2, positional="relative_bias",
                                         activation="swiglu", norm_type="rmsnorm", norm="pre")),
        ("encoder_only", "mlm", dict(positional="rotary", parallel_block=True,
                                     activation="geglu"))):
      oc = tiny.get_config()
      oc.model.update(arch=name, num_heads=4, dropout_rate=0.1, qkv_bias=False, **changes)
      oc.data.update(task=task, batching="fixed", batch_size=12)
      if task == "mlm":
        oc.data.update(source="files", format="text", path="unused")
      # Adam's eps of 1e-9 turns the rounding noise of a gradient near zero into whole steps
      # (see qkv_bias above); 1e-6 keeps such a coordinate's step as small as its gradient.
      oc.train.update(grad_clip_norm=1.0, learning_rate=3e-3, adam_eps=1e-6)
      mc = config_lib.validate(oc)
      texts = pairs if task == "seq2seq" else [(s, "") for s, _ in pairs]
      other = pipeline.TrainStream(tasks.examples(oc.data, texts, tok), oc.data, seed=0)
      opt = state_lib.make_optimizer(oc.train, mc.d_model)
      runs = {}
      for mesh_name in ("1", "1,2,4"):
        axes, devices = meshes[mesh_name]
        mesh = sharding.make_mesh(axes, devices)
        step = step_lib.make_train_step(mc, oc, mesh)
        state = state_lib.init_state(mc, opt, 0, mesh)
        start, losses = flat(state.params), []
        for k in range(3):
          state, metrics = step(state, sharding.shard_batch(other[k], mesh), rng)
          losses.append(float(metrics["loss"]))
        runs[mesh_name] = {"losses": losses, "params": flat(state.params), "init": start}
      results["architectures"][name] = runs
    print(json.dumps(results))
""")


@pytest.fixture(scope="module")
def meshes(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("resume")
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=f"--xla_force_host_platform_device_count=8 {QUICK_COMPILE}")
  out = subprocess.run(script_command(MESHES_SCRIPT, workdir), env=env, cwd=ROOT,
                       capture_output=True, text=True)
  assert out.returncode == 0, out.stderr[-3000:]
  return json.loads(out.stdout.strip().splitlines()[-1])


def _assert_same_run(a, b):
  # Only the order of float32 sums differs (measured: parameters within 1.2e-7, losses 2e-7).
  np.testing.assert_allclose(b["losses"], a["losses"], rtol=2e-6)
  for x, y in zip(a["params"], b["params"]):
    np.testing.assert_allclose(y, x, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["8,1,1", "2,4,1", "2,2,2", "1,2,4"])
def test_every_mesh_makes_the_same_updates_as_one_device(meshes, name):
  one = meshes["meshes"]["1"]
  _assert_same_run(one, meshes["meshes"][name])
  moved = max(np.abs(np.asarray(a) - np.asarray(b)).max()
              for a, b in zip(one["params"], meshes["init"]))
  assert moved > 1e-3  # three real updates, not a no-op


@pytest.mark.parametrize("name", ["2,4,1", "2,2,2", "1,2,4"])
def test_each_device_holds_its_share_of_every_split_parameter(meshes, name):
  result = meshes["meshes"][name]
  shape = result["shape"]
  split_by_both = 0
  for shard, whole, spec in result["shards"]:
    axes = [name for name in ("fsdp", "tensor") if f"'{name}'" in spec]
    assert shard * math.prod(shape[a] for a in axes) == whole, (spec, shard, whole)
    assert "data" not in spec  # parameters are never split over the data axis
    split_by_both += len(axes) == 2
  total_shard = sum(shard for shard, _, _ in result["shards"])
  total = sum(whole for _, whole, _ in result["shards"])
  if shape["tensor"] > 1:
    assert split_by_both > 0  # the weight matrices: 1 / (fsdp x tensor) on each device
  # Everything but a few small vectors is split: well under 1/2 of the whole per device.
  assert total_shard < total / (shape["fsdp"] * shape["tensor"]) * 1.5


@pytest.mark.parametrize("name", ["8,1,1", "1", "2,4,1"])
def test_a_checkpoint_from_one_mesh_resumes_on_another_like_no_stop(meshes, name):
  resumed = meshes["resumed"][name]
  assert resumed["step"] == 2
  _assert_same_run(meshes["uninterrupted"], {
      "losses": meshes["uninterrupted"]["losses"][:2] + resumed["losses"],
      "params": resumed["params"]})


def test_decoding_and_evaluation_on_a_sharded_state_match_one_device(meshes):
  """evaluate's loss by teacher forcing and its greedy decoding (the metrics of all 12 examples,
  the text of the first 5) on the mesh (1,2,4), as on one device."""
  sharded, single = meshes["evaluate"]
  assert sharded["hypotheses"] == single["hypotheses"], "the greedy outputs differ"
  assert any(sharded["hypotheses"]), "every greedy output is empty: nothing was compared"
  sharded, single = sharded["metrics"], single["metrics"]
  assert sharded.keys() == single.keys() and {"loss", "exact_match"} <= sharded.keys()
  for name in sharded:
    assert sharded[name] == pytest.approx(single[name], rel=1e-5, abs=1e-6), name


@pytest.mark.parametrize("arch", ["decoder_only", "encoder_only"])
def test_other_architectures_make_the_same_updates_on_a_mesh(meshes, arch):
  runs = meshes["architectures"][arch]
  # Parameters within 1e-5 (measured: 3e-6, the order of float32 sums after 3 Adam steps of
  # 3e-3 each split over 4 tensor shards); a sharding error moves them by a step or more.
  np.testing.assert_allclose(runs["1,2,4"]["losses"], runs["1"]["losses"], rtol=1e-5)
  for x, y in zip(runs["1"]["params"], runs["1,2,4"]["params"]):
    np.testing.assert_allclose(y, x, rtol=0, atol=1e-5)
  moved = max(np.abs(np.asarray(a) - np.asarray(b)).max()
              for a, b in zip(runs["1"]["params"], runs["1"]["init"]))
  assert moved > 1e-3


def test_checkpoint_averaging_restores_onto_the_mesh_and_averages(meshes):
  average = meshes["average"]
  assert average["sharding"] == "P('fsdp', 'tensor', None)"  # the mesh of (1,2,4)
  assert average["error"] < 1e-7


CLUSTER_VARIABLES = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID",
                     "SLURM_LOCALID", "OMPI_MCA_orte_hnp_uri", "TPU_WORKER_HOSTNAMES",
                     "TPU_PROCESS_ADDRESSES", "KUBERNETES_SERVICE_HOST")


@pytest.mark.parametrize("tasks", [1, 4])
def test_a_slurm_job_is_distributed_by_its_task_count(monkeypatch, tasks):
  """JAX's own detection reads the job: a SLURM allocation of one task starts nothing (it would
  start a coordinator service for nothing); one of 4 tasks is a job of 4 processes."""
  for name in CLUSTER_VARIABLES:
    monkeypatch.delenv(name, raising=False)
  assert sharding.detected_process_count() == 1  # this machine: no cluster
  for name, value in {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "node[1-4]",
                      "SLURM_NTASKS": str(tasks), "SLURM_PROCID": "0",
                      "SLURM_LOCALID": "0"}.items():
    monkeypatch.setenv(name, value)
  assert sharding.detected_process_count() == tasks
  if tasks == 1:
    sharding.initialize_distributed()
    assert not jax.distributed.is_initialized()
