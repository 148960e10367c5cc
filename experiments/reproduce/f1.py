"""F1: wire bytes per device against the number of workers, 2 to 256 (compile only).

Each worker count runs :func:`experiments.bench.bytes.bytes_vs_workers` (the B3 benchmark's
function: a child process simulating that many CPU devices compiles every exchange of a ResNet-50
and a BERT-base gradient; nothing trains), and its rows land in a run directory
(:func:`experiments.reproduce.report.write_run`) that the report reads back. Settings:
``configs/paper/f1.py``.
"""

import json
import math
import os
from collections.abc import Sequence

from configs.paper import f1 as f1_config
from experiments.bench import bytes as bench_bytes
from experiments.reproduce import common
from experiments.reproduce import plots
from experiments.reproduce import report as report_lib
from experiments.reproduce.report import Claim
from experiments.reproduce.report import Report

TITLE = "F1: wire bytes per device vs workers, 2 to 256 (compile only)"


def run_folders(options: common.Options) -> list[str]:
  """The folder of F1's runs, one per worker count."""
  return [os.path.join(options.workdir, "f1")]


def produce(options: common.Options) -> Report:
  """Compiles the worker counts not measured yet (unless ``report_only``); the figure."""
  settings = f1_config.get_config(options.config_arg())
  [workdir] = run_folders(options)
  if not options.report_only:
    measure(settings, workdir)
  return report(settings, workdir, full=options.full)


BENCHMARK_BYTES = "benchmarks/results/bytes.json"  # B3: the same function, run by experiments.bench


def run_name(workers: int) -> str:
  return f"workers_{workers:03d}"


def _by_design(row: dict) -> bool:
  """Whether a row is skipped by design (hierarchical TASC below two nodes), not by failure."""
  return "skipped" in row and "needs a multiple" in row["skipped"]


def finished(run) -> bool:
  """Whether a worker count's run directory holds every row (measured, or skipped by design);
  a count with a failed or timed-out row is compiled again on the next run."""
  return run is not None and run.finished and all(
      "slow_axis_bytes" in r or _by_design(r) for r in run.results["rows"])


def measure(settings, workdir: str, log=print) -> None:
  """Compiles every exchange at every worker count of ``settings`` (skipping finished ones)."""
  for n in settings.workers:
    run_dir = os.path.join(workdir, run_name(n))
    if finished(report_lib.read_run(run_dir)):
      continue
    rows = bench_bytes.bytes_vs_workers([n], list(settings.sizes), list(settings.methods),
                                        timeout_s=settings.timeout_s, log=log)
    config = {"function": "experiments.bench.bytes.bytes_vs_workers", "workers": n,
              "sizes": list(settings.sizes), "methods": list(settings.methods),
              "group": bench_bytes.NODE_SIZE}
    report_lib.write_run(run_dir, config, [{"step": 0, **r} for r in rows], {"rows": rows})


def rows_from_runs(settings, workdir: str) -> list[dict]:
  """One row per (workers, gradient, method) of the finished worker counts; ``status`` is
  ``measured``, ``n/a`` (skipped by design) or the failure."""
  rows = []
  for n in settings.workers:
    run = report_lib.read_run(os.path.join(workdir, run_name(n)))
    if run is None or not run.finished:
      continue
    for r in run.results["rows"]:
      status = ("measured" if "slow_axis_bytes" in r else "n/a" if _by_design(r) else
                f"failed: {r.get('error') or r.get('skipped')}")
      rows.append({**{k: r.get(k) for k in ("workers", "size", "method", "elements",
                                            "bytes_per_device", "slow_axis_bytes", "vs_dense")},
                   "status": status, "run_dir": report_lib.relative(run.path)})
  return rows


