"""One training run: ``train_and_evaluate(config, workdir)``.

Data parallelism over a 1-D ``Mesh`` named ``"data"`` that spans every device of every process.
The training step is a ``jax.shard_map`` over that mesh: each device computes the gradient of its
own batch, and the configured optax chain (:mod:`experiments.methods`) does all the communication:
its first transformation compresses, exchanges and averages the gradients, identically on every
device, and the optimizer that follows applies the same update everywhere. No gradient is summed
outside the chain.

What lives where (``TrainState``):

* ``step``, ``params``: replicated (``P()``), bit-identical on every device.
* ``opt_state``: the leaves that differ from device to device (error-feedback residuals and other
  compressor memories) carry a leading device axis (``P("data")``); the rest (counters, the
  moments of the optimizer after the exchange) is replicated (``compressors.state_specs``).
* ``model_state``: batch-norm statistics, per device (each device normalises with its own
  batch); averaged over devices when evaluating, which equals averaging them every step because
  the running average is linear. The training step therefore moves nothing but gradients.

Per-step inputs: a method whose update takes inputs on some steps declares them in the registry
(``compressors.registry.StepInputs``: every how many steps, and how to make them from the
worker's loss, parameters and batch; TASC's is a Hutchinson estimate of the Hessian diagonal).
On those steps the step makes them and passes them to the chain's update as keyword arguments;
such steps are a second compiled variant of the step. The trainer names no method.

Bytes on the wire are read from the compiled steps with ``compressors.wire_bytes``; the dense
baseline is the same step with ``method="dense"``, compiled but never run. With per-step inputs
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
* Crashes: the state is the whole position of the run (the data position is the step), and
  checkpoints are written atomically, so a killed run restarted with the same workdir ends bit
  for bit as an uninterrupted one. A workdir whose checkpoints another config wrote is refused
  (:func:`experiments.validation.check_resume`).
"""

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
from experiments import logs
from experiments import methods
from experiments import models
from experiments import tasks
from experiments import validation

AXIS = methods.AXIS_NAME
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


def _stack(tree: PyTree) -> PyTree:
  """Per-device values -> a leading device axis of size one (to leave ``shard_map`` as
  ``P("data")``)."""
  return jax.tree.map(lambda x: x[None], tree)


def _unstack(tree: PyTree) -> PyTree:
  """Inverse of :func:`_stack` (inside ``shard_map``)."""
  return jax.tree.map(lambda x: x[0], tree)


def make_mesh(num_devices: int | None) -> Mesh:
  """A 1-D mesh named ``"data"`` over the first ``num_devices`` devices (None: all of them)."""
  devices = jax.devices()
  count = len(devices) if num_devices is None else num_devices
  if count > len(devices):
    raise ValueError(f"config.num_devices={count} but only {len(devices)} devices exist; on CPU "
                     "run through experiments.run (which exposes them) or lower num_devices")
  if jax.process_count() > 1 and count != len(devices):
    raise ValueError(f"config.num_devices={count} must equal the {len(devices)} devices of all "
                     "processes in a multi-process run")
  return Mesh(np.asarray(devices[:count]), (AXIS,))


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


def _variables_initializer(model, task, example_batch, num_devices):
  """``seed -> (params, model_state)``, the model state with a leading device axis."""
  inputs = task.inputs(example_batch)

  def init_variables(seed):
    key = jax.random.PRNGKey(seed)
    variables = dict(model.init({"params": key, "dropout": key}, *inputs, train=False))
    params = variables.pop("params")
    return params, jax.tree.map(lambda x: jnp.broadcast_to(x, (num_devices,) + x.shape),
                                variables)
  return init_variables


class _Program(NamedTuple):
  """The jitted functions of one run (compiled on first use)."""
  specs: TrainState
  init_opt_state: Any
  train_steps: dict[bool, Any]  # with the method's per-step inputs -> step
  evaluate: Any
  replicas_agree: Any  # params -> bool, the same on every device


