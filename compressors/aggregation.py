"""Aggregators of a local-update method's synchronisation: whom it merges, with what weight, and
how the merged pseudo-gradient moves the synchronised parameters, when workers are slow, late or
gone (:mod:`compressors.worker_sim`).

Every rule runs in the per-worker program of :func:`compressors.local_updates` and of
:func:`compressors.streaming_local_updates` (where each fragment's synchronisation is one of the
simulator's, a round of ``H / F`` steps): each worker
multiplies its pseudo-gradient by ``workers * w_i / sum(w)`` before the exchange (the carrier
compresses that, per worker, before the collective), so the exchange's mean is the weighted
mean ``sum(w_i Delta_i) / sum(w)``; a worker of weight 0 puts zeros in (with an error-feedback
carrier it still sends what its residual holds, as a worker that flushes it would). The bytes
stay those of the compiled program. A synchronisation whose weights are all 0 moves nothing.

* ``sync``: every worker that arrived, weighted by the inner steps (tokens) it ran; the round
  waits for the last of them. With the workers alike this is DiLoCo, bit for bit.
* ``quorum`` (Decoupled DiLoCo's token-weighted merge with a deadline): the workers that arrive
  within the deadline, weighted by their tokens; the others' work is dropped (they land on the
  new parameters with everyone). The deadline is ``deadline`` seconds after the round began, or
  adaptive (``deadline=None``): the median of the arrivals plus ``deviations`` times their
  median absolute deviation (hivemind's rule); never before the first arrival.
* ``async``: Async Local-SGD (Liu et al. 2024, arXiv 2401.09135) with per-worker step counts
  (each worker runs ``max(1, round(H * t_min / t_i))`` inner steps a round, so that all arrive
  at about the fastest one's time; a worker that is done waits frozen) and Delayed Nesterov:
  the ``m`` arrivals of a round are applied one at a time in arrival order, each on the state
  it finds, as a plain step ``theta <- theta - lr Delta_k / m``, and the outer momentum is
  applied once every ``m`` arrivals, with the mean of the buffered ones: ``mom <- beta mom +
  mean; theta <- theta - lr beta mom``. Since every arrival of a round started from the same
  parameters the plain steps add up, so the round is ``theta - lr (mean + beta mom)``: the
  outer Nesterov step of the unweighted mean of the arrivals (one exchange), and with the
  workers alike DiLoCo's. The ``k``-th arrival is ``k - 1`` outer steps stale.
* ``naive_async``: the papers' baseline: every worker runs all ``H`` steps, and each of the
  ``m`` arrivals is applied as it is, one full outer step (momentum and all) each, on the state
  it finds; each arrival's pseudo-gradient is taken as the round's mean over ``m`` (exact when
  the workers are alike), so the outer optimizer runs ``m`` times a round.
* ``eager``: Kale et al. 2025 (arXiv 2502.12996), "eager updates": the exchange of round ``t``
  overlaps the next round's inner steps, so the average ``Delta^t`` arrives one outer step
  late; in its place worker ``i`` applies, at once, its own fresh pseudo-gradient and the
  others' delayed ones, ``g_i^t = (Delta_i^t + sum_{j != i} Delta_j^{t-1}) / N = Delta^{t-1} +
  (Delta_i^t - Delta_i^{t-1}) / N``, through its own copy of the outer optimizer: each worker
  keeps its own outer parameters (where its next inner phase starts) and outer state, and the
  workers' parameters never agree. The weights are ``sync``'s (``Delta_i`` is the weighted
  contribution a worker hands the exchange; a worker that dropped out contributes 0), and the
  outer step runs every round, also when nothing was merged (the delayed average still lands).
  The model a run evaluates is the mean of the workers' outer parameters, kept without a
  collective: with a linear outer optimizer (SGD, Nesterov) it is the outer optimizer run on
  ``mean_i g_i^t = Delta^t / N + (N - 1) / N Delta^{t-1}``, exact where the carrier is. The own
  term is the uncompressed pseudo-gradient, as in the paper (uncompressed there): with a lossy
  carrier it is not what the carrier delivered, and with error feedback the part the residual
  keeps is sent, and counted, again later. Each contribution reaches its own worker at once and
  the other ``N - 1`` one outer step late: staleness ``(N - 1) / N`` on average, at most 1.
* ``delayed``: Kale et al.'s naive one-step-delayed outer step, the baseline eager improves
  on: the exchange of round ``t`` overlaps the next round's inner steps, and every worker
  applies only the previous round's exchanged mean, ``anchor <- outer(anchor, Delta^{t-1})``,
  to the shared anchor, from which all start their next inner phase (the workers agree after
  each synchronisation). The weights are ``sync``'s; the first round applies nothing, and a
  round whose predecessor merged nothing moves nothing (as ``sync``). Every applied
  contribution is exactly one outer step stale.

Per-step methods (a compressor or transformation that exchanges every step,
:func:`per_step`): every step is a synchronisation of one inner step (``round_steps = 1``);
``sync`` merges every worker that is there, ``quorum`` those that arrive within the deadline.
A gradient that arrives after the deadline is dropped (``stale_weight = 0``) or held by its
worker and sent with its next step's at weight ``stale_weight`` (one step stale), the mean
divided by the total weight, fresh and stale. The weighting is the same as the local-update
methods': each worker scales what it hands the exchange.

Modelled seconds of a round: the compute the aggregator waits for (``sync``: the last arrival;
``quorum``: the deadline or the last arrival if sooner; ``async``/``naive_async``: ``m`` arrivals
at the workers' summed rates, ``m / sum(1 / arrival_i)``) plus one synchronisation's
communication, ``sync_seconds``, which the caller takes from the alpha-beta link model
(:func:`compressors.step_time.kind_times`). ``eager`` and ``delayed`` hide the communication
behind the next round's inner steps: ``max(sync's wait, sync_seconds)``, not their sum.
"""

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from compressors import worker_sim
from compressors.network import axes
from compressors.worker_sim import WorkerSim
from compressors.worker_sim import WorkerSimState

