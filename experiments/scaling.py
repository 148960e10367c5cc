"""Scaling-law fits of loss (and of retention, and of the tuned learning rate) against model size,
with bootstrap intervals over seeds and a leave-the-largest-out check.

  python -m experiments.scaling fit FILE.csv [--method=log|nonlinear] [--draws=1000] [--seed=0]

``FILE.csv`` has the columns ``params`` and ``loss``, and optionally ``workers`` (M, the workers
or DiLoCo replicas), ``tokens``, ``seed`` and ``family`` (each family is fitted on its own).
``tokens`` is checked but not fitted: each law is one in N at one rule for the token budget (as
Charles et al.'s 20 tokens a parameter).

The forms:

- :class:`PowerLaw`, ``L = A N^alpha`` (Kaplan et al. 2020, "Scaling Laws for Neural Language
  Models", arXiv 2001.08361), fitted by least squares on ``log L = log A + alpha log N``
  (``method="log"``, the command line's default) or on ``L`` itself (``method="nonlinear"``).
  The log fit is the default: it is closed-form (no start, no local minimum), it weighs each size's
  relative error alike (a loss's seed-to-seed noise scales with it), and it reproduces Charles
  et al.'s published fits (A within 0.4%, alpha within 1.5e-4) where the fit in loss units is
  1.7-2.2% off in A (``tests/test_scaling.py``).
- :class:`CharlesLaw`, ``L = A N^(alpha + beta M) + C`` (Charles et al. 2025, "Communication-
  Efficient Language Model Training Scales Reliably and Robustly: Scaling Laws for DiLoCo",
  arXiv 2503.09799), by nonlinear least squares in loss units from several starts, ``C`` in
  ``[0, min L)``. Refused where the data have fewer distinct ``(params, workers)`` points than
  its 4 parameters.
- :class:`JointLaw`, ``L = A N^alpha M^gamma`` (Charles et al.'s joint law), by least squares
  in log space.
- :class:`RetentionLaw`, ``retention = 1 - A N^alpha``: the retained share of communication's
  benefit (as ``experiments/reproduce/stats.py`` computes it). Its gap to 1 is a power law, so the law never predicts more than all of the benefit
  (a line in ``log N`` crosses 1 and keeps rising) and, with ``alpha < 0``, tends to 1, as
  Charles et al.'s DiLoCo-to-data-parallel gap shrinks with size. Fitted by least squares on
  the retention itself (a seed's retention may exceed 1, and its noise is additive), started
  from the log fit of each size's mean gap. :func:`crossing` predicts the size where it reaches a
  level.
- The tuned learning rate against size: a :class:`PowerLaw` (:func:`fit_learning_rate`).

Intervals (:func:`bootstrap`): each draw resamples, with replacement, the seeds of each model
size (and workers value), refits, and the 95% interval is the draws' 2.5th and 97.5th
percentiles; the same ``seed`` gives the same draws. Where every size has one seed there is
nothing to resample and there is no interval: resampling a 5-point fit's residuals would treat a
law's systematic misfit as noise and its 3 degrees of freedom as many. A size with one seed among
sizes with more keeps its one loss in every draw.

This module imports numpy and scipy only (no JAX, no runner), so that it is cheap to import;
its command line reuses :mod:`experiments.cli`'s one-line errors, imported when it runs.
"""

import argparse
import csv
import functools
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
from scipy import optimize

PROGRAM = "experiments.scaling"
# The command line's columns: required, then optional.
REQUIRED_COLUMNS = ("params", "loss")
OPTIONAL_COLUMNS = ("workers", "tokens", "seed", "family")
# A crossing beyond this many times the largest fitted size is not predicted.
EXTRAPOLATION_LIMIT = 10.0
NOT_WITHIN = f"not within {EXTRAPOLATION_LIMIT:g}x of the fitted range"
# A law at or above the level from the smallest size fitted: no crossing inside the range.
KEPT_THROUGHOUT = "reached at or below the smallest size fitted"


