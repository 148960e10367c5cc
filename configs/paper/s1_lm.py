"""S1-LM, the scaling grid: retention at 100x fewer total bytes against model size, token budget
and per-worker batch, runs of ``configs/paper/lm.py`` in ``<workdir>/s1_lm_<tier>``.

  python -m experiments.reproduce --target=s1_lm --tier=cpu

Model sizes (:data:`SIZES`), one rule a tier: the width doubles from size to size (96 between
64 and 128 is left out: four sizes span 29x on the CPU tier), depth grows with it (CPU: ``layers
= max(1, width / 32)``, heads of 16 dimensions; GPU: ``layers = width / 64``, heads of 64), the
vocabulary, sequence length and recipe are the tier's (``configs/paper/lm.py``). The CPU tier's
64-wide model is ``lm_stdlib``'s ``micro``, the tables' model; the GPU tier's 512-wide one is
``base``. Parameter counts are data here (a config traces no model);
``tests/test_s1_lm.py`` checks them against the traced shapes.

Points (:func:`points`): 20 tokens a parameter (Charles et al. 2025's budget) with today's
per-worker batch (8 sequences) at every size, and at the two smallest sizes 80 tokens a parameter
with today's batch and with 4x it (32 sequences): at equal tokens, the 4x batch runs a quarter of
the steps, so a quarter of the synchronisations (the outer steps each point's page row reports).
A point's steps are its tokens over the tokens a step (:func:`steps`), 8 workers.

Rows at every point (:data:`ROWS`): dense, solo (one worker alone on its share: retention's
zero), and at 100x fewer total bytes DiLoCo with int8 pseudo-gradients, Streaming DiLoCo,
SparseLoCo as published (H = 15), DeMo, and 1-bit Adam (fixed bytes: its dense warm-up is
:data:`ONEBIT_WARMUP` of a run's steps, so about 5.7x at every point). Each run solves
its own equal-bytes setting for its model and length when it starts
(:func:`experiments.methods.fill_equal_bytes`).

Rates: at every size but the largest, the tables' tuning rule (``configs/paper/t1_lm.py``'s
``LR_SCALES``, one seed, extended along ``LR_LADDER`` while an end wins; the lowest training
loss kept); at the largest, each row's scale from a power law of the tuned scales against size
fitted on the smaller sizes' 20-tokens points (``experiments.scaling.fit_learning_rate``), passed
here as ``chosen``. Seeds: 3 at the two smallest sizes (at the chosen scale), 1 elsewhere.

Arguments: ``tier`` (cpu/gpu), ``seeds`` (3: the smallest sizes' seeds), ``tuning`` (1/0:
whether the tuning phase's runs are listed), ``chosen`` (``<point>_<row>@<scale>`` joined by
``+``: seeds 1 and 2 at the smallest sizes' chosen scales, and the largest size's runs at the
rate law's scales, any scale > 0).
"""

from typing import NamedTuple

import ml_collections

from configs import common
from configs.paper import lm
from configs.paper import t1_lm

CONFIG = lm.__name__.replace(".", "/") + ".py"
TOKENS_PER_PARAM = 20  # Charles et al. 2025's budget
LONGER = 4  # the longer budget's and the larger batch's multiple
RATIO = 100.0
WORKERS = 8
SEEDS_AT_SMALLEST = 3
PER_WORKER_BATCH = 8  # today's: 64 sequences over 8 workers, both tiers


class Size(NamedTuple):
  width: int
  layers: int
  heads: int
  params: int  # traced (tests/test_s1_lm.py)


