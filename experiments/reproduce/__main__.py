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
* ``f4``: loss curves, Hessian-aware vs magnitude block selection (T1's runs);
* ``t1_lm``: validation loss at equal total bytes (30x-1000x below dense over the whole run),
  every family (per-step compression before or after the optimizer, local updates, DeMo), each
  row's rate tuned over the same three values on training loss, a decoder-only language model on
  the Python standard library's source, ``--tier=cpu|gpu``;
* ``f4_lm``: what makes a block of DiLoCo's pseudo-gradient worth sending: TASC's block scores,
  block sizes and supports at 1000x, beside top-k (same runs folder as ``t1_lm``);
* ``f5``: time to dense's loss: T1-LM's validation loss against measured compute plus modelled
  communication time on 1 and 10 Gbit/s clusters of 8 and 32 workers;
* ``f6_lm``, ``f7_lm``: the frontier and the horizon of the CPU tier (retention from 2x to
  1000x, and at longer runs);
* ``a1_lm``: workers that are slow, late or gone: each aggregator (sync, quorum, async, naive
  async, eager; naive delayed with the workers alike) for DiLoCo int8 and Streaming DiLoCo at
  100x under speed spreads and drop-outs.
* ``s1_lm``: the scaling grid: retention at 100x fewer bytes against model size, token budget
  and per-worker batch, with the laws fitted to it (``s1_lm_fits.csv``), ``--tier=cpu|gpu``.
* ``r1``: recommendation models: DLRM's embedding tables placed across 8 devices (replicated,
  table, row, column, the planner's), their all-to-alls compressed (bf16, int8, int4 with and
  without error feedback, top-k), hot rows replicated; AUC, bytes per collective, the modelled
  step on 8 to 512 devices.

