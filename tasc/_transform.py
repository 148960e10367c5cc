"""``tasc_compress``: TASC as an Optax gradient transformation.

TASC (Dong, Keutzer et al.): Hessian-aware, topology-aware, structured sparsification. Each
worker scores gradient blocks by the loss their delay would cost (curvature times squared norm,
:mod:`tasc._scores`), all workers agree on the same top blocks, and only those blocks travel, in
one compact all-reduce whose size does not grow with the number of workers
(:mod:`tasc._compressor`). It runs through :func:`compressors.compress`, which supplies error
feedback, fused buffers, the hierarchical mode, input validation and the wire accounting.

Topology. On a mesh ``(slow, fast)`` (nodes x accelerators of a node) ``density`` may be given
per axis, ``{slow: rho, fast: rho_fast}``:

* ``rho_fast = 1`` (also what a plain float means when ``dense_axis`` is set): a dense
  reduce-scatter over the fast axis, TASC over the slow axis on this device's ``1/g`` shard of
  the node's summed gradient (``g`` the fast axis's size), an all-gather over the fast axis.
  The slow links carry ``1/g`` of the flat mode's payload, and the blocks are ranked on the
  node's sum, which is less noisy than one device's gradient.
* ``rho_fast = rho``: the same blocks travel on both axes. One support is chosen from scores
  summed over every device, and the compact ``[K, block_size]`` payload is all-reduced
  hierarchically (:func:`compressors.network.collectives.hierarchical_all_reduce`: reduce-scatter
  over the fast axis, all-reduce of ``1/g`` of it over the slow axis, all-gather over the fast
  axis).
  The slow links again carry ``1/g`` of the payload and the fast links only the payload rather
  than the dense gradient.
* Anything else on the fast axis (``rho < rho_fast < 1``) would need two nested supports, the
  fast one a superset of the slow one, with the blocks reduced on the fast axis but not sent on
  the slow one owned by one device of the node: not offered; it raises. Fast links are rarely
  the bottleneck, and the two modes above cover the two ends.
"""

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax

from compressors import budget
from compressors import checks
from compressors import method_table
from compressors import wrapper
from compressors.network import axes
from compressors.network import topology as topology_lib
from tasc import _compressor as compressor_lib
from tasc import _hessian as hessian
from tasc import _plan as plan_lib
from tasc import _scores as scores
from tasc import _settings as settings_lib
from tasc import _wire as wire_formats



