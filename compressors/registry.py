"""The method registry: the table of every gradient-exchange method, and what it assembles.

:mod:`compressors.method_table` is the table (:class:`Method`, the settings every method shares,
:func:`register`, :func:`get`, :func:`names`), which every method module imports; this module
imports the built-in method modules, adds their ``METHODS`` to the table, and assembles a
method's transformation from its record: :func:`transformation` (a per-step method with its
momentum correction and density warm-up), :func:`training` (the whole per-worker chain with the
run's optimizer), :func:`step_kinds`, :func:`step_inputs` and :func:`cost`. What a family needs
of the assembly is a hook on its :class:`Method` (``carrier``, ``sends_every``, ``kinds``,
``cost``; its state's :class:`compressors.method_protocol.SynchronisingState`): adding a family
is writing its module.

Everything else reads the registry: ``experiments`` builds configs, validation, benchmark method
lists, sweeps and the paper's tables from :func:`names`; tests run every registered method through
the same checks. TASC's package registers its method when imported (``import tasc``; compressors
never imports tasc: experiments -> tasc -> compressors). The table's names are re-exported here.
"""

import dataclasses
from typing import Any

import optax

from compressors import _chunked_topk
from compressors import aggregation as aggregation_lib
from compressors import wrapper
from compressors import _dense
from compressors import _demo
from compressors import _dgc
from compressors import _intq
from compressors import _local
from compressors import _momentum
from compressors import _onebit_adam
from compressors import _powersgd
from compressors import _qsgd
from compressors import _randomk
from compressors import _sign
from compressors import _streaming
from compressors import _terngrad
from compressors import _threshold
from compressors import _topk
from compressors import _warmup
from compressors import method_protocol
from compressors.method_protocol import StepInputs
from compressors.method_table import BUILTIN
from compressors.method_table import EXCHANGE_INPUTS
from compressors.method_table import FAMILIES
from compressors.method_table import Common
from compressors.method_table import Method
from compressors.method_table import PER_STEP_ONLY
from compressors.method_table import PLAIN_PER_STEP
from compressors.method_table import NoSettings
from compressors.method_table import Shapes
from compressors.method_table import default_settings
from compressors.method_table import get
from compressors.method_table import names
from compressors.method_table import num_elements
from compressors.method_table import register
from compressors.method_table import renamed_settings
from compressors.method_table import unregister
from compressors.network import topology as topology_lib

__all__ = (
    "BUILTIN", "Common", "EXCHANGE_INPUTS", "FAMILIES", "Method", "NoSettings", "PER_STEP_ONLY",
    "PLAIN_PER_STEP", "Shapes", "StepInputs", "cost", "default_settings", "density_field", "get",
    "local_exchange", "names", "num_elements", "register", "renamed_settings", "step_inputs",
    "step_kinds", "steps_per_exchange", "training", "transformation", "unregister",
    "with_steps_per_exchange",
)

# The built-in method modules compressors implements, in the order of their methods in BUILTIN.
_BUILTIN_MODULES = (_dense, _intq, _topk, _chunked_topk, _randomk, _threshold, _dgc, _qsgd,
                    _terngrad, _sign, _powersgd, _demo, _onebit_adam, _local, _streaming)
for _module in _BUILTIN_MODULES:
  for _method in _module.METHODS:
    register(_method)


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
  method = get(name)
  if not method.per_step:
    raise ValueError(f"method {name!r} is a {method.family} method, not a per-step exchange: "
                     "registry.training builds its whole transformation")
  settings = method.settings() if settings is None else settings
  if not isinstance(settings, method.settings):
    raise TypeError(f"method {name!r}: settings must be a {method.settings.__name__}, got "
                    f"{settings!r}")
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
      tx = wrapper.compress(method.compressor(own), **options)
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
             exchange_settings: Any = None,
             aggregation: Any = None) -> optax.GradientTransformationExtraArgs:
  """The whole per-worker training transformation of method ``name`` with the run's
  ``optimizer``: what ``compressors.data_parallel`` runs.

  * A per-step method (a compressor or transformation): ``chain(method, optimizer)`` with
    ``common.exchanged="gradient"`` (the mean gradient into one optimizer), ``chain(optimizer,
    method)`` with ``"update"`` (each worker's own optimizer, its update averaged).
  * A method that is its own optimizer (DeMo, 1-bit Adam): that, with ``learning_rate``;
    ``optimizer`` is not used.
  * A local-update method (DiLoCo): ``optimizer`` is each worker's inner optimizer and its
    carrier (the per-step method its settings' ``carrier`` names), with ``exchange_settings``,
    averages the pseudo-gradient.

  Args:
    name: a registered method.
    settings: its settings (default: its defaults).
    optimizer: the run's optimizer.
    learning_rate: the run's learning rate (for a method that is its own optimizer).
    axis_name: the workers' mesh axis.
    common: the settings every method shares.
    exchange_settings: the settings of a local-update method's carrier (default: its defaults).
    aggregation: a local-update method's aggregator and simulated workers
      (``compressors.aggregation.Aggregation``), or a per-step method's (one of
      ``aggregation.PER_STEP_RULES``, every step a synchronisation: ``aggregation.per_step``),
      or None: every synchronisation the plain mean.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` to run per worker.

  Raises:
    ValueError: settings the method refuses, or common settings that do not fit it.
  """
  method = get(name)
  settings = method.settings() if settings is None else settings
  if method.per_step:
    per_step = transformation(name, settings, axis_name=axis_name, common=common)
    if aggregation is not None:
      per_step = aggregation_lib.per_step(per_step, aggregation, axis_name)
    if common.exchanged == "update":
      return optax.chain(optimizer, per_step)
    return optax.chain(per_step, optimizer)
  _refuse_per_step_settings(method, common)
  if method.optimizer is not None:
    return method.optimizer(settings, learning_rate, axis_name=axis_name, seed=common.seed)
  if aggregation is not None and not method.aggregates:
    raise ValueError(f"method {name!r} takes no aggregator but the plain mean (aggregation="
                     f"{aggregation.rule!r} and simulated workers); allowed: "
                     f"{[n for n in names('local') if get(n).aggregates]}")
  aggregated = {} if aggregation is None else {"aggregation": aggregation}
  return method.local(settings, optimizer, local_exchange(settings, exchange_settings,
                                                          axis_name=axis_name, common=common,
                                                          carrier=method.carrier(settings)),
                      axis_name=axis_name, **aggregated)