RULES = ("sync", "quorum", "async", "naive_async", "eager", "delayed")
OVERLAPPED_RULES = ("eager", "delayed")  # a round's exchange lands at the next one
PER_STEP_RULES = ("sync", "quorum")  # the rules a per-step method takes (:func:`per_step`)


@dataclasses.dataclass(frozen=True)
class Aggregation:
  """An aggregator and the workers it meets (Python values, fixed for a run).

  Attributes:
    rule: one of :data:`RULES`.
    sim: the workers (:class:`compressors.worker_sim.WorkerSim`).
    round_steps: ``H``, the inner steps of a round (``Method.sends_every``).
    deadline: ``quorum``'s deadline in modelled seconds after the round began (> 0), or None:
      adaptive.
    deviations: the adaptive deadline's ``k`` (>= 0).
    sync_seconds: the modelled communication seconds of one synchronisation (>= 0).
    stale_weight: a per-step method's weight of a gradient that arrived after ``quorum``'s
      deadline, sent with its worker's next one (in [0, 1]; 0: dropped).
  """
  rule: str
  sim: WorkerSim
  round_steps: int
  deadline: float | None = None
  deviations: float = 1.0
  sync_seconds: float = 0.0
  stale_weight: float = 0.0

  def __post_init__(self):
    where = "compressors.aggregation.Aggregation"
    if self.rule not in RULES:
      raise ValueError(f"{where}: rule={self.rule!r}; allowed: {RULES}")
    if self.deadline is not None and not self.deadline > 0:
      raise ValueError(f"{where}: deadline={self.deadline!r}; allowed: seconds > 0, or None "
                       "(adaptive)")
    if not self.deviations >= 0:
      raise ValueError(f"{where}: deviations={self.deviations!r}; allowed: >= 0")
    if not self.sync_seconds >= 0:
      raise ValueError(f"{where}: sync_seconds={self.sync_seconds!r}; allowed: >= 0")
    if not 0 <= self.stale_weight <= 1:
      raise ValueError(f"{where}: stale_weight={self.stale_weight!r}; allowed: [0, 1]")


