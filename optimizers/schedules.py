"""Learning-rate schedules and batch-size scaling rules of the large-batch recipes.

* :func:`warmup_polynomial_decay`: linear warmup, then polynomial decay; power 1 is the
  LAMB/BERT recipe (You et al., ICLR 2020: "warmup then linear decay"), power 2 the LARS /
  MLPerf ResNet-50 recipe (You, Gitman & Ginsburg 2017, "poly(2)").
* :func:`scale_learning_rate`: the linear rule (Goyal et al. 2017, used for SGD and LARS) and
  the square-root rule (Krizhevsky 2014; Hoffer et al. 2017; LAMB's choice for Adam-type
  methods) for moving a learning rate tuned at one batch size to another.
* :func:`mlperf_lars_preset` / :func:`mlperf_lars_schedule`: MLPerf's LARS table. Source:
  mlcommons/training, ``image_classification/tensorflow2/lars_util.py``
  (``PolynomialDecayWithWarmup``, commit dc72f48): batch < 16384 -> base lr 10, 5 warmup
  epochs; 16384 <= batch < 32768 -> 25, 5; batch >= 32768 -> 31.2, 25; end lr 1e-4; power 2;
  decay over ``train_steps - warmup_steps + 1`` steps. The base learning rate is absolute (not
  rescaled by batch size) and MLPerf submitters override it per run.
"""

import math
from typing import NamedTuple

import optax

from optimizers import _validation

SCALING_RULES = ("linear", "sqrt")


def warmup_polynomial_decay(
    peak_value: float,
    warmup_steps: int,
    total_steps: int,
    *,
    end_value: float = 0.0,
    power: float = 1.0,
    init_value: float = 0.0,
) -> optax.Schedule:
  """Linear warmup to ``peak_value``, then polynomial decay to ``end_value``.

  ``lr(t) = init + (peak - init) * t / W`` for ``t < W``, then
  ``lr(t) = end + (peak - end) * (1 - (t - W) / (T - W)) ** power`` for ``W <= t <= T`` and
  ``end`` after, with ``W = warmup_steps`` and ``T = total_steps``. Built from
  ``optax.linear_schedule``, ``optax.polynomial_schedule`` and ``optax.join_schedules``.
  The decay starts at the end of the warmup (as MLPerf's LARS schedule); BERT's
  ``optimization.py`` instead decays from step 0 and lets the warmup override the start.

  Args:
    peak_value: learning rate reached at the end of the warmup (>= 0).
    warmup_steps: number of warmup steps (>= 0).
    total_steps: step at which ``end_value`` is reached (> warmup_steps).
    end_value: final learning rate (>= 0).
    power: decay exponent (> 0): 1 for LAMB/BERT, 2 for LARS/MLPerf.
    init_value: learning rate at step 0 (>= 0).

  Returns:
    An optax schedule (step count -> learning rate).
  """
  caller = "warmup_polynomial_decay"
  _validation.check_non_negative(peak_value, "peak_value", caller)
  _validation.check_non_negative(end_value, "end_value", caller)
  _validation.check_non_negative(init_value, "init_value", caller)
  _validation.check_positive(power, "power", caller)
  warmup_steps = _validation.check_int(warmup_steps, "warmup_steps", 0, caller)
  total_steps = _validation.check_int(total_steps, "total_steps", warmup_steps + 1, caller)
  decay = optax.polynomial_schedule(peak_value, end_value, power, total_steps - warmup_steps)
  if warmup_steps == 0:
    return decay
  return optax.join_schedules(
      [optax.linear_schedule(init_value, peak_value, warmup_steps), decay],
      [warmup_steps])


def scale_learning_rate(base_learning_rate: float, batch_size: int, *, base_batch_size: int,
                        rule: str) -> float:
  """Scales a learning rate tuned at ``base_batch_size`` to ``batch_size``.

  ``"linear"``: ``lr * batch_size / base_batch_size`` (Goyal et al. 2017; SGD, LARS).
  ``"sqrt"``: ``lr * sqrt(batch_size / base_batch_size)`` (Krizhevsky 2014; LAMB, Adam).

  Args:
    base_learning_rate: the learning rate at ``base_batch_size`` (>= 0).
    batch_size: the new (global) batch size (int >= 1).
    base_batch_size: the batch size ``base_learning_rate`` was tuned at (int >= 1).
    rule: ``"linear"`` or ``"sqrt"``.

  Returns:
    The scaled learning rate.
  """
  caller = "scale_learning_rate"
  base_learning_rate = _validation.check_non_negative(
      base_learning_rate, "base_learning_rate", caller)
  batch_size = _validation.check_int(batch_size, "batch_size", 1, caller)
  base_batch_size = _validation.check_int(base_batch_size, "base_batch_size", 1, caller)
  rule = _validation.check_choice(rule, "rule", SCALING_RULES, caller)
  ratio = batch_size / base_batch_size
  return base_learning_rate * (ratio if rule == "linear" else math.sqrt(ratio))


class MLPerfLarsPreset(NamedTuple):
  """MLPerf ResNet-50 LARS learning-rate settings for one batch size."""
  base_learning_rate: float
  warmup_epochs: int
  end_learning_rate: float = 1e-4
  power: float = 2.0


def mlperf_lars_preset(batch_size: int) -> MLPerfLarsPreset:
  """MLPerf's base learning rate and warmup epochs for LARS at ``batch_size``.

  Args:
    batch_size: global batch size (int >= 1).

  Returns:
    ``MLPerfLarsPreset``: (10, 5) below 16384, (25, 5) below 32768, (31.2, 25) from 32768,
    end learning rate 1e-4, power 2 (see the module docstring for the source).
  """
  batch_size = _validation.check_int(batch_size, "batch_size", 1, "mlperf_lars_preset")
  if batch_size < 16384:
    return MLPerfLarsPreset(base_learning_rate=10.0, warmup_epochs=5)
  if batch_size < 32768:
    return MLPerfLarsPreset(base_learning_rate=25.0, warmup_epochs=5)
  return MLPerfLarsPreset(base_learning_rate=31.2, warmup_epochs=25)


def mlperf_lars_schedule(batch_size: int, steps_per_epoch: int,
                         train_steps: int) -> optax.Schedule:
  """MLPerf's LARS schedule: warmup from 0, then polynomial(2) decay to 1e-4.

  ``lr(t) = base * t / W`` for ``t <= W = warmup_epochs * steps_per_epoch``, then
  ``(base - 1e-4) * (1 - (t - W) / (train_steps - W + 1)) ** 2 + 1e-4``, exactly as
  ``PolynomialDecayWithWarmup`` in mlcommons/training computes it.

  Args:
    batch_size: global batch size, selects the preset (int >= 1).
    steps_per_epoch: optimizer steps per epoch (int >= 1).
    train_steps: total optimizer steps (int > the warmup steps).

  Returns:
    An optax schedule (step count -> learning rate).
  """
  caller = "mlperf_lars_schedule"
  preset = mlperf_lars_preset(batch_size)
  steps_per_epoch = _validation.check_int(steps_per_epoch, "steps_per_epoch", 1, caller)
  warmup_steps = preset.warmup_epochs * steps_per_epoch
  train_steps = _validation.check_int(train_steps, "train_steps", warmup_steps + 1, caller)
  return warmup_polynomial_decay(
      preset.base_learning_rate, warmup_steps, train_steps + 1,
      end_value=preset.end_learning_rate, power=preset.power)
