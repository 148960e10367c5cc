"""TASC against a numpy reference of its algorithm, and its behaviour on 8 simulated workers."""

import dataclasses
import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import compressors
from compressors import equal_bytes
from compressors import registry
from compressors.network import topology as topology_lib
import optimizers
import tasc
from tasc import _compressor as compressor_lib
from tasc import _plan as plan_lib
from tasc import _scores as scores
from tasc import _selection as selection
from tests import harness

pytestmark = pytest.mark.usefixtures("fast_compiles")

N = 8
PARAMS = {"a": jnp.zeros((12, 10)), "b": jnp.zeros((7,))}  # fused: b (7) then a (120)
D = 127


def _unfused(flat: np.ndarray, like=PARAMS) -> dict:
  leaves, treedef = jax.tree.flatten(like)
  out, start = [], 0
  for x in leaves:
    out.append(jnp.asarray(flat[..., start:start + x.size].reshape(flat.shape[:-1] + x.shape)))
    start += x.size
  return treedef.unflatten(out)


def _runner(tx, mesh, params, *, check_vma=True, axis=("data",)):
  """(state, update) for ``tx`` under shard_map; update(params, state, grads, curvature=None).

  Gradients and curvature carry a leading worker axis (one row per device, spec ``P(axis)``).
  ``check_vma=False`` where the schedule's ppermute types the mean per-worker.
  """
  try:  # each worker's curvature estimate makes its curvature state per-worker
    specs = compressors.state_specs(tx, params, mesh, axis, check_updates=check_vma,
                                    curvature=params)
  except ValueError as err:
    assert "does not use it" in str(err), err
    specs = compressors.state_specs(tx, params, mesh, axis, check_updates=check_vma)
  state = jax.jit(jax.shard_map(lambda p: compressors.add_device_axis(tx.init(p), specs),
                                mesh=mesh,
                                in_specs=P(), out_specs=specs))(params)

  def body(params, state, grads, curvature):
    state = compressors.drop_device_axis(state, specs)
    grads = jax.tree.map(lambda g: g[0], grads)
    curvature = None if curvature is None else jax.tree.map(lambda h: h[0], curvature)
    mean, state = tx.update(grads, state, params, curvature=curvature)
    return mean, compressors.add_device_axis(state, specs)

  def mapped(with_curvature):
    in_specs = (P(), specs, P(axis)) + ((P(axis),) if with_curvature else ())
    fn = body if with_curvature else (lambda p, s, g: body(p, s, g, None))
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=(P(), specs),
                                 check_vma=check_vma))

  with_curvature, without = mapped(True), mapped(False)

  def update(params, state, grads, curvature=None):
    if curvature is None:
      return without(params, state, grads)
    return with_curvature(params, state, grads, curvature)

  update.jitted = (with_curvature, without)
  return state, update


# ----------------------------------------------------------------------------- numpy reference


