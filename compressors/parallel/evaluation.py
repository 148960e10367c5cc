"""Evaluation over the workers of a data-parallel step: a sum over workers of a function of each
worker's batch, at the model state averaged over workers."""

from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from compressors.parallel import sharded_params as sharded_lib
from compressors.parallel import workers as workers_lib


def reduce_over_workers(layout: workers_lib.Workers, fn: Callable[..., Any], *,
                        sharded: sharded_lib.ShardedParams | None = None) -> Callable[..., Any]:
  """``fn`` summed over the workers of ``layout``.

  Args:
    layout: where the workers run.
    fn: ``(params, model_state, batch) -> pytree`` of one worker on its share of the batch.
    sharded: the parameters sharded over the workers' axes (``fn`` reads its worker's blocks,
      :meth:`compressors.parallel.sharded_params.ShardedParams.worker_blocks`), or None.

  Returns:
    A jitted ``(params, model_state, batch) -> sum over workers of fn(params, mean model_state,
    worker's batch)``: ``params`` replicated, ``model_state`` with one row per worker (averaged
    over workers first, e.g. batch statistics), ``batch`` split over the workers.
  """
  axis = layout.worker_axes

  def worker(params, model_state, batch):
    model_state = jax.tree.map(lambda x: jax.lax.pmean(x, axis), model_state)
    return jax.lax.psum(fn(params, model_state, batch), axis)

  def body(params, model_state, batch):
    if sharded is None:
      return layout.each(worker, (None, 0, 0), None)(params, model_state, layout.rows(batch))
    each = layout.each(worker, (sharded.worker_axes(), 0, 0), None)
    return each(sharded.worker_blocks(params, layout.per_device), model_state,
                layout.rows(batch))
  params_spec = P() if sharded is None else layout.on_mesh(sharded.specs)
  return jax.jit(layout.shard_map(body, in_specs=(params_spec, layout.spec, layout.spec),
                                  out_specs=P()))
