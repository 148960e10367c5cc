"""The language-model targets of the reproduction: their sweep configs (the CPU tier's grid with
its tuning budget, the GPU tier built) and T1-LM's table, tuning choice, total-bytes accounting and
claims from fake run directories (nothing is trained or compiled here; F4-LM's and F5's reports:
tests/test_reproduce_f4_lm.py, tests/test_reproduce_f5.py)."""

import json
import math
import os

import numpy as np
import pytest

from compressors import equal_bytes
from compressors import registry
from compressors.network import topology as topo
from configs.paper import lm
from configs.paper import t1_lm as sweep_config
from experiments import methods
from experiments import provenance
from experiments.reproduce import __main__ as reproduce
from experiments.reproduce import common
from experiments.reproduce import report as reproduce_report
from experiments.reproduce import t1_lm
from tests import lm_runs


# ----------------------------------------------------------------------------- configs


def _runs(arg: str) -> dict[str, str]:
  return {r["name"]: r["config"].split(":", 1)[1] for r in sweep_config.get_config(arg).runs}


def test_the_cpu_grid_tunes_every_row_over_the_same_rate_scales():
  runs = _runs("tier=cpu,subset=t1")
  rows = list(sweep_config.FIXED) + [f"{stem}_{tier}" for tier, stems
                                     in sweep_config.CPU_ROWS.items() for stem in stems]
  assert set(runs) == {sweep_config.run_name(label, scale, 0) for label in rows
                       for scale in (0.5, 1.0, 2.0)}
  assert len(runs) == 66
  configs = {name: lm.get_config(arg) for name, arg in runs.items()}
  # One recipe: the same schedule, batch, length and inner AdamW for every run, its peak rate
  # scaled by the tuning knob unless the knob is a local-update method's outer rate; solo
  # trains on one worker's share of the batch.
  recipes = {(c.schedule.to_json(), c.num_steps, c.batch_size // c.num_devices, c.data.seq_len,
              c.model.hidden) for c in configs.values()}
  assert recipes == {(configs["dense_lr1_s0"].schedule.to_json(), 1000, 8, 64, 64)}
  for name, c in configs.items():
    scale = float(name.split("_lr")[1].split("_")[0])
    if c.method in ("diloco", "sparseloco", "streaming_diloco"):
      default = registry.get(c.method).settings().outer_learning_rate
      assert c.optimizer.learning_rate == 3e-3, name
      assert c.compression[c.method].outer_learning_rate == pytest.approx(default * scale), name
    else:
      assert c.optimizer.learning_rate == pytest.approx(3e-3 * scale), name
  assert {c.method for c in configs.values()} == {"dense", "fp16", "onebit_adam", "topk", "dgc",
                                                  "tasc", "diloco", "sparseloco", "demo",
                                                  "streaming_diloco"}
  # Every T1-LM row but PowerSGD (no rank meets 100x on the CPU tier's model) runs at 100x.
  assert {label.rsplit("_", 1)[0] for label in rows if label.endswith("_100x")} == (
      set(sweep_config.TIERED) - {"sparseloco_tasc", "powersgd"})
  assert configs["sparseloco_tasc_1000x_lr1_s0"].compression.sparseloco.carrier == "tasc"
  assert configs["topk_update_100x_lr1_s0"].compression.exchanged == "update"
  assert configs["diloco_tasc_1000x_lr1_s0"].compression.diloco.carrier == "tasc"


def test_the_chosen_rows_get_their_other_seeds_once():
  tuning = _runs("tier=cpu,subset=t1")
  chosen = _runs("tier=cpu,subset=t1,chosen=dense@1+sparseloco_1000x@2")
  assert set(chosen) - set(tuning) == {"dense_lr1_s1", "dense_lr1_s2", "sparseloco_1000x_lr2_s1",
                                       "sparseloco_1000x_lr2_s2"}
  assert list(chosen)[:66] == list(tuning)  # seed-major: every first seed before any second
  with pytest.raises(ValueError, match="'topk_7x' is not a row"):
    sweep_config.get_config("chosen=topk_7x@1")
  with pytest.raises(ValueError, match=r"scale '3' of 'dense'; allowed: one of \(0.125, 0.25, "
                                       r"0.5, 1.0, 2.0, 4.0, 8.0\)"):
    sweep_config.get_config("chosen=dense@3")


