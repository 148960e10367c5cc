"""A1-LM, workers that are slow, late or gone: validation loss, retention, modelled time to
dense's loss on 1 and 10 Gbit/s links and useful throughput of each aggregator
(``config.aggregation``) for DiLoCo int8 and Streaming DiLoCo at 100x fewer total bytes, with
worker speed spreads 0 and 0.5 and drop-out rates 0 and 0.1 (``configs/paper/a1_lm.py``), beside
the published figures, each marked reproduced or not as a direction (our scale is not theirs).

The time model (:func:`seconds_at`): a cell's compute is the simulator's (``results.json``'s
``modelled_seconds``, in steps of a speed-1 worker, less the communication the run priced),
times the measured seconds of a step of the row's run with the workers alike; its
communication is the alpha-beta model's (:func:`experiments.reproduce.f5.kind_times`) on the
link, per step kind. ``eager`` and ``delayed`` hide a round's communication behind the next
round's compute: ``max(compute, communication)`` over the run (a lower bound of its rounds' sum
of maxima).
"""

import math
import os

import ml_collections
import numpy as np

from compressors import aggregation as aggregation_lib
from compressors import worker_sim
from compressors.network import topology as topo
from configs.paper import a1_lm as sweep_config
from configs.paper import lm as lm_config
from experiments import methods
from experiments.reproduce import common
from experiments.reproduce import f5
from experiments.reproduce import plots
from experiments.reproduce import report as report_lib
from experiments.reproduce import t1_lm
from experiments.reproduce.report import Claim
from experiments.reproduce.report import Report

TITLE = "A1-LM: slow, late or gone workers: each aggregator under speed spread and drop-outs"
run_folders = t1_lm.run_folders  # A1-LM's runs are in T1-LM's folder (F6-LM's shared)
LINKS = f5.LINKS
WORKERS = 8


def produce(options: common.Options) -> Report:
  """Runs (unless ``report_only``) each rule's tuning budget, then A1-LM's grid at one seed and its
  seeded condition's cells at three, each cell at its rule's chosen scale, and the probes; then
  its report."""
  workdir = t1_lm.runs_dir(options)
  if not options.report_only:
    tune(workdir, options.jobs)
    chosen = "+".join(f"{name}@{scale:g}" for name, scale in tuned_scales(workdir).items())
    run(workdir, f"chosen={chosen}", options.jobs)
    run(workdir, f"seeds=3,seeded=True,chosen={chosen}", options.jobs)
    run(workdir, "probes=True", options.jobs)
  return report(workdir)


def tune(workdir: str, jobs: int) -> None:
  """Each rule's tuning budget (:func:`configs.paper.a1_lm.tuning_runs`): T1-LM's rate scales,
  then past an end that wins, round by round (:func:`experiments.reproduce.t1_lm.extend_tuning`)."""
  run(workdir, "tuning=grid", jobs)
  t1_lm.extend_tuning(workdir, sweep_config.tuning_labels(),
                      lambda chosen: run(workdir, f"tuning={chosen}", jobs))


def tuned_scales(workdir: str) -> dict[str, float]:
  """Tuning label -> the rate scale its rule's finished tuning chose (a rule still tuning, or
  diverged at every scale, is absent: its cells run at the row's scale)."""
  return {name: scale for name in sweep_config.tuning_labels()
          if (scale := t1_lm.chosen_scale(workdir, name)) is not None}