class Runs(NamedTuple):
  """One row per run: its model size, the fitted quantity (a loss, a retention, a learning
  rate), its number of workers M and its seed (a label; rows of one size and M are its seeds)."""
  params: np.ndarray
  value: np.ndarray
  workers: np.ndarray
  seed: np.ndarray

  def select(self, mask: np.ndarray) -> "Runs":
    return Runs(*(field[mask] for field in self))

  def sizes(self) -> np.ndarray:
    return np.unique(self.params)

  def groups(self) -> list[np.ndarray]:
    """The row indices of each ``(params, workers)`` point: the point's seeds."""
    keys = np.stack([self.params, self.workers], axis=1)
    _, labels = np.unique(keys, axis=0, return_inverse=True)
    return [np.flatnonzero(labels.ravel() == g) for g in range(labels.max() + 1)]


def make_runs(params: Sequence[float], value: Sequence[float],
              workers: Sequence[float] | None = None, seed: Sequence[Any] | None = None, *,
              what: str = "loss") -> Runs:
  """:class:`Runs` from columns, checked: sizes and values positive and finite.

  Args:
    params: each run's number of parameters N.
    value: each run's fitted quantity.
    workers: each run's M (default 1).
    seed: each run's seed (default: the row's number, so repeated sizes are distinct seeds).
    what: the quantity's name, for the messages; ``"retention"`` allows any finite value (a
      seed may keep more than all of communication's benefit, or less than none).

  Returns:
    The runs, as float64 arrays (the seeds as given).

  Raises:
    ValueError: a column of another length, a non-positive or non-finite size or M, a
      non-positive loss or learning rate, a non-finite retention, or two rows of one size, M
      and seed.
  """
  params, value = np.asarray(params, np.float64), np.asarray(value, np.float64)
  n = len(params)
  workers = np.ones(n) if workers is None else np.asarray(workers, np.float64)
  seed = np.arange(n) if seed is None else np.asarray(seed)
  if not len(value) == len(workers) == len(seed) == n:
    raise ValueError(f"params, {what}, workers and seed have different lengths "
                     f"({n}, {len(value)}, {len(workers)}, {len(seed)})")
  for name, column in (("params", params), ("workers", workers)):
    _check_positive(name, column)
  if what == "retention":
    bad = ~np.isfinite(value)
    if bad.any():
      raise ValueError(f"retention={float(value[bad][0])!r}: allowed a finite number")
  else:
    _check_positive(what, value)
  seen = set()
  for key in zip(params, workers, seed):
    if key in seen:
      raise ValueError(f"two rows have params={key[0]:g}, workers={key[1]:g}, seed={key[2]}: "
                       "a seed is run once at a size and M")
    seen.add(key)
  return Runs(params, value, workers, seed)


def _check_positive(name: str, column: np.ndarray) -> None:
  bad = ~(np.isfinite(column) & (column > 0))
  if bad.any():
    raise ValueError(f"{name}={float(column[bad][0])!r}: allowed a finite number > 0")


class PowerLaw(NamedTuple):
  """``y = A N^alpha`` (Kaplan et al. 2020)."""
  A: float
  alpha: float

  def predict(self, params, workers=1.0):
    del workers  # one law for one M
    return self.A * np.asarray(params, np.float64) ** self.alpha


class CharlesLaw(NamedTuple):
  """``L = A N^(alpha + beta M) + C`` (Charles et al. 2025), M the workers (replicas)."""
  A: float
  alpha: float
  beta: float
  C: float

  def predict(self, params, workers=1.0):
    return self.A * np.asarray(params, np.float64) ** (self.alpha + self.beta * workers) + self.C


class JointLaw(NamedTuple):
  """``L = A N^alpha M^gamma`` (Charles et al. 2025's joint law in N and M)."""
  A: float
  alpha: float
  gamma: float

  def predict(self, params, workers=1.0):
    return (self.A * np.asarray(params, np.float64) ** self.alpha
            * np.asarray(workers, np.float64) ** self.gamma)


