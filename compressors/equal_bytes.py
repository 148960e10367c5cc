"""Equal-bytes tiers: set a method's density, rank or block count so its bytes land on a target.

Comparing methods at equal *density* compares different traffic: at density ``d`` top-k
all-gathers ``2 d n (p - 1)`` words over ``p`` workers while random-k all-reduces about ``2 d n``,
and TASC adds one score per block. A fair table fixes the bytes one device sends per step and
lets each method spend them as it likes. A *tier* is a ratio ``R``: the target is the dense
all-reduce's bytes over ``R`` (30x, 100x, 300x, 1000x below dense, :data:`TIERS`).

:func:`solve` reads each method's cost-model entry (:func:`compressors.registry.cost`, the same
byte rule as :func:`compressors.wire_bytes` applies to the compiled HLO) and searches what the
method declares as its budget (:attr:`compressors.registry.Method.budget`): a fraction in (0, 1]
(``density``), a count (PowerSGD's ``rank``), or a method's own search (TASC chooses its block
size and density). It returns the setting whose bytes come closest to the target, and says when
that is not within ``tolerance`` (a method whose bytes are fixed, or that cannot go that low:
PowerSGD sends the model's vectors uncompressed, TASC's block scores cost one number per block).
The bytes of the settings it picks are then checked against the compiled step
(``tests/test_equal_bytes.py``: within 10% at 8 and 32 workers).

A local-update method (DiLoCo) sends its exchange's bytes once every ``H`` steps, so its bytes
per step are the exchange's over ``H`` (Streaming DiLoCo too: each of its fragments sends once
every ``H`` steps, the whole model once a round), and a tier can be met by ``H``, by the
exchange's own setting, or by both (``H = 100`` with float32 is 100x; ``H = 10`` with TASC at 10x is too). The
rule: an exchange whose bytes are fixed (dense, fp16, int8) meets the tier through ``H``; one
with a budget (top-k's density, TASC's) keeps the configured ``H`` and meets the tier through
its budget, at ``ratio / H``. Given the run's length, a run is charged the synchronisations it
completes, and ``H`` moves where a short run would otherwise miss the tier (``solve``'s ``steps``).
"""

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

from compressors import registry
from compressors.budget import fit_field
from compressors.network import topology as topology_lib

#: Tier name -> how many times fewer bytes than the dense all-reduce.
TIERS = {"30x": 30.0, "100x": 100.0, "300x": 300.0, "1000x": 1000.0}
TOLERANCE = 0.1


class Solution(NamedTuple):
  """A method's settings for a tier.

  Attributes:
    method: the registered method.
    settings: its settings, with the budget field set.
    bytes: bytes per device per step of one exchange, by the cost model.
    dense_bytes: the dense all-reduce's, likewise.
    target_bytes: ``dense_bytes / ratio``.
    feasible: whether ``bytes`` is within the tolerance of the target.
    note: why not, when not (''otherwise).
    exchange_settings: a local-update method's exchange's settings (None for others).
  """
  method: str
  settings: Any
  bytes: float
  dense_bytes: float
  target_bytes: float
  feasible: bool
  note: str = ""
  exchange_settings: Any = None

  @property
  def ratio(self) -> float:
    """Dense bytes over this method's."""
    return self.dense_bytes / self.bytes


def topology(num_workers: int) -> topology_lib.Topology:
  """``num_workers`` on one link: bytes do not depend on the link's speed, only on the count."""
  if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 2:
    raise ValueError(f"equal_bytes: num_workers={num_workers!r}; allowed: an int >= 2")
  return topology_lib.Topology.flat(num_workers, topology_lib.CLOUD_10G)


def method_bytes(method: str, shapes: Sequence[tuple[int, ...]], num_workers: int,
                 settings: Any = None, exchange_settings: Any = None) -> float:
  """Bytes one device sends per step with ``method`` (cost model, the ``psum`` schedule); a
  local-update method's exchange's bytes over its ``H`` (``every``)."""
  sent = registry.cost(method, shapes, topology(num_workers), settings,
                       exchange_settings=exchange_settings).bytes_sent
  every = registry.steps_per_exchange(method, settings)
  return sent / every if every != 1 else sent


