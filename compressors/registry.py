"""The method registry: every gradient-exchange method, declared once next to its implementation.

A *method* is what a run names in ``config.method``: a compressor and the transformation that
runs it, with everything a runner, a benchmark, a sweep or the cost model needs to know of it,
declared in one :class:`Method` in the ``METHODS`` tuple at the bottom of the module that
implements it:

* its own typed settings (a frozen dataclass whose fields all have defaults): the runner's
  ``config.compression.<name>`` block;
* its error-feedback default (its paper's);
* its cost-model entry: how :mod:`compressors.network.topology` prices one exchange (time and bytes);
* what sets its bytes (its *budget*: ``density``, ``rank``, ...), so that
  :mod:`compressors.equal_bytes` can set methods to equal bytes per step;
* optionally, per-step inputs its ``update`` takes (TASC's curvature), and how to make them.

Everything else reads the registry: ``experiments`` builds configs, validation, benchmark method
lists, sweeps and the paper's tables from :func:`names`; tests run every registered method through
the same checks.

The built-in methods, TASC's among them, are listed by name in :data:`BUILTIN` with the module
that declares each; the registry imports those modules on its first lookup, so that every
built-in is known without importing anything for its side effect, in the order of
:data:`BUILTIN`, and importing a method module changes nothing. Adding a built-in method is its
module, its line in :data:`BUILTIN` and its test; a method outside the project registers with
:func:`register`.

With :mod:`compressors`' ``__init__``, this module is the package's face: the only modules that
use the wrapper (:func:`compressors.compress`) that runs compressors; compressors never import it.
"""

import dataclasses
import importlib
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import optax

from compressors import protocol
from compressors.network import topology as topology_lib

Shapes = Sequence[tuple[int, ...]]


class StepInputs(NamedTuple):
  """Inputs a method's ``update`` takes on some steps, and how a trainer makes them.

  Attributes:
    every: steps between fresh inputs (a trainer passes them on steps ``0, every, 2 every...``
      and compiles its step with and without them; 0: never).
    make: ``(loss_fn, params, batch, key, axis_name) -> dict`` of keyword arguments for
      ``update``: ``loss_fn(params, batch)`` is one worker's loss, ``params`` the per-worker
      copy being differentiated, ``key`` fresh for the step, ``axis_name`` the workers' axis.
  """
  every: int
  make: Callable[..., dict[str, Any]]


@dataclasses.dataclass(frozen=True)
class Common:
  """Settings every method shares (``config.compression``'s own fields).

  Attributes:
    error_feedback: keep what was not sent; None takes the method's own default.
    fuse: one buffer for the whole model (tensor fusion), or one per leaf.
    seed: seed of the shared randomness (random-k's indices, stochastic rounding).
    momentum_correction: DGC's local momentum around the sparsifier (then plain SGD after it);
      0: off. Methods that correct momentum themselves (DGC) refuse it.
    clip_norm: the local gradient clipping of ``momentum_correction``; None: off.
  """
  error_feedback: bool | None = None
  fuse: bool = True
  seed: int = 0
  momentum_correction: float = 0.0
  clip_norm: float | None = None


