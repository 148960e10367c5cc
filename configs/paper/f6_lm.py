"""F6-LM, the frontier: how much of communication's benefit each family keeps from 2x to 1000x
fewer total bytes, runs of ``configs/paper/lm.py`` in T1-LM's folder (``<workdir>/lm_<tier>``).

  python -m experiments.reproduce --target=f6_lm --tier=cpu

Each family of :data:`CURVES` runs at each of its ratios (:data:`RATIOS` and, where the knee
needs them, :data:`KNEE_RATIOS`; only where the method meets the ratio within 10%:
``tests/test_reproduce_frontier.py`` checks every point against the solver; the methods of fixed
bytes, :data:`FIXED_POINTS`, are one point each) with the tuning budget
T1-LM gives every row: the rate scale at each of ``configs.paper.t1_lm.LR_SCALES``, one seed, and
past an end of them while that end wins (``LR_LADDER``; the reproduction passes those scales as
``chosen`` with ``seeds=1``), the lowest training loss kept; the points that decide a family's
90% crossing then run seeds 1 and 2 (``chosen``). Beside them ``dense`` and ``solo`` (one worker
alone on its share of each step's batch: the loss with no communication at all), three seeds
each. A point's label is ``<family>_<ratio>x``, the same run as T1-LM's row of that label (the
same arguments: ``tests/test_reproduce_frontier.py`` checks it), so the two targets share their
runs.

Arguments: ``tier`` (cpu; the GPU tier has no frontier), ``seeds`` (3), ``families`` (the
families to run, joined by ``+``; '': all), ``chosen`` (``row@scale`` joined by ``+``: the points
whose seeds 1 and 2 run), ``tuning`` (whether the tuning phase's runs are listed, 1/0).
"""

import ml_collections

from configs import common
from configs.paper import lm
from configs.paper import t1_lm

CONFIG = lm.__name__.replace(".", "/") + ".py"
RATIOS = (2, 8, 30, 100, 1000)
KNEE_RATIOS = (4, 16, 316)
# Family -> (configs/paper/lm.py arguments, its ratios). The ratios are those the method meets
# within 10% on the CPU tier (DeMo's 64-wide tiles stop at 100x: 316x would need under one
# coefficient a tile; int8 DiLoCo sends a quarter of dense at its most frequent, so starts at 4x).
CURVES = {
    "topk": (dict(method="topk"), RATIOS),
    "topk_update": (dict(method="topk", exchanged="update"), RATIOS),
    "diloco": (dict(method="diloco"), RATIOS),
    # DiLoCo's outer Nesterov momentum (0.9) at rate 0.35-1.4 overshoots when rounds are short:
    # without it, outer rate 1 is plain model averaging (local SGD), the rate a short round wants.
    "diloco_avg": (dict(method="diloco", outer_momentum=0.0), RATIOS),
    "diloco_int8": (dict(method="diloco", carrier="int8"), (4, 8, 30, 100, 1000)),
    # int4 sends an eighth of dense at its most frequent: it starts at 8x.
    "diloco_int4": (dict(method="diloco", carrier="int4"), (8, 30, 100, 1000)),
    # Streaming DiLoCo (4 fragments, each landing a step late, mixed half and half): a round
    # sends the model once, so H = the ratio, and H >= 4 fragments: it starts at 4x.
    "streaming_diloco": (dict(method="streaming_diloco"), (4, 8, 30, 100, 1000)),
    "demo": (dict(method="demo"), (2, 4, 8, 30, 100)),
    # SparseLoCo as published (2-bit chunked top-k, error decay 0.95) at the paper's shortest
    # round, H = 15: a round cannot send less than a full 2-bit top-k, so it starts at 16x.
    "sparseloco_h15": (dict(method="sparseloco", every=15), (16, 30, 100, 316, 1000)),
    # TASC on the pseudo-gradient in SparseLoCo's form (F4-LM's row: block 256, saliency), H = 15:
    # its block scores cost a round more than 2x of dense below 30x.
    "sparseloco_tasc_h15": (dict(method="sparseloco", carrier="tasc", every=15, block=256),
                            (30, 100, 316, 1000)),
}
# Methods whose bytes are fixed (T1-LM's rows of those labels): each a family of one point, at
# the ratio its method sends (fp16 2x, 1-bit Adam 7.8x after its warm-up).
FIXED_POINTS = ("fp16", "onebit_adam")
# What each family is, for the figure's legend and the table.
DESCRIPTIONS = {
    "topk": "per-step top-k (error feedback) before one AdamW of the mean",
    "topk_update": "per-step top-k (error feedback) after each worker's AdamW",
    "diloco": "DiLoCo, float32 pseudo-gradient, H = the ratio",
    "diloco_avg": "DiLoCo without outer momentum (model averaging at outer rate 1), float32, "
                  "H = the ratio",
    "diloco_int8": "DiLoCo, int8 pseudo-gradient, H = a quarter of the ratio",
    "diloco_int4": "DiLoCo, int4 pseudo-gradient, H = an eighth of the ratio",
    "fp16": "per-step float16 exchange of the gradient (fixed bytes)",
    "onebit_adam": "1-bit Adam: dense warm-up, then 1-bit compressed momentum (fixed bytes)",
    "streaming_diloco": "Streaming DiLoCo, float32, 4 fragments staggered over H = the ratio, "
                      "each landing a step late (tau 1, alpha 0.5)",
    "demo": "DeMo (DCT tiles of 64, top coefficients all-gathered)",
    "sparseloco_h15": "SparseLoCo as published (2-bit chunked top-k of the error-fed "
                      "pseudo-gradient), H = 15",
    "sparseloco_tasc_h15": "TASC on the pseudo-gradient in SparseLoCo's form (block 256, "
                           "saliency), H = 15",
}
REFERENCES = ("dense", "solo")


