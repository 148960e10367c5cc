"""A worker's buffer ``a = g + e`` and its block energies ``||a_b||^2`` in one pass over memory.

TASC's compression needs both: ``a`` is what is sent and what error feedback keeps, the block
energies are its scores. As JAX they take two passes on CPU: XLA's CPU backend has no
multi-output fusion, so it writes the sum and reads it again for the reduction, and compression
costs the memory-bandwidth floor (``g + e``: two reads, one write) plus one more full read. On
CPU a small C++ kernel (``residual_energies.cc``, an XLA FFI custom call) makes one pass: each
element is summed, written over the residual's buffer and squared while in a register.

On NVIDIA GPUs a Pallas kernel (Triton) does the same: each program reads a tile of whole
blocks of ``g`` and ``e`` once, writes their sum over ``e``'s buffer and the tile's block
energies; the tail that no whole tile covers (fewer than a tile's elements) is summed by XLA and
written in place. Its outputs carry the varying manual axes of its inputs, so it runs inside
``shard_map`` with ``check_vma`` on, under ``vmap`` (simulated workers) and both. Before its first
use the kernel is compiled once on a small buffer; where that fails (no Pallas, a Triton that
cannot lower it) a warning says so once and the XLA version runs. A kernel is also chosen where
each call is traced: one that cannot be traced in that context is reported once, as a warning,
and the XLA version takes its place, so a kernel never stops a training step.

All versions give the same ``a`` bit for bit; the energies differ by float rounding (the kernels
sum each block in their own order, XLA in its own), which can only swap blocks whose scores tie
to rounding. The CPU kernel serves runs whose default backend is the CPU, the Pallas kernel runs
whose default backend is a GPU (``lax.platform_dependent``: a program compiled for another
platform, as the bytes of simulated workers are, takes the XLA version); for other dtypes, block
sizes that are not powers of two (Pallas), or where a kernel is unavailable, the XLA version
runs. ``TASC_ONE_PASS=0`` in the environment switches both kernels off (to compare, or to rule a
kernel out).

The kernel is compiled the first time it is needed, with ``$CXX`` (else ``c++``) against the
XLA FFI headers that ship with jaxlib, into ``$XDG_CACHE_HOME/tasc-jax`` (else
``~/.cache/tasc-jax``), keyed by the source, the compiler and jaxlib's version; it takes a few
seconds once. A failure is reported once, as a warning, and the XLA version is used.
"""

import ctypes
import functools
import hashlib
import os
import pathlib
import subprocess
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from tasc import _scores as scores

try:
  from jax.experimental import pallas as pl  # pylint: disable=g-import-not-at-top
  from jax.experimental.pallas import triton as pallas_triton  # pylint: disable=g-import-not-at-top
except ImportError:  # a JAX without Pallas: the XLA version runs on GPUs
  pl = pallas_triton = None

SOURCE = pathlib.Path(__file__).with_name("residual_energies.cc")
_TARGET = "tasc_residual_energies"
_SYMBOL = "TascResidualEnergies"


def residual_and_energies(g: jax.Array, e: jax.Array, block_size: int, *,
                          one_pass: bool = True) -> tuple[jax.Array, jax.Array]:
  """``(a, energies)``: ``a = g + e`` and ``||a_b||^2`` of each block of ``block_size``.

  On CPU and on GPUs, one pass that writes ``a`` over ``e``'s buffer (the module docstring);
  otherwise XLA's ``g + e`` and :func:`tasc.scores.block_energies`. A kernel that cannot be
  traced where this is called (inside ``shard_map``, under ``vmap``, for another platform) is
  reported once, as a warning, and XLA's version runs: the kernel never stops a step.

  Args:
    g: a flat buffer (the gradient).
    e: the residual, shaped and typed like ``g``.
    block_size: ``B``; the last block is shorter when ``B`` does not divide the size.
    one_pass: False takes XLA's two passes. The kernel writes over ``e``, which costs nothing
      when ``e`` is a buffer the step made or a flat argument of the jit, but when ``e`` is an
      argument seen through a reshape (per-worker state under ``shard_map``, see
      :func:`compressors.drop_device_axis`) XLA's CPU backend copies it in and out: there the
      two passes, which XLA fuses in place, are cheaper (the same holds on GPUs).

  Returns:
    ``a`` shaped like ``g``, and ``[ceil(size / B)]`` block energies in ``g``'s dtype.
  """
  if g.ndim != 1 or g.shape != e.shape or g.dtype != e.dtype:
    raise ValueError(f"residual_and_energies: g {jax.typeof(g).str_short()} and e "
                     f"{jax.typeof(e).str_short()} must be flat buffers of one shape and dtype")
  two_passes = functools.partial(_two_passes, block_size=block_size)
  kernels = one_pass_kernels(block_size) if one_pass and g.dtype == jnp.float32 else {}
  if not kernels:
    return two_passes(g, e)
  try:
    return jax.lax.platform_dependent(g, e, **kernels, default=two_passes)
  except Exception as error:  # pylint: disable=broad-except  # any kernel's tracing failure
    _warn_untraceable(f"{type(error).__name__}: {str(error)[:2000]}")
    return two_passes(g, e)


