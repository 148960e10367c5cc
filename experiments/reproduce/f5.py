"""F5: time to accuracy on a link: T1-LM's validation loss against modelled wall-clock.

Rows: dense and every T1-LM row at the tiers of :data:`configs.paper.t1_lm.HEADLINE_TIERS`
(100x, 1000x) with finished runs at its chosen rate scale (the tuning budget's, on training
loss: :func:`experiments.reproduce.t1_lm.chosen_scale`), its curve the mean over those seeds. A
step of a row takes measured compute + modelled communication, on a flat cluster of 8 or 32
workers joined by 1 Gbit/s or 10 Gbit/s links.

Measured: compute, the median of each run's logged step times (``batch_size /
examples_per_sec`` of ``metrics.jsonl``, compilation and evaluation excluded by the median),
averaged over the row's seeds, on the machine that ran it (the runs' provenance, below): all
the simulated workers share that machine, and the compressor's own work (top-k's selection,
TASC's scores and curvature, a local-update method's inner steps) is included.

Modelled: communication, by the project's one cost model (:func:`compressors.registry.cost`) of
the run's own settings (its config.json: the solved budget, a local-update method's ``every``
and its exchange's block), on the 1 Gbit/s or 10 Gbit/s preset of
:mod:`compressors.network.topology` (``ETHERNET_1G``, ``CLOUD_10G``; nominal alpha and beta, not
the calibration F3 fits on a loopback), and what of it hides behind compute by the time model
(:mod:`compressors.step_time`). Each step is charged its step kind's time (the kinds of
:func:`experiments.methods.step_kinds`, counted over the steps the run ran by
:func:`experiments.reproduce.t1_lm.kind_counts`): a local-update method (DiLoCo, SparseLoCo)
pays one exchange of its exchange method at each synchronisation and nothing between them;
1-bit Adam's warm-up (and 0/1 Adam's refresh) steps are a dense all-reduce, its compressed steps
its own price; every step of a per-step method (either place of the optimizer) or of DeMo pays
one exchange after the backward pass, which it needs whole. The 4-byte non-finite flag every
method sends each step is left out for all. At 32 workers the loss curve is still the 8-worker
run's: only the communication is re-priced.

Two dense baselines, from dense's own runs: ``dense_bf16_overlapped``, the fair one (tuned data
parallelism: its all-reduce in bfloat16, in 25 MiB buckets overlapped with the backward pass;
Agarwal et al. 2022 and Han et al. 2024 on comparing against less), whose loss curve is dense's
(a 16-bit all-reduce trains as float32 does here: T1-LM's fp16 row), and ``dense``, float32
after the backward pass. A model under one bucket (the CPU tier's 0.24M parameters) cannot
overlap: its fair baseline differs from plain dense by the bytes alone.

Time to dense's loss: the modelled time at which a row's mean validation curve first falls to
dense's final validation loss (linear between evaluations); the speed-up is the fair baseline's
total time over it (beside it, plain dense's). A row that never reaches it is given the
validation loss it has at the fair baseline's total time (linear between evaluations), or,
where its whole run is over sooner, its final loss, marked as having run out of steps. The best
row of a tier (:func:`best`, :func:`headline`): the fastest to dense's loss among its rows on
their tier of bytes, else the lowest loss in the fair baseline's time; reported, not selected
(every run was chosen on training loss).
"""

import functools
import math

import ml_collections
import numpy as np

from compressors import step_time
from compressors.network import topology as topo
from configs.paper import f7_lm as horizon_config
from configs.paper import t1_lm as sweep_config
from experiments import methods
from experiments import provenance
from experiments.reproduce import common
from experiments.reproduce import plots
from experiments.reproduce import report as report_lib
from experiments.reproduce import t1_lm
from experiments.reproduce.report import Claim
from experiments.reproduce.report import Report

TITLE = "F5: time to accuracy, measured compute + modelled 1/10 Gbit/s communication"
# The fair baseline's row: dense's runs, their all-reduce priced as bfloat16 overlapped with the
# backward pass (tuned data parallelism); speed-ups are against it, and beside them against
# ``dense`` priced as float32 after the backward pass.
FAIR = "dense_bf16_overlapped"
LINKS = {"1 Gbit/s": topo.ETHERNET_1G, "10 Gbit/s": topo.CLOUD_10G}
WORKERS = (8, 32)
# The cluster the headline quotes.
HEADLINE_LINK, HEADLINE_WORKERS = "1 Gbit/s", 8


