"""Mesh-axis helpers shared by every collective in the package.

An ``axis_name`` is one mesh-axis name, a tuple of names (the collective then spans their
product, ranks row-major over the tuple), or ``None`` (no collective: compress and decode
locally). These helpers turn an unbound name into an error that lists the axes that *are* bound,
at trace time, before XLA compiles anything.

Simulated workers: a tuple may mix a ``shard_map`` mesh axis with an axis bound by ``jax.vmap``
(``("data", "worker")``: several workers per device, :mod:`compressors.parallel.data_parallel` and
the runner's ``workers_per_device``). JAX's ``psum``, ``pmax``, ``all_to_all``, ``axis_index`` and
``axis_size`` take such a tuple; :func:`all_gather`, :func:`all_gather_invariant`,
:func:`ppermute` and :func:`psum_scatter` here do the rest, with the same values as on as many
devices: the all-gather one axis at a time, the permutation and the reduce-scatter from an
all-gather and a psum (the simulation computes values; the bytes of the equivalent program on
real devices are read from that program).
"""

from collections.abc import Hashable
import functools
import inspect
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

AxisName = Hashable | tuple[Hashable, ...] | None


def as_tuple(axis_name: AxisName) -> tuple[Hashable, ...]:
  """Returns ``axis_name`` as a tuple of names (empty for ``None``)."""
  if axis_name is None:
    return ()
  if isinstance(axis_name, tuple):
    return axis_name
  return (axis_name,)


def bound_axes() -> tuple[Hashable, ...]:
  """Names of the mesh axes bound where this is traced (shard_map or pmap)."""
  try:
    return tuple(jax.sharding.get_abstract_mesh().axis_names)
  except Exception:  # pylint: disable=broad-except  # no mesh context at all
    return ()


def is_bound(axis_name: AxisName) -> bool:
  """Whether every axis of ``axis_name`` (at least one) is bound here: by ``shard_map``,
  ``pmap`` or ``vmap(..., axis_name=...)``."""
  try:
    for name in as_tuple(axis_name):
      jax.lax.axis_size(name)
  except NameError:
    return False
  return bool(as_tuple(axis_name))


def num_workers(axis_name: AxisName, *, caller: str = "compress") -> int:
  """Number of workers along ``axis_name``; a clear error when it is not bound.

  Args:
    axis_name: a mesh-axis name, a tuple of names, or None (one worker).
    caller: the public function named in the error message.

  Returns:
    The static product of the sizes of the named axes.

  Raises:
    NameError: an axis is not bound here; the message lists those that are.
  """
  size = 1
  for name in as_tuple(axis_name):
    try:
      size *= jax.lax.axis_size(name)
    except NameError:
      bound = bound_axes()
      where = (f"the bound axes are {list(bound)}" if bound else
               "no mesh axis is bound here: call update() inside jax.shard_map or jax.pmap")
      raise NameError(
          f"{caller}: axis_name={axis_name!r} names axis {name!r}, which is not bound; {where}. "
          "Pass the mesh axis over which workers hold different gradients, or axis_name=None "
          "to compress without a collective.") from None
  return size


def worker_index(axis_name: AxisName) -> Any:
  """This worker's index along ``axis_name`` (0 when there is no axis)."""
  if axis_name is None or as_tuple(axis_name) == ():
    return 0
  return jax.lax.axis_index(axis_name)


def _varying_axes(x: Any) -> frozenset:
  manual = getattr(jax.typeof(x), "manual_axis_type", None)
  return frozenset(getattr(manual, "varying", ()))


def replication_checked(axis_name: AxisName) -> bool:
  """Whether shard_map tracks which values vary across ``axis_name`` (``check_vma=True``)."""
  names = as_tuple(axis_name)
  return bool(names) and set(names) <= _varying_axes(jax.lax.axis_index(names))


def is_varying(x: Any, axis_name: AxisName) -> bool:
  """Whether ``x`` is typed as differing across every axis of ``axis_name``."""
  return set(as_tuple(axis_name)) <= _varying_axes(x)


