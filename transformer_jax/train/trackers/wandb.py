"""Weights & Biases: one W&B run per workdir, its id WORKDIR/tracker.json's.

Each setting is the config's wandb.* key where it is set, else W&B's own (WANDB_PROJECT,
WANDB_ENTITY, WANDB_RUN_GROUP, WANDB_TAGS, WANDB_MODE, WANDB_DIR, its login). wandb.mode=offline
writes the run under WORKDIR/wandb (or WANDB_DIR) for `wandb sync` later; a resumed offline run
writes a second directory of the same id, which `wandb sync` adds to the same run.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

from transformer_jax.core import storage
from transformer_jax.train.trackers import base


def wandb_dir(workdir: str) -> str | None:
  """Where W&B writes its files: WANDB_DIR, else the workdir (a local one; W&B writes local
  files only: for a workdir in a bucket, W&B's default, ./wandb)."""
  if os.environ.get("WANDB_DIR"):
    return os.environ["WANDB_DIR"]
  return None if storage.is_url(workdir) else workdir


def last_offline_step(directory: str | None, run_id: str) -> int:
  """The last step that earlier offline runs of `run_id` in `directory` logged, read by W&B's
  own reader of its run files (`wandb leet inspect --summary --json`); -1 if none."""
  last = -1
  for run_dir in glob.glob(os.path.join(directory or ".", "wandb", f"offline-run-*-{run_id}")):
    done = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--summary", "--json",
                           run_dir], capture_output=True, text=True, timeout=120)
    if done.returncode == 0:
      try:
        last = max(last, int(json.loads(done.stdout).get("step") or -1))
      except ValueError:
        pass
  return last


class WandbTracker(base.Tracker):
  name = "wandb"

  def __init__(self, config, workdir: str):
    w = config.wandb
    self.settings = dict(
        project=w.project or None, entity=w.entity or None,
        group=w.group or config.train.tracker_group or None,
        tags=base.split_tags(w.tags or config.train.tags) or None,
        notes=config.train.notes or None,
        mode=w.mode or None, name=base.run_name(config, workdir, w.name),
        dir=wandb_dir(workdir))
    self.where = f"project {w.project or os.environ.get('WANDB_PROJECT') or '(W&B default)'}"
    self.run = None

  def open(self, run_id: str, config: dict) -> dict:
    import wandb
    mode = self.settings["mode"] or os.environ.get("WANDB_MODE", "")
    offline = mode in ("offline", "dryrun")
    before = last_offline_step(self.settings["dir"], run_id) if offline else -1
    # W&B's console capture wraps sys.stdout and sys.stderr: every line and progress-bar
    # update of the training thread would pass through it. Off unless WANDB_CONSOLE asks.
    settings = wandb.Settings(silent=True, console=os.environ.get("WANDB_CONSOLE", "off"))
    config = {**config, **{f"provenance/{k}": v for k, v in base.provenance().items()}}
    self.run = wandb.init(id=run_id, resume="allow", config=config, reinit="create_new",
                          settings=settings, **self.settings)
    self.run.config.update(config, allow_val_change=True)  # a resumed run's changed keys
    if self.run.resumed and not offline:
      before = max(before, self.run.starting_step - 1)
    return {"*": before} if before >= 0 else {}

  def write(self, records: list) -> None:
    import wandb
    for r in records:  # W&B takes a row's time from its _timestamp
      values = base.scalars(r)
      if rows := base.sample_rows(r):
        values[f"{r['split']}/samples"] = wandb.Table(list(base.SAMPLE_COLUMNS), rows)
      self.run.log({**values, **({"_timestamp": r["time"]} if "time" in r else {})},
                   step=r["step"])

  def summary(self, values: dict) -> None:
    self.run.summary.update({f"summary/{k}": v for k, v in values.items()})

  def images(self, paths: dict, step: int) -> None:
    import wandb
    self.run.log({f"plots/{name}": wandb.Image(path) for name, path in paths.items()},
                 step=max(step, self.run.step))

  def files(self, paths: dict) -> None:
    for name, path in paths.items():  # into the run's files as `name`, uploaded with it
      root = path[:-len(name)] if path.endswith(name) else os.path.dirname(path)
      self.run.save(path, base_path=root, policy="now")

  def checkpoints(self, steps: list, directory: str) -> None:
    """An artifact of references to the checkpoints (W&B stores no weights), a version per
    change of the steps kept; the directory and its steps in the run's summary."""
    import wandb
    self.run.summary.update({"checkpoint_steps": list(steps), "checkpoints": directory})
    uris = base.checkpoint_uris(steps, directory)
    artifact = wandb.Artifact(f"checkpoints-{self.run.id}", type="model",
                              metadata={"directory": directory, "steps": uris})
    for step, uri in uris.items():
      if uri.startswith("file://") and not os.path.isdir(uri[len("file://"):]):
        continue  # a save in flight: referenced at the next one, or at the end
      try:
        artifact.add_reference(uri, name=step, checksum=False)
      except Exception:  # noqa: BLE001 - a bucket W&B's own client cannot reach from here
        pass  # (no library, no credentials): its URI stays in the metadata
    self.run.log_artifact(artifact, aliases=["latest", f"step-{max(steps)}"] if steps else None)

  def close(self, state: str) -> None:
    if self.run is not None:
      if state == "stopped":
        self.run.mark_preempting()
      self.run.finish(exit_code=0 if state != "failed" else 1)