def _build_program(model, task, tx, learning_rate, mesh, config, example,
                   step_inputs) -> _Program:
  """Jitted ``shard_map`` functions for optimizer-state init, the training step(s) and eval.

  ``example`` is a :class:`TrainState` and a global batch, abstract (their shapes and dtypes).
  """
  dropout_key, inputs_key = jax.random.split(jax.random.PRNGKey(config.seed))

  def loss_of(model_state, rng):
    """One device's loss on its batch, its accuracy and new batch statistics as aux."""
    def loss_fn(params, local_batch):
      outcomes, new_model_state = _forward(model, task, {"params": params, **model_state},
                                           local_batch, train=True, rng=rng)
      loss, accuracy = tasks.mean_loss(outcomes)
      return loss, (accuracy, new_model_state)
    return loss_fn

  def make_inputs(state, batch, model_state, step):
    """The method's per-step inputs (``make`` with this device's loss and batch)."""
    loss_fn = loss_of(model_state, jax.random.fold_in(dropout_key, step))
    return step_inputs.make(lambda p, b: loss_fn(p, b)[0],
                            lax.pcast(state.params, AXIS, to="varying"), batch,
                            jax.random.fold_in(inputs_key, step), AXIS)

  example_state, example_batch = example
  extra_shapes = {}
  if step_inputs is not None:  # state_specs must see what the inputs make per-worker
    stacked = jax.eval_shape(jax.shard_map(
        lambda state, batch: _stack(make_inputs(state, _unstack(batch),
                                                _unstack(state.model_state), state.step)),
        mesh=mesh, in_specs=(P(), P(AXIS)), out_specs=P(AXIS), check_vma=False),
        example_state._replace(opt_state=()), example_batch)
    extra_shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), stacked)
  specs = TrainState(step=P(), params=P(), model_state=P(AXIS),
                     opt_state=compressors.state_specs(tx, example_state.params, mesh, AXIS,
                                                       **extra_shapes))

  def per_device_step(state, batch, with_inputs):
    batch, model_state = _unstack(batch), _unstack(state.model_state)
    old_model_state = model_state
    rng = jax.random.fold_in(jax.random.fold_in(dropout_key, state.step), lax.axis_index(AXIS))
    loss_fn = loss_of(model_state, rng)

    # Differentiate with respect to a device-varying copy of the replicated parameters: the
    # gradient of an unvarying input would be summed over devices by shard_map's autodiff, a
    # dense all-reduce before the chain could compress anything.
    local_params = lax.pcast(state.params, AXIS, to="varying")
    (loss, (accuracy, model_state)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        local_params, batch)
    extra_args = make_inputs(state, batch, model_state, state.step) if with_inputs else {}
    updates, opt_state = tx.update(
        grads, compressors.drop_device_axis(state.opt_state, specs.opt_state), state.params,
        **extra_args)
    params = optax.apply_updates(state.params, updates)
    metrics = {"loss": loss, "accuracy": accuracy,
               "learning_rate": jnp.asarray(learning_rate(state.step), jnp.float32)}
    if config.skip_nonfinite:
      # A skipped step keeps the batch statistics too: a non-finite batch would otherwise poison
      # this device's normalisation for every later step.
      model_state = jax.tree.map(lambda old, new: jnp.where(opt_state.last_skipped, old, new),
                                 old_model_state, model_state)
      metrics["skipped_steps"] = opt_state.skipped
    new_state = TrainState(state.step + 1, params, _stack(model_state),
                           compressors.add_device_axis(opt_state, specs.opt_state))
    return new_state, _stack(metrics)

  def train_step(with_inputs):
    return jax.jit(jax.shard_map(
        functools.partial(per_device_step, with_inputs=with_inputs), mesh=mesh,
        in_specs=(specs, P(AXIS)), out_specs=(specs, P(AXIS))), donate_argnums=0)

  def per_device_eval(params, model_state, batch):
    batch = _unstack(batch)
    model_state = jax.tree.map(lambda x: lax.pmean(x, AXIS), _unstack(model_state))
    outcomes, _ = _forward(model, task, {"params": params, **model_state}, batch, train=False,
                           rng=None)
    mask = batch["mask"].reshape(batch["mask"].shape + (1,) * (outcomes.weight.ndim - 1))
    weight = outcomes.weight * mask
    sums = jnp.stack([(outcomes.loss * weight).sum(), (outcomes.correct * weight).sum(),
                      weight.sum()])
    return lax.psum(sums, AXIS)

  init_opt_state = jax.jit(jax.shard_map(
      lambda p: compressors.add_device_axis(tx.init(p), specs.opt_state), mesh=mesh,
      in_specs=P(), out_specs=specs.opt_state))
  evaluate = jax.jit(jax.shard_map(
      per_device_eval, mesh=mesh, in_specs=(P(), P(AXIS), P(AXIS)), out_specs=P()))
  replicas_agree = jax.jit(jax.shard_map(
      lambda params: compressors.replicas_agree(params, AXIS), mesh=mesh, in_specs=P(),
      out_specs=P()))
  every = step_inputs.every if step_inputs else 0
  variants = {0: (False,), 1: (True,)}.get(every, (False, True))
  return _Program(specs, init_opt_state, {v: train_step(v) for v in variants},
                  evaluate, replicas_agree)


