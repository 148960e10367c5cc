"""F6-LM, the frontier: the share of communication's benefit each family keeps, from 2x to 1000x
fewer total bytes, on the language model's CPU tier.

The runs are ``configs/paper/f6_lm.py``'s, in T1-LM's folder (a point at a T1-LM tier is T1-LM's
row of that label). Each point's retention, ``(L_solo - L_row) / (L_solo - L_dense)`` with its 95%
interval over seeds (:mod:`experiments.reproduce.stats`), is plotted against its ratio (dense's
total bytes over the point's, from the compiled step kinds). For each family the page gives the
largest ratio at which it keeps at least 90% of the benefit, interpolated in log ratio between
the points that bracket it, with an interval from the points' interval ends; those points run
three seeds (:func:`deciding_points`), the others one. Every point's rate is tuned as T1-LM's rows
are, on training loss; validation losses are reported, never used to choose.
"""

import math
import os

from configs.paper import f6_lm as sweep_config
from configs.paper import t1_lm as t1_config
from experiments.reproduce import common
from experiments.reproduce import plots
from experiments.reproduce import report as report_lib
from experiments.reproduce import stats
from experiments.reproduce import t1_lm
from experiments.reproduce.report import Claim
from experiments.reproduce.report import Report

TITLE = "F6-LM: the frontier, retention of communication's benefit from 2x to 1000x fewer bytes"
LEVEL = 0.9  # the retention whose crossing each family's row reports
GOAL = (0.95, 100.0)  # the project's goal: this retention at this ratio or more
ON_RATIO = 0.1  # a point counts where its measured ratio is within 10% of the one asked
run_folders = t1_lm.run_folders  # F6-LM's runs are in T1-LM's folder


def _tier_of(label: str) -> str | None:
  ratio = sweep_config.ratio_of(label)
  return None if ratio is None else f"{ratio:g}x"


def point_rows(workdir: str, seeds: int = 3) -> list[dict]:
  """One row per point and reference with runs (see the module docstring): T1-LM's columns and
  ``family``, ``row``, ``asked`` (the ratio asked for), ``ratio`` (measured), ``on_ratio``,
  ``retention``, ``retention_ci95`` and ``n`` (seeds)."""
  labels = [label for label in sweep_config.rows()
            if label in sweep_config.REFERENCES or t1_lm.tuning(workdir, label)]
  rows = t1_lm.rows_for(workdir, labels, seeds, "cpu", family=sweep_config.family_of,
                        tier_of=_tier_of)
  for row in rows:
    asked = sweep_config.ratio_of(row["method"])
    row.update(row=row["method"], asked=asked, n=row["seeds"],
               ratio=row.get("compression_ratio"))
    if row["row"] in sweep_config.FIXED_POINTS:  # its method's bytes are its ratio
      row["on_ratio"] = row["ratio"] is not None
    else:
      row["on_ratio"] = (None if asked is None or row["ratio"] is None
                         else abs(row["ratio"] / asked - 1) <= ON_RATIO)
  return rows


def family_points(rows: list[dict]) -> dict[str, list[tuple[float, stats.Retention]]]:
  """Family -> its points on their ratio (``(ratio, retention)``), ratio ascending."""
  out = {}
  for row in rows:
    if row["family"] in sweep_config.REFERENCES or row.get("retention") is None:
      continue
    if not row["on_ratio"]:
      continue
    kept = stats.Retention(row["retention"], row["retention_ci95"], row["n"])
    out.setdefault(row["family"], []).append((row["ratio"], kept))
  return {f: sorted(p, key=lambda x: x[0]) for f, p in out.items()}


def deciding_points(rows: list[dict]) -> list[str]:
  """The points whose seeds decide a family's crossing of :data:`LEVEL`: the last at or above it
  and the next (the family's first point where none reaches it, its last where all do)."""
  out = []
  by_family = {}
  for row in rows:
    if row["family"] not in sweep_config.REFERENCES and row.get("retention") is not None:
      by_family.setdefault(row["family"], []).append(row)
  for members in by_family.values():
    members.sort(key=lambda r: r["ratio"] if r["asked"] is None else r["asked"])
    above = [i for i, r in enumerate(members) if r["retention"] >= LEVEL]
    if not above:
      chosen = [0]
    else:
      chosen = [above[-1]] + ([above[-1] + 1] if above[-1] + 1 < len(members) else [])
    out += [members[i]["row"] for i in chosen]
  return out


