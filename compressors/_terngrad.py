"""TernGrad: stochastic ternary gradients (Wen, Xu, Yan, Wu, Wang, Chen & Li, NeurIPS 2017).

Each worker ``i`` sends ``s * sign(g_i) * b_i`` with ``b_i ~ Bernoulli(|g_i| / s)``, unbiased
(``E = g_i``). TernGrad's *scaler sharing* makes every worker use the same ``s``: the max over
workers of their ``max |g_i|`` (one ``lax.pmax`` of a scalar). The codes ``sign * b`` in
``{-1, 0, 1}`` then sum exactly in a small integer type, and the sum is all-reduced as is:

* ``exchange="psum"`` (default): codes in ``int8`` while ``n <= 127`` workers (``|sum| <= n``
  cannot overflow), ``int16`` up to 32767, ``int32`` beyond: ``2 (n-1)/n * d`` bytes per
  worker for 8-bit codes, 4x below a float32 all-reduce. The mean is exactly
  ``s * sum_i codes_i / n``, the mean of what the workers sent.
* ``exchange="two_phase"`` or ``"all_gather"``: codes packed 2 bits each (4 to a byte) with one
  float32 scale per buffer (per chunk). Packed bytes cannot be summed (a carry would spill into
  the next code), so they go through a non-summable exchange: two-phase moves ``2 (n-1)/n *
  d / 4`` bytes, a quarter of the int8 all-reduce, at the price of a second ternarisation at each
  chunk's owner (whose loss its error-feedback memory keeps). No scaler sharing is needed there:
  each chunk carries its own ``max |g|``.

The scale is per buffer: ``compress(..., fuse=False)`` gives the paper's per-layer scalers.
TernGrad's optional per-layer gradient clipping (to 2.5 standard deviations) is not included:
clip before the transformation when wanted.
"""

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from compressors import checks
from compressors import protocol
from compressors import _packing as packing
from compressors import method_table
from compressors.network import topology as topology_lib

EXCHANGES = ("psum", "two_phase", "all_gather")
CODE_BITS = 2


class TernPayload(NamedTuple):
  """Packed ternary codes and their scale (non-summable exchanges).

  Attributes:
    codes: ``uint8[ceil(d / 4)]``, ``code + 1`` in 2 bits each.
    scale: ``f32[1]``, ``max |x|`` of the buffer (chunk).
  """
  codes: jax.Array
  scale: jax.Array


def sum_dtype(num_workers: int) -> jnp.dtype:
  """The narrowest integer type holding any sum of ``num_workers`` codes in {-1, 0, 1}."""
  for dtype in (jnp.int8, jnp.int16):
    if num_workers <= jnp.iinfo(dtype).max:
      return jnp.dtype(dtype)
  return jnp.dtype(jnp.int32)


def terngrad(*, exchange: str = "psum") -> protocol.Compressor:
  """TernGrad.

  Args:
    exchange: ``"psum"`` (scaler sharing; int8 codes summed exactly; the default),
      ``"two_phase"`` or ``"all_gather"`` (2-bit packed codes, one scale per buffer or chunk).

  Returns:
    A :class:`compressors.Compressor`; unbiased, so error feedback is optional.
  """
  if exchange not in EXCHANGES:
    raise ValueError(f"terngrad: exchange={exchange!r}; allowed: {EXCHANGES}")

  def ternary(x, scale, key):
    """Codes ``sign(x) * Bernoulli(|x| / scale)`` in {-1, 0, 1} as int32."""
    uniforms = jax.random.uniform(key, x.shape, x.dtype)
    keep = uniforms < abs(x) / jnp.where(scale > 0, scale, 1)
    return jnp.where(keep, jnp.sign(x), 0).astype(jnp.int32)

  def encode_packed(x, state, ctx):
    scale = jnp.max(abs(x), keepdims=True)
    codes = ternary(x, scale[0], ctx.private_key)
    return TernPayload(codes=packing.pack(codes + 1, CODE_BITS), scale=scale), state

  def decode_packed(payload, ctx):
    codes = packing.unpack(payload.codes, CODE_BITS, ctx.size).astype(jnp.int32) - 1
    return codes.astype(payload.scale.dtype) * payload.scale[0]

  def aggregate_shared_scale(x, state, ctx):
    scale = jnp.max(abs(x))
    if ctx.axis_name is not None:
      scale = jax.lax.pmax(scale, ctx.axis_name)  # scaler sharing
    codes = ternary(x, scale, ctx.private_key).astype(sum_dtype(ctx.num_workers))
    # Codes are summed as they are; decoding is linear in them, with the shared scale.
    return protocol.Aggregate(
        mean=ctx.all_reduce(codes).astype(x.dtype) * scale / ctx.num_workers,
        sent=codes.astype(x.dtype) * scale, state=state)

  if exchange == "psum":
    return protocol.Compressor(name="terngrad", encode=None, decode=None, exchange="psum",
                               aggregate=aggregate_shared_scale)
  return protocol.Compressor(name="terngrad", encode=encode_packed, decode=decode_packed,
                             exchange=exchange)


@dataclasses.dataclass(frozen=True)
class TernGradSettings:
  """``method="terngrad"``: the exchange (``"psum"``: scaler sharing, summed codes)."""
  exchange: str = checks.setting("psum", checks.Rule(str, choices=EXCHANGES))

  def __post_init__(self):
    checks.check_settings(self, "terngrad")


def _cost(s: TernGradSettings, shapes, topology, schedule) -> topology_lib.Cost:
  n, p = method_table.num_elements(shapes), topology.num_devices
  if s.exchange == "psum":  # the shared scale's pmax, then the integer codes summed
    return topology_lib.total([
        topology_lib.all_reduce_cost(schedule, topology, 1),
        topology_lib.all_reduce_cost(schedule, topology, n, sum_dtype(p).itemsize)])
  if s.exchange == "all_gather":
    return topology_lib.all_gather_cost(topology, -(-n * CODE_BITS // 8) + 4)
  return topology_lib.onebit_cost(topology, n, bits=CODE_BITS)


METHODS = (method_table.Method(
    name="terngrad", summary="ternary codes with a shared scale, summed as integers (Wen et al. "
    "2017)", settings=TernGradSettings, error_feedback=False,
    compressor=lambda s: terngrad(exchange=s.exchange), cost=_cost),)
