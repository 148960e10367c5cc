"""Method registry: ``config.method`` + config fields -> the optax chain a run trains with.

The chain is ``optax.chain(communication, [weight decay], optimizer)``, which the runner wraps in
``compressors.skip_nonfinite`` (:func:`training_chain`). The communication
transformation runs per worker inside ``shard_map`` over the data axis and is the only place
where gradients cross devices: a compressor wrapped by ``compressors.compress`` (error feedback,
the collective, the decoded mean), or TASC's ``tasc.tasc_compress``. ``dense`` is the same
wrapper around ``compressors.none()``, a plain all-reduce, so every method's bytes are measured
the same way.

A method whose implementation does not exist (yet) in ``compressors``/``tasc`` is reported with
a clear error naming it and listing what is available, before anything is compiled.
"""

from collections.abc import Callable
import importlib
from typing import Any, NamedTuple

import optax

import compressors
import optimizers

AXIS_NAME = "data"


class Method(NamedTuple):
  """How a method is built.

  Attributes:
    requires: ``"module.attribute"`` that must exist for the method to be available.
    build: ``(implementation, compression_config, axis_name) -> transformation``.
    error_feedback: the method's default for ``compression.error_feedback`` (the paper's).
    uses_curvature: the transformation's ``update`` takes ``curvature=`` (a Hessian diagonal,
      refreshed by the trainer every ``compression.hessian_every`` steps).
  """
  requires: str
  build: Callable[..., Any]
  error_feedback: bool = True
  uses_curvature: bool = False


def _compressor(make: Callable[[Any, Any], Any]) -> Callable[..., Any]:
  """A builder for compressors run through ``compressors.compress``."""
  def build(implementation, c, axis_name, error_feedback):
    return compressors.compress(make(implementation, c), axis_name=axis_name,
                                error_feedback=error_feedback, fuse=c.fuse, seed=c.seed)
  return build


def _tasc(implementation, c, axis_name, error_feedback):
  return implementation(axis_name=axis_name, density=c.density, block_size=c.block_size,
                        sensitivity=c.sensitivity, support=c.support, wire_dtype=c.wire_dtype,
                        error_feedback=error_feedback, fuse=c.fuse, seed=c.seed)


def _powersgd(implementation, c, axis_name, error_feedback):
  return implementation(c.rank, axis_name=axis_name, error_feedback=error_feedback, seed=c.seed)


METHODS: dict[str, Method] = {
    "dense": Method("compressors.none", _compressor(lambda f, c: f()), error_feedback=False),
    "fp16": Method("compressors.cast", _compressor(lambda f, c: f("float16")),
                   error_feedback=False),
    "bf16": Method("compressors.cast", _compressor(lambda f, c: f("bfloat16")),
                   error_feedback=False),
    "topk": Method("compressors.topk", _compressor(lambda f, c: f(c.density))),
    "randomk": Method("compressors.randomk", _compressor(lambda f, c: f(c.density))),
    "threshold": Method("compressors.threshold", _compressor(lambda f, c: f(c.threshold))),
    "dgc": Method("compressors.dgc", _compressor(
        lambda f, c: f(c.density, momentum=c.dgc_momentum, clip_norm=c.clip_norm,
                       warmup_steps=c.warmup_steps))),
    "qsgd": Method("compressors.qsgd", _compressor(lambda f, c: f(c.levels)),
                   error_feedback=False),
    "terngrad": Method("compressors.terngrad", _compressor(lambda f, c: f()),
                       error_feedback=False),
    "signsgd": Method("compressors.signsgd", _compressor(lambda f, c: f()),
                      error_feedback=False),
    "efsignsgd": Method("compressors.efsignsgd", _compressor(lambda f, c: f())),
    "onebit": Method("compressors.onebit", _compressor(lambda f, c: f())),
    "powersgd": Method("compressors.powersgd_compress", _powersgd),
    "tasc": Method("tasc.tasc_compress", _tasc, uses_curvature=True),
}


def _implementation(method: str):
  module, attribute = METHODS[method].requires.split(".")
  return getattr(importlib.import_module(module), attribute, None)


def available_methods() -> list[str]:
  """Methods whose implementation exists now."""
  return sorted(m for m in METHODS if _implementation(m) is not None)


def check_method(method: Any) -> Method:
  """The :class:`Method` named ``method``; a clear error if it is unknown or not available."""
  if method not in METHODS:
    raise ValueError(f"config.method={method!r} is not a known method; known: {sorted(METHODS)} "
                     f"(available now: {available_methods()})")
  if _implementation(method) is None:
    raise ValueError(f"config.method={method!r} needs {METHODS[method].requires}, which does not "
                     f"exist (yet); available methods: {available_methods()}")
  return METHODS[method]


def communication(config, axis_name: str = AXIS_NAME) -> optax.GradientTransformationExtraArgs:
  """The per-worker transformation that exchanges gradients for ``config.method``."""
  method = check_method(config.method)
  c = config.compression
  exchange = method.build(_implementation(config.method), c, axis_name,
                            error_feedback(config))
  if c.momentum_correction:
    return compressors.momentum_correction(exchange, c.momentum_correction,
                                           clip_norm=c.clip_norm, axis_name=axis_name)
  return exchange


