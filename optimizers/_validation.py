"""Construction-time checks of optimizer hyper-parameters.

Arguments come in the order :mod:`compressors.checks` uses (``value, field, ..., caller``), so
that checks of the same name read the same in both packages; this one does not import that one.

Every check raises before anything is traced or compiled, with a message that names the
optimizer, the field, the value given and what is allowed, e.g.
``lamb: b1=1.5 is not allowed; b1 must be in [0, 1).``
"""

import numbers
from typing import Any

import numpy as np


def _fail(value: Any, field: str, allowed: str, caller: str) -> None:
  raise ValueError(f"{caller}: {field}={value!r} is not allowed; {field} must be {allowed}.")


def as_float(value: Any, field: str, caller: str) -> float:
  """Returns ``value`` (a real number or a 0-d array) as a float; TypeError for anything else."""
  is_scalar_array = getattr(value, "shape", None) == () and np.issubdtype(
      getattr(value, "dtype", np.dtype(object)), np.number)
  if isinstance(value, bool) or not (isinstance(value, numbers.Real) or is_scalar_array):
    raise TypeError(
        f"{caller}: {field}={value!r} (type {type(value).__name__}) is not a real number; "
        f"{field} must be a real number.")
  return float(value)


def check_non_negative(value: Any, field: str, caller: str) -> float:
  """Checks ``value >= 0`` (NaN fails) and returns it as a float."""
  number = as_float(value, field, caller)
  if not number >= 0.0:
    _fail(value, field, ">= 0", caller)
  return number


def check_positive(value: Any, field: str, caller: str) -> float:
  """Checks ``value > 0`` (NaN fails) and returns it as a float."""
  number = as_float(value, field, caller)
  if not number > 0.0:
    _fail(value, field, "> 0", caller)
  return number


def check_unit_interval(value: Any, field: str, caller: str) -> float:
  """Checks ``0 <= value < 1`` (a decay rate or momentum) and returns it as a float."""
  number = as_float(value, field, caller)
  if not 0.0 <= number < 1.0:
    _fail(value, field, "in [0, 1)", caller)
  return number


def check_learning_rate(value: Any, caller: str) -> Any:
  """Accepts an optax schedule (any callable) or a non-negative number; returns it unchanged."""
  if callable(value):
    return value
  check_non_negative(value, "learning_rate", caller)
  return value


def check_choice(value: Any, field: str, choices: tuple[str, ...], caller: str) -> str:
  """Checks that ``value`` is one of ``choices``."""
  if value not in choices:
    _fail(value, field, "one of " + ", ".join(repr(c) for c in choices), caller)
  return value


def check_bool(value: Any, field: str, caller: str) -> bool:
  """Checks that ``value`` is a Python or NumPy boolean."""
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{caller}: {field}={value!r} is not a bool; {field} must be True or False.")
  return bool(value)


def check_trust_clip(value: Any, caller: str) -> tuple[float, float] | None:
  """Checks ``trust_clip``: None, or a pair ``(lower, upper)`` with ``0 <= lower <= upper``."""
  if value is None:
    return None
  if not isinstance(value, (tuple, list)) or len(value) != 2:
    _fail(value, "trust_clip", "None or a pair (lower, upper) with 0 <= lower <= upper", caller)
  lower = check_non_negative(value[0], "trust_clip[0] (lower)", caller)
  upper = as_float(value[1], "trust_clip[1] (upper)", caller)
  if not lower <= upper:
    _fail(value, "trust_clip", "a pair (lower, upper) with lower <= upper", caller)
  return lower, upper


def check_int(value: Any, field: str, minimum: int, caller: str) -> int:
  """Checks that ``value`` is an integer (not a bool) >= ``minimum``."""
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise TypeError(
        f"{caller}: {field}={value!r} is not an integer; {field} must be an int >= {minimum}.")
  if value < minimum:
    _fail(value, field, f"an int >= {minimum}", caller)
  return int(value)


def check_axis_name(value: Any, field: str, caller: str) -> Any:
  """Checks that ``value`` is None, a mesh axis's name (a string) or a tuple of them."""
  names = value if isinstance(value, tuple) else (value,)
  if value is not None and not (names and all(isinstance(n, str) and n for n in names)):
    raise TypeError(f"{caller}: {field}={value!r} is not a mesh axis's name; {field} must be "
                    "None, a non-empty string or a tuple of them.")
  return value
