"""CIFAR-100, ResNet-56 (0.86M parameters), 8 devices.

  python -m experiments.run --config=configs/cifar100_resnet56.py:method=tasc \
      --config.data_dir=/data/cifar-100-python --workdir=runs/c100_r56_tasc

160 epochs of Nesterov SGD (lr 0.1, batch 128, weight decay 1e-4, lr / 10 at 50% and 75%).
Expected: about 71-72% test accuracy dense (commonly reported for ResNet-56). Runtime: about two
hours on one modern GPU. Arguments: ``method=<name>``, ``smoke``.
"""

from configs import cifar


def get_config(arg=None):
  return cifar.config(arg, dataset="cifar100", model=dict(name="cifar_resnet", depth=56),
                      smoke_model=dict(name="cifar_resnet", depth=8, width=4), epochs=160,
                      weight_decay=1e-4, schedule="step")
