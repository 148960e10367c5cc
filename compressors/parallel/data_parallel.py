"""``data_parallel``: the data-parallel training step a compressing transformation needs.

Every step written by hand repeats the same few things, and they are where mistakes happen:
differentiate each worker's loss with respect to a per-worker copy of the parameters (with
respect to the replicated parameters, JAX's autodiff inside ``shard_map`` would already have
summed the gradient over the workers: a hidden dense all-reduce), lay the state out per worker
where it differs (:func:`compressors.state_specs`), skip a step on every worker when any worker's
gradient is not finite (:func:`compressors.skip_nonfinite`: one worker's NaN would otherwise reach
every replica), and read the bytes on the wire from the compiled step. :func:`data_parallel` does
them once::

  dp = compressors.data_parallel(loss, tx, mesh, params, batch)
  state = dp.init(params)
  params, state, metrics = dp.step(params, state, batch)   # batch split over the workers
  print(dp.wire_bytes(params, state, batch).total)

It runs the step under ``jax.shard_map`` over a mesh axis, or under ``jax.pmap`` over the local
devices (``mesh=None``); the long form stays documented (README) for steps it does not cover.
``workers_per_device=W`` runs W simulated workers on each device (:mod:`compressors.parallel.workers`),
with the transformation built over ``axis_name=("data", "worker")``::

  tx = optax.chain(compressors.compress(compressors.topk(0.01), axis_name=("data", "worker")),
                   optax.sgd(0.1))
  dp = compressors.data_parallel(loss, tx, mesh, params, batch, axis_name=("data", "worker"),
                                 workers_per_device=8)
"""

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from compressors.parallel import nonfinite
from compressors.parallel import per_worker
from compressors.network import axes
from compressors.parallel import hlo_bytes
from compressors.parallel import workers as workers_lib

PyTree = Any


class DataParallel(NamedTuple):
  """The functions :func:`data_parallel` returns.

  Attributes:
    init: ``params -> state``, jitted: the transformation's state, per-worker leaves laid out
      per worker (one row per worker, as :attr:`specs` say; under ``pmap`` every leaf).
    step: ``(params, state, batch, *, with_inputs=False) -> (params, state, metrics)``, jitted.
      ``params`` are replicated; every leaf of ``batch`` is split over the workers along its
      first axis (each worker differentiates its loss on its share); ``with_inputs`` (static)
      makes the method's per-step inputs this step and passes them to the update. ``metrics``:
      ``loss``, the mean over workers of their losses; ``skipped_steps`` (with
      ``skip_nonfinite``), the steps skipped so far; ``aux`` (with ``has_aux``), every worker's
      aux stacked along a leading worker axis.
    specs: the state's ``PartitionSpec``s on :attr:`mesh` (:func:`compressors.state_specs`,
      laid out by :meth:`compressors.parallel.workers.Workers.layout`); None under pmap.
    mesh: the mesh the step runs on; None under pmap.
    workers: where the workers run (:class:`compressors.parallel.workers.Workers`); None under pmap.
    equivalent: ``() -> DataParallel``: the same step with one worker per device on
      ``workers.count`` devices, whose compiled program gives the bytes (itself with one worker
      per device); None under pmap.
  """
  init: Callable[[PyTree], PyTree]
  step: Callable[..., tuple[PyTree, PyTree, dict[str, Any]]]
  specs: PyTree
  mesh: jax.sharding.Mesh | None
  workers: workers_lib.Workers | None = None
  equivalent: Callable[[], "DataParallel"] | None = None

  def wire_bytes(self, params: PyTree, state: PyTree, batch: PyTree, *,
                 with_inputs: bool = False) -> hlo_bytes.WireBytes:
    """Bytes one worker sends per step, read from the compiled step (compiled, never run): with
    several workers per device, from the program of one worker per device."""
    if self.workers is not None and self.workers.per_device > 1:
      one_each = self.equivalent()
      shapes = lambda tree, specs: _abstract(tree, one_each.mesh, specs)
      return one_each.wire_bytes(shapes(params, P()), shapes(state, one_each.specs),
                                 shapes(batch, one_each.workers.spec),
                                 with_inputs=with_inputs)
    return hlo_bytes.wire_bytes(functools.partial(self.step, with_inputs=with_inputs), params,
                           state, batch, mesh=self.mesh)


