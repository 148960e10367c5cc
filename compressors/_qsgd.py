"""QSGD: unbiased stochastic quantisation (Alistarh, Grubic, Li, Tomioka & Vojnovic, NeurIPS 2017).

The buffer is cut into buckets of ``bucket_size`` elements; each bucket ``v`` is sent as one
float32 scale ``||v||`` (the l2 norm, as in the paper, or the max norm) and one integer code per
element. With ``s = levels``::

  r_i = s |v_i| / ||v||,   l_i = floor(r_i),   level_i = l_i + Bernoulli(r_i - l_i)
  Q(v)_i = ||v|| sign(v_i) level_i / s

so ``E[Q(v)] = v``, and with the l2 norm ``E||Q(v) - v||^2 <= min(d / s^2, sqrt(d) / s) ||v||^2``
(``d`` the bucket size; Lemma 3.1). The Bernoulli draws compare uniforms from this worker's
private key with ``r_i - l_i``.

Codes on the wire: the signed level ``sign(v_i) level_i`` takes ``2 s + 1`` values. When they
fit in 4 bits (``s <= 7``) they are offset by ``s`` and packed, 2 or 4 bits a code
(:mod:`compressors.packing`: ``s = 1`` is 2 bits, ``s <= 7`` is 4 bits); otherwise they travel as
``int8`` (``s <= 127``) or ``int16`` (``s <= 32767``, the largest ``levels`` allowed). Scales differ
across workers, so payloads are not summable: two-phase compressed all-reduce by default (see
:func:`compressors.packing.non_summable_exchange`).
"""

import dataclasses
import math
import numbers
from typing import NamedTuple

import jax
import jax.numpy as jnp

from compressors import checks
from compressors import protocol
from compressors import _packing as packing
from compressors import method_table
from compressors.network import topology as topology_lib

NORMS = ("l2", "max")
# Codes fit int16, and the float32 ratio s |v_i| / ||v|| < 2**15 keeps 9 bits of fraction for the
# Bernoulli draw.
MAX_LEVELS = 2**15 - 1


class QSGDPayload(NamedTuple):
  """Codes and per-bucket scales.

  Attributes:
    codes: packed ``uint8`` (levels <= 7) or ``int8``/``int16`` signed levels.
    scales: ``f32[num_buckets]``, the norm of each bucket.
  """
  codes: jax.Array
  scales: jax.Array


def code_width(levels: int) -> int:
  """Bits a signed QSGD code with ``levels`` levels occupies on the wire (2, 4, 8 or 16)."""
  bits = math.ceil(math.log2(2 * levels + 1))
  return packing.slot_width(bits) if bits <= 8 else 16


