"""Workers that are slow, late or gone, simulated deterministically inside the training program.

Every worker of a run is one row of the same program; this module models what would make real
workers differ (how fast each one is, which ones miss a synchronisation, when they come back)
so that an aggregator (:mod:`compressors.aggregation`) can decide whom a synchronisation merges,
and what the run would have cost in time. Nothing here changes how fast the program runs.

* **Speed.** Each worker ``i`` takes ``seconds_per_step[i]`` modelled seconds per inner step:
  ``step_seconds * exp(speed_spread * z_i)`` with ``z_i`` standard normal, drawn once from the
  run's seed (a log-normal spread; 0: every worker alike), or the rows of a trace of per-worker
  step times (``speed_trace``: ``[workers]``, or ``[rounds, workers]`` whose row
  ``round % rounds`` holds at each synchronisation).
* **Drop-outs.** At each synchronisation each worker that is there misses it with probability
  ``dropout_rate``: what it computed since the previous one is lost (it contributes nothing and
  its tokens are not counted) and it is gone for the next ``rejoin_after`` steps, frozen (it
  runs no inner step; its optimizer state is kept). Every worker lands on the synchronised
  parameters at every synchronisation, so a worker that rejoins starts from the current global
  state, bit for bit.
* **Arrivals.** A worker that took part in a round arrives at ``worked[i] *
  seconds_per_step[i]`` modelled seconds after the round began (``worked``: the inner steps it
  ran since the previous synchronisation; a worker that rejoined mid-round is counted from the
  round's start, a simplification).

The state (:class:`WorkerSimState`) is replicated (the same on every worker: every worker draws
the same random numbers from the same key), a part of the optimizer state, so checkpoints hold
it and a resumed run draws what an uninterrupted one would, bit for bit. What is simulated:
speeds, drop-outs, arrival times and the modelled seconds that follow from them; what is
measured: nothing (the bytes of a synchronisation stay those of the compiled program).
"""

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class WorkerSim:
  """How the workers differ (Python values, fixed for a run).

  Attributes:
    workers: the number of workers.
    step_seconds: modelled seconds of one inner step of a worker of speed 1 (> 0).
    speed_spread: sigma of the log-normal spread of the workers' seconds per step (>= 0).
    speed_trace: per-worker seconds per step, ``[workers]`` or ``[rounds, workers]`` (row
      ``round % rounds`` at each synchronisation), or None: drawn from ``speed_spread``.
    dropout_rate: the chance that a worker misses a synchronisation (in [0, 1)).
    rejoin_after: steps a worker that missed a synchronisation stays gone (>= 0).
    seed: seeds the draws.
  """
  workers: int
  step_seconds: float = 1.0
  speed_spread: float = 0.0
  speed_trace: tuple | None = None
  dropout_rate: float = 0.0
  rejoin_after: int = 0
  seed: int = 0

  def __post_init__(self):
    where = "compressors.worker_sim.WorkerSim"
    if not self.step_seconds > 0:
      raise ValueError(f"{where}: step_seconds={self.step_seconds!r}; allowed: > 0")
    if not self.speed_spread >= 0:
      raise ValueError(f"{where}: speed_spread={self.speed_spread!r}; allowed: >= 0")
    if not 0 <= self.dropout_rate < 1:
      raise ValueError(f"{where}: dropout_rate={self.dropout_rate!r}; allowed: [0, 1)")
    if self.rejoin_after < 0:
      raise ValueError(f"{where}: rejoin_after={self.rejoin_after!r}; allowed: an int >= 0")
    if self.speed_trace is not None:
      trace = np.asarray(self.speed_trace, np.float64)
      if trace.ndim not in (1, 2) or trace.shape[-1] != self.workers:
        raise ValueError(f"{where}: speed_trace of shape {trace.shape} for {self.workers} "
                         f"workers; allowed: [{self.workers}] or [rounds, {self.workers}]")
      if not np.all(np.isfinite(trace)) or not np.all(trace > 0):
        raise ValueError(f"{where}: speed_trace holds a step time that is not a number > 0")

  @property
  def varies(self) -> bool:
    """Whether the workers differ at all (otherwise every worker is always there, alike)."""
    return bool(self.speed_spread or self.speed_trace is not None or self.dropout_rate)


class WorkerSimState(NamedTuple):
  """The simulator's state, the same on every worker.

  Attributes:
    key: ``uint32[2]``, the key of the next draws.
    step: ``int32[]``, inner steps run so far.
    rounds: ``int32[]``, synchronisations so far.
    seconds_per_step: ``float32[workers]``, each worker's modelled seconds per inner step.
    absent_until: ``int32[workers]``: a worker is gone while ``step < absent_until``.
    worked: ``int32[workers]``, inner steps each worker ran since the latest synchronisation.
    totals: :class:`RunTotals` so far.
  """
  key: jax.Array
  step: jax.Array
  rounds: jax.Array
  seconds_per_step: jax.Array
  absent_until: jax.Array
  worked: jax.Array
  totals: "RunTotals"


