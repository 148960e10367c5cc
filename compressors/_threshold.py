"""Threshold sparsification (Strom 2015; Dryden et al. 2016): send every entry with |x| >= tau.

The number of entries above a fixed threshold changes every step, but a compiled collective
needs a fixed shape, so the payload has a fixed capacity, ``round(max_density * d)`` (value,
index) pairs, and a count of the valid ones. Overflow policy: when more entries qualify than fit,
the ones sent are taken cyclically from a random start (see
:func:`compressors._sparse.select_up_to`);
the rest stay in the error-feedback residual and compete again next step.
"""

import dataclasses
import math
import numbers

from compressors import checks
from compressors import protocol
from compressors import _sparse as sparse
from compressors import method_table


def threshold(value: float, *, max_density: float = 0.01) -> protocol.Compressor:
  """Sends the entries whose magnitude reaches ``value``, up to a fixed capacity.

  Args:
    value: the magnitude threshold tau, > 0.
    max_density: payload capacity as a fraction of the buffer, in (0, 1]; this fixes the bytes
      on the wire whatever the data.

  Returns:
    A :class:`compressors.Compressor` with an all-gather exchange.
  """
  if (isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0
      or not math.isfinite(value)):
    raise ValueError(f"threshold: value={value!r} must be a positive number (the magnitude an "
                     "entry needs to be sent), and finite: no entry reaches infinity")
  max_density = checks.check_fraction(max_density, "max_density", "threshold")

  def encode(x, state, ctx):
    capacity = sparse.selection_size(max_density, x.size, "the buffer", "threshold")
    indices, count = sparse.select_up_to(abs(x) >= value, capacity, ctx.private_key)
    return sparse.gather(x, indices, count), state

  return sparse.all_gather_compressor(
      "threshold", encode,
      validate=lambda size, where: sparse.selection_size(max_density, size, where, "threshold"))


@dataclasses.dataclass(frozen=True)
class ThresholdSettings:
  """``method="threshold"``: entries of magnitude >= ``value``, at most ``max_density`` of them."""
  value: float = checks.setting(1e-3, checks.Rule(float, low=0, low_open=True))
  max_density: float = checks.setting(0.01, checks.FRACTION)

  def __post_init__(self):
    checks.check_settings(self, "threshold")


METHODS = (method_table.Method(
    name="threshold", summary="entries above a fixed magnitude, at a fixed capacity (Strom "
    "2015)", settings=ThresholdSettings,
    compressor=lambda s: threshold(s.value, max_density=s.max_density), budget="max_density",
    cost=lambda s, shapes, topology, schedule: sparse.payload_cost(s.max_density, shapes,
                                                                    topology)),)
