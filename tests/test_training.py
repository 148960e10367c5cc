"""Training with compression on 8 workers: hierarchical mode, convergence with and without error
feedback. (Every registered method's identical replicas, pmap and single compile are checked in
tests/test_methods_common.py.)"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import compressors
from tests import harness

pytestmark = pytest.mark.usefixtures("fast_compiles")

N = 8


def _init_params(key, sizes=(16, 48, 1)):
  params = {}
  for i, (m, n) in enumerate(zip(sizes[:-1], sizes[1:])):
    key, sub = jax.random.split(key)
    params[f"layer{i}"] = {"w": jax.random.normal(sub, (m, n)) / np.sqrt(m), "b": jnp.zeros(n)}
  return params


def _predict(params, x):
  h = x
  for i in range(len(params)):
    layer = params[f"layer{i}"]
    h = h @ layer["w"] + layer["b"]
    if i < len(params) - 1:
      h = jnp.tanh(h)
  return h[..., 0]


def _loss(params, batch):
  x, y = batch
  return jnp.mean((_predict(params, x) - y) ** 2)


def _data(num_examples=N * 256, seed=0):
  """A noisy teacher-student regression task: the loss plateaus at the noise floor (0.01)."""
  key_x, key_t, key_n = jax.random.split(jax.random.PRNGKey(seed), 3)
  x = jax.random.normal(key_x, (num_examples, 16))
  teacher = _init_params(key_t, (16, 8, 1))
  y = _predict(teacher, x) + 0.1 * jax.random.normal(key_n, (num_examples,))
  return x.reshape(N, -1, 16), y.reshape(N, -1)


def _trainer(tx, params):
  mesh = harness.mesh()
  specs = compressors.state_specs(tx, params, mesh, "data")
  state = jax.jit(jax.shard_map(lambda p: compressors.add_device_axis(tx.init(p), specs),
                                mesh=mesh,
                                in_specs=P(), out_specs=specs))(params)

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), specs, P("data")),
                     out_specs=(P(), specs, P()))
  def step(params, state, batch):
    state = compressors.drop_device_axis(state, specs)
    batch = jax.tree.map(lambda b: b[0], batch)
    local = jax.lax.pcast(params, "data", to="varying")  # per-worker gradients, not summed
    loss, grads = jax.value_and_grad(_loss)(local, batch)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), compressors.add_device_axis(state, specs), \
        jax.lax.pmean(loss, "data")

  return state, step


def _place(params, batch):
  """Parameters replicated and the batch split over workers, as the step's specs say."""
  mesh = harness.mesh()
  return (jax.device_put(params, jax.sharding.NamedSharding(mesh, P())),
          jax.device_put(batch, jax.sharding.NamedSharding(mesh, P("data"))))


def test_hierarchical_mode_gives_the_flat_mean_and_shrinks_the_slow_axis_bytes():
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("node", "gpu"))
  params = {"w": jnp.zeros((1000,))}
  grads = {"w": jax.random.normal(jax.random.PRNGKey(0), (N, 1000))}

  def run(tx, axis):
    specs = compressors.state_specs(tx, params, mesh, axis)
    state = jax.jit(jax.shard_map(lambda p: compressors.add_device_axis(tx.init(p), specs),
                                mesh=mesh,
                                  in_specs=P(), out_specs=specs))(params)
    fn = jax.jit(jax.shard_map(
        lambda p, s, g: tx.update(jax.tree.map(lambda x: x[0], g),
                                  compressors.drop_device_axis(s, specs),
                                  p)[0],
        mesh=mesh, in_specs=(P(), specs, P(("node", "gpu"))), out_specs=P()))
    return fn(params, state, grads), compressors.wire_bytes(fn, params, state, grads, mesh=mesh)

  flat, flat_bytes = run(compressors.compress(compressors.dense(), axis_name=("node", "gpu"),
                                              error_feedback=False), ("node", "gpu"))
  tiered, tiered_bytes = run(compressors.compress(compressors.dense(), axis_name="node",
                                                  dense_axis="gpu", error_feedback=False),
                             ("node", "gpu"))
  np.testing.assert_allclose(np.asarray(tiered["w"]), np.asarray(grads["w"]).mean(0), rtol=1e-5,
                             atol=1e-6)
  np.testing.assert_allclose(np.asarray(tiered["w"]), np.asarray(flat["w"]), rtol=1e-5, atol=1e-6)
  slow = sum(v for k, v in tiered_bytes.by_axis.items() if "node" in k)
  print(f"slow-axis bytes: hierarchical {slow:,.0f} vs flat all-reduce {flat_bytes.total:,.0f}")
  assert slow <= flat_bytes.total / 4 * 1.1


def _train(compressor, steps, error_feedback=True, lr=0.1):
  params = _init_params(jax.random.PRNGKey(1))
  tx = optax.chain(compressors.compress(compressor, axis_name="data",
                                        error_feedback=error_feedback), optax.sgd(lr))
  state, step = _trainer(tx, params)
  params, batch = _place(params, _data())
  losses = []
  for _ in range(steps):
    params, state, loss = step(params, state, batch)
    losses.append(float(loss))
  return losses


@pytest.mark.slow
def test_topk_with_error_feedback_matches_dense_and_without_is_worse():
  steps = 1500
  dense = _train(compressors.dense(), steps)
  with_ef = _train(compressors.topk(0.01), steps)
  without_ef = _train(compressors.topk(0.01), steps, error_feedback=False)
  print(f"final loss after {steps} steps: dense {dense[-1]:.4f}, top-k 1% + EF {with_ef[-1]:.4f},"
        f" top-k 1% without EF {without_ef[-1]:.4f}")
  assert with_ef[-1] <= dense[-1] * 1.02
  assert without_ef[-1] > with_ef[-1] * 1.1
