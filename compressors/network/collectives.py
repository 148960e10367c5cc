"""Explicit all-reduce schedules built from ``jax.lax.ppermute``, unrolled step by step.

Every schedule here runs inside ``shard_map``/``pmap`` where ``axis_name`` is bound. The Python
loops are unrolled at trace time, so the compiled HLO holds one ``collective-permute`` per step
and no while loop; what moves on the wire can be read straight off the program
(:func:`compressors.wire_bytes`) and matches the step lists of :func:`schedule`, which the cost
model (:mod:`compressors.network.topology`) prices.

Algorithms (Thakur, Rabenseifner & Gropp, "Optimization of collective communication operations
in MPICH", IJHPCA 2005; p workers, n elements):

``ring``
  Reduce-scatter then all-gather around the ring, ``p-1`` steps each, chunks of ``n/p`` (the
  vector is zero-padded to a multiple of ``p``, so any ``p`` works).
``butterfly``
  Recursive doubling: ``lg p`` exchanges of the whole vector with partner ``rank XOR d``.
``rabenseifner``
  Recursive-halving reduce-scatter then recursive-doubling all-gather. Halving starts at
  distance 1, so the largest messages travel between ranks that differ in the lowest bit (the
  same node when ranks are numbered node-major); the all-gather mirrors it.
``hierarchical``
  Over two mesh axes ``(slow, fast)`` in mesh order (e.g. ``("node", "gpu")``): ring
  reduce-scatter on the fast axis, ring all-reduce of the ``n/g`` chunk on the slow axis, ring
  all-gather on the fast axis.
``sparse_butterfly_all_reduce``
  SparCML's sparse recursive doubling (Renggli et al., SC'19): workers exchange and merge
  (index, value) sets; the set's static capacity doubles every step, and once that capacity
  passes ``switch_density`` of the dense size the schedule switches to dense recursive doubling.

Non-power-of-two ``p`` (butterfly, Rabenseifner, sparse butterfly) uses the standard fold-in:
with ``q = 2**floor(lg p)``, ranks ``q+i`` first send their vector to rank ``i``, the ``q`` low
ranks run the power-of-two algorithm, and rank ``i`` finally sends the result back to ``q+i``.

Replicas end bit-identical: every chunk is reduced at exactly one worker and then only copied
(ring, Rabenseifner, hierarchical), and where both partners reduce the same pair of vectors
(butterfly) both compute ``lower-rank value + higher-rank value``.
"""

import math
from collections.abc import Callable, Hashable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from compressors.network import axes

INDEX_DTYPE = jnp.int32

Pairs = tuple[tuple[int, int], ...]


class Step(NamedTuple):
  """One communication step of a schedule, as the cost model sees it.

  Attributes:
    pairs: (source, target) pairs in linear ranks over the whole group (row-major over the
      axes, like ``jax.lax.axis_index`` of the axis tuple); all pairs run concurrently.
    send_bytes: bytes each source sends in this step.
    reduce_bytes: bytes each target adds into its own data after receiving (0 for copies).
  """
  pairs: Pairs
  send_bytes: float
  reduce_bytes: float = 0.0


class Schedule(NamedTuple):
  """One all-reduce algorithm: how it runs, what the cost model prices, where it applies.

  :data:`SCHEDULES` is the one table that :func:`compressors.compress` runs payloads with,
  :mod:`compressors.network.topology` prices and :mod:`compressors.network.planner` chooses from, so
  the planner never proposes an algorithm ``compress`` cannot run.

  Attributes:
    name: the key in :data:`SCHEDULES`.
    run: ``(flat, axis_name) -> sum`` of a 1-D array over the workers.
    steps: ``(axis sizes, elements, itemsize) -> tuple[Step]``, the steps ``run`` performs.
    num_axes: the mesh axes it needs (``"hierarchical"``: 2, slow then fast); None: any.
  """
  name: str
  run: Callable[[jax.Array, axes.AxisName], jax.Array]
  steps: Callable[[Sequence[int], int, int], tuple[Step, ...]]
  num_axes: int | None = None

  def fits(self, num_axes: int) -> bool:
    """Whether the schedule runs over ``num_axes`` mesh (or topology) axes."""
    return self.num_axes is None or self.num_axes == num_axes

  def check(self, num_axes: int, axis_name: axes.AxisName, caller: str) -> None:
    """Raises ValueError, naming ``axis_name``, when the schedule cannot run over it."""
    if not self.fits(num_axes):
      raise ValueError(f"{caller}: schedule={self.name!r} needs {self.num_axes} mesh axes "
                       f"(axis_name=(slow_axis, fast_axis)); got axis_name={axis_name!r}")


