"""Hot rows replicated on every device (compressors/parallel/hot_rows.py) and the planner that
chooses them and the placements (compressors/embedding_planner.py): the math of the
tables whole, the compiled program's bytes as predicted, the all-to-all's bytes cut on the
synthetic skew."""

import dataclasses
import functools
import json
import shutil

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
import ml_collections
import numpy as np
import optax
import pytest

import compressors
from compressors import embedding_codecs
from compressors import embedding_planner
from compressors import registry
from compressors.network import topology
from compressors.parallel import embeddings
from compressors.parallel import hlo_bytes
from compressors.parallel import hot_rows
from compressors.parallel import sharded_params
from experiments import table_planning
from experiments.data import criteo
from experiments.models import dlrm
from tests import dlrm_problem
from tests import harness
from tests.dlrm_problem import BATCH, DEVICES, HOTNESS, LEARNING_RATE, MIXED, ROWS, WIDTH

pytestmark = pytest.mark.usefixtures("fast_compiles")


@pytest.fixture(scope="module")
def problem():
  return dlrm_problem.problem()


@pytest.fixture(scope="module")
def replicated():
  return dlrm_problem.replicated_trajectory(20)


def _step(tower, plan, hot, capacity=None, rows_exchange=None):
  """The data-parallel SGD step with the tables placed by ``plan`` and ``hot`` (the rows'
  all-to-alls encoded by ``rows_exchange``): ``(params, batch) -> (params, mean loss,
  overflow)``."""
  mesh = Mesh(np.array(jax.devices()[:DEVICES]), ("data",))

  def body(params, batch):
    def loss(params):
      pooled, overflow = hot_rows.pooled_lookup(plan, hot, params["tables"], batch["sparse"],
                                                "data", capacity, rows_exchange)
      logits = tower.apply({"params": params["tower"]}, batch["dense"], pooled)
      return dlrm_problem.bce(logits, batch["label"]), overflow
    (value, overflow), grads = jax.value_and_grad(loss, has_aux=True)(params)
    params = jax.tree.map(lambda p, g: p - LEARNING_RATE * g / DEVICES, params, grads)
    return params, jax.lax.pmean(value, "data"), jax.lax.psum(overflow, "data")
  specs = {"tower": P(), "tables": hot_rows.specs(plan, "data")}
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs, P("data")),
                               out_specs=(specs, P(), P())))


def _hot(plan, batch, count):
  """The ``count`` most looked-up rows of each fetched table in ``batch``."""
  counts = [np.bincount(ids.ravel(), minlength=r) for ids, r in zip(batch["sparse"], plan.rows)]
  return hot_rows.hot_rows(plan, [ids if t in plan.fetched else [] for t, ids in
                                  enumerate(hot_rows.hottest(counts, [count] * len(counts)))])


@pytest.mark.parametrize("placement,count,capacity", [
    (MIXED, 5, None),
    # about 20 s each on 2 cores
    pytest.param("row", 4, 8, marks=pytest.mark.slow),
    pytest.param("table", 3, None, marks=pytest.mark.slow),
    pytest.param("row", 200, 1, marks=pytest.mark.slow)])
def test_hot_rows_give_the_replicated_trajectory_over_20_steps(problem, replicated, placement,
                                                               count, capacity):
  """Hot rows served locally, the rest through the all-to-all (with a capacity that the hot
  rows leave room for): the losses and the trained tables of the tables whole. A count of 200
  makes every row of every fetched table hot (no cold key left)."""
  tower, batch, tower_params, tables = problem
  expected, trained = replicated
  plan = embeddings.plan(ROWS, WIDTH, placement, DEVICES)
  hot = _hot(plan, batch, count)
  assert hot.total > 0
  step = _step(tower, plan, hot, capacity)
  params = {"tower": tower_params, "tables": hot_rows.shard(plan, hot, tables)}
  losses = []
  for _ in range(20):
    params, value, overflow = step(params, batch)
    losses.append(float(value))
    assert int(overflow) == 0
  np.testing.assert_allclose(losses, expected, rtol=2e-6, atol=2e-6)
  _assert_tables_whole(plan, hot, params["tables"], trained["tables"])


