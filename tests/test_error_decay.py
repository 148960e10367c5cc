"""Error decay (SparseLoCo, arXiv 2508.15706): ``a = g + beta e``, ``sent + e' = a`` exactly, and
``beta = 1`` bit-identical to plain error feedback."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import compressors
import tasc
from tests import harness

PARAMS = {"b": jnp.zeros((8,)), "w": jnp.zeros((16, 8))}  # 136 elements, fused
WORKERS = 8


def _run(tx, steps, seed=0):
  """``[(g, residual before, mean, residual after)]`` of ``steps`` steps under shard_map, as
  float32 numpy arrays in the fused layout (``[workers, D]``; the mean ``[D]``)."""
  mesh = harness.mesh(WORKERS)
  state, update = harness.shard_map_update(tx, mesh, PARAMS)
  out = []
  for step in range(steps):
    grads = harness.per_worker_grads(jax.random.PRNGKey(seed + step), WORKERS, PARAMS)
    before = harness.fused(state.residual, WORKERS)
    mean, state = update(PARAMS, state, grads)
    out.append((harness.fused(grads, WORKERS), before, harness.fused(mean, 1)[0],
                harness.fused(state.residual, WORKERS)))
  return out


def test_topk_with_decay_keeps_what_it_does_not_send_exactly():
  k = 14
  for g, e, mean, kept in _run(compressors.compress(compressors.topk(k / 136), axis_name="data",
                                                    error_decay=0.5), steps=3):
    a = g + np.float32(0.5) * e  # float32, as the step adds them
    sent = harness.topk_reference(a, k)
    np.testing.assert_array_equal(kept, a - sent)
    np.testing.assert_array_equal(sent + kept, a)
    np.testing.assert_allclose(mean, sent.mean(0), rtol=1e-6, atol=1e-6)
  assert np.abs(e).max() > 0  # the last step had a residual to decay


def test_tasc_with_decay_keeps_what_it_does_not_send_exactly():
  tx = tasc.tasc_compress(axis_name="data", density=0.25, block_size=8, sensitivity="none",
                          error_decay=0.5)
  for g, e, mean, kept in _run(tx, steps=3):
    a = g + np.float32(0.5) * e
    blocks = (kept.reshape(WORKERS, -1, 8) == 0).all(axis=(0, 2))  # the shared support
    assert blocks.sum() == round(0.25 * 17)
    sent = np.where(np.repeat(blocks, 8)[None], a, 0)
    np.testing.assert_array_equal(sent + kept, a)
    np.testing.assert_allclose(mean, sent.mean(0), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("make", [
    lambda **kw: compressors.compress(compressors.topk(0.1), axis_name="data", **kw),
    lambda **kw: tasc.tasc_compress(axis_name="data", density=0.25, block_size=8,
                                    sensitivity="none", **kw)], ids=["topk", "tasc"])
def test_decay_one_is_bit_identical_to_the_default(make):
  for plain, decayed in zip(_run(make(), steps=3), _run(make(error_decay=1.0), steps=3)):
    for x, y in zip(plain, decayed):
      assert x.tobytes() == y.tobytes()


def test_decay_one_adds_no_operation():
  """The multiply is skipped at exactly 1, so the program is the default's."""
  grads = {"w": jnp.ones((64,))}
  jaxpr = lambda **kw: str(jax.make_jaxpr(
      lambda g: (tx := compressors.compress(compressors.topk(0.1), axis_name=None, **kw))
      .update(g, tx.init(g))[0])(grads))
  assert jaxpr(error_decay=1.0) == jaxpr()
  assert jaxpr(error_decay=0.5) != jaxpr()


@pytest.mark.parametrize("value, error, words", [
    (1.5, ValueError, "error_decay=1.5 is outside [0, 1]"),
    (-0.1, ValueError, "error_decay=-0.1 is outside [0, 1]"),
    ("0.5", TypeError, "error_decay must be a number in [0, 1], got '0.5'"),
    (True, TypeError, "error_decay must be a number in [0, 1], got True")])
def test_bad_decay_is_refused(value, error, words):
  with pytest.raises(error, match=words.replace("[", r"\[").replace("]", r"\]")):
    compressors.compress(compressors.topk(0.1), axis_name="data", error_decay=value)
  with pytest.raises(error, match="error_decay"):
    tasc.tasc_compress(axis_name="data", error_decay=value)


def test_decay_without_error_feedback_is_refused():
  for decay in (0.0, 0.5):
    with pytest.raises(ValueError, match=f"error_decay={decay} with error_feedback=False"):
      compressors.compress(compressors.topk(0.1), axis_name="data", error_feedback=False,
                           error_decay=decay)
  compressors.compress(compressors.topk(0.1), axis_name="data", error_feedback=False,
                       error_decay=1.0)
