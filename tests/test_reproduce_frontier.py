"""The language-model evidence against silence: solo's config, retention and its interval, the
frontier's points and crossings (F6-LM), and the horizon (F7-LM)."""

import math

import numpy as np
import pytest
from scipy import stats as scipy_stats

from configs.paper import f6_lm as f6_config
from configs.paper import f7_lm as f7_config
from configs.paper import lm
from configs.paper import t1_lm as t1_config
from experiments import methods
from experiments.reproduce import __main__ as reproduce
from experiments.reproduce import common
from experiments.reproduce import f6_lm
from experiments.reproduce import f7_lm
from experiments.reproduce import report as reproduce_report
from experiments.reproduce import stats
from experiments.reproduce import t1_lm
from tests import lm_runs


# ------------------------------------------------------------------------------- solo, lengths


def test_solo_is_one_worker_on_its_share_of_the_batch_with_the_same_recipe():
  solo, dense = lm.get_config("tier=cpu,solo=True"), lm.get_config("tier=cpu")
  assert solo.num_devices == 1 and dense.num_devices == 8
  assert solo.batch_size == dense.batch_size // 8 == 8
  for field in ("num_steps", "optimizer", "schedule", "model", "data", "eval_every"):
    assert solo[field] == dense[field], field
  methods.fill_equal_bytes(solo)  # dense's request: nothing to solve


def test_a_longer_run_stretches_the_schedule_and_keeps_the_tokens_a_step():
  base, longer = lm.get_config("tier=cpu"), lm.get_config("tier=cpu,steps_scale=16")
  assert longer.num_steps == 16 * base.num_steps == 16_000
  assert longer.schedule.warmup_steps == 16 * base.schedule.warmup_steps
  assert longer.batch_size == base.batch_size and longer.data.seq_len == base.data.seq_len
  assert longer.eval_every == 16 * base.eval_every
  assert longer.checkpoint_every == base.checkpoint_every == 500  # a long run may span sessions


def test_a_local_methods_outer_momentum_is_a_points_own():
  averaging = lm.get_config("tier=cpu,method=diloco,outer_momentum=0.0,ratio=8")
  assert averaging.compression.diloco.outer_momentum == 0.0
  assert lm.get_config("tier=cpu,method=diloco").compression.diloco.outer_momentum == 0.9
  assert f6_config.rows()["diloco_avg_8x"] == dict(method="diloco", outer_momentum=0.0, ratio=8.0)


@pytest.mark.parametrize("arg, message", [
    ("solo=True,method=topk", "solo=True with method='topk'; allowed: method=dense"),
    ("steps_scale=3", "steps_scale=3; allowed: one of (1, 4, 16)"),
])
def test_bad_solo_and_length_arguments_are_refused(arg, message):
  with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
    lm.get_config(f"tier=cpu,{arg}")


def test_t1_lm_tunes_and_seeds_solo_as_it_does_dense(tmp_path):
  assert "solo" in t1_config.tuning_rows("cpu") and t1_config.family("solo") == "solo"
  workdir = str(tmp_path)
  lm_runs.tuned_row(workdir, "dense", chosen=1.0, val_losses=[6, 4.0], wire=1e5)
  lm_runs.tuned_row(workdir, "solo", chosen=2.0, val_losses=[6, 5.0], wire=0.0)
  assert t1_lm.headline_choice(workdir, "cpu") == {"dense": 1.0, "solo": 2.0}


# --------------------------------------------------------------------------------- retention


def test_retention_is_the_share_of_communications_benefit():
  solo, dense = [5.0, 5.2, 5.1], [4.0, 4.1, 3.9]
  assert stats.retention(solo, solo, dense).value == pytest.approx(0.0)
  assert stats.retention(dense, solo, dense).value == pytest.approx(1.0)
  assert stats.retention([4.55], solo, dense).value == pytest.approx(0.5)
  assert stats.retention([5.65], solo, dense).value == pytest.approx(-0.5)  # worse than silence
  assert math.isnan(stats.retention([4.55], solo, dense).half_width)  # one seed: no interval
  assert math.isnan(stats.retention([4.5, 4.6], [4.0, 4.1], [4.0, 4.1]).half_width)  # no benefit
  with pytest.raises(ValueError, match="no solo losses"):
    stats.retention([4.0], [], dense)


