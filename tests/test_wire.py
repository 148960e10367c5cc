"""wire_bytes: the compiled program's collectives, charged as the ring algorithms imply."""

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
D = 1 << 20  # a 1M-element gradient
DENSE = 2 * (N - 1) / N * 4 * D


def _step_bytes(compressor, **kwargs) -> compressors.WireBytes:
  """Bytes per device of one compressed update of a 1M-element gradient (compile only)."""
  tx = compressors.compress(compressor, axis_name="data", **kwargs)
  return harness.update_bytes(tx, {"w": jax.ShapeDtypeStruct((D,), jnp.float32)},
                              harness.mesh())


def test_dense_psum_is_the_ring_all_reduce():
  report = _step_bytes(compressors.dense())
  assert report.total == DENSE
  assert report.by_kind == {"all-reduce": DENSE}
  assert report.by_axis == {("data",): DENSE}


def test_topk_bytes_are_what_the_algorithm_implies():
  report = _step_bytes(compressors.topk(0.01))
  k = round(0.01 * D)
  gathered = N * k * (4 + 4)  # values f32 + indices int32 from every worker
  assert report.by_kind == {"all-gather": (N - 1) / N * gathered}
  print(f"top-k 1%: {report.total:,.0f} B vs dense {DENSE:,.0f} B: {DENSE / report.total:.1f}x")
  assert report.total * 10 <= DENSE


def test_randomk_payload_is_summable_k_floats():
  report = _step_bytes(compressors.randomk(0.01))
  k = round(0.01 * D)
  assert [c.kind for c in report.collectives] == ["all-reduce"]
  assert report.collectives[0].size_bytes == 4 * k
  assert report.total == 2 * (N - 1) / N * 4 * k


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_sixteen_bit_transport_is_exactly_half_of_dense(dtype):
  report = _step_bytes(compressors.cast(dtype))
  assert report.total == DENSE / 2
  assert all(d in ("u16", "f16") for c in report.collectives for d in c.dtypes)


def test_threshold_and_dgc_are_charged_at_capacity():
  capacity = round(0.01 * D)
  expected = (N - 1) / N * N * (capacity * 8 + 4)  # values, indices and the count
  assert _step_bytes(compressors.threshold(1.0, max_density=0.01)).total == expected
  assert _step_bytes(compressors.dgc(0.01)).total == expected


def test_dgc_warmup_stages_are_each_charged_their_own_bytes():
  """DGC's warm-up (config.compression.density_warmup_steps): each stage is its own program,
  moving its own density's capacity, then the final density's."""
  common = compressors.registry.Common(density_warmup_steps=100, density_warmup_stages=2)
  tx = compressors.registry.transformation(
      "dgc", compressors.registry.default_settings("dgc", density=0.01), axis_name="data",
      common=common)
  densities = compressors.warmup_densities(0.01, common.density_warmup_start, 2)
  params = {"w": jax.ShapeDtypeStruct((D,), jnp.float32)}
  charged = []
  for stage, density in [*enumerate(densities), (None, 0.01)]:
    stage_tx = optax.GradientTransformation(tx.init,
                                            functools.partial(tx.update, density_stage=stage))
    charged.append(harness.update_bytes(stage_tx, params, harness.mesh()).total)
    assert charged[-1] == (N - 1) / N * N * (round(density * D) * 8 + 4)
  assert charged == sorted(charged, reverse=True) and len(set(charged)) == 3


def test_masked_dense_psum_is_not_compression():
  mesh = harness.mesh()

  @functools.partial(jax.shard_map, mesh=mesh, in_specs=P("data"), out_specs=P())
  def masked(g):
    g = g[0]
    keep = abs(g) >= jax.lax.top_k(abs(g), 100)[0][-1]
    return jax.lax.psum(jnp.where(keep, g, 0.0), "data")

  report = compressors.wire_bytes(masked, jax.ShapeDtypeStruct((N, D), jnp.float32))
  assert report.total == DENSE


def test_bf16_psum_is_charged_as_the_f32_the_cpu_backend_moves():
  mesh = harness.mesh()
  fn = jax.shard_map(lambda g: jax.lax.psum(g.astype(jnp.bfloat16), "data"), mesh=mesh,
                     in_specs=P("data"), out_specs=P())
  report = compressors.wire_bytes(fn, jax.ShapeDtypeStruct((N * 1024,), jnp.float32))
  assert report.total == 2 * (N - 1) / N * 1024 * 4
  assert report.collectives[0].dtypes == ("f32",)


