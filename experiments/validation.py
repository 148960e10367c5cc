"""Checks a run's config and workdir before anything is loaded or compiled, with errors that name
the field, the value and what is allowed."""

import json
import math
import os

from absl import logging
import numpy as np

from compressors import equal_bytes
from compressors import registry
from configs import common
from experiments import data
from experiments import methods
from experiments import models
from experiments import provenance

CONFIG_FILE = "config.json"
# Fields that may change when a run resumes: they decide what is logged, checked and kept, when a
# run counts as diverged, where the data is, how processes meet and how long a step may wait,
# never the trajectory of the training state (the data itself is checked against the
# checkpoints' record of it, unless resume_on_other_data says a change is meant:
# experiments.checkpoint).
RESUMABLE_CHANGES = ("data_dir", "log_every", "eval_every", "checkpoint_every",
                     "keep_checkpoints", "check_replicas_every", "max_skipped_fraction",
                     "distributed", "data.decode_threads", "resume_on_other_data",
                     "stall_timeout_seconds")


def check_workers(config) -> None:
  """Every field of ``config`` against the rule declared for it (:func:`check_finite`, then
  ``configs.common.check``: ``config.num_devices``, None for every device, among them) and, where
  the device count is given, the batch sizes against the workers: all of it without JAX, so
  that a run can check it before JAX starts its devices (:func:`check_batches`)."""
  check_finite(config)
  common.check(config)
  check_islands(config)
  if config.num_devices is not None:
    check_batches(config, config.num_devices * config.workers_per_device)


def check_islands(config) -> None:
  """``config.mesh`` (islands x fsdp, :mod:`compressors.parallel.fsdp`): the product is the
  device count, one worker per device, and the equal-bytes solver (which prices whole
  parameters) is not asked for. ``mesh.fsdp == 1`` is the default mesh (islands of one device
  each). Every optimizer runs on shards (LAMB's and LARS's norms summed over the fast axis:
  ``experiments.methods.optimizer``)."""
  islands, shards = config.mesh.islands, config.mesh.fsdp
  if shards == 1 and islands is None:
    return
  devices = config.num_devices
  if devices is not None and islands is not None and islands * shards != devices:
    raise ValueError(f"config.mesh.islands={islands} x config.mesh.fsdp={shards} must equal "
                     f"config.num_devices={devices}")
  if devices is not None and devices % shards:
    raise ValueError(f"config.mesh.fsdp={shards} must divide config.num_devices={devices}")
  if shards == 1:  # islands of one device each: the default mesh
    return
  if config.workers_per_device != 1:
    raise ValueError(f"config.workers_per_device={config.workers_per_device} with "
                     f"config.mesh.fsdp={shards}: islands run one worker per device; allowed: 1")
  if config.get("equal_bytes") is not None:
    raise ValueError(f"config.equal_bytes={config.equal_bytes!r} with config.mesh.fsdp={shards}: "
                     "the equal-bytes solver prices whole parameters exchanged by every device, "
                     "not shards across islands; allowed: None (the method's own settings), or "
                     "mesh.fsdp=1")


def check_batches(config, num_workers: int) -> None:
  """``config.batch_size`` and ``eval_batch_size`` (ints >= 1, :func:`check_workers`): the
  workers must divide them."""
  for name in ("batch_size", "eval_batch_size"):
    if config[name] % num_workers:
      raise ValueError(f"config.{name}={config[name]} must be divisible by the "
                       f"{num_workers} workers (config.num_devices x workers_per_device)")


def check_finite(config) -> None:
  """Refuses NaN and infinity in every number of ``config``, naming the field: no field means
  either, and a NaN would pass every range check (its comparisons are all False)."""
  for name, value in _flatten(config.to_dict()).items():
    values = value if isinstance(value, (tuple, list)) else (value,)
    if any(isinstance(v, float) and not math.isfinite(v) for v in values):
      raise ValueError(f"config.{name}={value!r} is not a finite number; allowed: a finite "
                       "number (see configs/common.py for the field's range)")


