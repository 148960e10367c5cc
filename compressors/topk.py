"""Top-k sparsification (Aji & Heafield 2017; Stich et al. 2018 "Sparsified SGD with memory").

Each worker keeps the ``k = round(density * d)`` entries of largest magnitude (exact
``lax.top_k``) and sends them as values plus int32 indices. Supports differ across workers, so
the payloads are all-gathered: about ``2 k (n - 1)`` words per worker, growing with ``n``.
"""

import jax

from compressors import base
from compressors import sparse


def topk(density: float) -> base.Compressor:
  """Exact magnitude top-k.

  Args:
    density: fraction of the buffer's entries sent each step, in (0, 1].

  Returns:
    A :class:`compressors.base.Compressor` with an all-gather exchange.
  """
  density = sparse.check_fraction(density, "density", "topk")

  def encode(x, state, ctx):
    k = sparse.selection_size(density, x.size, "the buffer", "topk")
    _, indices = jax.lax.top_k(abs(x), k)
    return sparse.gather(x, indices), state

  return sparse.all_gather_compressor(
      "topk", encode,
      validate=lambda size, where: sparse.selection_size(density, size, where, "topk"))
