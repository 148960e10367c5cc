"""Local updates: each worker optimises on its own for ``H`` steps, then the workers exchange
what they moved (the pseudo-gradient) through any compressor and take one outer step together.

DiLoCo (Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of Language
Models"): each worker runs an inner optimizer (AdamW) on its own gradient with no collective; every
``H`` steps the pseudo-gradient ``Delta = theta_sync - theta_worker`` is all-reduced (the mean over
workers), an outer optimizer (SGD with Nesterov momentum, lr 0.7, momentum 0.9) updates the
synchronised parameters with it as its gradient, and every worker restarts from them; the inner
optimizers' states stay each worker's own. Here the pseudo-gradient goes through an *exchange*:
any per-worker transformation that returns the mean over workers (``compressors.compress`` of any
compressor with error feedback, ``tasc.tasc_compress`` with its shared support), so the family
covers DiLoCo (dense float32), OpenDiLoCo (float16), INTELLECT-1 (int8), SparseLoCo (chunked
top-k with 2-bit values and an error buffer decayed in place of outer momentum:
``compress(chunk_topk, error_decay=0.95)`` and an outer SGD of lr 1) and TASC on the
pseudo-gradient.

Which step synchronises is static (the keyword ``synchronise`` of ``update``): a local step and a
synchronising step are two programs, the local one with no collective at all, so each one's bytes
are read from its own compiled program (``compressors.data_parallel`` with the kinds of
:func:`local_update_kinds`, and ``per_worker_params=True``: the parameters differ between workers
between synchronisations).

After a synchronising step every worker must hold the synchronised parameters bit for bit;
``params + (theta_sync - params)`` is not ``theta_sync`` in floating point, so apply the updates
with :func:`compressors.apply_local_updates` (``data_parallel`` does), which lands exactly on
them: :class:`LocalUpdatesState` says how (:class:`compressors.method_protocol.SynchronisingState`),
so that the harness knows no method.
"""

import dataclasses
import math
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import optax

from compressors import aggregation as aggregation_lib
from compressors import checks
from compressors import method_table
from compressors import worker_sim
from compressors.network import axes
from compressors.method_protocol import StepInputs
from compressors.method_protocol import StepKind
from compressors.method_protocol import WHOLE_MODEL


class LocalUpdatesState(NamedTuple):
  """State of :func:`local_updates` on one worker.

  Attributes:
    synchronised: ``bool[]``: the latest step synchronised (the parameters are then
      :attr:`anchor` on every worker); the same on every worker.
    anchor: the synchronised parameters of the latest synchronisation, the same on every worker
      (the model a run evaluates).
    inner: the inner optimizer's state, this worker's own.
    outer: the outer optimizer's state, the same on every worker.
    exchange: the exchange's state (error-feedback residuals: this worker's own).
  """
  synchronised: jax.Array
  anchor: chex.ArrayTree
  inner: Any
  outer: Any
  exchange: Any

  def land(self, params: chex.ArrayTree, applied: chex.ArrayTree) -> chex.ArrayTree:
    """``applied``, or after a synchronising step :attr:`anchor` itself, bit for bit
    (``params + (anchor - params)`` is not ``anchor`` in floating point)."""
    del params  # applied already holds them moved; a synchronisation replaces them
    return jax.tree.map(lambda a, p: jnp.where(self.synchronised, a, p).astype(p.dtype),
                        self.anchor, applied)

  def landed(self, params: chex.ArrayTree) -> chex.ArrayTree:
    """``params`` after a synchronising step (they are then :attr:`anchor` on every worker),
    :attr:`anchor` after a local one."""
    return jax.tree.map(lambda a, p: jnp.where(self.synchronised, p, a).astype(p.dtype),
                        self.anchor, params)

  def model_params(self) -> chex.ArrayTree:
    """The synchronised parameters (the model a run evaluates)."""
    return self.anchor


