"""One training run: ``train_and_evaluate(config, workdir)``.

Data parallelism over a 1-D ``Mesh`` named ``"data"`` that spans every device of every process,
with ``config.workers_per_device`` workers on each device (1: a worker is a device; more:
simulated workers, :mod:`compressors.parallel.workers`, on the axis ``"worker"``, so that one
accelerator studies many workers). The training step is :func:`compressors.data_parallel`'s: each
worker computes the gradient of its own batch, and the configured optax chain
(:mod:`experiments.methods`) does all the communication: its first transformation compresses,
exchanges and averages the gradients, identically on every worker, and the optimizer that follows
applies the same update everywhere. No gradient is summed outside the chain. This module keeps
the loop, the data, the logs, the checkpoints and the evaluation.

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

Step kinds: a method whose update takes inputs on some steps declares them in the registry
(``compressors.registry.StepInputs``: every how many steps, and how to make them from the
worker's loss, parameters and batch; TASC's is a Hutchinson estimate of the Hessian diagonal);
:func:`compressors.data_parallel` makes them a second kind of step (``"with_inputs"``), compiled
once, and the loop runs the kind each step is due (``DataParallel.kind_at``). The trainer names
no method.

Bytes on the wire are read from each kind's compiled step (``DataParallel.wire_bytes``); the
dense baseline is the same step with ``method="dense"``, compiled but never run. With simulated
workers both come from the program of one worker per device (compiled for as many devices, never
run), the bytes one worker would send. ``wire_bytes`` is the mean over the steps run, each step
charged its kind's bytes (``bytes_by_kind``; ``total_bytes`` in the logs, their sum). The
reliability checks move a few bytes more, reported apart as ``guard_bytes`` (also read from
compiled programs) so that ``wire_bytes`` and ``compression_ratio`` describe the gradient exchange
alone.

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
  (:func:`experiments.validation.check_resume`); a checkpoint that cannot be read, or whose files
  differ from their checksums, is moved aside and the newest readable one restored
  (:meth:`experiments.checkpoint.Checkpointer.restore_latest`); a resume on other data than the
  checkpoints record is refused (:meth:`experiments.checkpoint.Checkpointer.check_data`).
* Hangs: a training step, or its batch, that has not completed within
  ``config.stall_timeout_seconds`` (the step's compilation apart) stops the run with one line
  naming the step, its kind and, in a multi-process run, the processes and the coordinator's
  address it waits for, exit status 1 (:mod:`experiments.watchdog`); a signal before the first
  step has completed stops the run at once (:mod:`experiments.interrupt`).
* One run per workdir: a run holds the workdir's lock (:mod:`experiments.lock`) from the end of
  its checks to its exit; a second run on it is refused, naming the first.
"""

import contextlib
import json
import os
import queue
import threading
import time
from typing import Any, NamedTuple

from absl import logging
import jax
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
import optimizers
from experiments import checkpoint
from experiments import data
from experiments import distributed
from experiments import interrupt
from experiments import lock
from experiments import logs
from experiments import methods
from experiments import models
from experiments import provenance
from experiments import table_planning
from experiments import tasks
from experiments import validation
from experiments import watchdog
from experiments.models import placed_dlrm

AXIS = methods.AXIS_NAME
WORKER_AXIS = "worker"  # the simulated workers' axis (vmap), inside each device
ISLANDS_AXIS, FSDP_AXIS = "islands", "fsdp"  # with config.mesh.fsdp > 1: slow x fast
RESULTS_FILE = "results.json"


class ReplicaDriftError(RuntimeError):
  """The devices' copies of the parameters are no longer bit-identical."""


# The whole state of a run (see the module docstring for what is per device); checkpoints hold it.
TrainState = compressors.TrainState


_FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def make_workers(config) -> compressors.Workers:
  """The run's workers: ``config.num_devices`` devices (None: all) on a 1-D mesh named
  ``"data"``, ``config.workers_per_device`` on each; on an accelerator with fewer devices, the
  missing devices' workers simulated on those there are (:func:`split_workers`; one line says
  so). With several processes every process gives the mesh as many of its devices (the CPU
  exposes more where simulated workers' bytes need them).

  Raises:
    ValueError: more devices asked for than exposed on CPU or across processes (the message
      says how), a device count the processes do not divide, or more simulated CPU devices per
      process than can run a collective (:func:`experiments.distributed.check_running_cpu_devices`).
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
  if platform == "cpu":  # where the runner did not expose the devices (the Python API)
    distributed.check_running_cpu_devices(len(chosen) // jax.process_count(), jax.process_count())
  islands = config.mesh.islands
  if islands is not None and islands * config.mesh.fsdp != len(chosen) * per_device:
    raise ValueError(f"config.mesh.islands={islands} x config.mesh.fsdp={config.mesh.fsdp} must "
                     f"equal the {len(chosen) * per_device} devices of the run")
  if config.mesh.fsdp > 1:
    return _islands(config, chosen, per_device)
  mesh = Mesh(np.asarray(chosen), (AXIS,))
  return compressors.Workers.on(mesh, AXIS if per_device == 1 else (AXIS, WORKER_AXIS),
                                per_device)


def _islands(config, chosen, per_device) -> compressors.Workers:
  """Workers on the mesh ``("islands", "fsdp")`` of ``chosen`` (in process order: a process's
  devices fill whole islands where it holds a multiple of ``mesh.fsdp``)."""
  shards = config.mesh.fsdp
  if per_device != 1 or len(chosen) % shards:
    raise ValueError(f"config.mesh.fsdp={shards} needs config.num_devices devices, one worker "
                     f"each, that fsdp divides; {len(chosen)} device(s) with {per_device} "
                     "worker(s) each exist (islands do not simulate workers)")
  mesh = Mesh(np.asarray(chosen).reshape(len(chosen) // shards, shards),
              (ISLANDS_AXIS, FSDP_AXIS), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  return compressors.Workers.on(mesh, ISLANDS_AXIS, 1, shard_axis=FSDP_AXIS)


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


def _training_loss(model, task):
  """One worker's loss in :func:`compressors.data_parallel`'s form with a model state:
  ``(params, batch, model_state, rng) -> (loss, (accuracy, new model state))``."""
  def loss_fn(params, batch, model_state, rng):
    outcomes, new_model_state = _forward(model, task, {"params": params, **model_state}, batch,
                                         train=True, rng=rng)
    loss, accuracy = tasks.mean_loss(outcomes)
    return loss, (accuracy, new_model_state)
  return loss_fn


def _evaluation_sums(model, task):
  """One worker's ``[loss sum, correct sum, weight sum]`` on its evaluation batch (padding rows
  weigh nothing), for :meth:`compressors.DataParallel.reduce`."""
  def sums(params, model_state, batch):
    outcomes, _ = _forward(model, task, {"params": params, **model_state}, batch, train=False,
                           rng=None)
    mask = batch["mask"].reshape(batch["mask"].shape + (1,) * (outcomes.weight.ndim - 1))
    weight = outcomes.weight * mask
    return jnp.stack([(outcomes.loss * weight).sum(), (outcomes.correct * weight).sum(),
                      weight.sum()])
  return sums


def _placed(config, model, workers, learning_rate, dataset, init_variables):
  """``model`` with its tables placed across the devices as ``config.embedding`` says
  (:class:`experiments.models.placed_dlrm.PlacedDLRM`; the planner's choice where the settings
  ask it, :mod:`experiments.table_planning`), or ``model`` itself when every table is
  replicated (or the config has no ``embedding`` block).

  Raises:
    ValueError: a placement, an override, a planner setting or a table optimizer that is not
      allowed, or tables placed for a model that has none, in one line naming the field.
  """
  block = config.get("embedding")
  if block is None:
    return model
  if not isinstance(model, models.DLRM):
    if (block.placement != "replicated" or block.overrides
        or str(block.get("hot_rows", "0")) != "0"):
      raise ValueError(f"config.embedding.placement={block.placement!r} for model "
                       f"{config.model.name!r}; allowed: embedding tables placed for dlrm only")
    return model
  table_planning.check(block)
  hot_exchange, hot_cost = methods.hot_exchange(config, workers.axis_name)
  chosen = (None if block.placement == "auto" else
            placed_dlrm.placements(model.cardinalities, block.placement, block.overrides))
  hot, capacity, predicted = None, block.capacity or None, None
  codecs = table_planning.codecs(block)
  if table_planning.needs_planner(block):
    params = jax.eval_shape(init_variables, config.seed)[0]
    tables = sum(r * model.embedding_dim for r in model.cardinalities)
    choice = table_planning.choose(
        block, model, workers.count, config.batch_size // workers.count, dataset,
        sum(x.size for x in jax.tree.leaves(params)) - tables, chosen, codecs, hot_cost,
        table_planning.state_bytes(hot_exchange))
    chosen, hot, predicted = choice.plan.placements, choice.hot, table_planning.summary(choice)
    capacity = choice.capacity if block.capacity == -1 else capacity
  plan = compressors.parallel.embeddings.plan(model.cardinalities, model.embedding_dim, chosen,
                                              workers.count, block.row_reduction)
  if all(p == "replicated" for p in chosen):
    return model
  for refused, field in ((workers.shard_axis is not None, f"config.mesh.fsdp={config.mesh.fsdp}"),
                         (methods.per_worker_params(config), f"config.method={config.method!r} "
                                                             "(local updates)")):
    if refused:
      raise ValueError(f"config.embedding places tables across devices ({block.placement!r}, "
                       f"overrides {block.overrides!r}) with {field}; allowed: no islands, a "
                       "per-step method (or every table replicated)")
  return placed_dlrm.PlacedDLRM(model, plan, workers.axis_name,
                                _table_optimizer(config, block, chosen, learning_rate),
                                capacity, hot, predicted, codecs, hot_exchange)


def _table_optimizer(config, block, chosen, learning_rate) -> optax.GradientTransformation:
  """The sharded tables' optimizer: ``same`` (the run's optimizer, elementwise ones only: a
  per-leaf norm would be a device's block's) or ``rowwise_adagrad`` (MLPerf DLRM-DCNv2's, at
  ``config.embedding.learning_rate``; rows whole, so not with column-placed tables)."""
  if block.optimizer == "same":
    if config.optimizer.name in ("lamb", "lars"):
      raise ValueError(f"config.embedding.optimizer='same' with config.optimizer.name="
                       f"{config.optimizer.name!r}: its per-leaf norms would be each device's "
                       "block's; allowed: an elementwise optimizer, or embedding.optimizer="
                       "'rowwise_adagrad'")
    return methods.optimizer(config, learning_rate)
  if block.optimizer == "rowwise_adagrad":
    if "column" in chosen:
      raise ValueError("config.embedding.optimizer='rowwise_adagrad' with column-placed tables: "
                       "a device holds part of each row; allowed: placements row, table, "
                       "replicated, or embedding.optimizer='same'")
    return optimizers.rowwise_adagrad(block.learning_rate)
  raise ValueError(f"config.embedding.optimizer={block.optimizer!r} is not allowed; allowed: "
                   "['same', 'rowwise_adagrad']")


def _param_layout(workers: compressors.Workers,
                  params) -> compressors.parallel.fsdp.ParamLayout | None:
  """With islands, the layout of ``params`` (natural shapes) over the fast axis, the one the
  step gives them, on whose shards the optimizer runs; None otherwise."""
  if workers.shard_axis is None:
    return None
  return compressors.parallel.fsdp.ParamLayout.of(params, workers.shard_axis, workers.shards)


def _data_parallel(config, model, task, tx, workers, example: TrainState,
                   batch) -> compressors.DataParallel:
  """The run's data-parallel step (:func:`compressors.data_parallel`) of ``tx`` on ``workers``,
  with the method's step kinds; ``example`` and ``batch`` are read for their shapes and dtypes
  only, the batch's rows of every worker one after the other."""
  return compressors.data_parallel(
      _training_loss(model, task), tx, workers.mesh, example.params, batch,
      axis_name=workers.axis_name, workers_per_device=workers.per_device,
      kinds=methods.step_kinds(config), model_state=example.model_state,
      rng=jax.random.PRNGKey(config.seed), skip_nonfinite=config.skip_nonfinite,
      per_worker_params=methods.per_worker_params(config), shard_axis=workers.shard_axis,
      sharded=(model.sharded_params(example.params) if isinstance(model, placed_dlrm.PlacedDLRM)
               else None))


