"""Momentum correction: momentum applied per worker *before* sparsification, for any sparsifier.

Deep Gradient Compression (Lin et al., ICLR 2018, Sec. 3.2) observes that a sparsifier with error
feedback followed by momentum SGD is not momentum SGD with delays: a residual held back ``k``
steps arrives in one lump and the optimizer's momentum then applies that lump again and again,
``1 / (1 - m)`` times in all, on top of what it already applied to the parts sent earlier. Held-
back coordinates overshoot, and at high compression training diverges. The fix is to accumulate
the *velocity* locally and sparsify that:

  u <- m u + g                (per worker; the velocity)
  x =  u + e                  (error feedback adds what was not sent)
  send the sparsified x, keep e <- x - sent
  u <- 0 where something was sent       (momentum factor masking, Sec. 3.3)

and to follow the exchange with *plain* SGD (no second momentum): the update a coordinate
receives over time is then the sum of the velocities dense momentum SGD would have applied,
only later. Masking stops a sent coordinate's stale velocity from pushing it on while its fresh
gradients are being held back again.

:func:`momentum_correction` wraps any :func:`compressors.compress` (or
:func:`tasc.tasc_compress`) built with ``error_feedback=True`` and ``report_sent=True``: the
wrapped transformation reports which entries it sent (``CompressState.sent``), which is exact for
every compressor; a quantizer sends every entry, so its velocity would restart every step: use
the optimizer's own momentum with quantizers instead. DGC (:func:`compressors.dgc`) is this
wrapper around its sampled-threshold sparsifier.
"""

import math
import numbers
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import optax

from compressors.network import axes



class MomentumCorrectionState(NamedTuple):
  """State of :func:`momentum_correction`.

  Attributes:
    velocity: per-worker velocity ``u``, shaped like the gradients.
    inner: the wrapped compression's state (a :class:`compressors.CompressState`).
  """
  velocity: chex.ArrayTree
  inner: Any


def _sent(state: Any, where: str) -> chex.ArrayTree:
  """The wrapped compression's report of the entries it sent (``CompressState.sent``)."""
  absent = lambda field: isinstance(getattr(state, field, ()), tuple) and not getattr(
      state, field, ())
  if absent("sent") or absent("residual"):
    raise ValueError(
        f"momentum_correction: {where} is {type(state).__name__}, not the state of a "
        "compressors.compress / tasc.tasc_compress built with error_feedback=True and "
        "report_sent=True; momentum correction needs the residual and the report of which "
        "entries were sent")
  return state.sent


def momentum_correction(inner: optax.GradientTransformation, momentum: float = 0.9, *,
                        clip_norm: float | None = None, axis_name: axes.AxisName = None
                        ) -> optax.GradientTransformationExtraArgs:
  """DGC's momentum correction, factor masking and local clipping around a sparsifier.

  Use it as ``optax.chain(momentum_correction(compress(topk(0.001), axis_name="data",
  report_sent=True), 0.9), optax.sgd(lr))``: the optimizer after it must not add momentum again.

  Args:
    inner: a :func:`compressors.compress` or :func:`tasc.tasc_compress` transformation with
      error feedback on and ``report_sent=True`` (flat mode: not ``dense_axis``).
    momentum: ``m`` in [0, 1); 0 leaves ``inner`` unchanged.
    clip_norm: DGC's local gradient clipping (Sec. 3.4): each worker scales its gradient to a
      global norm of at most ``clip_norm / sqrt(N)`` (``N`` workers) before accumulating it, so
      that the sum over workers is clipped at ``clip_norm`` as in synchronous training; None:
      no clipping.
    axis_name: the workers' axis, for ``N``; required with ``clip_norm``.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose ``update`` runs per worker inside
    ``shard_map``/``pmap`` like ``inner``'s and forwards extra arguments (e.g. ``curvature``).
  """
  if isinstance(momentum, bool) or not isinstance(momentum, numbers.Real) or not 0 <= momentum < 1:
    raise ValueError(f"momentum_correction: momentum={momentum!r}; allowed: a number in [0, 1)")
  if clip_norm is not None and (isinstance(clip_norm, bool)
                                or not isinstance(clip_norm, numbers.Real) or not clip_norm > 0):
    raise ValueError(f"momentum_correction: clip_norm={clip_norm!r}; allowed: a number > 0, or "
                     "None")
  if clip_norm is not None and axis_name is None:
    raise ValueError(f"momentum_correction: clip_norm={clip_norm!r} needs axis_name (the "
                     "workers' axis, whose size N sets the local limit clip_norm / sqrt(N))")
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    inner_state = inner.init(params)
    _sent(inner_state, "the wrapped transformation's state")
    return MomentumCorrectionState(velocity=jax.tree.map(jnp.zeros_like, params),
                                   inner=inner_state)

  def update_fn(updates, state, params=None, **extra_args):
    if clip_norm is not None:
      updates = clip_locally(
          updates, clip_norm, axes.num_workers(axis_name, caller="momentum_correction"))
    velocity = jax.tree.map(lambda u, g: momentum * u + g, state.velocity, updates)
    mean, inner_state = inner.update(velocity, state.inner, params, **extra_args)
    sent = _sent(inner_state, "the wrapped transformation's new state")
    velocity = jax.tree.map(lambda u, was_sent: jnp.where(was_sent, jnp.zeros_like(u), u),
                            velocity, sent)
    return mean, MomentumCorrectionState(velocity=velocity, inner=inner_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def clip_locally(grads, clip_norm: float, num_workers: int):
  """DGC's local gradient clipping (Sec. 3.4): ``grads`` (an array or a pytree) scaled to a
  global norm of at most ``clip_norm / sqrt(num_workers)``, so that the sum over the workers is
  clipped at ``clip_norm`` as synchronous training would clip it."""
  limit = clip_norm / math.sqrt(num_workers)
  norm = optax.tree.norm(grads)
  return jax.tree.map(
      lambda g: g * jnp.minimum(1.0, limit / jnp.maximum(norm, jnp.finfo(g.dtype).tiny)), grads)
