"""Residual networks: CIFAR ResNets, Wide ResNets and the ImageNet ResNet family.

- :class:`CifarResNet`: He et al. (2016), "Deep Residual Learning for Image Recognition", Sec. 4.2:
  three stages of ``n`` basic blocks with 16/32/64 channels, depth ``6n + 2``, parameter-free
  shortcuts (option A: stride-2 subsampling and zero-padded channels). ResNet-20 has 269,722
  parameters and ResNet-56 853,018.
- :class:`WideResNet`: Zagoruyko & Komodakis (2016), "Wide Residual Networks": pre-activation
  blocks, widths 16k/32k/64k, depth ``6n + 4``, 1x1 projection shortcuts where the shape changes.
  WRN-28-10 has 36.5M parameters and WRN-16-8 11.0M.
- :class:`ImageNetResNet`: He et al. (2016) with bottlenecks for depth >= 50, stride on the 3x3
  convolution (the "v1.5" of MLPerf and torchvision), the last batch-norm scale of every block
  initialised to zero (Goyal et al. 2017). ResNet-50 has 25,557,032 parameters.

Normalisation: batch norm over each device's own batch (no cross-device axis). The running
statistics are kept per device by the trainer and averaged over devices only when read for
evaluation or checkpointing, which equals averaging them every step because the running average is
linear; the training step therefore communicates gradients only.
"""

import functools
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from compressors import checks
from experiments.models import fields

_conv_init = nn.initializers.variance_scaling(2.0, "fan_out", "normal")
Conv = functools.partial(nn.Conv, use_bias=False, kernel_init=_conv_init)


def batch_norm(train: bool, zero_init: bool = False) -> nn.BatchNorm:
  """Per-device batch norm (momentum 0.9, eps 1e-5); zero_init starts the scale at 0."""
  return nn.BatchNorm(use_running_average=not train, momentum=0.9, epsilon=1e-5,
                      scale_init=nn.initializers.zeros if zero_init else nn.initializers.ones)


def _depth(default: int, offset: int) -> Any:
  """A depth field allowing ``6n + offset`` with n >= 1 (three stages of n two-layer blocks)."""
  return fields.declare(default, rule=checks.Rule(int, low=6 + offset, condition=(
      lambda d: (d - offset) % 6 == 0,
      f"6n + {offset} with n >= 1 ({', '.join(str(6 * n + offset) for n in (1, 2, 3, 4, 5))}, "
      "...)")))


