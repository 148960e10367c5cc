"""Parameters sharded over an island's fast axis (ZeRO-3 by hand): each leaf's layout.

Inside an island the devices of the fast axis (``"fsdp"``) each hold one of its ``F`` shards of
every parameter, and of every optimizer-state leaf built from them; the whole leaf exists only
for the moment the loss needs it. The step is one ``shard_map`` manual over both axes: the loss
all-gathers each leaf over the fast axis where it reads it, and again in the backward pass
(:mod:`compressors.parallel.gather_on_use`; :meth:`ParamLayout.gather` gathers every leaf at
once, for what differentiates the loss forward-over-reverse), and the gather's transpose is a
reduce-scatter, so each device's gradient is its shard of the island's summed gradient. A
method built with ``axis_name="islands"`` then runs unchanged on the shard, over the slow axis
only (:func:`compressors.data_parallel` with ``shard_axis``).

A leaf's layout (:func:`leaf_layout`) depends on its shape and ``F`` alone: it is sharded along
its largest dimension that ``F`` divides (the first of equals), in its natural shape; a leaf
with none is flattened and zero-padded to a multiple of ``F``. Three forms of a leaf appear:

* natural: the model's array;
* stored: what the step takes as a global array, sharded over the fast axis (the natural array,
  or the padded flat one), with a leading row per island for per-island parameters;
* rows: an optimizer-state leaf that varies over the fast axis is laid out as any per-worker
  leaf is (:mod:`compressors.parallel.per_worker`): one row per shard, ``[F, *shard]``.

An elementwise optimizer runs on the shards as it is. One that reads a whole leaf's norm (LAMB,
LARS: ``optimizers.lamb(..., shard_axis=)``) sums the shards' squares over the fast axis, and
takes them with the padding zeroed (:meth:`ParamLayout.padding_zeroed`).
"""

import dataclasses
import math
from collections.abc import Hashable
from typing import Any

import chex
import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P


