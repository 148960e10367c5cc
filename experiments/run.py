r"""Runs one experiment.

  python -m experiments.run --config=configs/quickstart.py --workdir=runs/quickstart
  python -m experiments.run --config=configs/cifar10_resnet20.py:method=tasc \
      --config.data_dir=/data/cifar10 --workdir=runs/r20_tasc

``--config`` names a config file and, after ``:``, its argument; ``--config.<field>=<value>``
overrides any field. ``--workdir`` receives ``metrics.jsonl``, ``config.json``, TensorBoard events,
checkpoints and ``results.json``; a run restarted with the same workdir resumes (a run killed at
any moment ends as if it had never stopped), and refuses a workdir another config wrote.

Every config field, with what it does and its default, is documented in ``configs/common.py``
(the experiment configs in ``configs/`` start from its ``base()``).

On CPU the runner makes the host platform expose ``config.num_devices / num_processes`` devices
before JAX's first computation (:func:`experiments.distributed.expose_cpu_devices`); on
accelerators the real devices are used, and workers the config asks for beyond them are simulated
on them (``config.workers_per_device`` asks for simulated workers anywhere).

Bad input (a config value, a data file, a busy workdir, ...) is one line on stderr, without a
traceback, and exit status 1; ``--verbose`` (or ``TASC_JAX_VERBOSE=1``) shows the traceback.

The last line printed is the summary: test accuracy and loss, steps (and how many were skipped
for a non-finite gradient), bytes per worker per step against dense. Exit status: 0; 1 on an
error, or when the run diverged (a final loss that is not finite, or more than
``config.max_skipped_fraction`` of its steps skipped; a line on stderr says which, and
``results.json`` records it), or when a training step did not complete within
``config.stall_timeout_seconds`` or the processes of a job did not join within
``config.distributed.join_timeout_seconds`` (a line on stderr names what was waited for:
:mod:`experiments.watchdog`); 130 (SIGINT, Ctrl-C) or 143 (SIGTERM) when a signal stopped it at
a step boundary, after a checkpoint, with ``interrupted at step N; resume with: <command>`` on
stderr (a second signal stops it at once; before the first step has completed, the first one
does).
"""

import os
import sys

from absl import app
from absl import flags
from absl import logging
import jax
from ml_collections import config_flags

from experiments import cli
from experiments import distributed
from experiments import interrupt
from experiments import logs
from experiments import methods
from experiments import train
from experiments import validation

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Experiment config file; --config.<field>=<value> overrides a field (fields: "
    "configs/common.py).", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for logs and checkpoints.",
                               required=True)
flags.mark_flags_as_required(["config"])


def main(argv):
  with cli.errors_in_one_line("experiments.run"):
    if len(argv) > 1:  # not absl's UsageError, which prints every flag's help before the error
      raise ValueError(f"unexpected arguments {argv[1:]}; every option is a flag (--config=..., "
                       "--config.<field>=<value>, --workdir=...)")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # orbax logs every file it writes at INFO
  config = _CONFIG.value
  try:
    with cli.errors_in_one_line("experiments.run"):
      methods.fill_equal_bytes(config)
      validation.check_workers(config)  # before JAX builds the devices, which may take minutes
      distributed.expose_cpu_devices(config)
      results = train.train_and_evaluate(config, _WORKDIR.value)
  except jax.errors.JaxRuntimeError:
    if jax.process_count() > 1:
      logging.error("process %d of %d: a collective with the other processes failed, most likely "
                    "because one of them died; this process stops too. Restart every process "
                    "with the same --workdir to resume from the last checkpoint.",
                    jax.process_index(), jax.process_count())
    raise
  except (interrupt.Interrupted, KeyboardInterrupt) as e:
    cli.exit_interrupted(e, is_main=distributed.process_settings(config)[2] == 0)
  if jax.process_index() == 0:
    print(logs.summary(results), flush=True)
  if results["diverged"]:
    if jax.process_index() == 0:
      print(f"experiments.run: the run diverged: {results['divergence']} (recorded in "
            f"{os.path.join(_WORKDIR.value, train.RESULTS_FILE)})", file=sys.stderr, flush=True)
    sys.exit(1)


if __name__ == "__main__":
  app.run(main, flags_parser=cli.flags_parser("experiments.run"))