def tuning_note(workdir: str) -> str:
  """Each rule's tuning: training loss by rate scale (``*`` the choice), its choice against
  the scale the grid runs at, or how far it has got."""
  parts = []
  for name in sweep_config.tuning_labels():
    tried = t1_lm.tuning(workdir, name)
    chosen, pending = t1_lm.reported_scale(workdir, name)
    row, rule, spread, dropout = sweep_config.cells()[name]
    grid = sweep_config.scale_of(name)
    losses = " / ".join(f"{s:g}: {v:.3f}" + (" *" if s == chosen else "")
                        for s, v in tried.items())
    state = (t1_lm.tuning_status(tried) if chosen is None else
             f"provisional, {pending:g} next" if pending is not None else
             "chose the row's scale" if chosen == grid else
             f"chose {chosen:g}, its cells run there; the row's is {grid:g}")
    parts.append(f"{row} {rule} (spread {spread:g}, drop-outs {dropout:g}): "
                 f"{losses or 'none run'} ({state})")
  return ("Tuning (T1-LM's budget for every rule, at its tuning condition, seed 0; training "
          "loss over the last tenth by rate scale): " + "; ".join(parts) + ".")


def run(workdir: str, arg: str, jobs: int) -> None:
  """Runs ``configs/paper/a1_lm.py:arg``'s unfinished runs under ``workdir``."""
  sweep = sweep_config.get_config(arg)
  overrides = dict(sweep.overrides)
  overrides["data"] = {"cache_dir": os.path.abspath(os.path.join(workdir, "tokenizers"))}
  sweep.overrides = overrides
  common.run_sweep_config(sweep, workdir, jobs=jobs)


def runs_of(workdir: str, cell_label: str,
            chosen: dict[str, float] | None = None) -> list[report_lib.Run]:
  """The finished runs of a cell or a reference at its scale (:func:`configs.paper.a1_lm.scale_of`
  with ``chosen``; seeds 0, 1, 2)."""
  return t1_lm.label_runs(workdir, cell_label, sweep_config.scale_of(cell_label, chosen), 3)


def seconds_at(run: report_lib.Run, link: topo.Link, compute: float) -> float:
  """The modelled seconds of ``run``'s steps on ``link``, with ``compute`` seconds a step of a
  speed-1 worker (see the module docstring)."""
  config = run.config
  steps = int(run.results["step"])
  counts = t1_lm.kind_counts(config, steps)
  exposed = lambda l, c: sum(t.exposed * counts[k] for k, t in
                             f5.kind_times(config, l, WORKERS, c).items())
  communication = exposed(link, compute)
  modelled = run.results.get("modelled_seconds")
  if modelled is None:  # no simulator: the workers alike, every step computed
    return steps * compute + communication
  unit = config["workers"]["step_seconds"]
  if config["aggregation"] in aggregation_lib.OVERLAPPED_RULES:
    return max(modelled / unit * compute, communication)
  priced = exposed(topo.ETHERNET_1G, unit)  # what the run charged on config.workers' link
  return (modelled - priced) / unit * compute + communication


def useful_steps(run: report_lib.Run) -> float:
  """Worker-steps whose work reached the model (every one without a simulator)."""
  steps = int(run.results["step"])
  if run.results.get("modelled_seconds") is None:
    return steps * WORKERS
  config = run.config
  per_step = config["batch_size"] / WORKERS * config["data"]["seq_len"]
  return run.results["useful_throughput"] * run.results["modelled_seconds"] / per_step


def capacity_steps(run: report_lib.Run, seconds: float, compute: float) -> float:
  """Worker-steps the run's workers could have computed in ``seconds`` with nothing waited for
  or lost: each worker at its own drawn speed (the simulator's, rebuilt from the config), a
  speed-1 step taking ``compute`` seconds. A worker faster than speed 1 counts for more than one,
  so that no aggregator's useful share exceeds 100%."""
  config = ml_collections.ConfigDict(run.config)
  sim = methods.worker_simulation(config, WORKERS) if "workers" in config else None
  if sim is None:
    return WORKERS * seconds / compute
  relative = np.asarray(worker_sim.init(sim).seconds_per_step, np.float64) / sim.step_seconds
  return float(np.sum(seconds / (compute * relative)))