def test_f4_lm_varies_tasc_on_the_pseudo_gradient():
  runs = _runs("tier=cpu,subset=f4")
  labels = {name.rsplit("_lr", 1)[0] for name in runs}
  assert labels == {"sparseloco_tasc_1000x", "sparseloco_tasc_1000x_saliency_b256_previous"} | {
      f"sparseloco_tasc_1000x_{score}_b{block}_global"
      for score in ("magnitude", "saliency", "newton", "fisher") for block in (64, 256, 1024)
      if (score, block) != ("saliency", 256)}
  three = {name.rsplit("_lr", 1)[0] for name in runs if name.endswith("_s2")}
  # The default (saliency, block 256, this round's support) is T1-LM's row, with the others'
  # seeds at block 256.
  assert three == {"sparseloco_tasc_1000x"} | {f"sparseloco_tasc_1000x_{s}_b256_global"
                                               for s in ("magnitude", "newton", "fisher")}
  assert lm.get_config(runs["sparseloco_tasc_1000x_lr1_s0"]).compression.tasc.block_size == 256
  c = lm.get_config(runs["sparseloco_tasc_1000x_fisher_b64_global_lr1_s0"])
  assert (c.method, c.compression.sparseloco.carrier, c.compression.sparseloco.every) == (
      "sparseloco", "tasc", 30)
  assert (c.compression.tasc.sensitivity, c.compression.tasc.block_size) == ("fisher", 64)


def test_each_budgeted_method_is_solved_onto_its_tier():
  shapes = methods.parameter_shapes(lm.get_config("tier=cpu"))
  dense = equal_bytes.method_bytes("dense", shapes, 8)
  for method in ("topk", "randomk", "dgc", "tasc"):
    c = _solved(f"method={method},ratio=30")
    settings = registry.default_settings(method, **c.compression[method].to_dict())
    sent = equal_bytes.method_bytes(method, shapes, 8, settings)
    assert dense / sent == pytest.approx(30, rel=0.1), method
    again = c.compression[method].to_dict()
    methods.fill_equal_bytes(c)
    assert c.compression[method].to_dict() == again, f"{method}: solving twice changed it"
  assert _solved("method=tasc").compression.tasc.block_size == 256  # the solver's
  assert _solved("method=tasc,block=1024").compression.tasc.block_size == 1024
  assert lm.get_config("method=topk").compression.error_feedback is True


@pytest.mark.parametrize("label, exchange", [("diloco_int4_1000x", "int4"),
                                             ("diloco_100x", "dense"),
                                             ("sparseloco_1000x", "chunk_topk")])
def test_local_rows_meet_their_tier_on_total_bytes(label, exchange):
  """A local-update row's synchronisations, each sending its exchange's bytes, average over its
  steps to dense's bytes over the tier."""
  c = _solved(sweep_config.config_arg(label, "cpu", 1.0, 0, 8))
  shapes = methods.parameter_shapes(c)
  every = c.compression[c.method].every
  own = registry.default_settings(exchange, **c.compression[exchange].to_dict())
  per_step = equal_bytes.method_bytes(exchange, shapes, 8, own) / every
  ratio = equal_bytes.TIERS[sweep_config.tier_of(label)]
  assert equal_bytes.method_bytes("dense", shapes, 8) / per_step == pytest.approx(ratio, rel=0.1)
  assert every == {"diloco_int4_1000x": 133, "diloco_100x": 100, "sparseloco_1000x": 30}[label]


def test_block_16_leaves_the_pseudo_gradient_nothing():
  """F4-LM skips :data:`UNMET_BLOCKS`: at block 16 TASC's scores alone take the round's bytes (it
  would send under one block), on either tier's model; every other block size sends blocks."""
  for tier in ("cpu", "gpu"):
    shapes = methods.parameter_shapes(lm.get_config(f"tier={tier}"))
    elements = registry.num_elements(shapes)
    for block in sweep_config.BLOCK_SIZES:
      c = _solved(f"tier={tier},method=diloco,carrier=tasc,every=30,ratio=1000,block={block}")
      blocks_sent = c.compression.tasc.density * elements / block
      assert (blocks_sent < 1) == (block in sweep_config.UNMET_BLOCKS), (tier, block)


