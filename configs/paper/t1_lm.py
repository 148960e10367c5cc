"""The language-model sweeps: T1-LM (every family at equal total bytes) and F4-LM (what makes a
block of a pseudo-gradient worth sending), runs of ``configs/paper/lm.py`` in one folder per tier.

  python -m experiments.reproduce --target=t1_lm,f4_lm,f5 --tier=cpu

(the reproduction runs the two phases below and writes the tables; this config lists one phase's
runs: ``python -m experiments.sweep --config=configs/paper/t1_lm.py:tier=cpu``). Run
``<row>_lr<scale>_s<seed>`` works in ``workdir/<run>``.

Rows (:func:`rows`): ``dense``, ``fp16`` and ``onebit_adam``, whose bytes are fixed, then for each
tier of :data:`compressors.equal_bytes.TIERS` (30x-1000x fewer bytes than dense *over the whole
run*: a local-update method is charged its synchronisations' bytes, every step's share of them)
``<row>_<tier>`` for :data:`TIERED`: per-step top-k, TASC and DGC with the optimizer before the
exchange (``topk``) and after it on each worker (``topk_update``); PowerSGD; DiLoCo with float32,
int8 and int4 pseudo-gradients (``every`` solved to meet the tier); DiLoCo with top-k in
SparseLoCo's form (``sparseloco``) and with TASC at block 256, with DiLoCo's outer momentum
(``diloco_tasc``) and in SparseLoCo's form (``sparseloco_tasc``), all synchronising every 30
steps with the exchange solved at the tier over 30; DeMo.

The tuning budget, the same for every row: the rate :func:`configs.paper.lm.scale_tuned_rate`
scales (AdamW's peak rate; a local-update method's outer rate) at each of :data:`LR_SCALES`, one
seed, and past an end of them while that end wins (:data:`LR_LADDER`); the reproduction keeps the
scale with the lowest training loss (the mean over the last tenth of training's logged losses;
never a validation loss) and runs that setting's other seeds
for the headline rows (dense, and the best row of each family at :data:`HEADLINE_TIERS`), which
it passes to this config as ``chosen``.

F4-LM (:func:`f4_rows`): TASC on the pseudo-gradient (``sparseloco_tasc`` at :data:`F4_TIER`)
with each block score (``magnitude`` ``||a||^2``, ``saliency`` ``h ||a||^2``, the default,
``newton`` ``||a||^2 / h``, ``fisher``) at each block size of :data:`BLOCK_SIZES`, and this
round's or the last round's support, at the row's configured rates.

Grids (:func:`grid`):

* ``gpu``: dense, solo (retention's two ends, at rate scale 1) and :data:`GPU_ROWS` (the CPU
  tier's best three at 100x and its best row and TASC's best at 1000x, at its chosen rate
  scales), one seed, 8 workers: about 14 minutes of one GPU.
* ``cpu``: what 2 CPU cores run in a few hours with ``--jobs=2``: dense and :data:`CPU_ROWS` at
  their tiers over the rate scales, then the headline rows' seeds 1 and 2; F4-LM's scores x
  block sizes at this round's support and the last round's at the default (one seed; three at
  block 256). 8 workers (32 only in the bytes the solver reports).
* ``full``: every row at every tier over the rate scales, 8 and 32 workers.

Arguments: ``tier`` (cpu/gpu/full: the grid; ``full`` runs the CPU tier's model), ``seeds``
(default 3), ``subset`` (``t1``, ``f4`` or ``all``), ``chosen`` (``row@scale`` joined by ``+``:
the headline rows and their chosen scales, whose other seeds run, or with ``seeds=1`` the tuning's
scales past the grid; '': the tuning phase only).
"""

import math

import ml_collections

from compressors import equal_bytes
from compressors import registry
from configs import common

