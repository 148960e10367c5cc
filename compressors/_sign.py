"""One-bit compressors: signSGD with majority vote, EF-signSGD and 1-bit SGD.

Every element travels as its sign, bit-packed 8 to a byte (:mod:`compressors.packing`; sign(0)
is +1), with at most two float32 magnitudes per buffer (per chunk in the two-phase exchange):

* :func:`signsgd` (Bernstein, Wang, Azizzadenesheli & Anandkumar 2018, "signSGD: compressed
  optimisation for non-convex problems"; ICLR 2019 "signSGD with majority vote is communication
  efficient and fault tolerant"): worker ``i`` sends ``sign(g_i)``; the result is the majority
  vote ``sign(sum_i sign(g_i))`` (a tie goes to +1). No magnitude travels, so use it with
  ``error_feedback=False``: the algorithm has none, and a residual ``g - sign(g)`` would pile up
  the unit-scale error of every step.
* :func:`efsignsgd` (Karimireddy, Rebjock, Stich & Jaggi 2019, "Error feedback fixes SignSGD and
  other gradient compression schemes"): ``C(a) = ||a||_1 / d * sign(a)`` with error feedback.
* :func:`onebit`: sign times a magnitude, with error feedback. ``scale="rms"`` is 1-bit Adam's
  compressor (Tang et al. 2021, DeepSpeed's ``compressed_allreduce``: ``||a||_2 / sqrt(d)``);
  ``scale="seide"`` is 1-bit SGD's (Seide, Fu, Droppo, Li & Yu 2014): elements with sign +1 are
  rebuilt as the mean of those elements, elements with sign -1 as the mean of theirs.

Sign payloads cannot be summed, so they travel by the two-phase compressed all-reduce (default;
``2 (n-1)/n`` of one packed buffer per worker, flat in ``n``) or by all-gather (``(n-1)``
packed buffers); see :func:`compressors.packing.non_summable_exchange`. With the two-phase
exchange the owner of each chunk re-encodes the mean it received by the same rule, keeping what
that loses in its own error-feedback memory (1-bit Adam's server error); for the majority vote
the owner's sign of the mean *is* the vote.
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

ONEBIT_SCALES = ("rms", "seide")


class SignPayload(NamedTuple):
  """Packed signs and the magnitudes that rebuild them.

  Attributes:
    signs: ``uint8[ceil(d / 8)]``, bit 1 for ``x >= 0``.
    magnitudes: ``f32[1]`` (one magnitude for both signs) or ``f32[2]`` (for sign -1, for
      sign +1); decode gives ``-magnitudes[0]`` where the bit is 0, ``magnitudes[-1]`` where 1.
  """
  signs: jax.Array
  magnitudes: jax.Array


def signsgd(*, exchange: str | None = None) -> protocol.Compressor:
  """signSGD with majority vote: the result is ``sign(sum_i sign(g_i))``, entries +1 or -1.

  Args:
    exchange: ``"two_phase"`` (the default, None) or ``"all_gather"``; both return the exact
      majority vote when error feedback is off.

  Returns:
    A :class:`compressors.Compressor`; use it with ``compress(..., error_feedback=False)``.
  """
  exchange = packing.non_summable_exchange(exchange, "signsgd")

  def encode(x, state, ctx):
    del ctx
    return packing.pack_signs(x), state

  def decode(signs, ctx):
    return packing.unpack_signs(signs, ctx.size)

  def vote_by_all_gather(x, state, ctx):
    signs, _ = encode(x, state, ctx)
    sent = decode(signs, ctx)
    if ctx.axis_name is None:
      return protocol.Aggregate(mean=sent, sent=sent, state=state)
    gathered = ctx.all_gather(signs)
    votes = protocol.sum_decoded(lambda s: decode(s, ctx), gathered, ctx.num_workers)
    return protocol.Aggregate(mean=jnp.where(votes >= 0, 1.0, -1.0).astype(sent.dtype), sent=sent,
                          state=state)

  # Two-phase: the owner re-encodes the mean of the signs it received, i.e. takes their vote.
  return protocol.Compressor(
      name="signsgd", encode=encode, decode=decode, exchange=exchange,
      aggregate=vote_by_all_gather if exchange == "all_gather" else None)


def efsignsgd(*, exchange: str | None = None) -> protocol.Compressor:
  """EF-signSGD's compressor ``||a||_1 / d * sign(a)`` (use it with error feedback, the default).

  Args:
    exchange: ``"two_phase"`` (the default, None) or ``"all_gather"``.

  Returns:
    A :class:`compressors.Compressor`.
  """
  def magnitudes(x):
    return jnp.mean(abs(x), keepdims=True)
  return _sign_compressor("efsignsgd", magnitudes,
                          packing.non_summable_exchange(exchange, "efsignsgd"))


def onebit(*, scale: str = "rms", exchange: str | None = None) -> protocol.Compressor:
  """1-bit SGD / 1-bit Adam's compressor: sign times a magnitude (use it with error feedback).

  Args:
    scale: ``"rms"``, one magnitude ``||a||_2 / sqrt(d)`` (1-bit Adam), or ``"seide"``, the mean
      of the elements of each sign (1-bit SGD; two magnitudes).
    exchange: ``"two_phase"`` (the default, None) or ``"all_gather"``.

  Returns:
    A :class:`compressors.Compressor`.
  """
  if scale not in ONEBIT_SCALES:
    raise ValueError(f"onebit: scale={scale!r}; allowed: {ONEBIT_SCALES}")

  def rms(x):
    return jnp.sqrt(jnp.mean(jnp.square(x), keepdims=True))

  def mean_of_each_sign(x):
    non_negative = x >= 0
    count_non_negative = jnp.sum(non_negative)
    sum_non_negative = jnp.sum(jnp.where(non_negative, x, 0))
    sum_negative = jnp.sum(jnp.where(non_negative, 0, -x))
    return jnp.stack([sum_negative / jnp.maximum(x.size - count_non_negative, 1),
                      sum_non_negative / jnp.maximum(count_non_negative, 1)]).astype(x.dtype)

  return _sign_compressor("onebit", rms if scale == "rms" else mean_of_each_sign,
                          packing.non_summable_exchange(exchange, "onebit"))


def _sign_compressor(name, magnitudes, exchange) -> protocol.Compressor:
  """Signs plus ``magnitudes(x)`` (``f32[1]`` or ``f32[2]``) through a non-summable exchange."""
  def encode(x, state, ctx):
    del ctx
    return SignPayload(signs=packing.pack_signs(x), magnitudes=magnitudes(x)), state

  def decode(payload, ctx):
    positive = packing.unpack(payload.signs, 1, ctx.size).astype(bool)
    return jnp.where(positive, payload.magnitudes[-1], -payload.magnitudes[0])

  return protocol.Compressor(name=name, encode=encode, decode=decode, exchange=exchange)


# The exchanges of packed signs, which cannot be summed (None: two-phase).
_EXCHANGE = checks.Rule(str, choices=packing.NON_SUMMABLE_EXCHANGES, optional=True)


@dataclasses.dataclass(frozen=True)
class SignSettings:
  """``method="signsgd"`` / ``"efsignsgd"``: the exchange of the packed signs (None: two-phase)."""
  exchange: str = checks.setting("two_phase", _EXCHANGE)

  def __post_init__(self):
    checks.check_settings(self, "SignSettings")


@dataclasses.dataclass(frozen=True)
class OnebitSettings:
  """``method="onebit"``: the magnitude rule (:func:`onebit`) and the exchange."""
  scale: str = checks.setting("rms", checks.Rule(str, choices=ONEBIT_SCALES))
  exchange: str = checks.setting("two_phase", _EXCHANGE)

  def __post_init__(self):
    checks.check_settings(self, "onebit")


def _sign_cost(scale_bytes: int):
  """The cost entry of packed signs with ``scale_bytes`` of magnitudes per buffer (chunk)."""
  def cost(s, shapes, topology, schedule) -> topology_lib.Cost:
    del schedule
    n = method_table.num_elements(shapes)
    if s.exchange == "all_gather":
      return topology_lib.all_gather_cost(topology, -(-n // 8) + scale_bytes)
    return topology_lib.onebit_cost(topology, n, scale_bytes=scale_bytes)
  return cost


METHODS = (
    method_table.Method(
        name="signsgd", summary="signs with majority vote (Bernstein et al. 2018)",
        settings=SignSettings, error_feedback=False,
        compressor=lambda s: signsgd(exchange=s.exchange), cost=_sign_cost(0)),
    method_table.Method(
        name="efsignsgd", summary="scaled signs with error feedback (Karimireddy et al. 2019)",
        settings=SignSettings, compressor=lambda s: efsignsgd(exchange=s.exchange),
        cost=_sign_cost(4)),
    method_table.Method(
        name="onebit", summary="1-bit SGD / 1-bit Adam's compressor with error feedback (Seide "
        "et al. 2014; Tang et al. 2021)", settings=OnebitSettings,
        compressor=lambda s: onebit(scale=s.scale, exchange=s.exchange),
        cost=lambda s, shapes, topology, schedule: _sign_cost(4 if s.scale == "rms" else 8)(
            s, shapes, topology, schedule)),
)
