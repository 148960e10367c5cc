"""Config -> the per-worker transformation a run trains with, and its step kinds.

``config.method`` names a method of :mod:`compressors.registry`, built from
``config.compression``'s shared settings and its own block ``config.compression.<method>``
(:func:`make_chain`, :func:`compressors.registry.training`): a per-step exchange chained with
``config.optimizer`` before it (``config.compression.exchanged="gradient"``, the default) or
after it (``"update"``); a method that is its own optimizer (DeMo, 1-bit Adam); or a local-update
method (DiLoCo) whose inner optimizer is ``config.optimizer`` and whose pseudo-gradient goes
through its carrier, the per-step method its settings' ``carrier`` names (with that method's
block; a config written when the setting was called ``exchange`` still loads). The
runner's step (``compressors.data_parallel``) wraps it in ``compressors.skip_nonfinite`` when
``config.skip_nonfinite``. It runs per worker inside ``shard_map`` over the data axis and is the
only place where anything crosses devices (``dense`` is a plain all-reduce through the same
wrapper, so every method's bytes are measured the same way). Nothing here names a method: every
built-in method and any method registered with ``registry.register`` is available to every
config.
"""

import dataclasses
import functools
import json
import math
from typing import Any

import jax
import jax.numpy as jnp
import optax

from compressors import aggregation as aggregation_lib
from compressors import checks
from compressors import equal_bytes
from compressors import registry
from compressors import step_time
from compressors import worker_sim
from compressors.network import topology as topology_lib
from compressors.parallel import fsdp
from configs import common as config_common
from experiments import models
import optimizers
import tasc  # registers the method "tasc" (compressors never imports tasc)

AXIS_NAME = "data"


def check_method(method: Any) -> registry.Method:
  """The registered method ``config.method`` names; a clear error if there is none."""
  if not isinstance(method, str) or method not in registry.names():
    raise ValueError(f"config.method={method!r} is not a known method; known: "
                     f"{list(registry.names())}")
  return registry.get(method)


def settings(config) -> Any:
  """The method's own settings, from ``config.compression.<method>``."""
  check_method(config.method)
  block = config.compression.get(config.method)
  if block is None:
    raise ValueError(f"config.compression has no block {config.method!r} for "
                     f"config.method={config.method!r}; configs built from "
                     "configs.common.base() have one per registered method")
  return _settings_of(config.method, block)


def _settings_of(name: str, block) -> Any:
  """Method ``name``'s settings from its block of ``config.compression`` (old names read with a
  notice), each field checked, an error naming ``config.compression.<name>.<field>``."""
  where = f"config.compression.{name}"
  return _dataclass_from(registry.get(name).settings,
                         registry.renamed_settings(name, block, where), where)


def carrier(config) -> str | None:
  """The carrier of a local-update ``config.method`` (the per-step method that exchanges its
  pseudo-gradient: :attr:`compressors.registry.Method.carrier` of its settings); None for
  other methods."""
  method = check_method(config.method)
  return None if method.carrier is None else method.carrier(settings(config))


def common(config) -> registry.Common:
  """The settings every method shares, from ``config.compression``'s own fields."""
  return _dataclass_from(registry.Common, config.compression, "config.compression")


def _dataclass_from(cls: type, block, where: str):
  """``cls`` made from the fields of ``block`` it has, each first checked against its declared
  rule (:func:`compressors.checks.setting`), so that an error names ``<where>.<field>``; the
  errors of a settings class's own checks are prefixed with ``where``."""
  for field, rule in checks.rules_of(cls).items():
    if field in block:
      rule.check(block[field], f"{where}.{field}")
  names = {f.name for f in dataclasses.fields(cls)}
  try:
    return cls(**{k: v for k, v in block.items() if k in names})
  except (ValueError, TypeError) as err:
    raise type(err)(f"{where}: {err}") from err


