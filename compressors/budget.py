"""A method's budget search: the value of one settings field whose bytes come closest to a target.

What :func:`compressors.equal_bytes.solve` runs on a method's declared budget (a fraction such as
``density``, or a count such as ``rank``), and what a method's own search (TASC's block size and
density) runs too. It knows no method and imports no assembly: a method module may use it.
"""

import dataclasses
import math
from collections.abc import Callable
from typing import Any


def fit_field(settings: Any, field: str, cost: Callable[[Any], float],
              target: float) -> Any | None:
  """``settings`` with ``field`` set so that ``cost`` comes closest to ``target``.

  ``cost`` must not decrease as the field grows, and is a step function of it (a density sets a
  whole number of entries). A float field is a fraction in (0, 1], searched by bisection on its
  logarithm; the value returned is the middle of its step, so that the count the method rounds
  it to does not hang on the last bit. An int field is a count >= 1, searched by bisection up to
  2^20. Settings the method refuses (``ValueError``, when made or priced) count as infinitely
  expensive, and a fraction is searched from the smallest one the method takes (chunked top-k
  refuses a density that keeps no entry of a chunk).

  Returns:
    The settings of the value (of the two around the target) closest to it in log bytes, or None
    if no value can be priced.
  """
  default = getattr(settings, field)
  if isinstance(default, bool) or not isinstance(default, (int, float)):
    raise TypeError(f"equal_bytes: {type(settings).__name__}.{field}={default!r} is not a number "
                    "to search")
  with_value = lambda v: dataclasses.replace(settings, **{field: v})
  evaluate = lambda v: _cost_or_inf(lambda: cost(with_value(v)))
  if isinstance(default, int):
    low, high = 0, 1  # the largest count known within the target, the smallest known above it
    while high < 2**20 and evaluate(high) <= target:
      low, high = high, 2 * high
    while high - low > 1:
      middle = (low + high) // 2
      low, high = (middle, high) if evaluate(middle) <= target else (low, middle)
    candidates = [v for v in (low, high) if v >= 1]
  else:
    smallest = _smallest_priced(evaluate)
    if smallest is None:
      return None
    low, high = _bisect(evaluate, lambda v: v <= target, smallest, 1.0)
    candidates = [_step_middle(evaluate, v, smallest) for v in (low, high) if v is not None]
  scored = [(abs(math.log(evaluate(v) / target)), v) for v in candidates
            if math.isfinite(evaluate(v))]
  return with_value(min(scored)[1]) if scored else None


_SMALLEST = 2.0**-40


def _bisect(evaluate, within, low: float, high: float) -> tuple[float | None, float | None]:
  """``(largest value found whose cost is within, smallest value found whose cost is not)`` by
  bisection of the logarithm between ``low`` and ``high``; None where there is none."""
  if within(evaluate(high)):
    return high, None
  if not within(evaluate(low)):
    return None, low
  for _ in range(64):
    middle = math.sqrt(low * high)
    low, high = (middle, high) if within(evaluate(middle)) else (low, middle)
  return low, high


def _smallest_priced(evaluate) -> float | None:
  """The smallest fraction in ``[_SMALLEST, 1]`` whose settings the method takes, to the
  bisection's precision (those it refuses are priced infinite, and a method that takes a
  fraction takes every larger one), or None if it takes none."""
  if math.isfinite(evaluate(_SMALLEST)):
    return _SMALLEST
  if not math.isfinite(evaluate(1.0)):
    return None
  low, high = _SMALLEST, 1.0
  for _ in range(64):
    middle = math.sqrt(low * high)
    low, high = (low, middle) if math.isfinite(evaluate(middle)) else (middle, high)
  return high


def _step_middle(evaluate, value: float, smallest: float = _SMALLEST) -> float:
  """The middle of the interval of values that cost what ``value`` costs: ``k / n`` for a
  density that keeps ``round(density * n) = k`` of ``n`` (the first interval, which a cost model
  prices as one entry, runs from 0, and its middle still keeps one)."""
  cost = evaluate(value)
  low, _ = _bisect(evaluate, lambda c: c < cost, smallest, value)
  _, high = _bisect(evaluate, lambda c: c <= cost, value, 1.0)
  return ((low or 0.0) + (high or 1.0)) / 2


def _cost_or_inf(priced: Callable[[], float]) -> float:
  """``priced()``, the cost of settings made inside it, or infinity where the method refuses
  them (a ``ValueError`` when they are made or priced)."""
  try:
    return priced()
  except ValueError:
    return math.inf
