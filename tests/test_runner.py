"""The experiment runner end to end: every config's smoke variant on tiny data in the real formats,
logs, bytes on the wire, replicas, resume, sweeps, and 2 processes against 1.

Compiles here run with ``jax_disable_most_optimizations`` (``fast_compiles``, tests/conftest.py):
the programs and their collectives are the same, they just compile in a fraction of the time.
"""

import csv
import dataclasses
import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from compressors import registry
from compressors.network import topology
from configs import quickstart
from experiments import checkpoint
from experiments import data
from experiments import logs
from experiments import models
from experiments import provenance
from experiments import sweep
from experiments import train
from experiments.data import fake

pytestmark = pytest.mark.usefixtures("fast_compiles")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def data_dirs(tmp_path_factory):
  root = tmp_path_factory.mktemp("data")
  return {
      "cifar10": fake.write_cifar(str(root / "cifar10"), num_classes=10, num_train=40,
                                  num_test=16),
      "cifar100": fake.write_cifar(str(root / "cifar100"), num_classes=100, num_train=40,
                                   num_test=16),
      "imagenet": fake.write_imagenet(str(root / "imagenet"), num_classes=2, train_per_class=8,
                                      val_per_class=8),
      "text": fake.write_text(str(root / "text")),
  }


def _config(module, arg="smoke", **fields):
  config = __import__(f"configs.{module}", fromlist=["get_config"]).get_config(arg)
  config.update_from_flattened_dict(fields)
  return config


def _records(workdir):
  records = logs.read_metrics(workdir)
  return [r for r in records if "loss" in r], [r for r in records if "test_loss" in r]


def _assert_replicas_identical(tree):
  for leaf in jax.tree.leaves(tree):
    shards = [np.asarray(s.data) for s in leaf.addressable_shards]
    for shard in shards[1:]:
      np.testing.assert_array_equal(shard, shards[0])


@pytest.mark.parametrize("module, data, arg", [
    ("digits", None, "smoke,method=topk"),
    pytest.param("cifar10_resnet20", "cifar10", "smoke,method=dgc", marks=pytest.mark.slow),
    pytest.param("cifar10_wrn", "cifar10", "smoke", marks=pytest.mark.slow),
    pytest.param("cifar10_vgg19", "cifar10", "smoke", marks=pytest.mark.slow),
    pytest.param("cifar100_resnet56", "cifar100", "smoke", marks=pytest.mark.slow),
    pytest.param("cifar100_wrn", "cifar100", "smoke", marks=pytest.mark.slow),
    pytest.param("cifar100_vgg19", "cifar100", "smoke", marks=pytest.mark.slow),
    pytest.param("imagenet_resnet50", "imagenet", "smoke", marks=pytest.mark.slow),
    ("bert", "text", "smoke"),
])
def test_smoke_variants_train_end_to_end(module, data, arg, data_dirs, tmp_path):
  config = _config(module, arg)
  if module == "bert":  # the smoke variant reads pydoc_data; read the text files instead
    config.dataset = "text"
  if data:
    config.data_dir = data_dirs[data]
  results, state = train.train(config, str(tmp_path))
  assert results["step"] == 2 and int(state.step) == 2
  assert np.isfinite(results["test_loss"]) and 0 <= results["test_accuracy"] <= 1
  _assert_replicas_identical(state.params)
  train_records, eval_records = _records(tmp_path)
  assert [r["step"] for r in train_records] == [1, 2] and [r["step"] for r in eval_records] == [2]
  for r in train_records:
    assert np.isfinite(r["loss"]) and r["examples_per_sec"] > 0 and r["learning_rate"] >= 0
    assert r["compression_ratio"] == pytest.approx(r["dense_bytes"] / r["wire_bytes"])
  assert eval_records[0]["test_accuracy"] == results["test_accuracy"]
  with open(tmp_path / "config.json") as f:
    stored = json.load(f)
  assert stored["model"] == json.loads(json.dumps(config.model.to_dict()))
  with open(tmp_path / train.RESULTS_FILE) as f:
    origin = json.load(f)[provenance.KEY]
  for rec in (stored[provenance.KEY], origin):  # where the run comes from
    assert len(rec["commit"]) == 40 and rec["jax"] == jax.__version__ and rec["jaxlib"]
    assert rec["device_kinds"] == ["cpu"] and (rec["num_workers"], rec["process_count"]) == (8, 1)
  assert os.listdir(tmp_path / "tensorboard")
  assert checkpoint.Checkpointer(str(tmp_path), keep=2).latest_step() == 2


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory):
  """The quickstart's smoke variant with dense, top-k and TASC, run as a sweep."""
  workdir = str(tmp_path_factory.mktemp("sweep"))
  cwd = os.getcwd()
  os.chdir(ROOT)
  try:
    configs = sweep.run_configs(
        _config("sweeps.quickstart_methods", "smoke"))
  finally:
    os.chdir(cwd)
  rows = sweep.run_sweep(configs, workdir)
  return workdir, configs, rows