def exchange_settings(config) -> Any:
  """The settings of the carrier of a local-update ``config.method`` (:func:`carrier`, from
  ``config.compression.<carrier>``); None for other methods."""
  name = carrier(config)
  if name is None:
    return None
  if name not in registry.names():
    raise ValueError(f"config.compression.{config.method}.carrier={name!r} is not a known "
                     f"method; known: {list(registry.names())}")
  block = config.compression.get(name)
  if block is None:
    raise ValueError(f"config.compression has no block {name!r} for "
                     f"config.compression.{config.method}.carrier={name!r}")
  return _dataclass_from(registry.get(name).settings, block, f"config.compression.{name}")


def communication(config, axis_name: str = AXIS_NAME) -> optax.GradientTransformationExtraArgs:
  """The per-worker transformation that exchanges gradients for a per-step ``config.method``
  (without the optimizer; benchmarks time it alone).

  Raises:
    ValueError, TypeError: settings the method refuses, prefixed with the config block.
  """
  own = settings(config)
  return _in_config(config, own, lambda: registry.transformation(
      config.method, own, axis_name=axis_name, common=common(config)))


def hot_exchange(config, axis_name: str = AXIS_NAME):
  """``config.embedding.hot_exchange``: the per-step method that exchanges the hot rows'
  gradient (:func:`compressors.parallel.hot_rows.with_exchange`; ``"same"``: ``config.method``),
  with its settings (``config.compression.<name>``) and the shared ``error_feedback`` and
  ``seed`` (the rest of ``config.compression``'s own fields is the dense part's):
  ``(its per-worker transformation, (shape, topology) -> its cost-model price)``.

  Raises:
    ValueError: in one line, not a per-step method without per-step inputs, or a method other
      than ``dense`` where ``config.embedding.hot_rows`` is ``"0"``.
  """
  block = config.embedding
  value = block.get("hot_exchange", "dense")
  name = config.method if value == "same" else value
  allowed = [n for n in registry.names("per_step")
             if registry.step_inputs(n) is None and registry.get(n).kinds is None]
  if not isinstance(name, str) or name not in allowed:
    same = f" (config.method={config.method!r})" if value == "same" else ""
    raise ValueError(f"config.embedding.hot_exchange={value!r}{same} is not allowed; allowed: "
                     f"'same' or a per-step method without per-step inputs: {allowed}")
  if name != "dense" and str(block.get("hot_rows", "0")) == "0":
    raise ValueError(f"config.embedding.hot_exchange={value!r} with hot_rows='0' is not "
                     "allowed: there is no hot bank to exchange; allowed: 'dense' there")
  own = _settings_of(name, config.compression.get(name, {}))
  shared = common(config)
  shared = registry.Common(error_feedback=shared.error_feedback, seed=shared.seed)
  tx = registry.transformation(name, own, axis_name=axis_name, common=shared)
  return tx, lambda shape, topology: registry.cost(name, [shape], topology, own)


def step_kinds(config) -> tuple[Any, ...]:
  """The step kinds (``compressors.StepKind``) of ``config.method``'s steps."""
  own = settings(config)
  return _in_config(config, own, lambda: registry.step_kinds(
      config.method, own, common=common(config), exchange_settings=exchange_settings(config)))


def _in_config(config, own, build):
  """``build()``, its errors prefixed with the method and its config block."""
  try:
    return build()
  except (ValueError, TypeError) as err:
    raise type(err)(f"config.method={config.method!r} with config.compression.{config.method}="
                    f"{dataclasses.asdict(own)}: {err}") from err


def parameter_shapes(config) -> tuple[tuple[int, ...], ...]:
  """The shapes of the parameters of ``config.model``, a language model of
  ``config.data.vocab_size`` tokens read ``config.data.seq_len`` at a time (traced with
  ``jax.eval_shape``: nothing is allocated or run, and no corpus is read).

  Raises:
    ValueError: a config without ``data.vocab_size`` and ``data.seq_len``.
  """
  missing = [f for f in ("vocab_size", "seq_len") if f not in config.data]
  if missing:
    raise ValueError(f"config.data has no {missing}: parameter shapes are traced for a language "
                     "model's config (configs/lm_stdlib.py)")
  return _traced_shapes(json.dumps(config.model.to_dict(), sort_keys=True),
                        config.data.vocab_size, config.data.seq_len)


