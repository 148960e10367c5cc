"""A cheap check that every replica holds bit-identical parameters.

Each device reduces its parameters to a position-weighted 32-bit checksum of their bits (one
word per leaf); a min and a max all-reduce of those words (8 bytes per leaf) tell whether any
device differs. Bits, not values: -0.0 and 0.0, or two NaN payloads, count as different, as
they would diverge later.
"""

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from compressors.network import axes
from compressors.parallel import workers as workers_lib


def checksum(tree: Any) -> jax.Array:
  """``uint32[num_leaves]``: a position-weighted checksum of each leaf's bits."""
  words = []
  for leaf in jax.tree.leaves(tree):
    x = jnp.asarray(leaf).reshape(-1)
    bits = _as_uint32(x)
    weights = (jnp.arange(bits.size, dtype=jnp.uint32) * jnp.uint32(2654435761)) | jnp.uint32(1)
    words.append(jnp.sum(bits * weights, dtype=jnp.uint32))
  return jnp.stack(words) if words else jnp.zeros((0,), jnp.uint32)


def replicas_agree(tree: Any, axis_name: axes.AxisName) -> jax.Array:
  """Whether every worker along ``axis_name`` holds the same bits (a bool scalar, everywhere).

  Call it inside ``shard_map``/``pmap``. Inside ``shard_map`` the parameters are typed as
  replicated, so the checksum is first marked per-worker: otherwise JAX would know the answer
  and skip the collective.
  """
  words = checksum(tree)
  names = axes.as_tuple(axis_name)
  if axes.replication_checked(names) and not axes.is_varying(words, names):
    words = jax.lax.pcast(words, names, to="varying")
  return jnp.all(jax.lax.pmax(words, names) == jax.lax.pmin(words, names))


def replicas_agree_program(layout: workers_lib.Workers, per_worker_params: bool,
                           params_spec: Any = P()) -> Callable[[Any], jax.Array]:
  """The jitted replica check of a data-parallel step on ``layout``: ``params -> bool[]``, the
  parameters bit-identical on every device (replicated parameters), or every worker's row the
  same (per-worker parameters, as after a synchronising step). With islands (parameters
  sharded over ``layout.shard_axis``, laid out by ``params_spec``) each shard is compared
  across the islands; leaves sharded over the workers' axis (``params_spec`` other than ``P()``,
  :mod:`compressors.parallel.sharded_params`) are left out."""
  if layout.shard_axis is not None:
    def shard_agrees(params):
      if per_worker_params:
        params = jax.tree.map(lambda x: x[0], params)
      agree = replicas_agree(params, layout.axis_name).astype(jnp.int32)
      return jax.lax.pmin(agree, layout.shard_axis) > 0
    return jax.jit(jax.shard_map(shard_agrees, mesh=layout.mesh, in_specs=(params_spec,),
                                 out_specs=P()))
  if not per_worker_params:
    def replicated(params):  # sharded leaves (embedding tables) differ by design: left out
      if params_spec == P():
        return params
      return [x for x, s in zip(jax.tree.leaves(params),
                                jax.tree.leaves(params_spec, is_leaf=_is_spec)) if s == P()]
    return jax.jit(jax.shard_map(
        lambda params: replicas_agree(replicated(params), layout.device_axes),
        mesh=layout.mesh, in_specs=(params_spec,), out_specs=P()))
  # Per-worker parameters: every worker's row against every other's (a checksum per leaf).
  each = layout.each(lambda params: replicas_agree(params, layout.axis_name), 0, 0)
  rows = layout.shard_map(each, in_specs=layout.spec, out_specs=layout.spec)
  return jax.jit(lambda params: jnp.all(rows(params)))


def _is_spec(x) -> bool:
  return isinstance(x, P)


def _as_uint32(x: jax.Array) -> jax.Array:
  if x.dtype.itemsize == 4:
    return jax.lax.bitcast_convert_type(x, jnp.uint32)
  if x.dtype.itemsize == 8:
    halves = jax.lax.bitcast_convert_type(x, jnp.uint32)  # [..., 2]
    return (halves[..., 0] ^ (halves[..., 1] * jnp.uint32(0x9E3779B9))).reshape(-1)
  return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}")).astype(
      jnp.uint32)
