"""Threshold sparsification (Strom 2015; Dryden et al. 2016): send every entry with |x| >= tau.

The number of entries above a fixed threshold changes every step, but a compiled collective
needs a fixed shape, so the payload has a fixed capacity, ``round(max_density * d)`` (value,
index) pairs, and a count of the valid ones. Overflow policy: when more entries qualify than fit,
the ones sent are taken cyclically from a random start (see :func:`compressors.sparse.select_up_to`);
the rest stay in the error-feedback residual and compete again next step.
"""

import numbers

from compressors import base
from compressors import sparse


def threshold(value: float, *, max_density: float = 0.01) -> base.Compressor:
  """Sends the entries whose magnitude reaches ``value``, up to a fixed capacity.

  Args:
    value: the magnitude threshold tau, > 0.
    max_density: payload capacity as a fraction of the buffer, in (0, 1]; this fixes the bytes
      on the wire whatever the data.

  Returns:
    A :class:`compressors.base.Compressor` with an all-gather exchange.
  """
  if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0:
    raise ValueError(f"threshold: value={value!r} must be a positive number (the magnitude an "
                     "entry needs to be sent)")
  max_density = sparse.check_fraction(max_density, "max_density", "threshold")

  def encode(x, state, ctx):
    capacity = sparse.selection_size(max_density, x.size, "the buffer", "threshold")
    indices, count = sparse.select_up_to(abs(x) >= value, capacity, ctx.private_key)
    return sparse.gather(x, indices, count), state

  return sparse.all_gather_compressor(
      "threshold", encode,
      validate=lambda size, where: sparse.selection_size(max_density, size, where, "threshold"))
