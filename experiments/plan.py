"""Which communication-efficient method to run, for a model, a token budget, a worker count and
a link: the settings each family with a scaling law would run, its bytes a step, its predicted
loss (and retention), and its modelled time to dense's loss, then a recommendation.

  python -m experiments.plan --params=1.3e9 --tokens=26e9 --workers=8 --bandwidth_gbit=1

Inputs: ``--params`` (N), ``--tokens`` (the run's), ``--workers``, ``--bandwidth_gbit`` (the link
each worker sends on); optional ``--latency_us`` (per message, default 50), ``--step_seconds``
(one step's compute on a worker) or ``--device`` (:data:`DEVICES`, default ``h100``: the compute
from 6 N FLOPs a token at :data:`MFU` of the device's peak; ``cpu``: the CPU tier's measured
step model), the
global ``--batch_tokens`` (default: 2^20, at most a thousandth of the tokens), ``--memory_gb``
(a worker's memory: families whose state does not fit are not recommended), ``--fits`` (the
scaling grid's fits, default the S1-LM fits CSV in ``paper_figures``) and ``--write_config``
(writes the recommended settings as a config override, JSON).

The laws: S1-LM's fits (``python -m experiments.reproduce --target=s1_lm`` writes them), a
retention law ``1 - A N^alpha`` and a loss law ``A N^alpha`` per family, with dense's and
solo's loss laws (marked provisional where the grid had not finished); and beside them, always,
Charles et al. 2025's published laws for DiLoCo (data parallel ``L = 18.129 N^-0.0953``, DiLoCo
with 8 replicas at H = 30 ``L = 21.051 N^-0.1018``), labelled so, each family's loss set against
its own source's dense (the two are on different data). A family S1-LM has not fitted has no
law yet. Every law is at 20 tokens a parameter. The recommendation prefers laws used within 10x
of their fitted sizes; one that rests on a law extrapolated further says so.

The models, reused: bytes a step from :func:`compressors.equal_bytes.solve` on a stand-in of the
model's shapes (:func:`stand_in_shapes`: bytes depend on the count of parameters, the overlap of
buckets on their leaves); time a step from :mod:`compressors.step_time`, against dense's bf16
all-reduce overlapped with the backward pass (tuned data parallelism, F5's fair baseline). The
time to dense's loss: by the family's loss law, the size ``N'`` whose loss is dense's predicted
loss at N, trained on as many tokens a parameter with the same batch (``N' / N`` times the
steps, each at ``N'``'s step time); against dense's run at N.
"""

import argparse
import csv
import dataclasses
import json
import math
import os
import sys
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from compressors import equal_bytes
from compressors import registry
from compressors import step_time
from compressors.network import topology as topo
from compressors.parallel import step_kinds
from configs.paper import s1_lm
from experiments import scaling

PROGRAM = "experiments.plan"
FITS_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                         "paper_figures", "s1_lm_fits.csv")
PUBLISHED = "published law (Charles et al. 2025), not fitted here"
# Charles et al. 2025 (arXiv 2503.09799): C4, 20 tokens a parameter, 35M-2.4B parameters.
PUBLISHED_DENSE = scaling.PowerLaw(18.129, -0.0953)
PUBLISHED_DILOCO = scaling.PowerLaw(21.051, -0.1018)
PUBLISHED_RANGE = (35e6, 2.4e9)
PUBLISHED_REPLICAS = 8
TOKENS_PER_PARAM = s1_lm.TOKENS_PER_PARAM
# Peak dense bf16 FLOP/s of a device; compute at MFU of it.
DEVICES = {"h100": 989e12, "h200": 989e12, "a100": 312e12, "l4": 121e12, "cpu": None}
MFU = 0.4
LEAF = 1024  # the stand-in's matrices are LEAF x LEAF
# Bytes a parameter of a worker's state (float32 weights, gradient, optimizer; activations left
# out): AdamW 16; a local-update method adds its outer copy and momentum or error buffer (8);
# DeMo's sign-SGD one momentum (12); 1-bit Adam its error feedback (20).
STATE_BYTES = {"dense": 16, "diloco_int8": 24, "diloco": 24, "streaming_diloco": 24,
               "sparseloco": 24, "demo": 12, "onebit_adam": 20}


