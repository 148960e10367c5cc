"""Checkpoints with orbax: the whole training state, saved atomically, restored to its shardings.

The state holds the parameters, every optimizer and compressor state (error-feedback residuals
and TASC's curvature average included, one per device), the per-device batch-norm statistics and
the step, which is also the data position (batches are a function of the step, see
:mod:`experiments.data.pipeline`). Orbax writes each step into a temporary directory and renames
it only once complete, and lists only finalised steps, so a half-written checkpoint is never
restored.

Checksums: once orbax has finalised step N, process 0 writes ``checkpoints/N/checksums.json``
(atomically) with the sha256 of every file of the step and the identity of the data the run
trains on (:attr:`experiments.data.pipeline.ShardedDataset.identity`). A checkpoint is restored
only if every file still has its recorded sha256, so a file damaged in place (same size, so orbax
reads it) is caught as surely as one cut short. A checkpoint without ``checksums.json`` was cut
short between the two writes, unless it is older than the first checkpoint the workdir wrote
with checksums (``workdir/checksums_since.json``; a workdir of a version that wrote none), which
is restored unverified with a notice. A checkpoint cut short between the two writes is set aside
in favour of an older verified one; when none can be read, it is restored unverified, with a
notice, rather than lose the run: orbax finalised its arrays, only their record is missing.

A checkpoint that cannot be read (a file cut short, damaged, or unlike its checksum) does not
stop a resume while an older one can be read: :meth:`Checkpointer.restore_latest` restores the
newest readable checkpoint and moves the unreadable newer ones aside, into
``workdir/unreadable_checkpoints/`` (kept, not deleted), each reported in one line.

Data identity: a run resumes only on the data its newest checkpoint recorded
(:meth:`Checkpointer.check_data`), unless the config says the change is meant
(``config.resume_on_other_data``).

Replica-parallel serialisation (orbax's default off GPU: each replica of a replicated array writes
a slice) is turned off: on CPU it compiles a slicing program per array and replica, which costs
far more than writing the small replicated arrays once.
"""

import contextlib
import dataclasses
import errno
import gc
import hashlib
import json
import logging as std_logging
import os
import shutil
import sys
from collections.abc import Iterator, Mapping
from typing import Any

from absl import logging
import jax
from jax.experimental import multihost_utils
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint._src.serialization import jax_array_handlers
from orbax.checkpoint._src.serialization import type_handler_registry

from compressors.parallel import embeddings
from compressors.parallel import fsdp
from compressors.parallel import hot_rows
from experiments import cli
from experiments import logs


def _manager(workdir: str) -> ocp.CheckpointManager:
  # No max_to_keep: orbax prunes inside save, before the new checkpoint's checksums exist, and a
  # run killed in between would keep no checkpoint it can verify (Checkpointer.save prunes).
  registry = type_handler_registry.create_type_handler_registry(
      (np.ndarray, ocp.type_handlers.NumpyHandler()),  # for load_params
      (jax.Array, jax_array_handlers.ArrayHandler(use_replica_parallel=False)))
  return ocp.CheckpointManager(
      os.path.abspath(os.path.join(workdir, "checkpoints")),
      options=ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=False),
      item_handlers=ocp.PyTreeCheckpointHandler(type_handler_registry=registry))


UNREADABLE_DIR = "unreadable_checkpoints"
CHECKSUMS_FILE = "checksums.json"  # in each step's folder
_NO_CHECKSUMS = f"no {CHECKSUMS_FILE}: cut short after its arrays were written"
_ON_ANOTHER_PROCESS = "on another process"  # why a process refuses what another could not read
# In the workdir: the first step written with checksums.
CHECKSUMS_SINCE_FILE = "checksums_since.json"


class ChecksumMismatch(ValueError):
  """A checkpoint's files are not those its checksums describe."""