CONFIG = "configs/paper/lm.py"
HEADLINE = "100x"
HEADLINE_TIERS = ("100x", "1000x")
LR_SCALES = (0.5, 1.0, 2.0)  # every row's tuning starts here
# Where an end of the scales run wins, the best rate may lie beyond it: the tuning goes on past
# that end a factor of 2 at a time (one seed a scale, the same rule for every row) until an inner
# scale wins, the end ties its neighbour, or the next scale would leave the ladder
# (experiments.reproduce.t1_lm.next_scale). At 1,000 steps on the CPU tier 34 of 46 rows, dense
# among them, had chosen an end of LR_SCALES.
LR_LADDER = (0.125, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
# Solo: one worker alone on its share of each step's batch (configs/paper/lm.py), the loss with
# no communication at all, from which retention is counted.
FIXED = {"dense": dict(method="dense"), "solo": dict(method="dense", solo=True),
         "fp16": dict(method="fp16"), "onebit_adam": dict(method="onebit_adam")}
REFERENCES = ("dense", "solo")  # retention's two ends, three seeds each
# Row stem -> configs/paper/lm.py arguments; each runs at every tier as <stem>_<tier>.
TIERED = {
    "topk": dict(method="topk"),
    "topk_update": dict(method="topk", exchanged="update"),
    "tasc": dict(method="tasc"),
    "tasc_update": dict(method="tasc", exchanged="update"),
    "dgc": dict(method="dgc"),
    "dgc_update": dict(method="dgc", exchanged="update"),
    "powersgd": dict(method="powersgd"),
    "diloco": dict(method="diloco"),
    "diloco_int8": dict(method="diloco", carrier="int8"),
    "diloco_int4": dict(method="diloco", carrier="int4"),
    "sparseloco": dict(method="sparseloco", every=30),
    # Block 256 at every tier, F4-LM's default (the solver would take 16 at 100x, 128 at 1000x).
    "diloco_tasc": dict(method="diloco", carrier="tasc", every=30, block=256),
    # TASC in SparseLoCo's form: error decay 0.95 in place of outer momentum.
    "sparseloco_tasc": dict(method="sparseloco", carrier="tasc", every=30, block=256),
    "demo": dict(method="demo"),
    # Streaming DiLoCo's defaults: 4 fragments, each landing a step late, mixed half and half.
    "streaming_diloco": dict(method="streaming_diloco"),
}
# Rows whose budget is a method with a budget (top-k, TASC, ...), the others' bytes are fixed
# per step; tests/test_equal_bytes.py compiles each at every tier.
BUDGETED = ("topk", "randomk", "dgc", "powersgd", "tasc")
# The CPU tier's rows, by tier: every row at 100x but PowerSGD (its rank 1 sends 1/34 of dense on
# the CPU tier's 0.24M parameters: no rank meets 100x) and TASC in SparseLoCo's form (F4-LM's row,
# at 1000x: at 100x its 30-step rounds send half of the blocks), and at 1000x each family's rows that the
# previous CPU comparison (benchmarks/results/lm_cpu_families) left within 1 nat of the best (at
# 1000x on 1.7 kB a step, per-step TASC cannot send one block, DeMo's 64-wide tiles reach 381x at
# one coefficient each, and float32 DiLoCo would synchronise once in 1,000 steps); with them the
# rows of fixed bytes (:data:`FIXED`). The 30x and 300x tiers are left to ``full``.
CPU_ROWS = {
    "100x": ("topk", "topk_update", "tasc", "tasc_update", "dgc", "dgc_update", "diloco",
             "diloco_int8", "diloco_int4", "sparseloco", "diloco_tasc", "demo",
             "streaming_diloco"),
    "1000x": ("topk_update", "diloco_int4", "sparseloco", "diloco_tasc", "sparseloco_tasc"),
}
# The GPU tier's rows (dense runs too) and their rate scales, by the CPU tier's training loss (the
# tuning criterion; paper_figures/t1_lm.md's `train loss by lr scale`) at its chosen scales: the
# best three at 100x (4.328, 4.405, 4.445; SparseLoCo's 4.457 next), then at 1000x the best row
# (4.303) and TASC's best (5.363), so that the GPU tier answers both headline tiers.
GPU_ROWS = {"diloco_100x": 1.0, "topk_update_100x": 2.0, "diloco_tasc_100x": 0.5,
            "diloco_int4_1000x": 1.0, "sparseloco_tasc_1000x": 0.5}
BLOCK_SIZES = (16, 64, 256, 1024)
# Block sizes that cannot meet the headline tier on either tier's model: block 16's scores alone
# cost more than its bytes. Data, not a solve (a config does not trace the model);
# tests/test_reproduce_lm.py checks it against the solver.
UNMET_BLOCKS = (16,)
SCORES = {  # F4-LM's score name -> TASC's settings
    "magnitude": dict(sensitivity="none"),
    "saliency": dict(sensitivity="hutchinson", score="saliency"),
    "newton": dict(sensitivity="hutchinson", score="newton"),
    "fisher": dict(sensitivity="fisher"),
}
SUPPORTS = ("global", "previous")
F4_DEFAULT = ("saliency", 256, "global")
# TASC on the pseudo-gradient at 1000x (33x a synchronisation; at 100x its 30-step rounds send
# half of the blocks, where scores barely choose), in SparseLoCo's form: with DiLoCo's outer
# Nesterov momentum and plain error feedback it diverged there (paper_figures/t1_lm.md).
F4_TIER = "1000x"
F4_ROW = f"sparseloco_tasc_{F4_TIER}"
WORKERS = {"cpu": (8,), "gpu": (8,), "full": (8, 32)}


def family(label: str) -> str:
  """A row's family: ``exchange`` (per-step compression), ``optimizer`` (a method that is its own
  optimizer: DeMo, 1-bit Adam) or ``local`` (local updates: DiLoCo, SparseLoCo, Streaming
  DiLoCo), as the registry declares them; dense's is ``dense`` and solo's ``solo``."""
  if label in REFERENCES:
    return label
  method = {**rows(), **f4_rows()}[label]["method"]
  if method == "tasc":  # registered by its own package, which configs do not import
    return "exchange"
  return {"per_step": "exchange"}.get(registry.get(method).family, registry.get(method).family)


def tier_of(label: str) -> str | None:
  """The equal-bytes tier of a row (``100x``, ...), None for a row of fixed bytes."""
  tail = label.split("_")
  matches = [t for t in tail if t in equal_bytes.TIERS]
  return matches[0] if matches else None


def rows() -> dict[str, dict]:
  """T1-LM's rows, label -> ``configs/paper/lm.py`` arguments."""
  table = dict(FIXED)
  for tier, ratio in equal_bytes.TIERS.items():
    table.update({f"{stem}_{tier}": dict(args, ratio=ratio) for stem, args in TIERED.items()})
  return table


def f4_label(score: str, block: int, support: str) -> str:
  return f"{F4_ROW}_{score}_b{block}_{support}"


def f4_rows() -> dict[str, dict]:
  """F4-LM's rows (every score x block size x support of TASC on the pseudo-gradient), label ->
  arguments; :func:`grid` skips those of :data:`UNMET_BLOCKS`."""
  base = rows()[F4_ROW]
  return {f4_label(score, block, support): dict(base, block=block, support=support, **settings)
          for score, settings in SCORES.items() for block in BLOCK_SIZES
          for support in SUPPORTS}


def tuning_rows(tier: str) -> list[str]:
  """The rows whose rate scales the tuning phase runs on ``tier``'s grid."""
  if tier == "gpu":
    return ["dense", "solo"]
  if tier == "cpu":  # dense, the tiers' rows, then the other rows of fixed bytes
    return (["dense"] + [f"{stem}_{t}" for t, stems in CPU_ROWS.items() for stem in stems]
            + [label for label in FIXED if label != "dense"])
  return list(rows())


def f4_grid(tier: str) -> dict[str, int]:
  """F4-LM's row label -> seeds (at the row's rate scale 1): the default variant is T1-LM's
  :data:`F4_ROW` (its seed 0 is a tuning run)."""
  chosen = {F4_ROW: 3}
  for label, r in f4_rows().items():
    key = (label.split("_")[3], r["block"], r["support"])
    if r["block"] in UNMET_BLOCKS or key == F4_DEFAULT:
      continue  # F4_ROW's settings
    if tier == "full" or key[2] == F4_DEFAULT[2] or key[:2] == F4_DEFAULT[:2]:
      chosen[label] = 3 if tier == "full" or key[1:] == F4_DEFAULT[1:] else 1
  return chosen


def parse_chosen(text: str, labels=None, *, where: str = "configs/paper/t1_lm.py",
                 noun: str = "a row", ladder: bool = True) -> dict[str, float]:
  """``row@scale+row@scale`` -> {row: scale}, each row one of ``labels`` (T1-LM's rows by
  default) and each scale one of :data:`LR_LADDER` (``ladder=False``: any finite scale > 0, as a
  rate law gives); ``where`` and ``noun`` name the config and what a row is in its refusals."""
  labels = rows() if labels is None else labels
  chosen = {}
  for item in filter(None, text.split("+")):
    label, _, scale = item.partition("@")
    if label not in labels:
      raise ValueError(f"{where}: chosen={text!r}: {label!r} is not {noun}")
    try:
      value = float(scale)
    except ValueError:
      value = math.nan
    if ladder and value not in LR_LADDER:
      raise ValueError(f"{where}: chosen={text!r}: scale {scale!r} of {label!r}; "
                       f"allowed: one of {LR_LADDER}")
    if not (math.isfinite(value) and value > 0):
      raise ValueError(f"{where}: chosen={text!r}: scale {scale!r} of {label!r}; "
                       "allowed: a number > 0")
    chosen[label] = value
  return chosen


def grid(tier: str, subset: str = "all", chosen: str = "") -> list[tuple[str, float, int]]:
  """``(row, rate scale, seeds)`` to run on ``tier`` (see the module docstring), in order."""
  if tier not in WORKERS:
    raise ValueError(f"configs/paper/t1_lm.py: tier={tier!r}; allowed: {sorted(WORKERS)}")
  if subset not in ("t1", "f4", "all"):
    raise ValueError(f"configs/paper/t1_lm.py: subset={subset!r}; allowed: t1, f4, all")
  runs = []
  if subset in ("t1", "all"):
    scales = (1.0,) if tier == "gpu" else LR_SCALES
    runs += [(label, scale, 1) for label in tuning_rows(tier) for scale in scales]
    if tier == "gpu":
      runs += [(label, scale, 1) for label, scale in GPU_ROWS.items()]
      # The GPU tier runs one seed of each row at a given scale: nothing to choose.
    else:
      runs += [(label, scale, 3) for label, scale in parse_chosen(chosen).items()]
  if subset in ("f4", "all") and tier != "gpu":
    runs += [(label, 1.0, seeds) for label, seeds in f4_grid(tier).items()]
  return runs


def given_scale(tier: str, label: str) -> float | None:
  """The rate scale a tier gives a row without tuning it (the GPU tier: :data:`GPU_ROWS`', dense's
  and solo's 1); None where the tuning budget chooses."""
  if tier != "gpu":
    return None
  return GPU_ROWS.get(label, 1.0 if label in REFERENCES else None)


def run_name(label: str, scale: float, seed: int, workers: int = 8) -> str:
  """A run's directory name: ``<row>_lr<scale>_s<seed>``, with ``_w<workers>`` beyond 8."""
  return f"{label}_lr{scale:g}_s{seed}" + (f"_w{workers}" if workers != 8 else "")


def config_arg(label: str, tier: str, scale: float, seed: int, workers: int) -> str:
  settings = {**rows(), **f4_rows()}[label]
  model_tier = "cpu" if tier == "full" else tier
  return ",".join(f"{k}={v}" for k, v in {**settings, "tier": model_tier, "lr_scale": scale,
                                          "seed": seed, "workers": workers}.items())


def get_config(arg=None):
  args = common.parse_args(arg, tier="cpu", seeds=3, subset="all", chosen="")
  if args["seeds"] < 1:
    raise ValueError(f"configs/paper/t1_lm.py: seeds={args['seeds']}; allowed: >= 1")
  runs = grid(args["tier"], args["subset"], args["chosen"])
  c = ml_collections.ConfigDict()
  # Seed-major, so that every row has a first seed before any has a third; a run listed twice
  # (a tuning run that is also a chosen row's seed 0) once.
  names = {}
  for workers in WORKERS[args["tier"]]:
    for seed in range(args["seeds"]):
      for label, scale, seeds in runs:
        if seed < seeds:
          names.setdefault(run_name(label, scale, seed, workers),
                           config_arg(label, args["tier"], scale, seed, workers))
  c.runs = [{"name": name, "config": f"{CONFIG}:{arg}"} for name, arg in names.items()]
  c.overrides = {}
  return c
