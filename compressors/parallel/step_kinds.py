"""Step kinds' schedule: which of a method's programs runs at which step.

A method may run different programs at different steps: TASC refreshes its curvature every ``N``
steps (an input of its update the other steps lack), a local-update method synchronises every
``H`` steps and runs local steps in between, 1-bit Adam runs dense Adam for a warm-up and then
compresses, a sparsifier's density warm-up sends more in its first steps. Each
:class:`compressors.method_protocol.StepKind` (the method declares them) names one program: the
steps it runs at (a period and phase within a range of steps) and what it passes to the update
(inputs made from the worker's loss, and static options). :func:`compressors.data_parallel`
compiles each kind once and reads each kind's bytes from its own program, so that a run is
charged the bytes of the steps it actually ran (:func:`kind_counts`).

Which kind runs at a step: of the kinds whose range holds the step and whose period and phase
match it, the one of the largest ``every`` (:func:`kind_at`); :func:`checked` refuses kinds that
leave a step to no kind or to two of the same ``every``.
"""

from collections.abc import Sequence
import math

import numpy as np

from compressors.method_protocol import StepKind


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


# What a method declares moved to the method protocol; old imports get a one-line error.
_MOVED = {"step_kinds": "compressors.method_protocol.step_kinds",
          "in_stages": "compressors.method_protocol.in_stages"}


def __getattr__(name):
  if name in _MOVED:
    raise AttributeError(f"compressors.parallel.step_kinds.{name} is now {_MOVED[name]}")
  raise AttributeError(f"module 'compressors.parallel.step_kinds' has no attribute {name!r}")
