"""What a method declares to the harness that runs it: its step kinds, and its own parameters.

:func:`compressors.data_parallel` knows no method. A method tells it what it needs through this
protocol, which both sides import (and neither imports the other):

* its *step kinds* (:class:`StepKind`): the different programs it runs at different steps, e.g.
  TASC's curvature refresh every ``N`` steps, a local-update method's synchronisation every
  ``H``, 1-bit Adam's dense warm-up, a sparsifier's density warm-up; :func:`step_kinds` gives
  the kinds of a method whose only difference between steps is a per-step input
  (:class:`StepInputs`), and :func:`in_stages` repeats kinds over stages of training. A kind of
  a method whose parameters differ between workers declares what it synchronises: which part
  of the model it sends (:attr:`StepKind.sends`) and which part lands
  (:attr:`StepKind.lands`), the whole model (:data:`WHOLE_MODEL`) or one part of it (Streaming
  DiLoCo's fragment ``p``);
* for a method whose parameters differ between workers between synchronisations (local
  updates), a state that satisfies :class:`SynchronisingState`: how its updates land on each
  worker's parameters (bit for bit on the synchronised ones after a synchronisation), which of
  them landed so (what a replica check compares), and which parameters are the model to
  evaluate. :func:`apply_local_updates`, :func:`landed_params` and :func:`synchronised_params`
  find that state inside a transformation's state.
"""

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

import chex
import jax
import numpy as np
import optax


class StepInputs(NamedTuple):
  """Inputs a method's ``update`` takes on some steps, and how a trainer makes them.

  Attributes:
    every: steps between fresh inputs (a trainer passes them on steps ``0, every, 2 every...``
      and compiles its step with and without them; 0: never).
    make: ``(loss_fn, params, batch, key, axis_name) -> dict`` of keyword arguments for
      ``update``: ``loss_fn(params, batch)`` is one worker's loss, ``params`` the per-worker
      copy being differentiated, ``key`` fresh for the step, ``axis_name`` the workers' axis.
  """
  every: int
  make: Callable[..., dict[str, Any]]


# A part of the model a step kind sends or lands (StepKind.sends, .lands): the whole model, or
# the index of one of the parts the method deals its parameters into (Method.parts).
WHOLE_MODEL = "model"
Part = int | str


class StepKind(NamedTuple):
  """One kind of step: its name, the steps it runs at, what it passes to the update, and (of a
  method whose parameters differ between workers) what it synchronises.

  Attributes:
    name: what the kind is called (``DataParallel.kinds`` keys, logs).
    every: the kind runs at the steps ``s`` with ``s % every == phase`` (1: every step of its
      range not claimed by a kind of larger ``every``).
    inputs: ``(loss_fn, params, batch, key, axis_name) -> dict`` of keyword arguments for the
      update, made from the worker's loss (:attr:`StepInputs.make`), or None.
    options: static keyword arguments for the update (Python values the trace sees, e.g.
      ``{"synchronise": True}``), or None.
    phase: see ``every`` (``0 <= phase < every``).
    start: the first step the kind may run at.
    stop: the step before which it stops (None: never).
    sends: the part of the model whose pseudo-gradient the step exchanges: :data:`WHOLE_MODEL`,
      a part's index (``Method.parts``), or None (nothing; a per-step method's kinds, which
      exchange every step, leave it None too).
    lands: the part of the model whose synchronised values land on each worker's parameters at
      the end of the step (bit for bit where the method says so:
      :meth:`SynchronisingState.landed`): :data:`WHOLE_MODEL` (every worker then holds the same
      parameters), a part's index, or None.
  """
  name: str
  every: int = 1
  inputs: Callable[..., dict[str, Any]] | None = None
  options: Mapping[str, Any] | None = None
  phase: int = 0
  start: int = 0
  stop: int | None = None
  sends: Part | None = None
  lands: Part | None = None

  @property
  def synchronises(self) -> bool:
    """Whether the whole model lands at the end of the step (every worker's parameters are then
    the synchronised ones)."""
    return self.lands == WHOLE_MODEL

  def runs_at(self, steps: np.ndarray) -> np.ndarray:
    """Whether the kind's period, phase and range hold each of ``steps`` (ints)."""
    steps = np.asarray(steps)
    inside = (steps >= self.start) & (True if self.stop is None else steps < self.stop)
    return inside & (steps % self.every == self.phase)

  def update_kwargs(self) -> dict[str, Any]:
    """The static options as keyword arguments (the inputs are made per step)."""
    return dict(self.options or {})


def step_kinds(step_inputs: StepInputs | None = None) -> tuple[StepKind, ...]:
  """The kinds of a method with per-step ``step_inputs`` (or None): ``"step"`` every step, and
  ``"with_inputs"`` every ``step_inputs.every`` steps."""
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


@runtime_checkable
class SynchronisingState(Protocol):
  """The state of a method whose parameters differ between workers between synchronisations
  (``compressors.data_parallel(..., per_worker_params=True)``), e.g.
  :class:`compressors.LocalUpdatesState`."""

  def land(self, params: chex.ArrayTree, applied: chex.ArrayTree) -> chex.ArrayTree:
    """This worker's parameters after a step: ``applied`` (``params`` plus the step's
    updates), or after a synchronising step the synchronised parameters, bit for bit."""

  def landed(self, params: chex.ArrayTree) -> chex.ArrayTree:
    """``params`` (this worker's, after the step) where they landed on the synchronised
    parameters at the latest step, bit for bit, and this worker's copy of the synchronised
    parameters elsewhere: what must be the same on every worker (the rest of ``params``
    differs between workers by design)."""

  def model_params(self) -> chex.ArrayTree:
    """The parameters of the latest synchronisation, the same on every worker (the model a run
    evaluates)."""


def _synchronising_states(state: chex.ArrayTree) -> list[SynchronisingState]:
  is_synchronising = lambda x: isinstance(x, SynchronisingState)
  return [s for s in jax.tree.leaves(state, is_leaf=is_synchronising) if is_synchronising(s)]


def apply_local_updates(params: chex.ArrayTree, updates: chex.ArrayTree,
                        state: chex.ArrayTree) -> chex.ArrayTree:
  """``optax.apply_updates(params, updates)``, except after a synchronising step of the
  :class:`SynchronisingState` inside ``state`` (the state after the step, e.g. of
  :func:`compressors.local_updates`): then the synchronised parameters themselves, bit for bit
  on every worker. Without such a state, plain ``optax.apply_updates``.

  Raises:
    ValueError: ``state`` holds more than one such state.
  """
  applied = optax.apply_updates(params, updates)
  found = _synchronising_states(state)
  if not found:
    return applied
  if len(found) > 1:
    raise ValueError(f"apply_local_updates: the state holds {len(found)} local_updates states; "
                     "one local-update transformation per chain")
  return found[0].land(params, applied)


def landed_params(params: chex.ArrayTree, state: chex.ArrayTree) -> chex.ArrayTree:
  """:meth:`SynchronisingState.landed` of the state inside ``state`` (after the step that made
  ``params``): what every worker must hold alike; ``params`` themselves without such a state
  (replicated parameters: every entry)."""
  found = _synchronising_states(state)
  return found[0].landed(params) if len(found) == 1 else params


def synchronised_params(state: chex.ArrayTree) -> chex.ArrayTree | None:
  """The synchronised parameters of the :class:`SynchronisingState` inside ``state`` (the model
  a run with local updates evaluates), or None if there is none."""
  found = _synchronising_states(state)
  return found[0].model_params() if len(found) == 1 else None
