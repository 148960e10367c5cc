"""TASC's compressor: Hessian-aware block scores, a shared block support, one compact all-reduce.

Per worker and step, on its buffer ``a = g + e`` (:func:`compressors.compress` adds the
error-feedback residual ``e`` and keeps what is not sent):

1. cut ``a`` into ``num_blocks`` blocks of ``block_size`` and score each block,
   ``(eps * mean|h| + mean_{i in b}|h_i|) * ||a_b||^2``, or the energy over that weight with
   ``score="newton"`` (the diagonal Newton decrement; :mod:`tasc._scores` derives both);
2. agree on the support: the ``K`` blocks of highest *all-reduced* score (:mod:`tasc._selection`);
   because the scores are summed over workers before ranking, the support is the same on every
   worker even when each worker's curvature estimate differs (a local empirical Fisher);
3. gather the chosen blocks into a compact ``[K, block_size]`` payload and all-reduce it (no
   indices travel: every worker knows the support); scatter the mean back.

Parts: the support mode (:mod:`tasc._supports`: this step's scores, or last step's riding in
the payload) and the wire format (:mod:`tasc._wire`: float32, or float16 under a shared
power-of-two scale) are separate objects that this compressor composes.

Bytes. Per worker, the all-reduce operands are ``K * block_size + num_blocks`` floats whatever
the number of workers ``n`` (an all-reduce moves ``2 (n-1)/n`` of its operand per worker), where
top-k's all-gather moves ``2 k (n-1)`` words; with ``wire_dtype="float16"`` they are half as many
bytes, plus one number per worker for the payload's scale.

Memory traffic. The buffer is never padded or copied: the blocks are a free reshape of ``a``
(:func:`tasc._scores.block_sums`), only the ``K`` chosen blocks are gathered, and error feedback
keeps ``a`` with those blocks replaced, in place (``compress`` hands over ``g`` and ``e``:
:class:`compressors.protocol.ResidualAggregate`) rather than subtracting a dense ``sent``. The
dense mean's zeros are filled once the blocks are chosen, so XLA writes them over the
gradient's (donated) buffer instead of fresh memory. A step thus reads ``g`` and ``e`` and
writes ``a`` once, with the block energies taken in the same pass (:mod:`tasc._fused`: a CPU
kernel, as XLA's CPU backend cannot fuse the reduction into the sum, used where it can write
over ``e`` in place, ``Context.owns_buffers``; elsewhere one more read of ``a``), and writes the
mean's zeros once.

Curvature (``sensitivity``)
  ``"hutchinson"``: ``update(..., curvature=h)`` passes a fresh estimate (a pytree like the
  gradients, e.g. :func:`tasc.hutchinson_diagonal`); the state keeps an EMA of its block means of
  ``|h|`` (AdaHessian's spatial averaging), which the steps without an estimate use. No bias
  correction is needed: the score is invariant to the curvature's scale. Until the first
  estimate arrives blocks are ranked by magnitude.
  ``"fisher"``: an EMA of the block means of the worker's own squared gradient ``g^2`` (the
  empirical Fisher, a Gauss-Newton proxy), at no extra cost. It is local, not identical across
  workers, and need not be: only the summed scores decide the support. The aggregated gradient
  would be identical everywhere but is sparse: the blocks not sent would see their Fisher decay
  towards zero and then never be sent, a loop the local, dense gradient does not have.
  ``"none"``: ``||a_b||^2`` alone (block magnitude, as OmniReduce).

Replication under ``shard_map``: the support and the mean are computed from all-reduced values
(this step's scores for ``support="global"``, the previous step's, kept in the replicated part of
the state, for ``"previous"``), so JAX proves the mean replicated (``out_specs=P()``).

Dynamic density: ``density`` may be a function of the step (e.g. an optax schedule) with a
``max_density``. The payload's capacity is fixed by ``max_density`` (static shapes: one compiled
program); each step the top ``round(density(step) * num_blocks)`` blocks carry data and the other
rows are zero and stay in error feedback. The wire moves the full capacity every step: a schedule
changes what is sent, not the bytes (``compressors.wire_bytes`` reports the capacity). Values
above ``max_density`` are clipped to it.
"""

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from compressors.network import axes
from compressors import protocol
from tasc import _fused as fused
from tasc import _plan as plan_lib
from tasc import _scores as scores
from tasc import _selection as selection
from tasc import _settings as settings_lib
from tasc import _supports as supports
from tasc import _wire as wire_formats