class RetentionLaw(NamedTuple):
  """``retention = 1 - A N^alpha``: the gap to all of communication's benefit, a power law."""
  A: float
  alpha: float

  def predict(self, params, workers=1.0):
    del workers
    return 1.0 - self.A * np.asarray(params, np.float64) ** self.alpha

  def params_at(self, level: float) -> float:
    """The size where the law reaches ``level``; ``inf`` where it never does (``alpha >= 0``:
    the gap does not shrink)."""
    if self.alpha >= 0:
      return np.inf
    # In logarithms: an alpha near 0 puts the size past a float's range (infinite, not an
    # overflow).
    log_size = np.log((1.0 - level) / self.A) / self.alpha
    return float(np.exp(log_size)) if log_size < np.log(np.finfo(np.float64).max) else np.inf


def _need_sizes(runs: Runs, count: int, form: str) -> None:
  if len(runs.sizes()) < count:
    raise ValueError(f"{form}: needs at least {count} model sizes, the data have "
                     f"{len(runs.sizes())} ({', '.join(f'{p:g}' for p in runs.sizes())})")


def _log_least_squares(columns: Sequence[np.ndarray], y: np.ndarray) -> np.ndarray:
  """Least-squares coefficients of ``log y`` on an intercept and ``columns``."""
  design = np.stack([np.ones_like(y), *columns], axis=1)
  return np.linalg.lstsq(design, np.log(y), rcond=None)[0]


def fit_power_law(runs: Runs, method: str = "log") -> PowerLaw:
  """Fits ``y = A N^alpha`` to every row (all seeds, all M: select one M first).

  Args:
    runs: the runs, two sizes or more.
    method: ``"log"``: least squares on ``log y`` (closed form; the command line's default);
      ``"nonlinear"``: least squares on ``y`` itself, started from the log fit.

  Returns:
    The fitted law.

  Raises:
    ValueError: fewer than 2 sizes, or another method.
  """
  if method not in ("log", "nonlinear"):
    raise ValueError(f"method={method!r}: allowed 'log' or 'nonlinear'")
  _need_sizes(runs, 2, "L = A N^alpha")
  log_a, alpha = _log_least_squares([np.log(runs.params)], runs.value)
  if method == "log":
    return PowerLaw(float(np.exp(log_a)), float(alpha))
  # On log A, not A: the two coefficients are then of one scale for the solver.
  solution = optimize.least_squares(
      lambda p: np.exp(p[0]) * runs.params ** p[1] - runs.value, [log_a, alpha], method="lm")
  return PowerLaw(float(np.exp(solution.x[0])), float(solution.x[1]))


def fit_joint(runs: Runs) -> JointLaw:
  """Fits ``L = A N^alpha M^gamma`` by least squares on ``log L``.

  Raises:
    ValueError: fewer than 2 sizes or 2 values of M.
  """
  _need_sizes(runs, 2, "L = A N^alpha M^gamma")
  if len(np.unique(runs.workers)) < 2:
    raise ValueError("L = A N^alpha M^gamma: needs at least 2 values of workers")
  log_a, alpha, gamma = _log_least_squares([np.log(runs.params), np.log(runs.workers)],
                                           runs.value)
  return JointLaw(float(np.exp(log_a)), float(alpha), float(gamma))


