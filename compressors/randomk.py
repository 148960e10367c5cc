"""Random-k sparsification with a support shared by all workers.

The ``k`` indices come from a key identical on every worker and folded with the step (Stich et
al. 2018; Wangni et al. 2018), so no index travels and the payload, ``k`` values, is summable:
one all-reduce of ``k`` floats, whatever the number of workers. With ``rescale=True`` the values
are scaled by ``d / k`` so that the compressor is unbiased; with error feedback leave it off
(the residual already carries what was not sent).
"""

import jax
import jax.numpy as jnp

from compressors import base
from compressors import sparse


def randomk(density: float, *, rescale: bool = False) -> base.Compressor:
  """Random-k with shared indices.

  Args:
    density: fraction of the buffer's entries sent each step, in (0, 1].
    rescale: multiply the sent values by ``d / k`` (unbiased, higher variance).

  Returns:
    A :class:`compressors.base.Compressor` with a summable (``psum``) exchange.
  """
  density = sparse.check_fraction(density, "density", "randomk")

  def indices(ctx):
    k = sparse.selection_size(density, ctx.size, "the buffer", "randomk")
    # The k largest of ``size`` iid uniforms are a uniformly random k-subset; 50x faster on CPU
    # than jax.random.choice(replace=False), which permutes the whole buffer.
    draws = jax.random.uniform(ctx.shared_key, (ctx.size,))
    return jax.lax.top_k(draws, k)[1].astype(jnp.int32)

  def encode(x, state, ctx):
    return x[indices(ctx)], state

  def decode(values, ctx):
    scale = ctx.size / values.shape[0] if rescale else 1.0
    return jnp.zeros((ctx.size,), values.dtype).at[indices(ctx)].set(values * scale)

  return base.Compressor(
      name="randomk", encode=encode, decode=decode, exchange="psum",
      validate=lambda size, where: sparse.selection_size(density, size, where, "randomk"))
