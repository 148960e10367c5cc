"""experiments.reproduce: target resolution, the paper sweep configs, and table/figure generation
from tiny fake run directories (nothing is trained or compiled here)."""

import csv
import json
import math
import os
import subprocess
import sys

from matplotlib import figure
from matplotlib import text as mtext
import ml_collections
import numpy as np
import pytest

import compressors
from compressors import registry
from compressors.network import topology as topo
from configs.paper import f1
from configs.paper import f2
from configs.paper import f3
from configs.paper import large_batch
from configs.paper import mnist1d
from configs.paper import t1_cifar10
from configs.paper import t1_mnist1d
from configs.paper import t1_tasc_search
from configs.paper import t2
from configs.paper import t2_bert
from configs.paper import t2_mnist1d
from experiments import provenance
from experiments import validation
from experiments.bench import bytes as bench_bytes
from experiments.bench import calibrate
from experiments.bench import common as bench_common
from experiments.bench import links as bench_links
from experiments.reproduce import __main__ as reproduce
from experiments.reproduce import common
from experiments.reproduce import f1 as f1_target
from experiments.reproduce import f2 as f2_target
from experiments.reproduce import f3 as f3_target
from experiments.reproduce import f4 as f4_target
from experiments.reproduce import report as reproduce_report
from experiments.reproduce import t1 as t1_target
from experiments.reproduce import t1_cifar10 as t1_cifar10_target
from experiments.reproduce import t2 as t2_target

pytestmark = pytest.mark.usefixtures("fast_compiles")

PROV = reproduce_report.Provenance(
    provenance.record(command_line="python -m experiments.reproduce --target=t1"), "quick")


# ----------------------------------------------------------------------------- targets


@pytest.mark.parametrize("spec, expected", [
    ("all", list(reproduce.TARGETS)),
    ("t1", ["t1"]),
    ("T1, f2", ["t1", "f2"]),
    ("f4,t1,f4", ["f4", "t1"]),
    ("t2,all", list(reproduce.TARGETS)),
])
def test_resolve_targets(spec, expected):
  assert reproduce.resolve_targets(spec) == expected


@pytest.mark.parametrize("spec, message", [("t9", "unknown target 't9'"), ("t1,,f2", "empty"),
                                           ("", "empty")])
def test_resolve_targets_rejects_bad_names(spec, message):
  with pytest.raises(ValueError, match=message) as e:
    reproduce.resolve_targets(spec)
  assert "t1_cifar10" in str(e.value)  # names what is allowed


def test_all_runs_f4_after_t1_whose_runs_it_plots():
  order = list(reproduce.TARGETS)
  assert order.index("f4") > order.index("t1")
  assert set(order) == {"t1", "t1_cifar10", "f1", "f2", "f3", "t2", "f4", "t1_lm", "f4_lm", "f5",
                        "f6_lm", "f7_lm", "s1_lm", "a1_lm", "r1"}


def test_parse_args():
  names, options = reproduce.parse_args(["--target=t1,f2", "--full", "--workdir=w", "--seeds=2"])
  assert names == ["t1", "f2"]
  assert options == common.Options(workdir="w", full=True, seeds=2)
  with pytest.raises(ValueError, match="nope"):  # one line, exit 1, from main
    reproduce.parse_args(["--target=nope"])
  with pytest.raises(ValueError, match="--seeds=0"):
    reproduce.parse_args(["--target=t1", "--seeds=0"])
  assert reproduce.parse_args(["--target=t1", "--jobs=1"])[1].jobs == 1
  with pytest.raises(ValueError, match="--jobs"):
    reproduce.parse_args(["--target=t1", "--jobs=0"])


def test_sweep_runs_in_child_processes_and_records_their_failures(tmp_path, monkeypatch):
  """``jobs=2``: each run trains in a child process, with its overrides; a child that fails is
  recorded with its error line, and the finished run is skipped the next time. The workdir is
  relative to the caller's working directory, not to the repository the children start in."""
  monkeypatch.chdir(tmp_path)
  sweep = ml_collections.ConfigDict({"overrides": {"log_every": 1}, "runs": [
      {"name": "dense", "config": "configs/quickstart.py:smoke", "overrides": {"method": "dense"}},
      {"name": "zip", "config": "configs/quickstart.py:smoke", "overrides": {"method": "zip"}}]})
  failures = common.run_sweep_config(sweep, "sweep", jobs=2)
  assert list(failures) == ["zip"] and "zip" in failures["zip"], failures
  assert "Error" in failures["zip"].split(":")[0]
  workdir = tmp_path / "sweep"
  assert json.loads((workdir / common.FAILURES_FILE).read_text()) == failures
  run = reproduce_report.read_run(str(workdir / "dense"))
  assert run.finished and run.config["method"] == "dense" and run.config["log_every"] == 1
  assert (workdir / "logs" / "zip.log").exists()
  with open(workdir / "summary.csv") as f:
    assert [r["name"] for r in csv.DictReader(f)] == ["dense"]
  results = workdir / "dense" / reproduce_report.RESULTS_FILE
  written = results.stat().st_mtime_ns
  assert list(common.run_sweep_config(sweep, "sweep", jobs=2)) == ["zip"]
  assert results.stat().st_mtime_ns == written
  with pytest.raises(ValueError, match="jobs=0"):
    common.run_sweep_config(sweep, "sweep", jobs=0)


def test_children_share_an_accelerators_memory(tmp_path, monkeypatch):
  """Each of ``jobs`` children gets ``0.9 / jobs`` of an accelerator's memory (XLA's default 75%
  for each would leave the second none), unless the caller chose a fraction."""
  seen = []

  class Child:
    returncode = 0

    def __init__(self, args, env, **kwargs):
      seen.append(env.get("XLA_PYTHON_CLIENT_MEM_FRACTION"))

    def poll(self):
      return 0

  monkeypatch.setattr(common.subprocess, "Popen", Child)
  monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
  runs = [{"name": f"r{i}", "config": "configs/quickstart.py:smoke"} for i in range(2)]
  assert common._run_children(runs, {}, str(tmp_path), 3) == {}
  monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
  common._run_children(runs[:1], {}, str(tmp_path), 2)
  assert seen == ["0.300", "0.300", "0.5"]


# ----------------------------------------------------------------------------- configs


def test_t1_sweep_covers_every_method_and_seed():
  sweep = t1_mnist1d.get_config("full=true")
  names = [r["name"] for r in sweep.runs]
  rows = t1_mnist1d.rows()
  assert len(names) == len(set(names)) == 3 * len(rows) == 3 * (len(t1_mnist1d.ROWS) + 11) == 93
  assert names[:len(rows)] == [f"{m}_s0" for m in rows]  # seed-major
  quick = [r["name"] for r in t1_mnist1d.get_config("full=false").runs]
  assert quick == names  # the same runs; full settings only change their configs
  f4 = [r["name"] for r in t1_mnist1d.get_config("subset=f4,seeds=2").runs]
  assert set(f4) <= set(names) and len(f4) == 8
  with pytest.raises(ValueError, match="subset"):
    t1_mnist1d.get_config("subset=some")