# Tier -> size name -> its shape; ascending.
SIZES = {
    "cpu": {"w16": Size(16, 1, 1, 37_104), "w32": Size(32, 1, 2, 80_352),
            "w64": Size(64, 2, 4, 235_264), "w128": Size(128, 4, 8, 1_063_680)},
    "gpu": {"w256": Size(256, 4, 4, 5_322_240), "w384": Size(384, 6, 6, 13_891_584),
            "w512": Size(512, 8, 8, 29_545_472), "w768": Size(768, 12, 12, 91_544_064)},
}
# 1-bit Adam's dense warm-up (its freeze step) as a fraction of a point's steps: the published
# 15-25% of training at its low end (the fewest dense bytes). The compressor's default, 100 steps,
# was 2% of the largest size's run and 55% of the smallest's, so its bytes (1.8x to 10.7x) and
# its retention moved with the run's length as much as with the size (its first grid's runs).
ONEBIT_WARMUP = 0.15
# Row -> configs/paper/lm.py arguments (ratio RATIO for all but dense, solo and 1-bit Adam).
ROWS = {
    "dense": dict(method="dense"),
    "solo": dict(method="dense", solo=True),
    "diloco_int8": dict(method="diloco", carrier="int8"),
    "streaming_diloco": dict(method="streaming_diloco"),
    "sparseloco": dict(method="sparseloco", every=15),
    "demo": dict(method="demo"),
    "onebit_adam": dict(method="onebit_adam", freeze_fraction=ONEBIT_WARMUP),
}
# DeMo's DCT tile side by size (its default 64 elsewhere): it sends whole coefficients a tile, so
# its bytes move in steps; its default where that lands within 10% of 100x (the tables' model:
# F6-LM's point), else the nearer of 64 and 128. Data here (a config traces no model), checked
# against the solver by tests/test_s1_lm.py.
DEMO_TILE = {"w16": 128, "w32": 128, "w128": 128}
# Points whose rows the solver cannot put within 10% of 100x (the page shows their ratio): DeMo at
# the smallest model (88x at tile 128, 121x at 64) and Streaming DiLoCo where 181 steps hold 2
# rounds of H = 90 (90.5x). Data, checked by tests/test_s1_lm.py.
OFF_TIER = ("w16_t20_b8_demo", "w16_t80_b8_demo", "w16_t80_b32_demo",
            "w16_t20_b8_streaming_diloco", "w16_t80_b32_streaming_diloco")
REFERENCES = ("dense", "solo")
FIXED_BYTES = ("onebit_adam",)
DESCRIPTIONS = {
    "diloco_int8": "DiLoCo, int8 pseudo-gradient, H solved (about a quarter of the ratio)",
    "streaming_diloco": "Streaming DiLoCo, 4 fragments, H = the ratio",
    "sparseloco": "SparseLoCo as published (2-bit chunked top-k, error decay), H = 15",
    "demo": "DeMo (DCT tiles of 64 or 128, top coefficients)",
    "onebit_adam": f"1-bit Adam (fixed bytes, dense warm-up {ONEBIT_WARMUP:.0%} of the steps: "
                   "about 5.7x)",
}
# Measured step times (paper_figures/cpu_runs/lm_cpu, the CPU tier's 0.24M model, 1,000 steps,
# two runs at once on 2 cores, compiling included: the median of each row's runs; and the GPU
# tier's T1-LM runs on one H200), for the budget: a step costs OVERHEAD + PER_PARAM_TOKEN x
# params x tokens a step (fitted to dense's and solo's: the same model at 4,096 and 512
# tokens a step), times the method's FACTOR of dense's step (the CPU tier's, on both tiers).
STEP_COST = {"cpu": (0.0547, 1.933e-10), "gpu": (0.0754, 7.56e-14)}
FACTOR = {"dense": 1.0, "solo": 1.0, "diloco_int8": 0.65, "streaming_diloco": 0.54,
          "sparseloco": 2.95, "demo": 0.68, "onebit_adam": 0.63}
# Rate scales a tuned row is expected to run: the grid's 3 and one step past an end.
EXPECTED_SCALES = len(t1_lm.LR_SCALES) + 1


class Point(NamedTuple):
  size: str
  tokens_per_param: int
  per_worker_batch: int  # sequences

  @property
  def name(self) -> str:
    return f"{self.size}_t{self.tokens_per_param}_b{self.per_worker_batch}"


def points(tier: str) -> list[Point]:
  """Every point of ``tier``'s grid: each size at 20 tokens a parameter and today's batch, and
  the two smallest at 80 tokens a parameter with today's batch and 4x it."""
  if tier not in SIZES:
    raise ValueError(f"configs/paper/s1_lm.py: tier={tier!r}; allowed: {sorted(SIZES)}")
  sizes = list(SIZES[tier])
  out = [Point(s, TOKENS_PER_PARAM, PER_WORKER_BATCH) for s in sizes]
  for s in sizes[:2]:
    out += [Point(s, LONGER * TOKENS_PER_PARAM, PER_WORKER_BATCH),
            Point(s, LONGER * TOKENS_PER_PARAM, LONGER * PER_WORKER_BATCH)]
  return out


def seq_len(tier: str) -> int:
  return lm.HARDWARE_TIERS[tier][1]["seq_len"]


def steps(tier: str, point: Point) -> int:
  """The point's steps: its tokens (its size's parameters x tokens a parameter) over the tokens
  of a step (8 workers x per-worker batch x sequence length), rounded."""
  tokens = SIZES[tier][point.size].params * point.tokens_per_param
  return max(1, round(tokens / (WORKERS * point.per_worker_batch * seq_len(tier))))


