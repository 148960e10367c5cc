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
6. *warm-up*: the density starts at 25% and falls exponentially (75%, 93.75%, 98.4375%,
   99.6% sparsity) to ``density`` over the first epochs. That is the framework's general density
   warm-up, for every sparsifier (``config.compression.density_warmup_steps``,
   ``density_warmup_start``, ``density_warmup_stages``; compressors/_warmup.py), not this
   compressor's: a density sets the payload's static shape, so each stage is its own compiled
   program (a step kind), charged its own bytes, all stages sharing one state.

The whole method::

  momentum_correction(compress(dgc(0.001), axis_name="data", report_sent=True), 0.9,
                      clip_norm=5.0, axis_name="data")

and with the warm-up, as the runner builds it (``method="dgc"``)::

  registry.transformation("dgc", DGCSettings(density=0.001, clip_norm=5.0), axis_name="data",
                          common=method_table.Common(density_warmup_steps=1560))
"""

import dataclasses

from compressors import checks
from compressors import protocol
from compressors import _sparse as sparse
from compressors import method_table


def dgc(density: float, *, sample_fraction: float = 0.01) -> protocol.Compressor:
  """DGC's sparsifier: a threshold estimated from a sample.

  Args:
    density: fraction of entries sent, in (0, 1] (0.001 in the paper). DGC's density warm-up
      is the framework's (``config.compression.density_warmup_steps``, compressors/_warmup.py),
      which builds this compressor once per stage's density.
    sample_fraction: fraction of entries sampled to estimate the threshold, in (0, 1].

  Returns:
    A :class:`compressors.Compressor` (all-gather exchange). Use it with error feedback on (the
    default: the residual is DGC's accumulation) inside
    :func:`compressors.momentum_correction`, as the module docstring shows.
  """
  density = checks.check_fraction(density, "density", "dgc")
  sample_fraction = checks.check_fraction(sample_fraction, "sample_fraction", "dgc")

  def encode(x, state, ctx):
    sparse.selection_size(density, x.size, "the buffer", "dgc")
    indices, count = sparse.sampled_top_k(abs(x), density, sample_fraction, ctx.private_key)
    return sparse.gather(x, indices, count), state

  return sparse.all_gather_compressor(
      "dgc", encode,
      validate=lambda size, where: sparse.selection_size(density, size, where, "dgc"))


@dataclasses.dataclass(frozen=True)
class DGCSettings:
  """``method="dgc"``: the sparsifier's settings (:func:`dgc`) and its momentum correction's
  (``momentum``, ``clip_norm``: :func:`compressors.momentum_correction`)."""
  density: float = checks.setting(0.01, checks.FRACTION)
  momentum: float = checks.setting(0.9, checks.Rule(float, low=0, high=1, high_open=True))
  clip_norm: float | None = checks.setting(None, checks.Rule(float, low=0, low_open=True,
                                                             optional=True))
  sample_fraction: float = checks.setting(0.01, checks.FRACTION)

  def __post_init__(self):
    checks.check_settings(self, "dgc")


METHODS = (method_table.Method(
    name="dgc", summary="Deep Gradient Compression: momentum correction around a sampled "
    "threshold (Lin et al. 2018); its warm-up is density_warmup_steps", settings=DGCSettings,
    compressor=lambda s: dgc(s.density, sample_fraction=s.sample_fraction),
    momentum=lambda s: (s.momentum, s.clip_norm), budget="density",
    cost=lambda s, shapes, topology, schedule: sparse.payload_cost(s.density, shapes, topology)),)
