"""Streaming DiLoCo: DiLoCo whose parameters synchronise one fragment at a time, staggered, with
the outer step's result applied a few inner steps late and mixed into each worker's parameters.

Streaming DiLoCo (Douillard et al. 2025, "Streaming DiLoCo with overlapping communication:
Towards a Distributed Free Lunch", arXiv 2501.18512) splits the parameters into ``P`` fragments
and synchronises each one every ``H`` steps, at staggered offsets, so that no step moves more
than one fragment's pseudo-gradient (the peak bandwidth falls by about ``P``; the bytes over a
run are DiLoCo's at the same ``H``). The exchange of a fragment overlaps ``tau`` inner steps:
its outer result lands ``tau`` steps after the synchronisation, and each worker's fragment then
becomes ``alpha * its own + (1 - alpha) * the new synchronised fragment``.

Here, with ``F = fragments``, ``H = every`` and ``tau = overlap``:

* the parameters are dealt into ``F`` fragments of about equal size (:func:`fragment_layout`):
  a leaf larger than a fragment's share is cut along its first axis, and the pieces go largest
  first to the lightest fragment, so that the repeated layers of a deep model are dealt round
  robin (the paper's "strided" pattern: each fragment holds layers from the whole depth) and no
  fragment, hence no step, carries much more than ``1/F`` of the model (a language model's
  embedding alone is half of ours: dealt whole, it would set the peak). A model too small to
  give every fragment a piece is refused;
* fragment ``p`` synchronises at the steps ``t`` (from 0) with ``(t + 1 - offset_p) % H == 0``,
  ``offset_p = p * H // F``: fragment 0 as DiLoCo (steps ``H - 1, 2H - 1, ...``), the others
  spread evenly over the round;
* at fragment ``p``'s synchronisation (after the step's inner update, as DiLoCo): its
  pseudo-gradient ``anchor_p - worker_p`` goes through the exchange (any registered per-step
  method), on the fragment's own pieces (the wire carries the fragment, never a masked whole
  model), with an exchange state per fragment (error-feedback residuals per fragment); the
  outer optimizer (per fragment too: Nesterov momentum of a fragment decays only when the
  fragment moves) updates ``anchor_p`` at once;
* ``tau`` steps later (at the step ``t + tau``, after its inner update; ``tau = 0``: the same
  step) each worker's fragment becomes ``alpha * worker_p + (1 - alpha) * anchor_p``. With
  ``tau = 0`` and ``alpha = 0`` the fragment lands on ``anchor_p`` bit for bit: DiLoCo on the
  fragment. The pending result is the anchor itself: only fragment ``p``'s own next
  synchronisation, ``H > tau`` steps later, changes ``anchor_p``.

The schedule, against torchft's (``torchft.local_sgd.DiLoCo`` with ``fragment_sync_delay=tau``,
``fragment_update_alpha=alpha``, pytorch/torchft, which implements the paper). Each fragment has a
*turn* every ``H`` steps: here the step ``t`` with ``(t + 1 - offset_p) % H == 0``; in torchft
the ``(k + 1)``-th multiple of ``H / F`` inner steps (``k`` counting every fragment's turns), for
its fragment ``k % F``. A fragment's pseudo-gradient is taken and its all-reduce started
(sent), and its outer result lands (the outer step, the mix with ``alpha``), at:

================================  ===========================  ===========================
schedule                          sent (after the step)        lands (after the step)
================================  ===========================  ===========================
``land_at_turn=False`` (default)  the turn ``t``               ``t + tau``
``land_at_turn=True``             ``t - tau``                  the turn ``t``
torchft                           ``tau`` steps before turn    the turn
================================  ===========================  ===========================

so ``land_at_turn=True`` is torchft's schedule, and the default is it shifted ``tau`` steps
later (the runs made before the option keep their default). Fragments are numbered one turn
apart: torchft's fragment ``i`` turns after ``(i + 1) H / F`` steps, as the one numbered
``(i + 1) % F`` here (fragment 0 turns last in the round here, as DiLoCo, and first in
torchft). Per
fragment the two compute the same thing once aligned (tests/test_streaming_diloco.py runs a
float64 transcription of torchft's loop against ``land_at_turn=True``): the pseudo-gradient
``anchor_p - worker_p`` when sent, the outer step of ``anchor_p`` by its mean, the worker's
fragment set to ``alpha * worker_p + (1 - alpha) * anchor_p`` at the landing. Here the outer
step is taken when the fragment is sent, torchft takes it when it lands; only the model a run
evaluates between the two differs (``anchor_p``, which nothing else reads before it lands).
With ``land_at_turn=True`` a fragment whose first turn is at a step ``t < tau`` (nothing sent
yet) is first sent a round later (torchft requires ``F`` to divide ``H`` and ``tau < H / F``,
so that every first send is at step ``H / F - tau`` or later); the bytes are the same under
both options.

Slow, late or gone workers (``aggregation=``, any of :mod:`compressors.aggregation`'s rules):
each fragment's synchronisation is one synchronisation of the simulated workers
(:mod:`compressors.worker_sim`), whose round is the stretch between two consecutive ones,
``H / F`` steps (``F`` must divide ``H``; with ``land_at_turn`` the first is shorter). At
fragment ``p``'s synchronisation the aggregator decides whom it merges, each worker hands the
exchange its fragment pseudo-gradient times ``workers * w_i / sum(w)`` (``w_i``: the inner
steps it ran in the round, as DiLoCo's), and the fragment's outer step is the aggregator's
(``naive_async``: ``m`` outer steps of the fragment).
A worker runs an inner step only where the simulator says it is there and busy (``async``: its
own step count a round); one that sits a step out moves nothing but a landing fragment. A worker
that drops out loses its work (its pseudo-gradient of the fragment is not merged) and, while it
is gone, holds the whole anchor, every fragment, bit for bit (its inner state kept): it rejoins
on the global state. With the workers alike ``sync``, ``quorum`` and ``async`` are the plain
method (bit for bit as compiled with XLA's optimisations).

``delayed`` and ``eager`` (Kale et al. 2025) run per fragment: fragment ``p`` keeps its
exchanged mean pending until its next synchronisation. ``delayed``: the fragment's outer step
applies the pending mean alone to the shared anchor, and the landing mixes with it as above.
``eager``: each worker keeps its own outer parameters of every fragment (``own_p``) and their
outer states, and the pseudo-gradient it sends, ``sent_p``; its fragment pseudo-gradient is
``own_p - worker_p``, its own outer step of the fragment takes ``g_i = pending_p + (Delta_i,p -
sent_i,p) / N`` (DiLoCo's eager recursion on the fragment), the evaluated anchor's ``pending_p +
(mean_p - pending_p) / N``, and the landing mixes ``alpha * worker_p + (1 - alpha) * own_p``
(with ``alpha = 0`` onto ``own_p`` bit for bit); a worker that is gone holds ``own``, every
fragment. No fragment is then alike on the workers: the replica check compares the evaluated
anchor, which every worker keeps alike (:meth:`EagerStreamingState.landed`).

Every step is a static program (:func:`streaming_kinds`): ``"local"`` (no collective),
``"sync{p}"``, ``"apply{p}"`` and ``"sync{p}+apply{q}"`` where a synchronisation and another
fragment's late landing fall on the same step, each with its own options, so that each one's
bytes are read from its own compiled program. Each declares the fragment it sends
(``StepKind.sends``) and the one that lands (``StepKind.lands``); none lands the whole model:
the workers' parameters never all agree, only the landed fragment's with ``alpha = 0``, which
the runner's replica check compares after each landing (:meth:`StreamingState.landed`).
"""

