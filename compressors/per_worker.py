"""Per-worker state under ``shard_map``: a leading device axis on every leaf.

Error-feedback residuals (and every other compressor memory) differ from worker to worker, so
the optimizer state is not replicated. Under ``jax.shard_map`` such state is carried as a global
array with one row per worker and spec ``P(axis_name)``; inside the mapped function each worker
sees its own row. Under ``jax.pmap`` the leading axis is already there and these are not needed.
"""

from typing import Any

import jax


def add_device_axis(tree: Any) -> Any:
  """Gives every leaf a leading axis of size one, to leave ``shard_map`` with spec ``P(axis)``."""
  return jax.tree.map(lambda x: x[None], tree)


def drop_device_axis(tree: Any) -> Any:
  """Removes the leading axis added by :func:`add_device_axis` (inside ``shard_map``)."""
  return jax.tree.map(lambda x: x[0], tree)
