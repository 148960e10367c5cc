"""F5 (time to dense's loss: measured compute + modelled communication) from fake T1-LM run
directories (tests/lm_runs.py): nothing is trained or compiled here."""

import math

import ml_collections
import numpy as np
import pytest

from compressors import registry
from compressors.parallel import fsdp as compressors_fsdp
from compressors.network import topology as topo
from configs.paper import t1_lm as sweep_config
from experiments import methods
from experiments.reproduce import f5
from experiments.reproduce import report as reproduce_report
from experiments.reproduce import t1_lm
from tests import lm_runs
from tests.lm_runs import PROV
from tests.lm_runs import solved
from tests.lm_runs import tuned_row

DENSE = [6.0, 5.0, 4.5, 4.0]  # seed 1: each + 0.2, so the mean curve ends at 4.1
TOPK = [5.5, 4.5, 4.0]  # reaches 4.1 at step 28 (0.8 of the way from 20 to 30)
DILOCO = [5.8, 5.0, 4.6, 4.3]  # never reaches 4.1; its whole run is over before dense's
SPARSELOCO = [5.9, 5.2, 4.8, 4.5]  # never reaches 4.1; twice dense's compute per step
DEMO = [5.0, 4.0]  # reaches 4.1 soonest, but 20x, off its 100x tier


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory):
  d = str(tmp_path_factory.mktemp("lm_cpu"))
  tuned_row(d, "dense", chosen=1.0, val_losses=DENSE, seeds=2, step_s=0.5)
  tuned_row(d, "topk_update_100x", chosen=0.5, val_losses=TOPK, step_s=0.5)
  tuned_row(d, "diloco_int4_100x", chosen=1.0, val_losses=DILOCO, step_s=0.5,
            bytes_by_kind={"local": 0.0, "sync": 40_000 / 3})  # 3 syncs in 40 steps: 100x
  tuned_row(d, "sparseloco_1000x", chosen=2.0, val_losses=SPARSELOCO, step_s=1.0,
            bytes_by_kind={"local": 0.0, "sync": 4_000.0})  # 1 sync in 40 steps: 1000x
  tuned_row(d, "demo_100x", chosen=1.0, val_losses=DEMO, step_s=0.5, wire=5000.0)
  # DiLoCo's horizon run (F7-LM's, 4x the steps; here as short as the fixture's runs): it fits
  # in the fair baseline's time and reaches dense's loss two thirds of the way from 30 to 40.
  lm_runs.fake_run(d, "diloco_int4_100x_len4", 0, val_losses=[5.5, 4.6, 4.2, 4.05], step_s=0.5,
                   bytes_by_kind={"local": 0.0, "sync": 40_000 / 3})
  return d


@pytest.fixture(scope="module")
def f5_report(lm_dir):
  return f5.report(lm_dir, tier="cpu", seeds=2)


@pytest.fixture(scope="module")
def rows(f5_report):
  return {(r["method"], r["link"], r["workers"]): r for r in f5_report.rows}


def _shapes(label):
  return methods.parameter_shapes(ml_collections.ConfigDict(
      solved(sweep_config.config_arg(label, "cpu", 1.0, 0, 8))))


def test_time_to_a_loss_is_interpolated_between_evaluations():
  steps, loss = np.array([10.0, 20.0, 30.0]), np.array([6.0, 5.0, 4.0])
  assert f5.time_to(steps, loss, 2.0, 4.5) == pytest.approx(25 * 2.0)
  assert f5.time_to(steps, loss, 2.0, 7.0) == pytest.approx(10 * 2.0)
  assert math.isnan(f5.time_to(steps, loss, 2.0, 3.0))


def test_loss_at_a_time_is_interpolated_or_ran_out():
  steps, loss = np.array([10.0, 20.0, 30.0]), np.array([6.0, 5.0, 4.0])
  assert f5.loss_at(steps, loss, 2.0, 50.0) == (pytest.approx(4.5), False)
  assert f5.loss_at(steps, loss, 2.0, 61.0) == (4.0, True)
  value, ran_out = f5.loss_at(steps, loss, 2.0, 10.0)
  assert math.isnan(value) and not ran_out


