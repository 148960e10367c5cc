"""What every target of the paper reproduction shares: the command line's options, and running
the runs of a sweep config, in this process or in child processes of their own.

Training targets (T1, T2, F4) go through the project's runner with the sweep configs of
``configs/paper/``: :func:`run_sweep_config` skips finished runs and resumes unfinished ones
(:func:`experiments.sweep.run_sweep`), trains ``jobs`` runs at once, each in a child process
(``python -m experiments.reproduce.common <workdir> '<one-run sweep as JSON>'``, :func:`main`),
and records the runs that failed in ``workdir/failures.json`` (:func:`read_failures`), so that a
table can say so and the sweep goes on.
"""

import dataclasses
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import ml_collections

from configs.paper import lm
from experiments import distributed
from experiments import provenance
from experiments import sweep as sweep_lib
from experiments import train
from experiments import validation
from experiments.bench import common as bench_common
from experiments.reproduce import report as report_lib

FAILURES_FILE = "failures.json"


@dataclasses.dataclass(frozen=True)
class Options:
  """What the command line chose.

  Attributes:
    workdir: root of the run directories.
    out: folder of the outputs.
    full: full settings instead of quick.
    data_dir: CIFAR-10 folder for ``t1_cifar10`` ('' to skip it).
    report_only: regenerate outputs from existing runs, run nothing.
    seeds: seeds of T1 (and F4).
    jobs: training runs at once, each in a process of its own (1: one after another, in this
      process).
    tier: the language-model targets' size (``cpu``: about 1M parameters; ``gpu``: 25M+).
  """
  workdir: str = "runs/paper"
  out: str = provenance.PAPER_FIGURES
  full: bool = False
  data_dir: str = ""
  report_only: bool = False
  seeds: int = 3
  jobs: int = 2
  tier: str = "cpu"

  def config_arg(self) -> str | None:
    return "full=true" if self.full else None


# The language-model targets' tiers (configs/paper/lm.py's); the CPU tier's pages keep the
# target's name.
LM_TIERS = tuple(lm.HARDWARE_TIERS)


def page_name(target: str, tier: str) -> str:
  """The name of a language-model target's page at ``tier`` (``t1_lm``, ``t1_lm_gpu``): each tier
  has its own, so that a GPU tier's run leaves the CPU tier's tables as they are."""
  return target if tier == "cpu" else f"{target}_{tier}"


def _absolute_specs(sweep):
  """``sweep`` with its runs' config paths made absolute (sweep configs name them relative to
  the repository root, and :func:`experiments.sweep.load_config` to the working directory)."""
  for run in sweep.runs:
    path, sep, arg = run["config"].partition(":")
    run["config"] = str(report_lib.REPO_ROOT / path) + sep + arg
  return sweep


def run_sweep_config(sweep, workdir: str, *, jobs: int = 1,
                     check_finished: bool = False) -> dict[str, str]:
  """Runs every unfinished run of a sweep config under ``workdir``, ``jobs`` at a time.

  With ``jobs`` 1 the runs train one after another in this process (in a child process each
  where their ``num_devices`` differ: solo beside 8 workers); with more, each trains in a child
  process of its own (:func:`_run_children`), ``jobs`` at once. Runs are deterministic, so
  the results do not depend on ``jobs``. A run's XLA threads do not keep even 2 cores busy (a
  quick MNIST-1D run alone uses about 1.6 of them): 2 jobs finished pairs of T1 runs 1.1-1.3x
  sooner on 2 cores. A run that fails is logged and recorded in ``workdir/failures.json`` (its row
  then says so) and the sweep goes on with the next; ``workdir/summary.csv`` lists the finished
  runs.

  Args:
    sweep: a sweep config (``runs`` and ``overrides``, see :mod:`experiments.sweep`), its config
      paths relative to the repository root.
    workdir: the sweep's folder; run ``name`` works in ``workdir/name``.
    jobs: runs at once.
    check_finished: whether a finished run must have been trained with its config as the sweep
      gives it now (:func:`experiments.validation.check_resume`), rather than be skipped as done
      whatever its settings.

  Returns:
    Run name -> error message of the runs that failed now.

  Raises:
    ValueError: with ``check_finished``, a finished run that another config trained, naming the
      fields that differ (before anything runs).
  """
  if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
    raise ValueError(f"run_sweep_config: jobs={jobs!r}; allowed: an int >= 1")
  sweep = _absolute_specs(sweep)
  # Every run's config is checked before any starts.
  configs = sweep_lib.run_configs(sweep, one_device_count=False)
  os.makedirs(workdir, exist_ok=True)
  finished = lambda name: os.path.exists(os.path.join(workdir, name, report_lib.RESULTS_FILE))
  if check_finished:
    for name, config in configs.items():
      run = report_lib.read_run(os.path.join(workdir, name))
      if run is not None and run.finished:
        validation.check_resume(config, run.path, run.results["step"])
  # Runs of different device counts (solo beside 8 workers) each train in a process of their
  # own: a process's devices are set once.
  if jobs == 1 and len({c.num_devices for c in configs.values()}) == 1:
    failures = {}
    for name, config in configs.items():
      rows = sweep_lib.run_sweep({name: config}, workdir)
      if rows and rows[0].get("error"):  # run_sweep records a run's failure, whatever it was
        failures[name] = rows[0]["error"][:300]
  else:
    pending = [run for run in sweep.runs if not finished(run["name"])]
    failures = _run_children(pending, sweep.get("overrides", {}), workdir, jobs)
  sweep_lib.write_summary(workdir, configs)
  path = os.path.join(workdir, FAILURES_FILE)
  old = json.loads(Path(path).read_text()) if os.path.exists(path) else {}
  merged = {n: m for n, m in {**old, **failures}.items() if not finished(n)}
  Path(path).write_text(json.dumps(merged, indent=1))
  return failures


