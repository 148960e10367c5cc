"""The language-model targets of the reproduction (T1-LM, F4-LM, F5): their sweep configs (the
CPU tier's grid, the GPU tier built but not run) and their tables, claims and figures from fake
run directories (nothing is trained or compiled here)."""

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
from experiments.reproduce import f4_lm
from experiments.reproduce import f5
from experiments.reproduce import report as reproduce_report
from experiments.reproduce import t1_lm

PROV = reproduce_report.Provenance(
    provenance.record(command_line="python -m experiments.reproduce --target=t1_lm"), "quick")


# ----------------------------------------------------------------------------- configs


def test_the_cpu_grid_runs_every_method_with_one_recipe():
  t1 = sweep_config.get_config("tier=cpu,subset=t1")
  f4 = sweep_config.get_config("tier=cpu,subset=f4")
  names = {r["name"] for r in t1.runs} | {r["name"] for r in f4.runs}
  assert len(names) == 38  # topk_100x is in both
  # Three seeds for the headline's rows and F4-LM's scores, one for the rest (fits 90 minutes a
  # target).
  seeds = sweep_config.grid("cpu")
  assert {label for label, n in seeds.items() if n == 3} == {
      "dense", "topk_100x", "tasc_100x", "tasc_100x_magnitude_b256_global",
      "tasc_100x_newton_b256_global", "tasc_100x_fisher_b256_global"}
  configs = [lm.get_config(r["config"].split(":", 1)[1]) for r in t1.runs + f4.runs]
  # Same tuning budget for every method: one optimizer, schedule, batch and length.
  recipes = {(c.optimizer.to_json(), c.schedule.to_json(), c.num_steps, c.batch_size,
              c.data.seq_len) for c in configs}
  assert len(recipes) == 1
  assert {c.method for c in configs} == {"dense", "fp16", "onebit", "topk", "randomk", "dgc",
                                         "powersgd", "tasc"}
  # F4-LM: every score at every block size that meets 100x (block 16 cannot), this step's
  # support; the last step's support at TASC's default score and block.
  f4_labels = {r["name"].rsplit("_s", 1)[0] for r in f4.runs}
  assert f4_labels == {"topk_100x", "tasc_100x_saliency_b256_previous"} | {
      f"tasc_100x_{score}_b{block}_global"
      for score in ("magnitude", "saliency", "newton", "fisher") for block in (64, 256, 1024)
      if (score, block) != ("saliency", 256)}


def _solved(arg: str):
  """``configs/paper/lm.py:arg`` as the runner trains it: its equal-bytes request solved."""
  config = lm.get_config(arg)
  methods.fill_equal_bytes(config)
  return config


def test_each_budgeted_method_is_solved_onto_its_tier():
  shapes = methods.parameter_shapes(lm.get_config("tier=cpu"))
  dense = equal_bytes.method_bytes("dense", shapes, 8)
  for method in ("topk", "randomk", "dgc", "tasc"):
    c = _solved(f"method={method},ratio=300")
    settings = registry.default_settings(method, **c.compression[method].to_dict())
    sent = equal_bytes.method_bytes(method, shapes, 8, settings)
    assert dense / sent == pytest.approx(300, rel=0.1), method
    again = c.compression[method].to_dict()
    methods.fill_equal_bytes(c)
    assert c.compression[method].to_dict() == again, f"{method}: solving twice changed it"
  assert _solved("method=tasc").compression.tasc.block_size == 256  # the solver's
  assert _solved("method=tasc,block=1024").compression.tasc.block_size == 1024
  assert lm.get_config("method=topk").compression.error_feedback is True


def test_the_pinned_unmet_blocks_are_the_solvers():
  """``configs/paper/t1_lm.py`` skips F4-LM's rows at :data:`UNMET_BLOCKS` without solving
  (a config traces no model): exactly the block sizes the solver cannot fit to the headline
  tier on either tier's model."""
  ratio = equal_bytes.TIERS[sweep_config.HEADLINE]
  for tier in ("cpu", "gpu"):
    unmet = {block for block in sweep_config.BLOCK_SIZES
             if not methods.equal_bytes_settings(lm.get_config(
                 f"tier={tier},method=tasc,ratio={ratio},block={block}"))[1].feasible}
    assert unmet == set(sweep_config.UNMET_BLOCKS), tier


def test_the_gpu_tier_builds_at_25m_parameters_and_32_workers():
  """The GPU tier cannot run here (no GPU); its configs must build and its model be >= 25M."""
  assert registry.num_elements(methods.parameter_shapes(lm.get_config("tier=gpu"))) >= 25_000_000
  c = lm.get_config("tier=gpu,method=tasc,workers=32")
  assert (c.num_devices, c.batch_size, c.data.seq_len, c.model.hidden) == (32, 256, 256, 512)
  sweep = sweep_config.get_config("tier=gpu,seeds=1")
  assert {r["name"].split("_w")[-1] for r in sweep.runs if "_w" in r["name"]} == {"32"}


