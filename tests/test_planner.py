"""The planner's integer program against brute force, its choices on textbook regimes, and its
errors."""

import itertools

import numpy as np
import pytest

from compressors.network import planner
from compressors.network import topology

DENSITIES = (1.0, 0.1, 0.01, 0.001)


def _random_buckets(rng, count):
  """Buckets of 1e2..1e7 elements with random concave importance profiles."""
  buckets = []
  for i in range(count):
    weight, exponent = rng.uniform(0.1, 10), rng.uniform(0.05, 1.0)
    buckets.append(planner.Bucket(f"b{i}", int(10 ** rng.uniform(2, 7)),
                                  {d: weight * d ** exponent for d in DENSITIES}))
  return buckets


def _brute_force(time, retained, *, budget=None, need=None):
  """Best (primary, secondary) objective over every combination of one option per bucket."""
  best = None
  for combo in itertools.product(range(time.shape[1]), repeat=time.shape[0]):
    t = sum(time[i, o] for i, o in enumerate(combo))
    r = sum(retained[i, o] for i, o in enumerate(combo))
    if (budget is not None and t > budget) or (need is not None and r < need):
      continue
    key = (-r, t) if budget is not None else (t, -r)
    best = key if best is None or key < best else best
  return best


# (buckets, algorithms, densities): at most 6 buckets x 4 algorithms x 4 densities, with few
# enough combinations to enumerate.
INSTANCES = [(1, 4, 4), (2, 4, 4), (3, 4, 4), (4, 4, 4), (4, 4, 2), (5, 2, 2), (6, 1, 4),
             (6, 2, 2)]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("num_buckets, num_algorithms, num_densities", INSTANCES)
@pytest.mark.parametrize("mode", ["time_budget", "min_importance"])
def test_integer_program_equals_brute_force(mode, num_buckets, num_algorithms, num_densities,
                                            seed):
  rng = np.random.default_rng(1000 * seed + 10 * num_buckets + num_algorithms)
  topo = topology.v100_nvlink_25gbe(nodes=int(rng.integers(2, 4)))
  algorithms = tuple(rng.choice(["ring", "butterfly", "rabenseifner", "hierarchical"],
                                num_algorithms, replace=False))
  densities = tuple(sorted(rng.choice(DENSITIES, num_densities, replace=False), reverse=True))
  buckets = _random_buckets(rng, num_buckets)
  _, time, _, retained = planner.option_table(buckets, topo, algorithms, densities)
  fraction = rng.uniform(0.2, 0.9)
  if mode == "time_budget":
    budget = time.min(1).sum() + fraction * (time.max(1).sum() - time.min(1).sum())
    result = planner.plan(buckets, topo, time_budget=budget, algorithms=algorithms,
                          densities=densities)
    best_retained, best_time = _brute_force(time, retained, budget=budget)
    assert result.time <= budget * (1 + 1e-9)
    assert result.retained == pytest.approx(-best_retained, rel=1e-6)
    assert result.time == pytest.approx(best_time, rel=1e-6)
  else:
    total = sum(b.retained(1.0) for b in buckets)
    need_fraction = fraction * retained.max(1).sum() / total
    result = planner.plan(buckets, topo, min_importance=need_fraction, algorithms=algorithms,
                          densities=densities)
    best_time, best_retained = _brute_force(time, retained, need=need_fraction * total)
    assert result.retained >= need_fraction * total * (1 - 1e-9)
    assert result.time == pytest.approx(best_time, rel=1e-6)
    assert result.retained == pytest.approx(-best_retained, rel=1e-6)


def _dense_choice(topo, size):
  bucket = planner.Bucket("b", size, lambda d: d)
  return planner.plan([bucket], topo, min_importance=1.0, densities=(1.0,)).choices[0].algorithm


def test_ring_for_large_dense_buckets_butterfly_for_small_ones():
  cloud = topology.cloud_10gbe(nodes=6)  # 6 VMs: Rabenseifner needs a fold-in here
  assert _dense_choice(cloud, 10**7) == "ring"
  assert _dense_choice(cloud, 100) == "butterfly"
  flat = topology.Topology.flat(8, topology.CLOUD_10G)
  ring_vs_butterfly = dict(algorithms=("ring", "butterfly"), densities=(1.0,), min_importance=1)
  choose = lambda size: planner.plan([planner.Bucket("b", size, lambda d: d)], flat,
                                     **ring_vs_butterfly).choices[0].algorithm
  assert [choose(s) for s in (100, 10**3, 10**6, 10**7)] == [
      "butterfly", "butterfly", "ring", "ring"]