class DiskFull(OSError):
  """A checkpoint could not be written: the disk is full."""

  def __init__(self, folder: str, step: int, kept: list[int], nbytes: int):
    kept_text = ("no checkpoint: the run would start afresh" if not kept
                 else f"the checkpoint of step {kept[0]}" if len(kept) == 1
                 else f"the checkpoints of steps {', '.join(map(str, kept))}")
    super().__init__(
        errno.ENOSPC,
        f"{folder}: the disk is full (no space left on device): the checkpoint of step {step} "
        f"({nbytes:,} bytes of arrays) could not be written, and its partial files were "
        f"removed; kept: {kept_text}. Free space on that disk and run again with the same "
        "--workdir to resume")

  def __str__(self):
    return self.strerror


class Checkpointer:
  """Saves and restores the training state under ``workdir/checkpoints``."""

  def __init__(self, workdir: str, *, keep: int, data: Mapping[str, str] | None = None):
    """Args:
      workdir: the run's directory.
      keep: how many checkpoints to keep.
      data: the identity of the data the run trains on (``ShardedDataset.identity``), recorded
        with every checkpoint saved.
    """
    self._workdir, self._keep, self._data = workdir, keep, dict(data or {})
    self._folder = os.path.join(workdir, "checkpoints")
    self._manager = _manager(workdir)

  def latest_step(self) -> int | None:
    """The last complete checkpoint's step, or None."""
    return self._manager.latest_step()

  def save(self, step: int, state: Any) -> None:
    """Saves ``state`` as step ``step`` (every process must call it), then its checksums, then
    removes all but the newest ``keep`` checkpoints: until the new one can be verified, the
    older ones stay.

    Raises:
      DiskFull: the disk is full (or the quota spent); the step's partial files are removed,
        and the message names the folder, the bytes of the state's arrays and the checkpoints
        kept. Unless ``--verbose``, what orbax logs of it afterwards (its threads still
        writing) is dropped: the error's line is the run's last.
    """
    if self._manager.latest_step() == step:
      return
    is_main = jax.process_index() == 0
    since = os.path.join(self._workdir, CHECKSUMS_SINCE_FILE)
    folder = os.path.join(self._folder, str(step))
    try:
      with _quiet_storage():
        if is_main and not os.path.exists(since):
          os.makedirs(self._workdir, exist_ok=True)
          logs.write_json(since, step)
        self._manager.save(step, args=ocp.args.PyTreeSave(state))
        self._manager.wait_until_finished()
        if is_main:  # orbax's folder is shared by every process, and complete once save returns
          logs.write_json(os.path.join(folder, CHECKSUMS_FILE),
                          {"files": _file_checksums(folder), "data": self._data})
        # Every process deletes together (orbax waits for all of them in delete).
        for old in sorted(self._manager.all_steps())[:-self._keep]:
          self._manager.delete(old)
    except Exception as e:  # pylint: disable=broad-except  # TensorStore's are ValueErrors
      if not _disk_full(e):
        raise
      if not cli.verbose():  # the run ends on this error's line: orbax's late reports of it go
        std_logging.getLogger("absl").addFilter(_not_from_orbax)
      nbytes = sum(x.nbytes for x in jax.tree.leaves(state) if hasattr(x, "nbytes"))
      raise DiskFull(self._folder, step, self._remove_partial(step), nbytes) from e

  def _remove_partial(self, step: int) -> list[int]:
    """Removes what a failed save of step ``step`` left (orbax's temporary folder, or the step
    without its checksums); returns the steps of the checkpoints kept."""
    kept = []
    for name in os.listdir(self._folder) if os.path.isdir(self._folder) else ():
      if name.startswith(f"{step}.orbax-checkpoint-tmp") or name == str(step):
        if jax.process_index() == 0:
          shutil.rmtree(os.path.join(self._folder, name), ignore_errors=True)
      elif name.isdigit():
        kept.append(int(name))
    return sorted(kept)

  def check_data(self, *, changed_ok: bool) -> None:
    """Refuses to resume on other data than the newest checkpoint recorded.

    Compares the identity given to the constructor with the one recorded by the newest
    checkpoint that has checksums, key by key (keys only one of them has are not compared).

    Args:
      changed_ok: the change is meant (``config.resume_on_other_data``): it is logged, and the
        checkpoints saved from now on record the new identity.

    Raises:
      ValueError: the data differs, naming every differing hash with both values.
    """
    for step in sorted(self._manager.all_steps(), reverse=True):
      try:
        recorded = _read_checksums(os.path.join(self._folder, str(step))).get("data", {})
      except (OSError, ValueError):
        continue  # cut short: restore_latest sets it aside
      break
    else:
      return
    differing = sorted(k for k in self._data.keys() & recorded.keys()
                       if self._data[k] != recorded[k])
    if not differing:
      return
    changes = "; ".join(f"{k}: {recorded[k]!r} there, {self._data[k]!r} now" for k in differing)
    if changed_ok:
      logging.warning("%s: resuming on other data than the checkpoint of step %d was trained on "
                      "(%s), as config.resume_on_other_data=True allows", self._workdir, step,
                      changes)
      return
    raise ValueError(
        f"workdir={self._workdir!r} holds a checkpoint (step {step}) trained on other data "
        f"({changes}): token ids or images would change meaning mid-run. Resume with the data "
        "the run started on (config.data_dir and the caches), set "
        "--config.resume_on_other_data=True if the change is meant, or use another workdir")

  def restore(self, step: int, like: Any) -> Any:
    """Restores step ``step`` with the structure, shapes, dtypes and shardings of ``like``."""
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
    return self._manager.restore(step, args=ocp.args.PyTreeRestore(
        abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract)))

  def restore_latest(self, like: Any) -> tuple[int, Any] | None:
    """``(step, state)`` of the newest checkpoint that can be read (restored as
    :meth:`restore` does), or None when there is no checkpoint.

    Newer checkpoints that cannot be read, or whose files are not those their checksums
    describe (checked by process 0), are moved into ``workdir/unreadable_checkpoints/``, each
    reported in one line naming its folder. In a multi-process run a checkpoint counts as
    readable only if every process read it. When none can be read, the newest one whose only
    fault is a missing ``checksums.json`` (the run stopped between the two writes) is restored
    unverified, with a notice.

    Raises:
      ValueError: no checkpoint can be read; they are left in place (a state that no longer
        fits them, after a change of code, fails this way too) and the message says how to
        start afresh.
    """
    unreadable = []
    for step in sorted(self._manager.all_steps(), reverse=True):
      error = _damage(self._workdir, step) if jax.process_index() == 0 else None
      state, error = self._try_restore(step, like, error)
      if error is None:
        self._set_aside(unreadable, step)
        return step, state
      unreadable.append((step, error))
    if not unreadable:
      return None
    # The last resort: the newest checkpoint whose only fault is its missing checksums (process 0
    # checked them; a process that failed on its own has a reason of its own).
    for i, (step, error) in enumerate(unreadable):
      if not _on_every_process(error in (_NO_CHECKSUMS, _ON_ANOTHER_PROCESS)):
        continue
      state, reason = self._try_restore(step, like, None)
      if reason is None:
        logging.warning("checkpoint %s has no %s (stopped between writing its arrays and their "
                        "checksums) and no checkpoint before it can be read; restoring it "
                        "unverified", os.path.join(self._folder, str(step)), CHECKSUMS_FILE)
        self._set_aside(unreadable[:i], step)
        return step, state
      unreadable[i] = (step, reason)
    folder = os.path.join(self._workdir, "checkpoints")
    reasons = "; ".join(f"step {s}: {e}" for s, e in unreadable)
    raise ValueError(
        f"none of the {len(unreadable)} checkpoints under {folder} can be read ({reasons}); "
        f"they are left in place. To start afresh, move {folder} elsewhere (or use another "
        "--workdir)")

  def _try_restore(self, step: int, like: Any, error: str | None) -> tuple[Any, str | None]:
    """``(state, None)`` if step ``step`` reads on every process, else ``(None, why)``; ``error``
    is why this process already refuses it. Every process restores, or none: a restore waits
    for every process."""
    if not _on_every_process(error is None):
      return None, error or _ON_ANOTHER_PROCESS
    try:
      with _quiet_storage():
        state = self.restore(step, like)
    except Exception as e:  # pylint: disable=broad-except  # orbax, TensorStore, json: any
      error = _first_line(e)
    if _on_every_process(error is None):
      return state, None
    return None, error or _ON_ANOTHER_PROCESS

  def _set_aside(self, unreadable: list[tuple[int, str]], restored: int) -> None:
    """Moves the ``unreadable`` checkpoints (newer than ``restored``) out of orbax's folder,
    so that they are neither restored nor pruned, and reopens the manager without them."""
    if not unreadable:
      return
    aside = os.path.join(self._workdir, UNREADABLE_DIR)
    for step, error in unreadable if jax.process_index() == 0 else ():
      folder = os.path.join(self._workdir, "checkpoints", str(step))
      target, suffix = os.path.join(aside, str(step)), 1
      while os.path.exists(target):  # the same step, unreadable again after an earlier move
        target, suffix = os.path.join(aside, f"{step}.{suffix}"), suffix + 1
      os.makedirs(aside, exist_ok=True)
      os.rename(folder, target)
      logging.warning("checkpoint %s cannot be read (%s); moved to %s; resuming from the "
                      "checkpoint of step %d", folder,
                      error, target, restored)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices("unreadable checkpoints moved aside")
    self._manager.close()
    self._manager = _manager(self._workdir)

  def close(self) -> None:
    self._manager.close()


