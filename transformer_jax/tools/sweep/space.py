"""What a sweep varies, read from its experiment file, and Optuna's samplers and pruners by name.

Two declarations, either or both:
  get_sweep()         a list of override dicts (dotted config keys -> values): each becomes a trial
                      enqueued in the study as it is ("seeds": N asks for N of them, seeds S..S+N-1)
  get_search_space()  {dotted key: distribution}: trials the sampler draws (sweep.sampler), up
                      to sweep.budget trials in all

  def get_search_space():
    return {"train.learning_rate": sweep.log_uniform(1e-4, 1e-2),
            "model.dropout_rate": sweep.uniform(0.0, 0.3),
            "model.num_encoder_layers": sweep.integer(1, 4),
            "model.positional": sweep.choice(["sinusoidal", "rotary"]),
            "model.rotary_base": sweep.log_uniform(1e3, 1e5, when={"model.positional": "rotary"})}

A key with `when` is drawn only in trials where the named (earlier, categorical) keys take one of
the given values: a conditional key.
"""

from __future__ import annotations

import importlib.util
import itertools
import warnings
from typing import Any, NamedTuple, Optional, Sequence

from absl import flags
from ml_collections import config_flags
from optuna import distributions as dists
from optuna.exceptions import ExperimentalWarning

from transformer_jax import config as config_lib
from transformer_jax.core import metric_names
from transformer_jax.core.errors import UserError, unknown_key_message

# Heartbeats, their retry callback and TPE's grouping are "experimental" in Optuna 5.0; the
# warnings would print on every worker's start.
warnings.filterwarnings("ignore", category=ExperimentalWarning)

SEEDS = "seeds"  # the get_sweep() entry that asks for runs with several seeds (not a config key)
SAMPLERS = ("tpe", "gp", "cmaes", "random", "grid")
PRUNERS = ("median", "asha", "hyperband", "none")


class Param(NamedTuple):
  """One key of a search space: its distribution, and when it is drawn ({key: values}; {} for
  every trial)."""

  distribution: dists.BaseDistribution
  when: dict


def _when(when: Optional[dict]) -> dict:
  return {k: list(v) if isinstance(v, (list, tuple)) else [v] for k, v in (when or {}).items()}


def uniform(low: float, high: float, *, step: Optional[float] = None,
            when: Optional[dict] = None) -> Param:
  return Param(dists.FloatDistribution(low, high, step=step), _when(when))


def log_uniform(low: float, high: float, *, when: Optional[dict] = None) -> Param:
  return Param(dists.FloatDistribution(low, high, log=True), _when(when))


def integer(low: int, high: int, *, step: int = 1, log: bool = False,
            when: Optional[dict] = None) -> Param:
  return Param(dists.IntDistribution(low, high, log=log, step=step), _when(when))


def choice(values: Sequence[Any], *, when: Optional[dict] = None) -> Param:
  return Param(dists.CategoricalDistribution(list(values)), _when(when))


def grid(**axes: Sequence[Any]) -> list[dict]:
  """Every combination of the given values, for get_sweep(): grid(**{"a.b": [1, 2], "c": [3]})."""
  keys = list(axes)
  return [dict(zip(keys, values)) for values in itertools.product(*(axes[k] for k in keys))]


class Experiment(NamedTuple):
  path: str
  trials: Optional[list]  # get_sweep()'s override dicts, "seeds" entries included; None: none
  space: Optional[dict]  # get_search_space() as {key: Param}; None: none


def _call(module, name: str, path: str):
  try:
    return getattr(module, name)()
  except Exception as e:  # the experiment's own code: report it in one line
    raise UserError(f"{name}() in {path} raised {type(e).__name__}: {e}") from None


