"""The statistics the language-model pages report: a mean's interval over seeds, retention (the
share of communication's benefit a row keeps) with its interval, and where a family's retention
crosses a level along the compression ratio.

Retention, against two references trained with the same recipe and tuning budget:
``dense`` (every worker's gradient averaged every step) and ``solo`` (one worker alone on its
share of each step's batch: no communication at all),

    retention = (L_solo - L_row) / (L_solo - L_dense),

1 where a row matches dense, 0 where it is no better than not communicating, negative where it
is worse than that. Its 95% interval propagates the three means' spreads over seeds to first
order (the delta method: ``retention`` is linear in ``L_row`` and ``L_dense`` given ``L_solo``
minus ``L_dense``), with Welch and Satterthwaite's degrees of freedom for Student's t; each
reference and the row are independent runs. ``tests/test_reproduce_frontier.py`` checks its
coverage by simulation.
"""

import dataclasses
import math
from collections.abc import Sequence

import numpy as np
from scipy import stats as scipy_stats

LEVEL = 0.95  # every interval's confidence


def t_quantile(df: float) -> float:
  """Student's t quantile of a two-sided :data:`LEVEL` interval with ``df`` degrees of freedom."""
  return float(scipy_stats.t.ppf(0.5 + LEVEL / 2, df))


def interval(values: Sequence[float]) -> float:
  """Half-width of the 95% interval of the mean of ``values`` (Student's t; NaN for fewer than
  2)."""
  n = len(values)
  if n < 2:
    return math.nan
  return t_quantile(n - 1) * float(np.std(values, ddof=1)) / math.sqrt(n)


@dataclasses.dataclass(frozen=True)
class Retention:
  """A row's retention.

  Attributes:
    value: ``(L_solo - L_row) / (L_solo - L_dense)`` of the seeds' mean losses.
    half_width: of its 95% interval; NaN where the row or a reference has one seed, or where
      dense is no better than solo (no benefit to keep).
    seeds: the row's seeds.
  """
  value: float
  half_width: float
  seeds: int

  @property
  def low(self) -> float:
    return self.value - self.half_width

  @property
  def high(self) -> float:
    return self.value + self.half_width


def retention(row: Sequence[float], solo: Sequence[float], dense: Sequence[float]) -> Retention:
  """The retention of a row whose seeds reached losses ``row``, against the seeds' losses of solo
  and dense (see the module docstring).

  Raises:
    ValueError: a list is empty.
  """
  for name, values in (("row", row), ("solo", solo), ("dense", dense)):
    if not len(values):
      raise ValueError(f"retention: no {name} losses")
  means = [float(np.mean(v)) for v in (row, solo, dense)]
  mean_row, mean_solo, mean_dense = means
  benefit = mean_solo - mean_dense
  value = (mean_solo - mean_row) / benefit if benefit else math.nan
  if min(len(row), len(solo), len(dense)) < 2 or not benefit > 0:
    return Retention(value, math.nan, len(row))
  # value - r ~ ((1 - r) d_solo - d_row + r d_dense) / benefit: each term's variance of the mean.
  weights = (1.0, 1.0 - value, value)  # of row, solo and dense
  parts = [(w ** 2) * float(np.var(v, ddof=1)) / len(v)
           for w, v in zip(weights, (row, solo, dense))]
  variance = sum(parts)
  if variance == 0:
    return Retention(value, 0.0, len(row))
  df = variance ** 2 / sum(p ** 2 / (len(v) - 1) for p, v in zip(parts, (row, solo, dense)))
  return Retention(value, t_quantile(df) * math.sqrt(variance) / benefit, len(row))


@dataclasses.dataclass(frozen=True)
class Crossing:
  """Where a family's retention falls below a level, along the compression ratio.

  Attributes:
    ratio: the largest ratio at which the family keeps at least the level (interpolated in log
      ratio between the last point at or above it and the next point); None where no point
      reaches the level.
    low: the same from the points' lower interval ends (None likewise; NaN where an interval is
      missing).
    high: from their upper ends.
    beyond_range: the family's last (largest-ratio) point is still at or above the level: the
      crossing lies beyond the ratios run, ``ratio`` is that point's.
  """
  ratio: float | None
  low: float | None
  high: float | None
  beyond_range: bool


def _crossing(ratios: Sequence[float], values: Sequence[float], level: float) -> tuple:
  """(ratio, beyond_range) of :class:`Crossing` for one curve; ratios ascending."""
  if any(math.isnan(v) for v in values):
    return math.nan, False
  above = [i for i, v in enumerate(values) if v >= level]
  if not above:
    return None, False
  i = above[-1]
  if i == len(values) - 1:
    return float(ratios[i]), True
  a, b = values[i], values[i + 1]
  fraction = (a - level) / (a - b)
  log_ratio = math.log(ratios[i]) + fraction * (math.log(ratios[i + 1]) - math.log(ratios[i]))
  return math.exp(log_ratio), False


def crossing(points: Sequence[tuple[float, Retention]], level: float = 0.9) -> Crossing:
  """The largest ratio at which retention stays at least ``level``, from ``(ratio, retention)``
  points of one family, with an interval from the points' interval ends.

  Raises:
    ValueError: no points, or a ratio that is not positive.
  """
  if not points:
    raise ValueError("crossing: no points")
  points = sorted(points, key=lambda p: p[0])
  ratios = [p[0] for p in points]
  if min(ratios) <= 0:
    raise ValueError(f"crossing: ratios {ratios}; allowed: > 0")
  ratio, beyond = _crossing(ratios, [p[1].value for p in points], level)
  low, _ = _crossing(ratios, [p[1].low for p in points], level)
  high, _ = _crossing(ratios, [p[1].high for p in points], level)
  return Crossing(ratio, low, high, beyond)
