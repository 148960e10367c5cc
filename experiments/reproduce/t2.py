"""T2: large-batch training, SGD / Adam / LARS / LAMB on MNIST-1D and Adam / LAMB on BERT-tiny.

Both go through the runner, as T1 does (:func:`experiments.reproduce.common.run_sweep_config`):
MNIST-1D's runs are the sweep ``configs/paper/t2_mnist1d.py`` (an MLP, learning rates tuned once
at batch 128 and scaled, ``configs/paper/large_batch.py``), BERT's the sweep
``configs/paper/t2_bert.py``, where each optimizer's rate is chosen first at the smallest batch
size (:func:`select_bert_rates`), then trained at every batch size. Settings come from
``configs/paper/t2.py``; the table is regenerated from the run directories.
"""

import functools
import math
import os
from collections.abc import Sequence

import numpy as np

from configs.paper import large_batch
from configs.paper import t2 as t2_config
from configs.paper import t2_bert
from configs.paper import t2_mnist1d
from experiments.reproduce import common
from experiments.reproduce import plots
from experiments.reproduce import report as report_lib
from experiments.reproduce.report import Claim
from experiments.reproduce.report import Report

TITLE = "T2: large batch, SGD/Adam/LARS/LAMB (MNIST-1D) and Adam/LAMB (BERT-tiny)"


def produce(options: common.Options) -> Report:
  """Runs T2's MNIST-1D and BERT runs (unless ``report_only``); the table and figure."""
  settings = t2_config.get_config(options.config_arg())
  mnist_dir, bert_dir = runs_dirs(options.workdir, options.full)
  if not options.report_only:
    run_mnist1d(mnist_dir, full=options.full, jobs=options.jobs)
    run_bert(settings.bert, bert_dir, full=options.full, jobs=options.jobs)
  return report(options.workdir, settings, full=options.full)


def runs_dirs(workdir: str, full: bool) -> tuple[str, str]:
  """T2's MNIST-1D and BERT run folders under ``workdir``. Full settings get their own: their
  runs train longer under the same run names."""
  suffix = "_full" if full else ""
  return os.path.join(workdir, "t2_mnist1d" + suffix), os.path.join(workdir, "t2_bert" + suffix)


def run_folders(options: common.Options) -> list[str]:
  """The folders of the runs the table is built from."""
  return list(runs_dirs(options.workdir, options.full))


def run_mnist1d(workdir: str, *, full: bool, jobs: int = 1,
                smoke: bool = False) -> dict[str, str]:
  """T2's MNIST-1D runs, the sweep ``configs/paper/t2_mnist1d.py``, ``jobs`` at a time.

  Finished runs are skipped (when their config is the sweep's), unfinished ones resume.

  Args:
    workdir: the runs' folder (:func:`runs_dirs`).
    full: ``configs/paper/t2.py``'s full settings.
    jobs: runs at once, each in a process of its own (1: one after another, in this process).
    smoke: the sweep's smoke variant (tests).

  Returns:
    Run name -> error message of the runs that failed now.

  Raises:
    ValueError: a finished run directory was trained with other settings (it is not reused).
  """
  arg = ",".join(filter(None, ["full=true" if full else "", "smoke" if smoke else ""]))
  return common.run_sweep_config(t2_mnist1d.get_config(arg or None), workdir, jobs=jobs,
                                 check_finished=True)


def run_bert(bert, bert_dir: str, *, full: bool, jobs: int = 1) -> None:
  """T2's BERT runs: the rate-selection runs, then each optimizer at every batch size at its
  chosen rate (finished runs are skipped, unfinished ones resume)."""
  arg = [f"full={str(full).lower()}"]
  common.run_sweep_config(t2_bert.get_config(",".join(arg)), bert_dir, jobs=jobs)
  chosen = select_bert_rates(bert, bert_dir)
  if chosen:
    common.run_sweep_config(t2_bert.get_config(",".join(
        arg + [f"{o}_lr={lr!r}" for o, lr in chosen.items()])), bert_dir, jobs=jobs)


def _selection_runs(bert, bert_dir: str, optimizer: str):
  """``(base rate, run name, run or None)`` of ``optimizer``'s rate-selection runs."""
  names = [(lr, t2_bert.run_name(optimizer, min(bert.batch_sizes), lr))
           for lr in bert.learning_rates[optimizer]]
  return [(lr, n, report_lib.read_run(os.path.join(bert_dir, n))) for lr, n in names]