class AggregatedLocalState(NamedTuple):
  """State of :func:`local_updates` with an aggregator (:mod:`compressors.aggregation`) and
  simulated workers (:mod:`compressors.worker_sim`) on one worker: :class:`LocalUpdatesState`'s
  fields, and

  Attributes:
    active: ``bool[]``: this worker ran the latest step's inner step (a worker that is gone, or
      that has run its round's steps, stays where it was, bit for bit).
    workers: the simulator's state (:class:`compressors.worker_sim.WorkerSimState`), the same
      on every worker.
  """
  synchronised: jax.Array
  anchor: chex.ArrayTree
  inner: Any
  outer: Any
  exchange: Any
  active: jax.Array
  workers: worker_sim.WorkerSimState

  def land(self, params: chex.ArrayTree, applied: chex.ArrayTree) -> chex.ArrayTree:
    """:meth:`LocalUpdatesState.land`, and ``params`` themselves where this worker did not
    run."""
    return jax.tree.map(
        lambda a, p, q: jnp.where(self.synchronised, a, jnp.where(self.active, q, p)).astype(
            q.dtype), self.anchor, params, applied)

  def landed(self, params: chex.ArrayTree) -> chex.ArrayTree:
    """As :meth:`LocalUpdatesState.landed`."""
    return jax.tree.map(lambda a, p: jnp.where(self.synchronised, p, a).astype(p.dtype),
                        self.anchor, params)

  def model_params(self) -> chex.ArrayTree:
    """The synchronised parameters (the model a run evaluates)."""
    return self.anchor


class DelayedLocalState(NamedTuple):
  """State of :func:`local_updates` with ``aggregation.rule == "delayed"`` on one worker (Kale et
  al.'s naive one-step-delayed outer step, :mod:`compressors.aggregation`):
  :class:`AggregatedLocalState`'s fields, and

  Attributes:
    pending: the exchanged mean of the latest synchronisation, still "in flight": the next
      synchronisation's outer step applies it; the same on every worker.
    pending_count: ``int32[]``, the contributions it merged (0: the next outer step moves
      nothing); the same on every worker.
  """
  synchronised: jax.Array
  anchor: chex.ArrayTree
  inner: Any
  outer: Any
  exchange: Any
  active: jax.Array
  workers: worker_sim.WorkerSimState
  pending: chex.ArrayTree
  pending_count: jax.Array

  land = AggregatedLocalState.land
  landed = AggregatedLocalState.landed
  model_params = AggregatedLocalState.model_params


class EagerLocalState(NamedTuple):
  """State of :func:`local_updates` with ``aggregation.rule == "eager"`` on one worker (Kale et
  al.'s eager outer step, :mod:`compressors.aggregation`): :class:`AggregatedLocalState`'s
  fields, where :attr:`anchor` is the mean of the workers' outer parameters (the model a run
  evaluates, the same on every worker) and :attr:`outer` its outer state, and

  Attributes:
    own: this worker's outer parameters, where its inner phase starts (its own: the workers'
      differ).
    own_outer: the outer optimizer's state of :attr:`own`, this worker's own.
    sent: this worker's pseudo-gradient of the latest synchronisation, as it handed it to the
      exchange (weighted), this worker's own.
    pending: the exchanged mean of the latest synchronisation, still "in flight" (it lands at
      the next one), the same on every worker.
  """
  synchronised: jax.Array
  anchor: chex.ArrayTree
  inner: Any
  outer: Any
  exchange: Any
  active: jax.Array
  workers: worker_sim.WorkerSimState
  own: chex.ArrayTree
  own_outer: Any
  sent: chex.ArrayTree
  pending: chex.ArrayTree

  def land(self, params: chex.ArrayTree, applied: chex.ArrayTree) -> chex.ArrayTree:
    """``applied`` where this worker ran, ``params`` where it did not, and after a
    synchronising step :attr:`own` itself, bit for bit."""
    return jax.tree.map(
        lambda o, p, q: jnp.where(self.synchronised, o, jnp.where(self.active, q, p)).astype(
            q.dtype), self.own, params, applied)

  def landed(self, params: chex.ArrayTree) -> chex.ArrayTree:
    """:attr:`anchor`: no part of the workers' parameters is shared (each applied its own
    fresh pseudo-gradient); what every worker holds alike is the mean they evaluate."""
    return jax.tree.map(lambda a, p: a.astype(p.dtype), self.anchor, params)

  def model_params(self) -> chex.ArrayTree:
    """The mean of the workers' outer parameters (the model a run evaluates)."""
    return self.anchor


def nesterov_outer(learning_rate: float = 0.7,
                   momentum: float = 0.9) -> optax.GradientTransformation:
  """DiLoCo's outer optimizer: SGD with Nesterov momentum on the pseudo-gradient."""
  return optax.sgd(learning_rate, momentum=momentum or None, nesterov=bool(momentum))


