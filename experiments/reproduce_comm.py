"""The paper's communication results: F1 (bytes against workers, compiled), F2 (communication
time from the alpha-beta cost model) and F3 (communication time measured over a rate-limited
loopback, beside the model's prediction).

F1 reuses :func:`experiments.bench_bytes.bytes_vs_workers` (one child process per worker count,
compile only), F2 :mod:`compressors.topology`, F3 :func:`experiments.calibrate.calibrate` (the
fitted loopback) and :func:`experiments.bench_links.link_times` (dense, top-k and TASC exchanges
timed between processes). Every measurement lands in a run directory
(:func:`experiments.reproduce_report.write_run`) that the report reads back.
"""

import math
import os
from collections.abc import Sequence

import numpy as np

from experiments import reproduce_report as report_lib
from experiments.reproduce_report import Claim
from experiments.reproduce_report import Report

# ----------------------------------------------------------------------------- F1


def f1_run_name(workers: int) -> str:
  return f"workers_{workers:03d}"


def run_f1(settings, workdir: str, log=print) -> None:
  """Compiles every exchange at every worker count of ``settings`` (skipping finished ones)."""
  from experiments import bench_bytes  # pylint: disable=import-outside-toplevel
  for n in settings.workers:
    run_dir = os.path.join(workdir, f1_run_name(n))
    if os.path.exists(os.path.join(run_dir, report_lib.RESULTS_FILE)):
      continue
    rows = bench_bytes.bytes_vs_workers([n], list(settings.sizes), list(settings.methods),
                                        timeout_s=settings.timeout_s, log=log)
    config = {"function": "experiments.bench_bytes.bytes_vs_workers", "workers": n,
              "sizes": list(settings.sizes), "methods": list(settings.methods),
              "group": bench_bytes.NODE_SIZE}
    report_lib.write_run(run_dir, config, [{"step": 0, **r} for r in rows], {"rows": rows})


def f1_rows(settings, workdir: str) -> list[dict]:
  rows = []
  for n in settings.workers:
    run = report_lib.read_run(os.path.join(workdir, f1_run_name(n)))
    if run is None or not run.finished:
      continue
    for r in run.results["rows"]:
      rows.append({**{k: r.get(k) for k in ("workers", "size", "method", "elements",
                                            "bytes_per_device", "slow_axis_bytes", "vs_dense")},
                   "status": r.get("skipped") or r.get("error") or "measured",
                   "run_dir": report_lib.relative(run.path)})
  return rows


def f1_claims(rows: list[dict]) -> list[Claim]:
  def bytes_at(size, method, n):
    return next((r["slow_axis_bytes"] for r in rows if r["size"] == size and r["method"] ==
                 method and r["workers"] == n and r.get("slow_axis_bytes")), None)
  sizes = sorted({r["size"] for r in rows})
  workers = sorted({r["workers"] for r in rows})
  claims = []
  if not workers:
    return [Claim("top-k all-gather grows linearly with workers", "Renggli et al., SC'19", "not "
                  "run", None)]
  lo, hi = workers[0], workers[-1]
  growth = {s: (bytes_at(s, "topk", hi) or math.nan) / (bytes_at(s, "topk", lo) or math.nan)
            for s in sizes}
  claims.append(Claim(
      "Top-k's all-gather moves about 2k(p-1) words per worker: linear in p",
      "SparCML (Renggli et al., SC'19); REFERENCES.md",
      "; ".join(f"{s}: x{g:.1f} from {lo} to {hi} workers (p-1 ratio {(hi - 1) / (lo - 1):.0f})"
                for s, g in growth.items()),
      None if any(math.isnan(g) for g in growth.values()) else all(
          g >= 0.5 * (hi - 1) / (lo - 1) for g in growth.values()),
      "compiled HLO bytes"))
  flat = {s: (bytes_at(s, "tasc", hi) or math.nan) / (bytes_at(s, "tasc", lo) or math.nan)
          for s in sizes}
  claims.append(Claim(
      "A shared-support (TASC) all-reduce's bytes per worker do not grow with p",
      "TASC (unverified); ring all-reduce 2(p-1)/p n", "; ".join(
          f"{s}: x{g:.2f} from {lo} to {hi} workers" for s, g in flat.items()),
      None if any(math.isnan(g) for g in flat.values()) else all(
          g < 2.5 for g in flat.values()), "bounded by the ring's 2(p-1)/p <= 2"))
  onebit = {s: (bytes_at(s, "dense", hi) or math.nan) / (bytes_at(s, "onebit", hi) or math.nan)
            for s in sizes}
  claims.append(Claim(
      "1-bit two-phase exchange: about 2 x 1/32 of dense per worker regardless of p "
      "(16x fewer bytes than a dense all-reduce)", "1-bit Adam (Tang et al. 2021)",
      "; ".join(f"{s}: dense/onebit {g:.1f}x at {hi} workers" for s, g in onebit.items()),
      None if any(math.isnan(g) for g in onebit.values()) else all(
          12 <= g <= 40 for g in onebit.values()), "ring dense 2(p-1)/p n words vs 2(p-1)/p n/32"))
  return claims


