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

from compressors import checks
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


# What a per-step method exchanges (Common.exchanged).
EXCHANGED = ("gradient", "update")


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
    exchanged: what a per-step method (compressor or transformation) exchanges: ``"gradient"``,
      each worker's gradient, compressed before the optimizer (``chain(exchange, optimizer)``,
      one optimizer state for all), or ``"update"``, each worker's optimizer update, compressed
      after its own optimizer (``chain(optimizer, exchange)``, the optimizer's moments per
      worker). Methods that are their own optimizer or update locally refuse ``"update"``.
    error_decay: the error-feedback residual is multiplied by this before it is added to the
      next input (``a = g + error_decay * e``): 1 is error feedback as its papers have it;
      SparseLoCo decays it (0.95) in place of outer momentum.
    density_warmup_steps: DGC's density warm-up (Lin et al. 2018), for every method whose
      bytes are set by a density: over this many first steps the density falls exponentially
      from ``density_warmup_start`` to the method's own, in ``density_warmup_stages`` equal
      stages (each a step kind of its own, charged its own bytes); 0: off.
    density_warmup_start: the density of the warm-up's first stage (DGC: 0.25).
    density_warmup_stages: stages of the warm-up (DGC: 4, each a quarter of the last).

  Each field declares what it allows (:func:`compressors.checks.setting`), checked when the
  settings are made and, from the same declaration, in a run's ``config.compression``.
  """
  error_feedback: bool | None = checks.setting(None, checks.Rule(bool, optional=True))
  fuse: bool = checks.setting(True, checks.Rule(bool))
  seed: int = checks.setting(0, checks.SEED)
  momentum_correction: float = checks.setting(0.0, checks.Rule(float, low=0, high=1,
                                                               high_open=True))
  clip_norm: float | None = checks.setting(None, checks.Rule(float, low=0, low_open=True,
                                                             optional=True))
  exchanged: str = checks.setting("gradient", checks.Rule(str, choices=EXCHANGED))
  error_decay: float = checks.setting(1.0, checks.Rule(float, low=0, high=1))
  density_warmup_steps: int = checks.setting(0, checks.Rule(int, low=0))
  density_warmup_start: float = checks.setting(0.25, checks.Rule(float, low=0, low_open=True,
                                                                 high=1))
  density_warmup_stages: int = checks.setting(4, checks.Rule(int, low=0))

  def __post_init__(self):
    checks.check_settings(self, "Common")


@dataclasses.dataclass(frozen=True)
class Method:
  """One gradient-exchange method (see the module docstring).

  Attributes:
    name: the name runs use (``config.method``).
    summary: one line: the method and its paper.
    settings: a frozen dataclass of the method's own settings, every field with a default (and,
      declared with :func:`compressors.checks.setting`, what it allows: checked when the
      settings are made and in a run's ``config.compression.<name>`` block).
    cost: ``(settings, shapes, topology, schedule) -> compressors.network.topology.Cost`` of one
      exchange of gradients whose leaves have ``shapes``, summable payloads all-reduced by
      ``schedule`` (a name of :data:`compressors.network.collectives.SCHEDULES`, or ``"auto"``);
      None for a local-update method, whose synchronisation is priced by its exchange's entry.
    compressor: ``settings -> Compressor``, run through :func:`compressors.compress`; or
    transformation: ``(settings, *, axis_name, error_feedback, fuse, seed, report_sent) ->``
      an optax transformation, for methods that are more than ``compress(compressor)`` (TASC).
      These two are *exchanges*: chained with the run's optimizer (:func:`training`).
    optimizer: ``(settings, learning_rate, *, axis_name, seed) ->`` the whole per-worker
      training transformation, for a method that is its own optimizer (DeMo, 1-bit Adam): it
      takes each worker's gradient, runs its own collectives, and returns the update to apply,
      the same on every worker.
    local: ``(settings, inner, exchange, *, axis_name) ->`` the whole per-worker training
      transformation of a local-update method (DiLoCo): ``inner`` is the run's optimizer, run
      by each worker on its own gradient; ``exchange`` the per-worker transformation of the
      method its settings' ``exchange`` field names, which carries the pseudo-gradient. Its
      parameters differ between workers between synchronisations
      (``data_parallel(..., per_worker_params=True)``).
    error_feedback: the method's default for ``Common.error_feedback``.
    fuse: the buffer layout the method needs (PowerSGD: per leaf, False); None: the common one.
    momentum: ``settings -> (momentum, clip_norm)`` for a method that is a sparsifier inside
      :func:`compressors.momentum_correction` (DGC); None: the common ``momentum_correction``.
    step_inputs: ``settings -> StepInputs | None``, the per-step inputs of its ``update``.
    kinds: ``settings -> tuple[compressors.StepKind, ...]``: the step kinds of a method whose
      steps differ by more than inputs (1-bit Adam's dense warm-up, then compressed steps); None:
      those of ``step_inputs`` (:func:`step_kinds`).
    budget: what sets the bytes of one exchange, for :func:`compressors.equal_bytes.solve`: the
      name of a settings field that the bytes grow with (a float is a fraction in (0, 1], an
      int a count >= 1), or ``(settings, shapes, cost, target_bytes) -> settings | None`` for a
      method that needs its own search (``cost(settings)`` is the cost model's bytes); None:
      the method's bytes are fixed.
  """
  name: str
  summary: str
  settings: type
  cost: Callable[..., topology_lib.Cost] | None = None
  compressor: Callable[[Any], protocol.Compressor] | None = None
  transformation: Callable[..., optax.GradientTransformationExtraArgs] | None = None
  optimizer: Callable[..., optax.GradientTransformationExtraArgs] | None = None
  local: Callable[..., optax.GradientTransformationExtraArgs] | None = None
  error_feedback: bool = True
  fuse: bool | None = None
  momentum: Callable[[Any], tuple[float, float | None]] | None = None
  step_inputs: Callable[[Any], StepInputs | None] | None = None
  kinds: Callable[[Any], tuple[Any, ...]] | None = None
  budget: str | Callable[..., Any] | None = None

  def __post_init__(self):
    builders = [self.compressor, self.transformation, self.optimizer, self.local]
    if sum(b is not None for b in builders) != 1:
      raise ValueError(f"registry: method {self.name!r} needs exactly one of compressor=, "
                       "transformation=, optimizer= or local=")
    if not dataclasses.is_dataclass(self.settings):
      raise TypeError(f"registry: method {self.name!r}: settings must be a dataclass, got "
                      f"{self.settings!r}")
    missing = [f.name for f in dataclasses.fields(self.settings)
               if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
      raise ValueError(f"registry: method {self.name!r}: settings fields {missing} have no "
                       "default; every setting needs one")
    fields = [f.name for f in dataclasses.fields(self.settings)]
    if (self.cost is None) != (self.local is not None):
      raise ValueError(f"registry: method {self.name!r}: cost= is required, except for a "
                       "local-update method (priced by its exchange)")
    if self.local is not None and "exchange" not in fields:
      raise ValueError(f"registry: local-update method {self.name!r} needs a settings field "
                       "'exchange' naming the method that carries its pseudo-gradient")
    if isinstance(self.budget, str) and self.budget not in fields:
      raise ValueError(f"registry: method {self.name!r}: budget={self.budget!r} is not one of "
                       f"its settings {fields}")


  @property
  def family(self) -> str:
    """``"exchange"`` (a compressor or transformation chained with the run's optimizer),
    ``"optimizer"`` (its own optimizer) or ``"local"`` (local updates)."""
    if self.optimizer is not None:
      return "optimizer"
    return "local" if self.local is not None else "exchange"


@dataclasses.dataclass(frozen=True)
class NoSettings:
  """The settings of a method that has none of its own."""


# name -> the module whose ``METHODS`` declares it, in the order :func:`names` lists them: the
# baselines, the sparsifiers, the quantizers, low rank, TASC. Module names, not imports: a method
# module imports this registry, and TASC's package imports compressors, which must not import it
# back (experiments -> tasc -> compressors).
BUILTIN = (
    ("dense", "compressors._dense"), ("fp16", "compressors._dense"),
    ("bf16", "compressors._dense"), ("int8", "compressors._intq"), ("int4", "compressors._intq"),
    ("topk", "compressors._topk"),
    ("randomk", "compressors._randomk"), ("threshold", "compressors._threshold"),
    ("dgc", "compressors._dgc"), ("qsgd", "compressors._qsgd"),
    ("terngrad", "compressors._terngrad"), ("signsgd", "compressors._sign"),
    ("efsignsgd", "compressors._sign"), ("onebit", "compressors._sign"),
    ("powersgd", "compressors._powersgd"),
    ("demo", "compressors._demo"),
    ("onebit_adam", "compressors._onebit_adam"),
    ("tasc", "tasc._transform"),
    ("diloco", "compressors._local"), ("sparseloco", "compressors._local"),
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


def names(family: str | None = None) -> tuple[str, ...]:
  """The registered methods (of ``family``: ``"exchange"``, ``"optimizer"`` or ``"local"``;
  None: all): the built-ins in the order of :data:`BUILTIN`, then the others in registration
  order."""
  return tuple(n for n, m in _registered().items() if family is None or m.family == family)


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
  if method.family != "exchange":
    raise ValueError(f"method {name!r} is a {method.family} method, not a per-step exchange: "
                     "registry.training builds its whole transformation")
  settings = method.settings() if settings is None else settings
  if not isinstance(settings, method.settings):
    raise TypeError(f"method {name!r}: settings must be a {method.settings.__name__}, got "
                    f"{settings!r}")
  from compressors import _warmup  # pylint: disable=import-outside-toplevel
  error_feedback = method.error_feedback if common.error_feedback is None else common.error_feedback
  momentum, clip_norm = _momentum_of(method, settings, common, error_feedback)
  corrected = momentum > 0 or clip_norm is not None
  options = dict(axis_name=axis_name, error_feedback=error_feedback, seed=common.seed,
                 fuse=common.fuse if method.fuse is None else method.fuse, report_sent=corrected,
                 error_decay=common.error_decay)
  densities, field = _warmup_densities(method, settings, common)

  def build(density=None):
    own = settings if density is None else dataclasses.replace(settings, **{field: density})
    if method.compressor is not None:
      tx = _compress.compress(method.compressor(own), **options)
    else:  # TASC: every stage in the blocks of the final density (one state for all)
      extra = {"block_density": getattr(settings, field)} if densities else {}
      tx = method.transformation(own, **options, **extra)
    if corrected:
      tx = _momentum.momentum_correction(tx, momentum, clip_norm=clip_norm, axis_name=axis_name)
    return tx
  if not densities:
    return build()
  return _warmup.density_warmup(build, getattr(settings, field), densities)


def density_field(method: Method) -> str | None:
  """The settings field that is a method's density (the fraction it sends), for the density
  warm-up: its budget when that is a fraction (``density``, ``max_density``), TASC's
  ``density``; None for a method whose bytes are not set by a density."""
  fields = {f.name: f.default for f in dataclasses.fields(method.settings)}
  if isinstance(method.budget, str) and isinstance(fields.get(method.budget), float):
    return method.budget
  return "density" if callable(method.budget) and isinstance(fields.get("density"),
                                                             float) else None


def _warmup_densities(method: Method, settings: Any, common: Common) -> tuple[tuple, str]:
  """``(the warm-up's stage densities, the density field)``; no stages without a warm-up.

  Raises:
    ValueError: a warm-up asked of a method with no density, or bad warm-up settings.
  """
  from compressors import _warmup  # pylint: disable=import-outside-toplevel
  if not common.density_warmup_steps:
    return (), None
  field = density_field(method)
  if field is None:
    raise ValueError(f"density_warmup_steps={common.density_warmup_steps!r} with method "
                     f"{method.name!r}, whose bytes are not set by a density; allowed: 0, or a "
                     f"sparsifier ({[n for n in names() if density_field(get(n))]})")
  final = getattr(settings, field)
  if not isinstance(final, float):
    raise ValueError(f"density_warmup_steps={common.density_warmup_steps!r} with "
                     f"{method.name}.{field}={final!r}: the warm-up needs one density; allowed: "
                     "a float")
  densities = _warmup.warmup_densities(final, common.density_warmup_start,
                                       common.density_warmup_stages)
  _warmup.warmup_boundaries(common.density_warmup_steps, len(densities))  # checks them
  return tuple(densities), field


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


def training(name: str, settings: Any = None, *, optimizer: optax.GradientTransformation,
             learning_rate: optax.ScalarOrSchedule, axis_name, common: Common = Common(),
             exchange_settings: Any = None) -> optax.GradientTransformationExtraArgs:
  """The whole per-worker training transformation of method ``name`` with the run's
  ``optimizer``: what ``compressors.data_parallel`` runs.

  * An exchange (a compressor or transformation): ``chain(exchange, optimizer)`` with
    ``common.exchanged="gradient"`` (the mean gradient into one optimizer), ``chain(optimizer,
    exchange)`` with ``"update"`` (each worker's own optimizer, its update exchanged).
  * A method that is its own optimizer (DeMo, 1-bit Adam): that, with ``learning_rate``;
    ``optimizer`` is not used.
  * A local-update method (DiLoCo): ``optimizer`` is each worker's inner optimizer and the
    method its settings' ``exchange`` names, with ``exchange_settings``, carries the
    pseudo-gradient.

  Raises:
    ValueError: settings the method refuses, or common settings that do not fit it.
  """
  method = get(name)
  settings = method.settings() if settings is None else settings
  if method.family != "exchange":
    _refuse_for_family(method, common)
  if method.family == "optimizer":
    return method.optimizer(settings, learning_rate, axis_name=axis_name, seed=common.seed)
  if method.family == "local":
    return method.local(settings, optimizer, local_exchange(settings, exchange_settings,
                                                            axis_name=axis_name, common=common),
                        axis_name=axis_name)
  exchange = transformation(name, settings, axis_name=axis_name, common=common)
  if common.exchanged == "update":
    return optax.chain(optimizer, exchange)
  return optax.chain(exchange, optimizer)


def _refuse_for_family(method: Method, common: Common) -> None:
  """Common settings that only per-step exchanges take (a method that is its own optimizer
  also has its own error feedback and buffers: it would ignore them)."""
  what = ("is its own optimizer" if method.family == "optimizer" else
          "updates locally and exchanges pseudo-gradients")
  refused = [("exchanged", "gradient"), ("momentum_correction", 0.0), ("clip_norm", None),
             ("error_decay", 1.0), ("density_warmup_steps", 0)]
  if method.family == "optimizer":
    refused += [("error_feedback", None), ("fuse", True)]
  for field, default in refused:
    value = getattr(common, field)
    if value != default:
      where = ("its exchange's settings carry it" if method.family == "local"
               and field == "error_decay" else "it applies to per-step exchanges")
      raise ValueError(f"{field}={value!r} with method {method.name!r}, which {what}: {where}; "
                       f"allowed: {default!r}")


def local_exchange(settings: Any, exchange_settings: Any = None, *, axis_name,
                   common: Common = Common()) -> optax.GradientTransformationExtraArgs:
  """The per-worker exchange a local-update method's ``settings`` name (``settings.exchange``,
  a per-step method), with its ``settings.error_decay``.

  Raises:
    ValueError: the exchange is not a per-step method.
  """
  exchange = get(settings.exchange)
  if exchange.family != "exchange":
    raise ValueError(f"exchange={settings.exchange!r} is a {exchange.family} method; the "
                     "pseudo-gradient goes through a per-step exchange: one of "
                     f"{list(names('exchange'))}")
  return transformation(settings.exchange, exchange_settings, axis_name=axis_name,
                        common=dataclasses.replace(common, error_decay=settings.error_decay))


def step_kinds(name: str, settings: Any = None, *, common: Common = Common(),
               exchange_settings: Any = None) -> tuple[Any, ...]:
  """The step kinds (``compressors.StepKind``) of method ``name`` with ``settings``: its own
  (:attr:`Method.kinds`), else its per-step inputs' (``"step"`` and ``"with_inputs"``); a
  local-update method's local and synchronising steps (the exchange's inputs made at the
  synchronisations); each kind once per stage of a density warm-up."""
  # pylint: disable-next=import-outside-toplevel
  from compressors.parallel import step_kinds as kinds_lib
  method = get(name)
  settings = method.settings() if settings is None else settings
  if method.family == "local":
    from compressors import _local  # pylint: disable=import-outside-toplevel
    return _local.local_update_kinds(settings.every,
                                     step_inputs(settings.exchange, exchange_settings))
  if method.kinds is not None:
    kinds = tuple(method.kinds(settings))
  else:
    kinds = kinds_lib.step_kinds(step_inputs(name, settings))
  densities, _ = ((), None) if method.family != "exchange" else _warmup_densities(
      method, settings, common)
  if densities:
    from compressors import _warmup  # pylint: disable=import-outside-toplevel
    kinds = _warmup.warmup_kinds(kinds, common.density_warmup_steps, len(densities))
  return kinds


def step_inputs(name: str, settings: Any = None) -> StepInputs | None:
  """The per-step inputs of method ``name`` with ``settings``, or None if it takes none."""
  method = get(name)
  if method.step_inputs is None:
    return None
  inputs = method.step_inputs(method.settings() if settings is None else settings)
  return inputs if inputs is not None and inputs.every > 0 else None


def cost(name: str, shapes: Shapes, topology: topology_lib.Topology, settings: Any = None, *,
         schedule: str = "psum", exchange_settings: Any = None) -> topology_lib.Cost:
  """The cost model's price of one exchange by method ``name`` (see :attr:`Method.cost`); of a
  local-update method, one synchronisation: its exchange's with ``exchange_settings``."""
  method = get(name)
  settings = method.settings() if settings is None else settings
  if method.family == "local":
    return cost(settings.exchange, shapes, topology, exchange_settings, schedule=schedule)
  return method.cost(settings, [tuple(s) for s in shapes], topology, schedule)


def num_elements(shapes: Shapes) -> int:
  """Elements of gradients whose leaves have ``shapes`` (one fused buffer of that size)."""
  return sum(math.prod(s) for s in shapes)