def _state_bytes_per_device(config, dp: compressors.DataParallel, example: TrainState) -> int:
  """Bytes one device will hold of the parameters, the optimizer state and the model state
  (from shapes, before anything is allocated).

  Raises:
    ValueError: more than ``config.max_state_bytes_per_device`` (when > 0), naming both.
  """
  model_state = compressors.parallel.step_bytes.abstract(example.model_state, dp.mesh,
                                                          dp.workers.spec)
  held = (dp.state_bytes_per_device(example.params)
          + compressors.parallel.fsdp.state_bytes_per_device(model_state))
  budget = config.max_state_bytes_per_device
  if budget and held > budget:
    raise ValueError(
        f"config.max_state_bytes_per_device={budget:,}: each device would hold {held:,} bytes "
        f"of parameters and optimizer state on this mesh (mesh.islands={config.mesh.islands}, "
        f"mesh.fsdp={config.mesh.fsdp}); allowed: a budget of at least that, or a larger "
        "mesh.fsdp, which shards them inside each island")
  return held


def _init_state(init_variables, dp: compressors.DataParallel, seed) -> TrainState:
  layout = dp.workers
  replicated = NamedSharding(layout.mesh, P())
  per_worker = NamedSharding(layout.mesh, layout.spec)
  step = jax.device_put(jnp.zeros((), jnp.int32), replicated)
  # Initialisation runs once: compile it without LLVM's expensive passes (threefry random bits
  # otherwise take tens of seconds to compile on CPU for a ResNet).
  if dp.param_layout is None:
    placed = replicated if dp.sharded is None else jax.tree.map(  # tables sharded as placed
        lambda spec: NamedSharding(layout.mesh, spec), dp.params_spec,
        is_leaf=lambda x: isinstance(x, P))
    init = jax.jit(init_variables, out_shardings=(placed, per_worker)).lower(seed).compile(
        compiler_options=_FAST_COMPILE)
    params, model_state = init(seed)
    return TrainState(step, dp.worker_params(params), model_state, dp.init(params))
  # Islands: one program makes the parameters and the optimizer's state already sharded, so
  # that no device holds the whole model (threefry's bits are partitionable: each device draws
  # its shard's, the values those of the whole draw).
  shardings = jax.tree.map(lambda spec: NamedSharding(layout.mesh, spec), (dp.params_spec,
                                                                           dp.specs),
                           is_leaf=lambda x: isinstance(x, P))

  def sharded(seed):
    params, model_state = init_variables(seed)
    return dp.worker_params(params), model_state, dp.init(params)
  init = jax.jit(sharded, out_shardings=(shardings[0], per_worker, shardings[1])).lower(
      seed).compile(compiler_options=_FAST_COMPILE)
  params, model_state, opt_state = init(seed)
  return TrainState(step, params, model_state, opt_state)


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
  """Host rows ``[local_workers, batch, ...]`` -> global arrays ``[workers * batch, ...]``, each
  worker's rows after the previous worker's (as :func:`compressors.data_parallel` splits them)."""
  sharding = NamedSharding(workers.mesh, workers.spec)
  devices, rows = _local_devices(workers.mesh), workers.per_device

  def put(x):
    flat = lambda y: y.reshape((-1,) + y.shape[2:])
    shards = [jax.device_put(flat(x[i * rows:(i + 1) * rows]), d) for i, d in enumerate(devices)]
    return jax.make_array_from_single_device_arrays(
        (workers.count * x.shape[1],) + x.shape[2:], sharding, shards)
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


_dense_bytes_cache: dict[str, float] = {}


def _dense_bytes(config, model, task, learning_rate, workers, state, batch) -> float:
  """Bytes per worker of the same step with ``method="dense"`` (compiled, never run; remembered
  per process for runs that differ only in the method, as a sweep's do); ``state`` and ``batch``
  are read for their shapes only."""
  key = json.dumps([workers.count, workers.per_device,
                    {k: v for k, v in config.to_dict().items()
                     if k not in ("method", "compression")}], sort_keys=True, default=str)
  if key not in _dense_bytes_cache:
    dense_config = ml_collections.ConfigDict(config.to_dict())
    dense_config.method = "dense"
    # What only a compressor with error feedback, or a sparsifier, takes; dense is neither.
    dense_config.compression.update(compressors.registry.PLAIN_PER_STEP)
    dense_tx = methods.make_chain(dense_config, learning_rate, workers.axis_name,
                                  _param_layout(workers, state.params))
    dense = _data_parallel(dense_config, model, task, dense_tx, workers, state, batch)
    opt_state = jax.eval_shape(dense.init, state.params)
    params = jax.eval_shape(dense.worker_params, state.params)  # as the step takes them
    _dense_bytes_cache[key] = _exchange_bytes(dense, dense.wire_bytes(
        params, opt_state, batch, model_state=state.model_state))
  return _dense_bytes_cache[key]


