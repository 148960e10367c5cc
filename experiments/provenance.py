"""Where a result came from: the command, the code, the software and the devices.

Every results file the project writes carries one :func:`record`: a run's ``config.json`` and
``results.json`` (:mod:`experiments.train`), each benchmark's ``.json`` and ``.md``
(:mod:`experiments.bench`), and the paper reproduction's outputs (:mod:`experiments.reproduce`),
so that every number traces to the command line, the commit (and whether the tree had
uncommitted changes), the versions and the devices that produced it.

Nothing here imports JAX: versions come from the installed packages' metadata and the devices
from the caller, whose JAX already runs; the reproduction's report, which reads and writes
results without JAX, uses it too.
"""

import datetime
import importlib.metadata
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# Where the reproduction and the benchmarks write their tables by default (relative to the
# repository's root). They rewrite them as they go (the reproduction between targets), so a change
# there says nothing about the code that ran and does not make a tree dirty.
PAPER_FIGURES = "paper_figures"
BENCHMARK_RESULTS = "benchmarks/results"
GENERATED_OUTPUTS = (PAPER_FIGURES, BENCHMARK_RESULTS)
# The key under which results files hold the record (beside a run's config in config.json).
KEY = "provenance"
# A launcher that starts processes on a user's behalf (experiments.launch, the reproduction's
# child runs) names its own command here, so that its processes record, and tell the user to
# rerun, the command the user typed rather than their own.
COMMAND_ENV = "EXPERIMENTS_COMMAND"


def command() -> str:
  """The command line to rerun this process's work: ``$EXPERIMENTS_COMMAND`` where a launcher
  set it, else this process's own (interpreter and options included)."""
  return os.environ.get(COMMAND_ENV) or shlex.join(sys.orig_argv)


def git_state(repo: str | os.PathLike = Path(__file__).resolve().parent
              ) -> tuple[str | None, bool | None]:
  """``(commit, dirty)`` of the checkout that holds ``repo`` (by default, this code's).

  Returns:
    ``git rev-parse HEAD`` and whether tracked files differ from it (untracked files and the
    generated outputs in ``GENERATED_OUTPUTS`` do not count); ``(None, None)`` outside a git
    checkout, or without git.
  """
  try:
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True,
                          text=True, timeout=30, check=True).stdout.strip()
    excluded = [f":(top,exclude){path}" for path in GENERATED_OUTPUTS]
    status = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no", "--", ":(top)", *excluded],
        cwd=repo, capture_output=True, text=True, timeout=30, check=True).stdout
  except (OSError, subprocess.SubprocessError):
    return None, None
  return head, bool(status.strip())


def _version(package: str) -> str | None:
  try:
    return importlib.metadata.version(package)
  except importlib.metadata.PackageNotFoundError:
    return None


def record(*, devices: Sequence[Any] = (), num_workers: int | Sequence[int] | None = None,
           process_count: int | Sequence[int] | None = None,
           command_line: str | None = None) -> dict[str, Any]:
  """The provenance of results written now.

  Args:
    devices: the JAX devices the results were computed on (their platform and kinds are
      recorded); empty where the caller has none to name.
    num_workers: the data-parallel workers (devices of the mesh), or the counts a benchmark
      swept.
    process_count: the processes of the job, or the counts a benchmark swept.
    command_line: the command, if not :func:`command`.

  Returns:
    A JSON-ready dict: ``command``, ``commit``, ``dirty``, ``date`` (UTC, ISO 8601),
    ``python``, ``jax``, ``jaxlib``, ``os``, ``cpus``, ``device_platforms``, ``device_kinds``,
    ``process_count``, ``num_workers``.
  """
  commit, dirty = git_state()
  return {
      "command": command() if command_line is None else command_line,
      "commit": commit, "dirty": dirty,
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "python": platform.python_version(), "jax": _version("jax"), "jaxlib": _version("jaxlib"),
      "os": platform.platform(), "cpus": os.cpu_count(),
      "device_platforms": sorted({d.platform for d in devices}),
      "device_kinds": sorted({d.device_kind for d in devices}),
      "process_count": process_count, "num_workers": num_workers,
  }


def commit_text(rec: dict[str, Any]) -> str:
  """The commit of ``rec`` in words: the hash, noting uncommitted changes, or why there is
  none."""
  if rec["commit"] is None:
    return "unknown (not a git checkout, or git is missing)"
  return rec["commit"] + (" (with uncommitted changes)" if rec["dirty"] else "")


def describe(rec: dict[str, Any]) -> str:
  """Everything but the command and the commit of ``rec`` in one line, for Markdown headers and
  figure footers."""
  return f"{rec['date']}; {machine_text(rec)}"


def machine_text(rec: dict[str, Any]) -> str:
  """The software and the machine of ``rec`` without its date: the same for every run a sweep
  made on one machine, so a report names it once."""
  devices = ", ".join(rec["device_kinds"]) or "no devices named"
  return (f"Python {rec['python']}, JAX {rec['jax']}, jaxlib {rec['jaxlib']}; "
          f"{rec['os']}, {rec['cpus']} CPUs; devices: {devices}; processes: "
          f"{_count(rec['process_count'])}; workers: {_count(rec['num_workers'])}")


def _count(value) -> str:
  if value is None:
    return "-"
  if isinstance(value, (list, tuple)):
    return "/".join(str(v) for v in value)
  return str(value)
