"""PowerSGD: low-rank gradient compression by one power iteration (Vogels, Karimireddy & Jaggi,
NeurIPS 2019), with the ``start_powerSGD_iter`` and ``min_compression_rate`` of PyTorch's
``powerSGD_hook``.

Each matrix-shaped leaf ``M_i`` (worker ``i``'s gradient plus error-feedback residual, ``m x c``)
is exchanged as (Algorithm 1 of the paper, as in its reference implementation)::

  P = mean_i M_i Q          all-reduce of m x r
  P = orthonormal(P)        identical on every worker
  Q = mean_i M_i^T P        all-reduce of c x r; kept as the next step's warm start
  mean ~= P Q^T             the projection of mean_i M_i onto span(P)

and error feedback keeps ``M_i - P Q^T`` (the residual is the local matrix minus the
*aggregated* approximation, as in the reference code). With rank ``r`` at least the rank of
``mean_i M_i`` the result is the exact mean.

Shapes: a leaf of shape ``(d_1, ..., d_k, c)`` is compressed as the ``(d_1 ... d_k) x c`` matrix:
a Flax ``Dense`` kernel ``(in, out)`` as it is, a ``Conv`` kernel ``(h, w, in, out)`` as
``(h w in) x out``. The paper (PyTorch layout ``(out, in, h, w)``) compresses the transpose,
``out x (in h w)``; the compression rate ``m c / (r (m + c))`` is the same and the two are one
power iteration from either side. Leaves with fewer than 2 dimensions, and matrices whose rate is
below ``min_compression_rate``, are all-reduced densely, as in PyTorch's hook. A matrix left to
compress at a rate below 1 (``min_compression_rate`` below 1, or None) is refused, naming
``rank`` and its bound ``rows cols / (rows + cols)``: it would send more than the matrix (PyTorch
bounds the rank by ``min(rows, cols)``, which still sends more). A rank that sends every matrix
of a model densely is not seen leaf by leaf; a run (``experiments``) refuses it.

Orthonormalisation: the paper uses Gram-Schmidt; here Householder QR (``jnp.linalg.qr``) with
the signs fixed so that ``R`` has a non-negative diagonal, which is Gram-Schmidt's basis when
``P`` has full rank, and stays orthonormal to working precision when ``P`` is rank deficient
(rank above the gradient's rank, or a zero gradient), where Gram-Schmidt divides by ~0.

State: the warm-start basis ``Q`` (``c x r``) per compressed leaf, identical on every worker,
starting from a standard normal draw of the transformation's seed (``Compressor.init_leaf``
sees the leaf's shape). PowerSGD works leaf by leaf: ``compress(powersgd(...), fuse=False)``;
fusing leaves into one buffer is not offered, a fused buffer has no matrix shape (``init``
raises).
"""

import dataclasses
import math
import numbers
from typing import NamedTuple

import jax
import jax.numpy as jnp

from compressors import checks
from compressors import protocol
from compressors import method_table
from compressors.network import topology as topology_lib


class PowerSGDState(NamedTuple):
  """One leaf's PowerSGD state.

  Attributes:
    q: ``f32[c, rank]`` warm-start basis of a compressed leaf, None for a leaf sent densely.
  """
  q: jax.Array | None