def _exchange_bytes(dp, sent: compressors.WireBytes) -> float:
  """The bytes of the method's exchange in ``sent``: all of them, or with islands those on
  the slow axis (the link the method compresses; ZeRO-3's traffic on the fast axis is in
  ``bytes_by_axis``)."""
  if dp.workers.shard_axis is None:
    return sent.total
  return sent.by_axis.get((dp.workers.axis_name,), 0.0)


def _by_axis(dp, per_kind: dict[str, compressors.WireBytes], steps: int) -> dict[str, float]:
  """Bytes per device per step on each group of mesh axes (names joined by "+"), each step
  charged its kind's."""
  groups = {k for sent in per_kind.values() for k in sent.by_axis}
  return {"+".join(map(str, group)): dp.bytes_per_step(
      {kind: sent.by_axis.get(group, 0.0) for kind, sent in per_kind.items()}, 0, steps)
          for group in sorted(groups, key=str)}


def _communication(config, model, task, learning_rate, dp, state: TrainState, batch,
                   steps: int) -> dict[str, Any]:
  """Bytes per worker per step, read from compiled programs (one worker per device): the
  gradient exchange of each step kind (``bytes_by_kind``), their mean over the run's ``steps``
  (``wire_bytes``: each step charged its kind's), the same step with ``method="dense"``
  (``dense_bytes``), ``compression_ratio`` (None with one worker: no bytes travel) and
  ``guard_bytes`` (the reliability checks: the non-finite skip's flag, part of every step and
  taken out of the others, and the replica check, spread over its interval). ``state`` is read
  for its shapes only."""
  in_step_guard = dp.nonfinite_flag_bytes() if config.skip_nonfinite else 0.0
  replica_check = dp.replica_check_bytes(state.params) * _replica_checks_per_step(config, dp,
                                                                                 steps)
  ran = dp.kind_counts(0, steps)
  sent = {kind: dp.wire_bytes(state.params, state.opt_state, batch, kind=kind,
                              model_state=state.model_state)
          for kind in dp.kinds if ran[kind]}  # a kind the run never runs is not compiled
  # With islands the guard's flag spans both axes, not the exchange's.
  guard_in_exchange = 0.0 if dp.workers.shard_axis else in_step_guard
  by_kind = {kind: _exchange_bytes(dp, s) - guard_in_exchange for kind, s in sent.items()}
  wire = dp.bytes_per_step(by_kind, 0, steps)
  # The dense step's state is laid out for one model (replicated parameters).
  one_model = state._replace(params=jax.eval_shape(dp.model_params, state))
  dense = (by_kind[dp.kind_at(0)] if config.method == "dense" else
           _dense_bytes(config, model, task, learning_rate, dp.workers, one_model, batch)
           - guard_in_exchange)
  return {"wire_bytes": wire, "dense_bytes": dense,
          "compression_ratio": dense / wire if wire else None,
          "bytes_by_kind": by_kind, "guard_bytes": in_step_guard + replica_check,
          "bytes_by_axis": _by_axis(dp, sent, steps),
          **({"bytes_by_collective": _bytes_by_collective(model, task, dp, state, batch,
                                                          sent[dp.kind_at(0)], in_step_guard)}
             if dp.sharded is not None else {})}


_EXCHANGE_KINDS = ("all-to-all", "all-gather", "reduce-scatter")  # the embedding exchange's


def _bytes_by_collective(model, task, dp, state: TrainState, batch, step_sent,
                         in_step_guard: float) -> dict[str, float]:
  """Placed tables: bytes per device per step of the embedding exchange's forward pass (the
  IDs and rows or bags: its all-to-all, and the all-gather of some placements), of its
  backward pass (the rows' or bags' gradients) and of the dense exchange (the replicated
  leaves', by the run's method: an all-reduce, or a sparsifier's all-gather; the non-finite
  flag taken out), all from compiled programs on the training batch: the loss alone gives the
  forward, its gradient (the dense leaves' summed by an all-reduce, not counted) forward and
  backward, and the step less both the dense exchange. With simulated workers, the programs of
  one worker per device (:meth:`compressors.Workers.equivalent_mesh`), as ``step_sent``'s."""
  def loss_sum(params, model_state, batch):  # as the training step runs it (its capacity)
    outcomes, _ = _forward(model, task, {"params": params, **model_state}, batch, train=True,
                           rng=None)
    return outcomes.loss.sum()
  one_each = dp.equivalent() if dp.workers.per_device > 1 else dp
  laid_out = lambda tree, spec: compressors.parallel.step_bytes.abstract(tree, one_each.mesh,
                                                                         spec)
  args = (laid_out(state.params, one_each.params_spec),
          laid_out(state.model_state, one_each.workers.spec),
          laid_out(batch, one_each.workers.spec))
  def sent(fn):
    return compressors.parallel.hlo_bytes.wire_bytes(one_each.reduce(fn), *args)
  def exchanged(fn):
    return sum(sent(fn).by_kind.get(kind, 0.0) for kind in _EXCHANGE_KINDS)
  forward, both = exchanged(loss_sum), exchanged(jax.grad(loss_sum))
  hot = _hot_rows_all_reduce(model, sent, loss_sum)
  return {"embedding_forward": forward, "embedding_backward": both - forward,
          **({"hot_rows_all_reduce": hot} if hot is not None else {}),
          "dense_exchange": step_sent.total - in_step_guard - both - (hot or 0.0)}