def _assert_tables_whole(plan, hot, placed_tables, trained_tables):
  """Every device's copy of the hot bank is the same, and the placed tables, whole again, are
  the replicated run's ``trained_tables``."""
  laid_out = jax.device_get(placed_tables)
  copies = laid_out["hot"].reshape(DEVICES, hot.total, WIDTH)
  np.testing.assert_array_equal(copies, np.broadcast_to(copies[0], copies.shape))
  for got, want in zip(hot_rows.unshard(plan, hot, laid_out), trained_tables):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _workload(plan_rows, batch, tower_params):
  """The problem's workload, its access probabilities from its batch."""
  return embedding_planner.Workload(
      plan_rows, WIDTH, HOTNESS, BATCH // DEVICES,
      tuple(embedding_planner.probabilities_from_sample(ids, r)
            for ids, r in zip(batch["sparse"], plan_rows)),
      sum(x.size for x in jax.tree.leaves(tower_params)))


@pytest.mark.parametrize("placement,hot", [
    (MIXED, 6),
    # about 25 s each on 2 cores
    pytest.param("row", 20, marks=pytest.mark.slow),
    *(pytest.param(p, 0, marks=pytest.mark.slow) for p in ("row", "table", "column")),
    pytest.param("table", 5, marks=pytest.mark.slow)])
def test_the_planner_predicts_the_compiled_programs_bytes_per_collective(problem, placement,
                                                                         hot):
  """The exchange's all-to-alls and all-gathers (forward and backward), and the all-reduces
  (the hot rows' and the dense part's, the tower and any replicated table), within 5% of the
  compiled step's."""
  tower, batch, tower_params, tables = problem
  choice = embedding_planner.choose(_workload(ROWS, batch, tower_params),
                                    topology.Topology.flat(DEVICES, topology.CLOUD_10G), 0, 0.01,
                                    (placement,) * 5 if isinstance(placement, str) else placement,
                                    (hot,) * 5)
  assert choice.hot.total == sum(min(hot, r) for t, r in enumerate(ROWS)
                                 if t in choice.plan.fetched)
  params = {"tower": tower_params, "tables": hot_rows.shard(choice.plan, choice.hot, tables)}
  sent = hlo_bytes.wire_bytes(_step(tower, choice.plan, choice.hot, choice.capacity), params,
                              batch).by_kind
  predicted = choice.prediction.bytes
  exchanged = sum(sent.get(k, 0) for k in ("all-to-all", "all-gather", "reduce-scatter"))
  assert exchanged == pytest.approx(
      predicted["embedding_forward"] + predicted["embedding_backward"], rel=0.05)
  all_reduced = predicted["hot_rows_all_reduce"] + predicted["dense_all_reduce"]
  assert sent["all-reduce"] == pytest.approx(all_reduced, rel=0.05)  # and the step's 2 scalars
  if hot:  # a prediction without the hot rows' all-reduce would be off by more than 5%
    assert predicted["hot_rows_all_reduce"] > 0.1 * all_reduced


@pytest.mark.parametrize("forward,backward", [
    ("int8", "int4"),
    pytest.param("bf16", "topk", marks=pytest.mark.slow)])  # about 20 s on 2 cores
