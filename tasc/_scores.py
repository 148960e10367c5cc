"""Hessian-aware importance of gradient blocks: the score TASC ranks blocks by.

A worker's buffer ``a = g + e`` (gradient plus error-feedback residual, ``f32[d]``) is cut into
``num_blocks = ceil(d / B)`` blocks of ``B = block_size`` elements (the last one, the *tail*,
shorter when ``B`` does not divide ``d``). Block ``b`` scores

  score_b = (eps * mean_i |h_i| + mean_{i in b} |h_i|) * ||a_b||^2,

where ``h`` is a curvature estimate along each coordinate (the Hessian diagonal) and the first
mean runs over the whole buffer.

Why this score. Not sending block ``b`` this step leaves the parameters displaced from where the
synchronous step would have put them by ``delta_b = lr * a_b`` (error feedback sends it later).
Near a minimum of that direction the gradient term vanishes and the second-order term is what a
displacement costs, ``1/2 delta_b^T H_bb delta_b`` (the saliency of Optimal Brain Damage, LeCun et
al. 1990, and the sensitivity of HAWQ-v2, Dong et al. 2020, ``Tr(H_l)/n_l * ||dW_l||^2``). With
the learning rate a common factor, ranking by ``h_b * ||a_b||^2`` ranks blocks by the loss their
delay costs. It also says *why* delay hurts with error feedback: a residual held for ``k`` steps
in a direction of curvature ``h`` is applied in one lump ``k`` times too large, and overshoots as
soon as ``lr * k * h > 2``; in a flat direction the same lump is harmless. So a small gradient in
a sharp direction can matter more than a large one in a flat direction, and magnitude ranking
gets that backwards.

* Block mean of ``|h|``, not the per-coordinate ``sum_i |h_i| a_i^2``: AdaHessian's spatial
  averaging (Yao et al. 2021). A one-probe Hutchinson estimate ``z_i (Hz)_i`` carries the noise
  ``sum_{j != i} z_i z_j H_ij`` per coordinate; the block mean averages it down, and HAWQ-v2 uses
  the same per-group average (the trace over the group's size).
* ``|h|``, not ``h``: in a direction of negative curvature the quadratic model says a
  displacement lowers the loss, but there the model is least trustworthy (a saddle that the
  gradient is leaving ever faster), and a Hutchinson estimate of a positive diagonal is itself
  negative with noise; in both cases the size of the curvature is how sensitive the loss is to
  that direction. AdaHessian takes ``|diag H|`` for the same reason.
* ``eps * mean |h|``, a floor relative to the buffer's mean curvature: the score is unchanged
  when the curvature is scaled by any constant (so the estimate's units, its EMA bias and the
  number of probes do not matter), and flat blocks (``h ~ 0``) are still ranked among
  themselves by magnitude and are sent once their accumulated residual is large enough: ``eps``
  blends in the first-order term (``g^T delta``, what magnitude ranking measures). ``eps -> inf``
  recovers magnitude ranking.
* With no curvature (``sensitivity="none"``, or before the first estimate arrives, when every
  ``h`` is 0) the score is ``||a_b||^2``: OmniReduce's block-magnitude ranking (Fei et al. 2021).

The four scores TASC offers, each in two lines (``h_b`` the block's curvature weight above,
``delta_b`` the update the block's entries would make, ``lr`` the learning rate):

* magnitude, ``||a_b||^2`` (``sensitivity="none"``): the first-order loss change of sending the
  block is ``-g_b . delta_b = lr ||a_b||^2`` when ``delta_b = -lr a_b``;
  so it ranks blocks by what a plain gradient step on them would gain, curvature unseen.
* saliency, ``h_b ||a_b||^2`` (``score="saliency"``, the default, with ``"hutchinson"``): the
  loss a delay costs is the quadratic term ``1/2 delta_b^T H_bb delta_b = lr^2/2 h_b ||a_b||^2``
  (Optimal Brain Damage, LeCun et al. 1990; HAWQ-v2's ``Tr(H)/n ||dW||^2``), as derived above.
* Newton decrement, ``||a_b||^2 / h_b`` (``score="newton"``): the quadratic model
  ``g.d + 1/2 d^T H d`` is lowest at the Newton step ``d = -H^-1 g``, where it has fallen by
  ``1/2 g^T H^-1 g = 1/2 sum_i a_i^2 / h_i ~ ||a_b||^2 / (2 h_b)``: what a curvature-scaled step
  on the block (an Adam-like optimizer's) gains; flat blocks rank high, the opposite of saliency.
* Fisher, ``F_b ||a_b||^2`` (``sensitivity="fisher"``): near a minimum of the log-likelihood the
  Hessian is the expected outer product of the gradient, ``H ~ E[g g^T]``, whose diagonal
  ``E[g_i^2]`` the worker's own squared gradients estimate (an EMA): saliency, curvature for free.

The weight multiplies (saliency) or divides (Newton) the energy; the floor ``eps * mean |h|``
keeps the division bounded where the curvature vanishes.
"""