def test_the_gpu_tier_fits_a_short_lease():
  """The GPU tier cannot run here (no GPU); its configs must build, its model be >= 25M, and its
  grid be dense, solo and the CPU tier's best three at 100x and two at 1000x, one seed, 8
  workers, 1,000 steps."""
  assert registry.num_elements(methods.parameter_shapes(lm.get_config("tier=gpu"))) >= 25_000_000
  c = lm.get_config("tier=gpu,method=tasc,workers=32")
  assert (c.num_devices, c.batch_size, c.data.seq_len, c.model.hidden, c.num_steps) == (
      32, 64, 256, 512, 1000)
  assert c.model.compute_dtype == "bfloat16"
  runs = _runs("tier=gpu")
  assert set(runs) == {"dense_lr1_s0", "solo_lr1_s0"} | {sweep_config.run_name(label, scale, 0)
                                          for label, scale in sweep_config.GPU_ROWS.items()}
  # The best three at 100x, then the best and TASC's best at 1000x (the headline tiers).
  assert [sweep_config.tier_of(label) for label in sweep_config.GPU_ROWS] == [
      "100x", "100x", "100x", "1000x", "1000x"]
  assert all(scale in sweep_config.LR_SCALES for scale in sweep_config.GPU_ROWS.values())
  assert {n.split("_w")[-1] for n in _runs("tier=full,seeds=1") if "_w" in n} == {"32"}


@pytest.mark.parametrize("arg, message", [
    ("tier=tpu", "tier='tpu'; allowed: \\['cpu', 'gpu'\\]"),
    ("ratio=1", "ratio=1.0; allowed: > 1"),
    ("lr_scale=0", "lr_scale=0.0; allowed: > 0"),
    ("workers=1", "workers=1; allowed: >= 2")])
def test_bad_lm_arguments_are_refused(arg, message):
  with pytest.raises(ValueError, match=message):
    lm.get_config(arg)


def test_bad_sweep_arguments_are_refused():
  with pytest.raises(ValueError, match="subset='t3'; allowed: t1, f4, all"):
    sweep_config.get_config("subset=t3")
  with pytest.raises(ValueError, match="seeds=0; allowed: >= 1"):
    sweep_config.get_config("seeds=0")
  with pytest.raises(ValueError, match=r"tier='tpu'; allowed: \['cpu', 'full', 'gpu'\]"):
    sweep_config.get_config("tier=tpu")


def test_the_targets_are_registered_with_a_tier_flag():
  names, options = reproduce.parse_args(["--target=t1_lm,f4_lm,f5", "--tier=gpu"])
  assert names == ["t1_lm", "f4_lm", "f5"] and options.tier == "gpu"
  assert common.Options().tier == "cpu"
  order = list(reproduce.TARGETS)
  assert order.index("f5") > order.index("t1_lm")


def _solved(arg: str):
  """``configs/paper/lm.py:arg`` as the runner trains it: its equal-bytes request solved."""
  config = lm.get_config(arg)
  methods.fill_equal_bytes(config)
  return config


# ----------------------------------------------------------------------------- fake runs


@pytest.fixture
def lm_dir(tmp_path):
  """Dense 4.0 / 4.2 (2 seeds, chosen scale 1); top-k after AdamW at 100x 4.05 / 4.25 (scale 2,
  2 seeds); per-step TASC at 100x 4.5 (one seed); SparseLoCo at 1000x 4.3 / 4.5 (scale 0.5);
  DiLoCo with TASC at 1000x 4.6 (one seed)."""
  workdir = str(tmp_path / "lm_cpu")
  lm_runs.tuned_row(workdir, "dense", chosen=1.0, val_losses=[6, 5, 4.5, 4.0], seeds=2,
                    wire=1e5)
  lm_runs.tuned_row(workdir, "topk_update_100x", chosen=2.0, val_losses=[6, 5, 4.3, 4.05],
                    seeds=2, wire=1e3)
  lm_runs.tuned_row(workdir, "tasc_100x", chosen=1.0, val_losses=[6, 5, 4.6, 4.5], wire=1e3)
  lm_runs.tuned_row(workdir, "sparseloco_1000x", chosen=0.5, val_losses=[6, 5, 4.5, 4.3],
                    seeds=2, wire=100)
  lm_runs.tuned_row(workdir, "diloco_tasc_1000x", chosen=1.0, val_losses=[6, 5, 4.7, 4.6],
                    wire=100)
  return workdir


