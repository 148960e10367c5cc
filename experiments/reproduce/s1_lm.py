"""S1-LM, the scaling grid: how much of communication's benefit each family keeps at 100x fewer
total bytes as the model, the token budget and the per-worker batch grow, and the laws fitted to
it (:mod:`experiments.scaling`).

The runs are ``configs/paper/s1_lm.py``'s (runs of ``configs/paper/lm.py``) in
``<workdir>/s1_lm_<tier>``. Each row of the page is one point's row: its retention against that
point's own dense and solo (:mod:`experiments.reproduce.stats`), its tokens a parameter, its
per-worker batch and its outer steps (the synchronisations its run completed: the steps over the
run's ``H``; every step for a per-step method; none for solo). The fits (``s1_lm_fits.csv``
beside the page, a row per family) are on the 20-tokens points, one per size:

- the retention law ``retention = 1 - A N^alpha`` (:class:`experiments.scaling.RetentionLaw`)
  over each seed's retention (the seed's loss against the point's mean dense and solo losses),
  with the bootstrap's intervals over seeds, its leave-the-largest-out residual, and the size
  where it reaches 95% (:func:`experiments.scaling.crossing`: "not within 10x of the fitted
  range" beyond 10 times the largest size run), with its tokens (20 a parameter);
- the loss law ``L = A N^alpha`` of the family (dense's and solo's too), which
  ``python -m experiments.plan`` reads, with the retention laws' bootstrap draws written beside
  the fits (``s1_lm_fits_draws.csv``), whose predictions' percentiles are its intervals.
"""

import csv
import functools
import os
from typing import NamedTuple

import ml_collections
import numpy as np

from compressors import registry
from configs.paper import lm
from configs.paper import s1_lm as sweep_config
from experiments import methods
from experiments import scaling
from experiments.reproduce import common
from experiments.reproduce import report as report_lib
from experiments.reproduce import t1_lm
from experiments.reproduce.report import Report

TITLE = "S1-LM: the scaling grid, retention at 100x fewer bytes against model size"
FITS = "s1_lm_fits"
LEVEL = 0.95  # the retention whose crossing the fits predict
FITS_COLUMNS = (
    "family", "description", "sizes", "ratio", "A", "A_low", "A_high", "alpha", "alpha_low",
    "alpha_high", "holdout_residual", "crossing_params", "crossing_low", "crossing_high",
    "crossing_tokens", "crossing", "loss_A", "loss_A_low", "loss_A_high", "loss_alpha",
    "loss_alpha_low", "loss_alpha_high", "loss_holdout_residual", "note", "grid")
# Beside the fits CSV (scaling.draws_path), each retention law's bootstrap draws: the plan's
# intervals at any size are their percentiles (experiments.plan).
DRAWS_COLUMNS = ("family", "A", "alpha")


def runs_dir(options: common.Options) -> str:
  return os.path.join(options.workdir, f"s1_lm_{options.tier}")


def run_folders(options: common.Options) -> list[str]:
  return [runs_dir(options)]


def tuned_labels(tier: str) -> list[str]:
  """The labels whose rates the tables' rule tunes: every size's but the largest's."""
  return [label for label in sweep_config.rows(tier)
          if sweep_config.split_label(label)[0].size != sweep_config.largest(tier)]


def produce(options: common.Options) -> Report:
  """Runs the grid (unless ``report_only``): the tuning phase, its scales past the grid, the
  smallest sizes' other seeds, then the largest size at the rate law's scales; writes the fits
  CSV beside the page and returns the page."""
  workdir = runs_dir(options)
  if not options.report_only:
    run_grid(workdir, options)
  return report(workdir, tier=options.tier, seeds=options.seeds,
                fits_path=os.path.join(options.out, common.page_name(FITS, options.tier) + ".csv"))