def check_per_worker(tree: Any, axis_name: AxisName, caller: str) -> None:
  """Refuses leaves of ``tree`` (gradients) typed as identical on every worker of ``axis_name``:
  inside ``shard_map``, ``jax.grad`` with respect to replicated parameters has already summed
  them over the workers (a hidden dense all-reduce), so nothing is left to compress, and a sum
  of them would count every worker's gradient once per worker. Untyped contexts (``vmap``,
  ``pmap``, ``check_vma=False``) pass.

  Raises:
    ValueError: naming ``caller``, the leaf and the axes, and how to differentiate instead.
  """
  names = as_tuple(axis_name)
  if not names or not replication_checked(names):
    return
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    if not is_varying(leaf, names):
      raise ValueError(
          f"{caller}: gradient leaf {jax.tree_util.keystr(path) or '(the gradient)'} is typed as "
          f"identical on every worker of axes {names}: inside shard_map, jax.grad with respect "
          "to replicated parameters has already summed it over the workers (a hidden dense "
          "all-reduce). Differentiate with respect to a per-worker copy: grads = "
          f"jax.grad(loss)(jax.lax.pcast(params, {names!r}, to='varying'), batch)")


def _invariant_gather() -> Any:
  """The all-gather whose result JAX types as identical on every worker, for this JAX.

  JAX 0.11 and later spell it ``lax.all_gather(..., to="invarying")``; 0.10 keeps it private as
  ``jax._src.lax.parallel.all_gather_invariant``.
  """
  if "to" in inspect.signature(jax.lax.all_gather).parameters:
    return functools.partial(jax.lax.all_gather, to="invarying")
  from jax._src.lax.parallel import all_gather_invariant  # pylint: disable=g-import-not-at-top
  return all_gather_invariant


_ALL_GATHER_INVARIANT = _invariant_gather()


def all_gather_invariant(x: Any, axis_name: AxisName) -> Any:
  """``lax.all_gather`` whose result is typed as identical on every worker.

  Under ``shard_map``'s replication checking, ``lax.all_gather`` returns a value typed as varying
  across the axis although every worker holds the same bits; the decoded mean built from it
  could then not leave ``shard_map`` as replicated (``P()``), and a loop that accumulates it
  into an invariant carry would change the carry's type.
  """
  return all_gather(x, axis_name, invariant=True)


def all_gather(x: Any, axis_name: AxisName, *, invariant: bool = False) -> Any:
  """Every worker's ``x`` stacked on a new leading axis, ranks row-major over ``axis_name``
  (which may mix mesh and vmapped axes); ``invariant``: typed identical on every worker."""
  names = as_tuple(axis_name)
  if not _mixed(names):
    return _ALL_GATHER_INVARIANT(x, axis_name) if invariant else jax.lax.all_gather(x, axis_name)
  for name in reversed(names):  # the last axis innermost: row-major over the tuple
    mesh_axis = name in bound_axes()
    x = _ALL_GATHER_INVARIANT(x, name) if invariant and mesh_axis else jax.lax.all_gather(x, name)
  return x.reshape((-1,) + x.shape[len(names):])


def ppermute(x: Any, axis_name: AxisName, perm) -> Any:
  """``lax.ppermute`` over ``axis_name`` (which may mix mesh and vmapped axes): worker ``t`` of
  each pair ``(s, t)`` receives ``x`` of worker ``s``; a worker no pair names receives zeros."""
  names = as_tuple(axis_name)
  if not _mixed(names):
    return jax.lax.ppermute(x, axis_name, perm)
  sources = np.full(num_workers(names, caller="ppermute"), -1)
  for source, target in perm:
    sources[target] = source
  source = jnp.asarray(sources)[worker_index(names)]
  everyone = all_gather(x, names)
  return jnp.where(source >= 0, everyone[jnp.maximum(source, 0)], jnp.zeros_like(x))


def psum_scatter(x: Any, axis_name: AxisName) -> Any:
  """The sum over ``axis_name`` of ``x``, of which each worker keeps its ``1/n`` of the leading
  axis (``lax.psum_scatter(..., scatter_dimension=0, tiled=True)``); the axes may mix mesh and
  vmapped ones."""
  names = as_tuple(axis_name)
  if not _mixed(names):
    return jax.lax.psum_scatter(x, axis_name, scatter_dimension=0, tiled=True)
  shard = x.shape[0] // num_workers(names, caller="psum_scatter")
  return jax.lax.dynamic_slice_in_dim(jax.lax.psum(x, names), worker_index(names) * shard, shard)


def _mixed(names: tuple) -> bool:
  """Whether ``names`` mixes a ``shard_map`` mesh axis with an axis bound otherwise (vmap)."""
  mesh = set(bound_axes())
  return bool(set(names) & mesh) and not set(names) <= mesh
