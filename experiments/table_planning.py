"""``config.embedding``'s planner settings, checked, and the planner run on a run's data
(:mod:`compressors.embedding_planner`): ``placement="auto"``, ``hot_rows`` and
``capacity=-1``.

The planner's inputs come from the run: the tables' rows, width and hotness from the model,
each table's access probabilities from a sample of the training IDs (the first
:data:`SAMPLE_STEPS` batches, :func:`compressors.embedding_planner.probabilities_from_sample`),
a device's batch, the dense parameters' count, and from ``config.embedding``: ``budget_bytes``
(a device's bytes for the tables, 0: none), ``link_gbit`` (the link between devices, priced at
the 10 Gbit/s cloud preset's latency) and ``compute_seconds`` (a step's compute).
"""

import dataclasses
import functools
import math
import re
from collections.abc import Callable

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from compressors import embedding_codecs
from compressors import embedding_planner
from compressors.network import topology as topology_lib
from compressors.parallel import embeddings

SAMPLE_STEPS = 8  # training batches whose IDs estimate the access probabilities
_COUNT, _FRACTION = re.compile(r"^\d+$"), re.compile(r"^0?\.\d+$")


def hot_setting(value) -> str | int | float:
  """``config.embedding.hot_rows`` parsed: ``"auto"``, a count of rows per table (int) or a
  fraction of each table's rows (float in (0, 1)).

  Raises:
    ValueError: anything else, in one line.
  """
  text = str(value).strip()
  if text == "auto":
    return text
  if _COUNT.match(text):
    return int(text)
  if _FRACTION.match(text) and 0 < float(text) < 1:
    return float(text)
  raise ValueError(f"config.embedding.hot_rows={value!r} is not allowed; allowed: 'auto' (the "
                   "planner's), a count of rows per table such as '64', or a fraction of each "
                   "table's rows in (0, 1) such as '0.01'")


def check(block) -> None:
  """Refuses, in one line naming the field, a value of the planner's settings that is not
  allowed (before anything compiles)."""
  hot_setting(block.get("hot_rows", "0"))
  allowed = (*embeddings.PLACEMENTS, "auto")
  if block.placement not in allowed:
    raise ValueError(f"config.embedding.placement={block.placement!r} is not allowed; allowed: "
                     f"{list(allowed)}")
  capacity = block.get("capacity", 0)
  if not isinstance(capacity, int) or capacity < -1:
    raise ValueError(f"config.embedding.capacity={capacity!r} is not allowed; allowed: -1 (from "
                     "the skew), 0 (every lookup of a device fits) or keys per bucket >= 1")
  for field, low in (("budget_bytes", 0), ("link_gbit", None), ("compute_seconds", None)):
    value = block.get(field, 1)
    if not isinstance(value, (int, float)) or not math.isfinite(value) or (
        value < 0 if low == 0 else value <= 0):
      raise ValueError(f"config.embedding.{field}={value!r} is not allowed; allowed: "
                       + ("bytes >= 0 (0: no budget)" if low == 0 else "a number > 0"))
  if block.placement == "auto" and block.overrides:
    raise ValueError(f"config.embedding.overrides={block.overrides!r} with placement='auto' is "
                     "not allowed; allowed: overrides '' (the planner places every table)")


def needs_planner(block) -> bool:
  """Whether the settings ask the planner: placements, hot rows or the capacity from it."""
  return (block.placement == "auto" or hot_setting(block.get("hot_rows", "0")) != 0
          or block.get("capacity", 0) == -1)


def probabilities(model, dataset) -> tuple[np.ndarray, ...]:
  """Each table's access probabilities, from the IDs of the first :data:`SAMPLE_STEPS` training
  batches of ``dataset`` (``model``'s ``hotness`` and ``cardinalities``)."""
  steps = min(SAMPLE_STEPS, dataset.steps_per_epoch)
  ids = np.concatenate([np.asarray(dataset.train_batch(s)["sparse"]).reshape(
      -1, sum(model.hotness)) for s in range(steps)])
  bounds = np.cumsum(model.hotness)[:-1]
  return tuple(embedding_planner.probabilities_from_sample(table_ids, rows) for table_ids, rows
               in zip(np.split(ids, bounds, axis=1), model.cardinalities))


def codecs(block) -> embedding_codecs.Codecs:
  """The rows' all-to-alls' codecs of ``config.embedding`` (``exchange``,
  ``gradient_exchange``, ``error_feedback``, ``topk_fraction``, ``threshold``; a block without
  them exchanges float32), checked against the row reduction."""
  defaults = embedding_codecs.Codecs()
  made = embedding_codecs.codecs(block.get("exchange", defaults.forward),
                                 block.get("gradient_exchange", defaults.backward),
                                 block.get("error_feedback", defaults.error_feedback),
                                 block.get("topk_fraction", defaults.topk_fraction),
                                 block.get("threshold", defaults.threshold))
  embedding_codecs.check_plan(made, block.row_reduction)
  return made