class Setting(NamedTuple):
  """What a family runs: its method, its settings' changes from the defaults, its carrier's,
  the ratio its bytes are solved for (None: fixed bytes), the words for it, and the fraction
  of the run's steps its dense warm-up takes (1-bit Adam's freeze step; None: the method has
  none)."""
  method: str
  changes: dict
  carrier_changes: dict
  ratio: float | None
  text: str
  warmup: float | None = None


# S1-LM's rows as the plan runs them (configs/paper/s1_lm.py's ROWS at its RATIO).
SETTINGS = {
    "diloco_int8": Setting("diloco", {"carrier": "int8"}, {}, s1_lm.RATIO,
                           "DiLoCo, int8 pseudo-gradient"),
    "streaming_diloco": Setting("streaming_diloco", {}, {}, s1_lm.RATIO,
                                "Streaming DiLoCo, 4 fragments"),
    "sparseloco": Setting("sparseloco", {"every": 15}, {}, s1_lm.RATIO,
                          "SparseLoCo, 2-bit chunked top-k, H = 15"),
    "demo": Setting("demo", {}, {}, s1_lm.RATIO, "DeMo, DCT tiles of 64"),
    "onebit_adam": Setting("onebit_adam", {}, {}, None,
                           f"1-bit Adam (fixed bytes, dense warm-up {s1_lm.ONEBIT_WARMUP:.0%} "
                           "of the steps)", warmup=s1_lm.ONEBIT_WARMUP),
    # Charles et al.'s: float32 pseudo-gradient every 30 steps.
    "diloco": Setting("diloco", {}, {}, 30.0, "DiLoCo, float32 pseudo-gradient, H = 30 "
                      "(the published law's setting)"),
}


class Law(NamedTuple):
  """A family's laws: its loss law, dense's and solo's (None where not published), its
  retention law's fit with its bootstrap draws (None for a published law), the sizes it was
  fitted on, where it comes from, the runs it rests on, and what the grid had still to run when
  it was fitted (the fits CSV's ``grid``: '' for a published law and for a fits file without
  that column)."""
  family: str
  loss: scaling.PowerLaw
  dense: scaling.PowerLaw
  solo: scaling.PowerLaw | None
  retention: scaling.Fit | None  # of a scaling.RetentionLaw
  sizes: tuple[float, float]
  source: str
  runs: str
  grid: str = ""

  @property
  def label(self) -> str:
    """Where it comes from, and ``provisional`` while its rows have still to run."""
    return self.source + (", provisional" if provisional(self.grid) else "")


class Setup(NamedTuple):
  params: float
  tokens: float
  workers: int
  link: topo.Link
  batch_tokens: float
  compute: float  # seconds a step of one worker at params
  compute_text: str
  memory_gb: float | None


def _number(row: dict, key: str) -> float | None:
  text = (row.get(key) or "").strip()
  return float(text) if text else None


PUBLISHED_LAW = Law("diloco", PUBLISHED_DILOCO, PUBLISHED_DENSE, None, None, PUBLISHED_RANGE,
                    PUBLISHED,
                    "Charles et al. 2025's C4 runs, 35M-2.4B parameters, 8 replicas, H = 30")


def read_laws(path: str) -> tuple[dict[str, Law], list[str]]:
  """The families' laws: S1-LM's fits from the CSV at ``path`` (where it exists) and Charles et
  al.'s published DiLoCo law (always: its sizes, 35M-2.4B, are where S1-LM's CPU tier cannot
  go); and the families with no law yet."""
  fitted = [f for f in SETTINGS if f != "diloco"]
  if not os.path.isfile(path):
    return {"diloco": PUBLISHED_LAW}, fitted
  with open(path, newline="", encoding="utf-8") as f:
    rows = {r["family"]: r for r in csv.DictReader(f)}
  law = lambda r, p: (scaling.PowerLaw(_number(r, p + "A"), _number(r, p + "alpha"))
                      if r and _number(r, p + "A") is not None else None)
  dense, solo = law(rows.get("dense"), "loss_"), law(rows.get("solo"), "loss_")
  draws = read_draws(scaling.draws_path(path))
  laws, missing = {}, []
  for family in fitted:
    row = rows.get(family)
    grid = ((row or {}).get("grid") or "").strip()
    if row is None or dense is None or law(row, "") is None or law(row, "loss_") is None:
      missing.append(family)
      continue
    sizes = [float(s) for s in row["sizes"].split()]
    retention = scaling.Fit(scaling.RetentionLaw(*law(row, "")), draws.get(family), max(sizes),
                            min(sizes))
    laws[family] = Law(family, law(row, "loss_"), dense, solo, retention, (min(sizes), max(sizes)),
                       f"S1-LM fit ({os.path.basename(path)})",
                       f"S1-LM's {row['family']} rows at 20 tokens a parameter, "
                       f"{len(sizes)} sizes {min(sizes):.3g}-{max(sizes):.3g}", grid)
  laws["diloco"] = PUBLISHED_LAW
  return laws, missing


