"""PowerSGD against a float64 numpy replay of Vogels et al.'s Algorithm 1, on 8 workers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import compressors
from tests import harness
from tests.test_two_phase import bytes_at

pytestmark = pytest.mark.usefixtures("fast_compiles")

N = 8
# Leaves in pytree order: a bias (dense), a conv kernel (36 x 8, rate 3.3 at rank 2), a small
# matrix (rate 0.86: dense) and a dense kernel (48 x 20, rate 7.1).
PARAMS = {"b": jnp.zeros((40,)), "conv": jnp.zeros((3, 3, 4, 8)), "small": jnp.zeros((4, 3)),
          "w": jnp.zeros((48, 20))}
LOW_RANK = ("conv", "w")


def _per_leaf(compressor, **kwargs):
  """PowerSGD's transformation: ``compress`` leaf by leaf."""
  return compressors.compress(compressor, axis_name="data", fuse=False, **kwargs)


def gram_schmidt(p: np.ndarray) -> np.ndarray:
  """The paper's orthogonalisation (float64)."""
  p = p.copy()
  for i in range(p.shape[1]):
    p[:, i] /= np.linalg.norm(p[:, i])
    p[:, i + 1:] -= p[:, i:i + 1] * (p[:, i:i + 1].T @ p[:, i + 1:])
  return p


def powersgd_reference(x: np.ndarray, q: np.ndarray):
  """One exchange of ``x`` (``[n, m, c]``, gradients plus residuals): (mean, new Q)."""
  p = gram_schmidt(np.einsum("imc,cr->mr", x, q) / len(x))
  q = np.einsum("imc,mr->cr", x, p) / len(x)
  return p @ q.T, q


def initial_q(seed: int, index: int, cols: int, rank: int) -> np.ndarray:
  return np.asarray(jax.random.normal(jax.random.fold_in(jax.random.PRNGKey(seed), index),
                                      (cols, rank)), np.float64)


def as_matrices(tree, name) -> np.ndarray:
  """Per-worker leaf ``[n, ...]`` as ``[n, prod(leading), last]``."""
  x = np.asarray(tree[name], np.float64)
  return x.reshape(x.shape[0], -1, x.shape[-1])


@pytest.mark.parametrize("rank", [1, 2])
def test_matches_numpy_over_steps_with_warm_start_and_error_feedback(rank):
  seed = 3
  tx = _per_leaf(compressors.powersgd(rank), seed=seed)
  state, update = harness.shard_map_update(tx, harness.mesh(), PARAMS)
  names = sorted(PARAMS)
  qs = {name: initial_q(seed, names.index(name), PARAMS[name].shape[-1], rank)
        for name in LOW_RANK}
  residuals = {name: 0.0 for name in LOW_RANK}
  for t in range(3):
    g = harness.per_worker_grads(jax.random.PRNGKey(t), N, PARAMS)
    mean, state = update(PARAMS, state, g)
    for name in ("b", "small"):  # dense: the exact mean, nothing kept
      np.testing.assert_allclose(mean[name], np.asarray(g[name]).mean(0), rtol=1e-5, atol=1e-6)
      np.testing.assert_array_equal(state.residual[name], 0)
    for name in LOW_RANK:
      x = as_matrices(g, name) + residuals[name]
      approximation, qs[name] = powersgd_reference(x, qs[name])
      np.testing.assert_allclose(np.asarray(mean[name]).reshape(approximation.shape),
                                 approximation, rtol=1e-4, atol=1e-5)
      residuals[name] = x - approximation
      np.testing.assert_allclose(as_matrices(state.residual, name), residuals[name], rtol=1e-4,
                                 atol=1e-5)
      index = names.index(name)  # Q is all-reduced: replicated, no worker axis
      np.testing.assert_allclose(state.buffers[index].compressor.q, qs[name], rtol=1e-4,
                                 atol=1e-5)
  assert all(state.buffers[names.index(n)].compressor.q is None for n in ("b", "small"))


