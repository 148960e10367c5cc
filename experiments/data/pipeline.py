"""Deterministic, sharded host input pipeline over in-memory rows.

The global batch of step ``t`` is the concatenation of one per-device batch for every data shard
``s = 0 .. num_shards - 1`` (one shard per device of the mesh, in mesh order). Shard ``s`` owns the
rows ``s, s + num_shards, s + 2 num_shards, ...`` of the dataset; its batch at step ``t`` depends
only on ``(seed, s, t)``. A process therefore loads and serves only the shards of its own devices,
and the global batch is the same whatever the number of processes, which is what lets a 2-process
run reproduce a 1-process run bit for bit, and a restarted run continue exactly where it stopped
(the step is the whole data position).
"""

from collections.abc import Callable, Iterator, Mapping, Sequence
import dataclasses
import os
import stat
from typing import Any

import numpy as np

Rows = dict[str, np.ndarray]
Transform = Callable[[Rows, np.random.Generator], Rows]


@dataclasses.dataclass(frozen=True)
class ShardSpec:
  """Which data shards this process serves.

  Attributes:
    num_shards: shards in the whole job (the global number of devices).
    shard_ids: this process's shards, in the order of its devices in the mesh.
  """
  num_shards: int
  shard_ids: tuple[int, ...]

  def __post_init__(self):
    if self.num_shards < 1 or not self.shard_ids or not all(
        0 <= s < self.num_shards for s in self.shard_ids):
      raise ValueError(f"ShardSpec: shard_ids={self.shard_ids} must be non-empty and within "
                       f"[0, {self.num_shards})")


def split_rows(arrays: Mapping[str, np.ndarray], shards: ShardSpec) -> list[Rows]:
  """This process's shards of ``arrays`` (strided: shard ``s`` keeps rows ``s::num_shards``)."""
  return [{k: v[s::shards.num_shards] for k, v in arrays.items()} for s in shards.shard_ids]


def _identity(rows: Rows, rng: np.random.Generator) -> Rows:
  del rng
  return rows


