"""F4: Hessian-aware against magnitude block selection, the training-loss curves of T1's runs.

The runs are T1's (``configs/paper/t1_mnist1d.py:subset=f4``, the same run directories): TASC at
1% density with each block sensitivity, and per-element top-k at the same density; a run that T1
already trained is not trained again.
"""

import numpy as np

from configs.paper import t1_mnist1d
from experiments.reproduce import common
from experiments.reproduce import plots
from experiments.reproduce import report as report_lib
from experiments.reproduce import t1
from experiments.reproduce.report import Claim
from experiments.reproduce.report import Report

TITLE = "F4: Hessian-aware vs magnitude block selection, loss curves"


run_folders = t1.run_folders  # F4 plots T1's runs


def produce(options: common.Options) -> Report:
  """Runs F4's subset of T1's sweep (unless ``report_only``); the curves and their table."""
  workdir = t1.runs_dir(options)
  if not options.report_only:
    arg = ",".join(filter(None, [options.config_arg(), f"seeds={options.seeds}", "subset=f4"]))
    common.run_sweep_config(t1_mnist1d.get_config(arg), workdir, jobs=options.jobs)
  return report(workdir, seeds=options.seeds, full=options.full)


def report(workdir: str, *, seeds: int, full: bool) -> Report:
  """F4's curves, table and claim from T1's run directories.

  Args:
    workdir: T1's runs (:func:`experiments.reproduce.t1.runs_dir`).
    seeds: seeds per method.
    full: whether the runs have the full settings (for the configs named).

  Returns:
    The report ``f4``.
  """
  methods = list(t1_mnist1d.F4_METHODS)
  rows = t1.compression_rows(workdir, methods, seeds)
  curves = {}
  for method in methods:
    series = [r.series("loss") for r in t1.method_runs(workdir, method, seeds)]
    if series:
      steps = series[0][0]
      values = np.stack([v[:len(steps)] for _, v in series if len(v) >= len(steps)])
      curves[method] = (steps, values)
  for row in rows:
    if row["method"] in curves:
      _, values = curves[row["method"]]
      tail = values[:, -max(1, values.shape[1] // 10):].mean(axis=1)
      row["late_train_loss"] = report_lib.format_mean_std(list(tail), 1, 4)
      row["late_loss_mean"] = float(tail.mean())

  def plot(fig):
    ax = fig.add_axes([0.08, 0.2, 0.9, 0.72])
    for method, (steps, values) in curves.items():
      mean = values.mean(axis=0)
      line, = ax.plot(steps, mean, label=f"{method} ({values.shape[0]} seeds)")
      if values.shape[0] > 1:
        ax.fill_between(steps, values.min(axis=0), values.max(axis=0), alpha=0.15,
                        color=line.get_color())
    ax.set_yscale("log")
    plots.decorate(
        ax, xlabel="step", ylabel="training loss (mean over seeds; band: min-max)",
        title="F4: Hessian-aware vs magnitude block selection at 1% density, error feedback",
        legend_size=8)

  by = {r["method"]: r for r in rows if "late_loss_mean" in r}
  hutch, none = by.get("tasc_d0.01_hutchinson"), by.get("tasc_d0.01_none")
  if hutch and none:
    ours = (f"late training loss: Hutchinson {hutch['late_loss_mean']:.4f}, Fisher "
            f"{by['tasc_d0.01_fisher']['late_loss_mean']:.4f}, magnitude "
            f"{none['late_loss_mean']:.4f}" if "tasc_d0.01_fisher" in by else
            f"late training loss: Hutchinson {hutch['late_loss_mean']:.4f}, magnitude "
            f"{none['late_loss_mean']:.4f}")
    reproduced = hutch["late_loss_mean"] < none["late_loss_mean"]
  else:
    ours, reproduced = "not run", None
  claim = Claim("Hessian-aware block selection trains better than magnitude selection at equal "
                "density", "TASC (Dong, Keutzer et al., unverified); HAWQ-v2 sensitivity",
                ours, reproduced, "mean over seeds of the last 10% of logged training losses")
  return Report(
      name="f4", title="F4: Hessian-aware vs magnitude block selection (loss curves, MNIST-1D)",
      columns=[("method", "method"), ("late_train_loss", "training loss, last 10% of steps"),
               ("test_accuracy", "test accuracy %"), ("compression_ratio", "wire compression (x)"),
               ("status", "status"), ("run_dirs", "run directories")],
      rows=rows, claims=[claim],
      configs=[f"configs/paper/t1_mnist1d.py:subset=f4{',full=true' if full else ''}",
               "configs/paper/mnist1d.py"],
      notes=["The runs are T1's (same run directories): equal density 1% for every method, "
             "each with error feedback; TASC blocks of 256, top-k per element (so top-k's "
             "union over 8 workers updates up to 8% of the coordinates per step, and its bytes "
             "are several times TASC's).",
             "Training loss is the mean over the 8 devices' batches, logged every 10 steps "
             "(every 25 with full settings)."],
      plot=plot)


