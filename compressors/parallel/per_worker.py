"""Per-worker state under ``shard_map``: which leaves differ between workers, and their layout.

Error-feedback residuals (and every other memory a worker builds from its own gradient) differ
from worker to worker; the rest of the optimizer state (step counters, the moments of an
optimizer that follows the compressor and only ever sees the identical mean) is replicated.
Under ``jax.shard_map`` the per-worker leaves travel as global arrays with one row per worker and
spec ``P(axis)``, the replicated ones with spec ``P()``, so that JAX's replication checking proves
the replicated part really is identical.

Which is which is read from what the update *computes*, not from known state types: a leaf
computed from a per-worker value is per-worker. :func:`state_specs` traces one ``update`` under
``shard_map`` and follows the data through the traced program: the gradient and the step's extra
arguments are per worker, so is whatever is computed from them, except through a collective that
makes its result the same everywhere (``psum``, ``pmax``, ``pmin``, all-gather); ``axis_index``,
``ppermute``, ``all_to_all`` and reduce-scatter make theirs per worker (as JAX types them). A state
leaf that comes out per-worker goes in per-worker at the
next step, until nothing changes (the least fixed point: a step counter that only counts stays
replicated). So any optax wrapper (``MultiSteps``, ``apply_if_finite``, ``inject_hyperparams``,
``masked``) and any chain order work: an optimizer placed before the compressor sees each
worker's own gradient, and its moments are per worker. Under ``jax.pmap`` every leaf already has
a leading device axis and none of this is needed.
"""

from typing import Any

import chex
import jax
import jax.extend
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from compressors.network import axes



def add_device_axis(state: chex.ArrayTree, specs: chex.ArrayTree) -> chex.ArrayTree:
  """Gives every per-worker leaf (spec not ``P()``) a leading axis of size one, to leave
  ``shard_map``; ``specs`` is :func:`state_specs`'s."""
  return jax.tree.map(lambda x, spec: x if spec == P() else x[None], state, specs)


def drop_device_axis(state: chex.ArrayTree, specs: chex.ArrayTree) -> chex.ArrayTree:
  """Removes the leading axis :func:`add_device_axis` added (inside ``shard_map``)."""
  return jax.tree.map(lambda x, spec: x if spec == P() else x[0], state, specs)


