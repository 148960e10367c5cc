"""Reproduces the paper's tables and figures into ``paper_figures/``, beside the published claims.

  python -m experiments.reproduce --target=all              # quick settings, 2 CPU cores
  python -m experiments.reproduce --target=t1 --full        # full settings
  python -m experiments.reproduce --target=t1_cifar10 --data_dir=/data/cifar10
  python -m experiments.reproduce --target=t1 --report_only # tables from existing runs

Targets (``--target=NAME``, several comma-separated, or ``all``):

* ``t1``: accuracy against wire compression, every method, MNIST-1D, 8 workers, 3 seeds;
* ``t1_cifar10``: the same on CIFAR-10 ResNet-20 (only when ``--data_dir`` holds CIFAR-10);
* ``f1``: wire bytes per device from 2 to 256 workers, ResNet-50 and BERT-base (compile only);
* ``f2``: communication time from the cost model (VGG-19, ResNet-50 scaling, sparse all-reduce);
* ``f3``: communication time measured over a rate-limited loopback (needs root, ``ip netns``);
* ``t2``: large batch: SGD/Adam/LARS/LAMB on MNIST-1D, Adam/LAMB on BERT-tiny;
* ``f4``: loss curves, Hessian-aware vs magnitude block selection (T1's runs).

Each target runs what it needs (finished runs are skipped, unfinished ones resume; run
directories under ``--workdir``, default ``runs/paper``) and then regenerates
``paper_figures/NAME.md``, ``.csv`` and ``.png`` from the run directories alone, and the index
``paper_figures/README.md``. Settings live in ``configs/paper/`` (quick by default, ``--full``).
Training runs go ``--jobs`` at a time (default 2), each in a process of its own. ``--target=all``
took 89 minutes from scratch on 2 CPU cores (quick settings, 2 jobs; T1 70 min, T2 13, F1 4, F3 2).
"""

import argparse
import dataclasses
import logging
import os
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from experiments import distributed
from experiments import reproduce_report as report_lib

NUM_DEVICES = 8
LOG = logging.getLogger("reproduce")
INDEX = "README.md"


@dataclasses.dataclass(frozen=True)
class Options:
  """What the command line chose.

  Attributes:
    workdir: root of the run directories.
    out: folder of the outputs.
    full: full settings instead of quick.
    data_dir: CIFAR-10 folder for ``t1_cifar10`` ('' to skip it).
    report_only: regenerate outputs from existing runs, run nothing.
    seeds: seeds of T1 (and F4).
    jobs: training runs at once, each in a process of its own (1: one after another, in this
      process).
  """
  workdir: str = "runs/paper"
  out: str = "paper_figures"
  full: bool = False
  data_dir: str = ""
  report_only: bool = False
  seeds: int = 3
  jobs: int = 2

  def config_arg(self) -> str | None:
    return "full=true" if self.full else None


@dataclasses.dataclass(frozen=True)
class Target:
  """One table or figure.

  Attributes:
    name: the output's file stem and the ``--target`` name.
    title: one line for the index.
    produce: ``(options) -> Report``: runs what is missing (unless ``report_only``) and builds
      the report from the run directories.
  """
  name: str
  title: str
  produce: Callable[[Options], report_lib.Report]


# ----------------------------------------------------------------------------- targets


def _t1_workdir(options: Options) -> str:
  """T1's runs (F4 reads the same): full settings in their own folder, never mixed with quick."""
  return os.path.join(options.workdir, "t1_mnist1d_full" if options.full else "t1_mnist1d")


def _t1(options: Options) -> report_lib.Report:
  from configs.paper import t1_mnist1d  # pylint: disable=import-outside-toplevel
  from experiments import reproduce_training  # pylint: disable=import-outside-toplevel
  workdir = _t1_workdir(options)
  search_dir = os.path.join(options.workdir, "t1_tasc_search_full" if options.full
                            else "t1_tasc_search")
  if not options.report_only:
    arg = ",".join(filter(None, [options.config_arg(), f"seeds={options.seeds}"]))
    reproduce_training.run_sweep_config(t1_mnist1d.get_config(arg), workdir,
                                        jobs=options.jobs)
    reproduce_training.run_tasc_search(search_dir, seeds=options.seeds, full=options.full,
                                       jobs=options.jobs)
  return reproduce_training.t1_report(workdir, seeds=options.seeds, full=options.full,
                                      search_dir=search_dir)


