"""B2, step overhead: a jitted data-parallel training step with each method, against dense.

Eight workers in one process: on the CPU, eight simulated CPU devices (no network: the
collectives are memory copies); on a GPU (``--platform gpu``), the workers simulated on the
devices there are (:mod:`compressors.parallel.workers`: one H100 holds all eight). The runner's models
(:mod:`experiments.models`: ResNet-20 on CIFAR-shaped random images, BERT-tiny masked-LM on
random tokens; on GPUs also ResNet-50 on ImageNet-shaped images and BERT-base, at batches that
fill the device) and losses (:mod:`experiments.tasks`), and each method's transformation as the
runner builds it (:mod:`experiments.methods`) followed by SGD with momentum 0.9. The step is the
runner's: each worker's gradient with respect to its own copy of the parameters, the method's
``update``, ``apply_updates``; per-worker batch-norm statistics; state donated. TASC's step is
the common one, without a curvature refresh (the trainer refreshes every ``hessian_every = 100``
steps).

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
from compressors import step_time
from compressors.network import topology as topo
from compressors.parallel import step_kinds
from experiments import distributed
from experiments import methods as methods_lib
from experiments import models as models_lib
from experiments import tasks
from experiments import train
from experiments.bench import common

NUM_WORKERS = 8
AXIS, WORKER_AXIS = train.AXIS, train.WORKER_AXIS
# Goals: the step with TASC at most these multiples of dense's, on CPU for every model, on GPUs
# for the GPU-sized ones (>= 25M parameters).
GOAL_RATIO = {"cpu": 1.15, "gpu": 1.10}
# name -> (model config, global batch, task, image size or sequence length): ResNet-20 at the
# paper's batch of 128; BERT-tiny (configs/bert.py:tiny) with 128-token sequences, 20
# predictions each, 8 sequences per worker; ResNet-50 (25.6M) at 224 x 224, and BERT-base
# (110M) at 128 tokens, 32 per worker.
MODELS = {
    "resnet20": (dict(name="cifar_resnet", depth=20, num_classes=10), 128, "classification",
                 32),
    "bert_tiny": (dict(name="bert", hidden=128, num_layers=2, num_heads=2, intermediate=512,
                       vocab_size=8000), 64, "masked_lm", 128),
    "resnet50": (dict(name="imagenet_resnet", depth=50, num_classes=1000), 256,
                 "classification", 224),
    "bert_base": (dict(name="bert", hidden=768, num_layers=12, num_heads=12, intermediate=3072,
                       vocab_size=30522), 256, "masked_lm", 128),
}
DEFAULT_MODELS = {"cpu": ("resnet20", "bert_tiny"),
                  "gpu": ("resnet20", "bert_tiny", "resnet50", "bert_base")}
GPU_SIZED = ("resnet50", "bert_base")
PREDICTIONS = 20
# The cluster the modelled columns price the steps on, and the steps a method's kinds are
# averaged over (a local method's round, 1-bit Adam's warm-up and after).
MODEL_LINK, MODEL_WORKERS, MODEL_STEPS = topo.CLOUD_10G, NUM_WORKERS, 1000
TIMEOUT_S = 3600.0  # default limit for one child process, seconds


def random_batch(model: str, batch_size: int, model_config: dict):
  """A batch of random images and labels, or random BERT tokens and masked positions."""
  rng = np.random.default_rng(0)
  _, _, task, length = MODELS[model]
  if task == "classification":
    classes = model_config["num_classes"]
    return {"input": rng.standard_normal((batch_size, length, length, 3), np.float32),
            "label": rng.integers(0, classes, batch_size).astype(np.int32)}
  vocab = model_config["vocab_size"]
  return {"input_ids": rng.integers(0, vocab, (batch_size, length)).astype(np.int32),
          "attention_mask": np.ones((batch_size, length), np.int32),
          "masked_positions": np.sort(rng.permuted(np.tile(np.arange(length), (batch_size, 1)),
                                                   axis=1)[:, :PREDICTIONS],
                                      axis=1).astype(np.int32),
          "masked_ids": rng.integers(0, vocab, (batch_size, PREDICTIONS)).astype(np.int32),
          "masked_weights": np.ones((batch_size, PREDICTIONS), np.float32)}


def measure(request: dict) -> dict:
  """Child process: times every method's step on one model, 8 workers on the devices there are.

  Request: model, methods, repeats, batch_size (None: the model's default), model_overrides,
  devices (None: as many as the platform has, the rest of the 8 workers simulated on them; a
  divisor of 8: that many, each with 8 / devices simulated workers).
  """
  # On CPU the runner's settings (8 devices, single-threaded Eigen per device), before JAX's
  # first computation; on a GPU the CPU's devices are left alone.
  distributed.expose_cpu_devices(ml_collections.ConfigDict({
      "num_devices": NUM_WORKERS, "workers_per_device": 1,
      "distributed": {"coordinator_address": None, "num_processes": 1, "process_id": 0}}))
  warnings.filterwarnings("ignore", message="Some donated buffers were not usable")

  name = request["model"]
  model_config, default_batch, task_name, _ = MODELS[name]
  model_config = dict(model_config, **request.get("model_overrides", {}))
  batch_size = request.get("batch_size") or default_batch
  from_data = ("num_classes", "vocab_size")  # fields the dataset sets in a run
  model = models_lib.build_model({k: v for k, v in model_config.items() if k not in from_data},
                                 **{k: v for k, v in model_config.items() if k in from_data})
  task = tasks.TASKS[task_name]
  devices = jax.devices()
  if request.get("devices"):
    num_devices, per_device = request["devices"], NUM_WORKERS // request["devices"]
  else:
    num_devices, per_device = train.split_workers(NUM_WORKERS, 1, len(devices),
                                                  devices[0].platform)
  mesh = jax.sharding.Mesh(np.array(devices[:num_devices]), (AXIS,))
  workers = compressors.Workers.on(mesh, AXIS if per_device == 1 else (AXIS, WORKER_AXIS),
                                   per_device)
  batch = random_batch(name, batch_size, model_config)
  per_worker = {k: v.reshape((NUM_WORKERS, -1) + v.shape[1:]) for k, v in batch.items()}
  init_model = jax.jit(functools.partial(model.init, train=False))  # one compile, not one per op
  variables = dict(init_model(jax.random.PRNGKey(0),
                              *task.inputs({k: v[0] for k, v in per_worker.items()})))
  params = variables.pop("params")
  model_state = jax.tree.map(lambda x: np.broadcast_to(x, (NUM_WORKERS,) + x.shape), variables)
  num_params = sum(x.size for x in jax.tree.leaves(params))
  placed = jax.device_put(per_worker, jax.sharding.NamedSharding(mesh, workers.spec))

  steps, states = {}, {}
  for method in request["methods"]:
    steps[method], states[method] = method_step(method, model, task, params, model_state,
                                                workers, mesh, check_vma=per_device == 1)

  def prepare(method):
    def call():
      states[method] = steps[method](states[method], placed)
      return states[method]
    return lambda: call

  times = common.fastest_interleaved({m: prepare(m) for m in steps}, request["repeats"])
  dense = times["dense"]
  return {**common.device_info(), "model": name, "batch_size": batch_size,
          "params": num_params, "devices": num_devices, "workers_per_device": per_device,
          "shapes": [list(x.shape) for x in jax.tree.leaves(params)],
          "rows": [{"method": m, "seconds": t["wall"], "median_seconds": t["median_wall"],
                    "ratio": t["wall"] / dense["wall"], "cpu_ratio": t["cpu"] / dense["cpu"]}
                   for m, t in times.items()]}


def method_step(method: str, model, task, params, model_state, workers, mesh, *,
                check_vma: bool):
  """``method``'s jitted training step on ``mesh`` (it donates its state) and a fresh state
  for it: ``(step, (params, model_state, optimizer state))``; ``check_vma`` as
  ``jax.shard_map``'s (only with one worker per device)."""
  tx = methods_lib.make_chain(common.method_config(method), 0.1, workers.axis_name)
  opt_specs = workers.layout(compressors.state_specs(
      tx, params, workers.equivalent_mesh(abstract=True), workers.axis_name))
  opt_axes = compressors.parallel.workers.per_worker_axes(opt_specs)
  specs = (P(), workers.spec, opt_specs)

  def worker_step(params, model_state, opt_state, local_batch):
    def loss_fn(p):
      logits, new_model_state = (
          model.apply({"params": p, **model_state}, *task.inputs(local_batch), train=True,
                      mutable=list(model_state))
          if model_state else (model.apply({"params": p}, *task.inputs(local_batch),
                                           train=False), {}))
      return tasks.mean_loss(task.outcomes(logits, local_batch))[0], new_model_state

    grads, model_state = jax.grad(loss_fn, has_aux=True)(workers.own_copy(params))
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), model_state, opt_state

  each = workers.each(worker_step, (None, 0, opt_axes, 0), (None, 0, opt_axes))
  step = jax.jit(jax.shard_map(lambda state, b: each(*state, b), mesh=mesh,
                               in_specs=(specs, workers.spec), out_specs=specs,
                               check_vma=check_vma), donate_argnums=0)
  init = jax.jit(jax.shard_map(workers.each(tx.init, None, opt_axes), mesh=mesh,
                               in_specs=P(), out_specs=opt_specs, check_vma=check_vma))
  fresh = jax.tree.map(jax.numpy.copy, params)  # each method's step donates its own copy
  return step, (fresh, model_state, init(fresh))


