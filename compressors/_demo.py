"""DeMo: Decoupled Momentum Optimization, as one worker's whole training transformation.

Peng, Quesnelle & Kingma 2024, "DeMo: Decoupled Momentum Optimization" (arXiv 2411.19870), as
its reference code implements it (github.com/bloc97/DeMo, ``demo.py``, ``DeMo.step``). Each
worker keeps its own momentum ``delta``, which is also its error memory; per tensor, per step,
with ``g`` the worker's own gradient and ``lr`` the step's learning rate:

1. ``delta <- momentum_decay * delta + lr * g``;
2. ``delta`` is cut into tiles and each tile goes through the orthonormal DCT-II: a matrix in
   ``c1 x c2`` tiles (a 2-D DCT), a vector in chunks of ``c`` (a 1-D DCT), where each side is the
   largest divisor of the dimension that is at most ``chunk`` (the reference's
   ``_get_smaller_split``);
3. the ``topk`` coefficients of largest magnitude of each tile are kept, as values and their
   positions in the tile, and what they decode to leaves the momentum:
   ``delta <- delta - IDCT(kept)`` (nothing is lost: ``delta`` keeps everything not sent);
4. every worker's values and positions are all-gathered (their supports differ, so they cannot
   be summed); each worker averages them coefficient by coefficient, then inverts the DCT;
5. ``update = -lr * sign(mean)`` (signSGD on the decoded mean), plus ``-lr * weight_decay *
   param`` when ``weight_decay`` is set (the reference's decoupled ``p *= 1 - lr wd``; the
   paper's runs use none, the default).

Where this follows the reference code rather than the paper's pseudo-code: the learning rate
scales the gradient inside the momentum (step 1), and the average of step 4 is, coefficient by
coefficient, over the workers that *sent* that coefficient (the reference's
``scatter_reduce(reduce="mean", include_self=False)``), not over all workers; a coefficient no
worker sent is 0. Every worker sums the gathered payloads in worker order, so the updates are
bit-identical on every worker.

Choices the reference leaves open:

* shapes: a leaf of shape ``(d_1, ..., d_k, c)`` is tiled as the ``(d_1 ... d_k) x c`` matrix
  (the reference handles matrices and vectors only); a scalar as a vector of one;
* leaves sent whole: where ``topk`` is at least a tile's size (biases of at most ``topk``
  elements, scalars, dimensions with no divisor between 2 and ``chunk``, such as a prime above
  it, which the reference tiles in ones), every coefficient would be sent, and with it a position
  for each. Such a leaf travels as its momentum itself (what keeping every coefficient of an
  orthonormal transform decodes to), in the same all-gather, with no positions; its momentum is
  then 0, and its mean is over all workers;
* the wire: one all-gather of every leaf's values (float32) and one of every position, as the
  smallest unsigned integer that holds a tile's positions (``uint16`` for the default 64 x 64
  tiles, ``uint8`` up to 256 coefficients a tile): ``(n - 1)`` payloads per worker, each about
  ``topk`` values and positions per tile (:func:`cost`).
"""

import dataclasses
import functools
import math
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax

from compressors import checks
from compressors import method_table
from compressors.network import axes
from compressors.network import topology as topology_lib

# The DCT's matrix products run in full float32 on every backend (TF32 would perturb which
# coefficients are the top ones, and what leaves the momentum).
_HIGHEST = jax.lax.Precision.HIGHEST


class DemoState(NamedTuple):
  """State of :func:`demo`, one per worker.

  Attributes:
    count: steps taken so far (int32; the learning-rate schedule's argument), the same on every
      worker.
    delta: this worker's momentum, float32, shaped like the parameters: what it has not sent.
  """
  count: jax.Array
  delta: chex.ArrayTree