@pytest.mark.slow  # half a minute of sweep runs
def test_sweep_runs_every_method_and_writes_a_summary(sweep_dir):
  workdir, configs, rows = sweep_dir
  assert [r["name"] for r in rows] == ["dense", "topk", "tasc"]
  with open(os.path.join(workdir, "summary.csv")) as f:
    table = {r["name"]: r for r in csv.DictReader(f)}
  assert float(table["dense"]["compression_ratio"]) == 1.0
  # Top-k all-gathers k f32 values and k int32 indices from each of n workers; each worker sends
  # (n-1)/n of the gathered result.
  n, density = 8, configs["topk"].compression.topk.density
  with open(os.path.join(workdir, "topk", train.RESULTS_FILE)) as f:
    num_params = json.load(f)["num_params"]
  k = round(density * num_params)
  assert float(table["topk"]["wire_bytes"]) == (n - 1) / n * n * 2 * k * 4
  # TASC all-reduces K blocks and the num_blocks block scores per step (tasc/_supports.py), in
  # float16 as the quickstart sends them, and each worker's float32 bound for the payload's
  # scale; the curvature refresh is each worker's own estimate and moves nothing.
  c = configs["tasc"].compression.tasc
  assert c.wire_dtype == "float16"
  num_blocks = -(-num_params // c.block_size)
  operands = 2 * (round(c.density * num_blocks) * c.block_size + num_blocks) + 4
  per_step = 2 * (n - 1) / n * operands
  assert float(table["tasc"]["wire_bytes"]) == pytest.approx(per_step, rel=1e-12)
  # A finished sweep skips every run: nothing is trained or rewritten.
  before = {n: os.path.getmtime(os.path.join(workdir, n, logs.METRICS_FILE)) for n in table}
  assert sweep.run_sweep(configs, workdir) == rows
  assert before == {n: os.path.getmtime(os.path.join(workdir, n, logs.METRICS_FILE))
                    for n in table}


def test_dense_bytes_are_one_all_reduce_of_the_gradient(sweep_dir):
  """A ring all-reduce of n workers sends 2 (n-1)/n of the f32 gradient per device."""
  with open(os.path.join(sweep_dir[0], "dense", train.RESULTS_FILE)) as f:
    results = json.load(f)
  n = 8
  assert results["wire_bytes"] == results["dense_bytes"] == 2 * (n - 1) / n * 4 * results[
      "num_params"]


def test_a_dense_step_is_sgd_on_the_global_batch_mean(tmp_path):
  """Reference: one device, the 8 devices' batches concatenated, plain SGD on the mean loss."""
  config = _config("quickstart", "smoke", method="dense", **{
      "optimizer.name": "sgd", "optimizer.weight_decay": 0.0, "schedule.name": "constant"})
  train.train_and_evaluate(config, str(tmp_path))
  before, after = (checkpoint.load_params(str(tmp_path), step) for step in (1, 2))
  dataset = data.load(config, data.ShardSpec(8, tuple(range(8))))
  batch = {k: v.reshape((-1,) + v.shape[2:]) for k, v in dataset.train_batch(1).items()}
  model = models.build_model(config.model, **dataset.model_fields)

  def loss(params):
    logits = model.apply({"params": params}, batch["input"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

  grads = jax.grad(loss)(before)
  expected = jax.tree.map(lambda p, g: p - config.optimizer.learning_rate * g, before, grads)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), after,
               expected)
  assert not np.allclose(after["Dense_0"]["kernel"], before["Dense_0"]["kernel"])


def test_resume_after_a_checkpoint_ends_like_an_uninterrupted_run(sweep_dir, tmp_path):
  """The sweep's TASC run checkpointed after steps 1 and 2; stop it after step 1 and restart."""
  finished = os.path.join(sweep_dir[0], "tasc")
  workdir = str(tmp_path / "tasc")
  shutil.copytree(finished, workdir)
  checkpoints = os.path.join(workdir, "checkpoints")
  assert sorted(os.listdir(checkpoints)) == ["1", "2"]
  shutil.rmtree(os.path.join(checkpoints, "2"))
  os.remove(os.path.join(workdir, train.RESULTS_FILE))
  # A half-written checkpoint (orbax's temporary directory) must not be picked up.
  os.makedirs(os.path.join(checkpoints, "2.orbax-checkpoint-tmp-1234", "default"))
  resumed = train.train_and_evaluate(sweep_dir[1]["tasc"], workdir)
  jax.tree.map(np.testing.assert_array_equal, checkpoint.load_params(workdir, 2),
               checkpoint.load_params(finished, 2))
  with open(os.path.join(finished, train.RESULTS_FILE)) as f:
    assert resumed["test_loss"] == json.load(f)["test_loss"]
  train_records, eval_records = _records(workdir)
  assert [r["step"] for r in train_records] == [1, 2] and [r["step"] for r in eval_records] == [2]


def test_bad_configs_fail_before_compiling(tmp_path, data_dirs):
  with pytest.raises(ValueError, match="config.method='zip'"):
    train.train_and_evaluate(_config("quickstart", "smoke", method="zip"), str(tmp_path))
  with pytest.raises(FileNotFoundError, match="data_batch_1"):
    train.train_and_evaluate(_config("cifar10_resnet20", "smoke", data_dir=str(tmp_path / "x")),
                             str(tmp_path))
  with pytest.raises(ValueError, match="config.num_devices=16 but only 8 cpu devices"):
    train.train_and_evaluate(_config("quickstart", "smoke", num_devices=16, batch_size=64,
                                     eval_batch_size=64), str(tmp_path))
  assert not os.path.exists(tmp_path / logs.METRICS_FILE)


@pytest.mark.parametrize("workers", [
    [],
    # 2 processes x 2 devices x 2 simulated workers.
    pytest.param(["--config.num_devices=4", "--config.workers_per_device=2"],
                 marks=pytest.mark.slow)], ids=["devices", "simulated"])
@pytest.mark.slow  # multi-process
def test_two_processes_match_one_process(sweep_dir, tmp_path, workers):
  """experiments.launch: 2 processes x 4 devices give the parameters of 1 process x 8 devices
  (top-k: per-device error-feedback state split across the processes)."""
  workdir = str(tmp_path / "mp")
  env = dict(os.environ, JAX_DISABLE_MOST_OPTIMIZATIONS="1", XLA_FLAGS="")
  completed = subprocess.run(
      [sys.executable, "-m", "experiments.launch", "--num_processes=2", "--",
       "--config=configs/quickstart.py:smoke", "--config.method=topk", f"--workdir={workdir}",
       *workers],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert completed.returncode == 0, completed.stderr[-3000:]
  # Only process 0 prints and logs.
  assert completed.stdout.count("test accuracy") == 1
  train_records, eval_records = _records(workdir)
  assert [r["step"] for r in train_records] == [1, 2] and [r["step"] for r in eval_records] == [2]
  one_process = checkpoint.load_params(os.path.join(sweep_dir[0], "topk"))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
               checkpoint.load_params(workdir), one_process)
  with open(os.path.join(workdir, train.RESULTS_FILE)) as f:
    results = json.load(f)
  with open(os.path.join(sweep_dir[0], "topk", train.RESULTS_FILE)) as f:
    reference = json.load(f)
  assert results["wire_bytes"] == reference["wire_bytes"]


@pytest.mark.slow  # a multi-process run (README: the slow marker's)
def test_two_process_bert_matches_one_process_and_resumes_bit_for_bit(tmp_path):
  """BERT on pydoc text, 2 processes x 4 devices: the parameters of 1 process x 8 devices with
  the same global batch (both processes tokenize with the one tokenizer the first training put
  in the cache folder), and a restart from step 1's checkpoint ends bit for bit as the
  uninterrupted run."""
  fields = {"data.cache_dir": str(tmp_path / "tokenizers"), "checkpoint_every": 1}
  one_process = train.train_and_evaluate(_config("bert", "smoke", **fields),
                                         str(tmp_path / "one"))
  env = dict(os.environ, JAX_DISABLE_MOST_OPTIMIZATIONS="1", XLA_FLAGS="")
  command = [sys.executable, "-m", "experiments.launch", "--num_processes=2", "--",
             "--config=configs/bert.py:smoke", f"--workdir={tmp_path / 'two'}",
             *[f"--config.{k}={v}" for k, v in fields.items()]]

  def launch():
    completed = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                               timeout=600)
    assert completed.returncode == 0, completed.stderr[-3000:]
    with open(tmp_path / "two" / train.RESULTS_FILE) as f:
      return json.load(f), checkpoint.load_state(str(tmp_path / "two"))

  two_processes, state = launch()
  assert two_processes["tokenizer_sha256"] == one_process["tokenizer_sha256"]
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
               state["params"], checkpoint.load_params(str(tmp_path / "one")))
  shutil.rmtree(tmp_path / "two" / "checkpoints" / str(two_processes["step"]))
  _, resumed = launch()
  jax.tree.map(np.testing.assert_array_equal, resumed, state)


