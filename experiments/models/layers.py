"""Pieces shared by the transformer models.

``check_sizes``: the validation of a transformer's sizes and dropout rate, before it is built.

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


def check_sizes(model, name: str, int_fields: tuple[str, ...]) -> None:
  """Refuses a transformer ``model`` whose ``int_fields`` are not positive ints, whose
  ``num_heads`` does not divide its ``hidden``, or whose ``dropout`` is outside [0, 1); the
  message starts with the model's ``name``."""
  for field in int_fields:
    value = getattr(model, field)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f"{name}: {field}={value!r} must be a positive int")
  if model.hidden % model.num_heads:
    raise ValueError(f"{name}: num_heads={model.num_heads} must divide hidden={model.hidden}")
  if not 0.0 <= model.dropout < 1.0:
    raise ValueError(f"{name}: dropout={model.dropout!r} must be in [0, 1)")
