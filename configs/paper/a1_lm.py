"""A1-LM, workers that are slow, late or gone: each aggregator of ``config.aggregation`` for
DiLoCo (int8 pseudo-gradient) and Streaming DiLoCo at 100x fewer total bytes, under simulated
worker speed spreads and drop-outs; runs of ``configs/paper/lm.py`` in T1-LM's folder.

  python -m experiments.reproduce --target=a1_lm

The CPU tier's model, steps and recipe (``configs/paper/lm.py``: 0.24M parameters, 1,000 steps of
64 sequences of 64 tokens, 8 workers), so that dense, solo and the rows' runs with every worker
alike and ``sync`` are F6-LM's own (the same arguments, the same run directories: nothing runs
twice). Each rule gets T1-LM's tuning budget of its own at its tuning condition
(:func:`tuning_runs`), and its cells run at the scale it chose (``chosen``); without a choice, at
the rate scale F6-LM's tuning chose for the row (:data:`ROWS`; dense's and solo's as well). A
cell is a row, an aggregator and a condition (:data:`SPREADS` x :data:`DROPOUTS`); a run is
``a1_<row>_<rule>_sp<spread>_do<dropout>_lr<scale>_s<seed>``, and the cell of ``sync`` with the
workers alike is F6-LM's ``<row>_100x``. Both methods take every aggregator (Streaming DiLoCo's
each fragment's synchronisation is one of the simulator's). ``delayed`` (Kale et al.'s naive
one-step-delayed outer step) is a row of their comparison only (no overlap = ``sync``, naive
delay = ``delayed``, ``eager``): it runs at the workers-alike condition alone
(:data:`ALIKE_ONLY`).

The grid at one seed, 40 runs besides F6-LM's 4 (20 a method), about 2 to 3 minutes each on 2
cores with 2 jobs (Streaming DiLoCo's a little more: its four fragments' programs to compile):
about two hours.

Seeds: every cell of the :data:`SEEDED` condition (the slowest and least reliable workers) runs
at seeds 0, 1 and 2 (``seeded=True``: 20 runs more, about 45 minutes), the others at seed 0.

Arguments: ``seeds`` (1), ``rows`` and ``rules`` (joined by ``+``; '': all), ``seeded`` (False;
True: only the :data:`SEEDED` condition's cells), ``probes`` (False; True: only the off-grid
probes, :func:`probes`), ``tuning`` ('': none; ``grid`` or ``label@scale`` joined by ``+``: only
the tuning budget's runs, :func:`tuning_runs`), ``chosen`` ('': none; ``label@scale`` joined by
``+``: each tuning label's rule's cells at that scale, :func:`scale_of`), ``steps`` (0: the
tier's; a smaller number makes every run that short, a smoke test of the grid in a folder of its
own: its runs are not the tier's and must not share the tier's folder).
"""

import math

import ml_collections

from configs import common
from configs.paper import f6_lm
from configs.paper import t1_lm

CONFIG = f6_lm.CONFIG
RATIO = 100.0
# Row -> (configs/paper/lm.py arguments, F6-LM's label of the row at 100x, the rate scale its
# tuning chose on F6-LM's page: DiLoCo int8 0.5 of its outer rate 0.7, Streaming DiLoCo 1).
ROWS = {
    "diloco_int8": (dict(method="diloco", carrier="int8", ratio=RATIO), "diloco_int8_100x", 0.5),
    "streaming_diloco": (dict(method="streaming_diloco", ratio=RATIO), "streaming_diloco_100x",
                         1.0),
}
RULES = ("sync", "quorum", "async", "naive_async", "eager", "delayed")
ALIKE_ONLY = ("delayed",)  # rules run at the workers-alike condition alone (spread 0, drop-out 0)
SPREADS = (0.0, 0.5)  # log-normal sigma of the workers' seconds per step
DROPOUTS = (0.0, 0.1)  # the chance a worker misses a synchronisation
# The condition whose cells run 3 seeds (the others one): the slowest and least reliable workers,
# where the aggregators differ most (with the workers alike sync, quorum and async are one run).
SEEDED = (0.5, 0.1)
# Off-grid probes of Kale et al.'s comparison (no overlap, naive delay, eager) for DiLoCo int8 with
# the workers alike, where a linearised outer loop (experiments/reproduce/a1_lm.py's
# outer_loop_radius) is stable for eager but not naive delay: at a quarter of its rate (all three
# stable), and with 2 workers (eager's own term half its step) at its rate.
# The tuning budget (T1-LM's, configs/paper/t1_lm.py: its LR_SCALES, past an end that wins along
# its LR_LADDER, one seed, the lowest mean training loss over the last tenth): every rule of every
# row at its tuning condition, the SEEDED one (where the rules differ most), or with the workers
# alike for ALIKE_ONLY's rules. The row's own scale (F6-LM's choice for sync) is one of
# LR_SCALES, so each rule's run there is its seeded cell's seed 0.
PROBE_RULES = ("sync", "delayed", "eager")
PROBE_SCALE = 0.125
PROBE_WORKERS = 2
# Retention's references at the scales F6-LM's tuning chose (dense 4, solo 1).
REFERENCES = {"dense": 4.0, "solo": 1.0}
# The aggregators each method takes (compressors.registry's ``aggregates``: all of them); a
# method not listed only syncs with the workers alike (configs import no runner code:
# tests/test_reproduce_a1_lm.py checks this against the runner's refusal).
AGGREGATING = {"diloco": RULES, "sparseloco": RULES, "streaming_diloco": RULES}


