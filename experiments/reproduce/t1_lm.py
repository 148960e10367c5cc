"""T1-LM: validation loss at equal wire bytes, every method, a language model on real text.

The runs are ``configs/paper/t1_lm.py:subset=t1``'s (runs of ``configs/paper/lm.py``) in
``<workdir>/lm_<tier>``, the folder F4-LM and F5 read too; the tokenizer is trained once into its
``tokenizers`` folder. Each budgeted method's density, rank or block size is solved so that its
bytes per step land on the tier (:mod:`compressors.equal_bytes`); the table gives the bytes the
compiled step sent (``wire_bytes``, read from the HLO by the runner) and the solver's settings
at 8 and at 32 workers.
"""

import functools
import math
import os

import ml_collections
import numpy as np

from compressors import equal_bytes
from compressors import registry
from compressors.parallel import step_kinds
from configs.paper import lm
from configs.paper import t1_lm as sweep_config
from experiments import methods
from experiments import provenance
from experiments.reproduce import common
from experiments.reproduce import plots
from experiments.reproduce import report as report_lib
from experiments.reproduce import stats
from experiments.reproduce.report import Claim
from experiments.reproduce.report import Report

TITLE = "T1-LM: validation loss at equal wire bytes, language model on the stdlib's source"


def runs_dir(options: common.Options) -> str:
  """The folder of the tier's language-model runs (T1-LM's, F4-LM's and F5's)."""
  return os.path.join(options.workdir, f"lm_{options.tier}")


def run_folders(options: common.Options) -> list[str]:
  """The folders of the runs the table is built from (F4-LM's and F5's too)."""
  return [runs_dir(options)]


def run_subset(options: common.Options, subset: str) -> None:
  """Runs ``subset`` (``t1`` or ``f4``) of the tier's sweep, unless ``report_only``: for T1-LM
  the tuning phase (every row at the grid's rate scales, one seed) and its scales past the grid
  (:func:`extend_tuning`), then the headline rows' other seeds at their chosen scales
  (:func:`headline_choice`)."""
  if options.report_only:
    return
  workdir = runs_dir(options)

  def run(chosen: str, seeds: int = options.seeds) -> None:
    sweep = sweep_config.get_config(f"tier={options.tier},seeds={seeds},"
                                    f"subset={subset},chosen={chosen}")
    # One tokenizer for every run, trained by the first (see experiments/data/tokenizer.py).
    sweep.overrides = {"data": {"cache_dir": os.path.abspath(os.path.join(workdir,
                                                                          "tokenizers"))}}
    common.run_sweep_config(sweep, workdir, jobs=options.jobs)

  run("")
  if subset == "f4":
    return
  # The tuning's scales past the grid, then the headline rows' other seeds at their choice.
  extend_tuning(workdir, sweep_config.tuning_rows(options.tier),
                lambda chosen: run(chosen, seeds=1))
  run("+".join(f"{label}@{scale:g}"
               for label, scale in headline_choice(workdir, options.tier).items()))


def produce(options: common.Options) -> Report:
  """Runs T1-LM's sweep (unless ``report_only``); its table, claims and figure."""
  run_subset(options, "t1")
  return report(runs_dir(options), tier=options.tier, seeds=options.seeds)


def label_runs(workdir: str, label: str, scale: float, seeds: int) -> list[report_lib.Run]:
  """The finished runs of row ``label`` at rate scale ``scale`` (seeds 0..seeds-1, 8 workers)."""
  runs = [report_lib.read_run(os.path.join(workdir, sweep_config.run_name(label, scale, s)))
          for s in range(seeds)]
  return [r for r in runs if r is not None and r.finished]


def train_criterion(run: report_lib.Run) -> float:
  """What the tuning budget minimises: the mean of the run's logged training losses over the
  last tenth of its steps (never a validation loss). NaN or inf when the run diverged."""
  steps, loss = run.series("loss")
  if not len(steps):
    return math.nan
  return float(np.mean(loss[steps > 0.9 * steps[-1]]))


