"""compressors.parallel.workers: simulated workers (shard_map over devices x vmap over workers) give every
collective the values of as many devices, rank for rank."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import compressors
from compressors.network import axes
from compressors.network import collectives
from tests import harness

pytestmark = pytest.mark.usefixtures("fast_compiles")

N = 8
LAYOUTS = [(N, 1), (2, N // 2), (1, N)]


def _on_workers(fn, x, num_devices, per_device):
  """``fn(row)`` on each of N workers laid out as ``num_devices x per_device``; ``x`` has one
  row per worker; returns one output row per worker."""
  mesh = harness.mesh(num_devices)
  axis = "data" if per_device == 1 else ("data", "worker")
  workers = compressors.Workers.on(mesh, axis, per_device)
  body = workers.each(functools.partial(fn, axis_name=axis), 0, 0)
  return np.asarray(jax.jit(jax.shard_map(body, mesh=mesh, in_specs=workers.spec,
                                          out_specs=workers.spec, check_vma=False))(x))


COLLECTIVES = {
    "all_gather": lambda x, axis_name: axes.all_gather(x, axis_name),
    "all_gather_invariant": lambda x, axis_name: axes.all_gather_invariant(x, axis_name),
    "ring_ppermute": lambda x, axis_name: axes.ppermute(
        x, axis_name, collectives.ring_pairs(N)),
    "partial_ppermute": lambda x, axis_name: axes.ppermute(x, axis_name, [(0, 5), (6, 1)]),
    "psum_scatter": lambda x, axis_name: axes.psum_scatter(x, axis_name),
    "psum": lambda x, axis_name: jax.lax.psum(x, axis_name),
    "all_to_all": lambda x, axis_name: jax.lax.all_to_all(x, axis_name, 0, 0, tiled=True),
    "rank": lambda x, axis_name: x * 0 + axes.worker_index(axis_name),
    "ring_all_reduce": lambda x, axis_name: collectives.ring_all_reduce(x, axis_name),
    "butterfly_all_reduce": lambda x, axis_name: collectives.butterfly_all_reduce(x, axis_name),
    "rabenseifner_all_reduce": lambda x, axis_name: collectives.rabenseifner_all_reduce(
        x, axis_name),
}


@pytest.mark.parametrize("name", COLLECTIVES)
def test_every_collective_gives_simulated_workers_the_devices_values(name):
  x = jax.random.randint(jax.random.PRNGKey(0), (N, 16), -100, 100).astype(jnp.float32)
  results = [_on_workers(COLLECTIVES[name], x, *layout) for layout in LAYOUTS]
  for layout, result in zip(LAYOUTS[1:], results[1:]):
    np.testing.assert_array_equal(result, results[0], err_msg=f"{name} on {layout}")
  if name == "rank":
    np.testing.assert_array_equal(results[0][:, 0], np.arange(N))


def test_one_worker_per_device_indexes_the_row_away_and_back():
  workers = compressors.Workers.on(harness.mesh(1), "data")
  each = workers.each(lambda a, b: (a + b, b * 2), (0, None), (0, None))
  out = each(jnp.ones((1, 3)), jnp.full((3,), 2.0))
  assert out[0].shape == (1, 3) and out[1].shape == (3,)
  np.testing.assert_array_equal(out[0], 3.0)


def test_layout_and_equivalent_mesh():
  workers = compressors.Workers.on(harness.mesh(2), ("data", "worker"), 4)
  assert (workers.count, workers.simulated_axis, workers.device_axes) == (8, "worker",
                                                                          ("data",))
  assert workers.spec == P("data")
  assert workers.layout({"e": P(("data", "worker")), "count": P()}) == {"e": P("data"),
                                                                       "count": P()}
  equivalent = workers.equivalent_mesh()
  assert dict(equivalent.shape) == {"data": 2, "worker": 4}
  assert equivalent.devices.size == 8
  assert dict(workers.equivalent_mesh(abstract=True).shape) == {"data": 2, "worker": 4}
  too_many = compressors.Workers.on(harness.mesh(2), ("data", "worker"), 8)
  with pytest.raises(ValueError, match=r"the bytes of 16 workers .* the CPU backend exposes 8: "
                                       r"call jax.config.update\('jax_num_cpu_devices', 16\)"):
    too_many.equivalent_mesh()
