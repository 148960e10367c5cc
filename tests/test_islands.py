"""Islands: the model sharded over a fast axis inside each island (ZeRO-3), a method across the
slow axis between them (``compressors.data_parallel(..., shard_axis=)``,
:mod:`compressors.parallel.fsdp`). Each method's own checks on islands are in
``tests/method_checks.py`` (``check_islands_with_fsdp_inside``)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import compressors
from compressors import registry
from compressors import step_time
from compressors.network import topology as topo
from compressors.parallel import fsdp
from compressors.parallel import gather_on_use
from compressors.parallel import step_bytes
import optimizers
from optimizers import exclusions
from tests import harness

pytestmark = pytest.mark.usefixtures("fast_compiles")


@pytest.mark.parametrize("shape, shards, dim", [
    ((64, 256), 4, 1), ((256, 64), 4, 0), ((64, 64), 4, 0), ((3, 8), 4, 1), ((5,), 4, None),
    ((), 4, None), ((6, 10), 4, None), ((4,), 4, 0)])
def test_a_leaf_is_sharded_along_its_largest_divisible_dimension_else_padded_flat(
    shape, shards, dim):
  layout = fsdp.leaf_layout(shape, shards)
  assert layout.dim == dim
  x = jnp.arange(int(np.prod(shape)), dtype=jnp.float32).reshape(shape)
  stored = layout.to_stored(x)
  assert stored.shape == layout.stored_shape and stored.shape[dim or 0] % shards == 0
  np.testing.assert_array_equal(layout.to_natural(stored), x)
  # Rows (one per shard, as optimizer state is laid out) back to the natural leaf.
  rows = jnp.stack(jnp.split(stored, shards, axis=dim or 0))
  assert rows.shape[1:] == layout.shard_shape
  np.testing.assert_array_equal(layout.rows_to_natural(rows), x)


PARAMS = {"w1": jnp.zeros((32, 256)), "b1": jnp.zeros((256,)), "w2": jnp.zeros((256, 10)),
          "b2": jnp.zeros((10,)), "odd": jnp.zeros((5,))}


def _params():
  keys = jax.random.split(jax.random.PRNGKey(1), 2)
  return {**PARAMS, "w1": jax.random.normal(keys[0], (32, 256)) * 0.2,
          "w2": jax.random.normal(keys[1], (256, 10)) * 0.1}


def _loss(p, batch):
  x, y = batch
  hidden = jnp.tanh(x @ p["w1"] + p["b1"])
  return jnp.mean((hidden @ p["w2"] + p["b2"] + p["odd"].mean() - y) ** 2)


def _batch():
  keys = jax.random.split(jax.random.PRNGKey(2), 2)
  return jax.random.normal(keys[0], (64, 32)), jax.random.normal(keys[1], (64, 10))


def _dp(compressor, mesh, axis, shard_axis=None, batch=None):
  tx = optax.chain(compressors.compress(compressor, axis_name=axis), optax.adam(1e-2))
  return compressors.data_parallel(_loss, tx, mesh, PARAMS, _batch() if batch is None else batch,
                                   axis_name=axis, shard_axis=shard_axis)


def test_dense_across_islands_trains_as_plain_data_parallelism_with_a_fraction_of_the_state():
  runs = {}
  for mesh, axis, shard_axis in ((harness.mesh(), "data", None),
                                 (harness.islands_mesh(), "islands", "fsdp")):
    dp = _dp(compressors.dense(), mesh, axis, shard_axis)
    params, state = dp.worker_params(_params()), dp.init(_params())
    losses = []
    for _ in range(10):
      params, state, metrics = dp.step(params, state, _batch())
      losses.append(float(metrics["loss"]))
    natural = dp.model_params(compressors.TrainState(0, params, (), state))
    runs[axis] = losses, natural, fsdp.state_bytes_per_device((params, state))
  (plain_losses, plain, replicated), (losses, islands, held) = runs.values()
  np.testing.assert_allclose(losses, plain_losses, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(islands)):
    np.testing.assert_allclose(b, a, rtol=0, atol=1e-5)
  assert losses[-1] < 0.9 * losses[0]
  # Parameters and Adam's moments; the compressor's residual lives per shard too.
  assert held <= 0.30 * replicated, (held, replicated)


def test_topk_across_islands_sends_a_fiftieth_of_dense_on_the_slow_axis_and_the_same_on_the_fast():
  mesh = harness.islands_mesh()
  sent = {}
  for name, compressor in (("dense", compressors.dense()), ("topk", compressors.topk(0.01))):
    dp = _dp(compressor, mesh, "islands", "fsdp")
    params = dp.worker_params(PARAMS)
    sent[name] = dp.wire_bytes(params, dp.init(PARAMS), _batch()).by_axis
  model_bytes = sum(x.size * 4 for x in jax.tree.leaves(PARAMS))
  padded = model_bytes + 3 * 4  # the 5-vector padded to 8
  assert sent["dense"][("islands",)] >= 20 * sent["topk"][("islands",)], sent
  # ZeRO-3: an all-gather and a reduce-scatter of the (padded) model, and w2 gathered again in
  # the backward pass (the hidden layer's gradient reads it; no other leaf's backward reads a
  # parameter, so no other is gathered twice: compressors.parallel.gather_on_use).
  regathered = PARAMS["w2"].size * 4
  for name in sent:
    assert abs(sent[name][("fsdp",)] - 3 / 4 * (2 * padded + regathered)) <= 0.01 * model_bytes, (
        sent)


def test_the_islands_time_model_charges_the_fast_link_the_compiled_programs_gathers():
  """Given the compiled program's collectives, the fast link is charged what the program sends
  there (here the whole model gathered and reduce-scattered, and w2 gathered again in the
  backward pass), more than ZeRO-3's minimum the shapes alone give; the slow axis's price is
  the same either way."""
  dp = _dp(compressors.dense(), harness.islands_mesh(), "islands", "fsdp")
  params = dp.worker_params(PARAMS)
  sent = dp.wire_bytes(params, dp.init(PARAMS), _batch())
  islands = topo.Topology((topo.Axis("islands", 2, topo.ETHERNET_1G),
                           topo.Axis("fsdp", 4, topo.NVLINK4)))
  shapes = [x.shape for x in jax.tree.leaves(PARAMS)]
  [minimum] = step_time.island_kind_times("dense", shapes, islands, 0.1, overlap=False).values()
  [kind] = dp.kinds
  [compiled] = step_time.island_kind_times("dense", shapes, islands, 0.1, overlap=False,
                                           fast_collectives={kind: sent.collectives}).values()
  on_fast = [c for c in sent.collectives if c.axes == ("fsdp",)]
  assert {c.kind for c in on_fast} == {"all-gather", "reduce-scatter"}
  link = topo.NVLINK4
  # Each collective is a ring of 3 steps of a quarter of its bytes, the reduce-scatter's added.
  by_hand = sum(c.executions * 3 * (link.alpha + c.size_bytes / 4 * link.beta
                                    + (c.size_bytes / 4 * link.gamma
                                       if c.kind == "reduce-scatter" else 0.0))
                for c in on_fast)
  assert step_time.collectives_seconds(on_fast, link) == pytest.approx(by_hand)
  stored = sum(int(np.prod(fsdp.leaf_layout(shape, 4).stored_shape)) for shape in shapes)
  zero3 = topo.dense_cost("ring", topo.Topology.flat(4, link), stored).time
  across = compiled.communication - by_hand
  assert minimum.communication == pytest.approx(across + zero3)
  assert compiled.total == pytest.approx(0.1 + across + by_hand)
  assert by_hand > 1.2 * zero3, (by_hand, zero3)  # w2's second gather, and a gather per leaf (its latency)
  with pytest.raises(ValueError, match=r"fast_collectives has no step kind \['step'\]"):
    step_time.island_kind_times("dense", shapes, islands, 0.1, fast_collectives={})


def test_a_nan_on_one_shard_skips_the_step_on_every_device():
  x, y = _batch()
  bad = (x.at[3, 0].set(jnp.nan), y)  # one device's rows (8 per device)
  dp = _dp(compressors.dense(), harness.islands_mesh(), "islands", "fsdp", batch=bad)
  params, state = dp.worker_params(_params()), dp.init(_params())
  new, state, metrics = dp.step(params, state, bad)
  assert int(metrics["skipped_steps"]) == 1
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(new)):
    np.testing.assert_array_equal(a, b)


def test_diloco_across_islands_keeps_each_islands_shards_and_lands_on_one_model():
  settings = registry.default_settings("diloco", every=3)
  tx = registry.training("diloco", settings, optimizer=optax.adam(1e-2), learning_rate=1e-2,
                         axis_name="islands")
  dp = compressors.data_parallel(_loss, tx, harness.islands_mesh(), PARAMS, _batch(),
                                 axis_name="islands", shard_axis="fsdp",
                                 kinds=registry.step_kinds("diloco", settings),
                                 per_worker_params=True)
  params, state = dp.worker_params(_params()), dp.init(_params())
  # One row per island, each sharded over the fast axis.
  assert params["w1"].shape == (2, 32, 256)
  assert params["w1"].sharding.shard_shape(params["w1"].shape) == (1, 32, 64)
  for t in range(6):
    params, state, _ = dp.step(params, state, _batch(), kind=dp.kind_at(t))
    assert bool(dp.replicas_agree(params)) == dp.synchronises(dp.kind_at(t)), t
  model = dp.model_params(compressors.TrainState(0, params, (), state))
  # After a synchronisation the model is every island's parameters.
  island = dp.param_layout.to_natural(jax.tree.map(lambda x: x[1], params))
  for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(island)):
    np.testing.assert_array_equal(a, b)
  wire = {k: dp.wire_bytes(params, state, _batch(), kind=k).by_axis for k in dp.kinds}
  assert ("islands",) not in wire["local"] and wire["sync"][("islands",)] > 0, wire


@pytest.mark.slow
def test_lamb_inside_diloco_across_islands_is_two_workers_lamb():
  """LAMB as DiLoCo's inner optimizer on each island's shards (per-island parameters, a 3 x 5
  kernel and the 5-vector flattened and padded): its norms summed over the fast axis, the
  padding zeroed, the exclusions decided on the whole leaves, it lands where 2 workers of the
  whole model do (the same rows of the batch each)."""
  params = {**PARAMS, "m": jnp.zeros((3, 5))}
  start = {**_params(), "m": jax.random.normal(jax.random.PRNGKey(5), (3, 5))}

  def loss(p, batch):
    return _loss(p, batch) + jnp.mean(jnp.tanh(batch[0][:, :3] @ p["m"]) ** 2)

  settings = registry.default_settings("diloco", every=3)
  models = {}
  for mesh, axis in ((jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",)), "data"),
                     (harness.islands_mesh(), "islands")):
    layout = fsdp.ParamLayout.of(params, "fsdp", 4) if axis == "islands" else None
    inner = optimizers.lamb(0.05) if layout is None else layout.padding_zeroed(optimizers.lamb(
        0.05, shard_axis="fsdp", exclude=exclusions.excluded(optimizers.default_exclude, params)))
    tx = registry.training("diloco", settings, optimizer=inner, learning_rate=1e-2,
                           axis_name=axis)
    dp = compressors.data_parallel(loss, tx, mesh, params, _batch(), axis_name=axis,
                                   shard_axis=None if layout is None else "fsdp",
                                   kinds=registry.step_kinds("diloco", settings),
                                   per_worker_params=True)
    state, stepped = dp.worker_params(start), dp.init(start)
    for t in range(6):
      state, stepped, _ = dp.step(state, stepped, _batch(), kind=dp.kind_at(t))
    models[axis] = jax.tree.map(np.asarray, dp.model_params(
        compressors.TrainState(0, state, (), stepped)))
  for a, b, s in zip(*map(jax.tree.leaves, (models["data"], models["islands"], start))):
    np.testing.assert_allclose(b, a, rtol=0, atol=2e-5)
  assert max(np.abs(b - s).max() for b, s in zip(jax.tree.leaves(models["islands"]),
                                                  jax.tree.leaves(start))) > 0.05


def test_islands_refuse_what_they_cannot_run_naming_the_argument():
  mesh = harness.islands_mesh()
  tx = optax.chain(compressors.compress(compressors.dense(), axis_name="islands"),
                   optax.sgd(0.1))
  with pytest.raises(ValueError, match="shard_axis='fsdp' with axis_name=.*workers_per_device=2"):
    compressors.data_parallel(_loss, tx, mesh, PARAMS, _batch(), axis_name=("islands", "w"),
                              workers_per_device=2, shard_axis="fsdp")
  with pytest.raises(ValueError, match="shard_axis='islands'.*outside axis_name"):
    compressors.data_parallel(_loss, tx, mesh, PARAMS, _batch(), axis_name="islands",
                              shard_axis="islands")
  with pytest.raises(ValueError, match="shard_axis='fsdp' needs a mesh"):
    compressors.data_parallel(_loss, tx, None, PARAMS, _batch(), shard_axis="fsdp")


def test_the_islands_step_lowers_for_cuda_on_a_mesh_of_abstract_h100s(monkeypatch):
  """What a GPU process compiles: DiLoCo (int8) across 2 islands of 4 abstract H100s, its
  synchronising step traced and lowered for CUDA, with ZeRO-3's all-gather and reduce-scatter
  inside the islands and the exchange across them."""
  h100 = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132,
                                     platform="gpu")
  mesh = jax.sharding.AbstractMesh((2, 4), ("islands", "fsdp"),
                                   axis_types=(jax.sharding.AxisType.Auto,) * 2,
                                   abstract_device=h100)
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  settings = registry.default_settings("diloco", every=3, carrier="int8")
  tx = registry.training("diloco", settings, optimizer=optax.adam(1e-2), learning_rate=1e-2,
                         axis_name="islands")
  shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), PARAMS)
  batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), _batch())
  with jax.sharding.use_abstract_mesh(mesh):
    dp = compressors.data_parallel(_loss, tx, mesh, shapes, batch, axis_name="islands",
                                   shard_axis="fsdp", per_worker_params=True,
                                   kinds=registry.step_kinds("diloco", settings))
    params = step_bytes.abstract(jax.eval_shape(dp.worker_params, shapes), mesh,
                                 dp.params_spec)
    state = compressors.TrainState(
        step_bytes.abstract(jnp.zeros((), jnp.int32), mesh, P()), params, (),
        step_bytes.abstract(jax.eval_shape(dp.init, shapes), mesh, dp.specs))
    text = dp.train_step.trace(state, step_bytes.abstract(batch, mesh, dp.workers.spec),
                               kind="sync").lower(lowering_platforms=("cuda",)).as_text()
  for collective in ("all_gather", "reduce_scatter", "all_reduce"):
    assert f"stablehlo.{collective}" in text or f"\"stablehlo.{collective}\"" in text, collective
  assert "custom_call @xla_python" not in text and "host_callback" not in text


def _deep_loss(p, batch):
  x, y = batch
  for layer in p["layers"]:
    x = jnp.tanh(x @ layer["w"] + layer["b"])
  return jnp.mean((x - y) ** 2)


def _step_memory(depth: int, width: int = 256) -> dict[str, tuple[int, int]]:
  """``{axis: (peak bytes, temporary bytes)}`` of one device's step of ``depth`` layers,
  replicated (``"data"``) and on 2 islands x 4 (``"islands"``)."""
  params = {"layers": [{"w": jnp.zeros((width, width)), "b": jnp.zeros((width,))}] * depth}
  batch = (jnp.ones((64, width)), jnp.ones((64, width)))
  memory = {}
  for mesh, axis, shard_axis in ((harness.mesh(), "data", None),
                                 (harness.islands_mesh(), "islands", "fsdp")):
    tx = optax.chain(compressors.compress(compressors.dense(), axis_name=axis), optax.sgd(0.1))
    dp = compressors.data_parallel(_deep_loss, tx, mesh, params, batch, axis_name=axis,
                                   shard_axis=shard_axis)
    stored, state = dp.worker_params(params), dp.init(params)
    # pylint: disable-next=protected-access
    laid_out = step_bytes._laid_out(dp, stored, state, batch, ())
    temp = dp.train_step.lower(*laid_out).compile().memory_analysis().temp_size_in_bytes
    memory[axis] = dp.peak_bytes_per_device(stored, state, batch), temp
  return memory


def test_a_devices_peak_holds_one_layer_gathered_not_the_model():
  """Layers of 256 x 256: replicated, a device's step holds the model, its gradient and the
  optimizer's state; on 2 islands x 4 it holds a quarter of them and the layer being computed
  gathered (compressors.parallel.gather_on_use). Measured on CPU (XLA's buffers): each layer
  more adds 0.77 of a layer's bytes to the temporaries (its shards' copies and gradient
  buffers), 3.0 replicated, 1.35 when every leaf was gathered first."""
  layer_bytes = (256 * 256 + 256) * 4
  shallow, deep = _step_memory(4), _step_memory(8)
  assert deep["islands"][0] < 0.5 * deep["data"][0], deep
  per_layer = {axis: (deep[axis][1] - shallow[axis][1]) / 4 for axis in deep}
  assert per_layer["data"] >= layer_bytes, per_layer  # its gradient, at least
  assert per_layer["islands"] < layer_bytes, (per_layer, layer_bytes)


def test_gathering_on_use_gives_the_gradient_of_gathering_everything_first():
  """A model with what a block must handle: an embedding read by integer tokens and tied to the
  output (two blocks gather it), a leaf padded flat, a parameter-only chain (a cast, a
  transpose, a mean), and a parameter returned alone in the aux: the value and the gradient of
  the shards match those of the loss on the whole gathered model."""
  layout = fsdp.ParamLayout.of({"embed": jnp.zeros((12, 8)), "w": jnp.zeros((8, 8)),
                                "odd": jnp.zeros((5,))}, "fsdp", 4)
  keys = jax.random.split(jax.random.PRNGKey(3), 3)
  natural = {"embed": jax.random.normal(keys[0], (12, 8)), "w": jax.random.normal(keys[1], (8, 8)),
             "odd": jax.random.normal(keys[2], (5,))}
  tokens = jnp.arange(16, dtype=jnp.int32).reshape(8, 2) % 12

  def loss(p, tokens):
    x = p["embed"][tokens].sum(1)
    x = jnp.tanh(x @ p["w"].astype(jnp.float32).T + p["odd"].mean())
    logits = x @ p["embed"].T
    return jnp.mean(jax.nn.logsumexp(logits, -1)), p["odd"]

  def whole(shards, tokens):
    return jax.value_and_grad(lambda s: loss(layout.gather(s), tokens), has_aux=True)(shards)

  def on_use(shards, tokens):
    return jax.value_and_grad(gather_on_use.loss_on_use(loss, layout), has_aux=True)(
        shards, tokens)

  mesh = harness.islands_mesh(1, 4)
  specs = layout.shard_specs
  results = [jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(specs, P()),
                                   out_specs=((P(), P()), specs), check_vma=False))(
                                       layout.to_stored(natural), tokens)
             for fn in (whole, on_use)]
  jax.tree.map(lambda a, b: np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7), *results)
  assert float(jnp.abs(results[0][1]["odd"]).sum()) > 0  # the test reads real gradients
