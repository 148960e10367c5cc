"""Cluster topologies and the alpha-beta-gamma cost model of every all-reduce we can run.

A :class:`Topology` is the device mesh seen by the network: one :class:`Axis` per mesh axis,
major (slowest) first, like ``jax.make_mesh((nodes, gpus), ("node", "gpu"))``; a pair of
devices talks over the link of the most major axis on which their coordinates differ. Each
:class:`Link` has

* ``alpha``: latency per message, seconds;
* ``bandwidth``: bytes per second one sender gets (``beta = 1 / bandwidth`` seconds per byte);
* ``gamma``: seconds per byte to add a received buffer into one's own (the reduction).

An axis may be *shared*: devices that differ only along the axes named in ``Axis.shared_by``
send through one medium (a node's single NIC, one loopback interface), so ``c`` of them sending
at once each see ``bandwidth / c``.

The model prices a schedule step by step (:func:`steps_cost`): a step costs the slowest of its
links' ``alpha + bytes * beta * concurrency + reduced_bytes * gamma``, and steps run one after
another. On one unshared link this reproduces the textbook formulas (Thakur, Rabenseifner &
Gropp, IJHPCA 2005; ``n`` bytes, ``p`` workers):

* ring: ``2(p-1) alpha + 2(p-1)/p n beta + (p-1)/p n gamma``;
* recursive doubling (butterfly): ``lg p (alpha + n beta + n gamma)``;
* Rabenseifner: ``2 lg p alpha + 2(p-1)/p n beta + (p-1)/p n gamma``;
* top-k all-gather: ``(p-1) alpha + (p-1) k (value + index bytes) beta``;

and prices what they leave out exactly as our implementations run: padding to a multiple of
``p``, the fold-in/fold-out of non-power-of-two ``p`` (two extra full-vector steps), the
two-level hierarchy, the sparse butterfly's capacity doubling and dense switch-over (SparCML,
Renggli et al. SC'19) and 1-bit Adam's two-phase exchange (Tang et al. 2021).

Every cost also carries its *byte term*: bytes one device sends, averaged over devices, the
rule :func:`compressors.wire_bytes` applies to the compiled HLO (a collective-permute of ``S``
bytes counts ``S`` times the fraction of devices that send).
"""

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from compressors.network import collectives

#: Algorithms the cost model prices. The first five run as ``collectives.all_reduce``
#: schedules; at density < 1 they carry a shared-support payload (the same ``k`` coordinates
#: on every worker, as random-k or TASC's shared blocks). The rest carry per-worker supports.
ALGORITHMS = tuple(collectives.SCHEDULES) + ("topk_allgather", "sparse_butterfly", "onebit")
SPARSE_FILLS = ("static", "expected")


@dataclasses.dataclass(frozen=True)
class Link:
  """One class of network link.

  Attributes:
    alpha: latency per message, seconds (>= 0).
    bandwidth: bytes per second available to one sender (> 0).
    gamma: reduction cost, seconds per byte of the received buffer added in (>= 0).
    name: for tables.
  """
  alpha: float
  bandwidth: float
  gamma: float = 0.0
  name: str = ""

  def __post_init__(self):
    for field, value, allowed in (("alpha", self.alpha, ">= 0 seconds"),
                                  ("bandwidth", self.bandwidth, "> 0 bytes/s"),
                                  ("gamma", self.gamma, ">= 0 seconds per byte")):
      ok = isinstance(value, (int, float)) and math.isfinite(value) and (
          value > 0 if field == "bandwidth" else value >= 0)
      if not ok:
        raise ValueError(f"Link {self.name!r}: {field}={value!r} is invalid; allowed: {allowed}")

  @property
  def beta(self) -> float:
    """Seconds per byte."""
    return 1.0 / self.bandwidth


@dataclasses.dataclass(frozen=True)
class Axis:
  """One mesh axis and the link that carries traffic across it.

  Attributes:
    name: the mesh-axis name.
    size: devices along the axis (>= 1).
    link: the :class:`Link` between devices whose coordinates first differ on this axis.
    shared_by: axis names along which devices share this axis's medium (e.g. ``("gpu",)`` for
      one NIC per node; the axis's own name for a bus such as one loopback interface).
  """
  name: str
  size: int
  link: Link
  shared_by: tuple[str, ...] = ()

  def __post_init__(self):
    if not isinstance(self.size, int) or self.size < 1:
      raise ValueError(f"Axis {self.name!r}: size={self.size!r} is invalid; allowed: an int >= 1")
    if not isinstance(self.link, Link):
      raise TypeError(f"Axis {self.name!r}: link must be a Link, got {self.link!r}")