def run_grid(workdir: str, options: common.Options) -> None:
  tier = options.tier
  tokenizers = {"data": {"cache_dir": os.path.abspath(os.path.join(workdir, "tokenizers"))}}

  def run(arg: str, chosen: dict[str, float] | None = None) -> None:
    if chosen is not None:
      if not chosen:
        return
      arg += ",tuning=0,chosen=" + "+".join(f"{k}@{v:g}" for k, v in chosen.items())
    sweep = sweep_config.get_config(f"tier={tier},{arg}")
    sweep.overrides = tokenizers
    common.run_sweep_config(sweep, workdir, jobs=options.jobs)

  run("seeds=1")
  tuned = tuned_labels(tier)
  t1_lm.extend_tuning(workdir, tuned, lambda chosen: run(f"seeds=1,tuning=0,chosen={chosen}"))
  seeded = {label: t1_lm.chosen_scale(workdir, label) for label in tuned
            if sweep_config.seeds_of(tier, sweep_config.split_label(label)[0]) > 1}
  run(f"seeds={options.seeds}", {k: v for k, v in seeded.items() if v is not None})
  run("seeds=1", {label: law.scale for label, law in rate_laws(workdir, tier).items()})


class RateLaw(NamedTuple):
  """A row's rate law at the largest size: ``law`` (a :class:`experiments.scaling.PowerLaw` of
  the tuned rate scale against size), ``sizes`` fitted on, and ``scale`` (its prediction, 3
  significant digits)."""
  law: scaling.PowerLaw
  sizes: int
  scale: float


def rate_laws(workdir: str, tier: str) -> dict[str, RateLaw]:
  """The largest size's label -> its row's :class:`RateLaw`, for rows whose 20-tokens points
  have chosen a scale at 2 sizes or more."""
  base = [p for p in sweep_config.points(tier)
          if p.tokens_per_param == sweep_config.TOKENS_PER_PARAM
          and p.per_worker_batch == sweep_config.PER_WORKER_BATCH]
  top = base[-1]
  out = {}
  for row in sweep_config.ROWS:
    found = [(sweep_config.SIZES[tier][p.size].params,
              t1_lm.chosen_scale(workdir, sweep_config.label(p, row))) for p in base[:-1]]
    found = [(n, s) for n, s in found if s is not None]
    if len(found) < 2:
      continue
    law = scaling.fit_learning_rate(scaling.make_runs(*zip(*found), what="learning rate"))
    predicted = float(law.predict(sweep_config.SIZES[tier][top.size].params))
    out[sweep_config.label(top, row)] = RateLaw(law=law, sizes=len(found),
                                                scale=float(f"{predicted:.3g}"))
  return out


def largest_scale(workdir: str, label: str, laws: dict[str, RateLaw]) -> float | None:
  """The rate scale the largest size's row was run at: the rate law's where its run exists, else
  the first scale with a finished run (an older law's)."""
  law = laws.get(label)
  if law is not None and t1_lm.label_runs(workdir, label, law.scale, 1):
    return law.scale
  prefix = label + "_lr"
  names = sorted(os.listdir(workdir)) if os.path.isdir(workdir) else []
  for name in names:
    if name.startswith(prefix) and name.endswith("_s0"):
      scale = float(name[len(prefix):-len("_s0")])
      if t1_lm.label_runs(workdir, label, scale, 1):
        return scale
  return None


def outer_steps(config: dict, steps: int) -> int:
  """The synchronisations a run of ``steps`` steps completed: none alone, every step for a
  per-step method, the steps over ``H`` for a local-update one (Streaming DiLoCo: its rounds,
  each fragment sending once a round)."""
  if config.get("num_devices") == 1:
    return 0
  config = ml_collections.ConfigDict(config)
  return steps // registry.steps_per_exchange(config.method, methods.settings(config))


@functools.cache
def planned_outer_steps(tier: str, label: str) -> int:
  """The outer steps a label's run will complete, from its config solved as the runner solves
  it (for the rows that have not run)."""
  args = {**sweep_config.rows(tier)[label], "workers": sweep_config.WORKERS}
  config = lm.get_config(",".join(f"{k}={v}" for k, v in args.items()))
  methods.fill_equal_bytes(config)
  return outer_steps(config.to_dict(), config.num_steps)