def produce(options: common.Options) -> Report:
  """Runs F6-LM's grid (unless ``report_only``): every point and dense and solo over the tuning
  budget (its grid, then its scales past the grid's winning end), then dense's, solo's and the
  deciding points' other seeds at their chosen scales."""
  workdir = t1_lm.runs_dir(options)
  if not options.report_only:
    tokenizers = {"data": {"cache_dir": os.path.abspath(os.path.join(workdir, "tokenizers"))}}

    def run(arg: str) -> None:
      sweep = sweep_config.get_config(arg)
      sweep.overrides = tokenizers
      common.run_sweep_config(sweep, workdir, jobs=options.jobs)

    run(f"seeds={options.seeds}")
    t1_lm.extend_tuning(workdir, sweep_config.rows(),
                        lambda chosen: run(f"seeds=1,tuning=0,chosen={chosen}"))
    labels = list(sweep_config.REFERENCES) + deciding_points(point_rows(workdir))
    chosen = {label: t1_lm.chosen_scale(workdir, label) for label in labels}
    chosen = "+".join(f"{label}@{scale:g}" for label, scale in chosen.items()
                      if scale is not None)
    if chosen:
      run(f"seeds={options.seeds},tuning=0,chosen={chosen}")
  return report(workdir, seeds=options.seeds)


def crossing_rows(rows: list[dict]) -> list[dict]:
  """Per family: its ratios run, and the largest ratio keeping :data:`LEVEL` (with interval)."""
  out = []
  for family, points in family_points(rows).items():
    cross = stats.crossing(points, LEVEL)
    out.append({"family": family, "description": sweep_config.DESCRIPTIONS.get(family, ""),
                "ratios": ", ".join(f"{r:.3g}" for r, _ in points),
                "crossing": crossing_text(cross, points[0][0]),
                "crossing_ratio": cross.ratio, "crossing_low": cross.low,
                "crossing_high": cross.high})
  return out


def crossing_text(cross: stats.Crossing, smallest: float) -> str:
  """``~12x (8x-20x)``, ``below 2x``, or ``≥ 1000x (the largest run)``."""
  if cross.ratio is None:
    return f"below {smallest:.3g}x (no point keeps {LEVEL:.0%})"
  if isinstance(cross.ratio, float) and math.isnan(cross.ratio):
    return "-"
  if cross.beyond_range:
    return f"≥ {cross.ratio:.3g}x (its largest ratio run)"

  def end(value):
    if value is None:
      return f"<{smallest:.3g}x"
    return "?" if math.isnan(value) else f"{value:.3g}x"
  spread = ("" if cross.low is not None and isinstance(cross.low, float)
            and math.isnan(cross.low) else f" ({end(cross.low)} to {end(cross.high)}, 95%)")
  return f"{cross.ratio:.3g}x{spread}"


def claims(rows: list[dict]) -> list[Claim]:
  """The project's goal, judged by retention: the best retention at the goal's ratio or more."""
  level, ratio = GOAL
  pool = [r for r in rows if r.get("retention") is not None and r.get("on_ratio")
          and (r["ratio"] if r["asked"] is None else r["asked"]) >= ratio]
  claim = (f"A method keeps ≥ {level:.0%} of communication's benefit at ≥ {ratio:g}x fewer "
           "total bytes")
  if not pool:
    return [Claim(claim, "project goal", f"no point at ≥ {ratio:g}x has finished yet", None,
                  "nothing to judge")]
  best = max(pool, key=lambda r: r["retention"])
  spread = best["retention_ci95"]
  met = None if math.isnan(spread) else best["retention"] - spread >= level
  return [Claim(
      claim, "project goal",
      f"best retention at ≥ {ratio:g}x: {best['row']} {best['retention_text']} at "
      f"{best['ratio']:.3g}x (val loss {best['val_loss']})",
      met, "met when the interval's lower end reaches the goal" if met is not None else
      "one seed: no interval")]


def plot_frontier(rows: list[dict], crossings: list[dict]):
  """Retention against ratio (log x), one line per family, 95% intervals as bars."""
  def plot(fig):
    ax = fig.add_axes([0.08, 0.12, 0.6, 0.8])
    for family, points in sorted(family_points(rows).items()):
      x = [p[0] for p in points]
      y = [p[1].value for p in points]
      err = [0 if math.isnan(p[1].half_width) else p[1].half_width for p in points]
      ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=family)
    for level, text, style in ((1.0, "dense", "-"), (LEVEL, f"{LEVEL:.0%} of the benefit", "--"),
                               (0.0, "solo: no communication", "-")):
      ax.axhline(level, color="grey", lw=0.8, ls=style)
      ax.text(0.01, level, text, transform=ax.get_yaxis_transform(), va="bottom", fontsize=8,
              color="dimgrey")
    ax.set_xscale("log")
    ticks = sorted({r for _, (_, ratios) in sweep_config.CURVES.items() for r in ratios})
    ax.set_xticks(ticks, [f"{r:g}x" for r in ticks])
    ax.minorticks_off()
    plots.decorate(ax, xlabel="x fewer total bytes than dense (compiled HLO), log scale",
                   ylabel="retention: (L_solo - L) / (L_solo - L_dense)",
                   title="F6-LM (CPU tier): retention against compression", title_size=11)
    plots.legend_beside(ax)
  return plot