def load(config_path: str) -> Experiment:
  """The trials and the search space an experiment file declares (see the module docstring)."""
  spec = importlib.util.spec_from_file_location("sweep_experiment", config_path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  if not hasattr(module, "get_sweep") and not hasattr(module, "get_search_space"):
    raise UserError(f"{config_path} defines no get_sweep() or get_search_space(); add one "
                    "(see transformer_jax/tools/sweep/space.py)")
  trials = space = None
  if hasattr(module, "get_sweep"):
    trials = _call(module, "get_sweep", config_path)
    if not isinstance(trials, (list, tuple)) or not trials or not all(
        isinstance(t, dict) and all(isinstance(k, str) for k in t) for t in trials):
      raise UserError(f"get_sweep() in {config_path} must return a non-empty list of dicts of "
                      "dotted config keys (e.g. {'train.learning_rate': 1e-3})")
    for i, trial in enumerate(trials):
      if any(isinstance(value, dict) for value in trial.values()):
        raise UserError(f"trial_{i:03d} of get_sweep() in {config_path} nests a dict ({trial}); "
                        f"write its keys dotted: {_dotted(trial)}")
    trials = list(trials)
  if hasattr(module, "get_search_space"):
    space = _check_space(_call(module, "get_search_space", config_path), config_path)
  return Experiment(config_path, trials, space)


def _check_space(space, path: str) -> dict:
  """get_search_space()'s answer as {key: Param}; a malformed one is one UserError."""
  where = f"get_search_space() in {path}"
  example = "{'train.learning_rate': sweep.log_uniform(1e-4, 1e-2)}"
  if not isinstance(space, dict) or not space:
    raise UserError(f"{where} must return a non-empty dict of dotted config keys to "
                    f"distributions, e.g. {example}; got {space!r}")
  checked = {}
  for key, value in space.items():
    if isinstance(value, dists.BaseDistribution):
      value = Param(value, {})
    if not isinstance(key, str) or not isinstance(value, Param):
      raise UserError(f"{where}: {key!r}: {value!r} is not a distribution; use sweep.uniform, "
                      f"log_uniform, integer or choice, e.g. {example}")
    for other, values in value.when.items():
      parent = checked.get(other)
      if parent is None or not isinstance(parent.distribution, dists.CategoricalDistribution):
        raise UserError(f"{where}: {key} is drawn when {other} is {values}, but {other} is no "
                        "choice declared before it; declare it first, with sweep.choice")
      unknown = [v for v in values if v not in parent.distribution.choices]
      if unknown:
        raise UserError(f"{where}: {key} is drawn when {other} is {unknown}, which is none of "
                        f"its choices {list(parent.distribution.choices)}")
    checked[key] = value
  return checked


def _dotted(trial: dict, prefix: str = "") -> dict:
  """{'train': {'steps': 2}} -> {'train.steps': 2}."""
  flat = {}
  for key, value in trial.items():
    if isinstance(value, dict):
      flat.update(_dotted(value, f"{prefix}{key}."))
    else:
      flat[f"{prefix}{key}"] = value
  return flat


# ------------------------------------------------------------------ overrides -> configs


def flag_value(value) -> str:
  if isinstance(value, bool):
    return str(value)
  if isinstance(value, (list, tuple)):
    return f"({','.join(map(str, value))},)"
  return str(value)


def override_flags(overrides: dict) -> list[str]:
  return [f"--config.{key}={flag_value(value)}" for key, value in overrides.items()]


def trial_config(config_path: str, overrides: dict, base_overrides: dict):
  """The config of a trial: the experiment with the command's overrides, then the trial's,
  parsed as a command line would be (so a value is checked as the flag would check it)."""
  args = [f"--config={config_path}", *override_flags({**base_overrides, **overrides})]
  flag_values = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "", flag_values=flag_values, lock_config=True,
                                  sys_argv=["sweep", *args])
  try:
    flag_values(["sweep", *args])
  except flags.Error as e:  # a value of the wrong type: "flag --config.a.b=x: why"
    raise UserError(" ".join(str(e).split())) from None
  except (AttributeError, KeyError) as e:  # ml_collections: a key that does not exist
    raise UserError(unknown_key_message(e, args)) from None
  return flag_values["config"].value


def seed_counts(trials: list, seeds: int = 0) -> list[Optional[int]]:
  """How many seeds each trial runs: sweep.seeds (`seeds`) if given, else its "seeds" entry,
  else None (one run with the config's seed)."""
  if seeds < 0:
    raise UserError(f"sweep.seeds must be >= 0 (0 = as get_sweep() says), got {seeds}")
  counts = []
  for i, trial in enumerate(trials):
    count = seeds or trial.get(SEEDS)
    if count is not None and (isinstance(count, bool) or not isinstance(count, int)
                              or count < 1):
      raise UserError(f"trial_{i:03d} of get_sweep() asks for {SEEDS}={count!r}; give a "
                      "positive number of seeds")
    if count is not None and "seed" in trial:
      raise UserError(f"trial_{i:03d} of get_sweep() sets seed={trial['seed']} and asks for "
                      f"{count} seeds; leave out one of the two")
    counts.append(count)
  return counts