def tuning(workdir: str, label: str) -> dict[float, float]:
  """Rate scale -> :func:`train_criterion` of the row's finished seed-0 runs, scale ascending."""
  out = {}
  for scale in sweep_config.LR_LADDER:
    runs = label_runs(workdir, label, scale, 1)
    if runs:
      out[scale] = train_criterion(runs[0])
  return out


# Criteria closer than this are a tie: the criterion cannot tell the scales apart (a round as
# long as the run synchronises after its last logged training loss), so nothing is extended.
TIE = 1e-6


def next_scale(tried: dict[float, float]) -> float | None:
  """The rate scale a row's tuning runs next, given its finished seed-0 runs' criteria
  (``tried``, scale -> :func:`train_criterion`); None once its choice is made.

  The first of :data:`configs.paper.t1_lm.LR_SCALES` not run yet; then, while the lowest finite
  criterion is at an end of the scales run and beats its neighbour there by more than
  :data:`TIE` (a diverged neighbour counts as beaten), the scale a factor of 2 past that end, as
  long as :data:`configs.paper.t1_lm.LR_LADDER` holds it.
  """
  missing = [s for s in sweep_config.LR_SCALES if s not in tried]
  if missing:
    return missing[0]
  finite = {s: v for s, v in tried.items() if math.isfinite(v)}
  if not finite:
    return None
  scales = sorted(tried)
  best = min(finite, key=finite.get)
  if best not in (scales[0], scales[-1]):
    return None
  neighbour = scales[1] if best == scales[0] else scales[-2]
  if math.isfinite(tried[neighbour]) and tried[neighbour] - tried[best] <= TIE:
    return None
  beyond = best / 2 if best == scales[0] else best * 2
  return beyond if beyond in sweep_config.LR_LADDER else None


def pending_scales(workdir: str, labels) -> dict[str, float]:
  """Row -> the rate scale its tuning runs next (:func:`next_scale`), for the rows of ``labels``
  whose grid has finished but whose choice is not made."""
  pending = {label: reported_scale(workdir, label)[1] for label in labels}
  return {label: scale for label, scale in pending.items() if scale is not None}


def chosen_scale(workdir: str, label: str, tier: str = "cpu") -> float | None:
  """The row's rate scale with the lowest finite training criterion; None until its tuning has
  finished (:func:`next_scale` has nothing left to run: a partial budget chooses nothing). A
  tier that gives the row its scale (the GPU tier, :func:`configs.paper.t1_lm.given_scale`)
  gives that one, once a run of it has finished."""
  scale, pending = reported_scale(workdir, label, tier)
  return scale if pending is None else None


def reported_scale(workdir: str, label: str,
                   tier: str = "cpu") -> tuple[float | None, float | None]:
  """``(scale, pending)``: the scale a page reports a row at, and the scale its tuning still has
  to run (None once it is over). While the tuning goes on past its grid, the page shows the best
  scale so far, marked provisional by ``pending``; the runs the reproduction starts (seeds,
  horizons) wait for :func:`chosen_scale`. ``(None, None)`` until the grid has finished, or
  where every scale diverged."""
  given = sweep_config.given_scale(tier, label)
  if given is not None:
    return (given if label_runs(workdir, label, given, 1) else None), None
  tried = tuning(workdir, label)
  if not all(s in tried for s in sweep_config.LR_SCALES):
    return None, None
  finite = {s: v for s, v in tried.items() if math.isfinite(v)}
  return (min(finite, key=finite.get) if finite else None), next_scale(tried)


def extend_tuning(workdir: str, labels, run_chosen) -> None:
  """Runs the tuning's scales past the grid (:func:`pending_scales`) round by round until every
  row of ``labels`` has chosen; ``run_chosen(chosen)`` runs seed 0 of each ``row@scale`` of a
  round (a config's ``chosen`` argument)."""
  for _ in sweep_config.LR_LADDER:  # each round moves a row one scale along the ladder
    pending = pending_scales(workdir, labels)
    if not pending:
      return
    run_chosen("+".join(f"{label}@{scale:g}" for label, scale in pending.items()))


