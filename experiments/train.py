"""One training run: ``train_and_evaluate(config, workdir)``.

Data parallelism over a 1-D ``Mesh`` named ``"data"`` that spans every device of every process,
with ``config.workers_per_device`` workers on each device (1: a worker is a device; more:
simulated workers, :mod:`compressors.parallel.workers`, on the axis ``"worker"``, so that one accelerator
studies many workers). The training step is a ``jax.shard_map`` over that mesh: each worker
computes the gradient of its own batch, and the configured optax chain
(:mod:`experiments.methods`) does all the communication: its first transformation compresses,
exchanges and averages the gradients, identically on every worker, and the optimizer that follows
applies the same update everywhere. No gradient is summed outside the chain.

When the config asks for more devices than an accelerator platform has, the runner says so in
one line and simulates the rest: ``num_devices=8`` on one GPU trains 8 workers as 8 simulated
workers of that GPU (on CPU the runner exposes the devices the config asks for,
:func:`experiments.distributed.expose_cpu_devices`).

What lives where (``TrainState``):

* ``step``, ``params``: replicated (``P()``), bit-identical on every device.
* ``opt_state``: the leaves that differ from worker to worker (error-feedback residuals and other
  compressor memories) carry a leading worker axis (``P("data")``: one row per worker); the rest
  (counters, the moments of the optimizer after the exchange) is replicated
  (``compressors.state_specs``).
* ``model_state``: batch-norm statistics, per worker (each worker normalises with its own
  batch); averaged over workers when evaluating, which equals averaging them every step because
  the running average is linear. The training step therefore moves nothing but gradients.

The layout is the same with simulated workers as with one worker per device, so a checkpoint
holds the same arrays either way.

Per-step inputs: a method whose update takes inputs on some steps declares them in the registry
(``compressors.registry.StepInputs``: every how many steps, and how to make them from the
worker's loss, parameters and batch; TASC's is a Hutchinson estimate of the Hessian diagonal).
On those steps the step makes them and passes them to the chain's update as keyword arguments;
such steps are a second compiled variant of the step. The trainer names no method.

Bytes on the wire are read from the compiled steps with ``compressors.wire_bytes``; the dense
baseline is the same step with ``method="dense"``, compiled but never run. With simulated
workers both come from the program of one worker per device
(``compressors.Workers.equivalent_mesh``: compiled for as many devices, never run), the bytes one
worker would send. With per-step inputs
every ``h`` steps, ``wire_bytes`` is the average per step over ``h`` steps, whatever the variant
with inputs moves included. The reliability checks below move a few bytes more, reported
apart as ``guard_bytes`` (also read from compiled programs) so that ``wire_bytes`` and
``compression_ratio`` describe the gradient exchange alone.

Failures (see README, "Failure behaviour"):

* Non-finite gradients: with ``config.skip_nonfinite`` the chain is wrapped in
  ``compressors.skip_nonfinite``; a step whose gradient is not finite on any device is skipped on
  every device (parameters, optimizer moments, residuals, curvature and batch statistics stay as
  they were) and counted (``skipped_steps`` in ``metrics.jsonl``).
* Replica drift: every ``config.check_replicas_every`` steps a separate small program compares a
  checksum of every device's copy of the parameters (``compressors.replicas_agree``); a mismatch
  raises :class:`ReplicaDriftError` naming the step, before that step is checkpointed.
* Divergence: a run whose final training or test loss is not finite, or that skipped more than
  ``config.max_skipped_fraction`` of its steps, finishes (its ``results.json`` says
  ``"diverged": true`` and why, in ``divergence``); ``experiments.run`` then exits non-zero.
* Signals: a first SIGINT or SIGTERM stops the run at the next step boundary, after a
  checkpoint of that step, with :class:`experiments.interrupt.Interrupted` (every process of a
  multi-process run at the same step); restarting with the same workdir resumes from it.
* Crashes: the state is the whole position of the run (the data position is the step), and
  checkpoints are written atomically, so a killed run restarted with the same workdir ends bit
  for bit as an uninterrupted one. A workdir whose checkpoints another config wrote is refused
  (:func:`experiments.validation.check_resume`); a checkpoint that cannot be read is moved aside
  and the newest readable one restored (:meth:`experiments.checkpoint.Checkpointer.restore_latest`).
* One run per workdir: a run holds the workdir's lock (:mod:`experiments.lock`) from the end of
  its checks to its exit; a second run on it is refused, naming the first.
"""