def _f4(options: Options) -> report_lib.Report:
  from configs.paper import t1_mnist1d  # pylint: disable=import-outside-toplevel
  from experiments import reproduce_training  # pylint: disable=import-outside-toplevel
  workdir = _t1_workdir(options)
  if not options.report_only:
    arg = ",".join(filter(None, [options.config_arg(), f"seeds={options.seeds}", "subset=f4"]))
    reproduce_training.run_sweep_config(t1_mnist1d.get_config(arg), workdir, jobs=options.jobs)
  return reproduce_training.f4_report(workdir, seeds=options.seeds, full=options.full)


def _t1_cifar10(options: Options) -> report_lib.Report:
  from configs.paper import t1_cifar10  # pylint: disable=import-outside-toplevel
  from experiments import reproduce_training  # pylint: disable=import-outside-toplevel
  workdir = os.path.join(options.workdir, "t1_cifar10")
  available = reproduce_training.cifar10_available(options.data_dir)
  if available and not options.report_only:
    arg = ",".join(filter(None, [options.config_arg(), f"seeds={options.seeds}"]))
    sweep = t1_cifar10.get_config(arg)
    sweep.overrides.data_dir = options.data_dir
    reproduce_training.run_sweep_config(sweep, workdir, jobs=options.jobs)
  return reproduce_training.t1_cifar10_report(
      workdir, seeds=options.seeds, full=options.full,
      skipped=None if available else (
          f"--data_dir={options.data_dir!r} does not hold CIFAR-10's python batches "
          "(data_batch_1 ... test_batch); pass --data_dir=/path/to/cifar-10-batches-py"))


def _t2(options: Options) -> report_lib.Report:
  from configs.paper import t2  # pylint: disable=import-outside-toplevel
  from experiments import reproduce_training  # pylint: disable=import-outside-toplevel
  settings = t2.get_config(options.config_arg())
  mnist_dir, bert_dir = reproduce_training.t2_dirs(options.workdir, options.full)
  if not options.report_only:
    reproduce_training.run_t2_mnist1d(settings.mnist1d, mnist_dir)
    reproduce_training.run_t2_bert(settings.bert, bert_dir, full=options.full,
                                   jobs=options.jobs)
  return reproduce_training.t2_report(options.workdir, settings, full=options.full)


def _f1(options: Options) -> report_lib.Report:
  from configs.paper import f1  # pylint: disable=import-outside-toplevel
  from experiments import reproduce_comm  # pylint: disable=import-outside-toplevel
  settings = f1.get_config(options.config_arg())
  workdir = os.path.join(options.workdir, "f1")
  if not options.report_only:
    reproduce_comm.run_f1(settings, workdir)
  return reproduce_comm.f1_report(settings, workdir, full=options.full)


def _f2(options: Options) -> report_lib.Report:
  from configs.paper import f2  # pylint: disable=import-outside-toplevel
  from experiments import reproduce_comm  # pylint: disable=import-outside-toplevel
  settings = f2.get_config(options.config_arg())
  workdir = os.path.join(options.workdir, "f2")
  if not options.report_only:
    reproduce_comm.run_f2(settings, workdir)
  return reproduce_comm.f2_report(settings, workdir, full=options.full)


def _f3(options: Options) -> report_lib.Report:
  from configs.paper import f3  # pylint: disable=import-outside-toplevel
  from experiments import reproduce_comm  # pylint: disable=import-outside-toplevel
  settings = f3.get_config(options.config_arg())
  # Full settings time a larger gradient under the same run names: their own folder.
  workdir = os.path.join(options.workdir, "f3_full" if options.full else "f3")
  skipped = None
  if not options.report_only:
    skipped = reproduce_comm.run_f3(settings, workdir)
    if skipped:
      LOG.warning("f3: nothing measured: %s (needs root and `ip netns`); the report says so",
                  skipped)
  return reproduce_comm.f3_report(settings, workdir, full=options.full, skipped=skipped)


# The order of ``all``: cheap targets first; F4 after T1, whose runs it plots.
TARGETS = {t.name: t for t in (
    Target("f2", "F2: modelled communication time (VGG-19 speed-up, ResNet-50 scaling, sparse "
           "all-reduce)", _f2),
    Target("t1", "T1: accuracy vs wire compression, MNIST-1D, 8 workers, 3 seeds", _t1),
    Target("f4", "F4: Hessian-aware vs magnitude block selection, loss curves", _f4),
    Target("t1_cifar10", "T1 on CIFAR-10 ResNet-20 (needs --data_dir)", _t1_cifar10),
    Target("t2", "T2: large batch, SGD/Adam/LARS/LAMB (MNIST-1D) and Adam/LAMB (BERT-tiny)", _t2),
    Target("f1", "F1: wire bytes per device vs workers, 2 to 256 (compile only)", _f1),
    Target("f3", "F3: measured communication time over a rate-limited loopback", _f3),
)}


