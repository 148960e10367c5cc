"""The checks every gradient-exchange method must pass, by name in the method registry.

``tests/test_methods_common.py`` runs them on every method of :mod:`compressors.registry`, so a
method added to the registry is checked without a line of test code; a method registered
elsewhere (a plugin, a test) can call :func:`run_all` itself. Each check builds the method as the
runner does (:func:`compressors.registry.transformation` for a per-step exchange,
:func:`compressors.registry.training` with its step kinds for a method that is its own optimizer
or updates locally), with its default settings unless given others (a local-update method
synchronising every 4 steps, 1-bit Adam freezing after 5, so that 20 steps run every kind), on 8
workers and a two-leaf model (a 200 x 200 matrix and a 200-vector: 40,200 entries, enough for
every default density and TASC's 256-element blocks):

* nothing is lost, with the exchange before the optimizer and after each worker's own Adam
  (``exchanged="update"``): each step, the mean over workers of ``g + e`` equals the mean the method
  returned plus the mean of the residuals it kept (and, for the two-phase exchange, what the
  chunks' owners kept), to the rounding of the sums: float32's, or that of the narrower type a
  payload is all-reduced in (fp16's all-reduce rounds its partial sums in float16); with the
  method's own momentum correction, its velocity is the input;
* replicas stay bit-identical over 20 training steps (:func:`compressors.data_parallel`; a
  local-update method's after its synchronisations, and not between them; one that
  synchronises a fragment at a time, Streaming DiLoCo, never all at once: its synchronised
  parameters, the model, bit-identical on every device), and each step kind compiles once;
* ``pmap`` gives the bits ``shard_map`` gives;
* fused and per-leaf buffers give the same bits on a one-leaf model, where they hold the same
  buffer (methods that force a layout are skipped);
* the bytes on the wire, read from the compiled program, are within 5% of the method's
  cost-model entry (a local-update method's round of ``H`` steps, its exchange's of the whole
  model: DiLoCo's one synchronisation, Streaming DiLoCo's fragments' each once; its local steps
  move nothing but the non-finite guard's flag);
* 8 workers as 8 devices, as 2 devices x 4 simulated workers and as 1 device x 8 simulated
  workers (:mod:`compressors.parallel.workers`) send the same bytes per step and train to the same
  parameters, to the rounding of sums taken in another order.

A local-update method's exchange is a per-step method checked on its own (nothing lost, fused =
per leaf): those checks run on its exchange. A method that is its own optimizer (DeMo, 1-bit
Adam) keeps its memory in its own form; its test module checks that nothing is lost against a
numpy reference of its paper's algorithm (tests/test_demo.py, tests/test_onebit_adam.py), and
the fused layout does not apply to it.
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import compressors
from compressors import registry
from tests import harness

N = 8
_loss = harness.regression_loss  # one worker's loss: a linear regression
PARAMS = {"w": jnp.zeros((200, 200)), "b": jnp.zeros((200,))}
COST_TOLERANCE = 0.05


# Settings with which 20 steps run every step kind of a method whose defaults would not.
SHORT_SETTINGS = {"diloco": dict(every=4), "sparseloco": dict(every=4),
                  # The two-leaf model holds two fragments; each lands a step after it syncs.
                  "streaming_diloco": dict(every=4, fragments=2),
                  "onebit_adam": dict(freeze_step=5)}
OWN_BOOKKEEPING = {"demo": "tests/test_demo.py", "onebit_adam": "tests/test_onebit_adam.py"}
# 1-bit Adam divides a sum over workers by sqrt(v), which amplifies the sum's last-bit
# differences where the gradient is near zero, and its compressed steps sign them: summed in
# another order (simulated workers), an entry can take the other sign. Its parameters are
# compared after its dense warm-up, to a thousandth of a step of the learning rate each step
# (a worker's rows mixed up moves them by whole steps), and its bytes in every kind.
PARAMS_COMPARED_AFTER = {"onebit_adam": 5}
LEARNING_RATE = 0.01


def transformation(name: str, settings=None, **common):
  """The method's per-worker transformation over ``"data"``, as the runner builds it."""
  return registry.transformation(name, settings, axis_name="data",
                                 common=registry.Common(**common))