def point_row(workdir: str, label: str, tier: str, seeds: int, laws) -> dict:
  """One label's row: its point, rate and how it was chosen, and its runs' losses."""
  point, row = sweep_config.split_label(label)
  on_top = point.size == sweep_config.largest(tier)
  scale, pending = ((largest_scale(workdir, label, laws), None) if on_top
                    else t1_lm.reported_scale(workdir, label))
  runs = t1_lm.label_runs(workdir, label, scale, seeds) if scale is not None else []
  loss = [r.results["test_loss"] for r in runs]
  out = {"label": label, "point": point.name, "row": row, "size": point.size,
         "params": sweep_config.SIZES[tier][point.size].params,
         "tokens_per_param": point.tokens_per_param, "per_worker_batch": point.per_worker_batch,
         "steps": sweep_config.steps(tier, point), "lr_scale": scale,
         "rate": ("rate law" if on_top else "tuned" if pending is None
                  else f"tuned so far ({pending:g} to run)"),
         "pending_scale": pending, "n": len(runs), "losses": loss,
         "seeds": [r.config.get("seed") for r in runs], "data": t1_lm.data_of(runs),
         "val_loss": report_lib.format_mean_std(loss, 1, 3),
         "loss_mean": float(np.mean(loss)) if runs else None}
  if not runs:
    out["outer_steps"] = planned_outer_steps(tier, label)
  else:
    ratios = [r.results.get("compression_ratio") for r in runs]
    out.update(outer_steps=outer_steps(runs[0].config, runs[0].results["step"]),
               ratio=None if None in ratios else float(np.mean(ratios)),
               settings=t1_lm.settings_text(runs[0].config),
               run_dirs=" ".join(report_lib.relative(r.path) for r in runs))
  return out


def point_rows(workdir: str, tier: str, seeds: int = 3) -> list[dict]:
  """Every label's row, with its retention against its point's dense and solo."""
  laws = rate_laws(workdir, tier)
  rows = [point_row(workdir, label, tier, seeds, laws) for label in sweep_config.rows(tier)]
  by_point = {}
  for r in rows:
    by_point.setdefault(r["point"], {})[r["row"]] = r
  for r in rows:
    refs = by_point[r["point"]]
    if r["n"] and all(refs[name]["n"] for name in sweep_config.REFERENCES):
      r.update(t1_lm.retention_against(r["losses"], r["data"], refs["solo"], refs["dense"]))
  return rows


def _seed_retentions(rows: list[dict], family: str) -> scaling.Runs | None:
  """Each seed's retention at the family's 20-tokens points (against the point's mean dense
  and solo losses), as :class:`experiments.scaling.Runs`, at the points whose row has a
  retention (:func:`point_rows`: its references finished, on its data); None without 2 sizes."""
  params, values, seeds = [], [], []
  base = {(r["point"], r["row"]): r for r in rows
          if r["tokens_per_param"] == sweep_config.TOKENS_PER_PARAM
          and r["per_worker_batch"] == sweep_config.PER_WORKER_BATCH}
  for (point, row), r in base.items():
    if row != family or r.get("retention") is None:
      continue
    dense, solo = base[(point, "dense")], base[(point, "solo")]
    benefit = np.mean(solo["losses"]) - np.mean(dense["losses"])
    for seed, loss in zip(r["seeds"], r["losses"]):
      params.append(r["params"])
      values.append((np.mean(solo["losses"]) - loss) / benefit)
      seeds.append(seed)
  if len(set(params)) < 2:
    return None
  return scaling.make_runs(params, values, seed=seeds, what="retention")


