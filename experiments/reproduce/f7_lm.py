"""F7-LM, the horizon: does a longer run let the methods at 30x and 100x keep more of
communication's benefit? Retention (:mod:`experiments.reproduce.stats`) at the CPU tier's 1,000
steps (F6-LM's points) and at 4x and 16x the steps (``configs/paper/f7_lm.py``), the same tokens a
step and the schedule stretched, with dense and solo run at every length.

The rows are F6-LM's 1,000-step points at 100x, every family's, and the two best at 30x by
training loss (:func:`picked_rows`); every run keeps the rate scale its 1,000-step tuning chose.
The runs are in T1-LM's folder; a run of 16,000 steps may span sessions (it resumes from its
checkpoints) or run on a lent GPU: each row of the table names the device its runs trained on.
"""

import math
import os

from configs.paper import f6_lm as f6_config
from configs.paper import f7_lm as sweep_config
from configs.paper import lm
from experiments import provenance
from experiments.reproduce import common
from experiments.reproduce import plots
from experiments.reproduce import report as report_lib
from experiments.reproduce import t1_lm
from experiments.reproduce.report import Report

TITLE = "F7-LM: the horizon, retention at 1x, 4x and 16x the CPU tier's steps"
run_folders = t1_lm.run_folders  # F7-LM's runs are in T1-LM's folder
STEPS = lm.HARDWARE_TIERS["cpu"][1]["num_steps"]


def picked_rows(workdir: str) -> dict[str, float]:
  """Row -> rate scale: dense and solo at their chosen scales, and at each ratio of
  :data:`configs.paper.f7_lm.PICKED` the F6-LM points (on their ratio) with the lowest training
  criterion at their chosen scale, as many as it says (every family's where it says None); only
  rows whose tuning has finished."""
  out = {}
  for row in f6_config.REFERENCES:
    scale = t1_lm.chosen_scale(workdir, row)
    if scale is not None:
      out[row] = scale
  for ratio, count in sweep_config.PICKED.items():
    candidates = []
    for row in f6_config.rows():
      if f6_config.ratio_of(row) != ratio:
        continue
      scale = t1_lm.chosen_scale(workdir, row)
      if scale is not None:
        candidates.append((t1_lm.tuning(workdir, row)[scale], row, scale))
    finite = sorted(c for c in candidates if math.isfinite(c[0]))
    out.update({row: scale for _, row, scale in finite[:count]})
  return out


def seeded_rows(picked: dict[str, float]) -> list[str]:
  """The picked rows whose seeds run at the shortest longer length: dense, solo and those at
  :data:`configs.paper.f7_lm.SEEDED_RATIO`."""
  return [row for row in picked if row in f6_config.REFERENCES
          or f6_config.ratio_of(row) == sweep_config.SEEDED_RATIO]


def produce(options: common.Options) -> Report:
  """Runs the horizon's rows (unless ``report_only``; F6-LM's tuning must have finished for the
  rows to be picked), then its report."""
  workdir = t1_lm.runs_dir(options)
  if not options.report_only:
    picked = picked_rows(workdir)
    if picked:
      sweep = sweep_config.get_config(
          "chosen=" + "+".join(f"{row}@{scale:g}" for row, scale in picked.items())
          + ",seeded=" + "+".join(seeded_rows(picked)))
      sweep.overrides = {"data": {"cache_dir": os.path.abspath(os.path.join(workdir,
                                                                            "tokenizers"))}}
      common.run_sweep_config(sweep, workdir, jobs=options.jobs)
  return report(workdir)