def low_rank_shape(shape: tuple[int, ...], rank: int, min_compression_rate: float | None,
                   where: str) -> tuple[int, int] | None:
  """The ``(rows, cols)`` matrix a leaf of ``shape`` is compressed as, or None to send it densely.

  Args:
    shape: the leaf's shape.
    rank: the approximation rank.
    min_compression_rate: leaves whose rate ``rows cols / (rank (rows + cols))`` is below it go
      dense; None compresses every leaf, and a leaf that cannot be is an error. A leaf it
      leaves compressed at a rate below 1 (below ``min_compression_rate=1``, or None: ``rank``
      above ``rows cols / (rows + cols)``, so above ``min(rows, cols)`` too) is an error: it
      would send more than the leaf itself.
    where: names the leaf in errors.

  Returns:
    ``(rows, cols)`` or None.
  """
  if len(shape) < 2:
    if min_compression_rate is None:
      raise ValueError(
          f"powersgd: {where} has shape {tuple(shape)}, which is not a matrix, but "
          f"min_compression_rate=None forces every leaf to rank {rank}; pass a number (e.g. 2.0) "
          "so that vectors and scalars are all-reduced densely")
    return None
  rows, cols = math.prod(shape[:-1]), shape[-1]
  rate = rows * cols / (rank * (rows + cols))
  if min_compression_rate is not None and rate < min_compression_rate:
    return None
  if rank * (rows + cols) > rows * cols:  # rate < 1: more than the matrix itself
    bound = rows * cols // (rows + cols)
    allowed = (f"rank <= {bound} for this leaf" if bound else
               "no rank: this leaf is too small to compress")
    raise ValueError(
        f"powersgd: rank={rank} for {where}, shape {tuple(shape)} compressed as a {rows} x "
        f"{cols} matrix, sends rank x (rows + cols) = {rank * (rows + cols):,} numbers, more "
        f"than the {rows * cols:,} of the matrix itself; allowed: {allowed} (rank x (rows + "
        "cols) <= rows x cols, which also keeps it <= min(rows, cols)), or a "
        "min_compression_rate >= 1, which sends such leaves densely")
  return rows, cols


def powersgd(rank: int, *, start_step: int = 0,
             min_compression_rate: float | None = 2.0) -> protocol.Compressor:
  """The PowerSGD compressor (use it through :func:`powersgd_compress`).

  Args:
    rank: approximation rank ``r >= 1`` (the paper's rank 2 is its headline setting).
    start_step: steps all-reduced densely before compression starts (PyTorch's
      ``start_powerSGD_iter``). Compiled as a ``lax.cond``, which ``compressors.wire_bytes``
      charges at its dense branch: measure compressed bytes with ``start_step=0``.
    min_compression_rate: matrices compressed less than this go dense; None forces every leaf
      to rank ``r`` (an error for leaves that are not matrices). Below 1, or None, a matrix
      that rank ``r`` compresses at a rate below 1 is an error naming ``rank`` and the bound
      ``rows cols / (rows + cols)``: it would send more than dense.

  Returns:
    A :class:`compressors.Compressor` with a custom ``aggregate`` (two all-reduces).
  """
  if isinstance(rank, bool) or not isinstance(rank, numbers.Integral) or rank < 1:
    raise ValueError(f"powersgd: rank={rank!r}; allowed: an int >= 1")
  if isinstance(start_step, bool) or not isinstance(start_step, numbers.Integral) or start_step < 0:
    raise ValueError(f"powersgd: start_step={start_step!r}; allowed: an int >= 0")
  if min_compression_rate is not None and (
      isinstance(min_compression_rate, bool) or
      not isinstance(min_compression_rate, numbers.Real) or min_compression_rate < 0):
    raise ValueError(f"powersgd: min_compression_rate={min_compression_rate!r}; allowed: a "
                     "number >= 0 or None")
  rank = int(rank)

  def init_leaf(x, shape, key, where):
    if shape is None:
      raise ValueError(
          "powersgd: compresses each matrix-shaped leaf on its own, but the buffer fuses "
          "leaves (or is a hierarchical shard) and has no matrix shape: use "
          "compress(powersgd(...), axis_name=..., fuse=False)")
    matrix = low_rank_shape(shape, rank, min_compression_rate, where)
    if matrix is None:
      return PowerSGDState(q=None)
    return PowerSGDState(q=jax.random.normal(key, (matrix[1], rank), x.dtype))

  def aggregate(x, state, ctx):
    matrix = low_rank_shape(ctx.shape, rank, min_compression_rate, f"the leaf of shape {ctx.shape}")
    if matrix is None:
      out = _dense(x, ctx)
      return out._replace(state=state)

    def compressed(x, q):
      m = x.reshape(matrix)
      p = _orthonormal(_mean(_matmul(m, q), ctx))
      q = _mean(_matmul(m.T, p), ctx)
      approximation = _matmul(p, q.T).reshape(-1)
      return approximation, approximation, q

    def uncompressed(x, q):
      out = _dense(x, ctx)
      return out.mean, out.sent, q

    if start_step == 0:
      mean, sent, q = compressed(x, state.q)
    else:
      def compressed_varying(x, q):
        # The dense branch's `sent` and `q` vary across workers, the compressed branch's are
        # all-reduced; under shard_map both branches of a cond must carry the same type.
        mean, sent, q_new = compressed(x, q)
        return mean, _varying_like(sent, x), _varying_like(q_new, q)
      mean, sent, q = jax.lax.cond(ctx.step < start_step, uncompressed, compressed_varying, x,
                                   state.q)
    return protocol.Aggregate(mean=mean, sent=sent, state=PowerSGDState(q=q))

  return protocol.Compressor(name="powersgd", encode=None, decode=None, exchange="psum",
                         init_leaf=init_leaf, aggregate=aggregate)


