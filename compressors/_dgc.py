"""Deep Gradient Compression's sparsifier (Lin, Han, Mao, Wang & Dally, ICLR 2018).

DGC is this sparsifier inside :func:`compressors.momentum_correction`: per worker and step, with
``g`` the local gradient, ``u`` the velocity and ``v`` the accumulation (here:
:func:`compressors.compress`'s error-feedback residual),

1. *local gradient clipping*: ``g <- g * min(1, clip_norm / (sqrt(n) ||g||))``
   (``momentum_correction(..., clip_norm=...)``);
2. *momentum correction*: ``u <- m u + g``, and the accumulation ``a = v + u`` is what gets
   sparsified (``momentum_correction``: chain DGC with plain SGD, no second momentum);
3. *threshold from a sample* (this compressor): the threshold is the ``density``-quantile of
   ``|a|`` over a random sample of ``sample_fraction`` of the entries (and of at least
   ``2 / density`` of them), instead of an exact top-k over all of them;
4. the threshold is corrected as GRACE's DGC does (Xu et al. 2021) until ``k`` to ``2k``
   entries pass it (``k = round(density * d)``, the capacity), and the ``k`` largest of those
   are sent, ``v`` keeps the rest (:func:`compressors._sparse.sampled_top_k`: with ``k`` to
   ``2k`` candidates this is the exact top-k of the whole buffer);
5. *momentum factor masking*: ``u`` is zeroed where an entry was sent (``momentum_correction``,
   told by ``compress(..., report_sent=True)``);
6. *warm-up* (this compressor): the density starts at ``warmup_initial_density`` (25%) and falls
   by 4x per stage (75%, 93.75%, 98.4375%, 99.6% sparsity, ...) until ``density``, the stages
   splitting ``warmup_steps`` evenly.

The whole method::

  momentum_correction(compress(dgc(0.001), axis_name="data", report_sent=True), 0.9,
                      clip_norm=5.0, axis_name="data")

Every stage has its own static payload capacity, so the step is compiled once, with a
``lax.switch`` over the stages; ``compressors.wire_bytes`` charges a switch at its most
expensive branch (the first warm-up stage), so measure steady-state bytes with
``warmup_steps=0``.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from compressors import checks
from compressors import protocol
from compressors import _sparse as sparse
from compressors import registry


def dgc(density: float, *, sample_fraction: float = 0.01, warmup_steps: int = 0,
        warmup_initial_density: float = 0.25) -> protocol.Compressor:
  """DGC's sparsifier: a threshold estimated from a sample, with DGC's density warm-up.

  Args:
    density: steady-state fraction of entries sent, in (0, 1] (0.001 in the paper).
    sample_fraction: fraction of entries sampled to estimate the threshold, in (0, 1].
    warmup_steps: steps of exponential density warm-up; 0 starts at ``density``.
    warmup_initial_density: density of the first warm-up stage, in [density, 1].

  Returns:
    A :class:`compressors.Compressor` (all-gather exchange). Use it with error feedback on (the
    default: the residual is DGC's accumulation) inside
    :func:`compressors.momentum_correction`, as the module docstring shows.
  """
  density = checks.check_fraction(density, "density", "dgc")
  sample_fraction = checks.check_fraction(sample_fraction, "sample_fraction", "dgc")
  warmup_initial_density = checks.check_fraction(
      warmup_initial_density, "warmup_initial_density", "dgc")
  if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
    raise ValueError(f"dgc: warmup_steps={warmup_steps!r} must be an int >= 0")
  if warmup_steps and warmup_initial_density < density:
    raise ValueError(f"dgc: warmup_initial_density={warmup_initial_density} is below "
                     f"density={density}; the warm-up must start at or above the final density")
  stage_densities = warmup_stages(density, warmup_initial_density) if warmup_steps else [density]
  stage_length = max(1, math.ceil(warmup_steps / max(1, len(stage_densities) - 1)))

  def encode_at(stage_density, x, state, ctx):
    sparse.selection_size(stage_density, x.size, "the buffer", "dgc")
    indices, count = sparse.sampled_top_k(abs(x), stage_density, sample_fraction,
                                          ctx.private_key)
    return sparse.gather(x, indices, count), state

  def stage_compressor(stage_density):
    return sparse.all_gather_compressor("dgc", functools.partial(encode_at, stage_density))

  def aggregate(x, state, ctx):
    buffer_state = protocol.BufferState(compressor=state, owner_residual=None)
    branches = [functools.partial(protocol.exchange, stage_compressor(d))
                for d in stage_densities]
    if len(branches) == 1:
      out = branches[0](x, buffer_state, ctx)
    else:
      stage = jnp.minimum(ctx.step // stage_length, len(branches) - 1)
      out = jax.lax.switch(stage, [lambda x, s, b=b: b(x, s, ctx) for b in branches], x,
                           buffer_state)
    return out._replace(state=out.state.compressor)

  def validate(size, where):
    for d in stage_densities:
      sparse.selection_size(d, size, where, "dgc")

  return protocol.Compressor(name="dgc", encode=None, decode=None, exchange="all_gather",
                             aggregate=aggregate, validate=validate)


def warmup_stages(density: float, initial_density: float) -> list[float]:
  """DGC's exponential warm-up: ``initial, initial/4, initial/16, ...`` down to ``density``."""
  stages = []
  current = initial_density
  while current > density * (1 + 1e-9):
    stages.append(current)
    current /= 4
  return stages + [density]


@dataclasses.dataclass(frozen=True)
class DGCSettings:
  """``method="dgc"``: the sparsifier's settings (:func:`dgc`) and its momentum correction's
  (``momentum``, ``clip_norm``: :func:`compressors.momentum_correction`)."""
  density: float = 0.01
  momentum: float = 0.9
  clip_norm: float | None = None
  sample_fraction: float = 0.01
  warmup_steps: int = 0
  warmup_initial_density: float = 0.25


METHODS = (registry.Method(
    name="dgc", summary="Deep Gradient Compression: momentum correction around a sampled "
    "threshold, with warm-up (Lin et al. 2018)", settings=DGCSettings,
    compressor=lambda s: dgc(s.density, sample_fraction=s.sample_fraction,
                             warmup_steps=s.warmup_steps,
                             warmup_initial_density=s.warmup_initial_density),
    momentum=lambda s: (s.momentum, s.clip_norm), budget="density",
    cost=lambda s, shapes, topology, schedule: sparse.payload_cost(s.density, shapes, topology)),)
