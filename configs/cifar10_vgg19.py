"""CIFAR-10, VGG-19 with batch norm (20.0M parameters), 8 devices.

  python -m experiments.run --config=configs/cifar10_vgg19.py:method=tasc \
      --config.data_dir=/data/cifar10 --workdir=runs/vgg19_tasc

160 epochs of Nesterov SGD (lr 0.05, batch 128, weight decay 5e-4, lr / 10 at 50% and 75%).
Expected: about 93.5% test accuracy dense. VGG-19 is TASC's communication benchmark (claimed
2.6x speed-up on 1 x 8 GPUs, 11x on 2 x 8; unverified). Runtime: about two hours on one modern
GPU; impractical on CPU. Arguments: ``method=<name>``, ``smoke``.
"""

from configs import cifar


def get_config(arg=None):
  return cifar.config(arg, dataset="cifar10", model=dict(name="vgg", depth=19),
                      smoke_model=dict(name="vgg", depth=11, width_divisor=16), epochs=160,
                      weight_decay=5e-4, schedule="step", lr=0.05)
