"""One run of the language-model tables (T1-LM, F4-LM, F5) at an equal-bytes tier.

  python -m experiments.run --config=configs/paper/lm.py:tier=cpu,method=tasc,ratio=100 \
      --workdir=runs/paper/lm_cpu/tasc_100x_s0

The workload is ``configs/lm_stdlib.py`` (the standard library's source, a pre-LN decoder,
AdamW with cosine decay): every method trains with that one recipe, chosen on dense, for the
same number of steps; nothing is selected by a validation result.

Tiers (``tier``):

* ``cpu``: ``lm_stdlib``'s ``tiny`` model (1.07M parameters, vocabulary 2,048), sequences of 64
  tokens, batch 32 (2,048 tokens a step), 1,000 steps (2.0M tokens, 0.6 passes over the training
  tokens), 8 simulated CPU devices: long enough for the compressed methods to leave the unigram
  plateau (``paper_figures/t1_lm.md`` has the curves). ``configs/paper/t1_lm.py`` sizes the grid
  to fit 90 minutes on 2 cores.
* ``gpu``: ``lm_stdlib``'s ``base`` model (29.5M parameters, vocabulary 8,192), sequences of 256,
  batch 256 (65,536 tokens a step), 300 steps, ``workers`` (8 or 32) workers simulated on one
  GPU; its step count is sized for a short GPU lease.

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
with the recipe's AdamW for ``every`` steps and exchanges the pseudo-gradient through
``exchange`` (a per-step method: ``dense``, ``int8``, ``topk``, ``tasc``, ...); at a tier, an
exchange whose bytes are fixed gets the ``every`` that meets it, one with a budget keeps
``every`` and is solved at ``ratio / every`` (``compressors/equal_bytes.py``). ``exchanged=update``
runs a per-step method after each worker's own AdamW (``chain(adamw, exchange)``) instead of
before one AdamW of the mean (``gradient``).

Arguments (``key=value`` joined by commas): ``tier`` (cpu/gpu), ``method`` (dense, fp16, onebit,
topk, randomk, dgc, powersgd, tasc, or any registered method), ``ratio`` (the tier, > 1),
``workers``, ``score`` (tasc: saliency/newton), ``sensitivity`` (tasc: hutchinson/fisher/none),
``block`` (tasc; 0: the solver's), ``support`` (tasc: global/previous), ``exchange`` and
``every`` (local updates; '' and 0: the method's defaults), ``exchanged`` (gradient/update),
``seed``, ``cache`` (the tokenizer's cache folder; '' for the default).
"""

import ml_collections

from compressors import registry
from configs import common
from configs import lm_stdlib

# tier -> (lm_stdlib tier, overrides of its sizes and length)
TIERS = {
    "cpu": ("tiny", dict(seq_len=64, batch_size=32, num_steps=1000, eval_every=100)),
    "gpu": ("base", dict(seq_len=256, batch_size=256, num_steps=300, eval_every=50)),
}
# Settings every run of a method gets besides its budget.
METHOD_SETTINGS = {
    "tasc": dict(wire_dtype="float16", hessian_every=10, num_probes=1),
}
ERROR_FEEDBACK = ("topk", "randomk")  # the "top-k with error feedback"; DGC has its own


def method_block(method: str, **tasc_options) -> dict:
  """The fields of ``config.compression.<method>`` every run of the method sets besides its
  budget (TASC's ``tasc_options`` too, those given: a 0 or '' keeps TASC's default)."""
  block = dict(METHOD_SETTINGS.get(method, {}))
  if method == "tasc":
    block.update({k: v for k, v in tasc_options.items() if v})
  return block


def get_config(arg=None):
  args = common.parse_args(arg, tier="cpu", method="dense", ratio=100.0, workers=8,
                           score="saliency", sensitivity="hutchinson", block=0,
                           support="global", exchange="", every=0, exchanged="gradient", seed=0,
                           cache="")
  if args["tier"] not in TIERS:
    raise ValueError(f"configs/paper/lm.py: tier={args['tier']!r}; allowed: {sorted(TIERS)}")
  if args["method"] not in registry.names():
    raise ValueError(f"configs/paper/lm.py: method={args['method']!r}; allowed: "
                     f"{list(registry.names())}")
  if not args["ratio"] > 1:
    raise ValueError(f"configs/paper/lm.py: ratio={args['ratio']!r}; allowed: > 1")
  if args["workers"] < 2:
    raise ValueError(f"configs/paper/lm.py: workers={args['workers']}; allowed: >= 2")
  name, sizes = TIERS[args["tier"]]
  c = lm_stdlib.get_config(f"{name},method={args['method']},steps={sizes['num_steps']},"
                           f"workers={args['workers']},seed={args['seed']}"
                           + (f",cache={args['cache']}" if args["cache"] else ""))
  c.data.seq_len = sizes["seq_len"]
  c.batch_size = sizes["batch_size"]
  c.eval_every = sizes["eval_every"]
  c.checkpoint_every = c.num_steps // 2
  tasc_options = dict(score=args["score"], sensitivity=args["sensitivity"],
                      block_size=args["block"], support=args["support"])
  c.compression[args["method"]].update(method_block(args["method"], **tasc_options))
  if registry.get(args["method"]).family == "local":
    block = c.compression[args["method"]]
    block.update({k: args[k] for k in ("exchange", "every") if args[k]})
    c.compression[block.exchange].update(method_block(block.exchange, **tasc_options))
  c.compression.exchanged = args["exchanged"]
  # The request, as data: experiments.methods.fill_equal_bytes solves the method's budget when
  # the run starts (it traces the model, which a config does not).
  c.equal_bytes = ml_collections.ConfigDict(dict(ratio=args["ratio"], workers=args["workers"]))
  if args["method"] in ERROR_FEEDBACK:
    c.compression.error_feedback = True
  return c