def f1_report(settings, workdir: str, *, full: bool) -> Report:
  rows = f1_rows(settings, workdir)
  methods, sizes = list(settings.methods), list(settings.sizes)

  def plot(fig):
    for i, size in enumerate(sizes):
      ax = fig.add_axes([0.07 + 0.48 * i, 0.2, 0.42, 0.72])
      for method in methods:
        points = sorted((r["workers"], r["slow_axis_bytes"]) for r in rows
                        if r["size"] == size and r["method"] == method and r["slow_axis_bytes"])
        if points:
          ax.plot(*zip(*points), marker="o", label=method)
      ax.set_xscale("log", base=2)
      ax.set_yscale("log")
      ax.set_xlabel("workers")
      ax.set_ylabel("bytes per device per exchange (compiled HLO)")
      ax.set_title(f"{size} gradient")
      ax.grid(alpha=0.3)
      ax.legend(fontsize=7)

  table = []
  for size in sizes:
    for method in methods:
      line = {"size": size, "method": method}
      for r in rows:
        if r["size"] == size and r["method"] == method:
          line[f"n{r['workers']}"] = (r["slow_axis_bytes"] / 1e6 if r["slow_axis_bytes"]
                                      else r["status"])
          line["run_dirs"] = " ".join(filter(None, [line.get("run_dirs"), r["run_dir"]])) if \
              r["run_dir"] not in line.get("run_dirs", "") else line["run_dirs"]
      table.append(line)
  return Report(
      name="f1", title="F1: wire bytes per device against the number of workers (compile only)",
      columns=[("size", "gradient"), ("method", "method")]
      + [(f"n{n}", f"{n} workers (MB)") for n in settings.workers] + [("run_dirs", "run dirs")],
      rows=table, claims=f1_claims(rows),
      configs=[f"configs/paper/f1.py{':full=true' if full else ''}",
               "experiments/bench_bytes.py (bytes_vs_workers)"],
      notes=["Nothing runs: each worker count is a child process simulating that many CPU "
             "devices; compressors.wire_bytes reads each device's bytes from the compiled HLO "
             "(all-reduce 2(n-1)/n S, all-gather (n-1)/n S, all-to-all (n-1)/n S).",
             "ResNet-50 (25,557,032 parameters) and BERT-base with its masked-LM head, real layer "
             "shapes. topk/randomk/tasc at density 0.01 (TASC blocks of 256 plus one score per "
             "block), PowerSGD rank 4 per matrix, 1-bit two-phase; tasc_hierarchical: mesh "
             "(n/8, 8), bytes that cross nodes (none below 16 workers).",
             "The CSV has one row per (gradient, method); the per-worker-count rows are in each "
             "run directory's metrics.jsonl."],
      plot=plot)


# ----------------------------------------------------------------------------- F2


