"""One run of the language-model tables (T1-LM, F4-LM, F5, F6-LM, F7-LM) at an equal-bytes tier.

  python -m experiments.run --config=configs/paper/lm.py:tier=cpu,method=tasc,ratio=100 \
      --workdir=runs/paper/lm_cpu/tasc_100x_s0

The workload is ``configs/lm_stdlib.py`` (the standard library's source, a pre-LN decoder,
AdamW with cosine decay): every method trains with that one recipe, chosen on dense, for the
same number of steps; nothing is selected by a validation result.

Tiers (``tier``):

* ``cpu``: ``lm_stdlib``'s ``micro`` model (0.24M parameters, vocabulary 2,048), sequences of 64
  tokens, batch 64 (4,096 tokens a step: 8 sequences per worker), 1,000 steps (4.1M tokens, about
  17 per parameter, where a compute-optimal dense run stops; 1.2 passes over the training
  tokens), 8 simulated CPU devices. 2,000 steps of the 1.07M-parameter ``tiny`` model did not fit
  a grid with a tuning budget on 2 cores; ``configs/paper/t1_lm.py`` sizes the grid.
* ``gpu``: ``lm_stdlib``'s ``base`` model (29.5M parameters, vocabulary 8,192, bfloat16 matrix
  products), sequences of 256, batch 64 (16,384 tokens a step), 1,000 steps (16.4M tokens, 0.72
  passes over the 22.9M training tokens of ``lm_stdlib``'s ``pypi`` corpus, the source of 15
  pinned PyPI packages: the standard library's 4M, seen 4 times, overfit after about 700 steps),
  ``workers`` (8 or 32) workers simulated on one GPU; sized for about 12 minutes of one GPU. Its
  archives are fetched once (``python -m experiments.data.pypi_corpus --cache_dir=DIR``) and
  carried to a machine without the network (``corpus_dir=DIR``).

Solo (``solo=True``, dense only): one worker alone on its share of each step's batch (8 of the 64
sequences), the same steps, recipe and tuning: the loss with no communication, against which
the tables count a row's retention. Length (``steps_scale``, one of :data:`STEPS_SCALES`): the
tier's steps times it, the same tokens a step, warm-up and decay stretched (F7-LM).

Equal bytes (``ratio``): the config records the request (``config.equal_bytes``: ``ratio``,
``workers``); when the run starts, :func:`experiments.methods.fill_equal_bytes` gives a method
with a budget (top-k, random-k, DGC: density; PowerSGD: rank; TASC: density at its block size)
the setting whose bytes per step land nearest dense's over ``ratio`` at ``workers`` workers
(:func:`compressors.equal_bytes.solve`, from the cost model that ``tests/test_equal_bytes.py``
checks against the compiled HLO); dense, fp16 and onebit send fixed bytes and ignore it. TASC sends float16 on the wire (scores and payload), which halves the bytes
of the block scores, refreshes its Hutchinson curvature every 10 steps (one probe, on each
worker's own batch: compute, no bytes) and, unless ``block`` is given, takes the block size the
solver picks (the smallest whose scores take at most a quarter of the bytes). DGC runs without
its density warm-up (its compiled switch would be charged at the warm-up's density).

Local updates and the optimizer's place: ``method=diloco`` (or ``sparseloco``) trains each worker
with the recipe's AdamW for ``every`` steps and exchanges the pseudo-gradient through its
``carrier`` (a per-step method: ``dense``, ``int8``, ``topk``, ``tasc``, ...); at a tier, a
carrier whose bytes are fixed gets the ``every`` that meets it, one with a budget keeps
``every`` and is solved at ``ratio / every`` (``compressors/equal_bytes.py``). ``exchanged=update``
runs a per-step method after each worker's own AdamW (``chain(adamw, exchange)``) instead of
before one AdamW of the mean (``gradient``).

Arguments (``key=value`` joined by commas): ``tier`` (cpu/gpu), ``method`` (dense, fp16, onebit,
topk, randomk, dgc, powersgd, tasc, or any registered method), ``ratio`` (the tier, > 1),
``workers``, ``score`` (tasc: saliency/newton), ``sensitivity`` (tasc: hutchinson/fisher/none),
``block`` (tasc; 0: the solver's), ``support`` (tasc: global/previous), ``carrier`` (formerly
``exchange``, still read with a notice) and ``every`` (local updates; '' and 0: the method's
defaults), ``outer_momentum`` (local updates' outer Nesterov momentum; -1: the method's
default), ``exchanged`` (gradient/update),
``lr_scale`` (the tuning knob, a multiple of the method's own rate: the recipe's AdamW rate, or a
local-update method's outer rate; 1: as configured), ``seed``, ``cache`` (the tokenizer's cache
folder; '' for the default), ``solo``, ``steps_scale``, ``corpus_dir`` (the GPU tier's corpus
cache folder, holding ``archives/``; '' for the default); the scaling grid's (S1-LM,
``configs/paper/s1_lm.py``; 0: the tier's): ``width``, ``layers``, ``heads`` (the model's
shape), ``steps`` (the run's length, in place of ``steps_scale``; evaluations every tenth, a
checkpoint at half), ``per_worker_batch`` (sequences per worker a step; solo runs one worker's)
``tile`` (DeMo's DCT tile side, where its default's whole coefficients miss the ratio) and
``freeze_fraction`` (1-bit Adam's dense warm-up, DeepSpeed's ``freeze_step``, as a fraction of
the run's steps, as the paper sets it; 0: the method's default of 100 steps);
for workers that are slow, late or gone (A1-LM): ``aggregation`` (``config.aggregation``; '':
sync with no simulator, as published), ``speed_spread`` and ``dropout_rate`` (``config.workers``).
"""