import dataclasses
import math
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax

from compressors import _local
from compressors import aggregation as aggregation_lib
from compressors import checks
from compressors import method_table
from compressors import worker_sim
from compressors._local import RENAMED
from compressors._local import DilocoSettings
from compressors._local import nesterov_outer
from compressors._local import with_every
from compressors.method_protocol import StepInputs
from compressors.method_protocol import StepKind
from compressors.network import axes


class StreamingState(NamedTuple):
  """State of :func:`streaming_local_updates` on one worker.

  Attributes:
    on_anchor: the parameters' tree of ``bool[rows]`` (a leaf's first axis; ``bool[]`` for a
      leaf of shape ``()``): the rows that landed exactly on :attr:`anchor` at the latest step (a
      fragment's late landing with ``alpha = 0``); the same on every worker.
    anchor: the synchronised parameters, each fragment's of its latest synchronisation, the
      same on every worker (the model a run evaluates).
    inner: the inner optimizer's state, this worker's own.
    outer: the outer optimizer's state of each fragment (a tuple of ``fragments``), the same on
      every worker.
    exchange: the exchange's state of each fragment (a tuple; error-feedback residuals: this
      worker's own).
  """
  on_anchor: chex.ArrayTree
  anchor: chex.ArrayTree
  inner: Any
  outer: tuple
  exchange: tuple

  def land(self, params: chex.ArrayTree, applied: chex.ArrayTree) -> chex.ArrayTree:
    """``applied``, except on the leaves that land on :attr:`anchor` this step: the anchor,
    bit for bit (``params + (anchor - params)`` is not ``anchor`` in floating point)."""
    del params  # applied already holds them moved
    return _landed_rows(self.on_anchor, self.anchor, applied)

  def landed(self, params: chex.ArrayTree) -> chex.ArrayTree:
    """``params`` on the rows that landed on :attr:`anchor` at the latest step (a fragment's
    landing with ``alpha = 0``), :attr:`anchor` elsewhere (a landing with ``alpha > 0`` mixes in
    each worker's own: there the synchronised fragment is what must agree)."""
    return _agreeing(self.on_anchor, self.anchor, params)

  def model_params(self) -> chex.ArrayTree:
    """The synchronised parameters (the model a run evaluates)."""
    return self.anchor