run_folders = t1_lm.run_folders  # F5 plots T1-LM's runs


def produce(options: common.Options) -> Report:
  """Runs T1-LM's runs if missing (unless ``report_only``); the curves and speed-ups."""
  t1_lm.run_subset(options, "t1")
  return report(t1_lm.runs_dir(options), tier=options.tier, seeds=options.seeds)


def step_seconds(run) -> float:
  """The median logged step time of a run (seconds)."""
  rates = [r["examples_per_sec"] for r in run.metrics if r.get("examples_per_sec")]
  return run.config["batch_size"] / float(np.median(rates))


def kind_times(config, link: topo.Link, workers: int, compute: float, *,
               as_method: str | None = None, fsdp: int = 1,
               fast_link: topo.Link = topo.NVLINK4) -> dict[str, step_time.StepTime]:
  """Step kind name -> the time model's seconds of one step of that kind
  (:func:`compressors.step_time.kind_times`) for ``config`` (a run's config.json, a dict or
  ConfigDict) on ``workers`` workers joined by ``link``, with ``compute`` seconds of compute a
  step: its method overlapping what it can with the backward pass, but ``dense`` (the float32,
  non-overlapped baseline). ``as_method``: price the run's steps as another method's with its
  defaults (:data:`FAIR`'s bf16 all-reduce, overlapped). ``fsdp > 1``: an island layout, the
  workers in islands of ``fsdp`` devices joined by ``fast_link`` (the model sharded inside
  each), ``link`` between the islands (:func:`compressors.step_time.island_kind_times`)."""
  config = ml_collections.ConfigDict(config) if isinstance(config, dict) else config
  shapes = methods.parameter_shapes(config)
  topology = topo.Topology.flat(workers, link)
  price = step_time.kind_times
  if fsdp > 1:
    topology = topo.Topology((topo.Axis("islands", workers // fsdp, link),
                              topo.Axis("fsdp", fsdp, fast_link)), f"islands of {fsdp}")
    price = step_time.island_kind_times
  if as_method is not None:
    return price(as_method, shapes, topology, compute)
  return price(
      config.method, shapes, topology, compute, methods.settings(config),
      exchange_settings=methods.exchange_settings(config), kinds=methods.step_kinds(config),
      overlap=config.method != "dense")


def time_to(steps: np.ndarray, loss: np.ndarray, seconds_per_step: float,
            target: float) -> float:
  """Seconds until ``loss`` (at ``steps``) first falls to ``target``, linear between points; NaN
  when it never does."""
  for i, value in enumerate(loss):
    if value <= target:
      if i == 0:
        return float(steps[0] * seconds_per_step)
      fraction = (loss[i - 1] - target) / (loss[i - 1] - value)
      return float((steps[i - 1] + fraction * (steps[i] - steps[i - 1])) * seconds_per_step)
  return math.nan


def loss_at(steps: np.ndarray, loss: np.ndarray, seconds_per_step: float,
            seconds: float) -> tuple[float, bool]:
  """``(loss, ran_out)``: the loss (at ``steps``) at ``seconds``, linear between points;
  beyond the last point the final loss with ``ran_out`` True; NaN before the first point."""
  times = np.asarray(steps, float) * seconds_per_step
  if seconds > times[-1]:
    return float(loss[-1]), True
  if seconds < times[0]:
    return math.nan, False
  return float(np.interp(seconds, times, loss)), False


def curve(workdir: str, label: str, seeds: int, tier: str = "cpu", scale: float | None = None):
  """``(rate scale, steps, mean validation loss, runs)`` of a row at its reported scale
  (:func:`experiments.reproduce.t1_lm.reported_scale`; at the GPU tier, its given one; ``scale``:
  that one), None when no run at that scale finished (or the tuning's grid has not)."""
  scale = t1_lm.reported_scale(workdir, label, tier)[0] if scale is None else scale
  if scale is None:
    return None
  runs = t1_lm.label_runs(workdir, label, scale, seeds)
  series = [r.series("test_loss") for r in runs]
  series = [(s, v) for s, v in series if len(s)]
  if not series:
    return None
  length = min(len(s) for s, _ in series)
  steps = series[0][0][:length]
  return scale, steps, np.mean([v[:length] for _, v in series], axis=0), runs


def labels(workdir: str, tier: str) -> list[str]:
  """F5's rows: dense and T1-LM's rows (:func:`t1_lm.report_labels`) at the headline tiers."""
  return [label for label in t1_lm.report_labels(workdir, tier)
          if label == "dense" or sweep_config.tier_of(label) in sweep_config.HEADLINE_TIERS]


def report(workdir: str, *, tier: str, seeds: int) -> Report:
  """F5's table, curves and claims from T1-LM's run directories."""
  curves = {label: c for label in labels(workdir, tier)
            if (c := curve(workdir, label, seeds, tier)) is not None}
  rows = time_rows(curves)
  add_horizon(rows, workdir, seeds)
  table = [{k: v for k, v in r.items() if k not in ("steps", "loss")} for r in rows]
  return Report(
      name=common.page_name("f5", tier),
      title=f"F5: time to accuracy on 1 and 10 Gbit/s links, stdlib language model ({tier} tier)",
      columns=[("method", "row"), ("tier", "tier"), ("lr_scale", "lr scale"),
               ("workers", "workers"), ("link", "link"),
               ("compute_s", "compute s/step (measured)"),
               ("comm_s", "communication s/step (modelled)"),
               ("exposed_s", "of it not hidden s/step"), ("step_s", "s/step"),
               ("steps_by_kind", "steps by kind"), ("final_val_loss", "final val loss"),
               ("time_to_dense_s", "s to dense's final loss"),
               ("speedup", f"speed-up vs {FAIR} (fair)"),
               ("speedup_f32", "speed-up vs dense (float32, not overlapped)"),
               ("loss_at_dense_time", f"val loss in {FAIR}'s time (never reaching it)"),
               ("at_dense_time", "in dense's time"),
               ("fits_steps", f"steps in {FAIR}'s time"),
               ("horizon", "its longest horizon run that fits (F7-LM)"),
               ("on_tier_text", "on tier (±10%)"),
               ("seeds", "seeds")],
      rows=table, claims=claims(table, tier),
      sections=[("Soonest to dense's loss, by cluster",
                 "Among every row on its tier of bytes, counting its compressor's own compute "
                 "(measured in the step) and the communication it cannot hide (modelled):\n\n"
                 + report_lib.markdown_table(
                     [("link", "link"), ("workers", "workers"), ("row", "soonest row"),
                      ("result", "speed-up to dense's final loss"),
                      ("compute_s", "its compute s/step"),
                      ("exposed_s", "its communication not hidden s/step")],
                     fastest_rows(table)))],
      configs=[f"configs/paper/t1_lm.py:tier={tier},subset=t1", "configs/paper/lm.py"],
      notes=[*(p.replace("\n", " ").strip() for p in __doc__.split("\n\n")[1:]),
             measured_note(curves), t1_lm.recipe_note(tier),
             *t1_lm.provenance_notes(workdir, tier)],
      plot=functools.partial(plot, rows, list(dict.fromkeys(r["method"] for r in rows)), tier))


def measured_note(curves: dict) -> str:
  """Which machines measured the compute of F5's runs (their provenance records)."""
  records = [r.results[provenance.KEY] for _, _, _, runs in curves.values() for r in runs
             if provenance.KEY in r.results]
  machines = sorted({provenance.machine_text(rec) for rec in records})
  return ("Measured on: " + (" | ".join(machines) if machines else
                             "no provenance recorded in the runs' results")
          + f" ({len(records)} runs). Modelled: every communication time, nothing measured "
          "on a network.")


def time_rows(curves: dict) -> list[dict]:
  """One row per (row of ``curves``, link, workers), and :data:`FAIR`'s from dense's curve: its
  step time, its time to dense's final loss and speed-ups against :data:`FAIR` and against
  plain dense, or the loss it has in :data:`FAIR`'s total time (with the curve, ``steps`` and
  ``loss``)."""
  rows = []
  priced = [(label, label, None) for label in curves]
  if "dense" in curves:
    priced.insert(1, (FAIR, "dense", "bf16"))
  for label, source, as_method in priced:
    scale, steps, loss, runs = curves[source]
    compute = float(np.mean([step_seconds(r) for r in runs]))
    ratio = float(np.mean([r.results["compression_ratio"] for r in runs
                           if r.results.get("compression_ratio")] or [math.nan]))
    if as_method is not None:
      ratio *= 2  # bfloat16: half of float32's bytes
    tier = sweep_config.tier_of(label) if label != FAIR else None
    counts = t1_lm.kind_counts(runs[0].config, int(runs[0].results["step"]))
    for link_name, link in LINKS.items():
      for workers in WORKERS:
        times = kind_times(runs[0].config, link, workers, compute, as_method=as_method)
        if as_method is not None:  # every step the other method's one kind
          counts = {next(iter(times)): int(runs[0].results["step"])}
        step = step_time.mean_step_seconds(times, counts)
        comm = (sum(times[k].communication * n for k, n in counts.items())
                / max(1, sum(counts.values())))
        within = t1_lm.within_tier({"tier": tier, "compression_ratio": ratio})
        rows.append({"method": label, "tier": tier or "fixed", "lr_scale": scale,
                     "link": link_name, "workers": workers, "seeds": len(runs),
                     # a step is never shorter than its compute: below 0 is summation rounding
                     "compute_s": compute, "comm_s": comm, "exposed_s": max(0.0, step - compute),
                     "step_s": step,
                     "steps_by_kind": ", ".join(f"{k} {n}" for k, n in counts.items() if n),
                     "compression_ratio": ratio, "on_tier": within,
                     "on_tier_text": {True: "yes", False: "no", None: "-"}[within],
                     "final_val_loss": float(loss[-1]),
                     "run_time_s": float(steps[-1]) * step,
                     "steps": steps, "loss": loss})
  for row in rows:
    same = lambda name, r=row: next((x for x in rows if x["method"] == name and x["link"] ==
                                     r["link"] and x["workers"] == r["workers"]), None)
    fair, dense = same(FAIR), same("dense")
    if dense is None:
      continue
    target = dense["final_val_loss"]
    fair_time, plain_time = fair["run_time_s"], dense["run_time_s"]
    reach = time_to(row["steps"], row["loss"], row["step_s"], target)
    row["dense_loss"], row["dense_time_s"], row["dense_f32_time_s"] = (target, fair_time,
                                                                        plain_time)
    row["time_to_dense_s"] = reach
    row["speedup"] = fair_time / reach if math.isfinite(reach) else None
    row["speedup_f32"] = plain_time / reach if math.isfinite(reach) else None
    row["reached"] = math.isfinite(reach)
    if not row["reached"]:
      value, ran_out = loss_at(row["steps"], row["loss"], row["step_s"], fair_time)
      row["loss_at_dense_time"], row["ran_out"] = value, ran_out
      row["at_dense_time"] = (
          f"ran out of steps after {row['run_time_s']:.4g} s: final loss"
          if ran_out else f"at {fair_time:.4g} s")
  return rows


def add_horizon(rows: list[dict], workdir: str, seeds: int) -> None:
  """Equal time: ``fits_steps``, the steps of the row's step time that fit in the fair
  baseline's total time, and, for a row that ran out of steps before it, ``horizon``: what its
  longest horizon run (F7-LM's ``<row>_len<k>``, the schedule stretched, at the row's scale)
  that still fits reached; where none fits, what the shortest one had reached at the baseline's
  time, mid-schedule; or that none ran."""
  for row in rows:
    if "dense_time_s" not in row:
      continue
    row["fits_steps"] = row["dense_time_s"] / row["step_s"]
    if not row.get("ran_out"):
      continue
    longer = []
    for length in horizon_config.LENGTHS:
      found = curve(workdir, horizon_config.label(row["method"], length), seeds,
                    scale=row["lr_scale"])
      if found is not None:
        longer.append((length, found[1], found[2]))
    fitting = [(k, steps, loss) for k, steps, loss in longer if steps[-1] <= row["fits_steps"]]
    if not longer:
      row["horizon"] = "no horizon run"
      continue
    if not fitting:
      # The shortest longer run, read at the baseline's time: its schedule has not decayed there,
      # so a run sized to that time would likely do better; said, not hidden.
      length, steps, loss = longer[0]
      reach = time_to(steps, loss, row["step_s"], row["dense_loss"])
      at, _ = loss_at(steps, loss, row["step_s"], row["dense_time_s"])
      head = (f"its {length}x run ({steps[-1]:.0f} steps) is longer than the fair baseline's "
              f"time; at step {row['fits_steps']:.0f}, mid-schedule, it ")
      row["horizon"] = head + (f"reaches dense's loss at {reach:.4g} s"
                               if reach <= row["dense_time_s"] else
                               f"is at {at:.3f}, short of dense's loss")
      continue
    length, steps, loss = fitting[-1]
    reach = time_to(steps, loss, row["step_s"], row["dense_loss"])
    row["horizon"] = (f"{length}x run ({steps[-1]:.0f} steps): "
                      + (f"reaches dense's loss at {reach:.4g} s" if math.isfinite(reach) else
                         f"ends at {loss[-1]:.3f}, short of dense's loss"))


def _rank(row: dict) -> tuple:
  """Best first: reaching dense's loss by speed-up, then the lowest loss in dense's time."""
  if row.get("reached"):
    return (0, -row["speedup"])
  value = row.get("loss_at_dense_time", math.nan)
  return (1, value if math.isfinite(value) else math.inf)


def best(rows: list[dict], tier: str, link: str = HEADLINE_LINK,
         workers: int = HEADLINE_WORKERS) -> dict | None:
  """The best row of ``tier`` (``100x``, ...) on ``workers`` workers over ``link``: among its rows
  on their tier of bytes (``on_tier``), the fastest to dense's final loss, else the one with
  the lowest validation loss in dense's time; None without such rows (or without dense)."""
  pool = [r for r in rows if r["tier"] == tier and r.get("on_tier") and r["link"] == link
          and r["workers"] == workers and "reached" in r]
  return min(pool, key=_rank, default=None)


def fastest_rows(rows: list[dict]) -> list[dict]:
  """Per (link, workers): the row (of any tier, on its tier of bytes; not a dense baseline) that
  reaches dense's final loss soonest (:func:`_rank`), with its speed-ups over both baselines or,
  where none reaches it, the lowest loss in the fair baseline's time."""
  out = []
  for link in LINKS:
    for workers in WORKERS:
      pool = [r for r in rows if r["link"] == link and r["workers"] == workers
              and r["method"] not in ("dense", FAIR) and r.get("on_tier") and "reached" in r]
      top = min(pool, key=_rank, default=None)
      if top is None:
        continue
      out.append({"link": link, "workers": workers, "row": top["method"],
                  "result": (f"{top['speedup']:.3g}x vs {FAIR}, {top['speedup_f32']:.3g}x vs "
                             "dense float32" if top["reached"] else
                             f"none reaches it: {top['loss_at_dense_time']:.3f} in {FAIR}'s "
                             f"{top['dense_time_s']:.4g} s"
                             + (" (ran out of steps)" if top["ran_out"] else "")),
                  "compute_s": top["compute_s"], "exposed_s": top["exposed_s"]})
  return out


def describe(row: dict) -> str:
  """A row's result against dense's final loss, in words."""
  fair = "dense's (bf16 all-reduce overlapped with the backward pass)"
  if row["reached"]:
    return (f"{row['method']} reaches dense's final validation loss {row['dense_loss']:.3f} in "
            f"{row['time_to_dense_s']:.4g} s vs {fair} {row['dense_time_s']:.4g} s: "
            f"{row['speedup']:.2f}x ({row['speedup_f32']:.2f}x against float32 dense after the "
            "backward pass)")
  if row["ran_out"]:
    return (f"{row['method']} never reaches dense's final validation loss "
            f"{row['dense_loss']:.3f}; it ran out of steps after "
            f"{row['run_time_s']:.4g} s, before {fair} "
            f"{row['dense_time_s']:.4g} s, at {row['loss_at_dense_time']:.3f}")
  return (f"{row['method']} never reaches dense's final validation loss {row['dense_loss']:.3f};"
          f" in {fair} {row['dense_time_s']:.4g} s it reaches {row['loss_at_dense_time']:.3f}")


def headline(rows: list[dict], tier: str) -> dict | None:
  """The README's headline for ``tier`` (``100x`` or ``1000x``): the best row (:func:`best`) on
  8 workers over 1 Gbit/s, as ``{"method", "speedup", "loss_at_dense_time", "ran_out",
  "dense_loss", "text"}``: ``speedup`` dense's time to its final validation loss over the row's
  (None when the row never reaches it), else ``loss_at_dense_time`` the row's validation loss in
  dense's total time (its final loss, ``ran_out`` True, when its whole run is over sooner);
  ``text`` says it in words. None when the tier has no such row or dense has not run.

  ``rows``: :func:`time_rows`' rows or a report's (``f5.report(...).rows``)."""
  row = best(rows, tier)
  if row is None:
    return None
  return {"method": row["method"], "speedup": row["speedup"],
          "loss_at_dense_time": row.get("loss_at_dense_time"), "ran_out": row.get("ran_out"),
          "dense_loss": row["dense_loss"],
          "text": f"at {tier}, {HEADLINE_WORKERS} workers, {HEADLINE_LINK}: " + describe(row)}


def plot(rows: list[dict], labels_: list[str], tier: str, fig) -> None:
  """F5's figure: validation loss against time, a panel per (link, workers), a line per row
  (dashed at 1000x and for the fair baseline), dense's final loss dotted."""
  panels = fig.subplots(2, 2, sharey=True)
  fig.subplots_adjust(left=0.07, right=0.78, bottom=0.09, top=0.92, hspace=0.35, wspace=0.08)
  for (link_name, workers), ax in zip([(l, w) for l in LINKS for w in WORKERS], panels.flat):
    for row in rows:
      if (row["link"], row["workers"]) == (link_name, workers):
        ax.plot(row["steps"] * row["step_s"], row["loss"], marker="o", ms=2,
                ls="--" if row["tier"] == "1000x" or row["method"] == FAIR else "-",
                label=row["method"],
                color=_colour(row["method"], labels_))
        if row["method"] == "dense":
          ax.axhline(row["final_val_loss"], color="0.5", ls=":", lw=1)
    ax.set_xlim(left=0)
    plots.decorate(ax, title=f"{workers} workers, {link_name}", title_size=10,
                   xlabel="compute (measured) + comm. (modelled), s")
    ax.tick_params(labelsize=8)
  for ax in panels[:, 0]:
    ax.set_ylabel("validation loss, nats/token")
  handles, names = panels.flat[0].get_legend_handles_labels()
  fig.legend(handles, names, fontsize=8, loc="upper left", bbox_to_anchor=(0.79, 0.92))
  fig.suptitle(f"F5 ({tier} tier): validation loss vs measured compute + modelled "
               "communication (mean over seeds)", fontsize=11)


def _colour(label: str, labels_: list[str]) -> str:
  """One colour per row, the same in every panel."""
  return f"C{labels_.index(label) % 10}"


def _compute_caveat(tier: str) -> str:
  if tier == "gpu":
    return ("compute measured with all workers simulated on one GPU, so a step's compute is the "
            "whole cluster's on one device and communication's share smaller than on a cluster")
  return ("compute measured with all 8 workers on the runs' CPU cores (notes: machines), so a "
          "step's compute is far larger than a GPU's and communication's share far smaller")


def claims(rows: list[dict], tier: str = "cpu") -> list[Claim]:
  def at(method, link, workers):
    return next((r for r in rows if (r["method"], r["link"], r["workers"])
                 == (method, link, workers)), None)
  out = []
  top = best(rows, sweep_config.HEADLINE)
  if top is not None:
    slow, fast = top, at(top["method"], "10 Gbit/s", 8)
    dense_slow, dense_fast = at(FAIR, "1 Gbit/s", 8), at(FAIR, "10 Gbit/s", 8)
    out.append(Claim(
        "Compression pays on slow links and much less on fast ones (at 10 Gbit/s 2-5x "
        "compression is enough)", "Agarwal et al., MLSys 2022 (REFERENCES.md)",
        f"best row at {sweep_config.HEADLINE}, 8 workers: at 1 Gbit/s {describe(slow)}; at "
        f"10 Gbit/s {describe(fast)} (compute {slow['compute_s']:.3f} s/step measured; "
        f"communication {slow['comm_s']:.4f} and {fast['comm_s']:.4f} s/step modelled, dense's "
        f"in bf16 {dense_slow['comm_s']:.4f} and {dense_fast['comm_s']:.4f})",
        # Where compression does not pay even on the slow link, the setting cannot test the
        # claim's contrast between links.
        None if not slow["reached"] or slow["speedup"] <= 1 or not fast["reached"] else
        slow["speedup"] >= fast["speedup"],
        _compute_caveat(tier)))
  for tier_name in sweep_config.HEADLINE_TIERS:
    line = headline(rows, tier_name)
    if line is None:
      continue
    out.append(Claim(
        f"At {tier_name} fewer total bytes, the best row reaches dense's final validation loss "
        f"sooner than dense (bf16, overlapped) on {HEADLINE_WORKERS} workers over "
        f"{HEADLINE_LINK}",
        "project headline (README)", line["text"],
        line["speedup"] is not None and line["speedup"] > 1,
        "best: fastest to dense's loss among the tier's rows on their tier of bytes, reported "
        "not selected; compute measured, communication modelled; " + _compute_caveat(tier)))
  return out
