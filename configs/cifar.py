"""Shared recipe of the CIFAR configs: SGD with momentum, batch 128, per-device batch norm, the
standard augmentation, and any gradient exchange (``method=``).

Config argument: ``method=<name>`` (default ``dense``; see ``configs/common.py``), ``smoke`` (two
steps of a tiny model, for tests). Data: ``--config.data_dir`` holding the python-pickle batches
(see ``experiments/data/cifar.py``).
"""

from configs import common

# Per-method settings that differ from the methods' defaults (config.compression.<method>).
_METHOD_SETTINGS = {
    "dgc": dict(density=0.001, clip_norm=5.0),
    "qsgd": dict(levels=16),
    "powersgd": dict(rank=2),
    "tasc": dict(density=0.005, block_size=256, hessian_every=200, num_probes=1),
}
# Settings of config.compression itself (shared by every method) that only the run of one method
# sets: DGC's density warm-up (Lin et al. 2018), 4 epochs of 390 steps, in the 4 stages of
# 25%, 6.3%, 1.6%, 0.4% density before its 0.1%.
_METHOD_COMMON = {
    "dgc": dict(density_warmup_steps=1560),
}


def config(arg, *, dataset, model, smoke_model, epochs, weight_decay, schedule, lr=0.1):
  """A CIFAR run config.

  Args:
    arg: the config argument (``method=...``, ``smoke``).
    dataset: ``"cifar10"`` or ``"cifar100"``.
    model: the model fields (``name`` and its settings).
    smoke_model: a tiny model of the same family for the ``smoke`` variant.
    epochs: training epochs.
    weight_decay: L2 coefficient.
    schedule: ``"step"`` (divide by 10 at 50% and 75%, He et al. 2016) or ``"cosine"``.
    lr: peak learning rate at batch 128.

  Returns:
    The ConfigDict.
  """
  args = common.parse_args(arg, method="dense", smoke=False)
  c = common.base()
  c.dataset = dataset
  c.model = model
  c.method = args["method"]
  for name, settings in _METHOD_SETTINGS.items():
    c.compression[name].update(settings)
  c.compression.update(_METHOD_COMMON.get(c.method, {}))
  c.optimizer.update(dict(name="nesterov", learning_rate=lr, momentum=0.9,
                          weight_decay=weight_decay))
  c.schedule.update(dict(name=schedule, warmup_epochs=0.0))
  c.batch_size = 128
  c.eval_batch_size = 1000
  c.num_epochs = float(epochs)
  c.log_every = 100
  c.eval_every = 3900  # about every 10 epochs
  c.checkpoint_every = 3900
  if args["smoke"]:
    common.make_smoke(c, batch_size=16)
    c.model = smoke_model
    # The tiny model has a few thousand parameters: enough blocks for TASC to send one.
    common.set_method_settings(c, density=0.05, block_size=64)
  return c
