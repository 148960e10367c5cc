"""B1, compression cost: compress + decode of one gradient, against the memory-bandwidth floor.

Every method's transformation is built as the runner builds it (:mod:`experiments.methods`)
with ``axis_name=None``: error feedback, encode and decode, no collective. Its jitted ``update``
is timed on a gradient of ``d`` float32 elements against the *floor* measured in the same
process: a jitted ``residual + gradient`` over buffers of the same size (two reads, one write),
the memory traffic every error-feedback compressor must do at least. Both donate their inputs,
as a training step donates its state, so outputs are written in place rather than into freshly
mapped memory (whose page faults would otherwise dominate on CPU).

*Compress*, for the methods with error feedback, is the same ``update`` with its output, the
decoded mean, unused: XLA drops what only the mean needs, and what is left is a worker's work
before the collective (error feedback, the encoding, the new residual and state); only its
state is donated. Without error feedback the encoding reaches nothing but the mean, so it
cannot be timed apart. TASC's goal is on compress: its compression is the block scores, the
selection, the gather and the residual update; the decode (the dense mean written from the
all-reduced blocks) comes after the collective.

The gradient is one flat leaf ``f32[d]`` (the fused buffer of tensor fusion), except for
PowerSGD, which compresses matrices: one ``(d // 1024) x 1024`` leaf, with its own floor.

Memory: ``state B/param`` is the compressor's optax state (``jax.eval_shape`` of ``init``) per
parameter; ``temp B/param`` the scratch memory XLA allocates for one ``update`` (the compiled
program's ``memory_analysis``), i.e. the peak beyond the donated inputs.
"""

import glob
import gzip
import json
import math
import re
import tempfile
import warnings
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp

from experiments.bench import common
import tasc

DEFAULT_SIZES = ("1m", "resnet50", "bert_base")
GOAL_SIZE = common.SIZES["resnet50"]
GOAL_TOPK_SPEEDUP = 10.0


class Goal(NamedTuple):
  """TASC's goals on one platform: at each of ``sizes``, compress (and, if set, compress +
  decode) at most these multiples of the floor; at ``topk_size``, compress + decode (or compress
  alone, ``topk_on_compress``) at least :data:`GOAL_TOPK_SPEEDUP` times cheaper than exact
  top-k's."""
  sizes: tuple[int, ...]
  compress: float
  compress_and_decode: float | None
  topk_size: int
  topk_on_compress: bool


GOALS = {
    "cpu": Goal((GOAL_SIZE,), 1.5, None, GOAL_SIZE, topk_on_compress=True),
    "gpu": Goal((GOAL_SIZE, common.SIZES["bert_base"]), 1.3, 1.6, common.SIZES["bert_base"],
                topk_on_compress=False),
}
POWERSGD_COLUMNS = 1024
# Whose operations are profiled (where the time goes): TASC at every size, exact top-k at
# the goal's.
PROFILED = {"tasc": None, "topk": GOAL_SIZE}
TIMEOUT_S = 900.0  # default limit for one child process, seconds