def link(gbit: float) -> topology_lib.Link:
  """The link between devices at ``gbit`` Gbit/s, priced at the 10 Gbit/s cloud preset's
  latency (``config.embedding.link_gbit``'s)."""
  return dataclasses.replace(topology_lib.CLOUD_10G, bandwidth=gbit * 1e9 / 8,
                             name=f"{gbit:g} Gbit/s")


def workload(rows, width: int, hotness, batch_per_device: int, probabilities,
             dense_params: int, codecs_: embedding_codecs.Codecs, hot_exchange=None,
             hot_state_bytes=None) -> embedding_planner.Workload:
  """The planner's workload of tables of ``rows`` rows of ``width`` looked up ``hotness`` times
  a row of the batch, their rows' payloads priced as ``codecs_`` encodes them and their
  residuals charged to the budget, the hot rows' gradient as ``hot_exchange`` (None: the
  lookup's psum) with ``hot_state_bytes`` (:func:`state_bytes` of its method; None: none)."""
  return embedding_planner.Workload(
      tuple(rows), width, tuple(hotness), batch_per_device, tuple(probabilities), dense_params,
      payload_bytes=functools.partial(embedding_codecs.payload_bytes, codecs_),
      hot_exchange=hot_exchange,
      residual_bytes=functools.partial(embedding_codecs.residual_bytes_per_device, c=codecs_),
      hot_state_bytes=hot_state_bytes)


def state_bytes(tx) -> Callable[[tuple[int, int]], int]:
  """``shape -> bytes`` of ``tx``'s state for a float32 leaf of ``shape``, from shapes alone
  (the hot exchange's: :attr:`compressors.embedding_planner.Workload.hot_state_bytes`)."""
  @functools.lru_cache(maxsize=None)
  def of(shape: tuple[int, int]) -> int:
    state = jax.eval_shape(tx.init, jax.ShapeDtypeStruct(shape, jnp.float32))
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(state))
  return of


def choose(block, model, devices: int, batch_per_device: int, dataset, dense_params: int,
           placements, codecs_: embedding_codecs.Codecs, hot_exchange=None,
           hot_state_bytes=None) -> embedding_planner.Choice:
  """The planner's choice for the run (``placements`` None: chosen too; the rows' payloads
  priced as ``codecs_`` encodes them, the hot rows' gradient as ``hot_exchange``, a
  :attr:`compressors.embedding_planner.Workload.hot_exchange`, its state as
  ``hot_state_bytes``), logged with its report."""
  load = workload(model.cardinalities, model.embedding_dim, model.hotness, batch_per_device,
                  probabilities(model, dataset), dense_params, codecs_, hot_exchange,
                  hot_state_bytes)
  choice = plan(block, load, devices, placements)
  logging.warning("%s", choice.report())
  return choice


def plan(block, workload_: embedding_planner.Workload, devices: int,
         placements) -> embedding_planner.Choice:
  """The planner's choice for ``workload_`` on ``devices`` devices as ``config.embedding``'s
  ``hot_rows``, ``budget_bytes``, ``link_gbit``, ``compute_seconds`` and ``row_reduction`` ask
  (``placements`` None: chosen too)."""
  hot = hot_setting(block.hot_rows)
  counts = (None if hot == "auto" else
            [hot if isinstance(hot, int) else math.ceil(hot * r) for r in workload_.rows])
  choice = embedding_planner.choose(
      workload_, topology_lib.Topology.flat(devices, link(block.link_gbit)), block.budget_bytes,
      block.compute_seconds, placements, counts, block.row_reduction)
  if hot not in (0, "auto") and not choice.hot.total:
    raise ValueError(f"config.embedding.hot_rows={block.hot_rows!r} but no table is row- or "
                     f"table-placed with row_reduction 'all_to_all' (placements "
                     f"{sorted(set(choice.plan.placements))}, row_reduction "
                     f"{block.row_reduction!r}); allowed: hot_rows '0' there")
  return choice


def summary(choice: embedding_planner.Choice) -> dict:
  """The choice for results.json: the placements, the hot rows' count, the capacity, why, and
  the predicted bytes and seconds per collective per step, the step and the memory."""
  return {"placements": list(choice.plan.placements), "hot_rows": choice.hot.total,
          "capacity": choice.capacity, "why": choice.why,
          **dataclasses.asdict(choice.prediction)}