def test_retentions_interval_is_the_delta_method_with_welchs_degrees_of_freedom():
  row, solo, dense = [4.5, 4.6, 4.7], [5.0, 5.2, 5.1], [4.0, 4.1, 3.9]
  kept = stats.retention(row, solo, dense)
  r, benefit = kept.value, 5.1 - 4.0
  parts = [np.var(row, ddof=1) / 3, (1 - r) ** 2 * np.var(solo, ddof=1) / 3,
           r ** 2 * np.var(dense, ddof=1) / 3]
  df = sum(parts) ** 2 / sum(p ** 2 / 2 for p in parts)
  expected = scipy_stats.t.ppf(0.975, df) * math.sqrt(sum(parts)) / benefit
  assert kept.half_width == pytest.approx(expected) and kept.seeds == 3
  assert (kept.low, kept.high) == pytest.approx((r - expected, r + expected))


def test_retentions_interval_covers_the_truth_about_95_percent_of_the_time():
  """Simulated experiments of three seeds each (losses' spread as the CPU tier's, 0.05-0.1
  nats): the interval holds the true retention in 92-98.5% of 4,000."""
  rng = np.random.default_rng(0)
  truth, hits, trials = 0.6, 0, 4000
  solo_mean, dense_mean = 4.8, 3.95
  row_mean = solo_mean - truth * (solo_mean - dense_mean)
  for _ in range(trials):
    kept = stats.retention(rng.normal(row_mean, 0.1, 3), rng.normal(solo_mean, 0.05, 3),
                           rng.normal(dense_mean, 0.05, 3))
    hits += kept.low <= truth <= kept.high
  assert 0.92 <= hits / trials <= 0.985


def test_an_interval_of_the_mean_is_students_t():
  assert stats.interval([1.0, 2.0, 3.0]) == pytest.approx(4.302653 * 1.0 / math.sqrt(3))
  assert math.isnan(stats.interval([1.0]))


# ------------------------------------------------------------------------- crossings


def _points(*pairs, width=0.05):
  return [(r, stats.Retention(v, width, 3)) for r, v in pairs]


def test_the_crossing_interpolates_in_log_ratio_between_the_bracketing_points():
  cross = stats.crossing(_points((2, 1.0), (8, 0.95), (32, 0.75), (100, 0.2)))
  # 0.95 -> 0.75 between 8x and 32x: 0.9 is a quarter of the way, in log ratio.
  assert cross.ratio == pytest.approx(math.exp(math.log(8) + 0.25 * math.log(4)))
  assert not cross.beyond_range
  # The interval: the same crossing of the lower ends (0.90 at 8x: exactly 8x) and upper ends.
  assert cross.low == pytest.approx(8.0)
  assert cross.high == pytest.approx(math.exp(math.log(8) + 0.5 * math.log(4)))


def test_a_crossing_beyond_or_below_the_points_says_so():
  beyond = stats.crossing(_points((2, 1.0), (100, 0.97)))
  assert beyond.beyond_range and beyond.ratio == 100
  below = stats.crossing(_points((2, 0.5), (8, 0.3)))
  assert below.ratio is None and below.low is None
  # A point whose interval is unknown leaves the crossing's interval unknown, not guessed.
  lone = stats.crossing([(2, stats.Retention(1.0, math.nan, 1)), (8, stats.Retention(0.5, 0.1, 3))])
  assert lone.ratio == pytest.approx(2 * 4 ** 0.2) and math.isnan(lone.low)
  with pytest.raises(ValueError, match="no points"):
    stats.crossing([])


# --------------------------------------------------------------------------- F6-LM's grid


def test_every_frontier_point_is_t1s_row_where_their_labels_meet():
  t1_rows = t1_config.rows()
  shared = [label for label in f6_config.rows() if label in t1_rows]
  assert {"dense", "solo", "fp16", "onebit_adam", "topk_update_100x", "diloco_1000x", "demo_30x",
          "diloco_int4_1000x"} <= set(shared)
  for label in shared:
    assert f6_config.config_arg(label, 1.0, 0) == t1_config.config_arg(label, "cpu", 1.0, 0, 8)


def test_the_frontier_has_five_ratios_for_most_families_each_met_within_ten_percent():
  """The frontier's ratio solving: every point's budget (or H) is solved onto its ratio by the
  cost model the runner uses (tests/test_equal_bytes.py checks it against the compiled HLO)."""
  counts = {family: len(ratios) for family, (_, ratios) in f6_config.CURVES.items()}
  assert min(counts.values()) >= 4 and sum(n >= 5 for n in counts.values()) >= 4, counts
  for family, (args, ratios) in f6_config.CURVES.items():
    for ratio in ratios:
      config = lm.get_config(f6_config.config_arg(f6_config.label(family, ratio), 1.0, 0))
      _, solution = methods.equal_bytes_settings(config)
      assert solution.feasible and abs(solution.ratio / ratio - 1) <= 0.1, (family, ratio)


