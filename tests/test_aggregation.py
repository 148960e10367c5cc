"""Workers that are slow, late or gone (compressors.worker_sim) and the aggregators of a
local-update method's synchronisation (compressors.aggregation): float64 references of quorum,
async and naive async, sync's bits kept, drop-outs and rejoining, the time model, the runner's
figures, a crash and resume with the simulator's random state, and bad settings refused."""


import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import compressors
from compressors import aggregation
from compressors import worker_sim
from configs import common
from experiments import methods
from experiments import train
from tests import harness

pytestmark = pytest.mark.usefixtures("fast_compiles")

N, DIM, EVERY = 8, 6, 3
INNER_LR, OUTER_LR, MOMENTUM = 0.05, 0.7, 0.9
PARAMS = {"w": jnp.zeros((DIM, DIM)), "b": jnp.zeros((DIM,))}
TRACE = ((1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 2.0, 4.0),)  # two stragglers, seconds per step


def _batch(seed=0):
  return harness.regression_batch(N, DIM, seed)


def _local(agg, per_device=1):
  axis = "data" if per_device == 1 else ("data", "worker")
  exchange = compressors.compress(compressors.dense(), axis_name=axis)
  tx = compressors.local_updates(optax.sgd(INNER_LR), exchange,
                                 compressors.nesterov_outer(OUTER_LR, MOMENTUM),
                                 aggregation=agg, axis_name=axis)
  return compressors.data_parallel(harness.regression_loss, tx, harness.mesh(N // per_device),
                                   PARAMS, _batch(), axis_name=axis, workers_per_device=per_device,
                                   kinds=compressors.local_update_kinds(EVERY),
                                   per_worker_params=True)


def _run(dp, steps, each=None):
  params, state = dp.worker_params(PARAMS), dp.init(PARAMS)
  for t in range(steps):
    params, state, _ = dp.step(params, state, _batch(t), kind=dp.kind_at(t))
    if each is not None:
      each(t, params, state)
  return params, state


def _agg(rule, **sim):
  return aggregation.Aggregation(rule, worker_sim.WorkerSim(N, **sim), EVERY, sync_seconds=0.5)


def test_with_workers_alike_sync_is_diloco_bit_for_bit_and_quorum_and_async_agree():
  reference, _ = _run(_local(None), 6)
  for rule in ("sync", "quorum", "async"):
    params, state = _run(_local(_agg(rule)), 6)
    for k in PARAMS:
      np.testing.assert_array_equal(params[k], reference[k], err_msg=rule)
    figures = aggregation.totals(state)
    assert figures["updates_dropped"] == 0 and figures["useful_steps"] == N * 6
    assert figures["modelled_seconds"] == pytest.approx(2 * (EVERY * 1.0 + 0.5))


def _numpy_grads(params, x, y):
  residual = x @ params["w"] + params["b"] - y
  scale = 2 / residual.size
  return {"w": scale * x.T @ residual, "b": scale * residual.sum(0)}


def _targets(rule, seconds):
  if rule != "async":
    return np.full(N, EVERY)
  return np.maximum(1, np.floor(EVERY * seconds.min() / seconds + 0.5)).astype(int)


def _numpy_round(rule, anchor, velocity, workers, worked, seconds):
  """One synchronisation in float64: ``(anchor, velocity, modelled compute seconds)``."""
  deltas = [{k: anchor[k] - w[k] for k in anchor} for w in workers]
  arrival = worked * seconds
  order = np.argsort(arrival, kind="stable")
  if rule == "quorum":  # adaptive: median + 1 median absolute deviation
    median = np.median(arrival)
    deadline = max(median + np.median(np.abs(arrival - median)), arrival.min())
    weights = np.where(arrival <= deadline, worked, 0).astype(float)
    mean = {k: sum(w * d[k] for w, d in zip(weights, deltas)) / weights.sum() for k in anchor}
    velocity = {k: MOMENTUM * velocity[k] + mean[k] for k in anchor}
    return ({k: anchor[k] - OUTER_LR * (mean[k] + MOMENTUM * velocity[k]) for k in anchor},
            velocity, min(arrival.max(), deadline))
  wait = N / np.sum(1 / arrival)
  theta = dict(anchor)
  if rule == "async":  # Delayed Nesterov: plain steps in arrival order, momentum after N
    for i in order:
      theta = {k: theta[k] - OUTER_LR * deltas[i][k] / N for k in theta}
    buffered = {k: np.mean([d[k] for d in deltas], axis=0) for k in anchor}
    velocity = {k: MOMENTUM * velocity[k] + buffered[k] for k in anchor}
    return {k: theta[k] - OUTER_LR * MOMENTUM * velocity[k] for k in theta}, velocity, wait
  share = {k: np.mean([d[k] for d in deltas], axis=0) / N for k in anchor}
  for _ in order:  # naive: each arrival one full Nesterov step
    velocity = {k: MOMENTUM * velocity[k] + share[k] for k in anchor}
    theta = {k: theta[k] - OUTER_LR * (share[k] + MOMENTUM * velocity[k]) for k in theta}
  return theta, velocity, wait


def _numpy_run(rule, steps):
  seconds = np.asarray(TRACE[0])
  anchor = {k: np.zeros(v.shape) for k, v in PARAMS.items()}
  velocity = {k: np.zeros(v.shape) for k, v in PARAMS.items()}
  workers, worked, modelled = [dict(anchor) for _ in range(N)], np.zeros(N, int), 0.0
  targets = _targets(rule, seconds)
  for t in range(steps):
    x, y = (np.asarray(a, np.float64).reshape(N, -1, *a.shape[1:]) for a in _batch(t))
    for i in range(N):
      if worked[i] < targets[i]:
        g = _numpy_grads(workers[i], x[i], y[i])
        workers[i] = {k: workers[i][k] - INNER_LR * g[k] for k in g}
        worked[i] += 1
    if t % EVERY == EVERY - 1:
      anchor, velocity, wait = _numpy_round(rule, anchor, velocity, workers, worked, seconds)
      modelled += wait + 0.5
      workers, worked = [dict(anchor) for _ in range(N)], np.zeros(N, int)
  return anchor, modelled


@pytest.mark.parametrize("rule", ["quorum", "async", "naive_async"])
def test_each_aggregator_matches_a_float64_reference_with_stragglers(rule):
  """Six workers of 1 s a step, two of 2 s and 4 s (a trace), two rounds of H = 3: quorum's
  adaptive deadline leaves the stragglers out; async gives them fewer steps (2 and 1) and
  applies every arrival in order with Delayed Nesterov; naive async takes 8 outer steps."""
  _, state = _run(_local(_agg(rule, speed_trace=TRACE)), 6)
  anchor, modelled = _numpy_run(rule, 6)
  got = compressors.synchronised_params(state)
  for k in PARAMS:
    np.testing.assert_allclose(got[k], anchor[k], rtol=2e-5, atol=2e-6)
  figures = aggregation.totals(state)
  assert figures["modelled_seconds"] == pytest.approx(modelled, rel=1e-6)
  assert figures["updates_dropped"] == (4 if rule == "quorum" else 0)
  if rule != "quorum":
    assert (figures["staleness_mean"], figures["staleness_max"]) == ((N - 1) / 2, N - 1)


def test_workers_simulated_two_per_device_meet_the_same_stragglers_as_one_per_device():
  states = [_run(_local(_agg("quorum", speed_trace=TRACE), per_device), 6)[1]
            for per_device in (1, 2)]
  one, two = (compressors.synchronised_params(s) for s in states)
  for k in PARAMS:
    np.testing.assert_allclose(two[k], one[k], rtol=1e-6, atol=1e-7)
  assert aggregation.totals(states[0]) == aggregation.totals(states[1])


def test_drop_outs_change_the_result_and_a_rejoining_worker_holds_the_global_state():
  """A worker that missed a synchronisation stays frozen on the synchronised parameters (bit
  for bit) until it rejoins ``rejoin_after`` steps later; its work is not counted."""
  agg = _agg("sync", dropout_rate=0.4, rejoin_after=2)
  gone_seen = []

  def check(t, params, state):
    is_sim = lambda x: isinstance(x, worker_sim.WorkerSimState)
    sim = next(s for s in jax.tree.leaves(state, is_leaf=is_sim) if is_sim(s))
    anchor = compressors.synchronised_params(state)
    gone = np.asarray(sim.step) < np.asarray(sim.absent_until)
    for i in np.flatnonzero(gone):
      gone_seen.append(t)
      for k in PARAMS:
        assert np.asarray(params[k])[i].tobytes() == np.asarray(anchor[k]).tobytes(), (t, i)

  params, state = _run(_local(agg), 9, check)
  assert gone_seen, "no worker dropped out: the test would not test rejoining"
  figures = aggregation.totals(state)
  assert figures["updates_dropped"] > 0 and figures["useful_steps"] < N * 9
  alike, _ = _run(_local(_agg("sync")), 9)
  assert not np.allclose(params["w"], alike["w"])


@pytest.mark.parametrize("field,value,words", [
    ("workers.speed_spread", -0.1, "config.workers.speed_spread=-0.1 is outside [0, inf)"),
    ("workers.dropout_rate", 1.0, "config.workers.dropout_rate=1.0 is outside [0, 1)"),
    ("workers.dropout_rate", -0.5, "config.workers.dropout_rate=-0.5 is outside [0, 1)"),
    ("quorum.deadline", 0.0, "config.quorum.deadline=0.0 is outside (0, inf)"),
    ("quorum.stale_weight", 1.5, "config.quorum.stale_weight=1.5 is outside [0, 1]"),
    ("aggregation", "gossip", "config.aggregation='gossip' is unknown; allowed: "),
])
def test_bad_settings_are_refused_in_one_line_naming_field_value_and_range(field, value, words):
  config = common.base()
  config.update_from_flattened_dict({field: value})
  with pytest.raises((ValueError, TypeError)) as raised:
    common.check(config)
  assert words in str(raised.value) and "\n" not in str(raised.value)


def test_a_trace_with_the_wrong_worker_count_and_a_method_without_aggregator_are_refused(
    tmp_path):
  trace = tmp_path / "trace.txt"
  trace.write_text("1.0 1.2 0.9\n1.1 1.0 1.3\n")
  config = common.base()
  config.update_from_flattened_dict({"method": "diloco", "workers.speed_trace": str(trace)})
  with pytest.raises(ValueError) as raised:
    methods.worker_simulation(config, 8)
  assert (f"config.workers.speed_trace={str(trace)!r} has 3 columns; allowed: one per worker, 8"
          in str(raised.value)) and "\n" not in str(raised.value)
  assert len(methods.worker_simulation(config, 3).speed_trace) == 2
  config.update_from_flattened_dict({"method": "onebit_adam", "workers.speed_trace": ""})
  config.aggregation = "quorum"
  with pytest.raises(ValueError, match="config.method='onebit_adam' does not; allowed: "):
    methods.worker_simulation(config, 8)
  config.update_from_flattened_dict({"method": "topk", "aggregation": "async"})
  with pytest.raises(ValueError, match=r"config.aggregation='async' with config.method='topk', "
                     r"a per-step method; allowed: \('sync', 'quorum'\)"):
    methods.worker_simulation(config, 8)
  config.aggregation = "quorum"
  assert methods.worker_simulation(config, 8).workers == 8
  config.method = "diloco"
  assert methods.worker_simulation(config, 8).workers == 8
  config.aggregation = "sync"
  assert methods.worker_simulation(config, 8) is None  # the published algorithm, no simulator


def _quickstart(**fields):
  from configs import quickstart  # pylint: disable=import-outside-toplevel
  config = quickstart.get_config("smoke")
  config.update_from_flattened_dict({"method": "diloco", "num_steps": 4,
                                     "compression.diloco.every": 2, **fields})
  return config


@pytest.mark.slow
def test_the_runner_reports_modelled_time_and_quorum_models_less_than_sync_with_spread(
    tmp_path):
  results = {rule: train.train_and_evaluate(
      _quickstart(aggregation=rule, **{"workers.speed_spread": 0.5}), str(tmp_path / rule))
             for rule in ("sync", "quorum")}
  for r in results.values():
    assert r["modelled_seconds"] > 0 and r["useful_throughput"] > 0
    assert set(r["staleness"]) == {"mean", "max"} and "updates_dropped" in r
  assert results["quorum"]["modelled_seconds"] < results["sync"]["modelled_seconds"]
  assert results["quorum"]["updates_dropped"] > 0 == results["sync"]["updates_dropped"]


@pytest.mark.slow
@pytest.mark.parametrize("rule", ["quorum", "eager", "delayed"])
def test_a_run_with_spread_and_drop_outs_resumes_bit_for_bit(tmp_path, rule):
  """Killed after step 2 of 4 (the later checkpoints gone), the run ends as the uninterrupted
  one, the simulator's draws (speeds, drop-outs) and totals included (eager: the workers' own
  outer parameters and states too; delayed: the pending mean)."""
  config = lambda: _quickstart(aggregation=rule, **{
      "workers.speed_spread": 0.5, "workers.dropout_rate": 0.3, "workers.rejoin_after": 1})
  harness.assert_resumes_bit_for_bit(config, str(tmp_path), 4, (3, 4))