@pytest.mark.parametrize("num_devices, per_device", [
    (2, 4), pytest.param(1, 8, marks=pytest.mark.slow)])  # 1 x 8: a variant, in the slow suite
@pytest.mark.slow  # a variant: tests/test_aggregation.py and tests/test_embeddings.py match simulated workers to devices
def test_simulated_workers_train_as_the_devices_would(sweep_dir, tmp_path, num_devices,
                                                       per_device):
  """TASC (per-step curvature, per-worker residuals and scores) on 8 workers as 2 devices x 4
  simulated workers and as 1 x 8: the bytes of the 8-device run, its parameters to float32
  reassociation, checkpoints of the same arrays, and resume bit for bit."""
  reference_dir = os.path.join(sweep_dir[0], "tasc")
  config = sweep_dir[1]["tasc"].copy_and_resolve_references()
  config.num_devices, config.workers_per_device = num_devices, per_device
  workdir = str(tmp_path / "simulated")
  results = train.train_and_evaluate(config, workdir)
  with open(os.path.join(reference_dir, train.RESULTS_FILE)) as f:
    reference = json.load(f)
  for key in ("wire_bytes", "dense_bytes", "guard_bytes", "compression_ratio"):
    assert results[key] == reference[key], key
  assert (results["num_workers"], results["workers_per_device"]) == (8, per_device)
  assert results["test_accuracy"] == pytest.approx(reference["test_accuracy"], abs=1 / 16)
  simulated, devices = (checkpoint.load_state(d) for d in (workdir, reference_dir))
  assert jax.tree.structure(simulated) == jax.tree.structure(devices)
  for a, b in zip(jax.tree.leaves(simulated), jax.tree.leaves(devices)):
    assert a.shape == b.shape and a.dtype == b.dtype
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
               simulated["params"], devices["params"])
  # Resume: stop after step 1, restart.
  resumed_dir = str(tmp_path / "resumed")
  shutil.copytree(workdir, resumed_dir)
  shutil.rmtree(os.path.join(resumed_dir, "checkpoints", "2"))
  train.train_and_evaluate(config, resumed_dir)
  jax.tree.map(np.testing.assert_array_equal, checkpoint.load_state(resumed_dir),
               checkpoint.load_state(workdir))