def select_bert_rates(bert, bert_dir: str) -> dict[str, float]:
  """Optimizer -> the candidate base rate whose run at the smallest batch size ended with the
  lowest final training loss. An optimizer is left out until every candidate has finished or
  failed (and when none finished with a finite loss)."""
  failures = common.read_failures(bert_dir)
  chosen = {}
  for optimizer in bert.optimizers:
    runs = _selection_runs(bert, bert_dir, optimizer)
    if not all((run is not None and run.finished) or name in failures
               for _, name, run in runs):
      continue
    losses = {lr: run.results["train_loss"] for lr, _, run in runs
              if run is not None and run.finished and math.isfinite(run.results["train_loss"])}
    if losses:
      chosen[optimizer] = min(losses, key=losses.get)
  return chosen


def _bert_status(run, name: str, failures: dict[str, str], finished: str) -> str:
  if run is not None and run.finished:
    return finished
  if name in failures:
    return f"failed: {failures[name]}"
  return "unfinished" if run is not None else "not run"


def bert_selection_rows(bert, bert_dir: str) -> list[dict]:
  """T2's rows of the BERT rate-selection runs (the smallest batch size, every candidate)."""
  failures = common.read_failures(bert_dir)
  chosen = select_bert_rates(bert, bert_dir)
  rows = []
  for optimizer in bert.optimizers:
    for lr, name, run in _selection_runs(bert, bert_dir, optimizer):
      done = run is not None and run.finished
      rows.append({
          "task": f"BERT-tiny rate selection (base rate {lr:g} at batch {bert.base_batch_size})",
          "optimizer": optimizer, "batch_size": min(bert.batch_sizes),
          "metric": "final train loss (selects the rate)",
          "value": f"{run.results['train_loss']:.4f}" if done else None,
          "mean": run.results["train_loss"] if done else None,
          "train_loss": run.results["train_loss"] if done else None,
          "held_out_loss": run.results["test_loss"] if done else None,
          "steps": run.results["step"] if done else None,
          "peak_learning_rate": run.config["optimizer"]["learning_rate"] if done else None,
          "status": _bert_status(run, name, failures,
                                 "chosen" if chosen.get(optimizer) == lr else "candidate"),
          "run_dirs": report_lib.relative(run.path) if done else ""})
  return rows


def report(workdir: str, settings, *, full: bool) -> Report:
  """T2's table, claims and figure from the run directories.

  Args:
    workdir: the root of T2's run folders (:func:`runs_dirs`).
    settings: ``configs/paper/t2.py``'s config.
    full: whether the runs have the full settings.

  Returns:
    The report ``t2``.
  """
  mnist_dir, bert_dir = runs_dirs(workdir, full)
  mnist_rows, accuracy = mnist1d_rows(settings.mnist1d, mnist_dir)
  bert_rows, bert_loss = bert_rows_and_losses(settings.bert, bert_dir)
  rows = mnist_rows + bert_selection_rows(settings.bert, bert_dir) + bert_rows
  return Report(
      name="t2", title="T2: large-batch training, SGD / Adam / LARS / LAMB",
      columns=[("task", "task"), ("optimizer", "optimizer"), ("batch_size", "batch"),
               ("metric", "metric"), ("value", "value (mean ± std over seeds)"),
               ("train_loss", "final train loss"), ("held_out_loss", "held-out loss"),
               ("steps", "steps"), ("peak_learning_rate", "peak lr"), ("status", "status"),
               ("run_dirs", "run directories")],
      rows=rows, claims=claims(settings, accuracy, bert_loss),
      configs=[f"configs/paper/t2.py{':full=true' if full else ''}",
               f"configs/paper/t2_mnist1d.py{':full=true' if full else ''}",
               "configs/paper/large_batch.py (RECIPES)",
               f"configs/paper/t2_bert.py{':full=true' if full else ''}",
               "configs/bert.py:tiny,pydoc=true"],
      notes=notes(settings, rows, bert_dir),
      plot=functools.partial(plot, settings, accuracy, bert_loss))


