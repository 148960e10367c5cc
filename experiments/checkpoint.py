"""Checkpoints with orbax: the whole training state, saved atomically, restored to its shardings.

The state holds the parameters, every optimizer and compressor state (error-feedback residuals
and TASC's curvature average included, one per device), the per-device batch-norm statistics and
the step, which is also the data position (batches are a function of the step, see
:mod:`experiments.data.pipeline`). Orbax writes each step into a temporary directory and renames
it only once complete, and lists only finalised steps, so a half-written checkpoint is never
restored.

Replica-parallel serialisation (orbax's default off GPU: each replica of a replicated array writes
a slice) is turned off: on CPU it compiles a slicing program per array and replica, which costs
far more than writing the small replicated arrays once.
"""

import os
from typing import Any

import jax
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


class Checkpointer:
  """Saves and restores the training state under ``workdir/checkpoints``."""

  def __init__(self, workdir: str, *, keep: int):
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

  def close(self) -> None:
    self._manager.close()


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
