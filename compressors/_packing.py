"""Sub-byte codes packed into ``uint8``: 8 signs, 4 two-bit or 2 four-bit codes per byte, and
codes of any width up to 32 bits as one bit stream (:func:`pack_wide`: 12-bit chunk indices).

XLA has no sub-byte array type that travels on every backend, so codes narrower than a byte are
packed before a collective and unpacked after it. Code ``j`` of a group of ``8 // bits`` sits at
bits ``j * bits .. (j + 1) * bits - 1`` of its byte (little-endian within the byte, as
``numpy.packbits(..., bitorder="little")`` does for one-bit codes). Packed bytes cannot be summed
(a carry would spill into the neighbouring code), so packed payloads travel by all-to-all and
all-gather (:mod:`compressors.protocol`'s ``"two_phase"`` and ``"all_gather"`` exchanges).
"""

import jax
import jax.numpy as jnp

PACKED_WIDTHS = (1, 2, 4)


def slot_width(bits: int) -> int:
  """The narrowest packable width (1, 2, 4 or 8 bits) that holds ``bits``-bit codes.

  Widths that do not divide 8 (3, 5, 6, 7) would make codes straddle bytes; they are rounded up.
  """
  for width in (*PACKED_WIDTHS, 8):
    if bits <= width:
      return width
  raise ValueError(f"packing: bits={bits} does not fit in one byte; allowed: 1..8")


def packed_size(size: int, bits: int) -> int:
  """Bytes holding ``size`` codes of ``bits`` (1, 2 or 4) bits each."""
  _check_width(bits)
  return -(-size * bits // 8)


def pack(codes: jax.Array, bits: int) -> jax.Array:
  """Packs unsigned codes ``0 <= codes < 2**bits`` of a 1-D array into ``uint8``.

  Args:
    codes: a 1-D integer (or boolean) array; values must fit in ``bits`` bits (not checked:
      higher bits would corrupt the neighbouring code).
    bits: 1, 2 or 4.

  Returns:
    ``uint8[packed_size(codes.size, bits)]``; the tail of the last byte is zero.
  """
  _check_width(bits)
  per_byte = 8 // bits
  codes = codes.astype(jnp.uint8)
  codes = jnp.pad(codes, (0, -codes.size % per_byte)).reshape(-1, per_byte)
  shifts = jnp.arange(0, 8, bits, dtype=jnp.uint8)
  # The shifted codes occupy disjoint bits, so their sum is their bitwise or.
  return jnp.sum(codes << shifts, axis=1, dtype=jnp.uint8)


def unpack(packed: jax.Array, bits: int, size: int) -> jax.Array:
  """Inverse of :func:`pack`: the first ``size`` codes of ``packed`` as ``uint8[size]``."""
  _check_width(bits)
  shifts = jnp.arange(0, 8, bits, dtype=jnp.uint8)
  mask = jnp.uint8(2**bits - 1)
  return ((packed[:, None] >> shifts) & mask).reshape(-1)[:size]


def wide_packed_size(size: int, bits: int) -> int:
  """Bytes holding ``size`` codes of ``bits`` bits each as one bit stream (:func:`pack_wide`)."""
  _check_wide(bits)
  return -(-size * bits // 8)


def pack_wide(codes: jax.Array, bits: int) -> jax.Array:
  """Packs unsigned codes ``0 <= codes < 2**bits`` of any width from 1 to 32 bits into one bit
  stream of ``uint8``, with no padding between codes: two 12-bit indices in 3 bytes.

  Code ``i`` occupies bits ``i * bits .. (i + 1) * bits - 1`` of the stream, its least significant
  bit first, and bit ``j`` of the stream is bit ``j % 8`` of byte ``j // 8`` (as :func:`pack` lays
  out one-bit codes, which it reuses). Widths 1, 2 and 4 give :func:`pack`'s bytes.

  Args:
    codes: a 1-D integer array; values must fit in ``bits`` bits (not checked: higher bits are
      dropped).
    bits: 1 to 32.

  Returns:
    ``uint8[wide_packed_size(codes.size, bits)]``; the tail of the last byte is zero.
  """
  _check_wide(bits)
  # One bit plane per code bit: [size, bits] of 0/1, then one-bit packing of the flat stream.
  planes = (codes.astype(jnp.uint32)[:, None] >> jnp.arange(bits, dtype=jnp.uint32)) & 1
  return pack(planes.reshape(-1), 1)


def unpack_wide(packed: jax.Array, bits: int, size: int) -> jax.Array:
  """Inverse of :func:`pack_wide`: the first ``size`` codes of ``packed`` as ``uint32[size]``."""
  _check_wide(bits)
  planes = unpack(packed, 1, size * bits).reshape(size, bits).astype(jnp.uint32)
  # The planes hold disjoint bits, so their sum is their bitwise or.
  return jnp.sum(planes << jnp.arange(bits, dtype=jnp.uint32), axis=1, dtype=jnp.uint32)


def pack_signs(x: jax.Array) -> jax.Array:
  """One bit per element of ``x``: 1 where ``x >= 0`` (so sign(0) is +1), 0 where negative."""
  return pack(x >= 0, 1)


def unpack_signs(packed: jax.Array, size: int) -> jax.Array:
  """The ``f32[size]`` signs (+1 or -1) packed by :func:`pack_signs`."""
  return unpack(packed, 1, size).astype(jnp.float32) * 2 - 1


def _check_width(bits: int) -> None:
  if bits not in PACKED_WIDTHS:
    raise ValueError(f"packing: bits={bits!r}; allowed: {PACKED_WIDTHS} (codes of other widths "
                     "travel in whole bytes; see slot_width)")


def _check_wide(bits: int) -> None:
  if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 32:
    raise ValueError(f"packing: bits={bits!r}; allowed: an int in [1, 32] (pack_wide)")


NON_SUMMABLE_EXCHANGES = ("two_phase", "all_gather")


def non_summable_exchange(exchange: str | None, caller: str) -> str:
  """Resolves the exchange of a compressor whose payloads cannot be summed.

  With ``B`` the bytes of one worker's compressed buffer and ``n`` workers, one worker sends
  (:mod:`compressors.parallel.hlo_bytes`):

  * ``"two_phase"``: an all-to-all of ``n`` chunks, ``(n-1)/n B``, then an all-gather of the
    owner's re-encoded chunk, ``(n-1)/n B``: ``2 (n-1)/n B < 2 B`` whatever ``n``;
  * ``"all_gather"``: ``(n-1)/n`` of the ``n B`` gathered bytes, ``(n-1) B``, linear in ``n``.

  The two tie at ``n = 2`` and two-phase is cheaper for every ``n > 2``, so it is the default
  (None). All-gather remains on request: one round instead of two, and no second encoding at
  the owner (the mean is exactly the mean of what the workers sent).

  Args:
    exchange: ``"two_phase"``, ``"all_gather"`` or None (two-phase).
    caller: the compressor's name, for the error.

  Returns:
    The exchange's name.
  """
  if exchange is None:
    return "two_phase"
  if exchange not in NON_SUMMABLE_EXCHANGES:
    raise ValueError(f"{caller}: exchange={exchange!r}; allowed: None (two-phase), "
                     f"{', '.join(map(repr, NON_SUMMABLE_EXCHANGES))} (payloads that cannot be "
                     "summed are not all-reduced)")
  return exchange
