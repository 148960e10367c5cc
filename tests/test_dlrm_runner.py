"""DLRM through the runner (configs/dlrm.py): the click task, the synthetic click logs, AUC and
log-loss in results.json; tables placed across the devices (config.embedding) train as
replicated ones do, and the compiled exchange sends the formula's bytes."""

import json
import os
import shutil

import jax
import numpy as np
import pytest

from compressors.parallel import embeddings
from experiments import checkpoint
from experiments import logs
from experiments import train
from experiments.data import criteo


def _config(arg, cache_dir, **fields):
  config = __import__("configs.dlrm", fromlist=["get_config"]).get_config(arg)
  config.data.cache_dir = str(cache_dir)
  config.update_from_flattened_dict(fields)
  return config


@pytest.mark.slow  # about 16 s on 2 cores: data, initialisation, the step and the bytes compiled
@pytest.mark.usefixtures("fast_compiles")
def test_the_smoke_run_reports_auc_and_log_loss(tmp_path):
  results = train.train_and_evaluate(_config("smoke", tmp_path / "cache"), str(tmp_path / "run"))
  with open(os.path.join(tmp_path, "run", train.RESULTS_FILE)) as f:
    assert json.load(f)["auc"] == results["auc"]
  assert 0.0 <= results["auc"] <= 1.0
  # The whole set's log-loss is the evaluation's summed binary cross-entropy.
  assert results["log_loss"] == pytest.approx(results["test_loss"], rel=1e-5)
  assert results["data_sha256"]
  assert logs.summary(results).startswith(f"test AUC {results['auc']:.4f}, test accuracy ")


@pytest.mark.slow
def test_learned_embeddings_rank_clicks_well_above_frozen_ones(tmp_path):
  """The config's run (64 steps, about 25 s each on 2 cores): AUC 0.752 learned, 0.628 with
  the tables frozen at their initial values (configs/dlrm.py's Expected)."""
  learned = train.train_and_evaluate(_config(None, tmp_path / "cache"), str(tmp_path / "a"))
  frozen = train.train_and_evaluate(_config("frozen=true", tmp_path / "cache"),
                                    str(tmp_path / "b"))
  assert learned["auc"] == pytest.approx(0.752, abs=0.01)
  assert frozen["auc"] == pytest.approx(0.628, abs=0.01)
  assert learned["log_loss"] < frozen["log_loss"] - 0.03


def _placed_config(placement, cache_dir, overrides=""):
  """20 steps of a small DLRM (tables capped at 50 rows: most not divisible by the 8 devices),
  logged every step."""
  config = _config("smoke", cache_dir)
  config.data.update(dict(max_rows=50, num_train=512, num_eval=256))
  config.update_from_flattened_dict({"batch_size": 64, "eval_batch_size": 256, "num_steps": 20,
                                     "checkpoint_every": 0, "embedding.placement": placement,
                                     "embedding.overrides": overrides})
  return config


CAPACITY = 96  # keys per owner of a device: those of the 20 steps fit (64 do not)