def _loss_runs(rows: list[dict], family: str) -> scaling.Runs | None:
  chosen = [r for r in rows if r["row"] == family and r["n"]
            and r["tokens_per_param"] == sweep_config.TOKENS_PER_PARAM
            and r["per_worker_batch"] == sweep_config.PER_WORKER_BATCH]
  if len({r["params"] for r in chosen}) < 2:
    return None
  return scaling.make_runs([r["params"] for r in chosen for _ in r["losses"]],
                           [loss for r in chosen for loss in r["losses"]],
                           seed=[s for r in chosen for s in r["seeds"]])


def _law_fields(fit: scaling.Fit, prefix: str = "") -> dict:
  out = {}
  for name in ("A", "alpha"):
    out[prefix + name] = getattr(fit.law, name)
    interval = fit.interval(name)
    out[prefix + name + "_low"], out[prefix + name + "_high"] = interval or (None, None)
  return out


def _holdout(fit, runs: scaling.Runs) -> float | None:
  try:
    return scaling.leave_largest_out(fit, runs)[0].residual
  except ValueError:  # fewer than 3 sizes
    return None


def fit_row(rows: list[dict], family: str) -> dict:
  """The fits CSV's row of one family (see the module docstring); ``note`` says what could not
  be fitted and why."""
  out = {"family": family, "description": sweep_config.DESCRIPTIONS.get(family, family)}
  notes = []
  losses = _loss_runs(rows, family)
  if losses is None:
    notes.append("loss law: fewer than 2 sizes have finished")
  else:
    out.update(_law_fields(scaling.bootstrap(scaling.fit_power_law, losses), "loss_"))
    out["loss_holdout_residual"] = _holdout(scaling.fit_power_law, losses)
    out["sizes"] = " ".join(f"{n:g}" for n in losses.sizes())
  if family in sweep_config.REFERENCES:
    out["note"] = "; ".join(notes)
    return out
  ratios = [r["ratio"] for r in rows if r["row"] == family and r.get("ratio")]
  out["ratio"] = min(ratios) if ratios else None
  kept = _seed_retentions(rows, family)
  if kept is None:
    notes.append("retention law: fewer than 2 sizes have finished")
  else:
    fit = scaling.bootstrap(scaling.fit_retention, kept)
    out.update(_law_fields(fit))
    out["draws"] = fit.draws
    out["holdout_residual"] = _holdout(scaling.fit_retention, kept)
    out.update(_crossing_fields(scaling.crossing(fit, LEVEL)))
  if out.get("ratio") and out["ratio"] < sweep_config.RATIO * 0.9:
    notes.append(f"its bytes are fixed at {out['ratio']:.3g}x: its crossing is not one at "
                 f"{sweep_config.RATIO:g}x")
  out["note"] = "; ".join(notes)
  return out


def _crossing_fields(cross: scaling.Crossing) -> dict:
  low, high = cross.interval or (None, None)
  text = cross.reason or f"{cross.params:.3g} parameters, {20 * cross.params:.3g} tokens"
  if cross.interval and not cross.reason:
    text += f" (95%: {low:.3g} to {high:.3g} parameters)"
  return {"crossing_params": cross.params, "crossing_low": low, "crossing_high": high,
          "crossing_tokens": (sweep_config.TOKENS_PER_PARAM * cross.params
                              if cross.params is not None else None), "crossing": text}


def fit_rows(rows: list[dict]) -> list[dict]:
  return [fit_row(rows, family) for family in sweep_config.ROWS]


def write_fits(fits: list[dict], path: str) -> None:
  """The fits CSV at ``path`` and the retention laws' draws beside it
  (:func:`experiments.scaling.draws_path`)."""
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  with open(path, "w", newline="", encoding="utf-8") as f:
    writer = csv.DictWriter(f, fieldnames=FITS_COLUMNS, lineterminator="\n")
    writer.writeheader()
    for fit in fits:
      writer.writerow({k: "" if fit.get(k) is None else fit[k] for k in FITS_COLUMNS})
  with open(scaling.draws_path(path), "w", newline="", encoding="utf-8") as f:
    writer = csv.writer(f, lineterminator="\n")
    writer.writerow(DRAWS_COLUMNS)
    for fit in fits:
      for a, alpha in (fit.get("draws") if fit.get("draws") is not None else ()):
        writer.writerow((fit["family"], f"{a:.6g}", f"{alpha:.6g}"))