def local_updates(inner: optax.GradientTransformation,
                  exchange: optax.GradientTransformation,
                  outer: optax.GradientTransformation | None = None, *,
                  aggregation: aggregation_lib.Aggregation | None = None,
                  axis_name: axes.AxisName = None) -> optax.GradientTransformationExtraArgs:
  """Local updates with an exchanged pseudo-gradient (DiLoCo; see the module docstring).

  Args:
    inner: the optimizer each worker runs on its own gradient (e.g. ``optax.adamw(4e-4)``).
    exchange: the per-worker transformation that returns the mean over workers of what it is
      given, with its own collectives (``compressors.compress(compressors.dense(),
      axis_name=...)``, ``tasc.tasc_compress(...)``, ...); it sees only pseudo-gradients.
    outer: the optimizer of the synchronised parameters, given the exchanged pseudo-gradient as
      its gradient (default :func:`nesterov_outer`: lr 0.7, Nesterov momentum 0.9).
    aggregation: an aggregator and its simulated workers (:mod:`compressors.aggregation`), or
      None: every worker is always there and every synchronisation takes the plain mean
      (DiLoCo as published; the state is then a :class:`LocalUpdatesState`). With ``eager``
      the state is an :class:`EagerLocalState`, with ``delayed`` a :class:`DelayedLocalState`.
    axis_name: the workers' axis (the exchange's), needed with ``aggregation``: each worker
      finds its own row of the simulated workers by its index along it.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose ``update(grads, state, params, *,
    synchronise=False, **extra_args)`` runs inside ``shard_map``/``pmap`` over the exchange's
    axis: ``params`` are this worker's; with ``synchronise=False`` (static) it returns the inner
    optimizer's update and moves nothing; with ``synchronise=True`` it exchanges the
    pseudo-gradient (``extra_args`` go to the exchange, e.g. TASC's curvature), takes the outer
    step and returns what moves this worker onto the new synchronised parameters (apply it with
    :func:`compressors.apply_local_updates`).
  """
  outer = nesterov_outer() if outer is None else outer
  exchange = optax.with_extra_args_support(exchange)
  if aggregation is not None and aggregation.rule == "eager":
    return _eager(inner, exchange, outer, aggregation, axis_name)
  if aggregation is not None:
    return _aggregated(inner, exchange, outer, aggregation, axis_name)

  def init(params):
    return LocalUpdatesState(jnp.zeros((), bool), jax.tree.map(jnp.asarray, params),
                             inner.init(params), outer.init(params), exchange.init(params))

  def update(grads, state, params=None, *, synchronise: bool = False, **extra_args):
    _check_update(params, synchronise)
    updates, inner_state = inner.update(grads, state.inner, params)
    if not synchronise:
      return updates, state._replace(synchronised=jnp.zeros((), bool), inner=inner_state)
    worker = optax.apply_updates(params, updates)
    pseudo_gradient = jax.tree.map(lambda a, w: (a - w).astype(a.dtype), state.anchor, worker)
    mean, exchange_state = exchange.update(pseudo_gradient, state.exchange, state.anchor,
                                           **extra_args)
    outer_updates, outer_state = outer.update(mean, state.outer, state.anchor)
    anchor = optax.apply_updates(state.anchor, outer_updates)
    return (jax.tree.map(lambda a, p: a - p, anchor, params),
            LocalUpdatesState(jnp.ones((), bool), anchor, inner_state, outer_state,
                              exchange_state))

  return optax.GradientTransformationExtraArgs(init, update)


def _check_update(params, synchronise) -> None:
  if params is None:
    raise ValueError("local_updates: update needs params (this worker's parameters)")
  if not isinstance(synchronise, bool):  # a traced flag would put both programs in one
    raise TypeError(f"local_updates: synchronise={synchronise!r} must be a Python bool (a "
                    "static argument: local and synchronising steps are two programs)")


def _simulated_inner_step(inner, agg: aggregation_lib.Aggregation, axis_name, grads, state,
                          params):
  """The inner step of one of the simulated workers: ``(updates, inner state, this worker ran,
  the simulator after the step, this worker's index)``. A worker that did not run (gone, or
  done with its round's steps) keeps its inner state; its updates are masked where it lands."""
  me = axes.worker_index(axis_name)
  running = aggregation_lib.active(agg, state.workers)
  active = running[me]
  updates, inner_state = inner.update(grads, state.inner, params)
  inner_state = jax.tree.map(lambda new, old: jnp.where(active, new, old), inner_state,
                             state.inner)
  return updates, inner_state, active, worker_sim.advance(state.workers, running), me