def read_draws(path: str) -> dict[str, np.ndarray]:
  """Each family's retention-law bootstrap draws, ``(A, alpha)`` rows, from the CSV beside the
  fits (none where it is absent: the plan then prints no interval)."""
  if not os.path.isfile(path):
    return {}
  found = {}
  with open(path, newline="", encoding="utf-8") as f:
    for row in csv.DictReader(f):
      found.setdefault(row["family"], []).append((float(row["A"]), float(row["alpha"])))
  return {family: np.array(rows, np.float64) for family, rows in found.items()}


def provisional(grid: str) -> bool:
  """Whether a fits CSV's ``grid`` says its grid had still to run when it was fitted."""
  return grid.startswith("incomplete")


def stand_in_shapes(params: float) -> list[tuple[int, ...]]:
  """A model of ``params`` parameters as :data:`LEAF`-square matrices and a remainder: the
  solver's bytes depend on the count alone, the buckets' overlap on the leaves' sizes."""
  n = int(round(params))
  full, rest = divmod(n, LEAF * LEAF)
  shapes = [(LEAF, LEAF)] * full
  rows, tail = divmod(rest, LEAF)
  shapes += [(rows, LEAF)] if rows else []
  return shapes + ([(tail,)] if tail else [])


def compute_seconds(params: float, tokens_a_worker: float, step_seconds: float | None,
                    device: str) -> tuple[float, str]:
  """One step's compute on a worker, and how it was found."""
  if step_seconds is not None:
    return step_seconds, f"{step_seconds:g} s a step (given)"
  if device == "cpu":
    overhead, per = s1_lm.STEP_COST["cpu"]
    return (overhead + per * params * tokens_a_worker,
            "the CPU tier's measured step model (configs/paper/s1_lm.py)")
  flops = 6 * params * tokens_a_worker
  return flops / (DEVICES[device] * MFU), f"{device} at {MFU:.0%} of {DEVICES[device] / 1e12:g} " \
                                          "TFLOP/s bf16, 6 N FLOPs a token"


def solved(family: str, shapes, workers: int, steps: int):
  """``(method, settings, exchange settings, bytes a step)`` of a family's setting, solved: a
  fixed-bytes family's bytes are its run's mean over its step kinds (:func:`run_mean_bytes`)."""
  setting = SETTINGS[family]
  entry = registry.get(setting.method)
  settings = dataclasses.replace(entry.settings(), **setting.changes)
  if setting.warmup is not None:  # as S1-LM's rows: a fraction of the run, as published
    settings = dataclasses.replace(settings,
                                   freeze_step=settings.freeze_step_for(setting.warmup, steps))
  exchange = None
  if entry.carrier is not None:
    exchange = dataclasses.replace(registry.get(entry.carrier(settings)).settings(),
                                   **setting.carrier_changes)
  if setting.ratio is None:
    return setting.method, settings, exchange, run_mean_bytes(setting.method, settings, shapes,
                                                              workers, steps)
  solution = equal_bytes.solve(setting.method, shapes, workers, setting.ratio, settings,
                               exchange_settings=exchange, steps=steps)
  if not math.isfinite(solution.bytes):
    raise ValueError(f"{family}: {solution.note}")
  return setting.method, solution.settings, solution.exchange_settings, solution.bytes