def leaf_shape(method: str, size: int) -> tuple[int, ...]:
  """The gradient leaf a method is timed on (a matrix for PowerSGD)."""
  if method == "powersgd":
    return (max(size // POWERSGD_COLUMNS, 1), POWERSGD_COLUMNS)
  return (size,)


def measure(request: dict) -> dict:
  """Child process: times one method on one size. Request: method, size, repeats, budget_s."""
  warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
  method = request["method"]
  shape = leaf_shape(method, request["size"])
  elements = math.prod(shape)
  tx = common.communication(method, None)
  params = {"w": jax.ShapeDtypeStruct(shape, jnp.float32)}
  abstract_state = jax.eval_shape(tx.init, params)
  state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract_state))

  grad = {"w": jax.random.normal(jax.random.PRNGKey(0), shape, jnp.float32)}
  residual = jax.random.normal(jax.random.PRNGKey(1), shape, jnp.float32)
  state = jax.jit(tx.init)(grad)
  error_feedback = bool(getattr(state, "residual", ()))
  if error_feedback:  # a residual like a real step's
    state = state._replace(residual={"w": residual})
  update = jax.jit(tx.update, donate_argnums=(0, 1))
  floor = jax.jit(lambda e, g: e + g, donate_argnums=(0, 1))
  temp_bytes = update.lower(grad, state).compile().memory_analysis().temp_size_in_bytes

  def prepare(jitted, args):
    """``prepare`` of one timed call: fresh copies of the donated ``args``."""
    def fresh():
      copies = common.fresh_copies(args)
      return lambda: jitted(*copies)
    return fresh

  calls = {"floor": prepare(floor, (residual, grad["w"])), method: prepare(update, (grad, state))}
  if error_feedback:  # the update with its decoded mean unused: XLA drops the decode
    # The state alone is donated, as a training step's gradient is a temporary: with the mean
    # dropped no output needs the gradient's buffer, and XLA would put the new residual there
    # rather than over the old one, where a step writes it.
    compress = jax.jit(lambda g, s: tx.update(g, s)[1], donate_argnums=1)
    calls["compress"] = prepare(compress, (grad, state))
  if method == "tasc":
    calls["pass_bound"] = prepare(jax.jit(tasc_pass_bound, donate_argnums=(0, 1)),
                                  (grad["w"], residual))
  times = common.fastest_interleaved(calls, request["repeats"], request["budget_s"])
  floor_t, method_t = times["floor"], times[method]
  profile = (op_profile(update, lambda: common.fresh_copies((grad, state)))
             if request.get("profile") else None)
  return {
      **common.device_info(),
      **({"profile": profile} if profile else {}),
      "method": method, "elements": elements, "shape": list(shape),
      "repeats": method_t["repeats"],
      "seconds": method_t["wall"], "floor_seconds": floor_t["wall"],
      "median_seconds": method_t["median_wall"], "floor_median_seconds": floor_t["median_wall"],
      "ratio": method_t["wall"] / floor_t["wall"], "cpu_ratio": method_t["cpu"] / floor_t["cpu"],
      **({"compress_seconds": times["compress"]["wall"],
          "compress_ratio": times["compress"]["wall"] / floor_t["wall"]}
         if "compress" in times else {}),
      "floor_gbytes_per_s": 3 * 4 * elements / floor_t["wall"] / 1e9,
      "state_bytes_per_param": state_bytes / elements,
      "temp_bytes_per_param": temp_bytes / elements,
      **({"pass_bound_ratio": times["pass_bound"]["wall"] / floor_t["wall"],
          "one_pass_kernel": tasc.one_pass_available(256)} if "pass_bound" in times else {}),
  }


def tasc_pass_bound(gradient, residual):
  """The least TASC's compress + decode costs, whatever the scores and blocks: a yardstick.

  Compression is the floor's pass (the sum written over the residual; :mod:`tasc._fused` takes
  the block energies on the way); the decode writes the dense mean's zeros over the gradient
  once, after the sum (as TASC fills them after the selection). The values are meaningless.
  """
  total = gradient + residual
  return jnp.broadcast_to(total[0] * 0, gradient.shape), total


def op_profile(jitted, arguments, calls: int = 3) -> list[dict]:
  """Where one call's time goes: the compiled program's operations, slowest first.

  Runs ``calls`` calls under ``jax.profiler`` and sums each HLO instruction's events.

  Args:
    jitted: the jitted function.
    arguments: ``() -> args`` of one call (fresh copies when the function donates them).
    calls: calls traced.

  Returns:
    ``{"op", "source", "shape", "ms"}`` per instruction taking at least 1% of the total: the
    HLO instruction, the JAX operation it comes from, its result shape, milliseconds per call;
    empty where the profiler's trace names no instruction (as on some GPUs' traces).
  """
  pending = [arguments() for _ in range(calls)]
  hlo = jitted.lower(*pending[0]).compile().as_text()
  instructions = {name: (shape, source) for name, shape, source in re.findall(
      r"^\s*(?:ROOT )?%([\w.\-]+) = (\S+) [^\n]*?op_name=\"([^\"]+)\"", hlo, re.M)}
  instructions.update({name: (shape, "") for name, shape in re.findall(
      r"^\s*(?:ROOT )?%([\w.\-]+) = (\S+) (?:copy|fusion)\(", hlo, re.M)
      if name not in instructions})
  with tempfile.TemporaryDirectory(prefix="bench_profile") as folder:
    jax.profiler.start_trace(folder)
    for args in pending:
      jax.block_until_ready(jitted(*args))
    jax.profiler.stop_trace()
    traces = glob.glob(f"{folder}/**/*.trace.json.gz", recursive=True)
    events = [e for trace in traces for e in json.load(gzip.open(trace))["traceEvents"]]
  total = {}
  for e in events:
    if e.get("ph") == "X" and e.get("name") in instructions:
      total[e["name"]] = total.get(e["name"], 0.0) + e["dur"] / 1e3 / calls
  everything = sum(total.values())
  if not everything:
    return []
  return [{"op": name, "source": instructions[name][1].split("/", 1)[-1],
           "shape": re.sub(r"\{[^}]*\}", "", instructions[name][0]).strip("(,"), "ms": ms}
          for name, ms in sorted(total.items(), key=lambda kv: -kv[1]) if ms >= everything / 100]


