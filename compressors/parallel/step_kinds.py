"""Step kinds: the different programs a method runs at different steps, and which runs when.

A method may run different programs at different steps: TASC refreshes its curvature every ``N``
steps (an input of its update the other steps lack), a local-update method synchronises every
``H`` steps and runs local steps in between, 1-bit Adam runs dense Adam for a warm-up and then
compresses, a sparsifier's density warm-up sends more in its first steps. Each
:class:`StepKind` names one program: the steps it runs at (a period and phase within a range of
steps) and what it passes to the update (inputs made from the worker's loss, and static
options). :func:`compressors.data_parallel` compiles each kind once and reads each kind's bytes
from its own program, so that a run is charged the bytes of the steps it actually ran
(:func:`kind_counts`).

Which kind runs at a step: of the kinds whose range holds the step and whose period and phase
match it, the one of the largest ``every`` (:func:`kind_at`); :func:`checked` refuses kinds that
leave a step to no kind or to two of the same ``every``.
"""

from collections.abc import Callable, Mapping, Sequence
import math
from typing import Any, NamedTuple

import numpy as np


class StepKind(NamedTuple):
  """One kind of step: its name, the steps it runs at, and what it passes to the update.

  Attributes:
    name: what the kind is called (``DataParallel.kinds`` keys, logs).
    every: the kind runs at the steps ``s`` with ``s % every == phase`` (1: every step of its
      range not claimed by a kind of larger ``every``).
    inputs: ``(loss_fn, params, batch, key, axis_name) -> dict`` of keyword arguments for the
      update, made from the worker's loss (``registry.StepInputs.make``), or None.
    options: static keyword arguments for the update (Python values the trace sees, e.g.
      ``{"synchronise": True}``), or None.
    phase: see ``every`` (``0 <= phase < every``).
    start: the first step the kind may run at.
    stop: the step before which it stops (None: never).
  """
  name: str
  every: int = 1
  inputs: Callable[..., dict[str, Any]] | None = None
  options: Mapping[str, Any] | None = None
  phase: int = 0
  start: int = 0
  stop: int | None = None

  def runs_at(self, steps: np.ndarray) -> np.ndarray:
    """Whether the kind's period, phase and range hold each of ``steps`` (ints)."""
    steps = np.asarray(steps)
    inside = (steps >= self.start) & (True if self.stop is None else steps < self.stop)
    return inside & (steps % self.every == self.phase)

  def update_kwargs(self) -> dict[str, Any]:
    """The static options as keyword arguments (the inputs are made per step)."""
    return dict(self.options or {})


def step_kinds(step_inputs: Any = None) -> tuple[StepKind, ...]:
  """The kinds of a method with per-step ``step_inputs`` (``registry.StepInputs`` or None):
  ``"step"`` every step, and ``"with_inputs"`` every ``step_inputs.every`` steps."""
  plain = StepKind("step", 1)
  if step_inputs is None or step_inputs.every <= 0:
    return (plain,)
  if step_inputs.every == 1:
    return (StepKind("with_inputs", 1, step_inputs.make),)
  return (plain, StepKind("with_inputs", step_inputs.every, step_inputs.make))


def in_stages(kinds: Sequence[StepKind], boundaries: Sequence[int],
              options: Sequence[Mapping[str, Any]]) -> tuple[StepKind, ...]:
  """``kinds`` repeated in each stage of training: stage ``j`` covers the steps
  ``boundaries[j - 1], ..., boundaries[j] - 1`` (stage 0 from 0, the last to the end, so there
  is one stage more than boundaries) and adds ``options[j]`` to its kinds' options. A kind's
  name in stage ``j < last`` gets ``"@j"``; the last stage's kinds keep their names.

  E.g. a density warm-up: ``in_stages(kinds, [100, 200], [{"stage": 0}, {"stage": 1}, {}])``.
  """
  if len(options) != len(boundaries) + 1:
    raise ValueError(f"in_stages: {len(boundaries)} boundaries make {len(boundaries) + 1} "
                     f"stages, but {len(options)} options were given")
  if list(boundaries) != sorted(set(boundaries)) or (boundaries and boundaries[0] <= 0):
    raise ValueError(f"in_stages: boundaries={list(boundaries)}; allowed: increasing ints > 0")
  edges = [0, *boundaries, None]
  staged = []
  last = len(boundaries)
  for j, (first, stop, extra) in enumerate(zip(edges, edges[1:], options)):
    for kind in kinds:
      start = max(kind.start, first)
      end = stop if kind.stop is None else kind.stop if stop is None else min(kind.stop, stop)
      if end is not None and end <= start:
        continue
      staged.append(kind._replace(
          name=kind.name if j == last else f"{kind.name}@{j}", start=start, stop=end,
          options={**kind.update_kwargs(), **extra} or None))
  return tuple(staged)