def check_config(config, num_workers: int) -> None:
  """Validates ``config`` for ``num_workers`` workers (devices x workers per device).

  Checks every field against the rule declared for it (:func:`check_workers`), then the rules
  that relate fields; builds the communication transformation (not compiled), so a compressor's
  own checks of its settings run here too. Settings the run does not use, and an equal-bytes tier
  its method cannot meet, are warned about in the log (:func:`unused_settings`).

  Raises:
    ValueError, TypeError: the first problem found.
  """
  check_workers(config)
  data.check_name(config.dataset)
  # The model's fields by their declared rules, before the data loads (a sweep's runs too).
  models.check_model(config.model.to_dict())
  methods.check_method(config.method)
  check_batches(config, num_workers)
  if (config.num_steps > 0) == (config.num_epochs > 0):
    raise ValueError(f"exactly one of config.num_steps={config.num_steps} and "
                     f"config.num_epochs={config.num_epochs} must be > 0")
  methods.check_schedule(config)
  c = config.compression
  if c.momentum_correction and config.optimizer.name in ("momentum", "nesterov"):
    raise ValueError(f"config.optimizer.name={config.optimizer.name!r} with "
                     f"compression.momentum_correction={c.momentum_correction!r} applies "
                     "momentum twice; allowed: 'sgd' (or momentum_correction=0)")
  methods.make_chain(config, config.optimizer.learning_rate)
  methods.step_kinds(config)
  methods.worker_simulation(config, num_workers)  # the aggregator's method, the trace's workers
  for line in unused_settings(config):
    logging.warning("%s", line)


def check_compresses(config, shapes, num_workers: int) -> None:
  """Refuses a compressing method whose settings compress nothing of the model: by the cost
  model it would send at least dense's bytes per step (a PowerSGD rank that no matrix of the
  model can take, so that every leaf is all-reduced densely), while the run would report it as
  the method.

  Args:
    config: the run's config.
    shapes: the shapes of the model's parameters.
    num_workers: the run's workers (one sends nothing: not checked).

  Raises:
    ValueError: naming the method's settings, the bytes they send against dense's, and what is
      allowed.
  """
  entry = registry.get(config.method)
  # A budget is what makes a method's bytes smaller than dense's; a method without one (dense,
  # fp16) sends fixed bytes, and local updates and own optimizers are priced by their steps.
  if not entry.per_step or entry.budget is None or num_workers < 2:
    return
  settings = methods.settings(config)
  sent = equal_bytes.method_bytes(config.method, shapes, num_workers, settings)
  dense = equal_bytes.method_bytes("dense", shapes, num_workers)
  if sent < dense:
    return
  raise ValueError(
      f"config.compression.{config.method}={settings} compresses none of this model's "
      f"parameters: by the cost model it sends {sent / dense:.3g}x dense's bytes per step at "
      f"{num_workers} workers (e.g. a PowerSGD rank above every matrix's smaller side, which "
      "sends every leaf densely); allowed: settings that send fewer bytes than dense "
      "(compressors.equal_bytes.solve finds them for a ratio)")


def unused_settings(config) -> list[str]:
  """A line for each setting of ``config`` that its run does not do as asked: the fields of
  ``config.optimizer`` and ``config.schedule`` set away from their defaults that the optimizer
  and schedule named do not use (``methods.OPTIMIZERS``, ``methods.LR_SCHEDULES``), and all but
  the learning rate for a method that is its own optimizer; a step kind of the method that none of ``config.num_steps`` steps runs (a density warm-up, 1-bit
  Adam's, or a synchronisation period longer than the run); and an equal-bytes tier
  (``config.equal_bytes``) its method's bytes do not meet (dense's own, the reference, excepted).
  They are warned about, not refused: the language-model tables run DeMo with the recipe's
  optimizer block and keep rows off their tier on purpose (``experiments.methods.equal_bytes_tier``
  records the tier met in ``results.json``), and smoke runs are shorter than any warm-up."""
  lines = []
  own_optimizer = registry.get(config.method).optimizer is not None
  o, s = config.optimizer, config.schedule
  unused = _set_but_unused(o, common.base().optimizer, ("learning_rate",) if own_optimizer else
                           ("name", "learning_rate", *methods.OPTIMIZERS[o.name]))
  if unused and own_optimizer:
    lines.append(f"config.method={config.method!r} is its own optimizer (its settings: "
                 f"config.compression.{config.method}; of config.optimizer it takes only "
                 f"learning_rate, under config.schedule): config.optimizer's {unused} are not used")
  elif unused:
    lines.append(f"config.optimizer.name={o.name!r} does not use config.optimizer's {unused} "
                 f"(it takes {', '.join(methods.OPTIMIZERS[o.name])})")
  unused = _set_but_unused(s, common.base().schedule,
                           ("name", "warmup_epochs", "warmup_steps", *methods.LR_SCHEDULES[s.name]))
  if unused:
    lines.append(f"config.schedule.name={s.name!r} does not use config.schedule's {unused}")
  if config.num_steps:  # an epoch's steps are known once the data is loaded
    steps = np.arange(config.num_steps)
    missed = [k for k in methods.step_kinds(config) if not k.runs_at(steps).any()]
    if missed:
      kinds = ", ".join(f"{k.name!r} (from step {k.start}, every {k.every})" for k in missed)
      lines.append(f"config.method={config.method!r}: none of the run's {config.num_steps} steps "
                   f"(config.num_steps) is of its step kinds {kinds}: a warm-up or a period "
                   "longer than the run")
  tier = methods.equal_bytes_tier(config)
  # A method that sends dense's bytes is the reference the tiers are measured from.
  if tier is not None and not tier["on_tier"] and tier["met_ratio"] != 1:
    met = ("no setting of it can be priced" if tier["met_ratio"] is None else
           f"it sends {tier['met_ratio']:.3g}x fewer bytes than dense at {tier['workers']} workers")
    lines.append(f"config.equal_bytes.ratio={tier['ratio']!r} is not met by "
                 f"config.method={config.method!r}: {met} ({tier['note']}); the run trains off "
                 "its tier (recorded in results.json)")
  return lines


