"""The checks every gradient-exchange method must pass, by name in the method registry.

``tests/test_methods_common.py`` runs them on every method of :mod:`compressors.registry`, so a
method added to the registry is checked without a line of test code; a method registered
elsewhere (a plugin, a test) can call :func:`run_all` itself. Each check builds the method as the
runner does (:func:`compressors.registry.transformation`), with its default settings unless given
others, on 8 workers and a two-leaf model (a 200 x 200 matrix and a 200-vector: 40,200 entries,
enough for every default density and TASC's 256-element blocks):

* nothing is lost: each step, the mean over workers of ``g + e`` equals the mean the method
  returned plus the mean of the residuals it kept (and, for the two-phase exchange, what the
  chunks' owners kept), to the rounding of the sums: float32's, or that of the narrower type a
  payload is all-reduced in (fp16's all-reduce rounds its partial sums in float16); with the
  method's own momentum correction, its velocity is the input;
* replicas stay bit-identical over 20 training steps (:func:`compressors.data_parallel`), and
  the step compiles once;
* ``pmap`` gives the bits ``shard_map`` gives;
* fused and per-leaf buffers give the same bits on a one-leaf model, where they hold the same
  buffer (methods that force a layout are skipped);
* the bytes on the wire, read from the compiled program, are within 5% of the method's
  cost-model entry;
* 8 workers as 8 devices, as 2 devices x 4 simulated workers and as 1 device x 8 simulated
  workers (:mod:`compressors.parallel.workers`) send the same bytes per step and train to the same
  parameters, to the rounding of sums taken in another order.
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import optax

import compressors
from compressors import registry
from tests import harness

N = 8
PARAMS = {"w": jnp.zeros((200, 200)), "b": jnp.zeros((200,))}
COST_TOLERANCE = 0.05


def transformation(name: str, settings=None, **common):
  """The method's per-worker transformation over ``"data"``, as the runner builds it."""
  return registry.transformation(name, settings, axis_name="data",
                                 common=registry.Common(**common))


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
  rounding of the sums (float32's, or the narrower type a payload is all-reduced in)."""
  method = registry.get(name)
  settings = method.settings() if settings is None else settings
  momentum = 0.0
  if method.momentum is not None:
    momentum, clip_norm = method.momentum(settings)
    assert clip_norm is None, "the check feeds the velocity unclipped"
  tx = transformation(name, settings, error_feedback=True)
  state, update = harness.shard_map_update(tx, harness.mesh(), PARAMS)
  size = sum(x.size for x in jax.tree.leaves(PARAMS))
  epsilon = _reduction_epsilon(compressors.wire_bytes(
      update, PARAMS, state, harness.per_worker_grads(jax.random.PRNGKey(0), N, PARAMS)))
  for t in range(steps):
    grads = harness.per_worker_grads(jax.random.PRNGKey(t), N, PARAMS)
    before = _compress_state(state)
    velocity = harness.fused(state.velocity, N) if momentum else 0.0
    inputs = momentum * velocity + harness.fused(grads, N) + harness.fused(before.residual, N)
    mean, state = update(PARAMS, state, grads)
    after = _compress_state(state)
    kept = (harness.fused(after.residual, N).mean(0) + _owners_memory(after, size)
            - _owners_memory(before, size))
    # A sum of N terms rounds N - 1 times, each by at most epsilon of the largest partial sum.
    tolerance = (N - 1) * epsilon * np.abs(inputs).sum(0).max()
    np.testing.assert_allclose(inputs.mean(0), harness.fused(mean, 1)[0] + kept, rtol=0,
                               atol=tolerance, err_msg=f"{name}: step {t} lost something")


def _loss(params, batch):
  x, y = batch
  return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


def check_replicas_identical_and_one_compile(name: str, settings=None, steps: int = 20) -> None:
  """20 steps of ``chain(method, sgd)`` on a regression (``compressors.data_parallel``, the
  method's per-step inputs on the steps they are due): bit-identical parameters everywhere, one
  compiled step (two with per-step inputs)."""
  inputs = registry.step_inputs(name, settings)
  batch = _regression_batch()
  dp = compressors.data_parallel(_loss, optax.chain(transformation(name, settings),
                                                    optax.sgd(0.01)),
                                 harness.mesh(), PARAMS, batch, step_inputs=inputs)
  params, state, _ = dp.step(PARAMS, dp.init(PARAMS), batch, kind=dp.kind_at(0))
  compiled = []  # after the first step: at most the variant without the inputs
  with _counting_compilations(compiled):
    for t in range(1, steps):
      params, state, metrics = dp.step(params, state, batch, kind=dp.kind_at(t))
  harness.assert_replicas_identical(params)
  assert int(metrics["skipped_steps"]) == 0 and np.isfinite(float(metrics["loss"]))
  expected = int(inputs is not None and inputs.every > 1)
  assert len(compiled) == expected, f"{name}: {len(compiled)} compilations, {expected} expected"


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
  """The same updates under ``pmap`` and ``shard_map`` give the same bits."""
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


def check_fused_equals_per_leaf(name: str, settings=None, steps: int = 2) -> None:
  """On a one-leaf model, fused and per-leaf buffers are the same buffer: the same bits."""
  if registry.get(name).fuse is not None:
    return  # the method runs in one layout only
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
  """Bytes one device sends, from the compiled update, within 5% of the cost-model entry."""
  measured = harness.update_bytes(transformation(name, settings), PARAMS, harness.mesh()).total
  topology = compressors.Topology.flat(N, compressors.Link(alpha=1e-6, bandwidth=1e9))
  modelled = registry.cost(name, [x.shape for x in jax.tree.leaves(PARAMS)], topology,
                           settings).bytes_sent
  assert abs(measured - modelled) <= COST_TOLERANCE * modelled, (
      f"{name}: {measured:,.0f} bytes on the wire, the cost model says {modelled:,.0f}")


def _regression_batch():
  key_x, key_w = jax.random.split(jax.random.PRNGKey(0))
  x = jax.random.normal(key_x, (N * 16, 200))
  return x, x @ jax.random.normal(key_w, (200, 200)) / 10


def check_simulated_workers_match_devices(name: str, settings=None, steps: int = 4) -> None:
  """8 workers as 8 devices, 2 x 4 and 1 x 8 simulated: the same bytes per step (each read from
  its compiled program), and parameters equal to the rounding of reassociated sums (float32's,
  or that of the narrower type a payload is all-reduced in)."""
  inputs = registry.step_inputs(name, settings)
  batch = _regression_batch()
  runs = {}
  for devices, per_device in ((N, 1), (2, N // 2), (1, N)):
    axis = "data" if per_device == 1 else ("data", "worker")
    tx = optax.chain(registry.transformation(name, settings, axis_name=axis,
                                             common=registry.Common()), optax.sgd(0.01))
    dp = compressors.data_parallel(_loss, tx, harness.mesh(devices), PARAMS, batch,
                                   axis_name=axis, workers_per_device=per_device,
                                   step_inputs=inputs)
    params, state = PARAMS, dp.init(PARAMS)
    for t in range(steps):
      params, state, _ = dp.step(params, state, batch, kind=dp.kind_at(t))
    bytes_per_step = dp.wire_bytes(params, state, batch, kind=dp.kind_at(0))
    runs[devices, per_device] = (jax.tree.map(np.asarray, params), bytes_per_step)
  (reference, reference_bytes), *others = runs.values()
  # Each step's update is a sum over N workers, rounded N - 1 times in either order.
  epsilon = _reduction_epsilon(reference_bytes)
  scale = max(float(np.abs(x).max()) for x in jax.tree.leaves(reference))
  for (devices, per_device), (params, bytes_per_step) in zip(list(runs)[1:], others):
    where = f"{name}: {devices} devices x {per_device} workers"
    assert bytes_per_step.total == reference_bytes.total, (
        f"{where} send {bytes_per_step.total:,.0f} bytes per step, 8 devices "
        f"{reference_bytes.total:,.0f}")
    for a, b in zip(jax.tree.leaves(reference), jax.tree.leaves(params)):
      np.testing.assert_allclose(b, a, rtol=0, atol=N * steps * epsilon * scale, err_msg=where)


CHECKS = (check_nothing_lost, check_replicas_identical_and_one_compile,
          check_pmap_equals_shard_map, check_fused_equals_per_leaf,
          check_bytes_within_cost_model, check_simulated_workers_match_devices)


def run_all(name: str, settings=None) -> None:
  """Every check of this module on the registered method ``name``."""
  for check in CHECKS:
    check(name, settings)

