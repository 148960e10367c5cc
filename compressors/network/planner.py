"""Per-bucket choice of all-reduce algorithm and density by integer programming.

TASC (Dong, Keutzer et al.) schedules its structured sparse all-reduce, mixing ring and
butterfly, by integer programming; this is that planner over the cost model of
:mod:`compressors.network.topology`. Each gradient bucket ``b`` gets exactly one option ``o`` =
(algorithm, density), a binary ``x[b, o]``; buckets are exchanged one after another, so the
communication time is ``sum t[b, o] x[b, o]`` and the retained importance
``sum r[b, o] x[b, o]``, where ``r[b, o]`` is the bucket's importance profile at the option's
density (e.g. the share of Hessian-weighted gradient energy its top entries keep). Either

* ``min_importance`` given: minimise time subject to retained >= min_importance * total, or
* ``time_budget`` given: maximise retained importance subject to time <= time_budget,

each solved by ``scipy.optimize.milp`` (HiGHS), then re-solved for the other objective with the
first held at its optimum, so ties break towards the faster (or more faithful) plan.
"""

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np
from scipy import optimize

from compressors.network import topology as topo

DEFAULT_DENSITIES = (1.0, 0.1, 0.01, 0.001)

ImportanceProfile = Callable[[float], float] | Mapping[float, float]


@dataclasses.dataclass(frozen=True)
class Bucket:
  """One gradient bucket.

  Attributes:
    name: for tables.
    size: elements in the bucket.
    importance: retained importance as a function of density (a callable, or a mapping from
      each offered density); ``importance(1.0)`` is the bucket's whole importance.
  """
  name: str
  size: int
  importance: ImportanceProfile

  def __post_init__(self):
    if not isinstance(self.size, (int, np.integer)) or self.size < 1:
      raise ValueError(f"Bucket {self.name!r}: size={self.size!r} is invalid; allowed: an int "
                       ">= 1 (elements)")

  def retained(self, density: float) -> float:
    """Importance kept at ``density``."""
    if isinstance(self.importance, Mapping):
      if density not in self.importance:
        raise ValueError(f"Bucket {self.name!r}: importance has no entry for density {density}; "
                         f"it has {sorted(self.importance)}")
      value = self.importance[density]
    else:
      value = self.importance(density)
    value = float(value)
    if not math.isfinite(value) or value < 0:
      raise ValueError(f"Bucket {self.name!r}: importance({density}) = {value} must be finite "
                       "and >= 0")
    return value


@dataclasses.dataclass(frozen=True)
class Choice:
  """The plan for one bucket."""
  bucket: str
  size: int
  algorithm: str
  density: float
  time: float
  bytes_sent: float
  retained: float


@dataclasses.dataclass(frozen=True)
class Plan:
  """Per-bucket choices and their totals.

  Attributes:
    choices: one :class:`Choice` per bucket, in bucket order.
    topology: the topology planned for.
    total_importance: the buckets' importance at density 1.
  """
  choices: tuple[Choice, ...]
  topology: topo.Topology
  total_importance: float

  @property
  def time(self) -> float:
    """Modelled communication time of all buckets, seconds."""
    return sum(c.time for c in self.choices)

  @property
  def retained(self) -> float:
    """Importance retained by all buckets."""
    return sum(c.retained for c in self.choices)

  def __str__(self):
    header = (f"{'bucket':<16}{'elements':>12}  {'algorithm':<17}{'density':>8}"
              f"{'time (ms)':>11}{'MB sent':>10}{'retained':>10}")
    rows = [f"Plan on {self.topology.name or 'topology'} ({self.topology.num_devices} devices)",
            header, "-" * len(header)]
    for c in self.choices:
      rows.append(f"{c.bucket:<16}{c.size:>12}  {c.algorithm:<17}{c.density:>8.4g}"
                  f"{c.time * 1e3:>11.4f}{c.bytes_sent / 1e6:>10.4f}{c.retained:>10.4g}")
    share = self.retained / self.total_importance if self.total_importance else 1.0
    rows.append(f"{'total':<16}{sum(c.size for c in self.choices):>12}  {'':<17}{'':>8}"
                f"{self.time * 1e3:>11.4f}{sum(c.bytes_sent for c in self.choices) / 1e6:>10.4f}"
                f"{self.retained:>10.4g}  ({share:.2%} of importance)")
    return "\n".join(rows)


def default_algorithms(topology: topo.Topology) -> tuple[str, ...]:
  """The schedules of :data:`compressors.network.collectives.SCHEDULES` that run on ``topology``
  (``"psum"``, priced as ``"ring"``, left out)."""
  return topo.schedules_for(topology)


def option_table(buckets: Sequence[Bucket], topology: topo.Topology, algorithms: Sequence[str],
                 densities: Sequence[float], itemsize: int = 4):
  """Cost and retained importance of every (bucket, schedule, density): at density ``d`` the
  schedule carries a shared-support payload of ``ceil(d * size)`` elements.

  Returns:
    ``(options, time, sent, retained)``: the (algorithm, density) list and three arrays shaped
    ``[len(buckets), len(options)]``.
  """
  options = [(a, d) for a in algorithms for d in densities]
  costs = [[topo.collective_cost(a, topology, b.size, d, itemsize) for a, d in options]
           for b in buckets]
  time = np.array([[c.time for c in row] for row in costs])
  sent = np.array([[c.bytes_sent for c in row] for row in costs])
  retained = np.array([[b.retained(d) for _, d in options] for b in buckets])
  return options, time, sent, retained


