"""Chunked top-k with 2-bit values and chunk-local indices: SparseLoCo's transport (Sarfi,
Therien, Lidin & Belilovsky 2025, "Communication Efficient LLM Pre-training with SparseLoCo",
arXiv 2508.15706).

SparseLoCo sends each worker's error-fed pseudo-gradient as ``Q(chunked-top-k(e))``: the buffer
is cut into chunks, each chunk keeps its ``k`` entries of largest magnitude, their values travel
in 2 bits and their positions as indices local to the chunk. Its public port (templar,
``tplr-ai/templar``: ``src/tplr/compress/topk.py``, production ``hparams.json``:
``topk_compression=64``, ``target_chunk=64`` (64 x 64 tiles), ``quantization_bins=4``,
12-bit index packing) is what this module follows. Per worker and chunk of ``chunk`` entries:

1. **Selection**: the ``k = round(density * chunk)`` entries of largest magnitude of the chunk
   (``lax.top_k`` per chunk; at least 1, else the settings are refused). The buffer is cut
   into ``ceil(d / chunk)`` chunks of consecutive entries (the ports tile each matrix in 64 x 64
   blocks; here the flat, possibly fused, buffer is cut: chunks of the same size, grouped
   otherwise); the last is padded with zeros up to ``chunk`` entries, and a padding entry
   counts as magnitude -1, so it is chosen only where the last chunk holds fewer than ``k``
   real entries; whatever lands on padding is dropped by the decoder.
2. **Values, 2 bits** (templar's ``TopKCompressor._quantize_values`` with
   ``quantization_bins=4`` and its default ``quantization_range=6``, applied per chunk): with
   ``v`` the chunk's ``k`` kept values, ``shift = mean(v)``, ``c = v - shift``,
   ``std = ||c||_2 / sqrt(k - 1)``, ``scale = 6 std / 4`` (1 where that is 0 or not finite, as
   templar does: ``k = 1``, or equal values), ``code = clip(round(c / scale + 2), 0, 3)``
   (ties to even, as ``torch.round``), and the chunk's four *levels* are the mean of ``c`` over
   each code's values (0 for an empty code) plus ``shift``. The receiver decodes
   ``levels[code]``. Templar sends ``shift`` and the four bin means; ``levels[code]`` is exactly
   its ``lookup[code] + shift`` (the same float32 addition), so four float32 per chunk carry
   it. Why this quantiser: it is the one SparseLoCo's authors run (templar), and its levels
   are the means of what they stand for, so 2 bits lose little of a heavy-tailed chunk; it is
   biased, which error feedback absorbs (the residual keeps ``e - decoded``). Templar takes the
   statistics over one tensor's kept values; here over one chunk's, because a fused buffer
   mixes tensors of different scales in one stream, and the four levels are the chunk's shared
   scale.
3. **Indices**: each position within its chunk, ``ceil(log2(chunk))`` bits (12 for 4096),
   packed into one bit stream (:func:`compressors._packing.pack_wide`); the 2-bit codes are
   packed four to a byte (:func:`compressors._packing.pack`).

Supports differ between workers, so the payload (codes, indices, levels) is all-gathered and
every worker decodes all of them in worker order into one accumulator: the same bits on every
worker. **The mean** (``average``): by default each entry's sum is divided by the number of
workers that sent it (``"senders"``), as the authors' ``sparseloco.py`` does
(``scatter_reduce_(reduce="mean", include_self=False)``; templar the same): an entry one worker
of ``n`` sent moves by that worker's value, not by ``1/n`` of it. ``average="workers"`` divides
every entry by ``n``, this module's mean before 2026-11-28 and the one every SparseLoCo row of
T1-LM, F6-LM and F7-LM ran with until then, kept for comparison. With shared supports the two
are equal; with SparseLoCo's differing supports most entries have one sender (322 of 353
changed entries in one check), so ``"workers"`` applies about ``1/n`` of the reference's step.

**1-D leaves** differ from the reference, which cuts each tensor into its own chunks (a bias of
32 entries is one chunk of its own, of which it keeps its share): here the run's leaves are fused
into one flat buffer before chunking, so a bias shares a chunk with its neighbours and keeps
whatever of its entries rank in that chunk's top ``k``: where biases and norms' scales move
more than the matrices' entries they share a chunk with, more of them are sent than the
reference's share (in one check of the CPU tier, 32 of 96 fused bias entries against the
reference's one of each 32-entry bias). Not yet measured in training loss. One worker sends ``(p - 1)`` payloads of ``ceil(2 n k / 8) + ceil(b n k / 8) + 16 n``
bytes for ``n`` chunks and ``b`` index bits: at ``k = 64`` of 4096 (density 1/64) that is 2
bytes per kept value against top-k's 8 (float32 value and int32 index), a quarter of its bytes
at equal density (:func:`compressors.network.topology.chunked_topk_allgather_cost`).
"""

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from compressors import checks
from compressors import method_table
from compressors import protocol
from compressors import _packing as packing
from compressors.network import topology as topology_lib