def test_the_rate_scale_is_chosen_on_training_loss_never_validation(tmp_path):
  workdir = str(tmp_path)
  # Scale 2 trains to the lowest loss but validates worst: it is the one kept.
  for scale, train, val in [(0.5, 4.5, 4.0), (1.0, 4.4, 4.1), (2.0, 4.3, 4.9), (4.0, 4.35, 3.0)]:
    lm_runs.fake_run(workdir, "demo_100x", 0, scale=scale, val_losses=[5, val], train_loss=train)
  assert t1_lm.tuning(workdir, "demo_100x") == pytest.approx(
      {0.5: 4.5, 1.0: 4.4, 2.0: 4.3, 4.0: 4.35})
  assert t1_lm.chosen_scale(workdir, "demo_100x") == 2.0
  [row] = t1_lm.rows_for(workdir, ["demo_100x"], seeds=3)
  assert row["loss_mean"] == pytest.approx(4.9) and row["lr_scale"] == 2.0
  assert row["tuning"] == "0.5: 4.500 / 1: 4.400 / 2: 4.300 * / 4: 4.350"
  # A budget not yet spent chooses nothing, and says so.
  lm_runs.fake_run(workdir, "demo_1000x", 0, scale=0.5, val_losses=[5, 4.0])
  assert t1_lm.chosen_scale(workdir, "demo_1000x") is None
  [row] = t1_lm.rows_for(workdir, ["demo_1000x"], seeds=3)
  assert row["seeds"] == 0 and row["status"] == "tuning: 1 of 3 rate scales finished"


def test_rows_state_the_scale_their_retention_holds_at(tmp_path):
  workdir = str(tmp_path)
  lm_runs.tuned_row(workdir, "dense", chosen=1.0, val_losses=[5, 4.0])
  lm_runs.tuned_row(workdir, "solo", chosen=1.0, val_losses=[5, 4.6])
  dense, solo = t1_lm.rows_for(workdir, ["dense", "solo"], seeds=1)
  # 20 steps of 64 sequences of 64 tokens over 8 workers; solo trains one worker's 8 sequences.
  assert dense["tokens_per_param"] == pytest.approx(20 * 64 * 64 / lm_runs.CPU_TIER_PARAMS)
  assert dense["per_worker_tokens"] == solo["per_worker_tokens"] == 8 * 64
  assert solo["tokens_per_param"] == pytest.approx(20 * 8 * 64 / lm_runs.CPU_TIER_PARAMS)


def test_no_retention_or_difference_is_taken_against_a_reference_on_other_data(tmp_path):
  workdir = str(tmp_path)
  lm_runs.tuned_row(workdir, "dense", chosen=1.0, val_losses=[5, 4.0])
  lm_runs.tuned_row(workdir, "solo", chosen=1.0, val_losses=[5, 4.6], corpus="57a1e")
  lm_runs.tuned_row(workdir, "demo_100x", chosen=1.0, val_losses=[5, 4.3])
  dense, solo, demo = t1_lm.rows_for(workdir, ["dense", "solo", "demo_100x"], seeds=1)
  # Same data as dense: its difference stands; solo, on another corpus, gives no retention.
  assert demo["vs_dense"] == pytest.approx(0.3) and "retention" not in demo
  assert demo["retention_text"] == ("- (solo on corpus 57a1e, tokenizer beef, this row on "
                                    "corpus c0ffee, tokenizer beef)")
  assert "vs_dense" not in solo and "retention" not in solo
  assert solo["retention_text"].startswith("- (dense on corpus c0ffee")
  # On the same data the retention is taken: (4.6 - 4.3) / (4.6 - 4.0).
  lm_runs.tuned_row(workdir, "solo", chosen=1.0, val_losses=[5, 4.6])
  demo = t1_lm.rows_for(workdir, ["dense", "solo", "demo_100x"], seeds=1)[2]
  assert demo["retention"] == pytest.approx(0.5)