def headline_choice(workdir: str, tier: str) -> dict[str, float]:
  """The headline rows and their chosen rate scales: dense, solo and the best row of each family at
  each of :data:`HEADLINE_TIERS` (lowest training criterion at its chosen scale), among the
  tier's tuned rows whose tuning has finished."""
  tuned = {label: chosen_scale(workdir, label, tier) for label in sweep_config.tuning_rows(tier)}
  tuned = {label: scale for label, scale in tuned.items() if scale is not None}
  out = {label: scale for label, scale in tuned.items() if label in sweep_config.REFERENCES}
  for tier_name in sweep_config.HEADLINE_TIERS:
    best = {}
    for label, scale in tuned.items():
      if sweep_config.tier_of(label) != tier_name:
        continue
      value = tuning(workdir, label)[scale]
      fam = sweep_config.family(label)
      if fam not in best or value < best[fam][1]:
        best[fam] = (label, value)
    out.update({label: tuned[label] for label, _ in best.values()})
  return out


def kind_counts(config, steps: int) -> dict[str, int]:
  """Step kind name -> how many of the steps ``0, ..., steps - 1`` ran that kind, for ``config``
  (a run's config.json, a dict or ConfigDict), in the kinds' own order."""
  config = ml_collections.ConfigDict(config) if isinstance(config, dict) else config
  kinds = methods.step_kinds(config)
  counts = step_kinds.kind_counts(kinds, 0, steps)
  return {k.name: counts[k.name] for k in kinds}


def total_bytes(run: report_lib.Run) -> float:
  """The bytes one worker sent over the whole run: each step charged the bytes of its step kind's
  compiled program (``results.json``'s ``bytes_by_kind``), the kinds counted from the run's own
  config (:func:`kind_counts`).

  Raises:
    ValueError: the total disagrees with the runner's ``wire_bytes`` (their mean over the steps
      run): the run's accounting and its config do not describe the same steps.
  """
  steps = run.results["step"]
  by_kind = run.results["bytes_by_kind"]
  total = sum(by_kind[kind] * n for kind, n in kind_counts(run.config, steps).items() if n)
  if not math.isclose(total, run.results["wire_bytes"] * steps, rel_tol=1e-6):
    raise ValueError(f"{run.path}: the step kinds' bytes over {steps} steps total {total:.6g}, "
                     f"but results.json's wire_bytes x steps is "
                     f"{run.results['wire_bytes'] * steps:.6g}")
  return total


def within_tier(row: dict) -> bool | None:
  """Whether a row's total bytes are within 10% of its tier (None for a row of fixed bytes)."""
  ratio = equal_bytes.TIERS.get(row.get("tier"))
  if ratio is None or not row.get("compression_ratio"):
    return None
  return abs(row["compression_ratio"] / ratio - 1) <= 0.1