def _blocks(x: np.ndarray, b: int) -> np.ndarray:
  nb = -(-x.shape[-1] // b)
  pad = np.zeros(x.shape[:-1] + (nb * b - x.shape[-1],), x.dtype)
  return np.concatenate([x, pad], axis=-1).reshape(x.shape[:-1] + (nb, b))


def _block_means(x: np.ndarray, b: int) -> np.ndarray:
  d = x.shape[-1]
  counts = np.minimum(b, d - b * np.arange(-(-d // b)))
  return _blocks(x, b).sum(-1) / counts


def _weights(c: np.ndarray, d: int, b: int, eps: float) -> np.ndarray:
  counts = np.minimum(b, d - b * np.arange(c.shape[-1]))
  mean = (c * counts).sum(-1, keepdims=True) / d
  return np.where(mean > 0, c + eps * mean, 1.0)


class Reference:
  """TASC on ``n`` workers in float64 numpy, straight from the module docstrings."""

  def __init__(self, d, *, density, block_size, sensitivity, support, decay=0.9, eps=0.1,
               wire="float32", score="saliency"):
    self.d, self.b, self.sens, self.support, self.wire = d, block_size, sensitivity, support, wire
    self.score = score
    self.nb = -(-d // block_size)
    self.k = int(round(density * self.nb))
    self.decay, self.eps = decay, eps
    self.e = np.zeros((N, d))
    self.c = np.zeros((N, self.nb))
    self.prev = np.zeros(self.nb)

  def step(self, g, h=None):
    """Returns (mean, new residual, selected blocks)."""
    if self.sens == "fisher":
      self.c = self.decay * self.c + (1 - self.decay) * _block_means(g * g, self.b)
    if self.sens == "hutchinson" and h is not None:
      self.c = self.decay * self.c + (1 - self.decay) * _block_means(np.abs(h), self.b)
    a = g + self.e
    blocks = _blocks(a, self.b)
    energy = (blocks ** 2).sum(-1)
    w = np.ones_like(energy) if self.sens == "none" else _weights(self.c, self.d, self.b,
                                                                  self.eps)
    if self.score == "newton":  # the diagonal Newton decrement: energy over curvature
      w = 1.0 / w
    priority = self._wire(w * energy).mean(0) if self.support == "global" else self.prev
    chosen = np.argsort(-priority, kind="stable")[:self.k]
    mask = np.zeros(self.nb, bool)
    mask[chosen] = True
    sent = np.where(mask[None, :, None], blocks, 0.0)
    self.prev = self._wire(w * ((blocks - sent) ** 2).sum(-1)).mean(0)
    sent = sent.reshape(N, -1)[:, :self.d]
    self.e = a - sent
    return sent.mean(0), self.e, np.sort(chosen)

  def _wire(self, scores):
    """The scores as they travel: float16 ones are each worker's over its largest."""
    if self.wire == "float32":
      return scores
    return (scores / scores.max(-1, keepdims=True)).astype(np.float16).astype(np.float64)


def _selected_blocks(mean: np.ndarray, b: int) -> np.ndarray:
  return np.flatnonzero(np.abs(_blocks(mean, b)).sum(-1) > 0)


@pytest.mark.parametrize("support", ["global", "previous"])
@pytest.mark.parametrize("sensitivity, score", [
    ("hutchinson", "saliency"), ("fisher", "saliency"), ("none", "saliency"),
    ("hutchinson", "newton"), ("fisher", "newton")])
def test_aggregate_matches_numpy_reference(sensitivity, score, support):
  density, block = 0.3, 8  # 16 blocks, the last one 7 long; K = 5
  tx = tasc.tasc_compress(axis_name="data", density=density, block_size=block,
                          sensitivity=sensitivity, score=score, support=support)
  state, update = _runner(tx, harness.mesh(), PARAMS, check_vma=True)
  ref = Reference(D, density=density, block_size=block, sensitivity=sensitivity,
                  support=support, score=score)
  rng = np.random.default_rng(0)
  for t in range(4):
    g = rng.normal(size=(N, D)).astype(np.float32) * rng.uniform(0.1, 3, size=(1, D))
    # Per-worker curvature (they need not agree: the summed scores decide), on steps 0 and 2
    # only: steps 1 and 3 rank with the EMA kept in the state.
    h = (rng.normal(size=(N, D)) * np.linspace(0.01, 5, D)).astype(np.float32)
    use_h = sensitivity == "hutchinson" and t % 2 == 0
    mean, state = update(PARAMS, state, _unfused(g), _unfused(h) if use_h else None)
    want_mean, want_e, chosen = ref.step(g.astype(np.float64), h if use_h else None)
    mean = harness.fused(mean, 1)[0]
    np.testing.assert_array_equal(_selected_blocks(mean, block), chosen)
    np.testing.assert_allclose(mean, want_mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(harness.fused(state.residual, N), want_e, rtol=1e-5, atol=1e-6)


def test_block_scores_formula():
  rng = np.random.default_rng(1)
  x = rng.normal(size=(50,)).astype(np.float32)
  h = rng.normal(size=(50,)).astype(np.float32)  # negative entries count by their size
  got = tasc.block_scores(jnp.asarray(x), jnp.asarray(h), block_size=16, eps=0.5)
  c = _block_means(np.abs(h[None]), 16)[0]  # the 2-long tail block averages over 2
  want = (c + 0.5 * np.abs(h).mean()) * (_blocks(x[None], 16)[0] ** 2).sum(-1)
  np.testing.assert_allclose(got, want, rtol=1e-6)
  # Scale-free in the curvature; magnitude alone without it, or where it is all zero.
  np.testing.assert_allclose(tasc.block_scores(x, 1e3 * h, block_size=16, eps=0.5), 1e3 * want,
                             rtol=1e-5)
  magnitude = (_blocks(x[None], 16)[0] ** 2).sum(-1)
  np.testing.assert_allclose(tasc.block_scores(x, block_size=16), magnitude, rtol=1e-6)
  np.testing.assert_allclose(tasc.block_scores(x, 0 * h, block_size=16), magnitude, rtol=1e-6)
  # The diagonal Newton decrement divides by the same weight, and is scale-free too.
  newton = tasc.block_scores(x, h, block_size=16, eps=0.5, score="newton")
  np.testing.assert_allclose(newton, magnitude ** 2 / want, rtol=1e-5)
  np.testing.assert_allclose(tasc.block_scores(x, 1e3 * h, block_size=16, eps=0.5,
                                               score="newton"), newton / 1e3, rtol=1e-5)
  np.testing.assert_allclose(tasc.block_scores(x, 0 * h, block_size=16, score="newton"),
                             magnitude, rtol=1e-6)


# ----------------------------------------------------------------------------- the idea itself

QUAD_BLOCK, QUAD_BLOCKS = 8, 64
QUAD_D = QUAD_BLOCK * QUAD_BLOCKS


def _quadratic():
  """A separable quadratic ``1/2 sum_i h_i w_i^2`` with 24 sharp and 40 flat blocks.

  Flat blocks (``h = 0.01``, ``w = 30``) have gradients ``0.3``; sharp blocks (``h = 1``,
  ``w = 0.1``) have gradients ``0.1``: the largest gradients sit in the flat directions.
  """
  rng = np.random.default_rng(0)
  sharp_blocks = np.sort(rng.permutation(QUAD_BLOCKS)[:24])
  sharp = np.zeros(QUAD_BLOCKS, bool)
  sharp[sharp_blocks] = True
  h = np.where(np.repeat(sharp, QUAD_BLOCK), 1.0, 0.01).astype(np.float32)
  w0 = np.where(np.repeat(sharp, QUAD_BLOCK), 0.1, 30.0) * rng.choice([-1, 1], QUAD_D)
  return jnp.asarray(h), {"w": jnp.asarray(w0, jnp.float32)}, sharp_blocks


def test_curvature_picks_sharp_blocks_where_magnitude_picks_flat_ones():
  h, params, sharp_blocks = _quadratic()
  g = h * params["w"]
  k = 8
  with_curvature = np.argsort(-np.asarray(tasc.block_scores(g, h, block_size=QUAD_BLOCK)))[:k]
  by_magnitude = np.argsort(-np.asarray(tasc.block_scores(g, block_size=QUAD_BLOCK)))[:k]
  assert set(with_curvature) <= set(sharp_blocks)
  assert not set(by_magnitude) & set(sharp_blocks)
  # The same through the transformation (one worker, no collective): the blocks it sends.
  for sensitivity, curvature, want_sharp in (("hutchinson", {"w": h}, True), ("none", None, False)):
    tx = tasc.tasc_compress(axis_name=None, density=k / QUAD_BLOCKS, block_size=QUAD_BLOCK,
                            sensitivity=sensitivity)
    mean, _ = tx.update({"w": g}, tx.init(params), params, curvature=curvature)
    sent = set(_selected_blocks(np.asarray(mean["w"]), QUAD_BLOCK))
    assert len(sent) == k and (sent <= set(sharp_blocks)) == want_sharp
    assert (not sent & set(sharp_blocks)) != want_sharp


def _train_quadratic(tx, steps, curvature):
  """SGD on the quadratic, every worker with the full gradient, under shard_map."""
  h, params, _ = _quadratic()
  loss = lambda p: 0.5 * jnp.sum(h * p["w"] ** 2)
  mesh = harness.mesh()
  extra = {"curvature": params} if curvature else {}
  specs = compressors.state_specs(tx, params, mesh, "data", check_updates=False, **extra)
  state = jax.jit(jax.shard_map(lambda p: compressors.add_device_axis(tx.init(p), specs),
                                mesh=mesh,
                                in_specs=P(), out_specs=specs))(params)

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), specs), out_specs=(P(), specs),
                     check_vma=False)
  def step(params, state):
    state = compressors.drop_device_axis(state, specs)
    grads = jax.grad(loss)(params)
    extra = {}
    if curvature:  # exact here: for a diagonal Hessian z * Hz = h whatever the probe
      extra["curvature"] = tasc.hutchinson_diagonal(loss, params, jax.random.PRNGKey(0), 1,
                                                    axis_name="data")
    updates, state = tx.update(grads, state, params, **extra)
    return optax.apply_updates(params, updates), compressors.add_device_axis(state, specs)

  losses = []
  for _ in range(steps):
    params, state = step(params, state)
    losses.append(0.5 * np.sum(np.asarray(h) * np.asarray(params["w"]) ** 2))
  return np.array(losses)


def test_tasc_reaches_lower_loss_than_magnitude_at_equal_density():
  density, steps, sgd = 8 / QUAD_BLOCKS, 40, optax.sgd(0.5)
  curves = {
      "tasc": _train_quadratic(optax.chain(tasc.tasc_compress(
          axis_name="data", density=density, block_size=QUAD_BLOCK), sgd), steps, True),
      "block magnitude": _train_quadratic(optax.chain(tasc.tasc_compress(
          axis_name="data", density=density, block_size=QUAD_BLOCK, sensitivity="none"), sgd),
                                          steps, False),
      "top-k": _train_quadratic(optax.chain(compressors.compress(
          compressors.topk(density), axis_name="data"), sgd), steps, False),
  }
  for name, curve in curves.items():
    print(f"{name:>16}: loss {curve[0]:.1f} -> {curve[steps // 2]:.1f} -> {curve[-1]:.1f}")
  assert curves["tasc"][-1] < 0.95 * curves["block magnitude"][-1]
  assert curves["tasc"][-1] < 0.95 * curves["top-k"][-1]


@pytest.mark.parametrize("support", ["global", "previous"])
def test_float16_wire_matches_numpy_reference_to_float16_precision(support):
  density, block = 0.3, 8
  tx = tasc.tasc_compress(axis_name="data", density=density, block_size=block,
                          sensitivity="hutchinson", support=support, wire_dtype="float16")
  state, update = _runner(tx, harness.mesh(), PARAMS, check_vma=True)
  ref = Reference(D, density=density, block_size=block, sensitivity="hutchinson",
                  support=support, wire="float16")
  rng = np.random.default_rng(1)
  for t in range(4):
    g = rng.normal(size=(N, D)).astype(np.float32) * rng.uniform(0.1, 3, size=(1, D))
    h = (rng.normal(size=(N, D)) * np.linspace(0.01, 5, D)).astype(np.float32)
    use_h = t % 2 == 0
    mean, state = update(PARAMS, state, _unfused(g), _unfused(h) if use_h else None)
    want_mean, want_e, chosen = ref.step(g.astype(np.float64), h if use_h else None)
    mean = harness.fused(mean, 1)[0]
    np.testing.assert_array_equal(_selected_blocks(mean, block), chosen)
    # float16 keeps 11 significant bits of values scaled to about 1/n of its range.
    scale = np.abs(g).max()
    np.testing.assert_allclose(mean, want_mean, rtol=2e-3, atol=1e-3 * scale)
    residual = harness.fused(state.residual, N)
    np.testing.assert_allclose(residual, want_e, rtol=0, atol=1e-3 * scale)
    ref.e = residual.astype(np.float64)  # follow the device's rounding from here


# ----------------------------------------------------------------------------- invariants


@pytest.mark.parametrize("support", ["global", "previous"])
def test_replicas_bit_identical_and_error_feedback_exact_over_twenty_steps(support):
  tx = tasc.tasc_compress(axis_name="data", density=0.2, block_size=4, sensitivity="fisher",
                          support=support, min_blocks_per_leaf=1)
  state, update = _runner(tx, harness.mesh(), PARAMS, check_vma=True)
  e = np.zeros((N, D), np.float32)
  rng = np.random.default_rng(0)
  for _ in range(20):
    g = rng.normal(size=(N, D)).astype(np.float32)
    mean, state = update(PARAMS, state, _unfused(g))
    harness.assert_replicas_identical(mean)
    a = g + e  # float32, the same single addition compress() makes
    e = harness.fused(state.residual, N)
    sent = a - e
    # Exact: every element is either sent whole (residual 0) or kept whole (residual == a).
    assert np.all((e == 0) | (e == a))
    np.testing.assert_array_equal(sent + e, a)
    np.testing.assert_allclose(harness.fused(mean, 1)[0], sent.mean(0), rtol=1e-5, atol=1e-6)
  if support == "previous":
    harness.assert_replicas_identical(state.buffers.compressor.scores)


@pytest.mark.parametrize("support", ["global", "previous"])
def test_float16_wire_keeps_its_rounding_exactly_and_never_overflows(support):
  """Values over 13 octaves (1e-7 to 1e6), where an unscaled float16 sum would overflow.

  With ``"previous"`` the first step's scale (1) clips the largest values, and the next
  steps' scales come from the bounds: error feedback keeps what was clipped.
  """
  tx = tasc.tasc_compress(axis_name="data", density=0.3, block_size=8, sensitivity="none",
                          support=support, wire_dtype="float16")
  state, update = _runner(tx, harness.mesh(), PARAMS, check_vma=True)
  e = np.zeros((N, D), np.float32)
  rng = np.random.default_rng(0)
  rounded = 0
  for _ in range(10):
    g = (rng.normal(size=(N, D)) * 10.0 ** rng.uniform(-7, 6, size=(1, D))).astype(np.float32)
    mean, state = update(PARAMS, state, _unfused(g))
    harness.assert_replicas_identical(mean)
    mean = harness.fused(mean, 1)[0]
    assert np.all(np.isfinite(mean))
    a = g + e
    e = harness.fused(state.residual, N)
    sent = a - e
    np.testing.assert_array_equal(sent + e, a)  # what float16 dropped is kept, exactly
    selected = np.abs(_blocks(mean, 8)).sum(-1) > 0
    rounded += np.count_nonzero((e != 0) & np.repeat(selected, 8)[:D])
    # The all-reduce adds float16s: each partial sum keeps 11 significant bits.
    np.testing.assert_array_less(np.abs(mean - sent.mean(0)),
                                 2.0 ** -10 * np.abs(sent).sum(0) / N + 1e-6 * np.abs(sent).max())
  assert rounded > 0  # the rounding error is real, and it is what error feedback kept
  if support == "previous":
    scale = np.asarray(state.buffers.compressor.scale)
    harness.assert_replicas_identical(state.buffers.compressor.scale)
    np.testing.assert_array_equal(np.exp2(np.round(np.log2(scale))), scale)  # a power of two


def test_min_blocks_per_leaf_keeps_every_leaf_moving():
  # Leaf b's gradients are 1000x smaller: by the ranking alone it would never be sent.
  tx = tasc.tasc_compress(axis_name="data", density=0.1, block_size=4, sensitivity="none",
                          min_blocks_per_leaf=1)
  state, update = _runner(tx, harness.mesh(), PARAMS)
  g = harness.per_worker_grads(jax.random.PRNGKey(0), N, PARAMS)
  g = {"a": g["a"], "b": 1e-3 * g["b"]}
  mean, _ = update(PARAMS, state, g)
  assert np.count_nonzero(np.asarray(mean["b"])) > 0
  # Block 1 (elements 4..7) holds b's tail and a's head; it is b's, the smaller leaf.
  groups = selection.leaf_groups([7, 120], 4)
  assert groups.tolist()[0][:3] == [0, 0, 1]
  # Four shards (hierarchical mode) of 31 elements, blocks cut within each shard; the last
  # shard ends in padding (elements 121..123), a block of no leaf.
  shards = selection.leaf_groups([7, 114], 4, num_shards=4)
  assert shards.shape == (4, 8) and shards[3, -1] == -1 and shards[1, 0] == 1


def test_density_schedule_sends_fewer_blocks_over_a_fixed_capacity():
  blocks = -(-D // 4)  # 32
  schedule = optax.linear_schedule(0.5, 0.125, transition_steps=2)
  tx = tasc.tasc_compress(axis_name="data", density=schedule, max_density=0.5, block_size=4,
                          sensitivity="none")
  state, update = _runner(tx, harness.mesh(), PARAMS)
  for t in range(3):
    g = harness.per_worker_grads(jax.random.PRNGKey(t), N, PARAMS)
    mean, state = update(PARAMS, state, g)
    sent = _selected_blocks(harness.fused(mean, 1)[0], 4).size
    assert sent == round(float(schedule(t)) * blocks), (t, sent)
  assert update.jitted[1]._cache_size() == 1  # one program for every density


@pytest.mark.parametrize("size", [64, 72, 10, 67, 1000])  # whole blocks, tail, one short block,
@pytest.mark.parametrize("fn", [None, jnp.square, jnp.abs])  # odd (no 2-D view wider than 1)
def test_block_sums_without_padding_match_numpy(size, fn):
  x = np.random.default_rng(size).normal(size=(size,)).astype(np.float32)
  want = _blocks((x if fn is None else np.asarray(fn(x)))[None].astype(np.float64), 16)[0]
  np.testing.assert_allclose(scores.block_sums(jnp.asarray(x), 16, fn), want.sum(-1),
                             rtol=1e-5, atol=1e-6)


# Sizes whose widest 2-D view [d / q, q] (q = gcd(d, 16)) is each form the GPUs' sums take:
# q = 16 (whole blocks), 8 and 4 (row sums, then blocks, with and without a tail), 2 and 1 (the
# blocks summed directly), and one short block.
@pytest.mark.parametrize("size", [64, 1000, 72, 68, 60, 1002, 67, 10])
@pytest.mark.parametrize("fn", [None, jnp.square])
def test_block_sums_as_gpus_compute_them_match_numpy(size, fn):
  """The GPU form of block_sums (row sums XLA's GPU backend fuses into the pass that writes the
  buffer), run here on the CPU: the same sums as float64 numpy's."""
  x = np.random.default_rng(size).normal(size=(size,)).astype(np.float32)
  want = _blocks((x if fn is None else np.asarray(fn(x)))[None].astype(np.float64), 16)[0]
  got = (scores._block_sums_of_rows(jnp.asarray(x), block_size=16, fn=fn or (lambda v: v))
         if size >= 16 else scores.block_sums(jnp.asarray(x), 16, fn))
  np.testing.assert_allclose(got, want.sum(-1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("size", [25_557_032, 109_482_240])  # ResNet-50's and BERT-base's B1 sizes
def test_block_energies_lowered_for_a_gpu_reduce_the_buffer_not_a_window_of_it(size):
  """Lowered for CUDA, ``g + e`` and its block energies are a plain reduction over a reshape of
  the sum (which XLA's GPU backend writes and reduces in one kernel); a windowed sum, the CPU's
  form, is not fused so and costs the GPU a second read of the buffer. Lowered for the CPU, the
  windowed sum stays."""
  x = jax.ShapeDtypeStruct((size,), jnp.float32)
  energies = jax.jit(lambda g, e: scores.block_energies(g + e, 256))
  gpu = energies.trace(x, x).lower(lowering_platforms=("cuda",)).as_text()
  cpu = energies.trace(x, x).lower(lowering_platforms=("cpu",)).as_text()
  assert "reduce_window" not in gpu and "stablehlo.reduce" in gpu
  assert "reduce_window" in cpu


def test_block_sums_gpu_form_in_a_step_with_simulated_workers():
  """The GPU form where a GPU step runs it: under vmap over 4 simulated workers per device,
  inside shard_map with its type checks on. Run here on 2 CPU devices it gives numpy's sums;
  traced on 2 abstract H100s and lowered for CUDA, block_sums takes it (no windowed sum)."""
  size, workers = 1000, 8  # q = gcd(1000, 16) = 8: row sums, then blocks, with a tail
  gpu_form = functools.partial(scores._block_sums_of_rows, block_size=16, fn=jnp.square)
  x = np.random.default_rng(0).normal(size=(workers, size)).astype(np.float32)
  run = jax.jit(jax.shard_map(jax.vmap(gpu_form), mesh=harness.mesh(2), in_specs=P("data"),
                              out_specs=P("data")))
  want = _blocks(np.square(x.astype(np.float64)), 16).sum(-1)
  np.testing.assert_allclose(run(x), want, rtol=1e-5, atol=1e-6)

  mesh = harness.h100_mesh(2)
  step = jax.shard_map(jax.vmap(lambda v: scores.block_energies(v, 16)), mesh=mesh,
                       in_specs=P("data"), out_specs=P("data"))
  abstract = jax.ShapeDtypeStruct((workers, size), jnp.float32,
                                  sharding=jax.sharding.NamedSharding(mesh, P("data")))
  with jax.sharding.use_abstract_mesh(mesh):
    text = jax.jit(step).trace(abstract).lower(lowering_platforms=("cuda",)).as_text()
  assert "reduce_window" not in text and "stablehlo.reduce" in text


@pytest.mark.parametrize("size", [64, 72, 10, 67, 100])
@pytest.mark.parametrize("tail_scale", [100.0, 0.01])  # the short tail block sent, or kept
def test_local_step_sends_the_top_blocks_and_keeps_the_rest_exactly(size, tail_scale):
  """One worker, no collective (as the compression benchmark runs it), buffers of any length."""
  block, density = 16, 0.6
  rng = np.random.default_rng(size)
  g = rng.normal(size=(size,)) * rng.uniform(0.1, 3, size=(size,))
  g[size - size % block:] *= tail_scale
  g = g.astype(np.float32)
  e = rng.normal(size=(size,)).astype(np.float32)
  tx = tasc.tasc_compress(axis_name=None, density=density, block_size=block,
                          sensitivity="none")
  state = tx.init({"w": jnp.zeros((size,))})._replace(residual={"w": jnp.asarray(e)})
  update = jax.jit(tx.update, donate_argnums=(0, 1))
  mean, state = update({"w": jnp.asarray(g)}, state)
  a = g + e  # float32, the single addition the step makes
  blocks = -(-size // block)
  chosen = np.argsort(-(_blocks(a[None].astype(np.float64), block)[0] ** 2).sum(-1),
                      kind="stable")[:round(density * blocks)]
  sent = np.zeros(blocks, bool)
  sent[chosen] = True
  sent = np.repeat(sent, block)[:size]
  np.testing.assert_array_equal(np.asarray(mean["w"]), np.where(sent, a, 0))
  np.testing.assert_array_equal(np.asarray(state.residual["w"]), np.where(sent, 0, a))


@pytest.mark.parametrize("support", ["global", "previous"])
def test_local_step_compiles_in_place_without_padding(support):
  """The compiled step holds no padded or copied full-size buffer: its scratch memory is a
  small fraction of one buffer (the gathered blocks and the block scores) and no pad, copy or
  concatenate produces a full-size array. The old padded blocked view failed both, and
  ``"previous"`` failed the first while its mean's zeros did not wait for the scores."""
  size, block = 256 * 100 + 40, 256  # a tail block; rows of 8 elements tile the whole blocks
  tx = tasc.tasc_compress(axis_name=None, density=0.05, block_size=block, support=support)
  params = {"w": jax.ShapeDtypeStruct((size,), jnp.float32)}
  state = jax.eval_shape(tx.init, params)
  compiled = jax.jit(tx.update, donate_argnums=(0, 1)).lower(params, state).compile()
  assert compiled.memory_analysis().temp_size_in_bytes < size  # < 1/4 of one f32 buffer
  hlo = compiled.as_text()
  full_size = [m.group(0) for m in re.finditer(
      r"= f32\[([\d,]+)\]\S* (pad|copy|concatenate)\(", hlo)
               if math.prod(int(n) for n in m.group(1).split(",")) >= size]
  assert not full_size, full_size


@pytest.mark.parametrize("leaves,axis,one_pass", [
    ([(5000,)], None, True),  # the jit's own flat argument
    ([(50, 100)], None, False),  # a reshape of the argument: XLA would copy it in and out
    ([(5000,)], "data", False),  # per-worker state, reshaped by drop_device_axis
    ([(50, 100), (700,)], "data", True),  # leaves concatenated: buffers the step made
])
def test_one_pass_kernel_only_where_it_writes_in_place(leaves, axis, one_pass):
  """TASC takes g + e and the block energies in one pass (tasc.fused) on buffers it may
  overwrite, and the kernel then writes over them with no copy."""
  params = {f"w{i}": jnp.zeros(shape) for i, shape in enumerate(leaves)}
  tx = tasc.tasc_compress(axis_name=axis, density=0.05, block_size=64)
  if axis is None:
    state = jax.eval_shape(tx.init, params)
    hlo = jax.jit(tx.update, donate_argnums=(0, 1)).lower(params, state).compile().as_text()
  else:
    mesh = harness.mesh()
    specs = compressors.state_specs(tx, params, mesh, axis)
    state = jax.eval_shape(jax.shard_map(lambda p: compressors.add_device_axis(tx.init(p), specs),
                                         mesh=mesh, in_specs=P(), out_specs=specs), params)
    step = jax.jit(jax.shard_map(
        lambda g, s: tx.update(jax.tree.map(lambda x: x[0], g),
                               compressors.drop_device_axis(s, specs)),
        mesh=mesh, in_specs=(P(axis), specs), out_specs=(P(), specs)), donate_argnums=(0, 1))
    grads = {k: jax.ShapeDtypeStruct((N,) + v.shape, v.dtype) for k, v in params.items()}
    hlo = step.lower(grads, state).compile().as_text()
  calls = re.findall(r"custom-call\(([^)]*)\), custom_call_target=\"tasc_residual_energies\"", hlo)
  assert len(calls) == int(one_pass)
  for operand in calls[0].split(", ") if calls else ():  # not a copy of an argument
    assert not re.match(r"%(bitcast_)?copy", operand), calls


def test_cost_model_prices_the_scores_and_the_blocks_and_sets_the_density_for_a_budget():
  """A 25.6M buffer in blocks of 256: 1000 blocks of 1 KiB and the 100000 scores are two
  all-reduces of 1,424,000 bytes of operands, whatever the number of workers; the equal-bytes
  search finds that density back from those bytes."""
  shapes, block = [(25_600_000,)], 256
  topology = equal_bytes.topology(8)
  settings = tasc.TascSettings(density=1000 / 100_000, block_size=block)
  reduce = lambda n: topology_lib.all_reduce_cost("psum", topology, n).bytes_sent
  cost = lambda s: registry.cost("tasc", shapes, topology, s).bytes_sent
  assert cost(settings) == reduce(100_000) + reduce(1000 * block)
  assert reduce(1_424_000 // 4) == pytest.approx(reduce(100_000) + reduce(1000 * block))
  fitted = equal_bytes.fit_field(dataclasses.replace(settings, density=0.5), "density", cost,
                                 cost(settings))
  assert round(fitted.density * 100_000) == 1000


# ----------------------------------------------------------------------------- topology


def _two_level_mesh():
  return jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("slow", "fast"))


@pytest.mark.parametrize("mode", ["dense_fast", "sparse_both"])
def test_hierarchical_modes_match_flat_mode(mode):
  """With error feedback off, one step; the gradient is nonzero in 8 blocks of 16, 2 per fast
  shard, so every mode selects exactly those and the means agree up to summation order."""
  params = {"w": jnp.zeros((256,))}
  block = 16
  rng = np.random.default_rng(0)
  active = np.zeros(16, bool)
  active[[0, 3, 4, 6, 9, 10, 12, 15]] = True
  g = rng.normal(size=(N, 256)).astype(np.float32) * np.repeat(active, block)
  mesh = _two_level_mesh()
  axis = ("slow", "fast")
  # Fisher: in hierarchical mode its squared gradients are cut to the owned shard.
  common = dict(block_size=block, sensitivity="fisher", error_feedback=False)
  flat = tasc.tasc_compress(axis_name=axis, density=0.5, **common)
  density = 0.5 if mode == "dense_fast" else {"slow": 0.5, "fast": 0.5}
  hier = tasc.tasc_compress(axis_name="slow", dense_axis="fast", density=density, **common)
  means = []
  for tx, check_vma in ((flat, True), (hier, mode == "dense_fast")):
    # The hierarchical schedule is built from ppermutes, whose results JAX types as varying.
    state, update = _runner(tx, mesh, params, axis=axis, check_vma=check_vma)
    mean, _ = update(params, state, {"w": jnp.asarray(g)})
    harness.assert_replicas_identical(mean)
    means.append(np.asarray(mean["w"]))
  np.testing.assert_allclose(means[1], means[0], rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(means[0], g.mean(0), rtol=1e-6, atol=1e-7)


def test_pmap_matches_shard_map():
  tx = tasc.tasc_compress(axis_name="data", density=0.25, block_size=8)
  rng = np.random.default_rng(2)
  g = _unfused(rng.normal(size=(N, D)).astype(np.float32))
  h = _unfused(rng.uniform(0, 2, size=(N, D)).astype(np.float32))
  state, update = _runner(tx, harness.mesh(), PARAMS)
  want, _ = update(PARAMS, state, g, h)
  init, _ = harness.pmap_update(tx)
  replicated = jax.tree.map(lambda x: jnp.broadcast_to(x, (N,) + x.shape), PARAMS)
  pmapped = jax.pmap(lambda p, s, g, h: tx.update(g, s, p, curvature=h), axis_name="data")
  got, _ = pmapped(replicated, init(replicated), g, h)
  for leaf_got, leaf_want in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    for row in np.asarray(leaf_got):
      np.testing.assert_array_equal(row, leaf_want)


def test_no_recompilation_and_composes_with_lamb():
  tx = optax.chain(tasc.tasc_compress(axis_name="data", density=0.25, block_size=8),
                   optimizers.lamb(1e-2))
  state, update = _runner(tx, harness.mesh(), PARAMS, check_vma=False)
  for t in range(2):
    mean, state = update(PARAMS, state, harness.per_worker_grads(jax.random.PRNGKey(t), N,
                                                                 PARAMS))
    harness.assert_replicas_identical(mean)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(mean))
  assert update.jitted[1]._cache_size() == 1


# ----------------------------------------------------------------------------- settings


def test_settings_passed_whole_or_as_keywords_give_the_same_steps():
  """``tasc_compress(settings)``, its keywords, and keywords replacing a settings' fields build
  the same transformation, and so does the registry's method."""
  settings = tasc.TascSettings(density=0.25, block_size=8, sensitivity="none")
  variants = [
      tasc.tasc_compress(settings, axis_name="data"),
      tasc.tasc_compress(axis_name="data", density=0.25, block_size=8, sensitivity="none"),
      tasc.tasc_compress(dataclasses.replace(settings, density=0.5), axis_name="data",
                         density=0.25),
      registry.transformation("tasc", settings, axis_name="data"),
  ]
  g = harness.per_worker_grads(jax.random.PRNGKey(0), N, PARAMS)
  means = []
  for tx in variants:
    state, update = _runner(tx, harness.mesh(), PARAMS)
    means.append(update(PARAMS, state, g)[0])
  for mean in means[1:]:
    for got, want in zip(jax.tree.leaves(mean), jax.tree.leaves(means[0])):
      np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("min_blocks_per_leaf,builds", [(0, 1), (1, 2)])
def test_compressor_and_buffer_plan_are_made_once_not_per_trace(monkeypatch, min_blocks_per_leaf,
                                                                builds):
  """One compressor (a second for the leaf layout that ``min_blocks_per_leaf`` needs) and one
  plan per buffer size, however often init and update are traced."""
  made, planned = [], []
  make, plan = compressor_lib.tasc, plan_lib.buffer_plan
  monkeypatch.setattr(compressor_lib, "tasc", lambda *a, **k: made.append(1) or make(*a, **k))
  monkeypatch.setattr(plan_lib, "buffer_plan",
                      lambda s, size, *a: planned.append(size) or plan(s, size, *a))
  tx = tasc.tasc_compress(axis_name=None, density=0.25, block_size=8, sensitivity="none",
                          min_blocks_per_leaf=min_blocks_per_leaf)
  state = tx.init(PARAMS)
  for dtype in (jnp.float32, jnp.bfloat16):  # two traces of update
    grads = jax.tree.map(lambda x: jnp.ones(x.shape, dtype), PARAMS)
    jax.jit(tx.update)(grads, state, PARAMS)
  assert (len(made), planned) == (builds, [D])


def test_settings_checked_in_one_place_name_the_field():
  with pytest.raises(TypeError, match=r"tasc_compress: got an unexpected argument densty=0.1; "
                                      r"allowed: axis_name, .*TascSettings \['density', 'max_density'"):
    tasc.tasc_compress(axis_name="data", densty=0.1)
  with pytest.raises(TypeError, match=r"tasc_compress: settings must be a tasc.TascSettings, "
                                      r"got dict"):
    tasc.tasc_compress({"density": 0.1}, axis_name="data")
  with pytest.raises(ValueError, match=r"tasc: density=\{'data': 0.1\} names mesh axes, which "
                                       r"only tasc.tasc_compress resolves"):
    tasc.tasc(tasc.TascSettings(density={"data": 0.1}))
  with pytest.raises(ValueError, match=r"tasc: hessian_every=0 is below 1"):
    registry.step_inputs("tasc", tasc.TascSettings(hessian_every=0))
  with pytest.raises(ValueError, match=r"max_density=0.5 is only for a density schedule"):
    tasc.tasc_compress(axis_name="data", density=0.1, max_density=0.5)


# ----------------------------------------------------------------------------- bad input

BAD = [
    (dict(block_size=0), ValueError, r"block_size=0 is below 1"),
    (dict(block_size=2.5), TypeError, r"block_size must be an int >= 1, got 2.5"),
    (dict(density=0.0), ValueError, r"density=0.0 is outside \(0, 1\]"),
    (dict(density=1.5), ValueError, r"density=1.5 is outside \(0, 1\]"),
    (dict(sensitivity="hessian"), ValueError,
     r"sensitivity='hessian' is unknown; allowed: \('hutchinson', 'fisher', 'none'\)"),
    (dict(support="local"), ValueError,
     r"support='local' is unknown; allowed: \('global', 'previous'\)"),
    (dict(curvature_decay=1.0), ValueError, r"curvature_decay=1.0 is outside \[0, 1\)"),
    (dict(wire_dtype="int8"), ValueError,
     r"wire_dtype='int8' is unknown; allowed: \('float32', 'float16'\)"),
    (dict(wire_dtype=jnp.bfloat16), ValueError,
     r"wire_dtype='bfloat16' is unknown; allowed: \('float32', 'float16'\)"),
    (dict(eps=-1.0), ValueError, r"eps=-1.0 is outside \[0, inf\)"),
    (dict(score="hessian"), ValueError, r"score='hessian' is unknown; allowed: \('saliency', "
     r"'newton'\)"),
    (dict(score="newton", sensitivity="none"), ValueError,
     r"score='newton' divides each block's energy by its curvature, and sensitivity='none' "
     r"estimates none"),
    (dict(density=lambda step: 0.1), ValueError, r"max_density is required"),
    (dict(density={"data": 0.1, "model": 0.5}), ValueError, r"names axis 'model'"),
    (dict(dense_axis="fast", density={"data": 0.1, "fast": 0.5}), ValueError,
     r"the fast axis \(dense_axis='fast'\) must have density 1.0 .* or the slow axis's "
     r"density 0.1"),
]


@pytest.mark.parametrize("kwargs,error,message", BAD)
def test_bad_arguments_get_clear_errors(kwargs, error, message):
  with pytest.raises(error, match=message):
    tasc.tasc_compress(**{"axis_name": "data", "density": 0.1, **kwargs})


@pytest.mark.parametrize("curvature,message", [
    ({"a": jnp.zeros((12, 10))}, r"curvature must be a pytree like the gradients"),
    ({"a": jnp.zeros((12, 10)), "b": jnp.zeros((6,))},
     r"curvature leaf \['b'\] has shape \(6,\), the gradient leaf has shape \(7,\)"),
])
def test_curvature_not_matching_params_gets_a_clear_error(curvature, message):
  tx = tasc.tasc_compress(axis_name=None, density=0.5)
  state = tx.init(PARAMS)
  with pytest.raises(ValueError, match=message):
    tx.update(PARAMS, state, PARAMS, curvature=curvature)


def test_curvature_with_a_sensitivity_that_ignores_it_is_an_error():
  tx = tasc.tasc_compress(axis_name=None, density=0.5, sensitivity="fisher")
  with pytest.raises(ValueError, match=r"sensitivity='fisher' does not use it"):
    tx.update(PARAMS, tx.init(PARAMS), PARAMS, curvature=PARAMS)


def test_density_too_small_for_the_buffer_says_so_and_what_works():
  tx = tasc.tasc_compress(axis_name=None, density=0.01, block_size=8)
  with pytest.raises(ValueError, match=r"the fused gradient has \d+ elements: 16 blocks of "
                                       r"block_size=8, and density=0.01 keeps round\(0.01 \* 16\) "
                                       r"= 0 of them; use density >= 0.0312 or block_size=2 "
                                       r"\(then 64 blocks\)$"):
    tx.update(PARAMS, tx.init(PARAMS), PARAMS)


def test_the_readme_models_4k_parameters_work_at_one_percent():
  """256-element blocks would be 17 for 4,112 parameters, none of them sent at 1%: the automatic
  block size takes 64 (65 blocks, one sent); an explicit 256 says exactly that."""
  params = {"w": jnp.zeros((256, 16)), "b": jnp.zeros((16,))}
  grads = jax.tree.map(jnp.ones_like, params)
  tx = tasc.tasc_compress(axis_name=None, density=0.01, sensitivity="none")
  state = tx.init(params)
  assert state.buffers.compressor.scores == () and state.buffers.compressor.curvature == ()
  mean, _ = tx.update(grads, state, params)
  assert int(sum(np.count_nonzero(np.asarray(m)) for m in jax.tree.leaves(mean))) == 64
  explicit = tasc.tasc_compress(axis_name=None, density=0.01, block_size=256)
  with pytest.raises(ValueError, match=r"the fused gradient has 4112 elements: 17 blocks of "
                                       r"block_size=256, .* use density >= 0.0294 or "
                                       r"block_size=64 \(then 65 blocks\)$"):
    explicit.update(grads, explicit.init(params), params)
  per_leaf = tasc.tasc_compress(axis_name=None, density=0.01, fuse=False)
  with pytest.raises(ValueError, match=r"gradient leaf \['b'\] has 16 elements.*or fuse=True$"):
    per_leaf.update(grads, per_leaf.init(params), params)
