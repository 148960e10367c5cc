"""1-bit Adam: dense Adam for a warm-up, then Adam's momentum through a 1-bit exchange.

Tang, Gan, Awan, Rajbhandari, Li, Lian, Liu, Zhang & He 2021, "1-bit Adam: communication
efficient large-scale training with Adam's convergence speed" (ICML), as DeepSpeed implements it
(``deepspeed/runtime/fp16/onebit/adam.py``, ``OnebitAdam.step``; the exchange in
``deepspeed/runtime/comm/nccl.py``, ``compressed_allreduce``). Adam's variance stabilises early
in training; once it is frozen, Adam is a momentum method with a fixed per-coordinate learning
rate, and momentum tolerates error-compensated 1-bit compression. Per worker, with ``g`` its
own gradient:

* warm-up (the first ``freeze_step`` steps): the gradient is all-reduced densely (its mean over
  the workers, ``g_bar``), and ``m = b1 m + (1 - b1) g_bar``, ``v = b2 v + (1 - b2) g_bar**2``;
* compressed (every later step): ``v`` stays frozen; each worker updates the momentum with its
  own gradient, ``m_i = b1 m + (1 - b1) g``, and ``m_i`` goes through the error-compensated
  compressed all-reduce: :func:`compressors.onebit` with ``scale="rms"`` through the two-phase
  exchange of :func:`compressors.compress` (``x = m_i + e``, ``sign(x)`` times
  ``||x||_2 / sqrt(d)``, ``e = x - that``; each chunk's owner re-encodes the mean it received the
  same way, with its own error memory); ``m`` becomes the exchanged mean, the same on every
  worker;
* every step: ``theta <- theta - lr * (m / (sqrt(v) + eps) + weight_decay * theta)``.

Where this follows DeepSpeed rather than the textbook Adam: no bias correction (DeepSpeed takes
a ``bias_correction`` flag and never applies it), ``eps`` added to ``sqrt(v)`` (its default
``eps_inside_sqrt=False``), weight decay added to the update and scaled by the learning rate
(``update += weight_decay * p``), the warm-up's gradient averaged over the workers before the
moments see it (the engine's backward all-reduce), the variance frozen after ``freeze_step``
steps, and the momentum replaced by the exchanged mean, from which the next step's local
momentum starts. Where it differs: the whole model is one fused buffer (DeepSpeed exchanges each
parameter tensor on its own); each of a worker's ``n`` chunks carries its own scale (DeepSpeed's
worker sends one scale per tensor to every worker: the same bytes; the framework's two-phase
exchange encodes chunks independently); DeepSpeed's initialisation step (a step that only
allocates buffers) and its momentum mask (for entries whose momentum is exactly zero forever,
which 1-bit codes cannot send) are left out. As in DeepSpeed, the error memories start at zero
when the compressed steps begin.

0/1 Adam's variance refreshes (Lu et al. 2022) are a setting (``variance_refresh``): dense steps,
exponentially further apart, that update the variance again after the warm-up (they are
warm-up steps: :func:`kinds` schedules them). 0/1 Adam's other parts (its compressed gradient
between refreshes, its local steps) are not here.

The warm-up and the compressed steps are two programs: ``update(..., compressed=False)`` and
``update(..., compressed=True)``, a static keyword, compiled once each; :func:`kinds` gives the
step kinds (:class:`compressors.StepKind`) a trainer runs them as. Both take and return the same
:class:`OnebitAdamState`. A state laid out per worker must take its layout from the compressed
program (:func:`compressors.state_specs` of ``update`` with ``compressed=True``), where the error
memories change.
"""

import dataclasses
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import optax

from compressors import wrapper
from compressors import _sign
from compressors import checks
from compressors import method_table
from compressors.network import axes
from compressors.network import topology as topology_lib
from compressors.method_protocol import StepKind


