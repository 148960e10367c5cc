"""Explicit all-reduce schedules: exact sums, bit-identical replicas, and HLO bytes that match
the cost model's byte term."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import compressors
from compressors.network import collectives
from compressors.network import topology
from tests import harness

pytestmark = pytest.mark.usefixtures("fast_compiles")

WORKER_COUNTS = (2, 3, 4, 5, 8)
FLAT_SCHEDULES = ("psum", "ring", "butterfly", "rabenseifner")
INT_SHAPE, FLOAT_SHAPE = (7, 3), (13,)  # 21 and 13 elements: padding for every p


def _mesh(shape, names):
  return Mesh(np.array(jax.devices()[:int(np.prod(shape))]).reshape(shape), names)


def _per_device(fn, mesh, axis, num_inputs):
  """jit(shard_map(fn)) over one leading device axis per input and output."""
  body = lambda *xs: tuple(y[None] for y in fn(*(x[0] for x in xs)))
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(axis),) * num_inputs,
                               out_specs=P(axis)))


def _assert_bit_identical(rows: np.ndarray):
  bits = np.ascontiguousarray(rows).view(np.uint8).reshape(rows.shape[0], -1)
  assert (bits == bits[0]).all(), "replicas differ"


def _inputs(p, seed=0):
  rng = np.random.default_rng(seed)
  ints = rng.integers(-1000, 1000, (p,) + INT_SHAPE).astype(np.int32)
  floats = rng.standard_normal((p,) + FLOAT_SHAPE).astype(np.float32) * 10.0 ** rng.integers(
      -3, 4, (p,) + FLOAT_SHAPE)
  return ints, floats


def _reassociation_bound(floats):
  """Worst-case float32 rounding of any summation order of the workers' values."""
  return np.finfo(np.float32).eps * len(floats) * np.abs(floats).astype(np.float64).sum(0)


def _check_sums(out_int, out_float, ints, floats):
  out_int, out_float = np.asarray(out_int), np.asarray(out_float)
  np.testing.assert_array_equal(out_int, np.broadcast_to(ints.sum(0), out_int.shape))
  reference = floats.astype(np.float64).sum(0)
  assert (np.abs(out_float - reference) <= _reassociation_bound(floats)).all()
  _assert_bit_identical(out_int)
  _assert_bit_identical(out_float)


@pytest.mark.parametrize("p", WORKER_COUNTS)
@pytest.mark.parametrize("schedule", FLAT_SCHEDULES)
def test_flat_schedule_sums_and_wire_bytes(schedule, p):
  mesh = _mesh((p,), ("x",))
  fn = _per_device(lambda a, b: (collectives.all_reduce(a, "x", schedule),
                                 collectives.all_reduce(b, "x", schedule)), mesh, "x", 2)
  ints, floats = _inputs(p)
  out_int, out_float = fn(ints, floats)
  assert out_int.shape == ints.shape and out_float.shape == floats.shape
  _check_sums(out_int, out_float, ints, floats)
  (psum_float,) = _per_device(lambda b: (jax.lax.psum(b, "x"),), mesh, "x", 1)(floats)
  assert (np.abs(out_float - psum_float) <= 2 * _reassociation_bound(floats)).all()

  report = compressors.wire_bytes(fn, ints, floats)
  flat = topology.Topology.flat(p, topology.Link(1e-6, 1e9))
  expected = sum(topology.dense_cost(schedule, flat, int(np.prod(s)), 4).bytes_sent
                 for s in (INT_SHAPE, FLOAT_SHAPE))
  assert report.total == pytest.approx(expected, rel=1e-12)
  if schedule != "psum":  # unrolled: one collective-permute per step, no while loop
    steps = sum(len(collectives.SCHEDULES[schedule].steps((p,), int(np.prod(s)), 4))
                for s in (INT_SHAPE, FLOAT_SHAPE))
    assert [c.kind for c in report.collectives] == ["collective-permute"] * steps
    assert "while" not in fn.lower(ints, floats).compile().as_text()


