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
program: state and checkpoints are the same arrays in either.
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
  """
  mesh: jax.sharding.Mesh
  axis_name: axes.AxisName
  per_device: int = 1

  @classmethod
  def on(cls, mesh: jax.sharding.Mesh, axis_name: axes.AxisName = "data",
         per_device: int = 1) -> "Workers":
    """:class:`Workers` of ``mesh``, checked.

    Args:
      mesh: the devices.
      axis_name: the axes the collectives span; with ``per_device > 1`` its last name is the
        simulated axis, which must not be a mesh axis (e.g. ``("data", "worker")``).
      per_device: workers on each device (>= 1).

    Raises:
      ValueError: ``per_device`` is not a positive int, or ``axis_name`` does not name the mesh's
        axes (and, with ``per_device > 1``, a last axis outside the mesh).
    """
    if isinstance(per_device, bool) or not isinstance(per_device, int) or per_device < 1:
      raise ValueError(f"workers_per_device={per_device!r} must be an int >= 1")
    names = axes.as_tuple(axis_name)
    in_mesh = [a in mesh.axis_names for a in names]
    simulated = per_device > 1
    if not names or not all(in_mesh[:len(names) - simulated]) or (simulated and in_mesh[-1]) or (
        simulated and len(names) < 2):
      wanted = ("mesh axes, then one more name for the simulated workers' axis, e.g. "
                f"{(mesh.axis_names[0], 'worker')!r}" if simulated else "mesh axes")
      raise ValueError(f"axis_name={axis_name!r} with workers_per_device={per_device}: must be "
                       f"{wanted}; the mesh's axes are {tuple(mesh.axis_names)}")
    return cls(mesh, axis_name, per_device)

  @property
  def simulated_axis(self) -> Hashable | None:
    """The ``vmap``-bound axis of ``axis_name``, or None with one worker per device."""
    return axes.as_tuple(self.axis_name)[-1] if self.per_device > 1 else None

  @property
  def device_axes(self) -> tuple[Hashable, ...]:
    """The mesh axes of ``axis_name``: devices along them hold different workers."""
    return tuple(a for a in axes.as_tuple(self.axis_name) if a != self.simulated_axis)

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
    :func:`compressors.state_specs` gives them) -> specs on :attr:`mesh`."""
    return jax.tree.map(lambda s: P() if s == P() else self.spec, specs,
                        is_leaf=lambda s: isinstance(s, P))

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
    copy is typed as varying. Simulated workers (``vmap``) differentiate each their own loss.
    """
    if self.per_device > 1:
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
    per device only)."""
    return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=self.per_device == 1)

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
