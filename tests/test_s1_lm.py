"""S1-LM, the scaling grid: its run list (every point's rows, each config valid and on its
equal-bytes tier, the budget within 10 hours of 2 cores) and its report on fabricated runs shaped
as the runner leaves them (``paper_figures/cpu_runs/lm_cpu/*/results.json``'s layout)."""

import csv
import functools
import json
import math
import os

import ml_collections
import numpy as np
import pytest

from compressors import registry
from configs.paper import lm
from configs.paper import s1_lm as sweep_config
from configs.paper import t1_lm as t1_config
from experiments import methods
from experiments import scaling
from experiments import sweep as sweep_lib
from experiments.reproduce import common
from experiments.reproduce import report as report_lib
from experiments.reproduce import s1_lm
from tests import lm_runs

TIER = "cpu"


def test_sizes_follow_the_rule_and_their_parameters_are_the_traced_ones():
  sizes = sweep_config.SIZES[TIER]
  assert len(sizes) >= 4
  params = [s.params for s in sizes.values()]
  assert params == sorted(params) and params[-1] / params[0] >= 16
  for tier, table in sweep_config.SIZES.items():
    for size in table.values():
      config = lm.get_config(f"tier={tier},width={size.width},layers={size.layers},"
                             f"heads={size.heads}")
      assert registry.num_elements(methods.parameter_shapes(config)) == size.params
  for size in sizes.values():  # the CPU tier's rule: depth with width, heads of 16
    assert size.layers == max(1, size.width // 32) and size.width // size.heads == 16
  gpu = list(sweep_config.SIZES["gpu"].values())
  assert gpu[-1].params / gpu[0].params >= 16 and gpu[-1].params < 1.5e8


def test_points_cover_two_budgets_and_two_batches_at_two_sizes():
  points = sweep_config.points(TIER)
  sizes = list(sweep_config.SIZES[TIER])
  assert {p.size for p in points if p.tokens_per_param == 20} == set(sizes)
  assert len({p.size for p in points if p.tokens_per_param == 80}) >= 2
  assert len({p.size for p in points if p.per_worker_batch == 32}) >= 2
  for p in points:  # tokens = steps x 8 workers x batch x 64 tokens, within a step's rounding
    tokens = sweep_config.steps(TIER, p) * 8 * p.per_worker_batch * 64
    assert abs(tokens / (p.tokens_per_param * sweep_config.SIZES[TIER][p.size].params) - 1) < 0.02


def test_the_run_list_is_complete():
  sweep = sweep_config.get_config(f"tier={TIER}")
  names = {r["name"] for r in sweep.runs}
  top = sweep_config.largest(TIER)
  for label in sweep_config.rows(TIER):
    point, row = sweep_config.split_label(label)
    seeds_listed = {name for name in names if name.startswith(label + "_lr")}
    if point.size == top:  # its rates come from the rate law, later
      assert not seeds_listed
      continue
    for scale in t1_config.LR_SCALES:
      assert t1_config.run_name(label, scale, 0) in names
  points = {sweep_config.split_label(label)[0] for label in sweep_config.rows(TIER)}
  assert points == set(sweep_config.points(TIER))
  assert {sweep_config.split_label(label)[1] for label in sweep_config.rows(TIER)} == set(
      sweep_config.ROWS)
  chosen = sweep_config.get_config(f"tier={TIER},tuning=0,chosen=w16_t20_b8_demo@1+"
                                   f"{top}_t20_b8_dense@1.37")
  assert [r["name"] for r in chosen.runs] == [
      "w16_t20_b8_demo_lr1_s0", f"{top}_t20_b8_dense_lr1.37_s0", "w16_t20_b8_demo_lr1_s1",
      "w16_t20_b8_demo_lr1_s2"]  # 3 seeds at the smallest sizes, 1 at the largest


@pytest.mark.parametrize("arg, message", [
    ("tier=tpu", "tier='tpu'"), ("seeds=0", "seeds=0"),
    ("chosen=w16_t20_b8_demo@0", "scale '0'"), ("chosen=nope@1", "'nope' is not a label")])
def test_bad_arguments_are_refused(arg, message):
  with pytest.raises(ValueError, match=message):
    sweep_config.get_config(arg)


def test_every_config_validates_and_meets_its_tier():
  runs = [{"name": label, "config": f"{sweep_config.CONFIG}:" + ",".join(
      f"{k}={v}" for k, v in {**args, "workers": 8}.items())}
          for label, args in sweep_config.rows(TIER).items()]
  sweep = common._absolute_specs(ml_collections.ConfigDict({"runs": runs, "overrides": {}}))
  configs = sweep_lib.run_configs(sweep, one_device_count=False)
  for label, config in configs.items():
    point, row = sweep_config.split_label(label)
    assert config.num_steps == sweep_config.steps(TIER, point)
    assert config.batch_size == point.per_worker_batch * (1 if row == "solo" else 8)
    assert config.model.hidden == sweep_config.SIZES[TIER][point.size].width
    tier = methods.equal_bytes_tier(config)
    if row in sweep_config.REFERENCES or row in sweep_config.FIXED_BYTES:
      continue
    assert tier["on_tier"] == (label not in sweep_config.OFF_TIER), (label, tier)
    if row == "demo":  # 64 where it is on the tier, else the nearer of 64 and 128
      met = {}
      for tile in (64, 128):
        other = config.copy_and_resolve_references()
        other.compression.demo.chunk = tile
        methods.fill_equal_bytes(other)
        met[tile] = abs(math.log(methods.equal_bytes_tier(other)["met_ratio"] / 100))
      best = 64 if met[64] <= math.log(1.1) else min(met, key=met.get)
      assert config.compression.demo.chunk == best, (label, met)


def test_the_budget_fits_ten_hours_of_two_cores():
  rows = sweep_config.budget(TIER)
  assert len(rows) == len(sweep_config.points(TIER))
  assert sum(r["seconds"] for r in rows) / 7200 <= 10.0
  # The estimate grows with the model and the tokens a step.
  small, large = (sweep_config.step_seconds(TIER, sweep_config.points(TIER)[i], "dense")
                  for i in (0, 3))
  assert large > 5 * small


# ------------------------------------------------------------------ fabricated runs


# Each family's retention at size N: 1 - A N^alpha (the fit must find them); dense's and solo's
# losses a power law. "demo" keeps 95% within the range run, "diloco_int8" not within 10x of it.
TRUE_RETENTION = {"diloco_int8": (2.0, -0.2), "streaming_diloco": (3.0, -0.2),
                  "sparseloco": (4.0, -0.2), "demo": (0.5, -0.2), "onebit_adam": (1.0, -0.2)}
NOISE = (0.0, 0.004, -0.004)  # seed s's loss offset


def dense_loss(n):
  return 20.0 * n ** -0.12


def row_loss(row, n):
  solo = dense_loss(n) + 0.5
  if row == "dense":
    return dense_loss(n)
  if row == "solo":
    return solo
  a, alpha = TRUE_RETENTION[row]
  return solo - (1 - a * n ** alpha) * 0.5


@functools.cache
def _solved(label: str) -> str:
  args = {**sweep_config.rows(TIER)[label], "workers": 8}
  config = lm.get_config(",".join(f"{k}={v}" for k, v in args.items()))
  methods.fill_equal_bytes(config)
  return json.dumps(config.to_dict())


# One real run's results.json (paper_figures/cpu_runs/lm_cpu/diloco_int8_100x_lr1_s0), the
# fields a page reads replaced per run below.
REAL_RESULTS = {
    "bytes_by_kind": {"local": 0.0, "sync": 424592.0}, "compression_ratio": 102.07,
    "corpus_bytes": 12118641, "corpus_files": 734, "corpus_sha256": "5764bb67",
    "dense_bytes": 1646848.0, "diverged": False, "divergence": None,
    "equal_bytes": {"met_ratio": 100.85, "note": "", "on_tier": True, "ratio": 100.0,
                    "workers": 8},
    "eval_bytes": 103836, "eval_tokens": 32768, "examples_per_sec": 559.72, "guard_bytes": 7.0,
    "num_params": 235264, "num_workers": 8, "python_version": "3.11.7", "skipped_steps": 0,
    "step": 1000, "test_accuracy": 0.15, "test_bits_per_byte": 2.37, "test_loss": 5.2,
    "tokenizer_sha256": "d92e8bd6", "train_loss": 4.70, "train_tokens": 3557598,
    "wall_seconds": 145.3, "wire_bytes": 16134.5, "workers_per_device": 1}


def fake_run(workdir, label, scale, seed, *, worse=0.0):
  """A finished run of ``label``: its config as the runner solves it, the real layout's
  results with this run's loss, steps and bytes (the ratio asked: 100x, or 1-bit Adam's 5.7x)."""
  point, row = sweep_config.split_label(label)
  config = json.loads(_solved(label))
  config.update(seed=seed)
  n = sweep_config.SIZES[TIER][point.size].params
  loss = row_loss(row, n) + NOISE[seed]
  steps = config["num_steps"]
  ratio = None if row == "solo" else {"dense": 1.0, "onebit_adam": 5.7}.get(row, 100.0)
  records = [{"step": s, "loss": loss + 0.3 + worse, "examples_per_sec": 500.0}
             for s in range(10, steps + 1, 10)] + [{"step": steps, "test_loss": loss}]
  results = dict(REAL_RESULTS, step=steps, test_loss=loss, test_bits_per_byte=loss / 2,
                 num_params=n, compression_ratio=ratio,
                 num_workers=1 if row == "solo" else 8)
  report_lib.write_run(os.path.join(workdir, sweep_config.run_name(label, scale, seed)), config,
                       records, results)


def fake_grid(workdir, points=None):
  """The 20-tokens points of every size (and ``points``): the tuned sizes' three rate scales
  (1 the best), their seeds at 1, the largest's one run at the rate law's scale (1)."""
  chosen = [p for p in sweep_config.points(TIER) if p.tokens_per_param == 20]
  for point in chosen + list(points or []):
    for row in sweep_config.ROWS:
      label = sweep_config.label(point, row)
      if point.size == sweep_config.largest(TIER):
        fake_run(workdir, label, 1.0, 0)
        continue
      for scale in t1_config.LR_SCALES:
        fake_run(workdir, label, scale, 0, worse=0.0 if scale == 1.0 else 0.2)
      for seed in range(1, sweep_config.seeds_of(TIER, point)):
        fake_run(workdir, label, 1.0, seed)


@pytest.fixture(scope="module")
def grid_dir(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("s1") / "s1_lm_cpu")
  extra = [p for p in sweep_config.points(TIER) if p.per_worker_batch == 32][:1]
  fake_grid(workdir, extra)
  return workdir


def test_the_largest_size_takes_its_rates_from_the_rate_law(grid_dir):
  laws = s1_lm.rate_laws(grid_dir, TIER)
  assert set(laws) == {f"{sweep_config.largest(TIER)}_t20_b8_{row}" for row in sweep_config.ROWS}
  for law in laws.values():  # every tuned size chose 1
    assert law.scale == 1.0 and law.sizes == 3 and abs(law.law.alpha) < 1e-9


def test_the_report_holds_every_point_with_retention_tokens_batch_and_outer_steps(grid_dir):
  rows = {r["label"]: r for r in s1_lm.point_rows(grid_dir, TIER)}
  base = rows["w64_t20_b8_diloco_int8"]
  expected = 1 - 2.0 * 235264 ** -0.2
  assert base["retention"] == pytest.approx(expected, abs=1e-3)
  assert base["tokens_per_param"] == 20 and base["per_worker_batch"] == 8
  every = json.loads(_solved("w64_t20_b8_diloco_int8"))["compression"]["diloco"]["every"]
  assert base["outer_steps"] == sweep_config.steps(TIER, sweep_config.points(TIER)[2]) // every
  assert rows["w64_t20_b8_demo"]["outer_steps"] == rows["w64_t20_b8_demo"]["steps"]
  assert rows["w64_t20_b8_solo"]["outer_steps"] == 0
  assert rows["w16_t20_b8_demo"]["n"] == 3 and rows["w64_t20_b8_demo"]["n"] == 1
  assert rows["w128_t20_b8_demo"]["rate"] == "rate law"
  big = rows["w16_t80_b32_diloco_int8"]
  assert big["per_worker_batch"] == 32 and big["tokens_per_param"] == 80
  assert "retention" in big and big["outer_steps"] < base["outer_steps"]
  assert rows["w32_t80_b8_demo"]["n"] == 0 and "retention" not in rows["w32_t80_b8_demo"]
  # Planned where not run: the solved config's H over the point's steps.
  planned = rows["w32_t80_b8_diloco_int8"]
  assert planned["n"] == 0 and planned["outer_steps"] == 1569 // 26 >= 60


def test_the_fits_recover_the_laws_and_predict_the_crossing(grid_dir):
  fits = {f["family"]: f for f in s1_lm.fit_rows(s1_lm.point_rows(grid_dir, TIER))}
  for family, (a, alpha) in TRUE_RETENTION.items():
    assert fits[family]["A"] == pytest.approx(a, rel=0.1), family
    assert fits[family]["alpha"] == pytest.approx(alpha, abs=0.01), family
    assert fits[family]["A_low"] <= fits[family]["A"] <= fits[family]["A_high"]
    assert abs(fits[family]["holdout_residual"]) < 0.01
  assert fits["diloco_int8"]["crossing"] == scaling.NOT_WITHIN
  size = (0.05 / 0.5) ** (1 / -0.2)  # demo's 1 - 0.5 N^-0.2 reaches 0.95 at 1e5
  assert fits["demo"]["crossing_params"] == pytest.approx(size, rel=0.05)
  assert fits["demo"]["crossing_tokens"] == pytest.approx(20 * fits["demo"]["crossing_params"])
  assert "fixed" in fits["onebit_adam"]["note"]
  assert fits["dense"]["loss_alpha"] == pytest.approx(-0.12, abs=0.005)
  assert fits["dense"]["loss_A"] == pytest.approx(20.0, rel=0.1)


def test_the_report_path_writes_the_page_and_the_fits_csv(grid_dir, tmp_path):
  options = common.Options(workdir=os.path.dirname(grid_dir), out=str(tmp_path), tier=TIER,
                           report_only=True)
  page = s1_lm.produce(options)
  written = report_lib.write_report(page, lm_runs.PROV, tmp_path)
  text = (tmp_path / "s1_lm.md").read_text()
  for heading in ("tokens/parameter", "per-worker batch", "outer steps", "retention",
                  "Fitted laws", "Budget"):
    assert heading in text
  assert (tmp_path / "s1_lm.csv") in written
  with open(tmp_path / "s1_lm_fits.csv", encoding="utf-8") as f:
    fits = list(csv.DictReader(f))
  assert [f["family"] for f in fits] == list(sweep_config.ROWS)
  demo = next(f for f in fits if f["family"] == "demo")
  assert math.isclose(float(demo["alpha"]), -0.2, abs_tol=0.01)
  point_rows = s1_lm.point_rows(grid_dir, TIER)
  assert [f["grid"] for f in fits] == [s1_lm.grid_status(point_rows, TIER, 3, f["family"])
                                       for f in fits]
  assert np.isfinite(float(demo["crossing_params"]))
  # Each retention law's bootstrap draws beside it, whose predictions the plan's intervals are.
  with open(tmp_path / "s1_lm_fits_draws.csv", encoding="utf-8") as f:
    draws = list(csv.DictReader(f))
  families = [f["family"] for f in fits if f["alpha"]]
  assert sorted({d["family"] for d in draws}) == sorted(families) and "dense" not in families
  demo_draws = np.array([(float(d["A"]), float(d["alpha"])) for d in draws
                         if d["family"] == "demo"])
  assert len(demo_draws) == 1000 and np.median(demo_draws[:, 1]) == pytest.approx(-0.2, abs=0.01)


def test_the_budget_section_sets_the_measured_hours_beside_the_estimate(grid_dir):
  """Each point's measured hours are its runs' training loops (fake runs log 500 examples a
  second every 10 steps: logged steps x batch / 500 seconds a run)."""
  _, text = s1_lm.budget_section(TIER, grid_dir)
  runs = [report_lib.read_run(os.path.join(grid_dir, name)) for name in os.listdir(grid_dir)]
  point = "w64_t20_b8"
  own = [r for r in runs if os.path.basename(r.path).startswith(point + "_")]
  def seconds(run):
    return run.config["num_steps"] // 10 * 10 * run.config["batch_size"] / 500

  expected = sum(seconds(r) for r in own) / 3600
  line = next(l for l in text.splitlines() if l.startswith(f"| {point} |"))
  cells = [c.strip() for c in line.strip("|").split("|")]
  assert int(cells[5]) == len(own) == 3 * len(sweep_config.ROWS)
  assert float(cells[6]) == pytest.approx(expected, rel=1e-3)
  total = sum(seconds(r) for r in runs) / 3600
  assert f"Measured so far: {total:.1f} hours of the runs in its folder" in text


def test_a_runs_training_seconds_count_the_steps_a_resume_ran_again_once(tmp_path):
  config = {"batch_size": 64}
  records = [{"step": 10, "loss": 1.0, "examples_per_sec": 64.0},   # 10 s
             {"step": 20, "loss": 1.0, "examples_per_sec": 32.0},   # 20 s, then stopped
             {"step": 20, "loss": 1.0, "examples_per_sec": 128.0},  # resumed from 10: 5 s
             {"step": 30, "loss": 1.0, "examples_per_sec": 640.0},  # 1 s
             {"step": 30, "test_loss": 2.0}]
  report_lib.write_run(tmp_path / "run", config, records, {"step": 30})
  assert report_lib.read_run(tmp_path / "run").training_seconds() == pytest.approx(16.0)


@pytest.mark.parametrize("arg, message", [
    ("method=topk,tile=128", "tile=128 with method='topk'"), ("width=-1", "width=-1"),
    ("steps=10,steps_scale=4", "steps=10 with steps_scale=4"),
    ("per_worker_batch=-8", "per_worker_batch=-8"), ("width=30,heads=4", "width=30 with heads=4"),
    ("method=topk,freeze_fraction=0.1", "freeze_fraction=0.1 with method='topk'"),
    ("method=onebit_adam,freeze_fraction=1.5", "freeze_fraction=1.5; allowed: 0 <=")])
def test_the_run_config_refuses_a_bad_shape(arg, message):
  with pytest.raises(ValueError, match=message):
    lm.get_config(arg)


def test_the_run_config_sets_the_shape_steps_and_per_worker_batch():
  config = lm.get_config("width=32,layers=1,heads=2,steps=392,per_worker_batch=32")
  assert (config.model.hidden, config.model.num_layers, config.model.num_heads) == (32, 1, 2)
  assert config.num_steps == 392 and config.batch_size == 32 * 8
  assert config.eval_every == 39 and config.schedule.warmup_steps == 39
  # A short run checkpoints at half; the largest size's (5,194 steps) every 500, as it may span
  # sessions and a killed run resumes from its last checkpoint.
  assert config.checkpoint_every == 196
  assert lm.get_config("width=128,layers=4,heads=8,steps=5194").checkpoint_every == 500
  solo = lm.get_config("solo=true,steps=392,per_worker_batch=32")
  assert solo.batch_size == 32 and solo.num_devices == 1
  assert lm.get_config("method=demo,tile=128").compression.demo.chunk == 128
  assert lm.get_config("").to_dict() == lm.get_config("width=0,steps=0,tile=0").to_dict()


def test_one_bit_adam_s_warm_up_is_the_published_fraction_of_every_point_s_run():
  """Not the compressor's 100 steps, which were 2% of the largest size's run and 55% of the
  smallest's: its bytes and retention then moved with the run's length."""
  table = sweep_config.rows(TIER)
  for point in sweep_config.points(TIER):
    args = table[sweep_config.label(point, "onebit_adam")]
    config = lm.get_config(",".join(f"{k}={v}" for k, v in args.items()))
    steps = sweep_config.steps(TIER, point)
    assert config.compression.onebit_adam.freeze_step == round(0.15 * steps), point
  assert lm.get_config("method=onebit_adam").compression.onebit_adam.freeze_step == 100


def test_the_page_says_what_the_grid_has_still_to_run_and_nothing_once_it_has_finished():
  done = {"label": "w16_t20_b8_dense", "n": 3, "rate": "tuned", "pending_scale": None}
  assert s1_lm.progress_note([done, dict(done, label="w128_t20_b8_dense", n=1)], "cpu", 3) == []
  rows = [done, dict(done, n=0), dict(done, rate="tuned so far (4 to run)", pending_scale=4.0), dict(done, n=1)]
  note, = s1_lm.progress_note(rows, "cpu", 3)
  assert note.startswith("Incomplete: of 4 rows, 1 have no finished run, 1 are still tuning")
  assert "and 1 lack seeds" in note and "--target=s1_lm --tier=cpu" in note
  assert s1_lm.grid_status(rows, "cpu", 3) == (
      "incomplete: of 4 rows, 1 have no run, 1 are still tuning, 1 lack seeds")
  assert s1_lm.grid_status([done], "cpu", 3) == "complete"
  # A family's status counts its own rows and its references', not another family's.
  rows = [dict(done, row="dense"), dict(done, label="w16_t20_b8_solo", row="solo"),
          dict(done, label="w16_t20_b8_demo", row="demo"),
          dict(done, label="w16_t20_b8_onebit_adam", row="onebit_adam", n=0)]
  assert s1_lm.grid_status(rows, "cpu", 3, "demo") == "complete"
  assert s1_lm.grid_status(rows, "cpu", 3, "onebit_adam") == (
      "incomplete: of 3 rows, 1 have no run, 0 are still tuning, 0 lack seeds")
  assert s1_lm.grid_status(rows, "cpu", 3).startswith("incomplete: of 4 rows")