class FragmentPiece(NamedTuple):
  """Rows ``[start, stop)`` (along the first axis) of leaf ``leaf`` (in ``jax.tree.leaves``
  order); a leaf of shape ``()`` is one piece, rows ``[0, 1)``."""
  leaf: int
  start: int
  stop: int


def fragment_layout(shapes, fragments: int) -> tuple[tuple[FragmentPiece, ...], ...]:
  """Each fragment's pieces of the parameters, in leaf order, the fragments of about equal size.

  A leaf with more entries than a fragment's share (all entries over ``fragments``, rounded up)
  is cut along its first axis into the fewest pieces of at most the share, as even as its rows
  allow; then the pieces are dealt largest first (ties: in leaf order), each to the fragment
  holding the fewest entries so far (ties: the lowest), the longest-processing-time rule: the
  heaviest fragment holds at most a share plus one piece. Equal leaves (a deep model's repeated
  layers) are so dealt round robin, each fragment holding layers from the whole depth.

  Args:
    shapes: the shapes of the parameters' leaves, in ``jax.tree.leaves`` order.
    fragments: ``F``.

  Returns:
    ``F`` tuples of :class:`FragmentPiece`, each in leaf order; together they cover every entry
    once.
    A fragment is empty where the pieces are fewer than ``F``.
  """
  shapes = [tuple(s) for s in shapes]
  sizes = [math.prod(s) for s in shapes]
  share = max(1, -(-sum(sizes) // fragments))
  pieces = []  # (entries, piece)
  for i, shape in enumerate(shapes):
    rows = shape[0] if shape else 1
    cuts = 1 if not shape or sizes[i] <= share else max(1, min(rows, -(-sizes[i] // share)))
    bounds = [rows * k // cuts for k in range(cuts + 1)]
    per_row = sizes[i] // rows if rows else 0
    pieces += [(per_row * (b - a), FragmentPiece(i, a, b)) for a, b in zip(bounds, bounds[1:])]
  load, dealt = [0] * fragments, [[] for _ in range(fragments)]
  for entries, piece in sorted(pieces, key=lambda x: -x[0]):  # stable: leaf order on ties
    lightest = min(range(fragments), key=lambda f: (load[f], f))
    load[lightest] += entries
    dealt[lightest].append(piece)
  return tuple(tuple(sorted(d)) for d in dealt)


def _cut(leaf, piece: FragmentPiece):
  """The piece's rows of ``leaf`` (the leaf itself where the piece is all of it)."""
  if leaf.ndim == 0 or (piece.start, piece.stop) == (0, leaf.shape[0]):
    return leaf
  return leaf[piece.start:piece.stop]


def _paste(tree, pieces: tuple[FragmentPiece, ...], values):
  """``tree`` with each piece's rows replaced by its value, bit for bit."""
  leaves, treedef = jax.tree.flatten(tree)
  for piece, value in zip(pieces, values):
    whole = leaves[piece.leaf]
    leaves[piece.leaf] = (value if value.shape == whole.shape
                          else whole.at[piece.start:piece.stop].set(value))
  return jax.tree.unflatten(treedef, leaves)


def _row_masks(shapes, pieces: tuple[FragmentPiece, ...]) -> list[np.ndarray]:
  """Per leaf, ``bool[rows]`` (``bool[]`` for a leaf of shape ``()``): the rows in ``pieces``."""
  masks = [np.zeros(s[:1], bool) for s in shapes]
  for piece in pieces:
    if masks[piece.leaf].ndim:
      masks[piece.leaf][piece.start:piece.stop] = True
    else:
      masks[piece.leaf] = np.ones((), bool)
  return masks


def _by_rows(mask, leaf):
  """``mask`` (``bool[rows]``) shaped to broadcast over ``leaf``'s other axes."""
  return jnp.reshape(mask, mask.shape + (1,) * (leaf.ndim - mask.ndim))


def _static_fragment(value, field: str, fragments: int):
  """``value`` if it is None or a Python int naming a fragment (a static option)."""
  if value is None:
    return None
  if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < fragments:
    raise TypeError(f"streaming_local_updates: {field}={value!r} must be None or a Python int "
                    f"in [0, {fragments - 1}] (a static option: each step kind is its own "
                    "program)")
  return value


def _agreeing(on_anchor, anchor, params):
  """What every worker holds alike: ``params`` on the rows in ``on_anchor``, ``anchor``
  elsewhere."""
  return jax.tree.map(lambda on, a, p: jnp.where(_by_rows(on, p), p, a).astype(p.dtype),
                      on_anchor, anchor, params)


def _landed_rows(on_anchor, anchor, applied):
  """``applied``, with the rows in ``on_anchor`` (a tree of ``bool[rows]``) :attr:`anchor`'s,
  bit for bit."""
  return jax.tree.map(lambda on, a, p: jnp.where(_by_rows(on, p), a, p).astype(p.dtype),
                      on_anchor, anchor, applied)


class AggregatedStreamingState(NamedTuple):
  """State of :func:`streaming_local_updates` with an aggregator (:mod:`compressors.aggregation`)
  and simulated workers (:mod:`compressors.worker_sim`) on one worker: :class:`StreamingState`'s
  fields, and

  Attributes:
    active: ``bool[]``: this worker ran the latest step's inner step (one that did not moved
      only a fragment that landed).
    gone: ``bool[]``: this worker is gone after the latest step (it dropped out at it, or is
      away at the next): its parameters are then :attr:`anchor`, all of them, bit for bit, so
      that it rejoins on the global state.
    workers: the simulator's state, the same on every worker.
  """
  on_anchor: chex.ArrayTree
  anchor: chex.ArrayTree
  inner: Any
  outer: tuple
  exchange: tuple
  active: jax.Array
  gone: jax.Array
  workers: worker_sim.WorkerSimState

  def land(self, params: chex.ArrayTree, applied: chex.ArrayTree) -> chex.ArrayTree:
    """:meth:`StreamingState.land` onto where this worker's fragments land (:func:`_target`:
    the anchor, or under ``eager`` its own outer parameters), and the whole of it where this
    worker is gone."""
    del params  # applied already holds them moved (not at all where this worker sat out)
    target = _target(self)
    return jax.tree.map(lambda a, p: jnp.where(self.gone, a, p).astype(p.dtype), target,
                        _landed_rows(self.on_anchor, target, applied))

  def landed(self, params: chex.ArrayTree) -> chex.ArrayTree:
    """As :meth:`StreamingState.landed` (a worker that is gone holds the anchor everywhere)."""
    return _agreeing(self.on_anchor, self.anchor, params)

  def model_params(self) -> chex.ArrayTree:
    """The synchronised parameters (the model a run evaluates)."""
    return self.anchor


class DelayedStreamingState(NamedTuple):
  """State of :func:`streaming_local_updates` with ``aggregation.rule == "delayed"`` (Kale et
  al.'s naive one-step-delayed outer step, per fragment): :class:`AggregatedStreamingState`'s
  fields, and

  Attributes:
    pending: per fragment (a tuple of ``fragments``), the exchanged mean of its latest
      synchronisation (a tuple of its pieces), still "in flight": the fragment's next outer
      step applies it; the same on every worker.
    pending_count: per fragment, ``int32[]``, the contributions that mean merged (0: the next
      outer step moves nothing); the same on every worker.
  """
  on_anchor: chex.ArrayTree
  anchor: chex.ArrayTree
  inner: Any
  outer: tuple
  exchange: tuple
  active: jax.Array
  gone: jax.Array
  workers: worker_sim.WorkerSimState
  pending: tuple
  pending_count: tuple

  land = AggregatedStreamingState.land
  landed = AggregatedStreamingState.landed
  model_params = AggregatedStreamingState.model_params


class EagerStreamingState(NamedTuple):
  """State of :func:`streaming_local_updates` with ``aggregation.rule == "eager"`` (Kale et
  al.'s eager outer step, per fragment, :mod:`compressors.aggregation`):
  :class:`AggregatedStreamingState`'s fields, where :attr:`anchor` is the mean of the workers'
  outer parameters (the model a run evaluates, the same on every worker), :attr:`outer` its
  outer states, and :attr:`on_anchor` the rows that landed exactly on :attr:`own` (``alpha =
  0``); a worker that is gone holds :attr:`own`, every fragment, bit for bit. And

  Attributes:
    own: this worker's outer parameters, where its fragments land (``alpha * worker + (1 -
      alpha) * own``); its own: the workers' differ.
    own_outer: the outer optimizer's state of each fragment of :attr:`own`, this worker's own.
    sent: per fragment, this worker's pseudo-gradient of its latest synchronisation as it
      handed it to the exchange (weighted), this worker's own.
    pending: per fragment, the exchanged mean of its latest synchronisation, "in flight" (it
      lands at the fragment's next one), the same on every worker.
  """
  on_anchor: chex.ArrayTree
  anchor: chex.ArrayTree
  inner: Any
  outer: tuple
  exchange: tuple
  active: jax.Array
  gone: jax.Array
  workers: worker_sim.WorkerSimState
  own: chex.ArrayTree
  own_outer: tuple
  sent: tuple
  pending: tuple

  land = AggregatedStreamingState.land  # onto own (alpha = 0 rows, and all while gone)

  def landed(self, params: chex.ArrayTree) -> chex.ArrayTree:
    """:attr:`anchor`: no fragment of the workers' parameters is shared (each applied its own
    fresh pseudo-gradient); what every worker holds alike is the mean they evaluate."""
    return jax.tree.map(lambda a, p: a.astype(p.dtype), self.anchor, params)

  def model_params(self) -> chex.ArrayTree:
    """The mean of the workers' outer parameters (the model a run evaluates)."""
    return self.anchor


def _target(state) -> chex.ArrayTree:
  """Where a worker's fragments land: its own outer parameters under ``eager``, the anchor
  else."""
  return state.own if isinstance(state, EagerStreamingState) else state.anchor


def _at(values: tuple, index: int, value) -> tuple:
  """``values`` with ``values[index]`` replaced by ``value``."""
  return values[:index] + (value,) + values[index + 1:]


def streaming_local_updates(inner: optax.GradientTransformation,
                            exchange: optax.GradientTransformation,
                            outer: optax.GradientTransformation | None = None, *,
                            fragments: int = 4, alpha: float = 0.5,
                            aggregation: aggregation_lib.Aggregation | None = None,
                            axis_name: axes.AxisName = None
                            ) -> optax.GradientTransformationExtraArgs:
  """Streaming DiLoCo's local updates (Douillard et al. 2025; see the module docstring).

  Args:
    inner: the optimizer each worker runs on its own gradient.
    exchange: the per-worker transformation that returns the mean over workers of what it is
      given (as :func:`compressors.local_updates`'); it sees one fragment's pseudo-gradient at a
      time, a tuple of the fragment's leaves, with one state per fragment.
    outer: the optimizer of the synchronised parameters (default
      :func:`compressors.nesterov_outer`), one state per fragment.
    fragments: ``F``, the fragments the parameters are dealt into (:func:`fragment_layout`).
    alpha: the weight of a worker's own fragment when the outer result lands (in [0, 1]).
    aggregation: an aggregator (any of :data:`compressors.aggregation.RULES`; with ``eager`` the
      state is an :class:`EagerStreamingState`, with ``delayed`` a
      :class:`DelayedStreamingState`) and its simulated workers, or None (every worker always
      there, the plain mean; the state is a :class:`StreamingState`). Each fragment's
      synchronisation is one synchronisation of the simulator: ``aggregation.round_steps`` is
      the steps between two consecutive ones (``H / F``). See "Slow, late or gone workers" in
      the module docstring.
    axis_name: the workers' axis, needed with ``aggregation`` (each worker finds its own row of
      the simulated workers by its index along it).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose ``update(grads, state, params, *,
    sync=None, apply=None, **extra_args)`` runs inside ``shard_map``/``pmap`` over the
    exchange's axis: it returns the inner optimizer's update; with ``sync=p`` (a static int) it
    also exchanges fragment ``p``'s pseudo-gradient (``extra_args`` go to the exchange, those
    shaped as the parameters cut to the fragment) and takes fragment ``p``'s outer step on the
    anchor; with ``apply=q`` the update moves this worker's fragment ``q`` to ``alpha * (params
    + inner update) + (1 - alpha) * anchor_q`` (apply it with
    :func:`compressors.apply_local_updates`: with ``alpha = 0``, onto the anchor bit for bit).

  Raises:
    ValueError: bad ``fragments``, ``alpha`` or aggregator; at ``init``, fewer pieces than
      fragments.
  """
  checks.check_int(fragments, "fragments", 1, "streaming_local_updates")
  checks.check_real(alpha, "alpha", 0, 1, "a number in [0, 1]", "streaming_local_updates")
  outer = nesterov_outer() if outer is None else outer
  exchange = optax.with_extra_args_support(exchange)
  fragment = _Fragments(fragments, inner, exchange, outer, aggregation, axis_name)

  def update(grads, state, params=None, *, sync=None, apply=None, **extra_args):
    if params is None:
      raise ValueError("streaming_local_updates: update needs params (this worker's parameters)")
    sync = _static_fragment(sync, "sync", fragments)
    apply = _static_fragment(apply, "apply", fragments)
    updates, inner_state, simulated = fragment.inner_step(grads, state, params)
    leaves, treedef = jax.tree.flatten(params)
    layout = fragment.layout_of(leaves)
    state = state._replace(inner=inner_state)
    worker = optax.apply_updates(params, updates)
    if sync is not None:
      # Inputs shaped as the parameters (TASC's curvature) are cut to the fragment.
      cut = {k: fragment.split(v, layout)[sync] if jax.tree.structure(v) == treedef else v
             for k, v in extra_args.items()}
      state, simulated = fragment.synchronise(sync, layout, worker, state, cut, simulated)
    landing = _row_masks([x.shape for x in leaves], layout[apply] if apply is not None else ())
    if apply is not None:  # the late landing: mix the worker's fragment with its target's
      updates = jax.tree.unflatten(treedef, [
          jnp.where(_by_rows(on, u), (alpha * w + (1 - alpha) * a - p).astype(u.dtype), u)
          if on.any() else u for on, w, a, p, u in zip(
              landing, jax.tree.leaves(worker), jax.tree.leaves(_target(state)), leaves,
              jax.tree.leaves(updates))])
    on_anchor = jax.tree.unflatten(treedef, [jnp.asarray(on & (alpha == 0)) for on in landing])
    state = state._replace(on_anchor=on_anchor)
    if simulated is None:
      return updates, state
    gone = simulated.dropped[simulated.me] | ~worker_sim.present(simulated.sim)[simulated.me]
    return updates, state._replace(active=simulated.active, gone=gone, workers=simulated.sim)

  return optax.GradientTransformationExtraArgs(fragment.init, update)


class _Simulated(NamedTuple):
  """A simulated worker's step so far: whether it ran, the simulator, its index, and the
  workers that dropped out at the step's synchronisation (none off one)."""
  active: jax.Array
  sim: worker_sim.WorkerSimState
  me: jax.Array
  dropped: jax.Array


@dataclasses.dataclass(frozen=True)
class _Fragments:
  """The fragments of :func:`streaming_local_updates`' parameters and a fragment's
  synchronisation, with or without an aggregator."""
  fragments: int
  inner: optax.GradientTransformation
  exchange: optax.GradientTransformationExtraArgs
  outer: optax.GradientTransformation
  aggregation: aggregation_lib.Aggregation | None
  axis_name: Any

  def init(self, params):
    leaves, treedef = jax.tree.flatten(params)
    layout = self.layout_of(leaves)
    if not all(layout):
      raise ValueError(f"streaming_local_updates: fragments={self.fragments} but the "
                       f"parameters' {len(leaves)} leaves ({sum(x.size for x in leaves)} entries) "
                       f"cut into {sum(map(len, layout))} pieces; allowed: fragments <= the "
                       "pieces (a fragment would be empty)")
    anchor = jax.tree.map(jnp.asarray, params)
    pieces = self.split(anchor, layout)
    on_anchor = [jnp.zeros(x.shape[:1], bool) for x in leaves]
    state = StreamingState(jax.tree.unflatten(treedef, on_anchor), anchor,
                           self.inner.init(params), tuple(self.outer.init(x) for x in pieces),
                           tuple(self.exchange.init(x) for x in pieces))
    if self.aggregation is None:
      return state
    state = AggregatedStreamingState(*state, jnp.ones((), bool), jnp.zeros((), bool),
                                     worker_sim.init(self.aggregation.sim))
    zeros = tuple(jax.tree.map(jnp.zeros_like, x) for x in pieces)
    if self.aggregation.rule == "delayed":
      return DelayedStreamingState(*state, zeros, (jnp.zeros((), jnp.int32),) * self.fragments)
    if self.aggregation.rule == "eager":
      return EagerStreamingState(*state, anchor, tuple(self.outer.init(x) for x in pieces),
                                 zeros, zeros)
    return state

  def inner_step(self, grads, state, params):
    """``(updates, inner state, the simulated worker so far or None)``: with an aggregator, a
    worker that sits the step out moves nothing (but a landing fragment, later)."""
    if self.aggregation is None:
      return (*self.inner.update(grads, state.inner, params), None)
    updates, inner_state, active, sim, me = _local._simulated_inner_step(
        self.inner, self.aggregation, self.axis_name, grads, state, params)
    updates = jax.tree.map(lambda u: jnp.where(active, u, jnp.zeros_like(u)), updates)
    return updates, inner_state, _Simulated(active, sim, me, jnp.zeros(sim.worked.shape, bool))

  def layout_of(self, leaves) -> tuple[tuple[FragmentPiece, ...], ...]:
    return fragment_layout([x.shape for x in leaves], self.fragments)

  def split(self, tree, layout) -> list[tuple]:
    """``tree``'s pieces by fragment: a tuple of arrays for each."""
    leaves = jax.tree.leaves(tree)
    return [tuple(_cut(leaves[piece.leaf], piece) for piece in pieces) for pieces in layout]

  def synchronise(self, p: int, layout, worker, state, extra_args: dict,
                  simulated: _Simulated | None):
    """Fragment ``p``'s synchronisation: its pseudo-gradient ``start - worker`` (``start``: the
    anchor's fragment, or under ``eager`` this worker's own; with an aggregator weighted as
    :func:`compressors.local_updates`' and merged as the aggregator says) exchanged, the
    fragment's leaves alone on the wire, and the fragment's outer step. Returns ``(the state
    with the fragment's anchor, exchange and outer states moved, the simulated worker after the
    synchronisation)``."""
    rule = None if self.aggregation is None else self.aggregation.rule
    start = self.split(_target(state), layout)[p]
    worker_piece = self.split(worker, layout)[p]
    if simulated is None:
      handed, count = tuple((a - w).astype(a.dtype) for a, w in zip(start, worker_piece)), None
    else:
      merged = aggregation_lib.merge(self.aggregation, simulated.sim)
      handed = _local._weighted(self.aggregation, merged.weights, simulated.me, start,
                                worker_piece)
      simulated, count = simulated._replace(sim=merged.workers,
                                            dropped=merged.dropped), merged.count
    mean, exchange_state = self.exchange.update(handed, state.exchange[p], start, **extra_args)
    state = state._replace(exchange=_at(state.exchange, p, exchange_state))
    if rule == "eager":
      return self._eager_step(p, layout, state, handed, mean), simulated
    if rule == "delayed":  # the previous synchronisation's mean lands now, this one's next time
      state, mean, count = state._replace(
          pending=_at(state.pending, p, mean), pending_count=_at(state.pending_count, p, count)
      ), state.pending[p], state.pending_count[p]
    piece = self.split(state.anchor, layout)[p]
    if simulated is None:
      outer_updates, outer_state = self.outer.update(mean, state.outer[p], piece)
      moved = optax.apply_updates(piece, outer_updates)
    else:
      moved, outer_state = aggregation_lib.outer_step(self.aggregation, self.outer, mean,
                                                      state.outer[p], piece, count)
    return state._replace(anchor=_paste(state.anchor, layout[p], moved),
                          outer=_at(state.outer, p, outer_state)), simulated

  def _eager_step(self, p: int, layout, state, handed, mean):
    """Fragment ``p``'s eager outer steps (:func:`compressors.local_updates`' recursion on the
    fragment): this worker's own by ``pending + (handed - sent) / N``, the evaluated mean by
    ``pending + (mean - pending) / N``; ``mean`` is then pending."""
    late = lambda pending, fresh, stale: pending + (fresh - stale) / self.aggregation.sim.workers
    pending, own = state.pending[p], self.split(state.own, layout)[p]
    own_updates, own_outer = self.outer.update(jax.tree.map(late, pending, handed,
                                                            state.sent[p]),
                                               state.own_outer[p], own)
    piece = self.split(state.anchor, layout)[p]
    anchor_updates, outer_state = self.outer.update(jax.tree.map(late, pending, mean, pending),
                                                    state.outer[p], piece)
    return state._replace(
        anchor=_paste(state.anchor, layout[p], optax.apply_updates(piece, anchor_updates)),
        outer=_at(state.outer, p, outer_state),
        own=_paste(state.own, layout[p], optax.apply_updates(own, own_updates)),
        own_outer=_at(state.own_outer, p, own_outer), sent=_at(state.sent, p, handed),
        pending=_at(state.pending, p, mean))


def streaming_kinds(every: int, fragments: int, overlap: int,
                    exchange_inputs: StepInputs | None = None, *,
                    land_at_turn: bool = False) -> tuple[StepKind, ...]:
  """The step kinds of Streaming DiLoCo (see the module docstring): ``"local"``; ``"sync{p}"``
  at fragment ``p``'s synchronisations (with ``overlap`` 0 it also lands them);
  ``"apply{p}"`` ``overlap`` steps after each; ``"sync{p}+apply{q}"`` where the two meet. A
  landing waits for its first synchronisation (its kind starts then); where it meets another
  fragment's synchronisation, that synchronisation runs alone before it (``"sync{p}"`` with a
  ``stop``). The synchronisation is at fragment ``p``'s turn, or ``overlap`` steps before it
  with ``land_at_turn`` (torchft's schedule: the landing is then at the turn).

  Args:
    every: ``H``, steps between two synchronisations of a fragment (``>= fragments``).
    fragments: ``F``, the number of fragments.
    overlap: ``tau``, steps between a synchronisation and its landing (``0 <= tau < H``).
    exchange_inputs: the exchange's per-step inputs (TASC's curvature), or None: made fresh at
      every synchronisation of a fragment (each kind that synchronises carries them).
    land_at_turn: send each fragment ``overlap`` steps before its turn and land it at the turn
      (torchft's schedule), instead of sending at the turn and landing ``overlap`` steps later.

  Raises:
    ValueError: a setting out of range.
  """
  caller = "streaming_kinds"
  checks.check_int(every, "every", 1, caller)
  checks.check_int(fragments, "fragments", 1, caller)
  checks.check_int(overlap, "overlap", 0, caller)
  if every < fragments:
    raise ValueError(f"{caller}: every={every} with fragments={fragments}; allowed: every >= "
                     "fragments (each fragment synchronises at its own step of the round)")
  if overlap >= every:
    raise ValueError(f"{caller}: overlap={overlap} with every={every}; allowed: 0 <= overlap < "
                     "every (a landing comes before the fragment's next synchronisation)")
  inputs = exchange_inputs.make if exchange_inputs is not None and exchange_inputs.every > 0 \
      else None
  # Each fragment's first turn, its first synchronisation (a step in [0, H): with land_at_turn,
  # one within overlap steps of the start sends first a round later) and its first landing.
  turns = [(p * every // fragments - 1) % every for p in range(fragments)]
  first_sync = [(t - overlap) % every if land_at_turn else t for t in turns]
  syncs = {s: p for p, s in enumerate(first_sync)}
  lands = {(s + overlap) % every: (p, s + overlap) for p, s in enumerate(first_sync)}
  if every == 1:  # one fragment, synchronised and landed every step
    return (StepKind("sync0", 1, inputs, {"sync": 0, "apply": 0}, sends=0, lands=0),)
  kinds = [StepKind("local", 1)]
  for phase in range(every):
    p = syncs.get(phase)
    q, start = lands.get(phase, (None, 0))
    if p is None and q is None:
      continue
    if q is None:
      kinds.append(StepKind(f"sync{p}", every, inputs, {"sync": p}, phase, sends=p))
    elif p is None:
      kinds.append(StepKind(f"apply{q}", every, None, {"apply": q}, phase, start=start, lands=q))
    elif p == q:  # overlap 0: the synchronisation lands at once
      kinds.append(StepKind(f"sync{p}", every, inputs, {"sync": p, "apply": p}, phase, sends=p,
                            lands=p))
    else:
      if start > phase:  # the landing's first synchronisation comes after this one's first
        kinds.append(StepKind(f"sync{p}", every, inputs, {"sync": p}, phase, stop=start,
                              sends=p))
      kinds.append(StepKind(f"sync{p}+apply{q}", every, inputs, {"sync": p, "apply": q}, phase,
                            start=start, sends=p, lands=q))
  return tuple(kinds)


_FRAGMENTS = checks.Rule(int, low=1)
_OVERLAP = checks.Rule(int, low=0)
_ALPHA = checks.Rule(float, low=0, high=1)


@dataclasses.dataclass(frozen=True)
class StreamingDilocoSettings(DilocoSettings):
  """``method="streaming_diloco"`` (Streaming DiLoCo, Douillard et al. 2025, arXiv 2501.18512):
  DiLoCo's settings, and

  Attributes:
    fragments: ``F``, the fragments of about equal size the parameters are dealt into
      (:func:`fragment_layout`); each synchronises once every ``every`` steps, staggered;
      ``every`` must be ``>= fragments``, and the model must give each fragment a piece.
    overlap: ``tau``, the inner steps between a fragment's synchronisation and the landing of
      its outer result (0: the same step, as DiLoCo); ``0 <= overlap < every``.
    alpha: at the landing, the worker's fragment becomes ``alpha * its own + (1 - alpha) *
      the synchronised one`` (the paper's mixing, 0.5); 0: onto the synchronised one.
    land_at_turn: False sends a fragment at its turn and lands it ``overlap`` steps later;
      True sends it ``overlap`` steps before its turn and lands it at the turn, torchft's
      schedule (the module docstring compares them). The bytes are the same.
  """
  fragments: int = checks.setting(4, _FRAGMENTS)
  overlap: int = checks.setting(1, _OVERLAP)
  alpha: float = checks.setting(0.5, _ALPHA)
  land_at_turn: bool = checks.setting(False, checks.Rule(bool))

  def __post_init__(self):
    checks.check_settings(self, "streaming diloco")
    if self.every < self.fragments:
      raise ValueError(f"streaming diloco: every={self.every} with fragments={self.fragments}; "
                       "allowed: every >= fragments (each fragment synchronises at its own "
                       "step of the round)")
    if self.overlap >= self.every:
      raise ValueError(f"streaming diloco: overlap={self.overlap} with every={self.every}; "
                       "allowed: 0 <= overlap < every (a fragment's outer result lands before "
                       "its next synchronisation)")


def _build(s: StreamingDilocoSettings, inner, exchange, *, axis_name,
           aggregation: aggregation_lib.Aggregation | None = None
           ) -> optax.GradientTransformationExtraArgs:
  """The method's transformation; an aggregator's round (given as ``H``, ``Method.sends_every``)
  becomes the stretch between two fragments' synchronisations, ``H / F`` steps."""
  if aggregation is not None:
    if s.every % s.fragments:
      raise ValueError(f"streaming diloco: every={s.every} with fragments={s.fragments} and "
                       f"aggregation={aggregation.rule!r}; allowed: every a multiple of "
                       "fragments (the simulated workers' rounds, between two fragments' "
                       "synchronisations, are then equal)")
    aggregation = dataclasses.replace(aggregation, round_steps=s.every // s.fragments)
  return streaming_local_updates(inner, exchange,
                                 nesterov_outer(s.outer_learning_rate, s.outer_momentum),
                                 fragments=s.fragments, alpha=s.alpha, aggregation=aggregation,
                                 axis_name=axis_name)


def _fragment_shapes(s: StreamingDilocoSettings, shapes) -> list[list[tuple[int, ...]]]:
  """The shapes of each fragment's pieces (``Method.parts``: what a kind's ``sends`` and
  ``lands`` index)."""
  shapes = [tuple(x) for x in shapes]
  return [[(p.stop - p.start, *shapes[p.leaf][1:]) if shapes[p.leaf] else () for p in pieces]
          for pieces in fragment_layout(shapes, s.fragments)]


# Priced as DiLoCo: every H steps each fragment sends once, so a round moves the carrier's bytes
# of the whole model once (the cost of one "synchronisation" is the whole model's, spread over
# the round's steps), and the bytes per step are that over H.
METHODS = (
    method_table.Method(
        name="streaming_diloco", summary="DiLoCo synchronising one fragment of the parameters "
        "at a time, staggered, its outer result landing tau steps late and mixed (Streaming "
        "DiLoCo, Douillard et al. 2025)",
        settings=StreamingDilocoSettings, local=_build, carrier=lambda s: s.carrier,
        sends_every=lambda s: s.every, with_sends_every=with_every, parts=_fragment_shapes,
        lands_after=lambda s: s.overlap, renamed=RENAMED,
        kinds=lambda s, carrier_inputs: streaming_kinds(s.every, s.fragments, s.overlap,
                                                        carrier_inputs,
                                                        land_at_turn=s.land_at_turn),
        error_feedback=False, aggregates=True),
)