@pytest.mark.parametrize("asked, per_device, available, platform, expected", [
    (8, 1, 8, "cpu", (8, 1)), (4, 2, 8, "cpu", (4, 2)), (8, 1, 1, "gpu", (1, 8)),
    (8, 2, 3, "gpu", (2, 8)), (6, 1, 4, "tpu", (3, 2)),
])
def test_an_accelerator_simulates_the_devices_it_lacks(asked, per_device, available, platform,
                                                       expected):
  assert train.split_workers(asked, per_device, available, platform) == expected


def test_too_few_cpu_devices_is_an_error_that_says_how_to_expose_them():
  with pytest.raises(ValueError, match=r"num_devices=16 but only 8 cpu devices exist; .*"
                                       r"jax_num_cpu_devices', 32\)"):
    train.split_workers(16, 2, 8, "cpu")


def test_one_worker_sends_nothing_and_says_so(tmp_path):
  config = _config("quickstart", "smoke", num_devices=1)
  results = train.train_and_evaluate(config, str(tmp_path))
  assert results["wire_bytes"] == results["dense_bytes"] == 0
  assert results["compression_ratio"] is None
  assert logs.summary(results).endswith("one worker: no bytes travel")


@pytest.mark.slow
def test_quickstart_on_one_device_with_8_simulated_workers_matches_8_devices(tmp_path):
  """The README's main job as 8 workers simulated on one device (as on one GPU): the 8-device
  run's bytes, and its accuracy but for the rounding of sums taken in another order."""
  jax.config.update("jax_disable_most_optimizations", False)
  runs = {}
  for devices, per_device in ((8, 1), (1, 8)):
    config = quickstart.get_config()
    config.num_devices, config.workers_per_device = devices, per_device
    runs[devices] = train.train_and_evaluate(config, str(tmp_path / str(devices)))
  assert runs[1]["wire_bytes"] == runs[8]["wire_bytes"]
  assert runs[1]["compression_ratio"] == runs[8]["compression_ratio"] >= 100
  assert abs(runs[1]["test_accuracy"] - runs[8]["test_accuracy"]) <= 0.01