def benchmark_agreement(rows: Sequence[dict], path: str = BENCHMARK_BYTES) -> str:
  """How F1's bytes compare with the B3 benchmark's JSON (same function, run separately)."""
  full = report_lib.REPO_ROOT / path
  if not full.exists():
    return f"{path} not found: no comparison with the B3 benchmark."
  bench = {(r["workers"], r["size"], r["method"]): r.get("slow_axis_bytes")
           for r in json.loads(full.read_text())["data"]}
  pairs = [(r, bench.get((r["workers"], r["size"], r["method"]))) for r in rows]
  both = [(r, b) for r, b in pairs if r["slow_axis_bytes"] and b]
  differ = [f"{r['size']} {r['method']} at {r['workers']}: {r['slow_axis_bytes']:,.0f} here, "
            f"{b:,.0f} there" for r, b in both if r["slow_axis_bytes"] != b]
  text = (f"{len(both) - len(differ)} of {len(both)} measured cells equal, to the byte, "
          f"the B3 benchmark's `{path}` (`python -m experiments.bench bytes`, the same "
          "function run separately)")
  return text + (": differ: " + "; ".join(differ) if differ else ".")


def claims(rows: list[dict]) -> list[Claim]:
  def bytes_at(size, method, n):
    return next((r["slow_axis_bytes"] for r in rows if r["size"] == size and r["method"] ==
                 method and r["workers"] == n and r.get("slow_axis_bytes")), None)

  def ratio(size, top, top_n, bottom, bottom_n):
    return (bytes_at(size, top, top_n) or math.nan) / (bytes_at(size, bottom, bottom_n)
                                                       or math.nan)

  def verdict(values, test):
    return None if not values or any(math.isnan(v) for v in values) else all(map(test, values))

  sizes = sorted({r["size"] for r in rows})
  workers = sorted({r["workers"] for r in rows})
  if not workers:
    return [Claim("Top-k's all-gather moves about 2k(p-1) words per worker: linear in p",
                  "SparCML (Renggli et al., SC'19); REFERENCES.md", "not run", None)]
  lo, hi = workers[0], workers[-1]
  linear = (hi - 1) / (lo - 1)
  growth = {s: ratio(s, "topk", hi, "topk", lo) for s in sizes}
  flat = {s: ratio(s, "tasc", hi, "tasc", lo) for s in sizes}
  onebit = {s: ratio(s, "dense", hi, "onebit", hi) for s in sizes}
  nodes = [n for n in workers if n >= 16]
  crossing = {(s, n): ratio(s, "tasc", n, "tasc_hierarchical", n)
              for s in sizes for n in dict.fromkeys(nodes[:1] + nodes[-1:])}
  return [
      Claim("Top-k's all-gather moves about 2k(p-1) words per worker: linear in p",
            "SparCML (Renggli et al., SC'19); REFERENCES.md",
            "; ".join(f"{s}: x{g:.1f} from {lo} to {hi} workers ((p-1) grows x{linear:.0f})"
                      for s, g in growth.items()),
            verdict(list(growth.values()), lambda g: g >= 0.5 * linear), "compiled HLO bytes"),
      Claim("A shared-support (TASC) all-reduce's bytes per worker do not grow with p",
            "TASC (unverified); ring all-reduce 2(p-1)/p n", "; ".join(
                f"{s}: x{g:.2f} from {lo} to {hi} workers" for s, g in flat.items()),
            verdict(list(flat.values()), lambda g: g < 2.5),
            "bounded by the ring's 2(p-1)/p <= 2"),
      Claim("1-bit two-phase exchange (all-to-all, all-gather): about 2 x 1/32 of the gradient "
            "per worker regardless of p, so ~32x fewer bytes than a dense ring all-reduce "
            "(2 x the gradient)", "1-bit Adam (Tang et al. 2021); REFERENCES.md",
            "; ".join(f"{s}: dense / 1-bit {g:.1f}x at {hi} workers" for s, g in onebit.items()),
            verdict(list(onebit.values()), lambda g: 24 <= g <= 40),
            "24x-40x counts (each chunk also carries its scale)"),
      Claim("Topology-aware TASC: a hierarchical exchange (dense inside a node of 8, sparse "
            "between nodes) sends far fewer bytes over the slow inter-node links",
            "TASC (Dong, Keutzer et al., unverified: 11x on 2 x 8 GPUs vs 2.6x on 1 x 8)",
            "not run (needs >= 16 workers)" if not nodes else "flat TASC's bytes / "
            "hierarchical TASC's cross-node bytes: " + "; ".join(
                f"{s} {g:.1f}x at {n} workers" for (s, n), g in crossing.items()),
            verdict(list(crossing.values()), lambda g: g >= 4),
            "bytes only (>= 4x counts); the speed-up claim itself is modelled in F2"),
  ]


