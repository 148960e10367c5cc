"""F4-LM: what makes a block of a pseudo-gradient worth sending, at 1000x, language model.

TASC compressing the pseudo-gradient of local updates in SparseLoCo's form (error decay 0.95, outer
SGD at rate 1; ``configs/paper/t1_lm.py``'s ``sparseloco_tasc`` rows at
:data:`~configs.paper.t1_lm.F4_TIER`: a synchronisation every 30 steps, the exchange solved to the
tier over 30) with each block score (magnitude, saliency ``h ||a||^2``, Newton decrement
``||a||^2 / h``, Fisher), each block size that can meet the tier, and this round's or the last
round's support; beside it per-element top-k on the same pseudo-gradient (SparseLoCo). The runs
are ``configs/paper/t1_lm.py:subset=f4``'s, in T1-LM's folder, every one at rate scale 1; the
default variant (:data:`~configs.paper.t1_lm.F4_DEFAULT`) and SparseLoCo are T1-LM's own rows
(:data:`~configs.paper.t1_lm.F4_ROW` and ``sparseloco_1000x``) at rate scale 1. Each score's
derivation is in :mod:`tasc._scores` and in the report's notes.

The default is set from the data by one rule (:func:`default_decision`): a variant replaces it
only if its mean validation loss is below the default's with the two seeds' 95% intervals apart;
with one seed on either side nothing is resolved and the default stays. Validation losses are
reported, never used to select a training setting.
"""

import os

import ml_collections
import numpy as np

from configs.paper import t1_lm as sweep_config
from experiments import methods
from experiments.reproduce import common
from experiments.reproduce import plots
from experiments.reproduce import report as report_lib
from experiments.reproduce import stats
from experiments.reproduce import t1_lm
from experiments.reproduce.report import Claim
from experiments.reproduce.report import Report

TITLE = (f"F4-LM: TASC block scores x block sizes x supports on the pseudo-gradient at "
         f"{sweep_config.F4_TIER}, language model")
SCALE = 1.0  # every F4-LM run's rate scale
DEFAULT = sweep_config.F4_DEFAULT  # (score, block, support) of T1-LM's F4_ROW
TOPK = f"sparseloco_{sweep_config.F4_TIER}"  # per-element top-k on the same pseudo-gradient
TOPK_SCORE = "per-element top-k (SparseLoCo; T1-LM's tuning run at rate scale 1)"
SUPPORT_TEXT = {"global": "this round's support", "previous": "the last round's support"}
DERIVATIONS = [
    "`a` is the vector TASC compresses: a worker's pseudo-gradient (its parameters' change over "
    "the round's 30 local AdamW steps, an accumulated descent direction) plus error feedback's "
    "residual; the outer step applies -lr a (lr: the outer rate).",
    "magnitude `||a_b||^2`: sending block b with the outer step -lr a_b lowers the loss to first "
    "order by g_b . lr a_b ~ lr ||a_b||^2 (a along the descent direction); the gain of a plain "
    "step on the block, curvature unseen.",
    "saliency `h_b ||a_b||^2` (default): holding the block back leaves the parameters displaced "
    "by lr a_b from where the outer step puts them, which costs the quadratic term "
    "1/2 (lr a_b)^T H_bb (lr a_b) = lr^2/2 h_b ||a_b||^2 (Optimal Brain Damage; HAWQ-v2); h_b "
    "is the block's mean |Hessian diagonal| (Hutchinson, refreshed at synchronisations).",
    "Newton decrement `||a_b||^2 / h_b`: taking a for the gradient, the quadratic model "
    "a.d + 1/2 d^T H d falls by 1/2 a^T H^-1 a ~ ||a_b||^2 / (2 h_b) at its minimum d = -H^-1 a; "
    "the gain of a curvature-scaled (Adam-like) step on the block.",
    "Fisher `F_b ||a_b||^2`: near a minimum of the log-likelihood H ~ E[g g^T], whose diagonal "
    "TASC estimates by an EMA of the block means of the squared vector it compresses (here each "
    "round's pseudo-gradient); saliency with curvature for free.",
]