def _hot_rows_all_reduce(model, sent, loss_sum) -> float | None:
  """Placed tables with hot rows: the bytes per device per step of the hot rows' gradient
  exchange (``config.embedding.hot_exchange``'s method, run in the step), from compiled
  programs (``sent``: a function's summed over the workers -> its bytes): every collective of
  the loss's gradient with respect to the hot bank (each device's own) exchanged by that method
  (its state fresh), less those of the same gradient unexchanged; None without hot rows."""
  if not isinstance(model, placed_dlrm.PlacedDLRM) or not model.hot_or_none.total:
    return None
  def hot_gradient(params, model_state, batch):
    def of_hot(hot):
      tables = {**params["tables"], "hot": hot}
      return loss_sum({**params, "tables": tables}, model_state, batch)
    return jax.grad(of_hot)(params["tables"]["hot"])
  def exchanged(params, model_state, batch):
    gradient = hot_gradient(params, model_state, batch)
    return model.hot_exchange.update(gradient, model.hot_exchange.init(gradient))[0].sum()
  return sent(exchanged).total - sent(lambda *args: hot_gradient(*args).sum()).total


def _peak_bytes(dp, state: TrainState, batch, steps: int) -> dict[str, Any]:
  """``peak_bytes_by_kind``: the most bytes one device holds while it runs a step of each kind
  the run runs (its arguments, outputs and temporaries less what is donated, from the compiled
  program's memory analysis: :meth:`compressors.DataParallel.peak_bytes_per_device`), and
  ``peak_bytes_per_device``, the largest of them (None where the backend gives no analysis).
  ``state`` and ``batch`` are read for their shapes only."""
  ran = dp.kind_counts(0, steps)
  by_kind = {kind: dp.peak_bytes_per_device(state.params, state.opt_state, batch, kind=kind,
                                            model_state=state.model_state)
             for kind in dp.kinds if ran[kind]}
  known = [b for b in by_kind.values() if b is not None]
  return {"peak_bytes_per_device": max(known) if known else None,
          "peak_bytes_by_kind": by_kind}


def _bytes_so_far(communication: dict[str, Any], dp, done: int) -> dict[str, Any]:
  """``communication`` with ``wire_bytes`` the mean over the steps ``0, ..., done - 1`` (each
  charged its kind's bytes), its ``compression_ratio``, and ``total_bytes``, their sum."""
  wire = dp.bytes_per_step(communication["bytes_by_kind"], 0, done)
  dense = communication["dense_bytes"]
  return {**communication, "wire_bytes": wire, "total_bytes": wire * done,
          "compression_ratio": dense / wire if wire else None}


def _replica_check_due(config, dp, done: int) -> bool:
  """Whether the replica check runs after step ``done - 1``: every
  ``config.check_replicas_every`` steps, or with local updates after every step that lands
  some of the model (a synchronisation; Streaming DiLoCo's fragment landing), on what landed
  (between them the workers' parameters differ by design)."""
  if not config.check_replicas_every:
    return False
  if dp.per_worker_params:
    return dp.lands(dp.kind_at(done - 1))
  return done % config.check_replicas_every == 0


def _replica_checks_per_step(config, dp, steps: int) -> float:
  """Replica checks per training step over a run of ``steps`` (for their bytes)."""
  if not config.check_replicas_every:
    return 0.0
  if not dp.per_worker_params:
    return 1 / config.check_replicas_every
  counts = dp.kind_counts(0, steps)
  return sum(n for kind, n in counts.items() if dp.lands(kind)) / max(1, steps)


def _check_replicas(dp, state: TrainState, step: int) -> None:
  """Raises :class:`ReplicaDriftError` naming ``step`` if the devices' parameters differ (with
  per-worker parameters, if the workers' rows do where the latest step landed them:
  ``dp.landed``)."""
  params = dp.landed(state.params, state.opt_state)
  if bool(jax.device_get(dp.replicas_agree(params))):
    return
  differing = []
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    # Copies of one piece are compared: with islands, the shards at one position.
    pieces = {}
    for s in leaf.addressable_shards:
      where = str(s.index[1:] if dp.per_worker_params else s.index)
      rows = enumerate(np.asarray(s.data)) if dp.per_worker_params else [(None, s.data)]
      pieces.setdefault(where, []).extend(
          (s.device.id if r is None else f"{s.device.id} row {r}", np.asarray(x)) for r, x in rows)
    for copies in pieces.values():
      devices = [d for d, x in copies[1:] if x.tobytes() != copies[0][1].tobytes()]
      if devices:
        differing.append(f"{jax.tree_util.keystr(path)} on devices {devices} (vs device "
                         f"{copies[0][0]})")
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


