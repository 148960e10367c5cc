"""Defaults shared by every experiment config; each config file starts from :func:`base`.

Fields (all overridable on the command line, e.g. ``--config.batch_size=256``):

  dataset, data_dir, data         which data (see experiments/data), where, and its options
  model                           ``name`` plus the model's fields (see experiments/models)
  method, compression             gradient exchange: ``method`` names a method of
                                  compressors.registry; ``compression`` holds the settings all
                                  methods share (error_feedback, fuse, seed,
                                  momentum_correction, clip_norm, exchanged, error_decay,
                                  density_warmup_*: compressors.registry.Common) and one block
                                  per method with its own (``compression.topk.density``,
                                  ``compression.tasc.*``, ``compression.diloco.every``)
  optimizer, schedule             the optimizer (after a per-step exchange, or before it with
                                  ``compression.exchanged="update"``; a local-update method's
                                  inner optimizer), learning-rate schedule (its warmup in
                                  epochs or, ``warmup_steps``, in steps)
  batch_size, eval_batch_size     global batch sizes (divisible by the number of workers)
  num_steps | num_epochs          training length (exactly one > 0)
  log_every, eval_every, checkpoint_every, keep_checkpoints   in steps (0 = only at the end)
  num_devices                     devices in the mesh (all processes together); on CPU the
                                  runner makes the host platform expose this many; None = all;
                                  on an accelerator with fewer, the rest are simulated
  workers_per_device              workers simulated on each device (jax.vmap), each with its
                                  own batch shard and compressor state as if it were a device;
                                  the bytes are those of one worker per device
  mesh.islands, mesh.fsdp         islands: with fsdp > 1 the devices form islands x fsdp
                                  (product num_devices; islands None = num_devices / fsdp):
                                  parameters, gradients and optimizer state are sharded over
                                  the fast fsdp axis inside each island (ZeRO-3), the method
                                  runs across the slow islands axis on each shard; fsdp = 1
                                  (default): every device its own island, the 1-D mesh "data"
  max_state_bytes_per_device      the memory budget of one device for the parameters, the
                                  optimizer and the model state as laid out (0 = none): a run
                                  that would hold more is refused before anything is allocated
  distributed                     jax.distributed settings (None = from the environment), the
                                  heartbeat timeout after which a dead process stops the job,
                                  and join_timeout_seconds: how long a process waits for the
                                  others to join before it names the missing ones and exits 1
  skip_nonfinite                  skip, on every device at once, a step whose gradient is not
                                  finite on any device (compressors.skip_nonfinite)
  max_skipped_fraction            a run that skipped more than this fraction of its steps, or
                                  whose final train or test loss is not finite, counts as
                                  diverged: results.json says why and the runner exits 1
  check_replicas_every            steps between checks that every device holds bit-identical
                                  parameters (0 = never; with local updates, any > 0 checks
                                  after every synchronisation); a mismatch stops the run
  stall_timeout_seconds           a training step (or its batch) not completed in this time,
                                  its compilation apart, stops the run with a line naming the
                                  step and what it waits for, exit status 1 (0 = never; may
                                  change when a run resumes)
  resume_on_other_data            resume although the data's hashes (corpus, tokenizer, files)
                                  differ from those the checkpoints record; without it such a
                                  resume is refused (may change when a run resumes)
  aggregation                     how a local-update method's synchronisation merges the
                                  workers (compressors.aggregation): sync (all of them, as
                                  published), quorum (those within a deadline, token-weighted),
                                  async (Async Local-SGD: Delayed Nesterov, per-worker step
                                  counts), naive_async (each arrival applied as it is), eager
                                  (Kale et al.: the exchange overlapped, one's own fresh
                                  pseudo-gradient with the others' one round late), delayed
                                  (Kale et al.'s naive baseline: the exchange overlapped, the
                                  previous round's mean applied alone)
  quorum.deadline, .deviations    quorum's deadline in modelled seconds after a round began, or
                                  None: adaptive, the median arrival plus ``deviations`` median
                                  absolute deviations; for per-step methods (sync or quorum,
                                  every step a synchronisation), quorum.stale_weight: the
                                  weight of a gradient late for the deadline, sent with its
                                  worker's next one (0: dropped)
  workers.*                       simulated workers that differ (compressors.worker_sim), for
                                  the local-update methods: speed_spread (log-normal sigma of
                                  each worker's seconds per step), speed_trace (a file of
                                  per-worker step times, one column per worker), dropout_rate
                                  (the chance a worker misses a synchronisation), rejoin_after
                                  (steps it stays gone), step_seconds (modelled seconds of an
                                  inner step at speed 1) and link_gbit (the link the time model
                                  prices a synchronisation on, Gbit/s)
  seed

Every field's type and range is declared once: the fields here in :data:`RULES`, the compression
settings on their dataclasses' fields (``compressors.checks.setting``); :func:`check` checks a
config against them all, naming ``config.<field>=<value>`` and what is allowed.
"""

