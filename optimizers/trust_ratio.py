"""Layer-wise trust-ratio scaling in the forms optax's ``scale_by_trust_ratio`` lacks.

``optax.scale_by_trust_ratio`` computes ``c * ||w|| / (||u|| + eps)`` on whatever update ``u``
arrives, so it covers LAMB without trust clipping and optax's LARS. Three cases need more:

* LAMB's ``phi(||w||)`` with ``phi`` a clip to ``[gamma_l, gamma_u]`` (You et al., ICLR 2020,
  Algorithm 2);
* the LARS paper's denominator ``||g|| + wd * ||w||`` (You, Gitman & Ginsburg 2017, and
  MLPerf's ``LARSOptimizer``), which needs the gradient's norm before weight decay is added;
* leaves that are shards of the layers (``shard_axis``: each device of a mesh axis holds one
  piece of every layer, as an island's devices do, :mod:`compressors.parallel.fsdp`): a layer's
  norm is then the square root of its pieces' sums of squares summed over that axis.

:func:`scale_by_layerwise_trust_ratio` covers all three in one transformation.
"""

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import optax

from optimizers import _validation


def _leaf_norms(leaves: Sequence[jax.Array],
                shard_axis: str | tuple[str, ...] | None) -> list[jax.Array]:
  """Each leaf's norm; with ``shard_axis``, that of the whole layer whose shard it is on this
  device: the sums of squares of every leaf in one ``psum`` over the axis (one collective a
  step), in float32 at least."""
  if shard_axis is None:
    return [optax.safe_norm(x, 0.0) for x in leaves]
  if not leaves:
    return []
  squares = jnp.stack([jnp.sum(jnp.square(x.astype(jnp.promote_types(x.dtype, jnp.float32))))
                       for x in leaves])
  return list(jnp.sqrt(jax.lax.psum(squares, shard_axis)))


def scale_by_layerwise_trust_ratio(
    trust_coefficient: float = 1.0,
    eps: float = 0.0,
    trust_clip: tuple[float, float] | None = None,
    weight_decay: float = 0.0,
    shard_axis: str | tuple[str, ...] | None = None,
) -> optax.GradientTransformation:
  """Scales each leaf's (decayed) update by its trust ratio.

  For every leaf with parameter ``w`` and incoming update ``u``::

    ratio = trust_coefficient * phi(||w||) / (||u|| + weight_decay * ||w|| + eps)
    ratio = 1                     where ||w|| == 0 or ||u|| == 0
    out   = ratio * (u + weight_decay * w)

  with ``phi(z) = clip(z, lower, upper)`` when ``trust_clip=(lower, upper)`` and the identity
  otherwise. With ``weight_decay=0`` this is LAMB's ratio applied to ``u = r + lambda * w``;
  with ``u = g`` and ``weight_decay > 0`` it is the LARS paper's / MLPerf's local learning rate
  ``eta * ||w|| / (||g|| + wd * ||w|| + eps)`` times ``g + wd * w``. The zero-norm rule tests
  the unclipped ``||w||`` and ``||u||``, as TF-addons' LAMB and MLPerf's LARS do.

  Args:
    trust_coefficient: multiplier of the ratio (LARS's ``eta``; 1 for LAMB).
    eps: added to the denominator.
    trust_clip: ``(lower, upper)`` bounds of ``phi``, or None for the identity.
    weight_decay: decay added to the update after the norms are taken, and whose
      ``weight_decay * ||w||`` term enters the denominator.
    shard_axis: None (each leaf is a whole layer), or the mesh axis, inside ``shard_map``, over
      whose devices every leaf is split: each holds one shard of each layer, and the norms are
      the whole layers' (sums of squares summed over the axis). Entries of a shard that belong
      to no layer (padding) must be zero in both ``u`` and ``w``
      (:meth:`compressors.parallel.fsdp.ParamLayout.padding_zeroed` makes them so).

  Returns:
    A stateless :class:`optax.GradientTransformation` that needs ``params``.
  """
  caller = "scale_by_layerwise_trust_ratio"
  _validation.check_positive(trust_coefficient, "trust_coefficient", caller)
  _validation.check_non_negative(eps, "eps", caller)
  _validation.check_non_negative(weight_decay, "weight_decay", caller)
  trust_clip = _validation.check_trust_clip(trust_clip, caller)
  shard_axis = _validation.check_axis_name(shard_axis, "shard_axis", caller)

  def scale(update, param, update_norm, param_norm):
    numerator = param_norm if trust_clip is None else jnp.clip(param_norm, *trust_clip)
    ratio = trust_coefficient * numerator / (update_norm + weight_decay * param_norm + eps)
    zero_norm = jnp.logical_or(param_norm == 0.0, update_norm == 0.0)
    ratio = jnp.where(zero_norm, jnp.ones_like(ratio), ratio).astype(update.dtype)
    return ratio * (update + weight_decay * param)

  def update_fn(updates, state, params=None):
    if params is None:
      raise ValueError(f"{caller}: params is None; pass params to update() (the trust ratio "
                       "needs the parameters' norms).")
    update_leaves, treedef = jax.tree.flatten(updates)
    param_leaves = treedef.flatten_up_to(params)
    norms = _leaf_norms(update_leaves + param_leaves, shard_axis)
    update_norms, param_norms = norms[:len(update_leaves)], norms[len(update_leaves):]
    return treedef.unflatten(list(map(scale, update_leaves, param_leaves, update_norms,
                                      param_norms))), state

  return optax.GradientTransformation(optax.init_empty_state, update_fn)
