"""compressors.data_parallel: the step helper equals the long form bit for bit, skips non-finite
steps on every worker, runs under pmap alike, and takes any optax wrapper and chain order (or
says which order works)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import compressors
from compressors import registry
import optimizers
import tasc
from tests import harness

pytestmark = pytest.mark.usefixtures("fast_compiles")

N = 8
_loss = harness.regression_loss  # one worker's loss: a linear regression


def _problem(seed=0):
  key_x, key_w = jax.random.split(jax.random.PRNGKey(seed))
  x = jax.random.normal(key_x, (N * 4, 256))
  params = {"w": jnp.zeros((256, 16)), "b": jnp.zeros((16,))}
  return params, (x, x @ jax.random.normal(key_w, (256, 16)))


def _tasc_lamb():
  return optax.chain(tasc.tasc_compress(axis_name="data", density=0.1, block_size=64),
                     optimizers.lamb(1e-2))


def _long_form(tx, mesh, params):
  """The README's step by hand (with the lockstep skip of non-finite steps)."""
  tx = compressors.skip_nonfinite(tx, axis_name="data")
  specs = compressors.state_specs(tx, params, mesh, "data")
  state = jax.jit(jax.shard_map(lambda p: compressors.add_device_axis(tx.init(p), specs),
                                mesh=mesh, in_specs=P(), out_specs=specs))(params)

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), specs, P("data")),
                     out_specs=(P(), specs))
  def step(params, state, batch):
    grads = jax.grad(_loss)(jax.lax.pcast(params, "data", to="varying"), batch)
    updates, state = tx.update(grads, compressors.drop_device_axis(state, specs), params)
    return optax.apply_updates(params, updates), compressors.add_device_axis(state, specs)

  return state, step


def test_the_helper_equals_the_long_form_bit_for_bit():
  params, batch = _problem()
  mesh = harness.mesh()
  dp = compressors.data_parallel(_loss, _tasc_lamb(), mesh, params, batch)
  state, long_state = dp.init(params), None
  long_state, long_step = _long_form(_tasc_lamb(), mesh, params)
  mine, theirs = params, params
  for _ in range(4):
    mine, state, metrics = dp.step(mine, state, batch)
    theirs, long_state = long_step(theirs, long_state, batch)
  for a, b in zip(jax.tree.leaves(mine), jax.tree.leaves(theirs)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  harness.assert_replicas_identical(mine)
  assert float(metrics["loss"]) > 0 and int(metrics["skipped_steps"]) == 0
  report = dp.wire_bytes(mine, state, batch)
  dense = 2 * (N - 1) / N * 4 * (256 * 16 + 16)
  assert 0 < report.total < dense / 4


def test_a_nan_on_one_worker_skips_the_step_on_every_worker():
  params, (x, y) = _problem()
  dp = compressors.data_parallel(_loss, _tasc_lamb(), harness.mesh(), params, (x, y))
  state = dp.init(params)
  params, state, _ = dp.step(params, state, (x, y))
  poisoned = (x.at[5, 0].set(jnp.nan), y)  # row 5 belongs to worker 1
  after, state, metrics = dp.step(params, state, poisoned)
  assert int(metrics["skipped_steps"]) == 1
  for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_pmap_gives_the_bits_of_shard_map():
  params, batch = _problem()
  tx = optax.chain(compressors.compress(compressors.topk(0.05), axis_name="data"),
                   optax.sgd(0.1))
  results = []
  for mesh in (harness.mesh(), None):
    dp = compressors.data_parallel(_loss, tx, mesh, params, batch)
    p, state = params, dp.init(params)
    for _ in range(3):
      p, state, _ = dp.step(p, state, batch)
    results.append(p)
  for a, b in zip(jax.tree.leaves(results[0]), jax.tree.leaves(results[1])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_per_step_inputs_make_the_curvature_state_per_worker():
  params, batch = _problem()
  inputs = registry.step_inputs("tasc", tasc.TascSettings(hessian_every=2, num_probes=1))
  tx = optax.chain(tasc.tasc_compress(axis_name="data", density=0.1, block_size=64),
                   optax.sgd(0.05))
  dp = compressors.data_parallel(_loss, tx, harness.mesh(), params, batch, kinds=inputs)
  curvature = dp.specs.inner[0].buffers.compressor.curvature
  assert curvature == P("data")  # each worker's own estimate
  state = dp.init(params)
  for t in range(4):
    params, state, _ = dp.step(params, state, batch, kind=dp.kind_at(t))
  harness.assert_replicas_identical(params)


# Wrappers and chain orders: each runs 5 steps with identical replicas, or is refused with an
# error that says which order works.
WRAPPED = {
    "multisteps_around_the_chain": lambda: optax.MultiSteps(
        _tasc_lamb(), every_k_schedule=2).gradient_transformation(),
    "multisteps_after_the_compressor": lambda: optax.chain(
        tasc.tasc_compress(axis_name="data", density=0.1, block_size=64),
        optax.MultiSteps(optimizers.lamb(1e-2), every_k_schedule=2).gradient_transformation()),
    "apply_if_finite_after_the_compressor": lambda: optax.chain(
        compressors.compress(compressors.topk(0.05), axis_name="data"),
        optax.apply_if_finite(optax.adam(1e-2), 3)),
    "inject_hyperparams": lambda: optax.chain(
        compressors.compress(compressors.topk(0.05), axis_name="data"),
        optax.inject_hyperparams(optax.adam)(learning_rate=1e-2)),
    "masked": lambda: optax.chain(
        compressors.compress(compressors.topk(0.05), axis_name="data"),
        optax.masked(optax.adam(1e-2), {"w": True, "b": False})),
    "optimizer_first": lambda: optax.chain(
        optax.adam(1e-2), compressors.compress(compressors.topk(0.05), axis_name="data")),
}


@pytest.mark.parametrize("name", sorted(WRAPPED))
def test_optax_wrappers_and_chain_orders_keep_replicas_identical(name):
  params, batch = _problem()
  dp = compressors.data_parallel(_loss, WRAPPED[name](), harness.mesh(), params, batch)
  state = dp.init(params)
  start = params
  for _ in range(5):
    params, state, _ = dp.step(params, state, batch)
  harness.assert_replicas_identical(params)
  harness.assert_replicas_identical([x for x, spec in zip(jax.tree.leaves(state),
                                                          jax.tree.leaves(dp.specs))
                                     if spec == P()])
  assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(params),
                                                     jax.tree.leaves(start)))