def _checked(run, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """``batch``, refused in one line by ``run.check_batch`` (placed tables: an ID outside its
  table) before it reaches the step."""
  if run.check_batch is not None:
    run.check_batch(batch)
  return batch


def _evaluate(evaluate, state, dataset, workers, dp, score=None) -> dict[str, float]:
  """The test metrics of the model's parameters (with local updates, the synchronised ones);
  with ``score`` (:func:`_scorer`), also the task's metrics of the whole set's logits."""
  params = dp.model_params(state)
  sums, scored = np.zeros(3), []
  for batch in dataset.eval_batches():
    batch = _to_global(batch, workers)
    sums += np.asarray(jax.device_get(evaluate(params, state.model_state, batch)))
    if score is not None:
      scored.append(multihost_utils.process_allgather(
          (score.logits(params, state.model_state, batch), batch["label"], batch["mask"]),
          tiled=True))
  metrics = {"test_loss": float(sums[0] / sums[2]), "test_accuracy": float(sums[1] / sums[2])}
  if scored:
    logits, labels, mask = (np.concatenate(parts) for parts in zip(*scored))
    metrics.update(score.metrics(labels[mask > 0], logits[mask > 0]))
  return dataset.derive(metrics)


class _Scorer(NamedTuple):
  """A task's metrics of the whole evaluation set's logits (AUC: they do not sum over
  batches): ``logits(params, model_state, global batch)`` (the model state averaged over the
  workers, as the evaluation's sums take it) and ``metrics(labels, logits)``."""
  logits: Any
  metrics: Any


def _scorer(model, task, dp) -> _Scorer | None:
  """The :class:`_Scorer` of ``task``, None when it has no such metrics."""
  if task.scores is None:
    return None
  if dp.sharded is not None:  # placed tables: each worker's rows, their lookups exchanged
    layout = dp.workers
    worker = lambda params, model_state, batch: model.apply(
        {"params": params, **jax.tree.map(lambda x: jax.lax.pmean(x, layout.worker_axes),
                                          model_state)}, *task.inputs(batch), train=False)

    def device(params, model_state, batch):
      logits = layout.each(worker, (dp.sharded.worker_axes(), 0, 0), 0)(
          dp.sharded.worker_blocks(params, layout.per_device), model_state, layout.rows(batch))
      return logits.reshape((-1,) + logits.shape[2:])  # the device's workers' rows in turn
    return _Scorer(jax.jit(layout.shard_map(device, in_specs=(dp.params_spec, layout.spec,
                                                              layout.spec),
                                            out_specs=layout.spec)), task.scores)

  @jax.jit
  def logits(params, model_state, batch):
    averaged = jax.tree.map(lambda x: jnp.mean(x, axis=0), model_state)
    return model.apply({"params": params, **averaged}, *task.inputs(batch), train=False)
  return _Scorer(logits, task.scores)


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
    The run's results, as ``results.json`` records them: the final training loss and the
    evaluation's metrics, the bytes per worker per step (``wire_bytes``, the mean over the steps
    run, and ``bytes_by_kind``), ``dense_bytes``, ``compression_ratio``, ``guard_bytes``,
    ``skipped_steps``, ``diverged`` and ``divergence``, timings, the dataset's information and
    the provenance record.

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


class _Run(NamedTuple):
  """What one run needs once it is set up (:func:`_prepare`)."""
  config: ml_collections.ConfigDict
  workdir: str
  workers: compressors.Workers
  dataset: Any
  steps: int
  learning_rate: optax.Schedule
  dp: compressors.DataParallel
  evaluate: Any  # (params, model_state, batch) -> [loss sum, correct sum, weight sum]
  communication: dict[str, Any]
  checkpointer: checkpoint.Checkpointer
  num_params: int
  score: _Scorer | None  # the task's metrics of the whole evaluation set's logits
  check_batch: Any = None  # a host batch -> None, or a one-line refusal (IDs outside a table)
  check_step: Any = None  # (model state, step) -> None, or a one-line refusal (an overflow)

  @property
  def is_main(self) -> bool:
    return jax.process_index() == 0


def _train(config, workdir, stop: interrupt.StopRequest, started: float, lock_workdir):
  """:func:`train` once the processes have joined; stops where ``stop`` says, holds the workdir
  from ``lock_workdir()`` on (once the config is checked)."""
  run, state = _prepare(config, workdir, lock_workdir)
  start = int(jax.device_get(state.step))
  writer = logs.MetricsWriter(workdir, active=run.is_main, resume_step=start)
  state, train_loss, examples_per_sec = _loop(run, state, start, writer, stop)
  if (config.check_replicas_every and not run.dp.per_worker_params
      and run.steps % config.check_replicas_every):
    _check_replicas(run.dp, state, run.steps)  # before the final checkpoint
  final_eval = _evaluate(run.evaluate, state, run.dataset, run.workers, run.dp, run.score)
  writer.write(run.steps, final_eval)
  run.checkpointer.save(run.steps, state)
  run.checkpointer.close()
  writer.close()
  if start == run.steps:  # resumed after the last step: the training loss it logged then
    train_loss = next((r["loss"] for r in reversed(logs.read_metrics(workdir)) if "loss" in r),
                      None)
  skipped = _skipped_steps(state)
  reason = divergence(config, run.steps, skipped,
                      {"train_loss": train_loss, "test_loss": final_eval["test_loss"]})
  # An equal-bytes run records the tier it asked for and the one it met (off tier: warned).
  tier = methods.equal_bytes_tier(config)
  results = {"step": run.steps, "train_loss": train_loss, "examples_per_sec": examples_per_sec,
             "skipped_steps": skipped, "num_params": run.num_params,
             "wall_seconds": time.time() - started, "num_workers": run.workers.count,
             "workers_per_device": run.workers.per_device, "diverged": reason is not None,
             "divergence": reason, **final_eval, **run.communication, **run.dataset.info,
             **({"equal_bytes": tier} if tier else {}), **_simulated(config, run, state),
             provenance.KEY: _provenance(run.workers)}
  if run.is_main:
    logs.write_json(os.path.join(workdir, RESULTS_FILE), results)
  return results, state


