"""Density warm-up (Lin et al. ICLR 2018, DGC) for every sparsifier: DGC's schedule, each stage's
program moving its own density's bytes, one state handed on across stages with nothing lost, and
the stages as step kinds of ``compressors.data_parallel``."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import compressors
import tasc
from tasc import _plan as plan_lib
from compressors import method_protocol
from compressors.parallel import step_kinds
from tests import harness

pytestmark = pytest.mark.usefixtures("fast_compiles")

WORKERS = 8
PARAMS = {"b": jnp.zeros((24,)), "w": jnp.zeros((64, 16))}  # 1048 elements, fused
SIZE = 1048


def test_schedule_is_dgcs():
  # DGC's quarters 0.25 / 4**j, exactly where the final density continues them.
  np.testing.assert_allclose(compressors.warmup_densities(0.25 / 4**4, 0.25, 4),
                             [0.25, 0.0625, 0.015625, 0.00390625], rtol=1e-12)
  # Towards DGC's 0.1%: geometric, within 2% of the quarters, none below the final density.
  stages = compressors.warmup_densities(0.001, 0.25, 4)
  np.testing.assert_allclose(stages, [0.25, 0.0625, 0.015625, 0.00390625], rtol=0.02)
  ratios = np.array(stages[1:]) / np.array(stages[:-1])
  np.testing.assert_allclose(ratios, (0.001 / 0.25) ** 0.25, rtol=1e-12)
  assert stages[0] == 0.25 and min(stages) > 0.001
  assert compressors.warmup_densities(0.3, 0.25, 4) == ()
  assert compressors.warmup_densities(0.01, 0.25, 0) == ()


def test_boundaries_split_the_steps_equally():
  assert compressors.warmup_boundaries(100, 4) == (25, 50, 75, 100)
  assert compressors.warmup_boundaries(10, 3) == (3, 6, 10)
  assert compressors.warmup_boundaries(4, 4) == (1, 2, 3, 4)
  assert compressors.warmup_boundaries(0, 4) == ()
  assert compressors.warmup_boundaries(100, 0) == ()


@pytest.mark.parametrize("call, error, words", [
    (lambda: compressors.warmup_boundaries(3, 4), ValueError,
     "density_warmup_steps=3 is fewer than density_warmup_stages=4"),
    (lambda: compressors.warmup_boundaries(-1, 4), ValueError,
     "density_warmup_steps=-1 is below 0"),
    (lambda: compressors.warmup_boundaries(4.0, 2), TypeError,
     "density_warmup_steps must be an int"),
    (lambda: compressors.warmup_boundaries(4, -2), ValueError,
     "density_warmup_stages=-2 is below 0"),
    (lambda: compressors.warmup_densities(0.01, 0.0, 4), ValueError,
     "density_warmup_start=0.0 is outside"),
    (lambda: compressors.warmup_densities(0.01, 1.5, 4), ValueError,
     "density_warmup_start=1.5 is outside"),
    (lambda: compressors.warmup_densities(0.01, 0.25, True), TypeError,
     "density_warmup_stages must be an int"),
    (lambda: compressors.density_warmup(None, 0.01, [0.5, 2.0]), ValueError,
     r"densities\[1\]=2.0 is outside")])
def test_bad_settings_are_refused(call, error, words):
  with pytest.raises(error, match=words):
    call()


def test_kinds_run_each_stage_then_the_method_s_own():
  kinds = compressors.warmup_kinds(method_protocol.step_kinds(), steps=6, stages=3)
  assert [step_kinds.kind_at(kinds, s) for s in range(8)] == [
      "step@0", "step@0", "step@1", "step@1", "step@2", "step@2", "step", "step"]
  assert {k.name: k.update_kwargs() for k in kinds} == {
      "step@0": {"density_stage": 0}, "step@1": {"density_stage": 1},
      "step@2": {"density_stage": 2}, "step": {}}
  assert compressors.warmup_kinds(method_protocol.step_kinds(), steps=0, stages=3) == (
      method_protocol.step_kinds())


def _stage_steps(tx, mesh):
  """``(state, step)``: ``step(stage)`` is the jitted shard_map update of ``density_stage=stage``
  (None: the final density), ``(params, state, grads) -> (mean, state)``."""
  specs = compressors.state_specs(tx, PARAMS, mesh, "data")
  state = jax.jit(jax.shard_map(lambda p: compressors.add_device_axis(tx.init(p), specs),
                                mesh=mesh, in_specs=P(), out_specs=specs))(PARAMS)

  @functools.cache
  def step(stage):
    def per_worker(params, state, grads, density_stage):
      grads = jax.tree.map(lambda g: g[0], grads)
      mean, state = tx.update(grads, compressors.drop_device_axis(state, specs), params,
                              density_stage=density_stage)
      return mean, compressors.add_device_axis(state, specs)
    return jax.jit(jax.shard_map(functools.partial(per_worker, density_stage=stage), mesh=mesh,
                                 in_specs=(P(), specs, P("data")), out_specs=(P(), specs)))
  return state, step


def _bookkeeping(make, final, densities, check_step):
  """Runs a warm-up of ``make(density)`` through every stage and then the final density, two
  steps each; checks each stage's bytes against ``make(its density)`` alone, and calls
  ``check_step(a, kept, mean, density)`` with this worker's ``a = g + e`` and new residual."""
  mesh = harness.mesh(WORKERS)
  tx = compressors.density_warmup(make, final, densities)
  state, step = _stage_steps(tx, mesh)
  grads_like = jax.tree.map(lambda x: jax.ShapeDtypeStruct((WORKERS,) + x.shape, x.dtype), PARAMS)
  stages = [(j, d) for j, d in enumerate(densities)] + [(None, final)]
  sent_bytes = []
  for i, (stage, density) in enumerate(stages):
    moved = compressors.wire_bytes(step(stage), PARAMS, state, grads_like, mesh=mesh).total
    assert moved == harness.update_bytes(make(density), PARAMS, mesh).total
    sent_bytes.append(moved)
    for repeat in range(2):
      grads = harness.per_worker_grads(jax.random.PRNGKey(10 * i + repeat), WORKERS, PARAMS)
      a = harness.fused(grads, WORKERS) + harness.fused(state.residual, WORKERS)
      mean, state = step(stage)(PARAMS, state, grads)
      check_step(a, harness.fused(state.residual, WORKERS), harness.fused(mean, 1)[0], density)
  assert sent_bytes == sorted(sent_bytes, reverse=True) and sent_bytes[0] > sent_bytes[-1]