COLUMNS = [("family", "family"), ("row", "row"), ("asked", "ratio asked"),
           ("ratio", "x fewer total bytes (HLO)"), ("retention", "retention"),
           ("retention_ci95", "retention 95% CI ±"), ("n", "n"),
           ("tokens_per_param", "tokens/parameter"), ("per_worker_tokens", "tokens/worker/step"),
           ("val_loss", "val loss nats/token (mean ± std)"), ("tuning", "train loss by lr scale"),
           ("settings", "settings"), ("status", "status")]


def tuning_notes(workdir: str, rows: list[dict]) -> list[str]:
  """What the tuning budget could not decide: points whose rate scales tie on the training
  criterion (a round as long as the run synchronises after every logged training loss, so the
  criterion cannot see the outer rate: the first scale is kept), and points whose chosen scale
  is an end of the ladder the tuning may extend to (the best rate may lie beyond it)."""
  ties, edges = [], []
  ladder = t1_config.LR_LADDER
  for row in rows:
    tried = t1_lm.tuning(workdir, row["row"])
    if row["lr_scale"] is None or row["family"] in sweep_config.REFERENCES:
      continue
    if len({round(v, 6) for v in tried.values()}) == 1:
      ties.append(row["row"])
    elif row["lr_scale"] in (min(ladder), max(ladder)):
      edges.append(f"{row['row']} ({row['lr_scale']:g})")
  notes = []
  if ties:
    notes.append("Tuning blind: " + ", ".join(ties) + " tie on the training criterion over "
                 "every rate scale (the run synchronises once, after its last logged training "
                 "loss), so the first scale is kept: their outer rate is untuned.")
  if edges:
    notes.append(f"Chosen at an end of the rate ladder ({min(ladder):g}-{max(ladder):g}): "
                 + ", ".join(edges) + "; a rate beyond it may do better.")
  return notes


def report(workdir: str, *, seeds: int = 3) -> Report:
  """F6-LM's table, crossings, claim and figure from the run directories."""
  rows = point_rows(workdir, seeds)
  crossings = crossing_rows(rows)
  missing = [f for f in (*sweep_config.CURVES, *sweep_config.FIXED_POINTS)
             if f not in {c["family"] for c in crossings}]
  return Report(
      name="f6_lm", title=TITLE, columns=COLUMNS, rows=rows, claims=claims(rows),
      sections=[("Where each family stops paying",
                 f"The largest ratio at which a family keeps ≥ {LEVEL:.0%} of communication's "
                 "benefit, interpolated in log ratio between the points that bracket it; the "
                 "interval is the same crossing of the points' 95% interval ends (`?` where a "
                 "bracketing point has one seed).\n\n" + report_lib.markdown_table(
                     [("family", "family"), ("description", "what it is"),
                      ("ratios", "ratios run (measured)"), ("crossing", f"keeps ≥ {LEVEL:.0%} "
                                                                        "up to")], crossings)
                 + ("\n\nNo point has finished yet for: " + ", ".join(missing) + "."
                    if missing else ""))],
      configs=["configs/paper/f6_lm.py", "configs/paper/lm.py", "configs/lm_stdlib.py"],
      notes=[t1_lm.recipe_note("cpu"),
             "Solo: one worker alone, its share of each step's batch (8 of the 64 sequences), "
             "the same steps, recipe and tuning budget: the loss without communication. "
             "Retention 1 is dense's loss, 0 solo's; below 0 a method did worse than not "
             "communicating at all.",
             "Retention's interval: the delta method over the three means (row, solo, dense), "
             "Student's t with Welch-Satterthwaite degrees of freedom; none where the row has "
             "one seed. Points run one seed but those deciding a crossing, which run three "
             "(with dense and solo).",
             f"A point counts where its measured ratio is within {ON_RATIO:.0%} of the one "
             "asked; families run only at ratios their method can meet "
             "(configs/paper/f6_lm.py).",
             *tuning_notes(workdir, rows), *t1_lm.provenance_notes(workdir, "cpu")],
      plot=plot_frontier(rows, crossings))