def test_breakdown_by_mesh_axis_on_a_two_level_mesh():
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("node", "gpu"))

  @functools.partial(jax.shard_map, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)
  def two_level(x):
    inner = jax.lax.psum_scatter(x, "gpu", tiled=True)        # 4096 B in, groups of 4
    outer = jax.lax.psum(inner, "node")                       # 1024 B, groups of 2
    both = jax.lax.psum(x[:8], ("node", "gpu"))               # 32 B, all 8
    return jax.lax.all_gather(outer, "gpu", tiled=True) + both.sum()

  report = compressors.wire_bytes(two_level, jax.ShapeDtypeStruct((1024,), jnp.float32))
  assert report.by_axis[("gpu",)] == 3 / 4 * 4096 + 3 / 4 * 4096
  assert report.by_axis[("node",)] == 2 * 1 / 2 * 1024
  assert report.by_axis[("node", "gpu")] == 2 * 7 / 8 * 32


def test_loops_are_charged_per_iteration_and_permutes_per_sender():
  mesh = harness.mesh()
  ring = [(i, (i + 1) % N) for i in range(N)]

  @functools.partial(jax.shard_map, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)
  def rotate(x):
    return jax.lax.fori_loop(0, 5, lambda _, y: jax.lax.ppermute(y, "data", ring), x)

  report = compressors.wire_bytes(rotate, jax.ShapeDtypeStruct((256,), jnp.float32))
  assert report.by_kind == {"collective-permute": 5 * 256 * 4}
  assert report.collectives[0].executions == 5
  assert report.unknown_trip_counts == 0


def test_pmap_programs_are_read_too():
  fn = jax.pmap(lambda x: jax.lax.psum(x, "i"), axis_name="i")
  report = compressors.wire_bytes(fn, jax.ShapeDtypeStruct((N, 100), jnp.float32))
  assert report.total == 2 * (N - 1) / N * 400


def test_iota_replica_groups_are_parsed():
  text = """HloModule m, num_partitions=8

ENTRY %main (p: f32[64]) -> f32[64] {
  %p = f32[64]{0} parameter(0)
  ROOT %ar = f32[64]{0} all-reduce(%p), channel_id=1, replica_groups=[2,4]<=[4,2]T(1,0), use_global_device_ids=true, to_apply=%add
}
"""
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b"))
  report = compressors.parallel.hlo_bytes.parse_hlo(text, mesh)
  assert report.collectives[0].group_size == 4
  assert report.collectives[0].axes == ("a",)  # groups {0,2,4,6},{1,3,5,7}: same b, all a
  assert report.total == 2 * 3 / 4 * 256


# The same two-level program compiled by JAX 0.10.2 (listed groups) and by JAX 0.12.0.1 (mesh
# axes), copied from `jax.jit(f).lower(...).compile().as_text()`: both must read alike.
_TWO_LEVEL_HLO = {
    "jax_0.10.2": """HloModule jit_two_level, is_scheduled=true, num_partitions=8

ENTRY %main.1 (param.1: f32[1024]) -> f32[1024] {
  %param.1 = f32[1024]{0} parameter(0)
  %reduce_scatter.7 = f32[256]{0} reduce-scatter(%param.1), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true, dimensions={0}, to_apply=%region_0.0
  %psum.14 = f32[256]{0} all-reduce(%reduce_scatter.7), channel_id=1, replica_groups={{0,4},{1,5},{2,6},{3,7}}, use_global_device_ids=true, to_apply=%region_1.0
  %psum.15 = f32[8]{0} all-reduce(%param.1), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true, to_apply=%region_2.0
  ROOT %all_gather.3 = f32[1024]{0} all-gather(%psum.14), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}, use_global_device_ids=true
}
""",
    "jax_0.12.0.1": """HloModule jit_two_level, is_scheduled=true, num_partitions=8

ENTRY %main.1 (param.1: f32[1024]) -> f32[1024] {
  %param.1 = f32[1024]{0} parameter(0)
  %reduce_scatter.7 = f32[256]{0} reduce-scatter(%param.1), channel_id=1, replica_groups=mesh['node'=2,'gpu'=4] {'gpu'}, use_global_device_ids=true, dimensions={0}, to_apply=%region_0.0, metadata={op_name="jit(two_level)/shard_map/reduce_scatter" stack_frame_id=11}
  %psum.14 = f32[256]{0} all-reduce(%reduce_scatter.7), channel_id=1, replica_groups=mesh['node'=2,'gpu'=4] {'node'}, use_global_device_ids=true, to_apply=%region_1.0, metadata={op_name="jit(two_level)/shard_map/psum" stack_frame_id=12}
  %psum.15 = f32[8]{0} all-reduce(%param.1), channel_id=1, replica_groups=mesh['node'=2,'gpu'=4] {'node','gpu'}, use_global_device_ids=true, to_apply=%region_2.0, metadata={op_name="jit(two_level)/shard_map/psum" stack_frame_id=15}
  ROOT %all_gather.3 = f32[1024]{0} all-gather(%psum.14), channel_id=1, replica_groups=mesh['node'=2,'gpu'=4] {'gpu'}, dimensions={0}, use_global_device_ids=true, metadata={op_name="jit(two_level)/shard_map/all_gather" stack_frame_id=13}
}
""",
}


