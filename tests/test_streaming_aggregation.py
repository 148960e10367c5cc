"""Streaming DiLoCo among workers that are slow, late or gone (``aggregation=`` of
``method="streaming_diloco"``, compressors/_streaming.py): each fragment's synchronisation is
one of the simulator's. With the workers alike sync, quorum and async are the plain method bit
for bit; quorum, async and naive async against a float64 reference with stragglers; drop-outs
change the result and a worker that is gone holds the whole anchor bit for bit; two workers a
device meet what one a device does; each kind's bytes are the plain method's compiled
program's; Kale et al.'s eager and naive delayed outer steps per fragment against a float64
reference, resumed bit for bit; ``F`` not dividing ``H`` refused; the runner's figures and a
crash and resume with spread and drop-outs."""

import os

import jax
import numpy as np
import optax
import pytest

import compressors
from compressors import aggregation
from compressors import registry
from compressors import worker_sim
from tests import harness
from tests.test_streaming_diloco import INNER_LR
from tests.test_streaming_diloco import OUTER_LR
from tests.test_streaming_diloco import OUTER_MOMENTUM
from tests.test_streaming_diloco import ROWS
from tests.test_streaming_diloco import _batch
from tests.test_streaming_diloco import _fragment_rows
from tests.test_streaming_diloco import _loss
from tests.test_streaming_diloco import _numpy_grads
from tests.test_streaming_diloco import _params
from tests.test_streaming_diloco import land_fragment

pytestmark = pytest.mark.usefixtures("fast_compiles")

N, EVERY, FRAGMENTS, SYNC_SECONDS = 8, 6, 2, 0.5  # the simulator's round: 3 steps
TRACE = ((1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 2.0, 4.0),)  # two stragglers, seconds per step


def _agg(rule, workers=N, **sim):
  """As the runner gives it: ``round_steps`` is ``H`` (the method makes it ``H / F``)."""
  return aggregation.Aggregation(rule, worker_sim.WorkerSim(workers, **sim), EVERY,
                                 sync_seconds=SYNC_SECONDS)


