"""Dataset registry: ``config.dataset`` -> a :class:`pipeline.ShardedDataset`.

A run downloads nothing. MNIST-1D is generated and the digits are bundled with scikit-learn;
CIFAR, ImageNet and text are read from ``config.data_dir`` in their standard formats (see each
module for the layout it expects); the language-modelling corpus ``stdlib_lm`` is this Python's
own standard library (:mod:`.stdlib`), or with ``config.data.corpus='pypi'`` the source of pinned
packages whose archives ``python -m experiments.data.pypi_corpus`` fetched beforehand
(:mod:`.pypi_corpus`). Click logs for recommendation models are generated (``synthetic_ctr``) or
read from Criteo's TSV (``criteo``, ``config.data.criteo_tsv``) (:mod:`.criteo`). Every process
loads only the rows of its own devices' shards.
"""

from experiments.data import builtin
from experiments.data import cifar
from experiments.data import criteo
from experiments.data import imagenet
from experiments.data import stdlib
from experiments.data import text
from experiments.data.pipeline import ShardSpec
from experiments.data.pipeline import ShardedDataset

DATASETS = {
    "mnist1d": builtin.mnist1d,
    "digits": builtin.digits,
    "cifar10": cifar.cifar10,
    "cifar100": cifar.cifar100,
    "imagenet": imagenet.imagenet,
    "text": text.text,
    "pydoc_text": text.pydoc_text,
    "stdlib_lm": stdlib.stdlib_lm,
    "synthetic_ctr": criteo.synthetic_ctr,
    "criteo": criteo.criteo,
}


def check_name(name: str) -> None:
  """A clear error for an unknown ``config.dataset``."""
  if name not in DATASETS:
    raise ValueError(f"config.dataset={name!r} is not a known dataset; available: "
                     f"{sorted(DATASETS)}")


def load(config, shards: ShardSpec) -> ShardedDataset:
  """Loads ``config.dataset`` for this process's ``shards``."""
  check_name(config.dataset)
  return DATASETS[config.dataset](config, shards)
