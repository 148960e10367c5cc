"""Tests for tasc.hessian: exact Hessians (float64), the estimators' variances, shard_map."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.flatten_util import ravel_pytree
from jax.sharding import PartitionSpec as P

import compressors
import tasc
from tests import harness

pytestmark = pytest.mark.usefixtures("fast_compiles")

NUM_DEVICES = 8

# Compiled entry points: running scan / while_loop bodies eagerly is far slower than one compile.
hutchinson = jax.jit(tasc.hutchinson, static_argnums=(0, 3),
                     static_argnames=("axis_name", "probe_batch_size"))
top_eigenvalue = jax.jit(tasc.top_eigenvalue, static_argnums=0,
                         static_argnames=("max_iterations", "tolerance", "axis_name"))
assert_close = np.testing.assert_allclose


@pytest.fixture(autouse=True)
def x64():
  """float64 for every test here, scoped to the test so it cannot leak into other files."""
  with jax.enable_x64(True):
    yield


def mlp_params(seed, sizes=(3, 4, 2)):
  """A small tanh MLP's parameters (float64, drawn with numpy: building them compiles nothing)."""
  rng = np.random.default_rng(seed)
  return {
      f"layer{i}": {
          "w": jnp.asarray(rng.standard_normal((n_in, n_out)) / np.sqrt(n_in)),
          "b": jnp.asarray(0.1 * rng.standard_normal(n_out)),
      }
      for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:]))
  }


def mlp_data(seed, n=16, sizes=(3, 4, 2)):
  rng = np.random.default_rng(seed)
  return (jnp.asarray(rng.standard_normal((n, sizes[0]))),
          jnp.asarray(rng.standard_normal((n, sizes[-1]))))


def mlp_loss(params, x, y):
  """Mean squared error of a tanh MLP; a mean over examples, so equal local means average to it."""
  h = x
  for i in range(len(params)):
    h = h @ params[f"layer{i}"]["w"] + params[f"layer{i}"]["b"]
    if i < len(params) - 1:
      h = jnp.tanh(h)
  return jnp.mean(jnp.sum((h - y) ** 2, axis=-1))


def logsumexp_loss(params, x):
  return jax.nn.logsumexp(x @ params["w"] + params["b"]) + 0.5 * jnp.sum(params["b"] ** 4)


def random_like(seed, tree):
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(np.shape(p))), tree)


def dense_hessian(loss_fn, params, *args):
  """The exact Hessian with respect to the flattened parameters (ravel_pytree order)."""
  flat, unravel = ravel_pytree(params)
  hessian = jax.jit(jax.hessian(lambda f, *a: loss_fn(unravel(f), *a)))(flat, *args)
  return np.asarray(hessian)


def quadratic(matrix):
  """0.5 x^T A x over parameters {"a": x[:20], "b": x[20:]}, so probes span two leaves."""
  matrix = jnp.asarray(matrix)

  def loss(params):
    x = jnp.concatenate([params["a"], params["b"]])
    return 0.5 * x @ matrix @ x

  return loss


def split_vector(x):
  return {"a": jnp.asarray(x[:20]), "b": jnp.asarray(x[20:])}


def assert_trees_close(actual, expected, **tolerances):
  jax.tree.map(functools.partial(assert_close, **tolerances), actual, expected)


# ------------------------------------------------------------------ Hessian-vector products