def active(agg: Aggregation, state: WorkerSimState) -> jax.Array:
  """``bool[workers]``: the workers that run an inner step at the current step: those there
  that have not yet run their round's steps (``async``: each its own count)."""
  target = jnp.full(state.worked.shape, agg.round_steps, jnp.int32)
  if agg.rule == "async":
    seconds = state.seconds_per_step
    target = jnp.maximum(1, jnp.floor(agg.round_steps * seconds.min() / seconds + 0.5)).astype(
        jnp.int32)
  return worker_sim.present(state) & (state.worked < target)


def _masked_median(values: jax.Array, mask: jax.Array) -> jax.Array:
  """The median of ``values`` where ``mask`` (at least one), in float32."""
  ordered = jnp.sort(jnp.where(mask, values, jnp.inf))
  m = mask.sum()
  low, high = jnp.maximum(m - 1, 0) // 2, m // 2
  return (ordered[low] + ordered[jnp.minimum(high, values.shape[0] - 1)]) / 2


def _deadline(agg: Aggregation, rnd: worker_sim.Round) -> jax.Array:
  """``quorum``'s deadline for the round (never before its first arrival)."""
  first = jnp.where(rnd.arrived, rnd.arrival, jnp.inf).min()
  if agg.deadline is not None:
    return jnp.maximum(jnp.float32(agg.deadline), first)
  median = _masked_median(rnd.arrival, rnd.arrived)
  spread = _masked_median(jnp.abs(rnd.arrival - median), rnd.arrived)
  return jnp.maximum(median + agg.deviations * spread, first)


class Merged(NamedTuple):
  """Whom a synchronisation merged (:func:`merge`).

  Attributes:
    weights: ``float32[workers]``, each worker's weight (0: not merged).
    count: ``int32[]``, the contributions merged (the outer steps ``naive_async`` takes).
    late: ``bool[workers]``, the workers that arrived after the deadline.
    dropped: ``bool[workers]``, the workers that dropped out at this synchronisation (their
      work since the previous one lost).
    workers: the simulator's next state.
  """
  weights: jax.Array
  count: jax.Array
  late: jax.Array
  dropped: jax.Array
  workers: WorkerSimState


def merge(agg: Aggregation, state: WorkerSimState) -> Merged:
  """The synchronisation at the current step (after :func:`compressors.worker_sim.advance` of
  its inner step)."""
  rnd, key = worker_sim.arrivals(agg.sim, state)
  last = jnp.where(rnd.arrived, rnd.arrival, 0.0).max()
  merged = rnd.arrived
  wait = last
  if agg.rule == "quorum":
    deadline = _deadline(agg, rnd)
    merged = rnd.arrived & (rnd.arrival <= deadline)
    wait = jnp.minimum(last, deadline)
  elif agg.rule in ("async", "naive_async"):
    rates = jnp.where(rnd.arrived, 1 / rnd.arrival, 0.0).sum()
    wait = jnp.where(rates > 0, rnd.arrived.sum() / rates, 0.0)
  m = merged.sum().astype(jnp.int32)
  communication = jnp.float32(agg.sync_seconds)
  if agg.rule in ("async", "naive_async"):
    weights = merged.astype(jnp.float32)
    stale_sum, stale_max = m * (m - 1) / 2, jnp.maximum(m - 1, 0)
  elif agg.rule in OVERLAPPED_RULES:  # the exchange overlaps the next round's compute
    weights = jnp.where(merged, rnd.worked, 0).astype(jnp.float32)
    n = agg.sim.workers
    # eager: each contribution reaches N - 1 workers late, delayed: all N
    late, latest = ((n - 1) / n, min(n - 1, 1)) if agg.rule == "eager" else (1.0, 1)
    stale_sum, stale_max = m * late, jnp.where(m > 0, latest, 0)
    wait, communication = jnp.maximum(wait, communication), jnp.zeros((), jnp.float32)
  else:
    weights = jnp.where(merged, rnd.worked, 0).astype(jnp.float32)
    stale_sum, stale_max = jnp.zeros(()), jnp.zeros((), jnp.int32)
  t = state.totals
  totals = t._replace(
      modelled_seconds=t.modelled_seconds + wait + communication,
      useful_steps=t.useful_steps + jnp.where(merged, rnd.worked, 0).sum(),
      updates_dropped=t.updates_dropped + rnd.dropped + (rnd.arrived & ~merged).sum(),
      updates_applied=t.updates_applied + m,
      staleness_sum=t.staleness_sum + stale_sum.astype(jnp.float32),
      staleness_max=jnp.maximum(t.staleness_max, stale_max))
  left = (state.worked > 0) & ~rnd.arrived
  return Merged(weights, m, rnd.arrived & ~merged, left,
                worker_sim.close_round(agg.sim, state, key, left, totals))


