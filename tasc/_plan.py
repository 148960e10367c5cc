"""What TASC's settings decide for one buffer: its blocks, its payload's capacity, its leaf layout.

A :class:`BufferPlan` is made once per buffer size (:func:`buffer_plan`), from checked
:class:`tasc.TascSettings`; the compressor's steps, its state, its input check and the cost model
all read it, so the density is resolved into a number of blocks in this one place.
"""

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from tasc import _scores as scores
from tasc import _selection as selection
from tasc import _settings as settings_lib

AUTO_BLOCK_SIZES = (256, 128, 64, 32, 16, 8, 4, 2, 1)


class BufferPlan(NamedTuple):
  """How one buffer is cut into blocks and how many of them travel.

  Attributes:
    block_size: elements per block.
    num_blocks: blocks of the buffer (the last one shorter when ``block_size`` does not divide
      its size).
    selected: ``round(capacity_density * num_blocks)``, the blocks the density sends (0: the
      buffer is too small for these settings).
    capacity: the payload's static number of rows: ``selected``, or more when the
      ``min_blocks_per_leaf`` guarantees need more.
    leaf_groups: ``int32[shards, num_blocks]``, the leaf each block of each shard is assigned
      to (:func:`tasc._selection.leaf_groups`), read-only; None when no ``leaf_sizes`` were
      given (the buffer is one leaf, or :func:`tasc.tasc_compress` guarantees no block).
  """
  block_size: int
  num_blocks: int
  selected: int
  capacity: int
  leaf_groups: np.ndarray | None


def sends_a_block(size: int, block_size: int, density: float) -> bool:
  """Whether a buffer of ``size`` elements in blocks of ``block_size`` sends at least one block
  at ``density``."""
  return round(density * scores.num_blocks(size, block_size)) >= 1


def check_block_fits(block_size: int | None, size: int, what: str) -> None:
  """Refuses a ``block_size`` larger than the buffer of ``size`` elements it would cut (``what``
  names it): its one block, padded to ``block_size``, would send more than the buffer holds.
  The cost model checks the whole gradient so (:func:`tasc._transform._cost`)."""
  if block_size is not None and block_size > size:
    raise ValueError(
        f"tasc: block_size={block_size} is larger than {what}, {size:,} elements: its one "
        f"block, padded to {block_size:,} elements, would send more than the buffer; allowed: "
        f"block_size <= {size} (or None, which picks it from the size)")


def auto_block_size(size: int, density: float) -> int:
  """The largest of :data:`AUTO_BLOCK_SIZES` at which a buffer of ``size`` elements sends at
  least one block at ``density`` (1 if none does)."""
  return next((b for b in AUTO_BLOCK_SIZES if sends_a_block(size, b, density)), 1)


def buffer_plan(settings: settings_lib.TascSettings, size: int,
                leaf_sizes: Sequence[int] | None = None, shards: int = 1,
                block_density: float | None = None) -> BufferPlan:
  """The plan of a buffer of ``size`` elements.

  Args:
    settings: checked settings (:func:`tasc._settings.checked`) whose ``density`` is a number or
      a schedule.
    size: elements of the buffer (in hierarchical mode, one device's shard).
    leaf_sizes: sizes of the leaves fused into the buffer, for ``min_blocks_per_leaf``; None
      when the buffer is one leaf.
    shards: the fast axis's size in hierarchical mode (the fused leaves are cut into that many
      shards, ``size`` elements each), 1 otherwise.
    block_density: the density at which ``block_size=None`` picks the block size (default: the
      capacity's); the stages of a density warm-up pass their final density, so that they cut
      the buffer into the same blocks.

  Returns:
    The :class:`BufferPlan`.

  Raises:
    ValueError: ``leaf_sizes`` that do not make a buffer of ``size`` elements in ``shards``.
  """
  density = settings.capacity_density
  block_size = settings.block_size or auto_block_size(size, block_density or density)
  num_blocks = scores.num_blocks(size, block_size)
  selected = round(density * num_blocks)
  if leaf_sizes is None:
    return BufferPlan(block_size, num_blocks, selected,
                      max(selected, min(settings.min_blocks_per_leaf, num_blocks)), None)
  total = sum(leaf_sizes)
  if -(-total // shards) != size:
    raise ValueError(f"tasc: leaf_sizes add up to {total} elements, which in {shards} "
                     f"shard(s) do not make the buffer of {size} elements being compressed")
  groups = selection.leaf_groups(leaf_sizes, block_size, shards)
  groups.setflags(write=False)  # shared by every trace of the buffer
  capacity = max(selected, selection.guaranteed_count(groups, settings.min_blocks_per_leaf))
  return BufferPlan(block_size, num_blocks, selected, capacity, groups)