import contextlib
import functools
import json
import os
import queue
import threading
import time
from typing import Any, NamedTuple

from absl import logging
import jax
from jax import lax
from jax.experimental import multihost_utils
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import ml_collections
import numpy as np
import optax
import tqdm

import compressors
from experiments import checkpoint
from experiments import data
from experiments import distributed
from experiments import interrupt
from experiments import lock
from experiments import logs
from experiments import methods
from experiments import models
from experiments import provenance
from experiments import tasks
from experiments import validation

AXIS = methods.AXIS_NAME
WORKER_AXIS = "worker"  # the simulated workers' axis (vmap), inside each device
RESULTS_FILE = "results.json"
PyTree = Any


class ReplicaDriftError(RuntimeError):
  """The devices' copies of the parameters are no longer bit-identical."""


class TrainState(NamedTuple):
  """The whole state of a run (see the module docstring for what is per device)."""
  step: jax.Array
  params: PyTree
  model_state: PyTree
  opt_state: PyTree


_FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def make_workers(config) -> compressors.Workers:
  """The run's workers: ``config.num_devices`` devices (None: all) on a 1-D mesh named
  ``"data"``, ``config.workers_per_device`` on each; on an accelerator with fewer devices, the
  missing devices' workers simulated on those there are (:func:`split_workers`; one line says
  so). With several processes every process gives the mesh as many of its devices (the CPU
  exposes more where simulated workers' bytes need them).

  Raises:
    ValueError: more devices asked for than exposed on CPU or across processes (the message
      says how), or a device count the processes do not divide.
  """
  validation.check_workers(config)
  devices = jax.devices()
  asked = len(devices) if config.num_devices is None else config.num_devices
  platform = devices[0].platform
  if jax.process_count() == 1:
    count, per_device = split_workers(asked, config.workers_per_device, len(devices), platform)
    if count < asked:
      logging.warning("config.num_devices=%d but %d %s device(s) exist: simulating %d workers "
                      "as %d per device on %d device(s)", asked, len(devices), platform,
                      count * per_device, per_device, count)
    chosen = devices[:count]
  else:
    per_device = config.workers_per_device
    local = jax.local_device_count()
    if asked % jax.process_count() or asked // jax.process_count() > local:
      raise ValueError(
          f"config.num_devices={asked} with {jax.process_count()} processes of {local} "
          f"{platform} devices each: every process gives the mesh num_devices / processes of "
          "its devices; allowed: a multiple of the processes, at most their devices")
    per_process = asked // jax.process_count()
    chosen = [d for p in range(jax.process_count())
              for d in [d for d in devices if d.process_index == p][:per_process]]
  mesh = Mesh(np.asarray(chosen), (AXIS,))
  return compressors.Workers.on(mesh, AXIS if per_device == 1 else (AXIS, WORKER_AXIS),
                                per_device)


def split_workers(num_devices: int, workers_per_device: int, available: int,
                  platform: str) -> tuple[int, int]:
  """``(devices, workers per device)`` for ``num_devices x workers_per_device`` workers on
  ``available`` devices of ``platform`` (one process): as asked where there are enough devices;
  on an accelerator with fewer, the most devices that divide ``num_devices``, each with the
  workers of ``num_devices / devices`` asked-for devices.

  Raises:
    ValueError: too few CPU devices (the host platform exposes what the config asks for when
      told before JAX starts; the message says how).
  """
  if num_devices <= available:
    return num_devices, workers_per_device
  if platform == "cpu":
    raise ValueError(
        f"config.num_devices={num_devices} but only {available} {platform} devices exist; on CPU "
        f"the host platform exposes {num_devices} when jax.config.update('jax_num_cpu_devices', "
        f"{num_devices * workers_per_device}) runs before JAX's first computation "
        "(experiments.run does so from the config); or lower num_devices, or simulate workers "
        "with config.workers_per_device")
  used = max(d for d in range(1, available + 1) if num_devices % d == 0)
  return used, num_devices // used * workers_per_device


def _forward(model, task, variables, batch, *, train, rng):
  """Outcomes of the model on ``batch`` and the updated model state (batch statistics)."""
  model_state = {k: v for k, v in variables.items() if k != "params"}
  inputs = task.inputs(batch)
  rngs = {} if rng is None else {"dropout": rng}
  if train and model_state:
    logits, model_state = model.apply(variables, *inputs, train=True, rngs=rngs,
                                      mutable=list(model_state))
  else:
    logits = model.apply(variables, *inputs, train=train, rngs=rngs)
  return task.outcomes(logits, batch), model_state


