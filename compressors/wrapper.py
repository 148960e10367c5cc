"""``compress``: a compressor with error feedback as an Optax gradient transformation.

The transformation runs per worker inside ``jax.shard_map`` or ``jax.pmap`` over ``axis_name``.
Its ``update`` receives this worker's gradient, adds the error-feedback residual, encodes the
result, performs the collective itself, and returns the mean over workers of the decoded
gradients, bit-identical on every worker, ready for the optimizer that follows in the chain.

Error feedback (Seide et al. 2014; Stich et al. 2018 "Sparsified SGD with memory"; Karimireddy
et al. 2019 "Error feedback fixes SignSGD and other gradient compression schemes"):

  a = g + e;   sent = decode(encode(a));   e' = a - sent

so that ``sent + e' == a`` at every step: nothing that was not sent is lost. With
``error_decay = beta < 1`` (SparseLoCo, Sarfi et al. 2025, arXiv 2508.15706) the residual fades
before it is added, ``a = g + beta e``: what is not sent for long is forgotten rather than sent
late, and ``sent + e' == a`` still holds.
"""

import dataclasses
from collections.abc import Callable, Hashable
import numbers
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import optax

from compressors.network import axes
from compressors.network import collectives
from compressors import protocol

# JAX 0.11's shard_map crashes on zero-element outputs beside others (seen with 0.11.2).
_EMPTY_LEAVES_CRASH = jax.__version_info__[:2] == (0, 11)


class CompressState(NamedTuple):
  """State of :func:`compress`, one per worker.

  Attributes:
    count: number of updates so far (int32); identical on every worker.
    key: the PRNG key the transformation was seeded with (raw ``uint32[2]``); folded with
      ``count`` and the buffer index every step.
    residual: error-feedback memory shaped like the gradients (float32 or wider), or ``()``
      when error feedback is off.
    buffers: :class:`compressors.protocol.BufferState` of the single fused buffer, or a tuple
      with one per leaf.
    sent: with ``report_sent=True``, boolean masks shaped like the gradients of the entries
      this worker sent at the latest step; ``()`` otherwise.
  """
  count: jax.Array
  key: jax.Array
  residual: chex.ArrayTree
  buffers: Any
  sent: chex.ArrayTree = ()


@dataclasses.dataclass(frozen=True)
class _Settings:
  """The static arguments of one :func:`compress`."""
  compressor: protocol.Compressor
  axis_name: axes.AxisName
  dense_axis: axes.AxisName
  error_feedback: bool
  error_decay: float
  fuse: bool
  seed: int
  schedule_of_buffer: Callable[[int, int], str]
  topology: Any
  report_sent: bool