def _weighted(agg: aggregation_lib.Aggregation, weights: jax.Array, me: jax.Array, start,
              worker):
  """This worker's pseudo-gradient ``start - worker`` times ``workers * w_me / sum(w)`` (0 when
  nothing was merged): what it hands the exchange, whose mean is then the weighted mean."""
  total = weights.sum()
  scale = jnp.where(total > 0, weights[me] * agg.sim.workers / total, 0.0)
  return jax.tree.map(lambda a, w: ((a - w) * scale.astype(a.dtype)).astype(a.dtype), start,
                      worker)


def _aggregated(inner, exchange, outer, agg: aggregation_lib.Aggregation,
                axis_name) -> optax.GradientTransformationExtraArgs:
  """:func:`local_updates` with ``aggregation``: each worker runs an inner step only where the
  simulated workers say it is there and busy, and each synchronisation merges whom the
  aggregator takes, weighted inside the per-worker program (:mod:`compressors.aggregation`);
  ``delayed`` keeps the merged mean pending and applies the previous round's."""

  delayed = agg.rule == "delayed"

  def init(params):
    state = AggregatedLocalState(
        jnp.zeros((), bool), jax.tree.map(jnp.asarray, params), inner.init(params),
        outer.init(params), exchange.init(params), jnp.ones((), bool), worker_sim.init(agg.sim))
    if not delayed:
      return state
    return DelayedLocalState(*state, jax.tree.map(jnp.zeros_like, state.anchor),
                             jnp.zeros((), jnp.int32))

  def update(grads, state, params=None, *, synchronise: bool = False, **extra_args):
    early, sync = _simulated_round(inner, exchange, agg, axis_name, grads, state, params,
                                   synchronise, state.anchor, extra_args)
    if sync is None:
      return early
    # delayed: the previous round's mean lands now, this round's when the next one ends
    mean, count = (state.pending, state.pending_count) if delayed else (sync.mean,
                                                                       sync.merged.count)
    anchor, outer_state = aggregation_lib.outer_step(agg, outer, mean, state.outer,
                                                     state.anchor, count)
    new = AggregatedLocalState(jnp.ones((), bool), anchor, sync.inner, outer_state,
                               sync.exchange, sync.active, sync.merged.workers)
    if delayed:
      new = DelayedLocalState(*new, sync.mean, sync.merged.count)
    return jax.tree.map(lambda a, p: a - p, anchor, params), new

  return optax.GradientTransformationExtraArgs(init, update)


class _Synchronisation(NamedTuple):
  """A simulated worker's synchronisation, up to its outer step (:func:`_simulated_round`)."""
  contribution: Any  # what this worker handed the exchange (its weighted pseudo-gradient)
  mean: Any  # the exchange's mean
  exchange: Any  # the exchange's next state
  inner: Any  # the inner optimizer's next state
  active: jax.Array  # whether this worker ran this step
  merged: aggregation_lib.Merged  # whom the aggregator merged, and the simulator's next state


def _simulated_round(inner, exchange, agg: aggregation_lib.Aggregation, axis_name, grads, state,
                     params, synchronise: bool, start, extra_args):
  """The aggregated forms' step of a simulated worker: ``(updates, state)`` off a
  synchronisation, ``None`` and the :class:`_Synchronisation` on one, whose pseudo-gradient is
  ``start`` (the anchor, or eager's own outer parameters) minus the worker after its step (its
  own parameters where it sat out)."""
  _check_update(params, synchronise)
  updates, inner_state, active, sim, me = _simulated_inner_step(inner, agg, axis_name, grads,
                                                                state, params)
  if not synchronise:
    return (updates, state._replace(synchronised=jnp.zeros((), bool), inner=inner_state,
                                    active=active, workers=sim)), None
  worker = jax.tree.map(lambda p, q: jnp.where(active, q, p),
                        params, optax.apply_updates(params, updates))
  merged = aggregation_lib.merge(agg, sim)
  contribution = _weighted(agg, merged.weights, me, start, worker)
  mean, exchange_state = exchange.update(contribution, state.exchange, start, **extra_args)
  return None, _Synchronisation(contribution, mean, exchange_state, inner_state, active, merged)


