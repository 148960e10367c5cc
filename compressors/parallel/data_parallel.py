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
``workers_per_device=W`` runs W simulated workers on each device (:mod:`compressors.workers`),
with the transformation built over ``axis_name=("data", "worker")``::

  tx = optax.chain(compressors.compress(compressors.topk(0.01), axis_name=("data", "worker")),
                   optax.sgd(0.1))
  dp = compressors.data_parallel(loss, tx, mesh, params, batch, axis_name=("data", "worker"),
                                 workers_per_device=8)

Steps of several kinds. A method may run different programs at different steps: TASC refreshes
its curvature every ``N`` steps (an input of its update the other steps lack), a local-update
method synchronises every ``H``. Each :class:`StepKind` names one program and how often it runs
(at the steps that are multiples of its ``every``; where several divide a step, the one of the
largest ``every``); each is compiled once, and its bytes are read from its own compiled program
(:meth:`DataParallel.wire_bytes`, :mod:`compressors.parallel.step_bytes`). A run's bytes are
the sum over the steps it ran of each step's kind's bytes (:meth:`DataParallel.bytes_per_step`).
A method declares its kinds, or only its per-step inputs, through ``kinds=``.

Per-worker parameters (local updates, ``per_worker_params=True``): the step knows no method; the
transformation's state says how its updates land on each worker's parameters and which are the
model (:class:`compressors.method_protocol.SynchronisingState`).

Islands (``shard_axis="fsdp"`` on a mesh ``("islands", "fsdp")``): the parameters, the
gradient and the state built from them are sharded over the fast axis inside each island
(ZeRO-3: the loss all-gathers each leaf where it reads it, and the gradient is reduce-scattered;
:mod:`compressors.parallel.fsdp`, :mod:`compressors.parallel.gather_on_use`), and ``tx``, built
with ``axis_name="islands"``, exchanges each device's shard across the islands::

  dp = compressors.data_parallel(loss, tx, mesh, params, batch, axis_name="islands",
                                 shard_axis="fsdp")
  sharded = dp.worker_params(params)
  sharded, state, metrics = dp.step(sharded, dp.init(params), batch)