@functools.cache
def _traced_shapes(model_json: str, vocab_size: int, seq_len: int):
  model = models.build_model(json.loads(model_json), vocab_size=vocab_size)
  # Abstract inputs only: a concrete array would start JAX's backend before the runner has set
  # the number of CPU devices.
  variables = jax.eval_shape(model.init, jax.ShapeDtypeStruct((2,), jnp.uint32),
                             jax.ShapeDtypeStruct((1, seq_len), jnp.int32))
  return tuple(x.shape for x in jax.tree.leaves(variables["params"]))


def equal_bytes_settings(config) -> tuple[Any, equal_bytes.Solution | None]:
  """``(settings, solution)``: the method's settings (:func:`settings`) with its budget solved
  for ``config.equal_bytes`` (``ratio``: bytes per step dense's over this; ``workers``), by
  :func:`compressors.equal_bytes.solve` on :func:`parameter_shapes` (a local-update method's
  ``every`` or its exchange's budget; the latter in ``solution.exchange_settings``);
  ``solution`` is None, and the settings as configured, for a method whose bytes are fixed or a
  config without the request."""
  own = settings(config)
  request = config.get("equal_bytes")
  method = registry.get(config.method)
  if request is None or (method.budget is None and method.carrier is None):
    return own, None
  solution = _solve(config, own)
  return solution.settings, solution


def _solve(config, own) -> equal_bytes.Solution:
  """:func:`compressors.equal_bytes.solve` for ``config.equal_bytes`` from the method's settings
  ``own``, over the run's ``num_steps`` (None when it counts epochs)."""
  request = config.equal_bytes
  return equal_bytes.solve(config.method, parameter_shapes(config), request.workers,
                           request.ratio, own, exchange_settings=exchange_settings(config),
                           steps=config.get("num_steps") or None)


def equal_bytes_tier(config) -> dict[str, Any] | None:
  """The equal-bytes tier ``config.equal_bytes`` asks for and the one the method's settings
  (solved by :func:`fill_equal_bytes`, or as configured) meet, for the run's log and its
  ``results.json``: ``ratio`` (asked), ``met_ratio`` (dense's bytes over the method's, by the cost
  model, a local-update method's over the synchronisations its ``num_steps`` complete; None
  where no setting can be priced), ``workers``, ``on_tier`` (within
  :data:`compressors.equal_bytes.TOLERANCE`) and ``note`` (why not, when not). A method whose
  bytes are fixed (dense, fp16) meets only its own ratio. None for a config without the request.
  """
  request = config.get("equal_bytes")
  if request is None:
    return None
  solution = _solve(config, settings(config))
  return {"ratio": request.ratio, "workers": request.workers,
          "met_ratio": solution.ratio if math.isfinite(solution.bytes) else None,
          "on_tier": solution.feasible, "note": solution.note}


def fill_equal_bytes(config) -> None:
  """Writes :func:`equal_bytes_settings` into ``config.compression.<method>``, so that the run
  trains, and its ``config.json`` records, the solved settings. What runs a config calls this
  before training (a config is data: it records the request, and only experiments trace the
  model to solve it)."""
  if config.get("equal_bytes") is None:  # nothing to solve (and no method to look up yet)
    return
  solved, solution = equal_bytes_settings(config)
  if solution is not None:
    config.compression[config.method].update(dataclasses.asdict(solved))
    if solution.exchange_settings is not None:  # a local-update method's carrier's, solved too
      config.compression[carrier(config)].update(dataclasses.asdict(solution.exchange_settings))


# Each schedule and the fields of config.schedule it uses besides its name and warm-up (others set
# away from their defaults are warned about: experiments.validation.unused_settings).
LR_SCHEDULES = {"constant": (), "cosine": (), "step": ("boundaries",), "warmup_poly": ("power",),
                "mlperf_lars": ()}


