"""Bad input to the compression API gets a clear error before anything compiles."""

import functools

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import compressors
from tests import harness


@pytest.mark.parametrize("make", [compressors.topk, compressors.randomk, compressors.dgc])
@pytest.mark.parametrize("density", [0.0, -0.1, 1.5, float("nan")])
def test_density_outside_unit_interval(make, density):
  with pytest.raises(ValueError, match=r"density=.* is outside \(0, 1\]"):
    make(density)


def test_density_of_wrong_type():
  with pytest.raises(TypeError, match="density must be a number"):
    compressors.topk("0.01")


def test_threshold_and_cast_arguments():
  with pytest.raises(ValueError, match="value=-1 must be a positive number"):
    compressors.threshold(-1)
  with pytest.raises(ValueError, match="dtype=int8 is not supported; allowed"):
    compressors.cast(jnp.int8)


def test_dgc_density_warmup_of_negative_steps():
  """DGC's warm-up is the general one (config.compression.density_warmup_steps): its bad
  settings are named when the method is built."""
  settings = compressors.registry.default_settings("dgc", density=0.01)
  with pytest.raises(ValueError, match="density_warmup_steps=-1 is below 0"):
    compressors.registry.transformation(
        "dgc", settings, axis_name="data",
        common=compressors.registry.Common(density_warmup_steps=-1))


def _in_shard_map(tx, grads, params=None, axis="data"):
  params = grads if params is None else params
  mesh = harness.mesh()

  @functools.partial(jax.shard_map, mesh=mesh, in_specs=P(axis), out_specs=P(), check_vma=False)
  def step(g):
    g = jax.tree.map(lambda x: x[0], g)
    return tx.update(g, tx.init(params), params)[0]

  return jax.jit(step).lower(jax.tree.map(lambda x: jnp.stack([x] * 8), grads))


def test_unbound_axis_lists_the_bound_ones():
  tx = compressors.compress(compressors.topk(0.5), axis_name="batch")
  with pytest.raises(NameError, match=r"axis 'batch', which is not bound; the bound axes are "
                                      r"\['data'\]"):
    _in_shard_map(tx, {"w": jnp.ones(8)})


def test_update_outside_any_mesh_says_where_to_call_it():
  tx = compressors.compress(compressors.topk(0.5), axis_name="data")
  x = {"w": jnp.ones(8)}
  with pytest.raises(NameError, match="inside jax.shard_map or jax.pmap"):
    tx.update(x, compressors.compress(compressors.topk(0.5), axis_name=None).init(x))


def test_integer_gradients_are_rejected():
  tx = compressors.compress(compressors.topk(0.5), axis_name="data")
  with pytest.raises(TypeError, match=r"gradient leaf \['step'\] has dtype int32; only "
                                      "floating-point"):
    _in_shard_map(tx, {"step": jnp.ones(8, jnp.int32)}, params={"step": jnp.ones(8)})


def test_zero_size_leaf_is_rejected_per_leaf_and_allowed_fused():
  grads = {"empty": jnp.zeros((0, 4)), "w": jnp.ones(64)}
  per_leaf = compressors.compress(compressors.topk(0.5), axis_name="data", fuse=False)
  with pytest.raises(ValueError, match=r"leaf \['empty'\] has shape \(0, 4\) \(zero elements\)"):
    _in_shard_map(per_leaf, grads)
  fused = compressors.compress(compressors.topk(0.5), axis_name="data")
  if jax.__version_info__[:2] == (0, 11):  # its shard_map crashes on such a leaf: refused early
    with pytest.raises(ValueError, match=r"\['empty'\].*segmentation fault.*drop the leaf"):
      _in_shard_map(fused, grads)
  else:
    _in_shard_map(fused, grads)  # lowers fine: the empty leaf contributes nothing
  with pytest.raises(ValueError, match="every params leaf has zero elements"):
    fused.init({"empty": jnp.zeros((0,))})


def test_k_that_rounds_to_zero_names_the_leaf_and_the_smallest_density():
  tx = compressors.compress(compressors.topk(0.01), axis_name="data", fuse=False)
  with pytest.raises(ValueError, match=r"density=0.01 keeps round\(0.01 \* 10\) = 0 of the 10 "
                                      r"elements of gradient leaf \['b'\]; use density >= 0.05"):
    _in_shard_map(tx, {"w": jnp.ones(1000), "b": jnp.ones(10)})


@pytest.mark.parametrize("name, make", [
    ("compress", lambda: compressors.compress(compressors.topk(0.5), axis_name="data")),
    ("demo", lambda: compressors.demo(0.1, axis_name="data")),
    ("onebit_adam", lambda: compressors.onebit_adam(0.1, axis_name="data"))])
def test_already_summed_gradient_is_rejected(name, make):
  """jax.grad w.r.t. replicated params inside shard_map sums over workers: nothing to compress
  (and a sum of it would count each worker's gradient once per worker)."""
  tx = make()
  params = {"w": jnp.ones(8)}
  mesh = harness.mesh()

  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())
  def step(params, x):
    grads = jax.grad(lambda p: jnp.sum(p["w"] * x))(params)
    return tx.update(grads, tx.init(params), params)[0]

  with pytest.raises(ValueError, match=rf"{name}: .*already summed it over the workers.*pcast"):
    jax.jit(step).lower(params, jnp.ones((8, 8)))


def test_two_phase_init_outside_the_mesh_explains_why():
  tx = compressors.compress(compressors.cast("bfloat16", exchange="two_phase"), axis_name="data")
  with pytest.raises(ValueError, match="call init\\(\\) inside jax.shard_map"):
    tx.init({"w": jnp.ones(8)})


def test_non_compressor_and_overlapping_axes():
  with pytest.raises(TypeError, match="compressor must be a compressors.Compressor"):
    compressors.compress("topk", axis_name="data")
  with pytest.raises(ValueError, match="share an axis"):
    compressors.compress(compressors.dense(), axis_name=("a", "b"), dense_axis="b")