def _eager(inner, exchange, outer, agg: aggregation_lib.Aggregation,
           axis_name) -> optax.GradientTransformationExtraArgs:
  """:func:`local_updates` with Kale et al.'s eager outer step (``aggregation.rule ==
  "eager"``; the recursion in :mod:`compressors.aggregation`): worker ``i`` moves its own outer
  parameters by ``g_i = pending + (Delta_i - sent_i) / N``, and the evaluated mean by
  ``pending + (mean - pending) / N``; the round's exchanged ``mean`` is then pending."""
  n = agg.sim.workers

  def init(params):
    params = jax.tree.map(jnp.asarray, params)
    zeros = jax.tree.map(jnp.zeros_like, params)
    return EagerLocalState(
        jnp.zeros((), bool), params, inner.init(params), outer.init(params),
        exchange.init(params), jnp.ones((), bool), worker_sim.init(agg.sim), params,
        outer.init(params), zeros, zeros)

  def update(grads, state, params=None, *, synchronise: bool = False, **extra_args):
    early, sync = _simulated_round(inner, exchange, agg, axis_name, grads, state, params,
                                   synchronise, state.own, extra_args)
    if sync is None:
      return early
    contribution, mean = sync.contribution, sync.mean
    late = lambda pending, fresh, stale: pending + (fresh - stale) / n
    own_updates, own_outer = outer.update(
        jax.tree.map(late, state.pending, contribution, state.sent), state.own_outer, state.own)
    own = optax.apply_updates(state.own, own_updates)
    anchor_updates, outer_state = outer.update(
        jax.tree.map(late, state.pending, mean, state.pending), state.outer, state.anchor)
    anchor = optax.apply_updates(state.anchor, anchor_updates)
    return (jax.tree.map(lambda o, p: o - p, own, params),
            EagerLocalState(jnp.ones((), bool), anchor, sync.inner, outer_state, sync.exchange,
                            sync.active, sync.merged.workers, own, own_outer, contribution,
                            mean))

  return optax.GradientTransformationExtraArgs(init, update)


def local_update_kinds(every: int,
                       exchange_inputs: StepInputs | None = None) -> tuple[StepKind, ...]:
  """The step kinds of local updates synchronising every ``every`` steps: ``"local"`` (no
  collective), and ``"sync"`` at steps ``every - 1, 2 every - 1, ...`` (after ``every`` local
  gradients; every step when ``every`` is 1), which sends and lands the whole model.

  Args:
    every: ``H``, steps between synchronisations.
    exchange_inputs: the exchange's per-step inputs (a ``StepInputs``, e.g.
      ``registry.step_inputs("tasc")``: its curvature, every ``N`` steps), or None. They are
      made at the synchronisations every ``lcm(every, N)`` steps (the first synchronisation
      among them), as ``"sync_with_inputs"``, or at every synchronisation when ``N`` divides
      ``every``.

  Raises:
    ValueError: ``every`` is not an int >= 1.
  """
  checks.check_int(every, "every", 1, "local_update_kinds")
  sync = dict(options={"synchronise": True}, sends=WHOLE_MODEL, lands=WHOLE_MODEL)
  if every == 1:
    kinds = [StepKind("sync", 1, **sync)]
  else:
    kinds = [StepKind("local", 1), StepKind("sync", every, phase=every - 1, **sync)]
  if exchange_inputs is not None and exchange_inputs.every > 0:
    period = math.lcm(every, exchange_inputs.every)
    if period == every:  # every synchronisation carries the inputs
      kinds[-1] = kinds[-1]._replace(inputs=exchange_inputs.make)
    else:
      kinds.append(StepKind("sync_with_inputs", period, exchange_inputs.make, phase=every - 1,
                            **sync))
  return tuple(kinds)


# The rules of the local-update settings, declared once for DiLoCo's and SparseLoCo's defaults.
_EVERY = checks.Rule(int, low=1)
_CARRIER = checks.Rule(str)  # a registered per-step method: registry.local_exchange checks it
_OUTER_LEARNING_RATE = checks.Rule(float, low=0)
_OUTER_MOMENTUM = checks.Rule(float, low=0, high=1, high_open=True)
_ERROR_DECAY = checks.Rule(float, low=0, high=1)


