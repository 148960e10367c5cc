"""R1 (configs/paper/r1.py, experiments/reproduce/r1.py): the grid is placements x exchange
precision x hot rows and its configs validate, bad arguments are refused in one line, the
claims' verdicts, the report on fake runs (measured bytes, gaps, the cost model's step), and a
tiny grid trained end to end (slow)."""

import json
import math

import pytest

from configs.paper import r1 as sweep_config
from experiments import sweep as sweep_lib
from experiments.reproduce import __main__ as reproduce
from experiments.reproduce import r1
from experiments.reproduce import report as reproduce_report
from tests import lm_runs

NUM_PARAMS = 285_433  # configs/dlrm.py's model, tables included, as its runs report it


def test_the_grid_is_placements_precisions_and_hot_rows_and_its_configs_validate():
  sweep = sweep_config.get_config()
  names = [run["name"] for run in sweep.runs]
  assert len(names) == len(set(names)) == 3 * len(sweep_config.CELLS) == 33
  assert names[:len(sweep_config.CELLS)] == [f"{c}_s0" for c in sweep_config.CELLS]
  groups = {g: [c for c, (group, _) in sweep_config.CELLS.items() if group == g]
            for g in ("placement", "exchange", "hot rows")}
  assert groups["placement"] == ["replicated", "table", "row", "column", "auto"]
  assert len(groups["exchange"]) == 5 and groups["hot rows"] == ["row_hot_auto"]
  configs = sweep_lib.run_configs(sweep, one_device_count=False)
  sweep_lib.check_runs(configs)  # the runner's checks, before anything trains
  assert configs["row_int4_ef_s2"].embedding.error_feedback and configs["row_int4_ef_s2"].seed == 2
  assert not configs["row_int4_s0"].embedding.error_feedback
  assert configs["row_s0"].embedding.capacity == -1  # buckets from the skew
  assert configs["replicated_s0"].embedding.capacity == 0
  assert "r1" in reproduce.TARGETS and "r1" in reproduce.ANSWERS


@pytest.mark.parametrize("arg, message", [
    ("cells=row+rowwise", r"configs/paper/r1.py: cells='row\+rowwise': 'rowwise'; allowed: "),
    ("seeds=0", r"configs/paper/r1.py: seeds=0; allowed: >= 1"),
])
def test_bad_arguments_are_refused_in_one_line(arg, message):
  with pytest.raises(ValueError, match=message) as raised:
    sweep_config.get_config(arg)
  assert "\n" not in str(raised.value)


def test_an_unknown_target_is_refused_in_one_line():
  with pytest.raises(ValueError, match=r"unknown target 'r2'; allowed: all, .*r1") as raised:
    reproduce.resolve_targets("r1,r2")
  assert "\n" not in str(raised.value)


def _row(cell, aucs, all_to_all=0.0, total=0.0, hot=0):
  mean, half = r1._mean_interval(aucs)
  return {"cell": cell, "aucs": aucs, "auc_mean": mean, "auc_half": half,
          "auc": r1._text(mean, half), "all_to_all": all_to_all, "total_bytes": total,
          "hot_rows": hot}


def test_the_claims_verdicts():
  assert r1.within(0.755, 0.75, 0.01) and not r1.within(0.7601, 0.75, 0.01)
  assert r1.cut(1000.0, 120.0) == pytest.approx(0.88)
  f32 = _row("row", [0.74, 0.75, 0.76], 1000.0, 1100.0)  # interval ± 0.0248
  inside, outside = _row("row_int4_ef", [0.76, 0.77, 0.78]), _row("row_int4_ef", [0.78] * 3)
  without = _row("row_int4", [0.7, 0.7, 0.7])
  assert r1.meta_claim([f32, inside, without]).reproduced is True
  meta = r1.meta_claim([f32, outside, without])
  assert meta.reproduced is False and "+0.0300" in meta.ours
  assert r1.meta_claim([f32, inside]).reproduced is None  # a cell not run yet
  one_seed = r1.meta_claim([_row("row", [0.75], 1000.0), inside, without])
  assert one_seed.reproduced is None and "no interval" in one_seed.verdict
  plain = [_row("table", [0.75] * 2, 900.0, 1000.0), f32, _row("column", [0.75] * 2, 2000.0),
           _row("auto", [0.75] * 2, 1000.0)]
  hot = _row("row_hot_auto", [0.75] * 2, 130.0, 5000.0, hot=3800)
  flexshard, het = r1.cut_claim(plain + [hot], "FlexShard"), r1.cut_claim(plain + [hot], "HET")
  assert flexshard.reproduced is True and "table 900" in flexshard.ours  # 85.6% off table's
  assert het.reproduced is False and "87.0% fewer" in het.ours  # 87% off row's, not 88%
  assert "5,000" in het.ours  # the total bytes with the hot rows' all-reduce
  assert r1.cut_claim(plain[1:] + [hot], "FlexShard").reproduced is None
  assert r1.embark_verdict([0.25, 0.55]) and not r1.embark_verdict([0.25, 0.62])
  assert not r1.embark_verdict([0.6, 0.55])  # falling is not their trend


