"""Parameters sharded over the workers' axis beside replicated ones: a recommendation model's
embedding tables (:mod:`compressors.parallel.embeddings`' bank and column bank) in a
data-parallel step.

A sharded leaf (spec ``P(axis)`` or ``P(None, axis)`` over the workers' mesh axis) is one array
whose blocks live on different devices: nothing about it is replicated, so neither the
compressing chain's all-reduce nor the replica check applies to it. Its gradient needs no
exchange either: the loss reads other devices' blocks through collectives (the embedding
exchange's all-to-all), whose transpose returns every device's gradient of those rows to their
owner and sums it there. So the step (:func:`compressors.data_parallel` with ``sharded=``)

* differentiates each worker's loss with respect to its own copy of the replicated leaves (as
  always) and to its block of the sharded ones;
* divides the sharded leaves' gradient by the worker count (the all-to-all's transpose summed the
  workers' losses; the replicated leaves' chain takes their mean);
* updates the replicated leaves with the run's chain (any registered method) and the sharded
  ones with their own optimizer (:attr:`ShardedParams.tx`, e.g. ``optimizers.rowwise_adagrad``),
  which each device runs on its own rows with nothing exchanged; its state is laid out with one
  row per worker, like any per-worker state;
* skips a step with a non-finite gradient anywhere, sharded leaves included
  (:func:`compressors.skip_nonfinite` wraps both).

Simulated workers (``workers_per_device > 1``, :mod:`compressors.parallel.workers`): the specs
name the workers' axes (``P(("data", "worker"))``), a block per worker as on as many devices;
on the mesh a device holds its workers' blocks one after the other, and each worker's step
reads its own (:meth:`ShardedParams.worker_blocks`).
"""

from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

REPLICATED, SHARDED = "replicated", "sharded"


def _is_spec(x) -> bool:
  return isinstance(x, P)


