"""B2, step overhead: a jitted data-parallel training step with each method, against dense.

Eight simulated CPU devices in one process (no network: the collectives are memory copies), the
runner's models (:mod:`experiments.models`: ResNet-20 on CIFAR-shaped random images, BERT-tiny
masked-LM on random tokens) and losses (:mod:`experiments.tasks`), and each method's
transformation as the runner builds it (:mod:`experiments.methods`) followed by SGD with
momentum 0.9. The step is the runner's: per-device gradients inside ``shard_map`` with respect
to ``lax.pcast(params, "data", to="varying")``, the method's ``update``, ``apply_updates``;
per-device batch-norm statistics; state donated. TASC's step is the common one, without a
curvature refresh (the trainer refreshes every ``hessian_every = 100`` steps).

The figure is each method's step time over dense's (``compress(dense())``: one f32 all-reduce),
measured in the same process with the steps called in alternation.
"""

import functools
import warnings
from collections.abc import Sequence

import jax
from jax.sharding import PartitionSpec as P
import ml_collections
import numpy as np
import optax

import compressors
from experiments import distributed
from experiments import methods as methods_lib
from experiments import models as models_lib
from experiments import tasks
from experiments.bench import common

NUM_DEVICES = 8
AXIS = "data"
GOAL_RATIO = 1.15
# name -> (model config, global batch, task): ResNet-20 at the paper's batch of 128; BERT-tiny
# (configs/bert.py:tiny) with 128-token sequences, 20 predictions each, 8 sequences per device.
MODELS = {
    "resnet20": (dict(name="cifar_resnet", depth=20, num_classes=10), 128, "classification"),
    "bert_tiny": (dict(name="bert", hidden=128, num_layers=2, num_heads=2, intermediate=512,
                       vocab_size=8000), 64, "masked_lm"),
}
SEQUENCE_LENGTH, PREDICTIONS = 128, 20
TIMEOUT_S = 3600.0  # default limit for one child process, seconds


def random_batch(model: str, batch_size: int, vocab_size: int):
  """A batch of random CIFAR images and labels, or random BERT tokens and masked positions."""
  rng = np.random.default_rng(0)
  if MODELS[model][2] == "classification":
    return {"input": rng.standard_normal((batch_size, 32, 32, 3), np.float32),
            "label": rng.integers(0, 10, batch_size).astype(np.int32)}
  vocab = vocab_size
  return {"input_ids": rng.integers(0, vocab, (batch_size, SEQUENCE_LENGTH)).astype(np.int32),
          "attention_mask": np.ones((batch_size, SEQUENCE_LENGTH), np.int32),
          "masked_positions": np.sort(rng.permuted(np.tile(np.arange(SEQUENCE_LENGTH),
                                                           (batch_size, 1)), axis=1)
                                      [:, :PREDICTIONS], axis=1).astype(np.int32),
          "masked_ids": rng.integers(0, vocab, (batch_size, PREDICTIONS)).astype(np.int32),
          "masked_weights": np.ones((batch_size, PREDICTIONS), np.float32)}


def measure(request: dict) -> dict:
  """Child process (8 devices): times every method's step on one model.

  Request: model, methods, repeats, batch_size (None: the model's default).
  """
  # The runner's CPU settings (single-threaded Eigen per simulated device), before JAX's first
  # computation.
  distributed.expose_cpu_devices(ml_collections.ConfigDict({
      "num_devices": NUM_DEVICES, "distributed": {"coordinator_address": None,
                                                  "num_processes": 1, "process_id": 0}}))
  warnings.filterwarnings("ignore", message="Some donated buffers were not usable")

  name = request["model"]
  model_config, default_batch, task_name = MODELS[name]
  model_config = dict(model_config, **request.get("model_overrides", {}))
  batch_size = request.get("batch_size") or default_batch
  from_data = ("num_classes", "vocab_size")  # fields the dataset sets in a run
  model = models_lib.build_model({k: v for k, v in model_config.items() if k not in from_data},
                             **{k: v for k, v in model_config.items() if k in from_data})
  task = tasks.TASKS[task_name]
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:NUM_DEVICES]), (AXIS,))
  batch = random_batch(name, batch_size, model_config.get("vocab_size", 0))
  per_device = {k: v.reshape((NUM_DEVICES, -1) + v.shape[1:]) for k, v in batch.items()}
  init_model = jax.jit(functools.partial(model.init, train=False))  # one compile, not one per op
  variables = dict(init_model(jax.random.PRNGKey(0),
                              *task.inputs({k: v[0] for k, v in per_device.items()})))
  params = variables.pop("params")
  model_state = jax.tree.map(lambda x: np.broadcast_to(x, (NUM_DEVICES,) + x.shape), variables)
  num_params = sum(x.size for x in jax.tree.leaves(params))

  def build(method):
    tx = methods_lib.make_chain(common.method_config(method), 0.1, AXIS)
    specs = (P(), P(AXIS), compressors.state_specs(tx, params, mesh, AXIS))

    def per_device_step(state, local_batch):
      params, model_state, opt_state = state
      local_batch = jax.tree.map(lambda x: x[0], local_batch)
      model_state = jax.tree.map(lambda x: x[0], model_state)

      def loss_fn(p):
        logits, new_model_state = (
            model.apply({"params": p, **model_state}, *task.inputs(local_batch), train=True,
                        mutable=list(model_state))
            if model_state else (model.apply({"params": p}, *task.inputs(local_batch),
                                             train=False), {}))
        return tasks.mean_loss(task.outcomes(logits, local_batch))[0], new_model_state

      grads, model_state = jax.grad(loss_fn, has_aux=True)(
          jax.lax.pcast(params, AXIS, to="varying"))
      updates, opt_state = tx.update(grads, compressors.drop_device_axis(opt_state, specs[2]),
                                     params)
      return (optax.apply_updates(params, updates),
              jax.tree.map(lambda x: x[None], model_state),
              compressors.add_device_axis(opt_state, specs[2]))

    step = jax.jit(jax.shard_map(per_device_step, mesh=mesh, in_specs=(specs, P(AXIS)),
                                 out_specs=specs), donate_argnums=0)
    init = jax.jit(jax.shard_map(lambda p: compressors.add_device_axis(tx.init(p), specs[2]),
                                 mesh=mesh, in_specs=P(), out_specs=specs[2]))
    fresh = jax.tree.map(jax.numpy.copy, params)  # each method's step donates its own copy
    return step, (fresh, model_state, init(fresh))

  steps, states = {}, {}
  for method in request["methods"]:
    steps[method], states[method] = build(method)

  def prepare(method):
    def call():
      states[method] = steps[method](states[method], per_device)
      return states[method]
    return lambda: call

  times = common.fastest_interleaved({m: prepare(m) for m in steps}, request["repeats"])
  dense = times["dense"]
  return {"model": name, "batch_size": batch_size, "params": num_params,
          "rows": [{"method": m, "seconds": t["wall"], "median_seconds": t["median_wall"],
                    "ratio": t["wall"] / dense["wall"], "cpu_ratio": t["cpu"] / dense["cpu"]}
                   for m, t in times.items()]}


