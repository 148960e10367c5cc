"""The embedding planner: where each table lives and which rows are hot, for the most modelled
throughput within a memory budget (SCARS, FlexShard).

Inputs (:class:`Workload`, :func:`choose`): the tables' rows and width, the IDs a row of the
batch looks up per table (hotness), a device's batch, each table's access probabilities (a
measured sample: :func:`probabilities_from_sample`, or a declared law), the parameters
all-reduced besides the tables (the dense part), the memory budget of a device for the tables
and what their exchanges keep beside them (:meth:`Workload.held`), the link of each mesh axis
(a :class:`compressors.network.topology.Topology`) and the compute time of a step.

The model (:func:`predict`), per device and step:

* bytes: the embedding exchange's forward and backward passes
  (:func:`compressors.parallel.embeddings.exchange_bytes` at the planned capacity), the hot-row
  all-reduce (:meth:`compressors.parallel.hot_rows.HotRows.all_reduce_bytes`, or the cost
  model's price of the per-step method that exchanges it: :attr:`Workload.hot_exchange`) and
  the dense all-reduce (the dense parameters and the replicated tables), each charged as
  :mod:`compressors.parallel.hlo_bytes` charges the compiled program's collectives, so the
  predicted bytes are the compiled program's (tests/test_hot_rows.py);
* seconds: the project's alpha-beta model (:func:`compressors.network.topology.steps_cost`):
  each all-to-all or all-gather of the exchange as ``n - 1`` pairwise shifts, each all-reduce
  as XLA's (``psum``, priced as a ring);
* the step: the compute, plus the exchange's all-to-alls (on the critical path: the forward
  pass needs the rows, the update the cold rows' gradients), plus what of the all-reduces does
  not hide behind the backward pass (:data:`compressors.step_time.BACKWARD_SHARE` of the
  compute, as data parallelism overlaps its gradient buckets). The hot rows' gradient is ready
  once the tower's backward pass has reached the embeddings, before the bottom MLP's: counting
  it hidden like the dense buckets is this model's assumption, stated here.

The expected distinct keys of a device's batch (:func:`compressors.parallel.embeddings.
expected_unique`, less the hot rows') size the capacity (:func:`capacity`): the busiest owner's
expected count ``mu`` times ``max(1.5, 1 + 4 / sqrt(mu))``, so that a small count keeps four
standard deviations of room (a count of independent rare events varies by about ``sqrt(mu)``).

The search (:func:`choose`): placements by coordinate descent from every table row-placed (each
table in turn tries the other placements, kept where the modelled step is faster and the
tables fit the budget, until a pass changes nothing), then the hot rows: every row of the
fetched tables ranked by the probability that a device's batch looks it up, the number of them
chosen (from a grid of 200 counts) for the fastest modelled step within the budget.
:meth:`Choice.report` says what it chose and why, with the predicted bytes and seconds per
collective per step.
"""

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence

import numpy as np

from compressors import step_time
from compressors.network import collectives
from compressors.network import topology as topo
from compressors.parallel import embeddings
from compressors.parallel import hot_rows

COLLECTIVES = ("embedding_forward", "embedding_backward", "hot_rows_all_reduce",
               "dense_all_reduce")
MARGIN, SIGMAS = 1.5, 4.0  # the capacity's room: a share, and standard deviations
HOT_COUNTS = 200  # hot-row counts tried