@dataclasses.dataclass(frozen=True)
class Topology:
  """A device mesh with a link class per axis, major (slowest) axis first.

  Attributes:
    axes: the axes in mesh order; linear ranks are row-major over them.
    name: for tables.
  """
  axes: tuple[Axis, ...]
  name: str = ""

  def __post_init__(self):
    object.__setattr__(self, "axes", tuple(self.axes))
    if not self.axes:
      raise ValueError(f"Topology {self.name!r}: needs at least one Axis")
    names = [a.name for a in self.axes]
    if len(set(names)) != len(names):
      raise ValueError(f"Topology {self.name!r}: axis names {names} repeat")
    for axis in self.axes:
      unknown = set(axis.shared_by) - set(names)
      if unknown:
        raise ValueError(f"Topology {self.name!r}: axis {axis.name!r} has shared_by="
                         f"{axis.shared_by} naming {sorted(unknown)}; allowed: {names}")

  @classmethod
  def flat(cls, p: int, link: Link, *, shared: bool = False, name: str = "",
           axis_name: str = "x") -> "Topology":
    """``p`` devices on one link class; ``shared=True`` makes it a bus (one loopback)."""
    return cls((Axis(axis_name, p, link, (axis_name,) if shared else ()),), name)

  @property
  def sizes(self) -> tuple[int, ...]:
    return tuple(a.size for a in self.axes)

  @property
  def num_devices(self) -> int:
    return math.prod(self.sizes)

  def __str__(self):
    rows = [f"Topology {self.name or '(unnamed)'}: {self.num_devices} devices"]
    for a in self.axes:
      shared = f", shared by {'/'.join(a.shared_by)}" if a.shared_by else ""
      rows.append(f"  {a.name:>6} x{a.size:<4} {a.link.name or 'link'}: alpha "
                  f"{a.link.alpha * 1e6:.3g} us, {a.link.bandwidth * 8 / 1e9:.4g} Gbit/s, gamma "
                  f"{a.link.gamma * 1e12:.3g} ps/B{shared}")
    return "\n".join(rows)


# ----------------------------------------------------------------------------- presets
# Nominal figures: datasheet peak bandwidths per direction; latencies are typical orders of
# magnitude for NCCL/MPI small messages on such links, not measurements. gamma assumes the
# reduction streams at memory bandwidth, reading two bytes and writing one per byte reduced.
# Calibrate (python -m experiments.bench.calibrate) before trusting absolute times.

_V100_GAMMA = 3 / 900e9  # HBM2, 900 GB/s (NVIDIA Tesla V100 datasheet)
_H100_GAMMA = 3 / 3.35e12  # HBM3, 3.35 TB/s (NVIDIA H100 SXM datasheet)
NVLINK2 = Link(alpha=5e-6, bandwidth=150e9, gamma=_V100_GAMMA, name="NVLink2")  # 6 x 25 GB/s
NVLINK4 = Link(alpha=3e-6, bandwidth=450e9, gamma=_H100_GAMMA, name="NVLink4")  # 900 GB/s bidir
ETHERNET_25G = Link(alpha=30e-6, bandwidth=25e9 / 8, gamma=_V100_GAMMA, name="25GbE")
CLOUD_10G = Link(alpha=50e-6, bandwidth=10e9 / 8, gamma=_V100_GAMMA, name="10Gbit/s cloud")
# Commodity 1 Gbit/s Ethernet (a lab cluster's switch); the same latency as the cloud link.
ETHERNET_1G = Link(alpha=50e-6, bandwidth=1e9 / 8, gamma=_V100_GAMMA, name="1Gbit/s Ethernet")
INFINIBAND_NDR = Link(alpha=5e-6, bandwidth=400e9 / 8, gamma=_H100_GAMMA, name="IB NDR 400G")
PCIE3 = Link(alpha=10e-6, bandwidth=12e9, gamma=_V100_GAMMA, name="PCIe 3.0 x16")