def compression_cost(sizes: Sequence[int], methods: Sequence[str], *, repeats: int = 15,
                     budget_s: float = 30.0, timeout_s: float = TIMEOUT_S,
                     platform: str = "cpu", log=print) -> list[dict]:
  """Rows of B1: one per (size, method), each measured in its own child process.

  Args:
    sizes: gradient elements.
    methods: names of :func:`experiments.bench.common.all_methods`.
    platform: ``cpu`` or ``gpu`` (where the children run; :func:`common.resolve_platform`).
    repeats: most timed calls per method (fewer when one call is slow, see ``budget_s``).
    budget_s: about how long the timed calls of one method may take.
    timeout_s: a child taking longer is killed and its row marked skipped.
    log: progress printer.

  Returns:
    Dicts with ``size``, ``method``, ``ratio`` (compress + decode, to the floor), ``cpu_ratio``,
    ``compress_ratio`` (compress alone, methods with error feedback), ``vs_topk`` and
    ``compress_vs_topk`` (how many times cheaper than exact top-k on the same size, for each),
    memory per parameter; or ``skipped``/``error`` with the reason.
  """
  rows = []
  for size in sizes:
    for method in common.check_methods(methods):
      request = {"method": method, "size": size, "repeats": repeats, "budget_s": budget_s,
                 "profile": method in PROFILED and PROFILED[method] in (None, size)}
      row = {"size": size, "method": method}
      row.update(common.run_child(__name__, request, env=common.child_env(platform),
                                  timeout_s=timeout_s))
      log(f"B1 {size:>11,} {method:10s} " + (
          common.not_measured(row) or
          f"ratio {row['ratio']:.2f}" + (f", compress {row['compress_ratio']:.2f}"
                                          if "compress_ratio" in row else "")
          + f" (floor {row['floor_seconds'] * 1e3:.1f} ms)"))
      rows.append(row)
    reference = next((r for r in rows if r["size"] == size and r["method"] == "topk"
                      and "ratio" in r), None)
    for r in rows:
      if r["size"] == size and reference is not None and "ratio" in r:
        r["vs_topk"] = reference["ratio"] / r["ratio"]
        if "compress_ratio" in r and "compress_ratio" in reference:
          r["compress_vs_topk"] = reference["compress_ratio"] / r["compress_ratio"]
  for r in rows:
    r["goal"] = _goal(r, GOALS[platform])
  return rows


def _goal(row: dict, goal: Goal) -> str:
  if row["method"] != "tasc" or row["size"] not in goal.sizes + (goal.topk_size,):
    return ""
  if "ratio" not in row:
    return common.goal(None, common.not_measured(row))
  parts = []
  if row["size"] in goal.sizes:
    # On CPU the goal is on compression (scores, selection, gather, residual update), the
    # decode aside; on GPUs on both.
    parts.append(common.goal(row.get("compress_ratio", math.inf) <= goal.compress,
                             f"compress <= {goal.compress}x floor"))
    if goal.compress_and_decode is not None:
      parts.append(common.goal(row["ratio"] <= goal.compress_and_decode,
                               f"compress + decode <= {goal.compress_and_decode}x floor"))
  if row["size"] == goal.topk_size:
    what = "compress" if goal.topk_on_compress else "compress + decode"
    speedup = row.get("compress_vs_topk" if goal.topk_on_compress else "vs_topk")
    parts.append(common.goal(None if speedup is None else speedup >= GOAL_TOPK_SPEEDUP,
                             f"{what} >= {GOAL_TOPK_SPEEDUP:g}x cheaper than exact top-k's"))
  return "; ".join(parts)