def _matmul(a: jax.Array, b: jax.Array) -> jax.Array:
  # Full float32 products: accelerators' default matmul precision would round to bf16.
  return jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST)


def _varying_like(value: jax.Array, reference: jax.Array) -> jax.Array:
  """``value`` typed as varying over every mesh axis ``reference`` varies over (shard_map)."""
  varying = lambda x: jax.typeof(x).manual_axis_type.varying
  missing = tuple(a for a in varying(reference) if a not in varying(value))
  return jax.lax.pcast(value, missing, to="varying") if missing else value


def _orthonormal(p: jax.Array) -> jax.Array:
  """Orthonormal columns spanning ``p``'s (Gram-Schmidt's basis, computed by Householder QR)."""
  q, r = jnp.linalg.qr(p)
  return q * jnp.where(jnp.diagonal(r) < 0, -1, 1).astype(q.dtype)


def _dense(x: jax.Array, ctx: protocol.Context) -> protocol.Aggregate:
  """The uncompressed exchange of a flat buffer: its mean over workers, all of it sent."""
  return protocol.Aggregate(mean=ctx.mean(x), sent=x, state=())


def _mean(a: jax.Array, ctx: protocol.Context) -> jax.Array:
  """Mean over workers of a small matrix (``P`` or ``Q``)."""
  return _dense(a.reshape(-1), ctx).mean.reshape(a.shape)


@dataclasses.dataclass(frozen=True)
class PowerSGDSettings:
  """``method="powersgd"``: see :func:`powersgd` (``min_compression_rate`` None: every leaf)."""
  rank: int = checks.setting(2, checks.Rule(int, low=1))
  start_step: int = checks.setting(0, checks.Rule(int, low=0))
  min_compression_rate: float | None = checks.setting(2.0, checks.Rule(float, low=0,
                                                                       optional=True))

  def __post_init__(self):
    checks.check_settings(self, "powersgd")


def _cost(s: PowerSGDSettings, shapes, topology, schedule) -> topology_lib.Cost:
  """Per leaf, one after another: ``P`` (rows x rank) and ``Q`` (cols x rank) all-reduced, or
  the leaf itself where it is not compressed."""
  parts = []
  for i, shape in enumerate(shapes):
    matrix = low_rank_shape(shape, s.rank, s.min_compression_rate, f"leaf #{i}")
    sizes = [math.prod(shape)] if matrix is None else [matrix[0] * s.rank, matrix[1] * s.rank]
    parts += [topology_lib.all_reduce_cost(schedule, topology, size) for size in sizes]
  return topology_lib.total(parts)


METHODS = (method_table.Method(
    name="powersgd", summary="rank-r approximation by one power iteration, per matrix leaf "
    "(Vogels et al. 2019)", settings=PowerSGDSettings, fuse=False, budget="rank",
    compressor=lambda s: powersgd(s.rank, start_step=s.start_step,
                                  min_compression_rate=s.min_compression_rate),
    cost=_cost),)