COLUMNS = [("point", "point"), ("row", "row"), ("params", "parameters"),
           ("tokens_per_param", "tokens/parameter"), ("per_worker_batch", "per-worker batch (seq)"),
           ("steps", "steps"), ("outer_steps", "outer steps"), ("ratio", "x fewer total bytes"),
           ("retention_text", "retention (95% CI)"), ("val_loss", "val loss (mean ± std)"),
           ("lr_scale", "lr scale"), ("rate", "rate from"), ("settings", "settings"),
           ("run_dirs", "run directories")]


def budget_section(tier: str, workdir: str) -> tuple[str, str]:
  """The estimated budget per point beside what its runs so far measured (their training loops'
  seconds, :meth:`experiments.reproduce.report.Run.training_seconds`)."""
  rows = sweep_config.budget(tier)
  runs = [report_lib.read_run(os.path.join(workdir, name))
          for name in (sorted(os.listdir(workdir)) if os.path.isdir(workdir) else [])]
  runs = [run for run in runs if run is not None]
  for r in rows:
    r["hours"] = r["seconds"] / 3600
    own = [run for run in runs if os.path.basename(run.path).startswith(r["point"] + "_")]
    r["finished"] = sum(run.finished for run in own)
    r["measured"] = sum(run.training_seconds() for run in own) / 3600
  total = sum(r["seconds"] for r in rows)
  measured = sum(r["measured"] for r in rows)
  return ("Budget", (
      f"Estimated {total / 3600:.1f} hours of runs, {total / 7200:.1f} hours on 2 cores at "
      "two runs at once (configs/paper/s1_lm.py's step-time model, from the measured step "
      "times of the CPU tier's runs; a tuned point's rows at 4 rate scales and its other "
      f"seeds, the largest size's once). Measured so far: {measured:.1f} hours of the runs in "
      "its folder, at two at once, in their training loops (from the throughput each logged; "
      "the set-up, the final evaluation, the steps a stop lost and runs removed to run again "
      "are not counted), the unfinished runs' steps included.\n\n" + report_lib.markdown_table(
          [("point", "point"), ("params", "parameters"), ("steps", "steps"), ("runs", "runs"),
           ("hours", "hours estimated"), ("finished", "runs finished"),
           ("measured", "hours measured")], rows)))


def fits_section(fits: list[dict]) -> tuple[str, str]:
  return ("Fitted laws (20 tokens a parameter)", (
      "Retention = 1 - A N^alpha by least squares on the retention, L = A N^alpha by least "
      "squares in log space; intervals "
      "from the bootstrap over seeds (none where a size has one seed); the residual predicts "
      f"the largest size from the others; the crossing is where retention reaches {LEVEL:.0%} "
      "(also in the fits CSV beside this page).\n\n" + report_lib.markdown_table(
          [("family", "family"), ("sizes", "sizes"), ("A", "A"), ("alpha", "alpha"),
           ("holdout_residual", "held-out residual"), ("crossing", f"keeps {LEVEL:.0%} at"),
           ("loss_A", "loss A"), ("loss_alpha", "loss alpha"), ("note", "note")], fits)))


def progress(rows: list[dict], tier: str, seeds: int) -> tuple[int, int, int]:
  """What the grid has still to run: ``(rows with no finished run, rows whose tuning goes on
  past the grid's scales, rows short of their seeds)``; all 0 once it has finished."""
  missing = sum(1 for r in rows if not r["n"])
  tuning = sum(1 for r in rows if r["pending_scale"] is not None)
  short = sum(1 for r in rows if r["n"] and r["n"] < min(
      seeds, sweep_config.seeds_of(tier, sweep_config.split_label(r["label"])[0])))
  return missing, tuning, short