import warnings

import ml_collections

from compressors import registry
from configs import common
from configs import lm_stdlib

# tier -> (lm_stdlib tier, overrides of its sizes and length)
HARDWARE_TIERS = {
    "cpu": ("micro", dict(seq_len=64, batch_size=64, num_steps=1000, eval_every=100)),
    # The PyPI corpus (22.9M training tokens; the standard library's 4M, seen 4 times, overfit).
    "gpu": ("base", dict(seq_len=256, batch_size=64, num_steps=1000, eval_every=100,
                         corpus="pypi")),
}
# Settings every run of a method gets besides its budget.
METHOD_SETTINGS = {
    "tasc": dict(wire_dtype="float16", hessian_every=10, num_probes=1),
}
# Run lengths of the horizon (F7-LM): multiples of the tier's steps, tokens a step unchanged.
STEPS_SCALES = (1, 4, 16)
ERROR_FEEDBACK = ("topk", "randomk")  # the "top-k with error feedback"; DGC has its own
# The model's shape and the run's length and batch (0: the tier's), the scaling grid's knobs.
SHAPE_ARGS = ("width", "layers", "heads", "steps", "per_worker_batch", "tile")


def method_block(method: str, **tasc_options) -> dict:
  """The fields of ``config.compression.<method>`` every run of the method sets besides its
  budget (TASC's ``tasc_options`` too, those given: a 0 or '' keeps TASC's default)."""
  block = dict(METHOD_SETTINGS.get(method, {}))
  if method == "tasc":
    block.update({k: v for k, v in tasc_options.items() if v})
  return block


def scale_tuned_rate(c: ml_collections.ConfigDict, scale: float) -> None:
  """Multiplies the rate the tuning budget searches over by ``scale``: a local-update method's
  outer learning rate (its inner AdamW keeps the recipe's), every other method's AdamW (or own
  optimizer's) peak rate."""
  # A family comparison: the sweep's rate is DiLoCo's outer one, a setting of that family alone.
  if registry.get(c.method).family == "local":
    c.compression[c.method].outer_learning_rate = (
        c.compression[c.method].outer_learning_rate * scale)
  else:
    c.optimizer.learning_rate *= scale


