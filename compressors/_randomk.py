"""Random-k sparsification with a support shared by all workers.

The ``k`` indices come from a key identical on every worker and folded with the step (Stich et
al. 2018; Wangni et al. 2018), so no index travels and the payload, ``k`` values, is summable:
one all-reduce of ``k`` floats, whatever the number of workers. With ``rescale=True`` the values
are scaled by ``d / k`` so that the compressor is unbiased; with error feedback leave it off
(the residual already carries what was not sent).
"""

import dataclasses
import math

import jax
import jax.numpy as jnp

from compressors import checks
from compressors import protocol
from compressors import _sparse as sparse
from compressors import method_table
from compressors.network import topology as topology_lib

# Draws beyond their mean that sampling by rejection makes (see _draws_for): the chance that
# they still hold fewer than k distinct indices is far below 1e-12, and even then the result is
# exact (the slow path runs instead).
_SPARE_SIGMAS = 10.0


def randomk(density: float, *, rescale: bool = False) -> protocol.Compressor:
  """Random-k with shared indices.

  Args:
    density: fraction of the buffer's entries sent each step, in (0, 1].
    rescale: multiply the sent values by ``d / k`` (unbiased, higher variance).

  Returns:
    A :class:`compressors.Compressor` with a summable (``psum``) exchange.
  """
  density = checks.check_fraction(density, "density", "randomk")

  def indices(ctx):
    k = sparse.selection_size(density, ctx.size, "the buffer", "randomk")
    return uniform_subset(ctx.shared_key, ctx.size, k)

  def encode(x, state, ctx):
    return x[indices(ctx)], state

  def decode(values, ctx):
    scale = ctx.size / values.shape[0] if rescale else 1.0
    return jnp.zeros((ctx.size,), values.dtype).at[indices(ctx)].set(values * scale)

  def sent_mask_of(values, ctx):
    del values
    return jnp.zeros((ctx.size,), bool).at[indices(ctx)].set(True)

  return protocol.Compressor(
      name="randomk", encode=encode, decode=decode, exchange="psum",
      sent_mask_of=sent_mask_of,
      validate=lambda size, where: sparse.selection_size(density, size, where, "randomk"))


def uniform_subset(key: jax.Array, size: int, k: int) -> jax.Array:
  """``k`` distinct indices of ``range(size)``, every k-subset equally likely.

  Sampling without replacement by rejection: ``m`` indices drawn with replacement, of which the
  first ``k`` distinct ones in draw order are kept (one sort of the ``m ~ k`` draws). The
  alternative, the ``k`` largest of ``size`` iid uniforms, is exact too but costs a top-k over
  the whole buffer: 1.2 s at 25.6M elements on CPU (100x the memory-bandwidth floor), against
  0.1 s for this, mostly the sort of the draws. It remains the path where rejection would need
  ``m >= size / 2`` draws (densities above ~0.35, or tiny buffers), and the fallback, taken at
  run time, when the ``m`` draws hold fewer than ``k`` distinct indices (probability far below
  1e-12).

  Args:
    key: a PRNG key; the same key gives the same indices (shared by every worker).
    size: ``d``, the buffer's length.
    k: how many indices, in [1, size].

  Returns:
    ``int32[k]``, in the order they were drawn.
  """
  draws = _draws_for(size, k)
  key, fallback_key = jax.random.split(key)
  if draws is None:
    return _largest_uniforms(fallback_key, size, k)
  picked = jax.random.randint(key, (draws,), 0, size, dtype=jnp.int32)
  ranked, order = jax.lax.sort_key_val(picked, jnp.arange(draws, dtype=jnp.int32))
  # Whether each draw is its index's first: the sort is stable, so repeats follow it.
  first = jnp.zeros((draws,), bool).at[order].set(
      jnp.concatenate([jnp.ones((1,), bool), ranked[1:] != ranked[:-1]]), unique_indices=True)
  positions = jnp.nonzero(first, size=k, fill_value=draws)[0]
  return jax.lax.cond(positions[-1] < draws, lambda: picked[positions],
                      lambda: _largest_uniforms(fallback_key, size, k))


def _draws_for(size: int, k: int) -> int | None:
  """Draws with replacement that hold ``k`` distinct indices of ``range(size)`` but for a chance
  far below 1e-12: the mean plus ``_SPARE_SIGMAS`` standard deviations of the number needed
  (a sum of geometric waits, the j-th with success ``(size - j) / size``), and 16. None when
  that is half the buffer or more: a top-k over the buffer is then as cheap."""
  if 2 * k > size:
    return None
  # mean = sum_{j<k} size / (size - j) = size (H_size - H_{size-k}), within 1 of this.
  mean = size * math.log((size + 0.5) / (size - k + 0.5))
  # var = sum_{j<k} j size / (size - j)^2, at most this (each term at most j size / (size-k)^2).
  sigma = math.sqrt(k * k * size / (size - k) ** 2 / 2)
  draws = math.ceil(mean + _SPARE_SIGMAS * sigma) + 16
  return draws if 2 * draws < size else None


def _largest_uniforms(key: jax.Array, size: int, k: int) -> jax.Array:
  """The ``k`` largest of ``size`` iid uniforms: a uniform k-subset, by a top-k over ``size``."""
  return jax.lax.top_k(jax.random.uniform(key, (size,)), k)[1].astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class RandomkSettings:
  """``method="randomk"``: ``density`` sent; ``rescale`` by ``d / k`` (unbiased)."""
  density: float = checks.setting(0.01, checks.FRACTION)
  rescale: bool = checks.setting(False, checks.Rule(bool))

  def __post_init__(self):
    checks.check_settings(self, "randomk")


METHODS = (method_table.Method(
    name="randomk", summary="k entries at indices shared by all workers, all-reduced (Stich et "
    "al. 2018)", settings=RandomkSettings,
    compressor=lambda s: randomk(s.density, rescale=s.rescale), budget="density",
    cost=lambda s, shapes, topology, schedule: topology_lib.all_reduce_cost(
        schedule, topology, max(1, round(s.density * method_table.num_elements(shapes))))),)
