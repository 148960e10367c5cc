"""Non-finite gradients are skipped in lockstep; replica drift is detected."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import compressors
from tests import harness

N = 8


def _protected_update():
  params = {"w": jnp.zeros((64,)), "b": jnp.zeros((8,))}
  tx = compressors.skip_nonfinite(
      optax.chain(compressors.compress(compressors.topk(0.25), axis_name="data"),
                  optax.adam(1e-2)), axis_name="data")
  state, update = harness.shard_map_update(tx, harness.mesh(), params)
  return params, state, update


def test_nan_on_one_worker_skips_the_step_on_every_worker_and_training_goes_on():
  params, state, update = _protected_update()
  grads = harness.per_worker_grads(jax.random.PRNGKey(0), N, params)
  _, state = update(params, state, grads)  # one good step: residuals and moments are non-zero
  before = jax.tree.map(np.asarray, state)

  poisoned = jax.tree.map(lambda g: g, grads)
  poisoned["w"] = poisoned["w"].at[3, 5].set(jnp.nan)  # worker 3 only
  updates, state = update(params, state, poisoned)

  assert all(np.all(np.asarray(u) == 0) for u in jax.tree.leaves(updates))
  harness.assert_replicas_identical(updates)
  assert int(np.asarray(state.skipped)) == 1 and bool(np.asarray(state.last_skipped))
  for old, new in zip(jax.tree.leaves(before.inner), jax.tree.leaves(state.inner)):
    np.testing.assert_array_equal(np.asarray(new), old)  # residuals, moments, counters as they were

  updates, state = update(params, state, grads)
  assert all(np.all(np.isfinite(np.asarray(u))) for u in jax.tree.leaves(updates))
  assert any(np.any(np.asarray(u) != 0) for u in jax.tree.leaves(updates))
  assert int(np.asarray(state.skipped)) == 1 and not bool(np.asarray(state.last_skipped))


def test_infinite_aggregate_is_skipped_too():
  params, state, update = _protected_update()
  grads = {"w": jnp.full((N, 64), 3e38), "b": jnp.ones((N, 8))}  # finite here, inf once summed
  updates, state = update(params, state, grads)
  assert int(np.asarray(state.skipped)) == 1
  assert all(np.all(np.asarray(u) == 0) for u in jax.tree.leaves(updates))


def _agree(tree):
  mesh = harness.mesh()
  fn = jax.jit(jax.shard_map(lambda t: compressors.replicas_agree(t, "data"), mesh=mesh,
                             in_specs=P(), out_specs=P()))
  return bool(fn(tree)), compressors.wire_bytes(fn, tree)


def _replicated_with_one_copy_changed(x: np.ndarray, device: int) -> jax.Array:
  mesh = harness.mesh()
  copies = []
  for i, d in enumerate(mesh.devices.flat):
    copy = x.copy()
    if i == device:
      copy.view(np.uint32)[7] ^= 1  # one bit of one element
    copies.append(jax.device_put(copy, d))
  return jax.make_array_from_single_device_arrays(x.shape, NamedSharding(mesh, P()), copies)


def test_replica_check_passes_on_identical_and_fails_on_a_one_bit_difference():
  x = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
  same = _replicated_with_one_copy_changed(x, device=-1)
  ok, report = _agree({"w": same, "b": same[:10]})
  assert ok
  assert report.total <= 2 * 2 * (N - 1) / N * 4 * 2  # min and max of two 4-byte words
  drifted = _replicated_with_one_copy_changed(x, device=5)
  assert not _agree({"w": drifted, "b": same[:10]})[0]