Model state and randomness (the runner's models). With ``model_state`` the loss is
``loss_fn(params, batch, model_state, rng) -> (loss, (aux, new_model_state))``: ``model_state``
holds one row per worker (batch statistics, kept per worker and restored on a skipped step) and
``rng`` is ``rng`` folded with the step and the worker's index (``None`` without ``rng``). The
step is then :meth:`DataParallel.train_step` on a :class:`TrainState`.
"""

import functools
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from compressors import method_protocol
from compressors.method_protocol import StepInputs
from compressors.method_protocol import StepKind
from compressors.network import axes
from compressors.parallel import drift
from compressors.parallel import evaluation
from compressors.parallel import fsdp
from compressors.parallel import gather_on_use
from compressors.parallel import hlo_bytes
from compressors.parallel import nonfinite
from compressors.parallel import per_worker
from compressors.parallel import sharded_params as sharded_lib
from compressors.parallel import step_bytes
from compressors.parallel import step_kinds as kinds_lib
from compressors.parallel.step_kinds import kind_at
from compressors.parallel.step_kinds import kind_counts
from compressors.parallel import workers as workers_lib
from compressors.parallel.train_state import TrainState


class DataParallel(NamedTuple):
  """The functions :func:`data_parallel` returns.

  Attributes:
    init: ``params -> state``, jitted: the transformation's state, per-worker leaves laid out
      per worker (one row per worker, as :attr:`specs` say; under ``pmap`` every leaf).
    step: ``(params, state, batch, *, kind) -> (params, state, metrics)``, jitted.
      ``params`` are replicated; every leaf of ``batch`` is split over the workers along its
      first axis (each worker differentiates its loss on its share); ``kind`` names the step's
      kind (:attr:`kinds`; by default the every-step kind). ``metrics``: ``loss``, the mean over
      workers of their losses; ``skipped_steps`` (with ``skip_nonfinite``), the steps skipped so
      far; ``aux`` (with ``has_aux`` or ``model_state``), every worker's aux stacked along a
      leading worker axis.
    train_step: ``(TrainState, batch, *, kind) -> (TrainState, metrics)``, jitted, the state
      donated: the same step on a whole :class:`TrainState` (with ``model_state``); its metrics
      (``loss``, ``skipped_steps``, ``aux``) have one row per worker, so that no collective
      but the exchange's runs in the step.
    kinds: the step kinds (:class:`StepKind`) by name.
    specs: the state's ``PartitionSpec``s on :attr:`mesh` (:func:`compressors.state_specs`,
      laid out by :meth:`compressors.workers.Workers.layout`); None under pmap.
    mesh: the mesh the step runs on; None under pmap.
    workers: where the workers run (:class:`compressors.workers.Workers`); None under pmap.
    equivalent: ``() -> DataParallel``: the same step with one worker per device on
      ``workers.count`` devices, whose compiled program gives the bytes (itself with one worker
      per device); None under pmap.
    reduce: ``fn -> jitted (params, model_state, batch) -> sum over workers of fn(params,
      mean model_state, worker's batch)`` (evaluation: the model state averaged over workers).
    replicas_agree: ``params -> bool[]``: the parameters bit-identical on every device (with
      per-worker parameters: every worker's row the same, as after a synchronising step).
    worker_params: ``params -> params`` laid out as the step takes them: the identity, or with
      per-worker parameters replicated ones copied to one row per worker.
    per_worker_params: the parameters have one row per worker (:func:`data_parallel`; with
      islands, one row per island).
    param_layout: with islands (``shard_axis``), the parameters' layout over the fast axis
      (:class:`compressors.parallel.fsdp.ParamLayout`); None otherwise.
    sharded: the parameters sharded over the workers' axis and their optimizer
      (:class:`compressors.parallel.sharded_params.ShardedParams`), or None.
    landed: ``(params, opt_state) -> params``: with per-worker parameters, each worker's where
      they landed on the synchronised ones at the latest step (:attr:`StepKind.lands`: the whole
      model, or a part of it) and its copy of the synchronised ones elsewhere, so that
      :attr:`replicas_agree` of it checks what must agree after any landing; the parameters
      themselves otherwise.
  """
  init: Callable[[chex.ArrayTree], chex.ArrayTree]
  step: Callable[..., tuple[chex.ArrayTree, chex.ArrayTree, dict[str, Any]]]
  train_step: Callable[..., tuple[TrainState, dict[str, Any]]] | None
  kinds: dict[str, StepKind]
  specs: chex.ArrayTree
  mesh: jax.sharding.Mesh | None
  workers: workers_lib.Workers | None = None
  equivalent: Callable[[], "DataParallel"] | None = None
  reduce: Callable[[Callable[..., Any]], Callable[..., Any]] | None = None
  replicas_agree: Callable[[chex.ArrayTree], jax.Array] | None = None
  worker_params: Callable[[chex.ArrayTree], chex.ArrayTree] = lambda params: params
  per_worker_params: bool = False
  param_layout: fsdp.ParamLayout | None = None
  landed: Callable[[chex.ArrayTree, chex.ArrayTree], chex.ArrayTree] = lambda params, _: params
  sharded: sharded_lib.ShardedParams | None = None

  @property
  def params_spec(self) -> chex.ArrayTree:
    """The parameters' ``PartitionSpec`` on :attr:`mesh`: ``P()``, or one row per worker;
    with islands, a tree of them (sharded over the fast axis, a row per island)."""
    return _params_spec(self.workers, self.per_worker_params, self.param_layout, self.sharded)

  def model_params(self, state: TrainState) -> chex.ArrayTree:
    """The parameters the model is (to evaluate), in their natural shapes: ``state.params``,
    or with per-worker parameters those of the latest synchronisation
    (``compressors.synchronised_params``)."""
    layout = self.param_layout
    if not self.per_worker_params:
      return state.params if layout is None else layout.to_natural(state.params)
    synchronised = method_protocol.synchronised_params(state.opt_state)
    if layout is None:
      return synchronised
    # One island's rows over the fast axis (the synchronised parameters are every island's).
    first = jax.tree.map(lambda x: x.reshape((-1, layout.shards) + x.shape[1:])[0], synchronised)
    return layout.rows_to_natural(first)

  def state_bytes_per_device(self, params: chex.ArrayTree) -> int:
    """Bytes one device holds of the parameters and the transformation's state, laid out as
    the step lays them out (:func:`compressors.parallel.fsdp.state_bytes_per_device`), from
    shapes alone: ``params`` are natural ones or their ``ShapeDtypeStruct``s; nothing is
    allocated. Needs a mesh."""
    stored = step_bytes.abstract(jax.eval_shape(self.worker_params, params), self.mesh,
                                 self.params_spec)
    state = step_bytes.abstract(jax.eval_shape(self.init, params), self.mesh, self.specs)
    return fsdp.state_bytes_per_device((stored, state))

  def kind_at(self, step: int) -> str:
    """The name of the kind that runs at ``step``."""
    return kind_at(tuple(self.kinds.values()), step)

  def kind_counts(self, start: int, stop: int) -> dict[str, int]:
    """How many of the steps ``start, ..., stop - 1`` each kind runs."""
    return kind_counts(tuple(self.kinds.values()), start, stop)

  def synchronises(self, kind: str) -> bool:
    """Whether a step of ``kind`` leaves every worker with the same parameters: every step, or
    with per-worker parameters one that lands the whole model (:attr:`StepKind.synchronises`)."""
    return not self.per_worker_params or self.kinds[kind].synchronises

  def lands(self, kind: str) -> bool:
    """Whether after a step of ``kind`` some of the parameters must agree on every worker
    (what :attr:`landed` keeps): every step, or with per-worker parameters one that lands a
    part of the model or all of it (:attr:`StepKind.lands`)."""
    return not self.per_worker_params or self.kinds[kind].lands is not None

  def wire_bytes(self, params: chex.ArrayTree, state: chex.ArrayTree, batch: chex.ArrayTree, *,
                 kind: str | None = None,
                 model_state: chex.ArrayTree = ()) -> hlo_bytes.WireBytes:
    """:func:`compressors.parallel.step_bytes.wire_bytes` of this step."""
    return step_bytes.wire_bytes(self, params, state, batch, kind=kind, model_state=model_state)

  def peak_bytes_per_device(self, params: chex.ArrayTree, state: chex.ArrayTree,
                            batch: chex.ArrayTree, *, kind: str | None = None,
                            model_state: chex.ArrayTree = ()) -> int | None:
    """:func:`compressors.parallel.step_bytes.peak_bytes_per_device` of this step."""
    return step_bytes.peak_bytes_per_device(self, params, state, batch, kind=kind,
                                            model_state=model_state)

  def bytes_per_step(self, per_kind: dict[str, float], start: int, stop: int) -> float:
    """:func:`compressors.parallel.step_bytes.bytes_per_step` of this step."""
    return step_bytes.bytes_per_step(self, per_kind, start, stop)

  def nonfinite_flag_bytes(self) -> float:
    """:func:`compressors.parallel.step_bytes.nonfinite_flag_bytes` of this step."""
    return step_bytes.nonfinite_flag_bytes(self)

  def replica_check_bytes(self, params: chex.ArrayTree) -> float:
    """:func:`compressors.parallel.step_bytes.replica_check_bytes` of this step."""
    return step_bytes.replica_check_bytes(self, params)


def data_parallel(loss_fn: Callable[..., Any], tx: optax.GradientTransformation,
                  mesh: jax.sharding.Mesh | None, params: chex.ArrayTree, batch: chex.ArrayTree, *,
                  axis_name: axes.AxisName = "data", workers_per_device: int = 1,
                  has_aux: bool = False, kinds: Sequence[StepKind] | StepInputs | None = None,
                  model_state: chex.ArrayTree = None,
                  rng: jax.Array | None = None, skip_nonfinite: bool = True,
                  donate: bool = False, per_worker_params: bool = False,
                  shard_axis: str | None = None,
                  sharded: sharded_lib.ShardedParams | None = None,
                  **deprecated) -> DataParallel:
  """A data-parallel step of ``tx`` over the workers of ``axis_name`` (see the module docstring).

  Args:
    loss_fn: ``(params, batch) -> loss`` (or ``(loss, aux)`` with ``has_aux``) of one worker on
      its share of the batch; with ``model_state``, ``(params, batch, model_state, rng) ->
      (loss, (aux, new_model_state))``.
    tx: the transformation: a chain starting with a compressing one (``compressors.compress``,
      ``tasc.tasc_compress``) whose collectives run over ``axis_name``.
    mesh: the device mesh, in which ``axis_name`` names the workers' axis (or axes); None runs
      ``jax.pmap`` over the local devices instead, with ``axis_name`` as its axis name.
    params: the parameters, or their ``jax.ShapeDtypeStruct``s (to lay out the state).
    batch: a global batch, or its ``ShapeDtypeStruct``s (to lay out the state the per-step
      inputs make per-worker).
    axis_name: the axis (or tuple of axes) over which workers hold different batches; with
      ``workers_per_device > 1``, mesh axes and then the simulated workers' axis, e.g.
      ``("data", "worker")`` (:mod:`compressors.workers`).
    workers_per_device: workers simulated on each device (``jax.vmap``), each with its own
      share of the batch and its own state, as if each were a device.
    has_aux: ``loss_fn`` returns ``(loss, aux)``.
    kinds: the programs the method runs at different steps: its step kinds
      (:class:`compressors.StepKind`, e.g. ``registry.step_kinds("diloco")``), or just its
      per-step inputs (a :class:`compressors.StepInputs`, e.g. ``registry.step_inputs("tasc")``:
      the kinds ``"step"`` and ``"with_inputs"``); None: one kind, every step.
    model_state: the model's state with one row per worker (or its ``ShapeDtypeStruct``s), for
      :attr:`DataParallel.train_step` (needs a mesh).
    rng: the key the losses' randomness (``rng``) and the per-step inputs' keys derive from.
    skip_nonfinite: wrap ``tx`` in :func:`compressors.skip_nonfinite` (strongly advised).
    donate: donate the state's buffers to :attr:`DataParallel.step` (saves memory; the old
      state is invalid). :attr:`DataParallel.train_step` always donates.
    per_worker_params: the parameters differ between workers between synchronisations (a
      local-update method, ``compressors.local_updates``): the step takes and returns them with
      one row per worker (:meth:`DataParallel.worker_params` lays replicated ones out so), each
      worker differentiates at its own, and updates are applied with
      ``compressors.apply_local_updates`` (bit-identical rows after a synchronising step).
    shard_axis: islands: a mesh axis outside ``axis_name`` over which the parameters, the
      gradient and the state built from them are sharded inside each island, ZeRO-3 style
      (:mod:`compressors.parallel.fsdp`); every device is a worker, and ``tx``'s collectives
      span ``axis_name`` (the slow axis) on each device's shard. ``init`` and
      :meth:`DataParallel.worker_params` take natural parameters; ``step`` and ``train_step``
      take them as ``worker_params`` lays them out.
    sharded: parameters sharded over ``axis_name`` (embedding tables) beside the replicated
      ones, and their optimizer (:mod:`compressors.parallel.sharded_params`): the step and
      ``init`` take them as ``sharded.specs`` lay them out (over ``axis_name``: with
      simulated workers a device holds its workers' blocks, :meth:`Workers.on_mesh`),
      ``loss_fn`` reads each worker's block (and others' through its own collectives over
      ``axis_name``), ``tx`` updates the replicated leaves only. Needs a mesh, no islands and
      no per-worker parameters.
    **deprecated: ``step_inputs=``, now ``kinds=`` (a DeprecationWarning for one release).

  Returns:
    A :class:`DataParallel`.

  Raises:
    ValueError: ``tx``'s updates would differ between workers (a wrapper that decides per worker
      around the compressor, or no compressor), ``axis_name`` and ``workers_per_device`` do
      not fit the mesh, a leaf of ``batch`` does not split evenly over the workers, or
      ``model_state`` without a mesh, before anything compiles.
  """
  if "step_inputs" in deprecated:
    warnings.warn("data_parallel(step_inputs=...) is now data_parallel(kinds=...), which takes "
                  "the StepInputs too", DeprecationWarning, stacklevel=2)
    kinds = deprecated.pop("step_inputs")
  if deprecated:
    raise TypeError(f"data_parallel() got unexpected keyword arguments {sorted(deprecated)}")
  if kinds is None or isinstance(kinds, StepInputs):
    kinds = method_protocol.step_kinds(kinds)
  kinds = kinds_lib.checked(kinds)
  layout = (None if mesh is None
            else workers_lib.Workers.on(mesh, axis_name, workers_per_device, shard_axis))
  if sharded is not None:
    sharded_lib.check(sharded, params, layout, per_worker_params, shard_axis)
  if mesh is None:
    _check_pmap(shard_axis, workers_per_device, model_state, batch)
    if skip_nonfinite:
      tx = nonfinite.skip_nonfinite(tx, axis_name=axis_name)
    # pmap differentiates each device's own loss: no copy to type.
    return _on_pmap(_WorkerStep(loss_fn, tx, axis_name, axis_name, has_aux, False, rng,
                                skip_nonfinite, lambda params: params), kinds, axis_name, donate,
                    per_worker_params)
  _check_batch(batch, layout.count)
  one_each = functools.partial(
      data_parallel, loss_fn, tx, params=params, batch=batch, axis_name=axis_name,
      has_aux=has_aux, kinds=kinds, model_state=model_state, rng=rng,
      skip_nonfinite=skip_nonfinite, per_worker_params=per_worker_params, sharded=sharded)
  param_layout = None if shard_axis is None else fsdp.ParamLayout.of(
      params, shard_axis, layout.shards, per_island=per_worker_params, island_axis=axis_name)
  worker = _worker_step(loss_fn, tx, layout, params, axis_name, has_aux, model_state is not None,
                        rng, skip_nonfinite, per_worker_params, param_layout, sharded)
  model_state = () if model_state is None else model_state
  # Shapes and dtypes, laid out as the step takes them (a mesh of explicit axes checks that);
  # the parameters as init takes them (with islands: stored, one shard per device).
  params = _init_params(params, layout, param_layout, sharded)
  batch = step_bytes.abstract(batch, mesh, layout.spec)
  model_state = step_bytes.abstract(model_state, mesh, layout.spec)
  specs = layout.layout(_state_specs(worker, kinds, layout, params, model_state, batch,
                                     per_worker_params, param_layout, sharded))
  programs = _Programs(worker, layout, specs, kinds, per_worker_params, param_layout, sharded)
  return DataParallel(
      init=programs.init(), step=programs.simple_step(donate), train_step=programs.train_step(),
      kinds={k.name: k for k in kinds}, specs=specs, mesh=mesh, workers=layout,
      equivalent=functools.cache(lambda: one_each(mesh=layout.equivalent_mesh()))
      if layout.per_device > 1 else None,
      reduce=programs.reduce,
      replicas_agree=drift.replicas_agree_program(layout, per_worker_params,
                                                  programs.params_spec),
      **({"landed": programs.landed()} if per_worker_params else {}),
      worker_params=programs.worker_params(), per_worker_params=per_worker_params,
      param_layout=param_layout, sharded=sharded)


def _worker_step(loss_fn, tx, layout, params, axis_name, has_aux, stateful, rng, skip_nonfinite,
                 per_worker_params, param_layout, sharded) -> "_WorkerStep":
  """One worker's step on a mesh: ``tx`` protected by the non-finite skip (one shard's NaN skips
  the step on every device: an island's shards must stay one model), with sharded parameters
  beside it (their optimizer inside the skip too)."""
  protect = lambda tx: (nonfinite.skip_nonfinite(tx, axis_name=layout.worker_axes)
                        if skip_nonfinite else tx)
  own_copy = (lambda p: p) if per_worker_params else layout.own_copy
  if sharded is not None:
    # The replicated leaves' updates must agree on every worker: checked with the sharded
    # leaves' (which differ by design) left out.
    equivalent = layout.equivalent_mesh(abstract=True)
    per_worker.state_specs(protect(sharded.without_sharded_updates(tx)),
                           sharded.block_shapes(params, equivalent), equivalent, axis_name)
    own_copy = functools.partial(sharded.own_copy, layout.own_copy)
    tx = sharded.combined(tx)
  return _WorkerStep(loss_fn, protect(tx), axis_name, layout.worker_axes, has_aux, stateful, rng,
                     skip_nonfinite, own_copy, param_layout, sharded)


def _params_spec(layout: workers_lib.Workers, per_worker_params: bool,
                 param_layout: fsdp.ParamLayout | None,
                 sharded: sharded_lib.ShardedParams | None = None) -> chex.ArrayTree:
  """The parameters' specs: ``P()`` replicated, the workers' spec with per-worker parameters,
  with islands a tree (sharded over the fast axis, a row per island), with sharded parameters
  their specs on the mesh."""
  if param_layout is not None:
    return param_layout.specs
  if sharded is not None:
    return layout.on_mesh(sharded.specs)
  return layout.spec if per_worker_params else P()


def _check_pmap(shard_axis, workers_per_device, model_state, batch) -> None:
  """What ``jax.pmap`` (no mesh) cannot run is refused, naming the argument."""
  if shard_axis is not None:
    raise ValueError(f"shard_axis={shard_axis!r} needs a mesh (shard_map) with that axis; "
                     "under pmap (mesh=None) every device holds the whole model")
  if workers_per_device != 1:
    raise ValueError(f"workers_per_device={workers_per_device!r} needs a mesh (shard_map); "
                     "under pmap (mesh=None) every worker is a device")
  if model_state is not None:
    raise ValueError("data_parallel: model_state needs a mesh (shard_map, train_step); "
                     "under pmap (mesh=None) there is only the step of params and state")
  _check_batch(batch, jax.local_device_count())


def _init_params(params, layout, param_layout, sharded=None) -> chex.ArrayTree:
  """The parameters' shapes as ``init`` takes them: replicated (sharded ones as their specs
  say), or with islands stored and sharded over the fast axis (a shard per device)."""
  if param_layout is None:
    return step_bytes.abstract(params, layout.mesh,
                               _params_spec(layout, False, None, sharded))
  return step_bytes.abstract(jax.eval_shape(param_layout.to_stored, params), layout.mesh,
                             param_layout.shard_specs)


def _check_batch(batch: chex.ArrayTree, num_workers: int) -> None:
  """Every leaf of ``batch`` splits evenly over ``num_workers`` along its first axis (else the
  first step fails inside JAX, naming an axis but not the batch)."""
  for path, leaf in jax.tree_util.tree_leaves_with_path(batch):
    shape = jax.numpy.shape(leaf)
    if not shape or shape[0] % num_workers:
      raise ValueError(
          f"data_parallel: batch leaf {jax.tree_util.keystr(path) or '(the batch)'} has shape "
          f"{shape}; every leaf is split over the {num_workers} workers along its first axis, "
          f"so that axis must be a multiple of {num_workers}")


def _state_specs(worker, kinds, layout, params, model_state, batch, per_worker_params,
                 param_layout, sharded=None) -> chex.ArrayTree:
  """:func:`compressors.state_specs` of the step, traced on the mesh of one worker per device
  (the state's layout is the same with simulated workers) for each kind, with what its inputs
  make per worker and its options: a leaf is per worker if any kind makes it so. With islands
  (``param_layout``) the update is traced on one device's shard of ``params``."""
  axis, rows = layout.axis_name, P(layout.worker_axes)
  params_in, analysed = P(), params
  if param_layout is not None:
    params_in, analysed = param_layout.shard_specs, param_layout.shard_shapes(params)
  if sharded is not None:
    params_in = sharded.specs
    analysed = sharded.block_shapes(params, layout.equivalent_mesh(abstract=True))
  if layout.per_device == 1:  # the mesh itself, with the inputs laid out on it
    mesh = layout.mesh
  else:
    mesh = layout.equivalent_mesh(abstract=True)
    params, model_state, batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                              (params, model_state, batch))
  found, program = None, kinds_lib.same_programs(kinds)
  for kind in kinds:
    if program[kind.name] != kind.name:  # the same update as a kind traced already
      continue
    extras = {}
    if kind.inputs is not None:

      def per_worker_inputs(p, m, b, kind=kind):
        m = jax.tree.map(lambda x: x[0], m)
        made = worker.inputs(kind, worker.own_copy(p), b, m, jnp.zeros((), jnp.int32))
        return jax.tree.map(lambda x: x[None], made)
      made = jax.eval_shape(jax.shard_map(
          per_worker_inputs, mesh=mesh, in_specs=(params_in, rows, rows), out_specs=rows,
          check_vma=False), params, model_state, batch)
      extras = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), made)
    specs = per_worker.state_specs(worker.tx, analysed, mesh, axis,
                                   per_worker_params=per_worker_params,
                                   options=kind.update_kwargs(), shard_axis=layout.shard_axis,
                                   check_updates=sharded is None, **extras)
    found = specs if found is None else jax.tree.map(
        lambda a, b: a if a != P() else b, found, specs, is_leaf=lambda x: isinstance(x, P))
  return found