def measured_compute(workdir: str, row: str | None) -> float | None:
  """Measured seconds of a step of the row's run with the workers alike (F6-LM's; dense's for
  the references), the compute every cell of the row is priced with."""
  source = "dense" if row is None else sweep_config.ROWS[row][1]
  runs = runs_of(workdir, source)
  return float(np.median([f5.step_seconds(r) for r in runs])) if runs else None


def timing(runs, compute: float, target: float | None) -> dict:
  """A cell's modelled seconds to ``target`` (dense's final loss) on each link, and its useful
  throughput on 1 Gbit/s (the share of the workers' own compute that reached the model:
  :func:`capacity_steps`), the mean of its runs'."""
  out, seconds = {}, {}
  steps, loss = runs[0].series("test_loss")
  for name, link in LINKS.items():
    seconds[name] = [seconds_at(r, link, compute) for r in runs]
    total = float(np.mean(seconds[name]))
    key = name.split()[0]
    out[f"seconds_{key}g"] = total
    reached = (math.nan if target is None or not len(steps) else
               f5.time_to(steps, loss, total / runs[0].results["step"], target))
    out[f"to_dense_{key}g"] = "not reached" if math.isnan(reached) else f"{reached:.3g}"
  useful = [useful_steps(r) / capacity_steps(r, t, compute)
            for r, t in zip(runs, seconds["1 Gbit/s"])]
  out["useful_pct"] = 100 * float(np.mean(useful)) if out["seconds_1g"] else None
  return out


def cell_row(workdir: str, cell_label: str, references: dict,
             chosen: dict[str, float] | None = None) -> dict:
  """One cell of the grid (or a reference), at its rule's chosen scale (``chosen``, as
  :func:`tuned_scales`): its status, loss, retention and time columns. Until the cell's seeds
  at that scale have all finished, the row's scale's runs stand in, and the status says so."""
  if cell_label in sweep_config.REFERENCES:
    row, rule, spread, dropout = None, "-", 0.0, 0.0
  else:
    row, rule, spread, dropout = sweep_config.cells()[cell_label]
  scale = sweep_config.scale_of(cell_label, chosen)
  out = {"row": row or cell_label, "aggregation": rule, "spread": spread, "dropout": dropout,
         "label": cell_label, "lr_scale": scale}
  refused = None if row is None else sweep_config.refusal(row, rule, spread, dropout)
  runs, pending = ([] if refused else runs_of(workdir, cell_label, chosen)), ""
  seeds = 3 if row is None or (spread, dropout) == sweep_config.SEEDED else 1
  row_scale = sweep_config.scale_of(cell_label)
  if not refused and len(runs) < seeds and scale != row_scale:
    stand_in = runs_of(workdir, cell_label)
    if len(stand_in) > len(runs):
      runs, out["lr_scale"] = stand_in, row_scale
      pending = f"; at the row's scale: its rule's {scale:g} not run yet"
  if refused or not runs:
    out["status"] = refused or "not run yet"
    return out
  losses = [r.results["test_loss"] for r in runs]
  out.update(status=f"{len(runs)} seed(s){pending}", losses=losses,
             loss_mean=float(np.mean(losses)),
             val_loss=report_lib.format_mean_std(losses, 1, 3),
             run_dirs=" ".join(report_lib.relative(r.path) for r in runs),
             **t1_lm.scale_fields(runs[0]))
  staleness = [r.results.get("staleness") for r in runs]
  out["staleness"] = ("-" if None in staleness else
                      f"{np.mean([s['mean'] for s in staleness]):.2f} / "
                      f"{max(s['max'] for s in staleness)}")
  out["dropped"] = float(np.mean([r.results.get("updates_dropped", 0) for r in runs]))
  if set(references) == set(sweep_config.REFERENCES):
    out.update(t1_lm.retention_against(losses, t1_lm.data_of(runs), references["solo"],
                                       references["dense"]))
  compute = measured_compute(workdir, row)
  if compute is not None and cell_label != "solo":  # one worker alone: no cluster to time
    target = float(np.mean(references["dense"]["losses"])) if "dense" in references else None
    out.update(timing(runs, compute, target))
  return out