def rows_for(workdir: str, labels, seeds: int, tier: str = "cpu", *,
             family=sweep_config.family, tier_of=sweep_config.tier_of) -> list[dict]:
  """One row per label: the tuning budget's training losses by rate scale, and at the chosen
  scale the validation loss (nats per token, bits per byte) over its seeds, its retention
  against ``dense`` and ``solo`` (:func:`experiments.reproduce.stats.retention`; where both are
  among the labels), the total bytes of the compiled steps, and the method's settings as its
  first run's config holds them. ``family`` and ``tier_of`` name a label's family and tier (T1's
  by default; F6-LM's and F7-LM's labels are their own)."""
  failures = common.read_failures(workdir)
  rows = []
  for label in labels:
    scale, pending = reported_scale(workdir, label, tier)
    tried = tuning(workdir, label)
    runs = label_runs(workdir, label, scale, seeds) if scale is not None else []
    loss = [r.results["test_loss"] for r in runs]
    bpb = [r.results["test_bits_per_byte"] for r in runs]
    failed = [m for n, m in failures.items() if n.startswith(label + "_lr")]
    status = (f"{len(runs)} seed(s)" if runs else tuning_status(tried))
    if runs and pending is not None:
      status += f"; provisional: its tuning runs rate scale {pending:g} next"
    row = {"method": label, "tier": tier_of(label) or "fixed",
           "family": family(label), "seeds": len(runs), "lr_scale": scale, "losses": loss,
           "tuning": " / ".join(f"{s:g}: {v:.3f}" + (" *" if s == scale else "")
                                for s, v in tried.items()),
           "val_loss": report_lib.format_mean_std(loss, 1, 3),
           "loss_mean": report_lib.mean_std(loss)[0] if runs else None,
           "loss_std": report_lib.mean_std(loss)[1] if runs else None,
           "loss_ci95": stats.interval(loss) if len(runs) > 1 else None,
           "bits_per_byte": float(np.mean(bpb)) if runs else None,
           "status": ("failed: " + failed[0]) if failed and not tried else status,
           "run_dirs": " ".join(report_lib.relative(r.path) for r in runs)}
    if runs:
      first = runs[0]
      row["wire_bytes"] = float(np.mean([r.results["wire_bytes"] for r in runs]))
      row["total_bytes"] = float(np.mean([total_bytes(r) for r in runs]))
      ratios = [r.results["compression_ratio"] for r in runs]  # None: solo sends nothing
      row["compression_ratio"] = None if None in ratios else float(np.mean(ratios))
      row["settings"] = settings_text(first.config)
      row.update(scale_fields(first))
      row["on_tier"] = within_tier(row)
      row["on_tier_text"] = {True: "yes", False: "no", None: "-"}[row["on_tier"]]
      row["data"] = data_of(runs)
    rows.append(row)
  dense = next((r for r in rows if r["method"] == "dense" and r["seeds"]), None)
  solo = next((r for r in rows if r["method"] == "solo" and r["seeds"]), None)
  for row in rows:
    if not row["seeds"]:
      continue
    # Losses on another corpus or tokenizer are not the same quantity: no difference is taken.
    if dense is not None and dense["data"] == row["data"]:
      row["vs_dense"] = row["loss_mean"] - dense["loss_mean"]
      row["vs_dense_pct"] = 100 * row["vs_dense"] / dense["loss_mean"]
    if dense is not None and solo is not None:
      row.update(retention_against(row["losses"], row["data"], solo, dense))
  return rows


def retention_against(losses, data: tuple, solo: dict, dense: dict) -> dict:
  """:func:`retention_fields` of ``losses`` (measured on ``data``, :func:`data_of`) against
  ``solo`` and ``dense`` (each with its ``losses`` and ``data``); where either reference was
  measured on another corpus or tokenizer, only a ``retention_text`` that names both: losses
  under two tokenizers are not the same quantity."""
  apart = {name: ref["data"] for name, ref in (("solo", solo), ("dense", dense))
           if ref["data"] != data}
  if apart:
    return {"retention_text": "- (" + "; ".join(
        f"{name} on {data_text(other)}, this row on {data_text(data)}"
        for name, other in apart.items()) + ")"}
  return retention_fields(losses, solo["losses"], dense["losses"])


def data_of(runs: list[report_lib.Run]) -> tuple:
  """What a row's losses are measured on: each run's ``(corpus sha256, tokenizer sha256)``, as
  its results record them (None where they do not), sorted and without repeats."""
  return tuple(sorted({(r.results.get("corpus_sha256"), r.results.get("tokenizer_sha256"))
                       for r in runs}, key=str))


