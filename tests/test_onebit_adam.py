"""1-bit Adam (``compressors.onebit_adam``; Tang et al. 2021, as DeepSpeed's ``OnebitAdam``) on 8
workers: against a float64 reference of the algorithm, nothing lost by its compressed exchange,
replicas bit-identical, ``pmap`` giving ``shard_map``'s bits, each step kind's bytes, and its
settings' checks."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import compressors
from compressors import registry
from compressors.network import topology as topology_lib
from compressors.parallel import step_kinds
from tests import harness
from tests import method_checks

pytestmark = pytest.mark.usefixtures("fast_compiles")

N = 8
# 13 x 7 + 7 = 98 entries: 8 chunks of 13, the last padded, as the two-phase exchange cuts them.
SMALL = {"w": jnp.zeros((13, 7)), "b": jnp.zeros((7,))}
B1, B2, EPS, WEIGHT_DECAY = 0.9, 0.999, 1e-8, 0.01
SCHEDULE = optax.linear_schedule(0.01, 0.005, 6)
F32_EPS = float(jnp.finfo(jnp.float32).eps)


def _tx():
  return compressors.onebit_adam(SCHEDULE, axis_name="data", b1=B1, b2=B2, eps=EPS,
                                 weight_decay=WEIGHT_DECAY)


def _kind(tx, compressed: bool):
  """``tx`` whose ``update`` runs one step kind (the static ``compressed`` bound)."""
  return optax.GradientTransformationExtraArgs(
      tx.init, functools.partial(tx.update, compressed=compressed))


def _programs(tx, mesh_, params):
  """(initial state, specs, ``{compressed: update}``) under shard_map, as
  ``harness.shard_map_update`` makes them, one jitted update per step kind; the state's
  per-worker layout is the compressed step's (the warm-up leaves the error memories as they
  are)."""
  specs = compressors.state_specs(_kind(tx, True), params, mesh_, "data")
  state = jax.jit(jax.shard_map(lambda p: compressors.add_device_axis(tx.init(p), specs),
                                mesh=mesh_, in_specs=P(), out_specs=specs))(params)

  def program(compressed):
    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh_, in_specs=(P(), specs, P("data")),
                       out_specs=(P(), specs))
    def update(params, state, grads):
      grads = jax.tree.map(lambda g: g[0], grads)
      updates, state = tx.update(grads, compressors.drop_device_axis(state, specs), params,
                                 compressed=compressed)
      return updates, compressors.add_device_axis(state, specs)
    return update

  return state, specs, {c: program(c) for c in (False, True)}


@pytest.fixture(scope="module")
def small():
  return _programs(_tx(), harness.mesh(), SMALL)


def _signs_times_rms(x: np.ndarray) -> np.ndarray:
  """1-bit Adam's compressor on each row: ``sign(x) * ||x||_2 / sqrt(d)`` (sign(0) = +1)."""
  scale = np.sqrt(np.mean(np.square(x), axis=-1, keepdims=True))
  return np.where(x >= 0, scale, -scale)


