"""Hyperparameter sweeps on Optuna: the study (a journal file in the sweep's workdir, or a
database that workers on many machines share) is the one record of its trials.

  space.py    what a sweep varies: get_sweep()'s trials, get_search_space()'s distributions,
              the samplers and pruners by name
  store.py    where the study lives (journal file or database URL), and which sweep it is
  worker.py   a worker: joins the study, takes trials, trains each in WORKDIR/trial_NNNN
  results.py  results.md / results.csv and Optuna's plots, rebuilt from the study

The experiment file declares the sweep next to its config (see space.py):

  def get_sweep():
    return sweep.grid(**{"train.learning_rate": [1e-3, 2e-3], "model.num_encoder_layers": [2, 3]})

  def get_search_space():
    return {"train.learning_rate": sweep.log_uniform(1e-4, 1e-2)}
"""

from transformer_jax.tools.sweep.space import (  # noqa: F401 - the experiment files' vocabulary
  SEEDS,
  check_trials,
  choice,
  grid,
  integer,
  log_uniform,
  trial_config,
  uniform,
)