def _init_state(init_variables, program, mesh, seed) -> TrainState:
  replicated = NamedSharding(mesh, P())
  # Initialisation runs once: compile it without LLVM's expensive passes (threefry random bits
  # otherwise take tens of seconds to compile on CPU for a ResNet).
  init = jax.jit(init_variables, out_shardings=(replicated, NamedSharding(mesh, P(AXIS)))).lower(
      seed).compile(compiler_options=_FAST_COMPILE)
  params, model_state = init(seed)
  step = jax.device_put(jnp.zeros((), jnp.int32), replicated)
  return TrainState(step, params, model_state, program.init_opt_state(params))


def _local_devices(mesh: Mesh) -> list[jax.Device]:
  """This process's devices in mesh order; their mesh positions are their data shards."""
  return [d for d in mesh.devices.flat if d.process_index == jax.process_index()]


def _to_global(local: dict[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
  """Host rows ``[local_devices, batch, ...]`` -> global arrays ``[devices, batch, ...]``."""
  sharding = NamedSharding(mesh, P(AXIS))
  devices = _local_devices(mesh)

  def put(x):
    shards = [jax.device_put(x[i:i + 1], d) for i, d in enumerate(devices)]
    return jax.make_array_from_single_device_arrays((mesh.size,) + x.shape[1:], sharding, shards)
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


def _abstract(tree: PyTree, mesh: Mesh | None = None, specs: PyTree = None) -> PyTree:
  """Shape, dtype and sharding of ``tree``'s arrays (shardings from ``specs`` if given)."""
  if specs is None:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                        tree)
  return jax.tree.map(lambda x, spec: jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=NamedSharding(mesh, spec)), tree, specs)


_dense_bytes_cache: dict[str, float] = {}


def _dense_bytes(config, model, task, mesh, learning_rate, state, batch) -> float:
  """Bytes per device of the same step with ``method="dense"`` (compiled, never run; remembered
  per process for runs that differ only in the method, as a sweep's do)."""
  key = json.dumps([mesh.size, {k: v for k, v in config.to_dict().items()
                                if k not in ("method", "compression")}], sort_keys=True,
                    default=str)
  if key not in _dense_bytes_cache:
    dense_config = ml_collections.ConfigDict(config.to_dict())
    dense_config.method = "dense"
    # Momentum correction needs error feedback, which dense lacks.
    dense_config.compression.momentum_correction = 0.0
    dense_config.compression.clip_norm = None
    dense_tx = methods.training_chain(dense_config, learning_rate)
    params = _abstract(state.params)
    program = _build_program(model, task, dense_tx, learning_rate, mesh, dense_config,
                             (_abstract(state), _abstract(batch)), step_inputs=None)
    opt_state = jax.eval_shape(program.init_opt_state, params)
    abstract_state = TrainState(_abstract(state.step), params, _abstract(state.model_state),
                                _abstract(opt_state, mesh, program.specs.opt_state))
    _dense_bytes_cache[key] = compressors.wire_bytes(program.train_steps[False], abstract_state,
                                                     _abstract(batch)).total
  return _dense_bytes_cache[key]