def fit_charles(runs: Runs, start: CharlesLaw | None = None) -> CharlesLaw:
  """Fits ``L = A N^(alpha + beta M) + C`` (Charles et al. 2025) by nonlinear least squares on
  ``L``, ``C`` bounded to ``[0, min L)``.

  Without ``start`` it starts from ``C = 0``, ``0.5 min L`` and ``0.9 min L``, each with the log
  fit of ``L - C`` for ``A``, ``alpha`` and ``beta``, and keeps the best; the bootstrap passes the
  point estimate as ``start`` (one start a draw, for speed).

  Args:
    runs: the runs; at least 4 distinct ``(params, workers)`` points.
    start: the one start, if given.

  Returns:
    The fitted law.

  Raises:
    ValueError: fewer distinct points than the law's 4 parameters, or one value of M (beta
      multiplies it: with one, alpha and beta are one number).
  """
  points = len(runs.groups())
  if points < len(CharlesLaw._fields):
    raise ValueError(f"L = A N^(alpha + beta M) + C has {len(CharlesLaw._fields)} parameters; "
                     f"the data have {points} distinct (params, workers) points")
  if len(np.unique(runs.workers)) < 2:
    raise ValueError("L = A N^(alpha + beta M) + C: needs at least 2 values of workers")
  log_n, floor = np.log(runs.params), runs.value.min()

  def residuals(p):  # p: log A, alpha, beta, C (log A: of one scale with the others)
    return np.exp(p[0] + (p[1] + p[2] * runs.workers) * log_n) + p[3] - runs.value

  if start is not None:
    starts = [[np.log(start.A), start.alpha, start.beta, start.C]]
  else:
    starts = []
    for c in (0.0, 0.5 * floor, 0.9 * floor):
      log_a, alpha, beta = _log_least_squares([log_n, runs.workers * log_n], runs.value - c)
      starts.append([log_a, alpha, beta, c])
  upper_c = floor * (1 - 1e-9)
  bounds = ([-np.inf, -np.inf, -np.inf, 0.0], [np.inf, np.inf, np.inf, upper_c])
  best = min((optimize.least_squares(residuals, np.clip(x, *bounds), bounds=bounds)
              for x in starts), key=lambda s: s.cost)
  log_a, alpha, beta, c = best.x
  return CharlesLaw(float(np.exp(log_a)), float(alpha), float(beta), float(c))


# The smallest gap ``1 - retention`` a point's mean is taken as when it starts the retention fit:
# a family that keeps all of communication's benefit has no gap whose logarithm could start it.
_START_GAP = 1e-3


def fit_retention(runs: Runs) -> RetentionLaw:
  """Fits ``retention = 1 - A N^alpha`` by least squares on the retention itself, started from
  the log fit of each point's mean gap ``1 - retention`` (held at 0.001 or more).

  Least squares on the retention, not on ``log(1 - retention)``: a seed's noise in its loss is
  additive in its retention, and a family that keeps all of communication's benefit has seeds
  above 1, whose gap has no logarithm (``A`` stays positive: the law's gap is).

  Args:
    runs: ``value`` the retention of each run (:func:`make_runs` with ``what="retention"``),
      two sizes or more.

  Returns:
    The fitted law.
  """
  _need_sizes(runs, 2, "retention = 1 - A N^alpha")
  groups = runs.groups()
  means = np.array([runs.value[g].mean() for g in groups])
  sizes = np.array([runs.params[g[0]] for g in groups])
  log_a, alpha = _log_least_squares([np.log(sizes)], np.maximum(1.0 - means, _START_GAP))
  solution = optimize.least_squares(
      lambda p: 1.0 - np.exp(p[0]) * runs.params ** p[1] - runs.value, [log_a, alpha],
      method="lm")
  return RetentionLaw(float(np.exp(solution.x[0])), float(solution.x[1]))


def fit_learning_rate(runs: Runs) -> PowerLaw:
  """Fits the tuned learning rate ``lr = A N^alpha`` (a power law, by least squares in log
  space), ``value`` each size's tuned rate."""
  return fit_power_law(runs)


class Fit(NamedTuple):
  """A fitted law with its bootstrap draws (``draws``: one row of the law's fields a draw;
  ``None`` where every size has one seed) and the largest and smallest sizes it was fitted on."""
  law: Any
  draws: np.ndarray | None
  largest_params: float
  smallest_params: float

  def interval(self, name: str, level: float = 0.95) -> tuple[float, float] | None:
    """The ``level`` percentile interval of the law's field ``name``; ``None`` without draws."""
    if self.draws is None:
      return None
    column = self.draws[:, type(self.law)._fields.index(name)]
    return _percentiles(column, level)

  def prediction_interval(self, params: float, level: float = 0.95,
                          workers: float = 1.0) -> tuple[float, float] | None:
    """The ``level`` percentile interval of the draws' predictions at ``params`` (and
    ``workers``); ``None`` without draws. A prediction's interval, not one built from the
    coefficients' intervals apart: ``A`` and ``alpha`` move together (a steeper law starts
    higher), and a poorly fitted law's draws are far from normal."""
    if self.draws is None:
      return None
    kind = type(self.law)
    return _percentiles(np.array([kind(*row).predict(params, workers) for row in self.draws],
                                 np.float64), level)