def data_text(data: tuple) -> str:
  """``corpus c07d8a85, tokenizer f0c45fb9`` for each of ``data``'s pairs (:func:`data_of`)."""
  return " and ".join(f"corpus {str(corpus)[:8]}, tokenizer {str(tokenizer)[:8]}"
                      for corpus, tokenizer in data)


def tuning_status(tried: dict[float, float]) -> str:
  """Why a row has no run to report: its grid's scales not all run, or every one diverged."""
  done = sum(s in tried for s in sweep_config.LR_SCALES)
  if done < len(sweep_config.LR_SCALES):
    return f"tuning: {done} of {len(sweep_config.LR_SCALES)} rate scales finished"
  return "tuning: diverged at every rate scale"


def scale_fields(run: report_lib.Run) -> dict:
  """The scale a retention holds at, which the published laws depend on: ``tokens_per_param``
  (the tokens the run trained on, all its workers together, per parameter) and
  ``per_worker_tokens`` (each worker's tokens a step)."""
  config, results = run.config, run.results
  step_tokens = config["batch_size"] * config["data"]["seq_len"]
  return {"tokens_per_param": results["step"] * step_tokens / results["num_params"],
          "per_worker_tokens": step_tokens // results["num_workers"]}


def retention_fields(losses, solo_losses, dense_losses) -> dict:
  """A row's ``retention``, ``retention_ci95`` and ``retention_text`` (``0.62 ± 0.08 (n=3)``, or
  ``0.62 (n=1)`` without an interval) from its seeds' losses and the references'."""
  kept = stats.retention(losses, solo_losses, dense_losses)
  spread = "" if math.isnan(kept.half_width) else f" ± {kept.half_width:.2f}"
  return {"retention": kept.value, "retention_ci95": kept.half_width,
          "retention_text": f"{kept.value:.2f}{spread} (n={kept.seeds})"}


def settings_text(config: dict) -> str:
  """The budget fields of a run's method (and of a local-update method's carrier), as its
  config.json holds them."""
  def fields(name, keys=("density", "rank", "block_size", "score", "sensitivity", "support",
                          "topk", "chunk")):
    own = config["compression"].get(name, {})
    return [f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in own.items()
            if k in keys]
  method = config["method"]
  carrier = methods.carrier(ml_collections.ConfigDict(config))
  if carrier:  # a local-update method: its rounds, then its carrier's budget
    own = fields(method, ("every", "outer_learning_rate"))
    text = f"{method} " + " ".join(own) + f", {carrier} " + " ".join(fields(carrier))
  else:
    text = f"{method} " + " ".join(fields(method))
  if config["compression"].get("exchanged") == "update":
    text += " after each worker's AdamW"
  return text


def solver_rows(tier: str) -> list[dict]:
  """The solver's settings for every budgeted method and tier at 8 and 32 workers (cost model;
  ``tests/test_equal_bytes.py`` checks them against the compiled HLO)."""
  out = []
  for tier_name, ratio in equal_bytes.TIERS.items():
    for method in sweep_config.BUDGETED:
      row = {"tier": tier_name, "method": method}
      for workers in (8, 32):
        settings, solution = methods.equal_bytes_settings(lm.get_config(
            f"tier={tier},method={method},ratio={ratio},workers={workers}"))
        budget = {k: getattr(settings, k) for k in ("density", "rank", "block_size")
                  if hasattr(settings, k)}
        row[f"w{workers}"] = (", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                                        for k, v in budget.items())
                              + f" ({solution.ratio:.3g}x"
                              + ("" if solution.feasible else ", off tier") + ")")
      out.append(row)
  return out


def provenance_notes(workdir: str, tier: str) -> list[str]:
  """The tier, and the device, Python version and corpus of the runs (from their results)."""
  runs = [r for r in (report_lib.read_run(os.path.join(workdir, d))
                      for d in sorted(os.listdir(workdir)) if not d.startswith((".", "logs")))
          if r is not None and r.finished] if os.path.isdir(workdir) else []
  if not runs:
    return [f"Tier {tier}: no finished run yet."]
  seen = lambda key: sorted({str(r.results.get(key)) for r in runs})
  records = [r.results[provenance.KEY] for r in runs if provenance.KEY in r.results]
  machines = sorted({provenance.machine_text(rec) for rec in records})
  commits = sorted({provenance.commit_text(rec) for rec in records})
  dates = sorted(rec["date"] for rec in records)
  commands = sorted({rec["command"] for rec in records if rec.get("command")})
  return [f"Tier `{tier}` ({len(runs)} finished runs in `{report_lib.relative(workdir)}`): "
          f"Python {', '.join(seen('python_version'))}; corpus sha256 "
          f"{', '.join(seen('corpus_sha256'))} ({', '.join(seen('corpus_files'))} files, "
          f"{', '.join(seen('corpus_bytes'))} bytes); tokenizer sha256 "
          f"{', '.join(seen('tokenizer_sha256'))}.",
          f"Runs' machines ({len(records)} runs, {dates[0] if dates else '-'} to "
          f"{dates[-1] if dates else '-'}): " + " | ".join(machines) + ". Runs' commits: "
          + ", ".join(commits) + ". Runs' commands: "
          + ", ".join(f"`{c}`" for c in commands) + "."]


@functools.cache  # traces the model's shapes; the claims of one report ask twice
def scale_text(tier: str) -> str:
  """The tier's model and length, for the claims that compare with a paper's scale."""
  config = lm.get_config(f"tier={tier}")
  params = registry.num_elements(methods.parameter_shapes(config))
  return f"a {params / 1e6:.3g}M-parameter model for {config.num_steps:,} steps"


def recipe_note(tier: str) -> str:
  name, sizes = lm.HARDWARE_TIERS[tier]
  budget = (
      "No tuning at this tier: each row runs at the rate scale the CPU tier's tuning chose "
      "(configs/paper/t1_lm.py's GPU_ROWS), dense at 1, one seed"
      if tier == "gpu" else
      "Tuning budget, the same for every row: the rate `lr_scale` scales (AdamW's peak rate; "
      "a local-update method's outer rate) at "
      f"{', '.join(f'{s:g}' for s in sweep_config.LR_SCALES)}, one seed each, and past an "
      "end of them a factor of 2 at a time while that end has the lowest training loss "
      f"(within {min(sweep_config.LR_LADDER):g}-{max(sweep_config.LR_LADDER):g}); the scale "
      "with the lowest mean training loss over the last tenth of the run is kept (`tuning` "
      "column, chosen marked *)")
  return (f"Recipe, the same for every method: configs/lm_stdlib.py's `{name}` model, AdamW "
          f"with cosine decay, {sizes['num_steps']} steps of {sizes['batch_size']} sequences of "
          f"{sizes['seq_len']} tokens "
          f"({sizes['num_steps'] * sizes['batch_size'] * sizes['seq_len']:,} tokens), 8 "
          "workers; validation loss in nats per token on the held-out files' windows "
          f"(configs/paper/lm.py). {budget}; nothing is selected by a validation loss.")


COLUMNS = [("method", "row"), ("family", "family"), ("val_loss", "val loss nats/token (mean ± std)"),
           ("loss_ci95", "95% CI ±"), ("vs_dense", "vs dense"), ("vs_dense_pct", "vs dense %"),
           ("retention_text", "retention (95% CI)"),
           ("compression_ratio", "x fewer total bytes (HLO)"),
           ("tokens_per_param", "tokens/parameter"), ("per_worker_tokens", "tokens/worker/step"),
           ("total_bytes", "total bytes/worker"), ("on_tier_text", "on tier (±10%)"),
           ("tuning", "train loss by lr scale"), ("settings", "settings"), ("status", "status"),
           ("run_dirs", "run directories")]
# The project's goal: within GOAL[tier] of dense's validation loss (relative) at that tier.
GOAL = {"100x": 0.02, "1000x": 0.05}


def best_row(rows: list[dict], tier: str, *, tasc: bool | None = None) -> dict | None:
  """The row with the lowest mean validation loss at ``tier`` (only TASC's rows, or only the
  others', when ``tasc`` says), among finished rows on their tier. Reported, not selected: the
  runs it compares were each chosen on training loss."""
  pool = [r for r in rows if r["seeds"] and r["tier"] == tier and r.get("on_tier")
          and (tasc is None or ("tasc" in r["method"]) == tasc)]
  return min(pool, key=lambda r: r["loss_mean"], default=None)


def gap_text(row: dict, dense: dict) -> str:
  ci = math.sqrt((row.get("loss_ci95") or 0) ** 2 + (dense.get("loss_ci95") or 0) ** 2)
  spread = f" ± {ci:.3f} (95%)" if row["seeds"] > 1 and dense["seeds"] > 1 else " (one seed)"
  kept = f"; retention {row['retention_text']}" if row.get("retention_text") else ""
  return (f"{row['method']} {row['val_loss']} vs dense {dense['val_loss']}: "
          f"{row['vs_dense']:+.3f}{spread} nats, {row['vs_dense_pct']:+.1f}%{kept}")


def claims(rows: list[dict], model_tier: str = "cpu") -> list[Claim]:
  by = {r["method"]: r for r in rows if r["seeds"]}
  dense = by.get("dense")
  out = []
  if dense is None:
    return out
  for tier, goal in GOAL.items():
    best = best_row(rows, tier)
    if best is not None:
      out.append(Claim(
          f"At {tier} fewer total bytes, within {goal:.0%} of dense's validation loss at the "
          "same tokens", "project goal",
          "best: " + gap_text(best, dense), best["vs_dense_pct"] <= 100 * goal,
          f"met when the best row's loss is at most {goal:.0%} above dense's"))
    tasc, other = best_row(rows, tier, tasc=True), best_row(rows, tier, tasc=False)
    if tasc is not None and other is not None:
      gap = tasc["loss_mean"] - other["loss_mean"]
      # An interval of the difference needs seeds of both rows.
      ci = (math.sqrt(tasc["loss_ci95"] ** 2 + other["loss_ci95"] ** 2)
            if tasc.get("loss_ci95") and other.get("loss_ci95") else 0.0)
      out.append(Claim(
          "TASC (Hessian-aware structured sparsification) beats the other compressors at equal "
          "bytes", "TASC (Wide ResNet-20, CIFAR-10; unverified)",
          f"at {tier}: TASC's best, {tasc['method']} {tasc['val_loss']}, vs the best other, "
          f"{other['method']} {other['val_loss']} (difference {gap:+.3f}"
          + (f" ± {ci:.3f}, 95%)" if ci else ", one seed of at least one)"),
          gap < -ci if ci else None,
          "lower validation loss is better; a difference inside the interval is no win"
          if ci else "one seed cannot resolve the difference"))
  diloco = by.get(f"diloco_{sweep_config.HEADLINE}")
  if diloco:
    out.append(Claim(
        "DiLoCo: 500x less communication than data parallel at equal or better perplexity",
        "Douillard et al. 2023 (C4, 150M-400M parameters, 8 workers, H = 500)",
        "at 100x: " + gap_text(diloco, dense), None,
        f"{scale_text(model_tier)}, not the paper's scale and length"))
  demo = by.get(f"demo_{sweep_config.HEADLINE}")
  if demo:
    out.append(Claim(
        "DeMo matches or beats AdamW while sending orders of magnitude less",
        "Peng, Quesnelle & Kingma 2024 (OLMo 300M-1B)",
        f"at {demo['compression_ratio']:.0f}x: " + gap_text(demo, dense), None,
        f"{scale_text(model_tier)}, not the paper's scale"))
  return out


def plot_loss_vs_bytes(rows: list[dict], title: str):
  """Validation loss against total bytes per worker, one line per row stem across its tiers."""
  def plot(fig):
    ax = fig.add_axes([0.08, 0.12, 0.62, 0.8])
    stems = {}
    for r in rows:
      if r["seeds"] and r.get("total_bytes"):
        stem = r["method"].rsplit("_", 1)[0] if r["tier"] != "fixed" else r["method"]
        stems.setdefault(stem, []).append(r)
    for stem, members in sorted(stems.items()):
      members.sort(key=lambda r: r["total_bytes"])
      x = [r["total_bytes"] for r in members]
      y = [r["loss_mean"] for r in members]
      err = [r["loss_std"] if r["seeds"] > 1 else 0 for r in members]
      seeds = "/".join(str(r["seeds"]) for r in members)
      ax.errorbar(x, y, yerr=err, marker="o", capsize=3,
                  ls="-" if len(members) > 1 else "", label=f"{stem} (seeds: {seeds})")
    ax.set_xscale("log")
    plots.decorate(ax, xlabel="total bytes per worker over the run (compiled HLO), log scale",
                   ylabel="validation loss, nats/token (mean ± std over seeds)", title=title,
                   title_size=11)
    plots.legend_beside(ax)
  return plot


def report_labels(workdir: str, tier: str) -> list[str]:
  """The rows a tier's table shows: its grid's tuned rows, and any other row with runs."""
  grid = sweep_config.tuning_rows(tier) + (list(sweep_config.GPU_ROWS) if tier == "gpu" else [])
  return [label for label in sweep_config.rows()
          if label in grid or tuning(workdir, label)]


def report(workdir: str, *, tier: str, seeds: int) -> Report:
  """T1-LM's table, claims and figure from the run directories."""
  rows = rows_for(workdir, report_labels(workdir, tier), seeds, tier)
  solver = solver_rows(tier)
  return Report(
      name=common.page_name("t1_lm", tier),
      title=f"T1-LM: validation loss at equal total bytes, stdlib language model ({tier} tier)",
      columns=[("tier", "tier")] + COLUMNS, rows=rows, claims=claims(rows, tier),
      sections=[("Equal-bytes settings at 8 and 32 workers (solver, cost model)",
                 "Each budgeted per-step method's setting for each tier, solved from the cost "
                 "model (`compressors/equal_bytes.py`); `tests/test_equal_bytes.py` compiles "
                 "them at 8 and 32 workers and checks the HLO's bytes within 10% of the tier. "
                 "Runs of this tier use the 8-worker column; a local-update method's `every`, or "
                 "its exchange's budget at the tier over `every`, is solved the same way when "
                 "the run starts (its config.json holds it).\n\n" + report_lib.markdown_table(
                     [("tier", "tier"), ("method", "method"), ("w8", "8 workers"),
                      ("w32", "32 workers")], solver))],
      configs=[f"configs/paper/t1_lm.py:tier={tier},subset=t1", "configs/paper/lm.py",
               "configs/lm_stdlib.py"],
      notes=[recipe_note(tier), *provenance_notes(workdir, tier),
             "Bytes: what one worker sends over the whole run, each step charged the bytes of "
             "its step kind's compiled program's collectives (a local-update method's local "
             "steps send nothing but the 4-byte non-finite flag, its synchronisations the "
             "pseudo-gradient); x fewer total bytes is dense's total over the row's. Top-k "
             "with error feedback; DGC with its own momentum and residual; TASC float16 on the "
             "wire, Hutchinson curvature every 10 steps (local updates: at each "
             "synchronisation).",
             "95% CI: Student's t over seeds (half-width); a row with one seed has none. Seeds "
             "1 and 2 run for the headline rows only: dense and each family's best row at "
             "100x and 1000x by training loss (configs/paper/t1_lm.py)."],
      plot=plot_loss_vs_bytes(rows, f"T1-LM ({tier} tier): validation loss vs total bytes"))
