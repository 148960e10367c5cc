"""Which parameters skip weight decay and layer-wise adaptation (the trust ratio).

The reference implementations exclude biases and normalisation parameters from BOTH weight
decay and the trust ratio:

* BERT's LAMB (google-research/bert ``optimization.py``) and TF-addons ``LAMB``:
  ``exclude_from_weight_decay=["LayerNorm", "layer_norm", "bias"]``, and
  ``exclude_from_layer_adaptation`` defaults to the same list.
* MLPerf's LARS for ResNet-50 (mlcommons/training ``image_classification/tensorflow2``):
  ``skip_list=["batch_normalization", "bias"]``; skipped variables get the plain learning rate
  and no decay.

``optax.lamb``'s ``mask`` only masks the weight decay (the trust ratio still scales every
leaf) and ``optax.lars`` excludes nothing unless told to, so the optimizers here take one
``exclude`` argument that governs both.

An ``exclude`` specification is one of

* ``None`` or ``False``: nothing is excluded;
* a predicate ``exclude(path, leaf) -> bool`` where ``path`` is the leaf's key path as a tuple
  of strings (e.g. ``("params", "Dense_0", "bias")``) and ``leaf`` the array (only its static
  shape/dtype may decide, since it is called under ``jit``); True means excluded;
* a pytree of booleans with the parameters' structure (or a prefix of it); True means excluded.
"""

from collections.abc import Callable
import re
from typing import Any, Union

import chex
import jax
import numpy as np
import optax

ExcludePredicate = Callable[[tuple[str, ...], Any], bool]
Exclude = Union[None, bool, ExcludePredicate, chex.ArrayTree]

# Normalisation layers as Flax, Keras/TF and PyTorch name them (matched anywhere in the path).
_NORMALIZATION_LAYER = re.compile(r"(layer|batch|group)_?norm|batch_normalization", re.IGNORECASE)
# Leaf names of biases and normalisation gains/offsets (matched on the last path entry).
_BIAS_OR_GAIN = frozenset({"bias", "scale", "beta", "gamma"})


def path_names(key_path: tuple[Any, ...]) -> tuple[str, ...]:
  """Turns a ``jax.tree_util`` key path into a tuple of plain strings."""
  names = []
  for key in key_path:
    for attribute in ("key", "name", "idx"):
      if hasattr(key, attribute):
        names.append(str(getattr(key, attribute)))
        break
    else:
      names.append(str(key))
  return tuple(names)


def default_exclude(path: tuple[str, ...], leaf: Any) -> bool:
  """The default exclusion rule: biases and normalisation parameters.

  A leaf is excluded if it has at most one dimension (biases, LayerNorm/BatchNorm scales and
  offsets in every common layout), if its own name is ``bias``, ``scale``, ``beta`` or
  ``gamma``, or if any entry of its path names a normalisation layer (``LayerNorm``,
  ``layer_norm``, ``BatchNorm``, ``batch_normalization``, ``GroupNorm``...).

  Args:
    path: the leaf's key path as strings (see :func:`path_names`).
    leaf: the parameter (or update) array; only its number of dimensions is used.

  Returns:
    True when the leaf should receive neither weight decay nor trust-ratio scaling.
  """
  if np.ndim(leaf) <= 1:
    return True
  if path and path[-1].lower() in _BIAS_OR_GAIN:
    return True
  return any(_NORMALIZATION_LAYER.search(name) for name in path)


def _as_bool(value: Any, where: str) -> bool:
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(
        f"exclude: {where} is {value!r} (type {type(value).__name__}); an exclusion mask's leaves "
        "must be True (excluded) or False.")
  return bool(value)


def inclusion_mask(
    exclude: Exclude) -> chex.ArrayTree | Callable[[chex.ArrayTree], chex.ArrayTree] | None:
  """Converts an ``exclude`` specification into an ``optax.masked`` mask.

  Args:
    exclude: see the module docstring (True = excluded).

  Returns:
    None when nothing is excluded; otherwise a mask in optax's convention (True = the wrapped
    transformation applies): a boolean pytree for a mask pytree, or a function of the
    parameters (or updates) returning one for a predicate.

  Raises:
    TypeError: a mask pytree has a leaf that is not a boolean, or a predicate returns one.
  """
  if exclude is None or exclude is False:
    return None
  if callable(exclude):
    def mask_fn(tree: chex.ArrayTree) -> chex.ArrayTree:
      def included(key_path, leaf):
        path = path_names(key_path)
        return not _as_bool(exclude(path, leaf), f"the predicate's answer for {'/'.join(path)}")
      return jax.tree_util.tree_map_with_path(included, tree)
    return mask_fn
  return jax.tree_util.tree_map_with_path(
      lambda key_path, excluded: not _as_bool(
          excluded, f"the mask entry at {'/'.join(path_names(key_path)) or '<root>'}"),
      exclude)


def excluded(exclude: Exclude, params: chex.ArrayTree) -> chex.ArrayTree:
  """``exclude`` decided once on ``params``, as a mask pytree (True = excluded).

  What an optimizer on shards takes (``shard_axis``): a predicate there would see each
  device's shard, and a layer flattened and padded to shard it reads as a vector (excluded by
  :func:`default_exclude`) where the whole layer is a matrix.

  Args:
    exclude: see the module docstring.
    params: the whole parameters (arrays or ``jax.ShapeDtypeStruct``s).

  Returns:
    A boolean pytree shaped like ``params``.

  Raises:
    TypeError: as :func:`inclusion_mask`.
  """
  mask = inclusion_mask(exclude)
  if mask is None:
    return jax.tree.map(lambda _: False, params)
  included = mask(params) if callable(mask) else mask
  return jax.tree.map(lambda keep, _: not keep, included, params)


def masked(inner: optax.GradientTransformation,
           exclude: Exclude) -> optax.GradientTransformation:
  """Applies ``inner`` to the leaves that ``exclude`` does not exclude; the rest pass through.

  Args:
    inner: the transformation to restrict (weight decay and trust ratio, here).
    exclude: see the module docstring (True = excluded).

  Returns:
    ``optax.masked(inner, mask)``, or ``inner`` itself when nothing is excluded.
  """
  mask = inclusion_mask(exclude)
  return inner if mask is None else optax.masked(inner, mask)