def learning_rate_schedule(config, steps_per_epoch: int, total_steps: int) -> optax.Schedule:
  """``config.schedule`` as an optax schedule of the step.

  ``constant``: the peak rate after a linear warmup. ``cosine``: warmup, then cosine decay to 0
  (Loshchilov & Hutter 2017). ``step``: the peak rate divided by 10 at the fractions
  ``schedule.boundaries`` of training (He et al. 2016 use 0.5 and 0.75). ``warmup_poly``: warmup,
  then polynomial decay of ``schedule.power`` to 0 (1 for BERT's LAMB). ``mlperf_lars``: MLPerf's
  ResNet-50 LARS schedule (its base rate and warmup epochs come from the batch size).

  Warmup is ``schedule.warmup_epochs`` epochs (may be fractional) or, where an epoch's length
  is not known when the config is written (a corpus's token count depends on its tokenizer),
  ``schedule.warmup_steps`` steps; a config sets at most one. The peak rate is
  ``optimizer.learning_rate``.
  """
  config_common.check(config, "schedule", "optimizer.learning_rate")
  s = config.schedule
  peak = config.optimizer.learning_rate
  warmup = check_schedule(config, steps_per_epoch, total_steps)
  if s.name == "mlperf_lars":
    return optimizers.mlperf_lars_schedule(config.batch_size, steps_per_epoch, total_steps)
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


def check_schedule(config, steps_per_epoch: int | None = None,
                   total_steps: int | None = None) -> int | None:
  """Checks ``config.schedule``'s name and its warm-up (``warmup_epochs`` or ``warmup_steps``)
  against the run's length (the one place of these rules), and returns the warm-up's steps.

  Args:
    config: the run's config.
    steps_per_epoch, total_steps: the run's, once its data is loaded; None before, when the
      warm-up is checked only where it and the run's length are given in one unit (steps, or
      epochs).

  Returns:
    The warm-up's steps; None before the data is loaded.

  Raises:
    ValueError: an unknown name, both warm-up fields set, a warm-up with ``mlperf_lars`` (whose
      warm-up comes from the batch size), or a warm-up not shorter than the run.
  """
  s = config.schedule
  if s.name not in LR_SCHEDULES:
    raise ValueError(f"config.schedule.name={s.name!r} is not allowed; allowed: "
                     f"{sorted(LR_SCHEDULES)}")
  if s.warmup_epochs and s.warmup_steps:
    raise ValueError(f"config.schedule.warmup_epochs={s.warmup_epochs} and warmup_steps="
                     f"{s.warmup_steps} are both set; allowed: at most one > 0")
  if s.name == "mlperf_lars" and (s.warmup_epochs or s.warmup_steps):
    given = "warmup_steps" if s.warmup_steps else "warmup_epochs"
    raise ValueError(f"config.schedule.{given}={s[given]!r} with schedule.name='mlperf_lars', "
                     "whose warm-up comes from the batch size "
                     "(optimizers.mlperf_lars_schedule); allowed: 0")
  if total_steps is None:
    if s.warmup_steps and config.num_steps and s.warmup_steps >= config.num_steps:
      raise ValueError(f"config.schedule.warmup_steps={s.warmup_steps} not fewer than the "
                       f"{config.num_steps} training steps (config.num_steps)")
    if s.warmup_epochs and config.num_epochs and s.warmup_epochs >= config.num_epochs:
      raise ValueError(f"config.schedule.warmup_epochs={s.warmup_epochs} not fewer than the "
                       f"{config.num_epochs} training epochs (config.num_epochs)")
    return None
  warmup = int(round(s.warmup_epochs * steps_per_epoch)) + s.warmup_steps
  if s.name != "mlperf_lars" and warmup >= total_steps:
    given = (f"warmup_steps={s.warmup_steps}" if s.warmup_steps
             else f"warmup_epochs={s.warmup_epochs} is {warmup} steps,")
    raise ValueError(f"config.schedule.{given} not fewer than the {total_steps} training steps")
  return warmup


