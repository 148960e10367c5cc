"""One run of T2's large-batch study on MNIST-1D: an MLP, one optimizer, one batch size.

  python -m experiments.run --config=configs/paper/large_batch.py:optimizer=lars,batch=1024 \
      --workdir=runs/paper/t2_mnist1d/lars_b1024_s0

MNIST-1D (Greydanus 2020, generated offline by the ``mnist1d`` package) with ``num_samples``
examples in total (20,000 by default: 16,000 train / 4,000 test, the package's 80/20 split, so that
batch 4096 still takes a few steps per epoch) trains an MLP (two hidden layers of 128) for a fixed
number of epochs, so larger batches take fewer steps; the exchange is ``dense`` on 8 simulated
devices. Each optimizer's learning rate was tuned once at ``BASE_BATCH_SIZE`` and moves to other
batch sizes by its rule (:func:`optimizers.scale_learning_rate`): linear for SGD and LARS (Goyal
et al. 2017; You et al. 2017), square root for Adam and LAMB (You et al. 2020). Every run warms up
over the first ``WARMUP_FRACTION`` of its steps, then decays polynomially to 0
(``schedule.name = "warmup_poly"``): power 2 for LARS (MLPerf), power 1 for the others (the
LAMB/BERT recipe). A step whose gradient is not finite is not skipped: divergence at a large
batch is what the study looks for, and shows as a non-finite loss.

Epochs, sample count and batch sizes come from ``configs/paper/t2.py``; the sweep over them is
``configs/paper/t2_mnist1d.py``. Arguments: ``optimizer`` (``sgd``/``adam``/``lars``/``lamb``),
``batch`` (global batch size, a multiple of 8), ``seed``, ``full`` (``configs/paper/t2.py``'s
full settings), ``smoke`` (2 steps of a tiny MLP on 1,000 samples, for tests).
"""

from typing import NamedTuple

from configs import common
from configs.paper import t2
import optimizers

BASE_BATCH_SIZE = 128
WARMUP_FRACTION = 0.1
HIDDEN_WIDTHS = (128, 128)
SMOKE_SAMPLES = 1000


class Recipe(NamedTuple):
  """How one optimizer is run: its learning rate at ``BASE_BATCH_SIZE`` and how it scales.

  Attributes:
    base_learning_rate: the peak learning rate at ``BASE_BATCH_SIZE``.
    scaling_rule: ``"linear"`` or ``"sqrt"`` (:func:`optimizers.scale_learning_rate`).
    decay_power: the power of the polynomial decay after the warm-up.
    optimizer: ``config.optimizer``'s fields (:func:`experiments.methods.optimizer`).
    description: what the optimizer is, for the report.
  """
  base_learning_rate: float
  scaling_rule: str
  decay_power: float
  optimizer: dict
  description: str


# Base learning rates from a coarse sweep at batch 128, 30 epochs, seed 0 (test accuracy), taken
# with the study's former single-device loop (He-initialised MLP), since replaced by the runner:
#   sgd  0.05/0.1/0.2: 81.1/84.3/86.3      adam 2e-3/5e-3/1e-2: 78.7/82.5/84.4
#   lars 1/3/10:       74.0/84.5/88.8      lamb 1e-2/2e-2/5e-2: 86.1/85.9/53.0
# SGD, Adam and LARS were best at the grid's upper edge; they take the middle value (2-4 points
# below it at batch 128). LAMB takes its best, 1e-2. No rate was chosen by a large-batch result.
RECIPES = {
    "sgd": Recipe(0.1, "linear", 1.0, dict(name="momentum", momentum=0.9, weight_decay=0.0),
                  "optax.sgd, momentum 0.9"),
    "adam": Recipe(5e-3, "sqrt", 1.0, dict(name="adam", b1=0.9, b2=0.999, eps=1e-8),
                   "optax.adam, default betas"),
    "lars": Recipe(3.0, "linear", 2.0, dict(name="lars", momentum=0.9, weight_decay=1e-4,
                                            trust_coefficient=1e-3),
                   "optimizers.lars: paper denominator, eta 1e-3, wd 1e-4, momentum 0.9"),
    "lamb": Recipe(1e-2, "sqrt", 1.0, dict(name="lamb", b1=0.9, b2=0.999, eps=1e-6,
                                           weight_decay=0.01),
                   "optimizers.lamb: b 0.9/0.999, eps 1e-6, wd 0.01"),
}


def peak_learning_rate(optimizer: str, batch_size: int) -> float:
  """``optimizer``'s recipe rate, scaled from ``BASE_BATCH_SIZE`` to ``batch_size``."""
  recipe = RECIPES[optimizer]
  return optimizers.scale_learning_rate(recipe.base_learning_rate, batch_size,
                                        base_batch_size=BASE_BATCH_SIZE, rule=recipe.scaling_rule)


def get_config(arg=None):
  args = common.parse_args(arg, optimizer="sgd", batch=BASE_BATCH_SIZE, seed=0, full=False,
                           smoke=False)
  if args["optimizer"] not in RECIPES:
    raise ValueError(f"configs/paper/large_batch.py: optimizer={args['optimizer']!r}; allowed: "
                     f"{sorted(RECIPES)}")
  settings = t2.get_config("full=true" if args["full"] else None).mnist1d
  recipe = RECIPES[args["optimizer"]]
  c = common.base()
  c.dataset = "mnist1d"
  c.data = dict(num_samples=settings.num_samples)
  c.model = dict(name="mlp", hidden=HIDDEN_WIDTHS)
  c.method = "dense"
  c.optimizer.update(recipe.optimizer)
  c.optimizer.learning_rate = peak_learning_rate(args["optimizer"], args["batch"])
  c.schedule.update(dict(name="warmup_poly", warmup_epochs=WARMUP_FRACTION * settings.epochs,
                         power=recipe.decay_power))
  c.skip_nonfinite = False
  c.batch_size = args["batch"]
  c.eval_batch_size = 1000
  c.num_epochs = float(settings.epochs)
  c.log_every = 100
  c.eval_every = 0
  c.checkpoint_every = 0
  c.keep_checkpoints = 1
  c.seed = args["seed"]
  if args["smoke"]:
    common.make_smoke(c)
    c.data.num_samples = SMOKE_SAMPLES
    c.model.hidden = (16,)
  return c