@dataclasses.dataclass(frozen=True)
class Method:
  """One gradient-exchange method (see the module docstring).

  Attributes:
    name: the name runs use (``config.method``).
    summary: one line: the method and its paper.
    settings: a frozen dataclass of the method's own settings, every field with a default.
    cost: ``(settings, shapes, topology, schedule) -> compressors.network.topology.Cost`` of one
      exchange of gradients whose leaves have ``shapes``, summable payloads all-reduced by
      ``schedule`` (a name of :data:`compressors.network.collectives.SCHEDULES`, or ``"auto"``).
    compressor: ``settings -> Compressor``, run through :func:`compressors.compress`; or
    transformation: ``(settings, *, axis_name, error_feedback, fuse, seed, report_sent) ->``
      an optax transformation, for methods that are more than ``compress(compressor)`` (TASC).
    error_feedback: the method's default for ``Common.error_feedback``.
    fuse: the buffer layout the method needs (PowerSGD: per leaf, False); None: the common one.
    momentum: ``settings -> (momentum, clip_norm)`` for a method that is a sparsifier inside
      :func:`compressors.momentum_correction` (DGC); None: the common ``momentum_correction``.
    step_inputs: ``settings -> StepInputs | None``, the per-step inputs of its ``update``.
    budget: what sets the bytes of one exchange, for :func:`compressors.equal_bytes.solve`: the
      name of a settings field that the bytes grow with (a float is a fraction in (0, 1], an
      int a count >= 1), or ``(settings, shapes, cost, target_bytes) -> settings | None`` for a
      method that needs its own search (``cost(settings)`` is the cost model's bytes); None:
      the method's bytes are fixed.
  """
  name: str
  summary: str
  settings: type
  cost: Callable[..., topology_lib.Cost]
  compressor: Callable[[Any], protocol.Compressor] | None = None
  transformation: Callable[..., optax.GradientTransformationExtraArgs] | None = None
  error_feedback: bool = True
  fuse: bool | None = None
  momentum: Callable[[Any], tuple[float, float | None]] | None = None
  step_inputs: Callable[[Any], StepInputs | None] | None = None
  budget: str | Callable[..., Any] | None = None

  def __post_init__(self):
    if (self.compressor is None) == (self.transformation is None):
      raise ValueError(f"registry: method {self.name!r} needs exactly one of compressor= or "
                       "transformation=")
    if not dataclasses.is_dataclass(self.settings):
      raise TypeError(f"registry: method {self.name!r}: settings must be a dataclass, got "
                      f"{self.settings!r}")
    missing = [f.name for f in dataclasses.fields(self.settings)
               if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
      raise ValueError(f"registry: method {self.name!r}: settings fields {missing} have no "
                       "default; every setting needs one")
    fields = [f.name for f in dataclasses.fields(self.settings)]
    if isinstance(self.budget, str) and self.budget not in fields:
      raise ValueError(f"registry: method {self.name!r}: budget={self.budget!r} is not one of "
                       f"its settings {fields}")


@dataclasses.dataclass(frozen=True)
class NoSettings:
  """The settings of a method that has none of its own."""


# name -> the module whose ``METHODS`` declares it, in the order :func:`names` lists them: the
# baselines, the sparsifiers, the quantizers, low rank, TASC. Module names, not imports: a method
# module imports this registry, and TASC's package imports compressors, which must not import it
# back (experiments -> tasc -> compressors).
BUILTIN = (
    ("dense", "compressors._dense"), ("fp16", "compressors._dense"),
    ("bf16", "compressors._dense"), ("topk", "compressors._topk"),
    ("randomk", "compressors._randomk"), ("threshold", "compressors._threshold"),
    ("dgc", "compressors._dgc"), ("qsgd", "compressors._qsgd"),
    ("terngrad", "compressors._terngrad"), ("signsgd", "compressors._sign"),
    ("efsignsgd", "compressors._sign"), ("onebit", "compressors._sign"),
    ("powersgd", "compressors._powersgd"), ("tasc", "tasc._transform"),
)

_METHODS: dict[str, Method] = {}
_builtins_loaded = False


def _registered() -> dict[str, Method]:
  """The registered methods, the built-ins (:data:`BUILTIN`) imported on the first call."""
  global _builtins_loaded
  if not _builtins_loaded:
    declared = {}
    for module_name in dict.fromkeys(module for _, module in BUILTIN):
      module = importlib.import_module(module_name)
      methods = {m.name: m for m in module.METHODS}
      listed = [name for name, listed_in in BUILTIN if listed_in == module_name]
      if sorted(methods) != sorted(listed):
        raise RuntimeError(f"registry: {module_name}.METHODS declares {sorted(methods)}, but "
                           f"registry.BUILTIN lists {sorted(listed)} for it")
      declared.update(methods)
    _METHODS.update({name: declared[name] for name, _ in BUILTIN})
    _builtins_loaded = True
  return _METHODS


def register(method: Method, *, replace: bool = False) -> Method:
  """Adds ``method`` to the registry (``replace=True`` overwrites one of the same name, a built-in
  too)."""
  if not isinstance(method, Method):
    raise TypeError(f"registry.register: expected a registry.Method, got {method!r}")
  registered = _registered()
  if method.name in registered and not replace:
    raise ValueError(f"registry.register: a method named {method.name!r} is registered "
                     "already; pass replace=True to overwrite it")
  registered[method.name] = method
  return method


def unregister(name: str) -> None:
  """Removes the method ``name`` (a ValueError naming the known ones if there is none)."""
  get(name)
  del _METHODS[name]


def names() -> tuple[str, ...]:
  """The registered methods: the built-ins in the order of :data:`BUILTIN`, then the others in
  registration order."""
  return tuple(_registered())


def get(name: str) -> Method:
  """The method called ``name``; ValueError listing the registered ones otherwise."""
  registered = _registered()
  if name not in registered:
    raise ValueError(f"method {name!r} is not registered; registered methods: {list(registered)}")
  return registered[name]


def default_settings(name: str, **overrides) -> Any:
  """The settings of ``name`` with ``overrides`` replacing their defaults."""
  settings = get(name).settings
  known = {f.name for f in dataclasses.fields(settings)}
  unknown = sorted(set(overrides) - known)
  if unknown:
    raise ValueError(f"method {name!r} has no setting {unknown[0]!r}; its settings: "
                     f"{sorted(known)}")
  return settings(**overrides)


def transformation(name: str, settings: Any = None, *, axis_name,
                   common: Common = Common()) -> optax.GradientTransformationExtraArgs:
  """The per-worker transformation of method ``name``: compress, exchange, return the mean.

  Args:
    name: a registered method.
    settings: its settings (default: :func:`default_settings`).
    axis_name: the workers' mesh axis (see :func:`compressors.compress`).
    common: the settings every method shares.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` to chain before the optimizer; wrapped in
    :func:`compressors.momentum_correction` when the method or ``common`` asks for it.

  Raises:
    ValueError: settings the method refuses, or common settings that do not fit it.
  """
  # Imported here, not at the top: the method modules import this registry, and they never
  # import the wrapper that runs them.
  from compressors import _compress  # pylint: disable=import-outside-toplevel
  from compressors import _momentum  # pylint: disable=import-outside-toplevel
  method = get(name)
  settings = method.settings() if settings is None else settings
  if not isinstance(settings, method.settings):
    raise TypeError(f"method {name!r}: settings must be a {method.settings.__name__}, got "
                    f"{settings!r}")
  error_feedback = method.error_feedback if common.error_feedback is None else common.error_feedback
  momentum, clip_norm = _momentum_of(method, settings, common, error_feedback)
  corrected = momentum > 0 or clip_norm is not None
  options = dict(axis_name=axis_name, error_feedback=error_feedback, seed=common.seed,
                 fuse=common.fuse if method.fuse is None else method.fuse, report_sent=corrected)
  if method.compressor is not None:
    tx = _compress.compress(method.compressor(settings), **options)
  else:
    tx = method.transformation(settings, **options)
  if corrected:
    tx = _momentum.momentum_correction(tx, momentum, clip_norm=clip_norm, axis_name=axis_name)
  return tx


def _momentum_of(method: Method, settings: Any, common: Common,
                 error_feedback: bool) -> tuple[float, float | None]:
  """``(momentum, clip_norm)`` of the momentum correction around the method (0: none)."""
  if method.momentum is not None:
    if common.momentum_correction:
      raise ValueError(f"momentum_correction={common.momentum_correction!r} with method "
                       f"{method.name!r}, which corrects momentum itself (its settings' "
                       "momentum); allowed: 0")
    momentum, clip_norm = method.momentum(settings)
  else:
    momentum, clip_norm = common.momentum_correction, common.clip_norm
    if clip_norm is not None and not momentum:
      raise ValueError(f"clip_norm={clip_norm!r} is momentum correction's local clipping, but "
                       "momentum_correction=0; set momentum_correction > 0, or clip_norm=None")
  if (momentum or clip_norm is not None) and not error_feedback:
    raise ValueError(f"momentum_correction={momentum!r} with method {method.name!r} needs error "
                     "feedback (it masks the velocity where the residual was sent); set "
                     "error_feedback=True or momentum_correction=0")
  return momentum, clip_norm


def step_inputs(name: str, settings: Any = None) -> StepInputs | None:
  """The per-step inputs of method ``name`` with ``settings``, or None if it takes none."""
  method = get(name)
  if method.step_inputs is None:
    return None
  inputs = method.step_inputs(method.settings() if settings is None else settings)
  return inputs if inputs is not None and inputs.every > 0 else None


def cost(name: str, shapes: Shapes, topology: topology_lib.Topology, settings: Any = None, *,
         schedule: str = "psum") -> topology_lib.Cost:
  """The cost model's price of one exchange by method ``name`` (see :attr:`Method.cost`)."""
  method = get(name)
  return method.cost(method.settings() if settings is None else settings,
                     [tuple(s) for s in shapes], topology, schedule)


def num_elements(shapes: Shapes) -> int:
  """Elements of gradients whose leaves have ``shapes`` (one fused buffer of that size)."""
  return sum(math.prod(s) for s in shapes)
