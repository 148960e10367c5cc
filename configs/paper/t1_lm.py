"""The language-model sweeps: T1-LM (every method at equal-bytes tiers) and F4-LM (what makes a
block worth sending), runs of ``configs/paper/lm.py`` in one folder per tier.

  python -m experiments.sweep --config=configs/paper/t1_lm.py:tier=cpu --workdir=runs/paper/lm_cpu

(or ``python -m experiments.reproduce --target=t1_lm,f4_lm,f5 --tier=cpu``, which also writes the
tables; F5 plots T1-LM's runs). Run ``<row>_s<seed>`` works in ``workdir/<row>_s<seed>``.

Rows (:func:`rows`): ``dense``, ``fp16`` and ``onebit`` (fixed bytes), then ``<method>_<tier>``
for the methods with a budget (top-k and random-k with error feedback, DGC, PowerSGD, TASC with
its default scores) at each tier of :data:`compressors.equal_bytes.TIERS`. F4-LM's rows
(:func:`f4_rows`) are TASC at the headline tier (:data:`HEADLINE`, 100x) with each block score
(``magnitude`` ``||a||^2``, ``saliency`` ``h ||a||^2``, the default, ``newton`` ``||a||^2 / h``,
``fisher``), each block size of :data:`BLOCK_SIZES` where the tier can be met, and this step's or
the last step's support, beside per-element top-k (``topk_100x``, T1-LM's row).

Grids (:func:`grid`), every run with the same recipe and steps:

* ``gpu``: every row above, 3 seeds, at 8 and at 32 workers.
* ``cpu``: what fits the issue's 90 minutes a target on 2 CPU cores with ``--jobs=2`` at 1,000
  steps a run: 3 seeds for the rows that answer the headline (dense, top-k and TASC at
  100x) and F4-LM's scores (magnitude, saliency, Newton, Fisher at block 256), one seed for the
  other methods at 100x, top-k and TASC at 30x, 300x and 1000x, and the rest of F4-LM: every
  score at blocks 64 and 1024 (the scores x block sizes product at this step's support) and
  the last step's support at the default score and block; block 16 cannot meet 100x (its
  65,536 scores alone cost 2x the tier's bytes). 8 workers (32 only in the bytes the solver
  reports).

Arguments: ``tier`` (cpu/gpu), ``seeds`` (default 3), ``subset`` (``t1``, ``f4`` or ``all``).
"""

import ml_collections

from compressors import equal_bytes
from configs import common

CONFIG = "configs/paper/lm.py"
HEADLINE = "100x"
FIXED = ("dense", "fp16", "onebit")
BUDGETED = ("topk", "randomk", "dgc", "powersgd", "tasc")
BLOCK_SIZES = (16, 64, 256, 1024)
# Block sizes that cannot meet the headline tier on either tier's model: block 16's scores alone
# cost 2x its bytes. Data, not a solve (a config does not trace the model);
# tests/test_reproduce_lm.py checks it against the solver.
UNMET_BLOCKS = (16,)
SCORES = {  # F4-LM's score name -> TASC's settings
    "magnitude": dict(sensitivity="none"),
    "saliency": dict(sensitivity="hutchinson", score="saliency"),
    "newton": dict(sensitivity="hutchinson", score="newton"),
    "fisher": dict(sensitivity="fisher"),
}
SUPPORTS = ("global", "previous")
WORKERS = {"cpu": (8,), "gpu": (8, 32)}
# T1-LM's rows that the CPU tier runs with 3 seeds (its other rows run one): the headline's.
CPU_HEADLINE_ROWS = ("dense", f"topk_{HEADLINE}", f"tasc_{HEADLINE}")


def rows() -> dict[str, dict]:
  """T1-LM's rows, label -> ``configs/paper/lm.py`` arguments."""
  table = {m: dict(method=m) for m in FIXED}
  for tier, ratio in equal_bytes.TIERS.items():
    table.update({f"{m}_{tier}": dict(method=m, ratio=ratio) for m in BUDGETED})
  return table


def f4_label(score: str, block: int, support: str) -> str:
  return f"tasc_{HEADLINE}_{score}_b{block}_{support}"


def f4_rows() -> dict[str, dict]:
  """F4-LM's TASC rows (every score x block size x support), label -> arguments; :func:`grid`
  skips those of :data:`UNMET_BLOCKS`."""
  return {f4_label(score, block, support): dict(method="tasc", ratio=equal_bytes.TIERS[HEADLINE],
                                                block=block, support=support, **settings)
          for score, settings in SCORES.items() for block in BLOCK_SIZES
          for support in SUPPORTS}


def grid(tier: str, subset: str = "all") -> dict[str, int]:
  """Row label -> seeds to run, for ``tier`` (see the module docstring)."""
  if tier not in WORKERS:
    raise ValueError(f"configs/paper/t1_lm.py: tier={tier!r}; allowed: {sorted(WORKERS)}")
  if subset not in ("t1", "f4", "all"):
    raise ValueError(f"configs/paper/t1_lm.py: subset={subset!r}; allowed: t1, f4, all")
  chosen = {}
  if subset in ("t1", "all"):
    for label, r in rows().items():
      if tier == "gpu" or label in CPU_HEADLINE_ROWS:
        chosen[label] = 3
      elif "ratio" not in r or label.endswith(f"_{HEADLINE}") or r["method"] in ("topk", "tasc"):
        chosen[label] = 1
  if subset in ("f4", "all"):
    default = ("saliency", 256, "global")
    for label, r in f4_rows().items():
      key = (label.split("_")[2], r["block"], r["support"])
      if key == default:
        continue  # T1-LM's tasc_100x runs these settings
      # The CPU tier runs the scores x block sizes at this step's support, and the last
      # step's support at the default score and block only.
      if ((tier == "gpu" or key[2] == default[2] or key[:2] == default[:2])
          and r["block"] not in UNMET_BLOCKS):
        # On the CPU tier the scores get 3 seeds at block 256, everything else one.
        chosen[label] = 3 if tier == "gpu" or key[1:] == default[1:] else 1
    chosen[f"topk_{HEADLINE}"] = 3
  return chosen


def run_name(label: str, seed: int, workers: int = 8) -> str:
  """A run's directory name: ``<row>_s<seed>``, with ``_w<workers>`` beyond 8 workers."""
  return f"{label}_s{seed}" + (f"_w{workers}" if workers != 8 else "")


def config_arg(label: str, tier: str, seed: int, workers: int) -> str:
  settings = {**rows(), **f4_rows()}[label]
  return ",".join(f"{k}={v}" for k, v in {**settings, "tier": tier, "seed": seed,
                                          "workers": workers}.items())


def get_config(arg=None):
  args = common.parse_args(arg, tier="cpu", seeds=3, subset="all")
  if args["seeds"] < 1:
    raise ValueError(f"configs/paper/t1_lm.py: seeds={args['seeds']}; allowed: >= 1")
  chosen = grid(args["tier"], args["subset"])
  c = ml_collections.ConfigDict()
  # Seed-major, so that every row has a first seed before any has a third.
  c.runs = [{"name": run_name(label, seed, workers),
             "config": f"{CONFIG}:{config_arg(label, args['tier'], seed, workers)}"}
            for workers in WORKERS[args["tier"]] for seed in range(args["seeds"])
            for label, seeds in chosen.items() if seed < seeds]
  c.overrides = {}
  return c