class _WorkerStep(NamedTuple):
  """One worker's step: gradient of its loss, per-step inputs, update, metrics."""
  loss_fn: Callable[..., Any]
  tx: optax.GradientTransformation
  axis_name: axes.AxisName  # the exchange's (what tx is built with)
  worker_axes: axes.AxisName  # every axis workers differ along (ranks, metrics)
  has_aux: bool
  stateful: bool  # loss_fn(params, batch, model_state, rng) -> (loss, (aux, new_model_state))
  rng: jax.Array | None
  skip_nonfinite: bool
  # A per-worker copy of the parameters, to differentiate.
  own_copy: Callable[[chex.ArrayTree], chex.ArrayTree]
  # Islands: the parameters' layout over the fast axis (one device holds a shard of each).
  param_layout: fsdp.ParamLayout | None = None
  # Parameters sharded over the workers' axis (their gradient summed by the loss's collectives).
  sharded: sharded_lib.ShardedParams | None = None

  def keys(self, step):
    """``(loss key of the step, inputs key of the step)``, or Nones and a fixed inputs key
    without ``rng``."""
    if self.rng is None:
      return None, jax.random.PRNGKey(0)
    loss_key, inputs_key = jax.random.split(self.rng)
    return jax.random.fold_in(loss_key, step), jax.random.fold_in(inputs_key, step)

  def loss(self, params, batch, model_state, rng):
    """``(loss, (aux, new_model_state))`` whatever the form of ``loss_fn``; with islands, of
    the whole model all-gathered at once (for per-step inputs, which may differentiate it
    forward-over-reverse)."""
    if self.param_layout is not None:
      params = self.param_layout.gather(params)
    return self.natural_loss(params, batch, model_state, rng)

  def natural_loss(self, params, batch, model_state, rng):
    """:meth:`loss` of the model's parameters."""
    if self.stateful:
      return self.loss_fn(params, batch, model_state, rng)
    out = self.loss_fn(params, batch)
    return (out[0], (out[1], model_state)) if self.has_aux else (out, (None, model_state))

  def inputs(self, kind, params, batch, model_state, step):
    """The update's keyword arguments that ``kind`` makes from this worker's loss."""
    loss_key, inputs_key = self.keys(step)
    scalar = lambda p, b: self.loss(p, b, model_state, loss_key)[0]
    return kind.inputs(scalar, params, batch, inputs_key, self.axis_name)

  def __call__(self, step, params, model_state, state, batch, kind):
    loss_key, _ = self.keys(step)
    worker_key = (None if loss_key is None
                  else jax.random.fold_in(loss_key, axes.worker_index(self.worker_axes)))
    local_params = self.own_copy(params)
    # Islands: each leaf gathered where the loss reads it, so that a device's peak holds one
    # layer's leaves, not the model (compressors.parallel.gather_on_use).
    loss_fn = (self.loss if self.param_layout is None
               else gather_on_use.loss_on_use(self.natural_loss, self.param_layout))
    (loss, (aux, new_model_state)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        local_params, batch, model_state, worker_key)
    if self.param_layout is not None:  # the scatter summed the island's gradients: their mean
      grads = jax.tree.map(lambda g: g / self.param_layout.shards, grads)
    if self.sharded is not None:
      grads = self.sharded.mean_gradient(grads, axes.num_workers(self.worker_axes))
    extra = self.inputs(kind, local_params, batch, new_model_state, step) if kind.inputs else {}
    updates, state = self.tx.update(grads, state, params, **extra, **kind.update_kwargs())
    # This worker's own metrics: no collective, so a step's bytes are its exchange's alone.
    metrics = {"loss": loss}
    if self.skip_nonfinite:
      metrics["skipped_steps"] = state.skipped
      # A skipped step keeps the model state too: a non-finite batch would otherwise poison this
      # worker's batch statistics for every later step.
      new_model_state = jax.tree.map(lambda old, new: jnp.where(state.last_skipped, old, new),
                                     model_state, new_model_state)
    if self.has_aux or self.stateful:
      metrics["aux"] = aux
    return (method_protocol.apply_local_updates(params, updates, state), new_model_state, state,
            metrics)

  def _varying(self, x):
    """``x`` typed as differing between workers (an aux the same on every worker, such as an
    exchange's overflow count that a step without an exchange leaves 0, would otherwise be
    gathered into a value typed as differing)."""
    names = axes.as_tuple(self.worker_axes)
    if axes.replication_checked(names) and not axes.is_varying(x, names):
      return jax.lax.pcast(x, names, to="varying")
    return x

  def gathered(self, metrics):
    """A worker's metrics as :attr:`DataParallel.step` reports them: the mean loss, every
    worker's aux stacked along a leading worker axis (``skipped_steps`` is left out: the caller
    takes it from the replicated state)."""
    metrics = {k: v for k, v in metrics.items() if k != "skipped_steps"}
    metrics["loss"] = jax.lax.pmean(metrics["loss"], self.worker_axes)
    if "aux" in metrics:
      metrics["aux"] = jax.tree.map(lambda a: axes.all_gather_invariant(self._varying(a),
                                                                    self.worker_axes),
                                    metrics["aux"])
    return metrics


