"""Shared pieces of the sparsifying compressors: (value, index) payloads and their checks.

Top-k, threshold and DGC all send a fixed-capacity list of (value, int32 index) pairs. The
supports differ from worker to worker, so the payloads are not summable: they are all-gathered
and scatter-added on every worker in worker order (one accumulator, so the result is
bit-identical everywhere and costs ``O(n k + d)`` rather than ``O(n d)``).

:func:`sampled_top_k` is DGC's selection, which top-k uses on accelerators: a threshold from a
sample, corrected as GRACE does, then an exact top-k of the few candidates that pass it, in
place of a sort of the whole buffer.
"""

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from compressors import protocol
from compressors import method_table
from compressors.network import topology as topology_lib


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


def selection_size(density: float, size: int, where: str, caller: str) -> int:
  """``k = round(density * size)``, with a clear error when that is 0."""
  k = int(round(density * size))
  if k < 1:
    # Only a leaf's own buffer can grow by fusing the leaves into one.
    fusing = (", or fuse the leaves into one buffer (compress(..., fuse=True))" if "leaf" in where
              else "")
    raise ValueError(
        f"{caller}: density={density} keeps round({density} * {size}) = 0 of the {size} "
        f"elements of {where}; use density >= {0.5 / size:.3g} for this buffer{fusing}")
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


def sampled_top_k(magnitudes: jax.Array, density: float, sample_fraction: float,
                  key: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The ``capacity = round(density * size)`` largest of ``magnitudes`` without sorting them
  all (DGC, Lin et al. 2018, with GRACE's correction, Xu et al. 2021):
  ``(indices[capacity], count)``.

  1. the threshold is the ``density``-quantile of a random sample of ``sample_fraction`` of the
     entries, and of at least ``2 / density`` of them (the DGC authors' code takes as many: the
     quantile of a sample with fewer than two entries above it is the sample's maximum, far too high
     on a small buffer);
  2. it is corrected up to 10 times, scaled by 1.3 while more than ``2 capacity`` entries pass it
     or by 0.7 while fewer than ``capacity`` do (:func:`corrected_threshold`; when that ends with
     too few, the highest threshold seen that enough passed);
  3. the entries that pass (at most ``2 capacity``, overflow as in :func:`select_up_to`) are the
     candidates, and the ``capacity`` largest of them are taken (an exact top-k of at most
     ``2 capacity`` values, cheap).

  With ``capacity`` to ``2 capacity`` candidates this is the exact top-k of the whole buffer;
  when ten corrections do not reach that band, more than ``2 capacity`` pass and the candidates
  are ``2 capacity`` of them, not necessarily the largest (ties, as when every magnitude is
  equal); error feedback keeps the rest. A sample of every entry gives the exact
  threshold at once.

  Args:
    magnitudes: ``f32[size]``, non-negative.
    density: fraction of the entries to take, at least one (:func:`selection_size`).
    sample_fraction: fraction of the entries sampled, in (0, 1].
    key: the sample's and the overflow's randomness.
  """
  size = magnitudes.shape[0]
  capacity = round(density * size)
  sample_key, overflow_key = jax.random.split(key)
  num_samples = min(size, max(round(sample_fraction * size), math.ceil(2 / density)))
  sample = magnitudes  # every entry: the exact k-th largest magnitude
  if num_samples < size:
    sample = sample[jax.random.randint(sample_key, (num_samples,), 0, size)]
  num_above = max(1, round(density * num_samples))
  candidates = min(size, 2 * capacity)
  cut = corrected_threshold(magnitudes, jax.lax.top_k(sample, num_above)[0][-1], capacity,
                            candidates)
  indices, count = select_up_to(magnitudes >= cut, candidates, overflow_key)
  valid = jnp.arange(candidates) < count
  _, best = jax.lax.top_k(jnp.where(valid, magnitudes[indices], -1), capacity)
  return indices[best], jnp.minimum(count, capacity)


def corrected_threshold(magnitudes: jax.Array, cut: jax.Array, low: int, high: int,
                        rounds: int = 10) -> jax.Array:
  """GRACE's correction of a sampled threshold: up to ``rounds`` times, ``cut * 1.3`` while more
  than ``high`` of ``magnitudes`` reach it, ``cut * 0.7`` while fewer than ``low`` do (one pass
  over the buffer per round; none when the sampled threshold is already right). Where the rounds
  end with fewer than ``low`` passing (ties no scaling splits), the highest threshold seen that
  ``low`` passed (0 at worst: every entry) is taken instead, so that a capacity is still filled.
  """
  def passing(c):
    return jnp.sum(magnitudes >= c, dtype=jnp.int32)

  def wrong(state):
    i, _, n, _ = state
    return (i < rounds) & ((n < low) | (n > high))

  def rescale(state):
    i, c, n, enough = state
    c = jnp.where(n > high, c * 1.3, c * 0.7).astype(c.dtype)
    n_next = passing(c)
    return i + 1, c, n_next, jnp.where(n_next >= low, jnp.maximum(enough, c), enough)

  n = passing(cut)
  enough = jnp.where(n >= low, cut, jnp.zeros_like(cut))
  _, cut, n, enough = jax.lax.while_loop(wrong, rescale, (0, cut, n, enough))
  return jnp.where(n < low, enough, cut)


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


def sent_mask(payload: SparsePayload, size: int) -> jax.Array:
  """``bool[size]``: True at the payload's valid indices."""
  valid = (jnp.ones(payload.indices.shape, bool) if payload.count is None
           else jnp.arange(payload.indices.shape[-1]) < payload.count)
  return jnp.zeros((size,), bool).at[payload.indices].max(valid)


def decode_gathered(payloads: SparsePayload, size: int, num_workers: int) -> jax.Array:
  """Sum of all workers' payloads (leaves with a leading worker axis), in worker order."""
  def add_worker(i, total):
    count = None if payloads.count is None else payloads.count[i]
    return total.at[payloads.indices[i]].add(_valid_values(payloads.values[i], count))
  return jax.lax.fori_loop(0, num_workers, add_worker,
                           jnp.zeros((size,), payloads.values.dtype))


def all_gather_compressor(name: str, encode, **fields) -> protocol.Compressor:
  """A :class:`compressors.Compressor` whose (value, index) payloads are all-gathered."""
  return protocol.Compressor(
      name=name,
      encode=encode,
      decode=lambda p, ctx: decode(p, ctx.size),
      decode_gathered=lambda p, ctx: decode_gathered(p, ctx.size, ctx.num_workers),
      exchange="all_gather",
      sent_mask_of=lambda p, ctx: sent_mask(p, ctx.size),
      **fields)


def payload_cost(density: float, shapes, topology) -> topology_lib.Cost:
  """The cost entry of an all-gather of every worker's (value, index) list of capacity
  ``round(density * d)`` and its count, for gradients of ``shapes`` fused into one buffer."""
  capacity = max(1, round(density * method_table.num_elements(shapes)))
  return topology_lib.all_gather_cost(topology, capacity * 8 + 4)