def _run_children(runs, overrides, workdir: str, jobs: int) -> dict[str, str]:
  """Trains each of ``runs`` (sweep-config entries) in a child process, ``jobs`` at once.

  A child is ``python -m experiments.reproduce.common <workdir> '<one-run sweep as JSON>'``
  (:func:`main`); it inherits this process's environment (the simulated devices' XLA flags), with
  this process's command as the one its run records (``provenance.COMMAND_ENV``) and, unless set,
  ``XLA_PYTHON_CLIENT_MEM_FRACTION`` at ``0.9 / jobs`` (an accelerator's memory shared), and
  writes its output to ``workdir/logs/<name>.log``.

  Returns:
    Run name -> the error line of each child that failed.
  """
  workdir = os.path.abspath(workdir)  # the children work in the repository's root
  log_dir = os.path.join(workdir, "logs")
  os.makedirs(log_dir, exist_ok=True)
  env = dict(os.environ, **{provenance.COMMAND_ENV: provenance.command()})
  # On a GPU each child's XLA would take 75% of its memory and the second would run out: each
  # gets its share unless the caller set one.
  env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{0.9 / jobs:.3f}")
  waiting, running, failures = list(runs), {}, {}
  try:
    while waiting or running:
      while waiting and len(running) < jobs:
        run = waiting.pop(0)
        request = json.dumps({"runs": [run], "overrides": overrides}, default=_plain)
        log_path = os.path.join(log_dir, f"{run['name']}.log")
        with open(log_path, "wb") as sink:
          child = subprocess.Popen(
              [sys.executable, "-m", "experiments.reproduce.common", workdir, request],
              cwd=report_lib.REPO_ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT)
        running[child] = (run["name"], log_path)
      done = [c for c in running if c.poll() is not None]
      for child in done:
        name, log_path = running.pop(child)
        if child.returncode != 0:
          tail = Path(log_path).read_text(errors="replace")[-20000:]
          failures[name] = bench_common.error_line(tail, child.returncode)
          logging.error("reproduce: run %s failed (%s); its log: %s", name, failures[name],
                        log_path)
      if not done:
        time.sleep(0.5)
  finally:
    for child in running:  # interrupted: stop the children too (they resume next time)
      child.kill()
      child.wait()
  return failures


def read_failures(workdir: str) -> dict[str, str]:
  """Run name -> why its last attempt failed (``workdir/failures.json``; retried next time)."""
  path = os.path.join(workdir, FAILURES_FILE)
  return json.loads(Path(path).read_text()) if os.path.exists(path) else {}


def _plain(value):
  """JSON for what ``json`` cannot write itself: a ConfigDict, as its dict."""
  if hasattr(value, "to_dict"):
    return value.to_dict()
  raise TypeError(f"a sweep config holds {value!r} ({type(value).__name__}), which cannot be "
                  "handed to a child process; use numbers, strings, lists and dicts")


def main(argv) -> None:
  """A child of :func:`_run_children`: ``argv = [workdir, one-run sweep config as JSON]``."""
  workdir, request = argv
  [(name, config)] = sweep_lib.run_configs(ml_collections.ConfigDict(json.loads(request))).items()
  distributed.expose_cpu_devices(config)
  # Not sweep.run_sweep: its summary.csv would list this run alone, and the children would
  # overwrite one another's; the parent writes the sweep's once they are done.
  train.train_and_evaluate(config, os.path.join(workdir, name))


if __name__ == "__main__":
  main(sys.argv[1:])
