"""Curvature estimators for Hessian-aware sparsification (TASC).

Matrix-free estimates of a loss's Hessian, built on Hessian-vector products:

* ``hvp``: forward-over-reverse Hessian-vector product on pytrees.
* ``hutchinson``: the Hessian diagonal, per-leaf (per-layer) traces and the total
  trace from one set of Rademacher probes. Hutchinson (1990) estimates
  tr(H) = E[z^T H z]; Bekas, Kokiopoulou & Saad (2007) estimate
  diag(H) = E[z * Hz]. One probe over all parameters gives every layer's trace,
  E[z_l^T (Hz)_l] = tr(H_ll), which is the sum of that layer's diagonal estimate,
  so the traces cost nothing beyond the diagonal. HAWQ-v2 (Dong et al., NeurIPS
  2020) ranks layers by the average trace tr(H_ll) / n_l; AdaHessian (Yao et al.,
  AAAI 2021) uses the diagonal, averaged over blocks.
* ``top_eigenvalue``: power iteration as in PyHessian (Yao et al., IEEE BigData 2020):
  v <- Hv / ||Hv||, lambda = v^T H v, stopping at relative change < tolerance or
  after ``max_iterations``; converges to the eigenvalue of largest magnitude.

Data parallelism: inside ``jax.shard_map`` (or ``pmap``) pass ``axis_name``. Every
worker draws the same probes from the same key (the key is not folded with the
worker index) and probes its local batch; the estimates are then averaged with
``lax.pmean``. When the loss is a mean over equal-sized local batches, the
average of the local Hessians is the full-batch Hessian, so the averaged
estimate equals the full-batch estimate with the same probes. Hutchinson sends
one all-reduce of the diagonal's size per call (in the accumulation dtype, at
least float32); power iteration one per iteration (the pytree is flattened so
each is a single collective). Replicated parameters are cast to varying before
differentiating: otherwise ``shard_map``'s autodiff would sum every product over
the workers, an all-reduce per probe.

Memory: the gradient is linearised once (``jax.linearize``) and each probe costs
one tangent evaluation. Probes are processed by ``lax.scan`` in chunks of
``probe_batch_size`` probes, vmapped within a chunk, and summed into one
accumulator, so peak memory is about ``probe_batch_size`` Hessian-vector products
(tangent activations included) whatever ``num_samples`` is. The default of one
probe at a time is the least memory; larger chunks trade memory for speed.
"""
from __future__ import annotations

import operator
from typing import Any, Callable, NamedTuple

import chex
import jax
import jax.numpy as jnp
import optax
from jax.flatten_util import ravel_pytree

from compressors.network import axes

LossFn = Callable[..., jax.Array]


class HutchinsonEstimate(NamedTuple):
  """Hutchinson estimates of the Hessian from one set of probes.

  Attributes:
    diagonal: estimate of diag(H), a pytree like the parameters.
    traces: per-leaf (per-layer) estimates of tr(H_ll), a pytree of scalars.
    total: estimate of tr(H), the sum of ``traces``.
  """

  diagonal: chex.ArrayTree
  traces: chex.ArrayTree
  total: jax.Array


class PowerIterationResult(NamedTuple):
  """Result of ``top_eigenvalue``.

  Attributes:
    eigenvalue: the Hessian eigenvalue of largest magnitude (may be negative).
    eigenvector: its unit-norm eigenvector, a pytree like the parameters.
    iterations: number of Hessian-vector products taken.
  """

  eigenvalue: jax.Array
  eigenvector: chex.ArrayTree
  iterations: jax.Array


def _check_params(params: chex.ArrayTree) -> None:
  leaves = jax.tree_util.tree_leaves_with_path(params)
  if not leaves:
    raise ValueError("params must contain at least one array leaf; got an empty pytree.")
  for path, leaf in leaves:
    dtype = jnp.result_type(leaf)
    if not jnp.issubdtype(dtype, jnp.floating):
      raise TypeError(
          f"params leaf params{jax.tree_util.keystr(path)} has dtype {dtype}; "
          "curvature is defined only for real floating-point parameters "
          "(float16, bfloat16, float32, float64)."
      )


