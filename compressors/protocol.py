"""The exchange protocol: what a compressor is, what it may call, how payloads meet.

A :class:`Compressor` says how one worker's gradient *buffer* travels. A buffer is a flat 1-D
floating-point array: one pytree leaf (per-leaf mode) or every leaf fused into one (fused mode,
as Horovod's tensor fusion does). :func:`compressors.compress` adds error feedback around it and
runs it per worker inside ``shard_map``/``pmap``, before any sum.

Encode and decode
  ``encode(x, state, ctx) -> (payload, state)`` turns the buffer ``x`` (``f32[d]``) into a
  *payload*: a pytree of arrays whose shapes depend only on ``d`` and the compressor's static
  settings, never on the data, so one compiled program serves every step.
  ``decode(payload, ctx) -> f32[d]`` rebuilds the dense buffer the payload stands for, in the
  units of ``x``: ``decode(encode(x))`` is what this worker *sent*, and error feedback keeps
  ``x - decode(encode(x))`` for later.

How payloads meet (``exchange``)
  ``"psum"``
    Summable in compressed form: the payload itself is all-reduced (with the transformation's
    schedule, :meth:`Context.all_reduce`) and ``decode`` is linear in it, so
    ``decode(sum_i payload_i) / n`` is the mean. Per-worker bytes do not grow with the number of
    workers ``n``. Random-k (shared indices), fp16 transport, TernGrad's codes.
  ``"all_gather"``
    Not summable (workers pick different supports or scales): every payload is all-gathered and
    decoded on every worker in the same fixed order, so the mean is bit-identical everywhere.
    Per-worker bytes grow linearly with ``n``. ``decode_gathered(payloads, ctx)`` receives the
    payload leaves with a leading worker axis and returns the *sum* of the decoded buffers; it
    defaults to decoding each worker's payload in turn. The sum is divided by ``n``
    (``average="workers"``), or, with ``average="senders"``, each entry by the number of workers
    whose payload carries it (``sent_mask_of``; an entry nobody sent stays 0): SparseLoCo's
    mean, the authors' ``scatter_reduce_(reduce="mean", include_self=False)``. Two workers that
    send disjoint entries then move each entry by its sender's value, not by half of it.
  ``"two_phase"``
    Not summable, but bytes must not grow with ``n`` (1-bit Adam's compressed all-reduce, Tang et
    al. 2021): the buffer is cut into ``n`` chunks, each encoded; an all-to-all delivers chunk
    ``j`` of every worker to worker ``j``, which decodes and sums them, adds its own *owner*
    error-feedback memory, encodes the mean chunk again and all-gathers it. Both phases move
    about ``(n-1)/n`` of one compressed buffer. ``encode`` must not update compressor state in
    this mode (chunks are encoded independently).
  ``aggregate``
    A compressor whose protocol is none of these (PowerSGD's two rounds of all-reduce with an
    orthogonalisation between, TASC's shared block support) supplies
    ``aggregate(x, state, ctx) -> Aggregate`` itself, and takes means with the collectives the
    :class:`Context` offers (:meth:`Context.mean`, :meth:`Context.all_reduce`,
    :meth:`Context.all_gather`), which honour the transformation's schedule.

What was sent
  Every :class:`Aggregate` says which entries this worker sent (``sent_mask``: a boolean mask, or
  None for "every entry", as a quantizer sends), so that wrappers such as DGC's momentum
  correction (:func:`compressors.momentum_correction`) know what left the worker.
  Encode/decode compressors give it with ``sent_mask_of(payload, ctx)``. ("Support" is kept for
  the set of entries or blocks a sparsifier chooses, as in TASC's ``support`` setting.)

Residuals
  :func:`compressors.compress` keeps ``x - sent``; a sparsifier may instead keep ``x`` with the
  sent entries replaced, in place (:class:`ResidualAggregate`). In hierarchical mode each device
  compresses only the shard of the buffer it owns after a reduce-scatter over the fast axis
  (:func:`owned_shard`, :meth:`Context.owned_shard`).

Randomness comes from ``ctx``: ``shared_key`` is the same on every worker (random-k indices),
``private_key`` differs per worker (stochastic rounding); both change every step and buffer.
``decode`` may read ``ctx.shared_key`` only (the receiver of a payload does not know the
sender's private key).
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp

from compressors.network import axes
from compressors.network import collectives
from compressors.network import topology as topology_lib

EXCHANGES = ("psum", "all_gather", "two_phase")
# How an all-gathered sum becomes a mean: over all workers, or per entry over those that sent it.
AVERAGES = ("workers", "senders")


class Context(NamedTuple):
  """What a compressor may know about the step it runs in, and the collectives it may call.

  Attributes:
    axis_name: the mesh axis (or tuple of axes) the workers span; None for local compression.
    num_workers: static number of workers along ``axis_name``.
    size: static length ``d`` of the buffer being exchanged (decode needs it).
    shape: static shape of the gradient leaf the buffer holds in per-leaf mode (low-rank
      compressors reshape to it); ``(size,)`` for fused and sharded buffers.
    worker_index: this worker's index along ``axis_name`` (traced; 0 when local).
    step: the transformation's step counter (int32 scalar, identical on all workers).
    shared_key: a PRNG key identical on all workers, unique per step and buffer.
    private_key: a PRNG key unique per worker, step and buffer.
    extras: named extra arguments the compressor asked for (``Compressor.extra_args``), each
      flattened into the buffer's layout (e.g. ``"curvature"`` as ``f32[d]``).
    schedule: how :meth:`all_reduce` sums: ``"psum"``, a schedule of
      :data:`compressors.network.collectives.SCHEDULES`, or ``"auto"`` (the fastest on ``topology``
      by the cost model, chosen per payload size at trace time).
    topology: the :class:`compressors.network.topology.Topology` ``"auto"`` plans for, else None.
    owns_buffers: whether the gradient and residual buffers may be overwritten in place at no
      cost: True when the step made them (several leaves concatenated into one buffer) or when
      each is a flat leaf compressed locally (``axis_name`` None: the jit's own argument).
      Under an axis, per-worker state reaches the step through a reshape
      (:func:`compressors.drop_device_axis`), and XLA's CPU backend copies a jit argument
      before an in-place custom call that reaches it through a reshape.
    dense_axis: the fast axis of hierarchical mode, over which the buffer was reduce-scattered
      (this device holds its :meth:`owned_shard`); None in flat mode.
  """
  axis_name: axes.AxisName
  num_workers: int
  size: int
  shape: tuple[int, ...]
  worker_index: Any
  step: jax.Array
  shared_key: jax.Array
  private_key: jax.Array
  extras: dict[str, jax.Array]
  schedule: str = "psum"
  topology: Any = None
  owns_buffers: bool = False
  dense_axis: axes.AxisName = None

  def all_reduce(self, x: jax.Array) -> jax.Array:
    """The sum of ``x`` over the workers, by the transformation's schedule (``x`` itself when
    compressing locally); bit-identical on every worker."""
    if self.axis_name is None:
      return x
    if self.schedule == "psum":
      return jax.lax.psum(x, self.axis_name)
    schedule = self.schedule
    if schedule == "auto":
      schedule = topology_lib.fastest_schedule(self.topology, x.size, x.dtype.itemsize)
    return collectives.all_reduce(x, self.axis_name, schedule)

  def mean(self, x: jax.Array) -> jax.Array:
    """The mean over the workers of ``x`` (:meth:`all_reduce` divided by their number)."""
    return self.all_reduce(x) / self.num_workers

  def all_gather(self, x: jax.Array) -> jax.Array:
    """Every worker's ``x`` stacked on a new leading axis, in worker order, typed as identical
    on every worker."""
    return axes.all_gather_invariant(x, self.axis_name)

  def owned_shard(self, x: jax.Array) -> jax.Array:
    """This device's shard of a full-size buffer ``x`` in hierarchical mode (``x`` itself in
    flat mode): the part the reduce-scatter over ``dense_axis`` left here."""
    if self.dense_axis is None:
      return x
    return owned_shard(x, self.dense_axis, axes.num_workers(self.dense_axis))


class Aggregate(NamedTuple):
  """Result of one exchange.

  Attributes:
    mean: the mean over workers of the decoded buffers, bit-identical on every worker.
    sent: this worker's contribution as it left the worker (``decode(encode(x))``); error
      feedback keeps ``x - sent``.
    state: the compressor's updated state for this buffer.
    sent_mask: ``bool[d]``, the entries this worker sent; None when it sent every entry.
  """
  mean: jax.Array
  sent: jax.Array
  state: chex.ArrayTree
  sent_mask: jax.Array | None = None


class BufferState(NamedTuple):
  """Per-buffer state: the compressor's own and, for two-phase exchange, the owner's memory."""
  compressor: chex.ArrayTree
  owner_residual: jax.Array | None


def _no_state(x: jax.Array) -> tuple:
  del x
  return ()


class Compressor(NamedTuple):
  """How one gradient buffer is encoded, exchanged and decoded (see the module docstring).

  Attributes:
    name: short name used in errors and logs.
    encode: ``(x, state, ctx) -> (payload, state)``.
    decode: ``(payload, ctx) -> f32[d]``; linear in the payload when ``exchange == "psum"``.
    exchange: ``"psum"``, ``"all_gather"`` or ``"two_phase"``.
    init: ``(x) -> state`` for a buffer like ``x``; defaults to no state.
    init_leaf: ``(x, shape, key, where) -> state``, used instead of ``init`` by compressors whose
      state depends on the leaf's shape (PowerSGD's bases): ``shape`` is the leaf's shape in
      per-leaf mode and None for fused or sharded buffers; ``key`` is identical on every worker;
      ``where`` names the leaf for error messages.
    precondition: ``(g, state, ctx) -> (g', state)`` applied to the gradient *before* error
      feedback is added (TASC's empirical Fisher reads it there); None for most.
    decode_gathered: ``(payloads, ctx) -> f32[d]``, the sum of all workers' decoded payloads
      (leaves carry a leading worker axis); defaults to decoding them one at a time.
    aggregate: ``(x, state, ctx) -> Aggregate`` replacing encode/exchange/decode altogether
      (or a :class:`ResidualAggregate`).
    extra_args: names of ``update(..., **extra_args)`` pytrees (shaped like the gradients) the
      compressor reads from ``ctx.extras``.
    validate: ``(size, where) -> None`` raising a clear ValueError when the compressor cannot
      handle a buffer of ``size`` elements; ``where`` names the leaf for the message.
    sent_mask_of: ``(payload, ctx) -> bool[d]``, the entries a payload carries; None when every
      payload carries every entry.
    average: ``"workers"`` (the sum over ``n``) or ``"senders"`` (each entry's sum over the
      workers that sent it; ``exchange="all_gather"`` with ``sent_mask_of`` only).
  """
  name: str
  encode: Callable[..., tuple[chex.ArrayTree, chex.ArrayTree]] | None
  decode: Callable[..., jax.Array] | None
  exchange: str = "psum"
  init: Callable[[jax.Array], chex.ArrayTree] = _no_state
  init_leaf: Callable[..., chex.ArrayTree] | None = None
  precondition: Callable[..., tuple[jax.Array, chex.ArrayTree]] | None = None
  decode_gathered: Callable[..., jax.Array] | None = None
  aggregate: Callable[..., Aggregate] | None = None
  extra_args: tuple[str, ...] = ()
  validate: Callable[[int, str], None] | None = None
  sent_mask_of: Callable[..., jax.Array] | None = None
  average: str = "workers"


class ResidualAggregate(NamedTuple):
  """A ``Compressor.aggregate`` that can also add the error-feedback residual itself.

  :func:`compressors.compress` normally hands ``aggregate`` the buffer ``x = g + e`` and keeps
  ``x - sent`` as the new residual: a full pass over the buffer. A sparsifier can instead keep
  ``x`` with the sent entries replaced, in place (TASC zeroes the blocks it sends). Given as
  ``compressor.aggregate``, this pair lets ``compress`` call
  ``with_residual(g, e, state, ctx) -> (Aggregate, kept)`` with the gradient buffer ``g`` and
  the residual ``e`` (None without error feedback), ``kept`` being ``g + e - sent`` exactly
  (the returned ``Aggregate.sent`` is not used). Where the residual cannot be handed over (the
  hierarchical mode reduce-scatters ``g + e`` first), the plain ``aggregate(x, state, ctx)``
  runs, as for any compressor.
  """
  aggregate: Callable[..., Aggregate]
  with_residual: Callable[..., tuple[Aggregate, jax.Array | None]]

  def __call__(self, x: jax.Array, state: Any, ctx: Context) -> Aggregate:
    return self.aggregate(x, state, ctx)


def owned_shard(x: jax.Array, axis_name: axes.AxisName, group: int) -> jax.Array:
  """This device's ``1/group`` shard of ``x`` along ``axis_name`` (as a reduce-scatter keeps)."""
  padded = jnp.pad(x, (0, -x.size % group))
  shard = padded.size // group
  return jax.lax.dynamic_slice(padded, (axes.worker_index(axis_name) * shard,), (shard,))


def init_buffer_state(compressor: Compressor, x: jax.Array, num_workers: int | None,
                      error_feedback: bool, shape: tuple[int, ...] | None = None,
                      key: jax.Array | None = None, where: str = "the buffer") -> BufferState:
  """State for one buffer like ``x`` exchanged among ``num_workers`` workers.

  ``num_workers`` is None where no mesh axis is bound (``init`` called outside ``shard_map``);
  only the two-phase exchange needs it, to size the owner's error-feedback memory. ``shape``,
  ``key`` and ``where`` are for ``compressor.init_leaf``.
  """
  owner = None
  if compressor.exchange == "two_phase" and error_feedback:
    if num_workers is None:
      raise ValueError(
          f"compress: compressor {compressor.name!r} uses the two-phase exchange, whose state "
          "(the owner's error-feedback memory, one chunk of 1/n of the buffer) depends on the "
          "number of workers n: call init() inside jax.shard_map/jax.pmap where axis_name is "
          "bound (the state is per worker anyway), or pass error_feedback=False")
    owner = jnp.zeros((_chunk_size(x.size, num_workers),), x.dtype)
  own = (compressor.init(x) if compressor.init_leaf is None
         else compressor.init_leaf(x, shape, key, where))
  return BufferState(compressor=own, owner_residual=owner)


def exchange(compressor: Compressor, x: jax.Array, state: BufferState, ctx: Context) -> Aggregate:
  """Encodes ``x``, meets the other workers' payloads as the compressor says, decodes the mean.

  Args:
    compressor: the compressor.
    x: this worker's buffer (gradient plus error-feedback residual), ``f32[d]``.
    state: this buffer's :class:`BufferState`.
    ctx: the step's :class:`Context`.

  Returns:
    An :class:`Aggregate` whose ``state`` is the updated :class:`BufferState`.
  """
  if compressor.aggregate is not None:
    out = compressor.aggregate(x, state.compressor, ctx)
    return out._replace(state=state._replace(compressor=out.state))
  if compressor.exchange == "two_phase" and ctx.axis_name is not None:
    return _two_phase(compressor, x, state, ctx)

  payload, cstate = compressor.encode(x, state.compressor, ctx)
  sent = compressor.decode(payload, ctx)
  sent_mask = None if compressor.sent_mask_of is None else compressor.sent_mask_of(payload, ctx)
  out = Aggregate(mean=sent, sent=sent, state=state._replace(compressor=cstate),
                  sent_mask=sent_mask)
  if ctx.axis_name is None:
    return out
  if compressor.exchange == "psum":
    summed = jax.tree.map(ctx.all_reduce, payload)
    return out._replace(mean=compressor.decode(summed, ctx) / ctx.num_workers)
  if compressor.exchange == "all_gather":
    gathered = jax.tree.map(ctx.all_gather, payload)
    if compressor.average == "senders":
      total, senders = _sum_with_senders(compressor, gathered, ctx)
      return out._replace(mean=total / jnp.maximum(senders, 1))
    return out._replace(mean=_decode_gathered(compressor, gathered, ctx) / ctx.num_workers)
  raise ValueError(f"compressor {compressor.name!r}: exchange={compressor.exchange!r} is not one "
                   f"of {EXCHANGES}")


def _decode_gathered(compressor: Compressor, gathered: chex.ArrayTree, ctx: Context) -> jax.Array:
  if compressor.decode_gathered is not None:
    return compressor.decode_gathered(gathered, ctx)
  return sum_decoded(lambda p: compressor.decode(p, ctx), gathered, ctx.num_workers)


def _sum_with_senders(compressor: Compressor, gathered: chex.ArrayTree,
                      ctx: Context) -> tuple[jax.Array, jax.Array]:
  """Each entry's sum over the workers' payloads and the count of workers that sent it.

  One loop decodes and masks each payload: both read the same unpacked payload, which XLA then
  computes once per worker (two loops unpacked every payload twice).
  """
  def decode_and_count(p):
    decoded = compressor.decode(p, ctx)
    return decoded, compressor.sent_mask_of(p, ctx).astype(decoded.dtype)
  return sum_decoded(decode_and_count, gathered, ctx.num_workers)


def sum_decoded(decode_one: Callable[[chex.ArrayTree], jax.Array], payloads: chex.ArrayTree,
                count: int) -> jax.Array:
  """Sums ``decode_one(payloads[i])`` for ``i = 0 .. count-1`` in that order.

  A loop rather than a vectorised sum: it keeps one dense buffer live instead of ``count``, and
  fixes the summation order, so every worker gets the same bits on every backend.
  """
  def body(i, total):
    return jax.tree.map(jnp.add, total, decode_one(jax.tree.map(lambda p: p[i], payloads)))
  first = decode_one(jax.tree.map(lambda p: p[0], payloads))
  return jax.lax.fori_loop(1, count, body, first)


def _chunk_size(size: int, num_workers: int) -> int:
  return -(-size // num_workers)


def _two_phase(compressor: Compressor, x: jax.Array, state: BufferState,
               ctx: Context) -> Aggregate:
  """1-bit Adam's compressed all-reduce: all-to-all of chunks, owner re-encode, all-gather."""
  n, size = ctx.num_workers, x.size
  chunk = _chunk_size(size, n)
  chunks = jnp.pad(x, (0, n * chunk - size)).reshape(n, chunk)
  chunk_ctx = ctx._replace(size=chunk, shape=(chunk,))

  def keyed(i, key_base):
    """Chunk ``i``'s context: its encode and every decode of it see the same keys."""
    return chunk_ctx._replace(shared_key=jax.random.fold_in(ctx.shared_key, i),
                              private_key=jax.random.fold_in(key_base, i))

  def encode_chunk(c, i, key_base):
    payload, _ = compressor.encode(c, state.compressor, keyed(i, key_base))
    return payload

  def decode_chunk(payload, i):
    return compressor.decode(payload, keyed(i, ctx.private_key))

  def decode_chunks(payloads):
    return jax.vmap(decode_chunk)(payloads, jnp.arange(n))

  payloads = jax.vmap(encode_chunk, in_axes=(0, 0, None))(chunks, jnp.arange(n), ctx.private_key)
  sent = decode_chunks(payloads).reshape(-1)[:size]

  # Phase 1: worker j receives chunk j from every worker and owns its mean.
  received = jax.tree.map(
      lambda p: jax.lax.all_to_all(p, ctx.axis_name, split_axis=0, concat_axis=0), payloads)
  owned = ctx.worker_index
  owned_mean = sum_decoded(lambda p: decode_chunk(p, owned), received, n) / n

  # Phase 2: the owner re-encodes its mean chunk, keeping what that loses, and shares it.
  owner_input = owned_mean if state.owner_residual is None else owned_mean + state.owner_residual
  owner_key = jax.random.fold_in(ctx.private_key, n)
  owner_payload = encode_chunk(owner_input, owned, owner_key)
  owner_residual = state.owner_residual
  if owner_residual is not None:
    owner_residual = owner_input - decode_chunk(owner_payload, owned)
  mean = decode_chunks(jax.tree.map(ctx.all_gather, owner_payload)).reshape(-1)[:size]
  return Aggregate(mean=mean, sent=sent, state=state._replace(owner_residual=owner_residual))