class Queued(NamedTuple):
  """One trial of get_sweep() to enqueue: its index there, its seed (None: the config's, not
  varied) and its overrides ("seed" among them where seeded)."""

  index: int
  seed: Optional[int]
  overrides: dict

  @property
  def key(self) -> str:  # what tells two enqueued trials apart across sweeps of one study
    return f"{self.index}" if self.seed is None else f"{self.index}/seed{self.seed}"


def queued_trials(experiment: Experiment, base_overrides: dict, seeds: int = 0,
                  only: Optional[Sequence[int]] = None) -> list[Queued]:
  """get_sweep()'s trials to enqueue, every config checked first (the first bad one is a
  UserError); sweep.seeds is `seeds`, sweep.trials `only` (their order kept)."""
  if experiment.trials is None:
    if only is not None or seeds:
      raise UserError("sweep.trials and sweep.seeds choose trials of get_sweep(), which "
                      f"{experiment.path} does not define")
    return []
  trials = experiment.trials
  counts = seed_counts(trials, seeds)
  order = list(range(len(trials)))
  if only is not None:
    only = list(only)
    wrong = [t for t in only if not 0 <= t < len(trials)]
    if wrong or not only:
      raise UserError(f"sweep.trials must name trials 0..{len(trials) - 1} of get_sweep(); got "
                      f"{','.join(map(str, only)) or 'none'}")
    if len(set(only)) != len(only):
      raise UserError(f"sweep.trials names a trial twice: {','.join(map(str, only))}")
    order = only
  configs = check_trials(experiment.path, trials, base_overrides)
  queued = []
  for i in order:
    overrides = {k: v for k, v in trials[i].items() if k != SEEDS}
    if counts[i] is None:
      queued.append(Queued(i, None, overrides))
    else:
      start = configs[i].seed
      queued += [Queued(i, start + k, {**overrides, "seed": start + k}) for k in range(counts[i])]
  return queued


def check_trials(config_path: str, trials: list, base_overrides: dict) -> list:
  """Every get_sweep() trial's config, validated; the first bad one is a UserError."""
  configs = []
  for i, trial in enumerate(trials):
    try:
      config = trial_config(config_path, {k: v for k, v in trial.items() if k != SEEDS},
                            base_overrides)
      config_lib.validate(config)
    except UserError as e:
      raise UserError(f"trial_{i:03d} of get_sweep() in {config_path} ({trial}): {e}; fix "
                      "get_sweep() (no trial was run)") from None
    configs.append(config)
  return configs


def _corners(distribution) -> list:
  """Values that exercise a distribution's range: its ends, or each choice."""
  if isinstance(distribution, dists.CategoricalDistribution):
    return list(distribution.choices)
  return [distribution.low, distribution.high]


def check_space(experiment: Experiment, base_overrides: dict) -> None:
  """Every key of the search space names a config key, and each end of its range (each choice)
  gives a valid config with the others at their lower ends."""
  space = experiment.space or {}
  low = {k: _corners(p.distribution)[0] for k, p in space.items()}
  for key, param in space.items():
    for value in _corners(param.distribution):
      try:
        config_lib.validate(trial_config(experiment.path, {**low, key: value}, base_overrides))
      except UserError as e:
        raise UserError(f"get_search_space() in {experiment.path}: {key}={value!r}: {e}; fix "
                        "the search space (no trial was run)") from None


def suggest(trial, space: dict) -> dict:
  """The overrides of a trial the sampler draws: each key of the space whose `when` holds,
  asked of `trial` (Optuna's define-by-run: a fixed or earlier value is returned as it is)."""
  overrides = {}
  for key, param in space.items():
    if any(overrides.get(k) not in values for k, values in param.when.items()):
      continue  # a conditional key whose condition does not hold in this trial
    d = param.distribution
    if isinstance(d, dists.CategoricalDistribution):
      overrides[key] = trial.suggest_categorical(key, d.choices)
    elif isinstance(d, dists.IntDistribution):
      overrides[key] = trial.suggest_int(key, d.low, d.high, step=d.step, log=d.log)
    else:
      overrides[key] = trial.suggest_float(key, d.low, d.high, step=d.step, log=d.log)
  return overrides


