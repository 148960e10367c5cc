"""T2's BERT sweep: BERT-tiny masked LM on ``pydoc_data``, Adam vs LAMB at several batch sizes.

  python -m experiments.sweep --config=configs/paper/t2_bert.py --workdir=runs/paper/t2_bert

Each run is ``configs/bert.py:tiny,pydoc=true`` (8 simulated devices, dense exchange) trained for
the same number of epochs; the learning rate is scaled by ``sqrt(batch / base_batch_size)``
(You et al. 2020) with a linear warm-up over the first ``warmup_fraction`` of training and
linear decay. Settings (batch sizes, epochs, base rates) come from ``configs/paper/t2.py``.
Argument: ``full`` (as in ``configs/paper/t2.py``).
"""

import math

import ml_collections

from configs import common
from configs.paper import t2

BERT_CONFIG = "configs/bert.py:tiny,pydoc=true"


def run_name(optimizer: str, batch_size: int) -> str:
  return f"{optimizer}_b{batch_size}"


def get_config(arg=None):
  args = common.parse_args(arg, full=False)
  bert = t2.get_config("full=true" if args["full"] else None).bert
  c = ml_collections.ConfigDict()
  c.runs = []
  for optimizer in bert.optimizers:
    for batch_size in bert.batch_sizes:
      lr = bert.base_learning_rates[optimizer] * math.sqrt(batch_size / bert.base_batch_size)
      c.runs.append({"name": run_name(optimizer, batch_size), "config": BERT_CONFIG,
                     "overrides": {
                         "batch_size": batch_size, "num_steps": 0,
                         "num_epochs": float(bert.epochs),
                         "optimizer": {"name": optimizer, "learning_rate": lr,
                                       "weight_decay": 0.01 if optimizer == "lamb" else 0.0},
                         "schedule": {"warmup_epochs": bert.warmup_fraction * bert.epochs},
                         "log_every": 10, "eval_every": 0, "checkpoint_every": 200}})
  c.overrides = {}
  return c