def conditions() -> list[tuple[float, float]]:
  """``(speed spread, drop-out rate)`` of every condition, the workers alike first."""
  return [(spread, dropout) for spread in SPREADS for dropout in DROPOUTS]


def label(row: str, rule: str, spread: float, dropout: float) -> str:
  """A cell's label; the cell of ``sync`` with the workers alike is F6-LM's row itself."""
  if rule == "sync" and not spread and not dropout:
    return ROWS[row][1]
  return f"a1_{row}_{rule}_sp{spread:g}_do{dropout:g}"


def refusal(row: str, rule: str, spread: float, dropout: float) -> str | None:
  """Why a cell does not run (the runner refuses it), or None."""
  method = ROWS[row][0]["method"]
  takes = AGGREGATING.get(method, ())
  if rule in takes or (rule == "sync" and not spread and not dropout):
    return None
  allowed = f"aggregation in {takes}" if takes else "aggregation='sync' with the workers alike"
  return (f"refused: config.method={method!r} does not take config.aggregation={rule!r} "
          f"(workers.speed_spread={spread:g}, workers.dropout_rate={dropout:g}); allowed for "
          f"it: {allowed}")


def cells() -> dict[str, tuple[str, str, float, float]]:
  """Label -> ``(row, rule, spread, dropout)`` of every cell, refused ones included
  (:data:`ALIKE_ONLY`'s rules at the workers-alike condition alone)."""
  return {label(row, rule, *c): (row, rule, *c) for row in ROWS for rule in RULES
          for c in conditions() if rule not in ALIKE_ONLY or c == (0.0, 0.0)}


def config_arg(cell_label: str, seed: int, chosen: dict[str, float] | None = None) -> str:
  """The ``configs/paper/lm.py`` argument of a run of a cell or a reference, at
  :func:`scale_of`'s scale."""
  scale = scale_of(cell_label, chosen)
  if cell_label in REFERENCES:
    return f6_lm.config_arg(cell_label, scale, seed)
  row, rule, spread, dropout = cells()[cell_label]
  if cell_label == ROWS[row][1]:
    return f6_lm.config_arg(cell_label, scale, seed)
  return _cell_arg(row, rule, spread, dropout, scale, seed)


def _cell_arg(row: str, rule: str, spread: float, dropout: float, scale: float, seed: int,
              workers: int = 8) -> str:
  settings = {**ROWS[row][0], "tier": "cpu", "lr_scale": scale, "seed": seed,
              "workers": workers, "aggregation": rule, "speed_spread": spread,
              "dropout_rate": dropout}
  return ",".join(f"{k}={v}" for k, v in settings.items())


def probes() -> dict[str, str]:
  """Run name -> ``configs/paper/lm.py`` argument of each off-grid probe of Kale et al.'s three
  rules (:data:`PROBE_RULES`) for DiLoCo int8 with the workers alike (``sync`` through the
  simulator, which with the workers alike is DiLoCo itself): 8 workers at :data:`PROBE_SCALE`,
  and :data:`PROBE_WORKERS` workers (the same global batch) at the row's own scale."""
  scale = ROWS["diloco_int8"][2]
  out = {f"a1_diloco_int8_{rule}_sp0_do0_lr{PROBE_SCALE:g}_s0":
         _cell_arg("diloco_int8", rule, 0.0, 0.0, PROBE_SCALE, 0) for rule in PROBE_RULES}
  out.update({f"a1_diloco_int8_{rule}_sp0_do0_w{PROBE_WORKERS}_lr{scale:g}_s0":
              _cell_arg("diloco_int8", rule, 0.0, 0.0, scale, 0, PROBE_WORKERS)
              for rule in PROBE_RULES})
  return out


def tuning_condition(rule: str) -> tuple[float, float]:
  """``(speed spread, drop-out rate)`` at which ``rule``'s rate scale is tuned."""
  return (0.0, 0.0) if rule in ALIKE_ONLY else SEEDED