@pytest.mark.parametrize("shape", [(2, 2), (2, 3), (3, 2), (2, 4), (4, 2)])
def test_hierarchical_sums_and_wire_bytes(shape):
  mesh = _mesh(shape, ("node", "gpu"))
  axis = ("node", "gpu")
  fn = _per_device(lambda a, b: (collectives.all_reduce(a, axis, "hierarchical"),
                                 collectives.all_reduce(b, axis, "hierarchical")), mesh, axis, 2)
  ints, floats = _inputs(int(np.prod(shape)), seed=1)
  _check_sums(*fn(ints, floats), ints, floats)

  report = compressors.wire_bytes(fn, ints, floats, mesh=mesh)
  link = topology.Link(1e-6, 1e9)
  two_level = topology.Topology((topology.Axis("node", shape[0], link),
                                 topology.Axis("gpu", shape[1], link)))
  expected = sum(topology.dense_cost("hierarchical", two_level, int(np.prod(s)), 4).bytes_sent
                 for s in (INT_SHAPE, FLOAT_SHAPE))
  assert report.total == pytest.approx(expected, rel=1e-12)
  assert set(report.by_axis) == {("gpu",), ("node",)}  # RS/AG inside a node, AR across


def _sparse_input(p, size, k, rng, dtype):
  indices = np.stack([rng.choice(size, k, replace=False) for _ in range(p)]).astype(np.int32)
  indices[:, -1] = size  # one empty slot per worker: its value must be ignored
  values = (rng.integers(-100, 100, (p, k)) if dtype == np.int32 else
            rng.standard_normal((p, k))).astype(dtype)
  dense = np.stack([np.bincount(i[:-1], v[:-1], size) for i, v in zip(indices, values)])
  return indices, values, dense.astype(dtype)


@pytest.mark.parametrize("p", WORKER_COUNTS)
@pytest.mark.parametrize("switch_density", [None, 0.05, 1.0])
def test_sparse_butterfly_sums_and_wire_bytes(p, switch_density):
  size, k = 20, 3
  phases = collectives.sparse_butterfly_phases(
      p, size, k, switch_density or collectives.default_switch_density(4))
  mesh = _mesh((p,), ("x",))
  run = lambda i, v: collectives.sparse_butterfly_all_reduce(
      i, v, size, "x", switch_density=switch_density)
  fn = _per_device(lambda i, a, j, b: (run(i, a), run(j, b)), mesh, "x", 4)
  rng = np.random.default_rng(p)
  int_indices, ints, dense_ints = _sparse_input(p, size, k, rng, np.int32)
  float_indices, floats, dense_floats = _sparse_input(p, size, k, rng, np.float32)
  args = (int_indices, ints, float_indices, floats)
  _check_sums(*fn(*args), dense_ints, dense_floats)

  report = compressors.wire_bytes(fn, *args)
  flat = topology.Topology.flat(p, topology.Link(1e-6, 1e9))
  cost = topology.sparse_butterfly_cost(flat, size, k, 4, switch_density=switch_density)
  assert report.total == pytest.approx(2 * cost.bytes_sent, rel=1e-12)
  if p == 8 and switch_density is None:  # this case sends sparse first, then dense
    assert {ph.capacity is None for ph in phases} == {True, False}


def test_sparse_butterfly_never_drops_overlapping_entries():
  """Identical supports on every worker: each merge meets every index twice."""
  p, size, k = 8, 64, 5
  mesh = _mesh((p,), ("x",))
  fn = _per_device(lambda i, v: (collectives.sparse_butterfly_all_reduce(
      i, v, size, "x", switch_density=1.0),), mesh, "x", 2)
  indices = np.tile(np.array([3, 9, 10, 40, 63], np.int32), (p, 1))
  values = np.arange(p * k, dtype=np.int32).reshape(p, k)
  (out,) = fn(indices, values)
  expected = np.zeros(size, np.int64)
  np.add.at(expected, indices[0], values.sum(0))
  np.testing.assert_array_equal(np.asarray(out), np.broadcast_to(expected, (p, size)))


