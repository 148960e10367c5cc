"""DLRM through the runner (configs/dlrm.py): the click task, the synthetic click logs, AUC and
log-loss in results.json."""

import json
import os

import pytest

from experiments import logs
from experiments import train


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
