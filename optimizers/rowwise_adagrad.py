"""Row-wise Adagrad: the embedding tables' optimizer of MLPerf's DLRM-DCNv2 (FBGEMM's
``EXACT_ROWWISE_ADAGRAD``), one accumulator per row instead of one per entry."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from optimizers import _validation


class ScaleByRowwiseAdagradState(NamedTuple):
  """Per leaf, the sum over steps of each row's mean squared gradient (``[rows]``)."""
  sum_of_squares: optax.Updates


def _rows(x):
  """``x`` as ``[rows, entries]``: its first axis the rows (a 1-D leaf: one entry a row)."""
  return x.reshape(x.shape[0], -1) if x.ndim > 1 else x[:, None]


def scale_by_rowwise_adagrad(eps: float = 1e-8,
                             initial_accumulator_value: float = 0.0
                             ) -> optax.GradientTransformation:
  """Scales each row ``r`` of every leaf's gradient by ``1 / (sqrt(G_r) + eps)``, where
  ``G_r`` sums ``mean(g_r ** 2)`` (the row's mean over its entries) over the steps so far,
  this one included. A row whose gradient is zero does not move and its ``G_r`` does not grow,
  so that the rows a step does not look up are left as they are.

  Raises:
    ValueError: a negative ``eps`` or ``initial_accumulator_value``.
  """
  eps = _validation.as_float(eps, "eps", "rowwise_adagrad")
  initial = _validation.as_float(initial_accumulator_value, "initial_accumulator_value",
                                 "rowwise_adagrad")
  for value, field in ((eps, "eps"), (initial, "initial_accumulator_value")):
    if value < 0:
      raise ValueError(f"rowwise_adagrad: {field}={value!r} is not allowed; {field} must be "
                       ">= 0.")

  def init_fn(params):
    return ScaleByRowwiseAdagradState(jax.tree.map(
        lambda p: jnp.full((p.shape[0],) if p.ndim else (), initial, jnp.float32), params))

  def update_fn(updates, state, params=None):
    del params

    def one(g, accumulated):
      rows = _rows(g.astype(jnp.float32))
      accumulated = accumulated + jnp.mean(rows * rows, axis=1)
      denominator = (jnp.sqrt(accumulated) + eps)[:, None]
      # Zero only where the row's gradients have all been zero (and eps is): it stays put.
      scaled = jnp.where(denominator > 0, rows / jnp.where(denominator > 0, denominator, 1), 0)
      return scaled.reshape(g.shape).astype(g.dtype), accumulated
    # Flattened, not mapped to pairs: a masked leaf (optax.MaskedNode) is a tuple too.
    leaves, structure = jax.tree.flatten(updates)
    pairs = [one(g, a) for g, a in zip(leaves,
                                       structure.flatten_up_to(state.sum_of_squares))]
    return (structure.unflatten([p[0] for p in pairs]),
            ScaleByRowwiseAdagradState(structure.unflatten([p[1] for p in pairs])))
  return optax.GradientTransformation(init_fn, update_fn)


def rowwise_adagrad(learning_rate: optax.ScalarOrSchedule, eps: float = 1e-8,
                    initial_accumulator_value: float = 0.0) -> optax.GradientTransformation:
  """Row-wise Adagrad (FBGEMM's ``EXACT_ROWWISE_ADAGRAD``, MLPerf DLRM-DCNv2's optimizer of the
  tables): ``w_r <- w_r - lr * g_r / (sqrt(G_r) + eps)`` with ``G_r += mean(g_r ** 2)``
  (:func:`scale_by_rowwise_adagrad`). The rows are each leaf's first axis; a table sharded by
  rows (:mod:`compressors.parallel.embeddings`' bank) holds whole rows, so each device updates
  its own with nothing exchanged. A table sharded by columns holds part of each row: its
  ``G_r`` would be the part's, which is not this optimizer.

  Args:
    learning_rate: a float or an optax schedule.
    eps: added to the root of the accumulator (FBGEMM's default 1e-8).
    initial_accumulator_value: ``G_r`` before the first step.
  """
  return optax.chain(scale_by_rowwise_adagrad(eps, initial_accumulator_value),
                     optax.scale_by_learning_rate(learning_rate))