class _Programs(NamedTuple):
  """The jitted programs of one :func:`data_parallel` on a mesh."""
  worker: _WorkerStep
  layout: workers_lib.Workers
  specs: chex.ArrayTree
  kinds: tuple[StepKind, ...]
  per_worker_params: bool
  param_layout: fsdp.ParamLayout | None
  sharded: sharded_lib.ShardedParams | None = None

  @property
  def params_spec(self) -> chex.ArrayTree:
    """As :attr:`DataParallel.params_spec`."""
    return _params_spec(self.layout, self.per_worker_params, self.param_layout, self.sharded)

  @property
  def params_axis(self):
    """The parameters' ``in_axes``/``out_axes`` for :meth:`Workers.each` (sharded ones: as
    :meth:`worker_blocks` lays them out)."""
    if self.sharded is not None:
      return self.sharded.worker_axes()
    return 0 if self.per_worker_params else None

  def worker_blocks(self, params):
    """One device's parameters as :meth:`Workers.each` takes them: a sharded leaf's block of
    each of its workers along a leading axis
    (:meth:`compressors.parallel.sharded_params.ShardedParams.worker_blocks`)."""
    if self.sharded is None:
      return params
    return self.sharded.worker_blocks(params, self.layout.per_device)

  def device_blocks(self, params):
    """:meth:`worker_blocks` undone."""
    return params if self.sharded is None else self.sharded.device_blocks(params)

  def shard_map(self, fn, in_specs, out_specs):
    return self.layout.shard_map(fn, in_specs, out_specs)

  def reduce(self, fn):
    """As :attr:`DataParallel.reduce`: on the model's parameters, natural ones with islands,
    placed tables sharded as they are."""
    return evaluation.reduce_over_workers(self.layout, fn, sharded=self.sharded)

  def init(self):
    state_axes = workers_lib.per_worker_axes(self.specs)
    # Replicated parameters, the same on every worker; sharded ones, each worker's block.
    params_axes = None if self.sharded is None else self.sharded.worker_axes()
    each = self.layout.each(self.worker.tx.init, (params_axes,), state_axes)
    if self.param_layout is None:
      # init takes replicated parameters (placed tables sharded as they are).
      params_in = P() if self.sharded is None else self.params_spec
      return jax.jit(self.shard_map(lambda params: each(self.worker_blocks(params)),
                                    in_specs=(params_in,), out_specs=self.specs))
    shards = self.shard_map(each, in_specs=(self.param_layout.shard_specs,),
                            out_specs=self.specs)
    return jax.jit(lambda params: shards(self.param_layout.to_stored(params)))

  def landed(self):
    """``(params, opt_state) -> params`` laid out alike: each worker's parameters where they
    landed on the synchronised ones at the latest step, its copy of the synchronised ones
    elsewhere (:func:`compressors.method_protocol.landed_params`, on each worker's own rows)."""
    state_axes = workers_lib.per_worker_axes(self.specs)
    each = self.layout.each(method_protocol.landed_params, (self.params_axis, state_axes),
                            self.params_axis)
    return jax.jit(self.shard_map(each, in_specs=(self.params_spec, self.specs),
                                  out_specs=self.params_spec))

  def worker_params(self):
    """Replicated parameters -> laid out as the step takes them (one row per worker with
    per-worker parameters; with islands, stored and sharded, a row per island)."""
    sharding = _shardings(self.layout.mesh, self.params_spec)
    if self.param_layout is not None:
      islands = self.layout.count // self.layout.shards
      return jax.jit(lambda params: self.param_layout.to_stored(params, islands),
                     out_shardings=sharding)
    if not self.per_worker_params:
      return lambda params: params
    count = self.layout.count
    return jax.jit(lambda params: jax.tree.map(
        lambda x: jnp.broadcast_to(x, (count,) + x.shape), params), out_shardings=sharding)

  def per_device(self, state: TrainState, batch, kind: StepKind):
    """One device's workers' step on their rows of ``state`` and ``batch``."""
    state_axes = workers_lib.per_worker_axes(self.specs)
    each = self.layout.each(functools.partial(self.worker, kind=kind),
                            (None, self.params_axis, 0, state_axes, 0),
                            (self.params_axis, 0, state_axes, 0))
    params, model_state, opt_state, metrics = each(
        state.step, self.worker_blocks(state.params), state.model_state, state.opt_state,
        self.layout.rows(batch))
    return TrainState(state.step + 1, self.device_blocks(params), model_state,
                      opt_state), metrics

  def train_step(self):
    layout, by_name = self.layout, {k.name: k for k in self.kinds}
    specs = TrainState(P(), self.params_spec, layout.spec, self.specs)
    program, default = kinds_lib.same_programs(self.kinds), kinds_lib.steady(self.kinds)

    # Metrics come out one row per worker (no collective in the step for them).
    @functools.partial(jax.jit, static_argnames="kind", donate_argnums=0)
    def jitted(state, batch, kind):
      return self.shard_map(functools.partial(self.per_device, kind=by_name[kind]),
                            in_specs=(specs, layout.spec), out_specs=(specs, layout.spec))(
                                state, batch)

    # Kinds that differ only in when they run share one compiled program.
    def train_step(state, batch, *, kind=default):
      return jitted(state, batch, kind=program[kind])
    train_step.lower = lambda state, batch, *, kind=default: jitted.lower(state, batch,
                                                                          kind=program[kind])
    train_step.trace = lambda state, batch, *, kind=default: jitted.trace(state, batch,
                                                                          kind=program[kind])
    return train_step

  def simple_step(self, donate: bool):
    """``(params, state, batch, *, kind) -> (params, state, metrics)``: the step without model
    state or a step count (step 0's keys)."""
    layout, by_name = self.layout, {k.name: k for k in self.kinds}
    default = kinds_lib.steady(self.kinds)

    @functools.partial(jax.jit, static_argnames="kind", donate_argnums=(1,) if donate else ())
    def jitted(params, state, batch, kind=default):
      def body(params, state, batch):
        train_state = TrainState(jnp.zeros((), jnp.int32), params, (), state)
        new, metrics = self.per_device(train_state, batch, by_name[kind])
        gathered = self.layout.each(self.worker.gathered, 0, None)(metrics)
        if self.worker.skip_nonfinite:
          gathered["skipped_steps"] = new.opt_state.skipped
        return new.params, new.opt_state, gathered
      return self.shard_map(body, in_specs=(self.params_spec, self.specs, layout.spec),
                            out_specs=(self.params_spec, self.specs, P()))(params, state, batch)

    # Inputs placed as the step lays them out (a no-op for the step's own outputs), so that the
    # first call, on the caller's arrays, compiles the same program as the later ones.
    params_sharding = _shardings(layout.mesh, self.params_spec)
    split = NamedSharding(layout.mesh, layout.spec)

    program = kinds_lib.same_programs(self.kinds)

    def step(params, state, batch, *, kind=default):
      return jitted(jax.device_put(params, params_sharding), state, jax.device_put(batch, split),
                    kind=program[kind])
    # Compiled without running, as wire_bytes does.
    step.lower = lambda params, state, batch, *, kind=default: jitted.lower(
        params, state, batch, kind=program[kind])
    return step


