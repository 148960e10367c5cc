"""F3: communication time measured over a rate-limited loopback, beside the cost model's.

For each (processes, rate) of ``configs/paper/f3.py``: :func:`experiments.bench.calibrate.calibrate`
fits the loopback's alpha and beta, :func:`experiments.bench.links.link_times` times dense, top-k
and TASC exchanges between processes (the B4 benchmark's function), and the cost model predicts
each on the fitted loopback (:func:`predicted_times`). Every setting lands in a run directory
(:func:`experiments.reproduce.report.write_run`) that the report reads back. It needs root and
``ip netns``; without them nothing runs and the report says why.
"""

import functools
import json
import logging
import math
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from compressors.network import topology as topo
from configs.paper import f3 as f3_config
from experiments.bench import calibrate
from experiments.bench import links as bench_links
from experiments.reproduce import common
from experiments.reproduce import plots
from experiments.reproduce import report as report_lib
from experiments.reproduce.report import Claim
from experiments.reproduce.report import Report

TITLE = "F3: measured communication time over a rate-limited loopback"


def run_folders(options: common.Options) -> list[str]:
  """The folder of F3's runs. Full settings time a larger gradient under the same run names:
  their own folder."""
  return [os.path.join(options.workdir, "f3_full" if options.full else "f3")]


def produce(options: common.Options) -> Report:
  """Measures the settings not measured yet (unless ``report_only``); the figure."""
  settings = f3_config.get_config(options.config_arg())
  [workdir] = run_folders(options)
  skipped = None
  if not options.report_only:
    skipped = measure(settings, workdir)
    if skipped:
      logging.getLogger("reproduce").warning(
          "f3: nothing measured: %s (needs root and `ip netns`); the report says so", skipped)
  return report(settings, workdir, full=options.full, skipped=skipped)


def run_name(processes: int, rate: str) -> str:
  return f"p{processes}_{rate}"


def predicted_times(topology, elements: int, density: float, block_size: int) -> dict:
  """The cost model's seconds for the three exchanges F3 times, on the fitted loopback."""
  blocks = math.ceil(elements / block_size)
  payload = max(1, round(density * blocks)) * block_size
  return {"dense": topo.dense_cost("psum", topology, elements).time,
          "topk": topo.collective_cost("topk_allgather", topology, elements, density).time,
          "tasc": (topo.dense_cost("psum", topology, blocks).time
                   + topo.dense_cost("psum", topology, payload).time)}


def _record_failure(workdir: str, name: str, error: str | None) -> None:
  """Records why ``name``'s attempt failed in ``workdir/failures.json`` (None: forgets it)."""
  failures = {k: v for k, v in common.read_failures(workdir).items() if k != name}
  if error is not None:
    failures[name] = error
  os.makedirs(workdir, exist_ok=True)
  Path(workdir, common.FAILURES_FILE).write_text(json.dumps(failures, indent=1))


