"""compress(schedule=...): explicit algorithms, the cost model's choice, and a planner's plan."""

import functools

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import compressors
import tasc
from compressors.network import planner
from compressors.network import topology as topo
from tests import harness

pytestmark = pytest.mark.usefixtures("fast_compiles")

N = 8


def _mean(tx, grads):
  mesh = harness.mesh()
  params = jax.tree.map(lambda g: g[0], grads)

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=P("data"), out_specs=P(),
                     check_vma=False)  # explicit schedules come out of ppermute: typed varying
  def step(g):
    g = jax.tree.map(lambda x: x[0], g)
    return tx.update(g, tx.init(params), params)[0]

  return step(grads), compressors.wire_bytes(step, grads)


def _grads():
  return {"w": jax.random.normal(jax.random.PRNGKey(0), (N, 4096))}


@pytest.mark.parametrize("schedule", ["ring", "butterfly", "rabenseifner"])
def test_explicit_schedule_gives_the_psum_mean(schedule):
  reference, _ = _mean(compressors.compress(compressors.randomk(0.25), axis_name="data"), _grads())
  mean, report = _mean(compressors.compress(compressors.randomk(0.25), axis_name="data",
                                            schedule=schedule), _grads())
  np.testing.assert_allclose(np.asarray(mean["w"]), np.asarray(reference["w"]), rtol=1e-5,
                             atol=1e-6)
  assert set(report.by_kind) == {"collective-permute"}


def test_auto_follows_the_cost_model_per_payload_size():
  latency_bound = topo.Topology.flat(N, topo.Link(alpha=1e-3, bandwidth=1e12, gamma=0.0))
  bandwidth_bound = topo.Topology.flat(N, topo.Link(alpha=1e-9, bandwidth=1e6, gamma=0.0))
  assert topo.fastest_schedule(latency_bound, 1024) == "butterfly"
  assert topo.fastest_schedule(bandwidth_bound, 1 << 20) in ("ring", "rabenseifner")
  for topology in (latency_bound, bandwidth_bound):
    payload = int(round(0.25 * 4096))
    chosen = topo.fastest_schedule(topology, payload)
    _, auto = _mean(compressors.compress(compressors.randomk(0.25), axis_name="data",
                                         schedule="auto", topology=topology), _grads())
    _, explicit = _mean(compressors.compress(compressors.randomk(0.25), axis_name="data",
                                             schedule=chosen), _grads())
    assert auto.total == explicit.total
    assert [c.executions for c in auto.collectives] == [
        c.executions for c in explicit.collectives]


def test_a_plan_drives_tasc_per_bucket():
  topology = topo.cloud_10gbe(nodes=N)
  buckets = [planner.Bucket("model", 4096, lambda d: d ** 0.5)]
  plan = planner.plan(buckets, topology, densities=(0.125, 0.25, 1.0),
                      algorithms=("ring", "butterfly"), min_importance=0.4)
  choice = plan.choices[0]
  tx = tasc.tasc_compress(axis_name="data", density=choice.density, block_size=64,
                          sensitivity="none", schedule=plan)
  mean, report = _mean(tx, _grads())
  assert set(report.by_kind) >= {"collective-permute"}
  assert np.count_nonzero(np.asarray(mean["w"])) <= int(np.ceil(choice.density * 4096))


def test_schedule_errors_name_the_cause():
  with pytest.raises(ValueError, match="schedule='auto' needs topology="):
    compressors.compress(compressors.dense(), axis_name="data", schedule="auto")
  with pytest.raises(ValueError, match="schedule='tree' is unknown; allowed"):
    compressors.compress(compressors.dense(), axis_name="data", schedule="tree")
  wrong = topo.Topology.flat(4, topo.CLOUD_10G)
  tx = compressors.compress(compressors.dense(), axis_name="data", schedule="auto",
                            topology=wrong)
  with pytest.raises(ValueError, match="has 4 devices but axis_name='data' has 8 workers"):
    _mean(tx, _grads())
