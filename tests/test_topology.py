"""The alpha-beta-gamma cost model against the textbook formulas (Thakur, Rabenseifner & Gropp
2005), its crossover points, the shared-medium and two-level cases, and input validation."""

import math

import jax
import jax.numpy as jnp
import pytest

import compressors
from compressors.network import topology
from tests import harness

ALPHA, BANDWIDTH, GAMMA = 7e-6, 2.5e9, 3e-11
BETA = 1 / BANDWIDTH
LINK = topology.Link(ALPHA, BANDWIDTH, GAMMA, "test link")
POWERS_OF_TWO = (2, 4, 8, 16, 64)


def _flat(p, shared=False):
  return topology.Topology.flat(p, LINK, shared=shared)


def _ring_on(link, p, n_bytes):
  """Ring all-reduce of ``n_bytes`` on ``p`` workers over ``link``."""
  return (2 * (p - 1) * link.alpha + 2 * (p - 1) / p * n_bytes * link.beta
          + (p - 1) / p * n_bytes * link.gamma)


def _textbook(algorithm, p, n):
  """Time and bytes sent per device for ``n`` bytes on ``p`` (a power of two) workers."""
  lg = math.log2(p)
  return {
      "ring": (_ring_on(LINK, p, n), 2 * (p - 1) / p * n),
      "butterfly": (lg * (ALPHA + n * BETA + n * GAMMA), lg * n),
      "rabenseifner": (2 * lg * ALPHA + 2 * (p - 1) / p * n * BETA + (p - 1) / p * n * GAMMA,
                       2 * (p - 1) / p * n),
  }[algorithm]


@pytest.mark.parametrize("p", POWERS_OF_TWO)
@pytest.mark.parametrize("algorithm", ["ring", "butterfly", "rabenseifner"])
def test_dense_costs_reproduce_textbook_formulas(algorithm, p):
  n = 1024 * 1000  # elements, divisible by every p: no padding
  cost = topology.dense_cost(algorithm, _flat(p), n, itemsize=4)
  time, sent = _textbook(algorithm, p, 4 * n)
  assert cost.time == pytest.approx(time, rel=1e-12)
  assert cost.bytes_sent == pytest.approx(sent, rel=1e-12)


@pytest.mark.parametrize("p", (2, 3, 5, 8))
def test_psum_is_an_unpadded_ring_and_matches_the_wire_bytes_rule(p):
  n = 1001
  cost = topology.dense_cost("psum", _flat(p), n, itemsize=4)
  assert cost.bytes_sent == pytest.approx(2 * (p - 1) / p * 4 * n, rel=1e-12)
  assert cost.time == pytest.approx(_ring_on(LINK, p, 4 * n), rel=1e-12)


@pytest.mark.parametrize("p", (3, 5, 6, 7))
def test_non_power_of_two_costs(p):
  """Ring pads to a multiple of p; butterfly and Rabenseifner add a fold-in and a fold-out of
  the whole vector, sent by the p - q extra ranks only."""
  n, q = 1001, 2 ** int(math.log2(p))
  lg, extra = math.log2(q), p - q
  padded = 4 * math.ceil(n / p) * p
  ring = topology.dense_cost("ring", _flat(p), n)
  assert ring.time == pytest.approx(_textbook("ring", p, padded)[0], rel=1e-12)
  assert ring.bytes_sent == pytest.approx(2 * (p - 1) / p * padded, rel=1e-12)

  vector = 4 * n
  butterfly = topology.dense_cost("butterfly", _flat(p), n)
  assert butterfly.time == pytest.approx(
      (lg + 2) * (ALPHA + vector * BETA) + (lg + 1) * vector * GAMMA, rel=1e-12)
  assert butterfly.bytes_sent == pytest.approx((2 * extra + lg * q) / p * vector, rel=1e-12)

  vector = 4 * math.ceil(n / q) * q
  rabenseifner = topology.dense_cost("rabenseifner", _flat(p), n)
  assert rabenseifner.time == pytest.approx(
      (2 * lg + 2) * ALPHA + (2 * (q - 1) / q + 2) * vector * BETA
      + ((q - 1) / q + 1) * vector * GAMMA, rel=1e-12)
  assert rabenseifner.bytes_sent == pytest.approx(
      (2 * extra + 2 * (q - 1)) / p * vector, rel=1e-12)