def test_the_frontier_grid_tunes_every_point_then_seeds_the_chosen():
  sweep = f6_config.get_config("seeds=3")
  names = [r["name"] for r in sweep.runs]
  points = len(f6_config.rows())
  assert len(names) == len(set(names)) == points * len(t1_config.LR_SCALES)
  assert names[:6] == [f"{ref}_lr{s:g}_s0" for ref in ("dense", "solo") for s in (0.5, 1, 2)]
  seeded = f6_config.get_config("tuning=0,chosen=dense@2+diloco_8x@0.5")
  assert [r["name"] for r in seeded.runs] == [
      "dense_lr2_s0", "diloco_8x_lr0.5_s0", "dense_lr2_s1", "diloco_8x_lr0.5_s1", "dense_lr2_s2",
      "diloco_8x_lr0.5_s2"]
  only = f6_config.get_config("families=demo")
  assert {f6_config.family_of(r["name"].split("_lr")[0]) for r in only.runs} == {
      "dense", "solo", "demo"}
  fixed = f6_config.get_config("families=onebit_adam")
  assert [r["name"] for r in fixed.runs][6:] == [f"onebit_adam_lr{s:g}_s0" for s in (0.5, 1, 2)]


@pytest.mark.parametrize("arg, message", [
    ("families=dgc", "families='dgc': 'dgc'; allowed:"),
    ("tuning=0,chosen=topk_3x@1", "'topk_3x' is not a point"),
    ("tuning=0,chosen=topk_2x@3", "scale '3' of 'topk_2x'; allowed: one of"),
    ("tier=gpu", "tier='gpu'; allowed: cpu"),
])
def test_bad_frontier_arguments_are_refused(arg, message):
  with pytest.raises(ValueError, match=message.replace("(", r"\(")):
    f6_config.get_config(arg)


def test_runs_of_one_and_eight_devices_share_a_sweep_each_in_its_own_process(tmp_path):
  """Solo (1 device) beside dense (8): the sweep trains each run in a process of its own even
  with one job, rather than refuse the mix (experiments.sweep's in-process runs still do)."""
  from experiments import sweep as sweep_lib
  sweep = f6_config.get_config("families=demo,seeds=1")
  sweep.runs = [r for r in sweep.runs if r["name"] in ("dense_lr1_s0", "solo_lr1_s0")]
  with pytest.raises(ValueError, match=r"one num_devices, found \[1, 8\]"):
    sweep_lib.run_configs(sweep)
  assert len(sweep_lib.run_configs(sweep, one_device_count=False)) == 2


# --------------------------------------------------------------------------- F6-LM's page


@pytest.fixture
def frontier_dir(tmp_path):
  """Dense 4.0 / 4.1 / 3.9 and solo 5.0 / 5.1 / 4.9 (benefit 1.0 nat); DiLoCo at 2x 4.05, 8x 4.2
  (3 seeds each; 8x at the rate ladder's bottom end), 30x 4.6; top-k after AdamW at 2x 4.5; 1-bit Adam (fixed bytes, 7.8x) 4.1."""
  workdir = str(tmp_path / "lm_cpu")
  for label, chosen, loss, seeds in [("dense", 1.0, 4.0, 3), ("solo", 2.0, 5.0, 3),
                                     ("diloco_2x", 1.0, 4.05, 3), ("diloco_8x", 0.125, 4.2, 3),
                                     ("diloco_30x", 1.0, 4.6, 1), ("topk_update_2x", 1.0, 4.5, 1),
                                     ("onebit_adam", 1.0, 4.1, 1)]:
    ratio = 7.8 if label == "onebit_adam" else f6_config.ratio_of(label) or 1
    lm_runs.tuned_row(workdir, label, chosen=chosen, val_losses=[6, loss], seeds=seeds,
                      wire=1e5 / ratio)
  return workdir


