"""F5: time to accuracy on a link: T1-LM's validation loss against modelled wall-clock.

For each T1-LM row, a step takes

  measured compute (this machine) + modelled communication (the cost model, one link),

* measured: the median of the run's logged step times (``batch_size / examples_per_sec`` of
  ``metrics.jsonl``, compilation and evaluation excluded by the median), on the machine that ran
  it: 8 simulated workers sharing its CPU cores, the compressor's own work (top-k's selection,
  TASC's scores and curvature) included;
* modelled: :func:`compressors.registry.cost` of the run's own settings (its config.json) on a
  flat cluster of 8 or 32 workers joined by the 1 Gbit/s or 10 Gbit/s preset of
  :mod:`compressors.network.topology` (``ETHERNET_1G``, ``CLOUD_10G``; nominal alpha and beta, not the
  calibration F3 fits on a loopback). At 32 workers the loss curve is still the 8-worker run's:
  only the communication is re-priced.

The speed-up of a method is dense's time to its final validation loss over the method's time to
reach that loss (linear between evaluations; none when it never does). Where compressed runs
never reach it, a second speed-up compares the times to the *common* loss, the highest of the
rows' final validation losses, which every row reaches.
"""

import functools
import math

import numpy as np

from compressors import registry
from compressors.network import topology as topo
from configs.paper import lm
from configs.paper import t1_lm as sweep_config
from experiments import methods
from experiments.reproduce import common
from experiments.reproduce import plots
from experiments.reproduce import t1_lm
from experiments.reproduce.report import Claim
from experiments.reproduce.report import Report

TITLE = "F5: time to accuracy, measured compute + modelled 1/10 Gbit/s communication"
LINKS = {"1 Gbit/s": topo.ETHERNET_1G, "10 Gbit/s": topo.CLOUD_10G}
WORKERS = (8, 32)


def produce(options: common.Options) -> Report:
  """Runs T1-LM's runs if missing (unless ``report_only``); the curves and speed-ups."""
  t1_lm.run_subset(options, "t1")
  return report(t1_lm.runs_dir(options), tier=options.tier, seeds=options.seeds)


def step_seconds(run) -> float:
  """The median logged step time of a run (seconds)."""
  rates = [r["examples_per_sec"] for r in run.metrics if r.get("examples_per_sec")]
  return run.config["batch_size"] / float(np.median(rates))


def comm_seconds(run, tier: str, link: topo.Link, workers: int) -> float:
  """The cost model's seconds for one exchange of the run's method with its own settings."""
  method = run.config["method"]
  own = run.config["compression"].get(method, {})
  settings = registry.default_settings(method, **own) if own else None
  shapes = methods.parameter_shapes(lm.get_config(f"tier={tier}"))
  return registry.cost(method, shapes, topo.Topology.flat(workers, link), settings).time


def time_to(steps: np.ndarray, loss: np.ndarray, seconds_per_step: float,
            target: float) -> float:
  """Seconds until ``loss`` (at ``steps``) first falls to ``target``, linear between points; NaN
  when it never does."""
  for i, value in enumerate(loss):
    if value <= target:
      if i == 0:
        return steps[0] * seconds_per_step
      fraction = (loss[i - 1] - target) / (loss[i - 1] - value)
      return (steps[i - 1] + fraction * (steps[i] - steps[i - 1])) * seconds_per_step
  return math.nan


def curve(workdir: str, label: str, seeds: int):
  """``(steps, mean validation loss, runs)`` of a row, None when none finished."""
  runs = t1_lm.label_runs(workdir, label, seeds)
  series = [r.series("test_loss") for r in runs]
  if not series:
    return None
  steps = series[0][0]
  return steps, np.mean([v[:len(steps)] for _, v in series], axis=0), runs


def report(workdir: str, *, tier: str, seeds: int) -> Report:
  """F5's table, curves and claims from T1-LM's run directories."""
  labels = [label for label in sweep_config.rows()
            if label in sweep_config.grid(tier, "t1")
            and not any(label.endswith(f"_{t}") for t in ("30x", "300x", "1000x"))]
  curves = {label: c for label in labels if (c := curve(workdir, label, seeds)) is not None}
  rows = time_rows(curves, tier)
  table = [{k: v for k, v in r.items() if k not in ("steps", "loss")} for r in rows]
  return Report(
      name="f5",
      title=f"F5: time to accuracy on 1 and 10 Gbit/s links, stdlib language model ({tier} tier)",
      columns=[("method", "row"), ("workers", "workers"), ("link", "link"),
               ("compute_s", "compute s/step (measured)"),
               ("comm_s", "communication s/step (modelled)"), ("step_s", "s/step"),
               ("final_val_loss", "final val loss"),
               ("time_to_dense_s", "s to dense's final loss"),
               ("speedup", "speed-up vs dense"),
               ("time_to_common_s", "s to the common loss"),
               ("speedup_common", "speed-up vs dense to the common loss"), ("seeds", "seeds")],
      rows=table, claims=claims(table),
      configs=[f"configs/paper/t1_lm.py:tier={tier},subset=t1", "configs/paper/lm.py"],
      notes=[__doc__.split("\n\n", 1)[1].replace("\n", " ").strip(),
             t1_lm.recipe_note(tier), *t1_lm.provenance_notes(workdir, tier)],
      plot=functools.partial(plot, rows, list(curves), tier))


