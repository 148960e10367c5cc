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
  hierarchically (:func:`compressors.network.collectives.hierarchical_all_reduce`: reduce-scatter over
  the fast axis, all-reduce of ``1/g`` of it over the slow axis, all-gather over the fast axis).
  The slow links again carry ``1/g`` of the payload and the fast links only the payload rather
  than the dense gradient.
* Anything else on the fast axis (``rho < rho_fast < 1``) would need two nested supports, the
  fast one a superset of the slow one, with the blocks reduced on the fast axis but not sent on
  the slow one owned by one device of the node: not offered; it raises. Fast links are rarely
  the bottleneck, and the two modes above cover the two ends.
"""

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import compressors
from compressors.network import axes
from compressors import checks
from compressors import equal_bytes
from compressors import registry
from compressors.network import topology as topology_lib
from tasc import _compressor as compressor_lib
from tasc import _hessian as hessian
from tasc import _scores as scores
from tasc import _wire as wire_formats

PyTree = Any


def tasc_compress(*, axis_name: axes.AxisName,
                  density: float | Callable[[jax.Array], jax.Array] | Mapping[Any, float],
                  block_size: int | None = None, sensitivity: str = "hutchinson",
                  score: str = "saliency", dense_axis: axes.AxisName = None,
                  support: str = "global",
                  curvature_decay: float = 0.9, eps: float = 0.1,
                  max_density: float | None = None, min_blocks_per_leaf: int = 0,
                  error_feedback: bool = True, fuse: bool = True, seed: int = 0,
                  schedule: Any = "psum", topology: Any = None,
                  wire_dtype: str = "float32",
                  report_sent: bool = False) -> optax.GradientTransformationExtraArgs:
  """TASC: Hessian-aware structured sparsification over a block support shared by all workers.

  ``update(grads, state, params=None, *, curvature=None)`` runs per worker inside
  ``shard_map``/``pmap`` and returns the mean over workers of the sent blocks, identical on every
  worker; what is not sent stays in the error-feedback residual.

  Args:
    axis_name: the mesh axis (or axes) over which workers hold different gradients; with
      ``dense_axis``, the slow axis.
    density: fraction of blocks sent per step, in (0, 1]: a float; a function of the step (an
      optax schedule) with ``max_density``; or a mapping ``{axis: density}`` over the axes of
      ``axis_name`` and ``dense_axis`` (see the module docstring for the fast axis's options).
    block_size: elements per block (>= 1). Larger blocks mean fewer scores and coarser
      selection. None: with fused leaves, the largest of 256, 128, ..., 1 at which the buffer
      sends at least one block at ``density`` (256 for a model of more than ~38K parameters at
      1%, 64 for one of 4K), chosen from the parameters' sizes; leaf by leaf, 256.
    sensitivity: ``"hutchinson"`` (curvature passed as ``update(..., curvature=h)``, e.g.
      :func:`tasc.hutchinson_diagonal`, EMA kept in between), ``"fisher"`` (EMA of ``g^2``) or
      ``"none"`` (block magnitude).
    score: ``"saliency"`` (curvature times the block's energy) or ``"newton"`` (energy over
      curvature, the diagonal Newton decrement); see :mod:`tasc._scores`.
    dense_axis: the fast axis of hierarchical mode (see :func:`compressors.compress`).
    support: ``"global"`` (an all-reduce of this step's block scores picks the blocks) or
      ``"previous"`` (last step's scores, carried in the payload's all-reduce: no extra
      collective, see :mod:`tasc._supports`).
    curvature_decay: EMA factor of the curvature kept in the state, in [0, 1).
    eps: curvature floor relative to the mean curvature (>= 0).
    max_density: the payload capacity's density when ``density`` is a schedule.
    min_blocks_per_leaf: blocks of every parameter leaf always sent (>= 0).
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
    wire_dtype: ``"float32"`` or ``"float16"``: the precision of the block scores and the
      payload on the wire; float16 halves the bytes, error feedback keeps the rounding (see
      :mod:`tasc._wire`).
    report_sent: keep which entries each worker sent in the state, for
      :func:`compressors.momentum_correction` (see :func:`compressors.compress`).

  Returns:
    An ``optax.GradientTransformationExtraArgs``; chain it before the optimizer, e.g.
    ``optax.chain(tasc_compress(axis_name="data", density=0.01), optax.sgd(0.1))``.
  """
  rho, both_axes = _resolve_density(density, axis_name, dense_axis)
  if both_axes:
    axis_name = axes.as_tuple(axis_name) + axes.as_tuple(dense_axis)
    dense_axis = None
    if schedule == "psum" and len(axis_name) == 2:
      schedule = "hierarchical"

  capacity_density = max_density if callable(rho) else rho

  def build(tree):
    block = block_size
    if block is None:
      block = (auto_block_size(_buffer_sizes(tree, fuse, dense_axis), capacity_density)
               if tree is not None else AUTO_BLOCK_SIZES[0])
    compressor = compressor_lib.tasc(
        rho, block_size=block, sensitivity=sensitivity, score=score, support=support,
        curvature_decay=curvature_decay, eps=eps, max_density=max_density,
        min_blocks_per_leaf=min_blocks_per_leaf, leaf_sizes=leaf_sizes_of(tree),
        dense_axis=dense_axis, wire_dtype=wire_dtype)
    return compressors.compress(compressor, axis_name=axis_name, dense_axis=dense_axis,
                                error_feedback=error_feedback, fuse=fuse, seed=seed,
                                schedule=schedule, topology=topology, report_sent=report_sent)

  needs_leaf_sizes = fuse and min_blocks_per_leaf > 0

  def leaf_sizes_of(tree):
    if tree is None or not needs_leaf_sizes:
      return None
    return tuple(int(np.size(x)) for x in jax.tree.leaves(tree))

  build(None)  # every argument is checked here, before anything is traced

  def init_fn(params):
    return build(params).init(params)

  def update_fn(updates, state, params=None, *, curvature=None, **extra_args):
    del extra_args
    if curvature is not None:
      _check_curvature(curvature, updates, sensitivity)
    return build(updates).update(updates, state, params, curvature=curvature)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


AUTO_BLOCK_SIZES = (256, 128, 64, 32, 16, 8, 4, 2, 1)


def auto_block_size(buffer_sizes, density: float) -> int:
  """The largest of :data:`AUTO_BLOCK_SIZES` at which every buffer of ``buffer_sizes`` elements
  sends at least one block at ``density`` (1 if none does)."""
  for block in AUTO_BLOCK_SIZES:
    if all(round(density * scores.num_blocks(size, block)) >= 1 for size in buffer_sizes):
      return block
  return 1


def _buffer_sizes(tree, fuse: bool, dense_axis) -> list[int]:
  """Elements of the buffers the automatic block size is chosen for: the fused buffer (in
  hierarchical mode, each device's shard of it). Leaf by leaf it is not chosen: a small leaf
  would pull every leaf's blocks down to a few elements, so the block stays 256 and a leaf too
  small for it gets the error that says so."""
  if not fuse:
    return []
  shards = axes.num_workers(dense_axis, caller="tasc_compress (dense_axis)")
  return [-(-sum(int(np.size(x)) for x in jax.tree.leaves(tree)) // shards)]


def density_for_budget(num_elements: int, budget_bytes, *, block_size: int = 256):
  """The density whose all-reduce operands fit ``budget_bytes`` per step.

  TASC all-reduces ``K * block_size`` payload floats and ``num_blocks`` score floats per step
  (f32), whichever the support; an all-reduce then moves ``2 (n-1)/n`` of that per worker.

  Args:
    num_elements: elements of the buffer (in hierarchical mode, one device's shard: the
      gradient's size divided by the fast axis's size).
    budget_bytes: bytes of all-reduce operands per step; a number or a traced scalar (so a byte
      schedule ``step -> bytes`` composes into a density schedule).
    block_size: elements per block.

  Returns:
    ``K / num_blocks`` with ``K`` the most blocks that fit (at least 1).
  """
  blocks = scores.num_blocks(num_elements, block_size)
  rows = (budget_bytes / 4 - blocks) / block_size
  if isinstance(rows, (int, float)):
    if rows < 1:
      raise ValueError(
          f"density_for_budget: budget_bytes={budget_bytes} does not fit one block: the "
          f"{blocks} block scores take {4 * blocks} bytes and each block {4 * block_size}; "
          f"allowed: budget_bytes >= {4 * (blocks + block_size)}")
    return min(int(rows), blocks) / blocks
  return jnp.clip(jnp.floor(rows), 1, blocks) / blocks


def _resolve_density(density, axis_name: axes.AxisName,
                     dense_axis: axes.AxisName) -> tuple[Any, bool]:
  """(density of the compressed exchange, whether the fast axis is sparse too)."""
  if callable(density) or not isinstance(density, Mapping):
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
  values = {k: checks.check_fraction(v, f"density[{k!r}]", "tasc_compress")
            for k, v in density.items()}
  rho = values[slow[0]]
  if any(values[a] != rho for a in slow):
    raise ValueError(f"tasc_compress: density={dict(density)!r} gives the axes of "
                     f"axis_name={axis_name!r} different densities; they form one exchange")
  fast_values = {values.get(a, 1.0) for a in fast}
  if fast_values <= {1.0}:
    return rho, False
  if fast_values == {rho}:
    return rho, True
  raise ValueError(
      f"tasc_compress: density={dict(density)!r}: the fast axis (dense_axis={dense_axis!r}) "
      f"must have density 1.0 (a dense reduce-scatter, then TASC over the slow axis) or the "
      f"slow axis's density {rho} (the same blocks on both axes, all-reduced hierarchically); "
      "a different sparse fast density would need nested supports, which are not offered")


def _check_curvature(curvature: PyTree, updates: PyTree, sensitivity: str) -> None:
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


@dataclasses.dataclass(frozen=True)
class TascSettings:
  """``method="tasc"``: :func:`tasc_compress`'s settings, and the curvature refresh: every
  ``hessian_every`` steps (``sensitivity="hutchinson"``) a Hutchinson estimate of the Hessian
  diagonal from ``num_probes`` probes of each worker's own batch."""
  density: float = 0.01
  block_size: int | None = None
  sensitivity: str = "hutchinson"
  score: str = "saliency"
  support: str = "global"
  wire_dtype: str = "float32"
  curvature_decay: float = 0.9
  eps: float = 0.1
  min_blocks_per_leaf: int = 0
  hessian_every: int = 100
  num_probes: int = 4


def _transformation(s: TascSettings, *, axis_name, error_feedback, fuse, seed, report_sent):
  return tasc_compress(axis_name=axis_name, density=s.density, block_size=s.block_size,
                       sensitivity=s.sensitivity, score=s.score, support=s.support,
                       wire_dtype=s.wire_dtype,
                       curvature_decay=s.curvature_decay, eps=s.eps,
                       min_blocks_per_leaf=s.min_blocks_per_leaf, error_feedback=error_feedback,
                       fuse=fuse, seed=seed, report_sent=report_sent)


def _curvature_refresh(s: TascSettings) -> registry.StepInputs | None:
  """Each worker's own Hutchinson estimate, from its batch: TASC sums the block scores over the
  workers anyway, so the refresh moves no bytes."""
  if s.sensitivity != "hutchinson":
    return None
  checks.check_int(s.hessian_every, "hessian_every", 1, "tasc")
  checks.check_int(s.num_probes, "num_probes", 1, "tasc")

  def make(loss_fn, params, batch, key, axis_name):
    return {"curvature": hessian.hutchinson_diagonal(loss_fn, params, key, s.num_probes, batch,
                                                     axis_name=axis_name, average=False)}
  return registry.StepInputs(every=s.hessian_every, make=make)


def _cost(s: TascSettings, shapes, topology, schedule) -> topology_lib.Cost:
  """The scores' and the blocks' all-reduces (float16 global support: and the bound's), or,
  with last step's support, one all-reduce carrying both."""
  wire = wire_formats.FORMATS[s.wire_dtype]
  size = registry.num_elements(shapes)
  block = s.block_size or auto_block_size([size], s.density)
  blocks = scores.num_blocks(size, block)
  payload = max(1, round(s.density * blocks)) * block
  reduce = lambda n, itemsize=wire.itemsize: topology_lib.all_reduce_cost(schedule, topology, n,
                                                                          itemsize)
  if s.support == "previous":
    return reduce(payload + blocks + wire.bound_entries)
  bound = [reduce(1, 4)] if wire.bound_entries else []
  return topology_lib.total([reduce(blocks), *bound, reduce(payload)])


BUDGET_BLOCK_SIZES = tuple(2**i for i in range(4, 15))  # 16 .. 16384


def _budget(s: TascSettings, shapes, cost, target: float) -> TascSettings | None:
  """TASC's equal-bytes search (:mod:`compressors.equal_bytes`): the density for ``target`` bytes
  at the settings' block size; with ``block_size=None``, at the smallest block size of
  :data:`BUDGET_BLOCK_SIZES` whose scores (one number per block, all-reduced whatever the
  density) take at most a quarter of the target, so that most bytes carry blocks. Where none
  does (a small model at a high ratio), the block size at which the scores and one block cost
  least, if that fits."""
  if s.block_size is not None:
    return equal_bytes.fit_field(s, "density", cost, target)
  size = registry.num_elements(shapes)
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
      return equal_bytes.fit_field(dataclasses.replace(s, block_size=block), "density", cost,
                                   target)
    fitting.append((one, block))
  if not fitting:
    return None
  return equal_bytes.fit_field(dataclasses.replace(s, block_size=min(fitting)[1]), "density",
                               cost, target)


METHODS = (registry.Method(
    name="tasc", summary="TASC: Hessian-aware block scores, one block support shared by all "
    "workers, the blocks all-reduced", settings=TascSettings, transformation=_transformation,
    step_inputs=_curvature_refresh, cost=_cost, budget=_budget),)
