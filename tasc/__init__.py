"""TASC: Hessian-aware, topology-aware, structured sparsification, and curvature estimators.

``tasc.TascSettings`` holds every setting of TASC; ``tasc.tasc(settings)`` is the
:class:`compressors.Compressor` and ``tasc.tasc_compress(settings, *, axis_name, ...)`` its Optax
transformation (``compressors.compress`` around it, with per-axis densities and the leaf layout
TASC needs; ``tasc_compress(axis_name=..., density=0.01)`` builds the settings from keywords).
The method ``"tasc"`` of :mod:`compressors.registry` takes the same settings, with its per-step
input: a Hutchinson estimate of the Hessian diagonal every ``hessian_every`` steps.

What the benchmarks measure of TASC's passes over memory is public too, so that no module outside
``tasc`` imports its private ones: ``one_pass_available`` (whether the block energies ride the
pass that writes ``g + e``) and ``cpu_block_sums_everywhere`` (TASC compiled as it was before
its block sums had a GPU form).
"""

from compressors import method_table
from tasc import _transform
from tasc._compressor import TascState
from tasc._compressor import tasc
from tasc._fused import one_pass_available
from tasc._hessian import HutchinsonEstimate
from tasc._hessian import PowerIterationResult
from tasc._hessian import hutchinson
from tasc._hessian import hutchinson_diagonal
from tasc._hessian import hutchinson_trace
from tasc._hessian import hvp
from tasc._hessian import top_eigenvalue
from tasc._scores import block_scores
from tasc._scores import cpu_block_sums_everywhere
from tasc._settings import TascSettings
from tasc._transform import tasc_compress

__all__ = (
    "HutchinsonEstimate", "PowerIterationResult", "TascSettings", "TascState", "block_scores",
    "cpu_block_sums_everywhere", "hutchinson", "hutchinson_diagonal", "hutchinson_trace", "hvp",
    "one_pass_available", "tasc", "tasc_compress", "top_eigenvalue",
)

# TASC's method joins compressors' method table when tasc is imported, as the registry adds the
# built-in methods' (compressors never imports tasc: experiments -> tasc -> compressors, and tasc
# imports only the layers below the registry), so whoever runs methods by name imports tasc.
for _method in _transform.METHODS:
  method_table.register(_method)