# What B1's columns mean and how TASC's passes bound its cost (every report's notes).
NOTES = (
    "floor: jitted residual + gradient over the same buffers (2 reads, 1 write), timed "
    "in the same process, alternating with the method; both donate their inputs.",
    "time: fastest of several alternated calls after a warm-up (wall clock); CPU time: "
    "the same with process CPU time (steadier on a loaded machine).",
    "compress (methods with error feedback): the same update with the decoded mean "
    "unused, so that XLA drops the decode: a worker's work before the collective (error "
    "feedback, encoding, the new residual and state). TASC's goal is on it.",
    "methods as experiments.methods builds them (density 0.01, TASC blocks of 256 with "
    "Hutchinson scores from the state's curvature EMA, PowerSGD rank 4 on a "
    f"(d/{POWERSGD_COLUMNS}) x {POWERSGD_COLUMNS} matrix); topk with its default selection "
    "(exact lax.top_k on CPU, a corrected sampled threshold on GPUs).",
    "state B/param: the optax state per parameter (two-phase methods hold the owner's "
    "memory for 1/n of the buffer; with one worker here that is a full buffer); temp "
    "B/param: XLA's scratch memory for one update.",
    "TASC makes two passes over the buffer, in place: the floor's own to compress "
    "(gradient + residual, the block energies taken on the way by tasc._fused's CPU "
    "kernel, as XLA's CPU backend cannot fuse a reduction into an elementwise pass), and "
    "one write of the dense mean's zeros to decode. The floor is the least its "
    "compression can cost; the floor + one write, its pass bound, the least with the "
    "decode.",
)


def check_args(args) -> None:
  """Refuses the command-line arguments that :func:`report` would refuse, before anything runs
  (the platform is resolved by :func:`report`: it asks a child process)."""
  for size in args.sizes or DEFAULT_SIZES:
    common.parse_size(size)
  common.check_methods(args.methods or [])


def report(args) -> common.Report:
  """B1 as a :class:`experiments.bench.common.Report`."""
  sizes = [common.parse_size(s) for s in (args.sizes or DEFAULT_SIZES)]
  methods = args.methods or common.all_methods()
  platform = common.resolve_platform(args.platform)
  rows = compression_cost(sizes, methods, repeats=args.repeats,
                          timeout_s=args.timeout or TIMEOUT_S, platform=platform)
  on = common.measured_on(rows)
  for r in rows:
    if "ratio" not in r:
      r["ratio"] = common.not_measured(r)
  return common.Report(
      name="compression",
      title="B1: compression cost (no collective) / memory-bandwidth floor"
            + (f" on {on['device']}" if on else ""),
      columns=[("size", "elements"), ("method", "method"),
               ("ratio", "compress + decode / floor"), ("cpu_ratio", "CPU time / floor"),
               ("seconds", "seconds"), ("vs_topk", "x cheaper than top-k"),
               ("compress_ratio", "compress / floor"),
               ("compress_vs_topk", "compress: x cheaper than top-k"),
               ("state_bytes_per_param", "state B/param"),
               ("temp_bytes_per_param", "temp B/param"), ("goal", "goal")],
      rows=rows,
      notes=[*NOTES, *measured_notes(rows, platform)],
      settings={"sizes": sizes, "methods": list(methods), "repeats": args.repeats,
                "timeout_s": args.timeout or TIMEOUT_S, "platform": platform, **on})


def measured_notes(rows: Sequence[dict], platform: str) -> list[str]:
  """What this measurement adds to the notes: TASC's pass bounds, which TASC pass ran, and where
  each method's time goes at :data:`GOAL_SIZE`."""
  notes = []
  bounds = [f"{r['pass_bound_ratio']:.2f}x at {r['size']:,}" for r in rows
            if "pass_bound_ratio" in r]
  if bounds:
    notes.append("TASC's pass bound with the decode (experiments.bench.compression."
                 "tasc_pass_bound, timed alongside): " + ", ".join(bounds) + " the floor.")
  if platform == "gpu":
    notes.append("TASC on GPUs: XLA's passes, which fuse the block energies into the sum "
                 "(tasc._fused keeps no GPU kernel).")
  elif any(r.get("one_pass_kernel") is False for r in rows):
    notes.append("TASC ran without its one-pass CPU kernel (tasc._fused: it could not be built, "
                 "or TASC_ONE_PASS=0), so its block energies took one more read of the buffer.")
  for r in rows:
    if r.get("profile") and r["size"] == GOAL_SIZE:
      ops = ", ".join(f"{p['source'] or p['op']} {p['shape']} {p['ms']:.0f} ms"
                      for p in r["profile"][:6])
      notes.append(f"where {r['method']}'s time goes at {GOAL_SIZE:,} (profile, per call, "
                   f"floor {r['floor_seconds'] * 1e3:.0f} ms): {ops}")
  return notes


if __name__ == "__main__":
  common.child_main(None, measure)
