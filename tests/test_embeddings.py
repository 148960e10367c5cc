"""Embedding tables placed across devices (compressors/parallel/embeddings.py) under DLRM's tower
(experiments/models/dlrm.py): sharding moves rows, not the math."""

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

from compressors.parallel import embeddings
from compressors.parallel import hlo_bytes
from experiments import models
from experiments.data import criteo
from experiments.models import dlrm
from tests import dlrm_problem
from tests.dlrm_problem import BATCH, DEVICES, HOTNESS, LEARNING_RATE, MIXED, ROWS, WIDTH
import optimizers

pytestmark = pytest.mark.usefixtures("fast_compiles")


@pytest.fixture(scope="module")
def problem():
  return dlrm_problem.problem()


@pytest.fixture(scope="module")
def replicated():
  """The replicated tables' 20 losses and trained parameters."""
  return dlrm_problem.replicated_trajectory(20)


def _sharded_step(tower, plan, capacity=None):
  """The data-parallel SGD step with the tables placed by ``plan``: ``(params, batch) ->
  (params, mean loss, overflow)``."""
  mesh = Mesh(np.array(jax.devices()[:DEVICES]), ("data",))

  def body(params, batch):
    def loss(params):
      pooled, overflow = embeddings.pooled_lookup(plan, params["tables"], batch["sparse"], "data",
                                                  capacity)
      logits = tower.apply({"params": params["tower"]}, batch["dense"], pooled)
      return dlrm_problem.bce(logits, batch["label"]), overflow
    (value, overflow), grads = jax.value_and_grad(loss, has_aux=True)(params)
    # Every gradient arrives summed over the devices' losses (the replicated parameters' by
    # shard_map's autodiff, the sharded rows' by the all-to-all's transpose): their mean.
    params = jax.tree.map(lambda p, g: p - LEARNING_RATE * g / DEVICES, params, grads)
    return params, jax.lax.pmean(value, "data"), jax.lax.psum(overflow, "data")
  specs = {"tower": P(), "tables": embeddings.specs(plan, "data")}
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs, P("data")),
                               out_specs=(specs, P(), P())))




# Each placement alone over the all-to-all is slow: tests/test_sharded_params.py passes each
# through the training step in the default suite.
@pytest.mark.parametrize("placement,row_reduction", [
    *(pytest.param(p, "all_to_all", marks=pytest.mark.slow) for p in embeddings.PLACEMENTS),
    ("row", "reduce_scatter"), (MIXED, "all_to_all"), (MIXED, "reduce_scatter")])
def test_each_placement_gives_the_replicated_trajectory_over_20_steps(problem, replicated,
                                                                     placement, row_reduction):
  tower, batch, tower_params, tables = problem
  expected, trained = replicated
  plan = embeddings.plan(ROWS, WIDTH, placement, DEVICES, row_reduction)
  step = _sharded_step(tower, plan)
  params = {"tower": tower_params, "tables": embeddings.shard(plan, tables)}
  losses = []
  for _ in range(20):
    params, value, overflow = step(params, batch)
    losses.append(float(value))
    assert int(overflow) == 0
  assert expected[-1] < expected[0] - 0.05  # it learns: the comparison is not of constants
  np.testing.assert_allclose(losses, expected, rtol=2e-6, atol=2e-6)
  for got, want in zip(embeddings.unshard(plan, jax.device_get(params["tables"])),
                       trained["tables"]):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_the_layout_round_trips_with_padding_and_balances_whole_tables():
  plan = embeddings.plan(ROWS, WIDTH, MIXED, DEVICES)
  assert plan.column_width == 1 and plan.column_rows == 100
  assert plan.owners[4] != plan.owners[1]  # the two whole tables on different devices
  assert plan.bank_rows == 5 + 64  # ceil(37 / 8) shared rows, then the largest whole table
  tables = [np.random.default_rng(t).normal(size=(r, WIDTH)).astype(np.float32)
            for t, r in enumerate(ROWS)]
  laid_out = embeddings.shard(plan, tables)
  assert laid_out["bank"].shape == (DEVICES * 69, WIDTH)
  assert laid_out["column_bank"].shape == (100, DEVICES)
  for got, want in zip(embeddings.unshard(plan, laid_out), tables):
    np.testing.assert_array_equal(got, want)
  # Row 9 of the row-placed table: device 9 mod 8 = 1, local row 9 div 8 = 1.
  np.testing.assert_array_equal(laid_out["bank"][1 * 69 + 1], tables[0][9])
  assert plan.bytes_per_device() == 4 * (11 * WIDTH + 69 * WIDTH + 100 * 1)