def step_overhead(models: Sequence[str], methods: Sequence[str], *, repeats: int = 10,
                  batch_size: int | None = None, model_overrides: dict | None = None,
                  timeout_s: float = TIMEOUT_S, platform: str = "cpu",
                  devices: int | None = None, log=print) -> list[dict]:
  """Rows of B2: one per (model, method); ``ratio`` is the step time over dense's.

  Args:
    models: keys of :data:`MODELS`.
    platform: ``cpu`` or ``gpu`` (where the children run).
    devices: devices to run the 8 workers on, the rest simulated (a divisor of 8); None: the
      platform's (8 on CPU, where it simulates 8 devices).
    methods: methods to time ("dense", the reference, is added when missing).
    repeats: timed steps per method.
    batch_size: global batch (None: each model's default).
    model_overrides: model -> fields replacing the model's (e.g. a smaller width for a test).
    timeout_s: limit for one model's child process.
    log: progress printer.
  """
  methods = ["dense"] + [m for m in common.check_methods(methods) if m != "dense"]
  if devices is not None and (devices < 1 or NUM_WORKERS % devices):
    raise ValueError(f"devices={devices}: must divide the {NUM_WORKERS} workers")
  check_models(models)
  rows = []
  for model in models:
    request = {"model": model, "methods": methods, "repeats": repeats, "batch_size": batch_size,
               "model_overrides": (model_overrides or {}).get(model, {}), "devices": devices}
    result = common.run_child(__name__, request, env=common.child_env(platform),
                              timeout_s=timeout_s)
    if common.not_measured(result):
      rows += [{"model": model, "method": m, "ratio": common.not_measured(result)}
               for m in methods]
      continue
    modelled = modelled_steps(result["rows"], [tuple(x) for x in result["shapes"]])
    for r in result["rows"]:
      r.update({k: v for k, v in result.items() if k not in ("rows", "shapes")})
      r.update(modelled[r["method"]])
      if r["method"] == "tasc" and (platform == "cpu" or model in GPU_SIZED):
        limit = GOAL_RATIO[platform]
        r["goal"] = common.goal(r["ratio"] <= limit, f"<= {limit}x dense")
      log(f"B2 {model:9s} {r['method']:10s} ratio {r['ratio']:.3f} "
          f"({r['seconds'] * 1e3:.0f} ms)")
      rows.append(r)
  return rows