def qsgd(levels: int, *, norm: str = "l2", bucket_size: int | None = 512,
         exchange: str | None = None) -> protocol.Compressor:
  """QSGD with ``levels`` quantisation levels per sign.

  Args:
    levels: ``s >= 1``; magnitudes are rounded to ``{0, 1/s, ..., 1}`` of the bucket's norm.
    norm: ``"l2"`` (the paper's, with its variance bound) or ``"max"`` (lower variance in
      practice; every level is used).
    bucket_size: elements per bucket (one float scale each); None makes the whole buffer one
      bucket. The paper's experiments use 512.
    exchange: ``"two_phase"`` (the default, None) or ``"all_gather"``.

  Returns:
    A :class:`compressors.Compressor`.
  """
  if isinstance(levels, bool) or not isinstance(levels, numbers.Integral):
    raise TypeError(f"qsgd: levels must be an int >= 1, got {levels!r}")
  if not 1 <= levels <= MAX_LEVELS:
    raise ValueError(f"qsgd: levels={levels} is outside [1, {MAX_LEVELS}]; it is the number s "
                     "of non-zero magnitudes per sign (s=1 is ternary)")
  if norm not in NORMS:
    raise ValueError(f"qsgd: norm={norm!r}; allowed: {NORMS}")
  if bucket_size is not None and (isinstance(bucket_size, bool) or
                                  not isinstance(bucket_size, numbers.Integral) or
                                  bucket_size < 1):
    raise ValueError(f"qsgd: bucket_size={bucket_size!r}; allowed: an int >= 1 or None (one "
                     "bucket per buffer)")
  exchange = packing.non_summable_exchange(exchange, "qsgd")
  levels = int(levels)
  width = code_width(levels)
  packed = width in packing.PACKED_WIDTHS
  code_dtype = {8: jnp.int8, 16: jnp.int16}.get(width)

  def buckets(size):
    length = size if bucket_size is None else min(bucket_size, size)
    return -(-size // length), length

  def encode(x, state, ctx):
    count, length = buckets(x.size)
    uniforms = jax.random.uniform(ctx.private_key, x.shape, x.dtype)
    pad = count * length - x.size
    v = jnp.pad(x, (0, pad)).reshape(count, length)
    u = jnp.pad(uniforms, (0, pad)).reshape(count, length)
    scales = (jnp.linalg.norm(v, axis=1) if norm == "l2" else jnp.max(abs(v), axis=1))
    safe = jnp.where(scales > 0, scales, 1)[:, None]
    ratio = levels * abs(v) / safe
    floor = jnp.floor(ratio)
    level = jnp.minimum(floor + (u < ratio - floor), levels)
    signed = (jnp.sign(v) * level).reshape(-1)[:x.size].astype(jnp.int32)
    if packed:
      codes = packing.pack(signed + levels, width)
    else:
      codes = signed.astype(code_dtype)
    return QSGDPayload(codes=codes, scales=scales), state

  def decode(payload, ctx):
    count, length = buckets(ctx.size)
    if packed:
      signed = packing.unpack(payload.codes, width, ctx.size).astype(jnp.int32) - levels
    else:
      signed = payload.codes
    signed = jnp.pad(signed, (0, count * length - ctx.size)).reshape(count, length)
    values = signed.astype(payload.scales.dtype) * (payload.scales[:, None] / levels)
    return values.reshape(-1)[:ctx.size]

  return protocol.Compressor(name="qsgd", encode=encode, decode=decode, exchange=exchange)


@dataclasses.dataclass(frozen=True)
class QSGDSettings:
  """``method="qsgd"``: see :func:`qsgd` (``bucket_size`` None: one bucket per buffer)."""
  levels: int = checks.setting(16, checks.Rule(int, low=1, high=MAX_LEVELS))
  norm: str = checks.setting("l2", checks.Rule(str, choices=NORMS))
  bucket_size: int | None = checks.setting(512, checks.Rule(int, low=1, optional=True))
  exchange: str = checks.setting("two_phase", checks.Rule(
      str, choices=packing.NON_SUMMABLE_EXCHANGES, optional=True))

  def __post_init__(self):
    checks.check_settings(self, "qsgd")


def _cost(s: QSGDSettings, shapes, topology, schedule) -> topology_lib.Cost:
  """Codes of ``code_width`` bits and one float32 scale per bucket, through the exchange."""
  del schedule
  n, width = method_table.num_elements(shapes), code_width(s.levels)
  if s.exchange == "all_gather":
    buckets = -(-n // (s.bucket_size or n))
    return topology_lib.all_gather_cost(topology, -(-n * width // 8) + 4 * buckets)
  chunk = -(-n // topology.num_devices)
  buckets = -(-chunk // min(s.bucket_size or chunk, chunk))
  return topology_lib.two_phase_cost(topology, -(-chunk * width // 8) + 4 * buckets, 4 * chunk)


METHODS = (method_table.Method(
    name="qsgd", summary="unbiased stochastic quantisation to s levels per bucket norm "
    "(Alistarh et al. 2017)", settings=QSGDSettings, error_feedback=False,
    compressor=lambda s: qsgd(s.levels, norm=s.norm, bucket_size=s.bucket_size,
                              exchange=s.exchange),
    cost=_cost),)