def _settings(name: str, settings=None):
  """``settings``, or the method's defaults with :data:`SHORT_SETTINGS`."""
  if settings is not None:
    return settings
  return registry.default_settings(name, **SHORT_SETTINGS.get(name, {}))


def _family(name: str) -> str:
  return registry.get(name).family


def training_step(name: str, settings, mesh, *, axis="data", per_device: int = 1,
                  shard_axis=None):
  """``compressors.data_parallel`` of the method with plain SGD (an exchange's optimizer, a
  local-update method's inner one) on the regression of :func:`_regression_batch`, with the
  method's step kinds."""
  settings = _settings(name, settings)
  if _family(name) == "per_step":
    tx = optax.chain(registry.transformation(name, settings, axis_name=axis,
                                             common=registry.Common()), optax.sgd(LEARNING_RATE))
  else:
    tx = registry.training(name, settings, optimizer=optax.sgd(LEARNING_RATE),
                           learning_rate=LEARNING_RATE, axis_name=axis)
  return compressors.data_parallel(
      _loss, tx, mesh, PARAMS, _regression_batch(), axis_name=axis,
      workers_per_device=per_device, kinds=registry.step_kinds(name, settings),
      per_worker_params=_family(name) == "local", shard_axis=shard_axis)


def _compress_state(state) -> compressors.CompressState:
  """The error-feedback bookkeeping inside a method's state."""
  found = [s for s in jax.tree.leaves(state, is_leaf=lambda x: isinstance(
      x, compressors.CompressState)) if isinstance(s, compressors.CompressState)]
  assert len(found) == 1, f"expected one CompressState in the state, found {len(found)}"
  return found[0]


def _owners_memory(cs: compressors.CompressState, size: int) -> np.ndarray:
  """What the owners of the two-phase exchange's chunks keep, in the fused layout (0 without)."""
  buffers = ((cs.buffers,) if isinstance(cs.buffers, compressors.protocol.BufferState)
             else cs.buffers)
  parts = [np.asarray(b.owner_residual).reshape(-1) for b in buffers
           if b.owner_residual is not None]
  if not parts:
    return np.zeros(size, np.float32)
  assert len(parts) == 1, "two-phase owners' memory is checked for one fused buffer"
  return parts[0][:size]


def _reduction_epsilon(sent: compressors.WireBytes) -> float:
  """The machine epsilon of the narrowest float type a compiled program all-reduces in: a
  payload summed in float16 rounds its partial sums, and that rounding is the collective's, not
  a worker's, so no residual can keep it."""
  collectives = sent.collectives
  return max([float(jnp.finfo(_FLOAT_TYPES[d]).eps) for c in collectives
              if c.kind == "all-reduce" for d in c.dtypes if d in _FLOAT_TYPES]
             + [float(jnp.finfo(jnp.float32).eps)])


_FLOAT_TYPES = {"f16": "float16", "bf16": "bfloat16", "f32": "float32", "f64": "float64"}


def check_nothing_lost(name: str, settings=None, steps: int = 3) -> None:
  """Each step: mean_i(input_i + e_i) == returned mean + mean_i(e'_i) + owners' change, to the
  rounding of the sums (float32's, or the narrower type a payload is all-reduced in); of a
  local-update method, its exchange's. A compressor whose mean is over each entry's senders
  (``average="senders"``, SparseLoCo's) returns ``sum_i sent_i / senders``: the check scales it
  back by ``senders / n``, the senders counted from what each worker's residual gave up."""
  if _family(name) == "local":
    return check_nothing_lost(_settings(name, settings).carrier, None, steps)
  if _family(name) == "optimizer":
    assert name in OWN_BOOKKEEPING, f"{name}: no test of its own bookkeeping is named"
    return None
  return _check_bookkeeping(name, settings, steps, after_optimizer=False)