def test_topk_warmup_sends_each_stage_s_bytes_and_loses_nothing():
  def check_step(a, kept, mean, density):
    sent = harness.topk_reference(a, round(density * SIZE))
    np.testing.assert_array_equal(kept, a - sent)
    np.testing.assert_allclose(mean, sent.mean(0), rtol=1e-5, atol=1e-6)
  _bookkeeping(lambda d: compressors.compress(compressors.topk(d), axis_name="data"), 0.01,
               compressors.warmup_densities(0.01, 0.25, 2), check_step)


@pytest.mark.slow  # a variant (20 s on 2 busy cores): top-k's and TASC's warm-ups stay default
def test_randomk_warmup_sends_each_stage_s_bytes_and_loses_nothing():
  def check_step(a, kept, mean, density):
    chosen = (kept == 0).all(axis=0)  # the shared indices
    assert chosen.sum() == round(density * SIZE)
    np.testing.assert_array_equal(kept, np.where(chosen, 0, a))
    np.testing.assert_allclose(mean, np.where(chosen, a, 0).mean(0), rtol=1e-5, atol=1e-6)
  _bookkeeping(lambda d: compressors.compress(compressors.randomk(d), axis_name="data"), 0.01,
               compressors.warmup_densities(0.01, 0.25, 2), check_step)


def _tasc(density, **kw):
  return tasc.tasc_compress(axis_name="data", density=density, sensitivity="fisher", **kw)


