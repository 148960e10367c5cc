"""T2's BERT sweep: BERT-tiny masked LM on ``pydoc_data``, Adam vs LAMB at several batch sizes.

  python -m experiments.sweep --config=configs/paper/t2_bert.py --workdir=runs/paper/t2_bert
  python -m experiments.sweep --config=configs/paper/t2_bert.py:adam_lr=0.001,lamb_lr=0.01 \
      --workdir=runs/paper/t2_bert

Each run is ``configs/bert.py:tiny,pydoc=true`` (8 simulated devices, dense exchange) trained for
the same number of epochs; the peak learning rate is a base rate scaled by
``sqrt(batch / base_batch_size)`` (You et al. 2020), with a linear warm-up over the first
``warmup_fraction`` of training and linear decay. Settings (batch sizes, epochs, candidate base
rates) come from ``configs/paper/t2.py``.

Without a rate for an optimizer, the sweep holds its rate-selection runs: every candidate base
rate at the smallest batch size. With ``adam_lr=X`` / ``lamb_lr=Y`` (chosen base rates; the
selection runs stay in the sweep) it adds that optimizer at every batch size.
Arguments: ``full`` (as in ``configs/paper/t2.py``), ``adam_lr``, ``lamb_lr``.
"""

import math

import ml_collections

from configs import common
from configs.paper import t2

BERT_CONFIG = "configs/bert.py:tiny,pydoc=true"


def run_name(optimizer: str, batch_size: int, base_learning_rate: float) -> str:
  return f"{optimizer}_b{batch_size}_lr{base_learning_rate:g}"


def get_config(arg=None):
  args = common.parse_args(arg, full=False, adam_lr=0.0, lamb_lr=0.0)
  bert = t2.get_config("full=true" if args["full"] else None).bert
  chosen = {o: args[f"{o}_lr"] for o in bert.optimizers}
  for optimizer, lr in chosen.items():
    if lr and lr not in bert.learning_rates[optimizer]:
      raise ValueError(f"t2_bert: {optimizer}_lr={lr:g} is not a candidate; allowed: "
                       f"{list(bert.learning_rates[optimizer])} (configs/paper/t2.py)")
  smallest = min(bert.batch_sizes)
  runs = [(o, smallest, lr) for o in bert.optimizers for lr in bert.learning_rates[o]]
  runs += [(o, b, chosen[o]) for o in bert.optimizers if chosen[o]
           for b in bert.batch_sizes if b != smallest]
  c = ml_collections.ConfigDict()
  c.runs = []
  for optimizer, batch_size, base in runs:
    lr = base * math.sqrt(batch_size / bert.base_batch_size)
    c.runs.append({"name": run_name(optimizer, batch_size, base), "config": BERT_CONFIG,
                   "overrides": {
                       "batch_size": batch_size, "num_steps": 0,
                       "num_epochs": float(bert.epochs),
                       "optimizer": {"name": optimizer, "learning_rate": lr,
                                     "weight_decay": 0.01 if optimizer == "lamb" else 0.0},
                       "schedule": {"warmup_epochs": bert.warmup_fraction * bert.epochs},
                       "log_every": 10, "eval_every": 0, "checkpoint_every": 200}})
  c.overrides = {}
  return c
