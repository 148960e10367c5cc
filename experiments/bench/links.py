"""B4, real links: dense, top-k and TASC all-reduce of one gradient between processes over a
rate-limited loopback.

``p`` CPU processes (one device each) are started by :func:`experiments.launch.launch` inside a
private network namespace whose loopback is shaped to ``--rate`` (default 1 Gbit/s) by
:func:`experiments.bench.calibrate.rate_limited_namespace`, and joined by ``jax.distributed``
with gloo collectives (:mod:`experiments.distributed`). Each times one exchange of a
25,557,032-element (ResNet-50) float32 gradient with each method, as the runner builds it
(:mod:`experiments.methods`): ``dense`` (one f32 all-reduce), ``topk`` (exact top-k at density
0.01, values and indices all-gathered), ``tasc`` (density 0.01: block scores, then the shared
blocks, all-reduced), ``tasc_previous`` (the same with ``support="previous"``: the scores
ride in the payload's all-reduce, one collective instead of two), and both again with
``wire_dtype="float16"`` (``tasc_f16``, ``tasc_previous_f16``: scores and payload at half the
bytes, error feedback keeping the rounding; gloo sums float16 on the CPU slowly, so whether the
halved bytes save time varies from run to run: with one all-reduce they mostly do, with two they
mostly do not). The time of an exchange is compute and communication together (what a training
step waits for), with the gradient and the compressor's state donated as in a training step, so
outputs are written in place; the figure is dense's time over each method's, measured in the
same run. One loopback carries every process's traffic, so ``p`` processes share the rate (one
switch port, not ``p`` NICs): the link needs ``p * bytes/device / rate`` for an exchange, which
is what dense's measured times follow. The token bucket lets its first 512 KB pass unshaped.
"""

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

import jax
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import ml_collections
import numpy as np

import compressors
from experiments import distributed
from experiments.bench import calibrate
from experiments.bench import common

DEFAULT_PROCESSES = (2, 4)
METHODS = ("dense", "topk", "tasc", "tasc_previous", "tasc_f16", "tasc_previous_f16")
# Rows that are a runner method with other settings: name -> (method, compression overrides).
# TASC's "previous" support ranks the blocks by the scores that rode in the last step's payload,
# so an exchange is one all-reduce instead of two (the same bytes, one latency less).
VARIANTS = {"tasc_previous": ("tasc", {"support": "previous"}),
            "tasc_f16": ("tasc", {"wire_dtype": "float16"}),
            "tasc_previous_f16": ("tasc", {"support": "previous", "wire_dtype": "float16"})}
GOAL_SPEEDUP = 20.0
AXIS = "data"
TIMEOUT_S = 1800.0  # default limit for one child process, seconds