@pytest.mark.parametrize("rank", [2, 3])
def test_rank_at_least_the_mean_rank_returns_the_exact_mean(rank):
  """Gradients ``U C_i V^T`` with shared ``U``, ``V`` of rank 2: their mean has rank 2."""
  m, c = 48, 20
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  u = jax.random.normal(keys[0], (m, 2))
  v = jax.random.normal(keys[1], (c, 2))
  grads = {"w": jnp.einsum("mr,irs,cs->imc", u, jax.random.normal(keys[2], (N, 2, 2)), v)}
  params = {"w": jnp.zeros((m, c))}
  tx = _per_leaf(compressors.powersgd(rank, min_compression_rate=None))
  state, update = harness.shard_map_update(tx, harness.mesh(), params)
  mean, state = update(params, state, grads)
  exact = np.asarray(grads["w"], np.float64).mean(0)
  scale = np.abs(exact).max()
  np.testing.assert_allclose(mean["w"], exact, rtol=0, atol=1e-5 * scale)
  np.testing.assert_allclose(state.residual["w"], np.asarray(grads["w"]) - exact, rtol=0,
                             atol=1e-5 * scale)


def test_start_step_sends_dense_then_compresses():
  rank, seed = 2, 0
  tx = _per_leaf(compressors.powersgd(rank, start_step=2), seed=seed)
  state, update = harness.shard_map_update(tx, harness.mesh(), PARAMS)
  for t in range(3):
    g = harness.per_worker_grads(jax.random.PRNGKey(t), N, PARAMS)
    mean, state = update(PARAMS, state, g)
    x = as_matrices(g, "w")
    if t < 2:
      np.testing.assert_allclose(mean["w"], x.mean(0), rtol=1e-5, atol=1e-6)
      np.testing.assert_array_equal(state.residual["w"], 0)
    else:  # first compressed step: the initial Q, no residual yet
      approximation, _ = powersgd_reference(x, initial_q(seed, 3, 20, rank))
      np.testing.assert_allclose(mean["w"], approximation, rtol=1e-4, atol=1e-5)
  assert update._cache_size() == 1


def test_replicas_identical_error_feedback_exact_and_one_compilation():
  """20 steps: every device's mean is bit-identical; nothing is lost: ``sent_i = x_i - e_i'``
  averages to the mean, and on low-rank leaves every worker sent the mean itself (PowerSGD's
  residual is the local matrix minus the aggregated approximation); dense leaves keep nothing.
  ``x_i - e_i'`` is one float32 subtraction away from ``sent_i``: we allow 4 ulps of the largest
  magnitude. The second call reuses the compiled step."""
  tx = _per_leaf(compressors.powersgd(2))
  state, update = harness.shard_map_update(tx, harness.mesh(), PARAMS)
  for t in range(20):
    g = harness.per_worker_grads(jax.random.PRNGKey(t), N, PARAMS)
    old = state.residual
    mean, state = update(PARAMS, state, g)
    harness.assert_replicas_identical(mean)
    for name in PARAMS:
      x = np.asarray(g[name]) + np.asarray(old[name])
      sent = x - np.asarray(state.residual[name])
      tolerance = 4 * np.finfo(np.float32).eps * max(np.abs(x).max(), np.abs(mean[name]).max())
      np.testing.assert_allclose(sent.mean(0), mean[name], rtol=0, atol=tolerance)
      if name in LOW_RANK:
        np.testing.assert_allclose(sent, np.broadcast_to(mean[name], x.shape), rtol=0,
                                   atol=tolerance)
      else:
        np.testing.assert_array_equal(state.residual[name], 0)
  assert update._cache_size() == 1


def test_pmap_equals_shard_map():
  tx = _per_leaf(compressors.powersgd(2))
  state, update = harness.shard_map_update(tx, harness.mesh(), PARAMS)
  init, pupdate = harness.pmap_update(tx)
  stacked = jax.tree.map(lambda p: jnp.broadcast_to(p, (N,) + p.shape), PARAMS)
  pstate = init(stacked)
  for t in range(2):
    g = harness.per_worker_grads(jax.random.PRNGKey(t), N, PARAMS)
    mean, state = update(PARAMS, state, g)
    pmean, pstate = pupdate(stacked, pstate, g)
    for name in PARAMS:
      for row in np.asarray(pmean[name]):
        np.testing.assert_allclose(row, mean[name], rtol=1e-5, atol=1e-6)