def largest(tier: str) -> str:
  return list(SIZES[tier])[-1]


def seeds_of(tier: str, point: Point) -> int:
  """3 at the two smallest sizes, 1 elsewhere."""
  return SEEDS_AT_SMALLEST if point.size in list(SIZES[tier])[:2] else 1


def label(point: Point, row: str) -> str:
  return f"{point.name}_{row}"


def rows(tier: str) -> dict[str, dict]:
  """Label (``<point>_<row>``) -> ``configs/paper/lm.py`` arguments, every point's rows."""
  table = {}
  for point in points(tier):
    size = SIZES[tier][point.size]
    shape = dict(tier=tier, width=size.width, layers=size.layers, heads=size.heads,
                 steps=steps(tier, point), per_worker_batch=point.per_worker_batch)
    for row, args in ROWS.items():
      ratio = {} if row in REFERENCES or row in FIXED_BYTES else dict(ratio=RATIO)
      tile = dict(tile=DEMO_TILE[point.size]) if row == "demo" and point.size in DEMO_TILE else {}
      table[label(point, row)] = dict(args, **ratio, **tile, **shape)
  return table


def split_label(text: str) -> tuple[Point, str]:
  """``(point, row)`` of a label."""
  for row in ROWS:
    if text.endswith("_" + row):
      size, tokens, batch = text[:-len(row) - 1].split("_")
      return Point(size, int(tokens[1:]), int(batch[1:])), row
  raise ValueError(f"configs/paper/s1_lm.py: {text!r} is not a label <point>_<row>")


def run_name(label_: str, scale: float, seed: int) -> str:
  return t1_lm.run_name(label_, scale, seed)


def grid(tier: str, chosen: str = "", tuning: bool = True) -> list[tuple[str, float, int]]:
  """``(label, rate scale, seeds)`` in order: the tuning phase (every point's rows but the
  largest size's, at each of the tables' rate scales, one seed), then the chosen ones."""
  table = rows(tier)
  out = []
  if tuning:
    out += [(name, scale, 1) for name in table if split_label(name)[0].size != largest(tier)
            for scale in t1_lm.LR_SCALES]
  for name, scale in t1_lm.parse_chosen(chosen, table, where="configs/paper/s1_lm.py",
                                        noun="a label", ladder=False).items():
    out.append((name, scale, seeds_of(tier, split_label(name)[0])))
  return out


def step_seconds(tier: str, point: Point, row: str) -> float:
  """The estimated seconds of one step of ``row`` at ``point`` (see :data:`STEP_COST`)."""
  overhead, per = STEP_COST[tier]
  workers = 1 if row == "solo" else WORKERS
  tokens = workers * point.per_worker_batch * seq_len(tier)
  return FACTOR[row] * (overhead + per * SIZES[tier][point.size].params * tokens)


def budget(tier: str) -> list[dict]:
  """Per point: its steps and the estimated seconds of its runs (two at once, as measured): the
  tuned sizes' rows at :data:`EXPECTED_SCALES` scales and their other seeds, the largest size's
  rows once."""
  out = []
  for point in points(tier):
    n = steps(tier, point)
    tuned = point.size != largest(tier)
    runs = (EXPECTED_SCALES + seeds_of(tier, point) - 1) if tuned else 1
    seconds = sum(runs * n * step_seconds(tier, point, row) for row in ROWS)
    out.append({"point": point.name, "params": SIZES[tier][point.size].params, "steps": n,
                "runs": runs * len(ROWS), "seconds": seconds})
  return out


def get_config(arg=None):
  args = common.parse_args(arg, tier="cpu", seeds=SEEDS_AT_SMALLEST, tuning=1, chosen="")
  if args["tier"] not in SIZES:
    raise ValueError(f"configs/paper/s1_lm.py: tier={args['tier']!r}; allowed: {sorted(SIZES)}")
  if args["seeds"] < 1:
    raise ValueError(f"configs/paper/s1_lm.py: seeds={args['seeds']}; allowed: >= 1")
  table = rows(args["tier"])
  names = {}  # seed-major: every run has a first seed before any has a third
  for seed in range(args["seeds"]):
    for name, scale, seeds in grid(args["tier"], args["chosen"], bool(args["tuning"])):
      if seed < seeds:
        settings = {**table[name], "lr_scale": scale, "seed": seed, "workers": WORKERS}
        names.setdefault(run_name(name, scale, seed),
                         ",".join(f"{k}={v}" for k, v in settings.items()))
  c = ml_collections.ConfigDict()
  c.runs = [{"name": name, "config": f"{CONFIG}:{arg}"} for name, arg in names.items()]
  c.overrides = {}
  return c
