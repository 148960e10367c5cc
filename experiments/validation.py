"""Checks a run's config before anything is loaded or compiled, with errors that name the field,
the value and what is allowed."""

import numbers

from experiments import data
from experiments import methods
from experiments import models


def _int(name, value, minimum):
  if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
    raise ValueError(f"config.{name}={value!r} must be an int >= {minimum}")


def _number(name, value, minimum):
  if isinstance(value, bool) or not isinstance(value, numbers.Real) or value < minimum:
    raise ValueError(f"config.{name}={value!r} must be a number >= {minimum}")


def _choice(name, value, allowed):
  if value not in allowed:
    raise ValueError(f"config.{name}={value!r} is not allowed; allowed: {sorted(allowed)}")


def check_config(config, num_devices: int) -> None:
  """Validates ``config`` for a mesh of ``num_devices`` devices.

  Builds the communication transformation (not compiled), so a compressor's own checks of its
  settings run here too.

  Raises:
    ValueError: the first problem found.
  """
  data.check_name(config.dataset)
  _choice("model.name", config.model.get("name"), models.MODELS)
  methods.check_method(config.method)
  _choice("optimizer.name", config.optimizer.name, methods.OPTIMIZERS)
  _choice("schedule.name", config.schedule.name, methods.SCHEDULES)
  _number("optimizer.learning_rate", config.optimizer.learning_rate, 0)
  _number("optimizer.weight_decay", config.optimizer.weight_decay, 0)
  _number("schedule.warmup_epochs", config.schedule.warmup_epochs, 0)
  for name in ("batch_size", "eval_batch_size"):
    _int(name, config[name], 1)
    if config[name] % num_devices:
      raise ValueError(f"config.{name}={config[name]} must be divisible by the "
                       f"{num_devices} devices of the mesh")
  _int("num_steps", config.num_steps, 0)
  _number("num_epochs", config.num_epochs, 0)
  if (config.num_steps > 0) == (config.num_epochs > 0):
    raise ValueError(f"exactly one of config.num_steps={config.num_steps} and "
                     f"config.num_epochs={config.num_epochs} must be > 0")
  for name in ("log_every", "eval_every", "checkpoint_every"):
    _int(name, config[name], 0)
  _int("keep_checkpoints", config.keep_checkpoints, 1)
  _int("seed", config.seed, 0)
  if methods.uses_curvature(config):
    _int("compression.hessian_every", config.compression.hessian_every, 1)
    _int("compression.num_probes", config.compression.num_probes, 1)
  methods.communication(config)
