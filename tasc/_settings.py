"""TASC's settings: one frozen dataclass, checked in one place.

:class:`TascSettings` is what :func:`tasc.tasc`, :func:`tasc.tasc_compress`, the method registry
(``config.compression.tasc``), the cost model and the equal-bytes search all take: every setting
of TASC is named here once, and :func:`checked` is the one place that says what each field
allows. What the settings decide for a buffer (its blocks and capacity) is :mod:`tasc._plan`'s.
"""

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax

from compressors import checks
from tasc import _scores as scores
from tasc import _supports as supports
from tasc import _wire as wire_formats

SENSITIVITIES = ("hutchinson", "fisher", "none")
SUPPORTS = tuple(supports.SUPPORTS)
WIRE_DTYPES = tuple(wire_formats.FORMATS)
Density = float | Callable[[jax.Array], jax.Array] | Mapping[Any, float]


@dataclasses.dataclass(frozen=True)
class TascSettings:
  """TASC's settings (``method="tasc"``: ``config.compression.tasc``).

  Attributes:
    density: fraction of the buffer's blocks sent per step, in (0, 1]: a float; a function of
      the step (an optax schedule) with ``max_density``; or, for :func:`tasc.tasc_compress`, a
      mapping ``{axis: density}`` over its ``axis_name`` and ``dense_axis`` (see
      :mod:`tasc._transform` for the fast axis's options).
    max_density: the payload capacity's density when ``density`` is a schedule (the shapes are
      static); None otherwise.
    block_size: elements per block (>= 1). Larger blocks mean fewer scores and coarser
      selection. None: per buffer, the largest of
      :data:`tasc._plan.AUTO_BLOCK_SIZES` (256, 128, ..., 1) at which it sends at least one
      block (256 for a fused model of more than ~38K parameters at 1%, 64 for one of 4K);
      :func:`tasc.tasc_compress` takes 256 leaf by leaf.
    sensitivity: ``"hutchinson"`` (curvature passed as ``update(..., curvature=h)``, e.g.
      :func:`tasc.hutchinson_diagonal`, EMA kept in between), ``"fisher"`` (EMA of ``g^2``) or
      ``"none"`` (block magnitude).
    score: how the curvature weighs a block's energy: ``"saliency"`` multiplies
      (``h_b ||a_b||^2``, the loss a delay costs), ``"newton"`` divides (``||a_b||^2 / h_b``,
      the diagonal Newton decrement); see :mod:`tasc._scores`. ``"newton"`` needs a curvature
      (not ``sensitivity="none"``).
    support: ``"global"`` (an all-reduce of this step's block scores picks the blocks) or
      ``"previous"`` (last step's scores, carried in the payload's all-reduce: no extra
      collective); see :mod:`tasc._supports`.
    wire_dtype: ``"float32"`` or ``"float16"``: the precision of the block scores and the
      payload on the wire; float16 halves the bytes, error feedback keeps the rounding (see
      :mod:`tasc._wire`).
    curvature_decay: EMA factor ``beta`` in [0, 1) of the curvature kept in the state
      (``c <- beta c + (1 - beta) * new``); 0 uses each fresh estimate alone.
    eps: the curvature floor relative to the mean curvature (>= 0); larger leans towards
      magnitude ranking.
    min_blocks_per_leaf: blocks of every parameter leaf always sent (>= 0); raises the
      payload's capacity above ``density``'s when the guarantees need more
      (:mod:`tasc._selection`).
    hessian_every: with ``sensitivity="hutchinson"``, steps between the trainer's fresh
      Hutchinson estimates of the Hessian diagonal (>= 1; the registry's per-step input).
    num_probes: probes of each estimate, from each worker's own batch (>= 1).
  """
  density: Density = 0.01
  max_density: float | None = None
  block_size: int | None = None
  sensitivity: str = "hutchinson"
  score: str = "saliency"
  support: str = "global"
  wire_dtype: str = "float32"
  curvature_decay: float = 0.9
  eps: float = 0.1
  min_blocks_per_leaf: int = 0
  hessian_every: int = 100
  num_probes: int = 4

  @property
  def capacity_density(self) -> float:
    """The density the payload's static capacity is sized for: ``max_density`` with a density
    schedule, else ``density``."""
    return self.max_density if callable(self.density) else self.density


def checked(settings: Any, caller: str = "tasc") -> TascSettings:
  """``settings`` with every field checked, numbers as floats and ints and ``wire_dtype`` by
  its name.

  Args:
    settings: a :class:`TascSettings`.
    caller: the public function named in the errors.

  Returns:
    The checked :class:`TascSettings`.

  Raises:
    TypeError, ValueError: naming the field, the value given and what is allowed.
  """
  if not isinstance(settings, TascSettings):
    raise TypeError(f"{caller}: settings must be a tasc.TascSettings, got "
                    f"{type(settings).__name__}: {settings!r}")
  s = settings
  wire_dtype = checks.dtype_name(s.wire_dtype) or s.wire_dtype
  if checks.check_choice(s.score, "score", scores.SCORES, caller) == "newton" and (
      s.sensitivity == "none"):
    raise ValueError(f"{caller}: score='newton' divides each block's energy by its curvature, "
                     "and sensitivity='none' estimates none; use sensitivity='hutchinson' or "
                     "'fisher' with it, or score='saliency'")
  return dataclasses.replace(
      s, **_checked_density(s.density, s.max_density, caller),
      block_size=None if s.block_size is None else checks.check_int(s.block_size, "block_size",
                                                                    1, caller),
      sensitivity=checks.check_choice(s.sensitivity, "sensitivity", SENSITIVITIES, caller),
      support=checks.check_choice(s.support, "support", SUPPORTS, caller),
      wire_dtype=checks.check_choice(wire_dtype, "wire_dtype", WIRE_DTYPES, caller),
      curvature_decay=checks.check_real(s.curvature_decay, "curvature_decay", 0.0, 1.0,
                                        "[0, 1)", caller),
      eps=checks.check_real(s.eps, "eps", 0.0, float("inf"), "[0, inf)", caller),
      min_blocks_per_leaf=checks.check_int(s.min_blocks_per_leaf, "min_blocks_per_leaf", 0,
                                           caller),
      hessian_every=checks.check_int(s.hessian_every, "hessian_every", 1, caller),
      num_probes=checks.check_int(s.num_probes, "num_probes", 1, caller))


def _checked_density(density: Density, max_density: float | None,
                     caller: str) -> dict[str, Any]:
  """``density`` and ``max_density`` checked: a schedule needs ``max_density``, a number or a
  mapping of numbers refuses it."""
  if callable(density):
    if max_density is None:
      raise ValueError(f"{caller}: density is a schedule (a callable of the step), so "
                       "max_density is required: the payload's capacity must be static; pass "
                       "the schedule's largest value, e.g. max_density=0.25")
    return dict(density=density, max_density=checks.check_fraction(max_density, "max_density",
                                                                   caller))
  if max_density is not None:
    raise ValueError(f"{caller}: max_density={max_density!r} is only for a density schedule; "
                     f"density={density!r} is not one")
  if isinstance(density, Mapping):
    return dict(density={k: checks.check_fraction(v, f"density[{k!r}]", caller)
                         for k, v in density.items()})
  return dict(density=checks.check_fraction(density, "density", caller))