def _parameters(model: str) -> int:
  """Parameter count of a named model (``jax.eval_shape`` of its ``init``)."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from experiments import bench_common  # pylint: disable=import-outside-toplevel
  from experiments import models  # pylint: disable=import-outside-toplevel
  if model in bench_common.SIZES:
    return bench_common.SIZES[model]
  if model == "vgg19_cifar":
    module, x = models.VGG(num_classes=10, depth=19), jnp.zeros((1, 32, 32, 3))
  else:
    raise ValueError(f"F2: model {model!r} unknown; allowed: vgg19_cifar, "
                     f"{sorted(bench_common.SIZES)}")
  shapes = jax.eval_shape(lambda: module.init(jax.random.PRNGKey(0), x, train=False))["params"]
  return int(sum(math.prod(s.shape) for s in jax.tree.leaves(shapes)))


def tasc_cost(topology, n: int, density: float, block_size: int):
  """Modelled TASC exchange: all-reduce of the ``n / block_size`` block scores, then of the
  ``K * block_size`` shared-support payload, each by the model's fastest dense schedule.

  Returns:
    ``(seconds, bytes sent per device, schedules used)``.
  """
  from compressors import topology as topo  # pylint: disable=import-outside-toplevel
  blocks = math.ceil(n / block_size)
  payload = max(1, round(density * blocks)) * block_size
  time = sent = 0.0
  used = []
  for elements in (blocks, payload):
    schedule = topo.fastest_schedule(topology, elements)
    cost = topo.dense_cost(schedule, topology, elements)
    time, sent = time + cost.time, sent + cost.bytes_sent
    used.append(schedule)
  return time, sent, "+".join(used)


def _topology(name: str, nodes: int, gpus: int):
  from compressors import topology as topo  # pylint: disable=import-outside-toplevel
  presets = {"v100_nvlink_25gbe": topo.v100_nvlink_25gbe, "cloud_10gbe": topo.cloud_10gbe,
             "h100_nvlink_ib400": topo.h100_nvlink_ib400}
  if name not in presets:
    raise ValueError(f"F2: topology {name!r} unknown; allowed: {sorted(presets)}")
  return presets[name](nodes=nodes, gpus_per_node=gpus)


def run_f2(settings, workdir: str) -> None:
  """Prices every F2 case with the cost model; writes ``workdir/f2`` (always recomputed: the
  model takes seconds)."""
  from compressors import topology as topo  # pylint: disable=import-outside-toplevel
  records = []
  vgg = _parameters(settings.vgg.model)
  for nodes in settings.vgg.nodes:
    t = _topology(settings.topology, nodes, settings.gpus_per_node)
    ring = topo.dense_cost("ring", t, vgg).time
    best_dense = topo.fastest_schedule(t, vgg)
    best = topo.dense_cost(best_dense, t, vgg).time
    for density in settings.densities:
      tasc, sent, used = tasc_cost(t, vgg, density, settings.block_size)
      records.append({"part": "vgg", "model": settings.vgg.model, "parameters": vgg,
                      "nodes": nodes, "gpus": nodes * settings.gpus_per_node,
                      "density": density, "dense_ring_s": ring, "dense_best_s": best,
                      "dense_best_schedule": best_dense, "tasc_s": tasc,
                      "tasc_schedules": used, "tasc_bytes": sent,
                      "speedup_vs_ring": ring / tasc, "speedup_vs_best_dense": best / tasc})
  r50 = _parameters("resnet50")
  compute = settings.scaling.batch_per_gpu / settings.scaling.images_per_second
  for nodes in settings.scaling.nodes:
    t = _topology(settings.topology, nodes, settings.gpus_per_node)
    gpus = nodes * settings.gpus_per_node
    schemes = {"dense ring": topo.dense_cost("ring", t, r50).time}
    best_dense = topo.fastest_schedule(t, r50)
    schemes[f"dense {best_dense}"] = topo.dense_cost(best_dense, t, r50).time
    for density in settings.densities:
      schemes[f"tasc {density:g}"] = tasc_cost(t, r50, density, settings.block_size)[0]
    for scheme, comm in schemes.items():
      efficiency = compute / (compute + comm)
      records.append({"part": "scaling", "model": "resnet50", "parameters": r50,
                      "nodes": nodes, "gpus": gpus, "scheme": scheme, "compute_s": compute,
                      "comm_s": comm, "efficiency": efficiency, "speedup": gpus * efficiency,
                      "speedup_overlapped": gpus * compute / max(compute, comm)})
  for model in settings.sparse.models:
    n = _parameters(model)
    for name, nodes, gpus in settings.sparse.topologies:
      t = _topology(name, nodes, gpus)
      ring = topo.dense_cost("ring", t, n).time
      for density in settings.sparse.densities:
        tasc, _, used = tasc_cost(t, n, density, settings.block_size)
        sparcml = topo.collective_cost("sparse_butterfly", t, n, density).time
        records.append({"part": "sparse", "model": model, "parameters": n, "topology": name,
                        "nodes": nodes, "gpus": nodes * gpus, "density": density,
                        "dense_ring_s": ring, "tasc_s": tasc, "tasc_schedules": used,
                        "speedup_vs_ring": ring / tasc, "sparse_butterfly_s": sparcml,
                        "sparse_butterfly_speedup": ring / sparcml})
  config = {"topology": settings.topology, "gpus_per_node": settings.gpus_per_node,
            "densities": list(settings.densities), "block_size": settings.block_size,
            "vgg": settings.vgg.to_dict(), "scaling": settings.scaling.to_dict(),
            "sparse": settings.sparse.to_dict(), "cost_model": "compressors.topology"}
  report_lib.write_run(workdir, config, [{"step": i, **r} for i, r in enumerate(records)],
                       {"records": len(records)})


def f2_report(settings, workdir: str, *, full: bool) -> Report:
  run = report_lib.read_run(workdir)
  records = [] if run is None else [{k: v for k, v in r.items() if k != "step"}
                                    for r in run.metrics]
  vgg = [r for r in records if r["part"] == "vgg"]
  scaling = [r for r in records if r["part"] == "scaling"]
  sparse = [r for r in records if r["part"] == "sparse"]
  run_dir = report_lib.relative(workdir)
  rows = []
  for r in vgg:
    rows.append({"case": f"VGG-19 ({r['parameters']:,} params), {r['nodes']} node(s) x "
                         f"{settings.gpus_per_node}", "scheme": f"tasc density {r['density']:g}",
                 "value": r["speedup_vs_ring"], "unit": "x faster than dense ring",
                 "detail": f"ring {r['dense_ring_s'] * 1e3:.2f} ms, best dense "
                           f"({r['dense_best_schedule']}) {r['dense_best_s'] * 1e3:.2f} ms, tasc "
                           f"{r['tasc_s'] * 1e3:.3f} ms ({r['tasc_schedules']}); "
                           f"{r['speedup_vs_best_dense']:.1f}x vs best dense",
                 "run_dir": run_dir})
  for r in scaling:
    rows.append({"case": f"ResNet-50 on {r['gpus']} GPUs", "scheme": r["scheme"],
                 "value": r["speedup"], "unit": "x speed-up over 1 GPU (no overlap)",
                 "detail": f"comm {r['comm_s'] * 1e3:.2f} ms vs compute "
                           f"{r['compute_s'] * 1e3:.0f} ms, efficiency {r['efficiency']:.1%}, "
                           f"{r['speedup_overlapped']:.0f}x with full overlap",
                 "run_dir": run_dir})
  for r in sparse:
    rows.append({"case": f"{r['model']} ({r['parameters']:,}), {r['topology']} "
                         f"{r['nodes']}x{r['gpus'] // r['nodes']}",
                 "scheme": f"tasc shared support, density {r['density']:g}",
                 "value": r["speedup_vs_ring"], "unit": "x faster than dense ring",
                 "detail": f"sparse butterfly (SparCML, per-worker supports): "
                           f"{r['sparse_butterfly_speedup']:.1f}x", "run_dir": run_dir})

  def plot(fig):
    ax0 = fig.add_axes([0.05, 0.2, 0.2, 0.72])
    labels = [f"{r['nodes']}x{settings.gpus_per_node}\n{r['density']:g}" for r in vgg]
    ax0.bar(range(len(vgg)), [r["speedup_vs_ring"] for r in vgg], label="vs dense ring")
    ax0.bar(range(len(vgg)), [r["speedup_vs_best_dense"] for r in vgg], width=0.4,
            label="vs best dense schedule")
    for nodes, published in ((1, 2.6), (2, 11.0)):
      xs = [i for i, r in enumerate(vgg) if r["nodes"] == nodes]
      if xs:
        ax0.plot([min(xs) - 0.4, max(xs) + 0.4], [published] * 2, color="black", ls="--")
    ax0.set_xticks(range(len(vgg)), labels, fontsize=7)
    ax0.set_yscale("log")
    ax0.set_ylabel("TASC communication speed-up (model)")
    ax0.set_title("VGG-19: TASC vs dense\n(dashes: claims 2.6x, 11x)", fontsize=9)
    ax0.legend(fontsize=6)
    ax = fig.add_axes([0.32, 0.2, 0.3, 0.72])
    for scheme in dict.fromkeys(r["scheme"] for r in scaling):
      points = [(r["gpus"], r["speedup"]) for r in scaling if r["scheme"] == scheme]
      ax.plot(*zip(*points), marker="o", label=scheme)
    if scaling:
      gpus = sorted({r["gpus"] for r in scaling})
      ax.plot(gpus, gpus, color="grey", ls=":", label="linear")
      ax.plot([512], [462], marker="*", markersize=12, color="black", ls="",
              label="AIACC claim: 462x on 512")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("GPUs (8 per node, 25 Gbit/s between nodes)")
    ax.set_ylabel("modelled speed-up over one GPU")
    ax.set_title("ResNet-50 scaling (cost model, no overlap)", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    ax2 = fig.add_axes([0.68, 0.2, 0.31, 0.72])
    short = {"resnet50": "R50", "vgg19_cifar": "VGG19", "bert_base": "BERT"}
    labels = [f"{short.get(r['model'], r['model'])} {r['nodes']}x{r['gpus'] // r['nodes']} "
              f"{r['density']:g}" for r in sparse]
    ax2.bar(range(len(sparse)), [r["speedup_vs_ring"] for r in sparse], label="TASC shared "
            "support")
    ax2.bar(range(len(sparse)), [r["sparse_butterfly_speedup"] for r in sparse], width=0.4,
            label="sparse butterfly (SparCML)")
    ax2.axhline(30, color="black", ls="--", lw=0.8, label="TASC claim: up to 30x")
    ax2.set_yscale("log")
    ax2.set_xticks(range(len(sparse)), labels, fontsize=6, rotation=90)
    ax2.set_ylabel("x faster than dense ring (model)")
    ax2.set_title("Structured sparse all-reduce vs dense ring", fontsize=9)
    ax2.legend(fontsize=7)

  return Report(
      name="f2", title="F2: modelled communication time (alpha-beta cost model)",
      columns=[("case", "case"), ("scheme", "scheme"), ("value", "value"), ("unit", "unit"),
               ("detail", "detail"), ("run_dir", "run dir")],
      rows=rows, claims=f2_claims(settings, vgg, scaling, sparse),
      configs=[f"configs/paper/f2.py{':full=true' if full else ''}"],
      notes=[
          f"Topology: compressors.topology.{settings.topology} (V100s on NVLink2 150 GB/s per "
          "direction, one 25 Gbit/s NIC per node shared by its 8 GPUs; nominal datasheet "
          "figures, typical latencies: not calibrated).",
          f"TASC: block scores (1 float per {settings.block_size}-element block) all-reduced, "
          "then K blocks, each by the schedule the model finds fastest (ring, butterfly, "
          "Rabenseifner or hierarchical); compute and compression kernels are not priced.",
          f"Scaling: compute time per step assumed {settings.scaling.batch_per_gpu} images / "
          f"{settings.scaling.images_per_second:g} images/s = "
          f"{settings.scaling.batch_per_gpu / settings.scaling.images_per_second * 1e3:.0f} ms "
          "(a V100's ResNet-50 mixed-precision training throughput, NVIDIA's published figure "
          "is about 1,200-1,400 images/s); speed-up = GPUs x compute / (compute + "
          "communication), no overlap; full overlap in the detail column. The 462x claim is "
          "for P100s, whose slower compute hides communication better.",
          "Models: VGG-19 for CIFAR (TASC's VGG-19 experiments), ResNet-50 25,557,032 and "
          "BERT-base 109,482,240 parameters, float32 gradients.",
      ],
      plot=plot)


def f2_claims(settings, vgg, scaling, sparse) -> list[Claim]:
  claims = []
  density = settings.densities[0]
  for nodes, published in ((1, 2.6), (2, 11.0)):
    r = next((r for r in vgg if r["nodes"] == nodes and r["density"] == density), None)
    ours = "not run" if r is None else (
        f"{r['speedup_vs_ring']:.1f}x vs dense ring ({r['speedup_vs_best_dense']:.1f}x vs the "
        f"best dense schedule) at density {density:g}")
    claims.append(Claim(
        f"TASC: {published:g}x communication speed-up over dense ring, VGG-19 on {nodes} x 8 "
        "GPUs", "TASC (Dong, Keutzer et al., unverified)", ours,
        None if r is None else r["speedup_vs_ring"] >= published,
        "modelled (no measurement on GPUs); the density of the claim is not stated"))
  at512 = [r for r in scaling if r["gpus"] == 512]
  best = max(at512, key=lambda r: r["speedup"], default=None)
  claims.append(Claim(
      "462x speed-up on 512 GPUs (90% scaling efficiency), ResNet-50",
      "Alibaba AIACC (P100s; unverified)",
      "not run" if best is None else "; ".join(
          f"{r['scheme']}: {r['speedup']:.0f}x ({r['efficiency']:.0%})" for r in at512),
      None if best is None else best["speedup"] >= 462,
      "modelled with an assumed V100 compute time, no overlap of communication and compute"))
  top = max(sparse, key=lambda r: r["speedup_vs_ring"], default=None)
  claims.append(Claim(
      "Structured sparse all-reduce up to 30x faster than dense ring",
      "TASC (Dong, Keutzer et al., unverified)",
      "not run" if top is None else
      f"up to {top['speedup_vs_ring']:.0f}x ({top['model']}, {top['topology']} "
      f"{top['nodes']}x{top['gpus'] // top['nodes']}, density {top['density']:g})",
      None if top is None else top["speedup_vs_ring"] >= 30,
      "modelled; grows with sparsity as 1 / (density + 1/block_size) until latency dominates"))
  return claims


# ----------------------------------------------------------------------------- F3


def f3_run_name(processes: int, rate: str) -> str:
  return f"p{processes}_{rate}"


def predicted_times(topology, elements: int, density: float, block_size: int) -> dict:
  """The cost model's seconds for the three exchanges F3 times, on the fitted loopback."""
  from compressors import topology as topo  # pylint: disable=import-outside-toplevel
  blocks = math.ceil(elements / block_size)
  payload = max(1, round(density * blocks)) * block_size
  return {"dense": topo.dense_cost("psum", topology, elements).time,
          "topk": topo.collective_cost("topk_allgather", topology, elements, density).time,
          "tasc": (topo.dense_cost("psum", topology, blocks).time
                   + topo.dense_cost("psum", topology, payload).time)}


