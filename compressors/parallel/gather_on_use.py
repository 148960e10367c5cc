"""A loss of sharded parameters that gathers each parameter where it is used and frees it after.

Islands (:mod:`compressors.parallel.fsdp`) hold one shard of every parameter per device. All-
gathering every leaf before the loss would put the whole model on each device at once, and
autodiff would keep every gathered leaf alive until the backward pass used it: a device's peak
would hold the whole parameters, which islands exist to avoid. :func:`loss_on_use` runs the loss
as its jaxpr, one equation at a time; an equation that reads a parameter becomes a *block*:

* forward: the block waits for its other inputs (a data dependency: the compiler may not hoist
  the gather to the program's start), all-gathers its leaves over the fast axis, runs its
  equation, and drops the gathered leaves;
* backward (a ``custom_vjp``): the block waits for its output's cotangent, gathers its leaves
  again, differentiates its equation, and reduce-scatters the leaves' gradient back to shards
  (the transpose of the gather, as before).

So a device holds, besides its shards, the leaves of one block at a time: one layer's, not the
model's. The math is that of gathering everything first (the same gathers, the same equations);
only what stays alive, and so the peak memory, differs, at the price of a second gather of each
leaf in the backward pass (ZeRO-3's usual traffic: two gathers and a reduce-scatter). What a
parameter passes through before it meets the data (a cast, a transpose, ``p.mean()``) is
recomputed inside the block that consumes it, from the shards; a leaf read by several blocks
(a tied embedding) is gathered by each.

The blocks are reverse-mode only (``custom_vjp``): a step kind's per-step inputs that
differentiate the loss forward-over-reverse (TASC's curvature) gather the whole model instead
(:meth:`compressors.parallel.fsdp.ParamLayout.gather`).
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jex

from compressors.parallel import fsdp


def loss_on_use(loss_fn: Callable[..., Any], layout: fsdp.ParamLayout) -> Callable[..., Any]:
  """``loss_fn(natural params, *args)`` -> ``fn(shards, *args)`` with the same value and
  gradient, run inside ``shard_map`` with each device's shards (stored layout, without a
  per-island row); each leaf is gathered over ``layout.axis`` only in the blocks that read it
  (the module docstring)."""
  def on_use(shards, *args):
    leaves, treedef = jax.tree.flatten(shards)
    leaf_layouts = treedef.flatten_up_to(layout.leaves)
    natural = jax.tree.unflatten(treedef, [jax.ShapeDtypeStruct(l.shape, x.dtype)
                                           for l, x in zip(leaf_layouts, leaves)])
    closed, out_shape = jax.make_jaxpr(loss_fn, return_shape=True)(natural, *args)
    outs = _Interpreter(closed, leaf_layouts, layout.axis).run(
        leaves, jax.tree.leaves(args))
    return jax.tree.unflatten(jax.tree.structure(out_shape), outs)
  return on_use


def _gather(layout: fsdp.LeafLayout, axis, shard: jax.Array) -> jax.Array:
  """One device's shard -> the natural leaf."""
  return layout.to_natural(jax.lax.all_gather(shard, axis, axis=layout.dim or 0, tiled=True))


def _scatter(layout: fsdp.LeafLayout, axis, grad: jax.Array) -> jax.Array:
  """The natural leaf's gradient on each device -> this device's shard of their sum (the
  transpose of :func:`_gather`)."""
  return jax.lax.psum_scatter(layout.to_stored(grad), axis, scatter_dimension=layout.dim or 0,
                              tiled=True)


def _after(shards: list, values) -> list:
  """``shards``, unchanged, but computable only once ``values`` exist: each plus a zero made
  from one element of each value (a data dependency, which every backend's scheduler keeps; an
  optimisation barrier is dropped before scheduling on CPU). The zero is exact and finite
  whatever the element (inf, NaN)."""
  zero = jnp.zeros((), jnp.float32)
  for value in jax.tree.leaves(values):
    if jnp.size(value) and jnp.issubdtype(value.dtype, jnp.number):
      first = value.reshape(-1)[0].astype(jnp.float32)
      zero = zero + jnp.where(jnp.isfinite(first), first, 0.0) * 0.0
  return [s + zero.astype(s.dtype) if jnp.issubdtype(s.dtype, jnp.inexact) else s
          for s in shards]