def test_the_optimizer_before_the_compressor_keeps_its_moments_per_worker():
  params, batch = _problem()
  dp = compressors.data_parallel(_loss, WRAPPED["optimizer_first"](), harness.mesh(), params,
                                 batch)
  adam = dp.specs.inner[0][0]
  assert adam.mu["w"] == P("data") and adam.count == P()


def test_a_per_worker_decision_around_the_compressor_is_refused_naming_the_order():
  params, batch = _problem()
  tx = optax.apply_if_finite(_tasc_lamb(), 3)
  with pytest.raises(ValueError, match=r"updates of this transformation differ between the "
                                       r"workers.*apply_if_finite\) must go after it"):
    compressors.data_parallel(_loss, tx, harness.mesh(), params, batch, skip_nonfinite=False)


def test_simulated_workers_need_an_axis_outside_the_mesh_and_a_mesh():
  params, batch = _problem()
  tx = _tasc_lamb()
  with pytest.raises(ValueError, match=r"axis_name='data' with workers_per_device=4: must be "
                                       r"mesh axes, then one more name .*\('data', 'worker'\)"):
    compressors.data_parallel(_loss, tx, harness.mesh(2), params, batch, workers_per_device=4)
  with pytest.raises(ValueError, match=r"axis_name=\('data', 'worker'\) with "
                                       r"workers_per_device=1: must be mesh axes"):
    compressors.data_parallel(_loss, tx, harness.mesh(2), params, batch,
                              axis_name=("data", "worker"))
  with pytest.raises(ValueError, match="workers_per_device=0 must be an int >= 1"):
    compressors.data_parallel(_loss, tx, harness.mesh(2), params, batch,
                              axis_name=("data", "worker"), workers_per_device=0)
  with pytest.raises(ValueError, match=r"workers_per_device=2 needs a mesh"):
    compressors.data_parallel(_loss, tx, None, params, batch, workers_per_device=2)


def test_simulated_workers_give_each_their_own_batch_share_and_state():
  """2 devices x 4 workers: the aux of every worker is its own loss on its own rows, in rank
  order (device-major), and each worker's residual is its own."""
  params, (x, y) = _problem()
  axis = ("data", "worker")
  tx = optax.chain(compressors.compress(compressors.topk(0.05), axis_name=axis), optax.sgd(0.1))
  loss_and_own = lambda p, b: (_loss(p, b), _loss(p, b))
  dp = compressors.data_parallel(loss_and_own, tx, harness.mesh(2), params, (x, y),
                                 axis_name=axis, workers_per_device=4, has_aux=True)
  state = dp.init(params)
  _, state, metrics = dp.step(params, state, (x, y))
  rows = x.shape[0] // N
  expected = [_loss(params, (x[i * rows:(i + 1) * rows], y[i * rows:(i + 1) * rows]))
              for i in range(N)]
  np.testing.assert_allclose(metrics["aux"], expected, rtol=1e-6)
  residual = state.inner[0].residual["w"]
  assert residual.shape == (N,) + params["w"].shape
  assert len({np.asarray(r).tobytes() for r in residual}) == N