def _variables_initializer(model, task, example_batch, num_workers):
  """``seed -> (params, model_state)``, the model state with a leading worker axis."""
  inputs = task.inputs(example_batch)

  def init_variables(seed):
    key = jax.random.PRNGKey(seed)
    variables = dict(model.init({"params": key, "dropout": key}, *inputs, train=False))
    params = variables.pop("params")
    return params, jax.tree.map(lambda x: jnp.broadcast_to(x, (num_workers,) + x.shape),
                                variables)
  return init_variables


class _Program(NamedTuple):
  """The jitted functions of one run (compiled on first use)."""
  specs: TrainState
  init_opt_state: Any
  train_steps: dict[bool, Any]  # with the method's per-step inputs -> step
  evaluate: Any
  replicas_agree: Any  # params -> bool, the same on every device


def _build_program(model, task, tx, learning_rate, workers, config, example,
                   step_inputs) -> _Program:
  """Jitted ``shard_map`` functions for optimizer-state init, the training step(s) and eval.

  ``workers`` is a ``compressors.Workers``; ``example`` is a :class:`TrainState` and a global
  batch, abstract (their shapes and dtypes).
  """
  mesh, axis = workers.mesh, workers.axis_name
  dropout_key, inputs_key = jax.random.split(jax.random.PRNGKey(config.seed))

  def loss_of(model_state, rng):
    """One worker's loss on its batch, its accuracy and new batch statistics as aux."""
    def loss_fn(params, local_batch):
      outcomes, new_model_state = _forward(model, task, {"params": params, **model_state},
                                           local_batch, train=True, rng=rng)
      loss, accuracy = tasks.mean_loss(outcomes)
      return loss, (accuracy, new_model_state)
    return loss_fn

  def make_inputs(params, batch, model_state, step):
    """The method's per-step inputs (``make`` with this worker's loss and batch)."""
    loss_fn = loss_of(model_state, jax.random.fold_in(dropout_key, step))
    return step_inputs.make(lambda p, b: loss_fn(p, b)[0], workers.own_copy(params), batch,
                            jax.random.fold_in(inputs_key, step), axis)

  specs = TrainState(step=P(), params=P(), model_state=workers.spec,
                     opt_state=workers.layout(_opt_state_specs(tx, workers, example, make_inputs,
                                                               step_inputs is not None)))
  opt_axes = compressors.parallel.workers.per_worker_axes(specs.opt_state)
  # Simulated workers are untyped: shard_map's replication types know only mesh axes.
  shard_map = functools.partial(jax.shard_map, mesh=mesh, check_vma=workers.per_device == 1)

  def worker_step(step, params, model_state, opt_state, batch, with_inputs):
    old_model_state = model_state
    rng = jax.random.fold_in(jax.random.fold_in(dropout_key, step),
                             compressors.network.axes.worker_index(axis))
    loss_fn = loss_of(model_state, rng)
    # Differentiate with respect to the worker's own copy of the replicated parameters: the
    # gradient of an unvarying input would be summed over devices by shard_map's autodiff, a
    # dense all-reduce before the chain could compress anything.
    (loss, (accuracy, model_state)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        workers.own_copy(params), batch)
    extra_args = make_inputs(params, batch, model_state, step) if with_inputs else {}
    updates, opt_state = tx.update(grads, opt_state, params, **extra_args)
    params = optax.apply_updates(params, updates)
    metrics = {"loss": loss, "accuracy": accuracy,
               "learning_rate": jnp.asarray(learning_rate(step), jnp.float32)}
    if config.skip_nonfinite:
      # A skipped step keeps the batch statistics too: a non-finite batch would otherwise poison
      # this worker's normalisation for every later step.
      model_state = jax.tree.map(lambda old, new: jnp.where(opt_state.last_skipped, old, new),
                                 old_model_state, model_state)
      metrics["skipped_steps"] = opt_state.skipped
    return params, model_state, opt_state, metrics

  def per_device_step(state, batch, with_inputs):
    each = workers.each(functools.partial(worker_step, with_inputs=with_inputs),
                        (None, None, 0, opt_axes, 0), (None, 0, opt_axes, 0))
    params, model_state, opt_state, metrics = each(state.step, state.params, state.model_state,
                                                   state.opt_state, batch)
    return TrainState(state.step + 1, params, model_state, opt_state), metrics

  def train_step(with_inputs):
    return jax.jit(shard_map(
        functools.partial(per_device_step, with_inputs=with_inputs),
        in_specs=(specs, workers.spec), out_specs=(specs, workers.spec)), donate_argnums=0)

  def worker_eval(params, model_state, batch):
    model_state = jax.tree.map(lambda x: lax.pmean(x, axis), model_state)
    outcomes, _ = _forward(model, task, {"params": params, **model_state}, batch, train=False,
                           rng=None)
    mask = batch["mask"].reshape(batch["mask"].shape + (1,) * (outcomes.weight.ndim - 1))
    weight = outcomes.weight * mask
    sums = jnp.stack([(outcomes.loss * weight).sum(), (outcomes.correct * weight).sum(),
                      weight.sum()])
    return lax.psum(sums, axis)

  init_opt_state = jax.jit(shard_map(workers.each(tx.init, None, opt_axes), in_specs=P(),
                                     out_specs=specs.opt_state))
  evaluate = jax.jit(shard_map(workers.each(worker_eval, (None, 0, 0), None),
                               in_specs=(P(), workers.spec, workers.spec), out_specs=P()))
  replicas_agree = jax.jit(jax.shard_map(
      lambda params: compressors.replicas_agree(params, workers.device_axes), mesh=mesh,
      in_specs=P(), out_specs=P()))
  every = step_inputs.every if step_inputs else 0
  variants = {0: (False,), 1: (True,)}.get(every, (False, True))
  return _Program(specs, init_opt_state, {v: train_step(v) for v in variants},
                  evaluate, replicas_agree)