def _losses(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [row["loss"] for row in map(json.loads, f) if "loss" in row]


@pytest.fixture(scope="module")
def replicated_run(tmp_path_factory):
  path = tmp_path_factory.mktemp("dlrm")
  results = train.train_and_evaluate(_placed_config("replicated", path / "cache"),
                                     str(path / "run"))
  return path, results, _losses(path / "run")


@pytest.mark.slow  # about 15 s a placement on 2 cores (the step, its bytes and the evaluation)
@pytest.mark.usefixtures("fast_compiles")
@pytest.mark.parametrize("placement,overrides", [
    ("row", ""), ("table", ""), ("column", ""), ("row", "0:replicated,3:table,5:column")])
def test_each_placement_through_the_runner_gives_the_replicated_trajectory(
    replicated_run, tmp_path, placement, overrides):
  path, replicated, expected = replicated_run
  config = _placed_config(placement, path / "cache", overrides)
  results = train.train_and_evaluate(config, str(tmp_path / "run"))
  losses = _losses(tmp_path / "run")
  assert len(losses) == 20 and expected[-1] < expected[0] - 0.05  # it learns
  np.testing.assert_allclose(losses, expected, rtol=1e-5, atol=1e-6)
  assert results["auc"] == pytest.approx(replicated["auc"], abs=1e-4)
  # Its checkpoint loads as the replicated model's parameters: every table whole.
  placed, whole = (checkpoint.load_params(str(d / "run")) for d in (tmp_path, path))
  assert placed.keys() == whole.keys()
  for key in whole:
    for a, b in zip(jax.tree.leaves(placed[key]), jax.tree.leaves(whole[key])):
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
  # The compiled program's exchange is the formula's, forward and backward.
  with open(os.path.join(tmp_path, "run", checkpoint.EMBEDDING_LAYOUT_FILE)) as f:
    layout = json.load(f)
  plan = embeddings.Plan(**{k: tuple(v) if isinstance(v, list) else v for k, v in layout.items()})
  assert plan.placements[0] == ("replicated" if overrides else placement)
  _, hotness = criteo.table_shapes(config.data)
  predicted = embeddings.exchange_bytes(plan, config.batch_size // 8, hotness)
  sent = results["bytes_by_collective"]
  assert sent["embedding_forward"] == pytest.approx(predicted["forward"], rel=1e-9)
  assert sent["embedding_backward"] == pytest.approx(predicted["backward"], rel=1e-9)
  # The rest of the step is the dense all-reduce of the tower (and the replicated tables).
  assert results["num_params"] == replicated["num_params"]  # rows move, none are added
  placed = sum(r for r, p in zip(plan.rows, plan.placements) if p != "replicated") * plan.width
  dense = (results["num_params"] - placed) * 4 * 2 * 7 / 8
  assert sent["dense_exchange"] == pytest.approx(dense, rel=0.01)


@pytest.mark.parametrize("field,value,message", [
    ("embedding.overrides", "26:row", "config.embedding.overrides names table 26; allowed: "
                                      "tables 0 .. 25"),
    ("embedding.placement", "rows", "config.embedding.placement='rows' is not allowed; allowed: "
                                    r"\['replicated', 'table', 'row', 'column', 'auto'\]"),
    ("embedding.optimizer", "adagrad", "config.embedding.optimizer='adagrad' is not allowed"),
    ("mesh.fsdp", 2, r"with config.mesh.fsdp=2; allowed: no islands, a per-step method"),
    ("method", "diloco", "with config.method='diloco' .local updates.; allowed")])
def test_a_bad_placement_is_refused_in_one_line(tmp_path, field, value, message):
  config = _config("smoke", tmp_path / "cache", **{field: value})
  config.data.update(dict(max_rows=50, num_train=512, num_eval=256))
  if field != "embedding.placement":
    config.embedding.placement = "row"
  with pytest.raises(ValueError, match=message):
    train.train_and_evaluate(config, str(tmp_path / "run"))


@pytest.mark.slow  # about 40 s on 2 cores: two runs, the second resumed
@pytest.mark.usefixtures("fast_compiles")
def test_top_k_on_the_tower_rowwise_adagrad_on_the_tables_and_a_resumed_run(replicated_run,
                                                                           tmp_path):
  """The dense part runs a registered method (top-k with error feedback), the row-placed tables
  MLPerf's row-wise Adagrad; a run resumed from its step-3 checkpoint ends as the whole run."""
  path = replicated_run[0]
  config = _placed_config("row", path / "cache")
  config.update_from_flattened_dict({"num_steps": 6, "checkpoint_every": 3, "method": "topk",
                                     "compression.density": 0.1,
                                     "embedding.optimizer": "rowwise_adagrad",
                                     "embedding.learning_rate": 0.05})
  whole = train.train_and_evaluate(config, str(tmp_path / "run"))
  sent = whole["bytes_by_collective"]
  assert 0 < sent["dense_exchange"] < 0.2 * sent["embedding_backward"]  # top-k's all-gather
  shutil.rmtree(tmp_path / "run" / "checkpoints" / "6")
  resumed = train.train_and_evaluate(config, str(tmp_path / "run"))
  assert resumed["auc"] == whole["auc"] and resumed["test_loss"] == whole["test_loss"]


@pytest.mark.slow  # about 30 s on 2 cores: two runs
@pytest.mark.usefixtures("fast_compiles")
def test_a_capacity_sends_fewer_bytes_and_an_overflow_is_refused_in_one_line(replicated_run,
                                                                            tmp_path):
  path, _, expected = replicated_run
  config = _placed_config("row", path / "cache")
  config.embedding.capacity = CAPACITY
  results = train.train_and_evaluate(config, str(tmp_path / "fits"))
  np.testing.assert_allclose(_losses(tmp_path / "fits"), expected, rtol=1e-5, atol=1e-6)
  rows, hotness = criteo.table_shapes(config.data)
  plan = embeddings.plan(rows, config.model.embedding_dim, "row", 8)
  predicted = embeddings.exchange_bytes(plan, config.batch_size // 8, hotness, CAPACITY)
  sent = results["bytes_by_collective"]
  assert sent["embedding_forward"] == pytest.approx(predicted["forward"], rel=1e-9)
  assert sent["embedding_backward"] == pytest.approx(predicted["backward"], rel=1e-9)
  config.embedding.capacity = 2
  with pytest.raises(ValueError, match=r"training step 1: \d+ de-duplicated IDs did not fit the "
                                       "all-to-all's capacity"):
    train.train_and_evaluate(config, str(tmp_path / "overflows"))


def _simulated_config(cache_dir, num_devices, workers_per_device, **fields):
  """4 steps of :func:`_placed_config`'s DLRM on 8 workers (``num_devices x
  workers_per_device``): tables by rows, one by table, one by columns, hot rows."""
  config = _placed_config("row", cache_dir, "3:table,5:column")
  config.update_from_flattened_dict({"num_steps": 4, "num_devices": num_devices,
                                     "workers_per_device": workers_per_device,
                                     "embedding.hot_rows": "4", **fields})
  return config


@pytest.mark.slow  # about 4 min on 2 cores: three runs, each with its planner, step and bytes
@pytest.mark.usefixtures("fast_compiles")
def test_simulated_workers_train_placed_tables_and_send_as_eight_devices(tmp_path):
  """8 workers as 4 devices x 2 simulated workers, the rows' all-to-alls in int4 with error
  feedback and the hot rows' gradient exchanged by top-k: the losses of 8 devices to float
  rounding, the same bytes per collective (read from the program of 8 devices), and a run
  resumed from its step-2 checkpoint ends as the whole run."""
  codecs = {"embedding.exchange": "int4", "embedding.gradient_exchange": "int4",
            "embedding.hot_exchange": "topk", "checkpoint_every": 2}
  devices = train.train_and_evaluate(_simulated_config(tmp_path / "cache", 8, 1, **codecs),
                                     str(tmp_path / "devices"))
  config = _simulated_config(tmp_path / "cache", 4, 2, **codecs)
  simulated = train.train_and_evaluate(config, str(tmp_path / "simulated"))
  expected = _losses(tmp_path / "devices")
  assert expected[-1] < expected[0] - 0.05  # it learns: the comparison is not of constants
  np.testing.assert_allclose(_losses(tmp_path / "simulated"), expected, rtol=1e-5)
  assert simulated["workers_per_device"] == 2 and simulated["num_workers"] == 8
  assert simulated["bytes_by_collective"] == devices["bytes_by_collective"]
  assert set(simulated["bytes_by_collective"]) == {"embedding_forward", "embedding_backward",
                                                   "hot_rows_all_reduce", "dense_exchange"}
  assert simulated["auc"] == pytest.approx(devices["auc"], abs=1e-4)
  # The error-feedback residuals and the hot rows' top-k memory are checkpointed per worker.
  shutil.rmtree(tmp_path / "simulated" / "checkpoints" / "4")
  resumed = train.train_and_evaluate(config, str(tmp_path / "simulated"))
  assert resumed["auc"] == simulated["auc"]
  assert resumed["test_loss"] == simulated["test_loss"]


@pytest.mark.slow  # about 40 s on 2 cores
@pytest.mark.usefixtures("fast_compiles")
def test_simulated_workers_overflow_is_refused_in_one_line(tmp_path):
  config = _simulated_config(tmp_path / "cache", 4, 2, **{"embedding.capacity": 2})
  with pytest.raises(ValueError, match=r"^training step 1: \d+ de-duplicated IDs did not fit "
                                       "the all-to-all's capacity"):
    train.train_and_evaluate(config, str(tmp_path / "run"))