def run_mean_bytes(method: str, settings, shapes, workers: int, steps: int) -> float:
  """Bytes a worker sends a step over a run of ``steps``: each step kind's bytes (the dense
  all-reduce's for a step that sends the dense gradient: 1-bit Adam's warm-up) by how many of
  the run's steps it takes."""
  kinds = registry.step_kinds(method, settings)
  counts = step_kinds.kind_counts(kinds, 0, steps)
  sent = 0.0
  for kind in kinds:
    who = step_time.kind_method(method, kind)
    sent += counts[kind.name] * equal_bytes.method_bytes(
        who, shapes, workers, settings if who == method else None)
  return sent / steps


def mean_step(method: str, settings, exchange, shapes, setup: Setup, compute: float,
              steps: int) -> float:
  """The modelled mean seconds of a step over ``steps`` (:mod:`compressors.step_time`)."""
  topology = topo.Topology.flat(setup.workers, setup.link)
  kinds = registry.step_kinds(method, settings, exchange_settings=exchange)
  times = step_time.kind_times(method, shapes, topology, compute, settings,
                               exchange_settings=exchange, kinds=kinds)
  return step_time.mean_step_seconds(times, step_kinds.kind_counts(kinds, 0, steps))


def run_seconds(family: str, params: float, setup: Setup) -> float:
  """The modelled seconds of ``family``'s run of a ``params`` model on as many tokens a
  parameter as the setup's, with its batch (``dense``: bf16 overlapped)."""
  shapes = stand_in_shapes(params)
  steps = max(1, round(setup.tokens * params / setup.params / setup.batch_tokens))
  compute = setup.compute * params / setup.params
  if family == "dense":
    times = step_time.kind_times("bf16", shapes, topo.Topology.flat(setup.workers, setup.link),
                                 compute)
    return steps * next(iter(times.values())).total
  method, settings, exchange, _ = solved(family, shapes, setup.workers, steps)
  return steps * mean_step(method, settings, exchange, shapes, setup, compute, steps)


class Plan(NamedTuple):
  family: str
  law: Law
  settings_text: str
  bytes: float
  loss: float
  loss_interval: tuple[float, float] | None
  retention: float | None
  retention_interval: tuple[float, float] | None
  seconds: float | None  # to dense's loss; None where the law never reaches it
  equivalent_params: float | None
  memory_gb: float
  fits: bool
  dense_loss: float  # by the law's own source's dense law
  extrapolated: float  # how far outside its fitted sizes (1: inside)


def _retention(law: Law, n: float):
  """The retention the law predicts at ``n`` and its 95% interval (None without draws): the
  percentiles of its bootstrap draws' predictions (:meth:`experiments.scaling.Fit.
  prediction_interval`)."""
  return float(law.retention.law.predict(n)), law.retention.prediction_interval(n)


def plan_family(law: Law, setup: Setup) -> Plan:
  """What ``law``'s family would run at ``setup`` and what its laws predict, against dense's
  loss by the same source's dense law (S1-LM's losses and Charles et al.'s are on different
  data)."""
  n = setup.params
  dense_loss = float(law.dense.predict(n))
  steps = max(1, round(setup.tokens / setup.batch_tokens))
  shapes = stand_in_shapes(n)
  method, settings, exchange, sent = solved(law.family, shapes, setup.workers, steps)
  every = registry.steps_per_exchange(method, settings)
  carrier = registry.get(method).carrier(settings) if registry.get(method).carrier else None
  text = (f"{SETTINGS[law.family].text}; method={method}"
          + (f", H={every}, exchange={carrier}" if carrier else "")
          + (f", {SETTINGS[law.family].ratio:g}x fewer bytes" if SETTINGS[law.family].ratio
             else "")
          + (f", freeze_step={settings.freeze_step}" if SETTINGS[law.family].warmup is not None
             else ""))
  retention = interval = loss_interval = None
  loss = float(law.loss.predict(n))
  if law.retention is not None and law.solo is not None:
    retention, interval = _retention(law, n)
    solo = float(law.solo.predict(n))
    to_loss = lambda r: solo - r * (solo - dense_loss)
    loss = to_loss(retention)
    loss_interval = None if interval is None else (to_loss(interval[1]), to_loss(interval[0]))
  equivalent = None
  if law.loss.alpha < 0:
    equivalent = (dense_loss / law.loss.A) ** (1 / law.loss.alpha)
  seconds = (run_seconds(law.family, equivalent, setup)
             if equivalent is not None and equivalent <= 100 * n else None)
  memory = STATE_BYTES[law.family] * n / 1e9
  return Plan(law.family, law, text, sent, loss, loss_interval, retention, interval, seconds,
              equivalent, memory, setup.memory_gb is None or memory <= setup.memory_gb,
              dense_loss, extrapolation(law, n))


