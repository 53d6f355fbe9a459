"""train.init_from: a classifier starts from a masked-LM run's parameters."""

import jax
import numpy as np
import pytest

from transformer_jax import config as config_lib
from transformer_jax.core import trees
from transformer_jax.core.errors import UserError
from transformer_jax.experiments import tiny
from transformer_jax.train import checkpoint, pretrained, sharding
from transformer_jax.train import state as state_lib


def encoder_config(num_labels):
  c = tiny.get_config()
  c.model.update(arch="encoder_only", num_labels=num_labels, max_len=16)
  c.data.update(task="classify" if num_labels else "mlm", source="files", path="unused",
                format="tsv" if num_labels else "text", max_source_len=16)
  return c


def test_a_classifier_takes_the_masked_lms_encoder_and_keeps_its_new_head(tmp_path):
  mesh = sharding.make_mesh({"data": 1}, jax.devices()[:1])
  mlm = encoder_config(0)
  mlm_model = config_lib.validate(mlm)
  optimizer = state_lib.make_optimizer(mlm.train, mlm_model.d_model)
  source = state_lib.init_state(mlm_model, optimizer, seed=1, mesh=mesh)
  workdir = tmp_path / "mlm"
  manager = checkpoint.Manager(str(workdir), mlm, writable=True)
  manager.save(7, source)
  manager.wait()
  manager.close()
  (workdir / "config.json").write_text(mlm.to_json_best_effort())

  classifier = encoder_config(3)
  model = config_lib.validate(classifier)
  fresh = state_lib.init_state(model, state_lib.make_optimizer(classifier.train, model.d_model),
                               seed=2, mesh=mesh)
  state, copied = pretrained.load(str(workdir), fresh, mesh)
  old, new, init = (trees.flatten(jax.device_get(s.params)) for s in (source, state, fresh))
  assert set(copied) == set(new) - {"pooler.kernel", "pooler.bias", "classifier.kernel",
                                    "classifier.bias"}
  assert "token_embedding.embedding" in copied and "mlm_dense.kernel" not in new
  for key in new:
    expected = old[key] if key in copied else init[key]
    np.testing.assert_array_equal(new[key], expected, err_msg=key)

  with pytest.raises(UserError, match="holds no trained run"):
    pretrained.load(str(tmp_path / "nothing"), fresh, mesh)
