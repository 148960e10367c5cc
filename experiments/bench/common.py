"""What every benchmark of :mod:`experiments.bench` shares: methods, child processes, timing,
and the results files.

Each measurement runs in a child process (``python -m experiments.bench.<module> --child
<json>``) whose environment the parent sets before JAX starts: the platform (``--platform``: the
CPU, or the GPU for the compression cost and the training step; the parent itself never starts
a backend, so it never holds the GPU), the number of simulated CPU devices (1 for compression
cost, 8 for a training step, up to 256 for wire bytes), a child that exceeds its time limit is
killed and its row marked skipped with the reason, and the memory is returned after every large
buffer. Results record the device and the JAX version that measured them.

Figures are ratios of two times measured in the same process, each the fastest of several
calls made in alternation after a warm-up call (other load on a shared machine only ever adds
time, and alternating exposes both to the same load).
"""

import dataclasses
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jaxlib

from compressors import registry
from configs import common as config_common
from experiments import methods
from experiments import provenance

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO_ROOT / provenance.BENCHMARK_RESULTS

# Settings that differ from the methods' defaults (config.compression.<method>): PowerSGD at
# rank 4 (the wire-bytes benchmark's); everything else (density 0.01, TASC's 256-element blocks
# and Hutchinson scores) is the default.
SETTINGS = {"powersgd": {"rank": 4}}

# Gradient sizes by name: ResNet-50 and BERT-base (with pooler, the usual "110M") parameters.
SIZES = {"1m": 1_000_000, "resnet50": 25_557_032, "bert_base": 109_482_240}


def parse_size(text: str) -> int:
  """Elements from a size name of :data:`SIZES`, an int, or ``25.6m``/``110M``/``4k``; refused
  where it is not one, or rounds to no element (``0.0001m``)."""
  key = text.strip().lower()
  if key in SIZES:
    return SIZES[key]
  match = re.fullmatch(r"([0-9]+\.?[0-9]*|\.[0-9]+)([km]?)", key)
  elements = 0 if match is None else int(round(
      float(match.group(1)) * {"": 1, "k": 1e3, "m": 1e6}[match.group(2)]))
  if elements < 1:
    raise ValueError(f"--sizes: {text!r} is not a size of at least one element; allowed: "
                     f"{sorted(SIZES)}, a positive int, or a number with k/m (e.g. 25.6m)")
  return elements


def all_methods() -> tuple[str, ...]:
  """Every registered per-step exchange (:mod:`compressors.registry`): what the benchmarks time
  (a method that is its own optimizer or updates locally is not one exchange of a gradient)."""
  return registry.names("per_step")


def check_methods(methods: Sequence[str], allowed: Sequence[str] | None = None) -> list[str]:
  """``methods`` if every one is allowed (default: registered), else a ValueError naming the
  first unknown one."""
  allowed = all_methods() if allowed is None else allowed
  for m in methods:
    if m not in allowed:
      raise ValueError(f"--methods: {m!r} is not a benchmarked method; allowed: {list(allowed)}")
  return list(methods)


def method_config(method: str, **settings):
  """The run config ``experiments.methods`` builds ``method`` from (defaults plus overrides of
  its own settings, ``config.compression.<method>``)."""
  config = config_common.base()
  config.method = method
  config.compression[method].update(dict(SETTINGS.get(method, {}), **settings))
  return config


def communication(method: str, axis_name, **settings):
  """The per-worker exchange transformation of ``method``, exactly as the runner trains with."""
  return methods.communication(method_config(method, **settings), axis_name)


# ----------------------------------------------------------------------------- child processes


PLATFORMS = ("cpu", "gpu", "auto")


def resolve_platform(platform: str) -> str:
  """``"cpu"`` or ``"gpu"`` for ``--platform``: ``auto`` is the GPU where JAX finds one (asked
  of a child process).

  Raises:
    ValueError: an unknown platform, or ``gpu`` where JAX finds none.
  """
  if platform not in PLATFORMS:
    raise ValueError(f"--platform={platform!r}; allowed: {list(PLATFORMS)}")
  if platform == "cpu":
    return "cpu"
  env = {k: v for k, v in cpu_env().items() if k != "JAX_PLATFORMS"}
  found = subprocess.run([sys.executable, "-c", "import jax; print(jax.default_backend())"],
                         env=env, capture_output=True, text=True, timeout=600, check=False)
  backend = found.stdout.strip().splitlines()[-1] if found.returncode == 0 else (
      f"none: {error_line(found.stderr, found.returncode)}")
  if backend == "gpu":
    return "gpu"
  if platform == "gpu":
    raise ValueError(f"--platform=gpu: JAX finds no GPU here (its default backend: {backend}); "
                     "allowed here: cpu, auto")
  return "cpu"


