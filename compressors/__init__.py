"""Gradient compressors as Optax transformations that perform their own collectives.

A user writes::

  tx = optax.chain(compressors.compress(compressors.topk(density=0.01), axis_name="data"),
                   optax.sgd(0.1))

and calls ``tx.update`` inside ``jax.shard_map``/``jax.pmap`` over ``"data"``
(:func:`data_parallel` writes that step: the per-worker gradient, the state's layout, the lockstep
skip of non-finite steps). Naming: a factory named after a method returns a :class:`Compressor`
(``topk``, ``dgc``, ``powersgd``, ``dense``, ...); :func:`compress` turns any compressor into the
transformation, with error feedback. Beyond per-step methods: :func:`local_updates` (DiLoCo:
each worker's own optimizer for ``H`` steps, then the pseudo-gradient through any exchange and
an outer step), and the methods that are their own optimizer, :func:`demo` (DeMo) and
:func:`onebit_adam` (1-bit Adam). Every method, with its settings and its cost-model entry, is in
:mod:`compressors.registry` (TASC's once ``tasc`` is imported).

One word, one meaning: an *exchange* is the collective step that gives every worker the mean of
the workers' buffers. ``Compressor.exchange`` says how its payloads meet in it (``"psum"``,
``"all_gather"``, ``"two_phase"``), :func:`compressors.protocol.exchange` runs it,
``local_updates``' ``exchange`` is the transformation that runs it on the pseudo-gradient (that
of the per-step method a local-update method's ``carrier`` setting names), and
``config.compression.exchanged`` says what goes into it (each worker's gradient, or its
optimizer's update). A method's *family* is ``"per_step"`` (chained with the run's optimizer),
``"optimizer"`` or ``"local"``.

Layout, one concern a place:

* this package: the compressor protocol (:mod:`compressors.protocol`), the transformation
  (``compress``, :mod:`compressors.wrapper`), the methods, the method table
  (:mod:`compressors.method_table`) and its assembly (:mod:`compressors.registry`), what a
  method declares to the harness (:mod:`compressors.method_protocol`: its step kinds and what
  each sends and lands, its per-worker parameters), the budget search
  (:mod:`compressors.budget`) and the equal-bytes solver above the assembly;
* :mod:`compressors.parallel`: the data-parallel harness, which knows no method (the step,
  where workers run, the state's per-worker layout, the non-finite skip, the replica check,
  evaluation, the bytes of a compiled program);
* :mod:`compressors.network`: the network model (the workers' axes, the all-reduce schedules,
  their cost model, the integer-programming planner).

What is private: a module whose name starts with ``_`` belongs to its package and is imported by
nothing outside it; every other module is public, and everything a user needs is also
re-exported here (``__all__``), but the planner (``Bucket``, ``Plan``, ``plan``), which needs
scipy: ``from compressors.network import planner``, so that ``import compressors`` does not load
scipy (and no module here imports inside a function).
"""

from compressors import aggregation
from compressors import network
from compressors import parallel
from compressors import registry
from compressors import worker_sim
from compressors.wrapper import CompressState
from compressors.wrapper import compress
from compressors.parallel.data_parallel import DataParallel
from compressors.parallel.data_parallel import TrainState
from compressors.parallel.data_parallel import data_parallel
from compressors._chunked_topk import chunk_topk
from compressors._dense import cast
from compressors._dense import dense
from compressors._demo import DemoState
from compressors._demo import demo
from compressors._dgc import dgc
from compressors._local import DelayedLocalState
from compressors._local import EagerLocalState
from compressors._local import LocalUpdatesState
from compressors._local import local_update_kinds
from compressors._local import local_updates
from compressors._local import nesterov_outer
from compressors.method_protocol import StepInputs
from compressors.method_protocol import StepKind
from compressors.method_protocol import SynchronisingState
from compressors.method_protocol import apply_local_updates
from compressors.method_protocol import synchronised_params
from compressors._intq import quantize
from compressors.parallel.drift import replicas_agree
from compressors._momentum import MomentumCorrectionState
from compressors._momentum import momentum_correction
from compressors._onebit_adam import OnebitAdamState
from compressors._onebit_adam import onebit_adam
from compressors.parallel.nonfinite import SkipNonFiniteState
from compressors.parallel.nonfinite import skip_nonfinite
from compressors.parallel.per_worker import add_device_axis
from compressors.parallel.per_worker import drop_device_axis
from compressors.parallel.per_worker import state_specs
from compressors._powersgd import powersgd
from compressors._qsgd import qsgd
from compressors._randomk import randomk
from compressors._randomk import uniform_subset
from compressors._sign import efsignsgd
from compressors._sign import onebit
from compressors._sign import signsgd
from compressors._streaming import AggregatedStreamingState
from compressors._streaming import DelayedStreamingState
from compressors._streaming import EagerStreamingState
from compressors._streaming import FragmentPiece
from compressors._streaming import StreamingState
from compressors._streaming import fragment_layout
from compressors._streaming import streaming_kinds
from compressors._streaming import streaming_local_updates
from compressors._terngrad import terngrad
from compressors._threshold import threshold
from compressors._topk import topk
from compressors._warmup import density_warmup
from compressors._warmup import warmup_boundaries
from compressors._warmup import warmup_densities
from compressors._warmup import warmup_kinds
from compressors.network.axes import AxisName
from compressors.network.collectives import all_reduce
from compressors.protocol import Aggregate
from compressors.protocol import Compressor
from compressors.protocol import Context
from compressors.protocol import ResidualAggregate
from compressors.network.topology import Link
from compressors.network.topology import Topology
from compressors.network.topology import collective_cost
from compressors.parallel.hlo_bytes import WireBytes
from compressors.parallel.hlo_bytes import wire_bytes
from compressors.parallel.workers import Workers

__all__ = (
    "Aggregate", "AxisName", "CompressState", "Compressor", "Context", "DataParallel",
    "DelayedLocalState", "DemoState", "EagerLocalState", "Link", "LocalUpdatesState",
    "MomentumCorrectionState",
    "OnebitAdamState",
    "FragmentPiece", "ResidualAggregate", "SkipNonFiniteState", "StepInputs", "StepKind",
    "StreamingState", "SynchronisingState", "AggregatedStreamingState", "DelayedStreamingState",
    "EagerStreamingState",
    "Topology", "TrainState", "WireBytes", "Workers", "add_device_axis", "all_reduce",
    "apply_local_updates", "cast", "chunk_topk", "collective_cost", "compress", "data_parallel",
    "demo", "dense", "density_warmup", "dgc", "drop_device_axis", "efsignsgd", "fragment_layout",
    "local_update_kinds", "local_updates", "momentum_correction", "nesterov_outer", "onebit",
    "onebit_adam",
    "powersgd", "qsgd", "quantize", "randomk", "registry", "replicas_agree", "signsgd",
    "skip_nonfinite", "state_specs", "streaming_kinds", "streaming_local_updates",
    "synchronised_params", "terngrad", "threshold", "topk",
    "uniform_subset", "warmup_boundaries", "warmup_densities", "warmup_kinds", "wire_bytes"
)