def test_every_retention_refuses_references_on_other_data():
  """The one rule S1-LM, F4-LM, F7-LM and A1-LM call as T1-LM does."""
  here, there = (("c0ffee", "beef"),), (("57a1e", "beef"),)
  solo, dense = {"losses": [4.6], "data": here}, {"losses": [4.0], "data": there}
  assert t1_lm.retention_against([4.3], here, solo, dense) == {
      "retention_text": "- (dense on corpus 57a1e, tokenizer beef, this row on corpus c0ffee, "
                        "tokenizer beef)"}
  kept = t1_lm.retention_against([4.3], here, solo, {**dense, "data": here})
  assert kept["retention"] == pytest.approx(0.5)


NAN = float("nan")


@pytest.mark.parametrize("tried, expected", [
    ({}, 0.5),
    ({0.5: 4.0, 2.0: 3.0}, 1.0),  # the grid first
    ({0.5: 4.0, 1.0: 3.0, 2.0: 3.5}, None),  # an inner scale won
    ({0.5: 4.0, 1.0: 3.5, 2.0: 3.0}, 4.0),  # the top end won: past it
    ({0.5: 3.0, 1.0: 3.5, 2.0: 4.0}, 0.25),  # the bottom end
    ({0.25: 2.9, 0.5: 3.0, 1.0: 3.5, 2.0: 4.0}, 0.125),
    ({0.5: 4.0, 1.0: 3.5, 2.0: 3.0, 4.0: 3.2}, None),  # the end run past lost
    ({0.5: 4.0, 1.0: 3.0, 2.0: 2.9, 4.0: 2.8, 8.0: 2.7}, None),  # the ladder's end
    ({0.125: 2.7, 0.25: 2.8, 0.5: 3.0, 1.0: 3.5, 2.0: 4.0}, None),
    ({0.5: 4.381, 1.0: 4.381, 2.0: 4.381}, None),  # a tie: the criterion cannot choose
    ({0.5: 4.0, 1.0: 3.0, 2.0: 3.0 - 1e-7}, None),  # within the tie
    ({0.5: NAN, 1.0: NAN, 2.0: 3.0}, 4.0),  # a diverged neighbour is beaten
    ({0.5: 3.0, 1.0: 3.5, 2.0: NAN}, 0.25),
    ({0.5: 3.0, 1.0: 3.5, 2.0: 4.0, 0.25: NAN}, None),  # diverged past the end: the end stands
    ({0.5: NAN, 1.0: NAN, 2.0: NAN}, None),  # nothing to choose
])
def test_the_tuning_goes_past_the_grid_while_an_end_wins(tried, expected):
  assert t1_lm.next_scale(tried) == expected


def test_extending_the_tuning_runs_round_by_round_until_every_row_has_chosen(tmp_path):
  workdir = str(tmp_path)
  # dense improves up to scale 4 (8 is worse); DeMo's best is inside the grid; top-k's at 0.5,
  # with 0.25 worse.
  train = {"dense": {0.5: 4.5, 1.0: 4.4, 2.0: 4.3, 4.0: 4.2, 8.0: 4.6},
           "demo_100x": {0.5: 4.5, 1.0: 4.1, 2.0: 4.3},
           "topk_100x": {0.25: 4.2, 0.5: 4.0, 1.0: 4.4, 2.0: 4.6}}
  for label, losses in train.items():
    for scale in sweep_config.LR_SCALES:
      lm_runs.fake_run(workdir, label, 0, scale=scale, val_losses=[5, 4], train_loss=losses[scale])
  # Its tuning is not over: nothing chooses, but the page reports the best so far, provisionally.
  assert t1_lm.chosen_scale(workdir, "dense") is None
  assert t1_lm.reported_scale(workdir, "dense") == (2.0, 4.0)
  [row] = t1_lm.rows_for(workdir, ["dense"], seeds=3)
  assert row["lr_scale"] == 2.0 and row["seeds"] == 1
  assert row["status"] == "1 seed(s); provisional: its tuning runs rate scale 4 next"
  rounds = []

  def run_chosen(chosen):
    rounds.append(chosen)
    for item in chosen.split("+"):
      label, scale = item.split("@")
      lm_runs.fake_run(workdir, label, 0, scale=float(scale), val_losses=[5, 4],
                       train_loss=train[label][float(scale)])

  t1_lm.extend_tuning(workdir, list(train), run_chosen)
  assert rounds == ["dense@4+topk_100x@0.25", "dense@8"]
  assert {label: t1_lm.chosen_scale(workdir, label) for label in train} == {
      "dense": 4.0, "demo_100x": 1.0, "topk_100x": 0.5}
  assert t1_lm.pending_scales(workdir, list(train)) == {}
  assert t1_lm.reported_scale(workdir, "dense") == (4.0, None)
  # Every scale diverged: nothing to report, and the row says why.
  for scale in sweep_config.LR_SCALES:
    lm_runs.fake_run(workdir, "dgc_100x", 0, scale=scale, val_losses=[5, 4], train_loss=NAN)
  assert t1_lm.reported_scale(workdir, "dgc_100x") == (None, None)
  [row] = t1_lm.rows_for(workdir, ["dgc_100x"], seeds=3)
  assert row["seeds"] == 0 and row["status"] == "tuning: diverged at every rate scale"


