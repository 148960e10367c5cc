"""T2's MNIST-1D sweep: SGD (momentum), Adam, LARS and LAMB at growing batch sizes, an MLP.

  python -m experiments.sweep --config=configs/paper/t2_mnist1d.py \
      --workdir=runs/paper/t2_mnist1d

(or ``python -m experiments.reproduce --target=t2``, which also writes the table). One run of
``configs/paper/large_batch.py`` per seed, optimizer and batch size of ``configs/paper/t2.py``
(in that order); run ``<optimizer>_b<batch>_s<seed>`` works in ``workdir/<its name>``. Quick:
48 runs (``paper_figures/t2.md`` records how long they took).

Arguments: ``full`` (``configs/paper/t2.py``'s full settings), ``smoke`` (one seed of each
optimizer at the two smallest batch sizes, 2 steps each, for tests).
"""

import ml_collections

from configs import common
from configs.paper import t2

CONFIG = "configs/paper/large_batch.py"


def run_name(optimizer: str, batch_size: int, seed: int) -> str:
  """The run directory's name of ``optimizer`` at ``batch_size`` with ``seed``."""
  return f"{optimizer}_b{batch_size}_s{seed}"


def get_config(arg=None):
  args = common.parse_args(arg, full=False, smoke=False)
  settings = t2.get_config("full=true" if args["full"] else None).mnist1d
  seeds, batch_sizes = settings.seeds, settings.batch_sizes
  extra = ",full=true" if args["full"] else ""
  if args["smoke"]:
    seeds, batch_sizes, extra = 1, sorted(batch_sizes)[:2], extra + ",smoke"
  c = ml_collections.ConfigDict()
  c.runs = [{"name": run_name(o, b, seed),
             "config": f"{CONFIG}:optimizer={o},batch={b},seed={seed}{extra}"}
            for seed in range(seeds) for o in settings.optimizers for b in batch_sizes]
  c.overrides = {}
  return c
