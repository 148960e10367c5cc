"""Model registry: ``config.model.name`` plus keyword fields -> a flax linen module.

All models are flax linen modules called as ``model.apply(variables, *inputs, train=...)``.
Image classifiers take ``[batch, height, width, channels]`` (or ``[batch, length]`` for MNIST-1D)
and return logits; :class:`BertMLM` takes token ids, an attention mask and the masked positions;
:class:`DecoderLM` takes token ids and returns next-token logits at every position;
:class:`DLRM` takes dense features and one array of IDs per table and returns click logits.
Normalisation is per device (batch norm over the device's own batch, or layer norm); see
:mod:`experiments.models.resnet` for how the trainer keeps batch-norm statistics identical.
Each model declares what its fields allow next to them (:mod:`experiments.models.fields`), and
:func:`check_model` refuses what they do not before anything is built or traced.
"""

from collections.abc import Collection
from collections.abc import Mapping
import dataclasses
from typing import Any

import flax.linen as nn

from experiments.models import fields as fields_lib
from experiments.models.bert import BertMLM
from experiments.models.decoder import DecoderLM
from experiments.models.dlrm import DLRM
from experiments.models.resnet import CifarResNet
from experiments.models.resnet import ImageNetResNet
from experiments.models.resnet import WideResNet
from experiments.models.small import CNN1D
from experiments.models.small import CNN2D
from experiments.models.small import MLP
from experiments.models.vgg import VGG

MODELS = {
    "cnn1d": CNN1D,
    "mlp": MLP,
    "cnn2d": CNN2D,
    "cifar_resnet": CifarResNet,
    "wide_resnet": WideResNet,
    "vgg": VGG,
    "imagenet_resnet": ImageNetResNet,
    "bert": BertMLM,
    "decoder_lm": DecoderLM,
    "dlrm": DLRM,
}


def check_model(model_config: Mapping[str, Any], from_data: Collection[str] = ()) -> type:
  """Refuses a model config that cannot build a model, before anything is built or traced.

  Args:
    model_config: ``name`` plus the module's fields (e.g. ``{"name": "cifar_resnet",
      "depth": 20}``).
    from_data: the names of the fields the dataset decides (``num_classes`` or ``vocab_size``);
      they may not be set in ``model_config``.

  Returns:
    The module's class.

  Raises:
    ValueError: unknown model name, a field the module does not have or that the dataset sets,
      or a value the field does not allow (:func:`experiments.models.fields.check`).
  """
  fields = dict(model_config)
  name = fields.pop("name", None)
  if name not in MODELS:
    raise ValueError(f"config.model.name={name!r} is not a known model; available: "
                     f"{sorted(MODELS)}")
  cls = MODELS[name]
  allowed = {f.name for f in dataclasses.fields(cls)} - {"parent", "name"}
  for key in fields:
    if key in from_data:
      raise ValueError(f"config.model.{key} is set by the dataset for model {name!r}; remove it")
    if key not in allowed:
      raise ValueError(f"config.model.{key} is not a field of model {name!r}; its fields: "
                       f"{sorted(allowed - set(from_data))}")
  unknown = set(from_data) - allowed
  if unknown:
    raise ValueError(f"model {name!r} cannot take {sorted(unknown)} from the dataset; pick a model "
                     f"that fits the task (fields: {sorted(allowed)})")
  fields_lib.check(cls, name, fields)
  return cls


def build_model(model_config: Mapping[str, Any], **from_data: Any) -> nn.Module:
  """Builds the module named by ``model_config["name"]``, checked by :func:`check_model`.

  Args:
    model_config: ``name`` plus the module's fields.
    **from_data: fields the dataset decides (``num_classes`` or ``vocab_size``).

  Returns:
    The flax module.

  Raises:
    ValueError: what :func:`check_model` refuses.
  """
  cls = check_model(model_config, from_data)
  fields = {k: v for k, v in dict(model_config).items() if k != "name"}
  return cls(**fields, **from_data)
