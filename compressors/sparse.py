"""Shared pieces of the sparsifying compressors: (value, index) payloads and their checks.

Top-k, threshold and DGC all send a fixed-capacity list of (value, int32 index) pairs. The
supports differ from worker to worker, so the payloads are not summable: they are all-gathered
and scatter-added on every worker in worker order (one accumulator, so the result is
bit-identical everywhere and costs ``O(n k + d)`` rather than ``O(n d)``).
"""

import numbers
from typing import NamedTuple

import jax
import jax.numpy as jnp

from compressors import base


class SparsePayload(NamedTuple):
  """A fixed-capacity sparse buffer.

  Attributes:
    values: ``f32[capacity]``; entries past ``count`` are ignored.
    indices: ``int32[capacity]`` positions in the buffer; distinct within one payload.
    count: number of valid entries (``int32`` scalar), or None when every entry is valid.
  """
  values: jax.Array
  indices: jax.Array
  count: jax.Array | None = None


def check_fraction(value, field: str, caller: str) -> float:
  """Checks that ``value`` is a real number in (0, 1] and returns it as a float."""
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise TypeError(f"{caller}: {field} must be a number in (0, 1], got {value!r}")
  if not 0.0 < float(value) <= 1.0:
    raise ValueError(f"{caller}: {field}={value!r} is outside (0, 1]; it is the fraction of "
                     "gradient elements sent each step (0.01 sends 1%)")
  return float(value)


def selection_size(density: float, size: int, where: str, caller: str) -> int:
  """``k = round(density * size)``, with a clear error when that is 0."""
  k = int(round(density * size))
  if k < 1:
    raise ValueError(
        f"{caller}: density={density} keeps round({density} * {size}) = 0 of the {size} "
        f"elements of {where}; use density >= {0.5 / size:.3g} for this buffer, or fuse the "
        "leaves into one buffer (compress(..., fuse=True))")
  return k


def select_up_to(mask: jax.Array, capacity: int, key: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Positions of at most ``capacity`` True entries of ``mask``, and how many there are.

  Overflow policy: when more than ``capacity`` entries qualify, the scan starts at a random
  position (``key``) and runs cyclically, so no region of the buffer is starved step after step;
  what does not fit stays in the error-feedback residual and competes again next step.
  Unused slots hold index 0; the count tells the receiver they are not valid.
  """
  size = mask.shape[0]
  start = jax.random.randint(key, (), 0, size)
  rotated = jnp.roll(mask, -start)
  (positions,) = jnp.nonzero(rotated, size=capacity, fill_value=0)
  count = jnp.minimum(jnp.sum(mask, dtype=jnp.int32), capacity)
  valid = jnp.arange(capacity) < count
  indices = jnp.where(valid, (positions + start) % size, 0).astype(jnp.int32)
  return indices, count


def gather(x: jax.Array, indices: jax.Array, count: jax.Array | None = None) -> SparsePayload:
  """The payload holding ``x`` at ``indices`` (only the first ``count`` are valid)."""
  return SparsePayload(values=x[indices], indices=indices, count=count)


def _valid_values(values: jax.Array, count: jax.Array | None) -> jax.Array:
  if count is None:
    return values
  return jnp.where(jnp.arange(values.shape[-1]) < count, values, 0)


def decode(payload: SparsePayload, size: int) -> jax.Array:
  """Dense ``f32[size]`` buffer holding one payload's valid values (zeros elsewhere)."""
  values = _valid_values(payload.values, payload.count)
  return jnp.zeros((size,), values.dtype).at[payload.indices].add(values)


def decode_gathered(payloads: SparsePayload, size: int, num_workers: int) -> jax.Array:
  """Sum of all workers' payloads (leaves with a leading worker axis), in worker order."""
  def add_worker(i, total):
    count = None if payloads.count is None else payloads.count[i]
    return total.at[payloads.indices[i]].add(_valid_values(payloads.values[i], count))
  return jax.lax.fori_loop(0, num_workers, add_worker,
                           jnp.zeros((size,), payloads.values.dtype))


def all_gather_compressor(name: str, encode, **fields) -> base.Compressor:
  """A :class:`compressors.base.Compressor` whose (value, index) payloads are all-gathered."""
  return base.Compressor(
      name=name,
      encode=encode,
      decode=lambda p, ctx: decode(p, ctx.size),
      decode_gathered=lambda p, ctx: decode_gathered(p, ctx.size, ctx.num_workers),
      exchange="all_gather",
      **fields)
