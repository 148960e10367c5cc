"""How long a training step takes, modelled: its compute plus the communication the cost model
prices (:func:`compressors.registry.cost`), less what of it hides behind compute.

Compute is given (measured by the caller: F5 takes each run's logged step time); communication
is the alpha-beta model's. What hides depends on what a step kind does (its options,
:mod:`compressors.method_protocol`):

* a plain all-reduce of the gradient (a method with ``Method.overlaps_backward``: dense, fp16,
  bf16), where ``overlap`` allows, goes in buckets as the backward pass produces them, the way
  data parallelism is run when tuned (PyTorch DDP's gradient buckets, XLA's latency-hiding
  scheduler): :func:`overlapped_seconds`. Without ``overlap`` it waits for the whole backward
  pass, as every method's step did before this model (the float32, non-overlapped baseline);
* any other per-step exchange (top-k, TASC, PowerSGD, a quantizer with error feedback, a method
  that is its own optimizer) needs the whole gradient first: compute + communication;
* a local-update method's steps send and land what their kinds declare (``StepKind.sends``,
  ``StepKind.lands``: nothing, the whole model, or one of the method's ``Method.parts``), by
  its carrier: its local steps send nothing; DiLoCo's synchronisation pays its exchange after
  the step's compute;
* Streaming DiLoCo's fragment exchange starts after its synchronising step and runs beside the
  next ``overlap`` (``tau``, its ``Method.lands_after``) steps; its landing step waits only for
  what those steps' compute did not hide: ``max(0, exchange - tau * compute)``; with
  ``tau = 0`` the synchronising step waits for all of it. Our JAX programs run each fragment's
  collective inside its synchronising step; this prices the schedule the paper runs (Douillard
  et al. 2025), not a measurement.

Islands (:func:`island_kind_times`): a two-level topology, islands across its major (slow)
axis and an island's fsdp devices along its minor (fast) one. The method's exchange runs across
the islands on each device's shard, every device of an island at once (through a shared medium,
such as one NIC per node, each gets its share). On the fast link each step gathers parameters
and reduce-scatters their gradient, not hidden (the forward pass waits for a gather, the update
for the reduce-scatter). How much it gathers the shapes alone cannot tell: the loss gathers a
leaf in every block that reads it and again in the backward pass where that block's gradient
reads it (:mod:`compressors.parallel.gather_on_use`; a tied embedding twice or more, a bias
not at all). Given the compiled program's collectives (``fast_collectives``, from
:meth:`~compressors.parallel.data_parallel.DataParallel.wire_bytes`), the fast link is charged
exactly those, each as a ring over its group (:func:`collectives_seconds`); without them, ZeRO-3's
minimum, one gather and one reduce-scatter of the whole model, a lower bound.

Limits, said where the figures are used: one link class (the topology's), the buckets in
reverse leaf order (the backward pass's order) of :data:`BUCKET_BYTES` of float32 gradient with a
leaf never split, the backward pass :data:`BACKWARD_SHARE` of a step's compute spread over the
parameters in proportion to their size, and no contention between compute and communication.
"""

import dataclasses
import math
from typing import Any, Mapping, NamedTuple, Sequence

from compressors import registry
from compressors.method_protocol import WHOLE_MODEL
from compressors.network import collectives as collectives_lib
from compressors.network import topology as topology_lib
from compressors.parallel import fsdp
from compressors.parallel import hlo_bytes

__all__ = ("BACKWARD_SHARE", "BUCKET_BYTES", "StepTime", "bucket_sizes", "collectives_seconds",
           "island_kind_times", "kind_times", "mean_step_seconds", "overlapped_seconds")

# The backward pass costs about twice the forward's FLOPs (two matrix products per one).
BACKWARD_SHARE = 2 / 3
# PyTorch DDP's default gradient bucket (bucket_cap_mb=25), of the float32 gradient.
BUCKET_BYTES = 25 * 2**20


class StepTime(NamedTuple):
  """Modelled seconds of one step.

  Attributes:
    compute: the step's compute (given).
    communication: the seconds its collectives take on the link (hidden or not).
    total: the step's wall-clock: compute plus what of the communication is not hidden.
  """
  compute: float
  communication: float
  total: float

  @property
  def exposed(self) -> float:
    """The communication seconds the step waits for."""
    return self.total - self.compute


def bucket_sizes(shapes: Sequence[tuple[int, ...]], bucket_bytes: int = BUCKET_BYTES
                 ) -> list[int]:
  """Entries of each gradient bucket, in the order the backward pass fills them (the leaves
  reversed), each closed once the next leaf would take it past ``bucket_bytes`` of float32 (a
  leaf larger than that is a bucket alone)."""
  buckets, current = [], 0
  for shape in reversed([tuple(s) for s in shapes]):
    n = math.prod(shape)
    if current and 4 * (current + n) > bucket_bytes:
      buckets.append(current)
      current = 0
    current += n
  if current or not buckets:
    buckets.append(current)
  return buckets


