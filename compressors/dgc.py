"""Deep Gradient Compression (Lin, Han, Mao, Wang & Dally, ICLR 2018).

Per worker and step, with ``g`` the local gradient, ``u`` the velocity and ``v`` the
accumulation (here: :func:`compressors.compress`'s error-feedback residual):

1. *local gradient clipping*: ``g <- g * min(1, clip_norm / (sqrt(n) ||g||))`` (DGC scales the
   global threshold by ``n^-1/2`` because the n local gradients are summed);
2. *momentum correction*: ``u <- m u + g``, and the accumulation ``a = v + u`` is what gets
   sparsified (so momentum is applied before, not after, the sparsification: chain DGC with plain
   SGD, no second momentum);
3. *threshold from a sample*: the threshold is the ``density``-quantile of ``|a|`` over a random
   sample of ``sample_fraction`` of the entries, instead of an exact top-k over all of them;
4. entries of ``|a|`` above the threshold are sent (fixed capacity ``round(density * d)``,
   overflow as in :func:`compressors.sparse.select_up_to`), ``v`` keeps the rest;
5. *momentum factor masking*: ``u`` is zeroed where an entry was sent;
6. *warm-up*: the density starts at ``warmup_initial_density`` (25%) and falls by 4x per stage
   (75%, 93.75%, 98.4375%, 99.6% sparsity, ...) until ``density``, the stages splitting
   ``warmup_steps`` evenly.

Every stage has its own static payload capacity, so the step is compiled once, with a
``lax.switch`` over the stages; ``compressors.wire_bytes`` charges a switch at its most
expensive branch (the first warm-up stage), so measure steady-state bytes with
``warmup_steps=0``.
"""

import functools
import math
import numbers

import jax
import jax.numpy as jnp
import optax

from compressors import base
from compressors import sparse


def dgc(density: float, *, momentum: float = 0.9, clip_norm: float | None = None,
        sample_fraction: float = 0.01, warmup_steps: int = 0,
        warmup_initial_density: float = 0.25) -> base.Compressor:
  """Deep Gradient Compression.

  Args:
    density: steady-state fraction of entries sent, in (0, 1] (0.001 in the paper).
    momentum: momentum ``m`` of the correction, in [0, 1).
    clip_norm: global-norm threshold for local gradient clipping (scaled by ``n^-1/2``); None
      disables clipping.
    sample_fraction: fraction of entries sampled to estimate the threshold, in (0, 1].
    warmup_steps: steps of exponential density warm-up; 0 starts at ``density``.
    warmup_initial_density: density of the first warm-up stage, in [density, 1].

  Returns:
    A :class:`compressors.base.Compressor` (all-gather exchange). Use it with error feedback
    on (the default): the residual is DGC's accumulation.
  """
  density = sparse.check_fraction(density, "density", "dgc")
  sample_fraction = sparse.check_fraction(sample_fraction, "sample_fraction", "dgc")
  warmup_initial_density = sparse.check_fraction(
      warmup_initial_density, "warmup_initial_density", "dgc")
  if isinstance(momentum, bool) or not isinstance(momentum, numbers.Real) or not 0 <= momentum < 1:
    raise ValueError(f"dgc: momentum={momentum!r} must be in [0, 1)")
  if clip_norm is not None and not (isinstance(clip_norm, numbers.Real) and clip_norm > 0):
    raise ValueError(f"dgc: clip_norm={clip_norm!r} must be a positive number or None")
  if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
    raise ValueError(f"dgc: warmup_steps={warmup_steps!r} must be an int >= 0")
  if warmup_steps and warmup_initial_density < density:
    raise ValueError(f"dgc: warmup_initial_density={warmup_initial_density} is below "
                     f"density={density}; the warm-up must start at or above the final density")
  stage_densities = warmup_stages(density, warmup_initial_density) if warmup_steps else [density]
  stage_length = max(1, math.ceil(warmup_steps / max(1, len(stage_densities) - 1)))

  def init(x):
    return jnp.zeros_like(x)  # the velocity u

  def precondition(g, velocity, ctx):
    if clip_norm is not None:
      g = clip_locally(g, clip_norm, ctx.num_workers)
    velocity = momentum * velocity + g
    return velocity, velocity

  def encode_at(stage_density, x, velocity, ctx):
    capacity = sparse.selection_size(stage_density, x.size, "the buffer", "dgc")
    sample_key, overflow_key = jax.random.split(ctx.private_key)
    num_samples = min(x.size, max(1, round(sample_fraction * x.size)))
    sample = abs(x)  # sample_fraction=1: the exact k-th largest magnitude
    if num_samples < x.size:
      sample = sample[jax.random.randint(sample_key, (num_samples,), 0, x.size)]
    num_above = max(1, round(stage_density * num_samples))
    cut = jax.lax.top_k(sample, num_above)[0][-1]
    indices, count = sparse.select_up_to(abs(x) >= cut, capacity, overflow_key)
    valid = jnp.arange(capacity) < count
    velocity = velocity.at[indices].multiply(jnp.where(valid, 0.0, 1.0).astype(x.dtype))
    return sparse.gather(x, indices, count), velocity

  def stage_compressor(stage_density):
    return sparse.all_gather_compressor("dgc", functools.partial(encode_at, stage_density))

  def aggregate(x, velocity, ctx):
    state = base.BufferState(compressor=velocity, owner_residual=None)
    branches = [functools.partial(base.exchange, stage_compressor(d)) for d in stage_densities]
    if len(branches) == 1:
      out = branches[0](x, state, ctx)
    else:
      stage = jnp.minimum(ctx.step // stage_length, len(branches) - 1)
      out = jax.lax.switch(stage, [lambda x, s, b=b: b(x, s, ctx) for b in branches], x, state)
    return out._replace(state=out.state.compressor)

  def validate(size, where):
    for d in stage_densities:
      sparse.selection_size(d, size, where, "dgc")

  return base.Compressor(name="dgc", encode=None, decode=None, exchange="all_gather",
                         init=init, precondition=precondition, aggregate=aggregate,
                         validate=validate)


def clip_locally(grads, clip_norm: float, num_workers: int):
  """DGC's local gradient clipping (Sec. 3.4): ``grads`` (an array or a pytree) scaled to a
  global norm of at most ``clip_norm / sqrt(num_workers)``, so that the sum over the workers is
  clipped at ``clip_norm`` as synchronous training would clip it."""
  limit = clip_norm / math.sqrt(num_workers)
  norm = optax.tree.norm(grads)
  return jax.tree.map(
      lambda g: g * jnp.minimum(1.0, limit / jnp.maximum(norm, jnp.finfo(g.dtype).tiny)), grads)


def warmup_stages(density: float, initial_density: float) -> list[float]:
  """DGC's exponential warm-up: ``initial, initial/4, initial/16, ...`` down to ``density``."""
  stages = []
  current = initial_density
  while current > density * (1 + 1e-9):
    stages.append(current)
    current /= 4
  return stages + [density]