run_folders = t1_lm.run_folders  # F4-LM's runs are in T1-LM's folder


def produce(options: common.Options) -> Report:
  """Runs F4-LM's runs (unless ``report_only``); its table, sections, claim and figure."""
  t1_lm.run_subset(options, "f4")
  return report(t1_lm.runs_dir(options), tier=options.tier, seeds=options.seeds)


def factors_of(label: str) -> tuple[str, int, str]:
  """``(score, block, support)`` of a TASC variant's label (the default's for F4_ROW)."""
  if label == sweep_config.F4_ROW:
    return DEFAULT
  args = sweep_config.f4_rows()[label]
  score = label[len(sweep_config.F4_ROW) + 1:].split("_b")[0]
  return score, args["block"], args["support"]


def variants(workdir: str, tier: str) -> list[tuple[str, tuple[str, int, str]]]:
  """``(label, (score, block, support))`` of every TASC variant the tier's grid runs, and of any
  other F4-LM row with a finished run at rate scale 1: the default (T1-LM's F4_ROW) first, then
  in :func:`configs.paper.t1_lm.f4_rows`' order."""
  grid = sweep_config.f4_grid(tier)
  out = [(sweep_config.F4_ROW, DEFAULT)]
  for label in sweep_config.f4_rows():
    if label in grid or t1_lm.label_runs(workdir, label, SCALE, 1):
      out.append((label, factors_of(label)))
  return out


def run_block(config: dict) -> int | None:
  """The TASC block size a run used (its config.json, the solver's where the label gave none)."""
  carrier = methods.carrier(ml_collections.ConfigDict(config)) or config["method"]
  return config["compression"].get(carrier, {}).get("block_size")


def row_for(workdir: str, label: str, factors: tuple[str, int, str] | None, seeds: int,
            failures: dict[str, str]) -> dict:
  """One table row: the label's runs at rate scale 1 (seeds 0..seeds-1), their validation loss
  (mean ± std, 95% interval), bytes and settings; ``factors`` None for per-element top-k."""
  runs = t1_lm.label_runs(workdir, label, SCALE, seeds)
  loss = [r.results["test_loss"] for r in runs]
  score, block, support = factors or (TOPK_SCORE, 1, "each worker's own")
  names = [sweep_config.run_name(label, SCALE, s) for s in range(seeds)]
  failed = [failures[n] for n in names if n in failures]
  started = any(os.path.exists(os.path.join(workdir, n, report_lib.CONFIG_FILE)) for n in names)
  if runs:
    status = f"{len(runs)} seed(s)"
  elif failed:
    status = "failed: " + failed[0]
  else:
    status = "started, not finished" if started else "not run"
  row = {"method": label, "score": score, "block": block,
         "support": SUPPORT_TEXT.get(support, support), "support_key": support,
         "seeds": len(runs), "val_loss": report_lib.format_mean_std(loss, 1, 3),
         "loss_mean": float(np.mean(loss)) if runs else None,
         "loss_std": report_lib.mean_std(loss)[1] if runs else None,
         "loss_ci95": stats.interval(loss) if len(runs) > 1 else None,
         "seed_losses": [float(v) for v in loss], "status": status,
         "run_dirs": " ".join(report_lib.relative(r.path) for r in runs),
         "data": t1_lm.data_of(runs)}
  if runs:
    row["compression_ratio"] = float(np.mean([r.results["compression_ratio"] for r in runs]))
    row["settings"] = t1_lm.settings_text(runs[0].config)
    row.update(t1_lm.scale_fields(runs[0]))
    if factors is not None:
      row["run_block"] = run_block(runs[0].config)
  return row


