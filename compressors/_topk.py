"""Top-k sparsification (Aji & Heafield 2017; Stich et al. 2018 "Sparsified SGD with memory").

Each worker keeps the ``k = round(density * d)`` entries of largest magnitude (exact
``lax.top_k``) and sends them as values plus int32 indices. Supports differ across workers, so
the payloads are all-gathered: about ``2 k (n - 1)`` words per worker, growing with ``n``.
"""

import dataclasses
import jax

from compressors import checks
from compressors import protocol
from compressors import _sparse as sparse
from compressors import registry
from compressors import topology as topology_lib


def topk(density: float) -> protocol.Compressor:
  """Exact magnitude top-k.

  Args:
    density: fraction of the buffer's entries sent each step, in (0, 1].

  Returns:
    A :class:`compressors.Compressor` with an all-gather exchange.
  """
  density = checks.check_fraction(density, "density", "topk")

  def encode(x, state, ctx):
    k = sparse.selection_size(density, x.size, "the buffer", "topk")
    _, indices = jax.lax.top_k(abs(x), k)
    return sparse.gather(x, indices), state

  return sparse.all_gather_compressor(
      "topk", encode,
      validate=lambda size, where: sparse.selection_size(density, size, where, "topk"))


@dataclasses.dataclass(frozen=True)
class TopkSettings:
  """``method="topk"``: ``density``, the fraction of entries sent."""
  density: float = 0.01


registry.register(registry.Method(
    name="topk", summary="exact magnitude top-k, values and indices all-gathered (Aji & "
    "Heafield 2017; Stich et al. 2018)", settings=TopkSettings,
    compressor=lambda s: topk(s.density), budget="density",
    cost=lambda s, shapes, topology, schedule: topology_lib.topk_allgather_cost(
        topology, max(1, round(s.density * registry.num_elements(shapes))))))