def modelled_steps(rows: Sequence[dict], shapes: Sequence[tuple[int, ...]]) -> dict[str, dict]:
  """Method -> its step on :data:`MODEL_WORKERS` workers joined by :data:`MODEL_LINK`, modelled
  (:mod:`compressors.step_time`: the measured step as compute, communication priced and hidden
  where the method can hide it; a method of several step kinds, the mean over its first
  :data:`MODEL_STEPS`), as seconds (``modelled_seconds``) and over two dense baselines:
  float32 after the backward pass (``vs_dense_f32``) and bfloat16 overlapped with it
  (``vs_dense_bf16_overlapped``), each with dense's measured compute."""
  topology = topo.Topology.flat(MODEL_WORKERS, MODEL_LINK)

  def mean(method: str, compute: float, *, overlap: bool = True) -> float:
    config = common.method_config(method)
    kinds = methods_lib.step_kinds(config)
    times = step_time.kind_times(method, shapes, topology, compute, methods_lib.settings(config),
                                 exchange_settings=methods_lib.exchange_settings(config),
                                 kinds=kinds, overlap=overlap)
    return step_time.mean_step_seconds(times, step_kinds.kind_counts(kinds, 0, MODEL_STEPS))

  dense = next(r for r in rows if r["method"] == "dense")["seconds"]
  plain, fair = mean("dense", dense, overlap=False), mean("bf16", dense)
  out = {}
  for r in rows:
    seconds = mean(r["method"], r["seconds"], overlap=r["method"] != "dense")
    out[r["method"]] = {"modelled_seconds": seconds, "vs_dense_f32": seconds / plain,
                        "vs_dense_bf16_overlapped": seconds / fair}
  return out


