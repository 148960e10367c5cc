"""Small models for the quick datasets: a 1-D CNN for MNIST-1D, an MLP, a 2-D CNN for 8x8 digits.

The 1-D CNN follows the convolutional baseline of Greydanus (2020), "Scaling down deep learning"
(MNIST-1D), which reaches about 94% test accuracy; it has no normalisation layers, so nothing but
the gradients needs communicating.
"""

from collections.abc import Sequence
import math

import flax.linen as nn
import jax.numpy as jnp

from experiments.models import fields

_POOLS = {"flatten": lambda x: x.reshape(x.shape[0], -1),
          "mean": lambda x: jnp.mean(x, axis=1),
          "max": lambda x: jnp.max(x, axis=1)}


class CNN1D(nn.Module):
  """Strided 1-D convolutions with ReLU, a pooling of the positions, and a linear classifier.

  Attributes:
    num_classes: number of output logits.
    channels: output channels of each convolution.
    kernel_size: width of every convolution kernel.
    stride: stride of every convolution.
    pool: how positions are combined before the classifier: ``"flatten"`` (Greydanus's CNN),
      ``"mean"`` or ``"max"`` (global pooling: invariant to MNIST-1D's random translations).
    hidden: width of the dense layer before the classifier (0 for none).
  """
  num_classes: int
  channels: Sequence[int] = fields.integers((32, 32, 32))
  kernel_size: int = fields.integer(5)
  stride: int = fields.integer(2)
  pool: str = fields.choice("flatten", _POOLS)
  hidden: int = fields.integer(0, minimum=0)

  @nn.compact
  def __call__(self, x, train: bool = False):
    del train
    if x.ndim == 2:  # [batch, length] -> one input channel
      x = x[..., None]
    for width in self.channels:
      x = nn.relu(nn.Conv(width, (self.kernel_size,), strides=(self.stride,),
                          padding="SAME")(x))
    x = _POOLS[self.pool](x)
    if self.hidden:
      x = nn.relu(nn.Dense(self.hidden)(x))
    return nn.Dense(self.num_classes)(x)


class MLP(nn.Module):
  """Fully connected ReLU network on flattened inputs.

  Attributes:
    num_classes: number of output logits.
    hidden: widths of the hidden layers.
  """
  num_classes: int
  hidden: Sequence[int] = fields.integers((256, 256))

  @nn.compact
  def __call__(self, x, train: bool = False):
    del train
    x = x.reshape(x.shape[0], -1)
    for width in self.hidden:
      x = nn.relu(nn.Dense(width)(x))
    return nn.Dense(self.num_classes)(x)


class CNN2D(nn.Module):
  """Two 3x3 convolutions with 2x2 max-pooling, then a dense classifier (for 8x8 digits).

  Attributes:
    num_classes: number of output logits.
    channels: output channels of each convolution.
    hidden: width of the dense layer before the classifier.
  """
  num_classes: int
  channels: Sequence[int] = fields.integers((32, 64))
  hidden: int = fields.integer(128)

  @nn.compact
  def __call__(self, x, train: bool = False):
    del train
    if x.ndim == 3:  # [batch, height, width] -> one input channel
      x = x[..., None]
    # Each convolution's 2x2 pooling halves the image: one too many leaves no pixel, and JAX's
    # error for that (a division by zero) names no field.
    pools = int(math.log2(min(x.shape[1:3])))
    if len(self.channels) > pools:
      raise ValueError(f"config.model.channels={tuple(self.channels)} is not allowed for model "
                       f"'cnn2d' on {x.shape[1]}x{x.shape[2]} images; allowed: at most {pools} "
                       "convolutions (each halves the image)")
    for width in self.channels:
      x = nn.relu(nn.Conv(width, (3, 3), padding="SAME")(x))
      x = nn.max_pool(x, (2, 2), strides=(2, 2))
    x = x.reshape(x.shape[0], -1)
    x = nn.relu(nn.Dense(self.hidden)(x))
    return nn.Dense(self.num_classes)(x)

