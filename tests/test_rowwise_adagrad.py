"""Row-wise Adagrad (optimizers/rowwise_adagrad.py) against a float64 numpy reference."""

import jax.numpy as jnp
import numpy as np
import pytest

import optimizers


def _reference(params, gradients, learning_rate, eps):
  """FBGEMM's EXACT_ROWWISE_ADAGRAD, row by row in float64."""
  params = {k: np.asarray(v, np.float64).copy() for k, v in params.items()}
  accumulated = {k: np.zeros(v.shape[0]) for k, v in params.items()}
  for step in gradients:
    for k, g in step.items():
      g = np.asarray(g, np.float64)
      rows = g.reshape(g.shape[0], -1)
      accumulated[k] += np.mean(rows ** 2, axis=1)
      denominator = np.sqrt(accumulated[k]) + eps
      safe = np.where(denominator > 0, denominator, 1.0)
      params[k] -= learning_rate * np.where(denominator[:, None] > 0, rows / safe[:, None],
                                            0).reshape(g.shape)
  return params


@pytest.mark.parametrize("eps", [1e-8, 0.0])
def test_rowwise_adagrad_matches_the_float64_reference(eps):
  rng = np.random.default_rng(0)
  params = {"table": rng.normal(size=(6, 4)).astype(np.float32),
            "bias": rng.normal(size=(5,)).astype(np.float32)}
  gradients = []
  for _ in range(3):
    step = {k: rng.normal(size=v.shape).astype(np.float32) for k, v in params.items()}
    step["table"][2] = 0.0  # a row this step does not look up
    gradients.append(step)
  gradients[0]["table"][4] = 0.0
  gradients[1]["table"][4] = 0.0
  gradients[2]["table"][4] = 0.0  # a row never looked up: it stays put, without a NaN
  tx = optimizers.rowwise_adagrad(0.1, eps=eps)
  state = tx.init(params)
  got = {k: jnp.asarray(v) for k, v in params.items()}
  for step in gradients:
    updates, state = tx.update({k: jnp.asarray(v) for k, v in step.items()}, state, got)
    got = {k: got[k] + updates[k] for k in got}
  expected = _reference(params, gradients, 0.1, eps)
  for k in params:
    np.testing.assert_allclose(np.asarray(got[k]), expected[k], rtol=2e-6, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(got["table"][4]), params["table"][4])
  assert state[0].sum_of_squares["table"].shape == (6,)


def test_rowwise_adagrad_refuses_a_negative_eps():
  with pytest.raises(ValueError, match=r"rowwise_adagrad: eps=-1.0 is not allowed"):
    optimizers.rowwise_adagrad(0.1, eps=-1.0)