@pytest.mark.parametrize("p", (4, 8, 32))
def test_ring_butterfly_crossover_where_alpha_and_beta_terms_balance(p):
  """ring(n) = butterfly(n) at n* = (2(p-1) - lg p) alpha / (lg p (beta + gamma) -
  (p-1)/p (2 beta + gamma)); butterfly is faster below, ring above."""
  lg = math.log2(p)
  crossover = (2 * (p - 1) - lg) * ALPHA / (lg * (BETA + GAMMA) - (p - 1) / p * (2 * BETA + GAMMA))
  ring, butterfly = (_textbook(a, p, crossover)[0] for a in ("ring", "butterfly"))
  assert ring == pytest.approx(butterfly)
  for factor, faster in ((0.9, "butterfly"), (1.1, "ring")):
    n = int(crossover * factor / 4 / p) * p  # elements, a multiple of p
    times = {a: topology.dense_cost(a, _flat(p), n).time for a in ("ring", "butterfly")}
    assert min(times, key=times.get) == faster, (factor, times)


@pytest.mark.parametrize("p", (2, 8, 16))
def test_topk_allgather_and_shared_support(p):
  k = 3000
  gather = topology.topk_allgather_cost(_flat(p), k, itemsize=4)
  assert gather.time == pytest.approx((p - 1) * ALPHA + (p - 1) * 2 * k * 4 * BETA, rel=1e-12)
  assert gather.bytes_sent == pytest.approx((p - 1) * 2 * k * 4, rel=1e-12)
  shared = topology.shared_support_cost("ring", _flat(p), k, index_elements=16)
  assert shared == topology.dense_cost("ring", _flat(p), k + 16)
  via_density = topology.collective_cost("topk_allgather", _flat(p), 100 * k, density=0.01)
  assert via_density == gather


@pytest.mark.parametrize("p", (2, 4, 8))
def test_sparse_butterfly_static_and_expected_fill(p):
  n, k, lg = 10**6, 100, int(math.log2(p))
  entry = 8  # int32 index + float32 value
  static = topology.sparse_butterfly_cost(_flat(p), n, k)
  sizes = [k * 2**j for j in range(lg)]  # worst-case union: capacity doubles
  assert static.time == pytest.approx(
      sum(ALPHA + c * entry * BETA + c * 4 * GAMMA for c in sizes), rel=1e-12)
  assert static.bytes_sent == pytest.approx(sum(c * entry for c in sizes), rel=1e-12)

  expected = topology.sparse_butterfly_cost(_flat(p), n, k, fill="expected")
  unions = [n * (1 - (1 - k / n) ** 2**j) for j in range(lg)]
  assert expected.bytes_sent == pytest.approx(sum(u * entry for u in unions), rel=1e-12)
  assert expected.time <= static.time


def test_sparse_butterfly_switches_to_dense_at_the_break_even_fill():
  p, n, k = 8, 1000, 200  # capacities 200 and 400 stay sparse (<= n/2), 800 goes dense
  cost = topology.sparse_butterfly_cost(_flat(p), n, k)
  assert cost.bytes_sent == pytest.approx(200 * 8 + 400 * 8 + 1000 * 4, rel=1e-12)
  dense_from_start = topology.sparse_butterfly_cost(_flat(p), n, k, switch_density=0.1)
  assert dense_from_start == topology.dense_cost("butterfly", _flat(p), n)


@pytest.mark.parametrize("p", (2, 4, 8))
def test_onebit_two_phase(p):
  n = 8 * 1024
  chunk = n // p // 8 + 4  # sign bits + one float scale
  cost = topology.onebit_cost(_flat(p), n)
  assert cost.bytes_sent == pytest.approx(2 * (p - 1) * chunk, rel=1e-12)
  assert cost.time == pytest.approx(2 * (p - 1) * (ALPHA + chunk * BETA)
                                    + (p - 1) * n / p * 4 * GAMMA, rel=1e-12)


def test_shared_medium_divides_the_bandwidth_among_concurrent_senders():
  p, n = 4, 4000
  alone = topology.dense_cost("ring", _flat(p), n)
  shared = topology.dense_cost("ring", _flat(p, shared=True), n)
  assert shared.bytes_sent == alone.bytes_sent
  assert shared.time - alone.time == pytest.approx(
      2 * (p - 1) * (p - 1) * (4 * n / p) * BETA, rel=1e-9)  # p senders instead of one per step


