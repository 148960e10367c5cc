"""Top-k sparsification (Aji & Heafield 2017; Stich et al. 2018 "Sparsified SGD with memory").

Each worker keeps the ``k = round(density * d)`` entries of largest magnitude and sends them as
values plus int32 indices. Supports differ across workers, so the payloads are all-gathered:
about ``2 k (n - 1)`` words per worker, growing with ``n``.

Selection (``selection``): ``"exact"`` is ``lax.top_k`` over the whole buffer, a sort on GPUs
(each simulated worker's whole gradient, step after step); ``"sampled"`` is DGC's threshold from
a sample, corrected until ``k`` to ``2k`` entries pass it, then the exact top-k of those
(:func:`compressors._sparse.sampled_top_k`): the exact top-k whenever the correction lands in
that band, which ``tests/test_compressors.py`` measures (the share of the exact top-k sent).
``"auto"`` (the default) takes ``"exact"`` where JAX's default backend is the CPU, where this
project's CPU tables were made, and ``"sampled"`` on accelerators. The bytes are the same either
way, ``k`` values and indices, but for the count of valid entries (one int32) that
``"sampled"`` sends.
"""

import dataclasses

import jax

from compressors import checks
from compressors import protocol
from compressors import _sparse as sparse
from compressors import method_table
from compressors.network import topology as topology_lib

SELECTIONS = ("auto", "exact", "sampled")


def topk(density: float, *, selection: str = "auto",
         sample_fraction: float = 0.01) -> protocol.Compressor:
  """Magnitude top-k.

  Args:
    density: fraction of the buffer's entries sent each step, in (0, 1].
    selection: ``"exact"`` (``lax.top_k``), ``"sampled"`` (a corrected sampled threshold) or
      ``"auto"`` (exact on CPUs, sampled on accelerators); see the module docstring.
    sample_fraction: the fraction of the entries ``"sampled"`` draws its threshold from, in
      (0, 1] (at least ``2 / density`` entries are drawn).

  Returns:
    A :class:`compressors.Compressor` with an all-gather exchange.
  """
  density = checks.check_fraction(density, "density", "topk")
  selection = checks.check_choice(selection, "selection", SELECTIONS, "topk")
  sample_fraction = checks.check_fraction(sample_fraction, "sample_fraction", "topk")

  def encode(x, state, ctx):
    k = sparse.selection_size(density, x.size, "the buffer", "topk")
    chosen = selection
    if chosen == "auto":  # where this process runs its steps
      chosen = "exact" if jax.default_backend() == "cpu" else "sampled"
    if chosen == "exact":
      return sparse.gather(x, jax.lax.top_k(abs(x), k)[1]), state
    indices, count = sparse.sampled_top_k(abs(x), density, sample_fraction, ctx.private_key)
    return sparse.gather(x, indices, count), state

  return sparse.all_gather_compressor(
      "topk", encode,
      validate=lambda size, where: sparse.selection_size(density, size, where, "topk"))


@dataclasses.dataclass(frozen=True)
class TopkSettings:
  """``method="topk"``: ``density``, the fraction of entries sent; ``selection`` and
  ``sample_fraction``, how they are found (:func:`topk`)."""
  density: float = checks.setting(0.01, checks.FRACTION)
  selection: str = checks.setting("auto", checks.Rule(str, choices=SELECTIONS))
  sample_fraction: float = checks.setting(0.01, checks.FRACTION)

  def __post_init__(self):
    checks.check_settings(self, "topk")


METHODS = (method_table.Method(
    name="topk", summary="magnitude top-k, values and indices all-gathered (Aji & Heafield "
    "2017; Stich et al. 2018); exact, or a corrected sampled threshold on accelerators",
    settings=TopkSettings,
    compressor=lambda s: topk(s.density, selection=s.selection,
                              sample_fraction=s.sample_fraction), budget="density",
    cost=lambda s, shapes, topology, schedule: topology_lib.topk_allgather_cost(
        topology, max(1, round(s.density * method_table.num_elements(shapes))))),)