def _check_positive_int(name: str, value: Any) -> None:
  if isinstance(value, bool) or not isinstance(value, int):
    raise TypeError(
        f"{name} must be a Python int >= 1; got {value!r} of type {type(value).__name__}.")
  if value < 1:
    raise ValueError(f"{name} must be >= 1; got {value}.")


def _as_varying(tree: chex.ArrayTree, axis_name: axes.AxisName) -> chex.ArrayTree:
  """Casts the leaves of ``tree`` that are replicated over ``axis_name`` to varying (where
  ``shard_map`` types values: not without an axis, nor for simulated workers)."""
  if axis_name is None or not axes.replication_checked(axis_name):
    return tree
  return jax.tree.map(
      lambda x: x
      if axes.is_varying(x, axis_name)
      else jax.lax.pcast(x, axes.as_tuple(axis_name), to="varying"),
      tree,
  )


def _linearized_hvp(
    loss_fn: LossFn, params: chex.ArrayTree, args: tuple, axis_name: str | None
) -> Callable[[chex.ArrayTree], chex.ArrayTree]:
  """Returns v -> Hv of this worker's loss, linearising the gradient once.

  Each product then costs one tangent pass. Under ``shard_map``, autodiff with
  respect to replicated (invariant) parameters sums the derivatives over the
  axis, one all-reduce per product; casting the parameters (and so the
  tangents) to varying keeps every product local, so the caller averages once.
  """
  _, hvp_at = jax.linearize(lambda p: jax.grad(loss_fn)(p, *args), _as_varying(params, axis_name))
  return lambda v: hvp_at(_as_varying(v, axis_name))


def _rademacher_like(key: jax.Array, params: chex.ArrayTree) -> chex.ArrayTree:
  """One Rademacher vector over all parameters, as a pytree like ``params``.

  Drawn as a single flat vector: one random-bits call compiles far smaller
  than one per leaf.
  """
  flat, unravel = ravel_pytree(params)
  return unravel(jax.random.rademacher(key, flat.shape, flat.dtype))


def _pmean_flat(tree: chex.ArrayTree, axis_name: str | None) -> chex.ArrayTree:
  """Averages ``tree`` over ``axis_name`` with a single all-reduce (identity if None)."""
  if axis_name is None:
    return tree
  flat, unravel = ravel_pytree(tree)
  return unravel(jax.lax.pmean(flat, axis_name))


def hvp(loss_fn: LossFn, params: chex.ArrayTree, v: chex.ArrayTree, *args: Any) -> chex.ArrayTree:
  """Hessian-vector product Hv of ``loss_fn`` at ``params`` (forward-over-reverse).

  Computes ``jax.jvp(jax.grad(f), (params,), (v,))[1]``, which costs about two to
  three gradient evaluations and never forms H.

  Args:
    loss_fn: ``loss_fn(params, *args) -> scalar``.
    params: pytree of floating-point arrays, the point at which H is taken.
    v: pytree with the same structure, shapes and dtypes as ``params``.
    *args: further arguments to ``loss_fn`` (e.g. a batch); not differentiated.

  Returns:
    Hv, a pytree like ``params``.
  """
  _check_params(params)
  params_def, v_def = jax.tree.structure(params), jax.tree.structure(v)
  if params_def != v_def:
    raise ValueError(f"v must have the structure of params; got v {v_def}, params {params_def}.")
  for (path, p), u in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(v)):
    if jnp.shape(p) != jnp.shape(u) or jnp.result_type(p) != jnp.result_type(u):
      raise ValueError(
          f"v{jax.tree_util.keystr(path)} has shape {jnp.shape(u)} and dtype {jnp.result_type(u)}; "
          f"it must match params{jax.tree_util.keystr(path)}: shape {jnp.shape(p)}, "
          f"dtype {jnp.result_type(p)}."
      )
  return jax.jvp(lambda p: jax.grad(loss_fn)(p, *args), (params,), (v,))[1]