def state_specs(tx, params: chex.ArrayTree, mesh: jax.sharding.Mesh, axis_name: axes.AxisName, *,
                check_updates: bool = True, per_worker_params: bool = False,
                options: dict[str, Any] | None = None, shard_axis: axes.AxisName = None,
                **extra_args) -> chex.ArrayTree:
  """``PartitionSpec``s of ``tx``'s state as :func:`add_device_axis` lays it out.

  Args:
    tx: the gradient transformation (e.g. an ``optax.chain`` holding ``compress``).
    params: parameters (or ``jax.ShapeDtypeStruct``s) to initialise it for.
    mesh: the mesh ``shard_map`` runs on.
    axis_name: the axis (or tuple of axes) workers differ along.
    check_updates: raise when ``tx``'s updates differ between workers (see Raises). Explicit
      all-reduce schedules (``compress(..., schedule="ring")``) come out of ``ppermute``, which
      JAX types as per-worker although every worker holds the same bits: with those, run
      ``shard_map(..., check_vma=False)`` and pass False.
    per_worker_params: the parameters differ between workers (a local-update method between
      synchronisations); then the updates may too (``check_updates`` does not apply).
    options: static keyword arguments of ``tx.update`` (a step kind's options), passed as they
      are.
    shard_axis: a mesh axis over which the parameters are sharded inside each worker's group
      (:mod:`compressors.parallel.fsdp`: ``params`` are then one device's shard); the gradient
      and every leaf built from the parameters vary over it too, and a leaf is laid out with
      one row per device along the axes it varies over.
    **extra_args: the extra arguments the training step passes to ``tx.update`` on some steps
      (e.g. ``curvature=`` shaped like the parameters; values or ``ShapeDtypeStruct``s): a
      state leaf that only they make per-worker is found only if they are given.

  Returns:
    A pytree of specs shaped like the state: ``P(axis_name)`` on per-worker leaves, ``P()``
    elsewhere (with ``shard_axis``: ``P(axes)`` of the mesh axes the leaf varies over, in the
    mesh's order); use it as ``in_specs``/``out_specs`` for the state, and with
    :func:`add_device_axis`/:func:`drop_device_axis`.

  Raises:
    ValueError: (``check_updates``) the updates differ between workers, so the replicas would
      drift apart: a transformation that decides from each worker's own gradient wraps the
      compressor, or no compressor produces the updates; the message says which order works.
  """
  names = frozenset(axes.as_tuple(axis_name))
  sharded = frozenset(axes.as_tuple(shard_axis))
  params, extra_args = jax.tree.map(  # shapes and dtypes: whatever mesh the arrays are on
      lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), (params, extra_args))
  state = jax.eval_shape(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=P(),
                                       check_vma=False), params)
  body, layout = _traced_update(tx, params, state, mesh, axis_name, extra_args, options or {})
  per_worker = [frozenset()] * layout["state"]
  # The body's first inputs are constants the trace hoisted, then the arguments in order; its
  # outputs are the updates, then the new state. A value's mark is the set of axes it varies
  # over (as JAX types it); a state leaf varying over any is per-worker.
  constants = len(body.invars) - layout["params"] - layout["state"] - layout["varying"]
  every = names | sharded
  while True:
    sources = ([frozenset()] * constants
               + [every if per_worker_params else sharded] * layout["params"]
               + per_worker + [every] * layout["varying"])
    found = _varying_axes(body, sources)
    updates, found = found[:layout["updates"]], found[layout["updates"]:]
    if found == per_worker:
      break
    per_worker = [a | b for a, b in zip(per_worker, found)]
  if check_updates and not per_worker_params and any(u & names for u in updates):
    raise ValueError(
        "state_specs: the updates of this transformation differ between the workers of "
        f"{axis_name!r}, so the replicas would drift apart: the compressor (compress, "
        "tasc_compress), whose mean is the same everywhere, must produce what is applied. A "
        "transformation after it only sees that mean; one that decides from each worker's own "
        "gradient around it (optax.apply_if_finite) must go after it, or be "
        "compressors.skip_nonfinite, which decides for all workers at once. (With an explicit "
        "schedule, whose ppermute JAX types as per-worker, pass check_updates=False.)")
  return jax.tree.unflatten(jax.tree.structure(state),
                            [_spec(w, axis_name, mesh, bool(sharded)) for w in per_worker])


def _spec(varying: frozenset, axis_name: axes.AxisName, mesh, sharded: bool) -> P:
  """A state leaf's spec from the axes it varies over."""
  if not varying:
    return P()
  if not sharded:
    return P(axis_name)
  ordered = tuple(a for a in mesh.axis_names if a in varying)
  return P(ordered if len(ordered) > 1 else ordered[0])


def _traced_update(tx, params, state, mesh, axis_name, extra_args, options):
  """The jaxpr of one ``update`` inside ``shard_map`` (untyped: ``check_vma=False``, so whatever
  the state's leaves turn out to be, the trace goes through), and the counts of its inputs
  (parameters, state leaves, then the gradient and the extra arguments) and of its outputs'
  updates (the new state's leaves follow)."""
  def update(params, state, grads, extra_args):
    return jax.tree.map(lambda x: x[None], tx.update(grads, state, params, **extra_args,
                                                     **options))

  grads = jax.tree.map(lambda p: jax.ShapeDtypeStruct(jnp.shape(p), jnp.result_type(p)), params)
  outer = jax.make_jaxpr(jax.shard_map(update, mesh=mesh, in_specs=P(), out_specs=P(axis_name),
                                       check_vma=False))(params, state, grads, extra_args)
  (call,) = [e for e in outer.jaxpr.eqns if e.primitive.name == "shard_map"]
  layout = {"params": len(jax.tree.leaves(params)), "state": len(jax.tree.leaves(state)),
            "varying": len(jax.tree.leaves(grads)) + len(jax.tree.leaves(extra_args)),
            "updates": len(jax.tree.leaves(grads))}
  return call.params["jaxpr"], layout