def _set_shape(c: ml_collections.ConfigDict, args: dict) -> None:
  """The model's width, layers and heads where given (0: the tier's), for the scaling grid
  (``configs/paper/s1_lm.py``)."""
  for key, field in (("width", "hidden"), ("layers", "num_layers"), ("heads", "num_heads")):
    if args[key]:
      c.model[field] = args[key]
  if c.model.hidden % c.model.num_heads:
    raise ValueError(f"configs/paper/lm.py: width={c.model.hidden} with heads="
                     f"{c.model.num_heads}; allowed: heads dividing the width")


def _check_args(args: dict) -> None:
  """Every argument's rule (one line naming it and what is allowed), before anything is built;
  the scaling grid's (:data:`SHAPE_ARGS`) none negative, ``steps`` not with ``steps_scale``,
  ``tile`` with DeMo alone, ``freeze_fraction`` with 1-bit Adam alone and below 1."""
  if args["tier"] not in HARDWARE_TIERS:
    raise ValueError(f"configs/paper/lm.py: tier={args['tier']!r}; allowed: "
                     f"{sorted(HARDWARE_TIERS)}")
  if args["method"] not in registry.names():
    raise ValueError(f"configs/paper/lm.py: method={args['method']!r}; allowed: "
                     f"{list(registry.names())}")
  if not args["ratio"] > 1:
    raise ValueError(f"configs/paper/lm.py: ratio={args['ratio']!r}; allowed: > 1")
  if not args["lr_scale"] > 0:
    raise ValueError(f"configs/paper/lm.py: lr_scale={args['lr_scale']!r}; allowed: > 0")
  if args["workers"] < 2:
    raise ValueError(f"configs/paper/lm.py: workers={args['workers']}; allowed: >= 2")
  if args["solo"] and args["method"] != "dense":
    raise ValueError(f"configs/paper/lm.py: solo=True with method={args['method']!r}; allowed: "
                     "method=dense (one worker alone communicates nothing)")
  if args["steps_scale"] not in STEPS_SCALES:
    raise ValueError(f"configs/paper/lm.py: steps_scale={args['steps_scale']!r}; allowed: one "
                     f"of {STEPS_SCALES}")
  if args["tile"] and args["method"] != "demo":
    raise ValueError(f"configs/paper/lm.py: tile={args['tile']} with method={args['method']!r}; "
                     "allowed: method=demo (its DCT tile's side)")
  if args["freeze_fraction"] and args["method"] != "onebit_adam":
    raise ValueError(f"configs/paper/lm.py: freeze_fraction={args['freeze_fraction']} with "
                     f"method={args['method']!r}; allowed: method=onebit_adam (its dense "
                     "warm-up)")
  if not 0 <= args["freeze_fraction"] < 1:
    raise ValueError(f"configs/paper/lm.py: freeze_fraction={args['freeze_fraction']!r}; "
                     "allowed: 0 <= freeze_fraction < 1 (0: the method's default)")
  for key in SHAPE_ARGS:
    if args[key] < 0:
      raise ValueError(f"configs/paper/lm.py: {key}={args[key]}; allowed: >= 0 (0: the tier's)")
  if args["steps"] and args["steps_scale"] != 1:
    raise ValueError(f"configs/paper/lm.py: steps={args['steps']} with steps_scale="
                     f"{args['steps_scale']}; allowed: one of them")


def _read_old_names(args: dict) -> None:
  """``exchange=`` (the carrier's name before it was ``carrier``) read as ``carrier=``, with a
  notice."""
  if args["exchange"]:
    warnings.warn(f"configs/paper/lm.py: exchange={args['exchange']} is now "
                  f"carrier={args['exchange']}", FutureWarning, stacklevel=3)
    args["carrier"] = args["carrier"] or args["exchange"]


