"""DeMo (Peng, Quesnelle & Kingma 2024) against a float64 numpy replay of its algorithm, on 8
workers: updates, momenta, nothing lost, replicas, pmap, bytes and settings."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import compressors
from compressors import registry
from compressors.network import topology as topology_lib
from tests import harness

pytestmark = pytest.mark.usefixtures("fast_compiles")

N = 8
BETA = 0.999
CHUNK, TOPK = 64, 32
# A matrix in two 48 x 40 tiles, a conv-like kernel tiled as its 12 x 10 matrix, a vector in four
# chunks of 50, and two leaves sent whole: 16 elements (one tile of 16 <= topk) and a prime 67
# (tiles of one).
SHAPES = {"w": (96, 40), "conv": (3, 4, 10), "b": (200,), "small": (16,), "prime": (67,)}
WHOLE = ("small", "prime")


def schedule(count):
  return 0.1 / (1.0 + count)


@functools.lru_cache(maxsize=None)
def dct_matrix(n: int) -> np.ndarray:
  """The orthonormal DCT-II, written out: ``D[k, j] = sqrt(2/n) a_k cos(pi (j + 1/2) k / n)``."""
  d = np.empty((n, n))
  for k in range(n):
    for j in range(n):
      d[k, j] = np.sqrt((1.0 if k == 0 else 2.0) / n) * np.cos(np.pi * (j + 0.5) * k / n)
  return d


def split(n: int, target: int) -> int:
  """The reference's ``_get_smaller_split``: the largest divisor of ``n`` at most ``target``."""
  return max(d for d in range(1, n + 1) if n % d == 0 and d <= target)


def as_matrix(x: np.ndarray) -> np.ndarray:
  """A leaf as the matrix it is tiled as: a vector as one row, more dimensions as
  ``prod(leading) x last``."""
  return x.reshape(1, -1) if x.ndim < 2 else x.reshape(-1, x.shape[-1])


def tile_blocks(shape: tuple[int, int]):
  """The tile slices of a matrix of ``shape`` (a vector's row has tiles of height one)."""
  c1, c2 = (1 if shape[0] == 1 else split(shape[0], CHUNK)), split(shape[1], CHUNK)
  return [(slice(r, r + c1), slice(c, c + c2))
          for r in range(0, shape[0], c1) for c in range(0, shape[1], c2)], c1, c2


def coefficients(m: np.ndarray) -> list[np.ndarray]:
  """Each tile's 2-D DCT, ``D1 T D2^T``, flattened row-major."""
  blocks, c1, c2 = tile_blocks(m.shape)
  return [(dct_matrix(c1) @ m[b] @ dct_matrix(c2).T).reshape(-1) for b in blocks]


def decode(tiles: list[np.ndarray], shape: tuple[int, int]) -> np.ndarray:
  """The inverse of :func:`coefficients`."""
  blocks, c1, c2 = tile_blocks(shape)
  out = np.zeros(shape)
  for b, c in zip(blocks, tiles):
    out[b] = dct_matrix(c1).T @ c.reshape(c1, c2) @ dct_matrix(c2)
  return out


def top_mask(c: np.ndarray) -> np.ndarray:
  """The ``topk`` largest magnitudes of one tile (all of it when it is smaller)."""
  mask = np.zeros(c.shape, bool)
  mask[np.argsort(-np.abs(c), kind="stable")[:TOPK]] = True
  return mask


def reference_step(delta: np.ndarray, grad: np.ndarray, lr: float):
  """One DeMo step of one leaf on every worker (``[N, ...]``, float64): (decoded mean before
  the sign, new momenta, the momenta before extraction)."""
  shape = as_matrix(delta[0]).shape
  before = BETA * delta + lr * grad
  totals = counts = 0.0
  after = np.empty_like(before)
  for i in range(N):
    tiles = coefficients(as_matrix(before[i]))
    kept = [np.where(top_mask(c), c, 0.0) for c in tiles]
    after[i] = before[i] - decode(kept, shape).reshape(before[i].shape)
    totals = totals + np.stack(kept)
    counts = counts + np.stack([top_mask(c) for c in tiles])
  # The reference's scatter_reduce mean: over the workers that sent each coefficient.
  mean = list(totals / np.maximum(counts, 1))
  return decode(mean, shape).reshape(delta.shape[1:]), after, before