def grid_status(rows: list[dict], tier: str, seeds: int, family: str | None = None) -> str:
  """The fits CSV's ``grid`` column: ``complete``, or what is still to run (the fits are then
  provisional, which ``experiments.plan`` says); of ``family``'s rows and dense's and solo's
  (its retention's references) where given, else of every row."""
  if family is not None:
    rows = [r for r in rows if r["row"] in (family, *sweep_config.REFERENCES)]
  missing, tuning, short = progress(rows, tier, seeds)
  if not missing + tuning + short:
    return "complete"
  return (f"incomplete: of {len(rows)} rows, {missing} have no run, {tuning} are still tuning, "
          f"{short} lack seeds")


def progress_note(rows: list[dict], tier: str, seeds: int) -> list[str]:
  """A note saying what the grid has still to run, or none once it has finished: rows with no
  finished run, rows whose tuning goes on past the grid's scales, and rows short of their
  seeds; until then the rates, laws and fits are provisional."""
  missing, tuning, short = progress(rows, tier, seeds)
  if not missing + tuning + short:
    return []
  return [f"Incomplete: of {len(rows)} rows, {missing} have no finished run, {tuning} are still "
          f"tuning (rate 'tuned so far') and {short} lack seeds; the rates, rate laws and fits "
          "here are provisional until the grid has finished (`python -m experiments.reproduce "
          f"--target=s1_lm --tier={tier}` resumes it)."]


def report(workdir: str, *, tier: str, seeds: int = 3, fits_path: str | None = None) -> Report:
  """The page from the run directories; the fits CSV written to ``fits_path`` where given."""
  rows = point_rows(workdir, tier, seeds)
  fits = [dict(fit, grid=grid_status(rows, tier, seeds, fit["family"]))
          for fit in fit_rows(rows)]
  if fits_path is not None:
    write_fits(fits, fits_path)
  laws = rate_laws(workdir, tier)
  law_text = "; ".join(f"{label}: {law.scale:g} (lr = {law.law.A:.3g} N^{law.law.alpha:.3g}, "
                       f"{law.sizes} sizes)" for label, law in laws.items()) or "none yet"
  sizes = sweep_config.SIZES[tier]
  return Report(
      name=common.page_name("s1_lm", tier), title=f"{TITLE} ({tier} tier)", columns=COLUMNS,
      rows=rows, sections=[fits_section(fits), budget_section(tier, workdir)],
      configs=[f"configs/paper/s1_lm.py:tier={tier}", "configs/paper/lm.py"],
      notes=[
          *progress_note(rows, tier, seeds),
          "Sizes: " + ", ".join(f"{k} ({s.width} wide, {s.layers} layers, {s.heads} heads, "
                                f"{s.params:,} parameters)" for k, s in sizes.items())
          + "; the rule is configs/paper/s1_lm.py's (width doubling, depth with width).",
          "Points: 20 tokens a parameter at every size with 8 sequences a worker; 80 tokens a "
          "parameter with 8 and with 32 at the two smallest. Outer steps: the synchronisations "
          "a run completed (planned, from its solved config, where it has not run); below 100 "
          "where the budget does not allow more (its steps over H).",
          "Rates: tuned by the tables' rule at every size but the largest; at the largest, "
          f"each row's scale from a power law of the tuned scales against size: {law_text}.",
          f"Seeds: {sweep_config.SEEDS_AT_SMALLEST} at the two smallest sizes, 1 elsewhere. "
          "Retention is against the point's own dense and solo.",
          "Off the 100x tier by more than 10% (the solver's closest; their ratio column shows "
          "it): " + ", ".join(sweep_config.OFF_TIER) + ".",
          "The GPU tier (--tier=gpu) is declared: its grid, estimated "
          f"{sum(r['seconds'] for r in sweep_config.budget('gpu')) / 3600:.0f} hours of one "
          "GPU, runs where a GPU is lent for that long.",
          *t1_lm.provenance_notes(workdir, tier)])