def describe(space: dict) -> list[str]:
  """One line per key of a search space, for the dry run."""
  lines = []
  for key, param in space.items():
    d = param.distribution
    if isinstance(d, dists.CategoricalDistribution):
      what = f"one of {list(d.choices)}"
    else:
      kind = "int" if isinstance(d, dists.IntDistribution) else "float"
      what = (f"{kind} in [{d.low}, {d.high}]" + (" (log scale)" if d.log else "")
              + (f" step {d.step}" if d.step else ""))
    when = " and ".join(f"{k} in {v}" for k, v in param.when.items())
    lines.append(f"  {key}: {what}" + (f", when {when}" if when else ""))
  return lines


# ------------------------------------------------------------------ samplers and pruners


def grid_of(space: dict) -> dict:
  """The search space as the lists of values GridSampler walks: choices, integers, stepped
  floats. A continuous float has no grid: a UserError."""
  values = {}
  for key, param in space.items():
    d = param.distribution
    if isinstance(d, dists.CategoricalDistribution):
      values[key] = list(d.choices)
    elif isinstance(d, dists.IntDistribution) and not d.log:
      values[key] = list(range(d.low, d.high + 1, d.step))
    elif isinstance(d, dists.FloatDistribution) and d.step and not d.log:
      count = int(round((d.high - d.low) / d.step)) + 1
      values[key] = [d.low + i * d.step for i in range(count)]
    else:
      raise UserError(f"sweep.sampler=grid needs a list of values for every key; {key} is a "
                      "continuous range: give it a step (sweep.uniform(lo, hi, step=...)), make "
                      "it a sweep.choice, or pick another sampler")
  return values


def make_sampler(name: str, space: Optional[dict], seed: int, budget: int = 0):
  """The sampler by name. TPE draws its first trials at random (n_startup_trials, Optuna's default
  10): a quarter of the budget here, 3 to 10, so that a small budget still gets to model."""
  import optuna
  if name not in SAMPLERS:
    raise UserError(f"sweep.sampler must be one of {', '.join(SAMPLERS)}; got {name!r}")
  if name == "grid":
    return optuna.samplers.GridSampler(grid_of(space or {}), seed=seed)
  if name == "random":
    return optuna.samplers.RandomSampler(seed=seed)
  if name == "tpe":
    # multivariate + group: conditional keys are modelled together with the keys they follow;
    # constant_liar: running trials (other workers') count as bad, so that workers spread out.
    startup = min(10, max(3, budget // 4)) if budget else 10
    return optuna.samplers.TPESampler(seed=seed, multivariate=True, group=True,
                                      constant_liar=True, n_startup_trials=startup)
  needs = {"gp": "torch", "cmaes": "cmaes"}[name]
  if importlib.util.find_spec(needs) is None:
    raise UserError(f"sweep.sampler={name} needs the {needs} package (pip install {needs}); "
                    "or pick tpe or random")
  if name == "gp":
    return optuna.samplers.GPSampler(seed=seed)
  # CMA-ES draws floats and integers; a categorical key falls back to the random sampler.
  return optuna.samplers.CmaEsSampler(seed=seed, warn_independent_sampling=False)


def make_pruner(name: str, config):
  """The pruner by name. Resources are train steps: a trial reports at every evaluation."""
  import optuna
  if name not in PRUNERS:
    raise UserError(f"sweep.pruner must be one of {', '.join(PRUNERS)}; got {name!r}")
  t = config.train
  every = t.eval_every if t.eval_every > 0 else t.steps
  if name == "median":
    return optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=0)
  if name == "asha":
    return optuna.pruners.SuccessiveHalvingPruner(min_resource=every, reduction_factor=3)
  if name == "hyperband":
    return optuna.pruners.HyperbandPruner(min_resource=every, max_resource=t.steps,
                                          reduction_factor=3)
  return optuna.pruners.NopPruner()


def direction(metric: str) -> str:
  if metric not in metric_names.EVAL_METRICS:
    raise UserError(f"sweep.metric must be one of {', '.join(metric_names.EVAL_METRICS)}; "
                    f"got {metric!r}")
  return "minimize" if metric_names.lower_is_better(metric) else "maximize"