def v100_nvlink_25gbe(nodes: int = 2, gpus_per_node: int = 8) -> Topology:
  """DGX-1-class nodes of 8 V100s on NVLink2, one 25 Gbit/s Ethernet NIC per node (shared)."""
  return Topology((Axis("node", nodes, ETHERNET_25G, ("gpu",)),
                   Axis("gpu", gpus_per_node, NVLINK2)), "8xV100 NVLink + 25GbE")


def cloud_10gbe(nodes: int = 8, gpus_per_node: int = 1) -> Topology:
  """Public-cloud VMs on 10 Gbit/s networking; GPUs within a VM on PCIe share its NIC."""
  return Topology((Axis("node", nodes, CLOUD_10G, ("gpu",)),
                   Axis("gpu", gpus_per_node, PCIE3)), "10Gbit/s cloud")


def h100_nvlink_ib400(nodes: int = 2, gpus_per_node: int = 8) -> Topology:
  """DGX-H100-class nodes: NVLink4 inside, one 400 Gbit/s InfiniBand NIC per GPU."""
  return Topology((Axis("node", nodes, INFINIBAND_NDR), Axis("gpu", gpus_per_node, NVLINK4)),
                  "8xH100 NVLink + IB NDR 400")


# ----------------------------------------------------------------------------- cost model


class Cost(NamedTuple):
  """Modelled cost of one collective.

  Attributes:
    time: seconds, the critical path.
    bytes_sent: bytes one device sends, averaged over devices (the ``wire_bytes`` rule).
  """
  time: float
  bytes_sent: float


@functools.lru_cache(maxsize=4096)
def _step_links(topology: Topology, pairs: collectives.Pairs) -> tuple[tuple[Link, int], ...]:
  """The links a step's pairs use, each with its largest number of senders on one medium."""
  src, dst = (np.array(side) for side in zip(*pairs))
  src_coords = np.stack(np.unravel_index(src, topology.sizes), axis=1)
  dst_coords = np.stack(np.unravel_index(dst, topology.sizes), axis=1)
  crossed = np.argmax(src_coords != dst_coords, axis=1)
  names = [a.name for a in topology.axes]
  loads = []
  for a in np.unique(crossed):
    axis = topology.axes[a]
    senders = np.unique(src[crossed == a])
    concurrency = 1
    if axis.shared_by:  # senders on one medium agree on every axis outside shared_by
      keep = [i for i, name in enumerate(names) if name not in axis.shared_by]
      media = np.ravel_multi_index(
          [np.unravel_index(senders, topology.sizes)[i] for i in keep],
          [topology.sizes[i] for i in keep]) if keep else np.zeros_like(senders)
      concurrency = int(np.bincount(media).max())
    loads.append((axis.link, concurrency))
  return tuple(loads)


def steps_cost(steps: Sequence[collectives.Step], topology: Topology) -> Cost:
  """Prices a list of steps (see module docstring).

  Args:
    steps: the schedule, e.g. ``collectives.SCHEDULES[name].steps(...)``; ranks over
      ``topology``'s devices.
    topology: the cluster.

  Returns:
    The :class:`Cost`.
  """
  time = sent = 0.0
  for step in steps:
    time += max(link.alpha + step.send_bytes * link.beta * concurrency +
                step.reduce_bytes * link.gamma
                for link, concurrency in _step_links(topology, step.pairs))
    sent += step.send_bytes * len({s for s, _ in step.pairs}) / topology.num_devices
  return Cost(time, sent)


def dense_cost(algorithm: str, topology: Topology, n: int, itemsize: int = 4) -> Cost:
  """All-reduce of ``n`` elements by one of :data:`collectives.SCHEDULES` over all devices.

  Flat schedules rank the devices row-major over the topology's axes; ``"hierarchical"`` needs
  a two-axis topology (slow, fast).
  """
  schedule = collectives.check_schedule(algorithm)
  schedule.check(len(topology.axes), tuple(a.name for a in topology.axes),
                 f"dense_cost on topology {topology.name!r}")
  return steps_cost(schedule.steps(topology.sizes, n, itemsize), topology)