def data_parallel(loss_fn: Callable[..., Any], tx: optax.GradientTransformation,
                  mesh: jax.sharding.Mesh | None, params: PyTree, batch: PyTree, *,
                  axis_name: axes.AxisName = "data", workers_per_device: int = 1,
                  has_aux: bool = False, step_inputs: Any = None, skip_nonfinite: bool = True,
                  donate: bool = False) -> DataParallel:
  """A data-parallel step of ``tx`` over the workers of ``axis_name`` (see the module docstring).

  Args:
    loss_fn: ``(params, batch) -> loss`` (or ``(loss, aux)`` with ``has_aux``) of one worker on
      its share of the batch.
    tx: the transformation: a chain starting with a compressing one (``compressors.compress``,
      ``tasc.tasc_compress``) whose collectives run over ``axis_name``.
    mesh: the device mesh, in which ``axis_name`` names the workers' axis (or axes); None runs
      ``jax.pmap`` over the local devices instead, with ``axis_name`` as its axis name.
    params: the parameters, or their ``jax.ShapeDtypeStruct``s (to lay out the state).
    batch: a global batch, or its ``ShapeDtypeStruct``s (to lay out the state the per-step
      inputs make per-worker).
    axis_name: the axis (or tuple of axes) over which workers hold different batches; with
      ``workers_per_device > 1``, mesh axes and then the simulated workers' axis, e.g.
      ``("data", "worker")`` (:mod:`compressors.parallel.workers`).
    workers_per_device: workers simulated on each device (``jax.vmap``), each with its own
      share of the batch and its own state, as if each were a device.
    has_aux: ``loss_fn`` returns ``(loss, aux)``.
    step_inputs: the per-step inputs of the method, a
      :class:`compressors.registry.StepInputs` (e.g. ``registry.step_inputs("tasc")``).
    skip_nonfinite: wrap ``tx`` in :func:`compressors.skip_nonfinite` (strongly advised).
    donate: donate the state's buffers to the step (saves memory; the old state is invalid).

  Returns:
    A :class:`DataParallel`.

  Raises:
    ValueError: ``tx``'s updates would differ between workers (a wrapper that decides per worker
      around the compressor, or no compressor), ``axis_name`` and ``workers_per_device`` do
      not fit the mesh, or a leaf of ``batch`` does not split evenly over the workers, before
      anything compiles.
  """
  if mesh is None:
    if workers_per_device != 1:
      raise ValueError(f"workers_per_device={workers_per_device!r} needs a mesh (shard_map); "
                       "under pmap (mesh=None) every worker is a device")
    _check_batch(batch, jax.local_device_count())
    if skip_nonfinite:
      tx = nonfinite.skip_nonfinite(tx, axis_name=axis_name)
    # pmap differentiates each device's own loss: no copy to type.
    return _on_pmap(_WorkerStep(loss_fn, tx, axis_name, has_aux, step_inputs, skip_nonfinite,
                                own_copy=lambda params: params), axis_name, donate)
  layout = workers_lib.Workers.on(mesh, axis_name, workers_per_device)
  _check_batch(batch, layout.count)
  one_each = functools.partial(data_parallel, loss_fn, tx, params=params,
                               batch=batch, axis_name=axis_name, has_aux=has_aux,
                               step_inputs=step_inputs, skip_nonfinite=skip_nonfinite)
  wrapped = nonfinite.skip_nonfinite(tx, axis_name=axis_name) if skip_nonfinite else tx
  worker = _WorkerStep(loss_fn, wrapped, axis_name, has_aux, step_inputs, skip_nonfinite,
                       layout.own_copy)
  simulated = layout.per_device > 1
  # Shapes and dtypes, laid out as the step takes them (a mesh of explicit axes checks that).
  params = _abstract(params, mesh, P())
  batch = _abstract(batch, mesh, layout.spec)
  specs = layout.layout(_state_specs(worker, layout, params, batch))
  state_axes = workers_lib.per_worker_axes(specs)
  # Simulated workers are untyped: shard_map's replication types know only mesh axes.
  shard_map = functools.partial(jax.shard_map, mesh=mesh, check_vma=not simulated)
  init = jax.jit(shard_map(layout.each(wrapped.init, None, state_axes), in_specs=P(),
                           out_specs=specs))

  @functools.partial(jax.jit, static_argnums=3, donate_argnums=(1,) if donate else ())
  def jitted_step(params, state, batch, with_inputs):
    def body(params, state, batch):
      each = layout.each(functools.partial(worker, with_inputs=with_inputs),
                         (None, state_axes, 0), (None, state_axes, None))
      return each(params, state, _worker_rows(batch, layout.per_device))
    return shard_map(body, in_specs=(P(), specs, layout.spec),
                     out_specs=(P(), specs, P()))(params, state, batch)

  # Inputs placed as the step lays them out (a no-op for the step's own outputs), so that the
  # first call, on the caller's arrays, compiles the same program as the later ones.
  replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, layout.spec)

  def step(params, state, batch, *, with_inputs=False):
    return jitted_step(jax.device_put(params, replicated), state,
                       jax.device_put(batch, split), bool(with_inputs))

  return DataParallel(init=init, step=step, specs=specs, mesh=mesh, workers=layout,
                      equivalent=functools.cache(lambda: one_each(mesh=layout.equivalent_mesh()))
                      if simulated else None)


