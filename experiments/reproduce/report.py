"""Outputs of the paper reproduction: run directories in, Markdown + CSV + PNG out.

Every target of :mod:`experiments.reproduce` (one module per table or figure) ends in a
:class:`Report`: a table whose numbers come from run directories (each row names its own), the
published claims it stands beside with what we found for each, and notes. :func:`write_report`
writes ``NAME.md``, ``NAME.csv`` and ``NAME.png`` (matplotlib, Agg backend); each names the
command, the configs and the commit (:class:`Provenance`) and the published numbers; the
figures draw with :mod:`experiments.reproduce.plots`. Run directories are read
(:func:`read_run`) and, for results computed outside the runner, written (:func:`write_run`)
here. Nothing here imports JAX.
"""

import csv
import dataclasses
import io
import json
import math
import os
import textwrap
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import matplotlib
from matplotlib import figure
import numpy as np

from experiments import logs
from experiments import provenance

REPO_ROOT = Path(__file__).resolve().parents[2]
# Figures draw on this area (inches); the footer takes a strip below it.
PLOT_SIZE = (11, 6.5)
FOOTER_POINTS = 8
_FOOTER_LINE_SPACING = 1.3
# Footer characters per line across the figure (DejaVu Sans averages about 0.55 em each).
_FOOTER_CHARACTERS = int(PLOT_SIZE[0] * 72 / (0.55 * FOOTER_POINTS)) - 4
RESULTS_FILE = "results.json"  # what experiments.train writes when a run has finished
CONFIG_FILE = "config.json"


@dataclasses.dataclass(frozen=True)
class Claim:
  """A published claim beside what this reproduction measured.

  Attributes:
    claim: the published statement, with its numbers.
    source: the paper (and setting) it comes from.
    ours: what we measured that answers it.
    reproduced: True / False, or None where our setting cannot answer it.
    why: the reason for the verdict (scale, setting, accounting).
  """
  claim: str
  source: str
  ours: str
  reproduced: bool | None
  why: str = ""

  @property
  def verdict(self) -> str:
    word = {True: "yes", False: "no", None: "not comparable"}[self.reproduced]
    return f"{word}: {self.why}" if self.why else word


@dataclasses.dataclass(frozen=True)
class Provenance:
  """Where a report came from.

  Attributes:
    record: :func:`experiments.provenance.record` of the reproducing process (the command, the
      commit, the versions, the devices).
    settings: ``"quick"`` or ``"full"``.
  """
  record: dict
  settings: str

  @property
  def command(self) -> str:
    return self.record["command"]

  @property
  def commit(self) -> str:
    return provenance.commit_text(self.record)


@dataclasses.dataclass
class Report:
  """One target's outputs.

  Attributes:
    name: file stem in the output folder (``t1`` -> ``t1.md``, ``t1.csv``, ``t1.png``).
    title: the page's title.
    columns: ``(key, header)`` of the main table, in order; rows lacking a key show ``-``.
    rows: the main table (also the CSV).
    claims: the published claims beside our numbers.
    notes: settings, assumptions and caveats, one sentence or more each.
    configs: the config files (with arguments) or settings the numbers come from.
    plot: draws the figure onto a ``matplotlib.figure.SubFigure`` of :data:`PLOT_SIZE` (the
      footer goes below it); None for no figure.
    sections: extra Markdown sections, ``(heading, body)``.
  """
  name: str
  title: str
  columns: Sequence[tuple[str, str]]
  rows: list[dict]
  claims: Sequence[Claim] = ()
  notes: Sequence[str] = ()
  configs: Sequence[str] = ()
  plot: Callable[[Any], None] | None = None
  sections: Sequence[tuple[str, str]] = ()


def format_cell(value: Any) -> str:
  """A table cell: floats to 4 significant digits, None/missing as ``-``."""
  if value is None or (isinstance(value, float) and math.isnan(value)):
    return "-"
  if isinstance(value, float):
    return f"{value:.4g}"
  return str(value).replace("|", "\\|").replace("\n", " ")


def markdown_table(columns: Sequence[tuple[str, str]], rows: Iterable[dict]) -> str:
  """A GitHub Markdown table of ``rows`` under ``columns``' headers."""
  lines = ["| " + " | ".join(h for _, h in columns) + " |",
           "|" + "---|" * len(columns)]
  for row in rows:
    lines.append("| " + " | ".join(format_cell(row.get(k)) for k, _ in columns) + " |")
  return "\n".join(lines)


