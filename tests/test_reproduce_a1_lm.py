"""A1-LM (configs/paper/a1_lm.py, experiments/reproduce/a1_lm.py): the grid lists every row x
aggregator x condition once (delayed at the workers-alike condition alone), every run's config
validates and the runner takes it (Streaming DiLoCo's eager and delayed too), the cells F6-LM
shares are F6-LM's runs, and the report's time model and claims on fake runs."""

import math

import numpy as np
import pytest

from compressors import registry
from compressors import worker_sim
from compressors.network import topology as topo
from configs.paper import a1_lm as sweep_config
from configs.paper import f6_lm
from configs.paper import t1_lm as t1_lm_config
from experiments import methods
from experiments import sweep as sweep_lib
from experiments.reproduce import __main__ as reproduce
from experiments.reproduce import a1_lm
from experiments.reproduce import f5
from experiments.reproduce import report as reproduce_report
from tests import lm_runs


def test_the_grid_is_every_row_aggregator_and_condition_and_its_configs_validate():
  cells = sweep_config.cells()
  alike_only = len(sweep_config.ALIKE_ONLY)
  assert len(cells) == len(sweep_config.ROWS) * ((len(sweep_config.RULES) - alike_only) * 4 +
                                                 alike_only) == 2 * 21
  assert {(row, rule, spread, dropout) for row, rule, spread, dropout in cells.values()} == {
      (row, rule, spread, dropout) for row in sweep_config.ROWS for rule in sweep_config.RULES
      for spread in (0.0, 0.5) for dropout in (0.0, 0.1)
      if rule != "delayed" or (spread, dropout) == (0.0, 0.0)}
  sweep = sweep_config.get_config()
  names = [r["name"] for r in sweep.runs]
  runnable = [label for label, cell in cells.items() if sweep_config.refusal(*cell) is None]
  assert len(names) == len(set(names)) == len(runnable) + 2 == len(cells) + 2
  assert {"dense_lr4_s0", "solo_lr1_s0", "diloco_int8_100x_lr0.5_s0",
          "streaming_diloco_100x_lr1_s0"} <= set(names)
  configs = sweep_lib.run_configs(sweep, one_device_count=False)  # every config checked
  for config in configs.values():
    methods.worker_simulation(config, 8)  # the runner's refusal: none among the listed runs
  # The cells F6-LM shares are its runs: the same arguments.
  for _, f6_label, scale in sweep_config.ROWS.values():
    assert sweep_config.config_arg(f6_label, 0) == f6_lm.config_arg(f6_label, scale, 0)


@pytest.mark.parametrize("spread", [0.0, 0.5])
def test_streaming_dilocos_eager_and_delayed_cells_run_and_the_runner_takes_them(spread):
  config = lambda rule: sweep_lib.load_config(
      f"{sweep_config.CONFIG}:method=streaming_diloco,ratio=100.0,aggregation={rule},"
      f"speed_spread={spread}")
  for rule in ("quorum", "async", "naive_async", "eager", "delayed"):
    assert sweep_config.refusal("streaming_diloco", rule, spread, 0.1) is None
    assert methods.worker_simulation(config(rule), 8).workers == 8
  assert registry.get("streaming_diloco").aggregates is True
  assert sweep_config.AGGREGATING["streaming_diloco"] == sweep_config.RULES


def test_the_smoke_length_and_bad_arguments():
  sweep = sweep_config.get_config("rows=diloco_int8,rules=eager,steps=10")
  assert len(sweep.runs) == 2 + 4 and sweep.overrides["num_steps"] == 10
  sweep = sweep_config.get_config("rules=delayed")  # the workers alike only, both rows
  assert [r["name"] for r in sweep.runs][2:] == [
      "a1_diloco_int8_delayed_sp0_do0_lr0.5_s0", "a1_streaming_diloco_delayed_sp0_do0_lr1_s0"]
  seeded = sweep_config.get_config("seeds=3,seeded=True")  # the seeded condition, three seeds
  names = [r["name"] for r in seeded.runs]
  assert len(names) == len(set(names)) == 3 * (2 + 2 * 5)
  assert all(f"_s{seed}" in n for seed in range(3) for n in names[12 * seed:12 * (seed + 1)])
  assert all("sp0.5_do0.1" in n for n in names if n.startswith("a1_"))
  with pytest.raises(ValueError, match=r"rules='gossip': 'gossip'; allowed: \['sync', "):
    sweep_config.get_config("rules=gossip")
  assert "a1_lm" in reproduce.TARGETS and "a1_lm" in reproduce.CPU_TIER_TARGETS