def test_hierarchical_is_intra_ring_plus_inter_ring_on_n_over_g():
  fast = topology.Link(2e-6, 100e9, 1e-12, "fast")
  slow = topology.Link(20e-6, 5e9, 1e-12, "slow")
  nodes, g, n = 4, 8, 8 * 4 * 1000
  two_level = topology.Topology((topology.Axis("node", nodes, slow),
                                 topology.Axis("gpu", g, fast)))
  cost = topology.dense_cost("hierarchical", two_level, n)
  assert cost.time == pytest.approx(_ring_on(fast, g, 4 * n) + _ring_on(slow, nodes, 4 * n / g),
                                    rel=1e-12)
  assert cost.bytes_sent == pytest.approx(2 * (g - 1) / g * 4 * n
                                          + 2 * (nodes - 1) / nodes * 4 * n / g, rel=1e-12)

  # A flat ring over both levels crosses the slow link at every step.
  flat_ring = topology.dense_cost("ring", two_level, n)
  assert flat_ring.time == pytest.approx(_ring_on(slow, nodes * g, 4 * n), rel=1e-12)
  # One NIC per node shared by its g GPUs: the inter-node rings run g at a time.
  shared_nic = topology.Topology((topology.Axis("node", nodes, slow, ("gpu",)),
                                  topology.Axis("gpu", g, fast)))
  slower = topology.dense_cost("hierarchical", shared_nic, n).time - cost.time
  assert slower == pytest.approx(2 * (nodes - 1) * (g - 1) * (4 * n / g / nodes) * slow.beta)


@pytest.mark.parametrize("preset", [topology.v100_nvlink_25gbe, topology.cloud_10gbe,
                                    topology.h100_nvlink_ib400])
def test_presets_price_every_algorithm(preset):
  topo = preset()
  assert topo.num_devices == math.prod(topo.sizes) and str(topo).startswith("Topology")
  for algorithm in topology.ALGORITHMS:
    cost = topology.collective_cost(algorithm, topo, 10**6, 1.0 if algorithm == "onebit" else 0.01)
    assert cost.time > 0 and cost.bytes_sent > 0


def test_the_slower_network_costs_more():
  n = 25 * 10**6
  times = [topology.dense_cost("ring", preset(nodes=2, gpus_per_node=8), n).time
           for preset in (topology.h100_nvlink_ib400, topology.v100_nvlink_25gbe,
                          topology.cloud_10gbe)]
  assert times == sorted(times)


@pytest.mark.parametrize("field, value, match", [
    ("bandwidth", -1e9, r"bandwidth=-1000000000.0 is invalid; allowed: > 0"),
    ("bandwidth", 0.0, r"bandwidth=0.0"),
    ("alpha", -1e-6, r"alpha=-1e-06 is invalid; allowed: >= 0"),
    ("alpha", float("nan"), r"alpha=nan"),
    ("gamma", -1.0, r"gamma=-1.0"),
])
def test_link_rejects_bad_numbers(field, value, match):
  kwargs = dict(alpha=1e-6, bandwidth=1e9, gamma=0.0) | {field: value}
  with pytest.raises(ValueError, match=match):
    topology.Link(**kwargs)


def test_topology_and_cost_reject_bad_input():
  with pytest.raises(ValueError, match="size=0"):
    topology.Axis("x", 0, LINK)
  with pytest.raises(ValueError, match="repeat"):
    topology.Topology((topology.Axis("x", 2, LINK), topology.Axis("x", 2, LINK)))
  with pytest.raises(ValueError, match=r"shared_by=\('gpu',\).*\['gpu'\]"):
    topology.Topology((topology.Axis("node", 2, LINK, ("gpu",)),))
  with pytest.raises(ValueError, match=r"algorithm='tree'.*'ring'"):
    topology.collective_cost("tree", _flat(4), 100)
  with pytest.raises(ValueError, match=r"density=1.5"):
    topology.collective_cost("ring", _flat(4), 100, density=1.5)
  with pytest.raises(ValueError, match=r"'hierarchical' needs 2 mesh axes.*\('x',\)"):
    topology.dense_cost("hierarchical", _flat(4), 100)
  with pytest.raises(ValueError, match=r"fill='random'"):
    topology.sparse_butterfly_cost(_flat(4), 100, 10, fill="random")
  with pytest.raises(ValueError, match=r"'onebit'.*density=0.5"):
    topology.collective_cost("onebit", _flat(4), 100, density=0.5)


@pytest.mark.parametrize("name", ["topk", "onebit", "randomk"])
def test_byte_terms_match_the_compressors_on_the_wire(name):
  """The cost model's byte term for the library's own compressors equals wire_bytes."""
  p, d = 8, 1000
  compressor, algorithm, density = {
      "topk": (compressors.topk(0.01), "topk_allgather", 0.01),
      "onebit": (compressors.onebit(), "onebit", 1.0),
      "randomk": (compressors.randomk(0.01), "psum", 0.01),  # shared support: psum of k values
  }[name]
  params = {"w": jnp.zeros((d,))}
  state, update = harness.shard_map_update(
      compressors.compress(compressor, axis_name="data"), harness.mesh(p), params)
  grads = harness.per_worker_grads(jax.random.PRNGKey(0), p, params)
  measured = compressors.wire_bytes(update, params, state, grads).total
  assert measured == pytest.approx(
      topology.collective_cost(algorithm, _flat(p), d, density).bytes_sent, rel=1e-12)