def test_rows_are_dense_and_the_headline_tiers_at_their_chosen_scales(rows):
  assert {m for m, _, _ in rows} == {"dense", f5.FAIR, "topk_update_100x", "diloco_int4_100x",
                                     "sparseloco_1000x", "demo_100x"}
  assert len(rows) == 6 * 4  # 2 links x 2 worker counts
  topk = rows[("topk_update_100x", "1 Gbit/s", 8)]
  assert topk["lr_scale"] == 0.5 and topk["tier"] == "100x" and topk["on_tier"] is True
  assert rows[("sparseloco_1000x", "1 Gbit/s", 8)]["lr_scale"] == 2.0
  assert rows[("demo_100x", "1 Gbit/s", 8)]["on_tier"] is False  # 20x, not 100x
  dense = rows[("dense", "1 Gbit/s", 8)]
  assert dense["seeds"] == 2 and dense["final_val_loss"] == pytest.approx(4.1)


def test_dense_is_charged_the_cost_models_all_reduce_every_step(rows):
  """Plain dense: float32 after the backward pass; the fair baseline, dense's own curve with a
  bfloat16 all-reduce overlapped with the backward pass: the CPU tier's model (under one 25 MiB
  bucket) cannot hide it, so it saves the bytes alone."""
  n = registry.num_elements(_shapes("dense"))
  for (link_name, link) in f5.LINKS.items():
    for workers in f5.WORKERS:
      dense, fair = rows[("dense", link_name, workers)], rows[(f5.FAIR, link_name, workers)]
      topology = topo.Topology.flat(workers, link)
      expected = topo.dense_cost("psum", topology, n).time
      assert dense["compute_s"] == fair["compute_s"] == pytest.approx(0.5)
      assert dense["comm_s"] == pytest.approx(expected)
      assert dense["step_s"] == pytest.approx(0.5 + expected)
      half = topo.dense_cost("psum", topology, n, itemsize=2).time
      assert fair["comm_s"] == pytest.approx(half) and fair["step_s"] == pytest.approx(0.5 + half)
      assert fair["final_val_loss"] == dense["final_val_loss"]
      assert dense["speedup_f32"] == fair["speedup"] == pytest.approx(1.0)
      assert dense["speedup"] == pytest.approx(fair["step_s"] / dense["step_s"])
  # 1 MB all-reduced at 1 Gbit/s: milliseconds, and 10 Gbit/s is faster.
  assert 1e-3 < rows[("dense", "1 Gbit/s", 8)]["comm_s"] < 0.1
  assert rows[("dense", "10 Gbit/s", 8)]["comm_s"] < rows[("dense", "1 Gbit/s", 8)]["comm_s"]


@pytest.mark.parametrize("label,steps", [("diloco_int4_100x", 40), ("sparseloco_1000x", 40)])
def test_a_local_update_row_pays_its_exchange_at_each_synchronisation(rows, label, steps):
  config = solved(sweep_config.config_arg(label, "cpu", 1.0, 0, 8))
  own = config["compression"][config["method"]]
  exchange = own["carrier"]
  every = own["every"]
  syncs = steps // every  # synchronisations after steps every - 1, 2 every - 1, ...
  assert (label, every, syncs) in {("diloco_int4_100x", 13, 3), ("sparseloco_1000x", 30, 1)}
  settings = registry.default_settings(exchange, **config["compression"][exchange])
  for link_name, link in f5.LINKS.items():
    for workers in f5.WORKERS:
      once = registry.cost(exchange, _shapes(label), topo.Topology.flat(workers, link),
                           settings).time
      row = rows[(label, link_name, workers)]
      assert row["comm_s"] == pytest.approx(once * syncs / steps)
      assert row["steps_by_kind"] == f"local {steps - syncs}, sync {syncs}"
  assert rows[(label, "1 Gbit/s", 8)]["comm_s"] < rows[("dense", "1 Gbit/s", 8)]["comm_s"] / 10


def test_onebit_adams_warmup_steps_are_charged_a_dense_all_reduce():
  config = solved(sweep_config.config_arg("onebit_adam", "cpu", 1.0, 0, 8))
  shapes = _shapes("onebit_adam")
  topology = topo.Topology.flat(8, topo.ETHERNET_1G)
  price = {k: t.communication for k, t in f5.kind_times(config, topo.ETHERNET_1G, 8, 0.1).items()}
  assert price == {
      "warmup": pytest.approx(registry.cost("dense", shapes, topology).time),
      "compressed": pytest.approx(registry.cost("onebit_adam", shapes, topology).time)}
  assert price["compressed"] < price["warmup"] / 10
  assert t1_lm.kind_counts(config, 1000) == {"warmup": 100, "compressed": 900}