def plan(buckets: Sequence[Bucket], topology: topo.Topology, *,
         time_budget: float | None = None, min_importance: float | None = None,
         algorithms: Sequence[str] | None = None,
         densities: Sequence[float] = DEFAULT_DENSITIES, itemsize: int = 4) -> Plan:
  """Chooses an algorithm and density per bucket.

  Args:
    buckets: the gradient buckets.
    topology: the cluster.
    time_budget: seconds; maximise retained importance within it. Exclusive with
      ``min_importance``.
    min_importance: fraction in [0, 1] of the total importance to keep; minimise time.
    algorithms: schedules of :data:`compressors.network.collectives.SCHEDULES` that run on
      ``topology`` (default :func:`default_algorithms`): a plan is run by
      ``compressors.compress(..., schedule=plan)``, which carries each bucket's shared-support
      payload (TASC's blocks, random-k's values) with its schedule. Per-worker supports (top-k's
      all-gather) are other methods, priced by their registry entries
      (:mod:`compressors.registry`).
    densities: densities in (0, 1] offered to every algorithm.
    itemsize: bytes per gradient value on the wire.

  Returns:
    The optimal :class:`Plan`.

  Raises:
    ValueError: bad arguments, or no plan meets the constraint (the message gives the best
      that is reachable).
  """
  if (time_budget is None) == (min_importance is None):
    raise ValueError("plan: give exactly one of time_budget (seconds) or min_importance "
                     f"(fraction); got time_budget={time_budget}, min_importance={min_importance}")
  if time_budget is not None and not (math.isfinite(time_budget) and time_budget > 0):
    raise ValueError(f"plan: time_budget={time_budget!r} must be a positive number of seconds")
  if min_importance is not None and not 0 <= min_importance <= 1:
    raise ValueError(f"plan: min_importance={min_importance!r} must lie in [0, 1] (a fraction "
                     "of the total importance)")
  if not buckets:
    raise ValueError("plan: buckets is empty")
  allowed = default_algorithms(topology)
  algorithms = allowed if algorithms is None else tuple(algorithms)
  unknown = [a for a in algorithms if a not in allowed]
  if unknown or not algorithms:
    raise ValueError(f"plan: algorithms {unknown or list(algorithms)} unknown or empty; allowed: "
                     f"{list(allowed)}, the all-reduce schedules compress runs on "
                     f"{topology.name or 'this topology'}'s {len(topology.axes)} axes")
  bad = [d for d in densities if not 0 < d <= 1]
  if bad or not densities:
    raise ValueError(f"plan: densities {bad or list(densities)} invalid; allowed: non-empty, "
                     "each in (0, 1]")

  options, time, sent, retained = option_table(buckets, topology, algorithms, densities,
                                               itemsize)
  total = sum(b.retained(1.0) for b in buckets)
  if time_budget is not None:
    fastest = time.min(axis=1).sum()
    if fastest > time_budget:
      raise ValueError(f"plan: no plan meets the time budget {_ms(time_budget)}: the fastest plan "
                       f"needs {_ms(fastest)} on {topology.name or 'this topology'} (offered "
                       f"densities down to {min(densities)})")
    pick = _solve(time, -retained, time_budget)
  else:
    need = min_importance * total
    best = retained.max(axis=1).sum()
    if best < need * (1 - 1e-12):
      raise ValueError(f"plan: no plan retains {min_importance:.4g} of the importance: the most "
                       f"any plan keeps is {best / total:.4g} (offered densities up to "
                       f"{max(densities)})")
    pick = _solve(-retained, time, -need)
  choices = tuple(
      Choice(b.name, int(b.size), options[o][0], options[o][1], float(time[i, o]),
             float(sent[i, o]), float(retained[i, o]))
      for i, (b, o) in enumerate(zip(buckets, pick)))
  return Plan(choices, topology, total)


def _solve(bounded: np.ndarray, primary: np.ndarray, bound: float) -> list[int]:
  """Picks one option per row with ``sum bounded <= bound``: minimises ``sum primary``, then,
  with that held at its optimum, minimises ``sum bounded``.

  Both arrays are rescaled to O(1) so that HiGHS's absolute tolerances are meaningful.
  """
  rows, cols = bounded.shape
  one_each = optimize.LinearConstraint(np.kron(np.eye(rows), np.ones(cols)), 1, 1)
  b_scale = max(np.abs(bounded).max(), abs(bound), np.finfo(float).tiny)
  p_scale = max(np.abs(primary).max(), np.finfo(float).tiny)
  b, p = bounded.reshape(-1) / b_scale, primary.reshape(-1) / p_scale
  within = optimize.LinearConstraint(b, -np.inf, bound / b_scale)
  best = p @ _milp(p, [one_each, within])
  held = optimize.LinearConstraint(p, -np.inf, best + 1e-9 * max(1.0, abs(best)))
  return list(_milp(b, [one_each, within, held]).reshape(rows, cols).argmax(axis=1))


def _milp(c: np.ndarray, constraints) -> np.ndarray:
  result = optimize.milp(c, constraints=constraints, integrality=np.ones_like(c),
                         bounds=optimize.Bounds(0, 1))
  if not result.success:
    raise ValueError(f"plan: the integer program failed ({result.message})")
  return np.round(result.x)


def _ms(seconds: float) -> str:
  return f"{seconds * 1e3:.4g} ms"