def _varying_axes(jaxpr, sources: list[frozenset]) -> list[frozenset]:
  """The mesh axes each output of ``jaxpr`` varies over, given those of its inputs."""
  env = dict(zip(jaxpr.invars, sources))
  read = lambda v: (frozenset() if isinstance(v, jax.extend.core.Literal)
                    else env.get(v, frozenset()))
  for eqn in jaxpr.eqns:
    env.update(zip(eqn.outvars, _equation(eqn, [read(v) for v in eqn.invars])))
  return [read(v) for v in jaxpr.outvars]


# Collectives whose result is the same across the axes they span (an untyped trace does not
# tell the invariant all-gather from the plain one; both give every worker the same bits), and
# those JAX types as varying across them.
_SAME_ACROSS = ("psum", "psum_invariant", "pmax", "pmin", "all_gather", "all_gather_invariant")
_VARYING_ACROSS = ("axis_index", "ppermute", "all_to_all", "reduce_scatter", "psum_scatter")


def _union(sets) -> frozenset:
  return frozenset().union(*sets)


def _equation(eqn, inputs: list[frozenset]) -> list[frozenset]:
  """The axes each output of one equation varies over, given those of its inputs."""
  kind, count = eqn.primitive.name, len(eqn.outvars)
  spanned = eqn.params.get("axes", eqn.params.get("axis_name", ()))
  spanned = frozenset(spanned if isinstance(spanned, (tuple, list)) else (spanned,))
  if kind in _SAME_ACROSS:
    return [_union(inputs) - spanned] * count
  if kind in _VARYING_ACROSS:
    return [_union(inputs) | spanned] * count
  if kind == "cond":  # a predicate that varies makes every output vary
    branches = [_varying_axes(b.jaxpr, inputs[1:]) for b in eqn.params["branches"]]
    return [_union(outs) | inputs[0] for outs in zip(*branches)]
  if kind == "while":
    return _loop(eqn, inputs)
  if kind == "scan":
    return _scan(eqn, inputs)
  inner = [_open(p) for p in eqn.params.values() if _open(p) is not None]
  if len(inner) == 1 and len(inner[0].invars) == len(inputs):  # pjit, custom_jvp, remat, ...
    return _varying_axes(inner[0], inputs)
  return [_union(inputs)] * count


def _open(param):
  """The jaxpr of an equation's parameter, or None."""
  if isinstance(param, jax.extend.core.ClosedJaxpr):
    return param.jaxpr
  return param if isinstance(param, jax.extend.core.Jaxpr) else None


def _loop(eqn, inputs) -> list[frozenset]:
  """``while``: its carries to a fixed point; a varying condition makes every one vary."""
  cond_consts, body_consts = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
  carry = inputs[cond_consts + body_consts:]
  while True:
    new = _varying_axes(eqn.params["body_jaxpr"].jaxpr,
                        inputs[cond_consts:cond_consts + body_consts] + carry)
    merged = [a | b for a, b in zip(carry, new)]
    if merged == carry:
      break
    carry = merged
  condition = _union(_varying_axes(eqn.params["cond_jaxpr"].jaxpr,
                                   inputs[:cond_consts] + carry))
  return [c | condition for c in carry]


def _scan(eqn, inputs) -> list[frozenset]:
  """``scan``: its carries to a fixed point, then its stacked outputs. Where JAX does not name
  the carries (0.12 describes them otherwise), every output varies over what any input does."""
  if "num_carry" not in eqn.params:
    return [_union(inputs)] * len(eqn.outvars)
  consts, num_carry = eqn.params["num_consts"], eqn.params["num_carry"]
  carry, xs = inputs[consts:consts + num_carry], inputs[consts + num_carry:]
  while True:
    outs = _varying_axes(eqn.params["jaxpr"].jaxpr, inputs[:consts] + carry + xs)
    merged = [a | b for a, b in zip(carry, outs[:num_carry])]
    if merged == carry:
      return merged + outs[num_carry:]
    carry = merged