def _percentiles(values: np.ndarray, level: float) -> tuple[float, float]:
  tail = 100 * (1 - level) / 2
  # "lower"/"higher": an infinite value (a crossing that never comes) stays infinite, where
  # interpolating between it and a finite one would give inf - inf = nan.
  return (float(np.percentile(values, tail, method="lower")),
          float(np.percentile(values, 100 - tail, method="higher")))


def bootstrap(fit: Callable[[Runs], Any], runs: Runs, *, draws: int = 1000,
              seed: int = 0) -> Fit:
  """Fits ``runs`` and, where some size has 2 seeds or more, ``draws`` refits of seeds
  resampled with replacement within each ``(params, workers)`` point.

  Args:
    fit: a fit function (``fit_power_law``, ``fit_charles``, ...).
    runs: the runs.
    draws: the number of bootstrap draws.
    seed: the seed of the draws (the same seed, the same draws).

  Returns:
    The :class:`Fit`.

  Raises:
    ValueError: ``draws`` below 2.
  """
  if draws < 2:
    raise ValueError(f"draws={draws}: allowed 2 or more")
  law = fit(runs)
  groups = runs.groups()
  if max(len(g) for g in groups) < 2:
    return Fit(law, None, float(runs.params.max()), float(runs.params.min()))
  rng = np.random.default_rng(seed)
  rows = []
  for _ in range(draws):
    picked = np.concatenate([g[rng.integers(len(g), size=len(g))] for g in groups])
    rows.append(fit(runs.select(picked)))
  return Fit(law, np.array(rows, np.float64), float(runs.params.max()),
             float(runs.params.min()))


class Holdout(NamedTuple):
  """The leave-the-largest-out check at one M: the law fitted without the largest size,
  predicting it. ``residual = predicted - observed`` (the observed: the seeds' mean),
  ``relative = residual / observed``."""
  params: float
  workers: float
  predicted: float
  observed: float
  residual: float
  relative: float


def leave_largest_out(fit: Callable[[Runs], Any], runs: Runs) -> list[Holdout]:
  """Fits every size but the largest and predicts the largest, at each M it was run with.

  Returns:
    One :class:`Holdout` for each M at the largest size.

  Raises:
    ValueError: the fit refuses what remains (a power law needs 3 sizes in all).
  """
  largest = runs.params.max()
  law = fit(runs.select(runs.params < largest))
  held = runs.select(runs.params == largest)
  found = []
  for m in np.unique(held.workers):
    observed = float(held.value[held.workers == m].mean())
    predicted = float(law.predict(largest, m))
    found.append(Holdout(float(largest), float(m), predicted, observed, predicted - observed,
                         (predicted - observed) / observed))
  return found


class Crossing(NamedTuple):
  """Where a retention law reaches a level: ``params`` (``None`` with its ``reason`` where it
  is not predicted) and the bootstrap's interval (``None`` without draws)."""
  params: float | None
  interval: tuple[float, float] | None
  reason: str = ""


def crossing(fit: Fit, level: float = 0.95, interval_level: float = 0.95) -> Crossing:
  """The model size where a fitted :class:`RetentionLaw` reaches ``level``.

  Args:
    fit: the retention law's :class:`Fit` (:func:`bootstrap` of :func:`fit_retention`).
    level: the retention to reach, below 1.
    interval_level: the interval's coverage, from the bootstrap's draws (their crossings; a
      draw that never reaches ``level`` counts as an infinite size).

  Returns:
    The :class:`Crossing`; its ``reason`` is ``"not within 10x of the fitted range"`` where the
    crossing is beyond 10 times the largest fitted size (or never comes), and
    :data:`KEPT_THROUGHOUT` (with the smallest size) where the law is at ``level`` already there.

  Raises:
    ValueError: a level of 1 or more, or a law that is not a retention law.
  """
  if not isinstance(fit.law, RetentionLaw):
    raise ValueError(f"crossing: needs a RetentionLaw's fit, not {type(fit.law).__name__}")
  if not level < 1:
    raise ValueError(f"level={level!r}: allowed below 1 (1 - A N^alpha never reaches 1)")
  interval = None
  if fit.draws is not None:
    sizes = np.array([RetentionLaw(*row).params_at(level) for row in fit.draws])
    interval = _percentiles(sizes, interval_level)
  if fit.law.predict(fit.smallest_params) >= level:
    return Crossing(None, interval, f"{KEPT_THROUGHOUT} ({fit.smallest_params:.3g} parameters)")
  size = fit.law.params_at(level)
  if size > EXTRAPOLATION_LIMIT * fit.largest_params:
    return Crossing(None, interval, NOT_WITHIN)
  return Crossing(size, interval)


