"""Local updates (DiLoCo and its family): the algorithm against references, the per-worker
parameters' layout, bytes, checks and checkpoints, and the runner end to end.

The shared method checks (tests/method_checks.py) run diloco and sparseloco too: replicas
identical after each synchronisation, pmap = shard_map, simulated workers = devices, bytes within
the exchange's cost model.
"""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import compressors
from compressors import registry
from experiments import checkpoint
from experiments import train
from tests import harness

pytestmark = pytest.mark.usefixtures("fast_compiles")

N = 8
_loss = harness.regression_loss  # one worker's loss: a linear regression
DIM = 6


def _batch(seed=0):
  key_x, key_w = jax.random.split(jax.random.PRNGKey(seed))
  x = jax.random.normal(key_x, (N * 4, DIM))
  return x, x @ jax.random.normal(key_w, (DIM, DIM)) + 0.5


PARAMS = {"w": jnp.zeros((DIM, DIM)), "b": jnp.zeros((DIM,))}


def assert_resumes_bit_for_bit(config, finished: str, resumed: str, between: int, last: int,
                               results: dict) -> None:
  """The run in ``finished`` (``config()``'s, ``last`` steps) held each worker's own parameters
  at step ``between`` (they differ between workers), and a copy of it restarted from that
  checkpoint (the later ones and the results removed) ends bit for bit as it did."""
  rows = np.asarray(jax.tree.leaves(checkpoint.load_params(finished, between))[0])
  assert rows.shape[0] == 8 and not all(r.tobytes() == rows[0].tobytes() for r in rows)
  shutil.copytree(finished, resumed)
  for step in range(between + 1, last + 1):
    shutil.rmtree(os.path.join(resumed, "checkpoints", str(step)), ignore_errors=True)
  os.remove(os.path.join(resumed, train.RESULTS_FILE))
  again = train.train_and_evaluate(config(), resumed)
  jax.tree.map(np.testing.assert_array_equal, checkpoint.load_params(resumed, last),
               checkpoint.load_params(finished, last))
  assert again["test_loss"] == results["test_loss"]


def _local(inner, every, *, exchange=None, outer=None, mesh=None, axis="data", per_device=1):
  exchange = exchange or compressors.compress(compressors.dense(), axis_name=axis)
  tx = compressors.local_updates(inner, exchange, outer)
  return compressors.data_parallel(
      _loss, tx, harness.mesh() if mesh is None else mesh, PARAMS, _batch(), axis_name=axis,
      workers_per_device=per_device, kinds=compressors.local_update_kinds(every),
      per_worker_params=True)


def _run(dp, steps, batches=None):
  params, state = dp.worker_params(PARAMS), dp.init(PARAMS)
  for t in range(steps):
    batch = _batch() if batches is None else batches(t)
    params, state, _ = dp.step(params, state, batch, kind=dp.kind_at(t))
  return params, state


def _numpy_grads(params, x, y):
  """Each worker's gradient of the mean squared error, float64."""
  residual = x @ params["w"] + params["b"] - y
  scale = 2 / residual.size
  return {"w": scale * x.T @ residual, "b": scale * residual.sum(0)}


