"""Runs one experiment.

  python -m experiments.run --config=configs/quickstart.py --workdir=runs/quickstart
  python -m experiments.run --config=configs/cifar10_resnet20.py:method=tasc \
      --config.data_dir=/data/cifar10 --workdir=runs/r20_tasc

``--config`` names a config file and, after ``:``, its argument; ``--config.<field>=<value>``
overrides any field. ``--workdir`` receives ``metrics.jsonl``, ``config.json``, TensorBoard events,
checkpoints and ``results.json``; a run restarted with the same workdir resumes (a run killed at
any moment ends as if it had never stopped), and refuses a workdir another config wrote.

On CPU the runner makes the host platform expose ``config.num_devices / num_processes`` devices
before JAX's first computation (:func:`experiments.distributed.expose_cpu_devices`); on
accelerators the real devices are used, and workers the config asks for beyond them are simulated
on them (``config.workers_per_device`` asks for simulated workers anywhere).
"""

from absl import app
from absl import flags
from absl import logging
import jax
from ml_collections import config_flags

from experiments import distributed
from experiments import logs
from experiments import train

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for logs and checkpoints.",
                               required=True)
flags.mark_flags_as_required(["config"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # orbax logs every file it writes at INFO
  config = _CONFIG.value
  distributed.expose_cpu_devices(config)
  try:
    results = train.train_and_evaluate(config, _WORKDIR.value)
  except jax.errors.JaxRuntimeError:
    if jax.process_count() > 1:
      logging.error("process %d of %d: a collective with the other processes failed, most likely "
                    "because one of them died; this process stops too. Restart every process "
                    "with the same --workdir to resume from the last checkpoint.",
                    jax.process_index(), jax.process_count())
    raise
  if jax.process_index() == 0:
    print(logs.summary(results), flush=True)


if __name__ == "__main__":
  app.run(main)
