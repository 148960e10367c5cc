"""The runner on islands (``config.mesh.fsdp > 1``): the language model's smoke tier on 2 islands
x 4 fsdp devices against plain 8-way data parallelism, its bytes by axis, the state one device
holds, checkpoints and resume, and the settings islands refuse."""

import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from configs import digits
from configs import lm_islands
from configs import lm_stdlib
from configs import quickstart
from experiments import checkpoint
from experiments import train
from experiments import validation
from tests import test_failures

pytestmark = pytest.mark.usefixtures("fast_compiles")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(tmp_path, module=lm_stdlib, **args):
  arg = ",".join(f"{k}={v}" for k, v in {"smoke": True, "method": "dense", **args}.items())
  config = module.get_config(arg)
  config.data.cache_dir = str(tmp_path / "tokenizers")
  return config


SMOKE_BUDGET = 30_000  # bytes; the smoke model's parameters alone are 33,472


class _Runs(dict):
  """Run name -> its results, each run trained the first time a test reads it (the default
  suite never reads "plain": only a slow test compares against it)."""

  def __init__(self, root, configs):
    super().__init__()
    self.root, self.configs = root, configs

  def __missing__(self, name):
    self[name] = train.train_and_evaluate(self.configs[name], str(self.root / name))
    return self[name]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tokenizer_cache):
  """Smoke runs: plain dense, and dense and DiLoCo (int8) across 2 islands of 4 (top-k's bytes
  across islands are checked on the step itself, tests/test_islands.py), as
  ``(root, configs, results)``; a test that reads a run's directory reads its results first."""
  root = tmp_path_factory.mktemp("islands")
  configs = {"plain": _config(root), "dense": _config(root, fsdp=4),
             "diloco": _config(root, lm_islands, method="diloco")}  # int8, 2 x 4
  # Less than the model's parameters: the islands' quarter of the state fits, the whole does not.
  configs["dense"].max_state_bytes_per_device = SMOKE_BUDGET
  configs["diloco"].compression.diloco.every = 1
  for config in configs.values():
    config.data.cache_dir = tokenizer_cache
  return root, configs, _Runs(root, configs)


@pytest.mark.slow  # a minute; tests/test_islands.py checks the same equality on the step
def test_dense_across_islands_trains_as_eight_way_data_parallelism(runs):
  root, _, results = runs
  plain, islands = results["plain"], results["dense"]
  assert islands["test_loss"] == pytest.approx(plain["test_loss"], rel=1e-5)
  a, b = (checkpoint.load_params(str(root / name)) for name in ("plain", "dense"))
  jax.tree.map(lambda x, y: np.testing.assert_allclose(y, x, rtol=0, atol=1e-5), a, b)
  # Each device holds a quarter of the parameters, of AdamW's moments and of the rest.
  assert islands["state_bytes_per_device"] <= 0.30 * plain["state_bytes_per_device"]
  assert set(islands["bytes_by_axis"]) == {"islands", "fsdp", "islands+fsdp"}
  assert set(plain["bytes_by_axis"]) == {"data"}
  # A model larger than one device's budget trains on the islands, which report their peak.
  assert islands["num_params"] * 4 > SMOKE_BUDGET >= islands["state_bytes_per_device"]
  assert 0 < islands["peak_bytes_per_device"] < plain["peak_bytes_per_device"]
  assert islands["peak_bytes_by_kind"] == {"step": islands["peak_bytes_per_device"]}
  with open(os.path.join(root, "dense", train.RESULTS_FILE)) as f:
    assert json.load(f)["peak_bytes_per_device"] == islands["peak_bytes_per_device"]