def test_diloco_matches_a_numpy_reference_of_the_paper():
  """Inner SGD for H = 3 steps on each worker's rows, the mean pseudo-gradient, an outer
  Nesterov step (lr 0.7, momentum 0.9), every worker restarting from it: two rounds, then one
  local step."""
  inner_lr, every, steps = 0.05, 3, 7
  dp = _local(optax.sgd(inner_lr), every)
  params, state = _run(dp, steps)
  x, y = (np.asarray(a, np.float64).reshape(N, -1, *a.shape[1:]) for a in _batch())
  anchor = {k: np.zeros(v.shape) for k, v in PARAMS.items()}
  velocity = {k: np.zeros(v.shape) for k, v in PARAMS.items()}
  workers = [dict(anchor) for _ in range(N)]
  for t in range(steps):
    for i in range(N):
      g = _numpy_grads(workers[i], x[i], y[i])
      workers[i] = {k: workers[i][k] - inner_lr * g[k] for k in g}
    if t % every == every - 1:
      for k in anchor:
        delta = np.mean([anchor[k] - w[k] for w in workers], axis=0)
        velocity[k] = 0.9 * velocity[k] + delta
        anchor[k] = anchor[k] - 0.7 * (delta + 0.9 * velocity[k])
      workers = [dict(anchor) for _ in range(N)]
  for k in PARAMS:
    got = np.asarray(params[k])
    for i in range(N):
      np.testing.assert_allclose(got[i], workers[i][k], rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(compressors.synchronised_params(state)[k], anchor[k], rtol=2e-5,
                               atol=2e-6)


def test_every_step_synchronising_with_plain_outer_sgd_is_data_parallelism_of_updates():
  """H = 1, outer SGD of lr 1, dense exchange: each step every worker's own Adam update from the
  same parameters, averaged, i.e. ``chain(adam, exchange)`` with per-worker Adam states (the
  runner's ``exchanged="update"``)."""
  local = _local(optax.adam(0.01), 1, outer=optax.sgd(1.0))
  assert list(local.kinds) == ["sync"]
  params, _ = _run(local, 5)
  exchange = compressors.compress(compressors.dense(), axis_name="data")
  update_dp = compressors.data_parallel(_loss, optax.chain(optax.adam(0.01), exchange),
                                        harness.mesh(), PARAMS, _batch())
  reference, state = PARAMS, update_dp.init(PARAMS)
  for _ in range(5):
    reference, state, _ = update_dp.step(reference, state, _batch())
  assert update_dp.specs.inner[0][0].mu["w"] != jax.sharding.PartitionSpec()  # Adam per worker
  for k in PARAMS:
    for row in np.asarray(params[k]):
      np.testing.assert_allclose(row, reference[k], rtol=1e-5, atol=1e-6)


def test_local_steps_move_nothing_and_a_synchronisation_moves_the_exchange():
  dp = _local(optax.adam(0.01), 4)
  params, state = dp.worker_params(PARAMS), jax.eval_shape(dp.init, PARAMS)
  flag = dp.nonfinite_flag_bytes()
  local = dp.wire_bytes(params, state, _batch(), kind="local")
  assert local.total == flag and len(local.collectives) == 1  # the non-finite guard alone
  sync = dp.wire_bytes(params, state, _batch(), kind="sync").total - flag
  dense = compressors.data_parallel(
      _loss, optax.chain(compressors.compress(compressors.dense(), axis_name="data"),
                         optax.sgd(0.1)), harness.mesh(), PARAMS, _batch())
  assert sync == dense.wire_bytes(PARAMS, jax.eval_shape(dense.init, PARAMS),
                                  _batch()).total - flag
  assert dp.bytes_per_step({"local": 0.0, "sync": sync}, 0, 8) == sync / 4


def test_workers_differ_between_synchronisations_and_agree_bit_for_bit_after():
  dp = _local(optax.adam(0.01), 3)
  params, state = dp.worker_params(PARAMS), dp.init(PARAMS)
  for t in range(6):
    params, state, _ = dp.step(params, state, _batch(), kind=dp.kind_at(t))
    assert bool(dp.replicas_agree(params)) == (t % 3 == 2), t
  rows = np.asarray(params["w"])
  assert all(r.tobytes() == np.asarray(compressors.synchronised_params(state)["w"]).tobytes()
             for r in rows)


def test_tasc_on_the_pseudo_gradient_gets_its_curvature_at_synchronisations():
  settings = registry.default_settings("diloco", every=2, carrier="tasc")
  kinds = registry.step_kinds("diloco", settings)
  assert [(k.name, k.every, k.phase, k.inputs is not None) for k in kinds] == [
      ("local", 1, 0, False), ("sync", 2, 1, False), ("sync_with_inputs", 100, 1, True)]
  tasc_settings = registry.default_settings("tasc", hessian_every=4, block_size=4,
                                            density=0.5, num_probes=1)
  kinds = registry.step_kinds("diloco", settings, exchange_settings=tasc_settings)
  tx = registry.training("diloco", settings, optimizer=optax.adam(0.01), learning_rate=0.01,
                         axis_name="data", exchange_settings=tasc_settings)
  dp = compressors.data_parallel(_loss, tx, harness.mesh(), PARAMS, _batch(), kinds=kinds,
                                 per_worker_params=True)
  assert [dp.kind_at(t) for t in range(6)] == ["local", "sync_with_inputs", "local", "sync",
                                                "local", "sync_with_inputs"]
  params, state = _run(dp, 6)
  assert bool(dp.replicas_agree(params))
  assert np.isfinite(np.asarray(params["w"])).all()


def test_bad_local_settings_are_refused_with_the_field():
  with pytest.raises(ValueError, match="every=0"):
    registry.training("diloco", registry.default_settings("diloco", every=0),
                      optimizer=optax.sgd(0.1), learning_rate=0.1, axis_name="data")
  with pytest.raises(ValueError, match="carrier='demo' is a optimizer method"):
    registry.training("diloco", registry.default_settings("diloco", carrier="demo"),
                      optimizer=optax.sgd(0.1), learning_rate=0.1, axis_name="data")
  with pytest.raises(ValueError, match="exchanged='update' with method 'diloco'"):
    registry.training("diloco", optimizer=optax.sgd(0.1), learning_rate=0.1, axis_name="data",
                      common=registry.Common(exchanged="update"))
  with pytest.raises(ValueError, match="outer_momentum=1.0"):
    registry.training("diloco", registry.default_settings("diloco", outer_momentum=1.0),
                      optimizer=optax.sgd(0.1), learning_rate=0.1, axis_name="data")


def _quickstart(**fields):
  from configs import quickstart  # pylint: disable=import-outside-toplevel
  config = quickstart.get_config("smoke")
  config.update_from_flattened_dict({"method": "diloco", "num_steps": 4,
                                     "compression.diloco.every": 2, **fields})
  return config


def test_the_runner_charges_a_run_its_synchronisations_bytes_over_h_and_resumes_mid_round(
    tmp_path):
  """4 steps, a synchronisation every 2: the logged bytes per step are the synchronising
  program's over 2 (the guard's flag apart); a restart from the checkpoint after step 3 (between
  synchronisations: every worker's own parameters) ends bit for bit as the uninterrupted run."""
  finished = str(tmp_path / "finished")
  results = train.train_and_evaluate(_quickstart(), finished)
  assert results["bytes_by_kind"]["local"] == 0
  assert results["wire_bytes"] == pytest.approx(results["bytes_by_kind"]["sync"] / 2, rel=0.01)
  assert results["compression_ratio"] == pytest.approx(2 * results["dense_bytes"] /
                                                       results["bytes_by_kind"]["sync"])
  assert_resumes_bit_for_bit(_quickstart, finished, str(tmp_path / "resumed"), 3, 4, results)
  with open(os.path.join(finished, "metrics.jsonl")) as f:
    logged = [json.loads(line) for line in f if '"loss"' in line]
  assert [r["total_bytes"] for r in logged] == pytest.approx(
      [0, results["bytes_by_kind"]["sync"], results["bytes_by_kind"]["sync"],
       2 * results["bytes_by_kind"]["sync"]])


def test_a_traced_synchronise_flag_is_refused():
  tx = compressors.local_updates(optax.sgd(0.1), compressors.compress(compressors.dense(),
                                                                      axis_name=None))
  with pytest.raises(TypeError, match="synchronise=.* must be a Python bool"):
    jax.jit(lambda flag: tx.update(PARAMS, tx.init(PARAMS), PARAMS, synchronise=flag))(True)