def shared_support_cost(algorithm: str, topology: Topology, k: int, itemsize: int = 4, *,
                        index_elements: int = 0) -> Cost:
  """All-reduce of a payload whose ``k`` coordinates are the same on every worker.

  Args:
    algorithm: the dense schedule that carries the compact payload.
    topology: the cluster.
    k: kept elements per worker.
    itemsize: bytes per value.
    index_elements: elements of block indices appended to the payload, if the support is not
      derived identically on every worker (0 for random-k with a shared key).
  """
  return dense_cost(algorithm, topology, k + index_elements, itemsize)


def all_reduce_cost(schedule: str, topology: Topology, n: int, itemsize: int = 4) -> Cost:
  """All-reduce of ``n`` elements by ``schedule`` (``"auto"``: the model's fastest for ``n``)."""
  if schedule == "auto":
    schedule = fastest_schedule(topology, n, itemsize)
  return dense_cost(schedule, topology, n, itemsize)


def all_gather_cost(topology: Topology, payload_bytes: float) -> Cost:
  """All-gather of every worker's ``payload_bytes``, as a ring of ``p - 1`` steps."""
  p = topology.num_devices
  return steps_cost([collectives.Step(collectives.ring_pairs(p), payload_bytes)] * (p - 1),
                    topology)


def topk_allgather_cost(topology: Topology, k: int, itemsize: int = 4,
                        index_itemsize: int = 4) -> Cost:
  """All-gather of every worker's ``k`` (value, index) pairs, as a ring of ``p - 1`` steps."""
  return all_gather_cost(topology, k * (itemsize + index_itemsize))