def grid_rows(workdir: str) -> list[dict]:
  """The references, then every cell (refused ones marked), row by row, rule by rule."""
  references = {name: {"losses": [r.results["test_loss"] for r in runs],
                       "data": t1_lm.data_of(runs)}
                for name in sweep_config.REFERENCES if (runs := runs_of(workdir, name))}
  labels = [*sweep_config.REFERENCES, *sweep_config.cells()]
  chosen = tuned_scales(workdir)
  return [cell_row(workdir, label, references, chosen) for label in labels]


def _cell(rows: list[dict], row: str, rule: str, spread: float, dropout: float) -> dict | None:
  found = [r for r in rows if (r["row"], r["aggregation"], r["spread"], r["dropout"])
           == (row, rule, spread, dropout) and r.get("losses")]
  return found[0] if found else None


def _verdict(cells: list, test, ours: str, why_yes: str, why_no: str) -> tuple:
  """``(ours, reproduced, why)``: None where a cell the claim needs has no run."""
  if any(c is None for c in cells):
    return "its cells have not all run yet", None, "not run yet"
  yes = bool(test(*cells))
  return ours.format(*cells), yes, why_yes if yes else why_no


# Kale et al. 2025's losses (500M model): no overlap, naive one-step-delayed outer step, eager.
KALE = {"sync": 2.67, "delayed": 3.01, "eager": 2.69}


def gap_closed(sync: float, delayed: float, eager: float) -> float:
  """The share of naive delay's loss gap over no overlap that eager closes (theirs: 94%; nan
  where there is no gap)."""
  return (delayed - eager) / (delayed - sync) if delayed != sync else math.nan


def _kale(cells: list, ours_label: str, here: str) -> Claim:
  """Kale et al.'s comparison on ``cells`` (sync, delayed, eager; None where one has not run):
  the direction is reproduced where naive delay loses to no overlap and eager closes most (over
  half) of that gap."""
  if None not in cells:
    cells[2]["gap_closed"] = 100 * gap_closed(*(c["loss_mean"] for c in cells))
  ours, yes, why = _verdict(
      cells, lambda s, d, e: d["loss_mean"] > s["loss_mean"] and e["gap_closed"] > 50,
      f"{ours_label}: sync (no overlap) {{0[loss_mean]:.4g}}, delayed {{1[loss_mean]:.4g}}, "
      "eager {2[loss_mean]:.4g}: eager closes {2[gap_closed]:.3g}% of the delayed step's gap",
      "naive delay loses to no overlap and eager closes most of its gap",
      "eager does not close most of naive delay's gap (or naive delay does not lose)")
  if None in cells:  # what has run so far
    ours = f"{ours_label}: " + ", ".join(
        f"{rule} " + ("not run yet" if c is None else f"{c['loss_mean']:.4g}")
        for rule, c in zip(KALE, cells))
  theirs = ", ".join(f"{name} {KALE[rule]}" for rule, name in zip(
      KALE, ("no overlap", "naive one-step delayed outer step", "eager")))
  return Claim(f"{theirs} loss: eager closes {100 * gap_closed(*KALE.values()):.3g}% of the "
               "naive delay's gap", f"Kale et al. 2025 (eager updates), 500M model; here {here}",
               ours, yes, why)


def kale_claim(rows: list[dict], row: str) -> Claim:
  """Kale et al.'s comparison with the workers alike, for one row of the grid (8 workers)."""
  return _kale([_cell(rows, row, rule, 0.0, 0.0) for rule in KALE],
               f"{row}, loss with the workers alike", row)