def horizon_rows(workdir: str) -> list[dict]:
  """One row per (row, length) with a finished run, at 1x (F6-LM's and T1-LM's runs, for the rows
  that also ran longer) and each longer length; retention against that length's dense and solo."""
  names = sorted(os.listdir(workdir)) if os.path.isdir(workdir) else []
  longer = {}  # length -> {row: the scales it ran at}
  for name in names:
    stem, _, rest = name.rpartition("_lr")
    if "_len" not in stem or not rest.endswith("_s0"):
      continue
    row, length = sweep_config.parse_label(stem)
    scale = float(rest[:-len("_s0")])
    if t1_lm.label_runs(workdir, stem, scale, 1):
      longer.setdefault(length, {}).setdefault(row, []).append(scale)
  rows_seen = sorted({row for by_row in longer.values() for row in by_row})
  reported = {row: t1_lm.reported_scale(workdir, row)[0] for row in rows_seen}
  out = []
  for length in (1, *sorted(longer)):
    # A longer run at the row's 1,000-step choice where one finished (the tuning may have moved
    # since others ran), else its smallest scale run.
    by_row = (reported if length == 1 else
              {row: reported[row] if reported[row] in scales else min(scales)
               for row, scales in longer[length].items()})
    for row, scale in by_row.items():
      if scale is None:
        continue
      name = row if length == 1 else sweep_config.label(row, length)
      runs = t1_lm.label_runs(workdir, name, scale, 3)
      if not runs:
        continue
      loss = [r.results["test_loss"] for r in runs]
      ratio = runs[0].results.get("compression_ratio")  # None: solo sends nothing
      devices = sorted({kind for r in runs for kind in
                        r.results.get(provenance.KEY, {}).get("device_kinds", ["-"])})
      out.append({"row": row, "steps": STEPS * length, "length": length, "lr_scale": scale,
                  "n": len(runs), "losses": loss,
                  "val_loss": report_lib.format_mean_std(loss, 1, 3),
                  "ratio": None if ratio is None else float(ratio),
                  "device": ", ".join(devices),
                  "run_dirs": " ".join(report_lib.relative(r.path) for r in runs),
                  "data": t1_lm.data_of(runs), **t1_lm.scale_fields(runs[0])})
  for length in {r["length"] for r in out}:
    refs = {r["row"]: r for r in out if r["length"] == length and r["row"] in
            f6_config.REFERENCES}
    if len(refs) < 2:
      continue
    for r in out:
      if r["length"] == length:
        r.update(t1_lm.retention_against(r["losses"], r["data"], refs["solo"], refs["dense"]))
  return sorted(out, key=lambda r: (r["row"], r["steps"]))


def plot_horizon(rows: list[dict]):
  """Retention against run length (log x), one line per row of 30x or more."""
  def plot(fig):
    ax = fig.add_axes([0.08, 0.12, 0.6, 0.8])
    lines = {}
    for r in rows:
      if r.get("retention") is not None and r["row"] not in f6_config.REFERENCES:
        lines.setdefault(r["row"], []).append(r)
    for row, members in sorted(lines.items()):
      members.sort(key=lambda r: r["steps"])
      err = [0 if math.isnan(r["retention_ci95"]) else r["retention_ci95"] for r in members]
      ax.errorbar([r["steps"] for r in members], [r["retention"] for r in members], yerr=err,
                  marker="o", capsize=3, label=f"{row} ({members[0]['ratio']:.3g}x)")
    ax.axhline(1.0, color="black", lw=0.8)
    ax.axhline(0.0, color="grey", lw=0.8)
    ax.set_xscale("log")
    plots.decorate(ax, xlabel="steps (64 sequences of 64 tokens each), log scale",
                   ylabel="retention: (L_solo - L) / (L_solo - L_dense)",
                   title="F7-LM (CPU tier's model): retention against run length",
                   title_size=11)
    plots.legend_beside(ax)
  return plot


COLUMNS = [("row", "row"), ("steps", "steps"), ("ratio", "x fewer total bytes (HLO)"),
           ("retention", "retention"), ("retention_ci95", "retention 95% CI ±"), ("n", "n"),
           ("tokens_per_param", "tokens/parameter"), ("per_worker_tokens", "tokens/worker/step"),
           ("val_loss", "val loss nats/token (mean ± std)"), ("lr_scale", "lr scale"),
           ("device", "device"), ("run_dirs", "run directories")]


def report(workdir: str) -> Report:
  rows = horizon_rows(workdir)
  lengths = sorted({r["steps"] for r in rows})
  return Report(
      name="f7_lm", title=TITLE, columns=COLUMNS, rows=rows,
      configs=["configs/paper/f7_lm.py", "configs/paper/f6_lm.py", "configs/paper/lm.py"],
      notes=[f"Lengths run: {', '.join(f'{s:,}' for s in lengths) or 'none yet'} steps. "
             "Each length has its own dense and solo, the schedule (10% warm-up, cosine decay) "
             "stretched with it; retention at a length is against that length's references.",
             "Rates: each row keeps the rate scale its 1,000-step tuning chose (no retuning at "
             "the longer lengths: a run of 16,000 steps takes one to two hours of a CPU core); "
             "a longer run might prefer another rate, which this page does not test.",
             "Rows: dense, solo, every family's point of F6-LM at 100x, and the two with the "
             "lowest training loss at 30x (picked on training loss, never validation). Seeds: "
             "3 for dense, solo and the 100x rows at 4,000 steps, 1 elsewhere.",
             *t1_lm.provenance_notes(workdir, "cpu")],
      plot=plot_horizon(rows))