def overlapped_seconds(compute: float, bucket_sizes_: Sequence[int],
                       bucket_seconds: Sequence[float],
                       backward_share: float = BACKWARD_SHARE) -> float:
  """A step whose buckets are all-reduced one after another on the link as soon as the backward
  pass has produced them: bucket ``i`` is ready at ``forward + backward * (its entries and those
  before it) / all entries``; it starts when ready and when the link is free; the step ends
  when both the compute and the last bucket are done. About ``max(compute, communication)``
  plus the last bucket's exchange, which nothing can hide.

  Args:
    compute: seconds of the step's forward and backward passes.
    bucket_sizes_: entries of each bucket, in backward order (:func:`bucket_sizes`).
    bucket_seconds: each bucket's all-reduce seconds.
    backward_share: the backward pass's share of ``compute``.
  """
  total = sum(bucket_sizes_) or 1
  forward = compute * (1 - backward_share)
  done, ready_entries = 0.0, 0
  for entries, seconds in zip(bucket_sizes_, bucket_seconds):
    ready_entries += entries
    ready = forward + compute * backward_share * ready_entries / total
    done = max(ready, done) + seconds
  return max(compute, done)


def kind_times(name: str, shapes: Sequence[tuple[int, ...]], topology: topology_lib.Topology,
               compute: float, settings: Any = None, *, exchange_settings: Any = None,
               kinds: Sequence[Any] | None = None, overlap: bool = True,
               schedule: str = "psum") -> dict[str, StepTime]:
  """Each step kind's :class:`StepTime` for method ``name`` (see the module docstring).

  Args:
    name: a registered method.
    shapes: the parameters' shapes, in leaf order.
    topology: the workers and their links.
    compute: seconds of one step's compute (a local-update method's inner step too).
    settings: the method's settings (None: its defaults).
    exchange_settings: a local-update method's exchange's settings.
    kinds: the step kinds (None: :func:`compressors.registry.step_kinds` of the settings).
    overlap: whether a method that can overlap its all-reduce with the backward pass does
      (False: the non-overlapped baseline).
    schedule: the all-reduce schedule the cost model prices.

  Returns:
    Step kind name -> its time.

  Raises:
    ValueError: a kind the model cannot price (a density warm-up's stages).
  """
  method = registry.get(name)
  settings = method.settings() if settings is None else settings
  shapes = [tuple(s) for s in shapes]
  if kinds is None:
    kinds = registry.step_kinds(name, settings, exchange_settings=exchange_settings)
  price = lambda who, shapes_, own=None: registry.cost(
      who, shapes_, topology, own, schedule=schedule).time
  out = {}
  for kind in kinds:
    options = kind.update_kwargs()
    if "density_stage" in options:
      raise ValueError(f"step_time: {name}'s density warm-up kind {kind.name!r} is not priced")
    if method.per_worker_params:
      out[kind.name] = _local_kind_time(method, settings, kind, shapes, compute,
                                        lambda shapes_: price(method.carrier(settings), shapes_,
                                                              exchange_settings))
      continue
    who = kind_method(name, kind)
    if overlap and registry.get(who).overlaps_backward:
      sizes = bucket_sizes(shapes)
      seconds = [price(who, [(n,)], None if who != name else settings) for n in sizes]
      out[kind.name] = StepTime(compute, sum(seconds), overlapped_seconds(compute, sizes,
                                                                          seconds))
    else:
      sent = price(who, shapes, None if who != name else settings)
      out[kind.name] = StepTime(compute, sent, compute + sent)
  return out


def kind_method(name: str, kind: Any) -> str:
  """The method whose exchange a step of ``kind`` of method ``name`` runs: ``"dense"`` for a
  step that sends the dense gradient (1-bit Adam's warm-up and refreshes, ``compressed=False``),
  else ``name``."""
  return "dense" if kind.update_kwargs().get("compressed") is False else name


def _local_kind_time(method, settings, kind, shapes, compute: float, exchange) -> StepTime:
  """A local-update method's step of ``kind``: it sends the part its kind sends
  (``kind.sends``: nothing, the whole model, or one of ``method.parts``) by ``exchange``
  (``shapes -> seconds``), and waits for the part that lands (``kind.lands``) what the
  ``method.lands_after`` steps since its send did not hide."""
  parts = method.parts(settings, shapes) if method.parts is not None else []
  shapes_of = lambda part: shapes if part == WHOLE_MODEL else parts[part]
  sent = exchange(shapes_of(kind.sends)) if kind.sends is not None else 0.0
  waits = 0.0
  if kind.lands is not None:
    hidden = method.lands_after(settings) * compute if method.lands_after is not None else 0.0
    waits = max(0.0, exchange(shapes_of(kind.lands)) - hidden)
  return StepTime(compute, sent, compute + waits)