def _set_but_unused(block, defaults, used) -> str:
  """``"field=value, ..."`` for the fields of ``block`` outside ``used`` whose value is not
  their default (a field ``defaults`` lacks counts as set); '' for none."""
  return ", ".join(f"{k}={v!r}" for k, v in block.items()
                   if k not in used and (k not in defaults or v != defaults[k]))


def check_config_file(spec: str, what: str = "--config") -> None:
  """A one-line error naming the path for a config file that does not exist.

  Args:
    spec: ``path/to/config.py[:arg]``, as the command line or a sweep config gives it.
    what: where ``spec`` comes from, for the message.

  Raises:
    FileNotFoundError: there is no file at the path.
  """
  path = spec.partition(":")[0]
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{what}={spec!r}: config file {path!r} does not exist (paths are "
                            f"relative to the working directory {os.getcwd()!r})")


def check_workdir(workdir) -> None:
  """A clear error for a ``workdir`` that cannot hold a run (not a path, or not a directory)."""
  if not isinstance(workdir, (str, os.PathLike)) or not str(workdir):
    raise TypeError(f"workdir={workdir!r} must be a non-empty path")
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise ValueError(f"workdir={str(workdir)!r} exists and is not a directory; give a directory "
                     "(new, or of a run to resume)")


def check_resume(config, workdir: str, checkpoint_step: int | None) -> None:
  """Refuses to resume from checkpoints that another config wrote.

  The run's config is stored in ``workdir/config.json`` when it starts, beside its provenance
  (``provenance.KEY``, not compared). If ``workdir`` holds a checkpoint, the stored config must
  equal ``config`` except in :data:`RESUMABLE_CHANGES` and in fields it lacks that ``config``
  leaves at their defaults (fields added to the configs since it was written).

  Args:
    config: the config about to run.
    workdir: the run's directory.
    checkpoint_step: the step of its latest checkpoint, or None if it has none.

  Raises:
    ValueError: the checkpoints belong to another config (the message lists every differing
      field with both values), or their config is missing or unreadable.
  """
  if checkpoint_step is None:
    return
  path = os.path.join(workdir, CONFIG_FILE)
  try:
    with open(path) as f:
      stored = json.load(f)
  except (OSError, ValueError) as e:
    raise ValueError(f"workdir={workdir!r} holds a checkpoint (step {checkpoint_step}) but its "
                     f"config {path} cannot be read ({e}), so it cannot be told whether the "
                     "checkpoint belongs to this config; use another workdir") from None
  current = _flatten(json.loads(json.dumps(config.to_dict())))
  stored.pop(provenance.KEY, None)
  stored = _flatten(common.upgraded(stored))
  # A field added to the configs since the checkpoint was written, left at its default, changes
  # nothing the checkpoint holds (older workdirs resume).
  defaults = _flatten(json.loads(json.dumps(common.base().to_dict())))
  differing = sorted(k for k in set(current) | set(stored)
                     if current.get(k, _ABSENT) != stored.get(k, _ABSENT)
                     and not any(k == f or k.startswith(f + ".") for f in RESUMABLE_CHANGES)
                     and not (k not in stored and k in defaults and current[k] == defaults[k]))
  if differing:
    changes = "; ".join(f"{k}: {stored.get(k, _ABSENT)!r} there, {current.get(k, _ABSENT)!r} now"
                        for k in differing)
    raise ValueError(
        f"workdir={workdir!r} holds a checkpoint (step {checkpoint_step}) of another config "
        f"({changes}). A run resumes only with the config that wrote its checkpoints (allowed "
        f"to differ: {', '.join(RESUMABLE_CHANGES)}); use another workdir for this config.")


class _Absent:
  def __repr__(self):
    return "<absent>"


_ABSENT = _Absent()


def _flatten(tree: dict, prefix: str = "") -> dict:
  """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``."""
  out = {}
  for key, value in tree.items():
    if isinstance(value, dict) and value:
      out.update(_flatten(value, f"{prefix}{key}."))
    else:
      out[f"{prefix}{key}"] = value
  return out