def tuning_label(row: str, rule: str) -> str:
  """The cell whose rate scales the tuning budget tries for ``row``'s ``rule``: the rule at its
  tuning condition."""
  return label(row, rule, *tuning_condition(rule))


def tuning_labels() -> list[str]:
  """Every row's every rule's :func:`tuning_label`."""
  return [tuning_label(row, rule) for row in ROWS for rule in RULES]


def tuning_runs(text: str) -> dict[str, str]:
  """Run name -> ``configs/paper/lm.py`` argument of seed 0 of each ``label@scale`` of ``text``
  (joined by ``+``; ``grid``: every tuning label at each of T1-LM's ``LR_SCALES``).

  Raises:
    ValueError: an item that is not a tuning label at a scale of T1-LM's ``LR_LADDER``.
  """
  items = ([(name, scale) for name in tuning_labels() for scale in t1_lm.LR_SCALES]
           if text == "grid" else [])
  for item in ([] if text == "grid" else filter(None, str(text).split("+"))):
    name, _, scale = item.partition("@")
    try:
      value = float(scale)
    except ValueError:
      value = math.nan
    if name not in tuning_labels() or value not in t1_lm.LR_LADDER:
      raise ValueError(f"configs/paper/a1_lm.py: tuning={text!r}: {item!r}; allowed: 'grid' or "
                       f"label@scale joined by '+', a label of {tuning_labels()} at a scale of "
                       f"{list(t1_lm.LR_LADDER)}")
    items.append((name, value))
  return {t1_lm.run_name(name, scale, 0): _cell_arg(*cells()[name], scale, 0)
          for name, scale in items}


def scale_of(cell_label: str, chosen: dict[str, float] | None = None) -> float:
  """The rate scale a cell's or a reference's runs train at: its row and rule's in ``chosen``
  (:func:`tuning_label` -> the scale that rule's tuning chose), else the row's (F6-LM's)."""
  if cell_label in REFERENCES:
    return REFERENCES[cell_label]
  row, rule, _, _ = cells()[cell_label]
  return (chosen or {}).get(tuning_label(row, rule), ROWS[row][2])


def parse_chosen(text: str) -> dict[str, float]:
  """``label@scale`` joined by ``+`` -> {tuning label: scale}.

  Raises:
    ValueError: a label that is not a :func:`tuning_label` or a scale off T1-LM's ladder.
  """
  return t1_lm.parse_chosen(str(text), tuning_labels(), where="configs/paper/a1_lm.py",
                            noun=f"a tuning label (one of {tuning_labels()})")


def _chosen(text: str, allowed, field: str) -> tuple[str, ...]:
  names = tuple(filter(None, str(text).split("+"))) or tuple(allowed)
  for name in names:
    if name not in allowed:
      raise ValueError(f"configs/paper/a1_lm.py: {field}={text!r}: {name!r}; allowed: "
                       f"{list(allowed)} joined by '+'")
  return names


def get_config(arg=None):
  args = common.parse_args(arg, seeds=1, rows="", rules="", seeded=False, probes=False, steps=0,
                           tuning="", chosen="")
  chosen = parse_chosen(args["chosen"])
  rows, rules = _chosen(args["rows"], ROWS, "rows"), _chosen(args["rules"], RULES, "rules")
  if args["seeds"] < 1:
    raise ValueError(f"configs/paper/a1_lm.py: seeds={args['seeds']}; allowed: >= 1")
  if args["steps"] < 0:
    raise ValueError(f"configs/paper/a1_lm.py: steps={args['steps']}; allowed: 0 (the tier's) "
                     "or a number of steps > 0")
  wanted = [*REFERENCES] + [name for name, (row, rule, *c) in cells().items()
                            if row in rows and rule in rules and refusal(row, rule, *c) is None
                            and (not args["seeded"] or tuple(c) == SEEDED)]
  c = ml_collections.ConfigDict()
  c.runs = [{"name": t1_lm.run_name(name, scale_of(name, chosen), seed),
             "config": f"{CONFIG}:{config_arg(name, seed, chosen)}"}
            for seed in range(args["seeds"]) for name in wanted]
  if args["probes"]:
    c.runs = [{"name": name, "config": f"{CONFIG}:{arg}"} for name, arg in probes().items()]
  if args["tuning"]:
    c.runs = [{"name": name, "config": f"{CONFIG}:{arg}"}
              for name, arg in tuning_runs(args["tuning"]).items()]
  c.overrides = {}
  if args["steps"]:
    c.overrides = {"num_steps": args["steps"], "eval_every": max(1, args["steps"] // 2),
                   "checkpoint_every": args["steps"], "log_every": 1,
                   "schedule": {"warmup_steps": max(1, args["steps"] // 10)}}
  return c