def island_kind_times(name: str, shapes: Sequence[tuple[int, ...]],
                      topology: topology_lib.Topology, compute: float, settings: Any = None,
                      fast_collectives: Mapping[str, Sequence[hlo_bytes.Collective]] | None = None,
                      **options) -> dict[str, StepTime]:
  """Each step kind's :class:`StepTime` on islands (the module docstring).

  Args:
    name: a registered method.
    shapes: the parameters' (natural) shapes, in leaf order.
    topology: two axes: the islands (major, slow) and each island's fsdp devices (minor, fast).
    compute: seconds of one step's compute.
    settings: the method's settings (None: its defaults).
    fast_collectives: step kind -> the collectives of its compiled program
      (``WireBytes.collectives``); those over the fast axis alone are priced on the fast link.
      None: ZeRO-3's minimum (one gather and one reduce-scatter of the model), a lower bound.
    **options: :func:`kind_times`'s keyword arguments.

  Returns:
    Step kind name -> its time: the exchange across the islands on one shard, plus the
    gathers and reduce-scatters on the fast link.

  Raises:
    ValueError: ``topology`` does not have two axes, or ``fast_collectives`` lacks a kind.
  """
  if len(topology.axes) != 2:
    raise ValueError(f"island_kind_times: topology {topology.name!r} has axes "
                     f"{[a.name for a in topology.axes]}; allowed: two, the islands then fsdp")
  slow, fast = topology.axes
  layouts = [fsdp.leaf_layout(tuple(s), fast.size) for s in shapes]
  link = slow.link
  if fast.name in slow.shared_by:  # an island's devices send their shards through one medium
    link = dataclasses.replace(link, bandwidth=link.bandwidth / fast.size)
  across = kind_times(name, [l.shard_shape for l in layouts],
                      topology_lib.Topology.flat(slow.size, link), compute, settings, **options)
  if fast_collectives is None:
    stored = sum(math.prod(l.stored_shape) for l in layouts)
    zero3 = topology_lib.dense_cost("ring", topology_lib.Topology.flat(fast.size, fast.link),
                                    stored).time if fast.size > 1 else 0.0
    on_fast = dict.fromkeys(across, zero3)
  else:
    missing = sorted(set(across) - set(fast_collectives))
    if missing:
      raise ValueError(f"island_kind_times: fast_collectives has no step kind {missing}; "
                       f"allowed: one entry per kind of {name!r}, {sorted(across)}")
    on_fast = {kind: collectives_seconds([c for c in fast_collectives[kind]
                                          if tuple(c.axes) == (fast.name,)], fast.link)
               for kind in across}
  return {kind: StepTime(t.compute, t.communication + on_fast[kind], t.total + on_fast[kind])
          for kind, t in across.items()}


def collectives_seconds(collectives: Sequence[hlo_bytes.Collective],
                        link: topology_lib.Link) -> float:
  """Seconds a compiled program's ``collectives`` take on ``link``, one after another, each as
  a ring over its group of ``n``: an all-gather, a reduce-scatter or an all-to-all of ``S``
  bytes is ``n - 1`` steps of ``S / n`` (the reduce-scatter adding each), an all-reduce twice
  that, a collective-permute one step of ``S``; times its executions."""
  seconds = 0.0
  for c in collectives:
    n = c.group_size
    if n < 2:
      continue
    ring, chunk = collectives_lib.ring_pairs(n), c.size_bytes / n
    if c.kind == "collective-permute":
      steps = [collectives_lib.Step(ring, c.size_bytes)]
    else:
      reduce = c.kind in ("reduce-scatter", "all-reduce")
      steps = [collectives_lib.Step(ring, chunk, chunk if reduce else 0.0)] * (n - 1)
      if c.kind == "all-reduce":  # a reduce-scatter, then an all-gather of its result
        steps += [collectives_lib.Step(ring, chunk)] * (n - 1)
    seconds += c.executions * topology_lib.steps_cost(
        steps, topology_lib.Topology.flat(n, link)).time
  return seconds


def mean_step_seconds(times: dict[str, StepTime], counts: dict[str, int]) -> float:
  """The mean wall-clock of a step over a run that ran ``counts[kind]`` steps of each kind."""
  steps = sum(counts.values())
  return sum(times[k].total * n for k, n in counts.items()) / max(1, steps)

