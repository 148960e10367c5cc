"""Kale et al.'s eager outer step (``aggregation="eager"``, compressors.aggregation) and their
naive one-step-delayed baseline (``aggregation="delayed"``): float64 references of both
recursions for two workers on a quadratic, the bytes of sync's round, a resume from the state
alone, and the overlapped time model."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import compressors
from compressors import aggregation
from compressors import worker_sim
from experiments import methods
from tests import harness

pytestmark = pytest.mark.usefixtures("fast_compiles")

N, DIM, EVERY = 2, 4, 3
INNER_LR, OUTER_LR, MOMENTUM = 0.05, 0.7, 0.9
PARAMS = {"w": jnp.zeros((DIM, DIM)), "b": jnp.zeros((DIM,))}


def _batch(seed=0):
  return harness.regression_batch(N, DIM, seed)


def _agg(rule, sync_seconds=0.0, **sim):
  return aggregation.Aggregation(rule, worker_sim.WorkerSim(N, **sim), EVERY,
                                 sync_seconds=sync_seconds)


def _local(agg, per_device=1):
  axis = "data" if per_device == 1 else ("data", "worker")
  exchange = compressors.compress(compressors.dense(), axis_name=axis)
  tx = compressors.local_updates(optax.sgd(INNER_LR), exchange,
                                 compressors.nesterov_outer(OUTER_LR, MOMENTUM),
                                 aggregation=agg, axis_name=axis)
  return compressors.data_parallel(harness.regression_loss, tx, harness.mesh(N // per_device),
                                   PARAMS, _batch(), axis_name=axis,
                                   workers_per_device=per_device,
                                   kinds=compressors.local_update_kinds(EVERY),
                                   per_worker_params=True)


def _run(dp, steps, params=None, state=None, start=0):
  if params is None:
    params, state = dp.worker_params(PARAMS), dp.init(PARAMS)
  for t in range(start, start + steps):
    params, state, _ = dp.step(params, state, _batch(t), kind=dp.kind_at(t))
  return params, state


def _grads(p, x, y):
  residual = x @ p["w"] + p["b"] - y
  scale = 2 / residual.size
  return {"w": scale * x.T @ residual, "b": scale * residual.sum(0)}


def _nesterov(p, velocity, g):
  velocity = {k: MOMENTUM * velocity[k] + g[k] for k in g}
  return {k: p[k] - OUTER_LR * (g[k] + MOMENTUM * velocity[k]) for k in g}, velocity


def _inner_step(workers, t):
  """Each worker's inner SGD step on its own share of step ``t``'s batch, in float64."""
  x, y = (np.asarray(a, np.float64).reshape(N, -1, *a.shape[1:]) for a in _batch(t))
  return [{k: w[k] - INNER_LR * g for k, g in _grads(w, x[i], y[i]).items()}
          for i, w in enumerate(workers)]


def _numpy_eager(steps):
  """Kale et al.'s eager recursion in float64: worker ``i`` applies ``(Delta_i^t + sum_{j != i}
  Delta_j^{t-1}) / N`` to its own outer parameters through its own Nesterov state."""
  zero = {k: np.zeros(v.shape) for k, v in PARAMS.items()}
  own, velocity, sent = [dict(zero) for _ in range(N)], [dict(zero) for _ in range(N)], \
      [dict(zero) for _ in range(N)]
  workers = [dict(zero) for _ in range(N)]
  for t in range(steps):
    workers = _inner_step(workers, t)
    if t % EVERY == EVERY - 1:
      fresh = [{k: own[i][k] - workers[i][k] for k in own[i]} for i in range(N)]
      for i in range(N):
        others = {k: sum(sent[j][k] for j in range(N) if j != i) for k in zero}
        own[i], velocity[i] = _nesterov(own[i], velocity[i],
                                        {k: (fresh[i][k] + others[k]) / N for k in zero})
      sent, workers = fresh, [dict(o) for o in own]
  return own


def _numpy_delayed(steps):
  """Kale et al.'s naive one-step-delayed recursion in float64: the shared anchor takes the
  outer step of the previous round's mean (none at the first round), and every worker restarts
  from it."""
  zero = {k: np.zeros(v.shape) for k, v in PARAMS.items()}
  anchor, velocity, pending = dict(zero), dict(zero), None
  workers = [dict(zero) for _ in range(N)]
  for t in range(steps):
    workers = _inner_step(workers, t)
    if t % EVERY == EVERY - 1:
      mean = {k: np.mean([anchor[k] - w[k] for w in workers], axis=0) for k in zero}
      if pending is not None:
        anchor, velocity = _nesterov(anchor, velocity, pending)
      pending, workers = mean, [dict(anchor) for _ in range(N)]
  return anchor


def test_delayed_matches_a_float64_reference_of_the_naive_delayed_recursion():
  """Two workers alike: after three rounds both hold the anchor, which is the delayed
  recursion's (two outer steps, each with the round before's mean), and neither sync's nor
  eager's."""
  params, state = _run(_local(_agg("delayed")), 3 * EVERY)
  reference = _numpy_delayed(3 * EVERY)
  anchor = compressors.synchronised_params(state)
  for k in PARAMS:
    np.testing.assert_allclose(anchor[k], reference[k], rtol=2e-5, atol=2e-6)
    for i in range(N):
      assert np.asarray(params[k])[i].tobytes() == np.asarray(anchor[k]).tobytes()
  for rule in ("sync", "eager"):
    other, _ = _run(_local(_agg(rule)), 3 * EVERY)
    assert not np.allclose(np.asarray(other["w"])[0], reference["w"], rtol=1e-3)


