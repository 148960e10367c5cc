"""What each model field allows, declared with the field, and the check of a model's fields.

A model (a flax dataclass) declares each of its settings with one of the functions here, e.g.
``kernel_size: int = fields.integer(5)``, and :func:`check` refuses a value its rule does not
allow, in one line naming ``config.model.<field>``, before the module is built
(:func:`experiments.models.build_model`): a value that breaks shape inference (a zero stride or
width) fails deep inside JAX, with a message that names no field, or as a ZeroDivisionError.
Fields the dataset sets (``num_classes``, ``vocab_size``) are declared without a rule.
"""

from collections.abc import Collection, Mapping
import dataclasses
from typing import Any

from compressors import checks

_RULE = "rule"
_DIVIDES = "divides"


def declare(default: Any = dataclasses.MISSING, *, rule: checks.Rule,
            divides: str | None = None) -> Any:
  """A model field with ``default`` (none: a required field) that allows what ``rule`` allows
  (the rule every setting declares, :class:`compressors.checks.Rule`) and, with ``divides``,
  divides that other int field (attention heads the width)."""
  return dataclasses.field(default=default, metadata={_RULE: rule, _DIVIDES: divides})


def integer(default: Any = dataclasses.MISSING, *, minimum: int = 1, maximum: int | None = None,
            divides: str | None = None) -> Any:
  """An int field in ``[minimum, maximum]`` (no maximum by default) that divides the int field
  ``divides``, if given."""
  return declare(default, rule=checks.Rule(int, low=minimum, high=maximum), divides=divides)


def integers(default: tuple[int, ...], *, minimum: int = 1) -> Any:
  """A field holding a tuple of ints ``>= minimum`` (e.g. a width per layer)."""
  return declare(default, rule=checks.Rule(int, low=minimum, each=True))


def rate(default: float) -> Any:
  """A dropout rate: a number in [0, 1)."""
  return declare(default, rule=checks.Rule(float, low=0, high=1, high_open=True))


def choice(default: Any, allowed: Collection[Any]) -> Any:
  """A field holding one of ``allowed`` (of ``default``'s type)."""
  return declare(default, rule=checks.Rule(type(default), choices=tuple(allowed)))


def rules(module: type) -> dict[str, checks.Rule]:
  """The rule of each of ``module``'s declared fields, in the module's order."""
  return {f.name: f.metadata[_RULE] for f in dataclasses.fields(module) if _RULE in f.metadata}


def check(module: type, model: str, values: Mapping[str, Any]) -> None:
  """Refuses a field of ``values`` (model ``model``'s fields, without those the dataset sets)
  that its rule does not allow; fields left out are checked at their defaults, for a rule that
  relates two fields.

  Raises:
    ValueError: ``config.model.<field>=<value> is not allowed for model <model>; allowed: ...``
      for the first field, in the model's order, whose value is not allowed.
  """
  settings = {f.name: f.default for f in dataclasses.fields(module)
              if f.default is not dataclasses.MISSING}
  settings.update(values)
  divides = {f.name: f.metadata.get(_DIVIDES) for f in dataclasses.fields(module)}
  for name, rule in rules(module).items():
    if name not in settings:
      continue
    value, multiple = settings[name], divides[name]
    other = settings.get(multiple)
    if not rule.allows(value) or (multiple and rule.allows(other) and other % value):
      raise ValueError(
          f"config.model.{name}={value!r} is not allowed for model {model!r}; allowed: "
          f"{rule.allowed()}" + (f" that divides {multiple} ({multiple}={other!r})"
                                 if multiple else ""))
