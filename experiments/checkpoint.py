"""Checkpoints with orbax: the whole training state, saved atomically, restored to its shardings.

The state holds the parameters, every optimizer and compressor state (error-feedback residuals
and TASC's curvature average included, one per device), the per-device batch-norm statistics and
the step, which is also the data position (batches are a function of the step, see
:mod:`experiments.data.pipeline`). Orbax writes each step into a temporary directory and renames
it only once complete, and lists only finalised steps, so a half-written checkpoint is never
restored.

A checkpoint that cannot be read (a file cut short or damaged after it was written) does not stop
a resume while an older one can be read: :meth:`Checkpointer.restore_latest` restores the newest
readable checkpoint and moves the unreadable newer ones aside, into
``workdir/unreadable_checkpoints/`` (kept, not deleted), each reported in one line.

Replica-parallel serialisation (orbax's default off GPU: each replica of a replicated array writes
a slice) is turned off: on CPU it compiles a slicing program per array and replica, which costs
far more than writing the small replicated arrays once.
"""

import contextlib
import gc
import os
import sys
from collections.abc import Iterator
from typing import Any

from absl import logging
import jax
from jax.experimental import multihost_utils
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint._src.serialization import jax_array_handlers
from orbax.checkpoint._src.serialization import type_handler_registry


def _manager(workdir: str, keep: int | None) -> ocp.CheckpointManager:
  registry = type_handler_registry.create_type_handler_registry(
      (np.ndarray, ocp.type_handlers.NumpyHandler()),  # for load_params
      (jax.Array, jax_array_handlers.ArrayHandler(use_replica_parallel=False)))
  return ocp.CheckpointManager(
      os.path.abspath(os.path.join(workdir, "checkpoints")),
      options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                           enable_async_checkpointing=False),
      item_handlers=ocp.PyTreeCheckpointHandler(type_handler_registry=registry))


UNREADABLE_DIR = "unreadable_checkpoints"


class Checkpointer:
  """Saves and restores the training state under ``workdir/checkpoints``."""

  def __init__(self, workdir: str, *, keep: int):
    self._workdir, self._keep = workdir, keep
    self._manager = _manager(workdir, keep)

  def latest_step(self) -> int | None:
    """The last complete checkpoint's step, or None."""
    return self._manager.latest_step()

  def save(self, step: int, state: Any) -> None:
    """Saves ``state`` as step ``step`` (every process must call it)."""
    if self._manager.latest_step() == step:
      return
    self._manager.save(step, args=ocp.args.PyTreeSave(state))
    self._manager.wait_until_finished()

  def restore(self, step: int, like: Any) -> Any:
    """Restores step ``step`` with the structure, shapes, dtypes and shardings of ``like``."""
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
    return self._manager.restore(step, args=ocp.args.PyTreeRestore(
        abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract)))

  def restore_latest(self, like: Any) -> tuple[int, Any] | None:
    """``(step, state)`` of the newest checkpoint that can be read (restored as
    :meth:`restore` does), or None when there is no checkpoint.

    Newer checkpoints that cannot be read are moved into ``workdir/unreadable_checkpoints/``,
    each reported in one line naming its folder. In a multi-process run a checkpoint counts as
    readable only if every process read it.

    Raises:
      ValueError: no checkpoint can be read; they are left in place (a state that no longer
        fits them, after a change of code, fails this way too) and the message says how to
        start afresh.
    """
    unreadable = []
    for step in sorted(self._manager.all_steps(), reverse=True):
      with _quiet_abandoned_reads():
        try:
          state, error = self.restore(step, like), None
        except Exception as e:  # pylint: disable=broad-except  # orbax, TensorStore, json: any
          state, error = None, _first_line(e)
      if _on_every_process(error is None):
        self._set_aside(unreadable, step)
        return step, state
      unreadable.append((step, error))
    if not unreadable:
      return None
    folder = os.path.join(self._workdir, "checkpoints")
    reasons = "; ".join(f"step {s}: {e}" for s, e in unreadable)
    raise ValueError(
        f"none of the {len(unreadable)} checkpoints under {folder} can be read ({reasons}); "
        f"they are left in place. To start afresh, move {folder} elsewhere (or use another "
        "--workdir)")

  def _set_aside(self, unreadable: list[tuple[int, str | None]], restored: int) -> None:
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
                      error or "on another process", target, restored)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices("unreadable checkpoints moved aside")
    self._manager.close()
    self._manager = _manager(self._workdir, self._keep)

  def close(self) -> None:
    self._manager.close()


def _on_every_process(ok: bool) -> bool:
  """Whether ``ok`` holds on every process of the run."""
  if jax.process_count() == 1:
    return ok
  return bool(np.all(multihost_utils.process_allgather(np.asarray(ok))))


@contextlib.contextmanager
def _quiet_abandoned_reads() -> Iterator[None]:
  """Collects what a failed restore leaves behind, without a traceback for each array.

  When one read of a restore fails, orbax closes its event loop while TensorStore still holds
  the other reads; collecting them later reports "Event loop is closed" once per array, each
  with a traceback, and nothing is wrong but the error already caught.
  """
  previous = sys.unraisablehook

  def hook(unraisable):
    if not (isinstance(unraisable.exc_value, RuntimeError)
            and "Event loop is closed" in str(unraisable.exc_value)):
      previous(unraisable)

  sys.unraisablehook = hook
  try:
    yield
  finally:
    gc.collect()
    sys.unraisablehook = previous


def _first_line(error: BaseException, limit: int = 300) -> str:
  """``Type: the first line of its message``, at most ``limit`` characters (TensorStore's
  errors run to a hundred lines)."""
  lines = str(error).strip().splitlines()
  text = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
  return text if len(text) <= limit else text[:limit - 3] + "..."


def load_params(workdir: str, step: int | None = None) -> Any:
  """The parameters of a run's checkpoint (the latest by default), as numpy arrays on the host."""
  return _load(workdir, step, fields=("params",))["params"]


def load_state(workdir: str, step: int | None = None) -> dict[str, Any]:
  """The whole training state of a run's checkpoint (the latest by default), as a dict of its
  fields (``step``, ``params``, ``model_state``, ``opt_state``) holding numpy arrays on the host
  (per-device leaves with their device axis)."""
  return _load(workdir, step, fields=None)


def _load(workdir, step, fields):
  manager = _manager(workdir, keep=None)
  try:
    step = manager.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint under {os.path.join(workdir, 'checkpoints')}")
    metadata = manager.item_metadata(step)
    item = {k: metadata[k] for k in (fields or metadata)}
    restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), item)
    return manager.restore(step, args=ocp.args.PyTreeRestore(
        item=item, restore_args=restore_args, partial_restore=fields is not None))
  finally:
    manager.close()