def test_a_chosen_scale_may_be_any_of_the_ladder():
  assert sweep_config.parse_chosen("dense@8+topk_100x@0.125") == {"dense": 8.0,
                                                                   "topk_100x": 0.125}


def test_the_criterion_is_the_last_tenth_of_training(tmp_path):
  lm_runs.fake_run(str(tmp_path), "dense", 0, val_losses=[5.0] * 20)
  run = t1_lm.label_runs(str(tmp_path), "dense", 1.0, 1)[0]
  run.metrics[:] = [{"step": s, "loss": 10.0 if s <= 180 else float(s)} for s in range(10, 201, 10)]
  assert t1_lm.train_criterion(run) == pytest.approx(np.mean([190.0, 200.0]))


def test_each_rows_family_is_the_registrys():
  labels = ("dense", "solo", "fp16", "onebit_adam", "tasc_100x", "topk_update_100x",
            "streaming_diloco_100x", "sparseloco_1000x", "diloco_tasc_100x", "demo_100x")
  assert [sweep_config.family(label) for label in labels] == [
      "dense", "solo", "exchange", "optimizer", "exchange", "exchange", "local", "local", "local",
      "optimizer"]


def test_the_headline_rows_are_each_familys_best_on_training_loss(lm_dir):
  assert t1_lm.headline_choice(lm_dir, "cpu") == {
      "dense": 1.0, "topk_update_100x": 2.0, "sparseloco_1000x": 0.5}
  # A local-update row at 100x that trains better than nothing else of its family joins.
  lm_runs.tuned_row(lm_dir, "diloco_100x", chosen=0.5, val_losses=[6, 5, 4.9, 4.8])
  assert t1_lm.headline_choice(lm_dir, "cpu")["diloco_100x"] == 0.5


def test_total_bytes_charge_each_step_its_kinds_bytes(tmp_path):
  """DiLoCo with int4 at 100x (H = 13): over 40 steps, 3 synchronisations (steps 12, 25, 38) send
  the exchange's bytes and 37 local steps the 4-byte flag."""
  workdir = str(tmp_path)
  lm_runs.fake_run(workdir, "diloco_int4_100x", 0, val_losses=[6, 5, 4.5, 4.4],
                   bytes_by_kind={"local": 4.0, "sync": 20_000.0}, dense=16_000.0)
  [run] = t1_lm.label_runs(workdir, "diloco_int4_100x", 1.0, 1)
  assert run.config["compression"]["diloco"]["every"] == 13
  assert t1_lm.total_bytes(run) == pytest.approx(3 * 20_000 + 37 * 4)
  assert run.results["compression_ratio"] == pytest.approx(16_000 * 40 / (3 * 20_000 + 37 * 4))
  # Accounting that disagrees with the run's own step kinds is refused, naming the run.
  run.results["wire_bytes"] = 20_000.0
  with pytest.raises(ValueError, match="diloco_int4_100x_lr1_s0: the step kinds' bytes"):
    t1_lm.total_bytes(run)