def draws_path(fits_path: str) -> str:
  """Where a fits CSV's bootstrap draws lie: beside it, ``<stem>_draws.csv``."""
  stem, ext = os.path.splitext(fits_path)
  return stem + "_draws" + ext


def read_csv(path: str) -> dict[str, Runs]:
  """Reads the command line's CSV (:data:`REQUIRED_COLUMNS`, optionally
  :data:`OPTIONAL_COLUMNS`) into one :class:`Runs` a family (``""`` without the column).

  Raises:
    FileNotFoundError: no file at ``path``.
    ValueError: a missing column, an empty file, a value that is not a number, a non-positive
      params, loss, workers or tokens, or a family with fewer than 2 sizes; each names the path
      (and the line).
  """
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path}: no such file")
  with open(path, newline="", encoding="utf-8") as f:
    reader = csv.DictReader(f)
    columns = [c.strip() for c in reader.fieldnames or []]
    missing = [c for c in REQUIRED_COLUMNS if c not in columns]
    if missing:
      raise ValueError(f"{path}: no column {missing[0]!r} (its columns: "
                       f"{', '.join(columns) or 'none'}; needed: {', '.join(REQUIRED_COLUMNS)}, "
                       f"optional: {', '.join(OPTIONAL_COLUMNS)})")
    rows = [({k.strip(): (v or "").strip() for k, v in row.items() if k}, reader.line_num)
            for row in reader]
  if not rows:
    raise ValueError(f"{path}: no rows after the header")
  families: dict[str, list] = {}
  for row, line in rows:
    families.setdefault(row.get("family", ""), []).append(_parse_row(row, path, line))
  found = {}
  for family, parsed in families.items():
    params, loss, workers, _, seed = zip(*parsed)  # tokens: checked, not fitted
    try:
      found[family] = make_runs(params, loss, workers, seed)
      _need_sizes(found[family], 2, "a fit")
    except ValueError as e:
      raise ValueError(f"{path}: {f'family {family!r}: ' if family else ''}{e}") from e
  return found


def _parse_row(row: dict[str, str], path: str, line: int) -> tuple:
  """``(params, loss, workers, tokens, seed)`` of one CSV row; workers 1 and the line as the
  seed where the columns are absent."""
  numbers = {}
  for name in ("params", "loss", "workers", "tokens"):
    text = row.get(name, "")
    if not text and name in ("workers", "tokens"):
      numbers[name] = 1.0
      continue
    try:
      numbers[name] = float(text)
    except ValueError:
      raise ValueError(f"{path}: line {line}: {name}={text!r} is not a number") from None
    if not (np.isfinite(numbers[name]) and numbers[name] > 0):
      raise ValueError(f"{path}: line {line}: {name}={text} is not positive "
                       "(params, loss, workers and tokens must be finite and > 0)")
  return (numbers["params"], numbers["loss"], numbers["workers"], numbers["tokens"],
          row.get("seed") or f"line {line}")


def _number(x: float) -> str:
  return f"{x:.5g}"


def _law_line(fit: Fit) -> str:
  """``A=... [low, high] alpha=... [low, high]`` (each field with its interval, if any)."""
  parts = []
  for name, value in zip(fit.law._fields, fit.law):
    interval = fit.interval(name)
    bounds = f" [{_number(interval[0])}, {_number(interval[1])}]" if interval else ""
    parts.append(f"{name}={_number(value)}{bounds}")
  return " ".join(parts) + ("" if fit.draws is not None else
                            " (no interval: one seed per size)")