def _damage(workdir: str, step: int) -> str | None:
  """Why ``workdir``'s checkpoint of step ``step`` is not what its checksums describe, or None
  if it is (or if it predates checksums: a notice says so)."""
  folder = os.path.join(workdir, "checkpoints", str(step))
  try:
    verify(folder)
  except FileNotFoundError:
    if step < _checksums_since(workdir):
      logging.warning("checkpoint %s was written before checkpoints carried checksums; "
                      "restoring it unverified", folder)
      return None
    return _NO_CHECKSUMS
  except (OSError, ValueError) as e:
    return _first_line(e)
  return None


def verify(folder: str) -> None:
  """Checks that every file of the checkpoint in ``folder`` has the sha256 its
  ``checksums.json`` records.

  Raises:
    FileNotFoundError: the checkpoint has no ``checksums.json``.
    ChecksumMismatch: a file is missing or differs (the first one found, named).
    ValueError: ``checksums.json`` cannot be read.
  """
  recorded = _read_checksums(folder)["files"]
  found = _file_checksums(folder)
  for name, digest in sorted(recorded.items()):
    if found.get(name) != digest:
      # Digests cut to 16 digits: the notice that quotes this line names the folder too.
      state = "is missing" if name not in found else f"has sha256 {found[name][:16]}..."
      raise ChecksumMismatch(f"{name} {state}, not the {digest[:16]}... that {CHECKSUMS_FILE} "
                             "records: damaged after it was written")


