"""A1-LM (configs/paper/a1_lm.py, experiments/reproduce/a1_lm.py): the grid lists every row x
aggregator x condition once (the refused ones marked, and refused by the runner too), every
run's config validates, the cells F6-LM shares are F6-LM's runs, and the report's time model
and claims on fake runs."""

import math

import pytest

from compressors import registry
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
  assert len(cells) == len(sweep_config.ROWS) * len(sweep_config.RULES) * 4
  assert {(row, rule, spread, dropout) for row, rule, spread, dropout in cells.values()} == {
      (row, rule, spread, dropout) for row in sweep_config.ROWS for rule in sweep_config.RULES
      for spread in (0.0, 0.5) for dropout in (0.0, 0.1)}
  sweep = sweep_config.get_config()
  names = [r["name"] for r in sweep.runs]
  runnable = [label for label, cell in cells.items() if sweep_config.refusal(*cell) is None]
  assert len(names) == len(set(names)) == len(runnable) + 2
  assert {"dense_lr4_s0", "solo_lr1_s0", "diloco_int8_100x_lr0.5_s0",
          "streaming_diloco_100x_lr1_s0"} <= set(names)
  configs = sweep_lib.run_configs(sweep, one_device_count=False)  # every config checked
  for config in configs.values():
    methods.worker_simulation(config, 8)  # the runner's refusal: none among the listed runs
  # The cells F6-LM shares are its runs: the same arguments.
  for _, f6_label, scale in sweep_config.ROWS.values():
    assert sweep_config.config_arg(f6_label, 0) == f6_lm.config_arg(f6_label, scale, 0)


@pytest.mark.parametrize("spread", [0.0, 0.5])
def test_streaming_dilocos_eager_cells_are_refused_by_the_runner_too_and_the_others_run(spread):
  config = lambda rule: sweep_lib.load_config(
      f"{sweep_config.CONFIG}:method=streaming_diloco,ratio=100.0,aggregation={rule},"
      f"speed_spread={spread}")
  assert sweep_config.refusal("streaming_diloco", "eager", spread, 0.0).startswith("refused")
  with pytest.raises(ValueError, match=r"config.aggregation='eager' with config.method="
                     r"'streaming_diloco'; allowed: \('sync', 'quorum', 'async', 'naive_async'\)"):
    methods.worker_simulation(config("eager"), 8)
  for rule in ("quorum", "async", "naive_async"):
    assert sweep_config.refusal("streaming_diloco", rule, spread, 0.1) is None
    assert methods.worker_simulation(config(rule), 8).workers == 8
  assert sweep_config.AGGREGATING["streaming_diloco"] == registry.get("streaming_diloco").aggregates


def test_the_smoke_length_and_bad_arguments():
  sweep = sweep_config.get_config("rows=diloco_int8,rules=eager,steps=10")
  assert len(sweep.runs) == 2 + 4 and sweep.overrides["num_steps"] == 10
  with pytest.raises(ValueError, match=r"rules='gossip': 'gossip'; allowed: \['sync', "):
    sweep_config.get_config("rules=gossip")
  assert "a1_lm" in reproduce.TARGETS and "a1_lm" in reproduce.CPU_TIER_TARGETS


def _fake(workdir, label, loss, *, step_s=0.5, **results):
  """A finished run of a cell or reference, with ``results`` added to its results.json."""
  arg = sweep_config.config_arg(label, 0)
  config = lm_runs.solved(arg)
  steps = [500, 1000]
  records = [{"step": s, "loss": loss, "examples_per_sec": config["batch_size"] / step_s}
             for s in steps] + [{"step": s, "test_loss": v} for s, v in zip(steps, [6.0, loss])]
  reproduce_report.write_run(
      f"{workdir}/{t1_lm_config.run_name(label, sweep_config.scale_of(label), 0)}",
      config, records, {"test_loss": loss, "step": 1000, "wire_bytes": 1.0, "dense_bytes": 1.0,
                        **results})


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
  run = a1_lm.runs_of(workdir, quorum)[0]
  compute = 0.5  # the row's run with the workers alike: 0.5 s a step
  ten = f5.kind_times(run.config, topo.CLOUD_10G, 8, compute)
  counts = a1_lm.t1_lm.kind_counts(run.config, 1000)
  expected = 800 * compute + sum(t.exposed * counts[k] for k, t in ten.items())
  assert rows[quorum]["seconds_10g"] == pytest.approx(expected)
  assert rows[quorum]["useful_pct"] == pytest.approx(
      100 * 4000 * compute / (8 * rows[quorum]["seconds_1g"]))
  assert rows["diloco_int8_100x"]["useful_pct"] == pytest.approx(
      100 * 1000 * compute / rows["diloco_int8_100x"]["seconds_1g"])
  assert rows[quorum]["to_dense_1g"] == "not reached" and rounds > 0
  refused = rows[sweep_config.label("streaming_diloco", "eager", 0.0, 0.0)]
  assert refused["status"].startswith("refused: config.method='streaming_diloco'")
  assert [c.reproduced for c in report.claims] == [None, None, None]  # cells not run yet
  written = reproduce_report.write_report(report, lm_runs.PROV, tmp_path / "out")
  assert "a1_lm.md" in [p.name for p in written]
  assert not math.isnan(rows["dense"]["seconds_1g"]) and "seconds_1g" not in rows["solo"]