@dataclasses.dataclass(frozen=True)
class Workload:
  """What the tables serve per step.

  Attributes:
    rows: rows per table.
    width: the tables' width.
    hotness: IDs per table of a row of the batch.
    batch: rows of a device's batch.
    probabilities: per table, each ID's probability of a lookup (summing to 1).
    dense_params: parameters all-reduced besides the tables (the tower's).
    itemsize: bytes of a table's element.
    payload_bytes: ``(direction, rows, width) -> bytes`` of one bucket of the rows' all-to-alls
      as their codecs encode them (:func:`compressors.embedding_codecs.payload_bytes`); None:
      ``itemsize`` an element.
    hot_exchange: ``(shape, topology) -> Cost`` of one exchange of the hot bank's gradient
      ``[hot rows, width]`` by the per-step method that runs it
      (:func:`compressors.registry.cost`); None: a float32 ``psum``.
    residual_bytes: ``plan -> bytes`` of one device's error-feedback residuals of the rows'
      all-to-alls (:func:`compressors.embedding_codecs.residual_bytes_per_device`); None: none.
    hot_state_bytes: ``shape -> bytes`` of one device's state of the method that exchanges
      the hot bank's gradient ``[hot rows, width]`` (its error-feedback residual among them);
      None: none.
  """
  rows: tuple[int, ...]
  width: int
  hotness: tuple[int, ...]
  batch: int
  probabilities: tuple[np.ndarray, ...]
  dense_params: int = 0
  itemsize: int = 4
  payload_bytes: Callable[[str, int, int], int] | None = None
  hot_exchange: Callable[[tuple[int, int], topo.Topology], topo.Cost] | None = None
  residual_bytes: Callable[[embeddings.Plan], int] | None = None
  hot_state_bytes: Callable[[tuple[int, int]], int] | None = None

  def held(self, p: embeddings.Plan, hot: hot_rows.HotRows) -> int:
    """Bytes of a device that the memory budget bounds: the tables as ``p`` lays them out, the
    hot bank, and the memories of their exchanges (the rows' error-feedback residuals, the hot
    exchange's state). The tables' optimizer state is not among them: it scales the tables by
    the optimizer's factor whatever the placement (the run's ``max_state_bytes_per_device``
    bounds everything)."""
    return p.bytes_per_device(self.itemsize) + self.residual(p) + self.hot_held(p, hot)

  def residual(self, p: embeddings.Plan) -> int:
    """Bytes of a device's error-feedback residuals of the rows' all-to-alls."""
    return self.residual_bytes(p) if self.residual_bytes else 0

  def hot_held(self, p: embeddings.Plan, hot: hot_rows.HotRows) -> int:
    """Bytes of a device's hot bank and its exchange's state."""
    state = (self.hot_state_bytes((hot.total, p.width))
             if self.hot_state_bytes and hot.total else 0)
    return hot.bytes_per_device(p.width, self.itemsize) + state

  @functools.cached_property
  def presence(self) -> tuple[np.ndarray, ...]:
    """Per table, each row's probability to be among a device's batch's lookups: their sum is
    :func:`embeddings.expected_unique`."""
    out = []
    for p, h in zip(self.probabilities, self.hotness):
      p = np.minimum(np.asarray(p, np.float64), 1 - 1e-16)
      out.append(-np.expm1(self.batch * h * np.log1p(-p)))
    return tuple(out)


def probabilities_from_sample(ids: np.ndarray, rows: int) -> np.ndarray:
  """A table's access probabilities estimated from a sample of its IDs: each seen ID's share,
  and the Good-Turing estimate of the unseen IDs' mass (the share of IDs seen once) spread
  evenly over them, so that a sample does not make the rare rows impossible."""
  counts = np.bincount(np.asarray(ids).reshape(-1), minlength=rows).astype(np.float64)
  total, unseen = counts.sum(), int(np.sum(counts == 0))
  if not total:
    return np.full(rows, 1.0 / rows)
  mass = np.sum(counts == 1) / total if unseen else 0.0
  return np.where(counts > 0, counts / total * (1 - mass), mass / max(unseen, 1))


def capacity(w: Workload, p: embeddings.Plan, hot: hot_rows.HotRows) -> int:
  """Keys per bucket of the exchange for ``w``'s batch: the expected distinct cold keys of the
  fetched tables that the busiest owner holds, or the column-placed tables' per device, with
  room (see the module docstring); at most the lookups, at least 1. Per owner, not the mean
  over owners: a table placed whole puts all its keys in one owner's bucket."""
  def room(mu):
    margin = max(MARGIN, 1 + SIGMAS / math.sqrt(mu)) if mu > 0 else MARGIN
    return embeddings.capacity_from_skew(mu, 1, margin)
  columns = sum(w.presence[t].sum() for t in p.tables("column"))
  lookups = w.batch * max(sum(w.hotness[t] for t in p.fetched),
                          sum(w.hotness[t] for t in p.tables("column")))
  return max(1, min(max(room(_cold_per_owner(w, p, hot).max()) if p.fetched else 0,
                        room(columns) if p.tables("column") else 0), lookups))


