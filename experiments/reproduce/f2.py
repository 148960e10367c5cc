"""F2: communication time from the alpha-beta cost model (:mod:`compressors.network.topology`).

VGG-19 on one and two nodes of 8 V100s (TASC's published speed-ups), ResNet-50 scaling from 8 to
512 GPUs with an assumed compute time per step, and TASC's shared-support all-reduce against
dense ring for three models and topologies. Nothing trains or runs on devices: the model prices
every case in seconds, into one run directory that the report reads back. Settings:
``configs/paper/f2.py``.
"""

import functools
import math
import os

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np

from compressors.network import topology as topo
from configs.paper import f2 as f2_config
from experiments import models
from experiments.bench import common as bench_common
from experiments.reproduce import common
from experiments.reproduce import plots
from experiments.reproduce import report as report_lib
from experiments.reproduce.report import Claim
from experiments.reproduce.report import Report

TITLE = ("F2: modelled communication time (VGG-19 speed-up, ResNet-50 scaling, sparse "
         "all-reduce)")


def run_folders(options: common.Options) -> list[str]:
  """F2's run directory."""
  return [os.path.join(options.workdir, "f2")]


def produce(options: common.Options) -> Report:
  """Prices every case (unless ``report_only``); the figure."""
  settings = f2_config.get_config(options.config_arg())
  [workdir] = run_folders(options)
  if not options.report_only:
    price(settings, workdir)
  return report(settings, workdir, full=options.full)


def _parameters(model: str) -> int:
  """Parameter count of a named model (``jax.eval_shape`` of its ``init``)."""
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
  presets = {"v100_nvlink_25gbe": topo.v100_nvlink_25gbe, "cloud_10gbe": topo.cloud_10gbe,
             "h100_nvlink_ib400": topo.h100_nvlink_ib400}
  if name not in presets:
    raise ValueError(f"F2: topology {name!r} unknown; allowed: {sorted(presets)}")
  return presets[name](nodes=nodes, gpus_per_node=gpus)


def price(settings, workdir: str) -> None:
  """Prices every F2 case with the cost model; writes ``workdir/f2`` (always recomputed: the
  model takes seconds)."""
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
            "sparse": settings.sparse.to_dict(), "cost_model": "compressors.network.topology"}
  report_lib.write_run(workdir, config, [{"step": i, **r} for i, r in enumerate(records)],
                       {"records": len(records)})


def report(settings, workdir: str, *, full: bool) -> Report:
  """F2's figure, table and claims from its run directory.

  Args:
    settings: ``configs/paper/f2.py``'s config.
    workdir: F2's run directory.
    full: whether the settings are the full ones (for the configs named).

  Returns:
    The report ``f2``.
  """
  run = report_lib.read_run(workdir)
  records = [] if run is None else [{k: v for k, v in r.items() if k != "step"}
                                    for r in run.metrics]
  vgg = [r for r in records if r["part"] == "vgg"]
  scaling = [r for r in records if r["part"] == "scaling"]
  sparse = [r for r in records if r["part"] == "sparse"]
  return Report(
      name="f2", title="F2: modelled communication time (alpha-beta cost model)",
      columns=[("case", "case"), ("scheme", "scheme"), ("value", "value"), ("unit", "unit"),
               ("detail", "detail"), ("run_dir", "run dir")],
      rows=table_rows(settings, vgg, scaling, sparse, report_lib.relative(workdir)),
      claims=claims(settings, vgg, scaling, sparse),
      configs=[f"configs/paper/f2.py{':full=true' if full else ''}"],
      notes=notes(settings),
      plot=functools.partial(plot, settings, vgg, scaling, sparse))