FAR = 10.0  # a law used more than this factor outside its fitted sizes is extrapolated far


def extrapolation(law: Law, params: float) -> float:
  """How many times outside ``law``'s fitted sizes ``params`` is (1 inside them)."""
  low, high = law.sizes
  return max(1.0, low / params, params / high)


def warnings_for(laws: dict[str, Law], setup: Setup) -> list[str]:
  """Where the plan extrapolates: beyond the fitted sizes, off 20 tokens a parameter, or (the
  published law) off its 8 replicas; and laws fitted before their grid had finished."""
  out = []
  unfinished = [f"{law.family}'s ({law.grid})" for law in laws.values()
                if provisional(law.grid)]
  if unfinished:
    out.append(f"S1-LM's grid had not finished its rows for these laws: {'; '.join(unfinished)}"
               ": they are provisional (python -m experiments.reproduce --target=s1_lm resumes "
               "the grid)")
  per_param = setup.tokens / setup.params
  if not 0.5 <= per_param / TOKENS_PER_PARAM <= 2:
    out.append(f"{per_param:.3g} tokens a parameter: every law is at {TOKENS_PER_PARAM}; the "
               "predictions extrapolate in tokens")
  for law in laws.values():
    low, high = law.sizes
    factor = extrapolation(law, setup.params)
    if factor > 1:
      out.append(f"{law.family}: {setup.params:.3g} parameters is {factor:.3g}x "
                 f"{'below' if setup.params < low else 'beyond'} its law's fitted sizes "
                 f"({low:.3g}-{high:.3g}): extrapolated"
                 + (f" far (more than {FAR:g}x)" if factor > FAR else ""))
  workers = sorted({PUBLISHED_REPLICAS if law.source == PUBLISHED else s1_lm.WORKERS
                    for law in laws.values()} - {setup.workers})
  if workers:
    out.append(f"the laws are at {' and '.join(map(str, workers))} workers (S1-LM's grid; the "
               f"published law's replicas); {setup.workers} workers extrapolates in M (Charles "
               "et al.: the gap to data parallel grows with the replicas)")
  return out


def recommend(plans: list[Plan], dense_seconds: float) -> tuple[str, Plan | None]:
  """The family that reaches dense's loss soonest among those that fit in memory, preferring
  laws whose rows have all run (a provisional law, fitted while its grid was still running,
  is printed but recommended only where no finished law is), then laws used within
  :data:`FAR` of their fitted sizes (a law extrapolated further is a hypothesis, which the line
  says, as it names a faster law set aside for either reason); dense where none beats dense's
  time."""
  ready = [p for p in plans if p.fits and p.seconds is not None and p.seconds < dense_seconds]
  held = []
  if any(not provisional(p.law.grid) for p in plans):
    held = [p for p in ready if provisional(p.law.grid)]
    ready = [p for p in ready if not provisional(p.law.grid)]
  near = [p for p in ready if p.extrapolated <= FAR]
  best = min(near or ready, key=lambda p: p.seconds, default=None)
  set_aside = "".join(
      f"; {p.family}'s provisional law (its rows still running) predicts "
      f"{dense_seconds / p.seconds:.3g}x sooner, not recommended until they have run"
      for p in held if best is None or p.seconds < best.seconds)
  set_aside += "".join(
      f"; {p.family}'s law, extrapolated {p.extrapolated:.3g}x beyond its fitted sizes, "
      f"predicts {dense_seconds / p.seconds:.3g}x sooner, not recommended over a law used "
      f"within {FAR:g}x of its own" for p in ready
      if near and p.extrapolated > FAR and p.seconds < best.seconds)
  if best is None:
    return ("dense (bf16 all-reduce overlapped with the backward pass): no family with a "
            f"{'finished ' if held else ''}law reaches dense's predicted loss sooner "
            f"here{set_aside}", None)
  caveat = ("" if best.extrapolated <= FAR else
            f"; its law is extrapolated {best.extrapolated:.3g}x beyond its fitted sizes, and "
            f"every law that beats dense here more than {FAR:g}x: a hypothesis to test, not a "
            "prediction") + set_aside
  return (f"{best.family} ({best.settings_text}): dense's predicted loss in "
          f"{_duration(best.seconds)} against dense's {_duration(dense_seconds)}, "
          f"{dense_seconds / best.seconds:.3g}x sooner; rests on the {best.law.label}, from "
          f"{best.law.runs}{caveat}", best)