def measure(settings, workdir: str, log=print) -> str | None:
  """Calibrates and times each (processes, rate) of ``settings``, skipping finished ones.

  A (processes, rate) whose calibration or timing fails is logged, recorded in
  ``workdir/failures.json`` (its row then says so) and tried again on the next run; the others
  go on.

  Returns:
    Why nothing could run (no network namespaces here), or None.
  """
  ok, why = calibrate.netns_available()
  if not ok:
    return why
  for processes in settings.processes:
    for rate in settings.rates:
      name = run_name(processes, rate)
      run_dir = os.path.join(workdir, name)
      if os.path.exists(os.path.join(run_dir, report_lib.RESULTS_FILE)):
        continue
      rate_bits = calibrate.parse_rate(rate)
      try:
        fit = calibrate.calibrate(processes, rate_bits, message_bytes=settings.message_bytes,
                                  allreduce_elements=settings.elements,
                                  timeout_s=settings.timeout_s)
      except (RuntimeError, ValueError) as e:  # recorded, the other settings go on
        error = f"calibration: {type(e).__name__}: {e}".splitlines()[0][:300]
        log(f"F3 {name}: {error}")
        _record_failure(workdir, name, error)
        continue
      log(str(fit))
      predicted = predicted_times(fit.topology(), settings.elements, settings.density,
                                  settings.block_size)
      rows = bench_links.link_times([processes], settings.elements, list(settings.methods),
                                    rate_bits=rate_bits, repeats=settings.repeats,
                                    timeout_s=settings.timeout_s, log=log)
      unmeasured = [r for r in rows if not isinstance(r.get("seconds"), (int, float))]
      if unmeasured:
        error = f"timing ({unmeasured[0]['method']}): {unmeasured[0]['seconds']}"[:300]
        log(f"F3 {name}: {error}")
        _record_failure(workdir, name, error)
        continue
      for row in rows:
        row["predicted_s"] = predicted.get(row["method"])
      config = {"processes": processes, "rate": rate, "elements": settings.elements,
                "density": settings.density, "block_size": settings.block_size,
                "methods": list(settings.methods), "repeats": settings.repeats,
                "message_bytes": list(settings.message_bytes),
                "functions": ["experiments.bench.calibrate.calibrate",
                              "experiments.bench.links.link_times",
                              "experiments.reproduce.f3.predicted_times"]}
      calibration = {"alpha_s": fit.alpha, "beta_s_per_byte": fit.beta, "gamma": fit.gamma,
                     "fitted_rate_bits": fit.fitted_rate_bits, "shared": fit.shared,
                     "concurrency": fit.concurrency, "message_bytes": fit.message_bytes,
                     "measured_s": fit.measured, "model_s": fit.predicted,
                     "allreduce_measured_s": fit.allreduce_seconds,
                     "allreduce_predicted_s": fit.predicted["allreduce"]}
      report_lib.write_run(run_dir, config, [{"step": 0, **r} for r in rows],
                           {"calibration": calibration, "rows": rows})
      _record_failure(workdir, name, None)
  return None


def rows_from_runs(settings, workdir: str) -> list[dict]:
  """One row per (processes, rate, method) measured, and one per (processes, rate) whose last
  attempt failed."""
  failures = common.read_failures(workdir)
  rows = []
  for processes in settings.processes:
    for rate in settings.rates:
      name = run_name(processes, rate)
      run = report_lib.read_run(os.path.join(workdir, name))
      if run is None or not run.finished:
        if name in failures:
          rows.append({"processes": processes, "rate": rate, "method": "-",
                       "status": f"failed: {failures[name]}"})
        continue
      cal = run.results["calibration"]
      for r in run.results["rows"]:
        measured, predicted = r.get("seconds"), r.get("predicted_s")
        compute = r.get("compute_seconds")
        rows.append({
            "processes": processes, "rate": rate, "method": r["method"],
            "measured_s": measured, "predicted_s": predicted, "compute_s": compute,
            "predicted_plus_compute_s": predicted + compute if predicted and compute else None,
            "model_over_measured": predicted / measured if predicted else None,
            "speedup_vs_dense": r.get("speedup"),
            "bytes_per_device": r.get("bytes_per_device"),
            "mb_per_device": r["bytes_per_device"] / 1e6 if r.get("bytes_per_device") else None,
            "fitted_gbit": cal["fitted_rate_bits"] / 1e9,
            "link_model": "shared medium" if cal.get("shared") else "independent links",
            "status": "measured", "run_dir": report_lib.relative(run.path)})
  return rows