def table_rows(settings, vgg: list[dict], scaling: list[dict], sparse: list[dict],
               run_dir: str) -> list[dict]:
  """F2's table: one row per VGG-19 case, ResNet-50 scaling point and sparse all-reduce case."""
  table = []
  for r in vgg:
    table.append({"case": f"VGG-19 ({r['parameters']:,} params), {r['nodes']} node(s) x "
                          f"{settings.gpus_per_node}", "scheme": f"tasc density {r['density']:g}",
                  "value": r["speedup_vs_ring"], "unit": "x faster than dense ring",
                  "detail": f"ring {r['dense_ring_s'] * 1e3:.2f} ms, best dense "
                            f"({r['dense_best_schedule']}) {r['dense_best_s'] * 1e3:.2f} ms, "
                            f"tasc {r['tasc_s'] * 1e3:.3f} ms ({r['tasc_schedules']}); "
                            f"{r['speedup_vs_best_dense']:.1f}x vs best dense",
                  "run_dir": run_dir})
  for r in scaling:
    table.append({"case": f"ResNet-50 on {r['gpus']} GPUs", "scheme": r["scheme"],
                  "value": r["speedup"], "unit": "x speed-up over 1 GPU (no overlap)",
                  "detail": f"comm {r['comm_s'] * 1e3:.2f} ms vs compute "
                            f"{r['compute_s'] * 1e3:.0f} ms, efficiency {r['efficiency']:.1%}, "
                            f"{r['speedup_overlapped']:.0f}x with full overlap",
                  "run_dir": run_dir})
  for r in sparse:
    table.append({"case": f"{r['model']} ({r['parameters']:,}), {r['topology']} "
                          f"{r['nodes']}x{r['gpus'] // r['nodes']}",
                  "scheme": f"tasc shared support, density {r['density']:g}",
                  "value": r["speedup_vs_ring"], "unit": "x faster than dense ring",
                  "detail": f"sparse butterfly (SparCML, per-worker supports): "
                            f"{r['sparse_butterfly_speedup']:.1f}x", "run_dir": run_dir})
  return table


def notes(settings) -> list[str]:
  """F2's assumptions: the topology, what TASC's cost counts, the compute time, the models."""
  return [
      f"Topology: compressors.network.topology.{settings.topology} (V100s on NVLink2 150 GB/s "
      "per direction, one 25 Gbit/s NIC per node shared by its 8 GPUs; nominal datasheet "
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
  ]


def plot(settings, vgg: list[dict], scaling: list[dict], sparse: list[dict], fig) -> None:
  """F2's figure: VGG-19's speed-ups, ResNet-50's scaling, the sparse all-reduce's speed-ups."""
  _plot_vgg(fig.add_axes([0.05, 0.2, 0.2, 0.72]), vgg, settings.gpus_per_node)
  _plot_scaling(fig.add_axes([0.32, 0.2, 0.3, 0.72]), scaling)
  _plot_sparse(fig.add_axes([0.68, 0.2, 0.31, 0.72]), sparse)


def _plot_vgg(ax, vgg: list[dict], gpus_per_node: int) -> None:
  """TASC's modelled speed-up on VGG-19 against dense, a bar per (nodes, density), the
  published claims dashed over their node counts."""
  labels = [f"{r['nodes']}x{gpus_per_node}\n{r['density']:g}" for r in vgg]
  ax.bar(range(len(vgg)), [r["speedup_vs_ring"] for r in vgg], label="vs dense ring")
  ax.bar(range(len(vgg)), [r["speedup_vs_best_dense"] for r in vgg], width=0.4,
         label="vs best dense schedule")
  for nodes, published in ((1, 2.6), (2, 11.0)):
    xs = [i for i, r in enumerate(vgg) if r["nodes"] == nodes]
    if xs:
      ax.plot([min(xs) - 0.4, max(xs) + 0.4], [published] * 2, color="black", ls="--")
  ax.set_xticks(range(len(vgg)), labels, fontsize=8)
  ax.set_yscale("log")
  plots.decorate(ax, ylabel="TASC communication speed-up (model)",
                 title="VGG-19: TASC vs dense\n(dashes: claims 2.6x, 11x)", title_size=9,
                 legend_size=8, legend_loc="upper left", grid=None)


def _plot_scaling(ax, scaling: list[dict]) -> None:
  """ResNet-50's modelled speed-up over one GPU against the GPU count, one line per scheme,
  beside linear scaling and AIACC's claim."""
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
  plots.decorate(ax, xlabel="GPUs (8 per node, 25 Gbit/s between nodes)",
                 ylabel="modelled speed-up over one GPU",
                 title="ResNet-50 scaling (cost model, no overlap)", title_size=9,
                 legend_size=8)