def test_f6_lm_reports_retention_crossings_and_the_goal(frontier_dir, tmp_path):
  report = f6_lm.report(frontier_dir)
  rows = {r["row"]: r for r in report.rows}
  # tuned_row's seeds lie at +0, +0.2, +0.4: every three-seed mean is its first loss + 0.2.
  assert rows["diloco_2x"]["retention"] == pytest.approx((5.2 - 4.25) / (5.2 - 4.2))
  assert rows["diloco_2x"]["n"] == 3 and rows["diloco_2x"]["ratio"] == pytest.approx(2.0)
  assert rows["diloco_30x"]["n"] == 1 and math.isnan(rows["diloco_30x"]["retention_ci95"])
  # A method of fixed bytes is a family of one point, on its ratio by definition.
  assert rows["onebit_adam"]["family"] == "onebit_adam" and rows["onebit_adam"]["asked"] is None
  assert rows["onebit_adam"]["on_ratio"] and rows["onebit_adam"]["ratio"] == pytest.approx(7.8)
  assert f6_lm.deciding_points(report.rows) == ["onebit_adam", "topk_update_2x", "diloco_2x",
                                                "diloco_8x"]
  [section] = report.sections
  assert "| diloco |" in section[1] and "below 2x (no point keeps 90%)" in section[1]
  assert "| onebit_adam |" in section[1] and "≥ 7.8x (its largest ratio run)" in section[1]
  assert ("No point has finished yet for: topk, diloco_avg, diloco_int8, diloco_int4, "
          "streaming_diloco, demo, sparseloco_h15, sparseloco_tasc_h15, fp16.") in section[1]
  [claim] = report.claims
  assert claim.source == "project goal" and claim.reproduced is None
  assert claim.ours == "no point at ≥ 100x has finished yet"
  # tuned_row's other scales train 0.2 worse: no tie; DiLoCo at 8x chose the ladder's end.
  assert not [n for n in report.notes if n.startswith("Tuning blind")]
  [edge] = [n for n in report.notes if n.startswith("Chosen at an end of the rate ladder")]
  assert "diloco_8x (0.125)" in edge and "solo" not in edge
  written = reproduce_report.write_report(report, lm_runs.PROV, tmp_path / "out")
  assert sorted(p.name for p in written) == ["f6_lm.csv", "f6_lm.md", "f6_lm.png"]
  header = [line for line in (tmp_path / "out" / "f6_lm.csv").read_text().splitlines()
            if not line.startswith("#")][0].split(",")
  assert header[:7] == ["family", "row", "asked", "ratio", "retention", "retention_ci95", "n"]


# --------------------------------------------------------------------------- F7-LM


def test_the_horizon_runs_the_picked_rows_at_each_length_shorter_first():
  sweep = f7_config.get_config("chosen=dense@2+solo@1+diloco_int8_100x@0.5")
  names = [r["name"] for r in sweep.runs]
  assert names == [f"{row}_len{k}_lr{s}_s0" for k in (4, 16)
                   for row, s in (("dense", 2), ("solo", 1), ("diloco_int8_100x", 0.5))]
  assert "steps_scale=16" in sweep.runs[-1]["config"]
  with pytest.raises(ValueError, match="lengths='4\\+8': '8'; allowed: \\(4, 16\\)"):
    f7_config.get_config("lengths=4+8")
  with pytest.raises(ValueError, match="'nope_100x' is not a row"):
    f7_config.get_config("chosen=nope_100x@1")


def test_the_horizon_runs_the_seeded_rows_seeds_at_the_shorter_length_before_the_longer():
  sweep = f7_config.get_config("chosen=dense@2+solo@1+demo_30x@1+diloco_int8_100x@0.5,"
                               "seeded=dense+solo+diloco_int8_100x")
  names = [r["name"] for r in sweep.runs]
  four = [f"{row}_len4_lr{s}_s0" for row, s in
          (("dense", 2), ("solo", 1), ("demo_30x", 1), ("diloco_int8_100x", 0.5))]
  seeds = [f"{row}_len4_lr{s}_s{seed}" for seed in (1, 2)
           for row, s in (("dense", 2), ("solo", 1), ("diloco_int8_100x", 0.5))]
  assert names[:len(four) + len(seeds)] == four + seeds
  assert names[len(four) + len(seeds):] == [n.replace("_len4_", "_len16_") for n in four]
  assert "seed=2" in sweep.runs[len(four) + len(seeds) - 1]["config"]
  with pytest.raises(ValueError, match="seeded='topk_100x': 'topk_100x' is not a row of chosen"):
    f7_config.get_config("chosen=dense@2,seeded=topk_100x")
  with pytest.raises(ValueError, match="seeded_seeds=0; allowed: >= 1"):
    f7_config.get_config("chosen=dense@2,seeded=dense,seeded_seeds=0")