def kale_probe_claim(workdir: str) -> Claim:
  """Kale et al.'s comparison on the probes with :data:`configs.paper.a1_lm.PROBE_WORKERS`
  workers (eager's own term half its step), DiLoCo int8 at its rate."""
  names = list(sweep_config.probes())[len(sweep_config.PROBE_RULES):]
  runs = [report_lib.read_run(os.path.join(workdir, name)) for name in names]
  workers = sweep_config.PROBE_WORKERS
  return _kale([{"loss_mean": r.results["test_loss"]} if r and r.finished else None
                for r in runs], f"diloco_int8 with {workers} workers (probe, one seed), loss",
               f"diloco_int8 with {workers} workers")


def outer_loop_radius(rate: float, momentum: float, fresh: float, stiffness: float) -> float:
  """Spectral radius of DiLoCo's outer loop, linearised, along one direction: the round's
  pseudo-gradient is ``stiffness * x`` (``x``: the distance to the optimum at the round's start;
  ``stiffness`` in (0, 1]: the share of it ``H`` inner steps cover), and the outer optimizer
  (SGD with Nesterov ``momentum`` at ``rate``) takes ``fresh`` of this round's and ``1 - fresh``
  of the previous round's (sync: 1; eager with ``N`` workers: ``1 / N``, the own term; naive
  delay: 0). Above 1 the direction's error grows every round. A model, not a measurement: the
  inner optimizer and the network are not linear."""
  pull = np.array([stiffness * fresh, stiffness * (1 - fresh), 0.0])  # g from (x, x_prev, v)
  velocity = momentum * np.array([0.0, 0.0, 1.0]) + pull
  moved = np.array([1.0, 0.0, 0.0]) - rate * (pull + momentum * velocity)
  return float(np.abs(np.linalg.eigvals(np.stack([moved, [1.0, 0.0, 0.0], velocity]))).max())


def worst_radius(rate: float, momentum: float, fresh: float) -> float:
  """:func:`outer_loop_radius`'s largest over stiffnesses in (0, 1]."""
  return max(outer_loop_radius(rate, momentum, fresh, c) for c in np.linspace(0.005, 1, 200))


def stability_note(workers: int = WORKERS) -> str:
  """The linearised outer loop's worst radius for sync, eager and naive delay at each row's outer
  rate in the grid and at the probes' (:data:`configs.paper.a1_lm.PROBE_SCALE`), with
  ``workers`` and with 2 workers."""
  probe = dict(zip(sweep_config.PROBE_RULES, sweep_config.probes().values()))["eager"]
  sources = [(row, sweep_config.config_arg(f"a1_{row}_eager_sp0_do0", 0))
             for row in sweep_config.ROWS] + [("diloco_int8 probe", probe)]
  parts = []
  for name, arg in sources:
    config = lm_config.get_config(arg)
    settings = config.compression[config.method]
    rate, momentum = settings.outer_learning_rate, settings.outer_momentum
    radii = {f"eager, {n} workers": worst_radius(rate, momentum, 1 / n) for n in (workers, 2)}
    parts.append(f"{name} (outer rate {rate:g}, momentum {momentum:g}): sync "
                 f"{worst_radius(rate, momentum, 1.0):.3f}, " +
                 ", ".join(f"{k} {v:.3f}" for k, v in radii.items()) +
                 f", naive delay {worst_radius(rate, momentum, 0.0):.3f}")
  return ("Modelled, not measured: the outer loop linearised (outer_loop_radius: Nesterov on a "
          "pseudo-gradient stiffness x c, c in (0, 1], eager's own term 1/N of its step), worst "
          "spectral radius over c (above 1: the stiffest directions grow every round): " +
          "; ".join(parts) + f". At N = {workers} eager is {workers - 1}/{workers} naive delay; "
          "the model predicts its gain over naive delay shrinks with the workers.")