def measure(request: dict) -> dict:
  """One process of the run (started by experiments.launch): times each method, writes
  ``<out>/worker<i>.json``. Request: elements, methods, repeats, out."""
  config = ml_collections.ConfigDict({
      "num_devices": int(os.environ["JAX_NUM_PROCESSES"]),
      "distributed": {"coordinator_address": None, "num_processes": None, "process_id": None}})
  distributed.expose_cpu_devices(config)
  distributed.initialize(config)
  warnings.filterwarnings("ignore", message="Some donated buffers were not usable")

  worker, size = jax.process_index(), request["elements"]
  mesh = jax.sharding.Mesh(np.array(jax.devices()), (AXIS,))
  local = np.random.default_rng(worker).standard_normal((1, size), np.float32)
  grads = jax.make_array_from_process_local_data(NamedSharding(mesh, P(AXIS)), local)
  params = jax.ShapeDtypeStruct((size,), np.float32)
  out = {"worker": worker, "seconds": {}, "compute_seconds": {}, "bytes_per_device": {}}

  def fastest(call, args, name):
    """Fastest of ``repeats`` calls of ``call(*args)``, which donates its arguments (as a
    training step donates the gradient and the compressor's state): each call gets fresh
    copies, made before the clock starts, and writes its outputs over them in place."""
    fresh = lambda: common.fresh_copies(args)
    jax.block_until_ready(call(*fresh()))  # compile and warm up
    multihost_utils.sync_global_devices(f"{name} ready")
    jax.block_until_ready(call(*fresh()))  # drain the token bucket filled while waiting
    times = []
    for _ in range(request["repeats"]):
      ready = fresh()
      start = time.perf_counter()
      jax.block_until_ready(call(*ready))
      times.append(time.perf_counter() - start)
    return min(times)

  for method in request["methods"]:
    # The same method without a collective (axis_name=None), all processes at once: the part
    # of the exchange that is computation.
    runner_method, overrides = VARIANTS.get(method, (method, {}))
    local_tx = common.communication(runner_method, None, **overrides)
    local_update = jax.jit(local_tx.update, donate_argnums=(0, 1))
    local_grad = jax.numpy.asarray(local[0])
    local_state = jax.jit(local_tx.init)(local_grad)
    out["compute_seconds"][method] = fastest(local_update, (local_grad, local_state),
                                             f"{method} local")
    tx = common.communication(runner_method, AXIS, **overrides)
    specs = compressors.state_specs(tx, params, mesh, AXIS)

    def exchange(g, state, tx=tx, specs=specs):
      updates, state = tx.update(g[0], compressors.drop_device_axis(state, specs))
      return updates, compressors.add_device_axis(state, specs)

    step = jax.jit(jax.shard_map(exchange, mesh=mesh, in_specs=(P(AXIS), specs),
                                 out_specs=(P(), specs)), donate_argnums=(0, 1))
    init = jax.jit(jax.shard_map(lambda tx=tx, specs=specs: compressors.add_device_axis(
        tx.init(jax.numpy.zeros((size,), np.float32)), specs), mesh=mesh, in_specs=(),
        out_specs=specs))
    state = init()
    out["bytes_per_device"][method] = compressors.wire_bytes(step, grads, state,
                                                             mesh=mesh).total
    out["seconds"][method] = fastest(step, (grads, state), method)
  Path(request["out"], f"worker{worker}.json").write_text(json.dumps(out))
  multihost_utils.sync_global_devices("done")
  jax.distributed.shutdown()
  return out


def _run_processes(processes: int, request: dict, prefix: list[str], timeout_s: float) -> dict:
  """Runs one measurement over ``processes`` processes; the slowest process's time per method."""
  with tempfile.TemporaryDirectory(prefix="bench_links") as tmp:
    request = dict(request, out=tmp)
    cmd = prefix + [sys.executable, "-m", "experiments.launch", f"--num_processes={processes}",
                    f"--module={__name__}", "--", "--child", json.dumps(request)]
    log = Path(tmp, "log")
    with open(log, "wb") as sink:
      # Its own session, so that the launcher and the processes it started can be stopped
      # together (by this group's id) when the run exceeds its time.
      proc = subprocess.Popen(cmd, cwd=common.REPO_ROOT, env=common.cpu_env(1), stdout=sink,
                              stderr=subprocess.STDOUT, start_new_session=True)
      try:
        code = proc.wait(timeout=timeout_s)
      except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return {"skipped": f"not finished within the {timeout_s:.0f} s limit (--timeout)"}
    if code != 0:
      tail = log.read_text(errors="replace").strip()
      print(f"{__name__}: {processes} processes failed with status {code}; the log ends:\n"
            f"{tail[-4000:]}", file=sys.stderr)
      return {"error": common.error_line(tail, code)}
    results = [json.loads(Path(tmp, f"worker{i}.json").read_text()) for i in range(processes)]
  slowest = lambda key: {m: max(r[key][m] for r in results) for m in request["methods"]}
  return {"seconds": slowest("seconds"), "compute_seconds": slowest("compute_seconds"),
          "bytes_per_device": results[0]["bytes_per_device"]}