def test_the_horizon_picks_every_familys_100x_point_and_the_two_best_at_30x(tmp_path):
  workdir = str(tmp_path)
  losses = {"dense": 3.0, "solo": 5.0, "diloco_int8_100x": 4.9, "demo_100x": 4.5,
            "topk_100x": 4.7, "demo_30x": 4.2, "diloco_30x": 4.4, "topk_30x": 4.6}
  for row, loss in losses.items():  # each row's tuning chooses scale 1
    for scale in t1_config.LR_SCALES:
      lm_runs.fake_run(workdir, row, 0, scale=scale, val_losses=[6, loss],
                       train_loss=loss + abs(scale - 1.0))
  picked = f7_lm.picked_rows(workdir)
  assert picked == {row: 1.0 for row in ("dense", "solo", "demo_100x", "topk_100x",
                                         "diloco_int8_100x", "demo_30x", "diloco_30x")}
  assert f7_lm.seeded_rows(picked) == ["dense", "solo", "demo_100x", "topk_100x",
                                       "diloco_int8_100x"]


def test_a_tuning_that_cannot_see_the_rate_is_said(tmp_path):
  workdir = str(tmp_path)
  for scale in t1_config.LR_SCALES:  # one synchronisation, after every logged training loss
    lm_runs.fake_run(workdir, "diloco_1000x", 0, scale=scale, val_losses=[6, 5 + scale],
                     train_loss=4.381)
  rows = f6_lm.point_rows(workdir)
  [blind] = f6_lm.tuning_notes(workdir, rows)
  assert blind.startswith("Tuning blind: diloco_1000x tie on the training criterion")


def test_f7_lm_reports_retention_by_length_against_that_lengths_references(tmp_path):
  workdir = str(tmp_path / "lm_cpu")
  for label, loss in [("dense", 4.0), ("solo", 5.0), ("diloco_100x", 4.8),
                      ("dense_len4", 3.5), ("solo_len4", 4.7), ("diloco_100x_len4", 3.8)]:
    # Solo sends nothing: the runner records no compression ratio for it.
    lm_runs.fake_run(workdir, label, 0, scale=1.0, val_losses=[6, loss],
                     wire=0.0 if "solo" in label else 1e5 / (100 if "diloco" in label else 1))
  for row in ("dense", "solo", "diloco_100x"):  # the 1x rows' tuning budget
    for scale in (0.5, 2.0):
      lm_runs.fake_run(workdir, row, 0, scale=scale, val_losses=[6, 9.0], train_loss=9.0)
  # A longer dense run at a scale the tuning no longer chooses: the chosen one's is reported.
  lm_runs.fake_run(workdir, "dense_len4", 0, scale=0.5, val_losses=[6, 3.0], wire=1e5)
  report = f7_lm.report(workdir)
  got = {(r["row"], r["steps"]): r for r in report.rows}
  assert got[("dense", 4000)]["lr_scale"] == 1.0 and len(report.rows) == 6
  assert got[("diloco_100x", 1000)]["retention"] == pytest.approx(0.2)
  assert got[("diloco_100x", 4000)]["retention"] == pytest.approx((4.7 - 3.8) / (4.7 - 3.5))
  assert "steps" in [k for k, _ in report.columns] and got[("solo", 4000)]["ratio"] is None
  written = reproduce_report.write_report(report, lm_runs.PROV, tmp_path / "out")
  assert sorted(p.name for p in written) == ["f7_lm.csv", "f7_lm.md", "f7_lm.png"]


def test_the_frontier_and_horizon_targets_are_registered_for_the_cpu_tier_only():
  assert {"f6_lm", "f7_lm"} <= set(reproduce.TARGETS)
  options = common.Options(tier="gpu", report_only=True, workdir="paper_figures/gpu_runs")
  with pytest.raises(ValueError, match="--tier=gpu: f6_lm, f7_lm have the CPU tier's model only"):
    reproduce.check_inputs(["f6_lm", "f7_lm"], options)


def test_t1_lm_reports_each_rows_retention_and_its_claims_quote_it(tmp_path):
  workdir = str(tmp_path / "lm_cpu")
  for label, loss in [("dense", 4.0), ("solo", 5.0), ("topk_update_100x", 4.6)]:
    lm_runs.tuned_row(workdir, label, chosen=1.0, val_losses=[6, loss], seeds=2,
                      wire=1e5 / (100 if "100x" in label else 1))
  report = t1_lm.report(workdir, tier="cpu", seeds=3)
  rows = {r["method"]: r for r in report.rows}
  # Two seeds each at +0 and +0.2: dense 4.1, solo 5.1, top-k 4.7.
  assert rows["topk_update_100x"]["retention"] == pytest.approx(0.4)
  assert rows["topk_update_100x"]["retention_text"].startswith("0.40 ± ")
  assert ("retention (95% CI)", "retention (95% CI)") in [(h, h) for _, h in report.columns]
  [goal] = [c for c in report.claims if c.claim.startswith("At 100x")]
  assert "; retention 0.40 ± " in goal.ours