def probe_note(workdir: str) -> str:
  """The off-grid probes' losses (:func:`configs.paper.a1_lm.probes`), those that have run."""
  found = []
  for rule, name in zip(sweep_config.PROBE_RULES * 2, sweep_config.probes()):
    run = report_lib.read_run(os.path.join(workdir, name))
    found.append(f"{rule} " + (f"{run.results['test_loss']:.4g}" if run and run.finished
                               else "not run yet"))
  k = len(sweep_config.PROBE_RULES)
  return ("Off-grid probes (DiLoCo int8, workers alike, one seed), validation loss: 8 workers at "
          f"rate scale {sweep_config.PROBE_SCALE:g}, a quarter of the row's: " +
          ", ".join(found[:k]) + f"; {sweep_config.PROBE_WORKERS} workers (the same global "
          "batch) at the row's rate: " + ", ".join(found[k:]) + ".")


def claims(rows: list[dict]) -> list[Claim]:
  """The published figures beside ours, each a direction at our scale (DiLoCo int8 at 100x)."""
  cell = lambda rule, spread, dropout: _cell(rows, "diloco_int8", rule, spread, dropout)
  liu = [cell(rule, 0.5, 0.0) for rule in ("sync", "async", "naive_async")]
  liu_text = ("perplexity at speed spread 0.5: sync {0[loss_mean]:.4g} nats ("
              "{0[ppl]:.4g}), async {1[loss_mean]:.4g} ({1[ppl]:.4g}), naive async "
              "{2[loss_mean]:.4g} ({2[ppl]:.4g})")
  for c in liu:
    if c is not None:
      c["ppl"] = math.exp(c["loss_mean"])
  liu_ours, liu_yes, liu_why = _verdict(
      liu, lambda s, a, n: n["loss_mean"] > max(s["loss_mean"], a["loss_mean"]) and abs(
          a["loss_mean"] - s["loss_mean"]) < n["loss_mean"] - s["loss_mean"], liu_text,
      "naive async is the worst and Delayed Nesterov stays nearer sync than it",
      "not in that order at our scale")
  decoupled = [cell(rule, 0.5, 0.1) for rule in ("quorum", "sync")]
  dec_ours, dec_yes, dec_why = _verdict(
      decoupled, lambda q, s: q.get("useful_pct", 0) > s.get("useful_pct", 0),
      "useful throughput at spread 0.5 and drop-outs 0.1 on 1 Gbit/s: quorum "
      "{0[useful_pct]:.3g}%, sync {1[useful_pct]:.3g}%", "quorum keeps more of the workers' "
      "compute than sync", "quorum keeps less than sync")
  return [
      Claim("sync DiLoCo 17.23, naive async 18.08, async with Delayed Nesterov and per-worker "
            "step counts 17.26 perplexity", "Liu et al. 2024 (Async Local-SGD), 150M model",
            liu_ours, liu_yes, liu_why),
      *(kale_claim(rows, row) for row in sweep_config.ROWS),
      Claim("useful throughput under failures 88% with a quorum against 27% synchronous",
            "Decoupled DiLoCo", dec_ours, dec_yes, dec_why)]


def plot_grid(rows: list[dict]):
  """Each row's validation loss by aggregator, a panel a row and a group of bars a condition,
  the seeds' standard deviation as error bars where a cell has more than one seed (none drawn
  for one), with dense's and solo's losses as lines."""
  def plot(fig):
    panels = plots.panels_in_a_row(fig, len(sweep_config.ROWS), step=0.4, bottom=0.14,
                                   width=0.34, height=0.76)
    width = 0.8 / len(sweep_config.RULES)
    low = min([r["loss_mean"] for r in rows if r.get("loss_mean")] or [0]) * 0.98
    for ax, row in zip(panels, sweep_config.ROWS):
      for i, rule in enumerate(sweep_config.RULES):
        cells = [(k, c) for k, cond in enumerate(sweep_config.conditions())
                 if (c := _cell(rows, row, rule, *cond)) is not None]
        if cells:
          offset = i - (len(sweep_config.RULES) - 1) / 2
          ax.bar([k + offset * width for k, _ in cells], [c["loss_mean"] for _, c in cells],
                 width, yerr=[float(np.std(c["losses"], ddof=1)) if len(c["losses"]) > 1
                              else np.nan for _, c in cells], capsize=2, label=rule)
      for name, style in (("dense", "-"), ("solo", "--")):
        losses = next((r.get("losses") for r in rows if r["row"] == name and r.get("losses")),
                      None)
        if losses:
          ax.axhline(float(np.mean(losses)), color="black", ls=style, lw=0.8, label=name)
      ax.set_xticks(range(len(sweep_config.conditions())),
                    [f"spread {s:g}\ndrop-outs {d:g}" for s, d in sweep_config.conditions()],
                    fontsize=8)
      ax.set_ylim(bottom=low)
      plots.decorate(ax, ylabel="validation loss, nats/token",
                     title=f"A1-LM: {row} at 100x, each aggregator", title_size=10, grid="y")
    plots.legend_beside(panels[-1])
  return plot


