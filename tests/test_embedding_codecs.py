"""The embedding exchange's compressed row all-to-alls (compressors/embedding_codecs.py): each
codec's bytes from the compiled program, error feedback that loses nothing, the residual as
training state, and the config's refusals."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
import ml_dtypes
import numpy as np
import optax
import pytest

from compressors import embedding_codecs
from compressors.parallel import embeddings
from compressors.parallel import hlo_bytes
from configs import dlrm as dlrm_config
from experiments import train
from experiments.data import criteo
from tests import dlrm_problem
from tests.dlrm_problem import BATCH, DEVICES, HOTNESS, LEARNING_RATE, MIXED, ROWS, WIDTH

pytestmark = pytest.mark.usefixtures("fast_compiles")

LOSSY = ("bf16", "fp16", "int8", "int4", "topk", "threshold")


@pytest.fixture(scope="module")
def problem():
  return dlrm_problem.problem()


def _mesh():
  return Mesh(np.array(jax.devices()[:DEVICES]), ("data",))


def _sharded_step(tower, plan, codecs, capacity=None):
  """The data-parallel SGD step with the tables placed by ``plan`` and their rows exchanged by
  ``codecs`` (None: the uncompressed exchange); the residuals (``params["exchange"]``) take
  their change, as :func:`embedding_codecs.with_residual_updates` applies it."""
  def body(params, batch):
    def loss(params):
      exchange = (None if codecs is None else
                  embedding_codecs.rows_exchange(codecs, params.get("exchange"), "data"))
      pooled, overflow = embeddings.pooled_lookup(plan, params["tables"], batch["sparse"],
                                                  "data", capacity, exchange)
      logits = tower.apply({"params": params["tower"]}, batch["dense"], pooled)
      return dlrm_problem.bce(logits, batch["label"]), overflow
    (value, overflow), grads = jax.value_and_grad(loss, has_aux=True)(params)
    new = {k: jax.tree.map(lambda p, g: p - LEARNING_RATE * g / DEVICES, params[k], grads[k])
           for k in ("tower", "tables")}
    if "exchange" in params:
      new["exchange"] = jax.tree.map(jnp.add, params["exchange"], grads["exchange"])
    return new, jax.lax.pmean(value, "data"), jax.lax.psum(overflow, "data")
  specs = {"tower": P(), "tables": embeddings.specs(plan, "data")}
  residual = embedding_codecs.residual_shapes(plan, codecs or embedding_codecs.Codecs())
  if residual:
    specs["exchange"] = {k: P("data") for k in residual}
  return jax.jit(jax.shard_map(body, mesh=_mesh(), in_specs=(specs, P("data")),
                               out_specs=(specs, P(), P())))


def _params(problem, plan, codecs):
  _, _, tower_params, tables = problem
  params = {"tower": tower_params, "tables": embeddings.shard(plan, tables)}
  residual = embedding_codecs.init_residual(plan, codecs)
  return {**params, "exchange": residual} if residual else params


@pytest.mark.parametrize("forward,backward,placement", [
    ("int4", "threshold", "row"), ("int8", "topk", "row"),
    # About 10 s each on 2 cores.
    pytest.param("bf16", "fp16", "row", marks=pytest.mark.slow),
    pytest.param("fp16", "int8", "row", marks=pytest.mark.slow),
    pytest.param("int4", "int4", MIXED, marks=pytest.mark.slow),
    pytest.param("int8", "bf16", "column", marks=pytest.mark.slow)])
def test_each_codec_sends_the_predicted_bytes(problem, forward, backward, placement):
  """The compiled step's all-to-alls against :func:`embedding_codecs.exchange_bytes` (16-bit
  payloads bit-cast, int4 packed two a byte, a float32 scale per row, top-k's rows and int32
  indices), every codec in each direction it serves: within 5%, and, as it is, to the byte."""
  codecs = embedding_codecs.codecs(forward, backward, topk_fraction=0.5)
  plan = embeddings.plan(ROWS, WIDTH, placement, DEVICES)
  step = _sharded_step(problem[0], plan, codecs, capacity=6)
  measured = hlo_bytes.wire_bytes(step, _params(problem, plan, codecs), problem[1])
  exchanged = sum(measured.by_kind.get(kind, 0) for kind in ("all-to-all", "all-gather"))
  predicted = embedding_codecs.exchange_bytes(plan, BATCH // DEVICES, HOTNESS, 6, codecs)
  dense = embeddings.exchange_bytes(plan, BATCH // DEVICES, HOTNESS, 6)
  assert exchanged == pytest.approx(predicted["forward"] + predicted["backward"], rel=0.05)
  assert exchanged == predicted["forward"] + predicted["backward"]
  assert exchanged < dense["forward"] + dense["backward"] or placement == "column"


def test_the_payload_sizes_of_a_bucket():
  """A bucket of 10 rows of 8 entries: 320 bytes in float32."""
  make = lambda codec: embedding_codecs.codecs(backward=codec, topk_fraction=0.3)
  sizes = {codec: embedding_codecs.payload_bytes(make(codec), "backward", 10, 8)
           for codec in embedding_codecs.BACKWARD}
  assert sizes == {"dense": 320, "bf16": 160, "fp16": 160, "int8": 80 + 40, "int4": 40 + 40,
                   "topk": 3 * 36, "threshold": 3 * 36}


def _exchanged(codecs, found, carried, cotangent):
  """Under shard_map, every device's ``row_exchange`` and its VJP: ``(received, cotangent of
  found, cotangent of carried)``, each ``[devices, n, capacity, width]``."""
  def body(found, carried, cotangent):
    received, vjp = jax.vjp(
        lambda f, c: embedding_codecs.row_exchange(codecs, "data", f, c), found[0], carried[0])
    return jax.tree.map(lambda x: x[None], (received, *vjp(cotangent[0])))
  run = jax.jit(jax.shard_map(body, mesh=_mesh(), in_specs=P("data"), out_specs=P("data")))
  return [np.asarray(x, np.float64) for x in run(found, carried, cotangent)]


def _rows(seed, scale=1.0):
  """``[devices, n, capacity 5, width 6]`` float32, rows of very different sizes."""
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(DEVICES, DEVICES, 5, WIDTH)) * np.exp(rng.normal(size=(DEVICES, DEVICES,
                                                                              5, 1)))
  return (scale * x).astype(np.float32)


@pytest.mark.parametrize("codec", LOSSY)
def test_error_feedback_loses_nothing(codec):
  """What device ``d`` sent owner ``o`` (the owner's cotangent of ``found``, bucket ``d``) plus
  the residual it keeps is the gradient plus the residual it had: exactly (float64) from a zero
  residual; from a residual, to the one float32 rounding of ``g + e`` and of the residual's
  update ``e + (e' - e)``. The codec does lose something (the test is not of an identity)."""
  codecs = embedding_codecs.codecs(backward=codec, topk_fraction=0.4, threshold=1.5)
  found, gradient = _rows(0), _rows(1, 1e-3)
  for old in (np.zeros_like(gradient), _rows(2, 1e-4)):
    _, arrived, change = _exchanged(codecs, found, old, gradient)
    sent = arrived.transpose(1, 0, 2, 3)  # [sender, owner, ...]
    new = (old + change.astype(np.float32)).astype(np.float64)
    expected = gradient.astype(np.float64) + old
    if not old.any():
      np.testing.assert_array_equal(sent + change, expected)
    np.testing.assert_allclose(sent + new, expected, rtol=0,
                               atol=np.finfo(np.float32).eps * np.abs(expected).max())
    assert np.abs(new).max() > 1e-4 * np.abs(expected).max()


def test_without_error_feedback_the_loss_is_dropped_and_nothing_kept():
  codecs = embedding_codecs.codecs(backward="int4", error_feedback=False)
  plan = embeddings.plan(ROWS, WIDTH, "row", DEVICES)
  assert embedding_codecs.residual_shapes(plan, codecs) == {}
  found, gradient = _rows(0), _rows(1, 1e-3)
  _, arrived, _ = _exchanged(codecs, found, np.zeros_like(gradient), gradient)
  assert 0 < np.abs(arrived.transpose(1, 0, 2, 3) - gradient).max() < 0.2 * np.abs(gradient).max()


@pytest.mark.parametrize("codec", embedding_codecs.FORWARD[1:])
def test_the_forward_payload_decodes_to_the_reference(codec):
  """Owner ``o``'s rows for device ``d`` arrive as the numpy reference of the codec encodes
  them: bf16/fp16 rounded to nearest, int8/int4 by a per-row scale ``max |row|``."""
  found = _rows(3)
  received, _, _ = _exchanged(embedding_codecs.codecs(codec), found, np.zeros_like(found),
                              np.zeros_like(found))
  rows = found.transpose(1, 0, 2, 3)  # what device d receives from owner o
  if codec in ("bf16", "fp16"):
    dtype = ml_dtypes.bfloat16 if codec == "bf16" else np.float16
    np.testing.assert_array_equal(received, rows.astype(dtype).astype(np.float64))
    return
  top = 127 if codec == "int8" else 7
  scale = np.abs(rows).max(axis=-1, keepdims=True)
  expected = np.round(rows * (top / scale)) * (scale * np.float32(1 / top))
  np.testing.assert_allclose(received, expected, rtol=0, atol=1e-6 * scale.max())
  assert np.abs(received - rows).max() > 0


@pytest.mark.slow  # about 40 s on 2 cores: three programs, 20 steps each
def test_compressed_exchanges_train_close_to_float32_and_dense_codecs_exactly(problem):
  """20 steps: dense codecs through the custom VJP give the uncompressed trajectory to the bit;
  int4 forward and backward with error feedback stays within 0.03 of float32's loss (0.016 at
  step 20: the forward's rounding changes the model's outputs, which no feedback repairs)."""
  plan = embeddings.plan(ROWS, WIDTH, MIXED, DEVICES)
  trajectories = {}
  for name, codecs in (("float32", None), ("dense", embedding_codecs.Codecs()),
                       ("int4", embedding_codecs.codecs("int4", "int4"))):
    params = _params(problem, plan, codecs or embedding_codecs.Codecs())
    step = _sharded_step(problem[0], plan, codecs)
    losses = []
    for _ in range(20):
      params, value, overflow = step(params, problem[1])
      losses.append(float(value))
      assert int(overflow) == 0
    trajectories[name] = losses
  assert trajectories["dense"] == trajectories["float32"]
  assert trajectories["int4"][-1] < trajectories["int4"][0] - 0.05
  np.testing.assert_allclose(trajectories["int4"], trajectories["float32"], atol=0.03)


def test_the_residual_takes_its_change_and_the_tables_their_optimizer():
  tx = embedding_codecs.with_residual_updates(optax.sgd(0.5), workers=8)
  params = {"tables": {"bank": jnp.ones((2, 3))}, embedding_codecs.RESIDUAL: {"bank": jnp.ones(4)}}
  grads = {"tables": {"bank": jnp.full((2, 3), 2.0)},
           embedding_codecs.RESIDUAL: {"bank": jnp.full(4, 0.25)}}
  updates, _ = tx.update(grads, tx.init(params), params)
  np.testing.assert_array_equal(updates["tables"]["bank"], -1.0)
  np.testing.assert_array_equal(updates[embedding_codecs.RESIDUAL]["bank"], 2.0)


def test_the_residual_is_charged_to_the_memory_budget():
  """A whole bank per device: row-placed tables of 8 x 1,000 rows of 16 float32 hold 64,000
  bytes of a device, their residual 512,000."""
  plan = embeddings.plan((8000,), 16, "row", DEVICES)
  codecs = embedding_codecs.codecs(backward="int4")
  residual = embedding_codecs.residual_bytes_per_device(plan, codecs)
  assert plan.bytes_per_device() == 64_000 and residual == 512_000
  assert embedding_codecs.residual_bytes_per_device(
      plan, codecs._replace(error_feedback=False)) == 0
  embeddings.check_budget(plan, 576_000, residual_bytes=residual)
  with pytest.raises(ValueError, match=r"^the embedding tables need 576,000 bytes of one device "
                                       r"as placed \(512,000 of them the residual\); allowed"):
    embeddings.check_budget(plan, 575_999, residual_bytes=residual)


@pytest.mark.parametrize("fields,message", [
    ({"forward": "topk"}, r"config.embedding.exchange='topk' is not allowed; allowed: \['dense'"),
    ({"backward": "int2"}, r"config.embedding.gradient_exchange='int2' is not allowed"),
    ({"error_feedback": "yes"}, r"config.embedding.error_feedback='yes' is not allowed"),
    ({"topk_fraction": 0.0}, r"config.embedding.topk_fraction=0.0 is not allowed"),
    ({"threshold": -1.0}, r"config.embedding.threshold=-1.0 is not allowed")])
def test_bad_codecs_are_refused_in_one_line(fields, message):
  with pytest.raises(ValueError, match=message) as error:
    embedding_codecs.codecs(**fields)
  assert "\n" not in str(error.value)
  with pytest.raises(ValueError, match="with row_reduction='reduce_scatter': reduce-scattered"):
    embedding_codecs.check_plan(embedding_codecs.codecs("int8"), "reduce_scatter")
  embedding_codecs.check_plan(embedding_codecs.Codecs(), "reduce_scatter")


def _config(cache_dir, **fields):
  """20 steps of the small DLRM of tests/test_dlrm_runner.py, row-placed tables."""
  config = dlrm_config.get_config("smoke")
  config.data.update(dict(max_rows=50, num_train=512, num_eval=256, cache_dir=str(cache_dir)))
  config.update_from_flattened_dict({"batch_size": 64, "eval_batch_size": 256, "num_steps": 20,
                                     "checkpoint_every": 0, "embedding.placement": "row",
                                     **fields})
  return config


def test_the_runner_refuses_a_bad_codec_before_compiling(tmp_path):
  with pytest.raises(ValueError, match="config.embedding.gradient_exchange='int2' is not"):
    train.train_and_evaluate(_config(tmp_path / "cache", **{"embedding.gradient_exchange":
                                                            "int2"}), str(tmp_path / "run"))


@pytest.mark.slow  # about 40 s on 2 cores: two runs, the second resumed
def test_int4_with_error_feedback_through_the_runner_and_a_resumed_run(tmp_path):
  """int4 both ways with error feedback: the compiled program's bytes are the formula's, the
  residual is checkpointed with the parameters (a run resumed at step 3 ends as the whole
  run), and the run learns."""
  config = _config(tmp_path / "cache", **{"num_steps": 6, "checkpoint_every": 3,
                                          "embedding.exchange": "int4",
                                          "embedding.gradient_exchange": "int4"})
  whole = train.train_and_evaluate(config, str(tmp_path / "run"))
  rows, hotness = criteo.table_shapes(config.data)
  plan = embeddings.plan(rows, config.model.embedding_dim, "row", 8)
  predicted = embedding_codecs.exchange_bytes(plan, config.batch_size // 8, hotness, None,
                                              embedding_codecs.codecs("int4", "int4"))
  sent = whole["bytes_by_collective"]
  assert sent["embedding_forward"] == pytest.approx(predicted["forward"], rel=0.05)
  assert sent["embedding_backward"] == pytest.approx(predicted["backward"], rel=0.05)
  shutil.rmtree(tmp_path / "run" / "checkpoints" / "6")
  resumed = train.train_and_evaluate(config, str(tmp_path / "run"))
  assert resumed["auc"] == whole["auc"] and resumed["test_loss"] == whole["test_loss"]
  with open(os.path.join(tmp_path, "run", "metrics.jsonl")) as f:
    losses = [row["loss"] for row in map(json.loads, f) if "loss" in row]
  assert losses[-1] < losses[0]
