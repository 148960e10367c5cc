"""experiments.provenance: what every results file records about where it came from, and that
the runner's, the benchmarks' and the paper reproduction's files carry it."""

import json
import os
import shlex
import subprocess
import sys

import jax

from configs import digits
from experiments import logs
from experiments import provenance
from experiments import validation
from experiments.reproduce import report as reproduce_report

FIELDS = {"command", "commit", "dirty", "date", "python", "jax", "jaxlib", "os", "cpus",
          "device_platforms", "device_kinds", "process_count", "num_workers"}


def test_record_names_command_commit_versions_and_devices():
  rec = provenance.record(devices=jax.devices()[:2], num_workers=2, process_count=1)
  assert set(rec) == FIELDS
  assert rec["command"] == shlex.join(sys.orig_argv)
  assert len(rec["commit"]) == 40 and isinstance(rec["dirty"], bool)
  assert rec["python"] == sys.version.split()[0] and rec["jax"] == jax.__version__
  assert rec["jaxlib"] and rec["device_platforms"] == ["cpu"] and rec["device_kinds"] == ["cpu"]
  assert (rec["num_workers"], rec["process_count"]) == (2, 1)
  json.dumps(rec)  # JSON-ready
  line = provenance.describe(rec)
  assert f"JAX {jax.__version__}" in line and "devices: cpu" in line and "workers: 2" in line


def test_a_launcher_names_its_own_command(monkeypatch):
  monkeypatch.setenv(provenance.COMMAND_ENV, "python -m experiments.launch -- --config=x.py")
  assert provenance.record()["command"] == "python -m experiments.launch -- --config=x.py"


def test_commit_outside_a_checkout_is_none_and_said_so(tmp_path):
  assert provenance.git_state(tmp_path) == (None, None)
  rec = dict(provenance.record(), commit=None, dirty=None)
  assert provenance.commit_text(rec) == "unknown (not a git checkout, or git is missing)"
  rec.update(commit="ab" * 20, dirty=True)
  assert provenance.commit_text(rec) == "ab" * 20 + " (with uncommitted changes)"


def test_commit_and_dirty_tree(tmp_path):
  def git(*args):
    subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)
  git("init", "-q")
  (tmp_path / "a.txt").write_text("1")
  (tmp_path / "paper_figures").mkdir()
  (tmp_path / "paper_figures" / "t1.md").write_text("old table")
  git("add", "a.txt", "paper_figures/t1.md")
  git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "a")
  commit, dirty = provenance.git_state(tmp_path)
  assert len(commit) == 40 and dirty is False
  (tmp_path / "untracked.txt").write_text("new")  # untracked files do not count
  assert provenance.git_state(tmp_path) == (commit, False)
  # A reproduction regenerating its tables between targets leaves the code it ran unchanged.
  (tmp_path / "paper_figures" / "t1.md").write_text("new table")
  assert provenance.git_state(tmp_path / "paper_figures") == (commit, False)
  (tmp_path / "a.txt").write_text("2")
  assert provenance.git_state(tmp_path) == (commit, True)


def test_runs_written_outside_the_runner_carry_it(tmp_path):
  reproduce_report.write_run(tmp_path, {"workers": 2}, [], {"bytes": 1.0})
  run = reproduce_report.read_run(tmp_path)
  for payload in (run.config, run.results):
    assert set(payload[provenance.KEY]) == FIELDS
  assert run.config["workers"] == 2 and run.results["bytes"] == 1.0


def test_a_resume_does_not_compare_provenance(tmp_path):
  config = digits.get_config("smoke")
  stored = {**config.to_dict(), provenance.KEY: {**provenance.record(), "commit": "other"}}
  logs.write_json(os.path.join(tmp_path, validation.CONFIG_FILE), stored)
  validation.check_resume(config, str(tmp_path), checkpoint_step=2)