def _opt_state_specs(tx, workers, example, make_inputs, with_inputs: bool) -> PyTree:
  """``compressors.state_specs`` of the chain, traced on the mesh of one worker per device (the
  layout is the same with simulated workers), with what the per-step inputs make per worker."""
  mesh, axis = workers.equivalent_mesh(abstract=True), workers.axis_name
  example_state, example_batch = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), example)
  extra_shapes = {}
  if with_inputs:
    one_each = compressors.Workers(mesh, axis)
    stacked = jax.eval_shape(jax.shard_map(
        one_each.each(lambda params, model_state, step, batch: make_inputs(
            params, batch, model_state, step), (None, 0, None, 0), 0),
        mesh=mesh, in_specs=(P(), P(axis), P(), P(axis)), out_specs=P(axis), check_vma=False),
        example_state.params, example_state.model_state, example_state.step, example_batch)
    extra_shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), stacked)
  return compressors.state_specs(tx, example_state.params, mesh, axis, **extra_shapes)


def _init_state(init_variables, program, workers, seed) -> TrainState:
  replicated = NamedSharding(workers.mesh, P())
  # Initialisation runs once: compile it without LLVM's expensive passes (threefry random bits
  # otherwise take tens of seconds to compile on CPU for a ResNet).
  init = jax.jit(init_variables, out_shardings=(
      replicated, NamedSharding(workers.mesh, workers.spec))).lower(seed).compile(
          compiler_options=_FAST_COMPILE)
  params, model_state = init(seed)
  step = jax.device_put(jnp.zeros((), jnp.int32), replicated)
  return TrainState(step, params, model_state, program.init_opt_state(params))


def _local_devices(mesh: Mesh) -> list[jax.Device]:
  """This process's devices in mesh order."""
  return [d for d in mesh.devices.flat if d.process_index == jax.process_index()]


def _local_shards(workers) -> data.ShardSpec:
  """The data shards of this process's workers: worker ``w`` of the device at mesh position
  ``d`` reads shard ``d * per_device + w``, its rank in the collectives."""
  positions = {d: i for i, d in enumerate(workers.mesh.devices.flat)}
  return data.ShardSpec(workers.count, tuple(
      positions[d] * workers.per_device + w for d in _local_devices(workers.mesh)
      for w in range(workers.per_device)))


def _to_global(local: dict[str, np.ndarray], workers) -> dict[str, jax.Array]:
  """Host rows ``[local_workers, batch, ...]`` -> global arrays ``[workers, batch, ...]``."""
  sharding = NamedSharding(workers.mesh, workers.spec)
  devices, rows = _local_devices(workers.mesh), workers.per_device

  def put(x):
    shards = [jax.device_put(x[i * rows:(i + 1) * rows], d) for i, d in enumerate(devices)]
    return jax.make_array_from_single_device_arrays((workers.count,) + x.shape[1:], sharding,
                                                    shards)
  return {k: put(v) for k, v in local.items()}


