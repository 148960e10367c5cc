"""ImageNet (ILSVRC-2012) from the standard folder layout, decoded with PIL.

Expected layout of ``config.data_dir``::

  train/<wnid>/*.JPEG     one folder per class (e.g. n01440764), the class index being the
  val/<wnid>/*.JPEG       position of <wnid> in the sorted list of train/ folders

Training images: Inception-style random-resized crop (area 8%-100%, aspect ratio 3/4-4/3, ten
tries, then a centre crop), bilinear resize to ``image_size``, random horizontal flip. Evaluation
images: resize of the shorter side to ``image_size / 0.875`` and a centre crop (224 from 256).
Both normalised with the ImageNet per-channel mean and std. Only the listing is global: a process
opens and decodes only the files of its own shards, on ``config.data.decode_threads`` threads.
The listing's names and sizes are hashed (``files_sha256``, in ``results.json`` and the
checkpoints: the data's identity; the contents are not read for it). An image that is not a
regular file (a FIFO, which would block the run) is refused.
"""

from concurrent import futures
import hashlib
import math
import os

import numpy as np
from PIL import Image

from experiments.data import pipeline

_EXTENSIONS = (".jpeg", ".jpg", ".png")
_MEAN = np.asarray((0.485, 0.456, 0.406), np.float32) * 255
_STD = np.asarray((0.229, 0.224, 0.225), np.float32) * 255
_LAYOUT = ("config.data_dir must hold train/<wnid>/*.JPEG and val/<wnid>/*.JPEG (one folder per "
           "class, the standard ImageNet layout)")


def imagenet(config, shards: pipeline.ShardSpec) -> pipeline.ShardedDataset:
  """ImageNet from ``config.data_dir``; see the module docstring for the layout.

  Options in ``config.data``: ``image_size`` (224), ``decode_threads`` (8).
  """
  data_dir = config.data_dir
  if not data_dir or not os.path.isdir(data_dir):
    raise FileNotFoundError(f"imagenet: config.data_dir={data_dir!r} is not a directory; {_LAYOUT}")
  size = config.data.get("image_size", 224)
  pipeline.check_positive("config.data.image_size", size)
  threads = config.data.get("decode_threads", 8)
  pipeline.check_positive("config.data.decode_threads", threads)
  classes = _class_folders(os.path.join(data_dir, "train"))
  files = hashlib.sha256()
  train = _listing(data_dir, "train", classes, files)
  test = _listing(data_dir, "val", classes, files)
  pool = futures.ThreadPoolExecutor(threads)

  def decode_all(paths, decode, rng):
    seeds = rng.integers(0, 2**63, size=len(paths))
    images = pool.map(decode, paths, seeds)
    return (np.stack(list(images)).astype(np.float32) - _MEAN) / _STD

  def train_transform(rows, rng):
    decode = lambda path, seed: _train_image(path, size, np.random.default_rng(seed))
    return {"input": decode_all(rows["path"], decode, rng), "label": rows["label"]}

  def eval_transform(rows, rng):
    decode = lambda path, seed: _eval_image(path, size)
    return {"input": decode_all(rows["path"], decode, rng), "label": rows["label"]}

  return pipeline.classification(config, shards, train, test, num_classes=len(classes),
                                 train_transform=train_transform, eval_transform=eval_transform,
                                 info={"files_sha256": files.hexdigest()})


def _class_folders(train_dir):
  if not os.path.isdir(train_dir):
    raise FileNotFoundError(f"imagenet: {train_dir} does not exist; {_LAYOUT}")
  classes = sorted(d for d in os.listdir(train_dir) if os.path.isdir(os.path.join(train_dir, d)))
  if not classes:
    raise FileNotFoundError(f"imagenet: {train_dir} has no class folders; {_LAYOUT}")
  return classes


def _listing(data_dir, split, classes, digest):
  """The images of ``split`` and their labels; their names and sizes update ``digest``."""
  root = os.path.join(data_dir, split)
  if not os.path.isdir(root):
    raise FileNotFoundError(f"imagenet: {root} does not exist; {_LAYOUT}")
  unknown = sorted(set(os.listdir(root)) - set(classes))
  if unknown:
    raise ValueError(f"imagenet: {root} has class folders absent from train/: {unknown[:5]}; "
                     f"{_LAYOUT}")
  paths, labels = [], []
  for label, wnid in enumerate(classes):
    folder = os.path.join(root, wnid)
    if os.path.isdir(folder):
      files = sorted(f for f in os.listdir(folder) if f.lower().endswith(_EXTENSIONS))
      for name in files:
        path = os.path.join(folder, name)
        size = pipeline.check_regular_file("imagenet", path).st_size
        digest.update(f"{split}/{wnid}/{name}\0{size}\0".encode())
        paths.append(path)
      labels += [label] * len(files)
  if not paths:
    raise FileNotFoundError(f"imagenet: no images (*.JPEG) under {root}; {_LAYOUT}")
  return {"path": np.asarray(paths), "label": np.asarray(labels, np.int32)}


def _open(path):
  with Image.open(path) as image:
    return image.convert("RGB")


def random_resized_crop_box(width: int, height: int, rng: np.random.Generator,
                            scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)) -> tuple[int, int, int, int]:
  """Inception-style crop box ``(left, top, right, bottom)`` (Szegedy et al. 2015; torchvision's
  RandomResizedCrop): area fraction uniform in ``scale``, log-uniform aspect ratio in ``ratio``,
  ten tries, then the largest centred crop within ``ratio``."""
  area = width * height
  for _ in range(10):
    target = area * rng.uniform(*scale)
    aspect = math.exp(rng.uniform(math.log(ratio[0]), math.log(ratio[1])))
    w = int(round(math.sqrt(target * aspect)))
    h = int(round(math.sqrt(target / aspect)))
    if 0 < w <= width and 0 < h <= height:
      left = int(rng.integers(0, width - w + 1))
      top = int(rng.integers(0, height - h + 1))
      return left, top, left + w, top + h
  aspect = width / height
  if aspect < ratio[0]:
    w, h = width, int(round(width / ratio[0]))
  elif aspect > ratio[1]:
    w, h = int(round(height * ratio[1])), height
  else:
    w, h = width, height
  left, top = (width - w) // 2, (height - h) // 2
  return left, top, left + w, top + h


def _train_image(path, size, rng):
  image = _open(path)
  box = random_resized_crop_box(*image.size, rng)
  image = image.resize((size, size), Image.BILINEAR, box=box)
  if rng.random() < 0.5:
    image = image.transpose(Image.FLIP_LEFT_RIGHT)
  return np.asarray(image)


def _eval_image(path, size):
  image = _open(path)
  short = int(size / 0.875)
  w, h = image.size
  scale = short / min(w, h)
  image = image.resize((max(short, round(w * scale)), max(short, round(h * scale))),
                       Image.BILINEAR)
  w, h = image.size
  left, top = (w - size) // 2, (h - size) // 2
  return np.asarray(image.crop((left, top, left + size, top + size)))