def _shardings(mesh: jax.sharding.Mesh, specs: chex.ArrayTree) -> chex.ArrayTree:
  """``NamedSharding``s on ``mesh`` of a spec or a tree of them."""
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda s: isinstance(s, P))


def _on_pmap(worker: _WorkerStep, kinds: tuple[StepKind, ...], axis_name, donate: bool,
             per_worker_params: bool) -> DataParallel:
  """The same step under ``jax.pmap``: every state leaf carries the device axis (and the
  parameters, when they are per worker)."""
  count = jax.local_device_count()
  split = lambda batch: jax.tree.map(lambda x: x.reshape((count, -1) + x.shape[1:]), batch)
  copies = lambda tree: jax.tree.map(lambda x: jax.numpy.broadcast_to(x, (count,) + x.shape), tree)
  init_each = jax.pmap(worker.tx.init, axis_name=axis_name)
  init = lambda params: init_each(copies(params))
  by_name = {k.name: k for k in kinds}
  default = kinds_lib.steady(kinds)

  def one_device(params, state, batch, kind):
    params, _, state, metrics = worker(jnp.zeros((), jnp.int32), params, (), state, batch,
                                       by_name[kind])
    gathered = worker.gathered(metrics)
    if worker.skip_nonfinite:
      gathered["skipped_steps"] = state.skipped
    return params, state, gathered

  @functools.lru_cache(maxsize=None)
  def pmapped(kind):
    params_axis = 0 if per_worker_params else None
    return jax.pmap(functools.partial(one_device, kind=kind), axis_name=axis_name,
                    in_axes=(params_axis, 0, 0), out_axes=(params_axis, 0, None),
                    donate_argnums=(1,) if donate else ())

  program = kinds_lib.same_programs(kinds)

  def step(params, state, batch, *, kind=default):
    return pmapped(program[kind])(params, state, split(batch))
  step.lower = lambda params, state, batch, *, kind=default: pmapped(program[kind]).lower(
      params, state, split(batch))
  return DataParallel(init=init, step=step, train_step=None, kinds=by_name, specs=None,
                      mesh=None, worker_params=copies if per_worker_params else lambda p: p,
                      per_worker_params=per_worker_params)
