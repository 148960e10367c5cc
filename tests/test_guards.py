"""What guards published results and workdirs: ``reproduce`` refuses to rewrite its pages from no
runs, to train ``--tier=gpu`` without a GPU and to run ``t1_cifar10`` on a ``--data_dir`` without
CIFAR-10; a sweep records a run that raises anything and trains the others; a workdir's lock is
judged by its ``flock``, not by whether the pid it names is alive.

Nothing here trains: the sweeps' training is a stand-in that writes a finished run directory.
"""

import csv
import json
import os
import socket
import subprocess
import sys
import textwrap

import ml_collections
import pytest

from experiments import cli
from experiments import interrupt
from experiments import lock
from experiments import sweep
from experiments import train
from experiments.bench import common as bench_common
from experiments.reproduce import __main__ as reproduce
from experiments.reproduce import report as reproduce_report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIGITS = f"{ROOT}/configs/digits.py:smoke"


# ------------------------------------------------------------------------------- reproduce


def _reproduce(tmp_path, *args) -> str:
  """``python -m experiments.reproduce <args>`` in this process, into ``tmp_path/out``, where it
  must refuse: its one-line error."""
  with pytest.raises(SystemExit) as exited:
    reproduce.main([*args, f"--out={tmp_path / 'out'}"])
  assert isinstance(exited.value.code, str) and "\n" not in exited.value.code
  return exited.value.code


@pytest.mark.parametrize("target", list(reproduce.TARGETS))
def test_report_only_without_runs_under_the_workdir_writes_nothing(tmp_path, target):
  """A mistyped ``--workdir`` used to rewrite the target's published page as an empty table."""
  workdir = tmp_path / "runs" / "papr"
  message = _reproduce(tmp_path, f"--target={target}", "--report_only", f"--workdir={workdir}")
  assert message.startswith(f"experiments.reproduce: --report_only: --workdir={str(workdir)!r} "
                            f"holds no runs of {target} (in {workdir}")
  assert message.endswith("nothing was written: pass the --workdir that holds them, or leave "
                          "those targets out of --target")
  assert not (tmp_path / "out").exists()


def test_report_only_names_every_target_without_runs_and_leaves_published_pages(tmp_path):
  """F2's run is there and the others' are not: nothing is rewritten, not even F2's page or the
  index, and the line names the others alone."""
  workdir = tmp_path / "runs"
  reproduce_report.write_run(workdir / "f2", {}, [], {})
  out = tmp_path / "out"
  out.mkdir()
  (out / "f2.md").write_text("published")
  (out / reproduce.INDEX).write_text("published")
  message = _reproduce(tmp_path, "--target=f2,t1,t2", "--report_only", f"--workdir={workdir}")
  assert message.endswith(
      f"holds no runs of t1 (in {workdir / 't1_mnist1d'}), t2 (in {workdir / 't2_mnist1d'} or "
      f"{workdir / 't2_bert'}); nothing was written: pass the --workdir that holds them, or leave "
      "those targets out of --target (it holds runs of f2)")
  assert sorted(p.name for p in out.iterdir()) == ["README.md", "f2.md"]
  assert {p.read_text() for p in out.iterdir()} == {"published"}


def test_a_run_folder_counts_only_with_a_run_in_it(tmp_path):
  assert not reproduce_report.holds_runs(tmp_path / "missing")
  (tmp_path / "sweep" / "logs").mkdir(parents=True)  # a sweep whose runs never started
  assert not reproduce_report.holds_runs(tmp_path / "sweep")
  reproduce_report.write_run(tmp_path / "sweep" / "dense_s0", {}, [], {})
  assert reproduce_report.holds_runs(tmp_path / "sweep")
  assert reproduce_report.holds_runs(tmp_path / "sweep" / "dense_s0")


