"""Argument checks shared by compressor factories, for this package and for new compressors, and
the declared rules of settings (:class:`Rule`, :func:`setting`): a settings dataclass's fields,
and a run config's own fields (``configs.common.RULES``), each declare what they allow once, and
everything that takes them checks that declaration.

Each raises before anything is traced, with an error that names the caller, the field, the value
and what is allowed.
"""

import dataclasses
import math
import numbers
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp


def check_fraction(value, field: str, caller: str) -> float:
  """``value`` as a float if it is a real number in (0, 1] (a fraction of entries sent)."""
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise TypeError(f"{caller}: {field} must be a number in (0, 1], got {value!r}")
  if not 0.0 < float(value) <= 1.0:
    raise ValueError(f"{caller}: {field}={value!r} is outside (0, 1]; it is the fraction of "
                     "gradient elements sent each step (0.01 sends 1%)")
  return float(value)


def check_int(value, field: str, minimum: int, caller: str) -> int:
  """``value`` if it is an int (not a bool) of at least ``minimum``."""
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise TypeError(f"{caller}: {field} must be an int >= {minimum}, got {value!r}")
  if value < minimum:
    raise ValueError(f"{caller}: {field}={value!r} is below {minimum}; it must be an int >= "
                     f"{minimum}")
  return int(value)


def check_real(value, field: str, low: float, high: float, allowed: str, caller: str) -> float:
  """``value`` as a float if it is a real number with ``low <= value < high`` (``allowed``
  writes that interval for the message)."""
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise TypeError(f"{caller}: {field} must be a number in {allowed}, got {value!r}")
  if not low <= float(value) < high:
    raise ValueError(f"{caller}: {field}={value!r} is outside {allowed}")
  return float(value)


def check_choice(value, field: str, allowed, caller: str):
  """``value`` if it is one of ``allowed``."""
  if value not in allowed:
    raise ValueError(f"{caller}: {field}={value!r} is unknown; allowed: {tuple(allowed)}")
  return value


def dtype_name(dtype) -> str | None:
  """``dtype``'s numpy name (``jnp.float16`` and ``"float16"`` give ``"float16"``); None when
  ``dtype`` names no dtype."""
  try:
    return jnp.dtype(dtype).name
  except TypeError:
    return None