def _guard_bytes(config, program, mesh, params) -> tuple[float, float]:
  """Bytes per device per step of the reliability checks: ``(in_step, replica_check)``.

  ``in_step``: the all-reduce of ``compressors.skip_nonfinite``'s flag, part of every training
  step (compiled alone: it does not depend on the gradient). ``replica_check``: the replica
  check's, spread over ``config.check_replicas_every`` steps.
  """
  in_step = replica_check = 0.0
  if config.skip_nonfinite:
    guard = compressors.skip_nonfinite(optax.identity(), axis_name=AXIS)
    flag_only = jax.shard_map(lambda g: guard.update(g[0], guard.init(g[0]))[1].skipped[None],
                              mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS))
    in_step = compressors.wire_bytes(flag_only,
                                     jax.ShapeDtypeStruct((mesh.size,), jnp.float32)).total
  if config.check_replicas_every:
    replica_check = (compressors.wire_bytes(program.replicas_agree, params).total
                     / config.check_replicas_every)
  return in_step, replica_check


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


def _evaluate(program, state, dataset, mesh) -> dict[str, float]:
  sums = np.zeros(3)
  for batch in dataset.eval_batches():
    sums += np.asarray(jax.device_get(program.evaluate(state.params, state.model_state,
                                                       _to_global(batch, mesh))))
  return dataset.derive({"test_loss": float(sums[0] / sums[2]),
                         "test_accuracy": float(sums[1] / sums[2])})