class TascState(NamedTuple):
  """Per-buffer state of the TASC compressor (per worker).

  Attributes:
    curvature: ``f32[num_blocks]`` EMA of the block means of ``|h|`` (or of ``g^2`` for
      ``"fisher"``); ``()`` for ``sensitivity="none"``.
    scores: ``f32[num_blocks]`` mean over workers of the scores that rank the next step's
      blocks (``support="previous"``); ``()`` for ``"global"``.
    scale: ``f32[]`` the power of two that scales the next step's float16 payload
      (``wire_dtype="float16"`` with ``support="previous"``); ``()`` otherwise.
  """
  curvature: jax.Array | tuple
  scores: jax.Array | tuple
  scale: jax.Array | tuple = ()


@dataclasses.dataclass(frozen=True)
class _Parts:
  """One TASC compressor: its checked settings, support mode, wire format and buffer plans.

  Attributes:
    settings: the checked :class:`tasc.TascSettings`.
    support: the support mode (:mod:`tasc._supports`).
    wire: the wire format (:mod:`tasc._wire`).
    dense_axis: the fast axis in hierarchical mode, or None.
    plan: ``size -> BufferPlan`` of a buffer of ``size`` elements, made once per size and
      number of shards.
  """
  settings: settings_lib.TascSettings
  support: Any
  wire: Any
  dense_axis: axes.AxisName
  plan: Callable[[int], plan_lib.BufferPlan]


def tasc(settings: settings_lib.TascSettings, *, leaf_sizes: Sequence[int] | None = None,
         dense_axis: axes.AxisName = None,
         block_density: float | None = None) -> protocol.Compressor:
  """The TASC :class:`compressors.Compressor` (psum exchange, extra argument ``curvature``).

  Most users want :func:`tasc.tasc_compress`, which wraps this in :func:`compressors.compress`.

  Args:
    settings: :class:`tasc.TascSettings`, checked here; ``density`` a number or a schedule
      (``hessian_every`` and ``num_probes`` are the trainer's).
    leaf_sizes: sizes of the leaves fused into the buffer (for ``min_blocks_per_leaf`` in fused
      mode); None when each buffer is one leaf.
    dense_axis: the fast axis when :func:`compressors.compress` runs in hierarchical mode
      (the buffer is then this device's shard; ``"fisher"`` and the leaf layout need to know).
    block_density: the density ``block_size=None`` picks the block size at (default: the
      capacity's), so that the stages of a density warm-up share one state
      (:func:`tasc.tasc_compress`).

  Returns:
    A :class:`compressors.Compressor`.
  """
  s = settings_lib.checked(settings)
  if isinstance(s.density, Mapping):
    raise ValueError(f"tasc: density={dict(s.density)!r} names mesh axes, which only "
                     "tasc.tasc_compress resolves; the compressor takes one density (a number "
                     "or a schedule)")
  leaf_sizes = None if leaf_sizes is None else tuple(int(n) for n in leaf_sizes)

  @functools.cache
  def plan_of(size: int, shards: int) -> plan_lib.BufferPlan:
    return plan_lib.buffer_plan(s, size, leaf_sizes, shards, block_density)

  parts = _Parts(settings=s, support=supports.SUPPORTS[s.support],
                 wire=wire_formats.FORMATS[s.wire_dtype], dense_axis=dense_axis,
                 plan=lambda size: plan_of(size, axes.num_workers(dense_axis,
                                                                  caller="tasc (dense_axis)")))
  return protocol.Compressor(
      name="tasc", encode=None, decode=None, exchange="psum",
      init=functools.partial(_init, parts),
      precondition=functools.partial(_fisher, parts) if s.sensitivity == "fisher" else None,
      aggregate=protocol.ResidualAggregate(functools.partial(_aggregate, parts),
                                           functools.partial(_step, parts)),
      extra_args=("curvature",) if s.sensitivity == "hutchinson" else (),
      validate=functools.partial(_validate, parts))


def _validate(c: _Parts, size: int, where: str) -> None:
  """A clear error when the buffer of ``size`` elements sends no block, with what would work."""
  plan = c.plan(size)
  if plan.selected >= 1:
    return
  field = "max_density" if callable(c.settings.density) else "density"
  density = c.settings.capacity_density
  smaller = next((b for b in plan_lib.AUTO_BLOCK_SIZES
                  if b < plan.block_size and plan_lib.sends_a_block(size, b, density)), None)
  advice = [f"{field} >= {0.5 / plan.num_blocks:.3g}"]
  if smaller:
    advice.append(f"block_size={smaller} (then {scores.num_blocks(size, smaller)} blocks)")
  if "leaf" in where:  # per-leaf buffers: one ranking over all leaves would have more blocks
    advice.append("fuse=True")
  raise ValueError(
      f"tasc: {where} has {size} elements: {plan.num_blocks} blocks of "
      f"block_size={plan.block_size}, and {field}={density} keeps round({density} * "
      f"{plan.num_blocks}) = 0 of them; use {' or '.join(advice)}")


