"""Where a data-parallel step's workers run: one per device, or several per device (simulated).

A study of compression needs many workers at a real model size, and one accelerator holds the
memory of 8-64 workers of a ResNet-20 or a small transformer. :class:`Workers` runs
``per_device`` workers on every device of a mesh: ``jax.shard_map`` over the mesh axes and
``jax.vmap`` over the last axis of ``axis_name`` (the simulated axis), so that the collectives of a
transformation built with that ``axis_name`` span devices x workers
(:mod:`compressors.network.axes`), ranks row-major: worker ``w`` of device ``d`` is rank
``d * per_device + w``. Each worker has its own batch shard, its own state and its own random fold,
exactly as on :attr:`Workers.count` devices; the values equal those devices' to the reassociation of
sums (a collective sums the workers of one device, then the devices; floating-point sums then round
differently, by a few units of the last place; a payload all-reduced in float16 rounds in float16).

Nothing travels between the workers of one device. What a step sends per worker is what it
sends on :attr:`Workers.count` devices, read from the program compiled for them
(:meth:`Workers.equivalent_mesh`: the mesh's axes and the simulated axis as a mesh of that many
devices, compiled, never run; the CPU backend's devices when the accelerator has fewer).

Layout: an array that differs between workers has one row per worker, sharded over the mesh axes
of ``axis_name`` (``per_device`` rows on each device), which is the layout of the equivalent
program: state and checkpoints are the same arrays in either. So is an array sharded over the
workers (a block per worker: embedding tables, :mod:`compressors.parallel.sharded_params`), each
device holding its workers' blocks one after the other (:meth:`Workers.on_mesh`).

Islands (``shard_axis``): on a mesh ``("islands", "fsdp")`` the transformation's collectives span
the slow axis ``axis_name="islands"`` while every device is a worker with its own batch shard,
and the parameters are sharded over the fast axis inside each island
(:mod:`compressors.parallel.fsdp`). A worker's rank is its position on both axes, islands
first, so batch shards and random folds are those of plain data parallelism on as many devices.
"""

import math
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

import chex
import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from compressors.network import axes



