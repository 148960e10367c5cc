"""F4-LM: what makes a block worth sending, at a fixed byte tier (100x), on the language model.

TASC with each block score (magnitude, saliency ``h ||a||^2``, Newton decrement ``||a||^2 / h``,
Fisher), each block size that can meet the tier, and this step's or the last step's support,
beside per-element top-k with error feedback: ``configs/paper/t1_lm.py:subset=f4``'s runs, in
T1-LM's folder (the default TASC row and top-k are T1-LM's runs). Each score's two-line
derivation is in :mod:`tasc._scores` and in the report's notes.
"""

import math

import numpy as np

from configs.paper import t1_lm as sweep_config
from experiments.reproduce import common
from experiments.reproduce import plots
from experiments.reproduce import t1_lm
from experiments.reproduce.report import Claim
from experiments.reproduce.report import Report

TITLE = "F4-LM: TASC block scores x block sizes x supports at 100x, language model"
DEFAULT = ("saliency", 256, "global")  # TASC's default score, the solver's block, this step's
DERIVATIONS = [
    "magnitude `||a_b||^2`: sending block b with a step -lr a_b lowers the loss to first order by "
    "g_b . lr a_b = lr ||a_b||^2; a plain gradient step's gain, curvature unseen.",
    "saliency `h_b ||a_b||^2` (default): holding the block back displaces the parameters by "
    "lr a_b, which costs the quadratic term 1/2 (lr a_b)^T H_bb (lr a_b) = lr^2/2 h_b ||a_b||^2 "
    "(Optimal Brain Damage; HAWQ-v2).",
    "Newton decrement `||a_b||^2 / h_b`: the quadratic model g.d + 1/2 d^T H d falls by "
    "1/2 g^T H^-1 g = 1/2 ||a_b||^2 / h_b at its minimum d = -H^-1 g; the gain of a "
    "curvature-scaled (Adam-like) step on the block.",
    "Fisher `F_b ||a_b||^2`: near a minimum of the log-likelihood H ~ E[g g^T], whose diagonal "
    "E[g_i^2] the worker's own squared gradients estimate; saliency with curvature for free.",
]


def produce(options: common.Options) -> Report:
  """Runs F4-LM's runs (unless ``report_only``); its table, curves and claim."""
  t1_lm.run_subset(options, "f4")
  return report(t1_lm.runs_dir(options), tier=options.tier, seeds=options.seeds)


def variant_label(score: str, block: int, support: str) -> str:
  """The run label of a variant (the default one is T1-LM's ``tasc_100x``)."""
  if (score, block, support) == DEFAULT:
    return f"tasc_{sweep_config.HEADLINE}"
  return sweep_config.f4_label(score, block, support)


def variants(tier: str) -> list[tuple[str, tuple]]:
  """``(label, (score, block, support))`` of every TASC variant the tier's grid runs, the
  default first."""
  chosen = sweep_config.grid(tier, "f4")
  out = [(variant_label(*DEFAULT), DEFAULT)]
  for score in sweep_config.SCORES:
    for block in sweep_config.BLOCK_SIZES:
      for support in sweep_config.SUPPORTS:
        label = sweep_config.f4_label(score, block, support)
        if label in chosen:
          out.append((label, (score, block, support)))
  return out


def curves(workdir: str, label: str, seeds: int) -> tuple[np.ndarray, np.ndarray] | None:
  """``(steps, training loss [seeds, steps])`` of a row's runs, None if none finished."""
  series = [r.series("loss") for r in t1_lm.label_runs(workdir, label, seeds)]
  if not series:
    return None
  steps = series[0][0]
  return steps, np.stack([v[:len(steps)] for _, v in series if len(v) >= len(steps)])