class PerStepState(NamedTuple):
  """State of :func:`per_step` on one worker.

  Attributes:
    inner: the wrapped transformation's state.
    late: what this worker handed in after the latest step's deadline (zeros if it was on
      time), sent with its next step's at ``stale_weight``; this worker's own (``()`` with
      ``stale_weight`` 0).
    late_workers: ``bool[workers]``, the workers late at the latest step, the same on every
      worker.
    workers: the simulator's state (:class:`compressors.worker_sim.WorkerSimState`).
  """
  inner: Any
  late: Any
  late_workers: jax.Array
  workers: WorkerSimState


def _with_stale(totals: worker_sim.RunTotals, late_now: jax.Array,
                late_before: jax.Array) -> worker_sim.RunTotals:
  """``totals`` with the late gradients not dropped but sent at the next step: the ones of this
  step not counted dropped, the ones of the previous step applied, one step stale."""
  now, before = late_now.sum().astype(jnp.int32), late_before.sum().astype(jnp.int32)
  return totals._replace(
      updates_dropped=totals.updates_dropped - now,
      updates_applied=totals.updates_applied + before,
      useful_steps=totals.useful_steps + before,
      staleness_sum=totals.staleness_sum + before.astype(jnp.float32),
      staleness_max=jnp.maximum(totals.staleness_max, jnp.minimum(before, 1)))