def test_all_reduce_keeps_shape_and_dtype_of_scalars_and_empty_arrays():
  # One program each: JAX 0.11 crashes (segfault) when a zero-element array leaves shard_map
  # beside another output, whatever the program does (compressors.compress refuses such leaves
  # there).
  mesh = _mesh((3,), ("x",))
  ring = _per_device(lambda a: (collectives.all_reduce(a, "x", "ring"),), mesh, "x", 1)
  butterfly = _per_device(lambda b: (collectives.all_reduce(b, "x", "butterfly"),), mesh, "x", 1)
  (out_scalar,) = ring(np.arange(3, dtype=np.int32))
  (out_empty,) = butterfly(np.zeros((3, 0, 2), np.float32))
  np.testing.assert_array_equal(out_scalar, [3, 3, 3])
  assert out_empty.shape == (3, 0, 2) and out_scalar.dtype == jnp.int32


def test_unknown_schedule_names_the_allowed_ones():
  with pytest.raises(ValueError, match=r"schedule='tree'.*'ring'.*'rabenseifner'"):
    collectives.all_reduce(jnp.ones(3), "x", "tree")
  with pytest.raises(ValueError, match="schedule='tree'"):
    collectives.check_schedule("tree")


def test_hierarchical_needs_two_axes():
  mesh = _mesh((2,), ("x",))
  fn = _per_device(lambda a: (collectives.all_reduce(a, "x", "hierarchical"),), mesh, "x", 1)
  with pytest.raises(ValueError, match=r"hierarchical.*needs 2 mesh axes.*'x'"):
    fn(np.ones((2, 3), np.float32))


def test_sparse_butterfly_rejects_bad_input():
  with pytest.raises(ValueError, match="equal length"):
    collectives.sparse_butterfly_all_reduce(jnp.zeros(3, jnp.int32), jnp.zeros(4), 10, "x")
  with pytest.raises(ValueError, match=r"switch_density=1.5"):
    collectives.sparse_butterfly_all_reduce(jnp.zeros(3, jnp.int32), jnp.zeros(3), 10, "x",
                                            switch_density=1.5)


def test_unbound_axis_names_the_bound_ones():
  mesh = _mesh((2,), ("x",))
  fn = _per_device(lambda a: (collectives.all_reduce(a, "data", "ring"),), mesh, "x", 1)
  with pytest.raises(NameError, match=r"'data'.*\['x'\]"):
    fn(np.ones((2, 3), np.float32))


@pytest.mark.parametrize("schedule", ["ring", "butterfly", "rabenseifner"])
def test_compress_runs_its_sum_through_the_schedule(schedule):
  """compressors.compress(..., schedule=...) all-reduces summable payloads with our schedules.

  ppermute results are typed as varying across the axis, so a replicated out_spec needs
  check_vma=False (the test checks the replicas' bits instead).
  """
  p = 5
  mesh = harness.mesh(p)
  params = {"w": jnp.zeros((7, 3)), "b": jnp.zeros((4,))}
  tx = compressors.compress(compressors.dense(), axis_name="data", schedule=schedule)
  specs = compressors.state_specs(tx, params, mesh, "data", check_updates=False)
  state = jax.jit(jax.shard_map(lambda q: compressors.add_device_axis(tx.init(q), specs),
                                mesh=mesh,
                                in_specs=P(), out_specs=specs))(params)

  def step(params, state, grads):
    mean, state = tx.update(jax.tree.map(lambda g: g[0], grads),
                            compressors.drop_device_axis(state, specs), params)
    return mean, compressors.add_device_axis(state, specs)

  update = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P("data")),
                                 out_specs=(P(), specs), check_vma=False))
  grads = harness.per_worker_grads(jax.random.PRNGKey(0), p, params)
  mean, _ = update(params, state, grads)
  harness.assert_replicas_identical(mean)
  for name, g in grads.items():
    np.testing.assert_allclose(mean[name], np.asarray(g, np.float64).mean(0), rtol=1e-5,
                               atol=1e-6)
  report = compressors.wire_bytes(update, params, state, grads)
  flat = topology.Topology.flat(p, topology.Link(1e-6, 1e9))
  expected = topology.dense_cost(schedule, flat, 7 * 3 + 4).bytes_sent  # one fused buffer
  assert report.by_kind == {"collective-permute": pytest.approx(expected, rel=1e-12)}