def solve(method: str, shapes: Sequence[tuple[int, ...]], num_workers: int, ratio: float,
          settings: Any = None, *, tolerance: float = TOLERANCE,
          exchange_settings: Any = None, steps: int | None = None) -> Solution:
  """The settings of ``method`` whose bytes per step come closest to dense's over ``ratio``.

  Args:
    method: a registered method.
    shapes: the shapes of the gradient's leaves (the model's parameters).
    num_workers: workers exchanging (bytes per device depend on it, through ``p - 1`` terms).
    ratio: the tier, dense bytes over the target (> 1); a name of :data:`TIERS` works too.
    settings: the method's other settings (default: its defaults); the budget field is replaced.
    tolerance: how far from the target, relatively, still counts as on the tier.
    exchange_settings: a local-update method's exchange's settings (default: its defaults).
    steps: the run's length, or None. A local-update method whose ``H`` meets the tier runs
      only the synchronisations that fall inside the run (``steps // H`` of DiLoCo's), so a short
      run can miss the tier that ``H`` meets per step (1,000 steps at ``H = 258``: 3
      synchronisations, 1,293x for 1,000x). Given ``steps``, ``H`` stays the per-step solution
      while the run's total lands within ``tolerance`` of the target, and otherwise moves to the
      nearest ``H`` whose total is closest; ``bytes`` is then the run's mean per step.

  Returns:
    A :class:`Solution`; ``feasible`` False (with a ``note``) when no setting lands within the
    tolerance. A method without a budget (fixed bytes) is returned with its own settings.

  Raises:
    ValueError: an unknown method or tier, or a bad ratio or worker count.
  """
  ratio = TIERS.get(ratio, ratio)
  if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not ratio > 1:
    raise ValueError(f"equal_bytes.solve: ratio={ratio!r}; allowed: a number > 1 or one of "
                     f"{list(TIERS)}")
  entry = registry.get(method)
  settings = entry.settings() if settings is None else settings
  shapes = [tuple(s) for s in shapes]
  if entry.carrier is not None:
    return _solve_local(method, shapes, num_workers, ratio, settings, exchange_settings,
                        tolerance, steps)
  dense = method_bytes("dense", shapes, num_workers)
  target = dense / ratio
  cost = lambda s: method_bytes(method, shapes, num_workers, s)
  if entry.budget is None:
    chosen = settings
  elif callable(entry.budget):
    chosen = entry.budget(settings, shapes, cost, target)
  else:
    chosen = fit_field(settings, entry.budget, cost, target)
  if chosen is None:
    return Solution(method, settings, math.nan, dense, target, False,
                    f"no setting of {method} sends as few as {target:,.0f} bytes")
  sent = cost(chosen)
  off = sent / target - 1
  feasible = abs(off) <= tolerance
  note = "" if feasible else (
      f"{method}'s bytes are fixed: {dense / sent:.3g}x" if entry.budget is None else
      f"closest: {sent:,.0f} bytes ({dense / sent:.3g}x), {off:+.0%} from the target")
  return Solution(method, chosen, sent, dense, target, feasible, note)


def _solve_local(method, shapes, num_workers, ratio, settings, exchange_settings,
                 tolerance, steps) -> Solution:
  """:func:`solve` for a local-update method (see the module docstring)."""
  carrier = registry.get(method).carrier(settings)
  exchange = registry.get(carrier)
  exchange_settings = exchange.settings() if exchange_settings is None else exchange_settings
  dense = method_bytes("dense", shapes, num_workers)
  if exchange.budget is None:  # H meets the tier
    once = method_bytes(carrier, shapes, num_workers, exchange_settings)
    every = max(1, round(once * ratio / dense))
    try:  # a method may bound H by its other settings (Streaming DiLoCo: H >= its fragments)
      settings = registry.with_steps_per_exchange(method, settings, every)
      if steps is not None:
        settings = _every_for_run(method, settings, steps, once, dense / ratio, tolerance)
    except ValueError as refused:
      return Solution(method, settings, math.nan, dense, dense / ratio, False,
                      f"every={every} meets {ratio:g}x but is refused: {refused}",
                      exchange_settings)
    every = registry.steps_per_exchange(method, settings)
    rounds = None if steps is None else _rounds_in_run(method, settings, steps)
    if rounds == 0:
      return Solution(method, settings, math.nan, dense, dense / ratio, False,
                      f"a run of {steps} steps completes no synchronisation at "
                      f"every={every}; {ratio:g}x needs more steps", exchange_settings)
    per_step = once / every if rounds is None else once * rounds / steps
    solved = Solution(method, settings, per_step, dense, dense / ratio, True,
                      exchange_settings=exchange_settings)
  else:  # the exchange meets ratio / H
    every = registry.steps_per_exchange(method, settings)
    if ratio / every <= 1:
      return Solution(method, settings, math.nan, dense, dense / ratio, False,
                      f"every={every} alone is {every}x, beyond {ratio:g}x; lower it",
                      exchange_settings)
    inner = solve(carrier, shapes, num_workers, ratio / every, exchange_settings,
                  tolerance=tolerance)
    solved = Solution(method, settings, inner.bytes / every, dense, dense / ratio,
                      inner.feasible, inner.note, inner.settings)
  off = solved.bytes / solved.target_bytes - 1
  if abs(off) > tolerance:
    return solved._replace(feasible=False, note=solved.note or (
        f"closest: {dense / solved.bytes:.3g}x, {off:+.0%} from the target"))
  return solved


def _rounds_in_run(method: str, settings: Any, steps: int) -> int:
  """How many of ``method``'s rounds (``H`` steps each) the steps ``0, ..., steps - 1`` complete:
  DiLoCo's synchronisations (each ``H``-th step); Streaming DiLoCo's fragments each send once a
  round, at their own phase, so its count is within one round of this."""
  return steps // registry.steps_per_exchange(method, settings)


def _every_for_run(method: str, settings: Any, steps: int, once: float, target: float,
                   tolerance: float) -> Any:
  """``settings`` with the ``every`` whose run of ``steps`` sends closest to ``target`` bytes a
  step (``once`` a round) in at least one round, keeping the given one while it is within
  ``tolerance``."""
  def off(candidate) -> float:
    return abs(once * _rounds_in_run(method, candidate, steps) / steps / target - 1)

  if steps < 1 or off(settings) <= tolerance:  # off() divides by the steps
    return settings
  given = registry.steps_per_exchange(method, settings)
  candidates = []
  for every in range(1, steps + 1):
    try:
      candidate = registry.with_steps_per_exchange(method, settings, every)
    except ValueError:  # below the method's own bound on H
      continue
    if _rounds_in_run(method, candidate, steps) == 0:
      continue
    candidates.append((off(candidate), abs(every - given), candidate))
  return min(candidates, key=lambda c: c[:2])[2] if candidates else settings
