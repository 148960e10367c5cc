"""F4-LM's table, sections, claim and files from fake run directories (TASC on the
pseudo-gradient at 1000x; nothing is trained or compiled): the numbers, and a conclusion that says
what the data implies, whichever way it falls."""

import json
import os

import pytest

from configs.paper import t1_lm as sweep_config
from experiments.reproduce import common
from experiments.reproduce import f4_lm
from experiments.reproduce import report as reproduce_report
from tests import lm_runs
from tests.lm_runs import PROV
from tests.lm_runs import fake_run

DEFAULT = sweep_config.F4_ROW  # sparseloco_tasc_1000x: saliency, b256, this round's support
MAGNITUDE = sweep_config.f4_label("magnitude", 256, "global")
NEWTON = sweep_config.f4_label("newton", 256, "global")
B1024 = sweep_config.f4_label("saliency", 1024, "global")
PREVIOUS = sweep_config.f4_label("saliency", 256, "previous")
TOPK = "sparseloco_1000x"
# Student's t (1 degree of freedom) half-width of two seeds 0.02 apart: 12.706 * 0.02 / 2.
CI2 = 12.706 * 0.02 / 2


def seeds(workdir, label, finals):
  """Row ``label`` at rate scale 1, seed s ending at validation loss ``finals[s]``."""
  for seed, final in enumerate(finals):
    fake_run(workdir, label, seed, val_losses=[6.0, final])


def base(workdir, magnitude):
  """The default at 4.00/4.02, magnitude at ``magnitude``, a one-seed block-1024 saliency run
  below the default, SparseLoCo's tuning run at rate scale 1."""
  seeds(workdir, DEFAULT, [4.00, 4.02])
  seeds(workdir, MAGNITUDE, magnitude)
  seeds(workdir, B1024, [3.90])
  seeds(workdir, TOPK, [4.30])
  return workdir


def by_label(report):
  return {r["method"]: r for r in report.rows}


def section(report, start):
  [text] = [body for heading, body in report.sections if heading.startswith(start)]
  return text


def test_the_table_and_the_default_staying(tmp_path):
  workdir = base(str(tmp_path / "lm_cpu"), magnitude=[4.50, 4.52])
  report = f4_lm.report(workdir, tier="cpu", seeds=3)
  rows = by_label(report)
  # The default first, top-k last, every F4 row of the CPU grid between (12), missing ones too.
  assert [r["method"] for r in report.rows][0] == DEFAULT
  assert report.rows[-1]["method"] == TOPK and len(report.rows) == 14
  default = rows[DEFAULT]
  assert (default["score"], default["block"], default["support_key"]) == ("saliency", 256,
                                                                          "global")
  assert default["seeds"] == 2 and default["loss_mean"] == pytest.approx(4.01)
  assert default["loss_ci95"] == pytest.approx(CI2, rel=1e-4)
  assert default["val_loss"] == "4.010 ± 0.014 (n=2)"
  assert rows[MAGNITUDE]["vs_default"] == pytest.approx(0.5)
  assert rows[B1024]["seeds"] == 1 and rows[B1024]["loss_ci95"] is None
  assert rows[B1024]["vs_default"] == pytest.approx(-0.11)
  assert rows[TOPK]["score"].startswith("per-element top-k (SparseLoCo; T1-LM's tuning run")
  assert rows[TOPK]["loss_mean"] == pytest.approx(4.30) and rows[TOPK]["seeds"] == 1
  assert rows[NEWTON]["seeds"] == 0 and rows[NEWTON]["status"] == "not run"
  assert rows[NEWTON]["val_loss"] == "-" and "vs_default" not in rows[NEWTON]
  assert ", tasc block_size=256" in default["settings"]
  assert "topk" in rows[TOPK]["settings"]

  # Scores: saliency (the default) beats magnitude beyond the intervals.
  scores = section(report, "Which score")
  assert ("saliency, b256, this round's support is lowest, beyond the 95% intervals of every "
          "other score") in scores
  assert "Not finished: newton, b256" in scores
  [claim] = report.claims
  assert claim.reproduced is True
  gap = 0.5 - 2 * CI2
  assert f"resolved: the 95% intervals are {gap:.3f} apart" in claim.ours
  # Block sizes: 1024's lower mean rests on one seed.
  blocks = section(report, "Which block size")
  assert "Lowest: saliency, b1024, this round's support; its lead is not resolved" in blocks
  assert "-0.110 nats, not resolved: one seed, no interval" in blocks
  # Support: the last round's has not run.
  assert "nothing to compare" in section(report, "This round's or the last round's support")
  assert "Not finished: saliency, b256, the last round's support (not run)" in section(
      report, "This round's or the last round's support")
  # Beside top-k: the default is 0.29 below it, one seed of top-k.
  assert "-0.290 nats, not resolved: one seed" in section(report, "Beside per-element top-k")
  # The default stays: the only variant below it has one seed.
  winner, decision = f4_lm.default_decision(report.rows)
  assert winner is None
  assert decision.startswith("**The default stays saliency, b256, this round's support")
  assert "the lowest, saliency, b1024" in decision
  assert decision in section(report, "Conclusion")
  assert sum(n.startswith("Derivation,") for n in report.notes) == len(f4_lm.DERIVATIONS) == 5
  assert "pseudo-gradient" in report.title and sweep_config.F4_TIER in report.title

  written = reproduce_report.write_report(report, PROV, tmp_path / "out")
  assert sorted(p.name for p in written) == ["f4_lm.csv", "f4_lm.md", "f4_lm.png"]
  md = (tmp_path / "out" / "f4_lm.md").read_text()
  assert "The default stays" in md and "| sparseloco_tasc_1000x | saliency | 256 |" in md
  assert os.path.getsize(tmp_path / "out" / "f4_lm.png") > 10_000


