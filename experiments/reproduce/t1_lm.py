"""T1-LM: validation loss at equal wire bytes, every method, a language model on real text.

The runs are ``configs/paper/t1_lm.py:subset=t1``'s (runs of ``configs/paper/lm.py``) in
``<workdir>/lm_<tier>``, the folder F4-LM and F5 read too; the tokenizer is trained once into its
``tokenizers`` folder. Each budgeted method's density, rank or block size is solved so that its
bytes per step land on the tier (:mod:`compressors.equal_bytes`); the table gives the bytes the
compiled step sent (``wire_bytes``, read from the HLO by the runner) and the solver's settings
at 8 and at 32 workers.
"""

import math
import os

import numpy as np

from compressors import equal_bytes
from configs.paper import lm
from configs.paper import t1_lm as sweep_config
from experiments import methods
from experiments import provenance
from experiments.reproduce import common
from experiments.reproduce import plots
from experiments.reproduce import report as report_lib
from experiments.reproduce.report import Claim
from experiments.reproduce.report import Report

TITLE = "T1-LM: validation loss at equal wire bytes, language model on the stdlib's source"
# Seeds' spread: Student's t quantile for a two-sided 95% interval, by degrees of freedom.
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306}


def runs_dir(options: common.Options) -> str:
  """The folder of the tier's language-model runs (T1-LM's, F4-LM's and F5's)."""
  return os.path.join(options.workdir, f"lm_{options.tier}")


def run_subset(options: common.Options, subset: str) -> None:
  """Runs ``subset`` (``t1`` or ``f4``) of the tier's sweep, unless ``report_only``."""
  if options.report_only:
    return
  workdir = runs_dir(options)
  sweep = sweep_config.get_config(f"tier={options.tier},seeds={options.seeds},subset={subset}")
  # One tokenizer for every run, trained by the first (see experiments/data/tokenizer.py).
  sweep.overrides = {"data": {"cache_dir": os.path.abspath(os.path.join(workdir, "tokenizers"))}}
  common.run_sweep_config(sweep, workdir, jobs=options.jobs)


def produce(options: common.Options) -> Report:
  """Runs T1-LM's sweep (unless ``report_only``); its table, claims and figure."""
  run_subset(options, "t1")
  return report(runs_dir(options), tier=options.tier, seeds=options.seeds)


def interval(values) -> float:
  """Half-width of the 95% confidence interval of the mean of ``values`` (Student's t; NaN for
  fewer than 2)."""
  n = len(values)
  if n < 2:
    return math.nan
  return _T95.get(n - 1, 1.96) * float(np.std(values, ddof=1)) / math.sqrt(n)


def label_runs(workdir: str, label: str, seeds: int) -> list[report_lib.Run]:
  """The finished runs of row ``label`` (seeds 0..seeds-1, 8 workers)."""
  runs = [report_lib.read_run(os.path.join(workdir, sweep_config.run_name(label, s)))
          for s in range(seeds)]
  return [r for r in runs if r is not None and r.finished]


def rows_for(workdir: str, labels, seeds: int) -> list[dict]:
  """One row per label: validation loss (nats per token, bits per byte) over its seeds, the
  compiled bytes, and the method's settings as its first run's config holds them."""
  failures = common.read_failures(workdir)
  rows = []
  for label in labels:
    runs = label_runs(workdir, label, seeds)
    loss = [r.results["test_loss"] for r in runs]
    bpb = [r.results["test_bits_per_byte"] for r in runs]
    failed = [m for n, m in failures.items() if n.startswith(label + "_s")]
    row = {"method": label, "seeds": len(runs),
           "val_loss": report_lib.format_mean_std(loss, 1, 3),
           "loss_mean": report_lib.mean_std(loss)[0] if runs else None,
           "loss_std": report_lib.mean_std(loss)[1] if runs else None,
           "loss_ci95": interval(loss) if len(runs) > 1 else None,
           "bits_per_byte": float(np.mean(bpb)) if runs else None,
           "status": ("failed: " + failed[0]) if failed and not runs else f"{len(runs)} seed(s)",
           "run_dirs": " ".join(report_lib.relative(r.path) for r in runs)}
    if runs:
      first = runs[0]
      row["wire_bytes"] = float(np.mean([r.results["wire_bytes"] for r in runs]))
      row["compression_ratio"] = float(np.mean([r.results["compression_ratio"] for r in runs]))
      row["settings"] = settings_text(first.config)
    rows.append(row)
  dense = next((r for r in rows if r["method"] == "dense" and r["seeds"]), None)
  for row in rows:
    if dense is not None and row["seeds"]:
      row["vs_dense"] = row["loss_mean"] - dense["loss_mean"]
  return rows


