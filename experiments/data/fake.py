"""Writes small datasets in the standard on-disk formats (random content), to try the input
pipeline and the configs without the real data, and for the tests.

  python -m experiments.data.fake --format=cifar10 --out=/tmp/fake_cifar10

Formats: ``cifar10`` / ``cifar100`` (python-pickle batches), ``imagenet`` (``train/<wnid>`` and
``val/<wnid>`` folders of JPEGs), ``text`` (``.txt`` files).
"""

import os
import pickle

from absl import app
from absl import flags
import numpy as np
from PIL import Image

_WORDS = ("the gradient of every worker is compressed before it is summed and the error that "
          "was not sent is kept for the next step so nothing is lost while the network learns "
          "to classify images and to predict masked words from their context").split()


def write_cifar(directory: str, *, num_classes: int = 10, num_train: int = 50,
                num_test: int = 20, seed: int = 0) -> str:
  """CIFAR-10 (``data_batch_1..5``, ``test_batch``) or CIFAR-100 (``train``, ``test``) pickles.

  Returns:
    ``directory``.
  """
  rng = np.random.default_rng(seed)
  os.makedirs(directory, exist_ok=True)

  def batch(n, label_key):
    return {b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
            label_key: rng.integers(0, num_classes, n).tolist(), b"batch_label": b"fake"}

  if num_classes == 10:
    files = {f"data_batch_{i}": num_train // 5 + (i <= num_train % 5) for i in range(1, 6)}
    files["test_batch"] = num_test
    label_key = b"labels"
  else:
    files, label_key = {"train": num_train, "test": num_test}, b"fine_labels"
  for name, n in files.items():
    with open(os.path.join(directory, name), "wb") as f:
      pickle.dump(batch(n, label_key), f)
  return directory


def write_imagenet(directory: str, *, num_classes: int = 3, train_per_class: int = 6,
                   val_per_class: int = 3, size: tuple[int, int] = (48, 40),
                   seed: int = 0) -> str:
  """``train/<wnid>/*.JPEG`` and ``val/<wnid>/*.JPEG`` with random images of ``size`` (w, h)."""
  rng = np.random.default_rng(seed)
  for split, count in (("train", train_per_class), ("val", val_per_class)):
    for c in range(num_classes):
      folder = os.path.join(directory, split, f"n{c:08d}")
      os.makedirs(folder, exist_ok=True)
      for i in range(count):
        pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
        Image.fromarray(pixels).save(os.path.join(folder, f"n{c:08d}_{i}.JPEG"))
  return directory


def write_text(directory: str, *, num_files: int = 2, words_per_file: int = 3000,
               seed: int = 0) -> str:
  """``.txt`` files of random sentences over a small English vocabulary."""
  rng = np.random.default_rng(seed)
  os.makedirs(directory, exist_ok=True)
  for i in range(num_files):
    words = rng.choice(_WORDS, words_per_file)
    lines = [" ".join(words[j:j + 12]) + "." for j in range(0, words_per_file, 12)]
    with open(os.path.join(directory, f"part_{i}.txt"), "w", encoding="utf-8") as f:
      f.write("\n".join(lines) + "\n")
  return directory


def _define_flags() -> None:
  """Flags exist only when run as a script: tests import this module, and absl flags are global."""
  flags.DEFINE_enum("format", None, ["cifar10", "cifar100", "imagenet", "text"],
                    "Which format to write.", required=True)
  flags.DEFINE_string("out", None, "Output directory.", required=True)


def main(argv):
  del argv
  writers = {"cifar10": lambda d: write_cifar(d, num_classes=10, num_train=500, num_test=100),
             "cifar100": lambda d: write_cifar(d, num_classes=100, num_train=500, num_test=100),
             "imagenet": write_imagenet, "text": write_text}
  print(writers[flags.FLAGS.format](flags.FLAGS.out))


if __name__ == "__main__":
  _define_flags()
  app.run(main)
