"""The two-phase compressed all-reduce: a numpy replay of the protocol, and its bytes.

Protocol (compressors.protocol, after 1-bit Adam): the buffer is zero-padded to ``n`` chunks of
``ceil(d / n)``; worker ``i`` encodes chunk ``j`` and all-to-alls it to worker ``j``, which
averages the ``n`` decoded chunks (in worker order), adds its owner memory, encodes the result
again, keeps what that loses, and all-gathers it.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import compressors
from compressors import protocol
from tests import harness
from tests.subprocess_devices import run_with_devices
from tests.test_quantized import SIGN_COMPRESSORS, fused, qsgd_reference, sign_reference

pytestmark = pytest.mark.usefixtures("fast_compiles")

N = 8


def two_phase_reference(xs, owner, encode_decode):
  """Numpy replay of one two-phase exchange.

  Args:
    xs: ``[n, d]`` the workers' buffers (gradient plus residual).
    owner: ``[n, chunk]`` the owners' memories, or None without error feedback.
    encode_decode: ``(chunk, worker, index, phase) -> decoded chunk``; ``index`` is the chunk's
      position, ``phase`` 1 (the workers' chunks) or 2 (the owner's).

  Returns:
    ``(mean [d], sent [n, d], new owner memory or None)``.
  """
  n, d = xs.shape
  chunk = -(-d // n)
  chunks = np.pad(xs, ((0, 0), (0, n * chunk - d))).reshape(n, n, chunk)
  sent = np.stack([[encode_decode(chunks[i, j], i, j, 1) for j in range(n)] for i in range(n)])
  owned = sent[0].astype(np.float32)
  for i in range(1, n):  # worker order, in float32, as protocol.sum_decoded adds
    owned = owned + sent[i]
  owned = owned / np.float32(n)
  owner_input = owned if owner is None else owned + owner
  shared = np.stack([encode_decode(owner_input[j], j, j, 2) for j in range(n)])
  new_owner = None if owner is None else owner_input - shared
  return shared.reshape(-1)[:d], sent.reshape(n, -1)[:, :d], new_owner


@pytest.mark.parametrize("shapes", [{"w": (48, 20), "b": (40,)}, {"w": (7, 143)}],
                         ids=["divisible", "padded"])
@pytest.mark.parametrize("name", ["efsignsgd", "onebit_rms", "onebit_seide", "signsgd"])
def test_sign_two_phase_matches_numpy_over_steps(name, shapes):
  """Worker and owner error feedback replayed in numpy for 3 steps (signSGD: no feedback)."""
  params = {k: jnp.zeros(s) for k, s in shapes.items()}
  error_feedback = name != "signsgd"
  tx = compressors.compress(SIGN_COMPRESSORS[name](), axis_name="data",
                            error_feedback=error_feedback)
  state, update = harness.shard_map_update(tx, harness.mesh(), params)
  d = sum(math.prod(s) for s in shapes.values())
  e = np.zeros((N, d), np.float32)
  owner = np.zeros((N, -(-d // N)), np.float32) if error_feedback else None
  for t in range(3):
    g = harness.per_worker_grads(jax.random.PRNGKey(20 + t), N, params)
    mean, state = update(params, state, g)
    harness.assert_replicas_identical(mean)
    mean = np.concatenate([np.asarray(x).reshape(-1) for x in jax.tree.leaves(mean)])
    a = fused(g) + e
    expected, sent, owner = two_phase_reference(
        a, owner, lambda c, *_: sign_reference(name, c).astype(np.float32))
    if name == "signsgd":  # the owners' signs of the mean are the majority vote, exactly
      np.testing.assert_array_equal(mean, np.where(np.sign(fused(g)).sum(0) >= 0, 1.0, -1.0))
      np.testing.assert_array_equal(mean, expected)
      continue
    np.testing.assert_allclose(mean, expected, rtol=2e-5, atol=1e-6)
    e = a - sent
    np.testing.assert_allclose(fused(state.residual), e, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(state.buffers.owner_residual), owner, rtol=2e-5,
                               atol=1e-6)


def exchange_on_workers(compressor, xs, key, owner):
  """``protocol.exchange`` on 8 workers with worker ``w``'s private key ``fold_in(key, w)``."""
  n, d = xs.shape

  @jax.jit
  @functools.partial(jax.shard_map, mesh=harness.mesh(), in_specs=(P("data"), P("data")),
                     out_specs=P("data"))
  def run(x, owner):
    worker = jax.lax.axis_index("data")
    ctx = protocol.Context(axis_name="data", num_workers=n, size=d, shape=(d,), worker_index=worker,
                       step=jnp.int32(0), shared_key=key,
                       private_key=jax.random.fold_in(key, worker), extras={})
    out = protocol.exchange(compressor, x[0], protocol.BufferState((), owner[0]), ctx)
    return out.mean[None], out.sent[None], out.state.owner_residual[None]

  return [np.asarray(r) for r in run(xs, owner)]