class OnebitAdamState(NamedTuple):
  """State of :func:`onebit_adam`, one per worker.

  Attributes:
    count: steps taken so far (int32; the learning-rate schedule's argument).
    mu: Adam's momentum after the latest step, the same on every worker: the dense mean's in the
      warm-up, the exchanged mean after a compressed step.
    nu: Adam's variance, the same on every worker; frozen after the warm-up.
    exchange: the :class:`compressors.CompressState` of the 1-bit exchange: each worker's error
      memory (``residual``) and its chunk's owner memory (``buffers.owner_residual``), which
      differ between workers; unchanged by warm-up steps.
  """
  count: jax.Array
  mu: chex.ArrayTree
  nu: chex.ArrayTree
  exchange: wrapper.CompressState


def onebit_adam(learning_rate: optax.ScalarOrSchedule, *, axis_name: axes.AxisName,
                b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.0,
                seed: int = 0) -> optax.GradientTransformationExtraArgs:
  """1-bit Adam (Tang et al. 2021) as one worker's whole training transformation.

  Args:
    learning_rate: a float >= 0, or an optax schedule of the step count.
    axis_name: the workers' mesh axis (or tuple of axes); ``update`` runs inside
      ``jax.shard_map``/``jax.pmap``/``jax.vmap(axis_name=...)`` over it (None: one worker).
    b1: the momentum's decay, in [0, 1).
    b2: the variance's decay during the warm-up, in [0, 1).
    eps: added to ``sqrt(v)``, > 0.
    weight_decay: ``lambda`` of the update's ``lambda * theta`` term (DeepSpeed's), >= 0.
    seed: the seed of :func:`compressors.compress` (the 1-bit codes use no randomness).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is :class:`OnebitAdamState` and
    whose ``update(grads, state, params=None, *, compressed=False)`` takes this worker's
    gradient and returns the parameters' update, bit-identical on every worker: a warm-up step
    with ``compressed=False``, a compressed step with ``compressed=True`` (a Python bool: the
    two are different programs). ``params`` is needed when ``weight_decay > 0``. ``init`` must
    run where ``axis_name`` is bound (the owner memory's size depends on the workers' number).

  Raises:
    TypeError, ValueError: a setting out of range, naming it.
  """
  _check_adam(b1, b2, eps, weight_decay, "onebit_adam")
  if not callable(learning_rate):
    checks.check_real(learning_rate, "learning_rate", 0.0, float("inf"), "[0, inf)",
                      "onebit_adam")
  exchange = wrapper.compress(_sign.onebit(scale="rms"), axis_name=axis_name,
                                error_feedback=True, seed=seed)

  def init_fn(params):
    zeros = lambda: jax.tree.map(lambda x: jnp.zeros(jnp.shape(x), _work_dtype(x)), params)
    return OnebitAdamState(count=jnp.zeros((), jnp.int32), mu=zeros(), nu=zeros(),
                           exchange=exchange.init(params))

  def update_fn(grads, state, params=None, *, compressed: bool = False, **extra_args):
    del extra_args  # chained transformations' arguments
    if not isinstance(compressed, bool):
      raise TypeError(f"onebit_adam: compressed must be a Python bool (the warm-up and the "
                      f"compressed steps are different programs), got {compressed!r}")
    if weight_decay and params is None:
      raise ValueError(f"onebit_adam: weight_decay={weight_decay!r} needs params in update()")
    work = jax.tree.map(lambda g: g.astype(_work_dtype(g)), grads)
    if compressed:
      local = _moving_average(state.mu, work, b1)
      mu, exchange_state = exchange.update(local, state.exchange)
      nu = state.nu
    else:
      mean = _dense_mean(work, axis_name)
      mu = _moving_average(state.mu, mean, b1)
      nu = _moving_average(state.nu, jax.tree.map(jnp.square, mean), b2)
      exchange_state = state.exchange
    lr = learning_rate(state.count) if callable(learning_rate) else learning_rate
    step = jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + eps), mu, nu)
    if weight_decay:
      step = jax.tree.map(lambda s, p: s + weight_decay * p, step, params)
    updates = jax.tree.map(lambda s, g: (-lr * s).astype(g.dtype), step, grads)
    return updates, OnebitAdamState(count=state.count + 1, mu=mu, nu=nu,
                                    exchange=exchange_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _moving_average(average: chex.ArrayTree, value: chex.ArrayTree,
                    decay: float) -> chex.ArrayTree:
  """``decay * average + (1 - decay) * value``, written ``average + (1 - decay) * (value -
  average)``: with one product, XLA's CPU code contracts it into the same fused multiply-add
  in every fusion that computes it, where the two products of the textbook form give the
  contraction a choice that differs between fusions (pmap's update recomputed the momentum
  in its own fusion and got another last bit than shard_map's)."""
  return jax.tree.map(lambda a, x: a + (1 - decay) * (x - a), average, value)


def _dense_mean(grads: chex.ArrayTree, axis_name: axes.AxisName) -> chex.ArrayTree:
  """The mean over the workers of each worker's gradient (the warm-up's dense all-reduce)."""
  names = axes.as_tuple(axis_name)
  if not names:
    return grads
  count = axes.num_workers(axis_name, caller="onebit_adam")
  axes.check_per_worker(grads, axis_name, "onebit_adam")
  return jax.tree.map(lambda g: jax.lax.psum(g, axis_name) / count, grads)


def _work_dtype(x) -> jnp.dtype:
  """Moments are kept in float32 or wider, whatever the parameters' dtype."""
  return jnp.promote_types(jnp.result_type(x), jnp.float32)


def _check_adam(b1, b2, eps, weight_decay, caller: str) -> None:
  """Adam's hyper-parameters: decays in [0, 1), ``eps`` > 0, ``weight_decay`` >= 0."""
  checks.check_real(b1, "b1", 0.0, 1.0, "[0, 1)", caller)
  checks.check_real(b2, "b2", 0.0, 1.0, "[0, 1)", caller)
  # eps > 0: a coordinate whose frozen variance is 0 would otherwise divide by zero.
  if checks.check_real(eps, "eps", 0.0, float("inf"), "(0, inf)", caller) == 0.0:
    raise ValueError(f"{caller}: eps={eps!r} is outside (0, inf)")
  checks.check_real(weight_decay, "weight_decay", 0.0, float("inf"), "[0, inf)", caller)


@dataclasses.dataclass(frozen=True)
class OnebitAdamSettings:
  """``method="onebit_adam"``: Adam's hyper-parameters (:func:`onebit_adam`), the warm-up, and
  0/1 Adam's variance refreshes.

  Attributes:
    b1, b2, eps, weight_decay: see :func:`onebit_adam`.
    freeze_step: dense warm-up steps before the variance freezes and the momentum is compressed
      (DeepSpeed's ``freeze_step``); 0: compressed from the first step, with a variance of zero
      (updates ``m / eps``) unless ``variance_refresh`` makes a warm-up.
    variance_refresh: 0/1 Adam's variance refreshes (Lu, Li, Zhang, De Sa & He 2022, "Maximizing
      communication efficiency for large-scale training via 0/1 Adam"; DeepSpeed's
      ``ZeroOneAdam`` ``var_update_scaler``): the variance is refreshed, by a dense step, at the
      (1-based) steps that are multiples of an interval that starts at 1 and doubles after every
      ``variance_refresh`` refreshes; the refreshes at interval 1 lengthen the warm-up. 0: the
      variance stays frozen after the warm-up (1-bit Adam).
    variance_freeze_step: no refresh after this many steps (0/1 Adam's ``var_freeze_step``).
  """
  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-8
  weight_decay: float = 0.0
  freeze_step: int = 100
  variance_refresh: int = 0
  variance_freeze_step: int = 100_000

  def __post_init__(self):
    _check_adam(self.b1, self.b2, self.eps, self.weight_decay, "onebit_adam")
    for field in ("freeze_step", "variance_refresh", "variance_freeze_step"):
      checks.check_int(getattr(self, field), field, 0, "onebit_adam")

  @staticmethod
  def freeze_step_for(fraction: float, steps: int) -> int:
    """The ``freeze_step`` of a dense warm-up of ``fraction`` of a run of ``steps`` steps, at
    least one: the paper warms up for 15-25% of training (Tang et al. 2021, Section 7), a
    fraction, where a fixed count would be a different share of every run's length."""
    checks.check_real(fraction, "fraction", 0.0, 1.0, "[0, 1)", "onebit_adam.freeze_step_for")
    checks.check_int(steps, "steps", 1, "onebit_adam.freeze_step_for")
    return max(1, round(fraction * steps))


def kinds(settings: OnebitAdamSettings) -> tuple[StepKind, ...]:
  """The step kinds of 1-bit Adam: ``"warmup"`` (dense) for the first ``freeze_step`` steps,
  then ``"compressed"``; with 0/1 Adam's ``variance_refresh`` (Lu et al. 2022), a dense kind
  ``"refresh_every_<interval>"`` for each interval of the refreshes after the warm-up.

  Args:
    settings: the method's :class:`OnebitAdamSettings`.

  Returns:
    The kinds, each passing its ``compressed`` option to ``update`` (a refresh is a warm-up
    step: the dense mean updates the momentum and the variance); no ``"warmup"`` kind when
    the warm-up is empty.
  """
  s = settings
  # A refresh at every step is a warm-up step: 0/1 Adam's first interval is its warm-up.
  warmup_stop = max(s.freeze_step, min(s.variance_refresh, s.variance_freeze_step))
  compressed = StepKind("compressed", options={"compressed": True}, start=warmup_stop)
  warmup = (StepKind("warmup", options={"compressed": False}, stop=warmup_stop),)
  return (warmup if warmup_stop else ()) + (compressed,) + _refresh_kinds(s, warmup_stop)


def _refresh_kinds(s: OnebitAdamSettings, warmup_stop: int) -> tuple[StepKind, ...]:
  """0/1 Adam's variance refreshes after the warm-up, one kind per interval: DeepSpeed's
  ``ZeroOneAdam`` refreshes at its (1-based) step ``k`` when ``k % var_interval == 0`` while
  ``k <= var_freeze_step``, and doubles ``var_interval`` after ``var_update_scaler``
  refreshes (DeepSpeed's extra first step, which only allocates buffers, is not counted, and
  its check of ``var_freeze_step``, made after each step, lets one more step refresh)."""
  refreshes = []
  interval, last = 1, 0  # ``last``: the 1-based step of the latest refresh
  while s.variance_refresh and last < s.variance_freeze_step:
    first = (last // interval + 1) * interval
    last = first + (s.variance_refresh - 1) * interval
    # 0-based, the steps ``first - 1, ..., last - 1`` at which ``(t + 1) % interval == 0``.
    start, stop = max(first - 1, warmup_stop), min(last, s.variance_freeze_step)
    if interval > 1 and stop > start:
      refreshes.append(StepKind(f"refresh_every_{interval}", every=interval,
                                options={"compressed": False}, phase=interval - 1,
                                start=start, stop=stop))
    interval *= 2
  return tuple(refreshes)


def _cost(settings: OnebitAdamSettings, shapes, topology: topology_lib.Topology,
          schedule: str) -> topology_lib.Cost:
  """A compressed step's exchange: packed signs and one float32 scale per chunk, two-phase (a
  warm-up step is a dense all-reduce of the gradient)."""
  del settings, schedule
  return topology_lib.onebit_cost(topology, method_table.num_elements(shapes), scale_bytes=4)


METHODS = (method_table.Method(
    name="onebit_adam", summary="1-bit Adam: dense Adam warm-up, then frozen variance and "
    "1-bit compressed momentum with error feedback (Tang et al. 2021)",
    settings=OnebitAdamSettings, cost=_cost, kinds=kinds, error_feedback=True,
    optimizer=lambda s, learning_rate, *, axis_name, seed: onebit_adam(
        learning_rate, axis_name=axis_name, b1=s.b1, b2=s.b2, eps=s.eps,
        weight_decay=s.weight_decay, seed=seed)),)
