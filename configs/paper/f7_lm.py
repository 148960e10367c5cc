"""F7-LM, the horizon: retention at 4x and 16x the CPU tier's steps, runs of
``configs/paper/lm.py`` in T1-LM's folder.

  python -m experiments.reproduce --target=f7_lm --tier=cpu

The same tokens a step (64 sequences of 64) and the schedule stretched (``lm_stdlib``'s warm-up
and cosine decay are fractions of the steps) for dense, solo and the rows the reproduction picks
from F6-LM's 1,000-step points: every family's point at 100x, and the two with the lowest
training loss at 30x. Each runs at the rate scale its 1,000-step tuning chose: the horizon's
budget holds no retuning (a run of 16,000 steps takes one to two hours of a CPU core), which the
page says. A run is ``<row>_len<k>_lr<scale>_s<seed>``.

Arguments: ``lengths`` (multiples of the tier's steps joined by ``+``: 4, 16), ``chosen``
(``row@scale`` joined by ``+``: dense, solo and the picked rows at their scales), ``seeds`` (1),
``seeded`` (rows of ``chosen`` joined by ``+`` whose seeds run up to ``seeded_seeds`` (3) at the
shortest length: the reproduction passes dense, solo and the 100x rows).
"""

import ml_collections

from configs import common
from configs.paper import f6_lm
from configs.paper import lm
from configs.paper import t1_lm

CONFIG = f6_lm.CONFIG
LENGTHS = tuple(k for k in lm.STEPS_SCALES if k > 1)
# F6-LM's ratios whose rows run longer -> how many of them, the lowest training loss first (None:
# every family's point). 100x first, as the runs go in this order and the horizon's question is
# asked at 100x: there every family runs, since a family's 1,000-step loss does not say how it
# scales (DiLoCo int8 at 100x, not picked at 1,000 steps, beat both picked rows at 16,000).
PICKED = {100.0: None, 30.0: 2}
# The ratio whose rows, with dense and solo, run seeds at the shortest longer length.
SEEDED_RATIO = 100.0


def all_rows() -> dict[str, dict]:
  """Every 1,000-step row the horizon may lengthen: T1-LM's and F6-LM's (one run each where their
  labels meet: ``tests/test_reproduce_frontier.py`` checks the arguments agree)."""
  return {**t1_lm.rows(), **f6_lm.rows()}


def label(row: str, length: int) -> str:
  return f"{row}_len{length}"


def parse_label(text: str) -> tuple[str, int]:
  """``(row, length)`` of a horizon label."""
  row, _, length = text.rpartition("_len")
  return row, int(length)


def get_config(arg=None):
  args = common.parse_args(arg, lengths="4+16", chosen="", seeds=1, seeded="", seeded_seeds=3)
  lengths = []
  for item in filter(None, str(args["lengths"]).split("+")):
    if not item.isdigit() or int(item) not in LENGTHS:
      raise ValueError(f"configs/paper/f7_lm.py: lengths={args['lengths']!r}: {item!r}; "
                       f"allowed: {LENGTHS} joined by '+'")
    lengths.append(int(item))
  rows = all_rows()
  chosen = t1_lm.parse_chosen(args["chosen"], rows, where="configs/paper/f7_lm.py",
                              noun="a row of T1-LM or F6-LM")
  seeded = list(filter(None, str(args["seeded"]).split("+")))
  for row in seeded:
    if row not in chosen:
      raise ValueError(f"configs/paper/f7_lm.py: seeded={args['seeded']!r}: {row!r} is not a "
                       f"row of chosen; allowed: {sorted(chosen)} joined by '+'")
  if args["seeds"] < 1 or args["seeded_seeds"] < 1:
    raise ValueError(f"configs/paper/f7_lm.py: seeds={args['seeds']}, "
                     f"seeded_seeds={args['seeded_seeds']}; allowed: >= 1")
  c = ml_collections.ConfigDict()
  c.runs = []
  # The shorter horizon first (all of it is worth more than half of both), its seeds before the
  # longer one's: a length's retention needs its references' seeds for an interval.
  for length in lengths:
    seeds = args["seeds"]
    if length == min(lengths) and seeded:
      seeds = max(seeds, args["seeded_seeds"])
    for seed in range(seeds):
      for row, scale in chosen.items():
        if seed >= args["seeds"] and row not in seeded:
          continue
        settings = {**rows[row], "tier": "cpu", "lr_scale": scale, "seed": seed, "workers": 8,
                    "steps_scale": length}
        c.runs.append({"name": t1_lm.run_name(label(row, length), scale, seed),
                       "config": f"{CONFIG}:" + ",".join(f"{k}={v}"
                                                         for k, v in settings.items())})
  c.overrides = {}
  return c
