"""The method table: every gradient-exchange method, declared once next to its implementation.

A *method* is what a run names in ``config.method``: a compressor and the transformation that
runs it, with everything a runner, a benchmark, a sweep or the cost model needs to know of it,
declared in one :class:`Method` in the ``METHODS`` tuple at the bottom of the module that
implements it:

* its own typed settings (a frozen dataclass whose fields all have defaults): the runner's
  ``config.compression.<name>`` block;
* its error-feedback default (its paper's);
* its cost-model entry: how :mod:`compressors.network.topology` prices one exchange (time and
  bytes);
* what sets its bytes (its *budget*: ``density``, ``rank``, ...), so that
  :mod:`compressors.equal_bytes` can set methods to equal bytes per step;
* optionally, per-step inputs its ``update`` takes (TASC's curvature), its own step kinds, or the
  per-step method that carries its synchronisation (local updates): the hooks
  :mod:`compressors.registry` assembles it with.

This module is the table alone: it imports no method implementation, so every method module
imports it. :mod:`compressors.registry` imports the built-in method modules and adds their
``METHODS`` here (TASC's package adds its own when imported: ``import tasc``), and assembles
transformations from the table. :data:`BUILTIN` fixes the order :func:`names` lists the
built-ins in; a method outside the project registers with :func:`register`.
"""

import dataclasses
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import optax

from compressors import checks
from compressors import protocol
from compressors.method_protocol import StepInputs
from compressors.network import topology as topology_lib

Shapes = Sequence[tuple[int, ...]]

# What a per-step method exchanges (Common.exchanged).
EXCHANGE_INPUTS = ("gradient", "update")


# The common settings that shape a per-step method beyond its compressor, at their values that
# leave it plain: the dense baseline a run's bytes are compared with takes these, and a method
# that is not a per-step one refuses any other (with ``exchanged="gradient"``, PER_STEP_ONLY).
PLAIN_PER_STEP = {"momentum_correction": 0.0, "clip_norm": None, "error_decay": 1.0,
                  "density_warmup_steps": 0}