def checked(kinds: Sequence[StepKind], caller: str = "data_parallel") -> tuple[StepKind, ...]:
  """``kinds`` as a tuple, refused when names repeat, a field is out of range, a step is left
  to no kind, or two kinds of the same ``every`` can claim the same step."""
  kinds = tuple(kinds)
  names = [k.name for k in kinds]
  if len(set(names)) != len(names):
    raise ValueError(f"{caller}: kinds={names} repeat a name; each kind needs its own")
  for k in kinds:
    for field, low in (("every", 1), ("phase", 0), ("start", 0)):
      value = getattr(k, field)
      if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{caller}: kind {k.name!r} has {field}={value!r}; allowed: an int "
                         f">= {low}")
    if k.phase >= k.every:
      raise ValueError(f"{caller}: kind {k.name!r} has phase={k.phase} with every={k.every}; "
                       "allowed: 0 <= phase < every")
    if k.stop is not None and (not isinstance(k.stop, int) or k.stop <= k.start):
      raise ValueError(f"{caller}: kind {k.name!r} has stop={k.stop!r} with start={k.start}; "
                       "allowed: None or an int > start")
  # Every pattern repeats with the lcm of the periods after the last range edge.
  edges = [k.start for k in kinds] + [k.stop for k in kinds if k.stop is not None]
  period = math.lcm(*(k.every for k in kinds))
  steps = np.arange(max(edges) + period)
  plain = np.stack([k.runs_at(steps) for k in kinds if k.every == 1] or [steps < 0])
  uncovered = np.flatnonzero(plain.sum(0) != 1)
  if uncovered.size:
    step = int(uncovered[0])
    raise ValueError(f"{caller}: kinds {names} give step {step} to {int(plain[:, step].sum())} "
                     "kinds of every=1; the every=1 kinds' ranges must cover each step once")
  for every in {k.every for k in kinds if k.every > 1}:
    same = np.stack([k.runs_at(steps) for k in kinds if k.every == every])
    if (same.sum(0) > 1).any():
      step = int(np.flatnonzero(same.sum(0) > 1)[0])
      raise ValueError(f"{caller}: two kinds of every={every} run at step {step}; give them "
                       "different phases or ranges")
  return kinds


class Programs(dict):
  """Kind name -> the name of the kind whose program it runs; looking up a name that is no kind
  (a step's ``kind=`` argument) is refused naming the kinds there are."""

  def __missing__(self, kind):
    raise ValueError(f"kind={kind!r} is not a step kind of this method; allowed: {sorted(self)}")


def same_programs(kinds: Sequence[StepKind]) -> Programs:
  """Kind name -> the name of the first kind that runs the same program (the same inputs and
  options: kinds that differ only in when they run), so that each program compiles once."""
  first = {}
  return Programs({k.name: first.setdefault(
      (id(k.inputs), tuple(sorted(k.update_kwargs().items()))), k.name) for k in kinds})


def steady(kinds: Sequence[StepKind]) -> str:
  """The name of the kind that runs every step once all ranges have passed (``every=1``, no
  ``stop``): a step's default kind."""
  return next(k.name for k in kinds if k.every == 1 and k.stop is None)


def kind_at(kinds: Sequence[StepKind], step: int) -> str:
  """The name of the kind that runs at ``step`` (of those that may, the largest ``every``)."""
  return max((k for k in kinds if k.runs_at(step)), key=lambda k: k.every).name


def kind_counts(kinds: Sequence[StepKind], start: int, stop: int) -> dict[str, int]:
  """How many of the steps ``start, ..., stop - 1`` each kind runs."""
  steps = np.arange(start, stop)
  claimed = np.zeros(steps.shape, bool)
  counts = {}
  for kind in sorted(kinds, key=lambda k: -k.every):
    mine = kind.runs_at(steps) & ~claimed
    counts[kind.name] = int(mine.sum())
    claimed |= mine
  return counts