def test_a_score_beyond_the_intervals_becomes_the_default(tmp_path):
  workdir = base(str(tmp_path / "lm_cpu"), magnitude=[4.50, 4.52])
  seeds(workdir, NEWTON, [3.50, 3.52])
  report = f4_lm.report(workdir, tier="cpu", seeds=3)
  winner, decision = f4_lm.default_decision(report.rows)
  assert winner["method"] == NEWTON
  gap = 0.5 - 2 * CI2
  assert decision.startswith(
      f"**The data favours newton, b256, this round's support over the default by 0.500 nats, "
      f"{gap:.3f} beyond the two 95% intervals**")
  assert "the default becomes score `newton`, block 256, support `global`" in decision
  assert "newton, b256, this round's support is lowest, beyond the 95% intervals" in section(
      report, "Which score")
  [claim] = report.claims
  assert claim.reproduced is True and "best Hessian-aware: newton" in claim.ours


def test_overlapping_intervals_resolve_nothing(tmp_path):
  # Magnitude's mean below the default's, its interval wide: not resolved, the default stays.
  workdir = base(str(tmp_path / "lm_cpu"), magnitude=[3.80, 4.10])
  seeds(workdir, PREVIOUS, [4.20, 4.22])
  report = f4_lm.report(workdir, tier="cpu", seeds=3)
  winner, decision = f4_lm.default_decision(report.rows)
  assert winner is None and decision.startswith("**The default stays")
  scores = section(report, "Which score")
  assert "Lowest: magnitude, b256, this round's support; its lead is not resolved" in scores
  assert "-0.060 nats, not resolved: the 95% intervals overlap" in scores
  [claim] = report.claims
  assert claim.reproduced is False
  # This round's support is 0.2 below the last round's, less than the two half-widths (0.254).
  support = section(report, "This round's or the last round's support")
  assert "-0.200 nats, not resolved: the 95% intervals overlap" in support


def test_missing_and_failed_runs_show_their_status(tmp_path):
  workdir = str(tmp_path / "lm_cpu")
  os.makedirs(workdir)
  with open(os.path.join(workdir, common.FAILURES_FILE), "w") as f:
    json.dump({sweep_config.run_name(MAGNITUDE, 1.0, 0): "out of memory"}, f)
  report = f4_lm.report(workdir, tier="cpu", seeds=3)
  rows = by_label(report)
  assert all(r["seeds"] == 0 for r in report.rows)
  assert rows[MAGNITUDE]["status"] == "failed: out of memory"
  assert rows[DEFAULT]["status"] == "not run"
  _, decision = f4_lm.default_decision(report.rows)
  assert "has no finished run" in decision and "the default stays" in decision
  assert report.claims[0].reproduced is None
  written = reproduce_report.write_report(report, PROV, tmp_path / "out")
  assert len(written) == 3


def test_the_default_rows_block_is_the_runs(tmp_path):
  """The table names the block the label asks for; a run that used another one (the solver's
  at the tier, for T1-LM's default row) gets a note."""
  workdir = str(tmp_path / "lm_cpu")
  seeds(workdir, DEFAULT, [4.0])
  report = f4_lm.report(workdir, tier="cpu", seeds=1)
  default = report.rows[0]
  notes = [n for n in report.notes if n.startswith(f"Block size: the runs of `{DEFAULT}`")]
  assert len(notes) == (default["run_block"] != 256)
  assert f"block_size={default['run_block']}" in default["settings"]


def test_each_row_reports_its_retention_against_t1_lms_dense_and_solo(tmp_path):
  """Against dense 4.0 and solo 5.0 (T1-LM's, tuned at scale 1), the default at 4.00/4.02 keeps
  0.99 of communication's benefit, magnitude at 5.50/5.52 less than nothing; without solo, the
  column stays empty."""
  workdir = base(str(tmp_path / "lm_cpu"), magnitude=[5.50, 5.52])
  assert "retention" not in by_label(f4_lm.report(workdir, tier="cpu", seeds=3))[DEFAULT]
  for label, loss in [("dense", 4.0), ("solo", 5.0)]:
    lm_runs.tuned_row(workdir, label, chosen=1.0, val_losses=[6, loss], seeds=1)
  report = f4_lm.report(workdir, tier="cpu", seeds=3)
  rows = by_label(report)
  assert rows[DEFAULT]["retention"] == pytest.approx((5.0 - 4.01) / 1.0)
  assert rows[MAGNITUDE]["retention"] == pytest.approx(-0.51)
  assert rows[DEFAULT]["retention_text"].startswith("0.99")
  assert ("retention_text", "retention (vs solo)") in report.columns
  # The scale the retention holds at, as T1-LM's rows say it: the fake runs' 20 steps of 64
  # sequences of 64 tokens on 235,264 parameters; 512 tokens a worker a step.
  assert rows[DEFAULT]["tokens_per_param"] == pytest.approx(20 * 64 * 64 / 235264)
  assert rows[DEFAULT]["per_worker_tokens"] == 512
  assert ("tokens_per_param", "tokens/parameter") in report.columns