@dataclasses.dataclass(frozen=True)
class _Tiling:
  """How one leaf is cut into DCT tiles.

  Attributes:
    shape: the leaf's shape.
    grid: the vector ``(n,)`` or matrix ``(rows, cols)`` the leaf is tiled as.
    chunks: a tile's side along each axis of ``grid``.
    k: coefficients sent per tile; 0 when the leaf is sent whole (see the module docstring).
  """
  shape: tuple[int, ...]
  grid: tuple[int, ...]
  chunks: tuple[int, ...]
  k: int

  @property
  def size(self) -> int:
    return math.prod(self.shape)

  @property
  def tile(self) -> int:
    return math.prod(self.chunks)

  @property
  def sent(self) -> int:
    """Values this leaf puts on the wire per worker."""
    return self.size if self.k == 0 else self.size // self.tile * self.k


def _largest_divisor(n: int, target: int) -> int:
  """The largest divisor of ``n`` that is at most ``target`` (the reference's tile side)."""
  if n == 0:
    return 1
  return max(d for d in range(1, min(n, target) + 1) if n % d == 0)


def _tiling(shape: tuple[int, ...], chunk: int, topk: int) -> _Tiling:
  """The tiles of a leaf of ``shape`` for a target side ``chunk`` and ``topk`` per tile."""
  size = math.prod(shape)
  grid = (size,) if len(shape) < 2 or size == 0 else (size // shape[-1], shape[-1])
  chunks = tuple(_largest_divisor(d, chunk) for d in grid)
  return _Tiling(tuple(shape), grid, chunks, 0 if topk >= math.prod(chunks) else topk)


@functools.lru_cache(maxsize=None)
def _dct_matrix(n: int) -> np.ndarray:
  """The orthonormal DCT-II matrix ``D`` (coefficients ``D @ x``; its inverse is ``D.T``), made
  in float64 so that the float32 cast is the nearest to the exact basis."""
  j = np.arange(n)
  d = np.sqrt(2.0 / n) * np.cos(np.pi * (2 * j[None, :] + 1) * j[:, None] / (2 * n))
  d[0] /= np.sqrt(2.0)
  return d


def _basis(n: int) -> jax.Array:
  return jnp.asarray(_dct_matrix(n), jnp.float32)


def _forward(x: jax.Array, t: _Tiling) -> jax.Array:
  """The DCT coefficients of ``x`` (shaped ``t.grid``): ``[tiles, tile]``, a tile a row."""
  if len(t.grid) == 1:
    return jnp.matmul(x.reshape(-1, t.tile), _basis(t.tile).T, precision=_HIGHEST)
  (rows, cols), (c1, c2) = t.grid, t.chunks
  tiles = x.reshape(rows // c1, c1, cols // c2, c2)
  coefficients = jnp.einsum("yhxw,bh,dw->yxbd", tiles, _basis(c1), _basis(c2),
                            precision=_HIGHEST)
  return coefficients.reshape(-1, t.tile)


def _inverse(coefficients: jax.Array, t: _Tiling) -> jax.Array:
  """The inverse of :func:`_forward`: ``[tiles, tile]`` coefficients to an array of ``t.grid``."""
  if len(t.grid) == 1:
    return jnp.matmul(coefficients, _basis(t.tile), precision=_HIGHEST).reshape(t.grid)
  (rows, cols), (c1, c2) = t.grid, t.chunks
  tiles = coefficients.reshape(rows // c1, cols // c2, c1, c2)
  return jnp.einsum("yxbd,bh,dw->yhxw", tiles, _basis(c1), _basis(c2),
                    precision=_HIGHEST).reshape(rows, cols)


class _Extracted(NamedTuple):
  """What one leaf sends: ``values``, their ``positions`` in their tiles (None when sent
  whole), and what they decode to (``sent``, shaped like the grid)."""
  values: jax.Array
  positions: jax.Array | None
  sent: jax.Array


def _extract(delta: jax.Array, t: _Tiling) -> _Extracted:
  """The ``t.k`` coefficients of largest magnitude of each tile of ``delta`` (DeMo's fast
  components), or the whole of ``delta`` when ``t.k`` is 0."""
  if t.k == 0:
    return _Extracted(delta.reshape(-1), None, delta)
  coefficients = _forward(delta, t)
  _, positions = jax.lax.top_k(abs(coefficients), t.k)
  values = jnp.take_along_axis(coefficients, positions, axis=1)
  rows = jnp.arange(coefficients.shape[0])[:, None]
  kept = jnp.zeros_like(coefficients).at[rows, positions].set(values, unique_indices=True)
  return _Extracted(values.reshape(-1), positions.reshape(-1), _inverse(kept, t))


def _index_dtype(tilings: list[_Tiling]) -> np.dtype:
  """The smallest unsigned integer that holds a position in any tile that sends positions."""
  return np.min_scalar_type(max([t.tile - 1 for t in tilings if t.k], default=0))


def _payload_order(tilings: list[_Tiling]) -> list[int]:
  """Leaves in the order their values travel: those with positions first, then the whole
  ones, so that the positions line up with the head of the values."""
  return ([i for i, t in enumerate(tilings) if t.k] +
          [i for i, t in enumerate(tilings) if not t.k])


def _slot_bases(tilings: list[_Tiling]) -> np.ndarray:
  """For each value on the wire, the position in the concatenated coefficients (leaves in
  pytree order) of the start of its tile (of itself for a leaf sent whole)."""
  offsets = np.cumsum([0] + [t.size for t in tilings])
  bases = []
  for i in _payload_order(tilings):
    t = tilings[i]
    if t.k:
      bases.append(np.repeat(offsets[i] + np.arange(t.size // t.tile) * t.tile, t.k))
    else:
      bases.append(offsets[i] + np.arange(t.size))
  return np.concatenate(bases).astype(np.int32)


def _gather(x: jax.Array, axis_name: axes.AxisName, num_workers: int) -> jax.Array:
  """Every worker's ``x`` stacked in worker order (no collective for an empty ``x`` or without
  an axis), typed identical on every worker where a mesh axis is gathered over: the invariant
  all-gather exists only under ``shard_map``, a ``vmap``'s axis takes the plain one."""
  names = axes.as_tuple(axis_name)
  if x.size == 0:
    return jnp.zeros((num_workers, 0), x.dtype)
  if not names:
    return x[None]
  return axes.all_gather(x, axis_name, invariant=bool(set(names) & set(axes.bound_axes())))


def _average(values: jax.Array, positions: jax.Array, tilings: list[_Tiling]) -> list[jax.Array]:
  """Each leaf's decoded mean (shaped like its grid) from every worker's payload.

  Args:
    values: ``[workers, sent]``, each worker's values in :func:`_payload_order`.
    positions: ``[workers, positioned]``, the in-tile positions of the head of the values.
    tilings: the leaves' tilings, in pytree order.

  Returns:
    Per leaf, the inverse DCT of the coefficient-wise mean over the workers that sent each
    coefficient (the reference's ``scatter_reduce`` mean).
  """
  bases = jnp.asarray(_slot_bases(tilings))
  whole = values.shape[1] - positions.shape[1]

  def add(i, carry):
    # Worker by worker in a fixed order: the same bits on every worker. Within one worker the
    # targets are distinct (top-k positions are), so the scatter needs no order.
    total, count = carry
    target = bases + jnp.pad(positions[i].astype(jnp.int32), (0, whole))
    return (total.at[target].add(values[i], unique_indices=True),
            count.at[target].add(1.0, unique_indices=True))

  zeros = jnp.zeros((sum(t.size for t in tilings),), jnp.float32)
  total, count = jax.lax.fori_loop(0, values.shape[0], add, (zeros, zeros))
  mean = total / jnp.maximum(count, 1.0)
  offsets = np.cumsum([0] + [t.size for t in tilings])
  return [_inverse(mean[o:o + t.size].reshape(-1, t.tile), t) if t.k
          else mean[o:o + t.size].reshape(t.grid) for o, t in zip(offsets, tilings)]


def demo(learning_rate: optax.ScalarOrSchedule, *, axis_name: axes.AxisName,
         momentum_decay: float = 0.999, chunk: int = 64, topk: int = 32,
         weight_decay: float = 0.0) -> optax.GradientTransformationExtraArgs:
  """DeMo (Peng, Quesnelle & Kingma 2024) as one worker's whole training transformation.

  Args:
    learning_rate: a float >= 0, or an optax schedule of the step count; it scales both the
      gradient added to the momentum and the sign step (as in the reference code).
    axis_name: the workers' mesh axis (or tuple of axes); ``update`` runs inside
      ``jax.shard_map``/``jax.pmap``/``jax.vmap(axis_name=...)`` over it (None: one worker).
    momentum_decay: the momentum's decay ``beta``, in [0, 1).
    chunk: the target side of a DCT tile (each side is the largest divisor of its dimension
      that is at most this), an int >= 1.
    topk: DCT coefficients sent per tile, an int >= 1.
    weight_decay: decoupled weight decay (``-lr * weight_decay * param``), >= 0.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is :class:`DemoState` and whose
    ``update(grads, state, params=None)`` takes this worker's gradient, all-gathers every
    worker's DCT coefficients and returns the parameters' update, bit-identical on every
    worker. ``params`` is needed when ``weight_decay > 0``.

  Raises:
    TypeError, ValueError: a setting out of range, naming it.
  """
  _check_settings(momentum_decay, chunk, topk, weight_decay, "demo")
  if not callable(learning_rate):
    checks.check_real(learning_rate, "learning_rate", 0.0, float("inf"), "[0, inf)", "demo")

  def init_fn(params):
    _check_floating(params, "params")
    return DemoState(count=jnp.zeros((), jnp.int32),
                     delta=jax.tree.map(lambda x: jnp.zeros(jnp.shape(x), jnp.float32), params))

  def update_fn(grads, state, params=None, **extra_args):
    del extra_args  # chained transformations' arguments
    if weight_decay and params is None:
      raise ValueError(f"demo: weight_decay={weight_decay!r} needs params in update()")
    _check_floating(grads, "gradient")
    axes.check_per_worker(grads, axis_name, "demo")
    lr = learning_rate(state.count) if callable(learning_rate) else learning_rate
    leaves, treedef = jax.tree.flatten(grads)
    if not leaves:  # nothing to train (an optax.masked branch, say): no collective either
      return grads, state._replace(count=optax.safe_int32_increment(state.count))
    tilings = [_tiling(jnp.shape(g), chunk, topk) for g in leaves]
    deltas = [momentum_decay * d.reshape(t.grid) + lr * g.astype(jnp.float32).reshape(t.grid)
              for d, g, t in zip(treedef.flatten_up_to(state.delta), leaves, tilings)]
    extracted = [_extract(d, t) for d, t in zip(deltas, tilings)]
    means = _exchange(extracted, tilings, axis_name)
    updates = [-lr * jnp.sign(m) for m in means]
    if weight_decay:
      updates = [u - lr * weight_decay * p.reshape(t.grid)
                 for u, p, t in zip(updates, treedef.flatten_up_to(params), tilings)]
    delta = [(d - e.sent).reshape(t.shape) for d, e, t in zip(deltas, extracted, tilings)]
    return (treedef.unflatten([u.reshape(g.shape).astype(g.dtype)
                               for u, g in zip(updates, leaves)]),
            DemoState(count=optax.safe_int32_increment(state.count),
                      delta=treedef.unflatten(delta)))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _exchange(extracted: list[_Extracted], tilings: list[_Tiling],
              axis_name: axes.AxisName) -> list[jax.Array]:
  """All-gathers every worker's values and positions (one all-gather each, for the whole
  model) and returns each leaf's decoded mean, shaped like its grid."""
  num_workers = axes.num_workers(axis_name, caller="demo")
  order = _payload_order(tilings)
  values = jnp.concatenate([extracted[i].values for i in order])
  positions = [extracted[i].positions for i in order if tilings[i].k]
  positions = (jnp.concatenate(positions) if positions else jnp.zeros((0,), jnp.int32))
  return _average(_gather(values, axis_name, num_workers),
                  _gather(positions.astype(_index_dtype(tilings)), axis_name, num_workers),
                  tilings)


def _check_floating(tree: chex.ArrayTree, what: str) -> None:
  """Rejects integer and boolean leaves, which have no gradient to train them by."""
  for path, x in jax.tree_util.tree_leaves_with_path(tree):
    if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
      raise TypeError(f"demo: {what} leaf {jax.tree_util.keystr(path)} has dtype "
                      f"{jnp.result_type(x)}; only floating-point leaves can be trained")


def _check_settings(momentum_decay, chunk, topk, weight_decay, caller: str) -> None:
  """DeMo's settings: the decay in [0, 1), ``chunk`` and ``topk`` ints >= 1, the weight decay
  >= 0 (the reference refuses the same decays, sizes and counts)."""
  checks.check_real(momentum_decay, "momentum_decay", 0.0, 1.0, "[0, 1)", caller)
  checks.check_int(chunk, "chunk", 1, caller)
  checks.check_int(topk, "topk", 1, caller)
  checks.check_real(weight_decay, "weight_decay", 0.0, float("inf"), "[0, inf)", caller)


@dataclasses.dataclass(frozen=True)
class DemoSettings:
  """``method="demo"``: the momentum's decay, the DCT tile's target side, the coefficients sent
  per tile and the decoupled weight decay (:func:`demo`)."""
  momentum_decay: float = 0.999
  chunk: int = 64
  topk: int = 32
  weight_decay: float = 0.0

  def __post_init__(self):
    _check_settings(self.momentum_decay, self.chunk, self.topk, self.weight_decay,
                    "DemoSettings")


def cost(settings: DemoSettings, shapes, topology: topology_lib.Topology,
         schedule: str) -> topology_lib.Cost:
  """One step's exchange: the all-gather of every worker's values (float32), then that of its
  positions (:func:`demo`'s wire; no all-reduce, so ``schedule`` plays no part).

  Args:
    settings: the method's :class:`DemoSettings`.
    shapes: the shapes of the gradient's leaves.
    topology: the workers' cluster.
    schedule: unused (DeMo sends nothing that can be summed).

  Returns:
    The :class:`compressors.network.topology.Cost` of the two all-gathers, one after the other.
  """
  del schedule
  tilings = [_tiling(tuple(s), settings.chunk, settings.topk) for s in shapes]
  value_bytes = 4 * sum(t.sent for t in tilings)
  position_bytes = _index_dtype(tilings).itemsize * sum(t.sent for t in tilings if t.k)
  return topology_lib.total([topology_lib.all_gather_cost(topology, b)
                             for b in (value_bytes, position_bytes) if b])


def _optimizer(settings: DemoSettings, learning_rate: optax.ScalarOrSchedule, *,
               axis_name: axes.AxisName, seed: int) -> optax.GradientTransformationExtraArgs:
  """The registry's builder of :func:`demo` (DeMo draws nothing at random: ``seed`` is unused)."""
  del seed
  return demo(learning_rate, axis_name=axis_name, momentum_decay=settings.momentum_decay,
              chunk=settings.chunk, topk=settings.topk, weight_decay=settings.weight_decay)


METHODS = (method_table.Method(
    name="demo", summary="DeMo: per-worker momentum, its top-k DCT coefficients per tile "
    "all-gathered, sign step (Peng, Quesnelle & Kingma 2024)", settings=DemoSettings,
    cost=cost, optimizer=_optimizer, error_feedback=False, budget="topk"),)