@pytest.mark.parametrize("method", list(t1_mnist1d.rows()))
def test_t1_run_configs_are_valid(method):
  config = mnist1d.get_config(t1_mnist1d.config_arg(method) + ",seed=2")
  validation.check_config(config, 8)
  settings = t1_mnist1d.rows()[method]
  assert config.method == settings["method"] and config.seed == config.compression.seed == 2
  if "ef" in settings:
    assert config.compression.error_feedback is settings["ef"]
  else:
    assert config.compression.error_feedback is None  # the method's own default
  if settings["method"] == "tasc":
    assert config.compression.tasc.density == settings["density"]
    assert config.compression.tasc.sensitivity == settings["sensitivity"]


def test_mnist1d_full_settings_and_bad_argument():
  quick, full = mnist1d.get_config(), mnist1d.get_config("full=true")
  assert (quick.num_steps, full.num_steps) == (mnist1d.QUICK_STEPS, mnist1d.FULL_STEPS)
  assert full.data.num_samples == mnist1d.FULL_SAMPLES
  with pytest.raises(ValueError, match="ef='maybe'"):
    mnist1d.get_config("ef=maybe")


def test_cifar10_sweep_overrides_match_the_mnist1d_rows():
  sweep = t1_cifar10.get_config("seeds=1")
  runs = {r["name"]: r for r in sweep.runs}
  assert set(runs) == {f"{m}_s0" for m in t1_mnist1d.rows()}
  topk = runs["topk_d0.001_noef_s0"]
  assert topk["config"].endswith(":method=topk")
  assert topk["overrides"]["compression"] == {"seed": 0, "topk": {"density": 0.001},
                                              "error_feedback": False}
  assert topk["overrides"]["num_epochs"] == t1_cifar10.QUICK_EPOCHS
  assert "num_epochs" not in t1_cifar10.get_config("full=true,seeds=1").runs[0]["overrides"]


@pytest.mark.parametrize("arg", [None, "full=true"])
def test_bert_sweep_selects_rates_then_scales_them_by_sqrt_batch(arg):
  bert = t2.get_config(arg).bert
  smallest = min(bert.batch_sizes)
  selection = {r["name"]: r["overrides"] for r in t2_bert.get_config(arg).runs}
  assert set(selection) == {t2_bert.run_name(o, smallest, lr) for o in bert.optimizers
                            for lr in bert.learning_rates[o]}
  chosen = {"adam": bert.learning_rates["adam"][-1], "lamb": bert.learning_rates["lamb"][1]}
  rates = ",".join(f"{o}_lr={lr!r}" for o, lr in chosen.items())
  runs = {r["name"]: r["overrides"] for r in t2_bert.get_config(
      ",".join(filter(None, [arg, rates]))).runs}
  assert set(selection) < set(runs)  # the selection runs stay in the sweep
  assert len(runs) == len(selection) + len(bert.optimizers) * (len(bert.batch_sizes) - 1)
  for optimizer, base in chosen.items():
    for batch in bert.batch_sizes:
      o = runs[t2_bert.run_name(optimizer, batch, base)]
      expected = base * math.sqrt(batch / bert.base_batch_size)
      assert o["optimizer"]["learning_rate"] == pytest.approx(expected)
      assert o["optimizer"]["name"] == optimizer and o["batch_size"] == batch
      assert o["num_epochs"] == bert.epochs
      assert o["schedule"]["warmup_epochs"] == pytest.approx(bert.warmup_fraction * bert.epochs)
  with pytest.raises(ValueError, match="lamb_lr=0.123 is not a candidate"):
    t2_bert.get_config("lamb_lr=0.123")


def test_t1_rows_cover_every_registered_method_and_keep_their_own(tmp_path):
  """Today's rows keep their labels and settings (results are keyed by them); every registered
  method without one gets a row of its defaults under its name, also one registered later."""
  rows = t1_mnist1d.rows()
  assert list(rows)[:len(t1_mnist1d.ROWS)] == list(t1_mnist1d.ROWS)
  assert all(rows[label] == settings for label, settings in t1_mnist1d.ROWS.items())
  assert list(t1_mnist1d.ROWS) == [
      "dense", "topk_d0.01", "topk_d0.001", "topk_d0.01_noef", "topk_d0.001_noef",
      "randomk_d0.01", "dgc_d0.001", "qsgd_s16", "terngrad", "signsgd", "efsignsgd", "onebit",
      "powersgd_r2", "tasc_d0.01_hutchinson", "tasc_d0.01_fisher", "tasc_d0.01_none",
      "tasc_d0.001_hutchinson", "tasc_d0.001_fisher", "tasc_d0.001_none",
      "tasc_d0.016_hutchinson_f16"]
  assert {label: rows[label] for label in rows if label not in t1_mnist1d.ROWS} == {
      m: {"method": m} for m in ("fp16", "bf16", "int8", "int4", "chunk_topk", "threshold",
                                 "demo", "onebit_adam", "diloco", "sparseloco",
                                 "streaming_diloco")}
  assert {settings["method"] for settings in rows.values()} == set(registry.names())
  plugin = registry.register(registry.Method(
      name="plugin_dense", summary="dense under another name (a plugin of this test)",
      settings=registry.NoSettings, compressor=lambda s: compressors.dense(),
      error_feedback=False, cost=registry.get("dense").cost)).name
  try:
    assert list(t1_mnist1d.rows())[-1] == plugin
    assert t1_mnist1d.rows()[plugin] == {"method": plugin}
    assert [r["name"] for r in t1_mnist1d.get_config("seeds=1").runs][-1] == f"{plugin}_s0"
    config = mnist1d.get_config(t1_mnist1d.config_arg(plugin))
    validation.check_config(config, 8)
    assert config.method == plugin
    cifar = {r["name"]: r for r in t1_cifar10.get_config("seeds=1").runs}
    assert cifar[f"{plugin}_s0"]["config"].endswith(f":method={plugin}")
    table = t1_target.report(str(tmp_path), seeds=1, full=False)
    assert [r["method"] for r in table.rows][-1] == plugin
    assert table.rows[-1]["status"] == "0/1 seeds done"
  finally:
    registry.unregister(plugin)
  assert plugin not in t1_mnist1d.rows()


@pytest.mark.parametrize("layout, available", [
    ((), False), (("data_batch_1", "data_batch_5", "test_batch"), True),
    (("cifar-10-batches-py/data_batch_1", "cifar-10-batches-py/data_batch_5",
      "cifar-10-batches-py/test_batch"), True), (("data_batch_1",), False)])