def get_config(arg=None):
  args = common.parse_args(arg, tier="cpu", method="dense", ratio=100.0, workers=8,
                           score="saliency", sensitivity="hutchinson", block=0,
                           support="global", carrier="", exchange="", every=0,
                           outer_momentum=-1.0, exchanged="gradient", lr_scale=1.0, seed=0,
                           cache="", solo=False, steps_scale=1, corpus_dir="",
                           width=0, layers=0, heads=0, steps=0, per_worker_batch=0,
                           tile=0, freeze_fraction=0.0, aggregation="", speed_spread=0.0,
                           dropout_rate=0.0)
  _read_old_names(args)
  _check_args(args)
  name, sizes = HARDWARE_TIERS[args["tier"]]
  # Solo: one of the run's workers training alone on its share of each step's batch, the loss a
  # run reaches with no communication at all (retention's zero).
  workers = 1 if args["solo"] else args["workers"]
  num_steps = args["steps"] or sizes["num_steps"] * args["steps_scale"]
  c = lm_stdlib.get_config(f"{name},method={args['method']},steps={num_steps},"
                           f"workers={workers},seed={args['seed']},"
                           f"corpus={sizes.get('corpus', 'stdlib')}"
                           + (f",corpus_dir={args['corpus_dir']}" if args["corpus_dir"] else "")
                           + (f",cache={args['cache']}" if args["cache"] else ""))
  c.data.seq_len = sizes["seq_len"]
  share = args["per_worker_batch"] or sizes["batch_size"] // args["workers"]
  c.batch_size = share if args["solo"] else share * args["workers"]
  _set_shape(c, args)
  # A longer run evaluates as often relative to its length; its schedule stretches with it
  # (lm_stdlib's warm-up and decay are fractions of num_steps).
  c.eval_every = (max(1, num_steps // 10) if args["steps"]
                  else sizes["eval_every"] * args["steps_scale"])
  # At half a short run and every 500 steps of a long one: a horizon run (16,000 steps) or the
  # scaling grid's largest size (5,194) may span sessions, and a killed run resumes from its last.
  c.checkpoint_every = max(1, min(500, num_steps // 2))
  tasc_options = dict(score=args["score"], sensitivity=args["sensitivity"],
                      block_size=args["block"], support=args["support"])
  c.compression[args["method"]].update(method_block(args["method"], **tasc_options))
  # A family comparison: the row's every and carrier are local-update settings alone.
  if registry.get(args["method"]).family == "local":
    block = c.compression[args["method"]]
    block.update({k: args[k] for k in ("carrier", "every") if args[k]})
    if args["outer_momentum"] >= 0:
      block.outer_momentum = args["outer_momentum"]
    c.compression[block.carrier].update(method_block(block.carrier, **tasc_options))
  c.compression.exchanged = args["exchanged"]
  if args["tile"]:
    c.compression.demo.chunk = args["tile"]
  if args["freeze_fraction"]:
    c.compression.onebit_adam.freeze_step = registry.get("onebit_adam").settings.freeze_step_for(
        args["freeze_fraction"], num_steps)
  scale_tuned_rate(c, args["lr_scale"])
  # The request, as data: experiments.methods.fill_equal_bytes solves the method's budget when
  # the run starts (it traces the model, which a config does not).
  c.equal_bytes = ml_collections.ConfigDict(dict(ratio=args["ratio"], workers=args["workers"]))
  if args["method"] in ERROR_FEEDBACK:
    c.compression.error_feedback = True
  set_workers(c, args)
  return c


def set_workers(c: ml_collections.ConfigDict, args: dict) -> None:
  """The simulated workers and the aggregator of ``args`` (an argument left at its default sets
  nothing: the run's config is as before the arguments existed); ``config.check`` checks the
  values when the run starts."""
  if args["aggregation"]:
    c.aggregation = args["aggregation"]
  if args["speed_spread"]:
    c.workers.speed_spread = args["speed_spread"]
  if args["dropout_rate"]:
    c.workers.dropout_rate = args["dropout_rate"]
