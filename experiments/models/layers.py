"""Pieces shared by the transformer models.

``COMPUTE_DTYPES``: what a transformer's ``compute_dtype`` allows. Mixed precision as GPUs train
transformers: the parameters, the optimizer's state and the gradients (so the exchange) stay
float32; only the matrix products (projections, attention scores, the MLP, the logits) run in
``"bfloat16"``, with float32 accumulation where XLA offers it, and the residual stream, layer
norms, softmax and loss stay float32. A lower-precision wire stays the compressors' choice.

``gelu``: the exact GELU, ``x / 2 * erfc(-x / sqrt(2))`` (Hendrycks & Gimpel 2016), as
``flax.linen.gelu(x, approximate=False)`` computes it, with the derivative of ``erfc`` written
out, ``-2 / sqrt(pi) * exp(-x^2)``. JAX 0.12's own rule for that derivative evaluates a
polynomial whose constant coefficients are not typed as varying across a ``shard_map`` axis, so
differentiating a per-worker copy of the parameters (as every data-parallel step here does)
fails its type check. The rule written here is JAX 0.10's, so the numbers are the same there.
"""

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np


@jax.custom_jvp
def _erfc(x: jax.Array) -> jax.Array:
  return lax.erfc(x)


@_erfc.defjvp
def _erfc_jvp(primals, tangents):
  (x,), (tangent,) = primals, tangents
  slope = jnp.asarray(-2.0 / np.sqrt(np.pi), x.dtype)
  return _erfc(x), slope * (tangent * jnp.exp(-jnp.square(x)))


def gelu(x: jax.Array) -> jax.Array:
  """The exact (erf) GELU of ``x``."""
  sqrt_half = np.sqrt(0.5).astype(x.dtype)
  return 0.5 * x * _erfc(-x * sqrt_half)


# The dtypes of a transformer's matrix products (parameters and gradients stay float32 either way).
COMPUTE_DTYPES = ("float32", "bfloat16")
