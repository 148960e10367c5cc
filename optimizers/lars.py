"""LARS: layer-wise adaptive rate scaling (You, Gitman & Ginsburg 2017), paper and optax forms."""

import optax

from optimizers import _validation
from optimizers import exclusions
from optimizers.trust_ratio import scale_by_layerwise_trust_ratio

DENOMINATORS = ("paper", "optax")


def lars(
    learning_rate: optax.ScalarOrSchedule,
    momentum: float = 0.9,
    weight_decay: float = 1e-4,
    trust_coefficient: float = 0.001,
    eps: float = 0.0,
    denominator: str = "paper",
    nesterov: bool = False,
    exclude: exclusions.Exclude = exclusions.default_exclude,
    shard_axis: str | tuple[str, ...] | None = None,
) -> optax.GradientTransformationExtraArgs:
  """The LARS optimizer (You, Gitman & Ginsburg 2017, "Large Batch Training of Convolutional
  Networks"; the MLPerf ResNet-50 form).

  For every leaf (layer) ``w`` with gradient ``g``, at step ``t``::

    local_lr = eta * ||w|| / (||g|| + wd * ||w|| + eps)      denominator="paper"
    local_lr = eta * ||w|| / (||g + wd * w|| + eps)          denominator="optax"
    local_lr = 1                                             where ||w|| == 0 or the
                                                             denominator's gradient norm is 0
    v <- momentum * v + lr_t * local_lr * (g + wd * w)
    w <- w - v                        (nesterov: w <- w - (momentum * v + lr_t * local_lr * ...))

  Excluded leaves (see ``exclude``) get ``v <- momentum * v + lr_t * g``: no decay and no
  trust ratio, as MLPerf's ``skip_list=["batch_normalization", "bias"]`` does.

  Built from optax primitives as ``chain(masked(trust ratio with decay),
  scale_by_learning_rate, trace)``; the learning rate enters before the momentum, as in the
  paper's Algorithm 1 and MLPerf (so a schedule changes the step of new gradients only).

  Defaults and sources: ``trust_coefficient`` (``eta``) 0.001 and ``momentum`` 0.9 are the
  paper's; ``weight_decay=1e-4`` and ``eps=0`` are the defaults of MLPerf's ``LARSOptimizer``
  (mlcommons/training ``image_classification/tensorflow2/lars_optimizer.py``; note that
  that file replaces ``epsilon=0`` by Keras's 1e-7). Use :mod:`optimizers.schedules` for
  MLPerf's warmup + polynomial(2) learning rate.

  Differences from ``optax.lars``: optax's denominator is ``||g + wd * w||`` (reproduced by
  ``denominator="optax"``), its ``weight_decay`` defaults to 0 and it excludes nothing unless
  given masks; with ``denominator="optax"`` and ``exclude=None`` the two are the same
  computation.

  On shards (``shard_axis``, e.g. an island's devices, :mod:`compressors.parallel.fsdp`) every
  leaf is one device's piece of a layer: the momentum is elementwise and stays per shard, and
  the norms are the whole layer's, their sums of squares summed over the axis. An ``exclude``
  predicate is then called on the shards; where a layer's shard has fewer dimensions than the
  layer (a flattened, padded one), decide on the whole layers and pass the answers as a mask
  pytree (:func:`optimizers.exclusions.excluded`).

  Args:
    learning_rate: a non-negative float or an optax schedule of the step count.
    momentum: heavy-ball momentum, in [0, 1).
    weight_decay: L2 coefficient ``wd`` (>= 0), added to the gradient of included leaves.
    trust_coefficient: ``eta`` (> 0).
    eps: added to the trust ratio's denominator (>= 0).
    denominator: ``"paper"`` for ``||g|| + wd * ||w||`` or ``"optax"`` for ``||g + wd * w||``.
    nesterov: use Nesterov momentum.
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
  caller = "lars"
  _validation.check_learning_rate(learning_rate, caller)
  momentum = _validation.check_unit_interval(momentum, "momentum", caller)
  weight_decay = _validation.check_non_negative(weight_decay, "weight_decay", caller)
  trust_coefficient = _validation.check_positive(trust_coefficient, "trust_coefficient", caller)
  eps = _validation.check_non_negative(eps, "eps", caller)
  denominator = _validation.check_choice(denominator, "denominator", DENOMINATORS, caller)
  nesterov = _validation.check_bool(nesterov, "nesterov", caller)
  shard_axis = _validation.check_axis_name(shard_axis, "shard_axis", caller)

  if denominator == "paper":
    layer_adaptation = scale_by_layerwise_trust_ratio(
        trust_coefficient=trust_coefficient, eps=eps, weight_decay=weight_decay,
        shard_axis=shard_axis)
  else:
    trust_ratio = (optax.scale_by_trust_ratio(trust_coefficient=trust_coefficient, eps=eps)
                   if shard_axis is None else  # optax's own, bit for bit
                   scale_by_layerwise_trust_ratio(trust_coefficient=trust_coefficient, eps=eps,
                                                  shard_axis=shard_axis))
    layer_adaptation = optax.chain(optax.add_decayed_weights(weight_decay), trust_ratio)
  return optax.chain(
      exclusions.masked(layer_adaptation, exclude),
      optax.scale_by_learning_rate(learning_rate),
      optax.trace(decay=momentum, nesterov=nesterov),
  )