def child_env(platform: str, num_devices: int = 1) -> dict[str, str]:
  """Environment for a child on ``platform`` (``cpu``/``gpu``); ``num_devices`` simulated CPU
  devices (on a GPU they compile the programs read only for their bytes)."""
  env = cpu_env(num_devices)
  if platform == "gpu":
    env["JAX_PLATFORMS"] = "cuda,cpu"
  return env


def device_info() -> dict[str, str]:
  """What a child measured on (call after its backend started)."""
  return {"platform": jax.default_backend(), "device": jax.devices()[0].device_kind,
          "jax": jax.__version__, "jaxlib": jaxlib.__version__}


def measured_on(rows: Sequence[dict]) -> dict[str, str]:
  """The device and versions of the first measured row (for a report's settings)."""
  for row in rows:
    if "device" in row:
      return {k: row[k] for k in ("platform", "device", "jax", "jaxlib") if k in row}
  return {}


def cpu_env(num_devices: int = 1) -> dict[str, str]:
  """Environment for a child that simulates ``num_devices`` CPU devices."""
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
  flags = re.sub(r"--xla_force_host_platform_device_count=\S*", "", env.get("XLA_FLAGS", ""))
  if num_devices > 1:
    flags += f" --xla_force_host_platform_device_count={num_devices}"
  env["XLA_FLAGS"] = flags.strip()
  return env


def run_child(module: str, request: dict, *, env: dict[str, str], timeout_s: float) -> dict:
  """Runs ``python -m module --child '<request json>'`` and returns the JSON it prints last.

  A child that runs past ``timeout_s`` is killed: the answer is then ``{"skipped": reason}``.
  A child that fails answers ``{"error": its last line of stderr}`` (the whole tail is logged to
  stderr), so one failing method does not lose the other rows.
  """
  cmd = [sys.executable, "-m", module, "--child", json.dumps(request)]
  start = time.monotonic()
  try:
    result = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                            timeout=timeout_s, check=False)
  except subprocess.TimeoutExpired:
    return {"skipped": f"not finished within the {timeout_s:.0f} s limit (--timeout)"}
  if result.returncode != 0:
    print(f"{module} child {request} failed with status {result.returncode} after "
          f"{time.monotonic() - start:.0f} s:\n{result.stderr[-4000:]}", file=sys.stderr)
    return {"error": error_line(result.stderr, result.returncode)}
  return json.loads(result.stdout.strip().splitlines()[-1])


def error_line(log: str, status: int) -> str:
  """The exception line of a failed child's output (the last ``SomethingError: ...``)."""
  errors = [line for line in log.splitlines() if re.match(r"^[\w.]*(Error|Exception)\b", line)]
  return (errors or [f"exit status {status}"])[-1][:300]


def not_measured(result: dict) -> str | None:
  """``"skipped: why"`` or ``"failed: why"`` for a child's answer without figures, else None."""
  if "skipped" in result:
    return f"skipped: {result['skipped']}"
  if "error" in result:
    return f"failed: {result['error']}"
  return None


def child_main(argv: Sequence[str] | None, measure: Callable[[dict], Any]) -> bool:
  """If ``argv`` is ``--child <json>``: prints ``measure(request)`` as JSON and returns True."""
  argv = sys.argv[1:] if argv is None else list(argv)
  if len(argv) != 2 or argv[0] != "--child":
    return False
  print(json.dumps(measure(json.loads(argv[1]))), flush=True)
  return True


# ----------------------------------------------------------------------------- timing


def fresh_copies(tree):
  """Copies of ``tree``'s arrays, computed and waited for: the arguments of one call that donates
  them (as a training step donates its state), made before the clock starts."""
  return jax.block_until_ready(jax.tree.map(jax.numpy.copy, tree))