def hutchinson(
    loss_fn: LossFn,
    params: chex.ArrayTree,
    key: jax.Array,
    num_samples: int,
    *args: Any,
    axis_name: str | None = None,
    probe_batch_size: int = 1,
    average: bool = True,
) -> HutchinsonEstimate:
  """Hessian diagonal, per-layer traces and total trace from Rademacher probes.

  With z Rademacher, diag(H) ~ mean_z z * Hz (Bekas et al. 2007) and
  tr(H_ll) ~ mean_z z_l^T (Hz)_l (Hutchinson 1990), the sum of leaf l of the
  diagonal estimate. The per-probe variance of the total trace is
  2 (||H||_F^2 - sum_i H_ii^2).

  Args:
    loss_fn: ``loss_fn(params, *args) -> scalar``.
    params: pytree of floating-point arrays.
    key: PRNG key for the probes. Under ``shard_map`` it must be the same on all
      workers (replicated), so every worker probes with the same vectors.
    num_samples: number of probes m >= 1; the error shrinks as 1/sqrt(m).
    *args: further arguments to ``loss_fn`` (e.g. the local batch).
    axis_name: if given, the estimates are averaged over this mapped axis with
      one ``lax.pmean`` of the diagonal's size.
    probe_batch_size: probes vmapped together; peak memory grows with it (see the
      module docstring). Values above ``num_samples`` are clipped to it.
    average: with ``axis_name``, False skips the ``pmean``: each worker keeps the
      estimate of its own batch (no collective). TASC wants this: its block scores
      are summed over workers anyway, so a local curvature costs no bytes.

  Returns:
    ``HutchinsonEstimate(diagonal, traces, total)``; the diagonal has the dtypes
    of ``params``, traces and total are accumulated in at least float32.
  """
  _check_params(params)
  _check_positive_int("num_samples", num_samples)
  _check_positive_int("probe_batch_size", probe_batch_size)
  chunk = min(probe_batch_size, num_samples)
  hvp_at = _linearized_hvp(loss_fn, params, args, axis_name)
  accumulate_dtypes = jax.tree.map(
      lambda p: jnp.promote_types(jnp.result_type(p), jnp.float32), params)

  def chunk_sum(keys: jax.Array) -> chex.ArrayTree:
    def probe(k: jax.Array) -> chex.ArrayTree:
      z = _rademacher_like(k, params)
      return jax.tree.map(
          lambda zi, hzi, dtype: (zi * hzi).astype(dtype), z, hvp_at(z), accumulate_dtypes)

    return jax.tree.map(lambda x: x.sum(axis=0), jax.vmap(probe)(keys))

  keys = jax.random.split(key, num_samples)
  num_chunks, remainder = divmod(num_samples, chunk)
  chunked_keys = keys[: num_chunks * chunk].reshape((num_chunks, chunk) + keys.shape[1:])
  zeros = jax.tree.map(lambda p, dtype: jnp.zeros(jnp.shape(p), dtype), params, accumulate_dtypes)
  total_sum, _ = jax.lax.scan(
      lambda acc, ks: (optax.tree.add(acc, chunk_sum(ks)), None),
      _as_varying(zeros, axis_name),  # the sums vary over workers; the scan carry must match
      chunked_keys,
  )
  if remainder:
    total_sum = optax.tree.add(total_sum, chunk_sum(keys[num_chunks * chunk :]))
  diagonal = optax.tree.scale(
      1.0 / num_samples, _pmean_flat(total_sum, axis_name if average else None))
  traces = jax.tree.map(jnp.sum, diagonal)
  total = jax.tree.reduce(operator.add, traces)
  diagonal = jax.tree.map(lambda d, p: d.astype(jnp.result_type(p)), diagonal, params)
  return HutchinsonEstimate(diagonal=diagonal, traces=traces, total=total)


def hutchinson_diagonal(
    loss_fn: LossFn,
    params: chex.ArrayTree,
    key: jax.Array,
    num_samples: int,
    *args: Any,
    axis_name: str | None = None,
    probe_batch_size: int = 1,
    average: bool = True,
) -> chex.ArrayTree:
  """Hutchinson estimate of diag(H), a pytree like ``params``; see ``hutchinson``."""
  return hutchinson(
      loss_fn, params, key, num_samples, *args, axis_name=axis_name,
      probe_batch_size=probe_batch_size, average=average
  ).diagonal


