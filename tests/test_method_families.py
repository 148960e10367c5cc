"""The methods beyond per-step gradient compression, through the runner as a user runs them:
every new method from the quickstart's smoke config (``--config.method=...``; the language
model's smoke config with them: tests/test_stdlib_lm.py), the optimizer's place, and the density
warm-up's stages each charged their own bytes."""

import json

import jax
import numpy as np
import pytest

from compressors import registry
from configs import quickstart
from experiments import train

pytestmark = pytest.mark.usefixtures("fast_compiles")


def _quickstart(method, steps=4, **fields):
  config = quickstart.get_config("smoke")
  config.update_from_flattened_dict({"method": method, "num_steps": steps, **fields})
  return config


# Settings that make 4 steps run every kind: a synchronisation every 2 steps, 1-bit Adam's
# warm-up over 2.
SHORT = {"diloco": {"compression.diloco.every": 2},
         "sparseloco": {"compression.sparseloco.every": 2},
         "onebit_adam": {"compression.onebit_adam.freeze_step": 2},
         # two fragments, each synchronised once in 4 steps (at 1 and 3), fragment 1 landing at 2
         "streaming_diloco": {"compression.streaming_diloco.every": 4,
                              "compression.streaming_diloco.fragments": 2}}


# The shared checks run each method's steps and kinds, the runner's tests charge a run of two
# step kinds and a local-update run's synchronisations: every method here in the slow suite.
@pytest.mark.slow
@pytest.mark.parametrize("method", ["diloco", "demo", "onebit_adam", "sparseloco", "int8", "int4"])
def test_every_new_method_trains_the_quickstart(method, tmp_path):
  results, state = train.train(_quickstart(method, **SHORT.get(method, {})), str(tmp_path))
  assert results["step"] == 4 and np.isfinite(results["test_loss"]) and not results["diverged"]
  ran = results["bytes_by_kind"]
  family = registry.get(method).family
  if family == "local":
    assert set(ran) == {"local", "sync"} and ran["local"] == 0
    assert results["wire_bytes"] == pytest.approx(ran["sync"] / 2)
    rows = np.asarray(jax.tree.leaves(state.params)[0])
    assert rows.shape[0] == 8 and all(r.tobytes() == rows[0].tobytes() for r in rows)
  elif method == "onebit_adam":
    assert set(ran) == {"warmup", "compressed"} and ran["compressed"] < ran["warmup"] / 10
    assert results["wire_bytes"] == pytest.approx((ran["warmup"] + ran["compressed"]) / 2)
  elif method == "demo":  # an all-gather of every worker's coefficients: no all-reduce
    assert set(ran) == {"step"} and ran["step"] > 0
  else:  # 8 or 4 bits with a float32 scale per 128
    assert results["compression_ratio"] == pytest.approx(32 / 9 if method == "int8" else 32 / 5,
                                                         rel=0.15)


def test_the_optimizer_after_the_exchange_keeps_its_moments_per_worker(tmp_path):
  """``exchanged="update"``: each worker's own LAMB, its update compressed; the parameters stay
  identical, the moments differ between workers, and the bytes are the method's."""
  before = train.train(_quickstart("topk", steps=2), str(tmp_path / "gradient"))[0]
  results, state = train.train(_quickstart("topk", steps=2, **{
      "compression.exchanged": "update"}), str(tmp_path / "update"))
  assert results["wire_bytes"] == before["wire_bytes"]
  leaves = [np.asarray(x) for x in jax.tree.leaves(state.opt_state)
            if np.ndim(x) and x.shape[0] == 8 and x.dtype == np.float32]
  assert any(not all(row.tobytes() == x[0].tobytes() for row in x) for x in leaves)
  with open(tmp_path / "update" / "config.json") as f:
    assert json.load(f)["compression"]["exchanged"] == "update"


@pytest.mark.slow
def test_a_density_warmup_charges_each_stage_its_own_bytes(tmp_path):
  """Top-k at 5% after a 2-stage warm-up from 25% over 2 steps: steps 0 and 1 run the stages,
  2 and 3 the final density; the run is charged each stage's bytes once."""
  results, _ = train.train(_quickstart("topk", **{
      "compression.topk.density": 0.05, "compression.density_warmup_steps": 2,
      "compression.density_warmup_start": 0.25, "compression.density_warmup_stages": 2}),
      str(tmp_path))
  ran = results["bytes_by_kind"]
  assert set(ran) == {"step@0", "step@1", "step"}
  assert ran["step@0"] > ran["step@1"] > ran["step"]
  assert ran["step@0"] / ran["step"] == pytest.approx(5, rel=0.05)  # 25% against 5%
  assert results["wire_bytes"] == pytest.approx(
      (ran["step@0"] + ran["step@1"] + 2 * ran["step"]) / 4)


