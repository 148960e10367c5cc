"""LAMB: layer-wise adaptive moments for large-batch training (You et al., ICLR 2020)."""

import jax
import jax.numpy as jnp
import optax

from optimizers import _validation
from optimizers import exclusions
from optimizers.trust_ratio import scale_by_layerwise_trust_ratio


def _scale_by_adam(b1: float, b2: float, eps: float,
                   bias_correction: bool) -> optax.GradientTransformation:
  """``optax.scale_by_adam``, or its update without bias correction (LAMB's option)."""
  adam = optax.scale_by_adam(b1=b1, b2=b2, eps=eps)
  if bias_correction:
    return adam

  def update_fn(updates, state, params=None):
    del params
    mu = optax.tree.update_moment(updates, state.mu, b1, 1)
    nu = optax.tree.update_moment_per_elem_norm(updates, state.nu, b2, 2)
    updates = jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + eps), mu, nu)
    return updates, optax.ScaleByAdamState(
        count=optax.safe_increment(state.count), mu=mu, nu=nu)

  return optax.GradientTransformation(adam.init, update_fn)


def lamb(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-6,
    weight_decay: float = 0.01,
    bias_correction: bool = True,
    trust_clip: tuple[float, float] | None = None,
    exclude: exclusions.Exclude = exclusions.default_exclude,
    shard_axis: str | tuple[str, ...] | None = None,
) -> optax.GradientTransformationExtraArgs:
  """The LAMB optimizer (You et al., ICLR 2020, Algorithm 2).

  Per step ``t`` with gradient ``g`` and, for every leaf (layer) ``x``::

    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g**2
    m_hat = m / (1 - b1**t);  v_hat = v / (1 - b2**t)     (only if bias_correction)
    r = m_hat / (sqrt(v_hat) + eps)
    x <- x - lr_t * phi(||x||) / ||r + wd * x|| * (r + wd * x)

  where ``phi`` clips to ``trust_clip=(gamma_l, gamma_u)`` (identity when None) and the ratio
  is 1 where ``||x||`` or ``||r + wd * x||`` is 0. Excluded leaves (see ``exclude``) get
  ``x <- x - lr_t * r``: neither decay nor trust ratio.

  Built as ``chain(scale_by_adam, masked(chain(add_decayed_weights, trust ratio)),
  scale_by_learning_rate)`` from optax primitives (the clipped ratio and the uncorrected
  moments are the only additions).

  Defaults: ``b1=0.9, b2=0.999, eps=1e-6, weight_decay=0.01`` are the paper's and BERT's
  (google-research/bert ``AdamWeightDecayOptimizer``/LAMB recipe); biases and normalisation
  parameters are excluded from decay and adaptation as in the BERT reference and TF-addons.

  Differences from ``optax.lamb``: optax defaults to ``weight_decay=0`` and has no trust
  clipping or bias-correction switch; its ``mask`` masks only the weight decay while the
  trust ratio still scales every leaf. With ``exclude=None``, ``trust_clip=None`` and
  ``bias_correction=True`` the two are the same computation.

  On shards (``shard_axis``, e.g. an island's devices, :mod:`compressors.parallel.fsdp`) every
  leaf is one device's piece of a layer: Adam's moments are elementwise and stay per shard, and
  the two norms are the whole layer's, their sums of squares summed over the axis, so that each
  device takes its piece of the step the whole layer would. An ``exclude`` predicate is then
  called on the shards; where a layer's shard has fewer dimensions than the layer (a flattened,
  padded one), decide on the whole layers and pass the answers as a mask pytree
  (:func:`optimizers.exclusions.excluded`).

  Args:
    learning_rate: a non-negative float or an optax schedule of the step count.
    b1: decay of the first moment, in [0, 1).
    b2: decay of the second moment, in [0, 1).
    eps: added to ``sqrt(v_hat)``; must be > 0 so that zero gradients cannot give 0/0.
    weight_decay: decoupled weight decay ``lambda`` (>= 0), added before the trust ratio.
    bias_correction: divide the moments by ``1 - b**t`` (Adam's bias correction).
    trust_clip: None, or ``(gamma_l, gamma_u)`` with ``0 <= gamma_l <= gamma_u``.
    exclude: which leaves skip decay and trust ratio: a predicate ``(path, leaf) -> bool``,
      a boolean pytree (True = excluded), or None/False for none. See
      :mod:`optimizers.exclusions`.
    shard_axis: None, or the mesh axis (inside ``shard_map``) over whose devices every leaf is
      split; padding in a shard must be zero (see
      :func:`optimizers.scale_by_layerwise_trust_ratio`).

  Returns:
    An :class:`optax.GradientTransformationExtraArgs`; ``update`` needs ``params``.

  Raises:
    ValueError: a hyper-parameter is outside its allowed range.
    TypeError: a hyper-parameter has the wrong type.
  """
  caller = "lamb"
  _validation.check_learning_rate(learning_rate, caller)
  b1 = _validation.check_unit_interval(b1, "b1", caller)
  b2 = _validation.check_unit_interval(b2, "b2", caller)
  eps = _validation.check_positive(eps, "eps", caller)
  weight_decay = _validation.check_non_negative(weight_decay, "weight_decay", caller)
  bias_correction = _validation.check_bool(bias_correction, "bias_correction", caller)
  trust_clip = _validation.check_trust_clip(trust_clip, caller)
  shard_axis = _validation.check_axis_name(shard_axis, "shard_axis", caller)

  if trust_clip is None and shard_axis is None:  # optax's own, bit for bit
    trust_ratio = optax.scale_by_trust_ratio()
  else:
    trust_ratio = scale_by_layerwise_trust_ratio(trust_clip=trust_clip, shard_axis=shard_axis)
  layer_adaptation = optax.chain(optax.add_decayed_weights(weight_decay), trust_ratio)
  return optax.chain(
      _scale_by_adam(b1, b2, eps, bias_correction),
      exclusions.masked(layer_adaptation, exclude),
      optax.scale_by_learning_rate(learning_rate),
  )
