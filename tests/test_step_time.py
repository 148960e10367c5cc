"""The time model (compressors/step_time.py) against the alpha-beta model's own figures: dense's
bucketed all-reduce overlapped with the backward pass, per-step compressors after it, local
updates paying only their synchronisations, Streaming DiLoCo's exchange hidden behind its
``overlap`` inner steps when it fits."""

import pytest

from compressors import registry
from compressors import step_time
from compressors.network import topology as topo

TOPOLOGY = topo.Topology.flat(8, topo.ETHERNET_1G)
# Twelve 4 MiB float32 matrices: two buckets of 24 MiB under DDP's 25 MiB.
SHAPES = [(1024, 1024)] * 12


def _all_reduce(n: int, itemsize: int = 4) -> float:
  return topo.all_reduce_cost("psum", TOPOLOGY, n, itemsize).time


def test_buckets_fill_in_backward_order_and_a_large_leaf_is_alone():
  assert step_time.bucket_sizes([(10,), (20,), (30,)], bucket_bytes=4 * 35) == [30, 30]
  assert step_time.bucket_sizes([(50,), (5,), (5,)], bucket_bytes=4 * 35) == [10, 50]
  assert step_time.bucket_sizes(SHAPES) == [6 * 2**20, 6 * 2**20]
  assert step_time.bucket_sizes([]) == [0]


def test_an_overlapped_step_ends_with_the_compute_or_the_last_bucket():
  """Forward 1 s, backward 2 s over three equal buckets ready at 5/3, 7/3 and 3 s: short
  exchanges hide but the last; long ones queue from the first bucket's readiness."""
  assert step_time.overlapped_seconds(3.0, [1, 1, 1], [0.5] * 3) == pytest.approx(3.5)
  assert step_time.overlapped_seconds(3.0, [1, 1, 1], [2.0] * 3) == pytest.approx(5 / 3 + 6)
  assert step_time.overlapped_seconds(3.0, [1, 1, 1], [0.0] * 3) == pytest.approx(3.0)
  # One bucket (a model under 25 MiB) cannot overlap: it is ready when the backward pass ends.
  assert step_time.overlapped_seconds(3.0, [7], [0.4]) == pytest.approx(3.4)


@pytest.mark.parametrize("compute", [0.05, 1.0])
def test_dense_overlapped_and_not_against_the_alpha_beta_figures(compute):
  half = 6 * 2**20
  bucket = _all_reduce(half)
  plain = step_time.kind_times("dense", SHAPES, TOPOLOGY, compute, overlap=False)
  [(kind, time)] = plain.items()
  assert kind == "step" and time.communication == pytest.approx(_all_reduce(12 * 2**20))
  assert time.total == pytest.approx(compute + _all_reduce(12 * 2**20))
  [overlapped] = step_time.kind_times("dense", SHAPES, TOPOLOGY, compute).values()
  first_ready = compute / 3 + compute * 2 / 3 / 2
  expected = max(compute, max(compute, first_ready + bucket) + bucket)
  assert overlapped.communication == pytest.approx(2 * bucket)
  assert overlapped.total == pytest.approx(expected) and overlapped.total < time.total
  [bf16] = step_time.kind_times("bf16", SHAPES, TOPOLOGY, compute).values()
  assert bf16.communication == pytest.approx(2 * _all_reduce(half, itemsize=2))
  assert bf16.total < overlapped.total


def test_a_compressor_waits_for_the_whole_backward_pass():
  settings = registry.default_settings("topk", density=0.01)
  [time] = step_time.kind_times("topk", SHAPES, TOPOLOGY, 0.2, settings).values()
  sent = registry.cost("topk", SHAPES, TOPOLOGY, settings).time
  assert time.communication == pytest.approx(sent) and time.total == pytest.approx(0.2 + sent)