def settings_text(config: dict) -> str:
  """The budget fields of a run's method, as its config.json holds them."""
  method = config["method"]
  own = config["compression"].get(method, {})
  fields = [f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in own.items()
            if k in ("density", "rank", "block_size", "score", "sensitivity", "support")]
  return f"{method} " + " ".join(fields)


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
  parent = os.path.dirname(os.path.abspath(workdir))
  tiers_run = [t for t in lm.TIERS if any(
      os.path.exists(os.path.join(parent, f"lm_{t}", d, report_lib.RESULTS_FILE))
      for d in (os.listdir(os.path.join(parent, f"lm_{t}"))
                if os.path.isdir(os.path.join(parent, f"lm_{t}")) else ()))]
  return [f"Tiers with finished runs beside this one: {', '.join(tiers_run)}; not run: "
          f"{', '.join(t for t in lm.TIERS if t not in tiers_run) or 'none'}.",
          f"Tier `{tier}` ({len(runs)} finished runs in `{report_lib.relative(workdir)}`): "
          f"Python {', '.join(seen('python_version'))}; corpus sha256 "
          f"{', '.join(seen('corpus_sha256'))} ({', '.join(seen('corpus_files'))} files, "
          f"{', '.join(seen('corpus_bytes'))} bytes); tokenizer sha256 "
          f"{', '.join(seen('tokenizer_sha256'))}.",
          f"Runs' machines ({len(records)} runs, {dates[0] if dates else '-'} to "
          f"{dates[-1] if dates else '-'}): " + " | ".join(machines) + ". Runs' commits: "
          + ", ".join(commits) + "."]


def recipe_note(tier: str) -> str:
  name, sizes = lm.TIERS[tier]
  return (f"Recipe, the same for every method (chosen on dense; nothing selected by validation "
          f"loss): configs/lm_stdlib.py's `{name}` model, AdamW with cosine decay, "
          f"{sizes['num_steps']} steps of {sizes['batch_size']} sequences of {sizes['seq_len']} "
          f"tokens ({sizes['num_steps'] * sizes['batch_size'] * sizes['seq_len']:,} tokens), 8 "
          "workers; validation loss in nats per token on the held-out files' windows "
          "(configs/paper/lm.py).")


COLUMNS = [("method", "row"), ("val_loss", "val loss nats/token (mean ± std)"),
           ("loss_ci95", "95% CI ±"), ("vs_dense", "vs dense"),
           ("bits_per_byte", "bits/byte"), ("compression_ratio", "wire compression (x, HLO)"),
           ("wire_bytes", "bytes/worker/step"), ("settings", "settings"), ("status", "status"),
           ("run_dirs", "run directories")]


def _tier_of(label: str) -> str | None:
  return next((t for t in equal_bytes.TIERS if label.endswith("_" + t)), None)


def claims(rows: list[dict]) -> list[Claim]:
  by = {r["method"]: r for r in rows if r["seeds"]}
  dense, topk, tasc = (by.get(k) for k in ("dense", f"topk_{sweep_config.HEADLINE}",
                                           f"tasc_{sweep_config.HEADLINE}"))
  out = []
  if tasc and topk:
    gap = tasc["loss_mean"] - topk["loss_mean"]
    ci = math.sqrt((tasc.get("loss_ci95") or 0) ** 2 + (topk.get("loss_ci95") or 0) ** 2)
    out.append(Claim(
        "TASC: 130x compression at better accuracy than SparCML's magnitude top-k (93.27% vs "
        "92.57%)", "TASC (Wide ResNet-20, CIFAR-10; unverified)",
        f"at {sweep_config.HEADLINE}: TASC {tasc['val_loss']} vs top-k with error feedback "
        f"{topk['val_loss']} nats/token (difference {gap:+.3f} ± {ci:.3f}, 95%)",
        gap < -ci, "lower validation loss is better; a language model, not CIFAR-10"))
  if tasc and dense:
    out.append(Claim(
        "TASC at >= 100x within a small margin of dense", "project goal",
        f"TASC {tasc['val_loss']}, dense {dense['val_loss']} ({tasc['vs_dense']:+.3f} nats)",
        tasc["vs_dense"] <= 0.05 * dense["loss_mean"],
        "within 5% of dense's loss counts as close"))
  dgc = by.get(f"dgc_{sweep_config.HEADLINE}")
  if dgc and dense:
    out.append(Claim(
        "DGC: 270x-600x gradient compression without accuracy loss",
        "Lin et al., ICLR 2018 (LSTM language model on Penn Treebank: 462x at no perplexity "
        "loss; recalled, check)",
        f"DGC at {dgc['compression_ratio']:.0f}x: {dgc['val_loss']} vs dense {dense['val_loss']}",
        None, "a fixed token budget far short of convergence (the CPU tier: 0.6 passes over "
        "the training tokens) cannot answer a claim about converged models"))
  power = by.get(f"powersgd_{sweep_config.HEADLINE}")
  if power:
    out.append(Claim(
        "PowerSGD rank 1-2 trains language models at dense quality", "Vogels et al., NeurIPS "
        "2019 (LSTM on WikiText-2, rank 4)",
        f"rank 1 at {power['compression_ratio']:.0f}x (the model's bias and LayerNorm vectors "
        f"go uncompressed, so 100x is out of reach): {power['val_loss']}", None,
        "early training; not at the claim's scale"))
  return out


