"""Embedding tables sharded over the workers' axis in the one data-parallel step
(compressors.data_parallel(sharded=...), compressors/parallel/sharded_params.py): each placement
gives the replicated tables' trajectory, the compiled step sends the exchange's bytes, the dense
part runs a compressing chain, the replica check skips the tables; 8 workers simulated on 4
devices (or 1) train as 8 devices do and count their own overflow."""

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import compressors
from compressors.parallel import embeddings
from compressors.parallel import sharded_params
from tests import dlrm_problem
from tests.dlrm_problem import BATCH, DEVICES, HOTNESS, LEARNING_RATE, MIXED, ROWS, WIDTH

pytestmark = pytest.mark.usefixtures("fast_compiles")



@pytest.fixture(scope="module")
def problem():
  return dlrm_problem.problem()


@pytest.fixture(scope="module")
def replicated():
  """One device, the whole batch, the tables whole: 20 SGD losses."""
  return dlrm_problem.replicated_trajectory(20)


def _data_parallel(problem, plan, method=None, per_device=1, capacity=None):
  """The sharded step of :func:`dlrm_problem.problem` on ``DEVICES`` workers, ``per_device``
  of them simulated on each device (``axis_name=("data", "worker")``)."""
  tower, batch, tower_params, tables = problem
  mesh = Mesh(np.array(jax.devices()[:DEVICES // per_device]), ("data",))
  axis = "data" if per_device == 1 else ("data", "worker")

  def loss(params, batch):
    pooled, overflow = embeddings.pooled_lookup(plan, params["tables"], batch["sparse"], axis,
                                                capacity)
    logits = tower.apply({"params": params["tower"]}, batch["dense"], pooled)
    return dlrm_problem.bce(logits, batch["label"]), overflow
  params = {"tower": tower_params, "tables": embeddings.shard(plan, tables)}
  specs = {"tower": jax.tree.map(lambda _: P(), tower_params),
           "tables": embeddings.specs(plan, axis)}
  tx = optax.chain(compressors.compress(method or compressors.dense(), axis_name=axis),
                   optax.sgd(LEARNING_RATE))
  dp = compressors.data_parallel(
      loss, tx, mesh, params, batch, has_aux=True, axis_name=axis, workers_per_device=per_device,
      sharded=sharded_params.ShardedParams(specs, optax.sgd(LEARNING_RATE)))
  return dp, jax.device_put(params, jax.tree.map(lambda s: jax.NamedSharding(mesh, s),
                                                 dp.params_spec))


@pytest.mark.parametrize("placement", [*embeddings.PLACEMENTS, MIXED])
def test_each_placement_through_the_step_gives_the_replicated_trajectory(problem, replicated,
                                                                        placement):
  expected, trained = replicated
  plan = embeddings.plan(ROWS, WIDTH, placement, DEVICES)
  dp, params = _data_parallel(problem, plan)
  params, losses, overflow = _train(dp, params, problem[1], 20)
  assert overflow == 0
  assert expected[-1] < expected[0] - 0.05  # it learns: the comparison is not of constants
  np.testing.assert_allclose(losses, expected, rtol=2e-6, atol=2e-6)
  _assert_trained_as_whole(dp, plan, params, trained)


def _train(dp, params, batch, steps):
  """``(params, losses, overflowed keys in all)`` after ``steps`` steps of ``dp`` on ``batch``."""
  state, losses, overflow = dp.init(params), [], 0
  for _ in range(steps):
    params, state, metrics = dp.step(params, state, batch)
    losses.append(float(metrics["loss"]))
    overflow += int(jnp.sum(metrics["aux"]))
  return params, losses, overflow


def _assert_trained_as_whole(dp, plan, params, trained):
  """The placed tables of ``params`` are the tables trained whole, and the replica check
  passes (it compares the replicated leaves only: the bank differs by design)."""
  for got, want in zip(embeddings.unshard(plan, jax.device_get(params["tables"])),
                       trained["tables"]):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  assert bool(dp.replicas_agree(params))


@pytest.mark.parametrize("placement", ["row", "column"])
def test_the_compiled_step_sends_the_exchange_and_the_dense_all_reduce(problem, placement):
  plan = embeddings.plan(ROWS, WIDTH, placement, DEVICES)
  dp, params = _data_parallel(problem, plan)
  sent = dp.wire_bytes(params, dp.init(params), problem[1])
  predicted = embeddings.exchange_bytes(plan, BATCH // DEVICES, HOTNESS)
  exchanged = sum(sent.by_kind.get(kind, 0) for kind in ("all-to-all", "all-gather"))
  assert exchanged == pytest.approx(predicted["forward"] + predicted["backward"], rel=1e-9)
  # The dense all-reduce carries the tower (and the replicated tables), not the bank.
  dense = sum(x.size for x in jax.tree.leaves(problem[2])) * 4 * 2 * (DEVICES - 1) / DEVICES
  assert sent.by_kind["all-reduce"] == pytest.approx(dense, rel=0.01)


def test_a_compressing_chain_serves_the_dense_part(problem):
  """Top-k with error feedback on the tower while the bank trains by SGD: it learns, and the
  error-feedback residuals are per worker, the bank's state too."""
  plan = embeddings.plan(ROWS, WIDTH, "row", DEVICES)
  dp, params = _data_parallel(problem, plan, compressors.topk(0.25))
  state = dp.init(params)
  first = None
  for _ in range(10):
    params, state, metrics = dp.step(params, state, problem[1])
    first = float(metrics["loss"]) if first is None else first
  assert float(metrics["loss"]) < first - 0.02
  assert bool(dp.replicas_agree(params))


def test_what_the_sharded_step_does_not_run_is_refused_in_one_line(problem):
  plan = embeddings.plan(ROWS, WIDTH, "row", DEVICES)
  dp_args = dict(has_aux=True)
  params = {"tower": problem[2], "tables": embeddings.shard(plan, problem[3])}
  specs = {"tower": jax.tree.map(lambda _: P(), problem[2]),
           "tables": embeddings.specs(plan, "data")}
  sharded = sharded_params.ShardedParams(specs, optax.sgd(0.1))
  tx = optax.chain(compressors.compress(compressors.dense(), axis_name="data"), optax.sgd(0.1))
  mesh = Mesh(np.array(jax.devices()[:DEVICES]), ("data",))
  with pytest.raises(ValueError, match="mesh=None is not allowed with sharded parameters"):
    compressors.data_parallel(lambda p, b: 0.0, tx, None, params, problem[1], sharded=sharded,
                              **dp_args)
  with pytest.raises(ValueError, match="per_worker_params=True is not allowed"):
    compressors.data_parallel(lambda p, b: 0.0, tx, mesh, params, problem[1], sharded=sharded,
                              per_worker_params=True, **dp_args)
  bad = sharded._replace(specs={**specs, "tables": {**specs["tables"], "bank": P(None, "data")}})
  with pytest.raises(ValueError, match=r"\['tables'\]\['bank'\] of shape .* axis 1 must be a "
                                       "multiple of 8"):
    compressors.data_parallel(lambda p, b: 0.0, tx, mesh, params, problem[1], sharded=bad,
                              **dp_args)


def _overflow_per_worker(plan, sparse, capacity):
  """Each worker's keys beyond ``capacity`` (numpy): per owner of the bank's de-duplicated
  keys, and of the column bank's (sent to every device)."""
  counts = []
  for rows in np.split(np.arange(BATCH), DEVICES):
    bank, columns = set(), set()
    for t, placement in enumerate(plan.placements):
      for i in sparse[t][rows].reshape(-1).tolist():
        if placement == "row":
          bank.add((i % plan.devices, i // plan.devices + plan.offsets[t]))
        elif placement == "table":
          bank.add((plan.owners[t], plan.offsets[t] + i))
        elif placement == "column":
          columns.add(plan.offsets[t] + i)
    owners = np.bincount([owner for owner, _ in bank], minlength=plan.devices)
    counts.append(int(np.maximum(owners - capacity, 0).sum()) + max(len(columns) - capacity, 0))
  return counts


@pytest.mark.parametrize("per_device", [2, pytest.param(8, marks=pytest.mark.slow)])
def test_simulated_workers_train_the_placed_tables_as_devices_do(problem, per_device):
  """8 workers as 4 devices x 2 simulated workers (and 1 x 8): each worker reads and updates its
  own block of the banks (a device holds its workers' blocks, the layout of 8 devices), so
  every placement gives the trajectory of the tables whole."""
  expected, trained = dlrm_problem.replicated_trajectory(3)
  plan = embeddings.plan(ROWS, WIDTH, MIXED, DEVICES)
  dp, params = _data_parallel(problem, plan, per_device=per_device)
  assert dp.params_spec["tables"]["bank"] == P("data")  # the simulated axis is inside a device
  assert dp.params_spec["tables"]["column_bank"] == P(None, "data")
  params, losses, _ = _train(dp, params, problem[1], 3)
  assert losses[-1] < losses[0] - 0.005  # it learns: the comparison is not of constants
  np.testing.assert_allclose(losses, expected, rtol=1e-5, atol=1e-6)
  _assert_trained_as_whole(dp, plan, params, trained)


def test_simulated_workers_count_their_own_overflow(problem):
  """With a capacity of one key, each of the 8 workers (4 devices x 2) counts its own keys
  that did not fit, as numpy counts them from its share of the batch."""
  plan = embeddings.plan(ROWS, WIDTH, MIXED, DEVICES)
  dp, params = _data_parallel(problem, plan, per_device=2, capacity=1)
  _, _, metrics = dp.step(params, dp.init(params), problem[1])
  expected = _overflow_per_worker(plan, problem[1]["sparse"], 1)
  assert min(expected) > 0
  np.testing.assert_array_equal(np.asarray(metrics["aux"]).reshape(-1), expected)


def test_simulated_workers_need_a_block_per_worker_in_one_line(problem):
  """With simulated workers a sharded leaf's spec names every workers' axis (a block per
  worker), else one line names the leaf."""
  plan = embeddings.plan(ROWS, WIDTH, "row", DEVICES)
  params = {"tower": problem[2], "tables": embeddings.shard(plan, problem[3])}
  specs = {"tower": jax.tree.map(lambda _: P(), problem[2]),
           "tables": embeddings.specs(plan, "data")}  # a block per device only
  tx = optax.chain(compressors.compress(compressors.dense(), axis_name=("data", "worker")),
                   optax.sgd(0.1))
  mesh = Mesh(np.array(jax.devices()[:4]), ("data",))
  with pytest.raises(ValueError, match=r"^data_parallel\(sharded=...\): parameter "
                                       r"\['tables'\]\['bank'\] with spec .*; allowed: P\(\) or "
                                       r"one axis sharded over axis_name=\('data', 'worker'\)$"):
    compressors.data_parallel(lambda p, b: 0.0, tx, mesh, params, problem[1],
                              axis_name=("data", "worker"), workers_per_device=2,
                              sharded=sharded_params.ShardedParams(specs, optax.sgd(0.1)))