COLUMNS = [("row", "row"), ("aggregation", "aggregation"), ("spread", "speed spread"),
           ("dropout", "drop-out rate"), ("status", "status"),
           ("val_loss", "val loss nats/token (mean ± std)"), ("retention_text", "retention"),
           ("tokens_per_param", "tokens/parameter"), ("per_worker_tokens", "tokens/worker/step"),
           ("to_dense_1g", "modelled s to dense's loss, 1 Gbit/s"),
           ("to_dense_10g", "modelled s to dense's loss, 10 Gbit/s"),
           ("seconds_1g", "modelled s of the run, 1 Gbit/s"),
           ("useful_pct", "useful throughput % (1 Gbit/s)"),
           ("staleness", "staleness mean / max"), ("dropped", "updates dropped"),
           ("lr_scale", "lr scale"), ("run_dirs", "run directories")]


def report(workdir: str) -> Report:
  rows = grid_rows(workdir)
  table = [{k: v for k, v in r.items() if k != "losses"} for r in rows]
  return Report(
      name="a1_lm", title=TITLE, columns=COLUMNS, rows=table,
      claims=[*claims(rows), kale_probe_claim(workdir)],
      configs=["configs/paper/a1_lm.py", "configs/paper/lm.py"],
      notes=["The CPU tier's model and recipe (configs/paper/lm.py: 0.24M parameters), "
             "1,000 steps, 8 simulated workers, one seed a cell, three in the condition "
             f"{sweep_config.SEEDED} (spread, drop-out rate). Rates: each rule's cells at the "
             "scale its own tuning chose (below; the table's lr_scale); a rule still tuning at "
             "the scale F6-LM's tuning chose for the row (DiLoCo int8 at 100x 0.5, Streaming "
             "DiLoCo 1; dense 4, solo 1). The cells of sync with the workers alike, dense and "
             "solo at F6-LM's scales are F6-LM's own runs.",
             tuning_note(workdir),
             "Streaming DiLoCo takes every aggregator, each fragment's synchronisation one of "
             "the simulator's rounds (H/F steps); under eager each worker keeps its own outer "
             "parameters of every fragment. The delayed rule (Kale et al.'s naive "
             "one-step-delayed outer step) runs with the workers alike only: it is the middle "
             "row of their comparison (no overlap = sync, naive delay, eager).",
             " ".join(p.replace("\n", " ").strip() for p in __doc__.split("\n\n")[1:2]),
             "Useful throughput: the worker-steps whose work reached the model, over the "
             "worker-steps the run's 8 workers could have computed in its modelled seconds on "
             "1 Gbit/s, each at the speed the simulator drew for it (a worker faster than "
             "speed 1 counts for more than one, so that no rule exceeds 100%: measured against "
             "8 speed-1 workers, the asynchronous rules read 119-177%); the mean of the runs'.",
             "Published figures are at 150M-500M parameters and thousands of steps; ours at "
             "0.24M and 1,000: each verdict is a direction, not a number.",
             probe_note(workdir), stability_note(),
             *t1_lm.provenance_notes(workdir, "cpu")],
      plot=plot_grid(rows))