def test_tier_gpu_where_jax_finds_no_gpu_is_refused_before_anything_runs(tmp_path, monkeypatch):
  """The check of ``experiments.bench --platform=gpu``, made before the hours of training."""
  asked = []

  def platform(name):
    asked.append(name)
    return "cpu"

  monkeypatch.setattr(bench_common, "resolve_platform", platform)
  message = _reproduce(tmp_path, "--target=t1_lm", "--tier=gpu", f"--workdir={tmp_path / 'w'}")
  assert message == ("experiments.reproduce: --tier=gpu: JAX finds no GPU here; allowed here: "
                     "--tier=cpu, or --tier=gpu --report_only (which trains nothing)")
  assert asked == ["auto"]
  assert not (tmp_path / "out").exists() and not (tmp_path / "w").exists()


def test_a_data_dir_without_cifar10_is_one_line_and_exit_1(tmp_path):
  """As the command line's docstring promises, before anything runs or is written."""
  missing = tmp_path / "cifar"
  completed = subprocess.run(
      [sys.executable, "-m", "experiments.reproduce", "--target=t1_cifar10",
       f"--data_dir={missing}", f"--workdir={tmp_path / 'w'}", f"--out={tmp_path / 'out'}"],
      capture_output=True, text=True, check=False, cwd=ROOT, env=bench_common.cpu_env(1))
  assert completed.returncode == 1
  assert completed.stderr.strip().splitlines() == [
      f"experiments.reproduce: t1_cifar10: --data_dir={str(missing)!r} does not hold CIFAR-10's "
      "python batches (data_batch_1 ... test_batch); pass "
      "--data_dir=/path/to/cifar-10-batches-py"]
  assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_target_that_ran_nothing_keeps_its_page(tmp_path):
  """``t1_cifar10`` without ``--data_dir`` runs nothing: a page written from runs (perhaps on
  another machine) is kept, with a warning, rather than replaced by one of nothing."""
  out = tmp_path / "out"
  out.mkdir()
  (out / "t1_cifar10.md").write_text("published")
  completed = subprocess.run(
      [sys.executable, "-m", "experiments.reproduce", "--target=t1_cifar10",
       f"--workdir={tmp_path / 'w'}", f"--out={out}"],
      capture_output=True, text=True, check=False, cwd=ROOT, env=bench_common.cpu_env(1))
  assert completed.returncode == 0, completed.stderr
  assert (f"t1_cifar10: no runs under --workdir={tmp_path / 'w'}; {out / 't1_cifar10.md'} is left "
          "as it was") in completed.stderr
  assert [p.name for p in out.iterdir()] == ["t1_cifar10.md"]
  assert (out / "t1_cifar10.md").read_text() == "published"


# ----------------------------------------------------------------------------------- sweeps


def finish(config, workdir):
  """Stands in for training (here and in the command line's child): a finished run directory."""
  os.makedirs(workdir)
  with open(os.path.join(workdir, "config.json"), "w") as f:
    json.dump({"dataset": config.dataset, "model": {"name": config.model.name},
               "method": config.method}, f)
  with open(os.path.join(workdir, train.RESULTS_FILE), "w") as f:
    json.dump({"step": 2, "test_accuracy": 0.5, "compression_ratio": 1.0}, f)


def _sweep_configs(names):
  return sweep.run_configs(ml_collections.ConfigDict(
      {"runs": [{"name": n, "config": DIGITS} for n in names]}))


@pytest.mark.parametrize("verbose", [False, True])
def test_a_sweep_records_a_run_that_raises_anything_and_trains_the_others(
    tmp_path, monkeypatch, caplog, verbose):
  """Not only bad input: a run that fails with any exception (a ZeroDivisionError of a model
  field once aborted the whole sweep) is its row's one-line error; its traceback is logged with
  ``--verbose`` alone."""
  def trains(config, workdir):
    if workdir.endswith("broken"):
      raise RuntimeError("the model cannot be built\n(shape inference)")
    finish(config, workdir)

  monkeypatch.setattr(train, "train_and_evaluate", trains)
  monkeypatch.setenv(cli.VERBOSE_ENV, "1" if verbose else "0")
  workdir = tmp_path / "sweep"  # made by the sweep, though its first run fails before its own
  rows = sweep.run_sweep(_sweep_configs(["broken", "middle", "last"]), str(workdir))
  assert [(r["name"], r.get("error")) for r in rows] == [
      ("broken", "RuntimeError: the model cannot be built; (shape inference)"),
      ("middle", None), ("last", None)]
  with open(workdir / "summary.csv") as f:
    table = {r["name"]: r for r in csv.DictReader(f)}
  assert table["broken"]["error"] == rows[0]["error"] and table["last"]["step"] == "2"
  [record] = [r for r in caplog.records if "sweep: run broken failed" in r.getMessage()]
  assert bool(record.exc_info) is verbose