def report(settings, workdir: str, *, full: bool) -> Report:
  """F1's figure, table and claims from the run directories.

  Args:
    settings: ``configs/paper/f1.py``'s config.
    workdir: F1's runs, one per worker count.
    full: whether they have the full settings (for the configs named).

  Returns:
    The report ``f1``.
  """
  rows = rows_from_runs(settings, workdir)
  methods, sizes = list(settings.methods), list(settings.sizes)
  labels = {"dense": "dense ring", "topk": "top-k all-gather", "randomk": "random-k (shared)",
            "powersgd": "PowerSGD rank 4", "onebit": "1-bit two-phase",
            "tasc": "TASC shared support", "tasc_hierarchical": "TASC hierarchical (cross-node)"}

  def plot(fig):
    workers = sorted({r["workers"] for r in rows})
    panels = plots.panels_in_a_row(fig, len(sizes), step=0.49, bottom=0.3, width=0.41,
                                   height=0.62)
    for i, (size, ax) in enumerate(zip(sizes, panels)):
      for method in methods:
        points = sorted((r["workers"], r["slow_axis_bytes"] / 1e6) for r in rows
                        if r["size"] == size and r["method"] == method and r["slow_axis_bytes"])
        if points:
          ax.plot(*zip(*points), marker="o", label=labels.get(method, method))
      plots.log2_axis(ax, workers)
      ax.minorticks_off()
      ax.set_yscale("log")
      elements = next((r["elements"] for r in rows if r["size"] == size and r["elements"]), None)
      plots.decorate(ax, xlabel="workers", ylabel="MB sent per device per exchange (compiled HLO)",
                     title=f"{size} gradient" + (f" ({elements:,} float32)" if elements else ""))
      if i == 0:
        fig.legend(loc="center", bbox_to_anchor=(0.5, 0.16), ncol=4, fontsize=9)

  table = []
  for size in sizes:
    for method in methods:
      line = {"size": size, "method": method}
      mine = [r for r in rows if r["size"] == size and r["method"] == method]
      for r in mine:
        line["elements"] = r["elements"]
        line[f"n{r['workers']}"] = (r["slow_axis_bytes"] / 1e6 if r["status"] == "measured"
                                    else r["status"])
      line["run_dirs"] = " ".join(dict.fromkeys(r["run_dir"] for r in mine))
      table.append(line)
  return Report(
      name="f1", title="F1: wire bytes per device against the number of workers (compile only)",
      columns=[("size", "gradient"), ("elements", "elements"), ("method", "method")]
      + [(f"n{n}", f"{n} workers (MB)") for n in settings.workers] + [("run_dirs", "run dirs")],
      rows=table, claims=claims(rows),
      configs=[f"configs/paper/f1.py{':full=true' if full else ''}",
               "experiments/bench/bytes.py (bytes_vs_workers)"],
      notes=["Nothing runs: each worker count is a child process simulating that many CPU "
             "devices; compressors.wire_bytes reads each device's bytes from the compiled HLO "
             "(all-reduce 2(n-1)/n S, all-gather (n-1)/n S, all-to-all (n-1)/n S).",
             "ResNet-50 and BERT-base with its masked-LM head, real layer shapes "
             "(experiments.models), full size at every worker count. topk/randomk/tasc at "
             "density 0.01 (TASC blocks of 256 plus one score per block), PowerSGD rank 4 per "
             "matrix, 1-bit two-phase; tasc_hierarchical: mesh (n/8, 8), the bytes that cross "
             "nodes ('n/a' below 16 workers: it needs two nodes of 8).",
             benchmark_agreement(rows),
             "The CSV has one row per (gradient, method); the per-worker-count rows (with the "
             "bytes by collective kind and the compile time) are in each run directory's "
             "metrics.jsonl."],
      plot=plot)