def _fake_runs(workdir, cells, seeds=2):
  """Finished runs of ``cells`` of the smoke grid: their configs as the runner solves them,
  AUCs around 0.75, and bytes per collective."""
  arg = f"smoke=true,seeds={seeds},cells={'+'.join(cells)}"
  configs = sweep_lib.run_configs(sweep_config.get_config(arg), one_device_count=False)
  for name, config in configs.items():
    cell, seed = name.rsplit("_s", 1)
    results = {"auc": 0.75 + 0.01 * int(seed), "log_loss": 0.5 - 0.01 * int(seed), "step": 2,
               "num_params": NUM_PARAMS, "wire_bytes": 1_998_031.0, "dense_bytes": 1_998_031.0}
    if cell != "replicated":
      hot = 200_000.0 if cell == "row_hot_auto" else 0.0
      results["bytes_by_collective"] = {
          "embedding_forward": 6_000.0 if hot else 33_012.0, "embedding_backward": 5_000.0
          if hot else 29_344.0, "dense_exchange": 42_959.0,
          **({"hot_rows_all_reduce": hot} if hot else {})}
    reproduce_report.write_run(f"{workdir}/{name}", json.loads(json.dumps(config.to_dict())),
                               [{"step": 2, "loss": 0.5}], results)


def test_the_report_on_fake_runs(tmp_path, monkeypatch):
  monkeypatch.setattr(r1, "DEVICES", (8, 16))  # the cost model on 512 devices takes seconds
  workdir = str(tmp_path / "r1")
  _fake_runs(workdir, ["replicated", "row", "row_bf16", "row_int4_ef", "row_int4",
                       "row_hot_auto"])
  report = r1.report(workdir, 2)
  rows = {r["cell"]: r for r in report.rows}
  assert rows["table"]["status"] == "not run yet" and rows["row"]["status"] == "2 seed(s)"
  assert rows["replicated"]["dense_all_reduce"] == 1_998_031.0
  assert rows["replicated"]["embedding_forward"] == 0.0
  assert rows["row"]["all_to_all"] == 33_012.0 + 29_344.0
  assert rows["row_hot_auto"]["total_bytes"] == 6_000.0 + 5_000.0 + 200_000.0 + 42_959.0
  assert rows["row_int4"]["auc_gap_f32"] == pytest.approx(0.0)
  assert rows["row_int4"]["in_f32_interval"] == "yes"
  # The planner's all-to-all bytes on the run's devices, buckets from the skew of the smoke
  # grid's training IDs (the compiled ones equal them: the slow test below).
  assert rows["row"]["predicted_all_to_all"] > 0
  assert rows["row_hot_auto"]["hot_rows"] > 0 and rows["row"]["hot_rows"] == 0
  assert rows["row_int4_ef"]["predicted_all_to_all"] < rows["row"]["predicted_all_to_all"] / 2
  for cell in ("row", "row_hot_auto", "replicated"):
    assert rows[cell]["step_ms_8d_1g"] >= rows[cell]["step_ms_8d_100g"] >= 1e3 * r1.COMPUTE_SECONDS
  # The replicated tables' all-reduce on 16 devices at 1 Gbit/s: a ring's bytes over the
  # bandwidth and 2 (n - 1) latencies of 50 us (hidden behind 0.05 s of compute's backward).
  ring = r1.prediction(r1.modelled_inputs(*_first(workdir, "replicated")), 16, 1.0)
  assert ring.seconds["dense_all_reduce"] == pytest.approx(
      ring.bytes["dense_all_reduce"] / (1e9 / 8) + 2 * 15 * 50e-6, rel=0.02)
  # HET: 11,000 all-to-all bytes against row-wise 62,356 (82% off); FlexShard lacks cells.
  assert [c.reproduced for c in report.claims] == [True, None, False, r1.embark_verdict(
      r1.embark_shares(r1.modelled_inputs(*_first(workdir, "row")))["calibrated"])]
  written = reproduce_report.write_report(report, lm_runs.PROV, tmp_path / "out")
  assert sorted(p.name for p in written) == ["r1.csv", "r1.md", "r1.png"]
  page = (tmp_path / "out" / "r1.md").read_text()
  assert "## Modelled step time" in page and "0.7550 ± 0.0635" in page


def _first(workdir, cell):
  run = r1.runs_of(workdir, cell, 1)[0]
  return run.config, run.results


def test_embark_calibration_gives_their_share_on_eight_devices(tmp_path):
  workdir = str(tmp_path / "r1")
  _fake_runs(workdir, ["row"], seeds=1)
  inputs = r1.modelled_inputs(*_first(workdir, "row"))
  compute = r1.calibrated_compute(inputs, 8, r1.EMBARK_GBIT, 0.25)
  p = r1.prediction(inputs, 8, r1.EMBARK_GBIT, compute)
  assert r1.embedding_share(p) == pytest.approx(0.25, rel=1e-6)
  shares = r1.embark_shares(inputs)
  assert shares["calibrated"][0] == pytest.approx(0.25, rel=1e-6)
  assert shares["stated"][1] > shares["stated"][0]  # more devices, more all-to-all latency


@pytest.mark.slow
def test_a_tiny_grid_trains_and_reports(tmp_path, monkeypatch):
  """Two cells of the smoke grid trained through the target's runner, then its page."""
  monkeypatch.setattr(r1, "DEVICES", (8,))
  workdir = str(tmp_path / "r1")
  r1.run(workdir, "smoke=true,seeds=1,cells=row+row_int4_ef", jobs=1)
  report = r1.report(workdir, 1)
  rows = {r["cell"]: r for r in report.rows}
  for cell in ("row", "row_int4_ef"):
    assert rows[cell]["status"] == "1 seed(s)" and 0.0 < rows[cell]["auc_mean"] < 1.0
    assert rows[cell]["predicted_all_to_all"] == pytest.approx(rows[cell]["all_to_all"],
                                                               rel=0.05)
    assert not math.isnan(rows[cell]["step_ms_8d_10g"])
  assert rows["row_int4_ef"]["all_to_all"] < rows["row"]["all_to_all"] / 2
  assert rows["auto"]["status"] == "not run yet"
  written = reproduce_report.write_report(report, lm_runs.PROV, tmp_path / "out")
  assert (tmp_path / "out" / "r1.md") in written