def check_nothing_lost_after_the_optimizer(name: str, settings=None, steps: int = 3) -> None:
  """The same with the exchange after each worker's own Adam (``optax.chain(adam, exchange)``,
  the runner's ``exchanged="update"``): the input is that worker's Adam update, computed here by
  ``optax.adam`` on its gradients alone (its moments per worker); a method that is its own
  optimizer or updates locally refuses the placement."""
  if _family(name) != "per_step":
    with pytest.raises(ValueError, match="exchanged='update'"):
      registry.training(name, _settings(name, settings), optimizer=optax.sgd(LEARNING_RATE),
                        learning_rate=LEARNING_RATE, axis_name="data",
                        common=registry.Common(exchanged="update"))
    return None
  return _check_bookkeeping(name, settings, steps, after_optimizer=True)


def _check_bookkeeping(name: str, settings, steps: int, after_optimizer: bool) -> None:
  """:func:`check_nothing_lost`, the exchange before the optimizer or after Adam."""
  method = registry.get(name)
  settings = method.settings() if settings is None else settings
  momentum = 0.0
  if method.momentum is not None:
    momentum, clip_norm = method.momentum(settings)
    assert clip_norm is None, "the check feeds the velocity unclipped"
  tx = transformation(name, settings, error_feedback=True)
  over_senders = (method.compressor is not None
                  and method.compressor(settings).average == "senders")
  adam = optax.adam(LEARNING_RATE)
  if after_optimizer:
    tx = optax.chain(adam, tx)
  adam_states = [adam.init(PARAMS)] * N
  exchange_state = (lambda state: state[1]) if after_optimizer else (lambda state: state)
  state, update = harness.shard_map_update(tx, harness.mesh(), PARAMS)
  size = sum(x.size for x in jax.tree.leaves(PARAMS))
  epsilon = _reduction_epsilon(compressors.wire_bytes(
      update, PARAMS, state, harness.per_worker_grads(jax.random.PRNGKey(0), N, PARAMS)))
  for t in range(steps):
    grads = harness.per_worker_grads(jax.random.PRNGKey(t), N, PARAMS)
    sent = grads
    if after_optimizer:  # each worker's own Adam update, from its own moments
      own = [adam.update(jax.tree.map(lambda g, i=i: g[i], grads), adam_states[i])
             for i in range(N)]
      adam_states = [s for _, s in own]
      sent = jax.tree.map(lambda *u: jnp.stack(u), *[u for u, _ in own])
    before = _compress_state(exchange_state(state))
    velocity = harness.fused(exchange_state(state).velocity, N) if momentum else 0.0
    inputs = momentum * velocity + harness.fused(sent, N) + harness.fused(before.residual, N)
    mean, state = update(PARAMS, state, grads)
    after = _compress_state(exchange_state(state))
    kept = (harness.fused(after.residual, N).mean(0) + _owners_memory(after, size)
            - _owners_memory(before, size))
    returned = harness.fused(mean, 1)[0]
    if over_senders:
      gave_up = np.abs(inputs - harness.fused(after.residual, N))
      senders = (gave_up > 1e-4 * np.abs(inputs).max()).sum(0)
      assert (senders > 1).any(), f"{name}: no entry with two senders: the check cannot tell"
      returned = returned * senders / N
    # A sum of N terms rounds N - 1 times, each by at most epsilon of the largest partial sum;
    # the check's own float32 sum of what was returned and kept rounds at their scale.
    tolerance = ((N - 1) * epsilon * np.abs(inputs).sum(0).max()
                 + 2 * float(jnp.finfo(jnp.float32).eps) * np.abs(returned).max())
    if after_optimizer:  # Adam's update computed here and in the step rounds a few ulps apart
      tolerance += 4 * float(jnp.finfo(jnp.float32).eps) * np.abs(harness.fused(sent, N)).max()
    np.testing.assert_allclose(inputs.mean(0), returned + kept, rtol=0,
                               atol=tolerance, err_msg=f"{name}: step {t} lost something")