def test_local_updates_pay_only_their_synchronisations():
  settings = registry.default_settings("diloco", every=10, carrier="int8")
  times = step_time.kind_times("diloco", SHAPES, TOPOLOGY, 0.2, settings)
  sync = registry.cost("int8", SHAPES, TOPOLOGY).time
  assert times["local"] == step_time.StepTime(0.2, 0.0, 0.2)
  assert times["sync"].total == pytest.approx(0.2 + sync)
  counts = {"local": 9, "sync": 1}
  assert step_time.mean_step_seconds(times, counts) == pytest.approx(0.2 + sync / 10)


@pytest.mark.parametrize("compute, hidden", [(0.01, False), (10.0, True)])
def test_streaming_dilocos_exchange_hides_behind_its_overlap_steps_when_it_fits(compute, hidden):
  """Two equal fragments (six matrices each), tau = 1: a synchronisation waits for nothing, its
  landing a step later for what that step's compute did not hide; with tau = 0 the
  synchronisation waits for all of it."""
  settings = registry.default_settings("streaming_diloco", every=8, fragments=2, overlap=1)
  times = step_time.kind_times("streaming_diloco", SHAPES, TOPOLOGY, compute, settings)
  fragment = _all_reduce(6 * 2**20)
  assert set(times) == {"local", "sync0", "sync1", "apply0", "apply1"}
  for p in (0, 1):
    assert times[f"sync{p}"].communication == pytest.approx(fragment)
    assert times[f"sync{p}"].total == compute
    waits = 0.0 if hidden else fragment - compute
    assert times[f"apply{p}"].total == pytest.approx(compute + waits)
  at_once = step_time.kind_times(
      "streaming_diloco", SHAPES, TOPOLOGY, compute,
      registry.default_settings("streaming_diloco", every=8, fragments=2, overlap=0))
  assert at_once["sync0"].total == pytest.approx(compute + fragment)


def test_one_bit_adams_warm_up_is_a_dense_all_reduce():
  times = step_time.kind_times("onebit_adam", SHAPES, TOPOLOGY, 0.1, overlap=False)
  dense = registry.cost("dense", SHAPES, TOPOLOGY).time
  own = registry.cost("onebit_adam", SHAPES, TOPOLOGY).time
  assert sorted(t.communication for t in times.values()) == pytest.approx(sorted([own, dense]))


@pytest.mark.parametrize("shared", [False, True])
def test_islands_pay_zero3_on_the_fast_link_and_the_exchange_of_a_shard_on_the_slow(shared):
  """2 islands x 4 fsdp, without the compiled collectives: ZeRO-3's minimum on NVLink, a gather
  and a reduce-scatter (a ring all-reduce's halves) of the whole model; the method's exchange a
  2-device exchange of one shard (a quarter of each matrix) on Ethernet; through one NIC per
  island the four shards share its bandwidth."""
  islands = topo.Topology((topo.Axis("islands", 2, topo.ETHERNET_1G,
                                     ("fsdp",) if shared else ()),
                           topo.Axis("fsdp", 4, topo.NVLINK4)))
  zero3 = topo.dense_cost("ring", topo.Topology.flat(4, topo.NVLINK4), 12 * 2**20).time
  link = topo.ETHERNET_1G
  if shared:
    link = topo.Link(link.alpha, link.bandwidth / 4, link.gamma)
  shard = [(1024 // 4, 1024)] * 12  # of equal dimensions the first is sharded
  settings = registry.default_settings("diloco", every=10, carrier="int8")
  times = step_time.island_kind_times("diloco", SHAPES, islands, 0.2, settings)
  sync = registry.cost("int8", shard, topo.Topology.flat(2, link)).time
  assert times["local"].total == pytest.approx(0.2 + zero3)
  assert times["sync"].total == pytest.approx(0.2 + sync + zero3)
  assert times["sync"].communication == pytest.approx(sync + zero3)
  [dense] = step_time.island_kind_times("dense", SHAPES, islands, 0.2, overlap=False).values()
  across = topo.all_reduce_cost("psum", topo.Topology.flat(2, link), 3 * 2**20).time
  assert dense.total == pytest.approx(0.2 + across + zero3)
  with pytest.raises(ValueError, match="allowed: two, the islands then fsdp"):
    step_time.island_kind_times("dense", SHAPES, TOPOLOGY, 0.2)
