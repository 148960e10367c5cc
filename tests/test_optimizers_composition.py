"""LAMB and LARS after ``compressors.compress`` under ``shard_map`` on 8 simulated devices.

The trust ratio is a function of the whole layer's gradient, so it must be computed once, on the
aggregated (decoded, averaged) gradient, after the exchange: then every replica computes the same
ratio and the parameters stay bit-identical.
"""

import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import compressors
import optimizers

pytestmark = pytest.mark.usefixtures("fast_compiles")

NUM_DEVICES = 8
PER_DEVICE_BATCH = 4
STEPS = 4

OPTIMIZERS = {
    "lamb": lambda: optimizers.lamb(0.02, weight_decay=0.01),
    "lars": lambda: optimizers.lars(2.0, weight_decay=1e-3, trust_coefficient=0.01),
}


@pytest.fixture(scope="module")
def mesh():
  if jax.device_count() < NUM_DEVICES:
    pytest.skip(f"needs {NUM_DEVICES} devices (tests/conftest.py simulates them on CPU)")
  return jax.make_mesh((NUM_DEVICES,), ("data",))


def make_params() -> dict:
  rng = np.random.default_rng(0)
  return jax.tree.map(jnp.float32, {
      "hidden": {"kernel": 0.3 * rng.normal(size=(16, 24)), "bias": np.zeros(24)},
      "out": {"kernel": 0.3 * rng.normal(size=(24, 4)), "bias": np.zeros(4)},
  })


def make_batches(steps: int) -> list[tuple[jax.Array, jax.Array]]:
  """Different examples on every device and every step."""
  rng = np.random.default_rng(1)
  size = NUM_DEVICES * PER_DEVICE_BATCH
  return [(jnp.float32(rng.normal(size=(size, 16))), jnp.int32(rng.integers(0, 4, size=size)))
          for _ in range(steps)]


def loss(params, batch):
  x, y = batch
  hidden = jnp.tanh(x @ params["hidden"]["kernel"] + params["hidden"]["bias"])
  logits = hidden @ params["out"]["kernel"] + params["out"]["bias"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def data_parallel(tx, mesh, params):
  """The README's long form: replicated params, per-worker state where the update makes it so
  (a MultiSteps around the compressor accumulates each worker's own gradient), sharded batch."""
  specs = compressors.state_specs(tx, params, mesh, "data")
  to_global = lambda state: compressors.add_device_axis(state, specs)
  to_local = lambda state: compressors.drop_device_axis(state, specs)

  init = jax.jit(jax.shard_map(lambda p: to_global(tx.init(p)), mesh=mesh, in_specs=P(),
                               out_specs=specs))

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), specs, P("data")),
                     out_specs=(P(), specs))
  def step(params, opt_state, batch):
    opt_state = to_local(opt_state)
    # Differentiating w.r.t. the replicated params would make autodiff sum over "data" itself.
    grads = jax.grad(loss)(jax.lax.pcast(params, "data", to="varying"), batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), to_global(opt_state)

  return init, step


def train(tx, mesh, params, batches):
  """Runs the data-parallel steps; returns the parameters and state after each one."""
  init, step = data_parallel(tx, mesh, params)
  params = jax.device_put(params, NamedSharding(mesh, P()))
  opt_state = init(params)
  history = []
  for batch in batches:
    params, opt_state = step(params, opt_state,
                             jax.device_put(batch, NamedSharding(mesh, P("data"))))
    history.append((params, opt_state))
  return history


def device_copies(leaf: jax.Array) -> list[np.ndarray]:
  """What every device actually holds of a replicated array."""
  shards = [np.asarray(shard.data) for shard in leaf.addressable_shards]
  assert len(shards) == NUM_DEVICES
  return shards


def assert_replicas_identical(replicated):
  for leaf in jax.tree.leaves(replicated):
    copies = device_copies(leaf)
    for copy in copies[1:]:
      np.testing.assert_array_equal(copy, copies[0])


def device_batch(batch, i: int):
  """Worker ``i``'s part of a batch sharded with ``P("data")``: a contiguous slice."""
  return jax.tree.map(lambda a: a[i * PER_DEVICE_BATCH:(i + 1) * PER_DEVICE_BATCH], batch)