def chunked_topk_allgather_cost(topology: Topology, num_chunks: int, k: int, index_bits: int,
                                value_bits: int = 2, chunk_bytes: int = 16) -> Cost:
  """All-gather of every worker's chunked top-k payload (SparseLoCo's transport,
  ``compressors._chunked_topk``): ``k`` values of ``value_bits`` bits and ``k`` chunk-local
  indices of ``index_bits`` bits per chunk, each kind packed into one byte stream, plus
  ``chunk_bytes`` of side information per chunk (its four float32 levels), as a ring of
  ``p - 1`` steps."""
  count = num_chunks * k
  payload = (-(-count * value_bits // 8) + -(-count * index_bits // 8)
             + num_chunks * chunk_bytes)
  return all_gather_cost(topology, payload)


def total(costs: Sequence[Cost]) -> Cost:
  """Collectives run one after another: their times and bytes add up."""
  return Cost(sum(c.time for c in costs), sum(c.bytes_sent for c in costs))


def sparse_butterfly_cost(topology: Topology, n: int, k: int, itemsize: int = 4, *,
                          fill: str = "static", switch_density: float | None = None) -> Cost:
  """SparCML's sparse recursive doubling of per-worker ``k``-sparse vectors of length ``n``.

  Args:
    topology: the cluster.
    n: dense length.
    k: nonzeros per worker.
    itemsize: bytes per value (indices are int32).
    fill: ``"static"`` prices :func:`collectives.sparse_butterfly_all_reduce` as compiled
      (capacity doubles each step: worst-case union); ``"expected"`` prices a dynamic-size
      implementation on random supports, whose union after merging ``m`` sets has expected
      size ``n (1 - (1 - k/n)^m)``.
    switch_density: fill-in at which the vector goes dense (default: break-even size).
  """
  if fill not in SPARSE_FILLS:
    raise ValueError(f"sparse_butterfly_cost: fill={fill!r} is unknown; allowed: {SPARSE_FILLS}")
  if switch_density is None:
    switch_density = collectives.default_switch_density(itemsize)
  if fill == "static":
    return steps_cost(collectives.sparse_butterfly_steps(topology.sizes, n, k, itemsize,
                                                         switch_density=switch_density),
                      topology)
  entry = np.dtype(collectives.INDEX_DTYPE).itemsize + itemsize
  sets, dense, steps = 1, False, []
  for phase in collectives.sparse_butterfly_phases(topology.num_devices, n, k, 1.0):
    union = n * (1 - (1 - k / n) ** sets)
    dense = dense or union > switch_density * n
    send = n * itemsize if dense else union * entry
    reduced = 0 if phase.kind == "fold_out" else (n if dense else union) * itemsize
    steps.append(collectives.Step(phase.pairs, send, reduced))
    sets *= 2
  return steps_cost(steps, topology)


def two_phase_cost(topology: Topology, chunk_bytes: float, decoded_bytes: float = 0.0) -> Cost:
  """1-bit Adam's compressed all-reduce (:mod:`compressors.protocol`'s ``"two_phase"``): an
  all-to-all of compressed chunks of ``chunk_bytes``, decoded (``decoded_bytes`` each) and
  summed at their owner, then an all-gather of the re-compressed chunks. The all-to-all is
  priced as ``p - 1`` pairwise shifts, the all-gather as a ring."""
  p = topology.num_devices
  shifts = [collectives.Step(tuple((i, (i + s) % p) for i in range(p)), chunk_bytes,
                             decoded_bytes) for s in range(1, p)]
  gather = [collectives.Step(collectives.ring_pairs(p), chunk_bytes)] * (p - 1)
  return steps_cost(shifts + gather, topology)


def onebit_cost(topology: Topology, n: int, *, bits: int = 1, scale_bytes: int = 4,
                itemsize: int = 4) -> Cost:
  """The two-phase exchange of ``n`` elements as ``bits``-bit codes: a chunk is
  ``ceil(n/p * bits / 8) + scale_bytes`` (:func:`two_phase_cost`)."""
  p = topology.num_devices
  chunk = math.ceil(math.ceil(n / p) * bits / 8) + scale_bytes
  return two_phase_cost(topology, chunk, math.ceil(n / p) * itemsize)


def collective_cost(algorithm: str, topology: Topology, n: int, density: float = 1.0,
                    itemsize: int = 4) -> Cost:
  """Cost of exchanging an ``n``-element bucket at ``density`` with ``algorithm``.

  Args:
    algorithm: one of :data:`ALGORITHMS`. Dense schedules at density < 1 carry a shared
      support of ``ceil(density * n)`` elements; ``"topk_allgather"`` and
      ``"sparse_butterfly"`` carry per-worker supports of that size; ``"onebit"`` needs
      density 1.
    topology: the cluster.
    n: elements in the bucket.
    density: kept fraction in (0, 1].
    itemsize: bytes per value.

  Returns:
    The :class:`Cost`.

  Raises:
    ValueError: unknown algorithm, density outside (0, 1], or density < 1 for ``"onebit"``.
  """
  if algorithm not in ALGORITHMS:
    raise ValueError(f"collective_cost: algorithm={algorithm!r} is unknown; allowed: "
                     f"{ALGORITHMS}")
  if not 0 < density <= 1:
    raise ValueError(f"collective_cost: density={density!r} must lie in (0, 1]")
  k = max(1, math.ceil(density * n))
  if algorithm == "topk_allgather":
    return topk_allgather_cost(topology, k, itemsize)
  if algorithm == "sparse_butterfly":
    return sparse_butterfly_cost(topology, n, k, itemsize)
  if algorithm == "onebit":
    if density != 1:
      raise ValueError(f"collective_cost: 'onebit' sends every coordinate; density={density} "
                       "must be 1")
    return onebit_cost(topology, n, itemsize=itemsize)
  return shared_support_cost(algorithm, topology, k, itemsize)


def schedules_for(topology: Topology) -> tuple[str, ...]:
  """The explicit schedules of :data:`collectives.SCHEDULES` that run on ``topology``'s axes
  and differ from each other there: ``"psum"`` (priced like ``"ring"``) is left out, and so is
  ``"hierarchical"`` where an axis has one device (it is then the ring)."""
  return tuple(name for name, s in collectives.SCHEDULES.items()
               if name != "psum" and s.fits(len(topology.axes))
               and (s.num_axes is None or min(topology.sizes) > 1))


def fastest_schedule(topology: Topology, n: int, itemsize: int = 4,
                     schedules: Sequence[str] | None = None) -> str:
  """The dense all-reduce schedule the model says is fastest for ``n`` elements.

  Args:
    topology: the cluster the all-reduce runs on.
    n: elements all-reduced.
    itemsize: bytes per element.
    schedules: candidates; by default every explicit schedule the topology supports
      (``"hierarchical"`` only on two axes).

  Returns:
    The name of the schedule with the least modelled time (ties: the earlier candidate).
  """
  if schedules is None:
    schedules = schedules_for(topology)
  return min(schedules, key=lambda s: dense_cost(s, topology, n, itemsize).time)