@pytest.mark.parametrize("arg, message", [
    ("tier=tpu", "tier='tpu'; allowed: \\['cpu', 'gpu'\\]"),
    ("ratio=1", "ratio=1.0; allowed: > 1"),
    ("workers=1", "workers=1; allowed: >= 2")])
def test_bad_lm_arguments_are_refused(arg, message):
  with pytest.raises(ValueError, match=message):
    lm.get_config(arg)


def test_bad_sweep_arguments_are_refused():
  with pytest.raises(ValueError, match="subset='t3'; allowed: t1, f4, all"):
    sweep_config.get_config("subset=t3")
  with pytest.raises(ValueError, match="seeds=0; allowed: >= 1"):
    sweep_config.get_config("seeds=0")


def test_the_targets_are_registered_with_a_tier_flag():
  names, options = reproduce.parse_args(["--target=t1_lm,f4_lm,f5", "--tier=gpu"])
  assert names == ["t1_lm", "f4_lm", "f5"] and options.tier == "gpu"
  assert common.Options().tier == "cpu"
  order = list(reproduce.TARGETS)
  assert order.index("f5") > order.index("t1_lm")


# ----------------------------------------------------------------------------- fake runs


def _fake_run(workdir, label, seed, *, method, val_losses, step_s=0.5, wire=1000.0,
              ratio=100.0, **args):
  """A finished run of ``label``: validation losses at steps 10, 20, ...; ``step_s`` a step."""
  config = _solved(",".join(f"{k}={v}" for k, v in dict(method=method, seed=seed,
                                                         **args).items())).to_dict()
  records = [{"step": 10 * (i + 1), "loss": loss + 0.1,
              "examples_per_sec": config["batch_size"] / step_s}
             for i, loss in enumerate(val_losses)]
  records += [{"step": 10 * (i + 1), "test_loss": loss} for i, loss in enumerate(val_losses)]
  reproduce_report.write_run(
      os.path.join(workdir, sweep_config.run_name(label, seed)), config, records,
      {"test_loss": val_losses[-1], "test_bits_per_byte": val_losses[-1] / 2,
       "wire_bytes": wire, "compression_ratio": ratio, "python_version": "3.11.7",
       "corpus_sha256": "c0ffee", "corpus_files": 734, "corpus_bytes": 12_000_000,
       "tokenizer_sha256": "beef", "step": 10 * len(val_losses)})


@pytest.fixture
def lm_dir(tmp_path):
  """Dense reaches 4.0; TASC at 100x 4.0 (seed 0) / 4.2 (seed 1), reaching 4.0 at step 30 with
  seed 0; top-k 3.9, reaching 4.0 at step 30; TASC with magnitude scores 4.4 and 4.6."""
  workdir = str(tmp_path / "lm_cpu")
  for seed in range(2):
    _fake_run(workdir, "dense", seed, method="dense", val_losses=[6, 5, 4.5, 4.0], wire=1e5,
              ratio=1.0)
    _fake_run(workdir, "tasc_100x", seed, method="tasc", ratio=100.0,
              val_losses=[5.5, 4.5, 4.0 + 0.2 * seed, 4.0 + 0.2 * seed])
    _fake_run(workdir, "topk_100x", seed, method="topk", ratio=100.0,
              val_losses=[6, 5, 4.0, 3.9])
    _fake_run(workdir, sweep_config.f4_label("magnitude", 256, "global"), seed, method="tasc",
              ratio=100.0, sensitivity="none", block=256,
              val_losses=[6, 5, 4.6, 4.4 + 0.2 * seed])
  return workdir


def test_t1_lm_table_claims_and_figure(lm_dir, tmp_path):
  report = t1_lm.report(lm_dir, tier="cpu", seeds=2)
  rows = {r["method"]: r for r in report.rows}
  assert rows["dense"]["loss_mean"] == pytest.approx(4.0) and rows["dense"]["seeds"] == 2
  tasc = rows["tasc_100x"]
  assert tasc["loss_mean"] == pytest.approx(4.1) and tasc["vs_dense"] == pytest.approx(0.1)
  assert tasc["loss_ci95"] == pytest.approx(12.706 * np.std([4.0, 4.2], ddof=1) / math.sqrt(2))
  assert tasc["settings"].startswith("tasc block_size=256 density=0.016")
  assert rows["dgc_100x"]["seeds"] == 0 and rows["dgc_100x"]["status"] == "0 seed(s)"
  versus_topk = next(c for c in report.claims if "SparCML" in c.claim)
  assert "+0.200" in versus_topk.ours and versus_topk.reproduced is False  # 4.1 vs 3.9
  assert any("corpus sha256 c0ffee" in n and "Python 3.11.7" in n for n in report.notes)
  written = reproduce_report.write_report(report, PROV, tmp_path / "out")
  assert sorted(p.name for p in written) == ["t1_lm.csv", "t1_lm.md", "t1_lm.png"]
  text = (tmp_path / "out" / "t1_lm.md").read_text()
  assert "Equal-bytes settings at 8 and 32 workers" in text and "off tier" in text  # PowerSGD