def _init(c: _Parts, x: jax.Array) -> TascState:
  blocks = c.plan(x.size).num_blocks
  return TascState(
      curvature=jnp.zeros((blocks,), jnp.float32) if c.settings.sensitivity != "none" else (),
      scores=c.support.initial_scores(blocks), scale=c.support.initial_scale(c.wire))


def _fisher(c: _Parts, g: jax.Array, state: TascState,
            ctx: protocol.Context) -> tuple[jax.Array, TascState]:
  """The precondition of ``"fisher"``: the EMA of the block means of this worker's squared
  gradient (its owned shard in hierarchical mode)."""
  if c.dense_axis is not None:
    squares = ctx.owned_shard(g * g)
    fresh = scores.block_means(squares, c.plan(squares.size).block_size)
  else:
    fresh = scores.block_means(g, c.plan(g.size).block_size, jnp.square)
  if fresh.shape != state.curvature.shape:
    raise ValueError(f"tasc: the gradient buffer has {g.size} elements but the state "
                     f"holds {state.curvature.size} blocks; in hierarchical mode pass "
                     "dense_axis to tasc as to compressors.compress")
  return g, state._replace(curvature=_ema(state.curvature, fresh, c.settings.curvature_decay))


def _aggregate(c: _Parts, x: jax.Array, state: TascState,
               ctx: protocol.Context) -> protocol.Aggregate:
  return _step(c, x, None, state, ctx)[0]


def _step(c: _Parts, g: jax.Array, e: jax.Array | None, state: TascState,
          ctx: protocol.Context) -> tuple[protocol.Aggregate, jax.Array]:
  """One step on ``a = g + e`` (``e`` None: ``a = g``): ``(Aggregate, kept)``.

  ``kept`` is ``a - sent``, built as ``a`` with the sent blocks replaced (in place: the blocks
  sent are zero, those a density schedule holds back stay whole); the caller uses ``sent`` or
  ``kept`` and jit drops the other.
  """
  s, plan = c.settings, c.plan(g.size)
  block = plan.block_size
  if e is None:
    x, energies = g, scores.block_energies(g, block)
  else:
    x, energies = fused.residual_and_energies(g, e, block, one_pass=ctx.owns_buffers)
  curvature = _curvature(c, block, state, ctx)
  weights = (scores.score_weights(curvature, x.size, block, s.eps, s.score)
             if s.sensitivity != "none" else jnp.ones_like(energies))
  priority, scale = c.support.priority(weights * energies, energies, state, c.wire, ctx)
  indices, guaranteed = selection.select(priority, plan.capacity, _leaf_groups(c, plan),
                                         s.min_blocks_per_leaf)
  blocks = _take_blocks(x, indices, block)
  active = _active_rows(s, plan, guaranteed, ctx.step)
  rows = blocks if active is None else jnp.where(active[:, None], blocks, 0)
  out = c.support.exchange(rows, blocks, indices, energies, weights, state, scale, c.wire, ctx)
  # The outputs overwrite dead buffers in place only if XLA writes them after the last read of
  # ``a``, the block energies; with "previous" support the indices do not wait for them, so
  # the residual's scatter is ordered explicitly. The mean's zeros wait for a value that is
  # replicated, so that the mean is too.
  mean = _put_blocks(_zeros_after(out.replicated, x.shape, x.dtype), indices, out.mean_rows,
                     block)
  sent_blocks = jnp.ones(blocks.shape, bool) if active is None else jnp.broadcast_to(
      active[:, None], blocks.shape)
  aggregate = protocol.Aggregate(
      mean=mean, sent=_put_blocks(jnp.zeros_like(x), indices, out.sent_rows, block),
      state=TascState(curvature=curvature, scores=out.scores, scale=out.scale),
      sent_mask=_put_blocks(jnp.zeros(x.shape, bool), indices, sent_blocks, block))
  kept = _put_blocks(x, _after(indices, energies), blocks - out.sent_rows, block)
  return aggregate, kept


def _leaf_groups(c: _Parts, plan: plan_lib.BufferPlan) -> jax.Array | None:
  """The leaf of each block of this device's buffer (its shard's row of the plan's table)."""
  if plan.leaf_groups is None:
    return None
  if plan.leaf_groups.shape[0] == 1:
    return jnp.asarray(plan.leaf_groups[0])
  return jnp.asarray(plan.leaf_groups)[axes.worker_index(c.dense_axis)]