def _holdout_line(fit: Callable[[Runs], Any], runs: Runs) -> str:
  try:
    held = leave_largest_out(fit, runs)
  except ValueError as e:
    return f"leave-largest-out: not checked (without the largest size, {e})"
  return f"leave-largest-out at N={held[0].params:g}: " + "; ".join(
      (f"M={h.workers:g} " if len(held) > 1 else "")
      + f"predicted {h.predicted:.4f}, observed {h.observed:.4f}, residual {h.residual:+.4f} "
      f"({100 * h.relative:+.2f}%)" for h in held)


def report(runs: Runs, *, method: str = "log", draws: int = 1000, seed: int = 0) -> list[str]:
  """The command line's lines for one family: the power law at each M, and where M varies
  Charles et al.'s law over all M; each with its intervals and its leave-largest-out check."""
  lines = []
  power = functools.partial(fit_power_law, method=method)
  for m in np.unique(runs.workers):
    at_m = runs.select(runs.workers == m)
    seeds = sorted({len(g) for g in at_m.groups()})
    count = f"{seeds[0]}" if len(seeds) == 1 else f"{seeds[0]}-{seeds[-1]}"
    lines.append(f"workers={m:g}: {len(at_m.sizes())} sizes from {at_m.params.min():g} to "
                 f"{at_m.params.max():g}, {count} seed(s) a size")
    lines.append(f"  L = A N^alpha ({method} least squares): "
                 f"{_law_line(bootstrap(power, at_m, draws=draws, seed=seed))}")
    lines.append(f"  {_holdout_line(power, at_m)}")
  if len(np.unique(runs.workers)) > 1:
    lines.append("all workers: L = A N^(alpha + beta M) + C (Charles et al. 2025):")
    try:
      law = fit_charles(runs)
    except ValueError as e:
      lines.append(f"  not fitted: {e}")
      return lines
    warm = functools.partial(fit_charles, start=law)
    lines.append(f"  {_law_line(bootstrap(warm, runs, draws=draws, seed=seed))}")
    lines.append(f"  {_holdout_line(fit_charles, runs)}")
  return lines


def parse(argv: Sequence[str]) -> argparse.Namespace:
  # Imported here: experiments.cli loads the runner (and JAX), which the library needs not.
  from experiments import cli  # pylint: disable=import-outside-toplevel
  parser = cli.ArgumentParser(prog=f"python -m {PROGRAM}", description=__doc__.split("\n")[0])
  commands = parser.add_subparsers(dest="command", required=True)
  fit = commands.add_parser("fit", help="fit the scaling laws of a CSV's losses")
  fit.add_argument("csv", help="the runs: params, loss[, workers, tokens, seed, family]")
  fit.add_argument("--method", choices=("log", "nonlinear"), default="log",
                   help="the power law's least squares: on log L (default) or on L")
  fit.add_argument("--draws", type=int, default=1000, help="bootstrap draws (default 1000)")
  fit.add_argument("--seed", type=int, default=0, help="the bootstrap's seed (default 0)")
  for p in (parser, fit):
    p.add_argument(cli.VERBOSE_FLAG, action="store_true", help=cli.VERBOSE_HELP)
  args = parser.parse_args(argv)
  if args.draws < 2:
    raise ValueError(f"--draws={args.draws}: allowed 2 or more")
  return args


def main(argv: Sequence[str] | None = None) -> None:
  """``python -m experiments.scaling fit FILE.csv``: prints each family's fits; bad input is one
  line on stderr, exit status 1."""
  from experiments import cli  # pylint: disable=import-outside-toplevel  # see parse
  argv = sys.argv[1:] if argv is None else list(argv)
  with cli.errors_in_one_line(PROGRAM, show_traceback=cli.verbose(argv)):
    args = parse(argv)
    for family, runs in read_csv(args.csv).items():
      if family:
        print(f"family {family}:")
      for line in report(runs, method=args.method, draws=args.draws, seed=args.seed):
        print(f"  {line}" if family else line)


if __name__ == "__main__":
  main()