import contextlib
import functools
import math
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np


def num_blocks(size: int, block_size: int) -> int:
  """Blocks of ``block_size`` needed to cover ``size`` elements (the last one may be partial)."""
  return -(-size // block_size)


def block_counts(size: int, block_size: int) -> np.ndarray:
  """Valid (unpadded) elements in each block: ``block_size`` except, maybe, the last."""
  counts = np.full((num_blocks(size, block_size),), block_size, np.float32)
  counts[-1] = size - (counts.size - 1) * block_size
  return counts


def block_sums(x: jax.Array, block_size: int,
               fn: Callable[[jax.Array], jax.Array] | None = None) -> jax.Array:
  """Sum of ``fn(x)`` over each block of the flat buffer ``x``, reading ``x`` once, copying nothing.

  Each backend gets the form its compiler turns into one pass (``lax.platform_dependent``, so a
  program compiled for a GPU takes the GPU's form whatever the default backend):

  * CPU: the whole blocks are summed on a free reshape of ``x``, ``[d / q, q]`` with ``q`` the
    largest divisor of both ``d`` and ``block_size``, whose rows tile the blocks; a windowed sum
    of ``block_size / q`` rows gives one block each. The optimisation barrier keeps ``fn`` on
    the 2-D view: XLA's CPU reduction fuses an elementwise ``fn`` into the reduction there, but
    not across a reshape.
  * GPUs: XLA's GPU backend writes ``x`` and reduces it in one kernel (multi-output fusion) only
    when the reduction reads a plain reshape of all of ``x``, so it sums the rows of that same
    ``[d / q, q]`` view (a reduction, not a windowed sum, which it cannot fuse so), and a second,
    small reduction adds ``block_size / q`` row sums per block; the barrier between the two
    keeps XLA from merging them into one fusion that no longer shares ``x``'s pass. The row sums
    cost ``8 / q`` bytes per element, so for ``q < 4`` (``d`` not a multiple of 4) the blocks
    are summed directly from ``x`` once it is written, which reads it a second time.

  The tail block (``d`` not a multiple of ``block_size``) is summed on its own. Padding ``x`` to
  whole blocks instead would copy the buffer. Both forms give the same sums up to float rounding.

  Args:
    x: a flat (1-D) buffer of ``d`` elements.
    block_size: ``B``.
    fn: elementwise function applied first (e.g. ``jnp.square``); None sums ``x`` itself.

  Returns:
    ``[ceil(d / B)]`` block sums, in ``x``'s dtype.
  """
  fn = fn or (lambda v: v)
  if x.size < block_size:  # one short block: nothing to tile
    return jnp.sum(fn(x), keepdims=True)
  cpu = functools.partial(_block_sums_windowed, block_size=block_size, fn=fn)
  gpu = functools.partial(_block_sums_of_rows, block_size=block_size, fn=fn)
  return jax.lax.platform_dependent(x, cpu=cpu, default=gpu)


def _block_sums_windowed(x: jax.Array, *, block_size: int,
                         fn: Callable[[jax.Array], jax.Array]) -> jax.Array:
  """:func:`block_sums` for XLA's CPU backend: a windowed sum over the ``[d / q, q]`` view."""
  size, rows = x.size, math.gcd(x.size, block_size)
  whole = size // block_size
  view = jax.lax.optimization_barrier(x.reshape(size // rows, rows))
  window = (block_size // rows, rows)
  sums = jax.lax.reduce_window(fn(view), np.zeros((), x.dtype), jax.lax.add, window, window,
                               "VALID").reshape(whole)
  return _with_tail(sums, x, block_size, fn)


def _block_sums_of_rows(x: jax.Array, *, block_size: int,
                        fn: Callable[[jax.Array], jax.Array]) -> jax.Array:
  """:func:`block_sums` for XLA's GPU backend: row sums of the ``[d / q, q]`` view, then blocks."""
  size, rows = x.size, math.gcd(x.size, block_size)
  whole = size // block_size
  if rows < 4:
    # Without the barrier XLA would recompute ``x`` inside the reduction from what it is made
    # of (``g + e``: two reads) rather than read it once where it is written.
    x = jax.lax.optimization_barrier(x)
    sums = jnp.sum(fn(x[:whole * block_size].reshape(whole, block_size)), axis=1)
    return _with_tail(sums, x, block_size, fn)
  row_sums = jnp.sum(fn(x.reshape(size // rows, rows)), axis=1)
  if rows == block_size:
    return row_sums
  row_sums = jax.lax.optimization_barrier(row_sums)
  per_block = block_size // rows
  sums = jnp.sum(row_sums[:whole * per_block].reshape(whole, per_block), axis=1)
  if size > whole * block_size:
    sums = jnp.concatenate([sums, jnp.sum(row_sums[whole * per_block:], keepdims=True)])
  return sums


@contextlib.contextmanager
def cpu_block_sums_everywhere() -> Iterator[None]:
  """Within it, :func:`block_sums` traces the CPU's windowed form for every backend.

  That is how TASC compiled for GPUs before :func:`block_sums` had a GPU form: the memory-traffic
  model of B1 compiles TASC both ways to show the pass the GPU form saves. It changes how
  programs traced inside it compute (not what they compute, up to float rounding), for every
  thread, so use it for compiling to compare, never around training.

  Yields:
    None; on leaving, :func:`block_sums` takes each backend's own form again.
  """
  # block_sums looks the GPU form up by this name each time it traces.
  global _block_sums_of_rows  # pylint: disable=global-statement
  gpu_form = _block_sums_of_rows
  _block_sums_of_rows = _block_sums_windowed
  try:
    yield
  finally:
    _block_sums_of_rows = gpu_form


def _with_tail(sums: jax.Array, x: jax.Array, block_size: int,
               fn: Callable[[jax.Array], jax.Array]) -> jax.Array:
  """``sums`` of the whole blocks, with the tail block's sum appended when there is a tail."""
  whole = x.size // block_size
  if x.size == whole * block_size:
    return sums
  return jnp.concatenate([sums, jnp.sum(fn(x[whole * block_size:]), keepdims=True)])


def block_means(x: jax.Array, block_size: int,
                fn: Callable[[jax.Array], jax.Array] | None = None) -> jax.Array:
  """Mean of ``fn(x)`` over the valid elements of each block (``[num_blocks]``)."""
  return block_sums(x, block_size, fn) / block_counts(x.size, block_size)


def block_energies(x: jax.Array, block_size: int) -> jax.Array:
  """``||x_b||^2`` of each block ``x_b`` of the flat buffer ``x``."""
  return block_sums(x, block_size, jnp.square)


def curvature_weights(block_curvature: jax.Array, size: int, block_size: int,
                      eps: float) -> jax.Array:
  """``eps * mean |h| + mean_{i in b} |h_i|`` per block, or 1 where no curvature is known.

  Args:
    block_curvature: ``mean_{i in b} |h_i|`` per block (non-negative), ``f32[num_blocks]``.
    size: number of valid elements ``d`` of the buffer the blocks cut.
    block_size: ``B``.
    eps: the floor, relative to the buffer's mean curvature.

  Returns:
    ``f32[num_blocks]`` weights; all ones when the curvature is zero everywhere (no estimate
    yet), which makes the score the block's squared norm.
  """
  counts = block_counts(size, block_size)
  mean = jnp.sum(block_curvature * counts) / size
  return jnp.where(mean > 0, block_curvature + eps * mean, jnp.ones_like(block_curvature))


SCORES = ("saliency", "newton")


def score_weights(block_curvature: jax.Array, size: int, block_size: int, eps: float,
                  score: str) -> jax.Array:
  """What multiplies each block's energy: :func:`curvature_weights` (``"saliency"``) or its
  reciprocal (``"newton"``, the diagonal Newton decrement); ones where no curvature is known."""
  weights = curvature_weights(block_curvature, size, block_size, eps)
  return weights if score == "saliency" else 1.0 / weights


def block_scores(x: jax.Array, curvature: jax.Array | None = None, *, block_size: int = 256,
                 eps: float = 0.1, score: str = "saliency") -> jax.Array:
  """TASC's importance of each block of ``x`` (see the module docstring for the formula).

  Args:
    x: a worker's buffer (gradient plus residual), a 1-D float array of ``d`` elements.
    curvature: curvature along each element, shaped like ``x`` (e.g. a Hutchinson estimate of
      the Hessian diagonal, or squared gradients for the empirical Fisher); None ranks by
      magnitude alone.
    block_size: ``B``, elements per block.
    eps: the curvature floor, relative to the mean ``|h|``.
    score: ``"saliency"`` (curvature times energy) or ``"newton"`` (energy over curvature).

  Returns:
    ``f32[ceil(d / B)]``: ``(eps * mean |h| + mean_{i in b} |h_i|) * ||x_b||^2``, or
    ``||x_b||^2`` divided by that weight for ``"newton"``.
  """
  if score not in SCORES:
    raise ValueError(f"block_scores: score={score!r}; allowed: {list(SCORES)}")
  x = jnp.asarray(x)
  energies = block_energies(x.reshape(-1), block_size)
  if curvature is None:
    return energies
  curvature = jnp.asarray(curvature)
  if curvature.shape != x.shape:
    raise ValueError(f"block_scores: curvature has shape {curvature.shape}, x has shape "
                     f"{x.shape}; they must match (one curvature value per element)")
  block_curvature = block_means(curvature.reshape(-1), block_size, jnp.abs)
  return score_weights(block_curvature, x.size, block_size, eps, score) * energies