def fastest_interleaved(calls: dict[str, Callable[[], Callable[[], Any]]], repeats: int,
                        budget_s: float | None = None) -> dict[str, dict[str, float]]:
  """Times each call ``repeats`` times in alternation, after one warm-up call of each.

  Args:
    calls: name -> ``prepare``; ``prepare()`` builds the arguments of one call (untimed: fresh
      copies of donated buffers) and returns the zero-argument call to time, whose result is
      waited for with ``jax.block_until_ready``.
    repeats: timed calls of each.
    budget_s: if set, fewer repeats (at least 3) when the warm-up calls say that ``repeats``
      rounds would take longer than this.

  Returns:
    name -> ``{"wall": fastest wall-clock seconds, "cpu": fastest process CPU seconds,
    "median_wall": median wall-clock seconds, "repeats": timed calls}``. CPU time (all
    threads) does not count the time the process waited for a core, so it is the steadier
    figure on a loaded machine.
  """
  times = {name: [] for name in calls}

  def timed(prepare):
    call = prepare()
    wall, cpu = time.perf_counter(), time.process_time()
    jax.block_until_ready(call())
    return time.perf_counter() - wall, time.process_time() - cpu

  warm_up = sum(timed(prepare)[0] for prepare in calls.values())
  if budget_s is not None:
    repeats = min(repeats, max(3, int(budget_s / max(warm_up, 1e-9))))
  for _ in range(repeats):
    for name, prepare in calls.items():
      times[name].append(timed(prepare))
  out = {}
  for name, pairs in times.items():
    walls = sorted(w for w, _ in pairs)
    out[name] = {"wall": walls[0], "cpu": min(c for _, c in pairs),
                 "median_wall": walls[len(walls) // 2], "repeats": repeats}
  return out


# ----------------------------------------------------------------------------- results


@dataclasses.dataclass
class Report:
  """One benchmark's results: a table (rows of dicts) and notes, written as JSON and markdown.

  Attributes:
    name: file stem (``compression``, ``step``, ``bytes``, ``links``).
    title: the table's heading.
    columns: (key, heading) of each table column, in order.
    rows: one dict per row; keys not in ``columns`` go to the JSON only.
    notes: lines printed under the table (method, sizes, what each ratio means).
    settings: how it was run (in the JSON).
    data: the measurements behind the table, when it summarises them (in the JSON).
    num_workers: the simulated devices of a measurement, or the counts the benchmark swept.
    process_count: the processes of a measurement, or the counts the benchmark swept.
  """
  name: str
  title: str
  columns: list[tuple[str, str]]
  rows: list[dict]
  notes: list[str] = dataclasses.field(default_factory=list)
  settings: dict = dataclasses.field(default_factory=dict)
  data: list = dataclasses.field(default_factory=list)
  num_workers: int | list[int] = 1
  process_count: int | list[int] = 1

  def markdown(self, origin: dict) -> str:
    """The table under its title and provenance (``origin``, a
    :func:`experiments.provenance.record`), then the notes."""
    lines = [f"## {self.title}", "",
             f"Command: `{origin['command']}`  ",
             f"Commit: `{provenance.commit_text(origin)}`  ",
             f"Written {provenance.describe(origin)}", "",
             "| " + " | ".join(h for _, h in self.columns) + " |",
             "|" + "|".join("---" for _ in self.columns) + "|"]
    for row in self.rows:
      lines.append("| " + " | ".join(_cell(row.get(k)) for k, _ in self.columns) + " |")
    if self.notes:
      lines += [""] + [f"- {n}" for n in self.notes]
    return "\n".join(lines) + "\n"

  def write(self, out: Path) -> list[Path]:
    """Writes ``<out>/<name>.json`` and ``<out>/<name>.md``, each with the provenance of this
    process (its children's device where the settings name one, :func:`measured_on`); returns
    their paths."""
    origin = provenance.record(devices=jax.devices("cpu")[:1], num_workers=self.num_workers,
                               process_count=self.process_count)
    if "device" in self.settings:  # the children measured on another platform (--platform)
      origin.update(device_platforms=[self.settings["platform"]],
                    device_kinds=[self.settings["device"]])
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{self.name}.json", out / f"{self.name}.md"]
    paths[0].write_text(json.dumps(
        {"title": self.title, "settings": self.settings, "rows": self.rows,
         "notes": self.notes, provenance.KEY: origin, "load_average": load,
         **({"data": self.data} if self.data else {})}, indent=1) + "\n")
    paths[1].write_text(self.markdown(origin))
    return paths


def goal(met: bool | None, what: str) -> str:
  """The goal column's cell: ``met (what)``, ``missed (what)``, or ``-`` when not measured."""
  if met is None:
    return f"not measured ({what})"
  return f"{'met' if met else 'missed'} ({what})"


def _cell(value) -> str:
  if value is None:
    return ""
  if isinstance(value, float):
    if value == 0:
      return "0"
    if abs(value) >= 100:
      return f"{value:,.0f}"
    return f"{value:.3g}"
  if isinstance(value, int):
    return f"{value:,}"
  return str(value)