import dataclasses
import difflib
import typing

import ml_collections

from compressors import aggregation
from compressors import checks
from compressors import registry
import tasc  # registers the method "tasc": a config has a block per registered method

# A process silent this long counts as dead and the job stops; jax.distributed's default (100 s)
# leaves the survivors blocked in a collective for that long.
DEFAULT_HEARTBEAT_TIMEOUT_SECONDS = 20
# A job's processes are started together and join within seconds of importing JAX (about 10 s on
# a loaded 2-core machine): one that has not joined in 2 minutes is not coming. jax.distributed's
# own deadline, 5 minutes, ends the process silently until then.
DEFAULT_JOIN_TIMEOUT_SECONDS = 120
# The configs' steps take seconds on 2 CPU cores, compilation apart (which the watchdog does not
# count): 10 minutes leaves a machine 100 times slower its steps, and still names a step stuck in
# a collective within 10 minutes.
DEFAULT_STALL_TIMEOUT_SECONDS = 600


def settings_block(settings: type) -> ml_collections.ConfigDict:
  """A dataclass's fields and defaults as a typed ``ConfigDict`` (a None default keeps the type
  its annotation gives, so a command-line override is still checked)."""
  hints = typing.get_type_hints(settings)
  block = {}
  for field in dataclasses.fields(settings):
    kinds = [t for t in typing.get_args(hints[field.name]) if t is not type(None)]
    block[field.name] = (ml_collections.FieldReference(None, field_type=kinds[0])
                         if field.default is None else field.default)
  return ml_collections.ConfigDict(block)


def compression_block() -> ml_collections.ConfigDict:
  """``config.compression``: the settings every method shares (``registry.Common``) and one block
  per registered method, each from its settings' defaults."""
  block = settings_block(registry.Common)
  for name in registry.names():
    block[name] = settings_block(registry.get(name).settings)
  return block


_R = checks.Rule
AGGREGATIONS = aggregation.RULES
_DECAY_RATE = _R(float, low=0, high=1, high_open=True)
# What each field of base() allows (in its order): experiments.validation checks a run's config,
# and each sweep run's, against these before JAX starts; experiments.methods' factories check the
# blocks they read. Which names `dataset`, `model.name`, `method`, `optimizer.name` and
# `schedule.name` take is for what implements them to say (experiments.data, experiments.models,
# compressors.registry, experiments.methods); `data` and `model`'s other fields are checked by
# the dataset and the model that read them.
RULES = {
    "dataset": _R(str), "data_dir": _R(str), "method": _R(str),
    "optimizer.name": _R(str), "optimizer.learning_rate": _R(float, low=0),
    "optimizer.momentum": _DECAY_RATE, "optimizer.weight_decay": _R(float, low=0),
    "optimizer.b1": _DECAY_RATE, "optimizer.b2": _DECAY_RATE,
    "optimizer.eps": _R(float, low=0, low_open=True),
    "optimizer.trust_coefficient": _R(float, low=0, low_open=True),
    "schedule.name": _R(str), "schedule.warmup_epochs": _R(float, low=0),
    "schedule.warmup_steps": _R(int, low=0),
    # fractions of training at which the step schedule divides the rate by 10
    "schedule.boundaries": _R(float, low=0, high=1, each=True),
    "schedule.power": _R(float, low=0, low_open=True),
    "batch_size": _R(int, low=1), "eval_batch_size": _R(int, low=1),
    "num_steps": _R(int, low=0), "num_epochs": _R(float, low=0),
    "log_every": _R(int, low=0), "eval_every": _R(int, low=0),
    "checkpoint_every": _R(int, low=0), "keep_checkpoints": _R(int, low=1),
    "num_devices": _R(int, low=1, optional=True), "workers_per_device": _R(int, low=1),
    "mesh.islands": _R(int, low=1, optional=True), "mesh.fsdp": _R(int, low=1),
    "max_state_bytes_per_device": _R(int, low=0),
    "distributed.coordinator_address": _R(str, optional=True),
    "distributed.num_processes": _R(int, low=1, optional=True),
    "distributed.process_id": _R(int, low=0, optional=True),
    "distributed.heartbeat_timeout_seconds": _R(int, low=1),
    "distributed.join_timeout_seconds": _R(int, low=1),
    "skip_nonfinite": _R(bool), "max_skipped_fraction": _R(float, low=0, high=1),
    "check_replicas_every": _R(int, low=0), "stall_timeout_seconds": _R(int, low=0),
    "resume_on_other_data": _R(bool),
    "aggregation": _R(str, choices=AGGREGATIONS),
    "quorum.deadline": _R(float, low=0, low_open=True, optional=True),
    "quorum.deviations": _R(float, low=0),
    "quorum.stale_weight": _R(float, low=0, high=1),
    "workers.speed_spread": _R(float, low=0), "workers.speed_trace": _R(str),
    "workers.dropout_rate": _R(float, low=0, high=1, high_open=True),
    "workers.rejoin_after": _R(int, low=0),
    "workers.step_seconds": _R(float, low=0, low_open=True),
    "workers.link_gbit": _R(float, low=0, low_open=True),
    "seed": checks.SEED,
}