def rows_for(workdir: str, tier: str, seeds: int) -> list[dict]:
  """The TASC variants' rows (:func:`variants`, the default first), then SparseLoCo's; each
  finished row with its difference to the default's mean (``vs_default``) and, where T1-LM's
  dense and solo have run, its retention (:func:`experiments.reproduce.t1_lm.retention_against`)."""
  failures = common.read_failures(workdir)
  rows = [row_for(workdir, label, factors, seeds, failures)
          for label, factors in variants(workdir, tier)]
  rows.append(row_for(workdir, TOPK, None, seeds, failures))
  default = rows[0]
  references = {r["method"]: r for r in t1_lm.rows_for(workdir, ["dense", "solo"], seeds, tier)
                if r["seeds"]}
  for row in rows:
    if row["seeds"] and default["seeds"]:
      row["vs_default"] = row["loss_mean"] - default["loss_mean"]
    if row["seeds"] and len(references) == 2:
      row.update(t1_lm.retention_against(row["seed_losses"], row["data"], references["solo"],
                                         references["dense"]))
  return rows


# ----------------------------------------------------------------------------- comparisons


def name(row: dict) -> str:
  """A row's short name: ``saliency, b256, this round's support`` (or top-k's)."""
  if row["method"] == TOPK:
    return "per-element top-k (SparseLoCo)"
  return f"{row['score']}, b{row['block']}, {row['support']}"


def value(row: dict) -> str:
  """``4.123 ± 0.045 (95%, n=3)``, or ``4.123 (one seed)``."""
  if row["loss_ci95"] is None:
    return f"{row['loss_mean']:.3f} (one seed)"
  return f"{row['loss_mean']:.3f} ± {row['loss_ci95']:.3f} (95%, n={row['seeds']})"


def compare(row: dict, other: dict) -> tuple[float, float | None]:
  """``(difference of the means, row minus other; how far apart the two 95% intervals are)``:
  the distance positive when they do not overlap, negative when they do, None when either row
  has one seed (no interval: nothing is resolved)."""
  diff = row["loss_mean"] - other["loss_mean"]
  if row["loss_ci95"] is None or other["loss_ci95"] is None:
    return diff, None
  return diff, abs(diff) - row["loss_ci95"] - other["loss_ci95"]


def resolved(row: dict, other: dict) -> bool:
  """Whether ``row``'s mean is below ``other``'s with the two 95% intervals apart."""
  diff, gap = compare(row, other)
  return gap is not None and gap > 0 and diff < 0


def verdict_of(row: dict, other: dict) -> str:
  """Whether the 95% intervals resolve the difference of ``row`` and ``other``, in words."""
  diff, gap = compare(row, other)
  if gap is None:
    return f"{diff:+.3f} nats, not resolved: one seed, no interval"
  if gap > 0:
    return f"{diff:+.3f} nats, resolved: the 95% intervals are {gap:.3f} apart"
  return f"{diff:+.3f} nats, not resolved: the 95% intervals overlap"


def versus(row: dict, other: dict) -> str:
  """``row`` against ``other`` in words: the difference, and whether the intervals resolve it."""
  return f"{name(row)} vs {name(other)}: {verdict_of(row, other)}"


def ranking(group: list[dict], what: str) -> str:
  """The finished rows of ``group`` from lowest mean up, and whether the lowest one's lead over
  each other row is resolved by the 95% intervals."""
  done = sorted((r for r in group if r["seeds"]), key=lambda r: r["loss_mean"])
  missing = [r for r in group if not r["seeds"]]
  tail = (" Not finished: " + "; ".join(f"{name(r)} ({r['status']})" for r in missing) + "."
          if missing else "")
  if not done:
    return "No run has finished." + tail
  listed = "; ".join(f"{name(r)} {value(r)}" for r in done)
  if len(done) == 1:
    return f"Only {listed} has finished: nothing to compare." + tail
  best = done[0]
  open_ = [r for r in done[1:] if not resolved(best, r)]
  if not open_:
    verdict = (f"**{name(best)} is lowest, beyond the 95% intervals of every other "
               f"{what}.**")
  else:
    verdict = (f"**Lowest: {name(best)}; its lead is not resolved** over "
               + "; ".join(f"{name(r)} ({verdict_of(best, r)})" for r in open_) + ".")
  return f"{listed}. {verdict}" + tail