def normal(seed: int, leading: tuple[int, ...] = ()) -> dict[str, np.ndarray]:
  """Float32 standard normals for every leaf of :data:`SHAPES` (numpy: JAX's eager random
  draws compile once per shape, seconds on two cores)."""
  rng = np.random.default_rng(seed)
  return {name: rng.standard_normal(leading + shape).astype(np.float32)
          for name, shape in SHAPES.items()}


@functools.lru_cache(maxsize=None)
def shard_map_run(weight_decay: float = 0.0):
  """Three steps of DeMo on 8 workers under shard_map: per step the gradients, the updates
  and the state after it."""
  params = normal(1)
  tx = compressors.demo(schedule, axis_name="data", weight_decay=weight_decay)
  state, update = harness.shard_map_update(tx, harness.mesh(), params)
  log = []
  for step in range(3):
    grads = normal(10 + step, (N,))
    updates, state = update(params, state, grads)
    log.append((grads, updates, state))
  return params, log


def test_matches_the_numpy_replay_over_three_steps_with_a_schedule_and_weight_decay():
  wd = 0.1
  params, log = shard_map_run(weight_decay=wd)
  deltas = {name: np.zeros((N,) + shape) for name, shape in SHAPES.items()}
  for step, (grads, updates, state) in enumerate(log):
    lr = schedule(step)
    for name in SHAPES:
      p = np.asarray(params[name], np.float64)
      grad = np.asarray(grads[name], np.float64)
      mean, deltas[name], _ = reference_step(deltas[name], grad, lr)
      got = -(np.asarray(updates[name], np.float64) + lr * wd * p) / lr
      np.testing.assert_allclose(got, np.round(got), atol=1e-5)  # signs, nothing else
      decided = np.abs(mean) > 1e-5 * np.abs(mean).max()  # not at rounding level
      assert decided.mean() > 0.99
      np.testing.assert_array_equal(np.round(got)[decided], np.sign(mean[decided]), err_msg=name)
      np.testing.assert_allclose(np.asarray(state.delta[name]), deltas[name], rtol=1e-4,
                                 atol=1e-5 * np.abs(deltas[name]).max() + 1e-12, err_msg=name)
    assert int(state.count) == step + 1


def test_nothing_is_lost_what_leaves_the_momentum_is_the_top_coefficients():
  _, log = shard_map_run()
  previous = {name: np.zeros((N,) + shape) for name, shape in SHAPES.items()}
  for step, (grads, _, state) in enumerate(log):
    for name, shape in SHAPES.items():
      before = BETA * previous[name] + schedule(step) * np.asarray(grads[name], np.float64)
      after = np.asarray(state.delta[name], np.float64)
      if name in WHOLE:
        np.testing.assert_array_equal(after, 0.0)  # sent whole: nothing stays behind
      for i in range(N):
        tiles = coefficients(as_matrix(before[i]))
        kept = [np.where(top_mask(c), c, 0.0) for c in tiles]
        sent = decode(kept, as_matrix(before[i]).shape).reshape(shape)
        scale = np.abs(before[i]).max()
        np.testing.assert_allclose(sent + after[i], before[i], rtol=0, atol=2e-6 * scale,
                                   err_msg=f"{name} worker {i} step {step}")
      previous[name] = after


def test_replicas_are_bit_identical():
  _, log = shard_map_run()
  for _, updates, state in log:
    harness.assert_replicas_identical(updates)
    harness.assert_replicas_identical(state.count)


def test_pmap_gives_shard_maps_bits():
  params, log = shard_map_run()
  tx = compressors.demo(schedule, axis_name="data")
  init, update = harness.pmap_update(tx)
  replicated = jax.tree.map(lambda x: jnp.broadcast_to(x, (N,) + x.shape), params)
  state = init(replicated)
  for grads, expected, expected_state in log:
    updates, state = update(replicated, state, grads)
    for name in SHAPES:
      for row in np.asarray(updates[name]):
        assert row.tobytes() == np.asarray(expected[name]).tobytes(), name
      assert (np.asarray(state.delta[name]).tobytes()
              == np.asarray(expected_state.delta[name]).tobytes()), name


