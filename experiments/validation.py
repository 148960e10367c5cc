"""Checks a run's config and workdir before anything is loaded or compiled, with errors that name
the field, the value and what is allowed."""

import json
import math
import numbers
import os

from configs import common
from experiments import data
from experiments import distributed
from experiments import methods
from experiments import models
from experiments import provenance

CONFIG_FILE = "config.json"
# Fields that may change when a run resumes: they decide what is logged, checked and kept, when a
# run counts as diverged, where the data is and how processes meet, never the trajectory of the
# training state.
RESUMABLE_CHANGES = ("data_dir", "log_every", "eval_every", "checkpoint_every",
                     "keep_checkpoints", "check_replicas_every", "max_skipped_fraction",
                     "distributed", "data.decode_threads")


def _int(name, value, minimum):
  if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
    raise ValueError(f"config.{name}={value!r} must be an int >= {minimum}")


def _number(name, value, minimum):
  # NaN compares False with everything, so `value < minimum` alone would let it through.
  if (isinstance(value, bool) or not isinstance(value, numbers.Real)
      or not math.isfinite(value) or value < minimum):
    raise ValueError(f"config.{name}={value!r} must be a finite number >= {minimum}")


def _fraction(name, value):
  if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 <= value <= 1:
    raise ValueError(f"config.{name}={value!r} must be a number in [0, 1]")


def _choice(name, value, allowed):
  if value not in allowed:
    raise ValueError(f"config.{name}={value!r} is not allowed; allowed: {sorted(allowed)}")


def _bool(name, value):
  if not isinstance(value, bool):
    raise TypeError(f"config.{name}={value!r} must be True or False")


def check_workers(config) -> None:
  """``config.num_devices`` (None: every device) and ``config.workers_per_device``, and, where
  the device count is given, the batch sizes against the workers: all of it without JAX, so
  that a run can check it before JAX starts its devices (:func:`check_batches`)."""
  if config.num_devices is not None:
    _int("num_devices", config.num_devices, 1)
  _int("workers_per_device", config.workers_per_device, 1)
  if config.num_devices is not None:
    check_batches(config, config.num_devices * config.workers_per_device)


def check_batches(config, num_workers: int) -> None:
  """``config.batch_size`` and ``eval_batch_size``: ints >= 1 that the workers divide."""
  for name in ("batch_size", "eval_batch_size"):
    _int(name, config[name], 1)
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

  Builds the communication transformation (not compiled), so a compressor's own checks of its
  settings run here too.

  Raises:
    ValueError: the first problem found.
  """
  check_finite(config)
  data.check_name(config.dataset)
  _choice("model.name", config.model.get("name"), models.MODELS)
  methods.check_method(config.method)
  _choice("optimizer.name", config.optimizer.name, methods.OPTIMIZERS)
  _choice("schedule.name", config.schedule.name, methods.LR_SCHEDULES)
  _number("optimizer.learning_rate", config.optimizer.learning_rate, 0)
  _number("optimizer.weight_decay", config.optimizer.weight_decay, 0)
  _number("schedule.warmup_epochs", config.schedule.warmup_epochs, 0)
  _int("schedule.warmup_steps", config.schedule.warmup_steps, 0)
  check_batches(config, num_workers)
  _int("num_steps", config.num_steps, 0)
  _number("num_epochs", config.num_epochs, 0)
  if (config.num_steps > 0) == (config.num_epochs > 0):
    raise ValueError(f"exactly one of config.num_steps={config.num_steps} and "
                     f"config.num_epochs={config.num_epochs} must be > 0")
  for name in ("log_every", "eval_every", "checkpoint_every"):
    _int(name, config[name], 0)
  _int("keep_checkpoints", config.keep_checkpoints, 1)
  _int("check_replicas_every", config.check_replicas_every, 0)
  _bool("skip_nonfinite", config.skip_nonfinite)
  _fraction("max_skipped_fraction", config.max_skipped_fraction)
  distributed.heartbeat_timeout(config)
  _int("seed", config.seed, 0)
  check_workers(config)
  c = config.compression
  if c.momentum_correction and config.optimizer.name in ("momentum", "nesterov"):
    raise ValueError(f"config.optimizer.name={config.optimizer.name!r} with "
                     f"compression.momentum_correction={c.momentum_correction!r} applies "
                     "momentum twice; allowed: 'sgd' (or momentum_correction=0)")
  methods.make_chain(config, config.optimizer.learning_rate)
  methods.step_kinds(config)


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
  stored = _flatten(stored)
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