def _prefetch(make, steps, depth=2):
  """Yields ``make(step)`` for ``steps``, computed ``depth`` ahead on a background thread."""
  buffer = queue.Queue(maxsize=depth)

  def produce():
    try:
      for step in steps:
        buffer.put(make(step))
    except Exception as e:  # pylint: disable=broad-except  # re-raised in the consumer
      buffer.put(e)

  threading.Thread(target=produce, daemon=True).start()
  for _ in steps:
    item = buffer.get()
    if isinstance(item, Exception):
      raise item
    yield item


def _abstract(tree: PyTree, mesh: Mesh, specs: PyTree) -> PyTree:
  """Shape and dtype of ``tree``'s arrays, sharded on ``mesh`` by ``specs`` (one spec, or a tree
  of them)."""
  specs = jax.tree.broadcast(specs, tree, is_leaf=lambda s: isinstance(s, P))
  return jax.tree.map(lambda x, spec: jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=NamedSharding(mesh, spec)), tree, specs,
      is_leaf=lambda s: isinstance(s, P))


_dense_bytes_cache: dict[str, float] = {}


def _dense_bytes(config, model, task, workers, learning_rate, state, batch) -> float:
  """Bytes per worker of the same step with ``method="dense"`` (compiled for ``workers``, one
  per device, never run; remembered per process for runs that differ only in the method, as a
  sweep's do). ``state`` and ``batch`` are abstract."""
  key = json.dumps([workers.count, {k: v for k, v in config.to_dict().items()
                                if k not in ("method", "compression")}], sort_keys=True,
                    default=str)
  if key not in _dense_bytes_cache:
    dense_config = ml_collections.ConfigDict(config.to_dict())
    dense_config.method = "dense"
    # Momentum correction needs error feedback, which dense lacks.
    dense_config.compression.momentum_correction = 0.0
    dense_config.compression.clip_norm = None
    dense_tx = methods.training_chain(dense_config, learning_rate, workers.axis_name)
    program = _build_program(model, task, dense_tx, learning_rate, workers, dense_config,
                             (state, batch), step_inputs=None)
    opt_state = jax.eval_shape(program.init_opt_state, state.params)
    dense_state = state._replace(opt_state=_abstract(opt_state, workers.mesh,
                                                     program.specs.opt_state))
    _dense_bytes_cache[key] = compressors.wire_bytes(program.train_steps[False], dense_state,
                                                     batch).total
  return _dense_bytes_cache[key]


def _guard_bytes(config, program, workers, params) -> tuple[float, float]:
  """Bytes per worker per step of the reliability checks: ``(in_step, replica_check)``, read
  from programs compiled for ``workers`` (one per device).

  ``in_step``: the all-reduce of ``compressors.skip_nonfinite``'s flag, part of every training
  step (compiled alone: it does not depend on the gradient). ``replica_check``: the replica
  check's, spread over ``config.check_replicas_every`` steps.
  """
  in_step = replica_check = 0.0
  if config.skip_nonfinite:
    guard = compressors.skip_nonfinite(optax.identity(), axis_name=workers.axis_name)
    flag_only = jax.shard_map(lambda g: guard.update(g[0], guard.init(g[0]))[1].skipped[None],
                              mesh=workers.mesh, in_specs=workers.spec, out_specs=workers.spec)
    in_step = compressors.wire_bytes(flag_only,
                                     jax.ShapeDtypeStruct((workers.count,), jnp.float32)).total
  if config.check_replicas_every:
    replica_check = (compressors.wire_bytes(program.replicas_agree, params).total
                     / config.check_replicas_every)
  return in_step, replica_check