def _fake(workdir, label, loss, *, step_s=0.5, scale=None, **results):
  """A finished run of a cell or reference (at ``scale``, None: its grid's), with ``results``
  added to its results.json."""
  arg = sweep_config.config_arg(label, 0)
  config = lm_runs.solved(arg)
  steps = [500, 1000]
  records = [{"step": s, "loss": loss, "examples_per_sec": config["batch_size"] / step_s}
             for s in steps] + [{"step": s, "test_loss": v} for s, v in zip(steps, [6.0, loss])]
  reproduce_report.write_run(
      f"{workdir}/{t1_lm_config.run_name(label, scale or sweep_config.scale_of(label), 0)}",
      config, records, {"test_loss": loss, "step": 1000, "wire_bytes": 1.0, "dense_bytes": 1.0,
                        "num_params": 1000, "num_workers": config["num_devices"], **results})


def test_the_report_prices_time_and_useful_throughput_and_marks_the_claims(tmp_path):
  workdir = str(tmp_path / "lm_cpu")
  _fake(workdir, "dense", 4.0)
  _fake(workdir, "solo", 5.0)
  _fake(workdir, "diloco_int8_100x", 4.6)
  alike = a1_lm.runs_of(workdir, "diloco_int8_100x")[0]
  rounds = sum(n for k, n in a1_lm.t1_lm.kind_counts(alike.config, 1000).items() if k == "sync")
  per_worker = alike.config["batch_size"] / 8 * alike.config["data"]["seq_len"]
  quorum = sweep_config.label("diloco_int8", "quorum", 0.5, 0.1)
  # 800 modelled seconds of compute (in speed-1 steps) and half the workers' steps useful.
  priced = a1_lm.seconds_at(alike, topo.ETHERNET_1G, 1.0) - 1000
  _fake(workdir, quorum, 4.7, modelled_seconds=800 + priced,
        useful_throughput=4000 * per_worker / (800 + priced), staleness={"mean": 0, "max": 0},
        updates_dropped=3)
  report = a1_lm.report(workdir)
  rows = {r["label"]: r for r in report.rows}
  assert len(report.rows) == 2 + len(sweep_config.cells())
  assert rows[quorum]["retention"] == pytest.approx(0.3)
  # The scale the retention holds at: 64 sequences of 64 tokens a step over 8 workers.
  assert rows[quorum]["tokens_per_param"] == 1000 * 64 * 64 / 1000
  assert rows[quorum]["per_worker_tokens"] == 64 * 64 // 8
  run = a1_lm.runs_of(workdir, quorum)[0]
  compute = 0.5  # the row's run with the workers alike: 0.5 s a step
  ten = f5.kind_times(run.config, topo.CLOUD_10G, 8, compute)
  counts = a1_lm.t1_lm.kind_counts(run.config, 1000)
  expected = 800 * compute + sum(t.exposed * counts[k] for k, t in ten.items())
  assert rows[quorum]["seconds_10g"] == pytest.approx(expected)
  # The workers' own capacity: each at the speed the simulator drew for the run's seed.
  drawn = worker_sim.init(worker_sim.WorkerSim(8, 1.0, 0.5, dropout_rate=0.1,
                                               seed=run.config["seed"])).seconds_per_step
  capacity = np.sum(rows[quorum]["seconds_1g"] / (compute * np.asarray(drawn, np.float64)))
  assert rows[quorum]["useful_pct"] == pytest.approx(100 * 4000 / capacity)
  assert capacity != pytest.approx(8 * rows[quorum]["seconds_1g"] / compute, rel=1e-3)
  assert rows["diloco_int8_100x"]["useful_pct"] == pytest.approx(
      100 * 1000 * compute / rows["diloco_int8_100x"]["seconds_1g"])
  assert rows[quorum]["to_dense_1g"] == "not reached" and rounds > 0
  streaming_eager = rows[sweep_config.label("streaming_diloco", "eager", 0.0, 0.0)]
  assert streaming_eager["status"] == "not run yet"
  assert [c.reproduced for c in report.claims] == [None] * 5  # cells not run yet
  written = reproduce_report.write_report(report, lm_runs.PROV, tmp_path / "out")
  assert "a1_lm.md" in [p.name for p in written]
  assert not math.isnan(rows["dense"]["seconds_1g"]) and "seconds_1g" not in rows["solo"]