def tasc_compress(settings: settings_lib.TascSettings | None = None, /, *,
                  axis_name: axes.AxisName, dense_axis: axes.AxisName = None,
                  error_feedback: bool = True, fuse: bool = True, seed: int = 0,
                  schedule: Any = "psum", topology: Any = None, report_sent: bool = False,
                  error_decay: float = 1.0, block_density: float | None = None,
                  **fields) -> optax.GradientTransformationExtraArgs:
  """TASC: Hessian-aware structured sparsification over a block support shared by all workers.

  ``update(grads, state, params=None, *, curvature=None)`` runs per worker inside
  ``shard_map``/``pmap`` and returns the mean over workers of the sent blocks, identical on every
  worker; what is not sent stays in the error-feedback residual.

  Args:
    settings: TASC's :class:`tasc.TascSettings` (default: its defaults); ``density`` may be a
      mapping ``{axis: density}`` over ``axis_name`` and ``dense_axis`` (see the module
      docstring for the fast axis's options). ``block_size=None`` is chosen for the fused
      buffer (in hierarchical mode, each device's shard of it); leaf by leaf it is 256, as a
      small leaf would pull every leaf's blocks down to a few elements (a leaf too small for
      256 gets the error that says so).
    axis_name: the mesh axis (or axes) over which workers hold different gradients; with
      ``dense_axis``, the slow axis.
    dense_axis: the fast axis of hierarchical mode (see :func:`compressors.compress`).
    error_feedback: keep what was not sent (strongly advised: without it the unsent blocks are
      lost).
    fuse: one buffer and one ranking for the whole model (blocks compete across layers, so the
      layer-wise allocation emerges from the ranking); ``False`` applies ``density`` per leaf.
    seed: seed of :func:`compressors.compress` (TASC itself draws no random numbers).
    schedule: the all-reduce algorithm (``"psum"``, one of
      :data:`compressors.network.collectives.SCHEDULES`, ``"auto"`` with ``topology``, or a
      :class:`compressors.network.planner.Plan`; see :func:`compressors.compress`); with the same
      density on both axes the default ``"psum"`` becomes ``"hierarchical"``.
    topology: the workers' :class:`compressors.network.topology.Topology`, for ``schedule="auto"``.
    report_sent: keep which entries each worker sent in the state, for
      :func:`compressors.momentum_correction` (see :func:`compressors.compress`).
    error_decay: the factor in [0, 1] the residual is multiplied by before it is added to the
      next gradient (SparseLoCo, arXiv 2508.15706; see :func:`compressors.compress`).
    block_density: the density in (0, 1] at which ``block_size=None`` picks each buffer's block
      size (default: ``density``'s capacity). The blocks size the state (the curvature and
      scores, one per block), so a density warm-up (:func:`compressors.density_warmup`, after
      Lin et al. 2018) builds each stage with its own ``density`` and the final density here:
      every stage then cuts the buffers into the same blocks and shares one state.
    **fields: fields of :class:`tasc.TascSettings` replacing those of ``settings``, e.g.
      ``tasc_compress(axis_name="data", density=0.01)``.

  Returns:
    An ``optax.GradientTransformationExtraArgs``; chain it before the optimizer, e.g.
    ``optax.chain(tasc_compress(axis_name="data", density=0.01), optax.sgd(0.1))``.
  """
  settings = settings_lib.checked(_with_fields(settings, fields))
  rho, both_axes = _resolve_density(settings.density, axis_name, dense_axis)
  if both_axes:
    axis_name = axes.as_tuple(axis_name) + axes.as_tuple(dense_axis)
    dense_axis = None
    if schedule == "psum" and len(axis_name) == 2:
      schedule = "hierarchical"
  block_size = settings.block_size or (None if fuse else plan_lib.AUTO_BLOCK_SIZES[0])
  settings = dataclasses.replace(settings, density=rho, block_size=block_size)
  needs_leaf_sizes = fuse and settings.min_blocks_per_leaf > 0
  if block_density is not None:
    block_density = checks.check_fraction(block_density, "block_density", "tasc_compress")

  @functools.cache
  def transformation(leaf_sizes: tuple[int, ...] | None):
    compressor = compressor_lib.tasc(settings, leaf_sizes=leaf_sizes, dense_axis=dense_axis,
                                     block_density=block_density)
    return wrapper.compress(compressor, axis_name=axis_name, dense_axis=dense_axis,
                                error_feedback=error_feedback, fuse=fuse, seed=seed,
                                schedule=schedule, topology=topology, report_sent=report_sent,
                                error_decay=error_decay)

  def for_tree(tree):
    """The transformation for gradients like ``tree``: one per leaf layout, built once."""
    return transformation(tuple(int(np.size(x)) for x in jax.tree.leaves(tree))
                          if needs_leaf_sizes else None)

  transformation(None)  # every argument is checked here, before anything is traced

  def init_fn(params):
    return for_tree(params).init(params)

  def update_fn(updates, state, params=None, *, curvature=None, **extra_args):
    del extra_args
    if curvature is not None:
      _check_curvature(curvature, updates, settings.sensitivity)
    return for_tree(updates).update(updates, state, params, curvature=curvature)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _with_fields(settings: settings_lib.TascSettings | None,
                 fields: dict[str, Any]) -> settings_lib.TascSettings:
  """``settings`` (default: the defaults) with ``fields`` replaced; a clear error for a name
  that is neither an argument of :func:`tasc_compress` nor a field of the settings."""
  known = [f.name for f in dataclasses.fields(settings_lib.TascSettings)]
  unknown = sorted(set(fields) - set(known))
  if unknown:
    raise TypeError(f"tasc_compress: got an unexpected argument {unknown[0]}={fields[unknown[0]]!r}"
                    f"; allowed: axis_name, dense_axis, error_feedback, fuse, seed, schedule, "
                    f"topology, report_sent, error_decay, block_density and the fields of "
                    f"tasc.TascSettings {known}")
  if settings is None:
    return settings_lib.TascSettings(**fields)
  if not isinstance(settings, settings_lib.TascSettings):
    raise TypeError(f"tasc_compress: settings must be a tasc.TascSettings, got "
                    f"{type(settings).__name__}: {settings!r}")
  return dataclasses.replace(settings, **fields)