class ShardedParams(NamedTuple):
  """Which parameters are sharded over the workers' axis, and their optimizer.

  Attributes:
    specs: a tree shaped like the parameters: ``P()`` for a replicated leaf (the run's chain
      updates it), else its ``PartitionSpec`` over the workers' mesh axis (the leaf's global
      array split into one block per device).
    tx: the sharded leaves' optimizer, run by each device on its blocks (no collective).
  """
  specs: chex.ArrayTree
  tx: optax.GradientTransformation

  def labels(self) -> chex.ArrayTree:
    """``"replicated"`` or ``"sharded"`` per leaf (``optax.multi_transform``'s labels)."""
    return jax.tree.map(lambda s: REPLICATED if s == P() else SHARDED, self.specs,
                        is_leaf=_is_spec)

  def combined(self, tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """``tx`` on the replicated leaves, :attr:`tx` on the sharded ones."""
    return optax.multi_transform({REPLICATED: tx, SHARDED: self.tx}, self.labels())

  def without_sharded_updates(self, tx: optax.GradientTransformation
                              ) -> optax.GradientTransformation:
    """:meth:`combined` with the sharded leaves' updates zero: what the check that every
    worker applies the same updates to the replicated leaves traces."""
    return optax.multi_transform({REPLICATED: tx, SHARDED: optax.set_to_zero()}, self.labels())

  def own_copy(self, own_copy, params: chex.ArrayTree) -> chex.ArrayTree:
    """``own_copy`` (a per-worker copy to differentiate) of the replicated leaves; the sharded
    blocks are already each device's own."""
    return jax.tree.map(lambda x, s: own_copy(x) if s == P() else x, params, self.specs)

  def mean_gradient(self, grads: chex.ArrayTree, workers: int) -> chex.ArrayTree:
    """The sharded leaves' gradient (summed over the workers' losses by the exchange's
    transpose) divided by ``workers``; the replicated leaves' as it is."""
    return jax.tree.map(lambda g, s: g if s == P() else g / workers, grads, self.specs)

  def block_shapes(self, params: chex.ArrayTree, mesh: jax.sharding.Mesh) -> chex.ArrayTree:
    """``ShapeDtypeStruct``s of one device's block of each leaf (replicated: the whole); with
    simulated workers, ``mesh`` is the equivalent one (one worker's block)."""
    def block(x, spec):
      shape = list(x.shape)
      for dim, names in enumerate(spec):
        for name in (names if isinstance(names, tuple) else (names,) if names else ()):
          shape[dim] //= mesh.shape[name]
      return jax.ShapeDtypeStruct(tuple(shape), x.dtype)
    return jax.tree.map(block, params, self.specs)

  def worker_axes(self) -> chex.ArrayTree:
    """``in_axes``/``out_axes`` of :meth:`worker_blocks`' layout for
    :meth:`compressors.parallel.workers.Workers.each`: 0 sharded, None replicated."""
    return jax.tree.map(lambda s: None if s == P() else 0, self.specs, is_leaf=_is_spec)

  def worker_blocks(self, params: chex.ArrayTree, workers: int) -> chex.ArrayTree:
    """One device's blocks of the sharded leaves (its ``workers`` workers' blocks one after the
    other along the sharded axis, ranks row-major) -> one block per worker along a new leading
    axis; the replicated leaves as they are (traceable)."""
    def split(x, spec):
      if spec == P():
        return x
      dim = _sharded_dim(spec)
      shape = x.shape[:dim] + (workers, x.shape[dim] // workers) + x.shape[dim + 1:]
      return jnp.moveaxis(x.reshape(shape), dim, 0)
    return jax.tree.map(split, params, self.specs)

  def device_blocks(self, blocks: chex.ArrayTree) -> chex.ArrayTree:
    """:meth:`worker_blocks` undone: one device's blocks of the sharded leaves."""
    def join(x, spec):
      if spec == P():
        return x
      dim = _sharded_dim(spec)
      x = jnp.moveaxis(x, 0, dim)
      return x.reshape(x.shape[:dim] + (x.shape[dim] * x.shape[dim + 1],) + x.shape[dim + 2:])
    return jax.tree.map(join, blocks, self.specs)

  def replicated_leaves(self, params: chex.ArrayTree) -> list:
    """The replicated leaves of ``params`` (those every device must hold alike)."""
    return [x for x, s in zip(jax.tree.leaves(params),
                              jax.tree.leaves(self.specs, is_leaf=_is_spec)) if s == P()]


def _sharded_dim(spec: P) -> int:
  """The axis of a leaf that ``spec`` shards."""
  return next(dim for dim, names in enumerate(spec) if names)


def check(sharded: ShardedParams, params: chex.ArrayTree, workers, per_worker_params: bool,
          shard_axis) -> None:
  """Refuses, in one line, what the sharded step does not run: no mesh (pmap: ``workers`` is
  None, else a :class:`compressors.parallel.workers.Workers`), per-worker parameters, islands,
  specs not shaped like the parameters, or a sharded leaf whose blocks do not divide evenly
  (over the axes of the equivalent mesh, which name the simulated workers')."""
  for value, field, allowed in ((workers is None, "mesh=None", "a mesh (shard_map)"),
                                (per_worker_params, "per_worker_params=True", "False"),
                                (shard_axis is not None, f"shard_axis={shard_axis!r}", "None")):
    if value:
      raise ValueError(f"data_parallel(sharded=...): {field} is not allowed with sharded "
                       f"parameters; allowed: {allowed}")
  if (jax.tree.structure(params)
      != jax.tree.structure(jax.tree.map(lambda s: 0, sharded.specs, is_leaf=_is_spec))):
    raise ValueError("data_parallel(sharded=...): sharded.specs must be shaped like the "
                     "parameters, one PartitionSpec per leaf (P() for a replicated one)")
  mesh, along = workers.equivalent_mesh(abstract=True), workers.axis_name
  for (path, x), spec in zip(jax.tree_util.tree_leaves_with_path(params),
                             jax.tree.leaves(sharded.specs, is_leaf=_is_spec)):
    sharded_axes = [names for names in spec if names]
    if spec != P() and sharded_axes != [along] and sharded_axes != [(along,)]:
      # A block per worker, as worker_blocks reads it: one axis, over every workers' axis.
      raise ValueError(f"data_parallel(sharded=...): parameter {jax.tree_util.keystr(path)} "
                       f"with spec {spec}; allowed: P() or one axis sharded over "
                       f"axis_name={along!r}")
    for dim, names in enumerate(spec):
      count = 1
      for name in (names if isinstance(names, tuple) else (names,) if names else ()):
        count *= mesh.shape[name]
      if x.shape[dim] % count:
        raise ValueError(f"data_parallel(sharded=...): parameter {jax.tree_util.keystr(path)} "
                         f"of shape {x.shape} with spec {spec}: axis {dim} must be a multiple "
                         f"of {count}")

