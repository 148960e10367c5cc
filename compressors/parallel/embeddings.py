"""Embedding tables placed across the devices of a mesh axis, and their pooled lookups.

A recommendation model's tables may not fit one device. :func:`plan` places each table
(``placement``, one per table):

* ``replicated``: every device holds the whole table; a lookup moves nothing (its gradient is
  averaged like the dense parameters');
* ``row``: row ``r`` lives on device ``r mod n`` (cyclic, so that IDs ranked by frequency spread
  over the devices), at local row ``r div n``;
* ``table``: the whole table lives on one device (the largest tables first, each on the device
  holding the fewest rows);
* ``column``: every device holds every row's slice of ``ceil(width / n)`` columns (the width
  padded with zero columns).

Row and table placements share one array, the *bank* (``[n * rows_per_device, width]``, sharded
over the axis: device ``k`` holds block ``k``), and one exchange; column-placed tables share the
*column bank* (``[rows, n * columns_per_device]``, sharded over its columns). A table's row
therefore needs ``ceil(rows / n)`` rows of every device (row), its rows on one (table), or its
columns on all (column): sizes that the device count does not divide are padded, never refused.

The exchange, inside ``shard_map`` (:func:`pooled_lookup`), per device and step (row-placed
tables may instead be pooled where their rows live, below):

1. the device's IDs of every bank table become *keys* ``owner * rows_per_device + local row``,
   de-duplicated (``jnp.unique``): a row that recurs in the batch travels once;
2. the keys are bucketed by owner into a dense ``[n, capacity]`` buffer and sent with one
   ``all_to_all`` (``ragged_all_to_all`` is not implemented on XLA:CPU, hence the fixed capacity);
3. each owner gathers the requested rows and returns them with a second ``all_to_all``
   ``[n, capacity, width]``;
4. each device sums its bags from the rows it received.

The backward pass is JAX's transpose of the same program: the rows' gradients return to their
owners by one ``all_to_all`` and are summed there (scatter-add). Both row all-to-alls may be
compressed, with error feedback on the gradients (``pooled_lookup(..., rows_exchange=...)``,
:mod:`compressors.embedding_codecs`; ``exchange_bytes(..., payload_bytes=...)`` counts them).

With ``plan(..., row_reduction="reduce_scatter")`` row-placed tables are pooled as TorchRec's
row-wise sharding pools them: every device's IDs of those tables are all-gathered, each device
sums, for every row of the global batch, the looked-up rows it holds (a partial bag), and one
``psum_scatter`` (reduce-scatter) gives each device its own rows' bags; the backward pass
all-gathers the bags' gradients. Its bytes do not depend on the skew (nothing is
de-duplicated): ``(n - 1)`` times a device's bags, against the all-to-all's de-duplicated rows.

Column-placed tables send the
de-duplicated keys to every device (``all_gather``) and receive each device's columns of their
rows (``all_to_all``). Replicated tables take rows locally.

``axis`` may be a mesh axis or, for workers simulated on each device (``jax.vmap`` inside
``shard_map``, untyped), a tuple such as ``("data", "worker")``: the collectives then go through
:mod:`compressors.network.axes`, and the bags and gradients are those of as many devices.

Capacity: a bucket holds ``capacity`` keys (:func:`capacity_from_skew` sizes it from the batch
and the IDs' skew; the default, every lookup of the device, cannot overflow). Keys beyond it are
*counted* (:func:`pooled_lookup`'s second output, :func:`check_overflow` refuses a count > 0 in
one line) and contribute zero rows to that step: never dropped silently.

Bad input, before anything compiles, in one line: an ID outside its table or negative, naming the
table (:func:`check_ids`); a table, or all of them, over a device's memory budget as placed
(:func:`check_budget`); tables too large for the exchange's int32 keys (:func:`plan`).
"""

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np

from compressors.network import axes

PLACEMENTS = ("replicated", "table", "row", "column")
ROW_REDUCTIONS = ("all_to_all", "reduce_scatter")