@pytest.mark.parametrize("stop", [interrupt.Interrupted(3, 15, "w/first"), KeyboardInterrupt()])
def test_a_signal_still_stops_the_sweep(tmp_path, monkeypatch, stop):
  started = []

  def trains(config, workdir):
    del config
    started.append(os.path.basename(workdir))
    raise stop

  monkeypatch.setattr(train, "train_and_evaluate", trains)
  with pytest.raises(type(stop)):
    sweep.run_sweep(_sweep_configs(["first", "last"]), str(tmp_path))
  assert started == ["first"]


def test_the_sweep_command_exits_1_naming_a_run_that_raised(tmp_path):
  """The command line: the other run finishes, the failed one is named, no traceback."""
  path = tmp_path / "sweep.py"
  runs = [{"name": n, "config": DIGITS} for n in ("broken", "ok")]
  path.write_text("import ml_collections\n\n\ndef get_config(arg=None):\n"
                  f"  return ml_collections.ConfigDict({{'runs': {runs!r}}})\n")
  workdir = tmp_path / "w"
  script = textwrap.dedent(f"""\
      import sys
      from absl import app
      from experiments import sweep, train
      from tests import test_guards

      def trains(config, workdir):
        if workdir.endswith("broken"):
          raise ZeroDivisionError("integer division or modulo by zero")
        test_guards.finish(config, workdir)

      train.train_and_evaluate = trains
      sys.argv = ["experiments.sweep", "--config={path}", "--workdir={workdir}"]
      app.run(sweep.main, flags_parser=sweep._parse_flags)
      """)
  completed = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                             text=True, check=False, env=bench_common.cpu_env(1), timeout=300)
  assert completed.returncode == 1, completed.stderr[-3000:]
  assert completed.stderr.strip().splitlines()[-1] == (
      f"experiments.sweep: 1 of 2 runs failed (broken); see {workdir / 'summary.csv'}")
  assert "Traceback" not in completed.stderr
  assert ("broken: failed: ZeroDivisionError: integer division or modulo by zero"
          in completed.stdout)
  assert (workdir / "ok" / train.RESULTS_FILE).exists()


# -------------------------------------------------------------------------------- the lock


def test_a_lock_naming_a_live_unrelated_process_is_taken_over(tmp_path, caplog):
  """Its pid now belongs to another process, which holds no lock on the file: the run starts
  (the pid used to block every resume)."""
  unrelated = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
  try:
    stale = {"pid": unrelated.pid, "host": socket.gethostname(), "since": "yesterday",
             "command": "python -m experiments.run --workdir=x"}
    (tmp_path / lock.LOCK_FILE).write_text(json.dumps(stale))
    with lock.hold(str(tmp_path)):
      assert json.loads((tmp_path / lock.LOCK_FILE).read_text())["pid"] == os.getpid()
    assert unrelated.poll() is None
  finally:
    unrelated.kill()
    unrelated.wait()
  assert ("taking over the lock of a run that ended without releasing it "
          f"(pid {unrelated.pid}") in caplog.text


def test_a_held_lock_says_how_to_clear_it(tmp_path):
  path = tmp_path / lock.LOCK_FILE
  with lock.hold(str(tmp_path)):
    with pytest.raises(lock.WorkdirInUse) as refused:
      with lock.hold(str(tmp_path)):
        pass
  assert str(refused.value).endswith(
      f"Its lock {path} frees itself when the process that holds it ends (`fuser -v {path}` "
      "names that process); do not delete the file while it runs")