@pytest.mark.gpu
def test_quickstart_on_a_gpu_simulates_its_8_workers(tmp_path):
  """The README's quickstart, unchanged, on one GPU: its 8 devices become 8 workers simulated
  on the GPU, at the CPU run's accuracy band and its bytes (read from the CPU's compile of 8
  devices)."""
  jax.config.update("jax_disable_most_optimizations", False)
  config = quickstart.get_config()
  results = train.train_and_evaluate(config, str(tmp_path))
  assert results["num_workers"] == 8 and results["workers_per_device"] == 8 // len(
      jax.devices())
  assert 0.93 <= results["test_accuracy"] <= 0.96
  assert results["compression_ratio"] == pytest.approx(124.1, abs=0.1)


@pytest.mark.slow
def test_quickstart_reaches_its_targets(tmp_path):
  """The README's main job: >= 85% on MNIST-1D with >= 50x fewer bytes per step than dense."""
  jax.config.update("jax_disable_most_optimizations", False)
  results = train.train_and_evaluate(quickstart.get_config(), str(tmp_path))
  assert results["test_accuracy"] >= 0.85
  assert results["compression_ratio"] >= 50
  assert results["wall_seconds"] < 300


@dataclasses.dataclass(frozen=True)
class _TwoKindsSettings:
  sync_every: int = 2


def _two_kinds(settings, *, axis_name, **unused_options):
  """A toy of two step kinds: a float16 all-reduce of the gradient on most steps, a float32 one
  (twice the bytes) on the steps that pass ``sync`` (every ``sync_every``)."""
  def update(updates, state, params=None, *, sync=None):
    del params
    wire = jnp.float16 if sync is None else jnp.float32
    return jax.tree.map(lambda g: jax.lax.pmean(g.astype(wire), axis_name).astype(g.dtype),
                        updates), state
  return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)


def _sync_inputs(settings):
  return registry.StepInputs(every=settings.sync_every,
                             make=lambda *unused: {"sync": jnp.zeros((), jnp.float32)})


@pytest.fixture
def two_kinds():
  method = registry.Method(
      name="two_kinds", summary="a toy of two step kinds", settings=_TwoKindsSettings,
      transformation=_two_kinds, step_inputs=_sync_inputs, error_feedback=False,
      cost=lambda s, shapes, topo, schedule: topology.all_reduce_cost(
          schedule, topo, registry.num_elements(shapes)))
  registry.register(method)
  yield method
  registry.unregister("two_kinds")


@pytest.mark.slow
def test_a_run_of_two_step_kinds_is_charged_the_bytes_of_the_steps_it_ran(two_kinds, tmp_path):
  """Each kind's bytes come from its own compiled program (float16: half of dense's float32
  all-reduce; float32: dense's), and the logged bytes are their mean over the steps run so far,
  each step charged its kind's: 5 steps with the float32 kind at steps 0, 2 and 4."""
  config = _config("digits", "smoke", method="two_kinds", num_steps=5, log_every=1,
                   eval_every=0)
  results = train.train_and_evaluate(config, str(tmp_path))
  dense = results["dense_bytes"]
  assert results["bytes_by_kind"] == {"step": dense / 2, "with_inputs": dense}
  logged = [r["wire_bytes"] for r in _records(str(tmp_path))[0]]
  float32_steps = [1, 1, 2, 2, 3]  # of the first 1, 2, ..., 5 steps
  assert logged == pytest.approx([(n * dense + (done - n) * dense / 2) / done for done, n in
                                  zip(range(1, 6), float32_steps)], rel=1e-12)
  assert results["wire_bytes"] == logged[-1] == pytest.approx(4 * dense / 5)