@dataclasses.dataclass(frozen=True)
class LeafLayout:
  """How one parameter leaf is split into ``shards`` pieces.

  Attributes:
    shape: the natural shape.
    shards: the number of shards (the fast axis's size).
    dim: the natural dimension sharded, or None: the leaf is flattened and zero-padded to a
      multiple of ``shards``, and the flat array is sharded.
  """
  shape: tuple[int, ...]
  shards: int
  dim: int | None

  @property
  def stored_shape(self) -> tuple[int, ...]:
    """The global shape of the stored leaf (without a per-island row)."""
    if self.dim is not None:
      return self.shape
    return (-(-math.prod(self.shape) // self.shards) * self.shards,)

  @property
  def shard_shape(self) -> tuple[int, ...]:
    """The shape each device holds."""
    shape = list(self.stored_shape)
    shape[self.dim or 0] //= self.shards
    return tuple(shape)

  def spec(self, axis: Hashable, leading: tuple = ()) -> P:
    """The stored leaf's ``PartitionSpec`` (``leading``: specs of rows before it)."""
    return P(*leading, *([None] * (self.dim or 0)), axis)

  def to_stored(self, x: jax.Array) -> jax.Array:
    """Natural -> stored (the padded flat array where no dimension divides)."""
    if self.dim is not None:
      return x
    flat = x.reshape(-1)
    return jnp.pad(flat, (0, self.stored_shape[0] - flat.size))

  def to_natural(self, x: jax.Array) -> jax.Array:
    """Stored -> natural."""
    if self.dim is not None:
      return x
    return x[:math.prod(self.shape)].reshape(self.shape)

  def rows_to_natural(self, x: jax.Array) -> jax.Array:
    """Rows ``[shards, *shard_shape]`` (one per device of the fast axis, in its order) ->
    natural."""
    stored = jnp.moveaxis(x, 0, self.dim or 0).reshape(self.stored_shape)
    return self.to_natural(stored)

  def padding_zeroed(self, shard: jax.Array, axis: Hashable) -> jax.Array:
    """Inside ``shard_map`` over the fast axis ``axis``: this device's shard with the entries
    past the natural leaf's end (the padding) set to zero."""
    size = math.prod(self.shape)
    if self.dim is not None or size == self.stored_shape[0]:
      return shard
    first = jax.lax.axis_index(axis) * shard.shape[0]  # the shard's place in the flat leaf
    return jnp.where(first + jnp.arange(shard.shape[0]) < size, shard, jnp.zeros_like(shard))


def leaf_layout(shape: tuple[int, ...], shards: int) -> LeafLayout:
  """The layout of a leaf of ``shape`` split into ``shards`` (see the module docstring)."""
  fits = [d for d, n in enumerate(shape) if n % shards == 0 and n >= shards]
  if not fits:
    return LeafLayout(tuple(shape), shards, None)
  return LeafLayout(tuple(shape), shards, max(fits, key=lambda d: (shape[d], -d)))


def leaf_shard_shapes(shapes, shards: int) -> list[tuple[int, ...]]:
  """The shape each device holds of each leaf of natural ``shapes`` split into ``shards``:
  what a method compresses across the islands."""
  return [leaf_layout(tuple(s), shards).shard_shape for s in shapes]


def _is_layout(x) -> bool:
  return isinstance(x, LeafLayout)


@dataclasses.dataclass(frozen=True)
class ParamLayout:
  """The layouts of a parameter tree over the fast axis ``axis`` of ``shards`` devices.

  Attributes:
    leaves: a tree shaped like the parameters with a :class:`LeafLayout` per leaf.
    axis: the fast axis's name.
    shards: its size.
    per_island: the parameters carry a leading row per island (a local-update method), sharded
      over ``island_axis``.
    island_axis: the slow axis's name.
  """
  leaves: Any
  axis: Hashable
  shards: int
  per_island: bool = False
  island_axis: Hashable | None = None

  @classmethod
  def of(cls, params: chex.ArrayTree, axis: Hashable, shards: int, *, per_island: bool = False,
         island_axis: Hashable | None = None) -> "ParamLayout":
    """The layout of ``params`` (arrays or ``ShapeDtypeStruct``s, natural shapes)."""
    leaves = jax.tree.map(lambda x: leaf_layout(jnp.shape(x), shards), params)
    return cls(leaves, axis, shards, per_island, island_axis)

  def _map(self, fn, *trees):
    return jax.tree.map(fn, self.leaves, *trees, is_leaf=_is_layout)

  @property
  def specs(self) -> chex.ArrayTree:
    """The stored parameters' ``PartitionSpec``s."""
    leading = (self.island_axis,) if self.per_island else ()
    return self._map(lambda l: l.spec(self.axis, leading))

  @property
  def shard_specs(self) -> chex.ArrayTree:
    """The specs of the stored parameters without a per-island row (what ``init`` takes)."""
    return self._map(lambda l: l.spec(self.axis))

  def to_stored(self, params: chex.ArrayTree, islands: int | None = None) -> chex.ArrayTree:
    """Natural parameters -> stored ones (with ``per_island`` and ``islands``, copied to one
    row per island)."""
    stored = self._map(lambda l, x: l.to_stored(x), params)
    if not self.per_island or islands is None:
      return stored
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (islands,) + x.shape), stored)

  def to_natural(self, stored: chex.ArrayTree) -> chex.ArrayTree:
    """Stored parameters without a per-island row -> natural ones."""
    return self._map(lambda l, x: l.to_natural(x), stored)

  def rows_to_natural(self, rows: chex.ArrayTree) -> chex.ArrayTree:
    """A parameter-shaped state tree laid out in rows over the fast axis -> natural."""
    return self._map(lambda l, x: l.rows_to_natural(x), rows)

  def shard_shapes(self, params: chex.ArrayTree) -> chex.ArrayTree:
    """``ShapeDtypeStruct``s of the shard one device holds (without a per-island row)."""
    return self._map(lambda l, x: jax.ShapeDtypeStruct(l.shard_shape, jnp.result_type(x)),
                     params)

  def padding_zeroed(self, inner: optax.GradientTransformation
                     ) -> optax.GradientTransformationExtraArgs:
    """``inner`` (an optimizer, run on one device's shards inside ``shard_map``) with the
    padding zeroed in the updates it takes and the parameters it reads.

    The padding is no part of the model, but it need not stay zero: a compressor's decoding
    may put values there (a sign compressor sends a sign for every entry, zeros too), and a
    method's update may land them on the parameters. A transformation that reads a whole
    layer's norm over the fast axis (``optimizers.lamb``/``lars`` with ``shard_axis``) must
    not count them.
    """
    zeroed = lambda tree: self._map(lambda l, x: l.padding_zeroed(x, self.axis), tree)
    inner = optax.with_extra_args_support(inner)

    def update_fn(updates, state, params=None, **extra_args):
      params = None if params is None else zeroed(params)
      return inner.update(zeroed(updates), state, params, **extra_args)

    return optax.GradientTransformationExtraArgs(inner.init, update_fn)

  def gather(self, shards: chex.ArrayTree) -> chex.ArrayTree:
    """Inside ``shard_map``: each device's shards -> the natural parameters, all-gathered over
    the fast axis (autodiff makes the gradient's reduce-scatter of it)."""
    def one(layout, x):
      whole = jax.lax.all_gather(x, self.axis, axis=layout.dim or 0, tiled=True)
      return layout.to_natural(whole)
    return self._map(one, shards)


def state_bytes_per_device(tree: chex.ArrayTree) -> int:
  """Bytes one device holds of ``tree`` (arrays or sharded ``ShapeDtypeStruct``s): the largest
  over devices of the sum of its shards' sizes (an unsharded leaf counts whole)."""
  per_device: dict[Any, int] = {}
  total_unplaced = 0
  for leaf in jax.tree.leaves(tree):
    shape, dtype = jnp.shape(leaf), jnp.result_type(leaf)
    sharding = getattr(leaf, "sharding", None)
    if sharding is None:
      total_unplaced += math.prod(shape) * dtype.itemsize
      continue
    shard = math.prod(sharding.shard_shape(shape)) * dtype.itemsize
    for device in sharding.device_set:
      per_device[device] = per_device.get(device, 0) + shard
  return max(per_device.values(), default=0) + total_unplaced
