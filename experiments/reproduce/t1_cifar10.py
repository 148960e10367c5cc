"""T1 on CIFAR-10 ResNet-20: the MNIST-1D table's rows (:mod:`experiments.reproduce.t1`) on
``configs/cifar10_resnet20.py``, through the sweep ``configs/paper/t1_cifar10.py``.

Nothing is downloaded: the target runs only when ``--data_dir`` holds CIFAR-10's python batches.
Without ``--data_dir`` its report says why it was skipped (a page already written is kept rather
than replaced by one of nothing); a ``--data_dir`` that does not hold them is refused before
anything runs (:func:`experiments.reproduce.__main__.check_inputs`).
"""

import os

from configs.paper import t1_cifar10 as t1_cifar10_config
from configs.paper import t1_mnist1d
from experiments.reproduce import common
from experiments.reproduce import t1
from experiments.reproduce.report import Report

TITLE = "T1 on CIFAR-10 ResNet-20 (needs --data_dir)"


def run_folders(options: common.Options) -> list[str]:
  """The folder of the sweep's runs."""
  return [os.path.join(options.workdir, "t1_cifar10")]


def produce(options: common.Options) -> Report:
  """Runs the sweep when ``--data_dir`` holds CIFAR-10 (unless ``report_only``); the table."""
  [workdir] = run_folders(options)
  ready = available(options.data_dir)
  if ready and not options.report_only:
    arg = ",".join(filter(None, [options.config_arg(), f"seeds={options.seeds}"]))
    sweep = t1_cifar10_config.get_config(arg)
    sweep.overrides.data_dir = options.data_dir
    common.run_sweep_config(sweep, workdir, jobs=options.jobs)
  return report(
      workdir, seeds=options.seeds, full=options.full,
      skipped=None if ready else unavailable(options.data_dir))


def report(workdir: str, *, seeds: int, full: bool, skipped: str | None) -> Report:
  """The table, claims and figure from the run directories (empty when nothing ran).

  Args:
    workdir: the sweep's runs.
    seeds: seeds per row.
    full: whether the runs have the full settings (for the notes and the configs named).
    skipped: why the runs could not start, or None.

  Returns:
    The report ``t1_cifar10``.
  """
  rows = t1.compression_rows(workdir, list(t1_mnist1d.rows()), seeds)
  have = any(r["seeds"] for r in rows)
  return Report(
      name="t1_cifar10",
      title="T1 on CIFAR-10 ResNet-20: test accuracy against wire compression, 8 workers",
      columns=t1.COLUMNS, rows=rows if have else [],
      claims=t1.claims(rows, "CIFAR-10 ResNet-20") if have else [],
      configs=[f"configs/paper/t1_cifar10.py{':full=true' if full else ''}",
               "configs/cifar10_resnet20.py"],
      notes=([f"SKIPPED: {skipped}."] if skipped else []) + [
          "configs/cifar10_resnet20.py (Nesterov SGD lr 0.1, batch 128, step decay) with each "
          "row's compression settings; quick settings train 5 epochs (far from converged), "
          "full 160.", *t1.notes()],
      plot=t1.plot_accuracy_vs_compression(rows, "T1: CIFAR-10 ResNet-20") if have else None)


def unavailable(data_dir: str) -> str:
  """Why ``data_dir`` cannot be trained on: the report's note, and the command line's refusal of
  a ``--data_dir`` given."""
  return (f"--data_dir={data_dir!r} does not hold CIFAR-10's python batches "
          "(data_batch_1 ... test_batch); pass --data_dir=/path/to/cifar-10-batches-py")


def available(data_dir: str) -> bool:
  """Whether ``data_dir`` (or its ``cifar-10-batches-py``) holds CIFAR-10's python batches, the
  layout :mod:`experiments.data.cifar` reads."""
  if not data_dir:
    return False
  return any(all(os.path.exists(os.path.join(folder, f))
                 for f in ("data_batch_1", "data_batch_5", "test_batch"))
             for folder in (data_dir, os.path.join(data_dir, "cifar-10-batches-py")))