def test_eager_matches_a_float64_reference_of_its_recursion_and_differs_from_sync_by_the_delay():
  """Two workers alike, no latency: each worker's parameters after three rounds are the eager
  recursion's, the evaluated model is their mean, and sync (the same recursion without the
  delay) ends elsewhere."""
  params, state = _run(_local(_agg("eager")), 3 * EVERY)
  reference = _numpy_eager(3 * EVERY)
  for i in range(N):
    for k in PARAMS:
      np.testing.assert_allclose(np.asarray(params[k])[i], reference[i][k], rtol=2e-5,
                                 atol=2e-6)
  mean = compressors.synchronised_params(state)
  for k in PARAMS:
    np.testing.assert_allclose(mean[k], np.mean([r[k] for r in reference], axis=0), rtol=2e-5,
                               atol=2e-6)
  assert not np.allclose(np.asarray(params["w"])[0], np.asarray(params["w"])[1])
  synced, _ = _run(_local(_agg("sync")), 3 * EVERY)
  assert not np.allclose(np.asarray(synced["w"])[0], reference[0]["w"], rtol=1e-3)


@pytest.mark.slow
def test_eager_and_delayed_send_the_bytes_of_syncs_round():
  """One exchange of the pseudo-gradient a round, from the compiled programs."""
  sent = {}
  for rule in ("sync", "eager", "delayed"):
    dp = _local(_agg(rule))
    params, state = dp.worker_params(PARAMS), dp.init(PARAMS)
    sent[rule] = {kind: dp.wire_bytes(params, state, _batch(), kind=kind).total
                  for kind in dp.kinds}
  assert sent["eager"] == sent["delayed"] == sent["sync"]
  assert sent["sync"]["sync"] > 16 * DIM > sent["sync"]["local"]


@pytest.mark.parametrize("rule", ["eager", "delayed"])
def test_eager_and_delayed_resume_from_their_state_bit_for_bit_with_spread_and_drop_outs(rule):
  """Stopped after four steps and restarted from the host's copy of the parameters and the
  state (what a checkpoint holds), the run ends as the uninterrupted one, bit for bit."""
  dp = _local(_agg(rule, speed_spread=0.5, dropout_rate=0.3, rejoin_after=1))
  finished = _run(dp, 9)
  params, state = _run(dp, 4)
  host = jax.device_get((params, state))
  params, state = jax.tree.map(lambda h, d: jax.device_put(h, d.sharding), host,
                               (params, state))
  resumed = _run(dp, 5, params, state, start=4)
  for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(finished)):
    assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
  assert aggregation.totals(resumed[1])["updates_dropped"] > 0


@pytest.mark.slow  # about 20 s on 2 cores
def test_eager_workers_simulated_on_one_device_meet_the_same_as_one_per_device():
  agg = _agg("eager", speed_spread=0.5, dropout_rate=0.3, rejoin_after=1)
  (one, one_state), (two, two_state) = (_run(_local(agg, per_device), 2 * EVERY)
                                        for per_device in (1, 2))
  for k in PARAMS:
    np.testing.assert_allclose(two[k], one[k], rtol=1e-6, atol=1e-7)
  assert aggregation.totals(one_state) == aggregation.totals(two_state)


@pytest.mark.slow  # about 35 s on 2 cores
def test_eager_and_delayed_hide_the_communication_behind_the_next_rounds_compute():
  """Per round ``max(compute, communication)``, sync's sum; each contribution reaches the
  other worker one outer step late (eager), or every worker (delayed)."""
  for seconds, per_round in ((0.5, EVERY * 1.0), (5.0, 5.0)):
    totals = {rule: aggregation.totals(_run(_local(_agg(rule, seconds)), 2 * EVERY)[1])
              for rule in ("sync", "eager", "delayed")}
    assert totals["eager"]["modelled_seconds"] == pytest.approx(2 * per_round)
    assert totals["delayed"]["modelled_seconds"] == pytest.approx(2 * per_round)
    assert totals["sync"]["modelled_seconds"] == pytest.approx(2 * (EVERY + seconds))
    assert (totals["eager"]["staleness_mean"], totals["eager"]["staleness_max"]) == (0.5, 1)
    assert (totals["delayed"]["staleness_mean"], totals["delayed"]["staleness_max"]) == (1, 1)


@pytest.mark.parametrize("method", ["diloco", "streaming_diloco"])
def test_the_runner_takes_eager_and_delayed_and_refuses_an_unknown_rule_in_one_line(method):
  from configs import common  # pylint: disable=import-outside-toplevel
  config = common.base()
  for rule in ("eager", "delayed"):
    config.update_from_flattened_dict({"method": method, "aggregation": rule})
    assert methods.worker_simulation(config, 8).workers == 8
  with pytest.raises(ValueError) as raised:
    _agg("gossip")
  message = str(raised.value)
  assert ("rule='gossip'; allowed: ('sync', 'quorum', 'async', 'naive_async', 'eager', "
          "'delayed')" in message and "\n" not in message)