def check_replicas_identical_and_one_compile(name: str, settings=None, steps: int = 20) -> None:
  """20 steps of the method (:func:`training_step`, each step of the kind due): bit-identical
  parameters everywhere after every step that synchronises (with local updates, different
  ones between synchronisations), each kind compiled once."""
  dp = training_step(name, settings, harness.mesh())
  batch = _regression_batch()
  params, state, _ = dp.step(dp.worker_params(PARAMS), dp.init(PARAMS), batch,
                             kind=dp.kind_at(0))
  compiled, ran = [], {dp.kind_at(0)}
  dp.replicas_agree(dp.landed(params, state))  # compiled before the count
  with _counting_compilations(compiled):
    for t in range(1, steps):
      params, state, metrics = dp.step(params, state, batch, kind=dp.kind_at(t))
      ran.add(dp.kind_at(t))
      synchronised = dp.synchronises(dp.kind_at(t))
      if dp.per_worker_params:
        assert bool(dp.replicas_agree(params)) == synchronised, f"{name}: step {t}"
        # What landed (all of the model, a fragment, or nothing) agrees on every worker.
        assert bool(dp.replicas_agree(dp.landed(params, state))), f"{name}: step {t}"
  if dp.per_worker_params and any(dp.synchronises(k) for k in dp.kinds):
    assert synchronised, f"{name}: the check must end on a synchronising step"
  elif dp.per_worker_params:  # synchronised a fragment at a time: the model agrees everywhere
    model = compressors.synchronised_params(state)
    assert model is not None, f"{name}: no synchronised parameters in the state"
    harness.assert_replicas_identical(model)
  else:
    harness.assert_replicas_identical(params)
  assert int(metrics["skipped_steps"]) == 0 and np.isfinite(float(metrics["loss"]))
  assert ran == set(dp.kinds), f"{name}: kinds {set(dp.kinds) - ran} never ran in {steps} steps"
  assert len(compiled) == len(ran) - 1, (f"{name}: {len(compiled)} compilations, "
                                         f"{len(ran) - 1} expected")


@contextlib.contextmanager
def _counting_compilations(events: list):
  """Appends to ``events`` one entry per XLA compilation while the block runs."""
  listener = lambda event, duration, **kwargs: events.append(event) if event == (
      "/jax/core/compile/backend_compile_duration") else None
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)


def check_pmap_equals_shard_map(name: str, settings=None, steps: int = 2) -> None:
  """The same updates under ``pmap`` and ``shard_map`` give the same bits (a method with step
  kinds of its own: the same training steps, each kind run)."""
  if _family(name) != "per_step":
    return _pmap_equals_shard_map_steps(name, settings)
  tx = transformation(name, settings)
  sm_state, sm_update = harness.shard_map_update(tx, harness.mesh(), PARAMS)
  pm_init, pm_update = harness.pmap_update(tx)
  replicated = jax.tree.map(lambda x: jnp.broadcast_to(x, (N,) + x.shape), PARAMS)
  pm_state = pm_init(replicated)
  for t in range(steps):
    grads = harness.per_worker_grads(jax.random.PRNGKey(t), N, PARAMS)
    sm_mean, sm_state = sm_update(PARAMS, sm_state, grads)
    pm_mean, pm_state = pm_update(replicated, pm_state, grads)
    for a, b in zip(jax.tree.leaves(sm_mean), jax.tree.leaves(pm_mean)):
      for copy in np.asarray(b):
        np.testing.assert_array_equal(copy, np.asarray(a), err_msg=f"{name}: step {t}")