def test_the_runs_machine_is_named_once_with_the_span_of_their_dates(lm_dir):
  results_file = os.path.join(lm_dir, sweep_config.run_name("dense", 0),
                              reproduce_report.RESULTS_FILE)
  with open(results_file) as f:
    results = json.load(f)
  results[provenance.KEY]["date"] = "2000-01-01T00:00:00+00:00"  # the sweep's first run
  with open(results_file, "w") as f:
    json.dump(results, f)
  [machines] = [n for n in t1_lm.provenance_notes(lm_dir, "cpu")
                if n.startswith("Runs' machines")]
  assert machines.startswith("Runs' machines (8 runs, 2000-01-01T00:00:00+00:00 to ")
  assert machines.count("Python ") == 1 and "devices: " in machines


def test_f4_lm_table_names_the_best_score(lm_dir, tmp_path):
  report = f4_lm.report(lm_dir, tier="cpu", seeds=2)
  rows = {r["method"]: r for r in report.rows}
  assert rows["tasc_100x"]["score"] == "saliency" and rows["tasc_100x"]["block"] == 256
  assert rows["topk_100x"]["score"] == "per-element top-k"
  [claim] = report.claims
  assert "lowest: saliency" in claim.ours
  assert claim.reproduced is False  # 4.1 vs 4.5: within the two intervals
  assert sum(n.startswith("Derivation,") for n in report.notes) == 4
  [(heading, text)] = report.sections
  assert "Lowest validation loss: saliency" in text and "the default stays" in text
  written = reproduce_report.write_report(report, PROV, tmp_path / "out")
  assert sorted(p.name for p in written) == ["f4_lm.csv", "f4_lm.md", "f4_lm.png"]


def test_time_to_a_loss_is_interpolated_between_evaluations():
  steps, loss = np.array([10.0, 20.0, 30.0]), np.array([6.0, 5.0, 4.0])
  assert f5.time_to(steps, loss, 2.0, 4.5) == pytest.approx(25 * 2.0)
  assert f5.time_to(steps, loss, 2.0, 7.0) == pytest.approx(10 * 2.0)
  assert math.isnan(f5.time_to(steps, loss, 2.0, 3.0))


def test_f5_adds_modelled_communication_to_measured_compute(lm_dir, tmp_path):
  report = f5.report(lm_dir, tier="cpu", seeds=2)
  rows = {(r["method"], r["link"], r["workers"]): r for r in report.rows}
  dense = rows[("dense", "1 Gbit/s", 8)]
  shapes = methods.parameter_shapes(lm.get_config("tier=cpu"))
  expected = topo.dense_cost("psum", topo.Topology.flat(8, topo.ETHERNET_1G),
                             registry.num_elements(shapes)).time
  assert dense["compute_s"] == pytest.approx(0.5) and dense["comm_s"] == pytest.approx(expected)
  tasc = rows[("tasc_100x", "1 Gbit/s", 8)]
  # 100x fewer bytes, but two all-reduces whose latency (2 (p - 1) alpha each) does not shrink.
  assert tasc["comm_s"] < dense["comm_s"] / 10
  # TASC's mean curve (5.5, 4.5, 4.1, 4.1) never reaches dense's 4.0; one with 32 workers neither.
  assert tasc["speedup"] is None and tasc["reached"].startswith("no")
  assert rows[("dense", "10 Gbit/s", 32)]["speedup"] == pytest.approx(1.0)
  # The common loss is the highest final one, TASC's 4.1: every row reaches it.
  assert tasc["common_loss"] == pytest.approx(4.1)
  assert tasc["speedup_common"] == pytest.approx(
      f5.time_to(np.array([10, 20, 30, 40.]), np.array([6, 5, 4.5, 4.0]), dense["step_s"], 4.1)
      / (30 * tasc["step_s"]))
  topk = rows[("topk_100x", "1 Gbit/s", 8)]
  assert topk["speedup"] == pytest.approx(40 * dense["step_s"] / (30 * topk["step_s"]))
  written = reproduce_report.write_report(report, PROV, tmp_path / "out")
  assert sorted(p.name for p in written) == ["f5.csv", "f5.md", "f5.png"]
  assert "measured" in (tmp_path / "out" / "f5.md").read_text()