def claims_table(claims: Sequence[Claim]) -> str:
  return markdown_table(
      [("claim", "published claim"), ("source", "source"), ("ours", "this reproduction"),
       ("verdict", "reproduced here?")],
      [{"claim": c.claim, "source": c.source, "ours": c.ours, "verdict": c.verdict}
       for c in claims])


def _header_lines(report: Report, prov: Provenance) -> list[str]:
  return [f"Command: `{prov.command}`", f"Commit: `{prov.commit}`",
          f"Settings: {prov.settings}; written {provenance.describe(prov.record)}",
          "Configs: " + (", ".join(f"`{c}`" for c in report.configs) or "-")]


def write_report(report: Report, prov: Provenance, out_dir: str | os.PathLike) -> list[Path]:
  """Writes ``NAME.md``, ``NAME.csv`` and (if the report has a plot) ``NAME.png``.

  Returns:
    The paths written.
  """
  out = Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  written = []
  png = out / f"{report.name}.png"
  if report.plot is not None:
    _write_png(report, prov, png)
    written.append(png)

  md = [f"# {report.title}", "", *[f"{line}  " for line in _header_lines(report, prov)], ""]
  if report.claims:
    md += ["## Published claims beside this reproduction", "", claims_table(report.claims), ""]
  md += ["## Results", "", markdown_table(report.columns, report.rows), ""]
  for heading, body in report.sections:
    md += [f"## {heading}", "", body.strip(), ""]
  if report.notes:
    md += ["## Notes", "", *[f"- {n}" for n in report.notes], ""]
  if report.plot is not None:
    md += [f"![{report.name}]({png.name})", ""]
  (out / f"{report.name}.md").write_text("\n".join(md))
  written.append(out / f"{report.name}.md")

  buffer = io.StringIO()
  for line in _header_lines(report, prov):
    buffer.write(f"# {line}\n")
  for c in report.claims:
    buffer.write(f"# claim: {c.claim} ({c.source}); ours: {c.ours}; reproduced: {c.verdict}\n")
  keys = [k for k, _ in report.columns]
  extra = sorted({k for row in report.rows for k in row} - set(keys))
  writer = csv.DictWriter(buffer, fieldnames=keys + extra, lineterminator="\n")
  writer.writeheader()
  for row in report.rows:
    writer.writerow({k: _csv_cell(row.get(k, "")) for k in keys + extra})
  (out / f"{report.name}.csv").write_text(buffer.getvalue())
  written.append(out / f"{report.name}.csv")
  return written


def _csv_cell(value):
  """A list or tuple (a row's losses, the corpora it trained on) as JSON, which any reader can
  parse, rather than as Python prints it."""
  if isinstance(value, (list, tuple)):
    return json.dumps(value, default=lambda v: v.item() if isinstance(v, np.generic) else str(v))
  return value


def _write_png(report: Report, prov: Provenance, path: Path) -> None:
  """Draws ``report.plot`` on a :data:`PLOT_SIZE` area and, in a strip below as tall as its lines
  need, the footer: the command, the commit, the settings and the published claims."""
  matplotlib.use("Agg")
  claims = "; ".join(f"{c.claim} [{c.source}]" for c in report.claims)
  lines = [line for paragraph in (
      f"{prov.command}  |  commit {prov.commit[:12]}  |  {prov.settings} settings  |  "
      f"{prov.record['date']}", f"Published: {claims or 'n/a'}")
           for line in textwrap.wrap(paragraph, _FOOTER_CHARACTERS)]
  footer_height = (len(lines) + 1) * _FOOTER_LINE_SPACING * FOOTER_POINTS / 72
  fig = figure.Figure(figsize=(PLOT_SIZE[0], PLOT_SIZE[1] + footer_height))
  plot_area, footer = fig.subfigures(2, 1, height_ratios=[PLOT_SIZE[1], footer_height])
  report.plot(plot_area)
  footer.text(0.005, 0.5, "\n".join(lines), fontsize=FOOTER_POINTS, va="center",
              linespacing=_FOOTER_LINE_SPACING)
  fig.savefig(path, dpi=110)


# ----------------------------------------------------------------------------- run directories