# Each optimizer and the fields of config.optimizer it uses besides its name and learning rate
# (others set away from their defaults are warned about: experiments.validation.unused_settings).
OPTIMIZERS = {
    "sgd": ("weight_decay",), "momentum": ("momentum", "weight_decay"),
    "nesterov": ("momentum", "weight_decay"), "adam": ("b1", "b2", "eps"),
    "adamw": ("b1", "b2", "eps", "weight_decay"), "lamb": ("b1", "b2", "eps", "weight_decay"),
    "lars": ("momentum", "weight_decay", "trust_coefficient"),
}


def optimizer(config, learning_rate: optax.ScalarOrSchedule,
              param_layout: fsdp.ParamLayout | None = None) -> optax.GradientTransformation:
  """``config.optimizer`` applied to the already-averaged gradient.

  ``sgd``/``momentum``/``nesterov`` add coupled L2 weight decay (``weight_decay * w`` added to the
  gradient, as for the CIFAR ResNets); ``adamw`` decays decoupled; ``lamb`` and ``lars`` are the
  project's ``optimizers.lamb``/``optimizers.lars`` (biases and norm parameters excluded from decay
  and trust ratio, as the reference implementations do). With islands (``param_layout``, the
  parameters' layout over the fast axis) the optimizer runs on each device's shards: elementwise
  ones as they are, ``lamb`` and ``lars`` with :func:`_on_shards`.

  Raises:
    ValueError, TypeError: an unknown name, or a field of ``config.optimizer`` outside its
      declared rule (``configs.common.RULES``), e.g. ``b1=1.5``, for every optimizer alike.
  """
  config_common.check(config, "optimizer")
  o = config.optimizer
  if o.name not in OPTIMIZERS:
    raise ValueError(f"config.optimizer.name={o.name!r} is not allowed; allowed: "
                     f"{sorted(OPTIMIZERS)}")
  if o.name in ("sgd", "momentum", "nesterov"):
    momentum = None if o.name == "sgd" else o.momentum
    sgd = optax.sgd(learning_rate, momentum=momentum, nesterov=o.name == "nesterov")
    return optax.chain(optax.add_decayed_weights(o.weight_decay), sgd) if o.weight_decay else sgd
  if o.name == "adam":
    return optax.adam(learning_rate, b1=o.b1, b2=o.b2, eps=o.eps)
  if o.name == "adamw":
    return optax.adamw(learning_rate, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay)
  shards = {} if param_layout is None else _on_shards(param_layout)
  if o.name == "lamb":
    tx = optimizers.lamb(learning_rate, b1=o.b1, b2=o.b2, eps=o.eps,
                         weight_decay=o.weight_decay, **shards)
  else:
    tx = optimizers.lars(learning_rate, momentum=o.momentum, weight_decay=o.weight_decay,
                         trust_coefficient=o.trust_coefficient, **shards)
  return tx if param_layout is None else param_layout.padding_zeroed(tx)


def _on_shards(param_layout: fsdp.ParamLayout) -> dict[str, Any]:
  """LAMB's and LARS's arguments on each device's shards: the whole layers' norms (summed over
  the fast axis), and the default exclusions decided on the whole layers (a layer flattened and
  padded to shard is a vector on each device: the default rule would exclude it)."""
  # default_exclude reads the path and the number of dimensions: any dtype stands in.
  whole = jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, jnp.float32),
                       param_layout.leaves, is_leaf=lambda x: isinstance(x, fsdp.LeafLayout))
  return dict(shard_axis=param_layout.axis,
              exclude=optimizers.exclusions.excluded(optimizers.default_exclude, whole))