def _simulated(config, run: _Run, state: TrainState) -> dict[str, Any]:
  """With simulated workers (``config.workers``, ``config.aggregation``): ``modelled_seconds``
  of the synchronisations run, ``useful_throughput`` (tokens, or examples for a task without
  sequences, that reached the model per modelled second), ``staleness`` (``mean`` and ``max``
  outer steps behind of the applied contributions), ``updates_dropped`` and
  ``updates_applied``; nothing otherwise."""
  figures = compressors.aggregation.totals(state.opt_state)
  if figures is None:
    return {}
  per_example = config.data.get("seq_len", 1) or 1
  tokens = figures["useful_steps"] * config.batch_size // run.workers.count * per_example
  seconds = figures["modelled_seconds"]
  return {"modelled_seconds": seconds,
          "useful_throughput": tokens / seconds if seconds else None,
          "staleness": {"mean": figures["staleness_mean"], "max": figures["staleness_max"]},
          "updates_dropped": figures["updates_dropped"],
          "updates_applied": figures["updates_applied"]}


def _placed_initializer(model: placed_dlrm.PlacedDLRM, init_variables, workers, workdir):
  """``init_variables`` with the tables placed and the overflow counters added; the tables'
  layout written beside the checkpoints."""
  if jax.process_index() == 0:
    checkpoint.write_embedding_layout(workdir, model.plan, model.hot_or_none.ids)

  def placed(seed):
    params, state = init_variables(seed)
    return model.place(params), {**state, **model.overflow_state(workers.count)}
  return placed


def _prepare(config, workdir, lock_workdir) -> tuple[_Run, TrainState]:
  """Checks ``config``, loads the data and the model, builds the data-parallel step, takes the
  workdir, and restores its latest readable checkpoint (or initialises the state)."""
  # A config of an equal-bytes tier is solved here too when called from Python (idempotent).
  methods.fill_equal_bytes(config)
  workers = make_workers(config)
  validation.check_config(config, workers.count)
  validation.check_workdir(workdir)
  dataset = data.load(config, _local_shards(workers))
  model = models.build_model(config.model, **dataset.model_fields)
  task = tasks.TASKS[dataset.task]
  steps = total_steps(config, dataset.steps_per_epoch)
  learning_rate = methods.learning_rate_schedule(config, dataset.steps_per_epoch, steps)
  first_batch = _train_batch(dataset, config, 0)
  lock_workdir()
  checkpointer = checkpoint.Checkpointer(workdir, keep=config.keep_checkpoints,
                                        data=dataset.identity)
  validation.check_resume(config, workdir, checkpointer.latest_step())
  checkpointer.check_data(changed_ok=config.resume_on_other_data)
  if jax.process_index() == 0:
    os.makedirs(workdir, exist_ok=True)
    logs.write_json(os.path.join(workdir, validation.CONFIG_FILE),
                    {**config.to_dict(), provenance.KEY: _provenance(workers)})

  init_variables = _variables_initializer(model, task, {k: v[0] for k, v in first_batch.items()},
                                          workers.count)
  model = _placed(config, model, workers, learning_rate, dataset, init_variables)
  if isinstance(model, placed_dlrm.PlacedDLRM):
    init_variables = _placed_initializer(model, init_variables, workers, workdir)
  params_shape, model_state_shape = jax.eval_shape(init_variables, config.seed)
  if workers.shard_axis is not None and jax.process_index() == 0:
    checkpoint.write_param_layout(workdir, params_shape, workers.shards)
  # What the method compresses: each device's shard with islands, across the islands.
  shapes = [x.shape for x in jax.tree.leaves(params_shape)]
  if workers.shard_axis is not None:
    shapes = compressors.parallel.fsdp.leaf_shard_shapes(shapes, workers.shards)
  validation.check_compresses(config, shapes, workers.count // workers.shards)
  aggregator = methods.aggregation(config, methods.worker_simulation(config, workers.count),
                                   shapes)
  tx = methods.make_chain(config, learning_rate, workers.axis_name,
                          _param_layout(workers, params_shape), aggregator)
  batch_shape = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
      (workers.count * x.shape[1],) + x.shape[2:], x.dtype), first_batch)
  example = TrainState(jax.ShapeDtypeStruct((), jnp.int32), params_shape, model_state_shape, ())
  dp = _data_parallel(config, model, task, tx, workers, example, batch_shape)
  held = _state_bytes_per_device(config, dp, example)
  state = _init_state(init_variables, dp, config.seed)
  resumed = checkpointer.restore_latest(state)
  if resumed is not None:
    logging.warning("%s: resuming from the checkpoint of step %d", workdir, resumed[0])
    state = resumed[1]
  communication = {**_communication(config, model, task, learning_rate, dp, state, batch_shape,
                                   steps), "state_bytes_per_device": held,
                   **_peak_bytes(dp, state, batch_shape, steps)}
  if getattr(model, "planned", None) is not None:  # the embedding planner's choice
    communication["embedding_planner"] = model.planned
  return _Run(config, workdir, workers, dataset, steps, learning_rate, dp,
              dp.reduce(_evaluation_sums(model, task)), communication, checkpointer,
              _num_params(model, dp.model_params(state)),
              _scorer(model, task, dp),
              *((model.check_batch, model.check_step) if isinstance(model, placed_dlrm.PlacedDLRM)
                else ())), state


def _num_params(model, params) -> int:
  """The model's parameters. A placed model's tables count their own rows once: not the banks'
  padding, the hot rows' copies or the exchange's error-feedback residuals (training state
  carried with the parameters), so that a placement does not change the count."""
  if isinstance(model, placed_dlrm.PlacedDLRM):
    return (sum(x.size for x in jax.tree.leaves(params["tower"]))
            + sum(model.plan.rows) * model.plan.width)
  return sum(x.size for x in jax.tree.leaves(params))