class ShardedDataset:
  """Per-device batches of training and evaluation rows.

  Attributes:
    task: a key of :data:`experiments.tasks.TASKS` (``"classification"``, ``"masked_lm"``,
      ``"causal_lm"``); decides the loss.
    model_fields: model fields the data decides (``num_classes`` or ``vocab_size``).
    num_train: global number of training rows.
    num_eval: global number of evaluation rows.
    batch_per_device: training rows per device per step.
    steps_per_epoch: steps until every shard has seen its rows once.
    info: what identifies the data beyond the config (corpus and tokenizer hashes), recorded in
      the run's ``results.json``; its ``*_sha256`` entries are the data's :attr:`identity`.
  """

  def __init__(self, *, task: str, model_fields: Mapping[str, int],
               train: Sequence[Rows], evaluation: Sequence[Rows], num_train: int, num_eval: int,
               shards: ShardSpec, batch_per_device: int, eval_batch_per_device: int, seed: int,
               train_transform: Transform = _identity, eval_transform: Transform = _identity,
               info: Mapping[str, Any] | None = None,
               derived_metrics: Callable[[dict[str, float]], dict[str, float]] | None = None):
    """Args:
      task: see the class attributes.
      model_fields: see the class attributes.
      train: one dict of rows per local shard (from :func:`split_rows`).
      evaluation: likewise for evaluation.
      num_train: global number of training rows (all shards).
      num_eval: global number of evaluation rows.
      shards: this process's shards.
      batch_per_device: training rows per device per step.
      eval_batch_per_device: evaluation rows per device per batch.
      seed: seeds shuffling and ``train_transform``.
      train_transform: rows -> model inputs for training (augmentation, masking); gets a
        generator determined by ``(seed, shard, step)``.
      eval_transform: rows -> model inputs for evaluation; gets a generator fixed per shard and
        batch, so evaluation is deterministic.
      info: see the class attributes.
      derived_metrics: evaluation metrics (``test_loss``, ...) -> more metrics derived from them
        (a language model's bits per byte); see :meth:`derive`.
    """
    self.task = task
    self.model_fields = dict(model_fields)
    self.num_train, self.num_eval = num_train, num_eval
    self.batch_per_device = batch_per_device
    self._shards, self._seed = shards, seed
    self._train, self._eval = list(train), list(evaluation)
    self._eval_batch = eval_batch_per_device
    self._train_transform, self._eval_transform = train_transform, eval_transform
    self.info = dict(info or {})
    self._derived_metrics = derived_metrics
    self._rows_per_shard = num_train // shards.num_shards
    self.steps_per_epoch = self._rows_per_shard // batch_per_device
    if self.steps_per_epoch < 1:
      raise ValueError(
          f"the training set has {num_train} rows, {self._rows_per_shard} per device over "
          f"{shards.num_shards} devices, fewer than the {batch_per_device} rows per device of one "
          "batch; lower config.batch_size or use more data")
    if num_eval < shards.num_shards:
      raise ValueError(f"the evaluation set has {num_eval} rows, fewer than the "
                       f"{shards.num_shards} devices; every device needs at least one")

  @property
  def identity(self) -> dict[str, str]:
    """The hashes that identify the data (the ``*_sha256`` entries of ``info``): checkpoints
    record them, and a run resumes only on data with the same ones."""
    return {k: v for k, v in self.info.items() if k.endswith("_sha256")}

  def train_batch(self, step: int) -> Rows:
    """The local part of step ``step``'s global batch: leaves ``[local_shards, batch, ...]``."""
    epoch, position = divmod(step, self.steps_per_epoch)
    per_shard = []
    for rows, shard in zip(self._train, self._shards.shard_ids):
      order = np.random.default_rng([self._seed, shard, epoch]).permutation(self._rows_per_shard)
      index = order[position * self.batch_per_device:(position + 1) * self.batch_per_device]
      rng = np.random.default_rng([self._seed, shard, step, 1])
      per_shard.append(self._train_transform({k: v[index] for k, v in rows.items()}, rng))
    return _stack(per_shard)

  def derive(self, metrics: dict[str, float]) -> dict[str, float]:
    """``metrics`` with what the dataset derives from them added (nothing by default)."""
    if self._derived_metrics is None:
      return metrics
    return {**metrics, **self._derived_metrics(metrics)}

  @property
  def num_eval_batches(self) -> int:
    """Evaluation batches; the same on every process."""
    per_shard = -(-self.num_eval // self._shards.num_shards)
    return -(-per_shard // self._eval_batch)

  def eval_batches(self) -> Iterator[Rows]:
    """Evaluation batches with leaves ``[local_shards, eval_batch, ...]`` and a ``mask`` (1 for
    real rows, 0 for padding), covering every evaluation row exactly once over all shards."""
    for b in range(self.num_eval_batches):
      per_shard = []
      for rows, shard in zip(self._eval, self._shards.shard_ids):
        size = len(next(iter(rows.values())))
        index = np.arange(b * self._eval_batch, (b + 1) * self._eval_batch)
        mask = index < size
        index = np.where(mask, index, 0)  # padding repeats row 0 and is masked out
        batch = self._eval_transform({k: v[index] for k, v in rows.items()},
                                     np.random.default_rng([self._seed, shard, b, 2]))
        batch["mask"] = mask.astype(np.float32)
        per_shard.append(batch)
      yield _stack(per_shard)


def _stack(per_shard: Sequence[Rows]) -> Rows:
  return {k: np.stack([rows[k] for rows in per_shard]) for k in per_shard[0]}


def classification(config, shards: ShardSpec, train: Rows, test: Rows, *, num_classes: int,
                   train_transform: Transform = _identity, eval_transform: Transform = _identity,
                   info: Mapping[str, Any] | None = None) -> ShardedDataset:
  """A classification dataset from whole ``{"input", "label"}`` arrays, keeping this process's
  shards; batch sizes come from ``config.batch_size`` and ``config.eval_batch_size`` (global);
  ``info`` as :class:`ShardedDataset` takes it."""
  return ShardedDataset(
      task="classification", model_fields={"num_classes": num_classes},
      train=split_rows(train, shards), evaluation=split_rows(test, shards),
      num_train=len(train["label"]), num_eval=len(test["label"]), shards=shards,
      batch_per_device=config.batch_size // shards.num_shards,
      eval_batch_per_device=config.eval_batch_size // shards.num_shards, seed=config.seed,
      train_transform=train_transform, eval_transform=eval_transform, info=info)


def check_regular_file(dataset: str, path: str) -> os.stat_result:
  """Refuses a data file that is not a regular file: reading a FIFO (or a socket, or a device)
  waits for a writer, or never ends, and the run would hang without a word.

  Returns:
    The file's ``os.stat`` (its size, for an identity of the files).

  Raises:
    ValueError: ``path`` is not a regular file (a link to one is).
  """
  status = os.stat(path)
  mode = status.st_mode
  if not stat.S_ISREG(mode):
    kind = next((k for test, k in ((stat.S_ISFIFO, "a FIFO (named pipe)"),
                                   (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"),
                                   (stat.S_ISBLK, "a device"), (stat.S_ISDIR, "a folder"))
                 if test(mode)), "not a regular file")
    raise ValueError(f"{dataset}: {path} (under config.data_dir) is {kind}; every data file "
                     "must be a regular file: move it out of config.data_dir")
  return status


def check_positive(name: str, value: Any) -> None:
  """A clear error for a config field that must be a positive int."""
  if not isinstance(value, int) or isinstance(value, bool) or value < 1:
    raise ValueError(f"{name}={value!r} must be a positive int")
