"""Hot rows: the most looked-up rows of row- and table-placed tables, replicated on every device.

In click logs a few rows take most lookups (the synthetic logs' top 1% of rows, 92.6%). Those
rows, fetched by the all-to-all of :mod:`compressors.parallel.embeddings` from their owner at
almost every step, can instead live on every device (SCARS, FlexShard): a lookup of a hot row
is served locally, and only the cold rows travel through the all-to-all, so a capacity sized
for the cold keys (:func:`compressors.parallel.embedding_planner.capacity`) sends fewer bytes.

:class:`HotRows` names, per table, its hot IDs (ascending). They form the *hot bank*
``[hot rows, width]``, the tables' hot rows one table after the other, which every device holds
whole. As a parameter it is laid out ``[n * hot rows, width]`` and sharded over the axis
(:func:`specs`), each device's block its own copy (each worker's, with simulated workers: ``n``
counts workers): a data-parallel step then treats it like the
bank (:mod:`compressors.parallel.sharded_params`: its gradient needs no exchange from the
step, its optimizer runs on each device's block). The exchange is in the lookup instead: the
hot bank enters it through an identity whose transpose all-reduces (``psum``) its gradient, the
*hot-row all-reduce*, so every device's copy receives the same sum of every device's gradient
and takes the same update (:func:`pooled_lookup`). The math is that of the tables whole: a
bag is the sum of its hot rows (from the hot bank) and of its cold ones (from the all-to-all).

Or the step exchanges it (``pooled_lookup(..., all_reduce=False)``, the runner's way): the
transpose leaves each device its own gradient of its copy, and the hot bank's optimizer
(:func:`with_exchange`) first runs a registered per-step method's per-worker transformation
(:func:`compressors.registry.transformation`: each worker compresses its own gradient, with
error feedback where the method keeps it, and gets back the mean), as the run's chain does for
a dense parameter; that transformation's state (a residual, one row per worker) is the hot
bank's optimizer state, checkpointed with it. Why there and not in the transpose: compression
must come before the sum (a ``psum`` sums float32), and only an optimizer's state carries any
method's memory from step to step (the embedding codecs' residual rides in the parameters
because the rows it shadows are chosen inside the loss; the hot bank is a fixed leaf). With
the ``dense`` method it is the same float32 all-reduce as the ``psum``, the same bytes.

A hot row keeps its slot in the bank (unused, its gradient zero): the bank's layout does not
change, at ``ceil(hot rows / n)`` rows of a device per table.

Row IDs need no remapping: a table's hot IDs are a sorted constant of the program, and a
lookup finds an ID's slot by binary search (``searchsorted``), so the constant grows with the
hot rows, not with the table. The cold lookups reach the bank's exchange with the hot ones set
to -1 (no lookup).

Bad input, in one line, before anything compiles (:func:`hot_rows`): hot rows of a table that
is not fetched by the all-to-all (replicated, column-placed, or row-placed tables pooled by
reduce-scatter), an ID outside its table, or an ID named twice.
"""

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import optax

from compressors.network import axes
from compressors.parallel import embeddings


@dataclasses.dataclass(frozen=True)
class HotRows:
  """The hot IDs of each table (ascending; empty: none), as :func:`hot_rows` checks them."""
  ids: tuple[tuple[int, ...], ...]

  @property
  def counts(self) -> tuple[int, ...]:
    """Hot rows per table."""
    return tuple(len(i) for i in self.ids)

  @property
  def total(self) -> int:
    """Rows of the hot bank."""
    return sum(self.counts)

  @property
  def offsets(self) -> tuple[int, ...]:
    """Each table's first row in the hot bank."""
    return tuple(int(x) for x in np.cumsum((0,) + self.counts[:-1]))

  def bytes_per_device(self, width: int, itemsize: int = 4) -> int:
    """Bytes of the hot bank on one device."""
    return itemsize * self.total * width

  def all_reduce_bytes(self, p: embeddings.Plan, itemsize: int = 4) -> float:
    """Bytes one device sends per step in the hot-row all-reduce, as
    :mod:`compressors.parallel.hlo_bytes` charges an all-reduce of ``S`` bytes: ``2 (n - 1) / n
    * S``."""
    return 2 * (p.devices - 1) / p.devices * self.bytes_per_device(p.width, itemsize)