@dataclasses.dataclass(frozen=True)
class Rule:
  """What one setting allows, declared once next to the setting (:func:`setting` on a settings
  dataclass's field, ``configs.common.RULES`` for a run config's own fields) and checked from
  there by everything that takes the setting: a settings dataclass when it is made
  (:func:`check_settings`), a run's and each sweep run's config before JAX starts
  (``experiments.validation.check_config``).

  Attributes:
    kind: ``int``, ``float`` (an int is taken too; never NaN or infinite), ``str`` or ``bool``.
    low, high: the bounds (None: unbounded), closed unless ``low_open`` / ``high_open``.
    low_open, high_open: whether the bound itself is refused.
    choices: the allowed values, if only some are.
    optional: None is allowed too.
    each: the setting is a tuple or list, and the rule is its elements'.
    condition: ``(test, words)``: a further condition a value within the bounds must meet, and
      what it allows in words (a ResNet's depth, ``6n + 2``); None: none.
  """
  kind: type
  low: float | None = None
  high: float | None = None
  low_open: bool = False
  high_open: bool = False
  choices: tuple = ()
  optional: bool = False
  each: bool = False
  condition: tuple[Callable[[Any], bool], str] | None = None

  def allowed(self) -> str:
    """What the rule allows, in words (``an int >= 1``, ``a number in [0, 1)``)."""
    if self.condition is not None:
      text = self.condition[1]
    elif self.choices:
      text = f"one of {self.choices}"
    elif self.kind is bool:
      text = "True or False"
    elif self.kind is str:
      text = "a string"
    elif self.kind is int and self.low is None:
      text = "an int"
    elif self.kind is int and self.high is None:
      text = f"an int >= {self._lowest()}"
    elif self.kind is int:
      text = f"an int in [{self._lowest()}, {self._highest()}]"
    else:
      text = f"a number in {self._interval()}"
    if self.each:
      text = f"a tuple of values each {text}"
    return f"{text}, or None" if self.optional else text

  def check(self, value, name: str):
    """``value`` if the rule allows it.

    Args:
      value: the setting's value.
      name: the setting as the message names it: ``config.optimizer.b1``, or ``caller: field``.

    Returns:
      ``value``, unchanged.

    Raises:
      TypeError: a value of the wrong type; ValueError: one outside what is allowed; each naming
        ``name``, ``value`` and what is allowed, in the words of the checks above.
    """
    if value is None and self.optional:
      return value
    if self.each:
      if not isinstance(value, (tuple, list)):
        raise TypeError(f"{name} must be {self.allowed()}, got {value!r}")
      element = dataclasses.replace(self, each=False, optional=False)
      for i, item in enumerate(value):
        element.check(item, f"{name}[{i}]")
      return value
    if not self._has_kind(value):
      raise TypeError(f"{name} must be {self.allowed()}, got {value!r}")
    if self.choices:
      if value not in self.choices:
        raise ValueError(f"{name}={value!r} is unknown; allowed: {self.choices}")
    elif self.kind is int:
      if self.low is not None and value < self._lowest():
        raise ValueError(f"{name}={value!r} is below {self._lowest()}; it must be "
                         f"{self.allowed()}")
      if self.high is not None and value > self._highest():
        raise ValueError(f"{name}={value!r} is above {self._highest()}; it must be "
                         f"{self.allowed()}")
    elif self.kind is float and not self._within(value):
      raise ValueError(f"{name}={value!r} is outside {self._interval()}")
    if self.condition is not None and not self.condition[0](value):
      raise ValueError(f"{name}={value!r} is not allowed; it must be {self.allowed()}")
    return value

  def allows(self, value) -> bool:
    """Whether the rule allows ``value`` (:meth:`check` without the error)."""
    try:
      self.check(value, "value")
    except (TypeError, ValueError):
      return False
    return True

  def _has_kind(self, value) -> bool:
    if self.kind is bool:
      return isinstance(value, bool)
    if self.kind is int:
      return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if self.kind is float:
      return isinstance(value, numbers.Real) and not isinstance(value, bool)
    return isinstance(value, self.kind)

  def _within(self, value) -> bool:
    # NaN compares False with everything, so each test is written to fail for it.
    if not math.isfinite(value):
      return False
    if self.low is not None and not (value > self.low if self.low_open else value >= self.low):
      return False
    return self.high is None or (value < self.high if self.high_open else value <= self.high)

  def _lowest(self) -> int:
    """An int rule's smallest allowed value."""
    return self.low + 1 if self.low_open else self.low

  def _highest(self) -> int:
    """An int rule's largest allowed value."""
    return self.high - 1 if self.high_open else self.high

  def _interval(self) -> str:
    """A number rule's interval, ``[0, 1)``, ``(0, inf)``."""
    low = "(-inf" if self.low is None else f"{'(' if self.low_open else '['}{_bound(self.low)}"
    high = "inf)" if self.high is None else f"{_bound(self.high)}{')' if self.high_open else ']'}"
    return f"{low}, {high}"


def _bound(value) -> str:
  # An int bound in full (a seed's 4294967295, not 4.29e+09), a float one as short as it goes.
  return str(value) if isinstance(value, int) else f"{value:g}"


# The seeds of the shared randomness are a uint32 (jax.random.key's range).
SEED = Rule(int, low=0, high=2**32 - 1)
# A fraction of the entries sent (a density), as check_fraction has it.
FRACTION = Rule(float, low=0, low_open=True, high=1)


def setting(default, rule: Rule):
  """A settings dataclass field with ``default`` and the ``rule`` its values must obey
  (:func:`check_settings` checks it when the settings are made; ``configs.common`` reads it
  to check ``config.compression``)."""
  return dataclasses.field(default=default, metadata={"rule": rule})


def rules_of(settings) -> dict[str, Rule]:
  """The declared rules (:func:`setting`) of a settings dataclass (or an instance), by field."""
  return {f.name: f.metadata["rule"] for f in dataclasses.fields(settings) if "rule" in f.metadata}


def check_settings(settings, caller: str) -> None:
  """Checks every field of ``settings`` that declares a rule (:func:`setting`); the error names
  ``caller``, the field, the value and what is allowed (for a settings dataclass's
  ``__post_init__``)."""
  for field, rule in rules_of(settings).items():
    rule.check(getattr(settings, field), f"{caller}: {field}")