def test_speed_up_and_loss_in_denses_time(rows):
  for link_name in f5.LINKS:
    for workers in f5.WORKERS:
      dense = rows[(f5.FAIR, link_name, workers)]
      dense_time = 40 * dense["step_s"]
      topk = rows[("topk_update_100x", link_name, workers)]
      assert topk["time_to_dense_s"] == pytest.approx(28 * topk["step_s"])
      assert topk["speedup"] == pytest.approx(dense_time / (28 * topk["step_s"]))
      plain = 40 * rows[("dense", link_name, workers)]["step_s"]
      assert topk["speedup_f32"] == pytest.approx(plain / (28 * topk["step_s"]))
      assert topk["speedup_f32"] > topk["speedup"]  # the float32 baseline flatters
      assert topk.get("loss_at_dense_time") is None
      # DiLoCo's whole run (40 cheaper steps) is over before dense's: its final loss.
      diloco = rows[("diloco_int4_100x", link_name, workers)]
      assert diloco["speedup"] is None and not diloco["reached"]
      assert diloco["loss_at_dense_time"] == 4.3 and diloco["ran_out"]
      assert diloco["at_dense_time"].startswith("ran out of steps")
      # SparseLoCo's steps take twice dense's compute: at dense's time it is about halfway.
      sparse = rows[("sparseloco_1000x", link_name, workers)]
      expected = np.interp(dense_time, np.array([10, 20, 30, 40]) * sparse["step_s"],
                           SPARSELOCO)
      assert sparse["loss_at_dense_time"] == pytest.approx(expected) and not sparse["ran_out"]
  # On 8 workers at 1 Gbit/s: dense 40 steps of 0.5 s + ~7 ms (bf16); top-k 28 steps of ~0.5 s.
  assert rows[("topk_update_100x", "1 Gbit/s", 8)]["speedup"] == pytest.approx(1.44, abs=0.02)
  assert rows[("sparseloco_1000x", "1 Gbit/s", 8)]["loss_at_dense_time"] == pytest.approx(
      5.18, abs=0.02)
  # Compression pays more on the slow link.
  assert (rows[("topk_update_100x", "1 Gbit/s", 8)]["speedup"]
          > rows[("topk_update_100x", "10 Gbit/s", 8)]["speedup"])


def test_headline_quotes_each_tiers_best_row_on_8_workers_at_1_gbit(f5_report, rows):
  top = f5.headline(f5_report.rows, "100x")
  # DeMo reaches dense's loss sooner, but at 20x it is off the 100x tier.
  assert top["method"] == "topk_update_100x"
  assert top["speedup"] == pytest.approx(rows[("topk_update_100x", "1 Gbit/s", 8)]["speedup"])
  assert top["loss_at_dense_time"] is None and "1.4" in top["text"]
  low = f5.headline(f5_report.rows, "1000x")
  assert low["method"] == "sparseloco_1000x" and low["speedup"] is None
  assert low["loss_at_dense_time"] == pytest.approx(
      rows[("sparseloco_1000x", "1 Gbit/s", 8)]["loss_at_dense_time"])
  assert low["ran_out"] is False and "never reaches" in low["text"]
  assert f5.headline(f5_report.rows, "300x") is None
  claims = {c.claim.split(",")[0]: c for c in f5_report.claims}
  assert claims["At 100x fewer total bytes"].reproduced is True
  assert claims["At 1000x fewer total bytes"].reproduced is False
  agarwal = next(c for c in f5_report.claims if "Agarwal" in c.source)
  assert "topk_update_100x" in agarwal.ours and agarwal.reproduced is True


def test_at_equal_time_a_row_that_ran_out_of_steps_is_given_its_horizon_run(rows):
  for link in f5.LINKS:
    for workers in f5.WORKERS:
      diloco = rows[("diloco_int4_100x", link, workers)]
      assert diloco["fits_steps"] == pytest.approx(diloco["dense_time_s"] / diloco["step_s"])
      assert diloco["fits_steps"] > 40
      reach = (30 + 10 * (4.2 - 4.1) / (4.2 - 4.05)) * diloco["step_s"]
      assert diloco["horizon"] == f"4x run (40 steps): reaches dense's loss at {reach:.4g} s"
  # Top-k reaches dense's loss in its own run; SparseLoCo has no horizon run.
  assert "horizon" not in rows[("topk_update_100x", "1 Gbit/s", 8)]
  sparse = rows[("sparseloco_1000x", "1 Gbit/s", 8)]
  assert not sparse["ran_out"] and "horizon" not in sparse