class _BasicBlock(nn.Module):
  """3x3-3x3 basic block; where the shape changes, the shortcut is option A (stride-2 subsampling
  and zero-padded channels, no parameters) or a 1x1 projection with batch norm."""
  channels: int
  stride: int
  projection: bool
  zero_init_last: bool = False

  @nn.compact
  def __call__(self, x, train: bool):
    y = Conv(self.channels, (3, 3), strides=self.stride, padding=1)(x)
    y = nn.relu(batch_norm(train)(y))
    y = Conv(self.channels, (3, 3), padding=1)(y)
    y = batch_norm(train, zero_init=self.zero_init_last)(y)
    if self.stride != 1 or x.shape[-1] != self.channels:
      if self.projection:
        x = batch_norm(train)(Conv(self.channels, (1, 1), strides=self.stride)(x))
      else:
        x = x[:, ::self.stride, ::self.stride, :]
        extra = self.channels - x.shape[-1]
        x = jnp.pad(x, ((0, 0), (0, 0), (0, 0), (extra // 2, extra - extra // 2)))
    return nn.relu(x + y)


class CifarResNet(nn.Module):
  """ResNet-(6n+2) for 32x32 images.

  Attributes:
    num_classes: number of output logits.
    depth: 6n + 2 (20, 32, 44, 56, 110, ...).
    width: channels of the first stage (16 in the paper); later stages double it.
  """
  num_classes: int
  depth: int = _depth(20, 2)
  width: int = fields.integer(16)

  @nn.compact
  def __call__(self, x, train: bool = False):
    blocks = (self.depth - 2) // 6
    x = Conv(self.width, (3, 3), padding=1)(x)
    x = nn.relu(batch_norm(train)(x))
    for stage in range(3):
      for block in range(blocks):
        stride = 2 if stage > 0 and block == 0 else 1
        x = _BasicBlock(self.width * 2**stage, stride, projection=False)(x, train)
    x = jnp.mean(x, axis=(1, 2))
    return nn.Dense(self.num_classes)(x)


class _WideBlock(nn.Module):
  """Pre-activation 3x3-3x3 block with optional dropout between the convolutions."""
  channels: int
  stride: int
  dropout: float

  @nn.compact
  def __call__(self, x, train: bool):
    out = nn.relu(batch_norm(train)(x))
    shortcut = x
    if self.stride != 1 or x.shape[-1] != self.channels:
      shortcut = Conv(self.channels, (1, 1), strides=self.stride)(out)
    y = Conv(self.channels, (3, 3), strides=self.stride, padding=1)(out)
    y = nn.relu(batch_norm(train)(y))
    if self.dropout:
      y = nn.Dropout(self.dropout, deterministic=not train)(y)
    y = Conv(self.channels, (3, 3), padding=1)(y)
    return shortcut + y


class WideResNet(nn.Module):
  """WRN-depth-k for 32x32 images.

  Attributes:
    num_classes: number of output logits.
    depth: 6n + 4 (16, 22, 28, 40).
    widen_factor: k; stage widths are 16k, 32k, 64k.
    dropout: dropout rate inside each block (0.3 in the paper's best CIFAR runs; 0 by default).
  """
  num_classes: int
  depth: int = _depth(28, 4)
  widen_factor: int = fields.integer(10)
  dropout: float = fields.rate(0.0)

  @nn.compact
  def __call__(self, x, train: bool = False):
    blocks = (self.depth - 4) // 6
    x = Conv(16, (3, 3), padding=1)(x)
    for stage in range(3):
      for block in range(blocks):
        stride = 2 if stage > 0 and block == 0 else 1
        x = _WideBlock(16 * 2**stage * self.widen_factor, stride, self.dropout)(x, train)
    x = nn.relu(batch_norm(train)(x))
    x = jnp.mean(x, axis=(1, 2))
    return nn.Dense(self.num_classes)(x)


class _Bottleneck(nn.Module):
  channels: int
  stride: int

  @nn.compact
  def __call__(self, x, train: bool):
    y = nn.relu(batch_norm(train)(Conv(self.channels, (1, 1))(x)))
    y = Conv(self.channels, (3, 3), strides=self.stride, padding=1)(y)
    y = nn.relu(batch_norm(train)(y))
    y = batch_norm(train, zero_init=True)(Conv(4 * self.channels, (1, 1))(y))
    if self.stride != 1 or x.shape[-1] != 4 * self.channels:
      x = batch_norm(train)(Conv(4 * self.channels, (1, 1), strides=self.stride)(x))
    return nn.relu(x + y)


_IMAGENET_STAGES = {18: (2, 2, 2, 2), 34: (3, 4, 6, 3), 50: (3, 4, 6, 3), 101: (3, 4, 23, 3),
                    152: (3, 8, 36, 3)}


class ImageNetResNet(nn.Module):
  """ResNet-18/34/50/101/152 for 224x224 images.

  Attributes:
    num_classes: number of output logits.
    depth: one of 18, 34, 50, 101, 152.
    width: channels of the stem and first stage (64 in the paper).
  """
  num_classes: int
  depth: int = fields.choice(50, _IMAGENET_STAGES)
  width: int = fields.integer(64)

  @nn.compact
  def __call__(self, x, train: bool = False):
    x = Conv(self.width, (7, 7), strides=2, padding=3)(x)
    x = nn.relu(batch_norm(train)(x))
    x = nn.max_pool(x, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)))
    for stage, blocks in enumerate(_IMAGENET_STAGES[self.depth]):
      for i in range(blocks):
        channels, stride = self.width * 2**stage, 2 if stage > 0 and i == 0 else 1
        if self.depth >= 50:
          x = _Bottleneck(channels, stride)(x, train)
        else:
          x = _BasicBlock(channels, stride, projection=True, zero_init_last=True)(x, train)
    x = jnp.mean(x, axis=(1, 2))
    return nn.Dense(self.num_classes, kernel_init=nn.initializers.normal(0.01))(x)