def report(settings, workdir: str, *, full: bool, skipped: str | None) -> Report:
  """F3's figure, table and claims from the run directories.

  Args:
    settings: ``configs/paper/f3.py``'s config.
    workdir: F3's runs, one per (processes, rate).
    full: whether they have the full settings (for the configs named).
    skipped: why nothing could be measured, or None.

  Returns:
    The report ``f3``.
  """
  rows = rows_from_runs(settings, workdir)
  measured = [r for r in rows if r["status"] == "measured"]

  notes = [
      f"{settings.elements:,} float32 elements (quick settings; full: ResNet-50's 25,557,032); "
      f"top-k and TASC at density {settings.density:g}, TASC blocks of {settings.block_size} "
      "(block magnitudes: no curvature is passed).",
      "Measured: experiments.bench.links.link_times, processes joined by jax.distributed (gloo) "
      "inside a private network namespace whose loopback is shaped by tc tbf; fastest of "
      f"{settings.repeats} exchanges of the slowest process, compute (top-k selection, "
      "scoring) included. Compute s: the same method without a collective, all processes at "
      "once.",
      "Model: experiments.bench.calibrate fits alpha and beta from ping-pong times over the same "
      "shaped loopback (the fitted rate is in the table; a ring-shift test decides whether "
      "the processes share one medium or get independent links), then "
      "compressors.network.topology prices the exchange's collectives (dense: one all-reduce; top-k: "
      "all-gather of values and indices; TASC: all-reduce of the block scores, then of the "
      "shared blocks). The model prices communication only; 'model + compute' adds the "
      "measured compute.",
      "The processes share 2 CPU cores with each other (and with other jobs), so compute-heavy "
      "exchanges (top-k's selection) are slower than on one core each, and a loopback shaped "
      "to 10 Gbit/s runs CPU-bound below its rate (see the fitted rate).",
  ]
  if skipped:
    notes.insert(0, f"SKIPPED: {skipped} (needs root and `ip netns`).")
  return Report(
      name="f3", title="F3: measured communication time over a rate-limited loopback",
      columns=[("processes", "processes"), ("rate", "rate"), ("method", "method"),
               ("measured_s", "measured s"), ("predicted_s", "model s"),
               ("compute_s", "compute s"), ("predicted_plus_compute_s", "model + compute s"),
               ("model_over_measured", "model / measured"),
               ("speedup_vs_dense", "x faster than dense (measured)"),
               ("mb_per_device", "MB/device (HLO)"), ("fitted_gbit", "fitted Gbit/s"),
               ("link_model", "model's link"), ("status", "status"), ("run_dir", "run dir")],
      rows=rows, claims=claims(measured),
      configs=[f"configs/paper/f3.py{':full=true' if full else ''}"], notes=notes,
      plot=functools.partial(plot, settings, measured) if measured else None)


def plot(settings, measured: list[dict], fig) -> None:
  """F3's figure, a panel per rate: each exchange's measured time beside the model's
  communication and the method's compute."""
  panels = plots.panels_in_a_row(fig, len(settings.rates), step=0.49, bottom=0.3, width=0.42,
                                 height=0.6)
  for i, (rate, ax) in enumerate(zip(settings.rates, panels)):
    sub = [r for r in measured if r["rate"] == rate]
    x = np.arange(len(sub))
    model = np.array([r["predicted_s"] or 0.0 for r in sub])
    ax.bar(x - 0.2, [r["measured_s"] for r in sub], width=0.4, color="tab:blue",
           label="measured exchange (compute included)")
    ax.bar(x + 0.2, model, width=0.4, color="tab:orange",
           label="model: communication (calibrated alpha-beta)")
    ax.bar(x + 0.2, [r["compute_s"] or 0.0 for r in sub], bottom=model, width=0.4,
           color="tab:orange", alpha=0.35, label="+ the method's compute alone (measured)")
    ax.set_xticks(x, [f"{r['processes']} proc.\n{r['method']}" for r in sub], fontsize=8)
    ax.set_yscale("log")
    values = [v for r in sub for v in (r["measured_s"], r["predicted_s"]) if v]
    if values:
      ax.set_ylim(min(values) / 2, max(values) * 2)
    fits = dict.fromkeys((r["processes"], r["fitted_gbit"]) for r in sub)
    plots.decorate(ax, ylabel="seconds per exchange",
                   title=f"loopback shaped to {rate}; fitted " + (", ".join(
                       f"{g:.2g} Gbit/s ({p} proc.)" for p, g in fits) or "-"),
                   title_size=10, grid="y")
    if i == 0:
      fig.legend(loc="center", bbox_to_anchor=(0.5, 0.15), ncol=3, fontsize=9)
  fig.suptitle(f"F3: one exchange of {settings.elements:,} float32 between processes, "
               "measured vs the model", fontsize=11)