@pytest.mark.parametrize("version", sorted(_TWO_LEVEL_HLO))
def test_both_replica_group_forms_give_the_same_bytes_per_axis(version):
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("node", "gpu"))
  report = compressors.parallel.hlo_bytes.parse_hlo(_TWO_LEVEL_HLO[version], mesh)
  assert [c.group_size for c in report.collectives] == [4, 2, 8, 4]
  assert report.by_axis == {("gpu",): 3 / 4 * 4096 * 2, ("node",): 2 * 1 / 2 * 1024,
                            ("node", "gpu"): 2 * 7 / 8 * 32}


def _one_all_reduce(groups: str) -> str:
  return f"""HloModule m, num_partitions=8

ENTRY %main (p: f32[64]) -> f32[64] {{
  %p = f32[64]{{0}} parameter(0)
  ROOT %ar = f32[64]{{0}} all-reduce(%p), channel_id=1, replica_groups={groups}, use_global_device_ids=true, to_apply=%add
}}
"""


@pytest.mark.parametrize("groups, expected", [
    # The mesh's device order given as an iota and as a list: groups follow the devices.
    ("mesh['a'=2,'b'=4], device_ids=([2,4]<=[4,2]T(1,0)) {'b'}", [[0, 2, 4, 6], [1, 3, 5, 7]]),
    ("mesh['a'=2,'b'=4], device_ids=(devices=[2,4]1,0,3,2,5,4,7,6) {'a'}",
     [[1, 5], [0, 4], [3, 7], [2, 6]]),
    # Sub-axes: b = 2 x 2 (major x minor); b:(1)2 is the major half, b:(2)2 the minor one.
    ("mesh['a'=2,'b'=4] {'b':(1)2}", [[0, 2], [1, 3], [4, 6], [5, 7]]),
    ("mesh['a'=2,'b'=4] {'b':(2)2}", [[0, 1], [2, 3], [4, 5], [6, 7]]),
    ("mesh['a'=2,'b'=4] {'a','b':(2)2}", [[0, 1, 4, 5], [2, 3, 6, 7]]),
    ("mesh[a=2,b=4] {b}", [[0, 1, 2, 3], [4, 5, 6, 7]]),  # names printed without quotes
    # An axis of size 1 (JAX 0.12's form for 1 device x 8 simulated workers' equivalent program).
    ("mesh['data'=1,'worker'=8] {'data','worker'}", [list(range(8))]),
    ("mesh['data'=1,'worker'=8] {'data'}", [[i] for i in range(8)]),
])
def test_mesh_axes_replica_groups_match_xla_grouping(groups, expected):
  got = compressors.parallel.hlo_bytes._replica_groups(f"replica_groups={groups}, to_apply=%add", 8, "%ar")
  assert got == expected
  report = compressors.parallel.hlo_bytes.parse_hlo(_one_all_reduce(groups))
  assert report.collectives[0].group_size == len(expected[0])


def test_unreadable_replica_groups_name_the_instruction():
  with pytest.raises(ValueError, match=r"%ar \(all-reduce\).*no form this parser knows"):
    compressors.parallel.hlo_bytes.parse_hlo(_one_all_reduce("groups<8>(0..7)"))
  with pytest.raises(ValueError, match=r"%ar.*'c'.*names no axis"):
    compressors.parallel.hlo_bytes.parse_hlo(_one_all_reduce("mesh['a'=2,'b'=4] {'c'}"))
