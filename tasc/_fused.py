"""A worker's buffer ``a = g + e`` and its block energies ``||a_b||^2`` in one pass over memory.

TASC's compression needs both: ``a`` is what is sent and what error feedback keeps, the block
energies are its scores. As JAX they take two passes on CPU: XLA's CPU backend has no
multi-output fusion, so it writes the sum and reads it again for the reduction, and compression
costs the memory-bandwidth floor (``g + e``: two reads, one write) plus one more full read. On
CPU a small C++ kernel (``residual_energies.cc``, an XLA FFI custom call) makes one pass: each
element is summed, written over the residual's buffer and squared while in a register.

On GPUs XLA's own passes run: XLA's GPU backend fuses the reduction into the sum (multi-output
fusion) when the block sums read a reshape of the whole sum, the GPU form of
:func:`tasc._scores.block_sums` (``benchmarks/results/gpu_model/``: the compiled program's
traffic). On an NVIDIA H200 XLA's passes, in the CPU's form then, compressed faster than a
Pallas (Triton) kernel of the one pass did, with no scratch buffer where the kernel needed a
full one (the measurement: ``benchmarks/results/gpu/``), so no GPU kernel is kept.

The kernel is chosen where each call is traced: one that cannot be traced in that context
(inside ``shard_map``, under ``vmap``, for another platform) is reported once, as a warning, and
the XLA version takes its place, so a kernel never stops a training step. Both versions give the
same ``a`` bit for bit; the energies differ by float rounding (the kernel sums each block in its
own order, XLA in its own), which can only swap blocks whose scores tie to rounding. The kernel
serves runs whose default backend is the CPU (``lax.platform_dependent``: a program compiled for
another platform takes the XLA version); for other dtypes, or where it is unavailable, the XLA
version runs. ``TASC_ONE_PASS=0`` in the environment switches the kernel off (to compare, or to
rule it out).

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

SOURCE = pathlib.Path(__file__).with_name("residual_energies.cc")
_TARGET = "tasc_residual_energies"
_SYMBOL = "TascResidualEnergies"


def residual_and_energies(g: jax.Array, e: jax.Array, block_size: int, *,
                          one_pass: bool = True) -> tuple[jax.Array, jax.Array]:
  """``(a, energies)``: ``a = g + e`` and ``||a_b||^2`` of each block of ``block_size``.

  On CPU, one pass that writes ``a`` over ``e``'s buffer (the module docstring); otherwise
  XLA's ``g + e`` and :func:`tasc.scores.block_energies` (one fused pass on GPUs). A kernel that
  cannot be traced where this is called (inside ``shard_map``, under ``vmap``, for another
  platform) is reported once, as a warning, and XLA's version runs: it never stops a step.

  Args:
    g: a flat buffer (the gradient).
    e: the residual, shaped and typed like ``g``.
    block_size: ``B``; the last block is shorter when ``B`` does not divide the size.
    one_pass: False takes XLA's two passes. The kernel writes over ``e``, which costs nothing
      when ``e`` is a buffer the step made or a flat argument of the jit, but when ``e`` is an
      argument seen through a reshape (per-worker state under ``shard_map``, see
      :func:`compressors.drop_device_axis`) XLA's CPU backend copies it in and out: there the
      two passes, which XLA fuses in place, are cheaper.

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
  (``lax.platform_dependent``'s names) whose programs call them: the CPU kernel where the CPU is
  the default backend and it builds; empty elsewhere or with ``TASC_ONE_PASS=0`` (XLA's two
  passes everywhere, e.g. to compare)."""
  if os.environ.get("TASC_ONE_PASS", "1") == "0" or jax.default_backend() != "cpu":
    return {}
  return {"cpu": functools.partial(_one_pass, block_size=block_size)} if kernel_available() else {}


def one_pass_available(block_size: int) -> bool:
  """Whether TASC's compression takes the block energies in the pass that writes ``g + e``.

  Args:
    block_size: ``B``, TASC's block size.

  Returns:
    True when :func:`residual_and_energies` makes one pass on the default backend at
    ``block_size`` (float32 buffers it owns, in a context where the kernel traces); False where
    XLA's passes run instead: another default backend than the CPU, a kernel that could not be
    built, or ``TASC_ONE_PASS=0``.
  """
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


def _two_passes(g: jax.Array, e: jax.Array, *, block_size: int) -> tuple[jax.Array, jax.Array]:
  a = g + e
  return a, scores.block_energies(a, block_size)