def test_settings_a_family_refuses_fail_before_compiling(tmp_path):
  with pytest.raises(ValueError, match="exchanged='update' with method 'demo'"):
    train.train(_quickstart("demo", **{"compression.exchanged": "update"}), str(tmp_path))
  with pytest.raises(ValueError, match="density_warmup_steps=10 with method 'powersgd'"):
    train.train(_quickstart("powersgd", **{"compression.density_warmup_steps": 10}),
                str(tmp_path))
  with pytest.raises(ValueError, match="compression.diloco.carrier='zip'"):
    train.train(_quickstart("diloco", **{"compression.diloco.carrier": "zip"}), str(tmp_path))


# A kept run written when a local-update method's carrier was its "exchange" setting.
_KEPT_INT8 = "paper_figures/cpu_runs/lm_cpu/diloco_int8_100x_lr0.5_s0"


def _kept_config() -> dict:
  with open(f"{_KEPT_INT8}/config.json") as f:
    return json.load(f)


def test_a_kept_runs_old_exchange_key_still_loads_as_its_carrier_with_a_notice():
  """``compression.diloco.exchange`` (the carrier's name before it was ``carrier``) in a kept
  run's config.json is read as ``carrier``, with a one-line notice; the pages read it so."""
  import ml_collections  # pylint: disable=import-outside-toplevel
  from experiments import methods  # pylint: disable=import-outside-toplevel
  from experiments.reproduce import t1_lm  # pylint: disable=import-outside-toplevel
  stored = _kept_config()
  assert stored["compression"]["diloco"]["exchange"] == "int8"
  assert "carrier" not in stored["compression"]["diloco"]
  with pytest.warns(FutureWarning, match=r"config.compression.diloco.exchange is now "
                                         r"config.compression.diloco.carrier \(read as "
                                         r"carrier='int8'\)"):
    assert methods.carrier(ml_collections.ConfigDict(stored)) == "int8"
  with pytest.warns(FutureWarning):
    assert methods.exchange_settings(ml_collections.ConfigDict(stored)) == registry.get(
        "int8").settings(**stored["compression"]["int8"])
    assert ", int8 " in t1_lm.settings_text(stored)


def test_a_kept_run_resumes_under_the_renamed_key_and_a_changed_carrier_is_refused(tmp_path):
  """The resume check compares a stored config after renaming its old keys: the same run
  written now (``carrier``) matches its kept config.json (``exchange``); another carrier is
  named as the difference."""
  from configs import common  # pylint: disable=import-outside-toplevel
  from experiments import validation  # pylint: disable=import-outside-toplevel
  import ml_collections  # pylint: disable=import-outside-toplevel
  stored = _kept_config()
  (tmp_path / validation.CONFIG_FILE).write_text(json.dumps(stored))
  with pytest.warns(FutureWarning):
    now = common.upgraded(stored)
  now.pop("provenance", None)
  assert now["compression"]["diloco"]["carrier"] == "int8"
  with pytest.warns(FutureWarning):
    validation.check_resume(ml_collections.ConfigDict(now), str(tmp_path), 100)
  now["compression"]["diloco"]["carrier"] = "int4"
  with pytest.warns(FutureWarning), pytest.raises(
      ValueError, match=r"compression.diloco.carrier: 'int8' there, 'int4' now"):
    validation.check_resume(ml_collections.ConfigDict(now), str(tmp_path), 100)


def test_the_paper_configs_old_exchange_argument_still_reads_as_the_carrier():
  from configs.paper import lm  # pylint: disable=import-outside-toplevel
  with pytest.warns(FutureWarning, match="exchange=int8 is now carrier=int8"):
    old = lm.get_config("method=diloco,exchange=int8")
  new = lm.get_config("method=diloco,carrier=int8")
  assert old.to_dict() == new.to_dict() and new.compression.diloco.carrier == "int8"