@pytest.mark.parametrize(
    "loss_fn, make_params, make_args",
    [
        (mlp_loss, lambda: mlp_params(0), lambda: mlp_data(1)),
        (logsumexp_loss, lambda: random_like(0, {"w": np.zeros((5, 3)), "b": np.zeros(3)}),
         lambda: (jnp.asarray(np.random.default_rng(1).standard_normal(5)),)),
    ],
    ids=["mlp", "logsumexp"],
)
def test_hvp_matches_dense_hessian(loss_fn, make_params, make_args):
  params, args = make_params(), make_args()  # built inside the test, under float64
  v = random_like(2, params)
  hessian = dense_hessian(loss_fn, params, *args)
  actual = ravel_pytree(jax.jit(functools.partial(tasc.hvp, loss_fn))(params, v, *args))[0]
  assert np.abs(hessian).max() > 0.1  # not a degenerate Hessian
  assert_close(actual, hessian @ np.asarray(ravel_pytree(v)[0]), rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------ Hutchinson


def test_exact_after_one_probe_on_a_diagonal_hessian():
  coeffs = {"u": jnp.array([1.0, -2.0, 3.0]), "v": jnp.array([[0.5, 4.0], [-1.0, 2.0]])}

  def separable(params):  # sum c x^4: H = diag(12 c x^2), not constant
    return sum(jnp.sum(c * p**4)
               for c, p in zip(jax.tree.leaves(coeffs), jax.tree.leaves(params)))

  params = {"u": jnp.array([0.3, -1.2, 2.0]), "v": jnp.array([[1.0, -0.5], [0.7, 1.5]])}
  exact = jax.tree.map(lambda c, p: 12 * c * p**2, coeffs, params)
  estimate = hutchinson(separable, params, jax.random.key(3), 1)
  assert_trees_close(estimate.diagonal, exact, rtol=1e-12)
  assert_trees_close(estimate.traces, jax.tree.map(jnp.sum, exact), rtol=1e-12)
  assert_close(estimate.total, sum(jnp.sum(e) for e in jax.tree.leaves(exact)), rtol=1e-12)


@pytest.mark.parametrize("num_samples", [1, 8])
def test_trace_error_matches_rademacher_variance(num_samples):
  repetitions, n = 200, 50
  g = np.random.default_rng(0).standard_normal((n, n))
  matrix = g @ g.T / n + 3.0 * np.eye(n)  # dense, with a large diagonal
  rademacher_variance = 2 * (np.sum(matrix**2) - np.sum(np.diag(matrix) ** 2))
  assert 2 * np.sum(matrix**2) > 5 * rademacher_variance  # Gaussian probes would fail this test
  loss = quadratic(matrix)
  params = split_vector(np.random.default_rng(1).standard_normal(n))

  @jax.jit
  @jax.vmap
  def estimate(key):
    return tasc.hutchinson_trace(loss, params, key, num_samples, probe_batch_size=4)

  traces, totals = estimate(jax.random.split(jax.random.key(42), repetitions))
  assert_close(traces["a"] + traces["b"], totals, rtol=1e-12)  # layer traces sum to the total
  errors = np.asarray(totals) - np.trace(matrix)
  sigma = np.sqrt(rademacher_variance / num_samples)
  assert abs(errors.mean()) < 3 * sigma / np.sqrt(repetitions)
  assert 0.7 < errors.var(ddof=1) / sigma**2 < 1.4
  assert np.abs(errors).max() < 4.5 * sigma  # of 200 draws, one beyond 3 sigma is likely (~40%)


def test_layer_traces_and_diagonal_match_exact_hessian_blocks():
  num_samples = 2000
  params = mlp_params(1)
  x, y = mlp_data(2)
  estimate = jax.jit(lambda p, k: tasc.hutchinson(
      mlp_loss, p, k, num_samples, x, y, probe_batch_size=250))(params, jax.random.key(7))
  hessian = dense_hessian(mlp_loss, params, x, y)
  diag = np.diag(hessian)
  leaf_of = np.repeat(np.arange(4), [p.size for p in jax.tree.leaves(params)])

  # One probe's variance for leaf S: 2 (||H_SS||_F^2 - sum_S H_ii^2) + ||H_{S, not S}||_F^2.
  for leaf, (path, trace) in enumerate(jax.tree_util.tree_leaves_with_path(estimate.traces)):
    inside = leaf_of == leaf
    block, cross = hessian[np.ix_(inside, inside)], hessian[np.ix_(inside, ~inside)]
    variance = 2 * (np.sum(block**2) - np.sum(np.diag(block) ** 2)) + np.sum(cross**2)
    assert abs(trace - np.trace(block)) < 4 * np.sqrt(variance / num_samples), path
  # One probe's variance of z_i (Hz)_i: sum_{j != i} H_ij^2.
  diagonal_sigma = np.sqrt((np.sum(hessian**2, axis=1) - diag**2) / num_samples)
  assert np.all(np.abs(ravel_pytree(estimate.diagonal)[0] - diag) < 4 * diagonal_sigma + 1e-12)
  assert_close(estimate.total, sum(jax.tree.leaves(estimate.traces)), rtol=1e-12)
  total_sigma = np.sqrt(2 * (np.sum(hessian**2) - np.sum(diag**2)) / num_samples)
  assert abs(estimate.total - np.trace(hessian)) < 4 * total_sigma


def test_probe_chunking_and_wrappers_agree():
  params = mlp_params(1)
  x, y = mlp_data(2)

  @jax.jit
  def variants(p, k):
    chunked = [tasc.hutchinson(mlp_loss, p, k, 7, x, y, probe_batch_size=b)
               for b in (1, 3, 100)]  # 3 leaves a remainder chunk; 100 is clipped to 7
    wrappers = (tasc.hutchinson_diagonal(mlp_loss, p, k, 7, x, y),
                *tasc.hutchinson_trace(mlp_loss, p, k, 7, x, y))
    return chunked, wrappers

  (reference, *chunked), wrappers = variants(params, jax.random.key(5))
  for estimate in (*chunked, wrappers):
    assert_trees_close(tuple(estimate), tuple(reference), rtol=1e-12)


def test_mixed_dtypes_keep_parameter_dtypes():
  dtypes = {"layer0": {"w": jnp.bfloat16, "b": jnp.float32},
            "layer1": {"w": jnp.float32, "b": jnp.float64}}
  params = jax.tree.map(lambda p, dtype: p.astype(dtype), mlp_params(1), dtypes)
  x, y = mlp_data(2)
  mixed, wide = (hutchinson(mlp_loss, p, jax.random.key(0), 4, x, y)
                 for p in (params, optax.tree.cast(params, jnp.float64)))
  assert jax.tree.map(lambda d: d.dtype, mixed.diagonal) == jax.tree.map(jnp.dtype, dtypes)
  trace_dtypes = {"layer0": {"w": jnp.float32, "b": jnp.float32},  # at least float32
                  "layer1": {"w": jnp.float32, "b": jnp.float64}}
  assert jax.tree.map(lambda t: t.dtype, mixed.traces) == jax.tree.map(jnp.dtype, trace_dtypes)
  # Same probes (drawn in the promoted dtype); only the bf16 leaf's products are rounded.
  assert_trees_close(optax.tree.cast(mixed.diagonal, jnp.float64), wide.diagonal,
                     rtol=2e-2, atol=1e-3)


# ------------------------------------------------------------------ power iteration


@pytest.mark.parametrize("top", [10.0, -10.0], ids=["positive", "negative"])
def test_top_eigenvalue_matches_eigvalsh(top):
  n = 40
  q, _ = np.linalg.qr(np.random.default_rng(0).standard_normal((n, n)))
  eigenvalues = np.concatenate([[top, 5.0], np.linspace(-4.0, 4.0, n - 2)])  # gap: ratio 0.5
  matrix = (q * eigenvalues) @ q.T
  reference = np.linalg.eigvalsh(matrix)
  reference = reference[np.argmax(np.abs(reference))]
  params = split_vector(np.random.default_rng(1).standard_normal(n))
  result = top_eigenvalue(quadratic(matrix), params, jax.random.key(0),
                          max_iterations=200, tolerance=1e-10)
  assert_close(result.eigenvalue, reference, rtol=1e-4)
  vector = np.asarray(ravel_pytree(result.eigenvector)[0])
  assert_close(np.linalg.norm(vector), 1.0, rtol=1e-12)
  assert abs(vector @ q[:, 0]) > 1 - 1e-6
  assert 1 < int(result.iterations) < 200


def test_top_eigenvalue_stopping_rule():
  params = mlp_params(1)
  x, y = mlp_data(2)
  spectrum = np.linalg.eigvalsh(dense_hessian(mlp_loss, params, x, y))
  default = top_eigenvalue(mlp_loss, params, jax.random.key(0), x, y)
  assert 1 < int(default.iterations) < 100  # stopped by the 1e-3 relative-change rule
  assert_close(default.eigenvalue, spectrum[np.argmax(np.abs(spectrum))], rtol=1e-2)
  capped = top_eigenvalue(mlp_loss, params, jax.random.key(0), x, y,
                          max_iterations=3, tolerance=1e-12)
  assert int(capped.iterations) == 3


def test_top_eigenvalue_of_a_zero_hessian_is_zero_not_nan():
  result = top_eigenvalue(lambda p: jnp.sum(3.0 * p["w"]), {"w": jnp.ones(4)}, jax.random.key(0))
  assert float(result.eigenvalue) == 0.0 and int(result.iterations) == 2
  assert_close(optax.tree.norm(result.eigenvector), 1.0)


# ------------------------------------------------------------------ data parallel (shard_map)


def sharded(fn):
  """jit(shard_map(fn)) over (params, key, x, y), with the batch (x, y) split over the devices."""
  return jax.jit(jax.shard_map(fn, mesh=harness.mesh(NUM_DEVICES),
                               in_specs=(P(), P(), P("data"), P("data")), out_specs=P()))


def test_sharded_hutchinson_equals_full_batch_and_sends_one_all_reduce():
  assert jax.device_count() == NUM_DEVICES
  params = mlp_params(1)
  x, y = mlp_data(2, n=4 * NUM_DEVICES)
  key = jax.random.key(9)
  step = sharded(lambda p, k, xb, yb: tasc.hutchinson(mlp_loss, p, k, 16, xb, yb,
                                                      axis_name="data"))
  full_batch = hutchinson(mlp_loss, params, key, 16, x, y)
  assert_trees_close(step(params, key, x, y), full_batch, rtol=1e-10, atol=1e-14)
  # Worker 0's own estimate differs (its batch tiled: same shapes, same compiled program).
  tile = functools.partial(jnp.tile, reps=(NUM_DEVICES, 1))
  local = hutchinson(mlp_loss, params, key, 16, tile(x[:4]), tile(y[:4]))
  assert not np.allclose(ravel_pytree(local.diagonal)[0], ravel_pytree(full_batch.diagonal)[0])

  report = compressors.wire_bytes(step, params, key, x, y)
  (collective,) = report.collectives
  assert (collective.kind, collective.executions, collective.group_size) == (
      "all-reduce", 1, NUM_DEVICES)
  assert collective.size_bytes == ravel_pytree(params)[0].size * 8  # the diagonal, float64
  assert report.total == 2 * (NUM_DEVICES - 1) / NUM_DEVICES * collective.size_bytes  # ring


def test_sharded_hutchinson_without_averaging_is_each_workers_own_and_moves_nothing():
  """``average=False`` (what TASC's trainer uses): each worker's estimate of its own batch, with
  the parameters varying per worker as in a training step, and no collective at all."""
  params = mlp_params(1)
  x, y = mlp_data(2, n=4 * NUM_DEVICES)
  key = jax.random.key(9)

  def local_estimates(p, k, xb, yb):
    p = jax.lax.pcast(p, "data", to="varying")
    diagonal = tasc.hutchinson_diagonal(mlp_loss, p, k, 16, xb, yb, axis_name="data",
                                        average=False)
    return jax.tree.map(lambda d: d[None], diagonal)

  step = jax.jit(jax.shard_map(local_estimates, mesh=harness.mesh(NUM_DEVICES),
                               in_specs=(P(), P(), P("data"), P("data")), out_specs=P("data")))
  per_worker = step(params, key, x, y)
  for w in range(NUM_DEVICES):
    own = hutchinson(mlp_loss, params, key, 16, x[4 * w:4 * w + 4], y[4 * w:4 * w + 4])
    assert_trees_close(jax.tree.map(lambda d: d[w], per_worker), own.diagonal, rtol=1e-10,
                       atol=1e-14)
  assert compressors.wire_bytes(step, params, key, x, y).total == 0


def test_sharded_top_eigenvalue_equals_full_batch():
  params = mlp_params(1)
  x, y = mlp_data(2, n=4 * NUM_DEVICES)
  key = jax.random.key(4)
  options = dict(max_iterations=20, tolerance=1e-14)  # the same 20 iterations in both runs
  step = sharded(lambda p, k, xb, yb: tasc.top_eigenvalue(mlp_loss, p, k, xb, yb,
                                                          axis_name="data", **options))
  full_batch = top_eigenvalue(mlp_loss, params, key, x, y, **options)
  assert_trees_close(step(params, key, x, y), full_batch, rtol=1e-9, atol=1e-12)
  report = compressors.wire_bytes(step, params, key, x, y)
  (collective,) = report.collectives  # Hv's all-reduce in the while body, once per iteration
  assert (collective.kind, report.unknown_trip_counts) == ("all-reduce", 1)
  assert collective.size_bytes == ravel_pytree(params)[0].size * 8


# ------------------------------------------------------------------ bad input


def _loss(params):
  return 0.5 * sum(jnp.sum(p**2) for p in jax.tree.leaves(params))


_GOOD = {"w": np.ones((2, 2)), "b": np.zeros(2)}  # numpy: float64 whatever x64 is at import
_BAD_INPUTS = {
    "zero-samples": (lambda k: tasc.hutchinson(_loss, _GOOD, k, 0),
                     ValueError, "num_samples must be >= 1; got 0"),
    "float-samples": (lambda k: tasc.hutchinson(_loss, _GOOD, k, 2.0),
                      TypeError, "num_samples must be a Python int >= 1; got 2.0 of type float"),
    "bool-samples": (lambda k: tasc.hutchinson_diagonal(_loss, _GOOD, k, True),
                     TypeError, "num_samples must be a Python int"),
    "zero-batch": (lambda k: tasc.hutchinson_trace(_loss, _GOOD, k, 4, probe_batch_size=0),
                   ValueError, "probe_batch_size must be >= 1; got 0"),
    "int-params": (lambda k: tasc.hutchinson(_loss, {"w": jnp.ones(3, jnp.int32)}, k, 1),
                   TypeError, r"params\['w'\] has dtype int32"),
    "complex-params": (lambda k: tasc.hvp(_loss, {"w": jnp.ones(2, jnp.complex64)},
                                          {"w": jnp.ones(2, jnp.complex64)}),
                       TypeError, r"params\['w'\] has dtype complex64"),
    "empty-params": (lambda k: tasc.hutchinson(_loss, {}, k, 1), ValueError, "empty pytree"),
    "v-structure": (lambda k: tasc.hvp(_loss, _GOOD, {"w": jnp.ones((2, 2))}),
                    ValueError, "v must have the structure of params"),
    "v-shape": (lambda k: tasc.hvp(_loss, _GOOD, {"w": jnp.ones((2, 3)), "b": jnp.zeros(2)}),
                ValueError, r"v\['w'\] has shape \(2, 3\)"),
    "zero-iterations": (lambda k: tasc.top_eigenvalue(_loss, _GOOD, k, max_iterations=0),
                        ValueError, "max_iterations must be >= 1; got 0"),
    "zero-tolerance": (lambda k: tasc.top_eigenvalue(_loss, _GOOD, k, tolerance=0.0),
                       ValueError, "tolerance must be a float > 0; got 0.0"),
}


@pytest.mark.parametrize("call, error, message", _BAD_INPUTS.values(), ids=_BAD_INPUTS.keys())
def test_bad_input_raises_a_clear_error(call, error, message):
  with pytest.raises(error, match=message):
    call(jax.random.key(0))