def _skipped_steps(state: TrainState) -> int:
  """Steps skipped so far for a non-finite gradient (0 without ``config.skip_nonfinite``)."""
  if not isinstance(state.opt_state, compressors.SkipNonFiniteState):
    return 0
  return int(jax.device_get(state.opt_state.skipped))


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
    The final metrics: ``step``, ``test_loss``, ``test_accuracy`` (and what the dataset derives
    from them, e.g. ``test_bits_per_byte``), ``train_loss``, ``wire_bytes`` and ``dense_bytes``
    (per device per step, gradient exchange), ``compression_ratio``, ``guard_bytes`` (per device
    per step, reliability checks), ``skipped_steps`` (non-finite steps skipped),
    ``examples_per_sec``, ``num_params``, ``wall_seconds``, and the dataset's ``info`` (corpus
    and tokenizer hashes).

  Raises:
    ValueError, TypeError, FileNotFoundError: bad config values, unknown names, missing or
      unreadable data, or a workdir holding another config's checkpoints, before anything is
      compiled.
    ReplicaDriftError: the devices' parameters stopped being bit-identical.
  """
  return train(config, workdir)[0]


def train(config: ml_collections.ConfigDict, workdir: str) -> tuple[dict[str, Any], TrainState]:
  """:func:`train_and_evaluate`, also returning the final :class:`TrainState`."""
  started = time.time()
  distributed.initialize(config)
  mesh = make_mesh(config.num_devices)
  validation.check_config(config, mesh.size)
  validation.check_workdir(workdir)
  is_main = jax.process_index() == 0

  positions = {d: i for i, d in enumerate(mesh.devices.flat)}
  shards = data.ShardSpec(mesh.size, tuple(positions[d] for d in _local_devices(mesh)))
  dataset = data.load(config, shards)
  model = models.build_model(config.model, **dataset.model_fields)
  task = tasks.TASKS[dataset.task]
  steps = total_steps(config, dataset.steps_per_epoch)
  learning_rate = methods.learning_rate_schedule(config, dataset.steps_per_epoch, steps)
  tx = methods.training_chain(config, learning_rate)
  step_inputs = methods.step_inputs(config)
  first_batch = _train_batch(dataset, config, 0)
  checkpointer = checkpoint.Checkpointer(workdir, keep=config.keep_checkpoints)
  restored = checkpointer.latest_step()
  validation.check_resume(config, workdir, restored)
  if is_main:
    os.makedirs(workdir, exist_ok=True)
    logs.write_json(os.path.join(workdir, validation.CONFIG_FILE), config.to_dict())

  init_variables = _variables_initializer(model, task, {k: v[0] for k, v in first_batch.items()},
                                          mesh.size)
  params_shape, model_state_shape = jax.eval_shape(init_variables, config.seed)
  example = (TrainState(jax.ShapeDtypeStruct((), jnp.int32), params_shape, model_state_shape, ()),
             jax.tree.map(lambda x: jax.ShapeDtypeStruct((mesh.size,) + x.shape[1:], x.dtype),
                          first_batch))
  program = _build_program(model, task, tx, learning_rate, mesh, config, example, step_inputs)
  state = _init_state(init_variables, program, mesh, config.seed)
  num_params = sum(x.size for x in jax.tree.leaves(state.params))
  if restored is not None:
    logging.warning("%s: resuming from the checkpoint of step %d", workdir, restored)
    state = checkpointer.restore(restored, state)
  start = int(jax.device_get(state.step))

  global_batch = _to_global(first_batch, mesh)
  step_bytes = {r: compressors.wire_bytes(fn, state, global_batch).total
                for r, fn in program.train_steps.items()}
  every = step_inputs.every if step_inputs else 1
  wire = (step_bytes.get(False, 0.0) * (every - 1)
          + step_bytes.get(True, step_bytes.get(False))) / every
  dense = (step_bytes[False] if config.method == "dense" else
           _dense_bytes(config, model, task, mesh, learning_rate, state, global_batch))
  in_step_guard, replica_check = _guard_bytes(config, program, mesh, state.params)
  wire, dense = wire - in_step_guard, dense - in_step_guard
  communication = {"wire_bytes": wire, "dense_bytes": dense,
                   "compression_ratio": dense / wire if wire else float("inf"),
                   "guard_bytes": in_step_guard + replica_check}

  writer = logs.MetricsWriter(workdir, active=is_main, resume_step=start)
  mean_metrics = jax.jit(lambda m: jax.tree.map(jnp.mean, m),
                         out_shardings=NamedSharding(mesh, P()))
  progress = tqdm.tqdm(total=steps, initial=start, disable=not is_main, unit="step",
                       desc=os.path.basename(os.path.normpath(workdir)), dynamic_ncols=True)
  train_loss, examples_per_sec = float("nan"), 0.0
  last_time, last_step = time.time(), start
  batches = _prefetch(lambda s: _to_global(_train_batch(dataset, config, s), mesh),
                      range(start, steps))
  on_cpu = mesh.devices.flat[0].platform == "cpu"
  for step in range(start, steps):
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
      writer.write(done, _evaluate(program, state, dataset, mesh))
    if config.checkpoint_every and done % config.checkpoint_every == 0:
      checkpointer.save(done, state)
  progress.close()
  if config.check_replicas_every and steps % config.check_replicas_every:
    _check_replicas(program, state.params, steps)  # before the final checkpoint

  final_eval = _evaluate(program, state, dataset, mesh)
  writer.write(steps, final_eval)
  checkpointer.save(steps, state)
  checkpointer.close()
  writer.close()
  results = {"step": steps, "train_loss": train_loss, "examples_per_sec": examples_per_sec,
             "skipped_steps": _skipped_steps(state), "num_params": num_params,
             "wall_seconds": time.time() - started,
             **final_eval, **communication, **dataset.info}
  if is_main:
    logs.write_json(os.path.join(workdir, RESULTS_FILE), results)
  return results, state