def time_rows(curves: dict, tier: str) -> list[dict]:
  """One row per (row of ``curves``, link, workers): its step time and its time to dense's
  final loss and to the loss every row reaches (with the curve, ``steps`` and ``loss``)."""
  rows = []
  for label, (steps, loss, runs) in curves.items():
    compute = float(np.mean([step_seconds(r) for r in runs]))
    for link_name, link in LINKS.items():
      for workers in WORKERS:
        comm = comm_seconds(runs[0], tier, link, workers)
        rows.append({"method": label, "link": link_name, "workers": workers,
                     "seeds": len(runs), "compute_s": compute, "comm_s": comm,
                     "step_s": compute + comm, "final_val_loss": float(loss[-1]),
                     "steps": steps, "loss": loss})
  common_loss = max((r["final_val_loss"] for r in rows), default=math.nan)
  for row in rows:
    row["common_loss"] = common_loss
    row["time_to_common_s"] = time_to(row["steps"], row["loss"], row["step_s"], common_loss)
  for row in rows:
    dense = next((r for r in rows if r["method"] == "dense" and r["link"] == row["link"]
                  and r["workers"] == row["workers"]), None)
    if dense is None:
      continue
    target = dense["final_val_loss"]
    dense_time = dense["steps"][-1] * dense["step_s"]
    reach = time_to(row["steps"], row["loss"], row["step_s"], target)
    row["time_to_dense_s"] = reach
    row["speedup"] = dense_time / reach if math.isfinite(reach) else None
    row["reached"] = "yes" if math.isfinite(reach) else "no (never reaches dense's final loss)"
    row["speedup_common"] = dense["time_to_common_s"] / row["time_to_common_s"]
  return rows


def plot(rows: list[dict], labels: list[str], tier: str, fig) -> None:
  """F5's figure: validation loss against time, a panel per (link, workers), a line per row."""
  panels = fig.subplots(2, 2, sharey=True)
  fig.subplots_adjust(left=0.07, right=0.8, bottom=0.09, top=0.92, hspace=0.35, wspace=0.08)
  for (link_name, workers), ax in zip([(l, w) for l in LINKS for w in WORKERS], panels.flat):
    for row in rows:
      if (row["link"], row["workers"]) == (link_name, workers):
        ax.plot(row["steps"] * row["step_s"], row["loss"], marker="o", ms=3,
                label=row["method"], color=_colour(row["method"], labels))
    ax.set_xlim(left=0)
    plots.decorate(ax, title=f"{workers} workers, {link_name}", title_size=10,
                   xlabel="compute (measured) + comm. (modelled), s")
    ax.tick_params(labelsize=8)
  for ax in panels[:, 0]:
    ax.set_ylabel("validation loss, nats/token")
  handles, names = panels.flat[0].get_legend_handles_labels()
  fig.legend(handles, names, fontsize=9, loc="upper left", bbox_to_anchor=(0.81, 0.92))
  fig.suptitle(f"F5 ({tier} tier): validation loss vs measured compute + modelled "
               "communication (mean over seeds)", fontsize=11)


def _colour(label: str, labels: list[str]) -> str:
  """One colour per row, the same in every panel."""
  return f"C{labels.index(label) % 10}"


def claims(rows: list[dict]) -> list[Claim]:
  def at(method, link, workers):
    return next((r for r in rows if (r["method"], r["link"], r["workers"])
                 == (method, link, workers)), None)
  out = []
  tasc = f"tasc_{sweep_config.HEADLINE}"
  slow, fast = at(tasc, "1 Gbit/s", 8), at(tasc, "10 Gbit/s", 8)
  if slow and fast:
    describe = lambda r: (f"{r['speedup']:.2f}x" if r.get("speedup") else
                          "never reaches dense's final loss; to the common loss "
                          f"{r['common_loss']:.3f}: {r['speedup_common']:.2f}x")
    out.append(Claim(
        "Compression pays on slow links and much less on fast ones (at 10 Gbit/s 2-5x "
        "compression is enough)", "Agarwal et al., MLSys 2022 (REFERENCES.md)",
        f"TASC at 100x, 8 workers, time to dense's final loss: {describe(slow)} at 1 Gbit/s, "
        f"{describe(fast)} at 10 Gbit/s (compute {slow['compute_s']:.3f} s/step measured; "
        f"dense's communication {at('dense', '1 Gbit/s', 8)['comm_s']:.4f} and "
        f"{at('dense', '10 Gbit/s', 8)['comm_s']:.4f} s/step modelled)"
        if at("dense", "1 Gbit/s", 8) else "dense not run",
        # Where compression does not pay even on the slow link, the setting cannot test the
        # claim's contrast between links.
        None if slow["speedup_common"] <= 1 else
        slow["speedup_common"] >= fast["speedup_common"],
        "compute measured on 2 CPU cores running all 8 workers, so a step's compute is far "
        "larger than a GPU's and communication's share far smaller"))
  return out