def _refuse_per_step_settings(method: Method, common: Common) -> None:
  """Common settings that only per-step methods take (a method that is its own optimizer
  also has its own error feedback and buffers: it would ignore them)."""
  what = ("is its own optimizer" if method.optimizer is not None else
          "updates locally and exchanges pseudo-gradients")
  refused = list(PER_STEP_ONLY.items())
  if method.optimizer is not None:
    refused += [("error_feedback", None), ("fuse", True)]
  for field, default in refused:
    value = getattr(common, field)
    if value != default:
      where = ("its exchange's settings carry it" if method.carrier is not None
               and field == "error_decay" else "it applies to per-step exchanges")
      raise ValueError(f"{field}={value!r} with method {method.name!r}, which {what}: {where}; "
                       f"allowed: {default!r}")


def local_exchange(settings: Any, exchange_settings: Any = None, *, axis_name, carrier: str,
                   common: Common = Common()) -> optax.GradientTransformationExtraArgs:
  """The exchange of a local-update method's pseudo-gradient: the per-worker transformation of
  its carrier (``carrier``, a per-step method: :attr:`Method.carrier` of its settings) with
  ``exchange_settings`` and the local-update method's ``settings.error_decay``.

  Raises:
    ValueError: the carrier is not a per-step method.
  """
  carried = get(carrier)
  if not carried.per_step:
    raise ValueError(f"carrier={carrier!r} is a {carried.family} method; the "
                     "pseudo-gradient goes through a per-step exchange: one of "
                     f"{list(names('per_step'))}")
  return transformation(carrier, exchange_settings, axis_name=axis_name,
                        common=dataclasses.replace(common, error_decay=settings.error_decay))


def step_kinds(name: str, settings: Any = None, *, common: Common = Common(),
               exchange_settings: Any = None) -> tuple[Any, ...]:
  """The step kinds (``compressors.StepKind``) of method ``name`` with ``settings``: its own
  (:attr:`Method.kinds`; a method with a carrier's given the carrier's per-step inputs, with
  ``exchange_settings``), else its per-step inputs' (``"step"`` and ``"with_inputs"``); a
  per-step method's, each kind once per stage of a density warm-up."""
  method = get(name)
  settings = method.settings() if settings is None else settings
  if method.carrier is not None:
    kinds = tuple(method.kinds(settings, step_inputs(method.carrier(settings),
                                                     exchange_settings)))
  elif method.kinds is not None:
    kinds = tuple(method.kinds(settings))
  else:
    kinds = method_protocol.step_kinds(step_inputs(name, settings))
  densities, _ = _warmup_densities(method, settings, common) if method.per_step else ((), None)
  if densities:
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
  method with a carrier (local updates), one synchronisation: its carrier's with
  ``exchange_settings``."""
  method = get(name)
  settings = method.settings() if settings is None else settings
  if method.carrier is not None:
    return cost(method.carrier(settings), shapes, topology, exchange_settings,
                schedule=schedule)
  return method.cost(settings, [tuple(s) for s in shapes], topology, schedule)


def steps_per_exchange(name: str, settings: Any = None) -> int:
  """Steps between two exchanges of method ``name`` (:attr:`Method.sends_every`; 1: every
  step)."""
  method = get(name)
  if method.sends_every is None:
    return 1
  return method.sends_every(method.settings() if settings is None else settings)


def with_steps_per_exchange(name: str, settings: Any, steps: int) -> Any:
  """``settings`` of method ``name`` with ``steps`` between two exchanges
  (:attr:`Method.with_sends_every`).

  Raises:
    ValueError: a method that exchanges every step, or ``steps`` the method refuses.
  """
  method = get(name)
  if method.with_sends_every is None:
    raise ValueError(f"method {name!r} exchanges every step; it has no steps between "
                     "exchanges to set")
  return method.with_sends_every(settings, steps)