def test_the_planner_prices_the_rows_as_their_codecs_encode_them(problem, forward, backward):
  """Hot rows and compressed all-to-alls together: the planner's exchange bytes, the codecs'
  payloads included, within 5% of the compiled step's."""
  tower, batch, tower_params, tables = problem
  codecs = embedding_codecs.codecs(forward, backward, error_feedback=False)
  workload = dataclasses.replace(
      _workload(ROWS, batch, tower_params),
      payload_bytes=functools.partial(embedding_codecs.payload_bytes, codecs))
  choice = embedding_planner.choose(workload, topology.Topology.flat(DEVICES, topology.CLOUD_10G),
                                    0, 0.01, ("row",) * 5, (4,) * 5)
  assert choice.hot.total > 0
  params = {"tower": tower_params, "tables": hot_rows.shard(choice.plan, choice.hot, tables)}
  step = _step(tower, choice.plan, choice.hot, choice.capacity,
               embedding_codecs.rows_exchange(codecs, None, "data"))
  sent = hlo_bytes.wire_bytes(step, params, batch).by_kind
  predicted = choice.prediction.bytes
  dense = embeddings.exchange_bytes(choice.plan, BATCH // DEVICES, HOTNESS, choice.capacity)
  exchanged = predicted["embedding_forward"] + predicted["embedding_backward"]
  assert exchanged < 0.6 * (dense["forward"] + dense["backward"])  # the codecs are priced
  assert sent["all-to-all"] == pytest.approx(exchanged, rel=0.05)


SYNTHETIC_ROWS = dlrm.capped(dlrm.MLPERF_DCNV2_ROWS, 2000)
SYNTHETIC_HOTNESS = tuple(min(h, 4) for h in dlrm.MLPERF_DCNV2_HOTNESS)
BUDGET = 2**18  # bytes of a device for the tables: the row placement takes 139,776


def _synthetic_choices():
  """Row-placed tables without and with the planner's hot rows, on the synthetic logs."""
  generator = criteo.Generator(SYNTHETIC_ROWS, SYNTHETIC_HOTNESS, seed=0)
  workload = embedding_planner.Workload(
      SYNTHETIC_ROWS, 8, SYNTHETIC_HOTNESS, 64,
      tuple(generator.probabilities(t) for t in range(len(SYNTHETIC_ROWS))))
  link = topology.Topology.flat(DEVICES, topology.CLOUD_10G)
  plain = embedding_planner.choose(workload, link, BUDGET, 0.05, ("row",) * 26, (0,) * 26)
  hot = embedding_planner.choose(workload, link, BUDGET, 0.05, ("row",) * 26)
  return generator, plain, hot


def test_the_planners_hot_rows_cut_the_all_to_all_bytes_by_80_percent_on_the_synthetic_skew():
  """configs/dlrm.py's tables and batch (64 rows a device, 8 devices), the synthetic logs' law,
  a budget of 256 KiB a device, 10 Gbit/s, 50 ms of compute: the planner's hot rows (on
  row-placed tables) send 85% fewer all-to-all bytes per step than row-wise sharding alone,
  both with the capacity from the skew, within the same budget (the predicted bytes are the
  compiled program's: the test above, and the next one on these tables)."""
  _, plain, hot = _synthetic_choices()
  exchanged = lambda c: (c.prediction.bytes["embedding_forward"]
                         + c.prediction.bytes["embedding_backward"])
  assert 1 - exchanged(hot) / exchanged(plain) >= 0.8
  assert plain.prediction.memory == 139_776 < hot.prediction.memory <= BUDGET
  assert hot.prediction.step <= plain.prediction.step
  assert "hot rows: " in hot.report() and "embedding_forward" in hot.report()


@pytest.mark.parametrize("placement", ["table", "row"])
def test_the_capacity_from_the_skew_holds_every_owners_bucket_of_sampled_batches(placement):
  """The planner's capacity is sized for the busiest owner, not the mean over owners: with whole
  tables on one owner (table placement) some owners get far more keys than others, and 40
  sampled steps of the synthetic logs on 8 devices (320 buckets per owner) fit it, where a
  capacity from the mean over owners (the same margin) would overflow."""
  generator = criteo.Generator(SYNTHETIC_ROWS, SYNTHETIC_HOTNESS, seed=0)
  workload = embedding_planner.Workload(
      SYNTHETIC_ROWS, 8, SYNTHETIC_HOTNESS, 64,
      tuple(generator.probabilities(t) for t in range(len(SYNTHETIC_ROWS))))
  choice = embedding_planner.choose(workload, topology.Topology.flat(DEVICES, topology.CLOUD_10G),
                                    0, 0.05, (placement,) * 26, (0,) * 26)
  p, ids = choice.plan, generator.sample(40 * DEVICES * 64, seed=1)["sparse"]
  tables = np.split(ids, np.cumsum(SYNTHETIC_HOTNESS)[:-1], axis=1)
  busiest = 0
  for rows in np.split(np.arange(len(ids)), 40 * DEVICES):  # a device's batch of one step
    keys = np.unique(np.concatenate([
        (lambda owner, local: owner * p.bank_rows + local)(
            *embeddings.bank_address(p, t, tables[t][rows].reshape(-1))) for t in p.fetched]))
    busiest = max(busiest, np.bincount(keys // p.bank_rows, minlength=DEVICES).max())
  assert busiest <= choice.capacity
  if placement == "table":
    mean = sum(workload.presence[t].sum() for t in p.fetched) / DEVICES
    assert busiest > embeddings.capacity_from_skew(mean, 1, embedding_planner.MARGIN)


def test_the_budget_holds_the_exchanges_memories():
  """The rows' error-feedback residual (a whole bank a device) and the hot exchange's state
  (top-k's residual: as large as the hot bank) count in the budget: a budget the residual
  exceeds is refused in one line naming it, and the hot rows chosen with top-k's state fit the
  budget with it, half as many as a dense exchange's (which keeps no per-row memory)."""
  from experiments import methods  # pylint: disable=import-outside-toplevel
  generator = criteo.Generator(SYNTHETIC_ROWS, SYNTHETIC_HOTNESS, seed=0)
  probabilities = tuple(generator.probabilities(t) for t in range(len(SYNTHETIC_ROWS)))
  link = topology.Topology.flat(DEVICES, topology.CLOUD_10G)
  config = __import__("configs.dlrm", fromlist=["get_config"]).get_config("smoke")
  config.update_from_flattened_dict({"embedding.hot_rows": "auto"})

  def workload(codecs, hot_exchange):
    config.embedding.hot_exchange = hot_exchange
    tx, cost = methods.hot_exchange(config)
    return table_planning.workload(SYNTHETIC_ROWS, 8, SYNTHETIC_HOTNESS, 64, probabilities, 0,
                                   codecs, cost, table_planning.state_bytes(tx))
  plain = embedding_codecs.codecs()
  residual = workload(embedding_codecs.codecs("dense", "int4", True), "dense")
  with pytest.raises(ValueError, match=r"^the embedding tables need 1,257,984 bytes of one device as "
                                       r"placed \(1,118,208 of them the residual\); allowed: at "
                                       r"most the budget of 262,144$") as error:
    embedding_planner.choose(residual, link, BUDGET, 0.05, ("row",) * 26, (0,) * 26)
  assert "\n" not in str(error.value)
  dense = embedding_planner.choose(workload(plain, "dense"), link, BUDGET, 0.05, ("row",) * 26)
  topk = embedding_planner.choose(workload(plain, "topk"), link, BUDGET, 0.05, ("row",) * 26)
  assert topk.prediction.memory == (139_776 + 2 * 4 * 8 * topk.hot.total + 12) <= BUDGET
  assert dense.prediction.memory == 139_776 + 4 * 8 * dense.hot.total + 12 <= BUDGET
  assert topk.hot.total == (BUDGET - 139_776 - 12) // 64 < dense.hot.total


@pytest.mark.slow  # about 25 s on 2 cores: two lookups of 26 tables compiled, 20 run
def test_the_synthetic_tables_lookups_send_the_predicted_bytes_and_do_not_overflow():
  """The compiled lookups of the test above send the predicted forward bytes, and no key
  overflows the capacity from the skew over 10 sampled batches, with or without hot rows."""
  generator, plain, hot = _synthetic_choices()
  sampled = generator.sample(10 * DEVICES * 64, seed=1)["sparse"]
  for choice in (plain, hot):
    forward = _synthetic_lookup(choice)
    params = hot_rows.shard(choice.plan, choice.hot,
                            [np.zeros((r, 8), np.float32) for r in SYNTHETIC_ROWS])
    sent = hlo_bytes.wire_bytes(forward, params, sampled[:DEVICES * 64]).by_kind
    assert sent["all-to-all"] == pytest.approx(choice.prediction.bytes["embedding_forward"],
                                               rel=1e-9)
    for step in range(10):
      ids = sampled[step * DEVICES * 64:(step + 1) * DEVICES * 64]
      assert int(forward(params, ids)[1].sum()) == 0


def _synthetic_lookup(choice):
  """The lookup of a ``[devices * 64, 76]`` array of IDs: ``(bags, overflow per device)``."""
  mesh = Mesh(np.array(jax.devices()[:DEVICES]), ("data",))
  splits = np.cumsum(SYNTHETIC_HOTNESS)[:-1]

  def lookup(params, ids):
    bags, overflow = hot_rows.pooled_lookup(choice.plan, choice.hot, params,
                                            jnp.split(ids, splits, axis=1), "data",
                                            choice.capacity)
    return bags, overflow[None]
  return jax.jit(jax.shard_map(
      lookup, mesh=mesh, in_specs=(hot_rows.specs(choice.plan, "data"), P("data")),
      out_specs=(P("data"), P("data"))))


def test_auto_placement_is_no_slower_than_row_placement():
  generator = criteo.Generator(SYNTHETIC_ROWS, SYNTHETIC_HOTNESS, seed=0)
  workload = embedding_planner.Workload(
      SYNTHETIC_ROWS, 8, SYNTHETIC_HOTNESS, 64,
      tuple(generator.probabilities(t) for t in range(len(SYNTHETIC_ROWS))), dense_params=2000)
  link = topology.Topology.flat(DEVICES, topology.ETHERNET_1G)
  row = embedding_planner.choose(workload, link, BUDGET, 0.001, ("row",) * 26, (0,) * 26)
  auto = embedding_planner.choose(workload, link, BUDGET, 0.001)
  assert auto.prediction.step < row.prediction.step
  assert auto.prediction.memory <= BUDGET
  with pytest.raises(ValueError, match="fit no placement within the budget of 1,000 bytes"):
    embedding_planner.choose(workload, link, 1000, 0.001)


def test_probabilities_from_a_sample_keep_the_unseen_rows_possible():
  p = embedding_planner.probabilities_from_sample(np.array([0, 0, 1, 2]), 5)
  # Two IDs of four seen once: half the mass goes to the two unseen IDs.
  np.testing.assert_allclose(p, [0.25, 0.125, 0.125, 0.25, 0.25])


@pytest.mark.parametrize("field,value,message", [
    ("hot_rows", "abc", r"^config.embedding.hot_rows='abc' is not allowed; allowed: 'auto'"),
    ("hot_rows", "1.5", r"^config.embedding.hot_rows='1.5' is not allowed"),
    ("hot_rows", "-3", r"^config.embedding.hot_rows='-3' is not allowed"),
    ("capacity", -2, r"^config.embedding.capacity=-2 is not allowed; allowed: -1 \(from the "),
    ("budget_bytes", -1, r"^config.embedding.budget_bytes=-1 is not allowed; allowed: bytes"),
    ("link_gbit", 0.0, r"^config.embedding.link_gbit=0.0 is not allowed; allowed: a number > 0"),
    ("compute_seconds", -1.0, r"^config.embedding.compute_seconds=-1.0 is not allowed"),
    ("overrides", "3:row", r"^config.embedding.overrides='3:row' with placement='auto' is not "),
])
def test_bad_planner_settings_are_refused_in_one_line(field, value, message):
  block = ml_collections.ConfigDict(dict(
      placement="auto", overrides="", hot_rows="auto", capacity=-1, budget_bytes=0,
      link_gbit=10.0, compute_seconds=0.05))
  table_planning.check(block)
  block[field] = value
  with pytest.raises(ValueError, match=message) as error:
    table_planning.check(block)
  assert "\n" not in str(error.value)
  assert table_planning.hot_setting("0.01") == 0.01 and table_planning.hot_setting("64") == 64


@pytest.mark.parametrize("ids,message", [
    ([[], [], [1], [], []], r"^embedding.hot_rows: table 2 \(placement 'column', row_reduction "
                            r"'all_to_all'\) has 1 hot rows; allowed: hot rows of row- or"),
    ([[37], [], [], [], []], r"^embedding.hot_rows: table 0: ID 37 is not allowed; allowed: "
                             r"0 \.\. 36"),
    ([[3, 3], [], [], [], []], r"^embedding.hot_rows: table 0 names an ID twice"),
    ([[1]], r"^embedding.hot_rows names 1 tables for 5"),
])
def test_bad_hot_rows_are_refused_in_one_line(ids, message):
  plan = embeddings.plan(ROWS, WIDTH, MIXED, DEVICES)
  with pytest.raises(ValueError, match=message):
    hot_rows.hot_rows(plan, ids)
  with pytest.raises(ValueError, match="table 0 .placement 'row', row_reduction "
                                       "'reduce_scatter'. has 1 hot rows"):
    hot_rows.hot_rows(embeddings.plan(ROWS, WIDTH, "row", DEVICES, "reduce_scatter"),
                      [[1], [], [], [], []])


@pytest.mark.slow  # about 60 s each on 2 cores: the planner, the step, its bytes, the evaluation
@pytest.mark.parametrize("hot_exchange", ["dense", "topk", "int8"])
def test_the_runner_plans_the_tables_and_reports_the_hot_row_all_reduce(tmp_path, hot_exchange):
  """``placement=auto, hot_rows=auto, capacity=-1`` through the runner (configs/dlrm.py:smoke),
  the hot rows' gradient exchanged by ``hot_exchange``: results.json's ``bytes_by_collective``,
  read from the compiled programs, is the planner's prediction within 5% per collective; a
  compressing method sends a fraction of the float32 all-reduce's bytes."""
  from experiments import train  # pylint: disable=import-outside-toplevel
  config = __import__("configs.dlrm", fromlist=["get_config"]).get_config("smoke")
  config.data.cache_dir = str(tmp_path / "cache")
  config.update_from_flattened_dict({"embedding.placement": "auto", "embedding.hot_rows": "auto",
                                     "embedding.capacity": -1,
                                     "embedding.hot_exchange": hot_exchange})
  results = train.train_and_evaluate(config, str(tmp_path / "run"))
  sent, predicted = results["bytes_by_collective"], results["embedding_planner"]["bytes"]
  psum = 2 * 7 / 8 * 4 * config.model.embedding_dim * results["embedding_planner"]["hot_rows"]
  if hot_exchange == "dense":  # the lookup's psum's bytes
    assert sent["hot_rows_all_reduce"] == pytest.approx(psum, rel=1e-3)
  else:
    assert 0 < sent["hot_rows_all_reduce"] < 0.3 * psum
  for ours, theirs in (("embedding_forward", "embedding_forward"),
                       ("embedding_backward", "embedding_backward"),
                       ("hot_rows_all_reduce", "hot_rows_all_reduce"),
                       ("dense_exchange", "dense_all_reduce")):
    assert sent[ours] == pytest.approx(predicted[theirs], rel=0.05)


def test_hot_rows_where_no_table_is_fetched_are_refused_in_one_line(tmp_path):
  from experiments import train  # pylint: disable=import-outside-toplevel
  config = __import__("configs.dlrm", fromlist=["get_config"]).get_config("smoke")
  config.data.update(dict(max_rows=50, num_train=512, num_eval=256, cache_dir=str(tmp_path)))
  config.update_from_flattened_dict({"embedding.placement": "column",
                                     "embedding.hot_rows": "8"})
  with pytest.raises(ValueError, match=r"^config.embedding.hot_rows='8' but no table is row- or "
                                       r"table-placed .* allowed: hot_rows '0' there$"):
    train.train_and_evaluate(config, str(tmp_path / "run"))


def _exchanged_step(problem, plan, hot, exchange, capacity=None):
  """The runner's composition on the problem: the hot bank's gradient each device's own
  (``all_reduce=False``) and exchanged by ``exchange`` in the sharded leaves' optimizer (SGD,
  :func:`hot_rows.with_exchange`), the tower by a dense chain: ``(data_parallel, params)``."""
  tower, batch, tower_params, tables = problem
  mesh = Mesh(np.array(jax.devices()[:DEVICES]), ("data",))

  def loss(params, batch):
    pooled, overflow = hot_rows.pooled_lookup(plan, hot, params["tables"], batch["sparse"],
                                              "data", capacity, all_reduce=False)
    logits = tower.apply({"params": params["tower"]}, batch["dense"], pooled)
    return dlrm_problem.bce(logits, batch["label"]), overflow
  params = {"tower": tower_params, "tables": hot_rows.shard(plan, hot, tables)}
  specs = {"tower": jax.tree.map(lambda _: P(), tower_params),
           "tables": hot_rows.specs(plan, "data")}
  tx = optax.chain(compressors.compress(compressors.dense(), axis_name="data"),
                   optax.sgd(LEARNING_RATE))
  sharded = sharded_params.ShardedParams(
      specs, hot_rows.with_exchange(optax.sgd(LEARNING_RATE), exchange, DEVICES))
  dp = compressors.data_parallel(loss, tx, mesh, params, batch, has_aux=True, sharded=sharded)
  return dp, jax.device_put(params, jax.tree.map(lambda s: jax.NamedSharding(mesh, s),
                                                 dp.params_spec))


def test_the_hot_rows_exchanged_by_the_dense_method_give_the_replicated_trajectory(problem,
                                                                                   replicated):
  """The hot bank's gradient exchanged by the registered ``dense`` method in the step (not the
  lookup's ``psum``): the losses and the trained tables of the tables whole, every device's
  copy of the hot bank the same."""
  expected, trained = replicated
  plan = embeddings.plan(ROWS, WIDTH, MIXED, DEVICES)
  hot = _hot(plan, problem[1], 5)
  dp, params = _exchanged_step(problem, plan, hot,
                               registry.transformation("dense", axis_name="data"))
  state, losses = dp.init(params), []
  for _ in range(20):
    params, state, metrics = dp.step(params, state, problem[1])
    losses.append(float(metrics["loss"]))
  np.testing.assert_allclose(losses, expected, rtol=2e-6, atol=2e-6)
  _assert_tables_whole(plan, hot, params["tables"], trained["tables"])


def test_error_feedback_of_the_hot_rows_exchange_loses_nothing():
  """Top-k on the hot bank's gradient, as the sharded step hands it over (each device's own,
  divided by the worker count): at each of 3 steps, what each worker sent is exactly the ``k``
  largest entries of its gradient plus its residual, the residual exactly the rest, and the
  update the mean of what was sent (float32's rounding of a sum of 8)."""
  shape, density = (40, WIDTH), 0.1
  k = round(density * shape[0] * shape[1])
  exchange = registry.transformation("topk", registry.default_settings("topk").__class__(
      density=density), axis_name="data")
  tx = hot_rows.with_exchange(optax.identity(), exchange, DEVICES)
  params = {"tables": {"hot": jnp.zeros(shape, jnp.float32)}}
  state, update = harness.shard_map_update(tx, harness.mesh(DEVICES), params)
  residual = np.zeros((DEVICES, shape[0] * shape[1]), np.float32)
  for t in range(3):
    gradient = (np.asarray(jax.random.normal(jax.random.PRNGKey(t), (DEVICES, *shape)))
                * np.exp(np.arange(shape[0]) / 10)[:, None]).astype(np.float32)
    mean, state = update(params, state, {"tables": {"hot": gradient / DEVICES}})
    compensated = gradient.reshape(DEVICES, -1) + residual  # float32, as the step adds them
    sent = harness.topk_reference(compensated, k)
    (residual,) = [np.asarray(s.residual["tables"]["hot"]).reshape(DEVICES, -1)
                   for s in jax.tree.leaves(state, is_leaf=lambda x: isinstance(
                       x, compressors.CompressState)) if isinstance(s, compressors.CompressState)]
    np.testing.assert_array_equal(residual, compensated - sent)
    assert np.count_nonzero(residual) > 0.5 * residual.size  # top-k did leave something
    np.testing.assert_allclose(np.asarray(mean["tables"]["hot"]).reshape(-1), sent.mean(0),
                               rtol=0, atol=8 * np.finfo(np.float32).eps * np.abs(sent).max())


@pytest.mark.parametrize("method,settings", [
    ("topk", {"density": 0.25}),
    pytest.param("int8", {}, marks=pytest.mark.slow),  # about 20 s each on 2 cores
    pytest.param("dense", {}, marks=pytest.mark.slow)])
def test_the_planner_prices_the_hot_rows_exchange_as_its_method_sends_it(problem, method,
                                                                         settings):
  """The hot bank's gradient exchanged by a registered method in the step: the compiled step's
  bytes of that exchange within 5% of the planner's prediction, which prices the method
  (:func:`compressors.registry.cost`), not the ``psum``."""
  tower, batch, tower_params, tables = problem
  own = dataclasses.replace(registry.default_settings(method), **settings)
  workload = dataclasses.replace(
      _workload(ROWS, batch, tower_params),
      hot_exchange=lambda shape, topo: registry.cost(method, [shape], topo, own))
  choice = embedding_planner.choose(workload, topology.Topology.flat(DEVICES, topology.CLOUD_10G),
                                    0, 0.01, ("row",) * 5, (40,) * 5)
  dp, params = _exchanged_step(problem, choice.plan, choice.hot,
                               registry.transformation(method, own, axis_name="data"),
                               choice.capacity)
  sent = dp.wire_bytes(params, dp.init(params), batch)
  predicted = choice.prediction.bytes
  psum = choice.hot.all_reduce_bytes(choice.plan)
  # The exchange's and the tower's predictions are the compiled program's (the tests above): the
  # rest of the step's bytes is the hot rows' exchange (with the step's 2 scalars).
  others = sum(predicted[k] for k in ("embedding_forward", "embedding_backward",
                                      "dense_all_reduce"))
  assert sent.total - others == pytest.approx(predicted["hot_rows_all_reduce"], rel=0.05)
  assert (predicted["hot_rows_all_reduce"] == psum) == (method == "dense")


@pytest.mark.parametrize("fields,message", [
    ({"embedding.hot_exchange": "zip"}, r"^config.embedding.hot_exchange='zip' is not allowed; "
                                        r"allowed: 'same' or a per-step method without per-step "
                                        r"inputs: \['dense', 'fp16', 'bf16', 'int8'"),
    ({"embedding.hot_exchange": "tasc"}, r"^config.embedding.hot_exchange='tasc' is not allowed"),
    ({"embedding.hot_exchange": "same", "method": "diloco"},
     r"^config.embedding.hot_exchange='same' \(config.method='diloco'\) is not allowed"),
    ({"embedding.hot_exchange": "topk", "embedding.hot_rows": "0"},
     r"^config.embedding.hot_exchange='topk' with hot_rows='0' is not allowed: there is no hot "
     r"bank to exchange; allowed: 'dense' there$"),
    ({"embedding.hot_exchange": "topk", "compression.topk.density": 2.0},
     r"^config.compression.topk.density=2.0")])
def test_a_bad_hot_exchange_is_refused_in_one_line(fields, message):
  from experiments import methods  # pylint: disable=import-outside-toplevel
  config = __import__("configs.dlrm", fromlist=["get_config"]).get_config("smoke")
  config.update_from_flattened_dict({"embedding.hot_rows": "auto", **fields})
  with pytest.raises(ValueError, match=message) as error:
    methods.hot_exchange(config)
  assert "\n" not in str(error.value)
  config.update_from_flattened_dict({"embedding.hot_exchange": "same", "method": "int8",
                                     "embedding.hot_rows": "auto",
                                     "compression.topk.density": 0.01})
  _, cost = methods.hot_exchange(config)  # the run's own method, priced by its cost model
  flat = topology.Topology.flat(DEVICES, topology.CLOUD_10G)
  assert cost((100, 8), flat).bytes_sent == registry.cost("int8", [(100, 8)], flat).bytes_sent


@pytest.mark.slow  # about 60 s on 2 cores: two runs, the second resumed
def test_top_k_on_the_hot_rows_through_the_runner_and_a_resumed_run(tmp_path):
  """The hot rows' gradient exchanged by top-k with error feedback: its residual is the hot
  bank's optimizer state, checkpointed (a run resumed at step 3 ends bit for bit as the whole
  run), and the run learns."""
  from experiments import train  # pylint: disable=import-outside-toplevel
  config = __import__("configs.dlrm", fromlist=["get_config"]).get_config("smoke")
  config.data.update(dict(max_rows=50, num_train=512, num_eval=256,
                          cache_dir=str(tmp_path / "cache")))
  config.update_from_flattened_dict({
      "batch_size": 64, "eval_batch_size": 256, "num_steps": 6, "checkpoint_every": 3,
      "embedding.placement": "row", "embedding.hot_rows": "4", "embedding.hot_exchange": "topk",
      "compression.topk.density": 0.1})
  whole = train.train_and_evaluate(config, str(tmp_path / "run"))
  assert 0 < whole["bytes_by_collective"]["hot_rows_all_reduce"]
  shutil.rmtree(tmp_path / "run" / "checkpoints" / "6")
  resumed = train.train_and_evaluate(config, str(tmp_path / "run"))
  assert resumed["auc"] == whole["auc"] and resumed["test_loss"] == whole["test_loss"]
  with open(tmp_path / "run" / "metrics.jsonl") as f:
    losses = [row["loss"] for row in map(json.loads, f) if "loss" in row]
  assert losses[-1] < losses[0]