DEFAULT_CHUNK = 4096  # 64 x 64, the ports' tile
DEFAULT_DENSITY = 1 / 64  # k = 64 of 4096: templar's topk_compression, within the paper's 1-3%
MAX_CHUNK = 2**24  # indices of up to 24 bits
VALUE_BITS = 2
LEVELS = 2**VALUE_BITS  # templar's quantization_bins
RANGE_IN_SIGMAS = 6.0  # templar's quantization_range
LEVEL_BYTES = 4 * LEVELS  # four float32 levels per chunk
_CHUNK_RULE = checks.Rule(int, low=2, high=MAX_CHUNK)
_AVERAGE_RULE = checks.Rule(str, choices=protocol.AVERAGES)


class ChunkTopkPayload(NamedTuple):
  """One worker's chunked top-k payload of ``n`` chunks, ``k`` entries each.

  Attributes:
    codes: ``uint8[ceil(2 n k / 8)]``, the 2-bit value codes, chunk after chunk, four a byte.
    indices: ``uint8[ceil(b n k / 8)]``, the ``b``-bit chunk-local positions, one bit stream.
    levels: ``f32[n, 4]``, each chunk's value of each code.
  """
  codes: jax.Array
  indices: jax.Array
  levels: jax.Array


class Layout(NamedTuple):
  """How a buffer is cut: ``num_chunks`` chunks of ``chunk`` entries, ``k`` kept per chunk,
  indices of ``index_bits`` bits."""
  num_chunks: int
  chunk: int
  k: int
  index_bits: int


def per_chunk(density: float, chunk: int, caller: str = "chunk_topk") -> int:
  """``k = round(density * chunk)``, the entries kept per chunk.

  Raises:
    ValueError: ``k`` is 0, naming the density, the chunk and the densities allowed.
  """
  k = int(round(density * chunk))
  if k < 1:
    raise ValueError(f"{caller}: density={density!r} keeps round({density} * {chunk}) = 0 of "
                     f"each chunk's {chunk} entries; allowed: density in [{0.5 / chunk:.3g}, 1] "
                     f"for chunk={chunk} (at least one entry a chunk)")
  return k


