"""Density warm-up for every sparsifier (Lin, Han, Mao, Wang & Dally, ICLR 2018, "Deep Gradient
Compression").

DGC sends more in the first epochs, while the gradient changes fastest: the density falls
exponentially from 25% to the target over the first epochs (25%, 6.25%, 1.5625%, 0.4%, then
0.1%). Here any method whose bytes a density sets gets that warm-up: :func:`warmup_densities`
gives the stages' densities, geometric from ``start`` towards the final density, and
:func:`warmup_boundaries` their first steps, in equal stages.

A density is static: it sets the payload's shape. So each stage is its own compiled program, a
step kind (:func:`warmup_kinds`: the static option ``density_stage``), whose bytes
:func:`compressors.data_parallel` reads from its own program; and the transformation of each
stage is the method's own, built with that stage's density (:func:`density_warmup`). All stages
update one state, made at the final density, so the error-feedback residual carries across a
change of stage and nothing that was not sent is lost. That needs states that do not depend on
the density: top-k, random-k, threshold and DGC keep none of their own; TASC keeps one
curvature (and score) per block, so its stages must cut the buffers into the same blocks
(``tasc.tasc_compress(..., block_density=final)``). :func:`density_warmup` checks this at
``init``.

This is DGC's warm-up too (``config.compression.density_warmup_steps`` with
``method="dgc"``): one program per stage, each charged its own bytes, rather than one program
switching between stages, which the compiled program would charge at its densest stage.
"""

from collections.abc import Callable, Sequence
import functools
from typing import Any

import chex
import jax
import jax.numpy as jnp
import optax

from compressors import checks
from compressors import method_protocol
from compressors.method_protocol import StepKind

_CALLER = "density warm-up"


def warmup_densities(final: float, start: float, stages: int) -> tuple[float, ...]:
  """The densities of the warm-up's stages (Lin et al. 2018, DGC's exponential warm-up).

  Stage ``j`` sends ``start * (final / start) ** (j / stages)``, ``j = 0, ..., stages - 1``:
  geometric from ``start`` towards ``final``, which the steps after the warm-up send. DGC's
  ``0.25`` towards ``0.001`` over 4 stages gives 0.25, 0.0629, 0.0158, 0.0040 (DGC's own
  quarters, 0.25 / 4**j, within 2%).

  Args:
    final: the method's own density, in (0, 1].
    start: ``density_warmup_start``, the first stage's density, in (0, 1].
    stages: ``density_warmup_stages``, an int >= 0.

  Returns:
    The ``stages`` densities, none below ``final``; empty when ``start <= final`` or
    ``stages == 0`` (no warm-up).

  Raises:
    TypeError, ValueError: naming the field, the value and what is allowed.
  """
  final = checks.check_fraction(final, "density", _CALLER)
  start = checks.check_fraction(start, "density_warmup_start", _CALLER)
  stages = checks.check_int(stages, "density_warmup_stages", 0, _CALLER)
  if start <= final:
    return ()
  return tuple(max(final, start * (final / start) ** (j / stages)) for j in range(stages))


