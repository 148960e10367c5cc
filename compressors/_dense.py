"""Dense transports: no compression (the baseline), and 16-bit casts.

``cast`` halves the bytes by sending fp16 or bf16. Each worker divides by the number of
workers *before* the cast, so a sum of fp16 values cannot overflow where the individual
gradients do not (the fix PyTorch's fp16 compression hook had to make).

XLA's CPU backend widens bf16 all-reduces to f32 in the compiled program, so a bf16 ``psum``
moves as many bytes as f32 there. On CPU ``cast(bfloat16)`` therefore uses the two-phase
exchange with the bf16 payload bit-cast to ``uint16`` (all-to-all of chunks, sum at the owner in
f32, all-gather of the rounded mean): exactly half the bytes of the f32 all-reduce. fp16, and
bf16 on accelerators, are summed directly by ``psum``.
"""

import jax
import jax.numpy as jnp

from compressors import checks
from compressors import protocol
from compressors import method_table
from compressors.network import topology as topology_lib

_CASTS = {"float16": jnp.float16, "bfloat16": jnp.bfloat16}


def dense() -> protocol.Compressor:
  """No compression: a dense all-reduce of the f32 gradient (the baseline every ratio uses)."""
  return protocol.Compressor(
      name="dense",
      encode=lambda x, state, ctx: (x, state),
      decode=lambda payload, ctx: payload,
      exchange="psum")


def cast(dtype, *, exchange: str | None = None) -> protocol.Compressor:
  """Sends the gradient as fp16 or bf16 (divided by the number of workers first).

  Args:
    dtype: ``jnp.float16`` or ``jnp.bfloat16`` (or their names).
    exchange: ``"psum"`` or ``"two_phase"``; None picks ``"two_phase"`` for bf16 on the CPU
      backend (which widens bf16 all-reduces to f32) and ``"psum"`` otherwise.

  Returns:
    A :class:`compressors.Compressor`; with error feedback, the rounding error is kept.
  """
  name = checks.dtype_name(dtype) or repr(dtype)
  if name not in _CASTS:
    raise ValueError(f"cast: dtype={name} is not supported; allowed: {sorted(_CASTS)}")
  narrow = _CASTS[name]
  if exchange is None:
    exchange = "two_phase" if name == "bfloat16" and jax.default_backend() == "cpu" else "psum"
  if exchange not in ("psum", "two_phase"):
    raise ValueError(f"cast: exchange={exchange!r}; allowed: 'psum', 'two_phase' or None")
  # A payload that only travels (two-phase) goes as uint16 so no backend widens it.
  wire = jnp.uint16 if exchange == "two_phase" else narrow

  def encode(x, state, ctx):
    payload = (x / ctx.num_workers).astype(narrow)
    return jax.lax.bitcast_convert_type(payload, wire), state

  def decode(payload, ctx):
    values = jax.lax.bitcast_convert_type(payload, narrow).astype(jnp.float32)
    return values * ctx.num_workers

  return protocol.Compressor(name=f"cast_{name}", encode=encode, decode=decode, exchange=exchange)


METHODS = (
    method_table.Method(
        name="dense",
        summary="no compression: one float32 all-reduce of the gradient (the baseline)",
        settings=method_table.NoSettings, compressor=lambda s: dense(), error_feedback=False,
        cost=lambda s, shapes, topology, schedule: topology_lib.all_reduce_cost(
            schedule, topology, method_table.num_elements(shapes)), overlaps_backward=True),
    *(method_table.Method(
        name=name, summary=f"the gradient sent as {dtype}, divided by the workers first",
        settings=method_table.NoSettings, compressor=lambda s, dtype=dtype: cast(dtype),
        error_feedback=False, overlaps_backward=True,
        cost=lambda s, shapes, topology, schedule: topology_lib.all_reduce_cost(
            schedule, topology, method_table.num_elements(shapes), itemsize=2))
      for name, dtype in (("fp16", "float16"), ("bf16", "bfloat16"))),
)