def _plot_sparse(ax, sparse: list[dict]) -> None:
  """The structured sparse all-reduce against the dense ring: one group of bars per model and
  topology, one bar per density, the sparse butterfly's speed-up marked on each."""
  short = {"resnet50": "R50", "vgg19_cifar": "VGG19", "bert_base": "BERT"}
  groups = list(dict.fromkeys((r["model"], r["nodes"], r["gpus"]) for r in sparse))
  densities = sorted({r["density"] for r in sparse}, reverse=True)
  width = 0.8 / max(len(densities), 1)
  shades = matplotlib.colormaps["Blues"](np.linspace(0.35, 0.9, len(densities)))
  for j, density in enumerate(densities):
    sub = [r for r in sparse if r["density"] == density]
    x = [groups.index((r["model"], r["nodes"], r["gpus"])) + (j - (len(densities) - 1) / 2)
         * width for r in sub]
    ax.bar(x, [r["speedup_vs_ring"] for r in sub], width=width, color=shades[j],
           label=f"TASC, density {density:g}")
    ax.plot(x, [r["sparse_butterfly_speedup"] for r in sub], ls="", marker="_", markersize=7,
            mew=2, color="black", label="sparse butterfly (SparCML)" if j == 0 else None)
  for i in range(1, len(groups)):
    if groups[i][0] != groups[i - 1][0]:
      ax.axvline(i - 0.5, color="grey", lw=0.5)
  ax.axhline(30, color="black", ls="--", lw=0.8, label="TASC claim: up to 30x")
  ax.set_yscale("log")
  if sparse:  # room above the bars for the legend
    ax.set_ylim(top=max(r["speedup_vs_ring"] for r in sparse) * 60)
  ax.set_xticks(range(len(groups)), [f"{n}x{g // n}" for _, n, g in groups], fontsize=8)
  for model in dict.fromkeys(m for m, _, _ in groups):  # each model's name under its groups
    where = [i for i, group in enumerate(groups) if group[0] == model]
    ax.text(sum(where) / len(where), -0.07, short.get(model, model), ha="center", va="top",
            fontsize=9, transform=ax.get_xaxis_transform())
  ax.set_xlabel("nodes x GPUs per node (8x1: 10 GbE cloud)", fontsize=9, labelpad=24)
  ax.set_ylabel("x faster than dense ring (model)")
  ax.set_title("Structured sparse all-reduce vs dense ring", fontsize=9)
  ax.legend(fontsize=8, loc="upper left")


def claims(settings, vgg, scaling, sparse) -> list[Claim]:
  """F2's published claims (TASC's VGG-19 speed-ups, AIACC's ResNet-50 scaling, TASC's
  sparse all-reduce) beside the modelled records."""
  result = []
  density = settings.densities[0]
  for nodes, published in ((1, 2.6), (2, 11.0)):
    r = next((r for r in vgg if r["nodes"] == nodes and r["density"] == density), None)
    ours = "not run" if r is None else (
        f"{r['speedup_vs_ring']:.1f}x vs dense ring ({r['speedup_vs_best_dense']:.1f}x vs the "
        f"best dense schedule) at density {density:g}")
    result.append(Claim(
        f"TASC: {published:g}x communication speed-up over dense ring, VGG-19 on {nodes} x 8 "
        "GPUs", "TASC (Dong, Keutzer et al., unverified)", ours,
        None if r is None else r["speedup_vs_ring"] >= published,
        "modelled (no measurement on GPUs); the density of the claim is not stated"))
  at512 = [r for r in scaling if r["gpus"] == 512]
  best = max(at512, key=lambda r: r["speedup"], default=None)
  result.append(Claim(
      "462x speed-up on 512 GPUs (90% scaling efficiency), ResNet-50",
      "Alibaba AIACC (P100s; unverified)",
      "not run" if best is None else "; ".join(
          f"{r['scheme']}: {r['speedup']:.0f}x ({r['efficiency']:.0%})" for r in at512),
      None if best is None else best["speedup"] >= 462,
      "modelled with an assumed V100 compute time, no overlap of communication and compute"))
  top = max(sparse, key=lambda r: r["speedup_vs_ring"], default=None)
  result.append(Claim(
      "Structured sparse all-reduce up to 30x faster than dense ring",
      "TASC (Dong, Keutzer et al., unverified)",
      "not run" if top is None else
      f"up to {top['speedup_vs_ring']:.0f}x ({top['model']}, {top['topology']} "
      f"{top['nodes']}x{top['gpus'] // top['nodes']}, density {top['density']:g})",
      None if top is None else top["speedup_vs_ring"] >= 30,
      "modelled; grows with sparsity as 1 / (density + 1/block_size) until latency dominates"))
  return result
