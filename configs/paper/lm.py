"""One run of the language-model tables (T1-LM, F4-LM, F5) at an equal-bytes tier.

  python -m experiments.run --config=configs/paper/lm.py:tier=cpu,method=tasc,ratio=100 \
      --workdir=runs/paper/lm_cpu/tasc_100x_s0

The workload is ``configs/lm_stdlib.py`` (the standard library's source, a pre-LN decoder,
AdamW with cosine decay): every method trains with that one recipe, chosen on dense, for the
same number of steps; nothing is selected by a validation result.

Tiers (``tier``):

* ``cpu``: ``lm_stdlib``'s ``tiny`` model (1.07M parameters, vocabulary 2,048), sequences of 64
  tokens, batch 32 (2,048 tokens a step), 1,000 steps (2.0M tokens, 0.6 passes over the training
  tokens), 8 simulated CPU devices. At 200 steps every compressed method was still on the unigram
  plateau that dense was leaving, so the table measured only how soon each escapes it; 1,000
  steps take top-k and TASC at 100x off it. ``configs/paper/t1_lm.py`` sizes the grid to fit the
  issue's 90 minutes on 2 cores.
* ``gpu``: ``lm_stdlib``'s ``base`` model (29.5M parameters, vocabulary 8,192), sequences of 256,
  batch 256 (65,536 tokens a step), 300 steps, ``workers`` (8 or 32) workers simulated on one
  GPU. Not run here (no GPU); its step count is an estimate for the issue's 20 minutes.

Equal bytes (``ratio``): a method with a budget (top-k, random-k, DGC: density; PowerSGD: rank;
TASC: density at its block size) gets the setting whose bytes per step land nearest dense's over
``ratio`` at ``workers`` workers (:func:`compressors.equal_bytes.solve`, from the cost model that
``tests/test_equal_bytes.py`` checks against the compiled HLO); dense, fp16 and onebit send fixed
bytes and ignore it. TASC sends float16 on the wire (scores and payload), which halves the bytes
of the block scores, refreshes its Hutchinson curvature every 10 steps (one probe, on each
worker's own batch: compute, no bytes) and, unless ``block`` is given, takes the block size the
solver picks (the smallest whose scores take at most a quarter of the bytes). DGC runs without
its density warm-up (its compiled switch would be charged at the warm-up's density).

Arguments (``key=value`` joined by commas): ``tier`` (cpu/gpu), ``method`` (dense, fp16, onebit,
topk, randomk, dgc, powersgd, tasc, or any registered method), ``ratio`` (the tier, > 1),
``workers``, ``score`` (tasc: saliency/newton), ``sensitivity`` (tasc: hutchinson/fisher/none),
``block`` (tasc; 0: the solver's), ``support`` (tasc: global/previous), ``seed``, ``cache`` (the
tokenizer's cache folder; '' for the default).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp

from compressors import equal_bytes
from compressors import registry
from configs import common
from configs import lm_stdlib
from experiments import models

# tier -> (lm_stdlib tier, overrides of its sizes and length)
TIERS = {
    "cpu": ("tiny", dict(seq_len=64, batch_size=32, num_steps=1000, eval_every=100)),
    "gpu": ("base", dict(seq_len=256, batch_size=256, num_steps=300, eval_every=50)),
}
# Settings every run of a method gets besides its budget.
METHOD_SETTINGS = {
    "dgc": dict(warmup_steps=0),
    "tasc": dict(wire_dtype="float16", hessian_every=10, num_probes=1),
}
ERROR_FEEDBACK = ("topk", "randomk")  # the "top-k with error feedback"; DGC has its own


@functools.cache
def parameter_shapes(tier: str) -> tuple[tuple[int, ...], ...]:
  """The shapes of the tier's model's parameters (traced with ``jax.eval_shape``: nothing is
  allocated or run)."""
  name, sizes = TIERS[tier]
  spec = lm_stdlib.TIERS[name]
  model = models.build_model(dict(name="decoder_lm", **spec["model"]),
                             vocab_size=spec["vocab_size"])
  # Abstract inputs only: a concrete array would start JAX's backend before the runner has set
  # the number of CPU devices.
  variables = jax.eval_shape(model.init, jax.ShapeDtypeStruct((2,), jnp.uint32),
                             jax.ShapeDtypeStruct((1, sizes["seq_len"]), jnp.int32))
  return tuple(x.shape for x in jax.tree.leaves(variables["params"]))


def method_settings(tier: str, method: str, ratio: float, workers: int, **tasc_options):
  """``(settings, solution)``: the method's settings at the tier (``solution`` is the
  :class:`compressors.equal_bytes.Solution`, None for a method without a budget)."""
  extra = {**METHOD_SETTINGS.get(method, {}),
           **({k: v for k, v in tasc_options.items() if v} if method == "tasc" else {})}
  settings = registry.default_settings(method, **extra)
  if registry.get(method).budget is None:
    return settings, None
  solution = equal_bytes.solve(method, parameter_shapes(tier), workers, ratio, settings)
  return solution.settings, solution


def get_config(arg=None):
  args = common.parse_args(arg, tier="cpu", method="dense", ratio=100.0, workers=8,
                           score="saliency", sensitivity="hutchinson", block=0,
                           support="global", seed=0, cache="")
  if args["tier"] not in TIERS:
    raise ValueError(f"configs/paper/lm.py: tier={args['tier']!r}; allowed: {sorted(TIERS)}")
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
  settings, _ = method_settings(
      args["tier"], args["method"], args["ratio"], args["workers"],
      score=args["score"], sensitivity=args["sensitivity"], block_size=args["block"],
      support=args["support"])
  c.compression[args["method"]].update(dataclasses.asdict(settings))
  if args["method"] in ERROR_FEEDBACK:
    c.compression.error_feedback = True
  return c