def upgraded(stored: dict) -> dict:
  """A config as a dict (a run's ``config.json``) with the old names of its methods' settings
  replaced by the new ones (``registry.Method.renamed``, each with a one-line notice), so that
  a config written before a rename compares equal to the same config written now."""
  compression = stored.get("compression")
  if not isinstance(compression, dict):
    return stored
  blocks = {name: registry.renamed_settings(name, block, f"config.compression.{name}")
            for name, block in compression.items()
            if isinstance(block, dict) and name in registry.names()}
  return {**stored, "compression": {**compression, **blocks}}


def rules() -> dict[str, checks.Rule]:
  """Every declared field's rule, by its path in the config: :data:`RULES`, the settings every
  method shares (``compression.<field>``, ``registry.Common``'s) and each registered method's own
  (``compression.<method>.<field>``)."""
  out = dict(RULES)
  out.update({f"compression.{field}": rule
              for field, rule in checks.rules_of(registry.Common).items()})
  for name in registry.names():
    out.update({f"compression.{name}.{field}": rule
                for field, rule in checks.rules_of(registry.get(name).settings).items()})
  return out


def check(config: ml_collections.ConfigDict, *blocks: str) -> None:
  """Checks ``config``'s fields (those under ``blocks``, e.g. ``"optimizer"``; none: all)
  against their declared rules (:func:`rules`); a field the config lacks is not checked.

  Raises:
    TypeError, ValueError: naming the first field that breaks its rule as
      ``config.<path>=<value>`` and what is allowed.
  """
  for path, rule in rules().items():
    if blocks and not any(path == b or path.startswith(b + ".") for b in blocks):
      continue
    value = config
    for key in path.split("."):
      if not isinstance(value, ml_collections.ConfigDict) or key not in value:
        break
      value = value[key]
    else:
      rule.check(value, f"config.{path}")


