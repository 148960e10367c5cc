"""CIFAR-10 and CIFAR-100 from the standard python-pickle batches (Krizhevsky 2009).

Expected layout of ``config.data_dir`` (or of its ``cifar-10-batches-py`` / ``cifar-100-python``
sub-folder, as unpacked from the official archives):

  CIFAR-10:  data_batch_1 .. data_batch_5, test_batch   (each a pickled dict with b'data' uint8
             [N, 3072] in channel-major order and b'labels' [N])
  CIFAR-100: train, test                                (b'data' and b'fine_labels')

Training images get the standard augmentation (4-pixel zero padding, random 32x32 crop, random
horizontal flip); every image is normalised with the dataset's per-channel mean and std. The
files' names, sizes and contents are hashed (``files_sha256``, in ``results.json`` and the
checkpoints): the data's identity.
"""

import hashlib
import os
import pickle

import numpy as np

from experiments.data import pipeline

_LAYOUTS = {
    "cifar10": dict(folder="cifar-10-batches-py", num_classes=10, label_key=b"labels",
                    train=[f"data_batch_{i}" for i in range(1, 6)], test=["test_batch"],
                    mean=(0.4914, 0.4822, 0.4465), std=(0.2470, 0.2435, 0.2616)),
    "cifar100": dict(folder="cifar-100-python", num_classes=100, label_key=b"fine_labels",
                     train=["train"], test=["test"],
                     mean=(0.5071, 0.4865, 0.4409), std=(0.2673, 0.2564, 0.2762)),
}


def cifar10(config, shards: pipeline.ShardSpec) -> pipeline.ShardedDataset:
  """CIFAR-10 from ``config.data_dir``; see the module docstring for the layout."""
  return _cifar("cifar10", config, shards)


def cifar100(config, shards: pipeline.ShardSpec) -> pipeline.ShardedDataset:
  """CIFAR-100 (fine labels) from ``config.data_dir``; see the module docstring for the layout."""
  return _cifar("cifar100", config, shards)


def _cifar(name, config, shards):
  layout = _LAYOUTS[name]
  folder = _find_folder(name, config.data_dir, layout)
  files = hashlib.sha256()
  train = _read(folder, layout["train"], layout["label_key"], name, files)
  test = _read(folder, layout["test"], layout["label_key"], name, files)
  for split in (train, test):
    if split["label"].min() < 0 or split["label"].max() >= layout["num_classes"]:
      raise ValueError(f"{name}: labels in {folder} must lie in [0, {layout['num_classes']}), "
                       f"found [{split['label'].min()}, {split['label'].max()}]")
  mean = np.asarray(layout["mean"], np.float32) * 255
  std = np.asarray(layout["std"], np.float32) * 255
  augment = config.data.get("augment", True)

  def normalise(rows, rng):
    del rng
    return {"input": (rows["input"].astype(np.float32) - mean) / std, "label": rows["label"]}

  def augment_and_normalise(rows, rng):
    if augment:
      rows = dict(rows, input=random_crop_flip(rows["input"], rng, padding=4))
    return normalise(rows, rng)

  return pipeline.classification(config, shards, train, test, num_classes=layout["num_classes"],
                                 train_transform=augment_and_normalise, eval_transform=normalise,
                                 info={"files_sha256": files.hexdigest()})


def random_crop_flip(images: np.ndarray, rng: np.random.Generator, padding: int) -> np.ndarray:
  """Zero-pads ``[n, h, w, c]`` images by ``padding``, crops back at random offsets, and flips
  each image horizontally with probability 1/2."""
  n, h, w, _ = images.shape
  padded = np.pad(images, ((0, 0), (padding, padding), (padding, padding), (0, 0)))
  dy, dx = rng.integers(0, 2 * padding + 1, size=(2, n))
  flip = rng.random(n) < 0.5
  out = np.empty_like(images)
  for i in range(n):
    crop = padded[i, dy[i]:dy[i] + h, dx[i]:dx[i] + w]
    out[i] = crop[:, ::-1] if flip[i] else crop
  return out


def _expected(name, layout):
  files = ", ".join(layout["train"] + layout["test"])
  return (f"config.data_dir must hold the {name} python-pickle files ({files}), directly or in "
          f"a '{layout['folder']}' sub-folder, as unpacked from the official archive")


def _find_folder(name, data_dir, layout):
  if not data_dir:
    raise ValueError(f"{name}: config.data_dir is not set; {_expected(name, layout)}")
  for folder in (data_dir, os.path.join(data_dir, layout["folder"])):
    if all(os.path.isfile(os.path.join(folder, f)) for f in layout["train"] + layout["test"]):
      return folder
  if not os.path.isdir(data_dir):
    raise FileNotFoundError(f"{name}: config.data_dir={data_dir!r} does not exist; "
                            f"{_expected(name, layout)}")
  raise FileNotFoundError(f"{name}: config.data_dir={data_dir!r} lacks files; "
                          f"{_expected(name, layout)}")


def _read(folder, files, label_key, name, digest):
  """The images and labels of ``files``, whose names, sizes and contents update ``digest``."""
  images, labels = [], []
  for file in files:
    path = os.path.join(folder, file)
    with open(path, "rb") as f:
      content = f.read()
    digest.update(f"{file}\0{len(content)}\0".encode())
    digest.update(content)
    try:
      batch = pickle.loads(content, encoding="bytes")
    except (pickle.UnpicklingError, EOFError, ValueError) as e:
      raise ValueError(f"{name}: {path} is not a python pickle of a CIFAR batch ({e})") from None
    if not isinstance(batch, dict) or b"data" not in batch or label_key not in batch:
      keys = sorted(batch) if isinstance(batch, dict) else type(batch).__name__
      raise ValueError(f"{name}: {path} must be a dict with keys b'data' and {label_key!r}; "
                       f"found {keys}")
    data = np.asarray(batch[b"data"], np.uint8)
    if data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or len(batch[label_key]) != len(data):
      raise ValueError(f"{name}: {path} b'data' must be uint8 [N, 3072] with N labels; found "
                       f"shape {data.shape} and {len(batch[label_key])} labels")
    images.append(data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))
    labels.append(np.asarray(batch[label_key], np.int32))
  return {"input": np.concatenate(images), "label": np.concatenate(labels)}