def test_kale_et_al_s_claim_is_eager_closing_most_of_naive_delays_gap(tmp_path):
  """Their figures close 94% of the gap; ours are read from the three cells with the workers
  alike, per row, and marked reproduced where eager closes over half of it."""
  assert a1_lm.gap_closed(*a1_lm.KALE.values()) == pytest.approx(0.32 / 0.34)
  workdir = str(tmp_path / "lm_cpu")
  _fake(workdir, "diloco_int8_100x", 4.8)
  _fake(workdir, "streaming_diloco_100x", 4.8)
  for rule, losses in (("delayed", (5.8, 5.0)), ("eager", (6.2, 4.85))):
    for row, loss in zip(sweep_config.ROWS, losses):
      _fake(workdir, sweep_config.label(row, rule, 0.0, 0.0), loss, modelled_seconds=900.0,
            useful_throughput=1.0, staleness={"mean": 1, "max": 1}, updates_dropped=0)
  claims = {c.ours.split(",")[0]: c for c in a1_lm.report(workdir).claims if "Kale" in c.source}
  assert claims["diloco_int8"].reproduced is False and "closes -40%" in claims["diloco_int8"].ours
  assert claims["streaming_diloco"].reproduced is True
  assert "eager closes 75% of the delayed step's gap" in claims["streaming_diloco"].ours
  assert "no overlap 2.67, naive one-step delayed outer step 3.01, eager 2.69" in (
      claims["diloco_int8"].claim)
  assert "2 workers (probe, one seed), loss: sync not run yet" in claims["diloco_int8 with 2 "
                                                                         "workers (probe"].ours
  # The probes with 2 workers: their own claim, from their run directories.
  probes = list(sweep_config.probes().items())[len(sweep_config.PROBE_RULES):]
  for (name, arg), loss in zip(probes, (4.4, 6.0, 4.5)):
    config = lm_runs.solved(arg)
    reproduce_report.write_run(f"{workdir}/{name}", config, [{"step": 1000, "test_loss": loss}],
                               {"test_loss": loss, "step": 1000})
  probe = [c for c in a1_lm.report(workdir).claims if "2 workers" in c.source]
  assert len(probe) == 1 and probe[0].reproduced is True
  assert "sync (no overlap) 4.4, delayed 6, eager 4.5: eager closes 93.8%" in probe[0].ours


@pytest.mark.parametrize("fresh, stiffness", [(1.0, 1.0), (1 / 8, 1.0), (0.0, 1.0), (0.5, 0.3)])
def test_the_linearised_outer_loops_radius_is_the_growth_of_its_recursion(fresh, stiffness):
  """Iterated in float64 (Nesterov: v <- 0.9 v + g; x <- x - 0.35 (g + 0.9 v), g the mix of this
  round's and the previous round's pull), the error grows or shrinks by the radius a round."""
  rate, momentum = 0.35, 0.9
  x, previous, velocity, sizes = 1.0, 1.0, 0.0, []
  for _ in range(600):
    g = stiffness * (fresh * x + (1 - fresh) * previous)
    velocity = momentum * velocity + g
    x, previous = x - rate * (g + momentum * velocity), x
    sizes.append(max(abs(x), abs(previous), abs(velocity)))
  growth = (sizes[-1] / sizes[-201]) ** (1 / 200)
  assert growth == pytest.approx(a1_lm.outer_loop_radius(rate, momentum, fresh, stiffness),
                                 rel=2e-3)
  # sync is stable at the grid's rate, eager with 8 workers and naive delay are not, and eager
  # with 2 workers is again
  radius = lambda f: a1_lm.worst_radius(rate, momentum, f)
  assert radius(1.0) < 1 < radius(1 / 8) < radius(0.0) and radius(0.5) < 1