def mnist1d_rows(mnist1d, mnist_dir: str) -> tuple[list[dict], dict]:
  """T2's MNIST-1D rows, one per (optimizer, batch size), and their test accuracies'
  ``(optimizer, batch size) -> (mean, std)`` over the finished seeds."""
  rows, accuracy = [], {}
  failures = common.read_failures(mnist_dir)
  for optimizer in mnist1d.optimizers:
    for batch_size in mnist1d.batch_sizes:
      names = [t2_mnist1d.run_name(optimizer, batch_size, s) for s in range(mnist1d.seeds)]
      runs = [report_lib.read_run(os.path.join(mnist_dir, n)) for n in names]
      runs = [r for r in runs if r is not None and r.finished]
      failed = [failures[n] for n in names if n in failures]
      values = [r.results["test_accuracy"] for r in runs]
      accuracy[optimizer, batch_size] = report_lib.mean_std(values)
      rows.append({
          "task": "MNIST-1D MLP", "optimizer": optimizer, "batch_size": batch_size,
          "metric": "test accuracy %", "value": report_lib.format_mean_std(values, 100, 2),
          "mean": accuracy[optimizer, batch_size][0] * 100 if runs else None,
          "train_loss": float(np.mean([r.results["train_loss"] for r in runs]))
                        if runs else None,
          "steps": runs[0].results["step"] if runs else None,
          "peak_learning_rate": runs[0].config["optimizer"]["learning_rate"] if runs else None,
          "status": ("failed: " + failed[0]) if failed else (
              f"{len(runs)}/{mnist1d.seeds} seeds done"),
          "run_dirs": " ".join(report_lib.relative(r.path) for r in runs)})
  return rows, accuracy


def bert_rows_and_losses(bert, bert_dir: str) -> tuple[list[dict], dict]:
  """T2's BERT rows at each optimizer's chosen rate, one per (optimizer, batch size), and the
  finished runs' ``(optimizer, batch size) -> held-out loss``."""
  rows, bert_loss = [], {}
  failures = common.read_failures(bert_dir)
  chosen = select_bert_rates(bert, bert_dir)
  for optimizer in bert.optimizers:
    for batch_size in bert.batch_sizes:
      name = (t2_bert.run_name(optimizer, batch_size, chosen[optimizer])
              if optimizer in chosen else None)
      run = None if name is None else report_lib.read_run(os.path.join(bert_dir, name))
      done = run is not None and run.finished
      if done:
        bert_loss[optimizer, batch_size] = run.results["test_loss"]
      rows.append({
          "task": "BERT-tiny masked LM (pydoc_data)", "optimizer": optimizer,
          "batch_size": batch_size, "metric": "final held-out masked-LM loss",
          "value": f"{run.results['test_loss']:.4f} (n=1)" if done else None,
          "mean": run.results["test_loss"] if done else None,
          "train_loss": run.results["train_loss"] if done else None,
          "steps": run.results["step"] if done else None,
          "peak_learning_rate": run.config["optimizer"]["learning_rate"] if done else None,
          "status": ("rate not chosen yet" if name is None else
                     _bert_status(run, name, failures, "done")),
          "run_dirs": report_lib.relative(run.path) if done else ""})
  return rows, bert_loss


def plot(settings, accuracy: dict, bert_loss: dict, fig) -> None:
  """T2's figure: MNIST-1D's test accuracy (left) and BERT's held-out loss (right) against the
  batch size, one line per optimizer."""
  left, right = plots.panels_in_a_row(fig, 2, step=0.5, bottom=0.22, width=0.4, height=0.68)
  for optimizer in settings.mnist1d.optimizers:
    xs = [b for b in settings.mnist1d.batch_sizes if not math.isnan(accuracy[optimizer, b][0])]
    if xs:  # an empty errorbar leaves the log-scaled axis without positive limits
      left.errorbar(xs, [100 * accuracy[optimizer, b][0] for b in xs],
                    yerr=[100 * accuracy[optimizer, b][1] for b in xs], marker="o",
                    capsize=3, label=optimizer)
  left.axhline(10, color="grey", ls=":", lw=1, label="chance (10 classes)")
  plots.log2_axis(left, settings.mnist1d.batch_sizes)
  plots.decorate(
      left, xlabel="batch size",
      ylabel=f"test accuracy % (mean ± std, {settings.mnist1d.seeds} seeds)",
      title=f"MNIST-1D MLP, {settings.mnist1d.epochs} epochs at every batch size",
      title_size=10, legend_size=8)
  for optimizer in settings.bert.optimizers:
    xs = [b for b in settings.bert.batch_sizes if (optimizer, b) in bert_loss]
    right.plot(xs, [bert_loss[optimizer, b] for b in xs], marker="o", label=optimizer)
  plots.log2_axis(right, settings.bert.batch_sizes)
  plots.decorate(
      right, xlabel="batch size", ylabel="held-out masked-LM loss (1 seed; lower is better)",
      title=f"BERT-tiny on pydoc_data, {settings.bert.epochs} epochs at every batch size",
      title_size=10, legend_size=8)