def _cold_per_owner(w: Workload, p: embeddings.Plan, hot: hot_rows.HotRows) -> np.ndarray:
  """Per owner of the bank, the expected distinct keys of the fetched tables' cold rows that a
  device's batch asks of it."""
  per_owner = np.zeros(p.devices)
  for t in p.fetched:
    presence = w.presence[t].copy()
    presence[list(hot.ids[t])] = 0.0
    owner, _ = embeddings.bank_address(p, t, np.arange(p.rows[t]))
    per_owner += np.bincount(owner, weights=presence, minlength=p.devices)
  return per_owner


@dataclasses.dataclass(frozen=True)
class Prediction:
  """The model's figures per device and step: ``bytes`` and ``seconds`` per collective (keys
  :data:`COLLECTIVES`), the ``compute``, the ``step`` (modelled wall-clock) and the
  ``memory`` the budget bounds (bytes of a device, :meth:`Workload.held`)."""
  bytes: dict
  seconds: dict
  compute: float
  step: float
  memory: int


def _shift_seconds(topology: topo.Topology, operations: int, sent: float) -> float:
  """``operations`` all-to-alls (or all-gathers) that send ``sent`` bytes a device together,
  each ``n - 1`` pairwise shifts."""
  n = topology.num_devices
  if not operations or n < 2:
    return 0.0
  chunk = sent / (operations * (n - 1))
  steps = [collectives.Step(tuple((i, (i + s) % n) for i in range(n)), chunk)
           for s in range(1, n)]
  return operations * topo.steps_cost(steps, topology).time  # the operations are alike


def _all_reduce_seconds(topology: topo.Topology, elements: int, itemsize: int) -> float:
  if not elements or topology.num_devices < 2:
    return 0.0
  return topo.all_reduce_cost("psum", topology, elements, itemsize).time


def _hot_exchange(w: Workload, topology: topo.Topology, p: embeddings.Plan,
                  hot: hot_rows.HotRows) -> topo.Cost:
  """The hot bank's gradient exchange: a float32 ``psum``, or :attr:`Workload.hot_exchange`."""
  if not hot.total or topology.num_devices < 2:
    return topo.Cost(0.0, 0.0)
  if w.hot_exchange is None:
    return topo.Cost(_all_reduce_seconds(topology, hot.total * p.width, w.itemsize),
                     hot.all_reduce_bytes(p, w.itemsize))
  return w.hot_exchange((hot.total, p.width), topology)


def predict(w: Workload, topology: topo.Topology, p: embeddings.Plan, hot: hot_rows.HotRows,
            capacity_: int | None, compute_seconds: float) -> Prediction:
  """The bytes and seconds of each collective and the modelled step (module docstring)."""
  n, size = p.devices, w.itemsize
  exchange = embeddings.exchange_bytes(p, w.batch, w.hotness, capacity_, size, w.payload_bytes)
  replicated = sum(p.rows[t] for t in p.tables("replicated")) * p.width
  hot_exchange = _hot_exchange(w, topology, p, hot)
  sent = {"embedding_forward": exchange["forward"], "embedding_backward": exchange["backward"],
          "hot_rows_all_reduce": hot_exchange.bytes_sent,
          "dense_all_reduce": 2 * (n - 1) / n * (w.dense_params + replicated) * size}
  # Collectives of the exchange: keys then rows (or bags) forward, one of gradients backward.
  kinds = int(bool(p.fetched)) + int(bool(p.tables("column"))) + int(bool(p.reduce_scattered))
  seconds = {"embedding_forward": _shift_seconds(topology, 2 * kinds, sent["embedding_forward"]),
             "embedding_backward": _shift_seconds(topology, kinds, sent["embedding_backward"]),
             "hot_rows_all_reduce": hot_exchange.time,
             "dense_all_reduce": _all_reduce_seconds(topology, w.dense_params + replicated, size)}
  hidden = step_time.BACKWARD_SHARE * compute_seconds
  exposed = max(0.0, seconds["hot_rows_all_reduce"] + seconds["dense_all_reduce"] - hidden)
  step = (compute_seconds + seconds["embedding_forward"] + seconds["embedding_backward"]
          + exposed)
  return Prediction(sent, seconds, compute_seconds, step, w.held(p, hot))