def _loop(run: _Run, state: TrainState, start: int, writer, stop: interrupt.StopRequest):
  """Steps ``start`` to the end, with logs, replica checks, evaluations and checkpoints on
  their schedules: ``(state, last logged training loss, examples per second)``.

  Raises:
    experiments.interrupt.Interrupted: ``stop`` asked, at a step boundary, after a checkpoint.
  """
  config, dp = run.config, run.dp
  mean_metrics = jax.jit(lambda m: jax.tree.map(jnp.mean, m),
                         out_shardings=NamedSharding(run.workers.mesh, P()))
  # Closed however the loop ends, so that an error's line, printed after, is the last one and
  # not run into the bar's.
  with tqdm.tqdm(total=run.steps, initial=start, disable=not run.is_main, unit="step",
                 desc=os.path.basename(os.path.normpath(run.workdir)),
                 dynamic_ncols=True) as progress:
    train_loss, examples_per_sec, last = float("nan"), 0.0, (time.time(), start)
    batches = _prefetch(lambda s: _to_global(_checked(run, _train_batch(run.dataset, config, s)),
                                             run.workers), range(start, run.steps))
    on_cpu = run.workers.mesh.devices.flat[0].platform == "cpu"
    stalls, compiled, where = watchdog.Watchdog(), set(), _whose_step(run)
    for step in range(start, run.steps + 1):  # every step boundary, where a signal stops the run
      if stop.should_stop():
        _stop(run, state, step, start, writer, stop)
      if step == run.steps:
        break
      kind = dp.kind_at(step)
      with stalls.watching(f"the training batch of step {step} {where}",
                           config.stall_timeout_seconds, "config.stall_timeout_seconds",
                           _STALLED_BATCH_HINT):
        batch = next(batches)
      if kind not in compiled:  # before the step's clock starts; the step reuses the program
        dp.train_step.lower(state, batch, kind=kind).compile()
        compiled.add(kind)
      # Until the step's outputs are read (its log, its replica check) an accelerator may still
      # be running it.
      with stalls.watching(f"step {step} (kind {kind!r}) {where}", config.stall_timeout_seconds,
                           "config.stall_timeout_seconds", _STALLED_STEP_HINT):
        state, metrics = dp.train_step(state, batch, kind=kind)
        if on_cpu:
          # One program in flight at a time: simulated CPU devices share one thread pool, and runs
          # with several steps in flight occasionally hung in a collective
          # (experiments.distributed).
          jax.block_until_ready(state.step)
        done = step + 1
        if run.check_step is not None:
          run.check_step(state.model_state, done)
        progress.update(1)
        if (config.log_every and done % config.log_every == 0) or done == run.steps:
          now = time.time()
          examples_per_sec = config.batch_size * (done - last[1]) / (now - last[0])
          last = (now, done)
          train_loss = _log(run, writer, done, jax.device_get(mean_metrics(metrics)),
                            examples_per_sec)
          progress.set_postfix(loss=f"{train_loss:.4f}")
        if _replica_check_due(config, dp, done):
          _check_replicas(dp, state, done)
      stop.step_completed()
      if config.eval_every and done % config.eval_every == 0 and done != run.steps:
        writer.write(done, _evaluate(run.evaluate, state, run.dataset, run.workers, dp,
                                     run.score))
      if config.checkpoint_every and done % config.checkpoint_every == 0:
        run.checkpointer.save(done, state)
  return state, train_loss, examples_per_sec


# What the watchdog's line says of a training step, and of its batch, that has not completed.
_STALLED_STEP_HINT = (
    "its collectives wait for every device and every process, and one that never arrives (a "
    "device without a thread, a process stopped or hung) leaves them waiting forever; the last "
    "checkpoint is kept and a restart resumes from it (a step that is only slow needs a larger "
    "value)")
_STALLED_BATCH_HINT = (
    "a thread reads it ahead and is still reading its files (one that never ends, or storage "
    "that stopped answering); the last checkpoint is kept and a restart resumes from it")


def _whose_step(run: _Run) -> str:
  """The run's training steps, for the watchdog's line: its workdir and workers, and in a
  multi-process run this process and the others its collectives wait for, at the coordinator's
  address."""
  where = f"of {run.workdir} on {run.workers.count} workers"
  if jax.process_count() == 1:
    return where
  others = ", ".join(str(p) for p in range(jax.process_count()) if p != jax.process_index())
  return (f"{where}, in process {jax.process_index()} of {jax.process_count()}, waiting for "
          f"processes {others} (coordinator {distributed.process_settings(run.config)[0]})")


def _log(run: _Run, writer, done: int, metrics, examples_per_sec: float) -> float:
  """Writes the metrics of step ``done - 1`` (means over the workers) and the bytes of the steps
  run so far; returns the training loss."""
  train_loss = float(metrics["loss"])
  writer.write(done, {"loss": train_loss, "accuracy": float(metrics["aux"]),
                      "learning_rate": float(jnp.asarray(run.learning_rate(done - 1),
                                                         jnp.float32)),
                      "skipped_steps": int(metrics.get("skipped_steps", 0)),
                      "examples_per_sec": examples_per_sec,
                      **_bytes_so_far(run.communication, run.dp, done)})
  return train_loss


def _stop(run: _Run, state: TrainState, step: int, start: int, writer, stop) -> None:
  """Checkpoints step ``step`` (unless nothing ran since the last checkpoint) and raises
  :class:`experiments.interrupt.Interrupted`."""
  if step > start:  # else the latest checkpoint (none at step 0) already holds this position
    if (run.config.check_replicas_every and not run.dp.per_worker_params
        and step % run.config.check_replicas_every):
      _check_replicas(run.dp, state, step)
    run.checkpointer.save(step, state)
  run.checkpointer.close()
  writer.close()
  raise interrupt.Interrupted(step, stop.stopping_signal(), run.workdir)
