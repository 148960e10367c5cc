"""Quorum for per-step methods (compressors.aggregation.per_step): every step a synchronisation;
with the workers alike it is the plain mean; a float64 reference of a step with stragglers,
late gradients dropped or sent a step later at ``stale_weight``; drop-outs change the result;
the runner takes it."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import compressors
from compressors import aggregation
from compressors import worker_sim
from tests import harness

pytestmark = pytest.mark.usefixtures("fast_compiles")

N, DIM, LR = 8, 4, 0.1
PARAMS = {"w": jnp.zeros((DIM, DIM)), "b": jnp.zeros((DIM,))}
TRACE = ((1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 2.0, 4.0),)  # two stragglers, seconds per step


def _batch(seed=0):
  return harness.regression_batch(N, DIM, seed)


def _agg(rule="quorum", stale_weight=0.0, **sim):
  return aggregation.Aggregation(rule, worker_sim.WorkerSim(N, **sim), 1, sync_seconds=0.25,
                                 stale_weight=stale_weight)


def _run(agg, steps=4):
  exchange = compressors.compress(compressors.dense(), axis_name="data")
  if agg is not None:
    exchange = aggregation.per_step(exchange, agg, "data")
  dp = compressors.data_parallel(harness.regression_loss, optax.chain(exchange, optax.sgd(LR)),
                                 harness.mesh(N), PARAMS, _batch())
  params, state = PARAMS, dp.init(PARAMS)
  for t in range(steps):
    params, state, _ = dp.step(params, state, _batch(t))
  return params, state


def _numpy_run(steps, stale_weight):
  """SGD on the mean of the gradients that arrive within quorum's adaptive deadline (median +
  1 MAD): the 2 s and 4 s workers are late every step; their gradient of step t joins step t + 1
  at ``stale_weight``."""
  arrival = np.asarray(TRACE[0])
  median = np.median(arrival)
  on_time = arrival <= max(median + np.median(np.abs(arrival - median)), arrival.min())
  params = {k: np.zeros(v.shape) for k, v in PARAMS.items()}
  late = None
  for t in range(steps):
    x, y = (np.asarray(a, np.float64).reshape(N, -1, *a.shape[1:]) for a in _batch(t))
    grads = []
    for i in range(N):
      residual = x[i] @ params["w"] + params["b"] - y[i]
      scale = 2 / residual.size
      grads.append({"w": scale * x[i].T @ residual, "b": scale * residual.sum(0)})
    total = on_time.sum() + (0 if late is None else stale_weight * (~on_time).sum())
    mean = {k: sum(g[k] for g, ok in zip(grads, on_time) if ok) for k in params}
    if late is not None:
      mean = {k: mean[k] + stale_weight * sum(g[k] for g in late) for k in params}
    params = {k: params[k] - LR * mean[k] / total for k in params}
    late = [g for g, ok in zip(grads, on_time) if not ok]
  return params


def test_per_step_quorum_with_workers_alike_is_the_plain_mean():
  reference, _ = _run(None)
  for rule in ("sync", "quorum"):
    params, state = _run(_agg(rule))
    for k in PARAMS:
      np.testing.assert_allclose(params[k], reference[k], rtol=1e-6, atol=1e-7, err_msg=rule)
    figures = aggregation.totals(state)
    assert figures["updates_dropped"] == 0 and figures["useful_steps"] == N * 4
    assert figures["modelled_seconds"] == pytest.approx(4 * (1.0 + 0.25))


@pytest.mark.parametrize("stale_weight", [0.0, 0.5])
def test_per_step_quorum_matches_a_float64_reference_with_stragglers(stale_weight):
  params, state = _run(_agg(speed_trace=TRACE, stale_weight=stale_weight))
  reference = _numpy_run(4, stale_weight)
  for k in PARAMS:
    np.testing.assert_allclose(params[k], reference[k], rtol=2e-5, atol=2e-6)
  figures = aggregation.totals(state)
  assert figures["modelled_seconds"] == pytest.approx(4 * (1.0 + 0.25))
  if stale_weight:  # none dropped: the late ones applied a step late (the last step's held)
    assert (figures["updates_dropped"], figures["staleness_max"]) == (0, 1)
    assert figures["updates_applied"] == 4 * 6 + 3 * 2
  else:
    assert (figures["updates_dropped"], figures["updates_applied"]) == (4 * 2, 4 * 6)


@pytest.mark.slow  # about 10 s on 2 cores; the stragglers' reference drops late workers too
def test_per_step_drop_outs_change_the_result():
  alike, _ = _run(_agg())
  params, state = _run(_agg(dropout_rate=0.3, rejoin_after=1))
  assert aggregation.totals(state)["updates_dropped"] > 0
  assert not np.allclose(params["w"], alike["w"])


def test_per_step_refuses_the_local_update_rules():
  with pytest.raises(ValueError, match=r"rule='async', round_steps=1; allowed: rule in "):
    aggregation.per_step(optax.identity(), _agg("async"), "data")
  with pytest.raises(ValueError, match=r"stale_weight=1.5; allowed: \[0, 1\]"):
    _agg(stale_weight=1.5)
