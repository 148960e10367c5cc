"""DLRM with its tables placed across the devices of the workers' axis
(:mod:`compressors.parallel.embeddings`), as the runner trains it (``config.embedding``).

:class:`PlacedDLRM` has a flax module's ``apply`` (so the runner's loss and evaluation call it as
they call any model), run inside ``shard_map`` over ``axis``: the tables' pooled lookup goes
through the embedding exchange, then :class:`experiments.models.dlrm.DLRMTower`. Its parameters
are ``{"tower": ..., "tables": hot_rows.shard(...)}`` (:meth:`PlacedDLRM.place` lays out the
model's ``embedding_<t>`` tables so); the bank, the column bank and the hot bank (the hot rows,
:mod:`compressors.parallel.hot_rows`, a copy per worker) are sharded over ``axis``
(:meth:`PlacedDLRM.sharded_params`), updated by their own optimizer (the hot bank's gradient
first exchanged by :attr:`PlacedDLRM.hot_exchange`, a registered per-step method), the rest
replicated and updated by the run's chain.

``axis`` is the workers' (``("data", "worker")`` with simulated workers): the plan's devices
are the workers, each with its own block of every bank, as on as many devices; a device holds
its workers' blocks (:meth:`compressors.Workers.on_mesh`).
"""

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from compressors import embedding_codecs
from compressors.parallel import embeddings
from compressors.parallel import hot_rows
from compressors.parallel import sharded_params
from experiments.models import dlrm

OVERFLOW = "embedding_overflow"  # the model state's collection of the exchange's overflow


def placements(rows: Sequence[int], placement: str, overrides: str) -> tuple[str, ...]:
  """One placement per table: ``placement`` for all, then ``overrides`` (``"t:placement,..."``,
  table indices from 0) for some.

  Raises:
    ValueError: an override that is not ``index:placement``, or names a missing table.
  """
  chosen = [placement] * len(rows)
  for item in (x.strip() for x in overrides.split(",") if x.strip()):
    table, _, name = item.partition(":")
    if not table.strip().isdigit() or not name:
      raise ValueError(f"config.embedding.overrides item {item!r} is not allowed; allowed: "
                       "'table:placement' items separated by commas, e.g. '3:row,7:table'")
    if int(table) >= len(rows):
      raise ValueError(f"config.embedding.overrides names table {int(table)}; allowed: tables "
                       f"0 .. {len(rows) - 1} (the model has {len(rows)})")
    chosen[int(table)] = name.strip()
  return tuple(chosen)