def hutchinson_trace(
    loss_fn: LossFn,
    params: chex.ArrayTree,
    key: jax.Array,
    num_samples: int,
    *args: Any,
    axis_name: str | None = None,
    probe_batch_size: int = 1,
) -> tuple[chex.ArrayTree, jax.Array]:
  """Hutchinson estimates of the per-leaf traces and of tr(H); see ``hutchinson``.

  Returns:
    ``(traces, total)``: a pytree of scalars like ``params`` with tr(H_ll) per leaf,
    and their sum.
  """
  estimate = hutchinson(
      loss_fn, params, key, num_samples, *args, axis_name=axis_name,
      probe_batch_size=probe_batch_size
  )
  return estimate.traces, estimate.total


def top_eigenvalue(
    loss_fn: LossFn,
    params: chex.ArrayTree,
    key: jax.Array,
    *args: Any,
    max_iterations: int = 100,
    tolerance: float = 1e-3,
    axis_name: str | None = None,
) -> PowerIterationResult:
  """Largest-magnitude Hessian eigenvalue by power iteration (PyHessian, Yao et al. 2020).

  Iterates v <- Hv / ||Hv|| from a Rademacher start, with lambda = v^T H v, and stops
  when |lambda - lambda_prev| / (|lambda_prev| + 1e-6) < ``tolerance`` or after
  ``max_iterations`` products. Runs in ``lax.while_loop``, so it jits.

  Args:
    loss_fn: ``loss_fn(params, *args) -> scalar``.
    params: pytree of floating-point arrays.
    key: PRNG key for the start vector; replicated under ``shard_map``.
    *args: further arguments to ``loss_fn`` (e.g. the local batch).
    max_iterations: most Hessian-vector products, >= 1.
    tolerance: relative-change stopping threshold, > 0.
    axis_name: if given, every product Hv is averaged over this mapped axis (one
      all-reduce of the parameters' size per iteration).

  Returns:
    ``PowerIterationResult(eigenvalue, eigenvector, iterations)``.
  """
  _check_params(params)
  _check_positive_int("max_iterations", max_iterations)
  if not isinstance(tolerance, (int, float)) or isinstance(tolerance, bool) or not tolerance > 0:
    raise ValueError(f"tolerance must be a float > 0; got {tolerance!r}.")
  hvp_at = _linearized_hvp(loss_fn, params, args, axis_name)

  def normalize(tree: chex.ArrayTree, fallback: chex.ArrayTree) -> chex.ArrayTree:
    """tree / ||tree||, or ``fallback`` where Hv = 0 (v is then an eigenvector for 0)."""
    norm = optax.tree.norm(tree)
    return jax.tree.map(
        lambda x, f: jnp.where(norm > 0, x / jnp.where(norm > 0, norm, 1), f).astype(x.dtype),
        tree, fallback)

  probe = _rademacher_like(key, params)
  start = normalize(probe, probe)
  eigenvalue_dtype = jnp.promote_types(jnp.result_type(*jax.tree.leaves(params)), jnp.float32)

  def keep_going(state):
    iteration, _, _, converged = state
    return jnp.logical_and(iteration < max_iterations, jnp.logical_not(converged))

  def step(state):
    iteration, v, eigenvalue, _ = state
    hv = _pmean_flat(hvp_at(v), axis_name)
    new_eigenvalue = optax.tree.vdot(v, hv).astype(eigenvalue_dtype)
    relative_change = jnp.abs(new_eigenvalue - eigenvalue) / (jnp.abs(eigenvalue) + 1e-6)
    converged = jnp.logical_and(iteration > 0, relative_change < tolerance)
    return iteration + 1, normalize(hv, v), new_eigenvalue, converged

  init = (jnp.asarray(0, jnp.int32), start, jnp.asarray(0.0, eigenvalue_dtype), jnp.asarray(False))
  iterations, eigenvector, eigenvalue, _ = jax.lax.while_loop(keep_going, step, init)
  return PowerIterationResult(eigenvalue=eigenvalue, eigenvector=eigenvector, iterations=iterations)
