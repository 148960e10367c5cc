"""Benchmarks: compression cost, training-step overhead, wire bytes against workers, real links.

  python -m experiments.bench compression   # B1: compress + decode / memory-bandwidth floor
  python -m experiments.bench step          # B2: training step with each method / dense
  python -m experiments.bench bytes         # B3: wire bytes per device, 2 to 256 workers
  python -m experiments.bench links         # B4: all-reduce over a 1 Gbit/s loopback
  python -m experiments.bench all --out benchmarks/results

Each writes ``<out>/<name>.json`` and ``<out>/<name>.md`` and prints its table last. Every
figure is a ratio of times measured in one process (or one multi-process run), so a noisy
machine still gives stable answers; where the project's goal for a figure is missed the table's
``goal`` column says so. Options narrow a run: ``--sizes 1m resnet50``, ``--methods dense tasc``,
``--workers 2 4 8``, ``--processes 2``, ``--repeats``, ``--timeout`` (per child process, seconds).
``--platform gpu`` (or ``auto``: the GPU where there is one) times B1 and B2 on the GPU, B2 with
8 workers simulated on the devices there are (``compressors.parallel.workers``); B3 compiles and B4 runs
on the CPU whatever the platform (bytes, and a loopback network). Results name the device and the
JAX version.
Bad input is one line on stderr, without a traceback (``--verbose`` or ``TASC_JAX_VERBOSE=1``
shows it), and exit status 1, before any benchmark runs (``all`` runs for hours): an argument
argparse refuses, a value one of the named benchmarks refuses, or an option that none of them
reads.
See the modules :mod:`experiments.bench.compression`, :mod:`~experiments.bench.step`,
:mod:`~experiments.bench.bytes` and :mod:`~experiments.bench.links` for what each measures.
"""

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from experiments import cli
from experiments.bench import bytes as bench_bytes
from experiments.bench import common
from experiments.bench import compression
from experiments.bench import links
from experiments.bench import step

BENCHMARKS = {
    "compression": compression,
    "step": step,
    "bytes": bench_bytes,
    "links": links,
}
# The options that only some benchmarks read (the others' apply to every one).
READ_BY = {"sizes": ("compression", "bytes", "links"), "models": ("step",),
           "workers": ("bytes",), "processes": ("links",)}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  """The command line's arguments, with every value the named benchmarks read checked.

  Raises:
    ValueError: an argument argparse refuses, a value a named benchmark refuses, or an option
      that none of them reads.
  """
  parser = cli.ArgumentParser(prog="python -m experiments.bench",
                              description=__doc__.split("\n\n", 1)[0])
  parser.add_argument("name", choices=[*BENCHMARKS, "all"])
  parser.add_argument("--out", type=Path, default=common.DEFAULT_OUT,
                      help="folder for <name>.json and <name>.md (default benchmarks/results)")
  parser.add_argument("--sizes", nargs="+",
                      help="gradient sizes: 1m, resnet50, bert_base, ints, or e.g. 25.6m "
                           "(compression, links); resnet50/bert_base or ints (bytes)")
  parser.add_argument("--methods", nargs="+", help="subset of the benchmark's methods")
  parser.add_argument("--models", nargs="+",
                      help="step: resnet20, bert_tiny; resnet50, bert_base (GPU-sized: the "
                           "default with --platform gpu)")
  parser.add_argument("--workers", type=int, nargs="+", help="bytes: worker counts")
  parser.add_argument("--processes", type=int, nargs="+", help="links: process counts")
  parser.add_argument("--rate", default="1gbit", help="links: loopback rate, or none")
  parser.add_argument("--platform", default="cpu", choices=common.PLATFORMS,
                      help="where B1 and B2 run: cpu (default), gpu, or auto (the GPU where "
                           "JAX finds one)")
  parser.add_argument("--repeats", type=int, default=15, help="most timed calls per figure")
  parser.add_argument("--timeout", type=float,
                      help="seconds per child process (default: the benchmark's own: 900 for "
                           "compression, 3600 for step, 1800 for bytes and links); slower "
                           "ones are marked skipped")
  parser.add_argument(cli.VERBOSE_FLAG, action="store_true", help=cli.VERBOSE_HELP)
  args = parser.parse_args(argv)
  if args.repeats < 1:
    parser.error(f"--repeats={args.repeats}; allowed: >= 1")
  if args.timeout is not None and not 0 < args.timeout < float("inf"):
    parser.error(f"--timeout={args.timeout}; allowed: a finite number > 0")
  _check_out(parser, args.out)
  names = _names(args)
  for option, readers in READ_BY.items():
    if getattr(args, option) is not None and not set(names) & set(readers):
      parser.error(f"--{option} is read by {', '.join(readers)}, not by {args.name}")
  for name in names:
    BENCHMARKS[name].check_args(args)
  return args


def _check_out(parser: argparse.ArgumentParser, out: Path) -> None:
  """Refuses an ``--out`` that cannot become a folder (it, or a path above it, is a file), or
  one that cannot be written, before any benchmark runs rather than after its rows print."""
  existing = next(p for p in (out, *out.parents) if p.exists() or p == p.parent)
  if not existing.is_dir():
    what = "" if existing == out else f" ({existing} is a file)"
    parser.error(f"--out={str(out)!r} is not a folder{what}; allowed: a folder, or a path "
                 "where one can be made, for <name>.json and <name>.md")
  if not os.access(existing, os.W_OK | os.X_OK):
    parser.error(f"--out={str(out)!r}: {existing} cannot be written; allowed: a folder this "
                 "user can write")


def _names(args: argparse.Namespace) -> list[str]:
  return list(BENCHMARKS) if args.name == "all" else [args.name]


def main(argv: Sequence[str] | None = None) -> list[Path]:
  """Runs the named benchmark(s); returns the files written."""
  with cli.errors_in_one_line("experiments.bench", show_traceback=cli.verbose(argv)):
    args = parse_args(argv)
  written = []
  for name in _names(args):
    with cli.errors_in_one_line("experiments.bench", show_traceback=cli.verbose(argv)):
      paths = BENCHMARKS[name].report(args).write(args.out)
    written += paths
    print(paths[1].read_text(), flush=True)
  print("wrote " + ", ".join(str(p) for p in written), file=sys.stderr)
  return written


if __name__ == "__main__":
  main()