class PlacedDLRM(NamedTuple):
  """``model``'s tables placed by ``plan`` over the workers' axis ``axis``; ``tx`` updates the
  sharded ones (the bank and the column bank). With ``capacity``, a training step's exchange
  counts the keys beyond it in the model state (:meth:`overflow_state`, one count per worker),
  which :meth:`check_step` refuses; evaluation batches fetch every lookup (no capacity).
  ``codecs`` encode the rows' all-to-alls (:mod:`compressors.embedding_codecs`); with
  error feedback its residuals are the sharded parameters ``params["exchange"]``. With
  ``hot_exchange`` (a per-step method's per-worker transformation) the hot bank's gradient is
  each device's own and that transformation exchanges it in the step
  (:func:`hot_rows.with_exchange`); without, the lookup's transpose all-reduces it."""
  model: dlrm.DLRM
  plan: embeddings.Plan
  axis: str
  tx: optax.GradientTransformation
  capacity: int | None = None  # keys per bucket of a training step's exchange (None: all fit)
  hot: hot_rows.HotRows | None = None  # rows every device holds (None: none)
  planned: dict | None = None  # the embedding planner's choice for results.json, where it chose
  codecs: embedding_codecs.Codecs = embedding_codecs.Codecs()
  hot_exchange: optax.GradientTransformation | None = None

  @property
  def hot_or_none(self) -> hot_rows.HotRows:
    """The hot rows (:mod:`compressors.parallel.hot_rows`), none when not given."""
    return self.hot or hot_rows.none(self.plan)

  @property
  def sharded(self) -> bool:
    """Whether any table is not replicated (else the model runs as it is)."""
    return any(p != "replicated" for p in self.plan.placements)

  def place(self, params: dict) -> dict:
    """The model's parameters (``embedding_<t>`` and ``tower``) laid out by the plan
    (traceable), and the exchange's error-feedback residuals at zero (if any)."""
    tables = [params[f"embedding_{t}"] for t in range(len(self.plan.rows))]
    residual = embedding_codecs.init_residual(self.plan, self.codecs)
    return {"tower": params["tower"],
            "tables": self._held(hot_rows.shard(self.plan, self.hot_or_none, tables)),
            **({embedding_codecs.RESIDUAL: residual} if residual else {})}

  def _held(self, laid_out: dict) -> dict:
    """``laid_out`` without a bank that holds no rows (no table placed there): an empty leaf
    would be a parameter of no size, whose optimizer state a trace cannot tell sharded."""
    empty = {"bank": self.plan.bank_rows == 0, "column_bank": self.plan.column_rows == 0,
             "hot": self.hot_or_none.total == 0}
    return {k: v for k, v in laid_out.items() if not empty.get(k, False)}

  def natural(self, params: dict) -> dict:
    """:meth:`place` undone (numpy): the model's parameters."""
    tables = hot_rows.unshard(self.plan, self.hot_or_none, jax.device_get(params["tables"]))
    return {"tower": params["tower"], **{f"embedding_{t}": x for t, x in enumerate(tables)}}

  def sharded_params(self, placed_params: Any) -> sharded_params.ShardedParams:
    """Which leaves of :meth:`place`'s layout are sharded, and their optimizer (the hot bank's
    gradient exchanged first, :func:`hot_rows.with_exchange`; the residuals take their change,
    :func:`embedding_codecs.with_residual_updates`)."""
    specs = {"tower": jax.tree.map(lambda _: P(), placed_params["tower"]),
             "tables": self._held(hot_rows.specs(self.plan, self.axis))}
    tx = self.tx
    if self.hot_exchange is not None and "hot" in specs["tables"]:
      tx = hot_rows.with_exchange(tx, self.hot_exchange, self.plan.devices)
    if embedding_codecs.RESIDUAL not in placed_params:
      return sharded_params.ShardedParams(specs, tx)
    specs[embedding_codecs.RESIDUAL] = {k: P(self.axis)
                                        for k in placed_params[embedding_codecs.RESIDUAL]}
    return sharded_params.ShardedParams(
        specs, embedding_codecs.with_residual_updates(tx, self.plan.devices))

  def split(self, sparse) -> list:
    """Every table's IDs in turn along the last axis -> one array per table (the model's
    hotness)."""
    bounds = np.cumsum(self.model.hotness)[:-1].tolist()
    return (np.split(sparse, bounds, axis=-1) if isinstance(sparse, np.ndarray)
            else jnp.split(sparse, bounds, axis=-1))

  def check_batch(self, batch: dict) -> None:
    """Refuses, on the host, IDs outside their table (:func:`embeddings.check_ids`)."""
    embeddings.check_ids(self.plan, self.split(np.asarray(batch["sparse"])))

  def overflow_state(self, workers: int) -> dict:
    """The model state of a run with a capacity: the keys each worker's latest step could not
    exchange (none without a capacity: nothing can overflow)."""
    if self.capacity is None:
      return {}
    return {OVERFLOW: {"count": jnp.zeros((workers,), jnp.int32)}}

  def check_step(self, model_state, step: int) -> None:
    """Refuses, on the host, a step whose exchange overflowed (:func:`embeddings.check_overflow`,
    one line)."""
    if OVERFLOW in model_state:
      embeddings.check_overflow(jax.device_get(model_state[OVERFLOW]["count"]),
                                f"training step {step}")

  def apply(self, variables, dense, sparse, train: bool = False, rngs=None, mutable=None):
    """The logits of one worker's rows, inside ``shard_map`` over :attr:`axis` (with
    ``mutable``, and the step's overflow count)."""
    del rngs
    params = variables["params"]
    tables, residual = params["tables"], params.get(embedding_codecs.RESIDUAL)
    if self.model.frozen_embeddings:
      tables, residual = jax.lax.stop_gradient((tables, residual))
    # Evaluation sends nothing back: the forward codec alone, no residual.
    exchange = (embedding_codecs.rows_exchange(self.codecs, residual if train else None,
                                               self.axis) if self.codecs.compressed else None)
    pooled, overflow = hot_rows.pooled_lookup(self.plan, self.hot_or_none, tables,
                                              self.split(sparse), self.axis,
                                              self.capacity if train else None, exchange,
                                              all_reduce=self.hot_exchange is None)
    logits = self.model.tower(parent=None).apply({"params": params["tower"]}, dense, pooled)
    if not mutable:
      return logits
    return logits, ({OVERFLOW: {"count": overflow}} if OVERFLOW in mutable else {})