def _check_batch(batch: PyTree, num_workers: int) -> None:
  """Every leaf of ``batch`` splits evenly over ``num_workers`` along its first axis (else the
  first step fails inside JAX, naming an axis but not the batch)."""
  for path, leaf in jax.tree_util.tree_leaves_with_path(batch):
    shape = jax.numpy.shape(leaf)
    if not shape or shape[0] % num_workers:
      raise ValueError(
          f"data_parallel: batch leaf {jax.tree_util.keystr(path) or '(the batch)'} has shape "
          f"{shape}; every leaf is split over the {num_workers} workers along its first axis, "
          f"so that axis must be a multiple of {num_workers}")


def _state_specs(worker, layout, params, batch) -> PyTree:
  """:func:`compressors.state_specs` of the step, traced on the mesh of one worker per device
  (the state's layout is the same with simulated workers)."""
  axis = layout.axis_name
  if layout.per_device == 1:  # the mesh itself, with the inputs laid out on it
    mesh = layout.mesh
  else:
    mesh = layout.equivalent_mesh(abstract=True)
    params, batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                 (params, batch))
  extras = {}
  if worker.step_inputs is not None:  # state_specs must see what the inputs make per worker
    extras = jax.eval_shape(jax.shard_map(
        lambda p, b: jax.tree.map(lambda x: x[None], worker.inputs(worker.own_copy(p), b)),
        mesh=mesh, in_specs=(P(), P(axis)), out_specs=P(axis), check_vma=False),
        params, batch)
    extras = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), extras)
  return per_worker.state_specs(worker.tx, params, mesh, axis, **extras)


def _worker_rows(batch: PyTree, per_device: int) -> PyTree:
  """One device's share of the batch -> one share per worker along a new leading axis (one
  worker: the leading axis of size one :meth:`Workers.each` indexes away)."""
  return jax.tree.map(lambda x: x.reshape((per_device, -1) + x.shape[1:]), batch)


class _WorkerStep(NamedTuple):
  """One worker's step: gradient of its loss, per-step inputs, update, metrics."""
  loss_fn: Callable[..., Any]
  tx: optax.GradientTransformation
  axis_name: axes.AxisName
  has_aux: bool
  step_inputs: Any
  skip_nonfinite: bool
  own_copy: Callable[[PyTree], PyTree]  # a per-worker copy of the parameters to differentiate

  def scalar_loss(self, params, batch):
    out = self.loss_fn(params, batch)
    return out[0] if self.has_aux else out

  def inputs(self, params, batch):
    return self.step_inputs.make(self.scalar_loss, params, batch, jax.random.PRNGKey(0),
                                 self.axis_name)

  def __call__(self, params, state, batch, with_inputs):
    local_params = self.own_copy(params)
    out, grads = jax.value_and_grad(self.loss_fn, has_aux=self.has_aux)(local_params, batch)
    loss, aux = out if self.has_aux else (out, None)
    extra = self.inputs(local_params, batch) if with_inputs else {}
    updates, state = self.tx.update(grads, state, params, **extra)
    metrics = {"loss": jax.lax.pmean(loss, self.axis_name)}
    if self.skip_nonfinite:
      metrics["skipped_steps"] = state.skipped
    if self.has_aux:
      metrics["aux"] = jax.tree.map(lambda a: axes.all_gather(a, self.axis_name), aux)
    return optax.apply_updates(params, updates), state, metrics


def _on_pmap(worker: _WorkerStep, axis_name, donate: bool) -> DataParallel:
  """The same step under ``jax.pmap``: every state leaf carries the device axis."""
  count = jax.local_device_count()
  split = lambda batch: jax.tree.map(lambda x: x.reshape((count, -1) + x.shape[1:]), batch)
  copies = lambda tree: jax.tree.map(lambda x: jax.numpy.broadcast_to(x, (count,) + x.shape), tree)
  init_each = jax.pmap(worker.tx.init, axis_name=axis_name)
  init = lambda params: init_each(copies(params))

  def step(params, state, batch, *, with_inputs=False):
    return _pmapped(with_inputs)(params, state, split(batch))

  @functools.lru_cache(maxsize=2)
  def _pmapped(with_inputs):
    return jax.pmap(functools.partial(worker, with_inputs=with_inputs),
                    axis_name=axis_name, in_axes=(None, 0, 0), out_axes=(None, 0, None),
                    donate_argnums=(1,) if donate else ())

  return DataParallel(init=init, step=step, specs=None, mesh=None)


def _abstract(tree: PyTree, mesh: jax.sharding.Mesh, specs: PyTree) -> PyTree:
  """Shapes and dtypes of ``tree``, sharded on ``mesh`` by ``specs`` (a spec or a tree)."""
  specs = jax.tree.broadcast(specs, tree, is_leaf=lambda s: isinstance(s, P))
  return jax.tree.map(lambda x, spec: jax.ShapeDtypeStruct(
      jax.numpy.shape(x), jax.numpy.result_type(x), sharding=NamedSharding(mesh, spec)),
      tree, specs, is_leaf=lambda s: isinstance(s, P))