@pytest.mark.slow  # two runs' compiles (about 50 s on 2 CPU cores)
def test_a_model_over_one_devices_budget_peaks_at_under_half_the_replicated_step(tmp_path,
                                                                               monkeypatch):
  """Four 64-wide layers (881,152 bytes of parameters) under a budget of 800,000 bytes a
  device: replicated, the run is refused; on 2 islands x 4 it trains, and a device's peak in the
  step (parameters, state, gradients, activations, gathered leaves; the compiled program's
  memory analysis) is under half the replicated step's, the loss that of the replicated run.
  Its initialisation makes each device's shards without the whole model: the program's
  temporaries are under half the parameters' bytes (replicated: 1.5 times them)."""
  inits = []  # the memory analyses of the programs compiled as the initialisation is
  compile_program = jax.stages.Lowered.compile

  def compile_and_note(lowered, *args, compiler_options=None, **kwargs):
    compiled = compile_program(lowered, *args, compiler_options=compiler_options, **kwargs)
    if compiler_options == train._FAST_COMPILE:  # pylint: disable=protected-access
      inits.append(compiled.memory_analysis())
    return compiled
  monkeypatch.setattr(jax.stages.Lowered, "compile", compile_and_note)
  results = {}
  for name, fsdp in (("replicated", 1), ("islands", 4)):
    config = _config(tmp_path, fsdp=fsdp)
    config.model.hidden, config.model.num_layers = 64, 4
    results[name] = train.train_and_evaluate(config, str(tmp_path / name))
  replicated, islands = results["replicated"], results["islands"]
  param_bytes = islands["num_params"] * 4
  assert inits[0].temp_size_in_bytes > param_bytes > 2 * inits[1].temp_size_in_bytes, (
      [m.temp_size_in_bytes for m in inits], param_bytes)
  # Its outputs: a quarter of the parameters and of AdamW's two moments, and the model state
  # (and the guard's counters).
  assert inits[1].output_size_in_bytes <= 1.01 * islands["state_bytes_per_device"]
  budget = 800_000
  assert param_bytes > budget >= islands["state_bytes_per_device"]
  assert islands["peak_bytes_per_device"] < 0.5 * replicated["peak_bytes_per_device"], (
      islands["peak_bytes_per_device"], replicated["peak_bytes_per_device"])
  assert islands["test_loss"] == pytest.approx(replicated["test_loss"], rel=1e-6)
  config = _config(tmp_path, fsdp=1)
  config.model.hidden, config.model.num_layers = 64, 4
  config.max_state_bytes_per_device = budget
  with pytest.raises(ValueError, match="config.max_state_bytes_per_device=800,000"):
    train.train_and_evaluate(config, str(tmp_path / "refused"))


@pytest.mark.slow  # a variant: the islands layouts' padding is checked by tests/test_islands.py
def test_a_classifier_with_leaves_fsdp_does_not_divide_trains_and_loads_in_natural_shapes(
    tmp_path):
  """digits' 10-class head: its bias is flattened and padded to 12 on islands; the checkpoint's
  parameters come back in the model's shapes, those of the plain run to float rounding."""
  loaded = {}
  for name, fsdp in (("plain", 1), ("islands", 4)):
    config = digits.get_config("smoke")
    config.mesh.fsdp = fsdp
    train.train_and_evaluate(config, str(tmp_path / name))
    loaded[name] = checkpoint.load_params(str(tmp_path / name))
  assert jax.tree.map(np.shape, loaded["islands"]) == jax.tree.map(np.shape, loaded["plain"])
  jax.tree.map(lambda a, b: np.testing.assert_allclose(b, a, rtol=0, atol=1e-5),
               loaded["plain"], loaded["islands"])


# Learning rates at which a device's own shard's norms, in place of the whole layer's, would move
# the test loss by more than the tolerance (measured: 1.1e-3 for LAMB, 5.9e-4 for LARS, relative).
TRUST_RATIO_OPTIMIZERS = {"lamb": 0.1, "lars": 20.0}


@pytest.mark.parametrize("optimizer", ["lamb", pytest.param("lars", marks=pytest.mark.slow)])
def test_dense_with_a_trust_ratio_across_islands_trains_as_eight_way_data_parallelism(
    tmp_path, optimizer):
  """LAMB and LARS on 2 islands x 4 fsdp devices: each layer's trust ratio reads its whole norm
  (the shards' sums of squares summed over the fast axis; digits' head bias, padded from 10 to
  12, excluded as on one device), so dense ends at the test loss of 8 replicated devices."""
  results = {}
  for name, fsdp in (("plain", 1), ("islands", 4)):
    config = digits.get_config("smoke")
    config.mesh.fsdp = fsdp
    config.optimizer.update(dict(name=optimizer, learning_rate=TRUST_RATIO_OPTIMIZERS[optimizer]))
    config.num_steps = 4
    results[name] = train.train_and_evaluate(config, str(tmp_path / name))
  assert results["islands"]["test_loss"] == pytest.approx(results["plain"]["test_loss"],
                                                          rel=1e-4)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(b, a, rtol=0, atol=1e-5),
               *(checkpoint.load_params(str(tmp_path / name)) for name in ("plain", "islands")))