def default_decision(rows: list[dict]) -> tuple[dict | None, str]:
  """The default set from the data: ``(the variant that replaces it, or None; the sentence)``.

  Rule: a TASC variant replaces the default only if its mean validation loss is below the
  default's with the two 95% intervals apart (so with at least 2 seeds on each side); of several,
  the one with the lowest mean. Otherwise the default stays.
  """
  default = rows[0]
  keep = (f"the default stays {name(default)} (score `{DEFAULT[0]}`, block {DEFAULT[1]}, "
          f"support `{DEFAULT[2]}`)")
  tasc = [r for r in rows[1:] if r["method"] != TOPK and r["seeds"]]
  if not default["seeds"]:
    return None, (f"The default's row ({default['method']}) has no finished run "
                  f"({default['status']}), so nothing is compared with it: {keep}.")
  winners = sorted((r for r in tasc if resolved(r, default)), key=lambda r: r["loss_mean"])
  if winners:
    best = winners[0]
    diff, gap = compare(best, default)
    return best, (f"**The data favours {name(best)} over the default by {-diff:.3f} nats, "
                  f"{gap:.3f} beyond the two 95% intervals** ({value(best)} vs the default's "
                  f"{value(default)}): by the rule the default becomes score "
                  f"`{best['score']}`, block {best['block']}, support "
                  f"`{best['support_key']}`.")
  lowest = min(tasc + [default], key=lambda r: r["loss_mean"])
  if default["loss_ci95"] is None:
    why = "the default has one seed, so no variant's win over it can be resolved"
  elif lowest is default:
    why = "no variant's mean is below the default's"
  else:
    why = ("no variant's win over it is resolved: the lowest, " + versus(lowest, default))
  return None, (f"**{keep[0].upper() + keep[1:]}** ({value(default)}): {why}.")


# ----------------------------------------------------------------------------- the report


def sections(rows: list[dict]) -> list[tuple[str, str]]:
  """Which score, which block size, which support, SparseLoCo beside TASC, and the default."""
  tasc = [r for r in rows if r["method"] != TOPK]
  default, topk = rows[0], rows[-1]
  _, block, support = DEFAULT
  by_scores = [r for r in tasc if (r["block"], r["support_key"]) == (block, support)]
  blocks = []
  for score in sweep_config.SCORES:
    group = [r for r in tasc if r["score"] == score and r["support_key"] == support]
    if len({r["block"] for r in group}) > 1:
      blocks.append(f"- {score}: " + ranking(sorted(group, key=lambda r: r["block"]),
                                             "block size"))
  supports = [r for r in tasc if (r["score"], r["block"]) == DEFAULT[:2]]
  if topk["seeds"] and default["seeds"]:
    beside = (f"{name(default)} {value(default)}; per-element top-k on the same pseudo-gradient "
              f"at the same bytes (SparseLoCo, `{TOPK}`, T1-LM's tuning run at rate scale 1) "
              f"{value(topk)}: {versus(default, topk)}.")
  else:
    beside = (f"Not compared: TASC's default {default['status']}, SparseLoCo (`{TOPK}` at rate "
              f"scale 1) {topk['status']}.")
  _, decision = default_decision(rows)
  met = [b for b in sweep_config.BLOCK_SIZES if b not in sweep_config.UNMET_BLOCKS]
  rule = ("Rule: a variant replaces the default only if its mean validation loss is below the "
          "default's with the two seeds' 95% intervals apart; where they overlap, or either "
          "side has one seed, the difference is not resolved and the default stays. The "
          "validation losses are reported, not used to tune or select a training setting.")
  return [
      (f"Which score (block {block}, {SUPPORT_TEXT[support]})", ranking(by_scores, "score")),
      (f"Which block size ({', '.join(str(b) for b in met)}; {SUPPORT_TEXT[support]})",
       "\n".join(blocks) or "No score has runs at more than one block size."),
      (f"This round's or the last round's support ({DEFAULT[0]}, block {DEFAULT[1]})",
       ranking(supports, "support")),
      ("Beside per-element top-k", beside),
      ("Conclusion: the default, set from the data", f"{decision}\n\n{rule}"),
  ]


