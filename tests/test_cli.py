"""The command lines of the runner and the sweep: a missing config file is one line naming its
path, the sweep sets any field of every run with ``--config.overrides.<field>=<value>`` and goes
on past a diverged run, an interrupted run names the command that resumes it, and ``--help``
says where the config fields are documented. (Signals themselves: tests/test_failures.py.)"""

import csv
import json
import os
import signal
import subprocess
import sys

import ml_collections
import pytest

from configs import lm_stdlib
from experiments import cli
from experiments import interrupt
from experiments import provenance
from experiments import sweep
from experiments import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args, timeout=600):
  env = dict(os.environ, JAX_DISABLE_MOST_OPTIMIZATIONS="1", XLA_FLAGS="", JAX_PLATFORMS="cpu")
  env.pop(provenance.COMMAND_ENV, None)
  return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=timeout)


@pytest.mark.parametrize("args, message", [
    (["experiments.run", "--config=configs/quickstartt.py:smoke", "--config.num_steps=3"],
     "experiments.run: --config='configs/quickstartt.py:smoke': config file "
     "'configs/quickstartt.py' does not exist (paths are relative to the working directory"),
    (["experiments.sweep", "--config", "configs/sweeps/nope.py"],
     "experiments.sweep: --config='configs/sweeps/nope.py': config file "
     "'configs/sweeps/nope.py' does not exist"),
])
def test_a_missing_config_file_is_one_line_naming_the_path(args, message, tmp_path):
  completed = _run(*args, f"--workdir={tmp_path}")
  lines = completed.stderr.strip().splitlines()
  assert completed.returncode == 1 and len(lines) == 1 and lines[0].startswith(message), lines
  assert not os.listdir(tmp_path)


def _write_sweep(tmp_path, runs):
  path = tmp_path / "sweep.py"
  path.write_text("import ml_collections\n\n\ndef get_config(arg=None):\n"
                  f"  return ml_collections.ConfigDict({{'runs': {runs!r}, 'overrides': {{}}}})\n")
  return path


def test_a_sweep_run_naming_a_missing_config_file_is_one_line(tmp_path):
  path = _write_sweep(tmp_path, [{"name": "a", "config": "configs/digitz.py:smoke"}])
  completed = _run("experiments.sweep", f"--config={path}", f"--workdir={tmp_path / 'w'}")
  assert completed.returncode == 1
  assert completed.stderr.strip() == (
      "experiments.sweep: sweep: run config='configs/digitz.py:smoke': config file "
      f"'configs/digitz.py' does not exist (paths are relative to the working directory {ROOT!r})")


@pytest.mark.slow  # a minute of sweep runs
def test_sweep_overrides_set_fields_of_every_run_and_a_diverged_run_is_recorded(tmp_path):
  """``--config.overrides.num_epochs=1`` (with num_steps=0, which the smoke config sets to 2)
  and a nested field reach both runs; the run at learning rate 1e30 diverges, the other is
  trained all the same, and the sweep exits 1 naming it."""
  path = _write_sweep(tmp_path, [
      {"name": "bad", "config": "configs/quickstart.py:smoke",
       "overrides": {"optimizer": {"learning_rate": 1e30}}},
      {"name": "ok", "config": "configs/quickstart.py:smoke"}])
  workdir = tmp_path / "w"
  completed = _run("experiments.sweep", f"--config={path}", "--config.overrides.num_steps=0",
                   "--config.overrides.num_epochs=1",
                   "--config.overrides.optimizer.weight_decay=0.001", f"--workdir={workdir}")
  assert completed.returncode == 1, completed.stderr[-3000:]
  assert completed.stderr.strip().splitlines()[-1] == (
      f"experiments.sweep: 1 of 2 runs diverged (bad); see {workdir / 'summary.csv'}")
  with open(workdir / "summary.csv") as f:
    rows = {r["name"]: r for r in csv.DictReader(f)}
  assert (rows["bad"]["diverged"], rows["ok"]["diverged"]) == ("True", "False")
  assert "steps were skipped for a non-finite gradient" in rows["bad"]["divergence"]
  for name in ("bad", "ok"):
    with open(workdir / name / "config.json") as f:
      config = json.load(f)
    assert (config["num_steps"], config["num_epochs"]) == (0, 1.0)
    assert config["optimizer"]["weight_decay"] == 0.001
    with open(workdir / name / train.RESULTS_FILE) as f:
      assert json.load(f)["step"] > 2  # an epoch, not the smoke config's 2 steps
  assert "bad: test accuracy" in completed.stdout and "; diverged: " in completed.stdout


