"""B3, bytes against workers: per-device wire bytes of one gradient exchange, 2 to 256 workers.

Nothing runs: for each worker count a child process simulating that many CPU devices compiles
one exchange (the method's ``update`` inside ``shard_map``, arguments ``jax.ShapeDtypeStruct``)
and :func:`compressors.wire_bytes` reads the bytes each device sends from the compiled HLO.

Gradients have the real layer shapes of ResNet-50 (25,557,032 parameters, 161 leaves) and
BERT-base with its masked-LM head (:mod:`experiments.models`, ``jax.eval_shape`` of ``init``),
fused into one buffer by every method but PowerSGD, which compresses each matrix-shaped leaf at
rank 4 (convolution kernels as ``(h w in) x out``) and all-reduces vectors and leaves it would
compress less than 2x densely, as PyTorch's hook does. Methods:

- ``dense``: the f32 all-reduce (charged as a ring: ``2 (n-1)/n`` of the buffer);
- ``topk``: exact top-k at density 0.01, values and indices all-gathered (grows with ``n``);
- ``randomk``: random-k at density 0.01 with a shared support, all-reduced;
- ``powersgd``: rank 4, two all-reduces (P and Q);
- ``onebit``: 1-bit (signs plus a scale) by the two-phase exchange (all-to-all, all-gather);
- ``tasc``: TASC at density 0.01, shared block support (block scores, then the blocks,
  all-reduced);
- ``tasc_hierarchical``: mesh ``(n/8, 8)``, dense reduce-scatter over the 8 devices of a node,
  TASC over the ``n/8`` nodes, all-gather in the node; ``slow-axis bytes`` is what crosses
  nodes.
"""

import math
import time
import warnings
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np

import compressors
from experiments import models
from experiments.bench import common
import tasc

DEFAULT_WORKERS = (2, 4, 8, 16, 32, 64, 128, 256)
DEFAULT_SIZES = ("resnet50", "bert_base")
METHODS = ("dense", "topk", "randomk", "powersgd", "onebit", "tasc", "tasc_hierarchical")
NODE_SIZE = 8
AXIS, SLOW, FAST = "data", "node", "local"
TIMEOUT_S = 1800.0  # default limit for one child process, seconds


