"""The state of a data-parallel run (:func:`compressors.data_parallel`'s ``train_step``)."""

from typing import NamedTuple

import chex
import jax


class TrainState(NamedTuple):
  """The state of a data-parallel run.

  Attributes:
    step: ``int32[]``, replicated: steps taken.
    params: the parameters, replicated.
    model_state: the model's own state with one row per worker (e.g. batch statistics), or ``()``.
    opt_state: the transformation's state, laid out by :attr:`DataParallel.specs`.
  """
  step: jax.Array
  params: chex.ArrayTree
  model_state: chex.ArrayTree
  opt_state: chex.ArrayTree
