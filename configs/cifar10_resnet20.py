"""CIFAR-10, ResNet-20 (He et al. 2016, 0.27M parameters), 8 data-parallel devices.

  python -m experiments.run --config=configs/cifar10_resnet20.py:method=tasc \
      --config.data_dir=/data/cifar10 --workdir=runs/r20_tasc

160 epochs of Nesterov SGD (lr 0.1, batch 128, weight decay 1e-4, lr / 10 at 50% and 75%).
Expected: about 91.3% test accuracy dense (the paper reports 91.25%); compressed methods should
stay within about a point. Runtime: roughly an hour on one modern GPU; days on 2 CPU cores (not
measured there). Arguments: ``method=<name>``, ``smoke``.
"""

from configs import cifar


def get_config(arg=None):
  return cifar.config(arg, dataset="cifar10", model=dict(name="cifar_resnet", depth=20),
                      smoke_model=dict(name="cifar_resnet", depth=8, width=4), epochs=160,
                      weight_decay=1e-4, schedule="step")