def layout(size: int, chunk: int, density: float) -> Layout:
  """The :class:`Layout` of a buffer of ``size`` entries (the last chunk padded)."""
  return Layout(-(-size // chunk), chunk, per_chunk(density, chunk), (chunk - 1).bit_length())


def payload_bytes(size: int, chunk: int, density: float) -> int:
  """Bytes of one worker's payload for a buffer of ``size`` entries."""
  n, _, k, bits = layout(size, chunk, density)
  return (-(-n * k * VALUE_BITS // 8) + packing.wide_packed_size(n * k, bits)
          + n * LEVEL_BYTES)


def quantize_chunks(values: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Templar's 2-bit quantiser (``quantization_bins=4``, range 6 sigma), per chunk.

  Args:
    values: ``f32[n, k]``, each chunk's kept values.

  Returns:
    ``(codes, levels)``: ``uint8[n, k]`` codes in ``0..3`` and ``f32[n, 4]`` levels; a value
    decodes to ``levels[chunk, code]``. A non-finite value makes its chunk's levels non-finite,
    so the step's non-finite check sees it.
  """
  k = values.shape[1]
  shift = jnp.mean(values, axis=1, keepdims=True)
  centered = values - shift
  # Templar: std = ||c|| / sqrt(k - 1); with k = 1 that is 0 / 0, and the scale falls back to 1.
  std = jnp.sqrt(jnp.sum(centered * centered, axis=1, keepdims=True)) / np.float32(
      math.sqrt(k - 1) if k > 1 else 0.0)
  scale = np.float32(RANGE_IN_SIGMAS / LEVELS) * std
  scale = jnp.where((scale == 0) | ~jnp.isfinite(scale), jnp.ones_like(scale), scale)
  codes = jnp.clip(jnp.round(centered / scale + LEVELS // 2), 0, LEVELS - 1)
  codes = jnp.where(jnp.isfinite(codes), codes, 0).astype(jnp.uint8)
  # Each level: the mean of the centred values its code stands for (0 where none), plus shift.
  one_hot = codes[:, :, None] == jnp.arange(LEVELS, dtype=jnp.uint8)
  sums = jnp.sum(jnp.where(one_hot, centered[:, :, None], 0), axis=1)
  counts = jnp.sum(one_hot, axis=1, dtype=jnp.int32).astype(values.dtype)
  lookup = jnp.where(counts > 0, sums / jnp.where(counts > 0, counts, 1), 0)
  return codes, lookup + shift


def select(x: jax.Array, lay: Layout) -> tuple[jax.Array, jax.Array]:
  """``(positions, values)``, ``int32[n, k]`` chunk-local positions and ``f32[n, k]`` values of
  each chunk's ``k`` entries of largest magnitude (padding never before a real entry)."""
  n, chunk, k, _ = lay
  chunks = jnp.pad(x, (0, n * chunk - x.size)).reshape(n, chunk)
  magnitude = jnp.abs(chunks)
  if n * chunk > x.size:
    real = jnp.arange(n * chunk).reshape(n, chunk) < x.size
    magnitude = jnp.where(real, magnitude, -1)
  _, positions = jax.lax.top_k(magnitude, k)
  return positions, jnp.take_along_axis(chunks, positions, axis=1)


def encode_buffer(x: jax.Array, lay: Layout) -> ChunkTopkPayload:
  """One worker's payload for the buffer ``x`` (``f32[d]``)."""
  positions, values = select(x, lay)
  codes, levels = quantize_chunks(values)
  return ChunkTopkPayload(codes=packing.pack(codes.reshape(-1), VALUE_BITS),
                          indices=packing.pack_wide(positions.reshape(-1), lay.index_bits),
                          levels=levels)


def unpacked(payload: ChunkTopkPayload, lay: Layout) -> tuple[jax.Array, jax.Array]:
  """``(flat positions, decoded values)``, each ``[n * k]``: positions in the padded buffer of
  ``n * chunk`` entries."""
  n, chunk, k, bits = lay
  codes = packing.unpack(payload.codes, VALUE_BITS, n * k).reshape(n, k).astype(jnp.int32)
  positions = packing.unpack_wide(payload.indices, bits, n * k).reshape(n, k).astype(jnp.int32)
  values = jnp.take_along_axis(payload.levels, codes, axis=1)
  flat = positions + (jnp.arange(n, dtype=jnp.int32) * chunk)[:, None]
  return flat.reshape(-1), values.reshape(-1)


def decode_buffer(payload: ChunkTopkPayload, size: int, lay: Layout) -> jax.Array:
  """The dense ``f32[size]`` buffer one payload stands for (padding dropped)."""
  flat, values = unpacked(payload, lay)
  padded = jnp.zeros((lay.num_chunks * lay.chunk,), values.dtype).at[flat].add(values)
  return padded[:size]


def decode_gathered(payloads: ChunkTopkPayload, size: int, lay: Layout,
                    num_workers: int) -> jax.Array:
  """The sum of every worker's decoded payload (leaves with a leading worker axis), added in
  worker order into one accumulator, so every worker gets the same bits."""
  def add_worker(i, total):
    flat, values = unpacked(jax.tree.map(lambda p: p[i], payloads), lay)
    return total.at[flat].add(values)
  total = jax.lax.fori_loop(0, num_workers, add_worker,
                            jnp.zeros((lay.num_chunks * lay.chunk,), payloads.levels.dtype))
  return total[:size]


def sent_mask(payload: ChunkTopkPayload, size: int, lay: Layout) -> jax.Array:
  """``bool[size]``: True at the entries the payload carries."""
  flat, _ = unpacked(payload, lay)
  return jnp.zeros((lay.num_chunks * lay.chunk,), bool).at[flat].set(True)[:size]


def chunk_topk(density: float = DEFAULT_DENSITY, *, chunk: int = DEFAULT_CHUNK,
               average: str = "senders") -> protocol.Compressor:
  """SparseLoCo's transport: per chunk, the top ``k`` by magnitude, values in 2 bits with four
  levels per chunk, chunk-local packed indices, all-gathered (see the module docstring).

  Args:
    density: fraction of each chunk's entries sent, in (0, 1]; ``k = round(density * chunk)``
      must be at least 1.
    chunk: entries per chunk, an int in [2, 2**24] (default 4096, the ports' 64 x 64 tile); any
      size, a power of two wastes no index bit.
    average: ``"senders"`` (default, the authors' mean: each entry over the workers that sent
      it) or ``"workers"`` (each entry over all ``n``).

  Returns:
    A :class:`compressors.Compressor` named ``"chunk_topk"`` with an all-gather exchange; use it
    with error feedback (the method's default), which keeps ``x - decoded``.

  Raises:
    TypeError, ValueError: a setting outside what is allowed, naming it, its value and what is
      allowed.
  """
  density = checks.check_fraction(density, "density", "chunk_topk")
  chunk = _CHUNK_RULE.check(chunk, "chunk_topk: chunk")
  average = _AVERAGE_RULE.check(average, "chunk_topk: average")
  per_chunk(density, chunk)

  def encode(x, state, ctx):
    del ctx
    return encode_buffer(x, layout(x.size, chunk, density)), state

  return protocol.Compressor(
      name="chunk_topk", encode=encode,
      decode=lambda p, ctx: decode_buffer(p, ctx.size, layout(ctx.size, chunk, density)),
      decode_gathered=lambda p, ctx: decode_gathered(
          p, ctx.size, layout(ctx.size, chunk, density), ctx.num_workers),
      exchange="all_gather", average=average,
      sent_mask_of=lambda p, ctx: sent_mask(p, ctx.size, layout(ctx.size, chunk, density)))


@dataclasses.dataclass(frozen=True)
class ChunkTopkSettings:
  """``method="chunk_topk"`` (SparseLoCo's exchange, ``config.compression.chunk_topk``):
  ``chunk``, entries per chunk; ``density``, the fraction of each chunk sent
  (``k = round(density * chunk) >= 1``); ``average``, how the gathered sum becomes a mean
  (``senders``: each entry over the workers that sent it, the authors'; ``workers``: over all).
  Defaults: the ports' 4096 and 1/64 (``k = 64``), the authors' ``senders``."""
  chunk: int = checks.setting(DEFAULT_CHUNK, _CHUNK_RULE)
  density: float = checks.setting(DEFAULT_DENSITY, checks.FRACTION)
  average: str = checks.setting("senders", _AVERAGE_RULE)

  def __post_init__(self):
    checks.check_settings(self, "chunk_topk")
    per_chunk(self.density, self.chunk)


def _cost(s: ChunkTopkSettings, shapes, topology, schedule) -> topology_lib.Cost:
  del schedule  # all-gathered
  n, _, k, bits = layout(method_table.num_elements(shapes), s.chunk, s.density)
  return topology_lib.chunked_topk_allgather_cost(topology, n, k, bits, VALUE_BITS, LEVEL_BYTES)


METHODS = (method_table.Method(
    name="chunk_topk", summary="top-k per chunk of 4096, values in 2 bits with four levels per "
    "chunk, 12-bit chunk-local indices, all-gathered (SparseLoCo's transport, Sarfi et al. 2025)",
    settings=ChunkTopkSettings,
    compressor=lambda s: chunk_topk(s.density, chunk=s.chunk, average=s.average),
    budget="density", cost=_cost),)
