"""Gradient compressors as Optax transformations that perform their own collectives.

A user writes::

  tx = optax.chain(compressors.compress(compressors.topk(density=0.01), axis_name="data"),
                   optax.sgd(0.1))

and calls ``tx.update`` inside ``jax.shard_map``/``jax.pmap`` over ``"data"``. See
:mod:`compressors.base` for the compressor abstraction and :mod:`compressors.wire` for how bytes
on the wire are counted.
"""

from compressors.axes import AxisName
from compressors.base import Aggregate
from compressors.base import Compressor
from compressors.base import Context
from compressors.dense import cast
from compressors.dense import none
from compressors.dgc import dgc
from compressors.per_worker import add_device_axis
from compressors.per_worker import drop_device_axis
from compressors.per_worker import state_specs
from compressors.randomk import randomk
from compressors.randomk import uniform_subset
from compressors.threshold import threshold
from compressors.topk import topk
from compressors.transform import CompressState
from compressors.transform import compress
from compressors.wire import WireBytes
from compressors.wire import wire_bytes
from compressors.powersgd import powersgd
from compressors.powersgd import powersgd_compress
from compressors.qsgd import qsgd
from compressors.sign import efsignsgd
from compressors.sign import onebit
from compressors.sign import signsgd
from compressors.terngrad import terngrad
from compressors.collectives import all_reduce
from compressors.planner import Bucket
from compressors.planner import Plan
from compressors.planner import plan
from compressors.topology import Link
from compressors.topology import Topology
from compressors.topology import collective_cost
from compressors.drift import replicas_agree
from compressors.nonfinite import SkipNonFiniteState
from compressors.nonfinite import skip_nonfinite
from compressors.momentum import MomentumCorrectionState
from compressors.momentum import momentum_correction