def one_pass_kernels(block_size: int) -> dict[str, Callable[..., tuple[jax.Array, jax.Array]]]:
  """The one-pass kernels for the default backend at ``block_size``, by the platform
  (``lax.platform_dependent``'s names) whose programs call them; empty when none serves it or
  ``TASC_ONE_PASS=0`` is set (XLA's two passes everywhere, e.g. to compare)."""
  if os.environ.get("TASC_ONE_PASS", "1") == "0":
    return {}
  backend = jax.default_backend()
  if backend == "cpu" and kernel_available():
    return {"cpu": functools.partial(_one_pass, block_size=block_size)}
  if backend == "gpu" and gpu_kernel_available(block_size):
    return {"cuda": functools.partial(pallas_one_pass, block_size=block_size)}
  return {}


def one_pass_available(block_size: int) -> bool:
  """Whether :func:`residual_and_energies` makes one pass on the default backend at
  ``block_size`` (float32 buffers it owns, in a context where the kernel traces)."""
  return bool(one_pass_kernels(block_size))


@functools.cache
def _warn_untraceable(error: str) -> None:
  """One warning per kind of failure, not one per traced step."""
  warnings.warn(f"tasc: the one-pass kernel cannot be traced here: {error}; block energies take "
                "a second pass over the buffer (same results, slower compression)",
                RuntimeWarning, stacklevel=3)


@functools.cache
def kernel_available() -> bool:
  """Whether the one-pass CPU kernel is built and registered with XLA (builds it once)."""
  try:
    library = ctypes.cdll.LoadLibrary(str(_build()))
  except (OSError, subprocess.CalledProcessError) as error:
    detail = getattr(error, "stderr", "") or ""
    warnings.warn(f"tasc: the one-pass CPU kernel ({SOURCE.name}) could not be built: {error} "
                  f"{detail[-2000:]}; block energies take a second pass over the buffer "
                  "(same results, slower compression)", RuntimeWarning, stacklevel=2)
    return False
  jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(getattr(library, _SYMBOL)),
                              platform="cpu")
  return True