def label(family: str, ratio: float) -> str:
  return f"{family}_{ratio:g}x"


def rows() -> dict[str, dict]:
  """Label -> ``configs/paper/lm.py`` arguments of every point, and of dense and solo."""
  table = {name: dict(t1_lm.FIXED[name]) for name in (*REFERENCES, *FIXED_POINTS)}
  for family, (args, ratios) in CURVES.items():
    table.update({label(family, r): dict(args, ratio=float(r)) for r in ratios})
  return table


def family_of(row: str) -> str:
  """The family of a point's label (``dense``, ``solo`` and :data:`FIXED_POINTS` are their
  own)."""
  if row in REFERENCES or row in FIXED_POINTS:
    return row
  return row.rsplit("_", 1)[0]


def ratio_of(row: str) -> float | None:
  """The ratio a point was asked for (None for dense, solo and :data:`FIXED_POINTS`: their
  method's bytes are what they are)."""
  if row in REFERENCES or row in FIXED_POINTS:
    return None
  return float(row.rsplit("_", 1)[1].rstrip("x"))


def grid(families: str = "", chosen: str = "", tuning: bool = True) -> list[tuple[str, float, int]]:
  """``(row, rate scale, seeds)`` to run, in order: dense and solo first (their seeds decide every
  retention), then family by family, ratio by ratio."""
  known = (*CURVES, *FIXED_POINTS)
  names = list(known) if not families else families.split("+")
  for name in names:
    if name not in known:
      raise ValueError(f"configs/paper/f6_lm.py: families={families!r}: {name!r}; allowed: "
                       f"{sorted(known)} joined by '+'")
  table = rows()
  runs = []
  if tuning:
    selected = list(REFERENCES) + [r for r in table if family_of(r) in names]
    runs += [(row, scale, 1) for row in selected for scale in t1_lm.LR_SCALES]
  runs += [(row, scale, 3) for row, scale in t1_lm.parse_chosen(
      chosen, table, where="configs/paper/f6_lm.py", noun="a point").items()]
  return runs


def config_arg(row: str, scale: float, seed: int) -> str:
  settings = {**rows()[row], "tier": "cpu", "lr_scale": scale, "seed": seed, "workers": 8}
  return ",".join(f"{k}={v}" for k, v in settings.items())


def get_config(arg=None):
  args = common.parse_args(arg, tier="cpu", seeds=3, families="", chosen="", tuning=1)
  if args["tier"] != "cpu":
    raise ValueError(f"configs/paper/f6_lm.py: tier={args['tier']!r}; allowed: cpu")
  if args["seeds"] < 1:
    raise ValueError(f"configs/paper/f6_lm.py: seeds={args['seeds']}; allowed: >= 1")
  runs = grid(args["families"], args["chosen"], bool(args["tuning"]))
  names = {}  # seed-major: every point has a first seed before any has a third
  for seed in range(args["seeds"]):
    for row, scale, seeds in runs:
      if seed < seeds:
        names.setdefault(t1_lm.run_name(row, scale, seed), config_arg(row, scale, seed))
  c = ml_collections.ConfigDict()
  c.runs = [{"name": name, "config": f"{CONFIG}:{arg}"} for name, arg in names.items()]
  c.overrides = {}
  return c