def _resolve_density(density, axis_name: axes.AxisName,
                     dense_axis: axes.AxisName) -> tuple[Any, bool]:
  """(density of the compressed exchange, whether the fast axis is sparse too), from a checked
  density."""
  if not isinstance(density, Mapping):
    return density, False
  slow, fast = axes.as_tuple(axis_name), axes.as_tuple(dense_axis)
  unknown = [k for k in density if k not in slow + fast]
  if unknown:
    raise ValueError(f"tasc_compress: density={dict(density)!r} names axis {unknown[0]!r}, "
                     f"which is neither axis_name={axis_name!r} nor dense_axis={dense_axis!r}")
  missing = [a for a in slow if a not in density]
  if missing:
    raise ValueError(f"tasc_compress: density={dict(density)!r} gives no density for the "
                     f"compressed axis {missing[0]!r}; allowed keys: {list(slow + fast)}")
  rho = density[slow[0]]
  if any(density[a] != rho for a in slow):
    raise ValueError(f"tasc_compress: density={dict(density)!r} gives the axes of "
                     f"axis_name={axis_name!r} different densities; they form one exchange")
  fast_values = {density.get(a, 1.0) for a in fast}
  if fast_values <= {1.0}:
    return rho, False
  if fast_values == {rho}:
    return rho, True
  raise ValueError(
      f"tasc_compress: density={dict(density)!r}: the fast axis (dense_axis={dense_axis!r}) "
      f"must have density 1.0 (a dense reduce-scatter, then TASC over the slow axis) or the "
      f"slow axis's density {rho} (the same blocks on both axes, all-reduced hierarchically); "
      "a different sparse fast density would need nested supports, which are not offered")


def _check_curvature(curvature: chex.ArrayTree, updates: chex.ArrayTree, sensitivity: str) -> None:
  """A clear error when ``curvature`` cannot be used with these gradients."""
  if sensitivity != "hutchinson":
    raise ValueError(f"tasc_compress: update() got curvature=..., but sensitivity="
                     f"{sensitivity!r} does not use it; use sensitivity='hutchinson' to rank "
                     "blocks by a curvature estimate, or do not pass one")
  paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(updates)
  try:
    leaves = treedef.flatten_up_to(curvature)
  except (ValueError, TypeError) as err:
    raise ValueError(f"tasc_compress: curvature must be a pytree like the gradients "
                     f"(e.g. tasc.hutchinson_diagonal(loss, params, ...)); gradients: "
                     f"{treedef}, curvature: {jax.tree.structure(curvature)}") from err
  for (path, g), h in zip(paths_leaves, leaves):
    where = jax.tree_util.keystr(path)
    if jnp.shape(h) != jnp.shape(g):
      raise ValueError(f"tasc_compress: curvature leaf {where} has shape {jnp.shape(h)}, the "
                       f"gradient leaf has shape {jnp.shape(g)}; they must match")
    if not jnp.issubdtype(jnp.result_type(h), jnp.floating):
      raise TypeError(f"tasc_compress: curvature leaf {where} has dtype {jnp.result_type(h)}; "
                      "it must be floating-point")