def _build() -> pathlib.Path:
  """The kernel's shared library, compiled into the cache folder unless already there."""
  compiler = os.environ.get("CXX", "c++")
  source = SOURCE.read_bytes()
  key = hashlib.sha256(b"\0".join([source, compiler.encode(), jaxlib.__version__.encode()]))
  cache = pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache")
  library = cache / "tasc-jax" / f"residual_energies-{key.hexdigest()[:16]}.so"
  if not library.exists():
    library.parent.mkdir(parents=True, exist_ok=True)
    # Another process may build the same library at the same time: each writes its own file
    # and renames it into place, which is atomic.
    partial = library.with_name(f"{library.name}.{os.getpid()}.tmp")
    subprocess.run([compiler, "-O3", "-std=c++17", "-shared", "-fPIC", "-w",
                    f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", str(partial)],
                   check=True, capture_output=True, text=True)
    os.replace(partial, library)
  return library


def _one_pass(g: jax.Array, e: jax.Array, *, block_size: int) -> tuple[jax.Array, jax.Array]:
  # The results carry the inputs' types, varying manual axes included, as inside shard_map.
  buffer = jax.typeof(e)
  energies = buffer.update(shape=(scores.num_blocks(g.size, block_size),))
  call = jax.ffi.ffi_call(_TARGET, (buffer, energies), input_output_aliases={1: 0},
                          vmap_method="sequential")
  return call(g, e, block_size=np.int64(block_size))


# A GPU program's tile: about this many elements, whole blocks (Triton wants powers of two).
_GPU_TILE_ELEMENTS = 4096


def pallas_one_pass(g: jax.Array, e: jax.Array, *, block_size: int,
                    interpret: bool = False) -> tuple[jax.Array, jax.Array]:
  """``(a, energies)`` as :func:`residual_and_energies`, by the Pallas kernel: one read of ``g``
  and ``e``, ``a`` written over ``e``'s buffer (``input_output_aliases``).

  Each program takes a tile of ``rows`` whole blocks (``rows * block_size`` about
  :data:`_GPU_TILE_ELEMENTS`, powers of two); the elements after the last whole tile are summed
  by XLA and written in place, their energies appended. ``interpret`` runs the kernel in
  Pallas's interpreter (any backend: tests).

  Raises:
    ValueError: ``block_size`` is not a power of two.
  """
  if block_size & (block_size - 1):
    raise ValueError(f"pallas_one_pass: block_size={block_size} must be a power of two")
  rows = max(1, _GPU_TILE_ELEMENTS // block_size)
  tile = rows * block_size
  programs = g.size // tile
  if programs == 0:
    return _two_passes(g, e, block_size=block_size)

  def kernel(g_ref, e_ref, unused_energies_ref, a_ref, energies_ref):
    del unused_energies_ref  # the energies' buffer, aliased to the output (below)
    a = g_ref[...] + e_ref[...]
    a_ref[...] = a
    energies_ref[...] = jnp.sum((a * a).reshape(rows, block_size), axis=1)

  covered = programs * tile
  # The outputs vary over every manual axis either input does: inside shard_map (check_vma)
  # pallas_call needs that type on its outputs, which eval_shape of the sum carries. The
  # energies are written into a buffer passed in with that type, not a fresh output: Pallas's
  # interpreter (the CPU tests) starts a fresh output as a value varying over no axis.
  summed = jax.eval_shape(jnp.add, g, e)
  varying = tuple(getattr(summed.manual_axis_type, "varying", ()))
  energies = jnp.zeros((programs * rows,), g.dtype)
  if varying:
    energies = jax.lax.pcast(energies, varying, to="varying")
  a, energies = pl.pallas_call(
      kernel, grid=(programs,),
      in_specs=[pl.BlockSpec((tile,), lambda i: (i,))] * 2 + [
          pl.BlockSpec((rows,), lambda i: (i,))],
      out_specs=[pl.BlockSpec((tile,), lambda i: (i,)), pl.BlockSpec((rows,), lambda i: (i,))],
      out_shape=[summed, summed.update(shape=energies.shape)],
      input_output_aliases={1: 0, 2: 1}, interpret=interpret,
      # Triton, not Mosaic GPU (some JAX versions' default), whose copies take <= 256 elements.
      compiler_params=pallas_triton.CompilerParams(num_warps=4, num_stages=1))(g, e, energies)
  if covered == g.size:
    return a, energies
  # The tail kept e's values in the aliased buffer: sum it there.
  tail = g[covered:] + e[covered:]
  return (jax.lax.dynamic_update_slice(a, tail, (covered,)),
          jnp.concatenate([energies, scores.block_energies(tail, block_size)]))


@functools.cache
def gpu_kernel_available(block_size: int) -> bool:
  """Whether the Pallas kernel compiles for the default GPU at ``block_size`` (tried once on a
  small buffer; a failure is reported once, as a warning)."""
  if pl is None or block_size & (block_size - 1):
    return False
  rows = max(1, _GPU_TILE_ELEMENTS // block_size)
  probe = jax.ShapeDtypeStruct((2 * rows * block_size + 1,), jnp.float32)
  try:
    jax.jit(functools.partial(pallas_one_pass, block_size=block_size)).lower(
        probe, probe).compile()
  except Exception as error:  # pylint: disable=broad-except  # any lowering or compile failure
    warnings.warn(f"tasc: the one-pass GPU kernel (Pallas) does not compile here: "
                  f"{type(error).__name__}: {str(error)[:2000]}; block energies take a second "
                  "pass over the buffer (same results, slower compression)", RuntimeWarning,
                  stacklevel=2)
    return False
  return True


def _two_passes(g: jax.Array, e: jax.Array, *, block_size: int) -> tuple[jax.Array, jax.Array]:
  a = g + e
  return a, scores.block_energies(a, block_size)
