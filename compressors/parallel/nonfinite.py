"""Skip a step, on every worker at once, when any worker's gradient is not finite.

One worker's NaN would otherwise reach every replica through the collective, and corrupt the
error-feedback residuals and optimizer moments for good. :func:`skip_nonfinite` wraps the whole
chain (compressor and optimizer): each worker checks its own gradient, a single all-reduce of
one int32 flag tells every worker whether any of them saw a non-finite value, and the mean and
updates the chain produced, identical everywhere, are checked too. A flagged step returns zero
updates and leaves the wrapped state (parameters' moments, residuals, curvature, keys) exactly as
it was; the skip is counted. Every worker takes the same decision, so replicas stay identical.
"""

from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import optax

from compressors.network import axes



class SkipNonFiniteState(NamedTuple):
  """State of :func:`skip_nonfinite`.

  Attributes:
    inner: the wrapped transformation's state.
    skipped: steps skipped so far (int32, identical on every worker).
    last_skipped: whether the latest step was skipped (bool).
  """
  inner: chex.ArrayTree
  skipped: jax.Array
  last_skipped: jax.Array


def skip_nonfinite(inner: optax.GradientTransformation, *,
                   axis_name: axes.AxisName) -> optax.GradientTransformationExtraArgs:
  """Wraps ``inner`` so that a step with a non-finite gradient anywhere is skipped everywhere.

  Args:
    inner: the transformation to protect, typically ``optax.chain(compress(...), optimizer)``.
    axis_name: the workers' mesh axis (or tuple); None for a single worker.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is :class:`SkipNonFiniteState`.
  """
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    return SkipNonFiniteState(inner=inner.init(params), skipped=jnp.zeros((), jnp.int32),
                              last_skipped=jnp.zeros((), bool))

  def update_fn(updates, state, params=None, **extra_args):
    new_updates, new_inner = inner.update(updates, state.inner, params, **extra_args)
    # The new updates count too: a local-update method's differ between workers.
    skip = ~_all_finite(updates) | ~_all_finite(new_updates)
    if axes.as_tuple(axis_name):
      flag = skip.astype(jnp.int32)
      if axes.replication_checked(axis_name) and not axes.is_varying(flag, axis_name):
        flag = jax.lax.pcast(flag, axes.as_tuple(axis_name), to="varying")
      skip = jax.lax.psum(flag, axis_name) > 0
    keep = lambda old, new: jax.tree.map(lambda o, n: jnp.where(skip, o, n), old, new)
    return (jax.tree.map(lambda u: jnp.where(skip, jnp.zeros_like(u), u), new_updates),
            SkipNonFiniteState(inner=keep(state.inner, new_inner),
                               skipped=state.skipped + skip.astype(jnp.int32),
                               last_skipped=skip))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _all_finite(tree: chex.ArrayTree) -> jax.Array:
  leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
            if jnp.issubdtype(jnp.asarray(x).dtype, jnp.inexact)]
  return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)