def _compressed_allreduce(x: np.ndarray, owners: np.ndarray):
  """The two-phase compressed all-reduce of the rows of ``x`` (``[N, D]``: each worker's
  momentum plus its error memory) with the chunk owners' memories ``owners`` (``[N, chunk]``).

  Returns:
    ``(mean [D], worker memories [N, D], owner memories [N, chunk])``.
  """
  size = x.shape[1]
  chunk = -(-size // N)
  chunks = np.pad(x, ((0, 0), (0, N * chunk - size))).reshape(N, N, chunk)  # worker, chunk
  sent = _signs_times_rms(chunks)
  worker_memory = (chunks - sent).reshape(N, -1)[:, :size]
  owner_input = sent.mean(axis=0) + owners  # owner j holds chunk j
  owner_sent = _signs_times_rms(owner_input)
  return owner_sent.reshape(-1)[:size], worker_memory, owner_input - owner_sent


def _reference(theta: np.ndarray, grads: list[np.ndarray], compressed: list[bool]):
  """1-bit Adam in float64 on the fused parameters ``theta`` (``[D]``) with each step's
  per-worker gradients (``[N, D]``): dense Adam while not ``compressed``, then frozen variance
  and local momentum through the compressed all-reduce. Returns ``(theta, m)``."""
  m, v = np.zeros_like(theta), np.zeros_like(theta)
  worker_memory = np.zeros((N, theta.size))
  owners = np.zeros((N, -(-theta.size // N)))
  for t, (g, step_compressed) in enumerate(zip(grads, compressed)):
    if step_compressed:
      local = B1 * m + (1 - B1) * g
      m, worker_memory, owners = _compressed_allreduce(local + worker_memory, owners)
    else:
      mean = g.mean(axis=0)
      m = B1 * m + (1 - B1) * mean
      v = B2 * v + (1 - B2) * np.square(mean)
    theta = theta - float(SCHEDULE(t)) * (m / (np.sqrt(v) + EPS) + WEIGHT_DECAY * theta)
  return theta, m


def test_matches_the_float64_reference_over_warm_up_and_compressed_steps(small):
  state, _, update = small
  params = harness.per_worker_grads(jax.random.PRNGKey(99), 1, SMALL)
  params = jax.tree.map(lambda x: x[0], params)
  theta0 = harness.fused(params, 1)[0].astype(np.float64)
  compressed = [False] * 3 + [True] * 3
  grads = [harness.per_worker_grads(jax.random.PRNGKey(t), N, SMALL) for t in range(6)]
  for g, c in zip(grads, compressed):
    updates, state = update[c](params, state, g)
    params = optax.apply_updates(params, updates)
  theta, m = _reference(theta0, [harness.fused(g, N).astype(np.float64) for g in grads],
                        compressed)
  np.testing.assert_allclose(harness.fused(state.mu, 1)[0], m, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(harness.fused(params, 1)[0], theta, rtol=1e-5, atol=1e-6)
  assert int(state.count) == 6 and int(state.exchange.count) == 3


def _owners(state, size: int) -> np.ndarray:
  """The chunk owners' memories in the fused layout (owner ``j`` holds chunk ``j``)."""
  return np.asarray(state.exchange.buffers.owner_residual).reshape(-1)[:size]


def test_a_compressed_step_loses_nothing(small):
  state, _, update = small
  size = sum(x.size for x in jax.tree.leaves(SMALL))
  _, state = update[False](SMALL, state, harness.per_worker_grads(jax.random.PRNGKey(9), N, SMALL))
  for t in range(3):  # the first compressed steps, from zero error memories on
    grads = harness.per_worker_grads(jax.random.PRNGKey(t), N, SMALL)
    before = state
    inputs = (B1 * harness.fused(before.mu, 1) + (1 - B1) * harness.fused(grads, N)
              + harness.fused(before.exchange.residual, N))
    _, state = update[True](SMALL, state, grads)
    kept = (harness.fused(state.exchange.residual, N).mean(0) + _owners(state, size)
            - _owners(before, size))
    # The sum over N workers rounds N - 1 times; the local momentum twice more.
    tolerance = (N + 1) * F32_EPS * np.abs(inputs).sum(0).max()
    np.testing.assert_allclose(inputs.mean(0), harness.fused(state.mu, 1)[0] + kept, rtol=0,
                               atol=tolerance, err_msg=f"compressed step {t} lost something")


def test_replicas_are_bit_identical_and_pmap_gives_shard_maps_bits(small):
  state, _, update = small
  tx = _tx()
  pm_update = {c: jax.pmap(lambda p, s, g, c=c: tx.update(g, s, p, compressed=c),
                           axis_name="data") for c in (False, True)}
  replicated = jax.tree.map(lambda x: jnp.broadcast_to(x + 1.0, (N,) + x.shape), SMALL)
  pm_state = jax.pmap(tx.init, axis_name="data")(replicated)
  params = jax.tree.map(lambda x: x + 1.0, SMALL)
  for t, c in enumerate([False, False, True, True]):
    grads = harness.per_worker_grads(jax.random.PRNGKey(t), N, SMALL)
    updates, state = update[c](params, state, grads)
    pm_updates, pm_state = pm_update[c](replicated, pm_state, grads)
    harness.assert_replicas_identical((updates, state.mu, state.nu))
    for a, b in zip(jax.tree.leaves(updates), jax.tree.leaves(pm_updates)):
      for copy in np.asarray(b):
        np.testing.assert_array_equal(copy, np.asarray(a), err_msg=f"step {t}")


def test_a_warm_up_step_all_reduces_densely_and_a_compressed_one_costs_what_the_model_says():
  params = method_checks.PARAMS
  state, _, update = _programs(_tx(), harness.mesh(), params)
  grads = jax.tree.map(lambda x: jax.ShapeDtypeStruct((N,) + x.shape, x.dtype), params)
  size = sum(x.size for x in jax.tree.leaves(params))
  warm_up = compressors.wire_bytes(update[False], params, state, grads)
  dense = [c for c in warm_up.collectives if c.kind == "all-reduce" and "f32" in c.dtypes]
  assert sum(c.size_bytes for c in dense) >= 4 * size, str(warm_up)
  measured = compressors.wire_bytes(update[True], params, state, grads)
  assert not [c for c in measured.collectives if c.kind == "all-reduce" and c.size_bytes > 64]
  topology = compressors.Topology.flat(N, compressors.Link(alpha=1e-6, bandwidth=1e9))
  modelled = registry.cost("onebit_adam", [x.shape for x in jax.tree.leaves(params)],
                           topology).bytes_sent
  assert abs(measured.total - modelled) <= 0.05 * modelled, (
      f"{measured.total:,.0f} bytes on the wire, the cost model says {modelled:,.0f}")
  assert modelled == topology_lib.onebit_cost(topology, size, scale_bytes=4).bytes_sent


def test_the_warm_up_as_a_fraction_of_the_run():
  """The published warm-up, 15-25% of training: 15% of 5,194 steps is 779; at least one step;
  bad fractions and step counts refused naming the field."""
  freeze = registry.get("onebit_adam").settings.freeze_step_for
  assert freeze(0.15, 5194) == 779 and freeze(0.15, 1000) == 150
  assert freeze(0.001, 100) == 1 and freeze(0.0, 100) == 1
  with pytest.raises(ValueError, match=r"fraction=1.0 is outside \[0, 1\)"):
    freeze(1.0, 100)
  with pytest.raises(ValueError, match="steps"):
    freeze(0.15, 0)


def test_kinds_warm_up_then_compress():
  settings = registry.default_settings("onebit_adam", freeze_step=5)
  kinds = step_kinds.checked(registry.get("onebit_adam").kinds(settings))
  assert [step_kinds.kind_at(kinds, t) for t in (0, 4, 5, 100)] == [
      "warmup", "warmup", "compressed", "compressed"]
  assert [k.update_kwargs() for k in kinds] == [{"compressed": False}, {"compressed": True}]
  only = registry.get("onebit_adam").kinds(registry.default_settings("onebit_adam",
                                                                     freeze_step=0))
  assert [(k.name, k.start) for k in only] == [("compressed", 0)]
  assert registry.get("onebit_adam").family == "optimizer"


def _zero_one_adam_dense_steps(scaler: int, var_freeze_step: int, freeze_step: int,
                               steps: int) -> set[int]:
  """The 0-based steps that are dense by DeepSpeed's ``ZeroOneAdam`` counters (a refresh at
  1-based step ``k`` when ``k % var_interval == 0``, the interval doubled after ``scaler``
  refreshes, none after ``var_freeze_step``), or by 1-bit Adam's warm-up."""
  dense, interval, counter = set(range(freeze_step)), 1, 0
  for k in range(1, steps + 1):
    if k <= var_freeze_step and k % interval == 0:
      dense.add(k - 1)
      counter += 1
      if counter == scaler:
        counter, interval = 0, 2 * interval
  return dense


@pytest.mark.parametrize("freeze_step, scaler, var_freeze_step",
                         [(0, 2, 60), (5, 3, 100), (40, 2, 70), (3, 1, 50), (0, 4, 2)])
def test_variance_refreshes_follow_zero_one_adams_schedule(freeze_step, scaler, var_freeze_step):
  settings = registry.default_settings("onebit_adam", freeze_step=freeze_step,
                                       variance_refresh=scaler,
                                       variance_freeze_step=var_freeze_step)
  kinds = step_kinds.checked(registry.get("onebit_adam").kinds(settings))
  dense = {t for t in range(160) if step_kinds.kind_at(kinds, t) != "compressed"}
  assert dense == _zero_one_adam_dense_steps(scaler, var_freeze_step, freeze_step, 160)
  assert all(k.update_kwargs() == {"compressed": k.name == "compressed"} for k in kinds)


@pytest.mark.parametrize("field, value", [("b1", 1.0), ("b2", -0.1), ("eps", 0.0),
                                          ("weight_decay", -1e-4), ("freeze_step", -1),
                                          ("variance_refresh", -1)])
def test_bad_settings_name_the_field(field, value):
  with pytest.raises(ValueError, match=f"{field}={value!r}"):
    registry.default_settings("onebit_adam", **{field: value})


def test_bad_arguments_are_refused():
  with pytest.raises(ValueError, match="learning_rate=-0.1"):
    compressors.onebit_adam(-0.1, axis_name="data")
  with pytest.raises(TypeError, match="compressed must be a Python bool"):
    _tx().update(SMALL, None, SMALL, compressed=jnp.array(True))
  with pytest.raises(ValueError, match="needs params"):
    _tx().update(SMALL, None, compressed=False)