def test_a_horizon_run_longer_than_the_fair_time_is_read_at_that_time(lm_dir):
  # DiLoCo's 4x run (steps 10-40 at 0.5 s: losses 5.5, 4.6, 4.2, 4.05) against a baseline of
  # 12.5 s, step 25: there it is at 4.4 (half way from 4.6 to 4.2), mid-schedule.
  def horizon(dense_loss):
    row = {"method": "diloco_int4_100x", "lr_scale": 1.0, "dense_time_s": 12.5, "step_s": 0.5,
           "ran_out": True, "dense_loss": dense_loss}
    f5.add_horizon([row], lm_dir, seeds=2)
    assert row["fits_steps"] == pytest.approx(25.0)
    return row["horizon"]

  head = ("its 4x run (40 steps) is longer than the fair baseline's time; at step 25, "
          "mid-schedule, it ")
  assert horizon(4.1) == head + "is at 4.400, short of dense's loss"
  # Dense's loss 4.5 falls a quarter of the way from step 20 to 30: at 22.5 steps, 11.25 s.
  assert horizon(4.5) == head + "reaches dense's loss at 11.25 s"
  # Reached only after the baseline's time (4.3 at step 27.5): short of it at the time.
  assert horizon(4.3) == head + "is at 4.400, short of dense's loss"


def test_the_soonest_row_of_each_cluster_is_named_with_both_speed_ups(f5_report, rows):
  fastest = {(r["link"], r["workers"]): r for r in f5.fastest_rows(f5_report.rows)}
  assert len(fastest) == 4
  for (link, workers), r in fastest.items():
    top = rows[("topk_update_100x", link, workers)]  # DeMo is quicker but off its tier
    assert r["row"] == "topk_update_100x"
    assert r["result"] == (f"{top['speedup']:.3g}x vs {f5.FAIR}, {top['speedup_f32']:.3g}x vs "
                           "dense float32")
  [(title, text)] = f5_report.sections
  assert title.startswith("Soonest") and "| 1 Gbit/s | 8 | topk_update_100x |" in text


def test_write_report_writes_the_table_and_figure(f5_report, tmp_path):
  written = reproduce_report.write_report(f5_report, PROV, tmp_path / "out")
  assert sorted(p.name for p in written) == ["f5.csv", "f5.md", "f5.png"]
  text = (tmp_path / "out" / "f5.md").read_text()
  assert "Measured: compute" in text and "Modelled: communication" in text
  assert "sparseloco_1000x" in text and "ran out of steps" in text


def test_the_gpu_tier_prices_its_rows_at_their_given_scales_on_its_own_page(tmp_path):
  # The GPU tier tunes nothing: F5 reads each row at GPU_ROWS' scale (dense at 1), and writes
  # f5_gpu, leaving the CPU tier's f5 as it is.
  workdir = str(tmp_path / "lm_gpu")
  label, scale = next(iter(sweep_config.GPU_ROWS.items()))
  lm_runs.fake_run(workdir, "dense", 0, val_losses=DENSE, step_s=0.5)
  lm_runs.fake_run(workdir, label, 0, scale=scale, val_losses=TOPK, step_s=0.5)
  report = f5.report(workdir, tier="gpu", seeds=1)
  priced = {(r["method"], r["lr_scale"]) for r in report.rows}
  assert priced == {("dense", 1.0), (f5.FAIR, 1.0), (label, scale)}
  written = reproduce_report.write_report(report, PROV, tmp_path / "out")
  assert sorted(p.name for p in written) == ["f5_gpu.csv", "f5_gpu.md", "f5_gpu.png"]


def test_an_island_layout_is_priced_with_zero3_on_the_fast_link():
  """F5 prices a run on islands (``fsdp=4``: 2 islands of 4 joined by 1 Gbit/s, NVLink inside):
  dense's all-reduce of a quarter of the model between 2 islands, plus ZeRO-3's all-gather and
  reduce-scatter of the whole model on NVLink, which at this size is cheaper than 8 workers
  all-reducing the whole model over Ethernet."""
  config = solved(sweep_config.config_arg("dense", "cpu", 1.0, 0, 8))
  n = registry.num_elements(_shapes("dense"))
  [islands] = f5.kind_times(config, topo.ETHERNET_1G, 8, 0.1, fsdp=4).values()
  [flat] = f5.kind_times(config, topo.ETHERNET_1G, 8, 0.1).values()
  zero3 = topo.dense_cost("ring", topo.Topology.flat(4, topo.NVLINK4), n).time
  shards = registry.num_elements(compressors_fsdp.leaf_shard_shapes(_shapes("dense"), 4))
  across = topo.dense_cost("psum", topo.Topology.flat(2, topo.ETHERNET_1G), shards).time
  assert islands.communication == pytest.approx(across + zero3)
  assert islands.total == pytest.approx(0.1 + across + zero3)
  assert islands.total < flat.total