def base() -> ml_collections.ConfigDict:
  """Every field with its default; configs override what they need."""
  c = ml_collections.ConfigDict()
  c.dataset = ""
  c.data_dir = ""
  c.data = ml_collections.ConfigDict()
  c.model = ml_collections.ConfigDict({"name": ""})

  c.method = "dense"
  c.compression = compression_block()

  c.optimizer = ml_collections.ConfigDict(dict(
      name="momentum", learning_rate=0.1, momentum=0.9, weight_decay=0.0,
      b1=0.9, b2=0.999, eps=1e-6, trust_coefficient=0.001))
  c.schedule = ml_collections.ConfigDict(dict(
      name="constant", warmup_epochs=0.0, warmup_steps=0, boundaries=(0.5, 0.75), power=1.0))

  c.batch_size = 128
  c.eval_batch_size = 512
  c.num_steps = 0
  c.num_epochs = 0.0
  c.log_every = 50
  c.eval_every = 0
  c.checkpoint_every = 1000
  c.keep_checkpoints = 2
  c.num_devices = ml_collections.FieldReference(8, field_type=int)
  c.workers_per_device = 1
  c.mesh = ml_collections.ConfigDict(dict(
      islands=ml_collections.FieldReference(None, field_type=int), fsdp=1))
  c.max_state_bytes_per_device = 0
  c.distributed = ml_collections.ConfigDict(dict(
      coordinator_address=ml_collections.FieldReference(None, field_type=str),
      num_processes=ml_collections.FieldReference(None, field_type=int),
      process_id=ml_collections.FieldReference(None, field_type=int),
      heartbeat_timeout_seconds=DEFAULT_HEARTBEAT_TIMEOUT_SECONDS,
      join_timeout_seconds=DEFAULT_JOIN_TIMEOUT_SECONDS))
  c.skip_nonfinite = True
  c.max_skipped_fraction = 0.1
  c.check_replicas_every = 0
  c.stall_timeout_seconds = DEFAULT_STALL_TIMEOUT_SECONDS
  c.resume_on_other_data = False
  c.aggregation = "sync"
  c.quorum = ml_collections.ConfigDict(dict(
      deadline=ml_collections.FieldReference(None, field_type=float), deviations=1.0,
      stale_weight=0.0))
  c.workers = ml_collections.ConfigDict(dict(
      speed_spread=0.0, speed_trace="", dropout_rate=0.0, rejoin_after=0, step_seconds=1.0,
      link_gbit=1.0))
  c.seed = 0
  return c


def set_method_settings(c: ml_collections.ConfigDict, **values) -> None:
  """Sets those of ``values`` that ``c.method`` has among its settings
  (``c.compression.<method>``), e.g. a ``density`` for whichever sparsifier runs."""
  block = c.compression[c.method]
  block.update({k: v for k, v in values.items() if k in block})


def make_smoke(c: ml_collections.ConfigDict, *, batch_size: int | None = None,
               hessian_every: int = 1) -> None:
  """Turns ``c`` into its smoke variant (for tests): two steps, no warmup, logged,
  checkpointed and checked for replica drift after every step, evaluated once at the end.

  Args:
    c: the config to change in place (its model and data should be made tiny by the caller).
    batch_size: global training and evaluation batch size, if it must change.
    hessian_every: TASC's curvature refresh period (1 compiles only the refreshing step; 2
      both).
  """
  c.num_epochs = 0.0
  c.num_steps = 2
  c.schedule.warmup_epochs = 0.0
  c.log_every = 1
  c.eval_every = 0
  c.checkpoint_every = 1
  c.check_replicas_every = 1
  c.compression.tasc.hessian_every = hessian_every
  if batch_size:
    c.batch_size = c.eval_batch_size = batch_size


def parse_args(arg: str | None, **defaults) -> dict:
  """Parses a config argument ``"key=value,key=value"`` (a bare word sets ``variant``).

  Args:
    arg: the text after ``:`` in ``--config=file.py:arg``, or None.
    **defaults: the allowed keys and their defaults; values are parsed to the default's type
      (``smoke`` is a bool that a bare ``smoke`` sets).

  Returns:
    The defaults updated from ``arg``.

  Raises:
    ValueError: a key that is not allowed (the message suggests the nearest key), a bare word
      where the config has no variants, or a value of the wrong form; each names the part of
      ``arg`` and what is allowed.
  """
  out = dict(defaults)
  for part in filter(None, (arg or "").split(",")):
    key, sep, value = part.partition("=")
    if not sep:
      key, value = ("smoke", "true") if part == "smoke" else ("variant", part)
    if key not in defaults:
      nearest = difflib.get_close_matches(part.partition("=")[0], defaults, n=1)
      hint = f" (did you mean {nearest[0]!r}?)" if nearest else ""
      what = f"unknown key {key!r}" if sep else "not key=value, and the config has no variants"
      raise ValueError(f"config argument {part!r}: {what}{hint}; allowed keys: "
                       f"{sorted(defaults)}")
    kind = type(defaults[key])
    if kind is bool:
      if value.lower() not in ("true", "false", "1", "0"):
        raise ValueError(f"config argument {part!r}: {key}={value!r} is not allowed; {key} "
                         "must be true or false (or 1 or 0)")
      out[key] = value.lower() in ("true", "1")
    else:
      try:
        out[key] = kind(value)
      except ValueError:
        raise ValueError(f"config argument {part!r}: {key}={value!r} is not allowed; allowed: "
                         f"{'an' if kind is int else 'a'} {kind.__name__} (default "
                         f"{defaults[key]!r})") from None
  return out