def _pmap_equals_shard_map_steps(name: str, settings=None, steps: int = 8) -> None:
  """``steps`` training steps under ``pmap`` and ``shard_map``: the same bits."""
  batch = _regression_batch()
  results = []
  for mesh in (harness.mesh(), None):
    dp = training_step(name, settings, mesh)
    params, state = dp.worker_params(PARAMS), dp.init(PARAMS)
    for t in range(steps):
      params, state, _ = dp.step(params, state, batch, kind=dp.kind_at(t))
    results.append(jax.tree.map(np.asarray, params))
  for a, b in zip(*map(jax.tree.leaves, results)):
    np.testing.assert_array_equal(a, b, err_msg=f"{name}: pmap differs from shard_map")


def check_fused_equals_per_leaf(name: str, settings=None, steps: int = 2) -> None:
  """On a one-leaf model, fused and per-leaf buffers are the same buffer: the same bits (a
  local-update method: its exchange's)."""
  if _family(name) == "local":
    return check_fused_equals_per_leaf(_settings(name, settings).carrier, None, steps)
  if registry.get(name).fuse is not None or _family(name) == "optimizer":
    return None  # the method runs in one layout only
  one_leaf = {"w": PARAMS["w"].reshape(-1)}
  means = []
  for fuse in (True, False):
    state, update = harness.shard_map_update(transformation(name, settings, fuse=fuse),
                                             harness.mesh(), one_leaf)
    means.append([])
    for t in range(steps):
      mean, state = update(one_leaf, state,
                           harness.per_worker_grads(jax.random.PRNGKey(t), N, one_leaf))
      means[-1].append(np.asarray(mean["w"]))
  for t, (fused, per_leaf) in enumerate(zip(*means)):
    np.testing.assert_array_equal(fused, per_leaf, err_msg=f"{name}: step {t}")


def check_bytes_within_cost_model(name: str, settings=None) -> None:
  """Bytes one device sends, from the compiled update, within 5% of the cost-model entry (a
  method with step kinds of its own: its last kind's, less the non-finite guard's flag; a
  local-update method's: a round of ``H`` steps', its local steps the flag alone)."""
  topology = compressors.Topology.flat(N, compressors.Link(alpha=1e-6, bandwidth=1e9))
  settings = _settings(name, settings) if _family(name) != "per_step" else settings
  modelled = registry.cost(name, [x.shape for x in jax.tree.leaves(PARAMS)], topology,
                           settings).bytes_sent
  if _family(name) == "per_step":
    measured = harness.update_bytes(transformation(name, settings), PARAMS,
                                    harness.mesh()).total
  else:
    dp = training_step(name, settings, harness.mesh())
    state = jax.eval_shape(dp.init, PARAMS)
    by_kind = {k: dp.wire_bytes(dp.worker_params(PARAMS), state, _regression_batch(),
                                kind=k).total - dp.nonfinite_flag_bytes() for k in dp.kinds}
    if dp.per_worker_params:
      assert by_kind.pop("local") == 0, f"{name}: a local step moves more than the guard's flag"
      # One round of H steps once every kind has started: DiLoCo's synchronisation, or each
      # fragment's of Streaming DiLoCo (the whole model's bytes, spread over the round).
      every = registry.steps_per_exchange(name, settings)
      counts = dp.kind_counts(4 * every, 5 * every)
      measured = sum(n * by_kind[k] for k, n in counts.items() if k in by_kind)
    else:
      measured = by_kind[list(dp.kinds)[-1]]
  assert abs(measured - modelled) <= COST_TOLERANCE * modelled, (
      f"{name}: {measured:,.0f} bytes on the wire, the cost model says {modelled:,.0f}")


def _regression_batch():
  key_x, key_w = jax.random.split(jax.random.PRNGKey(0))
  x = jax.random.normal(key_x, (N * 16, 200))
  return x, x @ jax.random.normal(key_w, (200, 200)) / 10