def mean_gradient(params, batch):
  """The average of the 8 workers' gradients, computed outside ``shard_map``."""
  per_device = [jax.grad(loss)(params, device_batch(batch, i)) for i in range(NUM_DEVICES)]
  return jax.tree.map(lambda *g: sum(g) / NUM_DEVICES, *per_device)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_replicas_stay_bit_identical_with_topk(mesh, name):
  params = make_params()
  tx = optax.chain(compressors.compress(compressors.topk(0.01), axis_name="data"),
                   OPTIMIZERS[name]())
  history = train(tx, mesh, params, make_batches(STEPS))
  for new_params, (_, optimizer_state) in history:
    assert_replicas_identical(new_params)
    # Moments / momentum come from the aggregated gradient: the same on every worker too.
    assert_replicas_identical(optimizer_state[1])
  assert float(jnp.max(jnp.abs(history[-1][0]["hidden"]["kernel"] - params["hidden"]["kernel"]))
               ) > 1e-6
  residual = history[-1][1][0].residual  # error feedback differs per worker (a real exchange)
  assert not np.array_equal(np.asarray(residual["hidden"]["kernel"])[0],
                            np.asarray(residual["hidden"]["kernel"])[1])


# LAMB's case is slow: LARS's takes the same path through the chain at a fifth of the cost.
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "lamb" else n
                                  for n in sorted(OPTIMIZERS)])
def test_trust_ratio_uses_the_aggregated_gradient(mesh, name):
  params = make_params()
  batches = make_batches(3)
  tx = optax.chain(compressors.compress(compressors.dense(), axis_name="data"), OPTIMIZERS[name]())
  history = train(tx, mesh, params, batches)

  reference = OPTIMIZERS[name]()  # the same optimizer, fed the mean gradient computed apart
  state, expected = reference.init(params), params
  for batch, (new_params, _) in zip(batches, history):
    updates, state = reference.update(mean_gradient(expected, batch), state, expected)
    expected = optax.apply_updates(expected, updates)
    for ours, theirs, start in zip(jax.tree.leaves(new_params), jax.tree.leaves(expected),
                                   jax.tree.leaves(params)):
      np.testing.assert_allclose(np.asarray(ours) - start, np.asarray(theirs) - start,
                                 rtol=1e-4, atol=1e-7)

  # Non-vacuous: trust ratios of the local gradients, averaged afterwards, differ.
  local = []
  for i in range(NUM_DEVICES):
    tx_local = OPTIMIZERS[name]()
    grads = jax.grad(loss)(params, device_batch(batches[0], i))
    local.append(tx_local.update(grads, tx_local.init(params), params)[0])
  averaged_local = jax.tree.map(lambda *u: sum(u) / NUM_DEVICES, *local)
  aggregated = jax.tree.map(lambda a, b: a - b, history[0][0], params)
  kernel_local, kernel_ours = averaged_local["out"]["kernel"], aggregated["out"]["kernel"]
  assert float(jnp.linalg.norm(kernel_local - kernel_ours)) > 0.05 * float(
      jnp.linalg.norm(kernel_ours))


@pytest.mark.parametrize("compressor", ["dense", "topk"])
def test_multisteps_around_the_chain(mesh, compressor):
  every_k = 2
  params = make_params()
  batches = make_batches(2 * every_k)
  make_compressor = {"dense": compressors.dense, "topk": lambda: compressors.topk(0.01)}[compressor]
  chain = optax.chain(compressors.compress(make_compressor(), axis_name="data"),
                      OPTIMIZERS["lamb"]())
  tx = optax.MultiSteps(chain, every_k_schedule=every_k).gradient_transformation()
  history = train(tx, mesh, params, batches)

  previous = params
  for step, (new_params, _) in enumerate(history, start=1):
    assert_replicas_identical(new_params)
    moved = max(float(jnp.max(jnp.abs(a - b)))
                for a, b in zip(jax.tree.leaves(new_params), jax.tree.leaves(previous)))
    assert (moved > 0.0) == (step % every_k == 0), f"step {step}: moved {moved}"
    previous = new_params

  if compressor == "dense":  # LAMB on the mean over workers and micro-batches, computed apart
    reference = OPTIMIZERS["lamb"]()
    state, expected = reference.init(params), params
    for k in range(0, len(batches), every_k):
      grads = [mean_gradient(expected, b) for b in batches[k:k + every_k]]
      updates, state = reference.update(
          jax.tree.map(lambda *g: sum(g) / every_k, *grads), state, expected)
      expected = optax.apply_updates(expected, updates)
    for ours, theirs, start in zip(jax.tree.leaves(history[-1][0]), jax.tree.leaves(expected),
                                   jax.tree.leaves(params)):
      np.testing.assert_allclose(np.asarray(ours) - start, np.asarray(theirs) - start,
                                 rtol=1e-4, atol=1e-7)