def compress(compressor: protocol.Compressor, *, axis_name: axes.AxisName,
             dense_axis: axes.AxisName = None, error_feedback: bool = True, fuse: bool = True,
             seed: int = 0, schedule: Any = "psum", topology: Any = None,
             report_sent: bool = False,
             error_decay: float = 1.0) -> optax.GradientTransformationExtraArgs:
  """Compresses each worker's gradient, exchanges it, and returns the decoded mean.

  Args:
    compressor: a :class:`compressors.Compressor`, e.g. ``compressors.topk(0.01)``.
    axis_name: the mesh axis (or tuple of axes) over which workers hold different gradients.
      ``update`` must run where it is bound (inside ``shard_map``/``pmap``); ``None`` compresses
      and decodes locally with no collective.
    dense_axis: a fast axis (e.g. the GPUs of one node) to reduce over densely first:
      hierarchical mode. Each buffer is reduce-scattered over ``dense_axis``; each device
      compresses only the ``1/g`` shard it owns and exchanges it over ``axis_name`` (the slow
      inter-node axis); the mean shards are all-gathered over ``dense_axis``. The slow link then
      carries ``1/g`` of the flat mode's bytes. The residual keeps the layout of the gradient
      (zero outside the owned shard), so error feedback works unchanged.
    error_feedback: keep what was not sent and add it to the next step's gradient.
    fuse: concatenate all leaves into one buffer and compress it as one (one selection over the
      whole model, one collective), as Horovod's tensor fusion does; ``False`` compresses each
      leaf on its own.
    seed: seeds the keys of randomised compressors (random-k, stochastic rounding); the shared
      key is identical on all workers, so it must be the same seed everywhere.
    schedule: how summable payloads are all-reduced: a name of
      :data:`compressors.network.collectives.SCHEDULES` (``"psum"``, XLA's all-reduce, by default;
      ``"ring"``, ``"butterfly"``, ``"rabenseifner"``, ``"hierarchical"`` over
      ``axis_name=(slow, fast)``); ``"auto"``, the fastest on ``topology`` by the alpha-beta
      model for each payload's size; or a :class:`compressors.network.planner.Plan` with one choice
      per buffer (one when fused, one per leaf otherwise), whose schedule each buffer's payload uses
      (the density stays the compressor's: build the compressor from the plan's densities).
      Explicit schedules come out of ``ppermute``, which JAX types as varying: run them under
      ``shard_map(..., check_vma=False)``.
    topology: the :class:`compressors.network.topology.Topology` of the workers, for ``"auto"``; its
      device count must equal the workers along ``axis_name``.
    report_sent: keep in the state (``CompressState.sent``) which entries each worker sent at
      the latest step, for wrappers that need it (:func:`compressors.momentum_correction`);
      costs one boolean per gradient entry and worker. Flat mode only.
    error_decay: the factor ``beta`` in [0, 1] the residual is multiplied by before it is added
      to the next gradient, ``a = g + beta e`` (SparseLoCo, Sarfi et al. 2025, arXiv
      2508.15706, decays it by 0.95); 1, the default, is error feedback as Seide et al. and
      Stich et al. have it, bit for bit. Needs ``error_feedback``.

  Returns:
    An ``optax.GradientTransformationExtraArgs``. Extra arguments named in
    ``compressor.extra_args`` (shaped like the gradients) are passed to the compressor; others
    are ignored, so the transformation chains with any other.
  """
  settings = _Settings(
      compressor=compressor, axis_name=axis_name, dense_axis=dense_axis,
      error_feedback=error_feedback,
      error_decay=_check_error_decay(error_decay, error_feedback), fuse=fuse, seed=seed,
      schedule_of_buffer=_check_arguments(compressor, axis_name, dense_axis, seed, schedule,
                                          topology, report_sent),
      topology=topology, report_sent=report_sent)
  return optax.GradientTransformationExtraArgs(
      lambda params: _init(settings, params),
      lambda updates, state, params=None, **extra_args: _update(settings, updates, state,
                                                               extra_args))


def _check_arguments(compressor, axis_name, dense_axis, seed, schedule, topology,
                     report_sent) -> Callable[[int, int], str]:
  """Validates ``compress``'s arguments; returns ``(buffer index, buffer count) -> schedule``."""
  if not isinstance(compressor, protocol.Compressor):
    raise TypeError(f"compress: compressor must be a compressors.Compressor (e.g. "
                    f"compressors.topk(0.01)), got {type(compressor).__name__}: {compressor!r}")
  _check_axis_name(axis_name)
  _check_axis_name(dense_axis)
  if set(axes.as_tuple(axis_name)) & set(axes.as_tuple(dense_axis)):
    raise ValueError(f"compress: axis_name={axis_name!r} and dense_axis={dense_axis!r} share an "
                     "axis; the dense (fast) axis and the compressed (slow) axis must differ")
  if not isinstance(seed, int):
    raise TypeError(f"compress: seed must be an int, got {seed!r}")
  if compressor.exchange not in protocol.EXCHANGES:
    raise ValueError(f"compress: compressor {compressor.name!r} has exchange="
                     f"{compressor.exchange!r}; allowed: {protocol.EXCHANGES}")
  if compressor.average not in protocol.AVERAGES:
    raise ValueError(f"compress: compressor {compressor.name!r} has average="
                     f"{compressor.average!r}; allowed: {protocol.AVERAGES}")
  if compressor.average == "senders" and (compressor.exchange != "all_gather"
                                          or compressor.sent_mask_of is None):
    raise ValueError(f"compress: compressor {compressor.name!r} has average='senders', which "
                     "needs exchange='all_gather' and sent_mask_of (each worker's payload says "
                     f"what it sent); it has exchange={compressor.exchange!r}")
  if report_sent and dense_axis is not None:
    raise ValueError(f"compress: report_sent=True with dense_axis={dense_axis!r}: in "
                     "hierarchical mode a device sends the reduced shard of its node, not its own "
                     "entries; report_sent is for flat mode")
  return _schedules(schedule, topology, axis_name)