class Workers(NamedTuple):
  """The workers of a data-parallel step (see the module docstring); build with :meth:`Workers.on`.

  Attributes:
    mesh: the devices.
    axis_name: the axes the collectives span: mesh axes, then, with ``per_device > 1``, the
      simulated axis (bound by ``vmap``); what the transformation is built with.
    per_device: workers on each device.
    shard_axis: the mesh axis the parameters are sharded over inside an island (islands), or
      None: every worker holds the whole model.
  """
  mesh: jax.sharding.Mesh
  axis_name: axes.AxisName
  per_device: int = 1
  shard_axis: Hashable | None = None

  @classmethod
  def on(cls, mesh: jax.sharding.Mesh, axis_name: axes.AxisName = "data",
         per_device: int = 1, shard_axis: Hashable | None = None) -> "Workers":
    """:class:`Workers` of ``mesh``, checked.

    Args:
      mesh: the devices.
      axis_name: the axes the collectives span; with ``per_device > 1`` its last name is the
        simulated axis, which must not be a mesh axis (e.g. ``("data", "worker")``).
      per_device: workers on each device (>= 1).
      shard_axis: a mesh axis outside ``axis_name`` over which the parameters are sharded
        inside each island (the module docstring); needs ``per_device == 1``.

    Raises:
      ValueError: ``per_device`` is not a positive int, ``axis_name`` does not name the mesh's
        axes (and, with ``per_device > 1``, a last axis outside the mesh), or ``shard_axis`` is
        not a mesh axis outside ``axis_name`` or comes with simulated workers.
    """
    if isinstance(per_device, bool) or not isinstance(per_device, int) or per_device < 1:
      raise ValueError(f"workers_per_device={per_device!r} must be an int >= 1")
    names = axes.as_tuple(axis_name)
    if shard_axis is not None and (shard_axis not in mesh.axis_names or shard_axis in names
                                   or per_device != 1):
      raise ValueError(
          f"shard_axis={shard_axis!r} with axis_name={axis_name!r} and workers_per_device="
          f"{per_device}: must be a mesh axis outside axis_name, with one worker per device; "
          f"the mesh's axes are {tuple(mesh.axis_names)}")
    in_mesh = [a in mesh.axis_names for a in names]
    simulated = per_device > 1
    if not names or not all(in_mesh[:len(names) - simulated]) or (simulated and in_mesh[-1]) or (
        simulated and len(names) < 2):
      wanted = ("mesh axes, then one more name for the simulated workers' axis, e.g. "
                f"{(mesh.axis_names[0], 'worker')!r}" if simulated else "mesh axes")
      raise ValueError(f"axis_name={axis_name!r} with workers_per_device={per_device}: must be "
                       f"{wanted}; the mesh's axes are {tuple(mesh.axis_names)}")
    return cls(mesh, axis_name, per_device, shard_axis)

  @property
  def simulated_axis(self) -> Hashable | None:
    """The ``vmap``-bound axis of ``axis_name``, or None with one worker per device."""
    return axes.as_tuple(self.axis_name)[-1] if self.per_device > 1 else None

  @property
  def device_axes(self) -> tuple[Hashable, ...]:
    """The mesh axes along which devices hold different workers: those of ``axis_name``, then
    ``shard_axis``."""
    named = tuple(a for a in axes.as_tuple(self.axis_name) if a != self.simulated_axis)
    return named + ((self.shard_axis,) if self.shard_axis is not None else ())

  @property
  def worker_axes(self) -> axes.AxisName:
    """Every axis workers differ along (the mesh's and the simulated one): a worker's rank and
    the metrics' means span them."""
    if self.shard_axis is None:
      return self.axis_name
    return self.device_axes

  @property
  def shards(self) -> int:
    """Devices each parameter is sharded over (1 without ``shard_axis``)."""
    return 1 if self.shard_axis is None else self.mesh.shape[self.shard_axis]

  @property
  def count(self) -> int:
    """Workers in all."""
    return math.prod(self.mesh.shape[a] for a in self.device_axes) * self.per_device

  @property
  def spec(self) -> P:
    """The ``PartitionSpec`` on :attr:`mesh` of an array with one row per worker."""
    return P(self.device_axes if len(self.device_axes) > 1 else self.device_axes[0])

  def layout(self, specs: chex.ArrayTree) -> chex.ArrayTree:
    """Specs of the equivalent program (``P(axis_name)`` per worker, ``P()`` replicated, as
    :func:`compressors.state_specs` gives them) -> specs on :attr:`mesh` (with ``shard_axis``
    they are already)."""
    if self.shard_axis is not None:
      return specs
    return jax.tree.map(lambda s: P() if s == P() else self.spec, specs,
                        is_leaf=lambda s: isinstance(s, P))

  def on_mesh(self, specs: chex.ArrayTree) -> chex.ArrayTree:
    """Specs over ``axis_name`` (the equivalent program's: a block per worker, e.g. an
    embedding bank's ``P(("data", "worker"))``) -> specs on :attr:`mesh`, the simulated axis
    dropped: its workers' blocks one after the other on their device (ranks row-major, the
    simulated axis last)."""
    if self.per_device == 1:
      return specs
    def kept(names):
      names = tuple(a for a in axes.as_tuple(names) if a != self.simulated_axis)
      return names[0] if len(names) == 1 else names or None
    return jax.tree.map(lambda s: P(*map(kept, s)), specs, is_leaf=lambda s: isinstance(s, P))

  def equivalent_mesh(self, *, abstract: bool = False) -> Any:
    """The mesh of one worker per device that this layout simulates: the mesh's axes, then the
    simulated axis, of :attr:`count` devices (``abstract``: a ``jax.sharding.AbstractMesh``,
    enough to trace). Its devices: the mesh's platform's, or the CPU's where that platform has
    too few (the program is compiled to read its bytes, never run).

    Raises:
      ValueError: no platform has enough devices (the message says how to expose them).
    """
    if self.per_device == 1:
      return self.mesh.abstract_mesh if abstract else self.mesh
    names = tuple(self.mesh.axis_names) + (self.simulated_axis,)
    shape = tuple(self.mesh.devices.shape) + (self.per_device,)
    types = (jax.sharding.AxisType.Auto,) * len(names)
    if abstract:
      return jax.sharding.AbstractMesh(shape, names, axis_types=types)
    total = math.prod(shape)
    for devices in (jax.devices(self.mesh.devices.flat[0].platform), jax.devices("cpu")):
      if len(devices) >= total:
        return jax.sharding.Mesh(np.asarray(devices[:total]).reshape(shape), names,
                                 axis_types=types)
    raise ValueError(
        f"the bytes of {total} workers are read from a program compiled for {total} devices, but "
        f"the CPU backend exposes {len(jax.devices('cpu'))}: call "
        f"jax.config.update('jax_num_cpu_devices', {total}) before JAX's first computation "
        "(experiments.run does so from the config)")

  def own_copy(self, params: chex.ArrayTree) -> chex.ArrayTree:
    """A per-worker copy of replicated ``params``, to differentiate each worker's own loss.

    Under ``shard_map``'s replication checking, autodiff with respect to a replicated value sums
    the derivative over the workers (a hidden dense all-reduce before any compressor runs): the
    copy is typed as varying. Simulated workers (``vmap``) and islands (untyped) differentiate
    each their own loss.
    """
    if self.per_device > 1 or self.shard_axis is not None:
      return params
    return jax.lax.pcast(params, axes.as_tuple(self.axis_name), to="varying")

  def each(self, fn: Callable[..., Any], in_axes: Any, out_axes: Any) -> Callable[..., Any]:
    """``fn`` of one worker -> the function of one device's workers, to run inside
    ``shard_map``.

    ``in_axes``/``out_axes`` (prefix trees of the arguments' and results' structure): 0 for a
    value with one row per worker (a block of ``per_device`` rows on the device), None for one
    the same on every worker. With one worker per device the row is indexed away and restored;
    otherwise ``fn`` runs under ``jax.vmap`` with the simulated axis bound.
    """
    if self.per_device > 1:
      return jax.vmap(fn, in_axes=in_axes, out_axes=out_axes, axis_name=self.simulated_axis,
                      axis_size=self.per_device)

    def one_worker(*args):
      args = jax.tree.map(_row_away, jax.tree.broadcast(in_axes, args, is_leaf=_is_none), args,
                          is_leaf=_is_none)
      out = fn(*args)
      return jax.tree.map(_row_back, jax.tree.broadcast(out_axes, out, is_leaf=_is_none), out,
                          is_leaf=_is_none)
    return one_worker

  def shard_map(self, fn: Callable[..., Any], in_specs: Any, out_specs: Any) -> Callable[..., Any]:
    """``jax.shard_map`` of ``fn`` over :attr:`mesh` (simulated workers are untyped:
    ``shard_map``'s replication types know only mesh axes, so they are checked with one worker
    per device only; islands are untyped too, because the methods' code types its values
    for one exchange axis, and a value made per shard would break it: there the replica check,
    :func:`compressors.parallel.drift.replicas_agree_program`, proves agreement at run time)."""
    return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=self.per_device == 1 and self.shard_axis is None)

  def rows(self, batch: chex.ArrayTree) -> chex.ArrayTree:
    """One device's share of ``batch`` -> one share per worker along a new leading axis (one
    worker: the leading axis of size one :meth:`each` indexes away)."""
    return jax.tree.map(lambda x: x.reshape((self.per_device, -1) + x.shape[1:]), batch)


def per_worker_axes(specs: chex.ArrayTree) -> chex.ArrayTree:
  """``in_axes``/``out_axes`` for :meth:`Workers.each` from specs: 0 per worker, None
  replicated."""
  return jax.tree.map(lambda s: None if s == P() else 0, specs, is_leaf=lambda s: isinstance(s, P))


def _is_none(x) -> bool:
  return x is None


def _row_away(axis, x):
  return x if axis is None else x[0]


def _row_back(axis, x):
  return x if axis is None else x[None]
