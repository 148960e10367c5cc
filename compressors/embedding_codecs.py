"""Compressed payloads of the embedding exchange's row all-to-alls, forward and backward, with
error feedback on the backward one (:mod:`compressors.parallel.embeddings`).

The exchange moves rows twice (:func:`compressors.parallel.embeddings.pooled_lookup`): forward,
each owner returns the rows a device asked for (``[n, capacity, width]``, one bucket per
device), and backward, each device returns those rows' gradients to their owners (the same
shape). :class:`Codecs` names a codec for each; the names are the registered per-step methods
whose transport fits a row (:mod:`compressors.registry`), and their encoders are reused:

* ``dense``: float32 (the exchange as it is);
* ``bf16``, ``fp16``: the rows cast and sent bit-cast as ``uint16`` (``_dense.cast``'s two-phase
  payload), so the compiled program moves 2 bytes an entry on every backend;
* ``int8``, ``int4``: ``_intq.quantize`` with one bucket per row, i.e. a float32 scale per row;
  int4 codes are packed two to a byte over a bucket's rows (``_packing``);
* backward only, ``topk``: the ``k = max(1, round(topk_fraction * capacity))`` rows of largest
  L2 norm of each bucket, sent as their float32 values and int32 slot indices; ``threshold``:
  the rows whose L2 norm reaches ``threshold``, at most ``k`` of them (the largest first), at the
  same fixed size (unused places send zero rows). Both are dense all-to-alls of fixed size.

Bytes of one bucket of ``c`` rows of width ``w`` (:func:`payload_bytes`; the all-to-all sends
``(n - 1) / n`` of ``n`` buckets): dense ``4cw``; 16-bit ``2cw``; int8 ``cw + 4c``; int4
``ceil(cw / 2) + 4c``; top-k and threshold ``k (4w + 4)``. The keys the forward pass sends first
(int32) are never compressed.

The backward exchange is a ``jax.custom_vjp`` around the rows' all-to-all
(:func:`row_exchange`): forward and backward payloads are encoded independently, and the
backward pass adds the error-feedback residual of every row it sends before encoding it.

Error feedback (``error_feedback=True`` with a lossy backward codec): what a device did not send
of a row's gradient, ``e' = (g + e) - sent`` (float32; exact, as ``sent`` is within a factor 2
of ``g + e`` or zero), is kept and added to the same row's gradient the next time this device
sends it, however many steps later. Where it lives: only the sender knows its error (the owner
sees the sum of every device's decoded rows), and a device may next send any row of the bank,
so each device keeps a residual over *every key of the bank*, ``[n * bank_rows, width]`` (and
``[column_rows * n, column_width]`` for column-placed tables): a whole bank per device, ``n``
times the memory of the sharded tables it shadows (:func:`residual_bytes_per_device`, charged by
:func:`compressors.parallel.embeddings.check_budget` and by the run's state bytes). A smaller
cache (a few hot rows) would have to drop or flush the errors it evicts; this residual drops
nothing.

The residual is training state, not a closure: a sharded leaf of the parameters
(``params["exchange"]``, spec ``P(axis)``, one block per device, checkpointed with them) that
the loss reads and whose *gradient* is its change: the backward pass defines the cotangent of
the residual rows it read as ``e' - e``, and :func:`with_residual_updates` applies that change
(undoing the sharded step's division of sharded gradients by the worker count). It is a
parameter leaf, not optimizer state, because the loss must read it and the step hands the loss
only the parameters; ``num_params`` leaves it out. Storing ``e + (e' - e)`` rounds once more in
float32 (and the division and product by a worker count that is not a power of two once each):
within an ulp of ``e'``, as ``tests/test_embedding_codecs.py`` checks against float64. A step
skipped for a non-finite gradient keeps the old residual.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from compressors import _dense
from compressors import _intq
from compressors import protocol
from compressors.parallel import embeddings

FORWARD = ("dense", "bf16", "fp16", "int8", "int4")
BACKWARD = FORWARD + ("topk", "threshold")
_CASTS = {"bf16": "bfloat16", "fp16": "float16"}
_BITS = {"int8": 8, "int4": 4}
RESIDUAL = "exchange"  # the parameters' key of the error-feedback residuals


class Codecs(NamedTuple):
  """The exchange's codecs (see the module docstring).

  Attributes:
    forward: the rows' codec, one of :data:`FORWARD`.
    backward: the rows' gradients' codec, one of :data:`BACKWARD`.
    error_feedback: whether a lossy backward codec keeps what it did not send.
    topk_fraction: ``topk`` / ``threshold``: rows sent per bucket, as a fraction of its capacity.
    threshold: ``threshold``: the L2 norm a row's gradient needs to be sent.
  """
  forward: str = "dense"
  backward: str = "dense"
  error_feedback: bool = True
  topk_fraction: float = 0.25
  threshold: float = 1e-3

  @property
  def compressed(self) -> bool:
    """Whether either direction is not float32."""
    return self.forward != "dense" or self.backward != "dense"

  @property
  def keeps_residual(self) -> bool:
    """Whether the backward exchange keeps an error-feedback residual."""
    return self.error_feedback and self.backward != "dense"

  def selected(self, capacity: int) -> int:
    """Rows ``topk`` / ``threshold`` send per bucket of ``capacity`` rows."""
    return max(1, min(capacity, round(self.topk_fraction * capacity)))


def codecs(forward: str = "dense", backward: str = "dense", error_feedback: bool = True,
           topk_fraction: float = 0.25, threshold: float = 1e-3) -> Codecs:
  """:class:`Codecs`, checked.

  Raises:
    ValueError: one line naming the ``config.embedding`` field, its value and what is allowed.
  """
  for field, value, allowed in (("exchange", forward, FORWARD),
                                ("gradient_exchange", backward, BACKWARD)):
    if value not in allowed:
      raise ValueError(f"config.embedding.{field}={value!r} is not allowed; allowed: "
                       f"{list(allowed)}")
  if not isinstance(error_feedback, (bool, np.bool_)):
    raise ValueError(f"config.embedding.error_feedback={error_feedback!r} is not allowed; "
                     "allowed: true or false")
  if not 0 < topk_fraction <= 1:
    raise ValueError(f"config.embedding.topk_fraction={topk_fraction!r} is not allowed; "
                     "allowed: a fraction of a bucket's rows in (0, 1]")
  if not 0 < threshold < float("inf"):
    raise ValueError(f"config.embedding.threshold={threshold!r} is not allowed; allowed: a "
                     "finite row norm > 0")
  return Codecs(forward, backward, bool(error_feedback), float(topk_fraction), float(threshold))


def check_plan(c: Codecs, row_reduction: str) -> None:
  """Refuses compression of bags that are reduce-scattered (summed on the wire: encoded
  payloads cannot be), in one line."""
  if c.compressed and row_reduction != "all_to_all":
    raise ValueError(f"config.embedding.exchange={c.forward!r}, gradient_exchange="
                     f"{c.backward!r} with row_reduction={row_reduction!r}: reduce-scattered "
                     "bags are summed on the wire; allowed: row_reduction='all_to_all', or "
                     "both exchanges 'dense'")


def payload_bytes(c: Codecs, direction: str, rows: int, width: int) -> int:
  """Bytes of one bucket of ``rows`` rows of ``width`` float32 entries as ``direction``
  (``"forward"`` or ``"backward"``) sends it."""
  codec = c.forward if direction == "forward" else c.backward
  if codec == "dense":
    return 4 * rows * width
  if codec in _CASTS:
    return 2 * rows * width
  if codec in _BITS:
    return _intq.payload_bytes(rows * width, _BITS[codec], width)
  return c.selected(rows) * (4 * width + 4)


def _context(size: int) -> protocol.Context:
  """A local compressor's context (one worker, nothing random: nearest rounding)."""
  return protocol.Context(axis_name=None, num_workers=1, size=size, shape=(size,),
                          worker_index=0, step=jnp.zeros((), jnp.int32), shared_key=None,
                          private_key=None, extras={})