def test_vmap_and_a_tuple_of_mesh_axes_give_the_same_updates():
  params, log = shard_map_run()
  grads, expected, _ = log[0]
  tx = compressors.demo(schedule, axis_name="w")
  updates = jax.jit(jax.vmap(lambda g: tx.update(g, tx.init(params))[0], axis_name="w"))(grads)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:N]).reshape(2, 4), ("node", "gpu"))
  tx2 = compressors.demo(schedule, axis_name=("node", "gpu"))

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=P(("node", "gpu")), out_specs=P())
  def two_axes(grads):
    return tx2.update(jax.tree.map(lambda g: g[0], grads), tx2.init(params))[0]

  meshed = two_axes(grads)
  for name in SHAPES:
    np.testing.assert_array_equal(updates[name][0], expected[name])
    np.testing.assert_array_equal(meshed[name], expected[name])


def test_one_worker_without_an_axis_steps_by_the_sign_of_what_it_sent():
  params = {"w": jnp.zeros((96, 40))}
  g = {"w": jax.random.normal(jax.random.PRNGKey(0), (96, 40))}
  tx = compressors.demo(0.1, axis_name=None)
  updates, state = jax.jit(tx.update)(g, tx.init(params))
  sent = 0.1 * np.asarray(g["w"], np.float64) - np.asarray(state.delta["w"])
  decided = np.abs(sent) > 1e-5 * np.abs(sent).max()
  np.testing.assert_array_equal(np.asarray(updates["w"])[decided] / -0.1,
                                np.sign(sent[decided]))


def test_compiled_bytes_match_the_cost_model_and_only_all_gathers_run():
  params = {"w": jax.ShapeDtypeStruct((200, 200), jnp.float32),
            "b": jax.ShapeDtypeStruct((200,), jnp.float32)}
  measured = harness.update_bytes(compressors.demo(0.01, axis_name="data"), params,
                                  harness.mesh())
  modelled = registry.cost("demo", [(200, 200), (200,)],
                           topology_lib.Topology.flat(N, topology_lib.CLOUD_10G))
  assert abs(measured.total - modelled.bytes_sent) <= 0.05 * modelled.bytes_sent
  assert measured.by_kind.get("all-gather", 0) > 0
  assert not [c for c in measured.collectives if c.kind == "all-reduce" and c.size_bytes >= 800]
  # 50 x 50 tiles: positions up to 2499 travel as uint16.
  assert any("u16" in c.dtypes for c in measured.collectives)
  dense = registry.cost("dense", [(200, 200), (200,)],
                        topology_lib.Topology.flat(N, topology_lib.CLOUD_10G))
  assert modelled.bytes_sent < dense.bytes_sent / 5


def test_registered_as_its_own_optimizer():
  method = registry.get("demo")
  assert method.family == "optimizer" and method.budget == "topk"
  assert not method.error_feedback
  tx = method.optimizer(method.settings(), 0.01, axis_name="data", seed=0)
  assert isinstance(tx.init({"w": jnp.zeros((4, 4))}), compressors.DemoState)
  # More coefficients per tile cost more bytes (what the equal-bytes solver relies on).
  topology = topology_lib.Topology.flat(N, topology_lib.CLOUD_10G)
  costs = [registry.cost("demo", [(256, 256)], topology, registry.default_settings(
      "demo", topk=k)).bytes_sent for k in (8, 32, 128)]
  assert costs == sorted(costs) and costs[0] < costs[-1]


@pytest.mark.parametrize("field,value", [
    ("momentum_decay", 1.0), ("momentum_decay", -0.1), ("chunk", 0), ("topk", 0),
    ("weight_decay", -1e-3)])
def test_bad_settings_raise_naming_the_field(field, value):
  with pytest.raises(ValueError, match=field):
    registry.default_settings("demo", **{field: value})
  with pytest.raises(ValueError, match=field):
    compressors.demo(0.1, axis_name="data", **{field: value})


def test_bad_learning_rate_and_missing_params_raise():
  with pytest.raises(ValueError, match="learning_rate"):
    compressors.demo(-0.1, axis_name="data")
  tx = compressors.demo(0.1, axis_name=None, weight_decay=0.1)
  params = {"w": jnp.zeros((4, 4))}
  with pytest.raises(ValueError, match="weight_decay"):
    tx.update(params, tx.init(params))