PER_STEP_ONLY = {"exchanged": "gradient", **PLAIN_PER_STEP}


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
  exchanged: str = checks.setting("gradient", checks.Rule(str, choices=EXCHANGE_INPUTS))
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
      None for a method with a ``carrier``, whose synchronisation is priced by the carrier's.
    compressor: ``settings -> Compressor``, run through :func:`compressors.compress`; or
    transformation: ``(settings, *, axis_name, error_feedback, fuse, seed, report_sent) ->``
      an optax transformation, for methods that are more than ``compress(compressor)`` (TASC).
      These two are *per-step* methods: chained with the run's optimizer
      (:func:`compressors.registry.training`).
    optimizer: ``(settings, learning_rate, *, axis_name, seed) ->`` the whole per-worker
      training transformation, for a method that is its own optimizer (DeMo, 1-bit Adam): it
      takes each worker's gradient, runs its own collectives, and returns the update to apply,
      the same on every worker.
    local: ``(settings, inner, exchange, *, axis_name) ->`` the whole per-worker training
      transformation of a local-update method (DiLoCo): ``inner`` is the run's optimizer, run
      by each worker on its own gradient; ``exchange`` the per-worker transformation of its
      ``carrier``, which exchanges the pseudo-gradient. Its parameters differ between workers
      between synchronisations (:attr:`per_worker_params`); its state says how its updates land
      on them and which are the model (:class:`compressors.method_protocol.SynchronisingState`).
    carrier: ``settings -> name`` of the registered per-step method that carries the
      synchronisation of a ``local`` method (DiLoCo's ``carrier`` setting); None otherwise.
    sends_every: ``settings -> int``, steps per synchronisation of a ``local`` method (its
      ``H``: its bytes per step are its carrier's over this; of one that synchronises a
      fragment at a time, as Streaming DiLoCo, the steps in which every fragment sends once);
      None: every step.
    with_sends_every: ``(settings, every) -> settings`` with ``H`` set to ``every`` (how
      :func:`compressors.equal_bytes.solve` meets a tier through ``H``; a ValueError where the
      method refuses it); given with ``sends_every``.
    parts: ``(settings, shapes) -> a list of shapes per part``: the parts a ``local`` method
      deals the model into, each a list of its pieces' shapes, indexed by its step kinds'
      ``sends``/``lands`` (Streaming DiLoCo's fragments); None: the whole model only
      (:data:`compressors.method_protocol.WHOLE_MODEL`).
    lands_after: ``settings -> int``, inner steps between a part's send and its landing, which
      its exchange runs beside (Streaming DiLoCo's ``overlap``, ``tau``;
      :mod:`compressors.step_time` prices it); None: it lands in the step that sends it.
    error_feedback: the method's default for ``Common.error_feedback``.
    fuse: the buffer layout the method needs (PowerSGD: per leaf, False); None: the common one.
    momentum: ``settings -> (momentum, clip_norm)`` for a method that is a sparsifier inside
      :func:`compressors.momentum_correction` (DGC); None: the common ``momentum_correction``.
    step_inputs: ``settings -> StepInputs | None``, the per-step inputs of its ``update``.
    kinds: ``settings -> tuple[compressors.StepKind, ...]``: the step kinds of a method whose
      steps differ by more than inputs (1-bit Adam's dense warm-up, then compressed steps); with
      a ``carrier``, ``(settings, carrier_inputs) -> kinds``, given the carrier's per-step
      inputs (a ``StepInputs`` or None); None: those of ``step_inputs``
      (:func:`compressors.method_protocol.step_kinds`).
    budget: what sets the bytes of one exchange, for :func:`compressors.equal_bytes.solve`: the
      name of a settings field that the bytes grow with (a float is a fraction in (0, 1], an
      int a count >= 1), or ``(settings, shapes, cost, target_bytes) -> settings | None`` for a
      method that needs its own search (``cost(settings)`` is the cost model's bytes); None:
      the method's bytes are fixed.
    renamed: the method's settings' old names, ``((old, new), ...)``: a config written before
      a rename (a kept run's ``config.json``) still loads, with a notice
      (:func:`renamed_settings`).
    overlaps_backward: the exchange is a plain all-reduce of the gradient that can start per
      bucket while the backward pass runs (dense, fp16, bf16), as tuned data parallelism does;
      :mod:`compressors.step_time` prices it so. False: it needs the whole gradient first.
    aggregates: a ``local`` method whose builder also takes ``aggregation=`` (a
      ``compressors.aggregation.Aggregation``: simulated workers that are slow, late or gone,
      and a synchronisation that merges whom its aggregator takes); a tuple: the same, for
      those of ``compressors.aggregation.RULES`` alone; False: the plain mean only.
  """
  name: str
  summary: str
  settings: type
  cost: Callable[..., topology_lib.Cost] | None = None
  compressor: Callable[[Any], protocol.Compressor] | None = None
  transformation: Callable[..., optax.GradientTransformationExtraArgs] | None = None
  optimizer: Callable[..., optax.GradientTransformationExtraArgs] | None = None
  local: Callable[..., optax.GradientTransformationExtraArgs] | None = None
  carrier: Callable[[Any], str] | None = None
  sends_every: Callable[[Any], int] | None = None
  with_sends_every: Callable[[Any, int], Any] | None = None
  parts: Callable[[Any, Shapes], Sequence[Shapes]] | None = None
  lands_after: Callable[[Any], int] | None = None
  error_feedback: bool = True
  fuse: bool | None = None
  momentum: Callable[[Any], tuple[float, float | None]] | None = None
  step_inputs: Callable[[Any], StepInputs | None] | None = None
  kinds: Callable[[Any], tuple[Any, ...]] | None = None
  budget: str | Callable[..., Any] | None = None
  renamed: tuple[tuple[str, str], ...] = ()
  overlaps_backward: bool = False
  aggregates: bool | tuple[str, ...] = False

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
    if (self.local is not None) != (self.carrier is not None):
      raise ValueError(f"registry: method {self.name!r}: a local-update method (local=) needs "
                       "carrier=, the per-step method that carries its pseudo-gradient, and "
                       "only it takes one")
    if (self.sends_every is None) != (self.with_sends_every is None):
      raise ValueError(f"registry: method {self.name!r}: sends_every= and with_sends_every= "
                       "come together (the solver reads and sets H through them)")
    if (self.cost is None) != (self.carrier is not None):
      raise ValueError(f"registry: method {self.name!r}: cost= is required, except for a "
                       "method with a carrier= (priced by its carrier)")
    if isinstance(self.budget, str) and self.budget not in fields:
      raise ValueError(f"registry: method {self.name!r}: budget={self.budget!r} is not one of "
                       f"its settings {fields}")

  @property
  def family(self) -> str:
    """``"per_step"`` (a compressor or transformation chained with the run's optimizer),
    ``"optimizer"`` (its own optimizer) or ``"local"`` (local updates)."""
    if self.optimizer is not None:
      return "optimizer"
    return "local" if self.local is not None else "per_step"

  @property
  def per_step(self) -> bool:
    """A compressor or transformation chained with the run's optimizer (its ``update`` runs
    every step on each worker's gradient or update)."""
    return self.compressor is not None or self.transformation is not None

  @property
  def per_worker_params(self) -> bool:
    """The parameters differ between workers between synchronisations (local updates:
    ``compressors.data_parallel(..., per_worker_params=True)``)."""
    return self.local is not None


@dataclasses.dataclass(frozen=True)
class NoSettings:
  """The settings of a method that has none of its own."""


# The built-in methods in the order :func:`names` lists them: the baselines, the sparsifiers,
# the quantizers, low rank, the methods that are their own optimizer, TASC, local updates. Each is
# added by the module that imports its implementation (compressors.registry; TASC's package).
BUILTIN = ("dense", "fp16", "bf16", "int8", "int4", "topk", "chunk_topk", "randomk", "threshold",
           "dgc", "qsgd", "terngrad", "signsgd", "efsignsgd", "onebit", "powersgd", "demo",
           "onebit_adam", "tasc", "diloco", "sparseloco", "streaming_diloco")
FAMILIES = ("per_step", "optimizer", "local")

_METHODS: dict[str, Method] = {}


def register(method: Method, *, replace: bool = False) -> Method:
  """Adds ``method`` to the table (``replace=True`` overwrites one of the same name, a built-in
  too).

  Raises:
    TypeError: ``method`` is not a :class:`Method`.
    ValueError: a method of that name is registered already and ``replace`` is False.
  """
  if not isinstance(method, Method):
    raise TypeError(f"registry.register: expected a registry.Method, got {method!r}")
  if method.name in _METHODS and not replace:
    raise ValueError(f"registry.register: a method named {method.name!r} is registered "
                     "already; pass replace=True to overwrite it")
  _METHODS[method.name] = method
  return method


def unregister(name: str) -> None:
  """Removes the method ``name`` (a ValueError naming the known ones if there is none)."""
  get(name)
  del _METHODS[name]


def names(family: str | None = None) -> tuple[str, ...]:
  """The registered methods (of ``family``, one of :data:`FAMILIES`; None: all): the built-ins
  in the order of :data:`BUILTIN`, then the others in registration order.

  Raises:
    ValueError: an unknown family.
  """
  if family == "exchange":  # the family's name before "exchange" kept one meaning
    warnings.warn('registry.names(family="exchange") is now names(family="per_step")',
                  DeprecationWarning, stacklevel=2)
    family = "per_step"
  if family is not None and family not in FAMILIES:
    raise ValueError(f"registry.names: family={family!r}; allowed: {FAMILIES} or None")
  order = {name: i for i, name in enumerate(BUILTIN)}
  listed = sorted(_METHODS, key=lambda name: order.get(name, len(order)))  # a stable sort
  # The one comparison of families: the caller asks for one by name.
  return tuple(n for n in listed if family is None or _METHODS[n].family == family)


def get(name: str) -> Method:
  """The method called ``name``.

  Raises:
    ValueError: no method of that name is registered (listing the registered ones).
  """
  if name not in _METHODS:
    hint = (" (TASC registers when its package is imported: import tasc)"
            if name == "tasc" else "")
    raise ValueError(f"method {name!r} is not registered{hint}; registered methods: "
                     f"{list(names())}")
  return _METHODS[name]


def default_settings(name: str, **overrides) -> Any:
  """The settings of ``name`` with ``overrides`` replacing their defaults."""
  settings = get(name).settings
  known = {f.name for f in dataclasses.fields(settings)}
  unknown = sorted(set(overrides) - known)
  if unknown:
    raise ValueError(f"method {name!r} has no setting {unknown[0]!r}; its settings: "
                     f"{sorted(known)}")
  return settings(**overrides)


def renamed_settings(name: str, block: Mapping[str, Any], where: str) -> dict[str, Any]:
  """``block`` (method ``name``'s settings as a config holds them) with the old names of its
  fields (:attr:`Method.renamed`) replaced by the new ones, each with a one-line notice naming
  ``where`` (the block's place in the config); a field given under both names keeps the new
  one's value."""
  block = dict(block)
  for old, new in get(name).renamed:
    if old in block:
      value = block.pop(old)
      warnings.warn(f"{where}.{old} is now {where}.{new} (read as {new}={value!r})",
                    FutureWarning, stacklevel=2)
      block.setdefault(new, value)
  return block


def num_elements(shapes: Shapes) -> int:
  """Elements of gradients whose leaves have ``shapes`` (one fused buffer of that size)."""
  return sum(math.prod(s) for s in shapes)
