"""The compressor abstraction: encode, how payloads meet across workers, decode.

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
    Summable in compressed form: the payload itself is all-reduced and ``decode`` is linear in
    it, so ``decode(sum_i payload_i) / n`` is the mean. Per-worker bytes do not grow with the
    number of workers ``n``. Random-k (shared indices), fp16 transport, TernGrad's codes,
    TASC's shared block support.
  ``"all_gather"``
    Not summable (workers pick different supports or scales): every payload is all-gathered and
    decoded on every worker in the same fixed order, so the mean is bit-identical everywhere.
    Per-worker bytes grow linearly with ``n``. ``decode_gathered(payloads, ctx)`` receives the
    payload leaves with a leading worker axis and returns the *sum* of the decoded buffers; it
    defaults to decoding each worker's payload in turn.
  ``"two_phase"``
    Not summable, but bytes must not grow with ``n`` (1-bit Adam's compressed all-reduce, Tang et
    al. 2021): the buffer is cut into ``n`` chunks, each encoded; an all-to-all delivers chunk
    ``j`` of every worker to worker ``j``, which decodes and sums them, adds its own *owner*
    error-feedback memory, encodes the mean chunk again and all-gathers it. Both phases move
    about ``(n-1)/n`` of one compressed buffer. ``encode`` must not update compressor state in
    this mode (chunks are encoded independently).
  ``aggregate``
    A compressor whose protocol is none of these (PowerSGD's two rounds of all-reduce with an
    orthogonalisation between) supplies ``aggregate(x, state, ctx) -> Aggregate`` itself.

Randomness comes from ``ctx``: ``shared_key`` is the same on every worker (random-k indices),
``private_key`` differs per worker (stochastic rounding); both change every step and buffer.
``decode`` may read ``ctx.shared_key`` only (the receiver of a payload does not know the
sender's private key).
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from compressors import axes

PyTree = Any
EXCHANGES = ("psum", "all_gather", "two_phase")


class Context(NamedTuple):
  """What a compressor may know about the step it runs in.

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
    schedule: how summable payloads are all-reduced: ``"psum"``, an explicit algorithm of
      :mod:`compressors.collectives`, or ``"auto"`` (the fastest on ``topology`` by the cost
      model, chosen per payload size at trace time).
    topology: the :class:`compressors.topology.Topology` ``"auto"`` plans for, else None.
    owns_buffers: whether the gradient and residual buffers may be overwritten in place at no
      cost: True when the step made them (several leaves concatenated into one buffer) or when
      each is a flat leaf compressed locally (``axis_name`` None: the jit's own argument).
      Under an axis, per-worker state reaches the step through a reshape
      (:func:`compressors.drop_device_axis`), and XLA's CPU backend copies a jit argument
      before an in-place custom call that reaches it through a reshape.
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


class Aggregate(NamedTuple):
  """Result of one exchange.

  Attributes:
    mean: the mean over workers of the decoded buffers, bit-identical on every worker.
    sent: this worker's contribution as it left the worker (``decode(encode(x))``); error
      feedback keeps ``x - sent``.
    state: the compressor's updated state for this buffer.
  """
  mean: jax.Array
  sent: jax.Array
  state: PyTree


class BufferState(NamedTuple):
  """Per-buffer state: the compressor's own and, for two-phase exchange, the owner's memory."""
  compressor: PyTree
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
      feedback is added (DGC's momentum correction and local clipping); None for most.
    decode_gathered: ``(payloads, ctx) -> f32[d]``, the sum of all workers' decoded payloads
      (leaves carry a leading worker axis); defaults to decoding them one at a time.
    aggregate: ``(x, state, ctx) -> Aggregate`` replacing encode/exchange/decode altogether.
    extra_args: names of ``update(..., **extra_args)`` pytrees (shaped like the gradients) the
      compressor reads from ``ctx.extras``.
    validate: ``(size, where) -> None`` raising a clear ValueError when the compressor cannot
      handle a buffer of ``size`` elements; ``where`` names the leaf for the message.
  """
  name: str
  encode: Callable[..., tuple[PyTree, PyTree]] | None
  decode: Callable[..., jax.Array] | None
  exchange: str = "psum"
  init: Callable[[jax.Array], PyTree] = _no_state
  init_leaf: Callable[..., PyTree] | None = None
  precondition: Callable[..., tuple[jax.Array, PyTree]] | None = None
  decode_gathered: Callable[..., jax.Array] | None = None
  aggregate: Callable[..., Aggregate] | None = None
  extra_args: tuple[str, ...] = ()
  validate: Callable[[int, str], None] | None = None


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
  own = compressor.init(x) if compressor.init_leaf is None else compressor.init_leaf(x, shape, key, where)
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
  state = state._replace(compressor=cstate)
  if ctx.axis_name is None:
    return Aggregate(mean=sent, sent=sent, state=state)
  if compressor.exchange == "psum":
    summed = jax.tree.map(lambda p: _all_reduce(p, ctx), payload)
    return Aggregate(mean=compressor.decode(summed, ctx) / ctx.num_workers, sent=sent, state=state)
  if compressor.exchange == "all_gather":
    gathered = jax.tree.map(lambda p: axes.all_gather_invariant(p, ctx.axis_name), payload)
    total = _decode_gathered(compressor, gathered, ctx)
    return Aggregate(mean=total / ctx.num_workers, sent=sent, state=state)
  raise ValueError(f"compressor {compressor.name!r}: exchange={compressor.exchange!r} is not one "
                   f"of {EXCHANGES}")


def _all_reduce(payload: jax.Array, ctx: Context) -> jax.Array:
  if ctx.schedule == "psum":
    return jax.lax.psum(payload, ctx.axis_name)
  # pylint: disable=import-outside-toplevel  # schedules are optional machinery
  from compressors import collectives
  from compressors import topology
  schedule = ctx.schedule
  if schedule == "auto":
    schedule = topology.fastest_schedule(ctx.topology, payload.size, payload.dtype.itemsize)
  return collectives.all_reduce(payload, ctx.axis_name, schedule)


def _decode_gathered(compressor: Compressor, gathered: PyTree, ctx: Context) -> jax.Array:
  if compressor.decode_gathered is not None:
    return compressor.decode_gathered(gathered, ctx)
  return sum_decoded(lambda p: compressor.decode(p, ctx), gathered, ctx.num_workers)


def sum_decoded(decode_one: Callable[[PyTree], jax.Array], payloads: PyTree,
                count: int) -> jax.Array:
  """Sums ``decode_one(payloads[i])`` for ``i = 0 .. count-1`` in that order.

  A loop rather than a vectorised sum: it keeps one dense buffer live instead of ``count``, and
  fixes the summation order, so every worker gets the same bits on every backend.
  """
  def body(i, total):
    return total + decode_one(jax.tree.map(lambda p: p[i], payloads))
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
  gathered = jax.tree.map(lambda p: axes.all_gather_invariant(p, ctx.axis_name), owner_payload)
  mean = decode_chunks(gathered).reshape(-1)[:size]
  return Aggregate(mean=mean, sent=sent, state=state._replace(owner_residual=owner_residual))