def _duration(seconds: float) -> str:
  if seconds >= 2 * 86400:
    return f"{seconds / 86400:.3g} days"
  return f"{seconds / 3600:.3g} h" if seconds >= 3600 else f"{seconds:.3g} s"


def _interval(values, law: Law) -> str:
  if values:
    return f" [{values[0]:.4g}, {values[1]:.4g}]"
  return (" (no interval: published point estimates)" if law.source == PUBLISHED
          else " (no interval: one seed a size)")


def plan_lines(plan: Plan, dense_seconds: float) -> list[str]:
  dense_loss = plan.dense_loss
  lines = [f"{plan.family} ({plan.law.label}):", f"  runs: {plan.settings_text}",
           f"  bytes a step (equal-bytes solver): {plan.bytes:,.0f}"]
  if plan.retention is not None:
    lines.append(f"  predicted retention: {plan.retention:.3f}"
                 f"{_interval(plan.retention_interval, plan.law)}")
  else:
    lines.append("  predicted retention: not predicted (no solo law published)")
  lines.append(f"  predicted loss: {plan.loss:.4f}{_interval(plan.loss_interval, plan.law)} "
               f"({100 * (plan.loss / dense_loss - 1):+.2f}% over dense's {dense_loss:.4f})")
  if plan.seconds is None:
    lines.append("  time to dense's loss: not reached under its law")
  else:
    lines.append(f"  time to dense's loss: {_duration(plan.seconds)} (a "
                 f"{plan.equivalent_params:.3g}-parameter model per its law) against dense's "
                 f"{_duration(dense_seconds)}: {dense_seconds / plan.seconds:.3g}x")
  lines.append(f"  memory: {plan.memory_gb:.3g} GB of state a worker"
               + ("" if plan.fits else " (does not fit --memory_gb)"))
  return lines


def plan(setup: Setup, laws: dict[str, Law], missing: Sequence[str]) -> tuple[list[str], Any]:
  """The printed lines and the recommended :class:`Plan` (None: dense)."""
  dense_seconds = run_seconds("dense", setup.params, setup)
  steps = max(1, round(setup.tokens / setup.batch_tokens))
  lines = [f"setup: {setup.params:.4g} parameters, {setup.tokens:.4g} tokens "
           f"({setup.tokens / setup.params:.3g} a parameter), {setup.workers} workers, "
           f"{setup.link.name}; {steps:,} steps of {setup.batch_tokens:,.0f} tokens; compute "
           f"{setup.compute:.4g} s a step ({setup.compute_text})"]
  # One dense line per source of laws (S1-LM's fits, the published law): each family's loss is
  # set against its own source's dense.
  sources = {}
  for law in laws.values():
    sources.setdefault(law.source, law.dense)
  for source, dense_law in sources.items():
    lines.append(f"dense (bf16 all-reduce overlapped with the backward pass): "
                 f"{_duration(dense_seconds)} for the run, predicted loss "
                 f"{float(dense_law.predict(setup.params)):.4f} "
                 f"(L = {dense_law.A:g} N^{dense_law.alpha:g}, {source})")
  lines.append("")
  plans = [plan_family(law, setup) for law in laws.values()]
  for p in plans:
    lines += plan_lines(p, dense_seconds)
  lines += [f"{family}: no law yet (S1-LM has not run it: python -m experiments.reproduce "
            "--target=s1_lm)" for family in missing]
  text, best = recommend(plans, dense_seconds)
  lines += ["", f"recommended: {text}"]
  lines += [f"warning: {w}" for w in warnings_for(laws, setup)]
  return lines, best


