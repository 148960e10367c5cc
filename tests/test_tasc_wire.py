"""TASC's bytes on the wire, read from compiled HLO (compile only, abstract shapes).

A ResNet-50-sized gradient (25.6M float32) at density 0.01 in blocks of 256: the shared support
means one all-reduce of 1000 blocks (plus the 100000 block scores), whose per-worker bytes do not
grow with the number of workers, where top-k's all-gather does.
"""

import pytest

from tests.subprocess_devices import run_with_devices

pytestmark = pytest.mark.usefixtures("fast_compiles")

MEASURE = """
import functools, json
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import PartitionSpec as P
import compressors, tasc

SIZE, DENSITY, BLOCK = 25_600_000, 0.01, 256


def wire(tx, mesh, axis):
  params = {"w": jax.ShapeDtypeStruct((SIZE,), jnp.float32)}
  specs = compressors.state_specs(tx, params, mesh, axis, check_updates=False)
  state = jax.eval_shape(jax.shard_map(lambda p: compressors.add_device_axis(tx.init(p), specs),
                                       mesh=mesh, in_specs=P(), out_specs=specs), params)
  grads = {"w": jax.ShapeDtypeStruct((mesh.size, SIZE), jnp.float32)}

  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), specs, P(axis)),
                     out_specs=(P(), specs), check_vma=False)
  def step(params, state, grads):
    state = compressors.drop_device_axis(state, specs)
    mean, state = tx.update(jax.tree.map(lambda g: g[0], grads), state, params)
    return mean, compressors.add_device_axis(state, specs)

  report = compressors.wire_bytes(jax.jit(step), params, state, grads, mesh=mesh)
  return {"total": report.total,
          "by_axis": {"+".join(map(str, k)): v for k, v in report.by_axis.items()},
          "operands_by_axis": {"+".join(map(str, k)): sum(c.size_bytes for c in report.collectives
                                                          if c.axes == k)
                               for k in report.by_axis},
          "kinds": sorted(c.kind for c in report.collectives)}


n = jax.device_count()
flat = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
out = {
    "tasc": wire(tasc.tasc_compress(axis_name="data", density=DENSITY, block_size=BLOCK), flat,
                 "data"),
    "topk": wire(compressors.compress(compressors.topk(DENSITY), axis_name="data"), flat,
                 "data"),
}
if n == 8:
  out["dense"] = wire(compressors.compress(compressors.dense(), axis_name="data"), flat, "data")
  out["previous"] = wire(tasc.tasc_compress(axis_name="data", density=DENSITY, block_size=BLOCK,
                                            support="previous"), flat, "data")
  for support in ("global", "previous"):
    out[f"float16_{support}"] = wire(tasc.tasc_compress(
        axis_name="data", density=DENSITY, block_size=BLOCK, support=support,
        wire_dtype="float16"), flat, "data")
  two = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("slow", "fast"))
  both = ("slow", "fast")
  out["two_level_flat"] = wire(tasc.tasc_compress(axis_name=both, density=DENSITY,
                                                  block_size=BLOCK), two, both)
  out["dense_fast"] = wire(tasc.tasc_compress(axis_name="slow", dense_axis="fast",
                                              density=DENSITY, block_size=BLOCK), two, both)
  out["sparse_both"] = wire(tasc.tasc_compress(
      axis_name="slow", dense_axis="fast", density={"slow": DENSITY, "fast": DENSITY},
      block_size=BLOCK), two, both)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def figures():
  return {n: run_with_devices(n, MEASURE) for n in (8, 64)}


def test_tasc_is_40x_below_dense_and_flat_in_the_number_of_workers(figures):
  tasc8, tasc64 = figures[8]["tasc"]["total"], figures[64]["tasc"]["total"]
  topk8, topk64 = figures[8]["topk"]["total"], figures[64]["topk"]["total"]
  dense8 = figures[8]["dense"]["total"]
  print(f"\nbytes per device per step, 25.6M f32, density 0.01, block 256:\n"
        f"  dense psum  @8 : {dense8:>14,.0f}\n"
        f"  TASC        @8 : {tasc8:>14,.0f}   ({dense8 / tasc8:.1f}x below dense)\n"
        f"  TASC        @64: {tasc64:>14,.0f}   ({tasc64 / tasc8:.3f}x of @8)\n"
        f"  top-k gather@8 : {topk8:>14,.0f}\n"
        f"  top-k gather@64: {topk64:>14,.0f}   ({topk64 / topk8:.2f}x of @8)")
  assert dense8 / tasc8 >= 40
  assert abs(tasc64 / tasc8 - 1) <= 0.2
  assert topk64 / topk8 > 5
  # Operands: 1000 blocks of 256 floats and 100000 scores, all-reduced, nothing gathered.
  assert figures[8]["tasc"]["kinds"] == ["all-reduce", "all-reduce"]
  assert figures[8]["tasc"]["operands_by_axis"]["data"] == 4 * (1000 * 256 + 100_000)


def test_previous_support_rides_the_scores_in_the_payloads_all_reduce(figures):
  previous = figures[8]["previous"]
  assert previous["kinds"] == ["all-reduce"]
  assert previous["total"] == figures[8]["tasc"]["total"]


@pytest.mark.parametrize("support", ["global", "previous"])
def test_float16_wire_halves_the_bytes_plus_one_number_for_the_scale(figures, support):
  half = figures[8][f"float16_{support}"]
  # Scores and payload as float16 (XLA's CPU backend keeps float16 all-reduces narrow), and
  # each worker's bound for the shared scale: a float32 of its own ("global"), or one more
  # float16 in the payload ("previous", still one all-reduce).
  if support == "global":
    assert half["operands_by_axis"]["data"] == 2 * (1000 * 256 + 100_000) + 4
    assert half["kinds"] == ["all-reduce"] * 3
  else:
    assert half["operands_by_axis"]["data"] == 2 * (1000 * 256 + 100_000 + 1)
    assert half["kinds"] == ["all-reduce"]
  assert half["total"] == pytest.approx(figures[8]["tasc"]["total"] / 2, rel=1e-4)


@pytest.mark.parametrize("mode", ["dense_fast", "sparse_both"])
def test_slow_axis_carries_one_over_g_in_hierarchical_mode(figures, mode):
  g = 4
  flat, hier = figures[8]["two_level_flat"], figures[8][mode]
  print(f"\n{mode}: bytes per device by axis {hier['by_axis']}; operands by axis "
        f"{hier['operands_by_axis']}; flat mode: {flat['by_axis']}")
  flat_operands = flat["operands_by_axis"]["slow+fast"]
  assert hier["operands_by_axis"]["slow"] == pytest.approx(flat_operands / g, rel=0.01)
  assert hier["by_axis"]["slow"] <= flat["by_axis"]["slow+fast"] / g