def resolve_targets(spec: str) -> list[str]:
  """Target names from ``--target``: one name, several comma-separated, or ``all`` (every
  target, in :data:`TARGETS` order). Names are case-insensitive; duplicates are dropped.

  Raises:
    ValueError: an empty or unknown name, naming the allowed ones.
  """
  names = [s.strip().lower() for s in str(spec).split(",")]
  if not all(names):
    raise ValueError(f"--target={spec!r} has an empty name; allowed: all, {', '.join(TARGETS)}")
  if "all" in names:
    return list(TARGETS)
  unknown = [n for n in names if n not in TARGETS]
  if unknown:
    raise ValueError(f"--target={spec!r}: unknown target {unknown[0]!r}; allowed: all, "
                     f"{', '.join(TARGETS)}")
  return list(dict.fromkeys(names))


def write_index(out: str, prov: report_lib.Provenance) -> Path:
  """``out/README.md``: every target, its files (where written) and its one-line title."""
  lines = ["# Paper figures", "",
           "Tables and figures of the paper, reproduced at laptop scale by "
           "`python -m experiments.reproduce --target=all` (quick settings; `--full` for full "
           "ones), each beside the published claims it answers. Every number traces to a run "
           "directory listed in its table (`config.json`, `metrics.jsonl`, `results.json`).",
           "", f"Last written by `{prov.command}` at commit `{prov.commit}` ({prov.date}).", "",
           "| target | what | files |", "|---|---|---|"]
  for name, target in TARGETS.items():
    files = [f"[{name}{ext}]({name}{ext})" for ext in (".md", ".csv", ".png")
             if os.path.exists(os.path.join(out, name + ext))]
    lines.append(f"| `{name}` | {target.title} | {' '.join(files) or 'not written yet'} |")
  lines += ["", "Regenerate one target from existing runs without running anything: "
            "`python -m experiments.reproduce --target=t1 --report_only`.", ""]
  path = Path(out, INDEX)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text("\n".join(lines))
  return path


def parse_args(argv: Sequence[str] | None = None) -> tuple[list[str], Options]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
  parser.add_argument("--target", required=True, help=f"all, or of: {', '.join(TARGETS)}")
  parser.add_argument("--workdir", default=Options.workdir, help="root of the run directories")
  parser.add_argument("--out", default=Options.out, help="folder of the outputs")
  parser.add_argument("--full", action="store_true", help="full settings instead of quick")
  parser.add_argument("--data_dir", default="", help="CIFAR-10 python batches, for t1_cifar10")
  parser.add_argument("--seeds", type=int, default=Options.seeds, help="seeds of T1 and F4")
  parser.add_argument("--jobs", type=int, default=Options.jobs,
                      help="training runs at once, each in its own process (1: in this one)")
  parser.add_argument("--report_only", action="store_true",
                      help="regenerate outputs from existing run directories; run nothing")
  args = parser.parse_args(argv)
  try:
    names = resolve_targets(args.target)
  except ValueError as e:
    parser.error(str(e))
  if args.seeds < 1:
    parser.error(f"--seeds={args.seeds}; allowed: >= 1")
  if args.jobs < 1:
    parser.error(f"--jobs={args.jobs}; allowed: >= 1")
  return names, Options(workdir=args.workdir, out=args.out, full=args.full,
                        data_dir=args.data_dir, report_only=args.report_only, seeds=args.seeds,
                        jobs=args.jobs)


def main(argv: Sequence[str] | None = None) -> list[Path]:
  """Runs and reports the targets named on the command line; returns the files written."""
  argv = sys.argv[1:] if argv is None else list(argv)
  names, options = parse_args(argv)
  # The training runs need NUM_DEVICES simulated CPU devices, which XLA reads when JAX starts.
  distributed.expose_cpu_devices(_device_config())
  logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
  logging.getLogger("reproduce").setLevel(logging.INFO)
  prov = report_lib.provenance("python -m experiments.reproduce " + shlex.join(argv),
                               "full" if options.full else "quick")
  written = []
  for name in names:
    start = time.monotonic()
    LOG.info("%s ...", name)
    report = TARGETS[name].produce(options)
    written += report_lib.write_report(report, prov, options.out)
    written.append(write_index(options.out, prov))
    LOG.info("%s done in %.0f s", name, time.monotonic() - start)
  return written


def _device_config():
  import ml_collections  # pylint: disable=import-outside-toplevel
  return ml_collections.ConfigDict({
      "num_devices": NUM_DEVICES,
      "distributed": {"coordinator_address": None, "num_processes": None, "process_id": None}})


if __name__ == "__main__":
  main()