def _positive(name: str, value, *, integer: bool = False, zero: bool = False) -> None:
  ok = value is not None and math.isfinite(value) and (value >= 0 if zero else value > 0)
  if integer:
    ok = ok and float(value).is_integer() and value >= 2
  if not ok:
    allowed = "an integer >= 2" if integer else ("a number >= 0" if zero else "a number > 0")
    raise ValueError(f"--{name}={value:g}: allowed {allowed}")


def parse(argv: Sequence[str]) -> argparse.Namespace:
  from experiments import cli  # pylint: disable=import-outside-toplevel  # loads the runner
  parser = cli.ArgumentParser(prog=f"python -m {PROGRAM}", description=__doc__.split("\n")[0])
  for name in ("params", "tokens", "workers", "bandwidth_gbit"):
    parser.add_argument(f"--{name}", type=float, required=True)
  parser.add_argument("--latency_us", type=float, default=50.0)
  parser.add_argument("--step_seconds", type=float, default=None)
  parser.add_argument("--device", default="h100", choices=sorted(DEVICES))
  parser.add_argument("--batch_tokens", type=float, default=None)
  parser.add_argument("--memory_gb", type=float, default=None)
  parser.add_argument("--fits", default=FITS_PATH)
  parser.add_argument("--write_config", default="")
  parser.add_argument(cli.VERBOSE_FLAG, action="store_true", help=cli.VERBOSE_HELP)
  args = parser.parse_args(argv)
  for name in ("params", "tokens", "bandwidth_gbit"):
    _positive(name, getattr(args, name))
  _positive("workers", args.workers, integer=True)
  _positive("latency_us", args.latency_us, zero=True)
  for name in ("step_seconds", "batch_tokens", "memory_gb"):
    if getattr(args, name) is not None:
      _positive(name, getattr(args, name))
  return args


def make_setup(args: argparse.Namespace) -> Setup:
  link = dataclasses.replace(topo.CLOUD_10G, alpha=args.latency_us * 1e-6,
                             bandwidth=args.bandwidth_gbit * 1e9 / 8,
                             name=f"{args.bandwidth_gbit:g} Gbit/s, {args.latency_us:g} us")
  workers = int(args.workers)
  batch = args.batch_tokens or min(2.0 ** 20, args.tokens / 1000)
  compute, text = compute_seconds(args.params, batch / workers, args.step_seconds, args.device)
  return Setup(args.params, args.tokens, workers, link, batch, compute, text, args.memory_gb)


def config_override(best: Plan | None, setup: Setup) -> dict:
  """The recommended settings as a config override (``config.method`` and its block)."""
  if best is None:
    return {"method": "bf16"}
  steps = max(1, round(setup.tokens / setup.batch_tokens))
  method, settings, exchange, _ = solved(best.family, stand_in_shapes(setup.params),
                                         setup.workers, steps)
  block = {"method": method, "compression": {method: dataclasses.asdict(settings)}}
  if exchange is not None:
    block["compression"][registry.get(method).carrier(settings)] = dataclasses.asdict(exchange)
  return block


def main(argv: Sequence[str] | None = None) -> None:
  """``python -m experiments.plan``: prints the plan; bad input is one line on stderr, exit
  status 1."""
  from experiments import cli  # pylint: disable=import-outside-toplevel  # see parse
  argv = sys.argv[1:] if argv is None else list(argv)
  with cli.errors_in_one_line(PROGRAM, show_traceback=cli.verbose(argv)):
    args = parse(argv)
    setup = make_setup(args)
    lines, best = plan(setup, *read_laws(args.fits))
    print("\n".join(lines))
    if args.write_config:
      with open(args.write_config, "w", encoding="utf-8") as f:
        json.dump(config_override(best, setup), f, indent=1, default=str)
      print(f"wrote the recommended settings to {args.write_config}")


if __name__ == "__main__":
  main()