def _block(layouts: tuple[fsdp.LeafLayout, ...], axis, fn: Callable[..., Any]):
  """``(shards, data) -> fn(natural leaves, data)``, gathering on the forward and again on the
  backward pass, each only once the block's inputs (its cotangent) exist."""
  gather = lambda shards: [_gather(l, axis, s) for l, s in zip(layouts, shards)]

  @jax.custom_vjp
  def block(shards, data):
    return fn(gather(shards), data)

  def forward(shards, data):
    return fn(gather(_after(shards, data)), data), (shards, data)

  def backward(residuals, cotangent):
    shards, data = residuals
    _, vjp = jax.vjp(fn, gather(_after(shards, cotangent)), data)
    leaves, data_cotangent = vjp(cotangent)
    return [_scatter(l, axis, g) for l, g in zip(layouts, leaves)], data_cotangent

  block.defvjp(forward, backward)
  return block


class _Interpreter:
  """Evaluates a loss's jaxpr with its first inputs (the parameters) as shards: equations that
  read only parameters (and constants) are deferred into the blocks that consume them; an
  equation that reads a parameter and anything else runs as a block (:func:`_block`)."""

  def __init__(self, closed: jex.ClosedJaxpr, layouts, axis):
    self.jaxpr, self.layouts, self.axis = closed.jaxpr, layouts, axis
    self.order = {id(e): n for n, e in enumerate(self.jaxpr.eqns)}
    self.leaf_vars = self.jaxpr.invars[:len(layouts)]
    self.constants = frozenset(self.jaxpr.constvars)
    # A parameter-derived variable -> (its leaves' indices, the equations that compute it).
    self.derived = {v: (frozenset([i]), ()) for i, v in enumerate(self.leaf_vars)}
    self.env = dict(zip(self.jaxpr.constvars, closed.consts))
    self.shards = []

  def _read(self, v):
    return v.val if isinstance(v, jex.Literal) else self.env[v]

  def _needs(self, variables):
    """The leaves and the deferred equations (in order) that ``variables`` need."""
    leaves, eqns = frozenset(), {}
    for v in variables:
      if isinstance(v, jex.Var) and v in self.derived:
        more, chain = self.derived[v]
        leaves |= more
        eqns.update((id(e), e) for e in chain)
    return sorted(leaves), sorted(eqns.values(), key=lambda e: self.order[id(e)])

  def _run_block(self, eqns, outvars) -> list:
    """Runs the deferred equations ``outvars`` and ``eqns`` need, then ``eqns``, as one block
    (:func:`_block`); returns the values of ``outvars``."""
    leaves, chain = self._needs([*outvars, *(v for e in eqns for v in e.invars)])
    chain = [*chain, *eqns]
    made = {v for e in chain for v in e.outvars}
    leaf_vars = [self.leaf_vars[i] for i in leaves]
    # Everything else the block reads (the data, constants) enters it as an input.
    data_vars = list(dict.fromkeys(
        v for e in chain for v in e.invars
        if isinstance(v, jex.Var) and v not in made and v not in leaf_vars))

    def fn(natural, data):
      env = {**dict(zip(leaf_vars, natural)), **dict(zip(data_vars, data))}
      read = lambda v: v.val if isinstance(v, jex.Literal) else env[v]
      for eqn in chain:
        out = eqn.primitive.bind(*map(read, eqn.invars),
                                 **eqn.primitive.get_bind_params(eqn.params))
        env.update(zip(eqn.outvars, out if eqn.primitive.multiple_results else [out]))
      return [read(v) for v in outvars]

    block = _block(tuple(self.layouts[i] for i in leaves), self.axis, fn)
    return block([self.shards[i] for i in leaves], [self.env[v] for v in data_vars])

  def run(self, shards, args) -> list:
    """The jaxpr's outputs for the parameters' ``shards`` and the other inputs ``args``."""
    self.shards = shards
    self.env.update(zip(self.jaxpr.invars[len(shards):], args))
    for eqn in self.jaxpr.eqns:
      variables = [v for v in eqn.invars if isinstance(v, jex.Var)]
      if not any(v in self.derived for v in variables):
        out = eqn.primitive.bind(*map(self._read, eqn.invars),
                                 **eqn.primitive.get_bind_params(eqn.params))
        outs = out if eqn.primitive.multiple_results else [out]
      elif all(v in self.derived or v in self.constants for v in variables):
        leaves, chain = self._needs(variables)  # deferred to the blocks that read it
        self.derived.update((v, (frozenset(leaves), (*chain, eqn))) for v in eqn.outvars)
        continue
      else:
        outs = self._run_block([eqn], eqn.outvars)
      self.env.update((v, x) for v, x in zip(eqn.outvars, outs) if not isinstance(v, jex.DropVar))
    deferred = [v for v in dict.fromkeys(self.jaxpr.outvars)
                if isinstance(v, jex.Var) and v in self.derived]
    if deferred:  # a parameter-only output (a regulariser returned alone): a block of its own
      self.env.update(zip(deferred, self._run_block([], deferred)))
    return [self._read(v) for v in self.jaxpr.outvars]