def run_f3(settings, workdir: str, log=print) -> str | None:
  """Calibrates and times each (processes, rate) of ``settings``; returns why it was skipped,
  or None."""
  from experiments import bench_links  # pylint: disable=import-outside-toplevel
  from experiments import calibrate  # pylint: disable=import-outside-toplevel
  ok, why = calibrate.netns_available()
  if not ok:
    return why
  for processes in settings.processes:
    for rate in settings.rates:
      run_dir = os.path.join(workdir, f3_run_name(processes, rate))
      if os.path.exists(os.path.join(run_dir, report_lib.RESULTS_FILE)):
        continue
      rate_bits = calibrate.parse_rate(rate)
      fit = calibrate.calibrate(processes, rate_bits, message_bytes=settings.message_bytes,
                                allreduce_elements=settings.elements,
                                timeout_s=settings.timeout_s)
      log(str(fit))
      predicted = predicted_times(fit.topology(), settings.elements, settings.density,
                                  settings.block_size)
      rows = bench_links.link_times([processes], settings.elements, list(settings.methods),
                                    rate_bits=rate_bits, repeats=settings.repeats,
                                    timeout_s=settings.timeout_s, log=log)
      for row in rows:
        row["predicted_s"] = predicted.get(row["method"])
      config = {"processes": processes, "rate": rate, "elements": settings.elements,
                "density": settings.density, "block_size": settings.block_size,
                "methods": list(settings.methods), "repeats": settings.repeats,
                "message_bytes": list(settings.message_bytes),
                "functions": ["experiments.calibrate.calibrate",
                              "experiments.bench_links.link_times"]}
      calibration = {"alpha_s": fit.alpha, "beta_s_per_byte": fit.beta, "gamma": fit.gamma,
                     "fitted_rate_bits": fit.fitted_rate_bits, "shared": fit.shared,
                     "allreduce_measured_s": fit.allreduce_seconds,
                     "allreduce_predicted_s": fit.predicted["allreduce"]}
      report_lib.write_run(run_dir, config, [{"step": 0, **r} for r in rows],
                           {"calibration": calibration, "rows": rows})
  return None