def test_tasc_warmup_sends_each_stage_s_bytes_and_loses_nothing():
  # Automatic blocks: 32 at 2% (33 blocks of 1048 entries keep round(0.66) = 1), 256 at 25%.
  final, densities = 0.02, compressors.warmup_densities(0.02, 0.25, 2)
  block = plan_lib.auto_block_size(SIZE, final)

  def check_step(a, kept, mean, density):
    padded = -SIZE % block
    rows = lambda x: np.pad(x, ((0, 0), (0, padded))).reshape(x.shape[0], -1, block)
    chosen = (rows(kept) == 0).all(axis=(0, 2))  # the shared support
    assert chosen.sum() == round(density * chosen.size)
    sent = np.repeat(chosen, block)[:SIZE][None]
    np.testing.assert_array_equal(kept, np.where(sent, 0, a))
    np.testing.assert_allclose(mean, np.where(sent, a, 0).mean(0), rtol=1e-5, atol=1e-6)
  _bookkeeping(lambda d: _tasc(d, block_density=final), final, densities, check_step)


def test_tasc_stages_cut_into_other_blocks_are_refused():
  tx = compressors.density_warmup(_tasc, 0.02, compressors.warmup_densities(0.02, 0.25, 2))
  with pytest.raises(ValueError, match="stage 0 .* block_density=final"):
    jax.eval_shape(jax.shard_map(tx.init, mesh=harness.mesh(WORKERS), in_specs=P(),
                                 out_specs=P(), check_vma=False), PARAMS)


def test_stages_receive_the_extra_arguments():
  """TASC's curvature reaches the stage's update (its EMA moves from zero)."""
  tx = compressors.density_warmup(
      lambda d: tasc.tasc_compress(axis_name=None, density=d, block_size=8, block_density=0.1),
      0.1, [0.5])
  grads = {"w": jnp.arange(64.0)}
  _, state = tx.update(grads, tx.init(grads), density_stage=0, curvature={"w": jnp.ones(64)})
  np.testing.assert_allclose(state.buffers.compressor.curvature, 0.1, rtol=1e-6)


def test_update_refuses_a_stage_it_does_not_have():
  tx = compressors.density_warmup(
      lambda d: compressors.compress(compressors.topk(d), axis_name=None), 0.01, [0.25])
  grads = {"w": jnp.ones((128,))}
  with pytest.raises(ValueError, match="density_stage=1 is not a stage"):
    tx.update(grads, tx.init(grads), density_stage=1)
  with pytest.raises(TypeError, match="density_stage must be a Python int"):
    jax.jit(lambda s: tx.update(grads, tx.init(grads), density_stage=s))(0)


def test_data_parallel_runs_the_stages_as_step_kinds():
  mesh = jax.make_mesh((WORKERS,), ("data",))
  final = 0.01
  densities = compressors.warmup_densities(final, 0.25, 2)
  exchange = compressors.density_warmup(
      lambda d: compressors.compress(compressors.topk(d), axis_name="data"), final, densities)
  tx = optax.chain(exchange, optax.sgd(0.1))
  x = jax.random.normal(jax.random.PRNGKey(0), (WORKERS * 4, 64))
  batch = (x, x @ jax.random.normal(jax.random.PRNGKey(1), (64, 16)))
  params = {"w": jnp.zeros((64, 16)), "b": jnp.zeros((16,))}
  loss = lambda p, b: jnp.mean((b[0] @ p["w"] + p["b"] - b[1]) ** 2)
  kinds = compressors.warmup_kinds(method_protocol.step_kinds(), steps=4, stages=len(densities))
  dp = compressors.data_parallel(loss, tx, mesh, params, batch, kinds=kinds)
  expected = ["step@0", "step@0", "step@1", "step@1", "step", "step"]
  assert [dp.kind_at(s) for s in range(6)] == expected
  state = dp.init(params)
  moved = {k: dp.wire_bytes(params, state, batch, kind=k).total for k in set(expected)}
  assert moved["step@0"] > moved["step@1"] > moved["step"]
  losses = []
  for s in range(6):
    params, state, metrics = dp.step(params, state, batch, kind=dp.kind_at(s))
    losses.append(float(metrics["loss"]))
    harness.assert_replicas_identical(params)
    assert bool(dp.replicas_agree(params))
  assert losses[-1] < losses[0]