def plot_loss_vs_bytes(rows: list[dict], title: str):
  """Validation loss against bytes per step, one line per method across its tiers."""
  def plot(fig):
    ax = fig.add_axes([0.08, 0.12, 0.62, 0.8])
    families = {}
    for r in rows:
      if r["seeds"] and r.get("wire_bytes"):
        families.setdefault(r["method"].split("_")[0], []).append(r)
    for family, members in sorted(families.items()):
      members.sort(key=lambda r: r["wire_bytes"])
      x = [r["wire_bytes"] for r in members]
      y = [r["loss_mean"] for r in members]
      err = [r["loss_std"] if r["seeds"] > 1 else 0 for r in members]
      seeds = "/".join(str(r["seeds"]) for r in members)
      ax.errorbar(x, y, yerr=err, marker="o", capsize=3,
                  ls="-" if len(members) > 1 else "", label=f"{family} (seeds: {seeds})")
    ax.set_xscale("log")
    plots.decorate(ax, xlabel="bytes per worker per step (compiled HLO), log scale",
                   ylabel="validation loss, nats/token (mean ± std over seeds)", title=title,
                   title_size=11)
    plots.legend_beside(ax)
  return plot


def report(workdir: str, *, tier: str, seeds: int) -> Report:
  """T1-LM's table, claims and figure from the run directories."""
  labels = list(sweep_config.rows())
  rows = [r for r in rows_for(workdir, labels, seeds)
          if r["seeds"] or r["method"] in sweep_config.grid(tier, "t1")]
  for row in rows:
    row["tier"] = _tier_of(row["method"]) or "fixed"
  solver = solver_rows(tier)
  return Report(
      name="t1_lm",
      title=f"T1-LM: validation loss at equal wire bytes, stdlib language model ({tier} tier)",
      columns=[("tier", "tier")] + COLUMNS, rows=rows, claims=claims(rows),
      sections=[("Equal-bytes settings at 8 and 32 workers (solver, cost model)",
                 "Each budgeted method's setting for each tier, solved from the cost model "
                 "(`compressors/equal_bytes.py`); `tests/test_equal_bytes.py` compiles them at 8 "
                 "and 32 workers and checks the HLO's bytes within 10% of the tier. Runs of "
                 "this tier use the 8-worker column.\n\n" + report_lib.markdown_table(
                     [("tier", "tier"), ("method", "method"), ("w8", "8 workers"),
                      ("w32", "32 workers")], solver))],
      configs=[f"configs/paper/t1_lm.py:tier={tier},subset=t1", "configs/paper/lm.py",
               "configs/lm_stdlib.py"],
      notes=[recipe_note(tier), *provenance_notes(workdir, tier),
             "Bytes: what one worker sends per step in the compiled training step's HLO "
             "collectives (results.json `wire_bytes`); wire compression is dense's bytes over "
             "those. Top-k and random-k with error feedback; DGC with its own momentum and "
             "residual; TASC float16 on the wire, Hutchinson curvature every 10 steps.",
             "95% CI: Student's t over seeds (half-width); a row with one seed has none. The CPU "
             "tier runs 3 seeds of dense, top-k and TASC at 100x and one of every other row "
             "(configs/paper/t1_lm.py: what fits 90 minutes on 2 CPU cores)."],
      plot=plot_loss_vs_bytes(rows, f"T1-LM ({tier} tier): validation loss vs bytes per step"))