def _read_checksums(folder: str) -> dict[str, Any]:
  """The ``checksums.json`` of the checkpoint in ``folder`` (FileNotFoundError: none)."""
  path = os.path.join(folder, CHECKSUMS_FILE)
  with open(path) as f:
    try:
      checksums = json.load(f)
    except ValueError as e:
      raise ValueError(f"{path} cannot be read ({e})") from None
  if not isinstance(checksums, dict) or not isinstance(checksums.get("files"), dict):
    raise ValueError(f"{path} holds no checksums of files")
  return checksums


def _file_checksums(folder: str) -> dict[str, str]:
  """The sha256 of every file under ``folder`` but the checksums themselves, by relative path."""
  digests = {}
  for root, _, names in os.walk(folder):
    for name in names:
      if name.startswith(CHECKSUMS_FILE):  # the file and its temporary
        continue
      path = os.path.join(root, name)
      with open(path, "rb") as f:
        digests[os.path.relpath(path, folder)] = hashlib.file_digest(f, "sha256").hexdigest()
  return digests


def _checksums_since(workdir: str) -> int | float:
  """The first step ``workdir`` wrote with checksums (infinity if it never wrote one)."""
  try:
    with open(os.path.join(workdir, CHECKSUMS_SINCE_FILE)) as f:
      return int(f.read())
  except (OSError, ValueError):
    return float("inf")