def claims(rows: list[dict]) -> list[Claim]:
  """Hessian-aware scores against magnitude at the default's block and support."""
  claim = ("Hessian-aware block selection trains better than magnitude selection at equal "
           "bytes")
  source = "TASC (Dong, Keutzer et al., unverified); HAWQ-v2 sensitivity"
  at = [r for r in rows if r["method"] != TOPK and r["seeds"]
        and (r["block"], r["support_key"]) == DEFAULT[1:]]
  magnitude = next((r for r in at if r["score"] == "magnitude"), None)
  hessian = [r for r in at if r["score"] in ("saliency", "newton", "fisher")]
  if magnitude is None or not hessian:
    return [Claim(claim, source, "not run (magnitude or every Hessian-aware score missing at "
                  f"block {DEFAULT[1]}, {SUPPORT_TEXT[DEFAULT[2]]})", None)]
  best = min(hessian, key=lambda r: r["loss_mean"])
  diff, gap = compare(best, magnitude)
  ours = (f"TASC on the pseudo-gradient at {sweep_config.F4_TIER}, block {DEFAULT[1]}, "
          f"{SUPPORT_TEXT[DEFAULT[2]]}: " + "; ".join(f"{r['score']} {value(r)}" for r in at)
          + f"; best Hessian-aware: {versus(best, magnitude)}")
  if gap is None:
    return [Claim(claim, source, ours, None, "one seed on a side: no interval resolves it")]
  return [Claim(claim, source, ours, resolved(best, magnitude),
                "a Hessian-aware score's mean below magnitude's with the two 95% intervals "
                "apart counts as yes")]


def block_notes(rows: list[dict]) -> list[str]:
  """A note for each variant whose runs used another block size than its label's (the default
  takes the solver's block at the tier; F4_DEFAULT names 256)."""
  return [f"Block size: the runs of `{r['method']}` used block {r['run_block']} (config.json; "
          f"the solver's at the tier), not the {r['block']} the table's row names; its "
          "comparisons at that block size mix two block sizes."
          for r in rows if r.get("run_block") is not None and r["run_block"] != r["block"]]


def plot_variants(rows: list[dict], tier: str):
  """Validation loss of each variant: each seed a dot, the mean a diamond with its 95% interval,
  the default's mean a dashed line."""
  done = [r for r in rows if r["seeds"]]

  def plot(fig):
    ax = fig.add_axes([0.3, 0.1, 0.66, 0.82])
    for y, row in enumerate(done):
      color = "C3" if row["method"] == TOPK else "C0" if row is rows[0] else "C7"
      ax.scatter(row["seed_losses"], [y] * row["seeds"], s=14, color=color, alpha=0.5)
      ax.errorbar([row["loss_mean"]], [y], xerr=[[row["loss_ci95"] or 0],
                                                 [row["loss_ci95"] or 0]],
                  fmt="D", color=color, capsize=4, ms=6)
    if done and rows[0]["seeds"]:
      ax.axvline(rows[0]["loss_mean"], color="C0", ls="--", lw=1, label="the default's mean")
    ax.set_yticks(range(len(done)), [("default: " if r is rows[0] else "")
                                     + f"{name(r)} (n={r['seeds']})" for r in done], fontsize=8)
    ax.invert_yaxis()
    plots.decorate(ax, xlabel="validation loss, nats/token (dots: seeds; diamond: mean ± 95% "
                              "interval)",
                   title=f"F4-LM ({tier} tier): TASC on the pseudo-gradient at "
                         f"{sweep_config.F4_TIER}, by variant; red: per-element top-k",
                   title_size=11, grid="x")
    if not done:
      ax.text(0.5, 0.5, "no finished run", ha="center", va="center", transform=ax.transAxes)
  return plot