def test_rank_2_on_a_1024_square_leaf_is_over_100x_below_dense():
  measured = bytes_at(N, {
      "dense": "flat(compressors.dense()), (1024, 1024)",
      "powersgd": "compressors.compress(compressors.powersgd(2), axis_name='data', fuse=False), "
                  "(1024, 1024)"})
  assert measured["powersgd"] == pytest.approx(2 * 2 * (N - 1) / N * 4 * (1024 * 2))  # P and Q
  assert measured["dense"] / measured["powersgd"] >= 100  # 256x: 1024^2 / (2 (1024 + 1024))


@pytest.mark.parametrize("make,match", [
    (lambda: compressors.powersgd(0), r"rank=0; allowed: an int >= 1"),
    (lambda: compressors.powersgd(1.5), r"rank=1.5; allowed: an int >= 1"),
    (lambda: compressors.powersgd(2, start_step=-1), r"start_step=-1; allowed: an int >= 0"),
    (lambda: compressors.powersgd(2, min_compression_rate=-1.0),
     r"min_compression_rate=-1.0; allowed: a number >= 0 or None"),
    (lambda: _per_leaf(compressors.powersgd(4, min_compression_rate=None)).init(
        {"w": jnp.zeros((3, 5))}), r"^powersgd: rank=4 for params leaf \['w'\], shape \(3, 5\) "
     r"compressed as a 3 x 5 matrix, sends rank x \(rows \+ cols\) = 32 numbers, more than the "
     r"15 of the matrix itself; allowed: rank <= 1 for this leaf \(rank x \(rows \+ cols\) <= "
     r"rows x cols, which also keeps it <= min\(rows, cols\)\), or a min_compression_rate >= 1, "
     r"which sends such leaves densely$"),
    (lambda: _per_leaf(compressors.powersgd(4, min_compression_rate=0.5)).init(
        {"w": jnp.zeros((3, 50))}), r"rank=4 .* 212 numbers, more than the 150 .* rank <= 2 "),
    # A rank within the matrix that still sends more than it (rate 2048 / 3072 < 1).
    (lambda: _per_leaf(compressors.powersgd(32, min_compression_rate=0.0)).init(
        {"w": jnp.zeros((64, 32))}), r"rank=32 .* 3,072 numbers, more than the 2,048 .* "
     r"rank <= 21 for this leaf"),
    (lambda: _per_leaf(compressors.powersgd(1, min_compression_rate=None)).init(
        {"w": jnp.zeros((1, 5))}), r"allowed: no rank: this leaf is too small to compress"),
    (lambda: _per_leaf(compressors.powersgd(1, min_compression_rate=None)).init(
        {"b": jnp.zeros((7,))}), r"params leaf \['b'\] has shape \(7,\), which is not a matrix"),
])
def test_bad_input_raises_before_compiling(make, match):
  with pytest.raises(ValueError, match=match):
    make()


def test_the_registered_method_runs_leaf_by_leaf_whatever_the_common_fuse():
  grads = harness.per_worker_grads(jax.random.PRNGKey(0), N, PARAMS)
  means = []
  for tx in (compressors.compress(compressors.powersgd(2), axis_name="data", fuse=False),
             compressors.registry.transformation(
                 "powersgd", axis_name="data", common=compressors.registry.Common(fuse=True))):
    state, update = harness.shard_map_update(tx, harness.mesh(), PARAMS)
    means.append(update(PARAMS, state, grads)[0])
  for a, b in zip(jax.tree.leaves(means[0]), jax.tree.leaves(means[1])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_fused_powersgd_raises_a_clear_error_at_init():
  tx = compressors.compress(compressors.powersgd(2), axis_name="data")
  with pytest.raises(ValueError, match=r"no matrix shape: use compress\(powersgd\(\.\.\.\), "
                                      r"axis_name=\.\.\., fuse=False\)"):
    tx.init(PARAMS)