def notes(settings, rows: Sequence[dict], bert_dir: str) -> list[str]:
  """T2's settings, read from the configs and (BERT's model and data) a finished run."""
  recipes = "; ".join(f"{name} {r.base_learning_rate:g} ({r.scaling_rule}, {r.description})"
                      for name, r in large_batch.RECIPES.items())
  dead = [f"{r['optimizer']} at {r['batch_size']}" for r in rows
          if r["task"].startswith("MNIST") and r["mean"] is not None and r["mean"] < 15]
  lines = [
      f"MNIST-1D: configs/paper/large_batch.py through the runner (MLP "
      f"{large_batch.HIDDEN_WIDTHS}, {settings.mnist1d.num_samples} samples, 80/20 split, "
      f"{large_batch.get_config().num_devices} simulated devices, dense exchange), "
      f"{settings.mnist1d.epochs} epochs at every batch size (fewer steps at larger batches), "
      f"warm-up over the first {large_batch.WARMUP_FRACTION:.0%} of steps, then polynomial "
      f"decay. Learning rates tuned once at batch {large_batch.BASE_BATCH_SIZE} and scaled, "
      f"never re-tuned at a larger batch: {recipes}.",
      "Chance-level accuracy (10%) with a final train loss of ln 10 = 2.30 is a network whose "
      "ReLUs died; a larger loss is divergence. Here: " + (", ".join(dead) or "none") + ". "
      "Linear scaling gives peak rates up to 32x the tuned one after a warm-up of a few steps; "
      "LARS's paper re-tunes the rate per batch size and warms up for 5 epochs (MLPerf's LARS "
      "peaks at 10-31 with eta 0.001)."]
  bert = next((run for o in settings.bert.optimizers
               for _, _, run in _selection_runs(settings.bert, bert_dir, o)
               if run is not None and run.finished), None)
  model = "" if bert is None else (
      f" ({bert.config['model']['num_layers']} layers, {bert.config['model']['hidden']} "
      f"hidden, {bert.config['model']['num_heads']} heads, {bert.results['num_params']:,} "
      f"parameters; sequences of {bert.config['data']['seq_len']} tokens, "
      f"{bert.config['data']['eval_fraction']:.0%} held out)")
  chosen = select_bert_rates(settings.bert, bert_dir)
  candidates = "; ".join(f"{o} {', '.join(f'{lr:g}' for lr in settings.bert.learning_rates[o])}"
                         + (f" (chosen: {chosen[o]:g})" if o in chosen else " (not chosen yet)")
                         for o in settings.bert.optimizers)
  lines += [
      f"BERT-tiny{model}: masked LM on CPython's pydoc_data help texts (topics.py, 0.75 MB), "
      f"{settings.bert.epochs} epochs at every batch size, 8 simulated devices, dense "
      f"exchange; peak learning rate = base rate x sqrt(batch / "
      f"{settings.bert.base_batch_size}), linear warm-up over the first "
      f"{settings.bert.warmup_fraction:.0%} of training, then linear decay; LAMB weight decay "
      "0.01, Adam none. One seed per point.",
      f"BERT rate selection: candidate base rates {candidates}; each optimizer takes the one "
      f"with the lowest final training loss at batch {min(settings.bert.batch_sizes)} (the "
      "'rate selection' rows; held-out loss is not used to choose), then keeps it, scaled, at "
      "every batch size. configs/bert.py's LAMB rate 2e-3 is set for 2,000 steps; in these "
      "few steps LAMB's update (rate x the layer's weight norm) moves the weights far less "
      "than Adam's, hence larger candidates.",
  ]
  edge = [o for o, lr in chosen.items() if lr == max(settings.bert.learning_rates[o])]
  if edge:
    lines.append(f"The chosen rate of {' and of '.join(edge)} is the largest candidate (the "
                 "grid's edge): a larger one might train better still, so the BERT comparison "
                 "is between rates chosen on the same small grid, not between tuned optima.")
  return lines