def _curvature_refresh(s: settings_lib.TascSettings) -> method_table.StepInputs | None:
  """Each worker's own Hutchinson estimate, from its batch: TASC sums the block scores over the
  workers anyway, so the refresh moves no bytes."""
  s = settings_lib.checked(s)
  if s.sensitivity != "hutchinson":
    return None

  def make(loss_fn, params, batch, key, axis_name):
    return {"curvature": hessian.hutchinson_diagonal(loss_fn, params, key, s.num_probes, batch,
                                                     axis_name=axis_name, average=False)}
  return method_table.StepInputs(every=s.hessian_every, make=make)


def _cost(s: settings_lib.TascSettings, shapes, topology, schedule) -> topology_lib.Cost:
  """The scores' and the blocks' all-reduces (float16 global support: and the bound's), or,
  with last step's support, one all-reduce carrying both, for the fused buffer's plan (at least
  one block: the equal-bytes search prices densities too small to send one). A block larger
  than the whole gradient is refused (:func:`tasc._plan.check_block_fits`): a run asks the cost
  model first, and would otherwise be refused for sending more than dense, without the reason
  (a buffer of the transformation may be shorter than a block, as a leaf of ``fuse=False``)."""
  s = settings_lib.checked(s)
  wire = wire_formats.FORMATS[s.wire_dtype]
  leaf_sizes = [math.prod(shape) for shape in shapes] if s.min_blocks_per_leaf else None
  size = method_table.num_elements(shapes)
  plan_lib.check_block_fits(s.block_size, size, f"the model's gradient ({len(shapes)} leaves "
                            "fused)")
  plan = plan_lib.buffer_plan(s, size, leaf_sizes)
  payload = max(1, plan.capacity) * plan.block_size
  reduce = lambda n, itemsize=wire.itemsize: topology_lib.all_reduce_cost(schedule, topology, n,
                                                                          itemsize)
  if s.support == "previous":
    return reduce(payload + plan.num_blocks + wire.bound_entries)
  bound = [reduce(1, 4)] if wire.bound_entries else []
  return topology_lib.total([reduce(plan.num_blocks), *bound, reduce(payload)])


BUDGET_BLOCK_SIZES = tuple(2**i for i in range(4, 15))  # 16 .. 16384


def _budget(s: settings_lib.TascSettings, shapes, cost,
            target: float) -> settings_lib.TascSettings | None:
  """TASC's equal-bytes search (:mod:`compressors.equal_bytes`): the density for ``target`` bytes
  at the settings' block size; with ``block_size=None``, at the smallest block size of
  :data:`BUDGET_BLOCK_SIZES` whose scores (one number per block, all-reduced whatever the
  density) take at most a quarter of the target, so that most bytes carry blocks. Where none
  does (a small model at a high ratio), the block size at which the scores and one block cost
  least, if that fits."""
  if s.block_size is not None:
    return budget.fit_field(s, "density", cost, target)
  size = method_table.num_elements(shapes)
  fitting = []  # (bytes of the scores and one block, block size)
  for block in BUDGET_BLOCK_SIZES:
    blocks = scores.num_blocks(size, block)
    if blocks < 2:
      break
    one, two = (cost(dataclasses.replace(s, block_size=block, density=k / blocks))
                for k in (1, 2))
    if one > target:
      continue
    if one - (two - one) <= target / 4:  # the scores' bytes
      return budget.fit_field(dataclasses.replace(s, block_size=block), "density", cost,
                                   target)
    fitting.append((one, block))
  if not fitting:
    return None
  return budget.fit_field(dataclasses.replace(s, block_size=min(fitting)[1]), "density",
                               cost, target)


METHODS = (method_table.Method(
    name="tasc", summary="TASC: Hessian-aware block scores, one block support shared by all "
    "workers, the blocks all-reduced", settings=settings_lib.TascSettings,
    transformation=tasc_compress,
    step_inputs=_curvature_refresh, cost=_cost, budget=_budget),)
