"""int8 and int4 transport: uniform symmetric quantisation, one float32 scale per bucket.

Low-communication training sends its pseudo-gradients in few bits: OpenDiLoCo (Jaghouar, Ong &
Hagemann 2024, arXiv 2407.07852) all-reduces them in fp16, INTELLECT-1 (Jaghouar et al. 2024,
arXiv 2412.01152) in int8 (non-uniform bins) through its own all-reduce that decodes, sums in
float32 and re-quantizes, and Streaming DiLoCo (Douillard et al. 2025, arXiv 2501.18512) sends
4-bit outer gradients (4-bit floats there). These compressors are the uniform integer version,
for any gradient or pseudo-gradient, with error feedback keeping what the rounding loses.

The buffer is cut into buckets of ``bucket`` elements (the last one shorter; a buffer shorter
than a bucket is one bucket). With ``L = 2**(bits - 1) - 1`` (127 for int8, 7 for int4) and a
bucket ``v``::

  scale = max_i |v_i|,   code_i = clip(round(v_i * (L / scale)), -L, L),
  decoded_i = code_i * (scale * (1 / L))

(``1 / L`` rounded to float32: XLA compiles a division by the constant ``L`` into that product
anyway, so it is written out and a replay of the formula gives the module's bits).
``round`` is to the nearest integer, ties to even (deterministic; error feedback keeps the
rounding error), or, with ``rounding="stochastic"``, ``floor(r + u)`` with ``u`` uniform from the
worker's private key (unbiased; the keys come from the run's shared seed). A bucket of zeros has
scale 0 and sends zero codes; a non-finite entry makes its bucket's scale, hence its decoded
values, non-finite, so the step's non-finite check sees it.

On the wire: int8 codes travel as ``int8``; int4 codes, offset by 7 to ``0..14``, are packed two
to a byte (``uint8``, :mod:`compressors._packing`); each bucket adds its scale as a float32.
Float32 scales cost 4 bytes per 128 codes (3.1% of int8's bytes, 6.25% of int4's) and keep
every bucket's range: a float16 scale would flush buckets whose largest entry is below 6e-8 to
zero and overflow above 65504. The default bucket, 128 elements, is the group DeepSeek-V3 scales
its 8-bit activations by (1 x 128 tiles; DeepSeek-AI 2024, arXiv 2412.19437): small enough that
one outlier coarsens only 127 neighbours, large enough that the scales stay a few percent.

Scales differ between workers, so codes cannot be summed by an all-reduce: by default they
travel by the two-phase exchange (:mod:`compressors.protocol`: an all-to-all of chunks, each
chunk's owner decodes every worker's chunk, sums in float32, re-quantizes the mean with its own
error-feedback memory, and all-gathers it, so every worker ends with the same bits), bucketed
within each chunk. One worker then sends ``2 (n-1)`` chunk payloads of ``ceil(c bits / 8) +
4 ceil(c / bucket)`` bytes, ``c = ceil(d / n)``: about ``bits / 32`` of float32's all-reduce, plus
the scales. ``exchange="all_gather"`` gathers every worker's whole payload instead (``n - 1``
payloads, growing with ``n``).
"""

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from compressors import checks
from compressors import protocol
from compressors import _packing as packing
from compressors import method_table
from compressors.network import topology as topology_lib

BITS = (8, 4)
ROUNDINGS = ("nearest", "stochastic")
DEFAULT_BUCKET = 128
SCALE_BYTES = 4  # a float32 scale per bucket


class QuantizedPayload(NamedTuple):
  """Codes and the scale of each bucket.

  Attributes:
    codes: ``int8[d]`` (int8) or ``uint8[ceil(d / 2)]``, two codes offset by 7 a byte (int4).
    scales: ``f32[ceil(d / bucket)]``, each bucket's largest magnitude.
  """
  codes: jax.Array
  scales: jax.Array


def levels(bits: int) -> int:
  """``L``: codes lie in ``[-L, L]`` (127 for 8 bits, 7 for 4), symmetric around 0."""
  return 2 ** (bits - 1) - 1