@pytest.mark.parametrize("spec, message", [
    ("configs/digits.py:smok", "config argument 'smok': not key=value, and the config has no "
     "variants (did you mean 'smoke'?); allowed keys: ['method', 'smoke']"),
    ("configs/digits.py:smoke=yes",
     "config argument 'smoke=yes': smoke='yes' is not allowed; smoke must be true or false (or 1 "
     "or 0)"),
    ("configs/lm_stdlib.py:smoke,steps=two",
     "config argument 'steps=two': steps='two' is not allowed; allowed: an int (default 0)"),
    ("configs/lm_stdlib.py:huge", "configs/lm_stdlib.py: tier 'huge' is not one of "
     f"{sorted(lm_stdlib.MODEL_SIZES)}"),
    ("notes.txt", "notes.txt cannot be run as a Python config file (SyntaxError: invalid syntax "
     "(notes.txt, line 1)); a config file is Python that defines get_config(arg=None), as "
     "configs/quickstart.py does"),
    ("config.json", "config.json defines no get_config(arg=None); a config file is Python that "
     "defines it, as configs/quickstart.py does"),
    ("broken.py:x", "get_config of broken.py raised ZeroDivisionError: division by zero"),
])
def test_a_config_file_that_makes_no_config_is_one_line_naming_it(spec, message, tmp_path,
                                                                   monkeypatch):
  """Before absl parses the flags: ml_collections would print the traceback of an error of
  ``get_config``, and let any other error of the file escape with its own."""
  (tmp_path / "notes.txt").write_text("learning rate 0.1, eight workers\n")
  (tmp_path / "config.json").write_text('{"num_steps": 2}\n')
  (tmp_path / "broken.py").write_text("def get_config(arg=None):\n  return 1 / 0\n")
  os.symlink(os.path.join(ROOT, "configs"), tmp_path / "configs")
  monkeypatch.chdir(tmp_path)
  monkeypatch.delenv(cli.VERBOSE_ENV, raising=False)
  with pytest.raises(SystemExit) as exited:
    cli.flags_parser("experiments.run")(["run", f"--config={spec}", "--workdir=w"])
  assert exited.value.code == f"experiments.run: --config={spec!r}: {message}"


def test_help_says_where_the_config_fields_are_documented():
  for module in ("experiments.run", "experiments.sweep"):
    assert "configs/common.py" in _run(module, "--help").stdout


def test_command_line_overrides_reach_the_sweep_config():
  argv = ["sweep", "--config=s.py", "--config.overrides.num_epochs=1", "--workdir=w",
          "--config.overrides.optimizer.name", "lamb", "--config.overrides.data_dir=123",
          "--config.overrides.skip_nonfinite=false", "--config.overrides.model.channels=(8, 8)"]
  rest, overrides = sweep.take_overrides(argv)
  assert rest == ["sweep", "--config=s.py", "--workdir=w"]
  config = ml_collections.ConfigDict({"runs": [], "overrides": {"data_dir": ""}})
  sweep.add_overrides(config, overrides)
  assert config.overrides.to_dict() == {
      "num_epochs": 1, "optimizer": {"name": "lamb"}, "data_dir": "123",  # a string field
      "skip_nonfinite": False, "model": {"channels": (8, 8)}}
  with pytest.raises(ValueError, match="--config.overrides.seed has no value"):
    sweep.take_overrides(["sweep", "--config.overrides.seed"])
  with pytest.raises(ValueError, match=r"--config.overrides.data_dir.x: the sweep config "
                                       r"overrides 'data_dir' with '123', not a block"):
    sweep.add_overrides(config, {"data_dir.x": "1"})


@pytest.mark.parametrize("error, name_run, line, status", [
    (interrupt.Interrupted(12, signal.SIGTERM, "runs/s/topk"), False, "interrupted at step 12",
     143),
    (interrupt.Interrupted(3, signal.SIGINT, "runs/s/topk"), True,
     "interrupted at step 3 of runs/s/topk", 130),
    (KeyboardInterrupt(), False, "interrupted", 130),
])
def test_an_interrupted_run_names_its_step_and_the_command_that_resumes_it(
    error, name_run, line, status, capsys, monkeypatch):
  monkeypatch.setenv(provenance.COMMAND_ENV, "python -m experiments.sweep --config=s.py")
  with pytest.raises(SystemExit) as exited:
    cli.exit_interrupted(error, is_main=True, name_run=name_run)
  assert exited.value.code == status
  assert capsys.readouterr().err == (
      f"{line}; resume with: python -m experiments.sweep --config=s.py\n")
  with pytest.raises(SystemExit):
    cli.exit_interrupted(error, is_main=False)
  assert not capsys.readouterr().err  # process 0 alone prints