def link_times(processes: Sequence[int], elements: int, methods: Sequence[str] = METHODS, *,
               rate_bits: float | None = 1e9, repeats: int = 5,
               timeout_s: float = TIMEOUT_S, log=print) -> list[dict]:
  """Rows of B4: one per (processes, method), with ``speedup`` = dense's time / this one's.

  Args:
    processes: process counts (2 to 8), one run each.
    elements: float32 elements of the gradient.
    methods: names of :data:`METHODS` (``dense``, the reference, is added when missing).
    rate_bits: loopback rate in bits/s inside a private namespace; None for the plain loopback.
    repeats: timed exchanges per method (the fastest counts).
    timeout_s: limit for one run; its rows then say so (as does a run that fails).
    log: progress printer.
  """
  methods = ["dense"] + [m for m in common.check_methods(methods, METHODS) if m != "dense"]
  check_processes(processes)
  if rate_bits is not None:
    ok, why = calibrate.netns_available()
    if not ok:
      return [{"processes": p, "method": m, "seconds": f"skipped: {why}"}
              for p in processes for m in methods]
  request = {"elements": elements, "methods": methods, "repeats": repeats}
  rows = []
  for p in processes:
    if rate_bits is None:
      result = _run_processes(p, request, [], timeout_s)
    else:
      with calibrate.rate_limited_namespace(rate_bits) as namespace:
        result = _run_processes(p, request, ["ip", "netns", "exec", namespace], timeout_s)
    for m in methods:
      row = {"processes": p, "method": m, "elements": elements, "rate_bits": rate_bits}
      if common.not_measured(result):
        row["seconds"] = common.not_measured(result)
      else:
        seconds, wire = result["seconds"][m], result["bytes_per_device"][m]
        row.update(seconds=seconds, compute_seconds=result["compute_seconds"][m],
                   bytes_per_device=wire, speedup=result["seconds"]["dense"] / seconds,
                   link_seconds=None if rate_bits is None else p * wire * 8 / rate_bits)
        log(f"B4 {p} processes {m:6s} {seconds:8.3f} s, {wire / 1e6:8.2f} MB/device, "
            f"{row['speedup']:.1f}x dense")
      if VARIANTS.get(m, (m,))[0] == "tasc":
        row["goal"] = common.goal(row["speedup"] >= GOAL_SPEEDUP if "speedup" in row else None,
                                  f">= {GOAL_SPEEDUP:g}x faster than dense")
      rows.append(row)
  return rows


def check_processes(processes: Sequence[int]) -> None:
  """Refuses a process count outside 2 to 8."""
  for p in processes:
    if not isinstance(p, int) or not 2 <= p <= 8:
      raise ValueError(f"--processes: {p!r}; allowed: ints from 2 to 8")


def check_args(args) -> None:
  """Refuses the command-line arguments that :func:`report` would refuse, before anything runs."""
  check_processes(args.processes or DEFAULT_PROCESSES)
  common.parse_size((args.sizes or ["resnet50"])[0])
  common.check_methods(args.methods or METHODS, METHODS)
  calibrate.parse_rate(args.rate)


def report(args) -> common.Report:
  """B4 as a :class:`experiments.bench.common.Report`."""
  processes = args.processes or list(DEFAULT_PROCESSES)
  elements = common.parse_size((args.sizes or ["resnet50"])[0])
  methods = args.methods or list(METHODS)
  rate_bits = calibrate.parse_rate(args.rate)
  rows = link_times(processes, elements, methods, rate_bits=rate_bits,
                    repeats=args.repeats, timeout_s=args.timeout or TIMEOUT_S)
  rate = "unshaped loopback" if rate_bits is None else f"{rate_bits / 1e9:g} Gbit/s loopback"
  return common.Report(
      name="links",
      title=f"B4: one exchange of {elements:,} float32 between processes, {rate}",
      columns=[("processes", "processes"), ("method", "method"), ("seconds", "seconds"),
               ("speedup", "x faster than dense"), ("compute_seconds", "compute s"),
               ("bytes_per_device", "bytes/device"), ("link_seconds", "link s"),
               ("goal", "goal")],
      rows=rows,
      notes=[
          "jax.distributed over gloo, one CPU device per process, in a private network "
          "namespace whose loopback is shaped by tc tbf (experiments.bench.calibrate); all "
          "processes share the one loopback, and 2 CPU cores.",
          "seconds: fastest exchange (encode, collectives, decode; the gradient and the "
          "compressor's state donated, as in a training step) of the slowest process; "
          "compute: the same method without a collective (axis_name=None), all processes at "
          "once; bytes/device from the compiled HLO; link: processes x bytes/device at the "
          "rate (the time the shared loopback needs to carry them all).",
      ],
      settings={"processes": list(processes), "elements": elements, "methods": list(methods),
                "rate_bits": rate_bits, "repeats": args.repeats},
      num_workers=list(processes), process_count=list(processes))


if __name__ == "__main__":
  common.child_main(None, measure)