def buckets(size: int, bucket: int) -> tuple[int, int]:
  """``(count, length)`` of the buckets of a buffer of ``size`` elements (the last padded)."""
  length = min(bucket, size)
  return -(-size // length), length


def payload_bytes(size: int, bits: int, bucket: int) -> int:
  """Bytes of the payload of ``size`` elements: the codes plus a float32 scale per bucket."""
  return -(-size * bits // 8) + SCALE_BYTES * buckets(size, bucket)[0]


def _checked(bucket, rounding, exchange, caller: str) -> str:
  """Raises a clear error for a setting outside what is allowed; returns the exchange's name."""
  checks.check_int(bucket, "bucket", 1, caller)
  checks.check_choice(rounding, "rounding", ROUNDINGS, caller)
  return packing.non_summable_exchange(exchange, caller)


def quantize(bits: int = 8, *, bucket: int = DEFAULT_BUCKET, rounding: str = "nearest",
             exchange: str | None = None) -> protocol.Compressor:
  """int8 or int4 transport (INTELLECT-1's int8 pseudo-gradients, Jaghouar et al. 2024; Streaming
  DiLoCo's 4-bit outer gradients, Douillard et al. 2025): see the module docstring.

  Args:
    bits: 8 (codes in ``[-127, 127]``, ``int8`` on the wire) or 4 (``[-7, 7]``, two a byte).
    bucket: elements per float32 scale (>= 1; default 128).
    rounding: ``"nearest"`` (ties to even; deterministic) or ``"stochastic"`` (unbiased, from
      the worker's private key).
    exchange: ``"two_phase"`` (the default, None) or ``"all_gather"``.

  Returns:
    A :class:`compressors.Compressor` named ``"int8"`` or ``"int4"``; use it with error
    feedback (the default of methods ``"int8"`` and ``"int4"``).
  """
  checks.check_choice(bits, "bits", BITS, "quantize")
  exchange = _checked(bucket, rounding, exchange, "quantize")
  top = levels(bits)
  inverse = np.float32(1 / top)

  def encode(x, state, ctx):
    count, length = buckets(x.size, bucket)
    v = jnp.pad(x, (0, count * length - x.size)).reshape(count, length)
    scales = jnp.max(jnp.abs(v), axis=1)
    ratio = v * (top / jnp.where(scales > 0, scales, 1))[:, None]
    if rounding == "stochastic":
      rounded = jnp.floor(ratio + jax.random.uniform(ctx.private_key, v.shape, v.dtype))
    else:
      rounded = jnp.round(ratio)
    # The largest magnitude maps to L; the clip only catches L / scale rounded up.
    codes = jnp.clip(rounded, -top, top).reshape(-1)[:x.size].astype(jnp.int8)
    if bits == 4:
      codes = packing.pack(codes + top, 4)
    return QuantizedPayload(codes=codes, scales=scales), state

  def decode(payload, ctx):
    count, length = buckets(ctx.size, bucket)
    codes = payload.codes
    if bits == 4:
      codes = packing.unpack(codes, 4, ctx.size).astype(jnp.int8) - top
    codes = jnp.pad(codes.astype(payload.scales.dtype), (0, count * length - ctx.size))
    values = codes.reshape(count, length) * (payload.scales * inverse)[:, None]
    return values.reshape(-1)[:ctx.size]

  return protocol.Compressor(name=f"int{bits}", encode=encode, decode=decode, exchange=exchange)


@dataclasses.dataclass(frozen=True)
class QuantizeSettings:
  """``method="int8"`` / ``"int4"``: see :func:`quantize`; refused when constructed if a field
  is outside what it allows."""
  bucket: int = DEFAULT_BUCKET
  rounding: str = "nearest"
  exchange: str = "two_phase"

  def __post_init__(self):
    _checked(self.bucket, self.rounding, self.exchange, "QuantizeSettings")


def _cost(bits: int):
  """The cost entry of ``bits``-bit codes plus a float32 scale per bucket (buckets are cut
  within each chunk of the two-phase exchange, whose owners decode ``4 * chunk`` bytes)."""
  def cost(s: QuantizeSettings, shapes, topology, schedule) -> topology_lib.Cost:
    del schedule
    n = method_table.num_elements(shapes)
    if s.exchange == "all_gather":
      return topology_lib.all_gather_cost(topology, payload_bytes(n, bits, s.bucket))
    chunk = -(-n // topology.num_devices)
    return topology_lib.two_phase_cost(topology, payload_bytes(chunk, bits, s.bucket), 4 * chunk)
  return cost


METHODS = tuple(
    method_table.Method(
        name=f"int{bits}", summary=f"int{bits} codes with a float32 scale per bucket, two-phase "
        f"exchange, error feedback ({paper})", settings=QuantizeSettings,
        compressor=lambda s, bits=bits: quantize(bits, bucket=s.bucket, rounding=s.rounding,
                                                 exchange=s.exchange),
        error_feedback=True, budget=None, cost=_cost(bits))
    for bits, paper in ((8, "INTELLECT-1, Jaghouar et al. 2024"),
                        (4, "Streaming DiLoCo's 4-bit outer gradients, Douillard et al. 2025")))