def _communication(config, model, task, tx, learning_rate, workers, program, example,
                   step_inputs, state) -> dict[str, Any]:
  """Bytes per worker per step, read from compiled programs: ``wire_bytes`` (the gradient
  exchange, averaged over the steps with and without per-step inputs), ``dense_bytes`` (the same
  step with ``method="dense"``), ``compression_ratio`` (None with one worker: no bytes travel),
  ``guard_bytes`` (the reliability checks). With simulated workers, from the programs of one
  worker per device (compiled for as many devices, never run)."""
  one_each = workers
  if workers.per_device > 1:
    one_each = compressors.Workers.on(workers.equivalent_mesh(), workers.axis_name)
    program = _build_program(model, task, tx, learning_rate, one_each, config, example,
                             step_inputs)
  state = TrainState(_abstract(state.step, one_each.mesh, P()),
                     _abstract(state.params, one_each.mesh, P()),
                     _abstract(state.model_state, one_each.mesh, one_each.spec),
                     _abstract(state.opt_state, one_each.mesh, program.specs.opt_state))
  batch = _abstract(example[1], one_each.mesh, one_each.spec)
  step_bytes = {r: compressors.wire_bytes(fn, state, batch).total
                for r, fn in program.train_steps.items()}
  every = step_inputs.every if step_inputs else 1
  wire = (step_bytes.get(False, 0.0) * (every - 1)
          + step_bytes.get(True, step_bytes.get(False))) / every
  dense = (step_bytes[False] if config.method == "dense" else
           _dense_bytes(config, model, task, one_each, learning_rate, state, batch))
  in_step_guard, replica_check = _guard_bytes(config, program, one_each, state.params)
  wire, dense = wire - in_step_guard, dense - in_step_guard
  return {"wire_bytes": wire, "dense_bytes": dense,
          "compression_ratio": dense / wire if wire else None,
          "guard_bytes": in_step_guard + replica_check}


def _check_replicas(program, params, step: int) -> None:
  """Raises :class:`ReplicaDriftError` naming ``step`` if the devices' parameters differ."""
  if bool(jax.device_get(program.replicas_agree(params))):
    return
  differing = []
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    shards = [(s.device.id, np.asarray(s.data)) for s in leaf.addressable_shards]
    devices = [d for d, x in shards[1:] if x.tobytes() != shards[0][1].tobytes()]
    if devices:
      differing.append(f"{jax.tree_util.keystr(path)} on devices {devices} (vs device "
                       f"{shards[0][0]})")
  where = "; ".join(differing) or "on devices of another process"
  raise ReplicaDriftError(
      f"replica drift detected at step {step}: the devices' copies of the parameters are no "
      f"longer bit-identical ({where}). Every device must apply the same update; the run stops "
      "here, before this step is checkpointed. Restarting resumes from the last checkpoint.")


def _train_batch(dataset, config, step: int) -> dict[str, np.ndarray]:
  """``dataset.train_batch(step)``, with an unreadable file reported with the data settings."""
  try:
    return dataset.train_batch(step)
  except OSError as e:
    raise ValueError(
        f"config.dataset={config.dataset!r}, config.data_dir={config.data_dir!r}: a file of the "
        f"training batch of step {step} cannot be read ({type(e).__name__}: {e}); every file "
        f"must be readable in the dataset's format (see experiments/data/)") from e


def _evaluate(program, state, dataset, workers) -> dict[str, float]:
  sums = np.zeros(3)
  for batch in dataset.eval_batches():
    sums += np.asarray(jax.device_get(program.evaluate(state.params, state.model_state,
                                                       _to_global(batch, workers))))
  return dataset.derive({"test_loss": float(sums[0] / sums[2]),
                         "test_accuracy": float(sums[1] / sums[2])})


def _skipped_steps(state: TrainState) -> int:
  """Steps skipped so far for a non-finite gradient (0 without ``config.skip_nonfinite``)."""
  if not isinstance(state.opt_state, compressors.SkipNonFiniteState):
    return 0
  return int(jax.device_get(state.opt_state.skipped))


def _provenance(workers: compressors.Workers) -> dict[str, Any]:
  """Where this run's results come from (:func:`experiments.provenance.record`)."""
  return provenance.record(devices=list(workers.mesh.devices.flat), num_workers=workers.count,
                           process_count=jax.process_count())


def divergence(config, steps: int, skipped: int, losses: dict[str, float | None]) -> str | None:
  """Why a finished run counts as diverged, or None if it does not.

  Args:
    config: the run's config (``max_skipped_fraction``).
    steps: the run's training steps.
    skipped: steps skipped for a non-finite gradient.
    losses: the final losses by name (``train_loss``, ``test_loss``); None where unknown.

  Returns:
    One line naming every reason: a final loss that is not finite, more than
    ``config.max_skipped_fraction`` of the steps skipped.
  """
  reasons = [f"the final {name.replace('_', ' ')} is {value}" for name, value in losses.items()
             if value is not None and not np.isfinite(value)]
  if skipped > config.max_skipped_fraction * steps:
    reasons.append(f"{skipped} of its {steps} steps were skipped for a non-finite gradient (more "
                   f"than config.max_skipped_fraction={config.max_skipped_fraction})")
  return "; ".join(reasons) or None