@pytest.mark.slow  # DiLoCo's run; tests/test_islands.py checks DiLoCo across islands on the step
def test_diloco_across_islands_synchronises_its_shards_in_int8(runs):
  root, _, results = runs
  diloco, dense = results["diloco"], results["dense"]
  assert diloco["bytes_by_kind"]["sync"] > 0 and "islands" in diloco["bytes_by_axis"]
  # The fast axis carries ZeRO-3's traffic whatever the method; the tables' bytes are the slow
  # link's, the exchange the method compresses.
  assert diloco["bytes_by_axis"]["fsdp"] == dense["bytes_by_axis"]["fsdp"]
  assert diloco["wire_bytes"] == diloco["bytes_by_axis"]["islands"]
  assert dense["dense_bytes"] == dense["bytes_by_axis"]["islands"]
  # int8 payloads: about a quarter of dense's float32 all-reduce across the islands.
  assert diloco["bytes_by_kind"]["sync"] <= 0.3 * results["dense"]["dense_bytes"]
  with open(os.path.join(root, "diloco", train.RESULTS_FILE)) as f:
    assert json.load(f)["state_bytes_per_device"] == diloco["state_bytes_per_device"]


@pytest.mark.parametrize("name", ["dense", pytest.param("diloco", marks=pytest.mark.slow)])
def test_a_run_on_islands_resumes_bit_for_bit(runs, tmp_path, name):
  root, configs, results = runs
  assert results[name]["step"] == 2
  resumed = str(tmp_path / name)
  shutil.copytree(root / name, resumed)
  shutil.rmtree(os.path.join(resumed, "checkpoints", "2"))
  train.train_and_evaluate(configs[name], resumed)
  jax.tree.map(np.testing.assert_array_equal, checkpoint.load_state(resumed),
               checkpoint.load_state(str(root / name)))


def test_resuming_on_another_layout_is_refused_naming_both(runs, tmp_path):
  root, configs, results = runs
  assert results["dense"]["step"] == 2
  resumed = str(tmp_path / "other")
  shutil.copytree(root / "dense", resumed)
  config = configs["dense"].copy_and_resolve_references()
  config.mesh.fsdp = 2
  with pytest.raises(ValueError, match="mesh.fsdp: 4 there, 2 now"):
    train.train_and_evaluate(config, resumed)


@pytest.mark.slow  # compiles the islands step twice
def test_a_run_over_its_memory_budget_is_refused_before_it_allocates(tmp_path):
  """The islands config's budget holds a quarter of the state, not all of it: replicated
  (fsdp=1), the run is refused naming the budget, the bytes and the way out."""
  config = _config(tmp_path, lm_islands, method="diloco", fsdp=1)
  config.max_state_bytes_per_device = 20_000  # the smoke model's whole state is more
  with pytest.raises(ValueError, match=r"config.max_state_bytes_per_device=20,000: each device "
                     r"would hold [\d,]+ bytes .* mesh.fsdp=1\); allowed: .* a larger mesh.fsdp"):
    train.train_and_evaluate(config, str(tmp_path / "refused"))
  checkpoints = tmp_path / "refused" / "checkpoints"
  assert not checkpoints.exists() or not os.listdir(checkpoints)


@pytest.mark.parametrize("fields, message", [
    (dict(islands=3), r"config.mesh.islands=3 x config.mesh.fsdp=4 must equal "
                      r"config.num_devices=8"),
    (dict(fsdp=3), r"config.mesh.fsdp=3 must divide config.num_devices=8"),
    (dict(fsdp=1, islands=2), r"config.mesh.islands=2 x config.mesh.fsdp=1 must equal "
                              r"config.num_devices=8"),
    (dict(workers_per_device=2), r"config.workers_per_device=2 with config.mesh.fsdp=4"),
    (dict(equal_bytes=100), r"config.equal_bytes=100 with config.mesh.fsdp=4: the "
                            r"equal-bytes solver prices whole parameters"),
])
def test_islands_refuse_what_they_cannot_run_naming_the_field_in_one_line(tmp_path, fields,
                                                                          message):
  config = _config(tmp_path, fsdp=4)
  config.mesh.islands = fields.get("islands", config.mesh.islands)
  config.mesh.fsdp = fields.get("fsdp", config.mesh.fsdp)
  config.workers_per_device = fields.get("workers_per_device", 1)
  config.optimizer.name = fields.get("optimizer", config.optimizer.name)
  if "equal_bytes" in fields:
    config.equal_bytes = fields["equal_bytes"]
  with pytest.raises(ValueError, match=message) as refused:
    validation.check_workers(config)
  assert "\n" not in str(refused.value)


