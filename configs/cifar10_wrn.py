"""CIFAR-10, Wide ResNet-28-10 (Zagoruyko & Komodakis 2016, 36.5M parameters), 8 devices.

  python -m experiments.run --config=configs/cifar10_wrn.py:method=tasc \
      --config.data_dir=/data/cifar10 --workdir=runs/wrn_tasc

200 epochs of Nesterov SGD (lr 0.1, batch 128, weight decay 5e-4, cosine decay).
Expected: about 96% test accuracy dense (the paper reports 96.0% with dropout); TASC claims 93.27%
for a Wide ResNet at 130x compression (unverified). ``--config.model.depth=16 --config.model.widen_factor=8``
gives WRN-16-8 (11.0M). Runtime: several hours on one modern GPU; impractical on CPU.
Arguments: ``method=<name>``, ``smoke``.
"""

from configs import cifar


def get_config(arg=None):
  return cifar.config(arg, dataset="cifar10",
                      model=dict(name="wide_resnet", depth=28, widen_factor=10),
                      smoke_model=dict(name="wide_resnet", depth=10, widen_factor=1),
                      epochs=200, weight_decay=5e-4, schedule="cosine")