def check_schedule(schedule: str) -> Schedule:
  """The :class:`Schedule` named ``schedule``; ValueError naming the allowed ones otherwise."""
  if not isinstance(schedule, str) or schedule not in SCHEDULES:
    raise ValueError(f"all_reduce: schedule={schedule!r} is unknown; allowed: "
                     f"{tuple(SCHEDULES)}")
  return SCHEDULES[schedule]


def all_reduce(x: jax.Array, axis_name: axes.AxisName, schedule: str = "psum") -> jax.Array:
  """Sums ``x`` over the workers along ``axis_name`` with the named schedule.

  Args:
    x: any float or integer array (flattened and padded internally; the shape is restored).
    axis_name: a bound mesh axis or tuple of axes (ranks row-major over the tuple). The
      ``"hierarchical"`` schedule needs exactly two: ``(slow_axis, fast_axis)``.
    schedule: a name of :data:`SCHEDULES`; ``"psum"`` is XLA's own all-reduce.

  Returns:
    The sum over workers, shaped like ``x`` and bit-identical on every worker. Except for
    ``"psum"``, JAX types it as varying across the axis (it comes out of ``ppermute``), so a
    ``shard_map`` that returns it with a replicated out_spec (``P()``) needs
    ``check_vma=False``.

  Raises:
    ValueError: unknown schedule, or ``"hierarchical"`` without two axes.
  """
  chosen = check_schedule(schedule)
  chosen.check(len(axes.as_tuple(axis_name)), axis_name, "all_reduce")
  if schedule == "psum":
    return jax.lax.psum(x, axis_name)
  x = jnp.asarray(x)
  if x.size == 0:
    return x
  return chosen.run(x.reshape(-1), axis_name).reshape(x.shape)


# ----------------------------------------------------------------------------- pair patterns


def ring_pairs(p: int) -> Pairs:
  """Each rank sends to its successor on the ring."""
  return tuple((i, (i + 1) % p) for i in range(p))


def xor_pairs(q: int, distance: int) -> Pairs:
  """Each of the ranks ``0..q-1`` exchanges with ``rank XOR distance``."""
  return tuple((i, i ^ distance) for i in range(q))


def fold_in_pairs(p: int) -> Pairs:
  """Ranks above the largest power of two ``q <= p`` send to ``rank - q``."""
  q = _pow2_floor(p)
  return tuple((q + i, i) for i in range(p - q))


def fold_out_pairs(p: int) -> Pairs:
  """Ranks ``i < p - q`` return the result to ``q + i``."""
  return tuple((t, s) for s, t in fold_in_pairs(p))


def _pow2_floor(p: int) -> int:
  return 1 << (p.bit_length() - 1)


def _distances(q: int) -> list[int]:
  return [1 << j for j in range(q.bit_length() - 1)]


def _group_pairs(sizes: Sequence[int], axis: int, pairs: Pairs) -> Pairs:
  """Lifts ``pairs`` along one axis of a row-major grid to linear ranks over the whole grid."""
  grid = np.arange(math.prod(sizes)).reshape(sizes)
  lines = np.moveaxis(grid, axis, -1).reshape(-1, sizes[axis])
  return tuple((int(line[s]), int(line[t])) for line in lines for s, t in pairs)


# ----------------------------------------------------------------------------- dense schedules