def check_models(models: Sequence[str]) -> None:
  """Refuses a model that is not one of :data:`MODELS`."""
  for model in models:
    if model not in MODELS:
      raise ValueError(f"--models: {model!r} is not benchmarked; allowed: {sorted(MODELS)}")


def check_args(args) -> None:
  """Refuses the command-line arguments that :func:`report` would refuse, before anything runs
  (the platform is resolved by :func:`report`: it asks a child process)."""
  check_models(args.models or [])
  common.check_methods(args.methods or [])


def report(args) -> common.Report:
  """B2 as a :class:`experiments.bench.common.Report`."""
  platform = common.resolve_platform(args.platform)
  models = args.models or list(DEFAULT_MODELS[platform])
  methods = args.methods or common.all_methods()
  rows = step_overhead(models, methods, repeats=args.repeats,
                       timeout_s=args.timeout or TIMEOUT_S, platform=platform)
  on = common.measured_on(rows)
  layout = next(((r["devices"], r["workers_per_device"]) for r in rows if "devices" in r),
                (NUM_WORKERS, 1))
  devices, per_device = layout
  where = (f"{devices} devices x {per_device} simulated workers" if per_device > 1
           else f"{devices} devices")
  return common.Report(
      name="step",
      title=f"B2: training-step time with each method / dense ({NUM_WORKERS} workers: {where}"
            + (f", {on['device']}" if on else "") + ")",
      columns=[("model", "model"), ("params", "parameters"), ("method", "method"),
               ("ratio", "step / dense"), ("cpu_ratio", "CPU time / dense"),
               ("seconds", "step seconds"), ("goal", "goal"),
               ("modelled_seconds", "modelled step s, 8 workers at 10 Gbit/s"),
               ("vs_dense_f32", "modelled / dense f32"),
               ("vs_dense_bf16_overlapped", "modelled / dense bf16 overlapped")],
      rows=rows,
      notes=[
          "ResNet-20 (269,722 params), global batch 128 of random 32x32x3 images; BERT-tiny "
          "(2 layers, 128 hidden, vocabulary 8,000), global batch 64 of 128 random tokens with "
          "20 masked predictions; on GPUs also ResNet-50 (25.6M), global batch 256 of random "
          "224x224x3 images, and BERT-base (110M), global batch 256 of 128 tokens; SGD momentum "
          "0.9 after the exchange.",
          "dense: compress(dense()), one f32 all-reduce; times are the fastest of alternated "
          "steps after a warm-up. On the CPU: 2 shared cores simulating 8 devices. Simulated "
          "workers (compressors.parallel.workers) share a device: their collectives move no bytes, so "
          "the ratio is the methods' compute against dense's.",
          "modelled: each measured step as compute on 8 workers joined by 10 Gbit/s links "
          "(compressors.step_time: nominal alpha-beta, not measured), its communication hidden "
          "where the method can hide it; beside dense in float32 after the backward pass, the "
          "fair baseline: dense in bfloat16, its 25 MiB buckets overlapped with the backward "
          "pass (Agarwal et al. 2022).",
          f"goal: TASC's step <= {GOAL_RATIO['cpu']}x dense's on CPU, "
          f"<= {GOAL_RATIO['gpu']}x on GPUs for the GPU-sized models.",
      ],
      settings={"models": models, "methods": ["dense"] + [m for m in methods if m != "dense"],
                "repeats": args.repeats, "workers": NUM_WORKERS, "devices": devices,
                "workers_per_device": per_device, "platform": platform, **on},
      num_workers=NUM_WORKERS)


if __name__ == "__main__":
  common.child_main(None, measure)
