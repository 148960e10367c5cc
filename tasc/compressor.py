"""TASC's compressor: Hessian-aware block scores, a shared block support, one compact all-reduce.

Per worker and step, on its buffer ``a = g + e`` (:func:`compressors.compress` adds the
error-feedback residual ``e`` and keeps what is not sent):

1. cut ``a`` into ``num_blocks`` blocks of ``block_size`` and score each block,
   ``(eps * mean|h| + mean_{i in b}|h_i|) * ||a_b||^2`` (:mod:`tasc.scores`);
2. agree on the support: the ``K`` blocks of highest *all-reduced* score (:mod:`tasc.support`);
   because the scores are summed over workers before ranking, the support is the same on every
   worker even when each worker's curvature estimate differs (a local empirical Fisher);
3. gather the chosen blocks into a compact ``[K, block_size]`` payload and all-reduce it (no
   indices travel: every worker knows the support); scatter the mean back.

Support
  ``"global"``: the scores of this step are all-reduced first (one extra all-reduce of
  ``num_blocks`` floats, ``1/block_size`` of the gradient). ``"previous"``: no extra
  collective; the scores ride in the payload's all-reduce and rank the blocks of the *next*
  step. What rides is the score of what error feedback keeps, ``w_b * ||a_b - sent_b||^2``: a
  block just sent has an empty residual and waits one step, a block not sent competes with all
  it has accumulated; the next step's fresh gradient is what this prediction misses. The first
  step, with no scores yet (all zero), sends blocks ``0 .. K-1``; error feedback keeps the rest.

Bytes. Per worker, the all-reduce operands are ``K * block_size + num_blocks`` floats whatever
the number of workers ``n`` (an all-reduce moves ``2 (n-1)/n`` of its operand per worker), where
top-k's all-gather moves ``2 k (n-1)`` words; with ``wire_dtype="float16"`` they are half as many
bytes, plus one number per worker for the payload's scale.

Memory traffic. The buffer is never padded or copied: the blocks are a free reshape of ``a``
(:func:`tasc.scores.block_sums`), only the ``K`` chosen blocks are gathered, and error feedback
keeps ``a`` with those blocks replaced, in place (``compress`` hands over ``g`` and ``e``:
:class:`compressors.transform.ResidualAggregate`) rather than subtracting a dense ``sent``. The
dense mean's zeros are filled once the blocks are chosen, so XLA writes them over the
gradient's (donated) buffer instead of fresh memory. A step thus reads ``g`` and ``e`` and
writes ``a`` once, with the block energies taken in the same pass (:mod:`tasc.fused`: a CPU
kernel, as XLA's CPU backend cannot fuse the reduction into the sum, used where it can write
over ``e`` in place, ``Context.owns_buffers``; elsewhere one more read of ``a``), and writes the
mean's zeros once.

Wire precision (``wire_dtype``)
  ``"float16"`` halves both all-reduces, so that at a given budget of bytes the blocks can be
  half as large or twice as many (T1's model at 102x: 1.6% of its 256-element blocks instead
  of 0.5%). Each worker's scores are divided by its largest before the cast: they span many
  octaves, and the ranking needs their order, not their scale. The payload is multiplied by one
  power of two shared by all workers (an exact scaling) so that its sum cannot overflow, and
  error feedback keeps each worker's rounding exactly (``a - sent``, where ``sent`` is the value
  that went on the wire). The scale comes from ``sqrt(max_b ||a_b||^2)``, a bound on a worker's
  largest ``|a_i|``. With ``support="global"`` every worker all-reduces its bound (one float32
  more), and the bounds' sum maps to half of float16's largest value. With ``"previous"`` the
  bounds ride in the payload (as float16, at the current scale) and set the *next* step's scale
  (the first step's is 1) with 256-fold headroom, and each worker clips its payload to ``1/n``
  of that half: what a stale scale clips is kept by error feedback, not lost.

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

import numbers
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp

from compressors import axes
from compressors import base
from compressors import dense
from compressors import sparse
from compressors import transform
from tasc import fused
from tasc import scores
from tasc import support as support_lib

SENSITIVITIES = ("hutchinson", "fisher", "none")
SUPPORTS = ("global", "previous")
WIRE_DTYPES = ("float32", "float16")
# The summed payload is scaled to at most half of float16's largest value: headroom for the
# roundings of the scale and of the sum. The scale stays a normal float32 power of two.
_FLOAT16_TARGET = float(jnp.finfo(jnp.float16).max) / 2
_MAX_EXPONENT = 100
# With "previous" support the scale comes from last step's bounds; this much headroom lets a
# worker's largest value grow 256-fold before its clip (float16 has 40 octaves to spare).
_STALE_SCALE_HEADROOM = 2.0 ** 8
Density = float | Callable[[jax.Array], jax.Array]


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
  # The scores are all-reduced, hence identical on every worker: replicated under shard_map.
  per_worker_fields = ("curvature",)


def tasc_compressor(density: Density, *, block_size: int = 256,
                    sensitivity: str = "hutchinson", support: str = "global",
                    curvature_decay: float = 0.9, eps: float = 0.1,
                    max_density: float | None = None, min_blocks_per_leaf: int = 0,
                    leaf_sizes: Sequence[int] | None = None,
                    dense_axis: axes.AxisName = None,
                    wire_dtype: str = "float32") -> base.Compressor:
  """The TASC :class:`compressors.base.Compressor` (psum exchange, extra argument ``curvature``).

  Most users want :func:`tasc.tasc_compress`, which wraps this in :func:`compressors.compress`.

  Args:
    density: fraction of the buffer's blocks sent each step, in (0, 1]; or a function of the
      step (int32) returning it, with ``max_density`` set.
    block_size: ``B``, elements per block (>= 1).
    sensitivity: ``"hutchinson"``, ``"fisher"`` or ``"none"`` (see the module docstring).
    support: ``"global"`` or ``"previous"`` (see the module docstring).
    curvature_decay: EMA factor ``beta`` in [0, 1) of the curvature kept in the state
      (``c <- beta c + (1 - beta) * new``); 0 uses each fresh estimate alone.
    eps: the curvature floor relative to the mean curvature (>= 0); larger leans towards
      magnitude ranking.
    max_density: the capacity's density when ``density`` is a function; None otherwise.
    min_blocks_per_leaf: blocks of every leaf always sent (:mod:`tasc.support`); raises the
      capacity above ``density``'s when the guarantees need more.
    leaf_sizes: sizes of the leaves fused into the buffer (for ``min_blocks_per_leaf`` in fused
      mode); None when each buffer is one leaf.
    dense_axis: the fast axis when :func:`compressors.compress` runs in hierarchical mode
      (the buffer is then this device's shard; ``"fisher"`` and the leaf layout need to know).
    wire_dtype: ``"float32"`` or ``"float16"``, the precision of the scores and the payload on
      the wire (see the module docstring).

  Returns:
    A :class:`compressors.base.Compressor`.
  """
  dynamic = callable(density)
  if dynamic:
    if max_density is None:
      raise ValueError("tasc: density is a schedule (a callable of the step), so max_density "
                       "is required: the payload's capacity must be static; pass the "
                       "schedule's largest value, e.g. max_density=0.25")
    capacity_density = sparse.check_fraction(max_density, "max_density", "tasc")
  else:
    if max_density is not None:
      raise ValueError(f"tasc: max_density={max_density!r} is only for a density schedule; "
                       f"density={density!r} is a number")
    capacity_density = sparse.check_fraction(density, "density", "tasc")
  _check_int(block_size, "block_size", 1)
  _check_choice(sensitivity, "sensitivity", SENSITIVITIES)
  _check_choice(support, "support", SUPPORTS)
  wire_dtype = dense.dtype_name(wire_dtype) or wire_dtype
  _check_choice(wire_dtype, "wire_dtype", WIRE_DTYPES)
  narrow = wire_dtype == "float16"
  _check_real(curvature_decay, "curvature_decay", 0.0, 1.0, "[0, 1)")
  _check_real(eps, "eps", 0.0, float("inf"), "[0, inf)")
  _check_int(min_blocks_per_leaf, "min_blocks_per_leaf", 0)
  keeps_curvature = sensitivity != "none"

  def layout(size):
    """(leaf groups of this buffer's blocks or None, static capacity)."""
    blocks = scores.num_blocks(size, block_size)
    selected = round(capacity_density * blocks)
    if leaf_sizes is None:  # the buffer is one leaf
      return None, max(selected, min(min_blocks_per_leaf, blocks))
    shards = axes.num_workers(dense_axis, caller="tasc (dense_axis)")
    total = sum(leaf_sizes)
    if -(-total // shards) != size:
      raise ValueError(f"tasc: leaf_sizes add up to {total} elements, which in {shards} "
                       f"shard(s) do not make the buffer of {size} elements being compressed")
    table = support_lib.leaf_groups(leaf_sizes, block_size, shards)
    capacity = max(selected, support_lib.guaranteed_count(table, min_blocks_per_leaf))
    groups = jnp.asarray(table)[axes.worker_index(dense_axis)] if shards > 1 else table[0]
    return jnp.asarray(groups), capacity

  def validate(size, where):
    blocks = scores.num_blocks(size, block_size)
    if round(capacity_density * blocks) < 1:
      field = "max_density" if dynamic else "density"
      raise ValueError(
          f"tasc: {field}={capacity_density} keeps round({capacity_density} * {blocks}) = 0 of "
          f"the {blocks} blocks of {block_size} elements in {where} ({size} elements); use "
          f"{field} >= {0.5 / blocks:.3g}, a smaller block_size, or fuse the leaves")

  def init(x):
    blocks = scores.num_blocks(x.size, block_size)
    zeros = jnp.zeros((blocks,), jnp.float32)
    return TascState(curvature=zeros if keeps_curvature else (),
                     scores=zeros if support == "previous" else (),
                     scale=jnp.ones((), jnp.float32) if narrow and support == "previous" else ())

  def precondition(g, state, ctx):
    """Fisher: the EMA of the block means of this worker's squared gradient."""
    del ctx
    if dense_axis is not None:
      shards = axes.num_workers(dense_axis, caller="tasc (dense_axis)")
      fresh = scores.block_means(transform.owned_shard(g * g, dense_axis, shards), block_size)
    else:
      fresh = scores.block_means(g, block_size, jnp.square)
    if fresh.shape != state.curvature.shape:
      raise ValueError(f"tasc: the gradient buffer has {g.size} elements but the state "
                       f"holds {state.curvature.size} blocks; in hierarchical mode pass "
                       "dense_axis to tasc_compressor as to compressors.compress")
    return g, state._replace(curvature=_ema(state.curvature, fresh, curvature_decay))

  def exchange(g, e, state, ctx):
    """One step on ``a = g + e`` (``e`` None: ``a = g``): ``(mean, sent, kept, state)``.

    ``kept`` is ``a - sent``, built as ``a`` with the sent blocks replaced (in place: the
    blocks sent are zero, those a density schedule holds back stay whole); the caller uses
    ``sent`` or ``kept`` and jit drops the other.
    """
    if e is None:
      x, energies = g, scores.block_energies(g, block_size)
    else:
      x, energies = fused.residual_and_energies(g, e, block_size, one_pass=ctx.owns_buffers)
    size = x.size
    curvature = state.curvature
    if sensitivity == "hutchinson" and "curvature" in ctx.extras:
      fresh = scores.block_means(ctx.extras["curvature"], block_size, jnp.abs)
      curvature = _ema(curvature, fresh, curvature_decay)
    weights = (scores.curvature_weights(curvature, size, block_size, eps) if keeps_curvature
               else jnp.ones_like(energies))

    groups, capacity = layout(size)
    if support == "previous":
      priority = state.scores
    elif narrow:
      priority, to_wire = _float16_scores_and_scale(weights * energies, energies, ctx)
    else:
      priority = _mean_over_workers(weights * energies, ctx)
    indices, guaranteed = support_lib.select(priority, capacity, groups, min_blocks_per_leaf)
    blocks = _take_blocks(x, indices, block_size)
    rows = blocks
    if dynamic:
      wanted = jnp.round(density(ctx.step) * energies.size).astype(jnp.int32)
      sending = jnp.clip(jnp.maximum(wanted, guaranteed), 1, capacity)
      rows = jnp.where(jnp.arange(capacity)[:, None] < sending, rows, 0)

    next_scale = state.scale
    if support == "previous":
      if narrow:
        wire_rows, rows = _to_float16(rows, state.scale, _FLOAT16_TARGET / ctx.num_workers)
      # The score of what error feedback keeps: only the selected blocks' energies change.
      kept_energies = energies.at[indices].set(jnp.sum(jnp.square(blocks - rows), axis=1))
      if narrow:
        payload = jnp.concatenate([wire_rows.reshape(-1),
                                   _float16_scores(weights * kept_energies),
                                   _float16_bound(energies, state.scale, ctx.num_workers)])
        mean_payload = base.exchange(_FLOAT16_SUM, payload, _NO_STATE, ctx).mean
        mean_rows = mean_payload[:rows.size].reshape(rows.shape) / state.scale
        next_scale = _next_scale(mean_payload[-1], state.scale, ctx.num_workers)
        mean_payload = mean_payload[:-1]
      else:
        payload = jnp.concatenate([rows.reshape(-1), weights * kept_energies])
        mean_payload = _mean_over_workers(payload, ctx)
        mean_rows = mean_payload[:rows.size].reshape(rows.shape)
      next_scores = mean_payload[rows.size:].astype(state.scores.dtype)
      replicated_after_energies = next_scores
    elif narrow:
      wire_rows, rows = _to_float16(rows, to_wire)
      mean_rows = base.exchange(_FLOAT16_SUM, wire_rows, _NO_STATE, ctx).mean / to_wire
      next_scores, replicated_after_energies = (), indices
    else:
      mean_rows, next_scores = _mean_over_workers(rows, ctx), ()
      replicated_after_energies = indices
    # The outputs overwrite dead buffers in place only if XLA writes them after the last read of
    # ``a``, the block energies; with "previous" support the indices do not wait for them, so
    # the residual's scatter is ordered explicitly. The mean's zeros wait for a value that is
    # replicated, so that the mean is too.
    mean = _put_blocks(_zeros_after(replicated_after_energies, x.shape, x.dtype), indices,
                       mean_rows, block_size)
    sent = _put_blocks(jnp.zeros_like(x), indices, rows, block_size)
    kept = _put_blocks(x, _after(indices, energies), blocks - rows, block_size)
    return mean, sent, kept, TascState(curvature=curvature, scores=next_scores, scale=next_scale)

  def aggregate(x, state, ctx):
    mean, sent, _, new_state = exchange(x, None, state, ctx)
    return base.Aggregate(mean=mean, sent=sent, state=new_state)

  def add_residual(g, e, state, ctx):
    mean, sent, kept, new_state = exchange(g, e, state, ctx)
    return base.Aggregate(mean=mean, sent=sent, state=new_state), kept

  return base.Compressor(
      name="tasc", encode=None, decode=None, exchange="psum", init=init,
      precondition=precondition if sensitivity == "fisher" else None,
      aggregate=transform.ResidualAggregate(aggregate, add_residual),
      extra_args=("curvature",) if sensitivity == "hutchinson" else (),
      validate=validate)


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


_NO_STATE = base.BufferState(compressor=(), owner_residual=None)
# A float16 payload summed by the all-reduce and widened to float32 before the division by the
# number of workers, which float16 would round.
_FLOAT16_SUM = base.Compressor(name="tasc_float16", encode=lambda x, state, ctx: (x, state),
                               decode=lambda payload, ctx: payload.astype(jnp.float32))


def _mean_over_workers(x: jax.Array, ctx: base.Context) -> jax.Array:
  """The mean over workers of ``x``: a dense all-reduce with the transformation's schedule."""
  return base.exchange(dense.none(), x, _NO_STATE, ctx).mean


def _float16_scores(local_scores: jax.Array) -> jax.Array:
  """This worker's scores divided by its largest, as float16: the ranking needs their order,
  and they span more octaves than float16 holds."""
  peak = jnp.max(local_scores)
  return (local_scores / jnp.where(peak > 0, peak, 1.0)).astype(jnp.float16)


def _largest_bound(energies: jax.Array) -> jax.Array:
  """A bound on this worker's largest ``|a_i|``: no element exceeds its block's norm."""
  return jnp.sqrt(jnp.max(energies))


def _float16_scores_and_scale(local_scores: jax.Array, energies: jax.Array,
                              ctx: base.Context) -> tuple[jax.Array, jax.Array]:
  """``support="global"``: the float16 scores' mean over workers and this step's payload scale.

  Returns ``(priority, to_wire)``, both replicated: ``to_wire``, a power of two, multiplies the
  payload so that its sum over workers is at most half of float16's largest value.
  """
  priority = _mean_over_workers(_float16_scores(local_scores), ctx).astype(jnp.float32)
  total_bound = ctx.num_workers * _mean_over_workers(_largest_bound(energies)[None], ctx)[0]
  exponent = jnp.floor(jnp.log2(_FLOAT16_TARGET / jnp.where(total_bound > 0, total_bound, 1.0)))
  return priority, _power_of_two(exponent)


def _float16_bound(energies: jax.Array, to_wire: jax.Array, num_workers: int) -> jax.Array:
  """``support="previous"``: this worker's bound on its largest ``|a_i|`` at the scale
  ``to_wire``, over ``num_workers`` and clipped so that the sum stays finite, as ``f16[1]``."""
  limit = float(jnp.finfo(jnp.float16).max) / num_workers
  bound = _largest_bound(energies) * to_wire / num_workers
  return jnp.minimum(bound, limit).astype(jnp.float16)[None]


def _next_scale(mean_bound: jax.Array, to_wire: jax.Array, num_workers: int) -> jax.Array:
  """The next step's power of two: it maps the sum of this step's bounds to 1/256 of half of
  float16's largest, headroom for the next step's values to grow.

  ``mean_bound`` is the mean over workers of :func:`_float16_bound` at the scale ``to_wire``;
  when every bound fell below float16's range, the scale grows by 2^16 (and is clipped to
  float32's normal range).
  """
  total = mean_bound * num_workers / to_wire * num_workers
  target = _FLOAT16_TARGET / _STALE_SCALE_HEADROOM
  exponent = jnp.where(total > 0, jnp.floor(jnp.log2(target / jnp.where(total > 0, total, 1.0))),
                       jnp.round(jnp.log2(to_wire)) + 16)
  return _power_of_two(exponent)


def _power_of_two(exponent: jax.Array) -> jax.Array:
  """``2 ** exponent`` exactly (``exp2`` is approximate on some backends), as float32, the
  exponent clipped to +-100 so that it stays normal."""
  biased = jnp.clip(exponent, -_MAX_EXPONENT, _MAX_EXPONENT).astype(jnp.int32) + 127
  return jax.lax.bitcast_convert_type(biased << 23, jnp.float32)


def _to_float16(rows: jax.Array, to_wire: jax.Array,
                limit: float | None = None) -> tuple[jax.Array, jax.Array]:
  """``(wire, sent)``: ``rows`` times ``to_wire`` (clipped to ``+-limit``) as float16, and the
  value that went on the wire in ``rows``' units, rounding and clipping included; a power of
  two ``to_wire`` makes ``rows - sent`` exactly what was not sent."""
  scaled = rows * to_wire
  if limit is not None:
    scaled = jnp.clip(scaled, -limit, limit)
  wire = scaled.astype(jnp.float16)
  return wire, wire.astype(jnp.float32) / to_wire


def _ema(average: jax.Array, fresh: jax.Array, decay: float) -> jax.Array:
  """``decay * average + (1 - decay) * fresh``, kept in the state's float32."""
  return (decay * average + (1.0 - decay) * fresh).astype(average.dtype)


def _check_int(value, field: str, minimum: int) -> None:
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise TypeError(f"tasc: {field} must be an int >= {minimum}, got {value!r}")
  if value < minimum:
    raise ValueError(f"tasc: {field}={value!r} is below {minimum}; it must be an int >= "
                     f"{minimum}")


def _check_real(value, field: str, low: float, high: float, allowed: str) -> None:
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise TypeError(f"tasc: {field} must be a number in {allowed}, got {value!r}")
  if not low <= float(value) < high:
    raise ValueError(f"tasc: {field}={value!r} is outside {allowed}")


def _check_choice(value, field: str, allowed: tuple[str, ...]) -> None:
  if value not in allowed:
    raise ValueError(f"tasc: {field}={value!r} is unknown; allowed: {allowed}")