class RunTotals(NamedTuple):
  """What a run's synchronisations amounted to (``results.json``'s figures come from it).

  Attributes:
    modelled_seconds: ``float32[]``, the modelled seconds of the rounds so far.
    useful_steps: ``int32[]``, worker-steps whose work reached the model.
    updates_dropped: ``int32[]``, contributions lost (a drop-out, a worker past the deadline).
    updates_applied: ``int32[]``, contributions merged.
    staleness_sum: ``float32[]``, the sum over applied contributions of the outer steps that
      landed between the state a contribution started from and the one it was applied to.
    staleness_max: ``int32[]``, their maximum.
  """
  modelled_seconds: jax.Array
  useful_steps: jax.Array
  updates_dropped: jax.Array
  updates_applied: jax.Array
  staleness_sum: jax.Array
  staleness_max: jax.Array


class Round(NamedTuple):
  """One synchronisation's workers, before an aggregator decides whom it merges.

  Attributes:
    arrived: ``bool[workers]``: the worker worked this round and did not drop out.
    arrival: ``float32[workers]``: its modelled seconds from the round's start (``inf`` where
      it did not arrive).
    worked: ``int32[workers]``: its inner steps this round (0 where it did not arrive).
    dropped: ``int32[]``: workers that dropped out at this synchronisation.
  """
  arrived: jax.Array
  arrival: jax.Array
  worked: jax.Array
  dropped: jax.Array


def _zero_totals() -> RunTotals:
  f, i = jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32)
  return RunTotals(f, i, i, i, f, i)


def init(sim: WorkerSim) -> WorkerSimState:
  """The state at step 0: the workers' speeds drawn (or the trace's first row), all present."""
  key, draw = jax.random.split(jax.random.PRNGKey(sim.seed))
  if sim.speed_trace is not None:
    seconds = jnp.asarray(np.atleast_2d(np.asarray(sim.speed_trace, np.float32))[0])
  else:
    z = jax.random.normal(draw, (sim.workers,), jnp.float32)
    seconds = sim.step_seconds * jnp.exp(sim.speed_spread * z)
  n = (sim.workers,)
  return WorkerSimState(jax.random.key_data(key), jnp.zeros((), jnp.int32),
                        jnp.zeros((), jnp.int32), seconds.astype(jnp.float32),
                        jnp.zeros(n, jnp.int32), jnp.zeros(n, jnp.int32), _zero_totals())


def present(state: WorkerSimState) -> jax.Array:
  """``bool[workers]``: which workers are there at the current step."""
  return state.step >= state.absent_until


def advance(state: WorkerSimState, active: jax.Array) -> WorkerSimState:
  """The state after one inner step in which the workers ``active`` (``bool[workers]``) ran."""
  return state._replace(step=state.step + 1, worked=state.worked + active.astype(jnp.int32))


def arrivals(sim: WorkerSim, state: WorkerSimState) -> tuple[Round, jax.Array]:
  """The workers of the synchronisation at the current step (after :func:`advance` of its inner
  step): who drops out, who arrives and when. Returns ``(round, the key for what follows)``."""
  key, draw = jax.random.split(jax.random.wrap_key_data(state.key))
  there = state.worked > 0
  dropped = there & (jax.random.uniform(draw, (sim.workers,)) < sim.dropout_rate)
  arrived = there & ~dropped
  arrival = jnp.where(arrived, state.worked * state.seconds_per_step, jnp.inf)
  return (Round(arrived, arrival.astype(jnp.float32), jnp.where(arrived, state.worked, 0),
                dropped.sum().astype(jnp.int32)), key)


def close_round(sim: WorkerSim, state: WorkerSimState, key: jax.Array, dropped: jax.Array,
                totals: RunTotals) -> WorkerSimState:
  """The state after a synchronisation: the workers in ``dropped`` (``bool[workers]``) gone for
  ``rejoin_after`` steps, every count of the round reset, the next round's speeds (a trace's
  next row), ``totals`` recorded."""
  rounds = state.rounds + 1
  seconds = state.seconds_per_step
  if sim.speed_trace is not None:
    trace = jnp.asarray(np.atleast_2d(np.asarray(sim.speed_trace, np.float32)))
    seconds = trace[rounds % trace.shape[0]]
  absent_until = jnp.where(dropped, state.step + sim.rejoin_after, state.absent_until)
  return WorkerSimState(jax.random.key_data(key), state.step, rounds, seconds, absent_until,
                        jnp.zeros_like(state.worked), totals)


def read_trace(path: str, workers: int, field: str = "config.workers.speed_trace") -> tuple:
  """The per-worker step times of the text file ``path`` (one row per round, one column per
  worker, whitespace- or comma-separated; one row: the same every round), as nested tuples.

  Raises:
    ValueError: the file cannot be read, or its columns are not ``workers`` numbers > 0.
  """
  try:
    with open(path, encoding="utf-8") as f:
      rows = [line.replace(",", " ").split() for line in f if line.strip()
              and not line.lstrip().startswith("#")]
    trace = np.asarray([[float(x) for x in row] for row in rows], np.float64)
  except (OSError, ValueError) as e:
    raise ValueError(f"{field}={path!r} cannot be read as rows of per-worker step times "
                     f"({type(e).__name__}: {e})") from e
  if trace.ndim != 2 or trace.shape[1] != workers or not len(trace):
    found = trace.shape[1] if trace.ndim == 2 else "ragged"
    raise ValueError(f"{field}={path!r} has {found} columns; allowed: one per worker, "
                     f"{workers}")
  if not np.all(np.isfinite(trace)) or not np.all(trace > 0):
    raise ValueError(f"{field}={path!r} holds a step time that is not a number > 0; allowed: "
                     "seconds > 0")
  return tuple(map(tuple, trace.tolist()))