def total_steps(config, steps_per_epoch: int) -> int:
  """Training steps of the run: ``num_steps``, or ``num_epochs`` epochs."""
  if config.num_steps:
    return config.num_steps
  return max(1, int(round(config.num_epochs * steps_per_epoch)))


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Trains and evaluates ``config``, resuming from ``workdir``'s latest checkpoint.

  Args:
    config: a run config (see ``configs/common.py`` for the fields).
    workdir: where logs, checkpoints and ``results.json`` go; a run restarted with the same
      workdir continues from its last checkpoint and ends as an uninterrupted run would.

  Returns:
                                                       _to_global(batch, workers))))
  return dataset.derive({"test_loss": float(sums[0] / sums[2]),
                         "test_accuracy": float(sums[1] / sums[2])})

  Raises:
    ValueError, TypeError, FileNotFoundError: bad config values, unknown names, missing or
      unreadable data, or a workdir holding another config's checkpoints, before anything is
      compiled; no checkpoint of the workdir can be read (a newer one that cannot be read is
      moved aside, and the newest readable one restored: experiments.checkpoint).
    experiments.lock.WorkdirInUse: another run holds the workdir.
    ReplicaDriftError: the devices' parameters stopped being bit-identical.
    experiments.interrupt.Interrupted: a SIGINT or SIGTERM stopped the run at a step boundary,
      checkpointed (a BaseException, as KeyboardInterrupt).
  """
  return train(config, workdir)[0]


def train(config: ml_collections.ConfigDict, workdir: str) -> tuple[dict[str, Any], TrainState]:
  """:func:`train_and_evaluate`, also returning the final :class:`TrainState`."""
  started = time.time()
  distributed.initialize(config)  # before the stop request: it asks JAX's preemption service
  with interrupt.StopRequest() as stop, contextlib.ExitStack() as held:
    return _train(config, workdir, stop, started,
                  lock_workdir=lambda: held.enter_context(_workdir_lock(workdir)))


@contextlib.contextmanager
def _workdir_lock(workdir: str):
  """``workdir``'s lock (:mod:`experiments.lock`), taken once per run: by process 0, which tells
  the other processes whether it could.

  Raises:
    experiments.lock.WorkdirInUse: another run holds it (on every process).
  """
  if jax.process_count() == 1:
    with lock.hold(workdir):
      yield
    return
  with contextlib.ExitStack() as held:
    refusal = ""
    if jax.process_index() == 0:
      try:
        held.enter_context(lock.hold(workdir))
      except lock.WorkdirInUse as e:
        refusal = str(e)
    if not multihost_utils.broadcast_one_to_all(np.int32(not refusal)):
      raise lock.WorkdirInUse(refusal or f"workdir={workdir!r} is in use by another run (process "
                                         "0 says which)")
    yield


def _train(config, workdir, stop: interrupt.StopRequest, started: float, lock_workdir):
  """:func:`train` once the processes have joined; stops where ``stop`` says, holds the workdir
  from ``lock_workdir()`` on (once the config is checked)."""
  workers = make_workers(config)
  mesh = workers.mesh
  validation.check_config(config, workers.count)
  validation.check_workdir(workdir)
  is_main = jax.process_index() == 0

  dataset = data.load(config, _local_shards(workers))
  model = models.build_model(config.model, **dataset.model_fields)
  task = tasks.TASKS[dataset.task]
  steps = total_steps(config, dataset.steps_per_epoch)
  learning_rate = methods.learning_rate_schedule(config, dataset.steps_per_epoch, steps)
  tx = methods.training_chain(config, learning_rate, workers.axis_name)
  step_inputs = methods.step_inputs(config)
  first_batch = _train_batch(dataset, config, 0)
  lock_workdir()
  checkpointer = checkpoint.Checkpointer(workdir, keep=config.keep_checkpoints)
  restored = checkpointer.latest_step()
  validation.check_resume(config, workdir, restored)
  if is_main:
    os.makedirs(workdir, exist_ok=True)
    logs.write_json(os.path.join(workdir, validation.CONFIG_FILE),
                    {**config.to_dict(), provenance.KEY: _provenance(workers)})

  init_variables = _variables_initializer(model, task, {k: v[0] for k, v in first_batch.items()},
                                          workers.count)
  params_shape, model_state_shape = jax.eval_shape(init_variables, config.seed)
  example = (TrainState(jax.ShapeDtypeStruct((), jnp.int32), params_shape, model_state_shape, ()),
             jax.tree.map(lambda x: jax.ShapeDtypeStruct((workers.count,) + x.shape[1:], x.dtype),
                          first_batch))
  program = _build_program(model, task, tx, learning_rate, workers, config, example, step_inputs)
  state = _init_state(init_variables, program, workers, config.seed)
  num_params = sum(x.size for x in jax.tree.leaves(state.params))
  resumed = checkpointer.restore_latest(state)
  if resumed is not None:
    logging.warning("%s: resuming from the checkpoint of step %d", workdir, resumed[0])
    state = resumed[1]
  start = int(jax.device_get(state.step))

  communication = _communication(config, model, task, tx, learning_rate, workers, program,
                                 example, step_inputs, state)

  writer = logs.MetricsWriter(workdir, active=is_main, resume_step=start)
  mean_metrics = jax.jit(lambda m: jax.tree.map(jnp.mean, m),
                         out_shardings=NamedSharding(mesh, P()))
  progress = tqdm.tqdm(total=steps, initial=start, disable=not is_main, unit="step",
                       desc=os.path.basename(os.path.normpath(workdir)), dynamic_ncols=True)
  train_loss, examples_per_sec = float("nan"), 0.0
  last_time, last_step = time.time(), start
  batches = _prefetch(lambda s: _to_global(_train_batch(dataset, config, s), workers),
                      range(start, steps))
  on_cpu = mesh.devices.flat[0].platform == "cpu"
  for step in range(start, steps + 1):  # every step boundary, where a signal stops the run
    if stop.should_stop():
      progress.close()
      if step > start:  # else the latest checkpoint (none at step 0) already holds this position
        if config.check_replicas_every and step % config.check_replicas_every:
          _check_replicas(program, state.params, step)
        checkpointer.save(step, state)
      checkpointer.close()
      writer.close()
      raise interrupt.Interrupted(step, stop.stopping_signal(), workdir)
    if step == steps:
      break
    with_inputs = step_inputs is not None and step % step_inputs.every == 0
    state, metrics = program.train_steps[with_inputs](state, next(batches))
    if on_cpu:
      # One program in flight at a time: simulated CPU devices share one thread pool, and runs
      # with several steps in flight occasionally hung in a collective (experiments.distributed).
      jax.block_until_ready(state.step)
    done = step + 1
    progress.update(1)
    if (config.log_every and done % config.log_every == 0) or done == steps:
      metrics = jax.device_get(mean_metrics(metrics))
      now = time.time()
      examples_per_sec = config.batch_size * (done - last_step) / (now - last_time)
      last_time, last_step = now, done
      train_loss = float(metrics["loss"])
      writer.write(done, {"loss": train_loss, "accuracy": float(metrics["accuracy"]),
                          "learning_rate": float(metrics["learning_rate"]),
                          "skipped_steps": int(metrics.get("skipped_steps", 0)),
                          "examples_per_sec": examples_per_sec, **communication})
      progress.set_postfix(loss=f"{train_loss:.4f}")
    if config.check_replicas_every and done % config.check_replicas_every == 0:
      _check_replicas(program, state.params, done)
    if config.eval_every and done % config.eval_every == 0 and done != steps:
      writer.write(done, _evaluate(program, state, dataset, workers))
    if config.checkpoint_every and done % config.checkpoint_every == 0:
      checkpointer.save(done, state)
  progress.close()
  if config.check_replicas_every and steps % config.check_replicas_every:
    _check_replicas(program, state.params, steps)  # before the final checkpoint

  final_eval = _evaluate(program, state, dataset, workers)
  writer.write(steps, final_eval)
  checkpointer.save(steps, state)
  checkpointer.close()
  writer.close()
  if start == steps:  # resumed after the last step: the training loss it logged then
    train_loss = next((r["loss"] for r in reversed(logs.read_metrics(workdir)) if "loss" in r),
                      None)
  skipped = _skipped_steps(state)
  reason = divergence(config, steps, skipped,
                      {"train_loss": train_loss, "test_loss": final_eval["test_loss"]})
  results = {"step": steps, "train_loss": train_loss, "examples_per_sec": examples_per_sec,
             "skipped_steps": skipped, "num_params": num_params,
             "wall_seconds": time.time() - started, "num_workers": workers.count,
             "workers_per_device": workers.per_device, "diverged": reason is not None,
             "divergence": reason, **final_eval, **communication, **dataset.info,
             provenance.KEY: _provenance(workers)}
  if is_main:
    logs.write_json(os.path.join(workdir, RESULTS_FILE), results)
  return results, state
