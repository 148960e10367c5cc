"""Construction-time checks of optimizer hyper-parameters.

Every check raises before anything is traced or compiled, with a message that names the
optimizer, the field, the value given and what is allowed, e.g.
``lamb: b1=1.5 is not allowed; b1 must be in [0, 1).``
"""

import numbers
from typing import Any

import numpy as np


def _fail(caller: str, name: str, value: Any, allowed: str) -> None:
  raise ValueError(f"{caller}: {name}={value!r} is not allowed; {name} must be {allowed}.")


def as_float(caller: str, name: str, value: Any) -> float:
  """Returns ``value`` (a real number or a 0-d array) as a float; TypeError for anything else."""
  is_scalar_array = getattr(value, "shape", None) == () and np.issubdtype(
      getattr(value, "dtype", np.dtype(object)), np.number)
  if isinstance(value, bool) or not (isinstance(value, numbers.Real) or is_scalar_array):
    raise TypeError(
        f"{caller}: {name}={value!r} (type {type(value).__name__}) is not a real number; "
        f"{name} must be a real number.")
  return float(value)


def check_non_negative(caller: str, name: str, value: Any) -> float:
  """Checks ``value >= 0`` (NaN fails) and returns it as a float."""
  number = as_float(caller, name, value)
  if not number >= 0.0:
    _fail(caller, name, value, ">= 0")
  return number


def check_positive(caller: str, name: str, value: Any) -> float:
  """Checks ``value > 0`` (NaN fails) and returns it as a float."""
  number = as_float(caller, name, value)
  if not number > 0.0:
    _fail(caller, name, value, "> 0")
  return number


def check_unit_interval(caller: str, name: str, value: Any) -> float:
  """Checks ``0 <= value < 1`` (a decay rate or momentum) and returns it as a float."""
  number = as_float(caller, name, value)
  if not 0.0 <= number < 1.0:
    _fail(caller, name, value, "in [0, 1)")
  return number


def check_learning_rate(caller: str, value: Any) -> Any:
  """Accepts an optax schedule (any callable) or a non-negative number; returns it unchanged."""
  if callable(value):
    return value
  check_non_negative(caller, "learning_rate", value)
  return value


def check_choice(caller: str, name: str, value: Any, choices: tuple[str, ...]) -> str:
  """Checks that ``value`` is one of ``choices``."""
  if value not in choices:
    _fail(caller, name, value, "one of " + ", ".join(repr(c) for c in choices))
  return value


def check_bool(caller: str, name: str, value: Any) -> bool:
  """Checks that ``value`` is a Python or NumPy boolean."""
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{caller}: {name}={value!r} is not a bool; {name} must be True or False.")
  return bool(value)


def check_trust_clip(caller: str, value: Any) -> tuple[float, float] | None:
  """Checks ``trust_clip``: None, or a pair ``(lower, upper)`` with ``0 <= lower <= upper``."""
  if value is None:
    return None
  if not isinstance(value, (tuple, list)) or len(value) != 2:
    _fail(caller, "trust_clip", value, "None or a pair (lower, upper) with 0 <= lower <= upper")
  lower = check_non_negative(caller, "trust_clip[0] (lower)", value[0])
  upper = as_float(caller, "trust_clip[1] (upper)", value[1])
  if not lower <= upper:
    _fail(caller, "trust_clip", value, "a pair (lower, upper) with lower <= upper")
  return lower, upper


def check_int(caller: str, name: str, value: Any, minimum: int) -> int:
  """Checks that ``value`` is an integer (not a bool) >= ``minimum``."""
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise TypeError(
        f"{caller}: {name}={value!r} is not an integer; {name} must be an int >= {minimum}.")
  if value < minimum:
    _fail(caller, name, value, f"an int >= {minimum}")
  return int(value)