@dataclasses.dataclass(frozen=True)
class DilocoSettings:
  """``method="diloco"``: local updates with an exchanged pseudo-gradient (Douillard et al. 2023).

  Attributes:
    every: ``H``, the steps between synchronisations (each worker's inner optimizer runs ``H``
      steps on its own gradient; then the pseudo-gradient is exchanged).
    carrier: the registered per-step method that carries the pseudo-gradient (``dense``:
      float32 as in DiLoCo; ``fp16`` as OpenDiLoCo; ``int8`` as INTELLECT-1; ``topk``, ``tasc``,
      ...), with its own settings block (``config.compression.<carrier>``). Formerly
      ``exchange``; a config that says so still loads (:data:`RENAMED`).
    outer_learning_rate: the outer SGD's learning rate (DiLoCo: 0.7).
    outer_momentum: its Nesterov momentum (DiLoCo: 0.9); 0: plain SGD.
    error_decay: the exchange's error-feedback residual is multiplied by this before the next
      pseudo-gradient is added (SparseLoCo's beta); 1: plain error feedback.
  """
  every: int = checks.setting(100, _EVERY)
  carrier: str = checks.setting("dense", _CARRIER)
  outer_learning_rate: float = checks.setting(0.7, _OUTER_LEARNING_RATE)
  outer_momentum: float = checks.setting(0.9, _OUTER_MOMENTUM)
  error_decay: float = checks.setting(1.0, _ERROR_DECAY)

  def __post_init__(self):
    checks.check_settings(self, "local updates")


@dataclasses.dataclass(frozen=True)
class SparselocoSettings(DilocoSettings):
  """``method="sparseloco"`` (SparseLoCo, Sarfi et al. 2025, arXiv 2508.15706): DiLoCo whose
  pseudo-gradient goes through an error buffer decayed by ``error_decay`` (0.95) in place of
  outer momentum: ``e <- beta e + Delta; s = Q2(chunked-top-k(e)); e <- e - s;
  theta <- theta - lr mean(s)`` with outer lr 1 and no outer momentum. The default exchange,
  ``chunk_topk`` (``compressors._chunked_topk``, its settings in
  ``config.compression.chunk_topk``: chunks of 4096, 64 kept a chunk), is the paper's
  transport: per-chunk top-k, values in 2 bits, 12-bit chunk-local indices, each entry averaged
  over the workers that sent it (``config.compression.chunk_topk.average="senders"``, the
  authors' mean; ``"workers"`` divides by all of them, the mean before 2026-11-28).
  ``carrier="topk"`` sends float32 values and int32 indices over the fused buffer instead
  (about 4x the bytes at equal density; its mean is over all workers).

  The outer rate ``outer_learning_rate`` (alpha) multiplies the averaged ``s`` once:
  ``theta <- theta - alpha mean(s)``, the paper's equation. The authors' code applies an alpha
  other than 1 twice (to the error buffer's decoded values and again in the outer step), so
  the two agree at the published alpha = 1, and an alpha of ``a`` here is about ``sqrt(a)``
  there."""
  every: int = checks.setting(30, _EVERY)
  carrier: str = checks.setting("chunk_topk", _CARRIER)
  outer_learning_rate: float = checks.setting(1.0, _OUTER_LEARNING_RATE)
  outer_momentum: float = checks.setting(0.0, _OUTER_MOMENTUM)
  error_decay: float = checks.setting(0.95, _ERROR_DECAY)


def _build(s: DilocoSettings, inner, exchange, *, axis_name,
           aggregation: aggregation_lib.Aggregation | None = None
           ) -> optax.GradientTransformationExtraArgs:
  return local_updates(inner, exchange, nesterov_outer(s.outer_learning_rate, s.outer_momentum),
                       aggregation=aggregation, axis_name=axis_name)


def with_every(s: DilocoSettings, every: int) -> DilocoSettings:
  """``s`` with ``H`` set to ``every`` (``Method.with_sends_every``; its own checks run)."""
  return dataclasses.replace(s, every=every)


# The settings' old names, which configs written before a rename still use: (old, new).
RENAMED = (("exchange", "carrier"),)
# H and the carrier reach the assembly, the solver and the time model only through these hooks.
_LOCAL_HOOKS = dict(local=_build, carrier=lambda s: s.carrier, sends_every=lambda s: s.every,
                    with_sends_every=with_every, renamed=RENAMED,
                    kinds=lambda s, carrier_inputs: local_update_kinds(s.every, carrier_inputs),
                    error_feedback=False, aggregates=True)

METHODS = (
    method_table.Method(
        name="diloco", summary="local updates, the pseudo-gradient exchanged every H steps by "
        "any method and an outer Nesterov step (DiLoCo, Douillard et al. 2023)",
        settings=DilocoSettings, **_LOCAL_HOOKS),
    method_table.Method(
        name="sparseloco", summary="DiLoCo with an error-fed chunked top-k pseudo-gradient in 2 "
        "bits whose decayed error buffer replaces outer momentum (SparseLoCo, 2025)",
        settings=SparselocoSettings, **_LOCAL_HOOKS),
)