def gradient_shapes(size: str) -> dict[str, tuple[int, ...]]:
  """Leaf name -> shape of a named model's gradient, ``RxC`` (one matrix), or ``N`` (one vector).

  ``resnet50`` is :class:`experiments.models.ImageNetResNet` (1000 classes), ``bert_base`` is
  :class:`experiments.models.BertMLM` (vocabulary 30,522).
  """
  text = str(size).lower()
  if text in ("resnet50", "bert_base"):
    if text == "resnet50":
      model, inputs = models.ImageNetResNet(num_classes=1000, depth=50), (
          jnp.zeros((1, 224, 224, 3)),)
    else:
      model, inputs = models.BertMLM(vocab_size=30522), (
          jnp.zeros((1, 128), jnp.int32), jnp.ones((1, 128), jnp.int32),
          jnp.zeros((1, 20), jnp.int32))
    params = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), *inputs))["params"]
    return {jax.tree_util.keystr(path): tuple(leaf.shape)
            for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
  parts = text.split("x")
  if not all(p.isdigit() and int(p) > 0 for p in parts) or len(parts) > 2:
    raise ValueError(f"--sizes: {size!r} is not a gradient; allowed: resnet50, bert_base, an "
                     "element count N (one vector) or RxC (one matrix)")
  return {"w": tuple(int(p) for p in parts)}


def _exchange(method: str, num_workers: int, group: int):
  """(transformation, mesh, worker axes) of ``method`` over ``num_workers`` devices."""
  devices = np.array(jax.devices()[:num_workers])
  if method != "tasc_hierarchical":
    return (common.communication(method, AXIS), jax.sharding.Mesh(devices, (AXIS,)), AXIS)
  c = common.method_config("tasc").compression.tasc
  tx = tasc.tasc_compress(axis_name=SLOW, dense_axis=FAST, density=c.density,
                          block_size=c.block_size, sensitivity=c.sensitivity, support=c.support)
  mesh = jax.sharding.Mesh(devices.reshape(num_workers // group, group), (SLOW, FAST))
  return tx, mesh, (SLOW, FAST)


def measure(request: dict) -> dict:
  """Child process (``workers`` devices): wire bytes of each (size, method). Request: workers,
  sizes, methods, group."""
  warnings.filterwarnings("ignore")
  n, group = request["workers"], request["group"]
  rows = []
  for size in request["sizes"]:
    shapes = gradient_shapes(size)
    params = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in shapes.items()}
    elements = sum(math.prod(s) for s in shapes.values())
    for method in request["methods"]:
      row = {"workers": n, "size": str(size), "elements": elements, "method": method}
      rows.append(row)
      if method == "tasc_hierarchical" and (n % group or n < 2 * group):
        row["skipped"] = f"needs a multiple of {group} workers, at least {2 * group}"
        continue
      try:
        row.update(_wire_bytes(method, params, n, group))
      except Exception as e:  # pylint: disable=broad-except  # reported in the row, not lost
        row["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
  return {"rows": rows}


def _wire_bytes(method: str, params: dict, n: int, group: int) -> dict:
  """Compiles one exchange of ``params``-shaped gradients over ``n`` devices; its bytes."""
  start = time.perf_counter()
  tx, mesh, axes = _exchange(method, n, group)
  specs = compressors.state_specs(tx, params, mesh, axes)

  def exchange(grads, state):
    grads = jax.tree.map(lambda g: g[0], grads)
    updates, state = tx.update(grads, compressors.drop_device_axis(state, specs))
    return updates, compressors.add_device_axis(state, specs)

  fn = jax.jit(jax.shard_map(exchange, mesh=mesh, in_specs=(P(axes), specs),
                             out_specs=(P(), specs)))
  init = jax.jit(jax.shard_map(lambda p: compressors.add_device_axis(tx.init(p), specs),
                               mesh=mesh, in_specs=P(), out_specs=specs))
  state = jax.eval_shape(init, params)
  grads = {k: jax.ShapeDtypeStruct((n,) + p.shape, p.dtype) for k, p in params.items()}
  report = compressors.wire_bytes(fn, grads, state, mesh=mesh)
  slow = (sum(b for a, b in report.by_axis.items() if SLOW in a)
          if method == "tasc_hierarchical" else report.total)
  return {"bytes_per_device": report.total, "slow_axis_bytes": slow,
          "by_kind": report.by_kind, "compile_seconds": time.perf_counter() - start}


def bytes_vs_workers(workers: Sequence[int], sizes: Sequence[str],
                     methods: Sequence[str] = METHODS, *, group: int = NODE_SIZE,
                     timeout_s: float = TIMEOUT_S, log=print) -> list[dict]:
  """Per-device wire bytes of one exchange for each worker count, gradient and method.

  Args:
    workers: worker counts (one child process each, simulating that many CPU devices).
    sizes: ``resnet50``, ``bert_base``, ``N`` (one f32 vector) or ``RxC`` (one matrix).
    methods: names of :data:`METHODS`.
    group: devices per node for ``tasc_hierarchical`` (mesh ``(n / group, group)``).
    timeout_s: limit for one child; its rows are then marked skipped.
    log: progress printer.

  Returns:
    One dict per (workers, size, method): ``bytes_per_device`` (all collectives, per call),
    ``slow_axis_bytes`` (what crosses nodes for the hierarchical mode, else the total),
    ``by_kind``, ``vs_dense`` (dense's bytes over these, same workers and size),
    ``compile_seconds``; or ``skipped``/``error`` with the reason.
  """
  methods = check_rows(workers, sizes, methods)
  rows = []
  for n in workers:
    request = {"workers": n, "sizes": [str(s) for s in sizes], "methods": methods,
               "group": group}
    result = common.run_child(__name__, request, env=common.cpu_env(n), timeout_s=timeout_s)
    if common.not_measured(result):
      result = {"rows": [{"workers": n, "size": str(s), "method": m, **result}
                         for s in sizes for m in methods]}
    for r in result["rows"]:
      dense = next((d for d in result["rows"] if d["size"] == r["size"]
                    and d["method"] == "dense" and "bytes_per_device" in d), None)
      if dense is not None and r.get("slow_axis_bytes"):
        r["vs_dense"] = dense["bytes_per_device"] / r["slow_axis_bytes"]
      log(f"B3 {n:>4} workers {r['size']:>9} {r['method']:18s} " + (
          f"{r['slow_axis_bytes'] / 1e6:10.3f} MB ({r['compile_seconds']:.0f} s compile)"
          if "slow_axis_bytes" in r else common.not_measured(r)))
    rows += result["rows"]
  return rows


def check_rows(workers: Sequence[int], sizes: Sequence[str], methods: Sequence[str]) -> list[str]:
  """``methods``, once the worker counts, the sizes and the methods are checked: a clear error
  before any child starts."""
  for n in workers:
    if not isinstance(n, int) or n < 2:
      raise ValueError(f"--workers: {n!r}; allowed: ints >= 2")
  for s in sizes:
    if str(s).lower() not in DEFAULT_SIZES:
      gradient_shapes(s)
  return common.check_methods(methods, METHODS)


def check_args(args) -> None:
  """Refuses the command-line arguments that :func:`report` would refuse, before anything runs."""
  check_rows(args.workers or DEFAULT_WORKERS, args.sizes or DEFAULT_SIZES, args.methods or METHODS)


def report(args) -> common.Report:
  """B3 as a :class:`experiments.bench.common.Report` (one row per size and method, one column
  per worker count: megabytes each device sends, across nodes for the hierarchical mode)."""
  workers = args.workers or list(DEFAULT_WORKERS)
  sizes = args.sizes or list(DEFAULT_SIZES)
  methods = args.methods or list(METHODS)
  rows = bytes_vs_workers(workers, sizes, methods, timeout_s=args.timeout or TIMEOUT_S)
  table = []
  for size in sizes:
    for method in methods:
      line = {"size": str(size), "method": method}
      for r in rows:
        if r["size"] == str(size) and r["method"] == method:
          line["elements"] = r.get("elements", line.get("elements"))
          line[f"n{r['workers']}"] = (round(r["slow_axis_bytes"] / 1e6, 3)
                                      if "slow_axis_bytes" in r else "-")
      table.append(line)
  return common.Report(
      name="bytes",
      title="B3: megabytes each device sends per exchange, by number of workers",
      columns=[("size", "gradient"), ("elements", "elements"), ("method", "method")]
      + [(f"n{n}", str(n)) for n in workers],
      rows=table,
      notes=[
          "From the compiled HLO (compressors.wire_bytes): all-reduce 2(n-1)/n S, all-gather "
          "(n-1)/n S, all-to-all (n-1)/n S per device; nothing is run.",
          "density 0.01 for topk/randomk/tasc; PowerSGD rank 4 per matrix leaf (vectors and "
          "leaves compressed < 2x go dense); onebit two-phase; tasc_hierarchical: mesh (n/8, 8), "
          "bytes that cross nodes (the fast in-node reduce-scatter/all-gather not counted; '-' "
          "below 16 workers).",
          "real layer shapes of ResNet-50 and BERT-base (experiments.models), full size at "
          "every worker count (no scaling).",
      ],
      settings={"workers": list(workers), "sizes": [str(s) for s in sizes],
                "methods": list(methods), "group": NODE_SIZE},
      data=rows, num_workers=list(workers))


if __name__ == "__main__":
  common.child_main(None, measure)