def error_feedback(config) -> bool:
  """Whether ``config.method`` runs with error feedback (its paper's default unless set)."""
  c = config.compression
  return check_method(config.method).error_feedback if c.error_feedback is None else c.error_feedback


def uses_curvature(config) -> bool:
  """Whether ``config.method``'s update takes ``curvature=`` (a Hessian diagonal)."""
  return (check_method(config.method).uses_curvature
          and config.compression.sensitivity == "hutchinson")


SCHEDULES = ("constant", "cosine", "step", "warmup_poly", "mlperf_lars")


def learning_rate_schedule(config, steps_per_epoch: int, total_steps: int) -> optax.Schedule:
  """``config.schedule`` as an optax schedule of the step.

  ``constant``: the peak rate after a linear warmup. ``cosine``: warmup, then cosine decay to 0
  (Loshchilov & Hutter 2017). ``step``: the peak rate divided by 10 at the fractions
  ``schedule.boundaries`` of training (He et al. 2016 use 0.5 and 0.75). ``warmup_poly``: warmup,
  then polynomial decay of ``schedule.power`` to 0 (1 for BERT's LAMB). ``mlperf_lars``: MLPerf's
  ResNet-50 LARS schedule (its base rate and warmup epochs come from the batch size).

  Warmup is ``schedule.warmup_epochs`` epochs (may be fractional). The peak rate is
  ``optimizer.learning_rate``.
  """
  s = config.schedule
  peak = config.optimizer.learning_rate
  warmup = int(round(s.warmup_epochs * steps_per_epoch))
  if s.name == "mlperf_lars":
    return optimizers.mlperf_lars_schedule(config.batch_size, steps_per_epoch, total_steps)
  if warmup >= total_steps:
    raise ValueError(f"config.schedule.warmup_epochs={s.warmup_epochs} is {warmup} steps, not "
                     f"fewer than the {total_steps} training steps")
  if s.name == "warmup_poly":
    return optimizers.warmup_polynomial_decay(peak, warmup, total_steps, power=s.power)
  if s.name == "cosine":
    if not warmup:
      return optax.cosine_decay_schedule(peak, total_steps)
    return optax.warmup_cosine_decay_schedule(0.0, peak, warmup, total_steps)
  if s.name == "step":
    after_warmup = optax.piecewise_constant_schedule(
        peak, {int(b * total_steps) - warmup: 0.1 for b in s.boundaries})
  else:
    after_warmup = optax.constant_schedule(peak)
  if not warmup:
    return after_warmup
  return optax.join_schedules(
      [optax.linear_schedule(0.0, peak, warmup), after_warmup], [warmup])


OPTIMIZERS = ("sgd", "momentum", "nesterov", "adam", "adamw", "lamb", "lars")


def optimizer(config, learning_rate: optax.ScalarOrSchedule) -> optax.GradientTransformation:
  """``config.optimizer`` applied to the already-averaged gradient.

  ``sgd``/``momentum``/``nesterov`` add coupled L2 weight decay (``weight_decay * w`` added to the
  gradient, as for the CIFAR ResNets); ``adamw`` decays decoupled; ``lamb`` and ``lars`` are the
  project's ``optimizers.lamb``/``optimizers.lars`` (biases and norm parameters excluded from decay
  and trust ratio, as the reference implementations do).
  """
  o = config.optimizer
  if o.name in ("sgd", "momentum", "nesterov"):
    momentum = None if o.name == "sgd" else o.momentum
    sgd = optax.sgd(learning_rate, momentum=momentum, nesterov=o.name == "nesterov")
    return optax.chain(optax.add_decayed_weights(o.weight_decay), sgd) if o.weight_decay else sgd
  if o.name == "adam":
    return optax.adam(learning_rate, b1=o.b1, b2=o.b2, eps=o.eps)
  if o.name == "adamw":
    return optax.adamw(learning_rate, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay)
  if o.name == "lamb":
    return optimizers.lamb(learning_rate, b1=o.b1, b2=o.b2, eps=o.eps,
                           weight_decay=o.weight_decay)
  return optimizers.lars(learning_rate, momentum=o.momentum, weight_decay=o.weight_decay,
                         trust_coefficient=o.trust_coefficient)


def make_chain(config, learning_rate: optax.ScalarOrSchedule,
               axis_name: str = AXIS_NAME) -> optax.GradientTransformationExtraArgs:
  """``optax.chain(communication(config), optimizer(config))``: run its ``update`` per worker
  inside ``shard_map`` over ``axis_name``; its output is identical on every worker."""
  return optax.chain(communication(config, axis_name), optimizer(config, learning_rate))


def training_chain(config, learning_rate: optax.ScalarOrSchedule,
                   axis_name: str = AXIS_NAME) -> optax.GradientTransformationExtraArgs:
  """What the runner trains with: :func:`make_chain`, wrapped in ``compressors.skip_nonfinite``
  when ``config.skip_nonfinite`` (a step whose gradient is not finite on any worker is skipped on
  every worker, leaving residuals, moments and curvature as they were)."""
  chain = make_chain(config, learning_rate, axis_name)
  if not config.skip_nonfinite:
    return chain
  return compressors.skip_nonfinite(chain, axis_name=axis_name)
