"""CIFAR-100, Wide ResNet-28-10 (36.5M parameters), 8 devices.

  python -m experiments.run --config=configs/cifar100_wrn.py:method=tasc \
      --config.data_dir=/data/cifar-100-python --workdir=runs/c100_wrn_tasc

200 epochs of Nesterov SGD (lr 0.1, batch 128, weight decay 5e-4, cosine decay).
Expected: about 80-81% test accuracy dense (the paper reports 81.2% with dropout).
Runtime: several hours on one modern GPU. Arguments: ``method=<name>``, ``smoke``.
"""

from configs import cifar


def get_config(arg=None):
  return cifar.config(arg, dataset="cifar100",
                      model=dict(name="wide_resnet", depth=28, widen_factor=10),
                      smoke_model=dict(name="wide_resnet", depth=10, widen_factor=1),
                      epochs=200, weight_decay=5e-4, schedule="cosine")
