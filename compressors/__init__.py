"""Gradient compressors as Optax transformations that perform their own collectives.

A user writes::

  tx = optax.chain(compressors.compress(compressors.topk(density=0.01), axis_name="data"),
                   optax.sgd(0.1))

and calls ``tx.update`` inside ``jax.shard_map``/``jax.pmap`` over ``"data"``
(:func:`data_parallel` writes that step: the per-worker gradient, the state's layout, the lockstep
skip of non-finite steps). Naming: a
factory named after a method returns a :class:`Compressor` (``topk``, ``dgc``, ``powersgd``,
``dense``, ...); :func:`compress` turns any compressor into the transformation, with error
feedback. Every method, with its settings and its
cost-model entry, is in :mod:`compressors.registry`. :mod:`compressors.protocol` is the
compressor abstraction, :mod:`compressors.wire` how bytes on the wire are counted,
:mod:`compressors.workers` where the workers run (several simulated on one device),
:mod:`compressors.collectives`, :mod:`compressors.topology` and :mod:`compressors.planner` the
all-reduce schedules, their cost model and the integer-programming planner (which needs scipy,
and is loaded when first used).
"""

# The method modules register themselves (compressors.registry) when imported, here in the
# order methods are listed: the baselines, the sparsifiers, the quantizers, low rank.
from compressors import _dense, _topk, _randomk, _threshold, _dgc  # noqa: F401
from compressors import _qsgd, _terngrad, _sign, _powersgd  # noqa: F401
from compressors import registry
from compressors._compress import CompressState
from compressors._compress import compress
from compressors._data_parallel import DataParallel
from compressors._data_parallel import data_parallel
from compressors._dense import cast
from compressors._dense import dense
from compressors._dgc import dgc
from compressors._drift import replicas_agree
from compressors._momentum import MomentumCorrectionState
from compressors._momentum import momentum_correction
from compressors._nonfinite import SkipNonFiniteState
from compressors._nonfinite import skip_nonfinite
from compressors._per_worker import add_device_axis
from compressors._per_worker import drop_device_axis
from compressors._per_worker import state_specs
from compressors._powersgd import powersgd
from compressors._qsgd import qsgd
from compressors._randomk import randomk
from compressors._randomk import uniform_subset
from compressors._sign import efsignsgd
from compressors._sign import onebit
from compressors._sign import signsgd
from compressors._terngrad import terngrad
from compressors._threshold import threshold
from compressors._topk import topk
from compressors.axes import AxisName
from compressors.collectives import all_reduce
from compressors.protocol import Aggregate
from compressors.protocol import Compressor
from compressors.protocol import Context
from compressors.protocol import ResidualAggregate
from compressors.topology import Link
from compressors.topology import Topology
from compressors.topology import collective_cost
from compressors.wire import WireBytes
from compressors.wire import wire_bytes
from compressors.workers import Workers

_PLANNER = ("Bucket", "Plan", "plan")

__all__ = (
    "Aggregate", "AxisName", "Bucket", "CompressState", "Compressor", "Context", "DataParallel",
    "Link", "MomentumCorrectionState", "Plan", "ResidualAggregate", "SkipNonFiniteState",
    "Topology", "WireBytes", "Workers", "add_device_axis", "all_reduce", "cast", "collective_cost",
    "compress", "data_parallel", "dense", "dgc", "drop_device_axis", "efsignsgd",
    "momentum_correction", "onebit", "plan", "powersgd", "qsgd", "randomk", "registry",
    "replicas_agree", "signsgd", "skip_nonfinite", "state_specs", "terngrad", "threshold", "topk",
    "uniform_subset", "wire_bytes",
)


def __getattr__(name):
  """The planner's names, imported on first use: ``import compressors`` does not load scipy."""
  if name in _PLANNER:
    from compressors import planner  # pylint: disable=import-outside-toplevel
    return getattr(planner, name)
  raise AttributeError(f"module 'compressors' has no attribute {name!r}")


def __dir__():
  return sorted(set(globals()) | set(_PLANNER))