def per_step(tx: optax.GradientTransformation, agg: Aggregation,
             axis_name) -> optax.GradientTransformationExtraArgs:
  """A per-step method's exchange ``tx`` (a per-worker transformation whose output is the mean
  over the workers of what it is given, e.g. ``compressors.compress(...)``) among the simulated
  workers of ``agg`` (``agg.rule`` in :data:`PER_STEP_RULES`, ``agg.round_steps == 1``): each
  worker hands ``tx`` its input times ``workers * w_i / sum(w)``, plus its late one of the
  previous step times ``workers * stale_weight / sum(w)``, ``sum(w)`` counting both, so that
  ``tx``'s mean is the weighted mean of the merged inputs (see the module docstring). A worker
  that is gone hands in zeros; a step that nobody reached passes zeros on."""
  if agg.rule not in PER_STEP_RULES or agg.round_steps != 1:
    raise ValueError(f"compressors.aggregation.per_step: rule={agg.rule!r}, round_steps="
                     f"{agg.round_steps}; allowed: rule in {PER_STEP_RULES}, round_steps=1")
  tx = optax.with_extra_args_support(tx)
  n = agg.sim.workers

  def init(params):  # with stale_weight 0 no late input is ever sent: none is kept
    late = jax.tree.map(jnp.zeros_like, params) if agg.stale_weight else ()
    return PerStepState(tx.init(params), late, jnp.zeros((n,), bool), worker_sim.init(agg.sim))

  def update(updates, state, params=None, **extra_args):
    me = axes.worker_index(axis_name)
    sim = worker_sim.advance(state.workers, active(agg, state.workers))
    merged = merge(agg, sim)
    stale = agg.stale_weight * state.late_workers.astype(jnp.float32)
    total = merged.weights.sum() + stale.sum()
    fresh_scale = jnp.where(total > 0, merged.weights[me] * n / total, 0.0)
    stale_scale = jnp.where(total > 0, stale[me] * n / total, 0.0)
    handed = jax.tree.map(lambda g: (g * fresh_scale.astype(g.dtype)).astype(g.dtype), updates)
    if agg.stale_weight:
      handed = jax.tree.map(lambda h, late: (h + late * stale_scale.astype(h.dtype)).astype(
          h.dtype), handed, state.late)
    out, inner_state = tx.update(handed, state.inner, params, **extra_args)
    sim, late = merged.workers, state.late
    if agg.stale_weight:
      sim = sim._replace(totals=_with_stale(sim.totals, merged.late, state.late_workers))
      late = jax.tree.map(lambda g: jnp.where(merged.late[me], g, jnp.zeros_like(g)), updates)
    return out, PerStepState(inner_state, late, merged.late, sim)

  return optax.GradientTransformationExtraArgs(init, update)


def outer_step(agg: Aggregation, outer: optax.GradientTransformation, mean: Any,
               outer_state: Any, anchor: Any, m: jax.Array) -> tuple[Any, Any]:
  """The synchronised parameters and the outer optimizer's state after the round whose merged
  pseudo-gradient is ``mean`` (``m`` contributions; with none, nothing moves; ``delayed``: the
  caller's pending mean of the previous round and its count). Not ``eager``'s
  (:func:`compressors.local_updates` keeps its per-worker outer parameters)."""
  if agg.rule == "eager":
    raise ValueError("outer_step: rule='eager' keeps an outer state per worker; local_updates "
                     "runs its outer steps")
  if agg.rule != "naive_async":
    updates, new_state = outer.update(mean, outer_state, anchor)
    moved = optax.apply_updates(anchor, updates)
  else:  # m full outer steps, each with an arrival's share of the mean
    share = jax.tree.map(lambda g: g / jnp.maximum(m, 1).astype(g.dtype), mean)

    def arrival(k, carry):
      params, state = carry
      updates, stepped = outer.update(share, state, params)
      take = lambda new, old: jnp.where(k < m, new, old)
      return (jax.tree.map(take, optax.apply_updates(params, updates), params),
              jax.tree.map(take, stepped, state))
    moved, new_state = jax.lax.fori_loop(0, agg.sim.workers, arrival, (anchor, outer_state))
  keep = lambda new, old: jnp.where(m > 0, new, old)
  return jax.tree.map(keep, moved, anchor), jax.tree.map(keep, new_state, outer_state)


def totals(state: Any) -> dict[str, Any] | None:
  """The run's figures from the simulator's state inside ``state`` (an optimizer state), or
  None without one: ``modelled_seconds``, ``useful_steps`` (worker-steps that reached the
  model), ``updates_dropped``, ``updates_applied``, ``staleness_mean``, ``staleness_max``."""
  found = [s for s in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, WorkerSimState))
           if isinstance(s, WorkerSimState)]
  if len(found) != 1:
    return None
  t = jax.device_get(found[0].totals)
  applied = int(t.updates_applied)
  return {"modelled_seconds": float(t.modelled_seconds), "useful_steps": int(t.useful_steps),
          "updates_dropped": int(t.updates_dropped), "updates_applied": applied,
          "staleness_mean": float(t.staleness_sum) / applied if applied else 0.0,
          "staleness_max": int(t.staleness_max)}