def claims(rows: Sequence[dict]) -> list[Claim]:
  """F3's claims from its measured rows: the model's accuracy on dense, TASC's speed-up on the
  slowest and the fastest link (at the most processes measured, the closest to the claim's 16
  GPUs), and whether compression pays less on a faster link."""
  ratios = {(r["processes"], r["rate"]): r["model_over_measured"] for r in rows
            if r["method"] == "dense" and r["model_over_measured"]}
  speedup = {(r["processes"], r["rate"]): r["speedup_vs_dense"] for r in rows
             if r["method"] == "tasc" and r["speedup_vs_dense"]}
  fitted = {(r["processes"], r["rate"]): r["fitted_gbit"] for r in rows}
  rates = sorted({rate for _, rate in speedup}, key=_rate_bits)
  most = max((p for p, _ in speedup), default=None)

  def tasc_claim(published, setting, rate):
    value = speedup.get((most, rate))
    others = "; ".join(f"{p} processes {v:.1f}x" for (p, r), v in sorted(speedup.items())
                       if r == rate and p != most)
    return Claim(
        f"TASC: {published:g}x communication speed-up over dense ring, VGG-19 on {setting}",
        "TASC (Dong, Keutzer et al., unverified)",
        "not measured" if value is None else
        f"{value:.1f}x at {rate} ({most} processes, fitted {fitted[most, rate]:.2g} Gbit/s, "
        "compute included)" + (f"; {others}" if others else ""),
        None if value is None else value >= published,
        "CPU processes on one shaped loopback standing in for the claim's links, not GPUs; "
        "verdict at the most processes")

  pairs = [(p, speedup[p, rates[0]], speedup[p, rates[-1]]) for p in sorted({p for p, _ in speedup})
           if len(rates) > 1 and (p, rates[0]) in speedup and (p, rates[-1]) in speedup]
  return [
      Claim("The alpha-beta model predicts a dense ring all-reduce's time", "Thakur, "
            "Rabenseifner & Gropp 2005",
            "not measured" if not ratios else "dense, model / measured: " + "; ".join(
                f"{p} processes at {rate} {v:.2f}" for (p, rate), v in ratios.items()),
            None if not ratios else all(0.5 <= v <= 2 for v in ratios.values()),
            "within 2x counts, at every setting" + "".join(
                f"; at {rate} the loopback fitted {fitted[p, rate]:.2g} Gbit/s"
                for (p, rate), v in ratios.items() if not 0.5 <= v <= 2)),
      tasc_claim(11.0, "2 x 8 GPUs (slow links between nodes)", rates[0] if rates else None),
      tasc_claim(2.6, "1 x 8 GPUs (fast links in a node)", rates[-1] if len(rates) > 1 else None),
      Claim("Compression pays on slow links and much less on fast ones (at 10 Gbit/s 2-5x is "
            "enough; compression beat tuned dense SGD in few settings)",
            "Agarwal et al., MLSys 2022 (REFERENCES.md)",
            "not measured" if not pairs else "; ".join(
                f"{p} processes: TASC {slow:.1f}x faster than dense at {rates[0]}, {fast:.1f}x at "
                f"{rates[-1]}" for p, slow, fast in pairs),
            None if not pairs else all(fast < slow for _, slow, fast in pairs),
            "TASC's measured speed-up is lower on the faster link at every process count"),
  ]


def _rate_bits(rate: str) -> float:
  return calibrate.parse_rate(rate) or math.inf