def f3_report(settings, workdir: str, *, full: bool, skipped: str | None) -> Report:
  rows = []
  for processes in settings.processes:
    for rate in settings.rates:
      run = report_lib.read_run(os.path.join(workdir, f3_run_name(processes, rate)))
      if run is None or not run.finished:
        continue
      cal = run.results["calibration"]
      for r in run.results["rows"]:
        measured = r.get("seconds")
        predicted = r.get("predicted_s")
        numeric = isinstance(measured, (int, float))
        rows.append({
            "processes": processes, "rate": rate, "method": r["method"],
            "measured_s": measured if numeric else None,
            "predicted_s": predicted,
            "model_over_measured": predicted / measured if numeric and predicted else None,
            "speedup_vs_dense": r.get("speedup"),
            "bytes_per_device": r.get("bytes_per_device"),
            "fitted_gbit": cal["fitted_rate_bits"] / 1e9,
            "status": "measured" if numeric else measured,
            "run_dir": report_lib.relative(run.path)})

  def plot(fig):
    ax = fig.add_axes([0.08, 0.2, 0.9, 0.72])
    labels = [f"{r['processes']}p {r['rate']}\n{r['method']}" for r in rows]
    x = np.arange(len(rows))
    ax.bar(x - 0.2, [r["measured_s"] or 0 for r in rows], width=0.4, label="measured")
    ax.bar(x + 0.2, [r["predicted_s"] or 0 for r in rows], width=0.4,
           label="model (communication only)")
    ax.set_xticks(x, labels, fontsize=6)
    ax.set_yscale("log")
    ax.set_ylabel("seconds per exchange")
    ax.set_title("F3: exchange time over a rate-limited loopback, measured vs modelled")
    ax.legend()

  notes = [
      f"{settings.elements:,} float32 elements (quick settings; full: ResNet-50's 25,557,032); "
      f"top-k and TASC at density {settings.density:g}, TASC blocks of {settings.block_size} "
      "(block magnitudes: no curvature is passed).",
      "Measured: experiments.bench_links.link_times, processes joined by jax.distributed (gloo) "
      "inside a private network namespace whose loopback is shaped by tc tbf; fastest of "
      f"{settings.repeats} exchanges of the slowest process, compute (top-k selection, "
      "scoring) included.",
      "Model: experiments.calibrate fits alpha and beta from ping-pong times over the same "
      "shaped loopback (one shared medium), then compressors.topology prices the exchange's "
      "collectives; compression compute is not modelled, so a model/measured ratio below 1 is "
      "the compute share.",
  ]
  if skipped:
    notes.insert(0, f"SKIPPED: {skipped} (needs root and `ip netns`).")
  return Report(
      name="f3", title="F3: measured communication time over a rate-limited loopback",
      columns=[("processes", "processes"), ("rate", "rate"), ("method", "method"),
               ("measured_s", "measured s"), ("predicted_s", "model s"),
               ("model_over_measured", "model / measured"),
               ("speedup_vs_dense", "x faster than dense (measured)"),
               ("bytes_per_device", "bytes/device"), ("fitted_gbit", "fitted Gbit/s"),
               ("status", "status"), ("run_dir", "run dir")],
      rows=rows, claims=f3_claims(rows),
      configs=[f"configs/paper/f3.py{':full=true' if full else ''}"], notes=notes,
      plot=plot if rows else None)


def f3_claims(rows: Sequence[dict]) -> list[Claim]:
  ratios = [r["model_over_measured"] for r in rows
            if r["method"] == "dense" and r["model_over_measured"]]
  dense = ("not measured" if not ratios else
           f"dense all-reduce: model / measured from {min(ratios):.2f} to {max(ratios):.2f}")
  tasc = [r["speedup_vs_dense"] for r in rows if r["method"] == "tasc" and r["speedup_vs_dense"]]
  return [
      Claim("The alpha-beta model predicts a dense ring all-reduce's time", "Thakur, "
            "Rabenseifner & Gropp 2005", dense,
            None if not ratios else all(0.5 <= r <= 2 for r in ratios), "within 2x counts"),
      Claim("TASC's exchange is many times faster than dense on a slow link (2.6x-11x for "
            "VGG-19 on GPUs)", "TASC (Dong, Keutzer et al., unverified)",
            "not measured" if not tasc else
            f"TASC {min(tasc):.1f}x to {max(tasc):.1f}x faster than dense (measured, compute "
            "included)", None if not tasc else min(tasc) >= 2.6,
            "CPU processes on one loopback, not GPUs on NVLink/Ethernet"),
  ]