def _compressor(codec: str, width: int) -> protocol.Compressor:
  if codec in _CASTS:
    return _dense.cast(_CASTS[codec], exchange="two_phase")  # bit-cast to uint16
  return _intq.quantize(_BITS[codec], bucket=width)  # a scale per row


def _selection(c: Codecs, rows):
  """The slots ``topk`` / ``threshold`` send of one bucket ``[capacity, width]``, and whether
  each holds a selected row."""
  score = jnp.sum(rows * rows, axis=1)
  if c.backward == "threshold":
    score = jnp.where(score >= c.threshold ** 2, score, -1.0)
  picked, slots = jax.lax.top_k(score, c.selected(rows.shape[0]))
  return slots.astype(jnp.int32), picked >= 0


def encode(c: Codecs, codec: str, rows):
  """One bucket ``[capacity, width]`` as ``codec`` sends it (a pytree of arrays)."""
  if codec == "dense":
    return rows
  if codec in ("topk", "threshold"):
    slots, valid = _selection(c, rows)
    return jnp.where(valid[:, None], rows[slots], 0), slots
  return _compressor(codec, rows.shape[1]).encode(rows.reshape(-1), (), _context(rows.size))[0]


def decode(codec: str, payload, capacity: int, width: int):
  """The ``[capacity, width]`` rows of one bucket's payload."""
  if codec == "dense":
    return payload
  if codec in ("topk", "threshold"):
    values, slots = payload
    return jnp.zeros((capacity, width), values.dtype).at[slots].set(values)
  size = capacity * width
  return _compressor(codec, width).decode(payload, _context(size)).reshape(capacity, width)