def report(workdir: str, *, tier: str, seeds: int) -> Report:
  """F4-LM's table, sections, claim and figure from the run directories."""
  rows = rows_for(workdir, tier, seeds)
  ratio = sweep_config.rows()[sweep_config.F4_ROW]["ratio"]
  every = sweep_config.rows()[sweep_config.F4_ROW]["every"]
  return Report(
      name=common.page_name("f4_lm", tier),
      title=(f"F4-LM: what makes a block of the pseudo-gradient worth sending: TASC in "
             f"SparseLoCo's form at {sweep_config.F4_TIER}, stdlib language model ({tier} tier)"),
      columns=[("method", "row"), ("score", "score"), ("block", "block"),
               ("support", "support"), ("val_loss", "val loss nats/token (mean ± std)"),
               ("loss_ci95", "95% CI ±"), ("vs_default", "vs default"),
               ("retention_text", "retention (vs solo)"), ("seeds", "seeds"),
               ("tokens_per_param", "tokens/parameter"),
               ("per_worker_tokens", "tokens/worker/step"),
               ("compression_ratio", "x fewer total bytes (HLO)"), ("settings", "settings"),
               ("status", "status"), ("run_dirs", "run directories")],
      rows=rows, claims=claims(rows), sections=sections(rows),
      configs=[f"configs/paper/t1_lm.py:tier={tier},subset=f4", "configs/paper/lm.py"],
      notes=[t1_lm.recipe_note(tier),
             f"F4-LM's runs: SparseLoCo's local updates synchronising every {every} steps, its pseudo-gradient "
             f"compressed by TASC (float16 on the wire), every variant solved to "
             f"{ratio:g}x fewer total bytes than dense ({ratio / every:.3g}x a "
             "synchronisation): a smaller block spends more bytes on scores (one per block) and "
             "fewer on payload. Every run is at rate scale 1 (no tuning per variant); the "
             f"default row is T1-LM's `{sweep_config.F4_ROW}` and per-element top-k is "
             f"T1-LM's `{TOPK}` (SparseLoCo), each at rate scale 1 (their tuning runs, and any "
             "further seeds T1-LM ran there). Not run: block size "
             f"{', '.join(str(b) for b in sweep_config.UNMET_BLOCKS)} "
             "(configs/paper/t1_lm.py: its scores alone cannot meet the tier).",
             "Support: `global` (this round's) ranks blocks by this round's scores summed over "
             "workers (one extra all-reduce of the scores, counted in the bytes); `previous` "
             "(the last round's) sends the blocks the last round's scores chose, and this "
             "round's scores ride with the payload.",
             "95% CI: Student's t over seeds (half-width); a row with one seed has none and "
             "resolves no comparison. `vs default`: the row's mean minus the default's.",
             "Retention: the share of communication's benefit a row keeps, "
             "(L_solo - L_row) / (L_solo - L_dense), against T1-LM's dense and solo (one worker "
             "alone on its share of the batch) at their chosen rate scales, with a 95% interval "
             "over seeds (experiments/reproduce/stats.py); negative: worse than not "
             "communicating at all. Blank where dense or solo has not run (the GPU tier).",
             *block_notes(rows),
             *[f"Derivation, {d}" for d in DERIVATIONS],
             *t1_lm.provenance_notes(workdir, tier)],
      plot=plot_variants(rows, tier))