def test_qsgd_two_phase_matches_numpy_given_the_uniforms():
  """Chunk ``j`` of worker ``i`` is quantised with ``fold_in(private_i, j)``, the owner's with
  ``fold_in(fold_in(private_j, n), j)`` (compressors.protocol's key schedule)."""
  levels, bucket, d = 3, 40, 1001
  key = jax.random.PRNGKey(4)
  xs = jax.random.normal(jax.random.PRNGKey(0), (N, d))
  chunk = -(-d // N)
  owner = 0.01 * jax.random.normal(jax.random.PRNGKey(1), (N, chunk))
  mean, sent, new_owner = exchange_on_workers(compressors.qsgd(levels, bucket_size=bucket), xs,
                                              key, owner)

  def encode_decode(c, worker, index, phase):
    private = jax.random.fold_in(key, worker)
    if phase == 2:
      private = jax.random.fold_in(private, N)
    uniforms = np.asarray(jax.random.uniform(jax.random.fold_in(private, index), (chunk,)))
    length = min(bucket, chunk)
    v = np.pad(c, (0, -chunk % length)).reshape(-1, length)
    scales = np.sqrt((v.astype(np.float64) ** 2).sum(1)).astype(np.float32)
    return qsgd_reference(c.astype(np.float32), uniforms, scales, levels, bucket)[1]

  expected, expected_sent, expected_owner = two_phase_reference(
      np.asarray(xs), np.asarray(owner), encode_decode)
  for w in range(N):
    np.testing.assert_allclose(mean[w], expected, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(sent, expected_sent, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(new_owner, expected_owner, rtol=1e-5, atol=1e-5)


def test_two_phase_decodes_with_the_key_it_encoded_with():
  """Random-k at density 1 sends every entry; through two-phase the mean must be exact."""
  xs = jax.random.normal(jax.random.PRNGKey(0), (N, 64))
  two_phase_randomk = compressors.randomk(1.0)._replace(exchange="two_phase")
  mean, sent, _ = exchange_on_workers(two_phase_randomk, xs, jax.random.PRNGKey(3),
                                      jnp.zeros((N, 8)))
  np.testing.assert_allclose(sent, np.asarray(xs), rtol=1e-6)
  np.testing.assert_allclose(mean[0], np.asarray(xs).mean(0), rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------- bytes

D = 1 << 20  # a 1M-element gradient

BYTES_CODE = """
import functools, json, jax, jax.numpy as jnp, numpy as np
from jax.sharding import PartitionSpec as P
import compressors

def flat(compressor, **kwargs):
  return compressors.compress(compressor, axis_name="data", **kwargs)

def step_bytes(tx, shape=({d},)):
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
  params = {{"w": jax.ShapeDtypeStruct(shape, jnp.float32)}}
  specs = compressors.state_specs(tx, params, mesh, "data")
  state = jax.eval_shape(jax.shard_map(lambda p: compressors.add_device_axis(tx.init(p), specs),
                                       mesh=mesh, in_specs=P(), out_specs=specs), params)

  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(specs, P("data")),
                     out_specs=(P(), specs))
  def step(state, grads):
    state = compressors.drop_device_axis(state, specs)
    mean, state = tx.update({{"w": grads[0]}}, state)
    return mean, compressors.add_device_axis(state, specs)

  grads = jax.ShapeDtypeStruct((mesh.size,) + shape, jnp.float32)
  return compressors.wire_bytes(step, state, grads, mesh=mesh).total
"""


def bytes_at(num_devices: int, calls: dict[str, str]) -> dict[str, float]:
  """Wire bytes per device of one step of each named ``step_bytes(...)`` argument list (e.g.
  ``"flat(compressors.onebit())"``), in a child with that many devices (compile only, abstract
  shapes; the gradient has 1M elements unless a shape is given)."""
  code = BYTES_CODE.format(d=D) + "\nprint(json.dumps({" + ", ".join(
      f"{name!r}: step_bytes({args})" for name, args in calls.items()) + "}))"
  return run_with_devices(num_devices, code)


ONEBIT = {"two_phase": "flat(compressors.onebit())",
          "all_gather": "flat(compressors.onebit(exchange='all_gather'))"}


def test_two_phase_bytes_stay_flat_from_8_to_32_workers_while_all_gather_grows():
  at8, at32 = bytes_at(8, ONEBIT), bytes_at(32, ONEBIT)
  # two-phase: 2 (n-1)/n of one packed buffer (d/8 bytes) plus one float scale per chunk.
  for n, measured in ((8, at8), (32, at32)):
    assert measured["two_phase"] == pytest.approx(2 * (n - 1) / n * (D / 8 + 4 * n))
    assert measured["all_gather"] == pytest.approx((n - 1) * (D / 8 + 4))
  assert at32["two_phase"] <= 1.15 * at8["two_phase"]
  assert at32["all_gather"] >= 4 * at8["all_gather"]


SUMMARY = {
    "dense": "flat(compressors.dense())",
    "signsgd": "flat(compressors.signsgd(), error_feedback=False)",
    "efsignsgd": "flat(compressors.efsignsgd())",
    "onebit": "flat(compressors.onebit())",
    "qsgd4": "flat(compressors.qsgd(4))",
    "terngrad_psum": "flat(compressors.terngrad())",
    "terngrad_two_phase": "flat(compressors.terngrad(exchange='two_phase'))",
}
# Bytes per element relative to float32 (4 bytes), for the minimum ratio each must reach.
MIN_RATIO = {"signsgd": 16, "efsignsgd": 16, "onebit": 16,
             "qsgd4": 32 / (4 + 32 / 512) * 0.99,   # 4-bit codes + a float per 512
             "terngrad_psum": 4 * 0.99,             # int8 codes all-reduced
             "terngrad_two_phase": 16 * 0.99}       # 2-bit codes, two-phase


@pytest.mark.slow
def test_compressed_bytes_at_8_workers_against_dense():
  measured = bytes_at(8, SUMMARY)
  dense = measured.pop("dense")
  assert dense == pytest.approx(2 * (N - 1) / N * 4 * D)
  ratios = {name: dense / b for name, b in measured.items()}
  for name, ratio in ratios.items():
    assert ratio >= MIN_RATIO[name], (name, ratio)
  assert ratios["onebit"] >= 31  # 32x less the per-chunk scales