def test_cifar10_detection(tmp_path, layout, available):
  for name in layout:
    (tmp_path / name).parent.mkdir(exist_ok=True)
    (tmp_path / name).write_text("")
  assert t1_cifar10_target.available(str(tmp_path)) is available
  assert t1_cifar10_target.available("") is False


# ----------------------------------------------------------------------------- fake runs


def _fake_run(path, *, accuracy, ratio=None, wire=None, losses=(), finished=True, **results):
  records = [{"step": 10 * (i + 1), "loss": loss} for i, loss in enumerate(losses)]
  if ratio is not None:
    records.append({"step": 10 * (len(losses) + 1), "compression_ratio": ratio,
                    "wire_bytes": wire, "dense_bytes": wire * ratio})
  os.makedirs(path)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump({"method": os.path.basename(path)}, f)
  with open(os.path.join(path, "metrics.jsonl"), "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in records)
  if finished:
    with open(os.path.join(path, "results.json"), "w") as f:
      json.dump({"test_accuracy": accuracy, "train_loss": 0.1, "step": 60, **results}, f)


@pytest.fixture
def t1_dir(tmp_path):
  """dense (3 seeds), topk_d0.001 (2 finished + 1 unfinished), tasc 0.1% hutchinson (3)."""
  workdir = tmp_path / "t1"
  for seed, acc in enumerate((0.90, 0.92, 0.94)):
    _fake_run(workdir / f"dense_s{seed}", accuracy=acc, ratio=1.0, wire=1000.0)
    _fake_run(workdir / f"tasc_d0.001_hutchinson_s{seed}", accuracy=acc - 0.005, ratio=140.0,
              wire=1000 / 140)
  for seed, acc in enumerate((0.80, 0.84)):
    _fake_run(workdir / f"topk_d0.001_s{seed}", accuracy=acc, ratio=125.0, wire=8.0)
  _fake_run(workdir / "topk_d0.001_s2", accuracy=0.0, ratio=125.0, wire=8.0, finished=False)
  (workdir / common.FAILURES_FILE).write_text(json.dumps(
      {"powersgd_r2_s0": "ValueError: broken"}))
  return str(workdir)


def test_compression_rows_from_run_directories(t1_dir):
  rows = {r["method"]: r for r in t1_target.compression_rows(
      t1_dir, ["dense", "topk_d0.001", "tasc_d0.001_hutchinson", "powersgd_r2"], 3)}
  dense, topk = rows["dense"], rows["topk_d0.001"]
  assert dense["seeds"] == 3 and dense["status"] == "3/3 seeds done"
  assert dense["accuracy_mean"] == pytest.approx(92.0)
  assert dense["accuracy_std"] == pytest.approx(np.std([90, 92, 94], ddof=1))
  assert dense["test_accuracy"] == "92.00 ± 2.00 (n=3)"
  assert topk["seeds"] == 2 and topk["status"] == "2/3 seeds done"  # the unfinished one is out
  assert topk["vs_dense"] == pytest.approx(82.0 - 92.0)
  assert topk["compression_ratio"] == 125.0 and topk["wire_bytes"] == 8.0
  assert topk["run_dirs"].split() == [os.path.join(t1_dir, f"topk_d0.001_s{s}") for s in (0, 1)]
  assert rows["tasc_d0.001_hutchinson"]["vs_dense"] == pytest.approx(-0.5)
  assert rows["powersgd_r2"]["seeds"] == 0
  assert rows["powersgd_r2"]["status"] == "failed: ValueError: broken"


@pytest.mark.parametrize("tasc_delta, ratio, reproduced", [
    (-0.005, 140.0, True), (-0.02, 140.0, False), (-0.005, 60.0, False)])
def test_tasc_verdict(tmp_path, tasc_delta, ratio, reproduced):
  for seed in range(2):
    _fake_run(tmp_path / f"dense_s{seed}", accuracy=0.9, ratio=1.0, wire=1.0)
    _fake_run(tmp_path / f"tasc_d0.01_none_s{seed}", accuracy=0.9 + tasc_delta, ratio=ratio,
              wire=1 / ratio)
  rows = t1_target.compression_rows(str(tmp_path), ["dense", "tasc_d0.01_none"], 2)
  assert t1_target.tasc_verdict(rows).reproduced is reproduced


def test_tasc_search_selects_by_training_loss_and_compares_same_recipe(tmp_path):
  runs = {  # row -> (train loss, test accuracy, ratio)
      "dense_adam": (0.01, 0.98, 1.0), "dense_adam_lr3e-3": (0.02, 0.97, 1.0),
      "tasc_d0.005_b512_fisher_adam": (0.30, 0.90, 139.0),
      "tasc_d0.005_b512_fisher_adam_lr3e-3": (0.20, 0.95, 139.0),  # lowest loss at >= 100x
      "tasc_d0.001_b256_fisher_adam": (0.10, 0.99, 60.0),  # lower loss, but < 100x
  }
  for row, (loss, acc, ratio) in runs.items():
    _fake_run(tmp_path / t1_tasc_search.run_name(row, 0), accuracy=acc, ratio=ratio, wire=1.0,
              train_loss=loss)
  rows = t1_target.search_rows(str(tmp_path), seeds=3)
  assert t1_target.select_tasc_row(rows) == "tasc_d0.005_b512_fisher_adam_lr3e-3"
  by = {r["method"]: r for r in rows}
  assert by["tasc_d0.005_b512_fisher_adam_lr3e-3"]["vs_dense_same_recipe"] == pytest.approx(-2.0)
  assert by["tasc_d0.005_b512_fisher_adam"]["vs_dense_same_recipe"] == pytest.approx(-8.0)
  assert by["dense_adam_warmup10"]["seeds"] == 0
  text, _, selected = t1_target.search_section(str(tmp_path), 3)
  assert selected in text and "lowest final training loss" in text
  sweep = t1_tasc_search.get_config("seeds=3,rows=" + selected + "+dense_adam_lr3e-3")
  assert [r["name"] for r in sweep.runs][-1] == "dense_adam_lr3e-3_s2"
  assert "optimizer=adam,lr=0.003" in sweep.runs[0]["config"]


def test_t1_report_writes_markdown_csv_and_png(t1_dir, tmp_path):
  report = t1_target.report(t1_dir, seeds=3, full=False)
  out = tmp_path / "figures"
  written = reproduce_report.write_report(report, PROV, out)
  assert sorted(p.name for p in written) == ["t1.csv", "t1.md", "t1.png"]
  md = (out / "t1.md").read_text()
  for text in (PROV.command, PROV.commit, "configs/paper/t1_mnist1d.py", "270x-600x",
               "Error feedback by default: int8, int4, topk, chunk_topk, randomk, threshold, dgc, "
               "efsignsgd, "
               "onebit, "
               "powersgd, tasc;",
               "136x", "93.27%", "92.00 ± 2.00 (n=3)", os.path.join(t1_dir, "dense_s2"),
               "![t1](t1.png)"):
    assert text in md
  # TASC 140x at -0.5 points: the project's target is met, and said so.
  assert "| yes: mean over seeds" in md
  lines = (out / "t1.csv").read_text().splitlines()
  comments = [line for line in lines if line.startswith("#")]
  assert any(PROV.commit in line for line in comments)
  assert any("claim: DGC" in line for line in comments)
  rows = list(csv.DictReader(line for line in lines if not line.startswith("#")))
  assert [r["method"] for r in rows] == list(t1_mnist1d.rows())
  assert float(rows[0]["accuracy_mean"]) == pytest.approx(92.0)
  assert rows[0]["run_dirs"].count("dense_s") == 3
  assert (out / "t1.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_csv_writes_lists_and_tuples_as_json(tmp_path):
  # A row's losses and the corpora it trained on (t1_lm.data_of): JSON, which any reader parses.
  data = (("5764bb67", "d92e8bd6"),)
  report = reproduce_report.Report(
      "x", "X", [("row", "Row")],
      [{"row": "a", "losses": [4.5, np.float32(4.25)], "data": data, "n": 2}])
  reproduce_report.write_report(report, PROV, tmp_path)
  lines = (tmp_path / "x.csv").read_text().splitlines()
  [row] = csv.DictReader(line for line in lines if not line.startswith("#"))
  assert json.loads(row["losses"]) == [4.5, 4.25]
  assert json.loads(row["data"]) == [["5764bb67", "d92e8bd6"]]
  assert row["n"] == "2"


@pytest.mark.parametrize("hutchinson, reproduced", [(0.2, True), (0.6, False)])
def test_f4_report_curves_and_claim(tmp_path, hutchinson, reproduced):
  levels = {"tasc_d0.01_hutchinson": hutchinson, "tasc_d0.01_fisher": 0.3,
            "tasc_d0.01_none": 0.5, "topk_d0.01": 0.1}
  for method, level in levels.items():
    for seed in range(2):
      _fake_run(tmp_path / f"{method}_s{seed}", accuracy=0.9, ratio=50.0, wire=1.0,
                losses=[1.0] * 9 + [level * (1 + seed)])
  report = f4_target.report(str(tmp_path), seeds=2, full=False)
  rows = {r["method"]: r for r in report.rows}
  # The last 10% of 10 logged losses is the last one; mean over seeds of level * (1 + seed).
  for method, level in levels.items():
    assert rows[method]["late_loss_mean"] == pytest.approx(1.5 * level)
  [claim] = report.claims
  assert claim.reproduced is reproduced
  written = reproduce_report.write_report(report, PROV, tmp_path / "out")
  assert sorted(p.name for p in written) == ["f4.csv", "f4.md", "f4.png"]


def _t2_runs(tmp_path, accuracy, bert):
  """Fake T2 run directories: MNIST-1D (optimizer, batch) -> accuracy (seed 0), BERT
  (optimizer, batch, base rate) -> (held-out loss, train loss)."""
  for (optimizer, batch), acc in accuracy.items():
    run_dir = tmp_path / "t2_mnist1d" / t2_mnist1d.run_name(optimizer, batch, 0)
    result = {"test_accuracy": acc, "train_loss": 2.3026 if acc < 0.15 else 0.1, "step": 10}
    reproduce_report.write_run(run_dir, {"optimizer": {"learning_rate": 0.1}},
                               [{"step": 10, **result}], result)
  for (optimizer, batch, base), (loss, train_loss) in bert.items():
    run_dir = tmp_path / "t2_bert" / t2_bert.run_name(optimizer, batch, base)
    config = {"optimizer": {"learning_rate": base},
              "model": {"num_layers": 2, "hidden": 128, "num_heads": 2},
              "data": {"seq_len": 128, "eval_fraction": 0.05}}
    reproduce_report.write_run(run_dir, config, [],
                               {"test_loss": loss, "train_loss": train_loss, "step": 7,
                                "num_params": 1036640})


@pytest.mark.parametrize("lars_large, lamb_bert, expected", [
    (0.85, 4.0, [True, True, None, True]),   # LARS and LAMB hold up; LAMB beats Adam on BERT
    (0.10, 6.0, [True, False, None, False]),  # LARS dies like SGD; LAMB loses to Adam on BERT
])
def test_t2_report(tmp_path, lars_large, lamb_bert, expected):
  settings = t2.get_config()
  small, large = min(settings.mnist1d.batch_sizes), max(settings.mnist1d.batch_sizes)
  smallest, big = min(settings.bert.batch_sizes), max(settings.bert.batch_sizes)
  accuracy = {("sgd", small): 0.9, ("sgd", large): 0.1, ("adam", small): 0.9,
              ("adam", large): 0.7, ("lamb", small): 0.9, ("lamb", large): 0.88,
              ("lars", small): 0.9, ("lars", large): lars_large}
  # Rate selection at the smallest batch (train loss decides, not held-out loss): adam 3e-3,
  # lamb 1e-2 (its 5e-2 failed).
  bert = {("adam", smallest, 1e-3): (5.5, 5.0), ("adam", smallest, 3e-3): (5.6, 4.5),
          ("lamb", smallest, 2e-3): (7.0, 7.5), ("lamb", smallest, 1e-2): (5.0, 4.0),
          ("adam", big, 3e-3): (5.0, 5.0), ("lamb", big, 1e-2): (lamb_bert, lamb_bert)}
  _t2_runs(tmp_path, accuracy, bert)
  (tmp_path / "t2_bert" / common.FAILURES_FILE).write_text(json.dumps(
      {t2_bert.run_name("lamb", smallest, 5e-2): "ValueError: broken"}))
  assert t2_target.select_bert_rates(settings.bert, str(tmp_path / "t2_bert")) == {
      "adam": 3e-3, "lamb": 1e-2}
  report = t2_target.report(str(tmp_path), settings, full=False)
  rows = [r for r in report.rows if r["mean"] is not None]
  assert len(rows) == len(accuracy) + 4 + 2 + 2  # selection, then main rows at 32 and 256
  lamb_large = next(r for r in rows if r["optimizer"] == "lamb" and r["batch_size"] == large)
  assert lamb_large["value"] == "88.00 ± 0.00 (n=1)" and lamb_large["status"] == "1/2 seeds done"
  assert lamb_large["run_dirs"].endswith(f"lamb_b{large}_s0")
  assert lamb_large["steps"] == 10 and lamb_large["peak_learning_rate"] == 0.1
  assert [c.reproduced for c in report.claims] == expected
  assert "sgd +80.0" in report.claims[0].ours and "lamb +2.0" in report.claims[0].ours
  assert f"batch {big}: adam 5.000, lamb {lamb_bert:.3f}" in report.claims[-1].ours
  selection = {(r["optimizer"], r["peak_learning_rate"] or r["task"]): r["status"]
               for r in report.rows if "selection" in r["task"]}
  assert selection[("adam", 3e-3)] == "chosen" and selection[("adam", 1e-3)] == "candidate"
  assert "failed: ValueError: broken" in selection.values()
  main = {(r["optimizer"], r["batch_size"]): r for r in report.rows
          if r["task"].startswith("BERT-tiny masked")}
  assert main["adam", smallest]["run_dirs"].endswith("adam_b32_lr0.003")
  assert main["adam", big]["status"] == "done" and main["adam", 64]["status"] == "not run"
  # Settings in the notes come from the configs and the runs, not from hand-written text.
  notes = " ".join(report.notes)
  dead = "sgd at 4096, lars at 4096" if lars_large < 0.15 else "sgd at 4096."
  assert f"Here: {dead}" in notes
  assert f"first {settings.bert.warmup_fraction:.0%} of training" in notes
  assert "1,036,640 parameters" in notes
  assert "adam 0.001, 0.003 (chosen: 0.003); lamb 0.002, 0.01, 0.05 (chosen: 0.01)" in notes
  assert "The chosen rate of adam is the largest candidate" in notes  # lamb's is not
  written = reproduce_report.write_report(report, PROV, tmp_path / "out")
  assert sorted(p.name for p in written) == ["t2.csv", "t2.md", "t2.png"]
  md = (tmp_path / "out" / "t2.md").read_text()
  for text in ("91.46", "You, Gitman & Ginsburg 2017", "Nado et al. 2021",
               "configs/paper/t2_bert.py", "configs/paper/t2_mnist1d.py",
               "lars 3 (linear, optimizers.lars"):
    assert text in md


def test_bert_rate_waits_for_every_candidate(tmp_path):
  bert = t2.get_config().bert
  smallest = min(bert.batch_sizes)
  _t2_runs(tmp_path, {}, {("adam", smallest, 1e-3): (5.0, 5.0),
                          ("lamb", smallest, 2e-3): (7.0, 7.0),
                          ("lamb", smallest, 1e-2): (float("nan"), float("nan")),
                          ("lamb", smallest, 5e-2): (6.0, 6.5)})
  # adam's 3e-3 has not run: adam waits. lamb's 1e-2 ended non-finite: not a choice.
  bert_dir = str(tmp_path / "t2_bert")
  assert t2_target.select_bert_rates(bert, bert_dir) == {"lamb": 5e-2}
  report = t2_target.report(str(tmp_path), t2.get_config(), full=False)
  adam = [r["status"] for r in report.rows
          if r["task"].startswith("BERT-tiny masked") and r["optimizer"] == "adam"]
  assert adam == ["rate not chosen yet"] * len(bert.batch_sizes)
  # No MNIST-1D run has finished: the figure is drawn all the same.
  written = reproduce_report.write_report(report, PROV, tmp_path / "out")
  assert sorted(p.name for p in written) == ["t2.csv", "t2.md", "t2.png"]


def test_run_t2_bert_runs_selection_then_the_chosen_rates(tmp_path, monkeypatch):
  bert = t2.get_config().bert
  sweeps = []

  def fake_sweep(sweep, workdir, jobs=1):
    names = [r["name"] for r in sweep.runs]
    sweeps.append(names)
    for name in names:  # every run finishes; the middle candidate has the lowest train loss
      optimizer, _, lr = name.split("_")
      loss = 1.0 if float(lr[2:]) == bert.learning_rates[optimizer][1] else 2.0
      reproduce_report.write_run(os.path.join(workdir, name), {"optimizer": {}}, [],
                                 {"train_loss": loss, "test_loss": loss, "step": 1})
    return {}

  monkeypatch.setattr(common, "run_sweep_config", fake_sweep)
  t2_target.run_bert(bert, str(tmp_path), full=False)
  assert len(sweeps) == 2 and len(sweeps[0]) == 5
  assert sweeps[1][len(sweeps[0]):] == [
      t2_bert.run_name(o, b, bert.learning_rates[o][1]) for o in bert.optimizers
      for b in bert.batch_sizes[1:]]


@pytest.mark.slow  # a minute of training; the sweep's skip and refusal are tested without training
def test_t2_mnist1d_trains_through_the_runner_skips_finished_runs_and_rejects_changed_ones(
    tmp_path):
  """The sweep ``--target=t2`` runs for MNIST-1D, in its smoke variant: every optimizer trains in
  a child process (``--jobs=2``, as by default), the table reads the runs; a second call trains
  nothing, and a finished run whose settings changed is not passed off as the new one's."""
  settings = t2.get_config()
  workdir = str(tmp_path / "t2_mnist1d")
  assert t2_target.run_mnist1d(workdir, full=False, jobs=2, smoke=True) == {}
  names = [r["name"] for r in t2_mnist1d.get_config("smoke").runs]
  assert names == [t2_mnist1d.run_name(o, b, 0) for o in settings.mnist1d.optimizers
                   for b in (128, 256)]
  report = t2_target.report(str(tmp_path), settings, full=False)
  rows = {(r["optimizer"], r["batch_size"]): r for r in report.rows if r["task"] == "MNIST-1D MLP"}
  for optimizer in settings.mnist1d.optimizers:
    row = rows[optimizer, 256]
    assert row["status"] == "1/2 seeds done" and row["steps"] == 2 and 0 <= row["mean"] <= 100
    assert row["peak_learning_rate"] == pytest.approx(
        large_batch.peak_learning_rate(optimizer, 256))
  assert rows["sgd", 4096]["status"] == "0/2 seeds done"
  reproduce_report.write_report(report, PROV, tmp_path / "out")  # no BERT runs: plots anyway
  results = os.path.join(workdir, "lamb_b128_s0", reproduce_report.RESULTS_FILE)
  written = os.stat(results).st_mtime_ns
  assert t2_target.run_mnist1d(workdir, full=False, jobs=2, smoke=True) == {}
  assert os.stat(results).st_mtime_ns == written
  config = os.path.join(workdir, "lamb_b128_s0", "config.json")
  stored = json.loads(open(config).read())
  stored["optimizer"]["learning_rate"] /= 2  # trained with another rate than the recipe's
  with open(config, "w") as f:
    json.dump(stored, f)
  with pytest.raises(ValueError, match=r"lamb_b128_s0.*holds a checkpoint \(step 2\) of another "
                                       r"config \(optimizer.learning_rate: 0.005 there, 0.01 now"):
    t2_target.run_mnist1d(workdir, full=False, jobs=2, smoke=True)


@pytest.mark.parametrize("arg", [None, "full=true"])
def test_t2_mnist1d_runs_are_valid_runner_configs_with_the_recipes(arg):
  settings = t2.get_config(arg).mnist1d
  sweep = t2_mnist1d.get_config(arg)
  runs = {r["name"]: r["config"] for r in sweep.runs}
  assert len(runs) == len(sweep.runs) == (settings.seeds * len(settings.optimizers)
                                          * len(settings.batch_sizes))
  for optimizer in settings.optimizers:
    recipe = large_batch.RECIPES[optimizer]
    for batch in settings.batch_sizes:
      spec = runs[t2_mnist1d.run_name(optimizer, batch, settings.seeds - 1)]
      path, _, config_arg = spec.partition(":")
      assert path == t2_mnist1d.CONFIG
      config = large_batch.get_config(config_arg)
      validation.check_config(config, 8)
      ratio = batch / large_batch.BASE_BATCH_SIZE
      scale = ratio if recipe.scaling_rule == "linear" else math.sqrt(ratio)
      assert config.optimizer.learning_rate == pytest.approx(recipe.base_learning_rate * scale)
      assert config.optimizer.name == recipe.optimizer["name"]
      assert (config.dataset, config.model.name, config.method) == ("mnist1d", "mlp", "dense")
      assert config.data.num_samples == settings.num_samples
      assert config.batch_size == batch and config.seed == settings.seeds - 1
      assert config.num_epochs == settings.epochs and config.num_steps == 0
      assert config.schedule.name == "warmup_poly" and config.schedule.power == (
          recipe.decay_power)
      assert config.schedule.warmup_epochs == pytest.approx(0.1 * settings.epochs)
  assert large_batch.RECIPES["lars"].decay_power == 2 and large_batch.RECIPES["sgd"].optimizer[
      "momentum"] == 0.9
  with pytest.raises(ValueError, match="optimizer='rmsprop'"):
    large_batch.get_config("optimizer=rmsprop")


@pytest.mark.parametrize("full", [False, True])
def test_quick_and_full_settings_keep_separate_run_folders(full):
  mnist_dir, bert_dir = t2_target.runs_dirs("runs/paper", full)
  suffix = "_full" if full else ""
  assert (mnist_dir, bert_dir) == (f"runs/paper/t2_mnist1d{suffix}", f"runs/paper/t2_bert{suffix}")
  quick, other = t2.get_config(), t2.get_config("full=true")
  assert quick.mnist1d.epochs != other.mnist1d.epochs  # hence the separate folders
  assert quick.bert.epochs != other.bert.epochs


# ----------------------------------------------------------------------------- F1, F2, F3


def _f1_rows(n, *, failed=()):
  """Fake rows of one F1 worker count: top-k linear in n, the others flat; ``failed`` methods
  carry a child's error instead of bytes."""
  rows = []
  for size in ("resnet50", "bert_base"):
    for method, b in (("dense", 700.0), ("topk", 2.0 * (n - 1)), ("tasc", 10.0),
                      ("onebit", 700 / 32), ("tasc_hierarchical", 10.0 / 8)):
      row = {"workers": n, "size": size, "method": method, "elements": 100}
      if method in failed:
        row["error"] = "RuntimeError: broken"
      elif method == "tasc_hierarchical" and n < 16:
        row["skipped"] = "needs a multiple of 8 workers, at least 16"
      else:
        row.update(bytes_per_device=b, slow_axis_bytes=b)
      rows.append(row)
  return rows


def test_f1_report_from_run_directories(tmp_path):
  settings = f1.get_config()
  for n in (2, 256):
    rows = _f1_rows(n)
    reproduce_report.write_run(tmp_path / f1_target.run_name(n), {"workers": n},
                               [{"step": 0, **r} for r in rows], {"rows": rows})
  report = f1_target.report(settings, str(tmp_path), full=False)
  table = {(r["size"], r["method"]): r for r in report.rows}
  topk = table["resnet50", "topk"]
  assert topk["n2"] == pytest.approx(2e-6) and topk["n256"] == pytest.approx(510e-6)
  assert "n8" not in topk  # not measured: the table shows '-'
  assert topk["run_dirs"].split() == [os.path.join(str(tmp_path), f"workers_{n:03d}")
                                      for n in (2, 256)]
  assert table["bert_base", "tasc_hierarchical"]["n2"] == "n/a"
  assert [c.reproduced for c in report.claims] == [True, True, True, True]
  assert "x255.0 from 2 to 256 workers" in report.claims[0].ours
  assert "dense / 1-bit 32.0x" in report.claims[2].ours
  assert "resnet50 8.0x at 256 workers" in report.claims[3].ours
  reproduce_report.write_report(report, PROV, tmp_path / "out")


@pytest.mark.parametrize("onebit, hierarchical, expected", [
    (700 / 16, 10.0 / 8, [True, True, False, True]),  # 16x: not the 2 x 1/32 of 1-bit Adam
    (700 / 32, 5.0, [True, True, True, False]),  # crossing nodes saves only 2x
])
def test_f1_claims_can_fail(onebit, hierarchical, expected):
  rows = [dict(r, slow_axis_bytes={"onebit": onebit, "tasc_hierarchical": hierarchical}.get(
      r["method"], r.get("slow_axis_bytes"))) for n in (2, 256) for r in _f1_rows(n)]
  rows = [r for r in rows if r["method"] != "tasc_hierarchical" or r["workers"] >= 16]
  assert [c.reproduced for c in f1_target.claims(rows)] == expected


def test_run_f1_skips_finished_counts_and_retries_failed_ones(tmp_path, monkeypatch):
  settings = f1.get_config()
  settings.workers = (2, 8, 16)
  calls = []

  def fake(workers, sizes, methods, timeout_s, log):
    calls.append(workers[0])
    return _f1_rows(workers[0], failed=("onebit",) if len(calls) == 1 else ())

  monkeypatch.setattr(bench_bytes, "bytes_vs_workers", fake)
  f1_target.measure(settings, str(tmp_path))
  assert calls == [2, 8, 16]
  report = f1_target.report(settings, str(tmp_path), full=False)
  onebit = next(r for r in report.rows if r["size"] == "resnet50" and r["method"] == "onebit")
  assert onebit["n2"] == "failed: RuntimeError: broken" and onebit["n8"] == pytest.approx(
      700 / 32 / 1e6)
  f1_target.measure(settings, str(tmp_path))  # only the count with a failed row again
  assert calls == [2, 8, 16, 2]
  f1_target.measure(settings, str(tmp_path))
  assert calls == [2, 8, 16, 2]


def test_f1_benchmark_agreement(tmp_path):
  rows = [{"workers": 2, "size": "resnet50", "method": m, "slow_axis_bytes": b}
          for m, b in (("dense", 100.0), ("topk", 4.0), ("tasc", None))]
  bench = tmp_path / "bytes.json"
  bench.write_text(json.dumps({"data": [
      {"workers": 2, "size": "resnet50", "method": "dense", "slow_axis_bytes": 100.0},
      {"workers": 2, "size": "resnet50", "method": "topk", "slow_axis_bytes": 6.0}]}))
  text = f1_target.benchmark_agreement(rows, str(bench))
  assert text.startswith("1 of 2 measured cells equal")
  assert "topk at 2: 4 here, 6 there" in text
  assert "not found" in f1_target.benchmark_agreement(rows, str(tmp_path / "none.json"))


def test_tasc_cost_matches_the_ring_formula():
  alpha, beta, p = 1e-4, 1e-9, 4
  t = topo.Topology.flat(p, topo.Link(alpha=alpha, bandwidth=1 / beta))
  n, density, block = 1 << 20, 0.01, 256
  blocks = n // block
  payload = round(density * blocks) * block

  def ring(elements):  # Thakur et al.: 2(p-1) alpha + 2(p-1)/p n beta (gamma 0)
    return 2 * (p - 1) * alpha + 2 * (p - 1) / p * 4 * elements * beta

  seconds, _, schedules = f2_target.tasc_cost(t, n, density, block)
  best = [topo.dense_cost(s, t, e).time for s, e in zip(schedules.split("+"), (blocks, payload))]
  assert seconds == pytest.approx(sum(best))
  assert seconds <= ring(blocks) + ring(payload) * (1 + 1e-9)  # the fastest is no slower


def _f2_run(path):
  records = [
      {"part": "vgg", "model": "vgg19_cifar", "parameters": 20, "nodes": 1, "gpus": 8,
       "density": 0.01, "dense_ring_s": 3.0, "dense_best_s": 2.0, "dense_best_schedule": "ring",
       "tasc_s": 1.0, "tasc_schedules": "ring+ring", "tasc_bytes": 1.0,
       "speedup_vs_ring": 3.0, "speedup_vs_best_dense": 2.0},
      {"part": "scaling", "model": "resnet50", "parameters": 25, "nodes": 64, "gpus": 512,
       "scheme": "dense ring", "compute_s": 0.2, "comm_s": 0.2, "efficiency": 0.5,
       "speedup": 256.0, "speedup_overlapped": 512.0},
      {"part": "sparse", "model": "resnet50", "parameters": 25, "topology": "x", "nodes": 2,
       "gpus": 16, "density": 0.01, "dense_ring_s": 1.0, "tasc_s": 0.02, "tasc_schedules": "r",
       "speedup_vs_ring": 50.0, "sparse_butterfly_s": 0.1, "sparse_butterfly_speedup": 10.0},
  ]
  reproduce_report.write_run(path, {}, [{"step": i, **r} for i, r in enumerate(records)], {})


def test_f2_report_claims(tmp_path):
  _f2_run(tmp_path)
  report = f2_target.report(f2.get_config(), str(tmp_path), full=False)
  assert [c.reproduced for c in report.claims] == [True, None, False, True]
  assert "up to 50x" in report.claims[-1].ours
  reproduce_report.write_report(report, PROV, tmp_path / "out")


def _texts(fig):
  return [t for t in fig.findobj(mtext.Text) if t.get_visible() and t.get_text().strip()]


def test_figures_name_the_families_and_have_no_small_or_overlapping_labels(
    t1_dir, tmp_path, monkeypatch):
  """T1 (with three methods at one ratio and nearly one accuracy) and F2: every text at least 8
  points, no two point labels overlapping, a legend for T1's method families; the footer of a
  written figure at 8 points too."""
  for accuracy, method in ((0.962, "signsgd"), (0.965, "efsignsgd"), (0.967, "onebit")):
    for seed in range(3):
      _fake_run(os.path.join(t1_dir, f"{method}_s{seed}"), accuracy=accuracy, ratio=32.0,
                wire=1000 / 32)
  _f2_run(tmp_path / "f2")
  t1 = t1_target.report(t1_dir, seeds=3, full=False)
  for report in (t1, f2_target.report(f2.get_config(), str(tmp_path / "f2"), full=False)):
    fig = figure.Figure(figsize=reproduce_report.PLOT_SIZE)
    report.plot(fig)
    fig.draw_without_rendering()
    assert min(t.get_fontsize() for t in _texts(fig)) >= 8, report.name
    for ax in fig.axes:
      boxes = [t.get_window_extent() for t in ax.texts if isinstance(t, mtext.Annotation)]
      assert not [(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:] if a.overlaps(b)]
    if report is t1:
      assert len(fig.axes[0].texts) == 6  # dense, topk, tasc and the three at 32x
      assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == [
          "dense (no compression)", "TASC", "other compressors", "100x"]
  drawn = []
  monkeypatch.setattr(figure.Figure, "savefig", lambda self, *args, **kwargs: drawn.append(self))
  reproduce_report.write_report(t1, PROV, tmp_path / "out")
  [fig] = drawn
  assert min(t.get_fontsize() for t in _texts(fig)) >= 8


def test_f3_report_skipped_and_measured(tmp_path):
  settings = f3.get_config()
  skipped = f3_target.report(settings, str(tmp_path), full=False, skipped="no netns")
  assert skipped.rows == [] and skipped.plot is None
  assert skipped.notes[0].startswith("SKIPPED: no netns")
  assert all(c.reproduced is None and c.ours == "not measured" for c in skipped.claims)
  rows = [{"processes": 2, "method": "dense", "seconds": 2.0, "speedup": 1.0,
           "predicted_s": 1.6, "compute_seconds": 0.1, "bytes_per_device": 8.0},
          {"processes": 2, "method": "tasc", "seconds": 0.5, "speedup": 4.0,
           "predicted_s": 0.1, "compute_seconds": 0.3, "bytes_per_device": 1.0}]
  reproduce_report.write_run(tmp_path / f3_target.run_name(2, "1gbit"), {},
                             [{"step": 0, **r} for r in rows],
                             {"calibration": {"fitted_rate_bits": 0.95e9}, "rows": rows})
  report = f3_target.report(settings, str(tmp_path), full=False, skipped=None)
  assert [r["model_over_measured"] for r in report.rows] == [pytest.approx(0.8),
                                                              pytest.approx(0.2)]
  assert report.rows[1]["predicted_plus_compute_s"] == pytest.approx(0.4)
  # 4x at 1 Gbit/s: short of the 11x claim; the fast-link and two-rate claims need 10 Gbit/s.
  assert [c.reproduced for c in report.claims] == [True, False, None, None]
  assert report.claims[1].ours.startswith("4.0x at 1gbit (2 processes, fitted 0.95 Gbit/s")
  out = reproduce_report.write_report(report, PROV, tmp_path / "out")
  assert len(out) == 3


@pytest.mark.parametrize("fast_speedup, expected", [(1.5, True), (5.0, False)])
def test_f3_claim_compression_pays_less_on_a_faster_link(fast_speedup, expected):
  rows = [{"processes": p, "rate": rate, "method": "tasc", "speedup_vs_dense": speedup,
           "model_over_measured": None, "fitted_gbit": 1.0}
          for p in (2, 4) for rate, speedup in (("10gbit", fast_speedup), ("1gbit", 4.0))]
  claims = f3_target.claims(rows)
  assert [c.reproduced for c in claims[1:3]] == [False, fast_speedup >= 2.6]  # 4x < 11x
  assert claims[2].ours.startswith(f"{fast_speedup:.1f}x at 10gbit (4 processes")
  claim = claims[-1]
  assert claim.reproduced is expected
  assert claim.ours.startswith(f"2 processes: TASC 4.0x faster than dense at 1gbit, "
                               f"{fast_speedup:.1f}x at 10gbit")


def _calibration(processes, rate_bits):
  sizes = [1 << 20, 4 << 20]
  return calibrate.Calibration(
      processes=processes, rate_bits=rate_bits, message_bytes=sizes,
      measured={"pingpong": [0.01, 0.04]}, allreduce_elements=1000, allreduce_seconds=0.1,
      alpha=1e-4, beta=8 / rate_bits, gamma=1e-10, concurrency=float(processes), shared=True,
      predicted={"pingpong": [0.01, 0.04], "allreduce": 0.09})


def test_run_f3_records_failures_and_retries_them(tmp_path, monkeypatch):
  settings = f3.get_config()
  attempts, broken = [], [(4, 1e9)]  # fails once

  def fake_calibrate(processes, rate_bits, **kwargs):
    attempts.append((processes, rate_bits))
    if (processes, rate_bits) in broken:
      broken.remove((processes, rate_bits))
      raise RuntimeError("calibrate: worker 1 exited with 1; its log ends:\nboom")
    return _calibration(processes, rate_bits)

  def fake_link_times(processes, elements, methods, *, rate_bits, repeats, timeout_s, log):
    p = processes[0]
    if (p, rate_bits) == (2, 1e10):
      return [{"processes": p, "method": m, "seconds": "skipped: not finished within 1 s"}
              for m in methods]
    return [{"processes": p, "method": m, "seconds": 1.0 / (i + 1), "compute_seconds": 0.01,
             "speedup": i + 1.0, "bytes_per_device": 100.0 / (i + 1)}
            for i, m in enumerate(methods)]

  monkeypatch.setattr(calibrate, "netns_available", lambda: (True, ""))
  monkeypatch.setattr(calibrate, "calibrate", fake_calibrate)
  monkeypatch.setattr(bench_links, "link_times", fake_link_times)
  assert f3_target.measure(settings, str(tmp_path), log=lambda *a: None) is None
  failures = common.read_failures(str(tmp_path))
  assert failures == {"p4_1gbit": "calibration: RuntimeError: calibrate: worker 1 exited with 1; "
                                  "its log ends:",
                      "p2_10gbit": "timing (dense): skipped: not finished within 1 s"}
  report = f3_target.report(settings, str(tmp_path), full=False, skipped=None)
  failed = [r for r in report.rows if r["status"] != "measured"]
  assert [(r["processes"], r["rate"]) for r in failed] == [(2, "10gbit"), (4, "1gbit")]
  assert len(report.rows) == 2 * len(settings.methods) + 2
  dense = next(r for r in report.rows if r["status"] == "measured" and r["method"] == "dense")
  assert dense["predicted_s"] > 0 and dense["fitted_gbit"] == pytest.approx(1.0)
  # The next run retries only the failed settings, and forgets their failures once they pass.
  monkeypatch.setattr(bench_links, "link_times", lambda processes, *a, **k: fake_link_times(
      processes, *a, **dict(k, rate_bits=None)))
  attempts.clear()
  f3_target.measure(settings, str(tmp_path), log=lambda *a: None)
  assert attempts == [(2, 1e10), (4, 1e9)]
  assert common.read_failures(str(tmp_path)) == {}
  monkeypatch.setattr(calibrate, "netns_available", lambda: (False, "not permitted"))
  assert f3_target.measure(settings, str(tmp_path)) == "not permitted"


# ----------------------------------------------------------------------------- outputs


def test_markdown_table_escapes_and_formats():
  table = reproduce_report.markdown_table([("a", "A"), ("b", "B")],
                                          [{"a": "x|y", "b": 1 / 3}, {"a": None}])
  assert table.splitlines() == ["| A | B |", "|---|---|", "| x\\|y | 0.3333 |", "| - | - |"]


def test_mean_std_and_format():
  assert reproduce_report.mean_std([]) == pytest.approx((math.nan, math.nan), nan_ok=True)
  assert reproduce_report.mean_std([0.5]) == (0.5, 0.0)
  assert reproduce_report.format_mean_std([0.9, 0.95], 100, 1) == "92.5 ± 3.5 (n=2)"
  assert reproduce_report.format_mean_std([]) == "-"


def test_cli_runs_as_a_module(tmp_path):
  """``python -m experiments.reproduce`` (the package's __main__): F2 from its run directory,
  and its index."""
  _f2_run(tmp_path / "runs" / "f2")
  result = subprocess.run(
      [sys.executable, "-m", "experiments.reproduce", "--target=f2", "--report_only",
       f"--workdir={tmp_path / 'runs'}", f"--out={tmp_path / 'out'}"],
      capture_output=True, text=True, check=False, cwd=reproduce_report.REPO_ROOT,
      env=bench_common.cpu_env(1))
  assert result.returncode == 0, result.stderr
  assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
      "README.md", "f2.csv", "f2.md", "f2.png"]
  assert "python -m experiments.reproduce --target=f2" in (tmp_path / "out" / "f2.md").read_text()


def test_index_lists_written_targets(tmp_path):
  (tmp_path / "t1.md").write_text("x")
  (tmp_path / "t1.png").write_text("x")
  text = reproduce.write_index(str(tmp_path), PROV).read_text()
  assert "[t1.md](t1.md) [t1.png](t1.png)" in text
  assert "| `f3` |" in text and "not written yet" in text
  assert PROV.commit in text
  # Every target stands beside the published claim it answers.
  assert set(reproduce.ANSWERS) == set(reproduce.TARGETS)
  assert "| `f5` | F5: time to accuracy" in text and "Agarwal et al. 2022" in text


def test_full_t1_runs_never_share_folders_with_quick_ones():
  """A finished quick run would otherwise be skipped as done by a ``--full`` sweep."""
  quick, full = common.Options(workdir="w"), common.Options(workdir="w", full=True)
  assert t1_target.runs_dir(quick) == os.path.join("w", "t1_mnist1d")
  assert t1_target.runs_dir(full) == os.path.join("w", "t1_mnist1d_full")