def test_an_overflow_is_counted_and_refused_in_one_line(problem):
  tower, batch, tower_params, tables = problem
  plan = embeddings.plan(ROWS, WIDTH, "row", DEVICES)
  params = {"tower": tower_params, "tables": embeddings.shard(plan, tables)}
  _, _, overflow = _sharded_step(tower, plan, capacity=1)(params, batch)
  # Per device and owner, the distinct keys beyond the first, counted on the host.
  expected = 0
  for device in range(DEVICES):
    rows = slice(device * BATCH // DEVICES, (device + 1) * BATCH // DEVICES)
    keys = {(int(i) % DEVICES, t, int(i)) for t in range(len(ROWS))
            for i in batch["sparse"][t][rows].ravel()}
    per_owner = np.bincount([k[0] for k in keys], minlength=DEVICES)
    expected += int(np.maximum(per_owner - 1, 0).sum())
  assert int(overflow) == expected > 0
  with pytest.raises(ValueError, match=r"^the exchange: \d+ de-duplicated IDs did not fit") as e:
    embeddings.check_overflow(overflow)
  assert "\n" not in str(e.value)
  embeddings.check_overflow(jnp.zeros(()))


@pytest.mark.parametrize("bad,message", [(-1, "ID -1"), (100, "ID 100")])
def test_ids_outside_their_table_are_refused_in_one_line(bad, message):
  plan = embeddings.plan(ROWS, WIDTH, "row", DEVICES)
  sparse = [np.zeros((4, h), np.int32) for h in HOTNESS]
  embeddings.check_ids(plan, sparse)
  sparse[2][3, 1] = bad
  with pytest.raises(ValueError, match=rf"^table 2: {message} is not allowed; allowed: 0 \.\. 99"):
    embeddings.check_ids(plan, sparse)


@pytest.mark.parametrize("rows,width,placement,message", [
    (ROWS, WIDTH, "diagonal", r"embedding.placement='diagonal' \(table 0\) is not allowed"),
    (ROWS, WIDTH, ("row", "table"), "embedding.placement has 2 entries for 5 tables"),
    ((3, 0), WIDTH, "row", "table 1 has 0 rows"),
])
def test_a_bad_plan_is_refused_in_one_line(rows, width, placement, message):
  with pytest.raises(ValueError, match=message):
    embeddings.plan(rows, width, placement, DEVICES)
  with pytest.raises(ValueError, match="embedding.row_reduction='psum' is not allowed"):
    embeddings.plan(ROWS, WIDTH, "row", DEVICES, "psum")


@pytest.mark.parametrize("placement,row_reduction,capacity", [
    ("row", "all_to_all", None), ("table", "all_to_all", 3), ("column", "all_to_all", 5),
    (MIXED, "reduce_scatter", 4)])
def test_the_compiled_exchange_sends_the_predicted_bytes(problem, placement, row_reduction,
                                                         capacity):
  tower, batch, tower_params, tables = problem
  plan = embeddings.plan(ROWS, WIDTH, placement, DEVICES, row_reduction)
  params = {"tower": tower_params, "tables": embeddings.shard(plan, tables)}
  measured = hlo_bytes.wire_bytes(_sharded_step(tower, plan, capacity), params, batch)
  predicted = embeddings.exchange_bytes(plan, BATCH // DEVICES, HOTNESS, capacity)
  # The rest is the dense part's all-reduce and the step's two scalars.
  exchanged = sum(measured.by_kind.get(kind, 0)
                  for kind in ("all-to-all", "all-gather", "reduce-scatter"))
  assert exchanged == pytest.approx(predicted["forward"] + predicted["backward"], rel=1e-9)


def test_expected_unique_matches_sampling():
  rng = np.random.default_rng(1)
  probabilities = 1.0 / np.arange(1, 1001) ** 1.1
  probabilities /= probabilities.sum()
  counts = [np.unique(rng.choice(1000, size=300, p=probabilities)).size for _ in range(400)]
  assert embeddings.expected_unique(probabilities, 300) == pytest.approx(np.mean(counts), rel=0.02)
  assert embeddings.capacity_from_skew(100.0, 8) == 19


def test_the_model_registry_builds_dlrm_with_either_interaction():
  dense = jnp.ones((4, dlrm.NUM_DENSE))
  sparse = [jnp.zeros((4, 2), jnp.int32), jnp.ones((4, 1), jnp.int32)]
  for fields in ({"interaction": "dot"}, {"interaction": "dcn", "cross_rank": 3}):
    model = models.build_model({"name": "dlrm", "embedding_dim": 4, **fields},
                               cardinalities=(10, 3))
    variables = model.init(jax.random.PRNGKey(0), dense, sparse)
    assert variables["params"]["embedding_0"].shape == (10, 4)
    assert model.apply(variables, dense, sparse).shape == (4,)
  with pytest.raises(ValueError, match="config.model.interaction='cross' is not allowed"):
    models.build_model({"name": "dlrm", "interaction": "cross"}, cardinalities=(10, 3))


def test_the_cpu_tier_caps_the_real_shapes():
  assert len(dlrm.CRITEO_KAGGLE_ROWS) == len(dlrm.MLPERF_DCNV2_ROWS) == 26
  assert len(dlrm.MLPERF_DCNV2_HOTNESS) == 26 and sum(dlrm.MLPERF_DCNV2_HOTNESS) == 214
  assert dlrm.capped(dlrm.MLPERF_DCNV2_ROWS, 1000)[:6] == (1000, 1000, 1000, 1000, 1000, 3)


def test_a_capacity_from_the_skew_fits_the_synthetic_logs_at_a_thirtieth_of_the_bytes():
  """The smoke tier's click logs (26 tables of at most 2,000 rows, 64 rows a device, 4,096
  lookups): 696 distinct rows expected per device, a capacity of 131 keys per owner (against
  4,096 that nothing can overflow), and no overflow over 10 steps of sampled batches."""
  rows = dlrm.capped(dlrm.MLPERF_DCNV2_ROWS, 2000)
  hotness = tuple(min(h, 4) for h in dlrm.MLPERF_DCNV2_HOTNESS)
  generator = criteo.Generator(rows, hotness, seed=0)
  batch = 64
  unique = sum(embeddings.expected_unique(generator.probabilities(t), batch * h)
               for t, h in enumerate(hotness))
  capacity = embeddings.capacity_from_skew(unique, DEVICES)
  assert unique == pytest.approx(696.2, abs=0.1) and capacity == 131
  plan = embeddings.plan(rows, 4, "row", DEVICES)
  mesh = Mesh(np.array(jax.devices()[:DEVICES]), ("data",))
  splits = np.cumsum(hotness)[:-1]
  lookup = jax.jit(jax.shard_map(
      lambda params, ids: embeddings.pooled_lookup(
          plan, params, jnp.split(ids, splits, axis=1), "data", capacity)[1][None],
      mesh=mesh, in_specs=(embeddings.specs(plan, "data"), P("data")), out_specs=P("data")))
  params = embeddings.shard(plan, [np.zeros((r, 4), np.float32) for r in rows])
  sampled = generator.sample(10 * DEVICES * batch, seed=1)["sparse"]
  for step in range(10):
    ids = sampled[step * DEVICES * batch:(step + 1) * DEVICES * batch]
    assert int(lookup(params, ids).sum()) == 0
  full = embeddings.exchange_bytes(plan, batch, hotness)
  skewed = embeddings.exchange_bytes(plan, batch, hotness, capacity)
  assert full["forward"] / skewed["forward"] == pytest.approx(4096 / 131)


@pytest.mark.parametrize("placement", ["row", "table"])
def test_rowwise_adagrad_on_sharded_rows_gives_the_replicated_trajectory(problem, placement):
  """MLPerf's optimizer of the tables: each device updates the rows it holds, nothing moves."""
  tower, batch, tower_params, tables = problem
  tx = optimizers.rowwise_adagrad(0.1)

  def loss(tower_params, pooled):
    return dlrm_problem.bce(tower.apply({"params": tower_params}, batch["dense"], pooled), batch["label"])

  @jax.jit
  def replicated_step(tower_params, tables, state):
    value, (tower_grads, table_grads) = jax.value_and_grad(
        lambda p, t: loss(p, dlrm.pooled_lookup(t, batch["sparse"])), argnums=(0, 1))(
            tower_params, tables)
    updates, state = tx.update(table_grads, state)
    return (jax.tree.map(lambda p, g: p - LEARNING_RATE * g, tower_params, tower_grads),
            optax.apply_updates(tables, updates), state, value)

  plan = embeddings.plan(ROWS, WIDTH, placement, DEVICES)
  mesh = Mesh(np.array(jax.devices()[:DEVICES]), ("data",))

  def body(tower_params, bank, state, batch):
    def sharded_loss(tower_params, bank):
      laid_out = {"replicated": (), "bank": bank, "column_bank": jnp.zeros((0, DEVICES))}
      pooled, _ = embeddings.pooled_lookup(plan, laid_out, batch["sparse"], "data")
      return dlrm_problem.bce(tower.apply({"params": tower_params}, batch["dense"], pooled), batch["label"])
    value, (tower_grads, bank_grads) = jax.value_and_grad(sharded_loss, argnums=(0, 1))(
        tower_params, bank)
    updates, state = tx.update(bank_grads / DEVICES, state)
    return (jax.tree.map(lambda p, g: p - LEARNING_RATE * g / DEVICES, tower_params, tower_grads),
            bank + updates, state, jax.lax.pmean(value, "data"))
  state_spec = jax.tree.map(lambda _: P("data"), tx.init(jnp.zeros((DEVICES, WIDTH))))
  sharded_step = jax.jit(jax.shard_map(
      body, mesh=mesh, in_specs=(P(), P("data"), state_spec, P("data")),
      out_specs=(P(), P("data"), state_spec, P())))
  replicated = (tower_params, tables, tx.init(tables))
  bank = embeddings.shard(plan, tables)["bank"]
  sharded = (tower_params, bank, tx.init(jnp.asarray(bank)))
  for _ in range(20):
    *replicated, expected = replicated_step(*replicated)
    *sharded, got = sharded_step(*sharded, batch)
    np.testing.assert_allclose(float(got), float(expected), rtol=2e-6, atol=2e-6)
  assert float(expected) < 0.6  # it learned
  laid_out = {"replicated": (), "bank": sharded[1], "column_bank": np.zeros((0, DEVICES))}
  for got_table, want in zip(embeddings.unshard(plan, jax.device_get(laid_out)), replicated[1]):
    np.testing.assert_allclose(got_table, want, rtol=1e-5, atol=1e-6)


def test_a_table_over_the_memory_budget_is_refused_in_one_line_naming_it():
  tier = (100_000, 5000, 3000, 10)  # the largest: 100,000 x 16 x 4 = 6.4 MB
  budget = 4 * 2**20
  replicated = embeddings.plan(tier, 16, "replicated", DEVICES)
  with pytest.raises(ValueError, match=r"^table 0 \(100,000 rows, placement 'replicated'\) "
                                       r"needs 6,400,000 bytes of one device; allowed: at most "
                                       r"the budget of 4,194,304"):
    embeddings.check_budget(replicated, budget)
  by_rows = embeddings.plan(tier, 16, "row", DEVICES)
  embeddings.check_budget(by_rows, budget)  # the whole fits the machine, sharded
  assert by_rows.bytes_per_device() < budget < replicated.bytes_per_device()
  with pytest.raises(ValueError, match=r"^the embedding tables need [\d,]+ bytes of one device"):
    embeddings.check_budget(by_rows, by_rows.bytes_per_device() - 1)
  with pytest.raises(ValueError, match="cannot address them; allowed: fewer than 2\\*\\*31"):
    embeddings.plan((2**31,), 4, "row", DEVICES)


@pytest.mark.parametrize("placement,row_reduction", [("row", "all_to_all"),
                                                     (MIXED, "reduce_scatter")])
def test_simulated_workers_exchange_as_devices_do(problem, placement, row_reduction):
  """2 devices x 4 workers simulated on each (``jax.vmap`` over ``"worker"``, as the runner's
  ``workers_per_device``): the bags and the tables' gradient of 8 workers."""
  _, batch, _, tables = problem
  plan = embeddings.plan(ROWS, WIDTH, placement, DEVICES, row_reduction)
  laid_out = embeddings.shard(plan, tables)
  rng = np.random.default_rng(5)
  cotangent = rng.normal(size=(BATCH, len(ROWS), WIDTH)).astype(np.float32)
  expected, vjp = jax.vjp(lambda t: dlrm.pooled_lookup(t, batch["sparse"]), tables)
  (expected_grads,) = vjp(cotangent)
  workers, devices = DEVICES // 2, 2

  def worker(params, sparse, cotangent):
    pooled, vjp = jax.vjp(
        lambda p: embeddings.pooled_lookup(plan, p, sparse, ("data", "worker"))[0], params)
    return pooled, vjp(cotangent)[0]

  def body(params, sparse, cotangent):
    per_worker = {"replicated": tuple(jnp.broadcast_to(t, (workers,) + t.shape)
                                      for t in params["replicated"]),
                  "bank": params["bank"].reshape(workers, -1, WIDTH),
                  "column_bank": params["column_bank"].reshape(
                      plan.column_rows, workers, plan.column_width).transpose(1, 0, 2)}
    split = lambda x: x.reshape((workers, -1) + x.shape[1:])
    pooled, grads = jax.vmap(worker, axis_name="worker")(
        per_worker, [split(s) for s in sparse], split(cotangent))
    grads = {"replicated": tuple(jax.lax.psum(g.sum(0), "data") for g in grads["replicated"]),
             "bank": grads["bank"].reshape(-1, WIDTH),
             "column_bank": grads["column_bank"].transpose(1, 0, 2).reshape(
                 plan.column_rows, workers * plan.column_width)}
    return pooled.reshape((-1,) + pooled.shape[2:]), grads
  specs = embeddings.specs(plan, "data")
  mesh = Mesh(np.array(jax.devices()[:devices]), ("data",))
  run = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs, P("data"), P("data")),
                              out_specs=(P("data"), specs), check_vma=False))
  pooled, grads = run(laid_out, batch["sparse"], cotangent)
  np.testing.assert_allclose(np.asarray(pooled), np.asarray(expected), rtol=1e-5, atol=1e-6)
  got = embeddings.unshard(plan, jax.device_get(grads))
  for g, want in zip(got, expected_grads):
    np.testing.assert_allclose(g, np.asarray(want), rtol=1e-5, atol=1e-5)