def _disk_full(error: BaseException) -> bool:
  """Whether ``error`` (or one it was raised from) says the disk is full or the quota spent;
  TensorStore's errors say it in their message only."""
  while error is not None:
    if (isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT)
        or any(s in str(error) for s in ("No space left on device", "Disk quota exceeded"))):
      return True
    error = error.__cause__ or error.__context__
  return False


def _on_every_process(ok: bool) -> bool:
  """Whether ``ok`` holds on every process of the run."""
  if jax.process_count() == 1:
    return ok
  return bool(np.all(multihost_utils.process_allgather(np.asarray(ok))))


@contextlib.contextmanager
def _quiet_storage() -> Iterator[None]:
  """Holds back what orbax and TensorStore report while one of their reads or writes fails: the
  caller reports the failure in one line. The errors orbax logged are shown after all with
  ``--verbose`` (:func:`experiments.cli.verbose`), or when nothing failed.

  When one read or write fails (a damaged file, a full disk), orbax logs the error of each of
  its threads with a traceback, and the operations it abandoned report when they end
  (:func:`_hide_abandoned_operations`). A full disk made 10 to 32 tracebacks before the one line
  that says what happened; nothing in them is wrong but the error caught.
  """
  _hide_abandoned_operations()
  held = _HeldErrors()
  absl_logger = std_logging.getLogger("absl")
  absl_logger.addFilter(held)
  try:
    yield
  except BaseException:
    held.failed = True
    raise
  finally:
    gc.collect()
    absl_logger.removeFilter(held)
    if not held.failed or cli.verbose():
      for record in held.records:
        absl_logger.handle(record)


def _not_from_orbax(record: std_logging.LogRecord) -> bool:
  """Drops the errors orbax logs: its threads that were still writing when a save failed report
  the failure again, after it was reported in one line (added once, by ``addFilter``)."""
  return not (record.levelno >= std_logging.ERROR
              and f"{os.sep}orbax{os.sep}" in record.pathname)


class _HeldErrors(std_logging.Filter):
  """Holds the errors orbax logs, to drop them when the failure they come with is reported on
  its own (:func:`_quiet_storage`)."""

  def __init__(self):
    super().__init__()
    self.records, self.failed = [], False

  def filter(self, record: std_logging.LogRecord) -> bool:
    if record.levelno >= std_logging.ERROR and f"{os.sep}orbax{os.sep}" in record.pathname:
      self.records.append(record)
      return False
    return True


# What asyncio logs of the futures and tasks orbax abandoned when one of its operations failed
# ("Future", "_GatheringFuture", "Task" ... "exception was never retrieved").
_ABANDONED = ("exception was never retrieved", "Task was destroyed but it is pending")


def _hide_abandoned_operations() -> None:
  """From now on (unless ``--verbose``), drops what the reads and writes orbax abandoned report
  when TensorStore ends them or they are collected, after orbax closed its event loop, seconds
  later too: "Event loop is closed" once per array, and asyncio's futures whose exception was
  never retrieved, each with a traceback."""
  previous = sys.unraisablehook
  if getattr(previous, "hides_abandoned_operations", False) or cli.verbose():
    return

  def hook(unraisable):
    if not (isinstance(unraisable.exc_value, RuntimeError)
            and "Event loop is closed" in str(unraisable.exc_value)):
      previous(unraisable)

  hook.hides_abandoned_operations = True
  sys.unraisablehook = hook
  std_logging.getLogger("asyncio").addFilter(_not_abandoned)  # added once


def _not_abandoned(record: std_logging.LogRecord) -> bool:
  message = record.getMessage()
  return not any(s in message for s in _ABANDONED)


def _first_line(error: BaseException, limit: int = 300) -> str:
  """``Type: the first line of its message``, at most ``limit`` characters (TensorStore's
  errors run to a hundred lines)."""
  lines = str(error).strip().splitlines()
  text = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
  return text if len(text) <= limit else text[:limit - 3] + "..."


# Beside config.json in an islands run: each parameter's natural shape and the fast axis's size.
PARAM_LAYOUT_FILE = "param_layout.json"
EMBEDDING_LAYOUT_FILE = "embedding_layout.json"  # where placed tables' rows live