def _check_error_decay(error_decay: float, error_feedback: bool) -> float:
  """``error_decay`` as a float, refused outside [0, 1] or, unless 1, without error feedback."""
  if isinstance(error_decay, bool) or not isinstance(error_decay, numbers.Real):
    raise TypeError(f"compress: error_decay must be a number in [0, 1], got {error_decay!r}")
  if not 0.0 <= float(error_decay) <= 1.0:
    raise ValueError(f"compress: error_decay={error_decay!r} is outside [0, 1]; it multiplies "
                     "the error-feedback residual before it is added to the next gradient (1: "
                     "no decay)")
  if float(error_decay) != 1.0 and not error_feedback:
    raise ValueError(f"compress: error_decay={error_decay!r} with error_feedback=False: there is "
                     "no residual to decay; allowed: error_decay=1.0, or error_feedback=True")
  return float(error_decay)


def _init(s: _Settings, params: chex.ArrayTree) -> CompressState:
  paths, leaves, _ = _flatten(params)
  _check_leaves(paths, leaves, "params", s.fuse)
  num_workers = (axes.num_workers(s.axis_name, caller="compress") if axes.is_bound(s.axis_name)
                 else 1 if s.axis_name is None else None)
  buffers = [jnp.zeros((x.size,), _work_dtype(x.dtype)) for x in leaves]
  if s.fuse:
    buffers = [jnp.zeros((sum(b.size for b in buffers),), _common_dtype(buffers))]
  if s.dense_axis is not None:
    group = axes.num_workers(s.dense_axis, caller="compress (dense_axis; call init() inside "
                             "shard_map: the owned shard's size depends on it)")
    buffers = [jnp.zeros((-(-b.size // group),), b.dtype) for b in buffers]
  shapes = ([x.shape for x in leaves] if not s.fuse and s.dense_axis is None
            else [None] * len(buffers))
  wheres = [f"params leaf {p}" for p in paths] if not s.fuse else ["the fused parameters"]
  buffer_states = tuple(
      protocol.init_buffer_state(s.compressor, b, num_workers, s.error_feedback, shape,
                                 jax.random.fold_in(jax.random.PRNGKey(s.seed), i), where)
      for i, (b, shape, where) in enumerate(zip(buffers, shapes, wheres)))
  residual = (jax.tree.map(lambda x: jnp.zeros(x.shape, _work_dtype(x.dtype)), params)
              if s.error_feedback else ())
  sent = jax.tree.map(lambda x: jnp.zeros(x.shape, bool), params) if s.report_sent else ()
  return CompressState(count=jnp.zeros((), jnp.int32), key=jax.random.PRNGKey(s.seed),
                       residual=residual, buffers=buffer_states[0] if s.fuse else buffer_states,
                       sent=sent)


class _Layout(NamedTuple):
  """How a gradient pytree maps to buffers: all leaves fused into one, or one per leaf."""
  treedef: Any
  fuse: bool

  def to_buffers(self, leaves: list) -> list[jax.Array]:
    if self.fuse:
      return [_fuse(leaves)]
    return [x.reshape(-1) for x in leaves]

  def to_tree(self, buffers: list, like: list) -> chex.ArrayTree:
    """The pytree of ``buffers``, each leaf shaped and typed like the leaf of ``like``."""
    flat = _unfuse(buffers[0], [x.size for x in like]) if self.fuse else buffers
    return self.treedef.unflatten([b.reshape(x.shape).astype(x.dtype)
                                   for b, x in zip(flat, like)])


class _Exchanged(NamedTuple):
  """One buffer after its exchange."""
  mean: jax.Array
  kept: jax.Array
  state: protocol.BufferState
  sent_mask: jax.Array | None


def _update(s: _Settings, updates: chex.ArrayTree, state: CompressState,
            extra_args: dict[str, Any]) -> tuple[chex.ArrayTree, CompressState]:
  num_workers = axes.num_workers(s.axis_name, caller="compress")
  if s.topology is not None and s.topology.num_devices != num_workers:
    raise ValueError(f"compress: topology {s.topology.name!r} has {s.topology.num_devices} "
                     f"devices but axis_name={s.axis_name!r} has {num_workers} workers; they "
                     "must match")
  paths, grads, treedef = _flatten(updates)
  _check_leaves(paths, grads, "gradient", s.fuse)
  axes.check_per_worker(updates, axes.as_tuple(s.axis_name) + axes.as_tuple(s.dense_axis),
                        "compress")
  layout = _Layout(treedef, s.fuse)
  grad_buffers = layout.to_buffers([g.astype(_work_dtype(g.dtype)) for g in grads])
  residuals = treedef.flatten_up_to(state.residual) if s.error_feedback else None
  residual_buffers = (layout.to_buffers(residuals) if s.error_feedback
                      else [None] * len(grad_buffers))
  if s.error_feedback and s.error_decay != 1.0:  # 1: no multiply, so no change in any bit
    residual_buffers = [e * s.error_decay for e in residual_buffers]
  extras = {name: layout.to_buffers(_extra_leaves(name, extra_args[name], treedef, grads))
            for name in s.compressor.extra_args if extra_args.get(name) is not None}
  wheres = (["the fused gradient"] if s.fuse else [f"gradient leaf {p}" for p in paths])
  base_ctx = protocol.Context(
      axis_name=s.axis_name, num_workers=num_workers, size=0, shape=(), step=state.count,
      worker_index=axes.worker_index(s.axis_name), shared_key=jax.random.fold_in(
          state.key, state.count), private_key=state.key, extras={}, topology=s.topology,
      # Buffers this step made, or flat arguments of a local step (see protocol.Context).
      owns_buffers=(s.fuse and len(grads) > 1) or (
          s.axis_name is None and all(g.ndim == 1 for g in grads)),
      dense_axis=s.dense_axis)
  buffer_states = (state.buffers,) if s.fuse else state.buffers
  outs = [_exchange_buffer(s, i, g, e, b, {k: v[i] for k, v in extras.items()}, wheres[i],
                           base_ctx, grads[i].shape, len(grad_buffers))
          for i, (g, e, b) in enumerate(zip(grad_buffers, residual_buffers, buffer_states))]
  sent = ()
  if s.report_sent:
    sent = layout.to_tree([jnp.ones(o.mean.shape, bool) if o.sent_mask is None else o.sent_mask
                           for o in outs], [jnp.zeros(g.shape, bool) for g in grads])
  new_state = CompressState(
      count=state.count + 1, key=state.key,
      residual=layout.to_tree([o.kept for o in outs], residuals) if s.error_feedback else (),
      buffers=outs[0].state if s.fuse else tuple(o.state for o in outs), sent=sent)
  return layout.to_tree([o.mean for o in outs], grads), new_state


def _exchange_buffer(s: _Settings, i: int, g: jax.Array, e: jax.Array | None,
                     bstate: protocol.BufferState, extras: dict[str, jax.Array], where: str,
                     base_ctx: protocol.Context, leaf_shape: tuple[int, ...],
                     num_buffers: int) -> _Exchanged:
  """Exchanges buffer ``i`` (gradient ``g``, residual ``e``) with the other workers."""
  group = axes.num_workers(s.dense_axis, caller="compress (dense_axis)")
  size = -(-g.size // group)
  if s.compressor.validate is not None:
    s.compressor.validate(size, where)
  shared_key = jax.random.fold_in(base_ctx.shared_key, i)
  # Unique per device: in hierarchical mode devices of one fast group share a worker index.
  device = axes.worker_index(axes.as_tuple(s.axis_name) + axes.as_tuple(s.dense_axis))
  if s.dense_axis is not None:
    extras = {k: protocol.owned_shard(v, s.dense_axis, group) for k, v in extras.items()}
  ctx = base_ctx._replace(
      size=size, shape=leaf_shape if not s.fuse and s.dense_axis is None else (size,),
      shared_key=shared_key, private_key=jax.random.fold_in(shared_key, device + 1),
      extras=extras, schedule=s.schedule_of_buffer(i, num_buffers))
  if s.compressor.precondition is not None:
    # On the raw local gradient, before any sum: every device is a worker here.
    raw_ctx = ctx._replace(num_workers=ctx.num_workers * group, size=g.size, shape=(g.size,))
    g, cstate = s.compressor.precondition(g, bstate.compressor, raw_ctx)
    bstate = bstate._replace(compressor=cstate)
  if isinstance(s.compressor.aggregate, protocol.ResidualAggregate) and s.dense_axis is None:
    out, kept = s.compressor.aggregate.with_residual(g, e, bstate.compressor, ctx)
    out = out._replace(state=bstate._replace(compressor=out.state))
  else:
    x = g if e is None else g + e
    if s.dense_axis is not None:
      x = _reduce_scatter(x, s.dense_axis, group)
    out = protocol.exchange(s.compressor, x, bstate, ctx)
    kept = x - out.sent
  if s.dense_axis is None:
    return _Exchanged(out.mean, kept, out.state, out.sent_mask)
  return _Exchanged(_all_gather(out.mean / group, s.dense_axis, g.size),
                    _place_owned_shard(kept, s.dense_axis, g.size), out.state, None)


def _reduce_scatter(x: jax.Array, axis_name: axes.AxisName, group: int) -> jax.Array:
  """Sum over ``axis_name`` of ``x``, of which this device keeps its ``1/group`` shard."""
  padded = jnp.pad(x, (0, -x.size % group))
  return axes.psum_scatter(padded, axis_name)


def _all_gather(shard: jax.Array, axis_name: axes.AxisName, size: int) -> jax.Array:
  """The full buffer of ``size`` elements from every device's shard along ``axis_name``."""
  return axes.all_gather_invariant(shard, axis_name).reshape(-1)[:size]


def _place_owned_shard(shard: jax.Array, axis_name: axes.AxisName, size: int) -> jax.Array:
  """A buffer of ``size`` elements holding ``shard`` where this device's shard lives, else 0."""
  full = jnp.zeros((shard.size * axes.num_workers(axis_name),), shard.dtype)
  start = axes.worker_index(axis_name) * shard.size
  return jax.lax.dynamic_update_slice(full, shard, (start,))[:size]


def _schedules(schedule: Any, topology: Any,
               axis_name: axes.AxisName) -> Callable[[int, int], str]:
  """Validates ``schedule`` and returns ``(buffer index, buffer count) -> schedule name``."""
  num_axes = len(axes.as_tuple(axis_name))
  if _is_plan(schedule):
    names = [c.algorithm for c in schedule.choices]
    for name in names:
      if name not in collectives.SCHEDULES:
        raise ValueError(f"compress: the plan chose {name!r}, which is not a schedule of "
                         "compressors.network.collectives.SCHEDULES "
                         f"({tuple(collectives.SCHEDULES)})")
      collectives.SCHEDULES[name].check(num_axes, axis_name, "compress (the plan)")

    def from_plan(i, count):
      if count != len(names):
        raise ValueError(f"compress: the plan has {len(names)} buckets but the gradient makes "
                         f"{count} buffers (one when fused, one per leaf otherwise)")
      return names[i]
    return from_plan
  if schedule == "auto":
    if topology is None:
      raise ValueError("compress: schedule='auto' needs topology= (a "
                       "compressors.network.topology.Topology describing the workers' links)")
  else:
    collectives.check_schedule(schedule).check(num_axes, axis_name, "compress")
  return lambda i, count: schedule


def _is_plan(schedule: Any) -> bool:
  """Whether ``schedule`` is a planner's Plan (duck-typed: the planner, which needs scipy, is
  loaded only by those who plan)."""
  return hasattr(schedule, "choices") and hasattr(schedule, "topology")


def _check_axis_name(axis_name: axes.AxisName) -> None:
  names = axes.as_tuple(axis_name)
  if any(not isinstance(n, Hashable) or isinstance(n, (list, dict)) for n in names):
    raise TypeError(f"compress: axis_name must be a mesh-axis name, a tuple of names or None, "
                    f"got {axis_name!r}")


def _work_dtype(dtype) -> jnp.dtype:
  """Buffers and residuals are kept in float32 or wider, whatever the gradient's dtype."""
  return jnp.promote_types(dtype, jnp.float32)


def _common_dtype(buffers) -> jnp.dtype:
  return jnp.result_type(*[b.dtype for b in buffers]) if buffers else jnp.float32


def _flatten(tree: chex.ArrayTree) -> tuple[list[str], list, Any]:
  paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
  return ([jax.tree_util.keystr(p) for p, _ in paths_leaves],
          [jnp.asarray(x) for _, x in paths_leaves], treedef)


def _check_leaves(paths: list[str], leaves: list, what: str, fuse: bool) -> None:
  if not leaves:
    raise ValueError(f"compress: the {what} pytree has no leaves")
  if sum(x.size for x in leaves) == 0:
    raise ValueError(f"compress: every {what} leaf has zero elements; nothing to compress")
  for path, x in zip(paths, leaves):
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise TypeError(f"compress: {what} leaf {path} has dtype {x.dtype}; only floating-point "
                      "leaves can be compressed (integer leaves have no gradient: take them out "
                      "of the differentiated pytree)")
    if x.size == 0 and _EMPTY_LEAVES_CRASH:
      raise ValueError(
          f"compress: {what} leaf {path} has shape {x.shape} (zero elements); JAX "
          f"{jax.__version__} crashes the process (segmentation fault) when a zero-element "
          "array leaves jax.shard_map beside other outputs, as this leaf and its residual "
          "would: drop the leaf from the pytree, or use JAX 0.10 or >= 0.12")
    if x.size == 0 and not fuse:
      raise ValueError(f"compress: {what} leaf {path} has shape {x.shape} (zero elements); "
                       "per-leaf compression needs at least one element per leaf: drop the leaf "
                       "or use fuse=True")


def _extra_leaves(name: str, tree: chex.ArrayTree, treedef, grads: list) -> list:
  """Flattens an extra argument like the gradients, checking structure and shapes."""
  try:
    leaves = treedef.flatten_up_to(tree)
  except (ValueError, TypeError) as err:
    raise ValueError(f"compress: extra argument {name!r} must be a pytree shaped like the "
                     f"gradients ({treedef}); got {jax.tree.structure(tree)}") from err
  for i, (x, g) in enumerate(zip(leaves, grads)):
    if jnp.shape(x) != g.shape:
      raise ValueError(f"compress: extra argument {name!r} leaf #{i} has shape {jnp.shape(x)}, "
                       f"the gradient leaf has shape {g.shape}; they must match")
  return [jnp.asarray(x, _work_dtype(g.dtype)) for x, g in zip(leaves, grads)]


def _fuse(leaves: list) -> jax.Array:
  dtype = _common_dtype(leaves)
  return jnp.concatenate([x.reshape(-1).astype(dtype) for x in leaves])


def _unfuse(flat: jax.Array, sizes: list[int]) -> list:
  offsets = [0]
  for s in sizes:
    offsets.append(offsets[-1] + s)
  return [flat[a:b] for a, b in zip(offsets[:-1], offsets[1:])]
