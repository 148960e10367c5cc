"""CIFAR-100, VGG-19 with batch norm, 8 devices.

  python -m experiments.run --config=configs/cifar100_vgg19.py:method=tasc \
      --config.data_dir=/data/cifar-100-python --workdir=runs/c100_vgg19_tasc

160 epochs of Nesterov SGD (lr 0.05, batch 128, weight decay 5e-4, lr / 10 at 50% and 75%).
Expected: about 72-73% test accuracy dense. Runtime: about two hours on one modern GPU.
Arguments: ``method=<name>``, ``smoke``.
"""

from configs import cifar


def get_config(arg=None):
  return cifar.config(arg, dataset="cifar100", model=dict(name="vgg", depth=19),
                      smoke_model=dict(name="vgg", depth=11, width_divisor=16), epochs=160,
                      weight_decay=5e-4, schedule="step", lr=0.05)