def write_param_layout(workdir: str, params: Any, shards: int) -> None:
  """Records the natural shapes of ``params`` (arrays or shapes) and ``shards`` (the fast axis's
  size), so that :func:`load_params` can undo the islands' layout."""
  shapes = {jax.tree_util.keystr(path): list(np.shape(leaf))
            for path, leaf in jax.tree_util.tree_leaves_with_path(params)}
  logs.write_json(os.path.join(workdir, PARAM_LAYOUT_FILE), {"fsdp": shards, "shapes": shapes})


def write_embedding_layout(workdir: str, plan: Any, hot_ids: Any = ()) -> None:
  """Records where the embedding tables' rows live in the checkpoints' ``params["tables"]``
  (a :class:`compressors.parallel.embeddings.Plan`: its placements, owners and offsets, and
  ``hot_ids``, each table's hot rows, where any: ``compressors.parallel.hot_rows``), so that
  ``embeddings.unshard`` (``hot_rows.unshard``) can give back each table."""
  hot = {"hot_ids": [list(i) for i in hot_ids]} if any(hot_ids) else {}
  logs.write_json(os.path.join(workdir, EMBEDDING_LAYOUT_FILE),
                  {**dataclasses.asdict(plan), **hot})


def load_params(workdir: str, step: int | None = None) -> Any:
  """The parameters of a run's checkpoint (the latest by default), as numpy arrays on the host;
  an islands run's in their natural shapes (with per-island parameters, one row per island); a
  run's placed embedding tables whole (``embedding_<t>``, as the replicated model holds them)."""
  params = _load(workdir, step, fields=("params",))["params"]
  if os.path.exists(os.path.join(workdir, EMBEDDING_LAYOUT_FILE)):
    return _whole_tables(workdir, params)
  path = os.path.join(workdir, PARAM_LAYOUT_FILE)
  if not os.path.exists(path):
    return params
  with open(path) as f:
    layout = json.load(f)

  def natural(key, stored):
    leaf = fsdp.leaf_layout(tuple(layout["shapes"][jax.tree_util.keystr(key)]), layout["fsdp"])
    if stored.shape == leaf.stored_shape:
      return np.asarray(leaf.to_natural(stored))
    return np.stack([np.asarray(leaf.to_natural(row)) for row in stored])  # a row per island
  return jax.tree_util.tree_map_with_path(natural, params)


def _whole_tables(workdir: str, params: dict) -> dict:
  """A placed run's ``params`` with each table gathered from the banks and the hot rows
  (:data:`EMBEDDING_LAYOUT_FILE` says where its rows live), without the exchange's
  error-feedback residuals (training state, no part of the model)."""
  with open(os.path.join(workdir, EMBEDDING_LAYOUT_FILE)) as f:
    layout = json.load(f)
  hot_ids = layout.pop("hot_ids", None)
  plan = embeddings.Plan(**{k: tuple(v) if isinstance(v, list) else v
                            for k, v in layout.items()})
  hot = hot_rows.hot_rows(plan, hot_ids) if hot_ids else hot_rows.none(plan)
  tables = hot_rows.unshard(plan, hot, params["tables"])
  return {"tower": params["tower"], **{f"embedding_{t}": x for t, x in enumerate(tables)}}


def load_state(workdir: str, step: int | None = None) -> dict[str, Any]:
  """The whole training state of a run's checkpoint (the latest by default), as a dict of its
  fields (``step``, ``params``, ``model_state``, ``opt_state``) holding numpy arrays on the host
  (per-device leaves with their device axis)."""
  return _load(workdir, step, fields=None)


def _load(workdir, step, fields):
  manager = _manager(workdir)
  try:
    step = manager.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint under {os.path.join(workdir, 'checkpoints')}")
    damage = _damage(workdir, step)
    if damage:
      raise ValueError(f"the checkpoint of step {step} under {workdir} cannot be read ({damage})")
    metadata = manager.item_metadata(step)
    item = {k: metadata[k] for k in (fields or metadata)}
    restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), item)
    return manager.restore(step, args=ocp.args.PyTreeRestore(
        item=item, restore_args=restore_args, partial_restore=fields is not None))
  finally:
    manager.close()