@pytest.mark.parametrize("nodes", [2, 3])
def test_hierarchical_when_the_inter_node_link_dominates(nodes):
  topo = topology.v100_nvlink_25gbe(nodes=nodes)
  algorithms = ("ring", "butterfly", "hierarchical") + (("rabenseifner",) if nodes == 3 else ())
  bucket = planner.Bucket("b", 10**7, lambda d: d)
  chosen = planner.plan([bucket], topo, min_importance=1.0, densities=(1.0,),
                        algorithms=algorithms).choices[0]
  assert chosen.algorithm == "hierarchical"
  # With NVLink-speed links between nodes, the flat ring is as good: nothing to exploit.
  uniform = topology.Topology((topology.Axis("node", nodes, topology.NVLINK2),
                               topology.Axis("gpu", 8, topology.NVLINK2)))
  flat_ring = topology.dense_cost("ring", uniform, 10**7).time
  hierarchical = topology.dense_cost("hierarchical", uniform, 10**7).time
  assert flat_ring < 1.5 * hierarchical
  assert topology.dense_cost("ring", topo, 10**7).time > 1.25 * chosen.time


def test_budget_trades_density_for_time_and_prints_a_table():
  topo = topology.v100_nvlink_25gbe(nodes=2)
  buckets = [planner.Bucket("embedding", 4 * 10**6, lambda d: 5 * d ** 0.2),
             planner.Bucket("conv", 2 * 10**6, lambda d: 3 * d ** 0.5),
             planner.Bucket("head", 1000, lambda d: 1 * d)]
  loose = planner.plan(buckets, topo, time_budget=1.0)
  tight = planner.plan(buckets, topo, time_budget=1e-3)
  assert all(c.density == 1.0 for c in loose.choices)
  assert loose.retained == pytest.approx(loose.total_importance)
  assert tight.time <= 1e-3 < loose.time and tight.retained < loose.retained
  table = str(tight)
  for word in ("bucket", "algorithm", "density", "embedding", "conv", "head", "total"):
    assert word in table


def test_infeasible_budget_names_the_fastest_plan():
  topo = topology.v100_nvlink_25gbe(nodes=2)
  buckets = [planner.Bucket("b", 10**6, lambda d: d)]
  fastest = min(topology.collective_cost(a, topo, 10**6, d).time
                for a in planner.default_algorithms(topo) for d in planner.DEFAULT_DENSITIES)
  with pytest.raises(ValueError, match=(r"no plan meets the time budget 0.001 ms: the fastest plan "
                                        rf"needs {fastest * 1e3:.4g} ms")):
    planner.plan(buckets, topo, time_budget=1e-6)


def test_infeasible_importance_names_the_best_reachable():
  topo = topology.v100_nvlink_25gbe(nodes=2)
  buckets = [planner.Bucket("b", 10**6, lambda d: d)]
  with pytest.raises(ValueError, match=r"no plan retains 0.5 of the importance: the most any "
                                       r"plan keeps is 0.1 "):
    planner.plan(buckets, topo, min_importance=0.5, densities=(0.1, 0.01))


@pytest.mark.parametrize("kwargs, match", [
    (dict(), "exactly one of time_budget"),
    (dict(time_budget=1.0, min_importance=0.5), "exactly one of time_budget"),
    (dict(time_budget=-1.0), r"time_budget=-1.0 must be a positive"),
    (dict(min_importance=1.5), r"min_importance=1.5 must lie in \[0, 1\]"),
    (dict(min_importance=0.5, algorithms=("tree",)), r"\['tree'\] unknown"),
    (dict(min_importance=0.5, densities=(0.0, 0.5)), r"densities \[0.0\] invalid"),
    # Top-k's all-gather is a method of its own, not a schedule compress(schedule=plan) runs.
    (dict(min_importance=0.5, algorithms=("topk_allgather",), densities=(1.0,)),
     r"\['topk_allgather'\] unknown.*schedules compress runs"),
])
def test_bad_arguments(kwargs, match):
  with pytest.raises(ValueError, match=match):
    planner.plan([planner.Bucket("b", 100, lambda d: d)], topology.v100_nvlink_25gbe(), **kwargs)


def test_bad_buckets():
  with pytest.raises(ValueError, match=r"size=0"):
    planner.Bucket("b", 0, lambda d: d)
  with pytest.raises(ValueError, match=r"no entry for density 0.01"):
    planner.plan([planner.Bucket("b", 100, {1.0: 1.0, 0.1: 0.5})], topology.cloud_10gbe(),
                 min_importance=0.5, densities=(1.0, 0.01))
  with pytest.raises(ValueError, match=r"importance\(0.1\) = -1.0"):
    planner.plan([planner.Bucket("b", 100, lambda d: -1.0 if d < 1 else 1.0)],
                 topology.cloud_10gbe(), min_importance=0.5, densities=(1.0, 0.1))