def none(p: embeddings.Plan) -> HotRows:
  """No hot rows."""
  return HotRows(((),) * len(p.rows))


def hot_rows(p: embeddings.Plan, ids: Sequence[Sequence[int]]) -> HotRows:
  """The hot rows ``ids`` (per table, any order) of the tables ``p`` places, checked.

  Raises:
    ValueError: in one line: a count of tables other than the plan's, hot rows of a table the
      all-to-all does not fetch, an ID outside its table or negative, or an ID named twice.
  """
  if len(ids) != len(p.rows):
    raise ValueError(f"embedding.hot_rows names {len(ids)} tables for {len(p.rows)}; allowed: "
                     "one list of hot IDs per table")
  fetched, checked = set(p.fetched), []
  for t, table_ids in enumerate(ids):
    table_ids = np.asarray(table_ids, np.int64).reshape(-1)
    if table_ids.size and t not in fetched:
      raise ValueError(f"embedding.hot_rows: table {t} (placement {p.placements[t]!r}, "
                       f"row_reduction {p.row_reduction!r}) has {table_ids.size} hot rows; "
                       "allowed: hot rows of row- or table-placed tables fetched by the "
                       "all-to-all only")
    if table_ids.size and (table_ids.min() < 0 or table_ids.max() >= p.rows[t]):
      bad = table_ids.min() if table_ids.min() < 0 else table_ids.max()
      raise ValueError(f"embedding.hot_rows: table {t}: ID {int(bad)} is not allowed; allowed: "
                       f"0 .. {p.rows[t] - 1}")
    if np.unique(table_ids).size != table_ids.size:
      raise ValueError(f"embedding.hot_rows: table {t} names an ID twice; allowed: distinct IDs")
    checked.append(tuple(int(i) for i in np.sort(table_ids)))
  return HotRows(tuple(checked))


def hottest(probabilities: Sequence[np.ndarray], counts: Sequence[int]) -> list[np.ndarray]:
  """The ``counts[t]`` most probable IDs of each table (ties: the lower ID first)."""
  return [np.argsort(-np.asarray(p), kind="stable")[:c] for p, c in zip(probabilities, counts)]


def shard(p: embeddings.Plan, hot: HotRows, tables: Sequence[jax.Array]) -> dict:
  """:func:`embeddings.shard`'s layout and the hot bank ``"hot"``: ``[n * hot rows, width]``,
  one copy per device (traceable)."""
  laid_out = embeddings.shard(p, tables)
  dtype = laid_out["bank"].dtype
  rows = [jnp.asarray(tables[t])[np.asarray(i, np.int32)] for t, i in enumerate(hot.ids) if i]
  bank = jnp.concatenate(rows) if rows else jnp.zeros((0, p.width), dtype)
  return {**laid_out, "hot": jnp.tile(bank, (p.devices, 1))}


def unshard(p: embeddings.Plan, hot: HotRows, params: dict) -> list[np.ndarray]:
  """The tables of ``params`` (:func:`shard`'s layout), each ``[rows, width]``: the hot rows
  from the first device's copy of the hot bank, the rest from the bank."""
  tables = embeddings.unshard(p, params)
  if hot.total:
    bank = np.asarray(params["hot"])[:hot.total]
    for t, (ids, offset) in enumerate(zip(hot.ids, hot.offsets)):
      tables[t] = tables[t].copy()
      tables[t][list(ids)] = bank[offset:offset + len(ids)]
  return tables


def specs(p: embeddings.Plan, axis) -> dict:
  """The partition specs of :func:`shard`'s layout over ``axis``."""
  return {**embeddings.specs(p, axis), "hot": P(axis)}


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _gradient_all_reduced(bank, axis):
  """``bank`` itself; its gradient summed over ``axis`` (the hot-row all-reduce)."""
  return bank