@dataclasses.dataclass(frozen=True)
class Choice:
  """What :func:`choose` chose: the plan, the hot rows, the capacity, the prediction and why."""
  plan: embeddings.Plan
  hot: hot_rows.HotRows
  capacity: int
  prediction: Prediction
  budget_bytes: float
  why: str

  def report(self) -> str:
    """What was chosen and why, with the predicted bytes and seconds per collective per step."""
    p, f = self.plan, self.prediction
    placed = "; ".join(f"{name} {p.tables(name)}" for name in embeddings.PLACEMENTS
                       if p.tables(name))
    hot = {t: c for t, c in enumerate(self.hot.counts) if c}
    lines = [f"embedding planner: {len(p.rows)} tables on {p.devices} devices: {placed}",
             f"  hot rows: {self.hot.total} ({hot}): {self.why}",
             f"  capacity: {self.capacity} keys per bucket; memory {f.memory:,} bytes of a "
             f"device (budget {self.budget_bytes:,.0f})",
             f"  {'collective':<22}{'bytes/step/device':>20}{'seconds/step':>14}"]
    lines += [f"  {name:<22}{f.bytes[name]:>20,.0f}{f.seconds[name]:>14.3g}"
              for name in COLLECTIVES]
    lines.append(f"  step {f.step:.4g} s modelled (compute {f.compute:.4g} s): "
                 f"{1 / f.step:.4g} steps/s")
    return "\n".join(lines)


def _fits(w: Workload, p: embeddings.Plan, hot: hot_rows.HotRows, budget: float) -> bool:
  if math.isinf(budget):
    return True
  try:
    _check_budget(w, p, hot, budget)
  except ValueError:
    return False
  return True


def _check_budget(w: Workload, p: embeddings.Plan, hot: hot_rows.HotRows, budget: float) -> None:
  """:func:`embeddings.check_budget` of what :meth:`Workload.held` counts: the hot bank and the
  hot exchange's state taken off the budget, the rows' residuals charged beside the tables."""
  embeddings.check_budget(p, int(budget) - w.hot_held(p, hot), w.itemsize, w.residual(p))


def _placements(w: Workload, topology: topo.Topology, budget: float, compute: float,
                row_reduction: str, options: Sequence[str]) -> tuple[str, ...]:
  """Coordinate descent over the tables' placements among ``options`` (module docstring),
  without hot rows."""
  def seconds(placements):
    p = embeddings.plan(w.rows, w.width, placements, topology.num_devices, row_reduction)
    none = hot_rows.none(p)
    if not _fits(w, p, none, budget):
      return math.inf
    return predict(w, topology, p, none, capacity(w, p, none), compute).step
  current = ["row"] * len(w.rows)
  best, changed = seconds(current), True
  while changed:
    changed = False
    for t in range(len(w.rows)):
      for option in options:
        trial = current[:t] + [option] + current[t + 1:]
        if option != current[t] and (time := seconds(trial)) < best:
          best, current, changed = time, trial, True
  if math.isinf(best):
    raise ValueError(f"the embedding tables ({sum(w.rows):,} rows of width {w.width}) fit no "
                     f"placement within the budget of {budget:,.0f} bytes of a device; allowed: "
                     "a larger embedding.budget_bytes, or more devices")
  return tuple(current)


def _hot_of(p: embeddings.Plan, ranked: tuple[np.ndarray, np.ndarray],
            count: int) -> hot_rows.HotRows:
  """The first ``count`` of ``ranked`` (tables, IDs) as hot rows."""
  tables, ids = ranked[0][:count], ranked[1][:count]
  return hot_rows.hot_rows(p, [ids[tables == t] for t in range(len(p.rows))])