Each target runs what it needs (finished runs are skipped, unfinished ones resume; run
directories under ``--workdir``, default ``runs/paper``) and then regenerates its ``NAME.md``,
``.csv`` and ``.png`` in ``paper_figures/`` from the run directories alone, and the index
``paper_figures/README.md``. Settings live in ``configs/paper/`` (quick by default, ``--full``);
each target is a module of this package (:mod:`experiments.reproduce.t1` and the others named
above), the runs' machinery is :mod:`experiments.reproduce.common` and the outputs'
:mod:`experiments.reproduce.report`.
Bad input (a ``--data_dir`` without CIFAR-10, ...) is one line on stderr without a traceback
(``--verbose`` or ``TASC_JAX_VERBOSE=1`` shows it), exit status 1, before anything runs or is
written; so is ``--report_only`` where ``--workdir`` holds no runs of a target (a mistyped
``--workdir`` would otherwise rewrite the published pages as empty tables). A target that ran
nothing (``t1_cifar10`` without ``--data_dir``, ``f3`` without root) leaves its page as it was,
with a warning; where it has none yet, it writes one that says why.
Training runs go ``--jobs`` at a time (default 2), each in a process of its own; how long the
targets took is in ``README.md``'s Results. ``--tier=gpu`` (25M+ parameters, 8 and 32
simulated workers per GPU) needs a GPU, and is refused where JAX finds none, as
``python -m experiments.bench --platform=gpu`` is.
"""

import dataclasses
import logging
import os
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import ml_collections

from experiments import cli
from experiments import distributed
from experiments import provenance
from experiments.bench import common as bench_common
from experiments.reproduce import a1_lm
from experiments.reproduce import common
from experiments.reproduce import f1
from experiments.reproduce import f2
from experiments.reproduce import f3
from experiments.reproduce import f4
from experiments.reproduce import f4_lm
from experiments.reproduce import f5
from experiments.reproduce import f6_lm
from experiments.reproduce import f7_lm
from experiments.reproduce import r1
from experiments.reproduce import report as report_lib
from experiments.reproduce import s1_lm
from experiments.reproduce import t1
from experiments.reproduce import t1_cifar10
from experiments.reproduce import t1_lm
from experiments.reproduce import t2

NUM_DEVICES = 8
LOG = logging.getLogger("reproduce")
INDEX = "README.md"


@dataclasses.dataclass(frozen=True)
class Target:
  """One table or figure.

  Attributes:
    name: the output's file stem and the ``--target`` name.
    title: one line for the index.
    produce: ``(options) -> Report``: runs what is missing (unless ``report_only``) and builds
      the report from the run directories.
    run_folders: ``(options) -> folders``: where the run directories its report is built from
      are (``report_only`` needs a run in one of them).
  """
  name: str
  title: str
  produce: Callable[[common.Options], report_lib.Report]
  run_folders: Callable[[common.Options], Sequence[str]]

  def has_runs(self, options: common.Options) -> bool:
    """Whether a run directory its report is built from exists under ``options.workdir``."""
    return any(report_lib.holds_runs(folder) for folder in self.run_folders(options))


# The order of ``all``: cheap targets first; F4 after T1, whose runs it plots; F5 after T1-LM.
TARGETS = {t.name: t for t in (
    Target(name, module.TITLE, module.produce, module.run_folders) for name, module in (
        ("f2", f2), ("t1", t1), ("f4", f4), ("t1_cifar10", t1_cifar10), ("t2", t2), ("f1", f1),
        ("f3", f3), ("t1_lm", t1_lm), ("f4_lm", f4_lm), ("f5", f5), ("f6_lm", f6_lm),
        ("f7_lm", f7_lm), ("s1_lm", s1_lm), ("a1_lm", a1_lm), ("r1", r1)))}


# The folder of paper_figures that keeps the GPU tier's run directories (their config.json,
# metrics.jsonl, results.json and logs), copied from the GPU machine.
GPU_RUNS = "gpu_runs"
# The same for the CPU tier's frontier and horizon (F6-LM, F7-LM), whose grid spans sessions.
CPU_RUNS = "cpu_runs"
# The targets whose size --tier sets.
LM_TARGETS = ("t1_lm", "f4_lm", "f5", "s1_lm")
# The language-model targets of the CPU tier's model alone (their grids do not fit a GPU's loan).
CPU_TIER_TARGETS = ("f6_lm", "f7_lm", "a1_lm")
# The published claims each target answers, for the index (its page has the claims in full).
ANSWERS = {
    "f2": "TASC: 11x (2 x 8 GPUs) and 2.6x (1 x 8) communication speed-up over a dense ring",
    "t1": "TASC: 130x at 93.27% vs SparCML's 92.57%; DGC: 270-600x without loss; PowerSGD rank 2",
    "f4": "Hessian-aware block selection trains better than magnitude selection",
    "t1_cifar10": "T1's claims, on CIFAR-10 ResNet-20",
    "t2": "LAMB / LARS keep accuracy at large batch; tuned momentum / Adam match them",
    "f1": "top-k's all-gather grows with the workers; a shared support's all-reduce does not",
    "f3": "the alpha-beta model predicts a ring all-reduce; TASC's 11x / 2.6x speed-ups",
    "t1_lm": "TASC beats magnitude top-k at equal bytes (its 130x claim); DGC 270-600x without "
             "loss, language models included",
    "f4_lm": "Hessian-aware block scores beat magnitude (TASC; HAWQ-v2)",
    "f5": "compression pays on slow links, much less on fast ones (Agarwal et al. 2022)",
    "f6_lm": "the project's goal: ≥ 95% of communication's benefit kept at ≥ 100x fewer bytes",
    "s1_lm": "retention at 100x grows with scale (Charles et al. 2025: DiLoCo's gap to data "
             "parallel shrinks from +3.9% at 35M to +1.1% at 2.4B)",
    "f7_lm": "local-update methods need long runs (Charles et al. 2025: DiLoCo within 4% of "
             "data parallel at 20 tokens per parameter)",
    "a1_lm": "Async Local-SGD's Delayed Nesterov near sync, naive async worse (Liu et al. 2024); "
             "eager updates near no overlap, naive delay far above (Kale et al. 2025); a quorum "
             "keeps more useful throughput under failures (Decoupled DiLoCo)",
    "r1": "4-bit all-to-alls without loss (Meta); hot rows take 85-88% off the all-to-all "
          "(FlexShard, HET); embedding communication 25% -> 51% of the step, 8 -> 128 GPUs "
          "(EMBark)",
}


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


def check_inputs(names: Sequence[str], options: common.Options) -> None:
  """Refuses, before anything runs or is written, what would rewrite published pages from nothing
  or train where it cannot.

  Args:
    names: the targets (:func:`resolve_targets`).
    options: the command line's options.

  Raises:
    ValueError: with ``report_only``, targets whose run folders under ``workdir`` hold no run (a
      mistyped ``--workdir`` would rewrite their pages as empty tables), naming each; for
      ``t1_cifar10``, a ``--data_dir`` that does not hold CIFAR-10; for a language-model target
      that would train at ``--tier=gpu``, a machine where JAX finds no GPU (the check of
      ``python -m experiments.bench --platform=gpu``).
  """
  if options.report_only:
    empty = [name for name in names if not TARGETS[name].has_runs(options)]
    if empty:
      where = ", ".join(f"{name} (in {' or '.join(TARGETS[name].run_folders(options))})"
                        for name in empty)
      have = [name for name in names if name not in empty]
      raise ValueError(f"--report_only: --workdir={options.workdir!r} holds no runs of {where}; "
                       "nothing was written: pass the --workdir that holds them, or leave those "
                       "targets out of --target"
                       + (f" (it holds runs of {', '.join(have)})" if have else ""))
  cpu_only = [n for n in names if n in CPU_TIER_TARGETS]
  if options.tier != "cpu" and cpu_only:
    raise ValueError(f"--tier={options.tier}: {', '.join(cpu_only)} have the CPU tier's model "
                     "only; allowed: --tier=cpu (which a GPU runs too), or leave them out of "
                     "--target")
  if "t1_cifar10" in names and options.data_dir and not t1_cifar10.available(options.data_dir):
    raise ValueError(f"t1_cifar10: {t1_cifar10.unavailable(options.data_dir)}")
  if (options.tier == "gpu" and not options.report_only and any(n in LM_TARGETS for n in names)
      and bench_common.resolve_platform("auto") != "gpu"):
    raise ValueError("--tier=gpu: JAX finds no GPU here; allowed here: --tier=cpu, or --tier=gpu "
                     "--report_only (which trains nothing)")


def write_index(out: str, prov: report_lib.Provenance) -> Path:
  """``out/README.md``: every target, its files (where written) and its one-line title."""
  lines = ["# Paper figures", "",
           "Tables and figures of the paper, reproduced at laptop scale by "
           "`python -m experiments.reproduce --target=all` (quick settings; `--full` for full "
           "ones; the language-model targets at `--tier=cpu`, or `--tier=gpu` on a GPU), each "
           "beside the published claims it answers. Every number traces to a run "
           "directory listed in its table (`config.json`, `metrics.jsonl`, `results.json`).",
           "", f"Last written by `{prov.command}` at commit `{prov.commit}` "
           f"({provenance.describe(prov.record)}).", "",
           "| target | what | published claim it answers | files |", "|---|---|---|---|"]
  for name, target in TARGETS.items():
    pages = ([common.page_name(name, tier) for tier in common.LM_TIERS] if name in LM_TARGETS
             else [name])
    files = [f"[{page}{ext}]({page}{ext})" for page in pages for ext in (".md", ".csv", ".png")
             if os.path.exists(os.path.join(out, page + ext))]
    lines.append(f"| `{name}` | {target.title} | {ANSWERS.get(name, '-')} | "
                 f"{' '.join(files) or 'not written yet'} |")
  lines += ["", "Regenerate one target from existing runs without running anything: "
            "`python -m experiments.reproduce --target=t1 --report_only`. The GPU tier's run "
            f"directories are kept here, in `{GPU_RUNS}/` (a GPU is seldom at hand to run them "
            "again): `python -m experiments.reproduce --target=t1_lm,f5 --tier=gpu --report_only "
            f"--workdir={provenance.PAPER_FIGURES}/{GPU_RUNS}` regenerates its pages. The CPU "
            "tier's frontier and horizon (F6-LM, F7-LM: more runs than one sitting of 2 cores "
            f"trains) keep theirs in `{CPU_RUNS}/` the same way: `python -m experiments.reproduce "
            f"--target=f6_lm,f7_lm --report_only --workdir={provenance.PAPER_FIGURES}/{CPU_RUNS}` "
            f"regenerates their pages, and copying `{CPU_RUNS}/lm_cpu/*` into "
            "`runs/paper/lm_cpu/` lets the grid go on from them (a finished run is not run "
            f"again). R1's runs are there too (`{CPU_RUNS}/r1/`): `python -m "
            f"experiments.reproduce --target=r1 --report_only --workdir={provenance.PAPER_FIGURES}"
            f"/{CPU_RUNS}` regenerates its page.", ""]
  path = Path(out, INDEX)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text("\n".join(lines))
  return path


def parse_args(argv: Sequence[str] | None = None) -> tuple[list[str], common.Options]:
  """The targets and options of a command line (``--help`` lists them).

  Raises:
    ValueError: an argument that is not allowed (:class:`experiments.cli.ArgumentParser`: one
      line and exit status 1 from :func:`main`).
  """
  parser = cli.ArgumentParser(prog="python -m experiments.reproduce",
                                   description=__doc__.split("\n\n", 1)[0])
  parser.add_argument("--target", required=True, help=f"all, or of: {', '.join(TARGETS)}")
  parser.add_argument("--workdir", default=common.Options.workdir,
                      help="root of the run directories")
  parser.add_argument("--out", default=common.Options.out, help="folder of the outputs")
  parser.add_argument("--full", action="store_true", help="full settings instead of quick")
  parser.add_argument("--data_dir", default="", help="CIFAR-10 python batches, for t1_cifar10")
  parser.add_argument("--seeds", type=int, default=common.Options.seeds, help="seeds of T1 and F4")
  parser.add_argument("--jobs", type=int, default=common.Options.jobs,
                      help="training runs at once, each in its own process (1: in this one)")
  parser.add_argument("--tier", default=common.Options.tier, choices=common.LM_TIERS,
                      help="size of the language-model targets (t1_lm, f4_lm, f5)")
  parser.add_argument("--report_only", action="store_true",
                      help="regenerate outputs from existing run directories; run nothing")
  parser.add_argument(cli.VERBOSE_FLAG, action="store_true", help=cli.VERBOSE_HELP)
  args = parser.parse_args(argv)
  try:
    names = resolve_targets(args.target)
  except ValueError as e:
    parser.error(str(e))
  if args.seeds < 1:
    parser.error(f"--seeds={args.seeds}; allowed: >= 1")
  if args.jobs < 1:
    parser.error(f"--jobs={args.jobs}; allowed: >= 1")
  return names, common.Options(workdir=args.workdir, out=args.out, full=args.full,
                               data_dir=args.data_dir, report_only=args.report_only,
                               seeds=args.seeds, jobs=args.jobs, tier=args.tier)


def main(argv: Sequence[str] | None = None) -> list[Path]:
  """Runs and reports the targets named on the command line; returns the files written."""
  argv = sys.argv[1:] if argv is None else list(argv)
  with cli.errors_in_one_line("experiments.reproduce", show_traceback=cli.verbose(argv)):
    names, options = parse_args(argv)
    check_inputs(names, options)
  # The training runs need NUM_DEVICES simulated CPU devices, set before JAX's first computation.
  distributed.expose_cpu_devices(_device_config())
  # The language-model runs compile the same evaluation and dense-bytes programs, and each seed
  # of a row the same training step: a persistent cache shared by the child processes saves
  # about 15 of a run's 25 s of compiling on 2 CPU cores.
  os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                        os.path.abspath(os.path.join(options.workdir, "jax_cache")))
  jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
  logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
  logging.getLogger("reproduce").setLevel(logging.INFO)
  prov = report_lib.Provenance(
      provenance.record(devices=jax.devices(), num_workers=NUM_DEVICES, process_count=1,
                        command_line="python -m experiments.reproduce " + shlex.join(argv)),
      ("full" if options.full else "quick")
      + (f", {options.tier} tier" if any(n in LM_TARGETS for n in names) else ""))
  written = []
  with cli.errors_in_one_line("experiments.reproduce", show_traceback=cli.verbose(argv)):
    for name in names:
      start = time.monotonic()
      LOG.info("%s ...", name)
      report = TARGETS[name].produce(options)
      page = os.path.join(options.out, report.name + ".md")
      if not TARGETS[name].has_runs(options) and os.path.exists(page):
        # Skipped by design (no CIFAR-10 here, no root for F3) or every run failed to start: a
        # page of nothing would replace one written from runs, perhaps on another machine.
        LOG.warning("%s: no runs under --workdir=%s; %s is left as it was", name,
                    options.workdir, page)
        continue
      written += report_lib.write_report(report, prov, options.out)
      written.append(write_index(options.out, prov))
      LOG.info("%s done in %.0f s", name, time.monotonic() - start)
  return written


def _device_config():
  return ml_collections.ConfigDict({
      "num_devices": NUM_DEVICES,
      "distributed": {"coordinator_address": None, "num_processes": None, "process_id": None}})


if __name__ == "__main__":
  main()