def warmup_boundaries(steps: int, stages: int) -> tuple[int, ...]:
  """The first steps of stages ``1, ..., stages``: ``stages`` equal stages over ``steps``
  (Lin et al. 2018), the last boundary being ``steps``, after which the final density runs.

  Args:
    steps: ``density_warmup_steps``, an int >= 0 (0: no warm-up).
    stages: ``density_warmup_stages``, an int >= 0 (0: no warm-up); at most ``steps``, so that
      each stage has a step.

  Returns:
    The increasing boundaries (``j * steps // stages``), empty without a warm-up.

  Raises:
    TypeError, ValueError: naming the field, the value and what is allowed.
  """
  steps = checks.check_int(steps, "density_warmup_steps", 0, _CALLER)
  stages = checks.check_int(stages, "density_warmup_stages", 0, _CALLER)
  if not steps or not stages:
    return ()
  if steps < stages:
    raise ValueError(f"{_CALLER}: density_warmup_steps={steps} is fewer than "
                     f"density_warmup_stages={stages}, which leaves a stage no step; allowed: "
                     f"density_warmup_steps=0 (off) or >= {stages}")
  return tuple(j * steps // stages for j in range(1, stages + 1))


def warmup_kinds(kinds: Sequence[StepKind], steps: int, stages: int) -> tuple[StepKind, ...]:
  """``kinds`` in each stage of the warm-up (Lin et al. 2018): stage ``j``'s kinds pass the
  static option ``density_stage=j`` to the update (:func:`density_warmup`) and are named
  ``"<kind>@j"``; after ``steps`` the kinds run as they are.

  Args:
    kinds: the method's step kinds (:func:`compressors.method_protocol.step_kinds`).
    steps: ``density_warmup_steps`` (0: off).
    stages: the number of stages, ``len(warmup_densities(...))`` (0: off).

  Returns:
    The kinds for :func:`compressors.data_parallel`; ``kinds`` unchanged without a warm-up.
  """
  boundaries = warmup_boundaries(steps, stages)
  if not boundaries:
    return tuple(kinds)
  return method_protocol.in_stages(kinds, boundaries,
                                   [{"density_stage": j} for j in range(stages)] + [{}])


def density_warmup(build: Callable[[float], optax.GradientTransformation], final: float,
                   densities: Sequence[float]) -> optax.GradientTransformationExtraArgs:
  """A method's transformation with DGC's density warm-up (Lin et al. 2018).

  ``update(updates, state, params=None, *, density_stage=None, **extra_args)`` runs the update
  of ``build(densities[density_stage])`` (None: ``build(final)``) on the one shared state and
  passes ``extra_args`` on (TASC's ``curvature``). ``density_stage`` is static, a Python int
  that sets the payload's shape: each stage compiles to its own program (the trainer passes it
  as a step kind's option, :func:`warmup_kinds`).

  Args:
    build: ``density -> transformation`` of the method at that density, e.g.
      ``lambda d: compressors.compress(compressors.topk(d), axis_name="data")``; called once
      per density. Its state must not depend on the density (checked at ``init``).
    final: the density after the warm-up, in (0, 1].
    densities: the stages' densities (:func:`warmup_densities`), each in (0, 1].

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose ``init`` is ``build(final)``'s.

  Raises:
    ValueError: at ``init``, a stage whose state differs from the final density's; at
      ``update``, a ``density_stage`` that is not a stage.
  """
  final = checks.check_fraction(final, "final", "density_warmup")
  densities = tuple(checks.check_fraction(d, f"densities[{j}]", "density_warmup")
                    for j, d in enumerate(densities))
  built = functools.cache(lambda d: optax.with_extra_args_support(build(d)))

  def init_fn(params):
    state = built(final).init(params)
    _check_shared_state(built, densities, final, params, state)
    return state

  def update_fn(updates, state, params=None, *, density_stage=None, **extra_args):
    tx = built(final if density_stage is None else _stage_density(densities, density_stage))
    return tx.update(updates, state, params, **extra_args)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _stage_density(densities: tuple[float, ...], stage: Any) -> float:
  """The density of ``stage``, a static int indexing ``densities``."""
  if isinstance(stage, bool) or not isinstance(stage, int):
    raise TypeError(f"density_warmup: density_stage must be a Python int (static: it sets the "
                    f"payload's shape; a step kind's option), got {stage!r}")
  if not 0 <= stage < len(densities):
    raise ValueError(f"density_warmup: density_stage={stage} is not a stage of the warm-up "
                     f"({len(densities)} stages, densities {densities}); allowed: 0 to "
                     f"{len(densities) - 1}, or None for the final density")
  return densities[stage]


def _check_shared_state(built: Callable[[float], optax.GradientTransformation],
                        densities: tuple[float, ...], final: float, params: chex.ArrayTree,
                        state: chex.ArrayTree) -> None:
  """Raises unless every stage's state has the structure, shapes and dtypes of ``state``: the
  stages hand one state on to each other."""
  like = lambda tree: (jax.tree.structure(tree),
                       [(jnp.shape(x), jnp.result_type(x)) for x in jax.tree.leaves(tree)])
  expected = like(state)
  for j, density in enumerate(densities):
    if like(jax.eval_shape(built(density).init, params)) != expected:
      raise ValueError(
          f"density_warmup: stage {j} (density {density}) makes a state unlike the final "
          f"density's ({final}), but the stages share one state; the method's state must not "
          "depend on its density (TASC: tasc_compress(..., block_density=final) cuts every "
          "stage into the final density's blocks)")