def claims(settings, accuracy, bert_loss) -> list[Claim]:
  """T2's published claims: LAMB and LARS keep accuracy at large batch (You et al.), tuned
  SGD/Adam match them (Nado et al.), LAMB trains BERT at large batch at least as well as Adam."""
  small, large = min(settings.mnist1d.batch_sizes), max(settings.mnist1d.batch_sizes)
  mean = lambda o, b: 100 * accuracy[o, b][0]
  drops = {o: mean(o, small) - mean(o, large) for o in settings.mnist1d.optimizers
           if not math.isnan(accuracy[o, small][0]) and not math.isnan(accuracy[o, large][0])}
  ours = (f"MNIST-1D accuracy drop (points) from batch {small} to {large}: " +
          ", ".join(f"{o} {d:+.1f}" for o, d in drops.items())) if drops else "not run"
  scale = (f"a 16K-example task at batch <= {large}, rates tuned at batch {small} and scaled "
           "(not re-tuned per batch)")
  result = [
      Claim("LAMB keeps accuracy at large batch where SGD/Adam lose it (BERT-Large SQuAD F1 "
            "90.40 at batch 512, 91.46 at 32K in 101 min; 64K/32K mixed 90.58 in 76 min on "
            "1024 TPUv3)", "You et al., ICLR 2020", ours,
            drops["lamb"] < min(drops["sgd"], drops["adam"])
            if {"lamb", "sgd", "adam"} <= set(drops) else None,
            f"criterion: LAMB loses fewer points than SGD and Adam; {scale}"),
      Claim("LARS trains at large batch without SGD's accuracy loss (AlexNet-BN, ResNet-50 "
            "to batch 8K-32K)", "You, Gitman & Ginsburg 2017; MLPerf LARS (75.9% top-1)", ours,
            drops["lars"] < drops["sgd"] - 1 if {"lars", "sgd"} <= set(drops) else None,
            f"criterion: LARS loses at least 1 point less than SGD; {scale}")]
  sgd_adam = [o for o in ("sgd", "adam") if o in drops]
  lars_lamb = [o for o in ("lars", "lamb") if o in drops]
  if sgd_adam and lars_lamb:
    best = lambda names: max(names, key=lambda o: mean(o, large))
    a, b = best(sgd_adam), best(lars_lamb)
    ours = (f"at batch {large}: best of SGD/Adam {a} {mean(a, large):.1f}%, best of LARS/LAMB "
            f"{b} {mean(b, large):.1f}%")
  else:
    ours = "not run"
  result.append(Claim(
      "Well-tuned Nesterov momentum / Adam match LARS / LAMB at large batch",
      "Nado et al. 2021", ours, None,
      "their claim needs each optimizer re-tuned at each batch size; ours scales rates tuned at "
      f"batch {small}, so it cannot test it"))
  batches = sorted(settings.bert.batch_sizes)
  have = [b for b in batches if ("adam", b) in bert_loss and ("lamb", b) in bert_loss]
  if have:
    ours = "; ".join(f"batch {b}: adam {bert_loss['adam', b]:.3f}, lamb {bert_loss['lamb', b]:.3f}"
                     for b in have)
    reproduced = (bert_loss["lamb", batches[-1]] <= bert_loss["adam", batches[-1]]
                  if batches[-1] in have else None)
  else:
    ours, reproduced = "not run", None
  gap = (f"LAMB {bert_loss['lamb', batches[-1]] - bert_loss['adam', batches[-1]]:+.3f} vs Adam "
         "there; " if reproduced is not None else "")
  result.append(Claim(
      "LAMB trains BERT at large batch at least as well as Adam(W)", "You et al., ICLR 2020 "
      "(Adam(W) fails beyond 16K in their tuning)", ours, reproduced,
      f"held-out masked-LM loss at the largest batch ({batches[-1]}); {gap}one seed per point, "
      "so a gap of a few hundredths may be noise; BERT-tiny on 0.75 MB of text, batch <= "
      f"{batches[-1]}, far from the paper's 32K"))
  return result


