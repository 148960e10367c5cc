"""VGG for 32x32 images (Simonyan & Zisserman 2015), with batch norm after every convolution.

The CIFAR variant common in the literature (and in TASC's VGG-19 experiments): the 13/16
convolutions of configurations D/E, 2x2 max-pooling after each block, and a single linear
classifier on the 512 features left at 1x1. VGG-16 has 14,728,266 parameters, VGG-19 20,040,522
(10 classes). Batch norm is per device, as in :mod:`experiments.models.resnet`.
"""

import flax.linen as nn

from experiments.models import fields
from experiments.models import resnet

_LAYOUTS = {
    11: (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"),
    13: (64, 64, "M", 128, 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"),
    16: (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"),
    19: (64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M",
         512, 512, 512, 512, "M"),
}


class VGG(nn.Module):
  """VGG-11/13/16/19 with batch norm.

  Attributes:
    num_classes: number of output logits.
    depth: one of 11, 13, 16, 19.
    width_divisor: divides every layer's width (1 for the paper's model; larger for tiny tests;
      at most 64, the narrowest layer's width, which it would leave with no channel).
  """
  num_classes: int
  depth: int = fields.choice(19, _LAYOUTS)
  width_divisor: int = fields.integer(1, maximum=64)

  @nn.compact
  def __call__(self, x, train: bool = False):
    for layer in _LAYOUTS[self.depth]:
      if layer == "M":
        x = nn.max_pool(x, (2, 2), strides=(2, 2))
      else:
        x = resnet.Conv(layer // self.width_divisor, (3, 3), padding=1, use_bias=True)(x)
        x = nn.relu(resnet.batch_norm(train)(x))
    x = x.reshape(x.shape[0], -1)
    return nn.Dense(self.num_classes)(x)