def report(workdir: str, *, tier: str, seeds: int) -> Report:
  """F4-LM's table, curves and claim from the run directories."""
  chosen = variants(tier)
  topk = f"topk_{sweep_config.HEADLINE}"
  labels = [label for label, _ in chosen] + [topk]
  rows = t1_lm.rows_for(workdir, labels, seeds)
  factors = dict(chosen)
  for row in rows:
    score, block, support = factors.get(row["method"], ("per-element top-k", 1, "per worker"))
    row.update(score=score, block=block, support=support)
  drawn = {label: c for label in labels if (c := curves(workdir, label, seeds)) is not None}

  def plot(fig):
    ax = fig.add_axes([0.08, 0.1, 0.58, 0.82])
    for label, (steps, values) in drawn.items():
      row = next(r for r in rows if r["method"] == label)
      name = (f"{row['score']}, b{row['block']}, {row['support']}" if label != topk
              else "top-k per element")
      line, = ax.plot(steps, values.mean(axis=0), label=f"{name} ({values.shape[0]} seeds)",
                      lw=2.2 if label in (topk, variant_label(*DEFAULT)) else 1.2)
      if values.shape[0] > 1:
        ax.fill_between(steps, values.min(axis=0), values.max(axis=0), alpha=0.12,
                        color=line.get_color())
    plots.decorate(ax, xlabel="step",
                   ylabel="training loss, nats/token (mean; band: min-max over seeds)",
                   title=f"F4-LM ({tier} tier): TASC variants at {sweep_config.HEADLINE}, "
                         "error feedback", title_size=11)
    plots.legend_beside(ax)

  return Report(
      name="f4_lm",
      title=f"F4-LM: what makes a block worth sending, at {sweep_config.HEADLINE}, stdlib "
            f"language model ({tier} tier)",
      columns=[("score", "score"), ("block", "block"), ("support", "support"),
               ("val_loss", "val loss nats/token (mean ± std)"), ("loss_ci95", "95% CI ±"),
               ("compression_ratio", "wire compression (x, HLO)"), ("settings", "settings"),
               ("status", "status"), ("run_dirs", "run directories")],
      rows=rows, claims=claims(rows, topk), sections=[("Conclusion", conclusion(rows, topk))],
      configs=[f"configs/paper/t1_lm.py:tier={tier},subset=f4", "configs/paper/lm.py"],
      notes=[t1_lm.recipe_note(tier),
             "Every variant is solved to the same bytes (100x below dense, float16 on the wire): "
             "a smaller block spends more bytes on scores (one per block) and fewer on payload; "
             "block 16 cannot meet 100x (its scores alone cost about 2x the tier's bytes). On "
             "the CPU tier the grid is the scores x block sizes at this step's support (3 seeds "
             "at block 256, one at 64 and 1024) and the last step's support at the default "
             "(saliency, block 256, one seed); the GPU tier's grid is the full product, 3 seeds "
             "each.",
             "Support: `global` ranks blocks by this step's scores, summed over workers (one "
             "extra all-reduce of the scores, counted in the bytes); `previous` sends the blocks "
             "last step's scores chose, and this step's scores ride with the payload.",
             *[f"Derivation, {d}" for d in DERIVATIONS],
             *t1_lm.provenance_notes(workdir, tier)],
      plot=plot)


def claims(rows: list[dict], topk: str) -> list[Claim]:
  """Which score is best, and whether Hessian-aware beats magnitude, with 95% intervals."""
  done = [r for r in rows if r["seeds"] and r["method"] != topk]
  at_default = [r for r in done if (r["block"], r["support"]) == DEFAULT[1:]]
  by_score = {r["score"]: r for r in at_default}
  if not at_default:
    return [Claim("Hessian-aware block selection trains better than magnitude selection at "
                  "equal bytes", "TASC (Dong, Keutzer et al., unverified); HAWQ-v2",
                  "not run", None)]
  best = min(at_default, key=lambda r: r["loss_mean"])
  magnitude = by_score.get("magnitude")
  hessian = [r for r in at_default if r["score"] in ("saliency", "newton", "fisher")]
  text = "; ".join(f"{r['score']} {r['val_loss']}" for r in at_default)
  reproduced = None
  if magnitude and hessian:
    best_hessian = min(hessian, key=lambda r: r["loss_mean"])
    margin = (best_hessian.get("loss_ci95") or 0) + (magnitude.get("loss_ci95") or 0)
    reproduced = best_hessian["loss_mean"] < magnitude["loss_mean"] - margin
  overall = min(done, key=lambda r: r["loss_mean"])
  return [Claim(
      "Hessian-aware block selection trains better than magnitude selection at equal bytes",
      "TASC (Dong, Keutzer et al., unverified); HAWQ-v2 sensitivity",
      f"block 256, this step's support: {text}; lowest: {best['score']}; lowest of all "
      f"variants: {overall['score']}, b{overall['block']}, {overall['support']} "
      f"({overall['val_loss']})", reproduced,
      "yes only if a Hessian-aware score's mean is below magnitude's by more than both 95% "
      "half-widths together")]


def conclusion(rows: list[dict], topk: str) -> str:
  """Which variant had the lowest loss and whether it beats TASC's default beyond the seeds'
  95% intervals (the default changes only if one does)."""
  done = [r for r in rows if r["seeds"] and r["method"] != topk]
  default = next((r for r in done if (r["score"], r["block"], r["support"]) == DEFAULT), None)
  if not done or default is None:
    return "Not enough runs finished to conclude."
  best = min(done, key=lambda r: r["loss_mean"])
  margin = (best.get("loss_ci95") or math.inf) + (default.get("loss_ci95") or math.inf)
  wins = best is not default and best["loss_mean"] < default["loss_mean"] - margin
  return (f"Lowest validation loss: {best['score']}, block {best['block']}, {best['support']} "
          f"support ({best['val_loss']}); the default (saliency, block 256, this step's support) "
          f"{default['val_loss']}. "
          + ("It beats the default beyond both 95% intervals." if wins else
             "No variant beats the default beyond both 95% intervals, so the default stays; "
             "every variant is selectable (tasc's `sensitivity`, `score`, `block_size`, "
             "`support`)."))