def _curvature(c: _Parts, block_size: int, state: TascState, ctx: protocol.Context) -> Any:
  """The state's curvature, updated by a fresh Hutchinson estimate when the step passes one."""
  if c.settings.sensitivity == "hutchinson" and "curvature" in ctx.extras:
    fresh = scores.block_means(ctx.extras["curvature"], block_size, jnp.abs)
    return _ema(state.curvature, fresh, c.settings.curvature_decay)
  return state.curvature


def _active_rows(s: settings_lib.TascSettings, plan: plan_lib.BufferPlan,
                 guaranteed: jax.Array, step: jax.Array) -> jax.Array | None:
  """With a density schedule, which of the ``capacity`` rows carry data this step (the top
  ``round(density(step) * num_blocks)``, at least the guaranteed ones); None: all of them."""
  if not callable(s.density):
    return None
  wanted = jnp.round(s.density(step) * plan.num_blocks).astype(jnp.int32)
  sending = jnp.clip(jnp.maximum(wanted, guaranteed), 1, plan.capacity)
  return jnp.arange(plan.capacity) < sending


def _take_blocks(x: jax.Array, indices: jax.Array, block_size: int) -> jax.Array:
  """Blocks ``indices`` of the flat buffer ``x`` as ``[len(indices), block_size]`` rows.

  Reads only those blocks; the tail block (shorter when ``block_size`` does not divide
  ``x.size``) comes zero-padded.
  """
  whole = x.size // block_size
  if whole == 0:  # the buffer is one short block
    return jnp.broadcast_to(jnp.pad(x, (0, block_size - x.size)), (indices.size, block_size))
  # dynamic_slice clamps the tail block's start, so its row is replaced below.
  rows = jax.vmap(lambda i: jax.lax.dynamic_slice(x, (i * block_size,), (block_size,)))(indices)
  if x.size == whole * block_size:
    return rows
  tail = jnp.pad(x[whole * block_size:], (0, (whole + 1) * block_size - x.size))
  return jnp.where((indices == whole)[:, None], tail, rows)


def _put_blocks(x: jax.Array, indices: jax.Array, rows: jax.Array,
                block_size: int) -> jax.Array:
  """``x`` with blocks ``indices`` replaced by ``rows`` (the tail block's row cut to length).

  A scatter of whole windows, which XLA does in place on ``x``'s buffer when ``x`` is not used
  afterwards; the tail block, whose window would overrun the buffer, is dropped from it and
  written by a second scatter of its own length (or by none when it is not selected).
  """
  size = x.size
  whole = size // block_size
  windows = jax.lax.ScatterDimensionNumbers(update_window_dims=(1,), inserted_window_dims=(),
                                            scatter_dims_to_operand_dims=(0,))
  out = x
  if whole:
    out = jax.lax.scatter(x, (indices * block_size)[:, None], rows.astype(x.dtype), windows,
                          indices_are_sorted=False, unique_indices=True,
                          mode=jax.lax.GatherScatterMode.FILL_OR_DROP)
  tail = size - whole * block_size
  if tail:
    is_tail = indices == whole
    start = jnp.where(jnp.any(is_tail), whole * block_size, size)  # out of bounds: dropped
    row = rows[jnp.argmax(is_tail), :tail].astype(x.dtype)
    out = jax.lax.scatter(out, start[None, None], row[None], windows, indices_are_sorted=True,
                          unique_indices=True, mode=jax.lax.GatherScatterMode.FILL_OR_DROP)
  return out


def _after(value: jax.Array, last_read: jax.Array) -> jax.Array:
  """``value``, computed by XLA only once ``last_read`` exists.

  ``last_read`` is never negative (block energies or indices), so this adds 0 at run time;
  XLA cannot know that, so whatever uses the result waits for ``last_read``. (An
  ``optimization_barrier`` orders the same but keeps XLA from writing in place.)
  """
  return value + jnp.where(jnp.any(last_read < 0), 1, 0).astype(value.dtype)


def _zeros_after(last_read: jax.Array, shape: tuple[int, ...], dtype) -> jax.Array:
  """Zeros filled only once ``last_read`` exists, so XLA can write them over a dead buffer.

  A constant ``jnp.zeros`` may be filled at any time, even before the gradient it could
  overwrite has been read; XLA then gives it fresh memory (on CPU, page faults on every call for
  a large buffer) and copies the result into the donated output. Zeros filled after
  ``last_read`` (computed from every element of the gradient) go straight into its donated
  buffer.
  """
  return jnp.broadcast_to(_after(jnp.zeros((), dtype), last_read), shape)


def _ema(average: jax.Array, fresh: jax.Array, decay: float) -> jax.Array:
  """``decay * average + (1 - decay) * fresh``, kept in the state's float32."""
  return (decay * average + (1.0 - decay) * fresh).astype(average.dtype)