def worker_simulation(config, num_workers: int) -> worker_sim.WorkerSim | None:
  """The simulated workers of ``config`` (``config.workers``; its trace file read and checked),
  or None where they are all alike, always there, and ``config.aggregation`` is ``"sync"``
  (the published algorithm, with no simulator at all).

  Raises:
    ValueError: a method that takes no aggregator (a method that is its own optimizer), a
      per-step method with an aggregator other than ``aggregation.PER_STEP_RULES``, a method
      with one its ``aggregates`` does not list (where it lists them), or a trace file that
      cannot be read or has not one column per worker, naming the field.
  """
  w = config.workers
  if config.aggregation == "sync" and not (w.speed_spread or w.speed_trace or w.dropout_rate):
    return None
  method = check_method(config.method)
  per_step_rules = aggregation_lib.PER_STEP_RULES
  if method.per_step and config.aggregation not in per_step_rules:
    raise ValueError(f"config.aggregation={config.aggregation!r} with config.method="
                     f"{config.method!r}, a per-step method; allowed: {per_step_rules}")
  if not (method.aggregates or method.per_step):
    takes = [n for n in registry.names("local") if registry.get(n).aggregates]
    raise ValueError(f"config.aggregation={config.aggregation!r} with config.workers="
                     f"{w.to_dict()} needs a method that takes an aggregator; "
                     f"config.method={config.method!r} does not; allowed: {takes} or a per-step "
                     f"method with aggregation in {per_step_rules} (others: aggregation='sync' "
                     "and workers alike)")
  rules = method.aggregates if isinstance(method.aggregates, tuple) else None
  if rules is not None and config.aggregation not in rules:
    raise ValueError(f"config.aggregation={config.aggregation!r} with config.method="
                     f"{config.method!r}; allowed: {rules}")
  trace = worker_sim.read_trace(w.speed_trace, num_workers) if w.speed_trace else None
  return worker_sim.WorkerSim(num_workers, w.step_seconds, w.speed_spread, trace,
                              w.dropout_rate, w.rejoin_after, config.seed)


def aggregation(config, sim: worker_sim.WorkerSim | None,
                shapes) -> aggregation_lib.Aggregation | None:
  """``config.aggregation`` over the workers ``sim`` (:func:`worker_simulation`; None: no
  aggregator), a synchronisation's communication priced by the alpha-beta link model
  (:func:`compressors.step_time.kind_times`) on ``config.workers.link_gbit`` for a model of
  ``shapes``."""
  if sim is None:
    return None
  gbit = config.workers.link_gbit
  link = dataclasses.replace(topology_lib.ETHERNET_1G, bandwidth=gbit * 1e9 / 8,
                             name=f"{gbit:g} Gbit/s")
  own = settings(config)
  times = step_time.kind_times(config.method, shapes,
                               topology_lib.Topology.flat(sim.workers, link), sim.step_seconds,
                               own, exchange_settings=exchange_settings(config),
                               kinds=step_kinds(config))
  method = registry.get(config.method)
  every = 1 if method.per_step else method.sends_every(own)  # a per-step method: every step
  return aggregation_lib.Aggregation(
      config.aggregation, sim, every, config.quorum.deadline, config.quorum.deviations,
      max(t.exposed for t in times.values()), config.quorum.stale_weight)


def make_chain(config, learning_rate: optax.ScalarOrSchedule, axis_name: str = AXIS_NAME,
               param_layout: fsdp.ParamLayout | None = None,
               aggregator: aggregation_lib.Aggregation | None = None
               ) -> optax.GradientTransformationExtraArgs:
  """The per-worker training transformation of ``config`` (:func:`compressors.registry.training`
  with ``optimizer(config)``): run its ``update`` per worker inside ``shard_map`` over
  ``axis_name``; its output is identical on every worker (a local-update method's between
  synchronisations excepted). With islands, ``param_layout`` is the parameters' layout over the
  fast axis, on whose shards the optimizer runs (:func:`optimizer`); ``aggregator``, a
  local-update method's aggregator and simulated workers (:func:`aggregation`).

  Raises:
    ValueError, TypeError: settings the method refuses, prefixed with the config block.
  """
  own = settings(config)
  return _in_config(config, own, lambda: registry.training(
      config.method, own, optimizer=optimizer(config, learning_rate, param_layout),
      learning_rate=learning_rate, axis_name=axis_name, common=common(config),
      exchange_settings=exchange_settings(config), aggregation=aggregator))


def per_worker_params(config) -> bool:
  """Whether ``config.method``'s parameters differ between workers between synchronisations."""
  return check_method(config.method).per_worker_params