@dataclasses.dataclass
class Run:
  """One run directory as the runner leaves it.

  Attributes:
    path: the directory.
    config: ``config.json``.
    results: ``results.json`` (None while unfinished).
    metrics: the records of ``metrics.jsonl``.
  """
  path: str
  config: dict
  results: dict | None
  metrics: list[dict]

  @property
  def finished(self) -> bool:
    return self.results is not None

  def last(self, key: str) -> Any:
    """The last logged value of ``key`` in ``metrics.jsonl`` (None if never logged)."""
    for record in reversed(self.metrics):
      if key in record:
        return record[key]
    return None

  def training_seconds(self) -> float:
    """The seconds its training loop took, from the throughput it logged: each logged
    interval's steps times the batch over the interval's examples a second. Compiles and
    evaluations inside the loop count; the set-up before it and the final evaluation do not,
    and steps that a stop lost and a resume ran again count once (their last log)."""
    rates = {r["step"]: r["examples_per_sec"] for r in self.metrics
             if r.get("examples_per_sec")}
    seconds, previous = 0.0, 0
    for step in sorted(rates):
      seconds += self.config["batch_size"] * (step - previous) / rates[step]
      previous = step
    return seconds

  def series(self, key: str) -> tuple[np.ndarray, np.ndarray]:
    """``(steps, values)`` of every record of ``metrics.jsonl`` that has ``key``."""
    records = [r for r in self.metrics if key in r]
    return (np.array([r["step"] for r in records], float),
            np.array([r[key] for r in records], float))


def read_run(run_dir: str | os.PathLike) -> Run | None:
  """The run in ``run_dir``, or None if it has not started (no ``config.json``)."""
  run_dir = str(run_dir)
  config_path = os.path.join(run_dir, CONFIG_FILE)
  if not os.path.exists(config_path):
    return None
  with open(config_path) as f:
    config = json.load(f)
  results_path = os.path.join(run_dir, RESULTS_FILE)
  results = None
  if os.path.exists(results_path):
    with open(results_path) as f:
      results = json.load(f)
  return Run(run_dir, config, results, logs.read_metrics(run_dir))


def holds_runs(folder: str | os.PathLike) -> bool:
  """Whether ``folder`` is a run directory or holds one (a ``config.json`` in it or in a folder
  directly under it): what a target's report can be built from."""
  if os.path.exists(os.path.join(folder, CONFIG_FILE)):
    return True
  return os.path.isdir(folder) and any(
      os.path.exists(os.path.join(folder, name, CONFIG_FILE)) for name in os.listdir(folder))


def write_run(run_dir: str | os.PathLike, config: dict, records: Sequence[dict],
              results: dict) -> None:
  """Leaves a run directory as the runner does, for results computed outside it (models,
  compile-only measurements): ``config.json``, ``metrics.jsonl`` and, last, ``results.json``,
  the two JSON files with the provenance of this process (no devices named: the measurements ran
  in processes of their own)."""
  os.makedirs(run_dir, exist_ok=True)
  origin = {provenance.KEY: provenance.record()}
  logs.write_json(os.path.join(run_dir, CONFIG_FILE), {**config, **origin})
  with open(os.path.join(run_dir, logs.METRICS_FILE), "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in records)
  logs.write_json(os.path.join(run_dir, RESULTS_FILE), {**results, **origin})


def mean_std(values: Sequence[float]) -> tuple[float, float]:
  """Mean and sample standard deviation (``ddof=1``; 0 for one value; NaN for none)."""
  x = np.asarray(values, float)
  if x.size == 0:
    return float("nan"), float("nan")
  return float(x.mean()), float(x.std(ddof=1)) if x.size > 1 else 0.0


def format_mean_std(values: Sequence[float], scale: float = 1.0, digits: int = 2) -> str:
  """``"mean ± std (n)"`` of ``values * scale``; ``-`` for none."""
  if not len(values):
    return "-"
  mean, std = mean_std([v * scale for v in values])
  return f"{mean:.{digits}f} ± {std:.{digits}f} (n={len(values)})"


def relative(path: str | os.PathLike) -> str:
  """``path`` relative to the repository when inside it (for tables), else as given."""
  try:
    return str(Path(path).resolve().relative_to(REPO_ROOT))
  except ValueError:
    return str(path)