@pytest.mark.parametrize("optimizer", sorted(TRUST_RATIO_OPTIMIZERS))
def test_islands_take_every_optimizer_lamb_and_lars_included(tmp_path, optimizer):
  """Refused once (a trust ratio read a shard's norm); now their norms are the whole layers'."""
  config = _config(tmp_path, fsdp=4)
  config.optimizer.name = optimizer
  validation.check_workers(config)
  validation.check_config(config, 8)


@pytest.mark.slow  # 41 s on 2 busy CPU cores: the quickstart's compiles on islands
def test_the_quickstart_trains_on_islands_with_tasc_and_lamb(tmp_path):
  """The quickstart (TASC + LAMB) on 2 islands x 4 fsdp devices, its smoke tier: TASC compresses
  each device's shard across the islands (density raised so that the tiny model's shards keep
  a block), LAMB's norms are the whole layers'."""
  config = quickstart.get_config("smoke")
  config.mesh.islands, config.mesh.fsdp = 2, 4
  config.compression.tasc.density = 0.25
  results = train.train_and_evaluate(config, str(tmp_path / "quickstart"))
  assert results["skipped_steps"] == 0 and np.isfinite(results["test_loss"])
  assert 0 < results["bytes_by_axis"]["islands"] < results["dense_bytes"] / 4


@pytest.mark.slow  # a multi-process run (README: the slow marker's)
def test_one_process_per_island_matches_one_process_and_resumes_bit_for_bit(runs, tmp_path):
  """experiments.launch, 2 processes x 4 devices: each process is an island (its devices the
  fsdp shards), DiLoCo int8 across them; the parameters of the one-process run, and a restart
  from step 1's checkpoint ends bit for bit as the uninterrupted run."""
  root, configs, results = runs
  assert results["diloco"]["step"] == 2
  workdir = tmp_path / "two"
  env = dict(os.environ, JAX_DISABLE_MOST_OPTIMIZATIONS="1", XLA_FLAGS="")
  command = [sys.executable, "-m", "experiments.launch", "--num_processes=2", "--",
             "--config=configs/lm_islands.py:smoke=True", f"--workdir={workdir}",
             "--config.compression.diloco.every=1",
             f"--config.data.cache_dir={configs['diloco'].data.cache_dir}"]

  def launch():
    completed = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                               timeout=600)
    assert completed.returncode == 0, completed.stderr[-3000:]
    with open(workdir / train.RESULTS_FILE) as f:
      return json.load(f), checkpoint.load_state(str(workdir))

  results, state = launch()
  # Summed in another order, an int8 payload's entry can round to the next quantum (1e-5 here):
  # a few entries may differ by one, the rest to float32 rounding.
  for a, b in zip(jax.tree.leaves(state["params"]),
                  jax.tree.leaves(checkpoint.load_state(str(root / "diloco"))["params"])):
    np.testing.assert_allclose(a, b, rtol=0, atol=5e-5)
    assert np.mean(np.abs(a - b) > 1e-6) < 0.01
  shutil.rmtree(workdir / "checkpoints" / str(results["step"]))
  _, resumed = launch()
  jax.tree.map(np.testing.assert_array_equal, resumed, state)


@pytest.mark.slow  # a variant: the drift check is tested on devices and Streaming DiLoCo
def test_a_shard_that_drifts_between_islands_stops_the_run_naming_its_copies(tmp_path,
                                                                             monkeypatch):
  """A bit flipped in device 5's shard (island 1, fsdp position 1): the replica check compares
  it with the same shard on island 0 (device 1), not with the other shards of its island."""
  test_failures._wrap_train_steps(  # pylint: disable=protected-access
      monkeypatch, test_failures._drift)  # pylint: disable=protected-access
  config = _config(tmp_path, fsdp=4)
  config.num_steps, config.check_replicas_every = 5, 1
  with pytest.raises(train.ReplicaDriftError,
                     match=rf"replica drift detected at step {test_failures.DRIFT_AFTER_STEP}: "
                           r".* on devices \[5\] \(vs device 1\)"):
    train.train_and_evaluate(config, str(tmp_path / "drift"))