def _pad_rows(flat: jax.Array, rows: int) -> jax.Array:
  """Zero-pads a 1-D array to a multiple of ``rows`` and reshapes it to ``(rows, -1)``."""
  cols = -(-flat.size // rows)
  return jnp.pad(flat, (0, rows * cols - flat.size)).reshape(rows, cols)


def _lower_plus_higher(mine: jax.Array, theirs: jax.Array, i_am_higher: jax.Array) -> jax.Array:
  """``lower-rank value + higher-rank value``, so both partners compute the same bits."""
  return jnp.where(i_am_higher, theirs + mine, mine + theirs)


def ring_reduce_scatter(rows: jax.Array, axis_name: axes.AxisName) -> jax.Array:
  """Ring reduce-scatter of ``rows`` (``p`` chunks); worker ``r`` returns chunk ``(r+1) % p``.

  Chunk ``c`` is accumulated once, along ``c, c+1, ..., c-1``, so its bits do not depend on
  which worker later copies it.
  """
  p = axes.num_workers(axis_name, caller="ring_reduce_scatter")
  rank = axes.worker_index(axis_name)
  acc = jax.lax.dynamic_index_in_dim(rows, rank, keepdims=False)
  for s in range(p - 1):
    received = axes.ppermute(acc, axis_name, ring_pairs(p))
    own = jax.lax.dynamic_index_in_dim(rows, (rank - s - 1) % p, keepdims=False)
    acc = received + own
  return acc


def ring_all_gather(chunk: jax.Array, axis_name: axes.AxisName) -> jax.Array:
  """Inverse of :func:`ring_reduce_scatter`: worker ``r`` holds chunk ``(r+1) % p``; returns
  all ``p`` chunks stacked in order."""
  p = axes.num_workers(axis_name, caller="ring_all_gather")
  rank = axes.worker_index(axis_name)
  rows = jnp.zeros((p,) + chunk.shape, chunk.dtype)
  rows = jax.lax.dynamic_update_index_in_dim(rows, chunk, (rank + 1) % p, 0)
  for s in range(p - 1):
    chunk = axes.ppermute(chunk, axis_name, ring_pairs(p))
    rows = jax.lax.dynamic_update_index_in_dim(rows, chunk, (rank - s) % p, 0)
  return rows


def ring_all_reduce(flat: jax.Array, axis_name: axes.AxisName) -> jax.Array:
  """Ring all-reduce of a 1-D array (reduce-scatter + all-gather, ``p-1`` steps each)."""
  p = axes.num_workers(axis_name, caller="ring_all_reduce")
  if p == 1:
    return flat
  rows = ring_all_gather(ring_reduce_scatter(_pad_rows(flat, p), axis_name), axis_name)
  return rows.reshape(-1)[:flat.size]


def _fold_in(x: jax.Array, axis_name: axes.AxisName, p: int, rank: jax.Array) -> jax.Array:
  if p == _pow2_floor(p):
    return x
  received = axes.ppermute(x, axis_name, fold_in_pairs(p))
  return jnp.where(rank < p - _pow2_floor(p), x + received, x)


def _fold_out(x: jax.Array, axis_name: axes.AxisName, p: int, rank: jax.Array) -> jax.Array:
  if p == _pow2_floor(p):
    return x
  received = axes.ppermute(x, axis_name, fold_out_pairs(p))
  return jnp.where(rank >= _pow2_floor(p), received, x)


def butterfly_all_reduce(flat: jax.Array, axis_name: axes.AxisName) -> jax.Array:
  """Recursive-doubling all-reduce of a 1-D array (fold-in for non-power-of-two ``p``)."""
  p = axes.num_workers(axis_name, caller="butterfly_all_reduce")
  rank = axes.worker_index(axis_name)
  q = _pow2_floor(p)
  x = _fold_in(flat, axis_name, p, rank)
  for d in _distances(q):
    received = axes.ppermute(x, axis_name, xor_pairs(q, d))
    x = _lower_plus_higher(x, received, (rank & d) != 0)
  return _fold_out(x, axis_name, p, rank)


def rabenseifner_all_reduce(flat: jax.Array, axis_name: axes.AxisName) -> jax.Array:
  """Recursive-halving reduce-scatter + recursive-doubling all-gather of a 1-D array."""
  p = axes.num_workers(axis_name, caller="rabenseifner_all_reduce")
  rank = axes.worker_index(axis_name)
  q = _pow2_floor(p)
  segment = _fold_in(_pad_rows(flat, q), axis_name, p, rank)
  for d in _distances(q):  # halving: keep the half named by this rank's bit d, send the other
    half = segment.shape[0] // 2
    upper = (rank & d) != 0
    keep = jax.lax.dynamic_slice_in_dim(segment, jnp.where(upper, half, 0), half)
    send = jax.lax.dynamic_slice_in_dim(segment, jnp.where(upper, 0, half), half)
    received = axes.ppermute(send, axis_name, xor_pairs(q, d))
    segment = _lower_plus_higher(keep, received, upper)
  for d in reversed(_distances(q)):  # doubling: undo the halving steps in reverse order
    received = axes.ppermute(segment, axis_name, xor_pairs(q, d))
    upper = (rank & d) != 0
    segment = jnp.where(upper, jnp.concatenate([received, segment]),
                        jnp.concatenate([segment, received]))
  return _fold_out(segment, axis_name, p, rank).reshape(-1)[:flat.size]


def hierarchical_all_reduce(flat: jax.Array, slow_axis: Hashable,
                            fast_axis: Hashable) -> jax.Array:
  """Two-level all-reduce: ring reduce-scatter on ``fast_axis``, ring all-reduce of the chunk
  on ``slow_axis``, ring all-gather on ``fast_axis``."""
  g = axes.num_workers(fast_axis, caller="hierarchical_all_reduce")
  if g == 1:
    return ring_all_reduce(flat, slow_axis)
  chunk = ring_reduce_scatter(_pad_rows(flat, g), fast_axis)
  chunk = ring_all_reduce(chunk, slow_axis)
  return ring_all_gather(chunk, fast_axis).reshape(-1)[:flat.size]


# ----------------------------------------------------------------------------- sparse butterfly


class SparsePhase(NamedTuple):
  """One exchange of the sparse butterfly, fixed at trace time.

  Attributes:
    kind: ``"fold_in"``, ``"exchange"`` (a butterfly step) or ``"fold_out"``.
    pairs: (source, target) pairs of the step.
    capacity: entries of the (index, value) set sent, or None where the vector is sent dense.
    distance: the butterfly distance of an ``"exchange"`` (0 for the folds).
  """
  kind: str
  pairs: Pairs
  capacity: int | None
  distance: int = 0


def default_switch_density(itemsize: int) -> float:
  """Fill-in at which an (int32 index, value) set is as large as the dense vector."""
  return itemsize / (np.dtype(INDEX_DTYPE).itemsize + itemsize)


def sparse_butterfly_phases(p: int, size: int, k: int,
                            switch_density: float) -> tuple[SparsePhase, ...]:
  """The static exchange sequence of :func:`sparse_butterfly_all_reduce`.

  The set's capacity starts at ``k`` and doubles at each merge (the worst-case union, so no
  entry is ever dropped); before an exchange whose capacity exceeds ``switch_density * size``,
  the vector turns dense for the rest of the schedule.

  Args:
    p: number of workers.
    size: length of the dense vector.
    k: entries per worker's initial set.
    switch_density: fill-in (capacity / size) above which the dense vector is sent instead.

  Returns:
    The phases in order.
  """
  q = _pow2_floor(p)
  steps = [SparsePhase("exchange", xor_pairs(q, d), None, d) for d in _distances(q)]
  if p > q:
    steps = ([SparsePhase("fold_in", fold_in_pairs(p), None)] + steps +
             [SparsePhase("fold_out", fold_out_pairs(p), None)])
  capacity: int | None = k
  phases = []
  for phase in steps:
    if capacity is not None and capacity > switch_density * size:
      capacity = None
    phases.append(phase._replace(capacity=capacity))
    if capacity is not None and phase.kind != "fold_out":
      capacity = min(2 * capacity, size)
  return tuple(phases)


def _merge(indices: jax.Array, values: jax.Array, size: int, capacity: int):
  """Sums entries with equal indices; keeps the first ``capacity`` distinct ones in index order.

  Unused slots hold index ``size`` (past the end) and value 0.
  """
  indices, values = jax.lax.sort((indices, values), num_keys=1, is_stable=True)
  first = jnp.concatenate([jnp.ones((1,), bool), indices[1:] != indices[:-1]])
  slot = jnp.cumsum(first) - 1
  merged_values = jnp.zeros_like(values).at[slot].add(values)
  merged_indices = jnp.full_like(indices, size).at[slot].set(indices)
  return merged_indices[:capacity], merged_values[:capacity]


def _densify(indices: jax.Array, values: jax.Array, size: int) -> jax.Array:
  return jnp.zeros((size,), values.dtype).at[indices].add(values, mode="drop")


def sparse_butterfly_all_reduce(indices: jax.Array, values: jax.Array, size: int,
                                axis_name: axes.AxisName, *,
                                switch_density: float | None = None) -> jax.Array:
  """Sums per-worker sparse vectors by SparCML's sparse recursive doubling.

  Args:
    indices: ``int[k]`` positions of this worker's entries in ``[0, size)``, distinct; a slot
      may be left empty with index ``size`` (its value is ignored).
    values: ``[k]`` values at ``indices``.
    size: length of the dense vector.
    axis_name: bound mesh axis (or tuple) of the workers.
    switch_density: fill-in at which to continue dense; default: where an (index, value) set is
      as large as the dense vector (:func:`default_switch_density`).

  Returns:
    The dense sum ``[size]``, bit-identical on every worker.

  Raises:
    ValueError: mismatched shapes or a switch density outside (0, 1].
  """
  if indices.ndim != 1 or indices.shape != values.shape:
    raise ValueError(f"sparse_butterfly_all_reduce: indices and values must be 1-D of equal "
                     f"length; got shapes {indices.shape} and {values.shape}")
  if switch_density is None:
    switch_density = default_switch_density(values.dtype.itemsize)
  if not 0 < switch_density <= 1:
    raise ValueError(f"sparse_butterfly_all_reduce: switch_density={switch_density} must lie in "
                     f"(0, 1]")
  p = axes.num_workers(axis_name, caller="sparse_butterfly_all_reduce")
  rank = axes.worker_index(axis_name)
  valid = indices < size
  sparse = (jnp.where(valid, indices, size).astype(INDEX_DTYPE), jnp.where(valid, values, 0))
  dense = None
  for phase in sparse_butterfly_phases(p, size, indices.size, switch_density):
    if phase.capacity is None and dense is None:
      dense = _densify(*sparse, size)
    if phase.kind == "fold_out":
      if dense is None:
        return _densify(*(_fold_out(a, axis_name, p, rank) for a in sparse), size)
      return _fold_out(dense, axis_name, p, rank)
    if dense is not None:
      if phase.kind == "fold_in":
        dense = _fold_in(dense, axis_name, p, rank)
      else:
        received = axes.ppermute(dense, axis_name, phase.pairs)
        dense = _lower_plus_higher(dense, received, (rank & phase.distance) != 0)
      continue
    received = tuple(axes.ppermute(a, axis_name, phase.pairs) for a in sparse)
    if phase.kind == "fold_in":  # ranks that receive nothing merge an empty set
      received = (jnp.where(rank < p - _pow2_floor(p), received[0], size), received[1])
    higher = (rank & phase.distance) != 0  # the fold-in receiver i is below its sender q+i
    lower, upper = zip(*((jnp.where(higher, r, m), jnp.where(higher, m, r))
                         for m, r in zip(sparse, received)))
    sparse = _merge(jnp.concatenate([lower[0], upper[0]]), jnp.concatenate([lower[1], upper[1]]),
                    size, min(2 * phase.capacity, size))
  return dense if dense is not None else _densify(*sparse, size)


# ----------------------------------------------------------------------------- step lists


def sparse_butterfly_steps(sizes: Sequence[int], n: int, k: int, itemsize: int, *,
                           switch_density: float | None = None) -> tuple[Step, ...]:
  """The steps :func:`sparse_butterfly_all_reduce` performs, for the cost model.

  Args:
    sizes: the axis sizes the collective spans.
    n: elements of the dense vector.
    k: entries per worker.
    itemsize: bytes per value (indices are :data:`INDEX_DTYPE`).
    switch_density: as in :func:`sparse_butterfly_all_reduce`.

  Returns:
    The steps, each with the bytes one source sends and one target reduces.
  """
  if switch_density is None:
    switch_density = default_switch_density(itemsize)
  entry = np.dtype(INDEX_DTYPE).itemsize + itemsize
  return tuple(
      Step(ph.pairs, n * itemsize if ph.capacity is None else ph.capacity * entry,
           0 if ph.kind == "fold_out" else
           n * itemsize if ph.capacity is None else ph.capacity * itemsize)
      for ph in sparse_butterfly_phases(math.prod(sizes), n, k, switch_density))


def _ring_steps(p: int, n: int, itemsize: int, pairs: Pairs | None = None, *,
                pad: bool = True) -> tuple[Step, ...]:
  if p == 1:
    return ()
  chunk = (-(-n // p) if pad else n / p) * itemsize
  pairs = ring_pairs(p) if pairs is None else pairs
  return (Step(pairs, chunk, chunk),) * (p - 1) + (Step(pairs, chunk),) * (p - 1)


def _folded(p: int, vector_bytes: float, inner: tuple[Step, ...]) -> tuple[Step, ...]:
  if p == _pow2_floor(p):
    return inner
  return ((Step(fold_in_pairs(p), vector_bytes, vector_bytes),) + inner +
          (Step(fold_out_pairs(p), vector_bytes),))


def _butterfly_steps(p: int, vector_bytes: float) -> tuple[Step, ...]:
  q = _pow2_floor(p)
  inner = tuple(Step(xor_pairs(q, d), vector_bytes, vector_bytes) for d in _distances(q))
  return _folded(p, vector_bytes, inner)


def _rabenseifner_steps(p: int, n: int, itemsize: int) -> tuple[Step, ...]:
  q = _pow2_floor(p)
  padded = -(-n // q) * q * itemsize
  halving = tuple(Step(xor_pairs(q, d), padded / (2 * d), padded / (2 * d))
                  for d in _distances(q))
  doubling = tuple(Step(xor_pairs(q, d), padded / (2 * d)) for d in reversed(_distances(q)))
  return _folded(p, padded, halving + doubling)


def _hierarchical_steps(sizes: Sequence[int], n: int, itemsize: int) -> tuple[Step, ...]:
  slow, fast = sizes
  if fast == 1:
    return _ring_steps(slow, n, itemsize, _group_pairs(sizes, 0, ring_pairs(slow)))
  fast_steps = _ring_steps(fast, n, itemsize, _group_pairs(sizes, 1, ring_pairs(fast)))
  chunk = -(-n // fast)
  slow_steps = (_ring_steps(slow, chunk, itemsize, _group_pairs(sizes, 0, ring_pairs(slow)))
                if slow > 1 else ())
  return fast_steps[:fast - 1] + slow_steps + fast_steps[fast - 1:]


def _flat_steps(steps_of_p):
  """Steps of a flat schedule: it ranks every device row-major over the axes it spans."""
  return lambda sizes, n, itemsize: steps_of_p(math.prod(sizes), n, itemsize)


def _hierarchical_run(flat: jax.Array, axis_name: axes.AxisName) -> jax.Array:
  return hierarchical_all_reduce(flat, *axes.as_tuple(axis_name))


#: Every all-reduce algorithm, by name (see :class:`Schedule`). ``"psum"`` is XLA's own
#: all-reduce, priced as a ring on unpadded chunks.
SCHEDULES: dict[str, Schedule] = {s.name: s for s in (
    Schedule("psum", jax.lax.psum,
             _flat_steps(lambda p, n, itemsize: _ring_steps(p, n, itemsize, pad=False))),
    Schedule("ring", ring_all_reduce, _flat_steps(_ring_steps)),
    Schedule("butterfly", butterfly_all_reduce,
             _flat_steps(lambda p, n, itemsize: _butterfly_steps(p, n * itemsize))),
    Schedule("rabenseifner", rabenseifner_all_reduce, _flat_steps(_rabenseifner_steps)),
    Schedule("hierarchical", _hierarchical_run, _hierarchical_steps, num_axes=2),
)}