def step_overhead(models: Sequence[str], methods: Sequence[str], *, repeats: int = 10,
                  batch_size: int | None = None, model_overrides: dict | None = None,
                  timeout_s: float = TIMEOUT_S, log=print) -> list[dict]:
  """Rows of B2: one per (model, method); ``ratio`` is the step time over dense's.

  Args:
    models: keys of :data:`MODELS`.
    methods: methods to time ("dense", the reference, is added when missing).
    repeats: timed steps per method.
    batch_size: global batch (None: each model's default).
    model_overrides: model -> fields replacing the model's (e.g. a smaller width for a test).
    timeout_s: limit for one model's child process.
    log: progress printer.
  """
  methods = ["dense"] + [m for m in common.check_methods(methods) if m != "dense"]
  rows = []
  for model in models:
    if model not in MODELS:
      raise ValueError(f"--models: {model!r} is not benchmarked; allowed: {sorted(MODELS)}")
    request = {"model": model, "methods": methods, "repeats": repeats, "batch_size": batch_size,
               "model_overrides": (model_overrides or {}).get(model, {})}
    result = common.run_child(__name__, request, env=common.cpu_env(1), timeout_s=timeout_s)
    if common.not_measured(result):
      rows += [{"model": model, "method": m, "ratio": common.not_measured(result)}
               for m in methods]
      continue
    for r in result["rows"]:
      r.update(model=model, batch_size=result["batch_size"], params=result["params"])
      if r["method"] == "tasc":
        r["goal"] = common.goal(r["ratio"] <= GOAL_RATIO, f"<= {GOAL_RATIO}x dense")
      log(f"B2 {model:9s} {r['method']:10s} ratio {r['ratio']:.3f} "
          f"({r['seconds'] * 1e3:.0f} ms)")
      rows.append(r)
  return rows


def report(args) -> common.Report:
  """B2 as a :class:`experiments.bench.common.Report`."""
  models = args.models or list(MODELS)
  methods = args.methods or common.all_methods()
  rows = step_overhead(models, methods, repeats=args.repeats,
                       timeout_s=args.timeout or TIMEOUT_S)
  return common.Report(
      name="step",
      title=f"B2: training-step time with each method / dense ({NUM_DEVICES} simulated devices)",
      columns=[("model", "model"), ("method", "method"), ("ratio", "step / dense"),
               ("cpu_ratio", "CPU time / dense"), ("seconds", "step seconds"),
               ("goal", "goal")],
      rows=rows,
      notes=[
          "ResNet-20 (269,722 params), global batch 128 of random 32x32x3 images; BERT-tiny "
          "(2 layers, 128 hidden, vocabulary 8,000), global batch 64 of 128 random tokens with "
          "20 masked predictions; SGD momentum 0.9 after the exchange.",
          "dense: compress(dense()), one f32 all-reduce; times are the fastest of alternated "
          "steps after a warm-up, on 2 shared CPU cores simulating 8 devices.",
      ],
      settings={"models": models, "methods": ["dense"] + [m for m in methods if m != "dense"],
                "repeats": args.repeats, "devices": NUM_DEVICES},
      num_workers=NUM_DEVICES)


if __name__ == "__main__":
  common.child_main(None, measure)