def _hot(w: Workload, topology: topo.Topology, p: embeddings.Plan, budget: float,
         compute: float) -> tuple[hot_rows.HotRows, str]:
  """The hot rows of the fastest modelled step within the budget, and why that many."""
  if not p.fetched:
    return hot_rows.none(p), "no table is fetched by the all-to-all"
  tables = np.concatenate([np.full(p.rows[t], t) for t in p.fetched])
  ids = np.concatenate([np.arange(p.rows[t]) for t in p.fetched])
  presence = np.concatenate([w.presence[t] for t in p.fetched])
  order = np.argsort(-presence, kind="stable")
  ranked = (tables[order], ids[order])
  room = budget - w.held(p, hot_rows.none(p))
  most = len(order) if math.isinf(room) else min(len(order),
                                                 max(0, int(room // (w.width * w.itemsize))))
  # The hot exchange's state grows with the hot bank too: the most that fit with it, bisected.
  least = 0
  while least < most:
    middle = (least + most + 1) // 2
    if _fits(w, p, _hot_of(p, ranked, middle), budget):
      least = middle
    else:
      most = middle - 1
  counts = sorted({0, most, *np.geomspace(1, max(most, 1), HOT_COUNTS).astype(int).tolist()})
  counts = [c for c in counts if c <= most]
  best, chosen = math.inf, 0
  for count in counts:
    hot = _hot_of(p, ranked, count)
    step = predict(w, topology, p, hot, capacity(w, p, hot), compute).step
    if step < best:
      best, chosen = step, count
  last = presence[order[chosen - 1]] if chosen else 1.0
  why = (f"the rows a device's batch looks up with probability >= {last:.3g}; "
         + ("more do not fit the memory budget" if chosen == most < len(order) else
            "every row of the fetched tables" if chosen == len(order) else
            "more would add more to the all-reduces than they take off the all-to-all"))
  return _hot_of(p, ranked, chosen), why


def choose(w: Workload, topology: topo.Topology, budget_bytes: float, compute_seconds: float,
           placements: Sequence[str] | None = None, hot_counts: Sequence[int] | None = None,
           row_reduction: str = "all_to_all") -> Choice:
  """The placements and hot rows of the most modelled throughput within ``budget_bytes`` (0 or
  inf: no budget) of a device, on ``topology``'s devices.

  Args:
    w: the workload.
    topology: the devices the tables are placed on, a link per mesh axis.
    budget_bytes: bytes of a device for the tables, the hot bank and their exchanges' memories
      (:meth:`Workload.held`).
    compute_seconds: the compute time of a step.
    placements: the tables' placements (None: chosen).
    hot_counts: hot rows per table, its most probable ones, on fetched tables (None: chosen).
    row_reduction: as :func:`embeddings.plan`'s.

  Raises:
    ValueError: in one line, no placement fits the budget, or the given ones do not.
  """
  budget = math.inf if not budget_bytes else float(budget_bytes)
  if placements is not None:
    return _chosen(w, topology, budget, compute_seconds, placements, hot_counts, row_reduction)
  # Whole tables replicated first may leave no room for the hotter rows of others: the descent
  # without replicated tables (hot rows then replicate what pays) is a candidate too.
  candidates = [_chosen(w, topology, budget, compute_seconds,
                        _placements(w, topology, budget, compute_seconds, row_reduction, options),
                        hot_counts, row_reduction)
                for options in (embeddings.PLACEMENTS,
                                tuple(x for x in embeddings.PLACEMENTS if x != "replicated"))]
  return min(candidates, key=lambda c: c.prediction.step)


def _chosen(w: Workload, topology: topo.Topology, budget: float, compute: float,
            placements: Sequence[str], hot_counts: Sequence[int] | None,
            row_reduction: str) -> Choice:
  """:func:`choose` with the placements given."""
  p = embeddings.plan(w.rows, w.width, placements, topology.num_devices, row_reduction)
  if hot_counts is None:
    hot, why = _hot(w, topology, p, budget, compute)
  else:
    counts = [min(c, p.rows[t]) if t in p.fetched else 0 for t, c in enumerate(hot_counts)]
    hot = hot_rows.hot_rows(p, hot_rows.hottest(w.presence, counts))
    why = "as given"
  if not math.isinf(budget):
    _check_budget(w, p, hot, budget)
  cap = capacity(w, p, hot)
  return Choice(p, hot, cap, predict(w, topology, p, hot, cap, compute), budget, why)