def test_t1_lm_table_goal_and_claims(lm_dir, tmp_path):
  report = t1_lm.report(lm_dir, tier="cpu", seeds=3)
  rows = {r["method"]: r for r in report.rows}
  dense, topk = rows["dense"], rows["topk_update_100x"]
  assert dense["loss_mean"] == pytest.approx(4.1) and dense["seeds"] == 2
  assert topk["loss_mean"] == pytest.approx(4.15) and topk["lr_scale"] == 2.0
  assert topk["vs_dense_pct"] == pytest.approx(100 * 0.05 / 4.1)
  assert topk["loss_ci95"] == pytest.approx(12.7062 * np.std([4.05, 4.25], ddof=1) / math.sqrt(2))
  assert topk["total_bytes"] == pytest.approx(1e3 * 40) and topk["on_tier"] is True
  assert rows["sparseloco_1000x"]["on_tier"] is True and rows["sparseloco_1000x"]["family"] == "local"
  assert rows["diloco_100x"]["status"] == "tuning: 0 of 3 rate scales finished"
  goals = {c.claim.split(" fewer")[0]: c for c in report.claims if c.source == "project goal"}
  assert goals["At 100x"].reproduced is True and "+1.2%" in goals["At 100x"].ours
  assert goals["At 1000x"].reproduced is False and "+7.3%" in goals["At 1000x"].ours
  tasc = [c for c in report.claims if c.claim.startswith("TASC")]
  assert "at 100x: TASC's best, tasc_100x 4.500 ± 0.000 (n=1)" in tasc[0].ours
  assert tasc[0].reproduced is None  # one seed of TASC
  written = reproduce_report.write_report(report, lm_runs.PROV, tmp_path / "out")
  assert sorted(p.name for p in written) == ["t1_lm.csv", "t1_lm.md", "t1_lm.png"]
  text = (tmp_path / "out" / "t1_lm.md").read_text()
  assert "Equal-bytes settings at 8 and 32 workers" in text and "off tier" in text  # PowerSGD
  assert "nothing is selected by a validation loss" in text


def test_the_runs_machine_is_named_once_with_the_span_of_their_dates(lm_dir):
  results_file = os.path.join(lm_dir, sweep_config.run_name("dense", 1.0, 0),
                              reproduce_report.RESULTS_FILE)
  with open(results_file) as f:
    results = json.load(f)
  results[provenance.KEY]["date"] = "2000-01-01T00:00:00+00:00"  # the sweep's first run
  with open(results_file, "w") as f:
    json.dump(results, f)
  [machines] = [n for n in t1_lm.provenance_notes(lm_dir, "cpu")
                if n.startswith("Runs' machines")]
  assert machines.startswith("Runs' machines (20 runs, 2000-01-01T00:00:00+00:00 to ")
  assert machines.count("Python ") == 1 and "devices: " in machines


def test_the_gpu_tier_reports_its_given_scales_untuned(tmp_path):
  workdir = str(tmp_path)
  label = next(iter(sweep_config.GPU_ROWS))
  scale = sweep_config.GPU_ROWS[label]
  lm_runs.fake_run(workdir, "dense", 0, val_losses=[6, 4.0], wire=1e5)
  lm_runs.fake_run(workdir, label, 0, scale=scale, val_losses=[6, 4.4], wire=1e3)
  rows = {r["method"]: r for r in t1_lm.rows_for(workdir, ["dense", label], 1, tier="gpu")}
  assert rows[label]["seeds"] == 1 and rows[label]["loss_mean"] == pytest.approx(4.4)
  assert rows["dense"]["lr_scale"] == 1.0
  # The CPU tier would wait for the whole tuning budget of the same runs.
  assert t1_lm.chosen_scale(workdir, label) is None
  # Its page is its own (the CPU tier's t1_lm stays), and says that nothing was tuned.
  page = t1_lm.report(workdir, tier="gpu", seeds=1)
  assert page.name == "t1_lm_gpu" and "No tuning at this tier" in page.notes[0]
  assert "29.5M-parameter model" in page.claims[-1].why