def _streaming(agg, *, overlap=1, alpha=0.5, land_at_turn=False, every=EVERY, per_device=1,
               workers=N):
  settings = registry.default_settings(
      "streaming_diloco", every=every, fragments=FRAGMENTS, overlap=overlap, alpha=alpha,
      outer_learning_rate=OUTER_LR, outer_momentum=OUTER_MOMENTUM, land_at_turn=land_at_turn)
  axis = "data" if per_device == 1 else ("data", "worker")
  tx = registry.training("streaming_diloco", settings, optimizer=optax.sgd(INNER_LR),
                         learning_rate=INNER_LR, axis_name=axis, aggregation=agg)
  return compressors.data_parallel(
      _loss, tx, harness.mesh(workers // per_device), _params(2), _batch(workers), axis_name=axis,
      workers_per_device=per_device, kinds=registry.step_kinds("streaming_diloco", settings),
      per_worker_params=True)


def _run(dp, steps, each=None, workers=N, params=None, state=None, start=0):
  if params is None:
    params, state = dp.worker_params(_params(2)), dp.init(_params(2))
  for t in range(start, start + steps):
    params, state, _ = dp.step(params, state, _batch(workers), kind=dp.kind_at(t))
    if each is not None:
      each(t, params, state)
  return params, state


@pytest.fixture
def optimised():
  """Compiles with XLA's optimisations (after ``fast_compiles``): with them off, the programs
  with and without the simulator round the outer step's last bit differently."""
  previous = jax.config.read("jax_disable_most_optimizations")
  jax.config.update("jax_disable_most_optimizations", False)
  yield
  jax.config.update("jax_disable_most_optimizations", previous)


@pytest.mark.parametrize("overlap, alpha, land_at_turn, rules", [
    (0, 0.5, False, ("sync",)),  # tau = 0: three kinds to compile (the reference has tau 1)
    # Bit for bit with XLA's optimisations on, every rule, both schedules: the slow suite.
    pytest.param(1, 0.5, False, ("sync", "quorum", "async"), marks=pytest.mark.slow),
    pytest.param(1, 0.0, True, ("sync", "quorum", "async"), marks=pytest.mark.slow)])
def test_with_workers_alike_sync_quorum_and_async_are_streaming_diloco(
    request, overlap, alpha, land_at_turn, rules):
  """Three rounds of H = 6 over 2 fragments (six of the simulator's rounds, the first shorter
  with ``land_at_turn``): every worker's parameters and the anchor (bit for bit with XLA's
  optimisations; to float32's rounding without them, where the outer step's last bit differs);
  every worker-step counted, nothing dropped, each fragment's synchronisation priced as its
  round's compute and one synchronisation."""
  bitwise = len(rules) > 1
  if bitwise:
    request.getfixturevalue("optimised")
  options = dict(overlap=overlap, alpha=alpha, land_at_turn=land_at_turn)
  steps = 3 * EVERY
  reference, plain = _run(_streaming(None, **options), steps)
  assert aggregation.totals(plain) is None
  for rule in rules:
    params, state = _run(_streaming(_agg(rule), **options), steps)
    got, want = (compressors.synchronised_params(s) for s in (state, plain))
    for k in reference:
      for a, b in ((params[k], reference[k]), (got[k], want[k])):
        if bitwise:
          assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), (rule, k)
        else:
          np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7, err_msg=f"{rule}, {k}")
    figures = aggregation.totals(state)
    synced = steps - (overlap if land_at_turn else 0)  # the steps up to the last synchronisation
    assert figures["updates_dropped"] == 0 and figures["useful_steps"] == N * synced, rule
    assert figures["updates_applied"] == N * 2 * steps // EVERY, rule
    assert figures["modelled_seconds"] == pytest.approx(
        synced + 2 * steps // EVERY * SYNC_SECONDS), rule


def _targets(rule, seconds, round_steps):
  if rule != "async":
    return np.full(N, round_steps)
  return np.maximum(1, np.floor(round_steps * seconds.min() / seconds + 0.5)).astype(int)


def _merge(rule, worked, seconds):
  """Whom a synchronisation merges, with what weight, and its modelled compute seconds."""
  arrival = worked * seconds
  if rule == "quorum":  # adaptive: median + 1 median absolute deviation
    median = np.median(arrival)
    deadline = max(median + np.median(np.abs(arrival - median)), arrival.min())
    return np.where(arrival <= deadline, worked, 0).astype(float), min(arrival.max(), deadline)
  return np.ones(N), N / np.sum(1 / arrival)  # async, naive_async: every arrival, unweighted


def _outer(rule, anchor, velocity, mean):
  """The fragment's outer step (async's Delayed Nesterov: one Nesterov step of the mean, as
  every arrival of a round started from the same parameters; naive: N steps of mean / N)."""
  steps, share = (N, mean / N) if rule == "naive_async" else (1, mean)
  for _ in range(steps):
    velocity = OUTER_MOMENTUM * velocity + share
    anchor = anchor - OUTER_LR * (share + OUTER_MOMENTUM * velocity)
  return anchor, velocity


def reference(rule, params, x, y, steps, *, overlap, alpha):
  """Streaming DiLoCo in float64 (tests/test_streaming_diloco.py's reference) among the
  workers of :data:`TRACE`: each worker runs its round's inner steps (async: its own count),
  and fragment ``p``'s synchronisation merges whom ``rule`` takes, weighted. Returns ``(the
  anchor, the modelled seconds)``."""
  seconds, round_steps = np.asarray(TRACE[0]), EVERY // FRAGMENTS
  rows = _fragment_rows(params, FRAGMENTS)
  anchor = {k: np.asarray(v, np.float64) for k, v in params.items()}
  velocity = [{k: np.zeros_like(v) for k, v in anchor.items()} for _ in range(FRAGMENTS)]
  workers, worked = [dict(anchor) for _ in range(N)], np.zeros(N, int)
  targets, lands, modelled = _targets(rule, seconds, round_steps), {}, 0.0
  for t in range(steps):
    for i in np.flatnonzero(worked < targets):
      g = _numpy_grads(workers[i], x[i], y[i])
      workers[i] = {k: workers[i][k] - INNER_LR * g[k] for k in g}
      worked[i] += 1
    for p in range(FRAGMENTS):
      if (t + 1 - p * EVERY // FRAGMENTS) % EVERY == 0:
        weights, wait = _merge(rule, worked, seconds)
        modelled, worked = modelled + wait + SYNC_SECONDS, np.zeros(N, int)
        for k, on in rows[p].items():
          mean = sum(w * (anchor[k][on] - v[k][on]) for w, v in zip(weights, workers))
          anchor[k] = anchor[k].copy()
          anchor[k][on], velocity[p][k][on] = _outer(rule, anchor[k][on], velocity[p][k][on],
                                                     mean / weights.sum())
        lands.setdefault(t + overlap, []).append(p)
    for p in lands.pop(t, []):
      land_fragment(workers, anchor, rows[p], alpha)
  return anchor, modelled


@pytest.mark.parametrize("rule", ["quorum", "async", "naive_async"])
def test_each_aggregator_matches_a_float64_reference_with_stragglers(rule):
  """Six workers of 1 s a step, two of 2 s and 4 s, H = 6 over 2 fragments (rounds of 3
  steps), tau = 1, alpha = 0.5, 13 steps: quorum's adaptive deadline leaves the stragglers
  out; async gives them 2 and 1 steps a round; naive async takes 8 outer steps a fragment."""
  steps, params = 2 * EVERY + 1, _params(2)
  _, state = _run(_streaming(_agg(rule, speed_trace=TRACE)), steps)
  x, y = (np.asarray(a, np.float64).reshape(N, ROWS, -1) for a in _batch(N))
  anchor, modelled = reference(rule, params, x, y, steps, overlap=1, alpha=0.5)
  got = compressors.synchronised_params(state)
  for k in params:
    np.testing.assert_allclose(got[k], anchor[k], rtol=2e-5, atol=2e-6, err_msg=k)
  figures = aggregation.totals(state)
  assert figures["modelled_seconds"] == pytest.approx(modelled, rel=1e-6)
  assert figures["updates_dropped"] == (2 * 4 if rule == "quorum" else 0)
  if rule != "quorum":
    assert (figures["staleness_mean"], figures["staleness_max"]) == ((N - 1) / 2, N - 1)


@pytest.mark.slow  # 35 s: two programs of every kind
def test_workers_simulated_two_per_device_meet_the_same_stragglers_as_one_per_device():
  states = [_run(_streaming(_agg("quorum", speed_trace=TRACE), per_device=d), EVERY + 1)[1]
            for d in (1, 2)]
  one, two = (compressors.synchronised_params(s) for s in states)
  for k in one:
    np.testing.assert_allclose(two[k], one[k], rtol=1e-6, atol=1e-7, err_msg=k)
  assert aggregation.totals(states[0]) == aggregation.totals(states[1])
  assert aggregation.totals(states[0])["updates_dropped"] == 2 * 2  # the stragglers, twice


def _found(state, cls):
  """The one ``cls`` inside ``state``."""
  is_it = lambda x: isinstance(x, cls)
  return next(s for s in jax.tree.leaves(state, is_leaf=is_it) if is_it(s))


@pytest.mark.parametrize("rejoin_after", [2, pytest.param(0, marks=pytest.mark.slow)])
def test_drop_outs_change_the_result_and_a_worker_that_is_gone_holds_the_whole_anchor(
    rejoin_after):
  """A worker that missed a fragment's synchronisation holds the anchor, every fragment, bit
  for bit, from then until it rejoins (``rejoin_after`` steps later; at once with 0): it
  rejoins on the global state; its work is not counted."""
  seen = []

  def check(t, params, state):
    sim, own = (_found(state, cls) for cls in (worker_sim.WorkerSimState,
                                               compressors.AggregatedStreamingState))
    gone = np.asarray(own.gone)
    assert not (np.asarray(sim.step) < np.asarray(sim.absent_until))[~gone].any(), t
    anchor = compressors.synchronised_params(state)
    for i in np.flatnonzero(gone):
      seen.append((t, i))
      for k in anchor:
        assert np.asarray(params[k])[i].tobytes() == np.asarray(anchor[k]).tobytes(), (t, i, k)

  steps = 3 * EVERY
  params, state = _run(_streaming(_agg("sync", dropout_rate=0.3, rejoin_after=rejoin_after)),
                       steps, check)
  assert seen, "no worker dropped out: the test would not test rejoining"
  figures = aggregation.totals(state)
  assert figures["updates_dropped"] > 0 and figures["useful_steps"] < N * steps
  alike, _ = _run(_streaming(_agg("sync")), steps)
  assert not np.allclose(params["w0"], alike["w0"])


def test_each_kind_sends_the_bytes_of_the_plain_methods_compiled_program():
  plain, aggregated = _streaming(None), _streaming(_agg("quorum", speed_spread=0.5))
  sent = {}
  for name, dp in (("plain", plain), ("quorum", aggregated)):
    params, state = dp.worker_params(_params(2)), jax.eval_shape(dp.init, _params(2))
    sent[name] = {k: dp.wire_bytes(params, state, _batch(N), kind=k).total for k in dp.kinds}
  assert sent["quorum"] == sent["plain"] and sent["plain"]["sync0"] > sent["plain"]["local"]


def test_fragments_not_dividing_h_are_refused_in_one_line():
  with pytest.raises(ValueError) as raised:
    _streaming(_agg("sync"), every=5)
  assert ("every=5 with fragments=2 and aggregation='sync'; allowed: every a multiple of "
          "fragments" in str(raised.value) and "\n" not in str(raised.value))


def _nesterov(anchor, velocity, g):
  return _outer("sync", anchor, velocity, g)


def reference_overlapped(rule, params, x, y, steps, *, workers, overlap, alpha):
  """Kale et al.'s ``eager`` or ``delayed`` per fragment of Streaming DiLoCo in float64, the
  workers alike: at fragment ``p``'s synchronisation ``eager`` moves worker ``i``'s own
  fragment by ``g_i = pending_p + (Delta_i,p - sent_i,p) / N`` (``Delta_i,p = own_i,p -
  worker_i,p``) and the evaluated anchor by ``pending_p + (mean_p - pending_p) / N``, and lands
  ``alpha w + (1 - alpha) own_i``; ``delayed`` moves the anchor by the previous synchronisation's
  mean (none at the first) and lands as the plain method. Returns ``(each worker's parameters,
  the anchor)``."""
  rows = _fragment_rows(params, FRAGMENTS)
  copy = lambda: {k: np.asarray(v, np.float64).copy() for k, v in params.items()}
  zeros = lambda: {k: np.zeros(v.shape) for k, v in params.items()}
  anchor, velocity, pending = copy(), [zeros() for _ in range(FRAGMENTS)], zeros()
  own, sent = [copy() for _ in range(workers)], [zeros() for _ in range(workers)]
  own_velocity = [[zeros() for _ in range(FRAGMENTS)] for _ in range(workers)]
  ws, lands, seen = [copy() for _ in range(workers)], {}, set()
  for t in range(steps):
    for i in range(workers):
      g = _numpy_grads(ws[i], x[i], y[i])
      ws[i] = {k: ws[i][k] - INNER_LR * g[k] for k in g}
    for p in range(FRAGMENTS):
      if (t + 1 - p * EVERY // FRAGMENTS) % EVERY:
        continue
      for k, on in rows[p].items():
        start = own if rule == "eager" else [anchor] * workers
        fresh = [start[i][k][on] - ws[i][k][on] for i in range(workers)]
        mean, late = np.mean(fresh, axis=0), pending[k][on]
        if rule == "eager":
          for i in range(workers):
            own[i][k][on], own_velocity[i][p][k][on] = _nesterov(
                own[i][k][on], own_velocity[i][p][k][on], late + (fresh[i] - sent[i][k][on]) /
                workers)
            sent[i][k][on] = fresh[i]
          anchor[k][on], velocity[p][k][on] = _nesterov(anchor[k][on], velocity[p][k][on],
                                                        late + (mean - late) / workers)
        elif p in seen:
          anchor[k][on], velocity[p][k][on] = _nesterov(anchor[k][on], velocity[p][k][on], late)
        pending[k][on] = mean
      seen.add(p)
      lands.setdefault(t + overlap, []).append(p)
    for p in lands.pop(t, []):
      for i in range(workers):
        land_fragment(ws[i:i + 1], own[i] if rule == "eager" else anchor, rows[p], alpha)
  return ws, anchor


# delayed's per-fragment cases are slow: eager's run the same per-fragment state, and
# tests/test_eager.py checks delayed's recursion against float64.
@pytest.mark.parametrize("rule, alpha", [("eager", 0.5),
                                         pytest.param("delayed", 0.5, marks=pytest.mark.slow),
                                         pytest.param("eager", 0.0, marks=pytest.mark.slow)])
def test_eager_and_delayed_match_a_float64_reference_of_the_per_fragment_recursion(rule, alpha):
  """Two workers alike, H = 6 over 2 fragments, tau = 1, three rounds: each worker's
  parameters and the anchor are the recursion's; eager's workers differ, delayed's anchor is
  not sync's; each applied contribution one outer step stale (eager: for the other worker), and
  the communication hidden behind the compute."""
  workers, steps, params = 2, 3 * EVERY, _params(2)
  got, state = _run(_streaming(_agg(rule, workers), alpha=alpha, workers=workers), steps,
                    workers=workers)
  x, y = (np.asarray(a, np.float64).reshape(workers, ROWS, -1) for a in _batch(workers))
  ws, anchor = reference_overlapped(rule, params, x, y, steps, workers=workers, overlap=1,
                                    alpha=alpha)
  mean = compressors.synchronised_params(state)
  for k in params:
    np.testing.assert_allclose(mean[k], anchor[k], rtol=2e-5, atol=2e-6, err_msg=k)
    for i in range(workers):
      np.testing.assert_allclose(np.asarray(got[k])[i], ws[i][k], rtol=2e-5, atol=2e-6,
                                 err_msg=f"{k}, worker {i}")
  figures = aggregation.totals(state)
  assert (figures["staleness_mean"], figures["staleness_max"]) == (
      (0.5, 1) if rule == "eager" else (1, 1))
  # Each round's 0.5 s exchange hidden behind the next round's 3 s of compute.
  assert figures["modelled_seconds"] == pytest.approx(steps)
  if rule == "eager":
    assert not np.allclose(np.asarray(got["w0"])[0], np.asarray(got["w0"])[1])
  else:
    _, synced = _run(_streaming(_agg("sync", workers), workers=workers), steps, workers=workers)
    assert not np.allclose(compressors.synchronised_params(synced)["w0"], anchor["w0"])


@pytest.mark.parametrize("rule", ["eager", pytest.param("delayed", marks=pytest.mark.slow)])
def test_eager_and_delayed_resume_from_their_state_bit_for_bit_with_spread_and_drop_outs(
    optimised, rule):
  """Stopped after 7 steps (fragment 0 sent, not landed) and restarted from the host's copy of
  the parameters and the state, the run ends as the uninterrupted one, bit for bit; a worker
  that is gone holds its own outer parameters (eager) or the anchor (delayed), bit for bit with
  XLA's optimisations (without them eager's own outer step rounds its last bit differently
  where it lands)."""
  del optimised
  dp = _streaming(_agg(rule, speed_spread=0.5, dropout_rate=0.3, rejoin_after=1))
  gone = []

  def check(t, params, state):
    found = _found(state, compressors.DelayedStreamingState if rule == "delayed"
                   else compressors.EagerStreamingState)
    for i in np.flatnonzero(np.asarray(found.gone)):
      gone.append((t, i))
      for k in params:  # the anchor is the same on every worker, own is each one's
        held = np.asarray(found.anchor[k]) if rule == "delayed" else np.asarray(found.own[k])[i]
        assert np.asarray(params[k])[i].tobytes() == held.tobytes(), (t, i, k)

  finished = _run(dp, 2 * EVERY, check)
  params, state = _run(dp, 7)
  host = jax.device_get((params, state))
  params, state = jax.tree.map(lambda h, d: jax.device_put(h, d.sharding), host,
                               (params, state))
  resumed = _run(dp, 2 * EVERY - 7, params=params, state=state, start=7)
  for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(finished)):
    assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
  assert gone and aggregation.totals(resumed[1])["updates_dropped"] > 0


def _quickstart(**fields):
  from configs import quickstart  # pylint: disable=import-outside-toplevel
  config = quickstart.get_config("smoke")
  config.update_from_flattened_dict({
      "method": "streaming_diloco", "num_steps": 8, "compression.streaming_diloco.every": 4,
      "compression.streaming_diloco.fragments": 2, "workers.speed_spread": 0.5,
      "workers.dropout_rate": 0.3, "workers.rejoin_after": 1, "keep_checkpoints": 3, **fields})
  return config


@pytest.mark.slow
@pytest.mark.parametrize("rule", ["quorum", "naive_async", "eager", "delayed"])
def test_the_runner_reports_the_figures_and_resumes_bit_for_bit_with_spread_and_drop_outs(
    tmp_path, rule):
  """8 steps (four of the simulator's rounds), killed after 6 steps (after fragment 1's
  synchronisation, before its landing): the run ends as the uninterrupted one, its figures
  too."""
  config = lambda: _quickstart(aggregation=rule)
  results = harness.assert_resumes_bit_for_bit(config, str(tmp_path), 8, (7, 8))
  assert results["modelled_seconds"] > 0 and results["useful_throughput"] > 0
  assert set(results["staleness"]) == {"mean", "max"} and results["updates_dropped"] > 0
  assert os.path.isdir(os.path.join(str(tmp_path), "finished", "checkpoints", "6"))
