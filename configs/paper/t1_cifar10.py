"""T1 on CIFAR-10 ResNet-20: the MNIST-1D table's methods on ``configs/cifar10_resnet20.py``.

  python -m experiments.reproduce --target=t1_cifar10 --data_dir=/data/cifar-10-batches-py

Only run when ``data_dir`` holds CIFAR-10 (nothing is downloaded). Each run is
``configs/cifar10_resnet20.py:method=<m>`` (Nesterov SGD, batch 128, 8 devices) with the row's
density / error feedback / sensitivity, and seed. Quick (default): 5 epochs per run (a smoke
check of the table on CPU, far from converged; runtime not measured here, roughly 30+ minutes per
run on 2 CPU cores); ``full``: the config's 160 epochs (about an hour per run on one GPU).
Arguments: ``full``, ``seeds=N`` (default 3).
"""

import ml_collections

from configs import common
from configs.paper import t1_mnist1d

CONFIG = "configs/cifar10_resnet20.py"
QUICK_EPOCHS = 5.0


def overrides(method: str, seed: int) -> dict:
  """Config overrides of the row ``method`` (a label of ``t1_mnist1d.rows()``) and ``seed``."""
  settings = t1_mnist1d.rows()[method]
  name = settings["method"]
  own = {field: settings[arg] for arg, field in (("density", "density"),
                                                 ("sensitivity", "sensitivity"),
                                                 ("wire", "wire_dtype")) if arg in settings}
  compression = {"seed": seed, name: own}
  if name == "dgc":  # configs/cifar.py warms DGC's density up; steady-state bytes, as in MNIST-1D
    compression["density_warmup_steps"] = 0
  if "ef" in settings:
    compression["error_feedback"] = settings["ef"]
  return {"seed": seed, "compression": compression}


def get_config(arg=None):
  args = common.parse_args(arg, full=False, seeds=3)
  c = ml_collections.ConfigDict()
  c.runs = []
  for seed in range(args["seeds"]):
    for method, settings in t1_mnist1d.rows().items():
      run = {"name": t1_mnist1d.run_name(method, seed),
             "config": f"{CONFIG}:method={settings['method']}",
             "overrides": overrides(method, seed)}
      if not args["full"]:
        run["overrides"]["num_epochs"] = QUICK_EPOCHS
      c.runs.append(run)
  c.overrides = {"data_dir": ""}
  return c