def test_every_rule_gets_t1_lm_s_tuning_budget_and_the_page_says_what_it_chose(tmp_path):
  runs = sweep_config.tuning_runs("grid")
  assert len(runs) == len(sweep_config.ROWS) * len(sweep_config.RULES) * 3
  seeded = sweep_config.label("diloco_int8", "eager", *sweep_config.SEEDED)
  # The row's own scale is the seeded cell's seed 0: the same run.
  assert runs[t1_lm_config.run_name(seeded, 0.5, 0)] == sweep_config.config_arg(seeded, 0)
  delayed = sweep_config.label("streaming_diloco", "delayed", 0.0, 0.0)  # the workers alike
  assert t1_lm_config.run_name(delayed, 2.0, 0) in runs
  assert list(sweep_config.tuning_runs(f"{seeded}@0.25")) == [
      t1_lm_config.run_name(seeded, 0.25, 0)]
  assert len(sweep_config.get_config(f"tuning={seeded}@0.25").runs) == 1
  with pytest.raises(ValueError, match=r"^configs/paper/a1_lm.py: tuning='x@0.3': 'x@0.3'; "
                                       r"allowed: 'grid' or label@scale"):
    sweep_config.tuning_runs("x@0.3")
  workdir = str(tmp_path)
  for scale, loss in ((0.5, 5.0), (1.0, 4.0), (2.0, 4.5)):
    _fake(workdir, seeded, loss, scale=scale)
  note = a1_lm.tuning_note(workdir)
  assert ("diloco_int8 eager (spread 0.5, drop-outs 0.1): 0.5: 5.000 / 1: 4.000 * / 2: 4.500 "
          "(chose 1, its cells run there; the row's is 0.5)") in note
  assert "streaming_diloco sync (spread 0.5, drop-outs 0.1): none run (tuning: 0 of 3" in note


def test_each_rules_cells_run_and_report_at_the_scale_its_tuning_chose(tmp_path):
  eager = sweep_config.tuning_label("diloco_int8", "eager")
  sync = sweep_config.tuning_label("diloco_int8", "sync")
  names = {r["name"] for r in sweep_config.get_config(f"chosen={eager}@0.25+{sync}@1").runs}
  assert {n for n in names if n.startswith("a1_diloco_int8_eager")} == {
      f"a1_diloco_int8_eager_sp{spread:g}_do{dropout:g}_lr0.25_s0"
      for spread, dropout in sweep_config.conditions()}
  # sync's cell with the workers alike is F6-LM's row at sync's scale; other rules keep the row's
  assert {"diloco_int8_100x_lr1_s0", "a1_diloco_int8_sync_sp0.5_do0.1_lr1_s0",
          "a1_diloco_int8_quorum_sp0_do0_lr0.5_s0", "a1_streaming_diloco_eager_sp0_do0_lr1_s0"
          } <= names
  # The tuning's run at the chosen scale is the seeded cell's seed 0: the same arguments.
  assert sweep_config.config_arg(eager, 0, {eager: 0.25}) == sweep_config.tuning_runs(
      f"{eager}@0.25")[t1_lm_config.run_name(eager, 0.25, 0)]
  with pytest.raises(ValueError, match=r"^configs/paper/a1_lm.py: chosen='diloco_int8_100x@1': "
                                       r"'diloco_int8_100x' is not a tuning label"):
    sweep_config.get_config("chosen=diloco_int8_100x@1")
  workdir = str(tmp_path)
  for scale, loss in ((0.5, 5.0), (1.0, 4.0), (2.0, 4.5)):  # eager's tuning chooses 1
    _fake(workdir, eager, loss, scale=scale)
  _fake(workdir, sync, 4.2, scale=0.5)  # sync's tuning has not finished: the row's scale
  assert a1_lm.tuned_scales(workdir) == {eager: 1.0}
  rows = {r["label"]: r for r in a1_lm.grid_rows(workdir)}
  assert rows[eager]["lr_scale"] == 1.0 and rows[eager]["losses"] == [4.0]
  assert rows[sync]["lr_scale"] == 0.5 and rows[sync]["losses"] == [4.2]
  # A cell not yet rerun at its rule's scale shows the row's scale's runs, and says so.
  alike = sweep_config.label("diloco_int8", "eager", 0.0, 0.0)
  _fake(workdir, alike, 5.5)
  row = {r["label"]: r for r in a1_lm.grid_rows(workdir)}[alike]
  assert row["lr_scale"] == 0.5 and row["losses"] == [5.5]
  assert row["status"] == "1 seed(s); at the row's scale: its rule's 1 not run yet"
  _fake(workdir, alike, 5.0, scale=1.0)
  row = {r["label"]: r for r in a1_lm.grid_rows(workdir)}[alike]
  assert (row["lr_scale"], row["losses"], row["status"]) == (1.0, [5.0], "1 seed(s)")