# Devices x workers per device of :func:`check_simulated_workers_match_devices`: 2 x 4 has both
# the device axis and the simulated one; all 8 on one device is the slow suite's
# (``tests/test_methods_common.py``).
LAYOUTS = ((2, N // 2),)
ALL_LAYOUTS = ((2, N // 2), (1, N))


def check_simulated_workers_match_devices(name: str, settings=None, steps: int = 4,
                                          layouts=LAYOUTS) -> None:
  """8 workers as 8 devices and as each of ``layouts`` (devices x workers simulated on each):
  the same bytes per step of each kind (each read from its compiled program), and parameters
  equal to the rounding of reassociated sums (float32's, or that of the narrower type a payload
  is all-reduced in)."""
  batch = _regression_batch()
  steps = steps if _family(name) == "per_step" else max(steps, 8)  # every kind runs
  runs = {}
  for devices, per_device in ((N, 1), *layouts):
    axis = "data" if per_device == 1 else ("data", "worker")
    dp = training_step(name, settings, harness.mesh(devices), axis=axis, per_device=per_device)
    params, state = dp.worker_params(PARAMS), dp.init(PARAMS)
    for t in range(steps):
      if t == PARAMS_COMPARED_AFTER.get(name, steps):
        compared = jax.tree.map(np.asarray, params)
      params, state, _ = dp.step(params, state, batch, kind=dp.kind_at(t))
    kinds = sorted({dp.kind_at(t) for t in range(steps)})
    compared = jax.tree.map(np.asarray, params) if name not in PARAMS_COMPARED_AFTER else compared
    runs[devices, per_device] = (compared,
                                 {k: dp.wire_bytes(params, state, batch, kind=k) for k in kinds})
  (reference, reference_bytes), *others = runs.values()
  # Each step's update is a sum over N workers, rounded N - 1 times in either order.
  epsilon = max(_reduction_epsilon(b) for b in reference_bytes.values())
  scale = max(float(np.abs(x).max()) for x in jax.tree.leaves(reference))
  if name in PARAMS_COMPARED_AFTER:
    epsilon, scale = 1e-3, PARAMS_COMPARED_AFTER[name] * LEARNING_RATE / (N * steps)
  for (devices, per_device), (params, bytes_per_kind) in zip(list(runs)[1:], others):
    where = f"{name}: {devices} devices x {per_device} workers"
    for kind, sent in bytes_per_kind.items():
      assert sent.total == reference_bytes[kind].total, (
          f"{where} send {sent.total:,.0f} bytes in a {kind} step, 8 devices "
          f"{reference_bytes[kind].total:,.0f}")
    for a, b in zip(jax.tree.leaves(reference), jax.tree.leaves(params)):
      np.testing.assert_allclose(b, a, rtol=0, atol=N * steps * epsilon * scale, err_msg=where)


def check_islands_with_fsdp_inside(name: str, settings=None, steps: int = 8) -> None:
  """The method across 2 islands, the model sharded over 4 fast devices inside each
  (:mod:`compressors.parallel.fsdp`): every kind runs and compiles once; each shard agrees
  across the islands after every step that synchronises (with local updates, differs between
  synchronisations); the model stays finite; the islands axis carries the exchange and the
  fast axis nothing but ZeRO-3's all-gather and reduce-scatter of the whole model (within 1%:
  the non-finite guard's flag; a kind with per-step inputs, TASC's curvature, differentiates
  through the gather again and sends more), and the islands axis at most a float32
  all-reduce of one shard (dense's bytes across the islands), within 5% of the cost model's
  price of exchanging the shard."""
  mesh = harness.islands_mesh()
  dp = training_step(name, settings, mesh, axis="islands", shard_axis="fsdp")
  batch = _regression_batch()
  params, state = dp.worker_params(PARAMS), dp.init(PARAMS)
  for t in range(steps):
    kind = dp.kind_at(t)
    params, state, metrics = dp.step(params, state, batch, kind=kind)
    agree = bool(dp.replicas_agree(params))
    if dp.per_worker_params and any(dp.synchronises(k) for k in dp.kinds):
      assert agree == dp.synchronises(kind), f"{name}: islands agree {agree} at step {t}"
    elif not dp.per_worker_params:
      assert agree, f"{name}: the islands' shards differ at step {t}"
  model = dp.model_params(compressors.TrainState(0, params, (), state))
  assert jax.tree.map(jnp.shape, model) == jax.tree.map(jnp.shape, PARAMS)
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(model)), name
  assert np.isfinite(float(metrics["loss"])) and int(metrics["skipped_steps"]) == 0
  model_bytes = sum(x.size * 4 for x in jax.tree.leaves(PARAMS))
  zero3 = 2 * (4 - 1) / 4 * model_bytes  # all-gather and reduce-scatter of the model
  dense = 2 * (2 - 1) / 2 * model_bytes / 4  # a float32 all-reduce of a shard by 2 islands
  for kind in {dp.kind_at(t) for t in range(steps)}:
    sent = dp.wire_bytes(params, state, batch, kind=kind).by_axis
    fast = sent.get(("fsdp",), 0.0)
    # A kind with per-step inputs (TASC's curvature) differentiates through the gather again.
    extra = dp.kinds[kind].inputs is not None
    assert (fast >= 0.99 * zero3) if extra else abs(fast - zero3) <= 0.01 * zero3, (
        f"{name} {kind}: fsdp {fast:,.0f} vs {zero3:,.0f}")
    slow = sent.get(("islands",), 0.0)
    assert slow <= 1.01 * dense, f"{name} {kind}: islands {slow:,.0f}, dense {dense:,.0f}"
  _check_islands_bytes_within_cost_model(name, settings, dp, params, state)


def _check_islands_bytes_within_cost_model(name, settings, dp, params, state) -> None:
  """The bytes across the islands, per device, within 5% of the cost model's for the exchange
  of one device's shard between the 2 islands (as :func:`check_bytes_within_cost_model`
  charges a kind or a local-update method's round)."""
  shards = compressors.parallel.fsdp.leaf_shard_shapes(
      [x.shape for x in jax.tree.leaves(PARAMS)], 4)
  topology = compressors.Topology.flat(2, compressors.Link(alpha=1e-6, bandwidth=1e9))
  settings = _settings(name, settings) if _family(name) != "per_step" else settings
  modelled = registry.cost(name, shards, topology, settings).bytes_sent
  by_kind = {k: dp.wire_bytes(params, state, _regression_batch(), kind=k).by_axis.get(
      ("islands",), 0.0) for k in dp.kinds}
  if dp.per_worker_params:
    every = registry.steps_per_exchange(name, settings)
    counts = dp.kind_counts(4 * every, 5 * every)
    measured = sum(n * by_kind[k] for k, n in counts.items())
  else:
    measured = by_kind[list(dp.kinds)[-1]]
  assert abs(measured - modelled) <= COST_TOLERANCE * modelled, (
      f"{name} across islands: {measured:,.0f} bytes, the cost model says {modelled:,.0f}")


CHECKS = (check_nothing_lost, check_nothing_lost_after_the_optimizer,
          check_replicas_identical_and_one_compile,
          check_pmap_equals_shard_map, check_fused_equals_per_leaf,
          check_bytes_within_cost_model, check_simulated_workers_match_devices,
          check_islands_with_fsdp_inside)


# The costliest checks, in the slow suite: pmap's legacy path, islands and simulated workers,
# each method's most expensive programs (half of the shared test's time, measured).
SLOW_CHECKS = (check_pmap_equals_shard_map, check_fused_equals_per_leaf,
               check_islands_with_fsdp_inside,
               check_simulated_workers_match_devices)


def run_all(name: str, settings=None, slow: bool = True) -> None:
  """Every check of this module on the registered method ``name`` (without ``slow``: all but
  :data:`SLOW_CHECKS`)."""
  for check in CHECKS:
    if slow or check not in SLOW_CHECKS:
      check(name, settings)