def _sent(c: Codecs, codec: str, buckets, axis):
  """``buckets`` ``[n, capacity, width]`` encoded, all-to-all'd and decoded by the receivers;
  also what this device's payload decodes to (what it sent)."""
  _, capacity, width = buckets.shape
  payload = jax.vmap(lambda b: encode(c, codec, b))(buckets)
  unpack = jax.vmap(lambda p: decode(codec, p, capacity, width))
  arrived = jax.tree.map(lambda x: jax.lax.all_to_all(x, axis, 0, 0, tiled=True), payload)
  return unpack(arrived), unpack(payload)


def _exchange(c: Codecs, axis, found, carried):
  return _sent(c, c.forward, found, axis)[0]


def _exchange_forward(c, axis, found, carried):
  return _exchange(c, axis, found, carried), carried


def _exchange_backward(c, axis, carried, cotangent):
  compensated = cotangent if carried is None else cotangent + carried
  arrived, sent = _sent(c, c.backward, compensated, axis)
  if carried is None:
    return arrived, None
  # What was not sent, e' = (g + e) - sent, is the residual's next value: its change, e' - e,
  # is the residual rows' cotangent (see with_residual_updates).
  return arrived, (compensated - sent) - carried


row_exchange = jax.custom_vjp(_exchange, nondiff_argnums=(0, 1))
row_exchange.defvjp(_exchange_forward, _exchange_backward)
row_exchange.__doc__ = """``row_exchange(codecs, axis, found, carried)``: the rows ``found``
``[n, capacity, width]`` that this device returns to each device, all-to-all'd by
``codecs.forward``; their cotangents return by ``codecs.backward`` with ``carried`` (the
residual of each received slot, ``[n, capacity, width]``, or None) added first, and ``carried``'s
cotangent is the residual's change."""


def residual_shapes(p: embeddings.Plan, c: Codecs) -> dict[str, tuple[int, int]]:
  """Global shapes of the error-feedback residuals (sharded over the axis, a block per device):
  ``bank`` ``[n * n * bank_rows, width]`` when the all-to-all fetches bank rows, ``column_bank``
  ``[n * column_rows * n, column_width]`` with column-placed tables; none without error
  feedback."""
  if not c.keeps_residual:
    return {}
  n, shapes = p.devices, {}
  if p.fetched:
    shapes["bank"] = (n * n * p.bank_rows, p.width)
  if p.tables("column"):
    shapes["column_bank"] = (n * p.column_rows * n, p.column_width)
  return shapes


def init_residual(p: embeddings.Plan, c: Codecs) -> dict:
  """The residuals at zero (:func:`residual_shapes`), float32."""
  return {k: jnp.zeros(shape, jnp.float32) for k, shape in residual_shapes(p, c).items()}


def residual_bytes_per_device(p: embeddings.Plan, c: Codecs) -> int:
  """Bytes of one device's residual blocks: a whole bank (and column bank) per device."""
  return sum(4 * rows * width // p.devices for rows, width in residual_shapes(p, c).values())


def rows_exchange(c: Codecs, residual: dict | None, axis):
  """:func:`compressors.parallel.embeddings.pooled_lookup`'s ``rows_exchange``: ``(bank,
  found, slot_keys) -> received`` by :func:`row_exchange`, each slot's residual read from this
  device's block of ``residual`` (``bank``: rows indexed by the slot's bank key; column bank:
  by ``key * n + block``); keys outside the bank (empty slots) read and keep nothing."""
  def exchange(bank, found, slot_keys):
    carried = None
    if residual and bank in residual:
      index = slot_keys
      if bank == "column_bank":
        index = slot_keys * found.shape[0] + jnp.arange(found.shape[0])[:, None]
      carried = residual[bank].at[index].get(mode="fill", fill_value=0)
    return row_exchange(c, axis, found, carried)
  return exchange


def with_residual_updates(tx: optax.GradientTransformation,
                          workers: int) -> optax.GradientTransformation:
  """``tx`` on every sharded leaf but the residuals (``params["exchange"]``), whose update is
  their change: their gradient times ``workers`` (the sharded step divides a sharded leaf's
  gradient by the worker count; a residual's is this device's own, not a sum over workers)."""
  def labels(params):
    return jax.tree_util.tree_map_with_path(
        lambda path, _: "residual" if getattr(path[0], "key", None) == RESIDUAL else "table",
        params)
  return optax.multi_transform({"table": tx, "residual": optax.scale(float(workers))}, labels)


def exchange_bytes(p: embeddings.Plan, batch: int, hotness, capacity: int | None,
                   c: Codecs) -> dict[str, float]:
  """:func:`compressors.parallel.embeddings.exchange_bytes` with the rows' payloads encoded by
  ``c`` (:func:`payload_bytes`)."""
  return embeddings.exchange_bytes(p, batch, hotness, capacity,
                                   payload_bytes=lambda *a: payload_bytes(c, *a))