def _forward(bank, axis):
  del axis
  return bank, None


def _backward(axis, _, gradient):
  varying = axes.is_varying(gradient, axis)
  total = jax.lax.psum(gradient, axis)
  # Typed like the bank it is the gradient of: each device's own copy.
  return (jax.lax.pcast(total, axes.as_tuple(axis), to="varying") if varying else total,)


_gradient_all_reduced.defvjp(_forward, _backward)


def pooled_lookup(p: embeddings.Plan, hot: HotRows, params: dict, sparse: Sequence[jax.Array],
                  axis, capacity: int | None = None, rows_exchange=None,
                  all_reduce: bool = True) -> tuple[jax.Array, jax.Array]:
  """:func:`embeddings.pooled_lookup` with the hot rows served from this device's hot bank:
  ``(bags [batch, tables, width], overflow)``; the hot bank's gradient is all-reduced over
  ``axis`` in the backward pass, or, with ``all_reduce=False``, left this device's own for the
  step to exchange (:func:`with_exchange`). ``capacity`` counts cold keys only;
  ``rows_exchange`` encodes the cold rows' all-to-alls, as :func:`embeddings.pooled_lookup`'s."""
  if not hot.total:
    return embeddings.pooled_lookup(p, params, sparse, axis, capacity, rows_exchange)
  bank = _gradient_all_reduced(params["hot"], axis) if all_reduce else params["hot"]
  cold, hot_bags = list(sparse), {}
  for t, (ids, offset) in enumerate(zip(hot.ids, hot.offsets)):
    if not ids:
      continue
    table_ids = jnp.asarray(np.asarray(ids, np.int32))
    slot = jnp.minimum(jnp.searchsorted(table_ids, sparse[t]), len(ids) - 1)
    is_hot = table_ids[slot] == sparse[t]
    cold[t] = jnp.where(is_hot, -1, sparse[t])
    hot_bags[t] = jnp.where(is_hot[..., None], bank[offset + slot], 0).sum(axis=1)
  pooled, overflow = embeddings.pooled_lookup(p, params, cold, axis, capacity, rows_exchange)
  for t, bag in hot_bags.items():
    pooled = pooled.at[:, t].add(bag)
  return pooled, overflow


def with_exchange(tx: optax.GradientTransformation, exchange: optax.GradientTransformation,
                  workers: int) -> optax.GradientTransformation:
  """``tx``, the sharded leaves' optimizer, with the hot bank's gradient (``params["tables"]
  ["hot"]``, each device's own: ``pooled_lookup(..., all_reduce=False)``) first exchanged by
  ``exchange``, a per-step method's per-worker transformation (compress, exchange, the mean:
  :func:`compressors.registry.transformation`), then updated by ``tx``. The sharded step
  divides a sharded leaf's gradient by ``workers`` (the all-to-all's transpose summed it); this
  one is no sum, so ``exchange`` gets it times ``workers`` back (exact for a power of two).
  ``exchange``'s mean is the same on every device, so ``tx``'s state is one for every copy:
  it is made from the bank's shape (not from this device's copy, which would type it as
  differing from device to device), replicated like the run's chain's; ``exchange``'s memories
  (residuals) are per worker."""
  def labels(params):
    return jax.tree_util.tree_map_with_path(
        lambda path, _: "hot" if _keys(path) == ("tables", "hot") else "other", params)
  hot = optax.with_extra_args_support(
      optax.chain(optax.scale(float(workers)), exchange, tx))
  from_shape = lambda params: hot.init(jax.tree.map(
      lambda x: jnp.zeros(jnp.shape(x), jnp.result_type(x)), params))
  return optax.multi_transform(
      {"other": tx, "hot": optax.GradientTransformationExtraArgs(from_shape, hot.update)},
      labels)


def _keys(path) -> tuple:
  return tuple(getattr(k, "key", None) for k in path)