@dataclasses.dataclass(frozen=True)
class Plan:
  """Where every table's rows live on ``devices`` devices.

  Attributes:
    rows: rows per table.
    width: the tables' width (one for all, as DLRM's interaction needs).
    placements: one of :data:`PLACEMENTS` per table.
    devices: devices of the axis.
    owners: per table, its device (``table``) or -1.
    offsets: per table, its first local row in the bank (``row``, ``table``) or the column bank
      (``column``), -1 for ``replicated``.
    bank_rows: rows of the bank per device.
    column_rows: rows of the column bank.
    row_reduction: how row-placed tables' bags are made: ``all_to_all`` (their rows fetched
      de-duplicated, the bags summed by the device that looks them up) or ``reduce_scatter``
      (partial bags summed where the rows live, then reduce-scattered).
  """
  rows: tuple[int, ...]
  width: int
  placements: tuple[str, ...]
  devices: int
  owners: tuple[int, ...]
  offsets: tuple[int, ...]
  bank_rows: int
  column_rows: int
  row_reduction: str = "all_to_all"

  @property
  def column_width(self) -> int:
    """Columns of the column bank per device."""
    return -(-self.width // self.devices)

  def tables(self, *placements: str) -> list[int]:
    """The tables with one of ``placements``."""
    return [t for t, p in enumerate(self.placements) if p in placements]

  @property
  def fetched(self) -> list[int]:
    """The bank's tables whose rows the all-to-all fetches."""
    return self.tables("table", *(("row",) if self.row_reduction == "all_to_all" else ()))

  @property
  def reduce_scattered(self) -> list[int]:
    """The tables pooled where their rows live, then reduce-scattered."""
    return self.tables("row") if self.row_reduction == "reduce_scatter" else []

  def bytes_per_device(self, itemsize: int = 4) -> int:
    """Bytes of the tables one device holds as laid out (padding included)."""
    replicated = sum(self.rows[t] for t in self.tables("replicated")) * self.width
    return itemsize * (replicated + self.bank_rows * self.width
                       + self.column_rows * self.column_width)


def plan(rows: Sequence[int], width: int, placements: str | Sequence[str], devices: int,
         row_reduction: str = "all_to_all") -> Plan:
  """Places ``rows`` (rows per table) of ``width`` columns on ``devices`` devices.

  Args:
    rows: rows per table.
    width: the tables' width.
    placements: one of :data:`PLACEMENTS` for all tables, or one per table.
    devices: devices of the axis the tables are sharded over.
    row_reduction: see :class:`Plan`.

  Raises:
    ValueError: an unknown placement or row reduction, a count of placements other than the
      tables', or a table without rows.
  """
  if row_reduction not in ROW_REDUCTIONS:
    raise ValueError(f"embedding.row_reduction={row_reduction!r} is not allowed; allowed: "
                     f"{list(ROW_REDUCTIONS)}")
  rows = tuple(int(r) for r in rows)
  if isinstance(placements, str):
    placements = (placements,) * len(rows)
  placements = tuple(placements)
  if len(placements) != len(rows):
    raise ValueError(f"embedding.placement has {len(placements)} entries for {len(rows)} tables; "
                     "allowed: one placement, or one per table")
  for t, (placement, count) in enumerate(zip(placements, rows)):
    if placement not in PLACEMENTS:
      raise ValueError(f"embedding.placement={placement!r} (table {t}) is not allowed; allowed: "
                       f"{list(PLACEMENTS)}")
    if count < 1:
      raise ValueError(f"table {t} has {count} rows; allowed: at least 1")
  owners, offsets = [-1] * len(rows), [-1] * len(rows)
  shared = 0  # row-placed tables occupy the same rows of every device
  for t in (t for t, p in enumerate(placements) if p == "row"):
    offsets[t], shared = shared, shared + -(-rows[t] // devices)
  held = [0] * devices
  for t in sorted((t for t, p in enumerate(placements) if p == "table"), key=lambda t: -rows[t]):
    owner = min(range(devices), key=lambda d: held[d])
    owners[t], offsets[t] = owner, shared + held[owner]
    held[owner] += rows[t]
  column_rows = 0
  for t in (t for t, p in enumerate(placements) if p == "column"):
    offsets[t], column_rows = column_rows, column_rows + rows[t]
  made = Plan(rows, int(width), placements, int(devices), tuple(owners), tuple(offsets),
              shared + max(held), column_rows, row_reduction)
  if max(made.devices * made.bank_rows, made.column_rows) >= 2**31:
    raise ValueError(f"embedding tables of {sum(rows):,} rows on {devices} devices: a key of "
                     "the exchange (int32) cannot address them; allowed: fewer than 2**31 rows "
                     "in the bank and in the column bank")
  return made


def check_budget(p: Plan, budget_bytes: int, itemsize: int = 4, residual_bytes: int = 0) -> None:
  """Refuses a plan whose tables need more than ``budget_bytes`` of one device, with
  ``residual_bytes`` more per device (the exchange's error-feedback residual,
  :func:`compressors.embedding_codecs.residual_bytes_per_device`).

  Raises:
    ValueError: one line naming the table that alone does not fit as placed (its bytes on the
      device that holds most of it), or else the bytes all the tables (and the residual) need.
  """
  for t, placement in enumerate(p.placements):
    held = itemsize * {"replicated": p.rows[t] * p.width, "table": p.rows[t] * p.width,
                       "row": -(-p.rows[t] // p.devices) * p.width,
                       "column": p.rows[t] * p.column_width}[placement]
    if held > budget_bytes:
      raise ValueError(f"table {t} ({p.rows[t]:,} rows, placement {placement!r}) needs "
                       f"{held:,} bytes of one device; allowed: at most the budget of "
                       f"{budget_bytes:,} (place it by rows or columns, or on more devices)")
  if p.bytes_per_device(itemsize) + residual_bytes > budget_bytes:
    residual = f" ({residual_bytes:,} of them the residual)" if residual_bytes else ""
    raise ValueError(f"the embedding tables need {p.bytes_per_device(itemsize) + residual_bytes:,}"
                     f" bytes of one device as placed{residual}; allowed: at most the budget of "
                     f"{budget_bytes:,}")


def bank_address(p: Plan, t: int, ids):
  """``(owner, local row)`` of table ``t``'s IDs in the bank (numpy or jax)."""
  if p.placements[t] == "row":
    return ids % p.devices, p.offsets[t] + ids // p.devices
  return ids * 0 + p.owners[t], p.offsets[t] + ids


def shard(p: Plan, tables: Sequence[jax.Array]) -> dict:
  """The tables (``[rows, width]`` each) laid out as ``p`` places them: ``{"replicated": tuple of
  tables, "bank": [n * bank_rows, width], "column_bank": [column_rows, n * column_width]}``
  (global arrays; :func:`specs` shards them). Traceable: a run lays out its initial tables
  inside the program that draws them."""
  tables = [jnp.asarray(x) for x in tables]
  dtype = tables[0].dtype if tables else jnp.float32
  bank = jnp.zeros((p.devices * p.bank_rows, p.width), dtype)
  columns = jnp.zeros((p.column_rows, p.devices * p.column_width), dtype)
  for t in p.tables("row", "table"):
    owner, local = bank_address(p, t, np.arange(p.rows[t]))
    bank = bank.at[owner * p.bank_rows + local].set(tables[t])
  for t in p.tables("column"):
    columns = columns.at[p.offsets[t]:p.offsets[t] + p.rows[t], :p.width].set(tables[t])
  return {"replicated": tuple(tables[t] for t in p.tables("replicated")), "bank": bank,
          "column_bank": columns}


def unshard(p: Plan, params: dict) -> list[np.ndarray]:
  """The tables of ``params`` (as :func:`shard` lays them out, a bank that holds no rows and
  an empty tuple of replicated tables may be absent), each ``[rows, width]``."""
  bank = np.asarray(params.get("bank", np.zeros((0, p.width))))
  columns = np.asarray(params.get("column_bank", np.zeros((0, 0))))
  replicated = iter(params.get("replicated", ()))
  tables = []
  for t, placement in enumerate(p.placements):
    if placement == "replicated":
      tables.append(np.asarray(next(replicated)))
    elif placement == "column":
      tables.append(columns[p.offsets[t]:p.offsets[t] + p.rows[t], :p.width])
    else:
      owner, local = bank_address(p, t, np.arange(p.rows[t]))
      tables.append(bank[owner * p.bank_rows + local])
  return tables


def specs(p: Plan, axis) -> dict:
  """The partition specs of :func:`shard`'s layout over mesh axis ``axis``."""
  return {"replicated": tuple(P() for _ in p.tables("replicated")), "bank": P(axis),
          "column_bank": P(None, axis)}


def check_ids(p: Plan, sparse: Sequence[np.ndarray]) -> None:
  """Refuses, on the host, IDs outside their table or negative.

  Raises:
    ValueError: ``table <t>: ID <id> is not allowed; allowed: 0 .. rows - 1``, the first such
      table; or a count of ID arrays other than the tables'.
  """
  if len(sparse) != len(p.rows):
    raise ValueError(f"{len(sparse)} sparse features for {len(p.rows)} tables; allowed: one "
                     "array of IDs per table")
  for t, ids in enumerate(sparse):
    ids = np.asarray(ids)
    if ids.size and (ids.min() < 0 or ids.max() >= p.rows[t]):
      bad = ids.min() if ids.min() < 0 else ids.max()
      raise ValueError(f"table {t}: ID {int(bad)} is not allowed; allowed: 0 .. "
                       f"{p.rows[t] - 1} (the table's {p.rows[t]} rows)")


def check_overflow(overflow, where: str = "the exchange") -> None:
  """Refuses a step whose keys overflowed the capacity (:func:`pooled_lookup`'s count).

  Raises:
    ValueError: one line naming the count and what to raise.
  """
  count = int(np.sum(np.asarray(overflow)))
  if count:
    raise ValueError(f"{where}: {count} de-duplicated IDs did not fit the all-to-all's capacity "
                     "(their rows were not exchanged); raise embedding.capacity, or set none "
                     "(the runner's 0: every lookup of a device fits)")


def expected_unique(probabilities: np.ndarray, draws: int) -> float:
  """Expected distinct rows among ``draws`` independent draws from ``probabilities`` (a table's
  ID distribution): ``sum_i 1 - (1 - p_i)^draws``, in float64."""
  p = np.asarray(probabilities, np.float64)
  return float(np.sum(-np.expm1(draws * np.log1p(-np.minimum(p, 1 - 1e-16)))))


def capacity_from_skew(unique_per_device: float, devices: int, margin: float = 1.5) -> int:
  """A bucket's capacity: a device's expected distinct keys (:func:`expected_unique`, summed
  over the bank tables) spread over ``devices`` owners, times ``margin`` for the spread of the
  count between steps and owners."""
  return max(1, math.ceil(margin * unique_per_device / devices))


def exchange_bytes(p: Plan, batch: int, hotness: Sequence[int], capacity: int | None = None,
                   itemsize: int = 4, payload_bytes=None) -> dict[str, float]:
  """Bytes one device sends per step in the exchange of :func:`pooled_lookup`, as
  :mod:`compressors.parallel.hlo_bytes` charges them (an all-to-all, all-gather or
  reduce-scatter of ``S`` bytes: ``(n - 1) / n * S``): ``forward`` (IDs, rows, bags) and
  ``backward`` (the rows' or the bags' gradients).

  Args:
    p: the plan.
    batch: rows of a device's batch.
    hotness: IDs per table of a row.
    capacity: as :func:`pooled_lookup`'s.
    itemsize: bytes of a table's element.
    payload_bytes: ``(direction, rows, width) -> bytes`` of one bucket of rows as the forward
      or backward all-to-all encodes it
      (:func:`compressors.embedding_codecs.payload_bytes`); None: ``itemsize`` each.
  """
  n, share = p.devices, (p.devices - 1) / p.devices
  payload_bytes = payload_bytes or (lambda direction, rows, width: rows * width * itemsize)
  forward = backward = 0.0
  if n == 1:
    return {"forward": forward, "backward": backward}
  # The column exchange sends at most its keys (a capacity beyond them is not padded).
  for tables, width, padded in ((p.fetched, p.width, True),
                                (p.tables("column"), p.column_width, False)):
    if tables:
      lookups = batch * sum(hotness[t] for t in tables)
      rows = (capacity or lookups) if padded else min(capacity or lookups, lookups)  # per bucket
      forward += share * n * (4 * rows + payload_bytes("forward", rows, width))  # int32 keys
      backward += share * n * payload_bytes("backward", rows, width)
  if p.reduce_scattered:
    bags = n * batch * len(p.reduce_scattered) * p.width * itemsize
    forward += share * (n * batch * sum(hotness[t] for t in p.reduce_scattered) * 4 + bags)
    backward += share * bags
  return {"forward": forward, "backward": backward}


def _dedup(keys, fill):
  """``(unique keys padded with fill, each key's index among them, distinct count)``."""
  unique, inverse = jnp.unique(keys, size=keys.shape[0], fill_value=fill, return_inverse=True)
  return unique, inverse.reshape(-1), jnp.sum(unique != fill)


def _all_to_all_rows(axis):
  """The rows' exchange uncompressed: one all-to-all (its transpose returns the gradients)."""
  return lambda bank, found, slot_keys: jax.lax.all_to_all(found, axis, 0, 0, tiled=True)


def _bank_rows(p: Plan, bank, keys, axis, capacity, rows_exchange):
  """Each key's row of the bank, fetched from its owner: ``(rows [keys, width], overflow)``."""
  n, rows_each = p.devices, p.bank_rows
  unique, inverse, _ = _dedup(keys, n * rows_each)
  owner = unique // rows_each  # n for the padding
  # Sorted keys are grouped by owner: a key's slot is its place after its owner's first key.
  slot = jnp.arange(unique.shape[0]) - jnp.searchsorted(unique, owner * rows_each)
  valid = (owner < n) & (slot < capacity)
  overflow = jnp.sum((owner < n) & (slot >= capacity))
  slot_keys = jnp.full((n, capacity), n * rows_each, jnp.int32).at[
      jnp.where(valid, owner, n), jnp.where(valid, slot, 0)].set(unique, mode="drop")
  requests = jnp.where(slot_keys < n * rows_each, slot_keys % rows_each, -1)
  received = jax.lax.all_to_all(requests, axis, 0, 0, tiled=True)
  found = jnp.where((received >= 0)[..., None], bank[jnp.maximum(received, 0)], 0)
  returned = rows_exchange("bank", found, slot_keys)
  rows = jnp.where(valid[:, None], returned[jnp.minimum(owner, n - 1),
                                            jnp.minimum(slot, capacity - 1)], 0)
  return rows[inverse], overflow


def _column_rows(p: Plan, columns, keys, axis, capacity, rows_exchange):
  """Each key's row of the column bank, its columns from every device: ``(rows, overflow)``."""
  unique, inverse, count = _dedup(keys, p.column_rows)
  kept = unique[:capacity]
  everyone = axes.all_gather(kept, axis)  # [n, capacity]
  found = jnp.where((everyone < p.column_rows)[..., None],
                    columns[jnp.minimum(everyone, p.column_rows - 1)], 0)
  # [n (column block), cap, cols]
  returned = rows_exchange("column_bank", found, jnp.broadcast_to(kept, everyone.shape))
  rows = returned.transpose(1, 0, 2).reshape(kept.shape[0], -1)[:, :p.width]
  rows = jnp.where((inverse < capacity)[:, None], rows[jnp.minimum(inverse, capacity - 1)], 0)
  return rows, jnp.maximum(count - capacity, 0)


def _reduce_scattered_bags(p: Plan, bank, sparse, axis):
  """The bags of :attr:`Plan.reduce_scattered` tables: ``[batch, those tables, width]``."""
  tables = p.reduce_scattered
  mine = jnp.concatenate([sparse[t] for t in tables], axis=1)
  everyone = axes.all_gather(mine, axis).reshape(-1, mine.shape[1])  # [n * batch, hotness]
  me, partial, start = axes.worker_index(axis), [], 0
  for t in tables:
    ids = everyone[:, start:start + sparse[t].shape[1]]
    owner, local = bank_address(p, t, ids)
    partial.append(jnp.where((owner == me)[..., None], bank[local], 0).sum(axis=1))
    start += sparse[t].shape[1]
  return axes.psum_scatter(jnp.stack(partial, axis=1), axis)


def _concatenated_keys(p: Plan, sparse, tables, key_of):
  keys = [key_of(t, sparse[t].reshape(-1)) for t in tables]
  return jnp.concatenate(keys) if keys else jnp.zeros((0,), jnp.int32)


def _split_bags(p: Plan, rows, sparse, tables, pooled):
  start = 0
  for t in tables:
    size = sparse[t].size
    pooled[t] = rows[start:start + size].reshape(sparse[t].shape + (p.width,)).sum(axis=1)
    start += size


def pooled_lookup(p: Plan, params: dict, sparse: Sequence[jax.Array], axis,
                  capacity: int | None = None,
                  rows_exchange=None) -> tuple[jax.Array, jax.Array]:
  """Inside ``shard_map`` over ``axis``: this device's bags summed, ``[batch, tables, width]``,
  and the count of keys that overflowed the capacity (0 when none did).

  Args:
    p: the plan.
    params: this device's part of :func:`shard`'s layout.
    sparse: this device's IDs, one ``[batch, hotness]`` array per table (-1 in a table of
      :attr:`Plan.fetched`: no lookup, a zero row).
    axis: the mesh axis the tables are sharded over.
    capacity: keys per bucket of the all-to-all (per owner for the bank, per device for the
      column bank); None: every lookup of the device (no overflow possible).
    rows_exchange: ``(bank, found, slot_keys) -> received``, the all-to-all of the rows
      ``found`` (``[n, capacity, width]``) of ``"bank"`` or ``"column_bank"``, each slot's key
      in ``slot_keys`` (the bank's size: empty); None: uncompressed
      (:func:`compressors.embedding_codecs.rows_exchange` compresses it).
  """
  rows_exchange = rows_exchange or _all_to_all_rows(axis)
  pooled = [None] * len(p.rows)
  for t, table in zip(p.tables("replicated"), params["replicated"]):
    pooled[t] = jnp.take(table, sparse[t], axis=0).sum(axis=1)
  overflow = jnp.zeros((), jnp.int32)
  if p.reduce_scattered:
    bags = _reduce_scattered_bags(p, params["bank"], sparse, axis)
    for i, t in enumerate(p.reduce_scattered):
      pooled[t] = bags[:, i]
  bank_tables = p.fetched
  if bank_tables:
    # An ID of -1 is no lookup (a hot row, served by compressors.parallel.hot_rows): the key
    # past the bank, the de-duplication's padding, which sends nothing and gives a zero row.
    keys = _concatenated_keys(p, sparse, bank_tables, lambda t, ids: jnp.where(
        ids < 0, p.devices * p.bank_rows,
        (lambda owner, local: owner * p.bank_rows + local)(*bank_address(p, t, ids))))
    rows, lost = _bank_rows(p, params["bank"], keys, axis, capacity or keys.shape[0],
                            rows_exchange)
    _split_bags(p, rows, sparse, bank_tables, pooled)
    overflow += lost
  column_tables = p.tables("column")
  if column_tables:
    keys = _concatenated_keys(p, sparse, column_tables, lambda t, ids: p.offsets[t] + ids)
    rows, lost = _column_rows(p, params["column_bank"], keys, axis, capacity or keys.shape[0],
                              rows_exchange)
    _split_bags(p, rows, sparse, column_tables, pooled)
    overflow += lost
  return jnp.stack(pooled, axis=1), overflow
